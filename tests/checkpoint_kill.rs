//! CKPT-1 under SIGKILL: a child process (this test binary, re-executed) writes checkpoints in
//! a loop and is killed at pseudo-random moments, 50 times; at least 20 kills land during a
//! write. After each kill the newest complete checkpoint loads and holds exactly what was
//! written, and nothing partial is ever loaded. (The fsync/rename order itself is asserted
//! through the recording file system in the library's tests: SIGKILL leaves the page cache.)

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::tensor::Device;
use meshwork::checkpoint::{
    Checkpoint, CheckpointStore, DataCursor, RngState, ShardId, ShardSnapshot, snapshot_module,
};
use meshwork::demo::Mlp;
use meshwork::mesh::Layout;

const CHILD: &str = "MESHWORK_CKPT_KILL_CHILD";

/// The checkpoint the child writes at `step`: the same seeded model every time.
fn checkpoint(step: u64) -> Checkpoint {
    let device = Device::flex();
    device.seed(77);
    let model = Mlp::new(&[784, 1024, 1024, 10], &device);
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

#[test]
fn ckpt_1_sigkill_at_random_moments_never_leaves_a_partial_checkpoint_that_loads() {
    if let Ok(dir) = std::env::var(CHILD) {
        child(&dir);
        return;
    }
    let expected = checkpoint(0).shards[0].params.clone();
    let exe = std::env::current_exe().expect("the test binary");
    let mut during_write = 0;
    let mut loaded = 0;
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for trial in 0..50 {
        let dir =
            std::env::temp_dir().join(format!("meshwork-kill-{}-{trial}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "ckpt_1_sigkill_at_random_moments_never_leaves_a_partial_checkpoint_that_loads",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, &dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the child starts");
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let reader = {
            let lines = lines.clone();
            let stdout = child.stdout.take().expect("piped stdout");
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            })
        };
        // Wait for the first write to begin, then a pseudo-random 0–60 ms.
        let start = std::time::Instant::now();
        // (The test harness prints its own lines first.)
        let began = || lines.lock().unwrap().iter().any(|l| l.contains("begin "));
        while !began() && start.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(1));
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_micros(seed % 60_000));
        let last = lines.lock().unwrap().last().cloned().unwrap_or_default();
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        let _ = reader.join();
        // The kill landed during a write if the last line said a write began (a write that
        // ended after the look but before the kill counts as not during one).
        let ended: Vec<String> = lines.lock().unwrap().clone();
        if last.contains("begin ") && ended.last() == Some(&last) {
            during_write += 1;
        }
        let finished: Vec<u64> = ended
            .iter()
            .filter_map(|l| l.split("end ").nth(1).and_then(|n| n.trim().parse().ok()))
            .collect();
        let store = CheckpointStore::open(&dir, 3).unwrap();
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
            None => assert!(
                finished.is_empty(),
                "trial {trial}: step {:?} finished but nothing loads",
                finished.last()
            ),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    eprintln!("50 kills: {during_write} during a write, {loaded} with a checkpoint to load");
    assert!(
        during_write >= 20,
        "only {during_write} of 50 kills landed during a write"
    );
    assert!(
        loaded >= 20,
        "only {loaded} trials had a checkpoint to load"
    );
}
