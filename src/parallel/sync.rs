//! Gradient synchronisation: the one seam through which a data-parallel replica's step and a
//! pipeline stage's step turn the gradients computed on one rank into the update every rank
//! of its data-parallel group applies, and keep parameters and optimizer state in step.
//!
//! A [`GradientSync`] is a value a worker holds (like `burn-train`'s `TrainingStrategy`):
//! the worker computes gradients and calls [`GradientSync::reduce`] then
//! [`GradientSync::apply`]; it never branches on how the group synchronises. Four
//! implementations exist:
//! - [`AllReduceSync`]: every rank holds the whole optimizer state; gradients are all-reduced
//!   in buckets, and the flat rule (Burn's optimizer where the configuration has none) steps
//!   the whole model (plain data parallelism, OPT-1).
//! - [`ZeroSync`]: ZeRO stage 1 (all-reduce, then each rank steps its shard with its shard
//!   of the optimizer state and the shards are all-gathered; in block jobs a reduce-scatter,
//!   each block's buffer being its own) or stage 2 (reduce-scatter, so each rank also holds
//!   only its shard of the reduced gradient), over
//!   [`crate::parallel::zero`]'s pure update rules.
//! - `local::LocalSync`: local SGD, DiLoCo and EASGD ([`crate::parallel::local`]'s rules):
//!   no gradient collective; each rank steps its own optimizer, and every H steps the ranks
//!   all-reduce their parameters (or their outer gradients, or their distances to the
//!   centre) and apply the rule; in block and pipeline jobs, one per block (LOCAL-6).
//! - `sharded::ShardedSync`: ZeRO stage 3 for one block of a block or pipeline job: only the
//!   rank's shard of the parameters is kept between uses; a gather
//!   ([`GradientSync::start_gather`] / [`GradientSync::finish_gather`]) and
//!   [`GradientSync::release`] (no-ops for the others) bracket each forward and backward.
//!
//! A block executor runs the collectives itself, on a communication thread beside the
//! compute (`parallel::pipeline_exec::overlap`): it calls [`GradientSync::start_reduce`] (Burn's gradients
//! out as one flat buffer, and the [`Collective`] that reduces it), runs the collective
//! where it likes, and hands the result to [`GradientSync::finish_reduce`]; ZeRO-3's
//! parameters come the same way ([`GradientSync::start_gather`] /
//! [`GradientSync::finish_gather`]). The tensor work stays here, only buffers cross, and the
//! collective is the same calls on the same buffers as in `reduce` (COLL-1), so the
//! executor never branches on the strategy and overlap never changes a bit.
//!
//! - `compressed::CompressedSync`: plain data parallelism whose gradients travel compressed
//!   ([`crate::parallel::compress`]: bf16/f16, top-k, PowerSGD, with error feedback); its
//!   checkpoint part holds Burn's optimizer bytes and the rank's residual (CSYNC-1..3).
//! - `local::LocalSync`: local SGD, DiLoCo and EASGD ([`crate::parallel::local`]): no
//!   gradient collective; each rank steps alone and the group meets in one parameter
//!   all-reduce every H steps (LOCAL-1..5).
//!
//! Where the next strategy plugs in: a parameter server's worker pushes in `reduce` and
//! pulls in `apply`.

use std::ops::Range;
use std::time::Instant;

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Device;

use super::buckets::{Bucket, plan_buckets};
use super::gradients::{
    GradientBuffers, ParamLayout, bucket_ranges, reduce_buckets, set_trainable,
    set_trainable_owned, trainable_range, update_trainable,
};
use super::zero::{FlatRule, OptimizerShard, ZeroStage, owned_range, reshard};
use crate::checkpoint::{
    CheckpointError, OptimizerPart, OptimizerState, ShardParams, restore_module, snapshot_module,
};
use crate::comm::{CommError, Communicator, Element, ReduceOp};
use crate::optim::OptimizerConfig;
use crate::precision::Precision;
use crate::trace::TraceKind;

mod all_reduce;
mod checkpoint_parts;
mod collective;
mod compressed;
mod local;
mod sharded;
mod sharded_optimizer;

pub(crate) use all_reduce::AllReduceSync;
pub(crate) use checkpoint_parts::{
    decode_zero_parts, rank_part, restore_flat, restore_shard, shard_state, with_flat_and_named,
};
pub(crate) use collective::{Collective, Span};
pub(crate) use sharded_optimizer::ZeroSync;

/// What one rank holds of the training state, in bytes (`f32` words × 4), as a worker reports
/// it for `meshwork bench memory` and the sharding proofs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeldBytes {
    /// Parameters held between uses: the whole model on every rank at ZeRO stages 0–2, this
    /// rank's shard of it at stage 3.
    pub params: u64,
    /// Gradients held at the optimizer step, after the reduction.
    pub grads: u64,
    /// Gradients held right after Burn's backward, before any reduction (Burn's single
    /// backward call materialises every gradient at once).
    pub grads_backward: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// The range of the flat trainable order whose optimizer state this rank holds (the
    /// whole order when not sharded).
    pub owned: (u64, u64),
}

/// Why a synchronisation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum SyncError {
    /// A collective of the group failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A compressed reduction found a malformed message.
    #[error(transparent)]
    Compression(#[from] crate::parallel::compress::CompressError),
    /// This rank's optimizer shard is not the one its place in the group owns: the group
    /// changed and the state was not restored onto it (a runtime bug, not a user error).
    #[error(
        "ZeRO: this rank's optimizer shard covers {have:?} but rank {rank} of {world} owns \
         {want:?}: the group changed without its state being re-sharded"
    )]
    NotResharded {
        /// The range the shard covers.
        have: Range<usize>,
        /// The range the rank owns.
        want: Range<usize>,
        /// The rank.
        rank: usize,
        /// The group's size.
        world: usize,
    },
}

/// What a reduction hands to [`GradientSync::apply`]: the reduced gradients (whole or this
/// rank's shard) and what the worker must know before applying them.
#[derive(Debug)]
pub(crate) struct Reduced {
    grads: ReducedGrads,
    /// The reduced gradient holds a non-finite value (found by clipping's norm, which every
    /// rank computes alike, so every rank takes the same decision).
    pub non_finite: bool,
}

enum ReducedGrads {
    Whole(GradientsParams),
    /// The whole reduced gradient, flat, turned back into Burn's gradients at the update.
    Buffers(GradientBuffers),
    /// The whole reduced gradient in the flat order, as the collective left it: the flat
    /// rule reads each parameter's range in place (`AllReduceSync`'s block path).
    Flat(Vec<f32>),
    Shard(Vec<f32>),
}

impl Reduced {
    /// The sum of the squares of the reduced gradient this rank holds, and whether it is a
    /// part of the group's (a shard, to be summed over the group) rather than the whole;
    /// `None` when the gradient went to the optimizer untouched (`SyncContext::direct`).
    pub(crate) fn sum_of_squares(&self) -> Option<(f64, bool)> {
        match &self.grads {
            ReducedGrads::Whole(_) => None,
            ReducedGrads::Buffers(b) => Some((sum_of_squares(b.slices().into_iter()), false)),
            ReducedGrads::Flat(s) => Some((sum_of_squares(std::iter::once(&s[..])), false)),
            ReducedGrads::Shard(s) => Some((sum_of_squares(std::iter::once(&s[..])), true)),
        }
    }

    /// [`Reduced::sum_of_squares`] over the parameters `counts` keeps only: `layout` is the
    /// flat trainable order the gradient follows and `owned` the range of it a shard holds
    /// (a tensor-parallel block counts its replicated parameters on one rank of the group).
    pub(crate) fn sum_of_squares_of(
        &self,
        layout: &ParamLayout,
        owned: Range<usize>,
        counts: impl Fn(burn::module::ParamId) -> bool,
    ) -> Option<(f64, bool)> {
        let slots = layout.slots();
        match &self.grads {
            ReducedGrads::Whole(_) => None,
            ReducedGrads::Buffers(b) => {
                let kept = b
                    .slices()
                    .into_iter()
                    .zip(slots)
                    .filter(|(_, s)| counts(s.id))
                    .map(|(g, _)| g);
                Some((sum_of_squares(kept), false))
            }
            ReducedGrads::Flat(g) => {
                let kept = slots
                    .iter()
                    .filter(|s| counts(s.id))
                    .map(|s| &g[s.range.clone()]);
                Some((sum_of_squares(kept), false))
            }
            ReducedGrads::Shard(g) => {
                let kept = slots.iter().filter(|s| counts(s.id)).filter_map(|s| {
                    let (lo, hi) = (owned.start.max(s.range.start), owned.end.min(s.range.end));
                    (lo < hi).then(|| &g[lo - owned.start..hi - owned.start])
                });
                Some((sum_of_squares(kept), true))
            }
        }
    }

    /// Whether the reduced gradient this rank holds has an inf or a NaN (a loss scaler's
    /// overflow, found by a block job across its blocks, MIX-2).
    pub(crate) fn has_non_finite(&self) -> bool {
        let bad = |s: &[f32]| s.iter().any(|g| !g.is_finite());
        self.non_finite
            || match &self.grads {
                ReducedGrads::Whole(_) => false,
                ReducedGrads::Buffers(b) => b.slices().into_iter().any(bad),
                ReducedGrads::Flat(s) | ReducedGrads::Shard(s) => bad(s),
            }
    }

    /// Clip with a global `norm` computed over several reductions (a block job's blocks):
    /// the coefficient of [`clip_by_global_norm`]. Marks the gradient non-finite when the
    /// norm is.
    pub(crate) fn clip_to(&mut self, norm: f32, max_norm: f32) {
        self.non_finite |= !norm.is_finite();
        match &mut self.grads {
            ReducedGrads::Whole(_) => {}
            ReducedGrads::Buffers(b) => clip_to(&mut b.slices_mut(), norm, max_norm),
            ReducedGrads::Flat(s) | ReducedGrads::Shard(s) => {
                clip_to(&mut [&mut s[..]], norm, max_norm)
            }
        }
    }
}

impl std::fmt::Debug for ReducedGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReducedGrads::Whole(_) => write!(f, "Whole"),
            ReducedGrads::Buffers(_) => write!(f, "Buffers"),
            ReducedGrads::Flat(s) => write!(f, "Flat({} elements)", s.len()),
            ReducedGrads::Shard(s) => write!(f, "Shard({} elements)", s.len()),
        }
    }
}

/// The step's context for a synchronisation: the group, what to do with the gradient, and
/// where the spans of its collectives go.
pub(crate) struct SyncContext<'a> {
    /// The data-parallel group (`None`: this rank is alone).
    pub comm: Option<&'a mut Communicator>,
    /// The device the gradients go back to (without autodiff).
    pub device: &'a Device,
    /// Multiply the reduced gradient by this (a pipeline stage's 1 / replicas; 1 otherwise).
    pub scale: f32,
    /// This rank's share of the step's samples (its samples / the global batch): its
    /// gradient arrives weighted by it (DP-2); a rank that steps alone (`LocalSync`) divides
    /// by it to step on its own mean. 1 where it does not matter.
    pub share: f32,
    /// Clip the reduced gradient to this global L2 norm.
    pub clip: Option<f32>,
    /// Hand Burn's gradients to the optimizer untouched (one rank, nothing to scale or clip).
    pub direct: bool,
    /// The collectives' and copies' spans: what, when it began, how long.
    pub spans: Vec<(TraceKind, Instant, std::time::Duration)>,
    /// Mixed precision: the type gradients travel in, and whether to look for an overflow.
    pub precision: SyncPrecision,
}

/// What mixed precision asks of a reduction.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SyncPrecision {
    /// The type gradients travel in: `F32`, or a 16-bit type the collectives reduce in `f32`
    /// and round once (COMM-5).
    pub wire: Precision,
    /// Look for an inf or a NaN in the reduced gradient (loss scaling): found on any rank, it
    /// is [`Reduced::non_finite`] on every rank (PREC-2).
    pub find_overflow: bool,
}

/// All-reduce (sum) an `f32` bucket, travelling as `wire`'s type.
fn all_reduce_as(comm: &mut Communicator, b: &mut [f32], wire: Precision) -> Result<(), CommError> {
    fn narrow<T: Element>(comm: &mut Communicator, b: &mut [f32]) -> Result<(), CommError> {
        let mut n: Vec<T> = b.iter().map(|&v| T::from_f32(v)).collect();
        comm.all_reduce(&mut n, ReduceOp::Sum)?;
        b.iter_mut().zip(&n).for_each(|(d, s)| *d = s.to_f32());
        Ok(())
    }
    match wire {
        Precision::F32 => comm.all_reduce(b, ReduceOp::Sum),
        Precision::Bf16 => narrow::<half::bf16>(comm, b),
        Precision::F16 => narrow::<half::f16>(comm, b),
    }
}

/// Reduce-scatter (sum) a flat `f32` gradient into this rank's shard, travelling as `wire`'s
/// type.
fn reduce_scatter_as(
    comm: &mut Communicator,
    flat: &[f32],
    shard: &mut [f32],
    wire: Precision,
) -> Result<(), CommError> {
    fn narrow<T: Element>(c: &mut Communicator, f: &[f32], s: &mut [f32]) -> Result<(), CommError> {
        let input: Vec<T> = f.iter().map(|&v| T::from_f32(v)).collect();
        let mut out = vec![T::from_f32(0.0); s.len()];
        c.reduce_scatter(&input, &mut out, ReduceOp::Sum)?;
        s.iter_mut().zip(&out).for_each(|(d, v)| *d = v.to_f32());
        Ok(())
    }
    match wire {
        Precision::F32 => comm.reduce_scatter(flat, shard, ReduceOp::Sum),
        Precision::Bf16 => narrow::<half::bf16>(comm, flat, shard),
        Precision::F16 => narrow::<half::f16>(comm, flat, shard),
    }
}

/// Whether the reduced gradient overflowed anywhere in the group (PREC-2): `local` is what
/// this rank holds; a shard's finding is all-reduced (max) so every rank learns it.
fn overflow_in_group(
    local: &[&[f32]],
    sharded: bool,
    cx: &mut SyncContext<'_>,
) -> Result<bool, CommError> {
    if !cx.precision.find_overflow {
        return Ok(false);
    }
    let mut found = [f32::from(u8::from(
        local.iter().any(|p| p.iter().any(|g| !g.is_finite())),
    ))];
    if sharded && let Some(comm) = cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
        comm.all_reduce(&mut found, ReduceOp::Max)?;
    }
    Ok(found[0] > 0.0)
}

impl std::fmt::Debug for SyncContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncContext")
            .field("scale", &self.scale)
            .field("clip", &self.clip)
            .finish_non_exhaustive()
    }
}

impl SyncContext<'_> {
    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world())
    }

    fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, |c| c.rank().index())
    }

    fn timed<T>(&mut self, kind: TraceKind, f: impl FnOnce(&mut Self) -> T) -> T {
        let t = Instant::now();
        let out = f(self);
        self.spans.push((kind, t, t.elapsed()));
        out
    }
}

/// How a data-parallel group keeps its parameters, gradients and optimizer state in step
/// (the device side of a strategy). Called on the device thread, once per step, by every
/// rank of the group in the same order.
pub(crate) trait GradientSync<M: Module>: Send {
    /// Reduce this rank's gradients (already weighted by its share of the step's samples)
    /// over the group; scale and clip.
    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError>;

    /// The optimizer step with the reduced gradients at learning rate `lr`, and whatever
    /// exchange keeps the ranks' parameters equal afterwards. On failure the model comes
    /// back beside the error (as it was, or updated on this rank only).
    fn apply(
        &mut self,
        model: M,
        reduced: Reduced,
        lr: ModuleLearningRate,
        cx: &mut SyncContext<'_>,
    ) -> Result<M, (M, SyncError)>;

    /// The parameters of `model` (the block this synchronises) for a checkpoint or a peer:
    /// every float parameter by name, or, where the parameters are sharded (ZeRO-3), this
    /// rank's part of the flat trainable parameters and the others by name (CKPT-10).
    fn snapshot_params(&self, model: &M) -> ShardParams {
        snapshot_module(model)
    }

    /// `model` with the parameters of a snapshot of the same block, as rank `rank` of
    /// `world` (parameter parts are put together, CKPT-10, and a sharded block keeps its
    /// part of them for that group).
    fn restore_params(
        &mut self,
        model: M,
        params: &ShardParams,
        _rank: usize,
        _world: usize,
    ) -> Result<M, CheckpointError> {
        if !params.has_parts() {
            return restore_module(model, params);
        }
        let layout = ParamLayout::trainable(&model);
        Ok(restore_flat(model, &layout, params)?.0)
    }

    /// This rank's optimizer state, for a checkpoint or a peer (a part of it when sharded).
    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError>;

    /// Before a data-parallel step, as rank `rank` of `world`: `model` with state restored
    /// for this place, where a restore had to wait until the rank knew it (a roll-back
    /// restores a replacement before it joins its group, LOCAL-4); `None` when nothing waits.
    fn settle(
        &mut self,
        _model: &M,
        _rank: usize,
        _world: usize,
    ) -> Result<Option<M>, CheckpointError> {
        Ok(None)
    }

    /// The parameters and optimizer state of a data-parallel rank for a checkpoint or a
    /// peer: [`snapshot_params`](Self::snapshot_params) and
    /// [`optimizer_state`](Self::optimizer_state), or, where a rank's own parameters are its
    /// state (`LocalSync`, LOCAL-4), them inside its optimizer part.
    fn snapshot_state(&self, model: &M) -> Result<(ShardParams, OptimizerState), CheckpointError> {
        Ok((self.snapshot_params(model), self.optimizer_state()?))
    }

    /// `model` with a snapshot's parameters and, if it has one, optimizer state, as rank
    /// `rank` of `world`: the inverse of [`snapshot_state`](Self::snapshot_state).
    fn restore_state(
        &mut self,
        model: M,
        params: &ShardParams,
        optimizer: Option<&OptimizerState>,
        rank: usize,
        world: usize,
    ) -> Result<M, CheckpointError> {
        let model = self.restore_params(model, params, rank, world)?;
        if let Some(o) = optimizer {
            self.restore_optimizer(o, rank, world)?;
        }
        Ok(model)
    }

    /// Take optimizer state from a checkpoint or a peer, as rank `rank` of `world` (sharded
    /// state is re-sharded onto that group size).
    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<(), CheckpointError>;

    /// What this rank holds after its last step.
    fn held(&self) -> HeldBytes;

    /// The reduction split from its collective (COLL-1), for an executor that runs the
    /// collectives elsewhere (a communication thread, `parallel::pipeline_exec::overlap`): take this rank's
    /// gradients (already weighted) out of Burn as plain buffers and name the collective that
    /// reduces them over the group, this rank being `rank_of = (rank, world)`.
    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        rank_of: (usize, usize),
    ) -> Result<Collective, SyncError>;

    /// The second half of [`start_reduce`](Self::start_reduce): `out` is its collective's
    /// result; scale it by `scale` and keep it for [`apply`](Self::apply). Clipping is the
    /// caller's ([`Reduced::clip_to`], over several blocks).
    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        rank_of: (usize, usize),
    ) -> Result<Reduced, SyncError>;

    /// The all-gather that gives `model` its full parameters for a forward or a backward, as
    /// rank `rank_of` of the group: ZeRO-3's shard (a collective: every rank of the group
    /// issues it at the same point of its list, FSDP-2); `None` for the strategies that hold
    /// the parameters always. The parameters do not change between steps' updates, so the
    /// gather may be issued ahead of its use (prefetch, EXEC-5).
    fn start_gather(
        &mut self,
        _model: &M,
        _rank_of: (usize, usize),
    ) -> Result<Option<Collective>, SyncError> {
        Ok(None)
    }

    /// `model` with the full parameters `full`, the result of
    /// [`start_gather`](Self::start_gather)'s collective.
    fn finish_gather(&mut self, model: M, _full: Vec<f32>) -> M {
        model
    }

    /// `model` with its full parameters now, gathering them over `comm` on this thread if
    /// it does not hold them.
    fn gather(&mut self, model: M, comm: Option<&mut Communicator>) -> Result<M, (M, SyncError)> {
        if self.holds_full() {
            return Ok(model);
        }
        let rank_of = comm
            .as_ref()
            .map_or((0, 1), |c| (c.rank().index(), c.world()));
        let collective = match self.start_gather(&model, rank_of) {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(model),
            Err(e) => return Err((model, e)),
        };
        match collective.run(comm).0 {
            Ok(full) => Ok(self.finish_gather(model, full)),
            Err(e) => Err((model, SyncError::Comm(e))),
        }
    }

    /// `model` without its full parameters, once a forward or backward is done with them
    /// (ZeRO-3 keeps only this rank's shard); the other strategies keep them.
    fn release(&mut self, model: M) -> M {
        model
    }

    /// `model` (whole, as every replica starts) keeping only rank `rank` of `world`'s
    /// shard of its parameters (ZeRO-3); the other strategies keep them whole.
    fn shard(&mut self, model: M, _rank: usize, _world: usize) -> M {
        model
    }

    /// Whether the model handed to [`gather`](Self::gather) last holds its full parameters
    /// now.
    fn holds_full(&self) -> bool {
        true
    }
}

/// How a data-parallel group reduces and steps: the job's ZeRO stage, compression and local
/// updates (the table refuses local updates with either of the others).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Reduction {
    /// The ZeRO stage.
    pub(crate) zero: ZeroStage,
    /// How gradients travel compressed.
    pub(crate) compression: super::compress::Compression,
    /// Ranks stepping alone and meeting every few steps.
    pub(crate) local: Option<super::local::LocalUpdates>,
}

/// The synchronisation a [`Reduction`] asks for, over `model`'s trainable parameters:
/// [`for_local_updates`] for local updates, `compressed` for a compressed job without ZeRO,
/// ZeRO-1/2 with the compressor inside (ZSYNC-1), [`for_stage`] when nothing is compressed.
/// `build` refuses the pairs that have no form (rows of `composition::REFUSALS`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn for_reduction<M: Module>(
    reduction: Reduction,
    model: &M,
    device: &Device,
    optimizer: &OptimizerConfig,
    bucket_elems: usize,
    fuse_below: usize,
    rank: usize,
    world: usize,
) -> Result<Box<dyn GradientSync<M>>, super::zero::UnsupportedOptimizer> {
    let Reduction {
        zero: stage,
        compression,
        local,
    } = reduction;
    if let Some(updates) = local {
        return Ok(for_local_updates(
            updates,
            model,
            optimizer,
            bucket_elems,
            fuse_below,
            rank,
            world,
        ));
    }
    if !compression.is_on() {
        return for_stage(
            stage,
            model,
            device,
            optimizer,
            bucket_elems,
            fuse_below,
            rank,
            world,
        );
    }
    let layout = ParamLayout::trainable(model);
    Ok(match stage {
        ZeroStage::Off => compressed(compression, model, optimizer, rank, world),
        ZeroStage::One | ZeroStage::Two => {
            let compressor = super::compress::Compressor::new(
                compression,
                &sharded_optimizer::shapes_of(&layout),
            );
            let mut sync = zero_sync(stage, layout, Vec::new(), optimizer, rank, world)?;
            sync.compressor = Some(std::sync::Arc::new(std::sync::Mutex::new(compressor)));
            Box::new(sync)
        }
        ZeroStage::Three => {
            unreachable!("build refuses compression with ZeRO-3 (composition::REFUSALS)")
        }
    })
}

/// ZeRO-1 or 2 over `layout`, rank `rank` of `world`, reducing uncompressed in `buckets`.
fn zero_sync(
    stage: ZeroStage,
    layout: ParamLayout,
    buckets: Vec<Bucket>,
    optimizer: &OptimizerConfig,
    rank: usize,
    world: usize,
) -> Result<ZeroSync, super::zero::UnsupportedOptimizer> {
    Ok(ZeroSync {
        stage,
        shard: OptimizerShard::fresh(FlatRule::of(optimizer)?, layout.len(), world, rank),
        restored: None,
        layout,
        buckets,
        fusion: Vec::new(),
        held: HeldBytes::default(),
        compressor: None,
        restored_compressors: None,
    })
}

/// Whether `device` computes on the host (Burn's `flex`): there the flat rule steps the
/// parameters where they are (OPT-1); on a GPU, Burn's optimizer keeps them on the device
/// instead of bringing them to the host and back at every step.
pub(crate) fn steps_on_host(device: &Device) -> bool {
    #[cfg(feature = "flex")]
    {
        device.clone().inner() == Device::flex()
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = device;
        false
    }
}

/// The synchronisation `stage` asks for, over `model`'s trainable parameters on `device`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn for_stage<M: Module>(
    stage: ZeroStage,
    model: &M,
    device: &Device,
    optimizer: &OptimizerConfig,
    bucket_elems: usize,
    fuse_below: usize,
    rank: usize,
    world: usize,
) -> Result<Box<dyn GradientSync<M>>, super::zero::UnsupportedOptimizer> {
    let layout = ParamLayout::trainable(model);
    let sizes: Vec<usize> = layout.slots().iter().map(|s| s.range.len()).collect();
    let buckets = plan_buckets(&sizes, bucket_elems, fuse_below);
    Ok(match stage {
        ZeroStage::Off => Box::new(AllReduceSync::new(
            optimizer,
            steps_on_host(device),
            layout,
            buckets,
        )),
        ZeroStage::One | ZeroStage::Two => {
            Box::new(zero_sync(stage, layout, buckets, optimizer, rank, world)?)
        }
        ZeroStage::Three => Box::new(sharded::ShardedSync::new(FlatRule::of(optimizer)?, layout)),
    })
}

/// Plain data parallelism with its gradients compressed by `compression` (a scheme that is
/// on), for rank `rank` of `world` (`compressed::CompressedSync`).
pub(crate) fn compressed<M: Module>(
    compression: crate::parallel::compress::Compression,
    model: &M,
    optimizer: &OptimizerConfig,
    rank: usize,
    world: usize,
) -> Box<dyn GradientSync<M>> {
    let layout = ParamLayout::trainable(model);
    // Burn's optimizer always: a compressed job's parts hold Burn's bytes (CSYNC-2).
    let inner = AllReduceSync::new(optimizer, false, layout, Vec::new());
    Box::new(compressed::CompressedSync::new(
        inner,
        compression,
        rank,
        world,
    ))
}

/// The synchronisation of a data-parallel rank that steps alone and meets its group every
/// `updates.every()` steps (local SGD, DiLoCo, EASGD), as rank `rank` of `world`.
pub(crate) fn for_local_updates<M: Module>(
    updates: super::local::LocalUpdates,
    model: &M,
    optimizer: &OptimizerConfig,
    bucket_elems: usize,
    fuse_below: usize,
    rank: usize,
    world: usize,
) -> Box<dyn GradientSync<M>> {
    let layout = ParamLayout::trainable(model);
    let sizes: Vec<usize> = layout.slots().iter().map(|s| s.range.len()).collect();
    let buckets = plan_buckets(&sizes, bucket_elems, fuse_below);
    Box::new(local::LocalSync::new(
        updates,
        optimizer.init(),
        FlatRule::of(optimizer).map_or(0, |r| r.state_words()),
        layout,
        buckets,
        (rank, world),
    ))
}

/// Reduce `views` bucket by bucket with an all-reduce, recording each bucket's span.
fn all_reduce_buckets(
    views: &mut [&mut [f32]],
    buckets: &[Bucket],
    fusion: &mut Vec<f32>,
    cx: &mut SyncContext<'_>,
) -> std::result::Result<(), CommError> {
    let Some(comm) = cx.comm.as_deref_mut() else {
        return Ok(());
    };
    if comm.world() == 1 {
        return Ok(());
    }
    let mut spans = Vec::new();
    let wire = cx.precision.wire;
    let wire_bytes = if wire.is_low() { 2 } else { 4 };
    reduce_buckets(views, buckets, fusion, |b| {
        let t = Instant::now();
        let r = all_reduce_as(comm, b, wire);
        spans.push((
            TraceKind::AllReduce {
                bytes: (b.len() * wire_bytes) as u64,
            },
            t,
            t.elapsed(),
        ));
        r
    })?;
    cx.spans.extend(spans);
    Ok(())
}

/// Scale `grads` so that their global L2 norm is at most `max_norm` (PyTorch's
/// `clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`, applied when below 1).
/// Returns the norm before clipping.
pub(crate) fn clip_by_global_norm(grads: &mut [&mut [f32]], max_norm: f32) -> f32 {
    let norm = sum_of_squares(grads.iter().map(|g| &**g)).sqrt() as f32;
    clip_to(grads, norm, max_norm);
    norm
}

fn sum_of_squares<'a>(parts: impl Iterator<Item = &'a [f32]>) -> f64 {
    parts
        .flat_map(|g| g.iter())
        .map(|g| f64::from(*g) * f64::from(*g))
        .sum::<f64>()
}

fn clip_to(grads: &mut [&mut [f32]], norm: f32, max_norm: f32) {
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for g in grads.iter_mut() {
            g.iter_mut().for_each(|v| *v *= coef);
        }
    }
}

/// Each parameter's part of `range` (of the flat trainable order of `layout`), relative to
/// the range's start, with its learning rate: what a flat update rule steps a shard by.
fn lr_segments(
    layout: &ParamLayout,
    range: &Range<usize>,
    lr: &ModuleLearningRate,
) -> Vec<(Range<usize>, f64)> {
    layout
        .slots()
        .iter()
        .filter_map(|s| {
            let (lo, hi) = (range.start.max(s.range.start), range.end.min(s.range.end));
            (lo < hi).then(|| {
                (
                    lo - range.start..hi - range.start,
                    lr.lr_from_param(s.id, None),
                )
            })
        })
        .collect()
}
