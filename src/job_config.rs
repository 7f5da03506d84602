//! [`JobConfig`]: everything that decides how a job trains, as one serde value — what
//! [`JobBuilder`](crate::job::JobBuilder)'s setters fill, what a file holds
//! (`meshwork train --config job.toml`), what the head sends every node (the job spec is this
//! value, the model's name and the backend) and what the planner emits.
//!
//! - **CONF-1 one value.** The builder keeps its settings in a `JobConfig` and nothing else;
//!   `build()` reads them from it, a node takes the head's whole value
//!   ([`JobBuilder::with_config`](crate::job::JobBuilder::with_config)), and a file round-trips
//!   it: `from_toml(to_toml(c)) == c` (tested for every field).
//! - **CONF-2 nothing ignored.** A key the value does not have is refused naming its path and
//!   the keys accepted there; a value of the wrong type or out of range is refused naming its
//!   path ([`ConfigError`]); a combination the refusal table refuses is refused by `build()`
//!   like any builder's (COMP-1). A file's missing key takes the library default.
//!
//! What a file cannot hold is the program's own: the model, loss and data (code), the devices
//! (this process's), a checkpoint store other than a directory, and a learning-rate scheduler
//! other than [`LrSchedule`]'s (set with `learning_rate(..)`; such a job is refused across
//! processes, where the schedule must travel).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::comm::{CommConfig, DataTransport};
use crate::optim::OptimizerConfig;
use crate::parallel::NonFinitePolicy;
use crate::parallel::compress::Compression;
use crate::parallel::local::LocalUpdates;
use crate::parallel::parameter_server::ParameterServer;
use crate::parallel::pipeline::Schedule;
use crate::parallel::zero::ZeroStage;
use crate::precision::{LossScalerConfig, Precision};
use crate::stragglers::StragglerDetection;

mod fault_tolerance;
mod file;
#[cfg(test)]
pub(crate) mod tests;

pub use fault_tolerance::FaultTolerance;
pub use file::{ConfigError, ConfigFormat};

/// Default size of a gradient bucket (PyTorch DDP's default).
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// How a job trains, as one value (CONF-1). Every field has the library's default, so a file
/// names only what it changes:
///
/// ```toml
/// steps = 300
/// batch_size = 64
/// data_parallel = 2
/// learning_rate = 0.003
/// optimizer = { Adam = {} }
///
/// [reduction]
/// zero = "One"
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobConfig {
    /// Seed of the initialization, the data and its order.
    pub seed: u64,
    /// Optimizer steps.
    pub steps: u64,
    /// The global batch (split over the replicas and their micro-batches); required.
    pub batch_size: Option<usize>,
    /// Data-parallel replicas (across processes: the world's ranks ÷ stages ÷ tp, left at 1).
    pub data_parallel: u32,
    /// The tensor-parallel degree of a block or pipeline job's blocks.
    pub tensor_parallel: u32,
    /// The pipeline the model is cut into; `None`: no pipeline.
    pub pipeline: Option<PipelineConfig>,
    /// Every block of a block or pipeline job recomputes its forward during its backward
    /// (activation checkpointing), whatever its `BlockOptions` say; a `.model(..)` job refuses
    /// it.
    pub recompute: bool,
    /// A block or pipeline job's collectives running ahead of their use (FSDP's prefetch).
    pub blocks_in_flight: usize,
    /// Micro-batches each replica accumulates per step (1: none).
    pub accumulation: u32,
    /// The optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// The learning rate (a schedule's peak).
    pub learning_rate: f64,
    /// How the learning rate moves over the steps.
    pub lr_schedule: LrSchedule,
    /// The global gradient norm each step is clipped to.
    pub clip_norm: Option<f32>,
    /// What a NaN or infinite loss does.
    pub non_finite: NonFinitePolicy,
    /// The compute type and the 16-bit gradients.
    pub precision: PrecisionConfig,
    /// How the replicas' gradients meet.
    pub reduction: ReductionConfig,
    /// The collectives: algorithm, time-out, payload checks, an emulated link, partial sums.
    pub comm: CommConfig,
    /// Time-out of one step on every stage (above the collective time-out).
    #[serde(with = "crate::config::duration")]
    pub step_timeout: Duration,
    /// Where checkpoints go and how often.
    pub checkpoints: CheckpointConfig,
    /// Recovery, the elastic range and injected faults.
    pub fault_tolerance: FaultTolerance,
    /// How a slow rank is found (`"off"`: not looked for).
    #[serde(with = "crate::config::on_by_default")]
    pub stragglers: Option<StragglerDetection>,
    /// What moves the data plane's bytes between processes.
    pub transport: DataTransport,
    /// Events kept for a slow consumer.
    pub event_capacity: usize,
}

impl JobConfig {
    /// The learning rate every stage steps: the constant or the warm-up and cosine this
    /// description names; `None` for [`LrSchedule::Program`] (the program's own scheduler).
    pub fn learning_rate(
        &self,
    ) -> Result<Option<crate::optim::LearningRate>, crate::config::InvalidConfig> {
        use crate::optim::LearningRate;
        let to_usize = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        match self.lr_schedule {
            LrSchedule::Constant => Ok(Some(LearningRate::Constant(self.learning_rate))),
            LrSchedule::WarmupCosine { warmup, total } => LearningRate::warmup_cosine(
                self.learning_rate,
                to_usize(warmup),
                to_usize(total.unwrap_or(self.steps)),
            )
            .map(Some),
            LrSchedule::Program => Ok(None),
        }
    }
}

impl JobConfig {
    /// This description laid out as the planner's `layout` of a model of `blocks` blocks
    /// (what `meshwork plan --emit-config` writes): its replicas, tensor-parallel degree,
    /// pipeline (the planner's schedule, `planner::pipeline_schedule`), ZeRO stage and
    /// recomputation over the other settings.
    pub fn with_layout(mut self, layout: &crate::planner::Candidate, blocks: u32) -> Self {
        self.data_parallel = layout.dp;
        self.tensor_parallel = layout.tp;
        self.pipeline = (layout.pp > 1).then(|| PipelineConfig {
            stages: layout.pp,
            schedule: crate::planner::pipeline_schedule(layout, blocks),
        });
        self.recompute = layout.recompute;
        self.reduction.zero = ZeroStage::from_number(layout.zero).unwrap_or_default();
        self
    }
}

impl Default for JobConfig {
    /// The library's defaults: SGD at 0.01, one replica, 100 steps, seed 0, 25 MiB buckets,
    /// a 60 s collective and 600 s step time-out, stop on a non-finite loss.
    fn default() -> Self {
        Self {
            seed: 0,
            steps: 100,
            batch_size: None,
            data_parallel: 1,
            tensor_parallel: 1,
            pipeline: None,
            recompute: false,
            blocks_in_flight: 1,
            accumulation: 1,
            optimizer: OptimizerConfig::Sgd(burn::optim::SgdConfig::new()),
            learning_rate: 0.01,
            lr_schedule: LrSchedule::Constant,
            clip_norm: None,
            non_finite: NonFinitePolicy::Stop,
            precision: PrecisionConfig::default(),
            reduction: ReductionConfig::default(),
            comm: CommConfig::default(),
            step_timeout: Duration::from_secs(600),
            checkpoints: CheckpointConfig::default(),
            fault_tolerance: FaultTolerance::default(),
            stragglers: Some(StragglerDetection::default()),
            transport: DataTransport::default(),
            event_capacity: 1024,
        }
    }
}

/// A pipeline: how many stages, and the schedule that runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Pipeline stages (the world is replicas × stages × tp).
    pub stages: u32,
    /// The schedule and its micro-batches per step.
    pub schedule: Schedule,
}

/// How the learning rate moves over the steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum LrSchedule {
    /// `learning_rate` at every step.
    #[default]
    Constant,
    /// A linear warm-up from `learning_rate / 100` over `warmup` steps, then a cosine down
    /// to `learning_rate / 100` at step `total` (`LearningRate::warmup_cosine`).
    WarmupCosine {
        /// Warm-up steps (at least 1, below `total`).
        warmup: u64,
        /// The step the cosine ends at; left out: the job's last step.
        #[serde(default)]
        total: Option<u64>,
    },
    /// A scheduler the program built (`learning_rate(scheduler)`): it is not in the file, and
    /// a job across processes refuses it (every process must step the same schedule).
    Program,
}

/// The compute type and the 16-bit gradients.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionConfig {
    /// What forward and backward compute in (the optimizer steps f32 master weights).
    pub compute: Precision,
    /// All-reduce the gradients in the 16-bit compute type.
    pub low_precision_gradients: bool,
    /// How f16's loss scale moves.
    pub loss_scaler: LossScalerConfig,
}

/// How the replicas' gradients meet.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReductionConfig {
    /// The ZeRO stage.
    pub zero: ZeroStage,
    /// Gradient compression with error feedback.
    pub compression: Compression,
    /// Local updates instead of a reduction every step.
    pub local_updates: Option<LocalUpdates>,
    /// A parameter server instead of an all-reduce.
    pub parameter_server: Option<ParameterServer>,
    /// Backup workers (on the parameter server).
    pub backup_workers: Option<u32>,
    /// The most bytes one gradient all-reduce carries.
    pub bucket_bytes: usize,
}

impl Default for ReductionConfig {
    fn default() -> Self {
        Self {
            zero: ZeroStage::Off,
            compression: Compression::None,
            local_updates: None,
            parameter_server: None,
            backup_workers: None,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
        }
    }
}

/// Where checkpoints go and how often.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// The directory (the builder's `checkpoint_store` is the program's own instead).
    pub dir: Option<PathBuf>,
    /// Checkpoint every this many steps.
    pub every: Option<u64>,
    /// Complete checkpoints kept.
    pub keep: usize,
    /// Start from the newest valid checkpoint, if there is one.
    pub resume: bool,
    /// Fail when there is none to resume from.
    pub require: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: None,
            every: None,
            keep: 3,
            resume: false,
            require: false,
        }
    }
}
