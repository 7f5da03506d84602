//! What a block job's rank held during a step, counted by the worker itself (not the
//! process's resident memory): the bytes of full parameters materialised, of parameter
//! shards, of gradients and of stashed activations, instruction by instruction.
//!
//! Invariants:
//! - MEM-1: the figures are `f32` words × 4 of what the worker's own structures hold (the
//!   modules' trainable parameters, the shards, the accumulated or reduced gradients, the
//!   stashed boundary tensors); Burn's autodiff graph inside a block is not counted.
//! - MEM-2: every peak is the maximum over the step's [`MemoryPoint`]s, one taken after
//!   every instruction, after each block's reduction and after the update.

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

/// The most full-parameter bytes a rank may hold at once when `in_flight` blocks beyond the
/// one computing may be materialised: the largest sum over `in_flight + 1` consecutive
/// blocks of `block_bytes`.
pub fn full_param_bound(block_bytes: &[u64], in_flight: usize) -> u64 {
    let w = (in_flight + 1).min(block_bytes.len()).max(1);
    block_bytes
        .windows(w)
        .map(|x| x.iter().sum::<u64>())
        .max()
        .unwrap_or(0)
}
