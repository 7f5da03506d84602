//! Writing checkpoints off the training path.
//!
//! The Supervisor takes a snapshot at a step boundary (each stage copies its parameters and
//! optimizer state on its device thread: short) and hands it to the [`Checkpointer`], a thread
//! of its own that writes it through a [`CheckpointSink`] (normally a
//! [`CheckpointStore`](crate::checkpoint::CheckpointStore): atomic, verified, pruned) while
//! training goes on, and publishes `CheckpointWritten` or `CheckpointFailed`.
//!
//! - CKW-1: training never waits for a write, except when the job ends: the last requested
//!   checkpoint is written before `join()` returns (bounded by [`DRAIN_TIMEOUT`]).
//! - CKW-2: a failed write is an event, not a job failure; the previous checkpoints stay valid
//!   (CKPT-1).
//! - CKW-3: at most [`MAX_BACKLOG`] checkpoints wait or are being written; the writer thread
//!   signals every write it finishes ([`CheckpointQueue::wait_below`] wakes on it, no polling).

use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use tokio::sync::{broadcast, watch};

use crate::checkpoint::{Checkpoint, CheckpointFs, CheckpointStore, Loaded};
use crate::error::Result;
use crate::events::JobEvent;

/// How long the end of a job waits for the checkpoint being written.
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(120);

/// Where checkpoints go and where a resumed job finds them.
pub trait CheckpointSink: Send + Sync + std::fmt::Debug {
    /// Write one checkpoint (atomically); its directory.
    fn write(&self, checkpoint: &Checkpoint) -> Result<PathBuf>;
    /// Write one checkpoint, failing half-way on purpose (a FaultPlan's
    /// `FailCheckpointWrite`). By default nothing is written and the write fails.
    fn write_failing_half_way(&self, checkpoint: &Checkpoint) -> Result<PathBuf> {
        Err(crate::error::Error::Runtime(format!(
            "injected fault: the checkpoint of step {} failed before it was written",
            checkpoint.step
        )))
    }
    /// The newest checkpoint that verifies, with the newer ones refused.
    fn latest_valid(&self) -> Result<Option<Loaded>>;
    /// Check, when the job is built, that checkpoints can be written (CKPT-7); by default
    /// nothing is checked.
    fn check_writable(&self) -> Result<()> {
        Ok(())
    }
    /// Where the checkpoints are, for messages (a store's root directory; by default the
    /// sink's type).
    fn location(&self) -> String {
        std::any::type_name::<Self>().to_string()
    }
}

impl<F: CheckpointFs + 'static> CheckpointSink for CheckpointStore<F> {
    fn write(&self, checkpoint: &Checkpoint) -> Result<PathBuf> {
        Ok(CheckpointStore::write(self, checkpoint)?)
    }

    fn write_failing_half_way(&self, checkpoint: &Checkpoint) -> Result<PathBuf> {
        Ok(CheckpointStore::write_or_fail_half_way(
            self, checkpoint, true,
        )?)
    }

    fn latest_valid(&self) -> Result<Option<Loaded>> {
        Ok(CheckpointStore::latest_valid(self)?)
    }

    fn check_writable(&self) -> Result<()> {
        Ok(CheckpointStore::check_writable(self)?)
    }

    fn location(&self) -> String {
        self.root().display().to_string()
    }
}

/// A checkpoint waiting for the writer thread.
#[derive(Debug)]
pub(crate) struct Queued {
    /// What to write.
    pub checkpoint: Checkpoint,
    /// Whether the plan fails this write half-way (FaultKind::FailCheckpointWrite).
    pub fail_half_way: bool,
}

/// What the writer thread is asked to do.
#[derive(Debug)]
enum Work {
    /// Write a checkpoint.
    Write(Box<Queued>),
    /// Answer once everything queued before is written.
    Flush(mpsc::Sender<()>),
}

/// At most this many checkpoints wait or are being written (CKW-3): a snapshot is a copy of
/// the model, so a writer slower than the checkpoint interval must not make them pile up in
/// memory; the next step boundary waits for the oldest instead.
pub(crate) const MAX_BACKLOG: usize = 2;

/// Where checkpoints are queued for the writer thread.
#[derive(Debug, Clone)]
pub(crate) struct CheckpointQueue {
    tx: mpsc::Sender<Work>,
    /// Checkpoints queued and not written yet; the writer thread signals each write it ends.
    backlog: Arc<watch::Sender<usize>>,
}

impl CheckpointQueue {
    /// Queue a write (returns at once, CKW-1); false if the writer has stopped.
    pub(crate) fn send(&self, queued: Queued) -> bool {
        self.backlog.send_modify(|b| *b += 1);
        let sent = self.tx.send(Work::Write(Box::new(queued))).is_ok();
        if !sent {
            self.backlog.send_modify(|b| *b -= 1);
        }
        sent
    }

    /// Checkpoints queued and not written yet.
    pub(crate) fn backlog(&self) -> usize {
        *self.backlog.borrow()
    }

    /// Wait until fewer than `limit` checkpoints are queued or being written, woken by the
    /// writer thread as each write ends (CKW-3); after `timeout`, `Err` with the backlog then.
    pub(crate) async fn wait_below(&self, limit: usize, timeout: Duration) -> Result<(), usize> {
        let mut written = self.backlog.subscribe();
        match tokio::time::timeout(timeout, written.wait_for(|b| *b < limit)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(self.backlog()),
        }
    }

    /// Wait (blocking, at most `timeout`) until every write queued before is done; false if
    /// the writer has stopped or did not finish in time.
    pub(crate) fn flush(&self, timeout: Duration) -> bool {
        let (done, wait) = mpsc::channel();
        self.tx.send(Work::Flush(done)).is_ok() && wait.recv_timeout(timeout).is_ok()
    }
}

/// The writer thread.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    tx: Option<mpsc::Sender<Work>>,
    done: Option<mpsc::Receiver<()>>,
    backlog: Arc<watch::Sender<usize>>,
}

impl Checkpointer {
    /// Start the writer thread for `sink`; results are published on `events`.
    pub(crate) fn spawn(
        sink: std::sync::Arc<dyn CheckpointSink>,
        events: broadcast::Sender<JobEvent>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Work>();
        let (done_tx, done) = mpsc::channel();
        let backlog = Arc::new(watch::Sender::new(0));
        let left = backlog.clone();
        std::thread::Builder::new()
            .name("meshwork-checkpointer".into())
            .spawn(move || {
                while let Ok(work) = rx.recv() {
                    let Queued {
                        checkpoint: c,
                        fail_half_way,
                    } = match work {
                        Work::Write(q) => *q,
                        Work::Flush(done) => {
                            let _ = done.send(());
                            continue;
                        }
                    };
                    // A sink that panics fails this checkpoint, not the writer (CKW-2).
                    let write = || {
                        if fail_half_way {
                            sink.write_failing_half_way(&c)
                        } else {
                            sink.write(&c)
                        }
                    };
                    let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(write))
                        .unwrap_or_else(|p| {
                            Err(crate::error::Error::Runtime(format!(
                                "the checkpoint sink panicked: {}",
                                crate::actors::panic_text(p.as_ref())
                            )))
                        });
                    let event = match written {
                        Ok(path) => JobEvent::CheckpointWritten { step: c.step, path },
                        Err(error) => JobEvent::CheckpointFailed {
                            step: c.step,
                            error,
                        },
                    };
                    // The event goes out before the backlog shrinks: a step boundary that
                    // waited for this write then always follows its event (CKW-3).
                    let _ = events.send(event);
                    left.send_modify(|b| *b -= 1);
                }
                let _ = done_tx.send(());
            })
            .map_err(|e| crate::error::Error::Runtime(format!("checkpoint thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            done: Some(done),
            backlog,
        })
    }

    /// Where checkpoints are queued for writing (a send returns at once, CKW-1).
    pub(crate) fn queue(&self) -> Option<CheckpointQueue> {
        self.tx.clone().map(|tx| CheckpointQueue {
            tx,
            backlog: self.backlog.clone(),
        })
    }

    /// Finish the queued writes, waiting at most `timeout`; false if they did not finish.
    pub(crate) fn drain(&mut self, timeout: Duration) -> bool {
        self.tx = None;
        match self.done.take() {
            Some(done) => done.recv_timeout(timeout).is_ok(),
            None => true,
        }
    }
}
