//! [`Collective`]: one collective a synchronisation asks for, on plain `f32` buffers, so that
//! whoever holds the group's communicator (the compute thread itself, or a communication
//! thread beside it: `parallel::overlap`) can run it. The tensor work (taking Burn's gradients
//! out, putting parameters back) stays with the synchronisation; only buffers cross.
//!
//! Invariant:
//! - COLL-1: running a collective is the same calls on the communicator, with the same
//!   buffers, as the synchronisation made itself before the split (an all-reduce bucket by
//!   bucket, in bucket order), so where it runs never changes a bit of the result.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::comm::{CollectiveKind, CommError, Communicator, ReduceOp};
use crate::trace::TraceKind;

/// A collective on plain buffers, with what it needs to know about its output.
#[derive(Debug)]
pub(crate) enum Collective {
    /// All-gather this rank's `shard` into a buffer of `len` elements (ZeRO-3's parameters).
    AllGather {
        /// This rank's chunk.
        shard: Vec<f32>,
        /// The whole buffer's length.
        len: usize,
    },
    /// Reduce-scatter (sum) `flat`; the output is this rank's chunk of `out` elements.
    ReduceScatter {
        /// The whole buffer.
        flat: Vec<f32>,
        /// This rank's chunk's length.
        out: usize,
    },
    /// All-reduce (sum) `buf` in place, one call per range of `buckets`, in order.
    AllReduce {
        /// The whole buffer.
        buf: Vec<f32>,
        /// The buckets, consecutive ranges of `buf`.
        buckets: Vec<Range<usize>>,
    },
}

/// What a collective took: which kind, when it began, how long (a trace span).
pub(crate) type Span = (TraceKind, Instant, Duration);

impl Collective {
    /// The op, as errors name it.
    pub(crate) fn kind(&self) -> CollectiveKind {
        match self {
            Collective::AllGather { .. } => CollectiveKind::AllGather,
            Collective::ReduceScatter { .. } => CollectiveKind::ReduceScatter,
            Collective::AllReduce { .. } => CollectiveKind::AllReduce,
        }
    }

    /// The bytes of the buffer the collective leaves behind (what its result holds).
    pub(crate) fn output_bytes(&self) -> u64 {
        4 * match self {
            Collective::AllGather { len, .. } => *len,
            Collective::ReduceScatter { out, .. } => *out,
            Collective::AllReduce { buf, .. } => buf.len(),
        } as u64
    }

    /// Run on `comm` (COLL-1); alone (`None`, or a group of one) there is nothing to exchange
    /// and the input is the result. Returns the output buffer and the span, if anything was
    /// exchanged.
    pub(crate) fn run(
        self,
        comm: Option<&mut Communicator>,
    ) -> (Result<Vec<f32>, CommError>, Option<Span>) {
        let Some(comm) = comm.filter(|c| c.world() > 1) else {
            return (Ok(self.alone()), None);
        };
        let t = Instant::now();
        let (kind, result) = match self {
            Collective::AllGather { shard, len } => {
                let mut full = vec![0.0f32; len];
                let r = comm.all_gather(&shard, &mut full);
                (
                    TraceKind::AllGather {
                        bytes: 4 * len as u64,
                    },
                    r.map(|()| full),
                )
            }
            Collective::ReduceScatter { flat, out } => {
                let mut shard = vec![0.0f32; out];
                let r = comm.reduce_scatter(&flat, &mut shard, ReduceOp::Sum);
                let bytes = 4 * flat.len() as u64;
                drop(flat);
                (TraceKind::ReduceScatter { bytes }, r.map(|()| shard))
            }
            Collective::AllReduce { mut buf, buckets } => {
                let r = buckets
                    .iter()
                    .try_for_each(|b| comm.all_reduce(&mut buf[b.clone()], ReduceOp::Sum));
                let bytes = 4 * buf.len() as u64;
                (TraceKind::AllReduce { bytes }, r.map(|()| buf))
            }
        };
        (result, Some((kind, t, t.elapsed())))
    }

    /// The result in a group of one.
    fn alone(self) -> Vec<f32> {
        match self {
            Collective::AllGather { shard, .. } => shard,
            Collective::ReduceScatter { flat, .. } => flat,
            Collective::AllReduce { buf, .. } => buf,
        }
    }
}
