//! Rolling a block or pipeline job back across processes (issue 26): a node of a ZeRO-3 block
//! job, or of a dp × pp × tp GPT job, is killed mid-run; a spare node that joined the running
//! job takes the lost rank, every rank is wired anew and restored from the last checkpoint,
//! and the job trains on from it. Stopped, it ends bitwise where an uninterrupted run of as
//! many steps ends.
#![cfg(feature = "cluster")]

use std::path::{Path, PathBuf};
use std::time::Duration;

use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, parameter_bits};

use crate::cluster_procs::{Proc, SECRET, node, training_head};
use crate::cluster_tensor::{gpt_flags, load_gpt};
use crate::cluster_training::{
    WIDTHS, load_of, run_to_end, step_after, steps_trained, stop_cleanly, wait_for_line,
};

/// A job of `nodes` node processes (`job_flags(model, steps)` its flags) killed in node-b and
/// rolled back onto a spare, then stopped; then the same job uninterrupted for as many steps.
/// The two trained models' paths.
fn roll_back_and_run_again(
    dir: &Path,
    name: &str,
    nodes: usize,
    job_flags: &dyn Fn(&Path, u64) -> Vec<String>,
) -> (PathBuf, PathBuf) {
    let ckpt = |run: &str| dir.join(run).join("ckpt");
    let model = |run: &str| dir.join(run).join("trained.mpk");
    let with_checkpoints = |run: &str, steps: u64| {
        let mut flags = job_flags(&model(run), steps);
        flags.extend([
            "--checkpoint-dir".to_string(),
            ckpt(run).display().to_string(),
            "--checkpoint-every".to_string(),
            "10".to_string(),
        ]);
        flags
    };
    // Trains until stopped: it cannot end before the spare joins and the kill lands.
    let mut flags = with_checkpoints("killed", 100_000);
    flags.extend(["--on-replica-loss", "rollback"].map(String::from));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let job = format!("{name}-killed");
    let (mut head, addr) = training_head(&job, nodes as u32, 60, &flags);
    let names = ["node-a", "node-b", "node-c", "node-d"];
    let mut procs: Vec<Proc> = names[..nodes]
        .iter()
        .map(|n| node(n, &addr, &job, &[], SECRET))
        .collect();
    for p in &procs {
        p.wait_line("prepared:", Duration::from_secs(60));
    }
    procs.push(node("spare", &addr, &job, &[], SECRET));
    head.wait_line(
        "node spare joined the running job: rank(s) ",
        Duration::from_secs(30),
    );
    head.wait_line("checkpoint after step", Duration::from_secs(60));
    let mut victim = procs.remove(1);
    victim.signal("-KILL");
    victim.wait_exit(Duration::from_secs(10));
    let rolled = head.wait_line("rolled back to the checkpoint", Duration::from_secs(90));
    println!("{name}: {rolled}");
    let failed = step_after(&rolled, "step ").expect("the failed step");
    // Stopped once the job trained past the failed step (a checkpoint after it).
    wait_for_line(&mut head, Duration::from_secs(120), |l| {
        step_after(l, "checkpoint after step ").is_some_and(|s| s > failed) && l.contains("written")
    })
    .unwrap_or_else(|| panic!("{name}: the job ended by itself:\n{}", head.output()));
    let out = stop_cleanly(&mut head, &mut procs);
    // The spare took the lost rank and trained the redone and later steps.
    let spare = procs.last().expect("the spare");
    let trained = steps_trained(spare);
    assert!(
        trained.len() == 1 && trained[0].1 > 0,
        "{name}: the spare trained no step:\n{}",
        spare.output()
    );
    // The stop wrote a last checkpoint after the last step: how many steps the job applied.
    let steps = meshwork::checkpoint::CheckpointStore::open(ckpt("killed"), 3)
        .expect("the checkpoint store")
        .latest_valid()
        .expect("the checkpoints list")
        .expect("a checkpoint")
        .checkpoint
        .step;
    assert!(
        steps > failed,
        "{name}: {steps} steps, failed at {failed}:\n{out}"
    );
    let plain = with_checkpoints("plain", steps);
    let plain: Vec<&str> = plain.iter().map(String::as_str).collect();
    let none: &[&str] = &[];
    run_to_end(&format!("{name}-plain"), &vec![none; nodes], &plain);
    (model("killed"), model("plain"))
}

/// ZeRO-3 over three node processes (the demo MLP as blocks, each block sharded three ways):
/// node-b killed, its rank restored on the spare from the checkpoint's three parts of every
/// block, the job ends bitwise where the uninterrupted one does.
#[test]
fn a_killed_zero_3_node_rolls_back_onto_a_spare_and_ends_as_an_uninterrupted_run() {
    let dir = TempDir::new("zero3-rollback");
    std::fs::create_dir_all(dir.path()).unwrap();
    let flags = |model: &Path, steps: u64| {
        [
            "--zero",
            "3",
            "--batch-size",
            "48",
            "--seed",
            "5",
            "--collective-timeout",
            "5",
            "--steps",
            &steps.to_string(),
            "--save-model",
            &model.display().to_string(),
        ]
        .map(String::from)
        .to_vec()
    };
    let (killed, plain) = roll_back_and_run_again(dir.path(), "zero3", 3, &flags);
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    assert!(
        parameter_bits(&load_of(&WIDTHS, &killed, &device))
            == parameter_bits(&load_of(&WIDTHS, &plain, &device)),
        "the rolled-back ZeRO-3 job differs from the uninterrupted one"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The demo GPT as a 1 × 2 × 2 (dp × pp × tp) mesh over four node processes: node-b (tp rank
/// 1 of stage 0) killed, its slices restored on the spare from the checkpoint, every rank
/// rewired (links, tensor-parallel and model groups), the job ends bitwise where the
/// uninterrupted one does.
#[test]
fn a_killed_tensor_parallel_node_rolls_back_onto_a_spare_and_ends_as_an_uninterrupted_run() {
    let dir = TempDir::new("tp-rollback");
    std::fs::create_dir_all(dir.path()).unwrap();
    let flags = |model: &Path, steps: u64| {
        let mut f = gpt_flags(model, steps);
        f.extend(["--pp", "2", "--tp", "2"].map(String::from));
        f.iter_mut()
            .filter(|a| a.as_str() == "20")
            .for_each(|a| *a = "5".into());
        f
    };
    let (killed, plain) = roll_back_and_run_again(dir.path(), "gpt-tp", 4, &flags);
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    assert!(
        parameter_bits(&load_gpt(&killed, &device)) == parameter_bits(&load_gpt(&plain, &device)),
        "the rolled-back tensor-parallel job differs from the uninterrupted one"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}
