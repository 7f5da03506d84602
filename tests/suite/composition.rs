//! COMP-1 through `build()`: every row of the one table of refused combinations, set up as a
//! user would with the builder's methods, fails with `Error::Refused` naming exactly that
//! row's features; the same job without one of them passes the table.

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::composition::{Feature, REFUSALS};
use meshwork::demo::{Sample, mlp_blocks, mlp_pipeline, mse_loss};
use meshwork::faults::FaultPlan;
use meshwork::optim::LearningRate;
use meshwork::prelude::*;
use meshwork::testing::{TeacherFixture, draw_lock};

fn fixture() -> TeacherFixture {
    TeacherFixture::new(5, 3).with_widths(&[8, 16, 3])
}

/// A small job with every setting it needs, and `features` turned on through the builder.
fn with<M: Send + 'static>(
    mut b: JobBuilder<M, Sample>,
    features: &[Feature],
) -> JobBuilder<M, Sample> {
    b = b
        .data(fixture().data())
        .optimizer(SgdConfig::new())
        .learning_rate(0.1)
        .data_parallel(2)
        .batch_size(8)
        .steps(4);
    for f in features {
        b = match f {
            Feature::Blocks | Feature::Pipeline | Feature::AcrossProcesses => b,
            Feature::TensorParallel => b.tensor_parallel(2),
            Feature::Zero => b.zero(ZeroStage::One),
            Feature::ZeroGradients => b.zero(ZeroStage::Two),
            Feature::ZeroParameters => b.zero(ZeroStage::Three),
            Feature::Bf16 => b.precision(Precision::Bf16),
            Feature::F16 => b.precision(Precision::F16),
            Feature::LowPrecisionGradients => b
                .precision(if features.contains(&Feature::F16) {
                    Precision::F16
                } else {
                    Precision::Bf16
                })
                .low_precision_gradients(true),
            Feature::ClipGradNorm => b.clip_grad_norm(1.0),
            Feature::GradientAccumulation => b.gradient_accumulation(2),
            Feature::SkipNonFinite => b.on_non_finite_loss(NonFinitePolicy::Skip),
            Feature::Compression => b.compression(Compression::Bf16),
            Feature::SparseCompression => b.compression(Compression::TopK { fraction: 0.1 }),
            Feature::LocalUpdates => b.local_updates(LocalUpdates::local_sgd(2)),
            Feature::ParameterServer => {
                b.parameter_server(ParameterServer::new(Staleness::Bounded(0)))
            }
            Feature::StaleUpdates => {
                b.parameter_server(ParameterServer::new(Staleness::Bounded(2)))
            }
            Feature::BackupWorkers => b.backup_workers(1),
            Feature::LrSchedule => {
                b.learning_rate(LearningRate::warmup_cosine(0.1, 1, 4).expect("a valid schedule"))
            }
            Feature::Checkpoints => b
                .checkpoint_dir(std::env::temp_dir().join("meshwork-composition-unused"))
                .checkpoint_every(2),
            Feature::FaultPlan => b.fault_plan(FaultPlan::new(1)),
            Feature::RollBack => b.recovery(RecoveryPolicy::roll_back()),
            other => panic!("the test does not set {other:?} yet"),
        };
    }
    b
}

/// Builds a job with `features` on the model shape they need, and returns its error.
fn build(features: &[Feature]) -> Option<Error> {
    let device = Device::flex();
    // Unseeded draws all the same: not in the middle of another test's (the fixture takes
    // the lock itself, so it is held only around the model's own draw).
    if features.contains(&Feature::Pipeline) {
        let parts = {
            let _draw = draw_lock();
            mlp_pipeline(&[8, 16, 3], &[1, 1], &device).expect("a split")
        };
        with(
            Job::builder().pipeline(parts, Schedule::GPipe { micro_batches: 2 }),
            features,
        )
        .build()
        .err()
    } else if features.contains(&Feature::Blocks) || features.contains(&Feature::TensorParallel) {
        let parts = {
            let _draw = draw_lock();
            mlp_blocks(&[8, 16, 3], BlockOptions::default(), &device).expect("blocks")
        };
        with(Job::builder().blocks(parts), features).build().err()
    } else {
        with(
            Job::builder()
                .initial_model(fixture().initial_model())
                .loss(mse_loss),
            features,
        )
        .build()
        .err()
    }
}

#[test]
fn comp_1_every_row_of_the_table_is_refused_by_build_naming_its_features() {
    let mut walked = 0;
    for row in REFUSALS {
        // A job across processes needs a head's assembled world: the table's own proptest
        // (composition::tests) covers those rows; a job on the MPI transport is one across
        // processes (the spec's transport), its row also refused in the cluster tests
        // (`cluster_mpi::roll_back_on_the_mpi_transport_is_refused_up_front`).
        if row.features.contains(&Feature::AcrossProcesses)
            || row.features.contains(&Feature::MpiTransport)
        {
            continue;
        }
        match build(row.features) {
            Some(Error::Refused(r)) => {
                assert_eq!(r.features(), row.features, "{r}");
                let message = r.to_string();
                assert!(message.contains(row.reason), "{message}");
                assert!(message.contains(row.instead), "{message}");
            }
            other => panic!("{:?}: expected Error::Refused, got {other:?}", row.features),
        }
        walked += 1;
        // Each feature alone (with what the row needs absent) passes the table (it may still
        // fail a check of its own values).
        for f in row.features {
            let alone: Vec<Feature> = std::iter::once(*f)
                .chain(row.without.iter().copied())
                .collect();
            if let Some(Error::Refused(r)) = build(&alone) {
                panic!("{alone:?} is refused: {r}");
            }
        }
    }
    let in_process = REFUSALS
        .iter()
        .filter(|r| {
            !r.features.contains(&Feature::AcrossProcesses)
                && !r.features.contains(&Feature::MpiTransport)
        })
        .count();
    assert_eq!(walked, in_process);
    assert!(walked >= 20, "{walked} rows walked");
}

/// A job that sets two exclusive reductions gets one clear error naming both.
#[test]
fn two_exclusive_reductions_are_one_refusal() {
    match build(&[Feature::Compression, Feature::LocalUpdates]) {
        Some(Error::Refused(r)) => {
            let m = r.to_string();
            assert!(
                m.starts_with(".compression(bf16) with .local_updates(local-sgd:2) together:"),
                "{m}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}
