//! An in-process group: the state its ranks share (posted calls, phase barriers, mailboxes,
//! failure), how it is made and shut down, and the status it reports.

use super::*;

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
pub(super) struct Arrival {
    pub(super) seq: u64,
    pub(super) call: CallShape,
    pub(super) at: Instant,
}

#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub(super) error: CommError,
    /// The collective sequence number that failed, when a collective failed.
    pub(super) collective_seq: Option<u64>,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) arrivals: Vec<Option<Arrival>>,
    /// The calls of the last completed rendezvous, when they did not match.
    pub(super) last_mismatch: Option<(u64, Vec<RankCall>)>,
    pub(super) failure: Option<Failure>,
    pub(super) shut_down: bool,
    pub(super) sleepers: usize,
}

/// Where a rank's source buffer for the current op lives: `ptr` points at element `offset` of
/// the op's conceptual buffer.
#[derive(Debug, Default)]
pub(super) struct Posted {
    pub(super) ptr: AtomicUsize,
    pub(super) offset: AtomicUsize,
}

/// A reusable barrier for the data phases of direct plans: spin briefly, then park.
#[derive(Debug, Default)]
pub(super) struct PhaseBarrier {
    pub(super) count: AtomicUsize,
    pub(super) phase: AtomicU64,
    pub(super) parked: AtomicUsize,
    pub(super) lock: Mutex<()>,
    pub(super) cv: Condvar,
}

impl PhaseBarrier {
    /// Waits until `world` ranks called `wait`. No time-out: every rank in a data phase runs
    /// only this module's code, which reaches the next barrier in bounded time, and leaving
    /// early would let a peer read a buffer its owner already gave back.
    pub(super) fn wait(&self, world: usize, spin: bool) {
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
pub(super) struct Message {
    pub(super) seq: u64,
    /// Its index among the sender's messages to this receiver in op `seq` (COMM-8).
    pub(super) index: u32,
    pub(super) data: Vec<f32>,
    /// crc32 of `data`'s bytes as sent, when the group verifies payloads.
    pub(super) crc: Option<u32>,
}

/// crc32 of an f32 slice's bytes.
pub(super) fn checksum(data: &[f32]) -> u32 {
    // SAFETY: f32 has no padding and every byte of it is initialised; u8 has alignment 1.
    let bytes =
        unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), size_of_val(data)) };
    crc32fast::hash(bytes)
}

#[derive(Debug, Default)]
pub(super) struct MailboxState {
    /// `queues[sender]`, in send order.
    pub(super) queues: Vec<VecDeque<Message>>,
    pub(super) sleeping: bool,
}

/// One receiver's incoming messages for message plans.
#[derive(Debug, Default)]
pub(super) struct Mailbox {
    pub(super) state: Mutex<MailboxState>,
    pub(super) cv: Condvar,
}

#[derive(Debug)]
pub(super) struct SendPost {
    pub(super) seq: u64,
    pub(super) call: CallShape,
    pub(super) ptr: usize,
}

#[derive(Debug, Default)]
pub(super) struct PairSlot {
    pub(super) post: Option<SendPost>,
    /// The receiver took the post and is copying from the sender's buffer.
    pub(super) claimed: bool,
    pub(super) outcome: Option<(u64, Result<(), CommError>)>,
}

/// A group of ranks in one process that run collectives together.
///
/// Guarantees: see the module docs of [`crate::comm`] (COMM-1..7).
#[derive(Debug)]
pub struct LocalGroup {
    pub(super) world: usize,
    pub(super) generation: Generation,
    pub(super) config: CommConfig,
    /// Whether every rank can have a core of its own, so spinning is worth it.
    pub(super) spin: bool,
    pub(super) handed_out: AtomicBool,
    pub(super) closed: AtomicU8,
    pub(super) state: Mutex<State>,
    pub(super) arrived: Condvar,
    /// `((seq + 1) << 1) | mismatch` of the last completed rendezvous (0: none).
    pub(super) completion: AtomicU64,
    pub(super) posted: Vec<Posted>,
    pub(super) barrier: PhaseBarrier,
    pub(super) mailboxes: Vec<Mailbox>,
    pub(super) pool: Mutex<Vec<Vec<f32>>>,
    pub(super) pairs: Mutex<Vec<PairSlot>>,
    pub(super) pair_changed: Condvar,
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
                partial_sums: self.config.partial_sums,
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
}
