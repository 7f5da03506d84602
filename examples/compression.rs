//! Gradient compression: the same 4-replica job uncompressed, with bf16 gradients, top-k
//! sparsification and PowerSGD (each with error feedback), printing the final loss and the
//! bytes each replica's collectives carried per step.
//!
//! Run with `cargo run --release --example compression`.

// ANCHOR: imports
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::job::EventsError;
use meshwork::prelude::*;
use meshwork::trace::TraceKind;
// ANCHOR_END: imports

// ANCHOR: job
/// Train with `compression`; returns the mean loss of the last 5 steps and replica 0's bytes
/// per step.
async fn train(
    compression: Compression,
    init: Mlp,
    task: TeacherTask,
) -> meshwork::Result<(f32, u64)> {
    let steps = 100;
    let handle = Job::builder()
        .initial_model(init)
        .loss(mse_loss)
        .data(task.dataset(2048))
        .optimizer(SgdConfig::new().with_momentum(Some(MomentumConfig::new())))
        .learning_rate(0.05)
        .data_parallel(4)
        .batch_size(64)
        .compression(compression)
        .steps(steps)
        .build()?
        .spawn()
        .await?;
    let mut events = handle.events();
    let (mut tail, mut bytes) = (Vec::new(), 0);
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) => {
                if s.step + 5 >= steps {
                    tail.push(s.loss);
                }
                bytes = s.replicas[0]
                    .trace
                    .iter()
                    .map(|t| match t.kind {
                        TraceKind::AllReduce { bytes } | TraceKind::AllGather { bytes } => bytes,
                        _ => 0,
                    })
                    .sum();
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    handle.join().await?;
    Ok((tail.iter().sum::<f32>() / tail.len().max(1) as f32, bytes))
}
// ANCHOR_END: job

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
    // ANCHOR: values
    let schemes = [
        // Plain f32 all-reduce (the default).
        Compression::None,
        // Every value rounded to bf16; 2 bytes each on the wire.
        Compression::Bf16,
        // The largest 5 % of the entries, as (index, value) pairs.
        Compression::TopK { fraction: 0.05 },
        // Rank-2 factors of every matrix, after 10 uncompressed steps.
        Compression::PowerSgd {
            rank: 2,
            start_after: 10,
        },
    ];
    // ANCHOR_END: values
    for c in schemes {
        let (loss, bytes) = train(c, init.clone(), task).await?;
        println!(
            "{:>14}: final loss {loss:.5}, {bytes:>6} bytes per replica per step",
            c.to_string()
        );
    }
    Ok(())
}
