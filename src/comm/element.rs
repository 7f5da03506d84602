//! Element types and the reduction kernels over them. f16 and bf16 are widened to f32 for
//! every reduction and rounded once at the end (COMM-5).

use std::any::TypeId;

use half::{bf16, f16};

use super::{DType, ReduceOp};

pub(crate) mod bits16;

/// A scalar a collective can move: `f32`, `half::f16` or `half::bf16` (sealed).
///
/// Reductions over f16 and bf16 accumulate in f32 and round once.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static + std::fmt::Debug {
    /// The tag compared between ranks before data moves.
    const DTYPE: DType;
    /// Widens (exactly) to f32.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(v: f32) -> Self;
}

#[allow(unreachable_pub)] // the usual sealed-trait pattern: public, but unnameable outside
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// The slice as f32 when `T` is f32.
pub(crate) fn as_f32<T: Element>(s: &[T]) -> Option<&[f32]> {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (same TypeId), so the cast is the identity.
        Some(unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<f32>(), s.len()) })
    } else {
        None
    }
}

/// The slice as mutable f32 when `T` is f32.
pub(crate) fn as_f32_mut<T: Element>(s: &mut [T]) -> Option<&mut [f32]> {
    if TypeId::of::<T>() == TypeId::of::<f32>() {
        // SAFETY: T is f32 (same TypeId), so the cast is the identity; the borrow is moved.
        Some(unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<f32>(), s.len()) })
    } else {
        None
    }
}

/// The bit patterns of a 16-bit slice (f16 and bf16 are transparent `u16`s).
fn as_bits<T: Element>(s: &[T]) -> Option<&[u16]> {
    (T::DTYPE != DType::F32 && std::mem::size_of::<T>() == 2).then(|| {
        // SAFETY: T is f16 or bf16, `#[repr(transparent)]` over u16 (size checked).
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len()) }
    })
}

/// The mutable bit patterns of a 16-bit slice.
fn as_bits_mut<T: Element>(s: &mut [T]) -> Option<&mut [u16]> {
    (T::DTYPE != DType::F32 && std::mem::size_of::<T>() == 2).then(|| {
        // SAFETY: as in `as_bits`; every u16 is a valid f16 and bf16; the borrow is moved.
        unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u16>(), s.len()) }
    })
}

/// Widens `src` into `dst` (same length).
pub(crate) fn widen<T: Element>(dst: &mut [f32], src: &[T]) {
    if let Some(src) = as_f32(src) {
        return dst.copy_from_slice(src);
    }
    if let Some(bits) = as_bits(src) {
        return bits16::widen_bits(T::DTYPE, bits, dst);
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Rounds `src` into `dst` (same length).
pub(crate) fn narrow<T: Element>(dst: &mut [T], src: &[f32]) {
    if let Some(dst) = as_f32_mut(dst) {
        return dst.copy_from_slice(src);
    }
    if let Some(bits) = as_bits_mut(dst) {
        return bits16::narrow_bits(T::DTYPE, src, bits);
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(*s);
    }
}

/// `acc[i] = acc[i] ⊕ src[i]`; Mean combines as Sum (see [`finish`]).
pub(crate) fn combine(acc: &mut [f32], src: &[f32], op: ReduceOp) {
    let n = acc.len().min(src.len());
    let (acc, src) = (&mut acc[..n], &src[..n]);
    // Separate loops per op so each one vectorizes.
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a += *s;
            }
        }
        ReduceOp::Max => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.max(*s);
            }
        }
        ReduceOp::Min => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.min(*s);
            }
        }
    }
}

/// [`combine`] with `src` widened on the fly.
fn combine_widening<T: Element>(acc: &mut [f32], src: &[T], op: ReduceOp) {
    if let Some(src) = as_f32(src) {
        return combine(acc, src, op);
    }
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a += s.to_f32();
            }
        }
        ReduceOp::Max => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.max(s.to_f32());
            }
        }
        ReduceOp::Min => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = a.min(s.to_f32());
            }
        }
    }
}

/// The last step of a reduction: Mean divides by the world size, the others do nothing.
pub(crate) fn finish(acc: &mut [f32], op: ReduceOp, world: usize) {
    if op == ReduceOp::Mean {
        let n = world as f32;
        for a in acc.iter_mut() {
            *a /= n;
        }
    }
}

/// Elements reduced per block: 8 KiB of f32, so a block and its sources stay in L1.
const BLOCK: usize = 2048;

/// `dst = finish(first ⊕ peers[0] ⊕ peers[1] ⊕ ...)`, where `first` is `dst` itself when
/// `None`. Each value is accumulated in f32 and rounded once. Every slice has `dst.len()`
/// elements (shorter ones are a caller bug and are cut to the shortest).
pub(crate) fn reduce_into<T: Element>(
    dst: &mut [T],
    first: Option<&[T]>,
    peers: &[&[T]],
    op: ReduceOp,
    world: usize,
) {
    let len = dst.len();
    if let Some(dst32) = as_f32_mut(dst) {
        // f32: reduce in place in `dst`, block by block, no staging copy.
        let first32 = first.and_then(as_f32);
        let mut start = 0;
        while start < len {
            let end = (start + BLOCK).min(len);
            let block = &mut dst32[start..end];
            if let Some(first) = first32 {
                block.copy_from_slice(&first[start..end]);
            }
            for peer in peers {
                if let Some(peer) = as_f32(peer) {
                    combine(block, &peer[start..end], op);
                }
            }
            finish(block, op, world);
            start = end;
        }
        return;
    }
    let mut acc = [0f32; BLOCK];
    let mut start = 0;
    while start < len {
        let end = (start + BLOCK).min(len);
        let acc = &mut acc[..end - start];
        match first {
            Some(first) => widen(acc, &first[start..end]),
            None => widen(acc, &dst[start..end]),
        }
        for peer in peers {
            combine_widening(acc, &peer[start..end], op);
        }
        finish(acc, op, world);
        narrow(&mut dst[start..end], acc);
        start = end;
    }
}
