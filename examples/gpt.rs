//! Tensor parallelism: a small character-level GPT on the King James Bible, each layer's
//! matrices split over two devices (Megatron-LM: attention by heads, the MLP by its hidden
//! features, the embedding and the loss by the vocabulary). Checks that the validation loss
//! falls below the unigram baseline (the entropy of the characters' frequencies) and prints
//! text sampled from the trained model.
//!
//! Run with `cargo run --release --example gpt`.

// ANCHOR: imports
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::data::TextWindow;
use meshwork::demo::gpt::{Gpt, GptConfig, mean_loss};
use meshwork::demo::kjv_corpus;
use meshwork::prelude::*;
// ANCHOR_END: imports

/// Validation windows evaluated after training.
const VALIDATION_WINDOWS: usize = 128;

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    // The text, split into characters: the last tenth is held out for validation.
    let corpus = kjv_corpus().map_err(|e| Error::Data(e.to_string()))?;
    let config = GptConfig {
        vocab: corpus.vocab().len(),
        context: 32,
        d_model: 32,
        heads: 4,
        layers: 1,
    };
    let data_err = |e: meshwork::data::TextError| Error::Data(e.to_string());
    // Windows of context + 1 characters: the first `context` are the input, the last the targets.
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
    // The GPT as blocks: the embedding, each layer's attention and MLP, and the head; each
    // block's split matrices are cut over the tensor-parallel group when the job starts.
    let job = Job::builder()
        .blocks(model.into_blocks::<TextWindow>())
        .tensor_parallel(2)
        .data(train)
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .batch_size(16)
        .steps(40)
        .seed(7)
        .build()?;
    let trained = job.spawn().await?.join().await?;
    // The slices put back together: the one-device model, trained.
    let model = Gpt::from_blocks(trained.model)
        .ok_or_else(|| Error::Runtime("the trained blocks do not make the GPT back".into()))?;
    // ANCHOR_END: job

    let s = &trained.summary;
    let loss = mean_loss(&model, &validation, VALIDATION_WINDOWS, 32, &device);
    let baseline = corpus.unigram_baseline();
    println!(
        "training loss {:.4} → {:.4}; validation loss {loss:.4} nats/char (unigram baseline \
         {baseline:.4})",
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
    );

    // ANCHOR: sample
    let prompt = "And God said";
    let ids = corpus.vocab().encode(prompt).map_err(data_err)?;
    let text = corpus
        .vocab()
        .decode(&model.sample(&ids, 60, 0.8, 7, &device))
        .map_err(data_err)?;
    println!("{prompt}{text}");
    // ANCHOR_END: sample

    if loss.is_nan() || loss >= baseline {
        return Err(Error::Runtime(format!(
            "validation loss {loss:.4} is not below the unigram baseline {baseline:.4}"
        )));
    }
    Ok(())
}
// ANCHOR_END: main
