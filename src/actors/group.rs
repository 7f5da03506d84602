//! `GroupActor`: the owner of one collective group.
//!
//! The data path of a collective does not pass through this actor's mailbox: ranks meet inside
//! the in-process transport ([`crate::comm::LocalGroup`]), which does the rendezvous, the
//! sequencing, the time-outs and their diagnosis. This actor owns the group's lifecycle: it
//! hands out the communicators, answers status requests, and shuts the group down (waking every
//! rank blocked in it, RT-4). See ARCHITECTURE.md, "Collectives and the GroupActor".

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::comm::LocalGroup;
use crate::mesh::{Generation, Rank};

/// Messages a [`GroupActor`] handles.
#[derive(Debug)]
#[expect(
    dead_code,
    reason = "no caller yet: the Supervisor shuts groups down through the spawner's shutdown \
              closure and stopping the actor (post_stop); kept as the group's status and \
              shutdown interface for hang diagnosis"
)]
pub(crate) enum GroupMsg {
    /// Reply with the group's members and generation.
    Members(RpcReplyPort<(Vec<Rank>, Generation)>),
    /// Shut the group down: every current and future op fails with a typed error.
    Shutdown,
}

/// The actor owning one collective group.
#[derive(Debug, Default)]
pub(crate) struct GroupActor;

/// State of a [`GroupActor`].
#[derive(Debug)]
pub(crate) struct GroupState {
    members: Vec<Rank>,
    group: Arc<LocalGroup>,
}

/// What a [`GroupActor`] starts from.
#[derive(Debug)]
pub(crate) struct GroupArgs {
    /// Global ranks of the members, in group order.
    pub members: Vec<Rank>,
    /// The transport-level group.
    pub group: Arc<LocalGroup>,
}

impl Actor for GroupActor {
    type Msg = GroupMsg;
    type State = GroupState;
    type Arguments = GroupArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<GroupMsg>,
        args: GroupArgs,
    ) -> Result<GroupState, ActorProcessingErr> {
        Ok(GroupState {
            members: args.members,
            group: args.group,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<GroupMsg>,
        msg: GroupMsg,
        state: &mut GroupState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            GroupMsg::Members(reply) => {
                let _ = reply.send((state.members.clone(), state.group.generation()));
            }
            GroupMsg::Shutdown => state.group.shutdown(),
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<GroupMsg>,
        state: &mut GroupState,
    ) -> Result<(), ActorProcessingErr> {
        // A group never outlives its owner: ranks still inside it wake up with an error.
        state.group.shutdown();
        Ok(())
    }
}
