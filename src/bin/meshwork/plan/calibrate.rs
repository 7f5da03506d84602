//! What `meshwork plan` measures on this machine before it predicts (see the parent
//! module's docs): the model through `job::profile`, the collectives' α–β, the pipeline
//! send, and the runtime's costs at the machine's device count.

use meshwork::comm::Algorithm;
use meshwork::comm::bench::{Wire, all_reduce_bandwidth};
use meshwork::demo::gpt::{Gpt, GptConfig};
use meshwork::error::{Error, Result};
use meshwork::job::{ProfileRuns, profile};
use meshwork::parallel::pipeline::InstrKind;
use meshwork::planner::{AlphaBeta, Candidate, Machine, ModelCosts};

use super::{PlanArgs, PlanModel, median, mlp_stages, run_steps};

/// A pipeline send's busy time and its latency (from the send's end to the end of a receive
/// that was already waiting for it), medians over a dp 1 × pp 2 run's steps; `(0, 0)` for a
/// model or batch that cannot run it.
fn pipeline_sends(model: &PlanModel, blocks: usize, batch: u32) -> Result<(f64, f64)> {
    if blocks < 2 || !blocks.is_multiple_of(2) || !batch.is_multiple_of(2) {
        return Ok((0.0, 0.0));
    }
    let layout = Candidate {
        dp: 1,
        pp: 2,
        tp: 1,
        zero: 0,
        micro_batches: 2,
        recompute: false,
    };
    let steps = run_steps(model, &layout, batch, 6)?;
    let (mut sends, mut latencies) = (Vec::new(), Vec::new());
    for s in steps.iter().skip(2) {
        let lists: Vec<&Vec<meshwork::parallel::pipeline::TimedInstr>> = s
            .replicas
            .iter()
            .filter_map(|r| r.pipeline.as_ref().map(|p| &p.executed))
            .collect();
        for (from, list) in lists.iter().enumerate() {
            for t in list.iter() {
                let kind = t.instr.kind();
                if !matches!(kind, InstrKind::SendActivation | InstrKind::SendGradient) {
                    continue;
                }
                sends.push(t.end.saturating_sub(t.start) as f64 * 1e-6);
                // The matching receive: the other stage's of the same micro-batch and kind,
                // one that started before this send ended (it was waiting).
                let want = if kind == InstrKind::SendActivation {
                    InstrKind::RecvActivation
                } else {
                    InstrKind::RecvGradient
                };
                let other = lists.get(1 - from.min(1));
                if let Some(r) = other.and_then(|l| {
                    l.iter()
                        .filter(|r| r.instr.kind() == want && r.instr.mb() == t.instr.mb())
                        .filter(|r| r.start <= t.end && r.end >= t.end)
                        .min_by_key(|r| r.end)
                }) {
                    latencies.push(r.end.saturating_sub(t.end) as f64 * 1e-6);
                }
            }
        }
    }
    Ok((median(sends), median(latencies)))
}

/// The most ranks a core `at_scale` starts on this machine; past it the planned machine is
/// not one this machine can stand for.
const AT_SCALE_RANKS_PER_CORE: u32 = 4;

/// Steps of each calibrating run (the first two are not timed).
const CALIBRATION_STEPS: u64 = 12;

/// Measures what the planner needs on this machine (see the module's docs): the model's
/// costs and the machine, cores and memory as asked.
pub(super) fn calibrate(
    model: &PlanModel,
    args: &PlanArgs,
    cores: u32,
) -> Result<(ModelCosts, Machine)> {
    // The two sizes bracket every micro-batch a layout runs: the whole batch on one device,
    // and the smallest share (the most replicas × the most micro-batches).
    let most_micro_batches = args.micro_batches.iter().copied().max().unwrap_or(1).max(1);
    let big = args.batch.max(2);
    let small = (args.batch / most_micro_batches.saturating_mul(args.devices).max(1)).max(1);
    let small = if small >= big { big / 2 } else { small };
    let runs = ProfileRuns {
        batch: big,
        small_batch: small,
        steps: CALIBRATION_STEPS,
    };
    let name = match model {
        PlanModel::Gpt { config, .. } => format!(
            "GPT: {} layers, hidden {}, {} heads, context {}, vocabulary {}",
            config.layers, config.d_model, config.heads, config.context, config.vocab
        ),
        PlanModel::Mlp { widths, .. } => format!("MLP {widths:?}"),
    };
    // The model through the embedding API's profiler, as a user's own blocks would be.
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Error::Io {
        path: "tokio runtime".into(),
        reason: e.to_string(),
    })?;
    let profiled = runtime.block_on(async {
        match model {
            PlanModel::Gpt { gpt, data, .. } => {
                let blocks = |options| Ok((**gpt).clone().into_blocks_with(options));
                profile(&name, blocks, data.clone(), runs).await
            }
            PlanModel::Mlp { widths, data } => {
                let blocks = |options| mlp_stages(widths, options);
                profile(&name, blocks, data.clone(), runs).await
            }
        }
    })?;
    let mut costs = profiled.costs;
    // The GPT states what each rank holds at every tensor-parallel degree, and what its
    // all-reduces move.
    if let PlanModel::Gpt { gpt, config, .. } = model {
        let (params, tp_bytes, tp_degrees) = gpt_splits(gpt, config, args.devices);
        for (b, block) in costs.blocks.iter_mut().enumerate() {
            block.params = params.get(b).cloned().unwrap_or_default();
            block.tp_bytes = tp_bytes;
            block.splits = tp_degrees.len() > 1;
        }
        costs.tp_degrees = tp_degrees;
    }
    let blocks = costs.blocks.len();
    let link = match &args.link {
        Some(text) => parse_link("--link", text)?,
        None => measure_link()?,
    };
    let sends = pipeline_sends(model, blocks, big)?;
    let inter_link = match &args.inter_link {
        Some(text) => parse_link("--inter-link", text)?,
        None => link,
    };

    let mut machine = Machine {
        devices: args.devices,
        devices_per_node: args.devices_per_node.unwrap_or(args.devices),
        cores,
        memory_per_device: args.memory_per_device,
        link,
        inter_link,
        tp_wait: Vec::new(),
        replica_sync_s: 0.0,
        optimizer_s_per_param: profiled.optimizer_s_per_param,
        step_overhead_s: profiled.step_overhead_s,
        pipeline_send_s: sends,
    };
    if args.devices > 1 && args.devices <= AT_SCALE_RANKS_PER_CORE * cores {
        at_scale(model, &costs, &mut machine, args.batch)?;
    } else if args.devices > 1 {
        eprintln!(
            "meshwork plan: {} devices are more than {AT_SCALE_RANKS_PER_CORE} ranks a core here: \
             the replicas' synchronisation and the tp partner wait are not measured (taken as 0)",
            args.devices
        );
    }
    Ok((costs, machine))
}

/// What the runtime costs at the machine's device count, measured on half the batch
/// (rounded to split over the devices): the replicas' synchronisation per step (a
/// data-parallel run over every device: its step less the predicted step without it), and,
/// where ranks outnumber cores, the waits of each tensor-parallel degree's all-reduces for
/// partners off the core (a run of that degree, the rest data-parallel: its step less the
/// predicted step, as a share of the split blocks' compute). These are not runs a plan checks at its own
/// batch.
fn at_scale(
    model: &PlanModel,
    costs: &ModelCosts,
    machine: &mut Machine,
    batch: u32,
) -> Result<()> {
    let devices = machine.devices;
    let small = (batch / 2).max(devices).div_ceil(devices) * devices;
    let measured = |layout: &Candidate| -> Result<f64> {
        let steps = run_steps(model, layout, small, 2 * CALIBRATION_STEPS)?;
        Ok(median(steps.iter().skip(2).map(|s| s.wall_s).collect()))
    };
    // The runs are on this machine: predict them for one node, memory unbounded, whatever
    // nodes and memory the plan is for.
    let predicted = |machine: &Machine, layout: &Candidate| {
        let here = Machine {
            devices_per_node: 0,
            memory_per_device: u64::MAX,
            ..machine.clone()
        };
        meshwork::planner::predict(costs, &here, layout, small).map(|p| p.step_s)
    };
    let dp = Candidate {
        dp: devices,
        ..Candidate::ONE_DEVICE
    };
    if let Ok(without) = predicted(machine, &dp) {
        machine.replica_sync_s = (measured(&dp)? - without).max(0.0);
    }
    // Each tensor-parallel degree the model allows, the rest data-parallel: the share of the
    // split blocks' compute its partner waits add (the prediction is linear in it).
    let degrees: Vec<u32> = costs
        .tp_degrees
        .iter()
        .copied()
        .filter(|t| *t > 1 && devices.is_multiple_of(*t))
        .collect();
    if devices > machine.cores && costs.blocks.iter().any(|b| b.splits) {
        for width in degrees {
            let tp = Candidate {
                dp: devices / width,
                tp: width,
                ..dp
            };
            let mut with = machine.clone();
            with.tp_wait = vec![(width, 1.0)];
            if let (Ok(without), Ok(whole)) = (predicted(machine, &tp), predicted(&with, &tp))
                && whole > without
            {
                let share = (measured(&tp)? - without) / (whole - without);
                machine.tp_wait.push((width, share.max(0.0)));
            }
        }
    }
    Ok(())
}

/// A block's elements on one rank, per tensor-parallel degree: `(degree, elements)`.
type HeldPerDegree = Vec<(u32, u64)>;

/// The GPT's blocks at every tensor-parallel degree up to `devices`: each block's elements on
/// one rank per degree, the bytes its all-reduces move per sample (Megatron: one of the
/// block's output forward, one of its input's gradient backward, `s·h` floats each), and the
/// degrees every block splits at.
fn gpt_splits(gpt: &Gpt, config: &GptConfig, devices: u32) -> (Vec<HeldPerDegree>, u64, Vec<u32>) {
    let mut degrees = Vec::new();
    let mut per_degree = Vec::new();
    for tp in [1u32, 2, 4, 8].into_iter().filter(|t| *t <= devices) {
        // Every rank of a degree holds the same count; rank 0 stands for them.
        if let Ok(counts) = gpt.held_parameters(0, tp as usize) {
            degrees.push(tp);
            per_degree.push((tp, counts));
        }
    }
    let blocks = 2 * config.layers + 2;
    let params = (0..blocks)
        .map(|b| {
            per_degree
                .iter()
                .map(|(tp, counts)| (*tp, counts.get(b).copied().unwrap_or(0) as u64))
                .collect()
        })
        .collect();
    let (s, h) = (config.context as u64, config.d_model as u64);
    (params, 2 * 4 * s * h, degrees)
}

fn parse_link(flag: &str, text: &str) -> Result<AlphaBeta> {
    let bad = || Error::InvalidConfig(format!("{flag} {text:?}: write it as `5us,10GB/s`"));
    let (a, b) = text.split_once(',').ok_or_else(bad)?;
    let alpha = meshwork::comm::emulate::parse_latency(a.trim()).map_err(|_| bad())?;
    let beta = meshwork::comm::emulate::parse_bandwidth(b.trim()).map_err(|_| bad())?;
    Ok(AlphaBeta {
        alpha_s: alpha.as_secs_f64(),
        bytes_per_s: beta,
    })
}

/// α and β of the in-process all-reduce over 2 ranks, from 4 KiB and 4 MiB (ring plans, so
/// the plan's rounds are the model's).
fn measure_link() -> Result<AlphaBeta> {
    let time = |bytes: usize| -> Result<f64> {
        let f = all_reduce_bandwidth(2, bytes, Algorithm::Ring, 50, Wire::default())
            .map_err(|e| Error::Runtime(e.to_string()))?;
        Ok(f.seconds_median)
    };
    let (small, large) = (4096.0, 4.0 * 1048576.0);
    let (ts, tl) = (time(small as usize)?, time(large as usize)?);
    // t = 2(n−1)α + 2(n−1)/n · bytes/β with n = 2: t = 2α + bytes/β.
    let per_byte = ((tl - ts) / (large - small)).max(1e-13);
    Ok(AlphaBeta {
        alpha_s: ((ts - small * per_byte) / 2.0).max(0.0),
        bytes_per_s: 1.0 / per_byte,
    })
}
