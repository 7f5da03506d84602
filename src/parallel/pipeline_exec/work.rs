//! [`StageWork`]: what the instruction walk asks of a stage's block — the seam between the walk
//! and the block's Burn work (`TypedStage`).

use super::*;

/// One stage's work, independent of its module type.
pub(crate) trait StageWork<I>: Send {
    /// Forward of a micro-batch: `input` (from the previous stage, or built from `items` on the
    /// first stage); returns the activations to send on, or `None` on the last stage (which
    /// computed and stashed the loss).
    /// `input_grads` is false on the first stage: its inputs come from the data, so no
    /// gradient of them is computed.
    fn forward(
        &mut self,
        mb: u32,
        input: Boundary,
        items: &[I],
        input_grads: bool,
    ) -> Result<Option<Boundary>, ExecError>;
    /// Backward of a micro-batch from the received output gradient (`None` on the last stage);
    /// returns the gradients of the stage's inputs, to send upstream.
    fn backward(
        &mut self,
        mb: u32,
        grad_out: Option<Vec<WireTensor>>,
    ) -> Result<Vec<WireTensor>, ExecError>;
    /// For each use of the block in a step's list, in order (`None`: a forward; `Some(mb)`:
    /// the backward of micro-batch `mb`), whether its parameters must be gathered for it: a
    /// ZeRO-3 block that does not hold them then (FSDP-2). Decided from the block's options
    /// and state at the step's start only, so every replica decides alike (OVL-1).
    fn gather_plan(&self, uses: &[Option<u32>]) -> Vec<bool>;
    /// The all-gather of the block's parameters for a use [`gather_plan`](Self::gather_plan)
    /// marked, as rank `rank_of` of its group (`None`: the block holds them always).
    fn start_gather(&mut self, rank_of: (usize, usize)) -> Result<Option<Collective>, ExecError>;
    /// Take the full parameters `full` the gather brought.
    fn finish_gather(&mut self, full: Vec<f32>);
    /// Gather the block's full parameters over `replicas` now, if it does not hold them.
    fn gather_now(&mut self, replicas: Option<&mut Communicator>) -> Result<(), ExecError>;
    /// Take the step's accumulated gradients out as the collective that reduces them over
    /// the block's group (`rank_of`); called right after the block's last backward of the
    /// step.
    fn start_reduce(&mut self, rank_of: (usize, usize)) -> Result<Collective, ExecError>;
    /// Take the reduction's result `out`, scaled by `scale`, for [`apply`](Self::apply).
    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        rank_of: (usize, usize),
    ) -> Result<(), ExecError>;
    /// Whether the gradients of this step were reduced already.
    fn reduced(&self) -> bool;
    /// The sum of squares of the reduced gradient this rank holds, and whether it is a shard
    /// (to be summed over the replicas), for a global norm.
    fn norm_part(&self) -> Option<(f64, bool)>;
    /// Clip the reduced gradient with a global norm computed over several blocks.
    fn clip(&mut self, norm: f32, max_norm: f32);
    /// The optimizer step with the reduced gradient (and the exchange that keeps the
    /// replicas' parameters in step). Returns the learning rate used.
    fn apply(&mut self, replicas: Option<&mut Communicator>) -> Result<f64, ExecError>;
    /// What the block holds now (MEM-1).
    fn memory(&self) -> BlockBytes;
    /// Keep only this rank's shard of the block's parameters, as rank `replicas.rank()` of
    /// the group (ZeRO-3, FSDP-1; no collective: every replica starts from the same record);
    /// a no-op for the other strategies.
    fn shard_parameters(&mut self, replicas: Option<&Communicator>);
    /// The loss of each micro-batch seen since the last step (last stage only).
    fn take_losses(&mut self) -> Vec<f32>;
    /// Micro-batches stashed now and the bytes of their boundary tensors.
    fn stashed(&self) -> (u32, u64);
    /// Fingerprint of the stage's parameters.
    fn fingerprint(&self) -> u64;
    /// Forget what an unfinished step left behind: stashed micro-batches, accumulated
    /// gradients, losses, a sharded block's full parameters (EXEC-4).
    fn begin_step(&mut self);
    /// The stage's parameters by name and its optimizer state (a checkpoint shard, or what a
    /// twin's replacement starts from).
    fn snapshot(&self) -> Result<(ShardParams, OptimizerState), CheckpointError>;
    /// Take the parameters and optimizer state of a snapshot of the same block, as rank
    /// `rank` of `world` of the block's data-parallel group (sharded optimizer state is
    /// re-sharded onto that group).
    fn restore(
        &mut self,
        params: &ShardParams,
        optimizer: Option<&OptimizerState>,
        rank_of: (usize, usize),
    ) -> Result<(), CheckpointError>;
    /// The stage's learning-rate scheduler state, `None` for a constant rate (LR-2).
    fn lr_state(&self) -> Result<Option<LrSchedulerState>, CheckpointError>;
    /// Continue the learning-rate schedule from a snapshot's state (LR-2); nothing changes
    /// on an error.
    fn restore_lr(&mut self, state: Option<&LrSchedulerState>) -> Result<(), CheckpointError>;
    /// Shard the block's optimizer state over its data-parallel group (ZeRO), before the
    /// first step.
    fn shard_optimizer(&mut self, stage: ZeroStage) -> Result<(), UnsupportedOptimizer>;
    /// Run forward and backward in `precision` on a low-precision copy of the `f32` master
    /// parameters (MIX-1); `f32` until called.
    fn set_precision(&mut self, precision: Precision);
    /// Multiply the loss by `scale` before backward (the last block; f16's loss scaler,
    /// MIX-2); 1 until called.
    fn set_loss_scale(&mut self, scale: f32);
    /// Whether this rank's reduced gradient has an inf or a NaN (MIX-2).
    fn overflowed(&self) -> bool;
    /// Compute with this tensor-parallel group from now on (a rewired mesh's new
    /// generation); a no-op for a block that is not tensor-parallel.
    fn set_tensor_parallel(&mut self, tp: &Arc<TensorParallel>);
    /// The device (with autodiff) the stage computes on.
    fn device(&self) -> &Device;
    /// The module, type-erased (for `downcast`).
    fn into_module(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}
