//! [`Collective`]: one collective a synchronisation asks for, on plain `f32` buffers, so that
//! whoever holds the group's communicator (the compute thread itself, or a communication
//! thread beside it: `parallel::pipeline_exec::overlap`) can run it. The tensor work (taking Burn's gradients
//! out, putting parameters back) stays with the synchronisation; only buffers cross.
//!
//! Invariant:
//! - COLL-1: running a collective is the same calls on the communicator, with the same
//!   buffers, as the synchronisation made itself before the split (an all-reduce bucket by
//!   bucket, in bucket order), so where it runs never changes a bit of the result.

use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::comm::{CollectiveKind, CommError, Communicator};
use crate::parallel::compress::{Compressor, Exchange};
use crate::precision::Precision;
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
        /// The type the gradients travel in (`f32`, or a 16-bit type: COMM-5).
        wire: Precision,
    },
    /// All-reduce (sum) `buf` in place, one call per range of `buckets`, in order.
    AllReduce {
        /// The whole buffer.
        buf: Vec<f32>,
        /// The buckets, consecutive ranges of `buf`.
        buckets: Vec<Range<usize>>,
        /// The type the gradients travel in (`f32`, or a 16-bit type: COMM-5).
        wire: Precision,
    },
    /// Reduce (sum) `buf` in place through a compressor: its own collectives (a 16-bit
    /// all-reduce, top-k's all-gather, PowerSGD's two all-reduces), the part not sent kept
    /// in its residual (error feedback). Shared with the synchronisation that owns it, which
    /// reads its state for checkpoints; one collective at a time uses it.
    Compressed {
        /// The whole buffer.
        buf: Vec<f32>,
        /// The rank's compressor for this buffer.
        compressor: Arc<Mutex<Compressor>>,
    },
    /// No exchange: the rank keeps its own gradient (local updates, whose ranks step alone
    /// and meet every few steps in `apply`, LOCAL-5).
    Local {
        /// The rank's own gradient.
        buf: Vec<f32>,
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
            Collective::AllReduce { .. }
            | Collective::Compressed { .. }
            | Collective::Local { .. } => CollectiveKind::AllReduce,
        }
    }

    /// The same collective with its gradients travelling as `wire`'s type
    /// (`.low_precision_gradients(true)` in a block job); a gather stays `f32`.
    pub(crate) fn travelling_as(mut self, to: Precision) -> Self {
        match &mut self {
            Collective::AllGather { .. } => {}
            Collective::ReduceScatter { wire, .. } | Collective::AllReduce { wire, .. } => {
                *wire = to;
            }
            // The compressor chose its own wire; a local gradient does not travel.
            Collective::Compressed { .. } | Collective::Local { .. } => {}
        }
        self
    }

    /// The bytes of the buffer the collective leaves behind (what its result holds).
    pub(crate) fn output_bytes(&self) -> u64 {
        4 * match self {
            Collective::AllGather { len, .. } => *len,
            Collective::ReduceScatter { out, .. } => *out,
            Collective::AllReduce { buf, .. }
            | Collective::Compressed { buf, .. }
            | Collective::Local { buf } => buf.len(),
        } as u64
    }

    /// Run on `comm` (COLL-1); alone (`None`, or a group of one) there is nothing to exchange
    /// and the input is the result (a compressor still compresses: its residual is the same
    /// alone). Returns the output buffer and a span per exchange.
    pub(crate) fn run(
        self,
        comm: Option<&mut Communicator>,
    ) -> (Result<Vec<f32>, CommError>, Vec<Span>) {
        if let Collective::Compressed {
            mut buf,
            compressor,
        } = self
        {
            let mut on = OnComm::new(comm);
            let r = compressor
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .reduce(&mut buf, &mut on);
            return (r.map(|()| buf).map_err(|e| e.0), on.spans);
        }
        if let Collective::Local { buf } = self {
            return (Ok(buf), Vec::new());
        }
        let Some(comm) = comm.filter(|c| c.world() > 1) else {
            return (Ok(self.alone()), Vec::new());
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
            Collective::ReduceScatter { flat, out, wire } => {
                let mut shard = vec![0.0f32; out];
                let r = super::reduce_scatter_as(comm, &flat, &mut shard, wire);
                let bytes = wire_bytes(wire) * flat.len() as u64;
                drop(flat);
                (TraceKind::ReduceScatter { bytes }, r.map(|()| shard))
            }
            Collective::AllReduce {
                mut buf,
                buckets,
                wire,
            } => {
                let r = buckets
                    .iter()
                    .try_for_each(|b| super::all_reduce_as(comm, &mut buf[b.clone()], wire));
                let bytes = wire_bytes(wire) * buf.len() as u64;
                (TraceKind::AllReduce { bytes }, r.map(|()| buf))
            }
            Collective::Compressed { .. } | Collective::Local { .. } => {
                unreachable!("run above")
            }
        };
        (result, vec![(kind, t, t.elapsed())])
    }

    /// The result in a group of one.
    fn alone(self) -> Vec<f32> {
        match self {
            Collective::AllGather { shard, .. } => shard,
            Collective::ReduceScatter { flat, .. } => flat,
            Collective::AllReduce { buf, .. }
            | Collective::Compressed { buf, .. }
            | Collective::Local { buf } => buf,
        }
    }
}

/// Why a compressor's exchange failed: the collective, or what a peer sent.
#[derive(Debug)]
pub(crate) struct Exchanged(pub(crate) CommError);

impl From<CommError> for Exchanged {
    fn from(e: CommError) -> Self {
        Exchanged(e)
    }
}

impl From<crate::parallel::compress::CompressError> for Exchanged {
    fn from(e: crate::parallel::compress::CompressError) -> Self {
        Exchanged(CommError::Malformed {
            op: CollectiveKind::AllGather,
            reason: e.to_string(),
        })
    }
}

/// A group's communicator as a compressor's [`Exchange`], a span per collective (CSYNC-1);
/// alone (`None`, or a group of one), nothing is exchanged.
pub(crate) struct OnComm<'a> {
    comm: Option<&'a mut Communicator>,
    /// The spans of the collectives run so far.
    pub(crate) spans: Vec<Span>,
}

impl<'a> OnComm<'a> {
    pub(crate) fn new(comm: Option<&'a mut Communicator>) -> Self {
        Self {
            comm: comm.filter(|c| c.world() > 1),
            spans: Vec::new(),
        }
    }
}

impl Exchange for OnComm<'_> {
    type Error = Exchanged;

    fn world(&self) -> usize {
        self.comm.as_ref().map_or(1, |c| c.world())
    }

    fn all_reduce(&mut self, buf: &mut [f32], wire: Precision) -> Result<(), Exchanged> {
        let Some(comm) = self.comm.as_deref_mut() else {
            return Ok(());
        };
        let t = Instant::now();
        super::all_reduce_as(comm, buf, wire)?;
        let bytes = wire_bytes(wire) * buf.len() as u64;
        self.spans
            .push((TraceKind::AllReduce { bytes }, t, t.elapsed()));
        Ok(())
    }

    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), Exchanged> {
        let Some(comm) = self.comm.as_deref_mut() else {
            out.copy_from_slice(mine);
            return Ok(());
        };
        let t = Instant::now();
        comm.all_gather(mine, out)?;
        let bytes = 4 * out.len() as u64;
        self.spans
            .push((TraceKind::AllGather { bytes }, t, t.elapsed()));
        Ok(())
    }
}

/// The bytes one element takes in `wire`'s type.
fn wire_bytes(wire: Precision) -> u64 {
    if wire.is_low() { 2 } else { 4 }
}
