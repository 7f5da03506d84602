//! The recipe large models are trained with, on the small GPT and the King James Bible: two
//! replicas × two pipeline stages × two tensor-parallel ranks (8 devices), the distributed
//! optimizer (ZeRO-1), bf16 compute on f32 master weights, global-norm clipping, gradient
//! accumulation and a warm-up/cosine learning rate — what Megatron-LM, DeepSpeed and
//! torchtitan users run every day. Checks that the validation loss falls below the unigram
//! baseline.
//!
//! Run with `cargo run --release --example recipe`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::data::TextWindow;
use meshwork::demo::gpt::{Gpt, GptConfig, mean_loss};
use meshwork::demo::kjv_corpus;
use meshwork::optim::LearningRate;
use meshwork::prelude::*;
// ANCHOR_END: imports

/// Validation windows evaluated after training.
const VALIDATION_WINDOWS: usize = 128;
const STEPS: u64 = 60;

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
    let data_err = |e: meshwork::data::TextError| Error::Data(e.to_string());
    let train = corpus
        .train_windows(config.context, config.context)
        .map_err(data_err)?;
    let validation = corpus
        .validation_windows(config.context, config.context)
        .map_err(data_err)?;
    let device = Device::flex();
    device.seed(7);
    let model = Gpt::new(&config, &device);

    // ANCHOR: job
    // 1 layer: embedding, attention, MLP and head blocks; on 2 stages, block b on stage
    // b mod 2 (2 chunks each, interleaved 1F1B).
    let blocks = config.blocks() as u32;
    let stages = 2;
    let lr = LearningRate::warmup_cosine(3e-3, 6, STEPS as usize)?;
    let job = Job::builder()
        .pipeline(
            model.into_blocks::<TextWindow>(),
            Schedule::Interleaved {
                virtual_stages: blocks / stages,
                micro_batches: 2,
            },
        )
        .data_parallel(2)
        .tensor_parallel(2)
        .zero(ZeroStage::One)
        .precision(Precision::Bf16)
        .clip_grad_norm(1.0)
        .gradient_accumulation(2)
        .learning_rate(lr)
        .data(train)
        .optimizer(AdamConfig::new())
        .batch_size(16)
        .steps(STEPS)
        .seed(7)
        .build()?;
    let trained = job.spawn().await?.join().await?;
    let model = Gpt::from_blocks(trained.model)
        .ok_or_else(|| Error::Runtime("the trained blocks do not make the GPT back".into()))?;
    // ANCHOR_END: job

    let s = &trained.summary;
    let loss = mean_loss(&model, &validation, VALIDATION_WINDOWS, 32, &device);
    let baseline = corpus.unigram_baseline();
    println!(
        "dp 2 × pp 2 × tp 2, ZeRO-1, bf16, clip 1.0, accumulation 2, warm-up/cosine: training \
         loss {:.4} → {:.4}; validation loss {loss:.4} nats/char (unigram baseline \
         {baseline:.4})",
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
    );
    if loss.is_nan() || loss >= baseline {
        return Err(Error::Runtime(format!(
            "validation loss {loss:.4} is not below the unigram baseline {baseline:.4}"
        )));
    }
    Ok(())
}
// ANCHOR_END: main
