//! Training across processes: the Supervisor on the head drives stages that live in other
//! processes through proxies, and each process serves its own stages.
//!
//! ```text
//! head process                                   node process (and the head's own devices)
//! Supervisor ─ RemoteStage ×N (StageMsg) ─┐      NodeAgent ─► NodeStages (StageHost)
//!            └ RemoteDevice ×N (DeviceMsg)┘──────►   per slot: DeviceActor + StageActor
//!                 (control plane: StageRequest)       with a TCP Communicator (data plane)
//! ```
//!
//! - Every rank of a cluster job is a proxy on the head: a `RemoteStage` answers the
//!   Supervisor's `StageMsg`s by sending [`StageOp`]s to the process that holds the rank, and
//!   a `RemoteDevice` answers its heartbeats. The head's own devices are served by the same
//!   `NodeStages` in the head's process, without the network: one code path for every rank.
//! - A node builds its stages with the same [`crate::job::JobBuilder`] code as the head
//!   ([`crate::job::JobBuilder::stage_host`]), so a stage on a node trains exactly as a
//!   stage in the head's process would; gradients meet over the TCP data plane
//!   (`comm::tcp`), never over the control plane.
//! - Parameters cross the control plane only for snapshots, restores and the trained model,
//!   as checkpoint shards (CRC-checked on arrival) under the control message limit.
//!
//! # Invariants
//!
//! - **REMOTE-1** a slot is a rank of the world as assembled (generation 0); its device id is
//!   `DeviceId(slot)`, so after a recovery the Supervisor names the members of a rebuilt group
//!   by their slots (`StageMsg::Reconnect`).
//! - **REMOTE-2** a node that cannot be reached (its process died, its session closed) makes
//!   every request to its stages fail at once with `Error::StageLost` naming the stage and the
//!   node: the Supervisor's recovery treats it as a lost device. A peer's broken data-plane
//!   link (`CommError::Link`) names the lost rank too.
//! - **REMOTE-3** an abort (the Supervisor's RT-4 shutdown) carries the generation it is for:
//!   a node ignores an abort older than its slot's group, so a late abort never breaks the
//!   group a recovery just formed.
//! - **REMOTE-4** (dp × pp, `pipeline`) a pipeline slot starts in two phases and keeps its
//!   pipeline links on a listener of their own.
//! - **REMOTE-5** the world only grows: a node that joins the running job brings the next
//!   slots, and the job grows onto them (or a roll-back replaces a lost replica with one).
//! - **REMOTE-6** parameters of any size cross the control plane: a snapshot or restore over
//!   [`PART_BYTES`] moves in parts, each message under the control message limit.
//! - **REMOTE-7** (REC-6 across processes) a lost pipeline stage is started again on a
//!   waiting slot (a node that joined the running job) and every rank is wired anew under the
//!   next generation at once (`pipeline::wire_ops`); a survivor that takes the new wiring
//!   ignores aborts of older generations from then on.

use std::collections::HashMap;
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::module::Module;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::control::{
    HostArgs, NodeHandle, PART_BYTES, ProcessIndex, ProcessPlan, RemoteError, StageAnswer,
    StageHost, StageOp, StageRequest, World, join_shards, split_shards,
};
use crate::actors::device::{DeviceActor, DeviceMsg, heartbeat};
use crate::actors::pipeline_stage::PipelineSpec;
use crate::actors::spawner::{Capabilities, Rejoin, SpawnFuture, Spawner};
use crate::actors::stage::{InitReport, StageActor, StageArgs, StageMsg, StageSpec};
use crate::actors::supervisor::{
    Grow, GrowRemote, Grown, RemoteGrowArgs, RewireArgs, RewireStages, Rewired, SpawnContext,
    Spawned,
};
use crate::checkpoint::{ShardSnapshot, restore_module};
use crate::comm::hierarchical::HierarchyPlan;
use crate::comm::net::link::{JobToken, LinkCloser, LinkListener};
use crate::comm::tcp::{TcpConfig, TcpGroup, TcpShutdown};
use crate::comm::{Communicator, LocalGroup};
use crate::device::{BackendKind, MeshDevice};
use crate::error::{Error, Result};
use crate::mesh::{Coord, Generation, Layout, Rank};
use crate::mesh::{DeviceId, StageId};
use crate::parallel::ModelContext;
use crate::parallel::pipeline::PipelineSchedule;
use crate::parallel::pipeline_exec::{StageLinks, remote_links};
use crate::parallel::stages::PipelineModel;

pub(crate) mod pipeline;

/// How the head rebuilds a stage's trained model from the snapshot its process sends.
pub(crate) type Rebuild<M> =
    Arc<dyn Fn(StageId, Vec<ShardSnapshot>) -> std::result::Result<M, String> + Send + Sync>;

/// A started stage actor, or why not.
pub(crate) type SlotFuture<M> =
    Pin<Box<dyn Future<Output = std::result::Result<ActorRef<StageMsg<M>>, String>> + Send>>;

/// What a slot's stage actor starts with.
pub(crate) struct SlotStart {
    pub(crate) id: StageId,
    /// The slot (its rank in the world).
    pub(crate) rank: Rank,
    pub(crate) device: MeshDevice,
    pub(crate) device_actor: ActorRef<DeviceMsg>,
    /// Its data-parallel group's communicator (none in a pipeline job with one replica).
    pub(crate) comm: Option<Communicator>,
    /// Its pipeline links (pipeline jobs).
    pub(crate) links: Option<StageLinks>,
}

/// Members' communicators of in-process groups being formed, by (generation, members).
type LocalGroups = HashMap<(u64, Vec<u32>), Vec<Option<Communicator>>>;

/// What a process's slots run: data-parallel replicas or pipeline stages.
pub(crate) trait SlotFactory<M>: Send + Sync + 'static {
    /// The job's schedule, if it is a pipeline job (REMOTE-4).
    fn pipeline(&self) -> Option<Arc<PipelineSchedule>>;
    /// Starts a slot's stage actor.
    fn spawn(&self, start: SlotStart) -> SlotFuture<M>;
}

/// The slots of a data-parallel job: each an ordinary [`StageActor`].
pub(crate) struct ReplicaSlots<M, I>(pub(crate) Arc<StageSpec<M, I>>);

impl<M, I> SlotFactory<M> for ReplicaSlots<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    fn pipeline(&self) -> Option<Arc<PipelineSchedule>> {
        None
    }

    fn spawn(&self, start: SlotStart) -> SlotFuture<M> {
        let spec = self.0.clone();
        Box::pin(async move {
            let comm = start
                .comm
                .ok_or_else(|| format!("{}: no data-parallel group", start.id))?;
            let args = StageArgs {
                id: start.id,
                rank: start.rank,
                device: start.device,
                device_actor: start.device_actor,
                comm,
                spec,
            };
            Actor::spawn(None, StageActor::<M, I>::default(), args)
                .await
                .map(|(a, _)| a)
                .map_err(|e| format!("cannot start {}: {e}", start.id))
        })
    }
}

/// The head's side of a job's shape: where each rank sits, how its model comes back.
struct Shape<M> {
    layout: Layout,
    /// Slots start in two phases (REMOTE-4).
    pipelined: bool,
    rebuild: Rebuild<M>,
    model_ranks: Vec<usize>,
    assemble: fn(Vec<M>) -> Option<M>,
}

/// How much longer than the time-out a request carries the head waits for its answer (the
/// node's own bound fires first, with its diagnosis).
const ANSWER_MARGIN: Duration = Duration::from_secs(2);

/// How long a device heartbeat of another process may take.
const HEARTBEAT_WAIT: Duration = Duration::from_secs(2);

/// Where the stage of one slot lives.
#[derive(Clone)]
enum Endpoint {
    /// In the head's own process.
    Local(Arc<dyn StageHost>),
    /// In a node's process, reached over the control plane.
    Node(NodeHandle),
}

impl Endpoint {
    fn name(&self) -> String {
        match self {
            Endpoint::Local(_) => "the head".into(),
            Endpoint::Node(n) => format!("node {}", n.name()),
        }
    }

    /// Sends `op` for `slot` and waits at most `timeout` (plus a margin). A node that cannot
    /// be reached is `Err` with why (REMOTE-2).
    async fn call(
        &self,
        slot: Rank,
        op: StageOp,
        timeout: Duration,
    ) -> std::result::Result<StageAnswer, String> {
        let request = StageRequest {
            slot,
            timeout_ms: timeout.as_millis().min(u128::from(u64::MAX)) as u64,
            op,
        };
        match self {
            Endpoint::Local(host) => {
                tokio::time::timeout(timeout + ANSWER_MARGIN, host.serve(request))
                    .await
                    .map_err(|_| format!("no answer within {:?}", timeout + ANSWER_MARGIN))
            }
            Endpoint::Node(node) => node
                .stage(request, timeout + ANSWER_MARGIN)
                .await
                .map_err(|e| e.to_string()),
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name())
    }
}

/// The ranks of an assembled world and where each one's stage lives: what
/// [`crate::job::JobBuilder::cluster`] trains on.
pub struct ClusterMesh {
    slots: Arc<Mutex<MeshSlots>>,
    /// The device the trained model is assembled on (in the head's process).
    model_device: MeshDevice,
}

/// Every slot of the world, by slot: the world as assembled, then the slots of nodes that
/// joined the running job (REMOTE-5).
#[derive(Debug)]
struct MeshSlots {
    endpoints: Vec<Endpoint>,
    addrs: Vec<SocketAddr>,
    /// Each slot's process (ranks of one process all-reduce hierarchically).
    processes: Vec<u32>,
    /// Slots of nodes that joined the running job and are not replicas yet, oldest first.
    waiting: std::collections::VecDeque<Rank>,
}

fn lock(slots: &Mutex<MeshSlots>) -> std::sync::MutexGuard<'_, MeshSlots> {
    slots.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for ClusterMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterMesh")
            .field("slots", &*lock(&self.slots))
            .finish_non_exhaustive()
    }
}

/// Adds the slots of nodes that join a running job to its [`ClusterMesh`]
/// ([`ClusterMesh::joiner`]); cloneable.
#[derive(Debug, Clone)]
pub struct MeshJoiner {
    slots: Arc<Mutex<MeshSlots>>,
}

impl MeshJoiner {
    /// Adds the ranks `entries` of a node that joined the running job (from
    /// [`super::control::LateNode`]), reached through `node`; they wait until the job grows
    /// onto them (`JobControl::add_replicas`, one replica per rank). The ranks must continue
    /// the world's numbering. Returns how many were added.
    pub fn add(&self, node: NodeHandle, entries: &[super::control::RankEntry]) -> Result<u32> {
        let mut slots = lock(&self.slots);
        for (i, e) in entries.iter().enumerate() {
            let next = slots.endpoints.len() + i;
            if e.rank.index() != next {
                return Err(Error::InvalidConfig(format!(
                    "node {} brings rank {}, but the world's next rank is {next}",
                    node.name(),
                    e.rank.0
                )));
            }
        }
        for e in entries {
            slots.endpoints.push(Endpoint::Node(node.clone()));
            slots.addrs.push(e.addr);
            slots.processes.push(e.process.0);
            slots.waiting.push_back(e.rank);
        }
        Ok(entries.len() as u32)
    }

    /// Forgets the waiting slots of node `name` (it was lost before the job grew onto it): they
    /// are not offered to a resize or a roll-back any more. Returns how many.
    pub fn remove(&self, name: &str) -> usize {
        let mut slots = lock(&self.slots);
        let before = slots.waiting.len();
        let endpoints = slots.endpoints.clone();
        slots.waiting.retain(
            |r| !matches!(endpoints.get(r.index()), Some(Endpoint::Node(n)) if n.name() == name),
        );
        before - slots.waiting.len()
    }
}

impl ClusterMesh {
    /// The mesh of `world` (from [`super::control::Head::assemble`]): the ranks of process 0
    /// are served by `head_stages` (the head's own devices; `None` when it holds none), every
    /// other rank by its node (`nodes`, from [`super::control::Head::node_handles`]). The
    /// trained model is assembled on a Flex CPU device of the head.
    pub fn new(
        world: &World,
        nodes: &HashMap<String, NodeHandle>,
        head_stages: Option<Arc<dyn StageHost>>,
    ) -> Result<Self> {
        let mut endpoints = Vec::with_capacity(world.ranks.len());
        for entry in &world.ranks {
            let endpoint = if entry.process == ProcessIndex(0) {
                match &head_stages {
                    Some(h) => Endpoint::Local(h.clone()),
                    None => {
                        return Err(Error::InvalidConfig(format!(
                            "rank {} is the head's, but the head serves no stages",
                            entry.rank.0
                        )));
                    }
                }
            } else {
                let name = world
                    .processes
                    .get(entry.process.0 as usize)
                    .ok_or_else(|| {
                        Error::InvalidConfig(format!(
                            "rank {} is on process {}, which the world does not name",
                            entry.rank.0, entry.process.0
                        ))
                    })?;
                Endpoint::Node(nodes.get(name).cloned().ok_or_else(|| {
                    Error::InvalidConfig(format!(
                        "rank {} is on node {name}, which did not join",
                        entry.rank.0
                    ))
                })?)
            };
            endpoints.push(endpoint);
        }
        let model_device = MeshDevice::of_kind(BackendKind::Flex, 1)?.remove(0);
        Ok(Self {
            slots: Arc::new(Mutex::new(MeshSlots {
                endpoints,
                addrs: world.ranks.iter().map(|e| e.addr).collect(),
                processes: world.ranks.iter().map(|e| e.process.0).collect(),
                waiting: Default::default(),
            })),
            model_device,
        })
    }

    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        lock(&self.slots).endpoints.len()
    }

    /// How the slots of nodes that join the running job are added to it (data-parallel
    /// jobs grow onto them; REMOTE-5).
    pub fn joiner(&self) -> MeshJoiner {
        MeshJoiner {
            slots: self.slots.clone(),
        }
    }

    /// Sends `op(slot)` to every slot at once and collects the answers, by slot.
    async fn ask_all(
        endpoints: &[Endpoint],
        op: impl Fn(Rank) -> StageOp,
        timeout: Duration,
    ) -> Result<Vec<StageAnswer>> {
        let asks = endpoints
            .iter()
            .enumerate()
            .map(|(slot, e)| (Rank(slot as u32), e.clone(), op(Rank(slot as u32))))
            .collect();
        ask_each(asks, timeout).await
    }

    async fn spawn_all<M>(self, shape: Shape<M>, cx: SpawnContext) -> Result<Spawned<M>>
    where
        M: Send + 'static,
    {
        let timeout = cx.comm.timeout.max(Duration::from_secs(10)) * 2;
        let layout = shape.layout;
        let endpoints = lock(&self.slots).endpoints.clone();
        if layout.world_size() as usize != endpoints.len() {
            return Err(Error::InvalidConfig(format!(
                "a {} × {} mesh (data × pipeline) on a world of {} rank(s)",
                layout.dp(),
                layout.pp(),
                endpoints.len()
            )));
        }
        let id_of = |slot: Rank| {
            layout.coord_of(slot).map_or(
                StageId {
                    replica: slot.0,
                    stage: 0,
                    tp: 0,
                },
                |c| StageId {
                    replica: c.dp,
                    stage: c.pp,
                    tp: 0,
                },
            )
        };
        let start = |slot| StageOp::Start {
            id: id_of(slot),
            alone: false,
        };
        let started = Self::ask_all(&endpoints, start, timeout).await?;
        let unexpected = |answer: &StageAnswer, slot: usize, op: &str| {
            Error::Runtime(format!(
                "{} answered {op} of rank {slot} with {}",
                endpoints[slot].name(),
                answer.kind()
            ))
        };
        // Every slot's pipeline-link listener, by slot (pipeline jobs; REC-6 adds slots).
        let mut links: Vec<Option<SocketAddr>> = Vec::new();
        if shape.pipelined {
            links = started
                .iter()
                .enumerate()
                .map(|(slot, a)| match a {
                    StageAnswer::Listening(addr) => Ok(Some(*addr)),
                    other => Err(unexpected(other, slot, "Start")),
                })
                .collect::<Result<Vec<_>>>()?;
            // Generation 0: slot r holds layout rank r (REMOTE-1).
            let slot_of: Vec<Rank> = (0..endpoints.len() as u32).map(Rank).collect();
            let addrs = lock(&self.slots).addrs.clone();
            let ops = pipeline::wire_ops(layout, &slot_of, &addrs, &links, Generation(0))
                .map_err(Error::Runtime)?;
            let wire = |slot: Rank| ops[slot.index()].clone();
            let wired = Self::ask_all(&endpoints, wire, timeout).await?;
            if let Some((slot, a)) = wired
                .iter()
                .enumerate()
                .find(|(_, a)| !matches!(a, StageAnswer::Done))
            {
                return Err(unexpected(a, slot, "Wire"));
            }
        } else if let Some((slot, a)) = started
            .iter()
            .enumerate()
            .find(|(_, a)| !matches!(a, StageAnswer::Done))
        {
            return Err(unexpected(a, slot, "Start"));
        }
        let proxies = Proxies {
            slots: self.slots.clone(),
            rebuild: shape.rebuild.clone(),
            generation: Arc::new(AtomicU64::new(0)),
            wait: cx.step_timeout,
        };
        let mut stages = Vec::new();
        let mut devices = Vec::new();
        for (slot, endpoint) in endpoints.iter().enumerate() {
            let slot = Rank(slot as u32);
            let id = id_of(slot);
            let (stage, device) = proxies
                .spawn(slot, id, endpoint.clone(), &cx.supervisor)
                .await?;
            stages.push((stage, id));
            devices.push(device);
        }
        let generation = proxies.generation.clone();
        let slots = self.slots.clone();
        let shutdown = Arc::new(move || {
            // RT-4 across processes: every slot shuts the group it is in now; a late
            // abort never reaches a newer group (REMOTE-3).
            let generation = Generation(generation.load(Ordering::SeqCst));
            let endpoints = lock(&slots).endpoints.clone();
            for (slot, endpoint) in endpoints.iter().enumerate() {
                let endpoint = endpoint.clone();
                let slot = Rank(slot as u32);
                tokio::spawn(async move {
                    let _ = endpoint
                        .call(slot, StageOp::Abort { generation }, HEARTBEAT_WAIT)
                        .await;
                });
            }
        });
        let (grow, rewire) = if shape.pipelined {
            // REC-6 across processes: a lost stage is replaced on a spare (a node that joined
            // the running job) and the mesh rewired.
            let rewire = proxies.rewirer(layout, links, shutdown.clone(), timeout);
            (None, Some(rewire))
        } else {
            let slots = proxies.slots.clone();
            let grow = Grow::Remote {
                start: proxies.grower(timeout),
                waiting: Arc::new(move || lock(&slots).waiting.len()),
            };
            (Some(grow), None)
        };
        Ok(Spawned {
            stages,
            shutdown,
            others: Vec::new(),
            model_ranks: shape.model_ranks,
            assemble: shape.assemble,
            grow,
            rewire,
            devices: Some(devices),
        })
    }
}

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
        Capabilities::data_parallel(self.spec.replicated_state(), Rejoin::Reconnect)
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<M> {
        let ClusterReplicas { mesh, spec } = *self;
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
                rebuild,
                model_ranks: vec![0],
                assemble: |mut models: Vec<M>| models.pop(),
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
        Capabilities::pipeline(!self.spec.zero.shards_optimizer())
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<PipelineModel> {
        let ClusterPipeline { mesh, spec, layout } = *self;
        let rebuild = pipeline::rebuild_blocks(spec, mesh.model_device.burn().clone());
        Box::pin(async move {
            let model_ranks = (0..layout.pp())
                .filter_map(|pp| layout.rank_of(Coord { dp: 0, pp, tp: 0 }))
                .map(Rank::index)
                .collect();
            let shape = Shape {
                layout,
                pipelined: true,
                rebuild,
                model_ranks,
                assemble: PipelineModel::merge,
            };
            mesh.spawn_all(shape, cx)
                .await
                .map_err(ActorProcessingErr::from)
        })
    }
}

/// Sends each `(slot, endpoint, op)` at once and collects the answers, in the order asked;
/// a failure or a missing answer is the error.
async fn ask_each(
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
struct Proxies<M> {
    slots: Arc<Mutex<MeshSlots>>,
    rebuild: Rebuild<M>,
    /// The newest generation a group was formed under (REMOTE-3).
    generation: Arc<AtomicU64>,
    wait: Duration,
}

impl<M: Send + 'static> Proxies<M> {
    /// The proxies of `slot`'s stage (as `id`) and device, linked to the Supervisor.
    async fn spawn(
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
    async fn start_waiting(
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
    fn grower(self, timeout: Duration) -> GrowRemote<M> {
        let proxies = Arc::new(self);
        Arc::new(move |g: RemoteGrowArgs| {
            let proxies = proxies.clone();
            Box::pin(async move {
                let start = StageOp::Start {
                    id: g.id,
                    alone: true,
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
    fn rewirer(
        self,
        layout: Layout,
        links: Vec<Option<SocketAddr>>,
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
                    let coord = layout
                        .coord_of(Rank(r as u32))
                        .ok_or_else(|| Error::Runtime(format!("rank {r} is outside {layout:?}")))?;
                    let id = StageId {
                        replica: coord.dp,
                        stage: coord.pp,
                        tp: 0,
                    };
                    let start = StageOp::Start { id, alone: false };
                    let listening = |a: &StageAnswer| matches!(a, StageAnswer::Listening(_));
                    let (slot, endpoint, answer) =
                        proxies.start_waiting(id, start, listening, timeout).await?;
                    if let StageAnswer::Listening(addr) = answer {
                        let mut links = lock_links(&links);
                        if links.len() <= slot.index() {
                            links.resize(slot.index() + 1, None);
                        }
                        links[slot.index()] = Some(addr);
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

fn lock_links(
    links: &Mutex<Vec<Option<SocketAddr>>>,
) -> std::sync::MutexGuard<'_, Vec<Option<SocketAddr>>> {
    links.lock().unwrap_or_else(|e| e.into_inner())
}

/// The head's proxy of a stage in another process (or in the head's own [`NodeStages`]).
pub(crate) struct RemoteStage<M>(std::marker::PhantomData<fn() -> M>);

impl<M> Default for RemoteStage<M> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<M> std::fmt::Debug for RemoteStage<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteStage")
    }
}

/// What a [`RemoteStage`] starts from, and its state.
pub(crate) struct RemoteStageArgs<M> {
    slot: Rank,
    id: StageId,
    device: DeviceId,
    endpoint: Endpoint,
    /// Every slot, for its data-plane address.
    slots: Arc<Mutex<MeshSlots>>,
    /// Rebuilds the trained model on the head from the stage's snapshot.
    rebuild: Rebuild<M>,
    /// The newest generation a group was formed under (REMOTE-3).
    generation: Arc<AtomicU64>,
    /// How long a request may take (the job's step time-out, which the Supervisor's own wait
    /// also is).
    wait: Duration,
}

impl<M> std::fmt::Debug for RemoteStageArgs<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RemoteStage({}, slot {}, {:?})",
            self.id, self.slot.0, self.endpoint
        )
    }
}

impl<M> RemoteStageArgs<M> {
    /// The stage cannot be reached (REMOTE-2).
    fn lost(&self, why: String) -> Error {
        Error::StageLost {
            device: self.device,
            stage: self.id,
            reason: format!("{} is unreachable: {why}", self.endpoint.name()),
        }
    }

    /// Sends `op` and reads the answer with `read`; a failure on the node comes back as its
    /// error, an unreachable node as `StageLost`.
    async fn ask<T>(
        &self,
        op: StageOp,
        timeout: Duration,
        read: impl FnOnce(StageAnswer) -> Option<T>,
    ) -> Result<T> {
        let kind = op.kind();
        match self.endpoint.call(self.slot, op, timeout).await {
            Err(why) => Err(self.lost(why)),
            Ok(StageAnswer::Failed(e)) => Err(e.into_error(&self.endpoint.name())),
            Ok(answer) => {
                let got = answer.kind();
                read(answer).ok_or_else(|| {
                    Error::Runtime(format!(
                        "{} answered {kind} for {} with {got}",
                        self.endpoint.name(),
                        self.id
                    ))
                })
            }
        }
    }

    async fn snapshot(&self, timeout: Duration) -> Result<Vec<ShardSnapshot>> {
        let answer = self
            .ask(StageOp::Snapshot, timeout, |a| match a {
                StageAnswer::Snapshot(s) => Some(Ok(s)),
                StageAnswer::SnapshotParts { transfer, parts } => Some(Err((transfer, parts))),
                _ => None,
            })
            .await?;
        let from = format!("<snapshot of {} from {}>", self.id, self.endpoint.name());
        let shards = match answer {
            Ok(shards) => shards,
            // Over one message: fetched part by part (REMOTE-6).
            Err((transfer, parts)) => {
                let mut bytes = Vec::new();
                for part in 0..parts {
                    let op = StageOp::SnapshotPart { transfer, part };
                    let piece = self
                        .ask(op, timeout, |a| match a {
                            StageAnswer::Part(b) => Some(b),
                            _ => None,
                        })
                        .await?;
                    bytes.extend_from_slice(&piece);
                }
                split_shards(&bytes).map_err(|e| Error::Runtime(format!("{from}: {e}")))?
            }
        };
        shards
            .iter()
            .map(|bytes| {
                crate::checkpoint::format::decode_transfer(bytes, Path::new(&from))
                    .map_err(Error::from)
            })
            .collect()
    }
}

impl<M> RemoteStageArgs<M> {
    /// Sends shards (in the checkpoint format) to restore: in one message, or part by part
    /// over [`PART_BYTES`] (REMOTE-6).
    async fn restore(&self, shards: Vec<Vec<u8>>, wait: Duration) -> Result<()> {
        let done = |a: StageAnswer| matches!(a, StageAnswer::Done).then_some(());
        let total: usize = shards.iter().map(Vec::len).sum();
        if total <= PART_BYTES {
            return self.ask(StageOp::Restore { shards }, wait, done).await;
        }
        let joined = join_shards(&shards);
        let parts = joined.len().div_ceil(PART_BYTES) as u32;
        let transfer: u64 = rand::random();
        for (part, bytes) in joined.chunks(PART_BYTES).enumerate() {
            let op = StageOp::RestorePart {
                transfer,
                part: part as u32,
                parts,
                bytes: bytes.to_vec(),
            };
            self.ask(op, wait, done).await?;
        }
        Ok(())
    }
}

impl<M> Actor for RemoteStage<M>
where
    M: Send + 'static,
{
    type Msg = StageMsg<M>;
    type State = RemoteStageArgs<M>;
    type Arguments = RemoteStageArgs<M>;

    async fn pre_start(
        &self,
        _myself: ActorRef<StageMsg<M>>,
        args: RemoteStageArgs<M>,
    ) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<StageMsg<M>>,
        message: StageMsg<M>,
        state: &mut Self::State,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let wait = state.wait;
        match message {
            StageMsg::Init(reply) => {
                let r = state
                    .ask(StageOp::Init, wait, |a| match a {
                        StageAnswer::Init { before, after } => Some(InitReport { before, after }),
                        _ => None,
                    })
                    .await;
                let _ = reply.send(r);
            }
            StageMsg::Step {
                step,
                micro_batches,
                global_samples,
                reply,
            } => {
                let op = StageOp::Step {
                    step,
                    micro_batches,
                    global_samples,
                };
                let r = state
                    .ask(op, wait, |a| match a {
                        StageAnswer::Step(report) => Some(*report),
                        _ => None,
                    })
                    .await;
                let _ = reply.send(r);
            }
            StageMsg::Fingerprint(reply) => {
                let r = state
                    .ask(StageOp::Fingerprint, wait, |a| match a {
                        StageAnswer::Fingerprint(f) => Some(f),
                        _ => None,
                    })
                    .await;
                let _ = reply.send(r);
            }
            StageMsg::TakeModel(reply) => {
                let _ = reply.send(take_model(state, wait).await);
            }
            StageMsg::Snapshot(reply) => {
                let _ = reply.send(state.snapshot(wait).await);
            }
            StageMsg::Restore { shard, reply } => {
                let shards: Vec<Vec<u8>> = shard
                    .iter()
                    .map(crate::checkpoint::format::encode_transfer)
                    .collect();
                let _ = reply.send(state.restore(shards, wait).await);
            }
            StageMsg::Reconnect {
                id,
                rank,
                generation,
                slots,
                reply,
            } => {
                let (members, known) = {
                    let mesh = lock(&state.slots);
                    let members: Option<Vec<(SocketAddr, u32)>> = slots
                        .iter()
                        .map(|s| {
                            Some((*mesh.addrs.get(s.index())?, *mesh.processes.get(s.index())?))
                        })
                        .collect();
                    (members, mesh.addrs.len())
                };
                let r = match members {
                    None => Err(Error::InvalidConfig(format!(
                        "reconnect with slots {slots:?}, not all in a world of {known}"
                    ))),
                    Some(members) => {
                        let (addrs, processes) = members.into_iter().unzip();
                        let op = StageOp::Regroup {
                            id,
                            rank,
                            generation,
                            addrs,
                            processes,
                        };
                        state
                            .ask(op, wait, |a| matches!(a, StageAnswer::Done).then_some(()))
                            .await
                    }
                };
                if r.is_ok() {
                    state.id = id;
                    state.generation.fetch_max(generation.0, Ordering::SeqCst);
                }
                let _ = reply.send(r);
            }
            StageMsg::Regroup { reply, .. } | StageMsg::Rewire { reply, .. } => {
                let _ = reply.send(Err(Error::InvalidConfig(
                    "a stage of another process joins a rebuilt group through Reconnect".into(),
                )));
            }
        }
        Ok(())
    }
}

/// The trained model of a stage in another process: its snapshot, restored into a model the
/// job builds on the head.
async fn take_model<M>(state: &RemoteStageArgs<M>, wait: Duration) -> Option<M> {
    let shards = match state.snapshot(wait).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("the trained model of {} is lost: {e}", state.id);
            return None;
        }
    };
    match (state.rebuild)(state.id, shards) {
        Ok(m) => Some(m),
        Err(e) => {
            tracing::error!("the trained model of {} is lost: {e}", state.id);
            None
        }
    }
}

/// The head's proxy of a device in another process: answers the Supervisor's heartbeats with
/// the device's own.
#[derive(Debug, Default)]
pub(crate) struct RemoteDevice;

/// What a [`RemoteDevice`] starts from, and its state.
#[derive(Debug)]
pub(crate) struct RemoteDeviceArgs {
    slot: Rank,
    device: DeviceId,
    endpoint: Endpoint,
}

impl Actor for RemoteDevice {
    type Msg = DeviceMsg;
    type State = RemoteDeviceArgs;
    type Arguments = RemoteDeviceArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<DeviceMsg>,
        args: RemoteDeviceArgs,
    ) -> std::result::Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<DeviceMsg>,
        message: DeviceMsg,
        state: &mut Self::State,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match message {
            DeviceMsg::Heartbeat(reply) => {
                // Answered from a task: a cut-off node must not hold the next heartbeat.
                let (endpoint, slot) = (state.endpoint.clone(), state.slot);
                tokio::spawn(async move {
                    if let Ok(StageAnswer::Heartbeat(h)) = endpoint
                        .call(slot, StageOp::Heartbeat, HEARTBEAT_WAIT)
                        .await
                    {
                        let _ = reply.send(h);
                    }
                });
            }
            DeviceMsg::Run { label, .. } => {
                tracing::error!(
                    "device {} is in another process: it cannot run {label} from the head",
                    state.device
                );
            }
        }
        Ok(())
    }
}

/// One slot of a process: its device, listener, and (once started) its actors and group.
struct NodeSlot<M> {
    device: MeshDevice,
    listener: TcpListener,
    device_actor: Option<ActorRef<DeviceMsg>>,
    stage: Option<ActorRef<StageMsg<M>>>,
    id: StageId,
    /// The data-plane group it is in, with its generation.
    group: Option<(Generation, GroupShutdown)>,
    /// A pipeline slot once started: where its pipeline links are accepted (at every Wire).
    link_listener: Option<TcpListener>,
    /// A pipeline slot's links to its replica's other stages.
    wires: Vec<LinkCloser>,
    /// The generation of its last Wire (a pipeline slot; REMOTE-3: older aborts are ignored).
    wired: Generation,
    /// The last snapshot over one message, by transfer, until the head fetched its last part.
    outgoing: (u64, Vec<Vec<u8>>),
    /// The restore being received: its transfer, its parts so far, the next part expected.
    incoming: (u64, Vec<u8>, u32),
    /// Steps it trained (answered `Step` with a report).
    steps: u64,
    /// How it last joined the data plane, in words.
    joined: String,
}

/// Shuts a slot's data-plane group down: its TCP links, and its process's in-process group
/// when the group is hierarchical.
#[derive(Debug)]
struct GroupShutdown {
    tcp: Option<TcpShutdown>,
    local: Option<Arc<LocalGroup>>,
}

impl GroupShutdown {
    fn shutdown(&self) {
        if let Some(t) = &self.tcp {
            t.shutdown();
        }
        if let Some(l) = &self.local {
            l.shutdown();
        }
    }
}

impl<M> NodeSlot<M> {
    /// Shuts its data-plane group and pipeline links (RT-4).
    fn shut(&mut self) {
        if let Some((_, group)) = &self.group {
            group.shutdown();
        }
        for w in &self.wires {
            w.shutdown();
        }
    }
}

struct NodeInner<M> {
    factory: Arc<dyn SlotFactory<M>>,
    token: JobToken,
    /// In-process groups of hierarchical groups being formed, by generation and members: each
    /// member's communicator until it takes it.
    local_groups: Mutex<LocalGroups>,
    plan: ProcessPlan,
    tcp: TcpConfig,
    slots: Mutex<HashMap<u32, NodeSlot<M>>>,
}

/// A process's stages: serves the head's [`StageRequest`]s for its slots with ordinary
/// [`StageActor`]s (or pipeline stage actors) whose communicators are TCP groups (what a
/// node's agent, and the head for its own devices, hand requests to).
pub(crate) struct NodeStages<M> {
    inner: Arc<NodeInner<M>>,
}

impl<M> std::fmt::Debug for NodeStages<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeStages({:?})", self.inner.plan.ranks)
    }
}

impl<M: Send + 'static> NodeStages<M> {
    /// The stages of `args.plan`'s slots, started by `factory`, one Flex CPU device each.
    pub(crate) fn new(
        factory: Arc<dyn SlotFactory<M>>,
        args: HostArgs,
        tcp: TcpConfig,
    ) -> Result<Self> {
        if args.listeners.len() != args.plan.ranks.len() {
            return Err(Error::InvalidConfig(format!(
                "{} data-plane listeners for ranks {:?}",
                args.listeners.len(),
                args.plan.ranks
            )));
        }
        let devices = MeshDevice::of_kind(BackendKind::Flex, args.plan.ranks.len())?;
        let slots = args
            .plan
            .ranks
            .iter()
            .zip(args.listeners)
            .zip(devices)
            .map(|((&slot, listener), d)| {
                let device = MeshDevice::from_burn(DeviceId(slot.0), d.kind(), d.burn().clone());
                let id = StageId {
                    replica: slot.0,
                    stage: 0,
                    tp: 0,
                };
                (
                    slot.0,
                    NodeSlot {
                        device,
                        listener,
                        device_actor: None,
                        stage: None,
                        id,
                        group: None,
                        link_listener: None,
                        wires: Vec::new(),
                        wired: Generation(0),
                        outgoing: (0, Vec::new()),
                        incoming: (0, Vec::new(), 0),
                        steps: 0,
                        joined: String::new(),
                    },
                )
            })
            .collect();
        Ok(Self {
            inner: Arc::new(NodeInner {
                factory,
                local_groups: Mutex::new(HashMap::new()),
                token: args.token,
                plan: args.plan,
                tcp,
                slots: Mutex::new(slots),
            }),
        })
    }
}

impl<M: Send + 'static> NodeInner<M> {
    fn with_slot<T>(
        &self,
        slot: Rank,
        f: impl FnOnce(&mut NodeSlot<M>) -> T,
    ) -> std::result::Result<T, RemoteError> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        match slots.get_mut(&slot.0) {
            Some(s) => Ok(f(s)),
            None => Err(RemoteError::Other(format!(
                "rank {} is not a slot of this process (it holds {:?})",
                slot.0, self.plan.ranks
            ))),
        }
    }

    /// Joins the group of `generation` whose ranks listen at `addrs`, as `rank`, through
    /// `slot`'s listener; the old group (if any) is shut down first. With `processes` (each
    /// member's process) and a process holding two or more members, the group is
    /// hierarchical (HIER-1): an in-process group of this process's members, and a TCP group
    /// of one leader per process on the leaders' listeners; otherwise a flat TCP group.
    async fn connect(
        &self,
        slot: Rank,
        rank: Rank,
        generation: Generation,
        addrs: Vec<SocketAddr>,
        processes: Option<Vec<u32>>,
    ) -> std::result::Result<crate::comm::Communicator, RemoteError> {
        let listener = self.with_slot(slot, |s| {
            if let Some((_, old)) = s.group.take() {
                old.shutdown();
            }
            s.listener.try_clone()
        })?;
        let hierarchy = processes
            .as_ref()
            .and_then(|p| HierarchyPlan::of(rank, p).map(|plan| (plan, p.clone())));
        let Some((plan, processes)) = hierarchy else {
            let group = self.tcp_group(listener, rank, generation, addrs).await?;
            let shutdown = GroupShutdown {
                tcp: Some(group.shutdown_handle()),
                local: None,
            };
            let joined = format!(
                "generation {}: flat TCP group of {} rank(s)",
                generation.0,
                group.world()
            );
            self.with_slot(slot, |s| {
                s.group = Some((generation, shutdown));
                s.joined = joined;
            })?;
            return Ok(group.into_communicator());
        };
        let local = self.local_member(&plan, rank, generation)?;
        let leaders = match plan.local_index(rank) {
            Some(0) if plan.leaders.len() > 1 => {
                let index = plan.leaders.iter().position(|l| *l == rank).unwrap_or(0);
                let leader_addrs = plan
                    .leaders
                    .iter()
                    .map(|l| addrs.get(l.index()).copied())
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        RemoteError::Other(format!(
                            "{} addresses for leaders {:?}",
                            addrs.len(),
                            plan.leaders
                        ))
                    })?;
                Some(
                    self.tcp_group(listener, Rank(index as u32), generation, leader_addrs)
                        .await?,
                )
            }
            _ => None,
        };
        let shutdown = GroupShutdown {
            tcp: leaders.as_ref().map(TcpGroup::shutdown_handle),
            local: local.group().cloned(),
        };
        let joined = format!(
            "generation {}: hierarchical group of {} rank(s), {} in this process, {} process(es){}",
            generation.0,
            processes.len(),
            plan.local.len(),
            plan.leaders.len(),
            if leaders.is_some() {
                ", this rank leads its process across processes"
            } else {
                ""
            }
        );
        self.with_slot(slot, |s| {
            s.group = Some((generation, shutdown));
            s.joined = joined;
        })?;
        let leaders = leaders.map(TcpGroup::into_communicator);
        let timeout = self.tcp.comm.timeout;
        crate::comm::Communicator::hierarchical((rank, generation), processes, plan, local, leaders)
            .map(|c| c.with_timeout(timeout))
            .ok_or_else(|| RemoteError::Other("the in-process part of a hierarchical group".into()))
    }

    /// A flat TCP group of `generation` whose rank r listens at `addrs[r]`, joined as `rank`
    /// on `listener`.
    async fn tcp_group(
        &self,
        listener: std::io::Result<TcpListener>,
        rank: Rank,
        generation: Generation,
        addrs: Vec<SocketAddr>,
    ) -> std::result::Result<TcpGroup, RemoteError> {
        let listener = listener
            .and_then(|l| LinkListener::from_std(l, rank, self.token.clone(), self.tcp.link))
            .map_err(|e| RemoteError::Other(format!("the data-plane listener: {e}")))?;
        let tcp = self.tcp.clone();
        tokio::task::spawn_blocking(move || TcpGroup::connect(&listener, &addrs, generation, tcp))
            .await
            .map_err(|e| RemoteError::Other(format!("the connect task failed: {e}")))?
            .map_err(|e| {
                RemoteError::Other(format!(
                    "rank {} could not join the data plane of generation {}: {e}",
                    rank.0, generation.0
                ))
            })
    }

    /// `rank`'s communicator in the in-process group of its process's members: the first of
    /// them to ask makes the group (one per generation and membership), each takes its own.
    fn local_member(
        &self,
        plan: &HierarchyPlan,
        rank: Rank,
        generation: Generation,
    ) -> std::result::Result<crate::comm::Communicator, RemoteError> {
        let index = plan.local_index(rank).ok_or_else(|| {
            RemoteError::Other(format!("rank {} is not among {:?}", rank.0, plan.local))
        })?;
        let key = (
            generation.0,
            plan.local.iter().map(|r| r.0).collect::<Vec<_>>(),
        );
        let mut groups = self.local_groups.lock().unwrap_or_else(|e| e.into_inner());
        // Groups of older generations are over: drop what no member took.
        groups.retain(|(g, _), _| *g >= generation.0);
        let members = groups.entry(key.clone()).or_insert_with(|| {
            LocalGroup::new(plan.local.len(), generation, self.tcp.comm.clone())
                .communicators()
                .into_iter()
                .map(Some)
                .collect()
        });
        let mine = members.get_mut(index).and_then(Option::take);
        if members.iter().all(Option::is_none) {
            groups.remove(&key);
        }
        mine.ok_or_else(|| {
            RemoteError::Other(format!(
                "rank {} joined the in-process group of generation {} twice",
                rank.0, generation.0
            ))
        })
    }

    async fn serve(self: Arc<Self>, request: StageRequest) -> StageAnswer {
        let timeout = Duration::from_millis(request.timeout_ms);
        match self.serve_op(request.slot, request.op, timeout).await {
            Ok(answer) => answer,
            Err(e) => StageAnswer::Failed(e),
        }
    }

    async fn serve_op(
        &self,
        slot: Rank,
        op: StageOp,
        timeout: Duration,
    ) -> std::result::Result<StageAnswer, RemoteError> {
        match op {
            StageOp::Start { id, alone } => match self.factory.pipeline() {
                None => self
                    .start(slot, id, alone)
                    .await
                    .map(|()| StageAnswer::Done),
                Some(_) => self.listen(slot, id).await.map(StageAnswer::Listening),
            },
            StageOp::Wire {
                generation,
                dp,
                links,
            } => self
                .wire(slot, generation, (dp, links), timeout)
                .await
                .map(|()| StageAnswer::Done),
            StageOp::Abort { generation } => {
                self.with_slot(slot, |s| {
                    let grouped = s.group.as_ref().map_or(Generation(0), |(g, _)| *g);
                    let current = grouped.max(s.wired);
                    if current <= generation {
                        s.shut();
                    }
                })?;
                Ok(StageAnswer::Done)
            }
            StageOp::Heartbeat => {
                let (device, id) =
                    self.with_slot(slot, |s| (s.device_actor.clone(), s.device.id()))?;
                let device = device.ok_or_else(|| not_started(slot))?;
                heartbeat(&device, id, timeout.min(HEARTBEAT_WAIT))
                    .await
                    .map(StageAnswer::Heartbeat)
                    .map_err(|e| RemoteError::from(&e))
            }
            StageOp::Init => self
                .asker(slot, timeout)?
                .call(StageMsg::Init)
                .await
                .map(|r| StageAnswer::Init {
                    before: r.before,
                    after: r.after,
                }),
            StageOp::Step {
                step,
                micro_batches,
                global_samples,
            } => self
                .asker(slot, timeout)?
                .call(|reply| StageMsg::Step {
                    step,
                    micro_batches,
                    global_samples,
                    reply,
                })
                .await
                .map(|report| {
                    let _ = self.with_slot(slot, |s| s.steps += 1);
                    StageAnswer::Step(Box::new(report))
                }),
            StageOp::Fingerprint => self
                .asker(slot, timeout)?
                .call(StageMsg::Fingerprint)
                .await
                .map(StageAnswer::Fingerprint),
            StageOp::Snapshot => {
                let shards: Vec<Vec<u8>> = self
                    .asker(slot, timeout)?
                    .call(StageMsg::Snapshot)
                    .await?
                    .iter()
                    .map(crate::checkpoint::format::encode_transfer)
                    .collect();
                if shards.iter().map(Vec::len).sum::<usize>() <= PART_BYTES {
                    return Ok(StageAnswer::Snapshot(shards));
                }
                // REMOTE-6: kept until the head fetched it part by part.
                let parts: Vec<Vec<u8>> = join_shards(&shards)
                    .chunks(PART_BYTES)
                    .map(<[u8]>::to_vec)
                    .collect();
                let count = parts.len() as u32;
                let transfer = self.with_slot(slot, |s| {
                    let transfer = s.outgoing.0 + 1;
                    s.outgoing = (transfer, parts);
                    transfer
                })?;
                Ok(StageAnswer::SnapshotParts {
                    transfer,
                    parts: count,
                })
            }
            StageOp::SnapshotPart { transfer, part } => self.with_slot(slot, |s| {
                let (kept, parts) = &mut s.outgoing;
                let piece = (*kept == transfer)
                    .then(|| parts.get(part as usize).cloned())
                    .flatten();
                if *kept == transfer && part as usize + 1 >= parts.len() {
                    parts.clear();
                }
                piece.map(StageAnswer::Part).ok_or_else(|| {
                    RemoteError::Other(format!(
                        "rank {} keeps no part {part} of snapshot transfer {transfer} (a newer \
                         snapshot replaced it, or it was fetched already)",
                        slot.0
                    ))
                })
            })?,
            StageOp::RestorePart {
                transfer,
                part,
                parts,
                bytes,
            } => {
                let whole = self.with_slot(slot, |s| {
                    let (current, kept, next) = &mut s.incoming;
                    if part == 0 {
                        *current = transfer;
                        kept.clear();
                        *next = 0;
                    }
                    if transfer != *current || part != *next || part >= parts {
                        *next = 0;
                        kept.clear();
                        return Err(RemoteError::Other(format!(
                            "part {part} of {parts} of restore transfer {transfer}, expected \
                             part {next} of transfer {current}"
                        )));
                    }
                    kept.extend_from_slice(&bytes);
                    *next += 1;
                    Ok((part + 1 == parts).then(|| std::mem::take(kept)))
                })??;
                match whole {
                    None => Ok(StageAnswer::Done),
                    Some(bytes) => {
                        let shards = split_shards(&bytes).map_err(RemoteError::Other)?;
                        self.restore(slot, shards, timeout).await
                    }
                }
            }
            StageOp::Restore { shards } => self.restore(slot, shards, timeout).await,
            StageOp::Regroup {
                id,
                rank,
                generation,
                addrs,
                processes,
            } => {
                let ask = self.asker(slot, timeout)?;
                let comm = self
                    .connect(slot, rank, generation, addrs, Some(processes))
                    .await?;
                ask.call(|reply| StageMsg::Regroup {
                    id,
                    rank,
                    comm,
                    reply,
                })
                .await?;
                self.with_slot(slot, |s| s.id = id)?;
                Ok(StageAnswer::Done)
            }
        }
    }

    /// Restores `slot`'s stage from shards in the checkpoint format (checksums verified).
    async fn restore(
        &self,
        slot: Rank,
        shards: Vec<Vec<u8>>,
        timeout: Duration,
    ) -> std::result::Result<StageAnswer, RemoteError> {
        let from = Path::new("<shard from the head>");
        let shard = shards
            .iter()
            .map(|b| crate::checkpoint::format::decode_transfer(b, from))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| RemoteError::Other(e.to_string()))?;
        self.asker(slot, timeout)?
            .call(|reply| StageMsg::Restore { shard, reply })
            .await
            .map(|()| StageAnswer::Done)
    }

    /// Asks `slot`'s stage, bounded by `timeout`.
    fn asker(&self, slot: Rank, timeout: Duration) -> std::result::Result<Asker<M>, RemoteError> {
        let (stage, id, device) =
            self.with_slot(slot, |s| (s.stage.clone(), s.id, s.device.id()))?;
        Ok(Asker {
            stage: stage.ok_or_else(|| not_started(slot))?,
            id,
            device,
            timeout,
        })
    }

    /// Starts `slot`'s device and stage, joined to the world's data plane of generation 0, or
    /// (`alone`: a node that joined the running job) in a group of its own until the
    /// Supervisor reconnects everyone (REMOTE-5).
    async fn start(
        &self,
        slot: Rank,
        id: StageId,
        alone: bool,
    ) -> std::result::Result<(), RemoteError> {
        let (started, device) = self.with_slot(slot, |s| (s.stage.is_some(), s.device.clone()))?;
        if started {
            return Err(RemoteError::Other(format!(
                "rank {} was started already",
                slot.0
            )));
        }
        let comm = if alone {
            let own = self.plan.addrs.get(slot.index()).copied().ok_or_else(|| {
                RemoteError::Other(format!("rank {} has no address in the world", slot.0))
            })?;
            self.connect(slot, Rank(0), Generation(0), vec![own], None)
                .await?
        } else {
            let processes = self.plan.processes.iter().map(|p| p.0).collect();
            self.connect(
                slot,
                slot,
                Generation(0),
                self.plan.addrs.clone(),
                Some(processes),
            )
            .await?
        };
        let (device_actor, _) = Actor::spawn(None, DeviceActor, device.clone())
            .await
            .map_err(|e| RemoteError::Other(format!("cannot start the device: {e}")))?;
        let start = SlotStart {
            id,
            rank: slot,
            device,
            device_actor: device_actor.clone(),
            comm: Some(comm),
            links: None,
        };
        let stage = self
            .factory
            .spawn(start)
            .await
            .map_err(RemoteError::Other)?;
        self.with_slot(slot, |s| {
            s.device_actor = Some(device_actor);
            s.stage = Some(stage);
            s.id = id;
        })
    }

    /// A pipeline slot's first phase (REMOTE-4): starts its device and binds the listener of
    /// its pipeline links, on the address of its data-plane listener.
    async fn listen(
        &self,
        slot: Rank,
        id: StageId,
    ) -> std::result::Result<SocketAddr, RemoteError> {
        let (started, device, ip) = self.with_slot(slot, |s| {
            (
                s.device_actor.is_some(),
                s.device.clone(),
                s.listener.local_addr().map(|a| a.ip()),
            )
        })?;
        if started {
            return Err(RemoteError::Other(format!(
                "rank {} was started already",
                slot.0
            )));
        }
        let io = |e: std::io::Error| RemoteError::Other(format!("the pipeline-link listener: {e}"));
        let listener = TcpListener::bind((ip.map_err(io)?, 0)).map_err(io)?;
        let addr = listener.local_addr().map_err(io)?;
        let (device_actor, _) = Actor::spawn(None, DeviceActor, device)
            .await
            .map_err(|e| RemoteError::Other(format!("cannot start the device: {e}")))?;
        self.with_slot(slot, |s| {
            s.device_actor = Some(device_actor);
            s.link_listener = Some(listener);
            s.id = id;
        })?;
        Ok(addr)
    }

    /// A pipeline slot's second phase (REMOTE-4): joins its stage index's data-parallel group
    /// (its replicas at `dp`) and connects to its replica's other stages (at `links`) at once
    /// under `generation`, then starts its stage actor; or, a stage that runs already (REC-6:
    /// another stage of the mesh was replaced), shuts its old wiring first and hands the
    /// stage the new one.
    async fn wire(
        &self,
        slot: Rank,
        generation: Generation,
        (dp_addrs, pp_addrs): (Vec<SocketAddr>, Vec<SocketAddr>),
        timeout: Duration,
    ) -> std::result::Result<(), RemoteError> {
        let other = RemoteError::Other;
        let plan = self
            .factory
            .pipeline()
            .ok_or_else(|| other("Wire in a job without a pipeline".into()))?;
        let (id, device, device_actor, listener, stage) = self.with_slot(slot, |s| {
            // REMOTE-3: from now on an abort of an older generation leaves this one alone.
            s.shut();
            s.wired = generation;
            (
                s.id,
                s.device.clone(),
                s.device_actor.clone(),
                s.link_listener.as_ref().map(TcpListener::try_clone),
                s.stage.clone(),
            )
        })?;
        let (Some(device_actor), Some(listener)) = (device_actor, listener) else {
            return Err(other(format!(
                "rank {} is not listening for pipeline links (Start first)",
                slot.0
            )));
        };
        if dp_addrs.len() <= id.replica as usize || pp_addrs.len() <= id.stage as usize {
            return Err(other(format!(
                "{id} is outside a Wire of {} replica(s) and {} stage(s)",
                dp_addrs.len(),
                pp_addrs.len()
            )));
        }
        let listener = listener
            .and_then(|l| {
                LinkListener::from_std(l, Rank(id.stage), self.token.clone(), self.tcp.link)
            })
            .map_err(|e| other(format!("the pipeline-link listener: {e}")))?;
        let link_config = self.tcp.link;
        let capacity = plan.link_capacity() as usize;
        let wires = tokio::task::spawn_blocking(move || {
            pipeline::connect_wires(&listener, &pp_addrs, link_config, capacity)
        });
        let comm = async {
            if dp_addrs.len() > 1 {
                self.connect(slot, Rank(id.replica), generation, dp_addrs, None)
                    .await
                    .map(Some)
            } else {
                Ok(None)
            }
        };
        let (comm, wires) = tokio::join!(comm, wires);
        let (wires, closers) = wires
            .map_err(|e| other(format!("the connect task failed: {e}")))?
            .map_err(|e| other(format!("{id} could not connect its pipeline links: {e}")))?;
        self.with_slot(slot, |s| s.wires = closers)?;
        let comm = comm?;
        let links = remote_links(&plan, id.stage, self.tcp.comm.timeout, wires)
            .map_err(|e| other(e.to_string()))?;
        if stage.is_some() {
            let links = Box::new(links);
            return self
                .asker(slot, timeout)?
                .call(|reply| StageMsg::Rewire {
                    links,
                    comm,
                    tp: None,
                    reply,
                })
                .await;
        }
        let start = SlotStart {
            id,
            rank: slot,
            device,
            device_actor,
            comm,
            links: Some(links),
        };
        let stage = self.factory.spawn(start).await.map_err(other)?;
        self.with_slot(slot, |s| s.stage = Some(stage))
    }
}

fn not_started(slot: Rank) -> RemoteError {
    RemoteError::Other(format!("rank {} was not started", slot.0))
}

/// Asks a local stage actor, bounded by the request's time-out.
struct Asker<M> {
    stage: ActorRef<StageMsg<M>>,
    id: StageId,
    device: DeviceId,
    timeout: Duration,
}

impl<M: Send + 'static> Asker<M> {
    async fn call<T: Send + 'static>(
        &self,
        msg: impl FnOnce(RpcReplyPort<Result<T>>) -> StageMsg<M>,
    ) -> std::result::Result<T, RemoteError> {
        match self.stage.call(msg, Some(self.timeout)).await {
            Ok(CallResult::Success(Ok(v))) => Ok(v),
            Ok(CallResult::Success(Err(e))) => Err(RemoteError::from(&e)),
            Ok(CallResult::Timeout) => Err(RemoteError::Other(format!(
                "{} did not answer within {:?}",
                self.id, self.timeout
            ))),
            Ok(CallResult::SenderError) | Err(_) => Err(RemoteError::StageLost {
                device: self.device,
                stage: self.id,
                reason: "its actor stopped without answering".into(),
            }),
        }
    }
}

impl<M: Send + 'static> StageHost for NodeStages<M> {
    fn serve(&self, request: StageRequest) -> super::control::stages::AnswerFuture {
        Box::pin(self.inner.clone().serve(request))
    }

    fn steps_trained(&self) -> Vec<(Rank, u64)> {
        let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(Rank, u64)> = slots.iter().map(|(&r, s)| (Rank(r), s.steps)).collect();
        out.sort_unstable();
        out
    }

    fn data_plane(&self) -> Vec<(Rank, String)> {
        let slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<(Rank, String)> = slots
            .iter()
            .filter(|(_, s)| !s.joined.is_empty())
            .map(|(&r, s)| (Rank(r), s.joined.clone()))
            .collect();
        out.sort_unstable();
        out
    }

    fn stop(&self) {
        let mut slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        for s in slots.values_mut() {
            s.shut();
            s.group = None;
            s.wires.clear();
            if let Some(stage) = s.stage.take() {
                stage.stop(Some("the job ended".into()));
            }
            if let Some(device) = s.device_actor.take() {
                device.stop(Some("the job ended".into()));
            }
        }
    }
}
