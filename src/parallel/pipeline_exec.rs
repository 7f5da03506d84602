//! Executing pipeline schedules: a stage runs its instruction list literally.
//!
//! First slice of pipeline execution (issue 3): stages in one process, one OS thread each,
//! connected by bounded links (a queue of one message per direction and neighbour pair, the
//! capacity the schedules assume — a fast stage cannot run ahead without limit), schedules with
//! one model chunk per stage (GPipe, 1F1B; interleaved needs chunked stage modules and is
//! refused). Not yet wired into `Job` nor combined with data parallelism.
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

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor, TensorData};

use super::buckets::plan_buckets;
use super::gradients::{GradientBuffers, ParamLayout, parameter_fingerprint, reduce_buckets};
use crate::comm::{CommError, Communicator, ReduceOp};

/// Gradient buckets of the data-parallel reduction between pipeline replicas.
const BUCKET_ELEMS: usize = 25 * 1024 * 1024 / 4;
/// Tensors below this many elements are fused into one bucket.
const FUSE_BELOW: usize = 64 * 1024;
use super::pipeline::{Instr, PipelineSchedule, StageIndex, TimedInstr};
use crate::optim::{LearningRate, OptimizerConfig};

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
pub struct WireTensor {
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

    /// `(self · other).sum()` for tensors of the same rank.
    fn dot(&self, other: &AnyTensor) -> Option<Tensor<1>> {
        Some(match (self, other) {
            (AnyTensor::D1(a), AnyTensor::D1(b)) => (a.clone() * b.clone()).sum(),
            (AnyTensor::D2(a), AnyTensor::D2(b)) => (a.clone() * b.clone()).sum(),
            (AnyTensor::D3(a), AnyTensor::D3(b)) => (a.clone() * b.clone()).sum(),
            (AnyTensor::D4(a), AnyTensor::D4(b)) => (a.clone() * b.clone()).sum(),
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
    /// The schedule needs something this executor does not do yet.
    #[error("unsupported schedule: {0}")]
    Unsupported(String),
}

/// One stage's work, independent of its module type.
pub trait StageWork<I>: Send {
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
    ) -> Option<Boundary>;
    /// Backward of a micro-batch from the received output gradient (`None` on the last stage);
    /// returns the gradients of the stage's inputs, to send upstream.
    fn backward(
        &mut self,
        mb: u32,
        grad_out: Option<Vec<WireTensor>>,
    ) -> Result<Vec<WireTensor>, ExecError>;
    /// Optimizer step with the accumulated gradients: summed over the data-parallel replicas
    /// of this stage through `replicas` (when given), then scaled by `scale`.
    fn step(&mut self, scale: f32, replicas: Option<&mut Communicator>) -> Result<(), ExecError>;
    /// The loss of each micro-batch seen since the last step (last stage only).
    fn take_losses(&mut self) -> Vec<f32>;
    /// Micro-batches stashed now and the bytes of their boundary tensors.
    fn stashed(&self) -> (u32, u64);
    /// Fingerprint of the stage's parameters.
    fn fingerprint(&self) -> u64;
    /// The module, type-erased (for `downcast`).
    fn into_module(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

type ForwardFn<M> = Box<dyn Fn(&M, Boundary) -> Boundary + Send>;
type LossFn<M, I> = Box<dyn Fn(&M, Boundary, &[I], &Device) -> Tensor<1> + Send>;

/// One stage of a pipeline: a Burn module, what it computes, its optimizer.
pub struct TypedStage<M: Module, I> {
    model: M,
    device: Device,
    forward: Option<ForwardFn<M>>,
    loss: Option<LossFn<M, I>>,
    optimizer: ModuleOptimizer,
    lr: LearningRate,
    layout: ParamLayout,
    stash: HashMap<u32, (Boundary, Stashed)>,
    accumulated: GradientsAccumulator<M>,
    losses: Vec<f32>,
    recompute: bool,
    /// How gradients are grouped for the replicas' all-reduce (planned once).
    buckets: Vec<super::buckets::Bucket>,
    /// The buffer fused buckets are copied into (reused across steps).
    fusion: Vec<f32>,
    /// False on the first stage (set by each forward).
    input_grads: bool,
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
    pub fn new(
        model: M,
        forward: impl Fn(&M, Boundary) -> Boundary + Send + 'static,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        Self::build(model, Some(Box::new(forward)), None, optimizer, lr, device)
    }

    /// The last stage: its forward ends in the mean loss over the micro-batch's items.
    pub fn last(
        model: M,
        loss: impl Fn(&M, Boundary, &[I], &Device) -> Tensor<1> + Send + 'static,
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
        let layout = ParamLayout::trainable(&model);
        Self {
            buckets: plan_buckets(
                &layout
                    .slots()
                    .iter()
                    .map(|s| s.range.len())
                    .collect::<Vec<_>>(),
                BUCKET_ELEMS,
                FUSE_BELOW,
            ),
            fusion: Vec::new(),
            layout,
            model,
            device,
            forward,
            loss,
            optimizer: optimizer.init(),
            lr,
            stash: HashMap::new(),
            accumulated: GradientsAccumulator::new(),
            losses: Vec::new(),
            recompute: false,
            input_grads: true,
        }
    }

    /// Keep only each micro-batch's inputs between its forward and its backward, and run the
    /// forward again during backward: less memory for more compute (activation
    /// checkpointing). Has no effect on the last stage, whose backward follows its forward. A
    /// forward that draws random numbers (dropout) draws them again when recomputed.
    pub fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// The device (with autodiff) the stage computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl<M: Module + 'static, I: 'static> StageWork<I> for TypedStage<M, I> {
    fn forward(
        &mut self,
        mb: u32,
        input: Boundary,
        items: &[I],
        input_grads: bool,
    ) -> Option<Boundary> {
        self.input_grads = input_grads;
        let leaves: Boundary = if input_grads {
            input.into_iter().map(AnyTensor::require_grad).collect()
        } else {
            input
        };
        if let Some(loss) = &self.loss {
            let l = loss(&self.model, leaves.clone(), items, &self.device);
            self.losses.push(l.clone().into_scalar());
            self.stash.insert(mb, (leaves, Stashed::Loss(Box::new(l))));
            None
        } else {
            let forward = self
                .forward
                .as_ref()
                .expect("a stage has a forward or a loss");
            let out = forward(&self.model, leaves.clone());
            if self.recompute {
                // Keep the inputs' values only: no graph survives until the backward.
                let inputs = leaves.iter().map(AnyTensor::detached).collect();
                self.stash.insert(mb, (inputs, Stashed::Nothing));
            } else {
                self.stash
                    .insert(mb, (leaves, Stashed::Outputs(out.clone())));
            }
            Some(out)
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
                let out = forward(&self.model, leaves.clone());
                (leaves, Stashed::Outputs(out))
            }
            other => (leaves, other),
        };
        let mut grads = match (stashed, grad_out) {
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
                total
                    .ok_or_else(|| missing("backward (no outputs)"))?
                    .backward()
            }
            (Stashed::Outputs(_), None) => return Err(missing("backward (no gradient)")),
            (Stashed::Nothing, _) => unreachable!("recomputed above"),
        };
        let upstream = if self.input_grads {
            leaves.iter().map(|x| x.grad_wire(&grads)).collect()
        } else {
            Vec::new()
        };
        let params = GradientsParams::from_module(&mut grads, &self.model);
        self.accumulated.accumulate(&self.model, params);
        Ok(upstream)
    }

    fn step(&mut self, scale: f32, replicas: Option<&mut Communicator>) -> Result<(), ExecError> {
        let grads = self.accumulated.grads();
        let mut buffers = GradientBuffers::take(&self.model, &self.layout, grads);
        let mut views = buffers.slices_mut();
        if let Some(comm) = replicas {
            reduce_buckets(&mut views, &self.buckets, &mut self.fusion, |b| {
                comm.all_reduce(b, ReduceOp::Sum)
            })?;
        }
        for v in views.iter_mut() {
            v.iter_mut().for_each(|g| *g *= scale);
        }
        drop(views);
        let grads = buffers.into_gradients(&self.model, &self.device.clone().inner());
        let lr = self.lr.next_rate();
        let model = self.model.clone();
        self.model = self.optimizer.step(lr, model, grads);
        Ok(())
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

    fn into_module(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        Box::new(self.model)
    }
}

/// The two ends of one stage's links: to and from each neighbour.
#[derive(Debug)]
pub struct StageLinks {
    stage: u32,
    to_next: Option<SyncSender<Vec<WireTensor>>>,
    from_next: Option<Receiver<Vec<WireTensor>>>,
    to_prev: Option<SyncSender<Vec<WireTensor>>>,
    from_prev: Option<Receiver<Vec<WireTensor>>>,
    timeout: Duration,
}

/// Bounded links for a line of `stages` stages, one message of capacity per direction (the
/// capacity the schedules assume, PIPE-4).
pub fn links(stages: u32, timeout: Duration) -> Vec<StageLinks> {
    let mut out: Vec<StageLinks> = (0..stages)
        .map(|stage| StageLinks {
            stage,
            to_next: None,
            from_next: None,
            to_prev: None,
            from_prev: None,
            timeout,
        })
        .collect();
    for s in 1..stages as usize {
        let (fwd_tx, fwd_rx) = sync_channel(1);
        let (bwd_tx, bwd_rx) = sync_channel(1);
        out[s - 1].to_next = Some(fwd_tx);
        out[s].from_prev = Some(fwd_rx);
        out[s].to_prev = Some(bwd_tx);
        out[s - 1].from_next = Some(bwd_rx);
    }
    out
}

impl StageLinks {
    fn send(&self, to_next: bool, msg: Vec<WireTensor>) -> Result<(), ExecError> {
        let (tx, peer) = if to_next {
            (&self.to_next, self.stage + 1)
        } else {
            (&self.to_prev, self.stage.wrapping_sub(1))
        };
        let closed = ExecError::LinkClosed {
            stage: self.stage,
            peer,
        };
        let tx = tx.as_ref().ok_or(closed.clone())?;
        // Bounded: wait for room, but never forever (the receiver may have failed).
        let deadline = Instant::now() + self.timeout;
        let mut msg = msg;
        loop {
            match tx.try_send(msg) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => return Err(closed),
                Err(TrySendError::Full(m)) => {
                    if Instant::now() >= deadline {
                        return Err(closed);
                    }
                    msg = m;
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }

    fn recv(
        &self,
        from_prev: bool,
        mb: u32,
        what: &'static str,
    ) -> Result<Vec<WireTensor>, ExecError> {
        let (rx, peer) = if from_prev {
            (&self.from_prev, self.stage.wrapping_sub(1))
        } else {
            (&self.from_next, self.stage + 1)
        };
        let rx = rx.as_ref().ok_or(ExecError::LinkClosed {
            stage: self.stage,
            peer,
        })?;
        rx.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => ExecError::Timeout {
                stage: self.stage,
                from: peer,
                mb,
                what,
                waited: self.timeout,
            },
            RecvTimeoutError::Disconnected => ExecError::LinkClosed {
                stage: self.stage,
                peer,
            },
        })
    }
}

/// What a stage did in one step.
#[derive(Debug, Clone, Default)]
pub struct StageStepRecord {
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
}

/// The recorded step of every stage as one timeline in microseconds from the step's first
/// instruction, ready for [`summarize`](super::pipeline::summarize) (the measured bubble, with
/// the simulator's definitions) and [`render_svg`](super::pipeline::render_svg).
pub fn recorded_timeline(stages: &[&StageStepRecord]) -> Vec<Vec<TimedInstr>> {
    let Some(origin) = stages
        .iter()
        .flat_map(|r| r.executed.iter().map(|(_, s, _)| *s))
        .min()
    else {
        return Vec::new();
    };
    stages
        .iter()
        .map(|r| {
            r.executed
                .iter()
                .map(|(instr, s, e)| TimedInstr {
                    instr: *instr,
                    start: s.duration_since(origin).as_micros() as u64,
                    end: e.duration_since(origin).as_micros() as u64,
                })
                .collect()
        })
        .collect()
}

/// The recorded steps as a Chrome trace (Perfetto, `chrome://tracing`): one row per stage,
/// one box per instruction.
pub fn chrome_trace(stages: &[&StageStepRecord]) -> String {
    let timeline = recorded_timeline(stages);
    let events: Vec<serde_json::Value> = timeline
        .iter()
        .enumerate()
        .flat_map(|(stage, list)| {
            list.iter().map(move |t| {
                serde_json::json!({
                    "name": format!("{:?} mb{}", t.instr.kind(), t.instr.mb().0),
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

/// Run one training step of `stage` (index `me`) by executing its list of `schedule`
/// literally (EXEC-1), then the optimizer step over the mean of the micro-batches (EXEC-2).
/// `micro_batches[m]` are the items of micro-batch `m`; `inputs` builds the first stage's
/// boundary from them. With `replicas` (the communicator of this stage's data-parallel
/// group: the same stage in every pipeline replica), gradients are averaged over the replicas
/// before the update (EXEC-3).
#[allow(clippy::too_many_arguments)]
pub fn run_stage_step<I>(
    stage: &mut dyn StageWork<I>,
    schedule: &PipelineSchedule,
    me: StageIndex,
    links: &StageLinks,
    micro_batches: &[Vec<I>],
    inputs: &dyn Fn(&[I]) -> Boundary,
    device: &Device,
    replicas: Option<&mut Communicator>,
) -> Result<StageStepRecord, ExecError> {
    if schedule.virtual_stages() != 1 {
        return Err(ExecError::Unsupported(
            "interleaved schedules need chunked stage modules".into(),
        ));
    }
    let mut record = StageStepRecord::default();
    let began = Instant::now();
    let mut inbox: HashMap<u32, Vec<WireTensor>> = HashMap::new();
    let mut outbox: HashMap<u32, Vec<WireTensor>> = HashMap::new();
    let mut grads_in: HashMap<u32, Vec<WireTensor>> = HashMap::new();
    let mut grads_out: HashMap<u32, Vec<WireTensor>> = HashMap::new();
    let ad = device.clone().autodiff();
    let missing = |mb: u32, instr: &Instr| ExecError::MissingInput {
        stage: me.0,
        mb,
        instr: format!("{instr:?}"),
    };
    for instr in schedule.list(me) {
        let t0 = Instant::now();
        match instr {
            Instr::RecvActivation { mb, .. } => {
                let msg = links.recv(true, mb.0, "activation")?;
                inbox.insert(mb.0, msg);
            }
            Instr::Forward { mb, .. } => {
                let items = micro_batches
                    .get(mb.0 as usize)
                    .ok_or_else(|| missing(mb.0, instr))?;
                let input = if me.0 == 0 {
                    inputs(items)
                } else {
                    inbox
                        .remove(&mb.0)
                        .ok_or_else(|| missing(mb.0, instr))?
                        .into_iter()
                        .map(|w| AnyTensor::from_wire(w, &ad))
                        .collect::<Result<_, _>>()?
                };
                if let Some(out) = stage.forward(mb.0, input, items, me.0 != 0) {
                    outbox.insert(mb.0, out.iter().map(AnyTensor::to_wire).collect());
                }
            }
            Instr::SendActivation { mb, .. } => {
                let msg = outbox.remove(&mb.0).ok_or_else(|| missing(mb.0, instr))?;
                links.send(true, msg)?;
            }
            Instr::RecvGradient { mb, .. } => {
                let msg = links.recv(false, mb.0, "gradient")?;
                grads_in.insert(mb.0, msg);
            }
            Instr::Backward { mb, .. } => {
                let g = grads_in.remove(&mb.0);
                let upstream = stage.backward(mb.0, g).map_err(|e| match e {
                    ExecError::MissingInput { mb, instr, .. } => ExecError::MissingInput {
                        stage: me.0,
                        mb,
                        instr,
                    },
                    ExecError::ShapeMismatch { mb, .. } => {
                        ExecError::ShapeMismatch { stage: me.0, mb }
                    }
                    other => other,
                })?;
                grads_out.insert(mb.0, upstream);
            }
            Instr::SendGradient { mb, .. } => {
                let msg = grads_out
                    .remove(&mb.0)
                    .ok_or_else(|| missing(mb.0, instr))?;
                links.send(false, msg)?;
            }
        }
        record.executed.push((*instr, t0, Instant::now()));
        let (count, bytes) = stage.stashed();
        record.peak_stash = record.peak_stash.max(count);
        record.peak_stash_bytes = record.peak_stash_bytes.max(bytes);
    }
    let world = replicas.as_ref().map_or(1, |c| c.world());
    stage.step(
        1.0 / (schedule.micro_batches() as usize * world) as f32,
        replicas,
    )?;
    record.losses = stage.take_losses();
    record.span = Some((began, Instant::now()));
    Ok(record)
}

/// Builds the first stage's boundary from a micro-batch's items on that stage's device.
pub type InputsFn<I> = std::sync::Arc<dyn Fn(&[I], &Device) -> Boundary + Send + Sync>;

/// The outcome of [`train_pipeline`]: the stages (with their trained modules) and what each
/// did at every step.
pub struct PipelineRun<I> {
    /// The stages, in pipeline order.
    pub stages: Vec<Box<dyn StageWork<I>>>,
    /// `records[stage][step]`.
    pub records: Vec<Vec<StageStepRecord>>,
}

impl<I> std::fmt::Debug for PipelineRun<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PipelineRun({} stages)", self.stages.len())
    }
}

/// Train a pipeline in this process: one OS thread per stage, bounded links between
/// neighbours, `schedule` executed literally on every stage, one optimizer step per entry of
/// `batches` (each global batch cut into the schedule's micro-batches). `inputs` builds the
/// first stage's boundary from a micro-batch's items on that stage's device. Every wait is
/// bounded by `timeout`; the first stage error ends the run (its neighbours then fail on
/// their closed links) and is returned.
pub fn train_pipeline<I: Clone + Send + Sync + 'static>(
    stages: Vec<Box<dyn StageWork<I>>>,
    schedule: &super::pipeline::Schedule,
    batches: Vec<Vec<I>>,
    inputs: InputsFn<I>,
    device: &Device,
    timeout: Duration,
) -> Result<PipelineRun<I>, crate::error::Error> {
    let k = stages.len() as u32;
    let plan = std::sync::Arc::new(schedule.instructions(k)?);
    let m = schedule.micro_batches() as usize;
    if let Some(b) = batches.iter().find(|b| b.is_empty() || b.len() % m != 0) {
        return Err(crate::error::Error::InvalidConfig(format!(
            "a batch of {} samples does not split into {m} micro-batches",
            b.len()
        )));
    }
    let batches = std::sync::Arc::new(batches);
    let handles: Vec<_> = stages
        .into_iter()
        .zip(links(k, timeout))
        .enumerate()
        .map(|(i, (mut stage, link))| {
            let (plan, batches, inputs, device) = (
                plan.clone(),
                batches.clone(),
                inputs.clone(),
                device.clone(),
            );
            std::thread::Builder::new()
                .name(format!("meshwork-stage-{i}"))
                .spawn(move || {
                    let ad = device.clone().autodiff();
                    let build = move |items: &[I]| inputs(items, &ad);
                    let mut records = Vec::with_capacity(batches.len());
                    for batch in batches.iter() {
                        let micro: Vec<Vec<I>> =
                            batch.chunks(batch.len() / m).map(<[I]>::to_vec).collect();
                        let r = run_stage_step(
                            stage.as_mut(),
                            &plan,
                            StageIndex(i as u32),
                            &link,
                            &micro,
                            &build,
                            &device,
                            None,
                        );
                        match r {
                            Ok(r) => records.push(r),
                            // Dropping `link` here closes this stage's links: neighbours fail
                            // fast instead of waiting for their time-out.
                            Err(e) => return Err(e),
                        }
                    }
                    Ok((stage, records))
                })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| {
            crate::error::Error::Runtime(format!("could not start a stage thread: {e}"))
        })?;
    let mut out = PipelineRun {
        stages: Vec::new(),
        records: Vec::new(),
    };
    let mut first_error = None;
    for h in handles {
        match h.join() {
            Ok(Ok((stage, records))) => {
                out.stages.push(stage);
                out.records.push(records);
            }
            Ok(Err(e)) => {
                // A closed link is the consequence of another stage's failure.
                if first_error.is_none() || !matches!(e, ExecError::LinkClosed { .. }) {
                    first_error = Some(e);
                }
            }
            Err(p) => {
                first_error.get_or_insert(ExecError::Unsupported(format!(
                    "a stage panicked: {}",
                    crate::actors::panic_text(p.as_ref())
                )));
            }
        }
    }
    match first_error {
        Some(e) => Err(crate::error::Error::Pipeline(e)),
        None => Ok(out),
    }
}
