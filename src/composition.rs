//! What combines with what: the one table of refused combinations of strategies and settings
//! (COMP-1..3), checked in one place when a job is built.
//!
//! A job's settings are read as a set of [`Feature`]s (`JobBuilder::plan` says which a job
//! has). A setting whose value matters to a combination is a feature of its own that implies
//! the general one ([`Feature::implies`]: ZeRO-3 is `ZeroParameters`, which implies
//! `ZeroGradients` and `Zero`; top-k is `SparseCompression`, which implies `Compression`;
//! backup workers run on the parameter server), so every refusal that depends on a value is a
//! row too. [`REFUSALS`] lists every combination the runtime cannot run yet, each with why
//! and what to do instead; [`check`] refuses a set that, with what it implies, contains every
//! feature of some row and none of the row's `without` (a roll-back without checkpoints),
//! with the first such row in table order. Settings whose *values* are wrong on their own (a
//! zero degree, a batch that does not split, an optimizer the server cannot flatten) are not
//! combinations: their own modules check them.
//!
//! - **COMP-1**: a feature set is refused exactly when its closure under
//!   [`Feature::implies`] contains all the features of a row and none of its `without`, and
//!   the error names that row's features (proptested).
//! - **COMP-2**: every row has one to three distinct features and, with its `without`, two
//!   or more; no row's features and `without` contain another row's: each refusal is stated
//!   once.
//! - **COMP-3**: the book's composition matrix is [`matrix_markdown`]'s output (a test
//!   compares them).

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Serialize};

pub mod status;

/// One strategy or setting of a job, as far as combining it with others goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Feature {
    /// The model as a list of blocks, trained data-parallel (`.blocks(..)`).
    Blocks,
    /// The blocks cut into pipeline stages (`.pipeline(..)`).
    Pipeline,
    /// Blocks split over a tensor-parallel group (`.tensor_parallel(t)`, t > 1).
    TensorParallel,
    /// Sharded optimizer state, at any stage (`.zero(..)`).
    Zero,
    /// Gradients sharded too: ZeRO-2 or 3 (`.zero(Two | Three)`); implies [`Feature::Zero`].
    ZeroGradients,
    /// Parameters sharded too: ZeRO-3 (`.zero(Three)`); implies [`Feature::ZeroGradients`].
    ZeroParameters,
    /// bf16 compute on f32 master weights (`.precision(Precision::Bf16)`).
    Bf16,
    /// f16 compute with dynamic loss scaling (`.precision(Precision::F16)`).
    F16,
    /// Gradients reduced in the 16-bit compute type (`.low_precision_gradients(true)` with
    /// bf16 or f16).
    LowPrecisionGradients,
    /// Clipping by the global gradient norm (`.clip_grad_norm(..)`).
    ClipGradNorm,
    /// More than one micro-batch per replica and step (`.gradient_accumulation(n)`, n > 1).
    GradientAccumulation,
    /// A non-finite loss skips the step (`.on_non_finite_loss(NonFinitePolicy::Skip)`).
    SkipNonFinite,
    /// Compressed gradient all-reduce (`.compression(..)`).
    Compression,
    /// A sparse or low-rank compression: top-k or PowerSGD (`.compression(TopK | PowerSgd)`);
    /// implies [`Feature::Compression`].
    SparseCompression,
    /// Ranks stepping alone and meeting every few steps (`.local_updates(..)`).
    LocalUpdates,
    /// Gradients pushed to a parameter server (`.parameter_server(..)`).
    ParameterServer,
    /// A parameter server whose workers may run ahead: a staleness bound above 0
    /// (`.parameter_server(ssp:s)`, s > 0, or unbounded); implies [`Feature::ParameterServer`].
    StaleUpdates,
    /// Synchronous steps that drop the slowest workers (`.backup_workers(b)`); they run on the
    /// parameter server, so it implies [`Feature::ParameterServer`].
    BackupWorkers,
    /// A learning-rate scheduler rather than a constant rate (`.learning_rate(scheduler)`).
    LrSchedule,
    /// Checkpoints are written (`.checkpoint_dir(..)` or `.checkpoint_store(..)`).
    Checkpoints,
    /// The job runs across processes (`.cluster(..)`).
    AcrossProcesses,
    /// Its data plane moves bytes through the system's MPI (`JobSpec::transport`,
    /// `--transport mpi`).
    MpiTransport,
    /// Faults injected by a plan (`.fault_plan(..)`).
    FaultPlan,
    /// A fault plan that delays, drops or corrupts collective messages
    /// (`FaultKind::DelayMessage`, `DropMessage`, `CorruptMessage`).
    MessageFaults,
    /// A recovery policy that rolls back to a checkpoint (`RecoveryPolicy::roll_back()`).
    RollBack,
}

impl Feature {
    /// Every feature, in the table's order.
    pub const ALL: [Feature; 25] = [
        Feature::Blocks,
        Feature::Pipeline,
        Feature::TensorParallel,
        Feature::Zero,
        Feature::ZeroGradients,
        Feature::ZeroParameters,
        Feature::Bf16,
        Feature::F16,
        Feature::LowPrecisionGradients,
        Feature::ClipGradNorm,
        Feature::GradientAccumulation,
        Feature::SkipNonFinite,
        Feature::Compression,
        Feature::SparseCompression,
        Feature::LocalUpdates,
        Feature::ParameterServer,
        Feature::StaleUpdates,
        Feature::BackupWorkers,
        Feature::LrSchedule,
        Feature::Checkpoints,
        Feature::AcrossProcesses,
        Feature::MpiTransport,
        Feature::FaultPlan,
        Feature::MessageFaults,
        Feature::RollBack,
    ];

    /// The builder setting that turns the feature on, as a user writes it.
    pub fn setting(self) -> &'static str {
        match self {
            Feature::Blocks => ".blocks(..)",
            Feature::Pipeline => ".pipeline(..)",
            Feature::TensorParallel => ".tensor_parallel(t)",
            Feature::Zero => ".zero(..)",
            Feature::ZeroGradients => ".zero(Two | Three)",
            Feature::ZeroParameters => ".zero(Three)",
            Feature::Bf16 => ".precision(Bf16)",
            Feature::F16 => ".precision(F16)",
            Feature::LowPrecisionGradients => ".low_precision_gradients(true)",
            Feature::ClipGradNorm => ".clip_grad_norm(..)",
            Feature::GradientAccumulation => ".gradient_accumulation(n)",
            Feature::SkipNonFinite => ".on_non_finite_loss(Skip)",
            Feature::Compression => ".compression(..)",
            Feature::SparseCompression => ".compression(TopK | PowerSgd)",
            Feature::LocalUpdates => ".local_updates(..)",
            Feature::ParameterServer => ".parameter_server(..)",
            Feature::StaleUpdates => ".parameter_server(ssp:s > 0)",
            Feature::BackupWorkers => ".backup_workers(b)",
            Feature::LrSchedule => ".learning_rate(scheduler)",
            Feature::Checkpoints => ".checkpoint_dir(..)",
            Feature::AcrossProcesses => ".cluster(..)",
            Feature::MpiTransport => "JobConfig { transport: Mpi }",
            Feature::FaultPlan => ".fault_plan(..)",
            Feature::MessageFaults => ".fault_plan(message faults)",
            Feature::RollBack => "RecoveryPolicy::roll_back()",
        }
    }

    /// A short name for the matrix's headers.
    pub fn short(self) -> &'static str {
        match self {
            Feature::Blocks => "blocks",
            Feature::Pipeline => "pp",
            Feature::TensorParallel => "tp",
            Feature::Zero => "ZeRO",
            Feature::ZeroGradients => "ZeRO-2/3",
            Feature::ZeroParameters => "ZeRO-3",
            Feature::Bf16 => "bf16",
            Feature::F16 => "f16",
            Feature::LowPrecisionGradients => "16-bit grads",
            Feature::ClipGradNorm => "clip",
            Feature::GradientAccumulation => "accum",
            Feature::SkipNonFinite => "skip",
            Feature::Compression => "compress",
            Feature::SparseCompression => "top-k/PowerSGD",
            Feature::LocalUpdates => "local",
            Feature::ParameterServer => "PS",
            Feature::StaleUpdates => "stale",
            Feature::BackupWorkers => "backup",
            Feature::LrSchedule => "lr schedule",
            Feature::Checkpoints => "ckpt",
            Feature::AcrossProcesses => "cluster",
            Feature::MpiTransport => "MPI",
            Feature::FaultPlan => "faults",
            Feature::MessageFaults => "msg faults",
            Feature::RollBack => "roll back",
        }
    }
}

impl Feature {
    /// The features a job with this one has too (COMP-1's closure).
    pub fn implies(self) -> &'static [Feature] {
        match self {
            Feature::ZeroGradients => &[Feature::Zero],
            Feature::ZeroParameters => &[Feature::Zero, Feature::ZeroGradients],
            Feature::SparseCompression => &[Feature::Compression],
            Feature::StaleUpdates | Feature::BackupWorkers => &[Feature::ParameterServer],
            _ => &[],
        }
    }
}

/// `features` with every feature they imply.
pub fn closure(features: &BTreeSet<Feature>) -> BTreeSet<Feature> {
    let mut all = features.clone();
    for f in features {
        all.extend(f.implies());
    }
    all
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.setting())
    }
}

/// One refused combination: the features that may not all be on together (or not without
/// another), why, and what to do instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The features (one to three) that together are refused.
    pub features: &'static [Feature],
    /// Features whose absence the refusal needs: with any of them on, the row does not apply
    /// (a roll-back is refused without checkpoints).
    pub without: &'static [Feature],
    /// Why the runtime cannot run them together (yet).
    pub reason: &'static str,
    /// What the user can do instead.
    pub instead: &'static str,
}

use Feature::*;

const fn row(features: &'static [Feature], reason: &'static str, instead: &'static str) -> Refusal {
    Refusal {
        features,
        without: &[],
        reason,
        instead,
    }
}

/// A row that refuses `features` when none of `without` is on.
const fn row_without(
    features: &'static [Feature],
    without: &'static [Feature],
    reason: &'static str,
    instead: &'static str,
) -> Refusal {
    Refusal {
        features,
        without,
        reason,
        instead,
    }
}

impl Refusal {
    /// Whether the row refuses `features` (already closed under [`Feature::implies`]).
    pub fn applies(&self, features: &BTreeSet<Feature>) -> bool {
        self.features.iter().all(|f| features.contains(f))
            && !self.without.iter().any(|f| features.contains(f))
    }
}

/// Every combination a job may not have, in the order [`check`] reads them. A row removed is a
/// combination that works (and is tested against one device); a new strategy adds its rows here.
pub const REFUSALS: &[Refusal] = &[
    // Exclusive ways of reducing gradients.
    row(
        &[Compression, LocalUpdates],
        "the replicas exchange parameters every few steps, not gradients, so there is no \
         gradient to compress",
        "use one or the other",
    ),
    row(
        &[Compression, ParameterServer],
        "the workers push whole f32 gradients to the server",
        "use one method",
    ),
    row(
        &[LocalUpdates, ParameterServer],
        "the server applies the workers' gradients (backup workers' too); local updates \
         exchange parameters",
        "use one method",
    ),
    // Tensor parallelism, first: a tensor-parallel job is a block or pipeline job too, and
    // its own row says more than the blocks' or the pipeline's.
    row(
        &[TensorParallel, ParameterServer],
        "the server holds whole parameters",
        "remove one of them",
    ),
    // Compression: a data-parallel reduction of its own.
    row(
        &[Compression, LowPrecisionGradients],
        "both narrow the gradient all-reduce",
        "use .compression(Compression::Bf16) alone",
    ),
    row(
        &[Compression, F16],
        "a step skipped by the loss scaler would leave an overflow in the residual",
        "use .precision(Bf16)",
    ),
    row(
        &[Compression, ZeroParameters],
        "a compressed ZeRO-3 reduce-scatter is not built",
        "use .zero(Two) with Compression::Bf16, or .zero(Three) with \
         .low_precision_gradients(true) (16-bit gradients without error feedback)",
    ),
    row(
        &[SparseCompression, ZeroGradients],
        "top-k and PowerSGD compress an all-reduce, and ZeRO-2 reduce-scatters its gradients",
        "use .zero(One), or Compression::Bf16 or F16 (a 16-bit reduce-scatter with error \
         feedback)",
    ),
    // Local updates: each rank steps alone, block by block in block and pipeline jobs.
    row(
        &[LocalUpdates, Zero],
        "each rank steps its own optimizer on its own parameters: there is no shared state \
         to shard",
        "remove one of them",
    ),
    row(
        &[LocalUpdates, ClipGradNorm],
        "a rank stepping alone would clip its own gradient, not the group's mean, and skip a \
         non-finite one alone, falling out of the synchronisation schedule",
        "clip inside the loss, or use plain data parallelism",
    ),
    row(
        &[LocalUpdates, F16],
        "the loss scaler's overflow decision must be the same on every rank (PREC-2), and a \
         rank stepping alone sees only its own gradient",
        "use .precision(Bf16) or f32",
    ),
    // The parameter server holds whole f32 parameters and applies gradients one at a time.
    row(
        &[ParameterServer, Blocks],
        "the server holds the whole model's parameters",
        "give the model with .model(..)",
    ),
    row(
        &[ParameterServer, Pipeline],
        "the server holds the whole model's parameters",
        "give the model with .model(..)",
    ),
    row(
        &[ParameterServer, Zero],
        "the server already holds the only optimizer state",
        "remove .zero(..)",
    ),
    row(
        &[ParameterServer, Bf16],
        "the server steps f32 parameters with f32 gradients",
        "train in f32",
    ),
    row(
        &[ParameterServer, F16],
        "the server steps f32 parameters with f32 gradients",
        "train in f32",
    ),
    row(
        &[ParameterServer, ClipGradNorm],
        "the server applies gradients one at a time",
        "remove .clip_grad_norm(..)",
    ),
    row(
        &[ParameterServer, LrSchedule],
        "the server steps with a constant rate",
        "use a constant .learning_rate(..)",
    ),
    row(
        &[StaleUpdates, BackupWorkers],
        "backup workers are synchronous; a staleness bound above 0 is not",
        "use Staleness::Bounded(0) (ssp:0) with backup workers, or no backup workers",
    ),
    // Pipelines and blocks.
    row(
        &[Pipeline, SkipNonFinite],
        "stages update before the last stage's loss is known to all",
        "use NonFinitePolicy::Stop",
    ),
    row(
        &[Blocks, SkipNonFinite],
        "each block updates on its own",
        "use NonFinitePolicy::Stop",
    ),
    // Across processes.
    row(
        &[AcrossProcesses, MessageFaults],
        "a TCP data plane's messages do not pass the fault hooks (its faults are the \
         network's); a node carries out every other kind of fault",
        "use panic, stall, slow, partition or kill entries, or kill a node process",
    ),
    row(
        &[MpiTransport, RollBack],
        "a lost process ends an MPI job (the MPI launcher aborts the whole world), so no \
         survivor is left to roll back onto a spare",
        "rerun the same command (it resumes from the last checkpoint), or use the TCP \
         transport for live recovery",
    ),
    // Recovery (after the rows that refuse a roll-back outright).
    row_without(
        &[RollBack],
        &[Checkpoints],
        "a roll-back needs checkpoints to roll back to",
        "add .checkpoint_dir(dir) and .checkpoint_every(n)",
    ),
];

/// A job whose settings combine features that [`REFUSALS`] refuses: the row, and how the job
/// set each feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The row of the table.
    pub refusal: Refusal,
    /// Each of the row's features as the job set it (`compression(topk:0.05)`), in the row's
    /// order.
    pub settings: Vec<String>,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.refusal;
        if r.without.is_empty() {
            write!(f, "{} together", self.settings.join(" with "))?;
        } else {
            let absent: Vec<String> = r.without.iter().map(ToString::to_string).collect();
            write!(
                f,
                "{} without {}",
                self.settings.join(" with "),
                absent.join(" or ")
            )?;
        }
        write!(f, ": {}; {}", r.reason, r.instead)
    }
}

impl std::error::Error for Refused {}

impl Refused {
    /// The refused features.
    pub fn features(&self) -> &'static [Feature] {
        self.refusal.features
    }
}

/// The first row of [`REFUSALS`] that applies to `features` and what they imply (COMP-1);
/// `describe` writes each feature as the job set it.
pub fn check(
    features: &BTreeSet<Feature>,
    describe: impl Fn(Feature) -> String,
) -> Result<(), Refused> {
    let features = closure(features);
    match REFUSALS.iter().find(|r| r.applies(&features)) {
        Some(refusal) => Err(Refused {
            refusal: *refusal,
            settings: refusal.features.iter().map(|f| describe(*f)).collect(),
        }),
        None => Ok(()),
    }
}

/// The row that refuses the pair `a`, `b` (with what they imply) when neither alone is:
/// rows with a `without` are left out, since they refuse a feature alone.
pub fn pair_refusal(a: Feature, b: Feature) -> Option<&'static Refusal> {
    let alone = |f: Feature| closure(&BTreeSet::from([f]));
    let both = closure(&BTreeSet::from([a, b]));
    REFUSALS.iter().find(|r| {
        r.without.is_empty() && r.applies(&both) && !r.applies(&alone(a)) && !r.applies(&alone(b))
    })
}

/// A markdown table's head: `first`'s column, then `columns` centred.
fn table_head<'a>(first: &str, columns: impl IntoIterator<Item = &'a str>) -> String {
    let mut names = format!("| {first}").trim_end().to_string() + " |";
    let mut rule = String::from("|---|");
    for c in columns {
        names.push_str(&format!(" {c} |"));
        rule.push_str(":-:|");
    }
    format!("{names}\n{rule}\n")
}

/// The book's composition matrix (COMP-3): a pair table of every feature against every other
/// (✓ combines, ✗ refused, with what each implies), then each refusal with its reason and
/// what to do instead.
pub fn matrix_markdown() -> String {
    let mut out = table_head("", Feature::ALL.map(Feature::short));
    for a in Feature::ALL {
        out.push_str(&format!("| **{}** |", a.short()));
        for b in Feature::ALL {
            let cell = if a == b {
                "·"
            } else if pair_refusal(a, b).is_some() {
                "✗"
            } else {
                "✓"
            };
            out.push_str(&format!(" {cell} |"));
        }
        out.push('\n');
    }
    out.push_str("\n| refused together | why | instead |\n|---|---|---|\n");
    for r in REFUSALS {
        let names: Vec<String> = r.features.iter().map(|f| format!("`{f}`")).collect();
        let mut together = names.join(" with ");
        if !r.without.is_empty() {
            let absent: Vec<String> = r.without.iter().map(|f| format!("`{f}`")).collect();
            together = format!("{together} without {}", absent.join(" or "));
        }
        out.push_str(&format!("| {together} | {} | {} |\n", r.reason, r.instead));
    }
    out
}

#[cfg(test)]
mod tests;
