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
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// `mpirun -n 3 meshwork train …` on this host: the head (rank 0, one rank of its own) and two
/// node processes assemble a world of three ranks from OpenMPI's variables, train every step
/// in all three processes, and end bitwise where `meshwork train --dp 3` in one process ends
/// (`--algorithm ring`), within the tolerance of the one-device loop.
#[test]
fn mpirun_starts_a_job_equal_to_its_single_process_run() {
    let dir = TempDir::new("mpirun");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (across, alone) = (dir.join("mpirun.mpk"), dir.join("alone.mpk"));
    let (across_arg, alone_arg) = (across.display().to_string(), alone.display().to_string());
    let common = [
        "--steps",
        "8",
        "--batch-size",
        "48",
        "--seed",
        "7",
        "--algorithm",
        "ring",
        "--collective-timeout",
        "20",
    ];
    let exe = env!("CARGO_BIN_EXE_meshwork");
    let mut args = vec![
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        "3",
        "-x",
        "MESHWORK_SECRET",
        "-x",
        "MESHWORK_PORT",
        exe,
        "train",
        "--save-model",
        across_arg.as_str(),
    ];
    args.extend_from_slice(&common);
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
    // Really distributed: the two node processes trained their ranks every step.
    for rank in [1, 2] {
        assert!(
            out.contains(&format!(": rank {rank} trained 8 step(s)")),
            "rank {rank}:\n{out}"
        );
    }
    let mut one = Proc::spawn(
        "alone",
        &[
            &["train", "--dp", "3", "--save-model", alone_arg.as_str()][..],
            &common,
        ]
        .concat(),
        None,
    );
    let (status, _) = one.wait_exit(Duration::from_secs(180));
    assert!(status.success(), "in one process:\n{}", one.output());
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
