//! LayerNorm over the last dimension in one pass per row forward (statistics, normalise,
//! scale and shift) and one backward pass per row (input gradient) plus the parameters'
//! gradients summed over rows as it goes.
//!
//! Forward, per row of `d` features: `μ = Σx/d`, `σ² = Σ(x − μ)²/d` (biased, as Burn),
//! `r = 1/√(σ² + ε)`, `y = (x − μ)·r·γ + β`. Backward, with `x̂ = (x − μ)·r` and `h = g·γ`:
//! `dx = r·(h − mean(h) − x̂·mean(h·x̂))`, `dγ = Σ_rows g·x̂`, `dβ = Σ_rows g`.

use multiversion::multiversion;

use super::vector::{dot, sum};

/// The forward's output and what the backward needs of it.
#[derive(Debug, Clone)]
pub(crate) struct Normed {
    /// `y`, row-major like `x`.
    pub(crate) y: Vec<f32>,
    /// Each row's mean.
    pub(crate) mean: Vec<f32>,
    /// Each row's `1/√(σ² + ε)`.
    pub(crate) rstd: Vec<f32>,
}

/// The gradients of one backward.
#[derive(Debug, Clone)]
pub(crate) struct NormGrads {
    /// `dL/dx`, row-major like `x`.
    pub(crate) x: Vec<f32>,
    /// `dL/dγ`.
    pub(crate) gamma: Vec<f32>,
    /// `dL/dβ`.
    pub(crate) beta: Vec<f32>,
}

/// LayerNorm of the rows of `x` (`x.len()` a multiple of `gamma.len()`).
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn forward(x: &[f32], gamma: &[f32], beta: &[f32], epsilon: f32) -> Normed {
    let d = gamma.len().max(1);
    let rows = x.len() / d;
    let mut y = vec![0f32; x.len()];
    let mut mean = Vec::with_capacity(rows);
    let mut rstd = Vec::with_capacity(rows);
    for (row, out) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let mu = sum(row) / d as f32;
        for (o, &v) in out.iter_mut().zip(row) {
            *o = v - mu;
        }
        let r = 1.0 / (dot(out, out) / d as f32 + epsilon).sqrt();
        for ((o, &g), &b) in out.iter_mut().zip(gamma).zip(beta) {
            *o = *o * r * g + b;
        }
        mean.push(mu);
        rstd.push(r);
    }
    Normed { y, mean, rstd }
}

/// The gradients of [`forward`] for the output gradient `grad` (row-major like `x`).
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn backward(
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    grad: &[f32],
) -> NormGrads {
    let d = gamma.len().max(1);
    let mut dx = vec![0f32; x.len()];
    let mut dgamma = vec![0f32; gamma.len()];
    let mut dbeta = vec![0f32; gamma.len()];
    let mut xhat = vec![0f32; d];
    let mut h = vec![0f32; d];
    let rows = x
        .chunks_exact(d)
        .zip(grad.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d));
    for (((row, g), out), (&mu, &r)) in rows.zip(mean.iter().zip(rstd)) {
        for j in 0..d {
            xhat[j] = (row[j] - mu) * r;
            h[j] = g[j] * gamma[j];
            dgamma[j] += g[j] * xhat[j];
            dbeta[j] += g[j];
        }
        let mean_h = sum(&h) / d as f32;
        let mean_hx = dot(&h, &xhat) / d as f32;
        for j in 0..d {
            out[j] = r * (h[j] - mean_h - xhat[j] * mean_hx);
        }
    }
    NormGrads {
        x: dx,
        gamma: dgamma,
        beta: dbeta,
    }
}
