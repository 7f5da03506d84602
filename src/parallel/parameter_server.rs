//! A bounded-staleness parameter server and backup workers, as data and pure bookkeeping: the
//! configuration ([`ParameterServer`], [`Staleness`], backup workers), what a step reports
//! ([`ParameterServerStep`], [`AppliedGradient`]), the typed errors, the build-time check
//! (`check`) and the server's whole state machine (`ServerCore`: work items, clocks, the
//! stale-synchronous gate, aggregation, the optimizer on the flat parameters). The actors that
//! drive it (`actors::parameter_server`) only move messages.
//!
//! **What a step is.** One Supervisor step is one *round*: the sampler's global batch of that
//! step is cut into work items (each replica's share: one item under s = 0 and backup workers,
//! one item per micro-batch otherwise); every worker takes its own items first, then takes
//! items of the worker with the most left (a fast worker does more); the round ends when every
//! item's gradient was applied or dropped. Each gradient is weighted by its item's share of
//! the round's samples (`n_item / global`), so a round moves the parameters by about one
//! data-parallel step whatever the mode.
//!
//! **Clocks and versions.** A worker's clock counts the gradients it pushed; the server's
//! version is the smallest clock of the workers still working in the round (the clock every
//! gradient below it is known applied: Ho et al., 2013). A round starts with every clock at
//! the version reached so far. The staleness of a gradient is its clock minus the version
//! its parameters were pulled at.
//!
//! Invariants (tests name them):
//! - **PS-1** (the gate) a worker starts a gradient at clock `c` only if `c ≤ v + s` where `v`
//!   is the smallest clock among the live workers still working in the round; so every
//!   recorded staleness is at most `s`. `Unbounded` never waits.
//! - **PS-2** (s = 0) the server applies once per version: the sum, in worker order, of exactly
//!   one gradient from every live worker still working in the round; with one item per
//!   worker this is data parallelism's gradient (DP-2), bit-reproducible.
//! - **PS-3** (backup workers, Chen et al. 2016) a version is applied from the first
//!   `max(1, live − b)` gradients to arrive, re-weighted to the mean over their samples
//!   (`global / received`); every other item of the round is dropped and its sample ids
//!   reported by the worker that held it (or owned it, if no one had started it).
//! - **PS-4** every item of a round is applied or dropped exactly once; a lost worker's item
//!   in progress goes back to the queue and is taken by another worker.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::zero::{FlatRule, FlatState};

mod server;

pub(crate) use server::{Answer, ItemId, ServerCore, WorkerId, WorkerRound};

/// How far ahead of the slowest worker a worker may run (stale-synchronous parallel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Staleness {
    /// At most `s` clocks ahead; `Bounded(0)` is synchronous (equals data parallelism).
    Bounded(u32),
    /// Never waits: asynchronous SGD.
    Unbounded,
}

impl Staleness {
    /// The bound in clocks, `None` for `Unbounded`.
    pub fn bound(self) -> Option<u64> {
        match self {
            Staleness::Bounded(s) => Some(u64::from(s)),
            Staleness::Unbounded => None,
        }
    }
}

impl std::fmt::Display for Staleness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Staleness::Bounded(s) => write!(f, "ssp:{s}"),
            Staleness::Unbounded => write!(f, "async"),
        }
    }
}

impl FromStr for Staleness {
    type Err = ParameterServerError;

    /// `ssp:N` (N clocks), `sync` (= `ssp:0`) or `async`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParameterServerError::BadStaleness {
            text: s.to_string(),
        };
        match s.trim() {
            "async" | "asynchronous" => Ok(Staleness::Unbounded),
            "sync" | "synchronous" => Ok(Staleness::Bounded(0)),
            t => t
                .strip_prefix("ssp:")
                .and_then(|n| n.parse::<u32>().ok())
                .map(Staleness::Bounded)
                .ok_or_else(bad),
        }
    }
}

/// A parameter-server job's settings (`JobBuilder::parameter_server`): the staleness bound
/// and how many server shards hold the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParameterServer {
    /// How far ahead of the slowest worker a worker may run.
    pub staleness: Staleness,
    /// Server actors, each holding a contiguous range of the flat parameters (only 1 is
    /// built today; more is refused at build).
    pub shards: u32,
}

impl ParameterServer {
    /// One shard with the given staleness bound.
    pub fn new(staleness: Staleness) -> Self {
        Self {
            staleness,
            shards: 1,
        }
    }
}

impl FromStr for ParameterServer {
    type Err = ParameterServerError;

    /// What [`Staleness`] parses, on one shard.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Self::new)
    }
}

/// One gradient the server applied: what the step events carry per worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedGradient {
    /// Its clock minus the server version its parameters were pulled at (PS-1: at most `s`).
    pub staleness: u64,
    /// Optimizer updates the server applied between the pull and this gradient's update.
    pub updates_between: u64,
    /// Samples it was computed on.
    pub samples: u32,
}

/// A worker's part of a parameter-server step (`ReplicaStep::parameter_server`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParameterServerStep {
    /// Every gradient of this worker applied in the step, in the order applied.
    pub applied: Vec<AppliedGradient>,
    /// Sample ids whose gradients were dropped (backup workers: too late for their version;
    /// or never started before the version was applied).
    pub dropped: Vec<usize>,
    /// The server's version (clock) at the end of the step.
    pub version: u64,
    /// Optimizer updates the server applied since the job started, at the end of the step.
    pub updates: u64,
    /// Bytes of parameters the worker pulled in the step (4 per element per work item).
    #[serde(default)]
    pub bytes_pulled: u64,
    /// Bytes of gradients the server took from the worker in the step (4 per element per
    /// gradient pushed in time, applied or dropped).
    #[serde(default)]
    pub bytes_pushed: u64,
}

/// Why a parameter-server job cannot be built or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParameterServerError {
    /// A staleness that does not parse.
    #[error("staleness {text:?}: use ssp:N (N clocks), sync or async")]
    BadStaleness {
        /// What was given.
        text: String,
    },
    /// A job setting the parameter server cannot serve.
    #[error("a parameter-server job cannot use {what}: {why}")]
    Unsupported {
        /// The setting.
        what: String,
        /// Why, and what to do instead.
        why: String,
    },
    /// `b` backup workers of `workers`: at least one gradient must be used.
    #[error("backup_workers({backup}) with {workers} worker(s): use fewer than {workers}")]
    TooManyBackups {
        /// Backup workers asked for.
        backup: u32,
        /// Workers (data-parallel replicas).
        workers: u32,
    },
    /// A number of shards that is not built.
    #[error("parameter server with {shards} shard(s): only 1 shard is built")]
    Shards {
        /// Shards asked for.
        shards: u32,
    },
    /// A worker waited for the server past its time-out.
    #[error("worker {worker} waited {waited:?} for server shard {shard}: {missing}")]
    Timeout {
        /// The waiting worker.
        worker: u32,
        /// The shard it waited for.
        shard: u32,
        /// How long.
        waited: Duration,
        /// What did not come.
        missing: String,
    },
    /// A server shard is gone (its actor stopped or failed).
    #[error("parameter server shard {shard} is lost: {reason}")]
    ShardLost {
        /// The shard.
        shard: u32,
        /// What was seen.
        reason: String,
    },
}

/// How the server applies gradients (the resolved configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Stale-synchronous: `Some(0)` synchronous, `None` asynchronous.
    Ssp(Option<u64>),
    /// Synchronous with `b` backup workers.
    Backup(u32),
}

impl Mode {
    /// Whether a work item is a replica's whole share (synchronous modes) rather than one
    /// micro-batch.
    pub(crate) fn whole_shares(self) -> bool {
        matches!(self, Mode::Ssp(Some(0)) | Mode::Backup(_))
    }

    /// Whether gradients of one version are summed and applied once.
    fn aggregates(self) -> bool {
        self.whole_shares()
    }
}

/// What a parameter-server job is, as `check` sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobShape<'a> {
    pub(crate) workers: u32,
    pub(crate) optimizer: &'a OptimizerConfig,
    pub(crate) learning_rate: &'a LearningRate,
}

/// The server's mode, optimizer rule and learning rate for a job that asked for a parameter
/// server or backup workers; `None` when it asked for neither. Refuses what the server does
/// not serve.
pub(crate) fn check(
    ps: Option<ParameterServer>,
    backup: Option<u32>,
    job: JobShape<'_>,
) -> Result<Option<(Mode, FlatRule, f64)>, ParameterServerError> {
    let mode = match (ps, backup) {
        (None, None) => return Ok(None),
        (Some(p), None) => Mode::Ssp(p.staleness.bound()),
        (None, Some(b)) => Mode::Backup(b),
        // Backup workers are synchronous: the composition table refuses them with a staleness
        // bound above 0 (`StaleUpdates` with `BackupWorkers`) before this runs.
        (Some(_), Some(b)) => Mode::Backup(b),
    };
    if let Some(p) = ps
        && p.shards != 1
    {
        return Err(ParameterServerError::Shards { shards: p.shards });
    }
    if let Mode::Backup(b) = mode
        && b >= job.workers
    {
        return Err(ParameterServerError::TooManyBackups {
            backup: b,
            workers: job.workers,
        });
    }
    let rule = FlatRule::of(job.optimizer).map_err(|e| unsupported("this optimizer", &e.0))?;
    let LearningRate::Constant(lr) = job.learning_rate else {
        return Err(unsupported(
            "a learning-rate scheduler",
            "the server steps with a constant rate (the composition table refuses it first)",
        ));
    };
    Ok(Some((mode, rule, *lr)))
}

fn unsupported(what: &str, why: &str) -> ParameterServerError {
    ParameterServerError::Unsupported {
        what: what.into(),
        why: why.into(),
    }
}

#[cfg(test)]
mod tests;
