//! meshwork's fused CPU kernels in a block of your own: causal self-attention written with
//! `meshwork::kernels`, its loss and gradients beside the same block written with Burn's
//! composed operations. On a Flex device the kernels run fused (one pass per block of
//! queries for the attention, one per row for LayerNorm); on any other device, or with
//! `MESHWORK_KERNELS=composed`, they are Burn's operations.
//!
//! Run with `cargo run --example kernels`.

// ANCHOR: block
use burn::tensor::{Device, Distribution, Tensor};
use meshwork::kernels;

/// `x + attention(norm(x))·W_o`, causal, `heads` heads, every step through the kernels.
fn attention_block(x: Tensor<3>, w: &[Tensor<2>; 4], heads: usize) -> Tensor<3> {
    let [b, s, d] = x.dims();
    let (gamma, beta) = (
        Tensor::ones([d], &x.device()),
        Tensor::zeros([d], &x.device()),
    );
    let h = kernels::layer_norm(x.clone(), gamma, beta, kernels::NORM_EPSILON).reshape([b * s, d]);
    // Each projection is one product; the heads are views of it, read in place.
    let split = |t: Tensor<2>| t.reshape([b, s, heads, d / heads]).swap_dims(1, 2);
    let q = split(kernels::linear(h.clone(), w[0].clone(), None));
    let k = split(kernels::linear(h.clone(), w[1].clone(), None));
    let v = split(kernels::linear(h, w[2].clone(), None));
    let context = kernels::causal_attention(q, k, v)
        .swap_dims(1, 2)
        .reshape([b * s, d]);
    x + kernels::linear(context, w[3].clone(), None).reshape([b, s, d])
}
// ANCHOR_END: block

/// The same block from Burn's operations (`kernels::composed_attention` is the reference).
fn composed_block(x: Tensor<3>, w: &[Tensor<2>; 4], heads: usize) -> Tensor<3> {
    let [b, s, d] = x.dims();
    let norm = burn::tensor::module::layer_norm(
        x.clone(),
        Tensor::ones([d], &x.device()),
        Some(Tensor::zeros([d], &x.device())),
        kernels::NORM_EPSILON,
    )
    .reshape([b * s, d]);
    let split = |t: Tensor<2>| t.reshape([b, s, heads, d / heads]).swap_dims(1, 2);
    let q = split(norm.clone().matmul(w[0].clone()));
    let k = split(norm.clone().matmul(w[1].clone()));
    let v = split(norm.matmul(w[2].clone()));
    let context = kernels::composed_attention(q, k, v)
        .swap_dims(1, 2)
        .reshape([b * s, d]);
    x + context.matmul(w[3].clone()).reshape([b, s, d])
}

fn main() {
    let device = Device::default().autodiff();
    device.seed(1);
    let (b, s, d, heads) = (4, 96, 64, 4);
    let x = Tensor::<3>::random([b, s, d], Distribution::Default, &device);
    let w = [0, 1, 2, 3].map(|_| {
        Tensor::<2>::random([d, d], Distribution::Normal(0.0, 0.1), &device).require_grad()
    });
    let loss_and_grad = |block: fn(Tensor<3>, &[Tensor<2>; 4], usize) -> Tensor<3>| {
        let loss = block(x.clone(), &w, heads).powi_scalar(2).mean();
        let grads = loss.backward();
        let grad = w[0].grad(&grads).expect("the query weight's gradient");
        (loss.into_scalar::<f32>(), grad)
    };
    let (fused_loss, fused_grad) = loss_and_grad(attention_block);
    let (loss, grad) = loss_and_grad(composed_block);
    let differs = (fused_grad - grad).abs().max().into_scalar::<f32>();
    println!(
        "fused kernels on this device: {}",
        kernels::fused_on(&device)
    );
    println!(
        "loss {fused_loss:.6} (composed {loss:.6}); largest gradient difference {differs:.2e}"
    );
    assert!((fused_loss - loss).abs() < 1e-5 && differs < 1e-5);
}
