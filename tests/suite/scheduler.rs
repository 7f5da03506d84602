//! LR-1..2, CKPT-9: a learning-rate schedule (linear warm-up, then cosine) survives a
//! checkpoint, a roll-back and an elastic growth. Each run with an interruption ends with
//! the parameters of the same job run without one (bitwise), and every step used the rate of
//! the uninterrupted schedule; the runs are also checked against a plain single-device Burn
//! loop with the same schedule (every tensor within 1e-5 · max|reference|), and each test
//! checks the work was spread over the replicas or stages it asked for.

use std::path::Path;
use std::time::Duration;

use burn::lr_scheduler::LrSchedulerConfig;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::lr_scheduler::sequential::SequentialLrSchedulerConfig;
use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, Sample, mlp_pipeline_of, mse_loss, split_mlp};
use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
use meshwork::optim::LearningRate;
use meshwork::parallel::pipeline::Schedule;
use meshwork::prelude::*;
use meshwork::recovery::RecoveryPolicy;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    draw_lock, final_fingerprints, parameter_bits, reference_train, run_recording, steps_of,
};

const STEPS: u64 = 8;
const WARM_UP: usize = 3;
const GLOBAL_BATCH: usize = 16;
const TOLERANCE: f32 = 1e-5;
const WIDTHS: [usize; 4] = [8, 16, 16, 3];
const BOUND: Duration = Duration::from_secs(120);

/// Linear warm-up from 1e-4 to 1e-2 over `WARM_UP` steps, then cosine down to 1e-4.
fn schedule() -> ModuleLrScheduler {
    SequentialLrSchedulerConfig::new(
        vec![
            LrSchedulerConfig::Linear(LinearLrSchedulerConfig::new(1e-4, 1e-2, WARM_UP)),
            LrSchedulerConfig::Cosine(
                CosineAnnealingLrSchedulerConfig::new(1e-2, STEPS as usize).with_min_lr(1e-4),
            ),
        ],
        vec![WARM_UP],
    )
    .init()
    .expect("a valid schedule")
}

/// The rates of the uninterrupted schedule, step by step.
fn scheduled_rates() -> Vec<f64> {
    let mut lr = LearningRate::Scheduler(schedule());
    (0..STEPS).map(|_| lr.next_rate().base()).collect()
}

/// 128 samples of the 8 → 3 teacher (seed 41, noise 0.1) and the MLP of `WIDTHS` drawn from
/// seed 23.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(41, 23)
        .with_widths(&WIDTHS)
        .with_samples(128)
}

fn builder(dp: u32, steps: u64, init: &Mlp) -> JobBuilder<Mlp, Sample> {
    fixture()
        .builder(init, dp, GLOBAL_BATCH, steps)
        .optimizer(AdamConfig::new())
        .learning_rate(schedule())
        .seed(6)
}

async fn run<M: Send + 'static>(job: Job<M, Sample>) -> (Result<Trained<M>>, Vec<JobEvent>) {
    bounded(BOUND, run_recording(job)).await
}

/// Each counted step's (step, learning rate, ranks that reported it).
fn rates(events: &[JobEvent]) -> Vec<(u64, Option<f64>, usize)> {
    steps_of(events)
        .iter()
        .map(|s| (s.step, s.learning_rate, s.replicas.len()))
        .collect()
}

/// Steps `from..to` of the uninterrupted schedule, on `ranks` ranks each.
fn expected_rates(from: u64, to: u64, ranks: usize) -> Vec<(u64, Option<f64>, usize)> {
    let all = scheduled_rates();
    (from..to)
        .map(|s| (s, Some(all[s as usize]), ranks))
        .collect()
}

/// The trained model equals a plain Burn loop with the same schedule on the reported batches.
fn assert_matches_reference(init: Mlp, trained: &Mlp, events: &[JobEvent]) {
    let steps = steps_of(events);
    assert_eq!(steps.len() as u64, STEPS, "every step counted once");
    let reference = reference_train(
        init,
        mse_loss,
        &fixture().data(),
        &batches_from_events(&steps),
        &Reference {
            optimizer: AdamConfig::new().into(),
            learning_rate: LearningRate::Scheduler(schedule()),
            clip_norm: None,
        },
        &Device::flex(),
    );
    compare_parameters(trained, &reference, TOLERANCE).unwrap_or_else(|e| panic!("{e}"));
}

/// The schedule is not flat, so a restarted one would show: the warm-up climbs, the cosine
/// falls.
#[test]
fn lr_the_test_schedule_warms_up_then_decays() {
    let r = scheduled_rates();
    assert!(r[0] < r[1] && r[1] < r[WARM_UP], "{r:?}");
    assert!(
        r[WARM_UP] > r[WARM_UP + 2] && r[WARM_UP + 2] > r[STEPS as usize - 1],
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lr_2_a_resumed_warm_up_cosine_run_equals_the_uninterrupted_one() {
    let init = fixture().initial_model();
    let (whole, whole_events) = run(builder(2, STEPS, &init).build().unwrap()).await;
    let whole = whole.expect("the uninterrupted run").model;
    assert_eq!(rates(&whole_events), expected_rates(0, STEPS, 2));

    // Stop after 5 steps (past the warm-up), then resume to 8 in a new job.
    let dir = TempDir::new("sched-resume");
    let (first, first_events) = run(builder(2, 5, &init)
        .checkpoint_dir(dir.path())
        .build()
        .unwrap())
    .await;
    first.expect("the first part");
    let (resumed, events) = run(builder(2, STEPS, &init)
        .checkpoint_dir(dir.path())
        .resume_from_checkpoint(true)
        .require_checkpoint(true)
        .build()
        .unwrap())
    .await;
    let resumed = resumed.expect("the resumed part").model;
    assert!(
        events
            .iter()
            .any(|e| matches!(e, JobEvent::Restored { step: 5, .. }))
    );
    assert_eq!(rates(&events), expected_rates(5, STEPS, 2));
    assert_eq!(parameter_bits(&resumed), parameter_bits(&whole));
    let mut all = first_events;
    all.extend(events);
    assert_matches_reference(init, &resumed, &all);
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lr_2_a_resumed_pipeline_continues_its_schedule() {
    let parts = {
        let fixture = fixture();
        let _draw = draw_lock();
        let device = Device::flex();
        device.seed(fixture.model_seed);
        split_mlp(&fixture.widths, &[2, 1], &device).expect("the split fits")
    };
    let job = |steps: u64, dir: &Path, resume: bool| {
        Job::builder()
            .pipeline(
                mlp_pipeline_of(parts.clone()),
                Schedule::OneFOneB { micro_batches: 2 },
            )
            .data(fixture().data())
            .optimizer(AdamConfig::new())
            .learning_rate(schedule())
            .batch_size(GLOBAL_BATCH)
            .steps(steps)
            .seed(6)
            .checkpoint_dir(dir)
            .resume_from_checkpoint(resume)
            .build()
            .expect("a valid pipeline job")
    };
    let whole_dir = TempDir::new("sched-pp-whole");
    let (whole, whole_events) = run(job(STEPS, whole_dir.path(), false)).await;
    let whole = Mlp::from_pipeline(whole.expect("the uninterrupted run").model).expect("blocks");
    assert_eq!(
        rates(&whole_events),
        expected_rates(0, STEPS, 2),
        "two stages"
    );

    let dir = TempDir::new("sched-pp-resume");
    run(job(5, dir.path(), false))
        .await
        .0
        .expect("the first part");
    let (resumed, events) = run(job(STEPS, dir.path(), true)).await;
    let resumed = Mlp::from_pipeline(resumed.expect("the resumed part").model).expect("blocks");
    assert_eq!(rates(&events), expected_rates(5, STEPS, 2));
    assert_eq!(parameter_bits(&resumed), parameter_bits(&whole));
    let _ = std::fs::remove_dir_all(dir.path());
    let _ = std::fs::remove_dir_all(whole_dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lr_2_a_roll_back_restores_the_schedule_and_equals_the_uninterrupted_run() {
    let init = fixture().initial_model();
    let (whole, _) = run(builder(2, STEPS, &init).build().unwrap()).await;
    let whole = whole.expect("the uninterrupted run").model;

    // Device 1 panics in step 5; the job rolls back to its checkpoint of step 4.
    let dir = TempDir::new("sched-rollback");
    let plan = FaultPlan::new(3).with(Fault {
        device: 1,
        step: 5,
        micro_batch: Some(0),
        phase: Phase::Backward,
        kind: FaultKind::Panic,
    });
    let job = builder(2, STEPS, &init)
        .fault_plan(plan)
        .recovery(RecoveryPolicy::roll_back())
        .checkpoint_dir(dir.path())
        .checkpoint_every(2)
        .build()
        .expect("a roll-back job with a scheduler is valid");
    let (outcome, events) = run(job).await;
    let trained = outcome.expect("the job rolls back and finishes").model;
    assert!(
        events
            .iter()
            .any(|e| matches!(e, JobEvent::RolledBack { step: 4, .. })),
        "rolled back to step 4"
    );
    assert_eq!(rates(&events), expected_rates(0, STEPS, 2));
    assert_eq!(parameter_bits(&trained), parameter_bits(&whole));
    assert_matches_reference(init, &trained, &events);
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lr_2_replicas_that_join_continue_the_schedule() {
    let init = fixture().initial_model();
    let handle = builder(2, STEPS, &init)
        .build()
        .unwrap()
        .spawn()
        .await
        .expect("spawned");
    let control = handle.control();
    let mut stream = handle.events();
    let recorder = tokio::spawn(async move {
        let mut events = Vec::new();
        loop {
            match stream.recv().await {
                Ok(e) => {
                    if let JobEvent::StepDone(s) = &e
                        && s.step == 2
                    {
                        control.scale_to(3);
                    }
                    events.push(e);
                }
                Err(meshwork::job::EventsError::Missed(_)) => continue,
                Err(meshwork::job::EventsError::Closed) => break,
            }
        }
        events
    });
    let outcome = tokio::time::timeout(Duration::from_secs(120), handle.join())
        .await
        .expect("the job ends within 120 s");
    let events = recorder.await.expect("the recorder ends");
    let trained = outcome.expect("the job grows and finishes").model;
    let grown_at = events
        .iter()
        .find_map(|e| match e {
            JobEvent::Resized {
                step,
                from: 2,
                to: 3,
                ..
            } => Some(*step),
            _ => None,
        })
        .expect("the job grew from 2 to 3");
    assert!((3..STEPS).contains(&grown_at), "grew at step {grown_at}");
    let mut expected = expected_rates(0, grown_at, 2);
    expected.extend(expected_rates(grown_at, STEPS, 3));
    assert_eq!(rates(&events), expected);
    // A joiner that restarted the schedule would step with another rate and end different.
    let fingerprints = final_fingerprints(&events).expect("finished");
    assert_eq!(fingerprints.len(), 3);
    assert!(fingerprints.windows(2).all(|w| w[0] == w[1]));
    assert_matches_reference(init, &trained, &events);
}
