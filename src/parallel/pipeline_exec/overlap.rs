//! Overlapping a stage's collectives with its compute: a [`CommLane`] owns the stage's
//! data-parallel communicator for the forward and backward part of a step and runs, in the
//! order they were issued, the [`Collective`]s its blocks' synchronisations ask for (all-gather
//! of a ZeRO-3 block's parameters, all-reduce or reduce-scatter of a block's gradient), on a
//! communication thread beside the compute thread (`with_lane(.., threaded: true, ..)`), or
//! on the compute thread itself at the moment they are issued (`threaded: false`: no
//! overlap). The compute thread issues a collective and goes on; it blocks only on
//! [`CommLane::wait`] for a result it needs.
//!
//! Invariants:
//! - OVL-1: the lane runs the collectives first in, first out, and the executor issues them
//!   in an order that is a function of the schedule and `blocks_in_flight` only, so every
//!   rank of the group runs the same collectives in the same order and they pair up; where a
//!   collective runs never changes its result (COLL-1), so a step is bitwise the same with
//!   and without overlap.
//! - OVL-2: every wait is bounded: by the communicator's time-out for each collective still
//!   ahead of the awaited one, plus a margin; past it, a typed error names the block and the
//!   collective ([`ExecError::BlockCollectiveTimeout`]).
//! - OVL-3: once a collective fails, the lane runs no more (the group's ranks are out of
//!   step): every later result is that failure, named by its block and op
//!   ([`ExecError::BlockCollective`]). When the lane is dropped (the step ended, or failed)
//!   the thread skips what is queued and ends, after at most the collective it is running.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use super::ExecError;
use crate::comm::{CollectiveKind, CommError, Communicator};
use crate::parallel::sync::{Collective, Span};

/// Added to a wait's bound: a result is handed over, not computed, after its collective.
const WAIT_MARGIN: Duration = Duration::from_secs(1);

/// A collective issued on a [`CommLane`], to [`wait`](CommLane::wait) on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Ticket(u64);

/// One request to the communication thread.
struct Request {
    id: u64,
    collective: Collective,
}

/// What the communication thread hands back.
struct Done {
    id: u64,
    /// `Err(None)`: skipped because an earlier collective failed (OVL-3).
    result: Result<Vec<f32>, Option<CommError>>,
    spans: Vec<Span>,
}

/// What the lane remembers of an issued collective.
#[derive(Debug, Clone, Copy)]
struct Issued {
    block: u32,
    op: CollectiveKind,
}

/// Where collectives run: here, at issue, or on the communication thread.
enum Runner<'c> {
    Inline(Option<&'c mut Communicator>),
    Thread {
        to: Option<Sender<Request>>,
        from: Receiver<Done>,
        stop: Arc<AtomicBool>,
    },
}

/// The stage's communicator for one step's forwards and backwards (see the module docs).
pub(crate) struct CommLane<'c> {
    runner: Runner<'c>,
    stage: u32,
    /// Each collective's time-out (the communicator's).
    timeout: Duration,
    next: u64,
    /// Results not yet asked for, by ticket.
    ready: HashMap<u64, Done>,
    issued: HashMap<u64, Issued>,
    /// Results received from the thread (they come in issue order).
    received: u64,
    /// The first failure, reported for every later result (OVL-3).
    failure: Option<ExecError>,
    spans: Vec<Span>,
}

impl std::fmt::Debug for CommLane<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let threaded = matches!(self.runner, Runner::Thread { .. });
        f.debug_struct("CommLane")
            .field("stage", &self.stage)
            .field("threaded", &threaded)
            .field("issued", &self.next)
            .finish_non_exhaustive()
    }
}

/// Run `f` with a lane over `comm` for stage `stage`: with `threaded` (and a group of more
/// than one) the collectives run on a scoped communication thread, which ends before this
/// returns; otherwise each runs where it is issued.
pub(crate) fn with_lane<R>(
    comm: Option<&mut Communicator>,
    threaded: bool,
    stage: u32,
    f: impl FnOnce(&mut CommLane<'_>) -> R,
) -> R {
    let timeout = comm
        .as_ref()
        .map_or(Duration::from_secs(60), |c| c.timeout());
    let overlap = threaded && comm.as_ref().is_some_and(|c| c.world() > 1);
    match comm {
        Some(comm) if overlap => std::thread::scope(|scope| {
            let (to, requests) = channel::<Request>();
            let (done, from) = channel::<Done>();
            let stop = Arc::new(AtomicBool::new(false));
            let halt = stop.clone();
            std::thread::Builder::new()
                .name(format!("stage-{stage}-comm"))
                .spawn_scoped(scope, move || serve(comm, &requests, &done, &halt))
                .expect("the OS starts a thread");
            let mut lane = CommLane::new(
                Runner::Thread {
                    to: Some(to),
                    from,
                    stop,
                },
                stage,
                timeout,
            );
            f(&mut lane)
            // Dropping the lane stops the thread (OVL-3); the scope joins it.
        }),
        comm => {
            let mut lane = CommLane::new(Runner::Inline(comm), stage, timeout);
            f(&mut lane)
        }
    }
}

/// The communication thread: run each request in order until the lane goes away; after a
/// failure, or once told to stop, answer without running (OVL-3).
fn serve(
    comm: &mut Communicator,
    requests: &Receiver<Request>,
    done: &Sender<Done>,
    stop: &AtomicBool,
) {
    let mut failed = false;
    for Request { id, collective } in requests.iter() {
        let (result, spans) = if failed || stop.load(Ordering::Relaxed) {
            (Err(None), Vec::new())
        } else {
            let (r, spans) = collective.run(Some(comm));
            failed = r.is_err();
            (r.map_err(Some), spans)
        };
        if done.send(Done { id, result, spans }).is_err() {
            return;
        }
    }
}

impl<'c> CommLane<'c> {
    fn new(runner: Runner<'c>, stage: u32, timeout: Duration) -> Self {
        Self {
            runner,
            stage,
            timeout,
            next: 0,
            ready: HashMap::new(),
            issued: HashMap::new(),
            received: 0,
            failure: None,
            spans: Vec::new(),
        }
    }

    /// Queue `collective` for block `block` (its index in the model).
    pub(crate) fn issue(&mut self, block: u32, collective: Collective) -> Ticket {
        let id = self.next;
        self.next += 1;
        let op = collective.kind();
        self.issued.insert(id, Issued { block, op });
        match &mut self.runner {
            Runner::Inline(comm) => {
                let (result, spans) = if self.failure.is_some() {
                    (Err(None), Vec::new())
                } else {
                    let (r, spans) = collective.run(comm.as_deref_mut());
                    (r.map_err(Some), spans)
                };
                let done = Done { id, result, spans };
                self.note(&done);
                self.ready.insert(id, done);
            }
            Runner::Thread { to, .. } => {
                let request = Request { id, collective };
                // A send fails only if the thread ended; the wait reports it.
                if let Some(to) = to.as_ref()
                    && to.send(request).is_err()
                {
                    self.ready.insert(
                        id,
                        Done {
                            id,
                            result: Err(None),
                            spans: Vec::new(),
                        },
                    );
                }
            }
        }
        Ticket(id)
    }

    /// The result of `ticket`'s collective, waiting for it (bounded, OVL-2).
    pub(crate) fn wait(&mut self, ticket: Ticket) -> Result<Vec<f32>, ExecError> {
        let Ticket(id) = ticket;
        let issued = *self
            .issued
            .get(&id)
            .expect("a ticket comes from this lane's `issue`");
        let done = match self.ready.remove(&id) {
            Some(done) => done,
            None => self.receive(id, issued)?,
        };
        self.issued.remove(&id);
        self.spans.extend(done.spans);
        // A collective skipped after a failure reports that failure (OVL-3); one skipped
        // for no failure was stopped with the step.
        done.result.map_err(|_| {
            self.failure
                .clone()
                .unwrap_or(ExecError::Aborted { stage: self.stage })
        })
    }

    /// Remember the first failure (OVL-3).
    fn note(&mut self, done: &Done) {
        if let (Err(Some(cause)), Some(issued), None) =
            (&done.result, self.issued.get(&done.id), &self.failure)
        {
            self.failure = Some(ExecError::BlockCollective {
                stage: self.stage,
                block: issued.block,
                op: issued.op,
                cause: cause.clone(),
            });
        }
    }

    /// Take results from the thread until `id`'s arrives, keeping the others.
    fn receive(&mut self, id: u64, issued: Issued) -> Result<Done, ExecError> {
        // Every collective up to this one may still have to run, each within its time-out.
        let ahead = (id + 1).saturating_sub(self.received).max(1);
        let waited = self.timeout * ahead as u32 + WAIT_MARGIN;
        let deadline = Instant::now() + waited;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Runner::Thread { from, .. } = &self.runner else {
                unreachable!("an inline lane's results are ready at issue")
            };
            match from.recv_timeout(left) {
                Ok(done) => {
                    self.received += 1;
                    self.note(&done);
                    if done.id == id {
                        return Ok(done);
                    }
                    self.ready.insert(done.id, done);
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(ExecError::BlockCollectiveTimeout {
                        stage: self.stage,
                        block: issued.block,
                        op: issued.op,
                        waited,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self
                        .failure
                        .clone()
                        .unwrap_or(ExecError::Aborted { stage: self.stage }));
                }
            }
        }
    }

    /// The spans of the collectives whose results were taken, in the order taken.
    pub(crate) fn take_spans(&mut self) -> Vec<Span> {
        std::mem::take(&mut self.spans)
    }
}

impl Drop for CommLane<'_> {
    fn drop(&mut self) {
        if let Runner::Thread { to, stop, .. } = &mut self.runner {
            stop.store(true, Ordering::Relaxed);
            to.take();
        }
    }
}
