//! `DeviceActor`: one logical device and its compute thread.
//!
//! The compute thread is the device's stream: every Burn operation of the stages placed on the
//! device runs there, in submission order (RT-1). The actor itself only forwards tasks and
//! answers heartbeats from a status the thread keeps up to date (RT-2).

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::oneshot;

use crate::device::MeshDevice;
use crate::error::{Error, Result};
use crate::mesh::DeviceId;

/// Work for a compute thread (it reports its own result).
pub(crate) type Task = Box<dyn FnOnce() + Send + 'static>;

pub(crate) use crate::report::Heartbeat;

#[derive(Debug, Default)]
struct ThreadStatus {
    busy: Option<(String, Instant)>,
    tasks_done: u64,
    progress: Option<(String, Instant)>,
}

std::thread_local! {
    /// The status of the device thread this code runs on (none elsewhere).
    static THREAD_STATUS: std::cell::RefCell<Option<Arc<Mutex<ThreadStatus>>>> =
        const { std::cell::RefCell::new(None) };
}

/// Report where the running task is (e.g. "step 3, forward of micro-batch 1"), for heartbeats.
/// Cheap; does nothing off device threads.
pub(crate) fn report_progress(progress: impl FnOnce() -> String) {
    THREAD_STATUS.with(|s| {
        if let Some(status) = s.borrow().as_ref() {
            status.lock().unwrap_or_else(|e| e.into_inner()).progress =
                Some((progress(), Instant::now()));
        }
    });
}

/// Messages a [`DeviceActor`] handles.
pub(crate) enum DeviceMsg {
    /// Reply with the device's [`Heartbeat`].
    Heartbeat(RpcReplyPort<Heartbeat>),
    /// Run a task on the compute thread (fire and forget: the task reports its own result).
    Run {
        /// Shown in heartbeats while the task runs.
        label: String,
        /// The work.
        task: Task,
    },
}

impl std::fmt::Debug for DeviceMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceMsg::Heartbeat(_) => write!(f, "Heartbeat"),
            DeviceMsg::Run { label, .. } => write!(f, "Run({label})"),
        }
    }
}

/// The actor of one logical device.
#[derive(Debug, Default)]
pub(crate) struct DeviceActor;

/// State of a [`DeviceActor`].
#[derive(Debug)]
pub(crate) struct DeviceState {
    device: MeshDevice,
    tasks: Option<mpsc::Sender<(String, Task)>>,
    status: Arc<Mutex<ThreadStatus>>,
}

impl Actor for DeviceActor {
    type Msg = DeviceMsg;
    type State = DeviceState;
    type Arguments = MeshDevice;

    async fn pre_start(
        &self,
        _myself: ActorRef<DeviceMsg>,
        device: MeshDevice,
    ) -> Result<DeviceState, ActorProcessingErr> {
        let (tx, rx) = mpsc::channel::<(String, Task)>();
        let status = Arc::new(Mutex::new(ThreadStatus::default()));
        let thread_status = status.clone();
        std::thread::Builder::new()
            .name(format!("meshwork-device-{}", device.id()))
            .spawn(move || {
                THREAD_STATUS.with(|s| *s.borrow_mut() = Some(thread_status.clone()));
                // The thread ends when the actor drops its sender.
                while let Ok((label, task)) = rx.recv() {
                    set_status(&thread_status, Some(label));
                    // Tasks catch their own panics to report them; this guard keeps the thread
                    // alive for the next task if one does not.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
                    set_status(&thread_status, None);
                }
            })?;
        Ok(DeviceState {
            device,
            tasks: Some(tx),
            status,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<DeviceMsg>,
        msg: DeviceMsg,
        state: &mut DeviceState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DeviceMsg::Heartbeat(reply) => {
                let s = state.status.lock().unwrap_or_else(|e| e.into_inner());
                let _ = reply.send(Heartbeat {
                    device: state.device.id(),
                    busy: s.busy.as_ref().map(|(l, t)| (l.clone(), t.elapsed())),
                    tasks_done: s.tasks_done,
                    progress: s.progress.as_ref().map(|(p, t)| (p.clone(), t.elapsed())),
                });
            }
            DeviceMsg::Run { label, task } => {
                if let Some(tx) = &state.tasks
                    && tx.send((label, task)).is_err()
                {
                    return Err("compute thread has exited".into());
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DeviceMsg>,
        state: &mut DeviceState,
    ) -> Result<(), ActorProcessingErr> {
        // Dropping the sender ends the thread after its current task; it is not joined, so a
        // task stuck in user code cannot block shutdown.
        state.tasks = None;
        Ok(())
    }
}

fn set_status(status: &Mutex<ThreadStatus>, busy: Option<String>) {
    let mut s = status.lock().unwrap_or_else(|e| e.into_inner());
    if busy.is_none() {
        s.tasks_done += 1;
    }
    s.busy = busy.map(|l| (l, Instant::now()));
}

/// Run `f` on `device`'s compute thread and wait for its result. A panic in `f` comes back as
/// `Err(panic text)`.
pub(crate) async fn run_on<R: Send + 'static>(
    device: &ActorRef<DeviceMsg>,
    label: impl Into<String>,
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<std::result::Result<R, String>> {
    let (tx, rx) = oneshot::channel();
    let task: Task = Box::new(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|p| super::panic_text(p.as_ref()));
        let _ = tx.send(r);
    });
    device
        .send_message(DeviceMsg::Run {
            label: label.into(),
            task,
        })
        .map_err(|e| Error::Runtime(format!("device actor unreachable: {e}")))?;
    rx.await
        .map_err(|_| Error::Runtime("compute thread dropped a task".into()))
}

/// Run `f` on `device`'s compute thread on the state held in `slot`, and put the state back.
/// `None` when the slot is empty (its state was lost earlier); `Some(Ok(Err(panic)))` when `f`
/// panicked, which loses the state.
pub(crate) async fn run_on_slot<S: Send + 'static, R: Send + 'static>(
    device: &ActorRef<DeviceMsg>,
    label: &str,
    slot: &mut Option<S>,
    f: impl FnOnce(&mut S) -> R + Send + 'static,
) -> Option<Result<std::result::Result<R, String>>> {
    let mut state = slot.take()?;
    let out = run_on(device, label, move || {
        let r = f(&mut state);
        (state, r)
    })
    .await;
    Some(out.map(|r| {
        r.map(|(state, r)| {
            *slot = Some(state);
            r
        })
    }))
}

/// Ask `device` for a heartbeat, waiting at most `timeout`.
pub(crate) async fn heartbeat(
    device: &ActorRef<DeviceMsg>,
    id: DeviceId,
    timeout: Duration,
) -> Result<Heartbeat> {
    match device.call(DeviceMsg::Heartbeat, Some(timeout)).await {
        Ok(ractor::rpc::CallResult::Success(h)) => Ok(h),
        _ => Err(Error::DeviceUnresponsive {
            device: id,
            what: "heartbeat".into(),
            waited: timeout,
        }),
    }
}

#[cfg(test)]
mod tests;
