//! JOB-2 at the process level: jobs started and ended inside one long-lived process leave
//! nothing behind — the thread count, ractor's registry and its process groups return to where
//! they started. Alone in its test binary, so no other test's threads come and go meanwhile.

use std::time::{Duration, Instant};

use burn::optim::SgdConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::prelude::*;
use meshwork::testing::run_recording;

/// Threads of this process (Linux; `None` elsewhere).
fn thread_count() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

#[test]
fn job_2_threads_registry_and_process_groups_return_to_where_they_started() {
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
            let device = Device::flex();
            let job = Job::builder()
                .initial_model(Mlp::new(&[4, 8, 2], &device))
                .loss(mse_loss)
                .data(
                    TeacherTask {
                        d_in: 4,
                        d_out: 2,
                        noise: 0.1,
                        seed: 2,
                    }
                    .dataset(64),
                )
                .optimizer(SgdConfig::new())
                .data_parallel(dp)
                .batch_size(12)
                .steps(3)
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
