//! A [`Link`] split into a sending half and a receiving half, for a transport that sends on
//! one thread while it receives on another (so two ranks sending to each other at once never
//! both block in a send), plus a [`LinkCloser`] that shuts the connection down from any
//! thread.
//!
//! The halves keep the link's rules: frames numbered per direction, every wait bounded, here
//! by a deadline the caller passes (LINK-2: a collective's deadline, not the link's I/O
//! time-out), and the first error shuts the whole connection down (LINK-4). The receiving half
//! can stream a payload into the caller's memory piece by piece ([`LinkReader::recv_into`]),
//! checking the payload crc as the pieces arrive, so a receiver needs no buffer of a frame's
//! size.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use super::{Awaiting, Link, LinkError, Peer, is_timeout};
use crate::comm::net::frame::{self, FrameError, FrameHeader, FrameKind, HEADER_LEN};

/// Bytes read per piece by [`LinkReader::recv_into`]: small enough that a piece is still in
/// the cache when the sink reduces it.
const PIECE: usize = 128 << 10;

/// The largest reason a [`FrameKind::Close`] frame may carry.
const MAX_REASON: u64 = 64 << 10;

/// How far a socket's time-out may drift from the time left before it is set again: a read
/// or write blocks at most this much past its deadline, and a transfer sets the time-out about
/// once per this much time, not once per system call.
const SLACK: Duration = Duration::from_millis(10);

/// Where [`LinkReader::recv_into`] puts a payload, piece by piece.
pub trait PayloadSink {
    /// The buffer that payload bytes `offset..offset + len` are read into (exactly `len`
    /// bytes long).
    fn piece(&mut self, offset: usize, len: usize) -> &mut [u8];
    /// Bytes `offset..offset + len` have arrived in the buffer [`PayloadSink::piece`] gave.
    /// (The payload crc is checked only after the last piece: on a checksum error the sink has
    /// seen bytes that turned out bad, and the caller must treat what it built as garbage.)
    fn arrived(&mut self, offset: usize, len: usize);
}

impl Link {
    /// Splits the link into its sending half, its receiving half and a closer. Fails if the
    /// link is already broken or the operating system cannot duplicate the socket.
    pub fn split(self) -> Result<(LinkWriter, LinkReader, LinkCloser), LinkError> {
        self.check_open()?;
        let peer = self.peer;
        let clone = |stream: &TcpStream| {
            stream.try_clone().map_err(|source| LinkError::Io {
                peer,
                awaiting: Awaiting::Header,
                source,
            })
        };
        let read = clone(&self.stream)?;
        let closer = clone(&self.stream)?;
        let max_payload = self.config.max_payload;
        Ok((
            LinkWriter {
                stream: self.stream,
                peer,
                max_payload,
                seq: self.send_seq,
                armed: None,
                broken: false,
            },
            LinkReader {
                stream: read,
                peer,
                max_payload,
                seq: self.recv_seq,
                armed: None,
                broken: false,
            },
            LinkCloser {
                stream: closer,
                peer,
            },
        ))
    }
}

/// Shuts a link's connection down from any thread: a read or write blocked on it returns at
/// once, and the peer sees the connection end.
#[derive(Debug)]
pub struct LinkCloser {
    stream: TcpStream,
    peer: Peer,
}

impl LinkCloser {
    /// Shuts both directions down (idempotent).
    pub fn shutdown(&self) {
        // The peer may already be gone; nothing more to do then.
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// The other side.
    pub fn peer(&self) -> Peer {
        self.peer
    }
}

/// The sending half of a link.
#[derive(Debug)]
pub struct LinkWriter {
    stream: TcpStream,
    peer: Peer,
    max_payload: u64,
    seq: u64,
    armed: Option<Duration>,
    broken: bool,
}

impl LinkWriter {
    /// The other side.
    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// The largest payload one frame may carry.
    pub fn max_payload(&self) -> u64 {
        self.max_payload
    }

    /// Sends `payload` as the next data frame, straight from the caller's memory (no copy).
    /// Returns once the kernel took every byte; blocks while the peer's window is full, until
    /// `deadline` (LINK-5).
    pub fn send(&mut self, payload: &[u8], deadline: Instant) -> Result<(), LinkError> {
        if payload.len() as u64 > self.max_payload {
            return Err(LinkError::PayloadTooLarge {
                len: payload.len() as u64,
                max: self.max_payload,
            });
        }
        self.write_frame(FrameKind::Data, payload, deadline)
    }

    /// Sends a [`FrameKind::Close`] frame carrying `reason` (at most 64 KiB), then shuts the
    /// connection down. The peer's next receive returns [`LinkError::Aborted`] with the
    /// reason.
    pub fn abort(mut self, reason: &[u8], deadline: Instant) -> Result<(), LinkError> {
        let reason = &reason[..reason.len().min(MAX_REASON as usize)];
        let result = self.write_frame(FrameKind::Close, reason, deadline);
        self.shut_down();
        result
    }

    fn shut_down(&mut self) {
        self.broken = true;
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn write_frame(
        &mut self,
        kind: FrameKind,
        payload: &[u8],
        deadline: Instant,
    ) -> Result<(), LinkError> {
        if self.broken {
            return Err(LinkError::Broken { peer: self.peer });
        }
        let seq = self.seq;
        let header = frame::encode_header(kind, seq, payload);
        let mut parts = [IoSlice::new(&header), IoSlice::new(payload)];
        let mut parts = &mut parts[..];
        let peer = self.peer;
        let awaiting = Awaiting::Send { seq };
        let started = Instant::now();
        while !parts.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            let result = if left.is_zero() {
                Err(io::Error::from(io::ErrorKind::TimedOut))
            } else if needs_arming(self.armed, left) {
                self.armed = Some(left);
                self.stream
                    .set_write_timeout(Some(left))
                    .and_then(|()| self.stream.write_vectored(parts))
            } else {
                self.stream.write_vectored(parts)
            };
            match result {
                Ok(0) => {
                    self.shut_down();
                    return Err(LinkError::Closed { peer, awaiting });
                }
                Ok(n) => IoSlice::advance_slices(&mut parts, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The socket's time-out may be shorter than what is left: try again.
                Err(e) if is_timeout(&e) && Instant::now() < deadline => {}
                Err(e) if is_timeout(&e) => {
                    self.shut_down();
                    return Err(LinkError::Timeout {
                        peer,
                        awaiting,
                        after: started.elapsed(),
                    });
                }
                Err(source) => {
                    self.shut_down();
                    return Err(LinkError::Io {
                        peer,
                        awaiting,
                        source,
                    });
                }
            }
        }
        self.seq += 1;
        Ok(())
    }
}

/// Whether a socket time-out set to `armed` must be set again for a wait of `left`.
fn needs_arming(armed: Option<Duration>, left: Duration) -> bool {
    armed.is_none_or(|armed| armed > left + SLACK || armed + SLACK < left)
}

/// How a bounded read ended early.
enum ReadFailure {
    Eof { got: u64 },
    Timeout,
    Io(io::Error),
}

/// The receiving half of a link.
#[derive(Debug)]
pub struct LinkReader {
    stream: TcpStream,
    peer: Peer,
    max_payload: u64,
    seq: u64,
    armed: Option<Duration>,
    broken: bool,
}

impl LinkReader {
    /// The other side.
    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// Receives the next data frame whole into `payload` (replacing its contents, reusing its
    /// allocation); a frame of more than `max_len` bytes is refused from its header, before
    /// anything is allocated (LINK-3). Meant for small frames.
    pub fn recv(
        &mut self,
        payload: &mut Vec<u8>,
        max_len: u64,
        deadline: Instant,
    ) -> Result<FrameHeader, LinkError> {
        let started = Instant::now();
        let header = self.next_data_header(max_len, 1, deadline, started)?;
        // Bounded by max_len and the link's maximum: allocating it is safe.
        let len = header.payload_len as usize;
        payload.clear();
        payload.resize(len, 0);
        self.read_payload(payload, &header, deadline, started)?;
        if let Err(source) = frame::check_payload(&header, payload) {
            return Err(self.fail(LinkError::Frame {
                peer: self.peer,
                source,
            }));
        }
        Ok(header)
    }

    /// Receives the next data frame into `sink`, piece by piece, and returns its payload
    /// length. The frame must carry at most `max_len` bytes, a whole number of `granule`-byte
    /// elements (else [`LinkError::UnexpectedLength`], checked from the header).
    pub fn recv_into(
        &mut self,
        max_len: u64,
        granule: u64,
        sink: &mut dyn PayloadSink,
        deadline: Instant,
    ) -> Result<u64, LinkError> {
        let started = Instant::now();
        let header = self.next_data_header(max_len, granule, deadline, started)?;
        let len = header.payload_len as usize;
        let granule = usize::try_from(granule.max(1)).unwrap_or(1);
        let piece = (PIECE - PIECE % granule).max(granule);
        let mut crc = crc32fast::Hasher::new();
        let mut offset = 0;
        while offset < len {
            let n = piece.min(len - offset);
            let buf = sink.piece(offset, n);
            self.read_payload(buf, &header, deadline, started)?;
            crc.update(buf);
            sink.arrived(offset, n);
            offset += n;
        }
        let computed = crc.finalize();
        if computed != header.payload_crc {
            return Err(self.fail(LinkError::Frame {
                peer: self.peer,
                source: FrameError::PayloadChecksum {
                    seq: header.seq,
                    declared: header.payload_crc,
                    computed,
                },
            }));
        }
        Ok(header.payload_len)
    }

    fn fail(&mut self, error: LinkError) -> LinkError {
        self.broken = true;
        let _ = self.stream.shutdown(Shutdown::Both);
        error
    }

    /// Reads headers until a data frame's: checks its kind, sequence number and length. A
    /// Close frame ends the link ([`LinkError::Closed`], or [`LinkError::Aborted`] with its
    /// reason).
    fn next_data_header(
        &mut self,
        max_len: u64,
        granule: u64,
        deadline: Instant,
        started: Instant,
    ) -> Result<FrameHeader, LinkError> {
        if self.broken {
            return Err(LinkError::Broken { peer: self.peer });
        }
        let peer = self.peer;
        let mut bytes = [0u8; HEADER_LEN];
        match self.read_exact_by(&mut bytes, deadline) {
            Ok(()) => {}
            Err(ReadFailure::Eof { got: 0 }) => {
                return Err(self.fail(LinkError::Closed {
                    peer,
                    awaiting: Awaiting::Header,
                }));
            }
            Err(failure) => {
                return Err(self.read_failure(
                    failure,
                    Awaiting::Header,
                    HEADER_LEN as u64,
                    started,
                ));
            }
        }
        let header = match frame::decode_header(&bytes, self.max_payload) {
            Ok(header) => header,
            Err(source) => return Err(self.fail(LinkError::Frame { peer, source })),
        };
        match header.kind {
            FrameKind::Data => {}
            FrameKind::Close if header.payload_len == 0 => {
                return Err(self.fail(LinkError::Closed {
                    peer,
                    awaiting: Awaiting::Header,
                }));
            }
            FrameKind::Close if header.payload_len <= MAX_REASON => {
                let mut reason = vec![0u8; header.payload_len as usize];
                self.read_payload(&mut reason, &header, deadline, started)?;
                let error = match frame::check_payload(&header, &reason) {
                    Ok(()) => LinkError::Aborted { peer, reason },
                    Err(source) => LinkError::Frame { peer, source },
                };
                return Err(self.fail(error));
            }
            FrameKind::Close => {
                return Err(self.fail(LinkError::Frame {
                    peer,
                    source: FrameError::TooLarge {
                        declared: header.payload_len,
                        max: MAX_REASON,
                    },
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
        if header.seq != self.seq {
            let expected = self.seq;
            return Err(self.fail(LinkError::OutOfSequence {
                peer,
                expected,
                found: header.seq,
            }));
        }
        if header.payload_len > max_len || header.payload_len % granule.max(1) != 0 {
            return Err(self.fail(LinkError::UnexpectedLength {
                peer,
                expected: max_len,
                granule: granule.max(1),
                found: header.payload_len,
            }));
        }
        self.seq += 1;
        Ok(header)
    }

    fn read_payload(
        &mut self,
        buf: &mut [u8],
        header: &FrameHeader,
        deadline: Instant,
        started: Instant,
    ) -> Result<(), LinkError> {
        self.read_exact_by(buf, deadline).map_err(|failure| {
            self.read_failure(
                failure,
                Awaiting::Payload { seq: header.seq },
                header.payload_len,
                started,
            )
        })
    }

    fn read_failure(
        &mut self,
        failure: ReadFailure,
        awaiting: Awaiting,
        expected: u64,
        started: Instant,
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
                after: started.elapsed(),
            },
            ReadFailure::Io(source) => LinkError::Io {
                peer,
                awaiting,
                source,
            },
        };
        self.fail(error)
    }

    /// Fills `buf` before `deadline` (LINK-2).
    fn read_exact_by(&mut self, buf: &mut [u8], deadline: Instant) -> Result<(), ReadFailure> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ReadFailure::Timeout);
            }
            if needs_arming(self.armed, left) {
                self.armed = Some(left);
                self.stream
                    .set_read_timeout(Some(left))
                    .map_err(ReadFailure::Io)?;
            }
            match self.stream.read(&mut buf[filled..]) {
                Ok(0) => return Err(ReadFailure::Eof { got: filled as u64 }),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // The loop checks the deadline: a socket time-out shorter than it retries.
                Err(e) if is_timeout(&e) => {}
                Err(e) => return Err(ReadFailure::Io(e)),
            }
        }
        Ok(())
    }
}
