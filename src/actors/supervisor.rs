//! `Supervisor`: owns the job, drives the step clock, ends the job on failure.
//!
//! Handles, as a table:
//! - `Init` → call every stage's `Init` (model, broadcast of rank 0's parameters), publish
//!   `Started` and `ReplicasSynchronized`, send itself `RunStep(0)`;
//! - `RunStep(s)` → if a stop was asked or all steps are done: finish; else give every replica
//!   its sample ids (sampler), call every stage's `Step` concurrently, publish `StepDone`,
//!   send itself `RunStep(s + 1)`. The first failure shuts the group down (so peers blocked in
//!   a collective wake up, RT-4) and ends the job with that error;
//! - `Stop` → remember it; the job ends at the next step boundary;
//! - a child actor failing or stopping unexpectedly → end the job with an error naming it.
//!
//! SV-1: the job's actors never outlive it: finishing stops every child and the Supervisor.
//! SV-2: the outcome (model or error) is sent exactly once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinSet;

use std::collections::HashSet;

use super::checkpointer::{CheckpointSink, Checkpointer, DRAIN_TIMEOUT, MAX_BACKLOG, Queued};
use super::device::{DeviceActor, DeviceMsg, heartbeat};
use super::group::{GroupActor, GroupArgs};
use super::stage::{StageMsg, StepReport};
use crate::checkpoint::{Checkpoint, OptimizerState, RngState, ShardSnapshot};
use crate::comm::LocalGroup;
use crate::comm::{CommConfig, CommError};
use crate::device::MeshDevice;
use crate::error::{Error, Health, RankHealth, Result};
use crate::events::{JobEvent, PipelineStep, ReplicaStep, StageShares, StepDone};
use crate::faults::FaultHooks;
use crate::mesh::Rank;
use crate::mesh::{DeviceId, StageId};
use crate::mesh::{Generation, Layout};
use crate::parallel::pipeline::{TimedInstr, summarize};
use crate::parallel::pipeline_exec::ExecError;
use crate::parallel::sampler::DistributedSampler;
use crate::recovery::{Decision, OnReplicaLoss, RecoveryPolicy, RestartLog, decide};
use crate::trace::TimeBreakdown;

/// A trained model and how the run went.
#[derive(Debug)]
pub struct Trained<M> {
    /// Rank 0's model (every replica holds the same parameters).
    pub model: M,
    /// Summary of the run.
    pub summary: RunSummary,
}

/// Figures of a whole run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct RunSummary {
    /// Steps run.
    pub steps: u64,
    /// Mean loss of the first step.
    pub first_loss: Option<f32>,
    /// Mean loss of the last step.
    pub last_loss: Option<f32>,
    /// Samples trained on.
    pub samples: u64,
    /// Sum of the steps' wall times.
    pub wall_s: f64,
    /// Time breakdown summed over steps, averaged over replicas.
    pub breakdown: TimeBreakdown,
}

impl RunSummary {
    /// Samples per second over the steps' wall time.
    pub fn samples_per_s(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.samples as f64 / self.wall_s
        } else {
            0.0
        }
    }
}

/// Messages the [`Supervisor`] handles.
#[derive(Debug)]
pub enum SupervisorMsg {
    /// Build the models and synchronize the replicas.
    Init,
    /// Run this step.
    RunStep(u64),
    /// End the job at the next step boundary.
    Stop,
    /// Reply with where the job is.
    Status(ractor::RpcReplyPort<JobStatus>),
    /// Write a checkpoint at the next step boundary.
    CheckpointNow,
    /// Resize the data-parallel group at the next step boundary.
    ScaleTo(u32),
    /// Add this many replicas at the next step boundary (on top of any resize already asked
    /// for): devices that became available, such as nodes that joined a running job.
    AddReplicas(u32),
    /// Stop starting steps until `Resume`.
    Pause,
    /// Start steps again after `Pause`.
    Resume,
    /// The wait for devices of this generation below the elastic minimum is over (ELASTIC-3).
    MinimumWaitOver(Generation),
}

/// Where a running job is.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JobStatus {
    /// The mesh.
    pub layout: Layout,
    /// Steps finished so far.
    pub steps_done: u64,
    /// Steps the job will run.
    pub steps_total: u64,
    /// Whether a stop was asked for.
    pub stopping: bool,
    /// Whether the job is paused.
    pub paused: bool,
    /// The mesh's generation (it goes up with each recovery or resize).
    pub generation: Generation,
}

/// The job's root actor.
pub struct Supervisor<M, I>(std::marker::PhantomData<fn() -> (M, I)>);

impl<M, I> Default for Supervisor<M, I> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<M, I> std::fmt::Debug for Supervisor<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Supervisor")
    }
}

/// Where and how often a job writes checkpoints, and whether it starts from one.
#[derive(Debug, Clone)]
pub(crate) struct CheckpointSettings {
    pub(crate) sink: Arc<dyn CheckpointSink>,
    /// Every this many steps (none: only on request).
    pub(crate) every: Option<u64>,
    /// Start from the newest valid checkpoint, if there is one.
    pub(crate) resume: bool,
    /// With `resume`: finding no valid checkpoint fails the job instead of starting afresh.
    pub(crate) require: bool,
}

/// What a job's stage actors are spawned with.
pub(crate) struct SpawnContext {
    /// The Supervisor: every actor is linked to it.
    pub(crate) supervisor: ractor::ActorCell,
    /// One device (and its actor) per rank, in rank order.
    pub(crate) devices: Vec<(MeshDevice, ActorRef<DeviceMsg>)>,
    /// The mesh.
    pub(crate) layout: Layout,
    /// Collective settings (their time-out also bounds pipeline links).
    pub(crate) comm: CommConfig,
    /// The step time-out (what proxies of other processes' stages wait at most).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) step_timeout: Duration,
}

/// The stage actors of a job and how to handle them as a whole.
pub(crate) struct Spawned<M> {
    /// One stage actor per rank, in rank order.
    pub(crate) stages: Vec<(ActorRef<StageMsg<M>>, StageId)>,
    /// Wakes every stage blocked in a collective or a pipeline link (RT-4).
    pub(crate) shutdown: Arc<dyn Fn() + Send + Sync>,
    /// Other actors of the job (collective groups), stopped with it.
    pub(crate) others: Vec<ractor::ActorCell>,
    /// The ranks whose models make up the trained model.
    pub(crate) model_ranks: Vec<usize>,
    /// Puts the trained model together from those ranks' models.
    pub(crate) assemble: fn(Vec<M>) -> Option<M>,
    /// Whether every rank is a whole data-parallel replica (a lost one can be dropped).
    pub(crate) replicas_only: bool,
    /// Whether every data-parallel rank holds its block's whole training state (false under
    /// ZeRO: a rank's optimizer shard exists nowhere else, so checkpoints gather every rank,
    /// a lost rank rolls back, and a resize re-shards).
    pub(crate) replicated_state: bool,
    /// Starts one more data-parallel replica (jobs that can grow).
    pub(crate) grow: Option<Grow<M>>,
    /// Rewires a pipeline mesh under a new generation, starting fresh stages for replaced
    /// ranks (REC-6).
    pub(crate) rewire: Option<RewireStages<M>>,
    /// The device actors, by rank, when the spawner started them itself (a cluster job's
    /// proxies of other processes' devices); `None`: the context's devices.
    pub(crate) devices: Option<Vec<(ActorRef<DeviceMsg>, DeviceId)>>,
    /// Whether the stages join a rebuilt group by `StageMsg::Reconnect` (each connects its
    /// own data plane: a cluster job) rather than `Regroup` with an in-process group.
    pub(crate) reconnect: bool,
}

/// What [`RewireStages`] rewires.
pub(crate) struct RewireArgs {
    pub(crate) supervisor: ractor::ActorCell,
    pub(crate) layout: Layout,
    pub(crate) generation: Generation,
    pub(crate) comm: CommConfig,
    /// The devices of the fresh ranks, by rank (`None` for survivors, and for every rank
    /// when the spawner finds devices itself: a cluster job).
    pub(crate) devices: Vec<Option<(MeshDevice, ActorRef<DeviceMsg>)>>,
    /// The ranks that get a fresh stage actor.
    pub(crate) fresh: Vec<usize>,
    /// Each rank's device now, by rank (a cluster job: the slot that holds it).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) slots: Vec<DeviceId>,
}

/// A rewired mesh.
pub(crate) struct Rewired<M> {
    /// The fresh stage actors, by rank (not initialized yet).
    pub(crate) fresh: Vec<(usize, ActorRef<StageMsg<M>>)>,
    /// Per rank, the wiring a surviving stage takes with `StageMsg::Rewire` (none for fresh
    /// ranks).
    pub(crate) survivors: Vec<
        Option<(
            Box<crate::parallel::pipeline_exec::StageLinks>,
            Option<crate::comm::Communicator>,
        )>,
    >,
    /// The new collective groups' actors.
    pub(crate) others: Vec<ractor::ActorCell>,
    /// Wakes everything blocked in the new wiring.
    pub(crate) shutdown: Arc<dyn Fn() + Send + Sync>,
    /// The fresh ranks' devices when the spawner found them itself (a cluster job: proxies
    /// of the devices of the slots that took them), by rank.
    pub(crate) devices: Vec<(usize, (ActorRef<DeviceMsg>, DeviceId))>,
}

/// Rewires a pipeline mesh (REC-6).
pub(crate) type RewireStages<M> = Arc<
    dyn Fn(
            RewireArgs,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Rewired<M>, ActorProcessingErr>> + Send>,
        > + Send
        + Sync,
>;

/// What a replica added to a running job starts from.
pub(crate) struct GrowArgs {
    pub(crate) supervisor: ractor::ActorCell,
    pub(crate) id: StageId,
    pub(crate) rank: Rank,
    pub(crate) device: MeshDevice,
    pub(crate) device_actor: ActorRef<DeviceMsg>,
    pub(crate) comm: crate::comm::Communicator,
}

/// How a job adds a data-parallel replica.
pub(crate) enum Grow<M> {
    /// On a device of this process (a spare of the builder's list, else a new logical device),
    /// handed to the stage factory.
    Local(GrowStage<M>),
    /// Wherever the job's spawner has one waiting (a node that joined a running job across
    /// processes): the stage's and its device's proxies, or an error when none is waiting.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    Remote {
        /// Starts the oldest waiting one.
        start: GrowRemote<M>,
        /// How many are waiting (ELASTIC-4: a job below its maximum grows onto them after a
        /// loss).
        waiting: Arc<dyn Fn() -> usize + Send + Sync>,
    },
}

impl<M> Clone for Grow<M> {
    fn clone(&self) -> Self {
        match self {
            Grow::Local(g) => Grow::Local(g.clone()),
            Grow::Remote { start, waiting } => Grow::Remote {
                start: start.clone(),
                waiting: waiting.clone(),
            },
        }
    }
}

/// What a replica added by [`Grow::Remote`] is.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) struct RemoteGrowArgs {
    pub(crate) supervisor: ractor::ActorCell,
    /// Its place: replica = its rank in the group it joins.
    pub(crate) id: StageId,
}

/// A stage and its device, started where the spawner found room.
pub(crate) type Grown<M> = (ActorRef<StageMsg<M>>, (ActorRef<DeviceMsg>, DeviceId));

/// Starts a replica added to a running job somewhere else ([`Grow::Remote`]).
pub(crate) type GrowRemote<M> = Arc<
    dyn Fn(
            RemoteGrowArgs,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Grown<M>, ActorProcessingErr>> + Send>,
        > + Send
        + Sync,
>;

/// Spawns the stage actor of a replica added to a running job.
pub(crate) type GrowStage<M> = Arc<
    dyn Fn(
            GrowArgs,
        ) -> std::pin::Pin<
            Box<
                dyn std::future::Future<Output = Result<ActorRef<StageMsg<M>>, ActorProcessingErr>>
                    + Send,
            >,
        > + Send
        + Sync,
>;

/// Spawns a job's stage actors: data-parallel replicas or pipeline stages.
pub(crate) type SpawnStages<M> = Box<
    dyn FnOnce(
            SpawnContext,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<Spawned<M>, ActorProcessingErr>> + Send>,
        > + Send,
>;

/// What the Supervisor starts from (built by [`crate::job::Job::spawn`]).
pub struct SupervisorArgs<M, I> {
    pub(crate) spawn: SpawnStages<M>,
    pub(crate) items: std::marker::PhantomData<fn() -> I>,
    pub(crate) devices: Vec<MeshDevice>,
    /// Whether the spawner starts every rank's device itself (a cluster job): then `devices`
    /// holds only the template of the devices the job's model is assembled on.
    pub(crate) remote: bool,
    pub(crate) layout: Layout,
    pub(crate) steps: u64,
    pub(crate) accumulation: u32,
    pub(crate) sampler: DistributedSampler,
    pub(crate) comm: CommConfig,
    pub(crate) step_timeout: Duration,
    pub(crate) faults: Option<Arc<FaultHooks>>,
    pub(crate) recovery: RecoveryPolicy,
    pub(crate) checkpoints: Option<CheckpointSettings>,
    pub(crate) seed: u64,
    pub(crate) elastic: (u32, u32),
    /// How long the job waits for devices below the elastic minimum (ELASTIC-3).
    pub(crate) elastic_wait: Duration,
    pub(crate) lr_scheduled: bool,
    pub(crate) events: broadcast::Sender<JobEvent>,
    pub(crate) outcome: oneshot::Sender<Result<Trained<M>>>,
}

impl<M, I> std::fmt::Debug for SupervisorArgs<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SupervisorArgs({:?})", self.layout)
    }
}

/// State of the [`Supervisor`].
pub struct SupervisorState<M, I> {
    layout: Layout,
    steps: u64,
    accumulation: u32,
    sampler: DistributedSampler,
    /// The current epoch's sample order, computed once per epoch.
    epoch_order: Option<(u64, Vec<usize>)>,
    step_timeout: Duration,
    events: broadcast::Sender<JobEvent>,
    outcome: Option<oneshot::Sender<Result<Trained<M>>>>,
    devices: Vec<(ActorRef<DeviceMsg>, DeviceId)>,
    stages: Vec<(ActorRef<StageMsg<M>>, StageId)>,
    /// Collective groups and other actors of the job.
    others: Vec<ractor::ActorCell>,
    /// Wakes every stage blocked in a collective or a link, whatever happens to the actors'
    /// mailboxes (RT-4).
    shutdown: Arc<dyn Fn() + Send + Sync>,
    /// Whether stages join a rebuilt group by `Reconnect` (a cluster job).
    reconnect: bool,
    /// Whether the spawner found the devices itself (a cluster job's proxies of other
    /// processes' devices): replacements find theirs the same way.
    reconnect_devices: bool,
    model_ranks: Vec<usize>,
    assemble: fn(Vec<M>) -> Option<M>,
    replicas_only: bool,
    /// See [`Spawned::replicated_state`].
    replicated_state: bool,
    /// Collective settings, for rebuilt groups.
    comm: CommConfig,
    /// The Supervisor itself, to link rebuilt actors to.
    myself: ractor::ActorCell,
    generation: Generation,
    faults: Option<Arc<FaultHooks>>,
    recovery: RecoveryPolicy,
    restarts: RestartLog,
    /// Actors the Supervisor stopped or gave up on: their exit is not a new failure.
    departed: HashSet<ractor::ActorId>,
    /// Ranks found dead between steps (a supervision event): recovered at the next step.
    pending_lost: Vec<(usize, Error)>,
    /// The step that failed last, for the recovery that follows.
    interrupted: Option<Interrupted>,
    checkpoints: Option<CheckpointSettings>,
    checkpointer: Option<Checkpointer>,
    checkpoint_requested: bool,
    /// The step boundary of the last checkpoint taken or restored.
    last_checkpoint: Option<u64>,
    seed: u64,
    grow: Option<Grow<M>>,
    rewire: Option<RewireStages<M>>,
    /// Devices of the builder's list beyond the mesh, for replicas that join.
    spare_devices: Vec<MeshDevice>,
    /// What a new logical device is made like.
    device_template: MeshDevice,
    next_device_id: u32,
    /// The size asked by `scale_to`, applied at the next step boundary.
    scale_target: Option<u32>,
    /// Smallest and largest data-parallel size `scale_to` accepts.
    elastic: (u32, u32),
    /// Whether the learning rate comes from a scheduler (whose state is not transferred).
    lr_scheduled: bool,
    /// The step a pause held back, run on `Resume`.
    paused: Option<Option<u64>>,
    /// Set while the job waits below the elastic minimum: the generation that waits, since.
    below_min: Option<(Generation, Instant)>,
    /// How long the job waits for devices below the elastic minimum.
    elastic_wait: Duration,
    stop_requested: bool,
    finished: bool,
    summary: RunSummary,
    _items: std::marker::PhantomData<fn() -> I>,
}

impl<M, I> std::fmt::Debug for SupervisorState<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SupervisorState({:?})", self.layout)
    }
}

impl<M, I> Actor for Supervisor<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    type Msg = SupervisorMsg;
    type State = SupervisorState<M, I>;
    type Arguments = SupervisorArgs<M, I>;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        a: SupervisorArgs<M, I>,
    ) -> Result<SupervisorState<M, I>, ActorProcessingErr> {
        let world = a.layout.world_size() as usize;
        let local = if a.remote { 0 } else { world };
        let mut devices = Vec::with_capacity(local);
        for d in a.devices.iter().take(local) {
            let (r, _) =
                Actor::spawn_linked(None, DeviceActor, d.clone(), myself.get_cell()).await?;
            devices.push((d.clone(), r));
        }
        let spawned = (a.spawn)(SpawnContext {
            step_timeout: a.step_timeout,
            supervisor: myself.get_cell(),
            devices: devices.clone(),
            layout: a.layout,
            comm: a.comm.clone(),
        })
        .await?;
        let checkpointer = match &a.checkpoints {
            Some(c) => Some(Checkpointer::spawn(c.sink.clone(), a.events.clone())?),
            None => None,
        };
        myself.send_message(SupervisorMsg::Init)?;
        let reconnect_devices = spawned.devices.is_some();
        Ok(SupervisorState {
            reconnect_devices,
            layout: a.layout,
            steps: a.steps,
            accumulation: a.accumulation,
            sampler: a.sampler,
            epoch_order: None,
            step_timeout: a.step_timeout,
            events: a.events,
            outcome: Some(a.outcome),
            devices: spawned
                .devices
                .unwrap_or_else(|| devices.into_iter().map(|(d, r)| (r, d.id())).collect()),
            reconnect: spawned.reconnect,
            stages: spawned.stages,
            others: spawned.others,
            shutdown: spawned.shutdown,
            model_ranks: spawned.model_ranks,
            assemble: spawned.assemble,
            replicas_only: spawned.replicas_only,
            replicated_state: spawned.replicated_state,
            comm: a.comm.clone(),
            myself: myself.get_cell(),
            generation: Generation(0),
            faults: a.faults,
            recovery: a.recovery,
            restarts: RestartLog::default(),
            departed: HashSet::new(),
            pending_lost: Vec::new(),
            interrupted: None,
            checkpointer,
            checkpoints: a.checkpoints,
            checkpoint_requested: false,
            last_checkpoint: None,
            seed: a.seed,
            grow: spawned.grow,
            rewire: spawned.rewire,
            spare_devices: a.devices.iter().skip(local.max(1)).rev().cloned().collect(),
            device_template: a
                .devices
                .first()
                .cloned()
                .ok_or("a job needs at least one device")?,
            next_device_id: a.devices.iter().map(|d| d.id().0).max().unwrap_or(0),
            scale_target: None,
            elastic: a.elastic,
            lr_scheduled: a.lr_scheduled,
            paused: None,
            below_min: None,
            elastic_wait: a.elastic_wait,
            stop_requested: false,
            finished: false,
            summary: RunSummary::default(),
            _items: std::marker::PhantomData,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        if state.finished {
            return Ok(());
        }
        match msg {
            SupervisorMsg::Init => {
                publish(
                    state,
                    JobEvent::Started {
                        layout: state.layout,
                        generation: Generation(0),
                    },
                );
                let started = match init_all(state).await {
                    Ok((before, after)) => {
                        publish(state, JobEvent::ReplicasSynchronized { before, after });
                        resume(state).await
                    }
                    Err(e) => Err(e),
                };
                match started {
                    Ok(first) => myself.send_message(SupervisorMsg::RunStep(first))?,
                    Err(e) => finish(&myself, state, Err(e)).await,
                }
            }
            SupervisorMsg::RunStep(step) => {
                if let Some(held) = state.paused.as_mut() {
                    // Paused: hold the step until Resume.
                    *held = Some(step);
                    return Ok(());
                }
                // Devices lost between steps are dealt with first (their ranks are current).
                let lost = std::mem::take(&mut state.pending_lost);
                if !lost.is_empty()
                    && let Err(e) = recover(state, step, LostRanks(lost)).await
                {
                    finish(&myself, state, Err(e)).await;
                    return Ok(());
                }
                if let Some(n) = state.scale_target
                    && (state.stop_requested || step >= state.steps)
                {
                    state.scale_target = None;
                    publish(
                        state,
                        JobEvent::ResizeRefused {
                            requested: n,
                            reason: "the job is ending".into(),
                        },
                    );
                }
                let target = state.scale_target.take();
                if let Some(n) = target
                    && let Err(error) = resize(state, step, n as usize).await
                {
                    // A refused resize leaves the mesh as it was; one that failed half-way
                    // (the group could not be rebuilt) ends the job.
                    if matches!(error, Error::InvalidConfig(_)) {
                        publish(
                            state,
                            JobEvent::ResizeRefused {
                                requested: n,
                                reason: error.to_string(),
                            },
                        );
                    } else {
                        finish(&myself, state, Err(error)).await;
                        return Ok(());
                    }
                }
                // ELASTIC-3: a resize that left the job below its minimum (a growth toward it,
                // a partial or refused one) holds this step again.
                if target.is_some() && state.paused.is_none() {
                    wait_for_minimum(state, step);
                    if let Some(held) = state.paused.as_mut() {
                        *held = Some(step);
                        return Ok(());
                    }
                }
                let every = state.checkpoints.as_ref().and_then(|c| c.every);
                // Every n steps, on request, and when the job ends (the builder's and the
                // CLI's promise, with or without an interval).
                let due = state.checkpoint_requested
                    || every.is_some_and(|n| n > 0 && step > 0 && step % n == 0)
                    || (state.checkpoints.is_some()
                        && (state.stop_requested || step >= state.steps));
                if due && state.last_checkpoint != Some(step) {
                    checkpoint(state, step).await;
                }
                state.checkpoint_requested = false;
                if state.stop_requested || step >= state.steps {
                    finish(&myself, state, Ok(())).await;
                    return Ok(());
                }
                let outcome = run_step(state, step).await.map_err(LostRanks::from);
                publish_fired(state);
                match outcome {
                    Ok(()) => myself.send_message(SupervisorMsg::RunStep(step + 1))?,
                    Err(failure) => match recover(state, step, failure).await {
                        // REC-1: the survivors redo the step, unless it had completed on all
                        // of them before the failure ended it.
                        Ok(Redo::Step) => myself.send_message(SupervisorMsg::RunStep(step))?,
                        Ok(Redo::Nothing) => {
                            myself.send_message(SupervisorMsg::RunStep(step + 1))?
                        }
                        Ok(Redo::From(from)) => {
                            myself.send_message(SupervisorMsg::RunStep(from))?
                        }
                        Err(e) => finish(&myself, state, Err(e)).await,
                    },
                }
            }
            SupervisorMsg::Stop => {
                state.stop_requested = true;
                // A paused job stops at once: its held step sees the stop and finishes.
                if let Some(Some(step)) = state.paused.take() {
                    myself.send_message(SupervisorMsg::RunStep(step))?;
                }
            }
            SupervisorMsg::CheckpointNow => state.checkpoint_requested = true,
            SupervisorMsg::AddReplicas(k) => {
                let now = state.scale_target.unwrap_or(state.stages.len() as u32);
                myself.send_message(SupervisorMsg::ScaleTo(now.saturating_add(k)))?;
            }
            SupervisorMsg::ScaleTo(n) => {
                let (min, max) = state.elastic;
                let waiting = state.below_min.is_some();
                // Below the minimum, any growth toward it is welcome (ELASTIC-3, ELASTIC-4).
                let toward_min = waiting && n > state.layout.dp();
                if (n < min.max(1) && !toward_min) || n > max {
                    publish(
                        state,
                        JobEvent::ResizeRefused {
                            requested: n,
                            reason: format!("outside the elastic range {}..={max}", min.max(1)),
                        },
                    );
                } else if let Some(old) = state.scale_target.replace(n) {
                    publish(
                        state,
                        JobEvent::ResizeRefused {
                            requested: old,
                            reason: format!("replaced by a later request for {n}"),
                        },
                    );
                }
                // ELASTIC-3: devices joining end the wait below the minimum.
                if waiting && state.scale_target.is_some() {
                    myself.send_message(SupervisorMsg::Resume)?;
                }
            }
            SupervisorMsg::MinimumWaitOver(generation) => {
                if let Some((g, since)) = state.below_min
                    && g == generation
                {
                    let error = Error::BelowMinimum {
                        replicas: state.layout.dp(),
                        min: state.elastic.0,
                        waited: since.elapsed(),
                    };
                    finish(&myself, state, Err(error)).await;
                }
            }
            SupervisorMsg::Pause => {
                if state.paused.is_none() {
                    state.paused = Some(None);
                    publish(state, JobEvent::Paused);
                }
            }
            SupervisorMsg::Resume => {
                // Below the elastic minimum, resume() accepts the smaller mesh.
                state.below_min = None;
                if let Some(held) = state.paused.take() {
                    publish(state, JobEvent::Resumed);
                    if let Some(step) = held {
                        myself.send_message(SupervisorMsg::RunStep(step))?;
                    }
                }
            }
            SupervisorMsg::Status(reply) => {
                let _ = reply.send(JobStatus {
                    layout: state.layout,
                    steps_done: state.summary.steps,
                    steps_total: state.steps,
                    stopping: state.stop_requested,
                    paused: state.paused.is_some(),
                    generation: state.generation,
                });
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        state: &mut SupervisorState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        if !state.finished {
            // Stopped from outside before the job ended: still end it cleanly (SV-1, SV-2).
            state.finished = true;
            (state.shutdown)();
            let e = Error::Runtime("the supervisor stopped before the job ended".into());
            publish(state, JobEvent::Failed(e.clone()));
            if let Some(tx) = state.outcome.take() {
                let _ = tx.send(Err(e));
            }
            for (s, _) in &state.stages {
                s.stop(None);
            }
            for (d, _) in &state.devices {
                d.stop(None);
            }
            for o in &state.others {
                o.stop(None);
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        if state.finished {
            return Ok(());
        }
        let cell = match &event {
            SupervisionEvent::ActorFailed(cell, _)
            | SupervisionEvent::ActorTerminated(cell, ..) => cell.clone(),
            _ => return Ok(()),
        };
        if state.departed.contains(&cell.get_id()) {
            return Ok(());
        }
        let error = match event {
            SupervisionEvent::ActorFailed(cell, err) => {
                Error::Runtime(format!("{} failed: {err}", describe(state, &cell)))
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => Error::Runtime(format!(
                "{} stopped unexpectedly ({})",
                describe(state, &cell),
                reason.unwrap_or_else(|| "no reason given".into())
            )),
            _ => return Ok(()),
        };
        // A stage or device lost between steps: the next step recovers (or fails) with it.
        if let Some(rank) = rank_of_actor(state, &cell)
            && (state.recovery.on_replica_loss == OnReplicaLoss::Shrink || state.recovery.roll_back)
        {
            state.departed.insert(cell.get_id());
            state.pending_lost.push((rank, error));
            return Ok(());
        }
        finish(&myself, state, Err(error)).await;
        Ok(())
    }
}

/// The rank whose stage or device actor `cell` is.
fn rank_of_actor<M, I>(state: &SupervisorState<M, I>, cell: &ractor::ActorCell) -> Option<usize> {
    let id = cell.get_id();
    state
        .stages
        .iter()
        .position(|(r, _)| r.get_id() == id)
        .or_else(|| state.devices.iter().position(|(r, _)| r.get_id() == id))
}

/// Publish the faults of the plan that fired (FAULT-1).
fn publish_fired<M, I>(state: &SupervisorState<M, I>) {
    if let Some(h) = &state.faults {
        for f in h.take_fired() {
            publish(state, JobEvent::FaultInjected(f));
        }
    }
}

/// What the survivors of a recovery run next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Redo {
    /// The failed step, again (nothing of it was applied).
    Step,
    /// The next step: the failed one had completed, and been applied, on every survivor.
    Nothing,
    /// This step: the job rolled back to a checkpoint taken after it (REC-5).
    From(u64),
}

/// A step that failed: what each rank was given and what the ones that finished reported.
#[derive(Debug)]
struct Interrupted {
    shares: Vec<Vec<usize>>,
    done: Vec<Option<StepReport>>,
    started: Instant,
}

/// A step's failure: an error, with the ranks it names as lost.
struct LostRanks(Vec<(usize, Error)>);

impl From<Error> for LostRanks {
    fn from(e: Error) -> Self {
        LostRanks(vec![(usize::MAX, e)])
    }
}

/// The ranks a failure names as lost (a stage that failed on its device or whose actor is
/// gone).
fn lost_ranks<M, I>(state: &SupervisorState<M, I>, failure: &LostRanks) -> Vec<usize> {
    let mut lost: Vec<usize> = failure
        .0
        .iter()
        .filter_map(|(rank, e)| {
            if *rank != usize::MAX {
                return Some(*rank);
            }
            match e {
                Error::StageFailed { stage, .. } | Error::StageLost { stage, .. } => {
                    state.stages.iter().position(|(_, id)| id == stage)
                }
                // Across processes: the link to a peer broke (its process died or was cut
                // off); in a data-parallel job a rank is its stage's index.
                Error::Comm(CommError::Link { peer, .. }) if state.replicas_only => {
                    Some(peer.index()).filter(|&r| r < state.stages.len())
                }
                _ => None,
            }
        })
        .chain(failure.0.iter().flat_map(|(_, e)| match e {
            // Stuck, slow or dead: a rank that did not arrive in time is evicted.
            Error::RanksUnresponsive { ranks, .. } => {
                ranks.iter().map(|r| r.rank.index()).collect()
            }
            _ => Vec::new(),
        }))
        .collect();
    lost.sort_unstable();
    lost.dedup();
    lost
}

/// `lost` and every other rank whose device does not answer a heartbeat within twice
/// [`HEARTBEAT_PROBE`], in rank order.
async fn with_unreachable(
    devices: Vec<(ActorRef<DeviceMsg>, DeviceId)>,
    mut lost: Vec<usize>,
) -> Vec<usize> {
    let mut probes = JoinSet::new();
    for (r, (device, id)) in devices.into_iter().enumerate() {
        if lost.contains(&r) {
            continue;
        }
        // A device of another process answers through its node: twice the probe's time.
        let wait = HEARTBEAT_PROBE * 2;
        probes.spawn(async move { (r, heartbeat(&device, id, wait).await.is_ok()) });
    }
    while let Some(probe) = probes.join_next().await {
        if let Ok((r, false)) = probe {
            lost.push(r);
        }
    }
    lost.sort_unstable();
    lost
}

/// Recover from `failure` at `step` by the job's policy (REC-1..3): on `Ok` the mesh holds the
/// survivors under a new generation and the step is to be redone.
async fn recover<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    failure: LostRanks,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let first = failure
        .0
        .first()
        .map(|(_, e)| e.clone())
        .unwrap_or_else(|| Error::Runtime("a failure without an error".into()));
    let mut lost = lost_ranks(state, &failure);
    if state.reconnect_devices && !lost.is_empty() {
        // Across processes one failure can take several ranks (a node holding several
        // devices): every other rank whose device does not answer is lost with it.
        lost = with_unreachable(state.devices.clone(), lost).await;
    }
    let message_fault = failure.0.iter().any(|(_, e)| e.is_message_fault());
    // A rank whose state is a shard (ZeRO) has no twin and cannot be dropped: its state
    // comes back only from a checkpoint.
    let twins = twins_of(state, &lost).filter(|_| state.replicated_state);
    let decision = decide(
        &state.recovery,
        &mut state.restarts,
        state.stages.len(),
        (&lost, message_fault, twins.is_some()),
        state.replicas_only && state.replicated_state,
        Instant::now(),
    );
    let roll_back = decision == Decision::RollBack;
    let from_twins = decision == Decision::ReplaceFromTwins;
    let survivors = match decision {
        Decision::Shrink { survivors } => survivors,
        // REC-4: everyone is alive; the same members regroup and redo the step.
        Decision::Retry => (0..state.stages.len()).collect(),
        // REC-5 / REC-6: the lost are replaced below.
        Decision::RollBack | Decision::ReplaceFromTwins => (0..state.stages.len())
            .filter(|r| !lost.contains(r))
            .collect(),
        Decision::Fail(_) => return Err(first),
        Decision::TooMany { count } => {
            return Err(Error::TooManyFailures {
                count,
                window: state.recovery.window,
                last: Box::new(first),
            });
        }
    };
    for &r in &lost {
        let (stage, id) = &state.stages[r];
        let (device, device_id) = &state.devices[r];
        let error = failure
            .0
            .iter()
            .find(|(rank, e)| {
                *rank == r
                    || matches!(e, Error::StageFailed { stage, .. } | Error::StageLost { stage, .. } if stage == id)
            })
            .map_or_else(|| first.clone(), |(_, e)| e.clone());
        publish(
            state,
            JobEvent::DeviceLost {
                step,
                rank: Rank(r as u32),
                device: *device_id,
                error,
            },
        );
        state.departed.insert(stage.get_id());
        state.departed.insert(device.get_id());
        // Killed, not stopped: a stuck stage is still inside its step.
        stage.kill();
        device.kill();
    }
    if roll_back {
        return roll_back_to_checkpoint(state, step, &lost, first).await;
    }
    if from_twins {
        let twins = twins.unwrap_or_default();
        return replace_from_twins(state, step, &twins, first).await;
    }
    // REC-1: a step is redone only where nothing of it was applied. A survivor that finished
    // the step's last collective holds its full result (every rank's gradient was in it) and
    // applied it; one still waiting in it applied nothing. Both happen in one step: in a ring,
    // a rank whose predecessor died waits while the ranks after it finish (REC-7).
    let interrupted = state.interrupted.take();
    let finished: Vec<bool> = survivors
        .iter()
        .map(|&r| {
            interrupted
                .as_ref()
                .is_some_and(|i| i.done.get(r).is_some_and(Option::is_some))
        })
        .collect();
    let mixed = finished.iter().any(|f| *f) && !finished.iter().all(|f| *f);
    if mixed && state.lr_scheduled {
        if state.recovery.roll_back {
            // REC-5: only a checkpoint can make these replicas equal again.
            return roll_back_to_checkpoint(state, step, &lost, first).await;
        }
        return Err(Error::Runtime(format!(
            "step {step} was applied on some survivors and not on others, and a \
             learning-rate scheduler's state cannot be copied to the others; only a \
             checkpoint can make the replicas equal again (after: {first})"
        )));
    }
    let completed = finished.iter().any(|f| *f);
    let old_ids: Vec<StageId> = state.stages.iter().map(|(_, id)| *id).collect();
    let lost_devices: Vec<DeviceId> = lost.iter().map(|&r| state.devices[r].1).collect();
    let members = survivors
        .iter()
        .map(|&r| (state.stages[r].0.clone(), state.devices[r].clone()))
        .collect();
    rebuild_group(state, members).await?;
    if mixed {
        // REC-7: the ones that applied the step hand their state to the ones that did not,
        // once the old group no longer holds them; the step then counts as done.
        catch_up(state, step, &finished).await?;
    }
    let next = if completed { step + 1 } else { step };
    publish(
        state,
        JobEvent::Recovered {
            step: next,
            generation: state.generation,
            layout: state.layout,
            lost: lost_devices,
        },
    );
    wait_for_minimum(state, next);
    refill_from_waiting(state);
    let Some(interrupted) = interrupted.filter(|_| completed) else {
        return Ok(Redo::Step);
    };
    // The step completed: publish it, with the lost ranks' samples (their gradients were in
    // the all-reduce, so their samples were trained on).
    let learning_rate = interrupted
        .done
        .iter()
        .flatten()
        .find_map(|r| r.learning_rate);
    let samples = interrupted.shares.iter().map(Vec::len).sum();
    let reports = interrupted
        .done
        .into_iter()
        .enumerate()
        .map(|(r, report)| {
            let id = old_ids.get(r).copied().unwrap_or(StageId {
                replica: r as u32,
                stage: 0,
            });
            let report = report.unwrap_or_else(|| StepReport {
                rank: Rank(r as u32),
                sample_ids: interrupted
                    .shares
                    .get(id.replica as usize)
                    .cloned()
                    .unwrap_or_default(),
                local_loss: None,
                learning_rate,
                trace: Vec::new(),
                pipeline: None,
                held: None,
            });
            (report, id)
        })
        .collect();
    step_done(
        state,
        step,
        reports,
        samples,
        interrupted.started.elapsed().as_secs_f64(),
    );
    Ok(Redo::Nothing)
}

/// ELASTIC-3: below the elastic minimum, wait for devices rather than train on (the step
/// `next` is held until a resize or `resume()`, the job ends after the elastic wait).
fn wait_for_minimum<M, I>(state: &mut SupervisorState<M, I>, next: u64) {
    let min = state.elastic.0;
    if !state.replicas_only || state.layout.dp() >= min || state.paused.is_some() {
        return;
    }
    let generation = state.generation;
    state.below_min = Some((generation, Instant::now()));
    state.paused = Some(None);
    publish(
        state,
        JobEvent::WaitingForDevices {
            step: next,
            replicas: state.layout.dp(),
            min,
            within: state.elastic_wait,
        },
    );
    let me: ActorRef<SupervisorMsg> = state.myself.clone().into();
    me.send_after(state.elastic_wait, move || {
        SupervisorMsg::MinimumWaitOver(generation)
    });
}

/// ELASTIC-4: a job that lost replicas grows back onto slots waiting to join it (nodes that
/// joined a job across processes beyond its maximum: spares), up to its maximum, before its
/// next step; below the elastic minimum that also ends the wait (ELASTIC-3).
fn refill_from_waiting<M, I>(state: &SupervisorState<M, I>) {
    let Some(Grow::Remote { waiting, .. }) = &state.grow else {
        return;
    };
    let dp = state.layout.dp();
    let room = state.elastic.1.saturating_sub(dp) as usize;
    let k = waiting().min(room);
    if k > 0 {
        let me: ActorRef<SupervisorMsg> = state.myself.clone().into();
        // The mailbox outlives this call; a failed send means the job is ending anyway.
        let _ = me.send_message(SupervisorMsg::ScaleTo(dp + k as u32));
    }
}

/// REC-7: the survivors (in their new rank order) that did not finish `step` take the
/// parameters and optimizer state of the first one that did.
async fn catch_up<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    finished: &[bool],
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(source) = finished.iter().position(|f| *f) else {
        return Ok(());
    };
    let timeout = state.step_timeout;
    let (stage, id) = state.stages[source].clone();
    let snapshot = ask(&stage, StageMsg::Snapshot, timeout, || {
        format!("{id}, which finished step {step}, did not answer a snapshot")
    })
    .await?;
    let behind: Vec<usize> = (0..finished.len()).filter(|&r| !finished[r]).collect();
    for &r in &behind {
        let (stage, id) = state.stages[r].clone();
        restore(&stage, snapshot.clone(), timeout, || {
            format!(
                "{id} did not take the state of {} that finished step {step}",
                state.stages[source].1
            )
        })
        .await?;
    }
    publish(
        state,
        JobEvent::CaughtUp {
            step,
            ranks: behind.into_iter().map(|r| Rank(r as u32)).collect(),
            from: Rank(source as u32),
        },
    );
    Ok(())
}

/// One data-parallel member: its stage and its device.
type Member<M> = (ActorRef<StageMsg<M>>, (ActorRef<DeviceMsg>, DeviceId));

/// Make `members` (in their new rank order) the job's data-parallel group under the next
/// generation: the old group is shut down and its actors stopped, every member joins a new
/// collective group (`StageMsg::Regroup`), the layout follows.
async fn rebuild_group<M, I>(
    state: &mut SupervisorState<M, I>,
    members: Vec<Member<M>>,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    // The old group is over: wake anything still waiting in it, stop its actors.
    (state.shutdown)();
    for o in state.others.drain(..) {
        state.departed.insert(o.get_id());
        o.stop(None);
    }
    let n = members.len();
    let generation = Generation(state.generation.0 + 1);
    if state.reconnect {
        return reconnect_group(state, members, generation).await;
    }
    let group = LocalGroup::new(n, generation, state.comm.clone());
    let comms = group.communicators();
    let mut stages = Vec::with_capacity(n);
    let mut devices = Vec::with_capacity(n);
    for (new_rank, ((stage, device), comm)) in members.into_iter().zip(comms).enumerate() {
        let id = StageId {
            replica: new_rank as u32,
            stage: 0,
        };
        let regroup = |reply| StageMsg::Regroup {
            id,
            rank: Rank(new_rank as u32),
            comm,
            reply,
        };
        ask(&stage, regroup, state.step_timeout, || {
            format!(
                "{id} did not join the rebuilt group of generation {}",
                generation.0
            )
        })
        .await?;
        stages.push((stage, id));
        devices.push(device);
    }
    let (group_ref, _) = Actor::spawn_linked(
        None,
        GroupActor,
        GroupArgs {
            members: (0..n as u32).map(Rank).collect(),
            group: group.clone(),
        },
        state.myself.clone(),
    )
    .await
    .map_err(|e| Error::Runtime(format!("could not start the rebuilt group: {e}")))?;
    state.stages = stages;
    state.devices = devices;
    state.others = vec![group_ref.get_cell()];
    state.shutdown = Arc::new(move || group.shutdown());
    state.generation = generation;
    state.layout = Layout::data_parallel(n as u32)?;
    Ok(())
}

/// [`rebuild_group`] for stages that connect their own data plane (a cluster job): every
/// member is asked at once to join the group of `generation` (each waits for the others while
/// it connects), the members named by their slots (a cluster job's device ids).
async fn reconnect_group<M, I>(
    state: &mut SupervisorState<M, I>,
    members: Vec<Member<M>>,
    generation: Generation,
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let n = members.len();
    let slots: Vec<Rank> = members.iter().map(|(_, (_, d))| Rank(d.0)).collect();
    let mut joins = JoinSet::new();
    for (new_rank, (stage, _)) in members.iter().enumerate() {
        let id = StageId {
            replica: new_rank as u32,
            stage: 0,
        };
        let (stage, slots, timeout) = (stage.clone(), slots.clone(), state.step_timeout);
        joins.spawn(async move {
            let reconnect = |reply| StageMsg::Reconnect {
                id,
                rank: Rank(new_rank as u32),
                generation,
                slots,
                reply,
            };
            ask(&stage, reconnect, timeout, || {
                format!(
                    "{id} did not join the rebuilt group of generation {}",
                    generation.0
                )
            })
            .await
        });
    }
    while let Some(joined) = joins.join_next().await {
        joined.map_err(|e| Error::Runtime(format!("a reconnect task failed: {e}")))??;
    }
    let mut stages = Vec::with_capacity(n);
    let mut devices = Vec::with_capacity(n);
    for (new_rank, (stage, device)) in members.into_iter().enumerate() {
        let id = StageId {
            replica: new_rank as u32,
            stage: 0,
        };
        stages.push((stage, id));
        devices.push(device);
    }
    state.stages = stages;
    state.devices = devices;
    state.generation = generation;
    state.layout = Layout::data_parallel(n as u32)?;
    Ok(())
}

/// Ask `stage` for something whose reply is a `Result`, waiting at most `timeout`; a stage
/// that does not answer is `Error::Runtime(unanswered())`.
async fn ask<M, T>(
    stage: &ActorRef<StageMsg<M>>,
    msg: impl FnOnce(ractor::RpcReplyPort<Result<T>>) -> StageMsg<M>,
    timeout: Duration,
    unanswered: impl FnOnce() -> String,
) -> Result<T>
where
    M: Send + 'static,
    T: Send + 'static,
{
    match stage.call(msg, Some(timeout)).await {
        Ok(CallResult::Success(r)) => r,
        _ => Err(Error::Runtime(unanswered())),
    }
}

/// Have `stage` take the parameters and optimizer state of `shards` (the blocks it holds).
async fn restore<M: Send + 'static>(
    stage: &ActorRef<StageMsg<M>>,
    shards: Vec<ShardSnapshot>,
    timeout: Duration,
    unanswered: impl FnOnce() -> String,
) -> Result<()> {
    let shard = Box::new(shards);
    ask(
        stage,
        |reply| StageMsg::Restore { shard, reply },
        timeout,
        unanswered,
    )
    .await
}

/// A device for a replica or stage that joins a running job: a spare of the builder's list,
/// else a new logical device of the same backend, with its actor started.
async fn start_device<M, I>(
    state: &mut SupervisorState<M, I>,
) -> Result<(MeshDevice, ActorRef<DeviceMsg>)>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let device = match state.spare_devices.pop() {
        Some(d) => d,
        None => {
            state.next_device_id += 1;
            let like = &state.device_template;
            MeshDevice::from_burn(
                DeviceId(state.next_device_id),
                like.kind(),
                like.burn().clone(),
            )
        }
    };
    let (device_ref, _) =
        Actor::spawn_linked(None, DeviceActor, device.clone(), state.myself.clone())
            .await
            .map_err(|e| Error::Runtime(format!("could not start device {}: {e}", device.id())))?;
    Ok((device, device_ref))
}

/// A new data-parallel replica at rank `r`: a device (a spare of the builder's list, else a
/// new logical device of the same backend), its actor, and an initialized stage alone in a
/// group of one until everyone regroups.
async fn spawn_replica<M, I>(state: &mut SupervisorState<M, I>, r: usize) -> Result<Member<M>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(grow) = state.grow.clone() else {
        return Err(Error::InvalidConfig(
            "this job cannot start replicas".into(),
        ));
    };
    let id = StageId {
        replica: r as u32,
        stage: 0,
    };
    let (stage, device) = match grow {
        Grow::Local(grow) => {
            let (device, device_ref) = start_device(state).await?;
            let comm = LocalGroup::new(1, state.generation, state.comm.clone())
                .communicators()
                .remove(0);
            let stage = grow(GrowArgs {
                supervisor: state.myself.clone(),
                id,
                rank: Rank(r as u32),
                device: device.clone(),
                device_actor: device_ref.clone(),
                comm,
            })
            .await
            .map_err(|e| Error::Runtime(format!("could not start {id}: {e}")))?;
            (stage, (device_ref, device.id()))
        }
        Grow::Remote { start: grow, .. } => grow(RemoteGrowArgs {
            supervisor: state.myself.clone(),
            id,
        })
        .await
        .map_err(|e| Error::Runtime(format!("could not start {id}: {e}")))?,
    };
    if let Err(e) = ask(&stage, StageMsg::Init, state.step_timeout, || {
        format!("{id} did not initialize")
    })
    .await
    {
        // Linked to the Supervisor: departed, so their ends are not read as a failure.
        state.departed.insert(stage.get_id());
        state.departed.insert(device.0.get_id());
        stage.stop(None);
        device.0.stop(None);
        return Err(e);
    }
    Ok((stage, device))
}

/// REC-6: for every lost rank of a pipeline job, a surviving rank with the same stage index
/// (its twin), or `None` if some lost rank has none.
fn twins_of<M, I>(state: &SupervisorState<M, I>, lost: &[usize]) -> Option<Vec<(usize, usize)>> {
    if state.replicas_only || state.rewire.is_none() || lost.is_empty() {
        return None;
    }
    lost.iter()
        .map(|&r| {
            let stage = state.stages.get(r)?.1.stage;
            let twin = state
                .stages
                .iter()
                .enumerate()
                .position(|(t, (_, id))| id.stage == stage && !lost.contains(&t))?;
            Some((r, twin))
        })
        .collect()
}

/// Replace the `lost` ranks of a pipeline job with fresh, initialized stage actors on spare
/// or new devices, and rewire the whole mesh under the next generation (REC-6): the old
/// links and groups are shut, survivors take their new wiring, the layout stays.
async fn replace_pipeline_stages<M, I>(
    state: &mut SupervisorState<M, I>,
    lost: &[usize],
) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(rewire) = state.rewire.clone() else {
        return Err(Error::InvalidConfig(
            "this job cannot replace pipeline stages".into(),
        ));
    };
    (state.shutdown)();
    for o in state.others.drain(..) {
        state.departed.insert(o.get_id());
        o.stop(None);
    }
    let mut devices = Vec::with_capacity(state.devices.len());
    for r in 0..state.devices.len() {
        if !lost.contains(&r) || state.reconnect_devices {
            // A surviving stage keeps its device; a cluster job's spawner finds its own.
            devices.push(None);
            continue;
        }
        devices.push(Some(start_device(state).await?));
    }
    let generation = Generation(state.generation.0 + 1);
    let rewired = rewire(RewireArgs {
        supervisor: state.myself.clone(),
        layout: state.layout,
        generation,
        comm: state.comm.clone(),
        devices: devices.clone(),
        fresh: lost.to_vec(),
        slots: state.devices.iter().map(|(_, id)| *id).collect(),
    })
    .await
    .map_err(|e| Error::Runtime(format!("could not rewire the pipeline: {e}")))?;
    for (r, device) in rewired.devices {
        if let Some(d) = state.devices.get_mut(r) {
            *d = device;
        }
    }
    let timeout = state.step_timeout;
    for (r, stage) in rewired.fresh {
        let id = state.stages[r].1;
        ask(&stage, StageMsg::Init, timeout, || {
            format!("the replacement of {id} did not start")
        })
        .await?;
        state.stages[r].0 = stage;
        if let Some((device, device_ref)) = &devices[r] {
            state.devices[r] = (device_ref.clone(), device.id());
        }
    }
    for (r, wiring) in rewired.survivors.into_iter().enumerate() {
        let Some((links, comm)) = wiring else {
            continue;
        };
        let (stage, id) = state.stages[r].clone();
        let rewire = |reply| StageMsg::Rewire { links, comm, reply };
        ask(&stage, rewire, timeout, || {
            format!("{id} did not take its new wiring")
        })
        .await?;
    }
    state.others = rewired.others;
    state.shutdown = rewired.shutdown;
    state.generation = generation;
    Ok(())
}

/// REC-6: replace each lost pipeline stage with a fresh one holding its twin's parameters
/// and optimizer state, then redo the step — unless a survivor had already applied it.
async fn replace_from_twins<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    twins: &[(usize, usize)],
    cause: Error,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let lost: Vec<usize> = twins.iter().map(|(r, _)| *r).collect();
    let applied = state.interrupted.take().is_some_and(|i| {
        i.done
            .iter()
            .enumerate()
            .any(|(r, d)| d.is_some() && !lost.contains(&r))
    });
    if applied {
        // Some stages updated, others did not: only a checkpoint restores one state. (A stage
        // applies its update once its own data-parallel all-reduce is done, not when the
        // whole mesh is: a stage lost after sending its last gradients, while its twin waits
        // for it, leaves the stages before it updated.)
        if state.recovery.roll_back {
            return roll_back_to_checkpoint(state, step, &lost, cause).await;
        }
        return Err(Error::Runtime(format!(
            "step {step} was applied by some stages and not by others when a stage was lost, \
             so its replacement cannot redo it; only a checkpoint makes the stages agree \
             again (the loss: {cause})"
        )));
    }
    let lost_devices: Vec<DeviceId> = lost.iter().map(|&r| state.devices[r].1).collect();
    // Snapshots first: the twins' state is the step's starting state (nothing applied).
    let timeout = state.step_timeout;
    let mut snapshots = Vec::with_capacity(twins.len());
    for &(_, twin) in twins {
        let (stage, id) = state.stages[twin].clone();
        let s = ask(&stage, StageMsg::Snapshot, timeout, || {
            format!("{id} did not answer a snapshot")
        })
        .await?;
        snapshots.push(s);
    }
    replace_pipeline_stages(state, &lost).await.map_err(|e| {
        Error::Runtime(format!(
            "the lost stage could not be replaced: {e} (the loss: {cause})"
        ))
    })?;
    for (&(r, twin), shards) in twins.iter().zip(snapshots) {
        let (stage, id) = state.stages[r].clone();
        restore(&stage, shards, timeout, || {
            format!("{id} did not take its twin's state")
        })
        .await?;
        publish(
            state,
            JobEvent::StageReplaced {
                step,
                stage: id,
                twin: state.stages[twin].1,
                device: state.devices[r].1,
            },
        );
    }
    publish(
        state,
        JobEvent::Recovered {
            step,
            generation: state.generation,
            layout: state.layout,
            lost: lost_devices,
        },
    );
    Ok(Redo::Step)
}

/// REC-5: replace the `lost` ranks with new replicas, restore every replica from the newest
/// valid checkpoint, regroup under the next generation, and go on from the checkpoint's
/// step. Without a checkpoint the job ends with `cause`.
async fn roll_back_to_checkpoint<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    lost: &[usize],
    cause: Error,
) -> Result<Redo>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    state.interrupted = None;
    // Checkpoints still queued for writing count: wait for them (bounded).
    let queue = state.checkpointer.as_ref().and_then(Checkpointer::queue);
    if let Some(queue) = queue {
        let timeout = state.step_timeout;
        let _ = tokio::task::spawn_blocking(move || queue.flush(timeout)).await;
    }
    let Some((checkpoint, dir, _)) = latest_checkpoint(state).await? else {
        return Err(cause);
    };
    let shard = checkpoint.shards.clone();
    let lost_devices: Vec<DeviceId> = lost.iter().map(|&r| state.devices[r].1).collect();
    let mut members = Vec::with_capacity(state.stages.len());
    if state.replicas_only {
        for r in 0..state.stages.len() {
            if lost.contains(&r) {
                members.push(spawn_replica(state, r).await?);
            } else {
                members.push((state.stages[r].0.clone(), state.devices[r].clone()));
            }
        }
    } else {
        // A pipeline: fresh stages for the lost ranks, the whole mesh rewired.
        replace_pipeline_stages(state, lost).await?;
        members = state
            .stages
            .iter()
            .zip(&state.devices)
            .map(|((s, _), d)| (s.clone(), d.clone()))
            .collect();
    }
    for (stage, (_, device)) in &members {
        restore(stage, shard.clone(), state.step_timeout, || {
            format!(
                "the stage on device {device} did not restore {}",
                dir.display()
            )
        })
        .await?;
    }
    if state.replicas_only {
        rebuild_group(state, members).await?;
    }
    state.last_checkpoint = Some(checkpoint.step);
    publish(
        state,
        JobEvent::RolledBack {
            failed_step: step,
            step: checkpoint.step,
            generation: state.generation,
            path: dir,
            lost: lost_devices,
        },
    );
    Ok(Redo::From(checkpoint.step))
}

/// The newest valid checkpoint of the job's store, checked against the job's data order
/// (same seed, same position), with the newer ones that were refused.
async fn latest_checkpoint<M, I>(
    state: &mut SupervisorState<M, I>,
) -> Result<Option<(Checkpoint, std::path::PathBuf, Vec<String>)>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(settings) = state.checkpoints.clone() else {
        return Ok(None);
    };
    let sink = settings.sink.clone();
    let read = tokio::task::spawn_blocking(move || sink.latest_valid());
    let loaded = tokio::time::timeout(state.step_timeout, read)
        .await
        .map_err(|_| {
            Error::Runtime(format!(
                "reading the checkpoints took longer than the step time-out ({:?})",
                state.step_timeout
            ))
        })?
        .map_err(|e| Error::Runtime(format!("reading checkpoints: {e}")))??;
    let Some(loaded) = loaded else {
        return Ok(None);
    };
    let c = loaded.checkpoint;
    // The data must continue where it stopped: same seed, same batches.
    if c.rng.seed != state.seed || c.cursor != state.sampler.cursor(c.step) {
        return Err(Error::InvalidConfig(format!(
            "{} was written with seed {} at data position {:?}; this job has seed {} and \
             would read position {:?}: resume with the same seed, batch size and data",
            loaded.dir.display(),
            c.rng.seed,
            c.cursor,
            state.seed,
            state.sampler.cursor(c.step)
        )));
    }
    let refused = loaded
        .refused
        .iter()
        .map(|r| format!("{}: {}", r.dir.display(), r.error))
        .collect();
    Ok(Some((c, loaded.dir, refused)))
}

/// Resize a data-parallel job to `n` replicas at a step boundary (ELASTIC-1): leaving replicas
/// are stopped; joining ones get a device (a spare of the builder's list, else a new logical
/// device of the same backend), build the model, take rank 0's parameters and optimizer state,
/// and everyone regroups under the next generation. The global batch stays the same.
async fn resize<M, I>(state: &mut SupervisorState<M, I>, step: u64, n: usize) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let from = state.stages.len();
    if !state.replicas_only {
        return Err(Error::InvalidConfig(
            "only data-parallel jobs can be resized yet".into(),
        ));
    }
    if n == from {
        return Err(Error::InvalidConfig(format!(
            "the job already has {n} replicas"
        )));
    }
    if n > from && state.lr_scheduled {
        return Err(Error::InvalidConfig(
            "a job with a learning-rate scheduler cannot grow yet: a joining replica's \
             scheduler would start from its first step"
                .into(),
        ));
    }
    // ZeRO: every rank's shard is gathered before anyone leaves, and re-sharded onto the new
    // group once it is built (ZERO-3).
    let gathered = if state.replicated_state {
        None
    } else {
        Some(snapshot_state(state).await?)
    };
    let mut members: Vec<Member<M>> = state
        .stages
        .iter()
        .zip(&state.devices)
        .take(n)
        .map(|((s, _), d)| (s.clone(), d.clone()))
        .collect();
    // Leaving replicas: the last ranks.
    for r in n..from {
        let (stage, _) = &state.stages[r];
        let (device, _) = &state.devices[r];
        state.departed.insert(stage.get_id());
        state.departed.insert(device.get_id());
        stage.stop(None);
        device.stop(None);
    }
    if n > from {
        if state.grow.is_none() {
            return Err(Error::InvalidConfig("this job cannot grow".into()));
        }
        let snapshot = match &gathered {
            Some(all) => all.clone(),
            None => {
                let (rank0, _) = state.stages[0].clone();
                ask(&rank0, StageMsg::Snapshot, state.step_timeout, || {
                    "rank 0 did not answer the snapshot request".into()
                })
                .await?
            }
        };
        for r in from..n {
            let id = StageId {
                replica: r as u32,
                stage: 0,
            };
            let joined = match spawn_replica(state, r).await {
                Ok((stage, device)) => {
                    let taken = restore(&stage, snapshot.clone(), state.step_timeout, || {
                        format!("{id} did not take rank 0's state")
                    })
                    .await;
                    if taken.is_err() {
                        state.departed.insert(stage.get_id());
                        state.departed.insert(device.0.get_id());
                        stage.stop(None);
                        device.0.stop(None);
                    } else {
                        members.push((stage, device));
                    }
                    taken
                }
                Err(e) => Err(e),
            };
            if let Err(e) = joined {
                // ELASTIC-5: a replica that cannot join (no device for it, no node waiting, a
                // joining node gone) ends the growth there; the ones that joined before it
                // stay, and with none the mesh is left as it was.
                if members.len() == from {
                    return Err(Error::InvalidConfig(format!(
                        "replica {r} could not join: {e}"
                    )));
                }
                publish(
                    state,
                    JobEvent::ResizeRefused {
                        requested: n as u32,
                        reason: format!(
                            "replica {r} could not join ({e}); growing to {} replicas",
                            members.len()
                        ),
                    },
                );
                break;
            }
        }
    }
    let to = members.len();
    rebuild_group(state, members).await?;
    if let Some(all) = gathered {
        for (stage, id) in state.stages.clone() {
            restore(&stage, all.clone(), state.step_timeout, || {
                format!("{id} did not take its re-sharded state")
            })
            .await?;
        }
    }
    publish(
        state,
        JobEvent::Resized {
            step,
            generation: state.generation,
            from: from as u32,
            to: to as u32,
        },
    );
    Ok(())
}

fn describe<M, I>(state: &SupervisorState<M, I>, cell: &ractor::ActorCell) -> String {
    let id = cell.get_id();
    if let Some((_, s)) = state.stages.iter().find(|(r, _)| r.get_id() == id) {
        return format!("the actor of {s}");
    }
    if let Some((_, d)) = state.devices.iter().find(|(r, _)| r.get_id() == id) {
        return format!("the actor of device {d}");
    }
    format!("actor {id}")
}

fn publish<M, I>(state: &SupervisorState<M, I>, event: JobEvent) {
    // EV-1: no receiver or a lagging one never blocks the job.
    let _ = state.events.send(event);
}

/// Pick the root cause among several stage errors: a peer woken by the group's shutdown is a
/// consequence, not a cause.
fn root_cause(errors: Vec<Error>) -> Option<Error> {
    let is_consequence = |e: &Error| {
        matches!(
            e,
            // A broken link to another process is the consequence of that process's failure
            // (which its own stage reports, naming it).
            Error::Comm(
                CommError::Shutdown { .. } | CommError::Poisoned { .. } | CommError::Link { .. }
            ) | Error::Pipeline(
                ExecError::Aborted { .. }
                    | ExecError::LinkClosed { .. }
                    | ExecError::Wire { .. }
                    | ExecError::Comm(
                        CommError::Shutdown { .. }
                            | CommError::Poisoned { .. }
                            | CommError::Link { .. }
                    )
            )
        )
    };
    let mut it = errors.into_iter();
    let first = it.next()?;
    if !is_consequence(&first) {
        return Some(first);
    }
    Some(it.find(|e| !is_consequence(e)).unwrap_or(first))
}

async fn init_all<M, I>(state: &mut SupervisorState<M, I>) -> Result<(Vec<u64>, Vec<u64>)>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let timeout = state.step_timeout;
    let results = call_all(state, move |_| Some(StageMsg::Init), timeout).await?;
    Ok(results.into_iter().map(|r| (r.before, r.after)).unzip())
}

/// Send one request to every stage (built by `make` per rank) and collect the replies in rank
/// order. The first failure shuts the group down so that no stage stays blocked in a
/// collective; the root cause is returned.
async fn call_all<M, I, T, F>(
    state: &mut SupervisorState<M, I>,
    make: F,
    timeout: Duration,
) -> Result<Vec<T>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
    T: Send + 'static,
    F: Fn(usize) -> Option<fn(ractor::RpcReplyPort<Result<T>>) -> StageMsg<M>>,
{
    call_all_with(
        state,
        |r| {
            let f = make(r)?;
            Some(Box::new(f) as Box<dyn FnOnce(_) -> _ + Send>)
        },
        timeout,
        None,
    )
    .await
}

/// How long a device may take to answer a heartbeat probe.
const HEARTBEAT_PROBE: Duration = Duration::from_secs(2);

/// How long the other stages may take to report once one has failed.
const FAILURE_GRACE: Duration = Duration::from_secs(2);

type MsgBuilder<M, T> = Box<dyn FnOnce(ractor::RpcReplyPort<Result<T>>) -> StageMsg<M> + Send>;

async fn call_all_with<M, I, T, F>(
    state: &mut SupervisorState<M, I>,
    make: F,
    timeout: Duration,
    step: Option<u64>,
) -> Result<Vec<T>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
    T: Send + 'static,
    F: Fn(usize) -> Option<MsgBuilder<M, T>>,
{
    match call_all_partial(state, make, timeout, step).await {
        (results, None) => Ok(results.into_iter().flatten().collect()),
        (_, Some(e)) => Err(e),
    }
}

/// Like [`call_all_with`], also returning the replies of the stages that succeeded when
/// another failed (by rank), with the root cause.
async fn call_all_partial<M, I, T, F>(
    state: &mut SupervisorState<M, I>,
    make: F,
    timeout: Duration,
    step: Option<u64>,
) -> (Vec<Option<T>>, Option<Error>)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
    T: Send + 'static,
    F: Fn(usize) -> Option<MsgBuilder<M, T>>,
{
    let mut set = JoinSet::new();
    for (r, (stage, _)) in state.stages.iter().enumerate() {
        let Some(build) = make(r) else { continue };
        let stage = stage.clone();
        set.spawn(async move { (r, stage.call(build, Some(timeout)).await) });
    }
    let mut results: Vec<Option<T>> = (0..state.stages.len()).map(|_| None).collect();
    let mut errors = Vec::new();
    let mut missing = Vec::new();
    loop {
        // Once a stage has failed (and the shutdown woke every wait), the others get a short
        // grace to report; one stuck in user code does not hold the job's end back.
        let next = if errors.is_empty() {
            set.join_next().await
        } else {
            match tokio::time::timeout(FAILURE_GRACE.min(timeout), set.join_next()).await {
                Ok(next) => next,
                Err(_) => break,
            }
        };
        let Some(joined) = next else { break };
        let Ok((r, reply)) = joined else {
            errors.push(Error::Runtime("a request task panicked".into()));
            continue;
        };
        let failure = match reply {
            Ok(CallResult::Success(Ok(v))) => {
                results[r] = Some(v);
                None
            }
            Ok(CallResult::Success(Err(e))) => Some(e),
            Ok(CallResult::Timeout) => {
                missing.push(r);
                None
            }
            Ok(CallResult::SenderError) | Err(_) => Some(Error::StageLost {
                device: state.devices[r].1,
                stage: state.stages[r].1,
                reason: "its actor stopped without answering".into(),
            }),
        };
        if let Some(e) = failure {
            if errors.is_empty() {
                // RT-4: wake every peer blocked in a collective now.
                (state.shutdown)();
            }
            errors.push(e);
        }
    }
    if !missing.is_empty() && errors.is_empty() {
        (state.shutdown)();
        let mut devices = Vec::new();
        for &r in &missing {
            let (d, id) = &state.devices[r];
            devices.push(match heartbeat(d, *id, Duration::from_secs(2)).await {
                Ok(h) => match h.busy {
                    Some((what, since)) => format!("device {id}: busy with {what} for {since:?}"),
                    None => format!("device {id}: idle"),
                },
                Err(e) => e.to_string(),
            });
        }
        let e = Error::StepTimeout {
            step: step.unwrap_or(0),
            missing: missing.iter().map(|&r| state.stages[r].1).collect(),
            waited: timeout,
            devices,
        };
        return (results, Some(e));
    }
    let cause = root_cause(errors);
    (results, cause)
}

async fn run_step<M, I>(state: &mut SupervisorState<M, I>, step: u64) -> Result<()>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    // FaultPlan: devices killed at the start of this step (their actors disappear).
    if let Some(h) = state.faults.clone() {
        for device in h.kills_at(step) {
            if let Some(r) = state.devices.iter().position(|(_, d)| *d == device) {
                state.stages[r].0.kill();
                state.devices[r].0.kill();
            }
        }
    }
    let dp = state.layout.dp() as usize;
    let k = state.accumulation as usize;
    let epoch = state.sampler.cursor(step).epoch;
    if state.epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
        state.epoch_order = Some((epoch, state.sampler.epoch_order(epoch)));
    }
    let (_, order) = state.epoch_order.as_ref().expect("set just above");
    let shares = state.sampler.split_in(order, step, dp);
    let global_samples: usize = shares.iter().map(Vec::len).sum();
    let started = Instant::now();
    let timeout = state.step_timeout;
    // Every stage of a replica's pipeline gets that replica's share.
    let replica_of: Vec<usize> = state
        .stages
        .iter()
        .map(|(_, id)| id.replica as usize)
        .collect();
    let (partial, failure) = call_all_partial(
        state,
        |r| {
            let share = &shares[replica_of[r]];
            // k micro-batches whose sizes differ by at most one.
            let micro_batches: Vec<Vec<usize>> = (0..k)
                .map(|m| share[crate::comm::chunk_range(share.len(), k, m)].to_vec())
                .filter(|mb| !mb.is_empty())
                .collect();
            Some(Box::new(move |reply| StageMsg::Step {
                step,
                micro_batches,
                global_samples,
                reply,
            }) as MsgBuilder<M, StepReport>)
        },
        timeout,
        Some(step),
    )
    .await;
    let reports = match failure {
        None => Ok(partial.into_iter().flatten().collect::<Vec<_>>()),
        Some(e) => {
            // Kept for recovery: who finished this step (and applied its update) before the
            // failure ended it.
            state.interrupted = Some(Interrupted {
                shares: shares.clone(),
                done: partial,
                started,
            });
            Err(e)
        }
    };
    let reports = match reports {
        Ok(r) => r,
        Err(Error::Comm(CommError::Timeout {
            generation,
            seq,
            op,
            missing,
            waited,
        })) if state.replicas_only => {
            // Tell stuck from dead: probe the missing ranks' devices.
            let mut ranks = Vec::new();
            for rank in missing {
                let Some((device, id)) = state.devices.get(rank.index()) else {
                    continue;
                };
                let health = match heartbeat(device, *id, HEARTBEAT_PROBE).await {
                    Err(e) => Health::Dead {
                        reason: e.to_string(),
                    },
                    Ok(h) => match h.progress {
                        Some((progress, since)) if since >= waited => {
                            Health::Stuck { progress, since }
                        }
                        Some((progress, _)) => Health::Progressing { progress },
                        None => Health::Stuck {
                            progress: "no progress reported".into(),
                            since: waited,
                        },
                    },
                };
                ranks.push(RankHealth {
                    rank,
                    device: *id,
                    health,
                });
            }
            return Err(Error::RanksUnresponsive {
                op,
                seq,
                generation,
                waited,
                ranks,
            });
        }
        Err(e) => return Err(e),
    };
    let wall_s = started.elapsed().as_secs_f64();
    let samples: usize = shares.iter().map(Vec::len).sum();
    let ids: Vec<StageId> = state.stages.iter().map(|(_, id)| *id).collect();
    step_done(
        state,
        step,
        reports.into_iter().zip(ids).collect(),
        samples,
        wall_s,
    );
    Ok(())
}

/// Publish a finished step: its loss, samples, time breakdown and pipeline figures.
fn step_done<M, I>(
    state: &mut SupervisorState<M, I>,
    step: u64,
    reports: Vec<(StepReport, StageId)>,
    samples: usize,
    wall_s: f64,
) {
    let stage_ids: Vec<StageId> = reports.iter().map(|(_, id)| *id).collect();
    let reports: Vec<StepReport> = reports.into_iter().map(|(r, _)| r).collect();
    // The mean over the global batch: each replica's mean weighted by its share.
    let (weighted, counted) = reports
        .iter()
        .filter_map(|r| r.local_loss.map(|l| (l, r.sample_ids.len())))
        .fold((0.0f64, 0usize), |(s, n), (l, k)| {
            (s + f64::from(l) * k as f64, n + k)
        });
    let loss = (weighted / counted.max(1) as f64) as f32;
    let skipped = reports.iter().any(|r| r.learning_rate.is_none());
    if skipped {
        let ranks = reports
            .iter()
            .filter(|r| r.local_loss.is_some_and(|l| !l.is_finite()))
            .map(|r| r.rank)
            .collect();
        publish(
            state,
            JobEvent::NonFiniteLoss {
                step,
                ranks,
                skipped: true,
            },
        );
    }
    let learning_rate = reports.iter().find_map(|r| r.learning_rate);
    let pipeline = pipeline_step(&stage_ids, &reports, state.layout);
    let replicas: Vec<ReplicaStep> = reports
        .into_iter()
        .zip(&stage_ids)
        .map(|(r, id)| ReplicaStep {
            rank: r.rank,
            stage: *id,
            pipeline: r.pipeline,
            breakdown: TimeBreakdown::from_records(&r.trace, wall_s),
            sample_ids: r.sample_ids,
            loss: r.local_loss,
            trace: r.trace,
            held: r.held,
        })
        .collect();
    let mut mean = TimeBreakdown::default();
    for r in &replicas {
        mean = mean.plus(r.breakdown);
    }
    let n = replicas.len().max(1) as f64;
    let s = &mut state.summary;
    s.steps += 1;
    s.samples += samples as u64;
    s.wall_s += wall_s;
    s.breakdown = s.breakdown.plus(TimeBreakdown {
        compute_s: mean.compute_s / n,
        communication_s: mean.communication_s / n,
        waiting_s: mean.waiting_s / n,
    });
    if !skipped {
        s.first_loss.get_or_insert(loss);
        s.last_loss = Some(loss);
    }
    publish(
        state,
        JobEvent::StepDone(StepDone {
            step,
            loss,
            samples_per_s: samples as f64 / wall_s.max(1e-9),
            wall_s,
            learning_rate,
            skipped,
            replicas,
            pipeline,
        }),
    );
}

/// The pipeline figures of a step from the stages' reports: the measured bubble and timeline of
/// replica 0's pipeline (times from its first instruction), every stage's peak stash and
/// activation bytes (the largest over replicas).
fn pipeline_step(
    stages: &[StageId],
    reports: &[StepReport],
    layout: Layout,
) -> Option<PipelineStep> {
    let pp = layout.pp() as usize;
    let mut timeline: Vec<Vec<TimedInstr>> = vec![Vec::new(); pp];
    let mut peak_stash = vec![0u32; pp];
    let mut peak_activation_bytes = vec![0u64; pp];
    let mut any = false;
    for (report, id) in reports.iter().zip(stages) {
        let Some(p) = &report.pipeline else { continue };
        any = true;
        let s = id.stage as usize;
        if s >= pp {
            continue;
        }
        peak_stash[s] = peak_stash[s].max(p.peak_stash);
        peak_activation_bytes[s] = peak_activation_bytes[s].max(p.peak_activation_bytes);
        if id.replica == 0 {
            timeline[s] = p.executed.clone();
        }
    }
    if !any {
        return None;
    }
    let origin = timeline
        .iter()
        .flatten()
        .map(|t| t.start)
        .min()
        .unwrap_or(0);
    for t in timeline.iter_mut().flatten() {
        t.start -= origin;
        t.end -= origin;
    }
    let summary = summarize(&timeline);
    let span = summary.makespan.max(1) as f64;
    Some(PipelineStep {
        bubble: summary.bubble,
        shares: summary
            .per_stage
            .iter()
            .map(|s| StageShares {
                compute: s.compute as f64 / span,
                communication: s.communication as f64 / span,
                waiting: s.idle as f64 / span,
            })
            .collect(),
        peak_stash,
        peak_activation_bytes,
        timeline,
    })
}

/// Take a snapshot of the state after `step` steps and hand it to the writer thread (CKW-1).
/// A failure is published, not fatal (CKW-2).
/// The job's training state, one snapshot per block: data-parallel replicas hold the same
/// state, so replica 0's stages give it; where each rank holds a shard of it (ZeRO), every
/// rank is asked and each block's optimizer parts are put together (CKPT-8).
async fn snapshot_state<M, I>(state: &mut SupervisorState<M, I>) -> Result<Vec<ShardSnapshot>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let ranks: Vec<usize> = if state.replicated_state {
        state.model_ranks.clone()
    } else {
        (0..state.stages.len()).collect()
    };
    let mut all: Vec<ShardSnapshot> = Vec::new();
    for r in ranks {
        let Some((stage, id)) = state.stages.get(r).cloned() else {
            continue;
        };
        let got = ask(&stage, StageMsg::Snapshot, state.step_timeout, || {
            format!("{id} did not answer the snapshot request")
        })
        .await?;
        for snap in got {
            match all.iter_mut().find(|s| s.shard == snap.shard) {
                // Another rank's part of a block already snapshotted: keep its parameters
                // (equal on every rank) and add its optimizer part.
                Some(kept) => {
                    let merged = match (kept.optimizer.take(), snap.optimizer) {
                        (Some(a), Some(b)) => OptimizerState::merge_parts([a, b]),
                        (a, b) => a.or(b),
                    };
                    kept.optimizer = merged;
                }
                None => all.push(snap),
            }
        }
    }
    Ok(all)
}

async fn checkpoint<M, I>(state: &mut SupervisorState<M, I>, step: u64)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(queue) = state.checkpointer.as_ref().and_then(Checkpointer::queue) else {
        return;
    };
    // FaultPlan: this checkpoint's write fails half-way (so it is taken whatever the backlog).
    let fail_half_way = state
        .faults
        .as_ref()
        .is_some_and(|h| h.fails_checkpoint(step));
    // CKW-3: at most MAX_BACKLOG snapshots in flight; a disk slower than the checkpoint
    // interval holds the step boundary until the oldest is written (bounded by the step
    // time-out, after which this checkpoint is skipped and says so).
    let deadline = Instant::now() + state.step_timeout;
    while queue.backlog() >= MAX_BACKLOG && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let backlog = queue.backlog();
    if backlog >= MAX_BACKLOG && !fail_half_way {
        let error = Error::Runtime(format!(
            "skipped: the writer was still busy with {backlog} earlier checkpoint(s) after {:?}",
            state.step_timeout
        ));
        publish(state, JobEvent::CheckpointFailed { step, error });
        return;
    }
    let shards = snapshot_state(state).await;
    match shards {
        Ok(shards) => {
            let sent = queue.send(Queued {
                checkpoint: Checkpoint {
                    step,
                    layout: state.layout,
                    cursor: state.sampler.cursor(step),
                    rng: RngState {
                        seed: state.seed,
                        state: step,
                    },
                    shards,
                },
                fail_half_way,
            });
            if sent {
                state.last_checkpoint = Some(step);
            } else {
                let error = Error::Runtime("the checkpoint writer thread has stopped".into());
                publish(state, JobEvent::CheckpointFailed { step, error });
            }
        }
        Err(error) => publish(state, JobEvent::CheckpointFailed { step, error }),
    }
}

/// Restore the newest valid checkpoint if the job asks to resume; the first step to run.
async fn resume<M, I>(state: &mut SupervisorState<M, I>) -> Result<u64>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if !state.checkpoints.as_ref().is_some_and(|c| c.resume) {
        return Ok(0);
    }
    let Some((c, dir, refused)) = latest_checkpoint(state).await? else {
        let Some(settings) = &state.checkpoints else {
            return Ok(0);
        };
        let location = settings.sink.location();
        if settings.require {
            return Err(crate::checkpoint::CheckpointError::NothingToResume { location }.into());
        }
        publish(state, JobEvent::NothingToResume { location });
        return Ok(0);
    };
    let timeout = state.step_timeout;
    for (stage, id) in state.stages.clone() {
        let shard = Box::new(c.shards.clone());
        match stage
            .call(|reply| StageMsg::Restore { shard, reply }, Some(timeout))
            .await
        {
            Ok(CallResult::Success(Ok(()))) => {}
            Ok(CallResult::Success(Err(e))) => {
                return Err(Error::InvalidConfig(format!(
                    "{} cannot be restored onto this job: {e}",
                    dir.display()
                )));
            }
            _ => {
                return Err(Error::Runtime(format!(
                    "{id} did not restore the checkpoint"
                )));
            }
        }
    }
    state.last_checkpoint = Some(c.step);
    publish(
        state,
        JobEvent::Restored {
            step: c.step,
            path: dir,
            refused,
        },
    );
    Ok(c.step)
}

async fn finish<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    result: Result<()>,
) where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    state.finished = true;
    // CKW-1: the checkpoints asked for are on disk before the job's last event.
    if let Some(mut writer) = state.checkpointer.take() {
        let _ = tokio::task::spawn_blocking(move || writer.drain(DRAIN_TIMEOUT)).await;
    }
    let outcome = match result {
        Ok(()) => collect_model(state).await,
        Err(e) => Err(e),
    };
    match &outcome {
        Ok(_) => {}
        Err(e) => {
            if let Error::NonFiniteLoss { step, ranks } = e {
                publish(
                    state,
                    JobEvent::NonFiniteLoss {
                        step: *step,
                        ranks: ranks.clone(),
                        skipped: false,
                    },
                );
            }
            publish(state, JobEvent::Failed(e.clone()));
        }
    }
    (state.shutdown)();
    if let Some(tx) = state.outcome.take() {
        let _ = tx.send(outcome);
    }
    // SV-1: nothing of the job outlives it.
    for (s, _) in &state.stages {
        s.stop(None);
    }
    for (d, _) in &state.devices {
        d.stop(None);
    }
    for o in &state.others {
        o.stop(None);
    }
    myself.stop(None);
}

async fn collect_model<M, I>(state: &mut SupervisorState<M, I>) -> Result<Trained<M>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let timeout = state.step_timeout;
    let fingerprints = call_all(state, |_| Some(StageMsg::Fingerprint), timeout).await?;
    let mut parts = Vec::with_capacity(state.model_ranks.len());
    for &r in &state.model_ranks {
        let (stage, id) = &state.stages[r];
        match stage.call(StageMsg::TakeModel, Some(timeout)).await {
            Ok(CallResult::Success(Some(model))) => parts.push(model),
            _ => return Err(Error::Runtime(format!("{id} did not hand over its model"))),
        }
    }
    let model = (state.assemble)(parts)
        .ok_or_else(|| Error::Runtime("the trained model could not be put together".into()))?;
    // The last event: published only once the model is in hand.
    publish(
        state,
        JobEvent::Finished {
            steps: state.summary.steps,
            fingerprints,
        },
    );
    Ok(Trained {
        model,
        summary: state.summary.clone(),
    })
}
