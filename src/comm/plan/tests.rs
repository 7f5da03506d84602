use proptest::prelude::*;

use super::*;

const KINDS: [CollectiveKind; 4] = [
    CollectiveKind::AllReduce,
    CollectiveKind::ReduceScatter,
    CollectiveKind::AllGather,
    CollectiveKind::Broadcast,
];
const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::Ring,
    Algorithm::Tree,
    Algorithm::Direct,
    Algorithm::Auto,
];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];

/// Integer-valued inputs: sums are exact in f64 whatever the order, so plans must match the
/// reference exactly.
fn inputs(world: usize, len: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut x = seed | 1;
    (0..world)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 2001) as f64 - 1000.0
                })
                .collect()
        })
        .collect()
}

fn reduce_reference(inputs: &[Vec<f64>], op: ReduceOp) -> Vec<f64> {
    let world = inputs.len();
    let mut acc = inputs[0].clone();
    for input in &inputs[1..] {
        for (a, b) in acc.iter_mut().zip(input) {
            *a = combine64(*a, *b, op);
        }
    }
    acc.into_iter().map(|a| finish64(a, op, world)).collect()
}

/// What rank `r` must hold (in the region the collective defines) after `kind`.
fn check_plan(
    kind: CollectiveKind,
    algorithm: Algorithm,
    world: usize,
    len: usize,
    root: usize,
    op: ReduceOp,
    seed: u64,
) -> Result<(), TestCaseError> {
    let root = Rank(root as u32);
    let plan = plan(kind, algorithm, world, len, root).expect("every data collective has a plan");
    prop_assert_ne!(plan.algorithm, Algorithm::Auto);
    let mut ins = inputs(world, len, seed);
    if kind == CollectiveKind::AllGather {
        // Only each rank's own chunk is meaningful; poison the rest.
        for (r, buf) in ins.iter_mut().enumerate() {
            let mine = chunk_range(len, world, r);
            for (i, v) in buf.iter_mut().enumerate() {
                if !mine.contains(&i) {
                    *v = f64::NAN;
                }
            }
        }
    }
    let out =
        simulate(&plan, &ins, op).map_err(|e| TestCaseError::fail(format!("{plan:?}: {e}")))?;
    for (r, got) in out.iter().enumerate() {
        match kind {
            CollectiveKind::AllReduce => prop_assert_eq!(got, &reduce_reference(&ins, op)),
            CollectiveKind::ReduceScatter => {
                let mine = chunk_range(len, world, r);
                prop_assert_eq!(&got[mine.clone()], &reduce_reference(&ins, op)[mine]);
            }
            CollectiveKind::AllGather => {
                for (p, input) in ins.iter().enumerate() {
                    let chunk = chunk_range(len, world, p);
                    prop_assert_eq!(&got[chunk.clone()], &input[chunk]);
                }
            }
            CollectiveKind::Broadcast => prop_assert_eq!(got, &ins[root.index()]),
            _ => unreachable!(),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// PLAN-1..4: every plan gives the reference result, deadlock- and race-free.
    #[test]
    fn every_plan_matches_the_sequential_reference(
        world in 1usize..=8,
        len in prop_oneof![0usize..=2, 0usize..300, 300usize..2000],
        root_pick in 0usize..8,
        seed in any::<u64>(),
    ) {
        for kind in KINDS {
            for algorithm in ALGORITHMS {
                for op in OPS {
                    check_plan(kind, algorithm, world, len, root_pick % world, op, seed)?;
                }
            }
        }
    }

    /// Ring all-reduce is bandwidth-optimal: each rank sends 2(N−1)/N·L elements, up to one
    /// element of rounding per chunk sent.
    #[test]
    fn ring_all_reduce_sends_two_n_minus_one_over_n_of_the_buffer(world in 1usize..=8, len in 0usize..5000) {
        let plan = plan(CollectiveKind::AllReduce, Algorithm::Ring, world, len, Rank(0)).expect("plan");
        let ideal = 2.0 * (world as f64 - 1.0) / world as f64 * len as f64;
        for sent in plan.elements_sent() {
            prop_assert!((sent as f64 - ideal).abs() <= 2.0 * (world as f64 - 1.0), "sent {sent}, ideal {ideal}");
        }
    }
}

#[test]
fn exhaustive_small_worlds_and_lengths() {
    for world in 1..=8 {
        for len in 0..=2 * world + 1 {
            for kind in KINDS {
                for algorithm in ALGORITHMS {
                    for op in OPS {
                        check_plan(kind, algorithm, world, len, world - 1, op, 7).unwrap();
                    }
                }
            }
        }
    }
}

#[test]
fn direct_plan_reads_only_what_owners_do_not_write() {
    // A broken direct plan: rank 1 copies rank 0's chunk while rank 0 reduces into it.
    let mut steps = direct_all_reduce(2, 4);
    steps[1].insert(
        0,
        Step::CopyFrom {
            from: Rank(0),
            range: 0..2,
        },
    );
    let bad = Plan {
        kind: CollectiveKind::AllReduce,
        algorithm: Algorithm::Direct,
        world: 2,
        len: 4,
        steps,
    };
    // Both directions race: rank 1 reads rank 0's 0..2 and writes its own 0..2, which
    // rank 0 reads.
    let err = simulate(&bad, &inputs(2, 4, 1), ReduceOp::Sum).unwrap_err();
    let is_race = matches!(&err, PlanSimError::Race { range, .. } if *range == (0..2));
    assert!(is_race, "{err}");
}

#[test]
fn simulator_reports_a_receive_without_a_send_as_deadlock() {
    let steps = vec![
        vec![Step::RecvCopy {
            from: Rank(1),
            range: 0..1,
        }],
        vec![],
    ];
    let bad = Plan {
        kind: CollectiveKind::Broadcast,
        algorithm: Algorithm::Ring,
        world: 2,
        len: 1,
        steps,
    };
    let err = simulate(&bad, &inputs(2, 1, 1), ReduceOp::Sum).unwrap_err();
    assert_eq!(
        err,
        PlanSimError::Deadlock {
            waiting: vec![Rank(0)]
        }
    );
}

#[test]
fn auto_picks_tree_for_small_buffers_in_large_groups_and_direct_otherwise() {
    let kind = CollectiveKind::AllReduce;
    assert_eq!(choose(Algorithm::Auto, kind, 4, 1024), Algorithm::Tree);
    assert_eq!(
        choose(Algorithm::Auto, kind, 4, 16 << 20),
        Algorithm::Direct
    );
    assert_eq!(choose(Algorithm::Auto, kind, 2, 1024), Algorithm::Direct);
    assert_eq!(choose(Algorithm::Ring, kind, 2, 16 << 20), Algorithm::Ring);
}

#[test]
fn broadcast_root_outside_the_group_has_no_plan() {
    assert!(plan(CollectiveKind::Broadcast, Algorithm::Ring, 3, 10, Rank(3)).is_none());
}
