//! `meshwork bench tensor --dp --pp --zero --precision`: the recipe's model (the demo GPT on
//! the shipped KJV text, Adam) trained over a dp × pp × tp mesh against the same model on one
//! device (dp 1, pp 1, tp 1, f32, no ZeRO) at the same global batch, in the same run (the two
//! sides alternated, the median of each kept; this machine is shared).
//!
//! Figures: samples/s of both sides and their ratio; the bytes the fullest rank holds of
//! parameters, gradients and optimizer state (counted by the workers themselves) against the
//! ZeRO paper's formula for that mesh (Rajbhandari et al., 2020: 4Ψ + 4Ψ + 8Ψ with Adam in
//! f32, 2Ψ + 2Ψ + 12Ψ in mixed precision, the optimizer state divided by dp from stage 1, the
//! gradients from stage 2, the parameters from stage 3), where Ψ is the parameter elements
//! that rank's pipeline stage and tensor-parallel slice hold ([`Gpt::held_parameters`]); and
//! how far the two sides' losses are apart.

use meshwork::data::TextWindows;
use meshwork::demo::gpt::{Gpt, GptConfig};
use meshwork::demo::kjv_corpus;
use meshwork::error::{Error, Result};
use meshwork::events::StepDone;
use meshwork::parallel::memory::StepMemory;
use meshwork::parallel::zero::ZeroStage;
use meshwork::precision::Precision;
use serde::Serialize;

/// Seed of the model's initial parameters (the same on both sides).
const MODEL_SEED: u64 = 11;

/// What `bench tensor` is asked when a mesh beyond tp is named.
#[derive(Debug, Clone)]
pub(crate) struct LayoutBench {
    pub(crate) dp: u32,
    pub(crate) pp: u32,
    pub(crate) tp: u32,
    pub(crate) zero: u8,
    pub(crate) precision: Precision,
    pub(crate) layers: usize,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) seq: usize,
    /// The global batch (windows per step, split over the replicas).
    pub(crate) batch: usize,
    /// Micro-batches per step of each replica's pipeline (pp > 1 only).
    pub(crate) micro_batches: u32,
    /// Steps of each run, warm-up included.
    pub(crate) steps: u64,
    /// Alternated runs of each side; the median is kept.
    pub(crate) repeats: usize,
}

/// One side of the comparison: a mesh and what trains over it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Layout {
    dp: u32,
    pp: u32,
    tp: u32,
    zero: ZeroStage,
    precision: Precision,
}

impl Layout {
    /// One device, f32, no ZeRO.
    const ONE_DEVICE: Layout = Layout {
        dp: 1,
        pp: 1,
        tp: 1,
        zero: ZeroStage::Off,
        precision: Precision::F32,
    };
}

impl LayoutBench {
    /// Steps not timed at the start of each run: two, or fewer when the run is shorter (at
    /// least one step is timed).
    fn warmup(&self) -> u64 {
        self.steps.saturating_sub(1).min(2)
    }

    fn layout(&self) -> Result<Layout> {
        Ok(Layout {
            dp: self.dp,
            pp: self.pp,
            tp: self.tp,
            zero: ZeroStage::from_number(self.zero).ok_or_else(|| {
                Error::InvalidConfig(format!("--zero {}: choose 0 to 3", self.zero))
            })?,
            precision: self.precision,
        })
    }

    fn config(&self, vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            context: self.seq,
            d_model: self.hidden,
            heads: self.heads,
            layers: self.layers,
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidConfig(why));
        if self.dp == 0 || self.pp == 0 || self.tp == 0 {
            return bad("--dp, --pp and --tp must be at least 1".into());
        }
        if self.layers == 0 || self.hidden == 0 || self.heads == 0 || self.seq == 0 {
            return bad("--layers, --hidden, --heads and --seq must be at least 1".into());
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(format!(
                "--hidden {} does not split into --heads {}: choose a multiple",
                self.hidden, self.heads
            ));
        }
        let blocks = 2 * self.layers as u32 + 2;
        if !blocks.is_multiple_of(self.pp) {
            return bad(format!(
                "--pp {}: the GPT has {blocks} blocks (embedding, attention and MLP per layer, \
                 head), which do not split evenly over {} stages; choose --layers so that \
                 2 × layers + 2 is a multiple of {}",
                self.pp, self.pp, self.pp
            ));
        }
        if !self.batch.is_multiple_of(self.dp as usize) || self.batch == 0 {
            return bad(format!(
                "--batch {} does not split over --dp {}: choose a multiple",
                self.batch, self.dp
            ));
        }
        if self.steps == 0 || self.repeats == 0 {
            return bad("--steps and --repeats must be at least 1".into());
        }
        Ok(())
    }

    /// Parameter elements the fullest rank of `layout` holds: its pipeline stage's blocks
    /// (block `b` on stage `b mod pp`, as the interleaved schedule places them), its
    /// tensor-parallel slices of them.
    fn held_elements(&self, gpt: &Gpt, layout: Layout) -> Result<u64> {
        let (pp, tp) = (layout.pp as usize, layout.tp as usize);
        let mut most = 0u64;
        for t in 0..tp {
            let blocks = gpt
                .held_parameters(t, tp)
                .map_err(|e| Error::InvalidConfig(e.to_string()))?;
            for s in 0..pp {
                let held: usize = blocks.iter().skip(s).step_by(pp).sum();
                most = most.max(held as u64);
            }
        }
        Ok(most)
    }
}

/// The ZeRO paper's bytes per rank for Ψ parameters with Adam at `zero` over `n` ranks:
/// (parameters, gradients, optimizer state).
fn paper_bytes(psi: f64, n: f64, zero: ZeroStage, precision: Precision) -> (f64, f64, f64) {
    let (p, g, o) = if precision.is_low() {
        (2.0, 2.0, 12.0)
    } else {
        (4.0, 4.0, 8.0)
    };
    let stage = zero.number();
    let params = if stage >= 3 { p * psi / n } else { p * psi };
    let grads = if stage >= 2 { g * psi / n } else { g * psi };
    let optim = if stage >= 1 { o * psi / n } else { o * psi };
    (params, grads, optim)
}

/// What `bench tensor` measures over a mesh.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LayoutFigures {
    dp: u32,
    pp: u32,
    tp: u32,
    zero: u8,
    precision: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    seq: usize,
    batch: usize,
    micro_batches: u32,
    timed_steps: u64,
    repeats: usize,
    samples_per_s: f64,
    one_device_samples_per_s: f64,
    /// `samples_per_s / one_device_samples_per_s`.
    speedup: f64,
    /// The model's parameter elements.
    elements: u64,
    /// Parameter elements the fullest rank holds (its stage, its tp slices).
    rank_elements: u64,
    /// Measured on the fullest rank: parameters (full and shards), gradients, optimizer.
    param_bytes: u64,
    grad_bytes: u64,
    optim_bytes: u64,
    /// The ZeRO paper's figures for `rank_elements` over dp.
    formula_param_bytes: f64,
    formula_grad_bytes: f64,
    formula_optim_bytes: f64,
    /// The one-device side's bytes (the whole model, unsharded).
    one_device_bytes: u64,
    /// The largest difference between the two sides' losses at the same step, relative to
    /// the one device's largest loss (last pair of runs).
    loss_max_rel_diff: f64,
}

/// One run of one side.
#[derive(Debug, Clone)]
struct Run {
    samples_per_s: f64,
    /// The last step's memory of the rank holding the most.
    memory: StepMemory,
    losses: Vec<f32>,
}

fn fullest(step: &StepDone) -> Option<StepMemory> {
    step.replicas
        .iter()
        .filter_map(|r| r.pipeline.as_ref().map(|p| &p.memory))
        .max_by_key(|m| m.peak_full_params + m.param_shards + m.peak_grads + m.optimizer)
        .cloned()
}

fn run_once(b: &LayoutBench, layout: Layout, gpt: &Gpt, data: &TextWindows) -> Result<Run> {
    let planned = meshwork::planner::Candidate {
        dp: layout.dp,
        pp: layout.pp,
        tp: layout.tp,
        zero: layout.zero.number(),
        micro_batches: b.micro_batches,
        recompute: false,
    };
    let job = crate::plan::layout_job(
        gpt.clone().into_blocks(),
        data.clone(),
        (&planned, layout.precision),
        b.batch as u32,
        b.steps,
    )?;
    let what = format!(
        "bench tensor (dp {} × pp {} × tp {})",
        layout.dp, layout.pp, layout.tp
    );
    let steps = crate::bench_run::collect_steps(job, b.steps, &what)?;
    let timed: Vec<&StepDone> = steps.iter().filter(|s| s.step >= b.warmup()).collect();
    let wall: f64 = timed.iter().map(|s| s.wall_s).sum();
    let memory = steps
        .last()
        .and_then(fullest)
        .ok_or_else(|| Error::Runtime(format!("{what}: the last step reports no memory")))?;
    Ok(Run {
        samples_per_s: (b.batch * timed.len()) as f64 / wall.max(1e-12),
        memory,
        losses: steps.iter().map(|s| s.loss).collect(),
    })
}

fn held(m: &StepMemory) -> (u64, u64, u64) {
    (
        m.peak_full_params + m.param_shards,
        m.peak_grads,
        m.optimizer,
    )
}

/// Run both sides, alternated, and measure.
pub(crate) fn run(b: &LayoutBench) -> Result<LayoutFigures> {
    b.check()?;
    let layout = b.layout()?;
    let corpus = kjv_corpus().map_err(|e| Error::Data(format!("the embedded text: {e}")))?;
    let config = b.config(corpus.vocab().len());
    let data = corpus
        .train_windows(config.context, config.context)
        .map_err(|e| Error::Data(e.to_string()))?;
    let device = burn::tensor::Device::flex();
    device.seed(MODEL_SEED);
    let gpt = Gpt::new(&config, &device);
    let elements = b.held_elements(&gpt, Layout::ONE_DEVICE)?;
    let rank_elements = b.held_elements(&gpt, layout)?;
    let mut runs = Vec::new();
    let mut baselines = Vec::new();
    for _ in 0..b.repeats {
        baselines.push(run_once(b, Layout::ONE_DEVICE, &gpt, &data)?);
        runs.push(run_once(b, layout, &gpt, &data)?);
    }
    let (last_run, last_base) = (&runs[runs.len() - 1], &baselines[baselines.len() - 1]);
    let loss_max_rel_diff =
        crate::bench_run::loss_max_rel_diff(&last_run.losses, &last_base.losses);
    let run = crate::bench_run::median(runs, |r| r.samples_per_s);
    let base = crate::bench_run::median(baselines, |r| r.samples_per_s);
    let (param_bytes, grad_bytes, optim_bytes) = held(&run.memory);
    let (bp, bg, bo) = held(&base.memory);
    let (fp, fg, fo) = paper_bytes(
        rank_elements as f64,
        f64::from(b.dp),
        layout.zero,
        b.precision,
    );
    Ok(LayoutFigures {
        dp: b.dp,
        pp: b.pp,
        tp: b.tp,
        zero: b.zero,
        precision: b.precision.name(),
        layers: b.layers,
        hidden: b.hidden,
        heads: b.heads,
        seq: b.seq,
        batch: b.batch,
        micro_batches: if b.pp > 1 { b.micro_batches } else { 1 },
        timed_steps: b.steps - b.warmup(),
        repeats: b.repeats,
        samples_per_s: run.samples_per_s,
        one_device_samples_per_s: base.samples_per_s,
        speedup: run.samples_per_s / base.samples_per_s.max(1e-12),
        elements,
        rank_elements,
        param_bytes,
        grad_bytes,
        optim_bytes,
        formula_param_bytes: fp,
        formula_grad_bytes: fg,
        formula_optim_bytes: fo,
        one_device_bytes: bp + bg + bo,
        loss_max_rel_diff,
    })
}

fn mib(bytes: f64) -> String {
    format!("{:.3} MiB", bytes / (1024.0 * 1024.0))
}

/// Print the figures as text or one JSON line.
pub(crate) fn print(f: &LayoutFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
        return;
    }
    println!(
        "the recipe's model (GPT: {} layers, hidden {}, {} heads, context {}; Adam) over dp {} × pp {} × tp {}, ZeRO-{}, {}, global batch {} ({} micro-batches), against one device (f32) at the same batch; median of {} alternated runs of {} timed steps",
        f.layers,
        f.hidden,
        f.heads,
        f.seq,
        f.dp,
        f.pp,
        f.tp,
        f.zero,
        f.precision,
        f.batch,
        f.micro_batches,
        f.repeats,
        f.timed_steps
    );
    println!(
        "  samples/s: {:.2} against one device's {:.2}: {:.2}×",
        f.samples_per_s, f.one_device_samples_per_s, f.speedup
    );
    println!(
        "  the fullest rank holds Ψ = {} of the model's {} parameter elements (its stage, its tp slices)",
        f.rank_elements, f.elements
    );
    for (what, measured, formula) in [
        ("parameters", f.param_bytes, f.formula_param_bytes),
        ("gradients", f.grad_bytes, f.formula_grad_bytes),
        ("optimizer state", f.optim_bytes, f.formula_optim_bytes),
    ] {
        println!(
            "  {what}: {} held, {} by the ZeRO paper's formula ({:.2}×)",
            mib(measured as f64),
            mib(formula),
            measured as f64 / formula.max(1e-12)
        );
    }
    let total = (f.param_bytes + f.grad_bytes + f.optim_bytes) as f64;
    println!(
        "  together: {} per rank against one device's {} ({:.2}×)",
        mib(total),
        mib(f.one_device_bytes as f64),
        total / (f.one_device_bytes as f64).max(1e-12)
    );
    println!(
        "  losses at the same steps: largest difference {:.1e} of the largest loss",
        f.loss_max_rel_diff
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_papers_figures_shard_as_each_stage_says() {
        let f32 = Precision::F32;
        assert_eq!(
            paper_bytes(10.0, 2.0, ZeroStage::Off, f32),
            (40.0, 40.0, 80.0)
        );
        assert_eq!(
            paper_bytes(10.0, 2.0, ZeroStage::One, f32),
            (40.0, 40.0, 40.0)
        );
        assert_eq!(
            paper_bytes(10.0, 2.0, ZeroStage::Two, f32),
            (40.0, 20.0, 40.0)
        );
        assert_eq!(
            paper_bytes(10.0, 2.0, ZeroStage::Three, Precision::Bf16),
            (10.0, 10.0, 60.0)
        );
    }

    fn bench() -> LayoutBench {
        LayoutBench {
            dp: 2,
            pp: 2,
            tp: 2,
            zero: 1,
            precision: Precision::Bf16,
            layers: 1,
            hidden: 16,
            heads: 2,
            seq: 8,
            batch: 4,
            micro_batches: 2,
            steps: 3,
            repeats: 1,
        }
    }

    #[test]
    fn a_rank_holds_its_stage_and_its_slices() {
        let b = bench();
        let device = burn::tensor::Device::flex();
        device.seed(1);
        let gpt = Gpt::new(&b.config(10), &device);
        let whole = b.held_elements(&gpt, Layout::ONE_DEVICE).unwrap();
        let split = b.held_elements(&gpt, b.layout().unwrap()).unwrap();
        // Half the blocks, about half of each: more than an eighth (replicated norms and
        // positions), less than half.
        assert!(
            split * 4 > whole / 2 && split * 2 < whole,
            "{split} of {whole}"
        );
    }

    #[test]
    fn impossible_meshes_are_refused_naming_the_flag() {
        let mut b = bench();
        b.pp = 3;
        assert!(b.check().unwrap_err().to_string().contains("--pp 3"));
        b.pp = 2;
        b.batch = 3;
        assert!(b.check().unwrap_err().to_string().contains("--batch 3"));
        b.batch = 4;
        b.zero = 4;
        assert!(b.layout().unwrap_err().to_string().contains("--zero 4"));
    }
}
