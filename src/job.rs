//! The embedding API: build a job, spawn it inside your tokio runtime, watch its events, get
//! the trained model back.
//!
//! ```text
//! Job::builder().model(f).loss(l).data(d).optimizer(AdamConfig::new())
//!     .data_parallel(2).batch_size(64).steps(100).build()?.spawn().await?.join().await?
//! ```
//!
//! JOB-1: invalid configurations are refused by `build()` with a message saying what to change.
//! JOB-2: a job lives inside the caller's runtime and leaves nothing behind: starting, stopping
//! and starting again in one process works (no global names).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use ractor::{Actor, ActorRef};
use tokio::sync::{broadcast, oneshot};

pub use crate::actors::checkpointer::CheckpointSink;
use crate::actors::parameter_server::SpawnServer;
use crate::actors::pipeline_stage::{LocalPipeline, PipelineSpec};
use crate::actors::spawner::Spawner;
use crate::actors::stage::{LocalReplicas, LossFn, MixedPrecision, ModelFn, StageSpec};
use crate::actors::supervisor::CheckpointSettings;
pub use crate::actors::supervisor::{JobStatus, RunSummary, Trained};
use crate::actors::supervisor::{Supervisor, SupervisorArgs, SupervisorMsg};
use crate::checkpoint::CheckpointStore;
use crate::comm::{Algorithm, CommConfig};
use crate::data::Dataset;
use crate::device::MeshDevice;
use crate::error::{Error, Result};
pub use crate::events::{JobEvent, PipelineStageStep, PipelineStep, ReplicaStep, StepDone};
use crate::faults::{FaultHooks, FaultPlan};
use crate::mesh::Layout;
pub use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::compress::{self, Compression};
use crate::parallel::local::LocalUpdates;
use crate::parallel::parameter_server::{self, ParameterServer};
pub use crate::parallel::pipeline::Schedule;
use crate::parallel::sampler::DistributedSampler;
pub use crate::parallel::stages::{BlockOptions, PipelineModel, PipelineStages};
use crate::parallel::zero::{FlatRule, ZeroStage};
pub use crate::parallel::{ModelContext, NonFinitePolicy};
use crate::precision::{LossScalerConfig, Precision};
use crate::recovery::RecoveryPolicy;

mod fault_tolerance;
mod local_updates;
pub use fault_tolerance::FaultTolerance;

/// Default size of a gradient bucket (PyTorch DDP's default).
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// A configured job, ready to spawn.
pub struct Job<M, I> {
    args: Option<JobParts<M, I>>,
}

struct JobParts<M, I> {
    spawn: Box<dyn Spawner<M>>,
    items: std::marker::PhantomData<fn() -> I>,
    devices: Vec<MeshDevice>,
    /// A cluster job: the spawner starts every rank's device (on the processes that hold
    /// them); `devices` is only the template the trained model is assembled on.
    remote: bool,
    layout: Layout,
    steps: u64,
    accumulation: u32,
    sampler: DistributedSampler,
    comm: CommConfig,
    step_timeout: Duration,
    event_capacity: usize,
    faults: Option<Arc<FaultHooks>>,
    recovery: RecoveryPolicy,
    checkpoints: Option<CheckpointSettings>,
    seed: u64,
    elastic: (u32, u32),
    elastic_wait: Duration,
    stragglers: Option<crate::stragglers::StragglerDetection>,
}

impl<M, I> std::fmt::Debug for Job<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.args {
            Some(a) => write!(f, "Job({:?}, {} steps)", a.layout, a.steps),
            None => write!(f, "Job(spawned)"),
        }
    }
}

/// Builds a [`Job`]; every setting has a default except the model, loss, data and batch size.
///
/// The methods come in sections, in the order a program usually needs them:
///
/// - **What to train**: [`model`](Self::model) or [`initial_model`](Self::initial_model),
///   and [`loss`](Self::loss); or [`pipeline`](JobBuilder::pipeline) for a model cut into
///   stages.
/// - **The common path**: [`data`](Self::data), [`optimizer`](Self::optimizer),
///   [`learning_rate`](Self::learning_rate), [`data_parallel`](Self::data_parallel),
///   [`batch_size`](Self::batch_size), [`steps`](Self::steps).
/// - **Checkpoints**: [`checkpoint_dir`](Self::checkpoint_dir) and how often, how many,
///   whether to resume.
/// - **Tuning**: accumulation, ZeRO, mixed precision, clipping, buckets, time-outs; the
///   defaults work.
/// - **Failures and elasticity**: one [`FaultTolerance`] value through
///   [`fault_tolerance`](Self::fault_tolerance) (recovery policy, elastic range and wait,
///   injected faults), or its one-setting shorthands.
/// - **Across processes** (feature `cluster`): `cluster` on the head, `stage_host` on a node.
/// - [`build`](Self::build) checks the whole configuration (JOB-1).
///
/// ```text
/// Job::builder()
///     .initial_model(model).loss(mse_loss)                      // what to train
///     .data(data).optimizer(AdamConfig::new()).learning_rate(3e-3)
///     .data_parallel(2).batch_size(128).steps(200)              // the common path
///     .checkpoint_dir("ckpt")                                   // checkpoints
///     .fault_tolerance(FaultTolerance::new().recovery(RecoveryPolicy::shrink()).elastic(1, 4))
///     .build()?
/// ```
pub struct JobBuilder<M, I> {
    model: Option<ModelFn<M>>,
    loss: Option<LossFn<M, I>>,
    /// Spawns data-parallel replicas of `model` (set with it, where `M` is a Burn module).
    replicas: Option<SpawnReplicas<M, I>>,
    /// The pipeline's stages, schedule and how to spawn them.
    pipeline: Option<PipelineParts<M, I>>,
    data: Option<Arc<dyn Dataset<Item = I>>>,
    optimizer: OptimizerConfig,
    learning_rate: LearningRate,
    dp: u32,
    /// The tensor-parallel degree (`tensor_parallel`).
    tp: u32,
    devices: Option<Vec<MeshDevice>>,
    batch_size: Option<usize>,
    accumulation: u32,
    bucket_bytes: usize,
    clip_norm: Option<f32>,
    zero: ZeroStage,
    compression: Compression,
    local_updates: Option<LocalUpdates>,
    /// The parameter server's settings, the backup workers, and how to spawn them (set with
    /// the model, where `M` is a Burn module): a job with either trains through the server.
    parameter_server: (
        Option<ParameterServer>,
        Option<u32>,
        Option<SpawnServer<M, I>>,
    ),
    mixed: MixedPrecision,
    blocks_in_flight: usize,
    steps: u64,
    seed: u64,
    non_finite: NonFinitePolicy,
    comm: CommConfig,
    step_timeout: Duration,
    event_capacity: usize,
    faults: Option<Arc<FaultHooks>>,
    recovery: RecoveryPolicy,
    checkpoint_dir: Option<std::path::PathBuf>,
    checkpoint_sink: Option<Arc<dyn CheckpointSink>>,
    checkpoint_every: Option<u64>,
    keep_checkpoints: usize,
    resume: bool,
    require_checkpoint: bool,
    elastic: (u32, u32),
    elastic_wait: Duration,
    stragglers: Option<crate::stragglers::StragglerDetection>,
    /// A job across processes: the world it trains on (`JobBuilder::cluster`).
    #[cfg(feature = "cluster")]
    cluster: Option<crate::cluster::remote::ClusterMesh>,
    /// How data-parallel replicas of `model` run across processes (set with it).
    #[cfg(feature = "cluster")]
    replica_cluster: Option<ClusterFns<StageSpec<M, I>, M>>,
}

/// How the stages of a job built from a spec `S` run across processes: the head's spawner
/// and a process's slots (feature `cluster`).
#[cfg(feature = "cluster")]
struct ClusterFns<S, M> {
    spawn: fn(crate::cluster::remote::ClusterMesh, Arc<S>, Layout) -> Box<dyn Spawner<M>>,
    slots: fn(Arc<S>, Layout) -> Arc<dyn crate::cluster::remote::SlotFactory<M>>,
}

/// Spawns data-parallel replicas from a stage spec.
type SpawnReplicas<M, I> = fn(Arc<StageSpec<M, I>>) -> Box<dyn Spawner<M>>;

/// Refuse a global batch that does not cut into `dp` replicas × `k` micro-batches (JOB-1).
fn check_batch(global: usize, dp: usize, k: usize) -> Result<()> {
    let unit = dp * k;
    if global == 0 || !global.is_multiple_of(unit) {
        return Err(Error::InvalidConfig(format!(
            "batch_size {global} does not divide into {dp} replica(s) × {k} micro-batch(es): \
             use a positive multiple of {unit} (e.g. {})",
            (global / unit).max(1) * unit
        )));
    }
    Ok(())
}

/// What `.pipeline(..)` sets.
struct PipelineParts<M, I> {
    stages: PipelineStages<I>,
    /// `None`: a block job (`JobBuilder::blocks`), one stage running every block in turn.
    schedule: Option<Schedule>,
    spawn: fn(Arc<PipelineSpec<I>>) -> Box<dyn Spawner<M>>,
    #[cfg(feature = "cluster")]
    cluster: ClusterFns<PipelineSpec<I>, M>,
}

impl<M, I> std::fmt::Debug for JobBuilder<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobBuilder")
            .field("dp", &self.dp)
            .field("batch_size", &self.batch_size)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl<M, I> Job<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// A builder with the defaults: SGD at learning rate 0.01, one replica, no accumulation,
    /// 25 MiB buckets, 100 steps, seed 0, stop on a non-finite loss, 60 s collective time-out,
    /// 10 min step time-out.
    pub fn builder() -> JobBuilder<M, I> {
        JobBuilder {
            model: None,
            loss: None,
            replicas: None,
            pipeline: None,
            data: None,
            optimizer: OptimizerConfig::Sgd(burn::optim::SgdConfig::new()),
            learning_rate: LearningRate::Constant(0.01),
            dp: 1,
            devices: None,
            batch_size: None,
            accumulation: 1,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            clip_norm: None,
            zero: ZeroStage::Off,
            compression: Compression::None,
            local_updates: None,
            parameter_server: (None, None, None),
            mixed: MixedPrecision::default(),
            blocks_in_flight: 1,
            tp: 1,
            steps: 100,
            seed: 0,
            non_finite: NonFinitePolicy::Stop,
            comm: CommConfig::default(),
            step_timeout: Duration::from_secs(600),
            event_capacity: 1024,
            faults: None,
            recovery: RecoveryPolicy::default(),
            checkpoint_dir: None,
            checkpoint_sink: None,
            checkpoint_every: None,
            keep_checkpoints: 3,
            resume: false,
            require_checkpoint: false,
            elastic: (1, u32::MAX),
            elastic_wait: Duration::from_secs(300),
            stragglers: Some(crate::stragglers::StragglerDetection::default()),
            #[cfg(feature = "cluster")]
            cluster: None,
            #[cfg(feature = "cluster")]
            replica_cluster: None,
        }
    }

    /// Start the job's actors inside the current tokio runtime.
    pub async fn spawn(mut self) -> Result<JobHandle<M>> {
        let a = self
            .args
            .take()
            .ok_or_else(|| Error::InvalidConfig("this job was already spawned".into()))?;
        let (events, first) = broadcast::channel(a.event_capacity);
        let (outcome_tx, outcome_rx) = oneshot::channel();
        let (supervisor, _) = Actor::spawn(
            None,
            Supervisor::<M, I>::default(),
            SupervisorArgs {
                spawn: a.spawn,
                items: std::marker::PhantomData,
                devices: a.devices,
                remote: a.remote,
                layout: a.layout,
                steps: a.steps,
                accumulation: a.accumulation,
                sampler: a.sampler,
                comm: a.comm,
                step_timeout: a.step_timeout,
                faults: a.faults,
                recovery: a.recovery,
                checkpoints: a.checkpoints,
                seed: a.seed,
                elastic: a.elastic,
                elastic_wait: a.elastic_wait,
                stragglers: a.stragglers,
                events: events.clone(),
                outcome: outcome_tx,
            },
        )
        .await
        .map_err(|e| Error::Runtime(format!("could not start the supervisor: {e}")))?;
        drop(events);
        Ok(JobHandle {
            supervisor,
            template: first.resubscribe(),
            first: Mutex::new(Some(first)),
            outcome: outcome_rx,
        })
    }
}

/// # What to train
///
/// The model (built per replica, or one model copied to every replica) and its loss.
impl<M, I> JobBuilder<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    /// How each replica builds its model; replicas then start from rank 0's parameters
    /// (broadcast), whatever the factory returned on the other ranks.
    ///
    /// The factory runs on every replica's device thread at once. A factory that draws random
    /// parameters (Burn's generator is process-global) shares the generator with the others,
    /// so rank 0's draws depend on how the threads interleave: for a bitwise-reproducible start
    /// (REPRO-1) build the model once and hand it to
    /// [`initial_model`](Self::initial_model), or load a record in the factory.
    pub fn model(mut self, f: impl Fn(&ModelContext) -> M + Send + Sync + 'static) -> Self {
        self.model = Some(Arc::new(f));
        self.replicas = Some(|spec| Box::new(LocalReplicas { spec }));
        self.parameter_server.2 = Some(crate::actors::parameter_server::spawner::<M, I>);
        #[cfg(feature = "cluster")]
        {
            self.replica_cluster = Some(ClusterFns {
                spawn: |mesh, spec, _| {
                    Box::new(crate::cluster::remote::ClusterReplicas { mesh, spec })
                },
                slots: |spec, _| Arc::new(crate::cluster::remote::ReplicaSlots(spec)),
            });
        }
        self
    }

    /// Start every replica from this model (its record is copied to every device). Parameters
    /// Burn has not drawn yet are drawn now, on the calling thread
    /// ([`materialize`](crate::parallel::stages::materialize), REPRO-1).
    pub fn initial_model(self, model: M) -> Self {
        let model = Mutex::new(crate::parallel::stages::materialize(model));
        self.model(move |_| model.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// The mean loss of the model over some samples, built on the given device.
    pub fn loss(
        mut self,
        f: impl Fn(&M, &[I], &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        self.loss = Some(Arc::new(f));
        self
    }
}

/// # What to train: a pipeline
impl<I> JobBuilder<PipelineModel, I>
where
    I: Send + Sync + 'static,
{
    /// Train `stages` as a pipeline running `schedule`, in place of a single model and loss.
    /// With `Schedule::Interleaved { virtual_stages: v, .. }` the list holds K·v blocks and
    /// each of the K stages runs v of them; otherwise each block is one stage. Combine with
    /// [`data_parallel`](JobBuilder::data_parallel) for a dp × pp mesh; `batch_size` stays the
    /// global batch, cut per replica into the schedule's micro-batches. The trained blocks
    /// come back in a [`PipelineModel`].
    pub fn pipeline(self, stages: PipelineStages<I>, schedule: Schedule) -> Self {
        self.with_blocks(stages, Some(schedule))
    }

    /// Train the model given as `stages` (its blocks in order) with data parallelism only:
    /// every replica holds every block and runs them one after the other, micro-batch after
    /// micro-batch ([`gradient_accumulation`](JobBuilder::gradient_accumulation) of them),
    /// forwards through the blocks then backwards through them in reverse. Each block's
    /// gradient is reduced as soon as its last backward of the step is done. This is how a
    /// model trains with [`ZeroStage::Three`] (fully sharded: each replica keeps only its
    /// shard of every block's parameters between uses) and with per-block activation
    /// checkpointing ([`BlockOptions`]); ZeRO stages 0–2 and
    /// [`clip_grad_norm`](JobBuilder::clip_grad_norm) work as with a single model. The
    /// trained blocks come back in a [`PipelineModel`].
    pub fn blocks(self, stages: PipelineStages<I>) -> Self {
        self.with_blocks(stages, None)
    }

    /// Overlap a block or pipeline job's collectives with its compute, like FSDP's
    /// `limit_all_gathers` prefetch: a communication thread beside each stage runs them while
    /// the blocks compute. A [`ZeroStage::Three`] block's parameters are all-gathered up to
    /// `n` blocks ahead of their use (forwards, then backwards, then the next micro-batch),
    /// so at most `n` gathered-but-unused blocks exist at once besides the one computing; and
    /// each block's gradient reduction (all-reduce or reduce-scatter, at every ZeRO stage)
    /// runs while the earlier blocks' backwards compute, at most `n` at once, all of them
    /// finished before clipping and the update. `0` runs every collective in place when its
    /// result is needed (no overlap). The result is bitwise the same for every `n`.
    /// Default 1.
    pub fn blocks_in_flight(mut self, n: usize) -> Self {
        self.blocks_in_flight = n;
        self
    }

    fn with_blocks(mut self, stages: PipelineStages<I>, schedule: Option<Schedule>) -> Self {
        self.pipeline = Some(PipelineParts {
            stages,
            schedule,
            spawn: |spec| Box::new(LocalPipeline { spec }),
            #[cfg(feature = "cluster")]
            cluster: ClusterFns {
                spawn: |mesh, spec, layout| {
                    Box::new(crate::cluster::remote::ClusterPipeline { mesh, spec, layout })
                },
                slots: |spec, _| Arc::new(crate::cluster::remote::pipeline::PipelineSlots { spec }),
            },
        });
        self
    }
}

/// # The common path
///
/// What the quickstart sets: the data, the optimizer and its learning rate, how many
/// replicas, the global batch and how many steps (the model and loss are set above, or a
/// pipeline with [`pipeline`](JobBuilder::pipeline)).
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// The training data.
    pub fn data(mut self, data: impl Dataset<Item = I>) -> Self {
        self.data = Some(Arc::new(data));
        self
    }

    /// The optimizer (SGD, Adam, AdamW configs convert into it).
    pub fn optimizer(mut self, optimizer: impl Into<OptimizerConfig>) -> Self {
        self.optimizer = optimizer.into();
        self
    }

    /// A constant learning rate.
    pub fn learning_rate(mut self, lr: f64) -> Self {
        self.learning_rate = LearningRate::Constant(lr);
        self
    }

    /// One of Burn's learning-rate schedulers (e.g.
    /// `ExponentialLrSchedulerConfig::new(0.1, 0.9).init()?`), stepped once per applied
    /// optimizer step (LR-1). Its state is saved with every checkpoint and copied with every
    /// snapshot (LR-2, CKPT-9), so a resumed or rolled-back job and a replica that joins
    /// continue the schedule where it was.
    pub fn lr_scheduler(mut self, scheduler: ModuleLrScheduler) -> Self {
        self.learning_rate = LearningRate::Scheduler(scheduler);
        self
    }

    /// Number of data-parallel replicas.
    pub fn data_parallel(mut self, dp: u32) -> Self {
        self.dp = dp;
        self
    }

    /// The **global** batch size: each replica takes `batch_size / data_parallel` per step.
    pub fn batch_size(mut self, global: usize) -> Self {
        self.batch_size = Some(global);
        self
    }

    /// Number of optimizer steps.
    pub fn steps(mut self, steps: u64) -> Self {
        self.steps = steps;
        self
    }

    /// Seed of the data order.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The devices to run on (default: one logical Flex CPU device per replica).
    pub fn devices(mut self, devices: Vec<MeshDevice>) -> Self {
        self.devices = Some(devices);
        self
    }
}

/// # Checkpoints
///
/// Where checkpoints go, how often, how many are kept, and whether the job resumes from one.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Write checkpoints into `dir` (one subdirectory per checkpoint; see
    /// [`crate::checkpoint`]): every [`checkpoint_every`](Self::checkpoint_every) steps, at
    /// the end of the run, and on [`JobHandle::checkpoint_now`].
    pub fn checkpoint_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.checkpoint_dir = Some(dir.into());
        self
    }

    /// Write checkpoints through `sink` (a [`crate::checkpoint::CheckpointStore`] over any
    /// file system) instead of a directory.
    pub fn checkpoint_store(mut self, sink: impl CheckpointSink + 'static) -> Self {
        self.checkpoint_sink = Some(Arc::new(sink));
        self
    }

    /// Checkpoint every `n` steps (needs a checkpoint directory or store).
    pub fn checkpoint_every(mut self, n: u64) -> Self {
        self.checkpoint_every = Some(n);
        self
    }

    /// Keep the newest `k` complete checkpoints (default 3).
    pub fn keep_checkpoints(mut self, k: usize) -> Self {
        self.keep_checkpoints = k;
        self
    }

    /// Start from the newest valid checkpoint of the directory or store, if there is one
    /// (newer ones that do not verify are refused and reported in the `Restored` event). The
    /// job also writes checkpoints there (at least one when it ends), so the directory must be
    /// writable (CKPT-7); to resume from a read-only copy, copy it first.
    pub fn resume_from_checkpoint(mut self, resume: bool) -> Self {
        self.resume = resume;
        self
    }

    /// With `true`: resume from a checkpoint, and fail the job with
    /// [`CheckpointError::NothingToResume`](crate::checkpoint::CheckpointError::NothingToResume)
    /// when none verifies, instead of starting afresh with a `NothingToResume` event.
    pub fn require_checkpoint(mut self, require: bool) -> Self {
        self.require_checkpoint = require;
        if require {
            self.resume = true;
        }
        self
    }
}

/// # Tuning
///
/// Settings with working defaults: micro-batches, mixed precision, gradient buckets and
/// clipping, sharded optimizer state, the non-finite-loss policy, the all-reduce algorithm,
/// time-outs and the event buffer.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Accumulate gradients over `k` micro-batches per step (each replica's share of the
    /// global batch is cut into `k` equal micro-batches).
    pub fn gradient_accumulation(mut self, k: u32) -> Self {
        self.accumulation = k;
        self
    }

    /// Split every tensor-parallel block ([`PipelineStages::tp_block`]) over `t` ranks, as
    /// Megatron-LM does: each rank holds its slice of the block's split matrices, and the
    /// ranks' partial results meet in all-reduces (one per split region in the forward, one
    /// in the backward). Combines with [`data_parallel`](Self::data_parallel) and
    /// [`pipeline`](Self::pipeline) into a dp × pp × tp mesh (tp ranks fastest in the rank
    /// order, MESH-1); works with [`blocks`](Self::blocks) and `pipeline` jobs. Checkpoints
    /// hold each rank's slices (`shard-ppB-tpT`) and restore onto the same degree; a lost
    /// rank is replaced from its twin in another replica or rolled back, as a pipeline stage
    /// is. Not yet with ZeRO, mixed precision, `clip_grad_norm`, restoring onto another
    /// degree, or across processes: those are refused when the job is built (or, for a checkpoint of another
    /// degree, when it is read).
    pub fn tensor_parallel(mut self, t: u32) -> Self {
        self.tp = t;
        self
    }

    /// Shard the training state over the data-parallel replicas, as DeepSpeed's ZeRO and
    /// PyTorch's `ZeroRedundancyOptimizer` do: [`ZeroStage::One`] keeps each replica's share
    /// of the optimizer state only, [`ZeroStage::Two`] also reduce-scatters the gradients.
    /// The trained parameters equal plain data parallelism's. Works with SGD, Adam and AdamW
    /// (without the optimizer's own per-tensor clipping: use [`Self::clip_grad_norm`]).
    pub fn zero(mut self, stage: ZeroStage) -> Self {
        self.zero = stage;
        self
    }

    /// Send gradients compressed (PyTorch's DDP communication hooks): bf16/f16 values,
    /// top-k sparsification or PowerSGD, each with error feedback (the part a rank does not
    /// send waits in its residual, kept in checkpoints). A data-parallel strategy of its own:
    /// refused with blocks and pipelines, ZeRO, tensor parallelism, `low_precision_gradients`,
    /// f16 loss scaling and across processes. See [`crate::parallel::compress`].
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Synchronise less often: each data-parallel replica steps its own copy of the model
    /// with the job's optimizer on its own samples, and every `every` steps the replicas meet
    /// in one all-reduce of their parameters: [`LocalUpdates::LocalSgd`] averages them,
    /// [`LocalUpdates::DiLoCo`] takes an outer Nesterov-SGD step on their mean change,
    /// [`LocalUpdates::Easgd`] pulls them toward a centre variable
    /// ([`crate::parallel::local`]). With `every` 1 and SGD (and a global batch that splits
    /// evenly over the replicas), local SGD equals plain data parallelism. Checkpoints hold every replica's own parameters, optimizer and the outer
    /// state (LOCAL-4), so a lost replica rolls back (never dropped) and a resumed run equals
    /// the uninterrupted one; resuming or resizing onto another number of replicas is
    /// refused (the job cannot grow; a shrink fails at its next step). The job
    /// must end on a synchronisation (`steps` a multiple of `every`): the trained model is
    /// replica 0's (for EASGD its own variable after the last elastic step). Data-parallel
    /// `.model(..)` jobs in one process only, not with ZeRO, tensor parallelism or f16.
    pub fn local_updates(mut self, updates: LocalUpdates) -> Self {
        self.local_updates = Some(updates);
        self
    }

    /// Train through a parameter server instead of all-reduce: the replicas become workers
    /// that pull parameters, push gradients and wait only as the staleness bound says
    /// (stale-synchronous parallel; `Staleness::Bounded(0)` equals data parallelism,
    /// `Unbounded` is asynchronous SGD). A step is a round over its global batch, in which a
    /// fast worker computes more of it than a slow one; `StepDone`'s replicas report every
    /// applied gradient's staleness (see [`crate::parallel::parameter_server`]). In-process
    /// `.model(..)` jobs with SGD, Adam or AdamW at a constant rate, in `f32`, without
    /// clipping, ZeRO, pipelines or tensor parallelism; the rest is refused by `build()`.
    pub fn parameter_server(mut self, server: ParameterServer) -> Self {
        self.parameter_server.0 = Some(server);
        self
    }

    /// Synchronous training with `b` backup workers (Chen et al., 2016): each step applies
    /// the mean gradient of the first `replicas − b` workers to finish and drops the rest
    /// (their sample ids are in `StepDone`'s replicas). Runs on the parameter server
    /// (`parameter_server`, with `Staleness::Bounded(0)` if given); `b` must be below the
    /// number of replicas.
    pub fn backup_workers(mut self, b: u32) -> Self {
        self.parameter_server.1 = Some(b);
        self
    }

    /// Run forward and backward in `precision` (mixed precision, like PyTorch's autocast):
    /// each micro-batch computes on a copy of the model cast to the 16-bit type, its
    /// gradients reach the `f32` master weights as `f32`, and the optimizer steps the master
    /// weights, which are what checkpoints and the trained model hold (PREC-1). At
    /// [`Precision::F16`] the loss is scaled dynamically ([`Self::loss_scaler`]): a step
    /// whose all-reduced gradient overflows is skipped on every replica (PREC-2,
    /// `JobEvent::GradientOverflow`). The model must cast its input to its parameters' dtype
    /// and the loss function its output to `f32` (no-ops in `f32`; see
    /// [`crate::parallel::autocast`]). Data-parallel jobs only (not pipelines yet).
    pub fn precision(mut self, precision: Precision) -> Self {
        self.mixed.precision = precision;
        self
    }

    /// All-reduce gradients in the 16-bit type of [`Self::precision`] instead of `f32`:
    /// half the bytes on the wire, each sum still accumulated in `f32` and rounded once
    /// (COMM-5). Off by default; no effect at `f32`.
    pub fn low_precision_gradients(mut self, low: bool) -> Self {
        self.mixed.low_gradients = low;
        self
    }

    /// How f16's dynamic loss scaling moves its scale (default: `torch.amp.GradScaler`'s,
    /// 2^16, ×2 every 2000 clean steps, ×0.5 on an overflow).
    pub fn loss_scaler(mut self, config: LossScalerConfig) -> Self {
        self.mixed.scaler = config;
        self
    }

    /// Clip gradients so that their global L2 norm is at most `max_norm`.
    pub fn clip_grad_norm(mut self, max_norm: f32) -> Self {
        self.clip_norm = Some(max_norm);
        self
    }

    /// What to do on a NaN or infinite loss.
    pub fn on_non_finite_loss(mut self, policy: NonFinitePolicy) -> Self {
        self.non_finite = policy;
        self
    }

    /// Size of a gradient bucket for the all-reduce.
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// The all-reduce algorithm (default: chosen by size and group).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.comm.algorithm = algorithm;
        self
    }

    /// Emulate a slower network (`comm::emulate`): every message a rank sends waits for its
    /// link's latency and its bytes at the link's bandwidth before it leaves (LINK-1), so
    /// the methods for slow links can be measured on a fast machine. In-process the group
    /// then runs ring and tree plans only; across processes each process emulates the links
    /// it sends on (set it on every process's builder). Values are unchanged (LINK-2).
    pub fn link_emulation(mut self, link: crate::comm::emulate::LinkEmulation) -> Self {
        self.comm.link = Some(link);
        self
    }

    /// How a persistently slow rank is found and named in the events
    /// (`JobEvent::Straggler`, STRAG-1..3; default: a median compute time over 5 steps at
    /// least 1.5 × the ranks' median), or `None` to look for none.
    pub fn straggler_detection(
        mut self,
        detection: Option<crate::stragglers::StragglerDetection>,
    ) -> Self {
        self.stragglers = detection;
        self
    }

    /// Time-out of every collective operation.
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.comm.timeout = timeout;
        self
    }

    /// Time-out of one step on every stage.
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = timeout;
        self
    }

    /// How many events are kept for a slow consumer before the oldest are dropped for it.
    pub fn event_capacity(mut self, events: usize) -> Self {
        self.event_capacity = events;
        self
    }
}

/// # Failures and elasticity
///
/// What the job does when a device is lost, the sizes it may run at, and faults to inject
/// for a rehearsal: one [`FaultTolerance`] value, or its shorthands one setting at a time.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// What the job does about failures, in one value: the recovery policy, the elastic range
    /// and wait, and any faults to inject. Replaces all four settings (a value without a plan
    /// injects no faults); [`recovery`](Self::recovery), [`elastic`](Self::elastic),
    /// [`elastic_wait`](Self::elastic_wait) and [`fault_plan`](Self::fault_plan) are
    /// shorthands that set one of them.
    pub fn fault_tolerance(mut self, tolerance: FaultTolerance) -> Self {
        let FaultTolerance {
            recovery,
            elastic_min,
            elastic_max,
            elastic_wait,
            fault_plan,
        } = tolerance;
        self.recovery = recovery;
        self.elastic = (elastic_min, elastic_max);
        self.elastic_wait = elastic_wait;
        self.faults = fault_plan.map(FaultHooks::new);
        self
    }

    /// How to recover from a lost device (default: the job fails with the device's error).
    pub fn recovery(mut self, policy: RecoveryPolicy) -> Self {
        self.recovery = policy;
        self
    }

    /// The data-parallel sizes [`JobHandle::scale_to`] may ask for (default: 1 and up).
    ///
    /// When failures leave fewer than `min` replicas (with a shrinking recovery policy whose
    /// own `min_replicas` floor still holds), the job waits for devices rather than train on
    /// (ELASTIC-3): it publishes `WaitingForDevices` and holds its next step until
    /// `scale_to(n ≥ min)` or `resume()`, and ends with `Error::BelowMinimum` after
    /// [`JobBuilder::elastic_wait`].
    pub fn elastic(mut self, min: u32, max: u32) -> Self {
        self.elastic = (min, max);
        self
    }

    /// How long a job below its elastic minimum waits for devices (default 5 minutes).
    pub fn elastic_wait(mut self, wait: Duration) -> Self {
        self.elastic_wait = wait;
        self
    }

    /// Inject the faults of `plan` (a rehearsal of failures: see [`crate::faults`]).
    pub fn fault_plan(mut self, plan: FaultPlan) -> Self {
        self.faults = Some(FaultHooks::new(plan));
        self
    }
}

/// # Across processes (feature `cluster`)
#[cfg(feature = "cluster")]
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Train across processes on `mesh` (the world the head assembled): each rank in the
    /// process that holds its device, gradients (and a pipeline's activations) meeting over the
    /// TCP data plane. A data-parallel job has one replica per rank; a pipeline job
    /// (`.pipeline(..)`) has world ÷ stages replicas. Every process builds its stages from the
    /// same builder settings ([`JobBuilder::stage_host`] on the nodes); `data_parallel` follows
    /// the world. A data-parallel job across processes recovers by shrinking, growing onto
    /// nodes that joined it, or rolling back; a pipeline job replaces a lost stage from its
    /// twin on a node that joined it (REMOTE-7) or fails with the lost stage named; fault plans,
    /// and roll-back of a pipeline job, are refused at `build` (feature `cluster`).
    pub fn cluster(mut self, mesh: crate::cluster::remote::ClusterMesh) -> Self {
        self.cluster = Some(mesh);
        self
    }

    /// The stages of one process of a job across processes (a node's, or the head's own
    /// devices'), trained with this builder's model (or pipeline), loss, data, optimizer and
    /// settings: what a node's [`crate::cluster::control::HostFactory`] returns. Each slot gets
    /// a Flex CPU device (feature `cluster`).
    pub fn stage_host(
        mut self,
        args: crate::cluster::control::HostArgs,
    ) -> Result<Arc<dyn crate::cluster::control::StageHost>> {
        let Some(dataset) = self.data.clone() else {
            return Err(Error::InvalidConfig("no data: call .data(dataset)".into()));
        };
        let Some(global) = self.batch_size else {
            return Err(Error::InvalidConfig(
                "no batch size: call .batch_size(global_batch)".into(),
            ));
        };
        let world = args.plan.world_size as u32;
        let slots = match self.pipeline.take() {
            Some(p) => {
                // The head checks the mesh against the world it assembled; a node's slots learn
                // whom they group with from the head's Wire (and a node that joined the running
                // job as a spare counts a world that is no multiple of the stages).
                let slots = p.cluster.slots;
                let (spec, layout) = self.pipeline_spec(p, global, dataset, None)?;
                slots(spec, layout)
            }
            None => {
                let Some(fns) = self.replica_cluster.take() else {
                    return Err(Error::InvalidConfig(
                        "no model: call .model(..) or .initial_model(..), or .pipeline(stages, \
                         schedule)"
                            .into(),
                    ));
                };
                // The head checks the batch against the replicas it drives; a node's world
                // counts every rank ever joined (it grows with late nodes, REMOTE-5).
                self.dp = 1;
                let spec = self.stage_spec(global, dataset)?;
                (fns.slots)(spec, Layout::data_parallel(world)?)
            }
        };
        let link = crate::comm::net::link::LinkConfig {
            io_timeout: self.comm.timeout,
            ..Default::default()
        };
        let tcp = crate::comm::tcp::TcpConfig {
            comm: self.comm.clone(),
            ..Default::default()
        }
        .with_link(link);
        Ok(Arc::new(crate::cluster::remote::NodeStages::new(
            slots, args, tcp,
        )?))
    }
}

/// # Building
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Check the configuration (JOB-1) and produce the job.
    pub fn build(mut self) -> Result<Job<M, I>> {
        let invalid = |m: String| Err(Error::InvalidConfig(m));
        let Some(dataset) = self.data.clone() else {
            return invalid("no data: call .data(dataset)".into());
        };
        let Some(global) = self.batch_size else {
            return invalid("no batch size: call .batch_size(global_batch)".into());
        };
        if self.dp == 0 {
            return invalid("data_parallel(0): use at least 1 replica".into());
        }
        if self.accumulation == 0 {
            return invalid("gradient_accumulation(0): use at least 1 micro-batch".into());
        }
        if self.bucket_bytes < 4 {
            return invalid("bucket_bytes below one f32: use at least 4 bytes".into());
        }
        if self.event_capacity == 0 {
            return invalid("event_capacity(0): keep at least 1 event".into());
        }
        if let Some(link) = &self.comm.link
            && let Err(e) = link.validate()
        {
            return invalid(format!("link_emulation: {e}"));
        }
        if self.comm.timeout.is_zero() || self.step_timeout.is_zero() {
            return invalid("a time-out of zero: use a positive duration".into());
        }
        if self.mixed.precision.scales_loss() {
            self.mixed.scaler.validate()?;
        }
        if self.zero.shards_optimizer()
            && let Err(e) = FlatRule::of(&self.optimizer)
        {
            return invalid(format!("zero({:?}): {e}", self.zero));
        }
        let remote = self.is_remote();
        let traits = compress::JobTraits {
            blocks: self.pipeline.is_some(),
            zero: self.zero != ZeroStage::Off,
            tensor_parallel: self.tp != 1,
            low_precision_gradients: self.mixed.low_gradients && self.mixed.precision.is_low(),
            loss_scaling: self.mixed.precision.scales_loss(),
            across_processes: remote,
        };
        compress::check(self.compression, traits)?;
        if let Some(updates) = &self.local_updates
            && self.compression.is_on()
        {
            return invalid(format!(
                "local_updates({updates}) with compression({}): the replicas exchange \
                 parameters every few steps, not gradients, so there is no gradient to \
                 compress; use one or the other",
                self.compression
            ));
        }
        if let Some(updates) = &self.local_updates {
            local_updates::check(
                updates,
                local_updates::Combination {
                    blocks: self.pipeline.is_some(),
                    zero: self.zero,
                    tp: self.tp,
                    remote,
                    precision: self.mixed.precision,
                    dp: self.dp,
                    steps: self.steps,
                    clip: self.clip_norm.is_some(),
                },
            )?;
        }
        if remote {
            if self.faults.is_some() {
                return invalid(
                    "a fault plan acts on in-process devices: it is not supported across \
                     processes yet (kill a node process to rehearse a failure)"
                        .into(),
                );
            }
            if self.recovery.roll_back && self.pipeline.is_some() {
                return invalid(
                    "rolling a pipeline job back across processes is not supported yet: use \
                     shrink (a lost stage is replaced from its twin on a spare node) or fail"
                        .into(),
                );
            }
        }
        if (self.parameter_server.0.is_some() || self.parameter_server.1.is_some())
            && (self.compression.is_on() || self.local_updates.is_some())
        {
            return invalid(
                "parameter_server/backup_workers with compression or local_updates: the \
                 workers push whole f32 gradients to the server every item; use one method"
                    .into(),
            );
        }
        let server = parameter_server::check(
            self.parameter_server.0,
            self.parameter_server.1,
            parameter_server::JobShape {
                workers: self.dp,
                pipeline: self.pipeline.is_some(),
                tensor_parallel: self.tp,
                zero: self.zero,
                remote,
                low_precision: self.mixed.precision != Precision::F32 || self.mixed.low_gradients,
                clip: self.clip_norm.is_some(),
                optimizer: &self.optimizer,
                learning_rate: &self.learning_rate,
            },
        )?;
        let (spawn, layout, accumulation) = match self.pipeline.take() {
            Some(p) => self.pipeline_parts(p, global, dataset.clone())?,
            None => self.replica_parts(global, dataset.clone(), server)?,
        };
        let world = layout.world_size() as usize;
        let devices = match self.devices {
            Some(d) if remote => d.into_iter().take(1).collect(),
            Some(d) => d,
            // A cluster job needs only the template its model is assembled on.
            None => MeshDevice::of_kind(
                crate::device::BackendKind::Flex,
                if remote { 1 } else { world },
            )?,
        };
        if devices.len() < world && !remote {
            return invalid(format!(
                "a {} × {} mesh (data × pipeline) needs {world} devices but {} were given: add \
                 devices or use a smaller mesh",
                layout.dp(),
                layout.pp(),
                devices.len()
            ));
        }
        let precision = self.mixed.precision;
        let dtype = crate::parallel::autocast::float_dtype(precision);
        if let Some(d) = devices.iter().find(|d| !d.burn().supports_dtype(dtype)) {
            return invalid(format!(
                "precision({precision}): device {} does not compute in {precision}; use \
                 Precision::F32 or devices that support it",
                d.id()
            ));
        }
        if let Some(f) = &self.faults {
            f.plan().check()?;
            // COMM-8: a corrupted message is only caught where payloads are checked.
            if f.corrupts_messages() {
                self.comm.verify_payloads = true;
            }
        }
        let sink = match (self.checkpoint_sink.take(), &self.checkpoint_dir) {
            (Some(sink), _) => Some(sink),
            (None, Some(dir)) => Some(Arc::new(CheckpointStore::open(
                dir.clone(),
                self.keep_checkpoints,
            )?) as Arc<dyn CheckpointSink>),
            (None, None) => None,
        };

        let checkpoints = match sink {
            Some(sink) => Some(CheckpointSettings {
                sink,
                every: self.checkpoint_every,
                resume: self.resume,
                require: self.require_checkpoint,
            }),
            None if self.checkpoint_every.is_some() || self.resume => {
                return invalid(
                    "checkpoint_every or resume without a place for checkpoints: add \
                     .checkpoint_dir(dir)"
                        .into(),
                );
            }
            None => None,
        };
        if self.recovery.roll_back && checkpoints.is_none() {
            return invalid(
                "a recovery policy that rolls back needs checkpoints: add .checkpoint_dir(dir) \
                 and .checkpoint_every(n)"
                    .into(),
            );
        }
        if self.comm.timeout >= self.step_timeout {
            return invalid(format!(
                "collective_timeout {:?} is not below step_timeout {:?}: a rank that never \
                 arrives must be named by its collective before the step gives up",
                self.comm.timeout, self.step_timeout
            ));
        }
        if self.elastic.0 > self.elastic.1 {
            return invalid(format!(
                "elastic({}, {}): the minimum is above the maximum",
                self.elastic.0, self.elastic.1
            ));
        }
        if self.checkpoint_every == Some(0) {
            return invalid("checkpoint_every(0): use at least 1 step".into());
        }
        let sampler = DistributedSampler::new(dataset.len(), global, self.seed)?;
        // Last, once nothing else refuses the job: a required checkpoint in a directory that
        // does not exist is missing (the directory is not made for it), and a place checkpoints
        // cannot be written to is refused before any training (CKPT-7).
        if let (Some(settings), Some(dir)) = (&checkpoints, &self.checkpoint_dir)
            && settings.require
            && !dir.exists()
        {
            return Err(crate::checkpoint::CheckpointError::NothingToResume {
                location: dir.display().to_string(),
            }
            .into());
        }
        if let Some(settings) = &checkpoints {
            settings.sink.check_writable()?;
        }
        Ok(Job {
            args: Some(JobParts {
                spawn,
                items: std::marker::PhantomData,
                devices,
                remote,
                layout,
                steps: self.steps,
                accumulation,
                sampler,
                comm: self.comm,
                step_timeout: self.step_timeout,
                event_capacity: self.event_capacity,
                faults: self.faults,
                recovery: self.recovery,
                checkpoints,
                seed: self.seed,
                elastic: self.elastic,
                elastic_wait: self.elastic_wait,
                stragglers: self.stragglers,
            }),
        })
    }

    /// The data-parallel job's spawner, layout and accumulation.
    fn replica_parts(
        &mut self,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
        server: Option<(parameter_server::Mode, FlatRule, f64)>,
    ) -> Result<(Box<dyn Spawner<M>>, Layout, u32)> {
        let Some(spawn) = self.replicas else {
            return Err(Error::InvalidConfig(
                "no model: call .model(..) or .initial_model(..), or .pipeline(stages, schedule)"
                    .into(),
            ));
        };
        if self.tp != 1 {
            return Err(Error::InvalidConfig(format!(
                "tensor_parallel({}) splits blocks: give the model as tensor-parallel blocks \
                 with .blocks(stages) or .pipeline(stages, schedule) instead of .model(..)",
                self.tp
            )));
        }
        #[cfg(feature = "cluster")]
        if let Some(mesh) = self.cluster.take() {
            let world = mesh.world_size() as u32;
            if self.dp != 1 && self.dp != world {
                return Err(Error::InvalidConfig(format!(
                    "data_parallel({}) on a cluster of {world} rank(s): a job across processes \
                     has one replica per rank; leave data_parallel unset",
                    self.dp
                )));
            }
            let Some(fns) = self.replica_cluster.take() else {
                return Err(Error::InvalidConfig(
                    "no model: call .model(..) or .initial_model(..)".into(),
                ));
            };
            self.dp = world;
            let spec = self.stage_spec(global, dataset)?;
            let layout = Layout::data_parallel(world)?;
            return Ok(((fns.spawn)(mesh, spec, layout), layout, self.accumulation));
        }
        let spec = self.stage_spec(global, dataset)?;
        if let (Some(server), Some(ps)) = (server, self.parameter_server.2) {
            let layout = Layout::data_parallel(self.dp)?;
            return Ok((ps(spec, server), layout, self.accumulation));
        }
        Ok((
            spawn(spec),
            Layout::data_parallel(self.dp)?,
            self.accumulation,
        ))
    }

    /// Whether the job runs across processes (`JobBuilder::cluster`).
    fn is_remote(&self) -> bool {
        #[cfg(feature = "cluster")]
        return self.cluster.is_some();
        #[cfg(not(feature = "cluster"))]
        false
    }

    /// What every data-parallel stage trains with (JOB-1 checks of the model, loss and batch).
    fn stage_spec(
        &mut self,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
    ) -> Result<Arc<StageSpec<M, I>>> {
        let invalid = |m: String| Err(Error::InvalidConfig(m));
        let Some(model_fn) = self.model.take() else {
            return invalid(
                "no model: call .model(..) or .initial_model(..), or .pipeline(stages, schedule)"
                    .into(),
            );
        };
        let Some(loss_fn) = self.loss.take() else {
            return invalid("no loss: call .loss(|model, samples, device| ..)".into());
        };
        if self.zero.shards_parameters() {
            return invalid(
                "zero(Three) shards each block's parameters between uses, so it needs the \
                 model as blocks: give it with .blocks(stages) (or .pipeline(..)) instead of \
                 .model(..) / .initial_model(..), or use zero(Two)"
                    .into(),
            );
        }
        let dp = self.dp as usize;
        let k = self.accumulation as usize;
        check_batch(global, dp, k)?;
        Ok(Arc::new(StageSpec {
            model_fn,
            loss_fn,
            dataset,
            optimizer: self.optimizer.clone(),
            learning_rate: self.learning_rate.clone(),
            bucket_elems: self.bucket_bytes / 4,
            clip_norm: self.clip_norm,
            zero: self.zero,
            local: self.local_updates,
            non_finite: self.non_finite,
            epoch: Instant::now(),
            faults: self.faults.clone(),
            mixed: self.mixed,
            compression: self.compression,
        }))
    }

    /// The pipeline job's spawner, layout and accumulation (its micro-batches).
    fn pipeline_parts(
        &mut self,
        p: PipelineParts<M, I>,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
    ) -> Result<(Box<dyn Spawner<M>>, Layout, u32)> {
        #[cfg(feature = "cluster")]
        if let Some(mesh) = self.cluster.take() {
            let spawn = p.cluster.spawn;
            let world = Some(mesh.world_size() as u32);
            let (spec, layout) = self.pipeline_spec(p, global, dataset, world)?;
            let m = spec.plan.micro_batches();
            return Ok((spawn(mesh, spec, layout), layout, m));
        }
        let spawn = p.spawn;
        let (spec, layout) = self.pipeline_spec(p, global, dataset, None)?;
        let m = spec.plan.micro_batches();
        Ok((spawn(spec), layout, m))
    }

    /// What every stage of a pipeline job trains with, and the dp × pp layout (JOB-1 checks).
    /// `world`: the ranks of a job across processes (its replicas are world ÷ stages).
    fn pipeline_spec(
        &mut self,
        p: PipelineParts<M, I>,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
        world: Option<u32>,
    ) -> Result<(Arc<PipelineSpec<I>>, Layout)> {
        let invalid = |m: String| Err(Error::InvalidConfig(m));
        if let Some(problem) = p.stages.problem() {
            return invalid(problem);
        }
        if let Some(problem) = self.tensor_parallel_problem(&p.stages, world) {
            return invalid(problem);
        }
        // MIX-1: blocks compute in bf16 or f16 with f32 gradients; what they do not do yet
        // is refused here.
        if self.mixed.low_gradients && self.mixed.precision.is_low() {
            return invalid(
                "low_precision_gradients(true) is not supported with .blocks(..) or \
                 .pipeline(..) yet (their gradients are reduced in f32); remove it"
                    .into(),
            );
        }
        let Some(schedule) = p.schedule else {
            return self.blocks_spec(p.stages, global, dataset, world);
        };
        if self.mixed.precision.scales_loss() {
            return invalid(format!(
                "precision({}) is not supported with .pipeline(..) yet (its loss scaler's \
                 overflow would have to be agreed across the pipeline's stages); use \
                 Precision::Bf16, or train with .blocks(..)",
                self.mixed.precision
            ));
        }
        if self.accumulation != 1 {
            return invalid(
                "gradient_accumulation with a pipeline: the schedule's micro-batches are the \
                 accumulation; set micro_batches in the schedule instead"
                    .into(),
            );
        }
        if self.clip_norm.is_some() {
            return invalid(
                "clip_grad_norm is not supported with a pipeline yet (the global norm spans \
                 the stages); remove it or train without .pipeline(..)"
                    .into(),
            );
        }
        if self.non_finite == NonFinitePolicy::Skip {
            return invalid(
                "on_non_finite_loss(Skip) is not supported with a pipeline yet (stages update \
                 before the last stage's loss is known to all); use Stop"
                    .into(),
            );
        }
        let v = schedule.virtual_stages() as usize;
        let blocks = p.stages.len();
        if !blocks.is_multiple_of(v) {
            return invalid(format!(
                "{blocks} blocks do not split into stages of {v} virtual stages each: give a \
                 multiple of {v} blocks"
            ));
        }
        let pp = (blocks / v) as u32;
        if let Some(world) = world {
            if !world.is_multiple_of(pp) || (self.dp != 1 && self.dp * pp != world) {
                return invalid(format!(
                    "a pipeline of {pp} stages on a cluster of {world} rank(s): the world must \
                     be replicas × {pp}; leave data_parallel unset"
                ));
            }
            self.dp = world / pp;
        }
        let plan = schedule.instructions(pp)?;
        let dp = self.dp as usize;
        let m = schedule.micro_batches() as usize;
        check_batch(global, dp, m)?;
        let spec = self.stages_spec(p.stages, plan, dataset);
        Ok((spec, Layout::new(self.dp, pp, self.tp)?))
    }

    /// A block job's spec: one stage per replica holding every block, running
    /// [`PipelineSchedule::sequential`](crate::parallel::pipeline::PipelineSchedule::sequential)
    /// over the accumulation's micro-batches.
    fn blocks_spec(
        &mut self,
        stages: PipelineStages<I>,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
        world: Option<u32>,
    ) -> Result<(Arc<PipelineSpec<I>>, Layout)> {
        if self.non_finite == NonFinitePolicy::Skip {
            return Err(Error::InvalidConfig(
                "on_non_finite_loss(Skip) is not supported with .blocks(..) yet (each block \
                 updates on its own); use Stop"
                    .into(),
            ));
        }
        if let Some(world) = world {
            self.dp = world;
        }
        let plan = crate::parallel::pipeline::PipelineSchedule::sequential(
            stages.len() as u32,
            self.accumulation,
        )?;
        check_batch(global, self.dp as usize, self.accumulation as usize)?;
        let mut spec = self.stages_spec(stages, plan, dataset);
        Arc::get_mut(&mut spec)
            .expect("the spec was just made")
            .clip = self.clip_norm;
        Ok((spec, Layout::new(self.dp, 1, self.tp)?))
    }

    /// Why this job cannot be split `tensor_parallel(t)` ways (t > 1): what is not done yet
    /// is refused here, with what to change.
    fn tensor_parallel_problem(
        &self,
        stages: &PipelineStages<I>,
        world: Option<u32>,
    ) -> Option<String> {
        let t = self.tp;
        if t == 0 {
            return Some("tensor_parallel(0): the degree must be at least 1".into());
        }
        if t == 1 {
            return None;
        }
        if let Some(problem) = stages.tensor_parallel_problem(t as usize) {
            return Some(problem);
        }
        let not_yet = |what: &str| {
            Some(format!(
                "tensor_parallel({t}) with {what} is not supported yet; remove one of them"
            ))
        };
        if world.is_some() {
            return not_yet("a job across processes (cluster)");
        }
        if self.zero != ZeroStage::Off {
            return not_yet(&format!("ZeRO ({:?})", self.zero));
        }
        if self.mixed.precision.is_low() {
            return not_yet(&format!("precision({})", self.mixed.precision));
        }
        if self.clip_norm.is_some() {
            // The global norm would need the split parameters' squares summed over the
            // group and the replicated ones counted once.
            return not_yet("clip_grad_norm");
        }
        None
    }

    fn stages_spec(
        &self,
        stages: PipelineStages<I>,
        plan: crate::parallel::pipeline::PipelineSchedule,
        dataset: Arc<dyn Dataset<Item = I>>,
    ) -> Arc<PipelineSpec<I>> {
        Arc::new(PipelineSpec {
            stages,
            plan: Arc::new(plan),
            dataset,
            optimizer: self.optimizer.clone(),
            learning_rate: self.learning_rate.clone(),
            zero: self.zero,
            clip: None,
            blocks_in_flight: self.blocks_in_flight,
            epoch: Instant::now(),
            faults: self.faults.clone(),
            mixed: self.mixed,
        })
    }
}

/// A running job.
pub struct JobHandle<M> {
    supervisor: ActorRef<SupervisorMsg>,
    /// Only for `resubscribe`: the handle holds no sender, so every stream closes when the
    /// Supervisor's state is dropped, even if the Supervisor dies without a last event.
    template: broadcast::Receiver<JobEvent>,
    first: Mutex<Option<broadcast::Receiver<JobEvent>>>,
    outcome: oneshot::Receiver<Result<Trained<M>>>,
}

impl<M> std::fmt::Debug for JobHandle<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobHandle({})", self.supervisor.get_id())
    }
}

impl<M: Send + 'static> JobHandle<M> {
    /// A stream of the job's events. The first call sees every event since the job started;
    /// later calls see events from the moment of the call (EV-1).
    pub fn events(&self) -> EventStream {
        let rx = self
            .first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_else(|| self.template.resubscribe());
        EventStream { rx, ended: false }
    }

    /// Where the job is. Answered at once, also while a step runs (SV-3: the step runs on a
    /// task of its own); `timeout` bounds the wait for a Supervisor that does not answer.
    pub async fn status(&self, timeout: Duration) -> Result<JobStatus> {
        status_of(&self.supervisor, timeout).await
    }

    /// A cloneable handle on every control of the job (stop, checkpoint, resize, pause).
    pub fn control(&self) -> JobControl {
        JobControl {
            supervisor: self.supervisor.clone(),
        }
    }

    /// A cloneable way to stop the job from elsewhere in the program (a signal handler, a
    /// service endpoint) while this handle waits in [`join`](Self::join).
    pub fn stopper(&self) -> JobStopper {
        JobStopper {
            supervisor: self.supervisor.clone(),
        }
    }

    /// Wait for the job to end and return the trained model, or the error that ended it.
    pub async fn join(self) -> Result<Trained<M>> {
        self.outcome.await.unwrap_or_else(|_| {
            Err(Error::Runtime(
                "the supervisor ended without a result".into(),
            ))
        })
    }

    /// Write a checkpoint at the next step boundary (needs a checkpoint directory or store);
    /// a `CheckpointWritten` event follows once it is on disk.
    pub fn checkpoint_now(&self) {
        self.control().checkpoint_now();
    }

    /// Resize a data-parallel job to `n` replicas at the next step boundary: joining replicas
    /// take rank 0's parameters and optimizer state, the global batch stays the same. A
    /// `Resized` event follows, or `ResizeRefused` saying why (outside
    /// [`JobBuilder::elastic`]'s range, a pipeline job).
    pub fn scale_to(&self, n: u32) {
        self.control().scale_to(n);
    }

    /// Start no new step until [`resume`](Self::resume) (the running step finishes); a
    /// `Paused` event follows.
    pub fn pause(&self) {
        self.control().pause();
    }

    /// Continue after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.control().resume();
    }

    /// Ask the job to stop at the next step boundary and return the model trained so far.
    pub async fn stop(self) -> Result<Trained<M>> {
        let _ = self.supervisor.send_message(SupervisorMsg::Stop);
        self.join().await
    }
}

async fn status_of(supervisor: &ActorRef<SupervisorMsg>, timeout: Duration) -> Result<JobStatus> {
    match supervisor.call(SupervisorMsg::Status, Some(timeout)).await {
        Ok(ractor::rpc::CallResult::Success(s)) => Ok(s),
        Ok(ractor::rpc::CallResult::Timeout) => Err(Error::Runtime(format!(
            "the supervisor did not answer a status request within {timeout:?}"
        ))),
        _ => Err(Error::Stopped("the job has ended".into())),
    }
}

/// Every control of a running job, cheap to clone and send anywhere (a signal handler, a
/// service's endpoints): stop, checkpoint, resize, pause and resume. Each takes effect at the
/// next step boundary and is answered by an event.
#[derive(Debug, Clone)]
pub struct JobControl {
    supervisor: ActorRef<SupervisorMsg>,
}

impl JobControl {
    /// See [`JobHandle::stop`] (this one does not wait).
    pub fn stop(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Stop);
    }

    /// See [`JobHandle::checkpoint_now`].
    pub fn checkpoint_now(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::CheckpointNow);
    }

    /// See [`JobHandle::scale_to`].
    pub fn scale_to(&self, n: u32) {
        let _ = self.supervisor.send_message(SupervisorMsg::ScaleTo(n));
    }

    /// Grow a data-parallel job by `k` replicas at the next step boundary, on top of any
    /// resize already asked for: what a program calls when devices became available (a
    /// cluster job calls it for every node that joins it while it runs). A `Resized` event
    /// follows, or `ResizeRefused` saying why.
    pub fn add_replicas(&self, k: u32) {
        let _ = self.supervisor.send_message(SupervisorMsg::AddReplicas(k));
    }

    /// See [`JobHandle::pause`].
    pub fn pause(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Pause);
    }

    /// See [`JobHandle::resume`].
    pub fn resume(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Resume);
    }

    /// See [`JobHandle::status`].
    pub async fn status(&self, timeout: Duration) -> Result<JobStatus> {
        status_of(&self.supervisor, timeout).await
    }
}

/// Stops a job at its next step boundary; cheap to clone and send anywhere.
#[derive(Debug, Clone)]
pub struct JobStopper {
    supervisor: ActorRef<SupervisorMsg>,
}

impl JobStopper {
    /// Ask the job to stop at the next step boundary (a no-op if it has ended). The job's
    /// `join()` then returns the model trained so far.
    pub fn stop(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Stop);
    }

    /// Write a checkpoint at the next step boundary (see [`JobHandle::checkpoint_now`]).
    pub fn checkpoint_now(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::CheckpointNow);
    }
}

/// A consumer's view of a job's events.
#[derive(Debug)]
pub struct EventStream {
    rx: broadcast::Receiver<JobEvent>,
    ended: bool,
}

/// Why [`EventStream::recv`] returned no event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventsError {
    /// This consumer was too slow: the oldest `n` events were dropped for it.
    #[error("missed {0} events")]
    Missed(u64),
    /// The job has ended and every event has been received.
    #[error("the job has ended")]
    Closed,
}

impl EventStream {
    /// The next event; `Err(Missed(n))` tells a lagging consumer how many it lost (the next
    /// call continues with the oldest event still held). After the job's last event
    /// (`Finished` or `Failed`) every call returns `Err(Closed)`.
    pub async fn recv(&mut self) -> std::result::Result<JobEvent, EventsError> {
        if self.ended {
            return Err(EventsError::Closed);
        }
        let event = self.rx.recv().await.map_err(|e| match e {
            broadcast::error::RecvError::Lagged(n) => EventsError::Missed(n),
            broadcast::error::RecvError::Closed => EventsError::Closed,
        });
        match &event {
            Ok(JobEvent::Finished { .. } | JobEvent::Failed(_)) | Err(EventsError::Closed) => {
                self.ended = true;
            }
            _ => {}
        }
        event
    }
}
