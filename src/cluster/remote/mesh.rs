//! `ClusterMesh`: the assembled world a cluster job trains on — which process holds each slot,
//! how to reach it (the head's own `NodeStages` or a node's agent), and the slots that join
//! while the job runs (`MeshJoiner`).

use super::*;
use crate::cluster::control::PipelineListeners;

/// The head's side of a job's shape: where each rank sits, how its model comes back.
pub(super) struct Shape<M> {
    pub(super) layout: Layout,
    /// Slots start in two phases (REMOTE-4).
    pub(super) pipelined: bool,
    /// The job's fault plan on the head (FAULT-3).
    pub(super) faults: Option<Arc<crate::faults::FaultHooks>>,
    pub(super) rebuild: Rebuild<M>,
    pub(super) model_ranks: Vec<usize>,
    pub(super) assemble: fn(Vec<M>) -> Option<M>,
    /// A parameter-server job: the port of the head's gateway to the server.
    pub(super) server: Option<u16>,
}

/// How much longer than the time-out a request carries the head waits for its answer (the
/// node's own bound fires first, with its diagnosis).
pub(super) const ANSWER_MARGIN: Duration = Duration::from_secs(2);

/// How long a device heartbeat of another process may take.
pub(super) const HEARTBEAT_WAIT: Duration = Duration::from_secs(2);

/// Where the stage of one slot lives.
#[derive(Clone)]
pub(super) enum Endpoint {
    /// In the head's own process.
    Local(Arc<dyn StageHost>),
    /// In a node's process, reached over the control plane.
    Node(NodeHandle),
}

impl Endpoint {
    pub(super) fn name(&self) -> String {
        match self {
            Endpoint::Local(_) => "the head".into(),
            Endpoint::Node(n) => format!("node {}", n.name()),
        }
    }

    /// Sends `op` for `slot` and waits at most `timeout` (plus a margin). A node that cannot
    /// be reached is `Err` with why (REMOTE-2).
    pub(super) async fn call(
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
    pub(super) slots: Arc<Mutex<MeshSlots>>,
    /// The data-plane token every process of the job holds (links the head opens itself, as
    /// the parameter server's gateway, check it too).
    pub(super) token: JobToken,
    /// The device the trained model is assembled on (in the head's process).
    pub(super) model_device: MeshDevice,
}

/// Every slot of the world, by slot: the world as assembled, then the slots of nodes that
/// joined the running job (REMOTE-5).
#[derive(Debug)]
pub(super) struct MeshSlots {
    pub(super) endpoints: Vec<Endpoint>,
    pub(super) addrs: Vec<SocketAddr>,
    /// Each slot's process (ranks of one process all-reduce hierarchically).
    pub(super) processes: Vec<u32>,
    /// Slots of nodes that joined the running job and are not replicas yet, oldest first.
    pub(super) waiting: std::collections::VecDeque<Rank>,
}

pub(super) fn lock(slots: &Mutex<MeshSlots>) -> std::sync::MutexGuard<'_, MeshSlots> {
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
    pub(super) slots: Arc<Mutex<MeshSlots>>,
}

impl MeshJoiner {
    /// Adds the ranks `entries` of a node that joined the running job (from
    /// [`crate::cluster::control::LateNode`]), reached through `node`; they wait until the job grows
    /// onto them (`JobControl::add_replicas`, one replica per rank). The ranks must continue
    /// the world's numbering. Returns how many were added.
    pub fn add(
        &self,
        node: NodeHandle,
        entries: &[crate::cluster::control::RankEntry],
    ) -> Result<u32> {
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
    /// The mesh of the world `assembled` (from [`crate::cluster::control::Head::assemble`]): the
    /// ranks of process 0 are served by `head_stages` (the head's own devices; `None` when it
    /// holds none), every other rank by its node (`nodes`, from
    /// [`crate::cluster::control::Head::node_handles`]). The trained model is assembled on a
    /// Flex CPU device of the head.
    pub fn new(
        assembled: &crate::cluster::control::Assembled,
        nodes: &HashMap<String, NodeHandle>,
        head_stages: Option<Arc<dyn StageHost>>,
    ) -> Result<Self> {
        let world = &assembled.world;
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
            token: assembled.token.clone(),
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
    pub(super) async fn ask_all(
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

    pub(super) async fn spawn_all<M>(self, shape: Shape<M>, cx: SpawnContext) -> Result<Spawned<M>>
    where
        M: Send + 'static,
    {
        let timeout = cx.comm.timeout.max(Duration::from_secs(10)) * 2;
        let layout = shape.layout;
        let endpoints = lock(&self.slots).endpoints.clone();
        if layout.world_size() as usize != endpoints.len() {
            return Err(Error::InvalidConfig(format!(
                "a {} × {} × {} mesh (data × pipeline × tensor) on a world of {} rank(s)",
                layout.dp(),
                layout.pp(),
                layout.tp(),
                endpoints.len()
            )));
        }
        let id_of = |slot: Rank| {
            pipeline::stage_id(layout, slot).unwrap_or(StageId {
                replica: slot.0,
                stage: 0,
                tp: 0,
            })
        };
        let server = shape.server;
        let start = |slot| StageOp::Start {
            id: id_of(slot),
            alone: false,
            server,
        };
        let started = Self::ask_all(&endpoints, start, timeout).await?;
        let unexpected = |answer: &StageAnswer, slot: usize, op: &str| {
            Error::Runtime(format!(
                "{} answered {op} of rank {slot} with {}",
                endpoints[slot].name(),
                answer.kind()
            ))
        };
        // Every slot's pipeline listeners, by slot (pipeline jobs; REC-6 adds slots).
        let mut links: Vec<Option<PipelineListeners>> = Vec::new();
        if shape.pipelined {
            links = started
                .iter()
                .enumerate()
                .map(|(slot, a)| match a {
                    StageAnswer::Listening(heard) => Ok(Some(*heard)),
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
            faults: shape.faults.clone(),
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
