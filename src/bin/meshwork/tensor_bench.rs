//! `meshwork bench tensor`: one GPT transformer layer (pre-norm causal self-attention split by
//! heads, then the pre-norm MLP split column → row) trained as a block job over a
//! tensor-parallel group of `tp` ranks, against the same layer with `tp` 1, measured in the
//! same run (the two sides alternated, the median of each kept; this machine is shared).
//!
//! The model is three blocks: a replicated LayerNorm (so that the attention block's input
//! needs a gradient and Megatron's backward `f` runs at it), the attention as a
//! tensor-parallel block, and the MLP as the tensor-parallel last block with a mean-squared
//! error against a fixed random target. Items are fixed random `[seq, hidden]` inputs and
//! targets.
//!
//! Figures: samples/s of both sides; the activation bytes the tensor-parallel group's rank 0
//! all-reduced per layer per micro-batch, against Megatron's figure (two all-reduces of
//! `b·s·h` values in the forward, `g` after each row-parallel layer, and two in the backward,
//! `f` at each block's input: `4 · b·s·h · 4` bytes in f32); the share of the step's wall time
//! rank 0 spent in the group's collectives; and how far the two sides' losses are apart (the
//! same model trained two ways).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use burn::nn::{LayerNorm, LayerNormConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Tensor, TensorData};
use meshwork::data::InMemoryDataset;
use meshwork::error::{Error, Result};
use meshwork::events::StepDone;
use meshwork::job::Job;
use meshwork::parallel::pipeline_exec::{AnyTensor, Boundary};
use meshwork::parallel::stages::{PipelineStages, materialize};
use meshwork::parallel::tensor::TpTraffic;
use meshwork::parallel::tensor::layers::{ParallelMlp, ParallelSelfAttention};
use serde::Serialize;

/// Micro-batches per step: a block job without gradient accumulation runs the step's batch
/// as one micro-batch.
const MICRO_BATCHES: u64 = 1;
/// Seed of the layer's initial parameters (the same on both sides).
const MODEL_SEED: u64 = 11;
/// Seed of the items.
const DATA_SEED: u64 = 23;
/// All-reduces per transformer layer per micro-batch (Megatron): `g` after the attention's
/// and the MLP's row-parallel layer in the forward, `f` at their inputs in the backward.
const REDUCES_PER_LAYER: u64 = 4;

/// What `bench tensor` is asked.
#[derive(Debug, Clone)]
pub(crate) struct TensorBench {
    pub(crate) tp: u32,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) seq: usize,
    pub(crate) batch: usize,
    /// Steps of each run, warm-up included.
    pub(crate) steps: u64,
    /// Alternated runs of each side; the median is kept.
    pub(crate) repeats: usize,
    /// Draw the column/row split of one layer over `tp` ranks into this file.
    pub(crate) svg: Option<PathBuf>,
}

impl TensorBench {
    /// Steps not timed at the start of each run: two, or fewer when the run is shorter (at
    /// least one step is timed).
    pub(crate) fn warmup(&self) -> u64 {
        self.steps.saturating_sub(1).min(2)
    }

    /// Megatron's activation all-reduce bytes per layer per micro-batch: four all-reduces of
    /// `b·s·h` f32 values (none without a group).
    fn expected_bytes(&self) -> u64 {
        if self.tp <= 1 {
            return 0;
        }
        let b = self.batch as u64 / MICRO_BATCHES;
        REDUCES_PER_LAYER * b * (self.seq * self.hidden) as u64 * 4
    }

    pub(crate) fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidConfig(why));
        if self.tp == 0 {
            return bad("--tp 0: use at least 1".into());
        }
        if self.hidden == 0 || self.heads == 0 || self.seq == 0 || self.batch == 0 {
            return bad("--hidden, --heads, --seq and --batch must be at least 1".into());
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(format!(
                "--hidden {} does not split into --heads {}: choose a multiple",
                self.hidden, self.heads
            ));
        }
        if !self.heads.is_multiple_of(self.tp as usize) {
            return bad(format!(
                "--heads {} do not split over --tp {}: choose a degree dividing the heads",
                self.heads, self.tp
            ));
        }
        if self.steps == 0 || self.repeats == 0 {
            return bad("--steps and --repeats must be at least 1".into());
        }
        Ok(())
    }
}

/// What `bench tensor` measures.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TensorFigures {
    tp: u32,
    hidden: usize,
    heads: usize,
    seq: usize,
    batch: usize,
    micro_batches: u64,
    timed_steps: u64,
    repeats: usize,
    samples_per_s: f64,
    baseline_samples_per_s: f64,
    /// `samples_per_s / baseline_samples_per_s`.
    speedup: f64,
    /// Activation bytes rank 0 all-reduced per layer per micro-batch (every step of every
    /// tensor-parallel run, warm-up included: the bytes do not depend on timing).
    allreduce_bytes_per_layer: u64,
    /// Megatron's figure: 2 all-reduces of b·s·h values forward + 2 backward, f32.
    expected_allreduce_bytes_per_layer: u64,
    /// Every step of every run all-reduced exactly the expected bytes.
    bytes_as_expected: bool,
    /// Activation all-reduces per layer per micro-batch (Megatron: 4).
    allreduces_per_layer: f64,
    /// Bytes of replicated parameters' gradients summed over the group per step (TP-2).
    parameter_bytes_per_step: u64,
    /// Seconds rank 0 spent in the group's collectives over the timed steps' wall time
    /// (median run).
    comm_share: f64,
    /// The largest difference between the two sides' losses at the same step, relative to
    /// the baseline's largest loss (last pair of runs): the same model, trained two ways.
    loss_max_rel_diff: f64,
}

/// One item: a fixed random input and target, `[seq, hidden]` each.
#[derive(Debug, Clone)]
struct Item {
    input: Arc<[f32]>,
    target: Arc<[f32]>,
}

/// `n` values uniform in [-1, 1) from `seed` (SplitMix64).
fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn dataset(b: &TensorBench) -> InMemoryDataset<Item> {
    let len = b.seq * b.hidden;
    InMemoryDataset::new(
        (0..2 * b.batch as u64)
            .map(|i| Item {
                input: uniform(DATA_SEED + 2 * i, len).into(),
                target: uniform(DATA_SEED + 2 * i + 1, len).into(),
            })
            .collect(),
    )
}

fn rank3(x: &Boundary) -> Tensor<3> {
    match x.first() {
        Some(AnyTensor::D3(t)) => t.clone(),
        _ => panic!("a block of the benchmark layer takes one rank-3 tensor"),
    }
}

fn stack(items: &[Item], pick: fn(&Item) -> &[f32], s: usize, h: usize, d: &Device) -> Tensor<3> {
    let mut values = Vec::with_capacity(items.len() * s * h);
    for item in items {
        values.extend_from_slice(pick(item));
    }
    Tensor::from_data(TensorData::new(values, [items.len(), s, h]), d)
}

/// The layer as blocks: replicated LayerNorm, attention (tensor-parallel), MLP with the loss
/// (tensor-parallel), drawn from `MODEL_SEED`.
fn layer(b: &TensorBench) -> PipelineStages<Item> {
    let (s, h) = (b.seq, b.hidden);
    let (norm, attention, mlp) = layer_modules(b, &Device::flex());
    PipelineStages::new(move |items: &[Item], d: &Device| {
        vec![AnyTensor::D3(stack(items, |i| &i.input, s, h, d))]
    })
    .stage(norm, |m: &LayerNorm, x: Boundary| {
        vec![AnyTensor::D3(m.forward(rank3(&x)))]
    })
    .tp_block(attention, |m: &ParallelSelfAttention, x: Boundary, tp| {
        vec![AnyTensor::D3(m.forward(rank3(&x), tp))]
    })
    .tp_last(
        mlp,
        move |m: &ParallelMlp, x: Boundary, items: &[Item], d: &Device, tp| {
            let error = m.forward(rank3(&x), tp) - stack(items, |i| &i.target, s, h, d);
            (error.clone() * error).mean()
        },
    )
}

/// The layer's blocks — LayerNorm, attention, MLP — drawn in this order from `MODEL_SEED`
/// on `device` (`bench layer` trains the same blocks in a plain Burn loop).
pub(crate) fn layer_modules(
    b: &TensorBench,
    device: &Device,
) -> (LayerNorm, ParallelSelfAttention, ParallelMlp) {
    device.seed(MODEL_SEED);
    let h = b.hidden;
    let norm: LayerNorm = materialize(LayerNormConfig::new(h).init(device));
    let attention = ParallelSelfAttention::new(h, b.heads, device);
    let mlp = ParallelMlp::new(h, 4 * h, device);
    (norm, attention, mlp)
}

/// The first batch's inputs and targets `[batch, seq, hidden]` on `device`.
pub(crate) fn batch_tensors(b: &TensorBench, device: &Device) -> (Tensor<3>, Tensor<3>) {
    let data = dataset(b);
    let items: Vec<Item> = (0..b.batch)
        .filter_map(|i| meshwork::data::Dataset::get(&data, i))
        .collect();
    (
        stack(&items, |i| &i.input, b.seq, b.hidden, device),
        stack(&items, |i| &i.target, b.seq, b.hidden, device),
    )
}

/// One run of one side.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub(crate) samples_per_s: f64,
    /// The process's page faults per timed step (`None` where not counted).
    pub(crate) faults_per_step: Option<f64>,
    /// Rank 0's traffic, step by step (all steps).
    traffic: Vec<TpTraffic>,
    /// Wall time of the timed steps.
    timed_wall_s: f64,
    /// Rank 0's collective seconds over the timed steps.
    timed_comm_s: f64,
    losses: Vec<f32>,
}

fn rank0_traffic(step: &StepDone) -> Option<TpTraffic> {
    step.replicas
        .iter()
        .find(|r| r.rank.0 == 0)
        .and_then(|r| r.pipeline.as_ref())
        .and_then(|p| p.tensor_parallel)
}

pub(crate) fn run_once(b: &TensorBench, tp: u32) -> Result<Run> {
    let job = Job::builder()
        .blocks(layer(b))
        .tensor_parallel(tp)
        .data_parallel(1)
        .data(dataset(b))
        .batch_size(b.batch)
        .optimizer(SgdConfig::new())
        .learning_rate(0.01)
        .steps(b.steps)
        .seed(5)
        .collective_timeout(Duration::from_secs(120))
        .step_timeout(Duration::from_secs(600))
        .build()?;
    let steps = crate::bench_run::collect_steps(job, b.steps, &format!("bench tensor (tp {tp})"))?;
    let timed: Vec<&StepDone> = steps.iter().filter(|s| s.step >= b.warmup()).collect();
    let timed_wall_s: f64 = timed.iter().map(|s| s.wall_s).sum();
    let timed_comm_s: f64 = timed
        .iter()
        .filter_map(|s| rank0_traffic(s))
        .map(|t| t.seconds)
        .sum();
    let traffic = if tp > 1 {
        steps
            .iter()
            .map(|s| {
                rank0_traffic(s).ok_or_else(|| {
                    Error::Runtime(format!(
                        "bench tensor (tp {tp}): step {} has no tensor-parallel traffic from rank 0",
                        s.step
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let faults: Option<u64> = timed.iter().map(|s| s.page_faults).sum();
    Ok(Run {
        samples_per_s: (b.batch * timed.len()) as f64 / timed_wall_s.max(1e-12),
        faults_per_step: faults.map(|f| f as f64 / timed.len().max(1) as f64),
        traffic,
        timed_wall_s,
        timed_comm_s,
        losses: steps.iter().map(|s| s.loss).collect(),
    })
}

/// Run both sides, alternated, and measure.
pub(crate) fn run(b: &TensorBench) -> Result<TensorFigures> {
    b.check()?;
    if let Some(path) = &b.svg {
        std::fs::write(path, crate::tensor_svg::render(b.tp as usize, b.heads)).map_err(|e| {
            Error::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            }
        })?;
    }
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    for _ in 0..b.repeats {
        baselines.push(run_once(b, 1)?);
        runs.push(run_once(b, b.tp)?);
    }
    let (last_run, last_base) = (&runs[runs.len() - 1], &baselines[baselines.len() - 1]);
    let loss_max_rel_diff =
        crate::bench_run::loss_max_rel_diff(&last_run.losses, &last_base.losses);
    let expected = b.expected_bytes();
    let traffic: Vec<TpTraffic> = runs.iter().flat_map(|r| r.traffic.clone()).collect();
    let steps_seen = traffic.len().max(1) as u64;
    let per_layer = |t: &TpTraffic| t.activation_bytes / MICRO_BATCHES;
    let total_bytes: u64 = traffic.iter().map(|t| t.activation_bytes).sum();
    let total_reduces: u64 = traffic.iter().map(|t| t.activation_reduces).sum();
    let bytes_as_expected = if b.tp > 1 {
        !traffic.is_empty() && traffic.iter().all(|t| per_layer(t) == expected)
    } else {
        traffic.is_empty()
    };
    let parameter_bytes_per_step = traffic.first().map_or(0, |t| t.parameter_bytes);
    let run = crate::bench_run::median(runs, |r| r.samples_per_s);
    let base = crate::bench_run::median(baselines, |r| r.samples_per_s);
    Ok(TensorFigures {
        tp: b.tp,
        hidden: b.hidden,
        heads: b.heads,
        seq: b.seq,
        batch: b.batch,
        micro_batches: MICRO_BATCHES,
        timed_steps: b.steps - b.warmup(),
        repeats: b.repeats,
        samples_per_s: run.samples_per_s,
        baseline_samples_per_s: base.samples_per_s,
        speedup: run.samples_per_s / base.samples_per_s.max(1e-12),
        allreduce_bytes_per_layer: total_bytes / MICRO_BATCHES / steps_seen,
        expected_allreduce_bytes_per_layer: expected,
        bytes_as_expected,
        allreduces_per_layer: total_reduces as f64 / (MICRO_BATCHES * steps_seen) as f64,
        parameter_bytes_per_step,
        comm_share: run.timed_comm_s / run.timed_wall_s.max(1e-12),
        loss_max_rel_diff,
    })
}

/// Print the figures as text or one JSON line.
pub(crate) fn print(f: &TensorFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
        return;
    }
    println!(
        "tensor parallel: one GPT layer (hidden {}, {} heads, seq {}, batch {} in {} micro-batch, MLP 4×hidden), tp {} against tp 1, median of {} alternated runs of {} timed steps",
        f.hidden, f.heads, f.seq, f.batch, f.micro_batches, f.tp, f.repeats, f.timed_steps
    );
    println!(
        "  samples/s: tp {} {:.2}, tp 1 {:.2}: {:.2}× ",
        f.tp, f.samples_per_s, f.baseline_samples_per_s, f.speedup
    );
    println!(
        "  activation all-reduce bytes per layer per micro-batch: {} measured (rank 0, {:.1} all-reduces), {} expected (Megatron: 2 forward + 2 backward all-reduces of b·s·h f32 values): {}",
        f.allreduce_bytes_per_layer,
        f.allreduces_per_layer,
        f.expected_allreduce_bytes_per_layer,
        if f.bytes_as_expected {
            "exactly as expected at every step"
        } else {
            "NOT as expected"
        }
    );
    println!(
        "  replicated parameters' gradients summed per step: {} bytes; share of the step in the group's collectives (rank 0): {:.1}%",
        f.parameter_bytes_per_step,
        f.comm_share * 100.0
    );
    println!(
        "  losses of tp {} and tp 1 at the same steps: largest difference {:.1e} of the largest loss",
        f.tp, f.loss_max_rel_diff
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench(tp: u32) -> TensorBench {
        TensorBench {
            tp,
            hidden: 64,
            heads: 4,
            seq: 8,
            batch: 4,
            steps: 6,
            repeats: 1,
            svg: None,
        }
    }

    #[test]
    fn megatron_bytes_are_four_all_reduces_of_b_s_h_floats() {
        assert_eq!(bench(2).expected_bytes(), 4 * 4 * 8 * 64 * 4);
        assert_eq!(bench(1).expected_bytes(), 0);
    }

    #[test]
    fn warm_up_leaves_at_least_one_timed_step() {
        let mut b = bench(2);
        for (steps, warmup) in [(1, 0), (2, 1), (3, 2), (6, 2)] {
            b.steps = steps;
            assert_eq!(b.warmup(), warmup, "{steps} steps");
        }
    }

    #[test]
    fn impossible_sizes_are_refused_naming_the_flag() {
        let mut b = bench(3);
        assert!(b.check().unwrap_err().to_string().contains("--heads 4"));
        b.tp = 2;
        b.hidden = 30;
        assert!(b.check().unwrap_err().to_string().contains("--hidden 30"));
        b.hidden = 64;
        b.repeats = 0;
        assert!(b.check().unwrap_err().to_string().contains("--repeats"));
    }
}
