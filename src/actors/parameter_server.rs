//! The parameter-server strategy's actors: `ServerActor` (the parameters, the optimizer and
//! the rounds' bookkeeping: a `parallel::parameter_server::ServerCore` driven by messages),
//! `WorkerActor` (one per data-parallel rank, answering the same `StageMsg`s as every stage)
//! and `PsReplicas`, their `Spawner`. What a step, a clock and staleness are is written in
//! `parallel::parameter_server`.
//!
//! A worker's step: it tells the server its share (`Begin`) and starts its loop on its device
//! thread without waiting for it: pull (parameters and a work item; the server holds the
//! answer while the SSP gate says wait), compute the item's gradient, push it, again, until
//! the server says the round is over. The worker answers the Supervisor when the server
//! reports the round done, not when its loop ends: with backup workers a slow worker's loop
//! may still compute a gradient the server will drop, and the step does not wait for it.
//!
//! - **PSA-1** every wait is bounded: a device thread waits for the server with
//!   `recv_timeout` (the collective time-out) and fails naming the worker, the shard and what
//!   did not come (`ParameterServerError::Timeout`); a worker waits for its round at most the
//!   step time-out.
//! - **PSA-2** a worker whose device thread fails (panic or error) leaves the server
//!   (`Leave`) before its step fails, and one whose actor ends (a killed device: it says
//!   nothing) is found by the server's watch within `WATCH_EVERY`: the others go on without
//!   it and finish the round
//!   (its item in progress is taken by another worker, PS-4); the Supervisor drops it
//!   (`droppable_replicas`).
//! - **PSA-3** the job's training state is the server's: worker 0's snapshot is the server's
//!   parameters and optimizer state (`state_ranks` = replica 0), every worker's restore sets
//!   the server's, and the trained model is the server's parameters in worker 0's model.
//! - **PSA-4** a lost server (its actor gone) fails the step on every worker with
//!   `ParameterServerError::ShardLost` naming the shard; a job with a roll-back policy goes
//!   back to its checkpoint (not built: the server is not restarted, so the error ends the
//!   job).

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::module::Module;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::oneshot;

use super::device::{DeviceMsg, report_progress, run_on};
use super::spawner::{Capabilities, Rejoin, SpawnFuture, Spawner};
use super::spawner::{SpawnContext, Spawned};
use super::stage::{
    GradientLoop, InitReport, Stage, StageRole, StageSpec, StepReport, failed, shard_of,
};
use crate::checkpoint::{ShardId, ShardSnapshot, TrainingState, restore_module, snapshot_module};
use crate::comm::Communicator;
use crate::device::MeshDevice;
use crate::error::{Error, Result};
use crate::mesh::{Rank, StageId};
use crate::parallel::gradients::{
    Fingerprint, GradientBuffers, ParamLayout, parameter_fingerprint, parameters_to_flat,
    set_trainable,
};
use crate::parallel::parameter_server::{
    Answer, ItemId, Mode, ParameterServerError, ServerCore, WorkerId, WorkerRound,
};
use crate::parallel::sync::{restore_shard, shard_state};
use crate::parallel::zero::{FlatRule, FlatState, OptimizerShard};
mod server;

use server::ServerGuard;
#[cfg(feature = "cluster")]
pub(crate) use server::ServerState;
pub(crate) use server::{PullAnswer, ServerActor, ServerArgs, ServerMsg};

/// The one shard built today.
const SHARD: u32 = 0;

/// Spawns a parameter-server job's server and workers (`JobBuilder::parameter_server`).
pub(crate) type SpawnServer<M, I> =
    fn(Arc<StageSpec<M, I>>, (Mode, FlatRule, f64)) -> Box<dyn Spawner<M>>;

/// A [`PsReplicas`] spawner for `spec` with the server's mode, rule and learning rate.
pub(crate) fn spawner<M: Module + 'static, I: Send + Sync + 'static>(
    spec: Arc<StageSpec<M, I>>,
    (mode, rule, lr): (Mode, FlatRule, f64),
) -> Box<dyn Spawner<M>> {
    Box::new(PsReplicas {
        spec,
        mode,
        rule,
        lr,
    })
}

/// The spawner of a parameter-server job in this process: one server, one worker per
/// data-parallel rank.
pub(crate) struct PsReplicas<M, I> {
    pub(crate) spec: Arc<StageSpec<M, I>>,
    pub(crate) mode: Mode,
    pub(crate) rule: FlatRule,
    pub(crate) lr: f64,
}

impl<M, I> Spawner<M> for PsReplicas<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> Capabilities {
        capabilities(Rejoin::Regroup)
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<M> {
        let PsReplicas {
            spec,
            mode,
            rule,
            lr,
        } = *self;
        Box::pin(async move {
            let workers = cx.layout.world_size();
            let (server, _) =
                Actor::spawn(None, ServerActor, ServerArgs::new(mode, rule, lr, workers)).await?;
            let guard = Arc::new(ServerGuard(server.clone()));
            let mut stages = Vec::with_capacity(workers as usize);
            let mut watched = Vec::with_capacity(workers as usize);
            for (w, (device, device_actor)) in cx.devices.iter().take(workers as usize).enumerate()
            {
                let id = StageId {
                    replica: w as u32,
                    stage: 0,
                    tp: 0,
                };
                let (r, _) = Actor::spawn_linked(
                    None,
                    WorkerActor::<M, I>::default(),
                    WorkerState {
                        id,
                        rank: Rank(w as u32),
                        worker: w as u32,
                        device: device.clone(),
                        device_actor: device_actor.clone(),
                        spec: spec.clone(),
                        server: server.clone(),
                        _guard: Some(guard.clone()),
                        model: Arc::new(Mutex::new(None)),
                        rule,
                        lr,
                        wait: cx.comm.timeout,
                        round_wait: cx.step_timeout,
                        link: cx.comm.link.clone(),
                    },
                    cx.supervisor.clone(),
                )
                .await?;
                watched.push((w as u32, r.get_cell()));
                stages.push((r, id));
            }
            server
                .cast(ServerMsg::Watch(watched))
                .map_err(|e| format!("the parameter server did not start: {e}"))?;
            Ok(Spawned {
                stages,
                shutdown: Arc::new(|| {}),
                others: Vec::new(),
                model_ranks: vec![0],
                assemble: |mut models: Vec<M>| models.pop(),
                grow: None,
                rewire: None,
                devices: None,
            })
        })
    }
}

/// What a parameter-server job's spawner says the Supervisor may do (PSA-2, PSA-3): the
/// state is the server's, so any worker may be dropped, and its snapshot is read through
/// worker 0; workers are not added while the job runs. `rejoin`: how the survivors take a
/// rebuilt mesh (their server does not change).
pub(crate) fn capabilities(rejoin: Rejoin) -> Capabilities {
    Capabilities {
        replicated_state: true,
        droppable_replicas: true,
        twins: false,
        can_grow: false,
        fixed_size: None,
        micro_batches: None,
        rejoin,
    }
}

/// One worker of a parameter-server job.
pub(crate) type WorkerActor<M, I> = Stage<WorkerState<M, I>>;

/// Where a worker's server is and how it waits for it.
#[cfg(feature = "cluster")]
pub(crate) struct WorkerServer {
    pub(crate) server: ActorRef<ServerMsg>,
    pub(crate) rule: FlatRule,
    pub(crate) lr: f64,
    /// How long a device thread waits for the server (PSA-1).
    pub(crate) wait: Duration,
    /// How long the worker waits for its round.
    pub(crate) round_wait: Duration,
}

/// Starts worker `worker` (the world's rank) of a job across processes on this process's
/// `device`, its server reached through `server` (a link to the head's).
#[cfg(feature = "cluster")]
pub(crate) async fn spawn_remote_worker<M: Module + 'static, I: Send + Sync + 'static>(
    spec: Arc<StageSpec<M, I>>,
    (id, worker): (StageId, u32),
    (device, device_actor): (MeshDevice, ActorRef<DeviceMsg>),
    server: WorkerServer,
    link: Option<crate::comm::emulate::LinkEmulation>,
) -> std::result::Result<ActorRef<super::stage::StageMsg<M>>, ractor::SpawnErr> {
    let state = WorkerState {
        id,
        rank: Rank(worker),
        worker,
        device,
        device_actor,
        spec,
        server: server.server,
        _guard: None,
        model: Arc::new(Mutex::new(None)),
        rule: server.rule,
        lr: server.lr,
        wait: server.wait,
        round_wait: server.round_wait,
        link,
    };
    Actor::spawn(None, WorkerActor::<M, I>::default(), state)
        .await
        .map(|(a, _)| a)
}

/// A worker's model (the structure it computes gradients in) and its trainable layout.
struct WorkerModel<M> {
    model: M,
    layout: ParamLayout,
}

/// State of a [`WorkerActor`] (also its arguments).
pub(crate) struct WorkerState<M, I> {
    id: StageId,
    rank: Rank,
    worker: WorkerId,
    device: MeshDevice,
    device_actor: ActorRef<DeviceMsg>,
    spec: Arc<StageSpec<M, I>>,
    server: ActorRef<ServerMsg>,
    /// Stops the server with its last worker (in process; a worker of another process holds
    /// its link to the head's server instead).
    _guard: Option<Arc<ServerGuard>>,
    /// On the device thread while a loop runs; loops of one worker run one after another on
    /// its device thread.
    model: Arc<Mutex<Option<WorkerModel<M>>>>,
    rule: FlatRule,
    lr: f64,
    /// How long a device thread waits for the server (PSA-1).
    wait: Duration,
    /// How long the worker waits for its round.
    round_wait: Duration,
    /// The emulated network (EMU-1): a pull waits for the server's link to carry the
    /// parameters, a push for the worker's to carry the gradient.
    link: Option<crate::comm::emulate::LinkEmulation>,
}

impl<M, I> std::fmt::Debug for WorkerState<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerState({}, worker {})", self.id, self.worker)
    }
}

impl<M, I> StageRole for WorkerState<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    type Model = M;
    type Args = WorkerState<M, I>;
    const KIND: &'static str = "parameter-server worker";

    fn start(state: WorkerState<M, I>) -> std::result::Result<Self, String> {
        Ok(state)
    }

    fn id(&self) -> StageId {
        self.id
    }

    async fn init(&mut self) -> Result<InitReport> {
        init(self).await
    }

    async fn step(
        &mut self,
        step: u64,
        micro_batches: Vec<Vec<usize>>,
        global_samples: usize,
    ) -> Result<StepReport> {
        round(self, step, micro_batches, global_samples).await
    }

    async fn fingerprint(&mut self) -> Result<u64> {
        server_params(self).await.map(|p| {
            let mut f = Fingerprint::new();
            f.update(&p);
            f.finish()
        })
    }

    async fn take_model(&mut self) -> Option<M> {
        take_model(self).await.ok()
    }

    async fn snapshot(&mut self) -> Result<Vec<ShardSnapshot>> {
        snapshot(self).await.map(|x| vec![x])
    }

    async fn restore(&mut self, shards: Vec<ShardSnapshot>) -> Result<()> {
        let shard = shard_of(shards, ShardId::stage(0), self.id)?;
        restore(self, shard).await
    }

    fn regroup(&mut self, id: StageId, rank: Rank, _comm: Communicator) -> Result<()> {
        // The worker keeps its server id; only its place in the mesh changes.
        self.id = id;
        self.rank = rank;
        Ok(())
    }
}

fn lost_server(reason: impl Into<String>) -> Error {
    ParameterServerError::ShardLost {
        shard: SHARD,
        reason: reason.into(),
    }
    .into()
}

/// Ask the server (from the worker's actor), bounded by the step time-out.
async fn ask_server<M, I, T: Send + 'static>(
    s: &WorkerState<M, I>,
    msg: impl FnOnce(RpcReplyPort<T>) -> ServerMsg,
    what: &str,
) -> Result<T> {
    match s.server.call(msg, Some(s.round_wait)).await {
        Ok(ractor::rpc::CallResult::Success(x)) => Ok(x),
        Ok(ractor::rpc::CallResult::Timeout) => Err(ParameterServerError::Timeout {
            worker: s.worker,
            shard: SHARD,
            waited: s.round_wait,
            missing: what.into(),
        }
        .into()),
        Ok(ractor::rpc::CallResult::SenderError) | Err(_) => {
            Err(lost_server(format!("it did not answer {what}")))
        }
    }
}

async fn server_params<M, I>(s: &WorkerState<M, I>) -> Result<Arc<Vec<f32>>> {
    ask_server(s, ServerMsg::Params, "the parameters").await
}

/// Run `f` on the worker's model on its device thread.
async fn with_model<M, I, R>(
    s: &WorkerState<M, I>,
    during: &str,
    f: impl FnOnce(&mut WorkerModel<M>) -> Result<R> + Send + 'static,
) -> Result<R>
where
    M: Module + 'static,
    R: Send + 'static,
{
    let model = s.model.clone();
    let out = run_on(&s.device_actor, during, move || {
        let mut guard = model.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_mut() {
            Some(m) => f(m),
            None => Err(Error::Runtime("the worker has no model".into())),
        }
    })
    .await?;
    out.map_err(|panic| failed(s.id, &s.device, during, panic))?
}

/// Build the model; worker 0 hands its parameters to the server (DP-1's rank 0); every worker
/// reports the server's parameters as its own.
async fn init<M: Module + 'static, I: Send + Sync + 'static>(
    s: &mut WorkerState<M, I>,
) -> Result<InitReport> {
    let spec = s.spec.clone();
    let rank = s.rank;
    let device = s.device.burn().clone().autodiff();
    let slot = s.model.clone();
    let (first, server) = (s.worker == 0, s.server.clone());
    let out = run_on(&s.device_actor, "init", move || -> Result<u64> {
        let ctx = crate::parallel::ModelContext {
            rank,
            device: device.clone(),
        };
        let model = (spec.model_fn)(&ctx).fork(&device).train();
        let layout = ParamLayout::trainable(&model);
        let before = parameter_fingerprint(&model);
        if first {
            server
                .cast(ServerMsg::Init(parameters_to_flat(&model, &layout)))
                .map_err(|e| lost_server(e.to_string()))?;
        }
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(WorkerModel { model, layout });
        Ok(before)
    })
    .await?;
    let before = out.map_err(|p| failed(s.id, &s.device, "building the model", p))??;
    let params = server_params(s).await?;
    let mut f = Fingerprint::new();
    f.update(&params);
    Ok(InitReport {
        before,
        after: f.finish(),
    })
}

/// One round (PSA-1, PSA-2): begin, start the loop on the device thread, wait for the
/// server's report of the round.
async fn round<M: Module + 'static, I: Send + Sync + 'static>(
    s: &mut WorkerState<M, I>,
    step: u64,
    micro_batches: Vec<Vec<usize>>,
    global: usize,
) -> Result<StepReport> {
    let (done, rx) = oneshot::channel();
    s.server
        .cast(ServerMsg::Begin {
            worker: s.worker,
            step,
            micro_batches,
            global,
            done,
        })
        .map_err(|e| lost_server(e.to_string()))?;
    let lp = Loop {
        worker: s.worker,
        step,
        global,
        server: s.server.clone(),
        spec: s.spec.clone(),
        model: s.model.clone(),
        device: s.device.clone(),
        wait: s.wait,
        link: s.link.clone(),
    };
    let task: super::device::Task = Box::new(move || {
        let server = lp.server.clone();
        let worker = lp.worker;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lp.run()));
        let reason = match r {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(p) => format!("panic: {}", super::panic_text(p.as_ref())),
        };
        let _ = server.cast(ServerMsg::Leave { worker, reason });
    });
    s.device_actor
        .send_message(DeviceMsg::Run {
            label: format!("parameter-server step {step}"),
            task,
        })
        .map_err(|e| failed(s.id, &s.device, "starting the round", e.to_string()))?;
    let round = match tokio::time::timeout(s.round_wait, rx).await {
        Ok(Ok(Ok(round))) => round,
        Ok(Ok(Err(reason))) => {
            return Err(failed(s.id, &s.device, "a parameter-server round", reason));
        }
        Ok(Err(_)) => return Err(lost_server("it dropped the round")),
        Err(_) => {
            return Err(ParameterServerError::Timeout {
                worker: s.worker,
                shard: SHARD,
                waited: s.round_wait,
                missing: format!("the end of step {step}"),
            }
            .into());
        }
    };
    let (loss, samples) = round.loss;
    Ok(StepReport {
        rank: s.rank,
        sample_ids: round.sample_ids,
        local_loss: (samples > 0).then(|| (loss / samples as f64) as f32),
        learning_rate: Some(s.lr),
        trace: Vec::new(),
        pipeline: None,
        held: None,
        loss_scale: None,
        // What the worker's link carried: its pushed gradients (the pulls are the server's).
        bytes_sent: round.step.bytes_pushed,
        parameter_server: Some(round.step),
    })
}

/// A worker's loop on its device thread for one step.
struct Loop<M, I> {
    worker: WorkerId,
    step: u64,
    global: usize,
    server: ActorRef<ServerMsg>,
    spec: Arc<StageSpec<M, I>>,
    model: Arc<Mutex<Option<WorkerModel<M>>>>,
    device: MeshDevice,
    wait: Duration,
    link: Option<crate::comm::emulate::LinkEmulation>,
}

impl<M: Module + 'static, I: Send + Sync + 'static> Loop<M, I> {
    fn run(&self) -> Result<()> {
        let mut guard = self.model.lock().unwrap_or_else(|e| e.into_inner());
        let Some(wm) = guard.as_mut() else {
            return Err(Error::Runtime("the worker has no model".into()));
        };
        if let Some(h) = &self.spec.faults {
            h.begin_step(self.device.id(), self.step);
        }
        loop {
            let (tx, rx) = mpsc::channel();
            self.server
                .cast(ServerMsg::Pull {
                    worker: self.worker,
                    step: self.step,
                    reply: tx,
                })
                .map_err(|e| lost_server(e.to_string()))?;
            let answer = rx.recv_timeout(self.wait).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => ParameterServerError::Timeout {
                    worker: self.worker,
                    shard: SHARD,
                    waited: self.wait,
                    missing: format!("parameters and a work item of step {}", self.step),
                }
                .into(),
                mpsc::RecvTimeoutError::Disconnected => lost_server("it dropped a pull unanswered"),
            })?;
            let PullAnswer::Work {
                item,
                clock,
                micro_batches,
                params,
            } = answer
            else {
                return Ok(());
            };
            report_progress(|| format!("step {}: item {item} at clock {clock}", self.step));
            // EMU-1: the parameters come over the server's (ordinary) link.
            if let Some(link) = &self.link {
                std::thread::sleep(link.delay(Rank(u32::MAX), 4 * params.len()));
            }
            let (grads, loss_sum) = self.gradient(wm, &params, &micro_batches)?;
            // EMU-1: the gradient leaves over this worker's link.
            if let Some(link) = &self.link {
                std::thread::sleep(link.delay(Rank(self.worker), 4 * grads.len()));
            }
            self.server
                .cast(ServerMsg::Push {
                    worker: self.worker,
                    step: self.step,
                    item,
                    grads,
                    loss_sum,
                })
                .map_err(|e| lost_server(e.to_string()))?;
        }
    }

    /// The item's gradient at `params`, each micro-batch weighted by its share of the step's
    /// samples (DP-2), and its loss summed over its samples.
    fn gradient(
        &self,
        wm: &mut WorkerModel<M>,
        params: &[f32],
        micro_batches: &[Vec<usize>],
    ) -> Result<(Vec<f32>, f64)> {
        let spec = &self.spec;
        let device_id = self.device.id();
        let ad = self.device.burn().clone().autodiff();
        let model = set_trainable(wm.model.clone(), &wm.layout, params);
        // The worker trains in f32 (the refusal table keeps precision off the parameter
        // server).
        let gradients = GradientLoop {
            spec,
            device: &ad,
            at: (device_id, self.step),
            global: self.global,
            precision: crate::precision::Precision::F32,
            loss_scale: None,
        };
        let (grads, losses) = gradients.run(&model, micro_batches, &mut |_| {})?;
        let loss_sum: f64 = losses
            .iter()
            .zip(micro_batches)
            .map(|(l, ids)| f64::from(*l) * ids.len() as f64)
            .sum();
        let flat = GradientBuffers::take(&model, &wm.layout, grads).into_flat();
        wm.model = model;
        Ok((flat, loss_sum))
    }
}

/// The trained model: the server's parameters in this worker's model (PSA-3).
async fn take_model<M: Module + 'static, I>(s: &WorkerState<M, I>) -> Result<M> {
    let params = server_params(s).await?;
    with_model(s, "taking the model", move |wm| {
        Ok(set_trainable(wm.model.clone(), &wm.layout, &params))
    })
    .await
}

/// The server's parameters and optimizer state as this job's one shard (PSA-3).
async fn snapshot<M: Module + 'static, I>(s: &WorkerState<M, I>) -> Result<ShardSnapshot> {
    let (params, optimizer, rule) = ask_server(s, ServerMsg::State, "its state").await?;
    with_model(s, "checkpoint snapshot", move |wm| {
        let model = set_trainable(wm.model.clone(), &wm.layout, &params);
        let total = params.len();
        let shard = OptimizerShard {
            rule,
            range: 0..total,
            total,
            state: optimizer,
        };
        Ok(ShardSnapshot {
            shard: ShardId::stage(0),
            params: snapshot_module(&model),
            optimizer: Some(shard_state(&shard)?),
            training: TrainingState::default(),
        })
    })
    .await
}

/// Set the server's parameters and optimizer state from a checkpoint's shard (PSA-3).
async fn restore<M: Module + 'static, I>(
    s: &WorkerState<M, I>,
    shard: ShardSnapshot,
) -> Result<()> {
    let rule = s.rule;
    let (params, optimizer) = with_model(s, "checkpoint restore", move |wm| {
        let model = restore_module(wm.model.clone(), &shard.params)?;
        let flat = parameters_to_flat(&model, &wm.layout);
        let total = flat.len();
        let optimizer = match &shard.optimizer {
            Some(o) => {
                let own = OptimizerShard::fresh(rule, total, 1, 0);
                restore_shard(o, &own, total, 0, 1)?.0.state
            }
            None => FlatState::default(),
        };
        wm.model = model;
        Ok((flat, optimizer))
    })
    .await?;
    ask_server(
        s,
        |reply| ServerMsg::Restore {
            params,
            optimizer,
            reply,
        },
        "a restore",
    )
    .await
}
