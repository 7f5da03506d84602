//! A parameter server with a staleness bound, and backup workers: the demo MLP on 4 workers,
//! worker 3 three times slower than the others, trained synchronously (all-reduce), through
//! the server at s = 0, s = 2 and s = ∞ (asynchronous), and with one backup worker. Prints,
//! per method, the final loss on the data set, the wall time, the largest staleness of an
//! applied gradient, and how many gradients of each worker the server applied (and samples
//! it dropped).
//!
//! Run with `cargo run --release --example parameter_server`.

// ANCHOR: imports
use std::time::Instant;

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
use meshwork::prelude::*;
use meshwork::testing::{run_recording, steps_of};
// ANCHOR_END: imports

const WORKERS: u32 = 4;

// ANCHOR: job
fn job(init: &Mlp, task: TeacherTask, method: &str) -> meshwork::Result<Job<Mlp, Sample>> {
    // Worker 3's forwards and backwards take 3× as long.
    let slow = FaultPlan::new(0).with(Fault {
        device: 3,
        step: 0,
        micro_batch: None,
        phase: Phase::Forward,
        kind: FaultKind::Slow { factor: 3.0 },
    });
    let b = Job::builder()
        .initial_model(init.clone())
        .loss(mse_loss)
        .data(task.dataset(1024))
        .optimizer(SgdConfig::new())
        .learning_rate(0.1)
        .data_parallel(WORKERS)
        .batch_size(64)
        // Under s > 0 each micro-batch is a work item: a fast worker takes more of them.
        .gradient_accumulation(4)
        .steps(30)
        .fault_plan(slow);
    match method {
        // All-reduce, every worker every step.
        "sync" => b.build(),
        // Through the server: in lock-step (as "sync", up to rounding), at most 2 clocks
        // ahead of the slowest worker, never waiting (asynchronous SGD).
        "ssp:0" => b
            .parameter_server(ParameterServer::new(Staleness::Bounded(0)))
            .build(),
        "ssp:2" => b
            .parameter_server(ParameterServer::new(Staleness::Bounded(2)))
            .build(),
        "async" => b
            .parameter_server(ParameterServer::new(Staleness::Unbounded))
            .build(),
        // Each step applies the first 3 of the 4 gradients and drops the last.
        "backup" => b.backup_workers(1).build(),
        other => Err(meshwork::Error::InvalidConfig(format!("no method {other}"))),
    }
}
// ANCHOR_END: job

#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let task = TeacherTask {
        d_in: 8,
        d_out: 3,
        noise: 0.1,
        seed: 11,
    };
    let device = Device::flex();
    device.seed(5);
    let init = Mlp::new(&[8, 32, 3], &device);
    let data = task.dataset(1024);
    let samples: Vec<Sample> = (0..data.len()).filter_map(|i| data.get(i)).collect();
    let loss_of = |m: &Mlp| -> f32 { mse_loss(m, &samples, &device).into_scalar() };
    println!("initial loss {:.4}", loss_of(&init));
    for method in ["sync", "ssp:0", "ssp:2", "async", "backup"] {
        let started = Instant::now();
        let (outcome, events) = run_recording(job(&init, task, method)?).await;
        let model = outcome?.model;
        let wall = started.elapsed().as_secs_f64();
        let mut applied = vec![0usize; WORKERS as usize];
        let mut dropped = vec![0usize; WORKERS as usize];
        let mut staleness = 0;
        for s in steps_of(&events) {
            for r in &s.replicas {
                if let Some(ps) = &r.parameter_server {
                    let w = r.stage.replica as usize;
                    applied[w] += ps.applied.len();
                    dropped[w] += ps.dropped.len();
                    staleness = ps
                        .applied
                        .iter()
                        .map(|a| a.staleness)
                        .fold(staleness, u64::max);
                }
            }
        }
        println!(
            "{method:>6}: final loss {:.4}, {wall:.2} s, max staleness {staleness}, gradients \
             applied per worker {applied:?}, samples dropped per worker {dropped:?}",
            loss_of(&model)
        );
    }
    Ok(())
}
