//! What a block job's rank held during a step, counted by the worker itself (not the
//! process's resident memory): the bytes of full parameters materialised, of parameter
//! shards, of gradients and of stashed activations, instruction by instruction.
//!
//! Full parameters are those in the blocks' modules (gathered for a use, or kept for a
//! pending backward) plus those gathered ahead of their use and not yet taken by their
//! block (prefetched, `JobBuilder::blocks_in_flight`): counted from the moment their
//! all-gather is issued, so a buffer being filled on the communication thread counts.
//!
//! Invariants:
//! - MEM-1: the figures are `f32` words × 4 of what the worker's own structures hold (the
//!   modules' trainable parameters, the shards, the accumulated or reduced gradients, the
//!   stashed boundary tensors); Burn's autodiff graph inside a block is not counted.
//! - MEM-2: every peak is the maximum over the step's [`MemoryPoint`]s, one taken before
//!   every forward and backward (its block's parameters gathered, the next ones prefetched:
//!   the moment the most are whole), one after every instruction, one once the step's
//!   reductions are all taken and one after the update.
//! - MEM-3: with recomputed, resharded ZeRO-3 blocks, a rank's peak of full parameters is
//!   at most [`full_param_bound`]`(block_bytes, blocks_in_flight)`: the block computing and
//!   at most `blocks_in_flight` gathered ahead (EXEC-5). Without recompute,
//!   Burn's graph keeps each block's forward parameters until its backward.

use serde::{Deserialize, Serialize};

/// What a rank held at one instant of a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPoint {
    /// Microseconds since the step began.
    pub at_us: u64,
    /// Parameters: full blocks materialised plus the shards of the others.
    pub params: u64,
    /// Gradients (accumulated, then reduced).
    pub grads: u64,
    /// Stashed boundary tensors (activations awaiting their backward).
    pub activations: u64,
}

/// What a rank of a block job held during one step, in bytes (MEM-1, MEM-2).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepMemory {
    /// The most bytes of full (gathered) block parameters held at once.
    pub peak_full_params: u64,
    /// The bytes of parameter shards held between uses (ZeRO-3; 0 otherwise).
    pub param_shards: u64,
    /// The most gradient bytes held at once.
    pub peak_grads: u64,
    /// Optimizer state after the update.
    pub optimizer: u64,
    /// The most bytes of stashed activations held at once.
    pub peak_activations: u64,
    /// One point after every instruction, reduction and update, in order.
    pub timeline: Vec<MemoryPoint>,
}

/// What one block holds now (the executor sums these over a stage's blocks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BlockBytes {
    /// Full parameters materialised (in the module, or kept for a pending backward).
    pub full_params: u64,
    /// This rank's parameter shard (ZeRO-3).
    pub param_shard: u64,
    /// Gradients held.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Stashed boundary tensors.
    pub activations: u64,
}

impl StepMemory {
    /// Record what `blocks` hold now, `at_us` into the step.
    pub(crate) fn record(&mut self, at_us: u64, blocks: impl Iterator<Item = BlockBytes>) {
        let sum = blocks.fold(BlockBytes::default(), |a, b| BlockBytes {
            full_params: a.full_params + b.full_params,
            param_shard: a.param_shard + b.param_shard,
            grads: a.grads + b.grads,
            optimizer: a.optimizer + b.optimizer,
            activations: a.activations + b.activations,
        });
        self.peak_full_params = self.peak_full_params.max(sum.full_params);
        self.param_shards = sum.param_shard;
        self.peak_grads = self.peak_grads.max(sum.grads);
        self.optimizer = sum.optimizer;
        self.peak_activations = self.peak_activations.max(sum.activations);
        self.timeline.push(MemoryPoint {
            at_us,
            params: sum.full_params + sum.param_shard,
            grads: sum.grads,
            activations: sum.activations,
        });
    }
}

/// The most full-parameter bytes a rank of a block job may hold at once with recomputed,
/// resharded blocks (MEM-3) when up to `in_flight` blocks' gathered parameters wait for
/// their use beside the block computing (`JobBuilder::blocks_in_flight`): the largest sum
/// of `in_flight + 1` consecutive entries of the order the rank gathers its blocks in,
/// `0, 1, …, n−1, n−2, …, 0` over and over (each micro-batch's forwards, then its
/// backwards; the last block's backward follows its forward with no gather). A prefetch
/// crosses from one micro-batch's block 0 to the next one's, so the same block may count
/// twice. With `in_flight = 0` it is the largest block.
pub fn full_param_bound(block_bytes: &[u64], in_flight: usize) -> u64 {
    let n = block_bytes.len();
    if n == 0 {
        return 0;
    }
    let cycle: Vec<u64> = (0..n)
        .chain((0..n.saturating_sub(1)).rev())
        .map(|b| block_bytes[b])
        .collect();
    let w = in_flight + 1;
    let order: Vec<u64> = cycle
        .iter()
        .copied()
        .cycle()
        .take(cycle.len() * (w.div_ceil(cycle.len()) + 1))
        .collect();
    order
        .windows(w)
        .map(|x| x.iter().sum::<u64>())
        .max()
        .unwrap_or(0)
}

/// The minor page faults this process has taken so far (Linux: `/proc/self/stat`; `None`
/// elsewhere or when it cannot be read). A fault is memory touched for the first time since
/// the kernel handed it out: the kernel zeroes the page first, so a step that reuses its
/// buffers from the step before takes few, and one whose allocator returned them takes one
/// per page again (issue 50: a third of a GPT's step on `flex`).
pub fn minor_page_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    minor_faults_of(&stat)
}

/// The minor page faults this process took since it had taken `before` (`None` when either
/// count is missing).
pub fn minor_page_faults_since(before: Option<u64>) -> Option<u64> {
    before
        .zip(minor_page_faults())
        .map(|(before, after)| after.saturating_sub(before))
}

/// `minflt`, the 10th field of a `/proc/<pid>/stat` line; the 2nd (the command in
/// parentheses) may hold spaces and parentheses, so fields are counted after its last `)`.
fn minor_faults_of(stat: &str) -> Option<u64> {
    let (_, after) = stat.rsplit_once(')')?;
    // After the command: state (3), ppid, pgrp, session, tty_nr, tpgid, flags, minflt (10).
    after.split_whitespace().nth(7)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{full_param_bound, minor_faults_of, minor_page_faults};

    #[test]
    fn minor_faults_are_the_tenth_field_even_after_a_command_with_spaces_and_parentheses() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 1234 0 5 0 17 3 0 0 20 0 1 0";
        assert_eq!(minor_faults_of(line), Some(1234));
        assert_eq!(minor_faults_of("4242 (cut"), None);
        assert_eq!(minor_faults_of("4242 (x) S 1 2"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn touching_fresh_memory_counts_page_faults() {
        let before = minor_page_faults().expect("linux has /proc/self/stat");
        // 64 MiB touched page by page, kept alive until counted.
        let mut fresh = vec![0u8; 64 << 20];
        for page in fresh.chunks_mut(4096) {
            page[0] = 1;
        }
        let after = minor_page_faults().expect("still readable");
        assert!(
            std::hint::black_box(&fresh)
                .iter()
                .step_by(4096)
                .all(|&b| b == 1)
        );
        // At least one fault per 2 MiB (huge pages), at most what the process could take.
        assert!(after >= before + 32, "{before} → {after}");
    }

    proptest! {
        /// MEM-3's bound: the largest block alone without prefetch, one more block per block
        /// in flight, and never more than the sum of the largest blocks counted twice each.
        #[test]
        fn mem_3_bound_grows_by_at_most_one_block_per_block_in_flight(
            bytes in proptest::collection::vec(1u64..1000, 1..6),
            in_flight in 0usize..6,
        ) {
            let largest = *bytes.iter().max().expect("not empty");
            prop_assert_eq!(full_param_bound(&bytes, 0), largest);
            let bound = full_param_bound(&bytes, in_flight);
            let next = full_param_bound(&bytes, in_flight + 1);
            prop_assert!(next > bound && next <= bound + largest);
            prop_assert!(bound <= largest * (in_flight as u64 + 1));
        }
    }

    #[test]
    fn mem_3_bound_counts_block_0_twice_across_micro_batches() {
        // Order 0 1 2 1 0 | 0 1 2 …: the window (1, 0, 0) is the largest of three.
        assert_eq!(full_param_bound(&[50, 40, 10], 2), 140);
        assert_eq!(full_param_bound(&[50, 40, 10], 1), 100);
        assert_eq!(full_param_bound(&[7], 3), 28);
    }
}
