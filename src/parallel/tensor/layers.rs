//! Megatron-LM's tensor-parallel layers as Burn modules.
//!
//! Each layer is built **whole** (`new`: the one-device layer, drawn from Burn's generator);
//! a tensor-parallel job keeps each rank's slice of it ([`super::shard`]), so a job starts
//! from exactly the one-device model. Each forward takes the rank's [`TensorParallel`]; with
//! [`TensorParallel::single`] it computes the one-device layer.
//!
//! | layer | split | forward collectives |
//! |---|---|---|
//! | [`ColumnParallelLinear`] | weight `[in, out]` by columns, bias by `out` | none (`gather_output`: an all-gather) |
//! | [`RowParallelLinear`] | weight `[in, out]` by rows; bias replicated | one all-reduce of the output |
//! | [`ParallelSelfAttention`] | query, key, value by heads (column); output by rows | one all-reduce |
//! | [`ParallelMlp`] | up by columns, down by rows | one all-reduce |
//! | [`VocabParallelEmbedding`] | table `[vocab, d]` by vocabulary rows | one all-reduce |
//! | [`vocab_parallel_cross_entropy`] | logits by vocabulary | max, Σexp and target logit all-reduced per token |

use burn::module::{Module, Param, ParamId};
use burn::nn::{Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::module::embedding;
use burn::tensor::{DType, Device, Int, Tensor};

use super::{TensorParallel, TensorParallelModule};
use crate::config::InvalidConfig;
use crate::kernels::{self, NORM_EPSILON};
use crate::parallel::materialize;

/// A LayerNorm of `d` features with the family's ε ([`NORM_EPSILON`], which [`normalize`]
/// passes to the fused kernel).
pub(crate) fn layer_norm(d: usize, device: &Device) -> LayerNorm {
    materialize(
        LayerNormConfig::new(d)
            .with_epsilon(NORM_EPSILON)
            .init(device),
    )
}

/// `norm(x)`, through [`kernels::layer_norm`] for f32 (fused where it runs), through Burn's
/// module otherwise (which widens bf16 and f16 for its sums).
pub(crate) fn normalize<const D: usize>(norm: &LayerNorm, x: Tensor<D>) -> Tensor<D> {
    match &norm.beta {
        Some(beta) if x.dtype() == DType::F32 => {
            kernels::layer_norm(x, norm.gamma.val(), beta.val(), NORM_EPSILON)
        }
        _ => norm.forward(x),
    }
}

/// `x · W + b` over `x`'s last dimension with every leading dimension folded into the rows:
/// one `[rows, in]·[in, out]` product forward and one per gradient backward. Burn keeps a
/// `[batch, seq, in]` input batched when `seq` fills its tiles, so the weight broadcasts to
/// every batch entry and the backward builds one weight gradient per entry and sums them: on
/// `flex` that was 60 % of a GPT layer's step (`meshwork bench layer`).
fn linear_rows<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let dims = x.dims();
    let d_in = dims[D - 1];
    let rows = dims[..D - 1].iter().product::<usize>();
    let out = kernels::linear(x.reshape([rows, d_in]), weight, bias);
    let mut out_dims = dims;
    out_dims[D - 1] = out.dims()[1];
    out.reshape(out_dims)
}

/// A linear layer whose output features are split over the group (Megatron's
/// `ColumnParallelLinear`): each rank computes its columns of `x · W + b` from the whole
/// (replicated) input.
#[derive(Module, Debug)]
pub struct ColumnParallelLinear {
    linear: Linear,
}

impl ColumnParallelLinear {
    /// The whole layer `d_in → d_out`, initialized as Burn's `Linear`.
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Self {
        Self::from_linear(materialize(
            LinearConfig::new(d_in, d_out).with_bias(bias).init(device),
        ))
    }

    /// The layer computing `linear` (whole until sharded).
    pub fn from_linear(linear: Linear) -> Self {
        Self { linear }
    }

    /// This rank's output features `[.., out / T]` (a split region opens here, TP-6).
    pub fn forward<const D: usize>(&self, x: Tensor<D>, tp: &TensorParallel) -> Tensor<D> {
        tp.enter_split();
        linear_rows(
            x,
            self.linear.weight.val(),
            self.linear.bias.as_ref().map(|b| b.val()),
        )
    }

    /// Every rank's output features gathered `[.., out]` (`out` must be divisible by `T`).
    pub fn forward_gathered<const D: usize>(&self, x: Tensor<D>, tp: &TensorParallel) -> Tensor<D> {
        let local = self.forward(x, tp);
        tp.gather_last(local)
    }

    /// Output features this rank computes.
    pub fn local_out(&self) -> usize {
        self.linear.weight.dims()[1]
    }
}

impl TensorParallelModule for ColumnParallelLinear {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        split(self.linear.weight.id, 1);
        if let Some(b) = &self.linear.bias {
            split(b.id, 0);
        }
    }
}

/// A linear layer whose input features are split over the group (Megatron's
/// `RowParallelLinear`): each rank multiplies its slice of the input by its rows of `W`, the
/// partial outputs are summed by one all-reduce, then the (replicated) bias is added.
#[derive(Module, Debug)]
pub struct RowParallelLinear {
    weight: Param<Tensor<2>>,
    bias: Option<Param<Tensor<1>>>,
}

impl RowParallelLinear {
    /// The whole layer `d_in → d_out`, initialized as Burn's `Linear`.
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Self {
        Self::from_linear(materialize(
            LinearConfig::new(d_in, d_out).with_bias(bias).init(device),
        ))
    }

    /// The layer computing `linear` (whole until sharded).
    pub fn from_linear(linear: Linear) -> Self {
        Self {
            weight: linear.weight,
            bias: linear.bias,
        }
    }

    /// `Σ_ranks x_r · W_r + b` from this rank's input slice `x_r` `[.., in / T]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>, tp: &TensorParallel) -> Tensor<D> {
        let partial = linear_rows(x, self.weight.val(), None);
        let out = tp.reduce(partial);
        match &self.bias {
            Some(b) => out + b.val().unsqueeze(),
            None => out,
        }
    }
}

impl TensorParallelModule for RowParallelLinear {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        split(self.weight.id, 0);
    }
}

/// Causal self-attention with its heads split over the group, pre-norm and residual:
/// `x + out(attention(q, k, v))` with `q, k, v` of `norm(x)`. Query, key and value are
/// column-parallel (each rank holds `heads / T` whole heads), the output projection is
/// row-parallel: one all-reduce in the forward.
#[derive(Module, Debug)]
pub struct ParallelSelfAttention {
    norm: LayerNorm,
    query: ColumnParallelLinear,
    key: ColumnParallelLinear,
    value: ColumnParallelLinear,
    output: RowParallelLinear,
    heads: usize,
    head_dim: usize,
}

impl ParallelSelfAttention {
    /// The whole block for `d_model` features in `heads` heads (`d_model` divisible by
    /// `heads`).
    pub fn new(d_model: usize, heads: usize, device: &Device) -> Self {
        let heads = heads.max(1);
        Self {
            norm: layer_norm(d_model, device),
            query: ColumnParallelLinear::new(d_model, d_model, true, device),
            key: ColumnParallelLinear::new(d_model, d_model, true, device),
            value: ColumnParallelLinear::new(d_model, d_model, true, device),
            output: RowParallelLinear::new(d_model, d_model, true, device),
            heads,
            head_dim: d_model / heads,
        }
    }

    /// `x + attention(norm(x))` for `x` `[batch, seq, d_model]`, causal.
    pub fn forward(&self, x: Tensor<3>, tp: &TensorParallel) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let h = normalize(&self.norm, x.clone());
        let local_heads = self.query.local_out() / self.head_dim.max(1);
        let split = |t: Tensor<3>| {
            t.reshape([b, s, local_heads, self.head_dim])
                .swap_dims(1, 2)
        };
        let q = split(self.query.forward(h.clone(), tp));
        let k = split(self.key.forward(h.clone(), tp));
        let v = split(self.value.forward(h, tp));
        let context = kernels::causal_attention(q, k, v).swap_dims(1, 2).reshape([
            b,
            s,
            local_heads * self.head_dim,
        ]);
        x + self.output.forward(context, tp)
    }
}

impl TensorParallelModule for ParallelSelfAttention {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        self.query.split_params(split);
        self.key.split_params(split);
        self.value.split_params(split);
        self.output.split_params(split);
    }

    fn check_degree(&self, degree: usize) -> Result<(), InvalidConfig> {
        let d_model = self.query.linear.weight.dims()[0];
        if self.head_dim * self.heads != d_model {
            return Err(InvalidConfig(format!(
                "{d_model} features do not split into {} attention heads",
                self.heads
            )));
        }
        if !self.heads.is_multiple_of(degree.max(1)) {
            return Err(InvalidConfig(format!(
                "{} attention heads do not split over a tensor-parallel group of {degree}: \
                 choose a degree dividing the number of heads",
                self.heads
            )));
        }
        Ok(())
    }
}

/// The transformer's feed-forward block, pre-norm and residual:
/// `x + down(gelu(up(norm(x))))`, `up` column-parallel and `down` row-parallel: one
/// all-reduce in the forward.
#[derive(Module, Debug)]
pub struct ParallelMlp {
    norm: LayerNorm,
    up: ColumnParallelLinear,
    down: RowParallelLinear,
}

impl ParallelMlp {
    /// The whole block `d_model → hidden → d_model`.
    pub fn new(d_model: usize, hidden: usize, device: &Device) -> Self {
        Self {
            norm: layer_norm(d_model, device),
            up: ColumnParallelLinear::new(d_model, hidden, true, device),
            down: RowParallelLinear::new(hidden, d_model, true, device),
        }
    }

    /// `x + down(gelu(up(norm(x))))`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>, tp: &TensorParallel) -> Tensor<D> {
        let h = kernels::gelu(self.up.forward(normalize(&self.norm, x.clone()), tp));
        x + self.down.forward(h, tp)
    }
}

impl TensorParallelModule for ParallelMlp {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        self.up.split_params(split);
        self.down.split_params(split);
    }
}

/// An embedding table split over the vocabulary: each rank holds the rows of its
/// [`TensorParallel::range`] of the vocabulary, looks up the tokens that fall in it (zeros for
/// the others), and one all-reduce sums the ranks' lookups.
#[derive(Module, Debug)]
pub struct VocabParallelEmbedding {
    weight: Param<Tensor<2>>,
    vocab: usize,
}

impl VocabParallelEmbedding {
    /// The whole table `[vocab, d_model]`, drawn from N(0, 0.02²) as GPT-2 does.
    pub fn new(vocab: usize, d_model: usize, device: &Device) -> Self {
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        Self {
            weight: materialize_param(init.init([vocab, d_model], device)),
            vocab,
        }
    }

    /// The whole vocabulary's size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The embeddings `[batch, seq, d_model]` of `tokens` `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<2, Int>, tp: &TensorParallel) -> Tensor<3> {
        tp.enter_split();
        let range = tp.range(self.vocab);
        if tp.degree() == 1 {
            return embedding(self.weight.val(), tokens);
        }
        let inside = tokens
            .clone()
            .greater_equal_elem(range.start as i64)
            .bool_and(tokens.clone().lower_elem(range.end as i64));
        let local = (tokens - range.start as i64).mask_fill(inside.clone().bool_not(), 0);
        let found = embedding(self.weight.val(), local);
        let keep = inside.float().cast(found.dtype()).unsqueeze_dim::<3>(2);
        tp.reduce(found * keep)
    }
}

impl TensorParallelModule for VocabParallelEmbedding {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        split(self.weight.id, 0);
    }
}

fn materialize_param(p: Param<Tensor<2>>) -> Param<Tensor<2>> {
    let _ = p.val();
    p
}

/// The mean cross-entropy of `logits` split over the vocabulary (`[n, vocab / T]`, this
/// rank's [`TensorParallel::range`] of `vocab`) against `targets` `[n]`, without any rank
/// holding the whole logits (Megatron's `vocab_parallel_cross_entropy`): the row maximum is
/// all-reduced (max, outside the graph), then Σexp and the target's logit (sum), so each
/// token costs three numbers on the wire.
pub fn vocab_parallel_cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    vocab: usize,
    tp: &TensorParallel,
) -> Tensor<1> {
    let logits = logits.cast(burn::tensor::FloatDType::F32);
    if tp.degree() == 1 {
        return kernels::cross_entropy(logits, targets);
    }
    let range = tp.range(vocab);
    let max = tp.max_detached(logits.clone().max_dim(1));
    let shifted = logits - max;
    let sum_exp = tp.reduce(shifted.clone().exp().sum_dim(1));
    let targets = targets.unsqueeze_dim::<2>(1);
    let inside = targets
        .clone()
        .greater_equal_elem(range.start as i64)
        .bool_and(targets.clone().lower_elem(range.end as i64));
    let local = (targets - range.start as i64).mask_fill(inside.clone().bool_not(), 0);
    let picked = shifted.gather(1, local) * inside.float();
    let target = tp.reduce(picked);
    (sum_exp.log() - target).mean()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{CommConfig, LocalGroup};
    use crate::mesh::Generation;
    use crate::parallel::tensor::{shard, unshard};
    use burn::tensor::TensorData;

    fn device() -> Device {
        Device::default()
    }

    /// Run `f(tp)` on `t` threads, each a rank of one in-process group.
    fn on_group<R: Send>(t: usize, f: impl Fn(&TensorParallel) -> R + Sync) -> Vec<R> {
        let group = LocalGroup::new(t, Generation(0), CommConfig::default());
        let comms = group.communicators();
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let f = &f;
                    s.spawn(move || f(&TensorParallel::new(c)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        })
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32")
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol * scale, "{x} vs {y}");
        }
    }

    #[test]
    fn tp_layers_forward_equals_one_device() {
        let d = device();
        let _g = crate::testing::draw_lock();
        d.seed(7);
        let attn = ParallelSelfAttention::new(8, 4, &d);
        let mlp = ParallelMlp::new(8, 16, &d);
        let x = Tensor::<3>::random([2, 5, 8], burn::tensor::Distribution::Default, &d);
        let one = TensorParallel::single();
        let want = values(mlp.forward(attn.forward(x.clone(), &one), &one));
        for t in [2, 4] {
            let outs = on_group(t, |tp| {
                let a = shard(attn.clone(), tp.rank(), tp.degree()).expect("splits");
                let m = shard(mlp.clone(), tp.rank(), tp.degree()).expect("splits");
                // Two blocks: attention, then the MLP (one split region each, TP-6).
                tp.begin_block();
                let h = a.forward(x.clone(), tp);
                tp.begin_block();
                values(m.forward(h, tp))
            });
            for out in outs {
                close(&out, &want, 1e-5);
            }
        }
    }

    #[test]
    fn vocab_parallel_embedding_and_loss_equal_one_device() {
        let d = device();
        let _g = crate::testing::draw_lock();
        d.seed(3);
        let emb = VocabParallelEmbedding::new(11, 6, &d);
        let head = ColumnParallelLinear::new(6, 11, false, &d);
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 3, 10, 7, 5, 1], [2, 3]), &d);
        let targets =
            Tensor::<1, Int>::from_data(TensorData::new(vec![3i64, 10, 0, 5, 9, 2], [6]), &d);
        let one = TensorParallel::single();
        let loss_of =
            |tp: &TensorParallel, e: &VocabParallelEmbedding, h: &ColumnParallelLinear| {
                tp.begin_block();
                let x = e.forward(tokens.clone(), tp).reshape([6, 6]);
                tp.begin_block();
                let logits = h.forward(x, tp);
                vocab_parallel_cross_entropy(logits, targets.clone(), 11, tp)
            };
        let want = values(loss_of(&one, &emb, &head));
        // Burn's own cross-entropy on the one-device logits.
        let logits = head.forward(
            embedding(emb.weight.val(), tokens.clone()).reshape([6, 6]),
            &one,
        );
        let burn_loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&d)
            .forward(logits, targets.clone());
        close(&want, &values(burn_loss), 1e-6);
        for t in [2, 3] {
            let outs = on_group(t, |tp| {
                let e = shard(emb.clone(), tp.rank(), tp.degree()).expect("splits");
                let h = shard(head.clone(), tp.rank(), tp.degree()).expect("splits");
                values(loss_of(tp, &e, &h))
            });
            for out in outs {
                close(&out, &want, 1e-6);
            }
        }
    }

    #[test]
    fn gathered_column_output_equals_the_whole_layer() {
        let d = device();
        let _g = crate::testing::draw_lock();
        d.seed(5);
        let col = ColumnParallelLinear::new(4, 6, true, &d);
        let x = Tensor::<2>::random([3, 4], burn::tensor::Distribution::Default, &d);
        let want = values(col.forward(x.clone(), &TensorParallel::single()));
        let outs = on_group(2, |tp| {
            let c = shard(col.clone(), tp.rank(), tp.degree()).expect("splits");
            assert_eq!(c.local_out(), 3, "each rank holds half the columns");
            values(c.forward_gathered(x.clone(), tp))
        });
        for out in outs {
            assert_eq!(out, want);
        }
        let parts = (0..2)
            .map(|r| shard(col.clone(), r, 2).expect("splits"))
            .collect();
        let back = unshard(parts).expect("parts fit");
        assert_eq!(values(back.forward(x, &TensorParallel::single())), want);
    }

    /// TP-4: a rank whose peer never comes gets its own values back after the time-out, the
    /// failure is kept, and the next collective returns at once instead of waiting again.
    #[test]
    fn tp_4_a_failed_collective_is_kept_and_not_waited_for_again() {
        let config = CommConfig {
            timeout: std::time::Duration::from_millis(200),
            ..CommConfig::default()
        };
        let group = LocalGroup::new(2, Generation(0), config);
        let mut comms = group.communicators();
        let tp = TensorParallel::new(comms.remove(0));
        let x = Tensor::<2>::ones([2, 3], &device());
        let out = tp.reduce(x.clone());
        assert_eq!(values(out), vec![1.0; 6], "its own values, not a sum");
        let started = std::time::Instant::now();
        let _ = tp.reduce(x);
        assert!(
            started.elapsed() < std::time::Duration::from_millis(150),
            "the second collective does not wait"
        );
        match tp.take_failure() {
            Some(crate::parallel::tensor::TpFailure::Comm(e)) => {
                assert!(e.to_string().contains("rank"), "{e}")
            }
            other => panic!("a kept communication failure, got {other:?}"),
        }
    }

    /// TP-6: a split layer after a reduce in the same block is refused at T > 1 (a second
    /// split region), allowed at T = 1.
    #[test]
    fn tp_6_a_second_split_region_in_one_block_is_refused() {
        let d = device();
        let attn = ParallelSelfAttention::new(8, 4, &d);
        let mlp = ParallelMlp::new(8, 16, &d);
        let x = Tensor::<3>::zeros([1, 2, 8], &d);
        let one = TensorParallel::single();
        let _ = mlp.forward(attn.forward(x.clone(), &one), &one);
        assert!(one.take_failure().is_none());
        let failures = on_group(2, |tp| {
            tp.begin_block();
            let a = shard(attn.clone(), tp.rank(), 2).expect("splits");
            let m = shard(mlp.clone(), tp.rank(), 2).expect("splits");
            let _ = m.forward(a.forward(x.clone(), tp), tp);
            tp.take_failure()
        });
        for f in failures {
            assert!(
                matches!(f, Some(crate::parallel::tensor::TpFailure::SecondRegion)),
                "{f:?}"
            );
        }
    }

    #[test]
    fn heads_must_divide_the_degree() {
        let attn = ParallelSelfAttention::new(8, 4, &device());
        assert!(attn.check_degree(2).is_ok());
        let e = attn.check_degree(3).expect_err("4 heads over 3 ranks");
        assert!(e.0.contains("4 attention heads"), "{e}");
        let odd = ParallelSelfAttention::new(10, 4, &device());
        let e = odd.check_degree(2).expect_err("10 features in 4 heads");
        assert!(e.0.contains("do not split into 4"), "{e}");
    }
}
