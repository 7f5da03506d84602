//! Executing pipeline schedules: a stage runs its instruction list literally.
//!
//! `run_stage_step` (crate-internal, like the rest of the executor) is one stage's step, called on its device thread by
//! the runtime's `PipelineStageActor`: it walks the
//! stage's list over the stage's v model chunks (`BlockStep`, the walk's part of `StageWork`; usually a `TypedStage`),
//! moving activations and gradients over `StageLinks`: one bounded FIFO per peer and direction
//! of data, built from the schedule's sends (so interleaved schedules get their wrap-around
//! links), holding [`link_capacity`](crate::parallel::pipeline::PipelineSchedule::link_capacity) messages (a fast stage
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
//!   block's gradient reduction) go through the stage's `CommLane` (`parallel::pipeline_exec::overlap`): with
//!   `blocks_in_flight` n > 0 on a communication thread, the gathers issued in list order at
//!   most n ahead of their use (so at most n gathered-but-unused blocks exist besides the one
//!   computing, MEM-3) and at most n reductions in flight, each issued right after its block's
//!   last backward and all taken before the clip and the update; with n = 0 each in place when
//!   its result is needed. Which uses gather is decided from the blocks' options at the step's
//!   start (`BlockStep::gather_plan`), so every replica issues the same collectives in the same
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
//! - CLIP-1: the global norm of `clip_grad_norm` counts each element of the one-device model
//!   once. Over a replica's model group (its stages × tensor-parallel ranks), a split
//!   parameter's slice is counted by the rank that holds it; every parameter that each
//!   tensor-parallel rank holds whole (a split block's replicated ones, every parameter of an
//!   ordinary block, which each rank runs whole) by tensor-parallel rank 0 only. Under ZeRO
//!   each rank counts the part of those it owns and the sum goes over its data-parallel group
//!   first (`BlockStep::norm_part`).
//!
//! - **MIX-3** the loss scaler's `ScalerState` is `TrainingState::loss_scale` (CKPT-9): saved by a
//!   data-parallel slot and a block stage, restored on resume, roll-back and growth.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use super::gradients::parameter_fingerprint;
use super::memory::BlockBytes;
use super::sync::{self, Collective, GradientSync, Reduction, SyncContext};
use super::tensor::{TensorParallel, TpFailure};
use super::zero::{UnsupportedOptimizer, ZeroStage};
use crate::checkpoint::{CheckpointError, LrSchedulerState, OptimizerState, ShardParams};
use crate::comm::Communicator;
use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::autocast::low_precision_copy;
use crate::precision::Precision;

mod block;
mod error;
mod links;
mod overlap;
mod timeline;
mod typed_stage;
mod walk;
mod wire;
mod work;

pub(crate) use block::{BlockInput, BlockStep};
pub use error::ExecError;
#[cfg(feature = "cluster")]
pub(crate) use links::remote_links;
use links::{Flow, Packet};
pub(crate) use links::{StageLinks, links};
pub(crate) use timeline::StageStepRecord;
pub use timeline::chrome_trace;
pub(crate) use typed_stage::TypedStage;
pub(crate) use walk::{StepContext, run_stage_step};
#[cfg(feature = "cluster")]
pub(crate) use wire::PacketWire;
pub use wire::WireError;
pub(crate) use work::StageWork;

/// The groups a pipeline rank shares with the rest of its replica's model, beside its
/// data-parallel group: its tensor-parallel group (none at tp = 1) and the group of every
/// stage and tensor-parallel rank of its replica (none when a replica is one rank), where a
/// step agrees on what spans the model: the global gradient norm and f16's overflow.
#[derive(Default)]
pub(crate) struct ModelGroups {
    /// The rank's tensor-parallel group.
    pub(crate) tp: Option<Communicator>,
    /// Every stage × tensor-parallel rank of the rank's replica, in rank order.
    pub(crate) replica: Option<Communicator>,
}

/// Gradient buckets of the data-parallel reduction between pipeline replicas.
const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;
/// Tensors below this many elements are fused into one bucket.
const FUSE_BELOW: usize = 64 * 1024;

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
        let rank = w.dims.len();
        let data = TensorData::new(w.values, w.dims);
        Ok(match rank {
            1 => AnyTensor::D1(Tensor::from_data(data, device)),
            2 => AnyTensor::D2(Tensor::from_data(data, device)),
            3 => AnyTensor::D3(Tensor::from_data(data, device)),
            4 => AnyTensor::D4(Tensor::from_data(data, device)),
            rank => return Err(ExecError::UnsupportedRank { rank }),
        })
    }

    /// The tensor in `dtype` (a received `f32` boundary handed to a block computing in 16
    /// bits: meshwork's cast, not the model's, item 3 of mixed precision on a model as it is).
    fn cast(self, dtype: FloatDType) -> Self {
        each_rank!(self, t => t.cast(dtype))
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

/// Builds the first block's boundary from a micro-batch's items on a device.
pub(crate) type InputsFn<I> = Arc<dyn Fn(&[I], &Device) -> Boundary + Send + Sync>;
