//! The fused kernels as a Burn backend extension: implemented on `Flex` (the forward) and on
//! `Autodiff<Flex>` (the forward plus a hand-written backward step), reached through Burn's
//! `Dispatch` from [`super`]'s tensor functions, which call them only on a Flex device and f32.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Flex, backend_extension};
use burn::tensor::{Shape, TensorData};

use super::attention::{self, Heads};
use super::products::View;
use super::{entropy, linear, norm, vector};

/// The fused operations (see the module [`super`] for each one's semantics).
#[backend_extension(Flex, Autodiff)]
pub(crate) trait FusedKernels: burn::backend::Backend {
    /// `GELU(x)`, exact (erf) form.
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// LayerNorm of `x` over its last dimension, scaled by `gamma` and shifted by `beta`.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;
    /// Causal `softmax(QKᵀ/√d)·V` of `[batch, heads, seq, dim]` tensors.
    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// `x·W + b` for `x` `[rows, in]`, `W` `[in, out]`, `b` `[out]`.
    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
    /// The mean cross-entropy `[1]` of `logits` `[n, classes]` against `targets` `[n]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `t` with its elements contiguous from its start.
fn dense(t: FlexTensor) -> FlexTensor {
    if t.as_slice::<f32>().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

/// The f32 elements of a dense tensor (the callers made it so with [`dense`]).
fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("the fused kernels run on dense f32 tensors (checked by their callers)")
}

/// A tensor of `shape` holding `values`, row-major.
fn tensor(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `t` seen as [`Heads`] without a copy where its last dimension is contiguous and its
/// strides are not negative (a copy otherwise).
fn heads(t: FlexTensor) -> (FlexTensor, Heads) {
    let layout = t.layout();
    let dims = layout.shape().clone();
    let strides = layout.strides();
    let usable = dims.num_dims() == 4 && strides[3] == 1 && strides.iter().all(|&s| s >= 0);
    let t = if usable { t } else { t.to_contiguous() };
    let layout = t.layout();
    let s = layout.strides();
    let heads = Heads {
        shape: [dims[0], dims[1], dims[2], dims[3]],
        strides: [s[0] as usize, s[1] as usize, s[2] as usize],
        offset: layout.start_offset(),
    };
    (t, heads)
}

/// `t` (2-D) seen as a [`View`] without a copy where its strides are not negative (a copy
/// otherwise).
fn matrix(t: FlexTensor) -> (FlexTensor, View) {
    let layout = t.layout();
    let usable = layout.shape().num_dims() == 2 && layout.strides().iter().all(|&s| s >= 0);
    let t = if usable { t } else { t.to_contiguous() };
    let layout = t.layout();
    let (dims, s) = (layout.shape(), layout.strides());
    let view = View {
        offset: layout.start_offset(),
        rows: dims[0],
        cols: dims[1],
        rs: s[0] as usize,
        cs: s[1] as usize,
    };
    (t, view)
}

fn affine(x: FlexTensor, w: FlexTensor, b: FlexTensor) -> FlexTensor {
    let ((x, xv), (w, wv), b) = (matrix(x), matrix(w), dense(b));
    let y = linear::forward((x.storage(), xv), (w.storage(), wv), values(&b));
    tensor(y, Shape::from([xv.rows, wv.cols]))
}

/// A `[batch, heads, seq, dim]` tensor over a buffer laid out as [`Heads::packed`].
fn packed(values: Vec<f32>, shape: [usize; 4]) -> FlexTensor {
    let strides = Heads::packed_strides(shape).map(|s| s as isize).to_vec();
    tensor(values, Shape::from(shape)).with_layout(Layout::new(Shape::from(shape), strides, 0))
}

/// The targets as `i64`, whatever integer type the device stores (−1, no class, for all of
/// them if they cannot be read: the loss is then NaN, never a silent 0).
fn classes(targets: &FlexTensor) -> Vec<i64> {
    let n = targets.layout().shape().num_elements();
    let t = targets.clone().into_data();
    t.convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap_or_else(|_| vec![-1; n])
}

fn attend(q: FlexTensor, k: FlexTensor, v: FlexTensor) -> (FlexTensor, Vec<f32>) {
    let ((q, qh), (k, kh), (v, vh)) = (heads(q), heads(k), heads(v));
    let a = attention::forward((q.storage(), qh), (k.storage(), kh), (v.storage(), vh));
    (packed(a.out, qh.shape), a.lse)
}

fn normalise(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    eps: f64,
) -> (FlexTensor, norm::Normed) {
    let shape = x.layout().shape().clone();
    let (x, gamma, beta) = (dense(x), dense(gamma), dense(beta));
    let n = norm::forward(values(&x), values(&gamma), values(&beta), eps as f32);
    (tensor(n.y.clone(), shape), n)
}

impl FusedKernels for Flex {
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = x.layout().shape().clone();
        let x = dense(x);
        tensor(vector::gelu_of(values(&x)), shape)
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        normalise(x, gamma, beta, epsilon).0
    }

    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        attend(q, k, v).0
    }

    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        affine(x, weight, bias)
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let logits = dense(logits);
        let e = entropy::forward(values(&logits), &classes(&targets));
        tensor(vec![e.loss], Shape::from([1]))
    }
}

#[derive(Debug)]
struct GeluStep;

impl Backward<Flex, 1> for GeluStep {
    type State = FlexTensor;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = dense(grads.consume::<Flex>(&ops.node));
        let x = dense(ops.state);
        if let Some(node) = parent {
            let shape = x.layout().shape().clone();
            let dx = vector::gelu_grad(values(&x), values(&grad));
            grads.register::<Flex>(node.id, tensor(dx, shape));
        }
    }
}

#[derive(Debug)]
struct LayerNormStep;

impl Backward<Flex, 3> for LayerNormStep {
    /// The input, `gamma`, each row's mean and `1/σ`.
    type State = (FlexTensor, FlexTensor, Vec<f32>, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pgamma, pbeta] = ops.parents;
        let grad = dense(grads.consume::<Flex>(&ops.node));
        let (x, gamma, mean, rstd) = ops.state;
        let shape = x.layout().shape().clone();
        let d = norm::backward(values(&x), values(&gamma), &mean, &rstd, values(&grad));
        let features = Shape::from([d.gamma.len()]);
        if let Some(node) = px {
            grads.register::<Flex>(node.id, tensor(d.x, shape));
        }
        if let Some(node) = pgamma {
            grads.register::<Flex>(node.id, tensor(d.gamma, features.clone()));
        }
        if let Some(node) = pbeta {
            grads.register::<Flex>(node.id, tensor(d.beta, features));
        }
    }
}

#[derive(Debug)]
struct AttentionStep;

impl Backward<Flex, 3> for AttentionStep {
    /// Queries, keys, values, the output and each query's log-sum-exp.
    type State = (FlexTensor, FlexTensor, FlexTensor, FlexTensor, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [pq, pk, pv] = ops.parents;
        let (grad, gh) = heads(grads.consume::<Flex>(&ops.node));
        let (q, k, v, out, lse) = ops.state;
        let ((q, qh), (k, kh), (v, vh), (out, oh)) = (heads(q), heads(k), heads(v), heads(out));
        let [dq, dk, dv] = attention::backward(
            ((q.storage(), qh), (k.storage(), kh), (v.storage(), vh)),
            ((out.storage(), oh), &lse),
            (grad.storage(), gh),
        );
        for (parent, d) in [(pq, dq), (pk, dk), (pv, dv)] {
            if let Some(node) = parent {
                grads.register::<Flex>(node.id, packed(d, qh.shape));
            }
        }
    }
}

#[derive(Debug)]
struct LinearStep;

impl Backward<Flex, 3> for LinearStep {
    /// The input and the weight.
    type State = (FlexTensor, FlexTensor);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [px, pw, pb] = ops.parents;
        let (grad, gv) = matrix(grads.consume::<Flex>(&ops.node));
        let ((x, xv), (w, wv)) = (matrix(ops.state.0), matrix(ops.state.1));
        let g = (grad.storage(), gv);
        if let Some(node) = px {
            let dx = linear::input_grad((w.storage(), wv), g);
            grads.register::<Flex>(node.id, tensor(dx, Shape::from([xv.rows, xv.cols])));
        }
        if let Some(node) = pw {
            let dw = linear::weight_grad((x.storage(), xv), g);
            grads.register::<Flex>(node.id, tensor(dw, Shape::from([wv.rows, wv.cols])));
        }
        if let Some(node) = pb {
            let db = linear::bias_grad(g);
            grads.register::<Flex>(node.id, tensor(db, Shape::from([wv.cols])));
        }
    }
}

#[derive(Debug)]
struct EntropyStep;

impl Backward<Flex, 1> for EntropyStep {
    /// The logits, the targets and each row's log-sum-exp.
    type State = (FlexTensor, Vec<i64>, Vec<f32>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = dense(grads.consume::<Flex>(&ops.node));
        let g = values(&grad).first().copied().unwrap_or(0.0);
        let (logits, targets, lse) = ops.state;
        if let Some(node) = parent {
            let shape = logits.layout().shape().clone();
            let d = entropy::backward(values(&logits), &targets, &lse, g);
            grads.register::<Flex>(node.id, tensor(d, shape));
        }
    }
}

impl<C: CheckpointStrategy> FusedKernels for Autodiff<Flex, C> {
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluStep.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let input = dense(x.into_primitive());
                let out = Flex::fused_gelu(input.clone());
                prep.finish(input, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(Flex::fused_gelu(x.into_primitive())),
        }
    }

    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), gamma.node(), beta.node()];
        let (x, gamma, beta) = (
            dense(x.into_primitive()),
            dense(gamma.into_primitive()),
            dense(beta.into_primitive()),
        );
        match LayerNormStep.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, n) = normalise(x.clone(), gamma.clone(), beta, epsilon);
                prep.finish((x, gamma, n.mean, n.rstd), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(normalise(x, gamma, beta, epsilon).0),
        }
    }

    fn fused_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [q.node(), k.node(), v.node()];
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        match AttentionStep.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, lse) = attend(q.clone(), k.clone(), v.clone());
                prep.finish((q, k, v, out.clone(), lse), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(attend(q, k, v).0),
        }
    }

    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [x.node(), weight.node(), bias.node()];
        let (x, w, b) = (
            x.into_primitive(),
            weight.into_primitive(),
            bias.into_primitive(),
        );
        match LinearStep.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = affine(x.clone(), w.clone(), b);
                prep.finish((x, w), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(affine(x, w, b)),
        }
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match EntropyStep
            .prepare::<C>([logits.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let logits = dense(logits.into_primitive());
                let targets = classes(&targets);
                let e = entropy::forward(values(&logits), &targets);
                let out = tensor(vec![e.loss], Shape::from([1]));
                prep.finish((logits, targets, e.lse), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(Flex::fused_cross_entropy(logits.into_primitive(), targets))
            }
        }
    }
}
