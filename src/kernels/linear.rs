//! `x·W + b` over rows, forward and backward, each product one `gemm` call reading its
//! operands where they lie (a transposed or strided `x` without a copy) and writing into a
//! buffer allocated once: the bias rows first, the product added onto them. Burn's Flex
//! matmul allocates its output zeroed and copies it into an aligned buffer, and its autodiff
//! adds the bias in a separate pass.
//!
//! Backward: `dx = dy·Wᵀ`, `dW = xᵀ·dy`, `db = Σ_rows dy`.

use super::products::{View, product};

/// A matrix's elements and where each lies.
pub(crate) type Matrix<'a> = (&'a [f32], View);

/// `x·W + b` (`x` `rows × in`, `W` `in × out`, `b` of `out`), row-major `rows × out`.
pub(crate) fn forward(x: Matrix, w: Matrix, bias: &[f32]) -> Vec<f32> {
    let (rows, out) = (x.1.rows, w.1.cols);
    let mut y = Vec::with_capacity(rows * out);
    for _ in 0..rows {
        y.extend_from_slice(&bias[..out]);
    }
    product(&mut y, View::row_major(0, rows, out), true, 1.0, x, w);
    y
}

/// `dy·Wᵀ` (`rows × in`, row-major).
pub(crate) fn input_grad(w: Matrix, grad: Matrix) -> Vec<f32> {
    let (rows, d_in) = (grad.1.rows, w.1.rows);
    let mut dx = vec![0f32; rows * d_in];
    let wt = (w.0, w.1.t());
    product(
        &mut dx,
        View::row_major(0, rows, d_in),
        false,
        1.0,
        grad,
        wt,
    );
    dx
}

/// `xᵀ·dy` (`in × out`, row-major).
pub(crate) fn weight_grad(x: Matrix, grad: Matrix) -> Vec<f32> {
    let (d_in, out) = (x.1.cols, grad.1.cols);
    let mut dw = vec![0f32; d_in * out];
    let xt = (x.0, x.1.t());
    product(&mut dw, View::row_major(0, d_in, out), false, 1.0, xt, grad);
    dw
}

/// `Σ_rows dy` (of `out`).
pub(crate) fn bias_grad((g, v): Matrix) -> Vec<f32> {
    let mut db = vec![0f32; v.cols];
    for i in 0..v.rows {
        let start = v.offset + i * v.rs;
        if v.cs == 1 {
            for (d, x) in db.iter_mut().zip(&g[start..start + v.cols]) {
                *d += x;
            }
        } else {
            for (j, d) in db.iter_mut().enumerate() {
                *d += g[start + j * v.cs];
            }
        }
    }
    db
}
