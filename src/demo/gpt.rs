//! A small decoder-only transformer (GPT) written with the tensor-parallel layers: token and
//! position embeddings, `layers` × (pre-norm causal self-attention + pre-norm MLP), a final
//! norm and an untied output head over the vocabulary, trained on next-token prediction.
//!
//! As one module ([`Gpt`]) it is the one-device model (every collective the identity); cut
//! into blocks ([`Gpt::into_blocks`]) it trains with any dp × pp × tp layout: the embedding,
//! each attention, each MLP and the head are one tensor-parallel block each (one split region
//! per block, as `parallel::tensor` requires).

use burn::module::{Module, Param, ParamId};
use burn::nn::{Initializer, LayerNorm};
use burn::tensor::activation::softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::parallel::pipeline_exec::{AnyTensor, Boundary};
use crate::parallel::sampler::SplitMix64;
use crate::parallel::stages::{BlockOptions, PipelineModel, PipelineStages};
use crate::parallel::tensor::layers::{
    ColumnParallelLinear, ParallelMlp, ParallelSelfAttention, VocabParallelEmbedding, layer_norm,
    normalize, vocab_parallel_cross_entropy,
};
use crate::parallel::tensor::{TensorParallel, TensorParallelModule};

/// The GPT's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Tokens in the vocabulary.
    pub vocab: usize,
    /// The longest context (positions).
    pub context: usize,
    /// Features per token.
    pub d_model: usize,
    /// Attention heads (divide `d_model`; a tensor-parallel degree must divide them).
    pub heads: usize,
    /// Transformer layers.
    pub layers: usize,
}

/// The model kind of [`Gpt`] on the control plane ([`crate::cluster::control::ModelSpec`]):
/// `meshwork train --model gpt`'s model across processes, registered by the binary.
#[cfg(feature = "cluster")]
pub const GPT_KIND: &str = "meshwork-demo-gpt";

/// The [`crate::cluster::control::ModelSpec`] of a [`Gpt`] of `config` (its configuration:
/// vocabulary, context, d_model, heads and layers, each a little-endian `u32`).
#[cfg(feature = "cluster")]
pub fn gpt_spec(config: &GptConfig) -> crate::cluster::control::ModelSpec {
    let sizes = [
        config.vocab,
        config.context,
        config.d_model,
        config.heads,
        config.layers,
    ];
    crate::cluster::control::ModelSpec {
        kind: GPT_KIND.into(),
        config: sizes
            .iter()
            .flat_map(|&n| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes())
            .collect(),
    }
}

/// The configuration of the [`Gpt`] `spec` describes. The bytes come from the network, so the
/// model is bounded before it is built: five sizes, none 0, `heads` dividing `d_model`, at
/// most 2^28 parameters.
#[cfg(feature = "cluster")]
pub fn gpt_config(
    spec: &crate::cluster::control::ModelSpec,
) -> Result<GptConfig, crate::cluster::control::Incompatibility> {
    use crate::cluster::control::Incompatibility;
    if spec.kind != GPT_KIND {
        return Err(Incompatibility::UnknownModel {
            kind: spec.kind.clone(),
        });
    }
    let sizes: Vec<u64> = spec
        .config
        .chunks_exact(4)
        .map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        .collect();
    let refused = || {
        Incompatibility::Other(format!(
            "demo GPT sizes {sizes:?} ({} configuration bytes) are not a model this node builds",
            spec.config.len()
        ))
    };
    let &[vocab, context, d_model, heads, layers] = sizes.as_slice() else {
        return Err(refused());
    };
    // Embeddings, head, and per layer attention (4 d²) and MLP (8 d²), biases aside (in
    // u128: no product of u32 sizes overflows it).
    let (v, c, d, l) = (
        vocab as u128,
        context as u128,
        d_model as u128,
        layers as u128,
    );
    let params = 2 * v * d + c * d + l * 12 * d * d;
    if spec.config.len() != 20
        || sizes.contains(&0)
        || !d_model.is_multiple_of(heads)
        || params > 1 << 28
    {
        return Err(refused());
    }
    Ok(GptConfig {
        vocab: vocab as usize,
        context: context as usize,
        d_model: d_model as usize,
        heads: heads as usize,
        layers: layers as usize,
    })
}

/// The control plane's structure fingerprint of the [`Gpt`] `spec` describes, built on
/// `device` ([`gpt_config`] checks the spec).
#[cfg(feature = "cluster")]
pub fn gpt_fingerprint(
    spec: &crate::cluster::control::JobSpec,
    device: &Device,
) -> Result<crate::cluster::control::ModelFingerprint, crate::cluster::control::Incompatibility> {
    let config = gpt_config(&spec.model)?;
    Ok(crate::cluster::control::structure_fingerprint(
        GPT_KIND,
        &Gpt::new(&config, device),
    ))
}

impl GptConfig {
    /// The MLP's hidden width: 4 × `d_model`, as GPT-2.
    pub fn mlp_hidden(&self) -> usize {
        4 * self.d_model
    }

    /// Blocks of [`Gpt::into_blocks`]: embedding, attention and MLP per layer, head.
    pub fn blocks(&self) -> usize {
        2 * self.layers + 2
    }
}

/// Token embeddings (split over the vocabulary) plus learned position embeddings
/// (replicated).
#[derive(Module, Debug)]
pub struct GptEmbedding {
    tokens: VocabParallelEmbedding,
    positions: Param<Tensor<2>>,
}

impl GptEmbedding {
    fn new(config: &GptConfig, device: &Device) -> Self {
        let tokens = VocabParallelEmbedding::new(config.vocab, config.d_model, device);
        let init = Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let positions = init.init([config.context, config.d_model], device);
        let _ = positions.val();
        Self { tokens, positions }
    }

    /// `[batch, seq, d_model]` for `tokens` `[batch, seq]` (seq ≤ context).
    pub fn forward(&self, tokens: Tensor<2, Int>, tp: &TensorParallel) -> Tensor<3> {
        let [_, s] = tokens.dims();
        let x = self.tokens.forward(tokens, tp);
        x + self.positions.val().narrow(0, 0, s).unsqueeze::<3>()
    }
}

impl TensorParallelModule for GptEmbedding {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        self.tokens.split_params(split);
    }
}

/// The final norm and the output head (split over the vocabulary), ending in the
/// vocabulary-parallel cross-entropy.
#[derive(Module, Debug)]
pub struct GptHead {
    norm: LayerNorm,
    head: ColumnParallelLinear,
    vocab: usize,
}

impl GptHead {
    fn new(config: &GptConfig, device: &Device) -> Self {
        Self {
            norm: layer_norm(config.d_model, device),
            head: ColumnParallelLinear::new(config.d_model, config.vocab, false, device),
            vocab: config.vocab,
        }
    }

    /// The mean next-token cross-entropy of `x` `[batch, seq, d_model]` against `targets`
    /// `[batch, seq]`.
    pub fn loss(&self, x: Tensor<3>, targets: Tensor<2, Int>, tp: &TensorParallel) -> Tensor<1> {
        let [b, s, d] = x.dims();
        let logits = self
            .head
            .forward(normalize(&self.norm, x).reshape([b * s, d]), tp);
        vocab_parallel_cross_entropy(logits, targets.reshape([b * s]), self.vocab, tp)
    }

    /// The whole logits `[batch, seq, vocab]` (one device).
    pub fn logits(&self, x: Tensor<3>) -> Tensor<3> {
        self.head
            .forward(normalize(&self.norm, x), &TensorParallel::single())
    }
}

impl TensorParallelModule for GptHead {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        self.head.split_params(split);
    }
}

/// One transformer layer: attention, then MLP.
#[derive(Module, Debug)]
pub struct GptLayer {
    attention: ParallelSelfAttention,
    mlp: ParallelMlp,
}

/// The whole GPT on one device.
#[derive(Module, Debug)]
pub struct Gpt {
    embedding: GptEmbedding,
    layers: Vec<GptLayer>,
    head: GptHead,
}

impl Gpt {
    /// A GPT of `config`, drawn from Burn's generator now, in block order (seed the device
    /// first for a reproducible model).
    pub fn new(config: &GptConfig, device: &Device) -> Self {
        let embedding = GptEmbedding::new(config, device);
        let layers = (0..config.layers)
            .map(|_| GptLayer {
                attention: ParallelSelfAttention::new(config.d_model, config.heads, device),
                mlp: ParallelMlp::new(config.d_model, config.mlp_hidden(), device),
            })
            .collect();
        let head = GptHead::new(config, device);
        Self {
            embedding,
            layers,
            head,
        }
    }

    /// The mean next-token cross-entropy of a batch (`inputs` and `targets` `[batch, seq]`).
    pub fn loss(
        &self,
        inputs: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        tp: &TensorParallel,
    ) -> Tensor<1> {
        let mut x = self.embedding.forward(inputs, tp);
        for layer in &self.layers {
            x = layer.attention.forward(x, tp);
            x = layer.mlp.forward(x, tp);
        }
        self.head.loss(x, targets, tp)
    }

    /// The logits `[batch, seq, vocab]` of `inputs` `[batch, seq]` (one device).
    pub fn logits(&self, inputs: Tensor<2, Int>) -> Tensor<3> {
        let one = TensorParallel::single();
        let mut x = self.embedding.forward(inputs, &one);
        for layer in &self.layers {
            x = layer.attention.forward(x, &one);
            x = layer.mlp.forward(x, &one);
        }
        self.head.logits(x)
    }

    /// The longest context the model was built for.
    pub fn context(&self) -> usize {
        self.embedding.positions.dims()[0]
    }

    /// `n` tokens continuing `prompt`, each drawn from the softmax of the last position's
    /// logits divided by `temperature` (0: the most likely token), with the random numbers
    /// of `seed`: the same model, prompt and seed give the same text.
    pub fn sample(
        &self,
        prompt: &[u32],
        n: usize,
        temperature: f32,
        seed: u64,
        device: &Device,
    ) -> Vec<u32> {
        let mut rng = SplitMix64::new(seed);
        let mut tokens: Vec<u32> = prompt.to_vec();
        if tokens.is_empty() {
            tokens.push(0);
        }
        let context = self.context();
        for _ in 0..n {
            let window = &tokens[tokens.len().saturating_sub(context)..];
            let ids: Vec<i64> = window.iter().map(|&t| i64::from(t)).collect();
            let input =
                Tensor::<2, Int>::from_data(TensorData::new(ids, [1, window.len()]), device);
            let logits = self.logits(input);
            let [_, s, v] = logits.dims();
            let last = logits.narrow(1, s - 1, 1).reshape([v]);
            let next = if temperature <= 0.0 {
                argmax(&values(last))
            } else {
                let probs = values(softmax(last / temperature, 0));
                let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                let mut acc = 0.0f64;
                let mut pick = probs.len().saturating_sub(1);
                for (i, p) in probs.iter().enumerate() {
                    acc += f64::from(*p);
                    if u < acc {
                        pick = i;
                        break;
                    }
                }
                pick
            };
            tokens.push(next as u32);
        }
        tokens.split_off(prompt.len().max(1).min(tokens.len()))
    }

    /// Parameter elements rank `rank` of a tensor-parallel group of `degree` holds of each
    /// block of [`into_blocks`](Self::into_blocks): its slices of the split weights and the
    /// replicated ones whole.
    pub fn held_parameters(
        &self,
        rank: usize,
        degree: usize,
    ) -> Result<Vec<usize>, crate::config::InvalidConfig> {
        use crate::parallel::tensor::shard;
        fn parameter_count<M: burn::module::Module>(m: &M) -> usize {
            crate::parallel::gradients::ParamLayout::of(m).len()
        }
        let mut counts = vec![parameter_count(&shard(
            self.embedding.clone(),
            rank,
            degree,
        )?)];
        for layer in &self.layers {
            counts.push(parameter_count(&shard(
                layer.attention.clone(),
                rank,
                degree,
            )?));
            counts.push(parameter_count(&shard(layer.mlp.clone(), rank, degree)?));
        }
        counts.push(parameter_count(&shard(self.head.clone(), rank, degree)?));
        Ok(counts)
    }

    /// The model as tensor-parallel blocks (embedding, attention and MLP per layer, head),
    /// reading each item's tokens through `AsRef<[u32]>`: a window of `seq + 1` tokens whose
    /// first `seq` are the input and last `seq` the targets.
    ///
    /// A window must hold `seq + 1 ≤ context + 1` tokens, all below the vocabulary size, and
    /// the windows of a batch the same number: a batch that does not is a panic on the stage's
    /// device thread, which the job reports as the stage's failure with this reason.
    pub fn into_blocks<I: AsRef<[u32]> + 'static>(self) -> PipelineStages<I> {
        self.into_blocks_with(BlockOptions::default())
    }

    /// Like [`into_blocks`](Self::into_blocks), every attention and MLP block training with
    /// `options` (e.g. activation checkpointing; a recomputed forward runs its all-reduce
    /// again).
    pub fn into_blocks_with<I: AsRef<[u32]> + 'static>(
        self,
        options: BlockOptions,
    ) -> PipelineStages<I> {
        let (vocab, context) = (self.embedding.tokens.vocab(), self.context());
        let mut stages = PipelineStages::new(move |items: &[I], d: &Device| {
            if let Err(e) = check_windows(items, vocab, context) {
                panic!("{e}");
            }
            let (inputs, _) = token_batch(items, d);
            vec![AnyTensor::D2(inputs.float())]
        })
        .tp_block(self.embedding, |m: &GptEmbedding, x: Boundary, tp| {
            vec![AnyTensor::D3(m.forward(tokens_of(&x), tp))]
        });
        for layer in self.layers {
            stages = stages
                .tp_block_with(
                    layer.attention,
                    options,
                    |m: &ParallelSelfAttention, x: Boundary, tp| {
                        vec![AnyTensor::D3(m.forward(rank3(&x), tp))]
                    },
                )
                .tp_block_with(layer.mlp, options, |m: &ParallelMlp, x: Boundary, tp| {
                    vec![AnyTensor::D3(m.forward(rank3(&x), tp))]
                });
        }
        stages.tp_last(
            self.head,
            |m: &GptHead, x: Boundary, items: &[I], d: &Device, tp| {
                let (_, targets) = token_batch(items, d);
                m.loss(rank3(&x), targets, tp)
            },
        )
    }

    /// The GPT whose blocks a job trained ([`into_blocks`](Self::into_blocks)), put back
    /// together; `None` if a block is missing or of another type.
    pub fn from_blocks(mut model: PipelineModel) -> Option<Self> {
        let blocks = model.len();
        if blocks < 2 || !blocks.is_multiple_of(2) {
            return None;
        }
        let embedding = model.take_block::<GptEmbedding>(0)?;
        let layers = (0..(blocks - 2) / 2)
            .map(|l| {
                Some(GptLayer {
                    attention: model.take_block::<ParallelSelfAttention>(1 + 2 * l)?,
                    mlp: model.take_block::<ParallelMlp>(2 + 2 * l)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let head = model.take_block::<GptHead>(blocks - 1)?;
        Some(Self {
            embedding,
            layers,
            head,
        })
    }
}

/// The mean next-token loss (nats per token) of `model` on the first `max_windows` windows of
/// `data`, in batches of `batch` (one device, no gradient): a validation loss.
pub fn mean_loss<D>(model: &Gpt, data: &D, max_windows: usize, batch: usize, device: &Device) -> f64
where
    D: crate::data::Dataset,
    D::Item: AsRef<[u32]>,
{
    let n = data.len().min(max_windows);
    let batch = batch.max(1);
    let (mut total, mut count) = (0.0f64, 0usize);
    let mut start = 0;
    while start < n {
        let items: Vec<D::Item> = (start..(start + batch).min(n))
            .filter_map(|i| data.get(i))
            .collect();
        start += batch;
        if items.is_empty() {
            continue;
        }
        let loss: f32 = gpt_loss(model, &items, device).detach().into_scalar();
        total += f64::from(loss) * items.len() as f64;
        count += items.len();
    }
    if count == 0 {
        f64::NAN
    } else {
        total / count as f64
    }
}

/// Why a batch of windows cannot be the GPT's input: windows of different lengths, longer
/// than `context + 1` or shorter than 2 tokens, or a token outside the vocabulary.
pub fn check_windows<I: AsRef<[u32]>>(
    items: &[I],
    vocab: usize,
    context: usize,
) -> Result<(), String> {
    let Some(first) = items.first() else {
        return Err("an empty batch of windows".into());
    };
    let len = first.as_ref().len();
    if len < 2 || len > context + 1 {
        return Err(format!(
            "a window of {len} tokens: the GPT takes 2 to {} (its context + 1)",
            context + 1
        ));
    }
    for (i, w) in items.iter().enumerate() {
        let w = w.as_ref();
        if w.len() != len {
            return Err(format!(
                "window {i} of the batch has {} tokens, the first {len}",
                w.len()
            ));
        }
        if let Some(t) = w.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "window {i} holds token {t}, outside the vocabulary of {vocab}"
            ));
        }
    }
    Ok(())
}

/// The inputs and targets `[batch, seq]` of windows of `seq + 1` tokens.
pub fn token_batch<I: AsRef<[u32]>>(
    items: &[I],
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let seq = items
        .first()
        .map_or(0, |w| w.as_ref().len().saturating_sub(1));
    let mut inputs = Vec::with_capacity(items.len() * seq);
    let mut targets = Vec::with_capacity(items.len() * seq);
    for w in items {
        let w = w.as_ref();
        inputs.extend(w.iter().take(seq).map(|&t| i64::from(t)));
        targets.extend(w.iter().skip(1).take(seq).map(|&t| i64::from(t)));
    }
    let b = items.len();
    (
        Tensor::from_data(TensorData::new(inputs, [b, seq]), device),
        Tensor::from_data(TensorData::new(targets, [b, seq]), device),
    )
}

/// The one-device loss of a batch of windows (the reference loop's loss); the windows must
/// pass [`check_windows`].
pub fn gpt_loss<I: AsRef<[u32]>>(model: &Gpt, items: &[I], device: &Device) -> Tensor<1> {
    let (inputs, targets) = token_batch(items, device);
    model.loss(inputs, targets, &TensorParallel::single())
}

fn tokens_of(x: &Boundary) -> Tensor<2, Int> {
    match x.first() {
        Some(AnyTensor::D2(t)) => t.clone().detach().int(),
        _ => panic!("the GPT's first block takes the tokens as one rank-2 tensor"),
    }
}

fn rank3(x: &Boundary) -> Tensor<3> {
    match x.first() {
        Some(AnyTensor::D3(t)) => t.clone(),
        _ => panic!("a GPT block takes one rank-3 tensor"),
    }
}

fn values(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0
}
