//! The spawner of in-process data-parallel replicas (`.model(..)` jobs in one process): the
//! host side of the replica role (`stage::replica`), one collective group of every rank.

use std::sync::Arc;

use burn::module::Module;
use ractor::Actor;

use super::{
    Capabilities, Grow, GrowArgs, GrowStage, Rejoin, SpawnContext, SpawnFuture, Spawned, Spawner,
    StateKeeping,
};
use crate::actors::group::{GroupActor, GroupArgs};
use crate::actors::stage::{StageActor, StageArgs, StageSpec};
use crate::comm::LocalGroup;
use crate::mesh::{Generation, Rank, StageId};

/// The spawner of in-process data-parallel replicas: one replica per rank, all in one
/// collective group, regrouped in this process after a change; a job grows onto devices of
/// this process.
pub(crate) struct LocalReplicas<M, I> {
    pub(crate) spec: Arc<StageSpec<M, I>>,
}

impl<M, I> Spawner<M> for LocalReplicas<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> Capabilities {
        Capabilities::data_parallel(StateKeeping::of(self.spec.keeping()), Rejoin::Regroup)
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<M> {
        let spec = self.spec;
        Box::pin(async move {
            let world = cx.layout.world_size() as usize;
            let group = LocalGroup::new(world, Generation(0), cx.comm.clone());
            let local_group = group.clone();
            let comms = group.communicators();
            let members: Vec<Rank> = cx.layout.ranks().collect();
            let (group_ref, _) = Actor::spawn_linked(
                None,
                GroupActor,
                GroupArgs {
                    members: members.clone(),
                    group,
                },
                cx.supervisor.clone(),
            )
            .await?;
            let mut stages = Vec::with_capacity(world);
            for ((rank, comm), (device, device_ref)) in members.iter().zip(comms).zip(&cx.devices) {
                let coord = cx
                    .layout
                    .coord_of(*rank)
                    .expect("rank inside its own layout");
                let id = StageId {
                    replica: coord.dp,
                    stage: coord.pp,
                    tp: 0,
                };
                let (r, _) = Actor::spawn_linked(
                    None,
                    StageActor::<M, I>::default(),
                    StageArgs {
                        id,
                        rank: *rank,
                        device: device.clone(),
                        device_actor: device_ref.clone(),
                        comm,
                        spec: spec.clone(),
                    },
                    cx.supervisor.clone(),
                )
                .await?;
                stages.push((r, id));
            }
            Ok(Spawned {
                stages,
                shutdown: Arc::new(move || local_group.shutdown()),
                others: vec![group_ref.get_cell()],
                model_ranks: vec![0],
                assemble: |mut models: Vec<M>| models.pop(),
                grow: Some(Grow::Local(grow_replica(spec))),
                rewire: None,
                devices: None,
            })
        })
    }
}

/// Spawns the stage actor of a replica that joins a running job.
fn grow_replica<M, I>(spec: Arc<StageSpec<M, I>>) -> GrowStage<M>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    Arc::new(move |g: GrowArgs| {
        let spec = spec.clone();
        Box::pin(async move {
            let (r, _) = Actor::spawn_linked(
                None,
                StageActor::<M, I>::default(),
                StageArgs {
                    id: g.id,
                    rank: g.rank,
                    device: g.device,
                    device_actor: g.device_actor,
                    comm: g.comm,
                    spec,
                },
                g.supervisor,
            )
            .await?;
            Ok(r)
        })
    })
}
