//! `meshwork bench pipeline`: a pipeline of K stages on K threads, measured.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use meshwork::demo::{Sample, TeacherTask, batch_tensors};
use meshwork::error::{Error, Result};
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::parallel::pipeline::{Schedule, StageIndex, summarize};
use meshwork::parallel::pipeline_exec::{
    AnyTensor, Boundary, StageStepRecord, StageWork, TypedStage, links, recorded_timeline,
    run_stage_step,
};

/// Consecutive linear layers of the benchmark MLP held by one stage.
#[derive(Module, Debug)]
struct Layers {
    layers: Vec<Linear>,
}

fn first(b: &Boundary) -> Tensor<2> {
    match &b[0] {
        AnyTensor::D2(t) => t.clone(),
        other => panic!("the benchmark passes rank-2 tensors, got {other:?}"),
    }
}

/// Forward through `m`'s layers; ReLU after each except the model's very last layer.
fn run_layers(m: &Layers, x: Tensor<2>, ends_model: bool) -> Tensor<2> {
    let n = m.layers.len();
    m.layers.iter().enumerate().fold(x, |h, (i, l)| {
        let h = l.forward(h);
        if ends_model && i + 1 == n { h } else { relu(h) }
    })
}

/// What `bench pipeline` measures.
#[derive(Debug, serde::Serialize)]
pub(crate) struct PipelineFigures {
    pp: u32,
    micro_batches: u32,
    schedule: String,
    batch_size: usize,
    samples_per_s: f64,
    bubble_measured: f64,
    bubble_theoretical: f64,
    peak_stash: u32,
    peak_activation_bytes: Vec<u64>,
}

pub(crate) fn run(
    pp: u32,
    schedule: Schedule,
    batch: usize,
    hidden: usize,
    steps: usize,
) -> Result<PipelineFigures> {
    let m = schedule.micro_batches() as usize;
    if pp == 0 || batch == 0 || !batch.is_multiple_of(m) {
        return Err(Error::InvalidConfig(format!(
            "--batch-size {batch} must be a positive multiple of --micro-batches {m}, and --pp ≥ 1"
        )));
    }
    let plan = Arc::new(schedule.instructions(pp)?);
    // MLP 784 → 8 × hidden → 10: nine linear layers cut into pp contiguous groups.
    let mut widths = vec![784];
    widths.extend(std::iter::repeat_n(hidden, 8));
    widths.push(10);
    let device = Device::flex();
    let layers: Vec<Linear> = widths
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(&device))
        .collect();
    // Equal layer counts, the extra layers on the later stages: the first layer (784 wide
    // input) is the largest, the last stage also computes the loss.
    let (n, k) = (layers.len(), pp as usize);
    let mut it = layers.into_iter();
    let groups: Vec<Layers> = (0..k)
        .map(|s| Layers {
            layers: it
                .by_ref()
                .take(n / k + usize::from(s >= k - n % k))
                .collect(),
        })
        .filter(|g| !g.layers.is_empty())
        .collect();
    if groups.len() != k {
        return Err(Error::InvalidConfig(format!(
            "--pp {pp}: the 9-layer benchmark model splits into at most 9 stages"
        )));
    }
    let data = Arc::new(
        TeacherTask {
            d_in: 784,
            d_out: 10,
            noise: 0.1,
            seed: 3,
        }
        .dataset(batch),
    );
    let optimizer: OptimizerConfig = SgdConfig::new().into();
    let warmup = 2;
    let handles: Vec<_> = groups
        .into_iter()
        .zip(links(pp, Duration::from_secs(120)))
        .enumerate()
        .map(|(i, (group, link))| {
            let plan = plan.clone();
            let data = data.clone();
            let optimizer = optimizer.clone();
            std::thread::spawn(
                move || -> std::result::Result<(Vec<StageStepRecord>, Duration), String> {
                    let device = Device::flex();
                    let last = i + 1 == pp as usize;
                    let lr = LearningRate::Constant(0.01);
                    let mut stage: Box<dyn StageWork<Sample>> = if last {
                        Box::new(TypedStage::last(
                            group,
                            |m: &Layers, x: Boundary, items: &[Sample], d: &Device| {
                                let (_, y) = batch_tensors(items, d);
                                let diff = run_layers(m, first(&x), true) - y;
                                (diff.clone() * diff).mean()
                            },
                            &optimizer,
                            lr,
                            &device,
                        ))
                    } else {
                        Box::new(TypedStage::new(
                            group,
                            |m: &Layers, x: Boundary| {
                                vec![AnyTensor::D2(run_layers(m, first(&x), false))]
                            },
                            &optimizer,
                            lr,
                            &device,
                        ))
                    };
                    let ad = device.clone().autodiff();
                    let inputs =
                        move |items: &[Sample]| vec![AnyTensor::D2(batch_tensors(items, &ad).0)];
                    let items: Vec<Sample> = (0..batch)
                        .filter_map(|j| meshwork::data::Dataset::get(&*data, j))
                        .collect();
                    let micro: Vec<Vec<Sample>> =
                        items.chunks(batch / m).map(<[Sample]>::to_vec).collect();
                    let mut records = Vec::new();
                    let mut timed = Duration::ZERO;
                    for step in 0..warmup + steps {
                        let t = Instant::now();
                        let r = run_stage_step(
                            stage.as_mut(),
                            &plan,
                            StageIndex(i as u32),
                            &link,
                            &micro,
                            &inputs,
                            &device,
                            None,
                        )
                        .map_err(|e| e.to_string())?;
                        if step >= warmup {
                            timed += t.elapsed();
                            records.push(r);
                        }
                    }
                    Ok((records, timed))
                },
            )
        })
        .collect();
    let mut per_stage = Vec::new();
    let mut wall = Duration::ZERO;
    for h in handles {
        let (records, timed) = h
            .join()
            .map_err(|_| Error::Runtime("a pipeline stage panicked".into()))?
            .map_err(Error::Runtime)?;
        wall = wall.max(timed);
        per_stage.push(records);
    }
    let bubbles: Vec<f64> = (0..steps)
        .map(|s| {
            let step: Vec<&StageStepRecord> = per_stage.iter().map(|r| &r[s]).collect();
            summarize(&recorded_timeline(&step)).bubble
        })
        .collect();
    Ok(PipelineFigures {
        pp,
        micro_batches: m as u32,
        schedule: schedule.name().into(),
        batch_size: batch,
        samples_per_s: (batch * steps) as f64 / wall.as_secs_f64().max(1e-12),
        bubble_measured: bubbles.iter().sum::<f64>() / bubbles.len().max(1) as f64,
        bubble_theoretical: schedule.theoretical_bubble(pp),
        peak_stash: per_stage
            .iter()
            .flat_map(|r| r.iter().map(|x| x.peak_stash))
            .max()
            .unwrap_or(0),
        peak_activation_bytes: per_stage
            .iter()
            .map(|r| r.iter().map(|x| x.peak_stash_bytes).max().unwrap_or(0))
            .collect(),
    })
}

/// Print the figures as a line of text or JSON.
pub(crate) fn print(f: &PipelineFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
    } else {
        println!(
            "pipeline {} pp={} M={} batch={}: {:.0} samples/s; bubble measured {:.3} vs theory {:.3}; peak stash {}; peak activation bytes per stage {:?}",
            f.schedule,
            f.pp,
            f.micro_batches,
            f.batch_size,
            f.samples_per_s,
            f.bubble_measured,
            f.bubble_theoretical,
            f.peak_stash,
            f.peak_activation_bytes
        );
    }
}
