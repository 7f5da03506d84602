//! Tensor parallelism across processes (issue 26): `meshwork train --model gpt --tp 2 …` as
//! the head and `meshwork node` processes. The job spec carries the GPT (its sizes), the
//! pipeline's shape and the tensor-parallel degree; every process builds the same blocks, each
//! rank its slices; a tensor-parallel group is a TCP group (inside one node process holding
//! several devices, or spanning processes), as are the data-parallel groups and each
//! replica's model group; the head puts the trained slices back together.
#![cfg(feature = "cluster")]

use std::path::Path;
use std::time::Duration;

use burn::module::Module;
use meshwork::demo::gpt::{Gpt, GptConfig};
use meshwork::device::{BackendKind, MeshDevice};
use meshwork::testing::{TempDir, compare_parameters, draw_lock, parameter_bits};

use crate::cluster_procs::Proc;
use crate::cluster_training::{ranks_trained, run_to_end};

/// Per tensor, max|a − b| ≤ TOLERANCE · max|reference| (the foundation's criterion).
pub(crate) const TOLERANCE: f32 = 1e-5;
/// Steps each run trains.
pub(crate) const STEPS: u64 = 4;

/// A small GPT and its run of `steps` steps, saved at `model`: one layer of width 32, 4 heads, 16 characters of context, Adam,
/// the ring algorithm everywhere (so every group sums in one order in and across processes).
pub(crate) fn gpt_flags(model: &Path, steps: u64) -> Vec<String> {
    [
        "--model",
        "gpt",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--context",
        "16",
        "--steps",
        &steps.to_string(),
        "--batch-size",
        "8",
        "--micro-batches",
        "2",
        "--seed",
        "3",
        "--algorithm",
        "ring",
        "--collective-timeout",
        "20",
        "--save-model",
        &model.display().to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// The trained GPT the head (or a single-process run) saved at `path`.
pub(crate) fn load_gpt(path: &Path, device: &MeshDevice) -> Gpt {
    let vocab = meshwork::demo::kjv_corpus().unwrap().vocab().len();
    let config = GptConfig {
        vocab,
        context: 16,
        d_model: 32,
        heads: 4,
        layers: 1,
    };
    let shape = {
        // Unseeded (the file's values replace the draw), but a draw all the same.
        let _draw = draw_lock();
        Gpt::new(&config, device.burn())
    };
    shape
        .try_load_file(path)
        .unwrap_or_else(|e| panic!("the GPT at {}: {e:?}", path.display()))
}

/// The GPT job of `layout` (`--dp/--pp/--tp` values) trained in one process.
pub(crate) fn in_one_process(name: &str, layout: [&str; 3], model: &Path) {
    let flags = gpt_flags(model, STEPS);
    let args: Vec<&str> = [
        "train", "--dp", layout[0], "--pp", layout[1], "--tp", layout[2],
    ]
    .into_iter()
    .chain(flags.iter().map(String::as_str))
    .collect();
    let mut one = Proc::spawn(name, &args, None);
    let (status, _) = one.wait_exit(Duration::from_secs(180));
    assert!(status.success(), "{name} in one process:\n{}", one.output());
}

/// dp × pp × tp across processes: a 2 × 2 × 2 mesh over four node processes of two devices
/// each (every tensor-parallel group inside one process: rank = tp + 2·(dp + 2·pp)), and a
/// 1 × 2 × 2 mesh over four node processes of one device each (every tensor-parallel group
/// spanning two processes). Each trains every step in its node processes, ends bitwise where
/// the same layout ends in one process, and within 1e-5 of the same GPT trained on one device
/// (the slices put back together on the head: a lost slice would be far off).
#[test]
fn gpt_dp_pp_tp_across_node_processes_equals_its_single_process_run_and_one_device() {
    let dir = TempDir::new("gpt-tp-across");
    std::fs::create_dir_all(dir.path()).unwrap();
    let device = MeshDevice::of_kind(BackendKind::Flex, 1).unwrap().remove(0);
    let one_device = dir.join("one-device.mpk");
    in_one_process("gpt-one-device", ["1", "1", "1"], &one_device);
    let reference = load_gpt(&one_device, &device);
    let two: &[&str] = &["--devices", "2"];
    let one: &[&str] = &[];
    for (name, nodes, layout, per_node) in [
        ("gpt-2x2x2", [two, two, two, two], ["2", "2", "2"], 2),
        ("gpt-1x2x2", [one, one, one, one], ["1", "2", "2"], 1),
    ] {
        let (across, alone) = (
            dir.join(format!("{name}-across.mpk")),
            dir.join(format!("{name}-alone.mpk")),
        );
        let flags = gpt_flags(&across, STEPS);
        let flags: Vec<&str> = ["--pp", layout[1], "--tp", layout[2]]
            .into_iter()
            .chain(flags.iter().map(String::as_str))
            .collect();
        let (out, procs) = run_to_end(name, &nodes, &flags);
        let world = 4 * per_node;
        assert!(
            out.contains(&format!(
                "world assembled: {world} rank(s) over 5 process(es)"
            )),
            "{out}"
        );
        assert!(out.contains(".tensor_parallel(2) .cluster(..)"), "{out}");
        // Really distributed: every rank of the mesh trained every step in a node process.
        let ranks = ranks_trained(&procs, per_node, STEPS);
        assert_eq!(ranks, (0..world as u32).collect::<Vec<_>>(), "{name}");
        in_one_process(&format!("{name}-alone"), layout, &alone);
        let (trained, single) = (load_gpt(&across, &device), load_gpt(&alone, &device));
        assert!(
            parameter_bits(&trained) == parameter_bits(&single),
            "{name}: across processes, bitwise the same layout in one process"
        );
        let worst = compare_parameters(&trained, &reference, TOLERANCE)
            .unwrap_or_else(|e| panic!("{name} across processes differs from one device: {e}"));
        println!("{name} across processes, worst relative difference to one device: {worst:e}");
    }
    let _ = std::fs::remove_dir_all(dir.path());
}
