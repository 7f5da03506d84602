//! A job as a file across processes (issue 51): the recipe chapter's composition of the small
//! GPT (dp 2 × pp 2 × tp 2, ZeRO-1, bf16, clipping, accumulation, warm-up and cosine),
//! written by `meshwork train --print-config`, trained with `--config` by a head and four node
//! processes and in one process: the same parameters, bitwise, every rank trained in a node.
#![cfg(feature = "cluster")]

use std::time::Duration;

use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, parameter_bits};

use crate::cluster_procs::Proc;
use crate::cluster_tensor::{STEPS, gpt_flags, load_gpt};
use crate::cluster_training::{ranks_trained, run_to_end};

#[test]
fn the_recipe_from_a_file_trains_across_node_processes_as_in_one_process() {
    let dir = TempDir::new("recipe-file");
    std::fs::create_dir_all(dir.path()).unwrap();
    let file = dir.join("recipe.toml");
    // The recipe's flags on the small GPT, written as a file (its --save-model is the CLI's
    // own, not the job's).
    let unsaved = dir.join("unused.mpk");
    let flags = gpt_flags(&unsaved, STEPS);
    let recipe: Vec<&str> = [
        "train",
        "--dp",
        "2",
        "--pp",
        "2",
        "--tp",
        "2",
        "--zero",
        "1",
        "--precision",
        "bf16",
        "--clip",
        "1.0",
        "--accumulate",
        "2",
        "--lr-schedule",
        "warmup-cosine:2",
        "--print-config",
    ]
    .into_iter()
    .chain(flags.iter().map(String::as_str))
    .collect();
    let mut print = Proc::spawn("recipe-print", &recipe, None);
    let (status, _) = print.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{}", print.output());
    std::fs::write(&file, print.output() + "\n").unwrap();
    let config = file.display().to_string();

    let alone = dir.join("alone.mpk");
    let alone_path = alone.display().to_string();
    let mut one = Proc::spawn(
        "recipe-file-alone",
        &["train", "--config", &config, "--save-model", &alone_path],
        None,
    );
    let (status, _) = one.wait_exit(Duration::from_secs(180));
    assert!(status.success(), "in one process:\n{}", one.output());

    let across = dir.join("across.mpk");
    let across_path = across.display().to_string();
    let two: &[&str] = &["--local-devices", "2"];
    let (out, procs) = run_to_end(
        "recipe-file",
        &[two, two, two, two],
        &["--config", &config, "--save-model", &across_path],
    );
    assert!(
        out.contains("world assembled: 8 rank(s) over 5 process(es)"),
        "{out}"
    );
    assert!(
        out.contains(".tensor_parallel(2)") && out.contains(".zero(One)"),
        "{out}"
    );
    // Really distributed: every rank of the 2 × 2 × 2 mesh trained every step in a node.
    assert_eq!(
        ranks_trained(&procs, 2, STEPS),
        (0..8).collect::<Vec<u32>>()
    );
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    assert!(
        parameter_bits(&load_gpt(&across, &device)) == parameter_bits(&load_gpt(&alone, &device)),
        "the file's job across processes ends bitwise where it ends in one process"
    );
    let _ = std::fs::remove_dir_all(dir.path());
}
