//! What the Supervisor holds between messages, and the small reads and writes every concern
//! shares (publishing an event, naming an actor, the status).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use ractor::{ActorRef, SupervisionEvent};
use tokio::sync::{broadcast, oneshot};

use super::calls::Crew;
use super::checkpoints::CheckpointSettings;
use super::recover::Interrupted;
use super::step::RunningStep;
use super::{JobStatus, RunSummary, SupervisorMsg, Trained};
use crate::actors::checkpointer::Checkpointer;
use crate::actors::device::DeviceMsg;
use crate::actors::spawner::Capabilities;
use crate::actors::spawner::{Grow, RewireStages};
use crate::actors::stage::StageMsg;
use crate::comm::CommConfig;
use crate::device::MeshDevice;
use crate::error::{DeviceId, Error, StageId};
use crate::events::JobEvent;
use crate::faults::FaultHooks;
use crate::mesh::{Generation, Layout};
use crate::parallel::sampler::DistributedSampler;
use crate::recovery::{RecoveryPolicy, RestartLog};

/// State of the [`Supervisor`](super::Supervisor), in parts each concern owns: who is in the
/// job ([`Membership`], `members.rs` and `resize.rs`), where training is ([`StepClock`],
/// `step.rs`), checkpoints ([`Checkpointing`], `checkpoints.rs`), failures and what recovery
/// has done ([`RecoveryLog`], `recover.rs`) and the size the job may take ([`Elasticity`],
/// `resize.rs`). What decides (`decide.rs`) stays pure: it reads values, not this state.
pub(crate) struct SupervisorState<M, I> {
    pub(super) members: Membership<M>,
    pub(super) clock: StepClock,
    pub(super) ckpt: Checkpointing,
    pub(super) recovery: RecoveryLog,
    pub(super) elastic: Elasticity,
    pub(super) events: broadcast::Sender<JobEvent>,
    pub(super) outcome: Option<oneshot::Sender<crate::error::Result<Trained<M>>>>,
    /// The Supervisor itself, to link rebuilt actors to.
    pub(super) myself: ractor::ActorCell,
    /// The straggler detectors, one per pipeline stage and tensor-parallel rank (replicas of
    /// the same work are compared), and the generation their ranks are numbered in
    /// (STRAG-3).
    pub(super) stragglers: Option<Stragglers>,
    pub(super) _items: std::marker::PhantomData<fn() -> I>,
}

/// Who is in the job: the mesh, its generation, every actor and what rebuilds them.
pub(crate) struct Membership<M> {
    pub(super) layout: Layout,
    pub(super) generation: Generation,
    pub(super) devices: Vec<(ActorRef<DeviceMsg>, DeviceId)>,
    pub(super) stages: Vec<(ActorRef<StageMsg<M>>, StageId)>,
    /// Collective groups and other actors of the job.
    pub(super) others: Vec<ractor::ActorCell>,
    /// Wakes every stage blocked in a collective or a link, whatever happens to the actors'
    /// mailboxes (RT-4).
    pub(super) shutdown: Arc<dyn Fn() + Send + Sync>,
    /// What the job's strategy allows (recovery, resize, checkpoints, rejoining).
    pub(super) caps: Capabilities,
    /// Whether the spawner found the devices itself (a cluster job's proxies of other
    /// processes' devices): replacements find theirs the same way.
    pub(super) reconnect_devices: bool,
    pub(super) model_ranks: Vec<usize>,
    pub(super) assemble: fn(Vec<M>) -> Option<M>,
    /// Actors the Supervisor stopped or gave up on: their exit is not a new failure.
    pub(super) departed: HashSet<ractor::ActorId>,
    pub(super) grow: Option<Grow<M>>,
    pub(super) rewire: Option<RewireStages<M>>,
    /// Devices of the builder's list beyond the mesh, for replicas that join.
    pub(super) spare_devices: Vec<MeshDevice>,
    /// What a new logical device is made like.
    pub(super) device_template: MeshDevice,
    pub(super) next_device_id: u32,
    /// Collective settings, for rebuilt groups.
    pub(super) comm: CommConfig,
}

/// Where training is: the steps, the data order, the running step and the run so far.
pub(crate) struct StepClock {
    pub(super) steps: u64,
    pub(super) accumulation: u32,
    pub(super) sampler: DistributedSampler,
    /// The current epoch's sample order, computed once per epoch.
    pub(super) epoch_order: Option<(u64, Vec<usize>)>,
    pub(super) step_timeout: Duration,
    /// The step running now as a task of its own (SV-3), if any.
    pub(super) running: Option<RunningStep>,
    /// Step attempts started so far: a `StepFinished` of another attempt is stale (SV-4).
    pub(super) attempts: u64,
    /// Children that ended while a step ran: handled once its outcome is, in the order the
    /// actor would have seen them had it awaited the step.
    pub(super) deferred: Vec<SupervisionEvent>,
    pub(super) seed: u64,
    pub(super) summary: RunSummary,
    /// Control messages so far: requests the Supervisor sent to stages, their replies, and
    /// the messages its own inbox handled (SCALE-1).
    pub(super) control: Arc<AtomicU64>,
    /// The count when the last step ended (or the first began).
    pub(super) control_mark: u64,
    /// The step a pause held back, run on `Resume`.
    pub(super) paused: Option<Option<u64>>,
    pub(super) stop_requested: bool,
    pub(super) finished: bool,
}

/// Checkpoints: where they go, the writer, and the last one taken or restored.
pub(crate) struct Checkpointing {
    pub(super) checkpoints: Option<CheckpointSettings>,
    pub(super) checkpointer: Option<Checkpointer>,
    pub(super) checkpoint_requested: bool,
    /// The step boundary of the last checkpoint taken or restored.
    pub(super) last_checkpoint: Option<u64>,
}

/// Failures and what recovery has done about them.
pub(crate) struct RecoveryLog {
    pub(super) policy: RecoveryPolicy,
    pub(super) restarts: RestartLog,
    /// Ranks found dead between steps (a supervision event): recovered at the next step.
    pub(super) pending_lost: Vec<(usize, Error)>,
    /// The step that failed last, for the recovery that follows.
    pub(super) interrupted: Option<Interrupted>,
    pub(super) faults: Option<Arc<FaultHooks>>,
}

/// The sizes the job may take and a resize on its way.
pub(crate) struct Elasticity {
    /// The size asked by `scale_to`, applied at the next step boundary.
    pub(super) scale_target: Option<u32>,
    /// Smallest and largest data-parallel size `scale_to` accepts.
    pub(super) range: (u32, u32),
    /// Set while the job waits below the elastic minimum: the generation that waits, since.
    pub(super) below_min: Option<(Generation, Instant)>,
    /// How long the job waits for devices below the elastic minimum.
    pub(super) wait: Duration,
}

/// The Supervisor's straggler detection (STRAG-1..3).
#[derive(Debug)]
pub(crate) struct Stragglers {
    pub(super) config: crate::stragglers::StragglerDetection,
    /// The generation the detectors' ranks are numbered in.
    pub(super) generation: Generation,
    /// One detector per (pipeline stage, tensor-parallel rank).
    pub(super) detectors:
        std::collections::BTreeMap<(u32, u32), crate::stragglers::StragglerDetector>,
}

impl<M, I> std::fmt::Debug for SupervisorState<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SupervisorState({:?})", self.members.layout)
    }
}

impl<M, I> SupervisorState<M, I> {
    /// Publish an event. EV-1: no receiver or a lagging one never blocks the job.
    pub(super) fn publish(&self, event: JobEvent) {
        let _ = self.events.send(event);
    }

    /// Publish the faults of the plan that fired (FAULT-1).
    pub(super) fn publish_fired(&self) {
        if let Some(h) = &self.recovery.faults {
            for f in h.take_fired() {
                self.publish(JobEvent::FaultInjected(f));
            }
        }
    }

    /// The Supervisor's own address, for messages to itself.
    pub(super) fn me(&self) -> ActorRef<SupervisorMsg> {
        self.myself.clone().into()
    }

    /// Where the job is (answered at once, also while a step runs: SV-3).
    pub(super) fn status(&self) -> JobStatus {
        JobStatus {
            layout: self.members.layout,
            steps_done: self.clock.summary.steps,
            steps_total: self.clock.steps,
            stopping: self.clock.stop_requested,
            paused: self.clock.paused.is_some(),
            generation: self.members.generation,
        }
    }

    /// The stages, their devices and the group's shutdown, for requests made off the actor.
    pub(super) fn crew(&self) -> Crew<M> {
        Crew {
            stages: self.members.stages.clone(),
            devices: self.members.devices.clone(),
            shutdown: self.members.shutdown.clone(),
            control: self.clock.control.clone(),
        }
    }
}

impl<M> Membership<M> {
    /// The rank whose stage or device actor `cell` is.
    pub(super) fn rank_of_actor(&self, cell: &ractor::ActorCell) -> Option<usize> {
        let id = cell.get_id();
        self.stages
            .iter()
            .position(|(r, _)| r.get_id() == id)
            .or_else(|| self.devices.iter().position(|(r, _)| r.get_id() == id))
    }

    /// What `cell` is, for messages.
    pub(super) fn describe(&self, cell: &ractor::ActorCell) -> String {
        let id = cell.get_id();
        if let Some((_, s)) = self.stages.iter().find(|(r, _)| r.get_id() == id) {
            return format!("the actor of {s}");
        }
        if let Some((_, d)) = self.devices.iter().find(|(r, _)| r.get_id() == id) {
            return format!("the actor of device {d}");
        }
        format!("actor {id}")
    }

    /// Each current rank's place in the model: its stage index and its tensor-parallel rank
    /// (ranks of the same place in different replicas hold the same state: twins).
    pub(super) fn stage_of(&self) -> Vec<u32> {
        self.stages
            .iter()
            .map(|(_, id)| (id.stage << 16) | (id.tp & 0xffff))
            .collect()
    }

    /// The current ranks' stages.
    pub(super) fn stage_ids(&self) -> Vec<StageId> {
        self.stages.iter().map(|(_, id)| *id).collect()
    }

    /// The current ranks `failures` name as lost ([`decide::lost_ranks`](super::decide::lost_ranks)).
    pub(super) fn lost_ranks(&self, failures: &[(Option<usize>, Error)]) -> Vec<usize> {
        super::decide::lost_ranks(failures, &self.stage_ids(), self.caps.rejoin.regroups())
    }

    /// Stop every actor of the job (SV-1).
    pub(super) fn stop_all(&self) {
        for (s, _) in &self.stages {
            s.stop(None);
        }
        for (d, _) in &self.devices {
            d.stop(None);
        }
        for o in &self.others {
            o.stop(None);
        }
    }
}
