//! Data parallel on Burn's wgpu backend equals one wgpu device. Runs without a GPU on Mesa's
//! software Vulkan: `CUBECL_WGPU_DEFAULT_DEVICE=Cpu cargo test --features wgpu --test wgpu`.
#![cfg(feature = "wgpu")]

use std::collections::HashSet;
use std::time::Duration;

use burn::optim::SgdConfig;
use burn::tensor::{Device, DeviceKind};
use meshwork::demo::{Mlp, mse_loss};
use meshwork::optim::LearningRate;
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, batches_from_events, bounded, compare_parameters, draw_lock,
    reference_train, run_recording, steps_of,
};

/// Same bound as on CPU: max|a − b| ≤ 1e-5 · max|reference| per tensor.
const TOLERANCE: f32 = 1e-5;
/// Every test's wait.
const BOUND: Duration = Duration::from_secs(600);

// The device's random generator is shared by this file's tests, which run on parallel
// threads: a model is seeded and drawn under `draw_lock`, in one piece. The models are drawn on
// the wgpu device (not the fixtures' Flex `initial_model`), from the fixtures' seeds and widths.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_2_on_wgpu_matches_single_wgpu_device() {
    bounded(BOUND, async {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        // 256 samples of the 8 → 3 teacher (seed 11, noise 0.1); the 8-32-3 MLP of seed 5.
        let fixture = TeacherFixture::new(11, 5).with_widths(&[8, 32, 3]);
        let data = fixture.data();
        let init = {
            let _draw = draw_lock();
            device.seed(fixture.model_seed);
            meshwork::parallel::stages::materialize(Mlp::new(&fixture.widths, &device))
        };
        let job = Job::builder()
            .initial_model(init.clone())
            .loss(mse_loss)
            .data(data.clone())
            .optimizer(SgdConfig::new())
            .learning_rate(0.05)
            .data_parallel(2)
            .devices(MeshDevice::wgpu(2))
            .batch_size(16)
            .steps(10)
            .build()
            .expect("valid job");
        let (outcome, events) = run_recording(job).await;
        let trained = outcome.expect("job succeeds on wgpu");
        let steps = steps_of(&events);
        assert_eq!(steps.len(), 10);
        for s in &steps {
            let ids: HashSet<usize> = s
                .replicas
                .iter()
                .flat_map(|r| r.sample_ids.clone())
                .collect();
            assert_eq!(s.replicas.len(), 2);
            assert_eq!(ids.len(), 16, "disjoint shares making the global batch");
        }
        assert!(
            compare_parameters(&trained.model, &init, 1e-3).is_err(),
            "it trained"
        );
        let reference = reference_train(
            init,
            mse_loss,
            &data,
            &batches_from_events(&steps),
            &Reference {
                optimizer: SgdConfig::new().into(),
                learning_rate: LearningRate::Constant(0.05),
                clip_norm: None,
            },
            &device,
        );
        let worst = compare_parameters(&trained.model, &reference, TOLERANCE).expect("equivalent");
        eprintln!("wgpu dp=2: worst relative difference {worst:e}");
    })
    .await;
}

/// Mixed precision on wgpu (PREC-1): for each 16-bit type, where the device computes in it, a
/// dp 2 job tracks the f32 job's loss within 5 % at every step after the third and keeps f32
/// master weights; where it does not (Mesa's software Vulkan may lack 16-bit float shaders),
/// `build()` refuses the precision naming the device (JOB-1) instead of computing garbage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_precision_on_wgpu_tracks_f32_or_is_refused() {
    use burn::tensor::FloatDType;
    use meshwork::parallel::autocast::{compute_dtype, float_dtype};
    bounded(BOUND, async {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        // 256 samples of the 8 → 3 teacher (seed 21, noise 0.05); the 8-32-3 MLP of seed 9.
        let fixture = TeacherFixture::new(21, 9)
            .with_widths(&[8, 32, 3])
            .with_noise(0.05);
        let data = fixture.data();
        let job = |precision: Precision| {
            let init = {
                let _draw = draw_lock();
                device.seed(fixture.model_seed);
                meshwork::parallel::stages::materialize(Mlp::new(&fixture.widths, &device))
            };
            Job::builder()
                .initial_model(init)
                .loss(mse_loss)
                .data(data.clone())
                .optimizer(burn::optim::AdamConfig::new())
                .learning_rate(0.01)
                .data_parallel(2)
                .devices(MeshDevice::wgpu(2))
                .batch_size(16)
                .steps(12)
                .precision(precision)
                .build()
        };
        let (outcome, events) = run_recording(job(Precision::F32).expect("valid job")).await;
        outcome.expect("the f32 job succeeds");
        let reference: Vec<f32> = steps_of(&events).iter().map(|s| s.loss).collect();
        for precision in [Precision::Bf16, Precision::F16] {
            if !device.supports_dtype(float_dtype(precision)) {
                let refused = job(precision);
                assert!(
                    matches!(&refused, Err(Error::InvalidConfig(m)) if m.contains("does not compute in")),
                    "{precision} unsupported: refused at build"
                );
                eprintln!("wgpu: {precision} not supported by this device, refused at build");
                continue;
            }
            let (outcome, events) = run_recording(job(precision).expect("valid job")).await;
            let model = outcome.expect("the job succeeds").model;
            assert_eq!(compute_dtype(&model), Some(FloatDType::F32), "f32 master weights");
            let losses: Vec<f32> = steps_of(&events).iter().map(|s| s.loss).collect();
            for (i, (l, r)) in losses.iter().zip(&reference).enumerate().skip(3) {
                assert!(
                    (l - r).abs() <= 0.05 * r,
                    "{precision} step {i}: {l} vs f32 {r}"
                );
            }
        }
    })
    .await;
}

/// ZeRO-3 on wgpu (FSDP-1, MEM-1): a block job whose replicas keep only their shard of every
/// block equals the same blocks trained by plain data parallelism on wgpu (itself equal to one
/// device: `tests/suite/fsdp.rs`), within the bound above; each rank held a shard, never the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_3_blocks_on_wgpu_match_plain_data_parallel() {
    use meshwork::demo::mlp_blocks;
    bounded(BOUND, async {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        // 256 samples of the 32 → 4 teacher (seed 17, noise 0.1); the 32-48-48-4 MLP of seed 3
        // as blocks.
        let fixture = TeacherFixture::new(17, 3).with_widths(&[32, 48, 48, 4]);
        let data = fixture.data();
        let blocks = {
            let _draw = draw_lock();
            device.seed(fixture.model_seed);
            mlp_blocks(
                &fixture.widths,
                BlockOptions::default().recompute(true),
                &device,
            )
            .expect("the demo MLP as blocks")
        };
        let job = |zero: ZeroStage| {
            Job::builder()
                .blocks(blocks.clone())
                .zero(zero)
                .data(data.clone())
                .optimizer(burn::optim::AdamConfig::new())
                .learning_rate(0.01)
                .data_parallel(2)
                .devices(MeshDevice::wgpu(2))
                .batch_size(16)
                .steps(4)
                .build()
                .expect("valid job")
        };
        let mut trained = Vec::new();
        for zero in [ZeroStage::Off, ZeroStage::Three] {
            let (outcome, events) = run_recording(job(zero)).await;
            let model = outcome.expect("the block job succeeds on wgpu").model;
            let steps = steps_of(&events);
            assert_eq!(steps.len(), 4);
            for s in &steps {
                assert_eq!(s.replicas.len(), 2, "two replicas computed");
                for r in &s.replicas {
                    let m = &r.pipeline.as_ref().expect("block step figures").memory;
                    if zero == ZeroStage::Three {
                        assert!(m.param_shards > 0, "a rank holds its shard");
                        assert!(
                            m.peak_full_params < 4 * (32 * 48 + 48 + 48 * 48 + 48 + 48 * 4 + 4),
                            "a rank never held the whole model at once: {m:?}"
                        );
                    } else {
                        assert_eq!(m.param_shards, 0);
                    }
                }
            }
            trained.push(Mlp::from_pipeline(model).expect("the demo MLP's blocks"));
        }
        compare_parameters(&trained[1], &trained[0], TOLERANCE)
            .expect("ZeRO-3 equals plain data parallel on wgpu");
    })
    .await;
}
