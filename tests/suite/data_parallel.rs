//! Data-parallel training equals one device (DESIGN "Correctness is equivalence").
//!
//! Every test trains the same initial record on the same data with meshwork and with a plain
//! single-device Burn loop, then compares every parameter tensor:
//! `max|a − b| ≤ 1e-5 · max|reference|` (f32). The sample ids in the step-done events prove the
//! work was distributed: disjoint across replicas, together the global batch.

use std::collections::HashSet;
use std::time::Duration;

use burn::lr_scheduler::exponential::ExponentialLrSchedulerConfig;
use burn::module::Module;
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::Device;
use meshwork::demo::{Sample, mse_loss};
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, batches_from_events, bounded, compare_parameters, draw_lock,
    final_fingerprints, reference_train, run_recording, steps_of,
};
use meshwork::trace::TraceKind;

const TOLERANCE: f32 = 1e-5;
const STEPS: u64 = 20;
const GLOBAL_BATCH: usize = 16;
const BOUND: Duration = Duration::from_secs(300);

/// 256 samples of the 8 → 3 teacher (seed 11, noise 0.1) and the 8-32-16-3 MLP of seed 5.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(11, 5)
}

/// Run a data-parallel job and the reference; assert equivalence and real distribution.
async fn check_equivalence(
    dp: u32,
    optimizer: OptimizerConfig,
    lr: LearningRate,
    accumulation: u32,
    clip: Option<f32>,
) {
    let fixture = fixture();
    let data = fixture.data();
    let init = fixture.initial_model();
    let mut builder = fixture
        .builder(&init, dp, GLOBAL_BATCH, STEPS)
        .optimizer(optimizer.clone())
        .gradient_accumulation(accumulation)
        // Small buckets so that both fused and in-place (chunked) buckets are exercised.
        .bucket_bytes(if dp == 4 { 1024 } else { 4096 })
        .seed(3)
        .collective_timeout(Duration::from_secs(30));
    if let Some(c) = clip {
        builder = builder.clip_grad_norm(c);
    }
    builder = builder.learning_rate(lr.clone());
    let (outcome, events) = run_recording(builder.build().expect("valid job")).await;
    let trained = outcome.expect("job succeeds");
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS);

    for s in &steps {
        assert_eq!(s.replicas.len(), dp as usize, "one report per replica");
        let mut seen = HashSet::new();
        for r in &s.replicas {
            assert_eq!(r.sample_ids.len(), GLOBAL_BATCH / dp as usize);
            for id in &r.sample_ids {
                assert!(
                    seen.insert(*id),
                    "sample {id} used by two replicas at step {}",
                    s.step
                );
            }
            let forwards: Vec<u32> = r
                .trace
                .iter()
                .filter_map(|t| match t.kind {
                    TraceKind::Forward { samples, .. } => Some(samples),
                    _ => None,
                })
                .collect();
            // k forward passes, each over 1/k of the replica's share.
            let share = (GLOBAL_BATCH / dp as usize) as u32;
            assert_eq!(forwards, vec![share / accumulation; accumulation as usize]);
        }
        assert_eq!(
            seen.len(),
            GLOBAL_BATCH,
            "replicas together make the global batch"
        );
    }

    assert!(
        compare_parameters(&trained.model, &init, 1e-3).is_err(),
        "training moved the parameters"
    );
    let reference = reference_train(
        init,
        mse_loss,
        &data,
        &batches_from_events(&steps),
        &Reference {
            optimizer,
            learning_rate: lr,
            clip_norm: clip,
        },
        &Device::flex(),
    );
    let worst = compare_parameters(&trained.model, &reference, TOLERANCE)
        .unwrap_or_else(|e| panic!("dp={dp}: {e}"));
    eprintln!("dp={dp} k={accumulation}: worst relative difference {worst:e}");
    let fps = final_fingerprints(&events).expect("a Finished event");
    assert_eq!(fps.len(), dp as usize);
    assert!(
        fps.windows(2).all(|w| w[0] == w[1]),
        "replicas identical at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_1_2_4_match_single_device_with_sgd() {
    bounded(BOUND, async {
        for dp in [1, 2, 4] {
            check_equivalence(
                dp,
                SgdConfig::new().into(),
                LearningRate::Constant(0.05),
                1,
                None,
            )
            .await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_1_2_4_match_single_device_with_adam() {
    bounded(BOUND, async {
        for dp in [1, 2, 4] {
            check_equivalence(
                dp,
                AdamConfig::new().into(),
                LearningRate::Constant(0.01),
                1,
                None,
            )
            .await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accumulation_over_4_micro_batches_matches_one_big_batch() {
    bounded(
        BOUND,
        check_equivalence(
            2,
            SgdConfig::new().into(),
            LearningRate::Constant(0.05),
            4,
            None,
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_norm_clipping_matches_reference() {
    bounded(
        BOUND,
        check_equivalence(
            2,
            AdamConfig::new().into(),
            LearningRate::Constant(0.01),
            1,
            Some(0.05),
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burn_lr_scheduler_matches_reference() {
    let schedule = ExponentialLrSchedulerConfig::new(0.1, 0.9)
        .init()
        .expect("valid scheduler");
    bounded(
        BOUND,
        check_equivalence(
            2,
            SgdConfig::new().into(),
            LearningRate::Scheduler(schedule),
            1,
            None,
        ),
    )
    .await;
}

/// OPT-1: learning-rate groups reach the flat rule as they reach Burn's optimizer, by path
/// (the first layer held at rate 0 by a group matching `layers.0`) on top of a schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_1_learning_rate_groups_by_path_match_reference() {
    use burn::lr_scheduler::constant::ConstantLr;
    use burn::module::ParamGroup;
    let schedule = ExponentialLrSchedulerConfig::new(0.1, 0.9)
        .init()
        .expect("valid scheduler");
    let grouped = schedule.with_group(
        ParamGroup::from_predicate("layers.0"),
        ConstantLr::from(0.0),
    );
    bounded(
        BOUND,
        check_equivalence(
            2,
            SgdConfig::new().into(),
            LearningRate::Scheduler(grouped),
            1,
            None,
        ),
    )
    .await;
}

/// A model with a frozen first layer (fine-tuning): `no_grad` persists through training.
#[derive(burn::module::Module, Debug)]
struct FrozenBase {
    base: burn::nn::Linear,
    head: burn::nn::Linear,
}

fn frozen_loss(m: &FrozenBase, items: &[Sample], device: &Device) -> burn::tensor::Tensor<1> {
    let (x, y) = meshwork::demo::batch_tensors(items, device);
    let h = burn::tensor::activation::relu(m.base.forward(x));
    let d = m.head.forward(h) - y;
    (d.clone() * d).mean()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flat_2_frozen_parameters_are_not_updated_under_weight_decay() {
    bounded(BOUND, async {
        let data = fixture().data();
        let init = {
            let _draw = draw_lock();
            let device = Device::flex();
            device.seed(9);
            // Drawn here, under the lock (Burn draws a layer's parameters when first read).
            meshwork::parallel::stages::materialize(FrozenBase {
                base: burn::nn::LinearConfig::new(8, 16).init(&device).no_grad(),
                head: burn::nn::LinearConfig::new(16, 3).init(&device),
            })
        };
        let optimizer: OptimizerConfig = burn::optim::AdamWConfig::new()
            .with_weight_decay(0.5)
            .into();
        let (outcome, events) = run_recording(
            Job::builder()
                .initial_model(init.clone())
                .loss(frozen_loss)
                .data(data.clone())
                .optimizer(optimizer.clone())
                .learning_rate(0.01)
                .data_parallel(2)
                .batch_size(GLOBAL_BATCH)
                .steps(10)
                .build()
                .unwrap(),
        )
        .await;
        let trained = outcome.expect("job succeeds");
        let reference = reference_train(
            init.clone(),
            frozen_loss,
            &data,
            &batches_from_events(&steps_of(&events)),
            &Reference {
                optimizer,
                learning_rate: LearningRate::Constant(0.01),
                clip_norm: None,
            },
            &Device::flex(),
        );
        compare_parameters(&trained.model, &reference, TOLERANCE).expect("equivalent");
        // The frozen layer is exactly the initial one.
        compare_parameters(&trained.model.base, &init.base, 0.0).expect("frozen layer untouched");
    })
    .await;
}

/// A model with batch normalization: its running statistics are buffers.
#[derive(burn::module::Module, Debug)]
struct Normalized {
    first: burn::nn::Linear,
    norm: burn::nn::BatchNorm,
    last: burn::nn::Linear,
}

fn normalized_loss(m: &Normalized, items: &[Sample], device: &Device) -> burn::tensor::Tensor<1> {
    let (x, y) = meshwork::demo::batch_tensors(items, device);
    let h = burn::tensor::activation::relu(m.norm.forward(m.first.forward(x)));
    let d = m.last.forward(h) - y;
    (d.clone() * d).mean()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_4_batch_norm_buffers_stay_identical_across_replicas() {
    bounded(BOUND, async {
        let data = fixture().data();
        let init = {
            // Unseeded, but a draw all the same: not in the middle of another test's.
            let _draw = draw_lock();
            let device = Device::flex();
            meshwork::parallel::stages::materialize(Normalized {
                first: burn::nn::LinearConfig::new(8, 16).init(&device),
                norm: burn::nn::BatchNormConfig::new(16).init(&device),
                last: burn::nn::LinearConfig::new(16, 3).init(&device),
            })
        };
        let (outcome, events) = run_recording(
            Job::builder()
                .initial_model(init.clone())
                .loss(normalized_loss)
                .data(data)
                .optimizer(SgdConfig::new())
                .learning_rate(0.05)
                .data_parallel(2)
                .batch_size(GLOBAL_BATCH)
                .steps(5)
                .build()
                .unwrap(),
        )
        .await;
        let trained = outcome.expect("job succeeds");
        let fingerprints = final_fingerprints(&events).expect("a Finished event");
        assert_eq!(
            fingerprints[0], fingerprints[1],
            "buffers broadcast from rank 0"
        );
        // The running statistics did move (the buffers are really trained state).
        assert!(compare_parameters(&trained.model.norm, &init.norm, 1e-3).is_err());
    })
    .await;
}
