//! Data parallel on Burn's wgpu backend equals one wgpu device. Runs without a GPU on Mesa's
//! software Vulkan: `CUBECL_WGPU_DEFAULT_DEVICE=Cpu cargo test --features wgpu --test wgpu`.
#![cfg(feature = "wgpu")]

use std::collections::HashSet;
use std::time::Duration;

use burn::optim::SgdConfig;
use burn::tensor::{Device, DeviceKind};
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::optim::LearningRate;
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, batches_from_events, compare_parameters, reference_train, run_recording, steps_of,
};

/// Same bound as on CPU: max|a − b| ≤ 1e-5 · max|reference| per tensor.
const TOLERANCE: f32 = 1e-5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_2_on_wgpu_matches_single_wgpu_device() {
    tokio::time::timeout(Duration::from_secs(600), async {
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let task = TeacherTask {
            d_in: 8,
            d_out: 3,
            noise: 0.1,
            seed: 11,
        };
        let data = task.dataset(256);
        device.seed(5);
        let init = Mlp::new(&[8, 32, 3], &device);
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
    .await
    .expect("bounded");
}
