//! REPRO-1: every strategy is bitwise reproducible. The same job (same initial record, seed,
//! layout and data) run twice ends with the same parameters, bit for bit, on every rank: data
//! parallel, each pipeline schedule, and dp × pp meshes. (A cross-process run is checked in
//! `tests/cluster/cluster_training.rs`.)
//!
//! Each run also proves it was distributed: one fingerprint per rank of the mesh, and the
//! replicas' sample ids disjoint within every step.

use std::collections::HashSet;
use std::time::Duration;

use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::tensor::Device;
use burn::tensor::Tensor;
use burn::tensor::activation::relu;
use meshwork::demo::{Mlp, Sample, batch_tensors};
use meshwork::device::{BackendKind, MeshDevice};
use meshwork::events::JobEvent;
use meshwork::job::{PipelineModel, PipelineStages};
use meshwork::parallel::pipeline::Schedule;
use meshwork::parallel::pipeline_exec::{AnyTensor, Boundary};
use meshwork::prelude::*;
use meshwork::testing::{
    TeacherFixture, bounded, draw_lock, final_fingerprints, parameter_bits, run_recording, steps_of,
};

// Flex's random generator is process-global and the suite's tests run at once in one process:
// each seeds and builds its model under `draw_lock`, so that no other test draws numbers
// between its seed and its draws (two programs never share a generator).

const STEPS: u64 = 12;
const GLOBAL_BATCH: usize = 48;
const WIDTHS: [usize; 6] = [16, 64, 64, 64, 64, 4];
const BOUND: Duration = Duration::from_secs(300);

/// 1024 samples of the 16 → 4 teacher (seed 3, noise 0.1) and the MLP of `WIDTHS` drawn from
/// seed 21 (the pipelines' blocks are drawn from seeds 22 and 23).
fn fixture() -> TeacherFixture {
    TeacherFixture::new(3, 21)
        .with_widths(&WIDTHS)
        .with_samples(1024)
}

/// A run's outcome: each rank's fingerprint, every parameter's bits (in module order), and
/// each step's sample ids per replica.
struct Run {
    fingerprints: Vec<u64>,
    bits: Vec<Vec<u32>>,
    samples: Vec<Vec<Vec<usize>>>,
}

/// Runs `job` (bounded by 300 s); `bits` gives the trained model's parameters' bits.
async fn record<M: Send + 'static>(
    job: Job<M, Sample>,
    world: usize,
    bits: impl FnOnce(M) -> Vec<Vec<u32>>,
) -> Run {
    let (outcome, events) = bounded(BOUND, run_recording(job)).await;
    let trained = outcome.expect("the job trains");
    let fingerprints = final_fingerprints(&events).expect("a Finished event");
    assert_eq!(fingerprints.len(), world, "one fingerprint per rank");
    assert!(
        events.iter().all(|e| !matches!(e, JobEvent::Failed(_))),
        "no failure"
    );
    let steps = steps_of(&events);
    assert_eq!(steps.len() as u64, STEPS);
    // Each replica's sample ids per step (a pipeline's stages all report their replica's: its
    // first stage speaks for it).
    let samples: Vec<Vec<Vec<usize>>> = steps
        .iter()
        .map(|s| {
            s.replicas
                .iter()
                .filter(|r| r.stage.stage == 0)
                .map(|r| r.sample_ids.clone())
                .collect()
        })
        .collect();
    Run {
        fingerprints,
        bits: bits(trained.model),
        samples,
    }
}

/// The two runs are equal bit for bit, and each was distributed over `replicas` replicas.
fn assert_reproducible(what: &str, a: &Run, b: &Run, replicas: usize) {
    for step in &a.samples {
        assert_eq!(step.len(), replicas, "{what}: one share per replica");
        let ids: Vec<usize> = step.iter().flatten().copied().collect();
        let unique: HashSet<usize> = ids.iter().copied().collect();
        assert_eq!(
            unique.len(),
            ids.len(),
            "{what}: replicas' samples disjoint"
        );
        assert_eq!(ids.len(), GLOBAL_BATCH, "{what}: the global batch");
    }
    assert_eq!(a.samples, b.samples, "{what}: the same sample ids");
    assert_eq!(
        a.fingerprints, b.fingerprints,
        "{what}: the ranks' final fingerprints differ between two identical runs"
    );
    assert_eq!(a.bits.len(), b.bits.len());
    for (i, (x, y)) in a.bits.iter().zip(&b.bits).enumerate() {
        let differing = x.iter().zip(y).filter(|(p, q)| p != q).count();
        assert_eq!(
            differing,
            0,
            "{what}: parameter {i} differs in {differing} of {} values between two identical runs",
            x.len()
        );
    }
}

fn devices(world: usize) -> Vec<MeshDevice> {
    MeshDevice::of_kind(BackendKind::Flex, world).expect("flex devices")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_1_data_parallel_twice_is_bitwise_equal() {
    let job = |init: Mlp| {
        fixture()
            .builder(&init, 3, GLOBAL_BATCH, STEPS)
            .optimizer(AdamConfig::new())
            .learning_rate(3e-3)
            .gradient_accumulation(2)
            .devices(devices(3))
            .seed(9)
            .build()
            .expect("a valid job")
    };
    let a = record(job(fixture().initial_model()), 3, |m| parameter_bits(&m)).await;
    let b = record(job(fixture().initial_model()), 3, |m| parameter_bits(&m)).await;
    assert_reproducible("dp 3", &a, &b, 3);
}

/// The MLP of [`WIDTHS`] as `blocks` pipeline blocks of consecutive `Linear` layers, each
/// built as a user builds one: `LinearConfig::init` right after seeding the device, parameters
/// left for Burn to draw lazily on first use.
fn lazy_blocks(blocks: usize) -> Vec<Vec<Linear>> {
    let device = Device::flex();
    device.seed(22);
    let sizes =
        meshwork::parallel::pipeline::even_split(WIDTHS.len() - 1, blocks).expect("the MLP splits");
    let mut layers = WIDTHS
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(&device));
    sizes
        .iter()
        .map(|&n| layers.by_ref().take(n).collect())
        .collect()
}

fn block_forward(block: &[Linear], x: Tensor<2>, ends_model: bool) -> Tensor<2> {
    let n = block.len();
    block.iter().enumerate().fold(x, |h, (i, l)| {
        let h = l.forward(h);
        if ends_model && i + 1 == n { h } else { relu(h) }
    })
}

fn rank2(b: &Boundary) -> Tensor<2> {
    match b.first() {
        Some(AnyTensor::D2(t)) => t.clone(),
        other => panic!("one rank-2 tensor crosses each boundary, got {other:?}"),
    }
}

/// One pipeline job of `blocks` (each job gets the same blocks, before any was used).
fn pipeline_job(
    blocks: Vec<Vec<Linear>>,
    schedule: Schedule,
    dp: u32,
    pp: u32,
) -> Job<PipelineModel, Sample> {
    let last = blocks.len() - 1;
    let mut stages = PipelineStages::new(|items: &[Sample], d: &Device| {
        vec![AnyTensor::D2(batch_tensors(items, d).0)]
    });
    for (i, block) in blocks.into_iter().enumerate() {
        stages = if i == last {
            stages.last(
                block,
                |m: &Vec<Linear>, x: Boundary, items: &[Sample], d: &Device| {
                    let (_, y) = batch_tensors(items, d);
                    let diff = block_forward(m, rank2(&x), true) - y;
                    (diff.clone() * diff).mean()
                },
            )
        } else {
            stages.stage(block, |m: &Vec<Linear>, x: Boundary| {
                vec![AnyTensor::D2(block_forward(m, rank2(&x), false))]
            })
        };
    }
    Job::builder()
        .pipeline(stages, schedule)
        .data(fixture().data())
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(dp)
        .devices(devices((dp * pp) as usize))
        .batch_size(GLOBAL_BATCH)
        .steps(STEPS)
        .seed(9)
        .build()
        .expect("a valid pipeline job")
}

/// The trained blocks' parameters, block by block.
fn pipeline_bits(model: PipelineModel) -> Vec<Vec<u32>> {
    (0..model.len())
        .flat_map(|b| parameter_bits(model.block::<Vec<Linear>>(b).expect("a block of layers")))
        .collect()
}

async fn check_pipeline(schedule: Schedule, dp: u32, pp: u32) {
    let blocks = (pp * schedule.virtual_stages()) as usize;
    let what = format!("{schedule:?}, dp {dp} × pp {pp}");
    // Each run builds its blocks afresh from the seed, as two runs of a program would.
    let world = (dp * pp) as usize;
    let job = || {
        let _draw = draw_lock();
        pipeline_job(lazy_blocks(blocks), schedule, dp, pp)
    };
    let a = record(job(), world, pipeline_bits).await;
    let b = record(job(), world, pipeline_bits).await;
    assert_reproducible(&what, &a, &b, dp as usize);
}

const MICRO_BATCHES: u32 = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_1_gpipe_twice_is_bitwise_equal() {
    let s = Schedule::GPipe {
        micro_batches: MICRO_BATCHES,
    };
    check_pipeline(s, 1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_1_one_f_one_b_twice_is_bitwise_equal() {
    let s = Schedule::OneFOneB {
        micro_batches: MICRO_BATCHES,
    };
    check_pipeline(s, 1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_1_interleaved_twice_is_bitwise_equal() {
    let s = Schedule::Interleaved {
        micro_batches: MICRO_BATCHES,
        virtual_stages: 2,
    };
    check_pipeline(s, 1, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_1_dp_2_by_pp_2_twice_is_bitwise_equal_for_every_schedule() {
    for s in [
        Schedule::GPipe {
            micro_batches: MICRO_BATCHES,
        },
        Schedule::OneFOneB {
            micro_batches: MICRO_BATCHES,
        },
        Schedule::Interleaved {
            micro_batches: MICRO_BATCHES,
            virtual_stages: 2,
        },
    ] {
        check_pipeline(s, 2, 2).await;
    }
}

/// The demo's pipeline (`meshwork train --pp`), whose blocks were always drawn when built:
/// reproducible too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repro_1_the_demo_pipeline_twice_is_bitwise_equal() {
    let schedule = Schedule::OneFOneB {
        micro_batches: MICRO_BATCHES,
    };
    let job = || {
        let _draw = draw_lock();
        let device = Device::flex();
        device.seed(23);
        let sizes =
            meshwork::parallel::pipeline::even_split(WIDTHS.len() - 1, 2).expect("the MLP splits");
        let stages =
            meshwork::demo::mlp_pipeline(&WIDTHS, &sizes, &device).expect("the demo blocks");
        Job::builder()
            .pipeline(stages, schedule)
            .data(fixture().data())
            .optimizer(AdamConfig::new())
            .learning_rate(3e-3)
            .data_parallel(2)
            .devices(devices(4))
            .batch_size(GLOBAL_BATCH)
            .steps(STEPS)
            .seed(9)
            .build()
            .expect("a valid pipeline job")
    };
    let whole = |m| parameter_bits(&Mlp::from_pipeline(m).expect("the demo MLP's blocks"));
    let a = record(job(), 4, whole).await;
    let b = record(job(), 4, whole).await;
    assert_reproducible("the demo pipeline, dp 2 × pp 2", &a, &b, 2);
}
