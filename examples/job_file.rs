//! A job kept as a file: a service holds its training settings in TOML (here its own config
//! file, with the job as one table of it), reads them into a `JobConfig`, and trains its own
//! model with them; the program adds what a file cannot hold (the model, the loss, the data).
//! A bad key is refused naming it, before anything trains. Checks that the job trains the
//! file's steps with its strategies (ZeRO-1, clipping and accumulation over 2 replicas).
//!
//! Run with `cargo run --example job_file`.

// ANCHOR: imports
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::job_config::{ConfigError, JobConfig};
use meshwork::prelude::*;
use serde::Deserialize;
// ANCHOR_END: imports

// ANCHOR: file
/// The service's own configuration: its fields, and the training job as one table.
#[derive(Deserialize)]
struct ServiceConfig {
    name: String,
    training: JobConfig,
}

const SERVICE_TOML: &str = r#"
name = "ranker"

[training]
steps = 40
batch_size = 64
data_parallel = 2
learning_rate = 0.003
clip_norm = 1.0
accumulation = 2
optimizer = { Adam = {} }

[training.reduction]
zero = "One"

[training.comm]
timeout = "20s"
"#;
// ANCHOR_END: file

// ANCHOR: main
#[tokio::main]
async fn main() -> meshwork::Result<()> {
    let service: ServiceConfig = toml::from_str(SERVICE_TOML)
        .map_err(|e| Error::InvalidConfig(format!("the service's config: {e}")))?;
    let task = TeacherTask {
        d_in: 16,
        d_out: 4,
        noise: 0.1,
        seed: 2,
    };
    let device = burn::tensor::Device::flex();
    device.seed(2);
    let builder = Job::builder()
        .with_config(service.training)
        .initial_model(Mlp::new(&[16, 64, 4], &device))
        .loss(mse_loss)
        .data(task.dataset(4096));
    let plan = builder.plan().to_string();
    println!("{}: {plan}", service.name);
    assert!(plan.contains(".zero(One)") && plan.contains(".clip_grad_norm(1)"));
    let trained = builder.build()?.spawn().await?.join().await?;
    let s = &trained.summary;
    let (first, last) = (
        s.first_loss.unwrap_or(f32::NAN),
        s.last_loss.unwrap_or(f32::NAN),
    );
    println!("{} steps: loss {first:.4} -> {last:.4}", s.steps);
    assert_eq!(s.steps, 40, "the file's steps");
    assert!(last < first, "the loss falls");
    // ANCHOR_END: main

    // ANCHOR: refused
    // A key the description does not have is refused, naming it and what is accepted.
    match JobConfig::from_toml("[reduction]\nzeroo = \"One\"") {
        Err(ConfigError::Key { key, reason }) => {
            println!("refused: key `{key}`: {reason}");
            assert_eq!(key, "reduction.zeroo");
        }
        other => panic!("an unknown key must be refused, got {other:?}"),
    }
    // ANCHOR_END: refused
    Ok(())
}
