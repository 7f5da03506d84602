//! ZeRO stages 1 and 2 (Rajbhandari et al., 2020) as data and pure functions: which elements
//! of the flat parameter order each data-parallel rank owns, the update rules of SGD, Adam and
//! AdamW on flat slices, and the re-sharding of optimizer state onto another group size.
//! No Burn tensors, no threads, no I/O: the device side (`parallel::sync`) feeds it
//! buffers.
//!
//! # Invariants
//!
//! - **ZERO-1 ownership.** Rank `r` of `n` owns the elements
//!   `chunk_range(len, n, r)` of the flat trainable-parameter order (`ParamLayout::trainable`):
//!   the ranges are disjoint and cover the buffer, sizes not divisible by `n` included. A
//!   rank keeps optimizer state for its range only.
//! - **ZERO-2 same rule.** [`FlatRule::step`] applies the same arithmetic, in the same order
//!   and precision, as Burn's `Sgd`, `Adam` and `AdamW`, so a sharded step equals Burn's
//!   whole-model step element for element (tested against Burn in `tests/suite/zero.rs`).
//! - **ZERO-3 re-sharding.** [`reshard`] rebuilds any rank's shard of any group size from a
//!   complete set of parts; the state of every element is moved, never recomputed.
//!
//! - **ZERO-4** each buffer of a `FlatState` starts at its own offset within its allocation
//!   (`StateBuffer`: 1, 2, 3 cache lines); serialized as the plain sequence of its values, so
//!   checkpoints do not change (`meshwork bench optimizer`).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::comm::chunk_range;
use crate::optim::OptimizerConfig;

/// How much of the training state each data-parallel rank keeps (ZeRO's stages).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ZeroStage {
    /// Plain data parallelism: every rank holds all parameters, gradients and optimizer state.
    #[default]
    Off,
    /// Stage 1: each rank keeps the optimizer state of its 1/N of the parameters; gradients
    /// are all-reduced, each rank steps its shard, the updated shards are all-gathered.
    One,
    /// Stage 2: as stage 1, but gradients are reduce-scattered, so each rank also holds only
    /// its shard of the reduced gradient.
    Two,
    /// Stage 3 (fully sharded data parallelism, FSDP): as stage 2, and each rank also keeps
    /// only its shard of every block's parameters between uses; a block's parameters are
    /// all-gathered before its forward and backward and released after them. Needs the model
    /// given as blocks (`JobBuilder::blocks` or `JobBuilder::pipeline`).
    Three,
}

impl ZeroStage {
    /// The stage's number (0 to 3).
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }

    /// The stage with this number.
    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            0 => Some(ZeroStage::Off),
            1 => Some(ZeroStage::One),
            2 => Some(ZeroStage::Two),
            3 => Some(ZeroStage::Three),
            _ => None,
        }
    }

    /// Whether optimizer state is sharded (stage 1, 2 or 3).
    pub fn shards_optimizer(self) -> bool {
        self != ZeroStage::Off
    }

    /// Whether parameters are sharded between uses (stage 3).
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::Three
    }
}

/// The elements rank `rank` of `world` owns in a flat buffer of `len` elements (ZERO-1).
pub fn owned_range(len: usize, world: usize, rank: usize) -> Range<usize> {
    chunk_range(len, world, rank)
}

/// Why an optimizer configuration cannot be sharded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("this optimizer cannot be sharded: {0}")]
pub struct UnsupportedOptimizer(pub String);

/// An optimizer's update rule on flat `f32` slices (ZERO-2): Burn's arithmetic, element by
/// element.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum FlatRule {
    /// Burn's `Sgd`: optional L2 penalty added to the gradient, optional momentum.
    Sgd {
        /// The L2 penalty (`WeightDecayConfig::penalty`).
        weight_decay: Option<f32>,
        /// `(momentum, dampening, nesterov)`.
        momentum: Option<(f32, f64, bool)>,
    },
    /// Burn's `Adam`: L2 penalty added to the gradient, bias-corrected moments.
    Adam {
        /// β₁.
        beta_1: f32,
        /// β₂.
        beta_2: f32,
        /// ε.
        epsilon: f32,
        /// AMSGrad.
        amsgrad: bool,
        /// The L2 penalty.
        weight_decay: Option<f32>,
    },
    /// Burn's `AdamW`: decoupled weight decay.
    AdamW {
        /// β₁.
        beta_1: f32,
        /// β₂.
        beta_2: f32,
        /// ε.
        epsilon: f32,
        /// AMSGrad.
        amsgrad: bool,
        /// The decoupled weight decay.
        weight_decay: f32,
        /// Decay only where the parameter and the first moment agree in sign.
        cautious: bool,
    },
}

/// The optimizer state of a range of elements: step count and per-element buffers (momentum,
/// first and second moments). Empty buffers mean "not stepped yet".
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlatState {
    /// Optimizer steps taken.
    pub steps: u64,
    /// SGD's velocity, or Adam's first moment.
    pub first: StateBuffer,
    /// Adam's second moment.
    pub second: StateBuffer,
    /// AMSGrad's running maximum of the second moment.
    pub max_second: StateBuffer,
}

impl FlatState {
    /// The bytes of per-element state held.
    pub fn bytes(&self) -> usize {
        4 * (self.first.len() + self.second.len() + self.max_second.len())
    }

    /// The elements `range` (relative to this state's own range) of every buffer.
    fn slice(&self, range: Range<usize>) -> FlatState {
        let part = |v: &StateBuffer| {
            if v.is_empty() {
                StateBuffer::default()
            } else {
                v[range.clone()].to_vec().into()
            }
        };
        FlatState {
            steps: self.steps,
            first: part(&self.first),
            second: part(&self.second),
            max_second: part(&self.max_second),
        }
    }
}

/// One buffer of optimizer state: `f32` values, each buffer of a [`FlatState`] starting at
/// its own offset within its allocation (ZERO-4). Large allocations start at the same offset
/// within a page, and a fused update reading and writing four or five such buffers at once ran
/// at up to 10× a memcpy of its bytes on the development machine, within 1.5× once its
/// buffers were staggered (`meshwork bench optimizer`). Serialized as the plain sequence of
/// its values, like a `Vec<f32>`.
#[derive(Clone, Default)]
pub struct StateBuffer {
    buf: Vec<f32>,
    start: usize,
}

impl StateBuffer {
    /// `n` zeros starting `stagger` cache lines (64 bytes) into the allocation.
    pub fn zeros(n: usize, stagger: usize) -> Self {
        let start = if n == 0 { 0 } else { 16 * stagger };
        Self {
            buf: vec![0.0; start + n],
            start,
        }
    }

    /// `values` copied to a buffer starting `stagger` cache lines into its allocation.
    pub fn staggered(values: &[f32], stagger: usize) -> Self {
        let mut out = Self::zeros(values.len(), stagger);
        out.copy_from_slice(values);
        out
    }
}

impl From<Vec<f32>> for StateBuffer {
    fn from(buf: Vec<f32>) -> Self {
        Self { buf, start: 0 }
    }
}

impl std::ops::Deref for StateBuffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[self.start..]
    }
}

impl std::ops::DerefMut for StateBuffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[self.start..]
    }
}

impl PartialEq for StateBuffer {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for StateBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl Serialize for StateBuffer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (**self).serialize(s)
    }
}

impl<'de> Deserialize<'de> for StateBuffer {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<f32>::deserialize(d).map(Self::from)
    }
}

fn field<'a>(
    v: &'a serde_json::Value,
    name: &str,
) -> Result<&'a serde_json::Value, UnsupportedOptimizer> {
    v.get(name)
        .ok_or_else(|| UnsupportedOptimizer(format!("its configuration has no field {name}")))
}

fn f32_of(v: &serde_json::Value, name: &str) -> Result<f32, UnsupportedOptimizer> {
    field(v, name)?
        .as_f64()
        .map(|x| x as f32)
        .ok_or_else(|| UnsupportedOptimizer(format!("{name} is not a number")))
}

fn f64_of(v: &serde_json::Value, name: &str) -> Result<f64, UnsupportedOptimizer> {
    field(v, name)?
        .as_f64()
        .ok_or_else(|| UnsupportedOptimizer(format!("{name} is not a number")))
}

fn bool_of(v: &serde_json::Value, name: &str) -> Result<bool, UnsupportedOptimizer> {
    field(v, name)?
        .as_bool()
        .ok_or_else(|| UnsupportedOptimizer(format!("{name} is not a boolean")))
}

fn penalty(v: &serde_json::Value) -> Result<Option<f32>, UnsupportedOptimizer> {
    match field(v, "weight_decay")? {
        serde_json::Value::Null => Ok(None),
        d => f32_of(d, "penalty").map(Some),
    }
}

fn no_clipping(v: &serde_json::Value, name: &str) -> Result<(), UnsupportedOptimizer> {
    match v.get(name) {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(_) => Err(UnsupportedOptimizer(
            "per-tensor gradient clipping inside the optimizer needs whole tensors; use the \
             job's global-norm clipping (`clip_grad_norm`) instead"
                .into(),
        )),
    }
}

impl FlatRule {
    /// The rule of `config`. Burn's configurations keep their fields private; they are read
    /// from their serialized form, which is Burn's stable config format.
    pub fn of(config: &OptimizerConfig) -> Result<Self, UnsupportedOptimizer> {
        let json = |r: Result<serde_json::Value, serde_json::Error>| {
            r.map_err(|e| {
                UnsupportedOptimizer(format!("its configuration does not serialize: {e}"))
            })
        };
        match config {
            OptimizerConfig::Sgd(c) => {
                let v = json(serde_json::to_value(c))?;
                no_clipping(&v, "gradient_clipping")?;
                let momentum = match field(&v, "momentum")? {
                    serde_json::Value::Null => None,
                    m => Some((
                        f64_of(m, "momentum")? as f32,
                        f64_of(m, "dampening")?,
                        bool_of(m, "nesterov")?,
                    )),
                };
                Ok(FlatRule::Sgd {
                    weight_decay: penalty(&v)?,
                    momentum,
                })
            }
            OptimizerConfig::Adam(c) => {
                let v = json(serde_json::to_value(c))?;
                no_clipping(&v, "grad_clipping")?;
                Ok(FlatRule::Adam {
                    beta_1: f32_of(&v, "beta_1")?,
                    beta_2: f32_of(&v, "beta_2")?,
                    epsilon: f32_of(&v, "epsilon")?,
                    amsgrad: bool_of(&v, "amsgrad")?,
                    weight_decay: penalty(&v)?,
                })
            }
            OptimizerConfig::AdamW(c) => {
                let v = json(serde_json::to_value(c))?;
                no_clipping(&v, "grad_clipping")?;
                Ok(FlatRule::AdamW {
                    beta_1: f32_of(&v, "beta_1")?,
                    beta_2: f32_of(&v, "beta_2")?,
                    epsilon: f32_of(&v, "epsilon")?,
                    amsgrad: bool_of(&v, "amsgrad")?,
                    weight_decay: f32_of(&v, "weight_decay")?,
                    cautious: bool_of(&v, "cautious_weight_decay")?,
                })
            }
        }
    }

    /// Per-element state words the rule keeps once it has stepped (ZeRO's K / 2 for Adam).
    pub fn state_words(&self) -> usize {
        match self {
            FlatRule::Sgd { momentum, .. } => usize::from(momentum.is_some()),
            FlatRule::Adam { amsgrad, .. } | FlatRule::AdamW { amsgrad, .. } => {
                2 + usize::from(*amsgrad)
            }
        }
    }

    /// One optimizer step of `params` (a shard's values) with `grads` (its reduced gradient),
    /// `segments` giving each part of the shard's learning rate (parameters may have their
    /// own rates). Burn steps every parameter's state once per step; so does this.
    pub fn step(
        &self,
        state: &mut FlatState,
        params: &mut [f32],
        grads: &[f32],
        segments: &[(Range<usize>, f64)],
    ) {
        assert_eq!(params.len(), grads.len(), "a shard's values and gradient");
        self.begin_step(state, params.len());
        for (range, lr) in segments {
            let (p, g) = (&mut params[range.clone()], &grads[range.clone()]);
            self.step_range(state, range.clone(), p, g, *lr);
        }
        Self::end_step(state);
    }

    /// Before a step made of [`step_range`](Self::step_range)s: the state's buffers sized
    /// for `n` elements (zeros before the first step), each at its own offset (ZERO-4: first
    /// 1, second 2, AMSGrad's maximum 3 cache lines into its allocation).
    pub fn begin_step(&self, state: &mut FlatState, n: usize) {
        let grow = |v: &mut StateBuffer, stagger: usize| {
            if v.len() != n {
                *v = StateBuffer::zeros(n, stagger);
            }
        };
        let amsgrad = match *self {
            FlatRule::Sgd { momentum, .. } => {
                if momentum.is_some() {
                    grow(&mut state.first, 1);
                }
                return;
            }
            FlatRule::Adam { amsgrad, .. } | FlatRule::AdamW { amsgrad, .. } => amsgrad,
        };
        grow(&mut state.first, 1);
        grow(&mut state.second, 2);
        if amsgrad {
            grow(&mut state.max_second, 3);
        }
    }

    /// The elements `range` of the state stepped with `params` and `grads` (that range's
    /// values and gradient) at learning rate `lr`, within a step opened by
    /// [`begin_step`](Self::begin_step) and closed by [`end_step`](Self::end_step). The
    /// loops run over zipped slices, so that they vectorise; the arithmetic per element is
    /// Burn's, in its order.
    pub fn step_range(
        &self,
        state: &mut FlatState,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        lr: f64,
    ) {
        assert!(
            params.len() == range.len() && grads.len() == range.len(),
            "a range's values and gradient"
        );
        let first_step = state.steps == 0;
        let time = (state.steps + 1) as i32;
        let l2 = match *self {
            FlatRule::Sgd { weight_decay, .. } | FlatRule::Adam { weight_decay, .. } => {
                weight_decay
            }
            FlatRule::AdamW { .. } => None,
        };
        let with_l2 = |g: f32, p: f32| match l2 {
            Some(d) => g + p * d,
            None => g,
        };
        match *self {
            FlatRule::Sgd { momentum, .. } => {
                let lr = lr as f32;
                let Some((m, dampening, nesterov)) = momentum else {
                    for (p, &g) in params.iter_mut().zip(grads) {
                        *p -= with_l2(g, *p) * lr;
                    }
                    return;
                };
                let keep = (1.0 - dampening) as f32;
                let v = &mut state.first[range];
                for ((p, &g), v) in params.iter_mut().zip(grads).zip(v.iter_mut()) {
                    let g = with_l2(g, *p);
                    let velocity = if first_step { g } else { g * keep + *v * m };
                    *v = velocity;
                    let g = if nesterov { velocity * m + g } else { velocity };
                    *p -= g * lr;
                }
            }
            FlatRule::Adam {
                beta_1,
                beta_2,
                epsilon,
                ..
            } => {
                let bc2_sqrt = (1.0 - beta_2.powi(time)).sqrt();
                let combined = bc2_sqrt / (1.0 - beta_1.powi(time));
                let lr = lr as f32;
                let step = |p: &mut f32, m: f32, v: f32| {
                    let update = (m * combined) / (v.sqrt() + epsilon * bc2_sqrt);
                    *p -= update * lr;
                };
                let betas = (beta_1, beta_2);
                adam_segment(state, range, (params, grads), betas, with_l2, step);
            }
            FlatRule::AdamW {
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
                cautious,
                ..
            } => {
                let c1 = 1.0 - beta_1.powi(time);
                let c2 = 1.0 - beta_2.powi(time);
                let decay = lr * f64::from(weight_decay);
                let (keep, cut) = ((1.0 - decay) as f32, decay as f32);
                let lr = lr as f32;
                let step = |p: &mut f32, m: f32, v: f32| {
                    let update = (m / c1) / ((v / c2).sqrt() + epsilon);
                    let old = *p;
                    let decayed = if decay == 0.0 {
                        old
                    } else if cautious {
                        if (old >= 0.0) != (m >= 0.0) {
                            old - 0.0
                        } else {
                            old - old * cut
                        }
                    } else {
                        old * keep
                    };
                    *p = decayed - update * lr;
                };
                let betas = (beta_1, beta_2);
                adam_segment(state, range, (params, grads), betas, |g, _| g, step);
            }
        }
    }

    /// After a step's [`step_range`](Self::step_range)s: one more step taken.
    pub fn end_step(state: &mut FlatState) {
        state.steps += 1;
    }
}

/// Adam's moments over one segment of the flat buffers, element by element in Burn's order:
/// the gradient `grad(gradient, parameter)` (with an L2 penalty or not), the first and second
/// moments, AMSGrad's running maximum when its buffer is there, then `step(parameter, first
/// moment, second moment to divide by)`. One loop per case, over zipped slices.
#[inline(always)]
fn adam_segment(
    state: &mut FlatState,
    range: Range<usize>,
    (p, g): (&mut [f32], &[f32]),
    (b1, b2): (f32, f32),
    grad: impl Fn(f32, f32) -> f32,
    step: impl Fn(&mut f32, f32, f32),
) {
    let first = &mut state.first[range.clone()];
    let second = &mut state.second[range.clone()];
    let moments = |g: f32, m: &mut f32, v: &mut f32| {
        *m = *m * b1 + g * (1.0 - b1);
        *v = *v * b2 + (g * g) * (1.0 - b2);
    };
    if state.max_second.is_empty() {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(first).zip(second) {
            moments(grad(g, *p), m, v);
            step(p, *m, *v);
        }
    } else {
        let max_second = &mut state.max_second[range];
        let all = p.iter_mut().zip(g).zip(first).zip(second).zip(max_second);
        for ((((p, &g), m), v), max) in all {
            moments(grad(g, *p), m, v);
            *max = max.max(*v);
            step(p, *m, *max);
        }
    }
}

/// One rank's part of a sharded optimizer's state: which elements of the flat order it
/// covers, out of how many, and their state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerShard {
    /// The rule the state belongs to.
    pub rule: FlatRule,
    /// The elements covered, in the flat trainable-parameter order.
    pub range: Range<usize>,
    /// The length of the whole flat order.
    pub total: usize,
    /// The state of the covered elements.
    pub state: FlatState,
}

/// Why a set of optimizer parts cannot be re-sharded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReshardError {
    /// No parts.
    #[error("no optimizer parts to re-shard")]
    Empty,
    /// The parts describe buffers of different lengths or different rules.
    #[error("the optimizer parts disagree: {0}")]
    Inconsistent(String),
    /// Some elements are covered by no part, or by two.
    #[error("the optimizer parts do not cover elements {start}..{end} exactly once")]
    Coverage {
        /// First element concerned.
        start: usize,
        /// One past the last.
        end: usize,
    },
    /// The model's flat order has another length than the parts.
    #[error("the optimizer parts cover {parts} elements, the model has {model}")]
    Length {
        /// Elements in the parts.
        parts: usize,
        /// Elements in the model.
        model: usize,
    },
}

/// The parts, sorted and checked to tile `0..total` exactly once, with one rule and one step
/// count.
fn tiled(parts: &[OptimizerShard]) -> Result<Vec<&OptimizerShard>, ReshardError> {
    let first = parts.first().ok_or(ReshardError::Empty)?;
    let mut sorted: Vec<&OptimizerShard> = parts.iter().collect();
    sorted.sort_by_key(|p| (p.range.start, p.range.end));
    let mut at = 0;
    for p in &sorted {
        if p.total != first.total || p.rule != first.rule || p.state.steps != first.state.steps {
            return Err(ReshardError::Inconsistent(format!(
                "part {:?} has length {}, {} steps and rule {:?}; part {:?} has {}, {} and {:?}",
                p.range,
                p.total,
                p.state.steps,
                p.rule,
                first.range,
                first.total,
                first.state.steps,
                first.rule
            )));
        }
        let n = p.range.len();
        let buffers_ok = [&p.state.first, &p.state.second, &p.state.max_second]
            .iter()
            .all(|b| b.is_empty() || b.len() == n);
        if !buffers_ok {
            return Err(ReshardError::Inconsistent(format!(
                "part {:?} has state buffers of another length",
                p.range
            )));
        }
        if p.range.start != at {
            return Err(ReshardError::Coverage {
                start: at.min(p.range.start),
                end: at.max(p.range.start),
            });
        }
        at = p.range.end;
    }
    if at != first.total {
        return Err(ReshardError::Coverage {
            start: at,
            end: first.total,
        });
    }
    Ok(sorted)
}

/// Rank `rank` of `world`'s shard of the state held in `parts` (ZERO-3): the parts must tile
/// the flat order exactly once (any group size, any order); `model_len` is the model's flat
/// length, checked against theirs.
pub fn reshard(
    parts: &[OptimizerShard],
    model_len: usize,
    world: usize,
    rank: usize,
) -> Result<OptimizerShard, ReshardError> {
    let sorted = tiled(parts)?;
    let first = sorted[0];
    if first.total != model_len {
        return Err(ReshardError::Length {
            parts: first.total,
            model: model_len,
        });
    }
    let want = owned_range(first.total, world, rank);
    let stepped =
        |pick: fn(&FlatState) -> &[f32]| sorted.iter().any(|p| !pick(&p.state).is_empty());
    let gather = |pick: fn(&FlatState) -> &[f32], stagger: usize| -> StateBuffer {
        if !stepped(pick) {
            return StateBuffer::default();
        }
        let mut out = Vec::with_capacity(want.len());
        for p in &sorted {
            let lo = want.start.max(p.range.start);
            let hi = want.end.min(p.range.end);
            if lo >= hi {
                continue;
            }
            let buf = pick(&p.state);
            if buf.is_empty() {
                out.extend(std::iter::repeat_n(0.0, hi - lo));
            } else {
                out.extend_from_slice(&buf[lo - p.range.start..hi - p.range.start]);
            }
        }
        StateBuffer::staggered(&out, stagger)
    };
    Ok(OptimizerShard {
        rule: first.rule,
        range: want.clone(),
        total: first.total,
        state: FlatState {
            steps: first.state.steps,
            first: gather(|s| &s.first, 1),
            second: gather(|s| &s.second, 2),
            max_second: gather(|s| &s.max_second, 3),
        },
    })
}

impl OptimizerShard {
    /// A fresh shard (no state yet) of rank `rank` of `world` over `total` elements.
    pub fn fresh(rule: FlatRule, total: usize, world: usize, rank: usize) -> Self {
        Self {
            rule,
            range: owned_range(total, world, rank),
            total,
            state: FlatState::default(),
        }
    }

    /// The part of this shard covering `range` (absolute, inside this shard's range).
    pub fn part(&self, range: Range<usize>) -> OptimizerShard {
        let rel = range.start - self.range.start..range.end - self.range.start;
        OptimizerShard {
            rule: self.rule,
            range,
            total: self.total,
            state: self.state.slice(rel),
        }
    }
}

#[cfg(test)]
mod tests;
