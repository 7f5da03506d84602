//! `meshwork bench pipeline`: a pipeline of K stages on K threads, measured.

use std::time::Duration;

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::demo::{Sample, TeacherTask, mlp_pipeline, mlp_pipeline_inputs};
use meshwork::error::{Error, Result};
use meshwork::parallel::pipeline::{Schedule, summarize};
use meshwork::parallel::pipeline_exec::{StageStepRecord, recorded_timeline, train_pipeline};

/// What `bench pipeline` measures.
#[derive(Debug, serde::Serialize)]
pub(crate) struct PipelineFigures {
    pp: u32,
    micro_batches: u32,
    schedule: String,
    batch_size: usize,
    samples_per_s: f64,
    bubble_measured: f64,
    bubble_theoretical: f64,
    peak_stash: u32,
    peak_activation_bytes: Vec<u64>,
}

/// Steps run before the timed ones.
const WARMUP: usize = 2;

/// Measured figures of timed steps `records[stage][step]` (warm-up steps excluded by the caller).
pub(crate) fn figures(
    schedule: &Schedule,
    pp: u32,
    batch: usize,
    records: &[Vec<StageStepRecord>],
) -> PipelineFigures {
    let steps = records.first().map_or(0, Vec::len);
    let step = |s: usize| -> Vec<&StageStepRecord> { records.iter().map(|r| &r[s]).collect() };
    let mut wall = Duration::ZERO;
    let mut bubble = 0.0;
    for s in 0..steps {
        let stages = step(s);
        bubble += summarize(&recorded_timeline(&stages)).bubble;
        // Wall time of the step, optimizer included: first stage start to last stage end.
        let begin = stages.iter().filter_map(|r| r.span.map(|x| x.0)).min();
        let end = stages.iter().filter_map(|r| r.span.map(|x| x.1)).max();
        if let (Some(b), Some(e)) = (begin, end) {
            wall += e - b;
        }
    }
    PipelineFigures {
        pp,
        micro_batches: schedule.micro_batches(),
        schedule: schedule.name().into(),
        batch_size: batch,
        samples_per_s: (batch * steps) as f64 / wall.as_secs_f64().max(1e-12),
        bubble_measured: bubble / steps.max(1) as f64,
        bubble_theoretical: schedule.theoretical_bubble(pp),
        peak_stash: records
            .iter()
            .flat_map(|r| r.iter().map(|x| x.peak_stash))
            .max()
            .unwrap_or(0),
        peak_activation_bytes: records
            .iter()
            .map(|r| r.iter().map(|x| x.peak_stash_bytes).max().unwrap_or(0))
            .collect(),
    }
}

pub(crate) fn run(
    pp: u32,
    schedule: Schedule,
    batch: usize,
    hidden: usize,
    steps: usize,
    timeline: Option<&std::path::Path>,
) -> Result<PipelineFigures> {
    // MLP 784 → 8 × hidden → 10.
    let mut widths = vec![784];
    widths.extend(std::iter::repeat_n(hidden, 8));
    widths.push(10);
    let device = Device::flex();
    let stages = mlp_pipeline(
        &widths,
        pp as usize,
        &SgdConfig::new().into(),
        0.01,
        &device,
    )
    .ok_or_else(|| {
        Error::InvalidConfig(format!(
            "--pp {pp}: the 9-layer benchmark model has 1 to 9 stages"
        ))
    })?;
    let data = TeacherTask {
        d_in: 784,
        d_out: 10,
        noise: 0.1,
        seed: 3,
    }
    .dataset(batch);
    let items: Vec<Sample> = (0..batch)
        .filter_map(|j| meshwork::data::Dataset::get(&data, j))
        .collect();
    let run = train_pipeline(
        stages,
        &schedule,
        vec![items; WARMUP + steps],
        mlp_pipeline_inputs(),
        &device,
        Duration::from_secs(120),
    )?;
    let timed: Vec<Vec<StageStepRecord>> = run
        .records
        .into_iter()
        .map(|r| r.into_iter().skip(WARMUP).collect())
        .collect();
    if let Some(path) = timeline {
        let last: Vec<&StageStepRecord> = timed.iter().filter_map(|r| r.last()).collect();
        let svg = meshwork::parallel::pipeline::render_svg(&recorded_timeline(&last));
        std::fs::write(path, svg).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    Ok(figures(&schedule, pp, batch, &timed))
}

/// Print the figures as a line of text or JSON.
pub(crate) fn print(f: &PipelineFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
    } else {
        println!(
            "pipeline {} pp={} M={} batch={}: {:.0} samples/s; bubble measured {:.3} vs theory {:.3}; peak stash {}; peak activation bytes per stage {:?}",
            f.schedule,
            f.pp,
            f.micro_batches,
            f.batch_size,
            f.samples_per_s,
            f.bubble_measured,
            f.bubble_theoretical,
            f.peak_stash,
            f.peak_activation_bytes
        );
    }
}
