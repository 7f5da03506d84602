//! Causal scaled dot-product attention, fused, forward and backward, one block of queries at a
//! time (FlashAttention's plan, with the keys of a block whole):
//!
//! - forward, for each head and each block of [`BLOCK`] queries `i ∈ [i0, i1)`: the scores
//!   `S = Q_blk·K[0, i1)ᵀ/√d` into a scratch of `BLOCK × i1`, each row's softmax over its keys
//!   `j ≤ i` in place (the causal mask is the position, no mask tensor), then
//!   `O_blk = P·V[0, i1)`; each row's log-sum-exp is kept (`[batch, heads, seq]`), the
//!   probabilities are not: no `[batch, heads, seq, seq]` tensor exists;
//! - backward, per block again: the probabilities recomputed from the scores and the kept
//!   log-sum-exp, then `dV += Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P∘(dP − rowsum(dO∘O))`,
//!   `dQ = dS·K/√d`, `dK += dSᵀ·Q/√d`.
//!
//! The products are `gemm`'s ([`super::products`]), reading the operands where they lie: a
//! `[batch, seq, heads, dim]` activation split into heads by `swap_dims` is read as it is,
//! without a copy, and the outputs are written as `[batch, seq, heads, dim]` (returned as that
//! buffer seen through `[batch, heads, seq, dim]` strides), so the caller's merge of the heads
//! back is free too.

use super::products::{View, product};
use super::vector::{dot, exp_shifted, max_of};

/// Queries per block: the scores of a block (`BLOCK × seq` floats) stay in the core's cache.
pub(crate) const BLOCK: usize = 64;

/// A `[batch, heads, seq, dim]` tensor inside a slice, its last dimension contiguous: element
/// `(b, h, i, j)` at `offset + b·strides[0] + h·strides[1] + i·strides[2] + j`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Heads {
    /// `[batch, heads, seq, dim]`.
    pub(crate) shape: [usize; 4],
    /// Strides of batch, head and position (the feature stride is 1).
    pub(crate) strides: [usize; 3],
    /// Where element `(0, 0, 0, 0)` lies.
    pub(crate) offset: usize,
}

impl Heads {
    /// The `[batch, seq, heads, dim]` buffer of `shape` `[batch, heads, seq, dim]`: how every
    /// output of this module is laid out.
    pub(crate) fn packed(shape: [usize; 4]) -> Self {
        let [_, heads, seq, dim] = shape;
        Self {
            shape,
            strides: [seq * heads * dim, dim, heads * dim],
            offset: 0,
        }
    }

    /// The strides of [`Heads::packed`] as a tensor layout's (`[batch, heads, seq, dim]`).
    pub(crate) fn packed_strides(shape: [usize; 4]) -> [usize; 4] {
        let s = Self::packed(shape).strides;
        [s[0], s[1], s[2], 1]
    }

    /// Positions `first .. first + count` of head `(b, h)` as a `count × dim` matrix.
    fn rows(&self, b: usize, h: usize, first: usize, count: usize) -> View {
        View {
            offset: self.offset
                + b * self.strides[0]
                + h * self.strides[1]
                + first * self.strides[2],
            rows: count,
            cols: self.shape[3],
            rs: self.strides[2],
            cs: 1,
        }
    }

    /// Position `i`'s features of head `(b, h)`.
    fn row<'a>(&self, data: &'a [f32], b: usize, h: usize, i: usize) -> &'a [f32] {
        let start = self.rows(b, h, i, 1).offset;
        &data[start..start + self.shape[3]]
    }
}

/// A tensor's elements and where each lies.
pub(crate) type Operand<'a> = (&'a [f32], Heads);

/// The forward's output (laid out as [`Heads::packed`]) and each row's log-sum-exp
/// (`[batch, heads, seq]`).
#[derive(Debug, Clone)]
pub(crate) struct Attended {
    /// `softmax(QKᵀ/√d, causal)·V`.
    pub(crate) out: Vec<f32>,
    /// `log Σ_{j ≤ i} e^{s_ij}` per query.
    pub(crate) lse: Vec<f32>,
}

fn scale_of(dim: usize) -> f32 {
    1.0 / (dim.max(1) as f32).sqrt()
}

/// The scores of queries `i0 .. i0 + rows` against keys `0 .. keys` of head `(b, h)` into
/// `scores` (`rows × keys`, row-major).
fn scores(
    scores: &mut [f32],
    (q, qh): Operand,
    (k, kh): Operand,
    (b, h, i0, rows, keys): (usize, usize, usize, usize, usize),
) {
    let dst = View::row_major(0, rows, keys);
    let scale = scale_of(qh.shape[3]);
    let lhs = qh.rows(b, h, i0, rows);
    let rhs = kh.rows(b, h, 0, keys).t();
    product(scores, dst, false, scale, (q, lhs), (k, rhs));
}

/// Causal attention of `q`, `k`, `v` (the same `[batch, heads, seq, dim]` shape).
pub(crate) fn forward(q: Operand, k: Operand, v: Operand) -> Attended {
    let [batch, heads, seq, _] = q.1.shape;
    let oh = Heads::packed(q.1.shape);
    let mut out = vec![0f32; q.1.shape.iter().product()];
    let mut lse = vec![0f32; batch * heads * seq];
    let mut p = vec![0f32; BLOCK * seq];
    for b in 0..batch {
        for h in 0..heads {
            for i0 in (0..seq).step_by(BLOCK) {
                let rows = BLOCK.min(seq - i0);
                let keys = i0 + rows;
                scores(&mut p, q, k, (b, h, i0, rows, keys));
                for r in 0..rows {
                    let i = i0 + r;
                    let row = &mut p[r * keys..(r + 1) * keys];
                    let (seen, unseen) = row.split_at_mut(i + 1);
                    let max = max_of(seen);
                    let total = exp_shifted(seen, max);
                    let inv = 1.0 / total;
                    seen.iter_mut().for_each(|x| *x *= inv);
                    unseen.fill(0.0);
                    lse[(b * heads + h) * seq + i] = max + total.ln();
                }
                let probs = View::row_major(0, rows, keys);
                let dst = oh.rows(b, h, i0, rows);
                product(
                    &mut out,
                    dst,
                    false,
                    1.0,
                    (&p, probs),
                    (v.0, v.1.rows(b, h, 0, keys)),
                );
            }
        }
    }
    Attended { out, lse }
}

/// The gradients of queries, keys and values (each laid out as [`Heads::packed`]) of
/// [`forward`] for the output gradient `grad`, from the inputs, the output and its
/// log-sum-exp.
pub(crate) fn backward(
    (q, k, v): (Operand, Operand, Operand),
    (out, lse): (Operand, &[f32]),
    grad: Operand,
) -> [Vec<f32>; 3] {
    let shape = q.1.shape;
    let [batch, heads, seq, _] = shape;
    let scale = scale_of(shape[3]);
    let gh = Heads::packed(shape);
    let len = shape.iter().product();
    let (mut dq, mut dk, mut dv) = (vec![0f32; len], vec![0f32; len], vec![0f32; len]);
    let mut p = vec![0f32; BLOCK * seq];
    let mut ds = vec![0f32; BLOCK * seq];
    for b in 0..batch {
        for h in 0..heads {
            for i0 in (0..seq).step_by(BLOCK) {
                let rows = BLOCK.min(seq - i0);
                let keys = i0 + rows;
                let block = View::row_major(0, rows, keys);
                scores(&mut p, q, k, (b, h, i0, rows, keys));
                for r in 0..rows {
                    let i = i0 + r;
                    let row = &mut p[r * keys..(r + 1) * keys];
                    let (seen, unseen) = row.split_at_mut(i + 1);
                    exp_shifted(seen, lse[(b * heads + h) * seq + i]);
                    unseen.fill(0.0);
                }
                let d_out = grad.1.rows(b, h, i0, rows);
                // dV[0, keys) += Pᵀ · dO_blk
                let dst = gh.rows(b, h, 0, keys);
                product(&mut dv, dst, true, 1.0, (&p, block.t()), (grad.0, d_out));
                // dP = dO_blk · V[0, keys)ᵀ, then dS = P ∘ (dP − rowsum(dO ∘ O)).
                let vt = v.1.rows(b, h, 0, keys).t();
                product(&mut ds, block, false, 1.0, (grad.0, d_out), (v.0, vt));
                for r in 0..rows {
                    let i = i0 + r;
                    let delta = dot(grad.1.row(grad.0, b, h, i), out.1.row(out.0, b, h, i));
                    let probs = &p[r * keys..(r + 1) * keys];
                    let row = &mut ds[r * keys..(r + 1) * keys];
                    for (s, &pr) in row.iter_mut().zip(probs) {
                        *s = pr * (*s - delta);
                    }
                }
                // dQ_blk = dS · K[0, keys) / √d;  dK[0, keys) += dSᵀ · Q_blk / √d
                let dst = gh.rows(b, h, i0, rows);
                let keys_view = k.1.rows(b, h, 0, keys);
                product(&mut dq, dst, false, scale, (&ds, block), (k.0, keys_view));
                let dst = gh.rows(b, h, 0, keys);
                let queries = q.1.rows(b, h, i0, rows);
                product(&mut dk, dst, true, scale, (&ds, block.t()), (q.0, queries));
            }
        }
    }
    [dq, dk, dv]
}
