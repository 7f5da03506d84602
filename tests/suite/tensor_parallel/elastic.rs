//! ELASTIC-6: block and pipeline jobs resized along dp while they run. The fault plan asks
//! for each resize at a fixed step (FAULT-2), so a run replays bitwise; the global batch stays
//! the same, so every run equals the one-device loop on the same batches, whatever the
//! number of replicas at each step.

use super::*;

/// A composition and the resizes its fault plan asks for: (step, replicas).
struct Resizing {
    composed: Composed,
    resizes: &'static [(u64, u32)],
}

impl Resizing {
    fn job(&self, init: &Gpt) -> Job<PipelineModel, Window> {
        let plan = self
            .resizes
            .iter()
            .fold(FaultPlan::new(6), |plan, &(step, n)| {
                plan.with_resize(step, n)
            });
        let c = &self.composed;
        let mut b = builder(c.layout, init)
            .zero(c.zero)
            .compression(c.compression)
            .fault_plan(plan);
        if let Some(clip) = c.clip {
            b = b.clip_grad_norm(clip);
        }
        b.build().unwrap_or_else(|e| panic!("{}: {e}", c.name))
    }

    /// The replicas each step ran with, as the plan says: the first size until the first
    /// resize, each resize's size from its step on.
    fn planned_sizes(&self) -> Vec<u32> {
        (0..STEPS)
            .map(|s| {
                self.resizes
                    .iter()
                    .filter(|&&(at, _)| at <= s)
                    .map(|&(_, n)| n)
                    .next_back()
                    .unwrap_or(self.composed.layout.dp)
            })
            .collect()
    }

    /// Each step ran on every rank of its mesh, each rank at its place in the resized layout
    /// (its rank follows the layout, its block does not move); under ZeRO, each (stage, tp
    /// rank)'s data-parallel group held its momentum exactly once, re-sharded at each size.
    fn assert_distributed(&self, init: &Gpt, steps: &[StepDone]) {
        let Composed { name, layout, .. } = self.composed;
        let (pp, tp) = (layout.pp, layout.tp);
        assert_eq!(steps.len() as u64, STEPS, "{name}");
        for (step, dp) in steps.iter().zip(self.planned_sizes()) {
            let mesh = meshwork::mesh::Layout::new(dp, pp, tp).expect("a valid layout");
            assert_eq!(
                step.replicas.len(),
                mesh.world_size() as usize,
                "{name}: step {} ran on every rank of dp {dp}",
                step.step
            );
            let mut optimizer = std::collections::HashMap::<(u32, u32), u64>::new();
            for r in &step.replicas {
                let place = meshwork::mesh::Coord {
                    dp: r.stage.replica,
                    pp: r.stage.stage,
                    tp: r.stage.tp,
                };
                assert_eq!(
                    mesh.rank_of(place),
                    Some(r.rank),
                    "{name}: step {}: {} reports as its rank in dp {dp}",
                    step.step,
                    r.stage
                );
                let p = r.pipeline.as_ref().expect("a block job's record");
                *optimizer.entry((r.stage.stage, r.stage.tp)).or_default() += p.memory.optimizer;
            }
            if self.composed.zero != ZeroStage::Off {
                for ((stage, t), bytes) in optimizer {
                    let held = stage_elements(init, pp, stage, tp, t as usize);
                    assert_eq!(
                        bytes,
                        4 * held as u64,
                        "{name}: step {}: stage {stage} tp {t}'s {dp} ranks hold its momentum once",
                        step.step
                    );
                }
            }
        }
    }

    /// Trains twice: the planned resizes happen (a `Resized` event each), every step ran on
    /// its mesh, the result is within `TOLERANCE` of one device and bitwise repeatable.
    async fn equals_one_device(&self) {
        let name = self.composed.name;
        let init = initial();
        let (trained, events) = run(self.job(&init)).await;
        let resized: Vec<(u32, u32)> = events
            .iter()
            .filter_map(|e| match e {
                JobEvent::Resized { from, to, .. } => Some((*from, *to)),
                _ => None,
            })
            .collect();
        let mut from = self.composed.layout.dp;
        let planned: Vec<(u32, u32)> = self
            .resizes
            .iter()
            .map(|&(_, to)| (std::mem::replace(&mut from, to), to))
            .collect();
        assert_eq!(resized, planned, "{name}: {:#?}", events_summary(&events));
        let steps = steps_of(&events);
        self.assert_distributed(&init, &steps);
        let want = self.composed.reference(&init, &steps, self.composed.clip);
        let worst = compare_parameters(&trained, &want, TOLERANCE)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{name}: worst relative difference {worst:e}");
        if self.composed.clip.is_some() {
            let unclipped = self.composed.reference(&init, &steps, None);
            assert!(
                compare_parameters(&unclipped, &want, TOLERANCE).is_err(),
                "{name}: the clip bit"
            );
        }
        let (again, _) = run(self.job(&init)).await;
        assert_eq!(
            parameter_bits(&again),
            parameter_bits(&trained),
            "{name}: bitwise repeatable"
        );
    }
}

/// ELASTIC-6: a pipeline grows and shrinks along dp (its twins' state copied to joining
/// replicas); ZeRO-1 over tensor-parallel blocks and ZeRO-3 over a pipeline re-shard their
/// state over each new data-parallel group; each equals one device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_6_block_and_pipeline_jobs_resize_along_dp_and_equal_one_device() {
    for case in [
        Resizing {
            composed: Composed::new("dp 2 × pp 2, 2 → 4 → 1 replicas", 2, 2, 1),
            resizes: &[(3, 4), (6, 1)],
        },
        Resizing {
            composed: Composed {
                zero: ZeroStage::One,
                clip: Some(0.3),
                ..Composed::new("dp 2 × tp 2, ZeRO-1, clip, 2 → 1 → 4 replicas", 2, 1, 2)
            },
            resizes: &[(3, 1), (6, 4)],
        },
        Resizing {
            composed: Composed {
                zero: ZeroStage::Three,
                ..Composed::new("dp 2 × pp 2, ZeRO-3, 2 → 4 → 2 replicas", 2, 2, 1)
            },
            resizes: &[(3, 4), (7, 2)],
        },
    ] {
        case.equals_one_device().await;
    }
}

/// A dp 2 × pp 2 job (with `extra` settings) whose plan asks for `replicas` before step 3:
/// the one `ResizeRefused` reason, after checking every step ran on the 2 × 2 mesh.
async fn refused_resize(
    extra: impl FnOnce(JobBuilder<PipelineModel, Window>) -> JobBuilder<PipelineModel, Window>,
    replicas: u32,
) -> String {
    let init = initial();
    let layout = Layout {
        dp: 2,
        pp: 2,
        tp: 1,
    };
    let job = extra(builder(layout, &init))
        .fault_plan(FaultPlan::new(6).with_resize(3, replicas))
        .build()
        .expect("a valid job");
    let (_, events) = run(job).await;
    let refused: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::ResizeRefused { requested, reason } if *requested == replicas => Some(reason),
            _ => None,
        })
        .collect();
    assert_eq!(refused.len(), 1, "{:#?}", events_summary(&events));
    assert!(
        steps_of(&events).iter().all(|s| s.replicas.len() == 4),
        "every step ran on the 2 × 2 mesh"
    );
    refused[0].clone()
}

/// Local updates over blocks keep each rank's own parameters, which do not move onto another
/// number of replicas: the planned resize is refused with that reason and the job goes on at
/// its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_6_a_resize_of_local_updates_over_blocks_is_refused_with_its_reason() {
    let reason = refused_resize(|b| b.local_updates(LocalUpdates::local_sgd(2)), 4).await;
    assert!(reason.contains("local updates"), "{reason}");
}

/// JOB-1 at every size: a pipeline's micro-batches each weigh 1 / (micro-batches × replicas),
/// so a size that does not cut the global batch evenly (8 samples into 3 replicas × 2
/// micro-batches) is refused with the reason, and the job goes on at its size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_6_a_size_that_does_not_cut_the_batch_is_refused() {
    let reason = refused_resize(|b| b, 3).await;
    assert!(
        reason.contains("does not divide into 3 replica(s) × 2 micro-batch(es)"),
        "{reason}"
    );
}
