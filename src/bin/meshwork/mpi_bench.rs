//! `meshwork bench allreduce --transport mpi`: in one run, the same all-reduce sizes on the
//! three transports — `world` threads of this process (in-process), `world` processes over
//! meshwork's TCP links, and `world` processes under `mpirun` over MPI (meshwork's plans, and
//! the MPI library's own `MPI_Allreduce` beside them as the fabric's reference) — so each
//! figure is a ratio inside one run.

use std::process::Command;
use std::time::Duration;

use meshwork::comm::Algorithm;
use meshwork::comm::CommConfig;
use meshwork::comm::bench::{AllReduceFigures, Wire, all_reduce_bandwidth, time_all_reduce};
use meshwork::comm::mpi::{self, MpiEndpoint, MpiGroup};
use meshwork::error::{Error, Result};
use meshwork::mesh::{Generation, Rank};

use crate::launched::Launched;
use crate::tcp_bench::{SizeReport, figures_of, iterations};

fn runtime(what: impl std::fmt::Display) -> Error {
    Error::Runtime(what.to_string())
}

/// What each transport measured at one size.
struct Row {
    local: AllReduceFigures,
    tcp: AllReduceFigures,
    mpi: AllReduceFigures,
    library: AllReduceFigures,
}

/// The parent: the three transports, one table.
pub(crate) fn run(world: usize, sizes: &[usize], algo: Algorithm, json: bool) -> Result<()> {
    let mpi = mpirun_workers(world, sizes, algo)?;
    let tcp = crate::tcp_bench::measure(world, sizes, (algo, Wire::default()))?;
    let mut rows = Vec::new();
    for ((&bytes, tcp), (mpi, library)) in sizes.iter().zip(tcp).zip(mpi) {
        let local = all_reduce_bandwidth(world, bytes, algo, iterations(bytes), Wire::default())?;
        rows.push(Row {
            local,
            tcp,
            mpi,
            library,
        });
    }
    if !json {
        println!(
            "# all_reduce of f32 sums, {world} ranks on this host, in one run: in-process \
             (threads), TCP and MPI (processes; mpirun --oversubscribe --bind-to none); MPI lib: \
             the library's own MPI_Allreduce; busbw = algbw·2(N−1)/N in GB/s (1e9 bytes/s)"
        );
        println!(
            "{:>10} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}",
            "bytes", "algo", "local", "tcp", "mpi", "mpi lib", "mpi/tcp", "mpi/lib"
        );
    }
    for r in rows {
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "world": world, "bytes": r.mpi.bytes, "algo": r.mpi.algorithm.to_string(),
                    "busbw_local_gbps": r.local.busbw_gbps,
                    "busbw_tcp_gbps": r.tcp.busbw_gbps,
                    "busbw_mpi_gbps": r.mpi.busbw_gbps,
                    "busbw_mpi_library_gbps": r.library.busbw_gbps,
                    "time_us_mpi": r.mpi.seconds_median * 1e6,
                    "time_us_tcp": r.tcp.seconds_median * 1e6,
                    "transport": "mpi",
                })
            );
        } else {
            println!(
                "{:>10} {:>6} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8.2} {:>9.2}",
                r.mpi.bytes,
                r.mpi.algorithm.to_string(),
                r.local.busbw_gbps,
                r.tcp.busbw_gbps,
                r.mpi.busbw_gbps,
                r.library.busbw_gbps,
                r.mpi.busbw_gbps / r.tcp.busbw_gbps.max(1e-12),
                r.mpi.busbw_gbps / r.library.busbw_gbps.max(1e-12),
            );
        }
    }
    Ok(())
}

/// `mpirun -n world` of this binary's MPI worker; rank 0's figures per size: meshwork's
/// plans over MPI, then the library's `MPI_Allreduce`.
fn mpirun_workers(
    world: usize,
    sizes: &[usize],
    algo: Algorithm,
) -> Result<Vec<(AllReduceFigures, AllReduceFigures)>> {
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        path: "current executable".into(),
        reason: e.to_string(),
    })?;
    let list: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let mut command = Command::new("mpirun");
    command
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["-n", &world.to_string()])
        .arg(&exe)
        .args(["bench", "allreduce-mpi-worker", "--sizes", &list.join(",")])
        .args(["--algo", &algo.to_string()]);
    let mut mpirun = Launched::start(command, "mpirun (is OpenMPI installed?)")?;
    let mut measured = Vec::new();
    for _ in sizes {
        let ours = mpirun.next_line(Duration::from_secs(180))?;
        let theirs = mpirun.next_line(Duration::from_secs(180))?;
        measured.push((figures_of(world, &ours)?, figures_of(world, &theirs)?));
    }
    mpirun.wait(Duration::from_secs(30))?;
    Ok(measured)
}

/// One rank under `mpirun`: an MPI group of the whole world (each process's endpoint
/// broadcast over MPI), every size timed with meshwork's plan and with `MPI_Allreduce`; rank 0
/// prints two [`SizeReport`] lines per size.
pub(crate) fn worker(sizes: &[usize], algo: Algorithm) -> Result<()> {
    let world = mpi::init().map_err(runtime)?;
    let result = measure_in_worker(world, sizes, algo);
    mpi::finalize();
    result
}

fn measure_in_worker(
    world: &'static mpi::MpiWorld,
    sizes: &[usize],
    algo: Algorithm,
) -> Result<()> {
    let mine = world.endpoint().to_bytes();
    let mut endpoints = Vec::new();
    for p in 0..world.size() {
        let bytes = world.broadcast_bytes(p, &mine).map_err(runtime)?;
        endpoints.push(
            MpiEndpoint::from_bytes(&bytes).ok_or_else(|| runtime("an endpoint of 8 bytes"))?,
        );
    }
    let config = CommConfig::default().with_algorithm(algo);
    let mut comm = MpiGroup::new(world, endpoints, Rank(world.rank()), Generation(0), config)
        .map_err(runtime)?
        .into_communicator();
    for &size in sizes {
        let (times, used) = time_all_reduce(&mut comm, size, iterations(size), Wire::default())?;
        let library = time_library(world, &mut comm, size, iterations(size))?;
        if world.rank() == 0 {
            for (times, algorithm) in [(times, used.unwrap_or(algo)), (library, algo)] {
                let report = SizeReport {
                    bytes: size / 4 * 4,
                    times_s: times.iter().map(Duration::as_secs_f64).collect(),
                    algorithm,
                };
                println!("{}", serde_json::to_string(&report).map_err(runtime)?);
            }
        }
    }
    comm.barrier()?;
    Ok(())
}

/// `MPI_Allreduce` timed as `time_all_reduce` times meshwork's (barrier, then the op).
fn time_library(
    world: &'static mpi::MpiWorld,
    comm: &mut meshwork::comm::Communicator,
    bytes: usize,
    iterations: usize,
) -> Result<Vec<Duration>> {
    let mut buf = vec![1.0f32; bytes / 4];
    let mut times = Vec::with_capacity(iterations);
    for i in 0..iterations.max(1) + 2 {
        comm.barrier()?;
        let start = std::time::Instant::now();
        world.library_all_reduce_sum(&mut buf).map_err(runtime)?;
        if i >= 2 {
            times.push(start.elapsed());
        }
    }
    Ok(times)
}
