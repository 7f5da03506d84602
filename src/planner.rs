//! `meshwork plan`'s model: a layout's step time and bytes per device, predicted from
//! measured costs before anything runs.
//!
//! A model is a list of blocks ([`ModelCosts`]): for each, its parameter elements at every
//! tensor-parallel degree it splits over, its forward and backward seconds per sample on one
//! core (measured), the bytes of the boundary tensor it stashes per sample, and the bytes its
//! tensor-parallel all-reduces move per sample. A machine ([`Machine`]) is its devices, the
//! cores they share, the memory of each, an α–β cost of a collective between its devices and
//! the optimizer's seconds per parameter (both measured). A [`Layout`] is dp × pp × tp, the
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
//!   overlapped with compute; inside a node and between nodes (PLAN-3); when ranks
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
//! - PLAN-1 (enumeration): [`layouts`] lists every dp × pp × tp = devices with tp among the
//!   model's degrees, pp at most the blocks and dividing them, dp and the micro-batches
//!   dividing the global batch, each ZeRO stage (dp > 1; with one replica there is nothing to
//!   shard) and recomputation on and off, once each.
//! - PLAN-2 (monotone): more devices of data parallelism never predict less compute per
//!   rank; a layout that does not fit names the bytes it needs and the device's.
//! - PLAN-3 (nodes): ranks are placed as the mesh places them (MESH-1: tp innermost, then dp,
//!   then pp); a group that spans nodes reduces inside each node over `link`, then between
//!   one leader per node over `inter_link` (`comm::hierarchical`'s plan, which runs an
//!   all-gather or reduce-scatter as a whole all-reduce), and a pipeline that spans nodes
//!   carries its boundary tensors over `inter_link`; so, for the same nodes, a slower link
//!   between them never predicts a faster step, and bytes do not depend on the nodes.

use serde::{Deserialize, Serialize};

use crate::parallel::pipeline::{
    Costs, InstrKind, PipelineSchedule, Schedule, ScheduleError, StageIndex, simulate,
};

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

/// One way to lay a job out over the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Layout {
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

impl Layout {
    /// One device: no parallelism, one micro-batch.
    pub const ONE_DEVICE: Layout = Layout {
        dp: 1,
        pp: 1,
        tp: 1,
        zero: 0,
        micro_batches: 1,
        recompute: false,
    };
}

impl std::fmt::Display for Layout {
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

/// Every layout of `devices` for `model` and a global batch of `batch` (PLAN-1), with the
/// micro-batch counts in `micro_batches` (pipelines only; 1 otherwise).
pub fn layouts(model: &ModelCosts, devices: u32, batch: u32, micro_batches: &[u32]) -> Vec<Layout> {
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
                        out.push(Layout {
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
pub fn pipeline_schedule(layout: &Layout, blocks: u32) -> Schedule {
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
fn schedule_of(layout: &Layout, blocks: u32) -> Result<PipelineSchedule, ScheduleError> {
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
    layout: &Layout,
    batch: u32,
) -> Result<Prediction, Unfit> {
    let blocks = model.blocks.len() as u32;
    let Layout {
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
        1 => all_reduce + all_gather,
        2 => 2.0 * all_gather,
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

/// The bytes a rank of stage `s` holds (MEM-1): `held` parameter elements, its blocks'
/// boundary tensors for `per_chunk` samples' worth of each stashed chunk, `stash` chunks at
/// the peak; ZeRO-3's gathered parameters and ZeRO-2's gradients from [`walk_stage`].
fn stage_bytes(
    model: &ModelCosts,
    layout: &Layout,
    schedule: &PipelineSchedule,
    (s, held): (usize, u64),
    per_chunk: f64,
    stash: Option<&u32>,
) -> PredictedBytes {
    let (dp, pp, tp, zero) = (layout.dp, layout.pp as usize, layout.tp, layout.zero);
    let shard = |bytes: u64, from: u8| {
        if zero >= from {
            bytes.div_ceil(u64::from(dp))
        } else {
            bytes
        }
    };
    let mine = || {
        model
            .blocks
            .iter()
            .enumerate()
            .filter(move |(b, _)| b % pp == s)
            .map(|(_, blk)| blk)
    };
    let walked = walk_stage(model, layout, schedule, s);
    let params = if zero >= 3 {
        // With recomputation the block computing and the one gathered ahead are whole (MEM-3);
        // without, every block keeps the parameters of each forward until its backward.
        let largest = mine().filter_map(|b| b.params_at(tp)).max().unwrap_or(0);
        let whole = if layout.recompute {
            4 * 2 * largest
        } else {
            walked.full_params
        };
        whole + shard(4 * held, 3)
    } else {
        4 * held
    };
    let stash_per_sample: u64 = mine()
        .map(|b| {
            if layout.recompute {
                b.recompute_stash_bytes
            } else {
                b.stash_bytes
            }
        })
        .sum();
    let activations =
        stash_per_sample as f64 * per_chunk * f64::from(stash.copied().unwrap_or(1).max(1));
    PredictedBytes {
        params,
        grads: if zero >= 2 { walked.grads } else { 4 * held },
        optimizer: shard(8 * held, 1),
        activations: activations.round() as u64,
    }
}

/// The peaks of one stage's step, walked instruction by instruction as the worker counts
/// them (MEM-2).
#[derive(Debug, Default)]
struct Walked {
    /// Gathered parameters kept for pending backwards (ZeRO-3 without recomputation): a
    /// block's whole parameters once for every micro-batch forwarded and not yet backwarded.
    full_params: u64,
    /// Gradients with ZeRO-2 on: a block's whole gradient from its first backward until its
    /// last micro-batch's backward is done (then its reduction takes it to a shard); blocks
    /// not yet reached hold none.
    grads: u64,
}

fn walk_stage(
    model: &ModelCosts,
    layout: &Layout,
    schedule: &PipelineSchedule,
    s: usize,
) -> Walked {
    let blocks = model.blocks.len();
    let whole: Vec<u64> = model
        .blocks
        .iter()
        .map(|b| 4 * b.params_at(layout.tp).unwrap_or(0))
        .collect();
    let part = |b: usize| whole[b].div_ceil(u64::from(layout.dp.max(1)));
    let mut pending = vec![0u64; blocks];
    let mut backwards = vec![0u32; blocks];
    let mut out = Walked::default();
    let stage = StageIndex(s as u32);
    for instr in schedule.list(stage) {
        let b = schedule.block(stage, instr.chunk()) as usize;
        if b >= blocks {
            continue;
        }
        match instr.kind() {
            InstrKind::Forward => pending[b] += 1,
            InstrKind::Backward => backwards[b] += 1,
            _ => continue,
        }
        let full: u64 = (0..blocks).map(|k| whole[k] * pending[k]).sum();
        out.full_params = out.full_params.max(full);
        let grads: u64 = (0..blocks)
            .map(|k| match backwards[k] {
                0 => 0,
                n if n >= layout.micro_batches && k != b => part(k),
                _ => whole[k],
            })
            .sum();
        out.grads = out.grads.max(grads);
        if instr.kind() == InstrKind::Backward {
            pending[b] = pending[b].saturating_sub(1);
        }
    }
    out
}

/// Every layout with its prediction or why it does not fit, the fitting ones fastest first.
pub fn plan(
    model: &ModelCosts,
    machine: &Machine,
    batch: u32,
    micro_batches: &[u32],
) -> Vec<(Layout, Result<Prediction, Unfit>)> {
    let mut out: Vec<(Layout, Result<Prediction, Unfit>)> =
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
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn model(blocks: usize) -> ModelCosts {
        ModelCosts {
            name: "test".into(),
            blocks: (0..blocks)
                .map(|i| BlockCosts {
                    params: vec![(1, 1000 + i as u64), (2, 500 + i as u64)],
                    forward_s: 1e-4,
                    forward_fixed_s: 1e-5,
                    backward_s: 2e-4,
                    backward_fixed_s: 2e-5,
                    stash_bytes: 256,
                    recompute_stash_bytes: 128,
                    splits: true,
                    tp_bytes: 512,
                })
                .collect(),
            tp_degrees: vec![1, 2],
        }
    }

    fn machine(devices: u32) -> Machine {
        Machine {
            devices,
            devices_per_node: 0,
            cores: devices,
            memory_per_device: 1 << 30,
            link: AlphaBeta {
                alpha_s: 1e-5,
                bytes_per_s: 1e9,
            },
            inter_link: AlphaBeta {
                alpha_s: 5e-5,
                bytes_per_s: 1e8,
            },
            tp_wait: vec![(2, 0.1)],
            replica_sync_s: 1e-4,
            optimizer_s_per_param: 1e-9,
            step_overhead_s: 1e-4,
            pipeline_send_s: (1e-5, 1e-5),
        }
    }

    proptest! {
        /// PLAN-1: every listed layout uses the devices, splits the blocks and the batch, and
        /// appears once.
        #[test]
        fn plan_1_layouts_cover_the_machine_once(
            blocks in 1usize..9,
            devices in 1u32..9,
            batch in 1u32..65,
        ) {
            let m = model(blocks);
            let all = layouts(&m, devices, batch, &[1, 2, 4]);
            let mut seen = std::collections::BTreeSet::new();
            for l in &all {
                prop_assert!(seen.insert(*l));
                prop_assert_eq!(l.dp * l.pp * l.tp, devices);
                prop_assert_eq!(blocks as u32 % l.pp, 0);
                prop_assert_eq!(batch % (l.dp * l.micro_batches), 0);
                prop_assert!(l.pp > 1 || l.micro_batches == 1);
                prop_assert!(l.dp > 1 || l.zero == 0);
            }
            // dp over all devices (tp 1, pp 1) is there whenever the batch splits.
            let dp_only = all.iter().any(|l| l.dp == devices && l.pp == 1 && l.tp == 1);
            prop_assert_eq!(dp_only, batch % devices == 0);
        }

        /// PLAN-2: more data-parallel devices (enough cores) never predict more pipeline time
        /// per step; the optimizer's share falls with ZeRO; bytes fall with every ZeRO stage.
        #[test]
        fn plan_2_more_replicas_and_zero_stages_never_cost_more(
            blocks in 1usize..6,
            k in 0u32..3,
        ) {
            let m = model(blocks);
            let batch = 16;
            let small = 1u32 << k;
            let base = Layout { dp: small, pp: 1, tp: 1, zero: 0, micro_batches: 1, recompute: false };
            let big = Layout { dp: 2 * small, ..base };
            let a = predict(&m, &machine(small), &base, batch).expect("fits");
            let b = predict(&m, &machine(2 * small), &big, batch).expect("fits");
            prop_assert!(b.pipeline_s <= a.pipeline_s * (1.0 + 1e-9));
            let mut last = u64::MAX;
            for zero in 0..=3u8 {
                let p = predict(&m, &machine(2 * small), &Layout { zero, ..big }, batch).expect("fits");
                prop_assert!(p.bytes.grads + p.bytes.optimizer <= last);
                last = p.bytes.grads + p.bytes.optimizer;
            }
        }
    }

    proptest! {
        /// PLAN-3 (nodes): the same layout over the same nodes never predicts a faster step
        /// when the link between them is slower, and one node as large as the machine
        /// predicts what the machine without nodes does.
        #[test]
        fn plan_3_slower_links_between_nodes_never_speed_a_step(
            blocks in 1usize..6,
            per_node_log in 0u32..3,
            pick in 0usize..64,
            slower in 1.0f64..100.0,
        ) {
            let m = model(blocks);
            let one = machine(8);
            let all = layouts(&m, 8, 16, &[1, 2, 4]);
            let layout = all[pick % all.len()];
            // A layout the schedule refuses is refused on every machine.
            let Ok(base) = predict(&m, &one, &layout, 16) else {
                return Ok(());
            };
            let whole = Machine { devices_per_node: 8, ..one.clone() };
            prop_assert_eq!(predict(&m, &whole, &layout, 16).expect("fits"), base);
            let fast = Machine { devices_per_node: 1 << per_node_log, inter_link: one.link, ..one.clone() };
            let slow = Machine {
                inter_link: AlphaBeta {
                    alpha_s: one.link.alpha_s * slower,
                    bytes_per_s: one.link.bytes_per_s / slower,
                },
                ..fast.clone()
            };
            let f = predict(&m, &fast, &layout, 16).expect("fits");
            let s = predict(&m, &slow, &layout, 16).expect("fits");
            prop_assert!(s.step_s >= f.step_s * (1.0 - 1e-12), "{layout}: {s:?} vs {f:?}");
            prop_assert_eq!(s.bytes, base.bytes);
            prop_assert_eq!(f.bytes, base.bytes);
        }
    }

    #[test]
    fn zero_bytes_follow_the_stages_instructions() {
        // Four equal blocks of 1,000 elements (tp 1) on one stage, dp 4, one micro-batch: the
        // backwards run 3, 2, 1, 0; ZeRO-2 holds the block being reduced whole beside the
        // shards of those already reduced.
        let mut m = model(4);
        for b in &mut m.blocks {
            b.params = vec![(1, 1000), (2, 500)];
        }
        let dp4 = Layout {
            dp: 4,
            pp: 1,
            tp: 1,
            zero: 2,
            micro_batches: 1,
            recompute: false,
        };
        let p = predict(&m, &machine(4), &dp4, 16).expect("fits");
        assert_eq!(p.bytes.grads, 4000 + 3 * 1000);
        // ZeRO-3 without recomputation: every block's gathered parameters kept until its
        // backward, beside the shards.
        let p = predict(&m, &machine(4), &Layout { zero: 3, ..dp4 }, 16).expect("fits");
        assert_eq!(p.bytes.params, 4 * 4000 + 4 * 1000);
        // A pipeline of 2 stages (blocks 0, 2 and 1, 3) with 4 micro-batches at dp 2: every
        // block's gradient accumulates whole before it can be scattered, and a ZeRO-3 block
        // keeps a gathered copy for each micro-batch forwarded and not yet backwarded.
        let piped = Layout {
            dp: 2,
            pp: 2,
            micro_batches: 4,
            ..dp4
        };
        let p = predict(&m, &machine(4), &piped, 16).expect("fits");
        assert_eq!(p.bytes.grads, 2 * 4000);
        let schedule = schedule_of(&piped, 4).expect("a schedule");
        let most_in_flight = u64::from(schedule.peak_stash().into_iter().max().unwrap_or(1));
        let p = predict(&m, &machine(4), &Layout { zero: 3, ..piped }, 16).expect("fits");
        assert!(p.bytes.params > 2 * 4000 + 4000, "{p:?}");
        assert!(p.bytes.params <= most_in_flight * 4000 + 4000, "{p:?}");
    }

    #[test]
    fn groups_span_nodes_by_the_placement() {
        let m = Machine {
            devices_per_node: 4,
            ..machine(16)
        };
        // tp 4 fills a node; dp 4 over tp 4 spans four nodes, one member each.
        assert_eq!(m.group_span(4, 1), (4, 1));
        assert_eq!(m.group_span(4, 4), (1, 4));
        // dp 8 two apart (tp 2): two members per node, four nodes.
        assert_eq!(m.group_span(8, 2), (2, 4));
        // One node: everything inside.
        let one = machine(16);
        assert_eq!(one.group_span(16, 1), (16, 1));
    }

    #[test]
    fn a_layout_that_does_not_fit_says_what_it_needs() {
        let m = model(4);
        let mut small = machine(2);
        small.memory_per_device = 1000;
        let l = Layout {
            dp: 2,
            pp: 1,
            tp: 1,
            zero: 0,
            micro_batches: 1,
            recompute: false,
        };
        match predict(&m, &small, &l, 8) {
            Err(Unfit::Memory { needs, has }) => {
                assert_eq!(has, 1000);
                assert!(needs > has);
            }
            other => panic!("{other:?}"),
        }
        let err = predict(&m, &machine(2), &Layout { dp: 3, ..l }, 8).unwrap_err();
        assert!(err.to_string().contains("3"), "{err}");
    }

    #[test]
    fn equal_stages_give_the_schedules_bubble() {
        let m = model(4);
        let l = Layout {
            dp: 1,
            pp: 2,
            tp: 1,
            zero: 0,
            micro_batches: 4,
            recompute: false,
        };
        let p = predict(&m, &machine(2), &l, 8).expect("fits");
        assert!(p.bubble > 0.0 && p.bubble < 0.5, "{p:?}");
        let one = predict(
            &m,
            &machine(1),
            &Layout {
                pp: 1,
                micro_batches: 1,
                ..l
            },
            8,
        )
        .expect("fits");
        assert!(p.pipeline_s < one.pipeline_s, "{p:?} vs {one:?}");
    }
}
