//! `meshwork bench optimizer`: the time of one optimizer step per parameter — Burn's optimizer
//! on a Burn model, and meshwork's flat update rule (`FlatRule`, what ZeRO and the plain
//! data-parallel step run) on the same number of `f32` values — against a memcpy that moves
//! the same bytes the rule reads and writes. A memory-bound step cannot beat that memcpy.
//!
//! Bytes touched per parameter (read + written, `f32`): SGD 12 (parameter and gradient in,
//! parameter out), SGD with momentum 20 (+ the velocity in and out), Adam and AdamW 28 (+ two
//! moments in and out).

use std::time::Instant;

use burn::module::Module;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use meshwork::demo::Mlp;
use meshwork::error::Result;
use meshwork::optim::OptimizerConfig;
use meshwork::parallel::zero::{FlatRule, FlatState};
use serde::Serialize;

use crate::bench_run::median_of as median;

/// What `bench optimizer` is asked.
#[derive(Debug, Clone)]
pub(crate) struct OptimizerBench {
    /// Width of the MLP's square layers (4 of them: about 4·width² parameters).
    pub(crate) width: usize,
    /// Timed steps of each side (after two warm-up steps); the median is kept.
    pub(crate) steps: usize,
}

/// One rule's figures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RuleFigures {
    rule: &'static str,
    parameters: usize,
    bytes_per_parameter: usize,
    /// Burn's optimizer step, ns per parameter.
    burn_ns: f64,
    /// The flat rule's step, ns per parameter.
    flat_ns: f64,
    /// A memcpy of the same bytes, ns per parameter.
    memcpy_ns: f64,
    /// `flat_ns / memcpy_ns` (the target: at most 1.5).
    flat_over_memcpy: f64,
    /// `burn_ns / flat_ns`.
    burn_over_flat: f64,
}

fn rules() -> Vec<(&'static str, OptimizerConfig, usize)> {
    use burn::optim::momentum::MomentumConfig;
    vec![
        ("sgd", SgdConfig::new().into(), 12),
        (
            "sgd+momentum",
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                .into(),
            20,
        ),
        ("adam", AdamConfig::new().into(), 28),
        ("adamw", AdamWConfig::new().into(), 28),
    ]
}

/// Seconds of Burn's optimizer step on the MLP (median of `steps` after two warm-up steps).
fn burn_step(b: &OptimizerBench, config: &OptimizerConfig) -> (f64, usize) {
    let device = Device::flex();
    let ad = device.clone().autodiff();
    device.seed(1);
    let w = b.width;
    let mut model = Mlp::new(&[w, w, w, w, w], &device).fork(&ad).train();
    let params = model.num_params();
    let x = Tensor::<2>::random([8, w], Distribution::Default, &ad);
    let mut optim = config.init();
    let mut times = Vec::new();
    for step in 0..b.steps + 2 {
        let grads = GradientsParams::from_grads(model.forward(x.clone()).sum().backward(), &model);
        let t = Instant::now();
        model = optim.step(1e-6, model, grads);
        // The step is lazy nowhere on flex; read one value to be sure it ran.
        let _ = model.num_params();
        if step >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    (median(times), params)
}

/// Seconds of the flat rule over `n` values (median of `steps` after two warm-up steps).
fn flat_step(b: &OptimizerBench, rule: &FlatRule, n: usize) -> f64 {
    let mut params: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 1e-3).collect();
    let grads: Vec<f32> = (0..n).map(|i| (i % 89) as f32 * 1e-4 - 4e-3).collect();
    let mut state = FlatState::default();
    let segments = [(0..n, 1e-6)];
    let mut times = Vec::new();
    for step in 0..b.steps + 2 {
        let t = Instant::now();
        rule.step(&mut state, &mut params, &grads, &segments);
        if step >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box(&params);
    median(times)
}

/// Seconds of a memcpy moving `bytes` bytes in all (half read, half written).
fn memcpy(b: &OptimizerBench, bytes: usize) -> f64 {
    let words = bytes / 8;
    let src = vec![1.0f32; words];
    let mut dst = vec![0.0f32; words];
    let mut times = Vec::new();
    for step in 0..b.steps + 2 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        if step >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
    }
    median(times)
}

/// Every rule, measured.
pub(crate) fn run(b: &OptimizerBench) -> Result<Vec<RuleFigures>> {
    let mut out = Vec::new();
    for (name, config, bytes) in rules() {
        let rule = FlatRule::of(&config).map_err(|e| {
            meshwork::error::Error::InvalidConfig(format!("bench optimizer, {name}: {e}"))
        })?;
        let (burn_s, n) = burn_step(b, &config);
        let flat_s = flat_step(b, &rule, n);
        let copy_s = memcpy(b, bytes * n);
        let per = |s: f64| s * 1e9 / n as f64;
        out.push(RuleFigures {
            rule: name,
            parameters: n,
            bytes_per_parameter: bytes,
            burn_ns: per(burn_s),
            flat_ns: per(flat_s),
            memcpy_ns: per(copy_s),
            flat_over_memcpy: flat_s / copy_s.max(1e-12),
            burn_over_flat: burn_s / flat_s.max(1e-12),
        });
    }
    Ok(out)
}

/// Print the figures as a table or JSON lines.
pub(crate) fn print(figures: &[RuleFigures], json: bool) {
    if json {
        for f in figures {
            println!("{}", serde_json::to_string(f).unwrap_or_default());
        }
        return;
    }
    if let Some(f) = figures.first() {
        println!(
            "optimizer step per parameter ({} parameters, one thread, median of the timed steps)",
            f.parameters
        );
    }
    println!(
        "{:<13} {:>6} {:>9} {:>9} {:>10} {:>12} {:>11}",
        "rule", "bytes", "burn ns", "flat ns", "memcpy ns", "flat/memcpy", "burn/flat"
    );
    for f in figures {
        println!(
            "{:<13} {:>6} {:>9.2} {:>9.2} {:>10.2} {:>12.2} {:>11.2}",
            f.rule,
            f.bytes_per_parameter,
            f.burn_ns,
            f.flat_ns,
            f.memcpy_ns,
            f.flat_over_memcpy,
            f.burn_over_flat
        );
    }
}
