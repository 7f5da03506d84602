//! ZeRO stage 1 or 2 (`ZeroSync`): gradients reduce-scattered (stage 2, and stage 1 in block
//! jobs: `start_reduce`) or all-reduced (stage 1 in data-parallel jobs), each rank stepping
//! and keeping the optimizer state of its own range of the flat order, the updated ranges
//! all-gathered back: only the rank's range is read from the parameters, and the gathered
//! buffer becomes their data (`set_trainable_owned`).
//!
//! With a compressor (`.compression(..)` with `.zero(..)`, ZSYNC-1): at stage 1 the whole
//! gradient's all-reduce is the compressor's (any scheme: a 16-bit all-reduce, top-k's
//! all-gather, PowerSGD's factors), this rank's range of the result stepping as before; at
//! stage 2 a 16-bit scheme rounds the gradient with error feedback
//! (`Compressor::narrow_alone`) and the reduce-scatter carries it in that type. The residual
//! is this rank's own: its checkpoint part holds the ZeRO shard and the compressor's state
//! (ZSYNC-2); a restore onto the same group gives each rank its own residual back, onto
//! another group rank 0 the residuals' sum (what the group still owes, as CSYNC-2).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

use super::*;
use crate::checkpoint::OptimizerPart;
use crate::parallel::compress::{Compressor, CompressorState};

/// ZeRO stage 1 or 2: each rank keeps the optimizer state of its range of the flat order.
pub(crate) struct ZeroSync {
    pub(super) stage: ZeroStage,
    pub(super) shard: OptimizerShard,
    /// Every part of the state last restored, kept until the first step after it: the group
    /// a restored rank steps in may be rebuilt after the restore (a roll-back restores before
    /// the replacement joins), so the final re-sharding happens against the group it steps in.
    pub(super) restored: Option<Vec<OptimizerShard>>,
    pub(super) layout: ParamLayout,
    pub(super) buckets: Vec<Bucket>,
    pub(super) fusion: Vec<f32>,
    pub(super) held: HeldBytes,
    /// The compressor of the gradient's reduction (ZSYNC-1), shared with a block executor's
    /// collective while it runs; `None` reduces in `f32` (or the job's gradient wire type).
    pub(super) compressor: Option<Arc<Mutex<Compressor>>>,
    /// Every rank's compressor state last restored, with the range and total of its ZeRO
    /// part, kept (as `restored`) until the group the rank steps in is known.
    pub(super) restored_compressors: Option<Vec<SavedCompressor>>,
}

/// A rank's saved compressor state, with the range and total of its ZeRO part.
pub(crate) type SavedCompressor = (Range<usize>, usize, CompressorState);

/// A rank's checkpoint part with a compressor (ZSYNC-2): the ZeRO part's bytes as an
/// uncompressed job writes them, and the compressor's state.
#[derive(Serialize, Deserialize)]
struct CompressedShard {
    shard: Vec<u8>,
    compressor: CompressorState,
}

fn lock(c: &Mutex<Compressor>) -> MutexGuard<'_, Compressor> {
    c.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The compressor state rank `rank` of `world` resumes with from every rank's saved one
/// (`parts`: the range and total of each one's ZeRO part): its own where the checkpoint was
/// written by a group of this size, else the residuals' sum on rank 0 and nothing on the
/// others (ZSYNC-2); the step count and PowerSGD's `Q` are the same on every rank.
fn resumed_compressor(
    parts: &[SavedCompressor],
    len: usize,
    rank: usize,
    world: usize,
) -> Option<CompressorState> {
    let own = owned_range(len, world, rank);
    if parts.len() == world
        && let Some((_, _, state)) = parts
            .iter()
            .find(|(range, total, _)| *range == own && *total == len)
    {
        return Some(state.clone());
    }
    CompressorState::regrouped(parts.iter().map(|(_, _, s)| s), rank)
}

impl std::fmt::Debug for ZeroSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ZeroSync({:?}, owns {:?})", self.stage, self.shard.range)
    }
}

impl ZeroSync {
    /// This rank's range in the group the context names, re-sharding onto it if the group
    /// changed: from the state last restored, or a fresh shard if the optimizer never
    /// stepped. A stepped shard with nothing restored cannot move (its neighbours' state is
    /// elsewhere): the caller reports that.
    fn owned(&mut self, cx: &SyncContext<'_>) -> Range<usize> {
        self.owned_as(cx.rank(), cx.world())
    }

    fn owned_as(&mut self, rank: usize, world: usize) -> Range<usize> {
        let want = owned_range(self.layout.len(), world, rank);
        if want != self.shard.range {
            if let Some(parts) = &self.restored {
                if let Ok(shard) = reshard(parts, self.layout.len(), world, rank) {
                    let rule = self.shard.rule;
                    self.shard = OptimizerShard { rule, ..shard };
                }
            } else if self.shard.state.steps == 0 {
                self.shard = OptimizerShard::fresh(self.shard.rule, self.layout.len(), world, rank);
            }
            if let (Some(parts), Some(c)) = (&self.restored_compressors, &self.compressor)
                && let Some(state) = resumed_compressor(parts, self.layout.len(), rank, world)
            {
                // Validated when it was restored.
                let _ = lock(c).restore(state);
            }
        }
        self.restored = None;
        self.restored_compressors = None;
        self.shard.range.clone()
    }

    /// The collective that reduces `flat` through the compressor (ZSYNC-1), this rank's
    /// output being `out` elements at stage 2.
    fn compressed(&self, mut flat: Vec<f32>, out: usize, c: &Arc<Mutex<Compressor>>) -> Collective {
        match self.stage {
            ZeroStage::Two => {
                let wire = lock(c).narrow_alone(&mut flat).expect(
                    "build refuses ZeRO-2 with a scheme that is not 16-bit (composition::REFUSALS)",
                );
                Collective::ReduceScatter { flat, out, wire }
            }
            _ => Collective::Compressed {
                buf: flat,
                compressor: c.clone(),
            },
        }
    }
}

impl<M: Module> GradientSync<M> for ZeroSync {
    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError> {
        let range = self.owned(cx);
        if range != owned_range(self.layout.len(), cx.world(), cx.rank()) {
            return Err(SyncError::NotResharded {
                have: range,
                want: owned_range(self.layout.len(), cx.world(), cx.rank()),
                rank: cx.rank(),
                world: cx.world(),
            });
        }
        let t = Instant::now();
        let mut buffers = GradientBuffers::take(model, &self.layout, grads);
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads_backward = whole;
        self.held.owned = (range.start as u64, range.end as u64);
        let world = cx.world();
        let mut shard = match (self.stage, self.compressor.clone()) {
            (_, Some(c)) => {
                let t = Instant::now();
                let flat = buffers.into_flat();
                cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
                let collective = self.compressed(flat, range.len(), &c);
                let (out, spans) = collective.run(cx.comm.as_deref_mut());
                cx.spans.extend(spans);
                let out = out?;
                match self.stage {
                    ZeroStage::Two if world > 1 => out,
                    _ => out[range.clone()].to_vec(),
                }
            }
            (ZeroStage::Two, None) if world > 1 => {
                let t = Instant::now();
                let flat = buffers.into_flat();
                cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
                let mut shard = vec![0.0f32; range.len()];
                let comm = cx.comm.as_deref_mut().expect("world > 1 has a group");
                let t = Instant::now();
                reduce_scatter_as(comm, &flat, &mut shard, cx.precision.wire)?;
                cx.spans.push((
                    TraceKind::ReduceScatter {
                        bytes: (flat.len() * 4) as u64,
                    },
                    t,
                    t.elapsed(),
                ));
                drop(flat);
                shard
            }
            (_, None) => {
                let mut views = buffers.slices_mut();
                all_reduce_buckets(&mut views, &self.buckets, &mut self.fusion, cx)?;
                drop(views);
                let shard = cx.timed(TraceKind::Flatten, |_| buffers.copy_range(range.clone()));
                drop(buffers);
                shard
            }
        };
        self.held.grads = match self.stage {
            ZeroStage::Two => 4 * shard.len() as u64,
            _ => whole,
        };
        if cx.scale != 1.0 {
            shard.iter_mut().for_each(|g| *g *= cx.scale);
        }
        let norm = match cx.clip {
            None => None,
            Some(max) => {
                // The global norm from the shards: every rank's sum of squares, all-reduced.
                let mut sum = [sum_of_squares(std::iter::once(&shard[..])) as f32];
                if let Some(comm) = cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
                    comm.all_reduce(&mut sum, ReduceOp::Sum)?;
                }
                let norm = f64::from(sum[0]).sqrt() as f32;
                clip_to(&mut [&mut shard[..]], norm, max);
                Some(norm)
            }
        };
        let overflow = overflow_in_group(&[&shard[..]], cx.world() > 1, cx)?;
        Ok(Reduced {
            grads: ReducedGrads::Shard(shard),
            non_finite: overflow || norm.is_some_and(|n| !n.is_finite()),
        })
    }

    fn apply(
        &mut self,
        model: M,
        reduced: Reduced,
        lr: ModuleLearningRate,
        cx: &mut SyncContext<'_>,
    ) -> Result<M, (M, SyncError)> {
        let ReducedGrads::Shard(grads) = reduced.grads else {
            unreachable!("ZeroSync reduces shards")
        };
        let range = self.shard.range.clone();
        let t = Instant::now();
        let mut values = trainable_range(&model, &self.layout, range.clone());
        let segments = lr_segments(&self.layout, &range, &lr);
        self.shard
            .rule
            .step(&mut self.shard.state, &mut values, &grads, &segments);
        cx.spans.push((TraceKind::OptimizerStep, t, t.elapsed()));
        self.held.optimizer = self.shard.state.bytes() as u64;
        let flat = match cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
            Some(comm) => {
                // Fresh each step: it becomes the parameters' data (`set_trainable_owned`).
                let mut flat = vec![0.0f32; self.layout.len()];
                let t = Instant::now();
                if let Err(e) = comm.all_gather(&values, &mut flat) {
                    return Err((model, SyncError::Comm(e)));
                }
                cx.spans.push((
                    TraceKind::AllGather {
                        bytes: (flat.len() * 4) as u64,
                    },
                    t,
                    t.elapsed(),
                ));
                flat
            }
            None => values,
        };
        Ok(set_trainable_owned(model, &self.layout, flat))
    }

    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        (rank, world): (usize, usize),
    ) -> Result<Collective, SyncError> {
        let range = self.owned_as(rank, world);
        let want = owned_range(self.layout.len(), world, rank);
        if range != want {
            return Err(SyncError::NotResharded {
                have: range,
                want,
                rank,
                world,
            });
        }
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads_backward = whole;
        self.held.owned = (range.start as u64, range.end as u64);
        let flat = GradientBuffers::take(model, &self.layout, grads).into_flat();
        if let Some(c) = &self.compressor {
            return Ok(self.compressed(flat, range.len(), c));
        }
        // Both stages reduce-scatter here: a block's reduction runs beside the backward of
        // the blocks before it and its gradient buffer is the block's own, so stage 1 has no
        // whole reduced gradient to keep; only the shard is stepped.
        Ok(match self.stage {
            ZeroStage::One | ZeroStage::Two if world > 1 => Collective::ReduceScatter {
                flat,
                out: range.len(),
                wire: crate::precision::Precision::F32,
            },
            _ => Collective::AllReduce {
                buf: flat,
                buckets: bucket_ranges(&self.buckets, &self.layout),
                wire: crate::precision::Precision::F32,
            },
        })
    }

    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        (rank, world): (usize, usize),
    ) -> Result<Reduced, SyncError> {
        let range = owned_range(self.layout.len(), world, rank);
        // Reduce-scattered to the shard (`start_reduce`); a compressor's all-reduce at stage 1,
        // or a rank alone, gives the whole buffer back.
        self.held.grads = 4 * out.len() as u64;
        let mut shard = if out.len() == range.len() {
            out
        } else {
            out[range].to_vec()
        };
        if scale != 1.0 {
            shard.iter_mut().for_each(|g| *g *= scale);
        }
        Ok(Reduced {
            grads: ReducedGrads::Shard(shard),
            non_finite: false,
        })
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        let plain = shard_state(&self.shard)?;
        let Some(c) = &self.compressor else {
            return Ok(plain);
        };
        let mut parts = plain
            .parts()
            .map(<[OptimizerPart]>::to_vec)
            .unwrap_or_default();
        for p in &mut parts {
            let saved = CompressedShard {
                shard: std::mem::take(&mut p.bytes),
                compressor: lock(c).state(),
            };
            p.bytes = bincode::serde::encode_to_vec(&saved, bincode::config::standard()).map_err(
                |e| CheckpointError::Optimizer {
                    reason: format!("encoding the compression state: {e}"),
                },
            )?;
        }
        Ok(OptimizerState::from_parts(parts))
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<(), CheckpointError> {
        let len = self.layout.len();
        let (plain, compressors) = match (&self.compressor, state.parts()) {
            (Some(_), Some(parts)) => split_compressed(parts)?,
            _ => (state.clone(), None),
        };
        let (shard, decoded) = restore_shard(&plain, &self.shard, len, rank, world)?;
        if let Some(c) = &self.compressor {
            let scheme = lock(c).scheme();
            let resumed = compressors
                .as_deref()
                .and_then(|parts| resumed_compressor(parts, len, rank, world));
            match resumed {
                Some(s) => lock(c).restore(s).map_err(|e| CheckpointError::Optimizer {
                    reason: e.to_string(),
                })?,
                // Written without compression: a fresh compressor.
                None => *lock(c) = Compressor::new(scheme, &shapes_of(&self.layout)),
            }
        }
        self.shard = shard;
        self.restored = Some(decoded);
        self.restored_compressors = compressors;
        Ok(())
    }

    fn held(&self) -> HeldBytes {
        let mut held = self.held;
        held.optimizer = self.shard.state.bytes() as u64
            + self
                .compressor
                .as_ref()
                .map_or(0, |c| 4 * lock(c).state_words() as u64);
        held
    }
}

/// The shapes of the trainable parameters, in the flat order (a compressor's layout).
pub(super) fn shapes_of(layout: &ParamLayout) -> Vec<Vec<usize>> {
    layout
        .slots()
        .iter()
        .map(|s| s.shape.as_slice().to_vec())
        .collect()
}

/// A compressed ZeRO job's parts as the plain ZeRO parts and every rank's compressor state
/// (ZSYNC-2); parts written without compression come back as they are, with `None`.
fn split_compressed(
    parts: &[OptimizerPart],
) -> Result<(OptimizerState, Option<Vec<SavedCompressor>>), CheckpointError> {
    let decode = |p: &OptimizerPart| -> Option<CompressedShard> {
        let (saved, used) = bincode::serde::decode_from_slice::<CompressedShard, _>(
            &p.bytes,
            bincode::config::standard(),
        )
        .ok()?;
        let inner = bincode::serde::decode_from_slice::<OptimizerShard, _>(
            &saved.shard,
            bincode::config::standard(),
        )
        .ok()?;
        (used == p.bytes.len() && inner.1 == saved.shard.len()).then_some(saved)
    };
    let decoded: Vec<Option<CompressedShard>> = parts.iter().map(decode).collect();
    if decoded.iter().all(Option::is_none) {
        return Ok((OptimizerState::from_parts(parts.to_vec()), None));
    }
    let mut plain = Vec::with_capacity(parts.len());
    let mut states = Vec::with_capacity(parts.len());
    for (p, d) in parts.iter().zip(decoded) {
        let Some(saved) = d else {
            return Err(CheckpointError::Optimizer {
                reason: format!(
                    "the ZeRO part {:?} of {} holds no compression state while others do",
                    p.range, p.total
                ),
            });
        };
        states.push((
            p.range.start as usize..p.range.end as usize,
            p.total as usize,
            saved.compressor,
        ));
        plain.push(OptimizerPart {
            bytes: saved.shard,
            ..p.clone()
        });
    }
    Ok((OptimizerState::from_parts(plain), Some(states)))
}
