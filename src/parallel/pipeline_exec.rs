//! Executing pipeline schedules: a stage runs its instruction list literally.
//!
//! `run_stage_step` (crate-internal, like the rest of the executor) is one stage's step, called on its device thread by
//! the runtime's `PipelineStageActor`: it walks the
//! stage's list over the stage's v model chunks (`StageWork`, usually a `TypedStage`),
//! moving activations and gradients over `StageLinks`: one bounded FIFO per peer and direction
//! of data, built from the schedule's sends (so interleaved schedules get their wrap-around
//! links), holding [`link_capacity`](PipelineSchedule::link_capacity) messages (a fast stage
//! cannot run ahead without limit). Every wait is bounded by a time-out and ends early when the
//! job's abort flag is set.
//!
//! What crosses a stage boundary is a [`Boundary`]: one or several tensors of rank 1 to 4, so a
//! skip connection can cross. Backward from a received output gradient uses the
//! vector–Jacobian product: with the stage's stashed outputs `h` and the received gradients
//! `g`, backpropagate `Σ (h · g).sum()`; the stage's inputs were leaves with `require_grad`, so
//! their gradients are what goes upstream.
//!
//! Invariants:
//! - EXEC-1: a stage executes exactly its list, in order; an instruction whose input is not
//!   there (a receive that times out, a backward without a stash) is a typed error naming the
//!   stage, the micro-batch and the instruction, never a hang.
//! - EXEC-2: the gradient of a step is the mean over the M micro-batches of each micro-batch's
//!   mean loss: the same as one device on the whole batch.
//! - EXEC-3: with data-parallel replicas of the pipeline (dp × pp), each stage's gradients are
//!   averaged over its replicas before the update, so replicas stay identical and the step
//!   equals one device on the global batch.
//! - EXEC-4: every step starts clean: what an unfinished attempt left in a stage (stashed
//!   micro-batches, accumulated gradients, losses) is dropped, so a step redone after a
//!   recovery (REC-6) is the step itself.
//! - EXEC-5: the step's collectives for its blocks (a ZeRO-3 block's all-gathers, every
//!   block's gradient reduction) go through the stage's `CommLane` (`parallel::overlap`): with
//!   `blocks_in_flight` n > 0 on a communication thread, the gathers issued in list order at
//!   most n ahead of their use (so at most n gathered-but-unused blocks exist besides the one
//!   computing, MEM-3) and at most n reductions in flight, each issued right after its block's
//!   last backward and all taken before the clip and the update; with n = 0 each in place when
//!   its result is needed. Which uses gather is decided from the blocks' options at the step's
//!   start (`StageWork::gather_plan`), so every replica issues the same collectives in the same
//!   order (OVL-1) and the parameters are bitwise the same for every n.
//! - MIX-1: in low precision a block's forward (and its recompute) runs on
//!   `low_precision_copy` of its `f32` master module (the casts inside the autodiff graph, so
//!   the gradients reach the master as `f32`), the loss is cast to `f32`; boundary tensors
//!   travel as `f32` values, a block casts its input (as a data-parallel model does) and a
//!   received output gradient is cast to the output's dtype.
//! - MIX-2: with a loss scale (f16) the last block's loss is multiplied by it before backward
//!   and the reductions divide by it; each block's reduced gradient is checked for an inf or a
//!   NaN, the flags combined over the stage's blocks and all-reduced (max) over its replicas,
//!   so every replica skips the same step (no update, no schedule advance).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use burn::module::{Module, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use super::gradients::parameter_fingerprint;
use super::memory::{BlockBytes, StepMemory};
use super::overlap::{CommLane, Ticket, with_lane};
use super::sync::{self, Collective, GradientSync, SyncContext};
use super::tensor::{TensorParallel, TpFailure};
use super::zero::{UnsupportedOptimizer, ZeroStage};
use crate::checkpoint::{CheckpointError, LrSchedulerState, OptimizerState, ShardParams};
use crate::comm::{CollectiveKind, CommError, Communicator};
use crate::faults::{Phase, with_hooks};

mod wire;
pub(crate) use wire::PacketWire;
use wire::RemoteEnd;
pub use wire::WireError;

/// Gradient buckets of the data-parallel reduction between pipeline replicas.
const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;
/// Tensors below this many elements are fused into one bucket.
const FUSE_BELOW: usize = 64 * 1024;
use super::pipeline::{Chunk, Instr, PipelineSchedule, StageIndex, TimedInstr};

use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::autocast::low_precision_copy;
use crate::precision::Precision;

/// A tensor of rank 1 to 4 crossing a stage boundary.
#[derive(Debug, Clone)]
pub enum AnyTensor {
    /// Rank 1.
    D1(Tensor<1>),
    /// Rank 2.
    D2(Tensor<2>),
    /// Rank 3.
    D3(Tensor<3>),
    /// Rank 4.
    D4(Tensor<4>),
}

/// What crosses a stage boundary: one or more tensors.
pub type Boundary = Vec<AnyTensor>;

/// A boundary tensor's values as they travel: dims and `f32` values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WireTensor {
    /// The shape.
    pub dims: Vec<usize>,
    /// The values, row-major.
    pub values: Vec<f32>,
}

macro_rules! each_rank {
    ($t:expr, $x:ident => $body:expr) => {
        match $t {
            AnyTensor::D1($x) => AnyTensor::D1($body),
            AnyTensor::D2($x) => AnyTensor::D2($body),
            AnyTensor::D3($x) => AnyTensor::D3($body),
            AnyTensor::D4($x) => AnyTensor::D4($body),
        }
    };
}

impl AnyTensor {
    fn to_wire(&self) -> WireTensor {
        let (dims, data) = match self {
            AnyTensor::D1(t) => (t.dims().to_vec(), t.clone().inner().into_data()),
            AnyTensor::D2(t) => (t.dims().to_vec(), t.clone().inner().into_data()),
            AnyTensor::D3(t) => (t.dims().to_vec(), t.clone().inner().into_data()),
            AnyTensor::D4(t) => (t.dims().to_vec(), t.clone().inner().into_data()),
        };
        let values = data
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default();
        WireTensor { dims, values }
    }

    fn from_wire(w: WireTensor, device: &Device) -> Result<Self, ExecError> {
        let data = |dims: Vec<usize>| TensorData::new(w.values.clone(), dims);
        Ok(match w.dims.len() {
            1 => AnyTensor::D1(Tensor::from_data(data(w.dims.clone()), device)),
            2 => AnyTensor::D2(Tensor::from_data(data(w.dims.clone()), device)),
            3 => AnyTensor::D3(Tensor::from_data(data(w.dims.clone()), device)),
            4 => AnyTensor::D4(Tensor::from_data(data(w.dims.clone()), device)),
            rank => return Err(ExecError::UnsupportedRank { rank }),
        })
    }

    fn require_grad(self) -> Self {
        each_rank!(self, t => t.require_grad())
    }

    fn detached(&self) -> Self {
        each_rank!(self.clone(), t => t.detach())
    }

    /// `(self · other).sum()` for tensors of the same rank, `other` (an `f32` wire value)
    /// cast to `self`'s dtype first (a low-precision block's output, MIX-1).
    fn dot(&self, other: &AnyTensor) -> Option<Tensor<1>> {
        fn dot<const D: usize>(a: &Tensor<D>, b: &Tensor<D>) -> Tensor<1> {
            (a.clone() * b.clone().cast(a.dtype())).sum()
        }
        Some(match (self, other) {
            (AnyTensor::D1(a), AnyTensor::D1(b)) => dot(a, b),
            (AnyTensor::D2(a), AnyTensor::D2(b)) => dot(a, b),
            (AnyTensor::D3(a), AnyTensor::D3(b)) => dot(a, b),
            (AnyTensor::D4(a), AnyTensor::D4(b)) => dot(a, b),
            _ => return None,
        })
    }

    fn grad_wire(&self, grads: &burn::tensor::Gradients) -> WireTensor {
        let zeros = |dims: Vec<usize>| WireTensor {
            values: vec![0.0; dims.iter().product()],
            dims,
        };
        match self {
            AnyTensor::D1(t) => t.grad(grads).map(AnyTensor::D1),
            AnyTensor::D2(t) => t.grad(grads).map(AnyTensor::D2),
            AnyTensor::D3(t) => t.grad(grads).map(AnyTensor::D3),
            AnyTensor::D4(t) => t.grad(grads).map(AnyTensor::D4),
        }
        .map_or_else(|| zeros(self.to_wire().dims), |g| g.to_wire())
    }
}

/// Why a stage could not execute an instruction.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// A receive waited longer than the time-out.
    #[error(
        "stage {stage}: {what} for micro-batch {mb} did not arrive from stage {from} within {waited:?}"
    )]
    Timeout {
        /// The waiting stage.
        stage: u32,
        /// The stage expected to send.
        from: u32,
        /// The micro-batch.
        mb: u32,
        /// Activation or gradient.
        what: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// A neighbour's link is gone (its thread ended).
    #[error("stage {stage}: the link with stage {peer} is closed")]
    LinkClosed {
        /// This stage.
        stage: u32,
        /// The neighbour.
        peer: u32,
    },
    /// An instruction found nothing to work on (a schedule bug or a message out of order).
    #[error("stage {stage}: {instr} has no input for micro-batch {mb}")]
    MissingInput {
        /// This stage.
        stage: u32,
        /// The micro-batch.
        mb: u32,
        /// The instruction.
        instr: String,
    },
    /// A boundary tensor has a rank outside 1..=4.
    #[error("a boundary tensor of rank {rank}: ranks 1 to 4 are supported")]
    UnsupportedRank {
        /// The rank.
        rank: usize,
    },
    /// The received gradients do not match the stage's outputs.
    #[error("stage {stage}: gradient for micro-batch {mb} does not match the stage's outputs")]
    ShapeMismatch {
        /// This stage.
        stage: u32,
        /// The micro-batch.
        mb: u32,
    },
    /// The all-reduce of gradients across data-parallel replicas failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The step was aborted because another stage failed.
    #[error("stage {stage}: stopped because another stage of the job failed")]
    Aborted {
        /// This stage.
        stage: u32,
    },
    /// A message arrived for another micro-batch than the instruction names (a schedule that
    /// breaks PIPE-3).
    #[error("stage {stage}: expected micro-batch {expected} from stage {from}, got {got}")]
    OutOfOrder {
        /// This stage.
        stage: u32,
        /// The sender.
        from: u32,
        /// The micro-batch the instruction names.
        expected: u32,
        /// The micro-batch that arrived.
        got: u32,
    },
    /// A collective the stage ran for one of its blocks (gathering its parameters, reducing
    /// its gradient) failed; later collectives of the step did not run (OVL-3).
    #[error("stage {stage}: the {op} of block {block} failed: {cause}")]
    BlockCollective {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
        /// The collective.
        op: CollectiveKind,
        /// What the communicator said.
        cause: CommError,
    },
    /// The result of a block's collective did not come within the time-outs of the
    /// collectives ahead of it (OVL-2).
    #[error("stage {stage}: the {op} of block {block} gave no result within {waited:?}")]
    BlockCollectiveTimeout {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
        /// The collective.
        op: CollectiveKind,
        /// How long the stage waited.
        waited: Duration,
    },
    /// A collective of a tensor-parallel block's group failed (TP-4).
    #[error(
        "stage {stage}: the tensor-parallel group of block {block} failed during {during} of micro-batch {mb}: {cause}"
    )]
    TensorParallel {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
        /// The micro-batch.
        mb: u32,
        /// What the block was computing.
        during: &'static str,
        /// What the communicator said.
        cause: CommError,
    },
    /// A tensor-parallel block computed a split layer after a `reduce`: two split regions in
    /// one block, whose gradients the executor's rules would get wrong (TP-6).
    #[error(
        "stage {stage}: block {block} has two tensor-parallel split regions (a split layer after a reduce); cut it into one block per region"
    )]
    TensorParallelRegions {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
    },
    /// The schedule needs something this executor does not do yet.
    #[error("unsupported schedule: {0}")]
    Unsupported(String),
    /// The connection to a stage in another process failed (its process died or closed the
    /// connection, the job aborted, a bad packet arrived).
    #[error("stage {stage}: the connection to stage {peer} in another process failed: {reason}")]
    Wire {
        /// This stage.
        stage: u32,
        /// The peer stage.
        peer: u32,
        /// What the transport said.
        reason: String,
    },
}

impl ExecError {
    /// A block's error with its stage and block filled in (a block does not know them).
    fn in_block(self, stage: u32, block: u32) -> Self {
        match self {
            ExecError::TensorParallel {
                mb, during, cause, ..
            } => ExecError::TensorParallel {
                stage,
                block,
                mb,
                during,
                cause,
            },
            ExecError::TensorParallelRegions { .. } => {
                ExecError::TensorParallelRegions { stage, block }
            }
            other => other,
        }
    }
}

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

type ForwardFn<M> = Box<dyn Fn(&M, Boundary, &TensorParallel) -> Boundary + Send>;
type LossFn<M, I> = Box<dyn Fn(&M, Boundary, &[I], &Device, &TensorParallel) -> Tensor<1> + Send>;

/// One stage of a pipeline: a Burn module, what it computes, its optimizer.
pub(crate) struct TypedStage<M: Module, I> {
    model: M,
    device: Device,
    forward: Option<ForwardFn<M>>,
    loss: Option<LossFn<M, I>>,
    /// How the block's replicas keep gradients, parameters and optimizer state in step.
    sync: Box<dyn GradientSync<M>>,
    optimizer: OptimizerConfig,
    lr: LearningRate,
    stash: HashMap<u32, (Boundary, Stashed)>,
    accumulated: GradientsAccumulator<M>,
    losses: Vec<f32>,
    recompute: bool,
    /// Release a sharded block's full parameters after each forward (ZeRO-3; the last
    /// block never does: its backward follows its forward).
    reshard_after_forward: bool,
    /// Whether the sync shards the parameters (ZeRO-3).
    shards_params: bool,
    /// The module a released block's forward ran with, kept for that micro-batch's
    /// backward when the forward is not recomputed: Burn's graph holds its tensors anyway,
    /// and the gradients are found through them.
    kept: HashMap<u32, M>,
    /// The step's reduced gradient, between `reduce` and `apply`.
    reduced: Option<sync::Reduced>,
    /// Gradient bytes held now.
    grads_bytes: u64,
    /// Trainable parameter elements.
    param_len: usize,
    /// False on the first stage (set by each forward).
    input_grads: bool,
    /// What forward and backward compute in (MIX-1).
    precision: Precision,
    /// The loss is multiplied by this before backward (MIX-2).
    loss_scale: f32,
    /// The rank's tensor-parallel group (a group of one unless the block is
    /// tensor-parallel).
    tp: Arc<TensorParallel>,
    /// A tensor-parallel block's split parameters and their axes (TP-1..2).
    split: Option<HashMap<ParamId, usize>>,
}

enum Stashed {
    Outputs(Boundary),
    Loss(Box<Tensor<1>>),
    /// Only the inputs are kept; the forward runs again during backward (recompute).
    Nothing,
}

impl<M: Module, I> std::fmt::Debug for TypedStage<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TypedStage({} stashed)", self.stash.len())
    }
}

impl<M: Module + 'static, I: 'static> TypedStage<M, I> {
    /// A middle (or first) stage computing `forward`, on `device` (autodiff is turned on).
    pub(crate) fn new(
        model: M,
        forward: impl Fn(&M, Boundary, &TensorParallel) -> Boundary + Send + 'static,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        Self::build(model, Some(Box::new(forward)), None, optimizer, lr, device)
    }

    /// The last stage: its forward ends in the mean loss over the micro-batch's items.
    pub(crate) fn last(
        model: M,
        loss: impl Fn(&M, Boundary, &[I], &Device, &TensorParallel) -> Tensor<1> + Send + 'static,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        Self::build(model, None, Some(Box::new(loss)), optimizer, lr, device)
    }

    fn build(
        model: M,
        forward: Option<ForwardFn<M>>,
        loss: Option<LossFn<M, I>>,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        let device = device.clone().autodiff();
        let model = model.fork(&device).train();
        let sync = sync::for_stage(
            ZeroStage::Off,
            &model,
            optimizer,
            BUCKET_ELEMS,
            FUSE_BELOW,
            0,
            1,
        )
        .expect("whole (unsharded) optimizer state supports every optimizer");
        let param_len = super::gradients::ParamLayout::trainable(&model).len();
        Self {
            reshard_after_forward: true,
            shards_params: false,
            kept: HashMap::new(),
            reduced: None,
            grads_bytes: 0,
            param_len,
            sync,
            model,
            device,
            forward,
            loss,
            optimizer: optimizer.clone(),
            lr,
            stash: HashMap::new(),
            accumulated: GradientsAccumulator::new(),
            losses: Vec::new(),
            recompute: false,
            input_grads: true,
            precision: Precision::F32,
            loss_scale: 1.0,
            tp: Arc::new(TensorParallel::single()),
            split: None,
        }
    }

    /// Make this a tensor-parallel block of `tp`'s group, whose module is the rank's part
    /// with these split parameters (TP-1..2).
    pub(crate) fn with_tensor_parallel(
        mut self,
        tp: Arc<TensorParallel>,
        split: HashMap<ParamId, usize>,
    ) -> Self {
        self.tp = tp;
        self.split = Some(split);
        self
    }

    /// Whether the block's backward follows the tensor-parallel rules (TP-1..2).
    fn splits(&self) -> bool {
        self.split.is_some() && self.tp.degree() > 1
    }

    /// The tensor-parallel group's failure during `during`, if one happened (TP-4).
    fn tp_failed(&self, mb: u32, during: &'static str) -> Result<(), ExecError> {
        match self.tp.take_failure() {
            Some(TpFailure::Comm(cause)) => Err(ExecError::TensorParallel {
                stage: u32::MAX,
                block: u32::MAX,
                mb,
                during,
                cause,
            }),
            Some(TpFailure::SecondRegion) => Err(ExecError::TensorParallelRegions {
                stage: u32::MAX,
                block: u32::MAX,
            }),
            None => Ok(()),
        }
    }

    /// TP-2: sum each replicated parameter's gradient over the tensor-parallel group.
    fn sum_replicated(&self, grads: &mut GradientsParams) {
        struct Sum<'a> {
            grads: &'a mut GradientsParams,
            split: &'a HashMap<ParamId, usize>,
            tp: &'a TensorParallel,
        }
        impl burn::module::ModuleVisitor for Sum<'_> {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
                if self.split.contains_key(&param.id) {
                    return;
                }
                let Some(g) = self.grads.remove::<D>(param.id) else {
                    return;
                };
                let device = g.device();
                let dims = g.dims().to_vec();
                let mut values = g
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .unwrap_or_default();
                self.tp.sum_parameter(&mut values);
                self.grads.register::<D>(
                    param.id,
                    Tensor::from_data(TensorData::new(values, dims), &device),
                );
            }
        }
        if let Some(split) = &self.split {
            self.model.visit(&mut Sum {
                grads,
                split,
                tp: &self.tp,
            });
        }
    }

    /// Keep only each micro-batch's inputs between its forward and its backward, and run the
    /// forward again during backward: less memory for more compute (activation
    /// checkpointing). Has no effect on the last stage, whose backward follows its forward. A
    /// forward that draws random numbers (dropout) draws them again when recomputed.
    pub(crate) fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// Whether a sharded (ZeRO-3) block releases its full parameters after each forward and
    /// gathers them again for the backward (true), or keeps them until its backward.
    pub(crate) fn with_reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    fn sync_cx<'a>(
        device: &'a Device,
        scale: f32,
        replicas: Option<&'a mut Communicator>,
    ) -> SyncContext<'a> {
        SyncContext {
            comm: replicas,
            device,
            scale,
            share: 1.0,
            clip: None,
            direct: false,
            spans: Vec::new(),
            precision: sync::SyncPrecision::default(),
        }
    }
}

impl<M: Module + 'static, I: 'static> StageWork<I> for TypedStage<M, I> {
    fn forward(
        &mut self,
        mb: u32,
        input: Boundary,
        items: &[I],
        input_grads: bool,
    ) -> Result<Option<Boundary>, ExecError> {
        self.input_grads = input_grads;
        let leaves: Boundary = if input_grads {
            input.into_iter().map(AnyTensor::require_grad).collect()
        } else {
            input
        };
        // MIX-1: the forward runs on a low-precision copy whose casts hand the f32 master its
        // gradients (the identity at f32); the loss is f32.
        let model = low_precision_copy(&self.model, self.precision);
        if let Some(loss) = &self.loss {
            self.tp.begin_block();
            let l =
                loss(&model, leaves.clone(), items, &self.device, &self.tp).cast(FloatDType::F32);
            self.tp_failed(mb, "the loss")?;
            self.losses.push(l.clone().into_scalar());
            self.stash.insert(mb, (leaves, Stashed::Loss(Box::new(l))));
            Ok(None)
        } else {
            let forward = self
                .forward
                .as_ref()
                .expect("a stage has a forward or a loss");
            self.tp.begin_block();
            let out = forward(&model, leaves.clone(), &self.tp);
            drop(model);
            self.tp_failed(mb, "the forward")?;
            if self.recompute {
                // Keep the inputs' values only: no graph survives until the backward.
                let inputs = leaves.iter().map(AnyTensor::detached).collect();
                self.stash.insert(mb, (inputs, Stashed::Nothing));
            } else {
                self.stash
                    .insert(mb, (leaves, Stashed::Outputs(out.clone())));
            }
            if self.shards_params && self.reshard_after_forward {
                let used = self.model.clone();
                self.model = self.sync.release(self.model.clone());
                if !self.recompute {
                    self.kept.insert(mb, used);
                }
            }
            Ok(Some(out))
        }
    }

    fn backward(
        &mut self,
        mb: u32,
        grad_out: Option<Vec<WireTensor>>,
    ) -> Result<Vec<WireTensor>, ExecError> {
        let missing = |what: &str| ExecError::MissingInput {
            stage: u32::MAX,
            mb,
            instr: what.to_string(),
        };
        let (leaves, stashed) = self.stash.remove(&mb).ok_or_else(|| missing("backward"))?;
        // The module the graph was built with: the one kept at the forward, or this one.
        let used = self.kept.remove(&mb);
        let (leaves, stashed) = match stashed {
            Stashed::Nothing => {
                let forward = self
                    .forward
                    .as_ref()
                    .expect("recompute is for middle stages");
                let leaves: Boundary = if self.input_grads {
                    leaves.into_iter().map(AnyTensor::require_grad).collect()
                } else {
                    leaves
                };
                self.tp.begin_block();
                let out = forward(
                    &low_precision_copy(&self.model, self.precision),
                    leaves.clone(),
                    &self.tp,
                );
                self.tp_failed(mb, "the recomputed forward")?;
                (leaves, Stashed::Outputs(out))
            }
            other => (leaves, other),
        };
        // TP-1: a tensor-parallel block's backward is seeded with the output gradient / T.
        let seed = if self.splits() {
            1.0 / self.tp.degree() as f32
        } else {
            1.0
        };
        let mut grads = match (stashed, grad_out) {
            (Stashed::Loss(l), _) if self.loss_scale * seed != 1.0 => {
                (*l * (self.loss_scale * seed)).backward()
            }
            (Stashed::Loss(l), _) => l.backward(),
            (Stashed::Outputs(out), Some(g)) => {
                if g.len() != out.len() {
                    return Err(ExecError::ShapeMismatch {
                        stage: u32::MAX,
                        mb,
                    });
                }
                let mut total: Option<Tensor<1>> = None;
                for (h, g) in out.iter().zip(g) {
                    let g = AnyTensor::from_wire(g, &self.device.clone().inner())?;
                    let d = h.dot(&g).ok_or(ExecError::ShapeMismatch {
                        stage: u32::MAX,
                        mb,
                    })?;
                    total = Some(match total {
                        Some(t) => t + d,
                        None => d,
                    });
                }
                let total = total.ok_or_else(|| missing("backward (no outputs)"))?;
                if seed != 1.0 {
                    (total * seed).backward()
                } else {
                    total.backward()
                }
            }
            (Stashed::Outputs(_), None) => return Err(missing("backward (no gradient)")),
            (Stashed::Nothing, _) => unreachable!("recomputed above"),
        };
        let mut upstream: Vec<WireTensor> = if self.input_grads {
            leaves.iter().map(|x| x.grad_wire(&grads)).collect()
        } else {
            Vec::new()
        };
        if self.splits() {
            // TP-1: Megatron's `f` — the inputs' gradients summed over the group.
            for g in &mut upstream {
                self.tp.sum_activation(&mut g.values);
            }
            self.tp_failed(mb, "the sum of the input gradient")?;
        }
        let params = GradientsParams::from_module(&mut grads, used.as_ref().unwrap_or(&self.model));
        drop(used);
        self.accumulated.accumulate(&self.model, params);
        self.grads_bytes = 4 * self.param_len as u64;
        // A sharded block keeps only its shard until its next use (FSDP-1).
        self.model = self.sync.release(self.model.clone());
        Ok(upstream)
    }

    fn gather_plan(&self, uses: &[Option<u32>]) -> Vec<bool> {
        if !self.shards_params {
            return vec![false; uses.len()];
        }
        // What `forward` and `backward` do to the module, replayed: a middle block releases
        // after its forward when resharding (keeping the module for the backward unless it
        // recomputes), every block releases after its backward.
        let middle = self.loss.is_none();
        let releases_after_forward = middle && self.reshard_after_forward;
        let keeps = releases_after_forward && !self.recompute;
        let mut full = self.sync.holds_full();
        uses.iter()
            .map(|u| match u {
                None => {
                    let need = !full;
                    full = !releases_after_forward;
                    need
                }
                Some(_) => {
                    let need = !keeps && !full;
                    full = false;
                    need
                }
            })
            .collect()
    }

    fn start_gather(&mut self, rank_of: (usize, usize)) -> Result<Option<Collective>, ExecError> {
        self.sync
            .start_gather(&self.model, rank_of)
            .map_err(sync_failed)
    }

    fn finish_gather(&mut self, full: Vec<f32>) {
        self.model = self.sync.finish_gather(self.model.clone(), full);
    }

    fn gather_now(&mut self, replicas: Option<&mut Communicator>) -> Result<(), ExecError> {
        match self.sync.gather(self.model.clone(), replicas) {
            Ok(model) => {
                self.model = model;
                Ok(())
            }
            Err((model, e)) => {
                self.model = model;
                Err(sync_failed(e))
            }
        }
    }

    fn start_reduce(&mut self, rank_of: (usize, usize)) -> Result<Collective, ExecError> {
        let mut grads = self.accumulated.grads();
        if self.splits() {
            self.sum_replicated(&mut grads);
            self.tp_failed(0, "the sum of the replicated parameters' gradients")?;
        }
        let collective = self
            .sync
            .start_reduce(&self.model, grads, rank_of)
            .map_err(sync_failed)?;
        // The flat gradient is held (queued or being reduced) until the result comes.
        self.grads_bytes = 4 * self.param_len as u64;
        Ok(collective)
    }

    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        rank_of: (usize, usize),
    ) -> Result<(), ExecError> {
        let reduced = self
            .sync
            .finish_reduce(out, scale, rank_of)
            .map_err(sync_failed)?;
        self.grads_bytes = self.sync.held().grads;
        self.reduced = Some(reduced);
        Ok(())
    }

    fn reduced(&self) -> bool {
        self.reduced.is_some()
    }

    fn norm_part(&self) -> Option<(f64, bool)> {
        self.reduced
            .as_ref()
            .and_then(sync::Reduced::sum_of_squares)
    }

    fn clip(&mut self, norm: f32, max_norm: f32) {
        if let Some(r) = self.reduced.as_mut() {
            r.clip_to(norm, max_norm);
        }
    }

    fn apply(&mut self, replicas: Option<&mut Communicator>) -> Result<f64, ExecError> {
        let reduced = self.reduced.take().ok_or_else(|| ExecError::MissingInput {
            stage: u32::MAX,
            mb: 0,
            instr: "the update (no reduced gradient)".into(),
        })?;
        let inner = self.device.clone().inner();
        let mut cx = Self::sync_cx(&inner, 1.0, replicas);
        // LR-1: the schedule advances only with an applied step.
        let (lr, lr_after) = self.lr.peek_next();
        let rate = lr.base();
        let model = self.model.clone();
        self.model = match self.sync.apply(model, reduced, lr, &mut cx) {
            Ok(model) => model,
            Err((model, e)) => {
                self.model = model;
                return Err(sync_failed(e));
            }
        };
        self.grads_bytes = 0;
        self.lr.commit(lr_after);
        Ok(rate)
    }

    fn shard_parameters(&mut self, replicas: Option<&Communicator>) {
        if !self.shards_params {
            return;
        }
        let (rank, world) = replicas.map_or((0, 1), |c| (c.rank().index(), c.world()));
        self.model = self.sync.shard(self.model.clone(), rank, world);
    }

    fn memory(&self) -> BlockBytes {
        let whole = 4 * self.param_len as u64;
        let held = self.sync.held();
        BlockBytes {
            full_params: whole * (u64::from(self.sync.holds_full()) + self.kept.len() as u64),
            param_shard: if self.shards_params { held.params } else { 0 },
            grads: self.grads_bytes,
            optimizer: held.optimizer,
            activations: self.stashed().1,
        }
    }

    fn take_losses(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.losses)
    }

    fn stashed(&self) -> (u32, u64) {
        let bytes = self
            .stash
            .values()
            .map(|(inputs, kept)| {
                boundary_bytes(inputs)
                    + match kept {
                        Stashed::Outputs(o) => boundary_bytes(o),
                        Stashed::Loss(_) => 4,
                        Stashed::Nothing => 0,
                    }
            })
            .sum();
        (self.stash.len() as u32, bytes)
    }

    fn fingerprint(&self) -> u64 {
        parameter_fingerprint(&self.model)
    }

    fn begin_step(&mut self) {
        // A sharded block starts every step from its shard (an unfinished attempt or a
        // fingerprint may have left it whole), so every replica's `gather_plan` is the same.
        if self.shards_params {
            self.model = self.sync.release(self.model.clone());
        }
        self.stash.clear();
        self.kept.clear();
        self.reduced = None;
        self.grads_bytes = 0;
        self.accumulated = GradientsAccumulator::new();
        self.losses.clear();
        // A failure an unfinished attempt left behind is not this step's (TP-4).
        let _ = self.tp.take_failure();
    }

    fn snapshot(&self) -> Result<(ShardParams, OptimizerState), CheckpointError> {
        Ok((
            self.sync.snapshot_params(&self.model),
            self.sync.optimizer_state()?,
        ))
    }

    fn restore(
        &mut self,
        params: &ShardParams,
        optimizer: Option<&OptimizerState>,
        (rank, world): (usize, usize),
    ) -> Result<(), CheckpointError> {
        let model = self
            .sync
            .restore_params(self.model.clone(), params, rank, world)?;
        if let Some(o) = optimizer {
            self.sync.restore_optimizer(o, rank, world)?;
        }
        self.model = model;
        Ok(())
    }

    fn lr_state(&self) -> Result<Option<LrSchedulerState>, CheckpointError> {
        self.lr.state()
    }

    fn restore_lr(&mut self, state: Option<&LrSchedulerState>) -> Result<(), CheckpointError> {
        self.lr.restore(state)
    }

    fn shard_optimizer(&mut self, stage: ZeroStage) -> Result<(), UnsupportedOptimizer> {
        self.shards_params = stage.shards_parameters();
        self.sync = sync::for_stage(
            stage,
            &self.model,
            &self.optimizer,
            BUCKET_ELEMS,
            FUSE_BELOW,
            0,
            1,
        )?;
        Ok(())
    }

    fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    fn overflowed(&self) -> bool {
        self.reduced
            .as_ref()
            .is_some_and(sync::Reduced::has_non_finite)
    }

    fn set_tensor_parallel(&mut self, tp: &Arc<TensorParallel>) {
        if self.split.is_some() {
            self.tp = tp.clone();
        }
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn into_module(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        Box::new(self.model)
    }
}

/// A synchronisation's failure as the executor reports it.
fn sync_failed(e: sync::SyncError) -> ExecError {
    match e {
        sync::SyncError::Comm(c) => ExecError::Comm(c),
        other => ExecError::Unsupported(other.to_string()),
    }
}

/// Which way data moves on a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Flow {
    /// Activations, towards later blocks.
    Activation,
    /// Gradients, towards earlier blocks.
    Gradient,
}

/// One message on a link: the micro-batch it belongs to and the tensors.
#[derive(Debug)]
struct Packet {
    mb: u32,
    tensors: Vec<WireTensor>,
}

/// A stage's ends of the links its list uses: to a peer in the same process one bounded FIFO
/// per (peer, direction of data), created from the schedule's sends (PIPE-3), holding
/// [`link_capacity`](PipelineSchedule::link_capacity) messages; to a peer in another process
/// one connection ([`PacketWire`]), whose transport's window bounds what is in flight.
#[derive(Debug)]
pub(crate) struct StageLinks {
    stage: u32,
    to: HashMap<(u32, Flow), SyncSender<Packet>>,
    from: HashMap<(u32, Flow), Receiver<Packet>>,
    remote: HashMap<u32, RemoteEnd>,
    timeout: Duration,
    abort: Arc<AtomicBool>,
}

/// How often a blocked send or receive looks at the abort flag.
const ABORT_POLL: Duration = Duration::from_millis(20);

/// The links of a pipeline running `plan`: for every stage its ends, in stage order. Every
/// wait on them is bounded by `timeout`, and ends early (with [`ExecError::Aborted`]) once
/// `abort` is set, so a failure elsewhere wakes every stage at once.
pub(crate) fn links(
    plan: &PipelineSchedule,
    timeout: Duration,
    abort: Arc<AtomicBool>,
) -> Vec<StageLinks> {
    let k = plan.stages();
    let mut out: Vec<StageLinks> = (0..k)
        .map(|stage| StageLinks {
            stage,
            to: HashMap::new(),
            from: HashMap::new(),
            remote: HashMap::new(),
            timeout,
            abort: abort.clone(),
        })
        .collect();
    for stage in 0..k {
        for instr in plan.list(StageIndex(stage)) {
            let (peer, flow) = match *instr {
                Instr::SendActivation { to, .. } => (to.0, Flow::Activation),
                Instr::SendGradient { to, .. } => (to.0, Flow::Gradient),
                _ => continue,
            };
            if peer >= k || out[stage as usize].to.contains_key(&(peer, flow)) {
                continue;
            }
            let (tx, rx) = sync_channel(plan.link_capacity() as usize);
            out[stage as usize].to.insert((peer, flow), tx);
            out[peer as usize].from.insert((stage, flow), rx);
        }
    }
    out
}

/// The ends of `stage`'s links when every peer its list talks to is in another process:
/// `wires[peer]` is the connection to stage `peer`. A wait is bounded by `timeout`; an abort
/// reaches it by closing the connections (the abort flag of in-process links plays no part).
#[cfg_attr(
    not(feature = "cluster"),
    expect(
        dead_code,
        reason = "only a cluster job's proxies (`cluster::remote`) call it"
    )
)]
pub(crate) fn remote_links(
    plan: &PipelineSchedule,
    stage: u32,
    timeout: Duration,
    mut wires: HashMap<u32, Arc<dyn PacketWire>>,
) -> Result<StageLinks, ExecError> {
    let mut remote = HashMap::new();
    for instr in plan.list(StageIndex(stage)) {
        let peer = match *instr {
            Instr::SendActivation { to, .. } | Instr::SendGradient { to, .. } => to.0,
            Instr::RecvActivation { from, .. } | Instr::RecvGradient { from, .. } => from.0,
            _ => continue,
        };
        if remote.contains_key(&peer) {
            continue;
        }
        let wire = wires.remove(&peer).ok_or_else(|| {
            ExecError::Unsupported(format!(
                "stage {stage} exchanges data with stage {peer} but has no connection to it"
            ))
        })?;
        remote.insert(peer, RemoteEnd::new(wire));
    }
    Ok(StageLinks {
        stage,
        to: HashMap::new(),
        from: HashMap::new(),
        remote,
        timeout,
        abort: Arc::new(AtomicBool::new(false)),
    })
}

impl StageLinks {
    fn aborted(&self) -> ExecError {
        ExecError::Aborted { stage: self.stage }
    }

    fn send(&self, peer: u32, flow: Flow, packet: Packet) -> Result<(), ExecError> {
        let closed = ExecError::LinkClosed {
            stage: self.stage,
            peer,
        };
        if let (None, Some(end)) = (self.to.get(&(peer, flow)), self.remote.get(&peer)) {
            return end.send((self.stage, peer), flow, &packet, self.timeout);
        }
        let tx = self.to.get(&(peer, flow)).ok_or(closed.clone())?;
        // Bounded: wait for room, but never forever (the receiver may have failed).
        let deadline = Instant::now() + self.timeout;
        let mut packet = packet;
        let mut pause = Duration::from_micros(20);
        loop {
            match tx.try_send(packet) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => return Err(closed),
                Err(TrySendError::Full(p)) => {
                    if self.abort.load(Ordering::Relaxed) {
                        return Err(self.aborted());
                    }
                    if Instant::now() >= deadline {
                        return Err(ExecError::Timeout {
                            stage: self.stage,
                            from: peer,
                            mb: p.mb,
                            what: "room on the link",
                            waited: self.timeout,
                        });
                    }
                    packet = p;
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
            }
        }
    }

    fn recv(&self, peer: u32, flow: Flow, mb: u32) -> Result<Vec<WireTensor>, ExecError> {
        let what = match flow {
            Flow::Activation => "activation",
            Flow::Gradient => "gradient",
        };
        if let (None, Some(end)) = (self.from.get(&(peer, flow)), self.remote.get(&peer)) {
            return end.recv((self.stage, peer), flow, mb, self.timeout);
        }
        let rx = self.from.get(&(peer, flow)).ok_or(ExecError::LinkClosed {
            stage: self.stage,
            peer,
        })?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(ABORT_POLL)) {
                Ok(p) if p.mb == mb => return Ok(p.tensors),
                Ok(p) => {
                    return Err(ExecError::OutOfOrder {
                        stage: self.stage,
                        from: peer,
                        expected: mb,
                        got: p.mb,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ExecError::LinkClosed {
                        stage: self.stage,
                        peer,
                    });
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.abort.load(Ordering::Relaxed) {
                        return Err(self.aborted());
                    }
                    if left.is_zero() {
                        return Err(ExecError::Timeout {
                            stage: self.stage,
                            from: peer,
                            mb,
                            what,
                            waited: self.timeout,
                        });
                    }
                }
            }
        }
    }
}

/// What a stage did in one step.
#[derive(Debug, Clone, Default)]
pub(crate) struct StageStepRecord {
    /// The instructions executed, in order, with their start and end.
    pub executed: Vec<(Instr, Instant, Instant)>,
    /// Micro-batch losses (last stage only).
    pub losses: Vec<f32>,
    /// The most bytes of boundary tensors (stashed inputs and outputs of micro-batches
    /// awaiting their backward) held at once during the step. A proxy for activation memory:
    /// the autodiff graph inside the stage is not counted.
    pub peak_stash_bytes: u64,
    /// The most micro-batches stashed at once.
    pub peak_stash: u32,
    /// When the step began (before its first instruction) and ended (after the optimizer).
    pub span: Option<(Instant, Instant)>,
    /// What the stage's blocks held, instruction by instruction (MEM-1, MEM-2).
    pub memory: StepMemory,
    /// When the gradient reduction and optimizer step began and ended.
    pub update: Option<(Instant, Instant)>,
    /// The collectives the step's forwards and backwards issued for its blocks (gathers,
    /// gradient reductions), as they ran: on the communication thread, overlapping the
    /// instructions, when blocks may be in flight.
    pub collectives: Vec<sync::Span>,
    /// The learning rate of the update (`None`: no update, the step was skipped).
    pub learning_rate: Option<f64>,
    /// With a loss scale: whether the step's reduced gradient overflowed on any block of any
    /// replica, and was skipped (MIX-2).
    pub overflow: Option<bool>,
}

/// A timeline (microseconds) as a Chrome trace (Perfetto, `chrome://tracing`): one row per
/// stage, one box per instruction.
pub fn chrome_trace(timeline: &[Vec<TimedInstr>]) -> String {
    let events: Vec<serde_json::Value> = timeline
        .iter()
        .enumerate()
        .flat_map(|(stage, list)| {
            list.iter().map(move |t| {
                serde_json::json!({
                    "name": format!("{:?} mb{} chunk{}", t.instr.kind(), t.instr.mb().0, t.instr.chunk().0),
                    "ph": "X", "ts": t.start, "dur": t.end - t.start,
                    "pid": 0, "tid": stage,
                })
            })
        })
        .collect();
    serde_json::json!({ "traceEvents": events }).to_string()
}

fn boundary_bytes(b: &Boundary) -> u64 {
    b.iter()
        .map(|t| {
            let n: usize = match t {
                AnyTensor::D1(t) => t.dims().iter().product(),
                AnyTensor::D2(t) => t.dims().iter().product(),
                AnyTensor::D3(t) => t.dims().iter().product(),
                AnyTensor::D4(t) => t.dims().iter().product(),
            };
            4 * n as u64
        })
        .sum()
}

/// What one stage needs to run one step of a schedule.
pub(crate) struct StepContext<'a, I> {
    /// The lists of every stage.
    pub schedule: &'a PipelineSchedule,
    /// Which stage this is.
    pub stage: StageIndex,
    /// This stage's ends of the links.
    pub links: &'a StageLinks,
    /// The items of each micro-batch (the same on every stage of a pipeline).
    pub micro_batches: &'a [Vec<I>],
    /// Builds the first block's boundary from a micro-batch's items (autodiff device).
    pub inputs: &'a dyn Fn(&[I], &Device) -> Boundary,
    /// The communicator of this stage's data-parallel group (the same stage in every
    /// pipeline replica), if there is more than one replica.
    pub replicas: Option<&'a mut Communicator>,
    /// Clip the step's gradient to this global L2 norm over all the stage's blocks (a block
    /// job's stage holds every block).
    pub clip: Option<f32>,
    /// Called before each instruction runs (progress for heartbeats and failure reports).
    pub on_instr: &'a dyn Fn(&Instr),
    /// How many blocks' gathered parameters may wait for their use at once, the gathers
    /// and gradient reductions running on a communication thread meanwhile (OVL-1); 0: the
    /// collectives run in place, each when its result is needed.
    pub blocks_in_flight: usize,
    /// The fault plan's hooks, called around every forward and backward, with the device
    /// and the step they are called for.
    pub faults: Option<(&'a crate::faults::FaultHooks, crate::mesh::DeviceId, u64)>,
    /// f16's loss scale: the last block multiplies its loss by it, the reduced gradients are
    /// divided by it, and an overflow anywhere skips the step everywhere (MIX-2).
    pub loss_scale: Option<f32>,
}

impl<I> std::fmt::Debug for StepContext<'_, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepContext(stage {})", self.stage.0)
    }
}

/// Run one training step of a stage holding `chunks` (its v model chunks, in chunk order) by
/// executing its list literally (EXEC-1), then the optimizer step of every chunk over the mean
/// of the micro-batches (EXEC-2), averaged over the data-parallel replicas when there are
/// several (EXEC-3).
pub(crate) fn run_stage_step<I>(
    chunks: &mut [Box<dyn StageWork<I>>],
    cx: StepContext<'_, I>,
) -> Result<StageStepRecord, ExecError> {
    let me = cx.stage;
    let plan = cx.schedule;
    let v = plan.virtual_stages();
    if chunks.len() != v as usize {
        return Err(ExecError::Unsupported(format!(
            "stage {} holds {} model chunks but the schedule has {v} per stage",
            me.0,
            chunks.len()
        )));
    }
    // EXEC-4: a step starts from nothing of an earlier, failed attempt (stash, accumulated
    // gradients, losses), so a redone step is the step itself.
    for chunk in chunks.iter_mut() {
        chunk.begin_step();
        chunk.set_loss_scale(cx.loss_scale.unwrap_or(1.0));
    }
    let mut cx = cx;
    let mut replicas = cx.replicas.take();
    let rank_of = replicas
        .as_ref()
        .map_or((0, 1), |c| (c.rank().index(), c.world()));
    let scale =
        1.0 / (plan.micro_batches() as usize * rank_of.1) as f32 / cx.loss_scale.unwrap_or(1.0);
    let mut record = StageStepRecord::default();
    let began = Instant::now();
    record.memory.record(0, chunks.iter().map(|c| c.memory()));
    // The step's forwards and backwards, with their collectives on the lane: overlapped
    // with the compute when blocks may be in flight (OVL-1), in place otherwise.
    let threaded = cx.blocks_in_flight > 0;
    with_lane(replicas.as_deref_mut(), threaded, me.0, |lane| {
        let mut walk = Walk::new(chunks, &cx, rank_of, scale, began);
        let out = walk.run(lane, &mut record);
        record.collectives = lane.take_spans();
        out
    })?;
    let since = |t: Instant| t.saturating_duration_since(began).as_micros() as u64;
    let t = Instant::now();
    // MIX-2: an overflow in any block of any replica skips the step on every replica (the
    // flags of every block, all-reduced over the stage's group).
    if cx.loss_scale.is_some() {
        let mut found = [f32::from(u8::from(chunks.iter().any(|c| c.overflowed())))];
        if let Some(comm) = replicas.as_deref_mut().filter(|c| c.world() > 1) {
            comm.all_reduce(&mut found, crate::comm::ReduceOp::Max)?;
        }
        let overflow = found[0] > 0.0;
        record.overflow = Some(overflow);
        if overflow {
            for chunk in chunks.iter_mut() {
                record.losses.extend(chunk.take_losses());
            }
            record.span = Some((began, Instant::now()));
            return Ok(record);
        }
    }
    if let Some(max) = cx.clip {
        let sums: Vec<_> = chunks.iter().map(|c| c.norm_part()).collect();
        let partial = sums.iter().any(|s| s.is_some_and(|(_, p)| p));
        let total: f64 = sums.iter().flatten().map(|(v, _)| v).sum();
        // The same arithmetic as ZeRO's clipping: each rank's sum, all-reduced in f32.
        let mut sum = [total as f32];
        if partial && let Some(comm) = replicas.as_deref_mut().filter(|c| c.world() > 1) {
            comm.all_reduce(&mut sum, crate::comm::ReduceOp::Sum)?;
        }
        let norm = if partial {
            f64::from(sum[0]).sqrt() as f32
        } else {
            total.sqrt() as f32
        };
        for chunk in chunks.iter_mut() {
            chunk.clip(norm, max);
        }
    }
    for chunk in chunks.iter_mut() {
        let rate = hooked(&cx, 0, Phase::Update, || {
            chunk.apply(replicas.as_deref_mut())
        })?;
        record.learning_rate = Some(rate);
        record.losses.extend(chunk.take_losses());
    }
    record
        .memory
        .record(since(Instant::now()), chunks.iter().map(|c| c.memory()));
    record.update = Some((t, Instant::now()));
    record.span = Some((began, Instant::now()));
    Ok(record)
}

/// A gather issued ahead of its use: the instruction it is for, the chunk, its ticket
/// (`None`: the block needed no collective) and the bytes of full parameters it brings.
type Prefetched = (usize, u32, Option<Ticket>, u64);

/// One step's walk over a stage's list: the instructions, the gathers issued ahead of their
/// use (at most `blocks_in_flight` gathered but unused, EXEC-5) and the reductions in flight.
struct Walk<'w, 'c, I> {
    chunks: &'w mut [Box<dyn StageWork<I>>],
    cx: &'w StepContext<'c, I>,
    rank_of: (usize, usize),
    scale: f32,
    began: Instant,
    /// Every gather of the step, in list order: (instruction index, chunk).
    gathers: Vec<(usize, u32)>,
    /// The next of `gathers` to issue.
    next_gather: usize,
    /// Issued, not yet taken by their block, in order.
    prefetched: std::collections::VecDeque<Prefetched>,
    /// Reductions issued, not yet taken: (chunk, ticket), in order.
    reducing: std::collections::VecDeque<(u32, Ticket)>,
}

impl<'w, 'c, I> Walk<'w, 'c, I> {
    fn new(
        chunks: &'w mut [Box<dyn StageWork<I>>],
        cx: &'w StepContext<'c, I>,
        rank_of: (usize, usize),
        scale: f32,
        began: Instant,
    ) -> Self {
        let list = cx.schedule.list(cx.stage);
        // Each chunk's uses in list order, and where each sits in the list.
        let mut uses: Vec<Vec<(usize, Option<u32>)>> = vec![Vec::new(); chunks.len()];
        for (i, instr) in list.iter().enumerate() {
            let u = match *instr {
                Instr::Forward { .. } => None,
                Instr::Backward { mb, .. } => Some(mb.0),
                _ => continue,
            };
            if let Some(c) = uses.get_mut(instr.chunk().0 as usize) {
                c.push((i, u));
            }
        }
        let mut gathers: Vec<(usize, u32)> = uses
            .iter()
            .enumerate()
            .flat_map(|(c, u)| {
                let plan = chunks[c].gather_plan(&u.iter().map(|(_, u)| *u).collect::<Vec<_>>());
                u.iter()
                    .zip(plan)
                    .filter(|(_, need)| *need)
                    .map(move |((i, _), _)| (*i, c as u32))
                    .collect::<Vec<_>>()
            })
            .collect();
        gathers.sort_unstable();
        Self {
            chunks,
            cx,
            rank_of,
            scale,
            began,
            gathers,
            next_gather: 0,
            prefetched: std::collections::VecDeque::new(),
            reducing: std::collections::VecDeque::new(),
        }
    }

    fn block(&self, chunk: u32) -> u32 {
        self.cx.schedule.block(self.cx.stage, Chunk(chunk))
    }

    fn in_flight(&self) -> usize {
        self.cx.blocks_in_flight
    }

    /// Record what the blocks hold now, with the prefetched full parameters (MEM-1).
    fn record_memory(&self, record: &mut StageStepRecord) {
        let prefetched: u64 = self.prefetched.iter().map(|p| p.3).sum();
        let at = self.began.elapsed().as_micros() as u64;
        record.memory.record(
            at,
            self.chunks
                .iter()
                .map(|c| c.memory())
                .chain(std::iter::once(BlockBytes {
                    full_params: prefetched,
                    ..BlockBytes::default()
                })),
        );
    }

    /// Issue the next gather of the step.
    fn issue_gather(&mut self, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let Some(&(at, chunk)) = self.gathers.get(self.next_gather) else {
            return Ok(());
        };
        self.next_gather += 1;
        let block = self.block(chunk);
        let rank_of = self.rank_of;
        let prefetched = match self.chunk(chunk)?.start_gather(rank_of)? {
            Some(c) => {
                let bytes = c.output_bytes();
                (at, chunk, Some(lane.issue(block, c)), bytes)
            }
            None => (at, chunk, None, 0),
        };
        self.prefetched.push_back(prefetched);
        Ok(())
    }

    fn chunk(&mut self, chunk: u32) -> Result<&mut Box<dyn StageWork<I>>, ExecError> {
        let stage = self.cx.stage.0;
        self.chunks
            .get_mut(chunk as usize)
            .ok_or_else(|| ExecError::MissingInput {
                stage,
                mb: 0,
                instr: format!("a gather or reduction of chunk {chunk}"),
            })
    }

    /// Before instruction `index` computes: its block's parameters, if it gathers them (the
    /// gather issued now if not ahead), then the next gathers up to the window (OVL-2).
    fn gather_for(&mut self, index: usize, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let needed = self.gathers.get(self.next_gather - self.prefetched.len());
        if needed.is_some_and(|&(at, _)| at == index) {
            if self.prefetched.is_empty() {
                self.issue_gather(lane)?;
            }
            let (at, chunk, ticket, _) = self
                .prefetched
                .pop_front()
                .expect("issued just above if not ahead");
            debug_assert_eq!(at, index, "gathers are taken in list order");
            if let Some(ticket) = ticket {
                let full = lane.wait(ticket)?;
                self.chunk(chunk)?.finish_gather(full);
            }
        }
        while self.prefetched.len() < self.in_flight() && self.next_gather < self.gathers.len() {
            self.issue_gather(lane)?;
        }
        Ok(())
    }

    /// Right after `chunk`'s last backward: issue its reduction; keep at most
    /// `blocks_in_flight` in flight (none without overlap).
    fn reduce(&mut self, chunk: u32, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let block = self.block(chunk);
        let rank_of = self.rank_of;
        let stage = self.cx.stage.0;
        let collective = self
            .chunk(chunk)?
            .start_reduce(rank_of)
            .map_err(|e| e.in_block(stage, block))?;
        let ticket = lane.issue(block, collective);
        self.reducing.push_back((chunk, ticket));
        while self.reducing.len() > self.in_flight() {
            self.take_reduction(lane)?;
        }
        Ok(())
    }

    fn take_reduction(&mut self, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let Some((chunk, ticket)) = self.reducing.pop_front() else {
            return Ok(());
        };
        let out = lane.wait(ticket)?;
        let (scale, rank_of) = (self.scale, self.rank_of);
        self.chunk(chunk)?.finish_reduce(out, scale, rank_of)
    }

    /// Execute the list (EXEC-1), then take every reduction.
    fn run(
        &mut self,
        lane: &mut CommLane<'_>,
        record: &mut StageStepRecord,
    ) -> Result<(), ExecError> {
        let cx = self.cx;
        let me = cx.stage;
        let plan = cx.schedule;
        // Each chunk's gradient is reduced right after its last backward of the step, while
        // the earlier blocks' backwards are still to come (every replica at the same point,
        // FSDP-2).
        let mut last_backward: HashMap<u32, usize> = HashMap::new();
        for (i, instr) in plan.list(me).iter().enumerate() {
            if let Instr::Backward { chunk, .. } = instr {
                last_backward.insert(chunk.0, i);
            }
        }
        // Keyed by (micro-batch, local chunk).
        let mut inbox: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let mut outbox: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let mut grads_in: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let mut grads_out: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let missing = |instr: &Instr| ExecError::MissingInput {
            stage: me.0,
            mb: instr.mb().0,
            instr: format!("{instr:?}"),
        };
        for (index, instr) in plan.list(me).iter().enumerate() {
            (cx.on_instr)(instr);
            let key = (instr.mb().0, instr.chunk().0);
            let first_block = plan.block(me, instr.chunk()) == 0;
            if matches!(instr, Instr::Forward { .. } | Instr::Backward { .. }) {
                self.gather_for(index, lane)?;
                // The peak: this block's parameters and those gathered ahead (MEM-2).
                self.record_memory(record);
            }
            // The instruction's span is its own work: a gather waited for before it and the
            // reduction issued after it are the collectives' spans (so the breakdown tells
            // what overlapped).
            let t0 = Instant::now();
            let mut reduce = None;
            let work = self
                .chunks
                .get_mut(instr.chunk().0 as usize)
                .ok_or_else(|| missing(instr))?;
            match *instr {
                Instr::RecvActivation { mb, from, .. } => {
                    let msg = cx.links.recv(from.0, Flow::Activation, mb.0)?;
                    inbox.insert(key, msg);
                }
                Instr::Forward { mb, .. } => {
                    let items = cx
                        .micro_batches
                        .get(mb.0 as usize)
                        .ok_or_else(|| missing(instr))?;
                    let device = work.device().clone();
                    let input = if first_block {
                        (cx.inputs)(items, &device)
                    } else {
                        inbox
                            .remove(&key)
                            .ok_or_else(|| missing(instr))?
                            .into_iter()
                            .map(|w| AnyTensor::from_wire(w, &device))
                            .collect::<Result<_, _>>()?
                    };
                    let block = plan.block(me, instr.chunk());
                    let out = hooked(cx, mb.0, Phase::Forward, || {
                        work.forward(mb.0, input, items, !first_block)
                    })
                    .map_err(|e| e.in_block(me.0, block))?;
                    if let Some(out) = out {
                        outbox.insert(key, out.iter().map(AnyTensor::to_wire).collect());
                    }
                }
                Instr::SendActivation { mb, to, .. } => {
                    let tensors = outbox.remove(&key).ok_or_else(|| missing(instr))?;
                    cx.links
                        .send(to.0, Flow::Activation, Packet { mb: mb.0, tensors })?;
                }
                Instr::RecvGradient { mb, from, .. } => {
                    let msg = cx.links.recv(from.0, Flow::Gradient, mb.0)?;
                    grads_in.insert(key, msg);
                }
                Instr::Backward { mb, .. } => {
                    let g = grads_in.remove(&key);
                    let upstream = hooked(cx, mb.0, Phase::Backward, || work.backward(mb.0, g));
                    let upstream = upstream.map_err(|e| match e {
                        ExecError::MissingInput { mb, instr, .. } => ExecError::MissingInput {
                            stage: me.0,
                            mb,
                            instr,
                        },
                        ExecError::ShapeMismatch { mb, .. } => {
                            ExecError::ShapeMismatch { stage: me.0, mb }
                        }
                        other => other.in_block(me.0, plan.block(me, instr.chunk())),
                    })?;
                    grads_out.insert(key, upstream);
                    if last_backward.get(&instr.chunk().0) == Some(&index) {
                        reduce = Some(instr.chunk().0);
                    }
                }
                Instr::SendGradient { mb, to, .. } => {
                    let tensors = grads_out.remove(&key).ok_or_else(|| missing(instr))?;
                    cx.links
                        .send(to.0, Flow::Gradient, Packet { mb: mb.0, tensors })?;
                }
            }
            record.executed.push((*instr, t0, Instant::now()));
            if let Some(chunk) = reduce {
                self.reduce(chunk, lane)?;
            }
            let (count, bytes) = self
                .chunks
                .iter()
                .map(|c| c.stashed())
                .fold((0, 0), |(n, b), (n2, b2)| (n + n2, b + b2));
            record.peak_stash = record.peak_stash.max(count);
            record.peak_stash_bytes = record.peak_stash_bytes.max(bytes);
            self.record_memory(record);
        }
        // A chunk the list never ran backward on (none in a valid schedule) reduces now.
        for chunk in 0..self.chunks.len() as u32 {
            let pending = self.reducing.iter().any(|(c, _)| *c == chunk);
            if !pending && !self.chunk(chunk)?.reduced() {
                self.reduce(chunk, lane)?;
            }
        }
        while !self.reducing.is_empty() {
            self.take_reduction(lane)?;
        }
        self.record_memory(record);
        Ok(())
    }
}

/// Run a forward or backward under the fault plan's hooks, if any.
fn hooked<I, R>(cx: &StepContext<'_, I>, mb: u32, phase: Phase, f: impl FnOnce() -> R) -> R {
    match cx.faults {
        Some((hooks, device, step)) => with_hooks(Some(hooks), device, step, mb, phase, f),
        None => f(),
    }
}

/// Builds the first block's boundary from a micro-batch's items on a device.
pub(crate) type InputsFn<I> = Arc<dyn Fn(&[I], &Device) -> Boundary + Send + Sync>;
