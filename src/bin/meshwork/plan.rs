//! `meshwork plan`: every layout of a model over a machine, ranked by predicted step time,
//! with its bytes per device and the reason a layout does not fit; `--check K` then runs the
//! K fastest and puts predicted beside measured.
//!
//! The prediction is `meshwork::planner`'s model; its inputs are measured here, briefly, on
//! this machine (`plan/calibrate.rs`):
//! - the model through `meshwork::job::profile`: each block's forward and backward from a
//!   one-device block job's own timeline at the whole batch and at the smallest micro-batch a
//!   layout runs (`fixed + per sample × samples`), its parameters, the boundary tensors it
//!   stashes as the worker counts them (MEM-1), the optimizer's seconds per parameter and the
//!   runtime's per-step cost; the GPT adds its parameters per tensor-parallel degree and its
//!   all-reduces' bytes (`s·h` floats a sample each way);
//! - the α–β cost of a collective from two in-process all-reduces (4 KiB, 4 MiB) over 2 ranks
//!   (or `--link`), a pipeline send's cost and latency from a dp 1 × pp 2 run;
//! - at the machine's device count (up to `AT_SCALE_RANKS_PER_CORE` ranks a core), the
//!   replicas' synchronisation per step and, where ranks outnumber cores, the share of a
//!   split block's compute its tensor-parallel all-reduces add waiting for partners off the
//!   core, per degree (`calibrate::at_scale`).
//!
//! `--check` reruns the one-device reference before each checked layout: the machine's speed
//! drift since the calibration is printed beside the error, and the error with the prediction
//! scaled by it.
//!
//! A layout the job itself refuses (its builder's checks, the one refusal table) is listed
//! with the builder's reason.

use std::time::Duration;

use burn::optim::AdamConfig;
use burn::tensor::Device;
use meshwork::data::{Dataset, TextWindow, TextWindows};
use meshwork::demo::gpt::{Gpt, GptConfig};
use meshwork::demo::{Sample, TeacherTask, kjv_corpus, mlp_blocks};
use meshwork::error::{Error, Result};
use meshwork::events::StepDone;
use meshwork::job::{Job, JobConfig, PipelineModel};
use meshwork::parallel::stages::{BlockOptions, PipelineStages};
use meshwork::planner::{Candidate, Machine, ModelCosts, Prediction, plan};
use meshwork::precision::Precision;
use serde::Serialize;

mod calibrate;

/// What `meshwork plan` is asked.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct PlanArgs {
    /// `gpt` (the recipe's model on the shipped KJV text) or `mlp` (the demo MLP).
    #[arg(long, default_value = "gpt")]
    model: String,
    /// GPT: transformer layers.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// GPT: features per token; MLP: the hidden width.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// GPT: attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// GPT: context (tokens per window).
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// MLP: hidden layers.
    #[arg(long, default_value_t = 3)]
    depth: usize,
    /// The global batch (samples per step).
    #[arg(long, default_value_t = 16)]
    batch: u32,
    /// Devices (ranks) of the machine, all used.
    #[arg(long, default_value_t = 4)]
    devices: u32,
    /// Cores the devices share (default: this machine's).
    #[arg(long)]
    cores: Option<u32>,
    /// Memory per device (e.g. 512MiB, 16GiB).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    memory_per_device: u64,
    /// A collective's α (seconds per round) and β (bytes per second per rank), instead of
    /// measuring them here: `5us,10GB/s`.
    #[arg(long)]
    link: Option<String>,
    /// Devices per node (default: all of them, one node); collectives that span nodes use
    /// `--inter-link`.
    #[arg(long)]
    devices_per_node: Option<u32>,
    /// Collectives between nodes, `α,β` as `--link` (default: the same as inside a node).
    #[arg(long)]
    inter_link: Option<String>,
    /// Micro-batch counts tried for pipelines, comma-separated.
    #[arg(long, default_value = "1,2,4", value_delimiter = ',')]
    micro_batches: Vec<u32>,
    /// Layouts printed (fitting ones, fastest first).
    #[arg(long, default_value_t = 12)]
    top: usize,
    /// Run the K fastest layouts and put predicted beside measured.
    #[arg(long, default_value_t = 0)]
    check: usize,
    /// Steps of each checked run (the first two are not timed).
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
    /// Write the fastest layout that fits as a job description `meshwork train --config`
    /// runs unchanged (TOML, with the model's `[model]` table; `--model gpt` only).
    #[arg(long)]
    emit_config: Option<std::path::PathBuf>,
}

/// `512MiB`, `16GiB` → bytes (`bench`'s size syntax).
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    crate::bench::parse_size(s).map(|b| b as u64)
}

/// The model being planned, and how to build its jobs.
enum PlanModel {
    Gpt {
        gpt: Box<Gpt>,
        config: GptConfig,
        data: TextWindows,
    },
    Mlp {
        widths: Vec<usize>,
        data: meshwork::data::InMemoryDataset<Sample>,
    },
}

/// What a checked or calibrating run gives back: its steps.
fn run_steps(
    model: &PlanModel,
    layout: &Candidate,
    batch: u32,
    steps: u64,
) -> Result<Vec<StepDone>> {
    let what = format!("meshwork plan ({layout})");
    match PlanJob::build(model, layout, batch, steps)? {
        PlanJob::Gpt(job) => crate::bench_run::collect_steps(job, steps, &what),
        PlanJob::Mlp(job) => crate::bench_run::collect_steps(job, steps, &what),
    }
}

/// The job of a layout for the model being planned (its item type is the model's).
enum PlanJob {
    Gpt(Job<PipelineModel, TextWindow>),
    Mlp(Job<PipelineModel, Sample>),
}

impl PlanJob {
    /// `model` laid out as `layout` for `steps` steps of `batch` samples, or the job
    /// builder's refusal.
    fn build(model: &PlanModel, layout: &Candidate, batch: u32, steps: u64) -> Result<Self> {
        let options = BlockOptions {
            recompute: layout.recompute,
            ..BlockOptions::default()
        };
        let with = (layout, Precision::F32);
        Ok(match model {
            PlanModel::Gpt { gpt, data, .. } => {
                let stages = (**gpt).clone().into_blocks_with(options);
                PlanJob::Gpt(layout_job(stages, data.clone(), with, batch, steps)?)
            }
            PlanModel::Mlp { widths, data } => {
                let stages = mlp_stages(widths, options)?;
                PlanJob::Mlp(layout_job(stages, data.clone(), with, batch, steps)?)
            }
        })
    }
}

/// The demo MLP of `widths` as blocks training with `options` (drawn from seed 3).
fn mlp_stages(widths: &[usize], options: BlockOptions) -> Result<PipelineStages<Sample>> {
    let device = Device::flex();
    device.seed(3);
    mlp_blocks(widths, options, &device)
        .ok_or_else(|| Error::InvalidConfig("the MLP needs two widths".into()))
}

/// The job description of `layout` in `precision` for a model of `blocks` blocks: a pipeline
/// over pp stages with the planner's schedule (`planner::pipeline_schedule`), or blocks;
/// Adam. What `--emit-config` writes and every planned or checked run trains with.
pub(crate) fn layout_config(
    (layout, precision): (&Candidate, Precision),
    blocks: u32,
    batch: u32,
    steps: u64,
) -> JobConfig {
    let mut c = JobConfig {
        seed: 5,
        steps,
        batch_size: Some(batch as usize),
        optimizer: AdamConfig::new().into(),
        learning_rate: 1e-3,
        step_timeout: Duration::from_secs(600),
        ..JobConfig::default()
    }
    .with_layout(layout, blocks);
    c.precision.compute = precision;
    c.comm.timeout = Duration::from_secs(120);
    c
}

/// The job of `layout` in `precision` ([`layout_config`]) on `stages`. `bench tensor`'s
/// meshes are built here too.
pub(crate) fn layout_job<I, D>(
    stages: PipelineStages<I>,
    data: D,
    with: (&Candidate, Precision),
    batch: u32,
    steps: u64,
) -> Result<Job<PipelineModel, I>>
where
    I: Send + Sync + 'static,
    D: Dataset<Item = I> + Send + Sync + 'static,
{
    let config = layout_config(with, stages.len() as u32, batch, steps);
    let builder = match config.pipeline {
        Some(p) => Job::builder().pipeline(stages, p.schedule),
        None => Job::builder().blocks(stages),
    };
    // The blocks recompute as their options say (the planner's model: a GPT's embedding
    // does not).
    builder
        .with_config(config)
        .recompute(false)
        .data(data)
        .build()
}

/// The median of `v` (the upper one of an even count), 0 for none (a run with no sends).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The fullest rank's bytes in a step, as the workers count them: parameters (whole and
/// shards), gradients, optimizer state, stashed activations.
fn fullest_bytes(step: &StepDone) -> [u64; 4] {
    step.replicas
        .iter()
        .filter_map(|r| r.pipeline.as_ref().map(|p| &p.memory))
        .map(|m| {
            [
                m.peak_full_params + m.param_shards,
                m.peak_grads,
                m.optimizer,
                m.peak_activations,
            ]
        })
        .max_by_key(|b| b.iter().sum::<u64>())
        .unwrap_or_default()
}

/// Where the slowest rank's step went (see [`Row::measured_split`]), medians over the timed
/// steps.
fn split(steps: &[StepDone]) -> [f64; 4] {
    let mut parts: [Vec<f64>; 4] = Default::default();
    for s in steps.iter().skip(2) {
        let slowest = s
            .replicas
            .iter()
            .map(|r| {
                let comm = (r.breakdown.communication_s - r.breakdown.overlapped_s).max(0.0);
                [r.compute_s(), comm, r.optimizer_s()]
            })
            .max_by(|a, b| a.iter().sum::<f64>().total_cmp(&b.iter().sum::<f64>()))
            .unwrap_or_default();
        for (i, v) in slowest.iter().enumerate() {
            parts[i].push(*v);
        }
        parts[3].push((s.wall_s - slowest.iter().sum::<f64>()).max(0.0));
    }
    parts.map(median)
}

/// One row of the report.
#[derive(Debug, Serialize)]
struct Row {
    layout: Candidate,
    predicted: Option<Prediction>,
    samples_per_s: Option<f64>,
    unfit: Option<String>,
    measured_step_s: Option<f64>,
    measured_bytes: Option<u64>,
    /// Measured parameters, gradients, optimizer state and activations of the fullest rank.
    measured_parts: Option<[u64; 4]>,
    /// Where the slowest rank's step went, medians in seconds: forwards and backwards
    /// (tensor-parallel collectives inside them), collectives not hidden behind compute,
    /// the optimizer, and the rest of the step's wall time.
    measured_split: Option<[f64; 4]>,
    step_error: Option<f64>,
    /// The machine's speed when this layout ran against when it was measured: the
    /// one-device reference's step rerun just before the layout, over its step at
    /// calibration (1: no drift; above 1: the machine is slower now).
    drift: Option<f64>,
    /// The step error with the prediction scaled by `drift`.
    drift_error: Option<f64>,
    bytes_error: Option<f64>,
}

pub(crate) fn run(args: PlanArgs) -> Result<()> {
    let model = load(&args)?;
    let cores = args
        .cores
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32));
    if args.devices == 0 || args.batch == 0 {
        return Err(Error::InvalidConfig(
            "--devices and --batch must be at least 1".into(),
        ));
    }
    if let Some(n) = args.devices_per_node
        && (n == 0 || !args.devices.is_multiple_of(n))
    {
        return Err(Error::InvalidConfig(format!(
            "--devices-per-node {n}: nodes of equal size that divide --devices {}",
            args.devices
        )));
    }
    eprintln!("meshwork plan: measuring this machine (one-device runs, an all-reduce) …");
    let (costs, machine) = calibrate::calibrate(&model, &args, cores)?;
    let planned = plan(&costs, &machine, args.batch, &args.micro_batches);
    let mut rows: Vec<Row> = Vec::new();
    for (layout, verdict) in planned {
        // The job's own checks (the refusal table, the values) come first.
        let refused = PlanJob::build(&model, &layout, args.batch, 1).err();
        let (predicted, unfit) = match (refused, verdict) {
            (Some(e), _) => (None, Some(format!("refused by the job: {e}"))),
            (None, Ok(p)) => (Some(p), None),
            (None, Err(u)) => (None, Some(u.to_string())),
        };
        rows.push(Row {
            layout,
            samples_per_s: predicted.map(|p| f64::from(args.batch) / p.step_s),
            predicted,
            unfit,
            measured_step_s: None,
            measured_bytes: None,
            measured_parts: None,
            measured_split: None,
            step_error: None,
            drift: None,
            drift_error: None,
            bytes_error: None,
        });
    }
    rows.sort_by(|a, b| match (&a.predicted, &b.predicted) {
        (Some(x), Some(y)) => x.step_s.total_cmp(&y.step_s),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.layout.cmp(&b.layout),
    });
    // The one-device reference: rerun before each checked layout, it shows how the shared
    // machine's speed drifted since the calibration.
    let reference = |model: &PlanModel| -> Result<f64> {
        let steps = run_steps(model, &Candidate::ONE_DEVICE, args.batch, 8)?;
        Ok(median(steps.iter().skip(2).map(|s| s.wall_s).collect()))
    };
    let at_calibration = if args.check > 0 {
        reference(&model)?
    } else {
        0.0
    };
    for row in rows
        .iter_mut()
        .filter(|r| r.predicted.is_some())
        .take(args.check)
    {
        eprintln!("meshwork plan: running {} …", row.layout);
        let drift = reference(&model)? / at_calibration.max(1e-12);
        let steps = run_steps(&model, &row.layout, args.batch, args.steps.max(3))?;
        let timed: Vec<f64> = steps.iter().skip(2).map(|s| s.wall_s).collect();
        let measured = median(timed);
        let parts = steps.last().map(fullest_bytes).unwrap_or_default();
        let bytes: u64 = parts.iter().sum();
        row.measured_parts = Some(parts);
        row.measured_split = Some(split(&steps));
        if let Some(p) = row.predicted {
            row.step_error = Some(p.step_s / measured.max(1e-12) - 1.0);
            row.drift = Some(drift);
            row.drift_error = Some(p.step_s * drift / measured.max(1e-12) - 1.0);
            row.bytes_error = Some(p.bytes.total() as f64 / (bytes.max(1)) as f64 - 1.0);
        }
        row.measured_step_s = Some(measured);
        row.measured_bytes = Some(bytes);
    }
    print(&args, &costs, &machine, &rows);
    if let Some(path) = &args.emit_config {
        emit_config(&args, &model, &rows, path)?;
    }
    Ok(())
}

/// `--emit-config`: the fastest layout that fits, as the description `meshwork train --config`
/// runs (the GPT of the plan's flags, `--steps` steps of `--batch`).
fn emit_config(
    args: &PlanArgs,
    model: &PlanModel,
    rows: &[Row],
    path: &std::path::Path,
) -> Result<()> {
    let PlanModel::Gpt { config, .. } = model else {
        return Err(Error::InvalidConfig(
            "--emit-config: --model gpt only (meshwork train's MLP has other widths than the \
             plan's)"
                .into(),
        ));
    };
    let Some(best) = rows.iter().find(|r| r.predicted.is_some()) else {
        return Err(Error::InvalidConfig(
            "--emit-config: no layout fits; nothing to write".into(),
        ));
    };
    let job = layout_config(
        (&best.layout, Precision::F32),
        config.blocks() as u32,
        args.batch,
        args.steps,
    );
    let section = crate::job_file::ModelSection {
        kind: Some("gpt".into()),
        device: Some(meshwork::device::BackendKind::Flex),
        hidden: None,
        layers: Some(config.layers),
        d_model: Some(config.d_model),
        heads: Some(config.heads),
        context: Some(config.context),
    };
    let text = crate::job_file::text(&section, &job)?;
    std::fs::write(path, text).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    eprintln!(
        "meshwork plan: {} written to {} (meshwork train --config {} runs it)",
        best.layout,
        path.display(),
        path.display()
    );
    Ok(())
}

fn load(args: &PlanArgs) -> Result<PlanModel> {
    match args.model.as_str() {
        "gpt" => {
            let corpus =
                kjv_corpus().map_err(|e| Error::Data(format!("the embedded text: {e}")))?;
            let config = GptConfig {
                vocab: corpus.vocab().len(),
                context: args.seq,
                d_model: args.hidden,
                heads: args.heads,
                layers: args.layers,
            };
            if args.layers == 0 || args.heads == 0 || !args.hidden.is_multiple_of(args.heads) {
                return Err(Error::InvalidConfig(format!(
                    "--layers {} --hidden {} --heads {}: at least one layer, and heads that divide the hidden width",
                    args.layers, args.hidden, args.heads
                )));
            }
            let data = corpus
                .train_windows(config.context, config.context)
                .map_err(|e| Error::Data(e.to_string()))?;
            let device = Device::flex();
            device.seed(11);
            Ok(PlanModel::Gpt {
                gpt: Box::new(Gpt::new(&config, &device)),
                config,
                data,
            })
        }
        "mlp" => {
            let mut widths = vec![32];
            widths.extend(std::iter::repeat_n(args.hidden, args.depth.max(1)));
            widths.push(8);
            let task = TeacherTask {
                d_in: 32,
                d_out: 8,
                noise: 0.1,
                seed: 1,
            };
            Ok(PlanModel::Mlp {
                widths,
                data: task.dataset(4096),
            })
        }
        other => Err(Error::InvalidConfig(format!(
            "--model {other:?}: gpt or mlp"
        ))),
    }
}

fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

fn mib(b: u64) -> String {
    format!("{:.2}", b as f64 / 1048576.0)
}

fn print(args: &PlanArgs, costs: &ModelCosts, machine: &Machine, rows: &[Row]) {
    if args.json {
        for r in rows {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
        return;
    }
    println!(
        "# {} — global batch {}, Adam; {} devices sharing {} cores, {} MiB each; collectives α {:.1} µs, β {:.2} GB/s; pipeline sends {:.0} µs + {:.0} µs latency; optimizer {:.2} ns/parameter; runtime {:.2} ms/step, replicas' sync {:.2} ms/step; tp partner waits {}{}",
        costs.name,
        args.batch,
        machine.devices,
        machine.cores,
        mib(machine.memory_per_device),
        machine.link.alpha_s * 1e6,
        machine.link.bytes_per_s / 1e9,
        machine.pipeline_send_s.0 * 1e6,
        machine.pipeline_send_s.1 * 1e6,
        machine.optimizer_s_per_param * 1e9,
        machine.step_overhead_s * 1e3,
        machine.replica_sync_s * 1e3,
        if machine.tp_wait.is_empty() {
            "none".to_string()
        } else {
            machine
                .tp_wait
                .iter()
                .map(|(t, w)| format!("{:.0} % of compute at tp {t}", w * 100.0))
                .collect::<Vec<_>>()
                .join(", ")
        },
        if machine.devices_per_node > 0 && machine.devices_per_node < machine.devices {
            format!(
                "; {} devices a node, between nodes α {:.1} µs, β {:.2} GB/s",
                machine.devices_per_node,
                machine.inter_link.alpha_s * 1e6,
                machine.inter_link.bytes_per_s / 1e9
            )
        } else {
            String::new()
        }
    );
    println!(
        "{:<46} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>9} {:>10} {:>7} {:>9} {:>7}",
        "layout",
        "step ms",
        "samples/s",
        "bubble",
        "dp ms",
        "tp ms",
        "opt ms",
        "MiB/dev",
        "measured",
        "err",
        "meas MiB",
        "err"
    );
    let fitting: Vec<&Row> = rows.iter().filter(|r| r.predicted.is_some()).collect();
    for r in fitting.iter().take(args.top.max(args.check)) {
        let Some(p) = r.predicted else { continue };
        let pct = |e: Option<f64>| e.map_or_else(|| "–".into(), |e| format!("{:+.0}%", e * 100.0));
        println!(
            "{:<46} {:>9} {:>9.1} {:>7.3} {:>8} {:>8} {:>8} {:>9} {:>10} {:>7} {:>9} {:>7}",
            r.layout.to_string(),
            ms(p.step_s),
            f64::from(args.batch) / p.step_s,
            p.bubble,
            ms(p.dp_comm_s),
            ms(p.tp_comm_s),
            ms(p.optimizer_s),
            mib(p.bytes.total()),
            r.measured_step_s.map_or_else(|| "–".into(), ms),
            pct(r.step_error),
            r.measured_bytes.map_or_else(|| "–".into(), mib),
            pct(r.bytes_error)
        );
    }
    let unfit: Vec<&Row> = rows.iter().filter(|r| r.unfit.is_some()).collect();
    if !unfit.is_empty() {
        println!("# {} layouts do not fit:", unfit.len());
        for r in unfit.iter().take(args.top) {
            println!(
                "{:<46} {}",
                r.layout.to_string(),
                r.unfit.as_deref().unwrap_or("")
            );
        }
    }
    let checked: Vec<&Row> = rows.iter().filter(|r| r.step_error.is_some()).collect();
    if !checked.is_empty() {
        println!(
            "# where the slowest rank's step went, ms: predicted pipeline (compute, tp, bubble) / dp collectives / optimizer / runtime (with the replicas' sync), measured compute / collectives not hidden / optimizer / rest; the machine's drift (the one-device reference now against at calibration) and the step error with the prediction scaled by it"
        );
        for r in &checked {
            let (Some(p), Some(m)) = (r.predicted, r.measured_split) else {
                continue;
            };
            println!(
                "{:<46} {:>7} {:>6} {:>6} {:>6}  | {:>7} {:>6} {:>6} {:>6}  | {:>5} {:>6}",
                r.layout.to_string(),
                ms(p.pipeline_s),
                ms(p.dp_comm_s),
                ms(p.optimizer_s),
                ms(p.step_s - p.pipeline_s - p.dp_comm_s - p.optimizer_s),
                ms(m[0]),
                ms(m[1]),
                ms(m[2]),
                ms(m[3]),
                r.drift.map_or_else(|| "–".into(), |d| format!("{d:.2}")),
                r.drift_error
                    .map_or_else(|| "–".into(), |e| format!("{:+.0}%", e * 100.0))
            );
        }
        let within = |e: Option<f64>, bound: f64| e.is_some_and(|e| e.abs() <= bound);
        println!(
            "# checked {}: step time within 15 % for {} ({} against the machine's speed at the time), bytes within 10 % for {}",
            checked.len(),
            checked
                .iter()
                .filter(|r| within(r.step_error, 0.15))
                .count(),
            checked
                .iter()
                .filter(|r| within(r.drift_error, 0.15))
                .count(),
            checked
                .iter()
                .filter(|r| within(r.bytes_error, 0.10))
                .count()
        );
    }
}
