//! The Supervisor's decisions, as pure functions of plain data (counts, ranks, policies, and
//! what the job's strategy allows: its spawner's [`Capabilities`]) that return what to do;
//! the actor carries it out. No actor, no tokio, no I/O: each is property-tested on its own
//! (`decide/tests.rs`).
//!
//! - [`at_boundary`]: what comes next at a step boundary (a held pause, devices lost
//!   between steps, a resize, a hold below the elastic minimum, a checkpoint, the end, or
//!   the step).
//! - [`lost_ranks`], [`twins_of`] and [`on_failure`]: what a failure means (which ranks it
//!   lost, and [`recovery::decide`](crate::recovery::decide) completed with the rules about
//!   steps applied by some ranks and not others: REC-1..7).
//! - [`admit_request`], [`plan_resize`], [`refill_target`]: whether a resize is admitted,
//!   when it is asked for and when it is carried out (ELASTIC-1..5).

use std::time::Instant;

use crate::actors::spawner::Capabilities;
use crate::comm::CommError;
use crate::error::{Error, StageId};
use crate::recovery::{Decision, RecoveryPolicy, RestartLog, decide};

#[cfg(test)]
mod tests;

/// What the Supervisor knows about checkpoints at a step boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CheckpointFacts {
    /// The job has somewhere to write checkpoints.
    pub(crate) configured: bool,
    /// Every this many steps (none: only on request and at the end).
    pub(crate) every: Option<u64>,
    /// `checkpoint_now()` was asked since the last boundary.
    pub(crate) requested: bool,
    /// The step boundary of the last checkpoint taken or restored.
    pub(crate) last: Option<u64>,
    /// A checkpoint was already attempted at this boundary (written or failed).
    pub(crate) taken: bool,
}

/// What the Supervisor knows at the boundary before `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Boundary {
    /// The step about to run.
    pub(crate) step: u64,
    /// Steps the job runs in all.
    pub(crate) steps: u64,
    /// `pause()` holds the steps.
    pub(crate) paused: bool,
    /// `stop()` was asked.
    pub(crate) stop_requested: bool,
    /// Devices were found lost between steps.
    pub(crate) pending_losses: bool,
    /// A resize asked by `scale_to` and not carried out yet.
    pub(crate) scale_target: Option<u32>,
    /// A resize was carried out (or refused as invalid) at this boundary.
    pub(crate) resized: bool,
    /// A data-parallel job with fewer replicas than its elastic minimum.
    pub(crate) below_minimum: bool,
    /// Checkpoints.
    pub(crate) checkpoint: CheckpointFacts,
}

/// What to do next at a step boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtBoundary {
    /// Paused: keep the step for `Resume` (or `Stop`).
    Hold,
    /// Recover the devices lost between steps (their ranks are current).
    RecoverLosses,
    /// Refuse the pending resize: the job is ending.
    RefuseResize(u32),
    /// Resize the data-parallel group to this many replicas (ELASTIC-1).
    Resize(u32),
    /// A resize left the job below its elastic minimum: wait for devices, holding the step
    /// (ELASTIC-3).
    HoldBelowMinimum,
    /// Write a checkpoint of the state after `step` steps.
    Checkpoint,
    /// End the job (stop asked, or every step done).
    Finish,
    /// Run the step.
    Run,
}

/// The order between two steps (the runtime semantics' "step boundaries"): a held pause,
/// devices lost between steps, a pending resize (refused if the job is ending), a hold below
/// the minimum after a resize, a due checkpoint, then stop or the next step. The actor calls
/// it again after carrying out each answer, until `Hold`, `HoldBelowMinimum`, `Finish` or
/// `Run`.
pub(crate) fn at_boundary(b: &Boundary) -> AtBoundary {
    if b.paused {
        return AtBoundary::Hold;
    }
    if b.pending_losses {
        return AtBoundary::RecoverLosses;
    }
    let ending = b.stop_requested || b.step >= b.steps;
    if let Some(n) = b.scale_target {
        return if ending {
            AtBoundary::RefuseResize(n)
        } else {
            AtBoundary::Resize(n)
        };
    }
    if b.resized && b.below_minimum {
        return AtBoundary::HoldBelowMinimum;
    }
    if !b.checkpoint.taken && checkpoint_due(&b.checkpoint, b.step, ending) {
        return AtBoundary::Checkpoint;
    }
    if ending {
        AtBoundary::Finish
    } else {
        AtBoundary::Run
    }
}

/// Whether a checkpoint of the state after `step` steps is due: every n steps, on request,
/// and when the job ends (the builder's and the CLI's promise, with or without an interval);
/// never twice for the same boundary.
pub(crate) fn checkpoint_due(c: &CheckpointFacts, step: u64, ending: bool) -> bool {
    let due = c.requested
        || c.every
            .is_some_and(|n| n > 0 && step > 0 && step.is_multiple_of(n))
        || (c.configured && ending);
    due && c.last != Some(step)
}

/// The ranks a step's failures name as lost: a stage that failed on its device or whose
/// actor is gone, the peer of a broken link where the ranks are one data-parallel group
/// (`peers_are_ranks`: [`Rejoin::regroups`]; a peer is then a rank), every rank a collective
/// time-out found unresponsive. Each failure is an error with the rank it was found on, if
/// any; `stages` are the current ranks' stages. Sorted, without repeats.
///
/// [`Rejoin::regroups`]: crate::actors::spawner::Rejoin::regroups
pub(crate) fn lost_ranks(
    failures: &[(Option<usize>, Error)],
    stages: &[StageId],
    peers_are_ranks: bool,
) -> Vec<usize> {
    let mut lost: Vec<usize> = failures
        .iter()
        .filter_map(|(rank, e)| {
            if rank.is_some() {
                return *rank;
            }
            match e {
                Error::StageFailed { stage, .. } | Error::StageLost { stage, .. } => {
                    stages.iter().position(|id| id == stage)
                }
                // Across processes: the link to a peer broke (its process died or was cut
                // off); in one data-parallel group a rank is its stage's index.
                Error::Comm(CommError::Link { peer, .. }) if peers_are_ranks => {
                    Some(peer.index()).filter(|&r| r < stages.len())
                }
                _ => None,
            }
        })
        .chain(failures.iter().flat_map(|(_, e)| match e {
            // Stuck, slow or dead: a rank that did not arrive in time is evicted.
            Error::RanksUnresponsive { ranks, .. } => {
                ranks.iter().map(|r| r.rank.index()).collect()
            }
            _ => Vec::new(),
        }))
        .collect();
    lost.sort_unstable();
    lost.dedup();
    lost
}

/// REC-6: for every lost rank of a job whose stages have twins ([`Capabilities::twins`]), a
/// surviving rank with the same stage index (its twin: the first such rank), or `None` if
/// some lost rank has none, nothing is lost, or the stages have no twins. `stage_of` is each
/// current rank's stage index.
pub(crate) fn twins_of(
    stage_of: &[u32],
    lost: &[usize],
    twins: bool,
) -> Option<Vec<(usize, usize)>> {
    if !twins || lost.is_empty() {
        return None;
    }
    lost.iter()
        .map(|&r| {
            let stage = *stage_of.get(r)?;
            let twin = stage_of
                .iter()
                .enumerate()
                .position(|(t, s)| *s == stage && !lost.contains(&t))?;
            Some((r, twin))
        })
        .collect()
}

/// What the Supervisor knows about a failure.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Failure<'a> {
    /// Each current rank's place in the model: its stage index, with its tensor-parallel
    /// rank (0 everywhere in a data-parallel job); equal places are twins.
    pub(crate) stage_of: &'a [u32],
    /// The ranks lost ([`lost_ranks`], with those whose device does not answer).
    pub(crate) lost: &'a [usize],
    /// A collective message was lost or spoiled (REC-4).
    pub(crate) message_fault: bool,
    /// What the job's strategy allows: whether its ranks regroup (shrink, retry) or are
    /// rewired, whether a lost rank can be dropped, whether it has twins (REC-6, SV-5).
    pub(crate) caps: Capabilities,
    /// Per current rank, whether it finished the failed step (and applied its update).
    pub(crate) finished: &'a [bool],
}

/// Why a step applied by some ranks and not by others ends the job (the policy does not
/// roll back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Divergence {
    /// Pipeline stages: a stage updates once its own all-reduce is done (REC-6).
    Stages,
}

/// REC-7: the survivors that did not finish the step take the state of the first that did
/// (ranks in the new order, after the regroup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CatchUp {
    /// The first survivor that finished.
    pub(crate) source: usize,
    /// The survivors that did not.
    pub(crate) behind: Vec<usize>,
}

/// What a failure means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OnFailure {
    /// End the job with the failure's own error (REC-3), for this reason.
    Fail(String),
    /// End the job: too many recoveries within the window (REC-2).
    TooMany {
        /// Recoveries counted in the window.
        count: u32,
    },
    /// End the job: the step was applied by some ranks and not by others.
    Diverged(Divergence),
    /// Replace the lost ranks and restore everyone from the newest checkpoint (REC-5).
    RollBack,
    /// Replace each lost pipeline stage from its twin `(lost, twin)` and redo the step
    /// (REC-6).
    ReplaceFromTwins {
        /// Lost rank and the surviving rank it copies.
        twins: Vec<(usize, usize)>,
    },
    /// Regroup these ranks (in rank order) under the next generation (REC-1, REC-4).
    Regroup {
        /// The members of the new group, by their current rank.
        survivors: Vec<usize>,
        /// REC-7: who takes whose state after the regroup.
        catch_up: Option<CatchUp>,
        /// Some survivor finished the step: it counts as done (not redone).
        completed: bool,
    },
}

impl OnFailure {
    /// Whether the lost ranks are given up (published as lost and killed): every outcome
    /// that does not end the job at once with the failure's error.
    pub(crate) fn drops_lost(&self) -> bool {
        !matches!(self, OnFailure::Fail(_) | OnFailure::TooMany { .. })
    }
}

/// What `failure` means under `policy` at `now` (REC-1..7): [`recovery::decide`]
/// (which counts the recovery in `log`), then a step applied by some survivors and not
/// others is caught up (REC-7) or, where that cannot be done, rolled back (with
/// `roll_back`) or the end of the job.
///
/// [`recovery::decide`]: crate::recovery::decide
pub(crate) fn on_failure(
    policy: &RecoveryPolicy,
    log: &mut RestartLog,
    now: Instant,
    f: &Failure<'_>,
) -> OnFailure {
    let world = f.stage_of.len();
    let caps = f.caps;
    // SV-5: a lost rank whose state is a shard (ZeRO) has no twin and cannot be dropped (the
    // capabilities say neither); only a checkpoint brings its state back.
    if !caps.replicated_state && !f.lost.is_empty() && !policy.roll_back {
        return OnFailure::Fail(
            "a lost rank held the only copy of its optimizer shard (ZeRO): only rolling back \
             to a checkpoint recovers it, and the policy does not roll back"
                .into(),
        );
    }
    let regroups = caps.rejoin.regroups();
    // A group whose lost ranks cannot be dropped does not shrink: it rolls back.
    let no_shrink = RecoveryPolicy {
        on_replica_loss: crate::recovery::OnReplicaLoss::Fail,
        ..*policy
    };
    let keep_all = regroups && !caps.droppable_replicas && !f.lost.is_empty();
    let policy = if keep_all { &no_shrink } else { policy };
    let twins = twins_of(f.stage_of, f.lost, caps.twins);
    let decision = decide(
        policy,
        log,
        world,
        (f.lost, f.message_fault, twins.is_some()),
        regroups,
        now,
    );
    let finished = |r: usize| f.finished.get(r).copied().unwrap_or(false);
    let survivors = match decision {
        Decision::Fail(reason) => return OnFailure::Fail(reason),
        Decision::TooMany { count } => return OnFailure::TooMany { count },
        Decision::RollBack => return OnFailure::RollBack,
        Decision::ReplaceFromTwins => {
            // A stage that applied the step cannot redo it: only a checkpoint makes the
            // stages agree again.
            let applied = (0..world).any(|r| finished(r) && !f.lost.contains(&r));
            return match (applied, policy.roll_back) {
                (false, _) => OnFailure::ReplaceFromTwins {
                    twins: twins.unwrap_or_default(),
                },
                (true, true) => OnFailure::RollBack,
                (true, false) => OnFailure::Diverged(Divergence::Stages),
            };
        }
        Decision::Shrink { survivors } => survivors,
        // REC-4: everyone is alive; the same members regroup.
        Decision::Retry => (0..world).collect(),
    };
    // REC-1: a step is redone only where nothing of it was applied. A survivor that finished
    // the step's last collective holds its full result and applied it; one still waiting in
    // it applied nothing. Both happen in one step (REC-7).
    let done: Vec<bool> = survivors.iter().map(|&r| finished(r)).collect();
    let completed = done.iter().any(|d| *d);
    let mixed = completed && !done.iter().all(|d| *d);
    // The behind survivors copy the source's parameters, optimizer state and learning-rate
    // schedule (LR-2).
    let catch_up = mixed.then(|| CatchUp {
        source: done.iter().position(|d| *d).unwrap_or(0),
        behind: (0..done.len()).filter(|&r| !done[r]).collect(),
    });
    OnFailure::Regroup {
        survivors,
        catch_up,
        completed,
    }
}

/// A `scale_to(n)` request as it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResizeRequest {
    /// The size asked for.
    pub(crate) requested: u32,
    /// The elastic range `(min, max)`.
    pub(crate) elastic: (u32, u32),
    /// The data-parallel size now.
    pub(crate) dp: u32,
    /// The job waits below its elastic minimum (ELASTIC-3).
    pub(crate) waiting: bool,
    /// A resize asked before and not carried out yet.
    pub(crate) pending: Option<u32>,
}

/// Whether a `scale_to` request is taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Refused at once, for this reason.
    Refused(String),
    /// Taken for the next boundary, replacing this earlier request (refused with the
    /// reason given).
    Accepted {
        /// The earlier request it replaces, and why that one is refused.
        replaces: Option<(u32, String)>,
    },
}

/// Whether `r` is admitted (inside the elastic range; below the minimum, any growth toward
/// it is welcome: ELASTIC-3, ELASTIC-4), and whether the wait below the minimum ends (a
/// resize is pending while the job waits).
pub(crate) fn admit_request(r: &ResizeRequest) -> (Admission, bool) {
    let (min, max) = r.elastic;
    let n = r.requested;
    let toward_min = r.waiting && n > r.dp;
    let admission = if (n < min.max(1) && !toward_min) || n > max {
        Admission::Refused(format!("outside the elastic range {}..={max}", min.max(1)))
    } else {
        Admission::Accepted {
            replaces: r
                .pending
                .map(|old| (old, format!("replaced by a later request for {n}"))),
        }
    };
    let pending = r.pending.is_some() || matches!(admission, Admission::Accepted { .. });
    (admission, r.waiting && pending)
}

/// A resize to carry out at a boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResizePlan {
    /// The ranks from `to` on leave.
    Shrink {
        /// The new size.
        to: usize,
    },
    /// Ranks `from..to` join, taking rank 0's state (ELASTIC-1), until the first that
    /// cannot (ELASTIC-5).
    Grow {
        /// The size now.
        from: usize,
        /// The size asked.
        to: usize,
    },
}

/// What a resize from `from` to `n` replicas does, or why it is refused (the mesh is left
/// as it was): a job resizes unless its strategy says why not
/// ([`Capabilities::fixed_size`]: a data-parallel group regroups, ELASTIC-1; a dp × pp × tp
/// mesh is rewired along dp, ELASTIC-6), to another size; a job grows only if it can start
/// replicas ([`Capabilities::can_grow`]); a joining replica takes rank 0's learning-rate
/// schedule with its state (LR-2); a mesh whose micro-batches each weigh
/// 1 / (micro-batches × replicas) takes only sizes that cut the global batch `global` evenly
/// ([`Capabilities::micro_batches`], JOB-1).
pub(crate) fn plan_resize(
    n: usize,
    from: usize,
    global: usize,
    caps: &Capabilities,
) -> Result<ResizePlan, String> {
    if let Some(why) = caps.fixed_size {
        return Err(why.into());
    }
    if let Some(m) = caps.micro_batches {
        let unit = n * m as usize;
        if unit > 0 && !global.is_multiple_of(unit) {
            return Err(format!(
                "the global batch of {global} does not divide into {n} replica(s) × {m} \
                 micro-batch(es): choose a number of replicas that does"
            ));
        }
    }
    if n == from {
        return Err(format!("the job already has {n} replicas"));
    }
    if n < from {
        return Ok(ResizePlan::Shrink { to: n });
    }
    if !caps.can_grow {
        return Err("this job cannot grow".into());
    }
    Ok(ResizePlan::Grow { from, to: n })
}

/// ELASTIC-4: the size a job of `dp` replicas grows back to onto `waiting` slots waiting
/// to join it, up to its maximum; `None` when there is nothing to grow onto or no room.
pub(crate) fn refill_target(dp: u32, max: u32, waiting: usize) -> Option<u32> {
    let room = max.saturating_sub(dp) as usize;
    let k = waiting.min(room);
    (k > 0).then(|| dp + k as u32)
}

/// ELASTIC-3: whether a job waits for devices rather than train on: a resizable
/// data-parallel group (`resizable`: [`Rejoin::regroups`]) below its elastic minimum, not
/// already paused.
///
/// [`Rejoin::regroups`]: crate::actors::spawner::Rejoin::regroups
pub(crate) fn must_wait_for_devices(resizable: bool, dp: u32, min: u32, paused: bool) -> bool {
    resizable && dp < min && !paused
}
