//! Your own data: a Burn dataset and a Burn batcher, written without meshwork in mind, trained
//! data-parallel through `FromBurn`; then the trained classifier is scored on held-out points.
//!
//! Run with `cargo run --example own_data`.

// ANCHOR: imports
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use meshwork::prelude::*;
// ANCHOR_END: imports

// ANCHOR: dataset
/// One labelled point of the plane.
#[derive(Debug, Clone)]
struct Point {
    xy: [f32; 2],
    class: u8,
}

/// `n` points in three classes, each scattered around its own centre. Point `i` depends on
/// `i` and `salt` only, so every run (and every process) sees the same data.
fn points(n: usize, salt: u64) -> Vec<Point> {
    (0..n)
        .map(|i| {
            let class = (i % 3) as u8;
            let angle = f32::from(class) * std::f32::consts::TAU / 3.0;
            let jitter = |k: u64| {
                let h = mix((i as u64) << 1 | k, salt);
                (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5 // in [-0.5, 0.5)
            };
            Point {
                xy: [1.5 * angle.cos() + jitter(0), 1.5 * angle.sin() + jitter(1)],
                class,
            }
        })
        .collect()
}

/// SplitMix64's finaliser: a stable hash, so the data does not change with a crate update.
fn mix(x: u64, salt: u64) -> u64 {
    let mut z = x ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
// ANCHOR_END: dataset

// ANCHOR: batcher
/// The tensors of a batch of points.
#[derive(Debug, Clone)]
struct PointBatch {
    inputs: Tensor<2>,
    targets: Tensor<1, Int>,
}

/// A plain Burn batcher: items in, tensors on the device it is handed out.
#[derive(Debug, Clone, Copy)]
struct PointBatcher;

impl Batcher<Point, PointBatch> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> PointBatch {
        let n = items.len();
        let xy: Vec<f32> = items.iter().flat_map(|p| p.xy).collect();
        let classes: Vec<i64> = items.iter().map(|p| i64::from(p.class)).collect();
        PointBatch {
            inputs: Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            targets: Tensor::from_data(TensorData::new(classes, [n]), device),
        }
    }
}
// ANCHOR_END: batcher

// ANCHOR: model
/// Plain Burn: a two-layer classifier.
#[derive(Module, Debug)]
struct Classifier {
    hidden: Linear,
    output: Linear,
}

impl Classifier {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(2, 16).init(device),
            output: LinearConfig::new(16, 3).init(device),
        }
    }

    /// Logits `[batch, 3]` for inputs `[batch, 2]`.
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.output.forward(relu(self.hidden.forward(x)))
    }
}
// ANCHOR_END: model

// ANCHOR: loss
/// What meshwork calls for each micro-batch: the batcher, the model, then the **mean**
/// cross-entropy over the items (Burn's `CrossEntropyLoss` without weights or padding).
fn loss(model: &Classifier, items: &[Point], device: &Device) -> Tensor<1> {
    let batch = PointBatcher.batch(items.to_vec(), device);
    let logits = model.forward(batch.inputs);
    CrossEntropyLossConfig::new()
        .init(device)
        .forward(logits, batch.targets)
}
// ANCHOR_END: loss

// ANCHOR: job
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    // Any `burn::data::dataset::Dataset` will do; Burn's in-memory one here.
    let train = InMemDataset::new(points(1000, 0));
    let data = FromBurn::new(train); // meshwork's view of it: sample id i is Burn's item i
    assert_eq!(data.len(), 1000);

    // One model, drawn once from a seeded device and copied to every replica.
    let device = Device::flex();
    device.seed(1);
    let model = Classifier::new(&device);

    let trained = Job::builder()
        .initial_model(model)
        .loss(loss)
        .data(data)
        .optimizer(AdamConfig::new())
        .learning_rate(1e-2)
        .data_parallel(2)
        .batch_size(96) // 48 per replica; 1000 / 96 = 10 steps an epoch, 40 points left over
        .seed(1) // the order of the data: one permutation per epoch
        .steps(150)
        .build()?
        .spawn()
        .await?
        .join()
        .await?;
    // ANCHOR_END: job

    // ANCHOR: evaluate
    // The trained model is rank 0's, still on its training (autodiff) device: `valid()` is
    // Burn's inference copy of it.
    let model = trained.model.valid();
    let held_out = PointBatcher.batch(points(300, 7), &device);
    let predicted = model.forward(held_out.inputs).argmax(1).into_data();
    let expected = held_out.targets.into_data();
    let correct = predicted
        .iter::<i64>()
        .zip(expected.iter::<i64>())
        .filter(|(p, e)| p == e)
        .count();
    let accuracy = correct as f32 / 300.0;
    println!(
        "loss {:.3} → {:.3}; held-out accuracy {:.1}%",
        trained.summary.first_loss.unwrap_or(f32::NAN),
        trained.summary.last_loss.unwrap_or(f32::NAN),
        accuracy * 100.0
    );
    assert!(accuracy > 0.95, "the three classes are told apart");
    Ok(())
}
// ANCHOR_END: evaluate
