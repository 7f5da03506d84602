//! Optimizers and learning rates for a job.
//!
//! Every replica builds its own optimizer from the same [`OptimizerConfig`] and steps it with
//! the same all-reduced gradients, so replicas stay identical (DP-1, stated in `actors::stage::replica`).
//!
//! - **LR-1 one schedule.** Every replica and every pipeline stage steps its own copy of the
//!   job's [`LearningRate`] once per applied optimizer step, and only once the step is
//!   applied ([`LearningRate::peek_next`], then [`LearningRate::commit`]): a step that fails
//!   half-way and is redone does not advance the schedule twice.
//! - **LR-2 state travels with the parameters.** A scheduler's state is Burn's own record
//!   of it (`LrScheduler::to_record`), taken with every snapshot of a stage
//!   ([`LearningRate::state`]) and loaded with every restore ([`LearningRate::restore`]):
//!   a resumed job, a rolled-back one, a replica that joins and a stage that replaces a lost
//!   one continue the schedule at the snapshot's step, never from its start (CKPT-9).
//!   Burn's record is exact for every scheduler it ships (they are counters and the rates
//!   they derive), and for a user's own one as far as its `to_record` is; fast-forwarding a
//!   fresh scheduler by the step count would assume one `step()` per optimizer step and a
//!   deterministic schedule, which the record does not.

use burn::lr_scheduler::LrSchedulerRecord;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{CheckpointError, LrSchedulerState};

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

/// An optimizer as a job description holds it (`job_config`): Burn's own fields, each with
/// Burn's default when a file leaves it out, and no other key (CONF-2). `{ Adam = {} }` is
/// `AdamConfig::new()`.
#[derive(Serialize, Deserialize)]
enum OptimizerFile {
    Sgd(SgdFile),
    Adam(AdamFile),
    AdamW(AdamWFile),
}

/// `SgdConfig`'s fields.
#[derive(Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct SgdFile {
    weight_decay: Option<WeightDecayConfig>,
    momentum: Option<MomentumConfig>,
    gradient_clipping: Option<GradientClippingConfig>,
}

/// `AdamConfig`'s fields.
#[derive(Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct AdamFile {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    amsgrad: bool,
    weight_decay: Option<WeightDecayConfig>,
    grad_clipping: Option<GradientClippingConfig>,
}

impl Default for AdamFile {
    /// `AdamConfig::new()`'s values.
    fn default() -> Self {
        Self {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            amsgrad: false,
            weight_decay: None,
            grad_clipping: None,
        }
    }
}

/// `AdamWConfig`'s fields.
#[derive(Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct AdamWFile {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    cautious_weight_decay: bool,
    amsgrad: bool,
    grad_clipping: Option<GradientClippingConfig>,
}

impl Default for AdamWFile {
    /// `AdamWConfig::new()`'s values.
    fn default() -> Self {
        Self {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 1e-4,
            cautious_weight_decay: false,
            amsgrad: false,
            grad_clipping: None,
        }
    }
}

/// `from`'s fields as `T` (Burn's config and its file form share field names and types).
fn same_fields<F: Serialize, T: serde::de::DeserializeOwned>(from: &F) -> Result<T, String> {
    serde_json::to_value(from)
        .and_then(serde_json::from_value)
        .map_err(|e| format!("optimizer settings: {e}"))
}

impl Serialize for OptimizerConfig {
    fn serialize<S: serde::Serializer>(&self, to: S) -> Result<S::Ok, S::Error> {
        let file = match self {
            OptimizerConfig::Sgd(c) => same_fields(c).map(OptimizerFile::Sgd),
            OptimizerConfig::Adam(c) => same_fields(c).map(OptimizerFile::Adam),
            OptimizerConfig::AdamW(c) => same_fields(c).map(OptimizerFile::AdamW),
        };
        file.map_err(serde::ser::Error::custom)?.serialize(to)
    }
}

impl<'de> Deserialize<'de> for OptimizerConfig {
    fn deserialize<D: serde::Deserializer<'de>>(from: D) -> Result<Self, D::Error> {
        let config = match OptimizerFile::deserialize(from)? {
            OptimizerFile::Sgd(f) => same_fields(&f).map(OptimizerConfig::Sgd),
            OptimizerFile::Adam(f) => same_fields(&f).map(OptimizerConfig::Adam),
            OptimizerFile::AdamW(f) => same_fields(&f).map(OptimizerConfig::AdamW),
        };
        config.map_err(serde::de::Error::custom)
    }
}

/// Two optimizer settings are equal when every hyper-parameter is.
impl PartialEq for OptimizerConfig {
    fn eq(&self, other: &Self) -> bool {
        match (serde_json::to_value(self), serde_json::to_value(other)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
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
    /// [`LearningRate::warmup_cosine`]: Burn's linear then cosine schedulers, with the values
    /// it was made from, so that a job description can hold it (`job_config::LrSchedule`).
    WarmupCosine {
        /// The peak rate.
        peak: f64,
        /// Warm-up steps.
        warmup: usize,
        /// The step the cosine ends at.
        total: usize,
        /// The scheduler itself.
        scheduler: ModuleLrScheduler,
    },
}

impl From<f64> for LearningRate {
    fn from(lr: f64) -> Self {
        LearningRate::Constant(lr)
    }
}

impl From<ModuleLrScheduler> for LearningRate {
    fn from(scheduler: ModuleLrScheduler) -> Self {
        LearningRate::Scheduler(scheduler)
    }
}

impl LearningRate {
    /// The rate for the next optimizer step (advances a scheduler).
    pub fn next_rate(&mut self) -> ModuleLearningRate {
        match self {
            LearningRate::Constant(lr) => (*lr).into(),
            LearningRate::Scheduler(s) | LearningRate::WarmupCosine { scheduler: s, .. } => {
                s.step()
            }
        }
    }

    /// The rate for the next optimizer step, and the learning rate as it is once that step
    /// is applied (LR-1): [`LearningRate::commit`] it when the step succeeded, drop it when
    /// the step failed and will be redone.
    pub fn peek_next(&self) -> (ModuleLearningRate, LearningRate) {
        let mut after = self.clone();
        (after.next_rate(), after)
    }

    /// Take `after`, from [`LearningRate::peek_next`], as the state after the applied step.
    pub fn commit(&mut self, after: LearningRate) {
        *self = after;
    }

    /// Megatron-LM's and torchtitan's usual schedule: a linear warm-up from `peak / 100` to
    /// `peak` over `warmup` steps, then a cosine down to `peak / 100` at step `total`
    /// (Burn's linear and cosine schedulers in sequence). Refused: a `peak` that is not
    /// positive and finite, `warmup` of 0 or not below `total`.
    pub fn warmup_cosine(
        peak: f64,
        warmup: usize,
        total: usize,
    ) -> Result<LearningRate, crate::config::InvalidConfig> {
        use burn::lr_scheduler::LrSchedulerConfig;
        use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
        use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
        use burn::lr_scheduler::sequential::SequentialLrSchedulerConfig;
        let bad = |why: String| {
            crate::config::InvalidConfig(format!(
                "warm-up and cosine (peak {peak}, warm-up {warmup}, {total} steps): {why}"
            ))
        };
        if !(peak > 0.0 && peak.is_finite()) {
            return Err(bad("the peak rate must be positive and finite".into()));
        }
        if warmup == 0 || warmup >= total {
            return Err(bad(
                "the warm-up must be at least 1 step and below the steps".into(),
            ));
        }
        let floor = peak / 100.0;
        SequentialLrSchedulerConfig::new(
            vec![
                LrSchedulerConfig::Linear(LinearLrSchedulerConfig::new(floor, peak, warmup)),
                LrSchedulerConfig::Cosine(
                    CosineAnnealingLrSchedulerConfig::new(peak, total - warmup).with_min_lr(floor),
                ),
            ],
            vec![warmup],
        )
        .init()
        .map(|scheduler| LearningRate::WarmupCosine {
            peak,
            warmup,
            total,
            scheduler,
        })
        .map_err(bad)
    }

    /// The scheduler's state (LR-2); `None` for a constant rate.
    pub fn state(&self) -> Result<Option<LrSchedulerState>, CheckpointError> {
        match self {
            LearningRate::Constant(_) => Ok(None),
            LearningRate::Scheduler(s) | LearningRate::WarmupCosine { scheduler: s, .. } => {
                let bytes =
                    s.to_record()
                        .into_bytes()
                        .map_err(|e| CheckpointError::LrSchedulerRecord {
                            reason: e.to_string(),
                        })?;
                Ok(Some(LrSchedulerState {
                    record: bytes.to_vec(),
                }))
            }
        }
    }

    /// Continue from `state`, a snapshot's scheduler state (LR-2). A constant rate ignores
    /// one (the job chose a constant rate); a scheduler without one is refused, since it
    /// would restart its schedule ([`CheckpointError::NoLrSchedulerState`]).
    pub fn restore(&mut self, state: Option<&LrSchedulerState>) -> Result<(), CheckpointError> {
        match (self, state) {
            (LearningRate::Constant(_), _) => Ok(()),
            (LearningRate::Scheduler(_) | LearningRate::WarmupCosine { .. }, None) => {
                Err(CheckpointError::NoLrSchedulerState)
            }
            (
                LearningRate::Scheduler(s) | LearningRate::WarmupCosine { scheduler: s, .. },
                Some(state),
            ) => {
                let bytes = burn::tensor::Bytes::from_bytes_vec(state.record.clone());
                let record = LrSchedulerRecord::from_bytes(bytes).map_err(|e| {
                    CheckpointError::LrSchedulerRecord {
                        reason: e.to_string(),
                    }
                })?;
                *s = s.clone().load_record(record);
                Ok(())
            }
        }
    }
}

impl std::fmt::Debug for LearningRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LearningRate::Constant(lr) => write!(f, "Constant({lr})"),
            LearningRate::Scheduler(_) => write!(f, "Scheduler(..)"),
            LearningRate::WarmupCosine {
                peak,
                warmup,
                total,
                ..
            } => write!(f, "WarmupCosine({peak}, {warmup} of {total} steps)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::lr_scheduler::LrSchedulerConfig;
    use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
    use burn::lr_scheduler::sequential::SequentialLrSchedulerConfig;

    use super::*;

    fn warm_up_cosine() -> LearningRate {
        LearningRate::Scheduler(
            SequentialLrSchedulerConfig::new(
                vec![
                    LrSchedulerConfig::Linear(LinearLrSchedulerConfig::new(1e-3, 1e-1, 4)),
                    LrSchedulerConfig::Cosine(CosineAnnealingLrSchedulerConfig::new(1e-1, 10)),
                ],
                vec![4],
            )
            .init()
            .expect("a valid schedule"),
        )
    }

    fn rates(lr: &mut LearningRate, n: usize) -> Vec<f64> {
        (0..n).map(|_| lr.next_rate().base()).collect()
    }

    /// LR-2: a fresh scheduler that restores a state continues exactly where the original
    /// was, at any step (inside the warm-up, at the switch, in the cosine).
    #[test]
    fn lr_2_a_restored_scheduler_continues_the_schedule_exactly() {
        for k in [0, 2, 4, 7] {
            let mut original = warm_up_cosine();
            rates(&mut original, k);
            let state = original.state().expect("records");
            let mut restored = warm_up_cosine();
            restored.restore(state.as_ref()).expect("restores");
            let (a, b) = (rates(&mut original, 8), rates(&mut restored, 8));
            assert_eq!(
                a.iter().map(|r| r.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|r| r.to_bits()).collect::<Vec<_>>(),
                "after {k} steps"
            );
            // Not vacuous: a fresh schedule differs after a few steps.
            if k > 0 {
                assert_ne!(rates(&mut warm_up_cosine(), 8), a, "after {k} steps");
            }
        }
    }

    /// LR-2: a scheduler without a stored state is refused (it would restart); a constant
    /// rate has no state and ignores one; a record that does not decode is a typed error.
    #[test]
    fn lr_2_missing_or_corrupt_states_are_refused_and_constants_ignore_them() {
        let mut lr = warm_up_cosine();
        assert_eq!(lr.restore(None), Err(CheckpointError::NoLrSchedulerState));
        let garbage = LrSchedulerState {
            record: vec![1, 2, 3],
        };
        assert!(matches!(
            lr.restore(Some(&garbage)),
            Err(CheckpointError::LrSchedulerRecord { .. })
        ));
        assert_eq!(rates(&mut lr, 3), rates(&mut warm_up_cosine(), 3));
        let mut constant = LearningRate::Constant(0.5);
        assert_eq!(constant.state(), Ok(None));
        let state = warm_up_cosine().state().expect("records");
        assert_eq!(constant.restore(state.as_ref()), Ok(()));
        assert_eq!(constant.next_rate().base(), 0.5);
    }

    /// LR-1: peeking gives the next rate without advancing; committing advances once.
    #[test]
    fn lr_1_the_schedule_advances_only_when_a_step_is_committed() {
        let mut lr = warm_up_cosine();
        let (first, _) = lr.peek_next();
        let (again, after) = lr.peek_next();
        assert_eq!(first.base(), again.base());
        lr.commit(after);
        let mut reference = warm_up_cosine();
        let expected = rates(&mut reference, 2);
        assert_eq!(first.base(), expected[0]);
        assert_eq!(lr.next_rate().base(), expected[1]);
    }
}
