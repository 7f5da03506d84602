//! `meshwork bench pipeline`: a pipeline job (stage actors, one device each), measured.

use std::time::Duration;

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::demo::{TeacherTask, measure_mlp_layers, mlp_pipeline};
use meshwork::error::{Error, Result};
use meshwork::events::PipelineStep;
use meshwork::job::Job;
use meshwork::parallel::pipeline::{
    Costs, InstrKind, Schedule, StageIndex, TimedInstr, balanced_split, even_split, render_svg,
    simulate,
};
use meshwork::parallel::pipeline_exec::chrome_trace;

/// What `bench pipeline` measures.
#[derive(Debug, serde::Serialize)]
pub(crate) struct PipelineFigures {
    pp: u32,
    dp: u32,
    micro_batches: u32,
    virtual_stages: u32,
    schedule: String,
    batch_size: usize,
    /// Layers per block, in block order.
    split: Vec<usize>,
    samples_per_s: f64,
    /// The mean over the timed steps of `1 − Σ compute / (K · makespan)`.
    bubble_measured: f64,
    /// The schedule's textbook bubble: equal stages, free links.
    bubble_theoretical: f64,
    /// The bubble the schedule simulator predicts from this run's own costs: each stage's
    /// median forward and backward time, and the median send time (mean over the timed
    /// steps); what the schedule leaves idle given stages that are not equal.
    bubble_simulated: f64,
    /// `bubble_measured / bubble_simulated`: above 1 is what the runtime adds (wake-ups,
    /// gaps between instructions, noise).
    measured_over_simulated: f64,
    /// Per stage, the median forward + backward time of one micro-batch over the fastest
    /// stage's: how unequal the stages are.
    stage_imbalance: Vec<f64>,
    peak_stash: u32,
    peak_activation_bytes: Vec<u64>,
    /// Per stage, `[compute, communication, waiting]` shares of the measured interval,
    /// averaged over the timed steps.
    stage_shares: Vec<[f64; 3]>,
}

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct PipelineBench {
    pub(crate) pp: u32,
    pub(crate) dp: u32,
    pub(crate) schedule: Schedule,
    pub(crate) batch: usize,
    pub(crate) hidden: usize,
    /// Hidden layers of the MLP (8 by default).
    pub(crate) depth: usize,
    pub(crate) steps: usize,
    /// How the layers are cut into blocks.
    pub(crate) split: Split,
}

/// How `bench pipeline` cuts the MLP's layers into blocks.
#[derive(Debug, Clone)]
pub(crate) enum Split {
    /// By each layer's measured forward + backward time.
    Balanced,
    /// By count.
    Even,
    /// These many layers per block.
    Sizes(Vec<usize>),
}

impl std::str::FromStr for Split {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "balanced" => Ok(Split::Balanced),
            "even" => Ok(Split::Even),
            sizes => sizes
                .split(',')
                .map(|n| n.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(Split::Sizes)
                .map_err(|_| {
                    Error::InvalidConfig(format!(
                        "--split {s}: balanced, even, or layers per block such as 4,5"
                    ))
                }),
        }
    }
}

/// Steps run before the timed ones.
const WARMUP: usize = 2;

/// Measured figures of the timed steps (warm-up steps excluded by the caller).
fn figures(b: &PipelineBench, split: Vec<usize>, steps: &[(f64, PipelineStep)]) -> PipelineFigures {
    let n = steps.len().max(1) as f64;
    let wall: f64 = steps.iter().map(|(w, _)| w).sum();
    let pp = b.pp as usize;
    let bubble_measured = steps.iter().map(|(_, p)| p.bubble).sum::<f64>() / n;
    let simulated: Vec<(f64, Vec<f64>)> = steps
        .iter()
        .filter_map(|(_, p)| simulated_bubble(&b.schedule, b.pp, &p.timeline))
        .collect();
    let bubble_simulated = simulated.iter().map(|(s, _)| s).sum::<f64>() / n;
    let stage_imbalance = (0..pp)
        .map(|s| {
            simulated
                .iter()
                .map(|(_, w)| w.get(s).copied().unwrap_or(1.0))
                .sum::<f64>()
                / simulated.len().max(1) as f64
        })
        .collect();
    PipelineFigures {
        pp: b.pp,
        dp: b.dp,
        micro_batches: b.schedule.micro_batches(),
        virtual_stages: b.schedule.virtual_stages(),
        schedule: b.schedule.name().into(),
        batch_size: b.batch,
        split,
        samples_per_s: (b.batch * steps.len()) as f64 / wall.max(1e-12),
        bubble_measured,
        bubble_theoretical: b.schedule.theoretical_bubble(b.pp),
        bubble_simulated,
        measured_over_simulated: bubble_measured / bubble_simulated.max(1e-12),
        stage_imbalance,
        peak_stash: steps
            .iter()
            .flat_map(|(_, p)| p.peak_stash.iter().copied())
            .max()
            .unwrap_or(0),
        stage_shares: (0..pp)
            .map(|s| {
                let mut sum = [0.0; 3];
                for (_, p) in steps {
                    if let Some(x) = p.shares.get(s) {
                        sum[0] += x.compute / n;
                        sum[1] += x.communication / n;
                        sum[2] += x.waiting / n;
                    }
                }
                sum
            })
            .collect(),
        peak_activation_bytes: (0..pp)
            .map(|s| {
                steps
                    .iter()
                    .filter_map(|(_, p)| p.peak_activation_bytes.get(s).copied())
                    .max()
                    .unwrap_or(0)
            })
            .collect(),
    }
}

/// The median of `v` (0 for none).
fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// The bubble the simulator predicts for `schedule` over `pp` stages with the costs one step
/// measured (its `timeline`, ticks per stage): each stage's median forward and backward, the
/// median send on every link. Also each stage's forward + backward over the fastest stage's.
fn simulated_bubble(
    schedule: &Schedule,
    pp: u32,
    timeline: &[Vec<TimedInstr>],
) -> Option<(f64, Vec<f64>)> {
    let took = |t: &TimedInstr| t.end.saturating_sub(t.start);
    let of = |stage: &[TimedInstr], kind: InstrKind| {
        median(
            stage
                .iter()
                .filter(|t| t.instr.kind() == kind)
                .map(took)
                .collect(),
        )
    };
    let sends = median(
        timeline
            .iter()
            .flatten()
            .filter(|t| {
                matches!(
                    t.instr.kind(),
                    InstrKind::SendActivation | InstrKind::SendGradient
                )
            })
            .map(took)
            .collect(),
    );
    let mut costs = Costs::new(1, 1).with_communication(sends, 0);
    let mut per_stage = Vec::new();
    for (s, stage) in timeline.iter().enumerate() {
        let (f, bw) = (
            of(stage, InstrKind::Forward),
            of(stage, InstrKind::Backward),
        );
        costs = costs.with_stage(StageIndex(s as u32), f.max(1), bw.max(1));
        per_stage.push((f + bw).max(1) as f64);
    }
    let report = simulate(&schedule.instructions(pp).ok()?, &costs).ok()?;
    let fastest = per_stage.iter().copied().fold(f64::INFINITY, f64::min);
    Some((
        report.bubble,
        per_stage.iter().map(|t| t / fastest).collect(),
    ))
}

pub(crate) fn run(b: PipelineBench, timeline: Option<&std::path::Path>) -> Result<PipelineFigures> {
    // MLP 784 → depth × hidden → 10.
    let mut widths = vec![784];
    widths.extend(std::iter::repeat_n(b.hidden, b.depth.max(1)));
    widths.push(10);
    let blocks = (b.pp * b.schedule.virtual_stages()) as usize;
    let micro = b.batch / (b.dp as usize * b.schedule.micro_batches().max(1) as usize);
    let device = Device::flex();
    let split = match &b.split {
        // Cut by each layer's measured forward + backward time on one micro-batch.
        Split::Balanced => {
            balanced_split(&measure_mlp_layers(&widths, micro.max(1), &device), blocks)
        }
        Split::Even => even_split(widths.len() - 1, blocks),
        Split::Sizes(sizes) => Some(sizes.clone()).filter(|s| s.len() == blocks),
    }
    .ok_or_else(|| {
        Error::InvalidConfig(format!(
            "{blocks} blocks (pp × virtual stages): the {}-layer benchmark model has 1 to {}",
            widths.len() - 1,
            widths.len() - 1
        ))
    })?;
    device.seed(7);
    let stages = mlp_pipeline(&widths, &split, &device)
        .ok_or_else(|| Error::InvalidConfig(format!("split {split:?} does not fit the MLP")))?;
    let data = TeacherTask {
        d_in: 784,
        d_out: 10,
        noise: 0.1,
        seed: 3,
    }
    .dataset(b.batch);
    let job = Job::builder()
        .pipeline(stages, b.schedule)
        .data_parallel(b.dp)
        .data(data)
        .batch_size(b.batch)
        .optimizer(SgdConfig::new())
        .learning_rate(0.01)
        .steps((WARMUP + b.steps) as u64)
        .step_timeout(Duration::from_secs(300))
        .build()?;
    let steps: Vec<_> =
        crate::bench_run::collect_steps(job, (WARMUP + b.steps) as u64, "bench pipeline")?
            .into_iter()
            .filter(|s| s.step as usize >= WARMUP)
            .filter_map(|s| s.pipeline.map(|p| (s.wall_s, p)))
            .collect();
    if let (Some(path), Some((_, last))) = (timeline, steps.last()) {
        let text = if path.extension().is_some_and(|e| e == "json") {
            chrome_trace(&last.timeline)
        } else {
            render_svg(&last.timeline)
        };
        std::fs::write(path, text).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    Ok(figures(&b, split, &steps))
}

/// Print the figures as a line of text or JSON.
pub(crate) fn print(f: &PipelineFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
    } else {
        println!(
            "pipeline {} pp={} dp={} M={} v={} batch={} split {:?}: {:.0} samples/s; bubble measured {:.3} vs theory {:.3} ({:.2}×); simulated from this run's stage costs {:.3} (measured {:.2}× that; stage forward+backward over the fastest {}); peak stash {}; peak activation bytes per stage {:?}; per stage compute/communication/waiting {}",
            f.schedule,
            f.pp,
            f.dp,
            f.micro_batches,
            f.virtual_stages,
            f.batch_size,
            f.split,
            f.samples_per_s,
            f.bubble_measured,
            f.bubble_theoretical,
            f.bubble_measured / f.bubble_theoretical.max(1e-12),
            f.bubble_simulated,
            f.measured_over_simulated,
            f.stage_imbalance
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join("/"),
            f.peak_stash,
            f.peak_activation_bytes,
            f.stage_shares
                .iter()
                .map(|[c, m, w]| format!("{:.0}/{:.0}/{:.0}%", c * 100.0, m * 100.0, w * 100.0))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
}
