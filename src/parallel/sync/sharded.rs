//! ZeRO stage 3 (fully sharded data parallelism) for one block: each rank of the block's
//! data-parallel group keeps only its range of the block's flat trainable parameters
//! ([`owned_range`], ZERO-1), the optimizer state of that range and, after the reduction,
//! the gradient of that range. The full parameters exist only between a gather (an
//! all-gather of the shards: [`start_gather`](GradientSync::start_gather)'s collective, run
//! wherever the executor runs it, possibly ahead of the use, then
//! [`finish_gather`](GradientSync::finish_gather)) and the next
//! [`release`](GradientSync::release).
//!
//! Invariants (tested in `tests/suite/fsdp.rs`):
//! - FSDP-1: between uses a rank holds `owned_range` of the block's parameters only; the
//!   module's trainable parameters are empty tensors then.
//! - FSDP-2: every rank of the group gathers, reduces and steps a block at the same point
//!   of the same list, so the collectives pair up; a rank that never arrives is the
//!   communicator's typed time-out.
//! - FSDP-3: the update is [`FlatRule`]'s on the shard (ZERO-2's arithmetic), so a ZeRO-3
//!   step equals one device's step element for element.
//! - Here CKPT-10 (`checkpoint`, with `tests/suite/fsdp.rs`) means: a snapshot holds this
//!   rank's parameter part and
//!   optimizer part only; a restore puts every rank's parameter parts together and keeps this
//!   rank's range of them for the restoring group, the optimizer parts re-sharded alike.

use std::collections::HashSet;
use std::ops::Range;
use std::time::Instant;

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::Module;
use burn::optim::GradientsParams;

use super::{
    Collective, GradientSync, HeldBytes, Reduced, ReducedGrads, SyncContext, SyncError,
    lr_segments, restore_flat, restore_shard, shard_state, sum_of_squares,
};
use crate::checkpoint::{CheckpointError, OptimizerState, ParamPart, ShardParams, snapshot_module};
use crate::comm::ReduceOp;
use crate::parallel::gradients::{
    GradientBuffers, ParamLayout, release_trainable, set_trainable, trainable_range,
};
use crate::parallel::zero::{FlatRule, OptimizerShard, owned_range};
use crate::trace::TraceKind;

/// One block's ZeRO-3 state on one rank.
pub(crate) struct ShardedSync {
    layout: ParamLayout,
    /// This rank's range of the flat parameters; `None` until the first gather, which takes
    /// it from the full module every replica was built with.
    params: Option<Vec<f32>>,
    shard: OptimizerShard,
    /// Whether the module holds its full parameters now.
    full: bool,
    held: HeldBytes,
}

impl std::fmt::Debug for ShardedSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardedSync(owns {:?})", self.shard.range)
    }
}

impl ShardedSync {
    pub(super) fn new(rule: FlatRule, layout: ParamLayout) -> Self {
        let len = layout.len();
        Self {
            shard: OptimizerShard::fresh(rule, len, 1, 0),
            params: None,
            layout,
            full: true,
            held: HeldBytes {
                params: 4 * len as u64,
                owned: (0, len as u64),
                ..HeldBytes::default()
            },
        }
    }

    /// This rank's range in the context's group; the first call (the module still full)
    /// takes the shard of the parameters and a fresh optimizer shard for it.
    fn owned<M: Module>(
        &mut self,
        model: &M,
        cx: &SyncContext<'_>,
    ) -> Result<Range<usize>, SyncError> {
        self.owned_as(model, cx.rank(), cx.world())
    }

    fn owned_as<M: Module>(
        &mut self,
        model: &M,
        rank: usize,
        world: usize,
    ) -> Result<Range<usize>, SyncError> {
        let want = owned_range(self.layout.len(), world, rank);
        if self.params.is_none() {
            debug_assert!(self.full, "a module is full until its first release");
            self.params = Some(trainable_range(model, &self.layout, want.clone()));
            if self.shard.range != want && self.shard.state.steps == 0 {
                self.shard = OptimizerShard::fresh(self.shard.rule, self.layout.len(), world, rank);
            }
        }
        if self.shard.range != want {
            return Err(SyncError::NotResharded {
                have: self.shard.range.clone(),
                want,
                rank,
                world,
            });
        }
        self.held.params = 4 * want.len() as u64;
        self.held.owned = (want.start as u64, want.end as u64);
        Ok(want)
    }
}

impl<M: Module> GradientSync<M> for ShardedSync {
    fn start_gather(
        &mut self,
        model: &M,
        (rank, world): (usize, usize),
    ) -> Result<Option<Collective>, SyncError> {
        self.owned_as(model, rank, world)?;
        let shard = self.params.as_deref().expect("set by `owned_as`");
        Ok(Some(Collective::AllGather {
            shard: shard.to_vec(),
            len: self.layout.len(),
        }))
    }

    fn finish_gather(&mut self, model: M, full: Vec<f32>) -> M {
        self.full = true;
        set_trainable(model, &self.layout, &full)
    }

    fn shard(&mut self, model: M, rank: usize, world: usize) -> M {
        match self.owned_as(&model, rank, world) {
            Ok(_) => <Self as GradientSync<M>>::release(self, model),
            // A shard already taken for another group stays; the first gather reports it.
            Err(_) => model,
        }
    }

    fn release(&mut self, model: M) -> M {
        if !self.full || self.params.is_none() {
            // Never gathered yet: the module is the replica's starting record; the first
            // gather takes its shard from it.
            return model;
        }
        self.full = false;
        release_trainable(model)
    }

    fn holds_full(&self) -> bool {
        self.full
    }

    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError> {
        let rank_of = (cx.rank(), cx.world());
        let t = Instant::now();
        let collective = <Self as GradientSync<M>>::start_reduce(self, model, grads, rank_of)?;
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        let (out, span) = collective.run(cx.comm.as_deref_mut());
        cx.spans.extend(span);
        let mut reduced = <Self as GradientSync<M>>::finish_reduce(self, out?, cx.scale, rank_of)?;
        if let (Some(max), ReducedGrads::Shard(shard)) = (cx.clip, &reduced.grads) {
            // The global norm from the shards: every rank's sum of squares, all-reduced.
            let mut sum = [sum_of_squares(std::iter::once(&shard[..])) as f32];
            if let Some(comm) = cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
                comm.all_reduce(&mut sum, ReduceOp::Sum)?;
            }
            reduced.clip_to(f64::from(sum[0]).sqrt() as f32, max);
        }
        Ok(reduced)
    }

    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        (rank, world): (usize, usize),
    ) -> Result<Collective, SyncError> {
        let range = self.owned_as(model, rank, world)?;
        let flat = GradientBuffers::take(model, &self.layout, grads).into_flat();
        self.held.grads_backward = 4 * self.layout.len() as u64;
        Ok(Collective::ReduceScatter {
            flat,
            out: range.len(),
            wire: crate::precision::Precision::F32,
        })
    }

    fn finish_reduce(
        &mut self,
        mut shard: Vec<f32>,
        scale: f32,
        _rank_of: (usize, usize),
    ) -> Result<Reduced, SyncError> {
        self.held.grads = 4 * shard.len() as u64;
        if scale != 1.0 {
            shard.iter_mut().for_each(|g| *g *= scale);
        }
        Ok(Reduced {
            grads: ReducedGrads::Shard(shard),
            non_finite: false,
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
            unreachable!("ShardedSync reduces shards")
        };
        let range = match self.owned(&model, cx) {
            Ok(r) => r,
            Err(e) => return Err((model, e)),
        };
        let segments = lr_segments(&self.layout, &range, &lr);
        let t = Instant::now();
        let values = self.params.as_mut().expect("set by `owned`");
        self.shard
            .rule
            .step(&mut self.shard.state, values, &grads, &segments);
        cx.spans.push((TraceKind::OptimizerStep, t, t.elapsed()));
        self.held.optimizer = self.shard.state.bytes() as u64;
        // The module's copy, if any, is stale now: the next use gathers the new shards.
        Ok(<Self as GradientSync<M>>::release(self, model))
    }

    fn snapshot_params(&self, model: &M) -> ShardParams {
        // CKPT-10: this rank's part only, the other float parameters (buffers) by name.
        let trainable: HashSet<u64> = self.layout.slots().iter().map(|s| s.id.val()).collect();
        let named = snapshot_module(model)
            .params()
            .iter()
            .filter(|p| !trainable.contains(&p.id))
            .cloned()
            .collect();
        let (range, values) = match &self.params {
            Some(values) => (self.shard.range.clone(), values.clone()),
            // Never sharded yet: the module holds the replica's starting record.
            None => {
                let all = 0..self.layout.len();
                (all.clone(), trainable_range(model, &self.layout, all))
            }
        };
        ShardParams::with_part(
            ShardParams::from_params(named),
            ParamPart {
                range: range.start as u64..range.end as u64,
                total: self.layout.len() as u64,
                values,
            },
        )
    }

    fn restore_params(
        &mut self,
        model: M,
        params: &ShardParams,
        rank: usize,
        world: usize,
    ) -> Result<M, CheckpointError> {
        if !params.has_parts() {
            return Err(CheckpointError::ParameterParts {
                reason: "the checkpoint holds this block's whole parameters by name (written \
                         without zero(Three)); a zero(Three) job resumes only its own kind of \
                         checkpoint"
                    .into(),
            });
        }
        let (model, flat) = restore_flat(model, &self.layout, params)?;
        let flat = flat.expect("parts were checked present");
        // CKPT-10: re-sharded onto this group: this rank keeps its range of the whole.
        let want = owned_range(self.layout.len(), world, rank);
        self.params = Some(flat[want.clone()].to_vec());
        if self.shard.range != want {
            self.shard = OptimizerShard::fresh(self.shard.rule, self.layout.len(), world, rank);
        }
        self.held.params = 4 * want.len() as u64;
        self.held.owned = (want.start as u64, want.end as u64);
        self.full = true;
        Ok(<Self as GradientSync<M>>::release(self, model))
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        shard_state(&self.shard)
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<(), CheckpointError> {
        let (shard, _) = restore_shard(state, &self.shard, self.layout.len(), rank, world)?;
        self.shard = shard;
        Ok(())
    }

    fn held(&self) -> HeldBytes {
        let mut held = self.held;
        held.optimizer = self.shard.state.bytes() as u64;
        held
    }
}
