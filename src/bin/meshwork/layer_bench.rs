//! `meshwork bench layer`: one GPT transformer layer on one device — the layer `bench tensor`
//! trains at tp 1 — measured four ways in one run, so that the figures are ratios:
//!
//! - **job**: the layer trained by a meshwork block job (one device, SGD);
//! - **Burn loop**: the same layer, the same initial parameters and items, trained by a plain
//!   Burn loop (autodiff, `GradientsParams`, Burn's SGD) with no meshwork runtime;
//! - **matmul bound**: the layer's matrix products alone — forward, and the two products of
//!   each one's backward — timed on the backend with no autodiff: no layer on this backend can
//!   train faster than `batch / Σ product times`;
//! - **PyTorch** (`--pytorch PYTHON`): `benches/peers/gpt_layer.py`, the same layer on one
//!   thread, run by that interpreter between meshwork's runs.
//!
//! Run under `taskset -c 0` for figures per core: meshwork's device is one thread, and
//! PyTorch is asked for one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::nn::LayerNorm;
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use meshwork::error::{Error, Result};
use meshwork::parallel::memory::{minor_page_faults, minor_page_faults_since};
use meshwork::parallel::tensor::TensorParallel;
use meshwork::parallel::tensor::layers::{ParallelMlp, ParallelSelfAttention};
use serde::Serialize;

use crate::bench_run::median_of as median;
use crate::tensor_bench::TensorBench;

/// What `bench layer` is asked.
#[derive(Debug, Clone)]
pub(crate) struct LayerBench {
    /// The layer and the runs, as `bench tensor` takes them (at tp 1).
    pub(crate) layer: TensorBench,
    /// A Python interpreter with `torch`: run the PyTorch side too.
    pub(crate) pytorch: Option<PathBuf>,
}

/// What `bench layer` measures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LayerFigures {
    hidden: usize,
    heads: usize,
    seq: usize,
    batch: usize,
    repeats: usize,
    /// The layer trained by a meshwork job.
    job_samples_per_s: f64,
    /// The same layer in a plain Burn loop.
    burn_loop_samples_per_s: f64,
    /// `batch / Σ` the layer's matrix products' times on the backend (forward and backward).
    matmul_bound_samples_per_s: f64,
    /// The backend's matrix products' rate over the layer's shapes.
    matmul_gflops: f64,
    /// The job's samples/s over the bound.
    job_over_bound: f64,
    /// The job's samples/s over the Burn loop's.
    job_over_burn_loop: f64,
    /// The process's minor page faults per timed step of the job (fresh pages the kernel
    /// zeroed; Linux only).
    job_page_faults_per_step: Option<f64>,
    /// The same for the plain Burn loop.
    burn_loop_page_faults_per_step: Option<f64>,
    /// PyTorch's samples/s on one thread (with `--pytorch`).
    pytorch_samples_per_s: Option<f64>,
    /// The job's samples/s over PyTorch's.
    job_over_pytorch: Option<f64>,
    /// The bound over PyTorch's samples/s: above 1, the backend's products allow PyTorch's
    /// speed.
    bound_over_pytorch: Option<f64>,
}

/// The layer as one module for the plain loop: the same blocks as the job's, drawn in the
/// same order from the same seed.
#[derive(Module, Debug)]
struct Layer {
    norm: LayerNorm,
    attention: ParallelSelfAttention,
    mlp: ParallelMlp,
}

impl Layer {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let one = TensorParallel::single();
        self.mlp
            .forward(self.attention.forward(self.norm.forward(x), &one), &one)
    }
}

/// The plain loop's samples/s and page faults per timed step.
fn burn_loop(b: &LayerBench) -> (f64, Option<f64>) {
    let device = Device::flex();
    let (norm, attention, mlp) = crate::tensor_bench::layer_modules(&b.layer, &device);
    let ad = device.clone().autodiff();
    let mut model = Layer {
        norm,
        attention,
        mlp,
    }
    .fork(&ad)
    .train();
    let mut optim = SgdConfig::new().init();
    let (inputs, targets) = crate::tensor_bench::batch_tensors(&b.layer, &ad);
    let warmup = b.layer.warmup();
    let mut timed = 0.0;
    let mut faults_before = None;
    for step in 0..b.layer.steps {
        if step == warmup {
            faults_before = minor_page_faults();
        }
        let t = Instant::now();
        let error = model.forward(inputs.clone()) - targets.clone();
        let loss = (error.clone() * error).mean();
        let _: f32 = loss.clone().into_scalar();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.01, model, grads);
        if step >= warmup {
            timed += t.elapsed().as_secs_f64();
        }
    }
    let timed_steps = b.layer.steps - warmup;
    let faults =
        minor_page_faults_since(faults_before).map(|f| f as f64 / timed_steps.max(1) as f64);
    (
        (b.layer.batch as u64 * timed_steps) as f64 / timed.max(1e-12),
        faults,
    )
}

/// The layer's matrix products as `(batch, m, k, n)`: each linear layer's forward
/// `[t, in]·[in, out]`, input gradient `[t, out]·[out, in]` and weight gradient
/// `[in, t]·[t, out]` (`t` tokens); the attention's scores and context per head, forward and
/// the two products of each one's backward.
fn products(b: &LayerBench) -> Vec<(usize, usize, usize, usize)> {
    let (t, h, s) = (b.layer.batch * b.layer.seq, b.layer.hidden, b.layer.seq);
    let (bh, d) = (
        b.layer.batch * b.layer.heads,
        b.layer.hidden / b.layer.heads.max(1),
    );
    let mut out = Vec::new();
    for (i, o) in [(h, h), (h, h), (h, h), (h, h), (h, 4 * h), (4 * h, h)] {
        out.extend([(1, t, i, o), (1, t, o, i), (1, i, t, o)]);
    }
    // scores = q·kᵀ [s, d]·[d, s]: backward dq = g·k [s, s]·[s, d], dk = gᵀ·q [s, s]·[s, d].
    out.extend([(bh, s, d, s), (bh, s, s, d), (bh, s, s, d)]);
    // context = w·v [s, s]·[s, d]: backward dw = g·vᵀ [s, d]·[d, s], dv = wᵀ·g [s, s]·[s, d].
    out.extend([(bh, s, s, d), (bh, s, d, s), (bh, s, s, d)]);
    out
}

/// Seconds of one pass over the layer's products (the median of `repeats + 2` passes, the
/// first two not counted) and the products' floating-point operations.
fn matmul_pass(b: &LayerBench) -> (f64, f64) {
    let device = Device::flex();
    let shapes = products(b);
    let operands: Vec<(Tensor<3>, Tensor<3>)> = shapes
        .iter()
        .map(|&(n, m, k, p)| {
            (
                Tensor::random([n, m, k], Distribution::Default, &device),
                Tensor::random([n, k, p], Distribution::Default, &device),
            )
        })
        .collect();
    let flops: f64 = shapes
        .iter()
        .map(|&(n, m, k, p)| 2.0 * (n * m * k * p) as f64)
        .sum();
    let mut times = Vec::new();
    for pass in 0..b.layer.repeats + 2 {
        let t = Instant::now();
        for (x, w) in &operands {
            let _ = x.clone().matmul(w.clone()).into_data();
        }
        if pass >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    (median(times), flops)
}

/// One PyTorch run of the same layer on one thread.
fn pytorch_once(b: &LayerBench, python: &Path) -> Result<f64> {
    let script = crate::bench_run::peer_script("gpt_layer.py")?;
    let out = Command::new(python)
        .arg(&script)
        .args(["--threads", "1", "--repeats", "1"])
        .args([
            "--hidden",
            &b.layer.hidden.to_string(),
            "--heads",
            &b.layer.heads.to_string(),
        ])
        .args([
            "--seq",
            &b.layer.seq.to_string(),
            "--batch",
            &b.layer.batch.to_string(),
        ])
        .args(["--steps", &(b.layer.steps - b.layer.warmup()).to_string()])
        .output()
        .map_err(|e| Error::Io {
            path: python.display().to_string(),
            reason: e.to_string(),
        })?;
    let failed = |why: String| Error::Runtime(format!("--pytorch {}: {why}", python.display()));
    if !out.status.success() {
        return Err(failed(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let value: serde_json::Value = serde_json::from_str(line.trim())
        .map_err(|e| failed(format!("not one JSON line ({e}): {line}")))?;
    value["samples_per_s"]
        .as_f64()
        .ok_or_else(|| failed(format!("no samples_per_s in {line}")))
}

/// Run every side, alternated, and measure.
pub(crate) fn run(b: &LayerBench) -> Result<LayerFigures> {
    b.layer.check()?;
    let (mut job, mut plain, mut torch) = (Vec::new(), Vec::new(), Vec::new());
    let (mut job_faults, mut plain_faults) = (Vec::new(), Vec::new());
    for _ in 0..b.layer.repeats {
        let run = crate::tensor_bench::run_once(&b.layer, 1)?;
        job.push(run.samples_per_s);
        job_faults.extend(run.faults_per_step);
        let (samples_per_s, faults) = burn_loop(b);
        plain.push(samples_per_s);
        plain_faults.extend(faults);
        if let Some(python) = &b.pytorch {
            torch.push(pytorch_once(b, python)?);
        }
    }
    let (pass_s, flops) = matmul_pass(b);
    let job = median(job);
    let bound = b.layer.batch as f64 / pass_s.max(1e-12);
    let pytorch = (!torch.is_empty()).then(|| median(torch));
    Ok(LayerFigures {
        hidden: b.layer.hidden,
        heads: b.layer.heads,
        seq: b.layer.seq,
        batch: b.layer.batch,
        repeats: b.layer.repeats,
        job_samples_per_s: job,
        burn_loop_samples_per_s: median(plain.clone()),
        matmul_bound_samples_per_s: bound,
        matmul_gflops: flops / pass_s.max(1e-12) / 1e9,
        job_over_bound: job / bound,
        job_over_burn_loop: job / median(plain),
        job_page_faults_per_step: (!job_faults.is_empty()).then(|| median(job_faults)),
        burn_loop_page_faults_per_step: (!plain_faults.is_empty()).then(|| median(plain_faults)),
        pytorch_samples_per_s: pytorch,
        job_over_pytorch: pytorch.map(|p| job / p),
        bound_over_pytorch: pytorch.map(|p| bound / p),
    })
}

/// Print the figures as text or one JSON line.
pub(crate) fn print(f: &LayerFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
        return;
    }
    println!(
        "one GPT layer (hidden {}, {} heads, seq {}, batch {}, MLP 4×hidden, SGD) on one device, median of {} alternated runs",
        f.hidden, f.heads, f.seq, f.batch, f.repeats
    );
    println!(
        "  samples/s: meshwork job {:.2}, plain Burn loop {:.2} (job/loop {:.2}×)",
        f.job_samples_per_s, f.burn_loop_samples_per_s, f.job_over_burn_loop
    );
    if let (Some(job), Some(plain)) = (f.job_page_faults_per_step, f.burn_loop_page_faults_per_step)
    {
        println!(
            "  page faults per step (fresh pages the kernel zeroed): meshwork job {job:.0}, plain Burn loop {plain:.0}"
        );
    }
    println!(
        "  the backend's matrix products alone allow {:.2} samples/s ({:.1} GFLOP/s): the job reaches {:.2}× that bound",
        f.matmul_bound_samples_per_s, f.matmul_gflops, f.job_over_bound
    );
    match (
        f.pytorch_samples_per_s,
        f.job_over_pytorch,
        f.bound_over_pytorch,
    ) {
        (Some(p), Some(r), Some(bound)) => println!(
            "  PyTorch on one thread: {p:.2} samples/s: meshwork {r:.2}× PyTorch; the matmul bound is {bound:.2}× PyTorch"
        ),
        _ => println!("  PyTorch: not run (--pytorch PYTHON runs benches/peers/gpt_layer.py)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_products_cover_the_layers_flops() {
        let b = LayerBench {
            layer: TensorBench {
                tp: 1,
                hidden: 64,
                heads: 4,
                seq: 8,
                batch: 2,
                steps: 3,
                repeats: 1,
                svg: None,
            },
            pytorch: None,
        };
        let flops: usize = products(&b)
            .iter()
            .map(|&(n, m, k, p)| 2 * n * m * k * p)
            .sum();
        let (t, h) = (16, 64);
        // Six training flops per weight per token (12 h² weights), and the attention's two
        // products of 2·s²·h each, three times over (forward, two in the backward).
        let attention = 3 * 2 * (2 * b.layer.batch * b.layer.seq * b.layer.seq * h);
        assert_eq!(flops, 6 * 12 * h * h * t + attention);
    }
}
