//! Bandwidth probe for the in-process all-reduce, used by `meshwork bench allreduce` and the
//! criterion bench: how fast an f32 all-reduce runs next to a plain memcpy of the same buffer
//! on the same machine.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Algorithm, CommConfig, CommError, LocalGroup, ReduceOp};
use crate::mesh::Generation;

/// What [`all_reduce_bandwidth`] measured. Bandwidths are in 1e9 bytes per second.
#[derive(Debug, Clone, Serialize)]
pub struct AllReduceFigures {
    /// Ranks (threads) in the group.
    pub world: usize,
    /// Bytes of each rank's buffer.
    pub bytes: usize,
    /// The algorithm that actually ran (never [`Algorithm::Auto`]).
    pub algorithm: Algorithm,
    /// Algorithm bandwidth: `bytes / seconds_median`.
    pub algbw_gbps: f64,
    /// Bus bandwidth: `algbw · 2(N−1)/N`, comparable across world sizes (0 for N = 1).
    pub busbw_gbps: f64,
    /// `bytes` divided by the median time of one `copy_from_slice` of a buffer of that size,
    /// measured in the same call.
    pub memcpy_gbps: f64,
    /// Median wall time of one all-reduce, seen by rank 0 (which waits for every rank).
    pub seconds_median: f64,
}

impl AllReduceFigures {
    /// `busbw_gbps / memcpy_gbps`: the fraction of memcpy bandwidth the all-reduce reaches.
    pub fn busbw_over_memcpy(&self) -> f64 {
        if self.memcpy_gbps > 0.0 {
            self.busbw_gbps / self.memcpy_gbps
        } else {
            0.0
        }
    }
}

/// Warm-up ops before timing starts (they also fault the buffers in).
const WARM_UP: usize = 3;

/// One rank's timed op durations and the algorithm it ran.
type RankTimes = (Vec<Duration>, Option<Algorithm>);

fn median(mut samples: Vec<Duration>) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort();
    samples[samples.len() / 2]
}

fn gbps(bytes: usize, time: Duration) -> f64 {
    let seconds = time.as_secs_f64();
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// Runs `iterations` timed f32 sum all-reduces of `bytes` bytes per rank (rounded down to
/// whole f32s) on `world` threads with `algorithm`, after a warm-up, and reports the median.
/// Each op starts after a barrier; rank 0 times it.
pub fn all_reduce_bandwidth(
    world: usize,
    bytes: usize,
    algorithm: Algorithm,
    iterations: usize,
) -> Result<AllReduceFigures, CommError> {
    let world = world.max(1);
    let iterations = iterations.max(1);
    let len = bytes / 4;
    let bytes = len * 4;

    let source = vec![1.0f32; len];
    let mut copy = vec![0.0f32; len];
    let mut memcpy = Vec::with_capacity(iterations);
    for i in 0..iterations + WARM_UP {
        let start = Instant::now();
        copy.copy_from_slice(&source);
        std::hint::black_box(&mut copy);
        if i >= WARM_UP {
            memcpy.push(start.elapsed());
        }
    }
    drop((source, copy));

    let config = CommConfig::default().with_algorithm(algorithm);
    let group = LocalGroup::new(world, Generation(0), config);
    let results: Vec<Result<RankTimes, CommError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .communicators()
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || {
                    let mut buf = vec![1.0f32; len];
                    let mut times = Vec::with_capacity(iterations);
                    for i in 0..iterations + WARM_UP {
                        comm.barrier()?;
                        let start = Instant::now();
                        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
                        if i >= WARM_UP {
                            times.push(start.elapsed());
                        }
                    }
                    Ok((times, comm.last_algorithm()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a bench rank thread panicked"))
            .collect()
    });
    let mut rank0 = None;
    for result in results {
        let result = result?;
        rank0.get_or_insert(result);
    }
    let (times, used) = rank0.unwrap_or_default();
    let time = median(times);
    let algbw = gbps(bytes, time);
    let n = world as f64;
    Ok(AllReduceFigures {
        world,
        bytes,
        algorithm: used.unwrap_or(algorithm),
        algbw_gbps: algbw,
        busbw_gbps: algbw * 2.0 * (n - 1.0) / n,
        memcpy_gbps: gbps(bytes, median(memcpy)),
        seconds_median: time.as_secs_f64(),
    })
}
