//! `meshwork bench`: collective bandwidth and data-parallel scaling, as ratios measured
//! inside one run (this machine is shared and noisy).

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Device;
use meshwork::comm::Algorithm;
use meshwork::comm::bench::all_reduce_bandwidth;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::error::{Error, Result};
use meshwork::events::JobEvent;
use meshwork::job::{EventsError, Job};
use meshwork::parallel::pipeline::Schedule;
use meshwork::parallel::sampler::DistributedSampler;
use serde::{Deserialize, Serialize};

/// The benchmarks.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// All-reduce bandwidth (algbw, busbw) against memcpy, for sizes 4 KiB..64 MiB; with
    /// `--transport tcp`, across processes and against one loopback TCP stream.
    Allreduce {
        /// Ranks in the group: threads of this process (local) or processes (tcp).
        #[arg(long, default_value_t = 2)]
        world: usize,
        /// `local` (one process, shared memory) or `tcp` (one process per rank on 127.0.0.1;
        /// needs the `cluster` feature).
        #[arg(long, value_enum, default_value_t = TransportArg::Local)]
        transport: TransportArg,
        /// One size only (e.g. 16MiB, 4096, 64K); default: 4 KiB..64 MiB.
        #[arg(long, value_parser = parse_size)]
        bytes: Option<usize>,
        /// Algorithm.
        #[arg(long, value_enum, default_value_t = AlgoArg::Auto)]
        algo: AlgoArg,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Data-parallel weak scaling: MLP 784-1024-1024-10, batch 64 per replica, against a plain
    /// Burn loop on one thread; each run in its own child process for its peak memory.
    Dp {
        /// Replicas.
        #[arg(long, default_value_t = 2)]
        world: u32,
        /// Timed steps (after 3 warm-up steps).
        #[arg(long, default_value_t = 60)]
        steps: u64,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Pipeline parallelism: MLP 784 → depth×hidden → 10 (8 × 1024 by default) split into `pp` stage actors (one
    /// device each); samples/s, measured and theoretical bubble, peak stash, activation bytes
    /// per stage.
    Pipeline {
        /// Stages.
        #[arg(long, default_value_t = 2)]
        pp: u32,
        /// Data-parallel replicas of the pipeline.
        #[arg(long, default_value_t = 1)]
        dp: u32,
        /// Micro-batches per step.
        #[arg(long, default_value_t = 8)]
        micro_batches: u32,
        /// gpipe, 1f1b or interleaved.
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Model chunks per stage (interleaved only).
        #[arg(long, default_value_t = 2)]
        virtual_stages: u32,
        /// Global batch size.
        #[arg(long, default_value_t = 64)]
        batch_size: usize,
        /// Width of the hidden layers.
        #[arg(long, default_value_t = 1024)]
        hidden: usize,
        /// Number of hidden layers.
        #[arg(long, default_value_t = 8)]
        depth: usize,
        /// Timed steps (after 2 warm-up steps).
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// How the layers are cut into blocks: `balanced` (by each layer's measured time),
        /// `even` (by count), or layers per block (e.g. `4,5`).
        #[arg(long, default_value = "balanced")]
        split: String,
        /// Write the last timed step's timeline: `.svg` for a picture, `.json` for a Chrome trace.
        #[arg(long)]
        timeline: Option<std::path::PathBuf>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Recovery: time from a killed replica to its detection and to the next completed step
    /// (collective time-out 200 ms), and the per-step cost of checkpoints every 50 steps.
    Recovery {
        /// Replicas (one is killed).
        #[arg(long, default_value_t = 2)]
        dp: u32,
        /// Steps of each overhead run.
        #[arg(long, default_value_t = 600)]
        steps: u64,
        /// Rounds of the overhead measurement (each runs the job with and without
        /// checkpoints); the median round is reported.
        #[arg(long, default_value_t = 7)]
        rounds: u32,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// (internal) One rank of `bench allreduce --transport tcp`, run in a child process.
    #[command(hide = true)]
    AllreduceWorker {
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        world: usize,
        /// Sizes in bytes, comma-separated.
        #[arg(long)]
        sizes: String,
        #[arg(long, value_enum)]
        algo: AlgoArg,
    },
    /// Memory per data-parallel rank under ZeRO stage 0 to 3, with or without per-block
    /// recomputation (peak parameters, full and sharded, gradients, optimizer state and
    /// activations, counted by the worker) against the ZeRO paper's figures, with peak RSS
    /// and samples/s against plain data parallelism over the same blocks; the demo MLP as
    /// one-layer blocks, with Adam.
    Memory {
        /// Data-parallel replicas.
        #[arg(long, default_value_t = 2)]
        dp: u32,
        /// ZeRO stage: 0, 1, 2 or 3.
        #[arg(long, default_value_t = 2)]
        zero: u8,
        /// Width of the demo MLP's hidden layers (1024 with --depth 2: about 1.1 million
        /// parameters).
        #[arg(long, default_value_t = 1024)]
        hidden: usize,
        /// Hidden layers of the demo MLP (one block per layer).
        #[arg(long, default_value_t = 2)]
        depth: usize,
        /// Keep only each block's input and recompute its forward during backward.
        #[arg(long)]
        recompute: bool,
        /// What forward and backward compute in: f32, bf16 or f16 (f32 master weights).
        #[arg(long, default_value = "f32")]
        precision: meshwork::precision::Precision,
        /// Blocks whose parameters may be gathered ahead of the one computing (ZeRO-3
        /// prefetch; 0: no overlap).
        #[arg(long, default_value_t = 1)]
        in_flight: usize,
        /// Timed steps (after 2 warm-up steps).
        #[arg(long, default_value_t = 10)]
        steps: u64,
        /// Global batch size.
        #[arg(long, default_value_t = 128)]
        batch_size: usize,
        /// Draw one rank's bytes over the last step (this run above plain data parallel) as
        /// an SVG picture into this file.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Tensor parallelism: one GPT transformer layer (attention split by heads, MLP column
    /// then row) over `tp` ranks against tp 1, alternated runs, median: samples/s, the
    /// activation bytes all-reduced per layer per micro-batch against Megatron's figure, and
    /// the share of the step spent in the group's collectives.
    Tensor {
        /// Tensor-parallel ranks (must divide --heads).
        #[arg(long, default_value_t = 2)]
        tp: u32,
        /// Features per token.
        #[arg(long, default_value_t = 1024)]
        hidden: usize,
        /// Attention heads (must divide --hidden).
        #[arg(long, default_value_t = 16)]
        heads: usize,
        /// Sequence length.
        #[arg(long, default_value_t = 64)]
        seq: usize,
        /// Sequences per step (one micro-batch).
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Steps per run; the first two (one of two, none of one) are warm-up, not timed.
        #[arg(long, default_value_t = 6)]
        steps: u64,
        /// Alternated runs of each side; the median is reported.
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Draw the layer's column/row split over the ranks as an SVG picture into this file.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Training over slow and uneven networks: 4 ranks of the demo MLP to a target loss,
    /// synchronous data parallelism against the compressors and the methods that synchronise
    /// less often under emulated slow links, and against the parameter server and backup
    /// workers with one slow rank; time and steps to the target, bytes per rank, final loss.
    CommEfficiency {
        /// Every rank's emulated link bandwidth (e.g. 100MB/s, 1Gb/s).
        #[arg(long, default_value = "100MB/s", value_parser = parse_bandwidth)]
        link_bandwidth: f64,
        /// Every rank's emulated link latency (e.g. 2ms, 500us).
        #[arg(long, default_value = "2ms", value_parser = parse_latency)]
        link_latency: std::time::Duration,
        /// How many times slower the slow rank computes (slow-rank scenario).
        #[arg(long, default_value_t = 3.0)]
        slow_factor: f64,
        /// Steps of every run.
        #[arg(long, default_value_t = 120)]
        steps: u64,
        /// Global batch size (all 4 ranks) under slow links.
        #[arg(long, default_value_t = 16)]
        batch_size: usize,
        /// Global batch size (all 4 ranks) with the slow rank.
        #[arg(long, default_value_t = 2048)]
        slow_rank_batch_size: usize,
        /// Width of the MLP's two hidden layers.
        #[arg(long, default_value_t = 1024)]
        hidden: usize,
        /// The target loss (default: the loss sync reaches after 60 % of its steps).
        #[arg(long)]
        target_loss: Option<f32>,
        /// Only these methods (comma-separated; sync always runs).
        #[arg(long, value_delimiter = ',')]
        methods: Vec<String>,
        /// Draw the loss against wall time as an SVG picture into this file.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// One JSON object per method per line.
        #[arg(long)]
        json: bool,
    },
    /// (internal) One side of `bench memory`, run in a child process.
    #[command(hide = true)]
    MemoryWorker {
        #[arg(long)]
        dp: u32,
        #[arg(long)]
        zero: u8,
        #[arg(long)]
        hidden: usize,
        #[arg(long)]
        depth: usize,
        #[arg(long)]
        recompute: bool,
        #[arg(long)]
        precision: meshwork::precision::Precision,
        #[arg(long)]
        in_flight: usize,
        #[arg(long)]
        steps: u64,
        #[arg(long)]
        batch_size: usize,
    },
    /// (internal) One side of `bench dp`, run in a child process.
    #[command(hide = true)]
    DpWorker {
        /// "dp", "baseline" or "independent".
        #[arg(long)]
        mode: String,
        #[arg(long)]
        world: u32,
        #[arg(long)]
        steps: u64,
    },
}

/// Transport choice on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TransportArg {
    Local,
    Tcp,
}

/// Algorithm choice on the command line.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum AlgoArg {
    Ring,
    Tree,
    Direct,
    Auto,
}

impl From<AlgoArg> for Algorithm {
    fn from(a: AlgoArg) -> Self {
        match a {
            AlgoArg::Ring => Algorithm::Ring,
            AlgoArg::Tree => Algorithm::Tree,
            AlgoArg::Direct => Algorithm::Direct,
            AlgoArg::Auto => Algorithm::Auto,
        }
    }
}

/// `16MiB`, `64K`, `4096` → bytes.
fn parse_bandwidth(s: &str) -> std::result::Result<f64, String> {
    meshwork::comm::emulate::parse_bandwidth(s).map_err(|e| e.to_string())
}

fn parse_latency(s: &str) -> std::result::Result<std::time::Duration, String> {
    meshwork::comm::emulate::parse_latency(s).map_err(|e| e.to_string())
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        u => return Err(format!("unknown size unit {u:?}: use K, M or G")),
    };
    n.checked_mul(mul)
        .ok_or_else(|| format!("size too large: {s:?}"))
}

pub(crate) fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Allreduce {
            world,
            transport: TransportArg::Local,
            bytes,
            algo,
            json,
        } => allreduce(world, bytes, algo.into(), json),
        BenchCommand::Allreduce {
            world,
            transport: TransportArg::Tcp,
            bytes,
            algo,
            json,
        } => allreduce_tcp(world, bytes, algo.into(), json),
        BenchCommand::AllreduceWorker {
            rank,
            world,
            sizes,
            algo,
        } => allreduce_worker(rank, world, &sizes, algo.into()),
        BenchCommand::Dp { world, steps, json } => dp(world, steps, json),
        BenchCommand::DpWorker { mode, world, steps } => dp_worker(&mode, world, steps),
        BenchCommand::Memory {
            dp,
            zero,
            hidden,
            depth,
            recompute,
            precision,
            in_flight,
            steps,
            batch_size,
            svg,
            json,
        } => crate::memory_bench::run(
            crate::memory_bench::MemoryBench {
                dp,
                zero,
                hidden,
                depth,
                recompute,
                precision,
                in_flight,
                steps,
                batch_size,
                svg,
            },
            json,
        ),
        BenchCommand::MemoryWorker {
            dp,
            zero,
            hidden,
            depth,
            recompute,
            precision,
            in_flight,
            steps,
            batch_size,
        } => crate::memory_bench::worker(crate::memory_bench::MemoryBench {
            dp,
            zero,
            hidden,
            depth,
            recompute,
            precision,
            in_flight,
            steps,
            batch_size,
            svg: None,
        }),
        BenchCommand::Tensor {
            tp,
            hidden,
            heads,
            seq,
            batch,
            steps,
            repeats,
            svg,
            json,
        } => {
            let f = crate::tensor_bench::run(&crate::tensor_bench::TensorBench {
                tp,
                hidden,
                heads,
                seq,
                batch,
                steps,
                repeats,
                svg,
            })?;
            crate::tensor_bench::print(&f, json);
            Ok(())
        }
        BenchCommand::CommEfficiency {
            link_bandwidth,
            link_latency,
            slow_factor,
            steps,
            batch_size,
            slow_rank_batch_size,
            hidden,
            target_loss,
            methods,
            svg,
            json,
        } => {
            let link = meshwork::comm::emulate::LinkEmulation::new(link_bandwidth, link_latency)
                .map_err(|e| Error::InvalidConfig(e.to_string()))?;
            let b = crate::comm_bench::CommBench {
                link,
                slow_factor,
                steps,
                batch_size,
                slow_rank_batch_size,
                hidden,
                target: target_loss,
                only: methods,
                svg,
            };
            let runs = crate::comm_bench::run(&b)?;
            if json {
                for r in &runs {
                    let line = serde_json::to_string(r)
                        .map_err(|e| Error::Runtime(format!("JSON: {e}")))?;
                    println!("{line}");
                }
            } else {
                crate::comm_bench::print_table(&b, &runs);
            }
            Ok(())
        }
        BenchCommand::Recovery {
            dp,
            steps,
            rounds,
            json,
        } => {
            let f = crate::recovery_bench::run(dp, steps, rounds)?;
            crate::recovery_bench::print(&f, json);
            Ok(())
        }
        BenchCommand::Pipeline {
            pp,
            dp,
            micro_batches,
            schedule,
            virtual_stages,
            batch_size,
            hidden,
            depth,
            steps,
            split,
            timeline,
            json,
        } => {
            let schedule = Schedule::from_name(&schedule, micro_batches, virtual_stages)
                .ok_or_else(|| {
                    Error::InvalidConfig(format!(
                        "--schedule {schedule}: gpipe, 1f1b or interleaved"
                    ))
                })?;
            let split: crate::pipeline_bench::Split = split.parse()?;
            let f = crate::pipeline_bench::run(
                crate::pipeline_bench::PipelineBench {
                    pp,
                    dp,
                    schedule,
                    batch: batch_size,
                    hidden,
                    depth,
                    steps,
                    split,
                },
                timeline.as_deref(),
            )?;
            crate::pipeline_bench::print(&f, json);
            Ok(())
        }
    }
}

fn sizes(bytes: Option<usize>) -> Vec<usize> {
    match bytes {
        Some(b) => vec![b],
        None => (12..=26).map(|p| 1usize << p).collect(),
    }
}

#[cfg(feature = "cluster")]
fn allreduce_tcp(world: usize, bytes: Option<usize>, algo: Algorithm, json: bool) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidConfig("--world 0: use at least 1".into()));
    }
    crate::tcp_bench::run(world, &sizes(bytes), algo, json)
}

#[cfg(feature = "cluster")]
fn allreduce_worker(rank: u32, world: usize, sizes: &str, algo: Algorithm) -> Result<()> {
    let sizes = sizes
        .split(',')
        .map(|s| {
            s.parse()
                .map_err(|_| Error::InvalidConfig(format!("--sizes: {s:?} is not a size")))
        })
        .collect::<Result<Vec<usize>>>()?;
    crate::tcp_bench::worker(rank, world, &sizes, algo)
}

#[cfg(not(feature = "cluster"))]
fn allreduce_tcp(_: usize, _: Option<usize>, _: Algorithm, _: bool) -> Result<()> {
    Err(Error::InvalidConfig(
        "--transport tcp needs meshwork built with the `cluster` feature \
         (cargo run --release --features cluster -- bench allreduce --transport tcp)"
            .into(),
    ))
}

#[cfg(not(feature = "cluster"))]
fn allreduce_worker(_: u32, _: usize, _: &str, _: Algorithm) -> Result<()> {
    allreduce_tcp(0, None, Algorithm::Auto, false)
}

fn allreduce(world: usize, bytes: Option<usize>, algo: Algorithm, json: bool) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidConfig("--world 0: use at least 1".into()));
    }
    let sizes = sizes(bytes);
    if !json {
        println!(
            "# all_reduce, world {world}, f32, sum; GB/s = 1e9 bytes/s; busbw = algbw·2(N−1)/N"
        );
        println!(
            "{:>12} {:>8} {:>10} {:>10} {:>10} {:>11}",
            "bytes", "algo", "time_us", "algbw", "busbw", "busbw/mcpy"
        );
    }
    for b in sizes {
        let iterations = ((256usize << 20) / b.max(1)).clamp(5, 200);
        let f = all_reduce_bandwidth(world, b, algo, iterations)?;
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "world": f.world, "bytes": f.bytes, "algo": f.algorithm.to_string(),
                    "algbw_gbps": f.algbw_gbps, "busbw_gbps": f.busbw_gbps,
                    "memcpy_gbps": f.memcpy_gbps, "time_us": f.seconds_median * 1e6,
                })
            );
        } else {
            println!(
                "{:>12} {:>8} {:>10.1} {:>10.2} {:>10.2} {:>11.2}",
                f.bytes,
                f.algorithm.to_string(),
                f.seconds_median * 1e6,
                f.algbw_gbps,
                f.busbw_gbps,
                f.busbw_gbps / f.memcpy_gbps.max(1e-12)
            );
        }
    }
    Ok(())
}

/// What a `dp-worker` child prints.
#[derive(Debug, Serialize, Deserialize)]
struct WorkerReport {
    samples_per_s: f64,
    peak_rss_bytes: u64,
    /// Shares of a step's time (compute, communication, waiting); dp mode only.
    #[serde(default)]
    shares: Option<(f64, f64, f64)>,
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

fn dp(world: u32, steps: u64, json: bool) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })?;
    // Both sides get the same allocator settings: with glibc's adaptive mmap threshold, which
    // side happens to page-fault on its multi-MiB buffers every step varies from run to run
    // and would swamp the comparison. A user's own setting is kept.
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_else(|_| {
        "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456".into()
    });
    let child = |mode: &str| -> Result<WorkerReport> {
        let out = Command::new(&exe)
            .env("GLIBC_TUNABLES", &tunables)
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
            })
        );
    } else {
        println!(
            "# dp weak scaling: MLP 784-1024-1024-10, batch {LOCAL_BATCH}/replica, {steps} steps, \
             median of {ROUNDS} alternated runs per side; GLIBC_TUNABLES={tunables}"
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
        println!(
            "peak RSS: {:.1} MiB vs {:.1} MiB (ratio {:.3})",
            run.peak_rss_bytes as f64 / 1048576.0,
            baseline.peak_rss_bytes as f64 / 1048576.0,
            run.peak_rss_bytes as f64 / baseline.peak_rss_bytes.max(1) as f64
        );
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

fn dp_worker(mode: &str, world: u32, steps: u64) -> Result<()> {
    let total = steps + WARMUP;
    let global = LOCAL_BATCH * world as usize;
    let (samples_per_s, shares) = match mode {
        // On a spawned thread like meshwork's devices: on the main thread glibc serves the
        // multi-MiB buffers by mmap and the same loop runs markedly slower.
        "baseline" => (
            std::thread::spawn(move || baseline_loop(total, LOCAL_BATCH))
                .join()
                .map_err(|_| Error::Runtime("the baseline loop panicked".into()))?,
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
            (sum, None)
        }
        "dp" => {
            let runtime =
                tokio::runtime::Runtime::new().map_err(|e| Error::Runtime(e.to_string()))?;
            let (rate, shares) = runtime.block_on(dp_job(world, total, global))?;
            (rate, Some(shares))
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

async fn dp_job(world: u32, total: u64, global: usize) -> Result<(f64, (f64, f64, f64))> {
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
    Ok((samples as f64 / wall.max(1e-12), time.shares()))
}
