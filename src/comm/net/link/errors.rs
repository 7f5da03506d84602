//! What a link reports: the peer it names, what it was waiting for, why a handshake was
//! refused, and [`LinkError`].

use super::*;

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
