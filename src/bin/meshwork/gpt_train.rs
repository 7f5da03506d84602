//! `meshwork train --model gpt`: the small GPT on the King James Bible, character by
//! character, over a dp × pp × tp mesh — in this process, or across processes (the head and
//! every node build the same job from the job spec: [`cluster_job`]); validation loss
//! against the unigram baseline, and text sampled from the trained model.

use std::path::PathBuf;

use burn::module::Module;
use meshwork::data::{CharCorpus, TextWindow, TextWindows};
use meshwork::demo::gpt::{Gpt, GptConfig, mean_loss};
use meshwork::demo::kjv_corpus;
use meshwork::device::MeshDevice;
use meshwork::error::Error;
use meshwork::job::{Job, JobBuilder, PipelineModel, Trained};
use meshwork::job_config::PipelineConfig;
use meshwork::parallel::pipeline::Schedule;
use meshwork::parallel::stages::BlockOptions;

use crate::demo_job::{Watchers, no_watchers, report_time, run_job};
use crate::settings::Shape;
use crate::train::TrainArgs;

/// Validation windows evaluated before and after training.
const VALIDATION_WINDOWS: usize = 256;

/// What the flags ask of the GPT.
pub(crate) struct GptFlags {
    pub(crate) config: GptConfig,
    pub(crate) tp: u32,
    pub(crate) sample: Option<usize>,
}

/// The GPT's text: the embedded corpus and its training and validation windows of `context`
/// characters.
pub(crate) struct GptData {
    corpus: CharCorpus,
    train: TextWindows,
    validation: TextWindows,
}

impl GptData {
    /// The King James text cut into windows of `context` characters.
    pub(crate) fn load(context: usize) -> meshwork::error::Result<Self> {
        let corpus = kjv_corpus().map_err(|e| Error::Data(format!("the embedded text: {e}")))?;
        let data_err = |e: meshwork::data::TextError| Error::Data(e.to_string());
        let train = corpus.train_windows(context, context).map_err(data_err)?;
        let validation = corpus
            .validation_windows(context, context)
            .map_err(data_err)?;
        Ok(Self {
            corpus,
            train,
            validation,
        })
    }

    /// The corpus's vocabulary size.
    pub(crate) fn vocab(&self) -> usize {
        self.corpus.vocab().len()
    }
}

/// What the end of a GPT run reports (and saves).
pub(crate) struct GptReport {
    pub(crate) sample: Option<usize>,
    pub(crate) seed: u64,
    pub(crate) save: Option<PathBuf>,
    /// The validation loss before training.
    pub(crate) before: f64,
}

/// The interleaved pipeline the GPT of `config` is cut into over `--pp` stages (block b on
/// stage b mod pp, over `--micro-batches`), or `None` at `--pp` 1 (a block job).
pub(crate) fn gpt_pipeline(
    args: &TrainArgs,
    config: &GptConfig,
) -> meshwork::error::Result<Option<PipelineConfig>> {
    let (pp, micro_batches) = (args.pp, args.micro_batches);
    if pp <= 1 {
        return Ok(None);
    }
    // A --config file's own schedule (`meshwork plan --emit-config` writes 1F1B where every
    // stage holds one block), unless the command line reshapes the pipeline.
    let reshaped = ["pp", "micro_batches"]
        .iter()
        .any(|f| args.given.contains(*f));
    if let Some(p) = args.file.as_ref().and_then(|f| f.pipeline)
        && p.stages == pp
        && !reshaped
    {
        return Ok(Some(p));
    }
    let blocks = config.blocks() as u32;
    if !blocks.is_multiple_of(pp) {
        return Err(Error::InvalidConfig(format!(
            "--pp {pp}: the GPT has {blocks} blocks (embedding, attention and MLP per layer, \
             head), which do not split evenly over {pp} stages; choose --layers so that \
             2 × layers + 2 is a multiple of {pp}"
        )));
    }
    Ok(Some(PipelineConfig {
        stages: pp,
        schedule: Schedule::Interleaved {
            virtual_stages: blocks / pp,
            micro_batches,
        },
    }))
}

/// The GPT `init` as a job: its blocks cut as `pipeline` says, or as a block job without
/// one; each attention and MLP block recomputing its forward in its backward with
/// `recompute`.
pub(crate) fn gpt_builder(
    init: Gpt,
    pipeline: Option<PipelineConfig>,
    recompute: bool,
) -> JobBuilder<PipelineModel, TextWindow> {
    let stages = init.into_blocks_with::<TextWindow>(BlockOptions::default().recompute(recompute));
    match pipeline {
        None => Job::builder().blocks(stages),
        Some(p) => Job::builder().pipeline(stages, p.schedule),
    }
}

/// Trains the GPT as `args` and `gpt` say, in this process.
pub(crate) async fn train(args: &TrainArgs, gpt: GptFlags) -> meshwork::error::Result<()> {
    let data = GptData::load(gpt.config.context)?;
    let config = GptConfig {
        vocab: data.vocab(),
        ..gpt.config
    };
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
    let unit = dp as usize * args.micro_batches_per_replica();
    let batch = args.global_batch(32, unit);
    let shape = Shape {
        data_parallel: dp,
        pipeline: gpt_pipeline(args, &config)?,
        batch_size: batch,
    };
    let job = crate::settings::job_config(args, shape, true)?;
    if args.print_config {
        return crate::job_file::print(args, &job);
    }
    println!(
        "meshwork train --model gpt: {dp} × {pp} × {tp} (data × pipeline × tensor) {:?} device(s); \
         {} layers, d_model {}, {} heads, context {}, vocabulary {}; \
         {} training windows, {}, {} steps",
        args.device,
        config.layers,
        config.d_model,
        config.heads,
        config.context,
        config.vocab,
        train_len(&data.train),
        args.batch_line(32, unit),
        args.steps,
    );
    let report = GptReport {
        sample: gpt.sample,
        seed: args.seed,
        save: args.save_model.clone(),
        before: before_training(&init, &data),
    };
    // A checkpoint restores onto another --dp and --tp, re-sliced (TP-7).
    // The GPT's attention and MLP blocks recompute (their options), its embedding never.
    let builder = gpt_builder(init, job.pipeline, job.recompute)
        .with_config(job)
        .recompute(false)
        .devices(devices)
        .data(data.train.clone());
    run_gpt_job(builder, args.steps, &data, report, no_watchers()).await
}

/// The validation loss of `model` before training, printed beside the unigram baseline.
fn before_training(model: &Gpt, data: &GptData) -> f64 {
    let eval_device = burn::tensor::Device::flex();
    let before = mean_loss(
        model,
        &data.validation,
        VALIDATION_WINDOWS,
        32,
        &eval_device,
    );
    println!(
        "validation loss before training {before:.4} nats/char; unigram baseline {:.4}",
        data.corpus.unigram_baseline()
    );
    before
}

/// Runs a GPT job to its end and reports it: validation loss against the baseline, the
/// sample, the saved model.
pub(crate) async fn run_gpt_job(
    builder: JobBuilder<PipelineModel, TextWindow>,
    steps: u64,
    data: &GptData,
    report: GptReport,
    watchers: Watchers<'_>,
) -> meshwork::error::Result<()> {
    let eval_device = burn::tensor::Device::flex();
    let baseline = data.corpus.unigram_baseline();
    let conclude = |trained: Trained<PipelineModel>| -> meshwork::error::Result<()> {
        let s = &trained.summary;
        let model = Gpt::from_blocks(trained.model)
            .ok_or_else(|| Error::Runtime("the trained blocks do not make the GPT back".into()))?;
        let after = mean_loss(
            &model,
            &data.validation,
            VALIDATION_WINDOWS,
            32,
            &eval_device,
        );
        println!(
            "training loss {:.4} → {:.4}; validation loss {:.4} → {after:.4} nats/char \
             (unigram baseline {baseline:.4}: {})",
            s.first_loss.unwrap_or(f32::NAN),
            s.last_loss.unwrap_or(f32::NAN),
            report.before,
            if after < baseline {
                format!("{:.1} % below it", 100.0 * (baseline - after) / baseline)
            } else {
                "not below it yet: train longer".to_string()
            }
        );
        report_time(s);
        if let Some(n) = report.sample {
            let prompt = "And God said";
            let ids = data
                .corpus
                .vocab()
                .encode(prompt)
                .map_err(|e| Error::Data(e.to_string()))?;
            let out = model.sample(&ids, n, 0.8, report.seed, &eval_device);
            let text = data
                .corpus
                .vocab()
                .decode(&out)
                .map_err(|e| Error::Data(e.to_string()))?;
            println!(
                "sample (temperature 0.8, seed {}):\n{prompt}{text}",
                report.seed
            );
        }
        if let Some(path) = &report.save {
            model.save_file(path).map_err(|e| Error::Io {
                path: path.display().to_string(),
                reason: format!("{e:?}"),
            })?;
            println!("model written to {}", path.display());
        }
        Ok(())
    };
    run_job(builder, steps, watchers, conclude).await?;
    Ok(())
}

/// The GPT job a job spec describes, as the head and every node build it (feature `cluster`):
/// the model of `spec.model` drawn on a Flex device seeded with the spec's seed, cut as the
/// spec's pipeline shape says (blocks without one), trained on the embedded text
/// and the spec's whole description (`with_config`: its tensor-parallel degree included).
#[cfg(feature = "cluster")]
pub(crate) fn cluster_job(
    spec: &meshwork::cluster::control::JobSpec,
) -> meshwork::error::Result<(JobBuilder<PipelineModel, TextWindow>, GptData, Gpt)> {
    let config = meshwork::demo::gpt::gpt_config(&spec.model)
        .map_err(|e| Error::InvalidConfig(format!("the demo GPT: {e}")))?;
    let data = GptData::load(config.context)?;
    if config.vocab != data.vocab() {
        return Err(Error::InvalidConfig(format!(
            "the job's GPT has a vocabulary of {}, the embedded text {}",
            config.vocab,
            data.vocab()
        )));
    }
    let device = MeshDevice::of_kind(meshwork::device::BackendKind::Flex, 1)?.remove(0);
    device.burn().seed(spec.job.seed);
    let init = Gpt::new(&config, device.burn());
    let builder = gpt_builder(init.clone(), spec.job.pipeline, spec.job.recompute)
        .with_config(spec.job.clone())
        .recompute(false)
        .data(data.train.clone());
    Ok((builder, data, init))
}

/// The job spec of `meshwork train --model gpt` across processes: the GPT of `config` (its
/// vocabulary the embedded text's), its interleaved pipeline at `--pp` > 1, and the job
/// description of the flags.
#[cfg(feature = "cluster")]
pub(crate) fn gpt_spec(
    args: &TrainArgs,
    config: GptConfig,
) -> meshwork::error::Result<meshwork::cluster::control::JobSpec> {
    let vocab = kjv_corpus()
        .map_err(|e| Error::Data(format!("the embedded text: {e}")))?
        .vocab()
        .len();
    let config = GptConfig { vocab, ..config };
    let shape = Shape {
        data_parallel: 1,
        pipeline: gpt_pipeline(args, &config)?,
        // The head fits a default batch to the world it waits for.
        batch_size: args.global_batch(32, 1),
    };
    Ok(meshwork::cluster::control::JobSpec::new(
        meshwork::demo::gpt::gpt_spec(&config),
        crate::settings::job_config(args, shape, true)?,
        args.device,
    ))
}

/// Trains the GPT of `spec` on a cluster's head: `settings` adds the head's mesh and policy;
/// the same report as in one process.
#[cfg(feature = "cluster")]
pub(crate) async fn train_across(
    spec: &meshwork::cluster::control::JobSpec,
    settings: impl FnOnce(
        JobBuilder<PipelineModel, TextWindow>,
    ) -> JobBuilder<PipelineModel, TextWindow>,
    (save, sample): (Option<PathBuf>, Option<usize>),
    watchers: Watchers<'_>,
) -> meshwork::error::Result<()> {
    let (builder, data, init) = cluster_job(spec)?;
    let report = GptReport {
        sample,
        seed: spec.job.seed,
        save,
        before: before_training(&init, &data),
    };
    run_gpt_job(settings(builder), spec.job.steps, &data, report, watchers).await
}

fn train_len(d: &TextWindows) -> usize {
    use meshwork::data::Dataset;
    d.len()
}
