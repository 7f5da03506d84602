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

mod errors;
mod halves;
mod listener;
#[cfg(test)]
mod tests;

pub use errors::{Awaiting, LinkError, Peer, Rejection};
pub use halves::{LinkCloser, LinkReader, LinkWriter, PayloadSink};
pub use listener::LinkListener;
use listener::{Hello, bincode_config};

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
