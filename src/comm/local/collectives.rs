//! The collective and point-to-point operations of an in-process rank: rendezvous, then the
//! rank's part of the op's plan, through mailboxes (ring, tree) or reading peers' buffers in
//! place (direct plans).

use super::*;

impl LocalCommunicator {
    pub(super) fn plan_for(
        &mut self,
        kind: CollectiveKind,
        algorithm: Algorithm,
        len: usize,
        root: Rank,
    ) -> Plan {
        match self.plan_cache.take() {
            Some((r, plan))
                if r == root
                    && plan.kind == kind
                    && plan.algorithm == algorithm
                    && plan.len == len =>
            {
                plan
            }
            _ => plan::plan(kind, algorithm, self.group.world, len, root).unwrap_or(Plan {
                kind,
                algorithm,
                world: self.group.world,
                len,
                steps: vec![Vec::new(); self.group.world],
            }),
        }
    }

    /// Runs the validated collective `call` (op `seq`).
    ///
    /// # Safety
    /// `buffers` describe live buffers of the validated lengths that this rank does not
    /// otherwise touch until this returns; for message plans `work` already holds this rank's
    /// conceptual buffer.
    unsafe fn run<T: Element>(
        &mut self,
        call: &CallShape,
        (seq, deadline): (u64, Instant),
        buffers: Option<Target<T>>,
        work: &mut [f32],
    ) -> Result<(), CommError> {
        let (kind, len) = (call.kind, call.len);
        let root = call.peer.unwrap_or(Rank(0));
        let op = call.reduce.unwrap_or(ReduceOp::Sum);
        let algorithm = call.algorithm.unwrap_or(Algorithm::Direct);
        let plan = self.plan_for(kind, algorithm, len, root);
        let me = self.me();
        let result = match buffers {
            // SAFETY: forwarded from the caller.
            Some(target) => {
                // Peers read this rank's buffer until the plan's last barrier: if this thread
                // unwound in between, its buffer would be freed under their reads and they
                // would wait forever at the next barrier. Abort instead (never expected: the
                // plan was validated at the rendezvous).
                let guard = crate::comm::AbortOnUnwind(
                    "a rank panicked inside a direct collective's data phase",
                );
                unsafe { execute_direct(&self.group, me, plan.steps_of(self.rank), target, op) };
                std::mem::forget(guard);
                Ok(())
            }
            None => {
                let mut wire = Wire {
                    hook: self.hook.as_deref(),
                    link: self.group.config.link.as_ref(),
                    narrow: Narrowing::of(call, &plan, self.rank),
                    sent_bytes: 0,
                };
                let r = execute_messages(
                    &self.group,
                    me,
                    plan.steps_of(self.rank),
                    work,
                    op,
                    seq,
                    kind,
                    deadline,
                    self.timeout,
                    &mut wire,
                );
                self.bytes_sent += wire.sent_bytes;
                r
            }
        };
        self.plan_cache = Some((root, plan));
        result
    }

    pub(super) fn post<T>(&self, source: (*const T, usize)) {
        let posted = &self.group.posted[self.me()];
        posted.ptr.store(source.0 as usize, Ordering::Release);
        posted.offset.store(source.1, Ordering::Release);
    }

    /// Stages 1 to 3 for one collective over `T`.
    pub(super) fn collective<T: Element>(
        &mut self,
        call: CallShape,
        buffers: Buffers<T>,
        prepare_direct: impl FnOnce(),
        to_work: impl FnOnce(&mut Vec<f32>),
        from_work: impl FnOnce(&[f32]),
    ) -> Result<(), CommError> {
        let seq = self.take_seq();
        let deadline = self.deadline();
        let algorithm = call.algorithm.unwrap_or(Algorithm::Direct);
        self.post(buffers.source);
        self.group
            .rendezvous(self.me(), seq, call.clone(), deadline, self.timeout)?;
        self.last_algorithm = Some(algorithm);
        if algorithm == Algorithm::Direct {
            prepare_direct();
            // SAFETY: the rendezvous validated every rank's lengths against the plan; the
            // caller built `buffers` from its exclusive borrows and touches them no more.
            return unsafe { self.run(&call, (seq, deadline), Some(buffers.target), &mut []) };
        }
        let mut work = std::mem::take(&mut self.work);
        to_work(&mut work);
        // SAFETY: message plans touch no raw buffer.
        let result = unsafe { self.run::<T>(&call, (seq, deadline), None, &mut work) };
        if result.is_ok() {
            from_work(&work);
        }
        self.work = work;
        result
    }

    /// All-reduce in place: afterwards every rank's `buf` holds the element-wise reduction
    /// of all ranks' `buf`s, bit-identical on every rank. Ranks must pass equal lengths,
    /// the same type and the same `op`.
    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let call = CallShape::all_reduce::<T>(
            self.resolve::<T>(CollectiveKind::AllReduce, buf.len()),
            buf.len(),
            op,
        )
        .with_partial_sums(self.partial_sums);
        self.in_place(call, buf)
    }

    /// The algorithm this rank resolves for a collective of `kind` over `len` elements of `T`.
    pub(super) fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm {
        // EMU-3: on an emulated network, Auto picks the plan by the link's cost model.
        if let Some(link) = &self.group.config.link
            && self.algorithm == Algorithm::Auto
        {
            let bytes = len.saturating_mul(T::DTYPE.size_bytes());
            return link.choose(kind, self.group.world, bytes);
        }
        let chosen = plan::choose(
            self.algorithm,
            kind,
            self.group.world,
            len.saturating_mul(T::DTYPE.size_bytes()),
        );
        // COMM-8: checked or hooked messages need a plan made of messages.
        let messages_only = self.group.config.verify_payloads
            || self.hook.is_some()
            || self.group.config.link.is_some();
        if messages_only && chosen == Algorithm::Direct {
            Algorithm::Ring
        } else {
            chosen
        }
    }

    /// An f32 message-plan collective that works directly in the caller's buffer.
    pub(super) fn message_in_place<T: Element>(
        &mut self,
        call: CallShape,
        buf: &mut [T],
        ptr: *mut T,
    ) -> Result<(), CommError> {
        let seq = self.take_seq();
        let deadline = self.deadline();
        let algorithm = call.algorithm.unwrap_or(Algorithm::Direct);
        self.post::<T>((ptr.cast_const(), 0));
        self.group
            .rendezvous(self.me(), seq, call.clone(), deadline, self.timeout)?;
        self.last_algorithm = Some(algorithm);
        let Some(work) = as_f32_mut(buf) else {
            return Ok(());
        };
        // SAFETY: message plans touch no raw buffer; `work` is the caller's buffer.
        unsafe { self.run::<T>(&call, (seq, deadline), None, work) }
    }

    /// Reduce-scatter: `input` is the full buffer of length L on every rank; afterwards
    /// `output` holds this rank's chunk `chunk_range(L, world, rank)` of the reduction.
    /// `output.len()` must equal that chunk's length (else [`CommError::Mismatch`]).
    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let len = input.len();
        let mine = chunk_range(len, self.group.world, self.me());
        let call = CallShape::reduce_scatter::<T>(
            self.resolve::<T>(CollectiveKind::ReduceScatter, len),
            len,
            (output.len(), mine.len()),
            op,
        )
        .with_partial_sums(self.partial_sums);
        let out_ptr = output.as_mut_ptr();
        let out_len = output.len();
        let buffers = Buffers {
            source: (input.as_ptr(), 0),
            target: Target {
                ptr: out_ptr,
                offset: mine.start,
            },
        };
        self.collective(
            call,
            buffers,
            || {},
            |work| {
                work.clear();
                work.resize(len, 0.0);
                widen(work, input);
            },
            |work| {
                // SAFETY: `out_ptr` is `output`, borrowed for this call; its length was
                // validated to equal the chunk.
                let output = unsafe { std::slice::from_raw_parts_mut(out_ptr, out_len) };
                narrow(output, &work[mine.clone()]);
            },
        )
    }

    /// All-gather: `output` has the same length L on every rank; rank r contributes `input`
    /// as chunk `chunk_range(L, world, r)` (its length must match, else
    /// [`CommError::Mismatch`]); afterwards every `output` holds all chunks.
    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let len = output.len();
        let mine = chunk_range(len, self.group.world, self.me());
        let call = CallShape::all_gather::<T>(
            self.resolve::<T>(CollectiveKind::AllGather, len),
            len,
            (input.len(), mine.len()),
        );
        let out_ptr = output.as_mut_ptr();
        let buffers = Buffers {
            source: (input.as_ptr(), mine.start),
            target: Target {
                ptr: out_ptr,
                offset: 0,
            },
        };
        let own = mine.clone();
        self.collective(
            call,
            buffers,
            || {
                // SAFETY: validated: `input.len() == own.len()` and `own` lies in `output`;
                // no peer reads `output`.
                let output = unsafe { std::slice::from_raw_parts_mut(out_ptr, len) };
                output[own].copy_from_slice(input);
            },
            |work| {
                work.clear();
                work.resize(len, 0.0);
                widen(&mut work[mine.clone()], input);
            },
            |work| {
                // SAFETY: `out_ptr` is `output`, borrowed for this call.
                narrow(
                    unsafe { std::slice::from_raw_parts_mut(out_ptr, len) },
                    work,
                );
            },
        )
    }

    /// The shared tail of the in-place collectives (all-reduce, broadcast) once their call is
    /// described: f32 message plans run in `buf` itself; other element types go through the
    /// f32 working buffer; the direct plan reads and writes `buf` in place.
    pub(super) fn in_place<T: Element>(
        &mut self,
        call: CallShape,
        buf: &mut [T],
    ) -> Result<(), CommError> {
        if as_f32_mut(buf).is_some() && call.algorithm != Some(Algorithm::Direct) {
            // f32 message plans run in the caller's buffer itself.
            let ptr = buf.as_mut_ptr();
            return self.message_in_place(call, buf, ptr);
        }
        let ptr = buf.as_mut_ptr();
        let len = buf.len();
        let buffers = Buffers {
            source: (ptr.cast_const(), 0),
            target: Target { ptr, offset: 0 },
        };
        // SAFETY (for the closures below): they run only for message plans, where no peer
        // reads `buf`, and never concurrently with the direct path.
        self.collective(
            call,
            buffers,
            || {},
            |work| {
                work.clear();
                work.resize(len, 0.0);
                // SAFETY: `ptr` is `buf`, borrowed for this call; nothing else reads it now.
                widen(work, unsafe { std::slice::from_raw_parts(ptr, len) });
            },
            |work| {
                // SAFETY: as above.
                narrow(unsafe { std::slice::from_raw_parts_mut(ptr, len) }, work);
            },
        )
    }

    /// Broadcast: afterwards every rank's `buf` equals `root`'s. Ranks must pass equal
    /// lengths, the same type and the same root (inside the group).
    pub(crate) fn broadcast<T: Element>(
        &mut self,
        buf: &mut [T],
        root: Rank,
    ) -> Result<(), CommError> {
        let len = buf.len();
        let call =
            CallShape::broadcast::<T>(self.resolve::<T>(CollectiveKind::Broadcast, len), len, root);
        self.in_place(call, buf)
    }

    /// Barrier: returns once every rank of the group called it (or with an error).
    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        let seq = self.take_seq();
        let deadline = self.deadline();
        let call = CallShape::barrier();
        self.group
            .rendezvous(self.me(), seq, call, deadline, self.timeout)
    }

    pub(super) fn check_peer(&self, op: CollectiveKind, peer: Rank) -> Result<usize, CommError> {
        let p = peer.index();
        if p >= self.group.world || p == self.me() {
            return Err(CommError::InvalidPeer {
                generation: self.group.generation,
                op,
                rank: self.rank,
                peer,
                world: self.group.world,
            });
        }
        Ok(p)
    }

    /// Sends `buf` to rank `to`; returns once `to`'s matching [`Communicator::recv`] copied
    /// it (or failed). The k-th send from a rank to `to` matches the k-th recv of `to` from
    /// that rank; lengths and types must agree (else [`CommError::Mismatch`] on both sides).
    pub(crate) fn send<T: Element>(&mut self, buf: &[T], to: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Send;
        let peer = self.check_peer(op, to)?;
        let me = self.me();
        let seq = self.sent[peer];
        self.sent[peer] += 1;
        let deadline = self.deadline();
        if let Some(refusal) = self.group.refusal(seq, op, false) {
            return Err(refusal);
        }
        // EMU-1: the send is posted once the emulated link has carried its bytes.
        let bytes = std::mem::size_of_val(buf);
        self.bytes_sent += bytes as u64;
        if let Some(link) = &self.group.config.link {
            // Never past the op's deadline: the wait below then reports the time-out.
            let left = deadline.saturating_duration_since(Instant::now());
            std::thread::sleep(link.delay(self.rank, bytes).min(left));
        }
        let group = &*self.group;
        let slot = me * group.world + peer;
        let mut pairs = lock(&group.pairs);
        pairs[slot].outcome = None;
        pairs[slot].post = Some(SendPost {
            seq,
            call: CallShape::point_to_point::<T>(op, buf.len(), to),
            ptr: buf.as_ptr() as usize,
        });
        group.pair_changed.notify_all();
        loop {
            if let Some((s, outcome)) = pairs[slot].outcome.take()
                && s == seq
            {
                return outcome;
            }
            // Once claimed, the receiver is reading `buf`: wait for it whatever happens.
            if !pairs[slot].claimed {
                if group.closed.load(Ordering::Acquire) != OPEN {
                    pairs[slot].post = None;
                    drop(pairs);
                    return Err(group
                        .refusal(seq, op, false)
                        .unwrap_or(CommError::Shutdown {
                            generation: group.generation,
                            seq,
                            op,
                        }));
                }
                if Instant::now() >= deadline {
                    pairs[slot].post = None;
                    drop(pairs);
                    let error = CommError::Timeout {
                        generation: group.generation,
                        seq,
                        op,
                        missing: vec![to],
                        waited: self.timeout,
                    };
                    group.poison(error.clone(), None);
                    return Err(error);
                }
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(1), PARK_SLICE);
            pairs = group
                .pair_changed
                .wait_timeout(pairs, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Receives into `buf` the matching [`Communicator::send`] of rank `from` (see there).
    pub(crate) fn recv<T: Element>(&mut self, buf: &mut [T], from: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Recv;
        let peer = self.check_peer(op, from)?;
        let me = self.me();
        let seq = self.received[peer];
        self.received[peer] += 1;
        let deadline = self.deadline();
        if let Some(refusal) = self.group.refusal(seq, op, false) {
            return Err(refusal);
        }
        let group = &*self.group;
        let slot = peer * group.world + me;
        let mine = CallShape::point_to_point::<T>(op, buf.len(), from);
        let mut pairs = lock(&group.pairs);
        let post = loop {
            if pairs[slot].post.as_ref().is_some_and(|p| p.seq == seq) {
                pairs[slot].claimed = true;
                break pairs[slot].post.take();
            }
            if group.closed.load(Ordering::Acquire) != OPEN {
                drop(pairs);
                return Err(group
                    .refusal(seq, op, false)
                    .unwrap_or(CommError::Shutdown {
                        generation: group.generation,
                        seq,
                        op,
                    }));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(pairs);
                let error = CommError::Timeout {
                    generation: group.generation,
                    seq,
                    op,
                    missing: vec![from],
                    waited: self.timeout,
                };
                group.poison(error.clone(), None);
                return Err(error);
            }
            pairs = group
                .pair_changed
                .wait_timeout(pairs, (deadline - now).min(PARK_SLICE))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        drop(pairs);
        let Some(post) = post else {
            return Ok(()); // unreachable: the loop only breaks with a post
        };
        let outcome = if post.call.dtype == mine.dtype && post.call.len == mine.len {
            // SAFETY: the sender blocks until we publish the outcome, so its buffer of
            // `post.call.len` elements is live; equal dtypes mean it is a `[T]` (Element is
            // sealed and each type has its own DTYPE).
            let src = unsafe { std::slice::from_raw_parts(post.ptr as *const T, post.call.len) };
            buf.copy_from_slice(src);
            Ok(())
        } else {
            let mut calls = vec![
                RankCall {
                    rank: from,
                    call: post.call,
                },
                RankCall {
                    rank: self.rank,
                    call: mine,
                },
            ];
            calls.sort_by_key(|c| c.rank);
            Err(CommError::Mismatch {
                generation: group.generation,
                seq,
                op,
                calls,
            })
        };
        let mut pairs = lock(&group.pairs);
        pairs[slot].claimed = false;
        pairs[slot].outcome = Some((
            seq,
            outcome.clone().map_err(|e| match e {
                CommError::Mismatch {
                    generation,
                    seq,
                    calls,
                    ..
                } => CommError::Mismatch {
                    generation,
                    seq,
                    op: CollectiveKind::Send,
                    calls,
                },
                other => other,
            }),
        ));
        group.pair_changed.notify_all();
        outcome
    }
}
