//! Fixtures for tests of meshwork and of programs that embed it: a plain single-device Burn
//! training loop to compare against, per-tensor comparison of parameters, and the shared
//! plumbing (`fixtures`): the seeded [`TeacherFixture`] (data, initial model, job builder),
//! [`bounded`] waits and [`TempDir`].
//!
//! The reference loop uses no meshwork runtime: Burn's autodiff, `GradientsParams` and the
//! optimizer, on one device, one batch per step. Only the gradient clipping is computed here
//! with Burn tensor ops (Burn's own clipping is per parameter, meshwork's is by global norm).

mod fixtures;
// CI-1: not in the library's own test build, which nothing links to.
#[cfg(not(test))]
pub mod instances;
pub mod processes;

pub use fixtures::{TeacherFixture, TempDir, bounded};

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::data::Dataset;
use crate::events::StepDone;
use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::gradients::{ParamLayout, parameters_to_flat};

/// Burn's random generator is process-global (on Flex) and a test binary's tests run on
/// parallel threads: hold this guard while seeding and drawing a model, so the draws of one
/// test are not interleaved with another's (the same seed then gives the same model).
pub fn draw_lock() -> std::sync::MutexGuard<'static, ()> {
    static DRAW: std::sync::Mutex<()> = std::sync::Mutex::new(());
    DRAW.lock().unwrap_or_else(|e| e.into_inner())
}

/// Settings of the reference loop.
#[derive(Debug, Clone)]
pub struct Reference {
    /// The optimizer.
    pub optimizer: OptimizerConfig,
    /// The learning rate.
    pub learning_rate: LearningRate,
    /// Global-norm clipping, as in the job.
    pub clip_norm: Option<f32>,
}

/// Train `model` with a plain Burn loop on `device`: one optimizer step per entry of
/// `batches` (sample ids), loss from `loss`.
pub fn reference_train<M, D>(
    model: M,
    loss: impl Fn(&M, &[D::Item], &Device) -> Tensor<1>,
    data: &D,
    batches: &[Vec<usize>],
    settings: &Reference,
    device: &Device,
) -> M
where
    M: Module,
    D: Dataset,
{
    let ad = device.clone().autodiff();
    let mut model = model.fork(&ad).train();
    let mut optim = settings.optimizer.init();
    let mut lr = settings.learning_rate.clone();
    for ids in batches {
        let items: Vec<D::Item> = ids
            .iter()
            .map(|&i| {
                data.get(i)
                    .expect("reference batch ids come from the dataset")
            })
            .collect();
        let l = loss(&model, &items, &ad);
        let mut grads = GradientsParams::from_grads(l.backward(), &model);
        if let Some(max_norm) = settings.clip_norm {
            grads = clip_reference(&model, grads, max_norm);
        }
        model = optim.step(lr.next_rate(), model, grads);
    }
    model
}

/// Global-norm clipping with Burn tensor ops (independent of meshwork's flat-buffer version).
fn clip_reference<M: Module>(model: &M, grads: GradientsParams, max_norm: f32) -> GradientsParams {
    use burn::module::{ModuleVisitor, Param};
    struct SumSq<'a>(&'a GradientsParams, f64);
    impl ModuleVisitor for SumSq<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                let s: f32 = (g.clone() * g).sum().into_scalar();
                self.1 += f64::from(s);
            }
        }
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(p.id) {
                self.0.register::<D>(p.id, g * self.1);
            }
        }
    }
    let mut s = SumSq(&grads, 0.0);
    model.visit(&mut s);
    let norm = s.1.sqrt() as f32;
    let coef = max_norm / (norm + 1e-6);
    let mut grads = grads;
    if coef < 1.0 {
        model.visit(&mut Scale(&mut grads, coef));
    }
    grads
}

/// The global batches of a run, read from its step-done events: each step's replicas' sample
/// ids concatenated in rank order (the skipped steps left out).
pub fn batches_from_events(steps: &[StepDone]) -> Vec<Vec<usize>> {
    steps
        .iter()
        .filter(|s| !s.skipped)
        .map(|s| {
            s.replicas
                .iter()
                // A pipeline's stages (and a stage's tensor-parallel ranks) all report their
                // replica's samples: count them once.
                .filter(|r| r.stage.stage == 0 && r.stage.tp == 0)
                .flat_map(|r| r.sample_ids.clone())
                .collect()
        })
        .collect()
}

/// Every float parameter's exact bits, tensor by tensor in module order: two models are bitwise
/// equal (REPRO-1) exactly when these are.
pub fn parameter_bits<M: Module>(model: &M) -> Vec<Vec<u32>> {
    crate::checkpoint::snapshot_module(model)
        .params()
        .iter()
        .map(|p| p.values.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// The number of float parameter values of `model` (every tensor's element count, summed):
/// the size of the flat buffer that gradients and ZeRO shards are cut from.
pub fn parameter_count<M: Module>(model: &M) -> usize {
    ParamLayout::of(model).len()
}

/// Per parameter tensor: `max|a − b| ≤ rel · max|b|` (b is the reference). Returns the worst
/// ratio `max|a − b| / max|b|` over tensors, or a description of the first tensor that fails.
pub fn compare_parameters<M: Module>(a: &M, b: &M, rel: f32) -> Result<f32, String> {
    let la = ParamLayout::of(a);
    let lb = ParamLayout::of(b);
    if la.len() != lb.len() || la.slots().len() != lb.slots().len() {
        return Err(format!(
            "different parameter layouts: {} vs {} elements",
            la.len(),
            lb.len()
        ));
    }
    let fa = parameters_to_flat(a, &la);
    let fb = parameters_to_flat(b, &lb);
    let mut worst = 0.0f32;
    for (i, slot) in lb.slots().iter().enumerate() {
        let (x, y) = (&fa[slot.range.clone()], &fb[slot.range.clone()]);
        let max_ref = y.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let max_diff = x
            .iter()
            .zip(y)
            .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
        if max_diff.is_nan() || max_diff > rel * max_ref {
            return Err(format!(
                "tensor {i} (shape {:?}): max|a-b| = {max_diff:e} > {rel:e} * max|ref| = {:e}",
                slot.shape,
                rel * max_ref
            ));
        }
        if max_ref > 0.0 {
            worst = worst.max(max_diff / max_ref);
        }
    }
    Ok(worst)
}

/// [`run_recording`], calling `on_step` with the step and the job's controls as each step's
/// report arrives (a resize, a pause or a checkpoint asked while the job runs; each takes
/// effect at a later step boundary).
pub async fn run_controlled<M, I>(
    job: crate::job::Job<M, I>,
    on_step: impl Fn(u64, &crate::job::JobControl) + Send + 'static,
) -> (
    crate::error::Result<crate::job::Trained<M>>,
    Vec<crate::events::JobEvent>,
)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    let handle = match job.spawn().await {
        Ok(h) => h,
        Err(e) => return (Err(e), Vec::new()),
    };
    let control = handle.control();
    let mut stream = handle.events();
    let recorder = tokio::spawn(async move {
        let mut events = Vec::new();
        loop {
            match stream.recv().await {
                Ok(e) => {
                    if let crate::events::JobEvent::StepDone(s) = &e {
                        on_step(s.step, &control);
                    }
                    events.push(e);
                }
                Err(crate::job::EventsError::Missed(_)) => continue,
                Err(crate::job::EventsError::Closed) => break,
            }
        }
        events
    });
    let outcome = handle.join().await;
    let events = recorder.await.unwrap_or_default();
    (outcome, events)
}

/// Spawn `job`, record every event until it ends, and return its outcome with the events.
pub async fn run_recording<M, I>(
    job: crate::job::Job<M, I>,
) -> (
    crate::error::Result<crate::job::Trained<M>>,
    Vec<crate::events::JobEvent>,
)
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    run_controlled(job, |_, _| {}).await
}

/// Each rank's final parameter fingerprint, from the `Finished` event among `events`.
pub fn final_fingerprints(events: &[crate::events::JobEvent]) -> Option<Vec<u64>> {
    events.iter().find_map(|e| match e {
        crate::events::JobEvent::Finished { fingerprints, .. } => Some(fingerprints.clone()),
        _ => None,
    })
}

/// The step-done events among `events` that count: after a rollback (REC-5) the steps run
/// again replace the ones that were rolled back, so the result is the history the final model
/// went through, in step order.
pub fn steps_of(events: &[crate::events::JobEvent]) -> Vec<StepDone> {
    let mut steps: Vec<StepDone> = Vec::new();
    for e in events {
        if let crate::events::JobEvent::StepDone(s) = e {
            // After a rollback (REC-5) the steps run again replace the ones rolled back.
            steps.retain(|t| t.step < s.step);
            steps.push(s.clone());
        }
    }
    steps
}
