//! The one description of the demo job `meshwork train` runs, and the one path that runs it.
//!
//! The demo MLP trains whole (data parallel), as blocks of one layer (ZeRO-3 or
//! recomputation without a pipeline), or cut into a pipeline: three model types, so a
//! [`DemoJob`] holds the builder of one of them. Settings every kind shares are applied to it
//! through [`Configure`]; [`DemoJob::run`] then builds, spawns, drives, reports and saves
//! whichever it holds through [`run_job`], in one process or on a cluster's head (which adds
//! its mesh and its watchers through the same two seams). [`run_job`] is the one run path of
//! every model `meshwork train` trains: the demo GPT (`gpt_train.rs`) goes through it too,
//! with its own report.

use std::path::{Path, PathBuf};

use burn::module::Module;
use indicatif::{ProgressBar, ProgressStyle};

use meshwork::demo::{Mlp, Sample, TeacherTask};
use meshwork::error::{Error, Result};
use meshwork::events::{JobEvent, PipelineStep};
use meshwork::job::{
    EventsError, JobBuilder, JobControl, JobHandle, PipelineModel, RunSummary, Trained,
};
use meshwork::parallel::pipeline::Schedule;

/// What the demo trains, ready to be configured and run.
pub(crate) enum DemoJob {
    /// Data-parallel replicas of the whole MLP.
    Replicas(JobBuilder<Mlp, Sample>),
    /// The MLP as blocks of one layer, every block on every rank (ZeRO-3, recomputation).
    Blocks(JobBuilder<PipelineModel, Sample>),
    /// The MLP cut into a pipeline run by `schedule`.
    Pipeline(JobBuilder<PipelineModel, Sample>, Schedule),
}

/// Settings applied to a job builder whatever its model type: the flags every kind of demo
/// job shares, or what a cluster's head adds.
pub(crate) trait Configure {
    /// `builder` with the settings.
    fn apply<M: Send + 'static>(self, builder: JobBuilder<M, Sample>) -> JobBuilder<M, Sample>;
}

/// How a run reports beyond the progress bar and the summary.
pub(crate) struct RunOptions<'a> {
    /// Steps the job trains (the progress bar's length).
    pub(crate) steps: u64,
    /// The task, for the attainable loss in the report.
    pub(crate) task: &'a TeacherTask,
    /// Where the trained model goes.
    pub(crate) save: Option<PathBuf>,
    /// Tasks that watch or steer the job while it runs (a cluster's head: nodes that join
    /// or are lost).
    pub(crate) watchers: Watchers<'a>,
}

/// Tasks that watch or steer a job while it runs, started once it is spawned and stopped
/// when it ends.
pub(crate) type Watchers<'a> = Box<dyn FnOnce(JobControl) -> Vec<tokio::task::JoinHandle<()>> + 'a>;

/// No watchers.
pub(crate) fn no_watchers<'a>() -> Watchers<'a> {
    Box::new(|_| Vec::new())
}

impl RunOptions<'_> {
    /// No watchers.
    pub(crate) fn plain(steps: u64, task: &TeacherTask, save: Option<PathBuf>) -> RunOptions<'_> {
        RunOptions {
            steps,
            task,
            save,
            watchers: no_watchers(),
        }
    }
}

impl DemoJob {
    /// The same job with `settings` applied.
    pub(crate) fn configure(self, settings: impl Configure) -> Self {
        match self {
            DemoJob::Replicas(b) => DemoJob::Replicas(settings.apply(b)),
            DemoJob::Blocks(b) => DemoJob::Blocks(settings.apply(b)),
            DemoJob::Pipeline(b, s) => DemoJob::Pipeline(settings.apply(b), s),
        }
    }

    /// Checks the job as a job across processes of `world` ranks
    /// (`JobBuilder::check_across_processes`).
    #[cfg(feature = "cluster")]
    pub(crate) fn check_across_processes(self, world: u32) -> Result<()> {
        match self {
            DemoJob::Replicas(b) => b.check_across_processes(world),
            DemoJob::Blocks(b) | DemoJob::Pipeline(b, _) => b.check_across_processes(world),
        }
    }

    /// The pipeline schedule, for a pipeline job.
    pub(crate) fn schedule(&self) -> Option<Schedule> {
        match self {
            DemoJob::Pipeline(_, s) => Some(*s),
            _ => None,
        }
    }

    /// Builds, spawns, drives, reports and saves the job; the last step's pipeline figures
    /// (pipeline jobs).
    pub(crate) async fn run(self, options: RunOptions<'_>) -> Result<Option<PipelineStep>> {
        match self {
            DemoJob::Replicas(b) => finish(b, options, save_model).await,
            DemoJob::Blocks(b) | DemoJob::Pipeline(b, _) => finish(b, options, save_pipeline).await,
        }
    }
}

/// The demo MLP's report and save after [`run_job`].
async fn finish<M: Send + 'static>(
    builder: JobBuilder<M, Sample>,
    options: RunOptions<'_>,
    write: fn(M, &Path) -> Result<()>,
) -> Result<Option<PipelineStep>> {
    let RunOptions {
        steps,
        task,
        save,
        watchers,
    } = options;
    run_job(builder, steps, watchers, |trained| {
        report(&trained.summary, task);
        match &save {
            Some(path) => write(trained.model, path),
            None => Ok(()),
        }
    })
    .await
}

/// Hands every event of the spawned job to `on_event` until its stream ends, then joins it
/// (the benches' way of watching a job; `run_job` drives one with a progress bar).
pub(crate) async fn watch<M: Send + 'static>(
    handle: JobHandle<M>,
    on_event: &mut dyn FnMut(JobEvent),
) -> Result<Trained<M>> {
    let mut events = handle.events();
    loop {
        match events.recv().await {
            Ok(e) => on_event(e),
            Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    handle.join().await
}

/// The one run path of every model and strategy: build → spawn → drive (progress, signals,
/// watchers) → `conclude` (the model's report and save) with the trained job; the last
/// step's pipeline figures (pipeline jobs).
pub(crate) async fn run_job<M: Send + 'static, I: Send + Sync + 'static>(
    builder: JobBuilder<M, I>,
    steps: u64,
    watchers: Watchers<'_>,
    conclude: impl FnOnce(Trained<M>) -> Result<()>,
) -> Result<Option<PipelineStep>> {
    let plan = builder.plan();
    if !plan.features().is_empty() {
        println!("plan: {plan}");
    }
    let handle = builder.build()?.spawn().await?;
    let watchers = watchers(handle.control());
    let (trained, last) = drive(handle, steps).await;
    for w in watchers {
        w.abort();
    }
    conclude(trained?)?;
    Ok(last)
}

/// Resolves on Ctrl-C or (on Unix) SIGTERM.
async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Show a progress bar until the job ends; return its outcome and the last step's pipeline
/// figures (pipeline jobs).
async fn drive<M: Send + 'static>(
    handle: JobHandle<M>,
    steps: u64,
) -> (meshwork::error::Result<Trained<M>>, Option<PipelineStep>) {
    let mut events = handle.events();
    let bar = ProgressBar::new(steps);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} step {pos}/{len} {msg} [{elapsed_precise}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let progress = bar.clone();
    let watcher = tokio::spawn(async move {
        let mut last = None;
        loop {
            match events.recv().await {
                Ok(JobEvent::StepDone(s)) => {
                    progress.set_position(s.step + 1);
                    progress.set_message(format!(
                        "loss {:.4}  {:.0} samples/s",
                        s.loss, s.samples_per_s
                    ));
                    last = s.pipeline.or(last);
                }
                Ok(JobEvent::Failed(e)) => say(&progress, format!("job failed: {e}")),
                Ok(JobEvent::ReplicasSynchronized { after, .. }) => say(
                    &progress,
                    format!(
                        "started: {} rank(s) hold rank 0's parameters; training",
                        after.len()
                    ),
                ),
                Ok(JobEvent::GradientOverflow {
                    step,
                    scale,
                    next_scale,
                }) => say(
                    &progress,
                    format!(
                        "step {step} skipped: its gradient overflowed at loss scale {scale}; \
                         the scale is now {next_scale}"
                    ),
                ),
                Ok(JobEvent::CheckpointWritten { step, path }) => say(
                    &progress,
                    format!("checkpoint after step {step} written to {}", path.display()),
                ),
                Ok(JobEvent::CheckpointFailed { step, error }) => say(
                    &progress,
                    format!("checkpoint after step {step} failed: {error}"),
                ),
                Ok(JobEvent::Restored {
                    step,
                    path,
                    refused,
                }) => {
                    for r in refused {
                        say(&progress, format!("refused checkpoint {r}"));
                    }
                    say(
                        &progress,
                        format!("resumed after step {step} from {}", path.display()),
                    )
                }
                Ok(JobEvent::NothingToResume { location }) => say(
                    &progress,
                    format!(
                        "no checkpoint to resume from in {location}: starting from scratch \
                         (--require-checkpoint makes this an error)"
                    ),
                ),
                Ok(JobEvent::FaultInjected(f)) => say(
                    &progress,
                    format!(
                        "fault {} fired on device {} at step {}: {:?}",
                        f.index, f.fault.device, f.fault.step, f.fault.kind
                    ),
                ),
                Ok(JobEvent::DeviceLost {
                    step,
                    device,
                    error,
                    ..
                }) => say(
                    &progress,
                    format!("step {step}: lost device {device}: {error}"),
                ),
                Ok(JobEvent::NotRecovered { step, lost, reason }) => say(
                    &progress,
                    format!("step {step}: rank(s) {lost:?} lost and not recovered: {reason}"),
                ),
                Ok(JobEvent::Recovered {
                    step,
                    generation,
                    layout,
                    ..
                }) => say(
                    &progress,
                    format!(
                        "step {step}: recovered (generation {}, {} replicas), redoing the step",
                        generation.0,
                        layout.dp()
                    ),
                ),
                Ok(JobEvent::StageReplaced {
                    step,
                    stage,
                    twin,
                    device,
                }) => say(
                    &progress,
                    format!(
                        "step {step}: {stage} replaced on device {device}, from its twin {twin}"
                    ),
                ),
                Ok(JobEvent::CaughtUp { step, ranks, from }) => {
                    let ranks: Vec<String> = ranks.iter().map(ToString::to_string).collect();
                    say(
                        &progress,
                        format!(
                            "step {step}: {} had not finished it; took the state of {from}, \
                             which had",
                            ranks.join(", ")
                        ),
                    )
                }
                Ok(JobEvent::RolledBack {
                    failed_step,
                    step,
                    generation,
                    ..
                }) => say(
                    &progress,
                    format!(
                        "step {failed_step}: rolled back to the checkpoint after step {step} \
                         (generation {})",
                        generation.0
                    ),
                ),
                Ok(JobEvent::WaitingForDevices {
                    step,
                    replicas,
                    min,
                    within,
                }) => say(
                    &progress,
                    format!(
                        "step {step}: {replicas} replica(s), below the minimum of {min}: \
                         waiting up to {within:?} for devices"
                    ),
                ),
                Ok(JobEvent::Resized { step, from, to, .. }) => say(
                    &progress,
                    format!("step {step}: resized from {from} to {to} replicas"),
                ),
                Ok(JobEvent::ResizeRefused { requested, reason }) => say(
                    &progress,
                    format!("resize to {requested} replicas refused: {reason}"),
                ),
                Ok(_) | Err(EventsError::Missed(_)) => {}
                Err(EventsError::Closed) => break,
            }
        }
        last
    });
    // Ctrl-C or SIGTERM: checkpoint (when the job has a checkpoint directory) and stop.
    let stopper = handle.stopper();
    let signals = tokio::spawn(async move {
        interrupted().await;
        stopper.checkpoint_now();
        stopper.stop();
    });
    let trained = handle.join().await;
    signals.abort();
    let last = watcher.await.unwrap_or(None);
    bar.finish();
    (trained, last)
}

/// Prints `line` above the bar, or plainly when the bar is hidden (output not a terminal: a
/// log, a test).
fn say(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        println!("{line}");
    } else {
        bar.println(line);
    }
}

/// The loss from first to last step and where the time went.
pub(crate) fn report(s: &RunSummary, task: &TeacherTask) {
    println!(
        "loss {:.4} → {:.4} (attainable {:.4})",
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
        task.attainable_loss()
    );
    report_time(s);
}

/// Steps, throughput and where the time of a step went.
pub(crate) fn report_time(s: &RunSummary) {
    let (compute, comm, wait) = s.breakdown.shares();
    println!(
        "{} steps, {:.0} samples/s; time per step: compute {:.0}%, communication {:.0}%, waiting {:.0}%",
        s.steps,
        s.samples_per_s(),
        compute * 100.0,
        comm * 100.0,
        wait * 100.0
    );
    if let Some(amdahl) = s.amdahl() {
        println!("{amdahl}");
    }
    if let Some(faults) = s.page_faults {
        let later = s.page_faults_after_first.unwrap_or(0);
        println!(
            "page faults (this process's fresh pages): {} in the first step, {:.0} per step after it",
            faults.saturating_sub(later),
            later as f64 / s.steps.saturating_sub(1).max(1) as f64
        );
    }
}

/// Writes the trained demo MLP to `path` (Burn's burnpack format, `Module::save_file`).
pub(crate) fn save_model(model: Mlp, path: &std::path::Path) -> meshwork::error::Result<()> {
    model.save_file(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: format!("{e:?}"),
    })?;
    println!("model written to {}", path.display());
    Ok(())
}

/// Writes the trained blocks of the demo pipeline to `path` as the one MLP they make.
pub(crate) fn save_pipeline(
    model: meshwork::job::PipelineModel,
    path: &std::path::Path,
) -> meshwork::error::Result<()> {
    let mlp = Mlp::from_pipeline(model).ok_or_else(|| {
        Error::Runtime("the trained pipeline is missing a block of the demo MLP".into())
    })?;
    save_model(mlp, path)
}
