//! [`StageWork`]: what the stage actor asks of a block besides the walk's part
//! ([`BlockStep`]): building and resharding its parameters at the start, snapshots and
//! restores, precision, the tensor-parallel group, and the trained module at the end — the
//! seam between the runtime and the block's Burn work (`TypedStage`).

use super::*;

/// One block of a stage, independent of its module type: the walk's part and the actor's.
pub(crate) trait StageWork<I>: BlockStep<I> {
    /// Recompute the block's forward during its backward (activation checkpointing), as the
    /// job's description asks of every block (`JobConfig::recompute`).
    fn recompute_always(&mut self);
    /// Gather the block's full parameters over `replicas` now, if it does not hold them.
    fn gather_now(&mut self, replicas: Option<&mut Communicator>) -> Result<(), ExecError>;
    /// Keep only this rank's shard of the block's parameters, as rank `replicas.rank()` of
    /// the group (ZeRO-3, FSDP-1; no collective: every replica starts from the same record);
    /// a no-op for the other strategies.
    fn shard_parameters(&mut self, replicas: Option<&Communicator>);
    /// Fingerprint of the stage's parameters.
    fn fingerprint(&self) -> u64;
    /// The stage's parameters by name and its optimizer state (a checkpoint shard, or what a
    /// twin's replacement starts from).
    fn snapshot(&self) -> Result<(ShardParams, OptimizerState), CheckpointError>;
    /// The module's parameters as it holds them now (whole after a ZeRO-3 gather; a
    /// tensor-parallel rank's slices), in the checkpoint's form: what the trained model is
    /// rebuilt from in another process.
    fn module_params(&self) -> ShardParams;
    /// Take the parameters and optimizer state of a snapshot of the same block, as rank
    /// `rank` of `world` of the block's data-parallel group (sharded optimizer state is
    /// re-sharded onto that group).
    fn restore(
        &mut self,
        params: &ShardParams,
        optimizer: Option<&OptimizerState>,
        rank_of: (usize, usize),
    ) -> Result<(), CheckpointError>;
    /// A tensor-parallel block's float parameters as it holds them (name, split axis,
    /// whether trainable), in visit order: what re-slicing a checkpoint of another degree
    /// needs (TP-7); `None` for a block that is not tensor-parallel.
    fn held_params(&self) -> Option<Vec<crate::parallel::tensor::reslice::HeldParam>>;
    /// The stage's learning-rate scheduler state, `None` for a constant rate (LR-2).
    fn lr_state(&self) -> Result<Option<LrSchedulerState>, CheckpointError>;
    /// Continue the learning-rate schedule from a snapshot's state (LR-2); nothing changes
    /// on an error.
    fn restore_lr(&mut self, state: Option<&LrSchedulerState>) -> Result<(), CheckpointError>;
    /// How the block's data-parallel group reduces and steps, before the first step: its
    /// optimizer state sharded (ZeRO), its gradients compressed, both where they have a form
    /// together (ZSYNC-1), or its ranks stepping alone and meeting every few steps (local
    /// updates, LOCAL-6): `sync::for_reduction`.
    fn set_reduction(&mut self, reduction: Reduction) -> Result<(), UnsupportedOptimizer>;
    /// Run forward and backward in `precision` on a low-precision copy of the `f32` master
    /// parameters (MIX-1), and reduce its gradients travelling as `gradients`' type (`f32`,
    /// or the 16-bit type: `.low_precision_gradients(true)`); `f32` until called.
    fn set_precision(&mut self, precision: Precision, gradients: Precision);
    /// Compute with this tensor-parallel group from now on (a rewired mesh's new
    /// generation); a no-op for a block that is not tensor-parallel.
    fn set_tensor_parallel(&mut self, tp: &Arc<TensorParallel>);
    /// The module, type-erased (for `downcast`).
    fn into_module(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}
