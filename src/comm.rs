//! Collectives: all-reduce, reduce-scatter, all-gather, broadcast, barrier and point-to-point
//! send/recv between the ranks of a group, each rank driving its [`Communicator`] from its own
//! OS thread. The ranks are threads of one process ([`LocalGroup`]) or, with the `cluster`
//! feature, processes joined by TCP (`tcp::TcpGroup`), or, with the `mpi` feature, endpoints of
//! the system's MPI (`mpi::MpiGroup`); the same [`Communicator`] API, the same plans and the
//! same semantics (below) for all.
//!
//! Owns: the [`Communicator`] API and its dispatch to a transport, the element types
//! ([`Element`]), the pure algorithm plans ([`plan`]), the in-process transport
//! ([`LocalGroup`]), the TCP transport (`tcp`, feature `cluster`), the MPI transport (`mpi`,
//! feature `mpi`) and the bandwidth probes
//! ([`bench`](mod@bench)).
//!
//! ```
//! use meshwork::comm::{CommConfig, LocalGroup, ReduceOp};
//! use meshwork::mesh::Generation;
//!
//! let group = LocalGroup::new(2, Generation(0), CommConfig::default());
//! let sums: Vec<f32> = std::thread::scope(|scope| {
//!     let ranks: Vec<_> = group
//!         .communicators()
//!         .into_iter()
//!         .map(|mut comm| {
//!             scope.spawn(move || {
//!                 let mut grads = vec![comm.rank().0 as f32 + 1.0; 1000];
//!                 comm.all_reduce(&mut grads, ReduceOp::Sum).map(|()| grads[0])
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
//! });
//! assert_eq!(sums, vec![3.0, 3.0]);
//! ```
//!
//! # Semantics (ids are named by the tests that check them)
//!
//! - COMM-1 (sequence): every collective call on a communicator takes the next sequence number
//!   of that communicator ([`Communicator::next_seq`]); the n-th collective of every rank of a
//!   group forms one operation. Point-to-point calls are numbered separately, per (sender,
//!   receiver) pair, and matched by that order.
//! - COMM-2 (validation): before any data moves, every rank's call is compared. Ranks that
//!   disagree on the kind, element type, length, root or reduce op, or pass a chunk of the
//!   wrong length, all get [`CommError::Mismatch`] naming every rank and what it passed. No
//!   buffer is touched and the group stays usable.
//! - COMM-3 (time-out): every wait is bounded by the communicator's time-out. On expiry the
//!   op fails with [`CommError::Timeout`] naming the ranks that never arrived and the op's
//!   sequence number, and the group is *poisoned*: every later op on any of its
//!   communicators fails fast with [`CommError::Poisoned`], which carries the first failure.
//!   A poisoned group is replaced by a new one (a new [`Generation`]). Across processes a
//!   lost or misbehaving peer is [`CommError::Link`] naming it, and the failing rank tells the
//!   others, whose ops fail with [`CommError::Poisoned`] carrying that cause (TCP-5).
//! - COMM-4 (shutdown): after [`LocalGroup::shutdown`] (across processes: a rank's
//!   `tcp::TcpShutdown`), every op that is waiting wakes up and
//!   every later op fails with [`CommError::Shutdown`]. An op whose data phase has started
//!   finishes reading its peers' buffers before it returns, so no buffer is read after its
//!   owner's call returned.
//! - COMM-5 (numerics): f16 and bf16 are reduced in f32 and rounded once, where the algorithm
//!   allows (direct and the f32 working buffers of ring and tree always do). Mean is the sum
//!   divided by the world size. Every rank ends with bit-identical results.
//! - COMM-9 (16-bit partial sums): with [`PartialSums::Narrow`] an f16 or bf16 reduction run
//!   as a message plan (ring, tree) rounds every partial sum to the op's type before it
//!   travels, as NCCL does: a ring all-reduce moves 4 bytes per element per ring pass instead
//!   of 6 (TCP-7), each hop rounding once. The sender keeps the rounded value, so ranks that
//!   exchange sums (a tree) add the same two numbers. Every transport rounds at the same steps, so the
//!   results stay bit-identical across ranks and across the in-process, TCP and MPI
//!   transports; a direct plan has no messages and still rounds once (COMM-5). Ranks that
//!   disagree on it get [`CommError::Mismatch`].
//! - COMM-6 (layout): [`chunk_range`] is the public rule that splits a buffer among ranks.
//! - COMM-7 (never a panic): bad input from the caller gives a typed error, never a panic.
//! - COMM-8 (messages): in a message plan (ring, tree) every message names its op and its
//!   index among the sender's messages to that receiver in the op, so a lost message is
//!   detected when a later one arrives ([`CommError::MessageLost`]) or when the time-out
//!   expires ([`CommError::MessageTimeout`]) — never consumed in its place. With
//!   [`CommConfig::verify_payloads`] every message also carries a crc32 of its payload and a
//!   mismatch fails the op with [`CommError::CorruptMessage`]. Verified groups and
//!   communicators with a [`MessageHook`] run message plans only (direct resolves to ring):
//!   a direct plan reads peers' memory and has no messages to check or tamper with.
//! - COMM-11 (bounded errors): a [`CommError`] decoded from another process (a control-plane
//!   answer, a data-plane close reason, an MPI abort message) nests at most
//!   [`MAX_CAUSE_DEPTH`] poisoned causes; a deeper one is refused by the decoder, before its
//!   recursion can exhaust a thread's stack.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::mesh::chunk_range;
use crate::mesh::{Generation, Rank};
pub use cause::MAX_CAUSE_DEPTH;

pub mod bench;
mod call;
mod cause;
mod communicator;
#[cfg(feature = "cluster")]
mod cross;
mod element;
pub mod emulate;
#[cfg(feature = "cluster")]
pub mod hierarchical;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cluster")]
pub mod net;
pub mod plan;
#[cfg(feature = "cluster")]
pub(crate) mod process_groups;
#[cfg(feature = "cluster")]
pub mod tcp;
#[cfg(all(test, feature = "cluster"))]
mod test_support;
#[cfg(test)]
mod tests;

pub use call::CallShape;
pub use communicator::Communicator;
pub use element::Element;

/// What a [`MessageHook`] does to one message of a message plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Tamper {
    /// Deliver it as sent.
    Deliver,
    /// Hold it back this long (on the sender's thread), then deliver it.
    Delay(Duration),
    /// Never deliver it.
    Drop,
    /// Deliver it with one bit of its payload flipped after its checksum was taken.
    Corrupt,
}

/// Consulted for every message a communicator sends in a message plan (ring, tree): how
/// fault-injection runs delay, drop or corrupt a given message (`faults::FaultHooks` is one).
pub trait MessageHook: Send + Sync + fmt::Debug {
    /// What happens to the `index`-th message `from` sends to `to` in op `seq` of kind `op`.
    fn on_send(&self, from: Rank, to: Rank, seq: u64, op: CollectiveKind, index: u32) -> Tamper;
}
pub use local::{GroupState, GroupStatus, LocalGroup, RankStatus};

/// The element types a collective can move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision (`half::f16`); reduced in f32.
    F16,
    /// bfloat16 (`half::bf16`); reduced in f32.
    BF16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// The sum over ranks.
    Sum,
    /// The sum over ranks divided by the world size.
    Mean,
    /// The largest value over ranks (exact).
    Max,
    /// The smallest value over ranks (exact).
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// What moves a job's bytes between processes (every process of a job uses the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum DataTransport {
    /// meshwork's own authenticated TCP links (`comm::tcp`, feature `cluster`): works
    /// anywhere, keeps live recovery from a lost process.
    #[default]
    Tcp,
    /// The system's MPI (`comm::mpi`, feature `mpi`): every process started by an MPI
    /// launcher (`mpirun`, `srun --mpi=…`) and initialised MPI; the fabric MPI is tuned for,
    /// but a dead process ends the whole job (the launcher's rule), so failures end in a rerun
    /// from the last checkpoint rather than a live recovery.
    Mpi,
}

impl DataTransport {
    /// Whether this process can move bytes on this transport now (`Mpi`: built with the
    /// `mpi` feature and `comm::mpi::init` succeeded).
    pub fn is_ready(self) -> bool {
        match self {
            DataTransport::Tcp => cfg!(feature = "cluster"),
            #[cfg(feature = "mpi")]
            DataTransport::Mpi => mpi::world().is_some_and(|w| !w.is_finalized()),
            #[cfg(not(feature = "mpi"))]
            DataTransport::Mpi => false,
        }
    }
}

impl fmt::Display for DataTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataTransport::Tcp => "tcp",
            DataTransport::Mpi => "mpi",
        })
    }
}

/// Which algorithm moves the data of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Algorithm {
    /// Chosen per call by [`plan::choose`] from the collective, the group and the size.
    #[default]
    Auto,
    /// Ring: bandwidth-optimal; each rank sends 2(N−1)/N of the buffer in an all-reduce.
    Ring,
    /// Recursive doubling (all-reduce, all-gather, reduce-scatter) or a binomial tree
    /// (broadcast): latency-optimal, log2(N) rounds.
    Tree,
    /// Shared memory: each rank reduces its own slice straight from its peers' buffers, in
    /// parallel, then copies the others' reduced slices. In-process only.
    Direct,
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::Direct => "direct",
        })
    }
}

/// `auto`, `ring`, `tree` or `direct`, as [`Algorithm`]'s `Display` writes them.
impl std::str::FromStr for Algorithm {
    type Err = crate::config::InvalidConfig;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Algorithm::Auto),
            "ring" => Ok(Algorithm::Ring),
            "tree" => Ok(Algorithm::Tree),
            "direct" => Ok(Algorithm::Direct),
            other => Err(crate::config::InvalidConfig(format!(
                "unknown collective algorithm {other:?}: auto, ring, tree or direct"
            ))),
        }
    }
}

/// The kind of a communication op, as named in errors and status snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// [`Communicator::all_reduce`].
    AllReduce,
    /// [`Communicator::reduce_scatter`].
    ReduceScatter,
    /// [`Communicator::all_gather`].
    AllGather,
    /// [`Communicator::broadcast`].
    Broadcast,
    /// [`Communicator::barrier`].
    Barrier,
    /// [`Communicator::send`].
    Send,
    /// [`Communicator::recv`].
    Recv,
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
        })
    }
}

/// Settings of a group; every communicator starts from these and may override them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CommConfig {
    /// How long one op may wait for its peers before it fails with [`CommError::Timeout`].
    #[serde(with = "crate::config::duration")]
    pub timeout: Duration,
    /// The algorithm collectives use unless a communicator overrides it.
    pub algorithm: Algorithm,
    /// Whether every message carries a checksum of its payload that receivers verify
    /// (COMM-8). Off by default in-process, where memory is not corrupted in transit.
    #[serde(default)]
    pub verify_payloads: bool,
    /// An emulated network (bandwidth and latency per rank's link) every message of the group
    /// is held back by (`comm::emulate`, EMU-1..2); `None`: the transport's own speed.
    #[serde(default)]
    pub link: Option<emulate::LinkEmulation>,
    /// How an f16 or bf16 reduction's partial sums travel in a message plan (COMM-9):
    /// `f32` (default, each sum rounded once, COMM-5) or in the op's own 16-bit type.
    #[serde(default)]
    pub partial_sums: PartialSums,
}

/// How the partial sums of an f16 or bf16 reduction travel between ranks in a ring or tree
/// (COMM-9). f32 reductions are not affected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PartialSums {
    /// As `f32`: every sum is accumulated in `f32` and rounded once, at the end (COMM-5); a
    /// ring all-reduce moves 6 bytes per element per ring pass (4 for the partial sum, 2 for
    /// the final value, TCP-7).
    #[default]
    F32,
    /// In the op's 16-bit type, as NCCL's 16-bit all-reduce: each hop rounds the running sum
    /// once, and a ring all-reduce moves 4 bytes per element per ring pass. The error grows
    /// with the world size (one rounding per hop instead of one in all).
    Narrow,
}

impl std::str::FromStr for PartialSums {
    type Err = String;

    /// `f32`, or `16` (also `narrow`): what `--partial-sums` takes.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "32" => Ok(PartialSums::F32),
            "16" | "narrow" => Ok(PartialSums::Narrow),
            other => Err(format!(
                "unknown partial sums {other:?}: use f32 (rounded once) or 16 (each hop rounds)"
            )),
        }
    }
}

impl fmt::Display for PartialSums {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PartialSums::F32 => "f32 partial sums",
            PartialSums::Narrow => "16-bit partial sums",
        })
    }
}

impl Default for CommConfig {
    /// A 60 s time-out and [`Algorithm::Auto`].
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            algorithm: Algorithm::Auto,
            verify_payloads: false,
            link: None,
            partial_sums: PartialSums::F32,
        }
    }
}

impl CommConfig {
    /// This config with another time-out.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This config with another algorithm.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// This config with an emulated network (`comm::emulate`), or the transport's own speed.
    pub fn with_link_emulation(mut self, link: Option<emulate::LinkEmulation>) -> Self {
        self.link = link;
        self
    }

    /// This config with payload checksums on or off (COMM-8).
    pub fn with_verified_payloads(mut self, on: bool) -> Self {
        self.verify_payloads = on;
        self
    }

    /// This config with 16-bit reductions' partial sums travelling as `partial_sums` says
    /// (COMM-9).
    pub fn with_partial_sums(mut self, partial_sums: PartialSums) -> Self {
        self.partial_sums = partial_sums;
        self
    }
}

/// One rank and the call it made, as listed in [`CommError::Mismatch`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankCall {
    /// The rank.
    pub rank: Rank,
    /// What it passed.
    pub call: CallShape,
}

/// What went wrong with the connection to a peer process ([`CommError::Link`]). The variant
/// is for programs; `detail` is for people and not meant to be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum LinkFailure {
    /// The peer's end of the connection is gone: end of stream, reset, broken pipe (most
    /// likely its process ended or closed its communicator).
    #[error("the connection was closed ({detail})")]
    Closed {
        /// What the link layer saw.
        detail: String,
    },
    /// The peer sent bytes that are not a valid frame (checksum, version, truncation); the
    /// connection was closed.
    #[error("the peer sent a bad frame ({detail})")]
    BadFrame {
        /// What was wrong.
        detail: String,
    },
    /// The peer's frames belong to another op or another step than this rank's (a header of
    /// another sequence number or kind, a frame of the wrong length): the ranks are out of
    /// step, so nothing after it can be trusted.
    #[error("the peer is out of step ({detail})")]
    OutOfStep {
        /// What was expected and what came.
        detail: String,
    },
    /// The operating system refused an operation on the connection.
    #[error("I/O error ({detail})")]
    Io {
        /// The system's error.
        detail: String,
    },
}

/// Why a communication op failed. Every variant names the group's generation, the op and its
/// sequence number, so a failure can be matched without parsing text.
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum CommError {
    /// Some ranks did not arrive within the time-out (COMM-3). The group is poisoned.
    #[error(
        "{op} #{seq} ({generation}) timed out after {waited:?} waiting for ranks {}",
        rank_list(missing)
    )]
    Timeout {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number (per-pair number for send/recv).
        seq: u64,
        /// The op that timed out.
        op: CollectiveKind,
        /// The ranks that had not arrived (for a send: the receiver; for a recv: the sender).
        missing: Vec<Rank>,
        /// The time-out that expired.
        waited: Duration,
    },
    /// The ranks' calls do not agree or do not fit the layout (COMM-2). Nothing was moved and
    /// the group stays usable.
    #[error(
        "{op} #{seq} ({generation}): ranks passed calls that do not match: {}",
        call_list(calls)
    )]
    Mismatch {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number (per-pair number for send/recv).
        seq: u64,
        /// The op the failing rank called.
        op: CollectiveKind,
        /// Every participating rank and what it passed, in rank order.
        calls: Vec<RankCall>,
    },
    /// A peer's data arrived but does not make sense to the layer above the collective (a
    /// compressor's top-k message naming an element outside the gradient); the group stays
    /// usable, the step fails.
    #[error("{op}: a peer's data is malformed: {reason}")]
    Malformed {
        /// The collective that carried it.
        op: CollectiveKind,
        /// What is wrong with it.
        reason: String,
    },
    /// The group was shut down (COMM-4).
    #[error("{op} #{seq} ({generation}): the group was shut down")]
    Shutdown {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number.
        seq: u64,
        /// The op that was refused or interrupted.
        op: CollectiveKind,
    },
    /// An earlier op of the group failed in a way that leaves the ranks out of step
    /// (COMM-3); this op did not run.
    #[error("{op} #{seq} ({generation}) cannot run: the group failed earlier: {cause}")]
    Poisoned {
        /// The group's generation.
        generation: Generation,
        /// This op's sequence number.
        seq: u64,
        /// This op.
        op: CollectiveKind,
        /// The failure that poisoned the group.
        #[source]
        #[serde(deserialize_with = "cause::bounded")]
        cause: Box<CommError>,
    },
    /// A message of a message plan did not arrive within the time-out although its sender
    /// had joined the op (COMM-8): the link, or the sender's thread, failed mid-op. The group
    /// is poisoned.
    #[error("{op} #{seq} ({generation}): message {index} from rank {} did not arrive within {waited:?}", from.0)]
    MessageTimeout {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number.
        seq: u64,
        /// The op.
        op: CollectiveKind,
        /// The sender.
        from: Rank,
        /// The message's index among the sender's messages to this rank in the op.
        index: u32,
        /// The time-out that expired.
        waited: Duration,
    },
    /// A later message of the op arrived before this one: this one was lost (COMM-8). The
    /// group is poisoned.
    #[error("{op} #{seq} ({generation}): message {index} from rank {} was lost (message {got} arrived instead)", from.0)]
    MessageLost {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number.
        seq: u64,
        /// The op.
        op: CollectiveKind,
        /// The sender.
        from: Rank,
        /// The index expected.
        index: u32,
        /// The index that arrived.
        got: u32,
    },
    /// A message's payload does not match its checksum (COMM-8). The group is poisoned.
    #[error("{op} #{seq} ({generation}): message {index} from rank {} is corrupt (checksum {declared:#010x}, payload {computed:#010x})", from.0)]
    CorruptMessage {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number.
        seq: u64,
        /// The op.
        op: CollectiveKind,
        /// The sender.
        from: Rank,
        /// The message's index among the sender's messages to this rank in the op.
        index: u32,
        /// The checksum the sender declared.
        declared: u32,
        /// The checksum of what arrived.
        computed: u32,
    },
    /// The TCP link to `peer` failed or the peer broke the protocol (cross-process groups
    /// only). The group is poisoned; its ranks learn of it through their links.
    #[error("{op} #{seq} ({generation}): the link to rank {} failed: {failure}", peer.0)]
    Link {
        /// The group's generation.
        generation: Generation,
        /// The op's sequence number (per-pair number for send/recv).
        seq: u64,
        /// The op that failed.
        op: CollectiveKind,
        /// The rank at the other end of the link.
        peer: Rank,
        /// What went wrong.
        failure: LinkFailure,
    },
    /// A send or recv named a peer that is not another rank of the group.
    #[error("{op} ({generation}): rank {} cannot talk to rank {} in a group of {world}", rank.0, peer.0)]
    InvalidPeer {
        /// The group's generation.
        generation: Generation,
        /// The op.
        op: CollectiveKind,
        /// The calling rank.
        rank: Rank,
        /// The peer it named.
        peer: Rank,
        /// The group's size.
        world: usize,
    },
    /// The transport cannot run this op with these arguments (a hierarchical group's
    /// point-to-point ops; HIER-1).
    #[error("{op}: {why}")]
    Unsupported {
        /// The op.
        op: CollectiveKind,
        /// Why not, and what to do instead.
        why: String,
    },
}

impl CommError {
    /// The sequence number of the op that failed, where it had one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            CommError::Timeout { seq, .. }
            | CommError::Mismatch { seq, .. }
            | CommError::Shutdown { seq, .. }
            | CommError::Poisoned { seq, .. }
            | CommError::MessageTimeout { seq, .. }
            | CommError::MessageLost { seq, .. }
            | CommError::CorruptMessage { seq, .. }
            | CommError::Link { seq, .. } => Some(*seq),
            CommError::InvalidPeer { .. }
            | CommError::Unsupported { .. }
            | CommError::Malformed { .. } => None,
        }
    }

    /// Whether this failure (or the one that poisoned the group) lost or spoiled a message
    /// whose sender had joined the op: every rank is alive and the op can be run again on a
    /// new group ([`CommError::MessageTimeout`], [`CommError::MessageLost`],
    /// [`CommError::CorruptMessage`]).
    pub fn is_message_fault(&self) -> bool {
        match self {
            CommError::MessageTimeout { .. }
            | CommError::MessageLost { .. }
            | CommError::CorruptMessage { .. } => true,
            CommError::Poisoned { cause, .. } => cause.is_message_fault(),
            _ => false,
        }
    }
}

fn rank_list(ranks: &[Rank]) -> String {
    let numbers: Vec<String> = ranks.iter().map(|r| r.0.to_string()).collect();
    format!("[{}]", numbers.join(", "))
}

fn call_list(calls: &[RankCall]) -> String {
    let parts: Vec<String> = calls
        .iter()
        .map(|c| format!("rank {} passed {}", c.rank.0, c.call))
        .collect();
    parts.join("; ")
}

/// Aborts the process when dropped during a panic, saying why (COMM-10, TCP-4): held while
/// other threads or ranks read a buffer that unwinding would free.
pub(crate) struct AbortOnUnwind(pub(crate) &'static str);

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("meshwork: {}; aborting", self.0);
            std::process::abort();
        }
    }
}
