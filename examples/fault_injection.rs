//! A fault-injection rehearsal: four data-parallel replicas train the demo MLP while a
//! `FaultPlan` kills one device, makes another panic in its backward, drops one collective
//! message, corrupts another and slows a device. The Supervisor shrinks the group for each
//! lost device (the survivors redo the failed step on the same global batch) and retries the
//! step with everyone for each lost or corrupt message. Prints every fault, loss and recovery
//! as it happens.
//!
//! Run with `cargo run --release --example fault_injection [plan.json]` (default: the plan in
//! `book/snippets/faults.json`).

// ANCHOR: imports
use std::time::Duration;

use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::faults::FaultPlan;
use meshwork::prelude::*;
use meshwork::recovery::RecoveryPolicy;
// ANCHOR_END: imports

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "book/snippets/faults.json".into());
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Io {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let plan = FaultPlan::from_json(&text)?;

    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    let device = Device::flex();
    device.seed(1);
    let handle = Job::builder()
        .initial_model(Mlp::new(&[16, 64, 2], &device))
        .loss(mse_loss)
        .data(task.dataset(4096))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(4)
        .batch_size(48)
        .steps(20)
        // Inject the plan's faults; continue with the survivors, down to 2 replicas, at most
        // 5 recoveries a minute.
        .fault_tolerance(
            FaultTolerance::new().fault_plan(plan).recovery(
                RecoveryPolicy::shrink()
                    .min_replicas(2)
                    .max_restarts(5, Duration::from_secs(60)),
            ),
        )
        .collective_timeout(Duration::from_secs(2))
        .build()?
        .spawn()
        .await?;

    let mut events = handle.events();
    let mut recoveries = 0;
    loop {
        match events.recv().await {
            Ok(JobEvent::FaultInjected(f)) => {
                println!("fault {} fired: {:?}", f.index, f.fault.kind)
            }
            Ok(JobEvent::DeviceLost {
                step,
                device,
                error,
                ..
            }) => {
                println!("step {step}: lost device {device}: {error}")
            }
            Ok(JobEvent::Recovered {
                step,
                generation,
                layout,
                lost,
            }) => {
                recoveries += 1;
                let why = if lost.is_empty() {
                    "a message was lost or corrupt"
                } else {
                    "a device was lost"
                };
                println!(
                    "step {step}: {why}; generation {} with {} replicas redoes the step",
                    generation.0,
                    layout.dp()
                )
            }
            Ok(JobEvent::StepDone(s)) => println!(
                "step {:2}: loss {:.4} on {} replicas",
                s.step,
                s.loss,
                s.replicas.len()
            ),
            Ok(_) | Err(meshwork::job::EventsError::Missed(_)) => {}
            Err(meshwork::job::EventsError::Closed) => break,
        }
    }
    let trained = handle.join().await?;
    println!(
        "finished {} steps after {recoveries} recoveries: loss {:.4} → {:.4}",
        trained.summary.steps,
        trained.summary.first_loss.unwrap_or(f32::NAN),
        trained.summary.last_loss.unwrap_or(f32::NAN)
    );
    assert_eq!(recoveries, 4, "every failure was recovered");
    Ok(())
}
// ANCHOR_END: main
