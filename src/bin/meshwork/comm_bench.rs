//! `meshwork bench comm-efficiency`: the methods for slow and uneven networks, trained on the
//! demo task with 4 ranks under an emulated network, to a target loss.
//!
//! Two scenarios, each in this one process, method after method, from the same initial
//! model, data and seed:
//! - **slow links**: every rank's link emulated (`--link-bandwidth`, `--link-latency`,
//!   `comm::emulate`): synchronous data parallelism (`sync`) against the compressors and the
//!   methods that synchronise less often;
//! - **slow rank**: no emulation, one rank's forwards and backwards `--slow-factor` times as
//!   long (a `FaultPlan` `Slow` fault): `sync` against the parameter server and backup
//!   workers.
//!
//! With `--transport tcp` (feature `cluster`) the slow-links scenario runs over real
//! processes instead: this process is the head and starts [`WORLD`] `meshwork node` processes
//! per method, one rank each, the emulated link on every rank's TCP sends (the job spec
//! carries it, with the method); the job is `meshwork train`'s demo job (its data, from the
//! same seed). The slow-rank scenario is left out there: its methods (the parameter server,
//! backup workers) run across processes, but the scenario trains with SGD with momentum, and
//! the job spec carries no optimizer (every process's code sets it; the demo job's is Adam).
//!
//! Per method: the wall time and the steps until the loss (the mean of the last
//! [`SMOOTH`] steps' losses) first reaches the target, the bytes each rank's transport sent
//! (mean over ranks, the whole run), and the final loss (the same mean at the end). The
//! target is `--target-loss`, or by default the loss `sync` reaches after [`TARGET_AT`] of
//! its steps in the slow-links scenario. Time counts from the replicas' initial broadcast to
//! the step's `StepDone`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, SgdConfig};
use burn::tensor::Device;
use meshwork::comm::PartialSums;
use meshwork::comm::emulate::LinkEmulation;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::error::{Error, Result};
use meshwork::events::JobEvent;
use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
use meshwork::job::{Job, JobBuilder};
use meshwork::parallel::compress::Compression;
use meshwork::parallel::local::LocalUpdates;
use meshwork::parallel::parameter_server::{ParameterServer, Staleness};
use serde::Serialize;

/// Steps whose losses are averaged into the loss that is compared with the target.
pub(crate) const SMOOTH: usize = 5;
/// The default target: the loss `sync` reaches after this share of its steps.
const TARGET_AT: f64 = 0.6;
/// Ranks.
const WORLD: u32 = 4;
/// The learning rate of SGD with momentum in the slow-rank scenario.
const SLOW_RANK_LR: f64 = 0.02;
/// Micro-batches per replica per step in the slow-rank scenario (every method alike).
const MICRO_BATCHES: u32 = 4;
/// Steps between the synchronisations of local SGD and DiLoCo (`--steps` must be a multiple).
const LOCAL_EVERY: u32 = 8;

/// What `bench comm-efficiency` is asked.
#[derive(Debug, Clone)]
pub(crate) struct CommBench {
    pub(crate) link: LinkEmulation,
    /// How many times slower the slow rank computes in the slow-rank scenario.
    pub(crate) slow_factor: f64,
    /// Steps of every run.
    pub(crate) steps: u64,
    /// Global batch (all ranks) in the slow-links scenario: small, so that the network
    /// dominates the step.
    pub(crate) batch_size: usize,
    /// Global batch in the slow-rank scenario: large, so that compute dominates the step.
    pub(crate) slow_rank_batch_size: usize,
    /// Width of the demo MLP's two hidden layers.
    pub(crate) hidden: usize,
    /// The target loss (default: see the module docs).
    pub(crate) target: Option<f32>,
    /// Only these methods (by name); empty: all.
    pub(crate) only: Vec<String>,
    /// Draw the loss against wall time into this file.
    pub(crate) svg: Option<PathBuf>,
    /// Run over real processes and TCP (`--transport tcp`) instead of in this process.
    pub(crate) tcp: bool,
}

/// One method's run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MethodRun {
    pub(crate) method: String,
    pub(crate) scenario: &'static str,
    pub(crate) time_to_target_s: Option<f64>,
    pub(crate) steps_to_target: Option<u64>,
    pub(crate) bytes_per_rank: u64,
    pub(crate) final_loss: f32,
    /// Its time to the target over `sync`'s in the same scenario.
    pub(crate) time_vs_sync: Option<f64>,
    /// The scenario's target loss.
    pub(crate) target_loss: f32,
    #[serde(skip)]
    pub(crate) curve: Vec<(f64, f32)>,
}

/// The scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    SlowLinks,
    SlowRank,
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::SlowLinks => "slow-links",
            Scenario::SlowRank => "slow-rank",
        }
    }

    /// The methods this scenario compares (`sync` first).
    fn methods(self) -> &'static [&'static str] {
        match self {
            Scenario::SlowLinks => &[
                "sync",
                "bf16",
                "bf16-narrow",
                "topk",
                "powersgd",
                "powersgd:8:10",
                "local-sgd",
                "diloco",
                "easgd",
            ],
            Scenario::SlowRank => &["sync", "ssp-0", "ssp-2", "async", "backup"],
        }
    }
}

fn task() -> TeacherTask {
    TeacherTask {
        d_in: 32,
        d_out: 8,
        noise: 0.1,
        seed: 21,
    }
}

fn initial_model(hidden: usize) -> Mlp {
    let device = Device::flex();
    device.seed(9);
    Mlp::new(&[32, hidden, hidden, 8], &device)
}

/// The job every method shares: the demo MLP, Adam unless the method says otherwise, 4 ranks.
fn base(b: &CommBench, init: &Mlp) -> JobBuilder<Mlp, Sample> {
    Job::builder()
        .initial_model(init.clone())
        .loss(mse_loss)
        .data(task().dataset(4096))
        .optimizer(AdamConfig::new())
        .learning_rate(1e-3)
        .data_parallel(WORLD)
        .batch_size(b.batch_size)
        .steps(b.steps)
        .seed(5)
        .collective_timeout(Duration::from_secs(300))
        .step_timeout(Duration::from_secs(600))
}

/// How a slow-links method exchanges its gradients or parameters: its compression, its
/// local-update rule and how 16-bit partial sums travel; `None` for a name that is not a
/// slow-links method.
fn slow_links_method(method: &str) -> Option<(Compression, Option<LocalUpdates>, PartialSums)> {
    let compress = |c| Some((c, None, PartialSums::F32));
    let local = |u| Some((Compression::None, Some(u), PartialSums::F32));
    match method {
        "sync" => compress(Compression::None),
        "bf16" => compress(Compression::Bf16),
        // COMM-9: bf16 with 16-bit partial sums (4 bytes an element per ring pass, not 6).
        "bf16-narrow" => Some((Compression::Bf16, None, PartialSums::Narrow)),
        "topk" => compress(Compression::TopK { fraction: 0.1 }),
        "powersgd" => compress(Compression::PowerSgd {
            rank: 2,
            start_after: 10,
        }),
        "local-sgd" => local(LocalUpdates::local_sgd(LOCAL_EVERY)),
        "diloco" => local(LocalUpdates::DiLoCo {
            every: LOCAL_EVERY,
            outer_lr: 0.7,
            outer_momentum: 0.5,
            nesterov: true,
        }),
        "easgd" => local(LocalUpdates::easgd(4, 0.2)),
        // Any other compression by its `--compression` name (`powersgd:4:10`, `topk:0.01`).
        other => other
            .parse::<Compression>()
            .ok()
            .map(|c| (c, None, PartialSums::F32)),
    }
}

/// `builder` set up for `method`; `None` for a name this build does not know.
fn configure(method: &str, builder: JobBuilder<Mlp, Sample>) -> Option<JobBuilder<Mlp, Sample>> {
    if let Some((compression, local, partial_sums)) = slow_links_method(method) {
        let builder = builder.compression(compression).partial_sums(partial_sums);
        return Some(match local {
            Some(u) => builder.local_updates(u),
            None => builder,
        });
    }
    Some(match method {
        "ssp-0" => builder.parameter_server(ParameterServer::new(Staleness::Bounded(0))),
        "ssp-2" => builder.parameter_server(ParameterServer::new(Staleness::Bounded(2))),
        "async" => builder.parameter_server(ParameterServer::new(Staleness::Unbounded)),
        "backup" => builder.backup_workers(1),
        _ => return None,
    })
}

/// Runs one method in one scenario; the curve is (seconds since the replicas were
/// synchronised, step loss) per step, and the bytes the mean over ranks of their sent bytes.
fn run_method(
    b: &CommBench,
    init: &Mlp,
    method: &str,
    scenario: Scenario,
) -> Result<(Vec<(f64, f32)>, u64)> {
    let mut builder = base(b, init);
    match scenario {
        Scenario::SlowLinks => builder = builder.link_emulation(b.link.clone()),
        Scenario::SlowRank => {
            // Items of a parameter-server round are micro-batches: a fast worker takes more.
            // SGD with momentum: an asynchronous server applies every item's gradient, and
            // Adam would normalise each of those small steps into a full one.
            builder = builder
                .batch_size(b.slow_rank_batch_size)
                .optimizer(SgdConfig::new().with_momentum(Some(MomentumConfig::new())))
                .learning_rate(SLOW_RANK_LR)
                .gradient_accumulation(MICRO_BATCHES)
                .fault_plan(FaultPlan::new(1).with(Fault {
                    device: WORLD - 1,
                    step: 0,
                    micro_batch: None,
                    phase: Phase::Forward,
                    kind: FaultKind::Slow {
                        factor: b.slow_factor,
                    },
                }))
        }
    }
    let job = configure(method, builder)
        .ok_or_else(|| Error::InvalidConfig(format!("bench comm-efficiency: no method {method}")))?
        .build()?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::Runtime(e.to_string()))?;
    runtime.block_on(async move {
        let mut curve = Curve::default();
        crate::demo_job::watch(job.spawn().await?, &mut |e| curve.see(e)).await?;
        Ok((curve.points, curve.bytes))
    })
}

/// What a run's events make of its curve and bytes (see [`run_method`]).
#[derive(Default)]
struct Curve {
    start: Option<Instant>,
    points: Vec<(f64, f32)>,
    bytes: u64,
}

impl Curve {
    fn see(&mut self, event: JobEvent) {
        match event {
            JobEvent::ReplicasSynchronized { .. } => self.start = Some(Instant::now()),
            JobEvent::StepDone(s) => {
                let t0 = *self.start.get_or_insert_with(Instant::now);
                self.points.push((t0.elapsed().as_secs_f64(), s.loss));
                let n = s.replicas.len().max(1) as u64;
                self.bytes += s.replicas.iter().map(|r| r.bytes_sent).sum::<u64>() / n;
            }
            _ => {}
        }
    }
}

/// [`run_method`] of the slow-links scenario over [`WORLD`] node processes and TCP.
#[cfg(feature = "cluster")]
fn run_method_over_tcp(b: &CommBench, method: &str) -> Result<(Vec<(f64, f32)>, u64)> {
    use meshwork::cluster::control::JobSpec;
    let (compression, local_updates, partial_sums) =
        slow_links_method(method).ok_or_else(|| {
            Error::InvalidConfig(format!("bench comm-efficiency: no method {method}"))
        })?;
    let mut job = meshwork::job_config::JobConfig {
        seed: 5,
        batch_size: Some(b.batch_size),
        steps: b.steps,
        optimizer: burn::optim::AdamConfig::new().into(),
        learning_rate: 1e-3,
        step_timeout: std::time::Duration::from_secs(600),
        ..Default::default()
    };
    job.comm.timeout = std::time::Duration::from_secs(300);
    job.comm.link = Some(b.link.clone());
    job.comm.partial_sums = partial_sums;
    job.reduction.compression = compression;
    job.reduction.local_updates = local_updates;
    let spec = JobSpec::new(
        meshwork::demo::mlp_spec(&[32, b.hidden, b.hidden, 8]),
        job,
        meshwork::device::BackendKind::Flex,
    );
    let mut curve = Curve::default();
    crate::local_nodes::train_over_local_nodes(&spec, WORLD, &mut |e| curve.see(e))?;
    Ok((curve.points, curve.bytes))
}

/// Without the `cluster` feature there are no processes to run over.
#[cfg(not(feature = "cluster"))]
fn run_method_over_tcp(_: &CommBench, _: &str) -> Result<(Vec<(f64, f32)>, u64)> {
    Err(Error::InvalidConfig(
        "--transport tcp: build meshwork with --features cluster".into(),
    ))
}

/// The mean of the last [`SMOOTH`] losses up to each step.
fn smoothed(curve: &[(f64, f32)]) -> Vec<f32> {
    (0..curve.len())
        .map(|i| {
            let from = (i + 1).saturating_sub(SMOOTH);
            let w = &curve[from..=i];
            w.iter().map(|(_, l)| l).sum::<f32>() / w.len() as f32
        })
        .collect()
}

/// The first step (and its time) whose smoothed loss is at most `target`.
fn reach(curve: &[(f64, f32)], target: f32) -> Option<(u64, f64)> {
    smoothed(curve)
        .iter()
        .position(|l| *l <= target)
        .map(|i| (i as u64 + 1, curve[i].0))
}

/// Runs every scenario's methods; returns the runs.
pub(crate) fn run(b: &CommBench) -> Result<Vec<MethodRun>> {
    let init = initial_model(b.hidden);
    let wanted = |m: &str| b.only.is_empty() || m == "sync" || b.only.iter().any(|o| o == m);
    let mut runs = Vec::new();
    let scenarios: &[Scenario] = if b.tcp {
        &[Scenario::SlowLinks]
    } else {
        &[Scenario::SlowLinks, Scenario::SlowRank]
    };
    for &scenario in scenarios {
        let mut target = b.target;
        let mut sync_time = None;
        // The scenario's methods, then (slow links) compressions named by `--methods` with
        // their settings, such as `powersgd:4:10`.
        let named = b.only.iter().map(String::as_str).filter(|m| {
            scenario == Scenario::SlowLinks
                && !scenario.methods().contains(m)
                && slow_links_method(m).is_some()
        });
        let methods: Vec<&str> = scenario
            .methods()
            .iter()
            .copied()
            .filter(|m| wanted(m))
            .chain(named)
            .collect();
        for method in methods {
            eprintln!("bench comm-efficiency: {} / {method} …", scenario.name());
            let (curve, bytes) = if b.tcp {
                run_method_over_tcp(b, method)?
            } else {
                run_method(b, &init, method, scenario)?
            };
            let smooth = smoothed(&curve);
            if target.is_none() {
                let at = ((curve.len() as f64 * TARGET_AT).ceil() as usize).clamp(1, curve.len());
                target = smooth.get(at - 1).copied();
            }
            let t = target.unwrap_or(f32::NEG_INFINITY);
            let reached = reach(&curve, t);
            if method == "sync" {
                sync_time = reached.map(|r| r.1);
            }
            runs.push(MethodRun {
                method: method.to_string(),
                scenario: scenario.name(),
                time_to_target_s: reached.map(|r| r.1),
                steps_to_target: reached.map(|r| r.0),
                bytes_per_rank: bytes,
                final_loss: smooth.last().copied().unwrap_or(f32::NAN),
                time_vs_sync: reached.map(|r| r.1).zip(sync_time).map(|(m, s)| m / s),
                target_loss: t,
                curve,
            });
        }
    }
    if let Some(path) = &b.svg {
        let svg = crate::comm_svg::render(&runs);
        std::fs::write(path, svg).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    Ok(runs)
}

/// The table of `runs`.
pub(crate) fn print_table(b: &CommBench, runs: &[MethodRun]) {
    if b.tcp {
        println!(
            "transport: TCP, {WORLD} `meshwork node` processes on this machine (one rank each), \
             this process the head; the slow-rank scenario runs in one process only (the job spec \
             carries no optimizer)"
        );
    }
    println!(
        "comm-efficiency: {WORLD} ranks, demo MLP 32-{h}-{h}-8, {st} steps; slow links \
         (Adam, batch {bs}): {link}; slow rank (SGD with momentum, batch {rbs} in \
         {MICRO_BATCHES} micro-batches per rank): rank {slow} {f}× slower; loss = mean of \
         {SMOOTH} steps",
        rbs = b.slow_rank_batch_size,
        h = b.hidden,
        bs = b.batch_size,
        st = b.steps,
        link = b.link,
        slow = WORLD - 1,
        f = b.slow_factor,
    );
    println!(
        "{:<11} {:<10} {:>9} {:>15} {:>9} {:>15} {:>11} {:>8}",
        "scenario",
        "method",
        "target",
        "time to target",
        "steps",
        "bytes per rank",
        "final loss",
        "vs sync"
    );
    let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    for r in runs {
        println!(
            "{:<11} {:<10} {:>9.5} {:>14}s {:>9} {:>15} {:>11.5} {:>8}",
            r.scenario,
            r.method,
            r.target_loss,
            opt(r.time_to_target_s, 2),
            r.steps_to_target.map_or("-".to_string(), |s| s.to_string()),
            r.bytes_per_rank,
            r.final_loss,
            opt(r.time_vs_sync, 3),
        );
    }
}
