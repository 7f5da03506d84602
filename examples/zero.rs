//! Sharded optimizer state (ZeRO stages 1 and 2): the same data-parallel job three times, at
//! ZeRO stage 0, 1 and 2, printing what each replica holds and checking that the three
//! trained models are the same.
//!
//! Run with `cargo run --release --example zero`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::job::EventsError;
use meshwork::prelude::*;
use meshwork::testing::compare_parameters;
// ANCHOR_END: imports

// ANCHOR: job
async fn train(zero: ZeroStage, init: Mlp, task: TeacherTask) -> meshwork::Result<Mlp> {
    let handle = Job::builder()
        .initial_model(init)
        .loss(mse_loss)
        .data(task.dataset(2048))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(3)
        .batch_size(48)
        // Each of the 3 replicas keeps Adam's moments for its third of the parameters only;
        // at stage 2 it also keeps only its third of the reduced gradient.
        .zero(zero)
        .steps(20)
        .build()?
        .spawn()
        .await?;
    let mut events = handle.events();
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) if s.step == 19 => {
                for r in &s.replicas {
                    if let Some(held) = r.held {
                        println!(
                            "{zero:?} rank {}: parameters {} B, gradients {} B, optimizer state \
                             {} B (elements {}..{})",
                            r.rank.0,
                            held.params,
                            held.grads,
                            held.optimizer,
                            held.owned.0,
                            held.owned.1
                        );
                    }
                }
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    Ok(handle.join().await?.model)
}
// ANCHOR_END: job

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 3,
    };
    let device = Device::flex();
    device.seed(2);
    let init = Mlp::new(&[16, 64, 64, 2], &device);
    let plain = train(ZeroStage::Off, init.clone(), task).await?;
    for zero in [ZeroStage::One, ZeroStage::Two] {
        let sharded = train(zero, init.clone(), task).await?;
        let worst = compare_parameters(&sharded, &plain, 1e-5)
            .map_err(|e| meshwork::Error::Runtime(format!("{zero:?} differs: {e}")))?;
        println!("{zero:?} trains the same model as plain data parallelism (worst {worst:e})");
    }
    Ok(())
}
// ANCHOR_END: main
