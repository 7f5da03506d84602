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
//!   resolve as [`schedule::resolve`] says (ring for anything but small buffers).
//! - TCP-3 (never a deadlock from flow control): each link has a sender thread, so a rank
//!   never blocks in a send while its peer blocks in a send to it. Its queue holds at most
//!   [`SEND_QUEUE`] jobs, and a job is a pointer into the caller's buffer, not a copy, except
//!   where the plan overwrites a range while its send may still be in flight
//!   ([`schedule::send_modes`]); the socket's window is the only byte buffer (LINK-5). A
//!   step that writes a range waits for the borrowed sends of that range to complete.
//! - TCP-4 (no borrowed byte outlives its op): every op, successful or not, returns only after
//!   the sender threads stopped reading the caller's buffers: on success every send
//!   completed; on failure the links are aborted and the threads acknowledged every job.
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

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::element::{Element, as_f32_mut, combine, finish, narrow, widen};
use super::emulate::LinkEmulation;
use super::plan::{self, Plan, Step};
use super::{
    Algorithm, CallShape, CollectiveKind, CommConfig, CommError, Communicator, DType, LinkFailure,
    RankCall, ReduceOp, chunk_range,
};
use crate::comm::net::link::{
    LinkCloser, LinkConfig, LinkError, LinkListener, LinkReader, LinkWriter, PayloadSink,
};
use crate::mesh::{Generation, Rank};

mod schedule;
#[cfg(test)]
mod tests;

pub use schedule::{LinkRole, link_role};
use schedule::{SendMode, peers_with_role, send_modes, sends_of_final_values};

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

fn rank_of(index: usize) -> Rank {
    Rank(u32::try_from(index).unwrap_or(u32::MAX))
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// Settings of a TCP group. Plain data with defaults; builder methods set one field each.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TcpConfig {
    /// Time-out and algorithm of the ops.
    pub comm: CommConfig,
    /// Limits of the links (largest frame, how long forming a link may take).
    pub link: LinkConfig,
    /// The largest payload of one data frame: a plan step larger than this is sent as several
    /// frames. At most [`LinkConfig::max_payload`], a multiple of 4.
    pub frame_bytes: usize,
}

impl Default for TcpConfig {
    /// The default [`CommConfig`] and [`LinkConfig`], frames of up to 4 MiB.
    fn default() -> Self {
        Self {
            comm: CommConfig::default(),
            link: LinkConfig::default(),
            frame_bytes: 4 << 20,
        }
    }
}

impl TcpConfig {
    /// Sets the op time-out.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.comm.timeout = timeout;
        self
    }

    /// Sets the algorithm collectives request.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.comm.algorithm = algorithm;
        self
    }

    /// Sets the link limits.
    pub fn with_link(mut self, link: LinkConfig) -> Self {
        self.link = link;
        self
    }

    /// Sets [`TcpConfig::frame_bytes`].
    pub fn with_frame_bytes(mut self, bytes: usize) -> Self {
        self.frame_bytes = bytes;
        self
    }
}

/// Why a TCP group could not be formed. Every variant names the rank concerned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpGroupError {
    /// The listener's rank is not a rank of a group of `world` (one address per rank).
    #[error("rank {} is not in a group of {world} addresses", rank.0)]
    InvalidRank {
        /// The listener's rank.
        rank: Rank,
        /// The number of addresses passed.
        world: usize,
    },
    /// The configuration cannot work (frame size zero, not a multiple of 4, or above the
    /// link's maximum payload).
    #[error("frame_bytes {frame_bytes} must be a positive multiple of 4 of at most {max_payload}")]
    InvalidFrameBytes {
        /// [`TcpConfig::frame_bytes`].
        frame_bytes: usize,
        /// [`LinkConfig::max_payload`].
        max_payload: u64,
    },
    /// Connecting to a lower rank failed (refused handshake: wrong token; nobody listening
    /// until the handshake time-out; the wrong rank answered).
    #[error("rank {} could not connect to rank {}: {source}", rank.0, peer.0)]
    Connect {
        /// This rank.
        rank: Rank,
        /// The rank it connected to.
        peer: Rank,
        /// What went wrong.
        #[source]
        source: LinkError,
    },
    /// Higher ranks never connected within the handshake time-out.
    #[error("rank {}: ranks {missing:?} did not connect within {waited:?}", rank.0)]
    Missing {
        /// This rank.
        rank: Rank,
        /// The ranks that never connected.
        missing: Vec<Rank>,
        /// How long it waited.
        waited: Duration,
    },
    /// The operating system refused to duplicate a socket or start a sender thread.
    #[error("rank {}: setting up the link to rank {} failed: {detail}", rank.0, peer.0)]
    Setup {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: Rank,
        /// The system's error.
        detail: String,
    },
}

/// A rank's side of a TCP group, formed by [`TcpGroup::connect`]: its links to every other
/// rank. Hand it to the rank's thread as a [`Communicator`]; keep a [`TcpShutdown`] to stop it
/// from elsewhere.
#[derive(Debug)]
pub struct TcpGroup {
    comm: TcpCommunicator,
}

impl TcpGroup {
    /// Forms rank `listener.rank()`'s side of a group whose rank r listens at `addrs[r]`:
    /// accepts a link from every higher rank on `listener` and connects to every lower rank
    /// (TCP-1), each within the link's handshake time-out. Connections without the listener's
    /// job token are refused and never become links (LINK-1). Every rank of the group must
    /// call this with the same addresses, generation and token.
    pub fn connect(
        listener: &LinkListener,
        addrs: &[SocketAddr],
        generation: Generation,
        config: TcpConfig,
    ) -> Result<TcpGroup, TcpGroupError> {
        let me = listener.rank();
        let world = addrs.len();
        if me.index() >= world {
            return Err(TcpGroupError::InvalidRank { rank: me, world });
        }
        let max_payload = config.link.max_payload;
        if config.frame_bytes == 0
            || !config.frame_bytes.is_multiple_of(4)
            || config.frame_bytes as u64 > max_payload
        {
            return Err(TcpGroupError::InvalidFrameBytes {
                frame_bytes: config.frame_bytes,
                max_payload,
            });
        }
        let links = connect_mesh(listener, addrs, config.link)?;

        let mut peers: Vec<Option<PeerLink>> = (0..world).map(|_| None).collect();
        let mut closers = Vec::new();
        for (peer, link) in links {
            let setup = |detail: String| TcpGroupError::Setup {
                rank: me,
                peer,
                detail,
            };
            let (writer, reader, closer) = link.split().map_err(|e| setup(e.to_string()))?;
            let link = config.comm.link.clone().map(|l| (me, l));
            let sender = Sender::spawn(me, peer, writer, config.frame_bytes, link)
                .map_err(|e| setup(e.to_string()))?;
            closers.push(closer);
            peers[peer.index()] = Some(PeerLink { reader, sender });
        }
        let comm = TcpCommunicator {
            rank: me,
            world,
            generation,
            seq: 0,
            timeout: config.comm.timeout,
            algorithm: config.comm.algorithm,
            last_algorithm: None,
            sent: vec![0; world],
            received: vec![0; world],
            peers,
            shared: Arc::new(Shared {
                shut_down: AtomicBool::new(false),
                closers,
            }),
            failure: None,
            header: Vec::new(),
            work: Vec::new(),
            scratch: Vec::new(),
            scratch16: Vec::new(),
            plan_cache: None,
            data_bytes_sent: 0,
        };
        Ok(TcpGroup { comm })
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.comm.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.comm.world
    }

    /// The group's generation.
    pub fn generation(&self) -> Generation {
        self.comm.generation
    }

    /// A handle that shuts this rank's side of the group down from any thread (TCP-6).
    pub fn shutdown_handle(&self) -> TcpShutdown {
        TcpShutdown {
            shared: Arc::clone(&self.comm.shared),
        }
    }

    /// The rank's communicator, to be moved to the thread that runs its ops.
    pub fn into_communicator(self) -> Communicator {
        Communicator::tcp(self.comm)
    }
}

/// Rank `listener.rank()`'s links to every other rank of a group whose rank r listens at
/// `addrs[r]`, in rank order: accepted from every higher rank, connected to every lower one
/// (TCP-1), all within the link's handshake time-out; only token-holders become links
/// (LINK-1). What [`TcpGroup::connect`] and the pipeline links across processes are made of.
pub(crate) fn connect_mesh(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
) -> Result<Vec<(Rank, crate::comm::net::link::Link)>, TcpGroupError> {
    let me = listener.rank();
    let world = addrs.len();
    if me.index() >= world {
        return Err(TcpGroupError::InvalidRank { rank: me, world });
    }
    let started = Instant::now();
    let deadline = started + config.handshake_timeout;
    let (accepted, connected) = std::thread::scope(|scope| {
        let acceptor = scope.spawn(|| accept_all(listener, world, deadline, started));
        let connected = connect_all(listener, addrs, config, deadline);
        let accepted = acceptor
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (accepted, connected)
    });
    let mut links = connected?;
    links.extend(accepted?);
    links.sort_by_key(|(rank, _)| *rank);
    Ok(links)
}

/// Accepts a link from every higher rank before `deadline`. Connections from strangers (no
/// token: refused by the listener) or from ranks that are not expected are dropped and the
/// wait goes on.
fn accept_all(
    listener: &LinkListener,
    world: usize,
    deadline: Instant,
    started: Instant,
) -> Result<Vec<(Rank, crate::comm::net::link::Link)>, TcpGroupError> {
    let me = listener.rank();
    let mut missing = peers_with_role(me, world, LinkRole::Accept);
    let mut links = Vec::new();
    while !missing.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TcpGroupError::Missing {
                rank: me,
                missing,
                waited: started.elapsed(),
            });
        }
        match listener.accept_within(left) {
            Ok(link) => match link.peer().rank {
                Some(peer) if missing.contains(&peer) => {
                    missing.retain(|r| *r != peer);
                    links.push((peer, link));
                }
                other => {
                    tracing::warn!(
                        rank = me.0,
                        peer = ?other,
                        "dropped a data-plane link from a rank this group does not expect"
                    );
                }
            },
            // Refused connections were logged by the listener (LINK-1); a time-out is
            // checked against the deadline above.
            Err(LinkError::Rejected { .. } | LinkError::Timeout { .. }) => {}
            Err(e) => {
                tracing::warn!(rank = me.0, error = %e, "a data-plane handshake failed");
            }
        }
    }
    Ok(links)
}

/// Connects to every lower rank, retrying a refused TCP connection (a listener not bound yet)
/// until `deadline`.
fn connect_all(
    listener: &LinkListener,
    addrs: &[SocketAddr],
    config: LinkConfig,
    deadline: Instant,
) -> Result<Vec<(Rank, crate::comm::net::link::Link)>, TcpGroupError> {
    let me = listener.rank();
    let token = listener.token();
    let mut links = Vec::new();
    for peer in peers_with_role(me, addrs.len(), LinkRole::Connect) {
        let link = loop {
            match crate::comm::net::link::Link::connect(
                addrs[peer.index()],
                me,
                peer,
                token,
                config,
            ) {
                Ok(link) => break link,
                Err(LinkError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::ConnectionRefused
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(source) => {
                    return Err(TcpGroupError::Connect {
                        rank: me,
                        peer,
                        source,
                    });
                }
            }
        };
        links.push((peer, link));
    }
    Ok(links)
}

/// Shuts one rank's side of a TCP group down from any thread (TCP-6): its links are closed, a
/// waiting op fails with [`CommError::Shutdown`], and so does every later op.
#[derive(Debug, Clone)]
pub struct TcpShutdown {
    shared: Arc<Shared>,
}

impl TcpShutdown {
    /// Shuts down (idempotent).
    pub fn shutdown(&self) {
        self.shared.shut_down.store(true, Ordering::SeqCst);
        for closer in &self.shared.closers {
            closer.shutdown();
        }
    }

    /// Whether [`TcpShutdown::shutdown`] was called.
    pub fn is_shut_down(&self) -> bool {
        self.shared.shut_down.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
struct Shared {
    shut_down: AtomicBool,
    closers: Vec<LinkCloser>,
}

/// The header frame of an op.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OpHeader {
    tag: [u8; 4],
    generation: u64,
    seq: u64,
    call: CallShape,
}

/// Bytes a sender thread writes: the caller's memory, or a copy.
enum Payload {
    Owned(Vec<u8>),
    Borrowed(RawBytes),
}

/// A range of a caller's buffer that a sender thread reads while the op runs.
struct RawBytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the op that queued it keeps the buffer alive and leaves this range unwritten until
// the sender thread acknowledged the job (TCP-4).
unsafe impl Send for RawBytes {}

enum Job {
    Data {
        ticket: u64,
        payload: Payload,
        deadline: Instant,
    },
    Abort {
        reason: Vec<u8>,
        deadline: Instant,
    },
}

#[derive(Debug, Default)]
struct ProgressState {
    /// The last ticket the thread is done with (written, failed or skipped).
    processed: u64,
    /// The last ticket written successfully.
    completed: u64,
    /// The first error; every later job is skipped.
    error: Option<LinkError>,
}

#[derive(Debug, Default)]
struct Progress {
    state: Mutex<ProgressState>,
    changed: Condvar,
}

/// A link's sender thread and its queue (TCP-3).
#[derive(Debug)]
struct Sender {
    queue: Option<SyncSender<Job>>,
    progress: Arc<Progress>,
    thread: Option<JoinHandle<()>>,
    /// The last ticket queued.
    issued: u64,
}

impl Sender {
    fn spawn(
        me: Rank,
        peer: Rank,
        writer: LinkWriter,
        frame_bytes: usize,
        link: Option<(Rank, LinkEmulation)>,
    ) -> std::io::Result<Self> {
        let (queue, jobs) = std::sync::mpsc::sync_channel(SEND_QUEUE);
        let progress = Arc::new(Progress::default());
        let shared = Arc::clone(&progress);
        let thread = std::thread::Builder::new()
            .name(format!("meshwork-tcp-{}-to-{}", me.0, peer.0))
            .spawn(move || run_sender(writer, &jobs, &shared, frame_bytes, link.as_ref()))?;
        Ok(Self {
            queue: Some(queue),
            progress,
            thread: Some(thread),
            issued: 0,
        })
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it is idle; every job of a finished op is
        // done (TCP-4), so this does not wait for a peer.
        self.queue = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run_sender(
    mut writer: LinkWriter,
    jobs: &Receiver<Job>,
    progress: &Progress,
    frame: usize,
    link: Option<&(Rank, LinkEmulation)>,
) {
    let mut failed = false;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Data {
                ticket,
                payload,
                deadline,
            } => {
                let result = if failed {
                    Ok(())
                } else {
                    let bytes: &[u8] = match &payload {
                        Payload::Owned(bytes) => bytes,
                        // SAFETY: TCP-4: the op keeps this range alive and unwritten until
                        // `processed` reaches this ticket, which happens below.
                        Payload::Borrowed(raw) => unsafe {
                            std::slice::from_raw_parts(raw.ptr, raw.len)
                        },
                    };
                    // LINK-1: the payload leaves once the emulated link has carried it.
                    if let Some((me, link)) = link {
                        // Never past the op's deadline: the write then fails with it.
                        let left = deadline.saturating_duration_since(Instant::now());
                        std::thread::sleep(link.delay(*me, bytes.len()).min(left));
                    }
                    bytes
                        .chunks(frame.max(1))
                        .try_for_each(|chunk| writer.send(chunk, deadline))
                };
                let mut state = lock(&progress.state);
                match result {
                    Ok(()) if !failed => state.completed = ticket,
                    Ok(()) => {}
                    Err(e) => {
                        failed = true;
                        state.error.get_or_insert(e);
                    }
                }
                state.processed = ticket;
                drop(state);
                progress.changed.notify_all();
            }
            Job::Abort { reason, deadline } => {
                if !failed {
                    let _ = writer.abort(&reason, deadline);
                }
                return;
            }
        }
    }
}

#[derive(Debug)]
struct PeerLink {
    reader: LinkReader,
    sender: Sender,
}

/// Writes received bytes straight into a buffer.
struct CopySink {
    dst: *mut u8,
    base: usize,
}

impl PayloadSink for CopySink {
    fn piece(&mut self, offset: usize, len: usize) -> &mut [u8] {
        // SAFETY: the caller sized the frame (max_len) to the range this sink covers, which
        // lies in a buffer it owns for the op and that no sender reads now (TCP-3 waits).
        unsafe { std::slice::from_raw_parts_mut(self.dst.add(self.base + offset), len) }
    }

    fn arrived(&mut self, _offset: usize, _len: usize) {}
}

impl StepSink for CopySink {
    fn set_base(&mut self, base: usize) {
        self.base = base;
    }
}

/// A sink that receives a step as several frames: each frame's bytes start at `base`.
trait StepSink: PayloadSink {
    fn set_base(&mut self, base: usize);
}

impl StepSink for ReduceSink<'_> {
    fn set_base(&mut self, base: usize) {
        self.base = base;
    }
}

/// Reads received f32s into a scratch piece and combines them into a buffer.
struct ReduceSink<'a> {
    dst: *mut f32,
    /// Bytes of the step already received.
    base: usize,
    scratch: &'a mut Vec<f32>,
    op: ReduceOp,
}

impl PayloadSink for ReduceSink<'_> {
    fn piece(&mut self, _offset: usize, len: usize) -> &mut [u8] {
        let elements = len / 4;
        if self.scratch.len() < elements {
            self.scratch.resize(elements, 0.0);
        }
        // SAFETY: any byte pattern is a valid f32, u8 has no alignment, and the slice covers
        // exactly `elements` f32s of the scratch buffer (len is a multiple of 4: the reader
        // checks the granule).
        unsafe { std::slice::from_raw_parts_mut(self.scratch.as_mut_ptr().cast::<u8>(), len) }
    }

    fn arrived(&mut self, offset: usize, len: usize) {
        let (start, n) = ((self.base + offset) / 4, len / 4);
        // SAFETY: as for CopySink: this range of the buffer is this rank's to write now.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.dst.add(start), n) };
        combine(dst, &self.scratch[..n], self.op);
    }
}

/// Reads received 16-bit elements into a scratch piece and widens them into an f32 buffer.
struct WidenSink<'a> {
    dst: *mut f32,
    /// Bytes of the step already received.
    base: usize,
    scratch: &'a mut Vec<u8>,
    dtype: DType,
}

impl PayloadSink for WidenSink<'_> {
    fn piece(&mut self, _offset: usize, len: usize) -> &mut [u8] {
        if self.scratch.len() < len {
            self.scratch.resize(len, 0);
        }
        &mut self.scratch[..len]
    }

    fn arrived(&mut self, offset: usize, len: usize) {
        let (start, n) = ((self.base + offset) / 2, len / 2);
        // SAFETY: as for CopySink: this range of the buffer is this rank's to write now.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.dst.add(start), n) };
        for (d, b) in dst.iter_mut().zip(self.scratch[..len].chunks_exact(2)) {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            *d = match self.dtype {
                DType::BF16 => half::bf16::from_bits(bits).to_f32(),
                _ => half::f16::from_bits(bits).to_f32(),
            };
        }
    }
}

impl StepSink for WidenSink<'_> {
    fn set_base(&mut self, base: usize) {
        self.base = base;
    }
}

/// Final f32 values as the little-endian bytes of `dtype` (f16 or bf16), rounded to nearest
/// even: what the op's end rounds them to anyway (TCP-7).
fn narrow_bytes(dtype: DType, values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DType::BF16 => half::bf16::from_f32(v).to_bits().to_le_bytes(),
            _ => half::f16::from_f32(v).to_bits().to_le_bytes(),
        })
        .collect()
}

/// The bytes of a slice of elements (f32, f16, bf16: plain bit patterns).
fn bytes_of<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: Element types have no padding and every byte is initialized.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
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
}

/// Who an op is, for its errors.
#[derive(Debug, Clone, Copy)]
struct OpId {
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

    /// The error an op gets before it starts when the communicator is shut down or poisoned.
    fn refusal(&self, id: OpId) -> Option<CommError> {
        if self.shared.shut_down.load(Ordering::SeqCst) {
            return Some(self.shutdown_error(id));
        }
        let cause = self.failure.as_ref()?;
        Some(CommError::Poisoned {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            cause: Box::new(root_cause(cause).clone()),
        })
    }

    fn shutdown_error(&self, id: OpId) -> CommError {
        CommError::Shutdown {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
        }
    }

    /// Turns a link error with `peer` during op `id` into the op's error (TCP-5).
    fn link_error(&self, peer: usize, id: OpId, error: &LinkError) -> CommError {
        if self.shared.shut_down.load(Ordering::SeqCst) {
            return self.shutdown_error(id);
        }
        let peer = rank_of(peer);
        let (generation, seq, op) = (self.generation, id.seq, id.op);
        let link = |failure| CommError::Link {
            generation,
            seq,
            op,
            peer,
            failure,
        };
        let detail = error.to_string();
        match error {
            LinkError::Timeout { .. } => CommError::Timeout {
                generation,
                seq,
                op,
                missing: vec![peer],
                waited: self.timeout,
            },
            LinkError::Aborted { reason, .. } => {
                match bincode::serde::decode_from_slice::<CommError, _>(reason, bincode_config()) {
                    Ok((cause, _)) => CommError::Poisoned {
                        generation,
                        seq,
                        op,
                        cause: Box::new(cause),
                    },
                    Err(_) => link(LinkFailure::BadFrame { detail }),
                }
            }
            LinkError::Closed { .. }
            | LinkError::UnexpectedEof { .. }
            | LinkError::Broken { .. }
            | LinkError::HandshakeRefused { .. }
            | LinkError::Rejected { .. } => link(LinkFailure::Closed { detail }),
            LinkError::Io { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::BrokenPipe
                        | std::io::ErrorKind::NotConnected
                        | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                link(LinkFailure::Closed { detail })
            }
            LinkError::Io { .. } => link(LinkFailure::Io { detail }),
            LinkError::Frame { .. } => link(LinkFailure::BadFrame { detail }),
            _ => link(LinkFailure::OutOfStep { detail }),
        }
    }

    fn out_of_step(&self, peer: usize, id: OpId, detail: String) -> CommError {
        CommError::Link {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            peer: rank_of(peer),
            failure: LinkFailure::OutOfStep { detail },
        }
    }

    /// Poisons this communicator with `error` and aborts every link, telling the peers the
    /// root cause (TCP-5); returns once no sender thread reads a caller's buffer any more
    /// (TCP-4).
    fn fail(&mut self, error: CommError) -> CommError {
        let error = match &error {
            CommError::Shutdown { .. } => error,
            _ if self.shared.shut_down.load(Ordering::SeqCst) => CommError::Shutdown {
                generation: self.generation,
                seq: error.seq().unwrap_or(self.seq),
                op: op_of(&error),
            },
            _ => error,
        };
        if self.failure.is_none() {
            self.failure = Some(error.clone());
        }
        let reason =
            bincode::serde::encode_to_vec(root_cause(&error), bincode_config()).unwrap_or_default();
        let deadline = Instant::now() + ABORT_GRACE;
        for (r, peer) in self.peers.iter_mut().enumerate() {
            let Some(peer) = peer else { continue };
            let job = Job::Abort {
                reason: reason.clone(),
                deadline,
            };
            let queued = peer
                .sender
                .queue
                .take()
                .is_some_and(|q| !matches!(q.try_send(job), Err(TrySendError::Full(_))));
            if !queued {
                self.shared.closers.iter().for_each(|c| {
                    if c.peer().rank == Some(rank_of(r)) {
                        c.shutdown();
                    }
                });
            }
        }
        // TCP-4: wait for the sender threads to be done with every job; shut the sockets of
        // the ones still writing after the grace period down, which ends their writes.
        let mut forced = false;
        loop {
            let busy = self.peers.iter().flatten().any(|peer| {
                let state = lock(&peer.sender.progress.state);
                state.processed < peer.sender.issued
            });
            if !busy {
                break;
            }
            if !forced && Instant::now() >= deadline {
                self.shared.closers.iter().for_each(LinkCloser::shutdown);
                forced = true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        error
    }

    /// Queues `payload` for the link to `peer`; returns its ticket.
    fn push(&mut self, peer: usize, payload: Payload, id: OpId) -> Result<u64, CommError> {
        let Some(link) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(self.out_of_step(peer, id, "no link to this rank".into()));
        };
        let ticket = link.sender.issued + 1;
        let job = Job::Data {
            ticket,
            payload,
            deadline: id.deadline,
        };
        let sent = link.sender.queue.as_ref().map(|q| q.send(job));
        match sent {
            Some(Ok(())) => {
                link.sender.issued = ticket;
                Ok(ticket)
            }
            _ => {
                let progress = Arc::clone(&link.sender.progress);
                let state = lock(&progress.state);
                let error = state.error.as_ref().map(|e| self.link_error(peer, id, e));
                drop(state);
                Err(error.unwrap_or_else(|| CommError::Link {
                    generation: self.generation,
                    seq: id.seq,
                    op: id.op,
                    peer: rank_of(peer),
                    failure: LinkFailure::Closed {
                        detail: "the link's sender thread has stopped".into(),
                    },
                }))
            }
        }
    }

    /// Waits until the link to `peer` wrote every job up to `ticket`.
    fn wait_sent(&self, peer: usize, ticket: u64, id: OpId) -> Result<(), CommError> {
        let Some(link) = self.peers.get(peer).and_then(Option::as_ref) else {
            return Ok(());
        };
        let progress = &link.sender.progress;
        let mut state = lock(&progress.state);
        loop {
            if state.completed >= ticket {
                return Ok(());
            }
            if let Some(error) = &state.error {
                return Err(self.link_error(peer, id, error));
            }
            let now = Instant::now();
            if now >= id.deadline {
                return Err(CommError::Timeout {
                    generation: self.generation,
                    seq: id.seq,
                    op: id.op,
                    missing: vec![rank_of(peer)],
                    waited: self.timeout,
                });
            }
            state = progress
                .changed
                .wait_timeout(state, id.deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Waits until every job queued on every link was written.
    fn wait_all_sent(&self, id: OpId) -> Result<(), CommError> {
        for (r, peer) in self.peers.iter().enumerate() {
            if let Some(peer) = peer {
                self.wait_sent(r, peer.sender.issued, id)?;
            }
        }
        Ok(())
    }

    fn encode_header(&self, seq: u64, call: &CallShape) -> Vec<u8> {
        let header = OpHeader {
            tag: HEADER_TAG,
            generation: self.generation.0,
            seq,
            call: call.clone(),
        };
        bincode::serde::encode_to_vec(&header, bincode_config())
            .expect("an op header always encodes")
    }

    /// Reads the next header from `peer` before `deadline`.
    fn read_header(
        &mut self,
        peer: usize,
        id: OpId,
        deadline: Instant,
    ) -> Result<OpHeader, HeaderError> {
        let Some(link) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
            return Err(HeaderError::Comm(self.out_of_step(
                peer,
                id,
                "no link to this rank".into(),
            )));
        };
        if let Err(e) = link.reader.recv(&mut self.header, MAX_HEADER, deadline) {
            return Err(match e {
                LinkError::Timeout { .. } => HeaderError::Timeout,
                e => HeaderError::Comm(self.link_error(peer, id, &e)),
            });
        }
        match bincode::serde::decode_from_slice::<OpHeader, _>(&self.header, bincode_config()) {
            Ok((header, used)) if used == self.header.len() && header.tag == HEADER_TAG => {
                if header.generation != self.generation.0 {
                    return Err(HeaderError::Comm(self.out_of_step(
                        peer,
                        id,
                        format!(
                            "a header of generation {} in generation {}",
                            header.generation, self.generation.0
                        ),
                    )));
                }
                Ok(header)
            }
            _ => Err(HeaderError::Comm(self.out_of_step(
                peer,
                id,
                format!(
                    "expected the header of {} #{}, got {} bytes that are not one",
                    id.op,
                    id.seq,
                    self.header.len()
                ),
            ))),
        }
    }

    /// Stage 1 of a collective: exchange calls with every peer and check them (COMM-2).
    fn rendezvous(&mut self, call: CallShape) -> Result<OpId, CommError> {
        let id = OpId {
            seq: self.seq,
            op: call.kind,
            deadline: self.deadline(),
        };
        self.seq += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let header = self.encode_header(id.seq, &call);
        let me = self.me();
        for peer in (0..self.world).filter(|&p| p != me) {
            if let Err(e) = self.push(peer, Payload::Owned(header.clone()), id) {
                return Err(self.fail(e));
            }
        }
        let mut calls = Vec::with_capacity(self.world);
        for peer in 0..self.world {
            if peer == me {
                calls.push(RankCall {
                    rank: self.rank,
                    call: call.clone(),
                });
                continue;
            }
            match self.read_header(peer, id, id.deadline) {
                Ok(header) => {
                    let collective = !matches!(
                        header.call.kind,
                        CollectiveKind::Send | CollectiveKind::Recv
                    );
                    if header.seq != id.seq || !collective {
                        let e = self.out_of_step(
                            peer,
                            id,
                            format!(
                                "expected collective #{}, got {} #{}",
                                id.seq, header.call.kind, header.seq
                            ),
                        );
                        return Err(self.fail(e));
                    }
                    calls.push(RankCall {
                        rank: rank_of(peer),
                        call: header.call,
                    });
                }
                Err(HeaderError::Comm(e)) => return Err(self.fail(e)),
                Err(HeaderError::Timeout) => {
                    // Name every rank not heard from: probe the ones not read yet briefly.
                    let mut missing = vec![rank_of(peer)];
                    for later in (peer + 1..self.world).filter(|&p| p != me) {
                        if self.read_header(later, id, Instant::now() + PROBE).is_err() {
                            missing.push(rank_of(later));
                        }
                    }
                    let e = CommError::Timeout {
                        generation: self.generation,
                        seq: id.seq,
                        op: id.op,
                        missing,
                        waited: self.timeout,
                    };
                    return Err(self.fail(e));
                }
            }
        }
        let fits = calls.iter().all(|c| {
            c.call.agrees_with(&calls[0].call)
                && c.call.is_well_formed()
                && c.call.peer.is_none_or(|p| p.index() < self.world)
        });
        if !fits {
            return Err(CommError::Mismatch {
                generation: self.generation,
                seq: id.seq,
                op: id.op,
                calls,
            });
        }
        Ok(id)
    }

    fn plan_for(
        &mut self,
        kind: CollectiveKind,
        algorithm: Algorithm,
        len: usize,
        root: Rank,
    ) -> (Plan, Vec<SendMode>) {
        match self.plan_cache.take() {
            Some((r, plan, modes))
                if r == root
                    && plan.kind == kind
                    && plan.algorithm == algorithm
                    && plan.len == len =>
            {
                (plan, modes)
            }
            _ => {
                let plan = plan::plan(kind, algorithm, self.world, len, root).unwrap_or(Plan {
                    kind,
                    algorithm,
                    world: self.world,
                    len,
                    steps: vec![Vec::new(); self.world],
                });
                let modes = send_modes(&plan, self.rank);
                (plan, modes)
            }
        }
    }

    /// Stage 2 and 3: runs this rank's steps of the validated collective on the f32 buffer
    /// at `base` (`len` elements), then waits until every send completed.
    ///
    /// # Safety
    /// `base` points at `len` f32s that this rank owns for the whole call and does not touch
    /// otherwise until it returns.
    unsafe fn run(&mut self, call: &CallShape, base: *mut f32, id: OpId) -> Result<(), CommError> {
        let root = call.peer.unwrap_or(Rank(0));
        let op = call.reduce.unwrap_or(ReduceOp::Sum);
        let algorithm = call.algorithm.unwrap_or(Algorithm::Ring);
        let (plan, modes) = self.plan_for(call.kind, algorithm, call.len, root);
        self.last_algorithm = Some(algorithm);
        // TCP-7: a 16-bit op sends its final values as 16-bit.
        let finals = match call.dtype {
            Some(d @ (DType::F16 | DType::BF16)) => {
                Some((d, sends_of_final_values(&plan, self.rank)))
            }
            _ => None,
        };
        let narrow = finals.as_ref().map(|(d, f)| (*d, &f[..]));
        // SAFETY: forwarded.
        let result =
            unsafe { self.execute(plan.steps_of(self.rank), &modes, narrow, base, op, id) };
        let result = result.and_then(|()| self.wait_all_sent(id));
        self.plan_cache = Some((root, plan, modes));
        result.map_err(|e| self.fail(e))
    }

    /// # Safety
    /// As [`TcpCommunicator::run`]; the steps' ranges lie in the buffer (plans are checked
    /// against their lengths by the plan tests).
    unsafe fn execute(
        &mut self,
        steps: &[Step],
        modes: &[SendMode],
        narrow: Option<(DType, &[bool])>,
        base: *mut f32,
        op: ReduceOp,
        id: OpId,
    ) -> Result<(), CommError> {
        // Borrowed sends still possibly in flight: (peer, ticket, range).
        let mut borrowed: Vec<(usize, u64, Range<usize>)> = Vec::new();
        let mut sends = 0;
        for step in steps {
            match step {
                Step::Send { to, range } => {
                    let mode = modes.get(sends).copied().unwrap_or(SendMode::Copy);
                    let final_16 = narrow.and_then(|(d, finals)| {
                        finals.get(sends).copied().unwrap_or(false).then_some(d)
                    });
                    sends += 1;
                    if let Some(dtype) = final_16 {
                        // SAFETY: the range lies in the buffer (PLAN-1 and the plan tests).
                        let values = unsafe {
                            std::slice::from_raw_parts(base.add(range.start), range.len())
                        };
                        let bytes = narrow_bytes(dtype, values);
                        self.data_bytes_sent += bytes.len() as u64;
                        self.push(to.index(), Payload::Owned(bytes), id)?;
                        continue;
                    }
                    // SAFETY: the range lies in the buffer (PLAN-1 and the plan tests).
                    let bytes = unsafe {
                        std::slice::from_raw_parts(
                            base.add(range.start).cast::<u8>(),
                            range.len() * 4,
                        )
                    };
                    let payload = match mode {
                        SendMode::Borrow => Payload::Borrowed(RawBytes {
                            ptr: bytes.as_ptr(),
                            len: bytes.len(),
                        }),
                        SendMode::Copy => Payload::Owned(bytes.to_vec()),
                    };
                    self.data_bytes_sent += (range.len() * 4) as u64;
                    let ticket = self.push(to.index(), payload, id)?;
                    if mode == SendMode::Borrow {
                        borrowed.push((to.index(), ticket, range.clone()));
                    }
                }
                Step::RecvCopy { from, range } if narrow.is_some() => {
                    self.wait_overlapping(&mut borrowed, range, id)?;
                    let dtype = narrow.map_or(DType::F16, |(d, _)| d);
                    // SAFETY: forwarded; the range is this rank's to write now.
                    unsafe { self.recv_widened(from.index(), base, range, dtype, id)? };
                }
                Step::RecvReduce { from, range } | Step::RecvCopy { from, range } => {
                    self.wait_overlapping(&mut borrowed, range, id)?;
                    let reduce = matches!(step, Step::RecvReduce { .. });
                    // SAFETY: forwarded; the range is this rank's to write now.
                    unsafe { self.recv_step(from.index(), base, range, reduce.then_some(op), id)? };
                }
                Step::Finish { range } => {
                    self.wait_overlapping(&mut borrowed, range, id)?;
                    // SAFETY: as above.
                    let values = unsafe {
                        std::slice::from_raw_parts_mut(base.add(range.start), range.len())
                    };
                    finish(values, op, self.world);
                }
                Step::ReducePeers { .. } | Step::CopyFrom { .. } | Step::Barrier => {
                    unreachable!("TCP-2: a TCP group runs ring and tree plans only")
                }
            }
        }
        Ok(())
    }

    /// TCP-3: waits for the borrowed sends whose range overlaps `range`.
    fn wait_overlapping(
        &self,
        borrowed: &mut Vec<(usize, u64, Range<usize>)>,
        range: &Range<usize>,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut i = 0;
        while i < borrowed.len() {
            let (peer, ticket, sent) = &borrowed[i];
            if sent.start < range.end && range.start < sent.end {
                self.wait_sent(*peer, *ticket, id)?;
                borrowed.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Receives `range` (f32s) from `peer` into the buffer at `base`: reduced with `op`, or
    /// copied when `op` is `None`.
    ///
    /// # Safety
    /// `range` of the buffer at `base` is this rank's to write now.
    unsafe fn recv_step(
        &mut self,
        peer: usize,
        base: *mut f32,
        range: &Range<usize>,
        op: Option<ReduceOp>,
        id: OpId,
    ) -> Result<(), CommError> {
        // SAFETY: forwarded.
        let dst = unsafe { base.add(range.start) };
        let expected = range.len() * 4;
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = match op {
            Some(op) => {
                let mut sink = ReduceSink {
                    dst,
                    base: 0,
                    scratch: &mut scratch,
                    op,
                };
                self.recv_bytes(peer, expected, 4, &mut sink, id)
            }
            None => {
                let mut sink = CopySink {
                    dst: dst.cast::<u8>(),
                    base: 0,
                };
                self.recv_bytes(peer, expected, 4, &mut sink, id)
            }
        };
        self.scratch = scratch;
        result
    }

    /// Receives `range` of a 16-bit op's final values from `peer` as 16-bit elements and
    /// widens them into the f32 buffer at `base` (TCP-7).
    ///
    /// # Safety
    /// `range` of the buffer at `base` is this rank's to write now.
    unsafe fn recv_widened(
        &mut self,
        peer: usize,
        base: *mut f32,
        range: &Range<usize>,
        dtype: DType,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut scratch = std::mem::take(&mut self.scratch16);
        let mut sink = WidenSink {
            // SAFETY: forwarded.
            dst: unsafe { base.add(range.start) },
            base: 0,
            scratch: &mut scratch,
            dtype,
        };
        let result = self.recv_bytes(peer, range.len() * 2, 2, &mut sink, id);
        self.scratch16 = scratch;
        result
    }

    /// Data payload bytes this rank handed to its links so far (TCP-7, LINK-1).
    pub(crate) fn data_bytes_sent(&self) -> u64 {
        self.data_bytes_sent
    }

    /// Reads frames from `peer` into `sink` until `expected` bytes arrived.
    fn recv_bytes(
        &mut self,
        peer: usize,
        expected: usize,
        granule: u64,
        sink: &mut dyn StepSink,
        id: OpId,
    ) -> Result<(), CommError> {
        let mut filled = 0;
        while filled < expected {
            sink.set_base(filled);
            let Some(link) = self.peers.get_mut(peer).and_then(Option::as_mut) else {
                return Err(self.out_of_step(peer, id, "no link to this rank".into()));
            };
            match link
                .reader
                .recv_into((expected - filled) as u64, granule, sink, id.deadline)
            {
                Ok(0) => {
                    return Err(self.out_of_step(
                        peer,
                        id,
                        "an empty data frame inside a step".into(),
                    ));
                }
                Ok(n) => filled += n as usize,
                Err(e) => return Err(self.link_error(peer, id, &e)),
            }
        }
        Ok(())
    }

    fn take_work(&mut self, len: usize) -> Vec<f32> {
        let mut work = std::mem::take(&mut self.work);
        work.clear();
        work.resize(len, 0.0);
        work
    }

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

    pub(crate) fn broadcast<T: Element>(
        &mut self,
        buf: &mut [T],
        root: Rank,
    ) -> Result<(), CommError> {
        let call = CallShape::broadcast::<T>(
            self.resolve::<T>(CollectiveKind::Broadcast, buf.len()),
            buf.len(),
            root,
        );
        self.in_place(call, buf)
    }

    /// All-reduce and broadcast: f32 buffers are worked on in place, the others through the
    /// f32 working buffer.
    fn in_place<T: Element>(&mut self, call: CallShape, buf: &mut [T]) -> Result<(), CommError> {
        let id = self.rendezvous(call.clone())?;
        if let Some(values) = as_f32_mut(buf) {
            // SAFETY: `values` is borrowed for the whole call and not touched otherwise.
            return unsafe { self.run(&call, values.as_mut_ptr(), id) };
        }
        let mut work = self.take_work(buf.len());
        widen(&mut work, buf);
        // SAFETY: `work` is owned here for the whole call.
        let result = unsafe { self.run(&call, work.as_mut_ptr(), id) };
        if result.is_ok() {
            narrow(buf, &work);
        }
        self.work = work;
        result
    }

    pub(crate) fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let len = input.len();
        let mine = chunk_range(len, self.world, self.me());
        let call = CallShape::reduce_scatter::<T>(
            self.resolve::<T>(CollectiveKind::ReduceScatter, len),
            len,
            (output.len(), mine.len()),
            op,
        );
        let id = self.rendezvous(call.clone())?;
        let mut work = self.take_work(len);
        widen(&mut work, input);
        // SAFETY: `work` is owned here for the whole call.
        let result = unsafe { self.run(&call, work.as_mut_ptr(), id) };
        if result.is_ok() {
            narrow(output, &work[mine]);
        }
        self.work = work;
        result
    }

    pub(crate) fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let len = output.len();
        let mine = chunk_range(len, self.world, self.me());
        let call = CallShape::all_gather::<T>(
            self.resolve::<T>(CollectiveKind::AllGather, len),
            len,
            (input.len(), mine.len()),
        );
        let id = self.rendezvous(call.clone())?;
        if let Some(values) = as_f32_mut(output) {
            widen(&mut values[mine], input);
            // SAFETY: `output` is borrowed for the whole call and not touched otherwise.
            return unsafe { self.run(&call, values.as_mut_ptr(), id) };
        }
        let mut work = self.take_work(len);
        widen(&mut work[mine], input);
        // SAFETY: `work` is owned here for the whole call.
        let result = unsafe { self.run(&call, work.as_mut_ptr(), id) };
        if result.is_ok() {
            narrow(output, &work);
        }
        self.work = work;
        result
    }

    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        let call = CallShape::barrier();
        self.rendezvous(call).map(|_| ())
    }

    fn check_peer(&self, op: CollectiveKind, peer: Rank) -> Result<usize, CommError> {
        let p = peer.index();
        if p >= self.world || p == self.me() {
            return Err(CommError::InvalidPeer {
                generation: self.generation,
                op,
                rank: self.rank,
                peer,
                world: self.world,
            });
        }
        Ok(p)
    }

    /// The peer's answer to a send or recv header: its call, checked to be the matching op.
    fn p2p_header(
        &mut self,
        peer: usize,
        expect: CollectiveKind,
        id: OpId,
    ) -> Result<CallShape, CommError> {
        match self.read_header(peer, id, id.deadline) {
            Ok(header)
                if header.seq == id.seq
                    && header.call.kind == expect
                    && header.call.peer == Some(self.rank) =>
            {
                Ok(header.call)
            }
            Ok(header) => Err(self.out_of_step(
                peer,
                id,
                format!(
                    "expected {expect} #{}, got {} #{}",
                    id.seq, header.call.kind, header.seq
                ),
            )),
            Err(HeaderError::Timeout) => Err(CommError::Timeout {
                generation: self.generation,
                seq: id.seq,
                op: id.op,
                missing: vec![rank_of(peer)],
                waited: self.timeout,
            }),
            Err(HeaderError::Comm(e)) => Err(e),
        }
    }

    fn p2p_mismatch(&self, id: OpId, peer: usize, mine: CallShape, theirs: CallShape) -> CommError {
        let mut calls = vec![
            RankCall {
                rank: self.rank,
                call: mine,
            },
            RankCall {
                rank: rank_of(peer),
                call: theirs,
            },
        ];
        calls.sort_by_key(|c| c.rank);
        CommError::Mismatch {
            generation: self.generation,
            seq: id.seq,
            op: id.op,
            calls,
        }
    }

    pub(crate) fn send<T: Element>(&mut self, buf: &[T], to: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Send;
        let peer = self.check_peer(op, to)?;
        let id = OpId {
            seq: self.sent[peer],
            op,
            deadline: self.deadline(),
        };
        self.sent[peer] += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let mine = CallShape::point_to_point::<T>(op, buf.len(), to);
        let header = self.encode_header(id.seq, &mine);
        let result = (|| {
            self.push(peer, Payload::Owned(header), id)?;
            let theirs = self.p2p_header(peer, CollectiveKind::Recv, id)?;
            if theirs.dtype != mine.dtype || theirs.len != mine.len {
                return Ok(Err(self.p2p_mismatch(id, peer, mine, theirs)));
            }
            let bytes = bytes_of(buf);
            if !bytes.is_empty() {
                let payload = Payload::Borrowed(RawBytes {
                    ptr: bytes.as_ptr(),
                    len: bytes.len(),
                });
                self.push(peer, payload, id)?;
            }
            self.wait_all_sent(id)?;
            Ok(Ok(()))
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => Err(self.fail(e)),
        }
    }

    pub(crate) fn recv<T: Element>(&mut self, buf: &mut [T], from: Rank) -> Result<(), CommError> {
        let op = CollectiveKind::Recv;
        let peer = self.check_peer(op, from)?;
        let id = OpId {
            seq: self.received[peer],
            op,
            deadline: self.deadline(),
        };
        self.received[peer] += 1;
        if let Some(refusal) = self.refusal(id) {
            return Err(refusal);
        }
        let mine = CallShape::point_to_point::<T>(op, buf.len(), from);
        let result = (|| {
            let theirs = self.p2p_header(peer, CollectiveKind::Send, id)?;
            let header = self.encode_header(id.seq, &mine);
            self.push(peer, Payload::Owned(header), id)?;
            if theirs.dtype != mine.dtype || theirs.len != mine.len {
                self.wait_all_sent(id)?;
                return Ok(Err(self.p2p_mismatch(id, peer, mine.clone(), theirs)));
            }
            let size = std::mem::size_of::<T>();
            let mut sink = CopySink {
                dst: buf.as_mut_ptr().cast::<u8>(),
                base: 0,
            };
            self.recv_bytes(peer, std::mem::size_of_val(buf), size as u64, &mut sink, id)?;
            self.wait_all_sent(id)?;
            Ok(Ok(()))
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// Why reading a header failed.
enum HeaderError {
    /// Nothing (complete) arrived before the deadline.
    Timeout,
    /// Anything else, already an op error.
    Comm(CommError),
}

/// The first failure behind `error` (the cause of a poisoned op).
fn root_cause(error: &CommError) -> &CommError {
    match error {
        CommError::Poisoned { cause, .. } => root_cause(cause),
        other => other,
    }
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
        | CommError::Unsupported { op, .. } => *op,
    }
}
