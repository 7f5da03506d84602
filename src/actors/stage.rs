//! The stage actor: one actor for every stage that computes, in every kind of job.
//!
//! [`Stage`] is the skeleton written once (ractor's factory `Worker` pattern): it holds a
//! [`StageRole`] as its state and turns each [`StageMsg`] into one call of the role, whose
//! answer goes back on the message's reply port. The roles:
//! - [`replica`]: a data-parallel replica (plain DP, ZeRO, compression, local updates);
//! - `actors::pipeline_stage`: a pipeline stage, or one stage running every block in turn;
//! - `actors::parameter_server`: a parameter-server worker.
//!
//! The one stage that does not compute, the head's proxy for a stage in another process
//! (`cluster::remote`), speaks the same [`StageMsg`] but forwards it.
//!
//! RT-1: between steps a stage's state (model, optimizer, communicator) sits in the actor;
//! for a step it moves onto the device's compute thread and comes back with the result. A
//! panic on the thread loses the state and is reported as [`Error::StageFailed`] naming the
//! device, the stage and the phase (RT-4): [`lost`] and [`failed`] say so the same way for
//! every role.

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::device::MeshDevice;
use crate::error::Error;
use crate::mesh::StageId;

mod micro_batches;
mod msg;
pub(crate) mod replica;
mod role;

pub(crate) use crate::report::{InitReport, StepReport};
pub(crate) use micro_batches::{GradientLoop, Progress, read_items};
pub(crate) use msg::StageMsg;
pub(crate) use replica::{
    LossFn, MixedPrecision, ModelFn, StageActor, StageArgs, StageSpec, restore_scaler,
};
pub(crate) use role::{StageRole, shard_of};

/// The actor of one stage, whatever its role.
pub(crate) struct Stage<R>(std::marker::PhantomData<fn() -> R>);

impl<R> Default for Stage<R> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<R: StageRole> std::fmt::Debug for Stage<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stage({})", R::KIND)
    }
}

impl<R: StageRole> Actor for Stage<R> {
    type Msg = StageMsg<R::Model>;
    type State = R;
    type Arguments = R::Args;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: R::Args,
    ) -> Result<R, ActorProcessingErr> {
        Ok(R::start(args)?)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        role: &mut R,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            StageMsg::Init(reply) => {
                let _ = reply.send(role.init().await);
            }
            StageMsg::Step {
                step,
                micro_batches,
                global_samples,
                reply,
            } => {
                let _ = reply.send(role.step(step, micro_batches, global_samples).await);
            }
            StageMsg::Fingerprint(reply) => {
                let _ = reply.send(role.fingerprint().await);
            }
            StageMsg::TakeModel(reply) => {
                let _ = reply.send(role.take_model().await);
            }
            StageMsg::Snapshot(reply) => {
                let _ = reply.send(role.snapshot().await);
            }
            StageMsg::SnapshotModel(reply) => {
                let _ = reply.send(role.snapshot_model().await);
            }
            StageMsg::Restore { shard, reply } => {
                let _ = reply.send(role.restore(shard).await);
            }
            StageMsg::Regroup {
                id,
                rank,
                comm,
                reply,
            } => {
                let _ = reply.send(role.regroup(id, rank, comm));
            }
            StageMsg::Rewire {
                rank,
                links,
                comm,
                model,
                reply,
            } => {
                let _ = reply.send(role.rewire(rank, *links, comm, *model));
            }
            StageMsg::Reconnect { reply, .. } => {
                // Only the head's proxy for a stage in another process takes it; a stage of
                // this process joins a rebuilt group through Regroup, a pipeline stage of
                // another process through its node's Wire (REMOTE-7).
                let _ = reply.send(Err(Error::InvalidConfig(format!(
                    "{}: a {} of this process joins a rebuilt group through Regroup \
                     (a pipeline stage through its node's Wire), not Reconnect",
                    role.id(),
                    R::KIND
                ))));
            }
        }
        Ok(())
    }
}

/// The error of a stage whose state was lost to an earlier failure (RT-4).
pub(crate) fn lost(id: StageId, device: &MeshDevice) -> Error {
    Error::StageFailed {
        device: device.id(),
        stage: id,
        during: "a previous failure".into(),
        reason: "the stage lost its state in an earlier failure".into(),
    }
}

/// The error of a stage whose device thread panicked `during` a phase (RT-4).
pub(crate) fn failed(id: StageId, device: &MeshDevice, during: &str, reason: String) -> Error {
    // PREC-4: Burn's dtype assertion is a missing cast in the model, not a lost device.
    if reason.contains("dtype mismatch") {
        return Error::DtypeMismatch {
            device: device.id(),
            stage: id,
            during: during.into(),
            reason,
        };
    }
    Error::StageFailed {
        device: device.id(),
        stage: id,
        during: during.into(),
        reason,
    }
}
