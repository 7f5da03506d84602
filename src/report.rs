//! What device-side work reports to the runtime, as plain data: a stage's [`InitReport`] and
//! [`StepReport`], a device's [`Heartbeat`]. They sit below the actors so that the control
//! protocol (which carries them between processes) and the actors share them without either
//! knowing the other.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::events::PipelineStageStep;
use crate::mesh::{DeviceId, Rank};
use crate::trace::TraceRecord;

/// What a device reports in answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The device.
    pub device: DeviceId,
    /// The task running now and for how long, if any.
    pub busy: Option<(String, Duration)>,
    /// Tasks finished so far.
    pub tasks_done: u64,
    /// The last progress the running task reported (step, micro-batch, instruction) and how
    /// long ago: a task whose progress does not move is stuck, though its device answers.
    pub progress: Option<(String, Duration)>,
}

/// What a stage reports after the initial synchronization.
#[derive(Debug, Clone)]
pub struct InitReport {
    /// Fingerprint of the parameters the factory built.
    pub before: u64,
    /// Fingerprint after receiving rank 0's parameters.
    pub after: u64,
}

/// What a stage reports after a step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepReport {
    /// The stage's rank.
    pub rank: Rank,
    /// The sample ids it trained on, micro-batch after micro-batch.
    pub sample_ids: Vec<usize>,
    /// Its mean loss (`None` on a pipeline stage other than the last).
    pub local_loss: Option<f32>,
    /// The learning rate used (`None` when the update was skipped).
    pub learning_rate: Option<f64>,
    /// Its trace records.
    pub trace: Vec<TraceRecord>,
    /// A pipeline stage's instructions and stash figures.
    pub pipeline: Option<PipelineStageStep>,
    /// What the rank held of the training state at this step (`None` when it did not step).
    #[serde(default)]
    pub held: Option<crate::parallel::sync::HeldBytes>,
    /// The loss scale this step used and the one the next step uses (f16 mixed precision),
    /// `None` without loss scaling.
    #[serde(default)]
    pub loss_scale: Option<(f32, f32)>,
    /// Bytes the rank's transport sent in the step (`Communicator::bytes_sent`: messages of
    /// its collectives and point-to-point sends, 16-bit values 2 bytes each).
    #[serde(default)]
    pub bytes_sent: u64,
    /// A parameter-server worker's gradients applied and samples dropped in the step.
    #[serde(default)]
    pub parameter_server: Option<crate::parallel::parameter_server::ParameterServerStep>,
}
