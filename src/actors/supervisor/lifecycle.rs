//! A job's beginning and end: the actors spawned through the job's spawner, the stages
//! initialized and synchronized (and restored when resuming), a child that ends unexpectedly,
//! and the end (the trained model collected, the outcome sent once: SV-2; nothing of the job
//! left running: SV-1).

use std::collections::HashSet;

use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use super::calls::call_all;
use super::checkpoints::resume;
use super::state::{
    Checkpointing, Elasticity, Membership, RecoveryLog, StepClock, SupervisorState,
};
use super::{RunSummary, SupervisorArgs, SupervisorMsg, Trained};
use crate::actors::checkpointer::{Checkpointer, DRAIN_TIMEOUT};
use crate::actors::device::DeviceActor;
use crate::actors::spawner::SpawnContext;
use crate::actors::stage::StageMsg;
use crate::error::{Error, Result};
use crate::events::JobEvent;
use crate::mesh::Generation;
use crate::recovery::{OnReplicaLoss, RestartLog};

/// Spawn the job's devices and stages (linked to the Supervisor) and its checkpoint writer;
/// `Init` follows.
pub(super) async fn start<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    args: SupervisorArgs<M, I>,
) -> Result<SupervisorState<M, I>, ActorProcessingErr>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let SupervisorArgs {
        job: a,
        events,
        outcome,
    } = args;
    let ft = a.config.fault_tolerance.clone();
    let world = a.layout.world_size() as usize;
    let local = if a.remote { 0 } else { world };
    let mut devices = Vec::with_capacity(local);
    for d in a.devices.iter().take(local) {
        let (r, _) = Actor::spawn_linked(None, DeviceActor, d.clone(), myself.get_cell()).await?;
        devices.push((d.clone(), r));
    }
    let caps = a.spawn.capabilities();
    let spawned = a
        .spawn
        .spawn(SpawnContext {
            step_timeout: a.config.step_timeout,
            supervisor: myself.get_cell(),
            devices: devices.clone(),
            layout: a.layout,
            comm: a.comm.clone(),
        })
        .await?;
    let checkpointer = match &a.checkpoints {
        Some(c) => Some(Checkpointer::spawn(c.sink.clone(), events.clone())?),
        None => None,
    };
    myself.send_message(SupervisorMsg::Init)?;
    let reconnect_devices = spawned.devices.is_some();
    Ok(SupervisorState {
        members: Membership {
            layout: a.layout,
            generation: Generation(0),
            devices: spawned
                .devices
                .unwrap_or_else(|| devices.into_iter().map(|(d, r)| (r, d.id())).collect()),
            stages: spawned.stages,
            others: spawned.others,
            shutdown: spawned.shutdown,
            caps,
            reconnect_devices,
            model_ranks: spawned.model_ranks,
            assemble: spawned.assemble,
            departed: HashSet::new(),
            grow: spawned.grow,
            rewire: spawned.rewire,
            spare_devices: a.devices.iter().skip(local.max(1)).rev().cloned().collect(),
            device_template: a
                .devices
                .first()
                .cloned()
                .ok_or("a job needs at least one device")?,
            next_device_id: a.devices.iter().map(|d| d.id().0).max().unwrap_or(0),
            comm: a.comm.clone(),
        },
        clock: StepClock {
            steps: a.config.steps,
            accumulation: a.accumulation,
            sampler: a.sampler,
            epoch_order: None,
            step_timeout: a.config.step_timeout,
            running: None,
            attempts: 0,
            deferred: Vec::new(),
            seed: a.config.seed,
            summary: RunSummary::default(),
            control: Default::default(),
            control_mark: 0,
            paused: None,
            stop_requested: false,
            finished: false,
        },
        ckpt: Checkpointing {
            checkpointer,
            checkpoints: a.checkpoints,
            checkpoint_requested: false,
            last_checkpoint: None,
        },
        recovery: RecoveryLog {
            policy: ft.recovery,
            restarts: RestartLog::default(),
            pending_lost: Vec::new(),
            interrupted: None,
            faults: a.faults,
        },
        elastic: Elasticity {
            scale_target: None,
            range: (ft.elastic_min, ft.elastic_max),
            below_min: None,
            wait: ft.elastic_wait,
        },
        events,
        outcome: Some(outcome),
        myself: myself.get_cell(),
        stragglers: a.config.stragglers.map(|config| super::state::Stragglers {
            config,
            generation: Generation(0),
            detectors: Default::default(),
        }),
        _items: std::marker::PhantomData,
    })
}

/// `Init`: every stage builds its model and takes rank 0's parameters; `Started` and
/// `ReplicasSynchronized` are published, a checkpoint is restored when the job resumes, and
/// the first step is asked for.
pub(super) async fn init<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
) -> Result<(), ActorProcessingErr>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    state.publish(JobEvent::Started {
        layout: state.members.layout,
        generation: Generation(0),
    });
    let synchronized = call_all(&state.crew(), StageMsg::Init, state.clock.step_timeout).await;
    let started = match synchronized {
        Ok(reports) => {
            let (before, after) = reports.into_iter().map(|r| (r.before, r.after)).unzip();
            state.publish(JobEvent::ReplicasSynchronized { before, after });
            resume(state).await
        }
        Err(e) => Err(e),
    };
    match started {
        Ok(first) => {
            // SCALE-1: the steps' control messages are counted from here.
            state.clock.control_mark = state
                .clock
                .control
                .load(std::sync::atomic::Ordering::Relaxed);
            myself.send_message(SupervisorMsg::RunStep(first))?
        }
        Err(e) => {
            not_recovered_at_start(state, &e);
            finish(myself, state, Err(e)).await
        }
    }
    Ok(())
}

/// A recovering policy recovers from the first step on; a rank lost while the job starts
/// (building its stages, synchronizing their parameters, restoring a checkpoint) leaves the
/// survivors half-initialized, with nothing trained to keep: the job ends with the loss, and
/// `NotRecovered` says why the policy was not carried out (REC-3: never without a reason).
fn not_recovered_at_start<M, I>(state: &SupervisorState<M, I>, e: &Error)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if !state.recovery.policy.recovers() {
        return;
    }
    let lost = state.members.lost_ranks(&[(None, e.clone())]);
    state.publish(JobEvent::NotRecovered {
        step: 0,
        lost: lost.iter().map(|&r| crate::mesh::Rank(r as u32)).collect(),
        reason: "the failure came while the job was starting, before its first step \
                 (recovery begins at the first step): start the job again"
            .into(),
    });
}

/// A child actor failed or stopped. One the Supervisor stopped or gave up on is no news; a
/// stage or device lost between steps is recovered at the next step by a recovering policy;
/// anything else ends the job with an error naming it. While a step runs, the event waits
/// for the step's outcome (`deferred`), as it would if the Supervisor awaited the step.
pub(super) async fn child_exited<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    event: SupervisionEvent,
) where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if state.clock.finished {
        return;
    }
    let cell = match &event {
        SupervisionEvent::ActorFailed(cell, _) | SupervisionEvent::ActorTerminated(cell, ..) => {
            cell.clone()
        }
        _ => return,
    };
    if state.members.departed.contains(&cell.get_id()) {
        return;
    }
    if state.clock.running.is_some() {
        state.clock.deferred.push(event);
        return;
    }
    let error = match event {
        SupervisionEvent::ActorFailed(cell, err) => {
            Error::Runtime(format!("{} failed: {err}", state.members.describe(&cell)))
        }
        SupervisionEvent::ActorTerminated(cell, _, reason) => Error::Runtime(format!(
            "{} stopped unexpectedly ({})",
            state.members.describe(&cell),
            reason.unwrap_or_else(|| "no reason given".into())
        )),
        _ => return,
    };
    // A stage or device lost between steps: the next step recovers (or fails) with it.
    if let Some(rank) = state.members.rank_of_actor(&cell)
        && (state.recovery.policy.on_replica_loss == OnReplicaLoss::Shrink
            || state.recovery.policy.roll_back)
    {
        state.members.departed.insert(cell.get_id());
        state.recovery.pending_lost.push((rank, error));
        return;
    }
    finish(myself, state, Err(error)).await;
}

/// End the job: the checkpoints asked for are written, the model is collected (on success),
/// the last event is published, the outcome is sent (SV-2), every actor of the job stops
/// (SV-1). Only ever called between steps (a stop waits for the running step).
pub(super) async fn finish<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    result: Result<()>,
) where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    state.clock.finished = true;
    if let Some(running) = state.clock.running.take() {
        running.task.abort();
    }
    // CKW-1: the checkpoints asked for are on disk before the job's last event.
    if let Some(mut writer) = state.ckpt.checkpointer.take() {
        let _ = tokio::task::spawn_blocking(move || writer.drain(DRAIN_TIMEOUT)).await;
    }
    let outcome = match result {
        Ok(()) => collect_model(state).await,
        Err(e) => Err(e),
    };
    if let Err(e) = &outcome {
        if let Error::NonFiniteLoss { step, ranks } = e {
            state.publish(JobEvent::NonFiniteLoss {
                step: *step,
                ranks: ranks.clone(),
                skipped: false,
            });
        }
        state.publish(JobEvent::Failed(e.clone()));
    }
    (state.members.shutdown)();
    if let Some(tx) = state.outcome.take() {
        let _ = tx.send(outcome);
    }
    state.members.stop_all();
    myself.stop(None);
}

/// The Supervisor was stopped from outside before the job ended: still end it cleanly (SV-1,
/// SV-2), a running step's task included.
pub(super) fn abandon<M, I>(state: &mut SupervisorState<M, I>) {
    if state.clock.finished {
        return;
    }
    state.clock.finished = true;
    if let Some(running) = state.clock.running.take() {
        running.task.abort();
    }
    (state.members.shutdown)();
    let e = Error::Runtime("the supervisor stopped before the job ended".into());
    state.publish(JobEvent::Failed(e.clone()));
    if let Some(tx) = state.outcome.take() {
        let _ = tx.send(Err(e));
    }
    state.members.stop_all();
}

async fn collect_model<M, I>(state: &mut SupervisorState<M, I>) -> Result<Trained<M>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let timeout = state.clock.step_timeout;
    let fingerprints = call_all(&state.crew(), StageMsg::Fingerprint, timeout).await?;
    let mut parts = Vec::with_capacity(state.members.model_ranks.len());
    for &r in &state.members.model_ranks {
        let (stage, id) = &state.members.stages[r];
        match stage.call(StageMsg::TakeModel, Some(timeout)).await {
            Ok(CallResult::Success(Some(model))) => parts.push(model),
            _ => return Err(Error::Runtime(format!("{id} did not hand over its model"))),
        }
    }
    let model = (state.members.assemble)(parts)
        .ok_or_else(|| Error::Runtime("the trained model could not be put together".into()))?;
    // The last event: published only once the model is in hand.
    state.publish(JobEvent::Finished {
        steps: state.clock.summary.steps,
        fingerprints,
    });
    Ok(Trained {
        model,
        summary: state.clock.summary.clone(),
    })
}
