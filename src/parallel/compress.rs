//! Gradient compression as data plus pure functions: which scheme a data-parallel job sends
//! its gradients in ([`Compression`]), and the per-rank [`Compressor`] that turns this rank's
//! gradient into what travels and the group's messages back into the reduced gradient, with
//! error feedback. The collectives themselves are behind [`Exchange`] (the device side,
//! `parallel::sync::compressed`, runs them on the group's communicator; the tests run them on
//! threads), so the arithmetic here is tested on its own.
//!
//! Gradients are flat `f32` buffers in the order of the parameters' `shapes`, each rank's
//! already weighted by its share of the step's samples, so the reduced gradient is the **sum**
//! over the group of what each rank contributes (as the plain all-reduce's is).
//!
//! Invariants (tested in `compress/tests.rs` and `tests/suite/compression.rs`):
//! - CMP-1 (error feedback): each rank keeps a residual `e`; a step compresses `m = g + e`,
//!   contributes `c = decompress(compress(m))` to the group's sum and keeps `e' = m − c`. So
//!   over any number of steps, what a rank contributed plus its last residual equals the sum
//!   of its gradients (up to `f32` rounding): nothing is lost, only delayed.
//! - CMP-2 (exact limits): top-k with `fraction` 1.0 sends every element (the sum is the
//!   plain sum, in rank order), PowerSGD at full rank (`rank ≥ min(rows, cols)`) reduces to
//!   the plain sum up to rounding, `None` is the plain all-reduce.
//! - CMP-3 (same on every rank): what decides the reduced gradient (top-k's sum in rank
//!   order, PowerSGD's orthogonalised P and warm-started Q, seeded alike on every rank) is a
//!   function of the exchanged values only, so every rank applies the same update.
//! - CMP-4 (bytes): [`Compressor::ops`] lists the collectives a step runs and their sizes;
//!   what the device side records in its trace spans per step is exactly
//!   [`Compression::predicted_bytes`].

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::config::InvalidConfig;
use crate::kernels::products::{self, View};
use crate::precision::Precision;

/// How a data-parallel job sends its gradients ([`None`](Compression::None): plain `f32`
/// all-reduce), given to `JobBuilder::compression`. Its text form, read by `FromStr` and
/// written by `Display` (for a program's own flags or configuration files; no `meshwork`
/// command takes it), is `none`, `bf16`, `f16`, `topk:0.01`, `powersgd:2` or
/// `powersgd:2:100` (rank 2 after 100 uncompressed steps).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Compression {
    /// No compression: `f32` gradients all-reduced in buckets.
    #[default]
    None,
    /// Gradients rounded to bfloat16 (with error feedback) and all-reduced as 2-byte
    /// elements (each sum accumulated in `f32` and rounded once, COMM-5).
    Bf16,
    /// As [`Bf16`](Self::Bf16) with IEEE half precision.
    F16,
    /// Top-k sparsification with error feedback: each rank sends the `ceil(fraction × n)`
    /// elements of largest magnitude of its whole flat gradient (`n` elements) as (index,
    /// value) pairs, all-gathered; the rest waits in its residual. `fraction` in `(0, 1]`.
    TopK {
        /// The share of the gradient's elements each rank sends per step.
        fraction: f32,
    },
    /// PowerSGD (Vogels et al., 2019; PyTorch's `powerSGD_hook`): every parameter of two or
    /// more dimensions (viewed as `[dim 0, product of the rest]`, both at least 2) travels as
    /// two rank-`rank` factors with error feedback and a warm-started `Q`; vectors travel
    /// whole. The factors are smaller than the matrix only while
    /// `rank × (rows + cols) < rows × cols`: choose a rank well below the smaller dimension.
    PowerSgd {
        /// The rank of the approximation (at least 1; clamped to each matrix's smaller side).
        rank: usize,
        /// Steps all-reduced uncompressed before compression starts (PyTorch's
        /// `start_powerSGD_iter`); 0 compresses from the first step.
        start_after: u64,
    },
}

impl Compression {
    /// Whether gradients travel compressed (anything but [`None`](Self::None)).
    pub fn is_on(&self) -> bool {
        !matches!(self, Compression::None)
    }

    /// Refuse a scheme that cannot run: a top-k fraction outside `(0, 1]`, a rank of 0.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        match *self {
            Compression::TopK { fraction } if !(fraction > 0.0 && fraction <= 1.0) => {
                Err(InvalidConfig(format!(
                    "compression topk:{fraction}: the fraction must be in (0, 1], e.g. topk:0.01"
                )))
            }
            Compression::PowerSgd { rank: 0, .. } => Err(InvalidConfig(
                "compression powersgd:0: the rank must be at least 1, e.g. powersgd:2".into(),
            )),
            _ => Ok(()),
        }
    }

    /// The bytes a rank's trace records for the collectives of one compressed step (after
    /// PowerSGD's warm-up) of a gradient with these parameter `shapes` in a group of `world`
    /// (CMP-4): an all-reduce counts the buffer the rank hands in (2 bytes per element for
    /// bf16/f16), an all-gather the gathered buffer (every rank's chunk, as ZeRO's do). A
    /// group of one exchanges nothing: 0.
    pub fn predicted_bytes(&self, shapes: &[Vec<usize>], world: usize) -> u64 {
        let mut c = Compressor::new(*self, shapes);
        c.step = c.warm_up();
        c.ops(world).iter().map(|op| op.traced_bytes(world)).sum()
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compression::None => write!(f, "none"),
            Compression::Bf16 => write!(f, "bf16"),
            Compression::F16 => write!(f, "f16"),
            Compression::TopK { fraction } => write!(f, "topk:{fraction}"),
            Compression::PowerSgd {
                rank,
                start_after: 0,
            } => write!(f, "powersgd:{rank}"),
            Compression::PowerSgd { rank, start_after } => {
                write!(f, "powersgd:{rank}:{start_after}")
            }
        }
    }
}

impl FromStr for Compression {
    type Err = InvalidConfig;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            InvalidConfig(format!(
                "compression `{s}`: use none, bf16, f16, topk:FRACTION (e.g. topk:0.01) or \
                 powersgd:RANK[:WARM_UP_STEPS] (e.g. powersgd:2)"
            ))
        };
        let mut parts = s.trim().split(':');
        let name = parts.next().unwrap_or_default().to_ascii_lowercase();
        let args: Vec<&str> = parts.collect();
        let c = match (name.as_str(), args.as_slice()) {
            ("none", []) => Compression::None,
            ("bf16", []) => Compression::Bf16,
            ("f16", []) => Compression::F16,
            ("topk", [f]) => Compression::TopK {
                fraction: f.parse().map_err(|_| bad())?,
            },
            ("powersgd", [r]) => Compression::PowerSgd {
                rank: r.parse().map_err(|_| bad())?,
                start_after: 0,
            },
            ("powersgd", [r, w]) => Compression::PowerSgd {
                rank: r.parse().map_err(|_| bad())?,
                start_after: w.parse().map_err(|_| bad())?,
            },
            _ => return Err(bad()),
        };
        c.validate()?;
        Ok(c)
    }
}

/// Why a compressed reduction or a restore failed on this side of the exchange.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CompressError {
    /// A peer's top-k message names an element outside the gradient.
    #[error("top-k: rank {rank} sent index {index} for a gradient of {len} elements")]
    BadIndex {
        /// The rank whose message it was.
        rank: usize,
        /// The index it sent.
        index: u32,
        /// The gradient's length.
        len: usize,
    },
    /// A saved compressor state does not fit this model or scheme.
    #[error("compression state: {reason}")]
    State {
        /// What does not fit.
        reason: String,
    },
}

/// The kind of a collective a compressed step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireKind {
    /// Sum over the group, in place.
    AllReduce,
    /// Every rank's equal chunk, in rank order.
    AllGather,
}

/// One collective of a compressed step, as [`Compressor::ops`] predicts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireOp {
    /// Which collective.
    pub kind: WireKind,
    /// The elements this rank hands in (an all-gather's chunk).
    pub elements: usize,
    /// Bytes per element on the wire (4, or 2 for bf16/f16).
    pub element_bytes: usize,
}

impl WireOp {
    /// The bytes the trace records for it (CMP-4): the all-reduce's buffer, or the
    /// all-gather's whole gathered buffer.
    pub fn traced_bytes(&self, world: usize) -> u64 {
        let per_rank = (self.elements * self.element_bytes) as u64;
        match self.kind {
            WireKind::AllReduce => per_rank,
            WireKind::AllGather => per_rank * world as u64,
        }
    }
}

/// The collectives a compressor runs on, for one rank of a group. Every rank calls the same
/// methods in the same order with the same lengths.
pub trait Exchange {
    /// What a failed collective (or a malformed message) becomes.
    type Error: From<CompressError>;

    /// The group's size.
    fn world(&self) -> usize;

    /// Sum `buf` over the group in place, travelling as `wire`'s type (a 16-bit sum is
    /// accumulated in `f32` and rounded once).
    fn all_reduce(&mut self, buf: &mut [f32], wire: Precision) -> Result<(), Self::Error>;

    /// Every rank's `mine` (all of one length), in rank order, into `out`.
    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), Self::Error>;
}

/// A compressor's state between steps, for checkpoints: the step count, this rank's
/// error-feedback residual (empty until the first compressed step), and PowerSGD's
/// warm-started `Q` factors (equal on every rank).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompressorState {
    /// Steps reduced so far.
    pub step: u64,
    /// This rank's residual, one value per gradient element (or empty: all zero).
    pub residual: Vec<f32>,
    /// PowerSGD's `Q` per compressed matrix, in parameter order.
    pub q: Vec<Vec<f32>>,
}

impl CompressorState {
    /// The state rank `rank` of a group of another size resumes with from every rank's saved
    /// one (CSYNC-2): the step count and PowerSGD's `Q` (the same on every rank) from the
    /// first, and on rank 0 the residuals' sum (what the group still owes), on the others
    /// none. `None` without a saved state.
    pub fn regrouped<'a>(
        saved: impl IntoIterator<Item = &'a CompressorState>,
        rank: usize,
    ) -> Option<CompressorState> {
        let mut saved = saved.into_iter().peekable();
        let mut state = CompressorState {
            residual: Vec::new(),
            ..(*saved.peek()?).clone()
        };
        if rank == 0 {
            for p in saved {
                if state.residual.len() < p.residual.len() {
                    state.residual.resize(p.residual.len(), 0.0);
                }
                state
                    .residual
                    .iter_mut()
                    .zip(&p.residual)
                    .for_each(|(a, b)| *a += b);
            }
        }
        Some(state)
    }
}

/// One parameter as PowerSGD sees it: a matrix `[rows, cols]` worked on as `n × m` with
/// `n ≤ m` (transposed when `rows > cols`), approximated at rank `r`.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    start: usize,
    rows: usize,
    cols: usize,
    r: usize,
}

impl Matrix {
    fn transposed(&self) -> bool {
        self.rows > self.cols
    }
    fn n(&self) -> usize {
        self.rows.min(self.cols)
    }
    fn m(&self) -> usize {
        self.rows.max(self.cols)
    }
    /// The `n × m` view of the matrix inside the flat buffer.
    fn view(&self) -> products::View {
        let stored = products::View::row_major(self.start, self.rows, self.cols);
        if self.transposed() {
            stored.t()
        } else {
            stored
        }
    }
}

/// One rank's compressor: the scheme, the gradient's shapes and the state kept between
/// steps (CMP-1). Built alike on every rank of the group.
#[derive(Debug, Clone)]
pub struct Compressor {
    scheme: Compression,
    len: usize,
    /// PowerSGD's compressed matrices, and the ranges of the parameters sent whole.
    matrices: Vec<Matrix>,
    whole: Vec<std::ops::Range<usize>>,
    step: u64,
    residual: Vec<f32>,
    q: Vec<Vec<f32>>,
}

/// The seed every rank draws PowerSGD's first `Q` from (CMP-3).
const Q_SEED: u64 = 0x005E_ED0F_9051;

impl Compressor {
    /// A fresh compressor for a gradient with these parameter `shapes` (flat, in order).
    pub fn new(scheme: Compression, shapes: &[Vec<usize>]) -> Self {
        let mut matrices = Vec::new();
        let mut whole = Vec::new();
        let mut start = 0;
        for dims in shapes {
            let n: usize = dims.iter().product();
            let rows = dims.first().copied().unwrap_or(1);
            let cols = n.checked_div(rows).unwrap_or(0);
            match scheme {
                Compression::PowerSgd { rank, .. } if dims.len() >= 2 && rows.min(cols) >= 2 => {
                    matrices.push(Matrix {
                        start,
                        rows,
                        cols,
                        r: rank.clamp(1, rows.min(cols)),
                    })
                }
                _ => whole.push(start..start + n),
            }
            start += n;
        }
        let q = matrices
            .iter()
            .enumerate()
            .map(|(i, mat)| {
                seeded_uniform(
                    Q_SEED ^ (i as u64).wrapping_mul(0x9E37_79B9),
                    mat.m() * mat.r,
                )
            })
            .collect();
        Self {
            scheme,
            len: start,
            matrices,
            whole,
            step: 0,
            residual: Vec::new(),
            q,
        }
    }

    /// The scheme.
    pub fn scheme(&self) -> Compression {
        self.scheme
    }

    /// The gradient's length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the gradient has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This rank's residual (all zero when empty).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// The `f32` words of state kept between steps (residual and `Q` factors).
    pub fn state_words(&self) -> usize {
        self.residual.len() + self.q.iter().map(Vec::len).sum::<usize>()
    }

    /// Uncompressed steps before compression starts.
    fn warm_up(&self) -> u64 {
        match self.scheme {
            Compression::PowerSgd { start_after, .. } => start_after,
            _ => 0,
        }
    }

    /// The `k` of top-k: `ceil(fraction × len)`, at least 1 and at most `len`.
    pub fn top_k(&self) -> usize {
        match self.scheme {
            Compression::TopK { fraction } => ((f64::from(fraction) * self.len as f64).ceil()
                as usize)
                .clamp(1.min(self.len), self.len),
            _ => self.len,
        }
    }

    /// The collectives the next step runs in a group of `world` (none alone), CMP-4.
    pub fn ops(&self, world: usize) -> Vec<WireOp> {
        if world <= 1 {
            return Vec::new();
        }
        let op = |kind, elements, element_bytes| WireOp {
            kind,
            elements,
            element_bytes,
        };
        let ops = match self.scheme {
            _ if self.step < self.warm_up() => vec![op(WireKind::AllReduce, self.len, 4)],
            Compression::None => vec![op(WireKind::AllReduce, self.len, 4)],
            Compression::Bf16 | Compression::F16 => vec![op(WireKind::AllReduce, self.len, 2)],
            Compression::TopK { .. } => vec![op(WireKind::AllGather, 2 * self.top_k(), 4)],
            Compression::PowerSgd { .. } => {
                let p: usize = self.matrices.iter().map(|m| m.n() * m.r).sum();
                let whole: usize = self.whole.iter().map(|r| r.len()).sum();
                let q: usize = self.matrices.iter().map(|m| m.m() * m.r).sum();
                vec![
                    op(WireKind::AllReduce, p + whole, 4),
                    op(WireKind::AllReduce, q, 4),
                ]
            }
        };
        ops.into_iter().filter(|o| o.elements > 0).collect()
    }

    /// Replace `grad` (this rank's gradient, `len` elements) by the group's reduced gradient:
    /// the sum over ranks of what each contributes, with error feedback (CMP-1..3). Every
    /// rank calls it once per step.
    pub fn reduce<E: Exchange>(&mut self, grad: &mut [f32], ex: &mut E) -> Result<(), E::Error> {
        assert_eq!(
            grad.len(),
            self.len,
            "the gradient has the compressor's layout"
        );
        let warm = self.step < self.warm_up();
        self.step += 1;
        if warm || self.scheme == Compression::None {
            return ex.all_reduce(grad, Precision::F32);
        }
        if self.residual.len() != self.len {
            self.residual = vec![0.0; self.len];
        }
        // m = g + e, kept in `grad` until it is replaced by the reduced gradient.
        grad.iter_mut()
            .zip(&self.residual)
            .for_each(|(g, e)| *g += e);
        match self.scheme {
            Compression::None => unreachable!("returned above"),
            Compression::Bf16 => self.narrow(grad, ex, Precision::Bf16),
            Compression::F16 => self.narrow(grad, ex, Precision::F16),
            Compression::TopK { .. } => self.top_k_reduce(grad, ex),
            Compression::PowerSgd { .. } => self.power_sgd(grad, ex),
        }
    }

    fn narrow<E: Exchange>(
        &mut self,
        m: &mut [f32],
        ex: &mut E,
        wire: Precision,
    ) -> Result<(), E::Error> {
        self.round_into_residual(m, wire);
        ex.all_reduce(m, wire)
    }

    /// `m` rounded to `wire`'s type, what rounding dropped kept in the residual.
    fn round_into_residual(&mut self, m: &mut [f32], wire: Precision) {
        for (v, e) in m.iter_mut().zip(self.residual.iter_mut()) {
            let sent = round16(*v, wire);
            *e = *v - sent;
            *v = sent;
        }
    }

    /// A 16-bit scheme's step without its exchange, for a caller that sums the result itself
    /// (ZeRO-2's 16-bit reduce-scatter): `grad` becomes this rank's contribution, `g + e`
    /// rounded to the scheme's type with what rounding dropped kept in the residual, exactly
    /// what [`reduce`](Self::reduce) hands its all-reduce; returns that type. `None`, touching
    /// nothing, for the schemes whose contribution is not a dense buffer to sum (top-k,
    /// PowerSGD, none).
    pub fn narrow_alone(&mut self, grad: &mut [f32]) -> Option<Precision> {
        assert_eq!(
            grad.len(),
            self.len,
            "the gradient has the compressor's layout"
        );
        let wire = match self.scheme {
            Compression::Bf16 => Precision::Bf16,
            Compression::F16 => Precision::F16,
            _ => return None,
        };
        self.step += 1;
        if self.residual.len() != self.len {
            self.residual = vec![0.0; self.len];
        }
        grad.iter_mut()
            .zip(&self.residual)
            .for_each(|(g, e)| *g += e);
        self.round_into_residual(grad, wire);
        Some(wire)
    }

    fn top_k_reduce<E: Exchange>(&mut self, m: &mut [f32], ex: &mut E) -> Result<(), E::Error> {
        let k = self.top_k();
        let chosen = top_k_indices(m, k);
        let mut payload = Vec::with_capacity(2 * k);
        // Indices travel bit-cast in f32 words: collectives copy them, never add them.
        payload.extend(chosen.iter().map(|&i| f32::from_bits(i as u32)));
        payload.extend(chosen.iter().map(|&i| m[i]));
        self.residual.copy_from_slice(m);
        chosen.iter().for_each(|&i| self.residual[i] = 0.0);
        let world = ex.world();
        let mut all = vec![0.0f32; 2 * k * world];
        if world > 1 {
            ex.all_gather(&payload, &mut all)?;
        } else {
            all.copy_from_slice(&payload);
        }
        m.fill(0.0);
        for (rank, msg) in all.chunks_exact(2 * k.max(1)).enumerate() {
            let (idx, vals) = msg.split_at(k);
            for (&i, &v) in idx.iter().zip(vals) {
                let index = i.to_bits();
                let slot = m.get_mut(index as usize).ok_or(CompressError::BadIndex {
                    rank,
                    index,
                    len: self.len,
                })?;
                *slot += v;
            }
        }
        Ok(())
    }

    fn power_sgd<E: Exchange>(&mut self, m: &mut [f32], ex: &mut E) -> Result<(), E::Error> {
        // First exchange: every P = M Q, then the parameters sent whole.
        let mut first = Vec::new();
        for (mat, q) in self.matrices.iter().zip(&self.q) {
            first.extend(mat_mul_q(mat, m, q));
        }
        for r in &self.whole {
            first.extend_from_slice(&m[r.clone()]);
        }
        ex.all_reduce(&mut first, Precision::F32)?;
        let mut at = 0;
        let mut ps = Vec::with_capacity(self.matrices.len());
        for mat in &self.matrices {
            let mut p = first[at..at + mat.n() * mat.r].to_vec();
            orthogonalise(&mut p, mat.n(), mat.r);
            ps.push(p);
            at += mat.n() * mat.r;
        }
        for r in &self.whole {
            m[r.clone()].copy_from_slice(&first[at..at + r.len()]);
            self.residual[r.clone()].fill(0.0);
            at += r.len();
        }
        // Second exchange: Q = Mᵀ P. This rank contributes P Qᵀ; the rest is its residual.
        let mut second = Vec::new();
        for (mat, p) in self.matrices.iter().zip(&ps) {
            let q = mat_t_mul_p(mat, m, p);
            let region = mat.start..mat.start + mat.rows * mat.cols;
            self.residual[region.clone()].copy_from_slice(&m[region]);
            let (pv, qt) = factors(mat);
            products::product(
                &mut self.residual,
                mat.view(),
                true,
                -1.0,
                (p, pv),
                (&q, qt),
            );
            second.extend(q);
        }
        ex.all_reduce(&mut second, Precision::F32)?;
        let mut at = 0;
        for ((mat, p), keep) in self.matrices.iter().zip(&ps).zip(self.q.iter_mut()) {
            let q = &second[at..at + mat.m() * mat.r];
            let (pv, qt) = factors(mat);
            products::product(m, mat.view(), false, 1.0, (p, pv), (q, qt));
            // Warm start: the next step's power iteration starts from this step's Q.
            keep.copy_from_slice(q);
            at += mat.m() * mat.r;
        }
        Ok(())
    }

    /// The state to checkpoint.
    pub fn state(&self) -> CompressorState {
        CompressorState {
            step: self.step,
            residual: self.residual.clone(),
            q: self.q.clone(),
        }
    }

    /// Take a saved state (of a compressor of the same scheme and shapes).
    pub fn restore(&mut self, state: CompressorState) -> Result<(), CompressError> {
        let bad = |reason: String| Err(CompressError::State { reason });
        if !state.residual.is_empty() && state.residual.len() != self.len {
            return bad(format!(
                "the residual holds {} elements, the gradient {}",
                state.residual.len(),
                self.len
            ));
        }
        let fits = state.q.len() == self.q.len()
            && state.q.iter().zip(&self.q).all(|(a, b)| a.len() == b.len());
        if !fits {
            return bad(format!(
                "{} PowerSGD factor(s) saved, this job compresses {} matrices at {}",
                state.q.len(),
                self.q.len(),
                self.scheme
            ));
        }
        self.step = state.step;
        self.residual = state.residual;
        self.q = state.q;
        Ok(())
    }
}

/// `v` rounded to `wire`'s 16-bit type and back.
fn round16(v: f32, wire: Precision) -> f32 {
    match wire {
        Precision::Bf16 => half::bf16::from_f32(v).to_f32(),
        Precision::F16 => half::f16::from_f32(v).to_f32(),
        Precision::F32 => v,
    }
}

/// The indices of the `k` elements of largest magnitude (ties: the lower index), ascending.
pub(crate) fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let k = k.min(values.len());
    if k < values.len() {
        let order =
            |a: &usize, b: &usize| values[*b].abs().total_cmp(&values[*a].abs()).then(a.cmp(b));
        idx.select_nth_unstable_by(k, order);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// `n` values uniform in [-1, 1) from a splitmix64 stream: the same on every rank.
fn seeded_uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// P = M Q (`n × r`, row-major) for the `n × m` view of `mat`.
fn mat_mul_q(mat: &Matrix, flat: &[f32], q: &[f32]) -> Vec<f32> {
    let (n, m, r) = (mat.n(), mat.m(), mat.r);
    let mut p = vec![0.0f32; n * r];
    let (pv, qv) = (View::row_major(0, n, r), View::row_major(0, m, r));
    products::product(&mut p, pv, false, 1.0, (flat, mat.view()), (q, qv));
    p
}

/// Q = Mᵀ P (`m × r`, row-major) for the `n × m` view of `mat`.
fn mat_t_mul_p(mat: &Matrix, flat: &[f32], p: &[f32]) -> Vec<f32> {
    let (n, m, r) = (mat.n(), mat.m(), mat.r);
    let mut q = vec![0.0f32; m * r];
    let (pv, qv) = (View::row_major(0, n, r), View::row_major(0, m, r));
    products::product(&mut q, qv, false, 1.0, (flat, mat.view().t()), (p, pv));
    q
}

/// The views of P (`n × r`) and of Qᵀ (`r × m`, Q stored `m × r` row-major) whose product is
/// the matrix's rank-`r` approximation P Qᵀ.
fn factors(mat: &Matrix) -> (View, View) {
    (
        View::row_major(0, mat.n(), mat.r),
        View::row_major(0, mat.m(), mat.r).t(),
    )
}

/// Make the `r` columns of `p` (`n × r`, row-major, `r ≤ n`) orthonormal: modified
/// Gram-Schmidt, twice, in `f64`. A column that is (numerically) in the span of the earlier
/// ones is replaced by the first unit vector that is not, so the columns always span `r`
/// dimensions (at `r = n`, all of them: CMP-2).
pub(crate) fn orthogonalise(p: &mut [f32], n: usize, r: usize) {
    let mut cols: Vec<Vec<f64>> = (0..r)
        .map(|c| (0..n).map(|i| f64::from(p[i * r + c])).collect())
        .collect();
    let project_out = |v: &mut Vec<f64>, done: &[Vec<f64>]| {
        for _ in 0..2 {
            for u in done {
                let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(a, b)| *a -= d * b);
            }
        }
    };
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    for c in 0..r {
        let (done, rest) = cols.split_at_mut(c);
        let v = &mut rest[0];
        let before = norm(v);
        project_out(v, done);
        let after = norm(v);
        if !(after > 1e-6 * before && after > 0.0) {
            *v = (0..n)
                .find_map(|t| {
                    let mut e = vec![0.0; n];
                    e[t] = 1.0;
                    project_out(&mut e, done);
                    (norm(&e).powi(2) > 0.5 / n as f64).then_some(e)
                })
                .expect("fewer than n orthonormal columns leave a unit vector outside their span");
        }
        let len = norm(v);
        v.iter_mut().for_each(|a| *a /= len);
    }
    for (c, col) in cols.iter().enumerate() {
        for (i, v) in col.iter().enumerate() {
            p[i * r + c] = *v as f32;
        }
    }
}

#[cfg(test)]
mod tests;
