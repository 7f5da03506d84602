//! `Supervisor`: owns the job, drives the step clock, recovers or ends the job on failure.
//!
//! A thin actor over pure decisions: `decide` holds what to do at a step boundary, what a
//! failure means and whether a resize is admitted, as pure functions of plain data with
//! property tests, whose facts about the strategy are its spawner's `Capabilities` (kept in
//! the state); the files beside this one carry the answers out, one concern each: `state`
//! (what the actor holds, with what a job's `Spawner` hands it), `lifecycle` (start,
//! `Init`, children that end, the end of the job), `boundary` (between two steps),
//! `step` (a step as a task of its own), `calls` (requests to every stage at once, the root
//! cause of a failure), `recover` (REC-1..7), `members` (joining devices and replicas, the
//! group rebuilt under a new generation), `resize` (ELASTIC-1, 3..6), `checkpoints` (CKW-1..3,
//! resume).
//!
//! Handles, as a table (the `match` in `handle` is exactly this):
//! - `Init` → every stage's `Init` (model, broadcast of rank 0's parameters), `Started` and
//!   `ReplicasSynchronized`, a restore when resuming, then `RunStep(first)`;
//! - `RunStep(s)` → the step boundary: pause, losses between steps, resize, hold below the
//!   minimum, checkpoint, then finish or start step `s` on a task;
//! - `StepFinished` → `StepDone` and `RunStep(s + 1)`, or recover (redo, go on, roll back)
//!   or end the job with the root cause; then the children that ended during the step;
//! - `Stop`, `Pause`, `Resume`, `CheckpointNow`, `ScaleTo`, `AddReplicas` → remembered for the
//!   next boundary (a paused job stops at once; a resize below the minimum ends the wait);
//! - `Status` → answered at once;
//! - `MinimumWaitOver(g)` → `BelowMinimum` if generation `g` still waits;
//! - a child actor failing or stopping unexpectedly → recovered at the next boundary (a
//!   recovering policy) or the end of the job with an error naming it.
//!
//! Invariants:
//! - SV-1: the job's actors never outlive it: finishing stops every child, the running
//!   step's task and the Supervisor.
//! - SV-2: the outcome (model or error) is sent exactly once.
//! - SV-3: a step runs on a task of its own that reports `StepFinished`, so `status()` is
//!   answered, and `pause()`/`stop()` are taken, while a step runs; they act at the next
//!   boundary. A stop waits for the running step (bounded by the step time-out, RT-3) and
//!   never aborts it: an aborted step could leave some replicas updated and others not.
//! - SV-4: a step's outcome is taken only from the running attempt (its attempt number and
//!   the mesh's generation); any other is stale and ignored.
//!
//! - **SV-5** a lost rank whose state is a shard (ZeRO) is never dropped nor copied from a twin:
//!   the job rolls back to its checkpoint, or ends if the policy does not roll back
//!   (`decide::on_failure`).

mod boundary;
mod calls;
mod checkpoints;
mod decide;
mod lifecycle;
mod members;
mod recover;
mod resize;
mod state;
mod step;

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::{broadcast, oneshot};

pub(crate) use checkpoints::CheckpointSettings;
pub(crate) use state::SupervisorState;
pub(crate) use step::StepFinished;

use crate::actors::spawner::Spawner;
use crate::comm::CommConfig;
use crate::device::MeshDevice;
use crate::error::Result;
use crate::events::JobEvent;
use crate::faults::FaultHooks;
use crate::mesh::{Generation, Layout};
use crate::parallel::sampler::DistributedSampler;
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
    /// Ranks of the last step (every stage of every replica).
    #[serde(default)]
    pub ranks: u32,
    /// Control messages of the Supervisor over the run's steps (SCALE-1), from the first
    /// step's start to the last one's end: the requests it sent to the stages, their replies,
    /// and the messages its own inbox handled. Data never passes through it (collectives run
    /// between the ranks).
    #[serde(default)]
    pub control_messages: u64,
    /// The minor page faults of the Supervisor's process over the run's steps
    /// ([`StepDone::page_faults`](crate::events::StepDone::page_faults) summed); `None` where
    /// they are not counted.
    #[serde(default)]
    pub page_faults: Option<u64>,
    /// The same over every step after the first: the steady state, once the first step has
    /// touched the memory a step needs.
    #[serde(default)]
    pub page_faults_after_first: Option<u64>,
}

impl RunSummary {
    /// The run's serial fraction and the speed-up it allows on more devices (AMDAHL-1): from
    /// the steps' wall time and the mean time each rank computed. `None` before a step.
    pub fn amdahl(&self) -> Option<crate::scaling::Amdahl> {
        crate::scaling::Amdahl::from_times(self.wall_s, self.breakdown.compute_s, self.ranks)
    }

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
pub(crate) enum SupervisorMsg {
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
    /// A step's task reports its outcome (SV-3); one of another attempt is ignored (SV-4).
    StepFinished(Box<StepFinished>),
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
pub(crate) struct Supervisor<M, I>(std::marker::PhantomData<fn() -> (M, I)>);

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

/// A job as `build()` made it, ready for a Supervisor: its description (CONF-1: the steps,
/// time-outs, recovery policy, seed, elastic range and straggler detection are read from
/// it) and what was derived from it (the spawner, devices, mesh, sampler, the collectives'
/// settings in effect, the fault hooks, the checkpoint store).
pub(crate) struct PreparedJob<M, I> {
    pub(crate) config: crate::job_config::JobConfig,
    pub(crate) spawn: Box<dyn Spawner<M>>,
    pub(crate) items: std::marker::PhantomData<fn() -> I>,
    pub(crate) devices: Vec<MeshDevice>,
    /// Whether the spawner starts every rank's device itself (a cluster job): then `devices`
    /// holds only the template of the devices the job's model is assembled on.
    pub(crate) remote: bool,
    pub(crate) layout: Layout,
    /// Micro-batches per replica and step (a pipeline's schedule's, else the accumulation).
    pub(crate) accumulation: u32,
    pub(crate) sampler: DistributedSampler,
    /// The description's collective settings as they run (payload checks turned on for a
    /// fault plan that corrupts messages).
    pub(crate) comm: CommConfig,
    pub(crate) faults: Option<Arc<FaultHooks>>,
    pub(crate) checkpoints: Option<CheckpointSettings>,
}

impl<M, I> std::fmt::Debug for PreparedJob<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Job({:?}, {} steps)", self.layout, self.config.steps)
    }
}

/// What the Supervisor starts from (built by [`crate::job::Job::spawn`]).
pub(crate) struct SupervisorArgs<M, I> {
    pub(crate) job: PreparedJob<M, I>,
    pub(crate) events: broadcast::Sender<JobEvent>,
    pub(crate) outcome: oneshot::Sender<Result<Trained<M>>>,
}

impl<M, I> std::fmt::Debug for SupervisorArgs<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SupervisorArgs({:?})", self.job)
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
        args: SupervisorArgs<M, I>,
    ) -> Result<SupervisorState<M, I>, ActorProcessingErr> {
        lifecycle::start(&myself, args).await
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        if state.clock.finished {
            return Ok(());
        }
        state
            .clock
            .control
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let me = &myself;
        match msg {
            SupervisorMsg::Init => lifecycle::init(me, state).await?,
            SupervisorMsg::RunStep(step) => boundary::run(me, state, step).await?,
            SupervisorMsg::StepFinished(done) => step::finished(me, state, *done).await?,
            SupervisorMsg::Stop => boundary::stop(me, state)?,
            SupervisorMsg::Pause => boundary::pause(state),
            SupervisorMsg::Resume => boundary::resume(me, state)?,
            SupervisorMsg::CheckpointNow => state.ckpt.checkpoint_requested = true,
            SupervisorMsg::ScaleTo(n) => resize::request(me, state, n)?,
            SupervisorMsg::AddReplicas(k) => resize::add(me, state, k)?,
            SupervisorMsg::MinimumWaitOver(g) => resize::minimum_wait_over(me, state, g).await,
            SupervisorMsg::Status(reply) => drop(reply.send(state.status())),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        state: &mut SupervisorState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        lifecycle::abandon(state);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        lifecycle::child_exited(&myself, state, event).await;
        Ok(())
    }
}
