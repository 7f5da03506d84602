//! Quickstart: train a small MLP on two data-parallel replicas and watch its events.
//!
//! Run with `cargo run --release --example quickstart`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::prelude::*;
// ANCHOR_END: imports

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    // A task whose best attainable loss is known (σ² = 0.01), generated from a seed.
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 7,
    };
    let data = task.dataset(4096);

    // The model is plain Burn code; meshwork needs no change to it.
    let device = Device::flex();
    device.seed(7);
    let model = Mlp::new(&[16, 64, 2], &device);

    let job = Job::builder()
        .initial_model(model)
        .loss(mse_loss) // fn(&Mlp, &[Sample], &Device) -> Tensor<1>
        .data(data)
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(2) // two replicas, each on its own logical device
        .batch_size(128) // the global batch: 64 per replica
        .steps(200)
        .build()?;

    let handle = job.spawn().await?;
    let mut events = handle.events();
    let watcher = tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(JobEvent::StepDone(s)) if s.step % 50 == 0 => println!(
                    "step {:>3}  loss {:.4}  {:.0} samples/s",
                    s.step, s.loss, s.samples_per_s
                ),
                Ok(_) => {}
                // A watcher slower than the job misses the oldest events; it keeps reading.
                Err(EventsError::Missed(n)) => eprintln!("missed {n} event(s)"),
                // The job ended (after its Finished or Failed event).
                Err(EventsError::Closed) => break,
            }
        }
    });
    let trained = handle.join().await?;
    let _ = watcher.await;
    let last = trained.summary.last_loss.unwrap_or(f32::NAN);
    println!(
        "final loss {last:.4} (attainable {:.4})",
        task.attainable_loss()
    );
    assert!(last < 0.1, "training converges towards the attainable loss");
    Ok(())
}
// ANCHOR_END: main
