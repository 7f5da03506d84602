//! The instruction walk: one pipeline step of one stage, the schedule's instructions in order
//! (forward, backward, send, receive, reduce, step) over the stage's blocks ([`BlockStep`])
//! and its links, the blocks' collectives on the stage's [`CommLane`] (at most
//! `blocks_in_flight` ahead), and the memory points of the step. What a block computes sits
//! behind the trait, and what crosses a link is a [`WireTensor`]: no Burn type appears here,
//! so the walk is tested with a fake block (`walk/tests.rs`).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use super::overlap::{CommLane, Ticket, with_lane};
use super::{
    BlockInput, BlockStep, ExecError, Flow, Packet, StageLinks, StageStepRecord, WireTensor,
};
use crate::comm::{Communicator, ReduceOp};
use crate::faults::{FaultHooks, Phase, with_hooks};
use crate::mesh::DeviceId;
use crate::parallel::memory::BlockBytes;
use crate::parallel::pipeline::{Chunk, Instr, PipelineSchedule, StageIndex};

#[cfg(test)]
mod tests;

/// What one stage needs to run one step of a schedule.
pub(crate) struct StepContext<'a, I> {
    /// The lists of every stage.
    pub schedule: &'a PipelineSchedule,
    /// Which stage this is.
    pub stage: StageIndex,
    /// This stage's ends of the links.
    pub links: &'a StageLinks,
    /// The items of each micro-batch (the same on every stage of a pipeline).
    pub micro_batches: &'a [Vec<I>],
    /// The communicator of this stage's data-parallel group (the same stage in every
    /// pipeline replica), if there is more than one replica.
    pub replicas: Option<&'a mut Communicator>,
    /// The communicator of every stage and tensor-parallel rank of this stage's replica
    /// (`None` when the replica is this rank alone): the global norm and f16's overflow are
    /// agreed over it.
    pub model: Option<&'a mut Communicator>,
    /// Clip the step's gradient to this global L2 norm over the whole model: this stage's
    /// blocks, summed over the replica's other stages and tensor-parallel ranks (each
    /// element counted once, CLIP-1).
    pub clip: Option<f32>,
    /// This rank's coordinate in the tensor-parallel dimension (0 without tensor
    /// parallelism): who counts what in the global norm (CLIP-1).
    pub tp_rank: usize,
    /// Called before each instruction runs (progress for heartbeats and failure reports).
    pub on_instr: &'a dyn Fn(&Instr),
    /// How many blocks' gathered parameters may wait for their use at once, the gathers
    /// and gradient reductions running on a communication thread meanwhile (OVL-1); 0: the
    /// collectives run in place, each when its result is needed.
    pub blocks_in_flight: usize,
    /// The fault plan's hooks, called around every forward and backward, with the device
    /// and the step they are called for.
    pub faults: Option<(&'a FaultHooks, DeviceId, u64)>,
    /// f16's loss scale: the last block multiplies its loss by it, the reduced gradients are
    /// divided by it, and an overflow anywhere skips the step everywhere (MIX-2).
    pub loss_scale: Option<f32>,
}

impl<I> std::fmt::Debug for StepContext<'_, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepContext(stage {})", self.stage.0)
    }
}

/// Run one training step of a stage holding `chunks` (its v model chunks, in chunk order) by
/// executing its list literally (EXEC-1), then the optimizer step of every chunk over the mean
/// of the micro-batches (EXEC-2), averaged over the data-parallel replicas when there are
/// several (EXEC-3).
pub(crate) fn run_stage_step<I, W: BlockStep<I> + ?Sized>(
    chunks: &mut [Box<W>],
    cx: StepContext<'_, I>,
) -> Result<StageStepRecord, ExecError> {
    let me = cx.stage;
    let plan = cx.schedule;
    let v = plan.virtual_stages();
    if chunks.len() != v as usize {
        return Err(ExecError::Unsupported(format!(
            "stage {} holds {} model chunks but the schedule has {v} per stage",
            me.0,
            chunks.len()
        )));
    }
    // EXEC-4: a step starts from nothing of an earlier, failed attempt (stash, accumulated
    // gradients, losses), so a redone step is the step itself.
    for chunk in chunks.iter_mut() {
        chunk.begin_step();
        chunk.set_loss_scale(cx.loss_scale.unwrap_or(1.0));
    }
    let mut cx = cx;
    let mut replicas = cx.replicas.take();
    let mut model = cx.model.take().filter(|c| c.world() > 1);
    let rank_of = replicas
        .as_ref()
        .map_or((0, 1), |c| (c.rank().index(), c.world()));
    let scale =
        1.0 / (plan.micro_batches() as usize * rank_of.1) as f32 / cx.loss_scale.unwrap_or(1.0);
    let mut record = StageStepRecord::default();
    let began = Instant::now();
    record.memory.record(0, chunks.iter().map(|c| c.memory()));
    // The step's forwards and backwards, with their collectives on the lane: overlapped
    // with the compute when blocks may be in flight (OVL-1), in place otherwise.
    let threaded = cx.blocks_in_flight > 0;
    with_lane(replicas.as_deref_mut(), threaded, me.0, |lane| {
        let mut walk = Walk::new(chunks, &cx, rank_of, scale, began);
        let out = walk.run(lane, &mut record);
        record.collectives = lane.take_spans();
        out
    })?;
    let since = |t: Instant| t.saturating_duration_since(began).as_micros() as u64;
    let t = Instant::now();
    // MIX-2: an overflow in any block of any replica skips the step on every replica (the
    // flags of every block, all-reduced over the stage's group, then over the replica's
    // stages and tensor-parallel ranks).
    if cx.loss_scale.is_some() {
        let mut found = [f32::from(u8::from(chunks.iter().any(|c| c.overflowed())))];
        if let Some(comm) = replicas.as_deref_mut().filter(|c| c.world() > 1) {
            comm.all_reduce(&mut found, ReduceOp::Max)?;
        }
        if let Some(comm) = model.as_deref_mut() {
            comm.all_reduce(&mut found, ReduceOp::Max)?;
        }
        let overflow = found[0] > 0.0;
        record.overflow = Some(overflow);
        if overflow {
            for chunk in chunks.iter_mut() {
                record.losses.extend(chunk.take_losses());
            }
            record.span = Some((began, Instant::now()));
            return Ok(record);
        }
    }
    if let Some(max) = cx.clip {
        let sums: Vec<_> = chunks.iter().map(|c| c.norm_part(cx.tp_rank)).collect();
        let partial = sums.iter().any(|s| s.is_some_and(|(_, p)| p));
        let total: f64 = sums.iter().flatten().map(|(v, _)| v).sum();
        // The same arithmetic as ZeRO's clipping: each rank's sum, all-reduced in f32.
        let mut sum = [total as f32];
        if partial && let Some(comm) = replicas.as_deref_mut().filter(|c| c.world() > 1) {
            comm.all_reduce(&mut sum, ReduceOp::Sum)?;
        }
        // The other stages' and tensor-parallel ranks' parts: every replica's model group
        // sums the same values in the same order, so every rank clips alike.
        if let Some(comm) = model.as_deref_mut() {
            comm.all_reduce(&mut sum, ReduceOp::Sum)?;
        }
        let norm = if partial || model.is_some() {
            f64::from(sum[0]).sqrt() as f32
        } else {
            total.sqrt() as f32
        };
        for chunk in chunks.iter_mut() {
            chunk.clip(norm, max);
        }
    }
    for chunk in chunks.iter_mut() {
        let rate = hooked(&cx, 0, Phase::Update, || {
            chunk.apply(replicas.as_deref_mut())
        })?;
        record.learning_rate = Some(rate);
        record.losses.extend(chunk.take_losses());
    }
    record
        .memory
        .record(since(Instant::now()), chunks.iter().map(|c| c.memory()));
    record.update = Some((t, Instant::now()));
    record.span = Some((began, Instant::now()));
    Ok(record)
}

/// A gather issued ahead of its use: the instruction it is for, the chunk, its ticket
/// (`None`: the block needed no collective) and the bytes of full parameters it brings.
pub(super) type Prefetched = (usize, u32, Option<Ticket>, u64);

/// One step's walk over a stage's list: the instructions, the gathers issued ahead of their
/// use (at most `blocks_in_flight` gathered but unused, EXEC-5) and the reductions in flight.
pub(super) struct Walk<'w, 'c, I, W: ?Sized> {
    pub(super) chunks: &'w mut [Box<W>],
    pub(super) cx: &'w StepContext<'c, I>,
    pub(super) rank_of: (usize, usize),
    pub(super) scale: f32,
    pub(super) began: Instant,
    /// Every gather of the step, in list order: (instruction index, chunk).
    pub(super) gathers: Vec<(usize, u32)>,
    /// The next of `gathers` to issue.
    pub(super) next_gather: usize,
    /// Issued, not yet taken by their block, in order.
    pub(super) prefetched: VecDeque<Prefetched>,
    /// Reductions issued, not yet taken: (chunk, ticket), in order.
    pub(super) reducing: VecDeque<(u32, Ticket)>,
}

impl<'w, 'c, I, W: BlockStep<I> + ?Sized> Walk<'w, 'c, I, W> {
    fn new(
        chunks: &'w mut [Box<W>],
        cx: &'w StepContext<'c, I>,
        rank_of: (usize, usize),
        scale: f32,
        began: Instant,
    ) -> Self {
        let list = cx.schedule.list(cx.stage);
        // Each chunk's uses in list order, and where each sits in the list.
        let mut uses: Vec<Vec<(usize, Option<u32>)>> = vec![Vec::new(); chunks.len()];
        for (i, instr) in list.iter().enumerate() {
            let u = match *instr {
                Instr::Forward { .. } => None,
                Instr::Backward { mb, .. } => Some(mb.0),
                _ => continue,
            };
            if let Some(c) = uses.get_mut(instr.chunk().0 as usize) {
                c.push((i, u));
            }
        }
        let mut gathers: Vec<(usize, u32)> = uses
            .iter()
            .enumerate()
            .flat_map(|(c, u)| {
                let plan = chunks[c].gather_plan(&u.iter().map(|(_, u)| *u).collect::<Vec<_>>());
                u.iter()
                    .zip(plan)
                    .filter(|(_, need)| *need)
                    .map(move |((i, _), _)| (*i, c as u32))
                    .collect::<Vec<_>>()
            })
            .collect();
        gathers.sort_unstable();
        Self {
            chunks,
            cx,
            rank_of,
            scale,
            began,
            gathers,
            next_gather: 0,
            prefetched: VecDeque::new(),
            reducing: VecDeque::new(),
        }
    }

    fn block(&self, chunk: u32) -> u32 {
        self.cx.schedule.block(self.cx.stage, Chunk(chunk))
    }

    fn in_flight(&self) -> usize {
        self.cx.blocks_in_flight
    }

    /// Record what the blocks hold now, with the prefetched full parameters (MEM-1).
    fn record_memory(&self, record: &mut StageStepRecord) {
        let prefetched: u64 = self.prefetched.iter().map(|p| p.3).sum();
        let at = self.began.elapsed().as_micros() as u64;
        record.memory.record(
            at,
            self.chunks
                .iter()
                .map(|c| c.memory())
                .chain(std::iter::once(BlockBytes {
                    full_params: prefetched,
                    ..BlockBytes::default()
                })),
        );
    }

    /// Issue the next gather of the step.
    fn issue_gather(&mut self, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let Some(&(at, chunk)) = self.gathers.get(self.next_gather) else {
            return Ok(());
        };
        self.next_gather += 1;
        let block = self.block(chunk);
        let rank_of = self.rank_of;
        let prefetched = match self.chunk(chunk)?.start_gather(rank_of)? {
            Some(c) => {
                let bytes = c.output_bytes();
                (at, chunk, Some(lane.issue(block, c)), bytes)
            }
            None => (at, chunk, None, 0),
        };
        self.prefetched.push_back(prefetched);
        Ok(())
    }

    fn chunk(&mut self, chunk: u32) -> Result<&mut Box<W>, ExecError> {
        let stage = self.cx.stage.0;
        self.chunks
            .get_mut(chunk as usize)
            .ok_or_else(|| ExecError::MissingInput {
                stage,
                mb: 0,
                instr: format!("a gather or reduction of chunk {chunk}"),
            })
    }

    /// Before instruction `index` computes: its block's parameters, if it gathers them (the
    /// gather issued now if not ahead), then the next gathers up to the window (OVL-2).
    fn gather_for(&mut self, index: usize, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let needed = self.gathers.get(self.next_gather - self.prefetched.len());
        if needed.is_some_and(|&(at, _)| at == index) {
            if self.prefetched.is_empty() {
                self.issue_gather(lane)?;
            }
            let (at, chunk, ticket, _) = self
                .prefetched
                .pop_front()
                .expect("issued just above if not ahead");
            debug_assert_eq!(at, index, "gathers are taken in list order");
            if let Some(ticket) = ticket {
                let full = lane.wait(ticket)?;
                self.chunk(chunk)?.finish_gather(full);
            }
        }
        while self.prefetched.len() < self.in_flight() && self.next_gather < self.gathers.len() {
            self.issue_gather(lane)?;
        }
        Ok(())
    }

    /// Right after `chunk`'s last backward: issue its reduction; keep at most
    /// `blocks_in_flight` in flight (none without overlap).
    fn reduce(&mut self, chunk: u32, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let block = self.block(chunk);
        let rank_of = self.rank_of;
        let stage = self.cx.stage.0;
        let collective = self
            .chunk(chunk)?
            .start_reduce(rank_of)
            .map_err(|e| e.in_block(stage, block))?;
        let ticket = lane.issue(block, collective);
        self.reducing.push_back((chunk, ticket));
        while self.reducing.len() > self.in_flight() {
            self.take_reduction(lane)?;
        }
        Ok(())
    }

    fn take_reduction(&mut self, lane: &mut CommLane<'_>) -> Result<(), ExecError> {
        let Some((chunk, ticket)) = self.reducing.pop_front() else {
            return Ok(());
        };
        let out = lane.wait(ticket)?;
        let (scale, rank_of) = (self.scale, self.rank_of);
        self.chunk(chunk)?.finish_reduce(out, scale, rank_of)
    }

    /// Execute the list (EXEC-1), then take every reduction.
    fn run(
        &mut self,
        lane: &mut CommLane<'_>,
        record: &mut StageStepRecord,
    ) -> Result<(), ExecError> {
        let cx = self.cx;
        let me = cx.stage;
        let plan = cx.schedule;
        // Each chunk's gradient is reduced right after its last backward of the step, while
        // the earlier blocks' backwards are still to come (every replica at the same point,
        // FSDP-2).
        let mut last_backward: HashMap<u32, usize> = HashMap::new();
        for (i, instr) in plan.list(me).iter().enumerate() {
            if let Instr::Backward { chunk, .. } = instr {
                last_backward.insert(chunk.0, i);
            }
        }
        // Keyed by (micro-batch, local chunk).
        let mut inbox: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let mut outbox: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let mut grads_in: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let mut grads_out: HashMap<(u32, u32), Vec<WireTensor>> = HashMap::new();
        let missing = |instr: &Instr| ExecError::MissingInput {
            stage: me.0,
            mb: instr.mb().0,
            instr: format!("{instr:?}"),
        };
        for (index, instr) in plan.list(me).iter().enumerate() {
            (cx.on_instr)(instr);
            let key = (instr.mb().0, instr.chunk().0);
            let first_block = plan.block(me, instr.chunk()) == 0;
            if matches!(instr, Instr::Forward { .. } | Instr::Backward { .. }) {
                self.gather_for(index, lane)?;
                // The peak: this block's parameters and those gathered ahead (MEM-2).
                self.record_memory(record);
            }
            // The instruction's span is its own work: a gather waited for before it and the
            // reduction issued after it are the collectives' spans (so the breakdown tells
            // what overlapped).
            let t0 = Instant::now();
            let mut reduce = None;
            let work = self
                .chunks
                .get_mut(instr.chunk().0 as usize)
                .ok_or_else(|| missing(instr))?;
            match *instr {
                Instr::RecvActivation { mb, from, .. } => {
                    let msg = cx.links.recv(from.0, Flow::Activation, mb.0)?;
                    inbox.insert(key, msg);
                }
                Instr::Forward { mb, .. } => {
                    let items = cx
                        .micro_batches
                        .get(mb.0 as usize)
                        .ok_or_else(|| missing(instr))?;
                    let input = if first_block {
                        BlockInput::Data
                    } else {
                        BlockInput::Received(inbox.remove(&key).ok_or_else(|| missing(instr))?)
                    };
                    let block = plan.block(me, instr.chunk());
                    let out = hooked(cx, mb.0, Phase::Forward, || {
                        work.forward(mb.0, input, items)
                    })
                    .map_err(|e| e.in_block(me.0, block))?;
                    if let Some(out) = out {
                        outbox.insert(key, out);
                    }
                }
                Instr::SendActivation { mb, to, .. } => {
                    let tensors = outbox.remove(&key).ok_or_else(|| missing(instr))?;
                    cx.links
                        .send(to.0, Flow::Activation, Packet { mb: mb.0, tensors })?;
                }
                Instr::RecvGradient { mb, from, .. } => {
                    let msg = cx.links.recv(from.0, Flow::Gradient, mb.0)?;
                    grads_in.insert(key, msg);
                }
                Instr::Backward { mb, .. } => {
                    let g = grads_in.remove(&key);
                    let upstream = hooked(cx, mb.0, Phase::Backward, || work.backward(mb.0, g));
                    let upstream = upstream.map_err(|e| match e {
                        ExecError::MissingInput { mb, instr, .. } => ExecError::MissingInput {
                            stage: me.0,
                            mb,
                            instr,
                        },
                        ExecError::ShapeMismatch { mb, .. } => {
                            ExecError::ShapeMismatch { stage: me.0, mb }
                        }
                        other => other.in_block(me.0, plan.block(me, instr.chunk())),
                    })?;
                    grads_out.insert(key, upstream);
                    if last_backward.get(&instr.chunk().0) == Some(&index) {
                        reduce = Some(instr.chunk().0);
                    }
                }
                Instr::SendGradient { mb, to, .. } => {
                    let tensors = grads_out.remove(&key).ok_or_else(|| missing(instr))?;
                    cx.links
                        .send(to.0, Flow::Gradient, Packet { mb: mb.0, tensors })?;
                }
            }
            record.executed.push((*instr, t0, Instant::now()));
            if let Some(chunk) = reduce {
                self.reduce(chunk, lane)?;
            }
            let (count, bytes) = self
                .chunks
                .iter()
                .map(|c| c.stashed())
                .fold((0, 0), |(n, b), (n2, b2)| (n + n2, b + b2));
            record.peak_stash = record.peak_stash.max(count);
            record.peak_stash_bytes = record.peak_stash_bytes.max(bytes);
            self.record_memory(record);
        }
        // A chunk the list never ran backward on (none in a valid schedule) reduces now.
        for chunk in 0..self.chunks.len() as u32 {
            let pending = self.reducing.iter().any(|(c, _)| *c == chunk);
            if !pending && !self.chunk(chunk)?.reduced() {
                self.reduce(chunk, lane)?;
            }
        }
        while !self.reducing.is_empty() {
            self.take_reduction(lane)?;
        }
        self.record_memory(record);
        Ok(())
    }
}

/// Run a forward or backward under the fault plan's hooks, if any.
pub(super) fn hooked<I, R>(
    cx: &StepContext<'_, I>,
    mb: u32,
    phase: Phase,
    f: impl FnOnce() -> R,
) -> R {
    match cx.faults {
        Some((hooks, device, step)) => with_hooks(Some(hooks), device, step, mb, phase, f),
        None => f(),
    }
}
