//! Jobs started by the launchers clusters already run (issue 27): `mpirun` of OpenMPI starts
//! `meshwork train` in every process with no listen or join flags; rank 0 is the head (holding
//! one rank itself), the others are nodes, the world comes from the launcher's variables and
//! the secret from the environment. Needs OpenMPI's `mpirun` (`apt-get install openmpi-bin`;
//! `.ci/run` installs it).
#![cfg(feature = "cluster")]

use std::time::Duration;

use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, parameter_bits};

use crate::cluster_procs::{Proc, SECRET};
use crate::cluster_training::{WIDTHS, load_of};

/// A port nobody listens on now (the head binds it a moment later).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `meshwork train <flags>` in one process, run to its end (the reference of a launched run).
pub(crate) fn train_in_one_process(name: &str, flags: &[&str]) {
    let args: Vec<&str> = ["train"].iter().chain(flags).copied().collect();
    let mut one = Proc::spawn(name, &args, None);
    let (status, _) = one.wait_exit(Duration::from_secs(300));
    assert!(status.success(), "{name} in one process:\n{}", one.output());
}

/// Really distributed: a launched job's output shows each of `ranks` trained every one of
/// its `steps` in a node process.
pub(crate) fn assert_nodes_trained(out: &str, ranks: impl IntoIterator<Item = u32>, steps: u64) {
    for rank in ranks {
        assert!(
            out.contains(&format!(": rank {rank} trained {steps} step(s)")),
            "rank {rank}:\n{out}"
        );
    }
}

/// `mpirun`'s arguments for `meshwork train <train>` on 3 ranks of this host, the secret and
/// the head's port passed to every rank.
fn mpirun_train<'a>(train: &[&'a str]) -> Vec<&'a str> {
    mpirun_n("3", train)
}

/// [`mpirun_train`] on `n` ranks.
pub(crate) fn mpirun_n<'a>(n: &'a str, train: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        n,
        "-x",
        "MESHWORK_SECRET",
        "-x",
        "MESHWORK_PORT",
        env!("CARGO_BIN_EXE_meshwork"),
        "train",
    ];
    args.extend_from_slice(train);
    args
}

/// `mpirun -n 3 meshwork train …` on this host: the head (rank 0, one rank of its own) and two
/// node processes assemble a world of three ranks from OpenMPI's variables, train every step
/// in all three processes, and end bitwise where `meshwork train --dp 3` in one process ends
/// (`--algorithm ring`), within the tolerance of the one-device loop. No `--batch-size`: the
/// default (256) is fitted to the 3 replicas, 255, in both runs, and said on the first line.
#[test]
fn mpirun_starts_a_job_equal_to_its_single_process_run() {
    let dir = TempDir::new("mpirun");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (across, alone) = (dir.join("mpirun.mpk"), dir.join("alone.mpk"));
    let (across_arg, alone_arg) = (across.display().to_string(), alone.display().to_string());
    let common = [
        "--steps",
        "8",
        "--seed",
        "7",
        "--algorithm",
        "ring",
        "--collective-timeout",
        "20",
    ];
    let args = mpirun_train(&[&["--save-model", across_arg.as_str()][..], &common].concat());
    // The head's port, passed to every rank with `-x`.
    let port = free_port().to_string();
    let mut job = Proc::launch(
        "mpirun",
        "mpirun",
        &args,
        Some(SECRET),
        &[("MESHWORK_PORT", &port)],
    );
    let (status, _) = job.wait_exit(Duration::from_secs(180));
    let out = job.output();
    assert!(status.success(), "mpirun failed:\n{out}");
    assert!(
        out.contains("world assembled: 3 rank(s) over 3 process(es)"),
        "{out}"
    );
    assert_default_batch_fitted(&out);
    // Really distributed: the two node processes trained their ranks every step.
    assert_nodes_trained(&out, [1, 2], 8);
    train_in_one_process(
        "alone",
        &[
            &["--dp", "3", "--save-model", alone_arg.as_str()][..],
            &common,
        ]
        .concat(),
    );
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    let (trained, single) = (
        load_of(&WIDTHS, &across, &device),
        load_of(&WIDTHS, &alone, &device),
    );
    assert!(
        parameter_bits(&trained) == parameter_bits(&single),
        "the job mpirun started ends where the same job in one process ends"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// A launched job of 3 replicas without `--batch-size` said first that it trains the default
/// batch fitted to them.
pub(crate) fn assert_default_batch_fitted(out: &str) {
    let first = out
        .lines()
        .find(|l| l.starts_with("meshwork head:"))
        .unwrap_or_default();
    assert!(
        first.starts_with(
            "meshwork head: global batch 255 (the default 256 rounded to a multiple of 3"
        ),
        "the head's first line: {first:?}\n{out}"
    );
}

/// The pid in a node's default name (`host-pid`) of the node that holds `rank`, from its
/// `prepared:` line (`meshwork node NAME: prepared: process P, ranks [R] of N`).
pub(crate) fn pid_of_rank(output: &str, rank: u32) -> Option<u32> {
    output.lines().find_map(|l| {
        let rest = l.strip_prefix("meshwork node ")?;
        let (name, rest) = rest.split_once(": prepared: ")?;
        if !rest.contains(&format!("ranks [{rank}] ")) {
            return None;
        }
        name.rsplit_once('-')?.1.parse().ok()
    })
}

/// Failures under an engine (issue 27): OpenMPI ends the whole world when a rank dies. A node
/// process killed mid-run ends the job with a report naming the lost rank (meshwork's and
/// mpirun's), the last checkpoint stays intact, and the same command run again (`--resume`:
/// on the first run there is nothing to resume, an event) resumes from it and ends bitwise
/// where the same job in one process, uninterrupted, ends.
#[test]
fn a_rank_killed_under_mpirun_ends_the_job_and_the_same_command_resumes_it() {
    let dir = TempDir::new("mpirun-kill");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (rerun, alone) = (dir.join("rerun.mpk"), dir.join("alone.mpk"));
    let ckpt = dir.join("ckpt").display().to_string();
    let (rerun_arg, alone_arg) = (rerun.display().to_string(), alone.display().to_string());
    let common = [
        "--steps",
        "100",
        "--batch-size",
        "96",
        "--hidden",
        "1024",
        "--seed",
        "5",
        "--algorithm",
        "ring",
        "--collective-timeout",
        "10",
    ];
    let resume = [
        "--resume",
        "--checkpoint-dir",
        ckpt.as_str(),
        "--checkpoint-every",
        "10",
        "--save-model",
        rerun_arg.as_str(),
    ];
    let command = mpirun_train(&[&resume[..], &common].concat());
    let port = free_port().to_string();
    let vars = [("MESHWORK_PORT", port.as_str())];
    let mut first = Proc::launch("mpirun", "mpirun", &command, Some(SECRET), &vars);
    first.wait_line("checkpoint after step 10 written", Duration::from_secs(120));
    let pid = pid_of_rank(&first.output(), 2)
        .unwrap_or_else(|| panic!("the node of rank 2:\n{}", first.output()));
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, _) = first.wait_exit(Duration::from_secs(120));
    let out = first.output();
    assert!(!status.success(), "the job went on without rank 2:\n{out}");
    assert!(
        out.contains("stage 0 of replica 2 on device 2 was lost"),
        "meshwork names the lost rank:\n{out}"
    );
    assert!(
        out.contains("mpirun noticed that process rank 2"),
        "mpirun names it:\n{out}"
    );
    assert!(!rerun.exists(), "the killed run wrote no model");
    // The same command again: it resumes from the last checkpoint and trains to the end.
    let port = free_port().to_string();
    let vars = [("MESHWORK_PORT", port.as_str())];
    let mut again = Proc::launch("mpirun", "mpirun", &command, Some(SECRET), &vars);
    let (status, _) = again.wait_exit(Duration::from_secs(180));
    let out = again.output();
    assert!(status.success(), "the rerun failed:\n{out}");
    assert!(out.contains("resumed after step "), "{out}");
    train_in_one_process(
        "alone",
        &[
            &["--dp", "3", "--save-model", alone_arg.as_str()][..],
            &common,
        ]
        .concat(),
    );
    let widths = [32, 1024, 1024, 4];
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    assert!(
        parameter_bits(&load_of(&widths, &rerun, &device))
            == parameter_bits(&load_of(&widths, &alone, &device)),
        "killed and rerun under mpirun, the job ends where it ends uninterrupted in one process"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}
