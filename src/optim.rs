//! Optimizers and learning rates for a job.
//!
//! Every replica builds its own optimizer from the same [`OptimizerConfig`] and steps it with
//! the same all-reduced gradients, so replicas stay identical (DP-1 in ARCHITECTURE.md).

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};

/// Which optimizer every replica runs.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum OptimizerConfig {
    /// Stochastic gradient descent (with optional momentum and weight decay).
    Sgd(SgdConfig),
    /// Adam.
    Adam(AdamConfig),
    /// AdamW.
    AdamW(AdamWConfig),
}

impl OptimizerConfig {
    /// A fresh optimizer (no state yet).
    pub fn init(&self) -> ModuleOptimizer {
        match self {
            OptimizerConfig::Sgd(c) => c.init(),
            OptimizerConfig::Adam(c) => c.init(),
            OptimizerConfig::AdamW(c) => c.init(),
        }
    }
}

impl From<SgdConfig> for OptimizerConfig {
    fn from(c: SgdConfig) -> Self {
        Self::Sgd(c)
    }
}
impl From<AdamConfig> for OptimizerConfig {
    fn from(c: AdamConfig) -> Self {
        Self::Adam(c)
    }
}
impl From<AdamWConfig> for OptimizerConfig {
    fn from(c: AdamWConfig) -> Self {
        Self::AdamW(c)
    }
}

/// The learning rate of each optimizer step.
#[derive(Clone)]
pub enum LearningRate {
    /// The same rate at every step.
    Constant(f64),
    /// One of Burn's schedulers (`…LrSchedulerConfig::init()`); every replica steps its own
    /// copy once per optimizer step.
    Scheduler(ModuleLrScheduler),
}

impl LearningRate {
    /// The rate for the next optimizer step (advances a scheduler).
    pub fn next_rate(&mut self) -> ModuleLearningRate {
        match self {
            LearningRate::Constant(lr) => (*lr).into(),
            LearningRate::Scheduler(s) => s.step(),
        }
    }
}

impl std::fmt::Debug for LearningRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LearningRate::Constant(lr) => write!(f, "Constant({lr})"),
            LearningRate::Scheduler(_) => write!(f, "Scheduler(..)"),
        }
    }
}
