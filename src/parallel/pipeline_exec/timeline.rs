//! What a stage step records for its report and for `meshwork trace`: the timed instructions,
//! the bytes crossing each boundary, and the Chrome trace of a step's timeline.

use std::time::Instant;

use crate::parallel::memory::StepMemory;
use crate::parallel::pipeline::{Instr, TimedInstr};
use crate::parallel::sync;

/// What a stage did in one step.
#[derive(Debug, Clone, Default)]
pub(crate) struct StageStepRecord {
    /// The instructions executed, in order, with their start and end.
    pub executed: Vec<(Instr, Instant, Instant)>,
    /// Micro-batch losses (last stage only).
    pub losses: Vec<f32>,
    /// The most bytes of boundary tensors (stashed inputs and outputs of micro-batches
    /// awaiting their backward) held at once during the step. A proxy for activation memory:
    /// the autodiff graph inside the stage is not counted.
    pub peak_stash_bytes: u64,
    /// The most micro-batches stashed at once.
    pub peak_stash: u32,
    /// When the step began (before its first instruction) and ended (after the optimizer).
    pub span: Option<(Instant, Instant)>,
    /// What the stage's blocks held, instruction by instruction (MEM-1, MEM-2).
    pub memory: StepMemory,
    /// When the gradient reduction and optimizer step began and ended.
    pub update: Option<(Instant, Instant)>,
    /// The collectives the step's forwards and backwards issued for its blocks (gathers,
    /// gradient reductions), as they ran: on the communication thread, overlapping the
    /// instructions, when blocks may be in flight.
    pub collectives: Vec<sync::Span>,
    /// The learning rate of the update (`None`: no update, the step was skipped).
    pub learning_rate: Option<f64>,
    /// With a loss scale: whether the step's reduced gradient overflowed on any block of any
    /// replica, and was skipped (MIX-2).
    pub overflow: Option<bool>,
}

/// A timeline (microseconds) as a Chrome trace (Perfetto, `chrome://tracing`): one row per
/// stage, one box per instruction.
pub fn chrome_trace(timeline: &[Vec<TimedInstr>]) -> String {
    let events: Vec<serde_json::Value> = timeline
        .iter()
        .enumerate()
        .flat_map(|(stage, list)| {
            list.iter().map(move |t| {
                serde_json::json!({
                    "name": format!("{:?} mb{} chunk{}", t.instr.kind(), t.instr.mb().0, t.instr.chunk().0),
                    "ph": "X", "ts": t.start, "dur": t.end - t.start,
                    "pid": 0, "tid": stage,
                })
            })
        })
        .collect();
    serde_json::json!({ "traceEvents": events }).to_string()
}
