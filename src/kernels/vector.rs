//! Element-wise math written so that the compiler vectorises it: `exp` and `erf` as
//! branch-free polynomials (no call into libm per element), and the loops that use them
//! compiled for AVX-512, AVX2 + FMA and the baseline, the best one chosen at run time
//! (`multiversion`).
//!
//! - [`exp`]: Cephes' `expf` (range reduction by `ln 2`, a degree-6 polynomial, the power of two
//!   built from its bits): relative error below 2·10⁻⁷ on `[-87, 88]`; 0 below −87 (where
//!   `expf` is subnormal), `e^88` above 88, NaN for NaN.
//! - [`erf`]: Abramowitz & Stegun 7.1.26 (the form PyTorch's vectorised CPU `erf` uses):
//!   absolute error below 1.5·10⁻⁷ in exact arithmetic, below 5·10⁻⁷ in f32.
//! - GELU is the exact form `x·Φ(x) = x/2·(1 + erf(x/√2))`, as Burn's `gelu`.

use multiversion::multiversion;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `e^x` (see the module's note on its accuracy and range). Branch-free, with fused
/// multiply-adds and integer bit operations only, so that a loop of it vectorises: `n` is
/// rounded by adding and subtracting 1.5·2²³, which leaves it in the low bits of the sum.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    let c = x.clamp(-87.0, 88.0);
    let t = c.mul_add(LOG2E, ROUND);
    let n = t - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, c));
    let mut p = 1.987_569_1e-4f32;
    for coefficient in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = p.mul_add(r, coefficient);
    }
    let e = (p * r).mul_add(r, r) + 1.0;
    // `t`'s low bits hold n (two's complement); 2^n's exponent field is n + 127.
    let k = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let v = e * f32::from_bits(k << 23);
    // 0 below −87 (NaN, failing the comparison, stays NaN).
    let keep = u32::from(x >= -87.0 || x.is_nan()).wrapping_neg();
    f32::from_bits(v.to_bits() & keep)
}

/// `erf(x)` (see the module's note on its accuracy).
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / 0.327_591_1f32.mul_add(a, 1.0);
    let mut poly = 1.061_405_4f32;
    for coefficient in [-1.453_152_1, 1.421_413_8, -0.284_496_74, 0.254_829_6] {
        poly = poly.mul_add(t, coefficient);
    }
    (-(poly * t)).mul_add(exp(-a * a), 1.0).copysign(x)
}

/// `GELU(x) = x·Φ(x)`.
#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `GELU'(x) = Φ(x) + x·φ(x)`.
#[inline(always)]
fn gelu_derivative(x: f32) -> f32 {
    const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
    let cdf = 0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
    cdf + x * FRAC_1_SQRT_2PI * exp(-0.5 * x * x)
}

/// `GELU` of every element.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn gelu_of(x: &[f32]) -> Vec<f32> {
    // Plain loops, not iterator adapters: a closure would be compiled outside this function's
    // target features.
    let mut out = vec![0f32; x.len()];
    for i in 0..x.len() {
        out[i] = gelu(x[i]);
    }
    out
}

/// `grad · GELU'(x)`, element by element.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn gelu_grad(x: &[f32], grad: &[f32]) -> Vec<f32> {
    let n = x.len().min(grad.len());
    let (x, grad) = (&x[..n], &grad[..n]);
    let mut out = vec![0f32; n];
    for i in 0..n {
        out[i] = grad[i] * gelu_derivative(x[i]);
    }
    out
}

/// `row[j] := e^(row[j] − shift)` for every element, returning their sum.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn exp_shifted(row: &mut [f32], shift: f32) -> f32 {
    // Two passes over the (cached) row: the exponentials in a loop the compiler vectorises
    // whole, then sixteen partial sums (one exponential and one sum in the same loop body
    // vectorise poorly).
    for v in row.iter_mut() {
        *v = exp(*v - shift);
    }
    sum(row)
}

/// `Σ v[j]` with sixteen partial sums.
#[inline(always)]
pub(crate) fn sum(v: &[f32]) -> f32 {
    let mut sums = [0f32; 16];
    let mut chunks = v.chunks_exact(16);
    for chunk in &mut chunks {
        for k in 0..16 {
            sums[k] += chunk[k];
        }
    }
    for (k, x) in chunks.remainder().iter().enumerate() {
        sums[k] += x;
    }
    sums.iter().sum()
}

/// The largest element (−∞ for an empty row).
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx2+fma",
    "x86_64+avx2+fma",
    "aarch64+neon"
))]
pub(crate) fn max_of(row: &[f32]) -> f32 {
    let mut maxes = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for (v, m) in chunk.iter().zip(maxes.iter_mut()) {
            *m = m.max(*v);
        }
    }
    for (v, m) in chunks.remainder().iter().zip(maxes.iter_mut()) {
        *m = m.max(*v);
    }
    maxes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// `Σ a[j]·b[j]` with eight partial sums.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut sums = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            sums[k] += x[k] * y[k];
        }
    }
    for (k, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        sums[k] += x * y;
    }
    sums.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn exp_is_within_two_ulps_of_libm(x in -87.0f32..88.0) {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            prop_assert!(((got - want) / want).abs() < 2e-7, "exp({x}) = {got}, want {want}");
        }

        #[test]
        fn erf_is_within_its_stated_bound(x in -6.0f32..6.0) {
            let want = libm::erf(f64::from(x));
            prop_assert!((f64::from(erf(x)) - want).abs() < 5e-7, "erf({x}): {} vs {want}", erf(x));
        }

        #[test]
        fn gelu_and_its_derivative_match_the_exact_forms(x in -8.0f32..8.0) {
            let xd = f64::from(x);
            let cdf = 0.5 * (1.0 + libm::erf(xd / 2f64.sqrt()));
            let pdf = (-0.5 * xd * xd).exp() / (2.0 * std::f64::consts::PI).sqrt();
            prop_assert!((f64::from(gelu(x)) - xd * cdf).abs() < 1e-6 * (1.0 + xd.abs()));
            prop_assert!((f64::from(gelu_derivative(x)) - (cdf + xd * pdf)).abs() < 1e-6);
        }

        #[test]
        fn slices_agree_with_the_scalar_forms(v in proptest::collection::vec(-10.0f32..10.0, 0..70)) {
            let got = gelu_of(&v);
            prop_assert_eq!(got.len(), v.len());
            for (g, x) in got.iter().zip(&v) {
                prop_assert_eq!(g.to_bits(), gelu(*x).to_bits());
            }
            let mut row = v.clone();
            let max = max_of(&row);
            prop_assert_eq!(max, v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
            let sum = exp_shifted(&mut row, max);
            let want: f32 = v.iter().map(|x| exp(x - max)).sum();
            prop_assert!((sum - want).abs() <= 1e-5 * want.max(1.0));
            let d = dot(&v, &row);
            let want: f64 = v.iter().zip(&row).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            prop_assert!((f64::from(d) - want).abs() < 1e-4 * (1.0 + want.abs()));
        }
    }

    #[test]
    fn exp_ends() {
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(-87.5), 0.0);
        assert!(
            (exp(100.0) / 88f32.exp() - 1.0).abs() < 1e-6,
            "e^88 above 88"
        );
        assert!((exp(-86.5) / (-86.5f32).exp() - 1.0).abs() < 1e-5);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }
}
