//! A stage's pipeline links: the channels (or, across processes, TCP links) to the stages
//! before and after it, what travels on them, and how a wait on a link is bounded and aborted.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use super::wire::{PacketWire, RemoteEnd};
use super::{ExecError, WireTensor};
use crate::parallel::pipeline::{Instr, PipelineSchedule, StageIndex};

/// Which way data moves on a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Flow {
    /// Activations, towards later blocks.
    Activation,
    /// Gradients, towards earlier blocks.
    Gradient,
}

/// One message on a link: the micro-batch it belongs to and the tensors.
#[derive(Debug)]
pub(super) struct Packet {
    pub(super) mb: u32,
    pub(super) tensors: Vec<WireTensor>,
}

/// A stage's ends of the links its list uses: to a peer in the same process one bounded FIFO
/// per (peer, direction of data), created from the schedule's sends (PIPE-3), holding
/// [`link_capacity`](PipelineSchedule::link_capacity) messages; to a peer in another process
/// one connection ([`PacketWire`]), whose transport's window bounds what is in flight.
#[derive(Debug)]
pub(crate) struct StageLinks {
    pub(super) stage: u32,
    pub(super) to: HashMap<(u32, Flow), SyncSender<Packet>>,
    pub(super) from: HashMap<(u32, Flow), Receiver<Packet>>,
    pub(super) remote: HashMap<u32, RemoteEnd>,
    pub(super) timeout: Duration,
    pub(super) abort: Arc<AtomicBool>,
}

/// How often a blocked send or receive looks at the abort flag.
pub(super) const ABORT_POLL: Duration = Duration::from_millis(20);

/// The links of a pipeline running `plan`: for every stage its ends, in stage order. Every
/// wait on them is bounded by `timeout`, and ends early (with [`ExecError::Aborted`]) once
/// `abort` is set, so a failure elsewhere wakes every stage at once.
pub(crate) fn links(
    plan: &PipelineSchedule,
    timeout: Duration,
    abort: Arc<AtomicBool>,
) -> Vec<StageLinks> {
    let k = plan.stages();
    let mut out: Vec<StageLinks> = (0..k)
        .map(|stage| StageLinks {
            stage,
            to: HashMap::new(),
            from: HashMap::new(),
            remote: HashMap::new(),
            timeout,
            abort: abort.clone(),
        })
        .collect();
    for stage in 0..k {
        for instr in plan.list(StageIndex(stage)) {
            let (peer, flow) = match *instr {
                Instr::SendActivation { to, .. } => (to.0, Flow::Activation),
                Instr::SendGradient { to, .. } => (to.0, Flow::Gradient),
                _ => continue,
            };
            if peer >= k || out[stage as usize].to.contains_key(&(peer, flow)) {
                continue;
            }
            let (tx, rx) = sync_channel(plan.link_capacity() as usize);
            out[stage as usize].to.insert((peer, flow), tx);
            out[peer as usize].from.insert((stage, flow), rx);
        }
    }
    out
}

/// The ends of `stage`'s links when every other peer its list talks to is in another process:
/// `wires[peer]` is the connection to stage `peer`; its links to itself (a block job's) stay
/// in process. A wait is bounded by `timeout`; an abort
/// reaches it by closing the connections (the abort flag of in-process links plays no part).
#[cfg_attr(
    not(feature = "cluster"),
    expect(
        dead_code,
        reason = "only a cluster job's proxies (`cluster::remote`) call it"
    )
)]
pub(crate) fn remote_links(
    plan: &PipelineSchedule,
    stage: u32,
    timeout: Duration,
    mut wires: HashMap<u32, Arc<dyn PacketWire>>,
) -> Result<StageLinks, ExecError> {
    let mut remote = HashMap::new();
    let (mut to, mut from) = (HashMap::new(), HashMap::new());
    for instr in plan.list(StageIndex(stage)) {
        let (peer, flow) = match *instr {
            Instr::SendActivation { to, .. } => (to.0, Flow::Activation),
            Instr::SendGradient { to, .. } => (to.0, Flow::Gradient),
            Instr::RecvActivation { from, .. } => (from.0, Flow::Activation),
            Instr::RecvGradient { from, .. } => (from.0, Flow::Gradient),
            _ => continue,
        };
        if peer == stage {
            // A block job's boundaries pass through the stage's links to itself: in process.
            if let std::collections::hash_map::Entry::Vacant(link) = to.entry((peer, flow)) {
                let (tx, rx) = sync_channel(plan.link_capacity() as usize);
                link.insert(tx);
                from.insert((peer, flow), rx);
            }
            continue;
        }
        if remote.contains_key(&peer) {
            continue;
        }
        let wire = wires.remove(&peer).ok_or_else(|| {
            ExecError::Unsupported(format!(
                "stage {stage} exchanges data with stage {peer} but has no connection to it"
            ))
        })?;
        remote.insert(peer, RemoteEnd::new(wire));
    }
    Ok(StageLinks {
        stage,
        to,
        from,
        remote,
        timeout,
        abort: Arc::new(AtomicBool::new(false)),
    })
}

impl StageLinks {
    pub(super) fn aborted(&self) -> ExecError {
        ExecError::Aborted { stage: self.stage }
    }

    pub(super) fn send(&self, peer: u32, flow: Flow, packet: Packet) -> Result<(), ExecError> {
        let closed = ExecError::LinkClosed {
            stage: self.stage,
            peer,
        };
        if let (None, Some(end)) = (self.to.get(&(peer, flow)), self.remote.get(&peer)) {
            return end.send((self.stage, peer), flow, &packet, self.timeout);
        }
        let tx = self.to.get(&(peer, flow)).ok_or(closed.clone())?;
        // Bounded: wait for room, but never forever (the receiver may have failed).
        let deadline = Instant::now() + self.timeout;
        let mut packet = packet;
        let mut pause = Duration::from_micros(20);
        loop {
            match tx.try_send(packet) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => return Err(closed),
                Err(TrySendError::Full(p)) => {
                    if self.abort.load(Ordering::Relaxed) {
                        return Err(self.aborted());
                    }
                    if Instant::now() >= deadline {
                        return Err(ExecError::Timeout {
                            stage: self.stage,
                            from: peer,
                            mb: p.mb,
                            what: "room on the link",
                            waited: self.timeout,
                        });
                    }
                    packet = p;
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
            }
        }
    }

    pub(super) fn recv(
        &self,
        peer: u32,
        flow: Flow,
        mb: u32,
    ) -> Result<Vec<WireTensor>, ExecError> {
        let what = match flow {
            Flow::Activation => "activation",
            Flow::Gradient => "gradient",
        };
        if let (None, Some(end)) = (self.from.get(&(peer, flow)), self.remote.get(&peer)) {
            return end.recv((self.stage, peer), flow, mb, self.timeout);
        }
        let rx = self.from.get(&(peer, flow)).ok_or(ExecError::LinkClosed {
            stage: self.stage,
            peer,
        })?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.min(ABORT_POLL)) {
                Ok(p) if p.mb == mb => return Ok(p.tensors),
                Ok(p) => {
                    return Err(ExecError::OutOfOrder {
                        stage: self.stage,
                        from: peer,
                        expected: mb,
                        got: p.mb,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(ExecError::LinkClosed {
                        stage: self.stage,
                        peer,
                    });
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.abort.load(Ordering::Relaxed) {
                        return Err(self.aborted());
                    }
                    if left.is_zero() {
                        return Err(ExecError::Timeout {
                            stage: self.stage,
                            from: peer,
                            mb,
                            what,
                            waited: self.timeout,
                        });
                    }
                }
            }
        }
    }
}
