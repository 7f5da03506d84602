//! What the Supervisor does when a device is lost: the policy a user picks, and the pure
//! decision it implies.
//!
//! - REC-1: a lost data-parallel replica with `Shrink` and enough survivors (≥
//!   `min_replicas`) shrinks the group under a new generation; the failed step is redone by
//!   the survivors on the same global batch (`KeepGlobal`: the survivors split it, shares
//!   differing by at most one sample, each weighted by its share) so no sample is dropped.
//! - REC-4: a failure that lost or spoiled a collective message while every rank stayed
//!   alive (`CommError::is_message_fault`) is retried: the same members regroup under a new
//!   generation and redo the step (nothing of it was applied), if the policy recovers at
//!   all; it counts against the restart limit.
//! - REC-5: with `roll_back`, a failure nothing else recovers (a loss that shrinking may
//!   not take, replicas that diverged) replaces the lost devices, restores every replica
//!   from the newest valid checkpoint and trains on from its step, in the same process and
//!   at the same size; without a checkpoint the job ends with the failure's error.
//! - REC-6: in a pipeline job with a recovering policy, lost stages whose stage index still
//!   has a surviving replica (a twin) are replaced by fresh stages on spare or new devices
//!   that copy the twin's parameters and optimizer state; the mesh is rewired under a new
//!   generation and the step is redone, at the same size. Without twins the job rolls back
//!   (with `roll_back`) or ends with the failure's error.
//! - REC-7: where some survivors finished the failed step's last collective (and applied it)
//!   and others did not, the others take the state of one that did and the step is not
//!   redone; the state taken includes the learning-rate scheduler's (LR-2 in `optim`).
//! - REC-2: more than `max_restarts` recoveries within `window` end the job with
//!   `Error::TooManyFailures`, carrying the last failure.
//! - REC-3: anything else (pipeline jobs, too few survivors, `Fail`) ends the job with the
//!   failure's own typed error, as without a policy.
//!
//! - **SCALE-2** `decide`'s survivors come from a mask of the lost ranks, linear in the world;
//!   proptested at 16,384 ranks with up to 4,096 lost.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What to do when a data-parallel replica is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum OnReplicaLoss {
    /// End the job with the failure's error (the default).
    #[default]
    Fail,
    /// Continue with the survivors (REC-1).
    Shrink,
}

/// How the Supervisor recovers from lost devices.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecoveryPolicy {
    /// What a lost replica does.
    pub on_replica_loss: OnReplicaLoss,
    /// Fewer survivors than this end the job.
    pub min_replicas: u32,
    /// At most this many recoveries within `window` (REC-2).
    pub max_restarts: u32,
    /// The restart window.
    #[serde(with = "crate::config::duration")]
    pub window: Duration,
    /// When nothing else recovers a failure, roll back to the last checkpoint in place
    /// (REC-5).
    #[serde(default)]
    pub roll_back: bool,
}

impl Default for RecoveryPolicy {
    fn default() -> Self {
        Self {
            on_replica_loss: OnReplicaLoss::Fail,
            min_replicas: 1,
            max_restarts: 3,
            window: Duration::from_secs(60),
            roll_back: false,
        }
    }
}

impl RecoveryPolicy {
    /// Shrink to the survivors (at least one), at most 3 recoveries a minute.
    pub fn shrink() -> Self {
        Self {
            on_replica_loss: OnReplicaLoss::Shrink,
            ..Self::default()
        }
    }

    /// Keep the job's size: replace lost devices and roll every replica back to the last
    /// checkpoint (REC-5), at most 3 recoveries a minute. Needs checkpoints.
    pub fn roll_back() -> Self {
        Self {
            roll_back: true,
            ..Self::default()
        }
    }

    /// Whether the policy recovers from anything (shrinks, replaces or rolls back); the
    /// default does not: a lost device fails the job.
    pub fn recovers(&self) -> bool {
        self.on_replica_loss == OnReplicaLoss::Shrink || self.roll_back
    }

    /// The same policy, rolling back to the last checkpoint where it would otherwise fail
    /// (REC-5; e.g. a shrink below `min_replicas`).
    pub fn or_roll_back(mut self) -> Self {
        self.roll_back = true;
        self
    }

    /// The same policy with a different minimum number of replicas.
    pub fn min_replicas(mut self, n: u32) -> Self {
        self.min_replicas = n;
        self
    }

    /// The same policy with a different restart limit.
    pub fn max_restarts(mut self, n: u32, window: Duration) -> Self {
        self.max_restarts = n;
        self.window = window;
        self
    }
}

/// What to do about a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Continue with these replicas (indices into the current ranks, in rank order).
    Shrink {
        /// The surviving ranks' indices.
        survivors: Vec<usize>,
    },
    /// End the job: why recovery does not apply.
    Fail(String),
    /// Every rank is alive; regroup them all and redo the step (REC-4).
    Retry,
    /// Replace the lost devices, restore every replica from the last checkpoint and train
    /// on from there (REC-5).
    RollBack,
    /// Replace each lost pipeline stage with a fresh one that copies its twin's parameters
    /// and optimizer state, rewire the mesh and redo the step (REC-6).
    ReplaceFromTwins,
    /// End the job: too many recoveries in the window.
    TooMany {
        /// Recoveries counted in the window (this one included).
        count: u32,
    },
}

/// Recent recoveries, for the restart limit (REC-2).
#[derive(Debug, Clone, Default)]
pub struct RestartLog {
    times: VecDeque<Instant>,
}

impl RestartLog {
    /// Recoveries in the window ending at `now`, after recording one at `now`.
    fn record(&mut self, now: Instant, window: Duration) -> u32 {
        self.times.push_back(now);
        while self
            .times
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > window)
        {
            self.times.pop_front();
        }
        self.times.len() as u32
    }
}

/// Decide what to do when `lost` ranks (indices) of a `world`-rank job fail at `now`.
/// `data_parallel_only` says whether every rank is a whole replica (no pipeline);
/// `message_fault` whether the failure was a lost or spoiled message (REC-4); `twins`
/// whether every lost pipeline stage has a surviving twin in another replica (REC-6).
pub fn decide(
    policy: &RecoveryPolicy,
    log: &mut RestartLog,
    world: usize,
    (lost, message_fault, twins): (&[usize], bool, bool),
    data_parallel_only: bool,
    now: Instant,
) -> Decision {
    if !policy.recovers() {
        return Decision::Fail("the recovery policy is to fail".into());
    }
    let choice = if !data_parallel_only {
        if lost.is_empty() {
            return Decision::Fail("no lost pipeline stage could be named".into());
        }
        if twins {
            Decision::ReplaceFromTwins
        } else if policy.roll_back {
            Decision::RollBack
        } else {
            return Decision::Fail(
                "a lost pipeline stage has no surviving twin (every replica of that stage was \
                 lost, or dp = 1) and the policy does not roll back"
                    .into(),
            );
        }
    } else if lost.is_empty() {
        if !message_fault {
            return Decision::Fail("no lost device could be named".into());
        }
        Decision::Retry
    } else {
        // SCALE-2: linear in the world and the lost ranks (a mask, not a search per rank).
        let mut is_lost = vec![false; world];
        for &r in lost {
            if let Some(l) = is_lost.get_mut(r) {
                *l = true;
            }
        }
        let survivors: Vec<usize> = (0..world).filter(|r| !is_lost[*r]).collect();
        let floor = policy.min_replicas.max(1) as usize;
        if policy.on_replica_loss == OnReplicaLoss::Shrink && survivors.len() >= floor {
            Decision::Shrink { survivors }
        } else if policy.roll_back {
            Decision::RollBack
        } else {
            return Decision::Fail(format!(
                "{} survivor(s), fewer than the minimum of {floor}",
                survivors.len(),
            ));
        }
    };
    let count = log.record(now, policy.window);
    if count > policy.max_restarts {
        return Decision::TooMany { count };
    }
    choice
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn rec_1_survivors_are_everyone_not_lost_in_rank_order(
            world in 1usize..9, lost_mask in any::<u16>(), min in 1u32..4,
        ) {
            let lost: Vec<usize> = (0..world).filter(|r| lost_mask & (1 << r) != 0).collect();
            let policy = RecoveryPolicy::shrink().min_replicas(min).max_restarts(100, Duration::from_secs(1));
            let d = decide(&policy, &mut RestartLog::default(), world, (&lost, false, false), true, Instant::now());
            let alive = world - lost.len();
            match d.clone() {
                Decision::Shrink { survivors } => {
                    prop_assert!(!lost.is_empty() && alive >= min as usize);
                    prop_assert_eq!(survivors.len(), alive);
                    prop_assert!(survivors.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(survivors.iter().all(|s| !lost.contains(s)));
                }
                Decision::Fail(_) => prop_assert!(lost.is_empty() || alive < min as usize),
                other => prop_assert!(false, "{:?}", other),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]

        /// SCALE-2: at 16,384 ranks, any set of lost ranks (a node, a rack, scattered ranks,
        /// indices out of range ignored) leaves exactly the others, in rank order.
        #[test]
        fn scale_2_decisions_at_16384_ranks_keep_exactly_the_others(
            lost in prop::collection::vec(0usize..17_000, 1..4096),
            min in 1u32..16_384,
        ) {
            let world = 16_384;
            let policy = RecoveryPolicy::shrink().min_replicas(min).max_restarts(100, Duration::from_secs(1));
            let d = decide(&policy, &mut RestartLog::default(), world, (&lost, false, false), true, Instant::now());
            let gone: std::collections::BTreeSet<usize> = lost.iter().copied().filter(|r| *r < world).collect();
            let alive = world - gone.len();
            match d {
                Decision::Shrink { survivors } => {
                    prop_assert!(alive >= min as usize);
                    prop_assert_eq!(survivors.len(), alive);
                    prop_assert!(survivors.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(survivors.iter().all(|s| !gone.contains(s)));
                }
                Decision::Fail(_) => prop_assert!(alive < min as usize),
                other => prop_assert!(false, "{:?}", other),
            }
        }
    }

    #[test]
    fn rec_2_the_restart_limit_counts_recoveries_inside_the_window() {
        let policy = RecoveryPolicy::shrink().max_restarts(2, Duration::from_secs(10));
        let mut log = RestartLog::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(matches!(
            decide(&policy, &mut log, 8, (&[1], false, false), true, at(0)),
            Decision::Shrink { .. }
        ));
        assert!(matches!(
            decide(&policy, &mut log, 7, (&[1], false, false), true, at(1)),
            Decision::Shrink { .. }
        ));
        assert_eq!(
            decide(&policy, &mut log, 6, (&[1], false, false), true, at(2)),
            Decision::TooMany { count: 3 }
        );
        // Outside the window the old ones no longer count.
        let mut log = RestartLog::default();
        for s in [0, 20, 40, 60] {
            assert!(matches!(
                decide(&policy, &mut log, 8, (&[0], false, false), true, at(s)),
                Decision::Shrink { .. }
            ));
        }
    }

    #[test]
    fn rec_3_fail_policy_and_pipelines_do_not_shrink() {
        let mut log = RestartLog::default();
        let now = Instant::now();
        assert!(matches!(
            decide(
                &RecoveryPolicy::default(),
                &mut log,
                4,
                (&[0], false, false),
                true,
                now
            ),
            Decision::Fail(_)
        ));
        assert!(matches!(
            decide(
                &RecoveryPolicy::shrink(),
                &mut log,
                4,
                (&[0], false, false),
                false,
                now
            ),
            Decision::Fail(_)
        ));
    }

    #[test]
    fn rec_4_a_message_fault_with_nobody_lost_is_retried_within_the_limit() {
        let policy = RecoveryPolicy::shrink().max_restarts(1, Duration::from_secs(10));
        let mut log = RestartLog::default();
        let now = Instant::now();
        assert_eq!(
            decide(&policy, &mut log, 3, (&[], true, false), true, now),
            Decision::Retry
        );
        assert_eq!(
            decide(&policy, &mut log, 3, (&[], true, false), true, now),
            Decision::TooMany { count: 2 }
        );
        // Not without a recovering policy, nor when nothing says a message was lost.
        let mut log = RestartLog::default();
        assert!(matches!(
            decide(
                &RecoveryPolicy::default(),
                &mut log,
                3,
                (&[], true, false),
                true,
                now
            ),
            Decision::Fail(_)
        ));
        assert!(matches!(
            decide(&policy, &mut log, 3, (&[], false, false), true, now),
            Decision::Fail(_)
        ));
    }

    #[test]
    fn rec_5_roll_back_takes_what_shrinking_may_not() {
        let now = Instant::now();
        let mut log = RestartLog::default();
        // Roll back alone keeps the size.
        assert_eq!(
            decide(
                &RecoveryPolicy::roll_back(),
                &mut log,
                2,
                (&[1], false, false),
                true,
                now
            ),
            Decision::RollBack
        );
        // Shrink first; below the floor, roll back.
        let policy = RecoveryPolicy::shrink().min_replicas(2).or_roll_back();
        assert!(matches!(
            decide(&policy, &mut log, 3, (&[1], false, false), true, now),
            Decision::Shrink { .. }
        ));
        assert_eq!(
            decide(
                &policy,
                &mut RestartLog::default(),
                2,
                (&[0], false, false),
                true,
                now
            ),
            Decision::RollBack
        );
        // Nothing lost and no message fault (a non-finite loss, a data error): no rollback.
        assert!(matches!(
            decide(&policy, &mut log, 2, (&[], false, false), true, now),
            Decision::Fail(_)
        ));
    }

    #[test]
    fn rec_6_a_pipeline_stage_with_a_twin_is_replaced_else_rolled_back_or_failed() {
        let now = Instant::now();
        let mut log = RestartLog::default();
        let shrink = RecoveryPolicy::shrink();
        assert_eq!(
            decide(&shrink, &mut log, 4, (&[1], false, true), false, now),
            Decision::ReplaceFromTwins
        );
        assert!(matches!(
            decide(&shrink, &mut log, 4, (&[1], false, false), false, now),
            Decision::Fail(_)
        ));
        assert_eq!(
            decide(
                &shrink.or_roll_back(),
                &mut log,
                2,
                (&[1], false, false),
                false,
                now
            ),
            Decision::RollBack
        );
        assert!(matches!(
            decide(
                &RecoveryPolicy::default(),
                &mut log,
                4,
                (&[1], false, true),
                false,
                now
            ),
            Decision::Fail(_)
        ));
    }
}
