//! `meshwork bench dp`: data-parallel weak scaling of the demo MLP against a plain Burn loop
//! on one device, each side in a child process of its own, alternated, median of the rounds.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Device;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::error::{Error, Result};
use meshwork::events::JobEvent;
use meshwork::job::{EventsError, Job};
use meshwork::parallel::sampler::DistributedSampler;
use meshwork::scaling::{Amdahl, REPORTED_DEVICES};
use serde::{Deserialize, Serialize};

/// What a `dp-worker` child prints.
#[derive(Debug, Serialize, Deserialize)]
struct WorkerReport {
    samples_per_s: f64,
    peak_rss_bytes: u64,
    /// Shares of a step's time (compute, communication, waiting); dp mode only.
    #[serde(default)]
    shares: Option<(f64, f64, f64)>,
    /// The run's serial fraction (dp mode only).
    #[serde(default)]
    amdahl: Option<Amdahl>,
}

const WIDTHS: [usize; 4] = [784, 1024, 1024, 10];
const LOCAL_BATCH: usize = 64;
const WARMUP: u64 = 3;
/// Runs of each side in `bench dp`; each side reports its median run.
const ROUNDS: usize = 5;

fn median_run(mut runs: Vec<WorkerReport>) -> WorkerReport {
    runs.sort_by(|a, b| a.samples_per_s.total_cmp(&b.samples_per_s));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
}

fn bench_data(samples: usize) -> meshwork::data::InMemoryDataset<Sample> {
    TeacherTask {
        d_in: WIDTHS[0],
        d_out: WIDTHS[3],
        noise: 0.1,
        seed: 1,
    }
    .dataset(samples)
}

pub(crate) fn dp(world: u32, steps: u64, json: bool, svg: Option<&Path>) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })?;
    let child = |mode: &str| -> Result<WorkerReport> {
        let out = Command::new(&exe)
            .args(["bench", "dp-worker", "--mode", mode])
            .args(["--world", &world.to_string(), "--steps", &steps.to_string()])
            .output()
            .map_err(|e| Error::Io {
                path: exe.display().to_string(),
                reason: e.to_string(),
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().last().unwrap_or_default();
        serde_json::from_str(line).map_err(|e| {
            Error::Runtime(format!(
                "bench child ({mode}) gave no report ({e}); stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        })
    };
    // Alternate the two sides and keep each one's median run: the machine is shared and noisy.
    let mut baselines = Vec::new();
    let mut runs = Vec::new();
    let mut ceilings = Vec::new();
    for _ in 0..ROUNDS {
        baselines.push(child("baseline")?);
        runs.push(child("dp")?);
        if world > 1 {
            ceilings.push(child("independent")?);
        }
    }
    let baseline = median_run(baselines);
    let run = median_run(runs);
    let ceiling = (!ceilings.is_empty()).then(|| median_run(ceilings).samples_per_s);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "world": world,
                "samples_per_s": run.samples_per_s,
                "baseline_samples_per_s": baseline.samples_per_s,
                "speedup": run.samples_per_s / baseline.samples_per_s,
                "independent_loops_samples_per_s": ceiling,
                "peak_rss_bytes": run.peak_rss_bytes,
                "baseline_peak_rss_bytes": baseline.peak_rss_bytes,
                "compute_share": run.shares.map(|s| s.0),
                "communication_share": run.shares.map(|s| s.1),
                "waiting_share": run.shares.map(|s| s.2),
                "serial_fraction": run.amdahl.map(|a| a.serial_fraction),
                "amdahl_speedup_at": run.amdahl.map(|a| {
                    REPORTED_DEVICES.map(|n| (n, a.speedup(f64::from(n))))
                }),
            })
        );
    } else {
        println!(
            "# dp weak scaling: MLP 784-1024-1024-10, batch {LOCAL_BATCH}/replica, {steps} steps, \
             median of {ROUNDS} alternated runs per side"
        );
        println!(
            "world {world}: {:.0} samples/s; plain Burn loop (1 thread): {:.0} samples/s; ratio {:.3}",
            run.samples_per_s,
            baseline.samples_per_s,
            run.samples_per_s / baseline.samples_per_s
        );
        if let Some(c) = ceiling {
            println!(
                "{world} independent plain loops at once (no communication; the machine's ceiling): \
                 {c:.0} samples/s, ratio {:.3}; meshwork reaches {:.0}% of it",
                c / baseline.samples_per_s,
                100.0 * run.samples_per_s / c
            );
        }
        if let Some((c, m, w)) = run.shares {
            println!(
                "step time: compute {:.0}%, communication {:.0}%, waiting {:.0}%",
                c * 100.0,
                m * 100.0,
                w * 100.0
            );
        }
        if let Some(a) = run.amdahl {
            println!("{a}");
        }
        println!(
            "peak RSS: {:.1} MiB vs {:.1} MiB (ratio {:.3})",
            run.peak_rss_bytes as f64 / 1048576.0,
            baseline.peak_rss_bytes as f64 / 1048576.0,
            run.peak_rss_bytes as f64 / baseline.peak_rss_bytes.max(1) as f64
        );
    }
    if let (Some(path), Some(amdahl)) = (svg, run.amdahl) {
        let speedup = run.samples_per_s / baseline.samples_per_s;
        let mut points = vec![("meshwork dp", f64::from(world), speedup)];
        if let Some(c) = ceiling {
            points.push((
                "independent loops",
                f64::from(world),
                c / baseline.samples_per_s,
            ));
        }
        std::fs::write(path, crate::scaling_svg::render(&amdahl, &points)).map_err(|e| {
            Error::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            }
        })?;
        if !json {
            println!("scaling picture written to {}", path.display());
        }
    }
    Ok(())
}

pub(crate) fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

pub(crate) fn dp_worker(mode: &str, world: u32, steps: u64) -> Result<()> {
    let total = steps + WARMUP;
    let global = LOCAL_BATCH * world as usize;
    let (samples_per_s, shares, amdahl) = match mode {
        // On a spawned thread, like meshwork's devices.
        "baseline" => (
            std::thread::spawn(move || baseline_loop(total, LOCAL_BATCH))
                .join()
                .map_err(|_| Error::Runtime("the baseline loop panicked".into()))?,
            None,
            None,
        ),
        // The machine's own ceiling: `world` plain loops on `world` threads at once, no
        // communication at all.
        "independent" => {
            let threads: Vec<_> = (0..world)
                .map(|_| std::thread::spawn(move || baseline_loop(total, LOCAL_BATCH)))
                .collect();
            let mut sum = 0.0;
            for t in threads {
                sum += t
                    .join()
                    .map_err(|_| Error::Runtime("a plain loop panicked".into()))?;
            }
            (sum, None, None)
        }
        "dp" => {
            let runtime =
                tokio::runtime::Runtime::new().map_err(|e| Error::Runtime(e.to_string()))?;
            let (rate, shares, amdahl) = runtime.block_on(dp_job(world, total, global))?;
            (rate, Some(shares), amdahl)
        }
        other => {
            return Err(Error::InvalidConfig(format!(
                "unknown mode {other:?}: dp or baseline"
            )));
        }
    };
    let report = WorkerReport {
        samples_per_s,
        peak_rss_bytes: peak_rss_bytes(),
        shares,
        amdahl,
    };
    let mut out = std::io::stdout();
    let _ = writeln!(
        out,
        "{}",
        serde_json::to_string(&report).unwrap_or_default()
    );
    Ok(())
}

/// The plain Burn loop on this thread: forward, backward, SGD step.
fn baseline_loop(total: u64, batch: usize) -> f64 {
    let device = Device::flex();
    let ad = device.clone().autodiff();
    // The same data and batch order as a one-replica job reads.
    let data = bench_data(batch * 4);
    let sampler = DistributedSampler::new(batch * 4, batch, 0).expect("valid sampler");
    let mut model = Mlp::new(&WIDTHS, &device).fork(&ad).train();
    let mut optim = SgdConfig::new().init();
    let mut timed = Duration::ZERO;
    for step in 0..total {
        let t = Instant::now();
        let items: Vec<Sample> = sampler
            .global_batch(step)
            .into_iter()
            .filter_map(|i| meshwork::data::Dataset::get(&data, i))
            .collect();
        let loss = mse_loss(&model, &items, &ad);
        let _: f32 = loss.clone().into_scalar();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.01, model, grads);
        if step >= WARMUP {
            timed += t.elapsed();
        }
    }
    (batch as u64 * (total - WARMUP)) as f64 / timed.as_secs_f64()
}

use burn::module::Module;

async fn dp_job(
    world: u32,
    total: u64,
    global: usize,
) -> Result<(f64, (f64, f64, f64), Option<Amdahl>)> {
    let job = Job::builder()
        .model(|ctx| Mlp::new(&WIDTHS, &ctx.device))
        .loss(mse_loss)
        .data(bench_data(global * 4))
        .optimizer(SgdConfig::new())
        .learning_rate(0.01)
        .data_parallel(world)
        .batch_size(global)
        .steps(total)
        .build()?;
    let handle = job.spawn().await?;
    let mut events = handle.events();
    let mut samples = 0u64;
    let mut wall = 0.0f64;
    let mut time = meshwork::trace::TimeBreakdown::default();
    loop {
        match events.recv().await {
            Ok(JobEvent::StepDone(s)) if s.step >= WARMUP => {
                samples += s
                    .replicas
                    .iter()
                    .map(|r| r.sample_ids.len() as u64)
                    .sum::<u64>();
                wall += s.wall_s;
                for r in &s.replicas {
                    time = time.plus(r.breakdown);
                }
            }
            Ok(_) | Err(EventsError::Missed(_)) => {}
            Err(EventsError::Closed) => break,
        }
    }
    handle.join().await?;
    let compute_per_rank = time.compute_s / f64::from(world.max(1));
    let amdahl = Amdahl::from_times(wall, compute_per_rank, world);
    Ok((samples as f64 / wall.max(1e-12), time.shares(), amdahl))
}
