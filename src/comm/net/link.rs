//! A blocking, authenticated TCP link between two ranks, carrying [`super::frame`] frames.
//!
//! Owns: connecting and accepting with the job-token handshake, bounded waits on every read
//! and write, the sequence numbers of both directions, and closing the connection on the first
//! bad frame. One [`Link`] is one TCP stream; the thread that calls it blocks (meshwork's
//! device threads call collectives blocking).
//!
//! # Handshake
//!
//! The connecting side sends a [`FrameKind::Hello`] (seq 0) with the job token and its rank;
//! the accepting side checks the token (in constant time) and answers a
//! [`FrameKind::Ack`] (seq 0) with its own rank. Handshake frames may carry at most
//! [`HANDSHAKE_MAX_PAYLOAD`] bytes, so a peer that has not shown the token cannot make the
//! acceptor allocate more than that. Data frames are numbered from 1 in each direction.
//!
//! # Invariants (tests name the id they check)
//!
//! - LINK-1: a connection without the job's token (wrong token, no Hello, garbage, wrong
//!   version) is closed and logged (`tracing::warn`), and [`LinkListener::accept`] returns
//!   [`LinkError::Rejected`]; no [`Link`] exists for it, so it never reaches a collective.
//! - LINK-2: every wait is bounded: accept and connect by the handshake time-out, a whole
//!   [`Link::recv_frame`] or [`Link::send_frame`] by the I/O time-out (a deadline for the
//!   call, not per system call, so a peer trickling bytes cannot stretch it). Expiry is
//!   [`LinkError::Timeout`] naming the peer and what was awaited.
//! - LINK-3: a frame declaring more than the configured maximum is rejected from its header,
//!   before its payload is allocated or read; [`Link::send_frame`] refuses to send one.
//! - LINK-4: the first error on a link (bad frame, time-out, end of stream, out-of-order
//!   sequence number) shuts the TCP stream down; every later call fails with
//!   [`LinkError::Broken`].
//! - LINK-5 (bounded buffering): there is no user-side queue. `send_frame` writes the header
//!   and the caller's payload straight to the socket and returns once the kernel took every
//!   byte, so a slow receiver stalls the sender (TCP's window is the only buffer) until the
//!   I/O time-out. `recv_frame` holds one frame, in the caller's buffer.
//!
//! # What the token protects
//!
//! The token keeps processes that were not given it (another job, a port scanner, a stale
//! process of an earlier job) from joining a collective. It is sent in clear text: the data
//! plane is not encrypted, and someone who can read the network can read the token and the
//! data. The Ack does not prove the acceptor knows the token: the connector authenticates the
//! acceptor only by the address the control plane gave it and the rank it announces.
//!
//! # Limits, known and accepted for now
//!
//! [`LinkListener::accept`] runs one handshake at a time: a connector that connects and stays
//! silent holds the listener for up to the handshake time-out. A transport that accepts many
//! peers at once should accept in a loop until its expected ranks are in, or hand each
//! accepted stream's handshake to its own thread.

use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::frame::{self, FrameError, FrameHeader, FrameKind, HEADER_LEN};
use crate::mesh::Rank;

mod halves;
#[cfg(test)]
mod tests;

pub use halves::{LinkCloser, LinkReader, LinkWriter, PayloadSink};

/// The largest payload a handshake frame may carry.
pub const HANDSHAKE_MAX_PAYLOAD: u64 = 256;

/// How often a waiting [`LinkListener::accept`] looks for a new connection.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// The per-job secret that admits a connection to the data plane. Handed out by the control
/// plane; its `Debug` form never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken([u8; 32]);

impl JobToken {
    /// A token with these bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// A fresh token from the operating system's seeded cryptographic generator.
    pub fn random() -> Self {
        let mut bytes = [0u8; 32];
        rand::Rng::fill(&mut rand::rng(), &mut bytes);
        Self(bytes)
    }

    /// The token's bytes (to hand to the other processes over the control plane).
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Compares in time independent of where the tokens differ.
    fn matches(&self, other: &[u8; 32]) -> bool {
        self.0
            .iter()
            .zip(other)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(..)")
    }
}

/// Limits of a link. Plain data with defaults; builder methods set one field each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkConfig {
    /// The largest data payload sent or accepted, in bytes.
    pub max_payload: u64,
    /// The bound on one whole `send_frame` or `recv_frame` call.
    pub io_timeout: Duration,
    /// The bound on connecting, accepting and the handshake.
    pub handshake_timeout: Duration,
}

impl Default for LinkConfig {
    /// 64 MiB frames, a 60 s I/O time-out (the collective time-out's default), 10 s to connect.
    fn default() -> Self {
        Self {
            max_payload: frame::DEFAULT_MAX_PAYLOAD,
            io_timeout: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl LinkConfig {
    /// Sets [`LinkConfig::max_payload`].
    pub fn with_max_payload(mut self, bytes: u64) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Sets [`LinkConfig::io_timeout`].
    pub fn with_io_timeout(mut self, timeout: Duration) -> Self {
        self.io_timeout = timeout;
        self
    }

    /// Sets [`LinkConfig::handshake_timeout`].
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }
}

/// The other end of a link: its address, and its rank once the handshake told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// The peer's socket address (unknown only while nobody has connected yet).
    pub addr: Option<SocketAddr>,
    /// The peer's rank (unknown before the handshake).
    pub rank: Option<Rank>,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.rank, self.addr) {
            (Some(rank), Some(addr)) => write!(f, "rank {} at {addr}", rank.0),
            (Some(rank), None) => write!(f, "rank {}", rank.0),
            (None, Some(addr)) => write!(f, "{addr}"),
            (None, None) => f.write_str("any peer"),
        }
    }
}

/// What a link was waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Awaiting {
    /// A connection to arrive at the listener.
    Accept,
    /// The TCP connection to the peer to be established.
    Connect,
    /// The connecting side's [`FrameKind::Hello`].
    Hello,
    /// The accepting side's [`FrameKind::Ack`].
    Ack,
    /// The header of the next frame.
    Header,
    /// The payload of frame `seq`.
    Payload {
        /// The frame's sequence number.
        seq: u64,
    },
    /// The kernel to take the bytes of frame `seq` (the peer is not reading).
    Send {
        /// The frame's sequence number.
        seq: u64,
    },
}

/// Why the accepting side turned a connection away (LINK-1).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// The Hello carried another token.
    WrongToken,
    /// The first frame was not a Hello.
    NotHello(FrameKind),
    /// The Hello's payload is not a token and a rank.
    MalformedHello,
    /// The first bytes were not a valid frame (another protocol, version, or garbage).
    BadFrame(FrameError),
    /// The connection ended before a whole Hello arrived.
    NoHello,
    /// No whole Hello arrived within the handshake time-out.
    HelloTimeout,
}

/// Why a link operation failed. Every variant names the peer where one is known.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// A wait ran past its bound (LINK-2).
    #[error("timed out after {after:?} waiting for {awaiting:?} from {peer}")]
    Timeout {
        /// The peer waited on.
        peer: Peer,
        /// What was awaited.
        awaiting: Awaiting,
        /// The bound that expired.
        after: Duration,
    },
    /// The stream ended inside a frame.
    #[error(
        "{peer} closed the connection inside a frame ({awaiting:?}): {got} of {expected} bytes"
    )]
    UnexpectedEof {
        /// The peer.
        peer: Peer,
        /// What was being read.
        awaiting: Awaiting,
        /// Bytes of the header or payload that arrived.
        got: u64,
        /// Bytes of the header or payload expected.
        expected: u64,
    },
    /// The peer closed the connection between frames (or sent [`FrameKind::Close`]).
    #[error("{peer} closed the connection while we awaited {awaiting:?}")]
    Closed {
        /// The peer.
        peer: Peer,
        /// What was awaited.
        awaiting: Awaiting,
    },
    /// The peer sent bytes that are not a valid frame; the connection is closed.
    #[error("bad frame from {peer}: {source}")]
    Frame {
        /// The peer.
        peer: Peer,
        /// What was wrong.
        #[source]
        source: FrameError,
    },
    /// A valid frame of a kind not expected here.
    #[error("{peer} sent a {found:?} frame where a {expected:?} frame belongs")]
    UnexpectedKind {
        /// The peer.
        peer: Peer,
        /// The kind expected.
        expected: FrameKind,
        /// The kind received.
        found: FrameKind,
    },
    /// A frame out of order (lost, repeated or reordered by a faulty peer).
    #[error("{peer} sent frame {found}, expected frame {expected}")]
    OutOfSequence {
        /// The peer.
        peer: Peer,
        /// The sequence number expected.
        expected: u64,
        /// The sequence number received.
        found: u64,
    },
    /// The acceptor turned a connection away (LINK-1); the listener is still usable.
    #[error("rejected a data-plane connection from {from}: {reason:?}")]
    Rejected {
        /// The address the connection came from.
        from: SocketAddr,
        /// Why.
        reason: Rejection,
    },
    /// The acceptor closed the connection during the handshake (most likely: wrong token).
    #[error("{peer} closed the connection during the handshake (wrong token or version?)")]
    HandshakeRefused {
        /// The peer.
        peer: Peer,
    },
    /// The peer is not the rank this side meant to reach.
    #[error("connected to rank {}, expected rank {}", found.0, expected.0)]
    WrongPeer {
        /// The rank expected.
        expected: Rank,
        /// The rank the peer announced.
        found: Rank,
    },
    /// A payload over the configured maximum was not sent.
    #[error("payload of {len} bytes exceeds the maximum of {max}")]
    PayloadTooLarge {
        /// The payload's length.
        len: u64,
        /// [`LinkConfig::max_payload`].
        max: u64,
    },
    /// The peer closed the link with a [`FrameKind::Close`] frame that carries a reason (its
    /// bytes are the layer above's business: the TCP transport sends the failure that made the
    /// peer give up).
    #[error("{peer} closed the link with a reason ({} bytes)", reason.len())]
    Aborted {
        /// The peer.
        peer: Peer,
        /// The Close frame's payload.
        reason: Vec<u8>,
    },
    /// A data frame whose length does not fit what the receiver expects next (the peers are
    /// out of step).
    #[error(
        "{peer} sent a frame of {found} bytes where at most {expected} bytes in whole elements of {granule} bytes belong"
    )]
    UnexpectedLength {
        /// The peer.
        peer: Peer,
        /// The most bytes the receiver expected.
        expected: u64,
        /// The element size the length must be a multiple of.
        granule: u64,
        /// The frame's payload length.
        found: u64,
    },
    /// An earlier error closed this link (LINK-4).
    #[error("the link to {peer} is closed after an earlier error")]
    Broken {
        /// The peer.
        peer: Peer,
    },
    /// The operating system refused an operation.
    #[error("I/O error with {peer} while awaiting {awaiting:?}: {source}")]
    Io {
        /// The peer.
        peer: Peer,
        /// What was awaited.
        awaiting: Awaiting,
        /// The system's error.
        #[source]
        source: io::Error,
    },
}

/// The handshake payload: bincode of this struct (fixed-width integers).
#[derive(Serialize, Deserialize)]
struct Hello {
    token: [u8; 32],
    rank: u32,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// A listening socket that admits only connections that show the job token.
#[derive(Debug)]
pub struct LinkListener {
    listener: TcpListener,
    rank: Rank,
    token: JobToken,
    config: LinkConfig,
}

impl LinkListener {
    /// Binds `addr` (use port 0 for an ephemeral port) for rank `rank` of the job `token`.
    pub fn bind(
        addr: impl ToSocketAddrs,
        rank: Rank,
        token: JobToken,
        config: LinkConfig,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            rank,
            token,
            config,
        })
    }

    /// Adopts a listener bound earlier (the control plane binds one per device before the
    /// ranks and the token are known, to announce its address) for rank `rank` of the job
    /// `token`.
    pub fn from_std(
        listener: TcpListener,
        rank: Rank,
        token: JobToken,
        config: LinkConfig,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        Ok(Self {
            listener,
            rank,
            token,
            config,
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The rank this listener admits connections for.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The limits of the links it accepts.
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// The job token connections must show (to connect to the other ranks with).
    pub(crate) fn token(&self) -> &JobToken {
        &self.token
    }

    /// Waits up to the handshake time-out for one connection and runs the handshake.
    ///
    /// A connection without the token is closed, logged and returned as
    /// [`LinkError::Rejected`] (LINK-1); call `accept` again to wait for the next one.
    pub fn accept(&self) -> Result<Link, LinkError> {
        self.accept_within(self.config.handshake_timeout)
    }

    /// As [`LinkListener::accept`], but waits at most `timeout` for a connection to arrive
    /// (the handshake that follows still has the handshake time-out).
    pub fn accept_within(&self, wait: Duration) -> Result<Link, LinkError> {
        let timeout = self.config.handshake_timeout;
        let deadline = Instant::now() + wait;
        let unknown = Peer {
            addr: None,
            rank: None,
        };
        let (stream, from) = loop {
            match self.listener.accept() {
                Ok(conn) => break conn,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(LinkError::Timeout {
                            peer: unknown,
                            awaiting: Awaiting::Accept,
                            after: wait,
                        });
                    }
                    std::thread::sleep(ACCEPT_POLL);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(LinkError::Io {
                        peer: unknown,
                        awaiting: Awaiting::Accept,
                        source,
                    });
                }
            }
        };
        let peer = Peer {
            addr: Some(from),
            rank: None,
        };
        let io_err = |source| LinkError::Io {
            peer,
            awaiting: Awaiting::Hello,
            source,
        };
        // The accepted socket may inherit non-blocking mode on some platforms.
        stream.set_nonblocking(false).map_err(io_err)?;
        stream.set_nodelay(true).map_err(io_err)?;
        let mut link = Link::new(stream, self.rank, peer, self.config);

        let reject = |link: &mut Link, reason: Rejection| {
            tracing::warn!(
                %from,
                ?reason,
                rank = self.rank.0,
                "refused a data-plane connection without the job token"
            );
            link.shut_down();
            LinkError::Rejected { from, reason }
        };
        let mut payload = Vec::new();
        let hello = match link.read_frame(
            &mut payload,
            HANDSHAKE_MAX_PAYLOAD,
            Instant::now() + timeout,
            timeout,
            Awaiting::Hello,
        ) {
            Ok(header) => header,
            Err(e) => {
                let reason = match e {
                    LinkError::Frame { source, .. } => Rejection::BadFrame(source),
                    LinkError::Timeout { .. } => Rejection::HelloTimeout,
                    _ => Rejection::NoHello,
                };
                return Err(reject(&mut link, reason));
            }
        };
        if hello.kind != FrameKind::Hello || hello.seq != 0 {
            return Err(reject(&mut link, Rejection::NotHello(hello.kind)));
        }
        let hello = match bincode::serde::decode_from_slice::<Hello, _>(&payload, bincode_config())
        {
            Ok((hello, used)) if used == payload.len() => hello,
            _ => return Err(reject(&mut link, Rejection::MalformedHello)),
        };
        if !self.token.matches(&hello.token) {
            return Err(reject(&mut link, Rejection::WrongToken));
        }
        link.peer.rank = Some(Rank(hello.rank));
        let ack = bincode::serde::encode_to_vec(self.rank.0, bincode_config())
            .expect("a u32 always encodes");
        link.write_frame(FrameKind::Ack, 0, &ack, Instant::now() + timeout, timeout)?;
        link.recv_seq = 1;
        link.send_seq = 1;
        Ok(link)
    }
}

/// An authenticated connection to one peer rank. Frames are numbered per direction; every
/// call is bounded by the configured time-outs (LINK-2).
#[derive(Debug)]
pub struct Link {
    stream: TcpStream,
    rank: Rank,
    peer: Peer,
    config: LinkConfig,
    send_seq: u64,
    recv_seq: u64,
    broken: bool,
}

impl Link {
    fn new(stream: TcpStream, rank: Rank, peer: Peer, config: LinkConfig) -> Self {
        Self {
            stream,
            rank,
            peer,
            config,
            send_seq: 0,
            recv_seq: 0,
            broken: false,
        }
    }

    /// Connects to the listener of rank `expected` at `addr` as rank `rank` of the job
    /// `token`, within the handshake time-out.
    pub fn connect(
        addr: SocketAddr,
        rank: Rank,
        expected: Rank,
        token: &JobToken,
        config: LinkConfig,
    ) -> Result<Link, LinkError> {
        let timeout = config.handshake_timeout;
        let deadline = Instant::now() + timeout;
        let peer = Peer {
            addr: Some(addr),
            rank: Some(expected),
        };
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|source| {
            if is_timeout(&source) {
                LinkError::Timeout {
                    peer,
                    awaiting: Awaiting::Connect,
                    after: timeout,
                }
            } else {
                LinkError::Io {
                    peer,
                    awaiting: Awaiting::Connect,
                    source,
                }
            }
        })?;
        stream.set_nodelay(true).map_err(|source| LinkError::Io {
            peer,
            awaiting: Awaiting::Connect,
            source,
        })?;
        let mut link = Link::new(stream, rank, peer, config);
        let hello = Hello {
            token: *token.as_bytes(),
            rank: rank.0,
        };
        let hello = bincode::serde::encode_to_vec(&hello, bincode_config())
            .expect("a Hello always encodes");
        link.write_frame(FrameKind::Hello, 0, &hello, deadline, timeout)?;
        let mut payload = Vec::new();
        let ack = match link.read_frame(
            &mut payload,
            HANDSHAKE_MAX_PAYLOAD,
            deadline,
            timeout,
            Awaiting::Ack,
        ) {
            Ok(ack) => ack,
            Err(LinkError::Closed { .. } | LinkError::UnexpectedEof { .. }) => {
                return Err(LinkError::HandshakeRefused { peer });
            }
            Err(LinkError::Io { source, .. })
                if matches!(
                    source.kind(),
                    io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted
                ) =>
            {
                return Err(LinkError::HandshakeRefused { peer });
            }
            Err(e) => return Err(e),
        };
        if ack.kind != FrameKind::Ack {
            return Err(link.fail(LinkError::UnexpectedKind {
                peer,
                expected: FrameKind::Ack,
                found: ack.kind,
            }));
        }
        let found = match bincode::serde::decode_from_slice::<u32, _>(&payload, bincode_config()) {
            Ok((found, used)) if used == payload.len() => Rank(found),
            _ => {
                return Err(link.fail(LinkError::Frame {
                    peer,
                    source: FrameError::PayloadLength {
                        bytes: payload.len(),
                        expected: 1,
                        element_bytes: 4,
                    },
                }));
            }
        };
        if found != expected {
            return Err(link.fail(LinkError::WrongPeer { expected, found }));
        }
        link.recv_seq = 1;
        link.send_seq = 1;
        Ok(link)
    }

    /// This side's rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The other side: address and rank (known after the handshake).
    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// The link's limits.
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// Sends `payload` as the next data frame. Returns once the kernel has taken every byte;
    /// blocks while the peer's window is full, up to the I/O time-out (LINK-5).
    pub fn send_frame(&mut self, payload: &[u8]) -> Result<(), LinkError> {
        self.check_open()?;
        if payload.len() as u64 > self.config.max_payload {
            return Err(LinkError::PayloadTooLarge {
                len: payload.len() as u64,
                max: self.config.max_payload,
            });
        }
        let timeout = self.config.io_timeout;
        let seq = self.send_seq;
        self.write_frame(
            FrameKind::Data,
            seq,
            payload,
            Instant::now() + timeout,
            timeout,
        )?;
        self.send_seq += 1;
        Ok(())
    }

    /// Receives the next data frame's payload into `payload` (replacing its contents, reusing
    /// its allocation) and returns the frame's header. The buffer grows only after the header
    /// declared a length within the maximum (LINK-3).
    pub fn recv_frame(&mut self, payload: &mut Vec<u8>) -> Result<FrameHeader, LinkError> {
        self.check_open()?;
        let timeout = self.config.io_timeout;
        let header = self.read_frame(
            payload,
            self.config.max_payload,
            Instant::now() + timeout,
            timeout,
            Awaiting::Header,
        )?;
        let peer = self.peer;
        match header.kind {
            FrameKind::Data => {}
            FrameKind::Close => {
                return Err(self.fail(LinkError::Closed {
                    peer,
                    awaiting: Awaiting::Header,
                }));
            }
            found => {
                return Err(self.fail(LinkError::UnexpectedKind {
                    peer,
                    expected: FrameKind::Data,
                    found,
                }));
            }
        }
        if header.seq != self.recv_seq {
            let expected = self.recv_seq;
            return Err(self.fail(LinkError::OutOfSequence {
                peer,
                expected,
                found: header.seq,
            }));
        }
        self.recv_seq += 1;
        Ok(header)
    }

    /// Tells the peer nothing more will come (a [`FrameKind::Close`] frame) and closes the
    /// connection. The peer's next `recv_frame` returns [`LinkError::Closed`].
    pub fn close(mut self) -> Result<(), LinkError> {
        self.check_open()?;
        let timeout = self.config.io_timeout;
        let seq = self.send_seq;
        let result = self.write_frame(
            FrameKind::Close,
            seq,
            &[],
            Instant::now() + timeout,
            timeout,
        );
        self.shut_down();
        result
    }

    fn check_open(&self) -> Result<(), LinkError> {
        if self.broken {
            return Err(LinkError::Broken { peer: self.peer });
        }
        Ok(())
    }

    fn shut_down(&mut self) {
        self.broken = true;
        // The peer may already be gone; nothing more to do then.
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// LINK-4: the first error closes the link.
    fn fail(&mut self, error: LinkError) -> LinkError {
        self.shut_down();
        error
    }

    /// Reads one frame (any kind) before `deadline`, rejecting payloads over `max_payload`
    /// before allocating.
    fn read_frame(
        &mut self,
        payload: &mut Vec<u8>,
        max_payload: u64,
        deadline: Instant,
        timeout: Duration,
        awaiting: Awaiting,
    ) -> Result<FrameHeader, LinkError> {
        let mut header = [0u8; HEADER_LEN];
        match self.read_exact_by(&mut header, deadline) {
            Ok(()) => {}
            Err(ReadFailure::Eof { got: 0 }) => {
                return Err(self.fail(LinkError::Closed {
                    peer: self.peer,
                    awaiting,
                }));
            }
            Err(failure) => {
                return Err(self.read_failure(failure, awaiting, HEADER_LEN as u64, timeout));
            }
        }
        let header = match frame::decode_header(&header, max_payload) {
            Ok(header) => header,
            Err(source) => {
                let peer = self.peer;
                return Err(self.fail(LinkError::Frame { peer, source }));
            }
        };
        // decode_header bounded payload_len by max_payload: allocating it is now safe.
        let Ok(len) = usize::try_from(header.payload_len) else {
            let peer = self.peer;
            return Err(self.fail(LinkError::Frame {
                peer,
                source: FrameError::TooLarge {
                    declared: header.payload_len,
                    max: max_payload,
                },
            }));
        };
        payload.clear();
        payload.resize(len, 0);
        let awaiting = Awaiting::Payload { seq: header.seq };
        if let Err(failure) = self.read_exact_by(payload, deadline) {
            return Err(self.read_failure(failure, awaiting, header.payload_len, timeout));
        }
        if let Err(source) = frame::check_payload(&header, payload) {
            let peer = self.peer;
            return Err(self.fail(LinkError::Frame { peer, source }));
        }
        Ok(header)
    }

    fn read_failure(
        &mut self,
        failure: ReadFailure,
        awaiting: Awaiting,
        expected: u64,
        timeout: Duration,
    ) -> LinkError {
        let peer = self.peer;
        let error = match failure {
            ReadFailure::Eof { got } => LinkError::UnexpectedEof {
                peer,
                awaiting,
                got,
                expected,
            },
            ReadFailure::Timeout => LinkError::Timeout {
                peer,
                awaiting,
                after: timeout,
            },
            ReadFailure::Io(source) => LinkError::Io {
                peer,
                awaiting,
                source,
            },
        };
        self.fail(error)
    }

    /// Fills `buf` before `deadline`: the socket's read time-out is set to what is left before
    /// each read, so the whole call is bounded (LINK-2).
    fn read_exact_by(&mut self, buf: &mut [u8], deadline: Instant) -> Result<(), ReadFailure> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadFailure::Timeout);
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(ReadFailure::Io)?;
            match self.stream.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(ReadFailure::Eof { got: filled as u64 });
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => return Err(ReadFailure::Timeout),
                Err(e) => return Err(ReadFailure::Io(e)),
            }
        }
        Ok(())
    }

    /// Writes header and payload before `deadline`, without copying the payload.
    fn write_frame(
        &mut self,
        kind: FrameKind,
        seq: u64,
        payload: &[u8],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), LinkError> {
        self.check_open()?;
        let header = frame::encode_header(kind, seq, payload);
        let mut parts = [IoSlice::new(&header), IoSlice::new(payload)];
        let mut parts = &mut parts[..];
        let peer = self.peer;
        let awaiting = Awaiting::Send { seq };
        while !parts.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            let result = if left.is_zero() {
                Err(io::Error::from(io::ErrorKind::TimedOut))
            } else {
                self.stream
                    .set_write_timeout(Some(left))
                    .and_then(|()| self.stream.write_vectored(parts))
            };
            match result {
                Ok(0) => {
                    return Err(self.fail(LinkError::Closed { peer, awaiting }));
                }
                Ok(n) => IoSlice::advance_slices(&mut parts, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => {
                    return Err(self.fail(LinkError::Timeout {
                        peer,
                        awaiting,
                        after: timeout,
                    }));
                }
                Err(source) => {
                    return Err(self.fail(LinkError::Io {
                        peer,
                        awaiting,
                        source,
                    }));
                }
            }
        }
        Ok(())
    }
}

/// How a bounded read ended early.
enum ReadFailure {
    Eof { got: u64 },
    Timeout,
    Io(io::Error),
}

/// A socket time-out shows as `WouldBlock` on Unix and `TimedOut` on Windows.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
