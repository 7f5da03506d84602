//! Pipeline parallelism in one process: a model split into two stages, each a plain Burn
//! module on its own thread, trained with the 1F1B schedule; prints the loss and the measured
//! bubble, and draws the last step's real timeline.
//!
//! Run with `cargo run --release --example pipeline` (add a file name to write the SVG).

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use meshwork::demo::{Sample, TeacherTask, batch_tensors};
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::parallel::pipeline::{Schedule, render_svg, summarize};
use meshwork::parallel::pipeline_exec::{
    AnyTensor, Boundary, StageStepRecord, StageWork, TypedStage, recorded_timeline, train_pipeline,
};

// ANCHOR: stages
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
// ANCHOR_END: stages

// ANCHOR: main
fn main() -> meshwork::Result<()> {
    let device = Device::flex();
    device.seed(1);
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    let data = task.dataset(64 * 40);
    let optimizer: OptimizerConfig = AdamConfig::new().into();
    let lr = || LearningRate::Constant(3e-3);

    // Stage 0 computes an activation and sends it on; stage 1 ends in the mean loss.
    let encoder = Encoder {
        layer: LinearConfig::new(16, 64).init(&device),
    };
    let head = Head {
        hidden: LinearConfig::new(64, 32).init(&device),
        out: LinearConfig::new(32, 2).init(&device),
    };
    let stages: Vec<Box<dyn StageWork<Sample>>> = vec![
        Box::new(TypedStage::new(
            encoder,
            |m: &Encoder, x: Boundary| vec![AnyTensor::D2(relu(m.layer.forward(rank2(&x))))],
            &optimizer,
            lr(),
            &device,
        )),
        Box::new(TypedStage::last(
            head,
            |m: &Head, x: Boundary, items: &[Sample], d: &Device| {
                let (_, y) = batch_tensors(items, d);
                let diff = m.out.forward(relu(m.hidden.forward(rank2(&x)))) - y;
                (diff.clone() * diff).mean()
            },
            &optimizer,
            lr(),
            &device,
        )),
    ];

    // 40 steps of 64 samples, each cut into 4 micro-batches; 1F1B keeps at most 2 in flight.
    let batches: Vec<Vec<Sample>> = (0..40)
        .map(|s| {
            (s * 64..(s + 1) * 64)
                .filter_map(|i| meshwork::data::Dataset::get(&data, i))
                .collect()
        })
        .collect();
    let run = train_pipeline(
        stages,
        &Schedule::OneFOneB { micro_batches: 4 },
        batches,
        Arc::new(|items: &[Sample], d: &Device| vec![AnyTensor::D2(batch_tensors(items, d).0)]),
        &device,
        Duration::from_secs(60),
    )?;

    let mean = |r: &StageStepRecord| r.losses.iter().sum::<f32>() / r.losses.len() as f32;
    let losses = &run.records[1];
    let (first, last) = (mean(&losses[0]), mean(&losses[losses.len() - 1]));
    let step: Vec<&StageStepRecord> = run.records.iter().map(|r| &r[r.len() - 1]).collect();
    let timeline = recorded_timeline(&step);
    println!(
        "loss {first:.4} → {last:.4} (attainable {:.4})",
        task.attainable_loss()
    );
    println!(
        "last step: measured bubble {:.3}, peak stash {}",
        summarize(&timeline).bubble,
        step[0].peak_stash
    );
    if let Some(path) = std::env::args().nth(1) {
        std::fs::write(&path, render_svg(&timeline)).map_err(|e| meshwork::Error::Io {
            path: path.clone(),
            reason: e.to_string(),
        })?;
    }
    assert!(last < first, "the pipeline trains");
    Ok(())
}
// ANCHOR_END: main
