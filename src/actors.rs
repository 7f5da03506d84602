//! The runtime: every device, stage and collective group is an actor (ractor).
//!
//! | actor | owns | does |
//! |---|---|---|
//! | [`supervisor::Supervisor`] | the job: layout, step clock, policies | spawns everything linked to itself, drives steps, ends the job on failure, publishes events |
//! | [`device::DeviceActor`] | one logical device and its compute thread | runs compute tasks on its thread; answers heartbeats while compute runs |
//! | [`stage::Stage`] (one actor for every stage that computes; its role is its state) | as `stage::StageActor`: one data-parallel replica's model, its optimizer state, its communicator; as `pipeline_stage::PipelineStageActor`: one pipeline stage of one replica (model chunks, optimizers, links to the neighbouring stages, data-parallel communicator); as `parameter_server::WorkerActor`: one parameter-server worker | runs a step's work on its device's thread (a pipeline stage: its schedule's instruction list) |
//! | [`parameter_server::ServerActor`] | a parameter-server job's parameters and optimizer (one shard) | applies pushed gradients under its staleness bound; a worker's loop pulls, computes and pushes on its device's thread |
//! | [`group::GroupActor`] | one collective group (members, generation) | owns the group's lifecycle: status for hang diagnosis, shutdown |
//!
//! Invariants:
//! - RT-1: Burn work never runs on tokio worker threads: only on device compute threads.
//! - RT-2: a device answers a heartbeat while its thread is busy (the reply reads shared status,
//!   it does not queue behind compute).
//! - RT-3: every wait of the runtime is bounded: stage work by the step time-out, collectives by
//!   the communicator time-out, RPCs by explicit time-outs.
//! - RT-4: a failure on any device thread (panic or error) reaches the Supervisor as a typed
//!   error naming the device, the stage and the phase; the group is shut down so peers blocked
//!   in a collective wake up at once instead of waiting for their time-out.

pub(crate) mod checkpointer;
pub(crate) mod device;
pub(crate) mod group;
pub(crate) mod parameter_server;
pub(crate) mod pipeline_stage;
pub(crate) mod spawner;
pub(crate) mod stage;
pub(crate) mod supervisor;

/// Text of a panic payload.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

// With the `cluster` feature, ractor no longer implements `Message` for every type (a remote
// actor must say how its messages serialize). The runtime's own messages never cross a
// process: they stay local (no serialization), which is what the trait's defaults give.
#[cfg(feature = "cluster")]
mod local_messages {
    impl ractor::Message for super::device::DeviceMsg {}
    impl ractor::Message for super::group::GroupMsg {}
    impl<M: Send + 'static> ractor::Message for super::stage::StageMsg<M> {}
    impl ractor::Message for super::supervisor::SupervisorMsg {}
}
