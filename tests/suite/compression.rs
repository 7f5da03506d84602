//! Gradient compression (`JobBuilder::compression`, `parallel::compress`, CMP-1..4,
//! CSYNC-1..3) on the demo task at dp 4:
//! - at its exact limits (top-k of everything, PowerSGD at full rank) a compressed job equals
//!   plain data parallelism, which equals one device, every tensor within 1e-5 · max|ref|;
//! - each compressor trains to a final loss within a stated margin of uncompressed data
//!   parallelism's;
//! - the bytes its collectives record per step are the compressor's prediction and fewer than
//!   plain data parallelism's (compression happened);
//! - the same seed gives the same bits, and a checkpoint keeps the residuals (a resumed job
//!   equals the uninterrupted one bit for bit).
//!
//! The sample ids in the step events prove the work was distributed over 4 replicas.

use std::collections::HashSet;
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::{Device, Tensor};
use meshwork::checkpoint::CheckpointStore;
use meshwork::demo::{Mlp, Sample, mse_loss};
use meshwork::events::StepDone;
use meshwork::optim::{LearningRate, OptimizerConfig};
use meshwork::prelude::*;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    parameter_bits, reference_train, run_recording, steps_of,
};
use meshwork::trace::TraceKind;

const TOLERANCE: f32 = 1e-5;
const DP: u32 = 4;
const GLOBAL_BATCH: usize = 32;

const BOUND: Duration = Duration::from_secs(300);

/// 512 samples of the 8 → 3 teacher (seed 7, noise 0.05) and an MLP drawn from seed 21 with
/// 8×33, 33×17 and 17×3 weights: rank-2 PowerSGD factors are smaller than each.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(7, 21)
        .with_widths(&[8, 33, 17, 3])
        .with_noise(0.05)
        .with_samples(512)
}

/// The trainable parameters' shapes, in the flat order the job reduces them in.
fn shapes(model: &Mlp) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl ModuleVisitor for Shapes {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(p.val().dims().to_vec());
        }
    }
    let mut s = Shapes(Vec::new());
    model.visit(&mut s);
    s.0
}

fn builder(
    compression: Compression,
    optimizer: OptimizerConfig,
    lr: f64,
    steps: u64,
) -> JobBuilder<Mlp, Sample> {
    let f = fixture();
    f.builder(&f.initial_model(), DP, GLOBAL_BATCH, steps)
        .optimizer(optimizer)
        .learning_rate(lr)
        .compression(compression)
        .seed(3)
        .collective_timeout(Duration::from_secs(30))
}

/// Run and return the trained model and the steps; checks the work was spread over `DP`
/// replicas with disjoint samples.
async fn train(b: JobBuilder<Mlp, Sample>) -> (Mlp, Vec<StepDone>) {
    let (outcome, events) = run_recording(b.build().expect("valid job")).await;
    let model = outcome.expect("job succeeds").model;
    let steps = steps_of(&events);
    for s in &steps {
        assert_eq!(s.replicas.len(), DP as usize, "one report per replica");
        let ids: HashSet<usize> = s
            .replicas
            .iter()
            .flat_map(|r| r.sample_ids.clone())
            .collect();
        assert_eq!(ids.len(), GLOBAL_BATCH, "replicas read disjoint samples");
    }
    (model, steps)
}

/// The bytes each replica's collectives recorded at each step (CSYNC-1).
fn traced_bytes(steps: &[StepDone]) -> Vec<Vec<u64>> {
    steps
        .iter()
        .map(|s| {
            s.replicas
                .iter()
                .map(|r| {
                    r.trace
                        .iter()
                        .map(|t| match t.kind {
                            TraceKind::AllReduce { bytes } | TraceKind::AllGather { bytes } => {
                                bytes
                            }
                            _ => 0,
                        })
                        .sum()
                })
                .collect()
        })
        .collect()
}

/// Mean loss of the last `n` steps.
fn final_loss(steps: &[StepDone], n: usize) -> f32 {
    let tail = &steps[steps.len() - n..];
    tail.iter().map(|s| s.loss).sum::<f32>() / n as f32
}

fn sgd() -> OptimizerConfig {
    SgdConfig::new().into()
}

/// CMP-2 end to end: top-k of everything and PowerSGD at full rank equal plain data
/// parallelism, which equals one device on the same batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_limits_equal_plain_data_parallel_and_one_device() {
    bounded(BOUND, async {
        let steps = 6;
        let (plain, plain_steps) = train(builder(Compression::None, sgd(), 0.1, steps)).await;
        let reference = reference_train(
            fixture().initial_model(),
            mse_loss,
            &fixture().data(),
            &batches_from_events(&plain_steps),
            &Reference {
                optimizer: sgd(),
                learning_rate: LearningRate::Constant(0.1),
                clip_norm: None,
            },
            &Device::flex(),
        );
        compare_parameters(&plain, &reference, TOLERANCE)
            .unwrap_or_else(|e| panic!("plain dp 4 vs one device: {e}"));
        assert!(
            compare_parameters(&plain, &fixture().initial_model(), 1e-3).is_err(),
            "it trained"
        );
        for exact in [
            Compression::TopK { fraction: 1.0 },
            Compression::PowerSgd {
                rank: 64,
                start_after: 0,
            },
        ] {
            let (model, steps) = train(builder(exact, sgd(), 0.1, steps)).await;
            let worst = compare_parameters(&model, &plain, TOLERANCE)
                .unwrap_or_else(|e| panic!("{exact} vs plain data parallel: {e}"));
            eprintln!("{exact}: worst relative difference to plain dp {worst:e}");
            // It really ran compressed: its own collectives, its own bytes.
            let want = exact.predicted_bytes(&shapes(&model), DP as usize);
            assert!(traced_bytes(&steps).iter().flatten().all(|b| *b == want));
        }
    })
    .await;
}

/// Each compressor trains dp 4 (SGD with momentum, lr 0.1, 150 steps) to a final loss (mean
/// of the last 5 steps) within its margin × uncompressed data parallelism's. Measured:
/// bf16 1.000×, PowerSGD rank 2 1.012×, top-k 0.1 1.163× (Adam at lr 0.01 gives 0.998×,
/// 1.003× and 1.509×: sparse updates suit Adam's moments badly). Its recorded bytes are its
/// prediction (CMP-4) and fewer than plain data parallelism's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_compressor_converges_near_plain_data_parallel_with_fewer_bytes() {
    bounded(BOUND, async {
        let steps = 150;
        let sgdm =
            || OptimizerConfig::from(SgdConfig::new().with_momentum(Some(MomentumConfig::new())));
        let (_, plain) = train(builder(Compression::None, sgdm(), 0.1, steps)).await;
        let base = final_loss(&plain, 5);
        let first = plain[0].loss;
        let plain_bytes = traced_bytes(&plain)[0][0];
        let shapes = shapes(&fixture().initial_model());
        assert_eq!(
            plain_bytes,
            Compression::None.predicted_bytes(&shapes, DP as usize)
        );
        for (c, margin) in [
            (Compression::Bf16, 1.02),
            (Compression::TopK { fraction: 0.1 }, 1.25),
            (
                Compression::PowerSgd {
                    rank: 2,
                    start_after: 0,
                },
                1.05,
            ),
        ] {
            let (_, run) = train(builder(c, sgdm(), 0.1, steps)).await;
            let loss = final_loss(&run, 5);
            eprintln!(
                "{c}: final loss {loss:.5} vs plain {base:.5} ({:.3}×; first {first:.4}), \
                 {} vs {plain_bytes} bytes per step",
                loss / base,
                traced_bytes(&run)[0][0]
            );
            assert!(loss < 0.1 * first, "{c} trained: {first} -> {loss}");
            assert!(
                loss <= margin * base,
                "{c}: final loss {loss} above {margin} × plain's {base}"
            );
            let want = c.predicted_bytes(&shapes, DP as usize);
            for (s, per_rank) in traced_bytes(&run).iter().enumerate() {
                for b in per_rank {
                    assert_eq!(*b, want, "{c}, step {s}: recorded bytes are the prediction");
                }
            }
            assert!(
                want < plain_bytes,
                "{c}: {want} bytes not below {plain_bytes}"
            );
        }
    })
    .await;
}

/// `job` resumed from the 5-step checkpoint in `dir` starts at step 5 and ends with
/// `uninterrupted`'s bits; the directory is removed.
async fn resumes_as(uninterrupted: &Mlp, job: JobBuilder<Mlp, Sample>, dir: &TempDir, what: &str) {
    let (resumed, steps) = train(job.checkpoint_dir(dir.path()).resume_from_checkpoint(true)).await;
    assert_eq!(
        steps.first().map(|s| s.step),
        Some(5),
        "{what}: resumed after step 5"
    );
    assert_eq!(
        parameter_bits(&resumed),
        parameter_bits(uninterrupted),
        "{what}: resumed differs from uninterrupted"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// Same seed, same layout: the same bits; and a job resumed from a checkpoint (its residuals
/// and PowerSGD's Q in every rank's part, CSYNC-2) equals the uninterrupted job bit for bit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reruns_and_resumes_are_bitwise_equal() {
    bounded(BOUND, async {
        for c in [
            Compression::TopK { fraction: 0.1 },
            Compression::PowerSgd {
                rank: 2,
                start_after: 2,
            },
        ] {
            let adam = || OptimizerConfig::from(AdamConfig::new());
            let (a, _) = train(builder(c, adam(), 0.01, 10)).await;
            let (b, _) = train(builder(c, adam(), 0.01, 10)).await;
            assert_eq!(
                parameter_bits(&a),
                parameter_bits(&b),
                "{c}: two runs differ"
            );

            let dir = TempDir::new(&format!("compression-{}", c.to_string().replace(':', "-")));
            train(builder(c, adam(), 0.01, 5).checkpoint_dir(dir.path())).await;
            let store = CheckpointStore::open(dir.path(), 3).expect("a store");
            let saved = store.latest_valid().expect("listed").expect("a checkpoint");
            let parts = saved.checkpoint.shards[0]
                .optimizer
                .as_ref()
                .and_then(|o| o.parts())
                .map(<[_]>::len);
            assert_eq!(
                parts,
                Some(DP as usize),
                "{c}: one part (residual) per rank"
            );
            resumes_as(&a, builder(c, adam(), 0.01, 10), &dir, &c.to_string()).await;
        }
    })
    .await;
}

/// ZSYNC-1/2: compression under ZeRO. At ZeRO-1 every scheme compresses the whole gradient
/// before the sharded update: at the exact limits it equals plain data parallelism within
/// 1e-5 · max|ref| (SGD), its collectives being the compressor's plus ZeRO's parameter
/// all-gather. At ZeRO-2 bf16 rounds with error feedback and reduce-scatters 2-byte
/// elements: the same roundings as bf16 compression without ZeRO, so within 1e-5 · max|ref|
/// of it (measured: equal). Each runs twice, bitwise equal, and a
/// ZeRO-1 top-k and a ZeRO-2 bf16 job resumed from their checkpoints (the shard and the
/// residual in every rank's part) equal the uninterrupted ones bit for bit, as plain ZeRO-1
/// and 2 do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compression_under_zero_1_and_2() {
    bounded(BOUND, async {
        let steps = 6;
        let (plain, _) = train(builder(Compression::None, sgd(), 0.1, steps)).await;
        let len: u64 = shapes(&plain)
            .iter()
            .map(|s| s.iter().product::<usize>() as u64)
            .sum();
        for exact in [
            Compression::TopK { fraction: 1.0 },
            Compression::PowerSgd {
                rank: 64,
                start_after: 0,
            },
        ] {
            let job = || builder(exact, sgd(), 0.1, steps).zero(ZeroStage::One);
            let (model, steps) = train(job()).await;
            let worst = compare_parameters(&model, &plain, TOLERANCE)
                .unwrap_or_else(|e| panic!("{exact} with ZeRO-1 vs plain data parallel: {e}"));
            eprintln!("{exact} with ZeRO-1: worst relative difference to plain dp {worst:e}");
            let want = exact.predicted_bytes(&shapes(&model), DP as usize) + 4 * len;
            assert!(
                traced_bytes(&steps).iter().flatten().all(|b| *b == want),
                "{exact} with ZeRO-1: the compressor's bytes and the parameter all-gather"
            );
            let (again, _) = train(job()).await;
            assert_eq!(
                parameter_bits(&model),
                parameter_bits(&again),
                "{exact}: reruns differ"
            );
        }

        let bf16 = |zero| builder(Compression::Bf16, sgd(), 0.1, steps).zero(zero);
        let (unsharded, _) = train(bf16(ZeroStage::Off)).await;
        let (zero2, zero2_steps) = train(bf16(ZeroStage::Two)).await;
        let worst = compare_parameters(&zero2, &unsharded, TOLERANCE)
            .unwrap_or_else(|e| panic!("bf16 with ZeRO-2 vs bf16 alone: {e}"));
        eprintln!("bf16 with ZeRO-2: worst relative difference to bf16 alone {worst:e}");
        for s in &zero2_steps {
            for r in &s.replicas {
                let scattered: u64 = r
                    .trace
                    .iter()
                    .filter_map(|t| match t.kind {
                        TraceKind::ReduceScatter { bytes } => Some(bytes),
                        TraceKind::AllReduce { bytes } if bytes > 4 => {
                            panic!("bf16 with ZeRO-2: a gradient all-reduce of {bytes} bytes")
                        }
                        _ => None,
                    })
                    .sum();
                assert_eq!(scattered, 2 * len, "bf16 with ZeRO-2: 2 bytes an element");
            }
        }
        let (again, _) = train(bf16(ZeroStage::Two)).await;
        assert_eq!(
            parameter_bits(&zero2),
            parameter_bits(&again),
            "bf16 ZeRO-2: reruns differ"
        );

        // A resume (the shard and the residual in every rank's part) goes on bit for bit,
        // with and without compression: ZeRO-1 and 2 wrote nothing after a resume until
        // FLAT-3 held.
        for (c, zero) in [
            (Compression::None, ZeroStage::One),
            (Compression::None, ZeroStage::Two),
            (Compression::TopK { fraction: 0.1 }, ZeroStage::One),
            (Compression::Bf16, ZeroStage::Two),
        ] {
            let job = |n| builder(c, sgd(), 0.1, n).zero(zero);
            let (whole, _) = train(job(10)).await;
            let dir = TempDir::new(&format!(
                "compression-{zero:?}-{}",
                c.to_string().replace(':', "-")
            ));
            train(job(5).checkpoint_dir(dir.path())).await;
            resumes_as(&whole, job(10), &dir, &format!("{c} with {zero:?}")).await;
        }
    })
    .await;
}

/// JOB-1: compression is refused where it does not run.
#[test]
fn compression_is_refused_with_other_reductions() {
    let topk = Compression::TopK { fraction: 0.1 };
    let refused = |b: JobBuilder<Mlp, Sample>, what: &str| match b.build() {
        Err(Error::InvalidConfig(m)) => assert!(m.contains("compression"), "{what}: {m}"),
        Err(Error::Refused(r)) => assert!(
            r.features()
                .iter()
                .any(|f| matches!(f, Feature::Compression | Feature::SparseCompression)),
            "{what}: {r}"
        ),
        Err(e) => panic!("{what}: wrong error {e}"),
        Ok(_) => panic!("{what}: accepted"),
    };
    refused(
        builder(topk, sgd(), 0.1, 1).zero(ZeroStage::Two),
        "top-k with ZeRO-2",
    );
    refused(
        builder(Compression::Bf16, sgd(), 0.1, 1).zero(ZeroStage::Three),
        "ZeRO-3",
    );
    for (c, zero) in [(topk, ZeroStage::One), (Compression::Bf16, ZeroStage::Two)] {
        builder(c, sgd(), 0.1, 1)
            .zero(zero)
            .build()
            .unwrap_or_else(|e| panic!("{c} with {zero:?}: {e}"));
    }
    refused(
        builder(topk, sgd(), 0.1, 1)
            .precision(Precision::Bf16)
            .low_precision_gradients(true),
        "low precision gradients",
    );
    refused(
        builder(Compression::TopK { fraction: 0.0 }, sgd(), 0.1, 1),
        "fraction 0",
    );
}

/// EMU-1 with compression: the bytes each rank's transport counted in a step
/// (`ReplicaStep::bytes_sent`, ring plans in-process) equal what the compressor's collectives
/// send under those plans (`Compressor::ops` through `comm::plan`), plus the step's loss
/// all-reduce (DP-3) — and are below plain data parallelism's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transport_counts_the_bytes_the_compressor_predicts() {
    use meshwork::comm::plan::plan;
    use meshwork::comm::{Algorithm, CollectiveKind, DType, PartialSums};
    use meshwork::mesh::Rank;
    use meshwork::parallel::compress::{Compressor, WireKind};
    bounded(BOUND, async {
        let world = DP as usize;
        let shapes = shapes(&fixture().initial_model());
        let sent = |kind, len: usize, rank: usize, dtype| {
            plan(kind, Algorithm::Ring, world, len, Rank(0))
                .expect("a ring plan")
                .bytes_sent(dtype, PartialSums::F32)[rank]
        };
        let wire_bytes = |c: Compression, rank: usize| -> u64 {
            let ops = Compressor::new(c, &shapes).ops(world);
            let grads: usize = ops
                .iter()
                .map(|op| {
                    let (kind, len) = match op.kind {
                        WireKind::AllReduce => (CollectiveKind::AllReduce, op.elements),
                        WireKind::AllGather => (CollectiveKind::AllGather, op.elements * world),
                    };
                    let dtype = if op.element_bytes == 2 {
                        DType::BF16
                    } else {
                        DType::F32
                    };
                    sent(kind, len, rank, dtype)
                })
                .sum();
            (grads + sent(CollectiveKind::AllReduce, world, rank, DType::F32)) as u64
        };
        let counted = |steps: &[StepDone]| -> Vec<Vec<u64>> {
            steps
                .iter()
                .map(|s| s.replicas.iter().map(|r| r.bytes_sent).collect())
                .collect()
        };
        let ring = |c| builder(c, sgd(), 0.05, 3).algorithm(Algorithm::Ring);
        let (_, plain) = train(ring(Compression::None)).await;
        let plain_bytes = counted(&plain)[0][0];
        for c in [
            Compression::Bf16,
            Compression::TopK { fraction: 0.1 },
            Compression::PowerSgd {
                rank: 2,
                start_after: 0,
            },
        ] {
            let (_, run) = train(ring(c)).await;
            for (s, per_rank) in counted(&run).iter().enumerate() {
                for (r, b) in per_rank.iter().enumerate() {
                    assert_eq!(*b, wire_bytes(c, r), "{c}: step {s}, rank {r}");
                    assert!(*b < plain_bytes, "{c}: {b} not below plain's {plain_bytes}");
                }
            }
        }
    })
    .await;
}
