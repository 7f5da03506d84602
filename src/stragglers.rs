//! Straggler detection: naming a persistently slow rank, with its measured slowdown, long
//! before a time-out would fire (pure; the Supervisor feeds it every step's compute times and
//! publishes `JobEvent::Straggler` / `JobEvent::StragglerRecovered`).
//!
//! A rank's *slowdown* is the median of its compute times (forward and backward, from its
//! trace) over the last `window` steps, divided by the median of the other ranks' medians.
//! Medians make one slow step (a page fault, a noisy neighbour) harmless; the window makes a
//! slow-down that persists show.
//!
//! Invariants:
//! - STRAG-1 (persistent only): a rank is named only once `window` steps of it are known,
//!   its slowdown is at least `threshold` and its median exceeds the others' by at least
//!   `min_excess_s` (milliseconds of scheduling noise on tiny steps are no straggler); it is
//!   named once, and again only after it was reported recovered (slowdown back below
//!   halfway between 1 and `threshold`: hysteresis, so a rank near the line does not flap).
//! - STRAG-2 (relative): with `min_excess_s` 0, scaling every rank's times by the same factor
//!   changes nothing; ranks that are all equally slow are no stragglers.
//! - STRAG-3 (membership): a rank absent from a step (lost, dropped) keeps its history but is
//!   not compared in that step; ranks are identified by their index in the job's current
//!   layout, and [`StragglerDetector::reset`] forgets everything when the layout changes.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

/// When a rank counts as a straggler.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StragglerDetection {
    /// Steps of history per rank (≥ 1).
    pub window: usize,
    /// The slowdown (≥ 1) at which a rank is named.
    pub threshold: f64,
    /// How many seconds its median must exceed the other ranks' median by, too.
    pub min_excess_s: f64,
}

impl Default for StragglerDetection {
    /// A rank whose median compute time over 5 steps is 1.5 × the other ranks' median and at
    /// least 5 ms more.
    fn default() -> Self {
        Self {
            window: 5,
            threshold: 1.5,
            min_excess_s: 0.005,
        }
    }
}

/// A change the detector reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum StragglerChange {
    /// The rank became a straggler.
    Slow {
        /// Its index (the rank).
        rank: u32,
        /// Its median compute time over the window divided by the other ranks' median.
        slowdown: f64,
        /// Its median compute time over the window, in seconds.
        median_s: f64,
        /// The other ranks' median, in seconds.
        typical_s: f64,
    },
    /// A rank named before is no longer slow.
    Recovered {
        /// Its index (the rank).
        rank: u32,
        /// Its slowdown now.
        slowdown: f64,
    },
}

/// The detector's state: the last `window` compute times of each rank.
#[derive(Debug, Clone, Default)]
pub struct StragglerDetector {
    config: StragglerDetection,
    history: BTreeMap<u32, VecDeque<f64>>,
    named: BTreeMap<u32, bool>,
}

fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    Some(if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    })
}

impl StragglerDetector {
    /// A detector with `config` (a window of 0 counts as 1, a threshold below 1 as 1).
    pub fn new(config: StragglerDetection) -> Self {
        Self {
            config: StragglerDetection {
                window: config.window.max(1),
                threshold: if config.threshold.is_finite() {
                    config.threshold.max(1.0)
                } else {
                    f64::INFINITY
                },
                min_excess_s: if config.min_excess_s.is_finite() {
                    config.min_excess_s.max(0.0)
                } else {
                    f64::INFINITY
                },
            },
            ..Self::default()
        }
    }

    /// Forget every rank (the layout changed, STRAG-3).
    pub fn reset(&mut self) {
        self.history.clear();
        self.named.clear();
    }

    /// The slowdown of each rank with a full window among `present`, by rank.
    pub fn slowdowns(&self, present: &[u32]) -> BTreeMap<u32, (f64, f64, f64)> {
        let full: Vec<(u32, f64)> = present
            .iter()
            .filter_map(|r| {
                let h = self.history.get(r)?;
                (h.len() >= self.config.window)
                    .then(|| median(&mut h.iter().copied().collect::<Vec<_>>()))
                    .flatten()
                    .map(|m| (*r, m))
            })
            .collect();
        if full.len() < 2 {
            return BTreeMap::new();
        }
        // Each rank against the median of the others: with two ranks, a rank twice as slow
        // as its peer has slowdown 2 (against a median that held itself, it would be 1.33).
        full.iter()
            .map(|&(r, m)| {
                let mut others: Vec<f64> = full
                    .iter()
                    .filter(|(o, _)| *o != r)
                    .map(|(_, m)| *m)
                    .collect();
                let typical = median(&mut others).unwrap_or(m);
                let slowdown = if typical > 0.0 { m / typical } else { 1.0 };
                (r, (slowdown, m, typical))
            })
            .collect()
    }

    /// One step's compute time of each rank that took part (rank, seconds); returns what
    /// changed (STRAG-1..3).
    pub fn observe(&mut self, times: &[(u32, f64)]) -> Vec<StragglerChange> {
        for &(rank, t) in times {
            if !t.is_finite() || t < 0.0 {
                continue;
            }
            let h = self.history.entry(rank).or_default();
            h.push_back(t);
            while h.len() > self.config.window {
                h.pop_front();
            }
        }
        let present: Vec<u32> = times.iter().map(|(r, _)| *r).collect();
        let mut changes = Vec::new();
        let recovered_below = (1.0 + self.config.threshold) / 2.0;
        for (rank, (slowdown, median_s, typical_s)) in self.slowdowns(&present) {
            let named = self.named.entry(rank).or_insert(false);
            if !*named
                && slowdown >= self.config.threshold
                && median_s - typical_s >= self.config.min_excess_s
            {
                *named = true;
                changes.push(StragglerChange::Slow {
                    rank,
                    slowdown,
                    median_s,
                    typical_s,
                });
            } else if *named && slowdown < recovered_below {
                *named = false;
                changes.push(StragglerChange::Recovered { rank, slowdown });
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(det: &mut StragglerDetector, steps: &[Vec<f64>]) -> Vec<StragglerChange> {
        steps
            .iter()
            .flat_map(|s| {
                let times: Vec<(u32, f64)> =
                    s.iter().enumerate().map(|(r, t)| (r as u32, *t)).collect();
                det.observe(&times)
            })
            .collect()
    }

    #[test]
    fn a_three_times_slower_rank_is_named_once_with_its_slowdown_then_recovers() {
        let mut d = StragglerDetector::new(StragglerDetection::default());
        let slow: Vec<Vec<f64>> = (0..8).map(|_| vec![1.0, 1.0, 3.0, 1.0]).collect();
        let changes = run(&mut d, &slow);
        assert_eq!(changes.len(), 1, "{changes:?}");
        let StragglerChange::Slow { rank, slowdown, .. } = changes[0] else {
            panic!("{changes:?}")
        };
        assert_eq!((rank, slowdown), (2, 3.0));
        let fast: Vec<Vec<f64>> = (0..5).map(|_| vec![1.0; 4]).collect();
        let changes = run(&mut d, &fast);
        assert!(
            matches!(changes[..], [StragglerChange::Recovered { rank: 2, .. }]),
            "{changes:?}"
        );
    }

    #[test]
    fn milliseconds_of_noise_on_tiny_steps_are_no_straggler() {
        let mut d = StragglerDetector::new(StragglerDetection::default());
        let steps: Vec<Vec<f64>> = (0..10).map(|_| vec![0.001, 0.001, 0.004]).collect();
        assert!(run(&mut d, &steps).is_empty());
    }

    #[test]
    fn one_slow_step_is_not_a_straggler() {
        let mut d = StragglerDetector::new(StragglerDetection::default());
        let mut steps: Vec<Vec<f64>> = (0..10).map(|_| vec![1.0, 1.0, 1.0]).collect();
        steps[4][1] = 50.0;
        assert!(run(&mut d, &steps).is_empty());
    }

    proptest! {
        /// STRAG-2: the same times scaled by any factor give the same changes.
        #[test]
        fn scaling_every_rank_changes_nothing(
            steps in prop::collection::vec(prop::collection::vec(0.1f64..10.0, 3), 1..20),
            scale in 0.01f64..100.0,
        ) {
            let config = StragglerDetection { min_excess_s: 0.0, ..Default::default() };
            let mut a = StragglerDetector::new(config);
            let mut b = StragglerDetector::new(config);
            let scaled: Vec<Vec<f64>> =
                steps.iter().map(|s| s.iter().map(|t| t * scale).collect()).collect();
            let ra: Vec<(u32, bool)> = run(&mut a, &steps).iter().map(kind).collect();
            let rb: Vec<(u32, bool)> = run(&mut b, &scaled).iter().map(kind).collect();
            prop_assert_eq!(ra, rb);
        }

        /// STRAG-1: nothing is named before a full window, and names and recoveries
        /// alternate per rank.
        #[test]
        fn names_need_a_full_window_and_alternate(
            steps in prop::collection::vec(prop::collection::vec(0.1f64..10.0, 4), 1..30),
            window in 1usize..6,
        ) {
            let mut d = StragglerDetector::new(StragglerDetection {
                window,
                threshold: 1.5,
                min_excess_s: 0.0,
            });
            let mut last: BTreeMap<u32, bool> = BTreeMap::new();
            for (i, s) in steps.iter().enumerate() {
                let times: Vec<(u32, f64)> =
                    s.iter().enumerate().map(|(r, t)| (r as u32, *t)).collect();
                for c in d.observe(&times) {
                    prop_assert!(i + 1 >= window);
                    let (rank, slow) = kind(&c);
                    prop_assert_ne!(last.get(&rank).copied().unwrap_or(false), slow);
                    last.insert(rank, slow);
                }
            }
        }
    }

    fn kind(c: &StragglerChange) -> (u32, bool) {
        match *c {
            StragglerChange::Slow { rank, .. } => (rank, true),
            StragglerChange::Recovered { rank, .. } => (rank, false),
        }
    }
}
