//! `meshwork train`: the demo job with a progress bar and a final report.

use std::path::PathBuf;
use std::time::Duration;

use burn::module::Module;
use burn::optim::AdamConfig;
use indicatif::{ProgressBar, ProgressStyle};
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::device::{BackendKind, MeshDevice};
use meshwork::events::JobEvent;
use meshwork::job::{EventsError, Job};

/// Flags of `meshwork train`.
#[derive(Debug, clap::Args)]
pub(crate) struct TrainArgs {
    /// Data-parallel replicas (default: one per core).
    #[arg(long)]
    dp: Option<u32>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Global batch size (split across replicas).
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Backend of the logical devices: flex (CPU) or wgpu.
    #[arg(long, default_value = "flex")]
    device: BackendKind,
    /// Seed of the model initialization, the data and its order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Write the trained model (Burn record) to this file.
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Pipeline stages (> 1 splits the model into stages on their own threads; in-process,
    /// one pipeline: not combined with --dp yet).
    #[arg(long, default_value_t = 1)]
    pp: u32,
    /// Micro-batches per step (pipeline only).
    #[arg(long, default_value_t = 4)]
    micro_batches: u32,
    /// Pipeline schedule: gpipe or 1f1b.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Write the last step's pipeline timeline: `.svg` for a picture, `.json` for a Chrome
    /// trace (Perfetto, chrome://tracing).
    #[arg(long)]
    timeline: Option<PathBuf>,
}

pub(crate) fn run(args: TrainArgs) -> meshwork::error::Result<()> {
    let runtime = tokio::runtime::Runtime::new().map_err(|e| meshwork::error::Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    runtime.block_on(train(args))
}

async fn train(args: TrainArgs) -> meshwork::error::Result<()> {
    if args.pp > 1 || args.timeline.is_some() {
        return train_pipeline_demo(args);
    }
    let dp = args
        .dp
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32));
    let task = TeacherTask {
        d_in: 32,
        d_out: 4,
        noise: 0.1,
        seed: args.seed,
    };
    let data = task.dataset(16_384);
    let devices = MeshDevice::of_kind(args.device, dp as usize)?;
    let model_device = devices[0].burn().clone();
    model_device.seed(args.seed);
    let init = Mlp::new(&[32, 128, 128, 4], &model_device);
    let job = Job::builder()
        .initial_model(init)
        .loss(mse_loss)
        .data(data)
        .optimizer(AdamConfig::new())
        .learning_rate(args.lr)
        .data_parallel(dp)
        .devices(devices)
        .batch_size(args.batch_size)
        .steps(args.steps)
        .seed(args.seed)
        .step_timeout(Duration::from_secs(120))
        .build()?;
    println!(
        "meshwork train: {dp} × {:?} device(s), global batch {}, {} steps, attainable loss {:.4}",
        args.device,
        args.batch_size,
        args.steps,
        task.attainable_loss()
    );
    let handle = job.spawn().await?;
    let mut events = handle.events();
    let bar = ProgressBar::new(args.steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress = bar.clone();
    let watcher = tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(JobEvent::StepDone(s)) => {
                    progress.set_position(s.step + 1);
                    progress.set_message(format!(
                        "loss {:.4}  {:.0} samples/s",
                        s.loss, s.samples_per_s
                    ));
                }
                Ok(JobEvent::Failed(e)) => progress.println(format!("job failed: {e}")),
                Ok(_) | Err(EventsError::Missed(_)) => {}
                Err(EventsError::Closed) => break,
            }
        }
    });
    let trained = handle.join().await;
    let _ = watcher.await;
    bar.finish();
    let trained = trained?;
    let s = &trained.summary;
    let (compute, comm, wait) = s.breakdown.shares();
    println!(
        "loss {:.4} → {:.4} (attainable {:.4})",
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
        task.attainable_loss()
    );
    println!(
        "{} steps, {:.0} samples/s; time per step: compute {:.0}%, communication {:.0}%, waiting {:.0}%",
        s.steps,
        s.samples_per_s(),
        compute * 100.0,
        comm * 100.0,
        wait * 100.0
    );
    if let Some(path) = args.save_model {
        trained
            .model
            .save_file(&path)
            .map_err(|e| meshwork::error::Error::Io {
                path: path.display().to_string(),
                reason: format!("{e:?}"),
            })?;
        println!("model written to {}", path.display());
    }
    Ok(())
}

/// `meshwork train --pp K`: the demo MLP cut into K stages, trained with a pipeline schedule.
fn train_pipeline_demo(args: TrainArgs) -> meshwork::error::Result<()> {
    use meshwork::demo::{mlp_pipeline, mlp_pipeline_inputs};
    use meshwork::error::Error;
    use meshwork::parallel::pipeline::{Schedule, render_svg, summarize};
    use meshwork::parallel::pipeline_exec::{chrome_trace, recorded_timeline, train_pipeline};
    use meshwork::parallel::sampler::DistributedSampler;

    if args.dp.is_some_and(|d| d > 1) {
        return Err(Error::InvalidConfig(
            "--pp with --dp > 1 is not wired into `train` yet: use --dp 1".into(),
        ));
    }
    let m = args.micro_batches;
    let schedule = match args.schedule.as_str() {
        "gpipe" => Schedule::GPipe { micro_batches: m },
        "1f1b" => Schedule::OneFOneB { micro_batches: m },
        other => {
            return Err(Error::InvalidConfig(format!(
                "--schedule {other}: gpipe or 1f1b (interleaved is planned, not executed yet)"
            )));
        }
    };
    let task = TeacherTask {
        d_in: 32,
        d_out: 4,
        noise: 0.1,
        seed: args.seed,
    };
    let data = task.dataset(16_384);
    let device = meshwork::device::MeshDevice::of_kind(args.device, 1)?
        .remove(0)
        .burn()
        .clone();
    device.seed(args.seed);
    let widths = [32, 128, 128, 4];
    let stages = mlp_pipeline(
        &widths,
        args.pp as usize,
        &AdamConfig::new().into(),
        args.lr,
        &device,
    )
    .ok_or_else(|| {
        Error::InvalidConfig(format!("--pp {}: the demo MLP has 1 to 3 stages", args.pp))
    })?;
    let sampler = DistributedSampler::new(16_384, args.batch_size, args.seed)?;
    let batches = (0..args.steps)
        .map(|s| {
            sampler
                .global_batch(s)
                .into_iter()
                .filter_map(|i| meshwork::data::Dataset::get(&data, i))
                .collect()
        })
        .collect();
    println!(
        "meshwork train: pipeline of {} stages ({} schedule, {m} micro-batches), global batch {}, {} steps, attainable loss {:.4}",
        args.pp,
        schedule.name(),
        args.batch_size,
        args.steps,
        task.attainable_loss()
    );
    let started = std::time::Instant::now();
    let run = train_pipeline(
        stages,
        &schedule,
        batches,
        mlp_pipeline_inputs(),
        &device,
        Duration::from_secs(120),
    )?;
    let wall = started.elapsed().as_secs_f64();
    let last_stage = run.records.last().map(Vec::as_slice).unwrap_or_default();
    let mean = |r: &meshwork::parallel::pipeline_exec::StageStepRecord| {
        r.losses.iter().sum::<f32>() / r.losses.len().max(1) as f32
    };
    if let (Some(first), Some(last)) = (last_stage.first(), last_stage.last()) {
        println!(
            "loss {:.4} → {:.4} (attainable {:.4})",
            mean(first),
            mean(last),
            task.attainable_loss()
        );
    }
    let step: Vec<_> = run.records.iter().filter_map(|r| r.last()).collect();
    let timeline = recorded_timeline(&step);
    println!(
        "{} steps, {:.0} samples/s; last step: measured bubble {:.3} (theory {:.3}), peak stash {:?}",
        args.steps,
        (args.steps as usize * args.batch_size) as f64 / wall,
        summarize(&timeline).bubble,
        schedule.theoretical_bubble(args.pp),
        step.iter().map(|r| r.peak_stash).collect::<Vec<_>>()
    );
    if let Some(path) = &args.timeline {
        let text = if path.extension().is_some_and(|e| e == "json") {
            chrome_trace(&step)
        } else {
            render_svg(&timeline)
        };
        std::fs::write(path, text).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        println!("timeline written to {}", path.display());
    }
    Ok(())
}
