//! CLIP-1 on a user's model that mixes a tensor-parallel block (column- and row-parallel
//! linears with a replicated LayerNorm and a replicated bias inside it) with an ordinary
//! block that every tensor-parallel rank runs whole. Global-norm clipping that bites must
//! count each element of the one-device model once: the ordinary block's parameters and the
//! split block's replicated ones once over the tensor-parallel group, the split slices once
//! each. tp 2, dp 2 × tp 2, pp 2 × tp 2 and dp 2 × tp 2 under ZeRO-1 and ZeRO-3 equal one
//! device, twice bitwise.

use burn::module::{Module, ParamId};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Tensor, TensorData};
use meshwork::parallel::pipeline_exec::{AnyTensor, Boundary};
use meshwork::parallel::stages::PipelineStages;
use meshwork::parallel::tensor::layers::{ColumnParallelLinear, RowParallelLinear};
use meshwork::parallel::tensor::{TensorParallel, TensorParallelModule};

use super::*;

const D: usize = 8;
const HIDDEN: usize = 16;
const OUT: usize = 3;
/// A threshold well under the gradient's norm at every step (asserted: the clip bites).
const CLIP: f32 = 0.05;

/// One sample: features and a regression target.
#[derive(Debug, Clone)]
struct Sample {
    x: Vec<f32>,
    y: Vec<f32>,
}

fn samples() -> InMemoryDataset<Sample> {
    let mut s = 7u64;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    InMemoryDataset::new(
        (0..64)
            .map(|_| {
                let x: Vec<f32> = (0..D).map(|_| next()).collect();
                let y = (0..OUT)
                    .map(|o| x[o] * x[o + 1] + 0.5 * x[(o + 4) % D])
                    .collect();
                Sample { x, y }
            })
            .collect(),
    )
}

/// The split block: `norm(x + down(gelu(up(x))))`, `up` by columns, `down` by rows (its bias
/// replicated), the LayerNorm replicated.
#[derive(Module, Debug)]
struct Mixer {
    up: ColumnParallelLinear,
    down: RowParallelLinear,
    norm: LayerNorm,
}

impl TensorParallelModule for Mixer {
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize)) {
        self.up.split_params(split);
        self.down.split_params(split);
    }
}

impl Mixer {
    fn forward(&self, x: Tensor<2>, tp: &TensorParallel) -> Tensor<2> {
        let h = gelu(self.up.forward(x.clone(), tp));
        self.norm.forward(x + self.down.forward(h, tp))
    }
}

/// The ordinary block: a linear head with a mean squared error.
#[derive(Module, Debug)]
struct Head {
    linear: Linear,
}

impl Head {
    fn loss(&self, x: Tensor<2>, items: &[Sample], device: &Device) -> Tensor<1> {
        let y: Vec<f32> = items.iter().flat_map(|s| s.y.clone()).collect();
        let y = Tensor::<2>::from_data(TensorData::new(y, [items.len(), OUT]), device);
        let diff = self.linear.forward(x) - y;
        (diff.clone() * diff).mean()
    }
}

/// The one-device model.
#[derive(Module, Debug)]
struct Net {
    mixer: Mixer,
    head: Head,
}

fn features(items: &[Sample], device: &Device) -> Tensor<2> {
    let x: Vec<f32> = items.iter().flat_map(|s| s.x.clone()).collect();
    Tensor::from_data(TensorData::new(x, [items.len(), D]), device)
}

fn net_loss(net: &Net, items: &[Sample], device: &Device) -> Tensor<1> {
    let x = net
        .mixer
        .forward(features(items, device), &TensorParallel::single());
    net.head.loss(x, items, device)
}

fn initial_net() -> Net {
    let _draw = draw_lock();
    let device = Device::flex();
    device.seed(47);
    Net {
        mixer: Mixer {
            up: ColumnParallelLinear::new(D, HIDDEN, true, &device),
            down: RowParallelLinear::new(HIDDEN, D, true, &device),
            norm: LayerNormConfig::new(D).init(&device),
        },
        head: Head {
            linear: LinearConfig::new(D, OUT).init(&device),
        },
    }
}

fn blocks(net: Net) -> PipelineStages<Sample> {
    PipelineStages::new(|items: &[Sample], d: &Device| vec![AnyTensor::D2(features(items, d))])
        .tp_block(net.mixer, |m: &Mixer, x: Boundary, tp| {
            let AnyTensor::D2(x) = &x[0] else {
                panic!("the mixer takes a matrix")
            };
            vec![AnyTensor::D2(m.forward(x.clone(), tp))]
        })
        .last(
            net.head,
            |m: &Head, x: Boundary, items: &[Sample], d: &Device| {
                let AnyTensor::D2(x) = &x[0] else {
                    panic!("the head takes a matrix")
                };
                m.loss(x.clone(), items, d)
            },
        )
}

struct MixedCase {
    name: &'static str,
    layout: Layout,
    zero: ZeroStage,
}

impl MixedCase {
    fn job(&self, init: &Net, clip: Option<f32>) -> Job<PipelineModel, Sample> {
        let Layout { dp, pp, tp } = self.layout;
        let stages = blocks(init.clone());
        let b = if pp > 1 {
            Job::builder().pipeline(stages, Schedule::GPipe { micro_batches: 2 })
        } else {
            Job::builder().blocks(stages)
        };
        let mut b = b
            .tensor_parallel(tp)
            .data_parallel(dp)
            .data(samples())
            .optimizer(sgd())
            .learning_rate(LR)
            .batch_size(BATCH)
            .steps(STEPS)
            .seed(5)
            .zero(self.zero)
            .collective_timeout(Duration::from_secs(20))
            .step_timeout(Duration::from_secs(60));
        if let Some(c) = clip {
            b = b.clip_grad_norm(c);
        }
        b.build().unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    async fn train(&self, init: &Net) -> (Net, Vec<StepDone>) {
        let (out, events) = bounded(BOUND, run_recording(self.job(init, Some(CLIP)))).await;
        let mut model: PipelineModel = out
            .unwrap_or_else(|e| {
                panic!("{}: {e}; events: {:#?}", self.name, events_summary(&events))
            })
            .model;
        let net = Net {
            mixer: model.take_block::<Mixer>(0).expect("the trained mixer"),
            head: model.take_block::<Head>(1).expect("the trained head"),
        };
        (net, steps_of(&events))
    }

    fn reference(init: &Net, steps: &[StepDone], clip: Option<f32>) -> Net {
        reference_train(
            init.clone(),
            net_loss,
            &samples(),
            &batches_from_events(steps),
            &Reference {
                optimizer: sgd().into(),
                learning_rate: LearningRate::Constant(LR),
                clip_norm: clip,
            },
            &Device::flex(),
        )
    }

    /// Every rank of the layout reported every step, each tensor-parallel rank all-reduced
    /// its activations and holds only its slice of the split block.
    fn assert_distributed(&self, init: &Net, steps: &[StepDone]) {
        let Layout { dp, pp, tp } = self.layout;
        assert_eq!(steps.len() as u64, STEPS, "{}", self.name);
        let whole_mixer = parameter_count(&init.mixer) as u64;
        for step in steps {
            assert_eq!(
                step.replicas.len(),
                (dp * pp * tp) as usize,
                "{}: one report per rank",
                self.name
            );
            for r in &step.replicas {
                let p = r.pipeline.as_ref().expect("a block job's record");
                let traffic = p.tensor_parallel.expect("a tensor-parallel rank's traffic");
                if r.stage.stage == 0 {
                    assert!(
                        traffic.activation_reduces > 0,
                        "{}: rank {} all-reduced the row-parallel output",
                        self.name,
                        r.rank.0
                    );
                    if self.zero != ZeroStage::Three {
                        assert!(
                            p.memory.peak_full_params < 4 * whole_mixer,
                            "{}: rank {} holds a slice of the mixer",
                            self.name,
                            r.rank.0
                        );
                    }
                }
            }
        }
    }

    /// Within `TOLERANCE` of the clipped one-device loop (and not of the unclipped one: the
    /// clip bit), split over every rank, bitwise the same when run again.
    async fn equals_one_device(&self) {
        let init = initial_net();
        let (trained, steps) = self.train(&init).await;
        self.assert_distributed(&init, &steps);
        let want = Self::reference(&init, &steps, Some(CLIP));
        let worst = compare_parameters(&trained, &want, TOLERANCE)
            .unwrap_or_else(|e| panic!("{}: {e}", self.name));
        println!("{}: worst relative difference {worst:e}", self.name);
        let unclipped = Self::reference(&init, &steps, None);
        assert!(
            compare_parameters(&unclipped, &want, TOLERANCE).is_err(),
            "{}: the clip bit",
            self.name
        );
        let (again, _) = self.train(&init).await;
        assert_eq!(
            parameter_bits(&again),
            parameter_bits(&trained),
            "{}: bitwise repeatable",
            self.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clip_1_a_model_mixing_split_and_ordinary_blocks_equals_one_device() {
    let case = |name, dp, pp, tp, zero| MixedCase {
        name,
        layout: Layout { dp, pp, tp },
        zero,
    };
    for c in [
        case("tp 2", 1, 1, 2, ZeroStage::Off),
        case("dp 2 × tp 2", 2, 1, 2, ZeroStage::Off),
        case("pp 2 × tp 2", 1, 2, 2, ZeroStage::Off),
        case("dp 2 × tp 2, ZeRO-1", 2, 1, 2, ZeroStage::One),
        case("dp 2 × tp 2, ZeRO-3", 2, 1, 2, ZeroStage::Three),
    ] {
        c.equals_one_device().await;
    }
}
