//! Matrix products through the `gemm` crate — the kernels Burn's `flex` backend multiplies
//! with — on one thread, reading matrices where they lie in their buffers (row- or
//! column-major views, any row stride, no copies): PowerSGD's products
//! (`parallel::compress`) and the fused attention's blocks ([`super::attention`]).
//!
//! Each product runs the same kernel on the same inputs on every rank and every run, so its
//! bits are reproducible; they are not those of a plain loop's sums (the kernel adds in its
//! own blocked order).

/// An `rows × cols` matrix inside a slice: element `(i, j)` at `offset + i·rs + j·cs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) offset: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl View {
    /// A dense row-major `rows × cols` matrix at `offset`.
    pub(crate) fn row_major(offset: usize, rows: usize, cols: usize) -> Self {
        Self {
            offset,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The same elements read as the transposed matrix.
    pub(crate) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element lies inside a slice of `len` elements.
    fn inside(&self, len: usize) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return self.offset <= len;
        }
        let last = self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
        last < len
    }
}

/// `dst := (keep ? dst : 0) + scale · lhs · rhs` over the views, on one thread.
///
/// # Panics
/// If the shapes do not chain or a view leaves its slice: both are bugs of the caller (the
/// views come from the caller's own layout, never from outside the process).
pub(crate) fn product(
    dst: &mut [f32],
    d: View,
    keep: bool,
    scale: f32,
    (lhs, l): (&[f32], View),
    (rhs, r): (&[f32], View),
) {
    assert!(
        l.rows == d.rows && r.cols == d.cols && l.cols == r.rows,
        "product of {}×{} and {}×{} into {}×{}",
        l.rows,
        l.cols,
        r.rows,
        r.cols,
        d.rows,
        d.cols
    );
    assert!(
        d.inside(dst.len()) && l.inside(lhs.len()) && r.inside(rhs.len()),
        "a matrix view leaves its buffer"
    );
    if d.rows == 0 || d.cols == 0 {
        return;
    }
    if l.cols == 0 {
        if !keep {
            for i in 0..d.rows {
                for j in 0..d.cols {
                    dst[d.offset + i * d.rs + j * d.cs] = 0.0;
                }
            }
        }
        return;
    }
    let stride = |s: usize| s as isize;
    // SAFETY: the three views were checked to lie inside their slices above, `dst` is borrowed
    // mutably and the inputs shared, so the kernel reads and writes only memory it may; the
    // dimensions are those of the views.
    unsafe {
        gemm::gemm(
            d.rows,
            d.cols,
            l.cols,
            dst.as_mut_ptr().add(d.offset),
            stride(d.cs),
            stride(d.rs),
            keep,
            lhs.as_ptr().add(l.offset),
            stride(l.cs),
            stride(l.rs),
            rhs.as_ptr().add(r.offset),
            stride(r.cs),
            stride(r.rs),
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(
        d: View,
        dst: &mut [f32],
        keep: bool,
        scale: f32,
        a: (&[f32], View),
        b: (&[f32], View),
    ) {
        for i in 0..d.rows {
            for j in 0..d.cols {
                let s: f64 = (0..a.1.cols)
                    .map(|k| {
                        f64::from(a.0[a.1.offset + i * a.1.rs + k * a.1.cs])
                            * f64::from(b.0[b.1.offset + k * b.1.rs + j * b.1.cs])
                    })
                    .sum();
                let at = d.offset + i * d.rs + j * d.cs;
                let base = if keep { f64::from(dst[at]) } else { 0.0 };
                dst[at] = (base + f64::from(scale) * s) as f32;
            }
        }
    }

    proptest! {
        /// Every layout of the three matrices (row- or column-major, at an offset) gives the
        /// plain loop's product within f32 rounding, and the same bits twice.
        #[test]
        fn products_equal_the_plain_loop(
            (n, k, m) in (0usize..9, 0usize..9, 0usize..9),
            (ta, tb, td) in (any::<bool>(), any::<bool>(), any::<bool>()),
            keep in any::<bool>(),
            seed in any::<u32>(),
        ) {
            let value = |i: usize| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5;
            let view = |offset, rows, cols, t: bool| {
                if t { View::row_major(offset, cols, rows).t() } else { View::row_major(offset, rows, cols) }
            };
            let (a, b) = (view(3, n, k, ta), view(1, k, m, tb));
            let d = view(2, n, m, td);
            let lhs: Vec<f32> = (0..3 + n * k).map(value).collect();
            let rhs: Vec<f32> = (0..1 + k * m).map(|i| value(i + 1000)).collect();
            let start: Vec<f32> = (0..2 + n * m).map(|i| value(i + 5000)).collect();
            let (mut got, mut again, mut want) = (start.clone(), start.clone(), start.clone());
            product(&mut got, d, keep, -1.0, (&lhs, a), (&rhs, b));
            product(&mut again, d, keep, -1.0, (&lhs, a), (&rhs, b));
            naive(d, &mut want, keep, -1.0, (&lhs, a), (&rhs, b));
            prop_assert_eq!(&got, &again);
            for (x, y) in got.iter().zip(&want) {
                prop_assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
            }
        }
    }
}
