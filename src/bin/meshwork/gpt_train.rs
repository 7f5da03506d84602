//! `meshwork train --model gpt`: the small GPT on the King James Bible, character by
//! character, over a dp × pp × tp mesh; validation loss against the unigram baseline, and
//! text sampled from the trained model.

use std::time::Duration;

use burn::optim::AdamConfig;
use meshwork::data::TextWindow;
use meshwork::demo::gpt::{Gpt, GptConfig, mean_loss};
use meshwork::demo::kjv_corpus;
use meshwork::device::MeshDevice;
use meshwork::error::Error;
use meshwork::job::{Job, PipelineModel, Trained};
use meshwork::parallel::pipeline::Schedule;

use crate::demo_job::{no_watchers, report_time, run_job};
use crate::train::TrainArgs;

/// Validation windows evaluated before and after training.
const VALIDATION_WINDOWS: usize = 256;

/// What the flags ask of the GPT.
pub(crate) struct GptFlags {
    pub(crate) config: GptConfig,
    pub(crate) tp: u32,
    pub(crate) sample: Option<usize>,
}

/// Trains the GPT as `args` and `gpt` say.
pub(crate) async fn train(args: &TrainArgs, gpt: GptFlags) -> meshwork::error::Result<()> {
    let corpus = kjv_corpus().map_err(|e| Error::Data(format!("the embedded text: {e}")))?;
    let vocab = corpus.vocab().len();
    let config = GptConfig {
        vocab,
        ..gpt.config
    };
    let context = config.context;
    let data_err = |e: meshwork::data::TextError| Error::Data(e.to_string());
    let train = corpus.train_windows(context, context).map_err(data_err)?;
    let validation = corpus
        .validation_windows(context, context)
        .map_err(data_err)?;
    let (pp, tp) = (args.pp, gpt.tp);
    let too_many = || Error::InvalidConfig("--dp × --pp × --tp is too large".into());
    let per_replica = pp.checked_mul(tp).ok_or_else(too_many)?;
    let dp = args.dp.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        (cores / per_replica).max(1)
    });
    let world = dp.checked_mul(per_replica).ok_or_else(too_many)? as usize;
    let devices = MeshDevice::of_kind(args.device, world)?;
    let model_device = devices[0].burn().clone();
    model_device.seed(args.seed);
    let init = Gpt::new(&config, &model_device);
    let eval_device = burn::tensor::Device::flex();
    let baseline = corpus.unigram_baseline();
    let before = mean_loss(&init, &validation, VALIDATION_WINDOWS, 32, &eval_device);
    let batch = args.batch_size_or(32);
    println!(
        "meshwork train --model gpt: {dp} × {pp} × {tp} (data × pipeline × tensor) {:?} device(s); \
         {} layers, d_model {}, {} heads, context {context}, vocabulary {vocab}; \
         {} training windows, global batch {batch}, {} steps",
        args.device,
        config.layers,
        config.d_model,
        config.heads,
        train_len(&train),
        args.steps,
    );
    println!(
        "validation loss before training {before:.4} nats/char; unigram baseline {baseline:.4}"
    );
    let stages = init.into_blocks::<TextWindow>();
    let builder = if pp > 1 {
        let blocks = config.blocks() as u32;
        if !blocks.is_multiple_of(pp) {
            return Err(Error::InvalidConfig(format!(
                "--pp {pp}: the GPT has {blocks} blocks (embedding, attention and MLP per layer, \
                 head), which do not split evenly over {pp} stages; choose --layers so that \
                 2 × layers + 2 is a multiple of {pp}"
            )));
        }
        // Block b on stage b mod pp: each stage holds blocks / pp of them (interleaved).
        Job::builder().pipeline(
            stages,
            Schedule::Interleaved {
                virtual_stages: blocks / pp,
                micro_batches: args.micro_batches,
            },
        )
    } else {
        Job::builder().blocks(stages)
    };
    let builder = builder
        .tensor_parallel(tp)
        .zero(meshwork::parallel::zero::ZeroStage::from_number(args.zero).unwrap_or_default())
        .precision(args.precision)
        .low_precision_gradients(args.low_precision_gradients)
        .data_parallel(dp)
        .devices(devices)
        .data(train)
        .optimizer(AdamConfig::new())
        .batch_size(batch)
        .steps(args.steps)
        .seed(args.seed)
        .collective_timeout(Duration::from_secs_f64(args.collective_timeout));
    let builder =
        crate::train::training_settings(args, crate::train::learning_rate(args)?, builder);
    // A checkpoint restores onto another --dp and --tp, re-sliced (TP-7).
    let builder = crate::train::checkpoint_settings(&args.checkpoint_flags(), builder);
    let conclude = |trained: Trained<PipelineModel>| -> meshwork::error::Result<()> {
        let s = &trained.summary;
        let model = Gpt::from_blocks(trained.model)
            .ok_or_else(|| Error::Runtime("the trained blocks do not make the GPT back".into()))?;
        let after = mean_loss(&model, &validation, VALIDATION_WINDOWS, 32, &eval_device);
        println!(
            "training loss {:.4} → {:.4}; validation loss {before:.4} → {after:.4} nats/char \
             (unigram baseline {baseline:.4}: {})",
            s.first_loss.unwrap_or(f32::NAN),
            s.last_loss.unwrap_or(f32::NAN),
            if after < baseline {
                format!("{:.1} % below it", 100.0 * (baseline - after) / baseline)
            } else {
                "not below it yet: train longer".to_string()
            }
        );
        report_time(s);
        if let Some(n) = gpt.sample {
            let prompt = "And God said";
            let ids = corpus
                .vocab()
                .encode(prompt)
                .map_err(|e| Error::Data(e.to_string()))?;
            let out = model.sample(&ids, n, 0.8, args.seed, &eval_device);
            let text = corpus
                .vocab()
                .decode(&out)
                .map_err(|e| Error::Data(e.to_string()))?;
            println!(
                "sample (temperature 0.8, seed {}):\n{prompt}{text}",
                args.seed
            );
        }
        Ok(())
    };
    run_job(builder, args.steps, no_watchers(), conclude).await?;
    Ok(())
}

fn train_len(d: &meshwork::data::TextWindows) -> usize {
    use meshwork::data::Dataset;
    d.len()
}
