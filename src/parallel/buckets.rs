//! Gradient buckets: how a model's gradients are grouped for all-reduce.
//!
//! Pure. Like Horovod's tensor fusion: small tensors (fewer than `fuse_below` elements) are
//! packed, in order, into fused buckets that are copied into one buffer and reduced together;
//! a large tensor is reduced in place, in chunks of at most `bucket_elems`, with no copy.
//! Invariants:
//! - BUCKET-1: every element of every tensor is in exactly one bucket, and no bucket holds more
//!   than `bucket_elems` elements;
//! - BUCKET-2: buckets follow the tensors' order, so every replica reduces the same buckets in
//!   the same order.

use std::ops::Range;

/// One collective's worth of gradient elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bucket {
    /// Consecutive small tensors `tensors`, copied into one buffer and reduced together.
    Fused {
        /// Indices of the tensors, in order.
        tensors: Range<usize>,
        /// Total elements.
        len: usize,
    },
    /// A chunk of one large tensor, reduced in place.
    InPlace {
        /// Index of the tensor.
        tensor: usize,
        /// The chunk's element range inside the tensor.
        range: Range<usize>,
    },
}

impl Bucket {
    /// Number of elements the bucket reduces.
    pub fn len(&self) -> usize {
        match self {
            Bucket::Fused { len, .. } => *len,
            Bucket::InPlace { range, .. } => range.len(),
        }
    }

    /// Whether the bucket is empty (never produced by [`plan_buckets`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Group tensors of these sizes into buckets (BUCKET-1, BUCKET-2). Empty tensors are skipped.
pub fn plan_buckets(sizes: &[usize], bucket_elems: usize, fuse_below: usize) -> Vec<Bucket> {
    let cap = bucket_elems.max(1);
    let mut out = Vec::new();
    let mut fused: Option<(usize, usize, usize)> = None; // (first, end, len)
    let flush = |fused: &mut Option<(usize, usize, usize)>, out: &mut Vec<Bucket>| {
        if let Some((first, end, len)) = fused.take() {
            out.push(Bucket::Fused {
                tensors: first..end,
                len,
            });
        }
    };
    for (i, &n) in sizes.iter().enumerate() {
        if n == 0 {
            continue;
        }
        if n < fuse_below.min(cap + 1) {
            match &mut fused {
                Some((_, end, len)) if *len + n <= cap && *end == i => {
                    *end = i + 1;
                    *len += n;
                }
                _ => {
                    flush(&mut fused, &mut out);
                    fused = Some((i, i + 1, n));
                }
            }
        } else {
            flush(&mut fused, &mut out);
            let mut start = 0;
            while start < n {
                let end = (start + cap).min(n);
                out.push(Bucket::InPlace {
                    tensor: i,
                    range: start..end,
                });
                start = end;
            }
        }
    }
    flush(&mut fused, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn bucket_1_and_2_every_element_once_in_order_and_bounded(
            sizes in proptest::collection::vec(0usize..5_000, 0..20),
            cap in 1usize..3_000,
            fuse in 0usize..4_000,
        ) {
            let buckets = plan_buckets(&sizes, cap, fuse);
            // Walk the buckets and check they visit (tensor, element) in order, once each.
            let mut next = (0usize, 0usize);
            let advance = |next: &mut (usize, usize), sizes: &[usize]| {
                while next.0 < sizes.len() && next.1 >= sizes[next.0] {
                    *next = (next.0 + 1, 0);
                }
            };
            advance(&mut next, &sizes);
            for b in &buckets {
                prop_assert!(!b.is_empty());
                prop_assert!(b.len() <= cap);
                match b {
                    Bucket::Fused { tensors, len } => {
                        let mut total = 0;
                        for t in tensors.clone() {
                            prop_assert_eq!(next, (t, 0));
                            total += sizes[t];
                            next = (t, sizes[t]);
                            advance(&mut next, &sizes);
                        }
                        prop_assert_eq!(total, *len);
                    }
                    Bucket::InPlace { tensor, range } => {
                        prop_assert_eq!(next, (*tensor, range.start));
                        next = (*tensor, range.end);
                        advance(&mut next, &sizes);
                    }
                }
            }
            prop_assert_eq!(next.0, sizes.len());
        }
    }

    #[test]
    fn small_tensors_are_fused_large_ones_reduced_in_place() {
        let b = plan_buckets(&[10, 20, 1000, 5], 600, 100);
        assert_eq!(
            b,
            vec![
                Bucket::Fused {
                    tensors: 0..2,
                    len: 30
                },
                Bucket::InPlace {
                    tensor: 2,
                    range: 0..600
                },
                Bucket::InPlace {
                    tensor: 2,
                    range: 600..1000
                },
                Bucket::Fused {
                    tensors: 3..4,
                    len: 5
                },
            ]
        );
    }
}
