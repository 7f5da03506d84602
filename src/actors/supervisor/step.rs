//! A step, run as a task of its own that reports back (SV-3): the Supervisor gives every
//! replica its sample ids, spawns a task that calls every stage's `Step` and waits for the
//! replies (bounded by the step time-out), and goes back to its mailbox, so `status()`,
//! `pause()` and `stop()` are answered while the step runs. The task ends by sending
//! [`SupervisorMsg::StepFinished`]; an outcome of another attempt than the running one is
//! stale and ignored (SV-4). A finished step is published (`StepDone`), a failed one is
//! recovered from (`recover.rs`) or ends the job.
//!
//! - **HB-1** code on a device thread reports its progress (`device::report_progress`: step, phase,
//!   micro-batch); a collective time-out in a data-parallel job is turned into `RanksUnresponsive`,
//!   each missing rank probed and named stuck (answers, progress unchanged for the whole time-out),
//!   progressing, or dead (no answer).

use std::time::{Duration, Instant};

use ractor::{ActorProcessingErr, ActorRef};

use super::SupervisorMsg;
use super::boundary;
use super::calls::{Crew, HEARTBEAT_PROBE, MsgBuilder, call_all_partial};
use super::lifecycle::finish;
use super::recover::{Interrupted, LostRanks, Redo, recover};
use super::state::SupervisorState;
use crate::actors::device::heartbeat;
use crate::actors::stage::{StageMsg, StepReport};
use crate::comm::CommError;
use crate::error::{Error, Health, RankHealth, StageId};
use crate::events::{JobEvent, PipelineStep, ReplicaStep, StageShares, StepDone};
use crate::mesh::{Generation, Layout};
use crate::parallel::pipeline::{TimedInstr, summarize};
use crate::trace::TimeBreakdown;

/// The outcome of one step attempt, sent to the Supervisor by the step's task.
#[derive(Debug)]
pub(crate) struct StepFinished {
    /// Which attempt (the Supervisor counts them): another than the running one is stale.
    pub(super) attempt: u64,
    /// The mesh's generation when the step started.
    pub(super) generation: Generation,
    pub(super) step: u64,
    /// Each replica's sample ids.
    pub(super) shares: Vec<Vec<usize>>,
    /// Each rank's report, for the ranks that finished.
    pub(super) reports: Vec<Option<StepReport>>,
    /// The root cause of a failure (a collective time-out diagnosed: RanksUnresponsive).
    pub(super) failure: Option<Error>,
    pub(super) started: Instant,
    /// From the start to the last reply.
    pub(super) wall: Duration,
    /// This process's minor page faults during the step (`None` where they are not counted).
    pub(super) page_faults: Option<u64>,
}

/// The step running now.
#[derive(Debug)]
pub(crate) struct RunningStep {
    pub(super) attempt: u64,
    pub(super) step: u64,
    /// Aborts the task (when the Supervisor is stopped from outside: SV-1).
    pub(super) task: tokio::task::AbortHandle,
}

/// Start `step` on a task of its own (the boundary said `Run`).
pub(super) fn start<M, I>(state: &mut SupervisorState<M, I>, step: u64)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    // FaultPlan: devices killed at the start of this step (their actors disappear).
    if let Some(h) = state.recovery.faults.clone() {
        for device in h.kills_at(step) {
            if let Some(r) = state.members.devices.iter().position(|(_, d)| *d == device) {
                state.members.stages[r].0.kill();
                state.members.devices[r].0.kill();
            }
        }
    }
    let dp = state.members.layout.dp() as usize;
    let k = state.clock.accumulation as usize;
    let epoch = state.clock.sampler.cursor(step).epoch;
    if state
        .clock
        .epoch_order
        .as_ref()
        .is_none_or(|(e, _)| *e != epoch)
    {
        state.clock.epoch_order = Some((epoch, state.clock.sampler.epoch_order(epoch)));
    }
    let (_, order) = state.clock.epoch_order.as_ref().expect("set just above");
    let shares = state.clock.sampler.split_in(order, step, dp);
    // Every stage of a replica's pipeline gets that replica's share.
    let replica_of: Vec<usize> = state
        .members
        .stages
        .iter()
        .map(|(_, id)| id.replica as usize)
        .collect();
    state.clock.attempts += 1;
    let attempt = state.clock.attempts;
    let generation = state.members.generation;
    let (crew, timeout, peers_are_ranks, me) = (
        state.crew(),
        state.clock.step_timeout,
        state.members.caps.rejoin.regroups(),
        state.me(),
    );
    let task = tokio::spawn(async move {
        let started = Instant::now();
        let faults_before = crate::parallel::memory::minor_page_faults();
        let mut unfinished = Unfinished {
            me: Some(me.clone()),
            attempt,
            generation,
            step,
            started,
        };
        let global_samples: usize = shares.iter().map(Vec::len).sum();
        let build = |r: usize| {
            let share = &shares[replica_of[r]];
            // k micro-batches whose sizes differ by at most one.
            let micro_batches: Vec<Vec<usize>> = (0..k)
                .map(|m| share[crate::comm::chunk_range(share.len(), k, m)].to_vec())
                .filter(|mb| !mb.is_empty())
                .collect();
            Some(Box::new(move |reply| StageMsg::Step {
                step,
                micro_batches,
                global_samples,
                reply,
            }) as MsgBuilder<M, StepReport>)
        };
        let (reports, failure) = call_all_partial(&crew, build, timeout, Some(step)).await;
        let wall = started.elapsed();
        let page_faults = crate::parallel::memory::minor_page_faults_since(faults_before);
        let failure = match failure {
            Some(e) => Some(diagnose(&crew, e, peers_are_ranks).await),
            None => None,
        };
        unfinished.me = None;
        // A Supervisor gone meanwhile has ended the job: nobody to tell.
        let _ = me.send_message(SupervisorMsg::StepFinished(Box::new(StepFinished {
            attempt,
            generation,
            step,
            shares,
            reports,
            failure,
            started,
            wall,
            page_faults,
        })));
    });
    state.clock.running = Some(RunningStep {
        attempt,
        step,
        task: task.abort_handle(),
    });
}

/// Reports a step's task that ends without an outcome (a panic in it, or an abort at the end
/// of the job) as a failed step, so the Supervisor never waits for a step that cannot end.
struct Unfinished {
    /// `None` once the outcome is sent.
    me: Option<ActorRef<SupervisorMsg>>,
    attempt: u64,
    generation: Generation,
    step: u64,
    started: Instant,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        let Some(me) = self.me.take() else { return };
        let failure = Error::Runtime(format!(
            "the task running step {} ended without an outcome",
            self.step
        ));
        let _ = me.send_message(SupervisorMsg::StepFinished(Box::new(StepFinished {
            attempt: self.attempt,
            generation: self.generation,
            step: self.step,
            shares: Vec::new(),
            reports: Vec::new(),
            failure: Some(failure),
            started: self.started,
            wall: self.started.elapsed(),
            page_faults: None,
        })));
    }
}

/// A collective time-out where the ranks are one data-parallel group (`peers_are_ranks`: a
/// missing rank of the collective is a rank of the job): tell stuck from dead by probing the
/// missing ranks' devices (HB-1). Other failures are returned as they are.
async fn diagnose<M: Send + 'static>(crew: &Crew<M>, e: Error, peers_are_ranks: bool) -> Error {
    let Error::Comm(CommError::Timeout {
        generation,
        seq,
        op,
        missing,
        waited,
    }) = e
    else {
        return e;
    };
    if !peers_are_ranks {
        return Error::Comm(CommError::Timeout {
            generation,
            seq,
            op,
            missing,
            waited,
        });
    }
    let mut ranks = Vec::new();
    for rank in missing {
        let Some((device, id)) = crew.devices.get(rank.index()) else {
            continue;
        };
        let health = match heartbeat(device, *id, HEARTBEAT_PROBE).await {
            Err(e) => Health::Dead {
                reason: e.to_string(),
            },
            Ok(h) => match h.progress {
                Some((progress, since)) if since >= waited => Health::Stuck { progress, since },
                Some((progress, _)) => Health::Progressing { progress },
                None => Health::Stuck {
                    progress: "no progress reported".into(),
                    since: waited,
                },
            },
        };
        ranks.push(RankHealth {
            rank,
            device: *id,
            health,
        });
    }
    Error::RanksUnresponsive {
        op,
        seq,
        generation,
        waited,
        ranks,
    }
}

/// A step's outcome arrived: publish it and go on to the next step, or recover (redo the
/// step, go on, or go back to a checkpoint's step) or end the job. Then the children that
/// ended while the step ran are dealt with.
pub(super) async fn finished<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    done: StepFinished,
) -> Result<(), ActorProcessingErr>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let current = state
        .clock
        .running
        .as_ref()
        .is_some_and(|r| r.attempt == done.attempt && r.step == done.step)
        && done.generation == state.members.generation;
    if !current {
        tracing::debug!(
            step = done.step,
            attempt = done.attempt,
            "ignoring the outcome of a step attempt that is not the running one"
        );
        return Ok(());
    }
    state.clock.running = None;
    state.publish_fired();
    let StepFinished {
        step,
        shares,
        reports,
        failure,
        started,
        wall,
        page_faults,
        ..
    } = done;
    match failure {
        None => {
            let samples: usize = shares.iter().map(Vec::len).sum();
            let reports = reports
                .into_iter()
                .flatten()
                .zip(state.members.stage_ids())
                .collect();
            step_done(
                state,
                step,
                reports,
                samples,
                wall.as_secs_f64(),
                page_faults,
            );
            myself.send_message(SupervisorMsg::RunStep(step + 1))?;
        }
        Some(error) => {
            // Kept for recovery: who finished this step (and applied its update) before the
            // failure ended it.
            state.recovery.interrupted = Some(Interrupted {
                shares,
                done: reports,
                started,
            });
            match recover(state, step, LostRanks::from(error)).await {
                // REC-1: the survivors redo the step, unless it had completed on all of them
                // before the failure ended it.
                Ok(Redo::Step) => myself.send_message(SupervisorMsg::RunStep(step))?,
                Ok(Redo::Nothing) => myself.send_message(SupervisorMsg::RunStep(step + 1))?,
                Ok(Redo::From(from)) => myself.send_message(SupervisorMsg::RunStep(from))?,
                Err(e) => finish(myself, state, Err(e)).await,
            }
        }
    }
    boundary::replay_deferred(myself, state).await;
    Ok(())
}

/// Publish a finished step: its loss, samples, time breakdown and pipeline figures.
pub(super) fn step_done<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    reports: Vec<(StepReport, StageId)>,
    samples: usize,
    wall_s: f64,
    page_faults: Option<u64>,
) {
    let stage_ids: Vec<StageId> = reports.iter().map(|(_, id)| *id).collect();
    let reports: Vec<StepReport> = reports.into_iter().map(|(r, _)| r).collect();
    // The mean over the global batch: each replica's mean weighted by its share.
    let (weighted, counted) = reports
        .iter()
        .filter_map(|r| r.local_loss.map(|l| (l, r.sample_ids.len())))
        .fold((0.0f64, 0usize), |(s, n), (l, k)| {
            (s + f64::from(l) * k as f64, n + k)
        });
    let loss = (weighted / counted.max(1) as f64) as f32;
    let skipped = reports.iter().any(|r| r.learning_rate.is_none());
    let loss_scale = reports.iter().find_map(|r| r.loss_scale);
    if skipped {
        let ranks: Vec<_> = reports
            .iter()
            .filter(|r| r.local_loss.is_some_and(|l| !l.is_finite()))
            .map(|r| r.rank)
            .collect();
        match loss_scale {
            // The loss scaler skipped it (PREC-2): the losses were finite.
            Some((scale, next_scale)) if ranks.is_empty() => {
                state.publish(JobEvent::GradientOverflow {
                    step,
                    scale,
                    next_scale,
                });
            }
            _ => state.publish(JobEvent::NonFiniteLoss {
                step,
                ranks,
                skipped: true,
            }),
        }
    }
    let learning_rate = reports.iter().find_map(|r| r.learning_rate);
    let pipeline = pipeline_step(&stage_ids, &reports, state.members.layout);
    let replicas: Vec<ReplicaStep> = reports
        .into_iter()
        .zip(&stage_ids)
        .map(|(r, id)| ReplicaStep {
            rank: r.rank,
            stage: *id,
            pipeline: r.pipeline,
            breakdown: TimeBreakdown::from_records(&r.trace, wall_s),
            sample_ids: r.sample_ids,
            loss: r.local_loss,
            trace: r.trace,
            held: r.held,
            bytes_sent: r.bytes_sent,
            parameter_server: r.parameter_server,
        })
        .collect();
    observe_stragglers(state, step, &replicas);
    let mut mean = TimeBreakdown::default();
    for r in &replicas {
        mean = mean.plus(r.breakdown);
    }
    let n = replicas.len().max(1) as f64;
    let s = &mut state.clock.summary;
    s.steps += 1;
    s.ranks = u32::try_from(replicas.len()).unwrap_or(u32::MAX);
    let now = state
        .clock
        .control
        .load(std::sync::atomic::Ordering::Relaxed);
    s.control_messages += now.saturating_sub(state.clock.control_mark);
    state.clock.control_mark = now;
    s.samples += samples as u64;
    s.wall_s += wall_s;
    if let Some(faults) = page_faults {
        *s.page_faults.get_or_insert(0) += faults;
        if s.steps > 1 {
            *s.page_faults_after_first.get_or_insert(0) += faults;
        }
    }
    s.breakdown = s.breakdown.plus(TimeBreakdown {
        compute_s: mean.compute_s / n,
        communication_s: mean.communication_s / n,
        waiting_s: mean.waiting_s / n,
        overlapped_s: mean.overlapped_s / n,
    });
    if !skipped {
        s.first_loss.get_or_insert(loss);
        s.last_loss = Some(loss);
    }
    state.publish(JobEvent::StepDone(StepDone {
        step,
        loss,
        samples_per_s: samples as f64 / wall_s.max(1e-9),
        wall_s,
        learning_rate,
        skipped,
        loss_scale: loss_scale.map(|(used, _)| used),
        replicas,
        pipeline,
        page_faults,
    }));
}

/// The pipeline figures of a step from the stages' reports: the measured bubble and timeline of
/// replica 0's pipeline (times from its first instruction), every stage's peak stash and
/// activation bytes (the largest over replicas).
fn pipeline_step(
    stages: &[StageId],
    reports: &[StepReport],
    layout: Layout,
) -> Option<PipelineStep> {
    let pp = layout.pp() as usize;
    let mut timeline: Vec<Vec<TimedInstr>> = vec![Vec::new(); pp];
    let mut peak_stash = vec![0u32; pp];
    let mut peak_activation_bytes = vec![0u64; pp];
    let mut any = false;
    for (report, id) in reports.iter().zip(stages) {
        let Some(p) = &report.pipeline else { continue };
        any = true;
        let s = id.stage as usize;
        if s >= pp {
            continue;
        }
        peak_stash[s] = peak_stash[s].max(p.peak_stash);
        peak_activation_bytes[s] = peak_activation_bytes[s].max(p.peak_activation_bytes);
        if id.replica == 0 {
            timeline[s] = p.executed.clone();
        }
    }
    if !any {
        return None;
    }
    let origin = timeline
        .iter()
        .flatten()
        .map(|t| t.start)
        .min()
        .unwrap_or(0);
    for t in timeline.iter_mut().flatten() {
        t.start -= origin;
        t.end -= origin;
    }
    let summary = summarize(&timeline);
    let span = summary.makespan.max(1) as f64;
    Some(PipelineStep {
        bubble: summary.bubble,
        shares: summary
            .per_stage
            .iter()
            .map(|s| StageShares {
                compute: s.compute as f64 / span,
                communication: s.communication as f64 / span,
                waiting: s.idle as f64 / span,
            })
            .collect(),
        peak_stash,
        peak_activation_bytes,
        timeline,
    })
}

/// STRAG-1..3: feed the step's compute times to the straggler detectors (replicas of the same
/// pipeline stage and tensor-parallel rank are compared with each other) and publish what
/// they find; the detectors forget the ranks when the generation changed (renumbered).
fn observe_stragglers<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    replicas: &[ReplicaStep],
) {
    let generation = state.members.generation;
    let Some(s) = state.stragglers.as_mut() else {
        return;
    };
    if s.generation != generation {
        s.detectors.clear();
        s.generation = generation;
    }
    let mut groups: std::collections::BTreeMap<(u32, u32), Vec<(u32, f64)>> = Default::default();
    for r in replicas {
        groups
            .entry((r.stage.stage, r.stage.tp))
            .or_default()
            .push((r.rank.0, r.breakdown.compute_s));
    }
    let config = s.config;
    let changes: Vec<_> = groups
        .into_iter()
        .flat_map(|(key, times)| {
            s.detectors
                .entry(key)
                .or_insert_with(|| crate::stragglers::StragglerDetector::new(config))
                .observe(&times)
        })
        .collect();
    for change in changes {
        let event = match change {
            crate::stragglers::StragglerChange::Slow {
                rank,
                slowdown,
                median_s,
                typical_s,
            } => {
                let Some(r) = replicas.iter().find(|r| r.rank.0 == rank) else {
                    continue;
                };
                tracing::warn!(
                    step,
                    rank,
                    slowdown,
                    "straggler: rank {rank} computes {slowdown:.2}× slower than the others"
                );
                JobEvent::Straggler {
                    step,
                    rank: r.rank,
                    stage: r.stage,
                    slowdown,
                    median_s,
                    typical_s,
                }
            }
            crate::stragglers::StragglerChange::Recovered { rank, slowdown } => {
                JobEvent::StragglerRecovered {
                    step,
                    rank: crate::mesh::Rank(rank),
                    slowdown,
                }
            }
        };
        state.publish(event);
    }
}
