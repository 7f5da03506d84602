//! `meshwork bench gpt`: the demo GPT trained end to end, as a user runs it, at two sizes and
//! at dp 1 and dp 2 — each run a `meshwork train --model gpt` child process — beside
//! `benches/peers/gpt_ddp.py` (the same model, data order, batch, initialisation scheme and
//! Adam in PyTorch, DDP over gloo, one thread per process) with `--pytorch PYTHON`, the two
//! alternated run by run so that each ratio holds for one load. It prints windows/s and the
//! validation loss side by side, and the FLOP/s the training achieved per core against the
//! rate this machine's matrix products reach on one core at the model's own shape.
//!
//! Training FLOPs per token are `6·N + 12·L·d·T` (PaLM's count: N = 12·L·d² + d·vocab weights
//! in the matrix products, L layers, d = d_model, T = context; biases, norms, the embedding
//! look-up and the causal mask's saved half not counted), so the achieved rate is comparable
//! with other reports of model FLOP utilisation.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use meshwork::error::{Error, Result};
use serde::Serialize;

use crate::bench_run::median_of as median;

/// The two sizes of the issue and the book: (name, flags, steps).
const SIZES: [GptSize; 2] = [
    GptSize {
        name: "small",
        d_model: 64,
        layers: 2,
        heads: 4,
        context: 64,
        steps: 300,
    },
    GptSize {
        name: "large",
        d_model: 256,
        layers: 4,
        heads: 8,
        context: 128,
        steps: 40,
    },
];

/// The vocabulary of the embedded text (the FLOP count's head; checked against the child's
/// report line).
fn vocab() -> Result<usize> {
    let corpus =
        meshwork::demo::kjv_corpus().map_err(|e| Error::Data(format!("the embedded text: {e}")))?;
    Ok(corpus.vocab().len())
}

/// One GPT size.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct GptSize {
    name: &'static str,
    d_model: usize,
    layers: usize,
    heads: usize,
    context: usize,
    steps: u64,
}

impl GptSize {
    /// The flags both sides take for this size.
    fn flags(&self, steps: u64) -> Vec<String> {
        [
            ("--steps", steps.to_string()),
            ("--d-model", self.d_model.to_string()),
            ("--layers", self.layers.to_string()),
            ("--heads", self.heads.to_string()),
            ("--context", self.context.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }

    /// Training FLOPs of one window (`context` tokens): `6·N + 12·L·d·T` per token.
    fn flops_per_window(&self, vocab: usize) -> f64 {
        let (l, d, t) = (self.layers as f64, self.d_model as f64, self.context as f64);
        let n = 12.0 * l * d * d + d * vocab as f64;
        (6.0 * n + 12.0 * l * d * t) * t
    }
}

/// What `bench gpt` is asked.
#[derive(Debug, Clone)]
pub(crate) struct GptBench {
    /// Which sizes (`small`, `large`).
    pub(crate) sizes: Vec<String>,
    /// Which data-parallel degrees.
    pub(crate) dps: Vec<u32>,
    /// Steps for every size instead of its own (300 small, 40 large).
    pub(crate) steps: Option<u64>,
    /// Runs per side; the median is reported.
    pub(crate) repeats: usize,
    /// A Python interpreter with `torch`: run the PyTorch side too.
    pub(crate) pytorch: Option<PathBuf>,
}

/// One row: a size at one dp.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct GptRow {
    size: GptSize,
    dp: u32,
    steps: u64,
    /// meshwork's windows (samples) per second over the job.
    meshwork_windows_per_s: f64,
    /// meshwork's validation loss after training (nats/char).
    meshwork_validation_loss: f64,
    /// PyTorch's windows per second (with `--pytorch`).
    pytorch_windows_per_s: Option<f64>,
    /// PyTorch's validation loss after training.
    pytorch_validation_loss: Option<f64>,
    /// meshwork's windows/s over PyTorch's.
    speed_ratio: Option<f64>,
    /// meshwork's validation loss over PyTorch's, minus one (0.01: 1 % higher).
    loss_difference: Option<f64>,
    /// The training FLOP/s meshwork achieved, per core (dp cores).
    achieved_gflops_per_core: f64,
    /// The rate of one core's matrix products at the model's MLP shape.
    matmul_gflops_per_core: f64,
}

/// The figures of one `meshwork train --model gpt` run, read from its report lines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TrainFigures {
    windows_per_s: f64,
    validation_loss: f64,
}

/// Reads the report lines `run_gpt_job` prints: "validation loss B → A nats/char" and
/// "S steps, R samples/s; …".
pub(crate) fn parse_train_report(text: &str) -> Option<TrainFigures> {
    let after = text.lines().find_map(|l| {
        let rest = l.split("validation loss ").nth(1)?;
        let (_, after) = rest.split_once(" → ")?;
        after.split_whitespace().next()?.parse::<f64>().ok()
    })?;
    let rate = text
        .lines()
        .filter(|l| l.contains(" samples/s"))
        .find_map(|l| {
            let (_, rest) = l.split_once(" steps, ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })?;
    Some(TrainFigures {
        windows_per_s: rate,
        validation_loss: after,
    })
}

fn failed(what: impl std::fmt::Display) -> Error {
    Error::Runtime(format!("bench gpt: {what}"))
}

/// One `meshwork train --model gpt` child run.
fn meshwork_once(size: &GptSize, dp: u32, steps: u64) -> Result<TrainFigures> {
    let mut command = Command::new(crate::bench_run::this_binary()?);
    command
        .args(["train", "--model", "gpt", "--dp", &dp.to_string()])
        .args(size.flags(steps));
    let what = format!("bench gpt: meshwork train ({}, dp {dp})", size.name);
    let text = crate::bench_run::stdout_of(command, &what)?;
    parse_train_report(&text).ok_or_else(|| failed(format!("no report lines in: {text}")))
}

/// One PyTorch run of the same size and world.
fn pytorch_once(size: &GptSize, dp: u32, steps: u64, python: &Path) -> Result<TrainFigures> {
    let script = crate::bench_run::peer_script("gpt_ddp.py")?;
    let mut command = Command::new(python);
    command
        .arg(&script)
        .args(["--world", &dp.to_string()])
        .args(size.flags(steps));
    let what = format!("bench gpt: {} {}", python.display(), script.display());
    let line = crate::bench_run::stdout_of(command, &what)?;
    let value: serde_json::Value = serde_json::from_str(line.trim())
        .map_err(|e| failed(format!("not one JSON line ({e}): {line}")))?;
    let get = |k: &str| {
        value[k]
            .as_f64()
            .ok_or_else(|| failed(format!("no {k} in {line}")))
    };
    Ok(TrainFigures {
        windows_per_s: get("windows_per_s")?,
        validation_loss: get("validation_loss_after")?,
    })
}

/// One core's rate of the model's MLP product (`[batch·context, d] × [d, 4d]`, the fused
/// linear on the CPU backend, one thread), GFLOP/s: median of 5 after 2 warm-ups.
fn matmul_gflops(size: &GptSize) -> f64 {
    let device = Device::flex();
    let rows = 16 * size.context;
    let (d, f) = (size.d_model, 4 * size.d_model);
    let x = Tensor::<2>::random([rows, d], Distribution::Default, &device);
    let w = Tensor::<2>::random([d, f], Distribution::Default, &device);
    let flops = 2.0 * (rows * d * f) as f64;
    let mut times = Vec::new();
    for pass in 0..7 {
        let t = Instant::now();
        // Enough products that the clock's resolution does not matter.
        for _ in 0..8 {
            let _ = meshwork::kernels::linear(x.clone(), w.clone(), None).into_data();
        }
        if pass >= 2 {
            times.push(t.elapsed().as_secs_f64() / 8.0);
        }
    }
    flops / median(times).max(1e-12) / 1e9
}

/// Runs every asked size and dp, alternating the sides run by run.
pub(crate) fn run(b: &GptBench) -> Result<Vec<GptRow>> {
    if b.dps.is_empty() || b.dps.contains(&0) || b.repeats == 0 {
        return Err(Error::InvalidConfig(
            "--dp: one or more degrees of at least 1; --repeats at least 1".into(),
        ));
    }
    if b.steps.is_some_and(|s| s <= 3) {
        return Err(Error::InvalidConfig(
            "--steps: more than the PyTorch script's 3 warm-up steps".into(),
        ));
    }
    let sizes: Vec<GptSize> = b
        .sizes
        .iter()
        .map(|name| {
            SIZES
                .iter()
                .find(|s| s.name == name)
                .copied()
                .ok_or_else(|| {
                    Error::InvalidConfig(format!("--sizes: {name:?} is not small or large"))
                })
        })
        .collect::<Result<_>>()?;
    let vocab = vocab()?;
    let mut rows = Vec::new();
    for size in &sizes {
        let rate = matmul_gflops(size);
        for &dp in &b.dps {
            let steps = b.steps.unwrap_or(size.steps);
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..b.repeats {
                ours.push(meshwork_once(size, dp, steps)?);
                if let Some(python) = &b.pytorch {
                    theirs.push(pytorch_once(size, dp, steps, python)?);
                }
            }
            let ours = median_figures(ours);
            let theirs = (!theirs.is_empty()).then(|| median_figures(theirs));
            let achieved = ours.windows_per_s * size.flops_per_window(vocab) / f64::from(dp) / 1e9;
            rows.push(GptRow {
                size: *size,
                dp,
                steps,
                meshwork_windows_per_s: ours.windows_per_s,
                meshwork_validation_loss: ours.validation_loss,
                pytorch_windows_per_s: theirs.map(|t| t.windows_per_s),
                pytorch_validation_loss: theirs.map(|t| t.validation_loss),
                speed_ratio: theirs.map(|t| ours.windows_per_s / t.windows_per_s.max(1e-12)),
                loss_difference: theirs.map(|t| ours.validation_loss / t.validation_loss - 1.0),
                achieved_gflops_per_core: achieved,
                matmul_gflops_per_core: rate,
            });
        }
    }
    Ok(rows)
}

/// The run with the median windows/s (its loss with it).
fn median_figures(mut runs: Vec<TrainFigures>) -> TrainFigures {
    runs.sort_by(|a, b| a.windows_per_s.total_cmp(&b.windows_per_s));
    runs[runs.len() / 2]
}

/// Prints the rows as a table or one JSON line each.
pub(crate) fn print(rows: &[GptRow], json: bool) {
    if json {
        for r in rows {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
        return;
    }
    println!(
        "# the demo GPT end to end (meshwork train --model gpt | benches/peers/gpt_ddp.py, DDP over \
         gloo); windows/s over the job; validation loss after the steps (256 windows); \
         FLOP/s per core = (6·N + 12·L·d·T)·T per window × windows/s / dp; the matmul rate: one \
         core's [16·T, d] × [d, 4d]"
    );
    println!(
        "{:>6} {:>3} {:>6} {:>11} {:>9} {:>11} {:>9} {:>7} {:>7} {:>10} {:>10} {:>6}",
        "size",
        "dp",
        "steps",
        "meshwork/s",
        "loss",
        "pytorch/s",
        "loss",
        "ratio",
        "Δloss",
        "GFLOP/s",
        "matmul",
        "share"
    );
    let or_dash = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    for r in rows {
        println!(
            "{:>6} {:>3} {:>6} {:>11.1} {:>9.4} {:>11} {:>9} {:>7} {:>7} {:>10.2} {:>10.2} {:>5.0}%",
            r.size.name,
            r.dp,
            r.steps,
            r.meshwork_windows_per_s,
            r.meshwork_validation_loss,
            or_dash(r.pytorch_windows_per_s, 1),
            or_dash(r.pytorch_validation_loss, 4),
            or_dash(r.speed_ratio, 2),
            r.loss_difference
                .map_or("-".to_string(), |d| format!("{:+.1}%", 100.0 * d)),
            r.achieved_gflops_per_core,
            r.matmul_gflops_per_core,
            100.0 * r.achieved_gflops_per_core / r.matmul_gflops_per_core.max(1e-12),
        );
    }
    if rows.iter().all(|r| r.pytorch_windows_per_s.is_none()) {
        println!("# PyTorch: not run (--pytorch PYTHON runs benches/peers/gpt_ddp.py)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_lines_of_train_are_read() {
        let text = "meshwork train --model gpt: 2 × 1 × 1 …\n\
                    validation loss before training 4.4190 nats/char; unigram baseline 3.2\n\
                    training loss 4.41 → 2.05; validation loss 4.4190 → 1.9619 nats/char (unigram baseline 3.1: 37.0 % below it)\n\
                    300 steps, 1771 samples/s; time per step: compute 98%, communication 1%, waiting 1%\n";
        assert_eq!(
            parse_train_report(text),
            Some(TrainFigures {
                windows_per_s: 1771.0,
                validation_loss: 1.9619,
            })
        );
        assert_eq!(parse_train_report("no report"), None);
    }

    #[test]
    fn the_flop_count_is_palm_s() {
        let s = SIZES[0];
        // N = 12·2·64² + 64·80; (6N + 12·2·64·64)·64 per window.
        let n = 12.0 * 2.0 * 4096.0 + 64.0 * 80.0;
        let want = (6.0 * n + 12.0 * 2.0 * 64.0 * 64.0) * 64.0;
        assert_eq!(s.flops_per_window(80), want);
    }
}
