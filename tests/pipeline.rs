//! Pipeline execution equals one device (first slice: stages in one process, dp = 1).
//!
//! Each configuration trains the same initial stage modules on the same data with the pipeline
//! executor and with a plain single-device Burn loop that runs the same stage functions one
//! after the other on the whole batch; every parameter tensor must match:
//! `max|a − b| ≤ 1e-5 · max|reference|` (f32). The trace proves each stage ran exactly its
//! schedule's list and, for M ≥ 2, that stages computed at the same time.

use std::sync::Arc;
use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use meshwork::comm::{CommConfig, Communicator, LocalGroup};
use meshwork::demo::{Sample, TeacherTask, batch_tensors};
use meshwork::mesh::Generation;
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::parallel::pipeline::{Instr, Schedule, StageIndex};
use meshwork::parallel::pipeline_exec::{
    AnyTensor, Boundary, StageStepRecord, StageWork, TypedStage, links, run_stage_step,
};
use meshwork::testing::compare_parameters;

const TOLERANCE: f32 = 1e-5;
const STEPS: usize = 4;
const BATCH: usize = 16;

#[derive(Module, Debug)]
struct Block {
    linear: Linear,
    skip: Option<Linear>,
}

/// How the stages of a test model hand tensors on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    /// One rank-2 tensor crosses each boundary.
    Plain,
    /// Stage 0 sends a rank-3 tensor.
    Rank3,
    /// Stage 0 sends two tensors (its output and its input: a skip connection).
    Skip,
}

fn two(b: &Boundary, i: usize) -> Tensor<2> {
    match &b[i] {
        AnyTensor::D2(t) => t.clone(),
        AnyTensor::D3(t) => {
            let [n, a, c] = t.dims();
            t.clone().reshape([n, a * c])
        }
        other => panic!("unexpected boundary tensor {other:?}"),
    }
}

fn stage_forward(
    index: usize,
    last: usize,
    shape: Shape,
) -> impl Fn(&Block, Boundary) -> Boundary + Send + Sync + Clone {
    move |m: &Block, input: Boundary| {
        let x = two(&input, 0);
        let mut h = m.linear.forward(x.clone());
        if let (Some(skip), true) = (&m.skip, input.len() > 1) {
            h = h + skip.forward(two(&input, 1));
        }
        let h = if index < last { relu(h) } else { h };
        match (index, shape) {
            (0, Shape::Rank3) => {
                let [n, w] = h.dims();
                vec![AnyTensor::D3(h.reshape([n, 4, w / 4]))]
            }
            (0, Shape::Skip) => vec![AnyTensor::D2(h), AnyTensor::D2(x)],
            _ => vec![AnyTensor::D2(h)],
        }
    }
}

fn mse(out: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    let d = out - y;
    (d.clone() * d).mean()
}

fn blocks(widths: &[usize], shape: Shape, device: &Device) -> Vec<Block> {
    device.seed(17);
    widths
        .windows(2)
        .enumerate()
        .map(|(i, w)| Block {
            linear: LinearConfig::new(w[0], w[1]).init(device),
            skip: (i == 1 && shape == Shape::Skip)
                .then(|| LinearConfig::new(widths[0], w[1]).init(device)),
        })
        .collect()
}

fn data() -> Vec<Sample> {
    let t = TeacherTask {
        d_in: 8,
        d_out: 3,
        noise: 0.1,
        seed: 4,
    };
    let d = t.dataset(BATCH * STEPS);
    (0..BATCH * STEPS)
        .map(|i| meshwork::data::Dataset::get(&d, i).unwrap())
        .collect()
}

/// Run the pipeline; return the trained blocks and each stage's records.
/// Run `dp` replicas of the pipeline (dp × K threads); return replica 0's trained blocks and
/// its stages' records, after checking every replica ended identical (EXEC-3).
fn run_pipeline(
    schedule: Schedule,
    init: Vec<Block>,
    shape: Shape,
    dp: usize,
    recompute: bool,
) -> (Vec<Block>, Vec<Vec<StageStepRecord>>) {
    let k = init.len() as u32;
    let plan = Arc::new(schedule.instructions(k).expect("valid schedule"));
    let m = schedule.micro_batches() as usize;
    let samples = Arc::new(data());
    let optimizer: OptimizerConfig = SgdConfig::new().into();
    // One data-parallel group per stage index: that stage in every replica.
    let mut groups: Vec<Vec<Communicator>> = (0..k)
        .map(|_| LocalGroup::new(dp, Generation(0), CommConfig::default()).communicators())
        .collect();
    let mut handles = Vec::new();
    for replica in 0..dp {
        for (i, (block, link)) in init
            .clone()
            .into_iter()
            .zip(links(k, Duration::from_secs(20)))
            .enumerate()
        {
            let plan = plan.clone();
            let samples = samples.clone();
            let optimizer = optimizer.clone();
            let mut comm = groups[i].remove(0);
            handles.push(std::thread::spawn(move || {
                let device = Device::flex();
                let last = k as usize - 1;
                let mut stage: Box<dyn StageWork<Sample>> = if i == last {
                    let f = stage_forward(i, last, shape);
                    Box::new(TypedStage::last(
                        block,
                        move |b: &Block, x: Boundary, items: &[Sample], d: &Device| {
                            let (_, y) = batch_tensors(items, d);
                            mse(two(&f(b, x), 0), y)
                        },
                        &optimizer,
                        LearningRate::Constant(0.05),
                        &device,
                    ))
                } else {
                    Box::new(
                        TypedStage::new(
                            block,
                            stage_forward(i, last, shape),
                            &optimizer,
                            LearningRate::Constant(0.05),
                            &device,
                        )
                        .with_recompute(recompute),
                    )
                };
                let ad = device.clone().autodiff();
                let inputs =
                    move |items: &[Sample]| vec![AnyTensor::D2(batch_tensors(items, &ad).0)];
                let mut records = Vec::new();
                let share = BATCH / dp;
                for step in 0..STEPS {
                    // This replica's share of the global batch, cut into M micro-batches.
                    let start = step * BATCH + replica * share;
                    let batch = &samples[start..start + share];
                    let micro: Vec<Vec<Sample>> =
                        batch.chunks(share / m).map(<[Sample]>::to_vec).collect();
                    records.push(
                        run_stage_step(
                            stage.as_mut(),
                            &plan,
                            StageIndex(i as u32),
                            &link,
                            &micro,
                            &inputs,
                            &device,
                            (dp > 1).then_some(&mut comm),
                        )
                        .unwrap_or_else(|e| panic!("replica {replica} stage {i} step {step}: {e}")),
                    );
                }
                let block = *stage.into_module().downcast::<Block>().expect("a Block");
                (block, records)
            }));
        }
    }
    let mut results: Vec<(Block, Vec<StageStepRecord>)> = handles
        .into_iter()
        .map(|h| h.join().expect("stage thread"))
        .collect();
    let others = results.split_off(k as usize);
    for (i, (block, _)) in others.iter().enumerate() {
        let stage = i % k as usize;
        compare_parameters(block, &results[stage].0, 0.0).unwrap_or_else(|e| {
            panic!(
                "replica {} of stage {stage} differs: {e}",
                i / k as usize + 1
            )
        });
    }
    results.into_iter().unzip()
}

/// The plain loop: all stage functions in sequence on one device, one batch per step.
fn run_reference(init: Vec<Block>, shape: Shape) -> Vec<Block> {
    let device = Device::flex();
    let ad = device.clone().autodiff();
    let mut model: Vec<Block> = init.into_iter().map(|b| b.fork(&ad).train()).collect();
    let mut optims: Vec<_> = model.iter().map(|_| SgdConfig::new().init()).collect();
    let samples = data();
    let last = model.len() - 1;
    for step in 0..STEPS {
        let batch = &samples[step * BATCH..(step + 1) * BATCH];
        let (x, y) = batch_tensors(batch, &ad);
        let mut h: Boundary = vec![AnyTensor::D2(x)];
        for (i, b) in model.iter().enumerate() {
            h = stage_forward(i, last, shape)(b, h);
        }
        let mut grads = mse(two(&h, 0), y).backward();
        let per_stage: Vec<GradientsParams> = model
            .iter()
            .map(|b| GradientsParams::from_module(&mut grads, b))
            .collect();
        model = model
            .into_iter()
            .zip(per_stage)
            .zip(optims.iter_mut())
            .map(|((b, g), o)| o.step(0.05, b, g))
            .collect();
    }
    model
}

fn check(schedule: Schedule, widths: &[usize], shape: Shape) -> Vec<Vec<StageStepRecord>> {
    check_mesh(schedule, widths, shape, 1, false)
}

fn check_mesh(
    schedule: Schedule,
    widths: &[usize],
    shape: Shape,
    dp: usize,
    recompute: bool,
) -> Vec<Vec<StageStepRecord>> {
    // One initial record for both sides: Flex's generator is process-global and tests run
    // in parallel.
    let init = blocks(widths, shape, &Device::flex());
    let (trained, records) = run_pipeline(schedule, init.clone(), shape, dp, recompute);
    for (a, b) in trained.iter().zip(&init) {
        assert!(
            compare_parameters(a, b, 1e-4).is_err(),
            "training moved every stage"
        );
    }
    let reference = run_reference(init, shape);
    let plan = schedule.instructions(trained.len() as u32).unwrap();
    for (i, (a, b)) in trained.iter().zip(&reference).enumerate() {
        compare_parameters(a, b, TOLERANCE)
            .unwrap_or_else(|e| panic!("{schedule:?} {shape:?} stage {i}: {e}"));
        for r in &records[i] {
            let ran: Vec<Instr> = r.executed.iter().map(|(instr, _, _)| *instr).collect();
            assert_eq!(
                ran,
                plan.list(StageIndex(i as u32)),
                "stage {i} ran exactly its list"
            );
        }
    }
    let last = records.last().unwrap();
    assert!(
        last.iter()
            .all(|r| r.losses.len() == schedule.micro_batches() as usize)
    );
    records
}

#[test]
fn pp_2_and_4_gpipe_and_1f1b_match_one_device() {
    for m in [1, 4, 8] {
        for schedule in [
            Schedule::GPipe { micro_batches: m },
            Schedule::OneFOneB { micro_batches: m },
        ] {
            check(schedule, &[8, 32, 3], Shape::Plain);
            check(schedule, &[8, 32, 16, 12, 3], Shape::Plain);
        }
    }
}

#[test]
fn a_rank_3_boundary_and_two_tensors_across_a_boundary_match_one_device() {
    check(
        Schedule::OneFOneB { micro_batches: 4 },
        &[8, 32, 3],
        Shape::Rank3,
    );
    check(
        Schedule::GPipe { micro_batches: 4 },
        &[8, 32, 16, 3],
        Shape::Skip,
    );
}

#[test]
fn stages_compute_at_the_same_time() {
    // Wide layers so a forward takes long enough to overlap with the neighbour's.
    let records = check(
        Schedule::GPipe { micro_batches: 8 },
        &[8, 512, 512, 3],
        Shape::Plain,
    );
    let compute = |stage: usize| -> Vec<(std::time::Instant, std::time::Instant)> {
        records[stage]
            .iter()
            .flat_map(|r| r.executed.iter())
            .filter(|(i, _, _)| matches!(i, Instr::Forward { .. } | Instr::Backward { .. }))
            .map(|(_, s, e)| (*s, *e))
            .collect()
    };
    let (a, b) = (compute(0), compute(1));
    let overlaps = a
        .iter()
        .any(|(s0, e0)| b.iter().any(|(s1, e1)| s0 < e1 && s1 < e0));
    assert!(
        overlaps,
        "stage 0 and stage 1 never computed at the same time"
    );
}

#[test]
fn exec_3_dp_2_by_pp_2_matches_one_device() {
    for schedule in [
        Schedule::GPipe { micro_batches: 4 },
        Schedule::OneFOneB { micro_batches: 4 },
    ] {
        check_mesh(schedule, &[8, 32, 3], Shape::Plain, 2, false);
    }
}

#[test]
fn recorded_steps_give_stash_bounds_memory_and_a_measured_bubble() {
    use meshwork::parallel::pipeline::{render_svg, summarize};
    use meshwork::parallel::pipeline_exec::{chrome_trace, recorded_timeline};
    let widths = [8, 64, 3];
    let gpipe = check(Schedule::GPipe { micro_batches: 8 }, &widths, Shape::Plain);
    let one_f_one_b = check(
        Schedule::OneFOneB { micro_batches: 8 },
        &widths,
        Shape::Plain,
    );
    // Stage 0 of 2: GPipe stashes every micro-batch, 1F1B at most K = 2.
    assert!(gpipe[0].iter().all(|r| r.peak_stash == 8));
    assert!(one_f_one_b[0].iter().all(|r| r.peak_stash <= 2));
    let bytes = |rs: &Vec<Vec<StageStepRecord>>| rs[0].iter().map(|r| r.peak_stash_bytes).max();
    assert!(
        bytes(&one_f_one_b) < bytes(&gpipe),
        "1F1B holds fewer activations"
    );
    // The last step's measured timeline: a bubble in (0, 1), a picture, a Chrome trace.
    let last: Vec<&StageStepRecord> = gpipe.iter().map(|s| s.last().unwrap()).collect();
    let timeline = recorded_timeline(&last);
    let summary = summarize(&timeline);
    assert!(
        summary.bubble > 0.0 && summary.bubble < 1.0,
        "{}",
        summary.bubble
    );
    assert!(render_svg(&timeline).starts_with("<svg"));
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&last)).unwrap();
    let boxes = trace["traceEvents"].as_array().unwrap().len();
    assert_eq!(boxes, last.iter().map(|r| r.executed.len()).sum::<usize>());
}

#[test]
fn recompute_keeps_only_inputs_and_still_matches_one_device() {
    let widths = [8, 64, 32, 3];
    let kept = check_mesh(
        Schedule::GPipe { micro_batches: 4 },
        &widths,
        Shape::Skip,
        1,
        false,
    );
    let recomputed = check_mesh(
        Schedule::GPipe { micro_batches: 4 },
        &widths,
        Shape::Skip,
        1,
        true,
    );
    let bytes = |r: &Vec<Vec<StageStepRecord>>| r[0].iter().map(|s| s.peak_stash_bytes).max();
    assert!(bytes(&recomputed) < bytes(&kept), "recompute stashes less");
}
