//! f32 to and from the bit patterns of f16 and bf16, a slice at a time: what the 16-bit
//! collectives spend their CPU on (widening inputs, rounding results, TCP-7's final values
//! and COMM-9's partial sums on the wire). Bit-identical to `half`'s per-value conversions
//! (round to nearest even, NaNs kept quiet), written so that they vectorise: bf16 as
//! branch-free integer operations, f16 through `half`'s slice conversions (F16C where the CPU
//! has it). Per-value conversions in a loop ran 3–4× slower than the TCP ring they fed.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::combine;
use crate::comm::{DType, ReduceOp};

/// Elements converted per stack block.
const BLOCK: usize = 1024;

/// bf16's bits of `x`, as `half::bf16::from_f32`: round to nearest even, NaN made quiet.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let quiet = ((b >> 16) | 0x0040) as u16;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        quiet
    } else {
        rounded
    }
}

/// The f32 of bf16 bits, as `half::bf16::to_f32` (a NaN comes out quiet).
#[inline(always)]
fn bf16_value(i: u16) -> f32 {
    let quiet = if i & 0x7FFF > 0x7F80 { 0x0040 } else { 0 };
    f32::from_bits(u32::from(i | quiet) << 16)
}

#[inline(always)]
fn bf16_narrow(src: &[f32], dst: &mut [u16]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, s)| *d = bf16_bits(*s));
}

#[inline(always)]
fn bf16_widen(src: &[u16], dst: &mut [f32]) {
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, s)| *d = bf16_value(*s));
}

/// The bf16 loops compiled for the widest vectors the CPU has (chosen at run time; the
/// binary itself targets baseline x86-64, where they run 4 lanes wide).
#[cfg(target_arch = "x86_64")]
mod wide {
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn narrow_avx512(src: &[f32], dst: &mut [u16]) {
        super::bf16_narrow(src, dst);
    }

    /// # Safety
    /// The CPU has AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn widen_avx512(src: &[u16], dst: &mut [f32]) {
        super::bf16_widen(src, dst);
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn narrow_avx2(src: &[f32], dst: &mut [u16]) {
        super::bf16_narrow(src, dst);
    }

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen_avx2(src: &[u16], dst: &mut [f32]) {
        super::bf16_widen(src, dst);
    }
}

fn bf16_narrow_fastest(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: checked just above.
            return unsafe { wide::narrow_avx512(src, dst) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: checked just above.
            return unsafe { wide::narrow_avx2(src, dst) };
        }
    }
    bf16_narrow(src, dst);
}

fn bf16_widen_fastest(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bw") {
            // SAFETY: checked just above.
            return unsafe { wide::widen_avx512(src, dst) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: checked just above.
            return unsafe { wide::widen_avx2(src, dst) };
        }
    }
    bf16_widen(src, dst);
}

/// `dst[i]` = the bits of `src[i]` rounded to `dtype` (f16 or bf16; f32 is not 16-bit and
/// leaves `dst` as it is). Same lengths.
pub(crate) fn narrow_bits(dtype: DType, src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    match dtype {
        DType::BF16 => bf16_narrow_fastest(src, dst),
        DType::F16 => {
            let dst: &mut [f16] = bytemuck::cast_slice_mut(dst);
            dst.convert_from_f32_slice(src);
        }
        DType::F32 => {}
    }
}

/// `dst[i]` = the value of the `dtype` bits `src[i]`. Same lengths.
pub(crate) fn widen_bits(dtype: DType, src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    match dtype {
        DType::BF16 => bf16_widen_fastest(src, dst),
        DType::F16 => {
            let src: &[f16] = bytemuck::cast_slice(src);
            src.convert_to_f32_slice(dst);
        }
        DType::F32 => {}
    }
}

/// Rounds every value to `dtype` and back (COMM-9's partial sum as it travels). Nothing to
/// do for f32.
pub(crate) fn round_in_place(dtype: DType, values: &mut [f32]) {
    if dtype == DType::F32 {
        return;
    }
    let mut bits = [0u16; BLOCK];
    for block in values.chunks_mut(BLOCK) {
        let bits = &mut bits[..block.len()];
        narrow_bits(dtype, block, bits);
        widen_bits(dtype, bits, block);
    }
}

/// `acc` ⊕= the values of the `dtype` bits `src` (`op` `None`: `acc` = them).
#[cfg_attr(
    not(feature = "cluster"),
    allow(dead_code, reason = "the cross-process transports' wire")
)]
pub(crate) fn widen_into(dtype: DType, src: &[u16], acc: &mut [f32], op: Option<ReduceOp>) {
    let Some(op) = op else {
        return widen_bits(dtype, src, acc);
    };
    let mut values = [0f32; BLOCK];
    for (acc, src) in acc.chunks_mut(BLOCK).zip(src.chunks(BLOCK)) {
        let values = &mut values[..acc.len()];
        widen_bits(dtype, src, values);
        combine(acc, values, op);
    }
}

/// [`widen_into`] from little-endian bytes (a received payload); `bytes.len()` is twice the
/// elements.
#[cfg_attr(
    not(feature = "cluster"),
    allow(dead_code, reason = "the cross-process transports' wire")
)]
pub(crate) fn widen_bytes_into(dtype: DType, bytes: &[u8], acc: &mut [f32], op: Option<ReduceOp>) {
    if cfg!(target_endian = "little")
        && let Ok(bits) = bytemuck::try_cast_slice::<u8, u16>(bytes)
    {
        return widen_into(dtype, bits, acc, op);
    }
    // Unaligned (or big-endian): through a block of decoded bits.
    let mut bits = [0u16; BLOCK];
    for (acc, bytes) in acc.chunks_mut(BLOCK).zip(bytes.chunks(2 * BLOCK)) {
        let bits = &mut bits[..acc.len()];
        for (b, pair) in bits.iter_mut().zip(bytes.chunks_exact(2)) {
            *b = u16::from_le_bytes([pair[0], pair[1]]);
        }
        widen_into(dtype, bits, acc, op);
    }
}

/// `values` rounded to `dtype`, as little-endian bytes (what a 16-bit message carries).
#[cfg_attr(
    not(feature = "cluster"),
    allow(dead_code, reason = "the cross-process transports' wire")
)]
pub(crate) fn narrow_to_bytes(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * 2];
    if cfg!(target_endian = "little")
        && let Ok(bits) = bytemuck::try_cast_slice_mut::<u8, u16>(&mut out)
    {
        narrow_bits(dtype, values, bits);
        return out;
    }
    let mut bits = [0u16; BLOCK];
    for (values, out) in values.chunks(BLOCK).zip(out.chunks_mut(2 * BLOCK)) {
        let bits = &mut bits[..values.len()];
        narrow_bits(dtype, values, bits);
        for (pair, b) in out.chunks_exact_mut(2).zip(bits.iter()) {
            pair.copy_from_slice(&b.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Every f32 bit pattern narrows to `half`'s bits, and every 16-bit pattern widens
        /// to `half`'s f32 (NaNs compared by their bits too).
        #[test]
        fn conversions_equal_half_bit_for_bit(
            values in prop::collection::vec(any::<u32>(), 0..3000),
            offset in 0usize..3,
        ) {
            let values: Vec<f32> = values.into_iter().map(f32::from_bits).collect();
            let values = &values[offset.min(values.len())..];
            for dtype in [DType::F16, DType::BF16] {
                let mut bits = vec![0u16; values.len()];
                narrow_bits(dtype, values, &mut bits);
                let expected: Vec<u16> = values
                    .iter()
                    .map(|v| match dtype {
                        DType::BF16 => bf16::from_f32(*v).to_bits(),
                        _ => f16::from_f32(*v).to_bits(),
                    })
                    .collect();
                prop_assert_eq!(&bits, &expected);
                let mut back = vec![0f32; bits.len()];
                widen_bits(dtype, &bits, &mut back);
                for (b, v) in bits.iter().zip(&back) {
                    let want = match dtype {
                        DType::BF16 => bf16::from_bits(*b).to_f32(),
                        _ => f16::from_bits(*b).to_f32(),
                    };
                    prop_assert_eq!(v.to_bits(), want.to_bits());
                }
                let bytes = narrow_to_bytes(dtype, values);
                let mut from_bytes = vec![0f32; values.len()];
                widen_bytes_into(dtype, &bytes, &mut from_bytes, None);
                prop_assert_eq!(
                    from_bytes.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    back.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
                // The same bytes one byte off their alignment take the slow path alike.
                let mut shifted = vec![0u8; bytes.len() + 1];
                shifted[1..].copy_from_slice(&bytes);
                let mut acc = vec![1f32; values.len()];
                widen_bytes_into(dtype, &shifted[1..], &mut acc, Some(ReduceOp::Sum));
                for ((a, v), w) in acc.iter().zip(&back).zip(values) {
                    if w.is_finite() && v.is_finite() {
                        prop_assert_eq!(a.to_bits(), (1.0 + v).to_bits());
                    }
                }
                let mut rounded = values.to_vec();
                round_in_place(dtype, &mut rounded);
                prop_assert_eq!(
                    rounded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    back.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }
}
