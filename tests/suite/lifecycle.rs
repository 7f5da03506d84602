//! JOB-2 at the process level: jobs started and ended inside one long-lived process leave
//! nothing behind — the thread count, ractor's registry and its process groups return to where
//! they started. The check runs alone in a child process of the suite binary (this test
//! started again with `--exact`), so no other test's threads and actors come and go meanwhile.

use std::time::{Duration, Instant};

use burn::optim::SgdConfig;
use meshwork::testing::{TeacherFixture, run_recording};

/// 64 samples of the 4 → 2 teacher (seed 2, noise 0.1) and a 4-8-2 MLP. The MLP was drawn
/// unseeded before the suite became one binary; it is drawn from seed 0 now, under the draw
/// lock.
fn fixture() -> TeacherFixture {
    TeacherFixture::new(2, 0)
        .with_widths(&[4, 8, 2])
        .with_samples(64)
}

/// Threads of this process (Linux; `None` elsewhere).
fn thread_count() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

/// Set in the child process that runs the check.
const CHILD: &str = "MESHWORK_LIFECYCLE_CHILD";

#[test]
fn job_2_threads_registry_and_process_groups_return_to_where_they_started() {
    if std::env::var_os(CHILD).is_some() {
        check_alone();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "lifecycle::job_2_threads_registry_and_process_groups_return_to_where_they_started",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the child test process starts");
    let deadline = Instant::now() + Duration::from_secs(300);
    while child.try_wait().expect("the child's status").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child test process did not end within 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("the child's output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    // The child ran the check (a filter that matched nothing would pass too).
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "the child ran no test:\n{stdout}"
    );
}

/// The check itself, in a process where nothing else runs.
fn check_alone() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Warm the runtime's worker threads up before counting.
    rt.block_on(async { tokio::task::yield_now().await });
    let before = (
        thread_count(),
        ractor::registry::registered(),
        ractor::pg::which_groups(),
    );
    rt.block_on(async {
        for dp in [1, 2, 3] {
            let fixture = fixture();
            let job = fixture
                .builder(&fixture.initial_model(), dp, 12, 3)
                .optimizer(SgdConfig::new())
                .build()
                .unwrap();
            let (outcome, _) = tokio::time::timeout(Duration::from_secs(60), run_recording(job))
                .await
                .expect("the job ends");
            assert_eq!(outcome.unwrap().summary.steps, 3);
        }
    });
    // Device threads end once their actors are gone: give them a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    while thread_count() != before.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(before.0.is_some(), "this test needs /proc/self/status");
    assert_eq!(
        thread_count(),
        before.0,
        "threads return to where they started"
    );
    assert_eq!(ractor::registry::registered(), before.1);
    assert_eq!(ractor::pg::which_groups(), before.2);
}
