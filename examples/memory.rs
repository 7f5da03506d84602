//! Memory: a model given as blocks, trained by four replicas with ZeRO stage 3 (each keeps a
//! quarter of every block's parameters, gradient and optimizer state), bf16 compute on f32
//! master weights, and every block recomputed during backward; beside it the same blocks
//! with plain data parallelism in f32. Prints what one rank held during the last step of
//! each, counted by the worker, and checks the sharded run holds less and learns alike.
//!
//! Run with `cargo run --release --example memory`.

// ANCHOR: imports
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::{Device, FloatDType, Tensor};
use meshwork::demo::{Sample, TeacherTask, batch_tensors};
use meshwork::parallel::memory::StepMemory;
use meshwork::prelude::*; // Job, PipelineStages, BlockOptions, AnyTensor, Boundary, …
// ANCHOR_END: imports

// ANCHOR: blocks
/// What crosses from one block to the next is a `Boundary`: a list of `AnyTensor`s (rank 1
/// to 4). Every block of this model passes one rank-2 tensor.
fn two(x: &Boundary) -> Tensor<2> {
    match &x[0] {
        AnyTensor::D2(t) => t.clone(),
        _ => unreachable!("every block of this model passes one rank-2 tensor"),
    }
}

/// The model as blocks: a list of ordinary Burn modules, each with its forward; the last ends
/// in the loss. The same list trains as a pipeline with `.pipeline(..)`.
fn blocks(width: usize, depth: usize, options: BlockOptions) -> PipelineStages<Sample> {
    let device = Device::flex();
    device.seed(7);
    let mut stages = PipelineStages::new(|items: &[Sample], d: &Device| {
        vec![AnyTensor::D2(batch_tensors(items, d).0)]
    });
    let mut input = 16;
    for _ in 0..depth {
        let layer = LinearConfig::new(input, width).init(&device);
        stages = stages.block(layer, options, |m: &Linear, x: Boundary| {
            // In low precision the block's weights are bf16: cast the input to them.
            let x = two(&x).cast(m.weight.val().dtype());
            vec![AnyTensor::D2(Relu.forward(m.forward(x)))]
        });
        input = width;
    }
    let head = LinearConfig::new(input, 2).init(&device);
    stages.last(head, |m: &Linear, x, items: &[Sample], d: &Device| {
        let x = two(&x).cast(m.weight.val().dtype());
        let (_, y) = batch_tensors(items, d);
        let diff = m.forward(x).cast(FloatDType::F32) - y;
        (diff.clone() * diff).mean()
    })
}
// ANCHOR_END: blocks

/// Train `blocks` on four replicas; what rank 0 held during the last step and the last loss.
async fn train(
    blocks: PipelineStages<Sample>,
    zero: ZeroStage,
    precision: Precision,
) -> meshwork::Result<(StepMemory, f32)> {
    let task = TeacherTask {
        d_in: 16,
        d_out: 2,
        noise: 0.1,
        seed: 3,
    };
    // ANCHOR: job
    let job = Job::builder()
        .blocks(blocks)
        .zero(zero)
        .precision(precision)
        // Gather the next block's parameters while this one computes.
        .blocks_in_flight(1)
        .data(task.dataset(2048))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(4)
        .batch_size(64)
        .steps(30)
        .build()?;
    // ANCHOR_END: job
    let handle = job.spawn().await?;
    let mut events = handle.events();
    let mut last = (StepMemory::default(), f32::NAN);
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) => {
                if let Some(p) = s.replicas.first().and_then(|r| r.pipeline.as_ref()) {
                    last = (p.memory.clone(), s.loss);
                }
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    handle.join().await?;
    Ok(last)
}

fn show(name: &str, m: &StepMemory) {
    println!(
        "{name}: parameters {} B (full at once {} B, shards {} B), gradients {} B, optimizer \
         {} B, activations {} B",
        m.peak_full_params + m.param_shards,
        m.peak_full_params,
        m.param_shards,
        m.peak_grads,
        m.optimizer,
        m.peak_activations
    );
}

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let plain = blocks(256, 4, BlockOptions::default());
    let (full, full_loss) = train(plain, ZeroStage::Off, Precision::F32).await?;
    let sharded = blocks(256, 4, BlockOptions::default().recompute(true));
    let (small, small_loss) = train(sharded, ZeroStage::Three, Precision::Bf16).await?;
    show("plain data parallel, f32", &full);
    show("ZeRO-3, bf16, recomputed", &small);
    println!("last loss: {full_loss:.4} (plain) and {small_loss:.4} (sharded)");
    let held = |m: &StepMemory| m.peak_full_params + m.param_shards + m.optimizer;
    if held(&small) * 2 > held(&full) || small.peak_activations >= full.peak_activations {
        return Err(meshwork::Error::Runtime(
            "ZeRO-3 held as much as plain".into(),
        ));
    }
    if (small_loss - full_loss).abs() > 0.1 * full_loss {
        return Err(meshwork::Error::Runtime(
            "bf16 did not learn like f32".into(),
        ));
    }
    Ok(())
}
// ANCHOR_END: main
