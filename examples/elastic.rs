//! Elastic training with checkpoints: a data-parallel job grows from 2 to 4 replicas and
//! shrinks to 3 at step boundaries while writing a checkpoint every 5 steps; a second job then
//! resumes from the newest checkpoint on a single replica and finishes the run.
//!
//! Run with `cargo run --release --example elastic`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::job::{EventsError, JobBuilder};
use meshwork::prelude::*;
// ANCHOR_END: imports

// ANCHOR: builder
/// The job both runs share: the demo MLP, Adam, a global batch of 48.
fn builder(task: TeacherTask, steps: u64) -> JobBuilder<Mlp, Sample> {
    let device = Device::flex();
    device.seed(1);
    Job::builder()
        .initial_model(Mlp::new(&[16, 64, 2], &device))
        .loss(mse_loss)
        .data(task.dataset(4096))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .batch_size(48)
        .steps(steps)
}
// ANCHOR_END: builder

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    let dir = std::env::temp_dir().join(format!("meshwork-elastic-{}", std::process::id()));

    // 2 replicas, between 1 and 4 allowed; a checkpoint every 5 steps, the newest 2 kept.
    let handle = builder(task, 12)
        .data_parallel(2)
        .fault_tolerance(FaultTolerance::new().elastic(1, 4))
        .checkpoint_dir(&dir)
        .checkpoint_every(5)
        .keep_checkpoints(2)
        .build()?
        .spawn()
        .await?;
    let control = handle.control();
    let mut events = handle.events();
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) => {
                println!(
                    "step {:2}: loss {:.4} on {} replicas",
                    s.step,
                    s.loss,
                    s.replicas.len()
                );
                // Grow after step 2, shrink after step 7: both apply at the next boundary.
                match s.step {
                    2 => control.scale_to(4),
                    7 => control.scale_to(3),
                    _ => {}
                }
            }
            Ok(JobEvent::Resized {
                step,
                from,
                to,
                generation,
            }) => println!(
                "step {step}: resized {from} → {to} replicas (generation {})",
                generation.0
            ),
            Ok(JobEvent::CheckpointWritten { step, path }) => {
                println!("checkpoint after step {step}: {}", path.display())
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    handle.join().await?;

    // A new job resumes from the newest checkpoint, on one replica, and runs to step 16.
    let (outcome, events) = meshwork::testing::run_recording(
        builder(task, 16)
            .data_parallel(1)
            .checkpoint_dir(&dir)
            .resume_from_checkpoint(true)
            .build()?,
    )
    .await;
    let trained = outcome?;
    for e in &events {
        if let JobEvent::Restored { step, path, .. } = e {
            println!("resumed after step {step} from {}", path.display());
        }
    }
    println!(
        "finished at step 16: loss {:.4}",
        trained.summary.last_loss.unwrap_or(f32::NAN)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
// ANCHOR_END: main
