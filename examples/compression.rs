//! Gradient compression: the same 4-replica job uncompressed, with bf16 gradients (their
//! ring's partial sums in f32, then in bf16), top-k sparsification and PowerSGD (each with
//! error feedback), printing the final loss and the bytes each replica sent per step.
//!
//! Run with `cargo run --release --example compression`.

// ANCHOR: imports
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::tensor::Device;
use meshwork::comm::PartialSums;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::job::EventsError;
use meshwork::prelude::*;
// ANCHOR_END: imports

// ANCHOR: job
/// Train with `compression`, a 16-bit ring's partial sums travelling as `partial_sums` says;
/// returns the mean loss of the last 5 steps and the bytes replica 0 sent in the last step.
async fn train(
    (compression, partial_sums): (Compression, PartialSums),
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
        // The ring, as across machines: in one process `Auto` reads peers' memory directly.
        .algorithm(Algorithm::Ring)
        .partial_sums(partial_sums)
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
                bytes = s.replicas[0].bytes_sent;
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
        (Compression::None, PartialSums::F32),
        // Every value rounded to bf16: the ring's partial sums travel as f32 (4 bytes, each
        // sum rounded once), its final values as bf16 (2 bytes).
        (Compression::Bf16, PartialSums::F32),
        // The same, the partial sums in bf16 too (each hop rounds, as NCCL's bf16).
        (Compression::Bf16, PartialSums::Narrow),
        // The largest 5 % of the entries, as (index, value) pairs.
        (Compression::TopK { fraction: 0.05 }, PartialSums::F32),
        // Rank-2 factors of every matrix, after 10 uncompressed steps.
        (
            Compression::PowerSgd {
                rank: 2,
                start_after: 10,
            },
            PartialSums::F32,
        ),
    ];
    // ANCHOR_END: values
    for scheme in schemes {
        let (loss, bytes) = train(scheme, init.clone(), task).await?;
        let (c, sums) = scheme;
        let sums = if c == Compression::Bf16 {
            format!(", {sums}")
        } else {
            String::new()
        };
        println!(
            "{:>32}: final loss {loss:.5}, {bytes:>6} bytes sent per replica per step",
            format!("{c}{sums}")
        );
    }
    Ok(())
}
