//! `meshwork train`: the demo job with a progress bar and a final report.

use std::path::PathBuf;

use meshwork::comm::Algorithm;
use meshwork::demo::{Mlp, Sample, TeacherTask, mlp_blocks, mlp_blocks_of, mse_loss, split_mlp};
use meshwork::device::{BackendKind, MeshDevice};
use meshwork::error::Error;
use meshwork::events::PipelineStep;
use meshwork::job::{Job, JobBuilder};
use meshwork::parallel::compress::Compression;
use meshwork::parallel::local::LocalUpdates;
use meshwork::parallel::parameter_server::Staleness;
use meshwork::parallel::pipeline::{Schedule, even_split, render_svg};
use meshwork::parallel::pipeline_exec::chrome_trace;
use meshwork::parallel::stages::BlockOptions;
use meshwork::precision::Precision;
use meshwork::recovery::RecoveryPolicy;

use crate::demo_job::{Configure, DemoJob, RunOptions};
use crate::settings::{Shape, check_flags, job_config};
use meshwork::job_config::PipelineConfig;

/// Flags of `meshwork train`.
#[derive(Debug, clap::Args)]
pub(crate) struct TrainArgs {
    /// The model: `mlp` (the demo MLP on a teacher task) or `gpt` (a small character-level
    /// GPT on the King James Bible, with --tp for tensor parallelism).
    #[arg(long, default_value = "mlp")]
    pub(crate) model: String,
    /// Data-parallel replicas (default: one per core, divided by --pp × --tp).
    #[arg(long)]
    pub(crate) dp: Option<u32>,
    /// Tensor-parallel degree (--model gpt): each layer's matrices split over this many
    /// devices (Megatron-LM); must divide --heads.
    #[arg(long, default_value_t = 1)]
    pub(crate) tp: u32,
    /// With --model gpt: after training, print this many characters sampled from the model.
    #[arg(long)]
    pub(crate) sample: Option<usize>,
    /// GPT: transformer layers.
    #[arg(long, default_value_t = 2)]
    pub(crate) layers: usize,
    /// GPT: features per character.
    #[arg(long, default_value_t = 64)]
    pub(crate) d_model: usize,
    /// GPT: attention heads.
    #[arg(long, default_value_t = 4)]
    pub(crate) heads: usize,
    /// GPT: characters of context.
    #[arg(long, default_value_t = 64)]
    pub(crate) context: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    pub(crate) steps: u64,
    /// Global batch size (split across replicas; default about 256 samples for the MLP, 32
    /// windows for the GPT: the nearest multiple of the replicas × micro-batches, so the
    /// default fits every world size a launcher starts).
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Backend of the logical devices: flex (CPU) or wgpu.
    #[arg(long, default_value = "flex")]
    pub(crate) device: BackendKind,
    /// Seed of the model initialization, the data and its order.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 3e-3)]
    pub(crate) lr: f64,
    /// ZeRO stage: 0 (every replica holds the whole optimizer state), 1 (each holds its
    /// 1/N share of Adam's state), 2 (and only its share of the reduced gradient) or 3 (and
    /// only its share of the parameters: the demo MLP trains as blocks of one layer, each
    /// gathered for its use).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub(crate) zero: u8,
    /// Recompute each block's forward during its backward (activation checkpointing): less
    /// memory for more compute. Without --pp the demo MLP trains as blocks of one layer.
    #[arg(long)]
    pub(crate) recompute: bool,
    /// Precision of forward and backward: f32, bf16 or f16 (the optimizer steps f32 master
    /// weights; f16 scales the loss dynamically and skips steps whose gradient overflows).
    /// Replicas, blocks, --pp pipelines and --model gpt (with --tp) take both, in one process
    /// or across processes.
    #[arg(long, default_value = "f32")]
    pub(crate) precision: Precision,
    /// With --precision bf16 or f16: all-reduce the gradients in that type (half the bytes).
    #[arg(long)]
    pub(crate) low_precision_gradients: bool,
    /// With --low-precision-gradients or --compression bf16: the partial sums of a ring or
    /// tree travel as f32 (rounded once) or 16 (in the 16-bit type, each hop rounding: 4 bytes
    /// an element per ring pass instead of 6).
    #[arg(long, default_value = "f32")]
    pub(crate) partial_sums: meshwork::comm::PartialSums,
    /// Clip the gradient's global L2 norm to this value (torch's clip_grad_norm_).
    #[arg(long)]
    pub(crate) clip: Option<f32>,
    /// Micro-batches each replica accumulates per optimizer step (the global batch stays
    /// --batch-size). A --pp pipeline accumulates its --micro-batches instead.
    #[arg(long, default_value_t = 1)]
    pub(crate) accumulate: u32,
    /// The learning rate over the run: constant (--lr throughout), or
    /// warmup-cosine[:WARMUP_STEPS] (linear from --lr/100 to --lr over the warm-up, 10 % of
    /// --steps when left out, then a cosine down to --lr/100).
    #[arg(long, default_value = "constant")]
    pub(crate) lr_schedule: String,
    /// How the replicas exchange gradients: none (an f32 all-reduce), bf16, f16,
    /// topk:FRACTION or powersgd:RANK[:UNCOMPRESSED_STEPS], with error feedback.
    #[arg(long, default_value = "none")]
    pub(crate) compression: Compression,
    /// Replicas that step alone and meet every few steps: local-sgd:H,
    /// diloco:H[:OUTER_LR[:OUTER_MOMENTUM[:nesterov|plain]]] or easgd:H[:ALPHA].
    #[arg(long)]
    pub(crate) local_updates: Option<LocalUpdates>,
    /// The algorithm of every collective: auto (chosen per call by size and group), ring,
    /// tree or direct (in one process only; across processes it runs as auto). The same
    /// algorithm sums in the same order in one process and across processes.
    #[arg(long, default_value = "auto")]
    pub(crate) algorithm: Algorithm,
    /// Push the gradients to a parameter server, which applies them (see --staleness).
    #[arg(long)]
    pub(crate) parameter_server: bool,
    /// With --parameter-server: how far a worker may run ahead of the slowest: sync (ssp:0),
    /// ssp:N or async.
    #[arg(long, default_value = "sync", requires = "parameter_server")]
    pub(crate) staleness: Staleness,
    /// Synchronous steps that apply the first workers' gradients and drop the last N's.
    #[arg(long)]
    pub(crate) backup_workers: Option<u32>,
    /// Write the trained model (Burn record) to this file.
    #[arg(long)]
    pub(crate) save_model: Option<PathBuf>,
    /// Width of the demo MLP's hidden layers (128: about 21 thousand parameters; 1024:
    /// about 1.1 million).
    #[arg(long, default_value_t = 128)]
    pub(crate) hidden: usize,
    /// Pipeline stages: > 1 cuts the demo MLP into that many stages, one stage actor (and
    /// device) each; combined with --dp for a dp × pp mesh.
    #[arg(long, default_value_t = 1)]
    pub(crate) pp: u32,
    /// Micro-batches per step (pipeline only).
    #[arg(long, default_value_t = 4)]
    pub(crate) micro_batches: u32,
    /// Pipeline schedule: gpipe, 1f1b or interleaved.
    #[arg(long, default_value = "1f1b")]
    pub(crate) schedule: String,
    /// Model chunks per stage (interleaved only).
    #[arg(long, default_value_t = 2)]
    pub(crate) virtual_stages: u32,
    /// Write the last step's pipeline timeline: `.svg` for a picture, `.json` for a Chrome
    /// trace (Perfetto, chrome://tracing).
    #[arg(long)]
    pub(crate) timeline: Option<PathBuf>,
    /// Inject the faults of this plan (JSON, see the book's "Fault-injection runs").
    #[arg(long)]
    pub(crate) faults: Option<PathBuf>,
    /// What a lost replica does: fail (end the job), shrink (continue with the survivors;
    /// a lost pipeline stage is replaced from its twin), rollback (replace the lost device
    /// and roll back to the last checkpoint; needs --checkpoint-dir and --checkpoint-every),
    /// or shrink-or-rollback.
    #[arg(long, default_value = "fail")]
    pub(crate) on_replica_loss: String,
    /// At most this many recoveries within a minute; one more ends the job (like torchrun's
    /// --max-restarts).
    #[arg(long, default_value_t = RecoveryPolicy::default().max_restarts)]
    pub(crate) max_restarts: u32,
    /// Write checkpoints into this directory (every --checkpoint-every steps, at the end, and
    /// on Ctrl-C or SIGTERM, which then stop the job cleanly).
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps.
    #[arg(long)]
    pub(crate) checkpoint_every: Option<u64>,
    /// Start from the newest valid checkpoint in --checkpoint-dir (when there is none, say so
    /// and start from scratch).
    #[arg(long)]
    pub(crate) resume: bool,
    /// With --resume: end with an error when --checkpoint-dir holds no valid checkpoint,
    /// instead of starting from scratch.
    #[arg(long, requires = "resume")]
    pub(crate) require_checkpoint: bool,
    /// The collective time-out in seconds (a rank that does not arrive within it is named);
    /// below --step-timeout.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) collective_timeout: f64,
    /// The step time-out in seconds: a step whose ranks have not all reported within it ends
    /// the job (or starts recovery), naming the ranks that are missing.
    #[arg(long, default_value_t = 120.0)]
    pub(crate) step_timeout: f64,
    /// Run the job a file describes (TOML; JSON for a `.json` name): the library's job
    /// description (`meshwork::job_config::JobConfig`) with a `[model]` table for the model
    /// flags. Every flag given on the command line overrides its key.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Print the job's description as a file --config reads (TOML) and exit without training.
    #[arg(long)]
    pub(crate) print_config: bool,
    /// The flags the command line gave (clap's ids), set by `main`.
    #[arg(skip)]
    pub(crate) given: std::collections::BTreeSet<String>,
    /// The description --config read: the base every flag given goes over.
    #[arg(skip)]
    pub(crate) file: Option<meshwork::job_config::JobConfig>,
    /// Several processes: the head's flags (see `meshwork node` for the nodes').
    #[cfg(feature = "cluster")]
    #[command(flatten)]
    pub(crate) cluster: crate::cluster::ClusterTrainArgs,
}

pub(crate) fn run(mut args: TrainArgs) -> meshwork::error::Result<()> {
    crate::job_file::apply(&mut args)?;
    check_flags(&args)?;
    match args.model.as_str() {
        "mlp" => {}
        "gpt" => return run_gpt(args),
        other => {
            return Err(Error::InvalidConfig(format!("--model {other}: mlp or gpt")));
        }
    }
    if args.tp != 1 || args.sample.is_some() {
        return Err(Error::InvalidConfig(
            "--tp and --sample are for --model gpt (the demo MLP has no tensor-parallel blocks)"
                .into(),
        ));
    }
    // CKPT-7 before anything starts (a cluster head would otherwise wait for its nodes first);
    // a directory that does not exist is not made for a required checkpoint.
    if let Some(dir) = &args.checkpoint_dir
        && (!args.require_checkpoint || dir.exists())
    {
        meshwork::checkpoint::CheckpointStore::open(dir, 1)?.check_writable()?;
    }
    #[cfg(feature = "cluster")]
    {
        // What a launcher says of this process, read once: whether the job is across
        // processes, and whether this process is one of its nodes.
        let launched = meshwork::cluster::rendezvous::from_env(|k| std::env::var(k).ok())
            .ok()
            .flatten()
            .filter(|r| r.processes > 1);
        let across = args.cluster.listen.is_some() || launched.is_some();
        // A process a launcher made a node takes its job from the head's spec: the plan file
        // need not exist on its host.
        let launched_node = args.cluster.listen.is_none()
            && launched.is_some_and(|r| {
                matches!(r.role(), meshwork::cluster::rendezvous::Role::Node { .. })
            });
        // Refused here, before any node waits, if the flags make no job description.
        let pipeline = mlp_pipeline(&args)?;
        let widths = if pipeline.is_some() {
            pipeline_widths(args.hidden)
        } else {
            widths(args.hidden)
        };
        let shape = Shape {
            data_parallel: 1,
            pipeline,
            // The head fits a default batch to the world it waits for.
            batch_size: args.global_batch(256, 1),
        };
        let job = job_config(&args, shape, !launched_node)?;
        if across && args.print_config {
            return crate::job_file::print(&args, &job);
        }
        let spec = || {
            meshwork::cluster::control::JobSpec::new(
                meshwork::demo::mlp_spec(&widths),
                job,
                args.device,
            )
        };
        if across {
            refuse_across_processes(&args)?;
        }
        let head = crate::cluster::HeadJob {
            save_model: args.save_model.clone(),
            sample: None,
            elastic: (None, None),
            batch_given: args.batch_given(),
        };
        if let Some(outcome) = crate::cluster::dispatch_train(&args.cluster, spec, head) {
            return outcome;
        }
    }
    let runtime = tokio::runtime::Runtime::new().map_err(|e| meshwork::error::Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    runtime.block_on(train(args))
}

/// The flags a job across processes cannot apply, refused before the head waits for its
/// nodes: each would be ignored on some process.
#[cfg(feature = "cluster")]
fn refuse_across_processes(args: &TrainArgs) -> meshwork::error::Result<()> {
    let unsupported = [
        (
            "--timeline",
            args.timeline.is_some(),
            "the pipeline's timeline is drawn in one process only",
        ),
        (
            "--dp",
            // A --config file's data_parallel is one process's: across processes the world
            // decides, so only the flag itself is refused.
            args.dp.is_some() && args.given.contains("dp"),
            "the replicas are the world's ranks divided by --pp: start more nodes or devices",
        ),
    ];
    match unsupported.iter().find(|(_, given, _)| *given) {
        Some((flag, _, why)) => Err(Error::InvalidConfig(format!(
            "{flag} is not supported across processes yet ({why}): train in one process, or \
             leave it out"
        ))),
        None => Ok(()),
    }
}

/// `meshwork train --model gpt`: in this process, or across processes (`--listen`, or a
/// launcher's variables); without the MLP's fault plans and timeline.
fn run_gpt(args: TrainArgs) -> meshwork::error::Result<()> {
    let unsupported = [
        ("--faults", args.faults.is_some()),
        ("--timeline", args.timeline.is_some()),
    ];
    if let Some((flag, _)) = unsupported.iter().find(|(_, given)| *given) {
        return Err(Error::InvalidConfig(format!(
            "{flag} is not supported with --model gpt yet"
        )));
    }
    let flags = crate::gpt_train::GptFlags {
        config: meshwork::demo::gpt::GptConfig {
            vocab: 0,
            context: args.context,
            d_model: args.d_model,
            heads: args.heads,
            layers: args.layers,
        },
        tp: args.tp,
        sample: args.sample,
    };
    if !args.d_model.is_multiple_of(args.heads) {
        return Err(Error::InvalidConfig(format!(
            "--d-model {} does not split into --heads {}",
            args.d_model, args.heads
        )));
    }
    // Across processes (--listen, or a launcher's variables): the head sends the GPT and
    // every setting in the job spec; each process builds the same job from it.
    #[cfg(feature = "cluster")]
    {
        let launched = meshwork::cluster::rendezvous::from_env(|k| std::env::var(k).ok())
            .ok()
            .flatten()
            .is_some_and(|r| r.processes > 1);
        if args.cluster.listen.is_some() || launched {
            let spec = crate::gpt_train::gpt_spec(&args, flags.config)?;
            if args.print_config {
                return crate::job_file::print(&args, &spec.job);
            }
            refuse_across_processes(&args)?;
            let head = crate::cluster::HeadJob {
                save_model: args.save_model.clone(),
                sample: args.sample,
                elastic: (None, None),
                batch_given: args.batch_given(),
            };
            if let Some(outcome) = crate::cluster::dispatch_train(&args.cluster, || spec, head) {
                return outcome;
            }
        }
    }
    let runtime = tokio::runtime::Runtime::new().map_err(|e| meshwork::error::Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    runtime.block_on(crate::gpt_train::train(&args, flags))
}

/// The demo MLP's widths: 32 inputs, two hidden layers, 4 outputs.
fn widths(hidden: usize) -> Vec<usize> {
    vec![32, hidden, hidden, 4]
}

/// The demo MLP of pipeline jobs: deeper, so that it cuts into up to 5 blocks.
fn pipeline_widths(hidden: usize) -> Vec<usize> {
    vec![32, hidden, hidden, hidden, hidden, 4]
}

async fn train(args: TrainArgs) -> meshwork::error::Result<()> {
    let pipelined = args.pp > 1 || args.timeline.is_some();
    let dp = args.dp.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        if pipelined {
            (cores / args.pp).max(1)
        } else {
            cores
        }
    });
    let task = TeacherTask {
        d_in: 32,
        d_out: 4,
        noise: 0.1,
        seed: args.seed,
    };
    let world = (dp * if pipelined { args.pp } else { 1 }) as usize;
    let devices = MeshDevice::of_kind(args.device, world)?;
    let model_device = devices[0].burn().clone();
    model_device.seed(args.seed);
    let mesh = if pipelined {
        format!("{dp} × {} (data × pipeline)", args.pp)
    } else {
        format!("{dp}")
    };
    let unit = dp as usize * args.micro_batches_per_replica();
    let shape = Shape {
        data_parallel: dp,
        pipeline: mlp_pipeline(&args)?,
        batch_size: args.global_batch(256, unit),
    };
    let config = job_config(&args, shape, true)?;
    if args.print_config {
        return crate::job_file::print(&args, &config);
    }
    println!(
        "meshwork train: {mesh} × {:?} device(s), {}, {} steps, attainable loss {:.4}",
        args.device,
        args.batch_line(256, unit),
        args.steps,
        task.attainable_loss()
    );
    let job = demo_job(&args, pipelined, &model_device)?.configure(Shared {
        config,
        data: task.dataset(16_384),
        devices,
    });
    let schedule = job.schedule();
    let last = job
        .run(RunOptions::plain(
            args.steps,
            &task,
            args.save_model.clone(),
        ))
        .await?;
    if let (Some(schedule), Some(p)) = (schedule, last) {
        pipeline_report(&args, &schedule, &p)?;
    }
    Ok(())
}

/// The demo job the flags describe: the MLP cut into a pipeline (`--pp`, `--timeline`), as
/// blocks of one layer (`--zero 3`, `--recompute`), or whole.
fn demo_job(
    args: &TrainArgs,
    pipelined: bool,
    model_device: &burn::tensor::Device,
) -> meshwork::error::Result<DemoJob> {
    let options = BlockOptions::default().recompute(args.recompute);
    if let (true, Some(PipelineConfig { schedule, .. })) = (pipelined, mlp_pipeline(args)?) {
        let blocks = (args.pp * schedule.virtual_stages()) as usize;
        let pipeline_widths = pipeline_widths(args.hidden);
        let layers = pipeline_widths.len() - 1;
        let stages = even_split(layers, blocks)
            .and_then(|split| split_mlp(&pipeline_widths, &split, model_device))
            .map(|parts| mlp_blocks_of(parts, options))
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "--pp {} × {} virtual stages: the demo MLP has {layers} layers, so at most \
                     {layers} blocks",
                    args.pp,
                    schedule.virtual_stages()
                ))
            })?;
        return Ok(DemoJob::Pipeline(
            Job::builder().pipeline(stages, schedule),
            schedule,
        ));
    }
    if args.zero == 3 || args.recompute {
        // ZeRO-3 and recomputation work per block: the MLP as blocks of one layer each.
        let stages = mlp_blocks(&widths(args.hidden), options, model_device)
            .ok_or_else(|| Error::Runtime("the demo MLP did not cut into blocks".into()))?;
        return Ok(DemoJob::Blocks(Job::builder().blocks(stages)));
    }
    let init = Mlp::new(&widths(args.hidden), model_device);
    Ok(DemoJob::Replicas(
        Job::builder().initial_model(init).loss(mse_loss),
    ))
}

/// A pipeline job's last step: its measured bubble against the schedule's, each stage's
/// time, and the timeline file `--timeline` asks for.
fn pipeline_report(
    args: &TrainArgs,
    schedule: &Schedule,
    p: &PipelineStep,
) -> meshwork::error::Result<()> {
    println!(
        "last step: measured bubble {:.3} (theory {:.3}), peak stash per stage {:?}, peak activation bytes per stage {:?}",
        p.bubble,
        schedule.theoretical_bubble(args.pp),
        p.peak_stash,
        p.peak_activation_bytes
    );
    for (s, x) in p.shares.iter().enumerate() {
        println!(
            "  stage {s}: compute {:.0}%, communication {:.0}%, waiting {:.0}%",
            x.compute * 100.0,
            x.communication * 100.0,
            x.waiting * 100.0
        );
    }
    if let Some(path) = &args.timeline {
        let text = if path.extension().is_some_and(|e| e == "json") {
            chrome_trace(&p.timeline)
        } else {
            render_svg(&p.timeline)
        };
        std::fs::write(path, text).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        println!("timeline written to {}", path.display());
    }
    Ok(())
}

/// What every kind of demo job takes in one process: its description, the data and the
/// devices.
struct Shared {
    config: meshwork::job_config::JobConfig,
    data: meshwork::data::InMemoryDataset<Sample>,
    devices: Vec<MeshDevice>,
}

impl Configure for Shared {
    fn apply<M: Send + 'static>(self, builder: JobBuilder<M, Sample>) -> JobBuilder<M, Sample> {
        builder
            .with_config(self.config)
            .data(self.data)
            .devices(self.devices)
    }
}

/// The pipeline `--pp`, `--schedule`, `--micro-batches` and `--virtual-stages` cut the demo
/// MLP into (`--timeline` alone: a pipeline of one stage), or `None`.
fn mlp_pipeline(args: &TrainArgs) -> meshwork::error::Result<Option<PipelineConfig>> {
    if args.pp <= 1 && args.timeline.is_none() {
        return Ok(None);
    }
    let schedule = Schedule::from_name(&args.schedule, args.micro_batches, args.virtual_stages)
        .ok_or_else(|| {
            Error::InvalidConfig(format!(
                "--schedule {}: gpipe, 1f1b or interleaved",
                args.schedule
            ))
        })?;
    Ok(Some(PipelineConfig {
        stages: args.pp,
        schedule,
    }))
}
