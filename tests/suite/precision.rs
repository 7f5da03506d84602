//! Mixed precision (PREC-1..3): bf16 and f16 runs track the f32 run's loss, on the demo MLP and
//! on a model with LayerNorm; one replica in bf16 is Burn's own mixed-precision loop bit for
//! bit, and two replicas stay bit-identical on distributed work; f16's loss scaler grows,
//! backs off and skips on an injected overflow on every replica together; the master weights
//! (trained model, checkpoint) are `f32`.
//!
//! Tolerances: a 16-bit run is not an f32 run, so a low-precision run is compared with f32 by
//! its loss: at every step after the first `WARM` steps, `|loss − loss_f32| ≤ LOSS_TOL ·
//! loss_f32`. Parameters of two replicas are compared bit for bit; one replica in bf16 against
//! a plain Burn loop computing on the same bf16 copies, bit for bit; two replicas against
//! that loop within `DP_TOL · max|ref|` (the bf16 matmuls sum the batch in another grouping).
//! Measured (flex): worst loss distance bf16 4.3 %, f16 1.8 %, LayerNorm bf16 1.6 %, f16
//! 0.2 %; dp 2 against one device 7.7e-4 · max|ref|.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, FloatDType, Tensor};
use meshwork::checkpoint::CheckpointStore;
use meshwork::demo::{Mlp, Sample, batch_tensors, mse_loss};
use meshwork::demo::{MlpStage, rank2};
use meshwork::events::{JobEvent, StepDone};
use meshwork::optim::LearningRate;
use meshwork::parallel::autocast::{compute_dtype, low_precision_copy};
use meshwork::parallel::pipeline_exec::{AnyTensor, Boundary};
use meshwork::parallel::stages::{BlockOptions, PipelineModel, PipelineStages};
use meshwork::precision::LossScalerConfig;
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    draw_lock, final_fingerprints, parameter_bits, reference_train, run_recording, steps_of,
};

/// Relative distance of a 16-bit run's loss from the f32 run's, at every step after `WARM`.
const LOSS_TOL: f32 = 0.08;
const WARM: usize = 3;
/// Two bf16 replicas against one device computing in bf16: `max|a − b| ≤ DP_TOL · max|ref|`.
const DP_TOL: f32 = 1e-2;
const STEPS: u64 = 24;
const GLOBAL_BATCH: usize = 16;
const BOUND: Duration = Duration::from_secs(300);

/// 256 samples of the 8 → 3 teacher (seed 21, noise 0.05) and the 8-32-32-3 MLP of seed 9
/// (`initial_model`, drawn under the suite's draw lock: Burn's generator is process-global and
/// the tests run on parallel threads).
fn fixture() -> TeacherFixture {
    TeacherFixture::new(21, 9)
        .with_widths(&[8, 32, 32, 3])
        .with_noise(0.05)
}

/// A small model with LayerNorm: linear, LayerNorm, ReLU, linear. Its forward casts its input
/// to its parameters' dtype (what a model trained in low precision does).
#[derive(Module, Debug)]
struct NormNet {
    input: Linear,
    norm: LayerNorm,
    output: Linear,
}

impl NormNet {
    fn new(device: &Device) -> Self {
        let _draw = draw_lock();
        device.seed(13);
        meshwork::parallel::stages::materialize(Self {
            input: LinearConfig::new(8, 32).init(device),
            norm: LayerNormConfig::new(32).init(device),
            output: LinearConfig::new(32, 3).init(device),
        })
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = x.cast(self.input.weight.val().dtype());
        self.output
            .forward(relu(self.norm.forward(self.input.forward(x))))
    }
}

fn norm_loss(model: &NormNet, samples: &[Sample], device: &Device) -> Tensor<1> {
    let (x, y) = batch_tensors(samples, device);
    let diff = model.forward(x).cast(FloatDType::F32) - y;
    (diff.clone() * diff).mean()
}

fn builder<M: Module + 'static>(
    model: M,
    loss: impl Fn(&M, &[Sample], &Device) -> Tensor<1> + Send + Sync + 'static,
    precision: Precision,
    dp: u32,
) -> JobBuilder<M, Sample> {
    Job::builder()
        .initial_model(model)
        .loss(loss)
        .data(fixture().data())
        .optimizer(AdamConfig::new())
        .learning_rate(0.01)
        .data_parallel(dp)
        .batch_size(GLOBAL_BATCH)
        .steps(STEPS)
        .seed(4)
        .precision(precision)
        .collective_timeout(Duration::from_secs(30))
}

fn losses(steps: &[StepDone]) -> Vec<f32> {
    steps.iter().map(|s| s.loss).collect()
}

/// Runs `job`, checks that it finished with bit-identical replicas that shared every step's
/// batch, and returns its model and steps.
async fn run<M: Send + 'static>(job: Job<M, Sample>, dp: usize) -> (M, Vec<StepDone>) {
    let (outcome, events) = run_recording(job).await;
    let model = outcome.expect("job succeeds").model;
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS);
    for s in &steps {
        assert_eq!(s.replicas.len(), dp, "every replica reports every step");
        let mut ids: Vec<usize> = s
            .replicas
            .iter()
            .flat_map(|r| r.sample_ids.clone())
            .collect();
        assert!(
            s.replicas.iter().all(|r| !r.sample_ids.is_empty()),
            "every replica trained on samples of step {}",
            s.step
        );
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GLOBAL_BATCH, "the replicas' shares are disjoint");
    }
    let prints = final_fingerprints(&events).expect("a Finished event");
    assert_eq!(prints.len(), dp);
    assert!(
        prints.windows(2).all(|w| w[0] == w[1]),
        "DP-1/PREC-2: replicas end bit-identical: {prints:x?}"
    );
    (model, steps)
}

/// Every step after the warm-up within `LOSS_TOL` of the f32 run, and the run learned.
fn assert_tracks(name: &str, low: &[f32], f32_run: &[f32]) {
    for (i, (l, r)) in low.iter().zip(f32_run).enumerate().skip(WARM) {
        assert!(
            (l - r).abs() <= LOSS_TOL * r,
            "{name}: step {i} loss {l} is not within {LOSS_TOL} of f32's {r}\n{name}: {low:?}\nf32: {f32_run:?}"
        );
    }
    assert!(low[low.len() - 1] < 0.5 * low[0], "{name} learned: {low:?}");
    let worst = low
        .iter()
        .zip(f32_run)
        .skip(WARM)
        .map(|(l, r)| (l - r).abs() / r)
        .fold(0.0f32, f32::max);
    eprintln!("{name}: worst relative loss distance to f32 {worst:.4}");
}

/// PREC-1: the trained model's parameters are f32.
fn assert_f32_master<M: Module>(model: &M) {
    assert_eq!(
        compute_dtype(model),
        Some(FloatDType::F32),
        "master weights are f32"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_and_f16_track_the_f32_loss_on_the_demo_mlp() {
    bounded(BOUND, async {
        let (_, reference) = run(
            builder(fixture().initial_model(), mse_loss, Precision::F32, 2)
                .build()
                .unwrap(),
            2,
        )
        .await;
        let reference = losses(&reference);
        for (precision, low_grads) in [(Precision::Bf16, false), (Precision::F16, true)] {
            let job = builder(fixture().initial_model(), mse_loss, precision, 2)
                .low_precision_gradients(low_grads)
                .build()
                .expect("valid job");
            let (model, steps) = run(job, 2).await;
            assert_f32_master(&model);
            let name = format!("{precision} (16-bit gradients: {low_grads})");
            assert_tracks(&name, &losses(&steps), &reference);
            for s in &steps {
                let scale = s.loss_scale;
                assert_eq!(
                    scale.is_some(),
                    precision == Precision::F16,
                    "{name}: loss scale"
                );
                if low_grads {
                    let bytes: u64 = s.replicas[0]
                        .trace
                        .iter()
                        .filter_map(|t| match t.kind {
                            meshwork::trace::TraceKind::AllReduce { bytes } => Some(bytes),
                            _ => None,
                        })
                        .sum();
                    // 8·32 + 32 + 32·32 + 32 + 32·3 + 3 parameters, 2 bytes each.
                    assert_eq!(bytes, 2 * 1443, "{name}: gradients travel as 16-bit");
                }
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_and_f16_track_the_f32_loss_with_layer_norm() {
    bounded(BOUND, async {
        let device = Device::flex();
        let (_, reference) = run(
            builder(NormNet::new(&device), norm_loss, Precision::F32, 2)
                .build()
                .unwrap(),
            2,
        )
        .await;
        let reference = losses(&reference);
        for precision in [Precision::Bf16, Precision::F16] {
            let job = builder(NormNet::new(&device), norm_loss, precision, 2)
                .build()
                .expect("valid job");
            let (model, steps) = run(job, 2).await;
            assert_f32_master(&model);
            assert_tracks(
                &format!("LayerNorm {precision}"),
                &losses(&steps),
                &reference,
            );
        }
    })
    .await;
}

/// One replica in bf16 is the plain Burn loop on the bf16 copies bit for bit; two replicas
/// stay bit-identical and are within `DP_TOL` of it. The same job twice gives the same bits.
/// SGD: Adam's normalised update turns bf16's rounding of a near-zero gradient into a full
/// learning-rate step, which says nothing about the reduction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_data_parallel_matches_burns_mixed_precision_loop() {
    bounded(BOUND, async {
        let mixed_loss = |m: &Mlp, s: &[Sample], d: &Device| {
            mse_loss(&low_precision_copy(m, Precision::Bf16), s, d)
        };
        let reference = |batches: &[Vec<usize>]| {
            reference_train(
                fixture().initial_model(),
                mixed_loss,
                &fixture().data(),
                batches,
                &Reference {
                    optimizer: SgdConfig::new().into(),
                    learning_rate: LearningRate::Constant(0.05),
                    clip_norm: None,
                },
                &Device::flex(),
            )
        };
        let sgd = |dp: u32| {
            builder(fixture().initial_model(), mse_loss, Precision::Bf16, dp)
                .optimizer(SgdConfig::new())
                .learning_rate(0.05)
                .build()
                .expect("valid job")
        };
        let (one, steps) = run(sgd(1), 1).await;
        let plain = reference(&batches_from_events(&steps));
        assert_eq!(
            parameter_bits(&one),
            parameter_bits(&plain),
            "one replica in bf16 is Burn's mixed-precision loop, bit for bit"
        );
        let (two, steps) = run(sgd(2), 2).await;
        let plain = reference(&batches_from_events(&steps));
        let worst = compare_parameters(&two, &plain, DP_TOL).expect("dp 2 within DP_TOL");
        eprintln!("bf16 dp 2 against one device in bf16: worst {worst:e}");
        let (again, _) = run(sgd(2), 2).await;
        assert_eq!(
            parameter_bits(&two),
            parameter_bits(&again),
            "REPRO-1 in bf16"
        );
    })
    .await;
}

/// PREC-2: an overflow injected on one replica at step 3 (its loss × 10⁶, so the scaled
/// gradient overflows f16) makes every replica skip step 3 and halve the scale; the scale grows
/// after every 2 clean steps; the replicas end bit-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_loss_scaler_grows_backs_off_and_skips_together() {
    bounded(BOUND, async {
        const OVERFLOW_STEP: usize = 3;
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        // Both replicas call the loss once per step and steps run one after another, so
        // calls 2s and 2s + 1 are step s: only the first of step 3's calls overflows.
        let loss = move |m: &Mlp, s: &[Sample], d: &Device| {
            let l = mse_loss(m, s, d);
            if seen.fetch_add(1, Ordering::SeqCst) == 2 * OVERFLOW_STEP {
                l * 1e6
            } else {
                l
            }
        };
        let config = LossScalerConfig {
            init_scale: 1024.0,
            ..LossScalerConfig::default()
        }
        .growth_interval(2);
        let job = builder(fixture().initial_model(), loss, Precision::F16, 2)
            .loss_scaler(config)
            .build()
            .expect("valid job");
        let (outcome, events) = run_recording(job).await;
        let model = outcome.expect("job succeeds").model;
        assert_f32_master(&model);
        let steps = steps_of(&events);
        assert_eq!(steps.len() as u64, STEPS);
        let used: Vec<f32> = steps
            .iter()
            .map(|s| s.loss_scale.expect("f16 scales"))
            .collect();
        // 0,1 clean → ×2; 2 clean; 3 overflow → skip, ×0.5; 4,5 clean → ×2; ...
        let mut want = vec![1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0];
        let mut s = 2048.0;
        while want.len() < STEPS as usize {
            want.extend([s, s]);
            s *= 2.0;
        }
        want.truncate(STEPS as usize);
        assert_eq!(used, want, "the scale each step used");
        let skipped: Vec<u64> = steps.iter().filter(|s| s.skipped).map(|s| s.step).collect();
        assert_eq!(
            skipped,
            vec![OVERFLOW_STEP as u64],
            "only the overflowing step skipped"
        );
        let overflows: Vec<(u64, f32, f32)> = events
            .iter()
            .filter_map(|e| match e {
                JobEvent::GradientOverflow {
                    step,
                    scale,
                    next_scale,
                } => Some((*step, *scale, *next_scale)),
                _ => None,
            })
            .collect();
        assert_eq!(overflows, vec![(OVERFLOW_STEP as u64, 2048.0, 1024.0)]);
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, JobEvent::NonFiniteLoss { .. })),
            "an overflow is not a non-finite loss"
        );
        let prints = final_fingerprints(&events).expect("Finished");
        assert_eq!(
            prints[0], prints[1],
            "PREC-2: both replicas skipped the same step"
        );
        assert!(calls.load(Ordering::SeqCst) >= 2 * STEPS as usize);
    })
    .await;
}

/// PREC-1: a bf16 job's checkpoint holds the f32 master weights: values that bf16 cannot
/// represent (low 16 bits set), equal bit for bit to the trained model's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_hold_f32_master_weights() {
    bounded(BOUND, async {
        let dir = TempDir::new("precision");
        let job = builder(fixture().initial_model(), mse_loss, Precision::Bf16, 2)
            .checkpoint_dir(dir.path())
            .build()
            .expect("valid job");
        let (model, _) = run(job, 2).await;
        let store = CheckpointStore::open(dir.path(), 3).expect("store");
        let loaded = store
            .latest_valid()
            .expect("listable")
            .expect("a checkpoint at the end");
        assert_eq!(loaded.checkpoint.step, STEPS);
        let params = &loaded.checkpoint.shards[0].params;
        let stored: Vec<Vec<u32>> = params
            .params()
            .iter()
            .map(|p| p.values.iter().map(|v| v.to_bits()).collect())
            .collect();
        assert_eq!(
            stored,
            parameter_bits(&model),
            "the checkpoint is the trained model"
        );
        let beyond_bf16 = stored.iter().flatten().filter(|b| *b & 0xFFFF != 0).count();
        let total: usize = stored.iter().map(Vec::len).sum();
        assert!(
            beyond_bf16 > total / 2,
            "master weights carry f32 precision: {beyond_bf16} of {total} values beyond bf16"
        );
        let _ = std::fs::remove_dir_all(dir.path());
    })
    .await;
}

/// The fixture's MLP (its widths, its seed) as blocks of one layer each.
fn mlp_layers() -> Vec<MlpStage> {
    let fixture = fixture();
    let _draw = draw_lock();
    let device = Device::flex();
    device.seed(fixture.model_seed);
    meshwork::demo::split_mlp(&fixture.widths, &[1, 1, 1], &device).expect("blocks of the MLP")
}

/// The MLP's blocks at ZeRO-3 over 2 replicas, the middle blocks recomputed in their
/// backward, in `precision`.
fn block_job(precision: Precision) -> Job<PipelineModel, Sample> {
    let stages =
        meshwork::demo::mlp_blocks_of(mlp_layers(), BlockOptions::default().recompute(true));
    block_builder(stages, precision)
        .build()
        .expect("a valid block job")
}

fn block_builder(
    stages: PipelineStages<Sample>,
    precision: Precision,
) -> JobBuilder<PipelineModel, Sample> {
    Job::builder()
        .blocks(stages)
        .data(fixture().data())
        .optimizer(AdamConfig::new())
        .learning_rate(0.01)
        .data_parallel(2)
        .zero(ZeroStage::Three)
        .batch_size(GLOBAL_BATCH)
        .steps(STEPS)
        .seed(4)
        .precision(precision)
        .collective_timeout(Duration::from_secs(30))
}

/// MIX-1: a ZeRO-3 block job in bf16 tracks the f32 block job's loss, its replicas (each
/// holding a shard, whole blocks gathered for the fingerprint) end bit-identical, the same job
/// twice gives the same bits, and the master weights are f32.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bf16_block_job_at_zero_3_tracks_f32() {
    bounded(BOUND, async {
        let (_, reference) = run(block_job(Precision::F32), 2).await;
        let (mut a, steps) = run(block_job(Precision::Bf16), 2).await;
        let (mut b, _) = run(block_job(Precision::Bf16), 2).await;
        assert_tracks("blocks bf16", &losses(&steps), &losses(&reference));
        assert_ne!(
            losses(&steps),
            losses(&reference),
            "the blocks computed in bf16"
        );
        for s in &steps {
            for r in &s.replicas {
                let memory = &r.pipeline.as_ref().expect("a block job's record").memory;
                assert!(memory.param_shards > 0, "ZeRO-3: each rank holds a shard");
            }
        }
        for i in 0..3 {
            let (x, y) = (
                a.take_block::<meshwork::demo::MlpStage>(i)
                    .expect("a block"),
                b.take_block::<meshwork::demo::MlpStage>(i)
                    .expect("a block"),
            );
            assert_f32_master(&x);
            assert_eq!(
                parameter_bits(&x),
                parameter_bits(&y),
                "block {i} reproducible"
            );
        }
    })
    .await;
}

/// MIX-2: in an f16 block job at ZeRO-3, an overflow injected on one replica's last block at
/// step 3 (its loss × 10⁶) makes every replica skip step 3 and halve the scale (each block's
/// flag combined across blocks and replicas); the scale grows after every 2 clean steps; the
/// replicas end bit-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_block_job_skips_together_on_an_overflow() {
    bounded(BOUND, async {
        const OVERFLOW_STEP: usize = 3;
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let mut layers = mlp_layers();
        let last = layers.pop().expect("a last layer");
        let mut stages = PipelineStages::new(|items: &[Sample], d: &Device| {
            vec![AnyTensor::D2(batch_tensors(items, d).0)]
        });
        for layer in layers {
            stages = stages.block(
                layer,
                BlockOptions::default(),
                |m: &MlpStage, x: Boundary| vec![AnyTensor::D2(m.forward(rank2(&x)))],
            );
        }
        // One micro-batch per replica and step: calls 2s and 2s + 1 are step s.
        let stages = stages.last(
            last,
            move |m: &MlpStage, x: Boundary, items: &[Sample], d: &Device| {
                let (_, y) = batch_tensors(items, d);
                let diff = m.forward(rank2(&x)).cast(FloatDType::F32) - y;
                let l = (diff.clone() * diff).mean();
                if seen.fetch_add(1, Ordering::SeqCst) == 2 * OVERFLOW_STEP {
                    l * 1e6
                } else {
                    l
                }
            },
        );
        let config = LossScalerConfig {
            init_scale: 1024.0,
            ..LossScalerConfig::default()
        }
        .growth_interval(2);
        let job = block_builder(stages, Precision::F16)
            .loss_scaler(config)
            .build()
            .expect("valid job");
        let (_, steps) = run(job, 2).await;
        let used: Vec<f32> = steps
            .iter()
            .map(|s| s.loss_scale.expect("f16 scales"))
            .collect();
        let mut want = vec![1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0];
        let mut s = 2048.0;
        while want.len() < STEPS as usize {
            want.extend([s, s]);
            s *= 2.0;
        }
        want.truncate(STEPS as usize);
        assert_eq!(used, want, "the scale each step used");
        let skipped: Vec<u64> = steps.iter().filter(|s| s.skipped).map(|s| s.step).collect();
        assert_eq!(
            skipped,
            vec![OVERFLOW_STEP as u64],
            "only the overflowing step"
        );
        assert!(calls.load(Ordering::SeqCst) >= 2 * STEPS as usize);
    })
    .await;
}

/// MIX-3: an f16 job checkpointed after 5 steps and resumed ends bitwise equal to the
/// uninterrupted run and uses the same loss scale at every step after the resume (the
/// scaler's scale and clean-step count travel in the checkpoint); the checkpoint holds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_resumed_job_continues_its_loss_scale() {
    bounded(BOUND, async {
        const RESUMED: u64 = 8;
        let config = LossScalerConfig {
            init_scale: 1024.0,
            ..LossScalerConfig::default()
        }
        .growth_interval(2);
        let job = |steps: u64, dir: &std::path::Path, resume: bool| {
            builder(fixture().initial_model(), mse_loss, Precision::F16, 2)
                .loss_scaler(config)
                .steps(steps)
                .checkpoint_dir(dir)
                .resume_from_checkpoint(resume)
                .build()
                .expect("valid job")
        };
        let (whole_dir, dir) = (
            TempDir::new("precision-scale-whole"),
            TempDir::new("precision-scale-resume"),
        );
        let (outcome, events) = run_recording(job(RESUMED, whole_dir.path(), false)).await;
        let whole = outcome.expect("the uninterrupted run").model;
        let whole_steps = steps_of(&events);
        let (outcome, _) = run_recording(job(5, dir.path(), false)).await;
        outcome.expect("the first part");
        let store = CheckpointStore::open(dir.path(), 3).expect("store");
        let saved = store
            .latest_valid()
            .expect("listable")
            .expect("a checkpoint at the end");
        let state = saved.checkpoint.shards[0]
            .training
            .loss_scale
            .expect("the scaler's state is checkpointed");
        // Steps 0..4 clean: grown at steps 1 and 3, one clean step since.
        assert_eq!((state.scale, state.clean_steps), (4096.0, 1));
        let (outcome, events) = run_recording(job(RESUMED, dir.path(), true)).await;
        let resumed = outcome.expect("the resumed run").model;
        let scales = |steps: &[StepDone]| -> Vec<(u64, Option<f32>)> {
            steps
                .iter()
                .filter(|s| s.step >= 5)
                .map(|s| (s.step, s.loss_scale))
                .collect()
        };
        let resumed_steps = steps_of(&events);
        assert_eq!(resumed_steps.len(), 3, "the resumed run trained steps 5..8");
        assert_eq!(scales(&resumed_steps), scales(&whole_steps));
        assert_eq!(parameter_bits(&resumed), parameter_bits(&whole));
        let _ = std::fs::remove_dir_all(dir.path());
        let _ = std::fs::remove_dir_all(whole_dir.path());
    })
    .await;
}

#[test]
fn bad_scalers_are_refused() {
    let r = builder(fixture().initial_model(), mse_loss, Precision::F16, 1)
        .loss_scaler(LossScalerConfig::default().growth_interval(0))
        .build();
    assert!(matches!(r, Err(Error::InvalidConfig(m)) if m.contains("growth interval")));
}

/// `NormNet` as a model that was never written for mixed precision: no cast of its input,
/// none of its output.
fn uncast_loss(model: &NormNet, samples: &[Sample], device: &Device) -> Tensor<1> {
    let (x, y) = batch_tensors(samples, device);
    let out = model
        .output
        .forward(relu(model.norm.forward(model.input.forward(x))));
    let diff = out - y;
    (diff.clone() * diff).mean()
}

/// PREC-4: a model without casts trains in f32; under bf16 its first step ends the job with
/// `Error::DtypeMismatch`, which names the casts to add, and not with the backend's bare
/// assertion as a lost stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prec_4_a_model_without_casts_fails_under_bf16_naming_the_casts_to_add() {
    // The uncast model, trained for the bound at most in `precision`.
    let run_in = |precision| async move {
        let job = builder(NormNet::new(&Device::flex()), uncast_loss, precision, 2)
            .build()
            .expect("a valid job");
        tokio::time::timeout(Duration::from_secs(120), run_recording(job))
            .await
            .expect("the job ends")
    };
    let (outcome, _) = run_in(Precision::F32).await;
    outcome.expect("the model trains in f32");
    let (outcome, events) = run_in(Precision::Bf16).await;
    match outcome {
        Err(e @ Error::DtypeMismatch { .. }) => {
            let m = e.to_string();
            assert!(m.contains("cast the model's input"), "{m}");
            assert!(
                m.contains("dtype mismatch"),
                "the backend's words are kept: {m}"
            );
        }
        Err(e) => panic!("expected Error::DtypeMismatch, got {e}"),
        Ok(_) => panic!("a model without casts trained in bf16"),
    }
    assert!(steps_of(&events).is_empty(), "no step completed");
}
