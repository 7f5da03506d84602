//! Fully sharded data parallelism (ZeRO stage 3): the demo MLP given as four blocks and
//! trained by three replicas that each keep only a third of every block's parameters,
//! optimizer state and gradient between uses. Prints what each replica held during the last
//! step, counted by the worker.
//!
//! Run with `cargo run --release --example fsdp`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{TeacherTask, mlp_pipeline};
use meshwork::job::EventsError;
use meshwork::prelude::*;
// ANCHOR_END: imports

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
    // ANCHOR: job
    // Five linear layers cut into four blocks.
    let blocks = mlp_pipeline(&[16, 64, 64, 64, 64, 2], &[2, 1, 1, 1], &device)
        .ok_or_else(|| meshwork::Error::InvalidConfig("the split does not fit".into()))?;
    let handle = Job::builder()
        .blocks(blocks)
        .data(task.dataset(1024))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(3)
        .batch_size(48)
        .zero(ZeroStage::Three)
        .steps(10)
        .build()?
        .spawn()
        .await?;
    // ANCHOR_END: job
    // ANCHOR: events
    let mut events = handle.events();
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) if s.step == 9 => {
                for r in &s.replicas {
                    if let Some(m) = r.pipeline.as_ref().map(|p| &p.memory) {
                        println!(
                            "rank {}: parameter shards {} B, peak full parameters {} B, peak \
                             gradients {} B, optimizer state {} B, peak activations {} B",
                            r.rank.0,
                            m.param_shards,
                            m.peak_full_params,
                            m.peak_grads,
                            m.optimizer,
                            m.peak_activations
                        );
                    }
                }
                println!("loss {:.4}", s.loss);
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    let model = handle.join().await?.model;
    println!("trained {} blocks", model.len());
    // ANCHOR_END: events
    Ok(())
}
