//! `meshwork bench memory`: what each data-parallel rank holds of the training state (the
//! parameters, full and sharded, the gradients, the optimizer state and the activations kept
//! for backward, counted by the worker itself) for the demo MLP given as blocks of one layer,
//! under ZeRO stage 0 to 3 and with per-block recomputation, against the ZeRO paper's
//! figures (Rajbhandari et al., 2020: 16Ψ bytes per rank with Adam without sharding, split
//! 4Ψ + 4Ψ + 8Ψ in f32; at stage 3, 16Ψ/N plus the block being computed), with peak RSS and
//! samples/s against plain data parallelism over the same blocks measured in the same run
//! (each side in its own child process, alternated, median kept).

use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{TeacherTask, mlp_blocks};
use meshwork::error::{Error, Result};
use meshwork::events::JobEvent;
use meshwork::job::{BlockOptions, EventsError, Job};
use meshwork::parallel::memory::StepMemory;
use meshwork::parallel::zero::ZeroStage;
use meshwork::precision::Precision;
use serde::{Deserialize, Serialize};

use crate::memory_svg::{Panel, Point};

/// Warm-up steps not timed.
const WARMUP: u64 = 2;
/// Alternated runs of each side; the median is kept.
const ROUNDS: usize = 3;

/// What `bench memory` is asked.
#[derive(Debug, Clone)]
pub(crate) struct MemoryBench {
    pub(crate) dp: u32,
    pub(crate) zero: u8,
    pub(crate) hidden: usize,
    pub(crate) depth: usize,
    pub(crate) recompute: bool,
    pub(crate) precision: Precision,
    /// Blocks whose parameters may be gathered ahead of the one computing (prefetch).
    pub(crate) in_flight: usize,
    pub(crate) steps: u64,
    pub(crate) batch_size: usize,
    /// Draw one rank's bytes over the last step, this run beside the baseline.
    pub(crate) svg: Option<PathBuf>,
}

/// One side of the comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Side {
    zero: u8,
    recompute: bool,
    precision: Precision,
}

/// What one child reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WorkerReport {
    samples_per_s: f64,
    peak_rss_bytes: u64,
    /// What the rank holding the most held during the last step.
    memory: StepMemory,
}

/// The demo MLP: 32 inputs, `depth` hidden layers of `hidden`, 4 outputs; one block per layer.
fn widths(hidden: usize, depth: usize) -> Vec<usize> {
    let mut w = vec![32];
    w.extend(std::iter::repeat_n(hidden, depth));
    w.push(4);
    w
}

/// Trainable elements per layer (weights and biases).
fn layer_elements(widths: &[usize]) -> Vec<u64> {
    widths
        .windows(2)
        .map(|w| (w[0] * w[1] + w[1]) as u64)
        .collect()
}

fn args(b: &MemoryBench, side: Side) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "bench".into(),
        "memory-worker".into(),
        "--dp".into(),
        b.dp.to_string(),
        "--zero".into(),
        side.zero.to_string(),
        "--hidden".into(),
        b.hidden.to_string(),
        "--depth".into(),
        b.depth.to_string(),
        "--precision".into(),
        side.precision.name().into(),
        "--in-flight".into(),
        b.in_flight.to_string(),
        "--steps".into(),
        b.steps.to_string(),
        "--batch-size".into(),
        b.batch_size.to_string(),
    ];
    if side.recompute {
        a.push("--recompute".into());
    }
    a
}

fn child(b: &MemoryBench, side: Side) -> Result<WorkerReport> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })?;
    let out = Command::new(&exe)
        .args(args(b, side))
        .output()
        .map_err(|e| Error::Io {
            path: exe.display().to_string(),
            reason: e.to_string(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| {
        Error::Runtime(format!(
            "bench child ({side:?}) gave no report ({e}); stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    })
}

fn median(mut runs: Vec<WorkerReport>) -> WorkerReport {
    runs.sort_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
}

/// The ZeRO paper's bytes per rank for Ψ parameters with Adam at `zero` over `n` ranks:
/// (parameters, gradients, optimizer state). In f32: 4Ψ + 4Ψ + 8Ψ (Adam's two moments); in
/// mixed precision: 2Ψ + 2Ψ + 12Ψ (16-bit parameters and gradients; the optimizer keeps f32
/// master weights beside the moments).
fn paper_bytes(psi: f64, n: f64, zero: u8, precision: Precision) -> (f64, f64, f64) {
    let (p, g, o) = if precision.is_low() {
        (2.0, 2.0, 12.0)
    } else {
        (4.0, 4.0, 8.0)
    };
    let params = if zero >= 3 { p * psi / n } else { p * psi };
    let grads = if zero >= 2 { g * psi / n } else { g * psi };
    let optim = if zero >= 1 { o * psi / n } else { o * psi };
    (params, grads, optim)
}

/// The most bytes of parameters, gradients and optimizer state held at one instant of the
/// step (the peaks of each, reported apart, need not coincide).
fn peak_state(m: &StepMemory) -> u64 {
    m.timeline
        .iter()
        .map(|p| p.params + p.grads)
        .max()
        .unwrap_or(0)
        + m.optimizer
}

/// Run both sides and print the figures.
pub(crate) fn run(b: MemoryBench, json: bool) -> Result<()> {
    if b.zero > 3 || b.dp == 0 || b.steps == 0 || b.depth == 0 || b.hidden == 0 {
        return Err(Error::InvalidConfig(
            "--zero 0 to 3; --dp, --steps, --depth and --hidden at least 1".into(),
        ));
    }
    let side = Side {
        zero: b.zero,
        recompute: b.recompute,
        precision: b.precision,
    };
    // The baseline: plain data parallelism over the same blocks, in f32, nothing recomputed.
    let plain = Side {
        zero: 0,
        recompute: false,
        precision: Precision::F32,
    };
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    for _ in 0..ROUNDS {
        runs.push(child(&b, side)?);
        baselines.push(child(&b, plain)?);
    }
    let run = median(runs);
    let base = median(baselines);
    let w = widths(b.hidden, b.depth);
    let layers = layer_elements(&w);
    let psi = layers.iter().sum::<u64>() as f64;
    let largest = layers.iter().copied().max().unwrap_or(0) as f64;
    let n = f64::from(b.dp);
    let (f_params, f_grads, f_optim) = paper_bytes(psi, n, b.zero, b.precision);
    // ZeRO-3's allowance: the block being computed, its full parameters and gradient.
    let allowance = 16.0 * psi / n + 8.0 * largest;
    let m = &run.memory;
    let held_params = m.peak_full_params + m.param_shards;
    // Parameters, gradients and optimizer state held at the same instant, at its peak.
    let state = peak_state(m);
    let throughput = run.samples_per_s / base.samples_per_s.max(1e-12);
    if let Some(path) = &b.svg {
        let panel = |title: String, m: &StepMemory| Panel {
            title,
            points: m
                .timeline
                .iter()
                .map(|p| Point {
                    t_ms: p.at_us as f64 / 1000.0,
                    params: p.params,
                    grads: p.grads,
                    optimizer: m.optimizer,
                    activations: p.activations,
                })
                .collect(),
        };
        let svg = crate::memory_svg::render(&[
            panel(
                format!(
                    "ZeRO-0 (plain data parallel), dp {}: one rank, one step",
                    b.dp
                ),
                &base.memory,
            ),
            panel(
                format!(
                    "ZeRO-{}{}, dp {}: one rank, one step",
                    b.zero,
                    if b.recompute {
                        " with recomputation"
                    } else {
                        ""
                    },
                    b.dp
                ),
                m,
            ),
        ]);
        std::fs::write(path, svg).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    if json {
        println!(
            "{}",
            serde_json::json!({
                "world": b.dp,
                "zero": b.zero,
                "precision": b.precision.name(),
                "blocks_in_flight": b.in_flight,
                "recompute": b.recompute,
                "elements": psi,
                "largest_block_elements": largest,
                "param_bytes": held_params,
                "peak_full_param_bytes": m.peak_full_params,
                "param_shard_bytes": m.param_shards,
                "grad_bytes": m.peak_grads,
                "optim_bytes": m.optimizer,
                "activation_bytes": m.peak_activations,
                "state_bytes": state,
                "formula_param_bytes": f_params,
                "formula_grad_bytes": f_grads,
                "formula_optim_bytes": f_optim,
                "formula_unsharded_bytes": 16.0 * psi,
                "stage3_allowance_bytes": allowance,
                "state_to_allowance": state as f64 / allowance,
                "baseline_activation_bytes": base.memory.peak_activations,
                "baseline_state_bytes": peak_state(&base.memory),
                "peak_rss_bytes": run.peak_rss_bytes,
                "baseline_peak_rss_bytes": base.peak_rss_bytes,
                "samples_per_s": run.samples_per_s,
                "baseline_samples_per_s": base.samples_per_s,
                "throughput_ratio": throughput,
            })
        );
        return Ok(());
    }
    let mib = |bytes: f64| bytes / 1_048_576.0;
    println!(
        "# ZeRO-{}{} at dp {}, {} blocks in flight: demo MLP {:?} as {} one-layer blocks (Ψ = \
         {psi} parameters, largest block {largest}), Adam, {}, batch {}, {} timed steps; \
         median of {ROUNDS} alternated runs per side; the baseline is plain data parallel over \
         the same blocks in f32",
        b.zero,
        if b.recompute { " + recompute" } else { "" },
        b.dp,
        b.in_flight,
        w,
        layers.len(),
        b.precision,
        b.batch_size,
        b.steps
    );
    println!(
        "per rank, peak over the step (measured | ZeRO paper, {} Adam){}:",
        b.precision,
        if b.precision.is_low() {
            "; meshwork keeps the f32 master weights in the model and f32 gradients, counted \
             under parameters and gradients, and casts a 16-bit copy of a block for its compute"
        } else {
            ""
        }
    );
    for (what, measured, formula) in [
        ("parameters", held_params, f_params),
        ("gradients", m.peak_grads, f_grads),
        ("optimizer state", m.optimizer, f_optim),
    ] {
        println!(
            "  {what:<16} {:>9.2} MiB | {:>9.2} MiB",
            mib(measured as f64),
            mib(formula)
        );
    }
    println!(
        "  of which full parameters materialised at once: {:.2} MiB (shards {:.2} MiB)",
        mib(m.peak_full_params as f64),
        mib(m.param_shards as f64)
    );
    println!(
        "  parameters + gradients + optimizer held at once, at the peak: {:.2} MiB; without \
         sharding 16Ψ = {:.2} MiB; stage-3 allowance 16Ψ/N + the largest block's parameters \
         and gradient = {:.2} MiB; ratio {:.3}",
        mib(state as f64),
        mib(16.0 * psi),
        mib(allowance),
        state as f64 / allowance
    );
    println!(
        "  activations kept for backward: {:.2} MiB (plain data parallel {:.2} MiB)",
        mib(m.peak_activations as f64),
        mib(base.memory.peak_activations as f64)
    );
    println!(
        "peak RSS (whole process, {} ranks): {:.1} MiB; plain data parallel {:.1} MiB",
        b.dp,
        mib(run.peak_rss_bytes as f64),
        mib(base.peak_rss_bytes as f64)
    );
    println!(
        "samples/s: {:.0}; plain data parallel over the same blocks {:.0}; ratio {throughput:.3}",
        run.samples_per_s, base.samples_per_s,
    );
    if let Some(path) = &b.svg {
        println!("picture written to {}", path.display());
    }
    Ok(())
}

/// One side, in this (child) process: train and print a [`WorkerReport`] line.
pub(crate) fn worker(b: MemoryBench) -> Result<()> {
    let zero = ZeroStage::from_number(b.zero)
        .ok_or_else(|| Error::InvalidConfig(format!("--zero {}: 0 to 3", b.zero)))?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::Runtime(e.to_string()))?;
    let report = runtime.block_on(async move {
        let w = widths(b.hidden, b.depth);
        let task = TeacherTask {
            d_in: w[0],
            d_out: w[w.len() - 1],
            noise: 0.1,
            seed: 1,
        };
        let device = Device::flex();
        device.seed(1);
        let blocks = mlp_blocks(&w, BlockOptions::default().recompute(b.recompute), &device)
            .ok_or_else(|| Error::InvalidConfig("the demo MLP needs a layer".into()))?;
        let job = Job::builder()
            .blocks(blocks)
            .data(task.dataset(b.batch_size * 4))
            .optimizer(AdamConfig::new())
            .learning_rate(1e-3)
            .data_parallel(b.dp)
            .batch_size(b.batch_size)
            .zero(zero)
            .precision(b.precision)
            .blocks_in_flight(b.in_flight)
            .steps(b.steps + WARMUP)
            .build()?;
        let handle = job.spawn().await?;
        let mut events = handle.events();
        let (mut samples, mut wall) = (0u64, 0.0f64);
        let mut memory = StepMemory::default();
        loop {
            match events.recv().await {
                Ok(JobEvent::StepDone(s)) => {
                    if s.step >= WARMUP {
                        samples += s
                            .replicas
                            .iter()
                            .map(|r| r.sample_ids.len() as u64)
                            .sum::<u64>();
                        wall += s.wall_s;
                    }
                    // The rank holding the most (ranks differ by one element at most).
                    if let Some(most) = s
                        .replicas
                        .iter()
                        .filter_map(|r| r.pipeline.as_ref().map(|p| &p.memory))
                        .max_by_key(|m| {
                            m.peak_full_params + m.param_shards + m.peak_grads + m.optimizer
                        })
                    {
                        memory = most.clone();
                    }
                }
                Ok(_) | Err(EventsError::Missed(_)) => {}
                Err(EventsError::Closed) => break,
            }
        }
        handle.join().await?;
        Ok::<_, Error>(WorkerReport {
            samples_per_s: samples as f64 / wall.max(1e-12),
            peak_rss_bytes: crate::dp_bench::peak_rss_bytes(),
            memory,
        })
    })?;
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "{}",
        serde_json::to_string(&report).unwrap_or_default()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_papers_figures_shard_as_each_stage_says() {
        let (psi, n) = (1000.0, 4.0);
        let f32 = Precision::F32;
        assert_eq!(paper_bytes(psi, n, 0, f32), (4000.0, 4000.0, 8000.0));
        assert_eq!(paper_bytes(psi, n, 1, f32), (4000.0, 4000.0, 2000.0));
        assert_eq!(paper_bytes(psi, n, 2, f32), (4000.0, 1000.0, 2000.0));
        assert_eq!(paper_bytes(psi, n, 3, f32), (1000.0, 1000.0, 2000.0));
        // Mixed precision: the same 16Ψ, split 2 + 2 + 12.
        assert_eq!(
            paper_bytes(psi, n, 0, Precision::Bf16),
            (2000.0, 2000.0, 12000.0)
        );
        assert_eq!(
            paper_bytes(psi, n, 3, Precision::F16),
            (500.0, 500.0, 3000.0)
        );
    }

    #[test]
    fn the_demo_mlp_has_one_block_per_layer() {
        let w = widths(8, 3);
        assert_eq!(w, vec![32, 8, 8, 8, 4]);
        assert_eq!(layer_elements(&w), vec![264, 72, 72, 36]);
    }
}
