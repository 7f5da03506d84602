//! [`ServerCore`]: the parameter server's pure state machine — items handed out and their
//! state, pending gradients, each worker's round, and the answers to pushes and pulls under
//! the chosen staleness bound (PS-1..).

use super::*;

/// A worker, by its replica index at spawn (stable for the whole job).
pub(crate) type WorkerId = u32;

/// An item's index in its round.
pub(crate) type ItemId = usize;

/// What happens to a work item.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum ItemState {
    Queued,
    Taken { by: WorkerId },
    Applied,
    Dropped,
}

#[derive(Debug, Clone)]
pub(super) struct Item {
    pub(super) owner: WorkerId,
    pub(super) micro_batches: Vec<Vec<usize>>,
    pub(super) state: ItemState,
}

impl Item {
    fn samples(&self) -> impl Iterator<Item = usize> + '_ {
        self.micro_batches.iter().flatten().copied()
    }
}

/// A gradient waiting for its version's aggregation (s = 0, backup).
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) item: ItemId,
    pub(super) grads: Vec<f32>,
    pub(super) samples: usize,
    pub(super) pulled: (u64, u64),
}

/// A worker's bookkeeping.
#[derive(Debug, Default)]
pub(super) struct Worker {
    pub(super) clock: u64,
    /// Found no item to take: out of the gate's minimum until an item is queued again.
    pub(super) idle: bool,
    /// The item it computes, with the version and update count it pulled at.
    pub(super) taken: Option<(ItemId, u64, u64)>,
    pub(super) report: WorkerRound,
}

/// What a worker did in a round.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct WorkerRound {
    /// Samples of its applied gradients, in the order applied.
    pub(crate) sample_ids: Vec<usize>,
    /// Σ loss · samples over every item it computed, and those samples.
    pub(crate) loss: (f64, usize),
    pub(crate) step: ParameterServerStep,
}

/// The round running now.
#[derive(Debug)]
pub(super) struct Round {
    pub(super) step: u64,
    pub(super) global: usize,
    pub(super) items: Vec<Item>,
    pub(super) queues: BTreeMap<WorkerId, VecDeque<ItemId>>,
    pub(super) begun: BTreeSet<WorkerId>,
    pub(super) pending: BTreeMap<WorkerId, Pending>,
    pub(super) done: bool,
}

/// An answer the server owes.
#[derive(Debug)]
pub(crate) enum Answer {
    /// `worker` computes `item` at `clock` on `params` (the server's parameters at `version`).
    Work {
        worker: WorkerId,
        item: ItemId,
        micro_batches: Vec<Vec<usize>>,
        clock: u64,
        params: Arc<Vec<f32>>,
    },
    /// `worker`'s round is over: it stops pulling.
    RoundOver { worker: WorkerId },
    /// The round ended: each live worker's part.
    RoundDone {
        reports: BTreeMap<WorkerId, WorkerRound>,
    },
}

/// The parameter server's state: parameters, optimizer, workers, the running round.
#[derive(Debug)]
pub(crate) struct ServerCore {
    pub(super) mode: Mode,
    pub(super) rule: FlatRule,
    pub(super) lr: f64,
    pub(super) params: Arc<Vec<f32>>,
    pub(super) optimizer: FlatState,
    /// Optimizer updates applied since the job started.
    pub(super) updates: u64,
    /// The smallest clock of the workers still working (see the module doc).
    pub(super) version: u64,
    pub(super) workers: BTreeMap<WorkerId, Worker>,
    pub(super) round: Option<Round>,
    /// Pulls not answered yet.
    pub(super) parked: BTreeSet<WorkerId>,
    /// The workers whose gradients the last aggregation summed (PS-2's check).
    pub(super) last_aggregate: Vec<WorkerId>,
}

impl ServerCore {
    /// A server for `workers` workers (ids `0..workers`) over `params`.
    pub(crate) fn new(mode: Mode, rule: FlatRule, lr: f64, workers: u32, params: Vec<f32>) -> Self {
        Self {
            mode,
            rule,
            lr,
            params: Arc::new(params),
            optimizer: FlatState::default(),
            updates: 0,
            version: 0,
            workers: (0..workers).map(|w| (w, Worker::default())).collect(),
            round: None,
            parked: BTreeSet::new(),
            last_aggregate: Vec::new(),
        }
    }

    /// The parameters and the optimizer state (a checkpoint of the job).
    pub(crate) fn state(&self) -> (Arc<Vec<f32>>, FlatState) {
        (self.params.clone(), self.optimizer.clone())
    }

    /// The optimizer rule.
    pub(crate) fn rule(&self) -> FlatRule {
        self.rule
    }

    /// Take a checkpoint's parameters and optimizer state.
    pub(crate) fn restore(&mut self, params: Vec<f32>, optimizer: FlatState) {
        self.params = Arc::new(params);
        self.optimizer = optimizer;
    }

    /// The workers still in the job.
    #[cfg(test)]
    pub(crate) fn live(&self) -> Vec<WorkerId> {
        self.workers.keys().copied().collect()
    }

    /// The smallest clock of the live workers still working in the round (PS-1's `v`).
    pub(crate) fn working_min(&self) -> Option<u64> {
        self.workers
            .values()
            .filter(|w| !w.idle)
            .map(|w| w.clock)
            .min()
    }

    /// The workers whose gradients the last aggregation summed.
    #[cfg(test)]
    pub(crate) fn last_aggregate(&self) -> &[WorkerId] {
        &self.last_aggregate
    }

    /// `worker` starts `step` with its share: `micro_batches` (sample ids), `global` samples
    /// in the whole step.
    pub(crate) fn begin(
        &mut self,
        worker: WorkerId,
        step: u64,
        micro_batches: Vec<Vec<usize>>,
        global: usize,
    ) {
        if !self.workers.contains_key(&worker) {
            return;
        }
        let fresh = match &self.round {
            None => true,
            Some(r) => r.step != step || (r.done && r.begun.contains(&worker)),
        };
        if fresh {
            // The round before ended with every item applied or dropped: every clock is the
            // version reached so far.
            let top = self.workers.values().map(|w| w.clock).max().unwrap_or(0);
            self.version = self.version.max(top);
            for w in self.workers.values_mut() {
                *w = Worker {
                    clock: self.version,
                    ..Worker::default()
                };
            }
            self.round = Some(Round {
                step,
                global,
                items: Vec::new(),
                queues: BTreeMap::new(),
                begun: BTreeSet::new(),
                pending: BTreeMap::new(),
                done: false,
            });
        }
        let whole = self.mode.whole_shares();
        let round = self.round.as_mut().expect("set above");
        round.begun.insert(worker);
        let parts: Vec<Vec<Vec<usize>>> = if whole {
            vec![micro_batches]
        } else {
            micro_batches.into_iter().map(|m| vec![m]).collect()
        };
        for mb in parts
            .into_iter()
            .filter(|p| p.iter().any(|m| !m.is_empty()))
        {
            let id = round.items.len();
            round.items.push(Item {
                owner: worker,
                micro_batches: mb,
                state: ItemState::Queued,
            });
            round.queues.entry(worker).or_default().push_back(id);
        }
        for w in self.workers.values_mut() {
            w.idle = false;
        }
    }

    /// `worker` asks for work in `step`; answered by [`ServerCore::progress`].
    pub(crate) fn pull(&mut self, worker: WorkerId) {
        if self.workers.contains_key(&worker) {
            self.parked.insert(worker);
        }
    }

    /// `worker` pushes the gradient of `item` of `step` (weighted by the item's share of the
    /// step's samples) and its loss summed over the item's samples. A push of another step,
    /// of an item dropped meanwhile, or of another length than the parameters is discarded.
    pub(crate) fn push(
        &mut self,
        worker: WorkerId,
        step: u64,
        item: ItemId,
        grads: Vec<f32>,
        loss_sum: f64,
    ) {
        let Some(round) = self.round.as_mut().filter(|r| r.step == step && !r.done) else {
            return;
        };
        if grads.len() != self.params.len() {
            // Not a gradient of these parameters: the item stays with the worker, whose
            // round then ends by its time-out naming what is missing.
            return;
        }
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let Some((taken, clock_version, updates)) = w.taken.filter(|t| t.0 == item) else {
            return;
        };
        w.taken = None;
        let Some(it) = round.items.get_mut(taken) else {
            return;
        };
        if it.state != (ItemState::Taken { by: worker }) {
            return;
        }
        let samples = it.samples().count();
        w.report.step.bytes_pushed += 4 * grads.len() as u64;
        w.report.loss.0 += loss_sum;
        w.report.loss.1 += samples;
        w.clock += 1;
        if self.mode.aggregates() {
            round.pending.insert(
                worker,
                Pending {
                    item,
                    grads,
                    samples,
                    pulled: (clock_version, updates),
                },
            );
        } else {
            // Applied at once (s > 0, async): staleness against the version before this
            // gradient's own clock moves it.
            it.state = ItemState::Applied;
            let ids: Vec<usize> = it.samples().collect();
            let staleness = (w.clock - 1).saturating_sub(clock_version);
            w.report.step.applied.push(AppliedGradient {
                staleness,
                updates_between: self.updates - updates,
                samples: samples as u32,
            });
            w.report.sample_ids.extend(ids);
            let lr = self.lr;
            let n = self.params.len();
            self.rule.step(
                &mut self.optimizer,
                Arc::make_mut(&mut self.params).as_mut_slice(),
                &grads,
                &[(0..n, lr)],
            );
            self.updates += 1;
        }
    }

    /// `worker` is lost: it leaves the gate and the aggregations; its item in progress is
    /// queued again (PS-4).
    pub(crate) fn leave(&mut self, worker: WorkerId) {
        let Some(w) = self.workers.remove(&worker) else {
            return;
        };
        self.parked.remove(&worker);
        if let (Some(round), Some((item, _, _))) = (self.round.as_mut(), w.taken)
            && let Some(it) = round.items.get_mut(item)
        {
            it.state = ItemState::Queued;
            round.queues.entry(it.owner).or_default().push_front(item);
            for w in self.workers.values_mut() {
                w.idle = false;
            }
        }
    }

    /// Everything that can move now: aggregations, parked pulls, the end of the round.
    pub(crate) fn progress(&mut self) -> Vec<Answer> {
        let mut out = Vec::new();
        loop {
            let mut moved = self.aggregate();
            moved |= self.serve(&mut out);
            if !moved {
                break;
            }
        }
        self.finish(&mut out);
        out
    }

    /// s = 0 and backup: apply the pending version if it is complete (PS-2, PS-3).
    fn aggregate(&mut self) -> bool {
        let Some(round) = self.round.as_mut().filter(|r| !r.done) else {
            return false;
        };
        if round.pending.is_empty() {
            return false;
        }
        let working: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.idle)
            .map(|(id, _)| *id)
            .collect();
        let all_in = working.iter().all(|w| round.pending.contains_key(w));
        let ready = match self.mode {
            Mode::Backup(b) => {
                let need = (self.workers.len() as u32).saturating_sub(b).max(1) as usize;
                round.pending.len() >= need || all_in
            }
            _ => all_in,
        };
        if !ready {
            return false;
        }
        let pending = std::mem::take(&mut round.pending);
        let received: usize = pending.values().map(|p| p.samples).sum();
        let n = self.params.len();
        let mut sum = vec![0.0f32; n];
        for p in pending.values() {
            for (s, g) in sum.iter_mut().zip(&p.grads) {
                *s += g;
            }
        }
        if matches!(self.mode, Mode::Backup(_)) && received > 0 && received != round.global {
            // PS-3: the mean over the samples received.
            let k = round.global as f32 / received as f32;
            sum.iter_mut().for_each(|s| *s *= k);
        }
        self.last_aggregate = pending.keys().copied().collect();
        for (worker, p) in &pending {
            let it = &mut round.items[p.item];
            it.state = ItemState::Applied;
            if let Some(w) = self.workers.get_mut(worker) {
                w.report.step.applied.push(AppliedGradient {
                    staleness: self.version.saturating_sub(p.pulled.0),
                    updates_between: self.updates - p.pulled.1,
                    samples: p.samples as u32,
                });
                w.report.sample_ids.extend(it.samples());
            }
        }
        let lr = self.lr;
        self.rule.step(
            &mut self.optimizer,
            Arc::make_mut(&mut self.params).as_mut_slice(),
            &sum,
            &[(0..n, lr)],
        );
        self.updates += 1;
        self.version += 1;
        if matches!(self.mode, Mode::Backup(_)) {
            // PS-3: the rest of the round is dropped; every worker moves to the new version.
            for (id, it) in round.items.iter_mut().enumerate() {
                let holder = match it.state {
                    ItemState::Queued => it.owner,
                    ItemState::Taken { by } => by,
                    _ => continue,
                };
                it.state = ItemState::Dropped;
                if let Some(w) = self.workers.get_mut(&holder) {
                    w.report.step.dropped.extend(it.samples());
                    if w.taken.is_some_and(|t| t.0 == id) {
                        w.taken = None;
                    }
                }
            }
            round.queues.clear();
            for w in self.workers.values_mut() {
                w.clock = w.clock.max(self.version);
            }
        }
        true
    }

    /// Whether `worker` may start a gradient now (PS-1; backup: once its last version was
    /// applied).
    pub(crate) fn may_start(&self, worker: WorkerId) -> bool {
        let Some(w) = self.workers.get(&worker) else {
            return false;
        };
        match self.mode {
            Mode::Ssp(None) => true,
            Mode::Ssp(Some(s)) => self.working_min().is_none_or(|min| w.clock <= min + s),
            Mode::Backup(_) => w.clock <= self.version,
        }
    }

    /// Answer the parked pulls that can be answered: work where there is an item and the gate
    /// lets the worker start; idle where there is none.
    fn serve(&mut self, out: &mut Vec<Answer>) -> bool {
        if self.round.as_ref().is_none_or(|r| r.done) {
            return false;
        }
        self.advance_version();
        let mut moved = false;
        let parked: Vec<WorkerId> = self.parked.iter().copied().collect();
        for worker in parked {
            let next = self.next_item(worker);
            let Some(w) = self.workers.get_mut(&worker) else {
                continue;
            };
            if w.taken.is_some() {
                continue;
            }
            let Some(item) = next else {
                if !w.idle {
                    w.idle = true;
                    moved = true;
                }
                continue;
            };
            w.idle = false;
            if !self.may_start(worker) {
                continue;
            }
            let round = self.round.as_mut().expect("checked above");
            for q in round.queues.values_mut() {
                q.retain(|i| *i != item);
            }
            let it = &mut round.items[item];
            it.state = ItemState::Taken { by: worker };
            let w = self.workers.get_mut(&worker).expect("checked above");
            w.taken = Some((item, self.version, self.updates));
            w.report.step.bytes_pulled += 4 * self.params.len() as u64;
            self.parked.remove(&worker);
            out.push(Answer::Work {
                worker,
                item,
                micro_batches: it.micro_batches.clone(),
                clock: w.clock,
                params: self.params.clone(),
            });
            moved = true;
        }
        self.advance_version();
        moved
    }

    /// s > 0 and async: the version is the smallest clock of the workers still working.
    fn advance_version(&mut self) {
        if !self.mode.aggregates()
            && let Some(min) = self.working_min()
        {
            self.version = self.version.max(min);
        }
    }

    /// The item `worker` takes next: its own queue's first, else the first of the longest
    /// queue (ties: the lowest worker id).
    fn next_item(&self, worker: WorkerId) -> Option<ItemId> {
        let round = self.round.as_ref()?;
        if let Some(i) = round.queues.get(&worker).and_then(|q| q.front()) {
            return Some(*i);
        }
        round
            .queues
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .max_by_key(|(w, q)| (q.len(), std::cmp::Reverse(**w)))
            .and_then(|(_, q)| q.front().copied())
    }

    /// The round ends once every live worker began it and every item was applied or dropped.
    fn finish(&mut self, out: &mut Vec<Answer>) {
        let Some(round) = self.round.as_mut() else {
            return;
        };
        if round.done {
            for w in std::mem::take(&mut self.parked) {
                out.push(Answer::RoundOver { worker: w });
            }
            return;
        }
        let all_begun = self.workers.keys().all(|w| round.begun.contains(w));
        let settled = round
            .items
            .iter()
            .all(|i| matches!(i.state, ItemState::Applied | ItemState::Dropped));
        if !(all_begun && settled) {
            return;
        }
        round.done = true;
        let (version, updates) = (self.version, self.updates);
        let reports = self
            .workers
            .iter_mut()
            .map(|(id, w)| {
                let mut r = std::mem::take(&mut w.report);
                r.step.version = version;
                r.step.updates = updates;
                (*id, r)
            })
            .collect();
        for w in std::mem::take(&mut self.parked) {
            out.push(Answer::RoundOver { worker: w });
        }
        out.push(Answer::RoundDone { reports });
    }

    /// Whether a pull of `step` comes after its round ended (answered `RoundOver` at once).
    pub(crate) fn is_over(&self, step: u64) -> bool {
        self.round
            .as_ref()
            .is_some_and(|r| r.step > step || (r.step == step && r.done))
    }
}
