//! The crate's one error type: every public fallible function returns [`Result`].

use std::time::Duration;

use crate::comm::CommError;
use crate::mesh::Rank;
pub use crate::mesh::{DeviceId, StageId};

/// Shorthand for `Result<T, meshwork::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in meshwork, as values callers can match on.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The job's configuration cannot run; the message says what to change.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The job combines strategies or settings that the one table of refusals
    /// ([`crate::composition::REFUSALS`]) refuses: the row names the features, why, and what
    /// to do instead.
    #[error("invalid configuration: {0}")]
    Refused(#[from] crate::composition::Refused),
    /// A collective operation failed (time-out, mismatch, shut-down group).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The multi-process control plane failed: no secret, a node refused or missing, the
    /// head lost (feature `cluster`). The source is a `cluster::control::ControlError`
    /// (`downcast_ref` it to match): the control plane sits above this module in the layer
    /// order, so it converts its own errors (`From<ControlError> for Error`).
    #[cfg(feature = "cluster")]
    #[error(transparent)]
    Control(std::sync::Arc<dyn std::error::Error + Send + Sync>),
    /// A pipeline schedule cannot serve the configuration (PIPE-7).
    #[error(transparent)]
    Schedule(#[from] crate::parallel::pipeline::ScheduleError),
    /// A pipeline stage could not execute its schedule (a neighbour never sent, a panic).
    #[error(transparent)]
    Pipeline(#[from] crate::parallel::pipeline_exec::ExecError),
    /// A pipeline schedule failed validation or simulation (missing instruction, deadlock).
    #[error(transparent)]
    ScheduleCheck(#[from] crate::parallel::pipeline::ScheduleSimError),
    /// Code running on a device thread failed (a panic in the model's forward, backward or the
    /// optimizer): the job ends with this error.
    #[error("{stage} on device {device} failed during {during}: {reason}")]
    StageFailed {
        /// The device whose thread ran the failing work.
        device: DeviceId,
        /// The stage that was running.
        stage: StageId,
        /// What the stage was doing (forward, backward, optimizer step, ...).
        during: String,
        /// The panic message or error text.
        reason: String,
    },
    /// The model mixed float types in one operation on a device thread (Burn's dtype
    /// assertion), which under mixed precision means a cast is missing (PREC-4): the job ends
    /// with this error, which names the casts to add, in place of the backend's assertion.
    #[error(
        "{stage} on device {device} failed during {during}: the model mixed float types in one \
         operation ({reason}). Under mixed precision the parameters are 16-bit: cast the \
         model's input to its parameters' dtype in its first operation \
         (`x.cast(self.first.weight.val().dtype())`) and its output to f32 before the loss \
         (`y.cast(FloatDType::F32)`); see meshwork::parallel::autocast"
    )]
    DtypeMismatch {
        /// The device whose thread ran the failing work.
        device: DeviceId,
        /// The stage that was running.
        stage: StageId,
        /// What the stage was doing (forward, backward, ...).
        during: String,
        /// The backend's assertion.
        reason: String,
    },
    /// A stage's actor is gone (its device was killed or stopped) and did not answer.
    #[error("{stage} on device {device} was lost: {reason}")]
    StageLost {
        /// The device.
        device: DeviceId,
        /// The stage.
        stage: StageId,
        /// What was seen.
        reason: String,
    },
    /// The job recovered from too many failures within the policy's window (REC-2).
    #[error(
        "{count} recoveries within {window:?}, more than the policy allows; the last failure: {last}"
    )]
    TooManyFailures {
        /// Recoveries counted in the window.
        count: u32,
        /// The window.
        window: Duration,
        /// The failure that went over the limit.
        last: Box<Error>,
    },
    /// A collective timed out because these ranks never arrived; the Supervisor probed each
    /// one's device: alive but not progressing (stuck), alive and progressing (slow), or not
    /// answering (dead).
    #[error(
        "{op} #{seq} ({generation}) timed out after {waited:?} waiting for {}",
        health_list(ranks)
    )]
    RanksUnresponsive {
        /// The collective.
        op: crate::comm::CollectiveKind,
        /// Its sequence number.
        seq: u64,
        /// The group's generation.
        generation: crate::mesh::Generation,
        /// The time-out that expired.
        waited: Duration,
        /// Each missing rank and what its device said.
        ranks: Vec<RankHealth>,
    },
    /// Losses left fewer replicas than the elastic minimum and no device joined within the
    /// wait (ELASTIC-3).
    #[error(
        "{replicas} replica(s) left, below the elastic minimum of {min}, and no device joined \
         within {waited:?}"
    )]
    BelowMinimum {
        /// Replicas left.
        replicas: u32,
        /// The elastic minimum.
        min: u32,
        /// How long the job waited for devices.
        waited: Duration,
    },
    /// A device did not answer within its time-out.
    #[error("device {device} did not answer {what} within {waited:?}")]
    DeviceUnresponsive {
        /// The silent device.
        device: DeviceId,
        /// The request that went unanswered.
        what: String,
        /// How long we waited.
        waited: Duration,
    },
    /// Some stages did not finish a step within the step time-out.
    #[error(
        "step {step}: {missing:?} did not finish within {waited:?} (device status: {devices:?})"
    )]
    StepTimeout {
        /// The step.
        step: u64,
        /// The stages that had not reported.
        missing: Vec<StageId>,
        /// How long the Supervisor waited.
        waited: Duration,
        /// What each of their devices said it was doing (from heartbeats).
        devices: Vec<String>,
    },
    /// The loss was NaN or infinite and the policy is to stop.
    #[error("non-finite loss at step {step} on {ranks:?}")]
    NonFiniteLoss {
        /// The step whose loss was not finite.
        step: u64,
        /// The replicas that saw a non-finite loss.
        ranks: Vec<Rank>,
    },
    /// The all-reduced gradient was NaN or infinite (seen when clipping by norm) and the
    /// policy is to stop.
    #[error("non-finite gradient norm at step {step}")]
    NonFiniteGradient {
        /// The step.
        step: u64,
    },
    /// A batch could not be built from the dataset.
    #[error("data error: {0}")]
    Data(String),
    /// An actor of the runtime stopped or could not be reached.
    #[error("actor runtime: {0}")]
    Runtime(String),
    /// The job was stopped before it produced a model.
    #[error("job stopped: {0}")]
    Stopped(String),
    /// A checkpoint could not be written, or was refused when read (CKPT-1..5 in
    /// `src/checkpoint.rs`).
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// A parameter-server job was refused or its server failed
    /// (`parallel::parameter_server`).
    #[error(transparent)]
    ParameterServer(#[from] crate::parallel::parameter_server::ParameterServerError),
    /// Reading or writing a file failed.
    #[error("i/o error on {path}: {reason}")]
    Io {
        /// The file involved.
        path: String,
        /// The operating system's error text.
        reason: String,
    },
}

/// A rank that did not arrive at a collective, and what its device said.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankHealth {
    /// The rank.
    pub rank: Rank,
    /// Its device.
    pub device: DeviceId,
    /// What the probe found.
    pub health: Health,
}

/// What a heartbeat probe found about a rank that did not arrive.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Health {
    /// The device answers, but its task has reported no progress for `since`.
    Stuck {
        /// The last progress it reported.
        progress: String,
        /// How long ago.
        since: Duration,
    },
    /// The device answers and its task is still moving (a slow device).
    Progressing {
        /// The last progress it reported.
        progress: String,
    },
    /// The device did not answer the probe.
    Dead {
        /// What the probe saw.
        reason: String,
    },
}

fn health_list(ranks: &[RankHealth]) -> String {
    ranks
        .iter()
        .map(|r| {
            let what = match &r.health {
                Health::Stuck { progress, since } => {
                    format!("stuck (alive, no progress for {since:?}, last: {progress})")
                }
                Health::Progressing { progress } => format!("alive and progressing ({progress})"),
                Health::Dead { reason } => format!("dead ({reason})"),
            };
            format!("rank {} on device {}: {what}", r.rank.0, r.device)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl Error {
    /// Whether this is a collective message lost or spoiled while every rank stayed alive
    /// (`CommError::is_message_fault`): retried by a recovering job (REC-4).
    pub fn is_message_fault(&self) -> bool {
        matches!(self, Error::Comm(c) if c.is_message_fault())
    }
}

impl From<crate::config::InvalidConfig> for Error {
    fn from(e: crate::config::InvalidConfig) -> Self {
        Error::InvalidConfig(e.0)
    }
}

impl From<crate::parallel::sync::SyncError> for Error {
    fn from(e: crate::parallel::sync::SyncError) -> Self {
        match e {
            crate::parallel::sync::SyncError::Comm(c) => Error::Comm(c),
            other => Error::Runtime(other.to_string()),
        }
    }
}
