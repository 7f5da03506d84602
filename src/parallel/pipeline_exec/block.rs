//! [`BlockStep`]: what the instruction walk asks of one block of a stage — forward and
//! backward of a micro-batch, the block's collectives (parameter gathers, the gradient
//! reduction) as values the walk issues on the stage's lane, the update, and what the block
//! holds. The walk sees boundary tensors as they travel ([`WireTensor`]), never as Burn
//! tensors: the block turns them into its own (`TypedStage`), so the walk runs and is tested
//! without Burn (a fake block, `walk/tests.rs`). What the stage actor asks of a block besides
//! (snapshots, restores, precision, sharding at start) is [`StageWork`](super::StageWork).

use super::{ExecError, WireTensor};
use crate::comm::Communicator;
use crate::parallel::memory::BlockBytes;
use crate::parallel::sync::Collective;

/// Where a forward's input comes from.
#[derive(Debug)]
pub(crate) enum BlockInput {
    /// The micro-batch's items: the model's first block builds its input from them.
    Data,
    /// The previous block's outputs, received over a link.
    Received(Vec<WireTensor>),
}

/// One block's part in the walk of a step (see the module docs).
pub(crate) trait BlockStep<I>: Send {
    /// Forward of a micro-batch: `input` (received from the previous stage, or built by the
    /// block from `items` on the first stage); returns the activations to send on, or `None`
    /// on the last stage (which computed and stashed the loss). A first block's inputs come
    /// from the data, so no gradient of them is computed.
    fn forward(
        &mut self,
        mb: u32,
        input: BlockInput,
        items: &[I],
    ) -> Result<Option<Vec<WireTensor>>, ExecError>;
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
    /// (to be summed over the replicas), for a global norm, on the rank whose coordinate in
    /// the tensor-parallel dimension is `tp_rank` (CLIP-1): split parameters' slices on every
    /// rank, whatever the rank holds whole (a split block's replicated parameters, an ordinary
    /// block) on `tp_rank` 0 only, so the sum over the group counts each element once.
    fn norm_part(&self, tp_rank: usize) -> Option<(f64, bool)>;
    /// Clip the reduced gradient with a global norm computed over several blocks.
    fn clip(&mut self, norm: f32, max_norm: f32);
    /// The optimizer step with the reduced gradient (and the exchange that keeps the
    /// replicas' parameters in step). Returns the learning rate used.
    fn apply(&mut self, replicas: Option<&mut Communicator>) -> Result<f64, ExecError>;
    /// What the block holds now (MEM-1).
    fn memory(&self) -> BlockBytes;
    /// The loss of each micro-batch seen since the last step (last stage only).
    fn take_losses(&mut self) -> Vec<f32>;
    /// Micro-batches stashed now and the bytes of their boundary tensors.
    fn stashed(&self) -> (u32, u64);
    /// Forget what an unfinished step left behind: stashed micro-batches, accumulated
    /// gradients, losses, a sharded block's full parameters (EXEC-4).
    fn begin_step(&mut self);
    /// Multiply the loss by `scale` before backward (the last block; f16's loss scaler,
    /// MIX-2); 1 until called.
    fn set_loss_scale(&mut self, scale: f32);
    /// Whether this rank's reduced gradient has an inf or a NaN (MIX-2).
    fn overflowed(&self) -> bool;
}
