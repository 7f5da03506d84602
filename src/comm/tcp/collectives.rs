//! The collective and point-to-point operations of a TCP rank: each op rendezvouses, runs
//! its share of the pure plan over the links, and reduces or widens what it receives.

use super::*;

impl TcpCommunicator {
    pub(super) fn plan_for(
        &mut self,
        kind: CollectiveKind,
        algorithm: Algorithm,
        len: usize,
        root: Rank,
    ) -> (Plan, Vec<SendMode>) {
        match self.plan_cache.take() {
            Some((r, plan, modes))
                if r == root
                    && plan.kind == kind
                    && plan.algorithm == algorithm
                    && plan.len == len =>
            {
                (plan, modes)
            }
            _ => {
                let plan = plan::plan(kind, algorithm, self.world, len, root).unwrap_or(Plan {
                    kind,
                    algorithm,
                    world: self.world,
                    len,
                    steps: vec![Vec::new(); self.world],
                });
                let modes = send_modes(&plan, self.rank);
                (plan, modes)
            }
        }
    }

    /// Stage 2 and 3: runs this rank's steps of the validated collective on the f32 buffer
    /// at `base` (`len` elements), then waits until every send completed.
    ///
    /// # Safety
    /// `base` points at `len` f32s that this rank owns for the whole call and does not touch
    /// otherwise until it returns.
    unsafe fn run(&mut self, call: &CallShape, base: *mut f32, id: OpId) -> Result<(), CommError> {
        let root = call.peer.unwrap_or(Rank(0));
        let op = call.reduce.unwrap_or(ReduceOp::Sum);
        let algorithm = call.algorithm.unwrap_or(Algorithm::Ring);
        let (plan, modes) = self.plan_for(call.kind, algorithm, call.len, root);
        self.last_algorithm = Some(algorithm);
        // TCP-7, COMM-9: a 16-bit op sends its final values (and, asked, its partial sums)
        // as 16-bit.
        let narrow = Narrowing::of(call, &plan, self.rank);
        // TCP-4: the sender threads read borrowed ranges of the caller's buffer until every
        // send completed; unwinding before then would free the buffer under their reads.
        let guard = crate::comm::AbortOnUnwind(
            "a rank panicked inside a TCP collective while its links still read its buffer",
        );
        // SAFETY: forwarded.
        let result = unsafe {
            self.execute(
                plan.steps_of(self.rank),
                &modes,
                narrow.as_ref(),
                base,
                op,
                id,
            )
        };
        let result = result.and_then(|()| self.wait_all_sent(id));
        std::mem::forget(guard);
        self.plan_cache = Some((root, plan, modes));
        result.map_err(|e| self.fail(e))
    }

    /// # Safety
    /// As [`TcpCommunicator::run`]; the steps' ranges lie in the buffer (plans are checked
    /// against their lengths by the plan tests).
    unsafe fn execute(
        &mut self,
        steps: &[Step],
        modes: &[SendMode],
        narrow: Option<&Narrowing>,
        base: *mut f32,
        op: ReduceOp,
        id: OpId,
    ) -> Result<(), CommError> {
        // Borrowed sends still possibly in flight: (peer, ticket, range).
        let mut borrowed: Vec<(usize, u64, Range<usize>)> = Vec::new();
        let mut sends = 0;
        let mut next = 0;
        while let Some(step) = steps.get(next) {
            next += 1;
            match step {
                Step::Send { to, range } => {
                    let mode = modes.get(sends).copied().unwrap_or(SendMode::Copy);
                    let narrow_16 = narrow.and_then(|n| n.send(sends));
                    sends += 1;
                    if let Some(dtype) = narrow_16 {
                        let keep = narrow.is_some_and(Narrowing::rounds_in_place);
                        if keep {
                            self.wait_overlapping(&mut borrowed, range, id)?;
                        }
                        // In pieces, so the link sends one while the next is converted.
                        for piece in narrow_pieces(range, self.world) {
                            // SAFETY: the piece lies in the range, in the buffer (PLAN-1 and
                            // the plan tests); with `keep` no borrowed send reads it any more.
                            let values = unsafe { part(base, &piece) };
                            let bytes = narrow_to_bytes(dtype, values);
                            if keep {
                                // COMM-9: the sender keeps the value it sent.
                                bits16::widen_bytes_into(dtype, &bytes, values, None);
                            }
                            self.data_bytes_sent += bytes.len() as u64;
                            self.push(to.index(), Payload::Owned(bytes), id)?;
                        }
                        continue;
                    }
                    // SAFETY: the range lies in the buffer (PLAN-1 and the plan tests).
                    unsafe {
                        self.send_range(base, range.clone(), (to.index(), mode), &mut borrowed, id)?
                    };
                }
                Step::RecvReduce { from, range } | Step::RecvCopy { from, range } => {
                    self.wait_overlapping(&mut borrowed, range, id)?;
                    let reduce = matches!(step, Step::RecvReduce { .. }).then_some(op);
                    let from = from.index();
                    // TCP-8: a range sent on as soon as it is received goes on frame by frame.
                    if let Some(onward) = (narrow.is_none() && self.forwards)
                        .then(|| Onward::of(&steps[next..], range))
                        .flatten()
                    {
                        let forward = Forward {
                            to: onward.to,
                            mode: modes.get(sends).copied().unwrap_or(SendMode::Copy),
                            finish: onward.finish.then_some(op),
                        };
                        sends += 1;
                        next += onward.steps;
                        // SAFETY: forwarded; the range is this rank's to write now, and its
                        // sends are borrowed sends tracked in `borrowed`.
                        unsafe {
                            self.recv_forwarding(
                                from,
                                base,
                                range,
                                reduce,
                                &forward,
                                &mut borrowed,
                                id,
                            )?
                        };
                        continue;
                    }
                    // SAFETY: forwarded; the range is this rank's to write now.
                    unsafe {
                        match narrow.and_then(|n| n.recv(reduce.is_some())) {
                            Some(dtype) => {
                                self.recv_widened(from, base, range, dtype, reduce, id)?
                            }
                            None => self.recv_step(from, base, range, reduce, id)?,
                        }
                    }
                }
                Step::Finish { range } => {
                    self.wait_overlapping(&mut borrowed, range, id)?;
                    // SAFETY: as above.
                    finish(unsafe { part(base, range) }, op, self.world);
                }
                Step::ReducePeers { .. } | Step::CopyFrom { .. } | Step::Barrier => {
                    unreachable!("TCP-2: a TCP group runs ring and tree plans only")
                }
            }
        }
        Ok(())
    }

    /// TCP-3: waits for the borrowed sends whose range overlaps `range`.
    pub(super) fn wait_overlapping(
        &self,
        borrowed: &mut Vec<(usize, u64, Range<usize>)>,
        range: &Range<usize>,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut i = 0;
        while i < borrowed.len() {
            let (peer, ticket, sent) = &borrowed[i];
            if sent.start < range.end && range.start < sent.end {
                self.wait_sent(*peer, *ticket, id)?;
                borrowed.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Receives `range` (f32s) from `peer` into the buffer at `base`: reduced with `op`, or
    /// copied when `op` is `None`.
    ///
    /// # Safety
    /// `range` of the buffer at `base` is this rank's to write now.
    unsafe fn recv_step(
        &mut self,
        peer: usize,
        base: *mut f32,
        range: &Range<usize>,
        op: Option<ReduceOp>,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut got = 0;
        let mut result = Ok(());
        while got < range.len() && result.is_ok() {
            // SAFETY: forwarded.
            result = unsafe { self.recv_f32_frame(peer, base, range, got, op, &mut scratch, id) }
                .map(|n| got += n);
        }
        self.scratch = scratch;
        result
    }

    /// Reads the next frame of a step that receives `range` (f32s) from `peer`, `got` of its
    /// elements already in, into the buffer at `base`: reduced with `op` (through `scratch`),
    /// or copied when `op` is `None`. Returns the elements the frame carried.
    ///
    /// # Safety
    /// `range` of the buffer at `base` is this rank's to write now.
    #[allow(clippy::too_many_arguments)]
    unsafe fn recv_f32_frame(
        &mut self,
        peer: usize,
        base: *mut f32,
        range: &Range<usize>,
        got: usize,
        op: Option<ReduceOp>,
        scratch: &mut Vec<f32>,
        id: OpId,
    ) -> Result<usize, CommError> {
        // SAFETY: forwarded.
        let dst = unsafe { base.add(range.start) };
        let (got, left) = (got * 4, (range.len() - got) * 4);
        let bytes = match op {
            Some(op) => {
                let mut sink = ReduceSink {
                    dst,
                    base: got,
                    scratch,
                    op,
                };
                self.recv_frame(peer, left, 4, &mut sink, id)
            }
            None => {
                let mut sink = CopySink {
                    dst: dst.cast::<u8>(),
                    base: got,
                };
                self.recv_frame(peer, left, 4, &mut sink, id)
            }
        }?;
        Ok(bytes / 4)
    }

    /// Receives `range` of a 16-bit op's values from `peer` as 16-bit elements and widens
    /// them into the f32 buffer at `base`: copied (final values, TCP-7) or reduced with `op`
    /// (partial sums, COMM-9).
    ///
    /// # Safety
    /// `range` of the buffer at `base` is this rank's to write now.
    unsafe fn recv_widened(
        &mut self,
        peer: usize,
        base: *mut f32,
        range: &Range<usize>,
        dtype: DType,
        op: Option<ReduceOp>,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut scratch = std::mem::take(&mut self.scratch16);
        let mut sink = WidenSink {
            // SAFETY: forwarded.
            dst: unsafe { base.add(range.start) },
            base: 0,
            scratch: &mut scratch,
            dtype,
            op,
        };
        let result = self.recv_bytes(peer, range.len() * 2, 2, &mut sink, id);
        self.scratch16 = scratch;
        result
    }

    /// Parts of received ranges sent on before their step ended (TCP-8).
    #[cfg(test)]
    pub(crate) fn forwarded_parts(&self) -> u64 {
        self.forwarded_parts
    }

    /// Data payload bytes this rank handed to its links so far (TCP-7, EMU-1).
    pub(crate) fn data_bytes_sent(&self) -> u64 {
        self.data_bytes_sent
    }

    /// Reads frames from `peer` into `sink` until `expected` bytes arrived.
    pub(super) fn recv_bytes(
        &mut self,
        peer: usize,
        expected: usize,
        granule: u64,
        sink: &mut dyn StepSink,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut filled = 0;
        while filled < expected {
            sink.set_base(filled);
            filled += self.recv_frame(peer, expected - filled, granule, sink, id)?;
        }
        Ok(())
    }

    /// Reads one frame of at most `most` bytes from `peer` into `sink`; returns its length.
    fn recv_frame(
        &mut self,
        peer: usize,
        most: usize,
        granule: u64,
        sink: &mut dyn StepSink,
        id: OpId,
    ) -> Result<usize, CommError> {
        let Some(link) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(self.out_of_step(peer, id, "no link to this rank".into()));
        };
        match link
            .reader
            .recv_into(most as u64, granule, sink, id.deadline)
        {
            Ok(0) => Err(self.out_of_step(peer, id, "an empty data frame inside a step".into())),
            Ok(n) => Ok(n as usize),
            Err(e) => Err(self.link_error(peer, id, &e)),
        }
    }

    /// TCP-8: receives `range` (f32s) from `peer` as [`TcpCommunicator::recv_step`] does and
    /// sends each part on to `forward.to` as soon as it is in (finished first where the plan
    /// finishes the range before sending it), instead of once the whole range is in.
    ///
    /// A part is whole frames of at least [`forward_part`]'s length: at most
    /// `SEND_QUEUE / (2·world)` parts a step, so an op's sends to one peer never fill the
    /// link's queue and a push never waits for room (TCP-3). Forwarded bytes are read by the
    /// next rank only in its next step; a full queue here would leave every rank of a ring
    /// waiting in a push for a successor that waits in its own.
    ///
    /// # Safety
    /// `range` of the buffer at `base` is this rank's to write now and no other send reads it.
    #[allow(clippy::too_many_arguments)]
    unsafe fn recv_forwarding(
        &mut self,
        peer: usize,
        base: *mut f32,
        range: &Range<usize>,
        op: Option<ReduceOp>,
        forward: &Forward,
        borrowed: &mut Vec<(usize, u64, Range<usize>)>,
        id: OpId,
    ) -> Result<(), CommError> {
        let least = forward_part(range.len(), self.world);
        let mut scratch = std::mem::take(&mut self.scratch);
        // Elements of the range received (`filled`) and sent on (`sent`).
        let (mut filled, mut sent) = (range.start, range.start);
        let mut result = Ok(());
        while filled < range.end && result.is_ok() {
            // SAFETY: forwarded.
            let frame = unsafe {
                self.recv_f32_frame(
                    peer,
                    base,
                    range,
                    filled - range.start,
                    op,
                    &mut scratch,
                    id,
                )
            };
            result = frame.and_then(|n| {
                let arrived = filled..filled + n;
                filled = arrived.end;
                if let Some(op) = forward.finish {
                    // SAFETY: the part lies in the range, which this rank owns now.
                    finish(unsafe { part(base, &arrived) }, op, self.world);
                }
                if filled - sent >= least || filled == range.end {
                    let to = (forward.to, forward.mode);
                    // SAFETY: as above; the part is recorded in `borrowed`.
                    unsafe { self.send_range(base, sent..filled, to, borrowed, id)? };
                    self.forwarded_parts += 1;
                    sent = filled;
                }
                Ok(())
            });
        }
        self.scratch = scratch;
        result
    }

    /// Queues `range` of the buffer at `base` for the link to `to.0`, from the buffer itself
    /// (`Borrow`, recorded in `borrowed`) or as a copy (`to.1`, TCP-3).
    ///
    /// # Safety
    /// `range` lies in the buffer at `base`; borrowed, it stays unwritten until its send
    /// completes (`wait_overlapping`).
    unsafe fn send_range(
        &mut self,
        base: *mut f32,
        range: Range<usize>,
        (to, mode): (usize, SendMode),
        borrowed: &mut Vec<(usize, u64, Range<usize>)>,
        id: OpId,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded.
        let bytes = bytes_of(&*unsafe { part(base, &range) });
        let payload = match mode {
            SendMode::Borrow => Payload::Borrowed(RawBytes {
                ptr: bytes.as_ptr(),
                len: bytes.len(),
            }),
            SendMode::Copy => Payload::Owned(bytes.to_vec()),
        };
        self.data_bytes_sent += bytes.len() as u64;
        let ticket = self.push(to, payload, id)?;
        if mode == SendMode::Borrow {
            borrowed.push((to, ticket, range));
            #[cfg(test)]
            super::tests::panic_if_asked();
        }
        Ok(())
    }

    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        cross::all_reduce(self, buf, op)
    }

    pub(crate) fn broadcast<T: Element>(
        &mut self,
        buf: &mut [T],
        root: Rank,
    ) -> Result<(), CommError> {
        cross::broadcast(self, buf, root)
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        cross::reduce_scatter(self, input, output, op)
    }

    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        cross::all_gather(self, input, output)
    }

    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        let call = CallShape::barrier();
        self.rendezvous(call).map(|_| ())
    }

    pub(super) fn check_peer(&self, op: CollectiveKind, peer: Rank) -> Result<usize, CommError> {
        cross::check_peer((self.generation, self.rank, self.world), op, peer)
    }

    /// The peer's answer to a send or recv header: its call, checked to be the matching op.
    pub(super) fn p2p_header(
        &mut self,
        peer: usize,
        expect: CollectiveKind,
        id: OpId,
    ) -> Result<CallShape, CommError> {
        match self.read_header(peer, id, id.deadline) {
            Ok(header)
                if header.seq == id.seq
                    && header.call.kind == expect
                    && header.call.peer == Some(self.rank) =>
            {
                Ok(header.call)
            }
            Ok(header) => Err(self.out_of_step(
                peer,
                id,
                format!(
                    "expected {expect} #{}, got {} #{}",
                    id.seq, header.call.kind, header.seq
                ),
            )),
            Err(HeaderError::Timeout) => Err(CommError::Timeout {
                generation: self.generation,
                seq: id.seq,
                op: id.op,
                missing: vec![rank_of(peer)],
                waited: self.timeout,
            }),
            Err(HeaderError::Comm(e)) => Err(e),
        }
    }

    pub(super) fn p2p_mismatch(
        &self,
        id: OpId,
        peer: usize,
        mine: CallShape,
        theirs: CallShape,
    ) -> CommError {
        cross::p2p_mismatch(
            (self.generation, id.seq, id.op),
            RankCall {
                rank: self.rank,
                call: mine,
            },
            RankCall {
                rank: rank_of(peer),
                call: theirs,
            },
        )
    }

    pub(crate) fn send<T: Element>(&mut self, buf: &[T], to: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Send;
        let peer = self.check_peer(op, to)?;
        let id = OpId {
            seq: self.sent[peer],
            op,
            deadline: self.deadline(),
        };
        self.sent[peer] += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let mine = CallShape::point_to_point::<T>(op, buf.len(), to);
        let header = self.encode_header(id.seq, &mine);
        let result = (|| {
            self.push(peer, Payload::Owned(header), id)?;
            let theirs = self.p2p_header(peer, CollectiveKind::Recv, id)?;
            if theirs.dtype != mine.dtype || theirs.len != mine.len {
                return Ok(Err(self.p2p_mismatch(id, peer, mine, theirs)));
            }
            let bytes = bytes_of(buf);
            if !bytes.is_empty() {
                let payload = Payload::Borrowed(RawBytes {
                    ptr: bytes.as_ptr(),
                    len: bytes.len(),
                });
                self.push(peer, payload, id)?;
            }
            self.wait_all_sent(id)?;
            Ok(Ok(()))
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => Err(self.fail(e)),
        }
    }

    pub(crate) fn recv<T: Element>(&mut self, buf: &mut [T], from: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Recv;
        let peer = self.check_peer(op, from)?;
        let id = OpId {
            seq: self.received[peer],
            op,
            deadline: self.deadline(),
        };
        self.received[peer] += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let mine = CallShape::point_to_point::<T>(op, buf.len(), from);
        let result = (|| {
            let theirs = self.p2p_header(peer, CollectiveKind::Send, id)?;
            let header = self.encode_header(id.seq, &mine);
            self.push(peer, Payload::Owned(header), id)?;
            if theirs.dtype != mine.dtype || theirs.len != mine.len {
                self.wait_all_sent(id)?;
                return Ok(Err(self.p2p_mismatch(id, peer, mine.clone(), theirs)));
            }
            let size = std::mem::size_of::<T>();
            let mut sink = CopySink {
                dst: buf.as_mut_ptr().cast::<u8>(),
                base: 0,
            };
            self.recv_bytes(peer, std::mem::size_of_val(buf), size as u64, &mut sink, id)?;
            self.wait_all_sent(id)?;
            Ok(Ok(()))
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// The fewest elements a forwarded part of a `len`-element range holds (TCP-8), so that the
/// range leaves in at most `SEND_QUEUE / (2·world)` parts, as [`narrow_pieces`] cuts a 16-bit
/// send: every part but the last holds at least this many, the last may be shorter.
pub(super) fn forward_part(len: usize, world: usize) -> usize {
    let most = (SEND_QUEUE / (2 * world.max(1))).max(2);
    len.div_ceil(most - 1).max(1)
}

/// The elements `range` of the buffer at `base`.
///
/// # Safety
/// The range lies in the buffer, and no one else reads or writes it for the slice's life.
unsafe fn part<'a>(base: *mut f32, range: &Range<usize>) -> &'a mut [f32] {
    // SAFETY: forwarded.
    unsafe { std::slice::from_raw_parts_mut(base.add(range.start), range.len()) }
}

/// Where [`TcpCommunicator::recv_forwarding`] sends each received frame's part on to.
struct Forward {
    to: usize,
    mode: SendMode,
    /// The op whose last step is applied to the part before it leaves.
    finish: Option<ReduceOp>,
}

/// A received range that the plan's next steps send on whole (TCP-8): `Send` of the same
/// range, perhaps after `Finish` of it.
struct Onward {
    to: usize,
    finish: bool,
    /// How many of the following steps the forwarding replaces.
    steps: usize,
}

impl Onward {
    fn of(rest: &[Step], received: &Range<usize>) -> Option<Self> {
        match rest {
            [Step::Finish { range: f }, Step::Send { to, range: s }, ..]
                if f == received && s == received =>
            {
                Some(Self {
                    to: to.index(),
                    finish: true,
                    steps: 2,
                })
            }
            [Step::Send { to, range: s }, ..] if s == received => Some(Self {
                to: to.index(),
                finish: false,
                steps: 1,
            }),
            _ => None,
        }
    }
}

impl cross::PlanTransport for TcpCommunicator {
    type Op = OpId;

    fn world(&self) -> usize {
        self.world
    }

    fn me(&self) -> usize {
        self.rank.index()
    }

    fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm {
        TcpCommunicator::resolve::<T>(self, kind, len)
    }

    fn partial_sums(&self) -> PartialSums {
        self.partial_sums
    }

    fn start(&mut self, call: CallShape) -> Result<OpId, CommError> {
        self.rendezvous(call)
    }

    fn run_plan(&mut self, call: &CallShape, work: &mut [f32], op: &OpId) -> Result<(), CommError> {
        // SAFETY: `work` is borrowed for the whole call and not touched otherwise.
        unsafe { self.run(call, work.as_mut_ptr(), *op) }
    }

    fn work(&mut self) -> &mut Vec<f32> {
        &mut self.work
    }
}
