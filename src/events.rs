//! What a job tells the program that embeds it: [`JobEvent`]s.
//!
//! Pure data. Events are published on a broadcast channel: any number of consumers, a lagging
//! consumer loses the oldest events (and is told how many), training never waits for a
//! consumer (EV-1).

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::mesh::{Generation, Layout, Rank};
use crate::trace::{TimeBreakdown, TraceRecord};

/// Something that happened in a job.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum JobEvent {
    /// The actors are up and the job is about to synchronize the replicas.
    Started {
        /// The mesh.
        layout: Layout,
        /// The mesh's generation.
        generation: Generation,
    },
    /// Every replica now holds rank 0's parameters (the initial broadcast).
    ReplicasSynchronized {
        /// Fingerprint of each rank's parameters before the broadcast, by rank.
        before: Vec<u64>,
        /// Fingerprint of each rank's parameters after the broadcast, by rank.
        after: Vec<u64>,
    },
    /// A step finished (or was skipped by the non-finite policy).
    StepDone(StepDone),
    /// A rank has been persistently slower than the others (`JobBuilder::straggler_detection`,
    /// STRAG-1): named before any time-out fires.
    Straggler {
        /// The step at which it was found.
        step: u64,
        /// The rank.
        rank: Rank,
        /// Its stage (replica, pipeline stage, tensor-parallel rank).
        stage: crate::mesh::StageId,
        /// Its median compute time over the detector's window divided by the other ranks' median.
        slowdown: f64,
        /// Its median compute time (forward and backward) per step, in seconds.
        median_s: f64,
        /// The other ranks' median, in seconds.
        typical_s: f64,
    },
    /// A rank named by [`JobEvent::Straggler`] is no longer slow.
    StragglerRecovered {
        /// The step.
        step: u64,
        /// The rank.
        rank: Rank,
        /// Its slowdown now.
        slowdown: f64,
    },
    /// A replica computed a NaN or infinite loss (or, with clipping, the all-reduced gradient
    /// was not finite).
    NonFiniteLoss {
        /// The step.
        step: u64,
        /// The replicas whose loss was not finite; empty when the losses were finite but the
        /// gradient was not.
        ranks: Vec<Rank>,
        /// Whether the job skipped the step (else it stops).
        skipped: bool,
    },
    /// Mixed precision with loss scaling (f16): the all-reduced gradient of `step` held an
    /// inf or a NaN, so every replica skipped the step and backed the scale off (PREC-2).
    GradientOverflow {
        /// The step.
        step: u64,
        /// The scale the step's loss was multiplied by.
        scale: f32,
        /// The scale from the next step on.
        next_scale: f32,
    },
    /// A device (and the stage on it) was lost at `step`.
    DeviceLost {
        /// The step during which it was lost.
        step: u64,
        /// Its rank in the generation it was lost in.
        rank: Rank,
        /// The device.
        device: crate::mesh::DeviceId,
        /// The error that named it.
        error: Error,
    },
    /// A failure the recovery policy asked to recover from could not be: the job ends with
    /// the failure's own error (REC-3, published next as [`JobEvent::Failed`]); this says why
    /// it was not recovered.
    NotRecovered {
        /// The step that failed.
        step: u64,
        /// The ranks found lost (in the generation they were lost in).
        lost: Vec<Rank>,
        /// Why the policy could not be carried out.
        reason: String,
    },
    /// The mesh was rebuilt without the lost devices; `step` is redone by the survivors.
    Recovered {
        /// The step that is redone.
        step: u64,
        /// The new generation of the mesh.
        generation: Generation,
        /// The new mesh.
        layout: Layout,
        /// The devices that left.
        lost: Vec<crate::mesh::DeviceId>,
    },
    /// A checkpoint of the state after `step` steps was written.
    CheckpointWritten {
        /// Steps completed when the snapshot was taken.
        step: u64,
        /// Its directory.
        path: std::path::PathBuf,
    },
    /// Writing a checkpoint failed; training goes on and older checkpoints stay valid.
    CheckpointFailed {
        /// Steps completed when the snapshot was taken.
        step: u64,
        /// Why.
        error: Error,
    },
    /// The job restored a checkpoint and continues after its `step` steps.
    Restored {
        /// Steps completed in the checkpoint: the next step run is this one.
        step: u64,
        /// The checkpoint's directory.
        path: std::path::PathBuf,
        /// Newer checkpoints that were refused, and why.
        refused: Vec<String>,
    },
    /// The job was asked to resume but found no checkpoint that verifies, so it starts from
    /// its initial model at step 0 (with `require_checkpoint(true)` the job fails instead).
    NothingToResume {
        /// Where the checkpoints were looked for (a store's root directory).
        location: String,
    },
    /// The job's number of data-parallel replicas changed at a step boundary (`scale_to`,
    /// or a fault plan's `Resize`).
    Resized {
        /// The first step run at the new size.
        step: u64,
        /// The new generation of the mesh.
        generation: Generation,
        /// Replicas before.
        from: u32,
        /// Replicas after.
        to: u32,
    },
    /// A `scale_to` was not applied.
    ResizeRefused {
        /// The size asked for.
        requested: u32,
        /// Why.
        reason: String,
    },
    /// A failure was recovered by rolling back to a checkpoint in place (REC-5): lost devices
    /// were replaced, every replica restored the checkpoint, and training goes on from its
    /// step (the steps after it are run again).
    RolledBack {
        /// The step that failed.
        failed_step: u64,
        /// The checkpoint's step: the next step to run.
        step: u64,
        /// The new generation of the mesh.
        generation: Generation,
        /// The checkpoint's directory.
        path: std::path::PathBuf,
        /// The devices that were replaced.
        lost: Vec<crate::mesh::DeviceId>,
    },
    /// A lost pipeline stage was replaced by a fresh one on `device` that copied the
    /// parameters and optimizer state of its twin in another replica (REC-6).
    StageReplaced {
        /// The step that is redone.
        step: u64,
        /// The replaced stage.
        stage: crate::mesh::StageId,
        /// The twin it copied.
        twin: crate::mesh::StageId,
        /// Its new device.
        device: crate::mesh::DeviceId,
    },
    /// Some survivors of a failure had finished `step` (and applied it) and others had not:
    /// those took the state of one that had, and the step is not redone (REC-7).
    CaughtUp {
        /// The step.
        step: u64,
        /// The ranks (in the new generation) that had not finished it.
        ranks: Vec<Rank>,
        /// The rank (in the new generation) whose parameters and optimizer state they took.
        from: Rank,
    },
    /// The job paused (`pause()`): no step starts until `resume()`.
    Paused,
    /// Losses left fewer replicas than the elastic minimum: the job holds its next step until
    /// `scale_to(n ≥ min)` adds devices (or `resume()` accepts the smaller mesh), and ends
    /// with `Error::BelowMinimum` after `within` (ELASTIC-3).
    WaitingForDevices {
        /// The step that waits.
        step: u64,
        /// Replicas left.
        replicas: u32,
        /// The elastic minimum.
        min: u32,
        /// How long the job waits.
        within: std::time::Duration,
    },
    /// The job resumed after a pause.
    Resumed,
    /// A fault of the job's fault plan fired.
    FaultInjected(crate::faults::FiredFault),
    /// The job failed and is ending with this error.
    Failed(Error),
    /// The job finished; the trained model is available from `join()`.
    Finished {
        /// Steps run (skipped steps included).
        steps: u64,
        /// Fingerprint of each rank's final parameters.
        fingerprints: Vec<u64>,
    },
}

/// A finished step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepDone {
    /// The step (0-based).
    pub step: u64,
    /// The mean loss over the global batch (all replicas).
    pub loss: f32,
    /// Global batch size divided by the step's wall time.
    pub samples_per_s: f64,
    /// The step's wall time, as the Supervisor saw it.
    pub wall_s: f64,
    /// The learning rate the optimizer used (`None` when skipped).
    pub learning_rate: Option<f64>,
    /// True when the update was skipped: by the non-finite policy, or by the loss scaler
    /// on an overflow (then a `GradientOverflow` event comes before).
    pub skipped: bool,
    /// The loss scale the step used (f16 mixed precision), `None` without loss scaling.
    #[serde(default)]
    pub loss_scale: Option<f32>,
    /// What each rank did, by rank (with pipelines, every stage of every replica).
    pub replicas: Vec<ReplicaStep>,
    /// With pipeline parallelism: the step's measured timeline and memory figures.
    pub pipeline: Option<PipelineStep>,
    /// The minor page faults the Supervisor's process took during the step (Linux; `None`
    /// elsewhere): memory touched fresh, which the kernel zeroed first. In one process that
    /// is every rank's; across processes the head's alone.
    #[serde(default)]
    pub page_faults: Option<u64>,
}

/// How one pipeline stage spent a step's measured interval; the three add up to 1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StageShares {
    /// Forwards and backwards.
    pub compute: f64,
    /// Sends to the neighbouring stages.
    pub communication: f64,
    /// Waiting in receives, or done before the other stages.
    pub waiting: f64,
}

/// What one pipeline stage ran in a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PipelineStageStep {
    /// Its instructions with their start and end, in microseconds since the job started.
    pub executed: Vec<crate::parallel::pipeline::TimedInstr>,
    /// The most micro-batch chunks it stashed at once.
    pub peak_stash: u32,
    /// The most bytes of boundary tensors it stashed at once.
    pub peak_activation_bytes: u64,
    /// What its blocks held during the step, instruction by instruction, counted by the
    /// worker (parameters full and sharded, gradients, stashed activations).
    #[serde(default)]
    pub memory: crate::parallel::memory::StepMemory,
    /// What its tensor-parallel group's collectives moved during the step (none at tp = 1).
    #[serde(default)]
    pub tensor_parallel: Option<crate::parallel::tensor::TpTraffic>,
}

/// What a pipeline step looked like, measured from the instructions the stages ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PipelineStep {
    /// The measured bubble of replica 0's pipeline: for each stage, the share of the interval
    /// from the step's first instruction start to its last instruction end spent not
    /// computing, averaged over stages (PIPE-5's definition, on real times).
    pub bubble: f64,
    /// Per stage of replica 0: the shares of the measured interval spent computing,
    /// communicating (sends) and waiting (receives, or done before the others).
    pub shares: Vec<StageShares>,
    /// Per stage: the most micro-batch chunks stashed at once (largest over replicas).
    pub peak_stash: Vec<u32>,
    /// Per stage: the most bytes of boundary tensors stashed at once (largest over replicas).
    pub peak_activation_bytes: Vec<u64>,
    /// Replica 0's timeline: per stage, every instruction with its start and end in
    /// microseconds from the step's first instruction (for `render_svg` and traces).
    pub timeline: Vec<Vec<crate::parallel::pipeline::TimedInstr>>,
}

/// One replica's part of a step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplicaStep {
    /// The rank.
    pub rank: Rank,
    /// Its replica and pipeline stage (stage 0 without pipeline parallelism).
    pub stage: crate::mesh::StageId,
    /// The ids of the samples it trained on, in the order used.
    pub sample_ids: Vec<usize>,
    /// Its mean loss over its samples (`None` on pipeline stages that do not compute the
    /// loss: all but the last).
    pub loss: Option<f32>,
    /// Where its time went.
    pub breakdown: TimeBreakdown,
    /// Its trace records of this step.
    pub trace: Vec<TraceRecord>,
    /// A pipeline stage's instructions as they ran, and its stash figures.
    pub pipeline: Option<PipelineStageStep>,
    /// What the rank held of the training state at this step (parameters, gradients,
    /// optimizer state; `None` where the rank did not report it).
    pub held: Option<crate::parallel::sync::HeldBytes>,
    /// Bytes its transport sent in the step, counted by the transport
    /// (`Communicator::bytes_sent`), in data-parallel jobs (`.model(..)`); 0 where a direct
    /// shared-memory plan moved them, and in pipeline and block jobs (not counted yet).
    #[serde(default)]
    pub bytes_sent: u64,
    /// A parameter-server worker: the staleness of every gradient of it the server applied
    /// in this step, and the sample ids dropped (backup workers); `None` in other jobs.
    #[serde(default)]
    pub parameter_server: Option<crate::parallel::parameter_server::ParameterServerStep>,
}

impl ReplicaStep {
    /// Seconds its optimizer update took in the step (its `OptimizerStep` trace spans).
    pub fn optimizer_s(&self) -> f64 {
        self.trace
            .iter()
            .filter(|t| matches!(t.kind, crate::trace::TraceKind::OptimizerStep))
            .map(|t| t.duration_us as f64 * 1e-6)
            .sum()
    }

    /// Seconds its forwards and backwards took in the step (a pipeline or block job's
    /// executed instructions; 0 in other jobs).
    pub fn compute_s(&self) -> f64 {
        self.pipeline
            .iter()
            .flat_map(|p| p.executed.iter())
            .filter(|t| t.instr.is_compute())
            .map(|t| t.end.saturating_sub(t.start) as f64 * 1e-6)
            .sum()
    }
}
