//! The mean cross-entropy of logits against target classes, fused with its softmax: one pass
//! per row forward (maximum, `Σ e^{x − max}`, log-sum-exp, the target's logit) keeping only the
//! log-sum-exp, and one pass per row backward writing `(softmax − onehot)·g/n` — the
//! probabilities are never stored.

use multiversion::multiversion;

use super::vector::{exp, exp_shifted, max_of};

/// The forward's mean loss and each row's log-sum-exp.
#[derive(Debug, Clone)]
pub(crate) struct Entropy {
    /// `mean_i (lse_i − x_{i, t_i})`; NaN when a target lies outside the classes.
    pub(crate) loss: f32,
    /// `log Σ_j e^{x_ij}` per row.
    pub(crate) lse: Vec<f32>,
}

/// The target class of row `i`, if it is one of the `classes`.
fn class(targets: &[i64], i: usize, classes: usize) -> Option<usize> {
    usize::try_from(targets[i]).ok().filter(|&t| t < classes)
}

/// Cross-entropy of the rows of `logits` (`targets.len()` rows) against `targets`.
pub(crate) fn forward(logits: &[f32], targets: &[i64]) -> Entropy {
    let n = targets.len();
    let classes = logits.len().checked_div(n).unwrap_or(0);
    let mut scratch = vec![0f32; classes];
    let mut lse = Vec::with_capacity(n);
    let mut total = 0f64;
    for (i, row) in logits.chunks_exact(classes.max(1)).take(n).enumerate() {
        let max = max_of(row);
        scratch.copy_from_slice(row);
        let l = max + exp_shifted(&mut scratch, max).ln();
        lse.push(l);
        total += match class(targets, i, classes) {
            Some(t) => f64::from(l - row[t]),
            None => f64::NAN,
        };
    }
    Entropy {
        loss: (total / n.max(1) as f64) as f32,
        lse,
    }
}

/// `dL/dlogits` of [`forward`] for the loss gradient `grad`.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn backward(logits: &[f32], targets: &[i64], lse: &[f32], grad: f32) -> Vec<f32> {
    let n = targets.len();
    let classes = logits.len().checked_div(n).unwrap_or(0);
    let g = grad / n.max(1) as f32;
    let mut out = vec![0f32; logits.len()];
    let rows = logits
        .chunks_exact(classes.max(1))
        .zip(out.chunks_exact_mut(classes.max(1)));
    for (i, (row, o)) in rows.take(n).enumerate() {
        // An indexed loop: an iterator adapter's closure would compile without this
        // function's target features.
        for j in 0..classes.min(o.len()) {
            o[j] = g * exp(row[j] - lse[i]);
        }
        if let Some(t) = class(targets, i, classes) {
            o[t] -= g;
        }
    }
    out
}
