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

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use ractor::{Actor, ActorRef};
use tokio::sync::{broadcast, oneshot};

pub use crate::actors::checkpointer::CheckpointSink;
use crate::actors::parameter_server::SpawnServer;
use crate::actors::pipeline_stage::{LocalPipeline, PipelineSpec};
use crate::actors::spawner::LocalReplicas;
use crate::actors::spawner::Spawner;
use crate::actors::stage::{LossFn, MixedPrecision, ModelFn, StageSpec};
use crate::actors::supervisor::CheckpointSettings;
pub use crate::actors::supervisor::{JobStatus, RunSummary, Trained};
use crate::actors::supervisor::{PreparedJob, Supervisor, SupervisorArgs, SupervisorMsg};
use crate::checkpoint::CheckpointStore;
use crate::comm::Algorithm;
use crate::data::Dataset;
use crate::device::MeshDevice;
use crate::error::{Error, Result};
pub use crate::events::{JobEvent, PipelineStageStep, PipelineStep, ReplicaStep, StepDone};
use crate::faults::{FaultHooks, FaultPlan};
use crate::mesh::Layout;
pub use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::compress::Compression;
use crate::parallel::local::LocalUpdates;
use crate::parallel::parameter_server::{self, ParameterServer};
pub use crate::parallel::pipeline::Schedule;
use crate::parallel::sampler::DistributedSampler;
pub use crate::parallel::stages::{BlockOptions, PipelineModel, PipelineStages};
use crate::parallel::zero::{FlatRule, ZeroStage};
pub use crate::parallel::{ModelContext, NonFinitePolicy};
use crate::precision::{LossScalerConfig, Precision};
use crate::recovery::RecoveryPolicy;

mod build;
mod builder;
mod events;
#[cfg(test)]
mod fault_tolerance;
mod handle;
mod local_updates;
mod plan;
mod profile;
pub use events::{EventStream, EventsError};
pub use handle::{JobControl, JobHandle, JobStopper};
pub use plan::JobPlan;
pub use profile::{Profile, ProfileRuns, profile};

pub use crate::job_config::{DEFAULT_BUCKET_BYTES, FaultTolerance, JobConfig};

/// A configured job, ready to spawn.
pub struct Job<M, I> {
    args: Option<PreparedJob<M, I>>,
}

impl<M, I> std::fmt::Debug for Job<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.args {
            Some(a) => write!(f, "{a:?}"),
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
    /// Every setting that decides how the job trains (CONF-1): what the setters fill and
    /// `build()` reads.
    config: JobConfig,
    model: Option<ModelFn<M>>,
    loss: Option<LossFn<M, I>>,
    /// Spawns data-parallel replicas of `model` (set with it, where `M` is a Burn module).
    replicas: Option<SpawnReplicas<M, I>>,
    /// The pipeline's (or block job's) blocks and how to spawn them; whether they run as a
    /// pipeline is the config's (`JobConfig::pipeline`).
    pipeline: Option<PipelineParts<M, I>>,
    data: Option<Arc<dyn Dataset<Item = I>>>,
    devices: Option<Vec<MeshDevice>>,
    /// A learning-rate scheduler the program built (`LrSchedule::Program`): not in the
    /// description.
    program_lr: Option<LearningRate>,
    /// Checkpoints through the program's own store instead of `checkpoints.dir`.
    checkpoint_sink: Option<Arc<dyn CheckpointSink>>,
    /// How to spawn a parameter-server job of `model` (set with it, where `M` is a Burn
    /// module).
    ps_spawn: Option<SpawnServer<M, I>>,
    /// The injected faults' hooks, made from the config's plan when the job is built (one
    /// set shared by the Supervisor and every stage).
    faults: Option<Arc<FaultHooks>>,
    /// A job across processes: the world it trains on (`JobBuilder::cluster`).
    #[cfg(feature = "cluster")]
    cluster: Option<crate::cluster::remote::ClusterMesh>,
    /// How data-parallel replicas of `model` run across processes (set with it).
    #[cfg(feature = "cluster")]
    replica_cluster: Option<ClusterFns<StageSpec<M, I>, M>>,
    /// How a parameter-server job of `model` runs across processes (set with it).
    #[cfg(feature = "cluster")]
    ps_cluster: Option<PsClusterFns<M, I>>,
}

/// What a parameter-server job's server runs with: its mode, its update rule and rate.
#[cfg(feature = "cluster")]
type ServerSettings = (parameter_server::Mode, crate::parallel::zero::FlatRule, f64);

/// How a parameter-server job runs across processes: the head's spawner (the server and its
/// gateway) and a process's slots (workers linked to it; their rule and rate) (feature
/// `cluster`).
#[cfg(feature = "cluster")]
struct PsClusterFns<M, I> {
    spawn: PsSpawn<M, I>,
    slots: PsSlots<M, I>,
}

/// The head's spawner of a parameter-server job across processes.
#[cfg(feature = "cluster")]
type PsSpawn<M, I> = fn(
    crate::cluster::remote::ClusterMesh,
    Arc<StageSpec<M, I>>,
    ServerSettings,
) -> Box<dyn Spawner<M>>;

/// A process's parameter-server workers from their spec, update rule and rate.
#[cfg(feature = "cluster")]
type PsSlots<M, I> = fn(
    Arc<StageSpec<M, I>>,
    (crate::parallel::zero::FlatRule, f64),
) -> Arc<dyn crate::cluster::remote::SlotFactory<M>>;

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
    spawn: fn(Arc<PipelineSpec<I>>) -> Box<dyn Spawner<M>>,
    #[cfg(feature = "cluster")]
    cluster: ClusterFns<PipelineSpec<I>, M>,
}

impl<M, I> std::fmt::Debug for JobBuilder<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobBuilder")
            .field("config", &self.config)
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
            config: JobConfig::default(),
            model: None,
            loss: None,
            replicas: None,
            pipeline: None,
            data: None,
            devices: None,
            program_lr: None,
            checkpoint_sink: None,
            ps_spawn: None,
            faults: None,
            #[cfg(feature = "cluster")]
            cluster: None,
            #[cfg(feature = "cluster")]
            replica_cluster: None,
            #[cfg(feature = "cluster")]
            ps_cluster: None,
        }
    }

    /// Start the job's actors inside the current tokio runtime.
    pub async fn spawn(mut self) -> Result<JobHandle<M>> {
        let a = self
            .args
            .take()
            .ok_or_else(|| Error::InvalidConfig("this job was already spawned".into()))?;
        let (events, first) = broadcast::channel(a.config.event_capacity);
        let (outcome_tx, outcome_rx) = oneshot::channel();
        let (supervisor, _) = Actor::spawn(
            None,
            Supervisor::<M, I>::default(),
            SupervisorArgs {
                job: a,
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
