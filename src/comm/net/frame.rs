//! The data plane's wire format: one frame is a fixed-size header followed by its payload.
//! Pure: no sockets, no threads; [`super::link`] moves frames over TCP.
//!
//! # Layout (protocol version 1)
//!
//! | bytes | field | meaning |
//! |---|---|---|
//! | 0..4 | magic | `b"MWDP"` |
//! | 4..6 | version | [`PROTOCOL_VERSION`], little-endian `u16` |
//! | 6 | kind | [`FrameKind`] as a byte |
//! | 7..15 | seq | sequence number of the frame in its direction, `u64` |
//! | 15..23 | payload length | bytes that follow the header, `u64` |
//! | 23..27 | payload crc | crc32 (IEEE) of the payload |
//! | 27..31 | header crc | crc32 of bytes 0..27 |
//!
//! The header is encoded with bincode 2 (fixed-width little-endian integers), so its length is
//! the constant [`HEADER_LEN`]. The payload is raw bytes: an `f32` buffer travels as its
//! little-endian bytes ([`put_f32s`], [`get_f32s`]), with no per-element encoding.
//!
//! # Invariants (tests name the id they check)
//!
//! - FRAME-1: [`encode`] then [`decode`] gives back the kind, sequence number and payload.
//! - FRAME-2: a declared payload length over the decoder's maximum is rejected from the header
//!   alone, before any buffer of that size is allocated.
//! - FRAME-3: every byte of a frame is covered by a check: the magic and version are compared,
//!   the rest of the header by the header crc, the payload by the payload crc. A frame with
//!   any single byte changed is rejected.
//! - FRAME-4: a frame cut short anywhere is rejected ([`FrameError::Truncated`]), never read as
//!   a shorter frame.
//! - FRAME-5: no input makes the decoder panic; every rejection is a typed [`FrameError`].
//! - FRAME-6: magic and version sit at fixed offsets and are checked before anything else, so
//!   a peer speaking another version gets [`FrameError::UnsupportedVersion`], not a checksum
//!   error.

use serde::{Deserialize, Serialize};

#[cfg(test)]
mod tests;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MWDP";

/// The protocol version this build speaks; a frame of any other version is rejected.
pub const PROTOCOL_VERSION: u16 = 1;

/// Bytes in a frame header (fixed for a protocol version).
pub const HEADER_LEN: usize = 31;

/// Bytes of the header covered by the header crc (everything before it).
const HEADER_CRC_OFFSET: usize = HEADER_LEN - 4;

/// The default largest payload a decoder accepts: 64 MiB.
pub const DEFAULT_MAX_PAYLOAD: u64 = 64 << 20;

/// What a frame is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FrameKind {
    /// The connecting side's handshake: job token and rank.
    Hello,
    /// The accepting side's answer to a valid [`FrameKind::Hello`]: its rank.
    Ack,
    /// Bulk bytes of a collective or point-to-point op.
    Data,
    /// The sender will send nothing more on this connection.
    Close,
}

impl FrameKind {
    /// Every kind, in wire order.
    pub const ALL: [FrameKind; 4] = [Self::Hello, Self::Ack, Self::Data, Self::Close];

    /// The byte that stands for this kind on the wire.
    pub fn to_byte(self) -> u8 {
        match self {
            Self::Hello => 1,
            Self::Ack => 2,
            Self::Data => 3,
            Self::Close => 4,
        }
    }

    /// The kind a wire byte stands for, if any.
    pub fn from_byte(byte: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.to_byte() == byte)
    }
}

/// Why bytes were not accepted as a frame. Every variant means the connection that carried
/// them can no longer be trusted and is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`MAGIC`]: not a meshwork data-plane peer.
    #[error("bad magic {found:02x?}: not a meshwork data-plane frame")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The frame is of a protocol version this build does not speak.
    #[error("protocol version {found} is not supported (this build speaks {supported})")]
    UnsupportedVersion {
        /// The version in the frame.
        found: u16,
        /// [`PROTOCOL_VERSION`].
        supported: u16,
    },
    /// The header's crc does not match its bytes.
    #[error("header checksum mismatch: declared {declared:#010x}, computed {computed:#010x}")]
    HeaderChecksum {
        /// The crc in the header.
        declared: u32,
        /// The crc of the header bytes received.
        computed: u32,
    },
    /// The header bytes do not decode (cannot happen for bytes that pass the header crc,
    /// kept so a decoding failure is never a panic).
    #[error("malformed frame header: {detail}")]
    MalformedHeader {
        /// The decoder's account, for people.
        detail: String,
    },
    /// The kind byte names no [`FrameKind`].
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The declared payload is larger than the decoder accepts (checked before allocating).
    #[error("frame declares {declared} payload bytes, more than the maximum of {max}")]
    TooLarge {
        /// The length in the header.
        declared: u64,
        /// The decoder's maximum.
        max: u64,
    },
    /// The payload's crc does not match its bytes.
    #[error(
        "payload checksum mismatch in frame {seq}: declared {declared:#010x}, computed {computed:#010x}"
    )]
    PayloadChecksum {
        /// The frame's sequence number.
        seq: u64,
        /// The crc in the header.
        declared: u32,
        /// The crc of the payload received.
        computed: u32,
    },
    /// The input ended inside a frame.
    #[error("frame ends early: {got} of {expected} bytes")]
    Truncated {
        /// Bytes the frame needs (header, or header plus declared payload).
        expected: u64,
        /// Bytes there were.
        got: u64,
    },
    /// A payload's length is not a whole number of elements of the expected type.
    #[error("payload of {bytes} bytes does not hold {expected} elements of {element_bytes} bytes")]
    PayloadLength {
        /// Bytes in the payload.
        bytes: usize,
        /// Elements expected.
        expected: usize,
        /// Bytes per element.
        element_bytes: usize,
    },
}

/// A decoded, checked header: what the payload that follows must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame is for.
    pub kind: FrameKind,
    /// The frame's sequence number in its direction.
    pub seq: u64,
    /// Payload bytes that follow the header (at most the decoder's maximum).
    pub payload_len: u64,
    /// crc32 of the payload.
    pub payload_crc: u32,
}

/// A whole frame, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// What the frame is for.
    pub kind: FrameKind,
    /// The frame's sequence number in its direction.
    pub seq: u64,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

/// The header as bincode sees it; the field order is the wire order.
#[derive(Serialize, Deserialize)]
struct WireHeader {
    magic: [u8; 4],
    version: u16,
    kind: u8,
    seq: u64,
    payload_len: u64,
    payload_crc: u32,
    header_crc: u32,
}

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_fixed_int_encoding()
}

/// The header of a frame of `kind` numbered `seq` that carries `payload`. Write it, then the
/// payload, to send the frame without copying the payload.
pub fn encode_header(kind: FrameKind, seq: u64, payload: &[u8]) -> [u8; HEADER_LEN] {
    let wire = WireHeader {
        magic: MAGIC,
        version: PROTOCOL_VERSION,
        kind: kind.to_byte(),
        seq,
        payload_len: payload.len() as u64,
        payload_crc: crc32fast::hash(payload),
        header_crc: 0,
    };
    let mut bytes = [0u8; HEADER_LEN];
    let written = bincode::serde::encode_into_slice(&wire, &mut bytes, bincode_config())
        .expect("a WireHeader is exactly HEADER_LEN bytes with fixed-width integers");
    debug_assert_eq!(written, HEADER_LEN);
    let header_crc = crc32fast::hash(&bytes[..HEADER_CRC_OFFSET]);
    bytes[HEADER_CRC_OFFSET..].copy_from_slice(&header_crc.to_le_bytes());
    bytes
}

/// A whole frame (header then payload) in one buffer.
pub fn encode(kind: FrameKind, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&encode_header(kind, seq, payload));
    out.extend_from_slice(payload);
    out
}

/// Checks a header and returns what it declares. Rejects a payload length over
/// `max_payload` (FRAME-2), so the caller may then allocate `payload_len` bytes.
pub fn decode_header(
    bytes: &[u8; HEADER_LEN],
    max_payload: u64,
) -> Result<FrameHeader, FrameError> {
    // FRAME-6: magic and version first, at fixed offsets.
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != PROTOCOL_VERSION {
        return Err(FrameError::UnsupportedVersion {
            found: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let (wire, _): (WireHeader, usize) = bincode::serde::decode_from_slice(bytes, bincode_config())
        .map_err(|e| FrameError::MalformedHeader {
            detail: e.to_string(),
        })?;
    let computed = crc32fast::hash(&bytes[..HEADER_CRC_OFFSET]);
    if wire.header_crc != computed {
        return Err(FrameError::HeaderChecksum {
            declared: wire.header_crc,
            computed,
        });
    }
    let kind = FrameKind::from_byte(wire.kind).ok_or(FrameError::UnknownKind(wire.kind))?;
    if wire.payload_len > max_payload {
        return Err(FrameError::TooLarge {
            declared: wire.payload_len,
            max: max_payload,
        });
    }
    Ok(FrameHeader {
        kind,
        seq: wire.seq,
        payload_len: wire.payload_len,
        payload_crc: wire.payload_crc,
    })
}

/// Checks a received payload against its header (length and crc).
pub fn check_payload(header: &FrameHeader, payload: &[u8]) -> Result<(), FrameError> {
    if payload.len() as u64 != header.payload_len {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN as u64 + header.payload_len,
            got: (HEADER_LEN + payload.len()) as u64,
        });
    }
    let computed = crc32fast::hash(payload);
    if computed != header.payload_crc {
        return Err(FrameError::PayloadChecksum {
            seq: header.seq,
            declared: header.payload_crc,
            computed,
        });
    }
    Ok(())
}

/// Decodes the frame at the start of `input`; returns it and the bytes it took. Bytes after
/// the frame are left alone (they are the next frame's). Input that ends inside the frame is
/// [`FrameError::Truncated`].
pub fn decode(input: &[u8], max_payload: u64) -> Result<(Frame, usize), FrameError> {
    let Some(header_bytes) = input.first_chunk::<HEADER_LEN>() else {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN as u64,
            got: input.len() as u64,
        });
    };
    let header = decode_header(header_bytes, max_payload)?;
    let rest = &input[HEADER_LEN..];
    // payload_len <= max_payload, but max_payload may exceed usize on a small target.
    let len = usize::try_from(header.payload_len).map_err(|_| FrameError::TooLarge {
        declared: header.payload_len,
        max: max_payload,
    })?;
    let Some(payload) = rest.get(..len) else {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN as u64 + header.payload_len,
            got: input.len() as u64,
        });
    };
    check_payload(&header, payload)?;
    let frame = Frame {
        kind: header.kind,
        seq: header.seq,
        payload: payload.to_vec(),
    };
    Ok((frame, HEADER_LEN + len))
}

/// An incremental decoder: feed it bytes as they arrive ([`FrameDecoder::extend`]), take
/// frames out as they complete ([`FrameDecoder::next_frame`]).
///
/// A header is checked as soon as its last byte arrives, so an oversize or corrupt frame is
/// rejected before its payload is buffered. The decoder buffers what it is given: a caller
/// that takes frames out after each `extend` holds at most one frame (header plus
/// `max_payload`) plus the bytes of that `extend`.
#[derive(Debug)]
pub struct FrameDecoder {
    max_payload: u64,
    buffer: Vec<u8>,
}

impl FrameDecoder {
    /// A decoder that rejects payloads over `max_payload` bytes.
    pub fn new(max_payload: u64) -> Self {
        Self {
            max_payload,
            buffer: Vec::new(),
        }
    }

    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// Bytes received but not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed, or why the bytes are not
    /// a frame. After an error the decoder's state is unspecified; drop it with the connection.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let Some(header_bytes) = self.buffer.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let header = decode_header(header_bytes, self.max_payload)?;
        let needed = HEADER_LEN as u64 + header.payload_len;
        if (self.buffer.len() as u64) < needed {
            return Ok(None);
        }
        let (frame, used) = decode(&self.buffer, self.max_payload)?;
        self.buffer.drain(..used);
        Ok(Some(frame))
    }

    /// Declares the input finished: returns the complete frames still buffered, or an error
    /// if the input ended inside a frame (FRAME-4).
    pub fn finish(mut self) -> Result<Vec<Frame>, FrameError> {
        let mut frames = Vec::new();
        while let Some(frame) = self.next_frame()? {
            frames.push(frame);
        }
        if self.buffer.is_empty() {
            return Ok(frames);
        }
        // Incomplete: decode says how much was missing. (It cannot succeed here, since
        // next_frame takes every complete frame out; no panic either way.)
        let got = self.buffer.len() as u64;
        match decode(&self.buffer, self.max_payload) {
            Err(e) => Err(e),
            Ok((_, used)) => Err(FrameError::Truncated {
                expected: used as u64,
                got,
            }),
        }
    }
}

/// Appends `values` to `out` as their little-endian bytes (the payload form of an `f32`
/// buffer).
pub fn put_f32s(values: &[f32], out: &mut Vec<u8>) {
    out.reserve(values.len() * 4);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Reads a payload of little-endian `f32`s into `out`; its length must be exactly
/// `out.len() * 4` bytes.
pub fn get_f32s(payload: &[u8], out: &mut [f32]) -> Result<(), FrameError> {
    if payload.len() != out.len() * 4 {
        return Err(FrameError::PayloadLength {
            bytes: payload.len(),
            expected: out.len(),
            element_bytes: 4,
        });
    }
    for (v, bytes) in out.iter_mut().zip(payload.chunks_exact(4)) {
        *v = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    }
    Ok(())
}

/// Maximum payload used by [`exercise_decoder`]: small, so arbitrary inputs also reach the
/// over-the-maximum path.
pub const FUZZ_MAX_PAYLOAD: u64 = 4096;

/// The body of the `frame_decoder` fuzz target, shared with the test that replays its corpus:
/// whole-buffer and incremental decoding of arbitrary bytes must give a frame or a typed error,
/// never a panic (FRAME-5), and an accepted frame must re-encode to the bytes it came from.
/// Panics (the fuzzer's signal) when that does not hold.
pub fn exercise_decoder(data: &[u8]) {
    if let Ok((frame, used)) = decode(data, FUZZ_MAX_PAYLOAD) {
        assert_eq!(encode(frame.kind, frame.seq, &frame.payload), &data[..used]);
    }
    // The same bytes fed in pieces whose sizes come from the first byte.
    let piece = usize::from(data.first().copied().unwrap_or(1).max(1));
    let mut decoder = FrameDecoder::new(FUZZ_MAX_PAYLOAD);
    for chunk in data.chunks(piece) {
        decoder.extend(chunk);
        loop {
            match decoder.next_frame() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
}
