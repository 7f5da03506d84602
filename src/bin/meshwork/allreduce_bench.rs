//! `meshwork bench allreduce`: the all-reduce's bandwidth in one process (against memcpy),
//! across processes over TCP (against one loopback stream) and over MPI (against
//! `MPI_Allreduce`), and the workers those runs start.

use meshwork::comm::Algorithm;
use meshwork::comm::bench::{Wire, all_reduce_bandwidth};
use meshwork::error::{Error, Result};

fn sizes(bytes: Option<usize>) -> Vec<usize> {
    match bytes {
        Some(b) => vec![b],
        None => (12..=26).map(|p| 1usize << p).collect(),
    }
}

#[cfg(feature = "cluster")]
pub(crate) fn allreduce_tcp(
    world: usize,
    bytes: Option<usize>,
    how: (Algorithm, Wire),
    json: bool,
) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidConfig("--world 0: use at least 1".into()));
    }
    crate::tcp_bench::run(world, &sizes(bytes), how, json)
}

/// A worker's `--sizes` list.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
fn size_list(sizes: &str) -> Result<Vec<usize>> {
    sizes
        .split(',')
        .map(|s| {
            s.parse()
                .map_err(|_| Error::InvalidConfig(format!("--sizes: {s:?} is not a size")))
        })
        .collect()
}

#[cfg(feature = "cluster")]
pub(crate) fn allreduce_worker(
    rank: u32,
    world: usize,
    sizes: &str,
    how: (Algorithm, Wire),
) -> Result<()> {
    crate::tcp_bench::worker(rank, world, &size_list(sizes)?, how)
}

#[cfg(feature = "mpi")]
pub(crate) fn allreduce_mpi(
    world: usize,
    bytes: Option<usize>,
    algo: Algorithm,
    json: bool,
) -> Result<()> {
    if world < 2 {
        return Err(Error::InvalidConfig(
            "--transport mpi: use --world 2 or more".into(),
        ));
    }
    // 1 KiB..64 MiB: MPI's small messages are where a fabric library differs most.
    let sizes = match bytes {
        Some(b) => vec![b],
        None => (10..=26).map(|p| 1usize << p).collect(),
    };
    crate::mpi_bench::run(world, &sizes, algo, json)
}

#[cfg(feature = "mpi")]
pub(crate) fn allreduce_mpi_worker(sizes: &str, algo: Algorithm) -> Result<()> {
    crate::mpi_bench::worker(&size_list(sizes)?, algo)
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn allreduce_mpi(_: usize, _: Option<usize>, _: Algorithm, _: bool) -> Result<()> {
    Err(Error::InvalidConfig(
        "--transport mpi needs meshwork built with the `mpi` feature \
         (cargo run --release --features mpi -- bench allreduce --transport mpi)"
            .into(),
    ))
}

#[cfg(not(feature = "mpi"))]
pub(crate) fn allreduce_mpi_worker(_: &str, _: Algorithm) -> Result<()> {
    allreduce_mpi(0, None, Algorithm::Auto, false)
}

#[cfg(not(feature = "cluster"))]
pub(crate) fn allreduce_tcp(
    _: usize,
    _: Option<usize>,
    _: (Algorithm, Wire),
    _: bool,
) -> Result<()> {
    Err(Error::InvalidConfig(
        "--transport tcp needs meshwork built with the `cluster` feature \
         (cargo run --release --features cluster -- bench allreduce --transport tcp)"
            .into(),
    ))
}

#[cfg(not(feature = "cluster"))]
pub(crate) fn allreduce_worker(_: u32, _: usize, _: &str, _: (Algorithm, Wire)) -> Result<()> {
    allreduce_tcp(0, None, (Algorithm::Auto, Wire::default()), false)
}

pub(crate) fn allreduce(
    world: usize,
    bytes: Option<usize>,
    how: (Algorithm, Wire),
    json: bool,
) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidConfig("--world 0: use at least 1".into()));
    }
    let (algo, wire) = how;
    let sizes = sizes(bytes);
    if !json {
        println!(
            "# all_reduce, world {world}, {wire}, sum; GB/s = 1e9 bytes/s; busbw = algbw·2(N−1)/N"
        );
        println!(
            "{:>12} {:>8} {:>10} {:>10} {:>10} {:>11}",
            "bytes", "algo", "time_us", "algbw", "busbw", "busbw/mcpy"
        );
    }
    for b in sizes {
        let iterations = ((256usize << 20) / b.max(1)).clamp(5, 200);
        let f = all_reduce_bandwidth(world, b, algo, iterations, wire)?;
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "world": f.world, "bytes": f.bytes, "algo": f.algorithm.to_string(),
                    "algbw_gbps": f.algbw_gbps, "busbw_gbps": f.busbw_gbps,
                    "memcpy_gbps": f.memcpy_gbps, "time_us": f.seconds_median * 1e6,
                    "wire": wire.to_string(),
                })
            );
        } else {
            println!(
                "{:>12} {:>8} {:>10.1} {:>10.2} {:>10.2} {:>11.2}",
                f.bytes,
                f.algorithm.to_string(),
                f.seconds_median * 1e6,
                f.algbw_gbps,
                f.busbw_gbps,
                f.busbw_gbps / f.memcpy_gbps.max(1e-12)
            );
        }
    }
    Ok(())
}
