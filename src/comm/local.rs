//! The in-process transport: a [`LocalGroup`] shared by the ranks of one process, and the
//! [`Communicator`] each rank drives from its own OS thread.
//!
//! Every collective goes through three stages:
//! 1. rendezvous: the rank posts what it passed (a [`CallShape`]) and where its buffer is, and
//!    waits until every rank posted the same sequence number; the last to arrive validates
//!    the calls (COMM-2). Waits here honour the time-out, shutdown and poison (COMM-3, COMM-4).
//! 2. data: the rank runs its part of the op's [`Plan`]. Message plans (ring, tree) copy
//!    chunks through per-receiver mailboxes; direct plans read peers' buffers in place between
//!    phase barriers.
//! 3. release: direct plans end with a barrier, so no peer still reads a buffer when its
//!    owner's call returns.
//!
//! Blocking: meant for device threads, never for async executor threads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::element::{Element, as_f32_mut, combine, finish, narrow, reduce_into, widen};
use super::emulate::LinkEmulation;
use super::plan::{self, Plan, Step};
use super::{
    Algorithm, CallShape, CollectiveKind, CommConfig, CommError, Communicator, MessageHook,
    RankCall, ReduceOp, Tamper, chunk_range,
};
use crate::mesh::{Generation, Rank};

const OPEN: u8 = 0;
const POISONED: u8 = 1;
const SHUT_DOWN: u8 = 2;

/// Spin iterations before yielding, when every rank can have its own core.
const SPIN_ITERATIONS: u32 = 1 << 11;
/// `yield_now` calls before parking on a condition variable.
const YIELDS: u32 = 16;
/// Longest single park, so a missed wake-up costs at most this much.
const PARK_SLICE: Duration = Duration::from_millis(20);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-updated in a way
    // that matters more than refusing to continue; keep going rather than panic again.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn rank_of(index: usize) -> Rank {
    Rank(u32::try_from(index).unwrap_or(u32::MAX))
}

/// How a group stands, as reported by [`LocalGroup::status`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum GroupState {
    /// Ops run normally.
    Open,
    /// An op failed and left ranks out of step; every op fails with this cause (COMM-3).
    Poisoned {
        /// The first failure.
        cause: CommError,
    },
    /// [`LocalGroup::shutdown`] was called (COMM-4).
    ShutDown,
}

/// What one rank last did, for diagnosing a hang.
#[derive(Debug, Clone)]
pub struct RankStatus {
    /// The rank.
    pub rank: Rank,
    /// Sequence number of the last collective it arrived at (`None`: none yet).
    pub last_seq: Option<u64>,
    /// What it passed to that collective.
    pub last_call: Option<CallShape>,
    /// How long it has been waiting for its peers there (`None`: that op completed).
    pub waiting_for: Option<Duration>,
}

/// A snapshot of a group: its state and where each rank is.
#[derive(Debug, Clone)]
pub struct GroupStatus {
    /// The group's generation.
    pub generation: Generation,
    /// Ranks in the group.
    pub world: usize,
    /// Open, poisoned or shut down.
    pub state: GroupState,
    /// One entry per rank, in rank order.
    pub ranks: Vec<RankStatus>,
    /// Sequence number of the last collective every rank arrived at (`None`: none yet).
    pub last_completed_seq: Option<u64>,
}

#[derive(Debug, Clone)]
struct Arrival {
    seq: u64,
    call: CallShape,
    at: Instant,
}

#[derive(Debug, Clone)]
struct Failure {
    error: CommError,
    /// The collective sequence number that failed, when a collective failed.
    collective_seq: Option<u64>,
}

#[derive(Debug)]
struct State {
    arrivals: Vec<Option<Arrival>>,
    /// The calls of the last completed rendezvous, when they did not match.
    last_mismatch: Option<(u64, Vec<RankCall>)>,
    failure: Option<Failure>,
    shut_down: bool,
    sleepers: usize,
}

/// Where a rank's source buffer for the current op lives: `ptr` points at element `offset` of
/// the op's conceptual buffer.
#[derive(Debug, Default)]
struct Posted {
    ptr: AtomicUsize,
    offset: AtomicUsize,
}

/// A reusable barrier for the data phases of direct plans: spin briefly, then park.
#[derive(Debug, Default)]
struct PhaseBarrier {
    count: AtomicUsize,
    phase: AtomicU64,
    parked: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl PhaseBarrier {
    /// Waits until `world` ranks called `wait`. No time-out: every rank in a data phase runs
    /// only this module's code, which reaches the next barrier in bounded time, and leaving
    /// early would let a peer read a buffer its owner already gave back.
    fn wait(&self, world: usize, spin: bool) {
        let phase = self.phase.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == world {
            self.count.store(0, Ordering::Relaxed);
            self.phase.store(phase.wrapping_add(1), Ordering::SeqCst);
            if self.parked.load(Ordering::SeqCst) > 0 {
                let _guard = lock(&self.lock);
                self.cv.notify_all();
            }
            return;
        }
        let passed = || self.phase.load(Ordering::Acquire) != phase;
        if spin {
            for _ in 0..SPIN_ITERATIONS {
                if passed() {
                    return;
                }
                std::hint::spin_loop();
            }
        }
        for _ in 0..YIELDS {
            if passed() {
                return;
            }
            std::thread::yield_now();
        }
        let mut guard = lock(&self.lock);
        self.parked.fetch_add(1, Ordering::SeqCst);
        while self.phase.load(Ordering::SeqCst) == phase {
            guard = self
                .cv
                .wait_timeout(guard, PARK_SLICE)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        self.parked.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug)]
struct Message {
    seq: u64,
    /// Its index among the sender's messages to this receiver in op `seq` (COMM-8).
    index: u32,
    data: Vec<f32>,
    /// crc32 of `data`'s bytes as sent, when the group verifies payloads.
    crc: Option<u32>,
}

/// crc32 of an f32 slice's bytes.
fn checksum(data: &[f32]) -> u32 {
    // SAFETY: f32 has no padding and every byte of it is initialised; u8 has alignment 1.
    let bytes =
        unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), size_of_val(data)) };
    crc32fast::hash(bytes)
}

#[derive(Debug, Default)]
struct MailboxState {
    /// `queues[sender]`, in send order.
    queues: Vec<VecDeque<Message>>,
    sleeping: bool,
}

/// One receiver's incoming messages for message plans.
#[derive(Debug, Default)]
struct Mailbox {
    state: Mutex<MailboxState>,
    cv: Condvar,
}

#[derive(Debug)]
struct SendPost {
    seq: u64,
    call: CallShape,
    ptr: usize,
}

#[derive(Debug, Default)]
struct PairSlot {
    post: Option<SendPost>,
    /// The receiver took the post and is copying from the sender's buffer.
    claimed: bool,
    outcome: Option<(u64, Result<(), CommError>)>,
}

/// A group of ranks in one process that run collectives together.
///
/// Guarantees: see the module docs of [`crate::comm`] (COMM-1..7).
#[derive(Debug)]
pub struct LocalGroup {
    world: usize,
    generation: Generation,
    config: CommConfig,
    /// Whether every rank can have a core of its own, so spinning is worth it.
    spin: bool,
    handed_out: AtomicBool,
    closed: AtomicU8,
    state: Mutex<State>,
    arrived: Condvar,
    /// `((seq + 1) << 1) | mismatch` of the last completed rendezvous (0: none).
    completion: AtomicU64,
    posted: Vec<Posted>,
    barrier: PhaseBarrier,
    mailboxes: Vec<Mailbox>,
    pool: Mutex<Vec<Vec<f32>>>,
    pairs: Mutex<Vec<PairSlot>>,
    pair_changed: Condvar,
}

impl LocalGroup {
    /// A group of `world` ranks (a world of 0 is treated as 1), open and with no op run yet.
    pub fn new(world: usize, generation: Generation, config: CommConfig) -> Arc<Self> {
        let world = world.max(1);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Arc::new(Self {
            world,
            generation,
            config,
            spin: world <= cores,
            handed_out: AtomicBool::new(false),
            closed: AtomicU8::new(OPEN),
            state: Mutex::new(State {
                arrivals: vec![None; world],
                last_mismatch: None,
                failure: None,
                shut_down: false,
                sleepers: 0,
            }),
            arrived: Condvar::new(),
            completion: AtomicU64::new(0),
            posted: (0..world).map(|_| Posted::default()).collect(),
            barrier: PhaseBarrier::default(),
            mailboxes: (0..world)
                .map(|_| Mailbox {
                    state: Mutex::new(MailboxState {
                        queues: (0..world).map(|_| VecDeque::new()).collect(),
                        sleeping: false,
                    }),
                    cv: Condvar::new(),
                })
                .collect(),
            pool: Mutex::new(Vec::new()),
            pairs: Mutex::new((0..world * world).map(|_| PairSlot::default()).collect()),
            pair_changed: Condvar::new(),
        })
    }

    /// The group's communicators, one per rank in rank order, each to be moved to its rank's
    /// thread. They are handed out once: later calls return an empty vector, so no rank can
    /// ever have two handles (which would break COMM-1).
    pub fn communicators(self: &Arc<Self>) -> Vec<Communicator> {
        if self.handed_out.swap(true, Ordering::AcqRel) {
            return Vec::new();
        }
        (0..self.world)
            .map(|r| LocalCommunicator {
                group: Arc::clone(self),
                rank: rank_of(r),
                seq: 0,
                timeout: self.config.timeout,
                algorithm: self.config.algorithm,
                last_algorithm: None,
                sent: vec![0; self.world],
                received: vec![0; self.world],
                work: Vec::new(),
                plan_cache: None,
                hook: None,
                bytes_sent: 0,
            })
            .map(Communicator::local)
            .collect()
    }

    /// Shuts the group down: every op waiting for peers wakes up and fails with
    /// [`CommError::Shutdown`], and so does every later op (COMM-4). Idempotent.
    pub fn shutdown(&self) {
        self.closed.store(SHUT_DOWN, Ordering::SeqCst);
        lock(&self.state).shut_down = true;
        self.wake_everyone();
    }

    /// The group's generation.
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The group's settings.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// A snapshot of the group: open, poisoned or shut down, and which collective each rank
    /// last arrived at and for how long it has waited there.
    pub fn status(&self) -> GroupStatus {
        let state = lock(&self.state);
        let completed = self.completion.load(Ordering::Acquire) >> 1;
        let now = Instant::now();
        let ranks = state
            .arrivals
            .iter()
            .enumerate()
            .map(|(r, arrival)| RankStatus {
                rank: rank_of(r),
                last_seq: arrival.as_ref().map(|a| a.seq),
                last_call: arrival.as_ref().map(|a| a.call.clone()),
                waiting_for: arrival
                    .as_ref()
                    .filter(|a| a.seq + 1 > completed)
                    .map(|a| now.saturating_duration_since(a.at)),
            })
            .collect();
        let group_state = if state.shut_down {
            GroupState::ShutDown
        } else if let Some(failure) = &state.failure {
            GroupState::Poisoned {
                cause: failure.error.clone(),
            }
        } else {
            GroupState::Open
        };
        GroupStatus {
            generation: self.generation,
            world: self.world,
            state: group_state,
            ranks,
            last_completed_seq: completed.checked_sub(1),
        }
    }

    fn wake_everyone(&self) {
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
    fn refusal(&self, seq: u64, op: CollectiveKind, collective: bool) -> Option<CommError> {
        if self.closed.load(Ordering::Acquire) == OPEN {
            return None;
        }
        self.refusal_locked(&lock(&self.state), seq, op, collective)
    }

    fn refusal_locked(
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

    fn poison(&self, error: CommError, collective_seq: Option<u64>) {
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
    fn rendezvous(
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

    fn rendezvous_outcome(
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
    fn calls_fit(&self, calls: &[RankCall]) -> bool {
        let Some(first) = calls.first() else {
            return true;
        };
        calls.iter().all(|c| {
            c.call.agrees_with(&first.call)
                && c.call.is_well_formed()
                && c.call.peer.is_none_or(|p| p.index() < self.world)
        })
    }

    fn take_buffer(&self, data: &[f32]) -> Vec<f32> {
        let mut buffer = lock(&self.pool).pop().unwrap_or_default();
        buffer.clear();
        buffer.extend_from_slice(data);
        buffer
    }

    fn give_buffer(&self, buffer: Vec<f32>) {
        let mut pool = lock(&self.pool);
        if pool.len() < 4 * self.world {
            pool.push(buffer);
        }
    }

    fn deliver(&self, from: usize, to: usize, message: Message) {
        let mailbox = &self.mailboxes[to];
        let mut state = lock(&mailbox.state);
        state.queues[from].push_back(message);
        if state.sleeping {
            mailbox.cv.notify_all();
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn receive(
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

    fn closed_error(&self, seq: u64, op: CollectiveKind) -> CommError {
        self.refusal(seq, op, true).unwrap_or(CommError::Shutdown {
            generation: self.generation,
            seq,
            op,
        })
    }
}

/// How a rank's messages leave it: the fault hook, the emulated link, the size of the op's
/// elements on the wire, and the bytes sent so far in the op.
struct Wire<'a> {
    hook: Option<&'a dyn MessageHook>,
    link: Option<&'a LinkEmulation>,
    elem_bytes: usize,
    sent_bytes: u64,
}

/// Runs a message plan (ring, tree) on an f32 working buffer of the op's full length, with
/// `hook` deciding each message's fate (COMM-8).
#[allow(clippy::too_many_arguments)]
fn execute_messages(
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
    for step in steps {
        match step {
            Step::Send { to, range } => {
                let to = to.index();
                let index = sent[to];
                sent[to] += 1;
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
                // LINK-1: the message leaves once the emulated link has carried its bytes.
                let bytes = range.len() * wire.elem_bytes;
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
struct Target<T> {
    ptr: *mut T,
    offset: usize,
}

/// Aborts the process if dropped during a panic (see its use in the direct data phase).
struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "meshwork: a rank panicked inside a direct collective's data phase; aborting"
            );
            std::process::abort();
        }
    }
}

/// Runs a direct plan: reads peers' posted buffers in place, writes only `target`.
///
/// # Safety
/// - The rendezvous of this op completed successfully, so every rank's posted pointer and
///   offset describe a live buffer of the validated length that stays valid until the
///   plan's last barrier, and every rank runs its own part of the same plan.
/// - `target` is valid for writes over every range this rank's steps write, and nothing
///   else accesses it except peers' reads that the plan allows (PLAN-3).
unsafe fn execute_direct<T: Element>(
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

/// One rank's handle on a [`LocalGroup`]: runs that rank's side of every op, from one thread.
/// Wrapped by [`Communicator`], which documents the methods.
#[derive(Debug)]
pub(crate) struct LocalCommunicator {
    group: Arc<LocalGroup>,
    rank: Rank,
    seq: u64,
    timeout: Duration,
    algorithm: Algorithm,
    last_algorithm: Option<Algorithm>,
    /// Sends so far to each peer (the next send's per-pair sequence number).
    sent: Vec<u64>,
    /// Receives so far from each peer.
    received: Vec<u64>,
    /// f32 working buffer for message plans over f16/bf16 or read-only inputs.
    work: Vec<f32>,
    plan_cache: Option<(Rank, Plan)>,
    /// What happens to each message this rank sends (COMM-8).
    hook: Option<Arc<dyn MessageHook>>,
    /// Bytes this rank has sent in messages (elements × their size, LINK-1), point-to-point
    /// included.
    bytes_sent: u64,
}

/// Which buffers an op reads and writes, in terms of its conceptual buffer.
struct Buffers<T> {
    /// What peers read: (pointer, offset of its first element).
    source: (*const T, usize),
    /// What this rank writes.
    target: Target<T>,
}

impl LocalCommunicator {
    /// This communicator's rank.
    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    /// Ranks in the group.
    pub(crate) fn world(&self) -> usize {
        self.group.world
    }

    /// The group's generation.
    pub(crate) fn generation(&self) -> Generation {
        self.group.generation
    }

    /// The group this communicator belongs to.
    pub(crate) fn group(&self) -> &Arc<LocalGroup> {
        &self.group
    }

    /// The sequence number the next collective will carry (COMM-1).
    pub(crate) fn next_seq(&self) -> u64 {
        self.seq
    }

    /// The time-out each op gets.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the time-out of the following ops.
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The algorithm requested for the following collectives.
    pub(crate) fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Requests an algorithm for the following collectives. All ranks of a group should
    /// request the same: an algorithm is resolved per rank, and ranks running different plans
    /// of one op get wrong results or time out.
    pub(crate) fn set_algorithm(&mut self, algorithm: Algorithm) {
        self.algorithm = algorithm;
    }

    /// Sends every later message of this rank's message plans through `hook` (COMM-8), or no
    /// longer (`None`). A communicator with a hook resolves direct plans to ring, so every
    /// rank of the group should have one.
    pub(crate) fn set_message_hook(&mut self, hook: Option<Arc<dyn MessageHook>>) {
        self.hook = hook;
    }

    /// Bytes this rank has sent in messages so far (LINK-1's sizes; a direct shared-memory
    /// plan sends none).
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// The algorithm that moved the data of the last all-reduce, reduce-scatter, all-gather or
    /// broadcast that passed validation (never [`Algorithm::Auto`]).
    pub(crate) fn last_algorithm(&self) -> Option<Algorithm> {
        self.last_algorithm
    }

    fn me(&self) -> usize {
        self.rank.index()
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.seq;
        self.seq += 1;
        seq
    }

    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.timeout)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
    }

    fn plan_for(
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

    /// Runs the validated collective `kind` with `algorithm`.
    ///
    /// # Safety
    /// `buffers` describe live buffers of the validated lengths that this rank does not
    /// otherwise touch until this returns; for message plans `work` already holds this rank's
    /// conceptual buffer.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<T: Element>(
        &mut self,
        kind: CollectiveKind,
        algorithm: Algorithm,
        len: usize,
        root: Rank,
        op: ReduceOp,
        seq: u64,
        deadline: Instant,
        buffers: Option<Target<T>>,
        work: &mut [f32],
    ) -> Result<(), CommError> {
        let plan = self.plan_for(kind, algorithm, len, root);
        let me = self.me();
        let result = match buffers {
            // SAFETY: forwarded from the caller.
            Some(target) => {
                // Peers read this rank's buffer until the plan's last barrier: if this thread
                // unwound in between, its buffer would be freed under their reads and they
                // would wait forever at the next barrier. Abort instead (never expected: the
                // plan was validated at the rendezvous).
                let guard = AbortOnUnwind;
                unsafe { execute_direct(&self.group, me, plan.steps_of(self.rank), target, op) };
                std::mem::forget(guard);
                Ok(())
            }
            None => {
                let mut wire = Wire {
                    hook: self.hook.as_deref(),
                    link: self.group.config.link.as_ref(),
                    elem_bytes: T::DTYPE.size_bytes(),
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

    fn post<T>(&self, source: (*const T, usize)) {
        let posted = &self.group.posted[self.me()];
        posted.ptr.store(source.0 as usize, Ordering::Release);
        posted.offset.store(source.1, Ordering::Release);
    }

    /// Stages 1 to 3 for one collective over `T`.
    fn collective<T: Element>(
        &mut self,
        call: CallShape,
        buffers: Buffers<T>,
        prepare_direct: impl FnOnce(),
        to_work: impl FnOnce(&mut Vec<f32>),
        from_work: impl FnOnce(&[f32]),
    ) -> Result<(), CommError> {
        let seq = self.take_seq();
        let deadline = self.deadline();
        let (kind, len) = (call.kind, call.len);
        let root = call.peer.unwrap_or(Rank(0));
        let op = call.reduce.unwrap_or(ReduceOp::Sum);
        let algorithm = call.algorithm.unwrap_or(Algorithm::Direct);
        self.post(buffers.source);
        self.group
            .rendezvous(self.me(), seq, call, deadline, self.timeout)?;
        self.last_algorithm = Some(algorithm);
        if algorithm == Algorithm::Direct {
            prepare_direct();
            // SAFETY: the rendezvous validated every rank's lengths against the plan; the
            // caller built `buffers` from its exclusive borrows and touches them no more.
            return unsafe {
                self.run(
                    kind,
                    algorithm,
                    len,
                    root,
                    op,
                    seq,
                    deadline,
                    Some(buffers.target),
                    &mut [],
                )
            };
        }
        let mut work = std::mem::take(&mut self.work);
        to_work(&mut work);
        // SAFETY: message plans touch no raw buffer.
        let result = unsafe {
            self.run::<T>(
                kind, algorithm, len, root, op, seq, deadline, None, &mut work,
            )
        };
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
        );
        self.in_place(call, buf)
    }

    /// The algorithm this rank resolves for a collective of `kind` over `len` elements of `T`.
    fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm {
        // LINK-3: on an emulated network, Auto picks the plan by the link's cost model.
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
    fn message_in_place<T: Element>(
        &mut self,
        call: CallShape,
        buf: &mut [T],
        ptr: *mut T,
    ) -> Result<(), CommError> {
        let seq = self.take_seq();
        let deadline = self.deadline();
        let (kind, len) = (call.kind, call.len);
        let root = call.peer.unwrap_or(Rank(0));
        let op = call.reduce.unwrap_or(ReduceOp::Sum);
        let algorithm = call.algorithm.unwrap_or(Algorithm::Direct);
        self.post::<T>((ptr.cast_const(), 0));
        self.group
            .rendezvous(self.me(), seq, call, deadline, self.timeout)?;
        self.last_algorithm = Some(algorithm);
        let Some(work) = as_f32_mut(buf) else {
            return Ok(());
        };
        // SAFETY: message plans touch no raw buffer; `work` is the caller's buffer.
        unsafe { self.run::<T>(kind, algorithm, len, root, op, seq, deadline, None, work) }
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
        );
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
    fn in_place<T: Element>(&mut self, call: CallShape, buf: &mut [T]) -> Result<(), CommError> {
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

    fn check_peer(&self, op: CollectiveKind, peer: Rank) -> Result<usize, CommError> {
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
        // LINK-1: the send is posted once the emulated link has carried its bytes.
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
