//! [`Communicator`]: one rank's handle on a group, whatever transport moves its bytes.
//!
//! Owns: the public op API and its dispatch to a transport. The in-process transport
//! (`comm::local`), with the `cluster` feature the TCP transport (`comm::tcp`) and the
//! hierarchical one (`comm::hierarchical`), and with the `mpi` feature the MPI transport
//! (`comm::mpi`) each implement every op with the same signature and the same semantics
//! (COMM-1..7); callers (the stage actors, pipeline execution) hold a `Communicator` and never
//! learn which one runs.

use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "cluster")]
use super::hierarchical::HierCommunicator;
use super::local::LocalCommunicator;
#[cfg(feature = "mpi")]
use super::mpi::MpiCommunicator;
#[cfg(feature = "cluster")]
use super::tcp::TcpCommunicator;
use super::{Algorithm, CommError, Element, LocalGroup, MessageHook, PartialSums, ReduceOp};
use crate::mesh::{Generation, Rank};

/// The transport behind a communicator. An enum, not a trait object: the ops are generic
/// over the element type, and a match per op costs nothing next to moving a buffer.
#[derive(Debug)]
enum Transport {
    Local(LocalCommunicator),
    /// Boxed: a TCP communicator holds its links and buffers, and keeping it out of line
    /// keeps `Communicator` (moved around in actor messages) as small as the local one.
    #[cfg(feature = "cluster")]
    Tcp(Box<TcpCommunicator>),
    /// In-process first, then across processes between leaders (`comm::hierarchical`).
    #[cfg(feature = "cluster")]
    Hier(Box<HierCommunicator>),
    /// Endpoints of the system's MPI (`comm::mpi`).
    #[cfg(feature = "mpi")]
    Mpi(Box<MpiCommunicator>),
}

/// Runs the same method on whichever transport is behind `$comm`.
macro_rules! dispatch {
    ($comm:expr, $inner:ident => $call:expr) => {
        match $comm {
            Transport::Local($inner) => $call,
            #[cfg(feature = "cluster")]
            Transport::Tcp($inner) => $call,
            #[cfg(feature = "cluster")]
            Transport::Hier($inner) => $call,
            #[cfg(feature = "mpi")]
            Transport::Mpi($inner) => $call,
        }
    };
}

/// One rank's handle on a group: runs that rank's side of every op, from one thread.
///
/// A communicator comes from [`LocalGroup::communicators`] (ranks are threads of this
/// process) or, with the `cluster` feature, from `comm::tcp::TcpGroup::connect` (ranks are
/// processes joined by TCP links). Both give the same results for the same inputs and the same
/// errors for the same faults (see the module docs of [`crate::comm`]); a TCP group adds
/// [`CommError::Link`] for a lost or misbehaving peer process.
///
/// Every method blocks until the op completed on this rank or failed. On error a buffer the
/// op writes holds unspecified values, except after [`CommError::Mismatch`] (untouched).
#[derive(Debug)]
pub struct Communicator {
    transport: Transport,
}

impl Communicator {
    pub(crate) fn local(inner: LocalCommunicator) -> Self {
        Self {
            transport: Transport::Local(inner),
        }
    }

    #[cfg(feature = "cluster")]
    pub(crate) fn tcp(inner: TcpCommunicator) -> Self {
        Self {
            transport: Transport::Tcp(Box::new(inner)),
        }
    }

    #[cfg(feature = "mpi")]
    pub(crate) fn mpi(inner: MpiCommunicator) -> Self {
        Self {
            transport: Transport::Mpi(Box::new(inner)),
        }
    }

    /// Whether this communicator moves its bytes through MPI.
    pub fn is_mpi(&self) -> bool {
        #[cfg(feature = "mpi")]
        return matches!(self.transport, Transport::Mpi(_));
        #[cfg(not(feature = "mpi"))]
        false
    }

    /// A TCP communicator's data payload bytes sent so far (TCP-7's tests).
    #[cfg(all(test, feature = "cluster"))]
    pub(crate) fn tcp_data_bytes_sent(&self) -> Option<u64> {
        match &self.transport {
            Transport::Tcp(t) => Some(t.data_bytes_sent()),
            _ => None,
        }
    }

    /// A TCP communicator's parts of received ranges sent on mid-step so far (TCP-8's tests).
    #[cfg(all(test, feature = "cluster"))]
    pub(crate) fn tcp_forwarded_parts(&self) -> Option<u64> {
        match &self.transport {
            Transport::Tcp(t) => Some(t.forwarded_parts()),
            _ => None,
        }
    }

    /// A hierarchical group's communicator for `rank` (feature `cluster`): `local` is its
    /// communicator in its process's in-process group (ranks in `plan.local` order), `leaders`
    /// (on a process's leader, when there are two or more processes) its communicator in the
    /// leaders' TCP group (ranks in `plan.leaders` order); `processes[r]` is rank r's process.
    /// `None` if `local` is not an in-process communicator.
    #[cfg(feature = "cluster")]
    pub fn hierarchical(
        (rank, generation): (Rank, Generation),
        processes: Vec<u32>,
        plan: super::hierarchical::HierarchyPlan,
        local: Communicator,
        leaders: Option<Communicator>,
    ) -> Option<Self> {
        HierCommunicator::new((rank, generation), processes, plan, local, leaders).map(|h| Self {
            transport: Transport::Hier(Box::new(h)),
        })
    }

    /// Whether this communicator runs its collectives hierarchically (in its process, then
    /// between process leaders).
    pub fn is_hierarchical(&self) -> bool {
        #[cfg(feature = "cluster")]
        return matches!(self.transport, Transport::Hier(_));
        #[cfg(not(feature = "cluster"))]
        false
    }

    /// Bytes this rank has sent so far, counted by the transport: every message of a ring or
    /// tree plan and every point-to-point send, as elements × the size of their type (16-bit
    /// values count 2 bytes); in-process, a direct shared-memory plan sends no message and
    /// counts nothing (a group with an emulated link, `CommConfig::link`, never runs one).
    pub fn bytes_sent(&self) -> u64 {
        match &self.transport {
            Transport::Local(c) => c.bytes_sent(),
            #[cfg(feature = "cluster")]
            Transport::Tcp(t) => t.data_bytes_sent(),
            #[cfg(feature = "cluster")]
            Transport::Hier(h) => h.bytes_sent(),
            #[cfg(feature = "mpi")]
            Transport::Mpi(m) => m.bytes_sent(),
        }
    }

    /// This communicator's rank.
    pub fn rank(&self) -> Rank {
        dispatch!(&self.transport, c => c.rank())
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        dispatch!(&self.transport, c => c.world())
    }

    /// The group's generation.
    pub fn generation(&self) -> Generation {
        dispatch!(&self.transport, c => c.generation())
    }

    /// The in-process group this communicator belongs to; `None` for a TCP communicator.
    pub fn group(&self) -> Option<&Arc<LocalGroup>> {
        match &self.transport {
            Transport::Local(c) => Some(c.group()),
            #[cfg(feature = "cluster")]
            Transport::Tcp(_) | Transport::Hier(_) => None,
            #[cfg(feature = "mpi")]
            Transport::Mpi(_) => None,
        }
    }

    /// Whether this communicator's peers are other processes (the TCP, hierarchical or MPI
    /// transport).
    pub fn is_cross_process(&self) -> bool {
        !matches!(self.transport, Transport::Local(_))
    }

    /// The sequence number the next collective will carry (COMM-1).
    pub fn next_seq(&self) -> u64 {
        dispatch!(&self.transport, c => c.next_seq())
    }

    /// The time-out each op gets.
    pub fn timeout(&self) -> Duration {
        dispatch!(&self.transport, c => c.timeout())
    }

    /// Sets the time-out of the following ops.
    pub fn set_timeout(&mut self, timeout: Duration) {
        dispatch!(&mut self.transport, c => c.set_timeout(timeout))
    }

    /// This communicator with another time-out.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.set_timeout(timeout);
        self
    }

    /// The algorithm requested for the following collectives.
    pub fn algorithm(&self) -> Algorithm {
        dispatch!(&self.transport, c => c.algorithm())
    }

    /// Requests an algorithm for the following collectives. All ranks of a group should
    /// request the same: an algorithm is resolved per rank, and ranks that resolve different
    /// ones get [`CommError::Mismatch`]. A TCP group cannot run [`Algorithm::Direct`] (it reads
    /// peers' memory) and runs [`Algorithm::Ring`] instead.
    pub fn set_algorithm(&mut self, algorithm: Algorithm) {
        dispatch!(&mut self.transport, c => c.set_algorithm(algorithm))
    }

    /// How the following 16-bit reductions' partial sums travel (COMM-9).
    pub fn partial_sums(&self) -> PartialSums {
        dispatch!(&self.transport, c => c.partial_sums())
    }

    /// Sets how the following f16 and bf16 reductions' partial sums travel in ring and tree
    /// plans (COMM-9). All ranks of a group should set the same: ranks that differ get
    /// [`CommError::Mismatch`].
    pub fn set_partial_sums(&mut self, partial_sums: PartialSums) {
        dispatch!(&mut self.transport, c => c.set_partial_sums(partial_sums))
    }

    /// Sends every later message of this rank's message plans through `hook` (COMM-8: how a
    /// fault plan delays, drops or corrupts messages), or no longer (`None`). A communicator
    /// with a hook resolves direct plans to ring, so every rank of the group should have one.
    /// In-process groups only: a TCP communicator ignores it (its faults are the network's).
    pub fn set_message_hook(&mut self, hook: Option<Arc<dyn MessageHook>>) {
        match &mut self.transport {
            Transport::Local(c) => c.set_message_hook(hook),
            #[cfg(feature = "cluster")]
            Transport::Tcp(_) | Transport::Hier(_) => {}
            #[cfg(feature = "mpi")]
            Transport::Mpi(_) => {}
        }
    }

    /// The algorithm that moved the data of the last all-reduce, reduce-scatter, all-gather or
    /// broadcast that passed validation (never [`Algorithm::Auto`]).
    pub fn last_algorithm(&self) -> Option<Algorithm> {
        dispatch!(&self.transport, c => c.last_algorithm())
    }

    /// All-reduce in place: afterwards every rank's `buf` holds the element-wise reduction
    /// of all ranks' `buf`s, bit-identical on every rank. Ranks must pass equal lengths,
    /// the same type and the same `op`.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.all_reduce(buf, op))
    }

    /// Reduce-scatter: `input` is the full buffer of length L on every rank; afterwards
    /// `output` holds this rank's chunk `chunk_range(L, world, rank)` of the reduction.
    /// `output.len()` must equal that chunk's length (else [`CommError::Mismatch`]).
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.reduce_scatter(input, output, op))
    }

    /// All-gather: `output` has the same length L on every rank; rank r contributes `input`
    /// as chunk `chunk_range(L, world, r)` (its length must match, else
    /// [`CommError::Mismatch`]); afterwards every `output` holds all chunks.
    pub fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.all_gather(input, output))
    }

    /// Broadcast: afterwards every rank's `buf` equals `root`'s. Ranks must pass equal
    /// lengths, the same type and the same root (inside the group).
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.broadcast(buf, root))
    }

    /// Barrier: returns once every rank of the group called it (or with an error).
    pub fn barrier(&mut self) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.barrier())
    }

    /// Sends `buf` to rank `to`. The k-th send from a rank to `to` matches the k-th recv of
    /// `to` from that rank; lengths and types must agree (else [`CommError::Mismatch`] on both
    /// sides). In process it returns once `to` copied the data; over TCP once `to` matched the
    /// call and the kernel took the bytes.
    pub fn send<T: Element>(&mut self, buf: &[T], to: Rank) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.send(buf, to))
    }

    /// Receives into `buf` the matching [`Communicator::send`] of rank `from` (see there).
    pub fn recv<T: Element>(&mut self, buf: &mut [T], from: Rank) -> Result<(), CommError> {
        dispatch!(&mut self.transport, c => c.recv(buf, from))
    }
}
