//! `meshwork bench`: collective bandwidth and data-parallel scaling, as ratios measured
//! inside one run (this machine is shared and noisy).

use meshwork::comm::Algorithm;
use meshwork::comm::bench::Wire;
use meshwork::error::{Error, Result};
use meshwork::parallel::pipeline::Schedule;

use crate::allreduce_bench::{
    allreduce, allreduce_mpi, allreduce_mpi_worker, allreduce_tcp, allreduce_worker,
};
use crate::tensor_bench::TensorBench;

/// The benchmarks.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum BenchCommand {
    /// All-reduce bandwidth (algbw, busbw) against memcpy, for sizes 4 KiB..64 MiB; with
    /// `--transport tcp`, across processes and against one loopback TCP stream; with
    /// `--transport mpi`, 1 KiB..64 MiB on all three transports in one run (in-process, TCP,
    /// MPI under mpirun, and the MPI library's own all-reduce).
    Allreduce {
        /// Ranks in the group: threads of this process (local) or processes (tcp).
        #[arg(long, default_value_t = 2)]
        world: usize,
        /// `local` (one process, shared memory), `tcp` (one process per rank on 127.0.0.1;
        /// needs the `cluster` feature) or `mpi` (all three, the MPI ranks under `mpirun`;
        /// needs the `mpi` feature and OpenMPI).
        #[arg(long, value_enum, default_value_t = TransportArg::Local)]
        transport: TransportArg,
        /// One size only (e.g. 16MiB, 4096, 64K); default: 4 KiB..64 MiB.
        #[arg(long, value_parser = parse_size)]
        bytes: Option<usize>,
        /// Algorithm.
        #[arg(long, value_enum, default_value_t = AlgoArg::Auto)]
        algo: AlgoArg,
        /// Element type: f32, f16, bf16, or f16-narrow / bf16-narrow (16-bit partial sums,
        /// COMM-9); in-process and TCP.
        #[arg(long, default_value = "f32")]
        wire: Wire,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Data-parallel weak scaling: MLP 784-1024-1024-10, batch 64 per replica, against a plain
    /// Burn loop on one thread; each run in its own child process for its peak memory. With
    /// `--transport tcp` (or `mpi`): the demo job in one process against `world` processes
    /// under `mpirun` on the TCP data plane (and on MPI), in one run.
    Dp {
        /// Replicas.
        #[arg(long, default_value_t = 2)]
        world: u32,
        /// `local` (threads of one process against a plain Burn loop), `tcp` (also across
        /// processes under mpirun; needs the `cluster` feature and OpenMPI's mpirun) or `mpi`
        /// (both transports across processes; needs the `mpi` feature).
        #[arg(long, value_enum, default_value_t = TransportArg::Local)]
        transport: TransportArg,
        /// Timed steps (after 3 warm-up steps).
        #[arg(long, default_value_t = 60)]
        steps: u64,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Draw the measured speed-up beside Amdahl's curve for the run's serial fraction
        /// (SVG; in one process).
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
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
    /// The control plane past a handful of ranks: a tiny model on growing numbers of logical
    /// ranks in this process (step time, the Supervisor's control messages per step and per
    /// rank), and the recovery decision at 16,384 simulated ranks.
    Scale {
        /// World sizes, comma-separated.
        #[arg(long, default_value = "64,256,1024", value_delimiter = ',')]
        ranks: Vec<u32>,
        /// Steps of each run.
        #[arg(long, default_value_t = 5)]
        steps: u64,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// (internal) One rank of `bench allreduce --transport mpi`, run under `mpirun`.
    #[command(hide = true)]
    AllreduceMpiWorker {
        /// Sizes in bytes, comma-separated.
        #[arg(long)]
        sizes: String,
        #[arg(long, value_enum)]
        algo: AlgoArg,
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
        #[arg(long, default_value = "f32")]
        wire: Wire,
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
        /// Timed steps (after 2 warm-up steps): enough that a step's noise on a shared
        /// machine does not decide the ratio.
        #[arg(long, default_value_t = 60)]
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
        #[command(flatten)]
        layer: LayerArgs,
        /// Data-parallel replicas. Any of --dp, --pp, --zero or --precision switches to the
        /// recipe's model: the demo GPT on the KJV text with Adam over dp × pp × tp, against
        /// one device at the same global batch, with the bytes per rank against the ZeRO
        /// paper's formula.
        #[arg(long)]
        dp: Option<u32>,
        /// Pipeline stages (the GPT's blocks interleaved over them).
        #[arg(long)]
        pp: Option<u32>,
        /// ZeRO stage, 0 to 3.
        #[arg(long)]
        zero: Option<u8>,
        /// Compute precision: f32, bf16 or f16.
        #[arg(long)]
        precision: Option<meshwork::precision::Precision>,
        /// GPT layers (with a mesh).
        #[arg(long, default_value_t = 2)]
        layers: usize,
        /// Micro-batches per replica's step (with --pp > 1).
        #[arg(long, default_value_t = 4)]
        micro_batches: u32,
        /// Draw the layer's column/row split over the ranks as an SVG picture into this file.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// One optimizer step per parameter: Burn's optimizer and meshwork's flat update rule
    /// (SGD, SGD with momentum, Adam, AdamW) against a memcpy of the bytes the rule touches.
    Optimizer {
        /// Width of the MLP's 4 square layers (about 4·width² parameters).
        #[arg(long, default_value_t = 1024)]
        width: usize,
        /// Timed steps per side (after two warm-up steps); the median is reported.
        #[arg(long, default_value_t = 9)]
        steps: usize,
        /// One JSON object per rule.
        #[arg(long)]
        json: bool,
    },
    /// One GPT transformer layer on one device, per core: samples/s of a meshwork job, of a
    /// plain Burn loop, and the bound the backend's matrix products allow, beside PyTorch on
    /// one thread with `--pytorch` (run it under `taskset -c 0`).
    Layer {
        #[command(flatten)]
        layer: LayerArgs,
        /// A Python interpreter with `torch` installed: also run
        /// `benches/peers/gpt_layer.py` (the same layer in PyTorch, one thread) between
        /// meshwork's runs.
        #[arg(long)]
        pytorch: Option<std::path::PathBuf>,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// The demo GPT end to end at two sizes (d_model 64, 2 layers, context 64, 300 steps;
    /// d_model 256, 4 layers, 8 heads, context 128, 40 steps), at dp 1 and dp 2: windows/s
    /// and validation loss of `meshwork train --model gpt` beside `benches/peers/gpt_ddp.py`
    /// (PyTorch DDP, the same model, data and Adam) with `--pytorch`, and the training FLOP/s
    /// per core against one core's matrix-product rate.
    Gpt {
        /// Which sizes, comma-separated: small, large.
        #[arg(long, value_delimiter = ',', default_values_t = ["small".to_string(), "large".to_string()])]
        sizes: Vec<String>,
        /// Which data-parallel degrees, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [1u32, 2])]
        dp: Vec<u32>,
        /// Steps for every size instead of its own (300 small, 40 large).
        #[arg(long)]
        steps: Option<u64>,
        /// Runs per side, alternated; the median is reported.
        #[arg(long, default_value_t = 1)]
        repeats: usize,
        /// A Python interpreter with `torch` installed: also run `benches/peers/gpt_ddp.py`
        /// after each meshwork run.
        #[arg(long)]
        pytorch: Option<std::path::PathBuf>,
        /// One JSON object per row.
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
        /// Only these methods (comma-separated; sync always runs). Under slow links a
        /// compression may carry its settings, as `--compression` takes them: powersgd:4:10,
        /// topk:0.01.
        #[arg(long, value_delimiter = ',')]
        methods: Vec<String>,
        /// Draw the loss against wall time as an SVG picture into this file.
        #[arg(long)]
        svg: Option<std::path::PathBuf>,
        /// One JSON object per method per line.
        #[arg(long)]
        json: bool,
        /// Where the ranks run: in-process (this process, every rank a thread) or tcp (one
        /// `meshwork node` process per rank, the slow-links scenario only; feature cluster).
        #[arg(long, default_value = "in-process", value_parser = ["in-process", "tcp"])]
        transport: String,
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
/// The GPT layer `bench tensor` and `bench layer` train, and how long they measure it.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct LayerArgs {
    /// Features per token.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Attention heads (must divide --hidden).
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Sequences per step (one micro-batch; with a mesh, the global batch).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Steps per run; the first two (one of two, none of one) are warm-up, not timed.
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Alternated runs of each side; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

impl LayerArgs {
    /// `bench tensor`'s run of this layer at `tp` ranks.
    fn tensor_bench(&self, tp: u32, svg: Option<std::path::PathBuf>) -> TensorBench {
        TensorBench {
            tp,
            hidden: self.hidden,
            heads: self.heads,
            seq: self.seq,
            batch: self.batch,
            steps: self.steps,
            repeats: self.repeats,
            svg,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TransportArg {
    Local,
    Tcp,
    Mpi,
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

pub(crate) fn parse_size(s: &str) -> std::result::Result<usize, String> {
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
            wire,
            json,
        } => allreduce(world, bytes, (algo.into(), wire), json),
        BenchCommand::Allreduce {
            world,
            transport: TransportArg::Tcp,
            bytes,
            algo,
            wire,
            json,
        } => allreduce_tcp(world, bytes, (algo.into(), wire), json),
        BenchCommand::Allreduce {
            transport: TransportArg::Mpi,
            wire,
            ..
        } if wire != Wire::default() => Err(Error::InvalidConfig(format!(
            "--wire {wire} --transport mpi: the MPI bench compares f32 with MPI_Allreduce; use \
             --transport tcp or local"
        ))),
        BenchCommand::Allreduce {
            world,
            transport: TransportArg::Mpi,
            bytes,
            algo,
            json,
            ..
        } => allreduce_mpi(world, bytes, algo.into(), json),
        BenchCommand::AllreduceMpiWorker { sizes, algo } => {
            allreduce_mpi_worker(&sizes, algo.into())
        }
        BenchCommand::AllreduceWorker {
            rank,
            world,
            sizes,
            algo,
            wire,
        } => allreduce_worker(rank, world, &sizes, (algo.into(), wire)),
        BenchCommand::Dp {
            world,
            steps,
            json,
            transport: TransportArg::Local,
            svg,
        } => crate::dp_bench::dp(world, steps, json, svg.as_deref()),
        BenchCommand::Dp {
            world,
            steps,
            json,
            transport,
            ..
        } => dp_across(world, steps, transport == TransportArg::Mpi, json),
        BenchCommand::DpWorker { mode, world, steps } => {
            crate::dp_bench::dp_worker(&mode, world, steps)
        }
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
            layer,
            dp,
            pp,
            zero,
            precision,
            layers,
            micro_batches,
            svg,
            json,
        } => {
            if dp.is_some() || pp.is_some() || zero.is_some() || precision.is_some() {
                let f = crate::layout_bench::run(&crate::layout_bench::LayoutBench {
                    dp: dp.unwrap_or(1),
                    pp: pp.unwrap_or(1),
                    tp,
                    zero: zero.unwrap_or(0),
                    precision: precision.unwrap_or(meshwork::precision::Precision::F32),
                    layers,
                    hidden: layer.hidden,
                    heads: layer.heads,
                    seq: layer.seq,
                    batch: layer.batch,
                    micro_batches,
                    steps: layer.steps,
                    repeats: layer.repeats,
                })?;
                crate::layout_bench::print(&f, json);
                return Ok(());
            }
            let f = crate::tensor_bench::run(&layer.tensor_bench(tp, svg))?;
            crate::tensor_bench::print(&f, json);
            Ok(())
        }
        BenchCommand::Optimizer { width, steps, json } => {
            let f = crate::optimizer_bench::run(&crate::optimizer_bench::OptimizerBench {
                width,
                steps: steps.max(1),
            })?;
            crate::optimizer_bench::print(&f, json);
            Ok(())
        }
        BenchCommand::Layer {
            layer,
            pytorch,
            json,
        } => {
            let f = crate::layer_bench::run(&crate::layer_bench::LayerBench {
                layer: layer.tensor_bench(1, None),
                pytorch,
            })?;
            crate::layer_bench::print(&f, json);
            Ok(())
        }
        BenchCommand::Gpt {
            sizes,
            dp,
            steps,
            repeats,
            pytorch,
            json,
        } => {
            let rows = crate::gpt_bench::run(&crate::gpt_bench::GptBench {
                sizes,
                dps: dp,
                steps,
                repeats,
                pytorch,
            })?;
            crate::gpt_bench::print(&rows, json);
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
            transport,
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
                tcp: transport == "tcp",
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
        BenchCommand::Scale { ranks, steps, json } => {
            let runtime =
                tokio::runtime::Runtime::new().map_err(|e| Error::Runtime(e.to_string()))?;
            let (runs, decisions) = runtime.block_on(crate::scale_bench::run(&ranks, steps))?;
            crate::scale_bench::print(&runs, &decisions, json);
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

#[cfg(feature = "cluster")]
fn dp_across(world: u32, steps: u64, mpi: bool, json: bool) -> Result<()> {
    if world < 2 {
        return Err(Error::InvalidConfig(
            "--world: use 2 or more across processes".into(),
        ));
    }
    if mpi && !cfg!(feature = "mpi") {
        return allreduce_mpi(0, None, Algorithm::Auto, false);
    }
    let runs = crate::dp_across::run(world, steps, mpi)?;
    crate::dp_across::print(world, steps, &runs, json);
    Ok(())
}

#[cfg(not(feature = "cluster"))]
fn dp_across(_: u32, _: u64, _: bool, _: bool) -> Result<()> {
    allreduce_tcp(0, None, (Algorithm::Auto, Wire::default()), false)
}
