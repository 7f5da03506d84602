//! Data-parallel training equals one device (DESIGN "Correctness is equivalence").
//!
//! Every test trains the same initial record on the same data with meshwork and with a plain
//! single-device Burn loop, then compares every parameter tensor:
//! `max|a − b| ≤ 1e-5 · max|reference|` (f32). The sample ids in the step-done events prove the
//! work was distributed: disjoint across replicas, together the global batch.

use std::collections::HashSet;
use std::time::Duration;

use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::Device;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::events::JobEvent;
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, batches_from_events, compare_parameters, reference_train, run_recording, steps_of,
};

const TOLERANCE: f32 = 1e-5;
const STEPS: u64 = 20;
const GLOBAL_BATCH: usize = 16;

fn task() -> (TeacherTask, InMemoryDataset<Sample>) {
    let t = TeacherTask {
        d_in: 8,
        d_out: 3,
        noise: 0.1,
        seed: 11,
    };
    (t, t.dataset(256))
}

fn initial_model() -> Mlp {
    let device = Device::flex();
    device.seed(5);
    Mlp::new(&[8, 32, 16, 3], &device)
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(300), f)
        .await
        .expect("test exceeded its 300 s bound")
}

/// Run a data-parallel job and the reference; assert equivalence and real distribution.
async fn check_equivalence(
    dp: u32,
    optimizer: OptimizerConfig,
    lr: f64,
    accumulation: u32,
    clip: Option<f32>,
) {
    let (_, data) = task();
    let init = initial_model();
    let mut builder = Job::builder()
        .initial_model(init.clone())
        .loss(mse_loss)
        .data(data.clone())
        .optimizer(optimizer.clone())
        .learning_rate(lr)
        .data_parallel(dp)
        .batch_size(GLOBAL_BATCH)
        .gradient_accumulation(accumulation)
        // Small buckets so that both fused and in-place (chunked) buckets are exercised.
        .bucket_bytes(if dp == 4 { 1024 } else { 4096 })
        .steps(STEPS)
        .seed(3)
        .collective_timeout(Duration::from_secs(30));
    if let Some(c) = clip {
        builder = builder.clip_grad_norm(c);
    }
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
            let forwards = r
                .trace
                .iter()
                .filter(|t| matches!(t.kind, meshwork::trace::TraceKind::Forward { .. }))
                .count();
            assert_eq!(forwards, accumulation as usize);
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
            learning_rate: LearningRate::Constant(lr),
            clip_norm: clip,
        },
        &Device::flex(),
    );
    let worst = compare_parameters(&trained.model, &reference, TOLERANCE)
        .unwrap_or_else(|e| panic!("dp={dp}: {e}"));
    eprintln!("dp={dp} k={accumulation}: worst relative difference {worst:e}");
    let finished = events.iter().find_map(|e| match e {
        JobEvent::Finished { fingerprints, .. } => Some(fingerprints.clone()),
        _ => None,
    });
    let fps = finished.expect("a Finished event");
    assert_eq!(fps.len(), dp as usize);
    assert!(
        fps.windows(2).all(|w| w[0] == w[1]),
        "replicas identical at the end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_1_2_4_match_single_device_with_sgd() {
    bounded(async {
        for dp in [1, 2, 4] {
            check_equivalence(dp, SgdConfig::new().into(), 0.05, 1, None).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_1_2_4_match_single_device_with_adam() {
    bounded(async {
        for dp in [1, 2, 4] {
            check_equivalence(dp, AdamConfig::new().into(), 0.01, 1, None).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accumulation_over_4_micro_batches_matches_one_big_batch() {
    bounded(check_equivalence(2, SgdConfig::new().into(), 0.05, 4, None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_norm_clipping_matches_reference() {
    bounded(check_equivalence(
        2,
        AdamConfig::new().into(),
        0.01,
        1,
        Some(0.05),
    ))
    .await;
}
