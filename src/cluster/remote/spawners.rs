//! Spawning a cluster job's ranks: `ClusterReplicas` and `ClusterPipeline` start every slot
//! through its process and put a proxy on the head for each; `Proxies` grows the world onto
//! slots that join (REMOTE-5) and rewires survivors after a recovery.

use super::*;
use crate::cluster::control::PipelineListeners;

/// The spawner of a data-parallel job across processes (`JobBuilder::cluster`): starts every
/// slot's stage where it lives (all at once: each waits for the others while it joins the
/// data plane), then a proxy pair per slot on the head. After a change the members reconnect
/// their own data plane; the job grows onto slots of nodes that join it (REMOTE-5).
pub(crate) struct ClusterReplicas<M, I> {
    pub(crate) mesh: ClusterMesh,
    pub(crate) spec: Arc<StageSpec<M, I>>,
}

impl<M, I> Spawner<M> for ClusterReplicas<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> Capabilities {
        Capabilities::data_parallel(
            crate::actors::spawner::StateKeeping::of(self.spec.keeping()),
            Rejoin::Reconnect,
        )
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<M> {
        let ClusterReplicas { mesh, spec } = *self;
        let faults = spec.faults.clone();
        let device = mesh.model_device.burn().clone();
        let rebuild: Rebuild<M> = Arc::new(move |id: StageId, shards: Vec<ShardSnapshot>| {
            let shard = shards
                .into_iter()
                .next()
                .ok_or_else(|| format!("the snapshot of {id} has no shard"))?;
            let cx = ModelContext {
                rank: Rank(id.replica),
                device: device.clone(),
            };
            restore_module((spec.model_fn)(&cx), &shard.params)
                .map_err(|e| format!("the model of {id} does not restore: {e}"))
        });
        let world = mesh.world_size() as u32;
        Box::pin(async move {
            let shape = Shape {
                layout: Layout::data_parallel(world)?,
                pipelined: false,
                faults,
                rebuild,
                model_ranks: vec![0],
                assemble: |mut models: Vec<M>| models.pop(),
                server: None,
            };
            mesh.spawn_all(shape, cx)
                .await
                .map_err(ActorProcessingErr::from)
        })
    }
}

/// The spawner of a dp × pp job across processes: every slot starts its device and
/// pipeline-link listener, then (once all listen) joins its groups and starts its stage
/// (REMOTE-4); a lost stage is started again on a waiting slot and the mesh rewired
/// (REMOTE-7).
pub(crate) struct ClusterPipeline<I> {
    pub(crate) mesh: ClusterMesh,
    pub(crate) spec: Arc<PipelineSpec<I>>,
    pub(crate) layout: Layout,
}

impl<I> Spawner<PipelineModel> for ClusterPipeline<I>
where
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> Capabilities {
        Capabilities::pipeline(
            self.spec.keeping(),
            Some("a block or pipeline job across processes cannot be resized yet"),
            self.spec.plan.micro_batches(),
        )
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<PipelineModel> {
        let ClusterPipeline { mesh, spec, layout } = *self;
        let faults = spec.faults.clone();
        let rebuild = pipeline::rebuild_blocks(spec, mesh.model_device.burn().clone(), layout.tp());
        Box::pin(async move {
            // Replica 0's stages, every tensor-parallel rank of each (TP-3).
            let model_ranks = (0..layout.pp())
                .flat_map(|pp| (0..layout.tp()).map(move |tp| Coord { dp: 0, pp, tp }))
                .filter_map(|c| layout.rank_of(c))
                .map(Rank::index)
                .collect();
            let shape = Shape {
                layout,
                pipelined: true,
                faults,
                rebuild,
                model_ranks,
                assemble: PipelineModel::merge,
                server: None,
            };
            mesh.spawn_all(shape, cx)
                .await
                .map_err(ActorProcessingErr::from)
        })
    }
}

/// Sends each `(slot, endpoint, op)` at once and collects the answers, in the order asked;
/// a failure or a missing answer is the error.
pub(super) async fn ask_each(
    asks: Vec<(Rank, Endpoint, StageOp)>,
    timeout: Duration,
) -> Result<Vec<StageAnswer>> {
    let mut tasks = tokio::task::JoinSet::new();
    let n = asks.len();
    for (i, (slot, endpoint, op)) in asks.into_iter().enumerate() {
        tasks.spawn(async move {
            let kind = op.kind();
            let answer = endpoint.call(slot, op, timeout).await;
            (i, slot, kind, endpoint.name(), answer)
        });
    }
    let mut answers: Vec<Option<StageAnswer>> = vec![None; n];
    while let Some(asked) = tasks.join_next().await {
        let (i, slot, kind, name, answer) =
            asked.map_err(|e| Error::Runtime(format!("a request task failed: {e}")))?;
        match answer {
            Ok(StageAnswer::Failed(e)) => return Err(e.into_error(&name)),
            Ok(answer) => answers[i] = Some(answer),
            Err(why) => {
                return Err(Error::Runtime(format!(
                    "{name} did not answer {kind} for rank {}: {why}",
                    slot.0
                )));
            }
        }
    }
    Ok(answers.into_iter().flatten().collect())
}

/// What the head's proxies of a job share.
pub(super) struct Proxies<M> {
    pub(super) slots: Arc<Mutex<MeshSlots>>,
    pub(super) rebuild: Rebuild<M>,
    /// The newest generation a group was formed under (REMOTE-3).
    pub(super) generation: Arc<AtomicU64>,
    pub(super) wait: Duration,
    /// The job's fault plan on the head (FAULT-3).
    pub(super) faults: Option<Arc<crate::faults::FaultHooks>>,
}

impl<M: Send + 'static> Proxies<M> {
    /// The proxies of `slot`'s stage (as `id`) and device, linked to the Supervisor.
    pub(super) async fn spawn(
        &self,
        slot: Rank,
        id: StageId,
        endpoint: Endpoint,
        supervisor: &ractor::ActorCell,
    ) -> Result<Grown<M>> {
        let device = DeviceId(slot.0);
        let (device_ref, _) = Actor::spawn_linked(
            None,
            RemoteDevice,
            RemoteDeviceArgs {
                slot,
                device,
                endpoint: endpoint.clone(),
            },
            supervisor.clone(),
        )
        .await
        .map_err(|e| Error::Runtime(format!("cannot start a device proxy: {e}")))?;
        let (stage_ref, _) = Actor::spawn_linked(
            None,
            RemoteStage::<M>::default(),
            RemoteStageArgs {
                slot,
                id,
                device,
                endpoint,
                slots: self.slots.clone(),
                rebuild: self.rebuild.clone(),
                generation: self.generation.clone(),
                wait: self.wait,
                faults: self.faults.clone(),
            },
            supervisor.clone(),
        )
        .await
        .map_err(|e| Error::Runtime(format!("cannot start a stage proxy: {e}")))?;
        Ok((stage_ref, (device_ref, device)))
    }

    /// Starts the oldest waiting slot (a node that joined the running job) as `id`, with
    /// `start`; one that does not start (its node died meanwhile) is dropped and the next is
    /// tried. The slot, its endpoint and its answer; no waiting slot is an error.
    pub(super) async fn start_waiting(
        &self,
        id: StageId,
        start: StageOp,
        expect: fn(&StageAnswer) -> bool,
        timeout: Duration,
    ) -> Result<(Rank, Endpoint, StageAnswer)> {
        let mut failures = Vec::new();
        loop {
            let next = {
                let mut slots = lock(&self.slots);
                slots.waiting.pop_front().and_then(|slot| {
                    slots
                        .endpoints
                        .get(slot.index())
                        .cloned()
                        .map(|e| (slot, e))
                })
            };
            let Some((slot, endpoint)) = next else {
                return Err(Error::InvalidConfig(format!(
                    "no node is waiting to join the job for {id} (a job across processes grows, \
                     and replaces a lost node or stage, only onto nodes that joined it){}",
                    if failures.is_empty() {
                        String::new()
                    } else {
                        format!("; waiting ones failed: {}", failures.join("; "))
                    }
                )));
            };
            let name = endpoint.name();
            match endpoint.call(slot, start.clone(), timeout).await {
                Ok(answer) if expect(&answer) => return Ok((slot, endpoint, answer)),
                Ok(StageAnswer::Failed(e)) => failures.push(e.into_error(&name).to_string()),
                Ok(other) => {
                    failures.push(format!("{name} answered Start with {}", other.kind()));
                }
                Err(why) => failures.push(format!("{name} could not start: {why}")),
            }
        }
    }

    /// REMOTE-5: a replica added to the running job takes the oldest waiting slot (a node
    /// that joined): its stage starts alone, the Supervisor restores rank 0's state into it
    /// and reconnects everyone. No waiting slot, or a joiner that does not start, is an error
    /// (the resize is refused; the slot is not offered again).
    pub(super) fn grower(self, timeout: Duration) -> GrowRemote<M> {
        let proxies = Arc::new(self);
        Arc::new(move |g: RemoteGrowArgs| {
            let proxies = proxies.clone();
            Box::pin(async move {
                let start = StageOp::Start {
                    id: g.id,
                    alone: true,
                    server: None,
                };
                let done = |a: &StageAnswer| matches!(a, StageAnswer::Done);
                let (slot, endpoint, _) = proxies.start_waiting(g.id, start, done, timeout).await?;
                Ok(proxies.spawn(slot, g.id, endpoint, &g.supervisor).await?)
            })
        })
    }

    /// REC-6 across processes (REMOTE-7): each lost rank of a pipeline job is replaced by the
    /// stage of a waiting slot (a node that joined the running job), started as the lost
    /// rank's stage; then every rank of the mesh is wired under the new generation at once
    /// (`Wire`: survivors shut their old links and group and take new ones, the fresh stages
    /// start). The Supervisor then copies each twin's state into its replacement.
    pub(super) fn rewirer(
        self,
        layout: Layout,
        links: Vec<Option<PipelineListeners>>,
        shutdown: Arc<dyn Fn() + Send + Sync>,
        timeout: Duration,
    ) -> RewireStages<M> {
        let proxies = Arc::new(self);
        let links = Arc::new(Mutex::new(links));
        Arc::new(move |a: RewireArgs| {
            let (proxies, links, shutdown) = (proxies.clone(), links.clone(), shutdown.clone());
            Box::pin(async move {
                // REMOTE-3: aborts from now on are for the new wiring.
                proxies.generation.store(a.generation.0, Ordering::SeqCst);
                let mut slot_of: Vec<Rank> = a.slots.iter().map(|d| Rank(d.0)).collect();
                let mut fresh = Vec::new();
                for &r in &a.fresh {
                    let id = pipeline::stage_id(layout, Rank(r as u32))
                        .ok_or_else(|| Error::Runtime(format!("rank {r} is outside {layout:?}")))?;
                    let start = StageOp::Start {
                        id,
                        alone: false,
                        server: None,
                    };
                    let listening = |a: &StageAnswer| matches!(a, StageAnswer::Listening(_));
                    let (slot, endpoint, answer) =
                        proxies.start_waiting(id, start, listening, timeout).await?;
                    if let StageAnswer::Listening(heard) = answer {
                        let mut links = lock_links(&links);
                        if links.len() <= slot.index() {
                            links.resize(slot.index() + 1, None);
                        }
                        links[slot.index()] = Some(heard);
                    }
                    if let Some(s) = slot_of.get_mut(r) {
                        *s = slot;
                    }
                    fresh.push((r, slot, id, endpoint));
                }
                let (endpoints, addrs) = {
                    let s = lock(&proxies.slots);
                    (s.endpoints.clone(), s.addrs.clone())
                };
                let ops =
                    pipeline::wire_ops(layout, &slot_of, &addrs, &lock_links(&links), a.generation)
                        .map_err(Error::Runtime)?;
                let asks = slot_of
                    .iter()
                    .zip(ops)
                    .map(|(&slot, op)| {
                        let endpoint = endpoints.get(slot.index()).cloned().ok_or_else(|| {
                            Error::Runtime(format!("no node holds slot {}", slot.0))
                        })?;
                        Ok((slot, endpoint, op))
                    })
                    .collect::<Result<Vec<_>>>()?;
                ask_each(asks, timeout).await?;
                let mut stages = Vec::new();
                let mut devices = Vec::new();
                for (r, slot, id, endpoint) in fresh {
                    let (stage, device) = proxies.spawn(slot, id, endpoint, &a.supervisor).await?;
                    stages.push((r, stage));
                    devices.push((r, device));
                }
                Ok(Rewired {
                    fresh: stages,
                    survivors: slot_of.iter().map(|_| None).collect(),
                    others: Vec::new(),
                    shutdown,
                    devices,
                })
            }) as _
        })
    }
}

pub(super) fn lock_links(
    links: &Mutex<Vec<Option<PipelineListeners>>>,
) -> std::sync::MutexGuard<'_, Vec<Option<PipelineListeners>>> {
    links.lock().unwrap_or_else(|e| e.into_inner())
}
