//! What the transports' tests share: deterministic inputs, every collective in one scenario,
//! the in-process reference, and whom an error blames.

use super::*;
use crate::mesh::{Generation, Rank};

fn rank_of(index: usize) -> Rank {
    Rank(u32::try_from(index).unwrap_or(u32::MAX))
}

/// The reference: `body` on one thread per rank of an in-process group, results in rank order.
pub(crate) fn on_local<R: Send>(
    world: usize,
    body: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<R> {
    let group = LocalGroup::new(world, Generation(0), CommConfig::default());
    let body = &body;
    std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .communicators()
            .into_iter()
            .map(|mut comm| scope.spawn(move || body(&mut comm)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// Deterministic inputs in [-1, 1] per rank.
pub(crate) fn input<T: Element>(rank: usize, len: usize, seed: u64) -> Vec<T> {
    let mut x = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f32(((x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32)
        })
        .collect()
}

pub(crate) fn bits<T: Element>(values: &[T]) -> Vec<u32> {
    values.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// Every collective of one element type, with one algorithm, over several lengths and reduce
/// ops: each op's output as bits, in call order.
pub(crate) fn every_collective<T: Element>(
    comm: &mut Communicator,
    algorithm: Algorithm,
) -> Vec<Vec<u32>> {
    comm.set_algorithm(algorithm);
    let (me, world) = (comm.rank().index(), comm.world());
    let mut out = Vec::new();
    for (i, len) in [0usize, 1, 5, 64, 1000, 4099].into_iter().enumerate() {
        let seed = i as u64 + 11;
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            let mut buf = input::<T>(me, len, seed);
            comm.all_reduce(&mut buf, op).expect("all_reduce");
            out.push(bits(&buf));
            let full = input::<T>(me, len, seed + 1);
            let mut chunk = vec![T::from_f32(0.0); chunk_range(len, world, me).len()];
            comm.reduce_scatter(&full, &mut chunk, op)
                .expect("reduce_scatter");
            out.push(bits(&chunk));
        }
        let mine = input::<T>(me, chunk_range(len, world, me).len(), seed + 2);
        let mut gathered = vec![T::from_f32(0.0); len];
        comm.all_gather(&mine, &mut gathered).expect("all_gather");
        out.push(bits(&gathered));
        for root in 0..world {
            let mut buf = input::<T>(me, len, seed + 3);
            comm.broadcast(&mut buf, rank_of(root)).expect("broadcast");
            out.push(bits(&buf));
        }
        comm.barrier().expect("barrier");
    }
    out
}

/// The rank an error blames: the missing rank of a time-out, the peer of a link failure,
/// through a poisoned op's cause.
pub(crate) fn blamed(error: &CommError) -> Vec<Rank> {
    match error {
        CommError::Timeout { missing, .. } => missing.clone(),
        CommError::Link { peer, .. } => vec![*peer],
        CommError::Poisoned { cause, .. } => blamed(cause),
        _ => Vec::new(),
    }
}

/// Two ranks: rank 0 sends `values`, then 10 elements where rank 1 receives 11 (a mismatch
/// on both sides), then 5 that match, and receives `values` back; rank 1 the other side.
/// Each rank's mismatch error and the bits of its last receive.
pub(crate) fn send_recv_in_order_and_a_mismatch(
    comm: &mut Communicator,
    values: &[half::f16],
) -> (Result<(), CommError>, Vec<u32>) {
    let mut got = vec![half::f16::ZERO; 3000];
    if comm.rank() == Rank(0) {
        comm.send(values, Rank(1)).unwrap();
        let mismatch = comm.send(&values[..10], Rank(1));
        comm.send(&values[..5], Rank(1)).unwrap();
        comm.recv(&mut got, Rank(1)).unwrap();
        (mismatch, bits(&got))
    } else {
        comm.recv(&mut got, Rank(0)).unwrap();
        assert_eq!(bits(&got), bits(values));
        let mismatch = comm.recv(&mut got[..11], Rank(0));
        comm.recv(&mut got[..5], Rank(0)).unwrap();
        comm.send(values, Rank(0)).unwrap();
        (mismatch, bits(&got))
    }
}

/// Rank 2 passes 9 elements where the others pass 8 (COMM-2), then all agree: the first
/// op's result, whether the buffer was left untouched, and the second op's first value.
pub(crate) fn mismatched_then_agreeing_all_reduce(
    comm: &mut Communicator,
) -> (Result<(), CommError>, bool, f32) {
    let me = comm.rank().index();
    let mut buf = vec![1.0f32; if me == 2 { 9 } else { 8 }];
    let first = comm.all_reduce(&mut buf, ReduceOp::Sum);
    let untouched = buf.iter().all(|v| *v == 1.0);
    let mut buf = vec![1.0f32; 8];
    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    (first, untouched, buf[0])
}

/// COMM-9: every f16 and bf16 collective of [`every_collective`] with 16-bit partial sums.
pub(crate) fn every_narrow_collective(
    comm: &mut Communicator,
    algorithm: Algorithm,
) -> Vec<Vec<u32>> {
    comm.set_partial_sums(PartialSums::Narrow);
    let mut out = every_collective::<half::f16>(comm, algorithm);
    out.extend(every_collective::<half::bf16>(comm, algorithm));
    out
}

/// COMM-9: a ring all-reduce of 3000 bf16 elements with 16-bit partial sums, and the
/// bytes `sent` counted for it.
pub(crate) fn narrow_ring_all_reduce_bytes(
    comm: &mut Communicator,
    sent: impl Fn(&Communicator) -> u64,
) -> u64 {
    comm.set_algorithm(Algorithm::Ring);
    comm.set_partial_sums(PartialSums::Narrow);
    let mut buf = input::<half::bf16>(comm.rank().index(), 3000, 1);
    let before = sent(comm);
    comm.all_reduce(&mut buf, ReduceOp::Sum)
        .expect("all_reduce");
    sent(comm) - before
}
