//! Profiling a model for the planner through the embedding API: the blocks a user builds
//! with [`PipelineStages`] run as one-device jobs, and their own timelines and memory counts
//! give the planner's [`ModelCosts`] (`meshwork::planner`).
//!
//! Three short runs on one device (a block job, Adam): the whole batch and a small one
//! (each block's forward and backward as `fixed + per sample × samples`, through the two
//! sizes), and the whole batch again with every block recomputing (what a recomputing block
//! stashes). Parameters are the blocks' own counts; the boundary tensors a block stashes are
//! the worker's count (MEM-1), read off the step's memory timeline as it rises block by block
//! through the forwards. Parameters are all of a block's (`Module::num_params`, frozen ones
//! too). A tensor-parallel block ([`PipelineStages::tp_block`]) is planned at tp 1 only
//! here: what a rank holds at each degree and what its all-reduces move are the model's to
//! state (the GPT's `held_parameters`), so a caller that knows them sets each block's
//! `params`, `splits` and `tp_bytes` and extends [`ModelCosts::tp_degrees`].

use burn::optim::AdamConfig;

use super::{BlockOptions, Job, JobEvent, PipelineStages, StepDone};
use crate::data::Dataset;
use crate::error::{Error, Result};
use crate::parallel::pipeline::InstrKind;
use crate::planner::{BlockCosts, ModelCosts};

/// What [`profile`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// The model's blocks with their costs (tp 1).
    pub costs: ModelCosts,
    /// Seconds Adam's step took per parameter element (its trace span).
    pub optimizer_s_per_param: f64,
    /// Seconds of a one-device step that were neither a block's compute nor the optimizer
    /// (the runtime's own cost per step).
    pub step_overhead_s: f64,
}

/// How [`profile`] runs: the whole batch, a small one (a micro-batch as small as any layout
/// will run), and the steps of each run (the first two are not timed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProfileRuns {
    /// Samples a step at the larger size (the global batch).
    pub batch: u32,
    /// Samples a step at the smaller size.
    pub small_batch: u32,
    /// Steps of each run, at least 3.
    pub steps: u64,
}

/// Measures `stages` (built by `blocks` for the options asked) on `data`: see the module's
/// docs. `name` names the model in the planner's report.
pub async fn profile<I, D>(
    name: &str,
    blocks: impl Fn(BlockOptions) -> Result<PipelineStages<I>>,
    data: D,
    runs: ProfileRuns,
) -> Result<Profile>
where
    I: Send + Sync + 'static,
    D: Dataset<Item = I> + Clone + Send + Sync + 'static,
{
    let ProfileRuns {
        batch,
        small_batch,
        steps,
    } = runs;
    if batch == 0 || small_batch == 0 || small_batch >= batch || steps < 3 {
        return Err(Error::InvalidConfig(format!(
            "profile: sizes {batch} and {small_batch} (0 < small < whole) and {steps} steps (at least 3)"
        )));
    }
    let plain = blocks(BlockOptions::default())?;
    let parameters = plain.parameters();
    let n = parameters.len();
    let big = Measured::of(&run(plain, data.clone(), batch, steps).await?, n);
    let small = Measured::of(
        &run(
            blocks(BlockOptions::default())?,
            data.clone(),
            small_batch,
            steps,
        )
        .await?,
        n,
    );
    let recomputed = Measured::of(
        &run(
            blocks(BlockOptions::default().recompute(true))?,
            data,
            batch,
            3,
        )
        .await?,
        n,
    );
    let (stash, recompute_stash) = match (big.stash, recomputed.stash) {
        (Some(s), Some(r)) => (s, r),
        _ => {
            return Err(Error::Runtime(format!(
                "profile {name}: the step's memory timeline does not rise once per block's \
                 forward ({n} blocks), so its stash cannot be attributed to blocks"
            )));
        }
    };
    // Each block: t = fixed + per_sample × samples, through the two sizes.
    let fit = |a: f64, b: f64| {
        let per = ((a - b) / f64::from(batch - small_batch)).max(0.0);
        ((b - per * f64::from(small_batch)).max(0.0), per)
    };
    let per_sample = |bytes: u64| bytes / u64::from(batch);
    let block_costs = (0..n)
        .map(|b| {
            let (forward_fixed_s, forward_s) = fit(big.forward[b], small.forward[b]);
            let (backward_fixed_s, backward_s) = fit(big.backward[b], small.backward[b]);
            BlockCosts {
                params: vec![(1, parameters[b] as u64)],
                forward_s,
                forward_fixed_s,
                backward_s,
                backward_fixed_s,
                stash_bytes: per_sample(stash[b]),
                recompute_stash_bytes: per_sample(recompute_stash[b]),
                splits: false,
                tp_bytes: 0,
            }
        })
        .collect();
    let elements: usize = parameters.iter().sum();
    Ok(Profile {
        costs: ModelCosts {
            name: name.to_string(),
            blocks: block_costs,
            tp_degrees: vec![1],
        },
        optimizer_s_per_param: big.optimizer_s / elements.max(1) as f64,
        step_overhead_s: big.overhead_s,
    })
}

/// One run of `stages` on one device: its steps.
async fn run<I, D>(
    stages: PipelineStages<I>,
    data: D,
    batch: u32,
    steps: u64,
) -> Result<Vec<StepDone>>
where
    I: Send + Sync + 'static,
    D: Dataset<Item = I> + Send + Sync + 'static,
{
    let handle = Job::builder()
        .blocks(stages)
        .data(data)
        .batch_size(batch as usize)
        .optimizer(AdamConfig::new())
        .learning_rate(1e-3)
        .steps(steps)
        .seed(5)
        .build()?
        .spawn()
        .await?;
    let mut events = handle.events();
    let mut done = Vec::new();
    while let Ok(event) = events.recv().await {
        if let JobEvent::StepDone(s) = event {
            done.push(s);
        }
    }
    handle.join().await?;
    if done.len() as u64 != steps {
        return Err(Error::Runtime(format!(
            "profile: saw {} of {steps} steps",
            done.len()
        )));
    }
    Ok(done)
}

/// Medians over a run's timed steps (all but the first two).
struct Measured {
    forward: Vec<f64>,
    backward: Vec<f64>,
    optimizer_s: f64,
    overhead_s: f64,
    /// Bytes each block stashed at the whole micro-batch, if the timeline rose once per
    /// block.
    stash: Option<Vec<u64>>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

impl Measured {
    fn of(steps: &[StepDone], blocks: usize) -> Self {
        let mut forward = vec![Vec::new(); blocks];
        let mut backward = vec![Vec::new(); blocks];
        let (mut optimizer, mut overhead) = (Vec::new(), Vec::new());
        let mut stash = None;
        for s in steps.iter().skip(2) {
            let Some(r) = s.replicas.first() else {
                continue;
            };
            if let Some(p) = &r.pipeline {
                for t in &p.executed {
                    let took = t.end.saturating_sub(t.start) as f64 * 1e-6;
                    let b = t.instr.chunk().0 as usize;
                    match t.instr.kind() {
                        InstrKind::Forward if b < blocks => forward[b].push(took),
                        InstrKind::Backward if b < blocks => backward[b].push(took),
                        _ => {}
                    }
                }
                stash = rises(&p.memory.timeline, blocks);
            }
            let opt = r.optimizer_s();
            optimizer.push(opt);
            overhead.push((s.wall_s - r.compute_s() - opt).max(0.0));
        }
        Measured {
            forward: forward.into_iter().map(median).collect(),
            backward: backward.into_iter().map(median).collect(),
            optimizer_s: median(optimizer),
            overhead_s: median(overhead),
            stash,
        }
    }
}

/// The stashed bytes of each block from a one-micro-batch step's timeline: the activations
/// rise once per forward, block by block, to their peak; `None` if they do not rise exactly
/// `blocks` times.
fn rises(timeline: &[crate::parallel::memory::MemoryPoint], blocks: usize) -> Option<Vec<u64>> {
    let mut out = Vec::new();
    let mut last = 0u64;
    for point in timeline {
        if point.activations < last {
            break;
        }
        if point.activations > last {
            out.push(point.activations - last);
            last = point.activations;
        }
    }
    (out.len() == blocks).then_some(out)
}
