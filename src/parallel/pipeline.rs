//! Pipeline schedules as data: which instruction each pipeline stage runs, in which order.
//!
//! Pure (no tokio, no ractor, no Burn, no I/O). [`Schedule::instructions`] turns a schedule
//! (GPipe, 1F1B, interleaved 1F1B) and a number of stages K into a [`PipelineSchedule`]: one
//! list of [`Instr`] per stage, which a stage actor runs literally, communication included.
//! [`simulate`] runs any such lists with given [`Costs`] and checks them; [`summarize`]
//! measures a timeline (simulated, or recorded by an executor) and [`render_svg`] draws it.
//!
//! # Model
//!
//! The model is cut into `K·v` consecutive *blocks* (v = 1 except for interleaved 1F1B). Stage
//! (device) `d` holds `v` model *chunks*; chunk `c` of stage `d` is block `c·K + d`
//! (Megatron-LM's layout), so with v > 1 activations wrap from stage K−1 back to stage 0 for
//! the next chunk, and gradients wrap from stage 0 to stage K−1. The first block takes the
//! micro-batch's inputs; the last block computes the loss inside its forward, and its backward
//! starts from that loss (no gradient is received for it).
//!
//! # Buffering the lists assume
//!
//! Between two stages there is one FIFO *link* per direction of data (activations forward,
//! gradients backward) and per ordered pair of stages (a stage may be its own neighbour when
//! K = 1 and v > 1). A send puts one message into the link and returns at once while the link
//! holds fewer than [`PipelineSchedule::link_capacity`] messages; with the link full it waits
//! until the receiver takes one. A receive takes the message at the head of the link, waiting
//! while the link is empty. The generated lists need a capacity of [`LINK_CAPACITY`] = 1
//! message (more is allowed and never causes a deadlock); [`simulate`] enforces exactly the
//! capacity the schedule states (sends block on a full link), so lists that would need more
//! buffering end in [`ScheduleSimError::Deadlock`] on a send into a full link. Messages carry their
//! (micro-batch, chunk) so an executor can check them, but never needs to reorder them
//! (PIPE-3).
//!
//! # Invariants
//!
//! Tests name the id they check.
//!
//! - PIPE-1: every (micro-batch, chunk) is forwarded exactly once and backwarded exactly once
//!   on the stage that holds the chunk; a stage sends the activation (gradient) of a block
//!   exactly once unless it is the last (first) block, and receives the input activation
//!   (output gradient) of a block exactly once unless it is the first (last) block, always
//!   from/to the neighbouring block's stage. ([`validate`] checks it.)
//! - PIPE-2: dependency order within a list: a forward follows the receive of its input, a
//!   backward follows the forward of the same (micro-batch, chunk) and the receive of its
//!   output gradient, a send follows the compute that produced what it sends.
//! - PIPE-3: the messages of each link are received in the order they are sent (FIFO), each
//!   by the receive that names it, so an executor never reorders or matches by tag.
//! - PIPE-4: the generated lists never deadlock with links of [`LINK_CAPACITY`] messages,
//!   whatever the costs: which instruction waits for which is fixed by the lists alone.
//! - PIPE-5: with unit costs (forward = backward = 1 per chunk, free communication) the
//!   simulated bubble is exactly (K−1)/(M+K−1) for GPipe and 1F1B and (K−1)/(v·M+K−1) for
//!   interleaved 1F1B. The bubble is measured from the simulated timeline:
//!   `1 − Σ compute time / (K · makespan)`, i.e. the share of the interval from the step's
//!   first instruction start to its last instruction end that a stage spends not computing
//!   (waiting, sending, or done), averaged over stages ([`summarize`]).
//!   The equalities also hold exactly for any forward cost f and backward cost b when every
//!   stage has the same f and b and communication is free; with uneven stages or costly
//!   communication they do not (the simulator then measures what the lists really give).
//! - PIPE-6: peak stash (micro-batch chunks forwarded and not yet backwarded on a stage):
//!   GPipe M on every stage; 1F1B min(K − d, M) on stage d, so ≤ K; interleaved with v ≥ 2
//!   min((K−d−1)·2 + (v−1)·K + 1, v·M) chunks on stage d (Megatron-LM's warm-up + 1).
//! - PIPE-7: schedules a configuration cannot serve are refused with a [`ScheduleError`]
//!   naming the numbers, never a panic.
//!
//! # Choices
//!
//! - 1F1B accepts M < K: the schedule stays correct and the bubble formula still holds; stages
//!   whose warm-up (K−d−1) covers every micro-batch run GPipe's order, and no stage stashes
//!   more than M. Nothing is gained over GPipe there, but nothing is wrong either.
//! - Interleaved 1F1B needs M to be a multiple of K (micro-batches go round in groups of K,
//!   Megatron-LM's original rule); with v = 1 it gives the 1F1B lists.
//! - Receives sit immediately before the compute that needs them: with free communication no
//!   list makes a stage wait earlier than the data it needs.

mod partition;
mod schedule;
mod simulate;
mod svg;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

pub use partition::{balanced_split, even_split};
pub use simulate::{
    Costs, Needs, ScheduleSimError, SimReport, StageCosts, StageReport, TimedInstr, TimelineSummary,
};
pub use simulate::{simulate, summarize, validate};
pub use svg::render_svg;

/// The link capacity (messages per direction and ordered pair of stages) the generated lists
/// need to run without deadlock (PIPE-4): one message. An executor may buffer more; with
/// uneven stage costs a second slot lets a fast stage run one message further ahead
/// ([`PipelineSchedule::with_link_capacity`] simulates that).
pub const LINK_CAPACITY: u32 = 1;

/// A pipeline stage: a device's position in the pipeline, 0 for the first.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct StageIndex(pub u32);

/// A micro-batch of a step, numbered from 0 in the order the first stage takes them.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct MicroBatch(pub u32);

/// A model chunk of a stage (a virtual stage): chunk `c` of stage `d` is block `c·K + d`.
/// Always 0 without interleaving.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Chunk(pub u32);

macro_rules! display_index {
    ($($t:ty => $prefix:literal),*) => {$(
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, " {}"), self.0)
            }
        }
    )*};
}
display_index!(StageIndex => "stage", MicroBatch => "micro-batch", Chunk => "chunk");

impl StageIndex {
    /// The index as a `usize`, for indexing per-stage vectors.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One instruction of a stage's list. Every instruction names the (micro-batch, chunk) of the
/// stage running it: a send names the chunk whose output it sends, a receive the chunk whose
/// input (activation) or output gradient it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Instr {
    /// Take the input activation of (`mb`, `chunk`) from the link from stage `from`.
    RecvActivation {
        /// The micro-batch.
        mb: MicroBatch,
        /// The local chunk the activation is the input of.
        chunk: Chunk,
        /// The stage holding the previous block.
        from: StageIndex,
    },
    /// Run the forward of `chunk` on `mb` and stash what its backward needs; on the last block
    /// this includes the loss.
    Forward {
        /// The micro-batch.
        mb: MicroBatch,
        /// The local chunk.
        chunk: Chunk,
    },
    /// Put the output activation of (`mb`, `chunk`) into the link to stage `to`.
    SendActivation {
        /// The micro-batch.
        mb: MicroBatch,
        /// The local chunk whose output this is.
        chunk: Chunk,
        /// The stage holding the next block.
        to: StageIndex,
    },
    /// Take the gradient of the output of (`mb`, `chunk`) from the link from stage `from`.
    RecvGradient {
        /// The micro-batch.
        mb: MicroBatch,
        /// The local chunk whose output the gradient is for.
        chunk: Chunk,
        /// The stage holding the next block.
        from: StageIndex,
    },
    /// Run the backward of `chunk` on `mb` (from the loss on the last block, from the received
    /// output gradient elsewhere), accumulate parameter gradients, free the stash.
    Backward {
        /// The micro-batch.
        mb: MicroBatch,
        /// The local chunk.
        chunk: Chunk,
    },
    /// Put the gradient of the input of (`mb`, `chunk`) into the link to stage `to`.
    SendGradient {
        /// The micro-batch.
        mb: MicroBatch,
        /// The local chunk whose input the gradient is for.
        chunk: Chunk,
        /// The stage holding the previous block.
        to: StageIndex,
    },
}

/// The kind of an [`Instr`], without its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum InstrKind {
    /// [`Instr::RecvActivation`].
    RecvActivation,
    /// [`Instr::Forward`].
    Forward,
    /// [`Instr::SendActivation`].
    SendActivation,
    /// [`Instr::RecvGradient`].
    RecvGradient,
    /// [`Instr::Backward`].
    Backward,
    /// [`Instr::SendGradient`].
    SendGradient,
}

impl Instr {
    /// The micro-batch the instruction works on.
    pub fn mb(&self) -> MicroBatch {
        match *self {
            Instr::RecvActivation { mb, .. }
            | Instr::Forward { mb, .. }
            | Instr::SendActivation { mb, .. }
            | Instr::RecvGradient { mb, .. }
            | Instr::Backward { mb, .. }
            | Instr::SendGradient { mb, .. } => mb,
        }
    }

    /// The local chunk the instruction works on.
    pub fn chunk(&self) -> Chunk {
        match *self {
            Instr::RecvActivation { chunk, .. }
            | Instr::Forward { chunk, .. }
            | Instr::SendActivation { chunk, .. }
            | Instr::RecvGradient { chunk, .. }
            | Instr::Backward { chunk, .. }
            | Instr::SendGradient { chunk, .. } => chunk,
        }
    }

    /// What kind of instruction this is.
    pub fn kind(&self) -> InstrKind {
        match self {
            Instr::RecvActivation { .. } => InstrKind::RecvActivation,
            Instr::Forward { .. } => InstrKind::Forward,
            Instr::SendActivation { .. } => InstrKind::SendActivation,
            Instr::RecvGradient { .. } => InstrKind::RecvGradient,
            Instr::Backward { .. } => InstrKind::Backward,
            Instr::SendGradient { .. } => InstrKind::SendGradient,
        }
    }

    /// Whether this is a forward or a backward (compute, as opposed to communication).
    pub fn is_compute(&self) -> bool {
        matches!(self, Instr::Forward { .. } | Instr::Backward { .. })
    }

    /// The other stage of a send or receive (`None` for compute).
    pub fn peer(&self) -> Option<StageIndex> {
        match *self {
            Instr::RecvActivation { from, .. } | Instr::RecvGradient { from, .. } => Some(from),
            Instr::SendActivation { to, .. } | Instr::SendGradient { to, .. } => Some(to),
            Instr::Forward { .. } | Instr::Backward { .. } => None,
        }
    }
}

/// A pipeline schedule and its number of micro-batches per step: what a user picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Schedule {
    /// GPipe: every stage runs all its forwards, then all its backwards. Stashes all M
    /// micro-batches.
    GPipe {
        /// Micro-batches per step (M ≥ 1).
        micro_batches: u32,
    },
    /// 1F1B (PipeDream-flush): K − d − 1 warm-up forwards on stage d, then one forward and one
    /// backward in turn, then the remaining backwards. Same bubble as GPipe, at most K
    /// micro-batches stashed.
    OneFOneB {
        /// Micro-batches per step (M ≥ 1).
        micro_batches: u32,
    },
    /// Interleaved 1F1B (Megatron-LM): each stage holds `virtual_stages` model chunks, which
    /// divides the bubble by about v at the price of v times more messages.
    Interleaved {
        /// Micro-batches per step (M ≥ 1, a multiple of the number of stages).
        micro_batches: u32,
        /// Model chunks per stage (v ≥ 1).
        virtual_stages: u32,
    },
}

/// Why a schedule cannot serve a configuration (PIPE-7).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// A pipeline needs at least one stage.
    #[error("a pipeline needs at least 1 stage, got 0")]
    NoStages,
    /// A step needs at least one micro-batch.
    #[error("a pipeline step needs at least 1 micro-batch, got 0")]
    NoMicroBatches,
    /// Interleaving needs at least one model chunk per stage.
    #[error("interleaved 1F1B needs at least 1 virtual stage (model chunk) per stage, got 0")]
    NoVirtualStages,
    /// Interleaved 1F1B sends micro-batches round in groups of K.
    #[error(
        "interleaved 1F1B needs the micro-batches ({micro_batches}) to be a multiple of the \
         stages ({stages}): use {lower} or {higher} micro-batches, or 1F1B",
        lower = micro_batches / stages * stages,
        higher = (micro_batches / stages + 1) * stages
    )]
    MicroBatchesNotMultipleOfStages {
        /// Micro-batches asked for.
        micro_batches: u32,
        /// Stages of the pipeline.
        stages: u32,
    },
    /// Links must hold at least one message.
    #[error("a link between stages must hold at least 1 message, got 0")]
    NoLinkCapacity,
    /// Hand-made lists: one list per stage.
    #[error("{lists} instruction lists for {stages} stages: give one list per stage")]
    ListCount {
        /// Lists given.
        lists: usize,
        /// Stages of the pipeline.
        stages: u32,
    },
    /// The numbers overflow the 32-bit indices.
    #[error(
        "{stages} stages × {virtual_stages} chunks × {micro_batches} micro-batches is too large"
    )]
    TooLarge {
        /// Stages of the pipeline.
        stages: u32,
        /// Micro-batches per step.
        micro_batches: u32,
        /// Chunks per stage.
        virtual_stages: u32,
    },
}

impl Schedule {
    /// Micro-batches per step.
    pub fn micro_batches(&self) -> u32 {
        match *self {
            Schedule::GPipe { micro_batches }
            | Schedule::OneFOneB { micro_batches }
            | Schedule::Interleaved { micro_batches, .. } => micro_batches,
        }
    }

    /// Model chunks per stage (1 except for interleaved).
    pub fn virtual_stages(&self) -> u32 {
        match *self {
            Schedule::Interleaved { virtual_stages, .. } => virtual_stages,
            Schedule::GPipe { .. } | Schedule::OneFOneB { .. } => 1,
        }
    }

    /// The same schedule over `n` times its micro-batches: gradient accumulation over `n`
    /// passes of a pipeline is one pass over `n · M` micro-batches of the same size (what
    /// Megatron-LM's micro-batch count is), so `gradient_accumulation(n)` on a pipeline job
    /// runs this. `None` when `n · M` does not fit a `u32`.
    pub fn accumulated(self, n: u32) -> Option<Self> {
        let m = self.micro_batches().checked_mul(n)?;
        Some(match self {
            Schedule::GPipe { .. } => Schedule::GPipe { micro_batches: m },
            Schedule::OneFOneB { .. } => Schedule::OneFOneB { micro_batches: m },
            Schedule::Interleaved { virtual_stages, .. } => Schedule::Interleaved {
                micro_batches: m,
                virtual_stages,
            },
        })
    }

    /// The schedule called `name` (`gpipe`, `1f1b` or `interleaved`, the CLI's spelling) with
    /// `micro_batches` per step and, for `interleaved`, `virtual_stages` chunks per stage.
    pub fn from_name(name: &str, micro_batches: u32, virtual_stages: u32) -> Option<Self> {
        match name {
            "gpipe" => Some(Schedule::GPipe { micro_batches }),
            "1f1b" => Some(Schedule::OneFOneB { micro_batches }),
            "interleaved" => Some(Schedule::Interleaved {
                micro_batches,
                virtual_stages,
            }),
            _ => None,
        }
    }

    /// A short name: `gpipe`, `1f1b` or `interleaved` (the CLI's spelling).
    pub fn name(&self) -> &'static str {
        match self {
            Schedule::GPipe { .. } => "gpipe",
            Schedule::OneFOneB { .. } => "1f1b",
            Schedule::Interleaved { .. } => "interleaved",
        }
    }

    /// The textbook bubble for `stages` stages: (K−1)/(M+K−1), or (K−1)/(v·M+K−1) interleaved.
    /// What [`simulate`] measures with unit costs (PIPE-5); 0 for an empty configuration.
    pub fn theoretical_bubble(&self, stages: u32) -> f64 {
        let k = f64::from(stages);
        let vm = f64::from(self.virtual_stages()) * f64::from(self.micro_batches());
        if stages == 0 || vm == 0.0 {
            return 0.0;
        }
        (k - 1.0) / (vm + k - 1.0)
    }

    /// The instruction lists of this schedule for `stages` stages (PIPE-1..4), or why it cannot
    /// serve them (PIPE-7).
    pub fn instructions(&self, stages: u32) -> Result<PipelineSchedule, ScheduleError> {
        schedule::generate(self, stages)
    }
}

/// One instruction list per stage, with the dimensions they were made for. Stages run their
/// list in order, literally.
///
/// Serializable for traces and reports; build one from lists with
/// [`PipelineSchedule::from_lists`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PipelineSchedule {
    stages: u32,
    micro_batches: u32,
    virtual_stages: u32,
    link_capacity: u32,
    lists: Vec<Vec<Instr>>,
}

impl PipelineSchedule {
    /// Lists made elsewhere (by hand, or loaded). Only the dimensions are checked here;
    /// [`validate`] and [`simulate`] check the lists themselves.
    pub fn from_lists(
        stages: u32,
        micro_batches: u32,
        virtual_stages: u32,
        link_capacity: u32,
        lists: Vec<Vec<Instr>>,
    ) -> Result<Self, ScheduleError> {
        check_dimensions(stages, micro_batches, virtual_stages)?;
        if link_capacity == 0 {
            return Err(ScheduleError::NoLinkCapacity);
        }
        if lists.len() != stages as usize {
            return Err(ScheduleError::ListCount {
                lists: lists.len(),
                stages,
            });
        }
        Ok(Self {
            stages,
            micro_batches,
            virtual_stages,
            link_capacity,
            lists,
        })
    }

    /// The list of a block job: one stage holding all `blocks` as its chunks, each
    /// micro-batch forwarded through blocks 0..n then backwarded through n..0.
    pub fn sequential(blocks: u32, micro_batches: u32) -> Result<Self, ScheduleError> {
        schedule::sequential(blocks, micro_batches)
    }

    /// Stages (K).
    pub fn stages(&self) -> u32 {
        self.stages
    }

    /// Micro-batches per step (M).
    pub fn micro_batches(&self) -> u32 {
        self.micro_batches
    }

    /// Model chunks per stage (v).
    pub fn virtual_stages(&self) -> u32 {
        self.virtual_stages
    }

    /// Messages each link holds when these lists run (see the module docs); [`simulate`]
    /// enforces it.
    pub fn link_capacity(&self) -> u32 {
        self.link_capacity
    }

    /// The same lists run with links of `link_capacity` messages.
    pub fn with_link_capacity(mut self, link_capacity: u32) -> Result<Self, ScheduleError> {
        if link_capacity == 0 {
            return Err(ScheduleError::NoLinkCapacity);
        }
        self.link_capacity = link_capacity;
        Ok(self)
    }

    /// Every stage's list, indexed by stage.
    pub fn lists(&self) -> &[Vec<Instr>] {
        &self.lists
    }

    /// Stage `stage`'s list (empty if out of range).
    pub fn list(&self, stage: StageIndex) -> &[Instr] {
        self.lists.get(stage.index()).map_or(&[], Vec::as_slice)
    }

    /// Blocks of the whole model (K·v).
    pub fn blocks(&self) -> u32 {
        self.stages * self.virtual_stages
    }

    /// The block chunk `chunk` of `stage` holds: `chunk·K + stage` (for chunk < v, stage < K).
    pub fn block(&self, stage: StageIndex, chunk: Chunk) -> u32 {
        chunk.0.saturating_mul(self.stages).saturating_add(stage.0)
    }

    /// The stage and chunk holding `block`.
    pub fn placement(&self, block: u32) -> (StageIndex, Chunk) {
        (StageIndex(block % self.stages), Chunk(block / self.stages))
    }

    /// Peak stash per stage from the lists' order alone: the most (micro-batch, chunk) pairs
    /// forwarded and not yet backwarded (PIPE-6). Same as [`StageReport::peak_stash`].
    pub fn peak_stash(&self) -> Vec<u32> {
        self.lists
            .iter()
            .map(|list| {
                let (mut live, mut peak) = (0u32, 0u32);
                for instr in list {
                    match instr {
                        Instr::Forward { .. } => {
                            live += 1;
                            peak = peak.max(live);
                        }
                        Instr::Backward { .. } => live = live.saturating_sub(1),
                        _ => {}
                    }
                }
                peak
            })
            .collect()
    }
}

fn check_dimensions(
    stages: u32,
    micro_batches: u32,
    virtual_stages: u32,
) -> Result<(), ScheduleError> {
    if stages == 0 {
        return Err(ScheduleError::NoStages);
    }
    if micro_batches == 0 {
        return Err(ScheduleError::NoMicroBatches);
    }
    if virtual_stages == 0 {
        return Err(ScheduleError::NoVirtualStages);
    }
    // Every (stage, chunk, micro-batch) triple is counted in u32 by the generators.
    let too_large = stages
        .checked_mul(virtual_stages)
        .and_then(|b| b.checked_mul(micro_batches))
        .is_none();
    if too_large {
        return Err(ScheduleError::TooLarge {
            stages,
            micro_batches,
            virtual_stages,
        });
    }
    Ok(())
}
