//! Synchronising less often, as data and pure functions: local SGD, DiLoCo (Douillard et al.,
//! 2023) and synchronous elastic averaging SGD (EASGD, Zhang, Choromanska and LeCun, 2015).
//! Every rank of a data-parallel group steps its own copy of the model with the job's
//! optimizer (the *inner* optimizer) on its own samples, with no gradient collective; every
//! `every` applied steps the ranks meet in one all-reduce (sum) of a flat buffer of the size of
//! the trainable parameters and apply the strategy's rule. No Burn tensors, no threads, no I/O:
//! the device side (`parallel::sync::local`) feeds it buffers.
//!
//! A synchronisation is two halves around the all-reduce: [`LocalUpdates::contribution`] is
//! what a rank puts into it, [`LocalUpdates::after_sync`] turns the group's sum into the
//! rank's new parameters and [`OuterState`]:
//!
//! | strategy | a rank contributes | after the sum `S` (world `p`) |
//! |---|---|---|
//! | local SGD | its parameters `θᵢ` | `θᵢ ← S / p` |
//! | DiLoCo | its outer gradient `θ_g − θᵢ` | `Δ = S / p`; `m ← μ·m + Δ`; `θ_g ← θ_g − η·(Δ + μ·m)` (Nesterov) or `θ_g − η·m`; `θᵢ ← θ_g` |
//! | EASGD | its distance to the centre `θᵢ − x̃` | `θᵢ ← θᵢ − α·(θᵢ − x̃)`; `x̃ ← x̃ + α·S` |
//!
//! # Invariants
//!
//! - **LOCAL-1 schedule.** A rank synchronises after its applied step number `s` (counted from
//!   1, skipped steps not counted, the count restored from checkpoints) exactly when
//!   `s % every == 0` ([`LocalUpdates::syncs_after`]); every rank counts alike, so the
//!   all-reduces pair up.
//! - **LOCAL-2 replicated outer state.** DiLoCo's global parameters `θ_g` and momentum `m`,
//!   and EASGD's centre `x̃`, are kept whole on every rank and updated from the all-reduced
//!   sum only, so they are bitwise equal on every rank (the all-reduce hands every rank the
//!   same sum). A replicated centre costs one model copy per rank and no collective beyond
//!   the one all-reduce; a centre actor or a sharded centre would need a second exchange.
//! - **LOCAL-3 reductions.** Local SGD after a sync, DiLoCo with `η = 1, μ = 0` and EASGD with
//!   every `θᵢ = x̃` reduce to plain averaging / identity (property tests below); EASGD's
//!   elastic step conserves `x̃ + Σᵢ θᵢ` (the centre moves by exactly what the workers give).
//!
//! Defaults: DiLoCo's outer optimizer is the paper's Nesterov SGD with learning rate 0.7 and
//! momentum 0.9. EASGD's moving rate is `α = 0.1` per rank (the paper's `β = p·α`; `p·α ≤ 1`
//! is required, so the centre never overshoots the workers' mean: at `p = 4`, `β = 0.4`).
//! `every` defaults to 8 in the text form when left out.

use serde::{Deserialize, Serialize};

use crate::config::InvalidConfig;

/// How often and how a data-parallel group of ranks stepping on their own meet
/// (`JobBuilder::local_updates`). Its text form, read by `FromStr` and written by `Display`
/// (for a program's own flags or configuration files; no `meshwork` command takes it), is
/// `local-sgd:H`, `diloco:H[:outer_lr[:outer_momentum[:nesterov|plain]]]` or
/// `easgd:H[:alpha]`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum LocalUpdates {
    /// Local SGD: every `every` steps the ranks' parameters are averaged.
    LocalSgd {
        /// Steps between averagings (H).
        every: u32,
    },
    /// DiLoCo: the job's optimizer is the inner optimizer; every `every` steps an outer SGD
    /// step on the mean parameter change (the outer gradient) moves the global parameters,
    /// which every rank then takes.
    DiLoCo {
        /// Inner steps between outer steps (H).
        every: u32,
        /// The outer learning rate η (the paper: 0.7).
        outer_lr: f32,
        /// The outer momentum μ (the paper: 0.9).
        outer_momentum: f32,
        /// Nesterov momentum for the outer step (the paper: yes).
        nesterov: bool,
    },
    /// Synchronous elastic averaging SGD: every `every` steps (τ) each rank is pulled toward
    /// the centre variable by `alpha`, and the centre toward the ranks by `alpha` each.
    Easgd {
        /// Steps between elastic updates (τ).
        every: u32,
        /// The moving rate α of each rank (the paper's `β = p·α`).
        alpha: f32,
    },
}

/// What a strategy keeps besides each rank's own parameters: the same on every rank
/// (LOCAL-2); in checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OuterState {
    /// DiLoCo's global parameters `θ_g` (as of the last outer step), EASGD's centre `x̃`;
    /// empty for local SGD and before the first step (then [`OuterState::start`] fills it).
    pub anchor: Vec<f32>,
    /// DiLoCo's outer momentum buffer (zeros at the start); empty otherwise.
    pub momentum: Vec<f32>,
}

impl OuterState {
    /// Fill the state from the parameters every rank starts from, if `updates` needs one
    /// and it is empty (a restored state is kept).
    pub fn start(&mut self, updates: &LocalUpdates, params: &[f32]) {
        if !updates.has_outer_state() || !self.anchor.is_empty() {
            return;
        }
        self.anchor = params.to_vec();
        if matches!(updates, LocalUpdates::DiLoCo { .. }) {
            self.momentum = vec![0.0; params.len()];
        }
    }
}

impl LocalUpdates {
    /// DiLoCo's outer learning rate in the paper.
    pub const DILOCO_OUTER_LR: f32 = 0.7;
    /// DiLoCo's outer momentum in the paper.
    pub const DILOCO_OUTER_MOMENTUM: f32 = 0.9;
    /// EASGD's default moving rate per rank.
    pub const EASGD_ALPHA: f32 = 0.1;
    /// The steps between synchronisations when the text form leaves them out.
    pub const DEFAULT_EVERY: u32 = 8;

    /// Local SGD averaging every `every` steps.
    pub fn local_sgd(every: u32) -> Self {
        LocalUpdates::LocalSgd { every }
    }

    /// DiLoCo every `every` inner steps with the paper's outer optimizer (Nesterov SGD,
    /// learning rate 0.7, momentum 0.9).
    pub fn diloco(every: u32) -> Self {
        LocalUpdates::DiLoCo {
            every,
            outer_lr: Self::DILOCO_OUTER_LR,
            outer_momentum: Self::DILOCO_OUTER_MOMENTUM,
            nesterov: true,
        }
    }

    /// EASGD every `every` steps with moving rate `alpha` per rank.
    pub fn easgd(every: u32, alpha: f32) -> Self {
        LocalUpdates::Easgd { every, alpha }
    }

    /// The steps between synchronisations.
    pub fn every(&self) -> u32 {
        match *self {
            LocalUpdates::LocalSgd { every }
            | LocalUpdates::DiLoCo { every, .. }
            | LocalUpdates::Easgd { every, .. } => every,
        }
    }

    /// The method's name, as the text form and `meshwork bench comm-efficiency --methods`
    /// spell it: `local-sgd`, `diloco`, `easgd`.
    pub fn name(&self) -> &'static str {
        match self {
            LocalUpdates::LocalSgd { .. } => "local-sgd",
            LocalUpdates::DiLoCo { .. } => "diloco",
            LocalUpdates::Easgd { .. } => "easgd",
        }
    }

    /// Whether the strategy keeps an [`OuterState`] (DiLoCo, EASGD).
    pub fn has_outer_state(&self) -> bool {
        !matches!(self, LocalUpdates::LocalSgd { .. })
    }

    /// LOCAL-1: whether a rank synchronises after its `applied`-th applied step (from 1).
    pub fn syncs_after(&self, applied: u64) -> bool {
        let every = u64::from(self.every());
        every > 0 && applied > 0 && applied.is_multiple_of(every)
    }

    /// Refuses what cannot train: `every` of 0, a non-finite or negative outer learning rate,
    /// a momentum outside `[0, 1)`, an EASGD rate outside `(0, 1]` or with `replicas · α > 1`.
    pub fn validate(&self, replicas: u32) -> Result<(), InvalidConfig> {
        if self.every() == 0 {
            return Err(InvalidConfig(format!(
                "{}: synchronising every 0 steps: use at least 1",
                self.name()
            )));
        }
        match *self {
            LocalUpdates::LocalSgd { .. } => Ok(()),
            LocalUpdates::DiLoCo {
                outer_lr,
                outer_momentum,
                ..
            } => {
                if !outer_lr.is_finite() || outer_lr <= 0.0 {
                    return Err(InvalidConfig(format!(
                        "diloco: outer learning rate {outer_lr}: use a positive number (the \
                         paper's is 0.7)"
                    )));
                }
                if !(0.0..1.0).contains(&outer_momentum) {
                    return Err(InvalidConfig(format!(
                        "diloco: outer momentum {outer_momentum}: use a number in [0, 1) (the \
                         paper's is 0.9)"
                    )));
                }
                Ok(())
            }
            LocalUpdates::Easgd { alpha, .. } => {
                if !(alpha > 0.0 && alpha <= 1.0) {
                    return Err(InvalidConfig(format!(
                        "easgd: moving rate {alpha}: use a number in (0, 1]"
                    )));
                }
                if alpha * replicas as f32 > 1.0 {
                    return Err(InvalidConfig(format!(
                        "easgd: moving rate {alpha} with {replicas} replicas moves the centre \
                         by {} of the workers' distance (above 1 it overshoots their mean): \
                         use alpha <= {}",
                        alpha * replicas as f32,
                        1.0 / replicas as f32
                    )));
                }
                Ok(())
            }
        }
    }

    /// What a rank puts into the synchronisation's all-reduce (sum): its parameters (local
    /// SGD), its outer gradient `θ_g − θᵢ` (DiLoCo) or its distance to the centre `θᵢ − x̃`
    /// (EASGD). `outer` must have been started ([`OuterState::start`]).
    pub fn contribution(&self, params: &[f32], outer: &OuterState) -> Vec<f32> {
        match self {
            LocalUpdates::LocalSgd { .. } => params.to_vec(),
            LocalUpdates::DiLoCo { .. } => outer
                .anchor
                .iter()
                .zip(params)
                .map(|(g, p)| g - p)
                .collect(),
            LocalUpdates::Easgd { .. } => params
                .iter()
                .zip(&outer.anchor)
                .map(|(p, c)| p - c)
                .collect(),
        }
    }

    /// The rank's parameters and the outer state after the synchronisation whose all-reduced
    /// sum of [`contribution`](Self::contribution)s over `world` ranks is `sum` (the table in
    /// the module docs).
    pub fn after_sync(
        &self,
        params: &mut [f32],
        outer: &mut OuterState,
        sum: &[f32],
        world: usize,
    ) {
        let p = world.max(1) as f32;
        match *self {
            LocalUpdates::LocalSgd { .. } => {
                params.iter_mut().zip(sum).for_each(|(x, s)| *x = s / p);
            }
            LocalUpdates::DiLoCo {
                outer_lr,
                outer_momentum,
                nesterov,
                ..
            } => {
                let OuterState { anchor, momentum } = outer;
                for (((g, m), x), s) in anchor.iter_mut().zip(momentum).zip(params).zip(sum) {
                    let delta = s / p;
                    *m = outer_momentum * *m + delta;
                    let step = if nesterov {
                        delta + outer_momentum * *m
                    } else {
                        *m
                    };
                    *g -= outer_lr * step;
                    *x = *g;
                }
            }
            LocalUpdates::Easgd { alpha, .. } => {
                for ((x, c), s) in params.iter_mut().zip(&mut outer.anchor).zip(sum) {
                    *x -= alpha * (*x - *c);
                    *c += alpha * s;
                }
            }
        }
    }
}

impl std::fmt::Display for LocalUpdates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            LocalUpdates::LocalSgd { every } => write!(f, "local-sgd:{every}"),
            LocalUpdates::DiLoCo {
                every,
                outer_lr,
                outer_momentum,
                nesterov,
            } => write!(
                f,
                "diloco:{every}:{outer_lr}:{outer_momentum}:{}",
                if nesterov { "nesterov" } else { "plain" }
            ),
            LocalUpdates::Easgd { every, alpha } => write!(f, "easgd:{every}:{alpha}"),
        }
    }
}

impl std::str::FromStr for LocalUpdates {
    type Err = InvalidConfig;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut fields = s.split(':');
        let name = fields.next().unwrap_or("").to_ascii_lowercase();
        let rest: Vec<&str> = fields.collect();
        let form = "use local-sgd:H, diloco:H[:outer_lr[:outer_momentum[:nesterov|plain]]] \
                    or easgd:H[:alpha]";
        let number = |i: usize, what: &str| -> Result<Option<f32>, InvalidConfig> {
            rest.get(i)
                .map(|v| {
                    v.parse::<f32>().map_err(|_| {
                        InvalidConfig(format!("{s}: {what} `{v}` is not a number; {form}"))
                    })
                })
                .transpose()
        };
        let every = match rest.first() {
            None => Self::DEFAULT_EVERY,
            Some(v) => v.parse::<u32>().map_err(|_| {
                InvalidConfig(format!(
                    "{s}: steps between syncs `{v}` is not a count; {form}"
                ))
            })?,
        };
        let too_many = |n: usize| {
            if rest.len() > n {
                Err(InvalidConfig(format!("{s}: too many fields; {form}")))
            } else {
                Ok(())
            }
        };
        match name.as_str() {
            "local-sgd" | "localsgd" | "local_sgd" => {
                too_many(1)?;
                Ok(Self::local_sgd(every))
            }
            "diloco" => {
                too_many(4)?;
                let nesterov = match rest.get(3).map(|v| v.to_ascii_lowercase()) {
                    None => true,
                    Some(v) if v == "nesterov" => true,
                    Some(v) if v == "plain" => false,
                    Some(v) => {
                        return Err(InvalidConfig(format!(
                            "{s}: `{v}` is neither nesterov nor plain; {form}"
                        )));
                    }
                };
                Ok(LocalUpdates::DiLoCo {
                    every,
                    outer_lr: number(1, "outer learning rate")?.unwrap_or(Self::DILOCO_OUTER_LR),
                    outer_momentum: number(2, "outer momentum")?
                        .unwrap_or(Self::DILOCO_OUTER_MOMENTUM),
                    nesterov,
                })
            }
            "easgd" => {
                too_many(2)?;
                Ok(Self::easgd(
                    every,
                    number(1, "moving rate")?.unwrap_or(Self::EASGD_ALPHA),
                ))
            }
            other => Err(InvalidConfig(format!("unknown method `{other}`: {form}"))),
        }
    }
}

#[cfg(test)]
mod tests;
