//! How an MPI rank's ops move their bytes and fail: headers and data as `MPI_Isend`s of
//! owned copies and `MPI_Irecv`s polled until the op's deadline (MPI-2), sends reaped as they
//! complete, abort messages to and from the peers (MPI-3), and the errors each names.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::raw::{self, PendingRecv};
use super::world::Live;
use super::{ABORT, MpiCommunicator, OpId, STREAM};
use crate::comm::cross::{self, rank_of, root_cause};
use crate::comm::{CallShape, CollectiveKind, CommError, LinkFailure};
use crate::mesh::Rank;

/// The largest op header accepted.
const MAX_HEADER: usize = 1024;

/// Marks a header, so a data message read where a header belongs is told apart.
const HEADER_TAG: [u8; 4] = *b"MWMP";

/// How often a wait looks for abort messages (MPI-3).
const ABORT_PROBE: Duration = Duration::from_millis(1);

/// After a time-out, how long each peer not yet heard from gets to show its header.
pub(super) const PROBE: Duration = Duration::from_millis(2);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Header {
    pub(super) tag: [u8; 4],
    pub(super) generation: u64,
    pub(super) seq: u64,
    /// The sender's largest message: a step splits into messages of this size on both sides,
    /// so every rank of a group must use the same ([`super::MpiConfig::max_message_bytes`]).
    pub(super) max_message: u64,
    pub(super) call: CallShape,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// Why a wait ended early.
pub(super) enum Waited {
    Timeout,
    Comm(CommError),
}

impl MpiCommunicator {
    pub(super) fn shutdown_error(&self, id: OpId) -> CommError {
        CommError::Shutdown {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
        }
    }

    /// MPI kept live for one op (`MpiWorld::enter`), or the op's refusal once finalised.
    pub(super) fn live(&self, op: CollectiveKind) -> Result<Live, CommError> {
        self.mpi.enter().ok_or(CommError::Shutdown {
            generation: self.generation,
            seq: self.seq,
            op,
        })
    }

    fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::SeqCst) || self.mpi.is_finalized()
    }

    /// The error an op gets before it starts when shut down or poisoned.
    pub(super) fn refusal(&self, id: OpId) -> Option<CommError> {
        let op = (self.generation, id.seq, id.op);
        cross::refusal(self.is_shut_down(), self.failure.as_ref(), op)
    }

    fn link(&self, peer: usize, id: OpId, failure: LinkFailure) -> CommError {
        CommError::Link {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            peer: rank_of(peer),
            failure,
        }
    }

    fn mpi_error(&self, peer: usize, id: OpId, error: super::MpiError) -> CommError {
        self.link(
            peer,
            id,
            LinkFailure::Io {
                detail: error.to_string(),
            },
        )
    }

    pub(super) fn out_of_step(&self, peer: usize, id: OpId, detail: String) -> CommError {
        self.link(peer, id, LinkFailure::OutOfStep { detail })
    }

    pub(super) fn timeout_error(&self, id: OpId, missing: Vec<Rank>) -> CommError {
        CommError::Timeout {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            missing,
            waited: self.timeout,
        }
    }

    /// MPI-3: an abort message from any peer, as this op's error.
    fn aborted(&self, id: OpId) -> Option<CommError> {
        for (r, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            match raw::take_message(self.mpi, peer.process, peer.from | ABORT) {
                Ok(None) => {}
                Ok(Some(bytes)) => {
                    let cause =
                        bincode::serde::decode_from_slice::<CommError, _>(&bytes, bincode_config())
                            .map(|(c, _)| c)
                            .unwrap_or_else(|_| {
                                self.link(
                                    r,
                                    id,
                                    LinkFailure::BadFrame {
                                        detail: format!(
                                            "an abort message of {} bytes",
                                            bytes.len()
                                        ),
                                    },
                                )
                            });
                    return Some(CommError::Poisoned {
                        generation: self.generation,
                        seq: id.seq,
                        op: id.op,
                        cause: Box::new(cause),
                    });
                }
                Err(e) => return Some(self.mpi_error(r, id, e)),
            }
        }
        None
    }

    /// Frees the sends that completed; the first MPI error, if any, with the send's peer.
    fn reap(&mut self) -> Result<(), (usize, super::MpiError)> {
        let mut i = 0;
        while i < self.pending.len() {
            let peer = self.pending[i].peer();
            if self.pending[i].test().map_err(|e| (peer, e))? {
                self.pending.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Keeps every send still in flight alive for good (MPI-2). After `finalize` no MPI call
    /// is made: every pending send is kept.
    pub(super) fn forget_pending(&mut self) {
        if let Some(_live) = self.mpi.enter() {
            let _ = self.reap();
        }
        for send in self.pending.drain(..) {
            send.forget();
        }
    }

    /// Polls `done` until it is true, the deadline passes, the group shuts down or a peer
    /// aborts; sends in flight make progress meanwhile.
    fn wait_until(
        &mut self,
        id: OpId,
        deadline: Instant,
        mut done: impl FnMut(&mut Self) -> bool,
    ) -> Result<(), Waited> {
        let mut polls: u32 = 0;
        let mut next_probe = Instant::now();
        loop {
            if done(self) {
                return Ok(());
            }
            if let Err((to, e)) = self.reap() {
                return Err(Waited::Comm(self.mpi_error(to, id, e)));
            }
            if self.is_shut_down() {
                return Err(Waited::Comm(self.shutdown_error(id)));
            }
            let now = Instant::now();
            if now >= next_probe {
                if let Some(e) = self.aborted(id) {
                    return Err(Waited::Comm(e));
                }
                next_probe = now + ABORT_PROBE;
            }
            if now >= deadline {
                return Err(Waited::Timeout);
            }
            raw::pause(&mut polls);
        }
    }

    /// Sends `bytes` to `peer` as one message (the caller split it).
    pub(super) fn post(&mut self, peer: usize, bytes: Vec<u8>, id: OpId) -> Result<(), CommError> {
        let Some(tags) = self.peers.get(peer).copied().flatten() else {
            return Err(self.out_of_step(peer, id, "no such peer".into()));
        };
        match raw::isend(self.mpi, bytes, (tags.process, tags.to | STREAM, peer)) {
            Ok(send) => {
                self.pending.push(send);
                Ok(())
            }
            Err(e) => Err(self.mpi_error(peer, id, e)),
        }
    }

    /// Sends `bytes` to `peer` as messages of at most `max_message` bytes.
    pub(super) fn send_bytes(
        &mut self,
        peer: usize,
        bytes: &[u8],
        id: OpId,
    ) -> Result<(), CommError> {
        self.bytes_sent += bytes.len() as u64;
        for piece in bytes.chunks(self.max_message) {
            self.post(peer, piece.to_vec(), id)?;
        }
        Ok(())
    }

    /// Receives exactly `dst.len()` bytes from `peer` (as the sender split them).
    pub(super) fn recv_bytes(
        &mut self,
        peer: usize,
        dst: &mut [u8],
        id: OpId,
    ) -> Result<(), CommError> {
        let max = self.max_message;
        for piece in dst.chunks_mut(max) {
            let expected = piece.len();
            match self.recv_one(peer, piece, id, id.deadline) {
                Ok(n) if n == expected => {}
                Ok(n) => {
                    return Err(self.out_of_step(
                        peer,
                        id,
                        format!("a message of {n} bytes where {expected} belong"),
                    ));
                }
                Err(Waited::Timeout) => return Err(self.timeout_error(id, vec![rank_of(peer)])),
                Err(Waited::Comm(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives one message of at most `dst.len()` bytes from `peer`; returns its length.
    fn recv_one(
        &mut self,
        peer: usize,
        dst: &mut [u8],
        id: OpId,
        deadline: Instant,
    ) -> Result<usize, Waited> {
        let Some(tags) = self.peers.get(peer).copied().flatten() else {
            return Err(Waited::Comm(self.out_of_step(
                peer,
                id,
                "no such peer".into(),
            )));
        };
        // SAFETY: `dst` stays borrowed (untouched by us) until the receive completed or was
        // cancelled below.
        let started = unsafe {
            raw::irecv(
                self.mpi,
                dst.as_mut_ptr(),
                dst.len(),
                tags.process,
                tags.from | STREAM,
            )
        };
        let mut recv: PendingRecv = match started {
            Ok(r) => r,
            Err(e) => return Err(Waited::Comm(self.mpi_error(peer, id, e))),
        };
        let mut got = None;
        let mut failed = None;
        let waited = self.wait_until(id, deadline, |_| match recv.test() {
            Ok(count) => {
                got = count;
                got.is_some()
            }
            // A receive that completed in error (a longer message than the step's: the
            // ranks are out of step) is the peer's, not a broken library's.
            Err(e) => {
                failed = Some(e);
                true
            }
        });
        // Cancelled if still pending (its drop), so MPI lets go of `dst` before we return.
        drop(recv);
        match (waited, failed) {
            (Ok(()), Some(e)) => Err(Waited::Comm(self.out_of_step(
                peer,
                id,
                format!("a message that does not fit its step: {e}"),
            ))),
            (Ok(()), None) => Ok(got.unwrap_or(0)),
            (Err(e), _) => Err(e),
        }
    }

    pub(super) fn encode_header(&self, seq: u64, call: &CallShape) -> Vec<u8> {
        let header = Header {
            tag: HEADER_TAG,
            generation: self.generation.0,
            seq,
            max_message: self.max_message as u64,
            call: call.clone(),
        };
        bincode::serde::encode_to_vec(&header, bincode_config())
            .expect("an op header always encodes")
    }

    /// The next header from `peer`, before `deadline`.
    pub(super) fn read_header(
        &mut self,
        peer: usize,
        id: OpId,
        deadline: Instant,
    ) -> Result<Header, Waited> {
        let mut bytes = [0u8; MAX_HEADER];
        let n = self.recv_one(peer, &mut bytes, id, deadline)?;
        match bincode::serde::decode_from_slice::<Header, _>(&bytes[..n], bincode_config()) {
            Ok((header, used)) if used == n && header.tag == HEADER_TAG => {
                if header.generation != self.generation.0 {
                    return Err(Waited::Comm(self.out_of_step(
                        peer,
                        id,
                        format!(
                            "a header of generation {} in generation {}",
                            header.generation, self.generation.0
                        ),
                    )));
                }
                if header.max_message != self.max_message as u64 {
                    return Err(Waited::Comm(self.out_of_step(
                        peer,
                        id,
                        format!(
                            "its messages are at most {} bytes, this rank's {} \
                             (MpiConfig::max_message_bytes must agree)",
                            header.max_message, self.max_message
                        ),
                    )));
                }
                Ok(header)
            }
            _ => Err(Waited::Comm(self.out_of_step(
                peer,
                id,
                format!(
                    "expected the header of {} #{}, got {n} bytes that are not one",
                    id.op, id.seq
                ),
            ))),
        }
    }

    /// Waits until every send completed.
    pub(super) fn wait_all_sent(&mut self, id: OpId) -> Result<(), CommError> {
        let waited = self.wait_until(id, id.deadline, |c| c.pending.is_empty());
        match waited {
            Ok(()) => Ok(()),
            Err(Waited::Comm(e)) => Err(e),
            Err(Waited::Timeout) => {
                // The receivers of the sends still in flight.
                let mut missing: Vec<Rank> =
                    self.pending.iter().map(|p| rank_of(p.peer())).collect();
                missing.sort_unstable();
                missing.dedup();
                Err(self.timeout_error(id, missing))
            }
        }
    }

    /// Poisons this communicator with `error` and tells every peer (MPI-3).
    pub(super) fn fail(&mut self, error: CommError) -> CommError {
        if self.failure.is_none() {
            self.failure = Some(error.clone());
            if !self.mpi.is_finalized() {
                let reason = bincode::serde::encode_to_vec(root_cause(&error), bincode_config())
                    .unwrap_or_default();
                let peers: Vec<_> = self.peers.iter().copied().enumerate().collect();
                for (r, tags) in peers {
                    let Some(tags) = tags else { continue };
                    let to = (tags.process, tags.to | ABORT, r);
                    if let Ok(send) = raw::isend(self.mpi, reason.clone(), to) {
                        self.pending.push(send);
                    }
                }
            }
        }
        error
    }
}
