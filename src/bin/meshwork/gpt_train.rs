//! `meshwork train --model gpt`: the small GPT on the King James Bible, character by
//! character, over a dp × pp × tp mesh — in this process, or across processes (the head and
//! every node build the same job from the job spec: [`cluster_job`]); validation loss
//! against the unigram baseline, and text sampled from the trained model.

use std::path::PathBuf;
use std::time::Duration;

use burn::module::Module;
use burn::optim::AdamConfig;
use meshwork::data::{CharCorpus, TextWindow, TextWindows};
use meshwork::demo::gpt::{Gpt, GptConfig, mean_loss};
use meshwork::demo::kjv_corpus;
use meshwork::device::MeshDevice;
use meshwork::error::Error;
use meshwork::job::{Job, JobBuilder, PipelineModel, Trained};
use meshwork::parallel::pipeline::Schedule;
use meshwork::parallel::stages::BlockOptions;

use crate::demo_job::{Watchers, no_watchers, report_time, run_job};
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

/// The GPT `init` as a job: its blocks over `pp` stages (block b on stage b mod pp, the
/// interleaved schedule over `micro_batches`), or as a block job at `pp` 1; each attention and
/// MLP block recomputing its forward in its backward with `recompute`.
pub(crate) fn gpt_builder(
    init: Gpt,
    config: &GptConfig,
    (pp, micro_batches): (u32, u32),
    recompute: bool,
) -> meshwork::error::Result<JobBuilder<PipelineModel, TextWindow>> {
    let stages = init.into_blocks_with::<TextWindow>(BlockOptions::default().recompute(recompute));
    if pp == 1 {
        return Ok(Job::builder().blocks(stages));
    }
    let blocks = config.blocks() as u32;
    if !blocks.is_multiple_of(pp) {
        return Err(Error::InvalidConfig(format!(
            "--pp {pp}: the GPT has {blocks} blocks (embedding, attention and MLP per layer, \
             head), which do not split evenly over {pp} stages; choose --layers so that \
             2 × layers + 2 is a multiple of {pp}"
        )));
    }
    Ok(Job::builder().pipeline(
        stages,
        Schedule::Interleaved {
            virtual_stages: blocks / pp,
            micro_batches,
        },
    ))
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
    let builder = gpt_builder(init, &config, (pp, args.micro_batches), args.recompute)?
        .tensor_parallel(tp)
        .zero(meshwork::parallel::zero::ZeroStage::from_number(args.zero).unwrap_or_default())
        .precision(args.precision)
        .low_precision_gradients(args.low_precision_gradients)
        .partial_sums(args.partial_sums)
        .data_parallel(dp)
        .devices(devices)
        .data(data.train.clone())
        .optimizer(AdamConfig::new())
        .batch_size(batch)
        .steps(args.steps)
        .seed(args.seed)
        .collective_timeout(Duration::from_secs_f64(args.collective_timeout))
        .step_timeout(Duration::from_secs_f64(args.step_timeout));
    let builder =
        crate::settings::training_settings(args, crate::settings::learning_rate(args)?, builder)
            .recovery(crate::settings::fault_settings(args)?.1);
    // A checkpoint restores onto another --dp and --tp, re-sliced (TP-7).
    let builder = crate::settings::checkpoint_settings(&args.checkpoint_flags(), builder);
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
/// spec's pipeline shape says (blocks without one), trained on the embedded text with Adam
/// and every setting of the spec (`follow_spec`: its tensor-parallel degree included).
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
    device.burn().seed(spec.seed);
    let init = Gpt::new(&config, device.burn());
    let (pp, micro_batches) = spec
        .pipeline
        .as_ref()
        .map_or((1, 1), |p| (p.stages, p.micro_batches));
    let builder = gpt_builder(
        init.clone(),
        &config,
        (pp, micro_batches),
        spec.strategy.recompute,
    )?
    .data(data.train.clone())
    .optimizer(AdamConfig::new())
    .follow_spec(spec)
    .step_timeout(Duration::from_secs(120));
    Ok((builder, data, init))
}

/// The job spec of `meshwork train --model gpt` across processes: the GPT of `config` (its
/// vocabulary the embedded text's), its interleaved pipeline at `--pp` > 1, and the flags'
/// settings.
#[cfg(feature = "cluster")]
pub(crate) fn gpt_spec(
    args: &TrainArgs,
    config: GptConfig,
    tp: u32,
) -> meshwork::error::Result<meshwork::cluster::control::JobSpec> {
    let vocab = kjv_corpus()
        .map_err(|e| Error::Data(format!("the embedded text: {e}")))?
        .vocab()
        .len();
    let config = GptConfig { vocab, ..config };
    let blocks = config.blocks() as u32;
    let pipeline = (args.pp > 1).then(|| meshwork::cluster::control::PipelineShape {
        stages: args.pp,
        schedule: "interleaved".into(),
        micro_batches: args.micro_batches,
        virtual_stages: blocks / args.pp,
    });
    Ok(meshwork::cluster::control::JobSpec {
        model: meshwork::demo::gpt::gpt_spec(&config),
        seed: args.seed,
        // The head fits a default batch to the world it waits for.
        batch_size: args.global_batch(32, 1) as u64,
        steps: args.steps,
        learning_rate: args.lr,
        collective_timeout_ms: (args.collective_timeout * 1000.0) as u64,
        pipeline,
        zero: args.zero,
        precision: args.precision,
        low_precision_gradients: args.low_precision_gradients,
        strategy: meshwork::cluster::control::StrategySpec {
            compression: args.compression,
            local_updates: args.local_updates,
            clip_norm: args.clip,
            accumulation: args.accumulate,
            algorithm: args.algorithm,
            partial_sums: args.partial_sums,
            faults: None,
            link: None,
            tensor_parallel: tp,
            recompute: args.recompute,
            parameter_server: None,
            backup_workers: None,
            warmup_cosine: crate::settings::warmup_steps(args)?.map(|w| w as u64),
        },
        backend: args.device,
        transport: Default::default(),
    })
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
        seed: spec.seed,
        save,
        before: before_training(&init, &data),
    };
    run_gpt_job(settings(builder), spec.steps, &data, report, watchers).await
}

fn train_len(d: &TextWindows) -> usize {
    use meshwork::data::Dataset;
    d.len()
}
