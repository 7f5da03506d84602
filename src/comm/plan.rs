//! Pure plans: which chunk each rank moves where, for every collective and algorithm. No
//! threads, no I/O; [`simulate`] runs a plan sequentially on `f64` buffers so every plan can be
//! checked against a reference on its own.
//!
//! A plan starts once every rank has arrived (the transport's rendezvous) and works on one
//! conceptual buffer per rank of the op's full length `len`:
//! - all-reduce: the rank's buffer;
//! - reduce-scatter: the rank's input; the result is its chunk ([`chunk_range`]);
//! - all-gather: the output, with the rank's own chunk filled from its input beforehand;
//! - broadcast: the rank's buffer; the root's is the source.
//!
//! Invariants:
//! - PLAN-1: a send step and its receive step name the same range, in the same order per
//!   (sender, receiver) pair, so every message is consumed by exactly one receive.
//! - PLAN-2: sends never block (messages are buffered), so a plan is deadlock-free when its
//!   receives can be ordered after their sends; [`simulate`] checks it.
//! - PLAN-3: between two [`Step::Barrier`]s, no rank reads a range of a peer's buffer that the
//!   peer writes; [`simulate`] checks it. Each rank writes only its own buffer.
//! - PLAN-4: every rank ends with bit-identical reduced values (reductions of the same
//!   operands, commutative combination only).

use std::collections::VecDeque;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::{Algorithm, CallShape, CollectiveKind, DType, PartialSums, ReduceOp, chunk_range};
use crate::mesh::Rank;

/// One step of one rank's part of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    /// Send `range` of my buffer to `to` (buffered: never waits).
    Send {
        /// The receiver.
        to: Rank,
        /// Elements of my buffer.
        range: Range<usize>,
    },
    /// Receive `range` from `from` and combine it into my buffer with the reduce op.
    RecvReduce {
        /// The sender.
        from: Rank,
        /// Elements of my buffer.
        range: Range<usize>,
    },
    /// Receive `range` from `from` and overwrite my buffer with it.
    RecvCopy {
        /// The sender.
        from: Rank,
        /// Elements of my buffer.
        range: Range<usize>,
    },
    /// Reduce `range` of every rank's buffer (mine first, then peers in rank order), read in
    /// place, into my buffer, then [`Step::Finish`] it.
    ReducePeers {
        /// Elements of every buffer.
        range: Range<usize>,
    },
    /// Copy `range` of `from`'s buffer, read in place, into mine.
    CopyFrom {
        /// The rank read from.
        from: Rank,
        /// Elements of both buffers.
        range: Range<usize>,
    },
    /// Apply the reduce op's last step to `range` (divide by the world size for Mean).
    Finish {
        /// Elements of my buffer.
        range: Range<usize>,
    },
    /// Wait until every rank reached this barrier.
    Barrier,
}

/// A plan: one list of steps per rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The collective.
    pub kind: CollectiveKind,
    /// The algorithm (never [`Algorithm::Auto`]).
    pub algorithm: Algorithm,
    /// Ranks in the group.
    pub world: usize,
    /// Elements in the full buffer.
    pub len: usize,
    /// `steps[r]` is rank r's list.
    pub steps: Vec<Vec<Step>>,
}

impl Plan {
    /// Rank `rank`'s steps (empty if out of range).
    pub fn steps_of(&self, rank: Rank) -> &[Step] {
        self.steps.get(rank.index()).map_or(&[], Vec::as_slice)
    }

    /// Bytes each rank puts on the wire when the op's buffer is of `dtype` and its partial sums
    /// travel as `partial_sums` says: what every transport counts and an emulated link waits
    /// for (f32: 4 bytes an element; f16/bf16: final values 2, partial sums 4, or 2 with
    /// 16-bit partial sums; TCP-7, COMM-9).
    pub fn bytes_sent(&self, dtype: DType, partial_sums: PartialSums) -> Vec<usize> {
        let call = CallShape {
            kind: self.kind,
            dtype: Some(dtype),
            algorithm: Some(self.algorithm),
            len: self.len,
            chunk_len: None,
            expected_chunk_len: None,
            peer: None,
            reduce: matches!(
                self.kind,
                CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
            )
            .then_some(ReduceOp::Sum),
            narrow_partials: false,
        }
        .with_partial_sums(partial_sums);
        (0..self.world)
            .map(|r| {
                let rank = Rank(u32::try_from(r).unwrap_or(u32::MAX));
                let narrow = wire::Narrowing::of(&call, self, rank);
                self.steps_of(rank)
                    .iter()
                    .filter_map(|s| match s {
                        Step::Send { range, .. } => Some(range.len()),
                        _ => None,
                    })
                    .enumerate()
                    .map(|(nth, len)| narrow.as_ref().map_or(4 * len, |n| n.send_bytes(nth, len)))
                    .sum()
            })
            .collect()
    }

    /// Elements each rank sends in messages.
    pub fn elements_sent(&self) -> Vec<usize> {
        self.steps
            .iter()
            .map(|steps| {
                steps
                    .iter()
                    .map(|s| match s {
                        Step::Send { range, .. } => range.len(),
                        _ => 0,
                    })
                    .sum()
            })
            .collect()
    }
}

/// Buffers at most this many bytes go to [`Algorithm::Tree`] under [`Algorithm::Auto`].
pub const SMALL_BUFFER_BYTES: usize = 16 * 1024;

/// The algorithm [`Algorithm::Auto`] resolves to: in one process [`Algorithm::Direct`] (no
/// message copies) for anything but small buffers in groups of more than two, where the log2(N)
/// rounds of [`Algorithm::Tree`] need fewer synchronizations. A concrete `requested` algorithm
/// is returned unchanged.
pub fn choose(requested: Algorithm, kind: CollectiveKind, world: usize, bytes: usize) -> Algorithm {
    if requested != Algorithm::Auto {
        return requested;
    }
    match kind {
        CollectiveKind::AllReduce
        | CollectiveKind::ReduceScatter
        | CollectiveKind::AllGather
        | CollectiveKind::Broadcast
            if world > 2 && bytes <= SMALL_BUFFER_BYTES =>
        {
            Algorithm::Tree
        }
        _ => Algorithm::Direct,
    }
}

/// The plan of `kind` with `algorithm` (Auto resolves as for a 4-byte element) for `world`
/// ranks and `len` elements; `root` is the broadcast root (ignored otherwise). `None` for
/// kinds without a data plan (barrier, send, recv) or a root outside the group.
pub fn plan(
    kind: CollectiveKind,
    algorithm: Algorithm,
    world: usize,
    len: usize,
    root: Rank,
) -> Option<Plan> {
    let world = world.max(1);
    let algorithm = choose(algorithm, kind, world, len.saturating_mul(4));
    let steps = match (kind, algorithm) {
        (CollectiveKind::AllReduce, Algorithm::Ring) => ring_all_reduce(world, len),
        (CollectiveKind::AllReduce, Algorithm::Tree) => doubling_all_reduce(world, len),
        (CollectiveKind::AllReduce, _) => direct_all_reduce(world, len),
        (CollectiveKind::ReduceScatter, Algorithm::Ring) => ring_reduce_scatter(world, len),
        // Latency-optimal: a full all-reduce of a small buffer, then keep my chunk.
        (CollectiveKind::ReduceScatter, Algorithm::Tree) => doubling_all_reduce(world, len),
        (CollectiveKind::ReduceScatter, _) => direct_reduce_scatter(world, len),
        (CollectiveKind::AllGather, Algorithm::Ring) => ring_all_gather(world, len),
        (CollectiveKind::AllGather, Algorithm::Tree) => doubling_all_gather(world, len),
        (CollectiveKind::AllGather, _) => direct_all_gather(world, len),
        (CollectiveKind::Broadcast, _) if root.index() >= world => return None,
        (CollectiveKind::Broadcast, Algorithm::Ring) => ring_broadcast(world, len, root),
        (CollectiveKind::Broadcast, Algorithm::Tree) => tree_broadcast(world, len, root),
        (CollectiveKind::Broadcast, _) => direct_broadcast(world, len, root),
        _ => return None,
    };
    Some(Plan {
        kind,
        algorithm,
        world,
        len,
        steps,
    })
}

fn rank(index: usize) -> Rank {
    Rank(u32::try_from(index).unwrap_or(u32::MAX))
}

/// Chunk `c` (taken modulo `world`, from a possibly negative offset).
fn chunk(len: usize, world: usize, c: isize) -> Range<usize> {
    let w = world as isize;
    chunk_range(len, world, c.rem_euclid(w) as usize)
}

fn push_send(steps: &mut Vec<Step>, to: usize, range: Range<usize>) {
    if !range.is_empty() {
        steps.push(Step::Send {
            to: rank(to),
            range,
        });
    }
}

fn push_recv(steps: &mut Vec<Step>, from: usize, range: Range<usize>, reduce: bool) {
    if range.is_empty() {
        return;
    }
    let from = rank(from);
    steps.push(if reduce {
        Step::RecvReduce { from, range }
    } else {
        Step::RecvCopy { from, range }
    });
}

/// Ring reduce-scatter phase: after it rank r holds the reduced chunk r.
fn ring_reduce_phase(steps: &mut Vec<Step>, world: usize, len: usize, r: usize) {
    let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
    let ri = r as isize;
    for s in 0..world.saturating_sub(1) as isize {
        push_send(steps, next, chunk(len, world, ri - s - 1));
        push_recv(steps, prev, chunk(len, world, ri - s - 2), true);
    }
}

/// Ring all-gather phase: rank r starts with chunk r and ends with all of them.
fn ring_gather_phase(steps: &mut Vec<Step>, world: usize, len: usize, r: usize) {
    let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
    let ri = r as isize;
    for s in 0..world.saturating_sub(1) as isize {
        push_send(steps, next, chunk(len, world, ri - s));
        push_recv(steps, prev, chunk(len, world, ri - s - 1), false);
    }
}

/// Ring all-reduce: reduce-scatter then all-gather around the ring; each rank sends
/// 2(N−1) chunks, i.e. 2(N−1)/N of the buffer up to chunk rounding.
pub fn ring_all_reduce(world: usize, len: usize) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            let mut steps = Vec::new();
            ring_reduce_phase(&mut steps, world, len, r);
            let mine = chunk_range(len, world, r);
            if !mine.is_empty() {
                steps.push(Step::Finish { range: mine });
            }
            ring_gather_phase(&mut steps, world, len, r);
            steps
        })
        .collect()
}

/// Ring reduce-scatter: the first phase of [`ring_all_reduce`]; rank r ends with chunk r.
pub fn ring_reduce_scatter(world: usize, len: usize) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            let mut steps = Vec::new();
            ring_reduce_phase(&mut steps, world, len, r);
            let mine = chunk_range(len, world, r);
            if !mine.is_empty() {
                steps.push(Step::Finish { range: mine });
            }
            steps
        })
        .collect()
}

/// Ring all-gather: the second phase of [`ring_all_reduce`].
pub fn ring_all_gather(world: usize, len: usize) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            let mut steps = Vec::new();
            ring_gather_phase(&mut steps, world, len, r);
            steps
        })
        .collect()
}

/// Ring broadcast: the buffer flows chunk by chunk from the root around the ring, so chunks
/// pipeline.
pub fn ring_broadcast(world: usize, len: usize, root: Rank) -> Vec<Vec<Step>> {
    let root = root.index();
    (0..world)
        .map(|r| {
            let (next, prev) = ((r + 1) % world, (r + world - 1) % world);
            let mut steps = Vec::new();
            for c in 0..world {
                let range = chunk_range(len, world, c);
                if r != root {
                    push_recv(&mut steps, prev, range.clone(), false);
                }
                if next != root {
                    push_send(&mut steps, next, range);
                }
            }
            steps
        })
        .collect()
}

/// Largest power of two ≤ `world` (world ≥ 1).
fn core_size(world: usize) -> usize {
    1 << (usize::BITS - 1 - world.max(1).leading_zeros())
}

/// Recursive doubling all-reduce. With `p` the largest power of two ≤ N, ranks `p..N` first
/// fold into ranks `0..N−p`, the `p` core ranks exchange whole buffers in log2(p) rounds,
/// then the folded ranks get the result back.
pub fn doubling_all_reduce(world: usize, len: usize) -> Vec<Vec<Step>> {
    let p = core_size(world);
    let all = 0..len;
    (0..world)
        .map(|r| {
            let mut steps = Vec::new();
            if r >= p {
                push_send(&mut steps, r - p, all.clone());
                push_recv(&mut steps, r - p, all.clone(), false);
                return steps;
            }
            if r + p < world {
                push_recv(&mut steps, r + p, all.clone(), true);
            }
            let mut mask = 1;
            while mask < p {
                let partner = r ^ mask;
                push_send(&mut steps, partner, all.clone());
                push_recv(&mut steps, partner, all.clone(), true);
                mask <<= 1;
            }
            if !all.is_empty() {
                steps.push(Step::Finish { range: all.clone() });
            }
            if r + p < world {
                push_send(&mut steps, r + p, all.clone());
            }
            steps
        })
        .collect()
}

/// Contiguous ranges covering the chunks in `held` (sorted chunk indices).
fn ranges_of(held: &[bool], len: usize, world: usize) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for (c, _) in held.iter().enumerate().filter(|(_, h)| **h) {
        let range = chunk_range(len, world, c);
        if range.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => out.push(range),
        }
    }
    out
}

/// Recursive doubling all-gather: like [`doubling_all_reduce`], but each round exchanges the
/// chunks a rank holds so far instead of whole buffers.
pub fn doubling_all_gather(world: usize, len: usize) -> Vec<Vec<Step>> {
    let p = core_size(world);
    // held[r][c]: core rank r holds chunk c at the current round.
    let mut held: Vec<Vec<bool>> = (0..p)
        .map(|r| {
            (0..world)
                .map(|c| c == r || (r + p < world && c == r + p))
                .collect()
        })
        .collect();
    let mut steps: Vec<Vec<Step>> = vec![Vec::new(); world];
    for r in p..world {
        push_send(&mut steps[r], r - p, chunk_range(len, world, r));
        push_recv(&mut steps[r - p], r, chunk_range(len, world, r), false);
    }
    let mut mask = 1;
    while mask < p {
        for r in 0..p {
            let partner = r ^ mask;
            for range in ranges_of(&held[r], len, world) {
                push_send(&mut steps[r], partner, range);
            }
            for range in ranges_of(&held[partner], len, world) {
                push_recv(&mut steps[r], partner, range, false);
            }
        }
        let before = held.clone();
        for r in 0..p {
            let partner = r ^ mask;
            for c in 0..world {
                held[r][c] = before[r][c] || before[partner][c];
            }
        }
        mask <<= 1;
    }
    for r in p..world {
        push_send(&mut steps[r - p], r, 0..len);
        push_recv(&mut steps[r], r - p, 0..len, false);
    }
    steps
}

/// Binomial-tree broadcast from `root`: log2(N) rounds, the farthest subtree served first.
pub fn tree_broadcast(world: usize, len: usize, root: Rank) -> Vec<Vec<Step>> {
    let root = root.index();
    (0..world)
        .map(|r| {
            let v = (r + world - root) % world; // my position relative to the root
            let actual = |v: usize| (v + root) % world;
            let mut steps = Vec::new();
            // Children of v are v + 2^k for 2^k above v's highest set bit.
            let first_bit = if v == 0 {
                1
            } else {
                let parent = v & !(1 << (usize::BITS - 1 - v.leading_zeros()));
                push_recv(&mut steps, actual(parent), 0..len, false);
                1 << (usize::BITS - v.leading_zeros())
            };
            let mut bits = Vec::new();
            let mut bit = first_bit;
            while v + bit < world {
                bits.push(bit);
                bit <<= 1;
            }
            for bit in bits.into_iter().rev() {
                push_send(&mut steps, actual(v + bit), 0..len);
            }
            steps
        })
        .collect()
}

/// Direct all-reduce: each rank reduces its chunk from all buffers in place, barrier, then
/// copies the other chunks from their owners, barrier (so no buffer is read after its owner
/// returns).
pub fn direct_all_reduce(world: usize, len: usize) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            let mut steps = vec![Step::ReducePeers {
                range: chunk_range(len, world, r),
            }];
            steps.push(Step::Barrier);
            for p in (0..world).filter(|&p| p != r) {
                let range = chunk_range(len, world, p);
                if !range.is_empty() {
                    steps.push(Step::CopyFrom {
                        from: rank(p),
                        range,
                    });
                }
            }
            steps.push(Step::Barrier);
            steps
        })
        .collect()
}

/// Direct reduce-scatter: the first phase of [`direct_all_reduce`], then a barrier.
pub fn direct_reduce_scatter(world: usize, len: usize) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            vec![
                Step::ReducePeers {
                    range: chunk_range(len, world, r),
                },
                Step::Barrier,
            ]
        })
        .collect()
}

/// Direct all-gather: copy every other rank's chunk from its buffer, then a barrier.
pub fn direct_all_gather(world: usize, len: usize) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            let mut steps: Vec<Step> = (0..world)
                .filter(|&p| p != r)
                .map(|p| (p, chunk_range(len, world, p)))
                .filter(|(_, range)| !range.is_empty())
                .map(|(p, range)| Step::CopyFrom {
                    from: rank(p),
                    range,
                })
                .collect();
            steps.push(Step::Barrier);
            steps
        })
        .collect()
}

/// Direct broadcast: every rank copies the root's buffer, then a barrier.
pub fn direct_broadcast(world: usize, len: usize, root: Rank) -> Vec<Vec<Step>> {
    (0..world)
        .map(|r| {
            let mut steps = Vec::new();
            if r != root.index() && len > 0 {
                steps.push(Step::CopyFrom {
                    from: root,
                    range: 0..len,
                });
            }
            steps.push(Step::Barrier);
            steps
        })
        .collect()
}

/// Why a plan cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanSimError {
    /// The inputs do not match the plan (count or lengths).
    #[error("inputs do not fit the plan: {0}")]
    BadInput(String),
    /// A step names a range outside the buffer or a rank outside the group.
    #[error("{rank} step {step}: out of bounds")]
    OutOfBounds {
        /// The rank.
        rank: Rank,
        /// Index of the step in its list.
        step: usize,
    },
    /// Every unfinished rank waits for a message that never comes (or ranks disagree on the
    /// number of barriers).
    #[error("deadlock: ranks {waiting:?} wait forever")]
    Deadlock {
        /// The ranks still waiting.
        waiting: Vec<Rank>,
    },
    /// A message's length differs from the receive that consumed it (PLAN-1).
    #[error("{receiver} received {got} elements from {sender} but expected {expected}")]
    LengthMismatch {
        /// The sender.
        sender: Rank,
        /// The receiver.
        receiver: Rank,
        /// Elements sent.
        got: usize,
        /// Elements expected.
        expected: usize,
    },
    /// Messages were left unreceived at the end (PLAN-1).
    #[error("{0} messages were never received")]
    Unconsumed(usize),
    /// A rank read a range of a peer's buffer that the peer wrote between the same barriers
    /// (PLAN-3).
    #[error("{reader} reads {owner}'s {range:?} while {owner} writes it")]
    Race {
        /// The reading rank.
        reader: Rank,
        /// The buffer's owner.
        owner: Rank,
        /// The overlapping range.
        range: Range<usize>,
    },
}

fn combine64(a: f64, b: f64, op: ReduceOp) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

fn finish64(a: f64, op: ReduceOp, world: usize) -> f64 {
    if op == ReduceOp::Mean {
        a / world as f64
    } else {
        a
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Runs `plan` sequentially on one `f64` buffer per rank and returns the buffers at the end.
/// Messages are buffered (PLAN-2); in-place reads between barriers see the buffers as they
/// were at the last barrier, and a read of a range its owner writes in the same phase is a
/// [`PlanSimError::Race`] (PLAN-3).
pub fn simulate(
    plan: &Plan,
    inputs: &[Vec<f64>],
    op: ReduceOp,
) -> Result<Vec<Vec<f64>>, PlanSimError> {
    let world = plan.world;
    if inputs.len() != world || plan.steps.len() != world {
        return Err(PlanSimError::BadInput(format!(
            "{} inputs and {} step lists for world {world}",
            inputs.len(),
            plan.steps.len()
        )));
    }
    if let Some(bad) = inputs.iter().position(|b| b.len() != plan.len) {
        return Err(PlanSimError::BadInput(format!(
            "input {bad} has {} elements, plan has {}",
            inputs[bad].len(),
            plan.len
        )));
    }
    let mut bufs = inputs.to_vec();
    // channels[from * world + to]
    let mut channels: Vec<VecDeque<Vec<f64>>> = vec![VecDeque::new(); world * world];
    let mut pc = vec![0usize; world];
    loop {
        // One phase: run every rank up to its next barrier (or its end).
        let snapshot = bufs.clone();
        let mut writes: Vec<(usize, Range<usize>)> = Vec::new();
        let mut reads: Vec<(usize, usize, Range<usize>)> = Vec::new();
        let mut at_barrier = vec![false; world];
        loop {
            let mut progress = false;
            for r in 0..world {
                while !at_barrier[r] && pc[r] < plan.steps[r].len() {
                    let i = pc[r];
                    let step = &plan.steps[r][i];
                    let oob = PlanSimError::OutOfBounds {
                        rank: rank(r),
                        step: i,
                    };
                    let check = |range: &Range<usize>, peer: Option<Rank>| {
                        range.start <= range.end
                            && range.end <= plan.len
                            && peer.is_none_or(|p| p.index() < world && p.index() != r)
                    };
                    match step {
                        Step::Barrier => {
                            at_barrier[r] = true;
                            break;
                        }
                        Step::Send { to, range } => {
                            if !check(range, Some(*to)) {
                                return Err(oob);
                            }
                            channels[r * world + to.index()]
                                .push_back(bufs[r][range.clone()].to_vec());
                        }
                        Step::RecvReduce { from, range } | Step::RecvCopy { from, range } => {
                            if !check(range, Some(*from)) {
                                return Err(oob);
                            }
                            let Some(msg) = channels[from.index() * world + r].pop_front() else {
                                break; // blocked
                            };
                            if msg.len() != range.len() {
                                return Err(PlanSimError::LengthMismatch {
                                    sender: *from,
                                    receiver: rank(r),
                                    got: msg.len(),
                                    expected: range.len(),
                                });
                            }
                            let reduce = matches!(step, Step::RecvReduce { .. });
                            for (d, s) in bufs[r][range.clone()].iter_mut().zip(msg) {
                                *d = if reduce { combine64(*d, s, op) } else { s };
                            }
                        }
                        Step::ReducePeers { range } => {
                            if !check(range, None) {
                                return Err(oob);
                            }
                            for i in range.clone() {
                                let mut acc = snapshot[r][i];
                                for (p, buf) in snapshot.iter().enumerate() {
                                    if p != r {
                                        acc = combine64(acc, buf[i], op);
                                    }
                                }
                                bufs[r][i] = finish64(acc, op, world);
                            }
                            for p in (0..world).filter(|&p| p != r) {
                                reads.push((r, p, range.clone()));
                            }
                            writes.push((r, range.clone()));
                        }
                        Step::CopyFrom { from, range } => {
                            if !check(range, Some(*from)) {
                                return Err(oob);
                            }
                            let src = snapshot[from.index()][range.clone()].to_vec();
                            bufs[r][range.clone()].copy_from_slice(&src);
                            reads.push((r, from.index(), range.clone()));
                            writes.push((r, range.clone()));
                        }
                        Step::Finish { range } => {
                            if !check(range, None) {
                                return Err(oob);
                            }
                            for v in &mut bufs[r][range.clone()] {
                                *v = finish64(*v, op, world);
                            }
                            writes.push((r, range.clone()));
                        }
                    }
                    pc[r] += 1;
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        for (reader, owner, range) in &reads {
            if let Some((_, written)) = writes
                .iter()
                .find(|(w, written)| w == owner && overlaps(written, range))
            {
                return Err(PlanSimError::Race {
                    reader: rank(*reader),
                    owner: rank(*owner),
                    range: range.start.max(written.start)..range.end.min(written.end),
                });
            }
        }
        let done = (0..world).all(|r| pc[r] == plan.steps[r].len());
        if done {
            break;
        }
        if at_barrier.iter().all(|b| *b) {
            for p in &mut pc {
                *p += 1; // pass the barrier
            }
            continue;
        }
        let waiting = (0..world)
            .filter(|&r| pc[r] < plan.steps[r].len())
            .map(rank)
            .collect();
        return Err(PlanSimError::Deadlock { waiting });
    }
    let left: usize = channels.iter().map(VecDeque::len).sum();
    if left > 0 {
        return Err(PlanSimError::Unconsumed(left));
    }
    Ok(bufs)
}

/// Which of a plan's messages travel as 16-bit elements, and what they cost on the wire.
pub(crate) mod wire;

#[cfg(test)]
mod tests;
