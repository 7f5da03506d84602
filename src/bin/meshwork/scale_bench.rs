//! `meshwork bench scale`: how the control plane behaves past a handful of ranks. A tiny
//! model trains on growing numbers of logical ranks in this process (the in-process transport,
//! one device actor each): the step time and the Supervisor's control messages per step and
//! per rank (SCALE-1); and the Supervisor's pure recovery decision at 16,384 simulated ranks,
//! timed for lost sets from one rank to half of them (SCALE-2).

use std::time::{Duration, Instant};

use burn::optim::SgdConfig;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::error::Result;
use meshwork::job::Job;
use meshwork::recovery::{Decision, RecoveryPolicy, RestartLog, decide};

/// The tiny model every rank holds: 4 → 8 → 2 (58 parameters).
const WIDTHS: [usize; 3] = [4, 8, 2];
/// Simulated ranks of the recovery decisions.
pub(crate) const DECISION_WORLD: usize = 16_384;

/// One world size's run.
#[derive(Debug, serde::Serialize)]
pub(crate) struct RanksRun {
    ranks: u32,
    steps: u64,
    /// Mean wall time of a step.
    step_ms: f64,
    /// The Supervisor's control messages per step (SCALE-1).
    messages_per_step: f64,
    /// The same per rank.
    messages_per_step_per_rank: f64,
    /// The run's Amdahl figure.
    serial_fraction: Option<f64>,
}

/// One lost set's decision time.
#[derive(Debug, serde::Serialize)]
pub(crate) struct DecisionTime {
    lost: usize,
    /// Median over the repetitions, in microseconds.
    median_us: f64,
    /// Slowest repetition, in microseconds.
    max_us: f64,
}

/// Trains the tiny model on `ranks` logical ranks for `steps` steps (one sample per rank).
async fn run_ranks(ranks: u32, steps: u64) -> Result<RanksRun> {
    let task = TeacherTask {
        d_in: WIDTHS[0],
        d_out: WIDTHS[2],
        noise: 0.1,
        seed: 7,
    };
    let job = Job::builder()
        .model(|ctx| Mlp::new(&WIDTHS, &ctx.device))
        .loss(mse_loss)
        .data(task.dataset(ranks as usize * 2))
        .optimizer(SgdConfig::new())
        .learning_rate(0.01)
        .data_parallel(ranks)
        .batch_size(ranks as usize)
        .steps(steps)
        .collective_timeout(Duration::from_secs(120))
        .step_timeout(Duration::from_secs(300))
        .build()?;
    let trained = job.spawn().await?.join().await?;
    let s = &trained.summary;
    let per_step = s.control_messages as f64 / s.steps.max(1) as f64;
    Ok(RanksRun {
        ranks: s.ranks,
        steps: s.steps,
        step_ms: 1e3 * s.wall_s / s.steps.max(1) as f64,
        messages_per_step: per_step,
        messages_per_step_per_rank: per_step / f64::from(s.ranks.max(1)),
        serial_fraction: s.amdahl().map(|a| a.serial_fraction),
    })
}

/// Times `decide` at [`DECISION_WORLD`] ranks for each lost-set size, `repeats` times each.
pub(crate) fn decision_times(repeats: usize) -> Vec<DecisionTime> {
    let policy = RecoveryPolicy::shrink().max_restarts(u32::MAX, Duration::from_secs(1));
    [1usize, 8, 512, DECISION_WORLD / 2]
        .into_iter()
        .map(|n| {
            // Spread over the world: every other node of 8, say, rather than a prefix.
            let stride = (DECISION_WORLD / n).max(1);
            let lost: Vec<usize> = (0..n).map(|i| i * stride).collect();
            let mut times: Vec<Duration> = (0..repeats.max(1))
                .map(|_| {
                    let start = Instant::now();
                    let d = decide(
                        &policy,
                        &mut RestartLog::default(),
                        DECISION_WORLD,
                        (&lost, false, false),
                        true,
                        Instant::now(),
                    );
                    let took = start.elapsed();
                    debug_assert!(matches!(d, Decision::Shrink { .. }));
                    std::hint::black_box(d);
                    took
                })
                .collect();
            times.sort();
            DecisionTime {
                lost: n,
                median_us: times[times.len() / 2].as_secs_f64() * 1e6,
                max_us: times.last().map_or(0.0, |t| t.as_secs_f64() * 1e6),
            }
        })
        .collect()
}

/// Runs every world size in `ranks`, then the decisions.
pub(crate) async fn run(ranks: &[u32], steps: u64) -> Result<(Vec<RanksRun>, Vec<DecisionTime>)> {
    let mut runs = Vec::new();
    for &r in ranks {
        eprintln!("bench scale: {r} ranks …");
        runs.push(run_ranks(r, steps).await?);
    }
    Ok((runs, decision_times(200)))
}

/// Prints the figures (one JSON object per line with `json`).
pub(crate) fn print(runs: &[RanksRun], decisions: &[DecisionTime], json: bool) {
    if json {
        for r in runs {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
        for d in decisions {
            println!("{}", serde_json::to_string(d).unwrap_or_default());
        }
        return;
    }
    println!(
        "# logical ranks in one process (in-process transport), model {WIDTHS:?}, one sample \
         per rank; control messages: the Supervisor's requests to stages, their replies and \
         its own inbox"
    );
    println!(
        "{:>7} {:>6} {:>10} {:>14} {:>16} {:>8}",
        "ranks", "steps", "step ms", "msgs/step", "msgs/step/rank", "serial"
    );
    for r in runs {
        println!(
            "{:>7} {:>6} {:>10.1} {:>14.1} {:>16.3} {:>8}",
            r.ranks,
            r.steps,
            r.step_ms,
            r.messages_per_step,
            r.messages_per_step_per_rank,
            r.serial_fraction
                .map_or_else(|| "–".into(), |s| format!("{s:.3}"))
        );
    }
    println!(
        "# recovery decision (pure, shrink) at {DECISION_WORLD} simulated ranks, median of 200"
    );
    println!("{:>7} {:>12} {:>12}", "lost", "median µs", "max µs");
    for d in decisions {
        println!("{:>7} {:>12.1} {:>12.1}", d.lost, d.median_us, d.max_us);
    }
}
