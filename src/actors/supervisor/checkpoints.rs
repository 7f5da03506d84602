//! Checkpoints from the Supervisor's side: a snapshot at a step boundary handed to the
//! writer thread (CKW-1..3, with back-pressure on the writer's backlog), the newest valid
//! checkpoint read back (checked against the job's data order), and a job resumed from it.

use std::sync::Arc;

use ractor::rpc::CallResult;

use super::calls::ask;
use super::state::SupervisorState;
use crate::actors::checkpointer::{CheckpointSink, Checkpointer, MAX_BACKLOG, Queued};
use crate::actors::stage::StageMsg;
use crate::checkpoint::{Checkpoint, OptimizerState, RngState, ShardSnapshot};
use crate::error::{Error, Result};
use crate::events::JobEvent;

/// Where and how often a job writes checkpoints, and whether it starts from one.
#[derive(Debug, Clone)]
pub(crate) struct CheckpointSettings {
    pub(crate) sink: Arc<dyn CheckpointSink>,
    /// Every this many steps (none: only on request).
    pub(crate) every: Option<u64>,
    /// Start from the newest valid checkpoint, if there is one.
    pub(crate) resume: bool,
    /// With `resume`: finding no valid checkpoint fails the job instead of starting afresh.
    pub(crate) require: bool,
}

/// The newest valid checkpoint of the job's store, checked against the job's data order
/// (same seed, same position), with the newer ones that were refused.
pub(super) async fn latest_checkpoint<M, I>(
    state: &mut SupervisorState<M, I>,
) -> Result<Option<(Checkpoint, std::path::PathBuf, Vec<String>)>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(settings) = state.ckpt.checkpoints.clone() else {
        return Ok(None);
    };
    let sink = settings.sink.clone();
    let read = tokio::task::spawn_blocking(move || sink.latest_valid());
    let loaded = tokio::time::timeout(state.clock.step_timeout, read)
        .await
        .map_err(|_| {
            Error::Runtime(format!(
                "reading the checkpoints took longer than the step time-out ({:?})",
                state.clock.step_timeout
            ))
        })?
        .map_err(|e| Error::Runtime(format!("reading checkpoints: {e}")))??;
    let Some(loaded) = loaded else {
        return Ok(None);
    };
    let c = loaded.checkpoint;
    // The data must continue where it stopped: same seed, same batches.
    if c.rng.seed != state.clock.seed || c.cursor != state.clock.sampler.cursor(c.step) {
        return Err(Error::InvalidConfig(format!(
            "{} was written with seed {} at data position {:?}; this job has seed {} and \
             would read position {:?}: resume with the same seed, batch size and data",
            loaded.dir.display(),
            c.rng.seed,
            c.cursor,
            state.clock.seed,
            state.clock.sampler.cursor(c.step)
        )));
    }
    let refused = loaded
        .refused
        .iter()
        .map(|r| format!("{}: {}", r.dir.display(), r.error))
        .collect();
    Ok(Some((c, loaded.dir, refused)))
}

/// The job's training state, one snapshot per block (CKPT-8), from the ranks the strategy
/// says hold it ([`Capabilities::state_ranks`]): replica 0's stages where data-parallel
/// replicas hold the same state; where each rank holds a shard of it (ZeRO), every rank,
/// each block's optimizer parts put together.
///
/// [`Capabilities::state_ranks`]: crate::actors::spawner::Capabilities::state_ranks
pub(super) async fn snapshot_state<M, I>(
    state: &mut SupervisorState<M, I>,
) -> Result<Vec<ShardSnapshot>>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let ranks = state.members.caps.state_ranks(state.members.layout);
    let mut all: Vec<ShardSnapshot> = Vec::new();
    for r in ranks {
        let Some((stage, id)) = state.members.stages.get(r).cloned() else {
            continue;
        };
        let got = ask(&stage, StageMsg::Snapshot, state.clock.step_timeout, || {
            format!("{id} did not answer the snapshot request")
        })
        .await?;
        for snap in got {
            match all.iter_mut().find(|s| s.shard == snap.shard) {
                // Another rank's part of a block already taken: keep the parameters (equal
                // on every rank, or, for ZeRO-3, add its parameter part: CKPT-10) and add its
                // optimizer part.
                Some(kept) => {
                    kept.params.add_parts(snap.params);
                    kept.optimizer = match (kept.optimizer.take(), snap.optimizer) {
                        (Some(a), Some(b)) => OptimizerState::merge_parts([a, b]),
                        (a, b) => a.or(b),
                    };
                }
                None => all.push(snap),
            }
        }
    }
    Ok(all)
}

/// Take a snapshot of the state after `step` steps and hand it to the writer thread (CKW-1).
/// A failure is published, not fatal (CKW-2).
pub(super) async fn checkpoint<M, I>(state: &mut SupervisorState<M, I>, step: u64)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let Some(queue) = state
        .ckpt
        .checkpointer
        .as_ref()
        .and_then(Checkpointer::queue)
    else {
        return;
    };
    // FaultPlan: this checkpoint's write fails half-way (so it is taken whatever the backlog).
    let fail_half_way = state
        .recovery
        .faults
        .as_ref()
        .is_some_and(|h| h.fails_checkpoint(step));
    // CKW-3: at most MAX_BACKLOG snapshots in flight; a disk slower than the checkpoint
    // interval holds the step boundary until the oldest is written (the writer thread
    // signals each write it finishes; bounded by the step time-out, after which this
    // checkpoint is skipped and says so).
    if let Err(backlog) = queue
        .wait_below(MAX_BACKLOG, state.clock.step_timeout)
        .await
        && !fail_half_way
    {
        let error = Error::Runtime(format!(
            "skipped: the writer was still busy with {backlog} earlier checkpoint(s) after {:?}",
            state.clock.step_timeout
        ));
        state.publish(JobEvent::CheckpointFailed { step, error });
        return;
    }
    let shards = snapshot_state(state).await;
    match shards {
        Ok(shards) => {
            let sent = queue.send(Queued {
                checkpoint: Checkpoint {
                    step,
                    layout: state.members.layout,
                    cursor: state.clock.sampler.cursor(step),
                    rng: RngState {
                        seed: state.clock.seed,
                        state: step,
                    },
                    shards,
                },
                fail_half_way,
            });
            if sent {
                state.ckpt.last_checkpoint = Some(step);
            } else {
                let error = Error::Runtime("the checkpoint writer thread has stopped".into());
                state.publish(JobEvent::CheckpointFailed { step, error });
            }
        }
        Err(error) => state.publish(JobEvent::CheckpointFailed { step, error }),
    }
}

/// Restore the newest valid checkpoint if the job asks to resume; the first step to run.
pub(super) async fn resume<M, I>(state: &mut SupervisorState<M, I>) -> Result<u64>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    if !state.ckpt.checkpoints.as_ref().is_some_and(|c| c.resume) {
        return Ok(0);
    }
    let Some((c, dir, refused)) = latest_checkpoint(state).await? else {
        let Some(settings) = &state.ckpt.checkpoints else {
            return Ok(0);
        };
        let location = settings.sink.location();
        if settings.require {
            return Err(crate::checkpoint::CheckpointError::NothingToResume { location }.into());
        }
        state.publish(JobEvent::NothingToResume { location });
        return Ok(0);
    };
    let timeout = state.clock.step_timeout;
    for (stage, id) in state.members.stages.clone() {
        let shard = c.shards.clone();
        match stage
            .call(|reply| StageMsg::Restore { shard, reply }, Some(timeout))
            .await
        {
            Ok(CallResult::Success(Ok(()))) => {}
            Ok(CallResult::Success(Err(e))) => {
                return Err(Error::InvalidConfig(format!(
                    "{} cannot be restored onto this job: {e}",
                    dir.display()
                )));
            }
            _ => {
                return Err(Error::Runtime(format!(
                    "{id} did not restore the checkpoint"
                )));
            }
        }
    }
    state.ckpt.last_checkpoint = Some(c.step);
    state.publish(JobEvent::Restored {
        step: c.step,
        path: dir,
        refused,
    });
    Ok(c.step)
}
