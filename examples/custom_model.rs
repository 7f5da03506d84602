//! Your own model and data: a Burn module written without meshwork in mind, a dataset
//! implementing `meshwork::data::Dataset`, trained with gradient accumulation and clipping.
//!
//! Run with `cargo run --example custom_model`.

// ANCHOR: imports
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::tensor::{Device, Tensor, TensorData};
use meshwork::prelude::*;
// ANCHOR_END: imports

// ANCHOR: model
/// Plain Burn: a linear regression `y = w·x + b`.
#[derive(Module, Debug)]
struct Regression {
    linear: Linear,
}

impl Regression {
    fn new(device: &Device) -> Self {
        Self {
            linear: LinearConfig::new(3, 1).init(device),
        }
    }
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.linear.forward(x)
    }
}
// ANCHOR_END: model

// ANCHOR: data
/// Points on the plane y = 2a − b + 0.5c + 1, computed on demand.
struct Plane;

impl Dataset for Plane {
    type Item = ([f32; 3], f32);
    fn len(&self) -> usize {
        1024
    }
    fn get(&self, i: usize) -> Option<Self::Item> {
        (i < self.len()).then(|| {
            let x = [
                (i % 7) as f32 / 7.0,
                (i % 11) as f32 / 11.0,
                (i % 13) as f32 / 13.0,
            ];
            (x, 2.0 * x[0] - x[1] + 0.5 * x[2] + 1.0)
        })
    }
}

fn loss(model: &Regression, items: &[([f32; 3], f32)], device: &Device) -> Tensor<1> {
    let n = items.len();
    let x: Vec<f32> = items.iter().flat_map(|(x, _)| *x).collect();
    let y: Vec<f32> = items.iter().map(|(_, y)| *y).collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [n, 3]), device);
    let y = Tensor::<2>::from_data(TensorData::new(y, [n, 1]), device);
    let diff = model.forward(x) - y;
    (diff.clone() * diff).mean()
}
// ANCHOR_END: data

// ANCHOR: job
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let trained = Job::builder()
        .model(|ctx: &ModelContext| Regression::new(&ctx.device))
        .loss(loss)
        .data(Plane)
        .optimizer(SgdConfig::new().with_momentum(Some(MomentumConfig::new())))
        .learning_rate(0.05)
        .data_parallel(2)
        .batch_size(64)
        .gradient_accumulation(4) // 4 micro-batches of 8 per replica, one update
        .clip_grad_norm(5.0)
        .steps(300)
        .build()?
        .spawn()
        .await?
        .join()
        .await?;
    let loss = trained.summary.last_loss.unwrap_or(f32::NAN);
    println!("final loss {loss:.5}");
    assert!(loss < 0.01, "the plane is learnt");
    Ok(())
}
// ANCHOR_END: job
