//! Fault injection: a serializable [`FaultPlan`] of faults the runtime injects on purpose, for
//! fault-injection rehearsals and for our tests.
//!
//! Faults target a device (its [`DeviceId`] stays the same when the mesh shrinks) at a step,
//! and enter through hooks the runtime always calls — on the device thread before each forward,
//! each backward and the optimizer update ([`FaultHooks::before`], at a [`Phase`]), in the
//! communicators' message layer ([`DeviceMessages`]), in the checkpoint writer
//! ([`FaultHooks::fails_checkpoint`]), in the Supervisor at each step boundary
//! ([`FaultHooks::resize_at`]) and at the start of each step ([`FaultHooks::kills_at`]) —
//! not through test-only code paths. With no plan, a hook is one
//! `Option` check.
//!
//! - FAULT-1: a fault fires at most once per plan entry (`times` entries fire that many
//!   times), in the order the job reaches its trigger; every firing is recorded and published
//!   as a `FaultInjected` event.
//! - FAULT-2: the same plan gives the same run: triggers are step / micro-batch / phase
//!   positions, never wall-clock times, and [`FaultPlan::random`] draws from its seed only.
//! - FAULT-3 (across processes): every process of a job carries out the same plan, each the
//!   entries whose hook runs there — a node those of its own devices, the head those of the
//!   Supervisor —, and a node's firings travel back with its answers
//!   ([`FaultHooks::record`]), so the head publishes every firing once.
//! - FAULT-4: a rehearsed panic prints one line naming the fault, not a panic message and
//!   backtrace; a real panic keeps the hook's output (`injected_panic`).
//!
//! ```
//! use meshwork::faults::{Fault, FaultKind, FaultPlan, Phase};
//! let plan = FaultPlan::new(7).with(Fault {
//!     device: 1,
//!     step: 3,
//!     micro_batch: Some(0),
//!     phase: Phase::Forward,
//!     kind: FaultKind::Panic,
//! });
//! let json = plan.to_json();
//! assert_eq!(FaultPlan::from_json(&json).unwrap(), plan);
//! ```

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::comm::{CollectiveKind, MessageHook, Tamper};
use crate::config::InvalidConfig;
use crate::mesh::{DeviceId, Rank};
use crate::parallel::sampler::SplitMix64;

/// The largest slow-down factor a plan may ask for.
pub const MAX_SLOWDOWN: f64 = 1000.0;
/// The longest stall a plan may ask for, in seconds (a day).
pub const MAX_STALL_S: f64 = 86_400.0;

/// Where on the device thread a fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the forward of a micro-batch.
    Forward,
    /// Before the backward of a micro-batch.
    Backward,
    /// Before the optimizer update, after the step's last collective (micro-batch 0).
    Update,
}

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FaultKind {
    /// Panic on the device thread (the stage loses its state, like a crashed device).
    Panic,
    /// The Supervisor kills the device's actors at the start of the step (a device that
    /// disappears: it answers nothing any more).
    Kill,
    /// The device thread stops making progress for `seconds` while its actor keeps answering
    /// heartbeats (stuck but alive).
    Stall {
        /// How long.
        seconds: f64,
    },
    /// Every forward, backward and optimizer update of the device takes `factor` times as long
    /// from this step on (a slow device).
    Slow {
        /// ≥ 1.
        factor: f64,
    },
    /// The device is cut off from the others for `seconds` when the step's first collective
    /// begins: its messages reach no peer until then (a network partition).
    Partition {
        /// How long.
        seconds: f64,
    },
    /// The `message`-th collective message the device sends in the step is held back for
    /// `seconds` (a slow or congested link).
    DelayMessage {
        /// How long.
        seconds: f64,
        /// Which of the step's messages (0: the first).
        #[serde(default)]
        message: u32,
    },
    /// The `message`-th collective message the device sends in the step is lost.
    DropMessage {
        /// Which of the step's messages (0: the first).
        #[serde(default)]
        message: u32,
    },
    /// The `message`-th collective message the device sends in the step arrives with a bit
    /// flipped. The job verifies payload checksums when its plan holds such a fault.
    CorruptMessage {
        /// Which of the step's messages (0: the first).
        #[serde(default)]
        message: u32,
    },
    /// The checkpoint taken at the step fails half-way through writing (the device is
    /// ignored): the writer has written part of a shard file when the file system fails.
    FailCheckpointWrite,
    /// Devices leave or arrive: the job is asked to resize to `replicas` data-parallel
    /// replicas at the boundary before the step (the device is ignored). The same request
    /// as `JobControl::scale_to`, at a step the plan fixes, so an elastic rehearsal
    /// replays exactly (FAULT-2); admitted or refused as that request is (ELASTIC-1..6).
    Resize {
        /// The replicas asked for.
        replicas: u32,
    },
}

impl FaultKind {
    /// Whether the fault acts on a collective message.
    pub fn is_message_fault(&self) -> bool {
        matches!(
            self,
            FaultKind::DelayMessage { .. }
                | FaultKind::DropMessage { .. }
                | FaultKind::CorruptMessage { .. }
        )
    }
}

/// One fault of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fault {
    /// The device it hits.
    pub device: u32,
    /// The step at which it fires.
    pub step: u64,
    /// The micro-batch (any if `None`).
    #[serde(default)]
    pub micro_batch: Option<u32>,
    /// Where on the device thread a `panic` or `stall` fires: before the forward, the backward
    /// or the update (default: the forward). Other kinds ignore it.
    #[serde(default = "forward")]
    pub phase: Phase,
    /// What happens.
    #[serde(flatten)]
    pub kind: FaultKind,
}

fn forward() -> Phase {
    Phase::Forward
}

/// A seeded list of faults.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FaultPlan {
    /// The seed the plan was drawn from (kept for the record; explicit faults ignore it).
    pub seed: u64,
    /// The faults.
    pub faults: Vec<Fault>,
}

/// A fault that fired.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FiredFault {
    /// Its index in the plan.
    pub index: usize,
    /// The fault.
    pub fault: Fault,
    /// The micro-batch it fired at (`None` for faults fired by the Supervisor).
    pub micro_batch: Option<u32>,
}

impl FaultPlan {
    /// An empty plan with this seed.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            faults: Vec::new(),
        }
    }

    /// The plan with one more entry asking the job to resize to `replicas` at the boundary
    /// before `step` ([`FaultKind::Resize`]; the entry's device is not used).
    pub fn with_resize(self, step: u64, replicas: u32) -> Self {
        self.with(Fault {
            device: 0,
            step,
            micro_batch: None,
            phase: Phase::Forward,
            kind: FaultKind::Resize { replicas },
        })
    }

    /// The plan with one more fault.
    pub fn with(mut self, fault: Fault) -> Self {
        self.faults.push(fault);
        self
    }

    /// `count` faults drawn from `seed`: a kind among `kinds` (uniformly), a device below
    /// `devices`, a step in `steps`, micro-batch 0, forward (FAULT-2: the seed alone decides).
    pub fn random(
        seed: u64,
        count: usize,
        devices: u32,
        steps: std::ops::Range<u64>,
        kinds: &[FaultKind],
    ) -> Self {
        let mut rng = SplitMix64::new(seed);
        let span = steps.end.saturating_sub(steps.start).max(1);
        let faults = (0..count)
            .filter(|_| !kinds.is_empty() && devices > 0)
            .map(|_| Fault {
                device: (rng.next() % u64::from(devices)) as u32,
                step: steps.start + rng.next() % span,
                micro_batch: Some(0),
                phase: Phase::Forward,
                kind: kinds[(rng.next() % kinds.len() as u64) as usize],
            })
            .collect();
        Self { seed, faults }
    }

    /// The plan as JSON (what `meshwork train --faults plan.json` reads).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A plan from JSON, checked: slow factors ≥ 1, stall durations finite and ≥ 0.
    pub fn from_json(text: &str) -> Result<Self, InvalidConfig> {
        let plan: FaultPlan =
            serde_json::from_str(text).map_err(|e| InvalidConfig(format!("fault plan: {e}")))?;
        plan.check()?;
        Ok(plan)
    }

    /// Why this plan cannot run, if it cannot.
    pub fn check(&self) -> Result<(), InvalidConfig> {
        for (i, f) in self.faults.iter().enumerate() {
            match f.kind {
                FaultKind::Slow { factor } if !(1.0..=MAX_SLOWDOWN).contains(&factor) => {
                    return Err(InvalidConfig(format!(
                        "fault plan entry {i}: slow factor {factor} must be between 1 and \
                         {MAX_SLOWDOWN}"
                    )));
                }
                FaultKind::Stall { seconds }
                | FaultKind::Partition { seconds }
                | FaultKind::DelayMessage { seconds, .. }
                    if !(0.0..=MAX_STALL_S).contains(&seconds) =>
                {
                    return Err(InvalidConfig(format!(
                        "fault plan entry {i}: a stall of {seconds} s must be between 0 and \
                         {MAX_STALL_S} s"
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// What the device thread does at a hook.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Action {
    /// Nothing.
    Proceed,
    /// Panic with this plan index.
    Panic(usize),
    /// Sleep this long, then go on.
    Stall(Duration),
}

/// The runtime's view of a plan: which faults fired, and the hooks.
#[derive(Debug, Default)]
pub struct FaultHooks {
    plan: FaultPlan,
    state: Mutex<HookState>,
}

#[derive(Debug, Default)]
struct HookState {
    fired: Vec<bool>,
    log: Vec<FiredFault>,
    /// Per device: the step it is in and the collective messages it sent in it so far.
    messages: std::collections::HashMap<u32, (u64, u32)>,
}

impl FaultHooks {
    /// Hooks for `plan`.
    pub fn new(plan: FaultPlan) -> Arc<Self> {
        let n = plan.faults.len();
        Arc::new(Self {
            plan,
            state: Mutex::new(HookState {
                fired: vec![false; n],
                ..HookState::default()
            }),
        })
    }

    /// The plan.
    pub fn plan(&self) -> &FaultPlan {
        &self.plan
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HookState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Mark entry `i` fired (FAULT-1); false if it had fired already.
    fn fire(&self, i: usize, micro_batch: Option<u32>) -> bool {
        let mut s = self.state();
        if s.fired.get(i).copied().unwrap_or(true) {
            return false;
        }
        s.fired[i] = true;
        let fault = self.plan.faults[i].clone();
        s.log.push(FiredFault {
            index: i,
            fault,
            micro_batch,
        });
        true
    }

    /// Called on `device`'s thread before the forward or backward of `micro_batch` at `step`,
    /// or before its update (`Phase::Update`, micro-batch 0).
    pub fn before(&self, device: DeviceId, step: u64, micro_batch: u32, phase: Phase) -> Action {
        for (i, f) in self.plan.faults.iter().enumerate() {
            let hits = f.device == device.0
                && f.step == step
                && f.phase == phase
                && f.micro_batch.is_none_or(|m| m == micro_batch);
            if !hits {
                continue;
            }
            match f.kind {
                FaultKind::Panic if self.fire(i, Some(micro_batch)) => return Action::Panic(i),
                FaultKind::Stall { seconds } if self.fire(i, Some(micro_batch)) => {
                    return Action::Stall(Duration::from_secs_f64(seconds));
                }
                _ => {}
            }
        }
        Action::Proceed
    }

    /// The slow-down factor of `device` at `step` (1 when none applies); a `Slow` fault is
    /// recorded the first time it applies.
    pub fn slowdown(&self, device: DeviceId, step: u64) -> f64 {
        let mut factor = 1.0f64;
        for (i, f) in self.plan.faults.iter().enumerate() {
            if let FaultKind::Slow { factor: s } = f.kind
                && f.device == device.0
                && step >= f.step
            {
                self.fire(i, None);
                factor = factor.max(s);
            }
        }
        factor
    }

    /// How long `device` is cut off when its first collective of `step` begins, if a
    /// `Partition` fault says so (each entry fires once).
    pub fn partition(&self, device: DeviceId, step: u64) -> Option<Duration> {
        self.plan
            .faults
            .iter()
            .enumerate()
            .find_map(|(i, f)| match f.kind {
                FaultKind::Partition { seconds }
                    if f.device == device.0 && f.step == step && self.fire(i, None) =>
                {
                    Some(Duration::from_secs_f64(seconds))
                }
                _ => None,
            })
    }

    /// Whether the plan holds message faults (the job then hooks its communicators and, for
    /// corrupt messages, verifies payload checksums).
    pub fn has_message_faults(&self) -> bool {
        self.plan.faults.iter().any(|f| f.kind.is_message_fault())
    }

    /// Whether the plan corrupts messages.
    pub fn corrupts_messages(&self) -> bool {
        self.plan
            .faults
            .iter()
            .any(|f| matches!(f.kind, FaultKind::CorruptMessage { .. }))
    }

    /// Called on `device`'s thread when it starts `step`: its message count starts again.
    pub fn begin_step(&self, device: DeviceId, step: u64) {
        self.state().messages.insert(device.0, (step, 0));
    }

    /// The fate of the next collective message `device` sends (counted from its
    /// [`FaultHooks::begin_step`]).
    pub fn next_message(&self, device: DeviceId) -> Tamper {
        let (step, n) = {
            let mut s = self.state();
            let entry = s.messages.entry(device.0).or_insert((u64::MAX, 0));
            let at = *entry;
            entry.1 += 1;
            at
        };
        for (i, f) in self.plan.faults.iter().enumerate() {
            if f.device != device.0 || f.step != step {
                continue;
            }
            let fate = match f.kind {
                FaultKind::DelayMessage { seconds, message } if message == n => {
                    Tamper::Delay(Duration::from_secs_f64(seconds))
                }
                FaultKind::DropMessage { message } if message == n => Tamper::Drop,
                FaultKind::CorruptMessage { message } if message == n => Tamper::Corrupt,
                _ => continue,
            };
            if self.fire(i, None) {
                return fate;
            }
        }
        Tamper::Deliver
    }

    /// Whether the checkpoint of `step` is to fail half-way (each entry fires once).
    pub fn fails_checkpoint(&self, step: u64) -> bool {
        self.plan.faults.iter().enumerate().any(|(i, f)| {
            matches!(f.kind, FaultKind::FailCheckpointWrite) && f.step == step && self.fire(i, None)
        })
    }

    /// The resize the plan asks for at the boundary before `step`, if any (each entry fires
    /// once; of several at one step, the last in the plan).
    pub fn resize_at(&self, step: u64) -> Option<u32> {
        self.plan
            .faults
            .iter()
            .enumerate()
            .filter_map(|(i, f)| match f.kind {
                FaultKind::Resize { replicas } if f.step == step && self.fire(i, None) => {
                    Some(replicas)
                }
                _ => None,
            })
            .last()
    }

    /// The devices the Supervisor kills at the start of `step` (each entry fires once).
    pub fn kills_at(&self, step: u64) -> Vec<DeviceId> {
        self.plan
            .faults
            .iter()
            .enumerate()
            .filter(|(i, f)| {
                matches!(f.kind, FaultKind::Kill) && f.step == step && self.fire(*i, None)
            })
            .map(|(_, f)| DeviceId(f.device))
            .collect()
    }

    /// The faults that fired since the last call, in firing order.
    pub fn take_fired(&self) -> Vec<FiredFault> {
        std::mem::take(&mut self.state().log)
    }

    /// Records entries of this plan that fired elsewhere (a node process carrying out the
    /// same plan, FAULT-3), each as its index and micro-batch, so that they are published with
    /// this process's own; an index this plan does not hold is ignored (the record comes from
    /// the network).
    pub fn record(&self, fired: impl IntoIterator<Item = (usize, Option<u32>)>) {
        let mut s = self.state();
        for (index, micro_batch) in fired {
            // Each entry is published once (FAULT-1), whatever the record repeats.
            if let Some(fault) = self.plan.faults.get(index)
                && !s.fired[index]
            {
                s.fired[index] = true;
                s.log.push(FiredFault {
                    index,
                    fault: fault.clone(),
                    micro_batch,
                });
            }
        }
    }
}

/// [`FaultHooks`] seen from one device's communicator: its collective messages go through
/// the plan's message faults (COMM-8's hook).
#[derive(Debug)]
pub struct DeviceMessages {
    hooks: Arc<FaultHooks>,
    device: DeviceId,
}

impl DeviceMessages {
    /// The hook for `device`'s communicators.
    pub fn new(hooks: Arc<FaultHooks>, device: DeviceId) -> Arc<Self> {
        Arc::new(Self { hooks, device })
    }
}

impl MessageHook for DeviceMessages {
    fn on_send(&self, _: Rank, _: Rank, _: u64, _: CollectiveKind, _: u32) -> Tamper {
        self.hooks.next_message(self.device)
    }
}

/// Run `f` (a forward, a backward or the update) under the plan's hooks for this position:
/// panic or stall before it, stretch it afterwards on a slow device.
pub fn with_hooks<R>(
    hooks: Option<&FaultHooks>,
    device: DeviceId,
    step: u64,
    micro_batch: u32,
    phase: Phase,
    f: impl FnOnce() -> R,
) -> R {
    let Some(h) = hooks else { return f() };
    match h.before(device, step, micro_batch, phase) {
        Action::Panic(i) => injected_panic(format!(
            "injected fault {i}: panic on device {device} at step {step}, micro-batch \
             {micro_batch}, before the {phase:?}"
        )),
        Action::Stall(d) => std::thread::sleep(d),
        Action::Proceed => {}
    }
    let factor = h.slowdown(device, step);
    let t = std::time::Instant::now();
    let r = f();
    if factor > 1.0 {
        std::thread::sleep(t.elapsed().mul_f64(factor - 1.0));
    }
    r
}

/// FAULT-4: a rehearsed panic unwinds the device thread as a real one does (the runtime
/// catches it and reports the stage's failure with this text), but prints one line naming
/// the fault instead of the panic hook's message and backtrace: `resume_unwind` does not call
/// the hook.
fn injected_panic(what: String) -> ! {
    eprintln!("meshwork: {what} (rehearsed by the fault plan)");
    std::panic::resume_unwind(Box::new(what))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn fault(device: u32, step: u64, kind: FaultKind) -> Fault {
        Fault {
            device,
            step,
            micro_batch: None,
            phase: Phase::Forward,
            kind,
        }
    }

    #[test]
    fn fault_1_each_entry_fires_once_and_is_logged() {
        let h = FaultHooks::new(
            FaultPlan::new(0)
                .with(fault(1, 2, FaultKind::Panic))
                .with(fault(0, 2, FaultKind::Kill)),
        );
        assert_eq!(h.before(DeviceId(0), 2, 0, Phase::Forward), Action::Proceed);
        assert_eq!(h.before(DeviceId(1), 1, 0, Phase::Forward), Action::Proceed);
        assert_eq!(
            h.before(DeviceId(1), 2, 3, Phase::Forward),
            Action::Panic(0)
        );
        assert_eq!(h.before(DeviceId(1), 2, 3, Phase::Forward), Action::Proceed);
        assert_eq!(h.kills_at(2), vec![DeviceId(0)]);
        assert!(h.kills_at(2).is_empty());
        let fired: Vec<usize> = h.take_fired().iter().map(|f| f.index).collect();
        assert_eq!(fired, vec![0, 1]);
        assert!(h.take_fired().is_empty());
    }

    #[test]
    fn fault_3_firings_recorded_from_another_process_are_published_by_index() {
        let plan = FaultPlan::new(0)
            .with(fault(1, 2, FaultKind::Panic))
            .with(fault(0, 3, FaultKind::Slow { factor: 2.0 }));
        let (head, node) = (FaultHooks::new(plan.clone()), FaultHooks::new(plan));
        assert_eq!(
            node.before(DeviceId(1), 2, 1, Phase::Forward),
            Action::Panic(0)
        );
        let fired: Vec<(usize, Option<u32>)> = node
            .take_fired()
            .into_iter()
            .map(|f| (f.index, f.micro_batch))
            .collect();
        // An index the plan does not hold (bytes from the network) is ignored.
        head.record(
            fired
                .iter()
                .copied()
                .chain([(7, None)])
                .chain(fired.clone()),
        );
        let published = head.take_fired();
        assert_eq!(published.len(), 1);
        assert_eq!(published[0].index, 0);
        assert_eq!(published[0].micro_batch, Some(1));
        assert_eq!(published[0].fault, fault(1, 2, FaultKind::Panic));
    }

    #[test]
    fn plans_with_impossible_numbers_are_refused() {
        let slow = FaultPlan::new(0).with(fault(0, 0, FaultKind::Slow { factor: 0.5 }));
        assert!(FaultPlan::from_json(&slow.to_json()).is_err());
        let stall = FaultPlan::new(0).with(fault(0, 0, FaultKind::Stall { seconds: -1.0 }));
        assert!(FaultPlan::from_json(&stall.to_json()).is_err());
        assert!(FaultPlan::from_json("{ not json").is_err());
    }

    proptest! {
        #[test]
        fn fault_2_random_plans_depend_on_the_seed_only_and_round_trip(
            seed in any::<u64>(),
            count in 0usize..8,
        ) {
            let kinds = [FaultKind::Panic, FaultKind::Kill, FaultKind::Slow { factor: 2.0 }];
            let a = FaultPlan::random(seed, count, 4, 1..20, &kinds);
            let b = FaultPlan::random(seed, count, 4, 1..20, &kinds);
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(a.faults.len(), count);
            prop_assert!(a.faults.iter().all(|f| f.device < 4 && (1..20).contains(&f.step)));
            prop_assert_eq!(FaultPlan::from_json(&a.to_json()).unwrap(), a);
        }
    }
}
