//! Getting the trained model out of a job and saving it: the `Trained` value, a Burn record
//! on disk and loaded back, and the same parameters taken out of the job's last checkpoint.
//!
//! Run with `cargo run --example saving`.

// ANCHOR: imports
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor, TensorData};
use meshwork::checkpoint::{CheckpointStore, restore_module};
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::prelude::*;
// ANCHOR_END: imports

const WIDTHS: [usize; 3] = [8, 32, 2];

#[tokio::main]
async fn main() -> meshwork::Result<()> {
    // A scratch directory of this run, removed at the end.
    let dir = std::env::temp_dir().join(format!("meshwork-saving-{}", std::process::id()));
    let task = TeacherTask {
        d_in: 8,
        d_out: 2,
        noise: 0.1,
        seed: 3,
    };

    // ANCHOR: train
    let trained: Trained<Mlp> = Job::builder()
        .model(|ctx: &ModelContext| Mlp::new(&WIDTHS, &ctx.device))
        .loss(mse_loss)
        .data(task.dataset(1024))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(2)
        .batch_size(64)
        .steps(40)
        .checkpoint_dir(dir.join("checkpoints")) // also written at the end of the run
        .build()?
        .spawn()
        .await?
        .join()
        .await?;
    println!(
        "{} steps, last loss {:.4}",
        trained.summary.steps,
        trained.summary.last_loss.unwrap_or(f32::NAN)
    );
    // ANCHOR_END: train

    // ANCHOR: save
    // A Burn record (burnpack format) of rank 0's parameters.
    let path = dir.join("model.bpk");
    trained
        .model
        .clone()
        .save_file(&path)
        .map_err(|e| meshwork::Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    // ANCHOR_END: save

    // ANCHOR: load
    // Later, in another program: build the same model anywhere, then load the record onto it.
    let device = Device::flex();
    let loaded = Mlp::new(&WIDTHS, &device)
        .try_load_file(&path)
        .map_err(|e| meshwork::Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    // ANCHOR_END: load

    // ANCHOR: from_checkpoint
    // The parameters of the newest checkpoint that verifies, onto a freshly built model.
    let store = CheckpointStore::open(dir.join("checkpoints"), 3)?;
    let newest = store
        .latest_valid()?
        .ok_or_else(|| meshwork::Error::Runtime("no checkpoint was written".into()))?;
    assert_eq!(newest.checkpoint.step, 40, "the end of the run");
    // A data-parallel job has one shard: the whole model (pipeline stage 0).
    let shard = &newest.checkpoint.shards[0];
    let from_checkpoint = restore_module(Mlp::new(&WIDTHS, &device), &shard.params)?;
    // ANCHOR_END: from_checkpoint

    // ANCHOR: compare
    // The three give the same outputs, bit for bit.
    let inputs: Vec<f32> = (0..4 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = Tensor::<2>::from_data(TensorData::new(inputs, [4, 8]), &device);
    let outputs = |model: &Mlp| {
        model
            .forward(x.clone())
            .into_data()
            .iter::<f32>()
            .collect::<Vec<_>>()
    };
    let trained_outputs = outputs(&trained.model.valid());
    assert_eq!(outputs(&loaded), trained_outputs, "the saved record");
    assert_eq!(outputs(&from_checkpoint), trained_outputs, "the checkpoint");
    println!("saved, loaded and restored: the same model");
    // ANCHOR_END: compare

    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
