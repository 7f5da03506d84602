//! Who is in the mesh: a device or a replica that joins a running job, and the data-parallel
//! group rebuilt under the next generation around a new list of members (after a loss, a
//! resize or a rollback).

use std::sync::Arc;

use ractor::{Actor, ActorRef};
use tokio::task::JoinSet;

use super::calls::ask;
use super::state::SupervisorState;
use crate::actors::device::{DeviceActor, DeviceMsg};
use crate::actors::group::{GroupActor, GroupArgs};
use crate::actors::spawner::Rejoin;
use crate::actors::spawner::{Grow, GrowArgs, RemoteGrowArgs, SurvivorWiring};
use crate::actors::stage::StageMsg;
use crate::comm::LocalGroup;
use crate::device::MeshDevice;
use crate::error::{DeviceId, Error, Result, StageId};
use crate::mesh::{Generation, Layout, Rank};

/// One data-parallel member: its stage and its device.
pub(super) type Member<M> = (ActorRef<StageMsg<M>>, (ActorRef<DeviceMsg>, DeviceId));

/// Make `members` (in their new rank order) the job's data-parallel group under the next
/// generation, as the strategy's `Rejoin` says: the old group is shut down and its actors
/// stopped, every member joins a new collective group (`StageMsg::Regroup`, or `Reconnect`
/// across processes), the layout follows. A rewired mesh (a pipeline) has no such group.
pub(super) async fn rebuild_group<M, I>(
    state: &mut SupervisorState<M, I>,
    members: Vec<Member<M>>,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if !state.members.caps.rejoin.regroups() {
        return Err(Error::InvalidConfig(
            "a rewired mesh has no data-parallel group to rebuild".into(),
        ));
    }
    // The old group is over: wake anything still waiting in it, stop its actors.
    (state.members.shutdown)();
    for o in state.members.others.drain(..) {
        state.members.departed.insert(o.get_id());
        o.stop(None);
    }
    let n = members.len();
    let generation = Generation(state.members.generation.0 + 1);
    if state.members.caps.rejoin == Rejoin::Reconnect {
        return reconnect_group(state, members, generation).await;
    }
    let group = LocalGroup::new(n, generation, state.members.comm.clone());
    let comms = group.communicators();
    let mut stages = Vec::with_capacity(n);
    let mut devices = Vec::with_capacity(n);
    for (new_rank, ((stage, device), comm)) in members.into_iter().zip(comms).enumerate() {
        let id = StageId {
            replica: new_rank as u32,
            stage: 0,
            tp: 0,
        };
        let regroup = |reply| StageMsg::Regroup {
            id,
            rank: Rank(new_rank as u32),
            comm,
            reply,
        };
        ask(&stage, regroup, state.clock.step_timeout, || {
            format!(
                "{id} did not join the rebuilt group of generation {}",
                generation.0
            )
        })
        .await?;
        stages.push((stage, id));
        devices.push(device);
    }
    let (group_ref, _) = Actor::spawn_linked(
        None,
        GroupActor,
        GroupArgs {
            members: (0..n as u32).map(Rank).collect(),
            group: group.clone(),
        },
        state.myself.clone(),
    )
    .await
    .map_err(|e| Error::Runtime(format!("could not start the rebuilt group: {e}")))?;
    state.members.stages = stages;
    state.members.devices = devices;
    state.members.others = vec![group_ref.get_cell()];
    state.members.shutdown = Arc::new(move || group.shutdown());
    state.members.generation = generation;
    state.members.layout = Layout::data_parallel(n as u32)?;
    Ok(())
}

/// [`rebuild_group`] for stages that connect their own data plane (a cluster job): every
/// member is asked at once to join the group of `generation` (each waits for the others while
/// it connects), the members named by their slots (a cluster job's device ids).
async fn reconnect_group<M, I>(
    state: &mut SupervisorState<M, I>,
    members: Vec<Member<M>>,
    generation: Generation,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let n = members.len();
    let slots: Vec<Rank> = members.iter().map(|(_, (_, d))| Rank(d.0)).collect();
    let mut joins = JoinSet::new();
    for (new_rank, (stage, _)) in members.iter().enumerate() {
        let id = StageId {
            replica: new_rank as u32,
            stage: 0,
            tp: 0,
        };
        let (stage, slots, timeout) = (stage.clone(), slots.clone(), state.clock.step_timeout);
        joins.spawn(async move {
            let reconnect = |reply| StageMsg::Reconnect {
                id,
                rank: Rank(new_rank as u32),
                generation,
                slots,
                reply,
            };
            ask(&stage, reconnect, timeout, || {
                format!(
                    "{id} did not join the rebuilt group of generation {}",
                    generation.0
                )
            })
            .await
        });
    }
    while let Some(joined) = joins.join_next().await {
        joined.map_err(|e| Error::Runtime(format!("a reconnect task failed: {e}")))??;
    }
    let mut stages = Vec::with_capacity(n);
    let mut devices = Vec::with_capacity(n);
    for (new_rank, (stage, device)) in members.into_iter().enumerate() {
        let id = StageId {
            replica: new_rank as u32,
            stage: 0,
            tp: 0,
        };
        stages.push((stage, id));
        devices.push(device);
    }
    state.members.stages = stages;
    state.members.devices = devices;
    state.members.generation = generation;
    state.members.layout = Layout::data_parallel(n as u32)?;
    Ok(())
}

/// A device for a replica or stage that joins a running job: a spare of the builder's list,
/// else a new logical device of the same backend, with its actor started.
pub(super) async fn start_device<M, I>(
    state: &mut SupervisorState<M, I>,
) -> Result<(MeshDevice, ActorRef<DeviceMsg>)>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let device = match state.members.spare_devices.pop() {
        Some(d) => d,
        None => {
            state.members.next_device_id += 1;
            let like = &state.members.device_template;
            MeshDevice::from_burn(
                DeviceId(state.members.next_device_id),
                like.kind(),
                like.burn().clone(),
            )
        }
    };
    let (device_ref, _) =
        Actor::spawn_linked(None, DeviceActor, device.clone(), state.myself.clone())
            .await
            .map_err(|e| Error::Runtime(format!("could not start device {}: {e}", device.id())))?;
    Ok((device, device_ref))
}

/// A new data-parallel replica at rank `r`: a device (a spare of the builder's list, else a
/// new logical device of the same backend), its actor, and an initialized stage alone in a
/// group of one until everyone regroups.
pub(super) async fn spawn_replica<M, I>(
    state: &mut SupervisorState<M, I>,
    r: usize,
) -> Result<Member<M>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(grow) = state.members.grow.clone() else {
        return Err(Error::InvalidConfig(
            "this job cannot start replicas".into(),
        ));
    };
    let id = StageId {
        replica: r as u32,
        stage: 0,
        tp: 0,
    };
    let (stage, device) = match grow {
        Grow::Local(grow) => {
            let (device, device_ref) = start_device(state).await?;
            let comm = LocalGroup::new(1, state.members.generation, state.members.comm.clone())
                .communicators()
                .remove(0);
            let stage = grow(GrowArgs {
                supervisor: state.myself.clone(),
                id,
                rank: Rank(r as u32),
                device: device.clone(),
                device_actor: device_ref.clone(),
                comm,
            })
            .await
            .map_err(|e| Error::Runtime(format!("could not start {id}: {e}")))?;
            (stage, (device_ref, device.id()))
        }
        Grow::Remote { start: grow, .. } => grow(RemoteGrowArgs {
            supervisor: state.myself.clone(),
            id,
        })
        .await
        .map_err(|e| Error::Runtime(format!("could not start {id}: {e}")))?,
    };
    if let Err(e) = ask(&stage, StageMsg::Init, state.clock.step_timeout, || {
        format!("{id} did not initialize")
    })
    .await
    {
        // Linked to the Supervisor: departed, so their ends are not read as a failure.
        state.members.departed.insert(stage.get_id());
        state.members.departed.insert(device.0.get_id());
        stage.stop(None);
        device.0.stop(None);
        return Err(e);
    }
    Ok((stage, device))
}

/// Hand each rank of a rewired mesh that has wiring (`survivors`, by rank: the stages that
/// stay) its rank, links and communicators (`StageMsg::Rewire`), one after the other;
/// `stages` are the mesh's stages by rank, in the rewired layout.
pub(super) async fn rewire_survivors<M: Send + 'static>(
    stages: &[(ActorRef<StageMsg<M>>, StageId)],
    survivors: Vec<Option<SurvivorWiring>>,
    timeout: std::time::Duration,
) -> Result<()> {
    for (r, wiring) in survivors.into_iter().enumerate() {
        let (Some((links, comm, model)), Some((stage, id))) = (wiring, stages.get(r)) else {
            continue;
        };
        let rewire = |reply| StageMsg::Rewire {
            rank: Rank(r as u32),
            links,
            comm,
            model: Box::new(model),
            reply,
        };
        ask(stage, rewire, timeout, || {
            format!("{id} did not take its new wiring")
        })
        .await?;
    }
    Ok(())
}
