//! What a job's [`Spawner`](crate::actors::spawner::Spawner) and the Supervisor hand each
//! other: the spawn context, the spawned stages, and the handles the Supervisor uses when the
//! mesh changes: how to add a replica (`Grow`) and how to rewire a pipeline (REC-6). What the
//! Supervisor may do with them is the spawner's `Capabilities`, not part of these values.

use std::sync::Arc;
use std::time::Duration;

use ractor::{ActorProcessingErr, ActorRef};

use crate::actors::device::DeviceMsg;
use crate::actors::stage::StageMsg;
use crate::comm::CommConfig;
use crate::device::MeshDevice;
use crate::error::{DeviceId, StageId};
use crate::mesh::{Generation, Layout, Rank};

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
    /// Starts one more data-parallel replica: there when the capabilities say `can_grow`.
    pub(crate) grow: Option<Grow<M>>,
    /// Rewires a pipeline mesh under a new generation, starting fresh stages for replaced
    /// ranks (REC-6): there when the capabilities' `rejoin` is `Rewire`.
    pub(crate) rewire: Option<RewireStages<M>>,
    /// The device actors, by rank, when the spawner started them itself (a cluster job's
    /// proxies of other processes' devices); `None`: the context's devices.
    pub(crate) devices: Option<Vec<(ActorRef<DeviceMsg>, DeviceId)>>,
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

/// What a surviving stage takes with `StageMsg::Rewire`: its links, its data-parallel
/// communicator and its tensor-parallel communicator (none at dp = 1, tp = 1).
pub(crate) type SurvivorWiring = (
    Box<crate::parallel::pipeline_exec::StageLinks>,
    Option<crate::comm::Communicator>,
    crate::parallel::pipeline_exec::ModelGroups,
);

/// A rewired mesh.
pub(crate) struct Rewired<M> {
    /// The fresh stage actors, by rank (not initialized yet).
    pub(crate) fresh: Vec<(usize, ActorRef<StageMsg<M>>)>,
    /// Per rank, the wiring a surviving stage takes with `StageMsg::Rewire` (none for fresh
    /// ranks).
    pub(crate) survivors: Vec<Option<SurvivorWiring>>,
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
