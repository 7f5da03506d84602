//! Pipeline links to stages in other processes: each packet (micro-batch, direction of data,
//! boundary tensors) as one message of bytes over a [`PacketWire`] (the TCP data plane in
//! `cluster::remote`), with no per-element encoding: dims, then the `f32` values as they lie.
//!
//! One connection to a peer may carry both directions of data (an interleaved schedule with
//! two stages sends activations and gradients the same way round the ring), so a receive
//! that reads a packet of the other direction keeps it for the receive that wants it, in
//! order. How many it keeps is bounded by what the schedule sends in a step, and by
//! [`MAX_EARLY`] whatever a peer sends.
//!
//! - WIRE-1: decoding never panics and never allocates more than the bytes it was given
//!   justify: every declared length is checked against what is left before it is read.
//! - WIRE-2: `decode_packet(encode_packet(p)) == p` for every packet.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{ExecError, Flow, Packet, WireTensor};

/// The version byte every packet starts with.
const PACKET_VERSION: u8 = 1;

/// The most packets a receive keeps for the other direction of data before it calls the peer
/// broken (a correct schedule keeps at most its micro-batches × chunks).
pub(crate) const MAX_EARLY: usize = 4096;

/// Why a connection to a stage in another process failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Nothing (or not everything) moved before the deadline.
    #[error("timed out")]
    TimedOut,
    /// The connection is gone (the peer closed it, its process died, the job aborted, a bad
    /// frame); the transport's words.
    #[error("{0}")]
    Broken(String),
    /// The transport cannot carry this packet (larger than its largest frame): this stage's
    /// fault, not the peer's.
    #[error("{0}")]
    Refused(String),
}

/// One end of a connection to a stage in another process, carrying whole packets as bytes.
/// Both calls are bounded by `deadline`; after an error the connection is unusable. Closing
/// it from another thread (the job's abort) must wake a blocked call.
pub(crate) trait PacketWire: Send + Sync + std::fmt::Debug {
    /// Sends one packet's bytes; returns once the transport took them.
    fn send(&self, bytes: &[u8], deadline: Instant) -> Result<(), WireError>;
    /// Receives the next packet's bytes into `bytes` (replacing its contents).
    fn recv(&self, bytes: &mut Vec<u8>, deadline: Instant) -> Result<(), WireError>;
}

/// Why bytes are not a packet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PacketError {
    /// The bytes end before what they declare.
    #[error("the packet ends after {got} bytes, inside its {what}")]
    Truncated {
        /// Bytes there were.
        got: usize,
        /// What was being read.
        what: &'static str,
    },
    /// An unknown version byte.
    #[error("packet version {0} (this build reads {PACKET_VERSION})")]
    Version(u8),
    /// An unknown direction byte.
    #[error("direction byte {0} is neither activation (0) nor gradient (1)")]
    Direction(u8),
    /// A tensor of rank outside 1..=4.
    #[error("a tensor of rank {0}: ranks 1 to 4 cross a stage boundary")]
    Rank(u8),
    /// A tensor whose element count overflows.
    #[error("a tensor of dims {0:?} has more elements than memory")]
    Dims(Vec<u64>),
    /// Bytes left after the last tensor.
    #[error("{0} bytes after the last tensor")]
    Trailing(usize),
}

fn flow_byte(flow: Flow) -> u8 {
    match flow {
        Flow::Activation => 0,
        Flow::Gradient => 1,
    }
}

/// The bytes of `packet` travelling in direction `flow` (little-endian: version, direction,
/// micro-batch, tensor count, then per tensor its rank, dims and values).
pub(super) fn encode_packet(flow: Flow, packet: &Packet) -> Vec<u8> {
    let size = 10
        + packet
            .tensors
            .iter()
            .map(|t| 1 + 8 * t.dims.len() + 4 * t.values.len())
            .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.push(PACKET_VERSION);
    out.push(flow_byte(flow));
    out.extend_from_slice(&packet.mb.to_le_bytes());
    out.extend_from_slice(&(packet.tensors.len() as u32).to_le_bytes());
    for t in &packet.tensors {
        out.push(t.dims.len() as u8);
        for &d in &t.dims {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        for v in &t.values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// Reads bytes from the front of a slice, each read checked against what is left.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], PacketError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or(PacketError::Truncated {
                got: self.bytes.len(),
                what,
            })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, PacketError> {
        Ok(self.take(1, what)?[0])
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, PacketError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, PacketError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }
}

/// The packet in `bytes`, and its direction (WIRE-1).
pub(super) fn decode_packet(bytes: &[u8]) -> Result<(Flow, Packet), PacketError> {
    let mut r = Reader { bytes, at: 0 };
    let version = r.u8("header")?;
    if version != PACKET_VERSION {
        return Err(PacketError::Version(version));
    }
    let flow = match r.u8("header")? {
        0 => Flow::Activation,
        1 => Flow::Gradient,
        other => return Err(PacketError::Direction(other)),
    };
    let mb = r.u32("header")?;
    let count = r.u32("header")? as usize;
    // Every tensor takes at least its rank byte: a count beyond the bytes left is a lie.
    if count > r.left() {
        return Err(PacketError::Truncated {
            got: bytes.len(),
            what: "tensor list",
        });
    }
    // A tensor takes at least its rank byte and one dimension: never reserve more than that.
    let mut tensors = Vec::with_capacity(count.min(r.left() / 9));
    for _ in 0..count {
        let rank = r.u8("tensor rank")?;
        if !(1..=4).contains(&rank) {
            return Err(PacketError::Rank(rank));
        }
        let dims: Vec<u64> = (0..rank)
            .map(|_| r.u64("tensor dims"))
            .collect::<Result<_, _>>()?;
        let elems = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| n.checked_mul(4).is_some())
            .ok_or_else(|| PacketError::Dims(dims.clone()))?;
        let raw = r.take(elems * 4, "tensor values")?;
        let values = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let dims = dims
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| PacketError::Dims(dims.clone())))
            .collect::<Result<_, _>>()?;
        tensors.push(WireTensor { dims, values });
    }
    if r.left() != 0 {
        return Err(PacketError::Trailing(r.left()));
    }
    Ok((flow, Packet { mb, tensors }))
}

/// A stage's end of its connection to one peer stage in another process.
#[derive(Debug)]
pub(super) struct RemoteEnd {
    wire: Arc<dyn PacketWire>,
    early: Mutex<Early>,
}

/// Packets that arrived while a receive waited for the other direction, and the receive
/// buffer.
type Early = (HashMap<Flow, VecDeque<Packet>>, Vec<u8>);

impl RemoteEnd {
    pub(super) fn new(wire: Arc<dyn PacketWire>) -> Self {
        Self {
            wire,
            early: Mutex::new((HashMap::new(), Vec::new())),
        }
    }

    pub(super) fn send(
        &self,
        (stage, peer): (u32, u32),
        flow: Flow,
        packet: &Packet,
        timeout: Duration,
    ) -> Result<(), ExecError> {
        let bytes = encode_packet(flow, packet);
        self.wire
            .send(&bytes, Instant::now() + timeout)
            .map_err(|e| match e {
                WireError::TimedOut => ExecError::Timeout {
                    stage,
                    from: peer,
                    mb: packet.mb,
                    what: "room on the link",
                    waited: timeout,
                },
                WireError::Broken(reason) => ExecError::Wire {
                    stage,
                    peer,
                    reason,
                },
                WireError::Refused(reason) => ExecError::Unsupported(format!(
                    "stage {stage} cannot send micro-batch {} to stage {peer}: {reason}",
                    packet.mb
                )),
            })
    }

    /// The next packet in direction `flow`: one kept earlier, or the next that arrives.
    pub(super) fn recv(
        &self,
        (stage, peer): (u32, u32),
        flow: Flow,
        mb: u32,
        timeout: Duration,
    ) -> Result<Vec<WireTensor>, ExecError> {
        let what = match flow {
            Flow::Activation => "activation",
            Flow::Gradient => "gradient",
        };
        let deadline = Instant::now() + timeout;
        let mut guard = self.early.lock().unwrap_or_else(|e| e.into_inner());
        let (early, buf) = &mut *guard;
        let packet = loop {
            if let Some(p) = early.get_mut(&flow).and_then(VecDeque::pop_front) {
                break p;
            }
            self.wire.recv(buf, deadline).map_err(|e| match e {
                WireError::TimedOut => ExecError::Timeout {
                    stage,
                    from: peer,
                    mb,
                    what,
                    waited: timeout,
                },
                WireError::Broken(reason) | WireError::Refused(reason) => ExecError::Wire {
                    stage,
                    peer,
                    reason,
                },
            })?;
            let (got, p) = decode_packet(buf).map_err(|e| ExecError::Wire {
                stage,
                peer,
                reason: format!("a bad packet: {e}"),
            })?;
            if got == flow {
                break p;
            }
            let kept = early.entry(got).or_default();
            if kept.len() >= MAX_EARLY {
                return Err(ExecError::Wire {
                    stage,
                    peer,
                    reason: format!("more than {MAX_EARLY} packets arrived ahead of the schedule"),
                });
            }
            kept.push_back(p);
        };
        if packet.mb != mb {
            return Err(ExecError::OutOfOrder {
                stage,
                from: peer,
                expected: mb,
                got: packet.mb,
            });
        }
        Ok(packet.tensors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn tensor() -> impl Strategy<Value = WireTensor> {
        prop::collection::vec(1usize..4, 1..=4).prop_flat_map(|dims| {
            let n = dims.iter().product::<usize>();
            prop::collection::vec(any::<f32>(), n).prop_map(move |values| WireTensor {
                dims: dims.clone(),
                values,
            })
        })
    }

    fn same_bits(a: &[WireTensor], b: &[WireTensor]) -> bool {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                x.dims == y.dims
                    && x.values.len() == y.values.len()
                    && x.values
                        .iter()
                        .zip(&y.values)
                        .all(|(p, q)| p.to_bits() == q.to_bits())
            })
    }

    proptest! {
        /// WIRE-2: a packet comes back as it went, bit for bit (NaNs included).
        #[test]
        fn packets_round_trip(
            mb in any::<u32>(),
            gradient in any::<bool>(),
            tensors in prop::collection::vec(tensor(), 0..4),
        ) {
            let flow = if gradient { Flow::Gradient } else { Flow::Activation };
            let packet = Packet { mb, tensors };
            let (f, back) = decode_packet(&encode_packet(flow, &packet)).unwrap();
            prop_assert_eq!(f, flow);
            prop_assert_eq!(back.mb, mb);
            prop_assert!(same_bits(&back.tensors, &packet.tensors));
        }

        /// WIRE-1: any bytes decode to a packet or a typed error, never a panic; a cut or
        /// lengthened packet is an error.
        #[test]
        fn bad_bytes_are_typed_errors(
            bytes in prop::collection::vec(any::<u8>(), 0..256),
            tensors in prop::collection::vec(tensor(), 1..3),
            cut in any::<prop::sample::Index>(),
        ) {
            let _ = decode_packet(&bytes);
            let good = encode_packet(Flow::Activation, &Packet { mb: 3, tensors });
            let at = cut.index(good.len());
            prop_assert!(decode_packet(&good[..at]).is_err());
            let mut longer = good.clone();
            longer.push(0);
            prop_assert_eq!(decode_packet(&longer).unwrap_err(), PacketError::Trailing(1));
        }
    }

    #[test]
    fn huge_declared_sizes_are_refused_before_allocating() {
        let mut bytes = vec![PACKET_VERSION, 0, 0, 0, 0, 0];
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_packet(&bytes),
            Err(PacketError::Truncated { .. })
        ));
        let mut bytes = vec![PACKET_VERSION, 1, 0, 0, 0, 0, 1, 0, 0, 0, 2];
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode_packet(&bytes), Err(PacketError::Dims(_))));
        let mut bytes = vec![PACKET_VERSION, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1];
        bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            decode_packet(&bytes),
            Err(PacketError::Truncated { .. })
        ));
    }

    /// A wire over two in-memory queues, for the end's logic.
    #[derive(Debug, Default)]
    struct Queue(Mutex<VecDeque<Vec<u8>>>);

    impl PacketWire for Queue {
        fn send(&self, bytes: &[u8], _: Instant) -> Result<(), WireError> {
            self.0.lock().unwrap().push_back(bytes.to_vec());
            Ok(())
        }
        fn recv(&self, bytes: &mut Vec<u8>, _: Instant) -> Result<(), WireError> {
            *bytes = self
                .0
                .lock()
                .unwrap()
                .pop_front()
                .ok_or(WireError::TimedOut)?;
            Ok(())
        }
    }

    #[test]
    fn one_connection_carries_both_directions_in_order() {
        let wire = Arc::new(Queue::default());
        let end = RemoteEnd::new(wire.clone());
        let t = |v: f32| WireTensor {
            dims: vec![1],
            values: vec![v],
        };
        let ids = (0, 1);
        let wait = Duration::from_millis(10);
        for (flow, mb, v) in [
            (Flow::Activation, 0, 1.0),
            (Flow::Activation, 1, 2.0),
            (Flow::Gradient, 0, 3.0),
        ] {
            let p = Packet {
                mb,
                tensors: vec![t(v)],
            };
            end.send(ids, flow, &p, wait).unwrap();
        }
        // The gradient is wanted first: both activations are kept, in order.
        assert_eq!(
            end.recv(ids, Flow::Gradient, 0, wait).unwrap(),
            vec![t(3.0)]
        );
        assert_eq!(
            end.recv(ids, Flow::Activation, 0, wait).unwrap(),
            vec![t(1.0)]
        );
        assert!(matches!(
            end.recv(ids, Flow::Activation, 5, wait),
            Err(ExecError::OutOfOrder {
                expected: 5,
                got: 1,
                ..
            })
        ));
        assert!(matches!(
            end.recv(ids, Flow::Gradient, 1, wait),
            Err(ExecError::Timeout { from: 1, .. })
        ));
        wire.0.lock().unwrap().push_back(vec![9, 9]);
        assert!(matches!(
            end.recv(ids, Flow::Gradient, 1, wait),
            Err(ExecError::Wire { peer: 1, .. })
        ));
    }
}
