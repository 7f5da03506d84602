//! How a TCP op starts and hands its bytes over: queue a payload for a link and wait for it
//! to leave, write and read the op header every rank exchanges first, and agree on the op.

use super::*;

impl TcpCommunicator {
    /// Queues `payload` for the link to `peer`; returns its ticket.
    pub(super) fn push(
        &mut self,
        peer: usize,
        payload: Payload,
        id: OpId,
    ) -> Result<u64, CommError> {
        let Some(link) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(self.out_of_step(peer, id, "no link to this rank".into()));
        };
        let ticket = link.sender.issued + 1;
        let job = Job::Data {
            ticket,
            payload,
            deadline: id.deadline,
        };
        let sent = link.sender.queue.as_ref().map(|q| q.send(job));
        match sent {
            Some(Ok(())) => {
                link.sender.issued = ticket;
                Ok(ticket)
            }
            _ => {
                let progress = Arc::clone(&link.sender.progress);
                let state = lock(&progress.state);
                let error = state.error.as_ref().map(|e| self.link_error(peer, id, e));
                drop(state);
                Err(error.unwrap_or_else(|| CommError::Link {
                    generation: self.generation,
                    seq: id.seq,
                    op: id.op,
                    peer: rank_of(peer),
                    failure: LinkFailure::Closed {
                        detail: "the link's sender thread has stopped".into(),
                    },
                }))
            }
        }
    }

    /// Waits until the link to `peer` wrote every job up to `ticket`.
    pub(super) fn wait_sent(&self, peer: usize, ticket: u64, id: OpId) -> Result<(), CommError> {
        let Some(link) = self.peers.get(peer).and_then(Option::as_ref) else {
            return Ok(());
        };
        let progress = &link.sender.progress;
        let mut state = lock(&progress.state);
        loop {
            if state.completed >= ticket {
                return Ok(());
            }
            if let Some(error) = &state.error {
                return Err(self.link_error(peer, id, error));
            }
            let now = Instant::now();
            if now >= id.deadline {
                return Err(CommError::Timeout {
                    generation: self.generation,
                    seq: id.seq,
                    op: id.op,
                    missing: vec![rank_of(peer)],
                    waited: self.timeout,
                });
            }
            state = progress
                .changed
                .wait_timeout(state, id.deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Waits until every job queued on every link was written.
    pub(super) fn wait_all_sent(&self, id: OpId) -> Result<(), CommError> {
        for (r, peer) in self.peers.iter().enumerate() {
            if let Some(peer) = peer {
                self.wait_sent(r, peer.sender.issued, id)?;
            }
        }
        Ok(())
    }

    pub(super) fn encode_header(&self, seq: u64, call: &CallShape) -> Vec<u8> {
        let header = OpHeader {
            tag: HEADER_TAG,
            generation: self.generation.0,
            seq,
            call: call.clone(),
        };
        bincode::serde::encode_to_vec(&header, bincode_config())
            .expect("an op header always encodes")
    }

    /// Reads the next header from `peer` before `deadline`.
    pub(super) fn read_header(
        &mut self,
        peer: usize,
        id: OpId,
        deadline: Instant,
    ) -> Result<OpHeader, HeaderError> {
        let Some(link) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(HeaderError::Comm(self.out_of_step(
                peer,
                id,
                "no link to this rank".into(),
            )));
        };
        if let Err(e) = link.reader.recv(&mut self.header, MAX_HEADER, deadline) {
            return Err(match e {
                LinkError::Timeout { .. } => HeaderError::Timeout,
                e => HeaderError::Comm(self.link_error(peer, id, &e)),
            });
        }
        match bincode::serde::decode_from_slice::<OpHeader, _>(&self.header, bincode_config()) {
            Ok((header, used)) if used == self.header.len() && header.tag == HEADER_TAG => {
                if header.generation != self.generation.0 {
                    return Err(HeaderError::Comm(self.out_of_step(
                        peer,
                        id,
                        format!(
                            "a header of generation {} in generation {}",
                            header.generation, self.generation.0
                        ),
                    )));
                }
                Ok(header)
            }
            _ => Err(HeaderError::Comm(self.out_of_step(
                peer,
                id,
                format!(
                    "expected the header of {} #{}, got {} bytes that are not one",
                    id.op,
                    id.seq,
                    self.header.len()
                ),
            ))),
        }
    }

    /// Stage 1 of a collective: exchange calls with every peer and check them (COMM-2).
    pub(super) fn rendezvous(&mut self, call: CallShape) -> Result<OpId, CommError> {
        let id = OpId {
            seq: self.seq,
            op: call.kind,
            deadline: self.deadline(),
        };
        self.seq += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let header = self.encode_header(id.seq, &call);
        let me = self.me();
        for peer in (0..self.world).filter(|&p| p != me) {
            if let Err(e) = self.push(peer, Payload::Owned(header.clone()), id) {
                return Err(self.fail(e));
            }
        }
        let mut calls = Vec::with_capacity(self.world);
        for peer in 0..self.world {
            if peer == me {
                calls.push(RankCall {
                    rank: self.rank,
                    call: call.clone(),
                });
                continue;
            }
            match self.read_header(peer, id, id.deadline) {
                Ok(header) => {
                    let collective = !matches!(
                        header.call.kind,
                        CollectiveKind::Send | CollectiveKind::Recv
                    );
                    if header.seq != id.seq || !collective {
                        let e = self.out_of_step(
                            peer,
                            id,
                            format!(
                                "expected collective #{}, got {} #{}",
                                id.seq, header.call.kind, header.seq
                            ),
                        );
                        return Err(self.fail(e));
                    }
                    calls.push(RankCall {
                        rank: rank_of(peer),
                        call: header.call,
                    });
                }
                Err(HeaderError::Comm(e)) => return Err(self.fail(e)),
                Err(HeaderError::Timeout) => {
                    // Name every rank not heard from: probe the ones not read yet briefly.
                    let mut missing = vec![rank_of(peer)];
                    for later in (peer + 1..self.world).filter(|&p| p != me) {
                        if self.read_header(later, id, Instant::now() + PROBE).is_err() {
                            missing.push(rank_of(later));
                        }
                    }
                    let e = CommError::Timeout {
                        generation: self.generation,
                        seq: id.seq,
                        op: id.op,
                        missing,
                        waited: self.timeout,
                    };
                    return Err(self.fail(e));
                }
            }
        }
        if !cross::calls_fit(&calls, self.world) {
            return Err(CommError::Mismatch {
                generation: self.generation,
                seq: id.seq,
                op: id.op,
                calls,
            });
        }
        Ok(id)
    }
}
