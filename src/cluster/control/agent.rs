//! The node side: [`NodeAgent`], the actor that answers the head, and [`run_node`], which
//! starts it, connects to the head and waits until the head ends the job or is lost.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::mpsc;

use super::protocol::{
    self, CONTROL_PROTOCOL_VERSION, CodecError, ControlMsg, Incompatibility, JobSpec,
    MAX_CONTROL_MESSAGE, ModelFingerprint, NodeInfo, NodePhase, Prepare,
};
use super::secret::ClusterSecret;
use super::session::{ClusterNode, SessionEvent};
use super::stages::{HostArgs, HostFactory, RemoteError, StageAnswer, StageHost};
use super::tls::NodeTls;
use super::world::{ProcessIndex, ProcessPlan};
use super::{AGENTS_GROUP, ControlError, HeadLoss, bind_data_plane, host_name, job_scope};
use crate::comm::net::link::JobToken;
use crate::device::BackendKind;
use crate::mesh::Rank;

/// A message to a node's agent. Across processes it travels as the control protocol's bytes
/// ([`protocol`]): ractor_cluster carries them, the agent decodes them itself (CTL-2).
#[derive(Debug)]
pub enum AgentMsg {
    /// A request from the head, answered with an encoded reply.
    Request {
        /// The encoded request.
        bytes: Vec<u8>,
        /// Where the encoded reply goes.
        reply: RpcReplyPort<Vec<u8>>,
    },
    /// A one-way message from the head (a refusal).
    Notice {
        /// The encoded message.
        bytes: Vec<u8>,
    },
}

const REQUEST: &str = "request";
const NOTICE: &str = "notice";

impl ractor::Message for AgentMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        Ok(match self {
            Self::Request { bytes, reply } => SerializedMessage::Call {
                variant: REQUEST.to_string(),
                args: bytes,
                reply,
                metadata: None,
            },
            Self::Notice { bytes } => SerializedMessage::Cast {
                variant: NOTICE.to_string(),
                args: bytes,
                metadata: None,
            },
        })
    }

    fn deserialize(message: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match message {
            SerializedMessage::Call {
                variant,
                args,
                reply,
                ..
            } if variant == REQUEST => Ok(Self::Request { bytes: args, reply }),
            SerializedMessage::Cast { variant, args, .. } if variant == NOTICE => {
                Ok(Self::Notice { bytes: args })
            }
            _ => Err(BoxedDowncastErr),
        }
    }
}

/// How a node computes the fingerprint of the model a job spec describes, with its own code;
/// an [`Incompatibility`] when it cannot build that model. Runs off the async runtime (RT-1).
pub type FingerprintFn =
    Arc<dyn Fn(&JobSpec) -> Result<ModelFingerprint, Incompatibility> + Send + Sync>;

/// What a node needs to join a job. Plain data with defaults for the limits.
#[derive(Clone)]
pub struct NodeConfig {
    /// The head's control address (`host:port`).
    pub head: String,
    /// The job's name (the process group scope).
    pub job: String,
    /// The shared secret.
    pub secret: ClusterSecret,
    /// Devices this node holds (one data-plane listener each).
    pub devices: u32,
    /// This node's name (unique in the job; default `host-pid`).
    pub name: String,
    /// The process index to ask for (from `RANK`/`SLURM_PROCID`).
    pub requested: Option<ProcessIndex>,
    /// How the node fingerprints the job's model.
    pub fingerprint: FingerprintFn,
    /// How long to try to reach the head and be greeted (default 60 s).
    pub join_timeout: Duration,
    /// How long the head may stay silent once joined (default 10 s; the head sends a
    /// heartbeat every second).
    pub head_timeout: Duration,
    /// The control protocol version to speak (this build's; tests pretend to be another).
    pub protocol_version: u16,
    /// Builds the node's stages once the head prepared it (`None`: the node joins and is
    /// prepared, but cannot train; the head's stage requests are refused).
    pub stages: Option<HostFactory>,
    /// TLS on the control plane (CTL-10): the authorities that sign the head's certificate
    /// (default none: plain TCP).
    pub tls: Option<NodeTls>,
    /// The backend this node's devices compute on (default Flex): a job whose spec names
    /// another is refused at its Hello, naming both, never trained on a mix of backends.
    pub backend: BackendKind,
}

impl std::fmt::Debug for NodeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeConfig")
            .field("head", &self.head)
            .field("job", &self.job)
            .field("devices", &self.devices)
            .field("name", &self.name)
            .field("requested", &self.requested)
            .field("join_timeout", &self.join_timeout)
            .field("head_timeout", &self.head_timeout)
            .field("protocol_version", &self.protocol_version)
            .field("tls", &self.tls)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl NodeConfig {
    /// A node of job `job` joining `head` with `devices` devices, named `host-pid`, that
    /// trains the model kinds of `models`: it fingerprints and builds the kind a job names,
    /// and refuses a job of another kind at its Hello.
    pub fn for_models(
        head: impl Into<String>,
        job: impl Into<String>,
        secret: ClusterSecret,
        devices: u32,
        models: &super::ModelRegistry,
    ) -> Self {
        let mut config = Self::new(head, job, secret, devices, models.fingerprint_fn());
        config.stages = Some(models.host_factory());
        config
    }

    /// A node of job `job` joining `head` with `devices` devices, named `host-pid`.
    pub fn new(
        head: impl Into<String>,
        job: impl Into<String>,
        secret: ClusterSecret,
        devices: u32,
        fingerprint: FingerprintFn,
    ) -> Self {
        Self {
            head: head.into(),
            job: job.into(),
            secret,
            devices,
            name: format!("{}-{}", host_name(), std::process::id()),
            requested: None,
            fingerprint,
            join_timeout: Duration::from_secs(60),
            head_timeout: Duration::from_secs(10),
            protocol_version: CONTROL_PROTOCOL_VERSION,
            stages: None,
            tls: None,
            backend: BackendKind::Flex,
        }
    }
}

/// What a node reports while it runs (for a progress line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeReport {
    /// The control session passed the challenge.
    Authenticated,
    /// The head greeted this node and accepted its answer.
    Welcomed {
        /// The head's name.
        head: String,
    },
    /// The world is known.
    Prepared {
        /// This node's view of it.
        plan: ProcessPlan,
    },
}

/// How a node's run ended well: the head shut it down.
#[derive(Debug)]
pub struct NodeOutcome {
    /// This node's view of the world, if the head prepared it.
    pub plan: Option<ProcessPlan>,
    /// The data-plane token, if prepared.
    pub token: Option<JobToken>,
    /// The data-plane listeners bound for the devices, in device order (ranks in
    /// `plan.ranks`).
    pub listeners: Vec<TcpListener>,
    /// Why the head shut the node down.
    pub reason: String,
    /// The steps each of its slots trained (empty without stages).
    pub trained: Vec<(Rank, u64)>,
    /// How each of its slots last joined the data plane (`StageHost::data_plane`).
    pub data_plane: Vec<(Rank, String)>,
}

/// What the agent tells the node's runner.
#[derive(Debug)]
enum AgentEvent {
    Greeted {
        head: String,
    },
    RefusedHead(Incompatibility),
    RefusedByHead(Incompatibility),
    Prepared {
        plan: ProcessPlan,
        token: JobToken,
    },
    Heard,
    Shutdown {
        reason: String,
        trained: Vec<(Rank, u64)>,
        data_plane: Vec<(Rank, String)>,
    },
    Failed(ControlError),
}

/// The actor that answers the head for one node (see the module's conversation).
#[derive(Debug)]
pub(crate) struct NodeAgent;

/// The agent's fixed facts and its phase.
pub(crate) struct AgentState {
    name: String,
    devices: u32,
    data_addrs: Vec<SocketAddr>,
    requested: Option<ProcessIndex>,
    fingerprint: FingerprintFn,
    backend: BackendKind,
    version: u16,
    phase: NodePhase,
    greeted: bool,
    events: mpsc::UnboundedSender<AgentEvent>,
    /// The job of the Hello.
    spec: Option<JobSpec>,
    /// Copies of the data-plane listeners (the runner keeps the originals), handed to the
    /// stage host at Prepare.
    listeners: Vec<TcpListener>,
    /// Builds the stage host at Prepare.
    factory: Option<HostFactory>,
    /// The stages, once prepared (with a factory).
    host: Option<Arc<dyn StageHost>>,
    /// The head's address as this node reaches it (`HostArgs::head`).
    head: Option<std::net::IpAddr>,
}

impl std::fmt::Debug for AgentState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentState")
            .field("name", &self.name)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

impl AgentState {
    fn tell(&self, event: AgentEvent) {
        let _ = self.events.send(event);
    }

    /// The answer to one request (a table: on X, check, tell the runner, reply Y).
    async fn answer(&mut self, bytes: &[u8]) -> ControlMsg {
        let request = match protocol::decode_as(bytes, self.version, MAX_CONTROL_MESSAGE) {
            Ok(request) => request,
            Err(CodecError::UnsupportedVersion { found, .. }) => {
                let why = Incompatibility::ProtocolVersion {
                    head: found,
                    node: self.version,
                };
                self.tell(AgentEvent::RefusedHead(why.clone()));
                return ControlMsg::Refused(why);
            }
            Err(error) => {
                self.tell(AgentEvent::Failed(ControlError::Codec {
                    peer: "the head".into(),
                    outgoing: false,
                    error: error.clone(),
                }));
                return ControlMsg::Refused(Incompatibility::Other(format!(
                    "malformed request: {error}"
                )));
            }
        };
        match request {
            ControlMsg::Hello(hello) => {
                self.tell(AgentEvent::Heard);
                if hello.spec.backend != self.backend {
                    let why = Incompatibility::Backend {
                        head: hello.spec.backend,
                        node: self.backend,
                    };
                    self.tell(AgentEvent::RefusedHead(why.clone()));
                    return ControlMsg::Refused(why);
                }
                if !hello.spec.job.transport.is_ready() {
                    let why = Incompatibility::Transport {
                        job: hello.spec.job.transport,
                    };
                    self.tell(AgentEvent::RefusedHead(why.clone()));
                    return ControlMsg::Refused(why);
                }
                let compute = self.fingerprint.clone();
                let spec = hello.spec.clone();
                let mine = tokio::task::spawn_blocking(move || compute(&spec))
                    .await
                    .unwrap_or_else(|e| {
                        Err(Incompatibility::Other(format!(
                            "fingerprinting the model failed: {e}"
                        )))
                    });
                let refusal = match mine {
                    Err(why) => why,
                    Ok(node) if node != hello.fingerprint => Incompatibility::Fingerprint {
                        head: hello.fingerprint,
                        node,
                    },
                    Ok(node) => {
                        self.greeted = true;
                        self.spec = Some(hello.spec.clone());
                        self.tell(AgentEvent::Greeted {
                            head: hello.head.clone(),
                        });
                        return ControlMsg::Welcome(NodeInfo {
                            name: self.name.clone(),
                            devices: self.devices,
                            data_addrs: self.data_addrs.clone(),
                            requested: self.requested,
                            fingerprint: node,
                        });
                    }
                };
                self.tell(AgentEvent::RefusedHead(refusal.clone()));
                ControlMsg::Refused(refusal)
            }
            ControlMsg::Prepare(prepare) => {
                self.tell(AgentEvent::Heard);
                match self
                    .check_prepare(&prepare)
                    .and_then(|plan| self.start_host(plan, &prepare))
                {
                    Ok(plan) => {
                        self.phase = NodePhase::Prepared;
                        let ranks = plan.ranks.clone();
                        self.tell(AgentEvent::Prepared {
                            plan,
                            token: JobToken::from_bytes(prepare.token),
                        });
                        ControlMsg::Prepared { ranks }
                    }
                    Err(detail) => {
                        self.tell(AgentEvent::Failed(ControlError::InvalidPrepare(
                            detail.clone(),
                        )));
                        ControlMsg::Refused(Incompatibility::Other(detail))
                    }
                }
            }
            ControlMsg::Heartbeat { seq } => {
                self.tell(AgentEvent::Heard);
                ControlMsg::Alive {
                    seq,
                    phase: self.phase,
                    step: None,
                }
            }
            ControlMsg::Shutdown { reason } => {
                let (trained, data_plane) = self
                    .host
                    .as_ref()
                    .map(|h| (h.steps_trained(), h.data_plane()))
                    .unwrap_or_default();
                if let Some(host) = &self.host {
                    host.stop();
                }
                self.tell(AgentEvent::Shutdown {
                    reason,
                    trained,
                    data_plane,
                });
                ControlMsg::Bye
            }
            ControlMsg::Stage(request) => {
                ControlMsg::StageDone(StageAnswer::Failed(RemoteError::Other(format!(
                    "{} for rank {}: this node has no stages ({})",
                    request.op.kind(),
                    request.slot.0,
                    if self.factory.is_none() {
                        "it cannot train"
                    } else {
                        "it was not prepared"
                    }
                ))))
            }
            other => ControlMsg::Refused(Incompatibility::Other(format!(
                "{} is not a request",
                other.kind()
            ))),
        }
    }

    /// A Prepare is served only if it comes after the Hello, its world is well formed and
    /// this node's ranks are exactly its devices at its listeners' addresses.
    fn check_prepare(&self, prepare: &Prepare) -> Result<ProcessPlan, String> {
        if !self.greeted {
            return Err("Prepare before Hello".into());
        }
        prepare.world.validate()?;
        let process = prepare.process;
        match prepare.world.processes.get(process.0 as usize) {
            Some(name) if *name == self.name => {}
            other => {
                return Err(format!(
                    "process {} is {other:?}, not this node ({})",
                    process.0, self.name
                ));
            }
        }
        let addrs: Vec<SocketAddr> = prepare
            .world
            .ranks
            .iter()
            .filter(|e| e.process == process)
            .map(|e| e.addr)
            .collect();
        if addrs != self.data_addrs {
            return Err(format!(
                "the world places this node's ranks at {addrs:?}, its devices listen at {:?}",
                self.data_addrs
            ));
        }
        Ok(prepare.world.plan_for(process))
    }

    /// With a factory: builds the stage host for `plan` (once; a second Prepare keeps it).
    fn start_host(&mut self, plan: ProcessPlan, prepare: &Prepare) -> Result<ProcessPlan, String> {
        let Some(factory) = &self.factory else {
            return Ok(plan);
        };
        if self.host.is_some() {
            return Ok(plan);
        }
        let spec = self.spec.clone().ok_or("Prepare before Hello")?;
        let host = factory(HostArgs {
            spec,
            plan: plan.clone(),
            token: JobToken::from_bytes(prepare.token),
            listeners: std::mem::take(&mut self.listeners),
            head: self.head,
        })
        .map_err(|e| format!("this node cannot build the job's stages: {e}"))?;
        self.host = Some(host);
        Ok(plan)
    }
}

/// Arguments of [`NodeAgent`].
pub(crate) struct AgentArgs {
    config: NodeConfig,
    data_addrs: Vec<SocketAddr>,
    listeners: Vec<TcpListener>,
    events: mpsc::UnboundedSender<AgentEvent>,
}

impl std::fmt::Debug for AgentArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentArgs")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Actor for NodeAgent {
    type Msg = AgentMsg;
    type State = AgentState;
    type Arguments = AgentArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: AgentArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join_scoped(
            job_scope(&args.config.job),
            AGENTS_GROUP.to_string(),
            vec![myself.get_cell()],
        );
        let head = std::net::ToSocketAddrs::to_socket_addrs(args.config.head.as_str())
            .ok()
            .and_then(|mut a| a.next())
            .map(|a| a.ip());
        Ok(AgentState {
            head,
            name: args.config.name,
            devices: args.config.devices,
            data_addrs: args.data_addrs,
            requested: args.config.requested,
            fingerprint: args.config.fingerprint,
            backend: args.config.backend,
            version: args.config.protocol_version,
            phase: NodePhase::Joined,
            greeted: false,
            events: args.events,
            spec: None,
            listeners: args.listeners,
            factory: args.config.stages,
            host: None,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(host) = state.host.take() {
            host.stop();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            AgentMsg::Request { bytes, reply } => {
                // A stage request runs on its own task: the steps of several slots run at
                // once, and heartbeats are answered meanwhile.
                if let Some(host) = &state.host
                    && let Ok(ControlMsg::Stage(request)) =
                        protocol::decode_as(&bytes, state.version, MAX_CONTROL_MESSAGE)
                {
                    state.phase = NodePhase::Training;
                    state.tell(AgentEvent::Heard);
                    let (host, version) = (host.clone(), state.version);
                    tokio::spawn(async move {
                        let answer = ControlMsg::StageDone(host.serve(request).await);
                        let bytes = protocol::encode_as(&answer, version, MAX_CONTROL_MESSAGE)
                            .or_else(|e| {
                                protocol::encode_as(
                                    &ControlMsg::StageDone(StageAnswer::Failed(
                                        RemoteError::Other(format!(
                                            "the node's answer cannot be sent: {e}"
                                        )),
                                    )),
                                    version,
                                    MAX_CONTROL_MESSAGE,
                                )
                            });
                        if let Ok(bytes) = bytes {
                            let _ = reply.send(bytes);
                        }
                    });
                    return Ok(());
                }
                let answer = state.answer(&bytes).await;
                match protocol::encode_as(&answer, state.version, MAX_CONTROL_MESSAGE) {
                    Ok(bytes) => {
                        let _ = reply.send(bytes);
                    }
                    Err(error) => state.tell(AgentEvent::Failed(ControlError::Codec {
                        peer: "the head".into(),
                        outgoing: true,
                        error,
                    })),
                }
            }
            AgentMsg::Notice { bytes } => {
                match protocol::decode_as(&bytes, state.version, MAX_CONTROL_MESSAGE) {
                    Ok(ControlMsg::Refused(why)) => state.tell(AgentEvent::RefusedByHead(why)),
                    Ok(other) => tracing::warn!("ignoring a {} notice from the head", other.kind()),
                    Err(error) => {
                        tracing::warn!("ignoring a malformed notice from the head: {error}")
                    }
                }
            }
        }
        Ok(())
    }
}

/// How long a node that refused the head, or was refused, lingers so its last reply reaches
/// the head before the process ends.
const LINGER: Duration = Duration::from_millis(300);

/// Runs a node until the head shuts it down (`Ok`) or the job cannot go on (`Err`): connects
/// to the head (retrying until the join time-out, so nodes may start before the head), binds a
/// data-plane listener per device on the address that connection leaves from, starts the
/// `NodeAgent` in the job's process group, lets ractor_cluster authenticate the connection,
/// and then follows the head (CTL-6..8).
/// `report` hears of each stage as it is reached.
pub async fn run_node(
    config: NodeConfig,
    mut report: impl FnMut(NodeReport) + Send,
) -> Result<NodeOutcome, ControlError> {
    let started = Instant::now();
    let join_deadline = started + config.join_timeout;
    let head = config.head.clone();
    let mut cluster = ClusterNode::start(&config.name, &config.secret).await?;

    // Connect first: the data plane listens on the interface that reaches the head.
    let stream = connect_until(&head, join_deadline, started).await;
    let stream = match stream {
        Ok(s) => s,
        Err(e) => {
            cluster.stop("head unreachable");
            return Err(e);
        }
    };
    let local_ip = stream
        .local_addr()
        .map(|a| a.ip())
        .map_err(|e| ControlError::Runtime(format!("control stream: {e}")))?;
    let listeners = bind_data_plane(local_ip, config.devices)?;
    let data_addrs = listeners
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ControlError::Bind {
            addr: local_ip.to_string(),
            reason: e.to_string(),
        })?;

    let (tx, mut events) = mpsc::unbounded_channel();
    let head_timeout = config.head_timeout;
    let tls = config.tls.clone();
    let (agent, _) = Actor::spawn(
        None,
        NodeAgent,
        AgentArgs {
            config,
            data_addrs,
            listeners: listeners
                .iter()
                .map(TcpListener::try_clone)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ControlError::Bind {
                    addr: local_ip.to_string(),
                    reason: e.to_string(),
                })?,
            events: tx,
        },
    )
    .await
    .map_err(|e| ControlError::Runtime(format!("node agent: {e}")))?;
    let stop = |cluster: &ClusterNode, reason: &str| {
        agent.stop(Some(reason.to_string()));
        cluster.stop(reason);
    };
    // CTL-10: with TLS, the head proves its certificate before ractor_cluster's challenge.
    let adopted = match &tls {
        None => cluster.adopt(stream, false),
        Some(tls) => match tls.connect(&head, stream).await {
            Ok(stream) => cluster.adopt_stream(stream, false),
            Err(e) => Err(e),
        },
    };
    if let Err(e) = adopted {
        stop(&cluster, "cannot hand over the control stream");
        return Err(e);
    }

    let mut authenticated = false;
    let mut greeted = false;
    let mut plan = None;
    let mut token = None;
    let mut trained = Vec::new();
    let mut data_plane = Vec::new();
    // Before the Hello: the join deadline; after it: the head time-out since last heard.
    let mut deadline = tokio::time::Instant::from_std(join_deadline);
    let outcome = loop {
        tokio::select! {
            event = events.recv() => match event {
                Some(AgentEvent::Heard) => {
                    if greeted {
                        deadline = tokio::time::Instant::now() + head_timeout;
                    }
                }
                Some(AgentEvent::Greeted { head: name }) => {
                    greeted = true;
                    deadline = tokio::time::Instant::now() + head_timeout;
                    report(NodeReport::Welcomed { head: name });
                }
                Some(AgentEvent::Prepared { plan: p, token: t }) => {
                    deadline = tokio::time::Instant::now() + head_timeout;
                    report(NodeReport::Prepared { plan: p.clone() });
                    plan = Some(p);
                    token = Some(t);
                }
                Some(AgentEvent::Shutdown { reason, trained: t, data_plane: d }) => {
                    trained = t;
                    data_plane = d;
                    break Ok(reason);
                }
                Some(AgentEvent::RefusedHead(reason)) => {
                    tokio::time::sleep(LINGER).await;
                    break Err(ControlError::Refused { peer: head.clone(), by_head: false, reason });
                }
                Some(AgentEvent::RefusedByHead(reason)) => {
                    break Err(ControlError::Refused { peer: head.clone(), by_head: true, reason });
                }
                Some(AgentEvent::Failed(e)) => {
                    tokio::time::sleep(LINGER).await;
                    break Err(e);
                }
                None => break Err(ControlError::Runtime("the node agent stopped".into())),
            },
            session = cluster.events.recv() => match session {
                Some(SessionEvent::Authenticated { .. }) => {
                    authenticated = true;
                    report(NodeReport::Authenticated);
                }
                Some(SessionEvent::Closed { authenticated: false, .. }) if !authenticated => {
                    break Err(ControlError::AuthenticationFailed { head: head.clone() });
                }
                Some(SessionEvent::Closed { .. }) => {
                    break Err(ControlError::HeadLost { head: head.clone(), reason: HeadLoss::SessionClosed });
                }
                None => break Err(ControlError::Runtime("the node server stopped".into())),
            },
            _ = tokio::time::sleep_until(deadline) => {
                break Err(if greeted {
                    ControlError::HeadLost { head: head.clone(), reason: HeadLoss::Silent(head_timeout) }
                } else {
                    ControlError::NotGreeted { head: head.clone(), waited: started.elapsed() }
                });
            }
        }
    };
    // Let the Bye (or the refusal) reach the head before the sessions close.
    if outcome.is_ok() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop(&cluster, "node done");
    outcome.map(|reason| NodeOutcome {
        plan,
        token,
        listeners,
        reason,
        trained,
        data_plane,
    })
}

/// Connects to `head`, retrying every 100 ms until `deadline` (CTL-7).
async fn connect_until(
    head: &str,
    deadline: Instant,
    started: Instant,
) -> Result<tokio::net::TcpStream, ControlError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(left, tokio::net::TcpStream::connect(head)).await;
        let reason = match attempt {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "connection attempt timed out".to_string(),
        };
        if Instant::now() + Duration::from_millis(100) >= deadline {
            return Err(ControlError::HeadUnreachable {
                head: head.to_string(),
                waited: started.elapsed(),
                reason,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
