//! How a TCP op fails: the refusal before it starts, the error a broken link or an
//! out-of-step peer becomes, and poisoning the group so no rank waits for a failed one.

use super::*;

impl TcpCommunicator {
    /// The error an op gets before it starts when the communicator is shut down or poisoned.
    pub(super) fn refusal(&self, id: OpId) -> Option<CommError> {
        let shut_down = self.shared.shut_down.load(Ordering::SeqCst);
        let op = (self.generation, id.seq, id.op);
        cross::refusal(shut_down, self.failure.as_ref(), op)
    }

    pub(super) fn shutdown_error(&self, id: OpId) -> CommError {
        CommError::Shutdown {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
        }
    }

    /// Turns a link error with `peer` during op `id` into the op's error (TCP-5).
    pub(super) fn link_error(&self, peer: usize, id: OpId, error: &LinkError) -> CommError {
        if self.shared.shut_down.load(Ordering::SeqCst) {
            return self.shutdown_error(id);
        }
        let peer = rank_of(peer);
        let (generation, seq, op) = (self.generation, id.seq, id.op);
        let link = |failure| CommError::Link {
            generation,
            seq,
            op,
            peer,
            failure,
        };
        let detail = error.to_string();
        match error {
            LinkError::Timeout { .. } => CommError::Timeout {
                generation,
                seq,
                op,
                missing: vec![peer],
                waited: self.timeout,
            },
            LinkError::Aborted { reason, .. } => {
                match bincode::serde::decode_from_slice::<CommError, _>(reason, bincode_config()) {
                    Ok((cause, _)) => CommError::Poisoned {
                        generation,
                        seq,
                        op,
                        cause: Box::new(cause),
                    },
                    Err(_) => link(LinkFailure::BadFrame { detail }),
                }
            }
            LinkError::Closed { .. }
            | LinkError::UnexpectedEof { .. }
            | LinkError::Broken { .. }
            | LinkError::HandshakeRefused { .. }
            | LinkError::Rejected { .. } => link(LinkFailure::Closed { detail }),
            LinkError::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::NotConnected
                        | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                link(LinkFailure::Closed { detail })
            }
            LinkError::Io { .. } => link(LinkFailure::Io { detail }),
            LinkError::Frame { .. } => link(LinkFailure::BadFrame { detail }),
            _ => link(LinkFailure::OutOfStep { detail }),
        }
    }

    pub(super) fn out_of_step(&self, peer: usize, id: OpId, detail: String) -> CommError {
        CommError::Link {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            peer: rank_of(peer),
            failure: LinkFailure::OutOfStep { detail },
        }
    }

    /// Poisons this communicator with `error` and aborts every link, telling the peers the
    /// root cause (TCP-5); returns once no sender thread reads a caller's buffer any more
    /// (TCP-4): each has acknowledged every job, or has ended (a thread that died holding a
    /// job reads nothing any more).
    pub(super) fn fail(&mut self, error: CommError) -> CommError {
        let error = match &error {
            CommError::Shutdown { .. } => error,
            _ if self.shared.shut_down.load(Ordering::SeqCst) => CommError::Shutdown {
                generation: self.generation,
                seq: error.seq().unwrap_or(self.seq),
                op: op_of(&error),
            },
            _ => error,
        };
        if self.failure.is_none() {
            self.failure = Some(error.clone());
        }
        let reason =
            bincode::serde::encode_to_vec(root_cause(&error), bincode_config()).unwrap_or_default();
        let deadline = Instant::now() + ABORT_GRACE;
        for (r, peer) in self.peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            let job = Job::Abort {
                reason: reason.clone(),
                deadline,
            };
            let queued = peer
                .sender
                .queue
                .take()
                .is_some_and(|q| !matches!(q.try_send(job), Err(TrySendError::Full(_))));
            if !queued {
                self.shared.closers.iter().for_each(|c| {
                    if c.peer().rank == Some(rank_of(r)) {
                        c.shutdown();
                    }
                });
            }
        }
        // TCP-4: wait for the sender threads to be done with every job; shut the sockets of
        // the ones still writing after the grace period down, which ends their writes.
        let mut forced = false;
        loop {
            let busy = self.peers.iter().flatten().any(|peer| {
                let running = peer
                    .sender
                    .thread
                    .as_ref()
                    .is_some_and(|t| !t.is_finished());
                running && lock(&peer.sender.progress.state).processed < peer.sender.issued
            });
            if !busy {
                break;
            }
            if !forced && Instant::now() >= deadline {
                self.shared.closers.iter().for_each(LinkCloser::shutdown);
                forced = true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        error
    }
}
