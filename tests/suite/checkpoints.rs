//! Checkpoints of running jobs: written every n steps off the training path, kept k at a time,
//! restored on resume (same or different data-parallel size) so that the resumed run equals
//! the uninterrupted one; a corrupt newest checkpoint is refused and the previous one used; a
//! failing write is an event, not a failure.

use std::path::Path;
use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use meshwork::checkpoint::{CheckpointStore, FaultyFs, RealFs};
use meshwork::demo::{Mlp, Sample};
use meshwork::prelude::*;
use meshwork::testing::{
    TeacherFixture, TempDir, bounded, compare_parameters, run_recording, steps_of,
};

const GLOBAL_BATCH: usize = 16;

const BOUND: Duration = Duration::from_secs(120);

/// 128 samples of the 8 → 3 teacher (seed 31, noise 0.1) and the 8-32-16-3 MLP of seed 13.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(31, 13).with_samples(128)
}

fn builder(dp: u32, steps: u64, init: &Mlp) -> JobBuilder<Mlp, Sample> {
    fixture()
        .builder(init, dp, GLOBAL_BATCH, steps)
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .seed(2)
}

async fn run(job: Job<Mlp, Sample>) -> (Result<Trained<Mlp>>, Vec<JobEvent>) {
    bounded(BOUND, run_recording(job)).await
}

fn written(events: &[JobEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::CheckpointWritten { step, .. } => Some(*step),
            _ => None,
        })
        .collect()
}

fn checkpoint_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ckpt_every_2_steps_keeps_the_newest_2_and_a_resumed_run_equals_the_uninterrupted_one() {
    let init = fixture().initial_model();
    let (whole, _) = run(builder(2, 8, &init).build().unwrap()).await;
    let whole = whole.unwrap().model;

    let dir = TempDir::new("ckpt-resume");
    let (first, events) = run(builder(2, 5, &init)
        .checkpoint_dir(dir.path())
        .checkpoint_every(2)
        .keep_checkpoints(2)
        .build()
        .unwrap())
    .await;
    first.unwrap();
    // Steps 2 and 4, and the end of the run (5).
    assert_eq!(written(&events), vec![2, 4, 5]);
    assert_eq!(
        checkpoint_dirs(dir.path()),
        vec!["step-00000004", "step-00000005"]
    );

    // Resume onto one replica: parameters and Adam's state come back, the data continues.
    let (resumed, events) = run(builder(1, 8, &init)
        .checkpoint_dir(dir.path())
        .resume_from_checkpoint(true)
        .build()
        .unwrap())
    .await;
    let resumed = resumed.unwrap().model;
    assert!(events.iter().any(|e| matches!(
        e,
        JobEvent::Restored { step: 5, refused, .. } if refused.is_empty()
    )));
    let steps: Vec<u64> = steps_of(&events).iter().map(|s| s.step).collect();
    assert_eq!(steps, vec![5, 6, 7]);
    compare_parameters(&resumed, &whole, 1e-5).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ckpt_2_a_corrupt_newest_checkpoint_is_refused_and_the_previous_one_resumes() {
    let init = fixture().initial_model();
    let dir = TempDir::new("ckpt-corrupt");
    let (first, _) = run(builder(2, 4, &init)
        .checkpoint_dir(dir.path())
        .checkpoint_every(2)
        .build()
        .unwrap())
    .await;
    first.unwrap();
    // Flip a byte in the newest checkpoint's shard.
    let shard = dir.join("step-00000004").join("shard-pp0000-tp0000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let (resumed, events) = run(builder(2, 6, &init)
        .checkpoint_dir(dir.path())
        .resume_from_checkpoint(true)
        .build()
        .unwrap())
    .await;
    resumed.unwrap();
    let resumed_at = events.iter().find_map(|e| match e {
        JobEvent::Restored { step, refused, .. } => Some((*step, refused.clone())),
        _ => None,
    });
    let (step, refused) = resumed_at.expect("a Resumed event");
    assert_eq!(step, 2, "the previous good checkpoint");
    assert_eq!(refused.len(), 1);
    assert!(refused[0].contains("step-00000004"), "{refused:?}");
    let _ = std::fs::remove_dir_all(dir.path());
}

/// A file system whose writes take `delay` each.
#[derive(Debug)]
struct SlowFs {
    inner: RealFs,
    delay: Duration,
}

#[derive(Debug)]
struct SlowFile {
    inner: <RealFs as meshwork::checkpoint::CheckpointFs>::File,
    delay: Duration,
}

impl meshwork::checkpoint::CheckpointFile for SlowFile {
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        std::thread::sleep(self.delay);
        self.inner.write_all(buf)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.inner.sync()
    }
}

impl meshwork::checkpoint::CheckpointFs for SlowFs {
    type File = SlowFile;
    fn create_dir_all(&self, p: &Path) -> std::io::Result<()> {
        self.inner.create_dir_all(p)
    }
    fn create(&self, p: &Path) -> std::io::Result<SlowFile> {
        Ok(SlowFile {
            inner: self.inner.create(p)?,
            delay: self.delay,
        })
    }
    fn rename(&self, a: &Path, b: &Path) -> std::io::Result<()> {
        self.inner.rename(a, b)
    }
    fn sync_dir(&self, p: &Path) -> std::io::Result<()> {
        self.inner.sync_dir(p)
    }
    fn remove_file(&self, p: &Path) -> std::io::Result<()> {
        self.inner.remove_file(p)
    }
    fn remove_dir_all(&self, p: &Path) -> std::io::Result<()> {
        self.inner.remove_dir_all(p)
    }
    fn read(&self, p: &Path) -> std::io::Result<Vec<u8>> {
        self.inner.read(p)
    }
    fn file_len(&self, p: &Path) -> std::io::Result<u64> {
        self.inner.file_len(p)
    }
    fn list(&self, p: &Path) -> std::io::Result<Vec<String>> {
        self.inner.list(p)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ckw_1_step_events_keep_arriving_while_a_slow_checkpoint_write_is_in_progress() {
    let init = fixture().initial_model();
    let dir = TempDir::new("ckpt-slow");
    let store = CheckpointStore::with_fs(
        SlowFs {
            inner: RealFs,
            delay: Duration::from_millis(400),
        },
        dir.path(),
        2,
    )
    .unwrap();
    let started = Instant::now();
    let (outcome, events) = run(builder(2, 30, &init)
        .checkpoint_store(store)
        .checkpoint_every(10)
        .build()
        .unwrap())
    .await;
    outcome.unwrap();
    // The checkpoint of step 10 is written while steps 10.. run: step events come between
    // the snapshot and its CheckpointWritten event.
    let written_at = events
        .iter()
        .position(|e| matches!(e, JobEvent::CheckpointWritten { step: 10, .. }))
        .expect("step 10's checkpoint was written");
    let steps_before: Vec<u64> = events[..written_at]
        .iter()
        .filter_map(|e| match e {
            JobEvent::StepDone(s) => Some(s.step),
            _ => None,
        })
        .collect();
    assert!(
        steps_before.iter().filter(|s| **s >= 10).count() >= 3,
        "training went on during the write: {steps_before:?}"
    );
    assert_eq!(written(&events), vec![10, 20, 30]);
    // Each write is at least three slow file writes.
    assert!(started.elapsed() >= Duration::from_millis(1200));
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ckw_2_a_write_failing_halfway_is_an_event_and_training_goes_on() {
    let init = fixture().initial_model();
    let dir = TempDir::new("ckpt-faulty");
    let fs = FaultyFs::new(RealFs);
    fs.fail_after_bytes(100);
    let store = CheckpointStore::with_fs(fs, dir.path(), 2).unwrap();
    let (outcome, events) = run(builder(2, 4, &init)
        .checkpoint_store(store)
        .checkpoint_every(2)
        .build()
        .unwrap())
    .await;
    outcome.expect("a failed checkpoint write does not end the job");
    let failed: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::CheckpointFailed { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    assert_eq!(failed, vec![2, 4]);
    assert_eq!(steps_of(&events).len(), 4);
    // Nothing half-written is ever loaded.
    let loaded = CheckpointStore::open(dir.path(), 2)
        .unwrap()
        .latest_valid()
        .unwrap();
    assert!(loaded.is_none());
    let _ = std::fs::remove_dir_all(dir.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ckw_3_a_writer_slower_than_the_interval_holds_the_step_boundary_not_memory() {
    let init = fixture().initial_model();
    let dir = TempDir::new("ckpt-backlog");
    let store = CheckpointStore::with_fs(
        SlowFs {
            inner: RealFs,
            delay: Duration::from_millis(100),
        },
        dir.path(),
        2,
    )
    .unwrap();
    let (outcome, events) = run(builder(2, 6, &init)
        .checkpoint_store(store)
        .checkpoint_every(1)
        .build()
        .unwrap())
    .await;
    outcome.unwrap();
    // Every checkpoint is written: none skipped, none failed.
    assert_eq!(written(&events), vec![1, 2, 3, 4, 5, 6]);
    // At most two in flight: step k (after the checkpoint of boundary k) starts only once the
    // checkpoint of boundary k - 2 is written.
    let at = |f: &dyn Fn(&JobEvent) -> bool| events.iter().position(f).expect("event");
    for k in 3..6u64 {
        let written_k2 =
            at(&|e| matches!(e, JobEvent::CheckpointWritten { step, .. } if *step == k - 2));
        let step_k = at(&|e| matches!(e, JobEvent::StepDone(s) if s.step == k));
        assert!(
            written_k2 < step_k,
            "step {k} ran before checkpoint {} was written",
            k - 2
        );
    }
    let _ = std::fs::remove_dir_all(dir.path());
}

/// Resuming from a directory with no valid checkpoint says so (`NothingToResume`) and trains
/// from step 0, writing its end checkpoint; with `require_checkpoint(true)` it is an error
/// naming the directory, and nothing trains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_from_nothing_is_an_event_or_with_require_checkpoint_an_error() {
    let init = fixture().initial_model();
    let dir = TempDir::new("ckpt-nothing-to-resume");
    // A required checkpoint in a directory that does not exist: refused by build(), and the
    // directory is not made.
    match builder(2, 3, &init)
        .checkpoint_dir(dir.path())
        .require_checkpoint(true)
        .build()
    {
        Err(meshwork::Error::Checkpoint(
            meshwork::checkpoint::CheckpointError::NothingToResume { location },
        )) => assert_eq!(location, dir.path().display().to_string()),
        other => panic!("expected NothingToResume, got {:?}", other.map(|_| ())),
    }
    assert!(!dir.path().exists());
    // In an empty directory: the job fails when it looks, before any step.
    std::fs::create_dir_all(dir.path()).unwrap();
    let (required, events) = run(builder(2, 3, &init)
        .checkpoint_dir(dir.path())
        .require_checkpoint(true)
        .build()
        .unwrap())
    .await;
    match required {
        Err(meshwork::Error::Checkpoint(
            meshwork::checkpoint::CheckpointError::NothingToResume { location },
        )) => assert_eq!(location, dir.path().display().to_string()),
        other => panic!("expected NothingToResume, got {:?}", other.map(|_| ())),
    }
    assert!(steps_of(&events).is_empty(), "nothing trained");

    let (resumed, events) = run(builder(2, 3, &init)
        .checkpoint_dir(dir.path())
        .resume_from_checkpoint(true)
        .build()
        .unwrap())
    .await;
    resumed.unwrap();
    assert!(events.iter().any(|e| matches!(
        e,
        JobEvent::NothingToResume { location } if *location == dir.path().display().to_string()
    )));
    let steps: Vec<u64> = steps_of(&events).iter().map(|s| s.step).collect();
    assert_eq!(steps, vec![0, 1, 2], "trained from scratch");
    // The end of the run wrote a checkpoint (no interval was set), which a required resume
    // now finds.
    assert_eq!(written(&events), vec![3]);
    let (again, events) = run(builder(2, 4, &init)
        .checkpoint_dir(dir.path())
        .require_checkpoint(true)
        .build()
        .unwrap())
    .await;
    again.unwrap();
    assert!(
        events
            .iter()
            .any(|e| matches!(e, JobEvent::Restored { step: 3, .. }))
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// CKPT-7: a checkpoint directory that cannot be created is refused by `build()`.
#[test]
fn ckpt_7_build_refuses_a_checkpoint_dir_that_cannot_be_created() {
    let dir = TempDir::new("ckpt-not-writable");
    std::fs::create_dir_all(dir.path()).unwrap();
    let file = dir.join("file");
    std::fs::write(&file, b"x").unwrap();
    let init = fixture().initial_model();
    match builder(1, 2, &init)
        .checkpoint_dir(file.join("sub"))
        .build()
    {
        Err(meshwork::Error::Checkpoint(meshwork::checkpoint::CheckpointError::NotWritable {
            root,
            ..
        })) => assert_eq!(root, file.join("sub")),
        other => panic!("expected NotWritable, got {:?}", other.map(|_| ())),
    }
    let _ = std::fs::remove_dir_all(dir.path());
}

/// OPT-1: a job without ZeRO steps with the flat rule and checkpoints its state as one part of
/// the whole flat order, so its checkpoint resumes in a ZeRO-2 job (re-sharded over 2 ranks);
/// Burn's whole optimizer state (written by a configuration with Burn's own per-tensor
/// clipping, here at a norm no gradient reaches) resumes in a plain job, Burn's optimizer
/// stepping on from it. Both end within 1e-5 · max|ref| of the uninterrupted plain run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_1_plain_zero_and_burn_checkpoints_resume_in_each_others_jobs() {
    use burn::grad_clipping::GradientClippingConfig;
    let init = fixture().initial_model();
    let (whole, _) = run(builder(2, 8, &init).build().unwrap()).await;
    let whole = whole.unwrap().model;
    let first_half = |dir: &Path, optimizer: AdamConfig| {
        builder(2, 4, &init)
            .optimizer(optimizer)
            .checkpoint_dir(dir)
            .build()
            .unwrap()
    };
    let second_half = |dir: &Path| {
        builder(2, 8, &init)
            .checkpoint_dir(dir)
            .resume_from_checkpoint(true)
    };

    let dir = TempDir::new("opt-1-plain-to-zero");
    run(first_half(dir.path(), AdamConfig::new()))
        .await
        .0
        .unwrap();
    let (zero, events) = run(second_half(dir.path())
        .zero(ZeroStage::Two)
        .build()
        .unwrap())
    .await;
    let restored = |events: &[JobEvent]| {
        events
            .iter()
            .any(|e| matches!(e, JobEvent::Restored { step: 4, refused, .. } if refused.is_empty()))
    };
    assert!(
        restored(&events),
        "the ZeRO-2 job resumed the plain checkpoint"
    );
    compare_parameters(&zero.unwrap().model, &whole, 1e-5).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(dir.path());

    let dir = TempDir::new("opt-1-burn-to-plain");
    let clipped = AdamConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(1e6)));
    run(first_half(dir.path(), clipped)).await.0.unwrap();
    let (plain, events) = run(second_half(dir.path()).build().unwrap()).await;
    assert!(restored(&events), "the plain job resumed Burn's state");
    compare_parameters(&plain.unwrap().model, &whole, 1e-5).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(dir.path());
}
