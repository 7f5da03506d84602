//! Elastic jobs (ELASTIC-1..6): `scale_to`/`add_replicas` requests admitted or refused as
//! they arrive ([`decide::admit_request`]), a resize carried out at the next step boundary
//! ([`decide::plan_resize`]: a data-parallel group regrouped, or a dp × pp × tp mesh rewired
//! along dp), the wait for devices below the elastic minimum and its end, and the growth back
//! onto slots waiting to join.
//!
//! - **ELASTIC-1** `scale_to(n)` applies at a step boundary: leaving replicas stop, joining ones
//!   take rank 0's parameters, optimizer state and learning-rate schedule (LR-2;
//!   `StageMsg::Snapshot`/`Restore`), all regroup under generation + 1; the global batch and the
//!   sample order do not change.
//! - **ELASTIC-3** losses that leave fewer replicas than the elastic minimum hold the next step
//!   (`WaitingForDevices`) until `scale_to(n ≥ min)` or `resume()`, and end the job with
//!   `BelowMinimum` after `elastic_wait`: never a deadlock and never training below the minimum
//!   unasked. A growth toward the minimum is taken while waiting, and a resize that leaves the job
//!   below it holds the step again.
//! - **ELASTIC-4** a job that lost replicas grows back, before its next step, onto slots waiting to
//!   join it (`Grow::Remote`'s `waiting`: nodes that joined a job across processes at its maximum,
//!   spares), up to its maximum; below the minimum that ends the wait.
//! - **ELASTIC-5** a growth ends at the first replica that cannot join (no device, no node waiting,
//!   a joining node gone): the ones that joined before it stay (`Resized` to the size reached,
//!   `ResizeRefused` for the rest); with none, the mesh is left as it was.
//! - **ELASTIC-6** a block or pipeline job (a dp × pp × tp mesh, `Rejoin::Rewire`) resizes along
//!   dp: `Layout::remesh` (pure, proptested) keeps every (stage, tp rank) in its place and gives
//!   each new rank the old rank at its coordinates or none (joining); `resize_mesh` gathers every
//!   block's state first (`snapshot_state`: ZeRO parts put together), stops the leaving replicas,
//!   starts devices for the joining ones, wires the whole mesh anew (`RewireStages`, the REC-6
//!   seam), gives survivors their new rank with `StageMsg::Rewire`, and restores the gathered
//!   state: onto every rank where it is sharded (ZeRO, compression residuals: re-sharded over the
//!   new data-parallel groups), onto the joining ranks alone where replicas hold it whole. A
//!   failure after the gather ends the job (`Error::Runtime`, "failed half-way"); a refusal
//!   (`Capabilities::fixed_size`, `Capabilities::micro_batches`) leaves it as it was. A fault
//!   plan's `FaultKind::Resize` asks for the same resize at a fixed boundary, so an elastic
//!   rehearsal replays bitwise (FAULT-2).

use std::time::Instant;

use ractor::{ActorProcessingErr, ActorRef};

use super::SupervisorMsg;
use super::calls::{ask, restore};
use super::checkpoints::snapshot_state;
use super::decide::{self, Admission, ResizePlan, ResizeRequest};
use super::lifecycle::finish;
use super::members::{Member, rebuild_group, rewire_survivors, spawn_replica, start_device};
use super::state::SupervisorState;
use crate::actors::spawner::Rejoin;
use crate::actors::spawner::{Grow, RewireArgs};
use crate::actors::stage::StageMsg;
use crate::error::{Error, Result, StageId};
use crate::events::JobEvent;
use crate::mesh::{Generation, Rank};

/// `scale_to(n)`: take it for the next step boundary, or refuse it at once; below the
/// minimum, a resize taken ends the wait (ELASTIC-3).
pub(super) fn request<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    n: u32,
) -> Result<(), ActorProcessingErr> {
    let (admission, resume) = decide::admit_request(&ResizeRequest {
        requested: n,
        elastic: state.elastic.range,
        dp: state.members.layout.dp(),
        waiting: state.elastic.below_min.is_some(),
        pending: state.elastic.scale_target,
    });
    match admission {
        Admission::Refused(reason) => state.publish(JobEvent::ResizeRefused {
            requested: n,
            reason,
        }),
        Admission::Accepted { replaces } => {
            state.elastic.scale_target = Some(n);
            if let Some((requested, reason)) = replaces {
                state.publish(JobEvent::ResizeRefused { requested, reason });
            }
        }
    }
    if resume {
        myself.send_message(SupervisorMsg::Resume)?;
    }
    Ok(())
}

/// `add_replicas(k)`: a resize to `k` more than asked so far (or than the job has).
pub(super) fn add<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &SupervisorState<M, I>,
    k: u32,
) -> Result<(), ActorProcessingErr> {
    let now = state
        .elastic
        .scale_target
        .unwrap_or(state.members.layout.dp());
    myself.send_message(SupervisorMsg::ScaleTo(now.saturating_add(k)))?;
    Ok(())
}

/// The wait below the minimum of `generation` is over: if the job still waits there, it
/// ends with `BelowMinimum` (ELASTIC-3).
pub(super) async fn minimum_wait_over<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    generation: Generation,
) where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if let Some((g, since)) = state.elastic.below_min
        && g == generation
    {
        let error = Error::BelowMinimum {
            replicas: state.members.layout.dp(),
            min: state.elastic.range.0,
            waited: since.elapsed(),
        };
        finish(myself, state, Err(error)).await;
    }
}

/// ELASTIC-3: below the elastic minimum, wait for devices rather than train on (the step
/// `next` is held until a resize or `resume()`, the job ends after the elastic wait).
pub(super) fn wait_for_minimum<M, I>(state: &mut SupervisorState<M, I>, next: u64) {
    let min = state.elastic.range.0;
    let dp = state.members.layout.dp();
    let resizable = state.members.caps.rejoin.regroups();
    if !decide::must_wait_for_devices(resizable, dp, min, state.clock.paused.is_some()) {
        return;
    }
    let generation = state.members.generation;
    state.elastic.below_min = Some((generation, Instant::now()));
    state.clock.paused = Some(None);
    state.publish(JobEvent::WaitingForDevices {
        step: next,
        replicas: dp,
        min,
        within: state.elastic.wait,
    });
    state.me().send_after(state.elastic.wait, move || {
        SupervisorMsg::MinimumWaitOver(generation)
    });
}

/// ELASTIC-4: a job that lost replicas grows back onto slots waiting to join it (nodes that
/// joined a job across processes beyond its maximum: spares), up to its maximum, before its
/// next step; below the elastic minimum that also ends the wait (ELASTIC-3).
pub(super) fn refill_from_waiting<M, I>(state: &SupervisorState<M, I>) {
    let Some(Grow::Remote { waiting, .. }) = &state.members.grow else {
        return;
    };
    if let Some(n) =
        decide::refill_target(state.members.layout.dp(), state.elastic.range.1, waiting())
    {
        // The mailbox outlives this call; a failed send means the job is ending anyway.
        let _ = state.me().send_message(SupervisorMsg::ScaleTo(n));
    }
}

/// Resize a data-parallel job to `n` replicas at a step boundary (ELASTIC-1): leaving replicas
/// are stopped; joining ones get a device (a spare of the builder's list, else a new logical
/// device of the same backend), build the model, take rank 0's parameters, optimizer state
/// and learning-rate schedule (LR-2), and everyone regroups under the next generation. The global batch stays the same.
/// `InvalidConfig`: refused, the mesh is as it was; any other error: failed half-way.
pub(super) async fn resize<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    n: usize,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if state.members.caps.rejoin == Rejoin::Rewire {
        return resize_mesh(state, step, n).await;
    }
    let from = state.members.stages.len();
    let global = state.clock.sampler.batch_size();
    let plan =
        decide::plan_resize(n, from, global, &state.members.caps).map_err(Error::InvalidConfig)?;
    // ZERO-3: where each rank holds a shard of the state, every shard is gathered before
    // anyone leaves and re-sharded onto the new group once it is built.
    let gathered = if state.members.caps.replicated_state {
        None
    } else {
        Some(snapshot_state(state).await?)
    };
    let mut members: Vec<Member<M>> = state
        .members
        .stages
        .iter()
        .zip(&state.members.devices)
        .take(n)
        .map(|((s, _), d)| (s.clone(), d.clone()))
        .collect();
    match plan {
        // Leaving replicas: the last ranks.
        ResizePlan::Shrink { to } => {
            for r in to..from {
                let (stage, _) = &state.members.stages[r];
                let (device, _) = &state.members.devices[r];
                state.members.departed.insert(stage.get_id());
                state.members.departed.insert(device.get_id());
                stage.stop(None);
                device.stop(None);
            }
        }
        ResizePlan::Grow { from, to } => {
            grow(state, &mut members, (from, to), gathered.clone()).await?
        }
    }
    let to = members.len();
    rebuild_group(state, members).await?;
    if let Some(all) = gathered {
        for (stage, id) in state.members.stages.clone() {
            restore(&stage, all.clone(), state.clock.step_timeout, || {
                format!("{id} did not take its re-sharded state")
            })
            .await?;
        }
    }
    state.publish(JobEvent::Resized {
        step,
        generation: state.members.generation,
        from: from as u32,
        to: to as u32,
    });
    Ok(())
}

/// Start ranks `from..to`, each taking rank 0's state (or, sharded, every rank's gathered
/// state, re-sharded when it steps), into `members`; ELASTIC-5: the first that cannot join
/// ends the growth (with none joined, `InvalidConfig`).
async fn grow<M, I>(
    state: &mut SupervisorState<M, I>,
    members: &mut Vec<Member<M>>,
    (from, to): (usize, usize),
    gathered: Option<Vec<crate::checkpoint::ShardSnapshot>>,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let snapshot = match gathered {
        Some(all) => all,
        None => {
            let (rank0, _) = state.members.stages[0].clone();
            ask(&rank0, StageMsg::Snapshot, state.clock.step_timeout, || {
                "rank 0 did not answer the snapshot request".into()
            })
            .await?
        }
    };
    for r in from..to {
        let id = StageId {
            replica: r as u32,
            stage: 0,
            tp: 0,
        };
        let joined = match spawn_replica(state, r).await {
            Ok((stage, device)) => {
                let taken = restore(&stage, snapshot.clone(), state.clock.step_timeout, || {
                    format!("{id} did not take rank 0's state")
                })
                .await;
                if taken.is_err() {
                    state.members.departed.insert(stage.get_id());
                    state.members.departed.insert(device.0.get_id());
                    stage.stop(None);
                    device.0.stop(None);
                } else {
                    members.push((stage, device));
                }
                taken
            }
            Err(e) => Err(e),
        };
        if let Err(e) = joined {
            // ELASTIC-5: a replica that cannot join (no device for it, no node waiting, a
            // joining node gone) ends the growth there; the ones that joined before it stay,
            // and with none the mesh is left as it was.
            if members.len() == from {
                return Err(Error::InvalidConfig(format!(
                    "replica {r} could not join: {e}"
                )));
            }
            state.publish(JobEvent::ResizeRefused {
                requested: to as u32,
                reason: format!(
                    "replica {r} could not join ({e}); growing to {} replicas",
                    members.len()
                ),
            });
            break;
        }
    }
    Ok(())
}

/// ELASTIC-6: resize a dp × pp × tp mesh (a block or pipeline job) to `n` replicas at a step
/// boundary, keeping pp and tp. Every block's state is gathered first (each ZeRO rank's
/// parts put together), the replicas beyond `n` leave, new ones start on spare or new
/// devices, the whole mesh is wired anew under the next generation in the new layout
/// (survivors keep their place and take their new rank), and the state goes back: to every
/// rank where each holds a shard of it (re-sharded over its new data-parallel group), to the
/// joining ranks alone where replicas hold it whole. The global batch stays the same.
/// `InvalidConfig`: refused, the mesh is as it was; any other error: failed half-way.
async fn resize_mesh<M, I>(state: &mut SupervisorState<M, I>, step: u64, n: usize) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let old = state.members.layout;
    let from = old.dp() as usize;
    let global = state.clock.sampler.batch_size();
    decide::plan_resize(n, from, global, &state.members.caps).map_err(Error::InvalidConfig)?;
    let Some(rewire) = state.members.rewire.clone() else {
        return Err(Error::InvalidConfig(
            "this job cannot wire its mesh anew".into(),
        ));
    };
    let remesh = old.remesh(n as u32)?;
    let joining: Vec<usize> = remesh.joining().into_iter().map(Rank::index).collect();
    // Who takes the state back: every rank re-shards its part (ZeRO), or the joining ranks
    // take their twins' (replicated). A replicated mesh that only shrinks gathers nothing.
    let takers: Vec<usize> = if state.members.caps.replicated_state {
        joining.clone()
    } else {
        (0..remesh.origin.len()).collect()
    };
    let gathered = if takers.is_empty() {
        Vec::new()
    } else {
        snapshot_state(state).await?
    };
    // From here on the mesh is changing: a failure ends the job.
    let half_way = |e: Error| {
        Error::Runtime(format!(
            "resizing the mesh from {from} to {n} replicas failed half-way: {e}"
        ))
    };
    (state.members.shutdown)();
    for o in state.members.others.drain(..) {
        state.members.departed.insert(o.get_id());
        o.stop(None);
    }
    for r in &remesh.leaving {
        let (stage, _) = &state.members.stages[r.index()];
        let (device, _) = &state.members.devices[r.index()];
        state.members.departed.insert(stage.get_id());
        state.members.departed.insert(device.get_id());
        stage.stop(None);
        device.stop(None);
    }
    let mut devices = Vec::with_capacity(remesh.origin.len());
    for origin in &remesh.origin {
        devices.push(match origin {
            Some(_) => None,
            None => Some(start_device(state).await.map_err(half_way)?),
        });
    }
    let slots = remesh
        .origin
        .iter()
        .zip(&devices)
        .map(|(origin, fresh)| match (origin, fresh) {
            (Some(o), _) => state.members.devices[o.index()].1,
            (None, Some((device, _))) => device.id(),
            (None, None) => unreachable!("a joining rank has a device (just above)"),
        })
        .collect();
    let generation = Generation(state.members.generation.0 + 1);
    let rewired = rewire(RewireArgs {
        supervisor: state.myself.clone(),
        layout: remesh.layout,
        generation,
        comm: state.members.comm.clone(),
        devices: devices.clone(),
        fresh: joining,
        slots,
    })
    .await
    .map_err(|e| half_way(Error::Runtime(format!("could not rewire the mesh: {e}"))))?;
    let mut fresh: Vec<Option<ActorRef<StageMsg<M>>>> = vec![None; remesh.origin.len()];
    for (r, stage) in rewired.fresh {
        if let Some(f) = fresh.get_mut(r) {
            *f = Some(stage);
        }
    }
    let timeout = state.clock.step_timeout;
    let mut stages = Vec::with_capacity(remesh.origin.len());
    let mut members = Vec::with_capacity(remesh.origin.len());
    for (r, origin) in remesh.origin.iter().enumerate() {
        let coord = remesh
            .layout
            .coord_of(Rank(r as u32))
            .expect("every rank of a layout has coordinates");
        let id = StageId {
            replica: coord.dp,
            stage: coord.pp,
            tp: coord.tp,
        };
        match (origin, fresh[r].take(), &devices[r]) {
            (Some(o), _, _) => {
                stages.push((state.members.stages[o.index()].0.clone(), id));
                members.push(state.members.devices[o.index()].clone());
            }
            (None, Some(stage), Some((device, device_ref))) => {
                // Linked to the Supervisor before it is asked: a failed start is a loss.
                ask(&stage, StageMsg::Init, timeout, || {
                    format!("{id} did not start")
                })
                .await
                .map_err(half_way)?;
                stages.push((stage, id));
                members.push((device_ref.clone(), device.id()));
            }
            _ => {
                return Err(half_way(Error::Runtime(format!(
                    "the rewired mesh has no stage for {id}"
                ))));
            }
        }
    }
    // The joining ranks' wiring went to their new stages: the rest is the survivors'.
    rewire_survivors(&stages, rewired.survivors, timeout)
        .await
        .map_err(half_way)?;
    state.members.stages = stages;
    state.members.devices = members;
    state.members.others = rewired.others;
    state.members.shutdown = rewired.shutdown;
    state.members.generation = generation;
    state.members.layout = remesh.layout;
    state.members.model_ranks = remesh
        .layout
        .replica_ranks(0)
        .into_iter()
        .map(Rank::index)
        .collect();
    for r in takers {
        let (stage, id) = state.members.stages[r].clone();
        restore(&stage, gathered.clone(), timeout, || {
            format!("{id} did not take its state in the resized mesh")
        })
        .await
        .map_err(half_way)?;
    }
    state.publish(JobEvent::Resized {
        step,
        generation: state.members.generation,
        from: from as u32,
        to: n as u32,
    });
    Ok(())
}
