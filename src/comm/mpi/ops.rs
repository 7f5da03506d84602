//! The ops of an MPI rank: each exchanges headers (COMM-2), runs its share of the pure plan
//! over the messages of `messages`, and fails its peers fast through abort messages (MPI-3);
//! the collectives' front ends are the cross-process transports' shared ones (`comm::cross`).

use super::messages::{PROBE, Waited};
use super::world::Live;
use super::{MpiCommunicator, OpId};
use crate::comm::cross::{self, bytes_of, rank_of};
use crate::comm::element::bits16::{narrow_to_bytes, round_in_place, widen_bytes_into};
use crate::comm::element::{Element, combine, finish};
use crate::comm::plan::wire::Narrowing;
use crate::comm::plan::{self, Plan, Step};
use crate::comm::tcp::resolve_algorithm;
use crate::comm::{
    Algorithm, CallShape, CollectiveKind, CommError, DType, PartialSums, RankCall, ReduceOp,
};
use crate::mesh::Rank;
use std::time::Instant;

impl MpiCommunicator {
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
        if !cross::calls_fit(&calls, self.world) {
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
        // TCP-7, COMM-9: a 16-bit op sends its final values (and, asked, its partial sums)
        // as 16-bit.
        let narrow = Narrowing::of(call, &plan, self.rank);
        let result = self
            .execute(plan.steps_of(self.rank), narrow.as_ref(), work, op, id)
            .and_then(|()| self.wait_all_sent(id));
        self.plan_cache = Some((root, plan));
        result.map_err(|e| self.fail(e))
    }

    fn execute(
        &mut self,
        steps: &[Step],
        narrow: Option<&Narrowing>,
        work: &mut [f32],
        op: ReduceOp,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut sends = 0;
        for step in steps {
            match step {
                Step::Send { to, range } => {
                    let narrow_16 = narrow.and_then(|n| n.send(sends));
                    sends += 1;
                    let values = &mut work[range.clone()];
                    if let Some(dtype) = narrow_16
                        && narrow.is_some_and(Narrowing::rounds_in_place)
                    {
                        round_in_place(dtype, values);
                    }
                    let bytes = match narrow_16 {
                        Some(dtype) => narrow_to_bytes(dtype, values),
                        None => bytes_of(values).to_vec(),
                    };
                    self.send_bytes(to.index(), &bytes, id)?;
                }
                Step::RecvCopy { from, range } | Step::RecvReduce { from, range } => {
                    let reduce = matches!(step, Step::RecvReduce { .. }).then_some(op);
                    let (from, dst) = (from.index(), &mut work[range.clone()]);
                    match (narrow.and_then(|n| n.recv(reduce.is_some())), reduce) {
                        (Some(dtype), _) => self.recv_widened(from, dst, dtype, reduce, id)?,
                        (None, None) => self.recv_bytes(from, as_bytes_mut(dst), id)?,
                        (None, Some(op)) => {
                            let mut scratch = std::mem::take(&mut self.scratch);
                            scratch.clear();
                            scratch.resize(dst.len() * 4, 0);
                            let result = self.recv_bytes(from, &mut scratch, id);
                            if result.is_ok() {
                                reduce_bytes(dst, &scratch, op);
                            }
                            self.scratch = scratch;
                            result?;
                        }
                    }
                }
                Step::Finish { range } => finish(&mut work[range.clone()], op, self.world),
                Step::ReducePeers { .. } | Step::CopyFrom { .. } | Step::Barrier => {
                    unreachable!("an MPI group runs ring and tree plans only")
                }
            }
        }
        Ok(())
    }

    /// Receives a 16-bit op's values from `peer` and widens them into `dst`: copied (final
    /// values, TCP-7) or reduced with `op` (partial sums, COMM-9).
    fn recv_widened(
        &mut self,
        peer: usize,
        dst: &mut [f32],
        dtype: DType,
        op: Option<ReduceOp>,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        scratch.resize(dst.len() * 2, 0);
        let result = self.recv_bytes(peer, &mut scratch, id);
        if result.is_ok() {
            widen_bytes_into(dtype, &scratch, dst, op);
        }
        self.scratch = scratch;
        result
    }

    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        cross::all_reduce(self, buf, op)
    }

    pub(crate) fn broadcast<T: Element>(
        &mut self,
        buf: &mut [T],
        root: Rank,
    ) -> Result<(), CommError> {
        cross::broadcast(self, buf, root)
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        cross::reduce_scatter(self, input, output, op)
    }

    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        cross::all_gather(self, input, output)
    }

    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        let _live = self.live(CollectiveKind::Barrier)?;
        self.rendezvous(CallShape::barrier()).map(|_| ())
    }

    fn check_peer(&self, op: CollectiveKind, peer: Rank) -> Result<usize, CommError> {
        cross::check_peer((self.generation, self.rank, self.world), op, peer)
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
        cross::p2p_mismatch(
            (self.generation, id.seq, id.op),
            RankCall {
                rank: self.rank,
                call: mine,
            },
            RankCall {
                rank: rank_of(peer),
                call: theirs,
            },
        )
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

impl cross::PlanTransport for MpiCommunicator {
    /// The op's id, and MPI kept live until its plan ran (`MpiWorld::enter`).
    type Op = (OpId, Live);

    fn world(&self) -> usize {
        self.world
    }

    fn me(&self) -> usize {
        self.rank.index()
    }

    fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm {
        resolve_algorithm(
            self.algorithm,
            kind,
            self.world,
            len.saturating_mul(T::DTYPE.size_bytes()),
        )
    }

    fn partial_sums(&self) -> PartialSums {
        self.partial_sums
    }

    fn start(&mut self, call: CallShape) -> Result<Self::Op, CommError> {
        let live = self.live(call.kind)?;
        self.rendezvous(call).map(|id| (id, live))
    }

    fn run_plan(
        &mut self,
        call: &CallShape,
        work: &mut [f32],
        (id, _live): &Self::Op,
    ) -> Result<(), CommError> {
        self.run(call, work, *id)
    }

    fn work(&mut self) -> &mut Vec<f32> {
        &mut self.work
    }
}
