//! `meshwork bench memory`: what each data-parallel rank holds of the training state under
//! ZeRO stage 0, 1 or 2, against the ZeRO paper's formula (Rajbhandari et al., 2020: for
//! fp32 training with Adam, parameters Ψ, gradients Ψ — Ψ/N at stage 2 — and optimizer state
//! 2Ψ/N words at stages 1 and 2), with peak RSS and samples/s against plain data parallelism
//! measured in the same run (each side in its own child process, alternated, median kept).

use std::io::Write;
use std::process::Command;

use burn::optim::AdamConfig;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::error::{Error, Result};
use meshwork::events::JobEvent;
use meshwork::job::{EventsError, Job};
use meshwork::parallel::HeldBytes;
use meshwork::parallel::zero::ZeroStage;
use serde::{Deserialize, Serialize};

/// Warm-up steps not timed.
const WARMUP: u64 = 3;
/// Alternated runs of each side; the median is kept.
const ROUNDS: usize = 3;

/// What `bench memory` is asked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemoryBench {
    pub(crate) dp: u32,
    pub(crate) zero: u8,
    pub(crate) hidden: usize,
    pub(crate) steps: u64,
    pub(crate) batch_size: usize,
}

/// What one child reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WorkerReport {
    samples_per_s: f64,
    peak_rss_bytes: u64,
    /// The largest holding of any rank at the last step.
    held: HeldBytes,
    /// Ψ: trainable parameter elements.
    elements: u64,
}

/// The demo MLP of `meshwork train`: 32 inputs, two hidden layers, 4 outputs.
fn widths(hidden: usize) -> [usize; 4] {
    [32, hidden, hidden, 4]
}

fn args(b: &MemoryBench, zero: u8) -> Vec<String> {
    vec![
        "bench".into(),
        "memory-worker".into(),
        "--dp".into(),
        b.dp.to_string(),
        "--zero".into(),
        zero.to_string(),
        "--hidden".into(),
        b.hidden.to_string(),
        "--steps".into(),
        b.steps.to_string(),
        "--batch-size".into(),
        b.batch_size.to_string(),
    ]
}

fn child(b: &MemoryBench, zero: u8) -> Result<WorkerReport> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })?;
    let out = Command::new(&exe)
        .args(args(b, zero))
        .output()
        .map_err(|e| Error::Io {
            path: exe.display().to_string(),
            reason: e.to_string(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| {
        Error::Runtime(format!(
            "bench child (zero {zero}) gave no report ({e}); stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    })
}

fn median(mut runs: Vec<WorkerReport>) -> WorkerReport {
    runs.sort_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
}

/// Run both sides and print the figures.
pub(crate) fn run(b: MemoryBench, json: bool) -> Result<()> {
    if b.zero > 2 || b.dp == 0 || b.steps == 0 {
        return Err(Error::InvalidConfig(
            "--zero 0, 1 or 2; --dp and --steps at least 1".into(),
        ));
    }
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    for _ in 0..ROUNDS {
        runs.push(child(&b, b.zero)?);
        baselines.push(child(&b, 0)?);
    }
    let run = median(runs);
    let base = median(baselines);
    let n = f64::from(b.dp);
    let psi = run.elements as f64;
    // The ZeRO paper's words per rank (×4 bytes for f32).
    let words_params = psi;
    let words_grads = if b.zero == 2 { psi / n } else { psi };
    let words_optim = if b.zero >= 1 {
        2.0 * psi / n
    } else {
        2.0 * psi
    };
    let h = run.held;
    let ratio = |measured: u64, words: f64| measured as f64 / (4.0 * words);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "world": b.dp,
                "zero": b.zero,
                "elements": run.elements,
                "param_bytes": h.params,
                "grad_bytes": h.grads,
                "grad_bytes_backward": h.grads_backward,
                "optim_bytes": h.optimizer,
                "between_steps_bytes": h.params + h.optimizer,
                "formula_param_bytes": 4.0 * words_params,
                "formula_grad_bytes": 4.0 * words_grads,
                "formula_optim_bytes": 4.0 * words_optim,
                "optim_ratio": ratio(h.optimizer, words_optim),
                "grad_ratio": ratio(h.grads, words_grads),
                "peak_rss_bytes": run.peak_rss_bytes,
                "baseline_peak_rss_bytes": base.peak_rss_bytes,
                "samples_per_s": run.samples_per_s,
                "baseline_samples_per_s": base.samples_per_s,
                "throughput_ratio": run.samples_per_s / base.samples_per_s.max(1e-12),
            })
        );
        return Ok(());
    }
    let mib = |bytes: f64| bytes / 1_048_576.0;
    println!(
        "# ZeRO-{} at dp {}: demo MLP {:?} (Ψ = {} parameters), Adam, batch {}, {} timed steps; \
         median of {ROUNDS} alternated runs per side",
        b.zero,
        b.dp,
        widths(b.hidden),
        run.elements,
        b.batch_size,
        b.steps
    );
    println!("per rank, at the optimizer step (measured | ZeRO formula | ratio):");
    for (what, measured, words) in [
        ("parameters", h.params, words_params),
        ("gradients", h.grads, words_grads),
        ("optimizer state", h.optimizer, words_optim),
    ] {
        println!(
            "  {what:<16} {:>9.2} MiB | {:>9.2} MiB | {:.3}",
            mib(measured as f64),
            mib(4.0 * words),
            ratio(measured, words)
        );
    }
    println!(
        "  between steps: {:.2} MiB (parameters + optimizer state; no gradient is kept)",
        mib((h.params + h.optimizer) as f64)
    );
    println!(
        "  right after Burn's backward: {:.2} MiB of gradients (Burn's single backward call \
         materialises every gradient before any reduction)",
        mib(h.grads_backward as f64)
    );
    println!(
        "peak RSS (whole process, {} ranks): {:.1} MiB; plain data parallel {:.1} MiB",
        b.dp,
        mib(run.peak_rss_bytes as f64),
        mib(base.peak_rss_bytes as f64)
    );
    println!(
        "samples/s: {:.0}; plain data parallel {:.0}; ratio {:.3}",
        run.samples_per_s,
        base.samples_per_s,
        run.samples_per_s / base.samples_per_s.max(1e-12)
    );
    Ok(())
}

/// One side, in this (child) process: train and print a [`WorkerReport`] line.
pub(crate) fn worker(b: MemoryBench) -> Result<()> {
    let zero = ZeroStage::from_number(b.zero)
        .ok_or_else(|| Error::InvalidConfig(format!("--zero {}: 0, 1 or 2", b.zero)))?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::Runtime(e.to_string()))?;
    let report = runtime.block_on(async move {
        let w = widths(b.hidden);
        let task = TeacherTask {
            d_in: w[0],
            d_out: w[3],
            noise: 0.1,
            seed: 1,
        };
        let job = Job::builder()
            .model(move |ctx| Mlp::new(&w, &ctx.device))
            .loss(mse_loss)
            .data(task.dataset(b.batch_size * 4))
            .optimizer(AdamConfig::new())
            .learning_rate(1e-3)
            .data_parallel(b.dp)
            .batch_size(b.batch_size)
            .zero(zero)
            .steps(b.steps + WARMUP)
            .build()?;
        let handle = job.spawn().await?;
        let mut events = handle.events();
        let (mut samples, mut wall) = (0u64, 0.0f64);
        let mut held = HeldBytes::default();
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
                        .filter_map(|r| r.held)
                        .max_by_key(|h| h.params + h.grads + h.optimizer)
                    {
                        held = most;
                    }
                }
                Ok(_) | Err(EventsError::Missed(_)) => {}
                Err(EventsError::Closed) => break,
            }
        }
        handle.join().await?;
        Ok::<_, Error>(WorkerReport {
            samples_per_s: samples as f64 / wall.max(1e-12),
            peak_rss_bytes: crate::bench::peak_rss_bytes(),
            held,
            elements: held.params / 4,
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
