//! `LocalSync`: the device side of [`crate::parallel::local`] (local SGD, DiLoCo, EASGD).
//! `reduce` exchanges nothing: it rescales the rank's gradient from its share of the global
//! batch to its own mean (`SyncContext::share`) and clips it locally; `apply` steps the
//! rank's own Burn optimizer (the inner optimizer: the job's), counts the applied step and,
//! every `every` of them (LOCAL-1), all-reduces the strategy's flat contribution in buckets
//! and applies its rule to the parameters and the replicated outer state (LOCAL-2).
//!
//! Invariants (tested in `tests/suite/local_updates.rs`):
//! - LOCAL-4 rank state in checkpoints: between synchronisations the ranks' parameters and
//!   inner optimizer states differ, so each rank's snapshot holds, as its optimizer part
//!   (`rank..rank + 1` of `world`), its applied-step count, its inner optimizer state, its own
//!   trainable parameters and the outer state; a restore takes its own part back (onto the
//!   same group size only), so a resumed run equals the uninterrupted one bit for bit
//!   wherever the checkpoint was taken. The job's strategy says its state is not replicated:
//!   checkpoints gather every rank and a lost rank rolls back (never dropped).
//! - LOCAL-5 no gradient collective: the only collectives of a step are the losses'
//!   all-reduce every data-parallel step has (DP-3) and, on a synchronisation step, the
//!   parameter all-reduce, recorded as `AllReduce` spans (one per bucket).
//! - LOCAL-6 in block and pipeline jobs each block has its own `LocalSync`: its split
//!   reduction is `Collective::Local` (no exchange), `finish_reduce` rescales the block
//!   executor's group mean to the rank's own, and `apply` meets the block's data-parallel
//!   group every `every` steps; the block's checkpoint part is the rank's own state, as
//!   LOCAL-4 (tested in `tests/suite/tensor_parallel.rs`).

use std::ops::Range;
use std::time::Instant;

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};

use super::{
    Collective, GradientSync, HeldBytes, Reduced, ReducedGrads, SyncContext, SyncError,
    clip_by_global_norm, rank_part, with_flat_and_named,
};
use crate::checkpoint::{CheckpointError, OptimizerState, ShardParams, snapshot_module};
use crate::comm::ReduceOp;
use crate::parallel::buckets::Bucket;
use crate::parallel::gradients::{
    GradientBuffers, ParamLayout, bucket_ranges, set_trainable, trainable_range,
};
use crate::parallel::local::{LocalUpdates, OuterState};
use crate::trace::TraceKind;

/// One rank of a job that synchronises every `every` steps.
pub(crate) struct LocalSync {
    updates: LocalUpdates,
    /// The inner optimizer (the job's), on this rank's own parameters.
    optimizer: ModuleOptimizer,
    /// The `f32` words of state Burn's optimizer keeps per parameter element once stepped.
    words: usize,
    layout: ParamLayout,
    buckets: Vec<Bucket>,
    /// Applied steps so far (LOCAL-1).
    applied: u64,
    outer: OuterState,
    /// This rank's place in its group, as of the last step (names its checkpoint part).
    rank_of: (usize, usize),
    /// A restored snapshot whose part for this rank could not be chosen yet: a roll-back
    /// restores a replacement before it joins its group, so it is placed at the first step
    /// (`settle`), when the rank knows its place.
    pending: Option<(ShardParams, OptimizerState)>,
    held: HeldBytes,
}

/// A rank's checkpoint part (LOCAL-4).
#[derive(serde::Serialize, serde::Deserialize)]
struct RankState {
    applied: u64,
    /// Burn's bytes of the inner optimizer's state.
    inner: Vec<u8>,
    /// The rank's own trainable parameters, flat.
    params: Vec<f32>,
    outer: OuterState,
}

impl std::fmt::Debug for LocalSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalSync({}, {} applied)", self.updates, self.applied)
    }
}

impl LocalSync {
    pub(super) fn new(
        updates: LocalUpdates,
        optimizer: ModuleOptimizer,
        words: usize,
        layout: ParamLayout,
        buckets: Vec<Bucket>,
        rank_of: (usize, usize),
    ) -> Self {
        Self {
            updates,
            optimizer,
            words,
            layout,
            buckets,
            applied: 0,
            outer: OuterState::default(),
            rank_of,
            pending: None,
            held: HeldBytes::default(),
        }
    }

    /// `model` with rank `rank`'s state from a snapshot's parameters and parts (LOCAL-4): its
    /// own trainable parameters (keeping `model`'s parameter ids, which the layout and its
    /// own inner optimizer state are keyed by), the other float parameters (buffers) by name.
    fn place<M: Module>(
        &mut self,
        model: M,
        named: &ShardParams,
        state: RankState,
    ) -> Result<M, CheckpointError> {
        let model = with_flat_and_named(model, &self.layout, &state.params, named)?;
        // The model keeps its own ids (the layout's); the inner state is keyed by the ids the
        // checkpoint's model had, which another process drew differently: matched by name.
        let current = snapshot_module(&model);
        let ids: std::collections::HashMap<&str, u64> = current
            .params()
            .iter()
            .map(|p| (p.name.as_str(), p.id))
            .collect();
        let map: std::collections::HashMap<u64, u64> = named
            .named()
            .filter_map(|p| ids.get(p.name.as_str()).map(|&new| (p.id, new)))
            .filter(|(old, new)| old != new)
            .collect();
        let inner = OptimizerState::from_bytes(state.inner).with_param_ids(&map)?;
        self.optimizer = inner.restore(self.optimizer.clone())?;
        self.applied = state.applied;
        self.outer = state.outer;
        Ok(model)
    }

    fn all(&self) -> Range<usize> {
        0..self.layout.len()
    }

    /// A step begins, as rank `rank_of` of the group: what the rank holds, and the outer
    /// state's anchor at the first step.
    fn begin<M: Module>(&mut self, model: &M, rank_of: (usize, usize)) {
        self.rank_of = rank_of;
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads = whole;
        self.held.grads_backward = whole;
        self.held.owned = (0, self.layout.len() as u64);
        if self.updates.has_outer_state() && self.outer.anchor.is_empty() {
            // LOCAL-2: every rank starts from rank 0's broadcast parameters (a block job's
            // replicas are built from the same records).
            let start = trainable_range(model, &self.layout, self.all());
            self.outer.start(&self.updates, &start);
        }
    }

    /// The synchronisation after an applied step: the contribution all-reduced in buckets,
    /// then the rule (LOCAL-1, LOCAL-2).
    fn synchronise<M: Module>(
        &mut self,
        model: M,
        cx: &mut SyncContext<'_>,
    ) -> Result<M, (M, SyncError)> {
        let t = Instant::now();
        let mut params = trainable_range(&model, &self.layout, self.all());
        let mut sum = self.updates.contribution(&params, &self.outer);
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        let world = cx.world();
        if let Some(comm) = cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
            for b in bucket_ranges(&self.buckets, &self.layout) {
                let t = Instant::now();
                if let Err(e) = comm.all_reduce(&mut sum[b.clone()], ReduceOp::Sum) {
                    return Err((model, SyncError::Comm(e)));
                }
                cx.spans.push((
                    TraceKind::AllReduce {
                        bytes: 4 * b.len() as u64,
                    },
                    t,
                    t.elapsed(),
                ));
            }
        }
        let t = Instant::now();
        self.updates
            .after_sync(&mut params, &mut self.outer, &sum, world);
        let model = set_trainable(model, &self.layout, &params);
        cx.spans.push((TraceKind::OptimizerStep, t, t.elapsed()));
        Ok(model)
    }

    fn encode(&self, params: Vec<f32>) -> Result<OptimizerState, CheckpointError> {
        let inner = OptimizerState::capture(&self.optimizer)?
            .whole_bytes()
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        let state = RankState {
            applied: self.applied,
            inner,
            params,
            outer: self.outer.clone(),
        };
        let bytes =
            bincode::serde::encode_to_vec(&state, bincode::config::standard()).map_err(|e| {
                CheckpointError::Optimizer {
                    reason: format!("encoding the {} rank state: {e}", self.updates.name()),
                }
            })?;
        Ok(rank_part(bytes, self.rank_of))
    }

    /// This rank's part of `state` (LOCAL-4), decoded.
    fn decode(
        &self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<RankState, CheckpointError> {
        let name = self.updates.name();
        let Some(parts) = state.parts() else {
            return Err(CheckpointError::Optimizer {
                reason: format!(
                    "the checkpoint holds a whole-model optimizer state (written without local \
                     updates); a {name} job resumes only its own kind of checkpoint"
                ),
            });
        };
        let part = parts
            .iter()
            .find(|p| p.total == world as u64 && p.range == (rank as u64..rank as u64 + 1))
            .ok_or_else(|| CheckpointError::Optimizer {
                reason: format!(
                    "no {name} state for rank {rank} of {world} (the checkpoint has {} \
                     part(s) of {}): {name} resumes onto the same number of replicas only",
                    parts.len(),
                    parts.first().map_or(0, |p| p.total)
                ),
            })?;
        let (state, used) = bincode::serde::decode_from_slice::<RankState, _>(
            &part.bytes,
            bincode::config::standard(),
        )
        .map_err(|e| CheckpointError::Optimizer {
            reason: format!("a {name} rank state does not decode: {e}"),
        })?;
        let len = self.layout.len();
        let outer_ok = !self.updates.has_outer_state() || state.outer.anchor.len() == len;
        if used != part.bytes.len() || state.params.len() != len || !outer_ok {
            return Err(CheckpointError::Optimizer {
                reason: format!(
                    "a {name} rank state holds {} parameters where the model has {len}",
                    state.params.len()
                ),
            });
        }
        Ok(state)
    }
}

impl<M: Module> GradientSync<M> for LocalSync {
    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError> {
        self.begin(model, (cx.rank(), cx.world()));
        // The gradient arrives weighted by the rank's share of the global batch (DP-2); a
        // rank stepping alone steps on its own mean.
        let share = if cx.share > 0.0 { cx.share } else { 1.0 };
        let scale = cx.scale / share;
        if cx.direct && scale == 1.0 {
            return Ok(Reduced {
                grads: ReducedGrads::Whole(grads),
                non_finite: false,
            });
        }
        let t = Instant::now();
        let mut buffers = GradientBuffers::take(model, &self.layout, grads);
        let mut views = buffers.slices_mut();
        if scale != 1.0 {
            for v in views.iter_mut() {
                v.iter_mut().for_each(|g| *g *= scale);
            }
        }
        // Clipping is this rank's own gradient's norm: there is no group gradient.
        let norm = cx.clip.map(|max| clip_by_global_norm(&mut views, max));
        drop(views);
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        Ok(Reduced {
            grads: ReducedGrads::Buffers(buffers),
            non_finite: norm.is_some_and(|n| !n.is_finite()),
        })
    }

    fn apply(
        &mut self,
        model: M,
        reduced: Reduced,
        lr: ModuleLearningRate,
        cx: &mut SyncContext<'_>,
    ) -> Result<M, (M, SyncError)> {
        let grads = match reduced.grads {
            ReducedGrads::Whole(grads) => grads,
            ReducedGrads::Buffers(buffers) => cx.timed(TraceKind::Flatten, |cx| {
                buffers.into_gradients(&model, cx.device)
            }),
            ReducedGrads::Flat(_) | ReducedGrads::Shard(_) => {
                unreachable!("LocalSync reduces into buffers")
            }
        };
        let model = cx.timed(TraceKind::OptimizerStep, |_| {
            self.optimizer.step(lr, model, grads)
        });
        self.applied += 1;
        if self.updates.syncs_after(self.applied) {
            self.synchronise(model, cx)
        } else {
            Ok(model)
        }
    }

    fn snapshot_state(&self, model: &M) -> Result<(ShardParams, OptimizerState), CheckpointError> {
        if let Some((params, optimizer)) = &self.pending {
            // Restored and not placed yet: the restored state is still the state.
            return Ok((params.clone(), optimizer.clone()));
        }
        let params = trainable_range(model, &self.layout, self.all());
        Ok((snapshot_module(model), self.encode(params)?))
    }

    fn restore_state(
        &mut self,
        model: M,
        params: &ShardParams,
        optimizer: Option<&OptimizerState>,
        rank: usize,
        world: usize,
    ) -> Result<M, CheckpointError> {
        let Some(optimizer) = optimizer else {
            return Err(CheckpointError::Optimizer {
                reason: format!(
                    "the checkpoint holds no optimizer state; a {} job needs every rank's state",
                    self.updates.name()
                ),
            });
        };
        let total = optimizer.parts().and_then(|p| p.first()).map(|p| p.total);
        if total.is_some_and(|t| t != world as u64) {
            // Not in its group yet (a replacement during a roll-back): placed at its first
            // step, or refused there if the group is not the checkpoint's size.
            self.pending = Some((params.clone(), optimizer.clone()));
            return Ok(model);
        }
        let state = self.decode(optimizer, rank, world)?;
        self.pending = None;
        self.rank_of = (rank, world);
        self.place(model, params, state)
    }

    fn settle(
        &mut self,
        model: &M,
        rank: usize,
        world: usize,
    ) -> Result<Option<M>, CheckpointError> {
        let Some((params, optimizer)) = self.pending.take() else {
            return Ok(None);
        };
        let state = self.decode(&optimizer, rank, world)?;
        self.rank_of = (rank, world);
        self.place(model.clone(), &params, state).map(Some)
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        Err(CheckpointError::Optimizer {
            reason: format!(
                "a {} rank's state is taken with its parameters (snapshot_state)",
                self.updates.name()
            ),
        })
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<(), CheckpointError> {
        // Without the model only the optimizer and outer state can be taken; the caller
        // restores the parameters through `restore_state`.
        let state = self.decode(state, rank, world)?;
        self.optimizer = OptimizerState::from_bytes(state.inner).restore(self.optimizer.clone())?;
        self.applied = state.applied;
        self.outer = state.outer;
        self.pending = None;
        Ok(())
    }

    fn held(&self) -> HeldBytes {
        let mut held = self.held;
        let outer = 4 * (self.outer.anchor.len() + self.outer.momentum.len()) as u64;
        held.optimizer = if held.params > 0 {
            self.words as u64 * held.params
        } else {
            0
        } + outer;
        held
    }

    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        rank_of: (usize, usize),
    ) -> Result<Collective, SyncError> {
        self.begin(model, rank_of);
        Ok(Collective::Local {
            buf: GradientBuffers::take(model, &self.layout, grads).into_flat(),
        })
    }

    /// A block executor's `scale` turns the group's sum into its mean (1 / (micro-batches ×
    /// world)); a rank stepping alone steps on its own mean, `world` times that (LOCAL-6).
    fn finish_reduce(
        &mut self,
        mut out: Vec<f32>,
        scale: f32,
        (_, world): (usize, usize),
    ) -> Result<Reduced, SyncError> {
        let own = scale * world as f32;
        if own != 1.0 {
            out.iter_mut().for_each(|g| *g *= own);
        }
        Ok(Reduced {
            grads: ReducedGrads::Buffers(GradientBuffers::from_flat(&self.layout, out)),
            non_finite: false,
        })
    }
}
