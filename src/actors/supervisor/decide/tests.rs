//! Property tests of the Supervisor's pure decisions.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::actors::spawner::{Rejoin, StateKeeping};
use crate::mesh::Rank;
use crate::recovery::OnReplicaLoss;

fn boundary() -> impl Strategy<Value = Boundary> {
    (
        (
            0u64..12,
            0u64..12,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        ),
        (proptest::option::of(0u32..6), any::<bool>()),
        (
            any::<bool>(),
            proptest::option::of(0u64..4),
            any::<bool>(),
            proptest::option::of(0u64..12),
        ),
    )
        .prop_map(
            |(
                (step, steps, paused, stop_requested, pending_losses),
                (scale_target, below_minimum),
                (configured, every, requested, last),
            )| Boundary {
                step,
                steps,
                paused,
                stop_requested,
                pending_losses,
                scale_target,
                resized: false,
                below_minimum,
                checkpoint: CheckpointFacts {
                    configured,
                    every,
                    requested,
                    last,
                    taken: false,
                },
            },
        )
}

/// Carry out `at_boundary`'s answers on a model of the Supervisor (each action has the
/// effect the actor gives it; a resize keeps the job below its minimum when it was) until a
/// final answer; the actions in order.
fn walk(mut b: Boundary) -> Vec<AtBoundary> {
    let mut actions = Vec::new();
    for _ in 0..16 {
        let a = at_boundary(&b);
        actions.push(a);
        match a {
            AtBoundary::Hold
            | AtBoundary::HoldBelowMinimum
            | AtBoundary::Finish
            | AtBoundary::Run => return actions,
            AtBoundary::RecoverLosses => b.pending_losses = false,
            AtBoundary::RefuseResize(_) => b.scale_target = None,
            AtBoundary::Resize(_) => {
                b.scale_target = None;
                b.resized = true;
            }
            AtBoundary::Checkpoint => {
                b.checkpoint.taken = true;
                b.checkpoint.requested = false;
            }
        }
    }
    panic!("no final answer after 16 actions: {actions:?}");
}

proptest! {
    /// Step boundaries: a held pause first, then losses, a resize (never when the job ends),
    /// a hold below the minimum only after a resize, at most one checkpoint, and the walk
    /// ends in one final answer; a job ending or stopping never runs the step.
    #[test]
    fn boundaries_follow_the_documented_order(b in boundary()) {
        let actions = walk(b);
        let last = *actions.last().unwrap();
        let ending = b.stop_requested || b.step >= b.steps;
        if b.paused {
            prop_assert_eq!(&actions, &vec![AtBoundary::Hold]);
            return Ok(());
        }
        let rank = |a: &AtBoundary| match a {
            AtBoundary::Hold => 0,
            AtBoundary::RecoverLosses => 1,
            AtBoundary::RefuseResize(_) | AtBoundary::Resize(_) => 2,
            AtBoundary::HoldBelowMinimum => 3,
            AtBoundary::Checkpoint => 4,
            AtBoundary::Finish | AtBoundary::Run => 5,
        };
        prop_assert!(actions.windows(2).all(|w| rank(&w[0]) < rank(&w[1])), "{:?}", actions);
        prop_assert_eq!(actions.contains(&AtBoundary::RecoverLosses), b.pending_losses);
        if let Some(n) = b.scale_target {
            let expected = if ending { AtBoundary::RefuseResize(n) } else { AtBoundary::Resize(n) };
            prop_assert!(actions.contains(&expected));
        }
        prop_assert_eq!(
            last == AtBoundary::HoldBelowMinimum,
            b.scale_target.is_some() && !ending && b.below_minimum
        );
        if last != AtBoundary::HoldBelowMinimum {
            prop_assert_eq!(last, if ending { AtBoundary::Finish } else { AtBoundary::Run });
            // CKW: every n steps, on request, and at the end of a job with checkpoints;
            // never twice for one boundary.
            let c = b.checkpoint;
            let due = (c.requested
                || c.every.is_some_and(|n| n > 0 && b.step > 0 && b.step.is_multiple_of(n))
                || (c.configured && ending))
                && c.last != Some(b.step);
            prop_assert_eq!(actions.contains(&AtBoundary::Checkpoint), due);
        }
    }

    /// REC-1..7 on top of `recovery::decide`: survivors never include a lost rank; a step
    /// applied by some survivors and not others is caught up from one that applied it (its
    /// learning-rate schedule with it, LR-2); twins are survivors of the same stage index,
    /// and no replacement happens once a survivor applied the step.
    #[test]
    fn failures_never_keep_a_lost_rank_nor_apply_a_step_twice(
        (dp, pp) in (1usize..5, 1usize..4),
        lost_mask in any::<u16>(),
        done_mask in any::<u16>(),
        message_fault in any::<bool>(),
        shrink in any::<bool>(),
        roll_back in any::<bool>(),
        min in 1u32..4,
        replicated_state in any::<bool>(),
    ) {
        let world = dp * pp;
        let replicas_only = pp == 1;
        // Rank order: dp fastest, then pp (tp = 1).
        let stage_of: Vec<u32> = (0..world).map(|r| (r / dp) as u32).collect();
        let lost: Vec<usize> = (0..world).filter(|r| lost_mask & (1 << r) != 0).collect();
        let finished: Vec<bool> = (0..world).map(|r| done_mask & (1 << r) != 0).collect();
        let mut policy = RecoveryPolicy::default()
            .min_replicas(min)
            .max_restarts(100, Duration::from_secs(60));
        if shrink {
            policy.on_replica_loss = OnReplicaLoss::Shrink;
        }
        policy.roll_back = roll_back;
        let keeping = StateKeeping {
            sharded: !replicated_state,
            ..StateKeeping::default()
        };
        let caps = if replicas_only {
            Capabilities::data_parallel(keeping, Rejoin::Regroup)
        } else {
            Capabilities::pipeline(keeping, None, 2)
        };
        let f = Failure {
            stage_of: &stage_of,
            lost: &lost,
            message_fault,
            caps,
            finished: &finished,
        };
        let d = on_failure(&policy, &mut RestartLog::default(), Instant::now(), &f);
        // SV-5: a lost ZeRO rank is never dropped nor copied from a twin: roll back or fail.
        if !replicated_state && !lost.is_empty() {
            prop_assert!(
                matches!(d, OnFailure::RollBack | OnFailure::Fail(_) | OnFailure::TooMany { .. }),
                "{:?}",
                d
            );
            prop_assert_eq!(matches!(d, OnFailure::RollBack), roll_back);
        }
        if !shrink && !roll_back {
            prop_assert!(matches!(d, OnFailure::Fail(_)), "{:?}", d);
        }
        match d {
            OnFailure::Regroup { survivors, catch_up, completed } => {
                prop_assert!(replicas_only);
                prop_assert!(survivors.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(survivors.iter().all(|s| !lost.contains(s)));
                prop_assert_eq!(survivors.len(), world - lost.len());
                let done: Vec<bool> = survivors.iter().map(|&r| finished[r]).collect();
                prop_assert_eq!(completed, done.iter().any(|d| *d));
                let mixed = completed && !done.iter().all(|d| *d);
                prop_assert_eq!(catch_up.is_some(), mixed);
                if let Some(c) = catch_up {
                    prop_assert!(done[c.source]);
                    prop_assert!(c.behind.iter().all(|&r| !done[r]));
                    prop_assert_eq!(c.behind.len() + done.iter().filter(|d| **d).count(), done.len());
                }
            }
            OnFailure::ReplaceFromTwins { twins } => {
                prop_assert!(!replicas_only && !lost.is_empty());
                prop_assert_eq!(twins.iter().map(|(r, _)| *r).collect::<Vec<_>>(), lost.clone());
                for (r, t) in &twins {
                    prop_assert!(!lost.contains(t));
                    prop_assert_eq!(stage_of[*r], stage_of[*t]);
                }
                prop_assert!((0..world).all(|r| lost.contains(&r) || !finished[r]));
            }
            OnFailure::RollBack => prop_assert!(roll_back),
            OnFailure::Diverged(Divergence::Stages) => {
                prop_assert!(!replicas_only && !roll_back);
                prop_assert!((0..world).any(|r| !lost.contains(&r) && finished[r]));
            }
            OnFailure::Fail(_) | OnFailure::TooMany { .. } => {}
        }
    }

    /// `lost_ranks` is sorted, without repeats, and names the ranks given, the stages that
    /// failed and every unresponsive rank.
    #[test]
    fn lost_ranks_are_sorted_unique_and_named(
        world in 1usize..8,
        named in proptest::collection::vec(0usize..8, 0..4),
        failed in proptest::collection::vec(0usize..8, 0..3),
        unresponsive in proptest::collection::vec(0u32..8, 0..3),
    ) {
        let stages: Vec<StageId> = (0..world as u32).map(|r| StageId { replica: r, stage: 0, tp: 0 }).collect();
        let mut failures: Vec<(Option<usize>, Error)> = named
            .iter()
            .filter(|&&r| r < world)
            .map(|&r| (Some(r), Error::Runtime("lost".into())))
            .collect();
        for &r in &failed {
            failures.push((None, Error::StageLost {
                device: crate::error::DeviceId(r as u32),
                stage: StageId { replica: r as u32, stage: 0, tp: 0 },
                reason: "gone".into(),
            }));
        }
        failures.push((None, Error::RanksUnresponsive {
            op: crate::comm::CollectiveKind::AllReduce,
            seq: 0,
            generation: crate::mesh::Generation(0),
            waited: Duration::from_secs(1),
            ranks: unresponsive.iter().map(|&r| crate::error::RankHealth {
                rank: Rank(r),
                device: crate::error::DeviceId(r),
                health: crate::error::Health::Dead { reason: "gone".into() },
            }).collect(),
        }));
        let lost = lost_ranks(&failures, &stages, true);
        prop_assert!(lost.windows(2).all(|w| w[0] < w[1]));
        let mut expected: Vec<usize> = named.iter().copied().filter(|&r| r < world)
            .chain(failed.iter().copied().filter(|&r| r < world))
            .chain(unresponsive.iter().map(|&r| r as usize))
            .collect();
        expected.sort_unstable();
        expected.dedup();
        prop_assert_eq!(lost, expected);
    }

    /// ELASTIC-1/3/4: a request is taken only inside the elastic range, or below the minimum
    /// as a growth toward it; a taken one replaces (and refuses) the pending one; the wait
    /// below the minimum ends when a resize is pending.
    #[test]
    fn resize_requests_are_admitted_inside_the_range_or_toward_the_minimum(
        requested in 0u32..12, min in 0u32..6, span in 0u32..6, dp in 1u32..10,
        waiting in any::<bool>(), pending in proptest::option::of(1u32..10),
    ) {
        let max = min.max(1) + span;
        let r = ResizeRequest { requested, elastic: (min, max), dp, waiting, pending };
        let (admission, resume) = admit_request(&r);
        let in_range = requested >= min.max(1) && requested <= max;
        let toward_min = waiting && requested > dp && requested <= max;
        match &admission {
            Admission::Accepted { replaces } => {
                prop_assert!(in_range || toward_min);
                prop_assert_eq!(replaces.as_ref().map(|(n, _)| *n), pending);
            }
            Admission::Refused(reason) => {
                prop_assert!(!in_range && !toward_min);
                prop_assert!(reason.contains("outside the elastic range"));
            }
        }
        let accepted = matches!(admission, Admission::Accepted { .. });
        prop_assert_eq!(resume, waiting && (accepted || pending.is_some()));
    }

    /// A resize at a boundary: refused (mesh unchanged) where the strategy gives a reason
    /// (`fixed_size`: a mesh across processes, local updates over blocks), for the same
    /// size, and for growth without a way to grow (a scheduler does not matter, LR-2);
    /// otherwise a shrink to `n` or a growth from the current size to `n`, for a
    /// data-parallel group and a dp × pp × tp mesh alike (ELASTIC-6).
    #[test]
    fn resizes_are_planned_only_where_they_can_be_carried_out(
        n in 0usize..10, from in 1usize..10, replicas_only in any::<bool>(),
        can_grow in any::<bool>(), fixed in any::<bool>(), global in 1usize..64,
        micro in 1u32..4,
    ) {
        let caps = Capabilities {
            can_grow,
            fixed_size: fixed.then_some("the strategy's reason"),
            micro_batches: (!replicas_only).then_some(micro),
            rejoin: if replicas_only { Rejoin::Regroup } else { Rejoin::Rewire },
            ..Capabilities::data_parallel(StateKeeping::default(), Rejoin::Regroup)
        };
        // A mesh's micro-batches weigh 1 / (m · replicas): only sizes that cut the batch.
        let uneven = !replicas_only && n > 0 && global % (n * micro as usize) != 0;
        match plan_resize(n, from, global, &caps) {
            Ok(ResizePlan::Shrink { to }) => {
                prop_assert!(!fixed && !uneven && to == n && n < from)
            }
            Ok(ResizePlan::Grow { from: f, to }) => {
                prop_assert!(!fixed && !uneven && f == from && to == n && n > from);
                prop_assert!(can_grow);
            }
            Err(why) => {
                prop_assert!(fixed || uneven || n == from || (n > from && !can_grow));
                if fixed {
                    prop_assert_eq!(why, "the strategy's reason");
                }
            }
        }
    }

    /// ELASTIC-4: a job grows back onto waiting slots up to its maximum, never beyond.
    #[test]
    fn refills_stay_within_the_maximum(dp in 1u32..10, max in 1u32..10, waiting in 0usize..10) {
        match refill_target(dp, max, waiting) {
            Some(n) => {
                prop_assert!(n > dp && n <= max);
                prop_assert_eq!((n - dp) as usize, waiting.min((max - dp) as usize));
            }
            None => prop_assert!(waiting == 0 || dp >= max),
        }
    }
}

#[test]
fn a_failed_checkpoint_is_not_retried_at_the_same_boundary() {
    let b = Boundary {
        step: 4,
        steps: 10,
        checkpoint: CheckpointFacts {
            configured: true,
            every: Some(2),
            ..CheckpointFacts::default()
        },
        ..Boundary::default()
    };
    assert_eq!(at_boundary(&b), AtBoundary::Checkpoint);
    let mut after = b;
    after.checkpoint.taken = true;
    assert_eq!(at_boundary(&after), AtBoundary::Run);
}

#[test]
fn rec_6_twins_are_the_first_survivor_of_the_same_stage() {
    // dp = 3, pp = 2: ranks 0..3 hold stage 0, ranks 3..6 stage 1.
    let stage_of = [0, 0, 0, 1, 1, 1];
    assert_eq!(
        twins_of(&stage_of, &[0, 4], true),
        Some(vec![(0, 1), (4, 3)])
    );
    assert_eq!(twins_of(&stage_of, &[3, 4, 5], true), None);
    // Stages without twins: data-parallel replicas, or a pipeline whose state is sharded.
    assert_eq!(twins_of(&stage_of, &[0], false), None);
}
