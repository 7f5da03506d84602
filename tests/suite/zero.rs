//! ZeRO stages 1 and 2 equal plain data parallelism and one device (DESIGN "Correctness is
//! equivalence"), and each rank holds only its shard of the optimizer state (and, at stage 2,
//! of the reduced gradient).
//!
//! Every test trains the same initial record on the same data with meshwork and with a plain
//! single-device Burn loop, then compares every parameter tensor:
//! `max|a − b| ≤ 1e-5 · max|reference|` (f32). The sample ids in the step events prove the
//! work was distributed; the ranks' reported holdings prove the state was sharded
//! (ZERO-1: the owned ranges tile the flat parameter order) and the trace shows the
//! reduce-scatter (stage 2) and the all-gather of the updated shards.

use std::collections::HashSet;
use std::time::Duration;

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, SgdConfig};
use burn::tensor::Device;
use meshwork::checkpoint::CheckpointStore;
use meshwork::demo::{Mlp, Sample, mse_loss};
use meshwork::events::StepDone;
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    draw_lock, parameter_bits, parameter_count, reference_train, run_recording, steps_of,
};
use meshwork::trace::TraceKind;

const TOLERANCE: f32 = 1e-5;
const STEPS: u64 = 12;
/// Divisible by 2, 3 and 4 replicas (and 2 micro-batches each).
const GLOBAL_BATCH: usize = 24;
const BOUND: Duration = Duration::from_secs(300);

/// 256 samples of the 8 → 3 teacher (seed 11, noise 0.1) and the 8-33-17-3 MLP of seed 5:
/// 8·33 + 33·17 + 17·3 + biases, a flat order whose length no group size here divides.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(11, 5).with_widths(&[8, 33, 17, 3])
}

#[derive(Clone)]
struct Case {
    dp: u32,
    zero: ZeroStage,
    optimizer: OptimizerConfig,
    lr: f64,
    accumulation: u32,
    clip: Option<f32>,
}

fn builder(case: &Case, init: Mlp, steps: u64) -> JobBuilder<Mlp, Sample> {
    let mut b = fixture()
        .builder(&init, case.dp, GLOBAL_BATCH, steps)
        .optimizer(case.optimizer.clone())
        .learning_rate(case.lr)
        .gradient_accumulation(case.accumulation)
        .bucket_bytes(1024)
        .zero(case.zero)
        .seed(3)
        .collective_timeout(Duration::from_secs(30));
    if let Some(c) = case.clip {
        b = b.clip_grad_norm(c);
    }
    b
}

/// ZERO-1 in the events: every step, the ranks' owned ranges tile the flat order, each holds
/// the optimizer state of its range only (and at stage 2 the gradient of its range only), and
/// the collectives of the stage ran.
fn assert_sharded(steps: &[StepDone], case: &Case, total: usize) {
    let words = match case.optimizer {
        OptimizerConfig::Sgd(_) => 1,
        _ => 2,
    };
    for s in steps {
        assert_eq!(s.replicas.len(), case.dp as usize, "one report per replica");
        let mut ids = HashSet::new();
        let mut owned: Vec<(u64, u64)> = Vec::new();
        for r in &s.replicas {
            for id in &r.sample_ids {
                assert!(ids.insert(*id), "sample {id} used twice at step {}", s.step);
            }
            let held = r.held.expect("a ZeRO rank reports what it holds");
            let (lo, hi) = held.owned;
            let n = hi - lo;
            owned.push(held.owned);
            assert_eq!(
                held.params,
                4 * total as u64,
                "parameters stay whole at stages 1–2"
            );
            assert_eq!(
                held.optimizer,
                4 * words * n,
                "rank {} holds optimizer state for its {n} elements only",
                r.rank.0
            );
            let bound = 1.05 * (4 * words) as f64 * total as f64 / f64::from(case.dp);
            assert!(
                held.optimizer as f64 <= bound,
                "optimizer bytes within 1.05 × words·Ψ/N"
            );
            let grads = if case.zero == ZeroStage::Two {
                4 * n
            } else {
                4 * total as u64
            };
            assert_eq!(held.grads, grads, "gradient held at the optimizer step");
            let kinds = |f: fn(&TraceKind) -> bool| r.trace.iter().filter(|t| f(&t.kind)).count();
            assert_eq!(
                kinds(|k| matches!(k, TraceKind::AllGather { .. })),
                1,
                "one all-gather of the updated shards"
            );
            let scatters = kinds(|k| matches!(k, TraceKind::ReduceScatter { .. }));
            assert_eq!(scatters, usize::from(case.zero == ZeroStage::Two));
        }
        assert_eq!(
            ids.len(),
            GLOBAL_BATCH,
            "replicas together make the global batch"
        );
        owned.sort();
        let mut at = 0;
        for (lo, hi) in owned {
            assert_eq!(lo, at, "owned ranges are disjoint and leave no gap");
            at = hi;
        }
        assert_eq!(at, total as u64, "owned ranges cover the flat order");
    }
}

/// Train `case` and the one-device reference on the batches the job used; compare.
async fn check(case: Case) -> Mlp {
    let init = fixture().initial_model();
    // Every parameter of the MLP trains (it has no buffers); off autodiff none "requires" a
    // gradient, so the layout of all parameters is the trainable one.
    let total = parameter_count(&init);
    let (outcome, events) = run_recording(
        builder(&case, init.clone(), STEPS)
            .build()
            .expect("valid job"),
    )
    .await;
    let trained = outcome.expect("job succeeds").model;
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS);
    assert_sharded(&steps, &case, total);
    assert!(
        compare_parameters(&trained, &init, 1e-3).is_err(),
        "training moved the parameters"
    );
    let reference = reference_train(
        init,
        mse_loss,
        &fixture().data(),
        &batches_from_events(&steps),
        &Reference {
            optimizer: case.optimizer.clone(),
            learning_rate: LearningRate::Constant(case.lr),
            clip_norm: case.clip,
        },
        &Device::flex(),
    );
    let worst = compare_parameters(&trained, &reference, TOLERANCE)
        .unwrap_or_else(|e| panic!("dp={} {:?}: {e}", case.dp, case.zero));
    eprintln!(
        "dp={} {:?} k={}: worst relative difference to one device {worst:e}",
        case.dp, case.zero, case.accumulation
    );
    trained
}

fn adam(dp: u32, zero: ZeroStage) -> Case {
    Case {
        dp,
        zero,
        optimizer: AdamConfig::new().into(),
        lr: 0.01,
        accumulation: 1,
        clip: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_1_with_adam_at_dp_2_3_4_matches_one_device() {
    bounded(BOUND, async {
        for dp in [2, 3, 4] {
            check(adam(dp, ZeroStage::One)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_2_with_adam_at_dp_2_3_4_matches_one_device_and_plain_data_parallel() {
    bounded(BOUND, async {
        for dp in [2, 3, 4] {
            let sharded = check(adam(dp, ZeroStage::Two)).await;
            // The same job without ZeRO: plain data parallelism.
            let plain = adam(dp, ZeroStage::Off);
            let (outcome, _) = run_recording(
                builder(&plain, fixture().initial_model(), STEPS)
                    .build()
                    .expect("valid job"),
            )
            .await;
            let plain = outcome.expect("plain job succeeds").model;
            let worst = compare_parameters(&sharded, &plain, TOLERANCE)
                .unwrap_or_else(|e| panic!("dp={dp} ZeRO-2 vs plain data parallel: {e}"));
            eprintln!("dp={dp}: ZeRO-2 vs plain data parallel, worst {worst:e}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_1_and_2_with_sgd_momentum_and_accumulation_match_one_device() {
    bounded(BOUND, async {
        for zero in [ZeroStage::One, ZeroStage::Two] {
            check(Case {
                dp: 3,
                zero,
                optimizer: SgdConfig::new()
                    .with_momentum(Some(MomentumConfig::new()))
                    .with_weight_decay(Some(WeightDecayConfig::new(1e-3)))
                    .into(),
                lr: 0.05,
                accumulation: 2,
                clip: None,
            })
            .await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_1_and_2_with_adamw_and_global_norm_clipping_match_one_device() {
    bounded(BOUND, async {
        for zero in [ZeroStage::One, ZeroStage::Two] {
            check(Case {
                dp: 4,
                zero,
                optimizer: AdamWConfig::new().with_weight_decay(0.01).into(),
                lr: 0.01,
                accumulation: 1,
                // Small enough that clipping acts on most steps.
                clip: Some(0.05),
            })
            .await;
        }
    })
    .await;
}

/// The same seed and layout give bitwise-equal parameters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_2_runs_are_bitwise_reproducible() {
    bounded(BOUND, async {
        let case = adam(3, ZeroStage::Two);
        let mut bits = Vec::new();
        for _ in 0..2 {
            let (outcome, _) = run_recording(
                builder(&case, fixture().initial_model(), 6)
                    .build()
                    .expect("valid job"),
            )
            .await;
            bits.push(parameter_bits(&outcome.expect("job succeeds").model));
        }
        assert!(bits[0] == bits[1], "two runs of one seed and layout differ");
    })
    .await;
}

/// CKPT-8 + ZERO-3: a ZeRO-2 job checkpointed at dp 4 resumes at dp 3 (its optimizer shards
/// re-sharded) and ends where one device trained on the same batches ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_checkpoint_resumes_on_another_data_parallel_size() {
    bounded(BOUND, async {
        let dir = TempDir::new("zero-ckpt");
        let init = fixture().initial_model();
        let first = adam(4, ZeroStage::Two);
        let (outcome, events_a) = run_recording(
            builder(&first, init.clone(), 6)
                .checkpoint_dir(dir.path())
                .build()
                .expect("valid job"),
        )
        .await;
        outcome.expect("first run succeeds");
        let store = CheckpointStore::open(dir.path(), 3).expect("a store");
        let saved = store.latest_valid().expect("listed").expect("a checkpoint");
        let parts = saved.checkpoint.shards[0]
            .optimizer
            .as_ref()
            .and_then(|o| o.parts())
            .map(<[_]>::len);
        assert_eq!(parts, Some(4), "one optimizer part per rank");

        let second = adam(3, ZeroStage::Two);
        let (outcome, events_b) = run_recording(
            builder(&second, init.clone(), 12)
                .checkpoint_dir(dir.path())
                .resume_from_checkpoint(true)
                .build()
                .expect("valid job"),
        )
        .await;
        let trained = outcome.expect("resumed run succeeds").model;
        let mut steps = steps_of(&events_a);
        let resumed = steps_of(&events_b);
        assert_eq!(
            resumed.first().map(|s| s.step),
            Some(6),
            "resumed after step 6"
        );
        assert_eq!(resumed[0].replicas.len(), 3);
        steps.extend(resumed);
        let reference = reference_train(
            init,
            mse_loss,
            &fixture().data(),
            &batches_from_events(&steps),
            &Reference {
                optimizer: first.optimizer.clone(),
                learning_rate: LearningRate::Constant(first.lr),
                clip_norm: None,
            },
            &Device::flex(),
        );
        let worst = compare_parameters(&trained, &reference, TOLERANCE)
            .unwrap_or_else(|e| panic!("resumed at dp 3: {e}"));
        eprintln!("ZeRO-2 dp 4 → checkpoint → dp 3: worst {worst:e}");
        let _ = std::fs::remove_dir_all(dir.path());
    })
    .await;
}

/// Run `job`, calling `on_step` with the job's controls after each step event (bounded).
async fn run_controlled(
    job: Job<Mlp, Sample>,
    on_step: impl Fn(u64, &meshwork::job::JobControl) + Send + 'static,
) -> (Result<meshwork::job::Trained<Mlp>>, Vec<JobEvent>) {
    tokio::time::timeout(
        Duration::from_secs(120),
        meshwork::testing::run_controlled(job, on_step),
    )
    .await
    .expect("the job ends within 120 s")
}

fn reference_of(init: Mlp, case: &Case, steps: &[StepDone]) -> Mlp {
    reference_train(
        init,
        mse_loss,
        &fixture().data(),
        &batches_from_events(steps),
        &Reference {
            optimizer: case.optimizer.clone(),
            learning_rate: LearningRate::Constant(case.lr),
            clip_norm: case.clip,
        },
        &Device::flex(),
    )
}

/// ZERO-3 under elastic resizing: every rank's shard is gathered before the group changes and
/// re-sharded onto the new one, so growing 2 → 4 and shrinking 4 → 3 trains as one device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_job_re_shards_when_it_grows_and_shrinks() {
    bounded(BOUND, async {
        let init = fixture().initial_model();
        let case = adam(2, ZeroStage::Two);
        let job = builder(&case, init.clone(), 8).build().expect("valid job");
        let (outcome, events) = run_controlled(job, |step, control| match step {
            1 => control.scale_to(4),
            4 => control.scale_to(3),
            _ => {}
        })
        .await;
        let trained = outcome.expect("the job resizes and finishes").model;
        let steps = steps_of(&events);
        let sizes: Vec<usize> = steps.iter().map(|s| s.replicas.len()).collect();
        assert_eq!(sizes.first(), Some(&2));
        assert!(sizes.contains(&4), "{sizes:?}");
        assert_eq!(sizes.last(), Some(&3));
        let total = parameter_count(&init) as u64;
        for s in &steps {
            let n = s.replicas.len() as u64;
            for r in &s.replicas {
                let held = r.held.expect("reported");
                assert!(
                    held.owned.1 - held.owned.0 <= total / n + 1,
                    "step {}: a rank of {n} owns {:?}",
                    s.step,
                    held.owned
                );
            }
        }
        let reference = reference_of(init, &case, &steps);
        let worst = compare_parameters(&trained, &reference, TOLERANCE)
            .unwrap_or_else(|e| panic!("resized ZeRO-2 job: {e}"));
        eprintln!("ZeRO-2 2 → 4 → 3 replicas: worst {worst:e}");
    })
    .await;
}

/// A lost ZeRO rank's optimizer shard exists nowhere else: the job never shrinks around it,
/// it rolls back to its checkpoint at the same size (and still equals one device).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_zero_rank_rolls_back_to_the_checkpoint_instead_of_shrinking() {
    use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
    use meshwork::recovery::RecoveryPolicy;
    bounded(BOUND, async {
        let dir = TempDir::new("zero-lost");
        let init = fixture().initial_model();
        let case = adam(3, ZeroStage::One);
        let plan = FaultPlan::new(4).with(Fault {
            device: 1,
            step: 5,
            micro_batch: Some(0),
            phase: Phase::Backward,
            kind: FaultKind::Panic,
        });
        let job = builder(&case, init.clone(), 8)
            .fault_plan(plan)
            .recovery(RecoveryPolicy::shrink().or_roll_back())
            .checkpoint_dir(dir.path())
            .checkpoint_every(2)
            .step_timeout(Duration::from_secs(60))
            .build()
            .expect("valid job");
        let (outcome, events) = tokio::time::timeout(Duration::from_secs(120), run_recording(job))
            .await
            .expect("the job ends");
        let trained = outcome.expect("the job rolls back and finishes").model;
        let rolled: Vec<(u64, u64)> = events
            .iter()
            .filter_map(|e| match e {
                JobEvent::RolledBack {
                    failed_step, step, ..
                } => Some((*failed_step, *step)),
                _ => None,
            })
            .collect();
        assert_eq!(
            rolled,
            vec![(5, 4)],
            "rolled back from step 5 to the checkpoint of step 4"
        );
        let steps = steps_of(&events);
        assert!(
            steps.iter().all(|s| s.replicas.len() == 3),
            "never shrank: {:?}",
            steps.iter().map(|s| s.replicas.len()).collect::<Vec<_>>()
        );
        assert_eq!(steps.len(), 8);
        let reference = reference_of(init, &case, &steps);
        compare_parameters(&trained, &reference, TOLERANCE)
            .unwrap_or_else(|e| panic!("rolled-back ZeRO-1 job: {e}"));
        let _ = std::fs::remove_dir_all(dir.path());
    })
    .await;
}

/// A dp 2 × pp 2 pipeline shards each stage's optimizer over its data-parallel group: it
/// trains as the same pipeline without ZeRO, and its checkpoint holds one optimizer part per
/// replica for every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_shards_each_stage_optimizer_over_its_replicas() {
    use meshwork::demo::{mlp_pipeline_of, split_mlp};
    use meshwork::parallel::stages::PipelineModel;
    bounded(BOUND, async {
        let parts = {
            let _draw = draw_lock();
            let device = Device::flex();
            device.seed(7);
            split_mlp(&[8, 33, 17, 3], &[2, 1], &device).expect("a split")
        };
        let dir = TempDir::new("zero-pipe");
        let mut models = Vec::new();
        for zero in [ZeroStage::Off, ZeroStage::Two] {
            let mut b = Job::builder()
                .pipeline(
                    mlp_pipeline_of(parts.clone()),
                    Schedule::OneFOneB { micro_batches: 2 },
                )
                .data_parallel(2)
                .data(fixture().data())
                .batch_size(GLOBAL_BATCH)
                .optimizer(AdamConfig::new())
                .learning_rate(0.01)
                .zero(zero)
                .steps(6)
                .seed(3)
                .collective_timeout(Duration::from_secs(30))
                .step_timeout(Duration::from_secs(60));
            if zero == ZeroStage::Two {
                b = b.checkpoint_dir(dir.path());
            }
            let (outcome, _) = run_recording(b.build().expect("valid pipeline job")).await;
            let model: PipelineModel = outcome.expect("pipeline job succeeds").model;
            models.push(Mlp::from_pipeline(model).expect("the demo MLP's blocks"));
        }
        let worst = compare_parameters(&models[1], &models[0], TOLERANCE)
            .unwrap_or_else(|e| panic!("ZeRO-2 pipeline vs plain pipeline: {e}"));
        eprintln!("dp 2 × pp 2, ZeRO-2 vs plain: worst {worst:e}");
        let store = CheckpointStore::open(dir.path(), 3).expect("a store");
        let saved = store.latest_valid().expect("listed").expect("a checkpoint");
        assert_eq!(saved.checkpoint.shards.len(), 2, "one shard per block");
        for shard in &saved.checkpoint.shards {
            let parts = shard
                .optimizer
                .as_ref()
                .and_then(|o| o.parts())
                .expect("sharded");
            assert_eq!(parts.len(), 2, "{}: one part per replica", shard.shard);
            let total = parts[0].total;
            let mut ranges: Vec<_> = parts.iter().map(|p| p.range.clone()).collect();
            ranges.sort_by_key(|r| r.start);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[0].end, ranges[1].start);
            assert_eq!(ranges[1].end, total);
        }
        let _ = std::fs::remove_dir_all(dir.path());
    })
    .await;
}
