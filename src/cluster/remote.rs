//! Training across processes: the Supervisor on the head drives stages that live in other
//! processes through proxies, and each process serves its own stages.
//!
//! ```text
//! head process                                   node process (and the head's own devices)
//! Supervisor ─ RemoteStage ×N (StageMsg) ─┐      NodeAgent ─► NodeStages (StageHost)
//!            └ RemoteDevice ×N (DeviceMsg)┘──────►   per slot: DeviceActor + StageActor
//!                 (control plane: StageRequest)       with a TCP Communicator (data plane)
//! ```
//!
//! - Every rank of a cluster job is a proxy on the head: a `RemoteStage` answers the
//!   Supervisor's `StageMsg`s by sending [`StageOp`]s to the process that holds the rank, and
//!   a `RemoteDevice` answers its heartbeats. The head's own devices are served by the same
//!   `NodeStages` in the head's process, without the network: one code path for every rank.
//! - A node builds its stages with the same [`crate::job::JobBuilder`] code as the head
//!   ([`crate::job::JobBuilder::stage_host`]), so a stage on a node trains exactly as a
//!   stage in the head's process would; gradients meet over the TCP data plane
//!   (`comm::tcp`), never over the control plane.
//! - Parameters cross the control plane only for snapshots, restores and the trained model,
//!   as checkpoint shards (CRC-checked on arrival) under the control message limit.
//!
//! # Invariants
//!
//! - **REMOTE-1** a slot is a rank of the world as assembled (generation 0); its device id is
//!   `DeviceId(slot)`, so after a recovery the Supervisor names the members of a rebuilt group
//!   by their slots (`StageMsg::Reconnect`).
//! - **REMOTE-2** a node that cannot be reached (its process died, its session closed) makes
//!   every request to its stages fail at once with `Error::StageLost` naming the stage and the
//!   node: the Supervisor's recovery treats it as a lost device. A peer's broken data-plane
//!   link (`CommError::Link`) names the lost rank too.
//! - **REMOTE-3** an abort (the Supervisor's RT-4 shutdown) carries the generation it is for:
//!   a node ignores an abort older than its slot's group, so a late abort never breaks the
//!   group a recovery just formed.
//! - **REMOTE-4** (dp × pp × tp, `pipeline`) a pipeline slot starts in two phases and keeps
//!   its pipeline links, tensor-parallel group and model group on listeners of their own.
//! - **REMOTE-5** the world only grows: a node that joins the running job brings the next
//!   slots, and the job grows onto them (or a roll-back replaces a lost replica with one).
//! - **REMOTE-6** parameters of any size cross the control plane: a snapshot or restore over
//!   [`PART_BYTES`] moves in parts, each message under the control message limit.
//! - **REMOTE-7** (REC-6 across processes) a lost pipeline stage is started again on a
//!   waiting slot (a node that joined the running job) and every rank is wired anew under the
//!   next generation at once (`pipeline::wire_ops`); a survivor that takes the new wiring
//!   ignores aborts of older generations from then on.

use std::collections::HashMap;
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::module::Module;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::control::{
    HostArgs, NodeHandle, PART_BYTES, ProcessIndex, ProcessPlan, RemoteError, StageAnswer,
    StageHost, StageOp, StageRequest, join_shards, split_shards,
};
use crate::actors::device::{DeviceActor, DeviceMsg, heartbeat};
use crate::actors::pipeline_stage::PipelineSpec;
use crate::actors::spawner::{
    Capabilities, Grow, GrowRemote, Grown, Rejoin, RemoteGrowArgs, RewireArgs, RewireStages,
    Rewired, SpawnContext, SpawnFuture, Spawned, Spawner,
};
use crate::actors::stage::{InitReport, StageActor, StageArgs, StageMsg, StageSpec};
use crate::checkpoint::{ShardSnapshot, restore_module};
use crate::comm::Communicator;
use crate::comm::net::link::{JobToken, LinkListener};
use crate::comm::process_groups::{GroupShutdown, ProcessGroups};
use crate::comm::tcp::TcpConfig;
use crate::device::{BackendKind, MeshDevice};
use crate::error::{Error, Result};
use crate::mesh::{Coord, Generation, Layout, Rank};
use crate::mesh::{DeviceId, StageId};
use crate::parallel::ModelContext;
use crate::parallel::pipeline::PipelineSchedule;
use crate::parallel::pipeline_exec::{StageLinks, remote_links};
use crate::parallel::stages::PipelineModel;

mod mesh;
mod node;
pub(crate) mod pipeline;
mod proxy;
mod ps;
mod spawners;

pub use mesh::{ClusterMesh, MeshJoiner};
use mesh::{Endpoint, HEARTBEAT_WAIT, MeshSlots, Shape, lock};
pub(crate) use node::NodeStages;
pub(crate) use proxy::{RemoteDevice, RemoteDeviceArgs, RemoteStage, RemoteStageArgs};
pub(crate) use ps::{ClusterParameterServer, PsWorkerSlots};
pub(crate) use spawners::{ClusterPipeline, ClusterReplicas};
use spawners::{Proxies, ask_each};

/// How the head rebuilds a stage's trained model from the snapshot its process sends.
pub(crate) type Rebuild<M> =
    Arc<dyn Fn(StageId, Vec<ShardSnapshot>) -> std::result::Result<M, String> + Send + Sync>;

/// A started stage actor, or why not.
pub(crate) type SlotFuture<M> =
    Pin<Box<dyn Future<Output = std::result::Result<ActorRef<StageMsg<M>>, String>> + Send>>;

/// What a slot's stage actor starts with.
pub(crate) struct SlotStart {
    pub(crate) id: StageId,
    /// The slot (its rank in the world).
    pub(crate) rank: Rank,
    pub(crate) device: MeshDevice,
    pub(crate) device_actor: ActorRef<DeviceMsg>,
    /// Its data-parallel group's communicator (none in a pipeline job with one replica).
    pub(crate) comm: Option<Communicator>,
    /// Its pipeline links (pipeline jobs).
    pub(crate) links: Option<StageLinks>,
    /// Its tensor-parallel and model groups (pipeline jobs).
    pub(crate) model: crate::parallel::pipeline_exec::ModelGroups,
    /// Where its parameter server is (a parameter-server worker).
    pub(crate) server: Option<ps::ServerLinkArgs>,
}

/// What a process's slots run: data-parallel replicas or pipeline stages.
pub(crate) trait SlotFactory<M>: Send + Sync + 'static {
    /// The job's schedule, if it is a pipeline job (REMOTE-4).
    fn pipeline(&self) -> Option<Arc<PipelineSchedule>>;
    /// Starts a slot's stage actor.
    fn spawn(&self, start: SlotStart) -> SlotFuture<M>;
}

/// The slots of a data-parallel job: each an ordinary [`StageActor`].
pub(crate) struct ReplicaSlots<M, I>(pub(crate) Arc<StageSpec<M, I>>);

impl<M, I> SlotFactory<M> for ReplicaSlots<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    fn pipeline(&self) -> Option<Arc<PipelineSchedule>> {
        None
    }

    fn spawn(&self, start: SlotStart) -> SlotFuture<M> {
        let spec = self.0.clone();
        Box::pin(async move {
            let comm = start
                .comm
                .ok_or_else(|| format!("{}: no data-parallel group", start.id))?;
            let args = StageArgs {
                id: start.id,
                rank: start.rank,
                device: start.device,
                device_actor: start.device_actor,
                comm,
                spec,
            };
            Actor::spawn(None, StageActor::<M, I>::default(), args)
                .await
                .map(|(a, _)| a)
                .map_err(|e| format!("cannot start {}: {e}", start.id))
        })
    }
}
