//! Elastic resizing of a pipeline job, rehearsed: the small GPT on the King James Bible over
//! two replicas × two pipeline stages with the distributed optimizer (ZeRO-1). A fault plan
//! fixes two resizes — spot instances taken away after step 6 (down to one replica), then
//! more arriving after step 12 (up to four) — so the rehearsal replays exactly; a service
//! asks for the same with `control.scale_to(n)`. Each resize gathers every rank's optimizer
//! part, rewires the mesh under a new generation and re-shards the state over the new
//! data-parallel groups; the global batch stays the same.
//!
//! Run with `cargo run --release --example elastic_mesh`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::data::TextWindow;
use meshwork::demo::gpt::{Gpt, GptConfig};
use meshwork::demo::kjv_corpus;
use meshwork::faults::FaultPlan;
use meshwork::job::EventsError;
use meshwork::prelude::*;
// ANCHOR_END: imports

const STEPS: u64 = 18;

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let corpus = kjv_corpus().map_err(|e| Error::Data(e.to_string()))?;
    let config = GptConfig {
        vocab: corpus.vocab().len(),
        context: 32,
        d_model: 32,
        heads: 4,
        layers: 1,
    };
    let train = corpus
        .train_windows(config.context, config.context)
        .map_err(|e| Error::Data(e.to_string()))?;
    let device = Device::flex();
    device.seed(7);
    let model = Gpt::new(&config, &device);

    // ANCHOR: plan
    // The rehearsal: at the boundary before step 6 the job is asked for one replica, before
    // step 12 for four.
    let plan = FaultPlan::new(7).with_resize(6, 1).with_resize(12, 4);
    // ANCHOR_END: plan

    // ANCHOR: job
    let blocks = config.blocks() as u32;
    let handle = Job::builder()
        .pipeline(
            model.into_blocks::<TextWindow>(),
            Schedule::Interleaved {
                virtual_stages: blocks / 2,
                micro_batches: 2,
            },
        )
        .data_parallel(2)
        .zero(ZeroStage::One)
        .fault_tolerance(FaultTolerance::new().elastic(1, 4))
        .fault_plan(plan)
        .data(train)
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .batch_size(16)
        .steps(STEPS)
        .seed(7)
        .build()?
        .spawn()
        .await?;
    let mut events = handle.events();
    let mut sizes = Vec::new();
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) => {
                // One report per rank: replicas × 2 stages.
                let replicas = s.replicas.len() / 2;
                println!(
                    "step {:2}: loss {:.4} on {replicas} × 2 ranks",
                    s.step, s.loss
                );
                sizes.push(replicas);
            }
            Ok(JobEvent::Resized { step, from, to, .. }) => {
                println!("before step {step}: resized from {from} to {to} replicas")
            }
            Ok(JobEvent::ResizeRefused { requested, reason }) => {
                println!("resize to {requested} refused: {reason}")
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    let trained = handle.join().await?;
    // ANCHOR_END: job

    let s = &trained.summary;
    let (first, last) = (
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
    );
    println!("training loss {first:.4} → {last:.4}; replicas per step {sizes:?}");
    let want: Vec<usize> = (0..STEPS)
        .map(|step| match step {
            0..6 => 2,
            6..12 => 1,
            _ => 4,
        })
        .collect();
    if sizes != want {
        return Err(Error::Runtime(format!(
            "the job ran on {sizes:?} replicas, not the rehearsal's {want:?}"
        )));
    }
    if last.is_nan() || last >= first {
        return Err(Error::Runtime(format!(
            "the training loss went from {first:.4} to {last:.4}"
        )));
    }
    Ok(())
}
// ANCHOR_END: main
