//! Requests to the stages: one stage with a time-out ([`ask`], [`restore`]), or every stage
//! at once ([`call_all_partial`]), where the first failure shuts the group down so that no
//! stage stays blocked in a collective (RT-4) and the root cause is what is reported (a
//! woken collective, an aborted or closed link is a consequence, never the cause).
//! These run on the actor or on a step's task: they take a [`Crew`], never the state.
//!
//! - **SCALE-1** the Supervisor counts its control messages (each request to a stage and its reply,
//!   each message its inbox handles), and `RunSummary::control_messages` holds those of the steps
//!   (from the first step's start): `2R + 2` per step for R ranks (`meshwork bench scale`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ractor::ActorRef;
use ractor::rpc::CallResult;
use tokio::task::JoinSet;

use crate::actors::device::{DeviceMsg, heartbeat};
use crate::actors::stage::StageMsg;
use crate::checkpoint::ShardSnapshot;
use crate::comm::CommError;
use crate::error::{DeviceId, Error, Result, StageId};
use crate::parallel::pipeline_exec::ExecError;

/// How long a device may take to answer a heartbeat probe.
pub(super) const HEARTBEAT_PROBE: Duration = Duration::from_secs(2);

/// How long the other stages may take to report once one has failed.
const FAILURE_GRACE: Duration = Duration::from_secs(2);

/// Builds one stage's request around its reply port.
pub(super) type MsgBuilder<M, T> =
    Box<dyn FnOnce(ractor::RpcReplyPort<Result<T>>) -> StageMsg<M> + Send>;

/// The job's stages and devices by rank, and the shutdown of their group: what a request to
/// every stage needs, cloned off the state so that it can run on a task of its own.
pub(super) struct Crew<M> {
    pub(super) stages: Vec<(ActorRef<StageMsg<M>>, StageId)>,
    pub(super) devices: Vec<(ActorRef<DeviceMsg>, DeviceId)>,
    pub(super) shutdown: Arc<dyn Fn() + Send + Sync>,
    /// The Supervisor's count of control messages (SCALE-1): a request and its reply count
    /// one each.
    pub(super) control: Arc<AtomicU64>,
}

/// Ask `stage` for something whose reply is a `Result`, waiting at most `timeout`; a stage
/// that does not answer is `Error::Runtime(unanswered())`.
pub(super) async fn ask<M, T>(
    stage: &ActorRef<StageMsg<M>>,
    msg: impl FnOnce(ractor::RpcReplyPort<Result<T>>) -> StageMsg<M>,
    timeout: Duration,
    unanswered: impl FnOnce() -> String,
) -> Result<T>
where
    M: Send + 'static,
    T: Send + 'static,
{
    match stage.call(msg, Some(timeout)).await {
        Ok(CallResult::Success(r)) => r,
        _ => Err(Error::Runtime(unanswered())),
    }
}

/// Have `stage` take the parameters and optimizer state of `shards` (the blocks it holds).
pub(super) async fn restore<M: Send + 'static>(
    stage: &ActorRef<StageMsg<M>>,
    shards: Vec<ShardSnapshot>,
    timeout: Duration,
    unanswered: impl FnOnce() -> String,
) -> Result<()> {
    ask(
        stage,
        |reply| StageMsg::Restore {
            shard: shards,
            reply,
        },
        timeout,
        unanswered,
    )
    .await
}

/// Send the same request to every stage and collect the replies in rank order, or the root
/// cause of the first failure.
pub(super) async fn call_all<M, T>(
    crew: &Crew<M>,
    make: fn(ractor::RpcReplyPort<Result<T>>) -> StageMsg<M>,
    timeout: Duration,
) -> Result<Vec<T>>
where
    M: Send + 'static,
    T: Send + 'static,
{
    let build = |_| Some(Box::new(make) as MsgBuilder<M, T>);
    match call_all_partial(crew, build, timeout, None).await {
        (results, None) => Ok(results.into_iter().flatten().collect()),
        (_, Some(e)) => Err(e),
    }
}

/// Send one request to every stage (built by `make` per rank; `None`: none to that rank) and
/// collect the replies by rank, with the root cause of a failure: then the replies of the
/// stages that succeeded are there too. A stage silent past `timeout` is a `StepTimeout`
/// naming it (at `step`) and what its device says it is busy with.
pub(super) async fn call_all_partial<M, T, F>(
    crew: &Crew<M>,
    make: F,
    timeout: Duration,
    step: Option<u64>,
) -> (Vec<Option<T>>, Option<Error>)
where
    M: Send + 'static,
    T: Send + 'static,
    F: Fn(usize) -> Option<MsgBuilder<M, T>>,
{
    let mut set = JoinSet::new();
    for (r, (stage, _)) in crew.stages.iter().enumerate() {
        let Some(build) = make(r) else { continue };
        let stage = stage.clone();
        crew.control.fetch_add(1, Ordering::Relaxed);
        set.spawn(async move { (r, stage.call(build, Some(timeout)).await) });
    }
    let mut results: Vec<Option<T>> = (0..crew.stages.len()).map(|_| None).collect();
    let mut errors = Vec::new();
    let mut missing = Vec::new();
    loop {
        // Once a stage has failed (and the shutdown woke every wait), the others get a short
        // grace to report; one stuck in user code does not hold the job's end back.
        let next = if errors.is_empty() {
            set.join_next().await
        } else {
            match tokio::time::timeout(FAILURE_GRACE.min(timeout), set.join_next()).await {
                Ok(next) => next,
                Err(_) => break,
            }
        };
        let Some(joined) = next else { break };
        let Ok((r, reply)) = joined else {
            errors.push(Error::Runtime("a request task panicked".into()));
            continue;
        };
        if matches!(reply, Ok(CallResult::Success(_))) {
            crew.control.fetch_add(1, Ordering::Relaxed);
        }
        let failure = match reply {
            Ok(CallResult::Success(Ok(v))) => {
                results[r] = Some(v);
                None
            }
            Ok(CallResult::Success(Err(e))) => Some(e),
            Ok(CallResult::Timeout) => {
                missing.push(r);
                None
            }
            Ok(CallResult::SenderError) | Err(_) => Some(Error::StageLost {
                device: crew.devices[r].1,
                stage: crew.stages[r].1,
                reason: "its actor stopped without answering".into(),
            }),
        };
        if let Some(e) = failure {
            if errors.is_empty() {
                // RT-4: wake every peer blocked in a collective now.
                (crew.shutdown)();
            }
            errors.push(e);
        }
    }
    if !missing.is_empty() && errors.is_empty() {
        (crew.shutdown)();
        let mut devices = Vec::new();
        for &r in &missing {
            let (d, id) = &crew.devices[r];
            devices.push(match heartbeat(d, *id, HEARTBEAT_PROBE).await {
                Ok(h) => match h.busy {
                    Some((what, since)) => format!("device {id}: busy with {what} for {since:?}"),
                    None => format!("device {id}: idle"),
                },
                Err(e) => e.to_string(),
            });
        }
        let e = Error::StepTimeout {
            step: step.unwrap_or(0),
            missing: missing.iter().map(|&r| crew.stages[r].1).collect(),
            waited: timeout,
            devices,
        };
        return (results, Some(e));
    }
    let cause = root_cause(errors);
    (results, cause)
}

/// Pick the root cause among several stage errors: a peer woken by the group's shutdown is a
/// consequence, not a cause.
fn root_cause(errors: Vec<Error>) -> Option<Error> {
    let is_consequence = |e: &Error| {
        matches!(
            e,
            // A broken link to another process is the consequence of that process's failure
            // (which its own stage reports, naming it).
            Error::Comm(
                CommError::Shutdown { .. } | CommError::Poisoned { .. } | CommError::Link { .. }
            ) | Error::Pipeline(
                ExecError::Aborted { .. }
                    | ExecError::LinkClosed { .. }
                    | ExecError::Wire { .. }
                    | ExecError::Comm(
                        CommError::Shutdown { .. }
                            | CommError::Poisoned { .. }
                            | CommError::Link { .. }
                    )
                    | ExecError::BlockCollective {
                        cause: CommError::Shutdown { .. }
                            | CommError::Poisoned { .. }
                            | CommError::Link { .. },
                        ..
                    }
            )
        )
    };
    let mut it = errors.into_iter();
    let first = it.next()?;
    if !is_consequence(&first) {
        return Some(first);
    }
    Some(it.find(|e| !is_consequence(e)).unwrap_or(first))
}
