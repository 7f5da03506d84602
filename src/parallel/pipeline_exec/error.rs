//! [`ExecError`]: why a pipeline step failed, naming the stage, micro-batch and link.

use std::time::Duration;

use crate::comm::{CollectiveKind, CommError};

/// Why a stage could not execute an instruction.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ExecError {
    /// A receive waited longer than the time-out.
    #[error(
        "stage {stage}: {what} for micro-batch {mb} did not arrive from stage {from} within {waited:?}"
    )]
    Timeout {
        /// The waiting stage.
        stage: u32,
        /// The stage expected to send.
        from: u32,
        /// The micro-batch.
        mb: u32,
        /// Activation or gradient.
        what: &'static str,
        /// How long it waited.
        waited: Duration,
    },
    /// A neighbour's link is gone (its thread ended).
    #[error("stage {stage}: the link with stage {peer} is closed")]
    LinkClosed {
        /// This stage.
        stage: u32,
        /// The neighbour.
        peer: u32,
    },
    /// An instruction found nothing to work on (a schedule bug or a message out of order).
    #[error("stage {stage}: {instr} has no input for micro-batch {mb}")]
    MissingInput {
        /// This stage.
        stage: u32,
        /// The micro-batch.
        mb: u32,
        /// The instruction.
        instr: String,
    },
    /// A boundary tensor has a rank outside 1..=4.
    #[error("a boundary tensor of rank {rank}: ranks 1 to 4 are supported")]
    UnsupportedRank {
        /// The rank.
        rank: usize,
    },
    /// The received gradients do not match the stage's outputs.
    #[error("stage {stage}: gradient for micro-batch {mb} does not match the stage's outputs")]
    ShapeMismatch {
        /// This stage.
        stage: u32,
        /// The micro-batch.
        mb: u32,
    },
    /// The all-reduce of gradients across data-parallel replicas failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The step was aborted because another stage failed.
    #[error("stage {stage}: stopped because another stage of the job failed")]
    Aborted {
        /// This stage.
        stage: u32,
    },
    /// A message arrived for another micro-batch than the instruction names (a schedule that
    /// breaks PIPE-3).
    #[error("stage {stage}: expected micro-batch {expected} from stage {from}, got {got}")]
    OutOfOrder {
        /// This stage.
        stage: u32,
        /// The sender.
        from: u32,
        /// The micro-batch the instruction names.
        expected: u32,
        /// The micro-batch that arrived.
        got: u32,
    },
    /// A collective the stage ran for one of its blocks (gathering its parameters, reducing
    /// its gradient) failed; later collectives of the step did not run (OVL-3).
    #[error("stage {stage}: the {op} of block {block} failed: {cause}")]
    BlockCollective {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
        /// The collective.
        op: CollectiveKind,
        /// What the communicator said.
        cause: CommError,
    },
    /// The result of a block's collective did not come within the time-outs of the
    /// collectives ahead of it (OVL-2).
    #[error("stage {stage}: the {op} of block {block} gave no result within {waited:?}")]
    BlockCollectiveTimeout {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
        /// The collective.
        op: CollectiveKind,
        /// How long the stage waited.
        waited: Duration,
    },
    /// A collective of a tensor-parallel block's group failed (TP-4).
    #[error(
        "stage {stage}: the tensor-parallel group of block {block} failed during {during} of micro-batch {mb}: {cause}"
    )]
    TensorParallel {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
        /// The micro-batch.
        mb: u32,
        /// What the block was computing.
        during: &'static str,
        /// What the communicator said.
        cause: CommError,
    },
    /// A tensor-parallel block computed a split layer after a `reduce`: two split regions in
    /// one block, whose gradients the executor's rules would get wrong (TP-6).
    #[error(
        "stage {stage}: block {block} has two tensor-parallel split regions (a split layer after a reduce); cut it into one block per region"
    )]
    TensorParallelRegions {
        /// This stage.
        stage: u32,
        /// The block (its index in the model).
        block: u32,
    },
    /// The schedule needs something this executor does not do yet.
    #[error("unsupported schedule: {0}")]
    Unsupported(String),
    /// The connection to a stage in another process failed (its process died or closed the
    /// connection, the job aborted, a bad packet arrived).
    #[error("stage {stage}: the connection to stage {peer} in another process failed: {reason}")]
    Wire {
        /// This stage.
        stage: u32,
        /// The peer stage.
        peer: u32,
        /// What the transport said.
        reason: String,
    },
}

impl ExecError {
    /// A block's error with its stage and block filled in (a block does not know them).
    pub(super) fn in_block(self, stage: u32, block: u32) -> Self {
        match self {
            ExecError::TensorParallel {
                mb, during, cause, ..
            } => ExecError::TensorParallel {
                stage,
                block,
                mb,
                during,
                cause,
            },
            ExecError::TensorParallelRegions { .. } => {
                ExecError::TensorParallelRegions { stage, block }
            }
            other => other,
        }
    }
}
