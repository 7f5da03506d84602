//! Jobs under a real Slurm (issue 27): a one-machine cluster (munged, slurmctld, slurmd) started
//! inside the test (`tests/cluster/slurm/up.sh`), stopped at its end whatever happens
//! (`down.sh`, from a guard's drop). `srun -n 3 meshwork train …` starts a job from Slurm's
//! variables on the TCP transport, `srun --mpi=pmix -n 3 meshwork train --transport mpi …` one
//! from MPI's world on the MPI transport, and a batch job submitted with `--requeue` whose
//! rank is killed mid-run resumes from its last checkpoint when Slurm requeues it. Every job
//! ends bitwise where the same job in one process ends. Needs `slurm-wlm` and `munge` (`.ci/run`
//! installs them), root, and meshwork built with the `mpi` feature.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, parameter_bits};

use crate::cluster_launchers::{
    assert_default_batch_fitted, assert_nodes_trained, free_port, pid_of_rank,
    train_in_one_process as in_one,
};
use crate::cluster_procs::{Proc, SECRET};
use crate::cluster_training::{WIDTHS, load_of};

/// A running one-machine Slurm cluster; stopped on drop.
struct Slurm {
    dir: TempDir,
    conf: String,
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/cluster/slurm")
        .join(name)
}

impl Slurm {
    fn up() -> Slurm {
        let dir = TempDir::new("slurm");
        let (ctld, slurmd) = (free_port().to_string(), free_port().to_string());
        let out = Command::new(script("up.sh"))
            .args([&dir.path().display().to_string(), &ctld, &slurmd])
            .output()
            .expect("run tests/cluster/slurm/up.sh");
        let slurm = Slurm {
            conf: String::from_utf8_lossy(&out.stdout).trim().to_string(),
            dir,
        };
        assert!(
            out.status.success(),
            "Slurm did not start:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        slurm
    }

    /// `program args` in this cluster's environment (its `SLURM_CONF`), with the secret.
    fn launch(&self, name: &str, program: &str, args: &[&str]) -> Proc {
        Proc::launch(
            name,
            program,
            args,
            Some(SECRET),
            &[("SLURM_CONF", &self.conf)],
        )
    }

    /// `scontrol …`'s output.
    fn scontrol(&self, args: &[&str]) -> String {
        let out = Command::new("scontrol")
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .output()
            .expect("run scontrol");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The job's state (`JobState=…`).
    fn job_state(&self, job: &str) -> String {
        let shown = self.scontrol(&["show", "job", "-o", job]);
        shown
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("JobState="))
            .unwrap_or("UNKNOWN")
            .to_string()
    }

    /// Waits (at most `limit`) until the job's state is one of `states`; returns it.
    fn wait_state(&self, job: &str, states: &[&str], limit: Duration) -> String {
        let start = Instant::now();
        loop {
            let state = self.job_state(job);
            if states.contains(&state.as_str()) {
                return state;
            }
            assert!(
                start.elapsed() < limit,
                "job {job} still {state} after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new(script("down.sh"))
            .arg(self.dir.path())
            .env("SLURM_CONF", &self.conf)
            .status();
        let _ = std::fs::remove_dir_all(self.dir.path());
    }
}

/// Waits (at most `limit`) until `path` holds a line containing `needle`; the file's text.
fn wait_in_file(path: &Path, needle: &str, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            start.elapsed() < limit,
            "no {needle:?} in {} after {limit:?}:\n{text}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn slurm_starts_jobs_on_both_transports_and_requeues_a_killed_one_to_the_same_end() {
    let slurm = Slurm::up();
    let exe = env!("CARGO_BIN_EXE_meshwork");
    let work = TempDir::new("slurm-jobs");
    std::fs::create_dir_all(work.path()).unwrap();
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);

    // 1. srun -n 3 on each transport, against the same job in one process; no --batch-size
    // (the default fitted to 3 replicas).
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
    let alone = work.join("alone.mpk");
    let alone_arg = alone.display().to_string();
    in_one(
        "slurm-alone",
        &[&common[..], &["--dp", "3", "--save-model", &alone_arg]].concat(),
    );
    let tcp_port = free_port().to_string();
    for (name, launch, transport) in [
        ("tcp", &["-n", "3", "--overcommit"][..], &[][..]),
        (
            "mpi",
            &["--mpi=pmix", "-n", "3", "--overcommit"][..],
            &["--transport", "mpi"][..],
        ),
    ] {
        let model = work.join(format!("{name}.mpk"));
        let model_arg = model.display().to_string();
        let args: Vec<&str> = launch
            .iter()
            .copied()
            .chain([exe, "train"])
            .chain(transport.iter().copied())
            .chain(common)
            .chain(["--save-model", model_arg.as_str()])
            .collect();
        let mut job = Proc::launch(
            &format!("srun-{name}"),
            "srun",
            &args,
            Some(SECRET),
            &[("SLURM_CONF", &slurm.conf), ("MESHWORK_PORT", &tcp_port)],
        );
        let (status, _) = job.wait_exit(Duration::from_secs(180));
        let out = job.output();
        assert!(status.success(), "srun ({name}) failed:\n{out}");
        assert!(
            out.contains("world assembled: 3 rank(s) over 3 process(es)"),
            "{out}"
        );
        assert_default_batch_fitted(&out);
        assert_nodes_trained(&out, [1, 2], 8);
        let group = format!("flat {} group of 3 rank(s)", name.to_uppercase());
        assert!(out.contains(&group), "{out}");
        assert!(
            parameter_bits(&load_of(&WIDTHS, &model, &device))
                == parameter_bits(&load_of(&WIDTHS, &alone, &device)),
            "srun ({name}) ends where the same job in one process ends"
        );
    }

    // 2. A batch job with --requeue: rank 2 killed after the first checkpoint ends the run;
    //    Slurm requeues the job, whose same command resumes from the checkpoint and ends
    //    bitwise where the uninterrupted job ends.
    let (rerun, whole) = (work.join("requeued.mpk"), work.join("whole.mpk"));
    let long = [
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
    let ckpt = work.join("ckpt").display().to_string();
    let log = work.join("job.out");
    let batch = work.join("job.sh");
    let command: Vec<String> = [
        "srun",
        "--mpi=pmix",
        "--kill-on-bad-exit=1",
        exe,
        "train",
        "--transport",
        "mpi",
        "--resume",
        "--checkpoint-dir",
        &ckpt,
        "--checkpoint-every",
        "10",
        "--save-model",
        &rerun.display().to_string(),
    ]
    .iter()
    .chain(long.iter())
    .map(|s| s.to_string())
    .collect();
    std::fs::write(
        &batch,
        format!(
            "#!/bin/bash\necho \"run with restart count ${{SLURM_RESTART_COUNT:-0}}\"\n{}\n",
            command.join(" ")
        ),
    )
    .unwrap();
    let log_arg = log.display().to_string();
    let batch_arg = batch.display().to_string();
    let mut submit = slurm.launch(
        "sbatch",
        "sbatch",
        &[
            "--parsable",
            "--requeue",
            "--open-mode=append",
            "-n",
            "3",
            "--overcommit",
            "-o",
            &log_arg,
            &batch_arg,
        ],
    );
    let (status, _) = submit.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "sbatch:\n{}", submit.output());
    let job = submit.output().trim().to_string();
    let text = wait_in_file(
        &log,
        "checkpoint after step 10 written",
        Duration::from_secs(120),
    );
    let pid = pid_of_rank(&text, 2).unwrap_or_else(|| panic!("the node of rank 2:\n{text}"));
    assert!(
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let state = slurm.wait_state(&job, &["FAILED", "COMPLETED"], Duration::from_secs(120));
    assert_eq!(
        state,
        "FAILED",
        "the job went on without rank 2:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(!rerun.exists(), "the killed run wrote no model");
    // The run's step daemons gone (a step of the requeued run reuses their step id).
    let start = Instant::now();
    let pattern = format!("slurmstepd: \\[{job}\\.");
    while Command::new("pgrep")
        .args(["-f", &pattern])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "job {job}'s steps linger"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Slurm's requeue (what it does itself when a node fails), eligible at once.
    slurm.scontrol(&["requeue", &job]);
    slurm.scontrol(&["update", &format!("jobid={job}"), "StartTime=now"]);
    let state = slurm.wait_state(&job, &["COMPLETED", "FAILED"], Duration::from_secs(300));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(state, "COMPLETED", "the requeued job:\n{text}");
    assert!(text.contains("run with restart count 1"), "{text}");
    assert!(text.contains("resumed after step "), "{text}");
    let whole_arg = whole.display().to_string();
    in_one(
        "slurm-whole",
        &[&long[..], &["--dp", "3", "--save-model", &whole_arg]].concat(),
    );
    let widths = [32, 1024, 1024, 4];
    assert!(
        parameter_bits(&load_of(&widths, &rerun, &device))
            == parameter_bits(&load_of(&widths, &whole, &device)),
        "killed and requeued under Slurm, the job ends where it ends uninterrupted"
    );
    drop(slurm);
    let _ = std::fs::remove_dir_all(work.path());
}
