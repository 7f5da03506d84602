//! The head side: [`Head`] listens, greets the nodes that appear in the job's process group,
//! assembles the world, prepares every node, checks they are alive and shuts them down.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::rpc::CallResult;
use ractor::{ActorId, ActorRef};
use tokio::task::JoinSet;

use super::agent::AgentMsg;
use super::protocol::{
    self, CONTROL_PROTOCOL_VERSION, CodecError, ControlMsg, Hello, Incompatibility, JobSpec,
    MAX_CONTROL_MESSAGE, ModelFingerprint, NodeInfo, NodePhase, Prepare,
};
use super::secret::ClusterSecret;
use super::session::{ClusterNode, SessionEvent, adopt, adopt_stream};
use super::stages::{StageAnswer, StageRequest};
use super::tls::HeadTls;

/// The most TLS handshakes the head runs at once (CTL-10).
const MAX_HANDSHAKES: usize = 64;
use super::world::{ProcessIndex, ProcessPlan, ProcessSlot, World, assign_ranks};
use super::{AGENTS_GROUP, ControlError, host_name, job_scope};
use crate::comm::net::link::JobToken;

mod late;
pub use late::{LateEvent, LateEvents, LateJoins, LateNode};

/// What a head needs. Plain data with defaults for the limits.
#[derive(Clone)]
pub struct HeadConfig {
    /// Where to listen for nodes (`host:port`; port 0 lets the system choose).
    pub listen: String,
    /// The job's name (the process group scope its nodes join).
    pub job: String,
    /// The shared secret.
    pub secret: ClusterSecret,
    /// The head's name (default `head-host-pid`).
    pub name: String,
    /// How long each request to a node may take (default 10 s).
    pub rpc_timeout: Duration,
    /// How often joined nodes are sent a heartbeat (default 1 s).
    pub heartbeat_interval: Duration,
    /// The control protocol version to speak (this build's; tests pretend to be another).
    pub protocol_version: u16,
    /// TLS on the control plane (CTL-10): the head's certificate and key (default none:
    /// plain TCP).
    pub tls: Option<HeadTls>,
}

impl std::fmt::Debug for HeadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeadConfig")
            .field("listen", &self.listen)
            .field("job", &self.job)
            .field("name", &self.name)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl HeadConfig {
    /// A head of job `job` listening on `listen`.
    pub fn new(listen: impl Into<String>, job: impl Into<String>, secret: ClusterSecret) -> Self {
        Self {
            listen: listen.into(),
            job: job.into(),
            secret,
            name: format!("head-{}-{}", host_name(), std::process::id()),
            rpc_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(1),
            protocol_version: CONTROL_PROTOCOL_VERSION,
            tls: None,
        }
    }
}

/// A node that joined: what it said in its Welcome and its agent.
#[derive(Debug, Clone)]
pub struct JoinedNode {
    /// Its Welcome.
    pub info: NodeInfo,
    /// Its agent (a remote actor).
    pub agent: ActorRef<AgentMsg>,
}

/// The assembled world: every node prepared and acknowledged.
#[derive(Debug, Clone)]
pub struct Assembled {
    /// Every rank with its process and data-plane address.
    pub world: World,
    /// The data-plane token every process now holds.
    pub token: JobToken,
}

impl Assembled {
    /// The head's own view (process 0): its ranks, the world size, every address.
    pub fn head_plan(&self) -> ProcessPlan {
        self.world.plan_for(ProcessIndex(0))
    }
}

/// Sends requests to agents, each bounded by the RPC time-out (CTL-7).
#[derive(Debug, Clone, Copy)]
struct Caller {
    version: u16,
    timeout: Duration,
}

impl Caller {
    /// Sends `msg` and decodes the reply. A reply in another protocol version is read as the
    /// node's refusal of ours (CTL-3, CTL-6).
    async fn call(
        self,
        agent: &ActorRef<AgentMsg>,
        peer: &str,
        msg: &ControlMsg,
    ) -> Result<ControlMsg, ControlError> {
        let request = msg.kind();
        let bytes =
            protocol::encode_as(msg, self.version, MAX_CONTROL_MESSAGE).map_err(|error| {
                ControlError::Codec {
                    peer: peer.to_string(),
                    outgoing: true,
                    error,
                }
            })?;
        let no_reply = |detail: Option<String>| ControlError::NoReply {
            peer: peer.to_string(),
            request,
            timeout: self.timeout,
            detail,
        };
        let reply = match agent
            .call(
                |reply| AgentMsg::Request { bytes, reply },
                Some(self.timeout),
            )
            .await
        {
            Ok(CallResult::Success(reply)) => reply,
            Ok(CallResult::Timeout) => return Err(no_reply(None)),
            Ok(CallResult::SenderError) => {
                return Err(no_reply(Some("its session ended".into())));
            }
            Err(e) => return Err(no_reply(Some(e.to_string()))),
        };
        match protocol::decode_as(&reply, self.version, MAX_CONTROL_MESSAGE) {
            Ok(reply) => Ok(reply),
            Err(CodecError::UnsupportedVersion { found, .. }) => {
                Ok(ControlMsg::Refused(Incompatibility::ProtocolVersion {
                    head: self.version,
                    node: found,
                }))
            }
            Err(error) => Err(ControlError::Codec {
                peer: peer.to_string(),
                outgoing: false,
                error,
            }),
        }
    }

    /// Tells a node it is refused (one-way; it may already be gone).
    fn refuse(self, agent: &ActorRef<AgentMsg>, why: &Incompatibility) {
        if let Ok(bytes) = protocol::encode_as(
            &ControlMsg::Refused(why.clone()),
            self.version,
            MAX_CONTROL_MESSAGE,
        ) {
            let _ = agent.cast(AgentMsg::Notice { bytes });
        }
    }
}

/// How the head asks one node for its stages' work (`Stage` requests), from any task.
#[derive(Debug, Clone)]
pub struct NodeHandle {
    name: String,
    agent: ActorRef<AgentMsg>,
    version: u16,
}

impl NodeHandle {
    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sends `request` and waits for the answer at most `timeout`: a node that does not answer
    /// in time, or whose session ended, is [`ControlError::NoReply`].
    pub async fn stage(
        &self,
        request: StageRequest,
        timeout: Duration,
    ) -> Result<StageAnswer, ControlError> {
        let caller = Caller {
            version: self.version,
            timeout,
        };
        match caller
            .call(&self.agent, &self.name, &ControlMsg::Stage(request))
            .await?
        {
            ControlMsg::StageDone(answer) => Ok(answer),
            ControlMsg::Refused(why) => Err(ControlError::Refused {
                peer: self.name.clone(),
                by_head: false,
                reason: why,
            }),
            other => Err(ControlError::UnexpectedReply {
                peer: self.name.clone(),
                request: "Stage",
                reply: other.kind(),
            }),
        }
    }
}

/// The head of a job (see the module's conversation).
#[derive(Debug)]
pub struct Head {
    config: HeadConfig,
    cluster: ClusterNode,
    local_addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
    /// Peer addresses of authenticated sessions, by ractor_cluster's session id.
    peers: HashMap<u64, String>,
    /// Joined nodes; in process order once assembled.
    nodes: Vec<JoinedNode>,
    heartbeat_seq: u64,
}

impl Head {
    /// Starts listening for nodes (CTL-8: only sessions that pass ractor_cluster's challenge
    /// with the secret go further).
    pub async fn start(config: HeadConfig) -> Result<Head, ControlError> {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .map_err(|e| ControlError::Bind {
                addr: config.listen.clone(),
                reason: e.to_string(),
            })?;
        let local_addr = listener.local_addr().map_err(|e| ControlError::Bind {
            addr: config.listen.clone(),
            reason: e.to_string(),
        })?;
        let cluster = ClusterNode::start(&config.name, &config.secret).await?;
        let server = cluster.server.clone();
        let tls = config.tls.clone();
        // CTL-10: at most this many handshakes at once; more connections are closed at once.
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let accept = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        tracing::debug!("control connection from {peer}");
                        let Some(tls) = tls.clone() else {
                            if let Err(e) = adopt(&server, stream, true) {
                                tracing::warn!("dropping the control connection from {peer}: {e}");
                            }
                            continue;
                        };
                        // CTL-10: the handshake runs on its own task (bounded by its time-out
                        // and by MAX_HANDSHAKES at once), so a slow or silent peer never holds
                        // up the others.
                        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                            tracing::warn!(
                                "closed the control connection from {peer}: {MAX_HANDSHAKES} TLS \
                                 handshakes are under way"
                            );
                            continue;
                        };
                        let server = server.clone();
                        tokio::spawn(async move {
                            let _permit = permit;
                            let adopted = match tls.accept(stream).await {
                                Ok(stream) => adopt_stream(&server, stream, true),
                                Err(e) => Err(e),
                            };
                            if let Err(e) = adopted {
                                tracing::warn!("closed the control connection from {peer}: {e}");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!("accepting a control connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        Ok(Head {
            config,
            cluster,
            local_addr,
            accept,
            peers: HashMap::new(),
            nodes: Vec::new(),
            heartbeat_seq: 0,
        })
    }

    /// Where the head listens (the port the system chose, for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The nodes that joined (in process order once assembled).
    pub fn nodes(&self) -> &[JoinedNode] {
        &self.nodes
    }

    /// A handle per joined node, by name, to drive its stages.
    pub fn node_handles(&self) -> HashMap<String, NodeHandle> {
        self.nodes
            .iter()
            .map(|n| {
                (
                    n.info.name.clone(),
                    NodeHandle {
                        name: n.info.name.clone(),
                        agent: n.agent.clone(),
                        version: self.config.protocol_version,
                    },
                )
            })
            .collect()
    }

    fn caller(&self) -> Caller {
        Caller {
            version: self.config.protocol_version,
            timeout: self.config.rpc_timeout,
        }
    }

    fn peer_name(&self, id: ActorId) -> String {
        match id {
            ActorId::Remote { node_id, .. } => match self.peers.get(&node_id) {
                Some(addr) => format!("node at {addr}"),
                None => format!("node session {node_id}"),
            },
            ActorId::Local(pid) => format!("local actor {pid}"),
        }
    }

    /// Waits for `nodes` nodes of the job, at most `join_timeout` (CTL-7), greeting each with
    /// `spec` and `fingerprint` and admitting only those that speak this version and build
    /// the same model (CTL-6); then assigns ranks (the head is process 0 with one device per
    /// address in `head_devices`; CTL-4), draws the job token and prepares every node.
    /// On `Err`, call [`Head::shutdown`] to release the nodes that did join.
    pub async fn assemble(
        &mut self,
        nodes: usize,
        spec: &JobSpec,
        fingerprint: ModelFingerprint,
        head_devices: Vec<SocketAddr>,
        join_timeout: Duration,
    ) -> Result<Assembled, ControlError> {
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started + join_timeout);
        let scope = job_scope(&self.config.job);
        let group = AGENTS_GROUP.to_string();
        let caller = self.caller();
        let hello = ControlMsg::Hello(Hello {
            job: self.config.job.clone(),
            head: self.config.name.clone(),
            spec: spec.clone(),
            fingerprint,
        });
        let mut seen: HashSet<ActorId> = HashSet::new();
        let mut greetings: JoinSet<(ActorRef<AgentMsg>, String, Result<ControlMsg, ControlError>)> =
            JoinSet::new();
        let mut beats: JoinSet<(ActorId, String, Result<ControlMsg, ControlError>)> =
            JoinSet::new();
        let mut refused: Vec<(String, Incompatibility)> = Vec::new();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        let mut next_beat = Instant::now() + self.config.heartbeat_interval;
        while self.nodes.len() < nodes {
            tokio::select! {
                _ = tick.tick() => {
                    let members: Vec<ActorRef<AgentMsg>> = ractor::pg::get_scoped_members(&scope, &group)
                        .into_iter()
                        .filter(|cell| !cell.get_id().is_local())
                        .map(ActorRef::from)
                        .collect();
                    let present: HashSet<ActorId> = members.iter().map(|a| a.get_id()).collect();
                    for agent in members {
                        if seen.insert(agent.get_id()) {
                            let peer = self.peer_name(agent.get_id());
                            tracing::info!("{peer} appeared in job {}: greeting it", self.config.job);
                            let hello = hello.clone();
                            greetings.spawn(async move {
                                let reply = caller.call(&agent, &peer, &hello).await;
                                (agent, peer, reply)
                            });
                        }
                    }
                    self.nodes.retain(|n| {
                        let alive = present.contains(&n.agent.get_id());
                        if !alive {
                            tracing::warn!("node {} left before the world was assembled", n.info.name);
                        }
                        alive
                    });
                    if Instant::now() >= next_beat {
                        next_beat = Instant::now() + self.config.heartbeat_interval;
                        self.heartbeat_seq += 1;
                        let msg = ControlMsg::Heartbeat { seq: self.heartbeat_seq };
                        for n in &self.nodes {
                            let (agent, name, msg) = (n.agent.clone(), n.info.name.clone(), msg.clone());
                            beats.spawn(async move {
                                let reply = caller.call(&agent, &name, &msg).await;
                                (agent.get_id(), name, reply)
                            });
                        }
                    }
                }
                Some(done) = greetings.join_next() => {
                    let Ok((agent, peer, reply)) = done else { continue };
                    match reply {
                        Ok(ControlMsg::Welcome(info)) => {
                            let refusal = if info.fingerprint != fingerprint {
                                Some(Incompatibility::Fingerprint { head: fingerprint, node: info.fingerprint })
                            } else if self.nodes.len() >= nodes {
                                Some(Incompatibility::Other(format!("the job already has its {nodes} node(s)")))
                            } else if self.nodes.iter().any(|n| n.info.name == info.name) {
                                Some(Incompatibility::Other(format!("another node is named {}", info.name)))
                            } else {
                                None
                            };
                            let name = format!("{} ({peer})", info.name);
                            match refusal {
                                Some(why) => {
                                    tracing::warn!("refused {name}: {why}");
                                    caller.refuse(&agent, &why);
                                    refused.push((name, why));
                                }
                                None => {
                                    tracing::info!(
                                        "{name} joined with {} device(s) at {:?}",
                                        info.devices, info.data_addrs
                                    );
                                    self.nodes.push(JoinedNode { info, agent });
                                }
                            }
                        }
                        Ok(ControlMsg::Refused(why)) => {
                            tracing::warn!("{peer} refused to join: {why}");
                            refused.push((peer, why));
                        }
                        Ok(other) => {
                            let e = ControlError::UnexpectedReply { peer: peer.clone(), request: "Hello", reply: other.kind() };
                            tracing::warn!("{e}");
                            refused.push((peer, Incompatibility::Other(e.to_string())));
                        }
                        Err(e) => {
                            tracing::warn!("greeting failed: {e}");
                            refused.push((peer, Incompatibility::Other(e.to_string())));
                        }
                    }
                }
                Some(done) = beats.join_next() => {
                    let Ok((id, name, reply)) = done else { continue };
                    if !matches!(reply, Ok(ControlMsg::Alive { .. })) {
                        tracing::warn!("node {name} missed a heartbeat before the world was assembled: {reply:?}");
                        self.nodes.retain(|n| n.agent.get_id() != id);
                    }
                }
                event = self.cluster.events.recv() => match event {
                    Some(SessionEvent::Authenticated { node_id, peer }) => {
                        tracing::info!("control session from {peer} authenticated");
                        self.peers.insert(node_id, peer);
                    }
                    Some(SessionEvent::Closed { peer, authenticated: false, .. }) => {
                        tracing::warn!("the connection from {peer} closed before authentication (wrong secret?)");
                        refused.push((
                            format!("connection from {peer}"),
                            Incompatibility::Other("failed authentication (wrong secret?)".into()),
                        ));
                    }
                    Some(SessionEvent::Closed { peer, .. }) => {
                        tracing::info!("control session from {peer} closed");
                    }
                    None => return Err(ControlError::Runtime("the node server stopped".into())),
                },
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(ControlError::TooFewNodes {
                        expected: nodes,
                        joined: self.nodes.iter().map(|n| n.info.name.clone()).collect(),
                        refused,
                        waited: started.elapsed(),
                    });
                }
            }
        }
        greetings.abort_all();
        beats.abort_all();
        self.prepare(head_devices).await
    }

    /// Assigns ranks, draws the token and prepares every node, each acknowledging the ranks
    /// the world gives it.
    async fn prepare(&mut self, head_devices: Vec<SocketAddr>) -> Result<Assembled, ControlError> {
        let head = ProcessSlot {
            name: self.config.name.clone(),
            requested: None,
            data_addrs: head_devices,
        };
        let slots: Vec<ProcessSlot> = self
            .nodes
            .iter()
            .map(|n| ProcessSlot {
                name: n.info.name.clone(),
                requested: n.info.requested,
                data_addrs: n.info.data_addrs.clone(),
            })
            .collect();
        let world = assign_ranks(&head, &slots)?;
        // Keep the nodes in process order.
        let mut by_name: HashMap<String, JoinedNode> = self
            .nodes
            .drain(..)
            .map(|n| (n.info.name.clone(), n))
            .collect();
        self.nodes = world
            .processes
            .iter()
            .skip(1)
            .filter_map(|name| by_name.remove(name))
            .collect();
        let token = JobToken::random();
        let caller = self.caller();
        let mut acks = JoinSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let process = ProcessIndex(i as u32 + 1);
            let msg = ControlMsg::Prepare(Prepare {
                token: *token.as_bytes(),
                world: world.clone(),
                process,
            });
            let expected = world.ranks_of(process);
            let (agent, name) = (node.agent.clone(), node.info.name.clone());
            acks.spawn(async move {
                match caller.call(&agent, &name, &msg).await? {
                    ControlMsg::Prepared { ranks } if ranks == expected => Ok(()),
                    ControlMsg::Prepared { ranks } => Err(ControlError::InvalidPrepare(format!(
                        "{name} acknowledged ranks {ranks:?}, the world gives it {expected:?}"
                    ))),
                    ControlMsg::Refused(reason) => Err(ControlError::Refused {
                        peer: name,
                        by_head: false,
                        reason,
                    }),
                    other => Err(ControlError::UnexpectedReply {
                        peer: name,
                        request: "Prepare",
                        reply: other.kind(),
                    }),
                }
            });
        }
        while let Some(done) = acks.join_next().await {
            done.map_err(|e| ControlError::Runtime(format!("prepare task: {e}")))??;
        }
        Ok(Assembled { world, token })
    }

    /// One heartbeat round: every node's phase, or why it did not answer within the RPC
    /// time-out.
    pub async fn heartbeat(&mut self) -> Vec<(String, Result<NodePhase, ControlError>)> {
        self.heartbeat_seq += 1;
        let msg = ControlMsg::Heartbeat {
            seq: self.heartbeat_seq,
        };
        let caller = self.caller();
        let mut beats = JoinSet::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let (agent, name, msg) = (node.agent.clone(), node.info.name.clone(), msg.clone());
            beats.spawn(async move {
                let phase = match caller.call(&agent, &name, &msg).await {
                    Ok(ControlMsg::Alive { phase, .. }) => Ok(phase),
                    Ok(other) => Err(ControlError::UnexpectedReply {
                        peer: name.clone(),
                        request: "Heartbeat",
                        reply: other.kind(),
                    }),
                    Err(e) => Err(e),
                };
                (i, name, phase)
            });
        }
        let mut out: Vec<(usize, String, Result<NodePhase, ControlError>)> = beats.join_all().await;
        out.sort_by_key(|(i, _, _)| *i);
        out.into_iter().map(|(_, n, r)| (n, r)).collect()
    }

    /// Keeps the nodes' head time-outs from expiring while the job runs: a task sends every
    /// node a heartbeat each interval; a node that does not answer within the RPC time-out is
    /// reported once on [`KeepAlive::next_lost`] (the heartbeats ractor_cluster's own ping
    /// cannot give: it never times out). Dropping the handle stops the heartbeats.
    pub fn keep_alive(&self) -> KeepAlive {
        let caller = self.caller();
        let interval = self.config.heartbeat_interval;
        let nodes: Vec<(ActorRef<AgentMsg>, String)> = self
            .nodes
            .iter()
            .map(|n| (n.agent.clone(), n.info.name.clone()))
            .collect();
        let (tx, lost) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            let mut alive = nodes;
            let mut seq = 1u64 << 32;
            let mut tick = tokio::time::interval(interval);
            while !alive.is_empty() {
                tick.tick().await;
                seq += 1;
                let msg = ControlMsg::Heartbeat { seq };
                let mut beats = JoinSet::new();
                for (i, (agent, name)) in alive.iter().enumerate() {
                    let (agent, name, msg) = (agent.clone(), name.clone(), msg.clone());
                    beats.spawn(async move {
                        let result = match caller.call(&agent, &name, &msg).await {
                            Ok(ControlMsg::Alive { .. }) => Ok(()),
                            Ok(other) => Err(ControlError::UnexpectedReply {
                                peer: name,
                                request: "Heartbeat",
                                reply: other.kind(),
                            }),
                            Err(e) => Err(e),
                        };
                        (i, result)
                    });
                }
                let mut dead: Vec<(usize, ControlError)> = beats
                    .join_all()
                    .await
                    .into_iter()
                    .filter_map(|(i, r)| r.err().map(|e| (i, e)))
                    .collect();
                dead.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
                for (i, error) in dead {
                    let (_, name) = alive.remove(i);
                    let _ = tx.send((name, error));
                }
            }
        });
        KeepAlive { task, lost }
    }

    /// Tells every joined node to stop (`reason` is for their logs), waits for each Bye
    /// within the RPC time-out, then closes every session and the listener.
    pub async fn shutdown(mut self, reason: &str) -> Vec<(String, Result<(), ControlError>)> {
        let nodes = self.nodes.drain(..).collect();
        let out = say_bye(self.caller(), nodes, reason).await;
        // Let the nodes close their side first, so none reports a lost head.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.accept.abort();
        self.cluster.stop("job over");
        out
    }
}

/// Tells every node of `nodes` to stop and waits for each Bye within the RPC time-out; the
/// results in the nodes' order.
async fn say_bye(
    caller: Caller,
    nodes: Vec<JoinedNode>,
    reason: &str,
) -> Vec<(String, Result<(), ControlError>)> {
    let msg = ControlMsg::Shutdown {
        reason: reason.to_string(),
    };
    let mut byes = JoinSet::new();
    for (i, node) in nodes.into_iter().enumerate() {
        let (agent, name, msg) = (node.agent, node.info.name, msg.clone());
        byes.spawn(async move {
            let result = match caller.call(&agent, &name, &msg).await {
                Ok(ControlMsg::Bye) => Ok(()),
                Ok(other) => Err(ControlError::UnexpectedReply {
                    peer: name.clone(),
                    request: "Shutdown",
                    reply: other.kind(),
                }),
                Err(e) => Err(e),
            };
            (i, name, result)
        });
    }
    let mut out: Vec<(usize, String, Result<(), ControlError>)> = byes.join_all().await;
    out.sort_by_key(|(i, _, _)| *i);
    out.into_iter().map(|(_, n, r)| (n, r)).collect()
}

impl Drop for Head {
    fn drop(&mut self) {
        self.accept.abort();
        self.cluster.stop("head dropped");
    }
}

/// Heartbeats running in the background ([`Head::keep_alive`]); dropping it stops them.
#[derive(Debug)]
pub struct KeepAlive {
    task: tokio::task::JoinHandle<()>,
    lost: tokio::sync::mpsc::UnboundedReceiver<(String, ControlError)>,
}

impl KeepAlive {
    /// The next node that missed a heartbeat, with why; `None` once every node is lost.
    pub async fn next_lost(&mut self) -> Option<(String, ControlError)> {
        self.lost.recv().await
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.task.abort();
    }
}
