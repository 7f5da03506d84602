//! What a job that synchronises less often ([`LocalUpdates`],
//! [`JobBuilder::local_updates`](super::JobBuilder::local_updates)) may be combined with,
//! checked when the job is built (JOB-1): the rule's own values
//! ([`LocalUpdates::validate`]) and the job's other settings.

use crate::error::{Error, Result};
use crate::parallel::local::LocalUpdates;
use crate::parallel::zero::ZeroStage;
use crate::precision::Precision;

/// The settings of a job that bear on local updates.
#[derive(Debug, Clone, Copy)]
pub(super) struct Combination {
    /// The model is given as blocks or pipeline stages.
    pub(super) blocks: bool,
    pub(super) zero: ZeroStage,
    pub(super) tp: u32,
    /// The job runs across processes.
    pub(super) remote: bool,
    pub(super) precision: Precision,
    pub(super) dp: u32,
    pub(super) steps: u64,
    /// The job clips the gradient's global norm.
    pub(super) clip: bool,
}

/// Refuse what local updates cannot do (with the reason and what to do instead).
pub(super) fn check(updates: &LocalUpdates, c: Combination) -> Result<()> {
    let name = updates.name();
    updates.validate(c.dp)?;
    let refuse = |what: &str, why: &str| {
        Err(Error::InvalidConfig(format!(
            "local_updates({updates}) with {what}: {why}"
        )))
    };
    if c.blocks {
        return refuse(
            "a model given as blocks or pipeline stages",
            "ranks step alone on whole replicas; give the model with .model(..)",
        );
    }
    if c.zero != ZeroStage::Off {
        return refuse(
            &format!("zero({:?})", c.zero),
            "each rank steps its own optimizer on its own parameters, there is no shared \
             state to shard",
        );
    }
    if c.tp != 1 {
        return refuse(
            &format!("tensor_parallel({})", c.tp),
            "tensor-parallel blocks need a gradient collective every step",
        );
    }
    if c.remote {
        return refuse(
            "a job across processes (cluster)",
            "not supported yet; run it in one process",
        );
    }
    if c.clip {
        return refuse(
            "clip_grad_norm",
            "a rank stepping alone would clip its own gradient, not the group's mean, and \
             decide alone to skip a non-finite one, falling out of the group's \
             synchronisation schedule; clip inside the loss or use plain data parallelism",
        );
    }
    if c.precision.scales_loss() {
        return refuse(
            "precision(f16)",
            "the loss scaler's overflow decision must be the same on every rank (PREC-2) and \
             a rank stepping alone sees only its own gradient; use bf16 or f32",
        );
    }
    if !c.steps.is_multiple_of(u64::from(updates.every())) {
        return refuse(
            &format!("steps({})", c.steps),
            &format!(
                "the trained model is rank 0's, so the job must end on a synchronisation: use \
                 a multiple of {} steps for {name}",
                updates.every()
            ),
        );
    }
    Ok(())
}
