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
}

pub(crate) fn run(args: TrainArgs) -> meshwork::error::Result<()> {
    let runtime = tokio::runtime::Runtime::new().map_err(|e| meshwork::error::Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    runtime.block_on(train(args))
}

async fn train(args: TrainArgs) -> meshwork::error::Result<()> {
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
