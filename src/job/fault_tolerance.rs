//! `FaultTolerance` on a builder: it sets what its shorthands set.
use burn::tensor::Device;

use crate::demo::{Mlp, Sample, TeacherTask, mse_loss};
use crate::error::Error;
use crate::job::FaultTolerance;
use crate::job::{Job, JobBuilder};
use crate::recovery::RecoveryPolicy;

fn builder() -> JobBuilder<Mlp, Sample> {
    let task = TeacherTask {
        d_in: 4,
        d_out: 2,
        noise: 0.1,
        seed: 1,
    };
    Job::builder()
        .initial_model(Mlp::new(&[4, 8, 2], &Device::flex()))
        .loss(mse_loss)
        .data(task.dataset(32))
        .batch_size(8)
        .steps(1)
}

fn refusal(b: JobBuilder<Mlp, Sample>) -> String {
    match b.build() {
        Err(Error::InvalidConfig(m)) => m,
        Err(Error::Refused(r)) => r.to_string(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn fault_tolerance_sets_what_its_shorthands_set() {
    let grouped = refusal(builder().fault_tolerance(FaultTolerance::new().elastic(3, 2)));
    let shorthand = refusal(builder().elastic(3, 2));
    assert_eq!(grouped, shorthand);
    assert!(grouped.contains("elastic(3, 2)"), "{grouped}");

    let policy = RecoveryPolicy::roll_back();
    let grouped = refusal(builder().fault_tolerance(FaultTolerance::new().recovery(policy)));
    assert_eq!(grouped, refusal(builder().recovery(policy)));
    assert!(grouped.contains("checkpoint"), "{grouped}");
}

#[test]
fn fault_tolerance_replaces_every_earlier_failure_setting() {
    // The value replaces the shorthands set before it: the defaults build.
    let b = builder()
        .elastic(3, 2)
        .recovery(RecoveryPolicy::roll_back())
        .fault_tolerance(FaultTolerance::default());
    assert!(b.build().is_ok());
}
