//! Trace records: what each rank did during a step, and the time breakdown derived from them.
//!
//! Pure data. Device threads record [`TraceRecord`]s; step-done events carry them; reports and
//! the Chrome-trace export ([`chrome_trace_json`]) are computed from them. Times are
//! microseconds since the job started.

use serde::{Deserialize, Serialize};

use crate::mesh::Rank;

/// What a span of time on a rank was spent on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum TraceKind {
    /// Forward pass of one micro-batch of `samples` samples.
    Forward {
        /// Index of the micro-batch inside the step.
        micro_batch: u32,
        /// Samples in the micro-batch.
        samples: u32,
    },
    /// Backward pass of one micro-batch.
    Backward {
        /// Index of the micro-batch inside the step.
        micro_batch: u32,
    },
    /// Copying gradients into or out of the flat buffer.
    Flatten,
    /// An all-reduce of `bytes` bytes (includes waiting for peers to arrive).
    AllReduce {
        /// Payload size.
        bytes: u64,
    },
    /// A reduce-scatter of a `bytes`-byte buffer (ZeRO-2's gradient reduction).
    ReduceScatter {
        /// Size of the whole buffer.
        bytes: u64,
    },
    /// An all-gather into a `bytes`-byte buffer (ZeRO's updated parameter shards).
    AllGather {
        /// Size of the whole buffer.
        bytes: u64,
    },
    /// A broadcast of `bytes` bytes.
    Broadcast {
        /// Payload size.
        bytes: u64,
    },
    /// The optimizer's update.
    OptimizerStep,
    /// Pipeline: putting a micro-batch's activation or gradient on the link to stage `to`.
    Send {
        /// Index of the micro-batch inside the step.
        micro_batch: u32,
        /// The receiving stage.
        to: u32,
    },
    /// Pipeline: waiting for and taking a micro-batch's activation or gradient from stage
    /// `from` (waiting, not work).
    Recv {
        /// Index of the micro-batch inside the step.
        micro_batch: u32,
        /// The sending stage.
        from: u32,
    },
    /// Reading samples and building the batch tensors is part of `Forward`; this is anything
    /// else the rank ran on request (tests, diagnostics).
    Task {
        /// The task's label.
        label: String,
    },
}

impl TraceKind {
    /// Which share of the step this counts towards.
    pub fn category(&self) -> TimeCategory {
        match self {
            TraceKind::AllReduce { .. }
            | TraceKind::ReduceScatter { .. }
            | TraceKind::AllGather { .. }
            | TraceKind::Broadcast { .. }
            | TraceKind::Send { .. } => TimeCategory::Communication,
            TraceKind::Recv { .. } => TimeCategory::Waiting,
            _ => TimeCategory::Compute,
        }
    }

    fn name(&self) -> String {
        match self {
            TraceKind::Forward { micro_batch, .. } => format!("forward mb{micro_batch}"),
            TraceKind::Backward { micro_batch } => format!("backward mb{micro_batch}"),
            TraceKind::Flatten => "flatten".into(),
            TraceKind::AllReduce { .. } => "all_reduce".into(),
            TraceKind::ReduceScatter { .. } => "reduce_scatter".into(),
            TraceKind::AllGather { .. } => "all_gather".into(),
            TraceKind::Broadcast { .. } => "broadcast".into(),
            TraceKind::OptimizerStep => "optimizer".into(),
            TraceKind::Send { micro_batch, to } => format!("send mb{micro_batch} to {to}"),
            TraceKind::Recv { micro_batch, from } => format!("recv mb{micro_batch} from {from}"),
            TraceKind::Task { label } => label.clone(),
        }
    }
}

/// The coarse categories of a step's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeCategory {
    /// Forward, backward, optimizer, flattening.
    Compute,
    /// Collectives (including the wait for the slowest peer inside them) and pipeline sends.
    Communication,
    /// Waiting for a pipeline neighbour (counted in the waiting share).
    Waiting,
}

/// One span of work on one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// The rank that did the work.
    pub rank: Rank,
    /// The training step.
    pub step: u64,
    /// What was done.
    pub kind: TraceKind,
    /// Start, in microseconds since the job started.
    pub start_us: u64,
    /// Duration in microseconds.
    pub duration_us: u64,
}

impl TraceRecord {
    /// End, in microseconds since the job started.
    pub fn end_us(&self) -> u64 {
        self.start_us + self.duration_us
    }
}

/// How a step's wall time divides on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeBreakdown {
    /// Seconds computing.
    pub compute_s: f64,
    /// Seconds in collectives.
    pub communication_s: f64,
    /// Seconds of the step's wall time spent neither computing nor communicating (waiting
    /// for work, messaging, data loading outside the forward span).
    pub waiting_s: f64,
    /// Seconds of `communication_s` that ran while the rank computed (collectives on a
    /// communication thread beside the compute: a block job's prefetched gathers and
    /// gradient reductions), so hidden behind `compute_s`; 0 when nothing overlaps.
    #[serde(default)]
    pub overlapped_s: f64,
}

impl TimeBreakdown {
    /// The breakdown of `records` (one rank) inside a step that took `wall_s` seconds.
    pub fn from_records<'a>(
        records: impl IntoIterator<Item = &'a TraceRecord>,
        wall_s: f64,
    ) -> Self {
        let mut b = TimeBreakdown::default();
        let mut compute = Vec::new();
        let mut communication = Vec::new();
        for r in records {
            let s = r.duration_us as f64 * 1e-6;
            match r.kind.category() {
                TimeCategory::Compute => {
                    b.compute_s += s;
                    compute.push((r.start_us, r.end_us()));
                }
                TimeCategory::Communication => {
                    b.communication_s += s;
                    communication.push((r.start_us, r.end_us()));
                }
                TimeCategory::Waiting => {}
            }
        }
        b.overlapped_s = overlap_us(compute, communication) as f64 * 1e-6;
        b.waiting_s = (wall_s - b.compute_s - b.exposed_communication_s()).max(0.0);
        b
    }

    /// The communication not hidden behind compute.
    pub fn exposed_communication_s(&self) -> f64 {
        (self.communication_s - self.overlapped_s).max(0.0)
    }

    /// Sum of two breakdowns.
    pub fn plus(self, o: Self) -> Self {
        Self {
            compute_s: self.compute_s + o.compute_s,
            communication_s: self.communication_s + o.communication_s,
            waiting_s: self.waiting_s + o.waiting_s,
            overlapped_s: self.overlapped_s + o.overlapped_s,
        }
    }

    /// The shares (compute, communication not hidden behind compute, waiting) of the
    /// total, each in `[0, 1]`.
    pub fn shares(&self) -> (f64, f64, f64) {
        let exposed = self.exposed_communication_s();
        let total = self.compute_s + exposed + self.waiting_s;
        if total <= 0.0 {
            return (0.0, 0.0, 0.0);
        }
        (
            self.compute_s / total,
            exposed / total,
            self.waiting_s / total,
        )
    }
}

/// The length of the time covered by both sets of spans (start, end), each set merged first.
fn overlap_us(a: Vec<(u64, u64)>, b: Vec<(u64, u64)>) -> u64 {
    fn merged(mut spans: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
        spans.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
        for (s, e) in spans {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        out
    }
    let (a, b) = (merged(a), merged(b));
    let (mut i, mut j, mut total) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        let (s, e) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        total += e.saturating_sub(s);
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

/// The records as a Chrome trace (`chrome://tracing`, Perfetto): one row per rank.
pub fn chrome_trace_json(records: &[TraceRecord]) -> String {
    let events: Vec<serde_json::Value> = records
        .iter()
        .map(|r| {
            serde_json::json!({
                "name": r.kind.name(),
                "cat": format!("{:?}", r.kind.category()),
                "ph": "X",
                "ts": r.start_us,
                "dur": r.duration_us,
                "pid": 0,
                "tid": r.rank.0,
                "args": { "step": r.step },
            })
        })
        .collect();
    serde_json::json!({ "traceEvents": events }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: TraceKind, start: u64, dur: u64) -> TraceRecord {
        TraceRecord {
            rank: Rank(0),
            step: 0,
            kind,
            start_us: start,
            duration_us: dur,
        }
    }

    #[test]
    fn breakdown_splits_compute_communication_and_waiting() {
        let r = [
            rec(
                TraceKind::Forward {
                    micro_batch: 0,
                    samples: 4,
                },
                0,
                300_000,
            ),
            rec(TraceKind::Backward { micro_batch: 0 }, 300_000, 300_000),
            rec(TraceKind::AllReduce { bytes: 8 }, 600_000, 200_000),
        ];
        let b = TimeBreakdown::from_records(&r, 1.0);
        assert!((b.compute_s - 0.6).abs() < 1e-9);
        assert!((b.communication_s - 0.2).abs() < 1e-9);
        assert!((b.waiting_s - 0.2).abs() < 1e-9);
        let (c, m, w) = b.shares();
        assert!((c + m + w - 1.0).abs() < 1e-9);
    }

    #[test]
    fn breakdown_counts_communication_beside_compute_as_overlapped() {
        // A backward of 0.5 s with a gather of 0.3 s on the communication thread, 0.2 s of
        // it during the backward; then a reduction of 0.1 s alone.
        let r = [
            rec(TraceKind::Backward { micro_batch: 0 }, 100_000, 500_000),
            rec(TraceKind::AllGather { bytes: 8 }, 400_000, 300_000),
            rec(TraceKind::AllReduce { bytes: 8 }, 700_000, 100_000),
        ];
        let b = TimeBreakdown::from_records(&r, 1.0);
        assert!((b.overlapped_s - 0.2).abs() < 1e-9);
        assert!((b.exposed_communication_s() - 0.2).abs() < 1e-9);
        assert!((b.waiting_s - 0.3).abs() < 1e-9);
        let (c, m, w) = b.shares();
        assert!((c + m + w - 1.0).abs() < 1e-9);
        assert!((m - 0.2).abs() < 1e-9);
    }

    #[test]
    fn chrome_trace_has_one_event_per_record() {
        let r = [rec(TraceKind::OptimizerStep, 5, 7)];
        let v: serde_json::Value = serde_json::from_str(&chrome_trace_json(&r)).unwrap();
        assert_eq!(v["traceEvents"].as_array().unwrap().len(), 1);
        assert_eq!(v["traceEvents"][0]["dur"], 7);
    }
}
