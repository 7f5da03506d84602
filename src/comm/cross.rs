//! What the cross-process transports (TCP, MPI) share above their wires: the collective front
//! ends that turn a caller's buffer into the f32 working buffer a plan runs on (and back), the
//! agreement check of a rendezvous (COMM-2), and the errors every op names the same way. Each
//! transport implements [`PlanTransport`]: start an op (header exchange, validation) and run a
//! validated plan on an f32 buffer.

use std::ops::Range;

use super::element::{Element, as_f32_mut, narrow, widen};
use super::{
    Algorithm, CallShape, CollectiveKind, CommError, PartialSums, RankCall, ReduceOp, chunk_range,
};
use crate::mesh::{Generation, Rank};

/// A cross-process transport as the shared front ends drive it.
pub(crate) trait PlanTransport {
    /// What a started op carries until its plan ran (its id; MPI: also MPI kept live).
    type Op;

    /// Ranks in the group.
    fn world(&self) -> usize;

    /// This rank's index.
    fn me(&self) -> usize;

    /// The algorithm a call of `kind` over `len` elements of `T` resolves to.
    fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm;

    /// How 16-bit reductions' partial sums travel (COMM-9).
    fn partial_sums(&self) -> PartialSums;

    /// Starts a collective: exchanges calls with every peer and checks them (COMM-2).
    fn start(&mut self, call: CallShape) -> Result<Self::Op, CommError>;

    /// Runs this rank's steps of the validated `call` on `work` (the op's full buffer).
    fn run_plan(
        &mut self,
        call: &CallShape,
        work: &mut [f32],
        op: &Self::Op,
    ) -> Result<(), CommError>;

    /// The f32 working buffer kept between ops.
    fn work(&mut self) -> &mut Vec<f32>;
}

/// The working buffer, `len` zeros, taken out of `t` (hand it back with [`give_work`]).
fn take_work<C: PlanTransport>(t: &mut C, len: usize) -> Vec<f32> {
    let mut work = std::mem::take(t.work());
    work.clear();
    work.resize(len, 0.0);
    work
}

/// The working buffer holding `src` widened, taken out of `t`: its old values are not
/// zeroed first when it already has the length (every value is overwritten), which saves a
/// pass over the buffer per 16-bit op.
fn widened_work<C: PlanTransport, T: Element>(t: &mut C, src: &[T]) -> Vec<f32> {
    let mut work = std::mem::take(t.work());
    if work.len() != src.len() {
        work.clear();
        work.resize(src.len(), 0.0);
    }
    widen(&mut work, src);
    work
}

fn give_work<C: PlanTransport>(t: &mut C, work: Vec<f32>) {
    *t.work() = work;
}

pub(crate) fn all_reduce<C: PlanTransport, T: Element>(
    t: &mut C,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let algorithm = t.resolve::<T>(CollectiveKind::AllReduce, buf.len());
    let call = CallShape::all_reduce::<T>(algorithm, buf.len(), op);
    in_place(t, call.with_partial_sums(t.partial_sums()), buf)
}

pub(crate) fn broadcast<C: PlanTransport, T: Element>(
    t: &mut C,
    buf: &mut [T],
    root: Rank,
) -> Result<(), CommError> {
    let algorithm = t.resolve::<T>(CollectiveKind::Broadcast, buf.len());
    in_place(
        t,
        CallShape::broadcast::<T>(algorithm, buf.len(), root),
        buf,
    )
}

/// All-reduce and broadcast: f32 buffers are worked on in place, the others through the f32
/// working buffer.
fn in_place<C: PlanTransport, T: Element>(
    t: &mut C,
    call: CallShape,
    buf: &mut [T],
) -> Result<(), CommError> {
    let op = t.start(call.clone())?;
    if let Some(values) = as_f32_mut(buf) {
        return t.run_plan(&call, values, &op);
    }
    let mut work = widened_work(t, buf);
    let result = t.run_plan(&call, &mut work, &op);
    if result.is_ok() {
        narrow(buf, &work);
    }
    give_work(t, work);
    result
}

pub(crate) fn reduce_scatter<C: PlanTransport, T: Element>(
    t: &mut C,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let len = input.len();
    let mine = chunk_range(len, t.world(), t.me());
    let call = CallShape::reduce_scatter::<T>(
        t.resolve::<T>(CollectiveKind::ReduceScatter, len),
        len,
        (output.len(), mine.len()),
        op,
    )
    .with_partial_sums(t.partial_sums());
    let started = t.start(call.clone())?;
    let mut work = widened_work(t, input);
    let result = t.run_plan(&call, &mut work, &started);
    if result.is_ok() {
        narrow(output, &work[mine]);
    }
    give_work(t, work);
    result
}

pub(crate) fn all_gather<C: PlanTransport, T: Element>(
    t: &mut C,
    input: &[T],
    output: &mut [T],
) -> Result<(), CommError> {
    let len = output.len();
    let mine: Range<usize> = chunk_range(len, t.world(), t.me());
    let call = CallShape::all_gather::<T>(
        t.resolve::<T>(CollectiveKind::AllGather, len),
        len,
        (input.len(), mine.len()),
    );
    let started = t.start(call.clone())?;
    if let Some(values) = as_f32_mut(output) {
        widen(&mut values[mine], input);
        return t.run_plan(&call, values, &started);
    }
    let mut work = take_work(t, len);
    widen(&mut work[mine], input);
    let result = t.run_plan(&call, &mut work, &started);
    if result.is_ok() {
        narrow(output, &work);
    }
    give_work(t, work);
    result
}

/// COMM-2: every rank's call agrees with the first, is well formed, and names a root inside
/// the group.
pub(crate) fn calls_fit(calls: &[RankCall], world: usize) -> bool {
    calls.iter().all(|c| {
        c.call.agrees_with(&calls[0].call)
            && c.call.is_well_formed()
            && c.call.peer.is_none_or(|p| p.index() < world)
    })
}

/// The peer of a send or recv as an index, or [`CommError::InvalidPeer`] (outside the group,
/// or this rank itself).
pub(crate) fn check_peer(
    (generation, rank, world): (Generation, Rank, usize),
    op: CollectiveKind,
    peer: Rank,
) -> Result<usize, CommError> {
    let p = peer.index();
    if p >= world || p == rank.index() {
        return Err(CommError::InvalidPeer {
            generation,
            op,
            rank,
            peer,
            world,
        });
    }
    Ok(p)
}

/// A send and its recv that disagree (COMM-2), both calls named in rank order.
pub(crate) fn p2p_mismatch(
    (generation, seq, op): (Generation, u64, CollectiveKind),
    mine: RankCall,
    theirs: RankCall,
) -> CommError {
    let mut calls = vec![mine, theirs];
    calls.sort_by_key(|c| c.rank);
    CommError::Mismatch {
        generation,
        seq,
        op,
        calls,
    }
}

/// The error an op gets before it starts: [`CommError::Shutdown`] once the group was shut
/// down, else [`CommError::Poisoned`] carrying the first failure, else none.
pub(crate) fn refusal(
    shut_down: bool,
    failure: Option<&CommError>,
    (generation, seq, op): (Generation, u64, CollectiveKind),
) -> Option<CommError> {
    if shut_down {
        return Some(CommError::Shutdown {
            generation,
            seq,
            op,
        });
    }
    Some(CommError::Poisoned {
        generation,
        seq,
        op,
        cause: Box::new(root_cause(failure?).clone()),
    })
}

/// The first failure behind `error` (the cause of a poisoned op).
pub(crate) fn root_cause(error: &CommError) -> &CommError {
    match error {
        CommError::Poisoned { cause, .. } => root_cause(cause),
        other => other,
    }
}

/// Rank `index`.
pub(crate) fn rank_of(index: usize) -> Rank {
    Rank(u32::try_from(index).unwrap_or(u32::MAX))
}

/// The bytes of a slice of elements (f32, f16, bf16: plain bit patterns; both transports
/// need a little-endian target, which they check).
pub(crate) fn bytes_of<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: Element types have no padding and every byte is initialized.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}
