//! How an in-process op meets its peers: post the call, wait (spin, yield, park) until every
//! rank posted the same op, validate the calls (COMM-2), refuse or poison on failure (COMM-3,
//! COMM-4), and the mailboxes message plans copy through.

use super::*;

impl LocalGroup {
    pub(super) fn wake_everyone(&self) {
        {
            let _state = lock(&self.state);
            self.arrived.notify_all();
        }
        for mailbox in &self.mailboxes {
            let _state = lock(&mailbox.state);
            mailbox.cv.notify_all();
        }
        let _pairs = lock(&self.pairs);
        self.pair_changed.notify_all();
    }

    /// The error an op gets when the group is closed, `None` while it is open. Takes the
    /// state lock: call it without holding any other lock of the group.
    pub(super) fn refusal(
        &self,
        seq: u64,
        op: CollectiveKind,
        collective: bool,
    ) -> Option<CommError> {
        if self.closed.load(Ordering::Acquire) == OPEN {
            return None;
        }
        self.refusal_locked(&lock(&self.state), seq, op, collective)
    }

    pub(super) fn refusal_locked(
        &self,
        state: &State,
        seq: u64,
        op: CollectiveKind,
        collective: bool,
    ) -> Option<CommError> {
        if state.shut_down {
            return Some(CommError::Shutdown {
                generation: self.generation,
                seq,
                op,
            });
        }
        let failure = state.failure.as_ref()?;
        if collective && failure.collective_seq == Some(seq) {
            // This op is the one that timed out: report the time-out itself.
            return Some(failure.error.clone());
        }
        Some(CommError::Poisoned {
            generation: self.generation,
            seq,
            op,
            cause: Box::new(failure.error.clone()),
        })
    }

    pub(super) fn poison(&self, error: CommError, collective_seq: Option<u64>) {
        {
            let mut state = lock(&self.state);
            if state.failure.is_none() {
                state.failure = Some(Failure {
                    error,
                    collective_seq,
                });
            }
        }
        let _ = self
            .closed
            .compare_exchange(OPEN, POISONED, Ordering::SeqCst, Ordering::SeqCst);
        self.wake_everyone();
    }

    /// Stage 1: post `call` as rank `me`'s collective `seq` and wait for every rank.
    pub(super) fn rendezvous(
        &self,
        me: usize,
        seq: u64,
        call: CallShape,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), CommError> {
        let op = call.kind;
        let done = (seq + 1) << 1;
        {
            let mut state = lock(&self.state);
            if let Some(refusal) = self.refusal_locked(&state, seq, op, false) {
                return Err(refusal);
            }
            state.arrivals[me] = Some(Arrival {
                seq,
                call,
                at: Instant::now(),
            });
            let arrived = state
                .arrivals
                .iter()
                .filter(|a| a.as_ref().is_some_and(|a| a.seq == seq))
                .count();
            if arrived == self.world {
                let calls: Vec<RankCall> = state
                    .arrivals
                    .iter()
                    .enumerate()
                    .filter_map(|(r, a)| {
                        a.as_ref().map(|a| RankCall {
                            rank: rank_of(r),
                            call: a.call.clone(),
                        })
                    })
                    .collect();
                let valid = self.calls_fit(&calls);
                if !valid {
                    state.last_mismatch = Some((seq, calls));
                }
                self.completion
                    .store(done | u64::from(!valid), Ordering::Release);
                if state.sleepers > 0 {
                    self.arrived.notify_all();
                }
                return self.rendezvous_outcome(&state, me, seq, done | u64::from(!valid));
            }
        }
        if self.spin {
            for _ in 0..SPIN_ITERATIONS {
                let c = self.completion.load(Ordering::Acquire);
                if c >> 1 == done >> 1 {
                    if c & 1 == 0 {
                        return Ok(());
                    }
                    break;
                }
                if self.closed.load(Ordering::Relaxed) != OPEN {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        for _ in 0..YIELDS {
            let c = self.completion.load(Ordering::Acquire);
            if c == done {
                return Ok(());
            }
            if c >> 1 == done >> 1 || self.closed.load(Ordering::Relaxed) != OPEN {
                break;
            }
            std::thread::yield_now();
        }
        let mut state = lock(&self.state);
        loop {
            let c = self.completion.load(Ordering::Acquire);
            if c >> 1 == done >> 1 {
                return self.rendezvous_outcome(&state, me, seq, c);
            }
            if let Some(refusal) = self.refusal_locked(&state, seq, op, true) {
                return Err(refusal);
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<Rank> = state
                    .arrivals
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| a.as_ref().is_none_or(|a| a.seq != seq))
                    .map(|(r, _)| rank_of(r))
                    .collect();
                let error = CommError::Timeout {
                    generation: self.generation,
                    seq,
                    op,
                    missing,
                    waited: timeout,
                };
                drop(state);
                self.poison(error.clone(), Some(seq));
                // Another waiter may have poisoned first: report what the group recorded.
                return Err(self.refusal(seq, op, true).unwrap_or(error));
            }
            state.sleepers += 1;
            state = self
                .arrived
                .wait_timeout(state, (deadline - now).min(PARK_SLICE))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.sleepers -= 1;
        }
    }

    pub(super) fn rendezvous_outcome(
        &self,
        state: &State,
        me: usize,
        seq: u64,
        completion: u64,
    ) -> Result<(), CommError> {
        if completion & 1 == 0 {
            return Ok(());
        }
        let calls = match &state.last_mismatch {
            Some((s, calls)) if *s == seq => calls.clone(),
            _ => Vec::new(),
        };
        let op = calls
            .get(me)
            .map_or(CollectiveKind::Barrier, |c| c.call.kind);
        Err(CommError::Mismatch {
            generation: self.generation,
            seq,
            op,
            calls,
        })
    }

    /// COMM-2: the calls agree with each other and each fits the layout and the group.
    pub(super) fn calls_fit(&self, calls: &[RankCall]) -> bool {
        let Some(first) = calls.first() else {
            return true;
        };
        calls.iter().all(|c| {
            c.call.agrees_with(&first.call)
                && c.call.is_well_formed()
                && c.call.peer.is_none_or(|p| p.index() < self.world)
        })
    }

    pub(super) fn take_buffer(&self, data: &[f32]) -> Vec<f32> {
        let mut buffer = lock(&self.pool).pop().unwrap_or_default();
        buffer.clear();
        buffer.extend_from_slice(data);
        buffer
    }

    pub(super) fn give_buffer(&self, buffer: Vec<f32>) {
        let mut pool = lock(&self.pool);
        if pool.len() < 4 * self.world {
            pool.push(buffer);
        }
    }

    pub(super) fn deliver(&self, from: usize, to: usize, message: Message) {
        let mailbox = &self.mailboxes[to];
        let mut state = lock(&mailbox.state);
        state.queues[from].push_back(message);
        if state.sleeping {
            mailbox.cv.notify_all();
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn receive(
        &self,
        me: usize,
        from: usize,
        (seq, index): (u64, u32),
        op: CollectiveKind,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Message, CommError> {
        let mailbox = &self.mailboxes[me];
        let mut state = lock(&mailbox.state);
        loop {
            // Messages of ops that failed before this one are stale: drop them.
            while state.queues[from].front().is_some_and(|m| m.seq < seq) {
                state.queues[from].pop_front();
            }
            if let Some(message) = state.queues[from].pop_front() {
                drop(state);
                // COMM-8: a later message in the place of this one means this one was lost.
                let error = if message.seq != seq || message.index != index {
                    CommError::MessageLost {
                        generation: self.generation,
                        seq,
                        op,
                        from: rank_of(from),
                        index,
                        got: message.index,
                    }
                } else {
                    match message.crc.map(|c| (c, checksum(&message.data))) {
                        Some((declared, computed)) if declared != computed => {
                            CommError::CorruptMessage {
                                generation: self.generation,
                                seq,
                                op,
                                from: rank_of(from),
                                index,
                                declared,
                                computed,
                            }
                        }
                        _ => return Ok(message),
                    }
                };
                self.poison(error.clone(), Some(seq));
                return Err(self.refusal(seq, op, true).unwrap_or(error));
            }
            if self.closed.load(Ordering::Acquire) != OPEN {
                drop(state);
                return Err(self.closed_error(seq, op));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                let error = CommError::MessageTimeout {
                    generation: self.generation,
                    seq,
                    op,
                    from: rank_of(from),
                    index,
                    waited: timeout,
                };
                self.poison(error.clone(), Some(seq));
                return Err(self.refusal(seq, op, true).unwrap_or(error));
            }
            state.sleeping = true;
            state = mailbox
                .cv
                .wait_timeout(state, (deadline - now).min(PARK_SLICE))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.sleeping = false;
        }
    }

    pub(super) fn closed_error(&self, seq: u64, op: CollectiveKind) -> CommError {
        self.refusal(seq, op, true).unwrap_or(CommError::Shutdown {
            generation: self.generation,
            seq,
            op,
        })
    }
}
