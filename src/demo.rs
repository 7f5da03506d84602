//! The demo task of `meshwork train` and the benches: a multi-layer perceptron learning a
//! noisy linear teacher.
//!
//! Inputs are uniform in `[-1, 1]^d_in`, targets are `W·x + ε` with a fixed random `W` and
//! Gaussian noise `ε ~ N(0, σ²)`. The mean-squared error the best model can reach is `σ²`
//! ([`TeacherTask::attainable_loss`]), so a run's last loss says how close training got.
//! Everything is generated from a seed: nothing is downloaded.
//!
//! [`kjv`]: the King James Bible shipped with the crate, the text of the character-level
//! models (`kjv_text`, `kjv_corpus`).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::data::InMemoryDataset;
use crate::parallel::sampler::SplitMix64;

pub mod kjv;

pub use kjv::{KJV_VALIDATION_FRACTION, KjvError, kjv_corpus, kjv_text};

/// A multi-layer perceptron with ReLU between layers.
#[derive(Module, Debug)]
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// An MLP with these layer widths (`[784, 1024, 1024, 10]` is three linear layers),
    /// initialized from Burn's random generator.
    pub fn new(widths: &[usize], device: &Device) -> Self {
        let layers = widths
            .windows(2)
            .map(|w| {
                crate::parallel::stages::materialize(LinearConfig::new(w[0], w[1]).init(device))
            })
            .collect();
        Self { layers }
    }

    /// The MLP whose layers are the blocks of a trained demo pipeline ([`mlp_pipeline`]), in
    /// block order: the same model the blocks compute together. `None` if a block is missing or
    /// is not an [`MlpStage`].
    pub fn from_pipeline(mut model: crate::parallel::stages::PipelineModel) -> Option<Self> {
        let blocks = model.len();
        let mut layers = Vec::new();
        for b in 0..blocks {
            layers.extend(model.take_block::<MlpStage>(b)?.layers);
        }
        Some(Self { layers })
    }

    /// The output for a batch of inputs `[batch, d_in]`, in the dtype of the model's
    /// parameters: the input is cast to it first (a no-op in `f32`; what a model trained in
    /// low precision does, see [`crate::parallel::autocast`]).
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        if let Some(first) = self.layers.first() {
            x = x.cast(first.weight.val().dtype());
        }
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = relu(x);
            }
        }
        x
    }
}

/// One sample of the teacher task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The input.
    pub features: Vec<f32>,
    /// The noisy target.
    pub target: Vec<f32>,
}

/// The noisy linear teacher task.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TeacherTask {
    /// Input width.
    pub d_in: usize,
    /// Output width.
    pub d_out: usize,
    /// Standard deviation of the target noise.
    pub noise: f32,
    /// Seed of the teacher and the samples.
    pub seed: u64,
}

impl TeacherTask {
    /// The lowest mean-squared error any model can reach on fresh samples: `σ²`.
    pub fn attainable_loss(&self) -> f32 {
        self.noise * self.noise
    }

    /// `n` samples of the task.
    pub fn dataset(&self, n: usize) -> InMemoryDataset<Sample> {
        let mut rng = SplitMix64::new(self.seed);
        let mut uniform = move || (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
        let scale = 1.0 / (self.d_in as f32).sqrt();
        let w: Vec<f32> = (0..self.d_in * self.d_out)
            .map(|_| (uniform() * 2.0 - 1.0) * scale * 3.0_f32.sqrt())
            .collect();
        let items = (0..n)
            .map(|_| {
                let features: Vec<f32> = (0..self.d_in).map(|_| uniform() * 2.0 - 1.0).collect();
                let target = (0..self.d_out)
                    .map(|o| {
                        let clean: f32 = (0..self.d_in)
                            .map(|i| w[o * self.d_in + i] * features[i])
                            .sum();
                        // Box–Muller.
                        let (u1, u2) = (uniform().max(1e-7), uniform());
                        let gauss = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
                        clean + self.noise * gauss
                    })
                    .collect();
                Sample { features, target }
            })
            .collect();
        InMemoryDataset::new(items)
    }
}

/// The inputs and targets of some samples as tensors `[n, d_in]` and `[n, d_out]`.
pub fn batch_tensors(samples: &[Sample], device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = samples.len();
    let d_in = samples.first().map_or(0, |s| s.features.len());
    let d_out = samples.first().map_or(0, |s| s.target.len());
    let x: Vec<f32> = samples
        .iter()
        .flat_map(|s| s.features.iter().copied())
        .collect();
    let y: Vec<f32> = samples
        .iter()
        .flat_map(|s| s.target.iter().copied())
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [n, d_in]), device),
        Tensor::from_data(TensorData::new(y, [n, d_out]), device),
    )
}

/// Mean-squared error of the model over some samples (the loss of the demo job), in `f32`
/// whatever the model's precision (its output is cast first; a no-op in `f32`).
pub fn mse_loss(model: &Mlp, samples: &[Sample], device: &Device) -> Tensor<1> {
    let (x, y) = batch_tensors(samples, device);
    let diff = model.forward(x).cast(FloatDType::F32) - y;
    (diff.clone() * diff).mean()
}

/// A run of consecutive linear layers of an MLP: one pipeline stage of it.
#[derive(Module, Debug)]
pub struct MlpStage {
    layers: Vec<Linear>,
    /// Whether this stage holds the model's last layer (no ReLU after it).
    ends_model: bool,
}

impl MlpStage {
    /// The stage's output for `x`: ReLU after every layer except the model's last.
    /// The input is cast to the stage's parameters' dtype first (a block trained in low
    /// precision receives `f32` boundary values; the identity at `f32`).
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        if let Some(first) = self.layers.first() {
            x = x.cast(first.weight.val().dtype());
        }
        let n = self.layers.len();
        self.layers.iter().enumerate().fold(x, |h, (i, l)| {
            let h = l.forward(h);
            if self.ends_model && i + 1 == n {
                h
            } else {
                relu(h)
            }
        })
    }
}

/// An MLP with these widths cut into blocks of consecutive layers, `sizes[b]` layers in block
/// `b` (see [`even_split`](crate::parallel::pipeline::even_split) and
/// [`balanced_split`](crate::parallel::pipeline::balanced_split)); `None` when the sizes do not
/// add up to the number of layers or one is zero.
pub fn split_mlp(widths: &[usize], sizes: &[usize], device: &Device) -> Option<Vec<MlpStage>> {
    let layers: Vec<Linear> = widths
        .windows(2)
        .map(|w| crate::parallel::stages::materialize(LinearConfig::new(w[0], w[1]).init(device)))
        .collect();
    if sizes.contains(&0) || sizes.iter().sum::<usize>() != layers.len() {
        return None;
    }
    let mut it = layers.into_iter();
    let last = sizes.len() - 1;
    Some(
        sizes
            .iter()
            .enumerate()
            .map(|(b, &n)| MlpStage {
                layers: it.by_ref().take(n).collect(),
                ends_model: b == last,
            })
            .collect(),
    )
}

/// The one rank-2 tensor crossing every boundary of the demo pipeline.
pub fn rank2(b: &crate::parallel::pipeline_exec::Boundary) -> Tensor<2> {
    match b.first() {
        Some(crate::parallel::pipeline_exec::AnyTensor::D2(t)) => t.clone(),
        other => panic!("the demo pipeline passes one rank-2 tensor, got {other:?}"),
    }
}

/// The demo MLP as pipeline blocks for [`Job::builder().pipeline(..)`](crate::job::JobBuilder):
/// `sizes[b]` layers in block `b`, every block but the last sends its activation on, the last
/// ends in the mean-squared error. `None` when the sizes do not fit the MLP.
pub fn mlp_pipeline(
    widths: &[usize],
    sizes: &[usize],
    device: &Device,
) -> Option<crate::parallel::stages::PipelineStages<Sample>> {
    Some(mlp_pipeline_of(split_mlp(widths, sizes, device)?))
}

/// These blocks of the demo MLP (from [`split_mlp`], or a clone of them: the same initial
/// parameters for every job built from them) as pipeline blocks, as [`mlp_pipeline`] makes
/// them.
pub fn mlp_pipeline_of(parts: Vec<MlpStage>) -> crate::parallel::stages::PipelineStages<Sample> {
    mlp_blocks_of(parts, crate::parallel::stages::BlockOptions::default())
}

/// The demo MLP of `widths` as blocks of one layer each, for
/// [`Job::builder().blocks(..)`](crate::job::JobBuilder::blocks) (fully sharded data
/// parallelism, per-block recomputation): every block but the last trains with `options`.
pub fn mlp_blocks(
    widths: &[usize],
    options: crate::parallel::stages::BlockOptions,
    device: &Device,
) -> Option<crate::parallel::stages::PipelineStages<Sample>> {
    let layers = widths.len().checked_sub(1).filter(|&l| l > 0)?;
    Some(mlp_blocks_of(
        split_mlp(widths, &vec![1; layers], device)?,
        options,
    ))
}

/// These blocks of the demo MLP as blocks training with `options` (the last one, which ends
/// in the loss, trains with the defaults).
pub fn mlp_blocks_of(
    parts: Vec<MlpStage>,
    options: crate::parallel::stages::BlockOptions,
) -> crate::parallel::stages::PipelineStages<Sample> {
    use crate::parallel::pipeline_exec::{AnyTensor, Boundary};
    let last = parts.len().saturating_sub(1);
    let mut stages =
        crate::parallel::stages::PipelineStages::new(|items: &[Sample], d: &Device| {
            vec![AnyTensor::D2(batch_tensors(items, d).0)]
        });
    for (i, part) in parts.into_iter().enumerate() {
        stages = if i == last {
            stages.last(
                part,
                |m: &MlpStage, x: Boundary, items: &[Sample], d: &Device| {
                    let (_, y) = batch_tensors(items, d);
                    let diff = m.forward(rank2(&x)).cast(FloatDType::F32) - y;
                    (diff.clone() * diff).mean()
                },
            )
        } else {
            stages.block(part, options, |m: &MlpStage, x: Boundary| {
                vec![AnyTensor::D2(m.forward(rank2(&x)))]
            })
        };
    }
    stages
}

/// The measured cost of each layer of the demo MLP: the median time, in microseconds, of its
/// forward and backward on a micro-batch of `batch` random inputs (the first layer computes no
/// gradient of its input, like the first pipeline stage). What
/// [`balanced_split`](crate::parallel::pipeline::balanced_split) balances.
pub fn measure_mlp_layers(widths: &[usize], batch: usize, device: &Device) -> Vec<u64> {
    use burn::tensor::Distribution;
    let ad = device.clone().autodiff();
    widths
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let layer = LinearConfig::new(w[0], w[1]).init(&ad);
            // Two untimed runs first: the allocator and the caches warm up.
            let mut times: Vec<u64> = (0..11)
                .map(|_| {
                    let x = Tensor::<2>::random([batch, w[0]], Distribution::Default, &ad);
                    let x = if i == 0 { x } else { x.require_grad() };
                    let g = Tensor::<2>::random([batch, w[1]], Distribution::Default, &ad);
                    let t = std::time::Instant::now();
                    let h = relu(layer.forward(x));
                    let grads = (h * g).sum().backward();
                    drop(grads);
                    t.elapsed().as_micros() as u64
                })
                .collect();
            let mut times = times.split_off(2);
            times.sort_unstable();
            times[times.len() / 2]
        })
        .collect()
}

/// The model kind of [`Mlp`] on the control plane ([`crate::cluster::control::ModelSpec`]):
/// `meshwork train`'s model, registered by the binary like any program's own.
#[cfg(feature = "cluster")]
pub const MLP_KIND: &str = "meshwork-demo-mlp";

/// The [`crate::cluster::control::ModelSpec`] of an [`Mlp`] of `widths` (its configuration:
/// each width as a little-endian `u32`).
#[cfg(feature = "cluster")]
pub fn mlp_spec(widths: &[usize]) -> crate::cluster::control::ModelSpec {
    crate::cluster::control::ModelSpec {
        kind: MLP_KIND.into(),
        config: widths
            .iter()
            .flat_map(|&w| u32::try_from(w).unwrap_or(u32::MAX).to_le_bytes())
            .collect(),
    }
}

/// The widths of the [`Mlp`] `spec` describes. The bytes come from the network, so the model
/// is bounded before it is built: 2 to 64 widths, none 0, at most 2^28 parameters.
#[cfg(feature = "cluster")]
pub fn mlp_widths(
    spec: &crate::cluster::control::ModelSpec,
) -> Result<Vec<usize>, crate::cluster::control::Incompatibility> {
    use crate::cluster::control::Incompatibility;
    if spec.kind != MLP_KIND {
        return Err(Incompatibility::UnknownModel {
            kind: spec.kind.clone(),
        });
    }
    if spec.config.len() > 64 * 4 {
        return Err(Incompatibility::Other(format!(
            "demo MLP: {} configuration bytes, more than 64 widths",
            spec.config.len()
        )));
    }
    let widths: Vec<u32> = spec
        .config
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let params: u64 = widths
        .windows(2)
        .map(|w| u64::from(w[0]) * u64::from(w[1]) + u64::from(w[1]))
        .sum();
    if !spec.config.len().is_multiple_of(4)
        || widths.len() < 2
        || widths.len() > 64
        || widths.contains(&0)
        || params > 1 << 28
    {
        return Err(Incompatibility::Other(format!(
            "demo MLP widths {widths:?} ({} configuration bytes) are not a model this node builds",
            spec.config.len()
        )));
    }
    Ok(widths.iter().map(|&w| w as usize).collect())
}

/// The control plane's structure fingerprint
/// ([`structure_fingerprint`](crate::cluster::control::structure_fingerprint)) of [`Mlp`] built
/// from `spec` on `device` (the model of `meshwork train`; [`mlp_widths`] checks the spec).
#[cfg(feature = "cluster")]
pub fn cluster_fingerprint(
    spec: &crate::cluster::control::JobSpec,
    device: &burn::tensor::Device,
) -> Result<crate::cluster::control::ModelFingerprint, crate::cluster::control::Incompatibility> {
    let widths = mlp_widths(&spec.model)?;
    let model = Mlp::new(&widths, device);
    Ok(crate::cluster::control::structure_fingerprint(
        "demo-mlp", &model,
    ))
}
pub mod gpt;
