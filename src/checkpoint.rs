//! Checkpoint storage: what a checkpoint holds, how it is laid out on disk, how it is written
//! atomically, verified when read, and pruned.
//!
//! This module owns the storage layer only. Deciding when to checkpoint, taking the snapshot on
//! the device threads and writing it off the training path belong to the runtime, which calls
//! [`CheckpointStore::write`] from a background thread.
//!
//! # Layout on disk
//!
//! ```text
//! <root>/step-00000120/
//!     shard-pp0000-tp0000.bin   one file per stage shard: parameters by name + optimizer state
//!     shard-pp0001-tp0000.bin
//!     shard-pp0000-tp0000-optim0000-of0002.bin   a sharded (ZeRO) optimizer: one file per
//!     shard-pp0000-tp0000-optim0001-of0002.bin   data-parallel rank's part (CKPT-8)
//!     manifest                  format version, step, layout, data cursor, RNG state,
//!                               every shard file with its byte length and CRC-32
//! ```
//!
//! Parameters are stored by their structural path in the module (`layers.0.weight`), never by
//! Burn's `ParamId` (random per module instance), so a checkpoint restores onto a model built
//! afresh and, after renaming, onto a different pipeline split ([`ShardParams::merge`],
//! [`ShardParams::renamed`]).
//!
//! # Invariants
//!
//! Tests name the id they check.
//!
//! - **CKPT-1 atomicity.** Every file is written to `<name>.tmp`, fsynced, renamed to its
//!   final name, and then its directory is fsynced; the manifest is written last. A checkpoint
//!   directory without a valid manifest is incomplete and is never loaded, so a crash at any
//!   moment leaves either the previous checkpoints or a complete new one, never a partial
//!   file that is loaded.
//! - **CKPT-2 verification.** A checkpoint is loaded only if its manifest decodes (magic,
//!   format version, its own CRC-32, a valid layout, the step of its directory) and every
//!   shard file it lists is present with exactly the listed length and CRC-32 and decodes.
//!   Anything else is refused with a typed [`CheckpointError`], and
//!   [`CheckpointStore::latest_valid`] falls back to the next older checkpoint, reporting each
//!   refusal.
//! - **CKPT-3 retention.** After a write, the store keeps the newest `k` complete checkpoints
//!   (manifest valid, every shard file present with its listed length) and every directory
//!   newer than the oldest of them; older directories, complete or not, are removed, the
//!   manifest first so a half-removed checkpoint is incomplete rather than corrupt.
//! - **CKPT-4 bounded decoding.** Decoding never panics on bad input and never allocates a
//!   declared length before checking it against the bytes actually there: strings are
//!   borrowed from the file, sequence pre-allocation is capped, and the parameter values'
//!   declared sizes must add up exactly to the file's size before any is allocated.
//! - **CKPT-5 restore by name.** [`restore_module`] sets every float parameter from the entry
//!   of the same path, refusing a missing name or a different shape before changing anything,
//!   and gives each parameter back the id it had when snapshotted, so that the optimizer state
//!   (which Burn keys by parameter id) applies to the restored module.
//! - **CKPT-8 sharded optimizer state.** A block whose optimizer state is sharded over its
//!   data-parallel group (ZeRO) is stored as its parameter file plus one file per rank's
//!   part, each listed in the manifest with its length and CRC-32 and verified like a shard
//!   file; the parts must tile the block's flat parameter order exactly once. Loading gives
//!   back every part, so the training layer can re-shard them onto another group size.
//! - **CKPT-10 sharded parameters.** A ZeRO-3 block's snapshot holds its rank's part of the
//!   block's flat trainable parameters ([`ParamPart`]: range, total, values), stored as one
//!   entry of the shard file named `#flat[start..end]/total` (no module path starts with `#`),
//!   so it is length- and CRC-checked with the file; the block's other float parameters
//!   (buffers) stay by name. The Supervisor adds every rank's part to the block's snapshot;
//!   loading puts the parts together ([`ShardParams::flat_parameters`]) only if they tile the
//!   flat order exactly once, and the restoring rank keeps its range of the whole for its own
//!   group, so the checkpoint re-shards onto any data-parallel size.
//! - **CKPT-9 training state.** A shard snapshot carries its stage's [`TrainingState`] (the
//!   learning-rate scheduler's record, f16's loss scaler's scale and clean-step count); every
//!   stage of a job steps the same schedule and scaler, so the
//!   shards of one checkpoint carry equal states (a write is refused otherwise) and the
//!   manifest (format version 3) stores it once; every shard read back gets it. A version 2
//!   manifest, written before it existed, reads as an empty training state.
//! - **CKPT-7 writable before training.** [`CheckpointStore::check_writable`] creates the root
//!   and writes, syncs and removes a probe file in it; a job with a checkpoint directory calls
//!   it when it is built, so a directory that cannot be written is refused before the first
//!   step rather than reported after the run.
//!
//! - **CKPT-6** a pipeline job writes one shard per model block (`ShardId::stage(block)`), from
//!   replica 0's stages; every stage restores the blocks it holds, so a checkpoint restores onto
//!   another split of the same blocks (pp, virtual stages), and a model whose blocks do not fit is
//!   refused naming the checkpoint.

pub(crate) mod format;
mod fs;
mod params;
mod store;
#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::mesh::Layout;
pub use crate::parallel::sampler::DataCursor;
use crate::precision::ScalerState;

pub use fs::{
    CheckpointFile, CheckpointFs, FaultyFile, FaultyFs, FsOp, MemoryFile, MemoryFs, RealFs,
};
pub(crate) use params::{BurnRecord, RecordTensor};
pub use params::{
    NamedParam, OptimizerPart, OptimizerState, ParamPart, ShardParams, restore_module,
    snapshot_module,
};
pub use store::{CheckpointStore, Loaded, RefusedCheckpoint};

/// The on-disk format version this build writes. It also reads [`OLDEST_READABLE_VERSION`]
/// and every version between.
///
/// Version 3 added the manifest's [`TrainingState`] (CKPT-9); a version 2 checkpoint reads
/// as one with an empty training state.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest on-disk format version this build still reads.
pub const OLDEST_READABLE_VERSION: u32 = 2;

/// Which part of the model a shard file holds: one pipeline stage (and one tensor-parallel
/// slice of it). Data-parallel replicas hold the same shard; one copy is stored.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct ShardId {
    /// The pipeline stage.
    pub pp: u32,
    /// The tensor-parallel slice (0 without tensor parallelism).
    pub tp: u32,
}

impl ShardId {
    /// The shard of pipeline stage `pp` without tensor parallelism.
    pub fn stage(pp: u32) -> Self {
        Self { pp, tp: 0 }
    }

    /// The name of this shard's file inside a checkpoint directory.
    pub fn file_name(&self) -> String {
        format!("shard-pp{:04}-tp{:04}.bin", self.pp, self.tp)
    }

    /// The name of the file of part `index` of `of` of this shard's sharded optimizer state
    /// (CKPT-8).
    pub fn part_file_name(&self, index: u32, of: u32) -> String {
        format!(
            "shard-pp{:04}-tp{:04}-optim{index:04}-of{of:04}.bin",
            self.pp, self.tp
        )
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shard pp{}/tp{}", self.pp, self.tp)
    }
}

/// The random generator's state at the checkpointed step, so a resumed run draws the same
/// numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct RngState {
    /// The run's seed.
    pub seed: u64,
    /// The generator's state word after the checkpointed step.
    pub state: u64,
}

/// One stage shard's state: its parameters by name and its optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardSnapshot {
    /// Which shard.
    pub shard: ShardId,
    /// The shard's float parameters by structural path.
    pub params: ShardParams,
    /// The shard's optimizer state, if it has one yet.
    pub optimizer: Option<OptimizerState>,
    /// The step state of the stage that took the snapshot (its learning-rate scheduler):
    /// the same on every shard of one checkpoint (CKPT-9).
    pub training: TrainingState,
}

/// The state a training step carries from one step to the next besides parameters and
/// optimizer state: what a resumed, rolled-back or joining replica needs to continue the
/// run at the same step rather than restart it (CKPT-9). Every field is optional, so that a
/// job without the feature (a constant learning rate) stores nothing.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TrainingState {
    /// The learning-rate scheduler's state, if the job's learning rate comes from one.
    pub lr_scheduler: Option<LrSchedulerState>,
    /// f16's dynamic loss scaler's state (its scale and clean-step count), if the job
    /// scales its loss.
    pub loss_scale: Option<ScalerState>,
}

impl TrainingState {
    /// This training state with the learning-rate scheduler's state `lr_scheduler`.
    pub fn with_lr_scheduler(mut self, lr_scheduler: Option<LrSchedulerState>) -> Self {
        self.lr_scheduler = lr_scheduler;
        self
    }

    /// This training state with the loss scaler's state `loss_scale`.
    pub fn with_loss_scale(mut self, loss_scale: Option<ScalerState>) -> Self {
        self.loss_scale = loss_scale;
        self
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.lr_scheduler.is_none() && self.loss_scale.is_none()
    }
}

/// A learning-rate scheduler's state as Burn records it (`LrScheduler::to_record`): its
/// step counters and whatever else it keeps, as the bytes of Burn's own record encoding
/// (`LrSchedulerRecord::into_bytes`), opaque to this layer.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LrSchedulerState {
    /// Burn's record of the scheduler, encoded.
    pub record: Vec<u8>,
}

impl fmt::Debug for LrSchedulerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LrSchedulerState({} bytes)", self.record.len())
    }
}

/// Everything a run needs to resume at a step boundary: what [`CheckpointStore::write`]
/// stores and [`CheckpointStore::latest_valid`] gives back.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The number of steps completed when the snapshot was taken.
    pub step: u64,
    /// The mesh the run had.
    pub layout: Layout,
    /// Where the next step's data starts.
    pub cursor: DataCursor,
    /// The random generator's state.
    pub rng: RngState,
    /// One entry per stage shard, each shard at most once.
    pub shards: Vec<ShardSnapshot>,
}

/// Why a checkpoint could not be written, or why one was refused when read. Every variant
/// names the file or the parameter concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file-system operation failed.
    #[error("checkpoint i/o: {op} {path} failed: {reason}")]
    Io {
        /// The operation (`create`, `write`, `sync`, `rename`, …).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error text.
        reason: String,
    },
    /// The checkpoint directory cannot be created or written (CKPT-7): found when the job
    /// is built, before any training.
    #[error("checkpoints cannot be written under {root}: {op} {path} failed: {reason}")]
    NotWritable {
        /// The checkpoint directory.
        root: PathBuf,
        /// The operation that failed (`create_dir`, `create`, `write`, `remove`).
        op: &'static str,
        /// The file or directory it failed on.
        path: PathBuf,
        /// The operating system's error text.
        reason: String,
    },
    /// A job that requires a checkpoint to resume from found none that verifies (any that
    /// were refused are logged with their reasons).
    #[error("no checkpoint to resume from in {location}")]
    NothingToResume {
        /// Where the checkpoints were looked for (a store's root directory).
        location: String,
    },
    /// The directory has no manifest: the checkpoint was never completed (CKPT-1).
    #[error("{dir} is incomplete: it has no manifest")]
    MissingManifest {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// The file does not start with the magic bytes of its kind.
    #[error("{path} is not a meshwork checkpoint file (bad magic)")]
    BadMagic {
        /// The file.
        path: PathBuf,
    },
    /// The file was written in a format version this build does not read.
    #[error(
        "{path} has format version {found}, this build reads versions {OLDEST_READABLE_VERSION} \
         to {expected}"
    )]
    VersionMismatch {
        /// The file.
        path: PathBuf,
        /// The version in the file.
        found: u32,
        /// [`FORMAT_VERSION`], the newest this build reads.
        expected: u32,
    },
    /// The snapshot holds no learning-rate scheduler state where the job has a scheduler
    /// (it was written with a constant rate, or before format version 3): restoring it would
    /// restart the schedule.
    #[error(
        "the snapshot holds no learning-rate scheduler state (written with a constant rate, or \
         before checkpoint format 3): the job's scheduler would restart its schedule"
    )]
    NoLrSchedulerState,
    /// Burn could not encode a scheduler's record, or a stored one does not decode.
    #[error("the learning-rate scheduler's record: {reason}")]
    LrSchedulerRecord {
        /// Burn's error.
        reason: String,
    },
    /// Two shards of one checkpoint carry different training states (CKPT-9): their stages
    /// did not step the same learning-rate schedule.
    #[error("{first} and {other} carry different training states (learning-rate scheduler)")]
    TrainingStateDiffers {
        /// The first shard.
        first: ShardId,
        /// A shard whose training state differs from the first's.
        other: ShardId,
    },
    /// The file is shorter than its contents declare.
    #[error("{path} is truncated: {declared} bytes declared, {actual} present")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The length the contents declare.
        declared: u64,
        /// The length of the file.
        actual: u64,
    },
    /// The manifest's own checksum does not match its contents.
    #[error("{path}: checksum {computed:08x} does not match the stored {stored:08x}")]
    ManifestChecksum {
        /// The manifest.
        path: PathBuf,
        /// The checksum stored in the manifest.
        stored: u32,
        /// The checksum of the bytes read.
        computed: u32,
    },
    /// The contents do not decode (a structural error the checksums did not catch).
    #[error("{path} is malformed: {what}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A shard file the manifest lists is absent.
    #[error("{shard} is missing: {path} does not exist")]
    MissingShard {
        /// The shard.
        shard: ShardId,
        /// Its file.
        path: PathBuf,
    },
    /// A shard file has another length than the manifest lists.
    #[error("{path} has {actual} bytes, the manifest lists {expected}")]
    ShardLength {
        /// The file.
        path: PathBuf,
        /// The length in the manifest.
        expected: u64,
        /// The file's length.
        actual: u64,
    },
    /// A shard file's CRC-32 differs from the manifest's.
    #[error("{path}: checksum {computed:08x} does not match the manifest's {expected:08x}")]
    ShardChecksum {
        /// The file.
        path: PathBuf,
        /// The checksum in the manifest.
        expected: u32,
        /// The checksum of the bytes read.
        computed: u32,
    },
    /// A snapshot to write holds the same shard twice.
    #[error("the snapshot holds {shard} twice")]
    DuplicateShard {
        /// The shard.
        shard: ShardId,
    },
    /// Two parameter sets to merge both hold this name.
    #[error("parameter {name} is present in more than one shard")]
    DuplicateParameter {
        /// The parameter's path.
        name: String,
    },
    /// The module has a parameter the checkpoint does not hold (CKPT-5).
    #[error("the checkpoint has no parameter {name}")]
    MissingParameter {
        /// The parameter's path in the module.
        name: String,
    },
    /// The checkpoint holds the parameter with another shape than the module (CKPT-5).
    #[error(
        "parameter {name} has shape {module:?} in the module but {checkpoint:?} in the checkpoint"
    )]
    ShapeMismatch {
        /// The parameter's path.
        name: String,
        /// Its shape in the module.
        module: Vec<usize>,
        /// Its shape in the checkpoint.
        checkpoint: Vec<usize>,
    },
    /// Burn could not serialize or load the optimizer state.
    #[error("optimizer state: {reason}")]
    Optimizer {
        /// Burn's error text.
        reason: String,
    },
    /// A ZeRO-3 block's parameter parts (CKPT-10) do not make one flat vector for this block,
    /// or are restored where they cannot be.
    #[error("parameter parts: {reason}")]
    ParameterParts {
        /// What is wrong with them.
        reason: String,
    },
    /// A tensor-parallel checkpoint cannot be re-sliced onto this job's degree (TP-7).
    #[error("re-slicing {what} onto another tensor-parallel degree: {reason}")]
    Reslice {
        /// The parameter, optimizer tensor or state concerned.
        what: String,
        /// What is wrong or not supported.
        reason: String,
    },
}
