//! The distributed sampler: which sample ids each replica reads at each step.
//!
//! Pure. Every epoch is a seeded permutation of `0..len`; step `s` of an epoch takes the
//! `s`-th run of `global_batch` ids of that permutation (the last incomplete batch is dropped),
//! and replica `r` of `dp` takes the `r`-th contiguous share of it. Invariants:
//! - SAMPLER-1: the replicas' shares of one step are disjoint and together are the step's
//!   global batch;
//! - SAMPLER-2: no id is read twice within an epoch;
//! - SAMPLER-3: the same (seed, len, global batch) gives the same ids on every replica and run.
//!
//! - **SAMPLER-4** a global batch that does not divide by the replicas (after a loss) is split with
//!   shares differing by at most one sample; each micro-batch's loss is weighted by its share of
//!   the step's samples before backward, so the summed gradient is the global mean.

use serde::{Deserialize, Serialize};

use crate::config::InvalidConfig;

/// Which ids each replica reads at each step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DistributedSampler {
    len: usize,
    global_batch: usize,
    seed: u64,
}

/// Where a step falls in the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    /// The epoch (0-based).
    pub epoch: u64,
    /// The batch index inside the epoch.
    pub batch: u64,
}

impl DistributedSampler {
    /// A sampler over `len` samples with `global_batch` samples per step.
    pub fn new(len: usize, global_batch: usize, seed: u64) -> Result<Self, InvalidConfig> {
        if global_batch == 0 {
            return Err(InvalidConfig(
                "batch_size is 0: use at least 1 sample per step".into(),
            ));
        }
        if len < global_batch {
            return Err(InvalidConfig(format!(
                "the dataset has {len} samples, fewer than one global batch of {global_batch}: \
                 lower batch_size or use more data"
            )));
        }
        Ok(Self {
            len,
            global_batch,
            seed,
        })
    }

    /// Steps in one epoch (incomplete batches are dropped).
    pub fn steps_per_epoch(&self) -> u64 {
        (self.len / self.global_batch) as u64
    }

    /// Where global step `step` falls.
    pub fn cursor(&self, step: u64) -> DataCursor {
        let per_epoch = self.steps_per_epoch();
        DataCursor {
            epoch: step / per_epoch,
            batch: step % per_epoch,
        }
    }

    /// The permutation of `0..len` used in `epoch`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        let mut rng = SplitMix64::new(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // Fisher–Yates.
        for i in (1..order.len()).rev() {
            let j = (rng.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }

    /// Samples in every step's global batch.
    pub fn batch_size(&self) -> usize {
        self.global_batch
    }

    /// The global batch of `step`, in replica order.
    pub fn global_batch(&self, step: u64) -> Vec<usize> {
        let c = self.cursor(step);
        let start = c.batch as usize * self.global_batch;
        self.epoch_order(c.epoch)[start..start + self.global_batch].to_vec()
    }

    /// The ids replica `replica` of `replicas` reads at `step` (SAMPLER-1). When the global
    /// batch does not divide by `replicas` (after a replica was lost), the first
    /// `global % replicas` replicas take one sample more (SAMPLER-4).
    pub fn replica_batch(&self, step: u64, replica: usize, replicas: usize) -> Vec<usize> {
        let global = self.global_batch(step);
        global[crate::mesh::chunk_range(global.len(), replicas.max(1), replica)].to_vec()
    }

    /// Every replica's ids at `step`, in replica order (one permutation computed once).
    pub fn split(&self, step: u64, replicas: usize) -> Vec<Vec<usize>> {
        let order = self.epoch_order(self.cursor(step).epoch);
        self.split_in(&order, step, replicas)
    }

    /// Like [`split`](Self::split), reading the ids from `order`, which must be
    /// `epoch_order` of `step`'s epoch (so a caller computes each epoch's order once).
    pub fn split_in(&self, order: &[usize], step: u64, replicas: usize) -> Vec<Vec<usize>> {
        let start = self.cursor(step).batch as usize * self.global_batch;
        let global = &order[start..start + self.global_batch];
        (0..replicas.max(1))
            .map(|r| global[crate::mesh::chunk_range(global.len(), replicas.max(1), r)].to_vec())
            .collect()
    }
}

/// A small, stable pseudo-random generator (SplitMix64): the permutation must not change when
/// a dependency updates its generator.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        #[test]
        fn sampler_1_replica_shares_are_disjoint_and_make_the_global_batch(
            dp in 1usize..8, local in 1usize..16, odd in 0usize..8, extra in 0usize..40, seed in any::<u64>(), step in 0u64..50,
        ) {
            // SAMPLER-4: also when the global batch does not divide by dp.
            let global = dp * local + odd;
            let s = DistributedSampler::new(global + extra, global, seed).unwrap();
            let shares = s.split(step, dp);
            prop_assert_eq!(shares.len(), dp);
            let mut seen = HashSet::new();
            for (r, share) in shares.iter().enumerate() {
                prop_assert_eq!(share, &s.replica_batch(step, r, dp));
                for id in share { prop_assert!(seen.insert(*id)); }
            }
            let global_ids: HashSet<usize> = s.global_batch(step).into_iter().collect();
            prop_assert_eq!(seen, global_ids);
            let sizes: Vec<usize> = shares.iter().map(Vec::len).collect();
            prop_assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }

        #[test]
        fn sampler_2_no_sample_twice_in_an_epoch(len in 1usize..200, batch in 1usize..50, seed in any::<u64>()) {
            prop_assume!(batch <= len);
            let s = DistributedSampler::new(len, batch, seed).unwrap();
            let mut seen = HashSet::new();
            for step in 0..s.steps_per_epoch() {
                for id in s.global_batch(step) {
                    prop_assert!(id < len);
                    prop_assert!(seen.insert(id));
                }
            }
            prop_assert_eq!(seen.len(), (len / batch) * batch);
        }
    }

    #[test]
    fn sampler_3_same_seed_same_ids_and_epochs_differ() {
        let a = DistributedSampler::new(100, 10, 7).unwrap();
        let b = DistributedSampler::new(100, 10, 7).unwrap();
        assert_eq!(a.global_batch(3), b.global_batch(3));
        assert_eq!(a.cursor(12), DataCursor { epoch: 1, batch: 2 });
        assert_ne!(a.epoch_order(0), a.epoch_order(1));
    }

    #[test]
    fn too_little_data_is_refused() {
        assert!(DistributedSampler::new(5, 10, 0).is_err());
        assert!(DistributedSampler::new(5, 0, 0).is_err());
    }
}
