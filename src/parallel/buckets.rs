//! Gradient buckets: how the flat gradient buffer is cut for all-reduce.
//!
//! Pure. Buckets are contiguous, cover the buffer exactly once, in order, and hold at most
//! `bucket_elems` elements each (BUCKET-1), so a bucket can be reduced as soon as it is filled.

use std::ops::Range;

/// Cut `len` elements into consecutive ranges of at most `bucket_elems` (BUCKET-1).
pub fn bucket_ranges(len: usize, bucket_elems: usize) -> Vec<Range<usize>> {
    let size = bucket_elems.max(1);
    (0..len.div_ceil(size))
        .map(|i| i * size..((i + 1) * size).min(len))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bucket_1_cover_exactly_once_in_order(len in 0usize..10_000, size in 0usize..3_000) {
            let b = bucket_ranges(len, size);
            let mut next = 0;
            for r in &b {
                prop_assert_eq!(r.start, next);
                prop_assert!(r.end > r.start);
                prop_assert!(r.len() <= size.max(1));
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }
    }
}
