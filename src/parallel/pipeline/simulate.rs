//! The checker: [`validate`] (what the lists contain, PIPE-1) and [`simulate`] (running them
//! with costs: order, FIFO links, bounded buffering, deadlock, timing).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{Chunk, Instr, InstrKind, MicroBatch, PipelineSchedule, StageIndex};

/// Durations of one forward and one backward on one stage, overriding [`Costs`]'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageCosts {
    /// The stage.
    pub stage: StageIndex,
    /// Ticks of one forward of one chunk on one micro-batch.
    pub forward: u64,
    /// Ticks of one backward of one chunk on one micro-batch.
    pub backward: u64,
}

/// What each instruction costs, in ticks (any unit: nanoseconds, or 1 per forward).
///
/// Forward and backward costs are per chunk: to compare interleaved with v chunks against a
/// plain schedule on the same model, give the chunks 1/v of a stage's cost. A receive costs
/// nothing itself (waiting for a message is idle time); a send keeps its stage busy `send`
/// ticks, and the message can be received `latency` ticks after the send ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Costs {
    /// Ticks of one forward (every stage without an override).
    pub forward: u64,
    /// Ticks of one backward (every stage without an override).
    pub backward: u64,
    /// Ticks a send keeps its stage busy.
    pub send: u64,
    /// Ticks from the end of a send until the message can be received.
    pub latency: u64,
    /// Per-stage overrides of `forward` and `backward`; a later entry wins.
    pub per_stage: Vec<StageCosts>,
}

impl Default for Costs {
    fn default() -> Self {
        Self::unit()
    }
}

impl Costs {
    /// Forward = backward = 1 tick, free communication: the costs of PIPE-5.
    pub fn unit() -> Self {
        Self::new(1, 1)
    }

    /// `forward` and `backward` ticks on every stage, free communication.
    pub fn new(forward: u64, backward: u64) -> Self {
        Self {
            forward,
            backward,
            send: 0,
            latency: 0,
            per_stage: Vec::new(),
        }
    }

    /// With sends that keep the sender busy `send` ticks and arrive `latency` ticks later.
    pub fn with_communication(mut self, send: u64, latency: u64) -> Self {
        self.send = send;
        self.latency = latency;
        self
    }

    /// With `stage`'s forward and backward costs set to these.
    pub fn with_stage(mut self, stage: StageIndex, forward: u64, backward: u64) -> Self {
        self.per_stage.push(StageCosts {
            stage,
            forward,
            backward,
        });
        self
    }

    fn of(&self, stage: StageIndex) -> (u64, u64) {
        self.per_stage
            .iter()
            .rev()
            .find(|s| s.stage == stage)
            .map_or((self.forward, self.backward), |s| (s.forward, s.backward))
    }
}

/// One instruction as it ran (or was simulated): when it started and ended, in ticks from the
/// step's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimedInstr {
    /// The instruction.
    pub instr: Instr,
    /// Start tick.
    pub start: u64,
    /// End tick (≥ start).
    pub end: u64,
}

/// One stage's share of a simulated step. `compute + communication + idle = makespan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReport {
    /// The stage.
    pub stage: StageIndex,
    /// Ticks spent in forwards and backwards.
    pub compute: u64,
    /// Ticks spent in sends.
    pub communication: u64,
    /// Ticks of the step spent doing neither (waiting, or done before the others).
    pub idle: u64,
    /// The most (micro-batch, chunk) pairs forwarded and not yet backwarded at once (PIPE-6).
    pub peak_stash: u32,
}

/// What a simulated step did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Stages (K).
    pub stages: u32,
    /// Micro-batches (M).
    pub micro_batches: u32,
    /// Chunks per stage (v).
    pub virtual_stages: u32,
    /// Ticks from the first instruction's start (0) to the last one's end.
    pub makespan: u64,
    /// Measured bubble: `1 − Σ compute / (K · makespan)`, the idle-or-communicating share of
    /// the step averaged over stages (PIPE-5); 0 for a step that takes no time.
    pub bubble: f64,
    /// Per stage, indexed by stage.
    pub per_stage: Vec<StageReport>,
    /// Per stage, its list as it ran.
    pub timeline: Vec<Vec<TimedInstr>>,
}

impl SimReport {
    /// The largest peak stash over the stages.
    pub fn peak_stash(&self) -> u32 {
        self.per_stage
            .iter()
            .map(|s| s.peak_stash)
            .max()
            .unwrap_or(0)
    }

    /// Compute ticks summed over stages.
    pub fn compute_total(&self) -> u64 {
        self.per_stage.iter().map(|s| s.compute).sum()
    }
}

/// What an instruction needed that had not happened before it in its list (PIPE-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Needs {
    /// A forward before the receive of its input activation.
    Input,
    /// A backward or an activation send before the forward of its (micro-batch, chunk).
    Forward,
    /// A backward before the receive of its output gradient.
    OutputGradient,
    /// A gradient send before the backward that produces it.
    Backward,
}

/// Why lists are not a correct schedule, or could not run. `index` is the position in the
/// stage's list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleSimError {
    /// An instruction names a micro-batch or chunk the schedule does not have.
    #[error("{stage}, instruction {index} ({instr:?}): micro-batch or chunk out of range")]
    OutOfRange {
        /// The stage.
        stage: StageIndex,
        /// Position in its list.
        index: usize,
        /// The instruction.
        instr: Instr,
    },
    /// A send or receive names the wrong neighbour, or exists where no data crosses
    /// (`expected` is `None`: an input received by the first block, a gradient sent by it,
    /// anything sent onward by the last block).
    #[error("{stage}, instruction {index} ({instr:?}): expected peer {expected:?}")]
    WrongPeer {
        /// The stage.
        stage: StageIndex,
        /// Position in its list.
        index: usize,
        /// The instruction.
        instr: Instr,
        /// The peer the block layout gives.
        expected: Option<StageIndex>,
    },
    /// An instruction that must be in the stage's list exactly once is there `count` times.
    #[error("{stage}: {kind:?} of {mb}, {chunk} appears {count} times, expected once")]
    MissingOrDuplicate {
        /// The stage.
        stage: StageIndex,
        /// The instruction kind.
        kind: InstrKind,
        /// The micro-batch.
        mb: MicroBatch,
        /// The chunk.
        chunk: Chunk,
        /// How often it appears.
        count: u32,
    },
    /// An instruction comes before something it depends on (PIPE-2).
    #[error("{stage}, instruction {index} ({instr:?}) runs before its {needs:?}")]
    OrderViolation {
        /// The stage.
        stage: StageIndex,
        /// Position in its list.
        index: usize,
        /// The instruction.
        instr: Instr,
        /// What it needed.
        needs: Needs,
    },
    /// A receive found another message at the head of its link (PIPE-3).
    #[error("{stage}, instruction {index} ({instr:?}) found {found_mb}, {found_chunk} first")]
    MessageOrder {
        /// The stage.
        stage: StageIndex,
        /// Position in its list.
        index: usize,
        /// The receive.
        instr: Instr,
        /// The micro-batch of the message at the head of the link.
        found_mb: MicroBatch,
        /// The receiver's chunk that message is for.
        found_chunk: Chunk,
    },
    /// No stage can go on: `stage` (the lowest blocked one) waits at `index` on
    /// `waiting_for`, a receive whose message is never sent or a send into a link that stays
    /// full (lists that need more buffering than the link capacity).
    #[error("deadlock: {stage} waits at instruction {index} on {waiting_for:?}")]
    Deadlock {
        /// The lowest blocked stage.
        stage: StageIndex,
        /// Position in its list.
        index: usize,
        /// The instruction it is blocked on.
        waiting_for: Instr,
    },
    /// The costs name a stage the schedule does not have.
    #[error("costs given for {stage}, but the pipeline has {stages} stages")]
    UnknownStageInCosts {
        /// The stage named.
        stage: StageIndex,
        /// Stages of the pipeline.
        stages: u32,
    },
}

/// The two directions of data, each with its own links.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Direction {
    Activation,
    Gradient,
}

/// Checks PIPE-1: every instruction in range and with the right peer, every required
/// instruction exactly once on the stage holding its chunk. Says nothing about order.
pub fn validate(schedule: &PipelineSchedule) -> Result<(), ScheduleSimError> {
    let m = schedule.micro_batches();
    let v = schedule.virtual_stages();
    let last = schedule.blocks() - 1;
    for (d, list) in schedule.lists().iter().enumerate() {
        let stage = StageIndex(d as u32);
        // Sized by the list, not by v·M: a short hand-made list is cheap to reject.
        let mut counts: HashMap<(InstrKind, MicroBatch, Chunk), u32> = HashMap::new();
        for (index, instr) in list.iter().enumerate() {
            let (mb, chunk) = (instr.mb(), instr.chunk());
            if mb.0 >= m || chunk.0 >= v {
                return Err(ScheduleSimError::OutOfRange {
                    stage,
                    index,
                    instr: *instr,
                });
            }
            let block = schedule.block(stage, chunk);
            let before = (block > 0).then(|| schedule.placement(block - 1).0);
            let after = (block < last).then(|| schedule.placement(block + 1).0);
            let expected = match instr {
                Instr::RecvActivation { .. } | Instr::SendGradient { .. } => Some(before),
                Instr::SendActivation { .. } | Instr::RecvGradient { .. } => Some(after),
                Instr::Forward { .. } | Instr::Backward { .. } => None,
            };
            if let Some(expected) = expected
                && instr.peer() != expected
            {
                return Err(ScheduleSimError::WrongPeer {
                    stage,
                    index,
                    instr: *instr,
                    expected,
                });
            }
            *counts.entry((instr.kind(), mb, chunk)).or_default() += 1;
        }
        for c in 0..v {
            let chunk = Chunk(c);
            let block = schedule.block(stage, chunk);
            for mb in (0..m).map(MicroBatch) {
                for kind in KINDS {
                    let required = match kind {
                        InstrKind::Forward | InstrKind::Backward => true,
                        InstrKind::RecvActivation | InstrKind::SendGradient => block > 0,
                        InstrKind::SendActivation | InstrKind::RecvGradient => block < last,
                    };
                    let count = counts.get(&(kind, mb, chunk)).copied().unwrap_or(0);
                    if required && count != 1 {
                        return Err(ScheduleSimError::MissingOrDuplicate {
                            stage,
                            kind,
                            mb,
                            chunk,
                            count,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

const KINDS: [InstrKind; 6] = [
    InstrKind::RecvActivation,
    InstrKind::Forward,
    InstrKind::SendActivation,
    InstrKind::RecvGradient,
    InstrKind::Backward,
    InstrKind::SendGradient,
];

/// A FIFO link: what was sent (message tag and when it can be received) and when each message
/// was taken.
#[derive(Debug, Default)]
struct Link {
    sent: Vec<(MicroBatch, Chunk, u64)>,
    taken: Vec<u64>,
}

/// One stage's progress through its list.
#[derive(Debug)]
struct StageRun {
    pc: usize,
    clock: u64,
    /// Per (chunk · M + mb): input received, forwarded, output gradient received, backwarded.
    input: Vec<bool>,
    forwarded: Vec<bool>,
    gradient: Vec<bool>,
    backwarded: Vec<bool>,
    timeline: Vec<TimedInstr>,
}

/// Runs the lists with `costs` (after [`validate`]): every stage executes its list in order,
/// each instruction as soon as its stage is free and its message (for a receive) or a free
/// slot of its link (for a send) is there; links hold [`PipelineSchedule::link_capacity`]
/// messages. Checks PIPE-2 and PIPE-3 and finds deadlocks; reports the timeline, makespan,
/// measured bubble and peak stash per stage.
///
/// Which instruction waits for which does not depend on the costs, so a deadlock found with
/// any costs is found with all of them.
pub fn simulate(schedule: &PipelineSchedule, costs: &Costs) -> Result<SimReport, ScheduleSimError> {
    validate(schedule)?;
    let k = schedule.stages();
    let m = schedule.micro_batches();
    let v = schedule.virtual_stages();
    if let Some(bad) = costs.per_stage.iter().find(|s| s.stage.0 >= k) {
        return Err(ScheduleSimError::UnknownStageInCosts {
            stage: bad.stage,
            stages: k,
        });
    }
    let capacity = schedule.link_capacity() as usize;
    let last = schedule.blocks() - 1;
    let pairs = (v * m) as usize;
    // Only the links the lists use: K² of them would be too many for large K.
    let mut links: HashMap<(Direction, StageIndex, StageIndex), Link> = HashMap::new();
    let mut runs: Vec<StageRun> = (0..k)
        .map(|_| StageRun {
            pc: 0,
            clock: 0,
            input: vec![false; pairs],
            forwarded: vec![false; pairs],
            gradient: vec![false; pairs],
            backwarded: vec![false; pairs],
            timeline: Vec::new(),
        })
        .collect();

    loop {
        let mut progress = false;
        for d in 0..k {
            let stage = StageIndex(d);
            let list = schedule.list(stage);
            let (forward_cost, backward_cost) = costs.of(stage);
            let run = &mut runs[d as usize];
            while let Some(&instr) = list.get(run.pc) {
                let index = run.pc;
                let (mb, chunk) = (instr.mb(), instr.chunk());
                let pair = (chunk.0 * m + mb.0) as usize;
                let block = schedule.block(stage, chunk);
                let order = |needs| ScheduleSimError::OrderViolation {
                    stage,
                    index,
                    instr,
                    needs,
                };
                let (start, end) = match instr {
                    Instr::RecvActivation { from, .. } | Instr::RecvGradient { from, .. } => {
                        let dir = if instr.kind() == InstrKind::RecvActivation {
                            Direction::Activation
                        } else {
                            Direction::Gradient
                        };
                        let link = links.entry((dir, from, stage)).or_default();
                        let n = link.taken.len();
                        let Some(&(found_mb, found_chunk, ready)) = link.sent.get(n) else {
                            break; // blocked: the message is not sent yet
                        };
                        if (found_mb, found_chunk) != (mb, chunk) {
                            return Err(ScheduleSimError::MessageOrder {
                                stage,
                                index,
                                instr,
                                found_mb,
                                found_chunk,
                            });
                        }
                        let start = run.clock.max(ready);
                        link.taken.push(start);
                        match dir {
                            Direction::Activation => run.input[pair] = true,
                            Direction::Gradient => run.gradient[pair] = true,
                        }
                        (start, start)
                    }
                    Instr::SendActivation { to, .. } | Instr::SendGradient { to, .. } => {
                        let (dir, peer_block) = if instr.kind() == InstrKind::SendActivation {
                            if !run.forwarded[pair] {
                                return Err(order(Needs::Forward));
                            }
                            (Direction::Activation, block + 1)
                        } else {
                            if !run.backwarded[pair] {
                                return Err(order(Needs::Backward));
                            }
                            (Direction::Gradient, block - 1)
                        };
                        let link = links.entry((dir, stage, to)).or_default();
                        let n = link.sent.len();
                        let free_slot_at = if n < capacity {
                            0
                        } else {
                            match link.taken.get(n - capacity) {
                                Some(&t) => t,
                                None => break, // blocked: the link is full
                            }
                        };
                        let start = run.clock.max(free_slot_at);
                        let end = start.saturating_add(costs.send);
                        let receiver_chunk = schedule.placement(peer_block).1;
                        link.sent
                            .push((mb, receiver_chunk, end.saturating_add(costs.latency)));
                        (start, end)
                    }
                    Instr::Forward { .. } => {
                        if block > 0 && !run.input[pair] {
                            return Err(order(Needs::Input));
                        }
                        run.forwarded[pair] = true;
                        (run.clock, run.clock.saturating_add(forward_cost))
                    }
                    Instr::Backward { .. } => {
                        if !run.forwarded[pair] {
                            return Err(order(Needs::Forward));
                        }
                        if block < last && !run.gradient[pair] {
                            return Err(order(Needs::OutputGradient));
                        }
                        run.backwarded[pair] = true;
                        (run.clock, run.clock.saturating_add(backward_cost))
                    }
                };
                run.clock = end;
                run.timeline.push(TimedInstr { instr, start, end });
                run.pc += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }

    if let Some((d, run)) = runs
        .iter()
        .enumerate()
        .find(|(d, run)| run.pc < schedule.lists()[*d].len())
    {
        return Err(ScheduleSimError::Deadlock {
            stage: StageIndex(d as u32),
            index: run.pc,
            waiting_for: schedule.lists()[d][run.pc],
        });
    }

    let timeline: Vec<Vec<TimedInstr>> = runs.into_iter().map(|r| r.timeline).collect();
    let summary = summarize(&timeline);
    Ok(SimReport {
        stages: k,
        micro_batches: m,
        virtual_stages: v,
        makespan: summary.makespan,
        bubble: summary.bubble,
        per_stage: summary.per_stage,
        timeline,
    })
}

/// A step's shares of time, from a timeline (simulated, or measured by an executor).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineSummary {
    /// Ticks from the earliest instruction start to the latest instruction end.
    pub makespan: u64,
    /// `1 − Σ compute / (K · makespan)`: the share of the step a stage spends not computing,
    /// averaged over the K stages (PIPE-5); 0 for an empty step.
    pub bubble: f64,
    /// Per stage, in the timeline's order.
    pub per_stage: Vec<StageReport>,
}

/// Summarizes `timeline` (one list per stage, each in execution order, instructions of a
/// stage not overlapping): per stage, time in forwards and backwards (compute), in sends
/// (communication), and the rest of the step (idle: waiting in receives or for work, or
/// finished early), and the peak stash from the order of forwards and backwards; the bubble
/// from those. [`simulate`] reports exactly this for its timeline, so a measured step and
/// its simulation are compared on the same definitions.
pub fn summarize(timeline: &[Vec<TimedInstr>]) -> TimelineSummary {
    let all = || timeline.iter().flatten();
    let first = all().map(|t| t.start).min().unwrap_or(0);
    let last = all().map(|t| t.end).max().unwrap_or(first);
    let makespan = last.saturating_sub(first);
    let per_stage: Vec<StageReport> = timeline
        .iter()
        .enumerate()
        .map(|(d, instrs)| {
            let (mut compute, mut communication) = (0u64, 0u64);
            let (mut live, mut peak_stash) = (0u32, 0u32);
            for t in instrs {
                let took = t.end.saturating_sub(t.start);
                match t.instr {
                    Instr::Forward { .. } => {
                        compute = compute.saturating_add(took);
                        live += 1;
                        peak_stash = peak_stash.max(live);
                    }
                    Instr::Backward { .. } => {
                        compute = compute.saturating_add(took);
                        live = live.saturating_sub(1);
                    }
                    Instr::SendActivation { .. } | Instr::SendGradient { .. } => {
                        communication = communication.saturating_add(took);
                    }
                    Instr::RecvActivation { .. } | Instr::RecvGradient { .. } => {}
                }
            }
            StageReport {
                stage: StageIndex(d as u32),
                compute,
                communication,
                idle: makespan
                    .saturating_sub(compute)
                    .saturating_sub(communication),
                peak_stash,
            }
        })
        .collect();
    let compute: f64 = per_stage.iter().map(|s| s.compute as f64).sum();
    let bubble = if makespan == 0 || per_stage.is_empty() {
        0.0
    } else {
        1.0 - compute / (per_stage.len() as f64 * makespan as f64)
    };
    TimelineSummary {
        makespan,
        bubble,
        per_stage,
    }
}
