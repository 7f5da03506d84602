//! Bytes per device as the workers count them (MEM-1): a stage's parameters, gradients,
//! optimizer state and stash, ZeRO-1/2's gradients and ZeRO-3's gathered parameters walked
//! through the stage's own instructions.

use super::{Candidate, ModelCosts, PredictedBytes};
use crate::parallel::pipeline::{InstrKind, PipelineSchedule, StageIndex};

/// The bytes a rank of stage `s` holds (MEM-1): `held` parameter elements, its blocks'
/// boundary tensors for `per_chunk` samples' worth of each stashed chunk, `stash` chunks at
/// the peak; ZeRO-3's gathered parameters and ZeRO-1/2's gradients from [`walk_stage`].
pub(super) fn stage_bytes(
    model: &ModelCosts,
    layout: &Candidate,
    schedule: &PipelineSchedule,
    (s, held): (usize, u64),
    per_chunk: f64,
    stash: Option<&u32>,
) -> PredictedBytes {
    let (dp, pp, tp, zero) = (layout.dp, layout.pp as usize, layout.tp, layout.zero);
    let shard = |bytes: u64, from: u8| {
        if zero >= from {
            bytes.div_ceil(u64::from(dp))
        } else {
            bytes
        }
    };
    let mine = || {
        model
            .blocks
            .iter()
            .enumerate()
            .filter(move |(b, _)| b % pp == s)
            .map(|(_, blk)| blk)
    };
    let walked = walk_stage(model, layout, schedule, s);
    let params = if zero >= 3 {
        // With recomputation the block computing and the one gathered ahead are whole (MEM-3);
        // without, every block keeps the parameters of each forward until its backward.
        let largest = mine().filter_map(|b| b.params_at(tp)).max().unwrap_or(0);
        let whole = if layout.recompute {
            4 * 2 * largest
        } else {
            walked.full_params
        };
        whole + shard(4 * held, 3)
    } else {
        4 * held
    };
    let stash_per_sample: u64 = mine()
        .map(|b| {
            if layout.recompute {
                b.recompute_stash_bytes
            } else {
                b.stash_bytes
            }
        })
        .sum();
    let activations =
        stash_per_sample as f64 * per_chunk * f64::from(stash.copied().unwrap_or(1).max(1));
    PredictedBytes {
        params,
        // A block job reduce-scatters each block's gradient at stage 1 as at stage 2.
        grads: if zero >= 1 { walked.grads } else { 4 * held },
        optimizer: shard(8 * held, 1),
        activations: activations.round() as u64,
    }
}

/// The peaks of one stage's step, walked instruction by instruction as the worker counts
/// them (MEM-2).
#[derive(Debug, Default)]
struct Walked {
    /// Gathered parameters kept for pending backwards (ZeRO-3 without recomputation): a
    /// block's whole parameters once for every micro-batch forwarded and not yet backwarded.
    full_params: u64,
    /// Gradients with ZeRO-1 or 2 on: a block's whole gradient from its first backward until its
    /// last micro-batch's backward is done (then its reduction takes it to a shard); blocks
    /// not yet reached hold none.
    grads: u64,
}

fn walk_stage(
    model: &ModelCosts,
    layout: &Candidate,
    schedule: &PipelineSchedule,
    s: usize,
) -> Walked {
    let blocks = model.blocks.len();
    let whole: Vec<u64> = model
        .blocks
        .iter()
        .map(|b| 4 * b.params_at(layout.tp).unwrap_or(0))
        .collect();
    let part = |b: usize| whole[b].div_ceil(u64::from(layout.dp.max(1)));
    let mut pending = vec![0u64; blocks];
    let mut backwards = vec![0u32; blocks];
    let mut out = Walked::default();
    let stage = StageIndex(s as u32);
    for instr in schedule.list(stage) {
        let b = schedule.block(stage, instr.chunk()) as usize;
        if b >= blocks {
            continue;
        }
        match instr.kind() {
            InstrKind::Forward => pending[b] += 1,
            InstrKind::Backward => backwards[b] += 1,
            _ => continue,
        }
        let full: u64 = (0..blocks).map(|k| whole[k] * pending[k]).sum();
        out.full_params = out.full_params.max(full);
        let grads: u64 = (0..blocks)
            .map(|k| match backwards[k] {
                0 => 0,
                n if n >= layout.micro_batches && k != b => part(k),
                _ => whole[k],
            })
            .sum();
        out.grads = out.grads.max(grads);
        if instr.kind() == InstrKind::Backward {
            pending[b] = pending[b].saturating_sub(1);
        }
    }
    out
}
