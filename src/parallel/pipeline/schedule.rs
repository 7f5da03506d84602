//! The generators: the compute order of each schedule, then the sends and receives around it.

use super::{
    Chunk, Instr, LINK_CAPACITY, MicroBatch, PipelineSchedule, Schedule, ScheduleError, StageIndex,
    check_dimensions,
};

/// A forward or a backward of one (micro-batch, chunk): the skeleton of a list.
#[derive(Debug, Clone, Copy)]
enum Compute {
    Forward(MicroBatch, Chunk),
    Backward(MicroBatch, Chunk),
}

pub(super) fn generate(
    schedule: &Schedule,
    stages: u32,
) -> Result<PipelineSchedule, ScheduleError> {
    let micro_batches = schedule.micro_batches();
    let virtual_stages = schedule.virtual_stages();
    check_dimensions(stages, micro_batches, virtual_stages)?;
    let orders: Vec<Vec<Compute>> = match *schedule {
        Schedule::GPipe { .. } => (0..stages).map(|_| gpipe(micro_batches)).collect(),
        Schedule::OneFOneB { .. } => (0..stages)
            .map(|d| one_f_one_b(stages, d, micro_batches))
            .collect(),
        Schedule::Interleaved { .. } => {
            if !micro_batches.is_multiple_of(stages) {
                return Err(ScheduleError::MicroBatchesNotMultipleOfStages {
                    micro_batches,
                    stages,
                });
            }
            if virtual_stages == 1 {
                (0..stages)
                    .map(|d| one_f_one_b(stages, d, micro_batches))
                    .collect()
            } else {
                (0..stages)
                    .map(|d| interleaved(stages, d, micro_batches, virtual_stages))
                    .collect()
            }
        }
    };
    let lists = orders
        .iter()
        .enumerate()
        .map(|(d, order)| with_communication(stages, virtual_stages, StageIndex(d as u32), order))
        .collect();
    PipelineSchedule::from_lists(stages, micro_batches, virtual_stages, LINK_CAPACITY, lists)
}

/// One device holding all `blocks` as its chunks, micro-batch after micro-batch: the
/// forwards of blocks 0..n, then the backwards of blocks n..0 (a block job's list; the
/// boundaries between blocks pass through the stage's links to itself).
pub(super) fn sequential(
    blocks: u32,
    micro_batches: u32,
) -> Result<PipelineSchedule, ScheduleError> {
    check_dimensions(1, micro_batches, blocks)?;
    let order: Vec<Compute> = (0..micro_batches)
        .flat_map(|m| {
            let forwards = (0..blocks).map(move |c| Compute::Forward(MicroBatch(m), Chunk(c)));
            let backwards = (0..blocks)
                .rev()
                .map(move |c| Compute::Backward(MicroBatch(m), Chunk(c)));
            forwards.chain(backwards)
        })
        .collect();
    let list = with_communication(1, blocks, StageIndex(0), &order);
    PipelineSchedule::from_lists(1, micro_batches, blocks, LINK_CAPACITY, vec![list])
}

/// All forwards, then all backwards, in micro-batch order.
fn gpipe(micro_batches: u32) -> Vec<Compute> {
    let forwards = (0..micro_batches).map(|m| Compute::Forward(MicroBatch(m), Chunk(0)));
    let backwards = (0..micro_batches).map(|m| Compute::Backward(MicroBatch(m), Chunk(0)));
    forwards.chain(backwards).collect()
}

/// PipeDream-flush on stage `d`: min(K−d−1, M) warm-up forwards, then forward i+w and backward
/// i in turn, then the remaining backwards.
fn one_f_one_b(stages: u32, d: u32, micro_batches: u32) -> Vec<Compute> {
    let warmup = (stages - d - 1).min(micro_batches);
    steady_order(
        micro_batches,
        warmup,
        |k| (MicroBatch(k), Chunk(0)),
        |k| (MicroBatch(k), Chunk(0)),
    )
}

/// Megatron-LM's interleaved 1F1B on stage `d` with v chunks: the k-th forward takes
/// micro-batches in groups of K, chunk by chunk ascending; the k-th backward the same groups,
/// chunks descending. Warm-up (K−d−1)·2 + (v−1)·K forwards.
fn interleaved(stages: u32, d: u32, micro_batches: u32, virtual_stages: u32) -> Vec<Compute> {
    let total = micro_batches * virtual_stages;
    let round = stages * virtual_stages;
    let position = move |k: u32| {
        let group = k / round;
        let within = k % round;
        (
            MicroBatch(group * stages + within % stages),
            within / stages,
        )
    };
    let warmup = ((stages - d - 1) * 2 + (virtual_stages - 1) * stages).min(total);
    steady_order(
        total,
        warmup,
        |k| {
            let (mb, c) = position(k);
            (mb, Chunk(c))
        },
        |k| {
            let (mb, c) = position(k);
            (mb, Chunk(virtual_stages - 1 - c))
        },
    )
}

/// `warmup` forwards, then forward k+warmup and backward k in turn, then the rest of the
/// backwards; `forward(k)` and `backward(k)` name the k-th forward and backward.
fn steady_order(
    total: u32,
    warmup: u32,
    forward: impl Fn(u32) -> (MicroBatch, Chunk),
    backward: impl Fn(u32) -> (MicroBatch, Chunk),
) -> Vec<Compute> {
    let f = |k| {
        let (mb, c) = forward(k);
        Compute::Forward(mb, c)
    };
    let b = |k| {
        let (mb, c) = backward(k);
        Compute::Backward(mb, c)
    };
    let mut order = Vec::with_capacity(2 * total as usize);
    order.extend((0..warmup).map(f));
    for k in 0..total - warmup {
        order.push(f(k + warmup));
        order.push(b(k));
    }
    order.extend((total - warmup..total).map(b));
    order
}

/// The stage's list: each receive immediately before the compute that needs it, each send
/// immediately after the compute that produced it.
fn with_communication(
    stages: u32,
    virtual_stages: u32,
    stage: StageIndex,
    order: &[Compute],
) -> Vec<Instr> {
    let last_block = stages * virtual_stages - 1;
    let block = |chunk: Chunk| chunk.0 * stages + stage.0;
    let previous = StageIndex((stage.0 + stages - 1) % stages);
    let next = StageIndex((stage.0 + 1) % stages);
    let mut list = Vec::with_capacity(order.len() * 2);
    for &step in order {
        match step {
            Compute::Forward(mb, chunk) => {
                if block(chunk) > 0 {
                    list.push(Instr::RecvActivation {
                        mb,
                        chunk,
                        from: previous,
                    });
                }
                list.push(Instr::Forward { mb, chunk });
                if block(chunk) < last_block {
                    list.push(Instr::SendActivation {
                        mb,
                        chunk,
                        to: next,
                    });
                }
            }
            Compute::Backward(mb, chunk) => {
                if block(chunk) < last_block {
                    list.push(Instr::RecvGradient {
                        mb,
                        chunk,
                        from: next,
                    });
                }
                list.push(Instr::Backward { mb, chunk });
                if block(chunk) > 0 {
                    list.push(Instr::SendGradient {
                        mb,
                        chunk,
                        to: previous,
                    });
                }
            }
        }
    }
    list
}
