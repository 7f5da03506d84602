//! Synchronising less often (LOCAL-1..5): local SGD, DiLoCo and EASGD on the demo MLP.
//!
//! Equivalence (tolerance per tensor `max|a − b| ≤ 1e-5 · max|reference|`, f32):
//! - local SGD with H = 1 and SGD equals plain data parallelism and one device;
//! - local SGD with H = 4 equals a plain Burn loop per rank on that rank's own samples with
//!   the parameters averaged every 4 steps (so the work really was split: the ranks stepped
//!   apart between averagings), and differs from synchronous data parallelism;
//! - DiLoCo with an outer SGD of learning rate 1 and no momentum equals local SGD.
//!
//! The trace proves the schedule (one parameter all-reduce per bucket exactly every H
//! steps, none between); runs are bitwise reproducible; a lost rank rolls back to a
//! checkpoint taken between synchronisations and the job ends bitwise where the
//! uninterrupted one ends; a resumed job equals the uninterrupted one bitwise.

use std::time::Duration;

use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamWConfig, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use meshwork::checkpoint::snapshot_module;
use meshwork::demo::{Mlp, Sample, mse_loss};
use meshwork::events::StepDone;
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    final_fingerprints, parameter_bits, reference_train, run_recording, steps_of,
};
use meshwork::trace::TraceKind;

const TOLERANCE: f32 = 1e-5;
const GLOBAL_BATCH: usize = 32;
const DP: u32 = 4;

const BOUND: Duration = Duration::from_secs(300);

/// 256 samples of the 8 → 3 teacher (seed 11, noise 0.1) and the 8-33-17-3 MLP of seed 5.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(11, 5).with_widths(&[8, 33, 17, 3])
}

fn sgd() -> OptimizerConfig {
    SgdConfig::new().into()
}

fn adamw() -> OptimizerConfig {
    AdamWConfig::new().with_weight_decay(0.01).into()
}

fn builder(
    updates: Option<LocalUpdates>,
    optimizer: OptimizerConfig,
    lr: f64,
    steps: u64,
) -> JobBuilder<Mlp, Sample> {
    let f = fixture();
    let b = f
        .builder(&f.initial_model(), DP, GLOBAL_BATCH, steps)
        .optimizer(optimizer)
        .learning_rate(lr)
        // Several buckets: the parameter all-reduce is bucketed like the gradients'.
        .bucket_bytes(1024)
        .seed(3)
        .collective_timeout(Duration::from_secs(30));
    match updates {
        Some(u) => b.local_updates(u),
        None => b,
    }
}

async fn train(b: JobBuilder<Mlp, Sample>) -> (Mlp, Vec<JobEvent>) {
    let (outcome, events) = run_recording(b.build().expect("a valid job")).await;
    (outcome.expect("the job succeeds").model, events)
}

/// The steps at which a rank ran at least one all-reduce span (the parameter
/// synchronisation: local strategies have no gradient all-reduce, LOCAL-5), per rank.
fn all_reduce_steps(steps: &[StepDone]) -> Vec<Vec<u64>> {
    (0..DP as usize)
        .map(|rank| {
            steps
                .iter()
                .filter(|s| {
                    s.replicas.iter().any(|r| {
                        r.rank.index() == rank
                            && r.trace
                                .iter()
                                .any(|t| matches!(t.kind, TraceKind::AllReduce { .. }))
                    })
                })
                .map(|s| s.step)
                .collect()
        })
        .collect()
}

/// The mean of several models' parameters, tensor by tensor (local SGD's averaging, done
/// with Burn's module mapper, independently of meshwork's flat buffers).
fn average(models: &[Mlp]) -> Mlp {
    let snaps: Vec<_> = models.iter().map(snapshot_module).collect();
    let means: Vec<Vec<f32>> = (0..snaps[0].params().len())
        .map(|i| {
            let n = snaps[0].params()[i].values.len();
            (0..n)
                .map(|j| {
                    snaps.iter().map(|s| s.params()[i].values[j]).sum::<f32>() / models.len() as f32
                })
                .collect()
        })
        .collect();
    struct Set(Vec<Vec<f32>>, usize);
    impl ModuleMapper for Set {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let values = self.0[self.1].clone();
            self.1 += 1;
            param.map(|old| {
                let dims = old.shape().to_vec();
                let grad = old.is_require_grad();
                let t = Tensor::<D>::from_data(TensorData::new(values, dims), &old.device());
                if grad { t.require_grad() } else { t }
            })
        }
    }
    models[0].clone().map(&mut Set(means, 0))
}

/// Local SGD simulated with plain Burn: each rank trains alone on its own samples (from the
/// job's events) with a fresh SGD (stateless) for `every` steps, then the ranks' parameters
/// are averaged.
fn local_sgd_reference(init: Mlp, steps: &[StepDone], every: usize, lr: f64) -> Mlp {
    let settings = Reference {
        optimizer: sgd(),
        learning_rate: LearningRate::Constant(lr),
        clip_norm: None,
    };
    let mut global = init;
    for round in steps.chunks(every) {
        let ranks: Vec<Mlp> = (0..DP as usize)
            .map(|rank| {
                let batches: Vec<Vec<usize>> = round
                    .iter()
                    .map(|s| s.replicas[rank].sample_ids.clone())
                    .collect();
                reference_train(
                    global.clone(),
                    mse_loss,
                    &fixture().data(),
                    &batches,
                    &settings,
                    &Device::flex(),
                )
            })
            .collect();
        global = average(&ranks);
    }
    global
}

/// The mean-squared error of `model` over the whole data set.
fn full_loss(model: &Mlp) -> f32 {
    let device = Device::flex();
    let data = fixture().data();
    let samples: Vec<Sample> = (0..256).filter_map(|i| data.get(i)).collect();
    mse_loss(&model.clone().to_device(&device), &samples, &device).into_scalar()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sgd_every_step_with_sgd_equals_data_parallel_and_one_device() {
    bounded(BOUND, async {
        let steps = 8;
        let (local, events) = train(builder(
            Some(LocalUpdates::local_sgd(1)),
            sgd(),
            0.05,
            steps,
        ))
        .await;
        let (plain, _) = train(builder(None, sgd(), 0.05, steps)).await;
        let done = steps_of(&events);
        assert_eq!(
            all_reduce_steps(&done),
            vec![(0..steps).collect::<Vec<_>>(); DP as usize],
            "LOCAL-1: H = 1 synchronises after every step, on every rank"
        );
        let worst = compare_parameters(&local, &plain, TOLERANCE)
            .unwrap_or_else(|e| panic!("local SGD H=1 vs data parallel: {e}"));
        let one = reference_train(
            fixture().initial_model(),
            mse_loss,
            &fixture().data(),
            &batches_from_events(&done),
            &Reference {
                optimizer: sgd(),
                learning_rate: LearningRate::Constant(0.05),
                clip_norm: None,
            },
            &Device::flex(),
        );
        let worst_one = compare_parameters(&local, &one, TOLERANCE)
            .unwrap_or_else(|e| panic!("local SGD H=1 vs one device: {e}"));
        eprintln!("local SGD H=1: worst vs data parallel {worst:e}, vs one device {worst_one:e}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sgd_every_4_equals_ranks_training_alone_then_averaging() {
    bounded(BOUND, async {
        let (every, steps) = (4, 8);
        let (local, events) = train(builder(
            Some(LocalUpdates::local_sgd(every)),
            sgd(),
            0.05,
            steps,
        ))
        .await;
        let done = steps_of(&events);
        // LOCAL-1, LOCAL-5: a parameter all-reduce after steps 4 and 8 only (0-based 3, 7),
        // one span per bucket, each bucket's bytes adding up to the whole model.
        assert_eq!(all_reduce_steps(&done), vec![vec![3, 7]; DP as usize]);
        let total = meshwork::testing::parameter_count(&local) as u64;
        for s in done.iter().filter(|s| s.step == 3) {
            for r in &s.replicas {
                let bytes: u64 = r
                    .trace
                    .iter()
                    .filter_map(|t| match t.kind {
                        TraceKind::AllReduce { bytes } => Some(bytes),
                        _ => None,
                    })
                    .sum();
                assert_eq!(bytes, 4 * total, "the whole model, once");
            }
        }
        // Each rank read its own quarter of the global batch.
        for s in &done {
            assert_eq!(s.replicas.len(), DP as usize);
            assert!(
                s.replicas
                    .iter()
                    .all(|r| r.sample_ids.len() == GLOBAL_BATCH / 4)
            );
        }
        let reference = local_sgd_reference(fixture().initial_model(), &done, every as usize, 0.05);
        let worst = compare_parameters(&local, &reference, TOLERANCE)
            .unwrap_or_else(|e| panic!("local SGD H=4 vs ranks alone + averaging: {e}"));
        // Proof of distribution: stepping apart is not synchronous data parallelism.
        let (plain, _) = train(builder(None, sgd(), 0.05, steps)).await;
        assert!(
            compare_parameters(&local, &plain, 1e-3).is_err(),
            "local SGD H=4 ended where synchronous data parallelism ends"
        );
        eprintln!("local SGD H=4 vs per-rank Burn loops + averaging: worst {worst:e}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diloco_with_unit_outer_sgd_equals_local_sgd() {
    bounded(BOUND, async {
        let plain_outer = LocalUpdates::DiLoCo {
            every: 4,
            outer_lr: 1.0,
            outer_momentum: 0.0,
            nesterov: false,
        };
        let (diloco, events) = train(builder(Some(plain_outer), adamw(), 0.01, 8)).await;
        let (local, _) = train(builder(Some(LocalUpdates::local_sgd(4)), adamw(), 0.01, 8)).await;
        assert_eq!(
            all_reduce_steps(&steps_of(&events)),
            vec![vec![3, 7]; DP as usize]
        );
        let worst = compare_parameters(&diloco, &local, TOLERANCE)
            .unwrap_or_else(|e| panic!("DiLoCo (lr 1, no momentum) vs local SGD: {e}"));
        // The paper's outer optimizer does something else.
        let (nesterov, _) = train(builder(Some(LocalUpdates::diloco(4)), adamw(), 0.01, 8)).await;
        assert!(compare_parameters(&nesterov, &local, 1e-3).is_err());
        eprintln!("DiLoCo(1, 0) vs local SGD, AdamW inner: worst {worst:e}");
    })
    .await;
}

/// Each method reaches, on the demo task with 4 replicas and H = 4, a full-data loss within a
/// stated margin of synchronous data parallelism's with the same inner optimizer after the
/// same 128 steps (measured: sync SGD 0.0266, local SGD 0.0270, EASGD 0.0344; sync AdamW
/// 0.0082, DiLoCo 0.0098). DiLoCo runs with outer momentum 0.5: the paper's 0.9 is tuned for
/// hundreds of inner steps and overshoots at H = 4 (0.16 after 256 steps; 0.0094 at H = 16).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sgd_diloco_and_easgd_converge_near_synchronous_data_parallel() {
    bounded(BOUND, async {
        let steps = 128;
        let start = full_loss(&fixture().initial_model());
        let diloco = LocalUpdates::DiLoCo {
            every: 4,
            outer_lr: 0.7,
            outer_momentum: 0.5,
            nesterov: true,
        };
        let (sync, _) = train(builder(None, sgd(), 0.2, steps)).await;
        let (adamw_sync, _) = train(builder(None, adamw(), 0.01, steps)).await;
        let (local, _) = train(builder(Some(LocalUpdates::local_sgd(4)), sgd(), 0.2, steps)).await;
        let (diloco, _) = train(builder(Some(diloco), adamw(), 0.01, steps)).await;
        let (easgd, events) = train(builder(
            Some(LocalUpdates::easgd(4, 0.2)),
            sgd(),
            0.2,
            steps,
        ))
        .await;
        let (sync, adamw_sync) = (full_loss(&sync), full_loss(&adamw_sync));
        let (local, diloco, easgd) = (full_loss(&local), full_loss(&diloco), full_loss(&easgd));
        eprintln!(
            "start {start:.4}; sync SGD {sync:.4}, local SGD H=4 {local:.4}, EASGD τ=4 \
             {easgd:.4}; sync AdamW {adamw_sync:.4}, DiLoCo H=4 {diloco:.4}"
        );
        assert!(
            sync < 0.1 * start && adamw_sync < 0.1 * start,
            "the task trains"
        );
        // Margins over synchronous data parallelism with the same inner optimizer.
        assert!(local <= 1.1 * sync, "local SGD {local} vs sync {sync}");
        assert!(easgd <= 1.5 * sync, "EASGD {easgd} vs sync {sync}");
        assert!(
            diloco <= 1.5 * adamw_sync,
            "DiLoCo {diloco} vs sync AdamW {adamw_sync}"
        );
        // EASGD's workers stay apart from one another after an elastic step.
        let prints = final_fingerprints(&events).expect("a Finished event");
        assert_eq!(prints.len(), DP as usize);
        assert!(
            prints.iter().skip(1).all(|p| *p != prints[0]),
            "EASGD's workers are distinct variables: {prints:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_runs_are_bitwise_reproducible() {
    bounded(BOUND, async {
        for updates in [LocalUpdates::diloco(2), LocalUpdates::easgd(2, 0.2)] {
            let mut bits = Vec::new();
            for _ in 0..2 {
                let (model, _) = train(builder(Some(updates), adamw(), 0.01, 4)).await;
                bits.push(parameter_bits(&model));
            }
            assert!(bits[0] == bits[1], "{updates}: two runs of one seed differ");
        }
    })
    .await;
}

/// LOCAL-4: a rank lost between synchronisations rolls the job back to a checkpoint taken
/// between synchronisations (step 6 of H = 4: every rank's own parameters, AdamW state and
/// DiLoCo's outer state), and the job ends bitwise where the uninterrupted one ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_rank_rolls_back_between_syncs_and_ends_bitwise_as_uninterrupted() {
    use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
    use meshwork::recovery::RecoveryPolicy;
    bounded(BOUND, async {
        let dir = TempDir::new("local-lost");
        let updates = LocalUpdates::diloco(4);
        let (uninterrupted, _) = train(builder(Some(updates), adamw(), 0.01, 8)).await;
        let plan = FaultPlan::new(4).with(Fault {
            device: 1,
            step: 7,
            micro_batch: Some(0),
            phase: Phase::Backward,
            kind: FaultKind::Panic,
        });
        let job = builder(Some(updates), adamw(), 0.01, 8)
            .fault_plan(plan)
            .recovery(RecoveryPolicy::shrink().or_roll_back())
            .checkpoint_dir(dir.path())
            .checkpoint_every(2)
            .step_timeout(Duration::from_secs(60));
        let (recovered, events) = train(job).await;
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
            vec![(7, 6)],
            "rolled back to the checkpoint of step 6"
        );
        assert!(
            steps_of(&events)
                .iter()
                .all(|s| s.replicas.len() == DP as usize),
            "never shrank"
        );
        assert!(
            parameter_bits(&recovered) == parameter_bits(&uninterrupted),
            "the rolled-back job differs from the uninterrupted one"
        );
        let _ = std::fs::remove_dir_all(dir.path());
    })
    .await;
}

/// LOCAL-4 across jobs: EASGD (the centre in every rank's part) checkpointed after 4 steps
/// and resumed to 8 equals 8 uninterrupted steps bit for bit; the checkpoint holds one part
/// per rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_easgd_job_equals_the_uninterrupted_one_bitwise() {
    use meshwork::checkpoint::CheckpointStore;
    bounded(BOUND, async {
        let dir = TempDir::new("local-resume");
        let updates = LocalUpdates::easgd(2, 0.2);
        let (uninterrupted, _) = train(builder(Some(updates), sgd(), 0.05, 8)).await;
        train(builder(Some(updates), sgd(), 0.05, 4).checkpoint_dir(dir.path())).await;
        let store = CheckpointStore::open(dir.path(), 3).expect("a store");
        let saved = store.latest_valid().expect("listed").expect("a checkpoint");
        let parts = saved.checkpoint.shards[0]
            .optimizer
            .as_ref()
            .and_then(|o| o.parts())
            .map(<[_]>::len);
        assert_eq!(parts, Some(DP as usize), "one part per rank");
        let (resumed, events) = train(
            builder(Some(updates), sgd(), 0.05, 8)
                .checkpoint_dir(dir.path())
                .resume_from_checkpoint(true),
        )
        .await;
        assert_eq!(steps_of(&events).first().map(|s| s.step), Some(4));
        assert!(
            parameter_bits(&resumed) == parameter_bits(&uninterrupted),
            "the resumed job differs from the uninterrupted one"
        );
        let _ = std::fs::remove_dir_all(dir.path());
    })
    .await;
}

#[test]
fn local_updates_refuse_what_they_cannot_do() {
    let refused = |b: JobBuilder<Mlp, Sample>, want: &str| match b.build() {
        Err(Error::InvalidConfig(m)) => assert!(m.contains(want), "{m}"),
        Err(Error::Refused(r)) => assert!(
            r.features().contains(&Feature::LocalUpdates) && r.to_string().contains(want),
            "{r}"
        ),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("built a job that should be refused ({want})"),
    };
    refused(
        builder(Some(LocalUpdates::local_sgd(0)), sgd(), 0.05, 8),
        "every 0 steps",
    );
    refused(
        builder(Some(LocalUpdates::local_sgd(3)), sgd(), 0.05, 8),
        "multiple of 3",
    );
    refused(
        builder(Some(LocalUpdates::diloco(4)), adamw(), 0.01, 8).zero(ZeroStage::One),
        "zero(One)",
    );
    refused(
        builder(Some(LocalUpdates::easgd(4, 0.5)), sgd(), 0.05, 8),
        "overshoots",
    );
    refused(
        builder(Some(LocalUpdates::local_sgd(4)), sgd(), 0.05, 8).precision(Precision::F16),
        "f16",
    );
    refused(
        builder(Some(LocalUpdates::local_sgd(4)), sgd(), 0.05, 8).clip_grad_norm(1.0),
        "clip_grad_norm",
    );
}
