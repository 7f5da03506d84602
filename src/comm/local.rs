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
//!
//! - **COMM-10** a rank never unwinds out of a direct collective's data phase while peers read its
//!   buffer: a panic there aborts the process (`AbortOnUnwind`) instead of freeing memory under the
//!   peers' reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::element::bits16::round_in_place;
use super::element::{Element, as_f32_mut, combine, finish, narrow, reduce_into, widen};
use super::emulate::LinkEmulation;
use super::plan::wire::Narrowing;
use super::plan::{self, Plan, Step};
use super::{
    Algorithm, CallShape, CollectiveKind, CommConfig, CommError, Communicator, MessageHook,
    PartialSums, RankCall, ReduceOp, Tamper, chunk_range,
};
use crate::mesh::{Generation, Rank};

mod collectives;
mod execute;
mod group;
mod rendezvous;

use execute::{Target, Wire, execute_direct, execute_messages};
use group::{Arrival, Failure, Message, SendPost, State, checksum};
pub use group::{GroupState, GroupStatus, LocalGroup, RankStatus};

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

/// One rank's handle on a [`LocalGroup`]: runs that rank's side of every op, from one thread.
/// Wrapped by [`Communicator`], which documents the methods.
#[derive(Debug)]
pub(crate) struct LocalCommunicator {
    group: Arc<LocalGroup>,
    rank: Rank,
    seq: u64,
    timeout: Duration,
    algorithm: Algorithm,
    /// How 16-bit reductions' partial sums travel (COMM-9).
    partial_sums: PartialSums,
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
    /// Bytes this rank has sent in messages (elements × their size, EMU-1), point-to-point
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

    pub(crate) fn partial_sums(&self) -> PartialSums {
        self.partial_sums
    }

    pub(crate) fn set_partial_sums(&mut self, partial_sums: PartialSums) {
        self.partial_sums = partial_sums;
    }

    /// Sends every later message of this rank's message plans through `hook` (COMM-8), or no
    /// longer (`None`). A communicator with a hook resolves direct plans to ring, so every
    /// rank of the group should have one.
    pub(crate) fn set_message_hook(&mut self, hook: Option<Arc<dyn MessageHook>>) {
        self.hook = hook;
    }

    /// Bytes this rank has sent in messages so far (EMU-1's sizes; a direct shared-memory
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
}
