//! CKPT-1 under SIGKILL: a child process (this test binary, re-executed) writes checkpoints in
//! a loop and is killed at pseudo-random moments. After each kill the newest complete
//! checkpoint loads and holds exactly what was written, and nothing partial is ever loaded.
//! (The fsync/rename order itself is asserted through the recording file system in the
//! library's tests: SIGKILL leaves the page cache.)
//!
//! The kill moments are chosen from what the child reports, not from the clock alone: each
//! trial waits for the child to finish 0, 1 or 2 writes and begin the next, then kills it
//! within the first half of that write's expected length (the length of the child's previous
//! write, as observed). So a slow disk makes every write longer and the kills later, and the
//! test still sees the three kinds of trial it needs: kills during a write, kills with a
//! finished checkpoint to load, and kills before the first checkpoint finished. Trials go on
//! until each kind has happened often enough, within a bound.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshwork::checkpoint::{
    Checkpoint, CheckpointStore, DataCursor, RngState, ShardId, ShardSnapshot, TrainingState,
    snapshot_module,
};
use meshwork::mesh::Layout;
use meshwork::testing::{TeacherFixture, TempDir};

const CHILD: &str = "MESHWORK_CKPT_KILL_CHILD";

/// The 784-1024-1024-10 MLP of seed 77 (only the model is used: the data seed is unused).
fn fixture() -> TeacherFixture {
    TeacherFixture::new(0, 77).with_widths(&[784, 1024, 1024, 10])
}

/// The checkpoint the child writes at `step`: the same seeded model every time (drawn under
/// the suite's draw lock: the parent draws it while other tests of the binary run).
fn checkpoint(step: u64) -> Checkpoint {
    let model = fixture().initial_model();
    Checkpoint {
        step,
        layout: Layout::data_parallel(1).unwrap(),
        cursor: DataCursor {
            epoch: 0,
            batch: step,
        },
        rng: RngState {
            seed: 77,
            state: step,
        },
        shards: vec![ShardSnapshot {
            shard: ShardId::stage(0),
            params: snapshot_module(&model),
            optimizer: None,
            training: TrainingState::default(),
        }],
    }
}

/// Child mode: write checkpoints forever, saying when each write begins and ends.
fn child(dir: &str) {
    let store = CheckpointStore::open(dir, 3).expect("a checkpoint directory");
    let template = checkpoint(0);
    let mut out = std::io::stdout();
    for step in 1.. {
        let c = Checkpoint {
            step,
            ..template.clone()
        };
        let _ = writeln!(out, "begin {step}");
        let _ = out.flush();
        store.write(&c).expect("the write succeeds until the kill");
        let _ = writeln!(out, "end {step}");
        let _ = out.flush();
    }
}

/// Kills in all: at least this many, and until each kind of trial has happened often enough.
const MIN_TRIALS: usize = 40;
/// A run that has not seen every kind of trial often enough after this many fails.
const MAX_TRIALS: usize = 200;
/// Kills that must land during a write.
const DURING_WRITE: usize = 20;
/// Trials that must end with a finished checkpoint to load.
const LOADED: usize = 20;
/// Trials that must end before the first checkpoint finished (nothing to load).
const NOTHING_YET: usize = 3;

/// The child's lines, each with the moment it was read.
type Lines = Arc<Mutex<Vec<(Instant, String)>>>;

/// Waits until some line satisfies `found` (at most 60 s); the moment it was read.
fn wait_for(lines: &Lines, found: impl Fn(&str) -> bool) -> Option<Instant> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if let Some((at, _)) = lines.lock().unwrap().iter().find(|(_, l)| found(l)) {
            return Some(*at);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    None
}

/// A xorshift step: the trials' pseudo-random choices, the same on every run.
fn next(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

#[test]
fn ckpt_1_sigkill_at_random_moments_never_leaves_a_partial_checkpoint_that_loads() {
    if let Ok(dir) = std::env::var(CHILD) {
        child(&dir);
        return;
    }
    let expected = checkpoint(0).shards[0].params.clone();
    let exe = std::env::current_exe().expect("the test binary");
    let (mut during_write, mut loaded, mut nothing_yet) = (0, 0, 0);
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut trial = 0;
    while trial < MIN_TRIALS
        || during_write < DURING_WRITE
        || loaded < LOADED
        || nothing_yet < NOTHING_YET
    {
        assert!(
            trial < MAX_TRIALS,
            "after {trial} kills: {during_write} during a write (need {DURING_WRITE}), \
             {loaded} with a checkpoint to load (need {LOADED}), {nothing_yet} before the \
             first checkpoint (need {NOTHING_YET})"
        );
        let dir = TempDir::new(&format!("kill-{trial}"));
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "checkpoint_kill::ckpt_1_sigkill_at_random_moments_never_leaves_a_partial_checkpoint_that_loads",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the child starts");
        let lines: Lines = Arc::default();
        let reader = {
            let lines = lines.clone();
            let stdout = child.stdout.take().expect("piped stdout");
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push((Instant::now(), line));
                }
            })
        };
        // Let 0, 1 or 2 writes finish, wait for the next to begin, then kill within the first
        // half of its expected length (the previous write's, as observed; for the first
        // write, which has none, within 2 ms: encoding and writing 7 MiB takes longer).
        let finished_before = next(&mut seed) % 3;
        let began = |step: u64| {
            let line = format!("begin {step}");
            wait_for(&lines, move |l| l.trim_end().ends_with(&line))
        };
        let ended = |step: u64| {
            let line = format!("end {step}");
            wait_for(&lines, move |l| l.trim_end().ends_with(&line))
        };
        let expected_write = if finished_before == 0 {
            Duration::from_millis(4)
        } else {
            match (began(finished_before), ended(finished_before)) {
                (Some(b), Some(e)) => e - b,
                _ => panic!("trial {trial}: the child never finished write {finished_before}"),
            }
        };
        assert!(
            began(finished_before + 1).is_some(),
            "trial {trial}: the child never began write {}",
            finished_before + 1
        );
        let fraction = (next(&mut seed) % 1000) as f64 / 2000.0;
        std::thread::sleep(expected_write.mul_f64(fraction));
        let last = lines.lock().unwrap().last().map(|(_, l)| l.clone());
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let _ = reader.join();
        // The kill landed during a write if the last line said a write began (a write that
        // ended after the look but before the kill counts as not during one).
        let all: Vec<String> = lines
            .lock()
            .unwrap()
            .iter()
            .map(|(_, l)| l.clone())
            .collect();
        if last.as_deref().is_some_and(|l| l.contains("begin ")) && all.last() == last.as_ref() {
            during_write += 1;
        }
        let finished: Vec<u64> = all
            .iter()
            .filter_map(|l| l.split("end ").nth(1).and_then(|n| n.trim().parse().ok()))
            .collect();
        let store = CheckpointStore::open(dir.path(), 3).unwrap();
        match store.latest_valid().expect("the store reads") {
            Some(l) => {
                loaded += 1;
                // Only complete checkpoints load, with exactly what was written.
                assert!(
                    l.checkpoint.step >= finished.last().copied().unwrap_or(0),
                    "trial {trial}: loaded step {} but step {:?} had finished",
                    l.checkpoint.step,
                    finished.last()
                );
                assert_eq!(l.checkpoint.shards.len(), 1);
                // Names, shapes and values (a parameter's id is random per process).
                let same = l.checkpoint.shards[0]
                    .params
                    .params()
                    .iter()
                    .zip(expected.params())
                    .all(|(a, b)| a.name == b.name && a.dims == b.dims && a.values == b.values);
                assert!(
                    same && l.checkpoint.shards[0].params.len() == expected.len(),
                    "trial {trial}: the loaded parameters differ from those written"
                );
            }
            None => {
                nothing_yet += 1;
                assert!(
                    finished.is_empty(),
                    "trial {trial}: step {:?} finished but nothing loads",
                    finished.last()
                );
            }
        }
        let _ = std::fs::remove_dir_all(dir.path());
        trial += 1;
    }
    eprintln!(
        "{trial} kills: {during_write} during a write, {loaded} with a checkpoint to load, \
         {nothing_yet} before the first checkpoint"
    );
}
