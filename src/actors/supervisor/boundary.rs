//! Between two steps: [`decide::at_boundary`] says what comes next, this file carries it out
//! until the step starts (on a task of its own: `step.rs`), is held, or the job ends. Also
//! the controls that act at a boundary: pause, resume, stop, and the children that ended
//! while a step ran.

use ractor::{ActorProcessingErr, ActorRef};

use super::SupervisorMsg;
use super::checkpoints::checkpoint;
use super::decide::{self, AtBoundary, Boundary, CheckpointFacts};
use super::lifecycle::{child_exited, finish};
use super::recover::{LostRanks, recover};
use super::resize::{request, resize, wait_for_minimum};
use super::state::SupervisorState;
use super::step;
use crate::error::Error;
use crate::events::JobEvent;

/// `RunStep(step)`: the boundary before `step`.
pub(super) async fn run<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
    step: u64,
) -> Result<(), ActorProcessingErr>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if let Some(running) = &state.clock.running {
        // Steps are strictly sequential: the running one asks for the next when it ends.
        tracing::warn!(
            step,
            running = running.step,
            "a step was asked while one runs"
        );
        return Ok(());
    }
    // A resize the fault plan fixes at this boundary: the same request as `scale_to`
    // (FAULT-2: replayed at the same step).
    if let Some(n) = state
        .recovery
        .faults
        .as_ref()
        .and_then(|h| h.resize_at(step))
    {
        state.publish_fired();
        request(myself, state, n)?;
    }
    let mut resized = false;
    let mut checkpoint_taken = false;
    loop {
        let facts = Boundary {
            step,
            steps: state.clock.steps,
            paused: state.clock.paused.is_some(),
            stop_requested: state.clock.stop_requested,
            pending_losses: !state.recovery.pending_lost.is_empty(),
            scale_target: state.elastic.scale_target,
            resized,
            below_minimum: state.members.caps.rejoin.regroups()
                && state.members.layout.dp() < state.elastic.range.0,
            checkpoint: CheckpointFacts {
                configured: state.ckpt.checkpoints.is_some(),
                every: state.ckpt.checkpoints.as_ref().and_then(|c| c.every),
                requested: state.ckpt.checkpoint_requested,
                last: state.ckpt.last_checkpoint,
                taken: checkpoint_taken,
            },
        };
        match decide::at_boundary(&facts) {
            AtBoundary::Hold => {
                if let Some(held) = state.clock.paused.as_mut() {
                    *held = Some(step);
                }
                return Ok(());
            }
            AtBoundary::RecoverLosses => {
                // Devices lost between steps (their ranks are current).
                let lost = std::mem::take(&mut state.recovery.pending_lost);
                let lost = LostRanks(lost.into_iter().map(|(r, e)| (Some(r), e)).collect());
                if let Err(e) = recover(state, step, lost).await {
                    finish(myself, state, Err(e)).await;
                    return Ok(());
                }
            }
            AtBoundary::RefuseResize(n) => {
                state.elastic.scale_target = None;
                state.publish(JobEvent::ResizeRefused {
                    requested: n,
                    reason: "the job is ending".into(),
                });
            }
            AtBoundary::Resize(n) => {
                state.elastic.scale_target = None;
                resized = true;
                match resize(state, step, n as usize).await {
                    Ok(()) => {}
                    // A refused resize leaves the mesh as it was.
                    Err(error @ Error::InvalidConfig(_)) => {
                        state.publish(JobEvent::ResizeRefused {
                            requested: n,
                            reason: error.to_string(),
                        })
                    }
                    // One that failed half-way (the group could not be rebuilt) ends the job.
                    Err(error) => {
                        finish(myself, state, Err(error)).await;
                        return Ok(());
                    }
                }
            }
            AtBoundary::HoldBelowMinimum => {
                // ELASTIC-3: a resize that left the job below its minimum (a growth toward
                // it, a partial or refused one) holds this step again.
                wait_for_minimum(state, step);
                if let Some(held) = state.clock.paused.as_mut() {
                    *held = Some(step);
                }
                return Ok(());
            }
            AtBoundary::Checkpoint => {
                checkpoint_taken = true;
                checkpoint(state, step).await;
            }
            AtBoundary::Finish => {
                state.ckpt.checkpoint_requested = false;
                finish(myself, state, Ok(())).await;
                return Ok(());
            }
            AtBoundary::Run => {
                state.ckpt.checkpoint_requested = false;
                step::start(state, step);
                return Ok(());
            }
        }
    }
}

/// `Pause`: no new step starts (the running one finishes); `Paused` is published.
pub(super) fn pause<M, I>(state: &mut SupervisorState<M, I>) {
    if state.clock.paused.is_none() {
        state.clock.paused = Some(None);
        state.publish(JobEvent::Paused);
    }
}

/// `Resume`: the held step runs; below the elastic minimum, the smaller mesh is accepted.
pub(super) fn resume<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
) -> Result<(), ActorProcessingErr> {
    state.elastic.below_min = None;
    if let Some(held) = state.clock.paused.take() {
        state.publish(JobEvent::Resumed);
        if let Some(step) = held {
            myself.send_message(SupervisorMsg::RunStep(step))?;
        }
    }
    Ok(())
}

/// `Stop`: the job ends at the next step boundary, after the running step (bounded by the
/// step time-out; it is never aborted half-way, which could leave replicas that applied it
/// beside replicas that did not). A paused job stops at once: its held step sees the stop.
pub(super) fn stop<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
) -> Result<(), ActorProcessingErr> {
    state.clock.stop_requested = true;
    if let Some(Some(step)) = state.clock.paused.take() {
        myself.send_message(SupervisorMsg::RunStep(step))?;
    }
    Ok(())
}

/// The children that ended while the step ran, now that its outcome is dealt with.
pub(super) async fn replay_deferred<M, I>(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState<M, I>,
) where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    for event in std::mem::take(&mut state.clock.deferred) {
        child_exited(myself, state, event).await;
    }
}
