//! [`CallShape`]: what one rank passed to an op, compared between ranks before data moves
//! (COMM-2), carried in every mismatch error and, across processes, in every op's header.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Algorithm, CollectiveKind, DType, Element, PartialSums, ReduceOp};
use crate::mesh::Rank;

/// What one rank passed to an op: enough to tell why ranks disagree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallShape {
    /// The op the rank called.
    pub kind: CollectiveKind,
    /// The element type of its buffers (`None` for a barrier).
    pub dtype: Option<DType>,
    /// The algorithm this rank resolved for a data collective (`None` for the others); all
    /// ranks must run the same one.
    pub algorithm: Option<Algorithm>,
    /// The length of the full buffer, in elements (the output of an all-gather, the input of a
    /// reduce-scatter; 0 for a barrier).
    pub len: usize,
    /// The length of the rank's own chunk where the op has one (the input of an all-gather,
    /// the output of a reduce-scatter).
    pub chunk_len: Option<usize>,
    /// The chunk length the layout rule ([`chunk_range`](crate::mesh::chunk_range)) requires of this rank, where the op
    /// has a chunk.
    pub expected_chunk_len: Option<usize>,
    /// The root of a broadcast, the peer of a send or recv.
    pub peer: Option<Rank>,
    /// The reduce op of an all-reduce or reduce-scatter.
    pub reduce: Option<ReduceOp>,
    /// Whether a 16-bit reduction's partial sums travel in 16 bits (COMM-9); `false` for
    /// every other call.
    #[serde(default)]
    pub narrow_partials: bool,
}

impl CallShape {
    /// An all-reduce of `len` elements of `T` with `op`.
    pub(crate) fn all_reduce<T: Element>(algorithm: Algorithm, len: usize, op: ReduceOp) -> Self {
        Self {
            kind: CollectiveKind::AllReduce,
            dtype: Some(T::DTYPE),
            algorithm: Some(algorithm),
            len,
            chunk_len: None,
            expected_chunk_len: None,
            peer: None,
            reduce: Some(op),
            narrow_partials: false,
        }
    }

    /// A broadcast of `len` elements of `T` from `root`.
    pub(crate) fn broadcast<T: Element>(algorithm: Algorithm, len: usize, root: Rank) -> Self {
        Self {
            kind: CollectiveKind::Broadcast,
            dtype: Some(T::DTYPE),
            algorithm: Some(algorithm),
            len,
            chunk_len: None,
            expected_chunk_len: None,
            peer: Some(root),
            reduce: None,
            narrow_partials: false,
        }
    }

    /// A reduce-scatter of `len` elements with `op`: the chunk passed and the one expected.
    pub(crate) fn reduce_scatter<T: Element>(
        algorithm: Algorithm,
        len: usize,
        (chunk, expected): (usize, usize),
        op: ReduceOp,
    ) -> Self {
        Self {
            kind: CollectiveKind::ReduceScatter,
            dtype: Some(T::DTYPE),
            algorithm: Some(algorithm),
            len,
            chunk_len: Some(chunk),
            expected_chunk_len: Some(expected),
            peer: None,
            reduce: Some(op),
            narrow_partials: false,
        }
    }

    /// An all-gather into `len` elements: the chunk passed and the one expected.
    pub(crate) fn all_gather<T: Element>(
        algorithm: Algorithm,
        len: usize,
        (chunk, expected): (usize, usize),
    ) -> Self {
        Self {
            kind: CollectiveKind::AllGather,
            dtype: Some(T::DTYPE),
            algorithm: Some(algorithm),
            len,
            chunk_len: Some(chunk),
            expected_chunk_len: Some(expected),
            peer: None,
            reduce: None,
            narrow_partials: false,
        }
    }

    /// A barrier.
    pub(crate) fn barrier() -> Self {
        Self {
            kind: CollectiveKind::Barrier,
            dtype: None,
            algorithm: None,
            len: 0,
            chunk_len: None,
            expected_chunk_len: None,
            peer: None,
            reduce: None,
            narrow_partials: false,
        }
    }

    /// A send or recv (`kind`) of `len` elements of `T` to or from `peer`.
    pub(crate) fn point_to_point<T: Element>(kind: CollectiveKind, len: usize, peer: Rank) -> Self {
        Self {
            kind,
            dtype: Some(T::DTYPE),
            algorithm: None,
            len,
            chunk_len: None,
            expected_chunk_len: None,
            peer: Some(peer),
            reduce: None,
            narrow_partials: false,
        }
    }

    /// This call with its partial sums travelling as `partial_sums` says (COMM-9): narrow
    /// only for an f16 or bf16 reduction run as a message plan (ring or tree).
    pub(crate) fn with_partial_sums(mut self, partial_sums: PartialSums) -> Self {
        self.narrow_partials = partial_sums == PartialSums::Narrow
            && matches!(self.dtype, Some(DType::F16 | DType::BF16))
            && matches!(self.algorithm, Some(Algorithm::Ring | Algorithm::Tree))
            && self.reduce.is_some();
        self
    }

    /// Whether this call is fine on its own (its chunk fits the layout).
    pub fn is_well_formed(&self) -> bool {
        self.chunk_len == self.expected_chunk_len
    }

    /// Whether two ranks' calls can form one op: the same kind, type, length, root and reduce
    /// op, resolved to the same algorithm, with partial sums of the same width (COMM-9). (Chunk
    /// lengths differ between ranks by design.)
    pub fn agrees_with(&self, other: &CallShape) -> bool {
        self.kind == other.kind
            && self.dtype == other.dtype
            && self.algorithm == other.algorithm
            && self.len == other.len
            && self.peer == other.peer
            && self.reduce == other.reduce
            && self.narrow_partials == other.narrow_partials
    }
}

impl fmt::Display for CallShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.kind)?;
        if let Some(dtype) = self.dtype {
            write!(f, "{dtype}, ")?;
        }
        write!(f, "len {}", self.len)?;
        if let Some(chunk) = self.chunk_len {
            write!(f, ", chunk {chunk}")?;
            if let Some(expected) = self.expected_chunk_len
                && expected != chunk
            {
                write!(f, " but the layout needs {expected}")?;
            }
        }
        if let Some(peer) = self.peer {
            let what = match self.kind {
                CollectiveKind::Send => "to",
                CollectiveKind::Recv => "from",
                _ => "root",
            };
            write!(f, ", {what} {}", peer.0)?;
        }
        if let Some(reduce) = self.reduce {
            write!(f, ", {reduce}")?;
        }
        if let Some(algorithm) = self.algorithm {
            write!(f, ", {algorithm}")?;
        }
        if self.narrow_partials {
            write!(f, ", {}", PartialSums::Narrow)?;
        }
        f.write_str(")")
    }
}
