//! The parameter server across processes (`JobBuilder::parameter_server` or `backup_workers`
//! with `.cluster(..)`): the server's actor runs on the head, each worker on its node, and a
//! worker talks to the server through a [`ServerLink`] — an actor in the worker's process
//! that answers the same [`ServerMsg`]s as the server, by frames over one token-checked TCP
//! link to the head's [`Gateway`], which turns them back into messages to the server. The
//! worker's code is the in-process worker's; only its server is a link.
//!
//! ```text
//! node: WorkerActor ─ServerMsg─► ServerLink ══ TCP link (PsRequest / PsResponse frames) ══►
//! head: Gateway (a reader per worker) ─ServerMsg─► ServerActor
//! ```
//!
//! - **PSX-1** every request the worker waits for is answered on the frame that names it
//!   (`id`), whatever the order the server answers in (a round's end comes after its pulls);
//!   the worker's own bounds (PSA-1) apply unchanged.
//! - **PSX-2** a worker whose link breaks (its process died) leaves the server (PSA-2), named
//!   with why; a server that cannot be reached fails every waiting request at once (its
//!   reply is dropped: `ParameterServerError::ShardLost`).
//! - **PSX-3** a frame is decoded under the link's frame limit and bincode's; one that does
//!   not decode breaks that link only (its worker leaves), never the server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::actors::parameter_server::{PullAnswer, ServerMsg, ServerState};
use crate::comm::net::link::{
    JobToken, Link, LinkCloser, LinkConfig, LinkError, LinkListener, LinkReader, LinkWriter,
};
use crate::mesh::Rank;
use crate::parallel::parameter_server::WorkerRound;
use crate::parallel::zero::{FlatRule, FlatState};

/// The gateway's rank on its links (workers connect as their worker id).
const GATEWAY: Rank = Rank(u32::MAX);

/// How long a link's reader waits for its next frame: a pump, not an operation (every request
/// is bounded where it is waited for; the pump ends when its link is shut or its peer goes).
const PUMP_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A worker's message to the server, on the wire.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum PsRequest {
    /// `ServerMsg::Init`.
    Init(Vec<f32>),
    /// `ServerMsg::Params` (answered with `Params`).
    Params,
    /// `ServerMsg::Begin` (answered with `Round` at the round's end).
    Begin {
        worker: u32,
        step: u64,
        micro_batches: Vec<Vec<usize>>,
        global: usize,
    },
    /// `ServerMsg::Pull` (answered with `Work` or `RoundOver`).
    Pull { worker: u32, step: u64 },
    /// `ServerMsg::Push`.
    Push {
        worker: u32,
        step: u64,
        item: usize,
        grads: Vec<f32>,
        loss_sum: f64,
    },
    /// `ServerMsg::Leave`.
    Leave { worker: u32, reason: String },
    /// `ServerMsg::State` (answered with `State`).
    State,
    /// `ServerMsg::Restore` (answered with `Restored`).
    Restore {
        params: Vec<f32>,
        optimizer: FlatState,
    },
}

/// The server's answer to a request, on the wire.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum PsResponse {
    Params(Vec<f32>),
    Round(Result<WorkerRound, String>),
    Work {
        item: usize,
        clock: u64,
        micro_batches: Vec<Vec<usize>>,
        params: Vec<f32>,
    },
    RoundOver,
    State {
        params: Vec<f32>,
        optimizer: FlatState,
        rule: FlatRule,
    },
    Restored,
}

fn encode<T: Serialize>(id: u64, body: &T) -> Result<Vec<u8>, String> {
    bincode::serde::encode_to_vec((id, body), bincode::config::standard())
        .map_err(|e| e.to_string())
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], limit: u64) -> Result<(u64, T), String> {
    // PSX-3: no length inside the frame allocates more than the frame could carry.
    let config = bincode::config::standard().with_limit::<{ 1 << 30 }>();
    if bytes.len() as u64 > limit {
        return Err(format!("a frame of {} bytes", bytes.len()));
    }
    match bincode::serde::decode_from_slice::<(u64, T), _>(bytes, config) {
        Ok((v, used)) if used == bytes.len() => Ok(v),
        Ok((_, used)) => Err(format!("{} bytes left over", bytes.len() - used)),
        Err(e) => Err(e.to_string()),
    }
}

/// Sends one frame on a shared writer, bounded by the link's I/O time-out.
fn send(writer: &Mutex<LinkWriter>, bytes: &[u8], timeout: Duration) -> Result<(), LinkError> {
    writer
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(bytes, Instant::now() + timeout)
}

/// What a request waits for on the worker's side.
enum Pending {
    Params(ractor::RpcReplyPort<Arc<Vec<f32>>>),
    Round(oneshot::Sender<Result<WorkerRound, String>>),
    Pull(mpsc::Sender<PullAnswer>),
    State(ractor::RpcReplyPort<ServerState>),
    Restored(ractor::RpcReplyPort<()>),
}

/// A worker's server in another process (PSX-1): answers the worker's [`ServerMsg`]s over
/// its link to the head's [`Gateway`].
#[derive(Debug, Default)]
pub(crate) struct ServerLink;

/// Where a [`ServerLink`] connects.
#[derive(Debug)]
pub(crate) struct ServerLinkArgs {
    pub(crate) gateway: SocketAddr,
    pub(crate) worker: u32,
    pub(crate) token: JobToken,
    pub(crate) config: LinkConfig,
    /// The job's emulated link (EMU-1): a pull waits for the server's link to carry the
    /// parameters, a push for the worker's to carry the gradient, as in one process.
    pub(crate) emulated: Option<crate::comm::emulate::LinkEmulation>,
}

/// State of a [`ServerLink`].
pub(crate) struct ServerLinkState {
    writer: Arc<Mutex<LinkWriter>>,
    closer: LinkCloser,
    pending: Arc<Mutex<HashMap<u64, Pending>>>,
    next: u64,
    io_timeout: Duration,
}

impl std::fmt::Debug for ServerLinkState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerLinkState({:?})", self.closer.peer())
    }
}

impl Actor for ServerLink {
    type Msg = ServerMsg;
    type State = ServerLinkState;
    type Arguments = ServerLinkArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<ServerMsg>,
        a: ServerLinkArgs,
    ) -> Result<ServerLinkState, ActorProcessingErr> {
        let link = tokio::task::spawn_blocking(move || {
            Link::connect(a.gateway, Rank(a.worker), GATEWAY, &a.token, a.config)
        })
        .await??;
        let max = link.config().max_payload;
        let io_timeout = a.config.io_timeout;
        let (writer, reader, closer) = link.split()?;
        let pending: Arc<Mutex<HashMap<u64, Pending>>> = Arc::default();
        let answers = pending.clone();
        std::thread::Builder::new()
            .name(format!("meshwork-ps-link-{}", a.worker))
            .spawn(move || read_answers(reader, max, &answers))?;
        Ok(ServerLinkState {
            writer: Arc::new(Mutex::new(writer)),
            closer,
            pending,
            next: 0,
            io_timeout,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ServerMsg>,
        s: &mut ServerLinkState,
    ) -> Result<(), ActorProcessingErr> {
        s.closer.shutdown();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<ServerMsg>,
        msg: ServerMsg,
        s: &mut ServerLinkState,
    ) -> Result<(), ActorProcessingErr> {
        let (request, waits) = match msg {
            ServerMsg::Init(p) => (PsRequest::Init(p), None),
            ServerMsg::Params(r) => (PsRequest::Params, Some(Pending::Params(r))),
            ServerMsg::Begin {
                worker,
                step,
                micro_batches,
                global,
                done,
            } => (
                PsRequest::Begin {
                    worker,
                    step,
                    micro_batches,
                    global,
                },
                Some(Pending::Round(done)),
            ),
            ServerMsg::Pull {
                worker,
                step,
                reply,
            } => (PsRequest::Pull { worker, step }, Some(Pending::Pull(reply))),
            ServerMsg::Push {
                worker,
                step,
                item,
                grads,
                loss_sum,
            } => (
                PsRequest::Push {
                    worker,
                    step,
                    item,
                    grads,
                    loss_sum,
                },
                None,
            ),
            ServerMsg::Leave { worker, reason } => (PsRequest::Leave { worker, reason }, None),
            ServerMsg::State(r) => (PsRequest::State, Some(Pending::State(r))),
            ServerMsg::Restore {
                params,
                optimizer,
                reply,
            } => (
                PsRequest::Restore { params, optimizer },
                Some(Pending::Restored(reply)),
            ),
            // The head's server watches its workers through their links (PSX-2).
            ServerMsg::Watch(_) | ServerMsg::Tick => return Ok(()),
        };
        let id = s.next;
        s.next += 1;
        if let Some(w) = waits {
            lock(&s.pending).insert(id, w);
        }
        let sent = encode(id, &request)
            .map_err(|e| e.to_string())
            .and_then(|bytes| send(&s.writer, &bytes, s.io_timeout).map_err(|e| e.to_string()));
        if let Err(e) = sent {
            // PSX-2: nothing will answer; the waiting caller sees its reply dropped.
            tracing::warn!("the parameter server's link failed: {e}");
            lock(&s.pending).clear();
            s.closer.shutdown();
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The worker's side of a link: hands each answer to the request it names (PSX-1); when the
/// link ends, every waiting request is dropped (PSX-2).
fn read_answers(mut reader: LinkReader, max: u64, pending: &Mutex<HashMap<u64, Pending>>) {
    let mut buf = Vec::new();
    loop {
        if let Err(e) = reader.recv(&mut buf, max, Instant::now() + PUMP_WAIT) {
            tracing::debug!("the parameter server's link ended: {e}");
            break;
        }
        let (id, answer) = match decode::<PsResponse>(&buf, max) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!("a parameter-server answer does not decode: {e}");
                break;
            }
        };
        let Some(waiting) = lock(pending).remove(&id) else {
            continue;
        };
        match (waiting, answer) {
            (Pending::Params(r), PsResponse::Params(p)) => {
                let _ = r.send(Arc::new(p));
            }
            (Pending::Round(r), PsResponse::Round(round)) => {
                let _ = r.send(round);
            }
            (
                Pending::Pull(r),
                PsResponse::Work {
                    item,
                    clock,
                    micro_batches,
                    params,
                },
            ) => {
                let _ = r.send(PullAnswer::Work {
                    item,
                    clock,
                    micro_batches,
                    params: Arc::new(params),
                });
            }
            (Pending::Pull(r), PsResponse::RoundOver) => {
                let _ = r.send(PullAnswer::RoundOver);
            }
            (
                Pending::State(r),
                PsResponse::State {
                    params,
                    optimizer,
                    rule,
                },
            ) => {
                let _ = r.send((Arc::new(params), optimizer, rule));
            }
            (Pending::Restored(r), PsResponse::Restored) => {
                let _ = r.send(());
            }
            (_, other) => {
                tracing::warn!("request {id} answered with {other:?}");
            }
        }
    }
    lock(pending).clear();
}

/// The head's side (PSX-1, PSX-2): accepts one link per worker and turns each of its
/// requests into the same message to the server; ends every link when dropped.
pub(crate) struct Gateway {
    port: u16,
    closers: Arc<Mutex<Vec<LinkCloser>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gateway(port {})", self.port)
    }
}

impl Gateway {
    /// A gateway to `server` on every interface (any free port), taking links of the job
    /// `token`; its accept loop ends when the gateway is dropped.
    pub(crate) fn start(
        server: ActorRef<ServerMsg>,
        token: JobToken,
        config: LinkConfig,
        wait: Duration,
    ) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Handle::current();
        let listener = LinkListener::bind(("0.0.0.0", 0), GATEWAY, token, config)?;
        let port = listener.local_addr()?.port();
        let closers: Arc<Mutex<Vec<LinkCloser>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (links, stopped) = (closers.clone(), stop.clone());
        std::thread::Builder::new()
            .name("meshwork-ps-gateway".into())
            .spawn(move || {
                while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    match listener.accept_within(Duration::from_millis(200)) {
                        Ok(link) => {
                            let to = Forward {
                                server: server.clone(),
                                runtime: runtime.clone(),
                                wait,
                            };
                            if let Err(e) = serve(link, to, &links) {
                                tracing::warn!("a parameter-server worker's link: {e}");
                            }
                        }
                        Err(LinkError::Timeout { .. }) => {}
                        Err(e) => tracing::warn!("the parameter-server gateway: {e}"),
                    }
                }
            })?;
        Ok(Self {
            port,
            closers,
            stop,
        })
    }

    /// The port workers connect to (at the address they reach the head at).
    pub(crate) fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for c in lock(&self.closers).iter() {
            c.shutdown();
        }
    }
}

/// Serves one worker's link: a reader thread turning requests into server messages, each
/// answer written back by a thread of its own when it comes (bounded by `wait`).
fn serve(link: Link, to: Forward, closers: &Mutex<Vec<LinkCloser>>) -> Result<(), String> {
    let worker = link.peer().rank.map_or(u32::MAX, |r| r.0);
    let max = link.config().max_payload;
    let io_timeout = link.config().io_timeout;
    let (writer, mut reader, closer) = link.split().map_err(|e| e.to_string())?;
    lock(closers).push(closer);
    let writer = Arc::new(Mutex::new(writer));
    std::thread::Builder::new()
        .name(format!("meshwork-ps-worker-{worker}"))
        .spawn(move || {
            let mut buf = Vec::new();
            let why = loop {
                if let Err(e) = reader.recv(&mut buf, max, Instant::now() + PUMP_WAIT) {
                    break format!("its link to the server broke: {e}");
                }
                match decode::<PsRequest>(&buf, max) {
                    Ok((id, request)) => to.forward(id, request, &writer, io_timeout),
                    Err(e) => break format!("a request that does not decode: {e}"),
                }
            };
            // PSX-2: the worker is gone (or its process is); the others go on without it.
            let _ = to.server.cast(ServerMsg::Leave {
                worker,
                reason: why,
            });
        })
        .map_err(|e| format!("worker {worker}: {e}"))?;
    Ok(())
}

/// Where a gateway's requests go: the server, and the runtime an answer is awaited on.
struct Forward {
    server: ActorRef<ServerMsg>,
    runtime: tokio::runtime::Handle,
    /// How long an answer may take (the step time-out: a round's end waits for the round).
    wait: Duration,
}

/// One request to the server; an answer it waits for is written back from a thread of its own.
impl Forward {
    fn forward(
        &self,
        id: u64,
        request: PsRequest,
        writer: &Arc<Mutex<LinkWriter>>,
        io_timeout: Duration,
    ) {
        let (server, wait, runtime) = (&self.server, self.wait, self.runtime.clone());
        let reply = |answer: Box<dyn FnOnce() -> Option<PsResponse> + Send>| {
            let writer = writer.clone();
            let _ = std::thread::Builder::new()
                .name("meshwork-ps-answer".into())
                .spawn(move || {
                    if let Some(a) = answer()
                        && let Ok(bytes) = encode(id, &a)
                        && let Err(e) = send(&writer, &bytes, io_timeout)
                    {
                        tracing::debug!("a parameter-server answer was not sent: {e}");
                    }
                });
        };
        let cast = |m: ServerMsg| {
            let _ = server.cast(m);
        };
        match request {
            PsRequest::Init(p) => cast(ServerMsg::Init(p)),
            PsRequest::Push {
                worker,
                step,
                item,
                grads,
                loss_sum,
            } => cast(ServerMsg::Push {
                worker,
                step,
                item,
                grads,
                loss_sum,
            }),
            PsRequest::Leave { worker, reason } => cast(ServerMsg::Leave { worker, reason }),
            PsRequest::Params => {
                let (tx, rx) = oneshot::channel();
                cast(ServerMsg::Params(tx.into()));
                reply(Box::new(move || {
                    blocking(&runtime, rx, wait).map(|p| PsResponse::Params(p.as_ref().clone()))
                }));
            }
            PsRequest::Begin {
                worker,
                step,
                micro_batches,
                global,
            } => {
                let (done, rx) = oneshot::channel();
                cast(ServerMsg::Begin {
                    worker,
                    step,
                    micro_batches,
                    global,
                    done,
                });
                reply(Box::new(move || {
                    blocking(&runtime, rx, wait).map(PsResponse::Round)
                }));
            }
            PsRequest::Pull { worker, step } => {
                let (tx, rx) = mpsc::channel();
                cast(ServerMsg::Pull {
                    worker,
                    step,
                    reply: tx,
                });
                reply(Box::new(move || {
                    rx.recv_timeout(wait).ok().map(|a| match a {
                        PullAnswer::Work {
                            item,
                            clock,
                            micro_batches,
                            params,
                        } => PsResponse::Work {
                            item,
                            clock,
                            micro_batches,
                            params: params.as_ref().clone(),
                        },
                        PullAnswer::RoundOver => PsResponse::RoundOver,
                    })
                }));
            }
            PsRequest::State => {
                let (tx, rx) = oneshot::channel();
                cast(ServerMsg::State(tx.into()));
                reply(Box::new(move || {
                    blocking(&runtime, rx, wait).map(|(params, optimizer, rule)| {
                        PsResponse::State {
                            params: params.as_ref().clone(),
                            optimizer,
                            rule,
                        }
                    })
                }));
            }
            PsRequest::Restore { params, optimizer } => {
                let (tx, rx) = oneshot::channel();
                cast(ServerMsg::Restore {
                    params,
                    optimizer,
                    reply: tx.into(),
                });
                reply(Box::new(move || {
                    blocking(&runtime, rx, wait).map(|()| PsResponse::Restored)
                }));
            }
        }
    }
}

/// Waits for a oneshot's value on a plain thread, at most `wait`.
fn blocking<T>(
    runtime: &tokio::runtime::Handle,
    rx: oneshot::Receiver<T>,
    wait: Duration,
) -> Option<T> {
    // The timer is made inside the runtime's context (the async block), not on this thread.
    runtime
        .block_on(async move { tokio::time::timeout(wait, rx).await })
        .ok()
        .and_then(Result::ok)
}

/// The slots of a parameter-server job in a node's process: each a worker whose server is a
/// [`ServerLink`] to the head's gateway.
pub(crate) struct PsWorkerSlots<M, I> {
    pub(crate) spec: Arc<crate::actors::stage::StageSpec<M, I>>,
    pub(crate) rule: FlatRule,
    pub(crate) lr: f64,
}

impl<M, I> super::SlotFactory<M> for PsWorkerSlots<M, I>
where
    M: burn::module::Module + 'static,
    I: Send + Sync + 'static,
{
    fn pipeline(&self) -> Option<Arc<crate::parallel::pipeline::PipelineSchedule>> {
        None
    }

    fn spawn(&self, start: super::SlotStart) -> super::SlotFuture<M> {
        let (spec, rule, lr) = (self.spec.clone(), self.rule, self.lr);
        Box::pin(async move {
            let id = start.id;
            let link = start
                .server
                .ok_or_else(|| format!("{id}: a parameter-server worker without its server"))?;
            let gateway = link.gateway;
            let wait = link.config.io_timeout;
            let emulated = link.emulated.clone();
            let (server, _) = Actor::spawn(None, ServerLink, link)
                .await
                .map_err(|e| format!("{id} cannot reach the parameter server at {gateway}: {e}"))?;
            let worker = crate::actors::parameter_server::WorkerServer {
                server,
                rule,
                lr,
                wait,
                // The head's Supervisor bounds the step; the worker's own wait for its round
                // ends a little after it.
                round_wait: wait * 4,
            };
            crate::actors::parameter_server::spawn_remote_worker(
                spec,
                (id, start.rank.0),
                (start.device, start.device_actor),
                worker,
                emulated,
            )
            .await
            .map_err(|e| format!("cannot start {id}: {e}"))
        })
    }
}

/// The spawner of a parameter-server job across processes: the server's actor and its
/// [`Gateway`] on the head, a worker in every slot (each told the gateway's port at `Start`);
/// the trained model is the server's, read through worker 0 (PSA-3).
pub(crate) struct ClusterParameterServer<M, I> {
    pub(crate) mesh: super::ClusterMesh,
    pub(crate) spec: Arc<crate::actors::stage::StageSpec<M, I>>,
    pub(crate) mode: crate::parallel::parameter_server::Mode,
    pub(crate) rule: FlatRule,
    pub(crate) lr: f64,
}

impl<M, I> crate::actors::spawner::Spawner<M> for ClusterParameterServer<M, I>
where
    M: burn::module::Module + 'static,
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> crate::actors::spawner::Capabilities {
        crate::actors::parameter_server::capabilities(crate::actors::spawner::Rejoin::Reconnect)
    }

    fn spawn(
        self: Box<Self>,
        cx: crate::actors::spawner::SpawnContext,
    ) -> crate::actors::spawner::SpawnFuture<M> {
        let ClusterParameterServer {
            mesh,
            spec,
            mode,
            rule,
            lr,
        } = *self;
        let faults = spec.faults.clone();
        let device = mesh.model_device.burn().clone();
        let model_fn = spec.model_fn.clone();
        let rebuild: super::Rebuild<M> = Arc::new(
            move |id: crate::mesh::StageId, shards: Vec<crate::checkpoint::ShardSnapshot>| {
                let shard = shards
                    .into_iter()
                    .next()
                    .ok_or_else(|| format!("the snapshot of {id} has no shard"))?;
                let cx = crate::parallel::ModelContext {
                    rank: Rank(id.replica),
                    device: device.clone(),
                };
                crate::checkpoint::restore_module(model_fn(&cx), &shard.params)
                    .map_err(|e| format!("the model of {id} does not restore: {e}"))
            },
        );
        let world = mesh.world_size() as u32;
        Box::pin(async move {
            let (server, _) = Actor::spawn(
                None,
                crate::actors::parameter_server::ServerActor,
                crate::actors::parameter_server::ServerArgs::new(mode, rule, lr, world),
            )
            .await?;
            let link = LinkConfig {
                io_timeout: cx.comm.timeout,
                ..LinkConfig::default()
            };
            let gateway =
                Gateway::start(server.clone(), mesh.token.clone(), link, cx.step_timeout)?;
            let shape = super::Shape {
                layout: crate::mesh::Layout::data_parallel(world)?,
                pipelined: false,
                faults,
                rebuild,
                model_ranks: vec![0],
                assemble: |mut models: Vec<M>| models.pop(),
                server: Some(gateway.port()),
            };
            let mut spawned = mesh.spawn_all(shape, cx).await?;
            // The server and its gateway end with the job.
            let shutdown = spawned.shutdown.clone();
            let kept = Mutex::new(Some(gateway));
            spawned.shutdown = Arc::new(move || {
                shutdown();
                server.stop(Some("the job ended".into()));
                drop(lock(&kept).take());
            });
            Ok(spawned)
        })
    }
}
