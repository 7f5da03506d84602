use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const PARAMS: usize = 3;

fn sgd() -> FlatRule {
    FlatRule::Sgd {
        weight_decay: None,
        momentum: None,
    }
}

/// A round driven by a random schedule: which computing worker pushes next, and when one is
/// lost.
struct Sim {
    core: ServerCore,
    computing: BTreeMap<WorkerId, (ItemId, u64, Vec<Vec<usize>>)>,
    done: Option<BTreeMap<WorkerId, WorkerRound>>,
    /// Every (worker, clock) the server let start, with the gate's minimum after it.
    starts: Vec<(u64, Option<u64>)>,
}

impl Sim {
    fn new(mode: Mode, workers: u32) -> Self {
        Self {
            core: ServerCore::new(mode, sgd(), 0.1, workers, vec![0.0; PARAMS]),
            computing: BTreeMap::new(),
            done: None,
            starts: Vec::new(),
        }
    }

    fn progress(&mut self) {
        for a in self.core.progress() {
            match a {
                Answer::Work {
                    worker,
                    item,
                    micro_batches,
                    clock,
                    ..
                } => {
                    self.computing.insert(worker, (item, clock, micro_batches));
                    self.starts.push((clock, self.core.working_min()));
                }
                Answer::RoundOver { .. } => {}
                Answer::RoundDone { reports, .. } => self.done = Some(reports),
            }
        }
    }

    /// Begin a round of `step` where worker `w` owns samples `w·per..(w+1)·per` in `k`
    /// micro-batches, then every worker pulls.
    fn begin(&mut self, step: u64, per: usize, k: usize) {
        let live = self.core.live();
        let global = live.len() * per;
        for &w in &live {
            let share: Vec<usize> = (w as usize * per..(w as usize + 1) * per).collect();
            let mbs = share
                .chunks(per.div_ceil(k))
                .map(<[usize]>::to_vec)
                .collect();
            self.core.begin(w, step, mbs, global);
        }
        for &w in &live {
            self.core.pull(w);
        }
        self.progress();
    }

    /// The gradient of an item: its samples' ids, summed, in every element.
    fn grad(mbs: &[Vec<usize>]) -> Vec<f32> {
        let s: usize = mbs.iter().flatten().sum();
        vec![s as f32 / 100.0; PARAMS]
    }

    /// Push the gradient of the `pick`-th computing worker, which then pulls again.
    fn push(&mut self, step: u64, pick: usize) -> bool {
        let n = self.computing.len();
        if n == 0 {
            return false;
        }
        let w = *self.computing.keys().nth(pick % n).expect("in range");
        let (item, _, mbs) = self.computing.remove(&w).expect("present");
        self.core.push(w, step, item, Self::grad(&mbs), 1.0);
        self.core.pull(w);
        self.progress();
        true
    }

    /// Lose the `pick`-th live worker, unless it is the last one (then nothing happens).
    fn lose(&mut self, pick: usize) -> bool {
        let live = self.core.live();
        if live.len() < 2 {
            return false;
        }
        let w = live[pick % live.len()];
        self.computing.remove(&w);
        self.core.leave(w);
        self.progress();
        true
    }
}

/// Run one round of a random schedule; the reports when it ends.
fn run_round(
    sim: &mut Sim,
    step: u64,
    (per, k): (usize, usize),
    picks: &[(usize, bool)],
) -> Option<BTreeMap<WorkerId, WorkerRound>> {
    sim.done = None;
    sim.begin(step, per, k);
    let mut picks = picks.iter().cycle();
    for _ in 0..10_000 {
        if sim.done.is_some() {
            break;
        }
        let &(pick, lose) = picks.next().expect("cycles");
        if lose && sim.lose(pick) {
            continue;
        }
        if !sim.push(step, pick) {
            break;
        }
    }
    sim.done.take()
}

/// Every sample of the round is in exactly one report, applied or dropped (PS-4).
fn assert_settled(reports: &BTreeMap<WorkerId, WorkerRound>, expected: usize) {
    let mut seen: Vec<usize> = reports
        .values()
        .flat_map(|r| r.sample_ids.iter().chain(&r.step.dropped).copied())
        .collect();
    seen.sort_unstable();
    let before = seen.len();
    seen.dedup();
    assert_eq!(seen.len(), before, "a sample applied or dropped twice");
    assert!(seen.len() <= expected);
}

proptest! {
    /// PS-1: whatever order gradients arrive in, no worker starts more than `s` clocks ahead
    /// of the slowest working one, every recorded staleness is at most `s`, and every item is
    /// applied once (PS-4).
    #[test]
    fn ps_1_gate_bounds_staleness(
        s in 0u64..4, workers in 2u32..6, k in 1usize..5,
        picks in prop::collection::vec((0usize..64, prop::bool::weighted(0.03)), 1..64),
        steps in 1u64..3,
    ) {
        let mode = Mode::Ssp(Some(s));
        let mut sim = Sim::new(mode, workers);
        for step in 0..steps {
            let live = sim.core.live().len();
            let reports = run_round(&mut sim, step, (4, k), &picks);
            let reports = reports.expect("the round ends");
            for (clock, min) in &sim.starts {
                prop_assert!(min.is_none_or(|m| *clock <= m + s), "started at {clock}, min {min:?}");
            }
            let mut ids: Vec<usize> = Vec::new();
            for r in reports.values() {
                for a in &r.step.applied {
                    prop_assert!(a.staleness <= s, "staleness {} > {s}", a.staleness);
                }
                prop_assert!(r.step.dropped.is_empty(), "nothing is dropped without backups");
                ids.extend(&r.sample_ids);
            }
            assert_settled(&reports, live * 4);
            // Without losses every sample's gradient is applied.
            if sim.core.live().len() == live {
                prop_assert_eq!(ids.len(), live * 4);
            }
        }
    }

    /// PS-2: at s = 0 a round with no loss applies exactly one aggregate, of one gradient per
    /// worker, equal to one SGD step on the sum of the gradients in worker order.
    #[test]
    fn ps_2_synchronous_aggregates_one_gradient_per_worker(
        workers in 1u32..6,
        picks in prop::collection::vec(0usize..64, 1..16),
    ) {
        let mut sim = Sim::new(Mode::Ssp(Some(0)), workers);
        let picks: Vec<(usize, bool)> = picks.into_iter().map(|p| (p, false)).collect();
        let reports = run_round(&mut sim, 0, (4, 2), &picks).expect("the round ends");
        let all: Vec<WorkerId> = (0..workers).collect();
        prop_assert_eq!(sim.core.last_aggregate(), &all[..]);
        let mut expected = vec![0.0f32; PARAMS];
        for w in 0..workers as usize {
            let share: Vec<Vec<usize>> = vec![(w * 4..w * 4 + 4).collect()];
            for (e, g) in expected.iter_mut().zip(Sim::grad(&share)) {
                *e += g;
            }
        }
        let (params, _) = sim.core.state();
        for (p, e) in params.iter().zip(&expected) {
            prop_assert_eq!(p.to_bits(), (0.0 - e * 0.1f32).to_bits());
        }
        for r in reports.values() {
            prop_assert_eq!(r.step.applied.len(), 1);
            prop_assert_eq!(r.step.applied[0].staleness, 0);
        }
    }

    /// PS-3: with b backup workers a version is applied from the first N − b gradients; the
    /// rest of the round is dropped and reported, and every sample is applied or dropped.
    #[test]
    fn ps_3_backup_workers_use_the_first_n_minus_b(
        (workers, b) in (2u32..6).prop_flat_map(|w| (Just(w), 1..w)),
        picks in prop::collection::vec(0usize..64, 1..16),
    ) {
        let mut sim = Sim::new(Mode::Backup(b), workers);
        let picks: Vec<(usize, bool)> = picks.into_iter().map(|p| (p, false)).collect();
        let reports = run_round(&mut sim, 0, (4, 1), &picks).expect("the round ends");
        prop_assert_eq!(sim.core.last_aggregate().len(), (workers - b) as usize);
        let applied: usize = reports.values().map(|r| r.step.applied.len()).sum();
        let dropped: usize = reports.values().map(|r| r.step.dropped.len()).sum();
        prop_assert_eq!(applied, (workers - b) as usize);
        prop_assert_eq!(dropped, 4 * b as usize);
        assert_settled(&reports, 4 * workers as usize);
    }
}

#[test]
fn staleness_parses_and_prints() {
    for (text, s) in [
        ("ssp:0", Staleness::Bounded(0)),
        ("ssp:2", Staleness::Bounded(2)),
        ("sync", Staleness::Bounded(0)),
        ("async", Staleness::Unbounded),
    ] {
        assert_eq!(text.parse::<Staleness>(), Ok(s));
    }
    assert_eq!(Staleness::Bounded(2).to_string(), "ssp:2");
    assert_eq!(Staleness::Unbounded.to_string(), "async");
    assert!(matches!(
        "ssp:x".parse::<ParameterServer>(),
        Err(ParameterServerError::BadStaleness { .. })
    ));
}

#[test]
fn async_lets_a_fast_worker_take_more_items() {
    // Worker 1 never pushes until worker 0 has taken everything it can.
    let mut sim = Sim::new(Mode::Ssp(None), 2);
    sim.begin(0, 4, 4);
    for _ in 0..6 {
        sim.push(0, 0);
    }
    while sim.push(0, 1) {}
    let reports = sim.done.take().expect("the round ends");
    assert!(reports[&0].step.applied.len() > reports[&1].step.applied.len());
    assert_eq!(
        reports.values().map(|r| r.sample_ids.len()).sum::<usize>(),
        8
    );
}

#[test]
fn a_round_counts_the_bytes_each_worker_moved() {
    let mut sim = Sim::new(Mode::Ssp(Some(0)), 2);
    let reports = run_round(&mut sim, 0, (4, 1), &[(0, false), (1, false)]).expect("ends");
    for r in reports.values() {
        assert_eq!(
            r.step.bytes_pulled,
            4 * PARAMS as u64,
            "one pull of the parameters"
        );
        assert_eq!(
            r.step.bytes_pushed,
            4 * PARAMS as u64,
            "one gradient pushed"
        );
    }
}
