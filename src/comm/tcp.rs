//! The TCP transport (feature `cluster`): the ranks of a group are processes, joined by one
//! authenticated [`crate::comm::net::link`] per pair, and run the same pure [`crate::comm::plan`]
//! plans as the in-process transport, so every op gives the same results.
//!
//! ```
//! use meshwork::comm::net::link::{JobToken, LinkListener};
//! use meshwork::comm::tcp::{TcpConfig, TcpGroup};
//! use meshwork::comm::ReduceOp;
//! use meshwork::mesh::{Generation, Rank};
//!
//! // Each rank binds its listener first; the addresses then reach every rank (here: a vector,
//! // in a real job: the control plane).
//! let token = JobToken::random();
//! let config = TcpConfig::default();
//! let listeners: Vec<LinkListener> = (0..2)
//!     .map(|r| LinkListener::bind("127.0.0.1:0", Rank(r), token.clone(), config.link))
//!     .collect::<Result<_, _>>()?;
//! let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr()).collect::<Result<_, _>>()?;
//! let sums: Vec<f32> = std::thread::scope(|scope| {
//!     let ranks: Vec<_> = listeners
//!         .iter()
//!         .map(|listener| {
//!             let (addrs, config) = (addrs.clone(), config.clone());
//!             scope.spawn(move || {
//!                 let group = TcpGroup::connect(listener, &addrs, Generation(0), config).unwrap();
//!                 let mut comm = group.into_communicator();
//!                 let mut grads = vec![comm.rank().0 as f32 + 1.0; 1000];
//!                 comm.all_reduce(&mut grads, ReduceOp::Sum).map(|()| grads[0])
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
//! });
//! assert_eq!(sums, vec![3.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # How an op runs
//!
//! 1. **Header exchange.** The rank sends a small header frame (tag, generation, sequence
//!    number, [`CallShape`]) to every peer and reads every peer's. Every rank then holds every
//!    call and decides COMM-2 the same way: a mismatch is [`CommError::Mismatch`] on every
//!    rank, no data moves, the group stays usable. A barrier is this exchange alone.
//! 2. **Data.** The rank runs its steps of the plan: `Send` queues the range for the link's
//!    sender thread, `RecvReduce`/`RecvCopy` read the peer's frames piece by piece straight
//!    into the buffer (reducing each piece while it is in the cache), `Finish` is local. A
//!    step larger than [`TcpConfig::frame_bytes`] travels as several frames. Payloads are the
//!    buffer's little-endian bytes. f16 and bf16 collectives work on an f32 buffer: partial
//!    sums (what the receiver reduces) travel as f32, so each sum is rounded once, at the end,
//!    exactly as in process (COMM-5); final values (what the receiver copies: the all-gather
//!    phase of a ring, a tree's way down, a broadcast, an all-gather) travel as 2 bytes per
//!    element (TCP-7).
//! 3. **Completion.** The op returns once every byte it sent was handed to the kernel.
//!
//! Send and recv exchange headers too: the sender sends its call, the receiver answers with
//! its own, and data follows only when they match (else both get [`CommError::Mismatch`]).
//!
//! # Invariants (tests name the id they check)
//!
//! - TCP-1 (links): the lower rank of each pair accepts, the higher connects
//!   ([`link_role`]); only connections that show the job token become links (LINK-1), so a
//!   stranger never reaches a collective.
//! - TCP-2 (algorithms): a TCP group runs ring or tree plans only; `Auto` and `Direct`
//!   resolve as `schedule::resolve` says (ring for anything but small buffers).
//! - TCP-3 (never a deadlock from flow control): each link has a sender thread, so a rank
//!   never blocks in a send while its peer blocks in a send to it. Its queue holds at most
//!   [`SEND_QUEUE`] jobs, and a job is a pointer into the caller's buffer, not a copy, except
//!   where the plan overwrites a range while its send may still be in flight
//!   (`schedule::send_modes`); the socket's window is the only byte buffer (LINK-5). A
//!   step that writes a range waits for the borrowed sends of that range to complete.
//! - TCP-4 (no borrowed byte outlives its op): every op, successful or not, returns only after
//!   the sender threads stopped reading the caller's buffers: on success every send
//!   completed; on failure the links are aborted and the threads acknowledged every job. A
//!   panic while they may still read the buffer aborts the process (`AbortOnUnwind`, as
//!   COMM-10 in process) rather than unwind and free it under them.
//! - TCP-5 (failures): every wait is bounded by the op's deadline; a silent peer is
//!   [`CommError::Timeout`] naming it, a lost or misbehaving peer [`CommError::Link`] naming
//!   it. The first failure poisons the rank's communicator and aborts its links with a Close
//!   frame carrying the failure, so the other ranks fail at once with
//!   [`CommError::Poisoned`] carrying that root cause instead of waiting for their time-out.
//! - TCP-6 (shutdown): [`TcpShutdown::shutdown`] wakes a waiting op with
//!   [`CommError::Shutdown`], and every later op fails the same way (COMM-4).
//! - TCP-7 (16-bit payloads): an f16 or bf16 op sends the ranges its receivers copy (final
//!   values) as 2 bytes per element and those they reduce (partial sums) as f32, so its
//!   results equal the in-process transport's bit for bit; a broadcast or an all-gather moves
//!   2 bytes per element, a ring all-reduce 6 per element per ring pass instead of 8.
//! - TCP-8 (forwarding): an f32 range that the plan receives and then sends on whole (a
//!   ring's next step, a tree's way up or down) leaves in parts as its frames are received,
//!   reduced and, where the plan finishes it first, finished, so the next rank works on it
//!   while the rest still arrives. At most `SEND_QUEUE / (2·world)` parts a step, so the
//!   link's queue never fills (TCP-3: the next rank reads them only in its next step). The
//!   values sent are the ones the step-by-step plan would send, so results are bit for bit
//!   the same. Not on an emulated link (EMU-1: a message pays its latency once).

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::cross::{self, bytes_of, rank_of, root_cause};
use super::element::bits16::{self, narrow_to_bytes};
use super::element::{Element, combine, finish};
use super::emulate::LinkEmulation;
use super::plan::{self, Plan, Step};
use super::{
    Algorithm, CallShape, CollectiveKind, CommConfig, CommError, Communicator, DType, LinkFailure,
    PartialSums, RankCall, ReduceOp,
};
use crate::comm::net::link::{
    LinkCloser, LinkConfig, LinkError, LinkListener, LinkReader, LinkWriter, PayloadSink,
};
use crate::mesh::{Generation, Rank};

mod collectives;
mod failures;
mod rendezvous;
mod schedule;
mod setup;
#[cfg(test)]
mod tests;
mod transport;
/// What the MPI transport shares with this one: the same schedules, the same 16-bit wire.
#[cfg(feature = "mpi")]
pub(crate) use schedule::resolve as resolve_algorithm;
pub(crate) use setup::connect_mesh;
pub use setup::{TcpConfig, TcpGroup, TcpGroupError, TcpShutdown};
use transport::{
    CopySink, Job, OpHeader, Payload, PeerLink, RawBytes, ReduceSink, Sender, Shared, StepSink,
    WidenSink,
};

use super::plan::wire::Narrowing;
pub use schedule::{LinkRole, link_role};
use schedule::{SendMode, narrow_pieces, peers_with_role, send_modes};

#[cfg(not(target_endian = "little"))]
compile_error!(
    "meshwork's TCP transport sends buffers as their in-memory bytes (little-endian on the wire) \
     and so needs a little-endian target"
);

/// Jobs a link's sender thread may have queued (TCP-3).
pub const SEND_QUEUE: usize = 64;

/// The largest op header payload accepted.
const MAX_HEADER: u64 = 1024;

/// Marks a header payload, so a data frame read where a header belongs is told apart.
const HEADER_TAG: [u8; 4] = *b"MWOP";

/// How long a failing rank lets its sender threads deliver the abort before it shuts the
/// sockets down.
const ABORT_GRACE: Duration = Duration::from_millis(200);

/// After a time-out, how long each peer not yet heard from gets to show its header, to name
/// every missing rank.
const PROBE: Duration = Duration::from_millis(2);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// One rank's side of a TCP group: the transport behind [`Communicator`] for cross-process
/// groups.
#[derive(Debug)]
pub(crate) struct TcpCommunicator {
    rank: Rank,
    world: usize,
    generation: Generation,
    seq: u64,
    timeout: Duration,
    algorithm: Algorithm,
    /// How 16-bit reductions' partial sums travel (COMM-9).
    partial_sums: PartialSums,
    last_algorithm: Option<Algorithm>,
    sent: Vec<u64>,
    received: Vec<u64>,
    /// `peers[r]`: the link to rank r (`None` for this rank).
    peers: Vec<Option<PeerLink>>,
    shared: Arc<Shared>,
    /// The failure that poisoned this communicator.
    failure: Option<CommError>,
    header: Vec<u8>,
    /// f32 working buffer for f16/bf16 and read-only inputs.
    work: Vec<f32>,
    /// Received pieces being reduced.
    scratch: Vec<f32>,
    /// Received 16-bit pieces being widened (TCP-7).
    scratch16: Vec<u8>,
    plan_cache: Option<(Rank, Plan, Vec<SendMode>)>,
    /// Data payload bytes handed to the links so far (not counting headers and framing).
    #[cfg_attr(not(test), allow(dead_code, reason = "read by the tests of TCP-7"))]
    data_bytes_sent: u64,
    /// Whether received ranges are sent on in parts (TCP-8): not on an emulated link, whose
    /// cost model charges a message's latency once (EMU-1, EMU-3).
    forwards: bool,
    /// Parts of received ranges sent on before their step ended (TCP-8).
    #[cfg_attr(not(test), allow(dead_code, reason = "read by the tests of TCP-8"))]
    forwarded_parts: u64,
}

/// Who an op is, for its errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpId {
    seq: u64,
    op: CollectiveKind,
    deadline: Instant,
}

impl TcpCommunicator {
    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn generation(&self) -> Generation {
        self.generation
    }

    pub(crate) fn next_seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    pub(crate) fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    pub(crate) fn set_algorithm(&mut self, algorithm: Algorithm) {
        self.algorithm = algorithm;
    }

    pub(crate) fn partial_sums(&self) -> PartialSums {
        self.partial_sums
    }

    pub(crate) fn set_partial_sums(&mut self, partial_sums: PartialSums) {
        self.partial_sums = partial_sums;
    }

    pub(crate) fn last_algorithm(&self) -> Option<Algorithm> {
        self.last_algorithm
    }

    fn me(&self) -> usize {
        self.rank.index()
    }

    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.timeout)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
    }

    fn resolve<T: Element>(&self, kind: CollectiveKind, len: usize) -> Algorithm {
        schedule::resolve(
            self.algorithm,
            kind,
            self.world,
            len.saturating_mul(T::DTYPE.size_bytes()),
        )
    }
}

/// Why reading a header failed.
enum HeaderError {
    /// Nothing (complete) arrived before the deadline.
    Timeout,
    /// Anything else, already an op error.
    Comm(CommError),
}

fn op_of(error: &CommError) -> CollectiveKind {
    match error {
        CommError::Timeout { op, .. }
        | CommError::Mismatch { op, .. }
        | CommError::Shutdown { op, .. }
        | CommError::Poisoned { op, .. }
        | CommError::Link { op, .. }
        | CommError::MessageTimeout { op, .. }
        | CommError::MessageLost { op, .. }
        | CommError::CorruptMessage { op, .. }
        | CommError::InvalidPeer { op, .. }
        | CommError::Malformed { op, .. }
        | CommError::Unsupported { op, .. } => *op,
    }
}
