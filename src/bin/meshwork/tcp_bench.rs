//! `meshwork bench allreduce --transport tcp`: the all-reduce across N processes of this
//! machine (this binary re-executed as `bench allreduce-worker`, one rank each, on 127.0.0.1
//! ports the children pick), next to what one plain loopback TCP stream moves in the same run.

use std::process::Command;
use std::time::Duration;

use meshwork::comm::Algorithm;
use meshwork::comm::bench::{
    AllReduceFigures, Wire, figures, memcpy_gbps, tcp_duplex_gbps, tcp_stream_gbps, time_all_reduce,
};
use meshwork::comm::net::link::{JobToken, LinkListener};
use meshwork::comm::tcp::{TcpConfig, TcpGroup};
use meshwork::error::{Error, Result};
use meshwork::mesh::{Generation, Rank};
use meshwork::testing::processes::{ProcessGroup, announce_and_wait_for_peers};
use serde::{Deserialize, Serialize};

/// The job token reaches the children through the environment, never the command line.
const TOKEN_ENV: &str = "MESHWORK_BENCH_TOKEN";

/// Bytes one loopback stream run moves.
const STREAM_BYTES: usize = 1 << 30;

/// What rank 0 reports per size.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct SizeReport {
    pub(crate) bytes: usize,
    pub(crate) times_s: Vec<f64>,
    pub(crate) algorithm: Algorithm,
}

fn runtime(what: impl std::fmt::Display) -> Error {
    Error::Runtime(what.to_string())
}

pub(crate) fn iterations(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(5, 200)
}

/// The parent: measures the loopback stream, starts `world` workers, prints their figures.
pub(crate) fn run(
    world: usize,
    sizes: &[usize],
    (algo, wire): (Algorithm, Wire),
    json: bool,
) -> Result<()> {
    let stream = tcp_stream_gbps(STREAM_BYTES, 3).map_err(runtime)?;
    let duplex = tcp_duplex_gbps(STREAM_BYTES, 3).map_err(runtime)?;
    let measured = measure(world, sizes, (algo, wire))?;
    if !json {
        println!(
            "# all_reduce over TCP, {world} processes on 127.0.0.1, {wire}, sum; GB/s = 1e9 bytes/s; \
             busbw = algbw·2(N−1)/N; one loopback TCP stream: {stream:.2} GB/s; each of two \
             opposite streams at once: {duplex:.2} GB/s"
        );
        println!(
            "{:>12} {:>6} {:>10} {:>8} {:>8} {:>11} {:>14}",
            "bytes", "algo", "time_us", "algbw", "busbw", "busbw/tcp", "busbw/duplex"
        );
    }
    for f in measured {
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "world": f.world, "bytes": f.bytes, "algo": f.algorithm.to_string(),
                    "algbw_gbps": f.algbw_gbps, "busbw_gbps": f.busbw_gbps,
                    "memcpy_gbps": f.memcpy_gbps, "time_us": f.seconds_median * 1e6,
                    "transport": "tcp", "tcp_stream_gbps": stream, "wire": wire.to_string(),
                    "tcp_duplex_gbps": duplex,
                })
            );
        } else {
            println!(
                "{:>12} {:>6} {:>10.1} {:>8.2} {:>8.2} {:>11.2} {:>14.2}",
                f.bytes,
                f.algorithm.to_string(),
                f.seconds_median * 1e6,
                f.algbw_gbps,
                f.busbw_gbps,
                f.busbw_gbps / stream.max(1e-12),
                f.busbw_gbps / duplex.max(1e-12)
            );
        }
    }
    Ok(())
}

/// Starts `world` TCP workers (this binary, one process each) and returns rank 0's figures
/// per size.
pub(crate) fn measure(
    world: usize,
    sizes: &[usize],
    (algo, wire): (Algorithm, Wire),
) -> Result<Vec<AllReduceFigures>> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })?;
    let token = JobToken::random();
    let hex: String = token
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let list: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let commands = (0..world)
        .map(|rank| {
            let mut command = Command::new(&exe);
            command
                .env(TOKEN_ENV, &hex)
                .args(["bench", "allreduce-worker", "--rank", &rank.to_string()])
                .args(["--world", &world.to_string(), "--sizes", &list.join(",")])
                .args(["--algo", &algo.to_string(), "--wire", &wire.to_string()]);
            command
        })
        .collect();
    let mut group = ProcessGroup::start(commands, Duration::from_secs(30)).map_err(runtime)?;
    let mut measured = Vec::new();
    for _ in sizes {
        // A size takes at most 200 iterations; two minutes are far more than any needs.
        let line = group
            .next_line(0, Duration::from_secs(120))
            .map_err(runtime)?;
        measured.push(figures_of(world, &line)?);
    }
    let statuses = group.wait_all(Duration::from_secs(30));
    if let Some(rank) = statuses
        .iter()
        .position(|s| !s.is_some_and(|s| s.success()))
    {
        return Err(runtime(format!(
            "bench worker {rank} failed: {:?}",
            statuses[rank]
        )));
    }
    Ok(measured)
}

/// The figures of one of rank 0's report lines (a [`SizeReport`]).
pub(crate) fn figures_of(world: usize, line: &str) -> Result<AllReduceFigures> {
    let report: SizeReport = serde_json::from_str(line)
        .map_err(|e| runtime(format!("rank 0 reported {line:?}: {e}")))?;
    let times = report
        .times_s
        .iter()
        .map(|s| Duration::from_secs_f64(*s))
        .collect();
    let memcpy = memcpy_gbps(report.bytes, iterations(report.bytes));
    Ok(figures(
        world,
        report.bytes,
        report.algorithm,
        times,
        memcpy,
    ))
}

/// One rank, in a child process.
pub(crate) fn worker(
    rank: u32,
    world: usize,
    sizes: &[usize],
    (algo, wire): (Algorithm, Wire),
) -> Result<()> {
    let hex = std::env::var(TOKEN_ENV).map_err(|_| runtime(format!("{TOKEN_ENV} is not set")))?;
    let mut bytes = [0u8; 32];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = hex
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .ok_or_else(|| runtime(format!("{TOKEN_ENV} is not 64 hex digits")))?;
    }
    let config = TcpConfig::default().with_algorithm(algo);
    let listener = LinkListener::bind(
        "127.0.0.1:0",
        Rank(rank),
        JobToken::from_bytes(bytes),
        config.link,
    )
    .map_err(runtime)?;
    let addr = listener.local_addr().map_err(runtime)?;
    let addrs = announce_and_wait_for_peers(addr).map_err(runtime)?;
    if addrs.len() != world {
        return Err(runtime(format!(
            "{} addresses for a world of {world}",
            addrs.len()
        )));
    }
    let mut comm = TcpGroup::connect(&listener, &addrs, Generation(0), config)
        .map_err(runtime)?
        .into_communicator();
    for &size in sizes {
        let (times, used) = time_all_reduce(&mut comm, size, iterations(size), wire)?;
        if rank == 0 {
            let element = wire.element_bytes();
            let report = SizeReport {
                bytes: size / element * element,
                times_s: times.iter().map(Duration::as_secs_f64).collect(),
                algorithm: used.unwrap_or(algo),
            };
            println!("{}", serde_json::to_string(&report).map_err(runtime)?);
        }
    }
    // Every rank leaves only once all are done, so no rank sees a peer's links close early.
    comm.barrier()?;
    Ok(())
}
