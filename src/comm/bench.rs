//! Bandwidth probe for the in-process all-reduce, used by `meshwork bench allreduce` and the
//! criterion bench: how fast an f32 all-reduce runs next to a plain memcpy of the same buffer
//! on the same machine.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::{
    Algorithm, CommConfig, CommError, Communicator, DType, Element, LocalGroup, PartialSums,
    ReduceOp,
};
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

/// The element type a timed all-reduce runs in and how its partial sums travel (COMM-9):
/// `f32` (the default), `f16`, `bf16`, `f16-narrow`, `bf16-narrow` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wire {
    /// The buffer's element type.
    pub dtype: DType,
    /// How a 16-bit op's partial sums travel.
    pub partial_sums: PartialSums,
}

impl std::str::FromStr for Wire {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (dtype, partial_sums) = match s.to_ascii_lowercase().as_str() {
            "f32" => (DType::F32, PartialSums::F32),
            "f16" => (DType::F16, PartialSums::F32),
            "bf16" => (DType::BF16, PartialSums::F32),
            "f16-narrow" => (DType::F16, PartialSums::Narrow),
            "bf16-narrow" => (DType::BF16, PartialSums::Narrow),
            other => {
                return Err(format!(
                    "unknown wire {other:?}: use f32, f16, bf16, f16-narrow or bf16-narrow \
                     (-narrow: 16-bit partial sums)"
                ));
            }
        };
        Ok(Self {
            dtype,
            partial_sums,
        })
    }
}

impl std::fmt::Display for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.dtype)?;
        if self.dtype != DType::F32 && self.partial_sums == PartialSums::Narrow {
            f.write_str("-narrow")?;
        }
        Ok(())
    }
}

impl Default for Wire {
    /// `f32`.
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            partial_sums: PartialSums::F32,
        }
    }
}

impl Wire {
    /// Bytes of one element.
    pub fn element_bytes(&self) -> usize {
        self.dtype.size_bytes()
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

/// `bytes` divided by the median time of one `copy_from_slice` of a buffer of that size.
pub fn memcpy_gbps(bytes: usize, iterations: usize) -> f64 {
    let len = bytes / 4;
    let source = vec![1.0f32; len];
    let mut copy = vec![0.0f32; len];
    let mut memcpy = Vec::with_capacity(iterations);
    for i in 0..iterations.max(1) + WARM_UP {
        let start = Instant::now();
        copy.copy_from_slice(&source);
        std::hint::black_box(&mut copy);
        if i >= WARM_UP {
            memcpy.push(start.elapsed());
        }
    }
    gbps(len * 4, median(memcpy))
}

/// One rank's side of the timing loop, for any transport: `iterations` timed sum all-reduces
/// of `bytes` bytes (rounded down to whole elements of `wire`'s type) after a warm-up, each
/// after a barrier. Returns this rank's durations and the algorithm that ran.
pub fn time_all_reduce(
    comm: &mut Communicator,
    bytes: usize,
    iterations: usize,
    wire: Wire,
) -> Result<(Vec<Duration>, Option<Algorithm>), CommError> {
    comm.set_partial_sums(wire.partial_sums);
    let len = bytes / wire.element_bytes();
    match wire.dtype {
        DType::F32 => time_typed::<f32>(comm, len, iterations),
        DType::F16 => time_typed::<half::f16>(comm, len, iterations),
        DType::BF16 => time_typed::<half::bf16>(comm, len, iterations),
    }
}

fn time_typed<T: Element>(
    comm: &mut Communicator,
    len: usize,
    iterations: usize,
) -> Result<(Vec<Duration>, Option<Algorithm>), CommError> {
    let mut buf = vec![T::from_f32(1.0); len];
    let mut times = Vec::with_capacity(iterations);
    for i in 0..iterations.max(1) + WARM_UP {
        comm.barrier()?;
        let start = Instant::now();
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        if i >= WARM_UP {
            times.push(start.elapsed());
        }
    }
    Ok((times, comm.last_algorithm()))
}

/// The figures of `world` ranks' all-reduce of `bytes` bytes from rank 0's durations.
pub fn figures(
    world: usize,
    bytes: usize,
    algorithm: Algorithm,
    times: Vec<Duration>,
    memcpy_gbps: f64,
) -> AllReduceFigures {
    let time = median(times);
    let algbw = gbps(bytes, time);
    let n = world as f64;
    AllReduceFigures {
        world,
        bytes,
        algorithm,
        algbw_gbps: algbw,
        busbw_gbps: algbw * 2.0 * (n - 1.0) / n,
        memcpy_gbps,
        seconds_median: time.as_secs_f64(),
    }
}

/// Runs `iterations` timed sum all-reduces of `bytes` bytes per rank (rounded down to whole
/// elements of `wire`'s type) on `world` threads with `algorithm`, after a warm-up, and
/// reports the median. Each op starts after a barrier; rank 0 times it.
pub fn all_reduce_bandwidth(
    world: usize,
    bytes: usize,
    algorithm: Algorithm,
    iterations: usize,
    wire: Wire,
) -> Result<AllReduceFigures, CommError> {
    let world = world.max(1);
    let iterations = iterations.max(1);
    let bytes = bytes / wire.element_bytes() * wire.element_bytes();
    let memcpy = memcpy_gbps(bytes, iterations);
    let config = CommConfig::default().with_algorithm(algorithm);
    let group = LocalGroup::new(world, Generation(0), config);
    let results: Vec<Result<RankTimes, CommError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .communicators()
            .into_iter()
            .map(|mut comm| {
                scope.spawn(move || time_all_reduce(&mut comm, bytes, iterations, wire))
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
    Ok(figures(
        world,
        bytes,
        used.unwrap_or(algorithm),
        times,
        memcpy,
    ))
}

/// What each of two plain loopback TCP streams in opposite directions moves while both run
/// at once, in 1e9 bytes per second: the traffic of a two-rank ring all-reduce (each rank sends
/// and receives the buffer once), so the ceiling it meets when the machine's cores, not the
/// network, limit loopback TCP. `total` bytes each way in 4 MiB writes; the median of `runs`.
#[cfg(feature = "cluster")]
pub fn tcp_duplex_gbps(total: usize, runs: usize) -> std::io::Result<f64> {
    let mut samples = Vec::new();
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        let ways = [
            std::thread::spawn(move || one_way(total)),
            std::thread::spawn(move || one_way(total)),
        ];
        for way in ways {
            way.join()
                .map_err(|_| std::io::Error::other("a stream thread panicked"))??;
        }
        samples.push(start.elapsed());
    }
    Ok(gbps(total, median(samples)))
}

/// Moves `total` bytes over one loopback TCP stream (a writer thread, this thread reads).
#[cfg(feature = "cluster")]
fn one_way(total: usize) -> std::io::Result<()> {
    use std::io::{Read, Write};
    const CHUNK: usize = 4 << 20;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let mut stream = std::net::TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        let chunk = vec![1u8; CHUNK];
        let mut left = total;
        while left > 0 {
            let n = left.min(CHUNK);
            stream.write_all(&chunk[..n])?;
            left -= n;
        }
        Ok(())
    });
    let (mut stream, _) = listener.accept()?;
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0;
    while got < total {
        match stream.read(&mut buf)? {
            0 => break,
            n => got += n,
        }
    }
    writer
        .join()
        .map_err(|_| std::io::Error::other("the stream writer panicked"))?
}

/// What one plain loopback TCP stream moves, in 1e9 bytes per second: a thread writes
/// `total` bytes in 4 MiB writes to a socket of this process, another reads them; the median
/// of `runs` runs. The ceiling a TCP all-reduce on this machine is compared with.
#[cfg(feature = "cluster")]
pub fn tcp_stream_gbps(total: usize, runs: usize) -> std::io::Result<f64> {
    let mut samples = Vec::new();
    for _ in 0..runs.max(1) {
        let start = Instant::now();
        one_way(total)?;
        samples.push(start.elapsed());
    }
    Ok(gbps(total, median(samples)))
}
