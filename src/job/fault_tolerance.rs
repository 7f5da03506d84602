//! `FaultTolerance`: what a job does about failures, as one settings value.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::faults::FaultPlan;
use crate::recovery::RecoveryPolicy;

/// What a job does about failures, in one value passed to
/// [`JobBuilder::fault_tolerance`](super::JobBuilder::fault_tolerance): how it recovers from a
/// lost device, the data-parallel sizes it may run at, how long it waits below its minimum,
/// and, for a rehearsal, the faults to inject.
///
/// The default is the builder's: a lost device fails the job ([`RecoveryPolicy::default`]),
/// any size from 1 replica up, a 5-minute wait, no injected faults.
///
/// ```
/// use std::time::Duration;
/// use meshwork::prelude::*;
///
/// let tolerance = FaultTolerance::new()
///     .recovery(RecoveryPolicy::shrink().min_replicas(2))
///     .elastic(2, 8)
///     .elastic_wait(Duration::from_secs(60));
/// assert_eq!((tolerance.elastic_min, tolerance.elastic_max), (2, 8));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultTolerance {
    /// How to recover from a lost device.
    pub recovery: RecoveryPolicy,
    /// The fewest data-parallel replicas the job trains with (ELASTIC-3): below it, it waits.
    pub elastic_min: u32,
    /// The most data-parallel replicas [`JobHandle::scale_to`](super::JobHandle::scale_to) may
    /// ask for.
    pub elastic_max: u32,
    /// How long a job below its minimum waits for devices before it ends with
    /// `Error::BelowMinimum`.
    pub elastic_wait: Duration,
    /// Faults to inject (a rehearsal of failures: see [`crate::faults`]); none by default.
    pub fault_plan: Option<FaultPlan>,
}

impl Default for FaultTolerance {
    fn default() -> Self {
        Self {
            recovery: RecoveryPolicy::default(),
            elastic_min: 1,
            elastic_max: u32::MAX,
            elastic_wait: Duration::from_secs(300),
            fault_plan: None,
        }
    }
}

impl FaultTolerance {
    /// The defaults: fail on a lost device, any size, a 5-minute wait, no injected faults.
    pub fn new() -> Self {
        Self::default()
    }

    /// How to recover from a lost device.
    pub fn recovery(mut self, policy: RecoveryPolicy) -> Self {
        self.recovery = policy;
        self
    }

    /// The data-parallel sizes the job may run at: `scale_to` asks within `min..=max`, and
    /// failures that leave fewer than `min` replicas make it wait for devices (ELASTIC-3).
    pub fn elastic(mut self, min: u32, max: u32) -> Self {
        self.elastic_min = min;
        self.elastic_max = max;
        self
    }

    /// How long a job below its elastic minimum waits for devices.
    pub fn elastic_wait(mut self, wait: Duration) -> Self {
        self.elastic_wait = wait;
        self
    }

    /// Inject the faults of `plan`.
    pub fn fault_plan(mut self, plan: FaultPlan) -> Self {
        self.fault_plan = Some(plan);
        self
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::FaultTolerance;
    use crate::demo::{Mlp, Sample, TeacherTask, mse_loss};
    use crate::error::Error;
    use crate::job::{Job, JobBuilder};
    use crate::recovery::RecoveryPolicy;

    fn builder() -> JobBuilder<Mlp, Sample> {
        let task = TeacherTask {
            d_in: 4,
            d_out: 2,
            noise: 0.1,
            seed: 1,
        };
        Job::builder()
            .initial_model(Mlp::new(&[4, 8, 2], &Device::flex()))
            .loss(mse_loss)
            .data(task.dataset(32))
            .batch_size(8)
            .steps(1)
    }

    fn refusal(b: JobBuilder<Mlp, Sample>) -> String {
        match b.build() {
            Err(Error::InvalidConfig(m)) => m,
            Err(Error::Refused(r)) => r.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn fault_tolerance_sets_what_its_shorthands_set() {
        let grouped = refusal(builder().fault_tolerance(FaultTolerance::new().elastic(3, 2)));
        let shorthand = refusal(builder().elastic(3, 2));
        assert_eq!(grouped, shorthand);
        assert!(grouped.contains("elastic(3, 2)"), "{grouped}");

        let policy = RecoveryPolicy::roll_back();
        let grouped = refusal(builder().fault_tolerance(FaultTolerance::new().recovery(policy)));
        assert_eq!(grouped, refusal(builder().recovery(policy)));
        assert!(grouped.contains("checkpoint"), "{grouped}");
    }

    #[test]
    fn fault_tolerance_replaces_every_earlier_failure_setting() {
        // The value replaces the shorthands set before it: the defaults build.
        let b = builder()
            .elastic(3, 2)
            .recovery(RecoveryPolicy::roll_back())
            .fault_tolerance(FaultTolerance::default());
        assert!(b.build().is_ok());
    }
}
