//! `FaultTolerance`: what a job does about failures, as one settings value.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::faults::FaultPlan;
use crate::recovery::RecoveryPolicy;

/// What a job does about failures, in one value passed to
/// [`JobBuilder::fault_tolerance`](crate::job::JobBuilder::fault_tolerance): how it recovers from a
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
#[serde(default, deny_unknown_fields)]
pub struct FaultTolerance {
    /// How to recover from a lost device.
    pub recovery: RecoveryPolicy,
    /// The fewest data-parallel replicas the job trains with (ELASTIC-3): below it, it waits.
    pub elastic_min: u32,
    /// The most data-parallel replicas [`JobHandle::scale_to`](crate::job::JobHandle::scale_to) may
    /// ask for.
    pub elastic_max: u32,
    /// How long a job below its minimum waits for devices before it ends with
    /// `Error::BelowMinimum`.
    #[serde(with = "crate::config::duration")]
    pub elastic_wait: Duration,
    /// Faults to inject (a rehearsal of failures: see [`crate::faults`]); none by default.
    #[serde(with = "plan_in_binary_as_json")]
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

/// A fault plan as itself in a file, as its JSON text in a binary format: its fault kinds are
/// internally tagged, which bincode cannot carry; checked by `FaultPlan::from_json` when
/// decoded.
mod plan_in_binary_as_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::faults::FaultPlan;

    pub(super) fn serialize<S: Serializer>(
        plan: &Option<FaultPlan>,
        to: S,
    ) -> Result<S::Ok, S::Error> {
        if to.is_human_readable() {
            return plan.serialize(to);
        }
        plan.as_ref().map(FaultPlan::to_json).serialize(to)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        from: D,
    ) -> Result<Option<FaultPlan>, D::Error> {
        if from.is_human_readable() {
            return Option::<FaultPlan>::deserialize(from);
        }
        Option::<String>::deserialize(from)?
            .map(|text| FaultPlan::from_json(&text).map_err(serde::de::Error::custom))
            .transpose()
    }
}
