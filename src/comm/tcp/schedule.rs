//! The TCP transport's pure decisions: who listens and who connects for each pair of ranks,
//! which algorithm a cross-process collective runs, and which sends of a plan may go to the
//! socket straight from the caller's buffer. No sockets, no threads: tested on their own.

use std::collections::VecDeque;
use std::ops::Range;

use crate::comm::plan::{Plan, SMALL_BUFFER_BYTES, Step};
use crate::comm::{Algorithm, CollectiveKind};
use crate::mesh::Rank;

/// What a rank does to form the link with one peer (TCP-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkRole {
    /// Wait for the peer on this rank's listener.
    Accept,
    /// Connect to the peer's listener.
    Connect,
}

/// TCP-1: for the pair (me, peer), the lower rank accepts and the higher rank connects, so
/// every pair has exactly one link and no two ranks wait on each other to form it. `None`
/// for a rank and itself.
pub fn link_role(me: Rank, peer: Rank) -> Option<LinkRole> {
    match me.cmp(&peer) {
        std::cmp::Ordering::Less => Some(LinkRole::Accept),
        std::cmp::Ordering::Greater => Some(LinkRole::Connect),
        std::cmp::Ordering::Equal => None,
    }
}

/// The peers `me` takes a `role` with in a group of `world`, in rank order.
pub(crate) fn peers_with_role(me: Rank, world: usize, role: LinkRole) -> Vec<Rank> {
    (0..world)
        .map(|r| Rank(u32::try_from(r).unwrap_or(u32::MAX)))
        .filter(|&peer| link_role(me, peer) == Some(role))
        .collect()
}

/// The algorithm a cross-process collective runs (TCP-2): [`Algorithm::Ring`] or
/// [`Algorithm::Tree`] as requested; [`Algorithm::Auto`] and [`Algorithm::Direct`] (which
/// reads peers' memory and cannot cross a process) become Tree for buffers of at most
/// [`SMALL_BUFFER_BYTES`] in groups of more than two (fewer rounds of latency), Ring otherwise
/// (bandwidth-optimal).
pub(crate) fn resolve(
    requested: Algorithm,
    kind: CollectiveKind,
    world: usize,
    bytes: usize,
) -> Algorithm {
    match requested {
        Algorithm::Ring | Algorithm::Tree => requested,
        Algorithm::Auto | Algorithm::Direct => match kind {
            CollectiveKind::AllReduce
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllGather
            | CollectiveKind::Broadcast
                if world > 2 && bytes <= SMALL_BUFFER_BYTES =>
            {
                Algorithm::Tree
            }
            _ => Algorithm::Ring,
        },
    }
}

/// How one send step of a plan reaches the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendMode {
    /// Written from the caller's buffer itself (no copy); a later step of the same rank that
    /// writes an overlapping range first waits until the send completed.
    Borrow,
    /// Copied first, so later steps may overwrite the range at once.
    Copy,
}

/// The range a step writes in its rank's buffer, if any.
fn written(step: &Step) -> Option<&Range<usize>> {
    match step {
        Step::RecvReduce { range, .. } | Step::RecvCopy { range, .. } | Step::Finish { range } => {
            Some(range)
        }
        _ => None,
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Whether send step `i` of `steps` has its range written by a later step.
fn overwritten_later(steps: &[Step], i: usize) -> bool {
    let Some(Step::Send { range, .. }) = steps.get(i) else {
        return false;
    };
    steps[i + 1..]
        .iter()
        .filter_map(written)
        .any(|w| overlaps(w, range))
}

/// TCP-3: the mode of each send step of `rank` in `plan`, in order. Every send borrows the
/// caller's buffer when the whole plan still completes with borrowed sends that a receiver
/// must consume before their sender overwrites the range ([`completes_with`], the worst
/// case: no socket buffering at all); otherwise the sends whose range is written later are
/// copied (then no step ever waits on a send, and PLAN-2 applies).
pub(crate) fn send_modes(plan: &Plan, rank: Rank) -> Vec<SendMode> {
    let all_borrow = |_: usize, _: usize| SendMode::Borrow;
    let borrow = completes_with(plan, &all_borrow);
    let steps = plan.steps_of(rank);
    steps
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, Step::Send { .. }))
        .map(|(i, _)| {
            if borrow || !overwritten_later(steps, i) {
                SendMode::Borrow
            } else {
                SendMode::Copy
            }
        })
        .collect()
}

/// The pieces a 16-bit send of `range` is converted and queued in: about 256 Ki elements
/// each, so the link's sender thread writes one while the next is converted, and never more
/// than `SEND_QUEUE / (2·world)` per step, so an op's sends to one peer (at most 2(world−1)
/// steps) never fill the link's queue (TCP-3: a full queue would block the rank in a send).
pub(crate) fn narrow_pieces(
    range: &Range<usize>,
    world: usize,
) -> impl Iterator<Item = Range<usize>> {
    const PIECE: usize = 256 << 10;
    let most = (super::SEND_QUEUE / (2 * world.max(1))).max(1);
    let pieces = range.len().div_ceil(PIECE).clamp(1, most);
    let each = range.len().div_ceil(pieces).max(1);
    let (start, end) = (range.start, range.end);
    (start..end)
        .step_by(each)
        .map(move |s| s..(s + each).min(end))
        .chain((start == end).then_some(start..end))
}

/// The modes [`send_modes`] picks, as a function of (rank, step index), for checking.
#[cfg(test)]
pub(crate) fn chosen_modes(plan: &Plan) -> impl Fn(usize, usize) -> SendMode + '_ {
    let modes: Vec<Vec<SendMode>> = (0..plan.world)
        .map(|r| send_modes(plan, Rank(u32::try_from(r).unwrap_or(u32::MAX))))
        .collect();
    move |rank, step| {
        let sends_before = plan.steps[rank][..step]
            .iter()
            .filter(|s| matches!(s, Step::Send { .. }))
            .count();
        modes[rank][sends_before]
    }
}

/// Runs `plan` with TCP semantics on ranges only, and says whether every rank finishes: a
/// send is queued at once (its sender thread writes it while the rank goes on); a borrowed
/// send (`mode(rank, step)`) counts as outstanding until its receiver consumed it, and a step
/// that writes a range overlapping an outstanding borrowed send of its rank waits for that;
/// each (sender, receiver) pair is FIFO; receives wait for their message. No socket
/// buffering is assumed, so a plan that completes here completes with any buffering. `false`
/// also for plans with steps a TCP group cannot run (direct ones).
pub(crate) fn completes_with(plan: &Plan, mode: &dyn Fn(usize, usize) -> SendMode) -> bool {
    let world = plan.world;
    if plan.steps.len() != world {
        return false;
    }
    // channels[from * world + to]: message ids in send order.
    let mut channels: Vec<VecDeque<usize>> = vec![VecDeque::new(); world * world];
    let mut consumed: Vec<bool> = Vec::new();
    // outstanding[r]: (message id, range) of r's borrowed sends.
    let mut outstanding: Vec<Vec<(usize, Range<usize>)>> = vec![Vec::new(); world];
    let mut pc = vec![0usize; world];
    loop {
        let mut progress = false;
        for r in 0..world {
            while let Some(step) = plan.steps[r].get(pc[r]) {
                if let Some(range) = written(step) {
                    outstanding[r].retain(|(id, _)| !consumed[*id]);
                    if outstanding[r].iter().any(|(_, sent)| overlaps(sent, range)) {
                        break;
                    }
                }
                match step {
                    Step::Send { to, range } => {
                        if to.index() >= world || to.index() == r {
                            return false;
                        }
                        let id = consumed.len();
                        consumed.push(false);
                        channels[r * world + to.index()].push_back(id);
                        if mode(r, pc[r]) == SendMode::Borrow {
                            outstanding[r].push((id, range.clone()));
                        }
                    }
                    Step::RecvReduce { from, .. } | Step::RecvCopy { from, .. } => {
                        if from.index() >= world {
                            return false;
                        }
                        let Some(id) = channels[from.index() * world + r].pop_front() else {
                            break;
                        };
                        consumed[id] = true;
                    }
                    Step::Finish { .. } => {}
                    Step::ReducePeers { .. } | Step::CopyFrom { .. } | Step::Barrier => {
                        return false;
                    }
                }
                pc[r] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    (0..world).all(|r| pc[r] == plan.steps[r].len()) && channels.iter().all(VecDeque::is_empty)
}
