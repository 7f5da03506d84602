//! A consumer's view of a job's events: the stream and why it returned no event.

use super::*;

/// A consumer's view of a job's events.
#[derive(Debug)]
pub struct EventStream {
    rx: broadcast::Receiver<JobEvent>,
    ended: bool,
}

/// Why [`EventStream::recv`] returned no event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventsError {
    /// This consumer was too slow: the oldest `n` events were dropped for it.
    #[error("missed {0} events")]
    Missed(u64),
    /// The job has ended and every event has been received.
    #[error("the job has ended")]
    Closed,
}

impl EventStream {
    /// A stream reading `rx` from its oldest held event.
    pub(super) fn new(rx: broadcast::Receiver<JobEvent>) -> Self {
        Self { rx, ended: false }
    }

    /// The next event; `Err(Missed(n))` tells a lagging consumer how many it lost (the next
    /// call continues with the oldest event still held). After the job's last event
    /// (`Finished` or `Failed`) every call returns `Err(Closed)`.
    pub async fn recv(&mut self) -> std::result::Result<JobEvent, EventsError> {
        if self.ended {
            return Err(EventsError::Closed);
        }
        let event = self.rx.recv().await.map_err(|e| match e {
            broadcast::error::RecvError::Lagged(n) => EventsError::Missed(n),
            broadcast::error::RecvError::Closed => EventsError::Closed,
        });
        match &event {
            Ok(JobEvent::Finished { .. } | JobEvent::Failed(_)) | Err(EventsError::Closed) => {
                self.ended = true;
            }
            _ => {}
        }
        event
    }
}
