//! Each fused kernel against Burn's composed operations on the same inputs, forward and
//! gradients, on odd shapes (sequences across the attention's query blocks, features not a
//! multiple of the vector width) and on the strided views the layers pass.

use burn::tensor::{Device, Int, Tensor, TensorData};
use proptest::prelude::*;

use super::*;
use crate::parallel::sampler::SplitMix64;

fn device() -> Device {
    let d = Device::default().autodiff();
    assert!(
        fused_on(&d),
        "the fused kernels run on Flex with autodiff (unset MESHWORK_KERNELS to test them)"
    );
    d
}

/// Values in [-2, 2) drawn from `seed`.
fn draw(n: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    (0..n)
        .map(|_| (g.next() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
        .collect()
}

fn leaf<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let data = TensorData::new(draw(shape.iter().product(), seed), shape);
    Tensor::<D>::from_data(data, device).require_grad()
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32")
}

/// `|a − b| ≤ tol · (1 + max|b|)` element by element.
fn close(what: &str, a: Vec<f32>, b: Vec<f32>, tol: f32) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.len(), b.len(), "{} lengths", what);
    let scale = 1.0 + b.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        prop_assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: fused {x}, composed {y}"
        );
    }
    Ok(())
}

/// `Σ out ∘ w` for a fixed random `w`: every output element gets its own gradient.
fn weigh<const D: usize>(out: Tensor<D>, seed: u64) -> Tensor<1> {
    let w = Tensor::<D>::from_data(
        TensorData::new(draw(out.shape().num_elements(), seed), out.dims()),
        &out.device(),
    );
    (out * w).sum()
}

fn grad<const D: usize>(t: &Tensor<D>, grads: &burn::tensor::Gradients) -> Vec<f32> {
    values(t.grad(grads).expect("a gradient"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn attention_equals_the_composed_form(
        b in 1usize..3, h in 1usize..4, s in 1usize..150, d in 1usize..40,
        layout in 0u8..3, seed in any::<u64>(),
    ) {
        // 0: contiguous; 1: the layer's heads, `[b, s, h, d]` seen through `swap_dims`;
        // 2: a window of a longer sequence (`narrow`: a start offset, row strides of s + 2).
        let dev = device();
        let inputs: Vec<Tensor<4>> = (0..3)
            .map(|i| match layout {
                0 => leaf([b, h, s, d], seed + i, &dev),
                1 => leaf([b, s, h, d], seed + i, &dev),
                _ => leaf([b, h, s + 2, d], seed + i, &dev),
            })
            .collect();
        let heads = |t: &Tensor<4>| match layout {
            0 => t.clone(),
            1 => t.clone().swap_dims(1, 2),
            _ => t.clone().narrow(2, 1, s),
        };
        let run = |f: fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>| {
            let out = f(heads(&inputs[0]), heads(&inputs[1]), heads(&inputs[2]));
            let grads = weigh(out.clone(), seed ^ 7).backward();
            let g: Vec<Vec<f32>> = inputs.iter().map(|t| grad(t, &grads)).collect();
            (values(out), g)
        };
        let (fused_out, fused_grads) = run(causal_attention);
        let (want_out, want_grads) = run(composed_attention);
        close("output", fused_out, want_out, 2e-6)?;
        for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(fused_grads.into_iter().zip(want_grads)) {
            close(name, g, w, 2e-5)?;
        }
    }

    #[test]
    fn layer_norm_equals_burns(
        rows in 1usize..20, d in 4usize..70, mean in -8.0f32..8.0, seed in any::<u64>(),
    ) {
        // Rank 3 as the layers pass it, around a mean away from 0. (Far from 0, or with 2
        // features, where x̂ = ±1 and the true dx is 0, both forms' dx are rounding noise
        // amplified by 1/σ and differ by more than any fixed tolerance.)
        let dev = device();
        let x = (leaf([rows, 2, d], seed, &dev) + mean).detach().require_grad();
        let gamma = leaf([d], seed + 1, &dev);
        let beta = leaf([d], seed + 2, &dev);
        let run = |fused: bool| {
            let out = if fused {
                layer_norm(x.clone(), gamma.clone(), beta.clone(), NORM_EPSILON)
            } else {
                burn::tensor::module::layer_norm(
                    x.clone(), gamma.clone(), Some(beta.clone()), NORM_EPSILON,
                )
            };
            let grads = weigh(out.clone(), seed ^ 3).backward();
            (values(out), grad(&x, &grads), grad(&gamma, &grads), grad(&beta, &grads))
        };
        let (o, dx, dg, db) = run(true);
        let (wo, wdx, wdg, wdb) = run(false);
        close("output", o, wo, 1e-5)?;
        close("dx", dx, wdx, 5e-5)?;
        close("dgamma", dg, wdg, 1e-5)?;
        close("dbeta", db, wdb, 1e-5)?;
    }

    #[test]
    fn gelu_equals_burns(n in 1usize..300, seed in any::<u64>()) {
        let dev = device();
        let x = leaf([n], seed, &dev) * 3.0;
        let x = x.detach().require_grad();
        let run = |f: fn(Tensor<1>) -> Tensor<1>| {
            let out = f(x.clone());
            let grads = weigh(out.clone(), seed ^ 5).backward();
            (values(out), grad(&x, &grads))
        };
        let (o, g) = run(gelu);
        let (wo, wg) = run(burn::tensor::activation::gelu);
        close("output", o, wo, 1e-6)?;
        close("dx", g, wg, 1e-6)?;
    }

    #[test]
    fn linear_equals_burns(
        rows in 1usize..70, d_in in 1usize..40, out in 1usize..50,
        transposed in any::<bool>(), with_bias in any::<bool>(), seed in any::<u64>(),
    ) {
        let dev = device();
        // A transposed input is read where it lies (a strided view).
        let x = if transposed { leaf([d_in, rows], seed, &dev) } else { leaf([rows, d_in], seed, &dev) };
        let w = leaf([d_in, out], seed + 1, &dev);
        let b = leaf([out], seed + 2, &dev);
        let run = |f: fn(Tensor<2>, Tensor<2>, Option<Tensor<1>>) -> Tensor<2>| {
            let input = if transposed { x.clone().transpose() } else { x.clone() };
            let out = f(input, w.clone(), with_bias.then(|| b.clone()));
            let grads = weigh(out.clone(), seed ^ 13).backward();
            let db = if with_bias { grad(&b, &grads) } else { Vec::new() };
            (values(out), grad(&x, &grads), grad(&w, &grads), db)
        };
        let (o, dx, dw, db) = run(linear);
        let (wo, wdx, wdw, wdb) = run(burn::tensor::module::linear);
        close("output", o, wo, 1e-6)?;
        close("dx", dx, wdx, 1e-6)?;
        close("dw", dw, wdw, 1e-6)?;
        close("db", db, wdb, 1e-6)?;
    }

    #[test]
    fn cross_entropy_equals_the_composed_form(
        n in 1usize..50, classes in 1usize..90, seed in any::<u64>(),
    ) {
        let dev = device();
        let logits = (leaf([n, classes], seed, &dev) * 10.0).detach().require_grad();
        let mut g = SplitMix64::new(seed ^ 11);
        let targets: Vec<i64> = (0..n).map(|_| (g.next() % classes as u64) as i64).collect();
        let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), &dev);
        let run = |f: fn(Tensor<2>, Tensor<1, Int>) -> Tensor<1>| {
            let loss = f(logits.clone(), targets.clone());
            let grads = (loss.clone() * 3.0).sum().backward();
            (values(loss), grad(&logits, &grads))
        };
        let (l, d) = run(cross_entropy);
        let (wl, wd) = run(composed_cross_entropy);
        close("loss", l, wl, 1e-6)?;
        close("dlogits", d, wd, 1e-6)?;
    }
}

/// Without autodiff the same kernels compute the forward.
#[test]
fn the_forward_runs_without_autodiff() {
    let dev = Device::default();
    assert!(fused_on(&dev));
    let q = Tensor::<4>::from_data(
        TensorData::new(draw(2 * 3 * 70 * 5, 1), [2, 3, 70, 5]),
        &dev,
    );
    let fused = values(causal_attention(q.clone(), q.clone(), q.clone()));
    let composed = values(composed_attention(q.clone(), q.clone(), q));
    close("attention", fused, composed, 2e-6).expect("equal");
    let t = |shape: [usize; 2], seed| {
        Tensor::<2>::from_data(
            TensorData::new(draw(shape[0] * shape[1], seed), shape),
            &dev,
        )
    };
    let (x, w) = (t([7, 9], 2), t([9, 5], 3));
    let (gamma, beta) = (t([1, 9], 4).reshape([9]), t([1, 9], 5).reshape([9]));
    let b = t([1, 5], 6).reshape([5]);
    let pairs = [
        (
            "linear",
            linear(x.clone(), w.clone(), Some(b.clone())),
            burn::tensor::module::linear(x.clone(), w, Some(b)),
        ),
        (
            "layer_norm",
            layer_norm(x.clone(), gamma.clone(), beta.clone(), NORM_EPSILON),
            burn::tensor::module::layer_norm(x.clone(), gamma, Some(beta), NORM_EPSILON),
        ),
        (
            "gelu",
            gelu(x.clone()),
            burn::tensor::activation::gelu(x.clone()),
        ),
    ];
    for (what, fused, composed) in pairs {
        close(what, values(fused), values(composed), 1e-5).expect("equal");
    }
    let targets =
        Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 8, 3, 1, 4, 4, 2], [7]), &dev);
    let fused = values(cross_entropy(x.clone(), targets.clone()));
    close(
        "cross_entropy",
        fused,
        values(composed_cross_entropy(x, targets)),
        1e-6,
    )
    .expect("equal");
}

/// Inputs whose shapes do not fit take the composed path, which refuses them as Burn does,
/// instead of the fused kernel reading the buffers with the wrong sizes.
#[test]
#[should_panic]
fn mismatched_shapes_are_not_fused() {
    let dev = device();
    let logits = leaf([4, 6], 1, &dev);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 1, 2], [3]), &dev);
    let _ = values(cross_entropy(logits, targets));
}

/// A target outside the classes makes the loss NaN (the job's non-finite policy sees it),
/// never a panic or an out-of-bounds read.
#[test]
fn a_target_outside_the_classes_is_nan() {
    let dev = device();
    let logits = leaf([2, 3], 9, &dev);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64, 7], [2]), &dev);
    let loss = values(cross_entropy(logits.clone(), targets.clone()));
    assert!(loss[0].is_nan(), "{loss:?}");
    let grads = cross_entropy(logits.clone(), targets).backward();
    assert!(grad(&logits, &grads).iter().all(|g| g.is_finite()));
}
