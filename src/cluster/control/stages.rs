//! How the head drives the stages its nodes hold: one stage message of the Supervisor
//! (`actors::stage::StageMsg`) as a control message, and the node's side of it
//! ([`StageHost`]). Pure data and a trait: the host that trains lives in
//! `crate::cluster::remote`.
//!
//! # The conversation (after `Prepare`; each request bounded by the time-out it carries)
//!
//! ```text
//! head (a RemoteStage proxy per rank)            node agent → StageHost
//!  │ Stage { slot, Start { id } } ───────────────►│ device + stage actor, joins the data plane
//!  │◄──── StageDone(Done)                          │   (generation 0, every rank of the world)
//!  │      (a pipeline job: the device, and a listener for the pipeline links)
//!  │◄──── StageDone(Listening(listeners))          │   (links, tensor-parallel, model group)
//!  │ Stage { slot, Wire { generation, dp, links, tp, model } } ►│ joins its stage index's
//!  │◄──── StageDone(Done)                          │   data-parallel group, its tensor-parallel
//!  │                                               │   and model groups, connects to its
//!  │                                               │   pipeline's stages
//!  │                      (again under generation + 1 when a lost stage was replaced: REC-6)
//!  │ Stage { slot, Init | Step | Fingerprint | Snapshot | ModelSnapshot | Restore
//!  │         | Heartbeat } ─►│
//!  │◄──── StageDone(the answer) or StageDone(Failed(RemoteError))
//!  │ Stage { slot, Regroup { id, rank, generation, addrs } } ─►│ reconnects (after a loss)
//!  │ Stage { slot, Abort } ──────────────────────►│ shuts its data-plane group (RT-4)
//! ```
//!
//! A slot is a rank of the world as the head assembled it (generation 0); after a recovery
//! the stage of a slot may hold another rank, but keeps its slot.

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::protocol::JobSpec;
use super::world::ProcessPlan;
use crate::comm::CommError;
use crate::comm::net::link::JobToken;
use crate::error::Error;
use crate::mesh::{DeviceId, StageId};
use crate::mesh::{Generation, Rank};
use crate::parallel::pipeline_exec::ExecError;
use crate::report::{Heartbeat, StepReport};

/// One request for the stage of `slot`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageRequest {
    /// The stage's slot (its rank in the assembled world).
    pub slot: Rank,
    /// How long the node may take, in milliseconds (the head waits a little longer).
    pub timeout_ms: u64,
    /// What to do.
    pub op: StageOp,
}

/// What the head asks of a node's stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StageOp {
    /// Start the slot's device and stage actor as `id`, joining the data plane of generation 0
    /// with every rank of the world. In a pipeline job: start the device and bind a listener
    /// for the pipeline links (answered with [`StageAnswer::Listening`]); the stage starts at
    /// [`StageOp::Wire`].
    Start {
        /// The stage's place in the mesh.
        id: StageId,
        /// A node that joined the running job: start in a data-plane group of its own (the
        /// head reconnects everyone once its stage holds rank 0's state).
        alone: bool,
        /// A parameter-server worker: the port of the head's gateway to its server (at the
        /// address the node reaches the head at).
        server: Option<u16>,
    },
    /// A pipeline job: join the data-parallel group of the slot's stage index, its
    /// tensor-parallel group and its replica's model group, and connect to the other stages of
    /// its pipeline under `generation`, then start the stage actor, or (a stage that runs
    /// already: a rewire after a stage of the mesh was replaced, REC-6) hand it the new
    /// wiring.
    Wire {
        /// The wiring's generation (0 when the job starts).
        generation: Generation,
        /// The data-plane addresses of the slot's (stage, tensor-parallel rank)'s replicas, by
        /// replica (its data-parallel group; one address at dp = 1).
        dp: Vec<SocketAddr>,
        /// The pipeline-link listeners of its pipeline's stages (its replica and
        /// tensor-parallel rank), by stage index.
        links: Vec<SocketAddr>,
        /// The tensor-parallel listeners of its (replica, stage)'s ranks, by tensor-parallel
        /// rank (one address at tp = 1).
        tp: Vec<SocketAddr>,
        /// The model-group listeners of every stage × tensor-parallel rank of its replica, in
        /// rank order (stage-major; one address when a replica is one rank): where the global
        /// gradient norm and f16's overflow are agreed.
        model: Vec<SocketAddr>,
    },
    /// `StageMsg::Init`: build the model, take rank 0's parameters, build the optimizer.
    Init,
    /// `StageMsg::Step`.
    Step {
        /// The step.
        step: u64,
        /// The sample ids of each micro-batch.
        micro_batches: Vec<Vec<usize>>,
        /// Samples in the whole step over all replicas.
        global_samples: usize,
    },
    /// `StageMsg::Fingerprint`.
    Fingerprint,
    /// `StageMsg::Snapshot`: the answer carries each shard in the checkpoint format, or (over
    /// [`PART_BYTES`]) says in how many parts it waits to be fetched ([`StageOp::SnapshotPart`]).
    Snapshot,
    /// The stage's trained model as it holds it now (after `Fingerprint`, a ZeRO-3 stage holds
    /// its blocks' full parameters): one shard per block, parameters only, answered as
    /// `Snapshot` is (in parts over [`PART_BYTES`]). What the head rebuilds the trained model
    /// from.
    ModelSnapshot,
    /// Part `part` of the snapshot `transfer` the last `Snapshot` or `ModelSnapshot` kept.
    SnapshotPart {
        /// The transfer ([`StageAnswer::SnapshotParts`] names it): a part of an older snapshot
        /// is never handed out for a newer one.
        transfer: u64,
        /// The part, from 0.
        part: u32,
    },
    /// Part `part` of `parts` of shards to restore (a restore over [`PART_BYTES`]); the last
    /// part restores them.
    RestorePart {
        /// The transfer (the head's choice): parts of different restores never mix.
        transfer: u64,
        /// The part, from 0.
        part: u32,
        /// How many parts there are.
        parts: u32,
        /// The part's bytes ([`join_shards`]'s encoding, cut in pieces).
        bytes: Vec<u8>,
    },
    /// `StageMsg::Restore`: each shard in the checkpoint format (checksums verified on
    /// arrival).
    Restore {
        /// The encoded shards.
        shards: Vec<Vec<u8>>,
    },
    /// Join a new data-plane group under `generation` as `rank`: the group's ranks listen at
    /// `addrs`, in rank order (after a recovery).
    Regroup {
        /// The stage's new place.
        id: StageId,
        /// Its new rank.
        rank: Rank,
        /// The new group's generation.
        generation: Generation,
        /// Every member's data-plane address, by new rank.
        addrs: Vec<SocketAddr>,
        /// Every member's process, by new rank (members sharing a process all-reduce
        /// hierarchically).
        processes: Vec<u32>,
    },
    /// The device's heartbeat.
    Heartbeat,
    /// Shut the stage's data-plane group down, waking anything waiting in it (RT-4), if it is
    /// of `generation` or older (a late abort never breaks a newer group).
    Abort {
        /// The newest generation the abort is for.
        generation: Generation,
    },
}

impl StageOp {
    /// The op's name, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Start { .. } => "Start",
            Self::Wire { .. } => "Wire",
            Self::Init => "Init",
            Self::Step { .. } => "Step",
            Self::Fingerprint => "Fingerprint",
            Self::Snapshot => "Snapshot",
            Self::ModelSnapshot => "ModelSnapshot",
            Self::SnapshotPart { .. } => "SnapshotPart",
            Self::RestorePart { .. } => "RestorePart",
            Self::Restore { .. } => "Restore",
            Self::Regroup { .. } => "Regroup",
            Self::Heartbeat => "Heartbeat",
            Self::Abort { .. } => "Abort",
        }
    }
}

/// Where a pipeline slot accepts the connections of what a `Wire` joins it to (REMOTE-4): one
/// listener each, so no group takes another's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineListeners {
    /// Its pipeline's links to the other stages.
    pub links: SocketAddr,
    /// Its tensor-parallel group.
    pub tp: SocketAddr,
    /// Its replica's model group (every stage × tensor-parallel rank).
    pub model: SocketAddr,
}

/// A node's answer to a [`StageRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StageAnswer {
    /// Done (Start, Wire, Restore, Regroup, Abort).
    Done,
    /// The answer to Start in a pipeline job: where the slot accepts its pipeline links and
    /// the connections of its tensor-parallel and model groups.
    Listening(PipelineListeners),
    /// The answer to Init.
    Init {
        /// Fingerprint of the parameters the factory built.
        before: u64,
        /// Fingerprint after receiving rank 0's parameters.
        after: u64,
    },
    /// The answer to Step.
    Step(Box<StepReport>),
    /// The answer to Fingerprint.
    Fingerprint(u64),
    /// The answer to Snapshot: each shard in the checkpoint format.
    Snapshot(Vec<Vec<u8>>),
    /// The answer to a Snapshot over [`PART_BYTES`]: fetch it in `parts` parts.
    SnapshotParts {
        /// The transfer to name in each `SnapshotPart`.
        transfer: u64,
        /// How many parts.
        parts: u32,
    },
    /// The answer to SnapshotPart.
    Part(Vec<u8>),
    /// The answer to Heartbeat.
    Heartbeat(Heartbeat),
    /// The op failed on the node.
    Failed(RemoteError),
    /// The answer to Step (its report, or why it failed) with the faults of the job's fault
    /// plan that fired in the node's process since its last step answer (FAULT-3: the head
    /// publishes them). Flat, not a wrapper of another answer: a nested answer would let a
    /// message of bounded size nest without bound in the decoder.
    StepFired {
        /// Each fault that fired: its index in the plan (which the head holds too) and the
        /// micro-batch it fired at.
        fired: Vec<(u32, Option<u32>)>,
        /// The step's report, or why it failed.
        outcome: Result<Box<StepReport>, RemoteError>,
    },
}

impl StageAnswer {
    /// The answer's name, for errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Done => "Done",
            Self::Listening(_) => "Listening",
            Self::Init { .. } => "Init",
            Self::Step(_) => "Step",
            Self::Fingerprint(_) => "Fingerprint",
            Self::Snapshot(_) => "Snapshot",
            Self::SnapshotParts { .. } => "SnapshotParts",
            Self::Part(_) => "Part",
            Self::Heartbeat(_) => "Heartbeat",
            Self::Failed(_) => "Failed",
            Self::StepFired { outcome: Ok(_), .. } => "Step",
            Self::StepFired {
                outcome: Err(_), ..
            } => "Failed",
        }
    }
}

/// An [`Error`] of a node's stage, as it crosses to the head: the variants the Supervisor's
/// recovery reads keep their fields (who failed, which peer a link lost), the rest their text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RemoteError {
    /// [`Error::StageFailed`].
    StageFailed {
        /// The device.
        device: DeviceId,
        /// The stage.
        stage: StageId,
        /// What it was doing.
        during: String,
        /// Why.
        reason: String,
    },
    /// [`Error::StageLost`].
    StageLost {
        /// The device.
        device: DeviceId,
        /// The stage.
        stage: StageId,
        /// Why.
        reason: String,
    },
    /// [`Error::Comm`]: a collective failed (a lost peer is named in it).
    Comm(CommError),
    /// [`Error::NonFiniteLoss`].
    NonFiniteLoss {
        /// The step.
        step: u64,
        /// The ranks.
        ranks: Vec<Rank>,
    },
    /// [`Error::NonFiniteGradient`].
    NonFiniteGradient {
        /// The step.
        step: u64,
    },
    /// [`Error::Pipeline`] with [`ExecError::Wire`] or [`ExecError::LinkClosed`]: a pipeline
    /// neighbour in another process went silent (a consequence of its failure).
    PipelineLink {
        /// The stage index that saw it.
        stage: u32,
        /// The neighbour.
        peer: u32,
        /// What the transport said.
        reason: String,
    },
    /// [`Error::Pipeline`] with [`ExecError::Aborted`].
    PipelineAborted {
        /// The stage index.
        stage: u32,
    },
    /// Any other error, as text.
    Other(String),
}

impl From<&Error> for RemoteError {
    fn from(e: &Error) -> Self {
        match e {
            Error::StageFailed {
                device,
                stage,
                during,
                reason,
            } => Self::StageFailed {
                device: *device,
                stage: *stage,
                during: during.clone(),
                reason: reason.clone(),
            },
            Error::StageLost {
                device,
                stage,
                reason,
            } => Self::StageLost {
                device: *device,
                stage: *stage,
                reason: reason.clone(),
            },
            // A block's collective carries its cause: the head classifies a peer woken by the
            // group's shutdown as a consequence by it (the block is named in the node's log).
            Error::Comm(c)
            | Error::Pipeline(ExecError::Comm(c))
            | Error::Pipeline(ExecError::BlockCollective { cause: c, .. }) => Self::Comm(c.clone()),
            Error::NonFiniteLoss { step, ranks } => Self::NonFiniteLoss {
                step: *step,
                ranks: ranks.clone(),
            },
            Error::NonFiniteGradient { step } => Self::NonFiniteGradient { step: *step },
            Error::Pipeline(ExecError::Wire {
                stage,
                peer,
                reason,
            }) => Self::PipelineLink {
                stage: *stage,
                peer: *peer,
                reason: reason.clone(),
            },
            Error::Pipeline(ExecError::LinkClosed { stage, peer }) => Self::PipelineLink {
                stage: *stage,
                peer: *peer,
                reason: "the link is closed".into(),
            },
            Error::Pipeline(ExecError::Aborted { stage }) => {
                Self::PipelineAborted { stage: *stage }
            }
            other => Self::Other(other.to_string()),
        }
    }
}

impl RemoteError {
    /// The error on the head, where a node's stage failed in `node`.
    pub fn into_error(self, node: &str) -> Error {
        match self {
            Self::StageFailed {
                device,
                stage,
                during,
                reason,
            } => Error::StageFailed {
                device,
                stage,
                during,
                reason: format!("{reason} (on {node})"),
            },
            Self::StageLost {
                device,
                stage,
                reason,
            } => Error::StageLost {
                device,
                stage,
                reason: format!("{reason} (on {node})"),
            },
            Self::Comm(c) => Error::Comm(c),
            Self::NonFiniteLoss { step, ranks } => Error::NonFiniteLoss { step, ranks },
            Self::NonFiniteGradient { step } => Error::NonFiniteGradient { step },
            Self::PipelineLink {
                stage,
                peer,
                reason,
            } => Error::Pipeline(ExecError::Wire {
                stage,
                peer,
                reason: format!("{reason} (on {node})"),
            }),
            Self::PipelineAborted { stage } => Error::Pipeline(ExecError::Aborted { stage }),
            Self::Other(text) => Error::Runtime(format!("on {node}: {text}")),
        }
    }
}

/// The most bytes of shards one control message carries: a snapshot or restore of more moves
/// in parts of this size (a message stays well under `MAX_CONTROL_MESSAGE`).
pub const PART_BYTES: usize = 512 << 10;

/// Shards (each in the checkpoint format) as one byte string: per shard its length (u64,
/// little-endian), then its bytes.
pub fn join_shards(shards: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(shards.iter().map(|s| s.len() + 8).sum());
    for s in shards {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s);
    }
    out
}

/// The shards of [`join_shards`]'s byte string; a length past the end is an error (each shard
/// is then checked by its own checksums).
pub fn split_shards(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let (len, rest) = bytes
            .split_first_chunk::<8>()
            .ok_or_else(|| format!("{} bytes where a shard length was expected", bytes.len()))?;
        let len = usize::try_from(u64::from_le_bytes(*len))
            .ok()
            .filter(|&l| l <= rest.len())
            .ok_or_else(|| format!("a shard declares more than the {} bytes left", rest.len()))?;
        out.push(rest[..len].to_vec());
        bytes = &rest[len..];
    }
    Ok(out)
}

/// A boxed future of a stage answer.
pub type AnswerFuture = Pin<Box<dyn Future<Output = StageAnswer> + Send>>;

/// What serves the head's stage requests for the slots of one process: the node's agent hands
/// every [`StageRequest`] to it, each on its own task (a step's requests for several slots
/// run at once; heartbeats are answered meanwhile).
pub trait StageHost: Send + Sync + 'static {
    /// Serves one request.
    fn serve(&self, request: StageRequest) -> AnswerFuture;
    /// Stops every stage and device of the process and shuts its data plane (the job ended
    /// or the head was lost).
    fn stop(&self);
    /// The steps each slot trained so far (what a node reports when it stops: proof that
    /// its devices did the work).
    fn steps_trained(&self) -> Vec<(Rank, u64)>;
    /// How each slot last joined the data plane, in words (a flat TCP group, or a
    /// hierarchical one and its shape): what a node reports when it stops.
    fn data_plane(&self) -> Vec<(Rank, String)> {
        Vec::new()
    }
}

/// What a [`HostFactory`] gets when the head prepared the node.
#[derive(Debug)]
pub struct HostArgs {
    /// The job, as the head described it in its Hello.
    pub spec: JobSpec,
    /// This process's place in the world.
    pub plan: ProcessPlan,
    /// The data-plane token.
    pub token: JobToken,
    /// The data-plane listeners, one per slot of `plan.ranks`, in that order.
    pub listeners: Vec<TcpListener>,
    /// The head's address as this process reaches it (a node: the host it joined; `None` in
    /// the head's own process): where links to the head's own endpoints go (the parameter
    /// server's gateway).
    pub head: Option<std::net::IpAddr>,
}

/// Builds a node's [`StageHost`] once the world is known (the program's own job, built from
/// the spec with the same code as the head's); an error refuses the `Prepare`.
pub type HostFactory = Arc<dyn Fn(HostArgs) -> Result<Arc<dyn StageHost>, String> + Send + Sync>;
