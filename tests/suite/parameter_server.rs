//! The parameter server (stale-synchronous parallel) and backup workers
//! (`parallel::parameter_server`, `actors::parameter_server`).
//!
//! - s = 0 equals synchronous data parallelism and one device: every parameter within
//!   `1e-5 · max|reference|`, bitwise equal over two runs (PS-2), and each worker's reports
//!   show its own samples' gradient applied (the work was distributed).
//! - s = 2 with one worker 5× slower: no applied gradient is staler than 2 (PS-1) and every
//!   fast worker had more gradients applied than the slow one.
//! - asynchronous and backup(1) converge on the demo task within a stated margin of
//!   synchronous data parallelism; backup(1) drops one share per step and says which (PS-3).
//! - a worker that panics is dropped and the others finish the job (PSA-2).
//! - what the server cannot serve is refused at build with a typed error.

use std::time::Duration;

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::composition::Feature;
use meshwork::demo::{Mlp, Sample, mse_loss};
use meshwork::events::StepDone;
use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::parallel::parameter_server::{ParameterServer, ParameterServerError, Staleness};
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    parameter_bits, reference_train, run_recording, steps_of,
};

const TOLERANCE: f32 = 1e-5;
const WORKERS: u32 = 4;
const GLOBAL_BATCH: usize = 32;
const BOUND: Duration = Duration::from_secs(120);

/// 256 samples of the 8 → 3 teacher (seed 11, noise 0.1); the MLPs are drawn from seed 5, each
/// test with its own widths (`fixture().with_widths(..)`).
fn fixture() -> TeacherFixture {
    TeacherFixture::new(11, 5)
}

fn sgd() -> OptimizerConfig {
    SgdConfig::new().into()
}

fn builder(init: &Mlp, optimizer: OptimizerConfig, lr: f64, steps: u64) -> JobBuilder<Mlp, Sample> {
    fixture()
        .builder(init, WORKERS, GLOBAL_BATCH, steps)
        .optimizer(optimizer)
        .learning_rate(lr)
        .seed(3)
        .collective_timeout(Duration::from_secs(30))
        .step_timeout(Duration::from_secs(60))
}

async fn run(job: Job<Mlp, Sample>) -> (Mlp, Vec<StepDone>, Vec<JobEvent>) {
    let (outcome, events) = bounded(BOUND, run_recording(job)).await;
    let model = outcome.expect("the job succeeds").model;
    (model, steps_of(&events), events)
}

/// Mean squared error of `model` on the whole data set.
fn evaluate(model: &Mlp) -> f32 {
    let data = fixture().data();
    let samples: Vec<Sample> = (0..data.len()).filter_map(|i| data.get(i)).collect();
    mse_loss(model, &samples, &Device::flex()).into_scalar()
}

fn slow(device: u32, factor: f64) -> FaultPlan {
    FaultPlan::new(0).with(Fault {
        device,
        step: 0,
        micro_batch: None,
        phase: Phase::Forward,
        kind: FaultKind::Slow { factor },
    })
}

/// Every applied gradient and dropped sample of each worker over the steps, by replica.
fn per_worker(steps: &[StepDone]) -> Vec<(usize, usize, u64)> {
    let mut out = vec![(0usize, 0usize, 0u64); WORKERS as usize];
    for s in steps {
        for r in &s.replicas {
            let ps = r
                .parameter_server
                .as_ref()
                .expect("a worker reports its server part");
            let w = &mut out[r.stage.replica as usize];
            w.0 += ps.applied.len();
            w.1 += ps.dropped.len();
            w.2 =
                w.2.max(ps.applied.iter().map(|a| a.staleness).max().unwrap_or(0));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_0_equals_data_parallel_and_one_device_bitwise_twice() {
    let init = fixture().with_widths(&[8, 16, 3]).initial_model();
    let optimizer: OptimizerConfig = burn::optim::AdamConfig::new().into();
    let job = || {
        builder(&init, optimizer.clone(), 1e-2, 6)
            .parameter_server(ParameterServer::new(Staleness::Bounded(0)))
            .build()
            .expect("a valid job")
    };
    let (first, steps, _) = run(job()).await;
    let (second, _, _) = run(job()).await;
    assert_eq!(
        parameter_bits(&first),
        parameter_bits(&second),
        "s = 0 is bit-reproducible"
    );
    // Distributed: each worker's own share, one gradient per worker per step, disjoint.
    for s in &steps {
        assert_eq!(s.replicas.len(), WORKERS as usize);
        let mut ids: Vec<usize> = Vec::new();
        for r in &s.replicas {
            let ps = r.parameter_server.as_ref().expect("a server part");
            assert_eq!(
                ps.applied.len(),
                1,
                "one gradient of worker {} applied",
                r.rank.0
            );
            assert_eq!(ps.applied[0].staleness, 0);
            assert_eq!(
                ps.applied[0].samples as usize,
                GLOBAL_BATCH / WORKERS as usize
            );
            assert_eq!(r.sample_ids.len(), GLOBAL_BATCH / WORKERS as usize);
            assert!(ps.dropped.is_empty());
            ids.extend(&r.sample_ids);
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            GLOBAL_BATCH,
            "the workers' shares make the global batch"
        );
    }
    let (dp, dp_steps, _) = run(builder(&init, optimizer.clone(), 1e-2, 6)
        .build()
        .expect("a valid job"))
    .await;
    assert_eq!(batches_from_events(&steps), batches_from_events(&dp_steps));
    let worst = compare_parameters(&first, &dp, TOLERANCE).expect("s = 0 equals data parallel");
    eprintln!("ssp:0 vs data parallel: worst relative difference {worst:e}");
    let reference = reference_train(
        init.clone(),
        mse_loss,
        &fixture().data(),
        &batches_from_events(&steps),
        &Reference {
            optimizer,
            learning_rate: LearningRate::Constant(1e-2),
            clip_norm: None,
        },
        &Device::flex(),
    );
    let worst = compare_parameters(&first, &reference, TOLERANCE).expect("s = 0 equals one device");
    eprintln!("ssp:0 vs one device: worst relative difference {worst:e}");
    assert!(
        compare_parameters(&first, &init, 1e-3).is_err(),
        "training moved the parameters"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssp_2_with_a_slow_worker_never_exceeds_the_bound() {
    let init = fixture().with_widths(&[8, 64, 64, 3]).initial_model();
    let job = builder(&init, sgd(), 0.05, 4)
        .parameter_server(ParameterServer::new(Staleness::Bounded(2)))
        .gradient_accumulation(4)
        .fault_plan(slow(3, 5.0))
        .build()
        .expect("a valid job");
    let (_, steps, _) = run(job).await;
    assert_eq!(steps.len(), 4);
    for s in &steps {
        let applied: usize = s
            .replicas
            .iter()
            .flat_map(|r| &r.parameter_server.as_ref().expect("a server part").applied)
            .map(|a| a.samples as usize)
            .sum();
        assert_eq!(
            applied, GLOBAL_BATCH,
            "every sample's gradient applied once (PS-4)"
        );
    }
    let workers = per_worker(&steps);
    eprintln!("ssp:2, worker 3 slow: (applied, dropped, max staleness) = {workers:?}");
    for (w, &(_, dropped, staleness)) in workers.iter().enumerate() {
        assert!(
            staleness <= 2,
            "worker {w} had a gradient of staleness {staleness} applied"
        );
        assert_eq!(dropped, 0);
    }
    let slow_applied = workers[3].0;
    for (w, &(applied, _, _)) in workers.iter().enumerate().take(3) {
        assert!(
            applied > slow_applied,
            "fast worker {w} applied {applied}, the slow one {slow_applied}"
        );
    }
}

/// Steps of the convergence runs, and how far above synchronous data parallelism's final
/// loss (on the whole data set) the asynchronous methods may end.
const CONVERGE_STEPS: u64 = 40;
const MARGIN: f32 = 1.25;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_and_backup_workers_converge_near_data_parallel() {
    let init = fixture().with_widths(&[8, 16, 3]).initial_model();
    let start = evaluate(&init);
    let (sync, _, _) = run(builder(&init, sgd(), 0.1, CONVERGE_STEPS)
        .build()
        .expect("a valid job"))
    .await;
    let sync_loss = evaluate(&sync);
    let (asynchronous, async_steps, _) = run(builder(&init, sgd(), 0.1, CONVERGE_STEPS)
        .parameter_server(ParameterServer::new(Staleness::Unbounded))
        .gradient_accumulation(2)
        .build()
        .expect("a valid job"))
    .await;
    let async_loss = evaluate(&asynchronous);
    let (backup, backup_steps, _) = run(builder(&init, sgd(), 0.1, CONVERGE_STEPS)
        .backup_workers(1)
        .fault_plan(slow(3, 3.0))
        .build()
        .expect("a valid job"))
    .await;
    let backup_loss = evaluate(&backup);
    eprintln!(
        "loss on the data set: start {start}, sync {sync_loss}, async {async_loss}, backup(1) \
         {backup_loss}; async (applied, dropped, max staleness) {:?}, backup {:?}",
        per_worker(&async_steps),
        per_worker(&backup_steps)
    );
    assert!(sync_loss < 0.6 * start, "data parallel converges");
    assert!(
        async_loss <= MARGIN * sync_loss,
        "async within {MARGIN}× of sync"
    );
    assert!(
        backup_loss <= MARGIN * sync_loss,
        "backup(1) within {MARGIN}× of sync"
    );
    // PS-3: each step applies N − 1 shares and drops one, named in the events.
    let share = GLOBAL_BATCH / WORKERS as usize;
    for s in &backup_steps {
        let (mut applied, mut dropped) = (0, Vec::<usize>::new());
        for r in &s.replicas {
            let ps = r.parameter_server.as_ref().expect("a server part");
            applied += ps.applied.len();
            dropped.extend(&ps.dropped);
        }
        assert_eq!(applied, WORKERS as usize - 1, "step {}", s.step);
        assert_eq!(dropped.len(), share, "one share dropped at step {}", s.step);
    }
}

/// PSA-2: a worker lost at step 2 (`kind`: its device thread panics, or its device is
/// killed) is dropped; the three others finish every step and apply the whole batch.
async fn lose_a_worker(kind: FaultKind) {
    let init = fixture().with_widths(&[8, 16, 3]).initial_model();
    let plan = FaultPlan::new(1).with(Fault {
        device: 2,
        step: 2,
        micro_batch: None,
        phase: Phase::Forward,
        kind,
    });
    let job = builder(&init, sgd(), 0.1, 6)
        .parameter_server(ParameterServer::new(Staleness::Bounded(2)))
        .gradient_accumulation(2)
        .fault_plan(plan)
        .recovery(RecoveryPolicy::shrink())
        .build()
        .expect("a valid job");
    let (model, steps, events) = run(job).await;
    assert!(
        events
            .iter()
            .any(|e| matches!(e, JobEvent::DeviceLost { device, .. } if device.0 == 2)),
        "the lost worker is named"
    );
    let per_step: Vec<usize> = steps.iter().map(|s| s.replicas.len()).collect();
    assert_eq!(per_step.len(), 6, "every step is published: {per_step:?}");
    assert_eq!(
        per_step.last(),
        Some(&3),
        "three workers finish: {per_step:?}"
    );
    for s in steps.iter().filter(|s| s.replicas.len() == 3) {
        let applied: usize = s
            .replicas
            .iter()
            .flat_map(|r| &r.parameter_server.as_ref().expect("a server part").applied)
            .map(|a| a.samples as usize)
            .sum();
        assert_eq!(applied, GLOBAL_BATCH, "the survivors apply the whole batch");
    }
    assert!(evaluate(&model).is_finite());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psa_2_a_panicking_worker_is_dropped_and_the_others_finish() {
    lose_a_worker(FaultKind::Panic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psa_2_a_killed_worker_is_dropped_and_the_others_finish() {
    lose_a_worker(FaultKind::Kill).await;
}

#[test]
fn what_the_server_cannot_serve_is_refused_at_build() {
    let init = fixture().with_widths(&[8, 16, 3]).initial_model();
    let refused = |b: JobBuilder<Mlp, Sample>| match b.build() {
        Err(Error::ParameterServer(e)) => e,
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("built"),
    };
    let ps = ParameterServer::new(Staleness::Bounded(2));
    assert!(matches!(
        refused(builder(&init, sgd(), 0.1, 1).backup_workers(WORKERS)),
        ParameterServerError::TooManyBackups {
            backup: 4,
            workers: 4
        }
    ));
    // Staleness with backup workers is a row of the composition table.
    match builder(&init, sgd(), 0.1, 1)
        .parameter_server(ps)
        .backup_workers(1)
        .build()
    {
        Err(Error::Refused(r)) => assert_eq!(
            r.features(),
            &[Feature::StaleUpdates, Feature::BackupWorkers],
            "{r}"
        ),
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("built"),
    }
    assert!(matches!(
        refused(
            builder(&init, sgd(), 0.1, 1).parameter_server(ParameterServer { shards: 2, ..ps })
        ),
        ParameterServerError::Shards { shards: 2 }
    ));
    // Combinations are rows of the one table.
    for (b, other) in [
        (
            builder(&init, sgd(), 0.1, 1)
                .parameter_server(ps)
                .zero(ZeroStage::One),
            Feature::Zero,
        ),
        (
            builder(&init, sgd(), 0.1, 1)
                .parameter_server(ps)
                .clip_grad_norm(1.0),
            Feature::ClipGradNorm,
        ),
    ] {
        match b.build() {
            Err(Error::Refused(r)) => {
                assert_eq!(r.features(), [Feature::ParameterServer, other], "{r}")
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("built"),
        }
    }
}

/// PSA-3: a checkpoint holds the server's parameters and optimizer state; a job resumed from
/// it ends bitwise where an uninterrupted one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psa_3_a_checkpoint_holds_the_server_state_and_resumes_bitwise() {
    let init = fixture().with_widths(&[8, 16, 3]).initial_model();
    let adam: OptimizerConfig = burn::optim::AdamConfig::new().into();
    let job = |steps| {
        builder(&init, adam.clone(), 1e-2, steps)
            .parameter_server(ParameterServer::new(Staleness::Bounded(0)))
    };
    let (whole, _, _) = run(job(6).build().expect("a valid job")).await;
    let dir = TempDir::new("ps-ckpt");
    let (_, first, _) = run(job(3)
        .checkpoint_dir(dir.path())
        .build()
        .expect("a valid job"))
    .await;
    assert_eq!(first.len(), 3);
    let (resumed, steps, events) = run(job(6)
        .checkpoint_dir(dir.path())
        .resume_from_checkpoint(true)
        .build()
        .expect("a valid job"))
    .await;
    let _ = std::fs::remove_dir_all(dir.path());
    assert!(
        events
            .iter()
            .any(|e| matches!(e, JobEvent::Restored { step: 3, .. }))
    );
    assert_eq!(steps.iter().map(|s| s.step).collect::<Vec<_>>(), [3, 4, 5]);
    assert_eq!(
        parameter_bits(&resumed),
        parameter_bits(&whole),
        "the resumed job ends where the whole one does"
    );
}
