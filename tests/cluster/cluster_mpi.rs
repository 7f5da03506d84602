//! Jobs on the MPI transport (issue 27): `mpirun -n N meshwork train --transport mpi …` takes
//! its world from MPI itself (rank 0 the head, RDV-4) and moves every data-parallel,
//! tensor-parallel and model group's bytes and every pipeline activation through OpenMPI
//! (`comm::mpi`, the TCP groups and links only a bootstrap). Each run ends bitwise where the same layout ends in one process and within the
//! tolerance of one device. Needs OpenMPI (`openmpi-bin libopenmpi-dev`; `.ci/run` installs
//! them) and meshwork built with the `mpi` feature.
#![cfg(feature = "mpi")]

use std::time::Duration;

use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, compare_parameters, parameter_bits};

use crate::cluster_config::BookRecipe;
use crate::cluster_launchers::{
    assert_nodes_trained, free_port, mpirun_n, train_in_one_process as in_one,
};
use crate::cluster_procs::{Proc, SECRET};
use crate::cluster_tensor::{STEPS, TOLERANCE, gpt_flags, in_one_process, load_gpt};
use crate::cluster_training::{WIDTHS, load_of, reference};

/// Runs `mpirun -n <n> meshwork train --transport mpi <flags>` to its end; its output.
fn under_mpirun(n: &str, flags: &[&str]) -> String {
    let train: Vec<&str> = ["--transport", "mpi"]
        .iter()
        .chain(flags)
        .copied()
        .collect();
    let port = free_port().to_string();
    let mut job = Proc::launch(
        "mpirun",
        "mpirun",
        &mpirun_n(n, &train),
        Some(SECRET),
        &[("MESHWORK_PORT", &port)],
    );
    let (status, _) = job.wait_exit(Duration::from_secs(240));
    let out = job.output();
    assert!(status.success(), "mpirun failed:\n{out}");
    out
}

/// Really distributed and really MPI: every node process reports its ranks trained every
/// step, and each of its groups formed over MPI.
fn assert_trained_over_mpi(out: &str, ranks: impl IntoIterator<Item = u32>, steps: u64) {
    assert_nodes_trained(out, ranks, steps);
    assert!(out.contains("flat MPI group"), "{out}");
    assert!(
        !out.contains("flat TCP group"),
        "a group stayed on TCP:\n{out}"
    );
}

/// dp and ZeRO-3 (with recomputation) on 3 MPI ranks, one per process: bitwise the same job
/// in one process (`--dp 3`), within 1e-5 of the one-device loop on the same batches.
#[test]
fn dp_and_zero_3_over_mpi_equal_their_single_process_runs_and_one_device() {
    let dir = TempDir::new("mpi-dp");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (steps, batch, seed) = (8u64, 48usize, 5u64);
    let (expected, device) = reference(seed, batch, steps, 3);
    for (name, strategy) in [
        ("dp", &["--algorithm", "ring"][..]),
        (
            "zero3",
            &["--zero", "3", "--recompute", "--algorithm", "ring"][..],
        ),
    ] {
        let (across, alone) = (
            dir.join(format!("{name}-mpi.mpk")),
            dir.join(format!("{name}-alone.mpk")),
        );
        let (across_arg, alone_arg) = (across.display().to_string(), alone.display().to_string());
        let common: Vec<&str> = [
            "--steps",
            "8",
            "--batch-size",
            "48",
            "--seed",
            "5",
            "--collective-timeout",
            "20",
        ]
        .iter()
        .chain(strategy)
        .copied()
        .collect();
        let out = under_mpirun("3", &[&common[..], &["--save-model", &across_arg]].concat());
        assert!(
            out.contains("world assembled: 3 rank(s) over 3 process(es)"),
            "{out}"
        );
        assert!(out.contains("JobConfig { transport: Mpi }"), "{out}");
        assert_trained_over_mpi(&out, [1, 2], steps);
        in_one(
            &format!("{name}-alone"),
            &[&common[..], &["--dp", "3", "--save-model", &alone_arg]].concat(),
        );
        let trained = load_of(&WIDTHS, &across, &device);
        assert!(
            parameter_bits(&trained) == parameter_bits(&load_of(&WIDTHS, &alone, &device)),
            "{name} over MPI ends where the same job in one process ends"
        );
        let worst = compare_parameters(&trained, &expected, TOLERANCE)
            .unwrap_or_else(|e| panic!("{name} over MPI differs from one device: {e}"));
        println!("{name} over MPI, worst relative difference to one device: {worst:e}");
    }
    let _ = std::fs::remove_dir_all(dir.path());
}

/// dp 2 × pp 2 × tp 2 of the demo GPT on 4 MPI processes of 2 devices each: the
/// tensor-parallel, model and data-parallel groups and the pipeline links over MPI, bitwise
/// the same layout in one process, within 1e-5 of one device.
#[test]
fn gpt_dp_pp_tp_over_mpi_equals_its_single_process_run_and_one_device() {
    let dir = TempDir::new("mpi-gpt");
    std::fs::create_dir_all(dir.path()).unwrap();
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    let (across, alone, one_device) = (
        dir.join("gpt-mpi.mpk"),
        dir.join("gpt-alone.mpk"),
        dir.join("gpt-one-device.mpk"),
    );
    let flags = gpt_flags(&across, STEPS);
    let flags: Vec<&str> = ["--local-devices", "2", "--pp", "2", "--tp", "2"]
        .into_iter()
        .chain(flags.iter().map(String::as_str))
        .collect();
    let out = under_mpirun("4", &flags);
    assert!(
        out.contains("world assembled: 8 rank(s) over 4 process(es)"),
        "{out}"
    );
    assert_trained_over_mpi(&out, 2..8, STEPS);
    // The activations too: each stage's link to the other stage of its pipeline is MPI's.
    assert!(out.contains("pipeline: 1 link(s) over MPI"), "{out}");
    assert!(!out.contains("link(s) over TCP"), "{out}");
    in_one_process("gpt-mpi-alone", ["2", "2", "2"], &alone);
    in_one_process("gpt-mpi-one-device", ["1", "1", "1"], &one_device);
    let trained = load_gpt(&across, &device);
    assert!(
        parameter_bits(&trained) == parameter_bits(&load_gpt(&alone, &device)),
        "dp × pp × tp over MPI ends where the same layout in one process ends"
    );
    let worst = compare_parameters(&trained, &load_gpt(&one_device, &device), TOLERANCE)
        .unwrap_or_else(|e| panic!("dp × pp × tp over MPI differs from one device: {e}"));
    println!("dp × pp × tp over MPI, worst relative difference to one device: {worst:e}");
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The book's recipe file under mpirun (`book/snippets/multi-machine.sh`, anchor `recipe`: its
/// mpirun line as written, with the test's small GPT in the file): dp 2 × pp 2 × tp 2, ZeRO-1,
/// bf16, clipping, accumulation and warm-up/cosine over MPI, bitwise where the file's job ends
/// in one process.
#[test]
fn the_books_recipe_file_under_mpirun_equals_its_single_process_run() {
    let dir = TempDir::new("mpi-recipe");
    std::fs::create_dir_all(dir.path()).unwrap();
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    let book = BookRecipe::read();
    let config = book.write_file(&dir);
    let alone = book.in_one_process(&dir, &config);
    let across = dir.join("across.mpk");
    let mut flags = BookRecipe::paths(&book.mpirun, &config, "");
    flags.extend(["--save-model".to_string(), across.display().to_string()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = under_mpirun(&book.mpirun_n, &flags);
    assert!(
        out.contains("world assembled: 8 rank(s) over 4 process(es)"),
        "{out}"
    );
    assert!(out.contains(".zero(One)") && out.contains("bf16"), "{out}");
    assert_trained_over_mpi(&out, 2..8, STEPS);
    assert!(
        parameter_bits(&load_gpt(&across, &device)) == parameter_bits(&load_gpt(&alone, &device)),
        "the book's recipe file under mpirun ends where it ends in one process"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// A roll-back policy is refused on the MPI transport before anyone waits (a lost process
/// ends an MPI job), naming the row and what to do instead.
#[test]
fn roll_back_on_the_mpi_transport_is_refused_up_front() {
    let dir = TempDir::new("mpi-rollback");
    let ckpt = dir.join("ckpt").display().to_string();
    let train = [
        "--transport",
        "mpi",
        "--steps",
        "2",
        "--on-replica-loss",
        "rollback",
        "--checkpoint-dir",
        ckpt.as_str(),
        "--checkpoint-every",
        "1",
    ];
    let port = free_port().to_string();
    let mut job = Proc::launch(
        "mpirun",
        "mpirun",
        &mpirun_n("2", &train),
        Some(SECRET),
        &[("MESHWORK_PORT", &port)],
    );
    let (status, _) = job.wait_exit(Duration::from_secs(120));
    let out = job.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains("rerun the same command"), "{out}");
    let _ = std::fs::remove_dir_all(dir.path());
}
