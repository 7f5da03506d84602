//! The scenario most tests start from, and the plumbing every test needs: a seeded
//! noisy-teacher task (its data, an initial model and a data-parallel job builder), a bound on
//! a test's wait, and a temporary directory that cleans up after itself.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::tensor::Device;

use crate::data::InMemoryDataset;
use crate::demo::{Mlp, Sample, TeacherTask, mse_loss};
use crate::job::{Job, JobBuilder};

/// Runs `f`, panicking with the bound when it takes longer than `limit`: the test fails
/// naming its bound instead of hanging.
pub async fn bounded<T>(limit: Duration, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, f).await {
        Ok(out) => out,
        Err(_) => panic!("test exceeded its {} s bound", limit.as_secs()),
    }
}

/// A fresh directory under the system's temporary directory, named for the test and the
/// process (so parallel tests and concurrent runs do not share one), emptied when made and
/// removed when dropped.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// `meshwork-{name}-{process id}`, empty.
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("meshwork-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        Self { path }
    }

    /// Where it is (not created: a job's checkpoint store makes it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path of `name` inside it.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A seeded noisy-teacher scenario: the demo teacher's samples, the demo MLP drawn from its
/// own seed, and a data-parallel job over them with the MSE loss. Two fixtures with the same
/// settings give the same data and bitwise the same initial model.
#[derive(Debug, Clone)]
pub struct TeacherFixture {
    /// The task the samples come from (its seed is the data's).
    pub task: TeacherTask,
    /// Samples in the data set.
    pub samples: usize,
    /// The MLP's widths, input to output (`task.d_in` first, `task.d_out` last).
    pub widths: Vec<usize>,
    /// Seed of the initial model's parameters.
    pub model_seed: u64,
}

impl TeacherFixture {
    /// 256 samples of an 8 → 3 teacher with noise 0.1 drawn from `data_seed`, and an
    /// 8-32-16-3 MLP drawn from `model_seed`.
    pub fn new(data_seed: u64, model_seed: u64) -> Self {
        Self {
            task: TeacherTask {
                d_in: 8,
                d_out: 3,
                noise: 0.1,
                seed: data_seed,
            },
            samples: 256,
            widths: vec![8, 32, 16, 3],
            model_seed,
        }
    }

    /// The same scenario with an MLP of these widths (the task's input and output widths
    /// follow the first and last).
    pub fn with_widths(mut self, widths: &[usize]) -> Self {
        if let (Some(first), Some(last)) = (widths.first(), widths.last()) {
            self.task.d_in = *first;
            self.task.d_out = *last;
        }
        self.widths = widths.to_vec();
        self
    }

    /// The same scenario with `n` samples.
    pub fn with_samples(mut self, n: usize) -> Self {
        self.samples = n;
        self
    }

    /// The same scenario with this target noise.
    pub fn with_noise(mut self, noise: f32) -> Self {
        self.task.noise = noise;
        self
    }

    /// The samples.
    pub fn data(&self) -> InMemoryDataset<Sample> {
        self.task.dataset(self.samples)
    }

    /// The initial model, drawn on Flex under [`super::draw_lock`] (the same seed gives the
    /// same model whatever other tests draw meanwhile).
    pub fn initial_model(&self) -> Mlp {
        let _draw = super::draw_lock();
        let device = Device::flex();
        device.seed(self.model_seed);
        Mlp::new(&self.widths, &device)
    }

    /// A job training `init` on the samples with the MSE loss: `dp` replicas, a global
    /// batch of `batch`, `steps` steps; the builder's other settings are its defaults.
    pub fn builder(
        &self,
        init: &Mlp,
        dp: u32,
        batch: usize,
        steps: u64,
    ) -> JobBuilder<Mlp, Sample> {
        Job::builder()
            .initial_model(init.clone())
            .loss(mse_loss)
            .data(self.data())
            .data_parallel(dp)
            .batch_size(batch)
            .steps(steps)
    }
}
