//! What a job that synchronises less often ([`LocalUpdates`],
//! [`JobBuilder::local_updates`](super::JobBuilder::local_updates)) may be combined with,
//! checked when the job is built (JOB-1): the rule's own values
//! ([`LocalUpdates::validate`]) and the job's length.

use crate::error::{Error, Result};
use crate::parallel::local::LocalUpdates;

/// Refuse what local updates cannot do with this job's values (with the reason and what to do
/// instead); the strategies they do not combine with are rows of
/// [`crate::composition::REFUSALS`].
pub(super) fn check(updates: &LocalUpdates, dp: u32, steps: u64) -> Result<()> {
    let name = updates.name();
    updates.validate(dp)?;
    if !steps.is_multiple_of(u64::from(updates.every())) {
        return Err(Error::InvalidConfig(format!(
            "local_updates({updates}) with steps({steps}): the trained model is rank 0's, so \
             the job must end on a synchronisation: use a multiple of {} steps for {name}",
            updates.every()
        )));
    }
    Ok(())
}
