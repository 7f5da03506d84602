//! The ops of an MPI rank: each exchanges headers (COMM-2), runs its share of the pure plan
//! with `MPI_Isend`/`MPI_Irecv`, and waits with a deadline (MPI-2), failing its peers fast
//! through abort messages (MPI-3).

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::raw::{self, PendingRecv};
use super::world::Live;
use super::{ABORT, MpiCommunicator, OpId, STREAM};
use crate::comm::element::{Element, as_f32_mut, combine, finish, narrow, widen};
use crate::comm::plan::{self, Plan, Step};
use crate::comm::tcp::{narrow_bytes, resolve_algorithm, sends_of_final_values};
use crate::comm::{
    Algorithm, CallShape, CollectiveKind, CommError, DType, LinkFailure, RankCall, ReduceOp,
    chunk_range,
};
use crate::mesh::Rank;

/// The largest op header accepted.
const MAX_HEADER: usize = 1024;

/// Marks a header, so a data message read where a header belongs is told apart.
const HEADER_TAG: [u8; 4] = *b"MWMP";

/// How often a wait looks for abort messages (MPI-3).
const ABORT_PROBE: Duration = Duration::from_millis(1);

/// After a time-out, how long each peer not yet heard from gets to show its header.
const PROBE: Duration = Duration::from_millis(2);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Header {
    tag: [u8; 4],
    generation: u64,
    seq: u64,
    /// The sender's largest message: a step splits into messages of this size on both sides,
    /// so every rank of a group must use the same ([`super::MpiConfig::max_message_bytes`]).
    max_message: u64,
    call: CallShape,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

fn rank_of(index: usize) -> Rank {
    Rank(u32::try_from(index).unwrap_or(u32::MAX))
}

/// The first failure behind `error`.
fn root_cause(error: &CommError) -> &CommError {
    match error {
        CommError::Poisoned { cause, .. } => root_cause(cause),
        other => other,
    }
}

/// The bytes of a slice of elements (plain bit patterns, little-endian targets only).
fn bytes_of<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: Element types have no padding and every byte is initialized.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// Why a wait ended early.
enum Waited {
    Timeout,
    Comm(CommError),
}

impl MpiCommunicator {
    fn shutdown_error(&self, id: OpId) -> CommError {
        CommError::Shutdown {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
        }
    }

    /// MPI kept live for one op (`MpiWorld::enter`), or the op's refusal once finalised.
    fn live(&self, op: CollectiveKind) -> Result<Live, CommError> {
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
    fn refusal(&self, id: OpId) -> Option<CommError> {
        if self.is_shut_down() {
            return Some(self.shutdown_error(id));
        }
        let cause = self.failure.as_ref()?;
        Some(CommError::Poisoned {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            cause: Box::new(root_cause(cause).clone()),
        })
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

    fn out_of_step(&self, peer: usize, id: OpId, detail: String) -> CommError {
        self.link(peer, id, LinkFailure::OutOfStep { detail })
    }

    fn timeout_error(&self, id: OpId, missing: Vec<Rank>) -> CommError {
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
        peer: usize,
        mut done: impl FnMut(&mut Self) -> Result<bool, super::MpiError>,
    ) -> Result<(), Waited> {
        let mut polls: u32 = 0;
        let mut next_probe = Instant::now();
        loop {
            match done(self) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(Waited::Comm(self.mpi_error(peer, id, e))),
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
            // Spin briefly (most messages are near), then back off so ranks sharing cores
            // (oversubscribed runs) leave each other time.
            polls = polls.saturating_add(1);
            if polls > 64 {
                std::thread::sleep(Duration::from_micros(u64::from(polls.min(2_000) / 10)));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Sends `bytes` to `peer` as one message (the caller split it).
    fn post(&mut self, peer: usize, bytes: Vec<u8>, id: OpId) -> Result<(), CommError> {
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
    fn send_bytes(&mut self, peer: usize, bytes: &[u8], id: OpId) -> Result<(), CommError> {
        self.bytes_sent += bytes.len() as u64;
        for piece in bytes.chunks(self.max_message) {
            self.post(peer, piece.to_vec(), id)?;
        }
        Ok(())
    }

    /// Receives exactly `dst.len()` bytes from `peer` (as the sender split them).
    fn recv_bytes(&mut self, peer: usize, dst: &mut [u8], id: OpId) -> Result<(), CommError> {
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
        let waited = self.wait_until(id, deadline, peer, |_| match recv.test() {
            Ok(count) => {
                got = count;
                Ok(got.is_some())
            }
            // A receive that completed in error (a longer message than the step's: the
            // ranks are out of step) is the peer's, not a broken library's.
            Err(e) => {
                failed = Some(e);
                Ok(true)
            }
        });
        recv.cancel();
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

    fn encode_header(&self, seq: u64, call: &CallShape) -> Vec<u8> {
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
    fn read_header(&mut self, peer: usize, id: OpId, deadline: Instant) -> Result<Header, Waited> {
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
    fn wait_all_sent(&mut self, id: OpId) -> Result<(), CommError> {
        let blamed = self.pending.first().map_or(0, raw::PendingSend::peer);
        let waited = self.wait_until(id, id.deadline, blamed, |c| Ok(c.pending.is_empty()));
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
    fn fail(&mut self, error: CommError) -> CommError {
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

    /// Stage 1 of a collective: exchange calls with every peer and check them (COMM-2).
    fn rendezvous(&mut self, call: CallShape) -> Result<OpId, CommError> {
        let id = OpId {
            seq: self.seq,
            op: call.kind,
            deadline: self.deadline(),
        };
        self.seq += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let header = self.encode_header(id.seq, &call);
        let me = self.me();
        for peer in (0..self.world).filter(|&p| p != me) {
            if let Err(e) = self.post(peer, header.clone(), id) {
                return Err(self.fail(e));
            }
        }
        let mut calls = Vec::with_capacity(self.world);
        for peer in 0..self.world {
            if peer == me {
                calls.push(RankCall {
                    rank: self.rank,
                    call: call.clone(),
                });
                continue;
            }
            match self.read_header(peer, id, id.deadline) {
                Ok(header) => {
                    let collective = !matches!(
                        header.call.kind,
                        CollectiveKind::Send | CollectiveKind::Recv
                    );
                    if header.seq != id.seq || !collective {
                        let e = self.out_of_step(
                            peer,
                            id,
                            format!(
                                "expected collective #{}, got {} #{}",
                                id.seq, header.call.kind, header.seq
                            ),
                        );
                        return Err(self.fail(e));
                    }
                    calls.push(RankCall {
                        rank: rank_of(peer),
                        call: header.call,
                    });
                }
                Err(Waited::Comm(e)) => return Err(self.fail(e)),
                Err(Waited::Timeout) => {
                    // Name every rank not heard from: probe the ones not read yet briefly.
                    let mut missing = vec![rank_of(peer)];
                    for later in (peer + 1..self.world).filter(|&p| p != me) {
                        if self.read_header(later, id, Instant::now() + PROBE).is_err() {
                            missing.push(rank_of(later));
                        }
                    }
                    let e = self.timeout_error(id, missing);
                    return Err(self.fail(e));
                }
            }
        }
        let fits = calls.iter().all(|c| {
            c.call.agrees_with(&calls[0].call)
                && c.call.is_well_formed()
                && c.call.peer.is_none_or(|p| p.index() < self.world)
        });
        if !fits {
            return Err(CommError::Mismatch {
                generation: self.generation,
                seq: id.seq,
                op: id.op,
                calls,
            });
        }
        Ok(id)
    }

    fn plan_for(
        &mut self,
        kind: CollectiveKind,
        algorithm: Algorithm,
        len: usize,
        root: Rank,
    ) -> Plan {
        match self.plan_cache.take() {
            Some((r, plan))
                if r == root
                    && plan.kind == kind
                    && plan.algorithm == algorithm
                    && plan.len == len =>
            {
                plan
            }
            _ => plan::plan(kind, algorithm, self.world, len, root).unwrap_or(Plan {
                kind,
                algorithm,
                world: self.world,
                len,
                steps: vec![Vec::new(); self.world],
            }),
        }
    }

    /// Stage 2 and 3: runs this rank's steps of the validated collective on `work`, then
    /// waits until every send completed.
    fn run(&mut self, call: &CallShape, work: &mut [f32], id: OpId) -> Result<(), CommError> {
        let root = call.peer.unwrap_or(Rank(0));
        let op = call.reduce.unwrap_or(ReduceOp::Sum);
        let algorithm = call.algorithm.unwrap_or(Algorithm::Ring);
        let plan = self.plan_for(call.kind, algorithm, call.len, root);
        self.last_algorithm = Some(algorithm);
        // TCP-7: a 16-bit op sends its final values as 16-bit.
        let finals = match call.dtype {
            Some(d @ (DType::F16 | DType::BF16)) => {
                Some((d, sends_of_final_values(&plan, self.rank)))
            }
            _ => None,
        };
        let result = self
            .execute(plan.steps_of(self.rank), finals.as_ref(), work, op, id)
            .and_then(|()| self.wait_all_sent(id));
        self.plan_cache = Some((root, plan));
        result.map_err(|e| self.fail(e))
    }

    fn execute(
        &mut self,
        steps: &[Step],
        finals: Option<&(DType, Vec<bool>)>,
        work: &mut [f32],
        op: ReduceOp,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut sends = 0;
        for step in steps {
            match step {
                Step::Send { to, range } => {
                    let final_16 = finals
                        .and_then(|(d, f)| f.get(sends).copied().unwrap_or(false).then_some(*d));
                    sends += 1;
                    let values = &work[range.clone()];
                    let bytes = match final_16 {
                        Some(dtype) => narrow_bytes(dtype, values),
                        None => bytes_of(values).to_vec(),
                    };
                    self.send_bytes(to.index(), &bytes, id)?;
                }
                Step::RecvCopy { from, range } if finals.is_some() => {
                    let dtype = finals.map_or(DType::F16, |(d, _)| *d);
                    self.recv_widened(from.index(), &mut work[range.clone()], dtype, id)?;
                }
                Step::RecvCopy { from, range } => {
                    let dst = as_bytes_mut(&mut work[range.clone()]);
                    self.recv_bytes(from.index(), dst, id)?;
                }
                Step::RecvReduce { from, range } => {
                    let mut scratch = std::mem::take(&mut self.scratch);
                    scratch.clear();
                    scratch.resize(range.len() * 4, 0);
                    let result = self.recv_bytes(from.index(), &mut scratch, id);
                    if result.is_ok() {
                        reduce_bytes(&mut work[range.clone()], &scratch, op);
                    }
                    self.scratch = scratch;
                    result?;
                }
                Step::Finish { range } => finish(&mut work[range.clone()], op, self.world),
                Step::ReducePeers { .. } | Step::CopyFrom { .. } | Step::Barrier => {
                    unreachable!("an MPI group runs ring and tree plans only")
                }
            }
        }
        Ok(())
    }

    /// Receives a 16-bit op's final values from `peer` and widens them into `dst` (TCP-7).
    fn recv_widened(
        &mut self,
        peer: usize,
        dst: &mut [f32],
        dtype: DType,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.resize(dst.len() * 2, 0);
        let result = self.recv_bytes(peer, &mut scratch, id);
        if result.is_ok() {
            for (v, b) in dst.iter_mut().zip(scratch.chunks_exact(2)) {
                let bits = u16::from_le_bytes([b[0], b[1]]);
                *v = match dtype {
                    DType::BF16 => half::bf16::from_bits(bits).to_f32(),
                    _ => half::f16::from_bits(bits).to_f32(),
                };
            }
        }
        self.scratch = scratch;
        result
    }

    fn take_work(&mut self, len: usize) -> Vec<f32> {
        let mut work = std::mem::take(&mut self.work);
        work.clear();
        work.resize(len, 0.0);
        work
    }

    fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm {
        resolve_algorithm(
            self.algorithm,
            kind,
            self.world,
            len.saturating_mul(T::DTYPE.size_bytes()),
        )
    }

    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let call = CallShape::all_reduce::<T>(
            self.resolve::<T>(CollectiveKind::AllReduce, buf.len()),
            buf.len(),
            op,
        );
        self.in_place(call, buf)
    }

    pub(crate) fn broadcast<T: Element>(
        &mut self,
        buf: &mut [T],
        root: Rank,
    ) -> Result<(), CommError> {
        let call = CallShape::broadcast::<T>(
            self.resolve::<T>(CollectiveKind::Broadcast, buf.len()),
            buf.len(),
            root,
        );
        self.in_place(call, buf)
    }

    fn in_place<T: Element>(&mut self, call: CallShape, buf: &mut [T]) -> Result<(), CommError> {
        let _live = self.live(call.kind)?;
        let id = self.rendezvous(call.clone())?;
        if let Some(values) = as_f32_mut(buf) {
            return self.run(&call, values, id);
        }
        let mut work = self.take_work(buf.len());
        widen(&mut work, buf);
        let result = self.run(&call, &mut work, id);
        if result.is_ok() {
            narrow(buf, &work);
        }
        self.work = work;
        result
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let len = input.len();
        let mine = chunk_range(len, self.world, self.me());
        let call = CallShape::reduce_scatter::<T>(
            self.resolve::<T>(CollectiveKind::ReduceScatter, len),
            len,
            (output.len(), mine.len()),
            op,
        );
        let _live = self.live(call.kind)?;
        let id = self.rendezvous(call.clone())?;
        let mut work = self.take_work(len);
        widen(&mut work, input);
        let result = self.run(&call, &mut work, id);
        if result.is_ok() {
            narrow(output, &work[mine]);
        }
        self.work = work;
        result
    }

    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let len = output.len();
        let mine: Range<usize> = chunk_range(len, self.world, self.me());
        let call = CallShape::all_gather::<T>(
            self.resolve::<T>(CollectiveKind::AllGather, len),
            len,
            (input.len(), mine.len()),
        );
        let _live = self.live(call.kind)?;
        let id = self.rendezvous(call.clone())?;
        if let Some(values) = as_f32_mut(output) {
            widen(&mut values[mine], input);
            return self.run(&call, values, id);
        }
        let mut work = self.take_work(len);
        widen(&mut work[mine], input);
        let result = self.run(&call, &mut work, id);
        if result.is_ok() {
            narrow(output, &work);
        }
        self.work = work;
        result
    }

    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        let _live = self.live(CollectiveKind::Barrier)?;
        self.rendezvous(CallShape::barrier()).map(|_| ())
    }

    fn check_peer(&self, op: CollectiveKind, peer: Rank) -> Result<usize, CommError> {
        let p = peer.index();
        if p >= self.world || p == self.me() {
            return Err(CommError::InvalidPeer {
                generation: self.generation,
                op,
                rank: self.rank,
                peer,
                world: self.world,
            });
        }
        Ok(p)
    }

    /// The peer's answer to a send or recv header: its call, checked to be the matching op.
    fn p2p_header(
        &mut self,
        peer: usize,
        expect: CollectiveKind,
        id: OpId,
    ) -> Result<CallShape, CommError> {
        match self.read_header(peer, id, id.deadline) {
            Ok(header)
                if header.seq == id.seq
                    && header.call.kind == expect
                    && header.call.peer == Some(self.rank) =>
            {
                Ok(header.call)
            }
            Ok(header) => Err(self.out_of_step(
                peer,
                id,
                format!(
                    "expected {expect} #{}, got {} #{}",
                    id.seq, header.call.kind, header.seq
                ),
            )),
            Err(Waited::Timeout) => Err(self.timeout_error(id, vec![rank_of(peer)])),
            Err(Waited::Comm(e)) => Err(e),
        }
    }

    fn p2p_mismatch(&self, id: OpId, peer: usize, mine: CallShape, theirs: CallShape) -> CommError {
        let mut calls = vec![
            RankCall {
                rank: self.rank,
                call: mine,
            },
            RankCall {
                rank: rank_of(peer),
                call: theirs,
            },
        ];
        calls.sort_by_key(|c| c.rank);
        CommError::Mismatch {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            calls,
        }
    }

    pub(crate) fn send<T: Element>(&mut self, buf: &[T], to: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Send;
        let peer = self.check_peer(op, to)?;
        let _live = self.live(op)?;
        let id = OpId {
            seq: self.sent[peer],
            op,
            deadline: self.deadline(),
        };
        self.sent[peer] += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let mine = CallShape::point_to_point::<T>(op, buf.len(), to);
        let header = self.encode_header(id.seq, &mine);
        let result = (|| {
            self.post(peer, header, id)?;
            let theirs = self.p2p_header(peer, CollectiveKind::Recv, id)?;
            if theirs.dtype != mine.dtype || theirs.len != mine.len {
                self.wait_all_sent(id)?;
                return Ok(Err(self.p2p_mismatch(id, peer, mine, theirs)));
            }
            self.send_bytes(peer, bytes_of(buf), id)?;
            self.wait_all_sent(id)?;
            Ok(Ok(()))
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => Err(self.fail(e)),
        }
    }

    pub(crate) fn recv<T: Element>(&mut self, buf: &mut [T], from: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Recv;
        let peer = self.check_peer(op, from)?;
        let _live = self.live(op)?;
        let id = OpId {
            seq: self.received[peer],
            op,
            deadline: self.deadline(),
        };
        self.received[peer] += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let mine = CallShape::point_to_point::<T>(op, buf.len(), from);
        let result = (|| {
            let theirs = self.p2p_header(peer, CollectiveKind::Send, id)?;
            let header = self.encode_header(id.seq, &mine);
            self.post(peer, header, id)?;
            if theirs.dtype != mine.dtype || theirs.len != mine.len {
                self.wait_all_sent(id)?;
                return Ok(Err(self.p2p_mismatch(id, peer, mine.clone(), theirs)));
            }
            // SAFETY: Element types are plain bit patterns of their size: any bytes are a value.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    buf.as_mut_ptr().cast::<u8>(),
                    std::mem::size_of_val(buf),
                )
            };
            self.recv_bytes(peer, dst, id)?;
            self.wait_all_sent(id)?;
            Ok(Ok(()))
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// The bytes of an f32 slice, writable.
fn as_bytes_mut(values: &mut [f32]) -> &mut [u8] {
    // SAFETY: every byte pattern is a valid f32; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), values.len() * 4) }
}

/// Combines the little-endian f32s in `bytes` into `dst` with `op`.
fn reduce_bytes(dst: &mut [f32], bytes: &[u8], op: ReduceOp) {
    let mut piece = [0f32; 256];
    for (d, b) in dst.chunks_mut(256).zip(bytes.chunks(1024)) {
        let n = d.len();
        for (v, c) in piece[..n].iter_mut().zip(b.chunks_exact(4)) {
            *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        combine(d, &piece[..n], op);
    }
}
