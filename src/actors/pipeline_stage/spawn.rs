//! Starting a pipeline job's stages in this process: each replica's links, one data-parallel
//! group per stage index and one tensor-parallel group per block position (`LocalPipeline`, the
//! in-process `Spawner`), and the same wiring again under a new generation (`rewire`).

use super::*;

/// One rank's wiring: links to its pipeline's other stages, the communicator of its
/// data-parallel group (none at dp = 1) and its model's groups (tensor-parallel, replica).
pub(super) type RankWiring = (StageLinks, Option<Communicator>, ModelGroups);

/// A mesh's wiring under one generation: per rank its links and communicators, the
/// collective groups' actors, and how to wake everything blocked in it.
pub(super) struct Wiring {
    pub(super) per_rank: Vec<Option<RankWiring>>,
    pub(super) others: Vec<ractor::ActorCell>,
    pub(super) shutdown: Arc<dyn Fn() + Send + Sync>,
}

/// One collective group of `ranks` (in group order) under `generation`, watched by a
/// [`GroupActor`]: its communicators in the same order.
pub(super) async fn group_of(
    ranks: Vec<Rank>,
    comm: &crate::comm::CommConfig,
    generation: Generation,
    supervisor: &ractor::ActorCell,
    groups: &mut Vec<Arc<LocalGroup>>,
    others: &mut Vec<ractor::ActorCell>,
) -> Result<Vec<Communicator>, ActorProcessingErr> {
    let group = LocalGroup::new(ranks.len(), generation, comm.clone());
    groups.push(group.clone());
    let comms = group.communicators();
    let (g, _) = Actor::spawn_linked(
        None,
        GroupActor,
        GroupArgs {
            members: ranks,
            group,
        },
        supervisor.clone(),
    )
    .await?;
    others.push(g.get_cell());
    Ok(comms)
}

/// Wire a dp × pp × tp mesh: every (replica, tensor-parallel rank)'s pipeline connected by
/// its own links, every (stage, tensor-parallel rank)'s replicas in one data-parallel group,
/// every (replica, stage)'s tensor-parallel ranks in one tensor-parallel group, and every
/// replica's pp × tp ranks in one model group (when there are several), all of
/// `generation`.
pub(super) async fn wire<I>(
    spec: &PipelineSpec<I>,
    layout: Layout,
    comm: &crate::comm::CommConfig,
    generation: Generation,
    supervisor: &ractor::ActorCell,
) -> Result<Wiring, ActorProcessingErr> {
    let (dp, tp) = (layout.dp(), layout.tp());
    let abort = Arc::new(AtomicBool::new(false));
    let mut per_rank: Vec<Option<RankWiring>> = Vec::new();
    // Links: one pipeline per (replica, tensor-parallel rank).
    let mut links_of: std::collections::HashMap<(u32, u32), Vec<Option<StageLinks>>> =
        std::collections::HashMap::new();
    for replica in 0..dp {
        for t in 0..tp {
            // A link is point-to-point communication: bounded like a collective.
            let l = links(&spec.plan, comm.timeout, abort.clone())
                .into_iter()
                .map(Some)
                .collect();
            links_of.insert((replica, t), l);
        }
    }
    let mut groups = Vec::new();
    let mut others = Vec::new();
    // One data-parallel group per (stage, tp rank), one tensor-parallel group per
    // (replica, stage): the layout's own groups, each in group order.
    let dp_groups = if dp > 1 {
        layout.data_parallel_groups()
    } else {
        Vec::new()
    };
    let tp_groups: Vec<Vec<Rank>> = if tp > 1 {
        layout
            .ranks()
            .filter(|&r| layout.coord_of(r).is_some_and(|c| c.tp == 0))
            .filter_map(|r| layout.tensor_parallel_group(r))
            .collect()
    } else {
        Vec::new()
    };
    // One model group per replica: what the step agrees on over its stages and tp ranks.
    let replica_groups: Vec<Vec<Rank>> = if layout.pp() * tp > 1 {
        (0..dp)
            .map(|replica| {
                layout
                    .ranks()
                    .filter(|&r| layout.coord_of(r).is_some_and(|c| c.dp == replica))
                    .collect()
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut comms: [std::collections::HashMap<Rank, Communicator>; 3] = Default::default();
    for (kind, members) in dp_groups
        .into_iter()
        .map(|g| (0, g))
        .chain(tp_groups.into_iter().map(|g| (1, g)))
        .chain(replica_groups.into_iter().map(|g| (2, g)))
    {
        let made = group_of(
            members.clone(),
            comm,
            generation,
            supervisor,
            &mut groups,
            &mut others,
        )
        .await?;
        comms[kind].extend(members.into_iter().zip(made));
    }
    let [mut dp_comm, mut tp_comm, mut replica_comm] = comms;
    for rank in layout.ranks() {
        let w = layout.coord_of(rank).and_then(|c| {
            let links = links_of
                .get_mut(&(c.dp, c.tp))?
                .get_mut(c.pp as usize)?
                .take()?;
            let model = ModelGroups {
                tp: tp_comm.remove(&rank),
                replica: replica_comm.remove(&rank),
            };
            Some((links, dp_comm.remove(&rank), model))
        });
        per_rank.push(w);
    }
    Ok(Wiring {
        per_rank,
        others,
        shutdown: Arc::new(move || {
            abort.store(true, std::sync::atomic::Ordering::Relaxed);
            for g in &groups {
                g.shutdown();
            }
        }),
    })
}

/// Start the stage actor of `rank` with its wiring.
pub(super) async fn spawn_stage<I: Send + Sync + 'static>(
    spec: &Arc<PipelineSpec<I>>,
    layout: Layout,
    rank: Rank,
    (device, device_ref): (&MeshDevice, &ActorRef<DeviceMsg>),
    wiring: Option<RankWiring>,
    supervisor: &ractor::ActorCell,
) -> Result<(ActorRef<StageMsg<PipelineModel>>, StageId), ActorProcessingErr> {
    let coord = layout
        .coord_of(rank)
        .ok_or_else(|| format!("rank {rank} is outside the mesh {layout:?}"))?;
    let id = StageId {
        replica: coord.dp,
        stage: coord.pp,
        tp: coord.tp,
    };
    let (links, comm, model) = wiring.map_or((None, None, ModelGroups::default()), |(l, c, m)| {
        (Some(l), c, m)
    });
    let args = PipelineStageArgs {
        id,
        rank,
        tp_rank: coord.tp,
        device: device.clone(),
        device_actor: device_ref.clone(),
        spec: spec.clone(),
        links,
        comm,
        model,
    };
    let (a, _) = Actor::spawn_linked(
        None,
        PipelineStageActor::<I>::default(),
        args,
        supervisor.clone(),
    )
    .await?;
    Ok((a, id))
}

/// Starts the stage actor `id` (rank `rank`, tensor-parallel rank `id.tp`) of a job whose
/// ranks live in several processes, with its links, data-parallel communicator and model
/// groups already made (not linked to a Supervisor: the head drives it through a proxy).
#[cfg(feature = "cluster")]
pub(crate) async fn spawn_unlinked<I: Send + Sync + 'static>(
    spec: Arc<PipelineSpec<I>>,
    (id, rank): (StageId, Rank),
    (device, device_actor): (MeshDevice, ActorRef<DeviceMsg>),
    links: StageLinks,
    (comm, model): (Option<Communicator>, ModelGroups),
) -> Result<ActorRef<StageMsg<PipelineModel>>, ractor::SpawnErr> {
    let args = PipelineStageArgs {
        id,
        rank,
        tp_rank: id.tp,
        device,
        device_actor,
        spec,
        links: Some(links),
        comm,
        model,
    };
    let (a, _) = Actor::spawn(None, PipelineStageActor::<I>::default(), args).await?;
    Ok(a)
}

/// The spawner of an in-process dp × pp pipeline: one stage actor per rank, every replica's
/// stages connected by their own links, every stage index's replicas in one collective
/// group; a lost stage is replaced by a fresh one and the mesh rewired (REC-6).
pub(crate) struct LocalPipeline<I> {
    pub(crate) spec: Arc<PipelineSpec<I>>,
}

impl<I> Spawner<PipelineModel> for LocalPipeline<I>
where
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> Capabilities {
        // A tensor-parallel rank's twins are the same (stage, tensor-parallel rank) of the
        // other replicas: the Supervisor pairs them by place.
        Capabilities::pipeline(self.spec.keeping(), None, self.spec.plan.micro_batches())
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<PipelineModel> {
        let spec = self.spec;
        Box::pin(async move {
            let pp = cx.layout.pp();
            let mut wiring =
                wire(&spec, cx.layout, &cx.comm, Generation(0), &cx.supervisor).await?;
            let mut stages = Vec::new();
            for (rank, (device, device_ref)) in cx.layout.ranks().zip(&cx.devices) {
                let w = wiring.per_rank[rank.index()].take();
                stages.push(
                    spawn_stage(
                        &spec,
                        cx.layout,
                        rank,
                        (device, device_ref),
                        w,
                        &cx.supervisor,
                    )
                    .await?,
                );
            }
            // Replica 0's stages, every tensor-parallel rank of each (TP-3).
            let tp = cx.layout.tp();
            let model_ranks = (0..pp)
                .flat_map(|stage| (0..tp).map(move |t| (stage, t)))
                .filter_map(|(stage, t)| {
                    cx.layout.rank_of(Coord {
                        dp: 0,
                        pp: stage,
                        tp: t,
                    })
                })
                .map(Rank::index)
                .collect();
            let rewire_spec = spec.clone();
            let rewire: RewireStages<PipelineModel> = Arc::new(move |a: RewireArgs| {
                let spec = rewire_spec.clone();
                Box::pin(async move {
                    let mut wiring =
                        wire(&spec, a.layout, &a.comm, a.generation, &a.supervisor).await?;
                    let mut fresh = Vec::new();
                    for &r in &a.fresh {
                        let rank = Rank(r as u32);
                        let Some((device, device_ref)) = a.devices.get(r).and_then(Option::as_ref)
                        else {
                            return Err(format!("no device for the fresh rank {r}").into());
                        };
                        let w = wiring.per_rank[r].take();
                        let (stage, _) = spawn_stage(
                            &spec,
                            a.layout,
                            rank,
                            (device, device_ref),
                            w,
                            &a.supervisor,
                        )
                        .await?;
                        fresh.push((r, stage));
                    }
                    Ok(Rewired {
                        fresh,
                        survivors: wiring
                            .per_rank
                            .into_iter()
                            .map(|w| w.map(|(l, c, m)| (Box::new(l), c, m)))
                            .collect(),
                        others: wiring.others,
                        shutdown: wiring.shutdown,
                        devices: Vec::new(),
                    })
                }) as _
            });
            Ok(Spawned {
                stages,
                shutdown: wiring.shutdown,
                others: wiring.others,
                model_ranks,
                assemble: PipelineModel::merge,
                grow: None,
                rewire: Some(rewire),
                devices: None,
            })
        })
    }
}
