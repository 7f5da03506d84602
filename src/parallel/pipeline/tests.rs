use proptest::prelude::*;

use super::*;

fn f(mb: u32) -> Instr {
    Instr::Forward {
        mb: MicroBatch(mb),
        chunk: Chunk(0),
    }
}
fn b(mb: u32) -> Instr {
    Instr::Backward {
        mb: MicroBatch(mb),
        chunk: Chunk(0),
    }
}
fn send_act(mb: u32, to: u32) -> Instr {
    Instr::SendActivation {
        mb: MicroBatch(mb),
        chunk: Chunk(0),
        to: StageIndex(to),
    }
}
fn recv_act(mb: u32, from: u32) -> Instr {
    Instr::RecvActivation {
        mb: MicroBatch(mb),
        chunk: Chunk(0),
        from: StageIndex(from),
    }
}
fn send_grad(mb: u32, to: u32) -> Instr {
    Instr::SendGradient {
        mb: MicroBatch(mb),
        chunk: Chunk(0),
        to: StageIndex(to),
    }
}
fn recv_grad(mb: u32, from: u32) -> Instr {
    Instr::RecvGradient {
        mb: MicroBatch(mb),
        chunk: Chunk(0),
        from: StageIndex(from),
    }
}

/// The bubble equality of PIPE-5 checked exactly, in integers:
/// `(K·makespan − compute) / (K·makespan) = (K−1) / (vM+K−1)`.
fn assert_textbook_bubble(report: &SimReport, schedule: &Schedule) {
    let k = u64::from(report.stages);
    let vm = u64::from(schedule.virtual_stages()) * u64::from(schedule.micro_batches());
    let idle = k * report.makespan - report.compute_total();
    assert_eq!(
        idle * (vm + k - 1),
        (k - 1) * k * report.makespan,
        "{schedule:?} on {k} stages: measured bubble {} vs textbook {}",
        report.bubble,
        schedule.theoretical_bubble(report.stages)
    );
    assert!((report.bubble - schedule.theoretical_bubble(report.stages)).abs() < 1e-12);
}

/// Any schedule a configuration accepts: GPipe, 1F1B, or interleaved with M a multiple of K.
fn any_schedule() -> impl Strategy<Value = (u32, Schedule)> {
    (1u32..=8, 1u32..=32, 1u32..=4, 0u8..3).prop_map(|(k, m, v, which)| {
        let schedule = match which {
            0 => Schedule::GPipe { micro_batches: m },
            1 => Schedule::OneFOneB { micro_batches: m },
            _ => Schedule::Interleaved {
                // A multiple of K, at most 32.
                micro_batches: k * (1 + (m - 1) % (32 / k)),
                virtual_stages: v,
            },
        };
        (k, schedule)
    })
}

// --- PIPE-1..3: hand-checked lists -------------------------------------------------------------

#[test]
fn pipe1_one_f_one_b_two_stages_four_micro_batches_is_the_textbook_list() {
    let schedule = Schedule::OneFOneB { micro_batches: 4 }
        .instructions(2)
        .expect("1F1B serves 2 stages");
    let stage0 = vec![
        f(0),
        send_act(0, 1),
        f(1),
        send_act(1, 1),
        recv_grad(0, 1),
        b(0),
        f(2),
        send_act(2, 1),
        recv_grad(1, 1),
        b(1),
        f(3),
        send_act(3, 1),
        recv_grad(2, 1),
        b(2),
        recv_grad(3, 1),
        b(3),
    ];
    let stage1: Vec<Instr> = (0..4)
        .flat_map(|m| [recv_act(m, 0), f(m), b(m), send_grad(m, 0)])
        .collect();
    assert_eq!(schedule.lists(), [stage0, stage1]);
    assert_eq!(schedule.link_capacity(), LINK_CAPACITY);

    let report = simulate(&schedule, &Costs::unit()).expect("the textbook list runs");
    // Stage 0 waits for the first gradient once (t = 2..3) and at the end (t = 8..9).
    let compute_starts = |d: usize| -> Vec<u64> {
        report.timeline[d]
            .iter()
            .filter(|t| t.instr.is_compute())
            .map(|t| t.start)
            .collect()
    };
    assert_eq!(compute_starts(0), [0, 1, 3, 4, 5, 6, 7, 9]);
    assert_eq!(compute_starts(1), [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(report.makespan, 10);
    assert!((report.bubble - 0.2).abs() < 1e-12);
    assert_eq!(
        report
            .per_stage
            .iter()
            .map(|s| s.peak_stash)
            .collect::<Vec<_>>(),
        [2, 1]
    );
    assert_eq!(report.per_stage[0].idle, 2);
    assert_eq!(report.per_stage[1].idle, 2);
}

#[test]
fn pipe1_gpipe_runs_all_forwards_then_all_backwards() {
    let schedule = Schedule::GPipe { micro_batches: 3 }
        .instructions(3)
        .expect("GPipe serves 3 stages");
    let middle: Vec<Instr> = schedule
        .list(StageIndex(1))
        .iter()
        .copied()
        .filter(Instr::is_compute)
        .collect();
    assert_eq!(middle, [f(0), f(1), f(2), b(0), b(1), b(2)]);
    assert_eq!(
        schedule.list(StageIndex(1))[..3],
        [recv_act(0, 0), f(0), send_act(0, 2)]
    );
    assert_eq!(schedule.peak_stash(), [3, 3, 3]);
}

#[test]
fn pipe1_interleaved_chunks_follow_megatron_layout_and_wrap_around() {
    // K = 2, v = 2: blocks 0, 1, 2, 3 on stages 0, 1, 0, 1.
    let schedule = Schedule::Interleaved {
        micro_batches: 2,
        virtual_stages: 2,
    }
    .instructions(2)
    .expect("M = 2 is a multiple of K = 2");
    assert_eq!(schedule.blocks(), 4);
    assert_eq!(schedule.block(StageIndex(0), Chunk(1)), 2);
    assert_eq!(schedule.placement(3), (StageIndex(1), Chunk(1)));
    let stage1 = schedule.list(StageIndex(1));
    // Chunk 0 of stage 1 (block 1) sends its output back to stage 0 (block 2).
    assert!(stage1.contains(&Instr::SendActivation {
        mb: MicroBatch(0),
        chunk: Chunk(0),
        to: StageIndex(0),
    }));
    // Chunk 1 of stage 1 is the last block: no activation sent, no gradient received.
    assert!(!stage1.iter().any(|i| matches!(
        i,
        Instr::SendActivation {
            chunk: Chunk(1),
            ..
        } | Instr::RecvGradient {
            chunk: Chunk(1),
            ..
        }
    )));
    // Chunk 0 of stage 0 is the first block: nothing received for it, no gradient sent.
    assert!(!schedule.list(StageIndex(0)).iter().any(|i| matches!(
        i,
        Instr::RecvActivation {
            chunk: Chunk(0),
            ..
        } | Instr::SendGradient {
            chunk: Chunk(0),
            ..
        }
    )));
    let report = simulate(&schedule, &Costs::unit()).expect("interleaved runs");
    assert_textbook_bubble(
        &report,
        &Schedule::Interleaved {
            micro_batches: 2,
            virtual_stages: 2,
        },
    );
}

#[test]
fn pipe1_one_stage_interleaved_sends_to_itself_and_has_no_bubble() {
    let schedule = Schedule::Interleaved {
        micro_batches: 3,
        virtual_stages: 3,
    };
    let lists = schedule.instructions(1).expect("K = 1 divides every M");
    assert!(lists.list(StageIndex(0)).contains(&Instr::SendActivation {
        mb: MicroBatch(2),
        chunk: Chunk(1),
        to: StageIndex(0),
    }));
    let report = simulate(&lists, &Costs::unit()).expect("a single stage runs");
    assert_eq!(report.makespan, 18);
    assert_eq!(report.bubble, 0.0);
}

#[test]
fn pipe1_interleaved_with_one_chunk_is_one_f_one_b() {
    for k in 1..=4 {
        let m = 2 * k;
        let interleaved = Schedule::Interleaved {
            micro_batches: m,
            virtual_stages: 1,
        }
        .instructions(k)
        .expect("M is a multiple of K");
        let one_f_one_b = Schedule::OneFOneB { micro_batches: m }
            .instructions(k)
            .expect("1F1B serves any M");
        assert_eq!(interleaved, one_f_one_b);
    }
}

// --- PIPE-7: typed errors ----------------------------------------------------------------------

#[test]
fn pipe7_interleaved_refuses_micro_batches_not_a_multiple_of_stages() {
    let err = Schedule::Interleaved {
        micro_batches: 6,
        virtual_stages: 2,
    }
    .instructions(4)
    .expect_err("6 is not a multiple of 4");
    assert_eq!(
        err,
        ScheduleError::MicroBatchesNotMultipleOfStages {
            micro_batches: 6,
            stages: 4
        }
    );
    let message = err.to_string();
    assert!(message.contains("use 4 or 8 micro-batches"), "{message}");
}

#[test]
fn pipe7_zero_stages_micro_batches_or_chunks_are_refused() {
    assert_eq!(
        Schedule::OneFOneB { micro_batches: 4 }.instructions(0),
        Err(ScheduleError::NoStages)
    );
    assert_eq!(
        Schedule::GPipe { micro_batches: 0 }.instructions(2),
        Err(ScheduleError::NoMicroBatches)
    );
    assert_eq!(
        Schedule::OneFOneB { micro_batches: 0 }.instructions(2),
        Err(ScheduleError::NoMicroBatches)
    );
    assert_eq!(
        Schedule::Interleaved {
            micro_batches: 4,
            virtual_stages: 0
        }
        .instructions(2),
        Err(ScheduleError::NoVirtualStages)
    );
    assert_eq!(
        Schedule::Interleaved {
            micro_batches: u32::MAX,
            virtual_stages: 4
        }
        .instructions(1),
        Err(ScheduleError::TooLarge {
            stages: 1,
            micro_batches: u32::MAX,
            virtual_stages: 4
        })
    );
}

#[test]
fn pipe7_one_f_one_b_accepts_fewer_micro_batches_than_stages_as_gpipe_order() {
    let one_f_one_b = Schedule::OneFOneB { micro_batches: 2 }
        .instructions(4)
        .expect("1F1B serves M < K");
    let gpipe = Schedule::GPipe { micro_batches: 2 }
        .instructions(4)
        .expect("GPipe serves M < K");
    // Stages 0..2 warm up with every micro-batch, exactly GPipe's order there.
    assert_eq!(one_f_one_b.list(StageIndex(0)), gpipe.list(StageIndex(0)));
    assert_eq!(one_f_one_b.peak_stash(), [2, 2, 2, 1]);
}

#[test]
fn pipe7_hand_made_lists_need_one_list_per_stage_and_room_in_links() {
    assert_eq!(
        PipelineSchedule::from_lists(2, 1, 1, 1, vec![vec![]]),
        Err(ScheduleError::ListCount {
            lists: 1,
            stages: 2
        })
    );
    assert_eq!(
        PipelineSchedule::from_lists(1, 1, 1, 0, vec![vec![f(0), b(0)]]),
        Err(ScheduleError::NoLinkCapacity)
    );
    let one = PipelineSchedule::from_lists(1, 1, 1, 1, vec![vec![f(0), b(0)]])
        .expect("a valid one-stage schedule");
    assert_eq!(
        one.clone().with_link_capacity(0),
        Err(ScheduleError::NoLinkCapacity)
    );
    assert_eq!(
        simulate(&one, &Costs::unit().with_stage(StageIndex(3), 1, 1)),
        Err(ScheduleSimError::UnknownStageInCosts {
            stage: StageIndex(3),
            stages: 1
        })
    );
}

// --- The validator and the simulator catch broken lists ----------------------------------------

fn two_stage_1f1b() -> PipelineSchedule {
    Schedule::OneFOneB { micro_batches: 4 }
        .instructions(2)
        .expect("1F1B serves 2 stages")
}

fn with_lists(base: &PipelineSchedule, lists: Vec<Vec<Instr>>) -> PipelineSchedule {
    PipelineSchedule::from_lists(
        base.stages(),
        base.micro_batches(),
        base.virtual_stages(),
        base.link_capacity(),
        lists,
    )
    .expect("same dimensions")
}

#[test]
fn pipe1_dropped_backward_is_missing() {
    let base = two_stage_1f1b();
    let mut lists = base.lists().to_vec();
    lists[1].retain(|i| *i != b(2));
    let broken = with_lists(&base, lists);
    let expected = ScheduleSimError::MissingOrDuplicate {
        stage: StageIndex(1),
        kind: InstrKind::Backward,
        mb: MicroBatch(2),
        chunk: Chunk(0),
        count: 0,
    };
    assert_eq!(validate(&broken), Err(expected.clone()));
    assert_eq!(simulate(&broken, &Costs::unit()), Err(expected));
}

#[test]
fn pipe1_duplicated_forward_wrong_peer_and_out_of_range_are_caught() {
    let base = two_stage_1f1b();
    let mut lists = base.lists().to_vec();
    lists[0].push(f(1));
    assert_eq!(
        validate(&with_lists(&base, lists)),
        Err(ScheduleSimError::MissingOrDuplicate {
            stage: StageIndex(0),
            kind: InstrKind::Forward,
            mb: MicroBatch(1),
            chunk: Chunk(0),
            count: 2,
        })
    );

    let mut lists = base.lists().to_vec();
    lists[0][1] = send_act(0, 0);
    assert_eq!(
        validate(&with_lists(&base, lists)),
        Err(ScheduleSimError::WrongPeer {
            stage: StageIndex(0),
            index: 1,
            instr: send_act(0, 0),
            expected: Some(StageIndex(1)),
        })
    );

    // The first stage receives no input activation.
    let mut lists = base.lists().to_vec();
    lists[0].insert(0, recv_act(0, 1));
    assert!(matches!(
        validate(&with_lists(&base, lists)),
        Err(ScheduleSimError::WrongPeer {
            expected: None,
            index: 0,
            ..
        })
    ));

    let mut lists = base.lists().to_vec();
    lists[1].push(f(4));
    assert!(matches!(
        validate(&with_lists(&base, lists)),
        Err(ScheduleSimError::OutOfRange {
            stage: StageIndex(1),
            ..
        })
    ));
}

#[test]
fn pipe2_forward_before_its_input_is_an_order_violation() {
    let base = two_stage_1f1b();
    let mut lists = base.lists().to_vec();
    lists[1].swap(0, 1); // F0 before RecvActivation 0
    assert_eq!(
        simulate(&with_lists(&base, lists), &Costs::unit()),
        Err(ScheduleSimError::OrderViolation {
            stage: StageIndex(1),
            index: 0,
            instr: f(0),
            needs: Needs::Input,
        })
    );
}

#[test]
fn pipe2_backward_before_its_forward_is_an_order_violation() {
    let base = two_stage_1f1b();
    let mut lists = base.lists().to_vec();
    lists[1].swap(1, 2); // B0 before F0 on the last stage
    assert_eq!(
        simulate(&with_lists(&base, lists), &Costs::unit()),
        Err(ScheduleSimError::OrderViolation {
            stage: StageIndex(1),
            index: 1,
            instr: b(0),
            needs: Needs::Forward,
        })
    );
}

#[test]
fn pipe3_receives_in_another_order_than_sent_are_caught() {
    let base = two_stage_1f1b();
    let mut lists = base.lists().to_vec();
    let (first, second) = (0, 4); // RecvActivation 0 and 1 on stage 1
    lists[1].swap(first, second);
    assert_eq!(
        simulate(&with_lists(&base, lists), &Costs::unit()),
        Err(ScheduleSimError::MessageOrder {
            stage: StageIndex(1),
            index: 0,
            instr: recv_act(1, 0),
            found_mb: MicroBatch(0),
            found_chunk: Chunk(0),
        })
    );
}

#[test]
fn pipe4_waiting_for_a_gradient_before_sending_the_activation_deadlocks() {
    let base = two_stage_1f1b();
    let mut lists = base.lists().to_vec();
    // Stage 0: F0, RG0, SA0, … — the gradient of 0 needs the activation of 0.
    let rg0 = lists[0]
        .iter()
        .position(|i| *i == recv_grad(0, 1))
        .expect("stage 0 receives gradient 0");
    let moved = lists[0].remove(rg0);
    lists[0].insert(1, moved);
    let broken = with_lists(&base, lists);
    assert_eq!(validate(&broken), Ok(()));
    assert_eq!(
        simulate(&broken, &Costs::unit()),
        Err(ScheduleSimError::Deadlock {
            stage: StageIndex(0),
            index: 1,
            waiting_for: recv_grad(0, 1),
        })
    );
}

#[test]
fn pipe4_lists_needing_more_buffering_than_the_links_hold_deadlock_on_a_full_link() {
    // Stage 0 runs GPipe (sends all activations before it reads a gradient), stage 1 runs
    // 1F1B (sends each gradient as soon as it can): with one slot per link each waits for the
    // other to take a message; a second slot breaks the cycle.
    let gpipe = Schedule::GPipe { micro_batches: 4 }
        .instructions(2)
        .expect("GPipe serves 2 stages");
    let one_f_one_b = two_stage_1f1b();
    let lists = vec![
        gpipe.list(StageIndex(0)).to_vec(),
        one_f_one_b.list(StageIndex(1)).to_vec(),
    ];
    let mixed = with_lists(&gpipe, lists);
    assert_eq!(validate(&mixed), Ok(()));
    assert_eq!(
        simulate(&mixed, &Costs::unit()),
        Err(ScheduleSimError::Deadlock {
            stage: StageIndex(0),
            index: 7,
            waiting_for: send_act(3, 1),
        })
    );
    let roomy = mixed.with_link_capacity(2).expect("capacity 2 is valid");
    let report = simulate(&roomy, &Costs::unit()).expect("2 messages per link suffice");
    assert_eq!(report.per_stage[0].peak_stash, 4);
}

// --- Summaries of measured timelines ----------------------------------------------------------

#[test]
fn pipe5_summary_of_a_measured_step_counts_receive_waits_as_idle() {
    let at = |instr, start, end| TimedInstr { instr, start, end };
    // A measured step starting at tick 100; receives last as long as they waited.
    let timeline = vec![
        vec![
            at(f(0), 100, 110),
            at(send_act(0, 1), 110, 112),
            at(recv_grad(0, 1), 112, 143),
            at(b(0), 143, 163),
        ],
        vec![
            at(recv_act(0, 0), 100, 112),
            at(f(0), 112, 122),
            at(b(0), 122, 142),
            at(send_grad(0, 0), 142, 143),
        ],
    ];
    let summary = summarize(&timeline);
    assert_eq!(summary.makespan, 63);
    let shares: Vec<(u64, u64, u64)> = summary
        .per_stage
        .iter()
        .map(|s| (s.compute, s.communication, s.idle))
        .collect();
    assert_eq!(shares, [(30, 2, 31), (30, 1, 32)]);
    assert!((summary.bubble - (1.0 - 60.0 / 126.0)).abs() < 1e-12);
    assert_eq!(summary.per_stage[0].peak_stash, 1);
    assert_eq!(summarize(&[]).bubble, 0.0);
}

// --- SVG ---------------------------------------------------------------------------------------

#[test]
fn svg_has_one_box_per_forward_and_backward_with_micro_batch_labels() {
    let schedule = Schedule::Interleaved {
        micro_batches: 4,
        virtual_stages: 2,
    }
    .instructions(2)
    .expect("M is a multiple of K");
    let report = simulate(&schedule, &Costs::new(1, 2)).expect("runs");
    let svg = render_svg(&report.timeline);
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    let compute = schedule
        .lists()
        .iter()
        .flatten()
        .filter(|i| i.is_compute())
        .count();
    assert_eq!(compute, 2 * 2 * 4 * 2);
    assert_eq!(svg.matches("<rect").count(), compute);
    assert_eq!(svg.matches("</rect>").count(), compute);
    // One label per box plus one per stage row.
    assert_eq!(svg.matches("<text").count(), compute + 2);
    assert_eq!(svg.matches("</text>").count(), compute + 2);
    assert!(svg.contains(">3</text>"));
    assert!(svg.contains("#4c78a8") && svg.contains("#f58518"));
    assert_eq!(render_svg(&[]).matches("<rect").count(), 0);
}

#[test]
fn schedules_round_trip_through_json() {
    for schedule in [
        Schedule::GPipe { micro_batches: 8 },
        Schedule::OneFOneB { micro_batches: 4 },
        Schedule::Interleaved {
            micro_batches: 8,
            virtual_stages: 2,
        },
    ] {
        let json = serde_json::to_string(&schedule).expect("serializes");
        let back: Schedule = serde_json::from_str(&json).expect("deserializes");
        assert_eq!(back, schedule);
    }
}

// --- Properties over random K, M, v ------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn pipe1_pipe5_every_schedule_validates_and_unit_bubble_is_textbook(
        (k, schedule) in any_schedule()
    ) {
        let lists = schedule.instructions(k).expect("accepted configuration");
        prop_assert_eq!(validate(&lists), Ok(()));
        let report = simulate(&lists, &Costs::unit()).expect("generated lists run");
        assert_textbook_bubble(&report, &schedule);
        // Busy, sending and idle time add up to the step on every stage.
        for s in &report.per_stage {
            prop_assert_eq!(s.compute + s.communication + s.idle, report.makespan);
        }
        prop_assert_eq!(
            report.per_stage.iter().map(|s| s.peak_stash).collect::<Vec<_>>(),
            lists.peak_stash()
        );
        // The report is the timeline's summary: measured from it, not from a formula.
        let summary = summarize(&report.timeline);
        prop_assert_eq!(summary.makespan, report.makespan);
        prop_assert_eq!(&summary.per_stage, &report.per_stage);
        // Receives sit right before the compute that needs them, sends right after the
        // compute that produced what they send.
        for list in lists.lists() {
            for (n, instr) in list.iter().enumerate() {
                let same = |i: Option<&Instr>, kind| {
                    i.is_some_and(|i| i.kind() == kind && i.mb() == instr.mb() && i.chunk() == instr.chunk())
                };
                match instr.kind() {
                    InstrKind::RecvActivation => prop_assert!(same(list.get(n + 1), InstrKind::Forward)),
                    InstrKind::RecvGradient => prop_assert!(same(list.get(n + 1), InstrKind::Backward)),
                    InstrKind::SendActivation => prop_assert!(same(list.get(n.wrapping_sub(1)), InstrKind::Forward)),
                    InstrKind::SendGradient => prop_assert!(same(list.get(n.wrapping_sub(1)), InstrKind::Backward)),
                    InstrKind::Forward | InstrKind::Backward => {}
                }
            }
        }
    }

    #[test]
    fn pipe5_bubble_is_textbook_for_any_uniform_forward_and_backward_cost(
        (k, schedule) in any_schedule(),
        forward in 1u64..=5,
        backward in 1u64..=9,
    ) {
        let lists = schedule.instructions(k).expect("accepted configuration");
        let report = simulate(&lists, &Costs::new(forward, backward)).expect("runs");
        assert_textbook_bubble(&report, &schedule);
    }

    #[test]
    fn pipe6_peak_stash_gpipe_is_m_1f1b_at_most_k_interleaved_bounded(
        (k, schedule) in any_schedule()
    ) {
        let lists = schedule.instructions(k).expect("accepted configuration");
        let report = simulate(&lists, &Costs::unit()).expect("runs");
        let m = schedule.micro_batches();
        let v = schedule.virtual_stages();
        for s in &report.per_stage {
            let d = s.stage.0;
            match schedule {
                Schedule::GPipe { .. } => prop_assert_eq!(s.peak_stash, m),
                Schedule::OneFOneB { .. } => {
                    prop_assert_eq!(s.peak_stash, (k - d).min(m));
                    prop_assert!(s.peak_stash <= k);
                }
                Schedule::Interleaved { .. } => {
                    let bound = ((k - d - 1) * 2 + (v - 1) * k + 1).min(v * m);
                    if v == 1 {
                        prop_assert_eq!(s.peak_stash, (k - d).min(m));
                    } else {
                        prop_assert_eq!(s.peak_stash, bound);
                    }
                }
            }
        }
    }

    #[test]
    fn pipe4_generated_lists_never_deadlock_whatever_the_costs(
        (k, schedule) in any_schedule(),
        stage_costs in proptest::collection::vec((0u64..6, 0u64..10), 8),
        send in 0u64..3,
        latency in 0u64..4,
    ) {
        let lists = schedule.instructions(k).expect("accepted configuration");
        prop_assert_eq!(lists.link_capacity(), 1);
        let mut costs = Costs::new(1, 2).with_communication(send, latency);
        for (d, (fw, bw)) in stage_costs.iter().take(k as usize).enumerate() {
            costs = costs.with_stage(StageIndex(d as u32), *fw, *bw);
        }
        let report = simulate(&lists, &costs).expect("no deadlock, no order violation");
        // More room in the links never makes the lists deadlock.
        for capacity in [2, 3] {
            let roomy = lists.clone().with_link_capacity(capacity).expect("capacity ≥ 1");
            prop_assert!(simulate(&roomy, &costs).is_ok());
        }
        // No stage can finish before its own work is done.
        for s in &report.per_stage {
            prop_assert!(s.compute + s.communication <= report.makespan);
        }
        // Every instruction ran once, in list order, without overlapping its neighbours.
        for (d, timeline) in report.timeline.iter().enumerate() {
            prop_assert_eq!(timeline.len(), lists.lists()[d].len());
            for pair in timeline.windows(2) {
                prop_assert!(pair[0].end <= pair[1].start);
            }
        }
    }

    #[test]
    fn pipe4_broken_lists_are_caught(
        (k, schedule) in any_schedule(),
        pick in any::<prop::sample::Index>(),
    ) {
        prop_assume!(k >= 2);
        let base = schedule.instructions(k).expect("accepted configuration");
        // A dropped backward is missing.
        let mut lists = base.lists().to_vec();
        let stage = pick.index(k as usize);
        let backwards: Vec<usize> = lists[stage]
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i, Instr::Backward { .. }))
            .map(|(n, _)| n)
            .collect();
        let dropped = lists[stage].remove(backwards[pick.index(backwards.len())]);
        prop_assert!(
            matches!(
                simulate(&with_lists(&base, lists), &Costs::unit()),
                Err(ScheduleSimError::MissingOrDuplicate { kind: InstrKind::Backward, count: 0, mb, chunk, .. })
                    if mb == dropped.mb() && chunk == dropped.chunk()
            ),
            "dropping {:?}", dropped
        );
        // Stage 0 waiting for its first gradient right after its first forward, before
        // sending that forward's activation, deadlocks: the gradient needs the activation.
        let mut lists = base.lists().to_vec();
        let first_recv = lists[0]
            .iter()
            .position(|i| i.kind() == InstrKind::RecvGradient)
            .expect("stage 0 receives with K ≥ 2");
        let moved = lists[0].remove(first_recv);
        lists[0].insert(1, moved);
        let result = simulate(&with_lists(&base, lists), &Costs::unit());
        prop_assert_eq!(
            result,
            Err(ScheduleSimError::Deadlock { stage: StageIndex(0), index: 1, waiting_for: moved })
        );
        // A forward swapped with the receive of its input runs too early.
        let mut lists = base.lists().to_vec();
        let last = k as usize - 1;
        let recv = lists[last]
            .iter()
            .position(|i| i.kind() == InstrKind::RecvActivation)
            .expect("the last stage receives with K ≥ 2");
        lists[last].swap(recv, recv + 1);
        let result = simulate(&with_lists(&base, lists), &Costs::unit());
        prop_assert!(
            matches!(result, Err(ScheduleSimError::OrderViolation { needs: Needs::Input, .. })),
            "{:?}", result
        );
    }
}
