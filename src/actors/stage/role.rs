//! [`StageRole`]: what makes a stage a data-parallel replica, a pipeline stage or a
//! parameter-server worker. The stage actor ([`super::Stage`]) is written once; a role is
//! the stage's state and answers each [`super::StageMsg`] the way its kind must. A new kind of
//! stage is a new role, not a new actor.

use std::future::Future;

use crate::checkpoint::{ShardId, ShardSnapshot};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::mesh::{Rank, StageId};
use crate::parallel::pipeline_exec::StageLinks;
use crate::report::{InitReport, StepReport};

/// One kind of stage: its state between messages and its answer to each of them. Every
/// method answers; a message the kind cannot take is refused with a typed error that says
/// why (the caller is never left waiting).
pub(crate) trait StageRole: Sized + Send + 'static {
    /// What the stage hands over at the end ([`super::StageMsg::TakeModel`]): a replica's or
    /// worker's model, a pipeline stage's blocks.
    type Model: Send + 'static;
    /// What the stage starts from.
    type Args: Send + 'static;
    /// The kind, in words, for refusals and logs ("data-parallel replica").
    const KIND: &'static str;

    /// The state the stage starts in (the actor's `pre_start`); an error stops the spawn.
    fn start(args: Self::Args) -> std::result::Result<Self, String>;

    /// Its place in the mesh now.
    fn id(&self) -> StageId;

    /// Builds the model and optimizer, takes rank 0's parameters.
    fn init(&mut self) -> impl Future<Output = Result<InitReport>> + Send;

    /// One training step over `micro_batches` (sample ids), of `global_samples` samples over
    /// every replica.
    fn step(
        &mut self,
        step: u64,
        micro_batches: Vec<Vec<usize>>,
        global_samples: usize,
    ) -> impl Future<Output = Result<StepReport>> + Send;

    /// A fingerprint of the current parameters.
    fn fingerprint(&mut self) -> impl Future<Output = Result<u64>> + Send;

    /// Hands the model over; the stage keeps nothing.
    fn take_model(&mut self) -> impl Future<Output = Option<Self::Model>> + Send;

    /// Its parameters and optimizer state, one shard per block it holds.
    fn snapshot(&mut self) -> impl Future<Output = Result<Vec<ShardSnapshot>>> + Send;

    /// Its trained model's parameters as it holds them now, one shard per block, for the head
    /// of a job across processes to rebuild the model from (`TakeModel` in another process).
    /// A replica's snapshot holds its whole model already.
    fn snapshot_model(&mut self) -> impl Future<Output = Result<Vec<ShardSnapshot>>> + Send {
        self.snapshot()
    }

    /// Takes the parameters and optimizer state of its blocks' shards from `shards` (others
    /// are ignored; a missing one is an error).
    fn restore(&mut self, shards: Vec<ShardSnapshot>) -> impl Future<Output = Result<()>> + Send;

    /// Joins a rebuilt group of this process (after a recovery) as `id`, rank `rank`.
    fn regroup(&mut self, id: StageId, rank: Rank, comm: Communicator) -> Result<()> {
        let _ = (rank, comm);
        Err(Error::InvalidConfig(format!(
            "{id}: a {} cannot join a rebuilt group",
            Self::KIND
        )))
    }

    /// Takes its rank and new pipeline links and communicators in a mesh wired anew (after a
    /// stage of the mesh was replaced, or the mesh resized along dp).
    fn rewire(
        &mut self,
        rank: Rank,
        links: StageLinks,
        comm: Option<Communicator>,
        model: crate::parallel::pipeline_exec::ModelGroups,
    ) -> Result<()> {
        let _ = (rank, links, comm, model);
        Err(Error::InvalidConfig(format!(
            "{}: a {} has no pipeline links",
            self.id(),
            Self::KIND
        )))
    }
}

/// The shard `wanted` among `shards` (a restore's), or the error that names what is missing
/// for stage `id`.
pub(crate) fn shard_of(
    shards: Vec<ShardSnapshot>,
    wanted: ShardId,
    id: StageId,
) -> Result<ShardSnapshot> {
    shards
        .into_iter()
        .find(|s| s.shard == wanted)
        .ok_or_else(|| Error::InvalidConfig(format!("no {wanted} to restore {id} from")))
}
