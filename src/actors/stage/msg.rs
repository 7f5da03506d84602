//! [`StageMsg`]: the protocol every stage kind (data-parallel replica, pipeline stage,
//! parameter-server worker, and the head's proxy for a stage in another process) and the
//! Supervisor speak. Every arm carries its reply port; a stage answers every message, a
//! refusal included, so no caller waits on a message nobody handles.

use ractor::RpcReplyPort;

use crate::checkpoint::ShardSnapshot;
use crate::comm::Communicator;
use crate::error::Result;
use crate::mesh::{Generation, Rank, StageId};
use crate::report::{InitReport, StepReport};

/// Messages a stage handles (see [`super::Stage`]).
pub(crate) enum StageMsg<M> {
    /// Build the model, receive rank 0's parameters, build the optimizer.
    Init(RpcReplyPort<Result<InitReport>>),
    /// Run one training step over these micro-batches (sample ids).
    Step {
        /// The step.
        step: u64,
        /// The sample ids of each micro-batch.
        micro_batches: Vec<Vec<usize>>,
        /// Samples in the whole step over all replicas: each micro-batch's gradient is
        /// weighted by its share of them (DP-2), so uneven shares after a replica was lost
        /// still give the global mean.
        global_samples: usize,
        /// Where the report goes.
        reply: RpcReplyPort<Result<StepReport>>,
    },
    /// Fingerprint of the current parameters.
    Fingerprint(RpcReplyPort<Result<u64>>),
    /// Hand the model over (the stage keeps nothing).
    TakeModel(RpcReplyPort<Option<M>>),
    /// Copy the parameters and optimizer state (on the device thread), one shard per model
    /// block the stage holds (a data-parallel replica: one; a pipeline stage: one per chunk),
    /// for a checkpoint, a joining replica or a twin's replacement.
    Snapshot(RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// The trained model's parameters as the stage holds them now, one shard per block
    /// (parameters only; whole blocks under ZeRO-3 once `Fingerprint` gathered them): what a
    /// node sends the head of a job across processes for the trained model.
    #[cfg_attr(
        not(feature = "cluster"),
        expect(dead_code, reason = "only a node of a job across processes sends it")
    )]
    SnapshotModel(RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// Take the parameters and optimizer state of the shards of the blocks the stage holds
    /// (others in the list are ignored; a missing one is an error).
    Restore {
        /// The shards.
        shard: Vec<ShardSnapshot>,
        /// `Ok` once restored.
        reply: RpcReplyPort<Result<()>>,
    },
    /// Join a rebuilt group (after a recovery) as `id` with rank `rank`.
    Regroup {
        /// The stage's place in the new mesh.
        id: StageId,
        /// Its rank in the new mesh.
        rank: Rank,
        /// Its communicator in the new group.
        comm: Communicator,
        /// `Ok` once it holds its state and the new communicator.
        reply: RpcReplyPort<Result<()>>,
    },
    /// A stage of another process (a cluster job's proxy) joins a new data-plane group under
    /// `generation` as `rank`, with the stages of `slots` (their ranks in the assembled world)
    /// as members in new-rank order. In-process stages get their group with `Regroup`.
    #[cfg_attr(
        not(feature = "cluster"),
        expect(
            dead_code,
            reason = "only a cluster job's proxies (`cluster::remote`) read it"
        )
    )]
    Reconnect {
        /// The stage's place in the new mesh.
        id: StageId,
        /// Its rank in the new mesh.
        rank: Rank,
        /// The new group's generation.
        generation: Generation,
        /// The members, by new rank, as slots of the assembled world.
        slots: Vec<Rank>,
        /// `Ok` once connected.
        reply: RpcReplyPort<Result<()>>,
    },
    /// A pipeline stage takes its rank and new links and communicators in a mesh wired anew
    /// (after a stage of the mesh was replaced, REC-6, or the mesh resized along dp,
    /// ELASTIC-6: its place in the pipeline and its tensor-parallel rank stay, its rank
    /// follows the new layout).
    Rewire {
        /// Its rank in the rewired mesh.
        rank: Rank,
        /// Its links to its replica's other stages.
        links: Box<crate::parallel::pipeline_exec::StageLinks>,
        /// Its communicator in its stage index's data-parallel group (none at dp = 1).
        comm: Option<Communicator>,
        /// Its tensor-parallel group and its replica's model group.
        model: Box<crate::parallel::pipeline_exec::ModelGroups>,
        /// `Ok` once it holds its state and the new wiring.
        reply: RpcReplyPort<Result<()>>,
    },
}

impl<M> std::fmt::Debug for StageMsg<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageMsg::Init(_) => write!(f, "Init"),
            StageMsg::Step { step, .. } => write!(f, "Step({step})"),
            StageMsg::Fingerprint(_) => write!(f, "Fingerprint"),
            StageMsg::TakeModel(_) => write!(f, "TakeModel"),
            StageMsg::Regroup { id, .. } => write!(f, "Regroup({id})"),
            StageMsg::Snapshot(_) => write!(f, "Snapshot"),
            StageMsg::Restore { .. } => write!(f, "Restore"),
            StageMsg::Rewire { .. } => write!(f, "Rewire"),
            StageMsg::SnapshotModel(_) => write!(f, "SnapshotModel"),
            StageMsg::Reconnect { id, .. } => write!(f, "Reconnect({id})"),
        }
    }
}
