//! `meshwork bench dp --transport tcp|mpi`: the demo job's data-parallel training in one run on
//! each transport — `world` ranks as threads of one process (`meshwork train --dp N`), and
//! `world` processes under `mpirun` on meshwork's TCP data plane and (with `mpi`) on MPI —
//! each reported in samples/s with the head's split of a step, and as a ratio to one process.

use std::process::Command;
use std::time::Duration;

use meshwork::error::{Error, Result};
use serde::Serialize;

use crate::launched::Launched;

fn runtime(what: impl std::fmt::Display) -> Error {
    Error::Runtime(what.to_string())
}

/// One transport's run.
#[derive(Debug, Serialize)]
pub(crate) struct TransportRun {
    /// `in-process`, `tcp` or `mpi`.
    pub(crate) transport: &'static str,
    /// Samples per second over the run's steps.
    pub(crate) samples_per_s: f64,
    /// The head's split of a step: compute, communication, waiting (percent).
    pub(crate) split: [f64; 3],
}

/// The job every run trains: the demo MLP 32-1024-1024-4, batch 64 per replica, the ring.
fn job_flags(world: u32, steps: u64) -> Vec<String> {
    [
        "--hidden",
        "1024",
        "--batch-size",
        &(64 * world).to_string(),
        "--steps",
        &steps.to_string(),
        "--seed",
        "1",
        "--algorithm",
        "ring",
        "--collective-timeout",
        "60",
    ]
    .map(String::from)
    .to_vec()
}

/// `N steps, X samples/s; time per step: compute a%, communication b%, waiting c%`.
fn parse_summary(line: &str) -> Option<(f64, [f64; 3])> {
    let (_, rest) = line.split_once(" steps, ")?;
    let (rate, rest) = rest.split_once(" samples/s")?;
    let numbers: Vec<f64> = rest
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    Some((
        rate.trim().parse().ok()?,
        [*numbers.first()?, *numbers.get(1)?, *numbers.get(2)?],
    ))
}

/// Runs `command` to its end (at most `limit`) and reads its summary line.
fn summary_of(command: Command, what: &'static str, limit: Duration) -> Result<(f64, [f64; 3])> {
    let mut run = Launched::start(command, what)?;
    let lines = run.wait(limit)?;
    lines
        .iter()
        .find_map(|l| parse_summary(l))
        .ok_or_else(|| runtime(format!("{what}: no summary line in {lines:?}")))
}

/// The runs: in one process, then over TCP, then (`mpi`) over MPI.
pub(crate) fn run(world: u32, steps: u64, mpi: bool) -> Result<Vec<TransportRun>> {
    let exe = std::env::current_exe().map_err(|e| runtime(format!("the binary: {e}")))?;
    let flags = job_flags(world, steps);
    let limit = Duration::from_secs(600);
    let mut runs = Vec::new();
    let mut one = Command::new(&exe);
    one.args(["train", "--dp", &world.to_string()]).args(&flags);
    let (rate, split) = summary_of(one, "meshwork train --dp (in one process)", limit)?;
    runs.push(TransportRun {
        transport: "in-process",
        samples_per_s: rate,
        split,
    });
    let transports: &[(&'static str, &'static str)] = if mpi {
        &[
            ("tcp", "mpirun … --transport tcp"),
            ("mpi", "mpirun … --transport mpi"),
        ]
    } else {
        &[("tcp", "mpirun … --transport tcp")]
    };
    let secret = format!("bench-dp-{}-{}", std::process::id(), steps);
    for &(transport, what) in transports {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port().to_string())
            .map_err(|e| runtime(format!("a free port: {e}")))?;
        let mut command = Command::new("mpirun");
        command
            .env("MESHWORK_SECRET", &secret)
            .env("MESHWORK_PORT", &port)
            .args([
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                "none",
            ])
            .args([
                "-n",
                &world.to_string(),
                "-x",
                "MESHWORK_SECRET",
                "-x",
                "MESHWORK_PORT",
            ])
            .arg(&exe)
            .args(["train", "--transport", transport])
            .args(&flags);
        let (rate, split) = summary_of(command, what, limit)?;
        runs.push(TransportRun {
            transport,
            samples_per_s: rate,
            split,
        });
    }
    Ok(runs)
}

/// The table (or one JSON object per run).
pub(crate) fn print(world: u32, steps: u64, runs: &[TransportRun], json: bool) {
    let base = runs.first().map_or(1.0, |r| r.samples_per_s).max(1e-9);
    if !json {
        println!(
            "# data parallel across processes: demo MLP 32-1024-1024-4, Adam, batch 64 per \
             replica, {world} ranks, {steps} steps, ring; in-process = threads of one process, \
             tcp/mpi = {world} processes under mpirun --oversubscribe --bind-to none"
        );
        println!(
            "{:>11} {:>11} {:>9} {:>9} {:>9} {:>8}",
            "transport", "samples/s", "compute%", "comm%", "wait%", "ratio"
        );
    }
    for r in runs {
        if json {
            let line = serde_json::json!({
                "world": world, "steps": steps, "transport": r.transport,
                "samples_per_s": r.samples_per_s, "compute_pct": r.split[0],
                "communication_pct": r.split[1], "waiting_pct": r.split[2],
                "ratio_to_in_process": r.samples_per_s / base,
            });
            println!("{line}");
        } else {
            println!(
                "{:>11} {:>11.0} {:>9.0} {:>9.0} {:>9.0} {:>8.2}",
                r.transport,
                r.samples_per_s,
                r.split[0],
                r.split[1],
                r.split[2],
                r.samples_per_s / base
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_summary;

    #[test]
    fn the_heads_summary_line_parses() {
        let line = "8 steps, 33497 samples/s; time per step: compute 35%, communication 17%, \
                    waiting 48%";
        assert_eq!(parse_summary(line), Some((33497.0, [35.0, 17.0, 48.0])));
        assert_eq!(parse_summary("loss 0.2890 → 0.2484"), None);
    }
}
