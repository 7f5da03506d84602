//! PLANNER-1..3 and the bytes walked through a stage's instructions.

use proptest::prelude::*;

use super::*;

fn model(blocks: usize) -> ModelCosts {
    ModelCosts {
        name: "test".into(),
        blocks: (0..blocks)
            .map(|i| BlockCosts {
                params: vec![(1, 1000 + i as u64), (2, 500 + i as u64)],
                forward_s: 1e-4,
                forward_fixed_s: 1e-5,
                backward_s: 2e-4,
                backward_fixed_s: 2e-5,
                stash_bytes: 256,
                recompute_stash_bytes: 128,
                splits: true,
                tp_bytes: 512,
            })
            .collect(),
        tp_degrees: vec![1, 2],
    }
}

fn machine(devices: u32) -> Machine {
    Machine {
        devices,
        devices_per_node: 0,
        cores: devices,
        memory_per_device: 1 << 30,
        link: AlphaBeta {
            alpha_s: 1e-5,
            bytes_per_s: 1e9,
        },
        inter_link: AlphaBeta {
            alpha_s: 5e-5,
            bytes_per_s: 1e8,
        },
        tp_wait: vec![(2, 0.1)],
        replica_sync_s: 1e-4,
        optimizer_s_per_param: 1e-9,
        step_overhead_s: 1e-4,
        pipeline_send_s: (1e-5, 1e-5),
    }
}

proptest! {
    /// PLANNER-1: every listed layout uses the devices, splits the blocks and the batch, and
    /// appears once.
    #[test]
    fn planner_1_layouts_cover_the_machine_once(
        blocks in 1usize..9,
        devices in 1u32..9,
        batch in 1u32..65,
    ) {
        let m = model(blocks);
        let all = layouts(&m, devices, batch, &[1, 2, 4]);
        let mut seen = std::collections::BTreeSet::new();
        for l in &all {
            prop_assert!(seen.insert(*l));
            prop_assert_eq!(l.dp * l.pp * l.tp, devices);
            prop_assert_eq!(blocks as u32 % l.pp, 0);
            prop_assert_eq!(batch % (l.dp * l.micro_batches), 0);
            prop_assert!(l.pp > 1 || l.micro_batches == 1);
            prop_assert!(l.dp > 1 || l.zero == 0);
        }
        // dp over all devices (tp 1, pp 1) is there whenever the batch splits.
        let dp_only = all.iter().any(|l| l.dp == devices && l.pp == 1 && l.tp == 1);
        prop_assert_eq!(dp_only, batch % devices == 0);
    }

    /// PLANNER-2: more data-parallel devices (enough cores) never predict more pipeline time
    /// per step; the optimizer's share falls with ZeRO; bytes fall with every ZeRO stage.
    #[test]
    fn planner_2_more_replicas_and_zero_stages_never_cost_more(
        blocks in 1usize..6,
        k in 0u32..3,
    ) {
        let m = model(blocks);
        let batch = 16;
        let small = 1u32 << k;
        let base = Candidate { dp: small, ..Candidate::ONE_DEVICE };
        let big = Candidate { dp: 2 * small, ..base };
        let a = predict(&m, &machine(small), &base, batch).expect("fits");
        let b = predict(&m, &machine(2 * small), &big, batch).expect("fits");
        prop_assert!(b.pipeline_s <= a.pipeline_s * (1.0 + 1e-9));
        let mut last = u64::MAX;
        for zero in 0..=3u8 {
            let p = predict(&m, &machine(2 * small), &Candidate { zero, ..big }, batch).expect("fits");
            prop_assert!(p.bytes.grads + p.bytes.optimizer <= last);
            last = p.bytes.grads + p.bytes.optimizer;
        }
    }

    /// PLANNER-3 (nodes): the same layout over the same nodes never predicts a faster step
    /// when the link between them is slower, and one node as large as the machine
    /// predicts what the machine without nodes does.
    #[test]
    fn planner_3_slower_links_between_nodes_never_speed_a_step(
        blocks in 1usize..6,
        per_node_log in 0u32..3,
        pick in 0usize..64,
        slower in 1.0f64..100.0,
    ) {
        let m = model(blocks);
        let one = machine(8);
        let all = layouts(&m, 8, 16, &[1, 2, 4]);
        let layout = all[pick % all.len()];
        // A layout the schedule refuses is refused on every machine.
        let Ok(base) = predict(&m, &one, &layout, 16) else {
            return Ok(());
        };
        let whole = Machine { devices_per_node: 8, ..one.clone() };
        prop_assert_eq!(predict(&m, &whole, &layout, 16).expect("fits"), base);
        let fast = Machine { devices_per_node: 1 << per_node_log, inter_link: one.link, ..one.clone() };
        let slow = Machine {
            inter_link: AlphaBeta {
                alpha_s: one.link.alpha_s * slower,
                bytes_per_s: one.link.bytes_per_s / slower,
            },
            ..fast.clone()
        };
        let f = predict(&m, &fast, &layout, 16).expect("fits");
        let s = predict(&m, &slow, &layout, 16).expect("fits");
        prop_assert!(s.step_s >= f.step_s * (1.0 - 1e-12), "{layout}: {s:?} vs {f:?}");
        prop_assert_eq!(s.bytes, base.bytes);
        prop_assert_eq!(f.bytes, base.bytes);
    }
}

#[test]
fn zero_bytes_follow_the_stages_instructions() {
    // Four equal blocks of 1,000 elements (tp 1) on one stage, dp 4, one micro-batch: the
    // backwards run 3, 2, 1, 0; ZeRO-2 holds the block being reduced whole beside the
    // shards of those already reduced.
    let mut m = model(4);
    for b in &mut m.blocks {
        b.params = vec![(1, 1000), (2, 500)];
    }
    let dp4 = Candidate {
        dp: 4,
        zero: 2,
        ..Candidate::ONE_DEVICE
    };
    let p = predict(&m, &machine(4), &dp4, 16).expect("fits");
    assert_eq!(p.bytes.grads, 4000 + 3 * 1000);
    // ZeRO-3 without recomputation: every block's gathered parameters kept until its
    // backward, beside the shards.
    let p = predict(&m, &machine(4), &Candidate { zero: 3, ..dp4 }, 16).expect("fits");
    assert_eq!(p.bytes.params, 4 * 4000 + 4 * 1000);
    // A pipeline of 2 stages (blocks 0, 2 and 1, 3) with 4 micro-batches at dp 2: every
    // block's gradient accumulates whole before it can be scattered, and a ZeRO-3 block
    // keeps a gathered copy for each micro-batch forwarded and not yet backwarded.
    let piped = Candidate {
        dp: 2,
        pp: 2,
        micro_batches: 4,
        ..dp4
    };
    let p = predict(&m, &machine(4), &piped, 16).expect("fits");
    assert_eq!(p.bytes.grads, 2 * 4000);
    let schedule = schedule_of(&piped, 4).expect("a schedule");
    let most_in_flight = u64::from(schedule.peak_stash().into_iter().max().unwrap_or(1));
    let p = predict(&m, &machine(4), &Candidate { zero: 3, ..piped }, 16).expect("fits");
    assert!(p.bytes.params > 2 * 4000 + 4000, "{p:?}");
    assert!(p.bytes.params <= most_in_flight * 4000 + 4000, "{p:?}");
}

#[test]
fn groups_span_nodes_by_the_placement() {
    let m = Machine {
        devices_per_node: 4,
        ..machine(16)
    };
    // tp 4 fills a node; dp 4 over tp 4 spans four nodes, one member each.
    assert_eq!(m.group_span(4, 1), (4, 1));
    assert_eq!(m.group_span(4, 4), (1, 4));
    // dp 8 two apart (tp 2): two members per node, four nodes.
    assert_eq!(m.group_span(8, 2), (2, 4));
    // One node: everything inside.
    let one = machine(16);
    assert_eq!(one.group_span(16, 1), (16, 1));
}

#[test]
fn a_layout_that_does_not_fit_says_what_it_needs() {
    let m = model(4);
    let mut small = machine(2);
    small.memory_per_device = 1000;
    let l = Candidate {
        dp: 2,
        ..Candidate::ONE_DEVICE
    };
    match predict(&m, &small, &l, 8) {
        Err(Unfit::Memory { needs, has }) => {
            assert_eq!(has, 1000);
            assert!(needs > has);
        }
        other => panic!("{other:?}"),
    }
    let err = predict(&m, &machine(2), &Candidate { dp: 3, ..l }, 8).unwrap_err();
    assert!(err.to_string().contains("3"), "{err}");
}

#[test]
fn equal_stages_give_the_schedules_bubble() {
    let m = model(4);
    let l = Candidate {
        pp: 2,
        micro_batches: 4,
        ..Candidate::ONE_DEVICE
    };
    let p = predict(&m, &machine(2), &l, 8).expect("fits");
    assert!(p.bubble > 0.0 && p.bubble < 0.5, "{p:?}");
    let one = predict(
        &m,
        &machine(1),
        &Candidate {
            pp: 1,
            micro_batches: 1,
            ..l
        },
        8,
    )
    .expect("fits");
    assert!(p.pipeline_s < one.pipeline_s, "{p:?} vs {one:?}");
}
