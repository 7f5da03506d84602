//! Tests through the real transport: one OS thread per rank.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use proptest::prelude::*;

use super::*;

/// Runs `body` on one thread per rank of a fresh group and returns the group and each rank's
/// result, in rank order.
fn on_ranks<R: Send>(
    world: usize,
    config: CommConfig,
    body: impl Fn(&mut Communicator) -> R + Sync,
) -> (Arc<LocalGroup>, Vec<R>) {
    let group = LocalGroup::new(world, Generation(0), config);
    let body = &body;
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .communicators()
            .into_iter()
            .map(|mut comm| scope.spawn(move || body(&mut comm)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    (group, results)
}

/// Polls `condition` until it holds or `within` passes.
fn eventually(within: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    condition()
}

fn quick() -> CommConfig {
    CommConfig::default().with_timeout(Duration::from_secs(10))
}

/// Deterministic inputs in [-1, 1], exactly representable in every dtype (rounded through
/// `T`), so the reference sees the same values the ranks do.
fn input<T: Element>(rank: usize, len: usize, seed: u64) -> Vec<T> {
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

/// Unit roundoff of the result type: half an ULP, relative.
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f64::from(f32::EPSILON) / 2.0,
        DType::F16 => f64::from(f16::EPSILON.to_f32()) / 2.0,
        DType::BF16 => f64::from(bf16::EPSILON.to_f32()) / 2.0,
    }
}

/// Checks `got` against the exact (f64) reduction of `inputs` over `range`.
///
/// Tolerance, for sum and mean: f32 accumulation of N terms loses at most (N+1)·u32 of the
/// sum of magnitudes (one rounding per addition, one for the division by N), then the result
/// is rounded once to the dtype: u_dtype·|exact|; plus half the smallest f16 subnormal for
/// results that underflow. Max and min must be exact.
fn check_reduction<T: Element>(
    got: &[T],
    inputs: &[Vec<T>],
    range: std::ops::Range<usize>,
    op: ReduceOp,
) -> Result<(), TestCaseError> {
    let world = inputs.len() as f64;
    let u32_ = f64::from(f32::EPSILON) / 2.0;
    for (g, i) in got.iter().zip(range) {
        let values: Vec<f64> = inputs.iter().map(|b| f64::from(b[i].to_f32())).collect();
        let got = f64::from(g.to_f32());
        let (exact, magnitude) = match op {
            ReduceOp::Sum => (
                values.iter().sum::<f64>(),
                values.iter().map(|v| v.abs()).sum(),
            ),
            ReduceOp::Mean => (
                values.iter().sum::<f64>() / world,
                values.iter().map(|v| v.abs()).sum::<f64>() / world,
            ),
            ReduceOp::Max => (values.iter().copied().fold(f64::MIN, f64::max), 0.0),
            ReduceOp::Min => (values.iter().copied().fold(f64::MAX, f64::min), 0.0),
        };
        let tolerance = match op {
            ReduceOp::Max | ReduceOp::Min => 0.0,
            ReduceOp::Sum | ReduceOp::Mean => {
                unit_roundoff(T::DTYPE) * exact.abs() * 1.0001
                    + (world + 1.0) * u32_ * magnitude
                    + 2f64.powi(-25)
            }
        };
        prop_assert!(
            (got - exact).abs() <= tolerance,
            "{op} {:?} element {i}: got {got}, exact {exact}, tolerance {tolerance:e}",
            T::DTYPE
        );
    }
    Ok(())
}

const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::Ring,
    Algorithm::Tree,
    Algorithm::Direct,
    Algorithm::Auto,
];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

fn bits<T: Element>(v: &[T]) -> Vec<u32> {
    v.iter().map(|x| x.to_f32().to_bits()).collect()
}

/// Every algorithm × op × collective over `T`, on one thread per rank; each rank checks its
/// own results against the sequential reference.
fn every_collective_matches_reference<T: Element>(
    world: usize,
    len: usize,
    root: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(r, len, seed)).collect();
    let inputs = &inputs;
    let (_, results) = on_ranks(
        world,
        quick(),
        |comm| -> Result<Vec<Vec<u32>>, TestCaseError> {
            let r = comm.rank().index();
            let mine = chunk_range(len, world, r);
            let mut all_reduced = Vec::new();
            for algorithm in ALGORITHMS {
                comm.set_algorithm(algorithm);
                let expect_algorithm = |comm: &Communicator| -> Result<(), TestCaseError> {
                    let used = comm.last_algorithm();
                    prop_assert!(used.is_some() && used != Some(Algorithm::Auto));
                    if algorithm != Algorithm::Auto {
                        prop_assert_eq!(used, Some(algorithm));
                    }
                    Ok(())
                };
                for op in OPS {
                    let mut buf = inputs[r].clone();
                    comm.all_reduce(&mut buf, op)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    expect_algorithm(comm)?;
                    check_reduction(&buf, inputs, 0..len, op)?;
                    all_reduced.push(bits(&buf));

                    let mut out = vec![T::from_f32(f32::NAN); mine.len()];
                    comm.reduce_scatter(&inputs[r], &mut out, op)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    expect_algorithm(comm)?;
                    check_reduction(&out, inputs, mine.clone(), op)?;
                }
                let mut gathered = vec![T::from_f32(f32::NAN); len];
                comm.all_gather(&inputs[r][mine.clone()], &mut gathered)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                expect_algorithm(comm)?;
                for (p, input) in inputs.iter().enumerate() {
                    let chunk = chunk_range(len, world, p);
                    prop_assert_eq!(bits(&gathered[chunk.clone()]), bits(&input[chunk]));
                }

                let mut buf = inputs[r].clone();
                comm.broadcast(&mut buf, Rank(root as u32))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                expect_algorithm(comm)?;
                prop_assert_eq!(bits(&buf), bits(&inputs[root]));
                comm.barrier()
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Ok(all_reduced)
        },
    );
    let results: Vec<Vec<Vec<u32>>> = results.into_iter().collect::<Result<_, _>>()?;
    // COMM-5: every rank ends with bit-identical all-reduce results.
    for other in &results[1..] {
        prop_assert_eq!(other, &results[0]);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// COMM-5, PLAN-4: every algorithm, op, dtype and collective equals the sequential
    /// reference (exact for max/min, within the dtype-derived tolerance for sum/mean).
    #[test]
    fn collectives_match_sequential_reference_for_every_algorithm_op_and_dtype(
        world in 1usize..=8,
        len in prop_oneof![0usize..=2, 0usize..300, 300usize..5000],
        root in 0usize..8,
        seed in any::<u64>(),
    ) {
        let root = root % world;
        every_collective_matches_reference::<f32>(world, len, root, seed)?;
        every_collective_matches_reference::<f16>(world, len, root, seed)?;
        every_collective_matches_reference::<bf16>(world, len, root, seed)?;
    }
}

#[test]
fn large_uneven_buffers_reduce_across_block_boundaries() {
    // 50_001 elements: not divisible by 3, several 2048-element blocks per chunk.
    for world in [2, 3] {
        every_collective_matches_reference::<f32>(world, 50_001, world - 1, 3).unwrap();
        every_collective_matches_reference::<bf16>(world, 50_001, 0, 4).unwrap();
    }
}

#[test]
fn lengths_zero_and_one_work_in_every_world() {
    for world in 1..=8 {
        for len in [0, 1] {
            every_collective_matches_reference::<f32>(world, len, world / 2, 11).unwrap();
            every_collective_matches_reference::<f16>(world, len, 0, 12).unwrap();
        }
    }
}

#[test]
fn f16_sum_accumulates_in_f32_and_rounds_once() {
    // 2048 + 1 + 1 in f16 step by step gives 2048 (2049 rounds to 2048 each time); in f32
    // then rounded once it gives 2050.
    let (_, results) = on_ranks(3, quick(), |comm| {
        let value = [2048.0f32, 1.0, 1.0][comm.rank().index()];
        let mut buf = vec![f16::from_f32(value); 5];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .map(|()| buf[0].to_f32())
    });
    for got in results {
        assert_eq!(got.unwrap(), 2050.0);
    }
}

#[test]
fn auto_picks_direct_for_large_and_tree_for_small_buffers_and_reports_it() {
    let (_, results) = on_ranks(4, quick(), |comm| {
        let mut small = vec![1.0f32; 16];
        comm.all_reduce(&mut small, ReduceOp::Sum).unwrap();
        let small_algorithm = comm.last_algorithm();
        let mut large = vec![1.0f32; 1 << 16];
        comm.all_reduce(&mut large, ReduceOp::Sum).unwrap();
        (small_algorithm, comm.last_algorithm(), small[0], large[0])
    });
    for result in results {
        assert_eq!(
            result,
            (Some(Algorithm::Tree), Some(Algorithm::Direct), 4.0, 4.0)
        );
    }
}

#[test]
fn sequence_numbers_count_every_collective_on_every_rank() {
    let (_, results) = on_ranks(3, quick(), |comm| {
        let mut buf = [1.0f32];
        comm.barrier().unwrap();
        comm.all_reduce(&mut buf, ReduceOp::Max).unwrap();
        comm.broadcast(&mut buf, Rank(2)).unwrap();
        comm.next_seq()
    });
    assert_eq!(results, vec![3, 3, 3]);
}

#[test]
fn mismatched_lengths_name_every_rank_and_what_it_passed_and_leave_the_group_usable() {
    let (_, results) = on_ranks(3, quick(), |comm| {
        let len = if comm.rank() == Rank(1) { 5 } else { 4 };
        let mut buf = vec![1.0f32; len];
        let error = comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        assert_eq!(buf, vec![1.0; len], "COMM-2: nothing moved");
        // COMM-2: the group stays usable.
        let mut ok = vec![1.0f32; 4];
        comm.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
        assert_eq!(ok, vec![3.0; 4]);
        error
    });
    for error in results {
        let CommError::Mismatch {
            seq, op, ref calls, ..
        } = error
        else {
            panic!("expected a mismatch, got {error}");
        };
        assert_eq!((seq, op), (0, CollectiveKind::AllReduce));
        let lens: Vec<(Rank, usize)> = calls.iter().map(|c| (c.rank, c.call.len)).collect();
        assert_eq!(lens, vec![(Rank(0), 4), (Rank(1), 5), (Rank(2), 4)]);
        let text = error.to_string();
        assert!(
            text.contains("all_reduce #0 (generation 0)")
                && text.contains("rank 1 passed all_reduce(f32, len 5, sum"),
            "{text}"
        );
    }
}

#[test]
fn mismatched_dtypes_name_the_ranks_and_their_types() {
    let (_, results) = on_ranks(2, quick(), |comm| {
        if comm.rank() == Rank(0) {
            comm.all_reduce(&mut [1.0f32; 3], ReduceOp::Mean)
        } else {
            comm.all_reduce(&mut [bf16::ONE; 3], ReduceOp::Mean)
        }
    });
    for result in results {
        let error = result.unwrap_err();
        let CommError::Mismatch { ref calls, .. } = error else {
            panic!("expected a mismatch, got {error}");
        };
        let dtypes: Vec<Option<DType>> = calls.iter().map(|c| c.call.dtype).collect();
        assert_eq!(dtypes, vec![Some(DType::F32), Some(DType::BF16)]);
        assert!(error.to_string().contains("rank 1 passed all_reduce(bf16"));
    }
}

#[test]
fn a_chunk_of_the_wrong_length_is_a_mismatch_naming_the_expected_length() {
    let (_, results) = on_ranks(2, quick(), |comm| {
        // len 5 over 2 ranks: chunks of 3 and 2; rank 1 passes 3.
        let mut out = vec![0.0f32; 5];
        comm.all_gather(&[1.0f32; 3], &mut out)
    });
    for result in results {
        let error = result.unwrap_err();
        let CommError::Mismatch { ref calls, .. } = error else {
            panic!("expected a mismatch, got {error}");
        };
        assert!(calls[0].call.is_well_formed());
        assert_eq!(
            (calls[1].call.chunk_len, calls[1].call.expected_chunk_len),
            (Some(3), Some(2))
        );
        assert!(error.to_string().contains("chunk 3 but the layout needs 2"));
    }
}

#[test]
fn ranks_resolving_different_algorithms_get_a_mismatch_instead_of_a_hang() {
    let (_, results) = on_ranks(2, quick(), |comm| {
        if comm.rank() == Rank(0) {
            comm.set_algorithm(Algorithm::Ring);
        }
        comm.all_reduce(&mut [1.0f32; 64], ReduceOp::Sum)
    });
    for result in results {
        assert!(matches!(result, Err(CommError::Mismatch { .. })));
    }
}

#[test]
fn broadcast_root_outside_the_group_is_a_typed_error() {
    let (_, results) = on_ranks(2, quick(), |comm| comm.broadcast(&mut [1.0f32; 2], Rank(5)));
    for result in results {
        assert!(matches!(result, Err(CommError::Mismatch { .. })));
    }
}

#[test]
fn a_missing_rank_times_out_naming_the_missing_ranks_and_the_seq_then_poisons_the_group() {
    // The 17 setup barriers get a time-out no scheduling delay reaches; only the op under
    // test has the short one.
    let timeout = Duration::from_millis(200);
    let group = LocalGroup::new(4, Generation(7), quick());
    let mut comms = group.communicators();
    let started = Instant::now();
    let errors = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter_mut()
            .map(|comm| {
                scope.spawn(move || {
                    for _ in 0..17 {
                        comm.barrier().unwrap();
                    }
                    if comm.rank().index() >= 2 {
                        return None; // ranks 2 and 3 never arrive at #17
                    }
                    comm.set_timeout(timeout);
                    Some(
                        comm.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
                            .unwrap_err(),
                    )
                })
            })
            .collect();
        let errors: Vec<_> = handles
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        errors
    });
    let late = comms.pop().unwrap();
    assert!(
        started.elapsed() < timeout + Duration::from_secs(8),
        "bounded by the time-out: {:?}",
        started.elapsed()
    );
    assert_eq!(errors.len(), 2);
    for error in &errors {
        let CommError::Timeout {
            generation,
            seq,
            op,
            missing,
            waited,
        } = error
        else {
            panic!("expected a time-out, got {error}");
        };
        assert_eq!(*generation, Generation(7));
        assert_eq!((*seq, *op), (17, CollectiveKind::AllReduce));
        assert_eq!(missing, &vec![Rank(2), Rank(3)]);
        assert_eq!(*waited, Duration::from_millis(200));
        assert_eq!(
            error.to_string(),
            "all_reduce #17 (generation 7) timed out after 200ms waiting for ranks [2, 3]"
        );
    }
    // COMM-3: the late rank (and anyone else) fails fast, naming the failed op.
    let mut late = late;
    let fast = Instant::now();
    let error = late
        .all_reduce(&mut [1.0f32; 8], ReduceOp::Sum)
        .unwrap_err();
    // Fast: well under its own 10 s time-out (it does not wait for the others).
    assert!(
        fast.elapsed() < Duration::from_secs(2),
        "{:?}",
        fast.elapsed()
    );
    let CommError::Poisoned { seq, cause, .. } = &error else {
        panic!("expected poisoned, got {error}");
    };
    assert_eq!(*seq, 17);
    assert!(matches!(**cause, CommError::Timeout { seq: 17, .. }));
    assert!(matches!(group.status().state, GroupState::Poisoned { .. }));
}

#[test]
fn shutdown_wakes_a_blocked_rank_and_refuses_later_ops() {
    let group = LocalGroup::new(2, Generation(1), CommConfig::default());
    let mut comms = group.communicators();
    let mut lonely = comms.remove(0);
    let waiter = std::thread::spawn(move || {
        let started = Instant::now();
        let result = lonely.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum);
        (result, started.elapsed(), lonely)
    });
    assert!(eventually(Duration::from_secs(5), || {
        group.status().ranks[0].waiting_for.is_some()
    }));
    group.shutdown();
    let (result, waited, mut lonely) = waiter.join().unwrap();
    assert!(
        matches!(
            result,
            Err(CommError::Shutdown {
                seq: 0,
                op: CollectiveKind::AllReduce,
                ..
            })
        ),
        "{result:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "woken promptly, not by the 60 s time-out"
    );
    assert!(matches!(
        lonely.barrier(),
        Err(CommError::Shutdown { seq: 1, .. })
    ));
    assert!(matches!(
        comms[0].send(&[1.0f32], Rank(0)),
        Err(CommError::Shutdown { .. })
    ));
    assert!(matches!(group.status().state, GroupState::ShutDown));
}

#[test]
fn communicators_move_to_rank_threads_and_groups_are_shared() {
    fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<Communicator>();
    send_and_sync::<LocalGroup>();
}

#[test]
fn communicators_are_handed_out_once() {
    let group = LocalGroup::new(3, Generation(0), CommConfig::default());
    assert_eq!(group.communicators().len(), 3);
    assert!(group.communicators().is_empty());
}

#[test]
fn send_and_recv_match_by_order_per_pair() {
    let (_, results) = on_ranks(3, quick(), |comm| match comm.rank().index() {
        0 => {
            for k in 0..3 {
                comm.send(&[f16::from_f32(k as f32); 7], Rank(2)).unwrap();
            }
            Vec::new()
        }
        1 => {
            comm.send(&[f16::from_f32(10.0); 7], Rank(2)).unwrap();
            Vec::new()
        }
        _ => {
            let mut got = Vec::new();
            let mut buf = [f16::ZERO; 7];
            comm.recv(&mut buf, Rank(1)).unwrap();
            got.push(buf[6].to_f32());
            for _ in 0..3 {
                comm.recv(&mut buf, Rank(0)).unwrap();
                got.push(buf[0].to_f32());
            }
            got
        }
    });
    assert_eq!(results[2], vec![10.0, 0.0, 1.0, 2.0]);
}

#[test]
fn send_and_recv_of_different_lengths_fail_on_both_sides() {
    let (_, results) = on_ranks(2, quick(), |comm| {
        if comm.rank() == Rank(0) {
            comm.send(&[1.0f32; 4], Rank(1))
        } else {
            comm.recv(&mut [0.0f32; 3], Rank(0))
        }
    });
    for (result, op) in results
        .into_iter()
        .zip([CollectiveKind::Send, CollectiveKind::Recv])
    {
        let error = result.unwrap_err();
        let CommError::Mismatch {
            op: got_op,
            ref calls,
            ..
        } = error
        else {
            panic!("expected a mismatch, got {error}");
        };
        assert_eq!(got_op, op);
        let lens: Vec<usize> = calls.iter().map(|c| c.call.len).collect();
        assert_eq!(lens, vec![4, 3]);
    }
}

#[test]
fn recv_without_a_sender_times_out_naming_the_sender() {
    let config = CommConfig::default().with_timeout(Duration::from_millis(100));
    let (_, results) = on_ranks(2, config, |comm| {
        if comm.rank() == Rank(1) {
            Some(comm.recv(&mut [0.0f32; 3], Rank(0)).unwrap_err())
        } else {
            None
        }
    });
    let error = results[1].clone().unwrap();
    assert!(
        matches!(&error, CommError::Timeout { op: CollectiveKind::Recv, missing, .. } if missing == &vec![Rank(0)]),
        "{error}"
    );
}

#[test]
fn send_to_self_or_outside_the_group_is_an_invalid_peer() {
    let group = LocalGroup::new(2, Generation(0), CommConfig::default());
    let mut comms = group.communicators();
    assert!(matches!(
        comms[0].send(&[1.0f32], Rank(0)),
        Err(CommError::InvalidPeer { .. })
    ));
    assert!(matches!(
        comms[1].recv(&mut [1.0f32], Rank(9)),
        Err(CommError::InvalidPeer { .. })
    ));
}

#[test]
#[ignore = "measures bandwidth; run with --release -- --ignored --nocapture"]
fn report_all_reduce_bandwidth_at_16_mib_world_2() {
    for algorithm in [
        Algorithm::Direct,
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::Auto,
    ] {
        let figures =
            bench::all_reduce_bandwidth(2, 16 << 20, algorithm, 30, bench::Wire::default())
                .unwrap();
        println!(
            "{algorithm:>6}: busbw {:.2} GB/s, memcpy {:.2} GB/s, ratio {:.2}, median {:.3} ms ({})",
            figures.busbw_gbps,
            figures.memcpy_gbps,
            figures.busbw_over_memcpy(),
            figures.seconds_median * 1e3,
            figures.algorithm
        );
    }
}

/// Tampers with the `index`-th message `from` sends to `to` in op `seq` (COMM-8 tests).
#[derive(Debug)]
struct TamperOne {
    from: Rank,
    to: Rank,
    seq: u64,
    index: u32,
    fate: Tamper,
}

impl MessageHook for TamperOne {
    fn on_send(&self, from: Rank, to: Rank, seq: u64, _op: CollectiveKind, index: u32) -> Tamper {
        if (from, to, seq, index) == (self.from, self.to, self.seq, self.index) {
            self.fate
        } else {
            Tamper::Deliver
        }
    }
}

/// Runs one f32 all-reduce per rank on a group whose ranks all send through `hook`.
fn tampered_all_reduce(
    world: usize,
    len: usize,
    config: CommConfig,
    hook: Arc<dyn MessageHook>,
) -> (Vec<f32>, Vec<Result<Vec<f32>, CommError>>) {
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| input::<f32>(r, len, 3)).collect();
    let expected: Vec<f32> = (0..len)
        .map(|i| inputs.iter().map(|x| x[i]).sum::<f32>())
        .collect();
    let (_, results) = on_ranks(world, config, |comm| {
        comm.set_message_hook(Some(hook.clone()));
        let mut buf = inputs[comm.rank().index()].clone();
        comm.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf)
    });
    (expected, results)
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
}

#[test]
fn comm_8_a_hooked_group_runs_message_plans_and_a_short_delay_only_delays() {
    let hook = Arc::new(TamperOne {
        from: Rank(1),
        to: Rank(2),
        seq: 0,
        index: 0,
        fate: Tamper::Delay(Duration::from_millis(50)),
    });
    let (expected, results) = tampered_all_reduce(3, 3000, quick(), hook);
    for r in results {
        assert!(close(
            &r.expect("a delay shorter than the time-out"),
            &expected
        ));
    }
}

#[test]
fn comm_8_a_dropped_message_is_named_never_consumed_in_its_place() {
    let hook = Arc::new(TamperOne {
        from: Rank(0),
        to: Rank(1),
        seq: 0,
        index: 0,
        fate: Tamper::Drop,
    });
    let started = Instant::now();
    // Long enough that a slow rank never times out before the out-of-order message arrives.
    let config = quick().with_timeout(Duration::from_secs(2));
    let (_, results) = tampered_all_reduce(2, 1000, config, hook);
    assert!(started.elapsed() < Duration::from_secs(10));
    // Rank 1 sees message 1 of rank 0 arrive where message 0 was due.
    let error = results[1].as_ref().expect_err("rank 1 lost a message");
    assert!(
        matches!(
            error,
            CommError::MessageLost {
                from: Rank(0),
                index: 0,
                got: 1,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.is_message_fault());
    // Rank 0 fails too (the group is poisoned), and the cause is the lost message.
    let error = results[0].as_ref().expect_err("the group is poisoned");
    assert!(error.is_message_fault(), "{error}");
}

#[test]
fn comm_8_a_corrupt_message_fails_a_verified_group_with_both_checksums() {
    let hook = Arc::new(TamperOne {
        from: Rank(2),
        to: Rank(0),
        seq: 0,
        index: 1,
        fate: Tamper::Corrupt,
    });
    let config = quick()
        .with_verified_payloads(true)
        .with_algorithm(Algorithm::Ring);
    let (_, results) = tampered_all_reduce(3, 3000, config, hook);
    let error = results[0]
        .as_ref()
        .expect_err("rank 0 got a corrupt message");
    let CommError::CorruptMessage {
        from,
        index,
        declared,
        computed,
        ..
    } = error
    else {
        panic!("expected a corrupt message, got {error}");
    };
    assert_eq!((*from, *index), (Rank(2), 1));
    assert_ne!(declared, computed);
    assert!(
        results
            .iter()
            .all(|r| r.as_ref().is_err_and(CommError::is_message_fault))
    );
}

#[test]
fn comm_8_a_message_held_past_the_time_out_is_named_with_its_sender() {
    let hook = Arc::new(TamperOne {
        from: Rank(1),
        to: Rank(0),
        seq: 0,
        index: 0,
        fate: Tamper::Delay(Duration::from_secs(4)),
    });
    // Held twice the time-out: rank 1 reaching the op up to 2 s before rank 0 still makes
    // rank 0 time out on the message, and a 2 s time-out outlasts any scheduling delay.
    let config = quick().with_timeout(Duration::from_secs(2));
    let (_, results) = tampered_all_reduce(2, 1000, config, hook);
    let error = results[0]
        .as_ref()
        .expect_err("rank 0 waited past its time-out");
    assert!(
        matches!(
            error,
            CommError::MessageTimeout {
                from: Rank(1),
                index: 0,
                ..
            }
        ),
        "{error}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// COMM-8: whatever message of a verified group is dropped, corrupted or delayed, every
    /// rank either gets the right sum or a message-fault error; never a wrong sum.
    #[test]
    fn comm_8_a_tampered_message_never_gives_a_wrong_result(
        world in 2usize..5,
        len in 1usize..64,
        from in 0u32..4,
        to_offset in 1u32..4,
        index in 0u32..3,
        fate in 0u8..3,
        algorithm in prop::sample::select(vec![Algorithm::Ring, Algorithm::Tree]),
    ) {
        let from = from % world as u32;
        let to = (from + to_offset % world as u32).max(from + 1) % world as u32;
        let fate = match fate {
            0 => Tamper::Drop,
            1 => Tamper::Corrupt,
            _ => Tamper::Delay(Duration::from_millis(1)),
        };
        let hook = Arc::new(TamperOne { from: Rank(from), to: Rank(to), seq: 0, index, fate });
        // A rank that is merely slow must not time out (a plain time-out is not a message
        // fault); a dropped last message costs the whole time-out.
        let config = quick()
            .with_timeout(Duration::from_secs(2))
            .with_algorithm(algorithm)
            .with_verified_payloads(true);
        let (expected, results) = tampered_all_reduce(world, len, config, hook);
        for r in results {
            match r {
                Ok(sum) => prop_assert!(close(&sum, &expected)),
                Err(e) => prop_assert!(e.is_message_fault(), "{}", e),
            }
        }
    }
}

/// EMU-1/2: an emulated link holds every message back by its cost (a lower bound on the
/// time: sleeps never end early), counts 2 bytes per 16-bit element, leaves the values bitwise
/// equal to the plain group's, and a slow rank's link costs its factor more.
#[test]
fn emulated_links_delay_count_bytes_and_change_no_value() {
    use super::emulate::LinkEmulation;
    let world = 4;
    let len = 4000;
    let run = |config: CommConfig| {
        on_ranks(world, config, |c| {
            let mut a = input::<f32>(c.rank().index(), len, 7);
            let mut b = input::<bf16>(c.rank().index(), len, 8);
            let t = Instant::now();
            c.all_reduce(&mut a, ReduceOp::Sum).expect("f32 all-reduce");
            let f32_bytes = c.bytes_sent();
            c.all_reduce(&mut b, ReduceOp::Sum)
                .expect("bf16 all-reduce");
            (
                bits(&a),
                bits(&b),
                f32_bytes,
                c.bytes_sent() - f32_bytes,
                t.elapsed(),
            )
        })
        .1
    };
    let plain = run(quick().with_algorithm(Algorithm::Ring));
    let latency = Duration::from_millis(5);
    let link = LinkEmulation::new(1e9, latency)
        .and_then(|l| l.with_slow_link(3, 2.0))
        .expect("valid emulation");
    // The same plan (Auto would pick direct without emulation, which has no messages).
    let emulated = run(quick()
        .with_algorithm(Algorithm::Ring)
        .with_link_emulation(Some(link)));
    // The ring sends 2(N−1) chunks of about len/N elements from every rank.
    let ring_elems = |r: usize| {
        (0..world)
            .filter(|&c| c != (r + 1) % world)
            .map(|c| chunk_range(len, world, c).len())
            .sum::<usize>()
            + (0..world)
                .filter(|&c| c != (r + 2) % world)
                .map(|c| chunk_range(len, world, c).len())
                .sum::<usize>()
    };
    for (r, (p, e)) in plain.iter().zip(&emulated).enumerate() {
        assert!(p.0 == e.0 && p.1 == e.1, "EMU-2: rank {r}'s values changed");
        // Chunks of len/N: exactly 2(N−1)·len/N elements within one chunk's rounding; bf16
        // sends its partial sums as f32 and its final values as bf16 (TCP-7): 3/4 of it.
        let want = 2 * (world - 1) * len / world;
        assert!(
            (e.2 as usize / 4).abs_diff(want) <= 2 * world
                && (4 * e.3).abs_diff(3 * e.2) <= 16 * world as u64,
            "rank {r} sent {} f32 bytes and {} bf16 bytes, want about {} and 3/4 of it \
             (ring chunks {})",
            e.2,
            e.3,
            want * 4,
            ring_elems(r)
        );
        assert_eq!(p.2, e.2, "the same plan sends the same bytes");
        // 2(N−1) messages per all-reduce, each held back at least the latency (the slow
        // rank's twice); the ring waits on its slowest sender at every hop.
        assert!(
            e.4 >= latency * (2 * 2 * (world as u32 - 1)),
            "rank {r} took {:?}",
            e.4
        );
    }
}

/// COMM-9: with 16-bit partial sums each ring hop rounds the running sum: 2048 + 1 in f16
/// rounds to 2048 (ties to even) where the chain starts at the 2048, so some elements end at
/// 2048 instead of 2050; with f32 partial sums (the default, COMM-5) every element is 2050.
/// Every rank still ends with the same bits.
#[test]
fn comm_9_sixteen_bit_partial_sums_round_at_every_hop() {
    let run = |partial_sums: PartialSums| {
        let config = quick()
            .with_algorithm(Algorithm::Ring)
            .with_partial_sums(partial_sums);
        let (_, results) = on_ranks(3, config, |comm| {
            let value = [2048.0f32, 1.0, 1.0][comm.rank().index()];
            let mut buf = vec![f16::from_f32(value); 6];
            comm.all_reduce(&mut buf, ReduceOp::Sum)
                .map(|()| buf.iter().map(|v| v.to_f32()).collect::<Vec<_>>())
        });
        results
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .expect("all-reduce")
    };
    let wide = run(PartialSums::F32);
    assert!(wide.iter().flatten().all(|v| *v == 2050.0), "{wide:?}");
    let narrow = run(PartialSums::Narrow);
    assert!(narrow.iter().all(|r| r == &narrow[0]), "{narrow:?}");
    assert!(narrow[0].contains(&2048.0), "{narrow:?}");
    assert!(narrow[0].contains(&2050.0), "{narrow:?}");
}

/// COMM-9: ranks that disagree on the partial sums' width get a mismatch naming it, and the
/// group stays usable.
#[test]
fn comm_9_ranks_that_disagree_on_partial_sums_get_a_mismatch() {
    let (_, results) = on_ranks(2, quick().with_algorithm(Algorithm::Ring), |comm| {
        if comm.rank().index() == 1 {
            comm.set_partial_sums(PartialSums::Narrow);
        }
        let mut buf = vec![bf16::from_f32(1.0); 64];
        let first = comm.all_reduce(&mut buf, ReduceOp::Sum);
        comm.set_partial_sums(PartialSums::Narrow);
        let second = comm.all_reduce(&mut buf, ReduceOp::Sum);
        (first, second, buf[0].to_f32())
    });
    for (first, second, value) in results {
        match first {
            Err(CommError::Mismatch { calls, .. }) => {
                assert!(calls[1].call.to_string().contains("16-bit partial sums"));
                assert!(!calls[0].call.to_string().contains("16-bit partial sums"));
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        assert!(second.is_ok(), "{second:?}");
        assert_eq!(value, 2.0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// COMM-9: 16-bit partial sums in ring and tree all-reduces and reduce-scatters give
    /// every rank the same bits, within one 16-bit rounding per hop of the exact sum:
    /// |got − exact| ≤ (world + 1)·u16·Σ|x| (plus f32's own error, far smaller); the direct
    /// plan (no messages) ignores the setting and rounds once.
    #[test]
    fn comm_9_narrow_partial_sums_stay_within_one_rounding_per_hop(
        world in 2usize..=6,
        len in 1usize..700,
        seed in any::<u64>(),
        tree in any::<bool>(),
        bf in any::<bool>(),
    ) {
        let algorithm = if tree { Algorithm::Tree } else { Algorithm::Ring };
        let config = quick().with_algorithm(algorithm).with_partial_sums(PartialSums::Narrow);
        fn case<T: Element>(
            world: usize,
            len: usize,
            seed: u64,
            config: CommConfig,
        ) -> Result<(), TestCaseError> {
            let (_, results) = on_ranks(world, config, |comm| {
                let me = comm.rank().index();
                let mut buf = input::<T>(me, len, seed);
                comm.all_reduce(&mut buf, ReduceOp::Sum).expect("all_reduce");
                let mut chunk = vec![T::from_f32(0.0); chunk_range(len, world, me).len()];
                comm.reduce_scatter(&input::<T>(me, len, seed), &mut chunk, ReduceOp::Sum)
                    .expect("reduce_scatter");
                (buf, chunk)
            });
            let inputs: Vec<Vec<T>> = (0..world).map(|r| input::<T>(r, len, seed)).collect();
            let u = unit_roundoff(T::DTYPE);
            for (r, (all, chunk)) in results.iter().enumerate() {
                prop_assert_eq!(bits(all), bits(&results[0].0));
                let mine = chunk_range(len, world, r);
                for (i, got) in all.iter().enumerate() {
                    let exact: f64 = inputs.iter().map(|x| f64::from(x[i].to_f32())).sum();
                    let mass: f64 = inputs.iter().map(|x| f64::from(x[i].to_f32()).abs()).sum();
                    let bound = (world as f64 + 1.0) * u * mass + 1e-7;
                    let err = (f64::from(got.to_f32()) - exact).abs();
                    prop_assert!(err <= bound, "element {i}: {err} > {bound}");
                    if mine.contains(&i) {
                        let err = (f64::from(chunk[i - mine.start].to_f32()) - exact).abs();
                        prop_assert!(err <= bound, "reduce-scatter {i}: {err} > {bound}");
                    }
                }
            }
            Ok(())
        }
        if bf {
            case::<bf16>(world, len, seed, config)?;
        } else {
            case::<f16>(world, len, seed, config)?;
        }
    }
}

/// TCP-7 and COMM-9 in process: a ring all-reduce of a 16-bit buffer counts (and, on an
/// emulated link, waits for) the bytes the TCP transport sends: f32 partial sums and 16-bit
/// final values by default, 16-bit both with 16-bit partial sums.
#[test]
fn comm_9_in_process_ring_counts_the_bytes_tcp_sends() {
    let bytes = |partial_sums: PartialSums| {
        let config = quick()
            .with_algorithm(Algorithm::Ring)
            .with_partial_sums(partial_sums);
        let (_, sent) = on_ranks(3, config, |comm| {
            let mut buf = input::<bf16>(comm.rank().index(), 3000, 1);
            let before = comm.bytes_sent();
            comm.all_reduce(&mut buf, ReduceOp::Sum)
                .expect("all_reduce");
            comm.bytes_sent() - before
        });
        sent
    };
    // Each of 3 ranks sends 2 chunks of 1000 partial sums and 2 chunks of 1000 final values.
    assert_eq!(bytes(PartialSums::F32), vec![4 * 2000 + 2 * 2000; 3]);
    assert_eq!(bytes(PartialSums::Narrow), vec![2 * 4000; 3]);
}
