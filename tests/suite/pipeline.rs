//! Pipeline jobs equal one device.
//!
//! Each configuration trains the same initial blocks on the same data with a pipeline job
//! (stage actors, one device each, `Job::builder().pipeline(..)`) and with a plain
//! single-device Burn loop that runs the same block functions one after the other on each
//! step's global batch (the sample ids the step events report); after 10 steps every parameter
//! tensor must match: `max|a − b| ≤ 1e-5 · max|reference|` (f32). The recorded instructions
//! prove every stage of every replica ran exactly its schedule's list, on its own device, and,
//! for M ≥ 2, that stages computed at the same time (a job that quietly ran every stage on one
//! actor fails this).

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use meshwork::data::{Dataset, InMemoryDataset};
use meshwork::demo::{Sample, batch_tensors};
use meshwork::events::{JobEvent, StepDone};
use meshwork::job::{Job, PipelineModel, PipelineStages};
use meshwork::parallel::pipeline::{Instr, Schedule, StageIndex};
use meshwork::parallel::pipeline_exec::{AnyTensor, Boundary};
use meshwork::testing::{
    TeacherFixture, TempDir, batches_from_events, compare_parameters, draw_lock, run_recording,
    steps_of,
};

const TOLERANCE: f32 = 1e-5;
const STEPS: u64 = 10;
const BATCH: usize = 16;
const LR: f64 = 0.05;

/// 64 samples of the 8 → 3 teacher (seed 4, noise 0.1; `with_widths` for other ends); the
/// blocks are drawn from seed 17 (`blocks`).
fn fixture() -> TeacherFixture {
    TeacherFixture::new(4, 17).with_samples(BATCH * 4)
}

#[derive(Module, Debug)]
struct Block {
    linear: Linear,
    skip: Option<Linear>,
}

/// How the blocks of a test model hand tensors on.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    /// One rank-2 tensor crosses each boundary.
    Plain,
    /// Block 0 sends a rank-3 tensor.
    Rank3,
    /// Block 0 sends two tensors (its output and its input: a skip connection into block 1).
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

fn block_forward(
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

/// The blocks of `widths`, seeded and drawn under the suite's draw lock (Burn's generator is
/// process-global), each drawn here in block order, as a pipeline job would draw them.
fn blocks(widths: &[usize], shape: Shape, device: &Device) -> Vec<Block> {
    let _draw = draw_lock();
    device.seed(fixture().model_seed);
    widths
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            meshwork::parallel::stages::materialize(Block {
                linear: LinearConfig::new(w[0], w[1]).init(device),
                skip: (i == 1 && shape == Shape::Skip)
                    .then(|| LinearConfig::new(widths[0], w[1]).init(device)),
            })
        })
        .collect()
}

/// Called with a block's index before each of its forwards.
type ForwardHook = std::sync::Arc<dyn Fn(usize) + Send + Sync>;

/// The blocks as a pipeline: every block forwards, the last ends in the loss.
fn as_stages(init: &[Block], shape: Shape) -> PipelineStages<Sample> {
    as_hooked_stages(init, shape, None)
}

/// [`as_stages`], calling `hook` before every block's forward.
fn as_hooked_stages(
    init: &[Block],
    shape: Shape,
    hook: Option<ForwardHook>,
) -> PipelineStages<Sample> {
    let last = init.len() - 1;
    let mut stages = PipelineStages::new(|items: &[Sample], d: &Device| {
        vec![AnyTensor::D2(batch_tensors(items, d).0)]
    });
    for (i, b) in init.iter().enumerate() {
        let forward = block_forward(i, last, shape);
        let hook = hook.clone();
        let f = move |m: &Block, x: Boundary| {
            if let Some(h) = &hook {
                h(i);
            }
            forward(m, x)
        };
        stages = if i == last {
            stages.last(
                b.clone(),
                move |m: &Block, x: Boundary, items: &[Sample], d: &Device| {
                    let (_, y) = batch_tensors(items, d);
                    mse(two(&f(m, x), 0), y)
                },
            )
        } else {
            stages.stage(b.clone(), f)
        };
    }
    stages
}

/// The plain loop: all block functions in sequence on one device, one global batch per step.
fn run_reference(
    init: Vec<Block>,
    shape: Shape,
    data: &InMemoryDataset<Sample>,
    batches: &[Vec<usize>],
) -> Vec<Block> {
    let device = Device::flex();
    let ad = device.clone().autodiff();
    let mut model: Vec<Block> = init.into_iter().map(|b| b.fork(&ad).train()).collect();
    let mut optims: Vec<_> = model.iter().map(|_| SgdConfig::new().init()).collect();
    let last = model.len() - 1;
    for ids in batches {
        let batch: Vec<Sample> = ids.iter().filter_map(|&i| data.get(i)).collect();
        let (x, y) = batch_tensors(&batch, &ad);
        let mut h: Boundary = vec![AnyTensor::D2(x)];
        for (i, b) in model.iter().enumerate() {
            h = block_forward(i, last, shape)(b, h);
        }
        let mut grads = mse(two(&h, 0), y).backward();
        let per_block: Vec<GradientsParams> = model
            .iter()
            .map(|b| GradientsParams::from_module(&mut grads, b))
            .collect();
        model = model
            .into_iter()
            .zip(per_block)
            .zip(optims.iter_mut())
            .map(|((b, g), o)| o.step(LR, b, g))
            .collect();
    }
    model
}

/// Train `widths` as a dp × pp pipeline job and check it against the plain loop; returns the
/// step events.
async fn check(schedule: Schedule, widths: &[usize], shape: Shape, dp: u32) -> Vec<StepDone> {
    check_hooked(schedule, widths, shape, dp, None).await
}

/// [`check`], with `hook` called before every block's forward in the pipeline job.
async fn check_hooked(
    schedule: Schedule,
    widths: &[usize],
    shape: Shape,
    dp: u32,
    hook: Option<ForwardHook>,
) -> Vec<StepDone> {
    let init = blocks(widths, shape, &Device::flex());
    let d = fixture().with_widths(widths).data();
    let v = schedule.virtual_stages() as usize;
    let pp = init.len() / v;
    let job = Job::builder()
        .pipeline(as_hooked_stages(&init, shape, hook), schedule)
        .data_parallel(dp)
        .data(d.clone())
        .batch_size(BATCH)
        .optimizer(SgdConfig::new())
        .learning_rate(LR)
        .steps(STEPS)
        .seed(3)
        .step_timeout(Duration::from_secs(120))
        .build()
        .expect("a valid pipeline job");
    let (trained, events) = tokio::time::timeout(Duration::from_secs(300), run_recording(job))
        .await
        .expect("the job ends");
    let mut trained: PipelineModel = trained
        .unwrap_or_else(|e| panic!("{schedule:?}: {e}"))
        .model;
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS);
    let reference = run_reference(init.clone(), shape, &d, &batches_from_events(&steps));
    let label = format!("{schedule:?} dp={dp} {widths:?} {shape:?}");
    let mut moved = 0;
    for (i, (r, b0)) in reference.iter().zip(&init).enumerate() {
        let b = trained
            .take_block::<Block>(i)
            .unwrap_or_else(|| panic!("{label}: block {i} came back"));
        // A deep narrow stack may barely move its first blocks in 10 steps; the comparison is
        // not vacuous as long as training moved the model.
        moved += usize::from(compare_parameters(&b, b0, 1e-4).is_err());
        compare_parameters(&b, r, TOLERANCE).unwrap_or_else(|e| panic!("{label} block {i}: {e}"));
    }
    assert!(moved > 0, "{label}: training moved no block");
    // Replicas of a stage end identical.
    let fingerprints = events
        .iter()
        .find_map(|e| match e {
            JobEvent::Finished { fingerprints, .. } => Some(fingerprints.clone()),
            _ => None,
        })
        .expect("a Finished event");
    assert_eq!(fingerprints.len(), dp as usize * pp);
    // Every stage of every replica ran exactly its list, every step.
    let plan = schedule.instructions(pp as u32).unwrap();
    for s in &steps {
        assert_eq!(s.replicas.len(), dp as usize * pp, "one report per stage");
        for r in &s.replicas {
            let ran: Vec<Instr> = r
                .pipeline
                .as_ref()
                .expect("a pipeline record")
                .executed
                .iter()
                .map(|t| t.instr)
                .collect();
            assert_eq!(
                ran,
                plan.list(StageIndex(r.stage.stage)),
                "{label}: {} ran exactly its list",
                r.stage
            );
        }
        let p = s.pipeline.as_ref().expect("pipeline figures");
        assert_eq!(p.timeline.len(), pp);
        assert!(p.bubble >= 0.0 && p.bubble < 1.0, "{}", p.bubble);
    }
    steps
}

/// Whether stage 0 and stage 1 of replica 0 ever computed at the same time.
fn stages_overlap(steps: &[StepDone]) -> bool {
    let compute = |stage: u32| -> Vec<(u64, u64)> {
        steps
            .iter()
            .flat_map(|s| s.replicas.iter())
            .filter(|r| r.stage.replica == 0 && r.stage.stage == stage)
            .flat_map(|r| r.pipeline.iter().flat_map(|p| p.executed.iter()))
            .filter(|t| t.instr.is_compute())
            .map(|t| (t.start, t.end))
            .collect()
    };
    let (a, b) = (compute(0), compute(1));
    a.iter()
        .any(|(s0, e0)| b.iter().any(|(s1, e1)| s0 < e1 && s1 < e0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp_2_and_4_every_schedule_and_micro_batch_count_match_one_device() {
    let started = Instant::now();
    for m in [1, 4, 8] {
        for schedule in [
            Schedule::GPipe { micro_batches: m },
            Schedule::OneFOneB { micro_batches: m },
        ] {
            check(schedule, &[8, 32, 3], Shape::Plain, 1).await;
            check(schedule, &[8, 32, 16, 12, 3], Shape::Plain, 1).await;
        }
    }
    // Interleaved needs M to be a multiple of K: K·v blocks, v = 2.
    for m in [4, 8] {
        let schedule = Schedule::Interleaved {
            micro_batches: m,
            virtual_stages: 2,
        };
        check(schedule, &[8, 32, 16, 12, 3], Shape::Plain, 1).await;
        check(
            schedule,
            &[8, 32, 16, 16, 16, 16, 16, 12, 3],
            Shape::Plain,
            1,
        )
        .await;
    }
    eprintln!("20 configurations in {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_with_different_activation_shapes_match_one_device() {
    // 784 → 1024 → 256 → 10: three blocks, three different activation widths.
    for schedule in [
        Schedule::GPipe { micro_batches: 4 },
        Schedule::OneFOneB { micro_batches: 4 },
    ] {
        check(schedule, &[784, 1024, 256, 10], Shape::Plain, 1).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_3_boundary_and_two_tensors_across_a_boundary_match_one_device() {
    check(
        Schedule::OneFOneB { micro_batches: 4 },
        &[8, 32, 3],
        Shape::Rank3,
        1,
    )
    .await;
    check(
        Schedule::GPipe { micro_batches: 4 },
        &[8, 32, 16, 3],
        Shape::Skip,
        1,
    )
    .await;
    check(
        Schedule::Interleaved {
            micro_batches: 4,
            virtual_stages: 2,
        },
        &[8, 32, 16, 12, 3],
        Shape::Skip,
        1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_2_by_pp_2_matches_one_device_for_every_schedule() {
    for schedule in [
        Schedule::GPipe { micro_batches: 4 },
        Schedule::OneFOneB { micro_batches: 4 },
        Schedule::Interleaved {
            micro_batches: 4,
            virtual_stages: 2,
        },
    ] {
        let blocks: &[usize] = if schedule.virtual_stages() == 2 {
            &[8, 32, 16, 12, 3]
        } else {
            &[8, 32, 3]
        };
        let steps = check(schedule, blocks, Shape::Plain, 2).await;
        // Two replicas, each a whole pipeline: four stage reports per step.
        assert!(steps.iter().all(|s| s.replicas.len() == 4));
    }
}

/// Makes stage 0 and stage 1 (of replica 0, on a `pp`-stage pipeline) compute at the same
/// time at least once, however the threads are scheduled: block 0's second forward waits (at
/// most 30 s) until a block of stage 1 has started a forward. Only a pipeline whose stages
/// run concurrently gets past the wait in time; the recorded timelines must then overlap.
fn overlap_hook(pp: usize) -> ForwardHook {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let stage_1_started = Arc::new(AtomicBool::new(false));
    let block_0_second_began = Arc::new(AtomicBool::new(false));
    let block_0_forwards = Arc::new(AtomicU32::new(0));
    // Each side says it is inside its forward, then waits (bounded) for the other: both
    // forwards are running at the moment both flags are set, however the threads are
    // scheduled. (Neither waits for something that needs the other's wait to end: block 0's
    // second forward needs no backward, and stage 1's first forward only its input.)
    let wait_for = |flag: &AtomicBool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    Arc::new(move |block| {
        // Block b runs on stage b mod pp (chunk c of stage d is block c·pp + d).
        if block % pp == 1 && !stage_1_started.swap(true, Ordering::SeqCst) {
            wait_for(&block_0_second_began);
        }
        if block == 0 && block_0_forwards.fetch_add(1, Ordering::SeqCst) == 1 {
            block_0_second_began.store(true, Ordering::SeqCst);
            wait_for(&stage_1_started);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_compute_at_the_same_time() {
    // The overlap is forced by `overlap_hook` (a loaded machine may otherwise run short
    // forwards one after the other); the recorded timelines must show it.
    for schedule in [
        Schedule::GPipe { micro_batches: 8 },
        Schedule::OneFOneB { micro_batches: 4 },
        Schedule::Interleaved {
            micro_batches: 4,
            virtual_stages: 2,
        },
    ] {
        let widths: &[usize] = if schedule.virtual_stages() == 2 {
            &[8, 256, 256, 256, 3]
        } else {
            &[8, 512, 512, 3]
        };
        let pp = (widths.len() - 1) / schedule.virtual_stages() as usize;
        let hook = overlap_hook(pp);
        let steps = check_hooked(schedule, widths, Shape::Plain, 1, Some(hook)).await;
        assert!(
            stages_overlap(&steps),
            "{schedule:?}: stage 0 and stage 1 never computed at the same time"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_steps_give_stash_bounds_memory_and_a_measured_bubble() {
    use meshwork::parallel::pipeline::render_svg;
    use meshwork::parallel::pipeline_exec::chrome_trace;
    let widths = [8, 64, 3];
    let gpipe = check(
        Schedule::GPipe { micro_batches: 8 },
        &widths,
        Shape::Plain,
        1,
    )
    .await;
    let one_f_one_b = check(
        Schedule::OneFOneB { micro_batches: 8 },
        &widths,
        Shape::Plain,
        1,
    )
    .await;
    let stash = |s: &[StepDone]| -> Vec<u32> {
        s.iter()
            .map(|s| s.pipeline.as_ref().unwrap().peak_stash[0])
            .collect()
    };
    // Stage 0 of 2: GPipe stashes every micro-batch, 1F1B at most K = 2.
    assert!(stash(&gpipe).iter().all(|&p| p == 8));
    assert!(stash(&one_f_one_b).iter().all(|&p| p <= 2));
    let bytes = |s: &[StepDone]| {
        s.iter()
            .map(|s| s.pipeline.as_ref().unwrap().peak_activation_bytes[0])
            .max()
    };
    assert!(
        bytes(&one_f_one_b) < bytes(&gpipe),
        "1F1B holds fewer activations"
    );
    // The last step's measured timeline: a picture and a Chrome trace with one box per
    // instruction.
    let last = gpipe.last().unwrap().pipeline.as_ref().unwrap();
    assert!(render_svg(&last.timeline).starts_with("<svg"));
    let trace: serde_json::Value = serde_json::from_str(&chrome_trace(&last.timeline)).unwrap();
    let boxes = trace["traceEvents"].as_array().unwrap().len();
    assert_eq!(boxes, last.timeline.iter().map(Vec::len).sum::<usize>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recompute_keeps_only_inputs_and_still_matches_one_device() {
    let widths = [8, 64, 32, 3];
    let init = blocks(&widths, Shape::Plain, &Device::flex());
    let last = init.len() - 1;
    let d = fixture().data();
    let mut stages = PipelineStages::new(|items: &[Sample], dev: &Device| {
        vec![AnyTensor::D2(batch_tensors(items, dev).0)]
    });
    for (i, b) in init.iter().enumerate() {
        let f = block_forward(i, last, Shape::Plain);
        stages = if i == last {
            stages.last(
                b.clone(),
                move |m: &Block, x: Boundary, items: &[Sample], dev: &Device| {
                    mse(two(&f(m, x), 0), batch_tensors(items, dev).1)
                },
            )
        } else {
            stages.stage_recomputed(b.clone(), f)
        };
    }
    let job = Job::builder()
        .pipeline(stages, Schedule::GPipe { micro_batches: 4 })
        .data(d.clone())
        .batch_size(BATCH)
        .optimizer(SgdConfig::new())
        .learning_rate(LR)
        .steps(STEPS)
        .seed(3)
        .build()
        .unwrap();
    let (trained, events) = tokio::time::timeout(Duration::from_secs(300), run_recording(job))
        .await
        .expect("the job ends");
    let mut trained = trained.unwrap().model;
    let steps = steps_of(&events);
    let reference = run_reference(init, Shape::Plain, &d, &batches_from_events(&steps));
    for (i, r) in reference.iter().enumerate() {
        compare_parameters(&trained.take_block::<Block>(i).unwrap(), r, TOLERANCE).unwrap();
    }
    // Stage 0 stashed only its inputs: 4 micro-batches × 4 samples × 8 features × 4 bytes.
    let p = steps[0].pipeline.as_ref().unwrap();
    assert_eq!(p.peak_activation_bytes[0], 4 * 4 * 8 * 4);
    let kept = check(
        Schedule::GPipe { micro_batches: 4 },
        &widths,
        Shape::Plain,
        1,
    )
    .await;
    assert!(
        kept[0].pipeline.as_ref().unwrap().peak_activation_bytes[0] > p.peak_activation_bytes[0]
    );
}

/// A two-block job whose blocks call `hook` with the number of forwards the block has run
/// (on this replica) before each forward.
fn hooked_job(
    hook0: impl Fn(u32) + Send + Sync + Clone + 'static,
    hook1: impl Fn(u32) + Send + Sync + Clone + 'static,
    collective_timeout: Duration,
) -> Job<PipelineModel, Sample> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    let init = blocks(&[8, 16, 3], Shape::Plain, &Device::flex());
    let (c0, c1) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let stages = PipelineStages::new(|items: &[Sample], d: &Device| {
        vec![AnyTensor::D2(batch_tensors(items, d).0)]
    })
    .stage(init[0].clone(), move |m: &Block, x: Boundary| {
        hook0(c0.fetch_add(1, Ordering::SeqCst));
        vec![AnyTensor::D2(relu(m.linear.forward(two(&x, 0))))]
    })
    .last(
        init[1].clone(),
        move |m: &Block, x: Boundary, items: &[Sample], d: &Device| {
            hook1(c1.fetch_add(1, Ordering::SeqCst));
            mse(m.linear.forward(two(&x, 0)), batch_tensors(items, d).1)
        },
    );
    Job::builder()
        .pipeline(stages, Schedule::GPipe { micro_batches: 4 })
        .data(fixture().data())
        .batch_size(BATCH)
        .steps(STEPS)
        .collective_timeout(collective_timeout)
        .step_timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp_1_a_panicking_stage_ends_the_job_naming_the_stage_and_micro_batch() {
    use meshwork::Error;
    // The last stage panics in the forward of micro-batch 2 of step 1 (its 7th forward).
    let job = hooked_job(
        |_| {},
        |n| assert!(n != 6, "injected failure"),
        Duration::from_secs(30),
    );
    let started = Instant::now();
    let (outcome, events) = tokio::time::timeout(Duration::from_secs(60), run_recording(job))
        .await
        .expect("the job ends");
    match outcome {
        Err(Error::StageFailed { stage, during, .. }) => {
            assert_eq!((stage.replica, stage.stage), (0, 1));
            assert_eq!(during, "forward of micro-batch 2 (chunk 0)");
        }
        other => panic!("expected StageFailed, got {other:?}"),
    }
    // The neighbour was woken at once, not after the 30 s link time-out.
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(steps_of(&events).len(), 1, "step 0 finished, step 1 failed");
    assert!(matches!(events.last(), Some(JobEvent::Failed(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp_1_a_neighbour_that_never_sends_is_a_typed_time_out_not_a_hang() {
    use meshwork::Error;
    use meshwork::parallel::pipeline_exec::ExecError;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Stage 0 stalls in its first forward of step 1 until the test has the job's outcome (at
    // most 120 s), so the job can only end by the link time-out, never by the stall ending.
    // The time-out (5 s) is far above step 0's compute, which it also bounds.
    let link_timeout = Duration::from_secs(5);
    let released = Arc::new(AtomicBool::new(false));
    let job = hooked_job(
        {
            let released = released.clone();
            move |n| {
                if n == 4 {
                    let guard = Instant::now() + Duration::from_secs(120);
                    while !released.load(Ordering::SeqCst) && Instant::now() < guard {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
        },
        |_| {},
        link_timeout,
    );
    let started = Instant::now();
    // Well under the stall's guard: a job that waited for the stalled stage fails here.
    let outcome = tokio::time::timeout(Duration::from_secs(60), run_recording(job)).await;
    released.store(true, Ordering::SeqCst);
    let (outcome, _) = outcome.expect("the job ends while stage 0 is still stalled");
    match outcome {
        Err(Error::Pipeline(ExecError::Timeout {
            stage,
            from,
            mb,
            waited,
            ..
        })) => {
            assert_eq!((stage, from, mb), (1, 0, 0));
            assert_eq!(waited, link_timeout);
        }
        other => panic!("expected a link time-out, got {other:?}"),
    }
    assert!(started.elapsed() >= link_timeout, "{:?}", started.elapsed());
}

#[test]
fn job_1_pipeline_configurations_that_cannot_work_are_refused_with_what_to_change() {
    let init = blocks(&[8, 16, 12, 3], Shape::Plain, &Device::flex());
    let refused = |build: &dyn Fn() -> meshwork::Result<Job<PipelineModel, Sample>>,
                   needle: &str| {
        match build() {
            Err(meshwork::Error::InvalidConfig(m)) => {
                assert!(m.contains(needle), "{m:?} should mention {needle:?}")
            }
            Err(meshwork::Error::Refused(r)) => {
                assert!(
                    r.features()
                        .contains(&meshwork::composition::Feature::Pipeline)
                        && r.to_string().contains(needle),
                    "{r} should name the pipeline and mention {needle:?}"
                )
            }
            Err(meshwork::Error::Schedule(e)) => {
                assert!(
                    e.to_string().contains(needle),
                    "{e} should mention {needle:?}"
                )
            }
            Err(other) => panic!("expected a refusal mentioning {needle:?}, got {other}"),
            Ok(_) => panic!("expected a refusal mentioning {needle:?}"),
        }
    };
    let base = |schedule: Schedule, batch: usize| {
        Job::builder()
            .pipeline(as_stages(&init, Shape::Plain), schedule)
            .data(fixture().data())
            .batch_size(batch)
    };
    let one_f_one_b = Schedule::OneFOneB { micro_batches: 4 };
    // 3 blocks do not make stages of 2 chunks each.
    let interleaved = Schedule::Interleaved {
        micro_batches: 4,
        virtual_stages: 2,
    };
    refused(&|| base(interleaved, 16).build(), "multiple of 2 blocks");
    // 16 samples do not cut into 2 replicas × 3 micro-batches.
    refused(
        &|| {
            base(Schedule::GPipe { micro_batches: 3 }, 16)
                .data_parallel(2)
                .build()
        },
        "multiple of 6",
    );
    // Accumulation over 2 is the schedule over 8 micro-batches: 12 samples do not cut so.
    refused(
        &|| base(one_f_one_b, 12).gradient_accumulation(2).build(),
        "multiple of 8",
    );
    refused(
        &|| {
            base(one_f_one_b, 16)
                .on_non_finite_loss(meshwork::job::NonFinitePolicy::Skip)
                .build()
        },
        "Skip",
    );
    // Interleaved 1F1B needs M to be a multiple of K (here K = 2, M = 3).
    let four = blocks(&[8, 16, 16, 12, 3], Shape::Plain, &Device::flex());
    refused(
        &|| {
            Job::builder()
                .pipeline(
                    as_stages(&four, Shape::Plain),
                    Schedule::Interleaved {
                        micro_batches: 3,
                        virtual_stages: 2,
                    },
                )
                .data(fixture().data())
                .batch_size(12)
                .build()
        },
        "multiple",
    );
    // A pipeline without its loss block.
    refused(
        &|| {
            Job::builder()
                .pipeline(
                    PipelineStages::new(|items: &[Sample], d: &Device| {
                        vec![AnyTensor::D2(batch_tensors(items, d).0)]
                    })
                    .stage(init[0].clone(), block_forward(0, 2, Shape::Plain)),
                    one_f_one_b,
                )
                .data(fixture().data())
                .batch_size(16)
                .build()
        },
        ".last(..)",
    );
    // Too few devices for 2 × 3.
    refused(
        &|| {
            base(one_f_one_b, 16)
                .data_parallel(2)
                .devices(meshwork::device::MeshDevice::of_kind(
                    meshwork::device::BackendKind::Flex,
                    4,
                )?)
                .build()
        },
        "needs 6 devices",
    );
}

/// A 1F1B (or interleaved) pipeline job of `widths` for `steps` steps, with the extras
/// `configure` adds (faults, recovery, checkpoints).
fn recovery_job(
    init: &[Block],
    schedule: Schedule,
    dp: u32,
    steps: u64,
    configure: impl FnOnce(
        meshwork::job::JobBuilder<PipelineModel, Sample>,
    ) -> meshwork::job::JobBuilder<PipelineModel, Sample>,
) -> Job<PipelineModel, Sample> {
    let builder = Job::builder()
        .pipeline(as_stages(init, Shape::Plain), schedule)
        .data_parallel(dp)
        .data(fixture().data())
        .batch_size(BATCH)
        .optimizer(SgdConfig::new())
        .learning_rate(LR)
        .steps(steps)
        .seed(3)
        .step_timeout(Duration::from_secs(120));
    configure(builder).build().expect("a valid pipeline job")
}

/// Every trained block equals the plain loop's after `batches`.
fn assert_blocks_match(
    init: Vec<Block>,
    mut trained: PipelineModel,
    batches: &[Vec<usize>],
    label: &str,
) {
    let reference = run_reference(init, Shape::Plain, &fixture().data(), batches);
    for (i, r) in reference.iter().enumerate() {
        let b = trained
            .take_block::<Block>(i)
            .unwrap_or_else(|| panic!("{label}: block {i} came back"));
        compare_parameters(&b, r, TOLERANCE).unwrap_or_else(|e| panic!("{label} block {i}: {e}"));
    }
}

fn fired(events: &[JobEvent]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, JobEvent::FaultInjected(_)))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_6_a_lost_stage_is_replaced_from_its_twin_and_training_equals_one_device() {
    use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
    use meshwork::recovery::RecoveryPolicy;
    let init = blocks(&[8, 16, 16, 3], Shape::Plain, &Device::flex());
    // Three blocks on a 2 × 3 mesh; device 3 holds one replica's stage, which panics in a
    // backward of step 3.
    let plan = FaultPlan::new(6).with(Fault {
        device: 3,
        step: 3,
        micro_batch: Some(1),
        phase: Phase::Backward,
        kind: FaultKind::Panic,
    });
    let job = recovery_job(
        &init,
        Schedule::OneFOneB { micro_batches: 4 },
        2,
        STEPS,
        |b| b.fault_plan(plan).recovery(RecoveryPolicy::shrink()),
    );
    let (trained, events) = tokio::time::timeout(Duration::from_secs(300), run_recording(job))
        .await
        .expect("the job ends");
    let trained = trained.expect("the stage is replaced").model;
    assert_eq!(fired(&events), 1);
    type Replaced = (u64, (u32, u32), (u32, u32));
    let replaced: Vec<Replaced> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::StageReplaced {
                step, stage, twin, ..
            } => Some((
                *step,
                (stage.replica, stage.stage),
                (twin.replica, twin.stage),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(replaced.len(), 1, "{replaced:?}");
    let (step, lost, twin) = replaced[0];
    assert_eq!(step, 3);
    assert_eq!(lost.1, twin.1, "the twin holds the same stage");
    assert_ne!(lost.0, twin.0, "in another replica");
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS, "every step once, step 3 redone");
    let sizes: Vec<usize> = steps.iter().map(|s| s.replicas.len()).collect();
    assert!(
        sizes.iter().all(|&n| n == 6),
        "the size stayed 2 × 3: {sizes:?}"
    );
    // Replicas of each stage end identical.
    let fingerprints = meshwork::testing::final_fingerprints(&events).expect("finished");
    assert_eq!(fingerprints.len(), 6);
    assert_blocks_match(init, trained, &batches_from_events(&steps), "twin restore");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ckpt_6_a_pipeline_checkpoint_resumes_onto_another_split_and_equals_one_device() {
    let init = blocks(&[8, 16, 16, 16, 3], Shape::Plain, &Device::flex());
    let dir = TempDir::new("pp-ckpt");
    let interleaved = Schedule::Interleaved {
        micro_batches: 4,
        virtual_stages: 2,
    };
    // First run: 4 steps, a checkpoint when it ends (one shard per block).
    let first = recovery_job(&init, interleaved, 1, 4, |b| {
        b.checkpoint_dir(dir.path()).checkpoint_every(4)
    });
    let (outcome, first_events) =
        tokio::time::timeout(Duration::from_secs(300), run_recording(first))
            .await
            .expect("the job ends");
    outcome.expect("the first run");
    let store = meshwork::checkpoint::CheckpointStore::open(dir.path(), 3).unwrap();
    let latest = store.latest_valid().unwrap().expect("a checkpoint");
    assert_eq!(latest.checkpoint.step, 4);
    assert_eq!(latest.checkpoint.shards.len(), 4, "one shard per block");
    // Second run, on another split of the same blocks (four stages of one block each
    // instead of two stages of two): resumes at step 4 and runs to 8.
    let split = Schedule::OneFOneB { micro_batches: 4 };
    let second = recovery_job(&init, split, 1, 8, |b| {
        b.checkpoint_dir(dir.path()).resume_from_checkpoint(true)
    });
    let (outcome, second_events) =
        tokio::time::timeout(Duration::from_secs(300), run_recording(second))
            .await
            .expect("the job ends");
    let trained = outcome.expect("the resumed run").model;
    assert!(
        second_events
            .iter()
            .any(|e| matches!(e, JobEvent::Restored { step: 4, .. }))
    );
    let mut all = steps_of(&first_events);
    all.extend(steps_of(&second_events));
    assert_eq!(
        all.iter().map(|s| s.step).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert_blocks_match(
        init,
        trained,
        &batches_from_events(&all),
        "resumed pipeline",
    );
    // A model whose blocks do not fit the checkpoint's is refused, naming the checkpoint.
    let other = blocks(&[8, 32, 3], Shape::Plain, &Device::flex());
    let third = recovery_job(&other, split, 1, 8, |b| {
        b.checkpoint_dir(dir.path()).resume_from_checkpoint(true)
    });
    let (outcome, _) = tokio::time::timeout(Duration::from_secs(300), run_recording(third))
        .await
        .expect("the job ends");
    match outcome {
        Err(meshwork::Error::InvalidConfig(m)) => {
            assert!(m.contains("cannot be restored onto this job"), "{m}")
        }
        other => panic!("expected a refused checkpoint, got {:?}", other.map(|_| ())),
    }
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_5_a_pipeline_without_a_twin_rolls_back_to_its_checkpoint_in_place() {
    use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
    use meshwork::recovery::RecoveryPolicy;
    let init = blocks(&[8, 16, 16, 3], Shape::Plain, &Device::flex());
    let dir = TempDir::new("pp-rollback");
    let plan = FaultPlan::new(7).with(Fault {
        device: 1,
        step: 5,
        micro_batch: Some(0),
        phase: Phase::Forward,
        kind: FaultKind::Panic,
    });
    let job = recovery_job(
        &init,
        Schedule::OneFOneB { micro_batches: 4 },
        1,
        STEPS,
        |b| {
            b.fault_plan(plan)
                .recovery(RecoveryPolicy::roll_back())
                .checkpoint_dir(dir.path())
                .checkpoint_every(2)
        },
    );
    let (trained, events) = tokio::time::timeout(Duration::from_secs(300), run_recording(job))
        .await
        .expect("the job ends");
    let trained = trained.expect("the job rolls back").model;
    assert_eq!(fired(&events), 1);
    let rolled: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::RolledBack {
                failed_step, step, ..
            } => Some((*failed_step, *step)),
            _ => None,
        })
        .collect();
    assert_eq!(rolled, vec![(5, 4)]);
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS);
    assert_blocks_match(
        init,
        trained,
        &batches_from_events(&steps),
        "pipeline rollback",
    );
    let _ = std::fs::remove_dir_all(dir.path());
}
