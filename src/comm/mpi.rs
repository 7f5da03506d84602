//! The MPI transport (feature `mpi`): the ranks of a group are endpoints of the system's MPI
//! (OpenMPI, MPICH, …, through the `mpi` crate's bindings), so a job's bytes move through the
//! library its cluster is tuned for (shared memory, InfiniBand and other RDMA fabrics through
//! UCX or libfabric) while every op runs the same pure [`crate::comm::plan`] plans as the
//! in-process and TCP transports and gives the same results, bit for bit.
//!
//! ```no_run
//! use meshwork::comm::mpi::{self, MpiGroup};
//! use meshwork::comm::{CommConfig, ReduceOp};
//! use meshwork::mesh::{Generation, Rank};
//!
//! // Under `mpirun -n 2`: one rank per process; the endpoints reach every rank (here through
//! // MPI itself; in a meshwork job through the group's TCP bootstrap).
//! let world = mpi::init()?;
//! let mine = world.endpoint();
//! let bytes = mine.to_bytes();
//! let endpoints = (0..world.size())
//!     .map(|p| world.broadcast_bytes(p, &bytes))
//!     .collect::<Result<Vec<_>, _>>()?
//!     .iter()
//!     .map(|b| mpi::MpiEndpoint::from_bytes(b).expect("eight bytes"))
//!     .collect::<Vec<_>>();
//! let rank = Rank(world.rank());
//! let group = MpiGroup::new(world, endpoints, rank, Generation(0), CommConfig::default())?;
//! let mut comm = group.into_communicator();
//! let mut grads = vec![comm.rank().0 as f32 + 1.0; 1000];
//! comm.all_reduce(&mut grads, ReduceOp::Sum)?;
//! assert_eq!(grads[0], 3.0);
//! drop(comm);
//! mpi::finalize();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Groups are endpoints on one communicator, not MPI sub-communicators
//!
//! A meshwork rank is a device, not a process: a process of four devices holds four ranks of
//! its data-parallel group, and a tensor-parallel group may hold two ranks of one process. An
//! MPI communicator cannot hold one process twice, and creating one (`MPI_Comm_split`,
//! `MPI_Comm_create_group`) is collective over processes that meshwork's head wires one group
//! at a time. So every group runs on one duplicate of `MPI_COMM_WORLD` ([`init`]), each rank
//! of a group addressed by an [`MpiEndpoint`] (its process's world rank and an id unique in
//! that process), and every message carries a tag naming its receiving endpoint and its
//! sending group rank (MPI-1). The dp, pp (each pipeline link an [`MpiPackets`] channel) and tp
//! groups of a job are thus each their own tag space; MPI's matching keeps them apart.
//!
//! # How an op runs
//!
//! As over TCP (see [`crate::comm::tcp`]): every rank sends its call's header to every peer
//! and reads theirs (COMM-2: a mismatch moves no data on any rank); then runs its steps of
//! the plan on an f32 working buffer, each `Send` an `MPI_Isend` of a copy of its range
//! (several messages when a range is over [`MpiConfig::max_message_bytes`]), each
//! `RecvReduce`/`RecvCopy` an `MPI_Irecv` polled with `MPI_Test` until the op's deadline;
//! then waits until its sends completed. 16-bit ops send final values as 2 bytes per
//! element and partial sums as f32, exactly as over TCP (TCP-7), so results equal the
//! in-process transport's bit for bit.
//!
//! # Invariants (tests name the id they check)
//!
//! - MPI-1 (isolation): a message's tag is `((receiver endpoint id mod 2^e) << 12 | sender
//!   group rank) << 1 | kind` (12 bits for the group's ranks in every group, `e` the rest of
//!   `MPI_TAG_UB`'s bits, at least 8); MPI matches on (source process, tag), so two groups never consume each other's
//!   messages, and per (sender, receiver) pair messages are matched in the order sent (MPI's
//!   non-overtaking rule), which is the order the plan reads them (PLAN-1). A group too large
//!   for the tag space is refused when it forms ([`MpiError::TagSpace`]).
//! - MPI-2 (never a wait without end): every wait polls its requests until the op's
//!   deadline; a silent peer is [`CommError::Timeout`] naming it, a pending receive is
//!   cancelled, and the communicator is poisoned. Sends that never completed keep their
//!   buffers alive (leaked, never freed under MPI's feet).
//! - MPI-3 (failures reach the peers): the first failure poisons the rank's communicator and
//!   sends every peer an abort message (tag kind 1) carrying it; a peer's waits probe for it,
//!   so the others fail at once with [`CommError::Poisoned`] instead of waiting out their
//!   time-out. (A process that died is OpenMPI's to report: it ends the whole job.)
//! - MPI-4 (shutdown): [`MpiShutdown::shutdown`] wakes a waiting op with
//!   [`CommError::Shutdown`], and every later op fails the same way (COMM-4); so do ops after
//!   [`finalize`], which waits for running ops to end (no MPI call after `MPI_Finalize`).
//!
//! Not carried over from the in-process transport: message hooks and
//! `CommConfig::verify_payloads` (COMM-8) are ignored, as over TCP: MPI's messages are the
//! library's to check, and a fault plan's message faults are refused across processes.

#[cfg(not(target_endian = "little"))]
compile_error!(
    "meshwork's MPI transport sends buffers as their in-memory bytes (little-endian on the \
     wire) and so needs a little-endian target"
);

use std::ffi::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::plan::Plan;
use super::{Algorithm, CollectiveKind, CommConfig, CommError, Communicator, PartialSums};
use crate::mesh::{Generation, Rank};

mod messages;
mod ops;
mod packets;
mod raw;
#[cfg(test)]
mod tests;
mod world;

pub use packets::{MpiPackets, PacketsError};
pub use world::{MpiWorld, finalize, init, world};

/// Why MPI could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MpiError {
    /// An MPI call failed.
    #[error("{call} failed: {detail}")]
    Call {
        /// The MPI function.
        call: &'static str,
        /// MPI's error string.
        detail: String,
    },
    /// The MPI library cannot run calls from several threads at once.
    #[error(
        "the MPI library provides thread level {provided}, below MPI_THREAD_MULTIPLE \
         (meshwork's device threads call MPI concurrently); use an MPI built with thread \
         support (OpenMPI ≥ 3 and MPICH ≥ 3.2 are, by default)"
    )]
    Threading {
        /// The level it provided.
        provided: i32,
    },
    /// MPI was initialised by someone else before meshwork's [`init`].
    #[error("MPI was initialised before meshwork's mpi::init (call it instead, once)")]
    AlreadyInitialized,
    /// [`finalize`] already ran.
    #[error("MPI was finalised")]
    Finalized,
    /// The group does not fit MPI's tag space (MPI-1).
    #[error(
        "a group of {world} ranks (at most 4096) needs {needed} tag bits; this MPI's \
         MPI_TAG_UB gives {available}"
    )]
    TagSpace {
        /// Ranks in the group.
        world: usize,
        /// Bits it needs.
        needed: u32,
        /// Bits available.
        available: u32,
    },
    /// This process has made as many groups as MPI's tag space numbers (MPI-1): a new one
    /// would share an old one's tags.
    #[error(
        "{endpoint:?}: this process's groups have used the {limit} endpoint ids MPI_TAG_UB \
         leaves (each (re)wiring takes one per rank); restart the process (rerun resumes)"
    )]
    EndpointsExhausted {
        /// The endpoint past the limit.
        endpoint: MpiEndpoint,
        /// Endpoint ids a tag can name.
        limit: u64,
    },
    /// The rank is not one of the group's.
    #[error("rank {} is outside a group of {world}", rank.0)]
    InvalidRank {
        /// The rank.
        rank: Rank,
        /// Ranks in the group.
        world: usize,
    },
    /// The group's endpoints are not distinct or this rank's endpoint is not this process's.
    #[error("bad endpoints: {0}")]
    Endpoints(String),
}

/// Where a rank of a group receives: its process's rank in `MPI_COMM_WORLD` and an id unique
/// in that process ([`MpiWorld::endpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MpiEndpoint {
    /// The process's world rank.
    pub process: u32,
    /// The endpoint's id in its process.
    pub id: u32,
}

impl MpiEndpoint {
    /// Eight little-endian bytes: process, then id.
    pub fn to_bytes(self) -> [u8; 8] {
        let mut out = [0u8; 8];
        out[..4].copy_from_slice(&self.process.to_le_bytes());
        out[4..].copy_from_slice(&self.id.to_le_bytes());
        out
    }

    /// The endpoint of [`MpiEndpoint::to_bytes`]; `None` unless `bytes` is eight bytes long.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let bytes: [u8; 8] = bytes.try_into().ok()?;
        let (p, i) = bytes.split_at(4);
        Some(Self {
            process: u32::from_le_bytes(p.try_into().ok()?),
            id: u32::from_le_bytes(i.try_into().ok()?),
        })
    }
}

/// Settings of an MPI group.
#[derive(Debug, Clone)]
pub struct MpiConfig {
    /// Time-out, algorithm and the rest of what every transport reads.
    pub comm: CommConfig,
    /// The largest message one `MPI_Isend` carries; a larger step travels as several.
    pub max_message_bytes: usize,
}

impl Default for MpiConfig {
    fn default() -> Self {
        Self {
            comm: CommConfig::default(),
            max_message_bytes: 16 << 20,
        }
    }
}

/// One rank's side of an MPI group, before it becomes a [`Communicator`].
#[derive(Debug)]
pub struct MpiGroup {
    comm: MpiCommunicator,
}

/// The tags of one (sender, receiver) pair of a group (MPI-1).
#[derive(Debug, Clone, Copy)]
struct PeerTags {
    /// The peer's world rank.
    process: c_int,
    /// What this rank's messages to the peer carry.
    to: c_int,
    /// What the peer's messages to this rank carry.
    from: c_int,
}

/// The tag kinds (MPI-1's lowest bit).
const STREAM: c_int = 0;
const ABORT: c_int = 1;

/// Bits of a tag that carry the sender's group rank: the same for every group, so the
/// endpoint field sits at the same place in every tag and two groups' tags never collide.
const RANK_BITS: u32 = 12;

/// The fewest bits the endpoint field may have (a tag space smaller than this is refused).
const MIN_ENDPOINT_BITS: u32 = 8;

/// Bits of a tag that carry the receiving endpoint's id.
fn endpoint_bits(tag_bits: u32) -> u32 {
    tag_bits.saturating_sub(RANK_BITS + 1).min(30)
}

/// MPI-1's tag of a message to the endpoint `receiver` from group rank `sender`
/// (`sender < 2^RANK_BITS`; `receiver < 2^endpoint_bits`, which `MpiGroup::new` checks).
fn tag(receiver: u32, sender: usize, tag_bits: u32) -> c_int {
    let e = endpoint_bits(tag_bits);
    let endpoint = u64::from(receiver) & ((1u64 << e) - 1);
    let sender = sender as u64 & ((1u64 << RANK_BITS) - 1);
    let tag = ((endpoint << RANK_BITS) | sender) << 1;
    c_int::try_from(tag).unwrap_or(0)
}

impl MpiGroup {
    /// Forms rank `rank`'s side of a group whose rank r receives at `endpoints[r]` (this
    /// rank's endpoint must be one of this process's, [`MpiWorld::endpoint`]). Every rank of
    /// the group calls it with the same endpoints and generation. Nothing is exchanged: the
    /// endpoints are the group.
    pub fn new(
        world: &'static MpiWorld,
        endpoints: Vec<MpiEndpoint>,
        rank: Rank,
        generation: Generation,
        config: impl Into<MpiConfig>,
    ) -> Result<MpiGroup, MpiError> {
        let config = config.into();
        let size = endpoints.len();
        let me = rank.index();
        if me >= size {
            return Err(MpiError::InvalidRank { rank, world: size });
        }
        if endpoints[me].process != world.rank() {
            return Err(MpiError::Endpoints(format!(
                "rank {}'s endpoint is in process {}, not this process ({})",
                rank.0,
                endpoints[me].process,
                world.rank()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = endpoints.iter().find(|e| !seen.insert(**e)) {
            return Err(MpiError::Endpoints(format!("{dup:?} appears twice")));
        }
        if let Some(outside) = endpoints.iter().find(|e| e.process >= world.size()) {
            return Err(MpiError::Endpoints(format!(
                "{outside:?} is outside a world of {} processes",
                world.size()
            )));
        }
        let needed = RANK_BITS + 1 + MIN_ENDPOINT_BITS;
        if needed > world.tag_bits() || size > 1 << RANK_BITS {
            return Err(MpiError::TagSpace {
                world: size,
                needed,
                available: world.tag_bits(),
            });
        }
        // MPI-1: an endpoint id past the tag's field would alias an older group's tags.
        let limit = 1u64 << endpoint_bits(world.tag_bits());
        if let Some(e) = endpoints.iter().find(|e| u64::from(e.id) >= limit) {
            return Err(MpiError::EndpointsExhausted {
                endpoint: *e,
                limit,
            });
        }
        let peers = endpoints
            .iter()
            .enumerate()
            .map(|(r, e)| {
                (r != me).then(|| PeerTags {
                    process: e.process as c_int,
                    to: tag(e.id, me, world.tag_bits()),
                    from: tag(endpoints[me].id, r, world.tag_bits()),
                })
            })
            .collect();
        Ok(MpiGroup {
            comm: MpiCommunicator {
                mpi: world,
                rank,
                world: size,
                generation,
                seq: 0,
                timeout: config.comm.timeout,
                algorithm: config.comm.algorithm,
                partial_sums: config.comm.partial_sums,
                last_algorithm: None,
                sent: vec![0; size],
                received: vec![0; size],
                peers,
                shut_down: Arc::new(AtomicBool::new(false)),
                failure: None,
                work: Vec::new(),
                scratch: Vec::new(),
                plan_cache: None,
                pending: Vec::new(),
                max_message: config.max_message_bytes.clamp(4, i32::MAX as usize / 4 * 4),
                bytes_sent: 0,
            },
        })
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.comm.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.comm.world
    }

    /// A handle that shuts this rank's side of the group down from any thread (MPI-4).
    pub fn shutdown_handle(&self) -> MpiShutdown {
        MpiShutdown {
            flag: Arc::clone(&self.comm.shut_down),
        }
    }

    /// The rank's communicator, to be moved to the thread that runs its ops.
    pub fn into_communicator(self) -> Communicator {
        Communicator::mpi(self.comm)
    }
}

impl From<CommConfig> for MpiConfig {
    fn from(comm: CommConfig) -> Self {
        Self {
            comm,
            ..Self::default()
        }
    }
}

/// Shuts one rank's side of an MPI group down from any thread (MPI-4).
#[derive(Debug, Clone)]
pub struct MpiShutdown {
    flag: Arc<AtomicBool>,
}

impl MpiShutdown {
    /// Wakes the rank's waiting op with [`CommError::Shutdown`] and refuses later ones.
    pub fn shutdown(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }
}

/// One rank's side of an MPI group: the transport behind [`Communicator`] for MPI groups.
#[derive(Debug)]
pub(crate) struct MpiCommunicator {
    mpi: &'static MpiWorld,
    rank: Rank,
    world: usize,
    generation: Generation,
    seq: u64,
    timeout: Duration,
    algorithm: Algorithm,
    /// How 16-bit reductions' partial sums travel (COMM-9).
    partial_sums: PartialSums,
    last_algorithm: Option<Algorithm>,
    /// Point-to-point sends/recvs so far, per peer (COMM-1).
    sent: Vec<u64>,
    received: Vec<u64>,
    /// `peers[r]`: rank r's process and tags (`None` for this rank).
    peers: Vec<Option<PeerTags>>,
    shut_down: Arc<AtomicBool>,
    /// The failure that poisoned this communicator.
    failure: Option<CommError>,
    /// f32 working buffer for f16/bf16 and read-only inputs.
    work: Vec<f32>,
    /// Received pieces being reduced or widened.
    scratch: Vec<u8>,
    plan_cache: Option<(Rank, Plan)>,
    /// Sends not known to be complete, each with the bytes it reads (MPI-2).
    pending: Vec<raw::PendingSend>,
    max_message: usize,
    bytes_sent: u64,
}

/// Who an op is, for its errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpId {
    seq: u64,
    op: CollectiveKind,
    deadline: Instant,
}

impl MpiCommunicator {
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

    /// Data payload bytes this rank sent so far (headers not counted).
    pub(crate) fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn me(&self) -> usize {
        self.rank.index()
    }

    fn deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.timeout)
            .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
    }
}

impl Drop for MpiCommunicator {
    fn drop(&mut self) {
        // MPI-2: sends still in flight keep reading their buffers; never free them.
        self.forget_pending();
    }
}
