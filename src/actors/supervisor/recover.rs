//! Recovering from a failure without a restart (REC-1..7). What the failure means is decided
//! by [`decide::on_failure`](super::decide::on_failure); this file carries it out: the lost
//! ranks are published and killed, then the survivors regroup under the next generation
//! (REC-1, REC-4, with REC-7's catch-up), lost pipeline stages are replaced from their twins
//! (REC-6), or every rank is restored from the newest checkpoint (REC-5).

use std::time::{Duration, Instant};

use ractor::ActorRef;
use tokio::task::JoinSet;

use super::calls::{ask, restore};
use super::checkpoints::latest_checkpoint;
use super::decide::{self, CatchUp, Divergence, Failure, OnFailure};
use super::members::{rebuild_group, rewire_survivors, spawn_replica, start_device};
use super::resize::{refill_from_waiting, wait_for_minimum};
use super::state::SupervisorState;
use super::step::step_done;
use crate::actors::checkpointer::Checkpointer;
use crate::actors::device::{DeviceMsg, heartbeat};
use crate::actors::spawner::RewireArgs;
use crate::actors::stage::{StageMsg, StepReport};
use crate::error::{DeviceId, Error, Result, StageId};
use crate::events::JobEvent;
use crate::mesh::{Generation, Rank};

/// What the survivors of a recovery run next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Redo {
    /// The failed step, again (nothing of it was applied).
    Step,
    /// The next step: the failed one had completed, and been applied, on every survivor.
    Nothing,
    /// This step: the job rolled back to a checkpoint taken after it (REC-5).
    From(u64),
}

/// A step that failed: what each rank was given and what the ones that finished reported.
#[derive(Debug)]
pub(crate) struct Interrupted {
    pub(super) shares: Vec<Vec<usize>>,
    pub(super) done: Vec<Option<StepReport>>,
    pub(super) started: Instant,
}

/// A failure: errors, each with the rank it was found on when that is known.
pub(super) struct LostRanks(pub(super) Vec<(Option<usize>, Error)>);

impl From<Error> for LostRanks {
    fn from(e: Error) -> Self {
        LostRanks(vec![(None, e)])
    }
}

/// How long a rank's device may take to answer the probe that decides whether it was lost
/// with the failure ([`with_unreachable`]).
const LOSS_PROBE: Duration = Duration::from_secs(20);

/// `lost` and every other rank whose device does not answer a heartbeat within
/// [`LOSS_PROBE`], in rank order.
async fn with_unreachable(
    devices: Vec<(ActorRef<DeviceMsg>, DeviceId)>,
    mut lost: Vec<usize>,
) -> Vec<usize> {
    let mut probes = JoinSet::new();
    for (r, (device, id)) in devices.into_iter().enumerate() {
        if lost.contains(&r) {
            continue;
        }
        // A dead process is found at once (its session ends): the wait only bounds a frozen
        // one. It is generous because a rank wrongly called lost can leave a lost stage
        // without its twin, and a loaded machine answers late.
        let wait = LOSS_PROBE;
        probes.spawn(async move { (r, heartbeat(&device, id, wait).await.is_ok()) });
    }
    while let Some(probe) = probes.join_next().await {
        if let Ok((r, false)) = probe {
            lost.push(r);
        }
    }
    lost.sort_unstable();
    lost
}

/// Recover from `failure` at `step` by the job's policy (REC-1..7): on `Ok` the mesh holds the
/// survivors (or replacements) under a new generation and says which step runs next.
pub(super) async fn recover<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    failure: LostRanks,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let first = failure
        .0
        .first()
        .map(|(_, e)| e.clone())
        .unwrap_or_else(|| Error::Runtime("a failure without an error".into()));
    let mut lost = state.members.lost_ranks(&failure.0);
    if state.members.reconnect_devices {
        // Across processes one failure can take several ranks (a node holding several
        // devices): every other rank whose device does not answer is lost with it. And a
        // survivor's report can come first and name no lost rank (its tensor-parallel or
        // pipeline peer's link broke, the peer numbered in its own group): the probe finds
        // the rank whose process died.
        lost = with_unreachable(state.members.devices.clone(), lost).await;
    }
    let finished: Vec<bool> = (0..state.members.stages.len())
        .map(|r| {
            state
                .recovery
                .interrupted
                .as_ref()
                .is_some_and(|i| i.done.get(r).is_some_and(Option::is_some))
        })
        .collect();
    let stage_of = state.members.stage_of();
    let facts = Failure {
        stage_of: &stage_of,
        lost: &lost,
        message_fault: failure.0.iter().any(|(_, e)| e.is_message_fault()),
        caps: state.members.caps,
        finished: &finished,
    };
    let plan = decide::on_failure(
        &state.recovery.policy,
        &mut state.recovery.restarts,
        Instant::now(),
        &facts,
    );
    if plan.drops_lost() {
        drop_lost(state, step, &lost, &failure, &first);
    }
    match plan {
        OnFailure::Fail(reason) => {
            // A policy that asked for no recovery needs no reason; one that did says why it
            // was not carried out (a job must not end without saying why).
            if state.recovery.policy.recovers() {
                tracing::warn!(step, ?lost, %reason, "the failure is not recovered");
                state.publish(JobEvent::NotRecovered {
                    step,
                    lost: lost.iter().map(|&r| Rank(r as u32)).collect(),
                    reason,
                });
            }
            Err(first)
        }
        OnFailure::TooMany { count } => Err(Error::TooManyFailures {
            count,
            window: state.recovery.policy.window,
            last: Box::new(first),
        }),
        OnFailure::RollBack => roll_back_to_checkpoint(state, step, &lost, first).await,
        OnFailure::Diverged(Divergence::Stages) => {
            // A stage applies its update once its own data-parallel all-reduce is done, not
            // when the whole mesh is: a stage lost after sending its last gradients, while
            // its twin waits for it, leaves the stages before it updated.
            state.recovery.interrupted = None;
            Err(Error::Runtime(format!(
                "step {step} was applied by some stages and not by others when a stage was \
                 lost, so its replacement cannot redo it; only a checkpoint makes the stages \
                 agree again (the loss: {first})"
            )))
        }
        OnFailure::ReplaceFromTwins { twins } => {
            state.recovery.interrupted = None;
            replace_from_twins(state, step, &twins, first).await
        }
        OnFailure::Regroup {
            survivors,
            catch_up,
            completed,
        } => regroup(state, step, &lost, &survivors, catch_up, completed).await,
    }
}

/// Publish every lost rank (`DeviceLost`, with the error that names it) and kill its actors
/// (killed, not stopped: a stuck stage is still inside its step).
fn drop_lost<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    lost: &[usize],
    failure: &LostRanks,
    first: &Error,
) {
    for &r in lost {
        let (stage, id) = state.members.stages[r].clone();
        let (device, device_id) = state.members.devices[r].clone();
        let error = failure
            .0
            .iter()
            .find(|(rank, e)| {
                *rank == Some(r)
                    || matches!(e, Error::StageFailed { stage, .. } | Error::StageLost { stage, .. } if *stage == id)
            })
            .map_or_else(|| first.clone(), |(_, e)| e.clone());
        state.publish(JobEvent::DeviceLost {
            step,
            rank: Rank(r as u32),
            device: device_id,
            error,
        });
        state.members.departed.insert(stage.get_id());
        state.members.departed.insert(device.get_id());
        stage.kill();
        device.kill();
    }
}

/// REC-1, REC-4, REC-7: the `survivors` regroup under the next generation; those that did
/// not finish the step take the state of one that did (`catch_up`), and a step that
/// `completed` on a survivor is published (with the lost ranks' samples: their gradients
/// were in the all-reduce) and not redone.
async fn regroup<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    lost: &[usize],
    survivors: &[usize],
    catch_up: Option<CatchUp>,
    completed: bool,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let interrupted = state.recovery.interrupted.take();
    let old_ids = state.members.stage_ids();
    let lost_devices: Vec<DeviceId> = lost.iter().map(|&r| state.members.devices[r].1).collect();
    let members = survivors
        .iter()
        .map(|&r| {
            (
                state.members.stages[r].0.clone(),
                state.members.devices[r].clone(),
            )
        })
        .collect();
    rebuild_group(state, members).await?;
    if let Some(c) = catch_up {
        // REC-7: once the old group no longer holds them; the step then counts as done.
        catch_up_from(state, step, &c).await?;
    }
    let next = if completed { step + 1 } else { step };
    state.publish(JobEvent::Recovered {
        step: next,
        generation: state.members.generation,
        layout: state.members.layout,
        lost: lost_devices,
    });
    wait_for_minimum(state, next);
    refill_from_waiting(state);
    let Some(interrupted) = interrupted.filter(|_| completed) else {
        return Ok(Redo::Step);
    };
    let learning_rate = interrupted
        .done
        .iter()
        .flatten()
        .find_map(|r| r.learning_rate);
    let samples = interrupted.shares.iter().map(Vec::len).sum();
    let reports = interrupted
        .done
        .into_iter()
        .enumerate()
        .map(|(r, report)| {
            let id = old_ids.get(r).copied().unwrap_or(StageId {
                replica: r as u32,
                stage: 0,
                tp: 0,
            });
            let report = report.unwrap_or_else(|| StepReport {
                rank: Rank(r as u32),
                sample_ids: interrupted
                    .shares
                    .get(id.replica as usize)
                    .cloned()
                    .unwrap_or_default(),
                local_loss: None,
                learning_rate,
                trace: Vec::new(),
                pipeline: None,
                held: None,
                loss_scale: None,
                bytes_sent: 0,
                parameter_server: None,
            });
            (report, id)
        })
        .collect();
    step_done(
        state,
        step,
        reports,
        samples,
        interrupted.started.elapsed().as_secs_f64(),
        None,
    );
    Ok(Redo::Nothing)
}

/// REC-7: the survivors (in their new rank order) that did not finish `step` take the
/// parameters, optimizer state and learning-rate schedule (LR-2) of the first one that did.
async fn catch_up_from<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    c: &CatchUp,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let timeout = state.clock.step_timeout;
    let (stage, id) = state.members.stages[c.source].clone();
    let snapshot = ask(&stage, StageMsg::Snapshot, timeout, || {
        format!("{id}, which finished step {step}, did not answer a snapshot")
    })
    .await?;
    for &r in &c.behind {
        let (stage, id) = state.members.stages[r].clone();
        restore(&stage, snapshot.clone(), timeout, || {
            format!(
                "{id} did not take the state of {} that finished step {step}",
                state.members.stages[c.source].1
            )
        })
        .await?;
    }
    state.publish(JobEvent::CaughtUp {
        step,
        ranks: c.behind.iter().map(|&r| Rank(r as u32)).collect(),
        from: Rank(c.source as u32),
    });
    Ok(())
}

/// Replace the `lost` ranks of a pipeline job with fresh, initialized stage actors on spare
/// or new devices, and rewire the whole mesh under the next generation (REC-6): the old
/// links and groups are shut, survivors take their new wiring, the layout stays.
async fn replace_pipeline_stages<M, I>(
    state: &mut SupervisorState<M, I>,
    lost: &[usize],
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(rewire) = state.members.rewire.clone() else {
        return Err(Error::InvalidConfig(
            "this job cannot replace pipeline stages".into(),
        ));
    };
    (state.members.shutdown)();
    for o in state.members.others.drain(..) {
        state.members.departed.insert(o.get_id());
        o.stop(None);
    }
    let mut devices = Vec::with_capacity(state.members.devices.len());
    for r in 0..state.members.devices.len() {
        if !lost.contains(&r) || state.members.reconnect_devices {
            // A surviving stage keeps its device; a cluster job's spawner finds its own.
            devices.push(None);
            continue;
        }
        devices.push(Some(start_device(state).await?));
    }
    let generation = Generation(state.members.generation.0 + 1);
    let rewired = rewire(RewireArgs {
        supervisor: state.myself.clone(),
        layout: state.members.layout,
        generation,
        comm: state.members.comm.clone(),
        devices: devices.clone(),
        fresh: lost.to_vec(),
        slots: state.members.devices.iter().map(|(_, id)| *id).collect(),
    })
    .await
    .map_err(|e| Error::Runtime(format!("could not rewire the pipeline: {e}")))?;
    for (r, device) in rewired.devices {
        if let Some(d) = state.members.devices.get_mut(r) {
            *d = device;
        }
    }
    let timeout = state.clock.step_timeout;
    for (r, stage) in rewired.fresh {
        let id = state.members.stages[r].1;
        ask(&stage, StageMsg::Init, timeout, || {
            format!("the replacement of {id} did not start")
        })
        .await?;
        state.members.stages[r].0 = stage;
        if let Some((device, device_ref)) = &devices[r] {
            state.members.devices[r] = (device_ref.clone(), device.id());
        }
    }
    rewire_survivors(&state.members.stages, rewired.survivors, timeout).await?;
    state.members.others = rewired.others;
    state.members.shutdown = rewired.shutdown;
    state.members.generation = generation;
    Ok(())
}

/// REC-6: replace each lost pipeline stage with a fresh one holding its twin's parameters
/// and optimizer state, then redo the step (no survivor applied it: `decide::on_failure`).
async fn replace_from_twins<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    twins: &[(usize, usize)],
    cause: Error,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let lost: Vec<usize> = twins.iter().map(|(r, _)| *r).collect();
    let lost_devices: Vec<DeviceId> = lost.iter().map(|&r| state.members.devices[r].1).collect();
    // Snapshots first: the twins' state is the step's starting state (nothing applied).
    let timeout = state.clock.step_timeout;
    let mut snapshots = Vec::with_capacity(twins.len());
    for &(_, twin) in twins {
        let (stage, id) = state.members.stages[twin].clone();
        let s = ask(&stage, StageMsg::Snapshot, timeout, || {
            format!("{id} did not answer a snapshot")
        })
        .await?;
        snapshots.push(s);
    }
    replace_pipeline_stages(state, &lost).await.map_err(|e| {
        Error::Runtime(format!(
            "the lost stage could not be replaced: {e} (the loss: {cause})"
        ))
    })?;
    for (&(r, twin), shards) in twins.iter().zip(snapshots) {
        let (stage, id) = state.members.stages[r].clone();
        restore(&stage, shards, timeout, || {
            format!("{id} did not take its twin's state")
        })
        .await?;
        state.publish(JobEvent::StageReplaced {
            step,
            stage: id,
            twin: state.members.stages[twin].1,
            device: state.members.devices[r].1,
        });
    }
    state.publish(JobEvent::Recovered {
        step,
        generation: state.members.generation,
        layout: state.members.layout,
        lost: lost_devices,
    });
    Ok(Redo::Step)
}

/// REC-5: replace the `lost` ranks with new replicas, restore every replica from the newest
/// valid checkpoint, regroup under the next generation, and go on from the checkpoint's
/// step. Without a checkpoint the job ends with `cause`.
async fn roll_back_to_checkpoint<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    lost: &[usize],
    cause: Error,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    state.recovery.interrupted = None;
    // Checkpoints still queued for writing count: wait for them (bounded).
    let queue = state
        .ckpt
        .checkpointer
        .as_ref()
        .and_then(Checkpointer::queue);
    if let Some(queue) = queue {
        let timeout = state.clock.step_timeout;
        let _ = tokio::task::spawn_blocking(move || queue.flush(timeout)).await;
    }
    let Some((checkpoint, dir, _)) = latest_checkpoint(state).await? else {
        return Err(cause);
    };
    let shard = checkpoint.shards.clone();
    let lost_devices: Vec<DeviceId> = lost.iter().map(|&r| state.members.devices[r].1).collect();
    let mut members = Vec::with_capacity(state.members.stages.len());
    let regroups = state.members.caps.rejoin.regroups();
    if regroups {
        // One data-parallel group: new replicas for the lost ranks, regrouped below.
        for r in 0..state.members.stages.len() {
            if lost.contains(&r) {
                members.push(spawn_replica(state, r).await?);
            } else {
                members.push((
                    state.members.stages[r].0.clone(),
                    state.members.devices[r].clone(),
                ));
            }
        }
    } else {
        // A rewired mesh (a pipeline): fresh stages for the lost ranks, every rank rewired.
        replace_pipeline_stages(state, lost).await?;
        members = state
            .members
            .stages
            .iter()
            .zip(&state.members.devices)
            .map(|((s, _), d)| (s.clone(), d.clone()))
            .collect();
    }
    for (stage, (_, device)) in &members {
        restore(stage, shard.clone(), state.clock.step_timeout, || {
            format!(
                "the stage on device {device} did not restore {}",
                dir.display()
            )
        })
        .await?;
    }
    if regroups {
        rebuild_group(state, members).await?;
    }
    state.ckpt.last_checkpoint = Some(checkpoint.step);
    state.publish(JobEvent::RolledBack {
        failed_step: step,
        step: checkpoint.step,
        generation: state.members.generation,
        path: dir,
        lost: lost_devices,
    });
    Ok(Redo::From(checkpoint.step))
}
