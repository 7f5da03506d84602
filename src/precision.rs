//! Mixed precision as data: which float type a job's forward and backward run in
//! ([`Precision`]), and the dynamic loss scaler of f16 training ([`LossScaler`], the rules of
//! `torch.amp.GradScaler`). Pure: no Burn, no I/O; the worker applies them
//! (`parallel::autocast`, `actors::stage`).
//!
//! Invariants (tests name them):
//! - **PREC-1** the optimizer steps `f32` master weights: a job's model, its checkpoints and
//!   its trained model hold `f32` parameters whatever the precision; only the copy a
//!   micro-batch computes with is low precision.
//! - **PREC-2** the scaler's decision (skip and back off, or step and maybe grow) is taken on
//!   the all-reduced gradient, which every replica holds bit for bit, so every replica skips
//!   the same steps and keeps the same scale.
//! - **PREC-3** the scale stays finite and positive: a growth that would overflow `f32` and a
//!   back-off below [`MIN_SCALE`] are not applied.
//!
//! - **PREC-4** a model that does not cast its input to its parameters' dtype (Burn does not
//!   promote dtypes) ends its first step with `Error::DtypeMismatch` naming the casts to add (the
//!   device thread's panic carrying Burn's dtype assertion is mapped in `actors::stage::failed`),
//!   never as a lost stage.

use serde::{Deserialize, Serialize};

use crate::config::InvalidConfig;

/// The float type a job's forward and backward run in. The optimizer always steps `f32`
/// master weights (PREC-1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Precision {
    /// Everything in `f32` (the default).
    #[default]
    F32,
    /// Forward and backward in bfloat16 (8-bit exponent: no loss scaling needed).
    Bf16,
    /// Forward and backward in IEEE half precision, with dynamic loss scaling.
    F16,
}

impl Precision {
    /// Whether forward and backward run in a 16-bit type.
    pub fn is_low(self) -> bool {
        self != Precision::F32
    }

    /// Whether this precision needs loss scaling (f16's small exponent range).
    pub fn scales_loss(self) -> bool {
        self == Precision::F16
    }

    /// The name the CLI and reports use: `f32`, `bf16`, `f16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = InvalidConfig;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f16" | "fp16" => Ok(Precision::F16),
            other => Err(InvalidConfig(format!(
                "unknown precision `{other}`: use f32, bf16 or f16"
            ))),
        }
    }
}

/// The smallest scale a back-off goes to (PREC-3).
pub const MIN_SCALE: f32 = 1.0 / 65536.0;

/// How a [`LossScaler`] moves its scale (`torch.amp.GradScaler`'s defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossScalerConfig {
    /// The first scale (2^16).
    pub init_scale: f32,
    /// What the scale is multiplied by after `growth_interval` clean steps in a row (2).
    pub growth_factor: f32,
    /// What the scale is multiplied by on an overflow (0.5).
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows (2000).
    pub growth_interval: u32,
}

impl Default for LossScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScalerConfig {
    /// The same configuration growing after `n` clean steps.
    pub fn growth_interval(mut self, n: u32) -> Self {
        self.growth_interval = n;
        self
    }

    /// Refuses a configuration that cannot scale: a non-finite or non-positive first scale, a
    /// growth factor not above 1, a back-off factor outside (0, 1), an interval of 0.
    pub fn validate(&self) -> Result<(), InvalidConfig> {
        let bad = |what: String| Err(InvalidConfig(format!("loss scaler: {what}")));
        if !(self.init_scale.is_finite() && self.init_scale >= MIN_SCALE) {
            return bad(format!(
                "the initial scale {} must be finite and at least {MIN_SCALE}",
                self.init_scale
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(format!(
                "the growth factor {} must be finite and above 1",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(format!(
                "the back-off factor {} must be in (0, 1)",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return bad("the growth interval must be at least one step".into());
        }
        Ok(())
    }
}

/// A [`LossScaler`]'s state: what a checkpoint keeps of it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The scale the next step multiplies its loss by.
    pub scale: f32,
    /// Clean steps in a row since the last growth or back-off.
    pub clean_steps: u32,
}

/// What a [`LossScaler`] decided about a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleUpdate {
    /// The gradient overflowed: the step is skipped and the scale backed off.
    Skip,
    /// The step is taken; the scale stays.
    Step,
    /// The step is taken and the scale grew (the growth interval was reached).
    StepAndGrow,
}

impl ScaleUpdate {
    /// Whether the optimizer steps.
    pub fn steps(self) -> bool {
        self != ScaleUpdate::Skip
    }
}

/// Dynamic loss scaling (`torch.amp.GradScaler`): the loss is multiplied by the scale before
/// backward, the reduced gradient divided by it; an overflow (inf or NaN in the reduced
/// gradient) skips the step and multiplies the scale by the back-off factor, and every
/// `growth_interval` clean steps in a row multiply it by the growth factor.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    config: LossScalerConfig,
    state: ScalerState,
}

impl LossScaler {
    /// A scaler at the configuration's first scale.
    pub fn new(config: LossScalerConfig) -> Result<Self, InvalidConfig> {
        config.validate()?;
        Ok(Self {
            config,
            state: ScalerState {
                scale: config.init_scale,
                clean_steps: 0,
            },
        })
    }

    /// The scale the next step's loss is multiplied by.
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// The configuration.
    pub fn config(&self) -> LossScalerConfig {
        self.config
    }

    /// Takes a step's outcome: `overflow` is whether the all-reduced gradient held an inf or
    /// a NaN (PREC-2).
    pub fn update(&mut self, overflow: bool) -> ScaleUpdate {
        let s = &mut self.state;
        if overflow {
            s.clean_steps = 0;
            let backed = s.scale * self.config.backoff_factor;
            if backed >= MIN_SCALE {
                s.scale = backed;
            }
            return ScaleUpdate::Skip;
        }
        s.clean_steps += 1;
        if s.clean_steps < self.config.growth_interval {
            return ScaleUpdate::Step;
        }
        s.clean_steps = 0;
        let grown = s.scale * self.config.growth_factor;
        if grown.is_finite() {
            s.scale = grown;
            ScaleUpdate::StepAndGrow
        } else {
            ScaleUpdate::Step
        }
    }

    /// The state to checkpoint.
    pub fn state(&self) -> ScalerState {
        self.state
    }

    /// Continues from a checkpointed state; refuses a scale that is not finite and positive,
    /// or a count past the growth interval.
    pub fn restore(&mut self, state: ScalerState) -> Result<(), InvalidConfig> {
        if !(state.scale.is_finite() && state.scale >= MIN_SCALE) {
            return Err(InvalidConfig(format!(
                "loss scaler: a checkpointed scale of {} is not finite and at least {MIN_SCALE}",
                state.scale
            )));
        }
        if state.clean_steps >= self.config.growth_interval {
            return Err(InvalidConfig(format!(
                "loss scaler: {} clean steps checkpointed, but the growth interval is {}",
                state.clean_steps, self.config.growth_interval
            )));
        }
        self.state = state;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
