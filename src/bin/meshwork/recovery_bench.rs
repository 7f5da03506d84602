//! `meshwork bench recovery`: how fast a data-parallel job finds a killed replica and trains
//! again without it, and what periodic checkpoints cost per step.

use std::time::{Duration, Instant};

use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::demo::{Mlp, TeacherTask, mse_loss};
use meshwork::error::{Error, Result};
use meshwork::events::JobEvent;
use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
use meshwork::job::{EventsError, Job};
use meshwork::recovery::RecoveryPolicy;

/// What `bench recovery` measures.
#[derive(Debug, serde::Serialize)]
pub(crate) struct RecoveryFigures {
    dp: u32,
    /// From the kill (the start of the step after the last completed one) to the loss being
    /// reported (`DeviceLost`).
    detect_s: f64,
    /// From the detection to the next completed step (regroup, redo).
    recovery_s: f64,
    /// What checkpointing every 50 steps adds to a step, in percent, measured inside each
    /// checkpointed run: the extra time of the step intervals that hold a checkpoint over the
    /// median interval, spread over the 50 steps (median over rounds). Inside one run, so the
    /// noise of a shared machine largely cancels. Heartbeat progress reports are always on.
    overhead_pct: f64,
    /// The same job with and without checkpoints, run back to back in each round: the median
    /// round's ratio of mean step times, in percent (noisy on a shared machine).
    ab_overhead_pct: f64,
    /// The smallest and largest round's A/B overhead, in percent (the noise of this machine).
    ab_range_pct: (f64, f64),
    /// Mean step time without checkpoints.
    step_s: f64,
}

/// Run a job and return the receive time of each event.
async fn timed_events(job: Job<Mlp, meshwork::demo::Sample>) -> Result<Vec<(Instant, JobEvent)>> {
    let handle = job.spawn().await?;
    let mut stream = handle.events();
    let mut out = Vec::new();
    loop {
        match stream.recv().await {
            Ok(e) => out.push((Instant::now(), e)),
            Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    handle.join().await?;
    Ok(out)
}

fn job(dp: u32, steps: u64) -> meshwork::job::JobBuilder<Mlp, meshwork::demo::Sample> {
    let device = Device::flex();
    device.seed(1);
    let task = TeacherTask {
        d_in: 32,
        d_out: 4,
        noise: 0.1,
        seed: 1,
    };
    Job::builder()
        .initial_model(Mlp::new(&[32, 128, 128, 4], &device))
        .loss(mse_loss)
        .data(task.dataset(16_384))
        .optimizer(AdamConfig::new())
        .learning_rate(3e-3)
        .data_parallel(dp)
        .batch_size(256)
        .steps(steps)
}

/// The overhead of checkpoints every `every` steps inside one run, in percent: the intervals
/// between step events that hold a checkpoint, against the median interval.
fn in_run_overhead(events: &[(Instant, JobEvent)], every: u64) -> f64 {
    let done: Vec<(u64, Instant)> = events
        .iter()
        .filter_map(|(t, e)| match e {
            JobEvent::StepDone(s) if s.step >= 5 => Some((s.step, *t)),
            _ => None,
        })
        .collect();
    let mut plain = Vec::new();
    let mut with = Vec::new();
    for w in done.windows(2) {
        let gap = w[1].1.duration_since(w[0].1).as_secs_f64();
        // The checkpoint of boundary k is taken before step k runs.
        if w[1].0 % every == 0 {
            with.push(gap);
        } else {
            plain.push(gap);
        }
    }
    plain.sort_by(f64::total_cmp);
    let Some(&typical) = plain.get(plain.len() / 2) else {
        return 0.0;
    };
    if with.is_empty() || typical <= 0.0 {
        return 0.0;
    }
    let extra = with.iter().sum::<f64>() / with.len() as f64 - typical;
    extra / every as f64 / typical * 100.0
}

/// Mean time per step between the 5th and the last step's events: everything between steps
/// counts (snapshots, the Supervisor's own work).
fn mean_step(events: &[(Instant, JobEvent)]) -> f64 {
    let done: Vec<(u64, Instant)> = events
        .iter()
        .filter_map(|(t, e)| match e {
            JobEvent::StepDone(s) if s.step >= 5 => Some((s.step, *t)),
            _ => None,
        })
        .collect();
    match (done.first(), done.last()) {
        (Some((a, ta)), Some((b, tb))) if b > a => {
            tb.duration_since(*ta).as_secs_f64() / (b - a) as f64
        }
        _ => 0.0,
    }
}

pub(crate) fn run(dp: u32, steps: u64, rounds: u32) -> Result<RecoveryFigures> {
    if dp < 2 {
        return Err(Error::InvalidConfig(
            "--dp: at least 2 replicas (one is killed)".into(),
        ));
    }
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    runtime.block_on(async move {
        // A replica killed at step 10; collectives bounded at 200 ms.
        let kill_at = 10;
        let plan = FaultPlan::new(0).with(Fault {
            device: dp - 1,
            step: kill_at,
            micro_batch: None,
            phase: Phase::Forward,
            kind: FaultKind::Kill,
        });
        let events = timed_events(
            job(dp, 20)
                .fault_plan(plan)
                .recovery(RecoveryPolicy::shrink())
                .collective_timeout(Duration::from_millis(200))
                .build()?,
        )
        .await?;
        let at = |f: &dyn Fn(&JobEvent) -> bool| events.iter().find(|(_, e)| f(e)).map(|(t, _)| *t);
        let before = at(&|e| matches!(e, JobEvent::StepDone(s) if s.step == kill_at - 1));
        let lost = at(&|e| matches!(e, JobEvent::DeviceLost { .. }));
        let redone = at(&|e| matches!(e, JobEvent::StepDone(s) if s.step == kill_at));
        let (Some(before), Some(lost), Some(redone)) = (before, lost, redone) else {
            return Err(Error::Runtime(
                "the kill was not detected and recovered from".into(),
            ));
        };
        // Checkpoint overhead: the same job with and without checkpoints every 50 steps, in
        // rounds of one run each, alternating which goes first.
        let dir = std::env::temp_dir().join(format!("meshwork-bench-{}", std::process::id()));
        let mut plain = Vec::new();
        let mut checkpointed = Vec::new();
        for round in 0..rounds.max(1) {
            let checkpointed_run = || async {
                let events = timed_events(
                    job(dp, steps)
                        .checkpoint_dir(&dir)
                        .checkpoint_every(50)
                        .keep_checkpoints(1)
                        .build()?,
                )
                .await?;
                Ok::<_, Error>((mean_step(&events), in_run_overhead(&events, 50)))
            };
            if round % 2 == 1 {
                checkpointed.push(checkpointed_run().await?);
                plain.push(mean_step(&timed_events(job(dp, steps).build()?).await?));
                continue;
            }
            plain.push(mean_step(&timed_events(job(dp, steps).build()?).await?));
            checkpointed.push(checkpointed_run().await?);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let mut ratios: Vec<f64> = plain
            .iter()
            .zip(&checkpointed)
            .filter(|(p, _)| **p > 0.0)
            .map(|(p, (c, _))| (c / p - 1.0) * 100.0)
            .collect();
        let mut in_run: Vec<f64> = checkpointed.iter().map(|(_, o)| *o).collect();
        in_run.sort_by(f64::total_cmp);
        ratios.sort_by(f64::total_cmp);
        let median = |v: &[f64]| v.get(v.len() / 2).copied().unwrap_or(0.0);
        let mut sorted_plain = plain.clone();
        sorted_plain.sort_by(f64::total_cmp);
        Ok(RecoveryFigures {
            dp,
            detect_s: lost.duration_since(before).as_secs_f64(),
            recovery_s: redone.duration_since(lost).as_secs_f64(),
            overhead_pct: median(&in_run),
            ab_overhead_pct: median(&ratios),
            ab_range_pct: (
                ratios.first().copied().unwrap_or(0.0),
                ratios.last().copied().unwrap_or(0.0),
            ),
            step_s: median(&sorted_plain),
        })
    })
}

/// Print the figures as a line of text or JSON.
pub(crate) fn print(f: &RecoveryFigures, json: bool) {
    if json {
        println!("{}", serde_json::to_string(f).unwrap_or_default());
    } else {
        println!(
            "recovery dp={}: kill → detected {:.3} s, detected → next step done {:.3} s; checkpoints every 50 steps cost {:+.2} % per step inside a run (A/B runs: {:+.2} %, rounds {:+.2}..{:+.2} %; step {:.4} s)",
            f.dp,
            f.detect_s,
            f.recovery_s,
            f.overhead_pct,
            f.ab_overhead_pct,
            f.ab_range_pct.0,
            f.ab_range_pct.1,
            f.step_s
        );
    }
}
