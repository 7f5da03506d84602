//! Fault-injection scenarios: each states its one expected outcome, asserts it, and asserts that
//! the injected faults fired (a `FaultInjected` event per fault).
//!
//! Completed runs are compared with a plain single-device Burn loop that consumed exactly the
//! samples the step events report (`max|a − b| ≤ 1e-5 · max|reference|` per tensor); runs that
//! must fail end with the documented typed error within their time-out.

use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, Sample, mse_loss};
use meshwork::error::DeviceId;
use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
use meshwork::optim::LearningRate;
use meshwork::prelude::*;
use meshwork::recovery::RecoveryPolicy;
use meshwork::testing::{
    Reference, TeacherFixture, TempDir, batches_from_events, bounded, compare_parameters,
    draw_lock, reference_train, run_recording, steps_of,
};

const TOLERANCE: f32 = 1e-5;
const STEPS: u64 = 8;
const GLOBAL_BATCH: usize = 24;
const LR: f64 = 3e-3;
const BOUND: Duration = Duration::from_secs(120);

/// 240 samples of the 8 → 3 teacher (seed 21, noise 0.1) and the 8-32-16-3 MLP of seed 9.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(21, 9).with_samples(240)
}

/// The demo MLP with Adam on `dp` replicas, the suite's batch, steps and seed.
fn base(dp: u32, init: &Mlp) -> meshwork::job::JobBuilder<Mlp, Sample> {
    fixture()
        .builder(init, dp, GLOBAL_BATCH, STEPS)
        .optimizer(AdamConfig::new())
        .learning_rate(LR)
        .seed(5)
}

fn fault(device: u32, step: u64, phase: Phase, kind: FaultKind) -> Fault {
    Fault {
        device,
        step,
        micro_batch: Some(0),
        phase,
        kind,
    }
}

/// A dp-replica job of the demo MLP (Adam) under `plan` and `policy`.
fn job(
    dp: u32,
    init: &Mlp,
    plan: FaultPlan,
    policy: RecoveryPolicy,
    collective_timeout: Duration,
) -> Job<Mlp, Sample> {
    base(dp, init)
        .fault_plan(plan)
        .recovery(policy)
        .collective_timeout(collective_timeout)
        .step_timeout(Duration::from_secs(60))
        .build()
        .expect("a valid job")
}

async fn run(job: Job<Mlp, Sample>) -> (Result<Trained<Mlp>>, Vec<JobEvent>, Duration) {
    let started = Instant::now();
    let (outcome, events) = bounded(BOUND, run_recording(job)).await;
    (outcome, events, started.elapsed())
}

fn fired(events: &[JobEvent]) -> Vec<usize> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::FaultInjected(f) => Some(f.index),
            _ => None,
        })
        .collect()
}

fn lost_devices(events: &[JobEvent]) -> Vec<DeviceId> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::DeviceLost { device, .. } => Some(*device),
            _ => None,
        })
        .collect()
}

/// The trained model equals a reference that consumed exactly the reported samples.
fn assert_matches_reference(init: Mlp, trained: &Mlp, events: &[JobEvent]) {
    let steps = steps_of(events);
    assert_eq!(steps.len() as u64, STEPS, "every step completed once");
    let batches = batches_from_events(&steps);
    for (s, b) in batches.iter().enumerate() {
        assert_eq!(
            b.len(),
            GLOBAL_BATCH,
            "step {s} trained on the whole global batch"
        );
    }
    let reference = reference_train(
        init,
        mse_loss,
        &fixture().data(),
        &batches,
        &Reference {
            optimizer: AdamConfig::new().into(),
            learning_rate: LearningRate::Constant(LR),
            clip_norm: None,
        },
        &Device::flex(),
    );
    compare_parameters(trained, &reference, TOLERANCE).unwrap_or_else(|e| panic!("{e}"));
}

/// Replicas per step, from the step events.
fn replicas_per_step(events: &[JobEvent]) -> Vec<usize> {
    steps_of(events).iter().map(|s| s.replicas.len()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_a_panic_in_forward_shrinks_the_group_and_training_equals_the_reference() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(1).with(fault(1, 3, Phase::Forward, FaultKind::Panic));
    let (outcome, events, _) = run(job(
        4,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the job recovers");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(lost_devices(&events), vec![DeviceId(1)]);
    assert!(events.iter().any(|e| matches!(
        e,
        JobEvent::Recovered { step: 3, generation, layout, .. }
            if generation.0 == 1 && layout.dp() == 3
    )));
    assert_eq!(replicas_per_step(&events), vec![4, 4, 4, 3, 3, 3, 3, 3]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_a_panic_in_backward_shrinks_the_group_and_training_equals_the_reference() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(2).with(fault(0, 5, Phase::Backward, FaultKind::Panic));
    let (outcome, events, _) = run(job(
        3,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the job recovers");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(lost_devices(&events), vec![DeviceId(0)]);
    // 24 samples over 2 survivors; the surviving rank 0 (device 1) hands the model back.
    assert_eq!(replicas_per_step(&events), vec![3, 3, 3, 3, 3, 2, 2, 2]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_a_killed_device_is_dropped_and_its_share_is_redone_by_the_survivors() {
    let init = fixture().initial_model();
    // 24 samples over 4, then over 3 (8 each): the killed device's samples are not lost.
    let plan = FaultPlan::new(3).with(fault(2, 2, Phase::Forward, FaultKind::Kill));
    let (outcome, events, _) = run(job(
        4,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the job recovers");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(lost_devices(&events), vec![DeviceId(2)]);
    let lost_as = events.iter().find_map(|e| match e {
        JobEvent::DeviceLost { error, .. } => Some(error.clone()),
        _ => None,
    });
    assert!(
        matches!(
            lost_as,
            Some(Error::StageLost {
                device: DeviceId(2),
                ..
            })
        ),
        "{lost_as:?}"
    );
    assert_eq!(replicas_per_step(&events), vec![4, 4, 3, 3, 3, 3, 3, 3]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_two_failures_shrink_twice_with_uneven_shares() {
    let init = fixture().initial_model();
    // 4 → 3 → 2 replicas; 24 samples split 8/8/8 then 12/12. With 5 replicas the shares
    // would be uneven (5/5/5/5/4): see the next scenario.
    let plan = FaultPlan::new(4)
        .with(fault(3, 1, Phase::Forward, FaultKind::Kill))
        .with(fault(0, 4, Phase::Backward, FaultKind::Panic));
    let (outcome, events, _) = run(job(
        4,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the job recovers twice");
    assert_eq!(fired(&events), vec![0, 1]);
    assert_eq!(lost_devices(&events), vec![DeviceId(3), DeviceId(0)]);
    assert_eq!(replicas_per_step(&events), vec![4, 3, 3, 3, 2, 2, 2, 2]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampler_4_survivors_that_do_not_divide_the_batch_take_uneven_weighted_shares() {
    let init = fixture().initial_model();
    // 24 samples over 5 survivors: 5, 5, 5, 5, 4.
    let plan = FaultPlan::new(5).with(fault(5, 2, Phase::Forward, FaultKind::Panic));
    let (outcome, events, _) = run(job(
        6,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the job recovers");
    let after = &steps_of(&events)[2];
    let sizes: Vec<usize> = after.replicas.iter().map(|r| r.sample_ids.len()).collect();
    assert_eq!(sizes, vec![5, 5, 5, 5, 4]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_2_more_failures_than_the_restart_limit_end_the_job_with_too_many_failures() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(6)
        .with(fault(1, 1, Phase::Forward, FaultKind::Panic))
        .with(fault(2, 2, Phase::Forward, FaultKind::Panic));
    let policy = RecoveryPolicy::shrink().max_restarts(1, Duration::from_secs(600));
    let (outcome, events, _) = run(job(4, &init, plan, policy, Duration::from_secs(30))).await;
    match outcome {
        Err(Error::TooManyFailures { count: 2, last, .. }) => {
            assert!(
                matches!(
                    *last,
                    Error::StageFailed {
                        device: DeviceId(2),
                        ..
                    }
                ),
                "{last}"
            )
        }
        other => panic!("expected TooManyFailures, got {other:?}"),
    }
    assert_eq!(fired(&events), vec![0, 1]);
    assert!(matches!(events.last(), Some(JobEvent::Failed(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_3_below_the_minimum_size_the_job_ends_with_the_devices_error() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(7).with(fault(0, 1, Phase::Forward, FaultKind::Panic));
    let (outcome, events, _) = run(job(
        2,
        &init,
        plan,
        RecoveryPolicy::shrink().min_replicas(2),
        Duration::from_secs(30),
    ))
    .await;
    match outcome {
        Err(Error::StageFailed { device, during, .. }) => {
            assert_eq!(device, DeviceId(0));
            assert_eq!(during, "forward");
        }
        other => panic!("expected StageFailed, got {other:?}"),
    }
    assert_eq!(fired(&events), vec![0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_3_without_a_recovery_policy_a_lost_device_ends_the_job() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(8).with(fault(1, 2, Phase::Forward, FaultKind::Kill));
    let (outcome, events, elapsed) = run(job(
        2,
        &init,
        plan,
        RecoveryPolicy::default(),
        Duration::from_secs(30),
    ))
    .await;
    assert!(
        matches!(
            outcome,
            Err(Error::StageLost {
                device: DeviceId(1),
                ..
            })
        ),
        "{outcome:?}"
    );
    assert_eq!(fired(&events), vec![0]);
    // Found at once, not after the 30 s collective time-out.
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_device_slows_its_replica_and_training_still_equals_the_reference() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(9).with(Fault {
        device: 1,
        step: 0,
        micro_batch: None,
        phase: Phase::Forward,
        kind: FaultKind::Slow { factor: 20.0 },
    });
    // The demo's steps take milliseconds: no floor on the excess (STRAG-1).
    let detection = meshwork::stragglers::StragglerDetection {
        min_excess_s: 0.0,
        ..Default::default()
    };
    let job = base(2, &init)
        .fault_plan(plan)
        .straggler_detection(Some(detection))
        .collective_timeout(Duration::from_secs(30))
        .step_timeout(Duration::from_secs(60))
        .build()
        .expect("a valid job");
    let (outcome, events, _) = run(job).await;
    let trained = outcome.expect("a slow device is not a failure");
    assert_eq!(fired(&events), vec![0]);
    // Device 1's forwards take longer than device 0's, step after step.
    let compute = |rank: u32| -> u64 {
        steps_of(&events)
            .iter()
            .flat_map(|s| s.replicas.iter())
            .filter(|r| r.rank.0 == rank)
            .flat_map(|r| r.trace.iter())
            .filter(|t| matches!(t.kind, meshwork::trace::TraceKind::Forward { .. }))
            .map(|t| t.duration_us)
            .sum()
    };
    assert!(
        compute(1) > 3 * compute(0),
        "{} vs {}",
        compute(1),
        compute(0)
    );
    // STRAG-1: the slow rank is named once its window is full, with its measured slowdown
    // (against the other rank, a 20× slower one is far above 1.5×); the fast one
    // is not.
    let named: Vec<(Rank, f64, u64)> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Straggler {
                rank,
                slowdown,
                step,
                ..
            } => Some((*rank, *slowdown, *step)),
            _ => None,
        })
        .collect();
    assert_eq!(named.len(), 1, "{named:?}");
    assert_eq!(named[0].0, Rank(1));
    assert!(named[0].1 >= 1.5 && named[0].2 >= 4, "{named:?}");
    assert_matches_reference(init, &trained.model, &events);
}

/// The collective time-out of the stall and partition scenarios: far above any step's
/// compute on a loaded machine (a shorter one may fire on a mere hiccup and change the
/// outcome), far below the stall or partition.
const SHORT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the stalled or cut-off device is gone: the job must end, or go on without it,
/// long before (the time-out plus the 2 s failure grace plus a few steps).
const GONE_S: f64 = 30.0;
/// A bound on such a job that a wait for the stall or partition to end cannot meet.
const WELL_BEFORE_THE_DEVICE_RETURNS: Duration = Duration::from_secs(20);

fn stall_plan() -> FaultPlan {
    // Device 1 stops making progress for GONE_S; collectives give up long before.
    FaultPlan::new(10).with(fault(
        1,
        2,
        Phase::Backward,
        FaultKind::Stall { seconds: GONE_S },
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_device_is_named_stuck_but_alive_within_the_time_out_not_a_hang() {
    use meshwork::error::Health;
    let init = fixture().initial_model();
    let (outcome, events, elapsed) = run(job(
        2,
        &init,
        stall_plan(),
        RecoveryPolicy::default(),
        SHORT_COLLECTIVE_TIMEOUT,
    ))
    .await;
    match outcome {
        Err(Error::RanksUnresponsive {
            ranks, generation, ..
        }) => {
            assert_eq!(generation.0, 0);
            assert_eq!(ranks.len(), 1);
            assert_eq!((ranks[0].rank, ranks[0].device), (Rank(1), DeviceId(1)));
            match &ranks[0].health {
                Health::Stuck { progress, .. } => {
                    assert_eq!(progress, "step 2: backward of micro-batch 0")
                }
                other => panic!("expected stuck, got {other:?}"),
            }
        }
        other => panic!("expected RanksUnresponsive naming rank 1, got {other:?}"),
    }
    assert_eq!(fired(&events), vec![0]);
    assert!(elapsed < WELL_BEFORE_THE_DEVICE_RETURNS, "{elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_a_stuck_replica_is_evicted_and_the_survivor_finishes_the_run() {
    let init = fixture().initial_model();
    let (outcome, events, elapsed) = run(job(
        2,
        &init,
        stall_plan(),
        RecoveryPolicy::shrink(),
        SHORT_COLLECTIVE_TIMEOUT,
    ))
    .await;
    let trained = outcome.expect("the stuck replica is evicted");
    assert_eq!(lost_devices(&events), vec![DeviceId(1)]);
    assert!(
        elapsed < WELL_BEFORE_THE_DEVICE_RETURNS,
        "did not wait for the stall: {elapsed:?}"
    );
    assert_eq!(replicas_per_step(&events), vec![2, 2, 1, 1, 1, 1, 1, 1]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_2_the_same_plan_gives_the_same_events_and_bitwise_equal_parameters() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(11)
        .with(fault(2, 1, Phase::Forward, FaultKind::Kill))
        .with(fault(0, 3, Phase::Backward, FaultKind::Panic))
        .with(fault(
            1,
            5,
            Phase::Forward,
            FaultKind::CorruptMessage { message: 0 },
        ));
    let summary = |events: &[JobEvent]| -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                JobEvent::StepDone(s) => format!("step {} {:?}", s.step, s.loss),
                JobEvent::DeviceLost { step, device, .. } => format!("lost {device} at {step}"),
                JobEvent::Recovered {
                    step, generation, ..
                } => format!("recovered {} at {step}", generation.0),
                JobEvent::FaultInjected(f) => format!("fault {}", f.index),
                JobEvent::Finished { fingerprints, .. } => format!("finished {fingerprints:?}"),
                other => format!("{other:?}").chars().take(12).collect(),
            })
            .collect()
    };
    let (a, ea, _) = run(job(
        4,
        &init,
        plan.clone(),
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let (b, eb, _) = run(job(
        4,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    assert_eq!(summary(&ea), summary(&eb));
    compare_parameters(&a.unwrap().model, &b.unwrap().model, 0.0).expect("bitwise equal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_3_a_pipeline_stage_lost_without_twin_restore_ends_the_job_with_its_error() {
    use meshwork::demo::mlp_pipeline;
    let stages = {
        let _draw = draw_lock();
        let device = Device::flex();
        device.seed(3);
        mlp_pipeline(&[8, 16, 16, 3], &[1, 2], &device).unwrap()
    };
    let job = Job::builder()
        .pipeline(stages, Schedule::OneFOneB { micro_batches: 4 })
        .data(fixture().data())
        .batch_size(GLOBAL_BATCH)
        .steps(STEPS)
        .fault_plan(FaultPlan::new(12).with(fault(1, 2, Phase::Backward, FaultKind::Panic)))
        .recovery(RecoveryPolicy::shrink())
        .build()
        .unwrap();
    let (outcome, events) = tokio::time::timeout(Duration::from_secs(120), run_recording(job))
        .await
        .expect("the job ends");
    assert!(
        matches!(&outcome, Err(Error::StageFailed { stage, .. }) if stage.stage == 1),
        "{outcome:?}"
    );
    assert_eq!(fired(&events), vec![0]);
    // The policy asked for a recovery: the job says why it could not make one.
    let why: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::NotRecovered { step, lost, reason } => Some((*step, lost.clone(), reason)),
            _ => None,
        })
        .collect();
    assert!(
        matches!(&why[..], [(2, lost, reason)] if lost.len() == 1 && reason.contains("no surviving twin")),
        "{why:?}"
    );
}

/// Run `job`, calling `on_step` with the job's controls after each step event.
async fn run_controlled(
    job: Job<Mlp, Sample>,
    on_step: impl Fn(u64, &meshwork::job::JobControl) + Send + 'static,
) -> (Result<Trained<Mlp>>, Vec<JobEvent>) {
    run_reacting(job, move |e, control| {
        if let JobEvent::StepDone(s) = e {
            on_step(s.step, control);
        }
    })
    .await
}

/// Run `job`, calling `on_event` with the job's controls for each event.
async fn run_reacting(
    job: Job<Mlp, Sample>,
    on_event: impl Fn(&JobEvent, &meshwork::job::JobControl) + Send + 'static,
) -> (Result<Trained<Mlp>>, Vec<JobEvent>) {
    let handle = job.spawn().await.expect("spawned");
    let control = handle.control();
    let mut stream = handle.events();
    let recorder = tokio::spawn(async move {
        let mut events = Vec::new();
        loop {
            match stream.recv().await {
                Ok(e) => {
                    on_event(&e, &control);
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
    (outcome, recorder.await.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_1_growing_and_shrinking_at_step_boundaries_equals_the_reference() {
    let init = fixture().initial_model();
    let job = job(
        2,
        &init,
        FaultPlan::new(0),
        RecoveryPolicy::default(),
        Duration::from_secs(30),
    );
    let (outcome, events) = run_controlled(job, |step, control| match step {
        1 => control.scale_to(4),
        4 => control.scale_to(3),
        _ => {}
    })
    .await;
    let trained = outcome.expect("the job resizes and finishes");
    let resized: Vec<(u32, u32)> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Resized { from, to, .. } => Some((*from, *to)),
            _ => None,
        })
        .collect();
    assert_eq!(resized, vec![(2, 4), (4, 3)]);
    let sizes = replicas_per_step(&events);
    assert_eq!(sizes.first(), Some(&2));
    assert_eq!(sizes.last(), Some(&3));
    assert!(sizes.contains(&4), "{sizes:?}");
    // New replicas joined with rank 0's state: all replicas end identical.
    let fingerprints = meshwork::testing::final_fingerprints(&events).unwrap();
    assert_eq!(fingerprints.len(), 3);
    assert!(fingerprints.windows(2).all(|w| w[0] == w[1]));
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_2_sizes_outside_the_range_are_refused_and_the_job_goes_on() {
    let init = fixture().initial_model();
    let job = base(2, &init).elastic(2, 3).build().unwrap();
    let (outcome, events) = run_controlled(job, |step, control| {
        if step == 1 {
            control.scale_to(1);
            control.scale_to(8);
        }
    })
    .await;
    outcome.expect("refusals do not end the job");
    let refused: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::ResizeRefused { requested, .. } => Some(*requested),
            _ => None,
        })
        .collect();
    assert_eq!(refused, vec![1, 8]);
    assert!(replicas_per_step(&events).iter().all(|&n| n == 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_job_starts_no_step_until_resumed() {
    use meshwork::job::EventsError;
    // Many steps: the job cannot end before the pause lands, however fast it runs.
    let job = base(2, &fixture().initial_model())
        .steps(1_000_000)
        .collective_timeout(Duration::from_secs(30))
        .step_timeout(Duration::from_secs(60))
        .build()
        .expect("a valid job");
    let handle = job.spawn().await.unwrap();
    let control = handle.control();
    let mut events = handle.events();
    // The next event that `wanted` accepts (a lagging receiver skips what it missed).
    async fn next_of(
        events: &mut meshwork::job::EventStream,
        wanted: impl Fn(&JobEvent) -> bool,
    ) -> JobEvent {
        let wait = async {
            loop {
                match events.recv().await {
                    Ok(e) if wanted(&e) => return e,
                    Ok(_) | Err(EventsError::Missed(_)) => {}
                    Err(EventsError::Closed) => panic!("the job ended"),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .expect("the event within 60 s")
    }
    // Pause after the first step. Steps that finish before the pause lands do not count.
    next_of(&mut events, |e| matches!(e, JobEvent::StepDone(_))).await;
    control.pause();
    next_of(&mut events, |e| matches!(e, JobEvent::Paused)).await;
    let status = control.status(Duration::from_secs(5)).await.unwrap();
    assert!(status.paused);
    let held_at = status.steps_done;
    // Paused: at most the step already running when the pause arrived finishes; none starts.
    let mut during = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while let Ok(Ok(e)) = tokio::time::timeout_at(until, events.recv()).await {
        during.push(e);
    }
    let steps_while_paused = during
        .iter()
        .filter(|e| matches!(e, JobEvent::StepDone(_)))
        .count();
    assert!(steps_while_paused <= 1, "{during:?}");
    let held = control.status(Duration::from_secs(5)).await.unwrap();
    assert!(held.paused);
    assert!(held.steps_done <= held_at + 1, "{held:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        control
            .status(Duration::from_secs(5))
            .await
            .unwrap()
            .steps_done,
        held.steps_done
    );
    // Resumed: steps run again; stop() ends the job at the next step boundary.
    control.resume();
    next_of(&mut events, |e| matches!(e, JobEvent::StepDone(_))).await;
    let trained = tokio::time::timeout(Duration::from_secs(60), handle.stop())
        .await
        .expect("the job stops within 60 s")
        .unwrap();
    assert!(
        trained.summary.steps > held.steps_done,
        "{:?}",
        trained.summary
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_a_replica_lost_after_the_last_collective_does_not_make_the_step_apply_twice() {
    let init = fixture().initial_model();
    // Device 2 panics in its optimizer update at step 3: the all-reduce had finished, so the
    // survivors have applied step 3 already; it must not be redone.
    let plan = FaultPlan::new(13).with(fault(2, 3, Phase::Update, FaultKind::Panic));
    let (outcome, events, _) = run(job(
        3,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the job recovers");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(lost_devices(&events), vec![DeviceId(2)]);
    assert!(events.iter().any(|e| matches!(
        e,
        JobEvent::Recovered { step: 4, layout, .. } if layout.dp() == 2
    )));
    // Step 3 is reported once, with all three replicas' samples (the lost one's gradient was
    // in the all-reduce), then the survivors go on.
    assert_eq!(replicas_per_step(&events), vec![3, 3, 3, 3, 2, 2, 2, 2]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_7_survivors_that_missed_a_step_others_applied_take_their_state_and_it_is_not_redone() {
    let init = fixture().initial_model();
    // A 3-rank ring all-reduce: each rank sends 4 messages, the last one in its all-gather
    // half. Device 1's last message at step 2 is lost: device 2 waits for it until the
    // time-out while devices 0 and 1 finish the all-reduce and apply the step.
    let plan = FaultPlan::new(15).with(fault(
        1,
        2,
        Phase::Forward,
        FaultKind::DropMessage { message: 7 },
    ));
    let job = base(3, &init)
        .algorithm(Algorithm::Ring)
        .fault_plan(plan)
        .recovery(RecoveryPolicy::shrink())
        .collective_timeout(Duration::from_secs(2))
        .step_timeout(Duration::from_secs(60))
        .build()
        .expect("a valid job");
    let (outcome, events, _) = run(job).await;
    let trained = outcome.expect("the replicas are made equal and the job goes on");
    assert_eq!(fired(&events), vec![0]);
    assert!(lost_devices(&events).is_empty());
    // Step 2 counts as done (generation 1 starts at step 3) and is reported once, with every
    // replica's samples; device 2 trains on from the state devices 0 and 1 reached.
    assert_eq!(recoveries(&events), vec![(3, 1, vec![])]);
    assert!(events.iter().any(|e| matches!(
        e,
        JobEvent::CaughtUp { step: 2, ranks, from: Rank(0) } if ranks == &[Rank(2)]
    )));
    assert_eq!(replicas_per_step(&events), vec![3; STEPS as usize]);
    assert_matches_reference(init, &trained.model, &events);
}

fn partition_plan(seconds: f64) -> FaultPlan {
    FaultPlan::new(14).with(fault(
        1,
        2,
        Phase::Forward,
        FaultKind::Partition { seconds },
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_shorter_than_the_time_out_only_delays_the_step() {
    let init = fixture().initial_model();
    let (outcome, events, _) = run(job(
        2,
        &init,
        partition_plan(0.3),
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the partition heals before the time-out");
    assert_eq!(fired(&events), vec![0]);
    assert!(lost_devices(&events).is_empty());
    let step2 = &steps_of(&events)[2];
    assert!(
        step2.wall_s >= 0.3,
        "step 2 waited for the partition: {}",
        step2.wall_s
    );
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_1_a_partition_longer_than_the_time_out_evicts_the_cut_off_device() {
    use meshwork::error::Health;
    let init = fixture().initial_model();
    let (outcome, events, elapsed) = run(job(
        3,
        &init,
        partition_plan(GONE_S),
        RecoveryPolicy::shrink(),
        SHORT_COLLECTIVE_TIMEOUT,
    ))
    .await;
    let trained = outcome.expect("the survivors go on");
    assert_eq!(lost_devices(&events), vec![DeviceId(1)]);
    let why = events.iter().find_map(|e| match e {
        JobEvent::DeviceLost { error, .. } => Some(error.clone()),
        _ => None,
    });
    match why {
        Some(Error::RanksUnresponsive { ranks, .. }) => {
            assert!(matches!(ranks[0].health, Health::Stuck { .. }), "{ranks:?}")
        }
        other => panic!("expected RanksUnresponsive, got {other:?}"),
    }
    assert!(elapsed < WELL_BEFORE_THE_DEVICE_RETURNS, "{elapsed:?}");
    assert_matches_reference(init, &trained.model, &events);
}

/// A plan whose one fault acts on the first collective message device 1 sends at step 2.
fn message_plan(kind: FaultKind) -> FaultPlan {
    FaultPlan::new(11).with(fault(1, 2, Phase::Forward, kind))
}

/// The `Recovered` events' (step, generation, lost devices).
fn recoveries(events: &[JobEvent]) -> Vec<(u64, u64, Vec<DeviceId>)> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Recovered {
                step,
                generation,
                lost,
                ..
            } => Some((*step, generation.0, lost.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_delayed_less_than_the_time_out_only_delays_the_step() {
    let init = fixture().initial_model();
    let plan = message_plan(FaultKind::DelayMessage {
        seconds: 0.3,
        message: 0,
    });
    let (outcome, events, _) = run(job(
        3,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("a delayed message still arrives");
    assert_eq!(fired(&events), vec![0]);
    assert!(recoveries(&events).is_empty(), "nothing to recover from");
    assert!(steps_of(&events)[2].wall_s >= 0.3);
    assert_matches_reference(init, &trained.model, &events);
}

/// The drop test's collective time-out. At dp 3 on two cores the ring waits for the dropped
/// message until this time-out (every rank waits on the one before it); it must stay above
/// the time three device threads of a loaded machine take to reach one collective, or a
/// late rank is taken for a missing one and evicted instead of the step being retried.
const DROP_TIME_OUT: Duration = Duration::from_secs(4);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_4_a_dropped_message_is_detected_and_the_step_is_retried_by_everyone() {
    let init = fixture().initial_model();
    let (outcome, events, elapsed) = run(job(
        3,
        &init,
        message_plan(FaultKind::DropMessage { message: 0 }),
        RecoveryPolicy::shrink(),
        DROP_TIME_OUT,
    ))
    .await;
    let trained = outcome.expect("the step is retried");
    assert_eq!(fired(&events), vec![0]);
    // Detected when a later message arrives in its place, or at the collective time-out:
    // long before the 60 s step time-out, which a missed drop would wait for. (The whole
    // run is timed, so the bound leaves room for a loaded machine's slow steps.)
    assert!(elapsed < Duration::from_secs(45), "{elapsed:?}");
    assert_eq!(recoveries(&events), vec![(2, 1, vec![])]);
    assert!(lost_devices(&events).is_empty());
    assert_eq!(replicas_per_step(&events), vec![3; STEPS as usize]);
    assert_matches_reference(init, &trained.model, &events);
}

/// `JobBuilder::verify_payloads(true)` checks every message (COMM-8): the two replicas then
/// all-reduce through a message plan, whose bytes the transport counts (the direct plan a
/// plain two-replica job uses sends none), and train the same model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verified_payloads_travel_as_messages_and_train_the_same_model() {
    let init = fixture().initial_model();
    let sent = |events: &[JobEvent]| -> Vec<bool> {
        steps_of(events)
            .iter()
            .flat_map(|s| s.replicas.iter().map(|r| r.bytes_sent > 0))
            .collect()
    };
    let (outcome, events, _) = run(base(2, &init).build().expect("a valid job")).await;
    outcome.expect("trains");
    assert!(
        sent(&events).iter().all(|s| !s),
        "the direct plan sends no bytes"
    );
    let verified = base(2, &init)
        .verify_payloads(true)
        .build()
        .expect("a valid job");
    let (outcome, events, _) = run(verified).await;
    let trained = outcome.expect("trains");
    let verified_sent = sent(&events);
    assert_eq!(verified_sent.len(), 2 * STEPS as usize);
    assert!(
        verified_sent.iter().all(|s| *s),
        "every replica sent messages"
    );
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_4_a_corrupt_message_fails_its_checksum_and_the_step_is_retried() {
    let init = fixture().initial_model();
    let (outcome, events, _) = run(job(
        2,
        &init,
        message_plan(FaultKind::CorruptMessage { message: 0 }),
        RecoveryPolicy::shrink(),
        Duration::from_secs(30),
    ))
    .await;
    let trained = outcome.expect("the step is retried");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(recoveries(&events), vec![(2, 1, vec![])]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_4_a_message_held_past_the_time_out_is_retried_without_evicting_its_sender() {
    let init = fixture().initial_model();
    // The sender sleeps 5 s on the message; its peer gives up after 2 s, and the sender
    // reports 3 s later. A 2 s time-out is far above a step's compute; the 3 s gap leaves
    // room for the two ranks reaching the collective at different times.
    let plan = message_plan(FaultKind::DelayMessage {
        seconds: 5.0,
        message: 0,
    });
    let (outcome, events, _) = run(job(
        2,
        &init,
        plan,
        RecoveryPolicy::shrink(),
        Duration::from_secs(2),
    ))
    .await;
    let trained = outcome.expect("the step is retried");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(recoveries(&events), vec![(2, 1, vec![])]);
    assert_eq!(replicas_per_step(&events), vec![2; STEPS as usize]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_3_a_corrupt_message_without_a_recovery_policy_ends_the_job_naming_its_sender() {
    let init = fixture().initial_model();
    let (outcome, events, elapsed) = run(job(
        2,
        &init,
        message_plan(FaultKind::CorruptMessage { message: 0 }),
        RecoveryPolicy::default(),
        Duration::from_secs(30),
    ))
    .await;
    let error = outcome.expect_err("no recovery policy");
    assert_eq!(fired(&events), vec![0]);
    let corrupt = |e: &meshwork::comm::CommError| matches!(e, meshwork::comm::CommError::CorruptMessage { from, .. } if from.0 == 1);
    match &error {
        Error::Comm(c) if corrupt(c) => {}
        Error::Comm(meshwork::comm::CommError::Poisoned { cause, .. }) if corrupt(cause) => {}
        other => panic!("expected the corrupt message from rank 1, got {other}"),
    }
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_write_that_fails_half_way_leaves_the_previous_one_and_training_goes_on() {
    let init = fixture().initial_model();
    let dir = TempDir::new("faults-ckpt");
    let plan = FaultPlan::new(3).with(fault(0, 4, Phase::Forward, FaultKind::FailCheckpointWrite));
    let job = base(2, &init)
        .fault_plan(plan)
        .checkpoint_dir(dir.path())
        .checkpoint_every(2)
        .keep_checkpoints(10)
        .build()
        .expect("a valid job");
    let (outcome, events, _) = run(job).await;
    let trained = outcome.expect("a failed checkpoint does not stop training");
    assert_eq!(fired(&events), vec![0]);
    let written: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::CheckpointWritten { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    // Periodic checkpoints may also be skipped behind a slow disk (CKW-3); the faulty one
    // and the final one are always taken.
    let mut failed = Vec::new();
    for e in &events {
        if let JobEvent::CheckpointFailed { step, error } = e {
            let text = error.to_string();
            if text.contains("half-way") {
                failed.push(*step);
            } else {
                assert!(text.contains("skipped"), "{text}");
            }
        }
    }
    assert_eq!(failed, vec![4]);
    assert!(!written.contains(&4));
    assert_eq!(written.last(), Some(&8));
    // The half-written directory is gone; every checkpoint left loads.
    let store = meshwork::checkpoint::CheckpointStore::open(dir.path(), 10).expect("store");
    let mut steps: Vec<u64> = store
        .steps()
        .expect("list")
        .iter()
        .map(|(s, _)| *s)
        .collect();
    steps.reverse();
    assert_eq!(steps, written);
    let latest = store.latest_valid().expect("read").expect("one is valid");
    assert_eq!(latest.checkpoint.step, 8);
    assert!(latest.refused.is_empty());
    assert_matches_reference(init, &trained.model, &events);
    let _ = std::fs::remove_dir_all(dir.path());
}

/// A 3-replica job that loses device 1 at step 2 with an elastic minimum of 3.
fn below_minimum_job(init: &Mlp, wait: Duration) -> Job<Mlp, Sample> {
    base(3, init)
        .fault_plan(FaultPlan::new(4).with(fault(1, 2, Phase::Forward, FaultKind::Panic)))
        .recovery(RecoveryPolicy::shrink())
        .elastic(3, 4)
        .elastic_wait(wait)
        .build()
        .expect("a valid job")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_3_below_the_minimum_the_job_waits_and_a_joining_device_resumes_it() {
    let init = fixture().initial_model();
    let job = below_minimum_job(&init, Duration::from_secs(60));
    let (outcome, events) = run_reacting(job, |e, control| {
        if let JobEvent::WaitingForDevices { .. } = e {
            control.scale_to(3);
        }
    })
    .await;
    let trained = outcome.expect("a device joined");
    assert_eq!(fired(&events), vec![0]);
    let waiting: Vec<(u64, u32, u32)> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::WaitingForDevices {
                step,
                replicas,
                min,
                ..
            } => Some((*step, *replicas, *min)),
            _ => None,
        })
        .collect();
    assert_eq!(waiting, vec![(2, 2, 3)]);
    // Step 2 ran once, after the new device joined: no step ran below the minimum.
    assert_eq!(replicas_per_step(&events), vec![3; STEPS as usize]);
    assert_matches_reference(init, &trained.model, &events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elastic_3_below_the_minimum_with_no_device_joining_ends_with_below_minimum() {
    let init = fixture().initial_model();
    let started = Instant::now();
    let (outcome, events) = run_reacting(
        below_minimum_job(&init, Duration::from_millis(500)),
        |_, _| {},
    )
    .await;
    match outcome {
        Err(Error::BelowMinimum {
            replicas,
            min,
            waited,
        }) => {
            assert_eq!((replicas, min), (2, 3));
            assert!(waited >= Duration::from_millis(500), "{waited:?}");
        }
        other => panic!("expected BelowMinimum, got {other:?}"),
    }
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(replicas_per_step(&events), vec![3, 3]);
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// A 2-replica job checkpointing every 2 steps into a fresh directory, under `plan` and
/// `policy`.
fn checkpointed_job(
    init: &Mlp,
    name: &str,
    plan: FaultPlan,
    policy: RecoveryPolicy,
    every: u64,
) -> (Job<Mlp, Sample>, TempDir) {
    let dir = TempDir::new(&format!("faults-{name}"));
    let job = base(2, init)
        .fault_plan(plan)
        .recovery(policy)
        .checkpoint_dir(dir.path())
        .checkpoint_every(every)
        .build()
        .expect("a valid job");
    (job, dir)
}

/// The `RolledBack` events' (failed step, checkpoint step, generation, replaced devices).
fn rollbacks(events: &[JobEvent]) -> Vec<(u64, u64, u64, Vec<DeviceId>)> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::RolledBack {
                failed_step,
                step,
                generation,
                lost,
                ..
            } => Some((*failed_step, *step, generation.0, lost.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_5_a_lost_replica_is_replaced_and_the_job_rolls_back_to_its_checkpoint_in_place() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(8).with(fault(1, 5, Phase::Backward, FaultKind::Panic));
    let (job, dir) = checkpointed_job(&init, "rollback", plan, RecoveryPolicy::roll_back(), 2);
    let (outcome, events, _) = run(job).await;
    let trained = outcome.expect("the job rolls back and finishes");
    assert_eq!(fired(&events), vec![0]);
    assert_eq!(lost_devices(&events), vec![DeviceId(1)]);
    assert_eq!(rollbacks(&events), vec![(5, 4, 1, vec![DeviceId(1)])]);
    // Step 4 ran twice (before the failure and after the rollback); the size stayed 2.
    let raw: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::StepDone(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert_eq!(raw, vec![0, 1, 2, 3, 4, 4, 5, 6, 7]);
    assert_eq!(replicas_per_step(&events), vec![2; STEPS as usize]);
    // The replacement restored the same checkpoint: both replicas end identical.
    let fingerprints = meshwork::testing::final_fingerprints(&events).expect("finished");
    assert_eq!(fingerprints.len(), 2);
    assert_eq!(fingerprints[0], fingerprints[1]);
    assert_matches_reference(init, &trained.model, &events);
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_5_a_loss_that_shrinking_may_not_take_rolls_back_at_the_same_size() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(9).with(fault(0, 3, Phase::Forward, FaultKind::Panic));
    let policy = RecoveryPolicy::shrink().min_replicas(2).or_roll_back();
    let (job, dir) = checkpointed_job(&init, "floor", plan, policy, 2);
    let (outcome, events, _) = run(job).await;
    let trained = outcome.expect("the job rolls back and finishes");
    assert_eq!(rollbacks(&events), vec![(3, 2, 1, vec![DeviceId(0)])]);
    assert!(recoveries(&events).is_empty(), "no shrink below the floor");
    assert_eq!(replicas_per_step(&events), vec![2; STEPS as usize]);
    assert_matches_reference(init, &trained.model, &events);
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rec_5_a_rollback_before_any_checkpoint_ends_the_job_with_the_failure() {
    let init = fixture().initial_model();
    let plan = FaultPlan::new(10).with(fault(1, 2, Phase::Forward, FaultKind::Panic));
    let (job, dir) = checkpointed_job(&init, "nockpt", plan, RecoveryPolicy::roll_back(), 4);
    let started = Instant::now();
    let (outcome, events, _) = run(job).await;
    match outcome {
        Err(Error::StageFailed { device, .. }) => assert_eq!(device, DeviceId(1)),
        other => panic!("expected StageFailed, got {other:?}"),
    }
    assert_eq!(fired(&events), vec![0]);
    assert!(rollbacks(&events).is_empty());
    assert!(started.elapsed() < Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The scenario a child run of this test binary plays (FAULT-4): `injected` or `real`.
const OUTPUT_SCENARIO: &str = "MESHWORK_FAULT_OUTPUT_SCENARIO";

/// FAULT-4's child: a 2-replica job whose device 1 panics at step 2, by the fault plan
/// (`injected`) or in the user's loss (`real`), recovering by shrinking. Run by
/// `fault_4_a_rehearsed_panic_prints_one_line_and_a_real_one_its_backtrace` in a process of
/// its own; a no-op in the ordinary run of the suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_4_child() {
    let Ok(scenario) = std::env::var(OUTPUT_SCENARIO) else {
        return;
    };
    let init = fixture().initial_model();
    let builder = base(2, &init)
        .recovery(RecoveryPolicy::shrink())
        .collective_timeout(Duration::from_secs(30))
        .step_timeout(Duration::from_secs(60));
    let builder = match scenario.as_str() {
        "injected" => builder.fault_plan(FaultPlan::new(1).with(fault(
            1,
            2,
            Phase::Forward,
            FaultKind::Panic,
        ))),
        _ => {
            let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            builder.loss(move |m: &Mlp, items: &[Sample], d: &Device| {
                // The fifth loss is step 2's on one of the two replicas.
                if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 4 {
                    panic!("a real bug in the user's loss");
                }
                mse_loss(m, items, d)
            })
        }
    };
    let job = builder.build().expect("a valid job");
    let (outcome, events, _) = run(job).await;
    outcome.expect("the job recovers by shrinking");
    assert_eq!(lost_devices(&events).len(), 1, "one replica lost");
}

#[test]
fn fault_4_a_rehearsed_panic_prints_one_line_and_a_real_one_its_backtrace() {
    let stderr_of = |scenario: &str| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "faults::fault_4_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(OUTPUT_SCENARIO, scenario)
            .env("RUST_BACKTRACE", "1")
            .output()
            .expect("the test binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            out.status.success(),
            "{scenario}: the child job recovers; stderr:\n{stderr}"
        );
        stderr
    };
    let injected = stderr_of("injected");
    let lines: Vec<&str> = injected
        .lines()
        .filter(|l| l.contains("injected fault"))
        .collect();
    assert_eq!(
        lines,
        vec![
            "meshwork: injected fault 0: panic on device 1 at step 2, micro-batch 0, before the \
             Forward (rehearsed by the fault plan)"
        ],
        "stderr:\n{injected}"
    );
    assert!(
        !injected.contains("panicked at") && !injected.contains("stack backtrace"),
        "a rehearsed panic prints no panic message or backtrace; stderr:\n{injected}"
    );
    let real = stderr_of("real");
    assert!(
        real.contains("panicked at") && real.contains("a real bug in the user's loss"),
        "a real panic keeps its message; stderr:\n{real}"
    );
    assert!(
        real.contains("stack backtrace"),
        "a real panic keeps its backtrace; stderr:\n{real}"
    );
}
