//! CI-1: the runtime of the demo models' jobs, compiled once, here.
//!
//! A job's runtime (its supervisor, stages, spawner and collectives) is generic in the model
//! and the sample type, so every crate that trains a model compiles it again for its types:
//! each example, the test suites and the command line did so for the same demo models, most
//! of what CI compiled. Rust lets a crate reuse a generic function's instance from the crate
//! that compiled it, where that one was built without heavy optimisation (opt-level ≤ 1:
//! the dev and test profiles' `share-generics`). These functions are the library's own
//! instances of the demo jobs — the MLP on [`Sample`]s whole or as stages, and the GPT's
//! blocks on [`TextWindow`]s — from building the job and its stages to joining it, with its
//! events recorded ([`run_recording`]); whatever trains those types downstream links to
//! them. A release build optimises each crate on its own and gains nothing from them (nor
//! loses anything but their compile time).
//!
//! They are ordinary functions too: each builds the job, runs it to its end and returns its
//! outcome with every event it published.

use super::run_recording;
use crate::data::text::TextWindow;
use crate::demo::gpt::Gpt;
use crate::demo::{Mlp, Sample};
use crate::error::Result;
use crate::events::JobEvent;
use crate::job::{BlockOptions, JobBuilder, PipelineModel, PipelineStages, Trained};
use crate::parallel::pipeline::Schedule;

/// A job's outcome and every event it published.
pub type Recorded<M> = (Result<Trained<M>>, Vec<JobEvent>);

/// Build the demo MLP's data-parallel job (or any job of [`Mlp`] on [`Sample`]s), run it to
/// its end and return its outcome with its events.
pub async fn run_mlp(builder: JobBuilder<Mlp, Sample>) -> Recorded<Mlp> {
    record(builder).await
}

/// The same for a model of stages on [`Sample`]s (the demo MLP's pipeline or blocks):
/// `stages` as a pipeline under `schedule`, or as blocks without one.
pub async fn run_stages(
    builder: JobBuilder<PipelineModel, Sample>,
    stages: PipelineStages<Sample>,
    schedule: Option<Schedule>,
) -> Recorded<PipelineModel> {
    record(staged(builder, stages, schedule)).await
}

/// The same for the demo GPT on [`TextWindow`]s: its blocks (with `options`, if any) as a
/// pipeline under `schedule`, or as blocks without one.
pub async fn run_gpt(
    builder: JobBuilder<PipelineModel, TextWindow>,
    model: Gpt,
    options: Option<BlockOptions>,
    schedule: Option<Schedule>,
) -> Recorded<PipelineModel> {
    let stages = match options {
        Some(options) => model.into_blocks_with(options),
        None => model.into_blocks(),
    };
    record(staged(builder, stages, schedule)).await
}

/// `stages` as a pipeline under `schedule`, or as blocks without one.
fn staged<I: Send + Sync + 'static>(
    builder: JobBuilder<PipelineModel, I>,
    stages: PipelineStages<I>,
    schedule: Option<Schedule>,
) -> JobBuilder<PipelineModel, I> {
    match schedule {
        Some(schedule) => builder.pipeline(stages, schedule),
        None => builder.blocks(stages),
    }
}

/// Build the job and run it to its end, recording its events (a refused build: its error and
/// no events).
async fn record<M, I>(builder: JobBuilder<M, I>) -> Recorded<M>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    match builder.build() {
        Ok(job) => run_recording(job).await,
        Err(e) => (Err(e), Vec::new()),
    }
}
