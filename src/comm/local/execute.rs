//! Running a plan's steps in one process: message plans through the receivers' mailboxes,
//! direct plans by reading the peers' posted buffers in place between phase barriers.

use super::*;

/// How a rank's messages leave it: the fault hook, the emulated link, which of a 16-bit op's
/// messages travel 16-bit (counted as the TCP transport sends them, TCP-7, and rounded as it
/// rounds them, COMM-9), and the bytes sent so far in the op.
pub(super) struct Wire<'a> {
    pub(super) hook: Option<&'a dyn MessageHook>,
    pub(super) link: Option<&'a LinkEmulation>,
    pub(super) narrow: Option<Narrowing>,
    pub(super) sent_bytes: u64,
}

/// Runs a message plan (ring, tree) on an f32 working buffer of the op's full length, with
/// `hook` deciding each message's fate (COMM-8).
#[allow(clippy::too_many_arguments)]
pub(super) fn execute_messages(
    group: &LocalGroup,
    me: usize,
    steps: &[Step],
    work: &mut [f32],
    op: ReduceOp,
    seq: u64,
    kind: CollectiveKind,
    deadline: Instant,
    timeout: Duration,
    wire: &mut Wire<'_>,
) -> Result<(), CommError> {
    // Messages sent to / received from each peer so far in this op (COMM-8).
    let mut sent = vec![0u32; group.world];
    let mut received = vec![0u32; group.world];
    // This rank's sends so far in this op (how `wire.narrow` names them).
    let mut sends = 0;
    for step in steps {
        match step {
            Step::Send { to, range } => {
                let to = to.index();
                let index = sent[to];
                sent[to] += 1;
                let nth = sends;
                sends += 1;
                if let Some(n) = wire.narrow.as_ref().filter(|n| n.rounds_in_place()) {
                    // COMM-9: the running sum is rounded where it is, then sent.
                    round_in_place(n.dtype(), &mut work[range.clone()]);
                }
                let mut data = group.take_buffer(&work[range.clone()]);
                let crc = group.config.verify_payloads.then(|| checksum(&data));
                let fate = wire.hook.map_or(Tamper::Deliver, |h| {
                    h.on_send(rank_of(me), rank_of(to), seq, kind, index)
                });
                match fate {
                    Tamper::Deliver => {}
                    Tamper::Delay(d) => std::thread::sleep(d),
                    Tamper::Drop => {
                        group.give_buffer(data);
                        continue;
                    }
                    Tamper::Corrupt => {
                        if let Some(x) = data.first_mut() {
                            *x = f32::from_bits(x.to_bits() ^ (1 << 22));
                        }
                    }
                }
                // EMU-1: the message leaves once the emulated link has carried its bytes.
                let bytes = wire
                    .narrow
                    .as_ref()
                    .map_or(range.len() * 4, |n| n.send_bytes(nth, range.len()));
                wire.sent_bytes += bytes as u64;
                if let Some(link) = wire.link {
                    // Never past the op's deadline: the receivers' time-out names the wait.
                    let left = deadline.saturating_duration_since(Instant::now());
                    std::thread::sleep(link.delay(rank_of(me), bytes).min(left));
                }
                let message = Message {
                    seq,
                    index,
                    data,
                    crc,
                };
                group.deliver(me, to, message);
            }
            Step::RecvReduce { from, range } | Step::RecvCopy { from, range } => {
                let index = received[from.index()];
                received[from.index()] += 1;
                let message =
                    group.receive(me, from.index(), (seq, index), kind, deadline, timeout)?;
                let dst = &mut work[range.clone()];
                let n = dst.len().min(message.data.len());
                debug_assert_eq!(dst.len(), message.data.len(), "PLAN-1");
                if matches!(step, Step::RecvReduce { .. }) {
                    combine(&mut dst[..n], &message.data[..n], op);
                } else {
                    dst[..n].copy_from_slice(&message.data[..n]);
                }
                group.give_buffer(message.data);
            }
            Step::Finish { range } => finish(&mut work[range.clone()], op, group.world),
            Step::ReducePeers { .. } | Step::CopyFrom { .. } | Step::Barrier => {
                debug_assert!(false, "direct step in a message plan");
            }
        }
    }
    Ok(())
}

/// Rank `me`'s writable view of the op's conceptual buffer: `ptr` is element `offset`.
pub(super) struct Target<T> {
    pub(super) ptr: *mut T,
    pub(super) offset: usize,
}

/// Runs a direct plan: reads peers' posted buffers in place, writes only `target`.
///
/// # Safety
/// - The rendezvous of this op completed successfully, so every rank's posted pointer and
///   offset describe a live buffer of the validated length that stays valid until the
///   plan's last barrier, and every rank runs its own part of the same plan.
/// - `target` is valid for writes over every range this rank's steps write, and nothing
///   else accesses it except peers' reads that the plan allows (PLAN-3).
pub(super) unsafe fn execute_direct<T: Element>(
    group: &LocalGroup,
    me: usize,
    steps: &[Step],
    target: Target<T>,
    op: ReduceOp,
) {
    let source = |rank: usize, start: usize, len: usize| -> &[T] {
        let posted = &group.posted[rank];
        let ptr = posted.ptr.load(Ordering::Acquire) as *const T;
        let offset = posted.offset.load(Ordering::Acquire);
        // SAFETY: validated lengths mean `start - offset .. + len` lies in that rank's posted
        // buffer; PLAN-3 means its owner does not write this range during this phase.
        unsafe { std::slice::from_raw_parts(ptr.add(start - offset), len) }
    };
    for step in steps {
        match step {
            Step::ReducePeers { range } => {
                // SAFETY: `range` is my chunk; only I write it, no peer reads it now (PLAN-3).
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        target.ptr.add(range.start - target.offset),
                        range.len(),
                    )
                };
                let in_place = group.posted[me].ptr.load(Ordering::Acquire) == target.ptr as usize;
                let first = (!in_place).then(|| source(me, range.start, range.len()));
                let mut on_stack: [&[T]; 16] = [&[]; 16];
                let on_heap: Vec<&[T]>;
                let peers: &[&[T]] = if group.world <= on_stack.len() {
                    let mut n = 0;
                    for p in (0..group.world).filter(|&p| p != me) {
                        on_stack[n] = source(p, range.start, range.len());
                        n += 1;
                    }
                    &on_stack[..n]
                } else {
                    on_heap = (0..group.world)
                        .filter(|&p| p != me)
                        .map(|p| source(p, range.start, range.len()))
                        .collect();
                    &on_heap
                };
                reduce_into(dst, first, peers, op, group.world);
            }
            Step::CopyFrom { from, range } => {
                // SAFETY: as above; `range` of my buffer is written only by me in this phase.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        target.ptr.add(range.start - target.offset),
                        range.len(),
                    )
                };
                dst.copy_from_slice(source(from.index(), range.start, range.len()));
            }
            Step::Barrier => group.barrier.wait(group.world, group.spin),
            Step::Send { .. }
            | Step::RecvReduce { .. }
            | Step::RecvCopy { .. }
            | Step::Finish { .. } => {
                // A plan mixing kinds is a bug in `plan`; the proptests cover every plan.
                std::process::abort();
            }
        }
    }
}
