//! Fused CPU kernels for the transformer operations Burn composes from many passes over memory
//! (attention, LayerNorm, GELU, softmax cross-entropy), each with its backward, used by the
//! tensor-parallel layer family ([`crate::parallel::tensor::layers`], so by the demo GPT and
//! any model built from those layers).
//!
//! Each function here computes with the fused kernel on a Flex device (with or without
//! autodiff) for f32 tensors, and with Burn's composed operations everywhere else (other
//! backends, other dtypes, or `MESHWORK_KERNELS=composed` in the environment): the composed
//! form is the reference the kernels are tested against (forward and gradients) and the path
//! on GPUs. The kernels are a Burn backend extension (`kernels::extension`); what they compute
//! and how is said in each kernel's module: `attention`, `norm`, `linear`, `entropy`,
//! `vector`.
//!
//! | function | fused | composed (reference) |
//! |---|---|---|
//! | [`causal_attention`] | one pass per block of 64 queries, no `seq × seq` tensor; backward recomputes the probabilities | `softmax(mask(QKᵀ/√d))·V` |
//! | [`layer_norm`] | one pass per row forward and backward | Burn's `layer_norm` |
//! | [`gelu`] | vectorised `erf` (A&S 7.1.26) | Burn's `gelu` (libm `erf`) |
//! | [`linear`] | one `gemm` per product into a buffer allocated once, bias rows first | Burn's `linear` |
//! | [`cross_entropy`] | one pass per row, probabilities never stored | `log Σ e^x − x_t` |

pub(crate) mod products;

#[cfg(feature = "flex")]
mod attention;
#[cfg(feature = "flex")]
mod entropy;
#[cfg(feature = "flex")]
mod extension;
#[cfg(feature = "flex")]
mod linear;
#[cfg(feature = "flex")]
mod norm;
#[cfg(feature = "flex")]
mod vector;

#[cfg(all(test, feature = "flex"))]
mod tests;

use std::sync::OnceLock;

#[cfg(feature = "flex")]
use burn::backend::Dispatch;
use burn::backend::DispatchDevice;
#[cfg(feature = "flex")]
use burn::tensor::DType;
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Device, Int, Tensor};

#[cfg(feature = "flex")]
use extension::FusedKernels;

/// The LayerNorm ε of the layer family (Burn's default), which [`layer_norm`] is given.
pub const NORM_EPSILON: f64 = 1e-5;

/// Whether the fused kernels compute on `device`: a Flex device, with or without autodiff,
/// unless the environment sets `MESHWORK_KERNELS=composed` (read once per process).
pub fn fused_on(device: &Device) -> bool {
    static COMPOSED: OnceLock<bool> = OnceLock::new();
    let composed = *COMPOSED.get_or_init(|| {
        std::env::var("MESHWORK_KERNELS").is_ok_and(|v| v.eq_ignore_ascii_case("composed"))
    });
    !composed && on_flex(device.as_dispatch())
}

fn on_flex(device: &DispatchDevice) -> bool {
    match device {
        #[cfg(feature = "flex")]
        DispatchDevice::Flex(_) => true,
        DispatchDevice::Autodiff(inner) => on_flex(inner),
        #[allow(unreachable_patterns)]
        _ => false,
    }
}

/// Whether `tensors` (all f32) compute with the fused kernels.
#[cfg(feature = "flex")]
fn fused<const D: usize>(tensors: &[&Tensor<D>]) -> bool {
    tensors.iter().all(|t| t.dtype() == DType::F32)
        && tensors.first().is_some_and(|t| fused_on(&t.device()))
}

/// `GELU(x) = x·Φ(x)` (exact, erf form) of every element.
pub fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if fused(&[&x]) {
        return Tensor::from_dispatch(<Dispatch as FusedKernels>::fused_gelu(x.into_dispatch()));
    }
    burn::tensor::activation::gelu(x)
}

/// LayerNorm of `x` over its last dimension: `(x − μ)/√(σ² + ε)·γ + β`, `σ²` biased, as
/// Burn's `LayerNorm`.
pub fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
) -> Tensor<D> {
    #[cfg(feature = "flex")]
    if fused(&[&x])
        && fused(&[&gamma, &beta])
        && gamma.dims() == [x.dims()[D - 1]]
        && beta.dims() == gamma.dims()
    {
        return Tensor::from_dispatch(<Dispatch as FusedKernels>::fused_layer_norm(
            x.into_dispatch(),
            gamma.into_dispatch(),
            beta.into_dispatch(),
            epsilon,
        ));
    }
    burn::tensor::module::layer_norm(x, gamma, Some(beta), epsilon)
}

/// Causal scaled dot-product attention `softmax(QKᵀ/√d)·V` of `q`, `k`, `v`
/// `[batch, heads, seq, dim]` (query `i` attends to keys `j ≤ i`).
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    #[cfg(feature = "flex")]
    if fused(&[&q, &k, &v]) && q.dims() == k.dims() && q.dims() == v.dims() {
        return Tensor::from_dispatch(<Dispatch as FusedKernels>::fused_causal_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
        ));
    }
    composed_attention(q, k, v)
}

/// [`causal_attention`] from Burn's operations: the scores, a causal mask, a softmax.
pub fn composed_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>) -> Tensor<4> {
    let [b, h, s, d] = q.dims();
    let scores = q.matmul(k.swap_dims(2, 3)) / (d.max(1) as f32).sqrt();
    let mask: Tensor<4, Bool> = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device())
        .reshape([1, 1, s, s])
        .expand([b, h, s, s]);
    softmax(scores.mask_fill(mask, -1.0e9), 3).matmul(v)
}

/// `x·W + b` for `x` `[rows, in]`, `W` `[in, out]` and `b` `[out]` (none: zero).
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    #[cfg(feature = "flex")]
    if x.dims()[1] == weight.dims()[0]
        && fused(&[&x, &weight])
        && bias
            .as_ref()
            .is_none_or(|b| b.dims() == [weight.dims()[1]] && fused(&[b]))
    {
        let bias = bias.unwrap_or_else(|| Tensor::zeros([weight.dims()[1]], &weight.device()));
        return Tensor::from_dispatch(<Dispatch as FusedKernels>::fused_linear(
            x.into_dispatch(),
            weight.into_dispatch(),
            bias.into_dispatch(),
        ));
    }
    burn::tensor::module::linear(x, weight, bias)
}

/// The mean cross-entropy `[1]` of `logits` `[n, classes]` against `targets` `[n]`.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    #[cfg(feature = "flex")]
    if fused(&[&logits]) && logits.dims()[0] > 0 && targets.dims() == [logits.dims()[0]] {
        return Tensor::from_dispatch(<Dispatch as FusedKernels>::fused_cross_entropy(
            logits.into_dispatch(),
            targets.into_dispatch(),
        ));
    }
    composed_cross_entropy(logits, targets)
}

/// [`cross_entropy`] from Burn's operations: `mean(log Σ e^{x − max} − (x_t − max))`.
pub fn composed_cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let max = logits.clone().max_dim(1).detach();
    let shifted = logits - max;
    let sum_exp = shifted.clone().exp().sum_dim(1);
    let picked = shifted.gather(1, targets.unsqueeze_dim::<2>(1));
    (sum_exp.log() - picked).mean()
}
