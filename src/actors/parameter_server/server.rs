//! The parameter server's actor (`ServerActor`): one shard of the parameters and optimizer
//! state, a `ServerCore` driven by the workers' pushes and pulls and a watch tick, and the
//! guard that stops it when the last worker goes.

use super::*;

/// What a device thread's pull is answered with.
#[derive(Debug)]
pub(crate) enum PullAnswer {
    /// Compute `item` (these micro-batches) at `clock` on `params`.
    Work {
        item: ItemId,
        clock: u64,
        micro_batches: Vec<Vec<usize>>,
        params: Arc<Vec<f32>>,
    },
    /// The round is over.
    RoundOver,
}

/// The server's parameters, optimizer state and rule.
pub(crate) type ServerState = (Arc<Vec<f32>>, FlatState, FlatRule);

/// Messages a [`ServerActor`] handles.
pub(crate) enum ServerMsg {
    /// Worker 0's initial parameters (DP-1's rank 0); later ones are ignored.
    Init(Vec<f32>),
    /// The parameters, once initialized.
    Params(RpcReplyPort<Arc<Vec<f32>>>),
    /// `worker` starts `step` with its share; `done` gets its part of the round.
    Begin {
        worker: WorkerId,
        step: u64,
        micro_batches: Vec<Vec<usize>>,
        global: usize,
        done: oneshot::Sender<std::result::Result<WorkerRound, String>>,
    },
    /// A device thread asks for work in `step`.
    Pull {
        worker: WorkerId,
        step: u64,
        reply: mpsc::Sender<PullAnswer>,
    },
    /// A device thread's gradient of `item` and its loss summed over the item's samples.
    Push {
        worker: WorkerId,
        step: u64,
        item: ItemId,
        grads: Vec<f32>,
        loss_sum: f64,
    },
    /// `worker`'s device thread failed (PSA-2).
    Leave { worker: WorkerId, reason: String },
    /// The workers' actors: a worker whose actor ended (a killed device) leaves (PSA-2).
    Watch(Vec<(WorkerId, ractor::ActorCell)>),
    /// Look for ended workers (every [`WATCH_EVERY`]).
    Tick,
    /// The parameters, the optimizer state and the rule (a checkpoint, PSA-3).
    State(RpcReplyPort<ServerState>),
    /// Take a checkpoint's parameters and optimizer state.
    Restore {
        params: Vec<f32>,
        optimizer: FlatState,
        reply: RpcReplyPort<()>,
    },
}

impl std::fmt::Debug for ServerMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerMsg::Init(_) => write!(f, "Init"),
            ServerMsg::Params(_) => write!(f, "Params"),
            ServerMsg::Begin { worker, step, .. } => write!(f, "Begin({worker}, {step})"),
            ServerMsg::Pull { worker, step, .. } => write!(f, "Pull({worker}, {step})"),
            ServerMsg::Push { worker, item, .. } => write!(f, "Push({worker}, {item})"),
            ServerMsg::Leave { worker, .. } => write!(f, "Leave({worker})"),
            ServerMsg::Watch(_) => write!(f, "Watch"),
            ServerMsg::Tick => write!(f, "Tick"),
            ServerMsg::State(_) => write!(f, "State"),
            ServerMsg::Restore { .. } => write!(f, "Restore"),
        }
    }
}

#[cfg(feature = "cluster")]
impl ractor::Message for ServerMsg {}

/// The parameter server (one shard).
#[derive(Debug, Default)]
pub(crate) struct ServerActor;

/// What the server starts from.
#[derive(Debug)]
pub(crate) struct ServerArgs {
    pub(super) mode: Mode,
    pub(super) rule: FlatRule,
    pub(super) lr: f64,
    pub(super) workers: u32,
}

impl ServerArgs {
    /// A server of `workers` workers in `mode`, stepping with `rule` at `lr`.
    pub(crate) fn new(mode: Mode, rule: FlatRule, lr: f64, workers: u32) -> Self {
        Self {
            mode,
            rule,
            lr,
            workers,
        }
    }
}

/// State of a [`ServerActor`].
#[derive(Debug)]
pub(crate) struct ServerActorState {
    pub(super) args: ServerArgs,
    pub(super) core: Option<ServerCore>,
    pub(super) waiting: Vec<RpcReplyPort<Arc<Vec<f32>>>>,
    pub(super) pulls: BTreeMap<WorkerId, mpsc::Sender<PullAnswer>>,
    pub(super) done: BTreeMap<WorkerId, oneshot::Sender<std::result::Result<WorkerRound, String>>>,
    /// The workers' actors, until they leave.
    pub(super) watched: Vec<(WorkerId, ractor::ActorCell)>,
    /// The timer of `Tick`s.
    pub(super) ticks: Option<tokio::task::JoinHandle<()>>,
}

/// How often the server looks for ended workers.
pub(super) const WATCH_EVERY: Duration = Duration::from_millis(50);

impl Actor for ServerActor {
    type Msg = ServerMsg;
    type State = ServerActorState;
    type Arguments = ServerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<ServerMsg>,
        args: ServerArgs,
    ) -> std::result::Result<ServerActorState, ActorProcessingErr> {
        Ok(ServerActorState {
            args,
            core: None,
            waiting: Vec::new(),
            pulls: BTreeMap::new(),
            done: BTreeMap::new(),
            watched: Vec::new(),
            ticks: None,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<ServerMsg>,
        s: &mut ServerActorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        if let Some(t) = s.ticks.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<ServerMsg>,
        msg: ServerMsg,
        s: &mut ServerActorState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        match msg {
            ServerMsg::Watch(workers) => {
                s.watched = workers;
                s.ticks = Some(myself.send_interval(WATCH_EVERY, || ServerMsg::Tick));
            }
            ServerMsg::Tick => {
                // A killed actor never says so: its status does.
                let ended: Vec<WorkerId> = s
                    .watched
                    .iter()
                    .filter(|(_, cell)| {
                        matches!(
                            cell.get_status(),
                            ractor::ActorStatus::Stopping | ractor::ActorStatus::Stopped
                        )
                    })
                    .map(|(w, _)| *w)
                    .collect();
                for worker in ended {
                    s.watched.retain(|(w, _)| *w != worker);
                    leave(s, worker, "its actor ended".into());
                }
            }
            ServerMsg::Init(params) => {
                if s.core.is_none() {
                    let a = &s.args;
                    let core = ServerCore::new(a.mode, a.rule, a.lr, a.workers, params);
                    for w in s.waiting.drain(..) {
                        let _ = w.send(core.state().0);
                    }
                    s.core = Some(core);
                }
            }
            ServerMsg::Params(reply) => match &s.core {
                Some(core) => {
                    let _ = reply.send(core.state().0);
                }
                None => s.waiting.push(reply),
            },
            ServerMsg::State(reply) => {
                if let Some(core) = &s.core {
                    let (params, optimizer) = core.state();
                    let _ = reply.send((params, optimizer, core.rule()));
                }
            }
            ServerMsg::Restore {
                params,
                optimizer,
                reply,
            } => {
                if let Some(core) = s.core.as_mut() {
                    core.restore(params, optimizer);
                    let _ = reply.send(());
                }
            }
            ServerMsg::Begin {
                worker,
                step,
                micro_batches,
                global,
                done,
            } => {
                s.done.insert(worker, done);
                if let Some(core) = s.core.as_mut() {
                    core.begin(worker, step, micro_batches, global);
                }
            }
            ServerMsg::Pull {
                worker,
                step,
                reply,
            } => match s.core.as_mut() {
                Some(core) if core.is_over(step) => {
                    let _ = reply.send(PullAnswer::RoundOver);
                }
                Some(core) => {
                    s.pulls.insert(worker, reply);
                    core.pull(worker);
                }
                // Unanswered: the device thread's wait names what is missing (PSA-1).
                None => {}
            },
            ServerMsg::Push {
                worker,
                step,
                item,
                grads,
                loss_sum,
            } => {
                if let Some(core) = s.core.as_mut() {
                    core.push(worker, step, item, grads, loss_sum);
                }
            }
            ServerMsg::Leave { worker, reason } => leave(s, worker, reason),
        }
        answer(s);
        Ok(())
    }
}

/// `worker` is lost (PSA-2): out of the core, its step fails with `reason`.
pub(super) fn leave(s: &mut ServerActorState, worker: WorkerId, reason: String) {
    if let Some(core) = s.core.as_mut() {
        core.leave(worker);
    }
    s.pulls.remove(&worker);
    if let Some(d) = s.done.remove(&worker) {
        let _ = d.send(Err(reason));
    }
}

/// Send what the server owes.
pub(super) fn answer(s: &mut ServerActorState) {
    let Some(core) = s.core.as_mut() else { return };
    for a in core.progress() {
        match a {
            Answer::Work {
                worker,
                item,
                micro_batches,
                params,
                clock,
            } => {
                if let Some(reply) = s.pulls.remove(&worker) {
                    let _ = reply.send(PullAnswer::Work {
                        item,
                        clock,
                        micro_batches,
                        params,
                    });
                }
            }
            Answer::RoundOver { worker } => {
                if let Some(reply) = s.pulls.remove(&worker) {
                    let _ = reply.send(PullAnswer::RoundOver);
                }
            }
            Answer::RoundDone { reports, .. } => {
                for (worker, report) in reports {
                    if let Some(d) = s.done.remove(&worker) {
                        let _ = d.send(Ok(report));
                    }
                }
            }
        }
    }
}

/// Stops the server when the last worker holding it is gone.
#[derive(Debug)]
pub(super) struct ServerGuard(pub(super) ActorRef<ServerMsg>);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        self.0.stop(None);
    }
}
