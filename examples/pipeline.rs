//! Pipeline parallelism: a model given as two plain Burn modules, each a pipeline stage on its
//! own device (a stage actor), trained with the 1F1B schedule in a 2 × 2 mesh (two
//! data-parallel replicas of the pipeline); prints the loss and the measured bubble, and draws
//! the last step's real timeline.
//!
//! Run with `cargo run --release --example pipeline` (add a file name to write the SVG).

// ANCHOR: imports
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use meshwork::demo::{Sample, TeacherTask, batch_tensors};
use meshwork::parallel::pipeline::render_svg;
use meshwork::prelude::*; // Job, PipelineStages, Schedule, AnyTensor, Boundary, JobEvent, …
// ANCHOR_END: imports

// ANCHOR: model
/// The first half of the model: plain Burn.
#[derive(Module, Debug)]
struct Encoder {
    layer: Linear,
}

/// The second half, which ends in the loss.
#[derive(Module, Debug)]
struct Head {
    hidden: Linear,
    out: Linear,
}

fn rank2(b: &Boundary) -> Tensor<2> {
    match &b[0] {
        AnyTensor::D2(t) => t.clone(),
        other => panic!("expected a rank-2 activation, got {other:?}"),
    }
}
// ANCHOR_END: model

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let device = Device::flex();
    device.seed(1);
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    let encoder = Encoder {
        layer: LinearConfig::new(16, 64).init(&device),
    };
    let head = Head {
        hidden: LinearConfig::new(64, 32).init(&device),
        out: LinearConfig::new(32, 2).init(&device),
    };

    // ANCHOR: stages
    // The inputs go to the first stage, the targets (read from the same items) to the last.
    let stages = PipelineStages::new(|items: &[Sample], d: &Device| {
        vec![AnyTensor::D2(batch_tensors(items, d).0)]
    })
    .stage(encoder, |m: &Encoder, x: Boundary| {
        vec![AnyTensor::D2(relu(m.layer.forward(rank2(&x))))]
    })
    .last(
        head,
        |m: &Head, x: Boundary, items: &[Sample], d: &Device| {
            let (_, y) = batch_tensors(items, d);
            let diff = m.out.forward(relu(m.hidden.forward(rank2(&x)))) - y;
            (diff.clone() * diff).mean()
        },
    );
    // ANCHOR_END: stages

    // 2 replicas × 2 stages = 4 devices. Each replica takes half of the global batch of 64
    // and cuts it into 4 micro-batches; 1F1B keeps at most 2 in flight per stage.
    let handle = Job::builder()
        .pipeline(stages, Schedule::OneFOneB { micro_batches: 4 })
        .data_parallel(2)
        .data(task.dataset(64 * 40))
        .batch_size(64)
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .steps(40)
        .step_timeout(Duration::from_secs(120))
        .build()?
        .spawn()
        .await?;
    let mut events = handle.events();
    let mut last_step = None;
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) => last_step = s.pipeline,
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    let trained = handle.join().await?;
    let encoder: &Encoder = trained.model.block(0).expect("block 0 is the encoder");
    let s = &trained.summary;
    println!(
        "loss {:.4} → {:.4} (attainable {:.4}); encoder weight {:?}",
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
        task.attainable_loss(),
        encoder.layer.weight.dims()
    );
    if let Some(p) = last_step {
        println!(
            "last step: measured bubble {:.3}, peak stash per stage {:?}",
            p.bubble, p.peak_stash
        );
        if let Some(path) = std::env::args().nth(1) {
            std::fs::write(&path, render_svg(&p.timeline)).map_err(|e| meshwork::Error::Io {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        }
    }
    assert!(s.last_loss < s.first_loss, "the pipeline trains");
    Ok(())
}
// ANCHOR_END: main
