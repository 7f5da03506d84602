//! A running job's handles: wait for it, stop it, control it, ask where it is.

use super::*;

/// A running job.
pub struct JobHandle<M> {
    pub(super) supervisor: ActorRef<SupervisorMsg>,
    /// Only for `resubscribe`: the handle holds no sender, so every stream closes when the
    /// Supervisor's state is dropped, even if the Supervisor dies without a last event.
    pub(super) template: broadcast::Receiver<JobEvent>,
    pub(super) first: Mutex<Option<broadcast::Receiver<JobEvent>>>,
    pub(super) outcome: oneshot::Receiver<Result<Trained<M>>>,
}

impl<M> std::fmt::Debug for JobHandle<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobHandle({})", self.supervisor.get_id())
    }
}

impl<M: Send + 'static> JobHandle<M> {
    /// A stream of the job's events. The first call sees every event since the job started;
    /// later calls see events from the moment of the call (EV-1).
    pub fn events(&self) -> EventStream {
        let rx = self
            .first
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_else(|| self.template.resubscribe());
        EventStream::new(rx)
    }

    /// Where the job is. Answered at once, also while a step runs (SV-3: the step runs on a
    /// task of its own); `timeout` bounds the wait for a Supervisor that does not answer.
    pub async fn status(&self, timeout: Duration) -> Result<JobStatus> {
        status_of(&self.supervisor, timeout).await
    }

    /// A cloneable handle on every control of the job (stop, checkpoint, resize, pause).
    pub fn control(&self) -> JobControl {
        JobControl {
            supervisor: self.supervisor.clone(),
        }
    }

    /// A cloneable way to stop the job from elsewhere in the program (a signal handler, a
    /// service endpoint) while this handle waits in [`join`](Self::join).
    pub fn stopper(&self) -> JobStopper {
        JobStopper {
            supervisor: self.supervisor.clone(),
        }
    }

    /// Wait for the job to end and return the trained model, or the error that ended it.
    pub async fn join(self) -> Result<Trained<M>> {
        self.outcome.await.unwrap_or_else(|_| {
            Err(Error::Runtime(
                "the supervisor ended without a result".into(),
            ))
        })
    }

    /// Write a checkpoint at the next step boundary (needs a checkpoint directory or store);
    /// a `CheckpointWritten` event follows once it is on disk.
    pub fn checkpoint_now(&self) {
        self.control().checkpoint_now();
    }

    /// Resize the job to `n` data-parallel replicas at the next step boundary (a block or
    /// pipeline job keeps its stages and tensor-parallel degree): joining replicas take the
    /// parameters and optimizer state, sharded state is re-sharded, the global batch stays
    /// the same. A `Resized` event follows, or `ResizeRefused` saying why (outside
    /// [`JobBuilder::elastic`]'s range, a mesh across processes, local updates over blocks, a
    /// size that does not cut a mesh's global batch into its micro-batches).
    pub fn scale_to(&self, n: u32) {
        self.control().scale_to(n);
    }

    /// Start no new step until [`resume`](Self::resume) (the running step finishes); a
    /// `Paused` event follows.
    pub fn pause(&self) {
        self.control().pause();
    }

    /// Continue after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.control().resume();
    }

    /// Ask the job to stop at the next step boundary and return the model trained so far.
    pub async fn stop(self) -> Result<Trained<M>> {
        let _ = self.supervisor.send_message(SupervisorMsg::Stop);
        self.join().await
    }
}

async fn status_of(supervisor: &ActorRef<SupervisorMsg>, timeout: Duration) -> Result<JobStatus> {
    match supervisor.call(SupervisorMsg::Status, Some(timeout)).await {
        Ok(ractor::rpc::CallResult::Success(s)) => Ok(s),
        Ok(ractor::rpc::CallResult::Timeout) => Err(Error::Runtime(format!(
            "the supervisor did not answer a status request within {timeout:?}"
        ))),
        _ => Err(Error::Stopped("the job has ended".into())),
    }
}

/// Every control of a running job, cheap to clone and send anywhere (a signal handler, a
/// service's endpoints): stop, checkpoint, resize, pause and resume. Each takes effect at the
/// next step boundary and is answered by an event.
#[derive(Debug, Clone)]
pub struct JobControl {
    supervisor: ActorRef<SupervisorMsg>,
}

impl JobControl {
    /// See [`JobHandle::stop`] (this one does not wait).
    pub fn stop(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Stop);
    }

    /// See [`JobHandle::checkpoint_now`].
    pub fn checkpoint_now(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::CheckpointNow);
    }

    /// See [`JobHandle::scale_to`].
    pub fn scale_to(&self, n: u32) {
        let _ = self.supervisor.send_message(SupervisorMsg::ScaleTo(n));
    }

    /// Grow a data-parallel job by `k` replicas at the next step boundary, on top of any
    /// resize already asked for: what a program calls when devices became available (a
    /// cluster job calls it for every node that joins it while it runs). A `Resized` event
    /// follows, or `ResizeRefused` saying why.
    pub fn add_replicas(&self, k: u32) {
        let _ = self.supervisor.send_message(SupervisorMsg::AddReplicas(k));
    }

    /// See [`JobHandle::pause`].
    pub fn pause(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Pause);
    }

    /// See [`JobHandle::resume`].
    pub fn resume(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Resume);
    }

    /// See [`JobHandle::status`].
    pub async fn status(&self, timeout: Duration) -> Result<JobStatus> {
        status_of(&self.supervisor, timeout).await
    }
}

/// Stops a job at its next step boundary; cheap to clone and send anywhere.
#[derive(Debug, Clone)]
pub struct JobStopper {
    supervisor: ActorRef<SupervisorMsg>,
}

impl JobStopper {
    /// Ask the job to stop at the next step boundary (a no-op if it has ended). The job's
    /// `join()` then returns the model trained so far.
    pub fn stop(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::Stop);
    }

    /// Write a checkpoint at the next step boundary (see [`JobHandle::checkpoint_now`]).
    pub fn checkpoint_now(&self) {
        let _ = self.supervisor.send_message(SupervisorMsg::CheckpointNow);
    }
}
