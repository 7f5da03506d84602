//! GPUs: the quickstart's job on two logical wgpu devices. Needs the `wgpu` feature:
//! `cargo run --features wgpu --example gpus`; on a machine without a GPU, add
//! `CUBECL_WGPU_DEFAULT_DEVICE=Cpu` to run on Mesa's software Vulkan.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::{Device, DeviceKind};
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::mesh::DeviceId;
use meshwork::prelude::*;
// ANCHOR_END: imports

// ANCHOR: adapters
/// One logical device per discrete GPU, `DiscreteGpu(0)` to `DiscreteGpu(n - 1)`, in place
/// of `MeshDevice::wgpu(n)`'s `n` devices on the one default adapter.
fn one_per_discrete_gpu(n: usize) -> Vec<MeshDevice> {
    (0..n)
        .map(|i| {
            let gpu = Device::wgpu(DeviceKind::DiscreteGpu(i));
            MeshDevice::from_burn(DeviceId(i as u32), BackendKind::Wgpu, gpu)
        })
        .collect()
}
// ANCHOR_END: adapters

#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 7,
    };
    // ANCHOR: devices
    // `gpus discrete`: one device per discrete GPU; otherwise two on the default adapter.
    let devices = match std::env::args().nth(1).as_deref() {
        Some("discrete") => one_per_discrete_gpu(2),
        _ => MeshDevice::wgpu(2),
    };
    // The model is drawn on the first device; every replica gets a copy on its own.
    let device = devices[0].burn().clone();
    device.seed(7);
    let model = Mlp::new(&[16, 64, 2], &device);

    let trained = Job::builder()
        .initial_model(model)
        .loss(mse_loss)
        .data(task.dataset(4096))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(2)
        .devices(devices) // in place of the default: one Flex CPU device per replica
        .batch_size(128)
        .steps(100)
        .build()?
        .spawn()
        .await?
        .join()
        .await?;
    // ANCHOR_END: devices
    let last = trained.summary.last_loss.unwrap_or(f32::NAN);
    println!(
        "final loss {last:.4} (attainable {:.4})",
        task.attainable_loss()
    );
    assert!(last < 0.1, "training converges towards the attainable loss");
    Ok(())
}
