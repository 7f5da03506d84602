//! `meshwork plan`'s model: a layout's step time and bytes per device, predicted from
//! measured costs before anything runs.
//!
//! A model is a list of blocks ([`ModelCosts`]): for each, its parameter elements at every
//! tensor-parallel degree it splits over, its forward and backward seconds per sample on one
//! core (measured), the bytes of the boundary tensor it stashes per sample, and the bytes its
//! tensor-parallel all-reduces move per sample. A machine ([`Machine`]) is its devices, the
//! cores they share, the memory of each, an α–β cost of a collective between its devices and
//! the optimizer's seconds per parameter (both measured). A [`Candidate`] is dp × pp × tp, the
//! ZeRO stage, micro-batches and recomputation.
//!
//! The prediction ([`predict`]):
//! - **compute**: each pipeline stage holds the blocks `b ≡ s (mod pp)` (the interleaved
//!   placement); a micro-batch of `B / (dp·M)` samples costs each block its measured time,
//!   divided by tp for blocks that split; recomputation adds a forward to every backward;
//!   when the ranks outnumber the cores, compute slows by the ratio of busy ranks to cores;
//! - **the bubble**: the pipeline's step is the schedule simulator's makespan with those
//!   stage costs (`parallel::pipeline::simulate`), so the bubble is the schedule's own for
//!   these costs, unequal stages included;
//! - **collectives**: tensor parallelism's all-reduces per block and micro-batch, and the
//!   data-parallel reduction of each rank's gradient (a ring's `2(n−1)/n` of the bytes, with
//!   ZeRO-1 the parameters' all-gather added, ZeRO-3 the parameters gathered for the forward
//!   and again for the backward of every micro-batch), each `α·steps + bytes/β`, not
//!   overlapped with compute; inside a node and between nodes (PLANNER-3); when ranks
//!   outnumber cores, a tensor-parallel group of degree t also waits for partners off the
//!   core, a measured share (`tp_wait`) of the split blocks' compute;
//! - **the optimizer**: the parameters the rank steps (its shard from ZeRO-1 on) times the
//!   measured seconds per parameter; plus a fixed per-step cost of the runtime, and with
//!   replicas the measured cost of synchronising them.
//!
//! Bytes per device are what the workers count (`parallel::memory`, MEM-1: f32 words): the
//! fullest rank's parameters (4 bytes an element; ZeRO-3: its shard plus the blocks whole at
//! once), gradients (4; ZeRO-2 on: a shard), Adam's two moments (8; ZeRO-1 on: a shard) and
//! its stashed boundary tensors at the schedule's peak stash.
//!
//! - PLANNER-1 (enumeration): [`layouts`] lists every dp × pp × tp = devices with tp among the
//!   model's degrees, pp at most the blocks and dividing them, dp and the micro-batches
//!   dividing the global batch, each ZeRO stage (dp > 1; with one replica there is nothing to
//!   shard) and recomputation on and off, once each.
//! - PLANNER-2 (monotone): more devices of data parallelism never predict less compute per
//!   rank; a layout that does not fit names the bytes it needs and the device's.
//! - PLANNER-3 (nodes): ranks are placed as the mesh places them (MESH-1: tp innermost, then dp,
//!   then pp); a group that spans nodes reduces inside each node over `link`, then between
//!   one leader per node over `inter_link` (`comm::hierarchical`'s plan, which runs an
//!   all-gather or reduce-scatter as a whole all-reduce), and a pipeline that spans nodes
//!   carries its boundary tensors over `inter_link`; so, for the same nodes, a slower link
//!   between them never predicts a faster step, and bytes do not depend on the nodes.

use serde::{Deserialize, Serialize};

use crate::parallel::pipeline::{
    Costs, PipelineSchedule, Schedule, ScheduleError, StageIndex, simulate,
};

mod bytes;
use bytes::stage_bytes;

/// One block of a model, as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockCosts {
    /// Parameter elements one rank holds at each tensor-parallel degree: `(degree, elements)`.
    pub params: Vec<(u32, u64)>,
    /// Seconds of one forward per sample on one core (tp 1).
    pub forward_s: f64,
    /// Seconds of one forward per micro-batch, whatever its size (launching the block's
    /// operations).
    pub forward_fixed_s: f64,
    /// Seconds of one backward per sample on one core (tp 1).
    pub backward_s: f64,
    /// Seconds of one backward per micro-batch, whatever its size.
    pub backward_fixed_s: f64,
    /// Bytes of boundary tensors this block keeps per sample until its backward (its input
    /// and its output, as the executor counts them).
    pub stash_bytes: u64,
    /// The same when the layout recomputes (a recomputing block keeps its input only; a
    /// block that does not recompute keeps what it kept).
    pub recompute_stash_bytes: u64,
    /// Whether its compute splits over a tensor-parallel group.
    pub splits: bool,
    /// Bytes its tensor-parallel all-reduces move per sample, forward and backward together
    /// (0 for a block that does not split).
    pub tp_bytes: u64,
}

impl BlockCosts {
    /// Elements a rank holds at `tp`, if the block splits at that degree.
    pub fn params_at(&self, tp: u32) -> Option<u64> {
        self.params.iter().find(|(d, _)| *d == tp).map(|(_, n)| *n)
    }
}

/// A model's blocks, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCosts {
    /// What the model is (for the report).
    pub name: String,
    /// Its blocks.
    pub blocks: Vec<BlockCosts>,
    /// The tensor-parallel degrees every block supports.
    pub tp_degrees: Vec<u32>,
}

/// The cost of a collective between devices: `alpha_s` per message round, `bytes_per_s` of
/// bandwidth per rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct AlphaBeta {
    /// Seconds per round of messages.
    pub alpha_s: f64,
    /// Bytes per second each rank moves.
    pub bytes_per_s: f64,
}

impl AlphaBeta {
    /// A ring all-reduce of `bytes` over `n` ranks: `2(n−1)` rounds, `2(n−1)/n` of the bytes.
    pub fn all_reduce_s(&self, bytes: f64, n: u32) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n = f64::from(n);
        2.0 * (n - 1.0) * self.alpha_s + 2.0 * (n - 1.0) / n * bytes / self.bytes_per_s
    }

    /// A ring all-gather (or reduce-scatter) of a `bytes` buffer over `n` ranks: half an
    /// all-reduce.
    pub fn all_gather_s(&self, bytes: f64, n: u32) -> f64 {
        self.all_reduce_s(bytes, n) / 2.0
    }
}

/// The machine a plan is for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// Devices (ranks) to use, all of them.
    pub devices: u32,
    /// Devices in one node (they share `link`; nodes talk over `inter_link`); 0 or
    /// `devices` or more: one node.
    #[serde(default)]
    pub devices_per_node: u32,
    /// Cores the devices' compute shares (on a GPU machine: as many as devices).
    pub cores: u32,
    /// Bytes of memory per device.
    pub memory_per_device: u64,
    /// Collectives between the devices of a node.
    pub link: AlphaBeta,
    /// Collectives between nodes (one leader per node, as `comm::hierarchical` runs them).
    #[serde(default)]
    pub inter_link: AlphaBeta,
    /// Per tensor-parallel degree, `(degree, share)`: when ranks outnumber cores, a split
    /// block's all-reduces wait for partners off the core for this share of its compute
    /// (measured; none: no wait).
    #[serde(default)]
    pub tp_wait: Vec<(u32, f64)>,
    /// Seconds a step of data-parallel replicas spends beyond `step_overhead_s` (handing the
    /// gradients to the reduction, waiting for the last replica, the Supervisor's messages to
    /// every rank), measured at the machine's device count.
    #[serde(default)]
    pub replica_sync_s: f64,
    /// Seconds the optimizer takes per parameter element it steps.
    pub optimizer_s_per_param: f64,
    /// Seconds of the runtime's own per step (messages, scheduling), measured.
    pub step_overhead_s: f64,
    /// Seconds a pipeline send keeps its stage busy, and from its end until the receiver
    /// has the message (measured).
    pub pipeline_send_s: (f64, f64),
}

impl Machine {
    /// Devices per node, `devices` for one node.
    fn node_size(&self) -> u32 {
        if self.devices_per_node == 0 {
            self.devices.max(1)
        } else {
            self.devices_per_node.min(self.devices.max(1))
        }
    }

    /// A group of `members` ranks `stride` apart (the mesh's placement, MESH-1: tp
    /// innermost, then dp, then pp, as Megatron places them): its members per node and the
    /// nodes it spans.
    pub fn group_span(&self, members: u32, stride: u32) -> (u32, u32) {
        let members = members.max(1);
        let per_node = (self.node_size() / stride.max(1)).clamp(1, members);
        (per_node, members.div_ceil(per_node))
    }

    /// The link between nodes (`link` where none was given).
    fn between_nodes(&self) -> AlphaBeta {
        if self.inter_link.bytes_per_s > 0.0 {
            self.inter_link
        } else {
            self.link
        }
    }

    /// An all-reduce of `bytes` over a group of `members` ranks `stride` apart: a ring inside
    /// each node, then between one leader per node (`comm::hierarchical`).
    pub fn all_reduce_s(&self, bytes: f64, members: u32, stride: u32) -> f64 {
        let (inside, nodes) = self.group_span(members, stride);
        self.link.all_reduce_s(bytes, inside) + self.between_nodes().all_reduce_s(bytes, nodes)
    }

    /// An all-gather (or reduce-scatter) over the same group: half an all-reduce inside one
    /// node; across nodes `comm::hierarchical` runs it as a whole all-reduce (HIER-1).
    pub fn all_gather_s(&self, bytes: f64, members: u32, stride: u32) -> f64 {
        let whole = self.all_reduce_s(bytes, members, stride);
        if self.group_span(members, stride).1 > 1 {
            whole
        } else {
            whole / 2.0
        }
    }
}

/// A candidate layout: one way to lay a job out over the machine, as the planner ranks them
/// (the mesh a job then runs on is a [`crate::mesh::Layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Candidate {
    /// Data-parallel replicas.
    pub dp: u32,
    /// Pipeline stages.
    pub pp: u32,
    /// Tensor-parallel degree.
    pub tp: u32,
    /// ZeRO stage, 0 to 3.
    pub zero: u8,
    /// Micro-batches per replica and step (the pipeline's; 1 without one).
    pub micro_batches: u32,
    /// Every block recomputes its forward in the backward.
    pub recompute: bool,
}

impl Candidate {
    /// One device: no parallelism, one micro-batch.
    pub const ONE_DEVICE: Candidate = Candidate {
        dp: 1,
        pp: 1,
        tp: 1,
        zero: 0,
        micro_batches: 1,
        recompute: false,
    };
}

impl std::fmt::Display for Candidate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dp {} × pp {} × tp {}, ZeRO-{}, {} micro-batch{}{}",
            self.dp,
            self.pp,
            self.tp,
            self.zero,
            self.micro_batches,
            if self.micro_batches == 1 { "" } else { "es" },
            if self.recompute { ", recompute" } else { "" }
        )
    }
}

/// Bytes the fullest rank holds, as the workers count them (MEM-1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PredictedBytes {
    /// Parameters: whole blocks at their peak plus shards.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state (Adam's two moments).
    pub optimizer: u64,
    /// Stashed boundary tensors at the peak.
    pub activations: u64,
}

impl PredictedBytes {
    /// All four.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations
    }
}

/// What [`predict`] says of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Seconds of one step.
    pub step_s: f64,
    /// Of it: the pipeline's makespan (compute, tensor-parallel collectives and bubbles).
    pub pipeline_s: f64,
    /// The pipeline's bubble (idle share of its makespan; 0 without a pipeline).
    pub bubble: f64,
    /// The data-parallel reduction (and ZeRO's gathers).
    pub dp_comm_s: f64,
    /// The tensor-parallel all-reduces, inside `pipeline_s`.
    pub tp_comm_s: f64,
    /// The optimizer step.
    pub optimizer_s: f64,
    /// Bytes of the fullest rank.
    pub bytes: PredictedBytes,
}

/// Why a layout cannot run as asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unfit {
    /// It needs more memory than a device has.
    Memory {
        /// Bytes the fullest rank would hold.
        needs: u64,
        /// Bytes a device has.
        has: u64,
    },
    /// Its shape does not fit the model or the batch (the reason).
    Shape(String),
}

impl std::fmt::Display for Unfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unfit::Memory { needs, has } => write!(
                f,
                "needs {:.1} MiB on its fullest device, which has {:.1} MiB",
                *needs as f64 / 1048576.0,
                *has as f64 / 1048576.0
            ),
            Unfit::Shape(why) => f.write_str(why),
        }
    }
}

/// Every layout of `devices` for `model` and a global batch of `batch` (PLANNER-1), with the
/// micro-batch counts in `micro_batches` (pipelines only; 1 otherwise).
pub fn layouts(
    model: &ModelCosts,
    devices: u32,
    batch: u32,
    micro_batches: &[u32],
) -> Vec<Candidate> {
    let blocks = model.blocks.len() as u32;
    let mut out = Vec::new();
    for tp in model.tp_degrees.iter().copied().filter(|t| *t >= 1) {
        for pp in 1..=blocks.min(devices) {
            if !devices.is_multiple_of(tp * pp) || !blocks.is_multiple_of(pp) {
                continue;
            }
            let dp = devices / (tp * pp);
            if dp == 0 || !batch.is_multiple_of(dp) {
                continue;
            }
            let ms: Vec<u32> = if pp == 1 {
                vec![1]
            } else {
                micro_batches
                    .iter()
                    .copied()
                    .filter(|m| *m >= 1 && (batch / dp).is_multiple_of(*m))
                    .collect()
            };
            // ZeRO shards over the replicas: with one there is nothing to shard.
            let zeros = if dp > 1 { 0..=3u8 } else { 0..=0 };
            for micro_batches in ms {
                for zero in zeros.clone() {
                    for recompute in [false, true] {
                        out.push(Candidate {
                            dp,
                            pp,
                            tp,
                            zero,
                            micro_batches,
                            recompute,
                        });
                    }
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The schedule a pipelined layout runs over `blocks` blocks: interleaved (one chunk per
/// block of a stage) where a stage holds several blocks, 1F1B where it holds one (so any
/// micro-batch count runs); `meshwork plan`'s jobs are built with it.
pub fn pipeline_schedule(layout: &Candidate, blocks: u32) -> Schedule {
    let virtual_stages = blocks / layout.pp.max(1);
    if virtual_stages > 1 {
        Schedule::Interleaved {
            virtual_stages,
            micro_batches: layout.micro_batches,
        }
    } else {
        Schedule::OneFOneB {
            micro_batches: layout.micro_batches,
        }
    }
}

/// The instructions a layout runs: [`pipeline_schedule`]'s for pp > 1, the block job's
/// sequential list otherwise.
fn schedule_of(layout: &Candidate, blocks: u32) -> Result<PipelineSchedule, ScheduleError> {
    if layout.pp <= 1 {
        return PipelineSchedule::sequential(blocks, layout.micro_batches);
    }
    pipeline_schedule(layout, blocks).instructions(layout.pp)
}

/// The step time and bytes of `layout` for `model` on `machine` at a global batch of `batch`
/// samples, or why it does not fit.
pub fn predict(
    model: &ModelCosts,
    machine: &Machine,
    layout: &Candidate,
    batch: u32,
) -> Result<Prediction, Unfit> {
    let blocks = model.blocks.len() as u32;
    let Candidate {
        dp,
        pp,
        tp,
        zero,
        micro_batches: m,
        recompute,
    } = *layout;
    let shape = |why: String| Err(Unfit::Shape(why));
    if dp == 0 || pp == 0 || tp == 0 || m == 0 {
        return shape("every degree and the micro-batches must be at least 1".into());
    }
    if dp * pp * tp != machine.devices {
        return shape(format!(
            "dp × pp × tp = {} is not the machine's {} devices",
            dp * pp * tp,
            machine.devices
        ));
    }
    if blocks == 0 || !blocks.is_multiple_of(pp) {
        return shape(format!("{blocks} blocks do not split over {pp} stages"));
    }
    if !batch.is_multiple_of(dp * m) {
        return shape(format!(
            "a global batch of {batch} does not split into {dp} replicas × {m} micro-batches"
        ));
    }
    if zero > 3 {
        return shape(format!("ZeRO stage {zero}: 0 to 3"));
    }
    let mut held = vec![0u64; pp as usize];
    for (b, block) in model.blocks.iter().enumerate() {
        let Some(n) = block.params_at(tp) else {
            return shape(format!("block {b} does not split over tp {tp}"));
        };
        held[b % pp as usize] += n;
    }
    let samples = f64::from(batch / (dp * m));
    let wait_share = if machine.devices > machine.cores {
        machine
            .tp_wait
            .iter()
            .find(|(t, _)| *t == tp)
            .map_or(0.0, |(_, w)| *w)
    } else {
        0.0
    };
    // Seconds per micro-batch of each stage, forward and backward, tp collectives included.
    let mut forward = vec![0.0f64; pp as usize];
    let mut backward = vec![0.0f64; pp as usize];
    let mut tp_comm = vec![0.0f64; pp as usize];
    for (b, block) in model.blocks.iter().enumerate() {
        let s = b % pp as usize;
        let split = if block.splits { f64::from(tp) } else { 1.0 };
        // The per-sample work splits over tp; launching the block's operations does not.
        let f = block.forward_fixed_s + block.forward_s * samples / split;
        let bw = block.backward_fixed_s
            + block.backward_s * samples / split
            + if recompute { f } else { 0.0 };
        let comm = if block.splits && tp > 1 {
            let per_direction = block.tp_bytes as f64 * samples / 2.0;
            // One all-reduce each way (Megatron's f and g), a recomputed forward's again; the
            // waits for partners off the core grow with the compute between them.
            let once = machine.all_reduce_s(per_direction, tp, 1);
            (
                once + wait_share * f,
                once + if recompute { once } else { 0.0 } + wait_share * bw,
            )
        } else {
            (0.0, 0.0)
        };
        forward[s] += f + comm.0;
        backward[s] += bw + comm.1;
        tp_comm[s] += comm.0 + comm.1;
    }
    let schedule = schedule_of(layout, blocks).map_err(|e| Unfit::Shape(e.to_string()))?;
    // The simulator's costs are per chunk: a stage's blocks share its time.
    let chunks = f64::from(schedule.virtual_stages().max(1));
    // A pipeline whose stages span nodes carries the boundary tensor over the inter-node link;
    // the simulator has one send cost, so every boundary pays it.
    let (_, nodes_of_pipeline) = machine.group_span(pp, tp * dp);
    let boundary = model
        .blocks
        .iter()
        .map(|b| b.recompute_stash_bytes)
        .max()
        .unwrap_or(0) as f64
        * samples;
    let between = machine.between_nodes();
    let crossing = if nodes_of_pipeline > 1 {
        between.alpha_s + boundary / between.bytes_per_s.max(1.0)
    } else {
        0.0
    };
    let run = |slowdown: f64| -> Result<(f64, f64, Vec<u32>), Unfit> {
        let ns = |s: f64| (s * slowdown / chunks * 1e9).round().max(1.0) as u64;
        let (send, latency) = machine.pipeline_send_s;
        let latency = latency + crossing;
        let whole = |s: f64| (s * 1e9).round().max(0.0) as u64;
        let mut costs = Costs::new(1, 1).with_communication(whole(send), whole(latency));
        for s in 0..pp as usize {
            let ss = StageIndex(s as u32);
            costs = costs.with_stage(ss, ns(forward[s]), ns(backward[s]));
        }
        let report = simulate(&schedule, &costs).map_err(|e| Unfit::Shape(e.to_string()))?;
        let stash = report.per_stage.iter().map(|s| s.peak_stash).collect();
        Ok((report.makespan as f64 * 1e-9, report.bubble, stash))
    };
    // Ranks busy at once: all of them but the bubble's share; past the cores, each computes
    // that much slower.
    let ranks = f64::from(machine.devices);
    let cores = f64::from(machine.cores.max(1));
    let (_, bubble0, _) = run(1.0)?;
    let slowdown = (ranks * (1.0 - bubble0) / cores).max(1.0);
    let (pipeline_s, bubble, peak_stash) = run(slowdown)?;
    let fullest = held.iter().copied().max().unwrap_or(0);
    let grad_bytes = 4.0 * fullest as f64;
    let all_reduce = machine.all_reduce_s(grad_bytes, dp, tp);
    let all_gather = machine.all_gather_s(grad_bytes, dp, tp);
    let dp_comm_s = match zero {
        0 => all_reduce,
        // A block job reduce-scatters the gradient at stage 1 as at stage 2 and all-gathers
        // the stepped parameters: the same bytes as an all-reduce.
        1 | 2 => 2.0 * all_gather,
        // The parameters gathered for every micro-batch's forward and again for its backward,
        // the gradient reduce-scattered once.
        _ => all_gather * (1.0 + 2.0 * f64::from(m)),
    };
    let stepped = if zero >= 1 {
        fullest as f64 / f64::from(dp)
    } else {
        fullest as f64
    };
    let optimizer_s = stepped * machine.optimizer_s_per_param;
    let replicas_s = if dp > 1 { machine.replica_sync_s } else { 0.0 };
    let step_s = pipeline_s + dp_comm_s + optimizer_s + machine.step_overhead_s + replicas_s;
    // The fullest rank's bytes: every stage's, the largest.
    let bytes = (0..pp as usize)
        .map(|s| {
            stage_bytes(
                model,
                layout,
                &schedule,
                (s, held[s]),
                samples / chunks,
                peak_stash.get(s),
            )
        })
        .max_by_key(PredictedBytes::total)
        .unwrap_or_default();
    if bytes.total() > machine.memory_per_device {
        return Err(Unfit::Memory {
            needs: bytes.total(),
            has: machine.memory_per_device,
        });
    }
    Ok(Prediction {
        step_s,
        pipeline_s,
        bubble: if pp > 1 { bubble } else { 0.0 },
        dp_comm_s,
        tp_comm_s: tp_comm.iter().copied().fold(0.0, f64::max),
        optimizer_s,
        bytes,
    })
}

/// Every layout with its prediction or why it does not fit, the fitting ones fastest first.
pub fn plan(
    model: &ModelCosts,
    machine: &Machine,
    batch: u32,
    micro_batches: &[u32],
) -> Vec<(Candidate, Result<Prediction, Unfit>)> {
    let mut out: Vec<(Candidate, Result<Prediction, Unfit>)> =
        layouts(model, machine.devices, batch, micro_batches)
            .into_iter()
            .map(|l| (l, predict(model, machine, &l, batch)))
            .collect();
    out.sort_by(|a, b| match (&a.1, &b.1) {
        (Ok(x), Ok(y)) => x.step_s.total_cmp(&y.step_s),
        (Ok(_), Err(_)) => std::cmp::Ordering::Less,
        (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
        (Err(_), Err(_)) => a.0.cmp(&b.0),
    });
    out
}

#[cfg(test)]
mod tests;
