//! The command line as a careful user meets it: flag values no job can run with, checkpoint
//! directories that cannot be used, and resuming from nothing end with a clear message and a
//! failing exit code (never a panic), before any training; the cases that are not errors say
//! what they did.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use meshwork::testing::TempDir;

/// Runs `meshwork` with `args`, killed if it has not ended within two minutes.
pub(crate) fn meshwork(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_meshwork"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the meshwork binary starts");
    let start = Instant::now();
    while child.try_wait().expect("the child's status").is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let out = child.wait_with_output().expect("the killed child's output");
            panic!(
                "meshwork {args:?} did not end within 2 minutes; stdout:\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("the child's output")
}

/// What a run printed: (exit code, stdout, stderr).
pub(crate) fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let out = meshwork(args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a refused run: exit code 1, `error: …` naming `expected` on stderr, no panic, and
/// no training (no step was reported).
pub(crate) fn assert_refused(args: &[&str], expected: &str) {
    let (code, stdout, stderr) = run(args);
    assert_eq!(
        code,
        Some(1),
        "meshwork {args:?} should fail with exit code 1; stderr:\n{stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "meshwork {args:?} panicked:\n{stderr}"
    );
    assert!(
        stderr.contains("error: ") && stderr.contains(expected),
        "meshwork {args:?}: stderr should name {expected:?}:\n{stderr}"
    );
    assert!(
        !stdout.contains("samples/s"),
        "meshwork {args:?} trained before refusing:\n{stdout}"
    );
}

/// A fresh scratch directory for one test (made; removed when dropped).
pub(crate) fn scratch(name: &str) -> TempDir {
    let dir = TempDir::new(&format!("cli-{name}"));
    std::fs::create_dir_all(dir.path()).expect("a scratch directory");
    dir
}

pub(crate) fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}

#[test]
fn zero_sizes_are_refused_naming_the_flag() {
    for (flag, value) in [
        ("--dp", "0"),
        ("--pp", "0"),
        ("--batch-size", "0"),
        ("--hidden", "0"),
        ("--micro-batches", "0"),
        ("--virtual-stages", "0"),
    ] {
        assert_refused(
            &["train", "--steps", "2", flag, value],
            &format!("{flag} 0"),
        );
    }
    // A pipeline job too (the --dp 0 panic was in the code that counts devices).
    assert_refused(
        &["train", "--steps", "2", "--dp", "0", "--pp", "2"],
        "--dp 0",
    );
}

#[test]
fn other_impossible_values_are_refused_naming_the_flag() {
    assert_refused(&["train", "--steps", "2", "--lr=-1"], "--lr -1");
    assert_refused(&["train", "--steps", "2", "--lr", "NaN"], "--lr NaN");
    assert_refused(
        &["train", "--steps", "2", "--collective-timeout", "0"],
        "--collective-timeout 0",
    );
    assert_refused(
        &["train", "--steps", "2", "--on-replica-loss", "retry"],
        "--on-replica-loss retry",
    );
    assert_refused(
        &["train", "--steps", "2", "--pp", "2", "--schedule", "zigzag"],
        "--schedule zigzag",
    );
    assert_refused(&["train", "--steps", "2", "--resume"], "--resume needs");
    assert_refused(
        &["train", "--steps", "2", "--checkpoint-every", "2"],
        "--checkpoint-every needs",
    );
    let dir = scratch("every-zero");
    assert_refused(
        &[
            "train",
            "--steps",
            "2",
            "--checkpoint-dir",
            path(dir.path()),
            "--checkpoint-every",
            "0",
        ],
        "--checkpoint-every 0",
    );
    let _ = std::fs::remove_dir_all(dir.path());
    // A fault plan that is not there names the file.
    assert_refused(
        &[
            "train",
            "--steps",
            "2",
            "--faults",
            "/nonexistent/plan.json",
        ],
        "/nonexistent/plan.json",
    );
}

/// CKPT-7 from the command line: a checkpoint directory that cannot be created is refused
/// before training, for data-parallel and pipeline jobs, with the path in the message.
#[test]
fn ckpt_7_a_checkpoint_dir_that_cannot_be_created_is_refused_before_training() {
    let dir = scratch("not-a-dir");
    // Under a regular file no directory can be created (this holds for root too).
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a directory").expect("a file");
    let target = file.join("checkpoints");
    for pipeline in [&[][..], &["--pp", "2"][..]] {
        let mut args = vec![
            "train",
            "--dp",
            "1",
            "--steps",
            "3",
            "--checkpoint-dir",
            path(&target),
        ];
        args.extend_from_slice(pipeline);
        assert_refused(&args, "checkpoints cannot be written under");
        assert_refused(&args, path(&target));
    }
    let _ = std::fs::remove_dir_all(dir.path());
}

#[test]
fn resume_from_an_empty_or_missing_directory_says_so_and_starts_from_scratch() {
    let root = scratch("resume-empty");
    let missing = root.join("never-made");
    for dir in [root.path(), missing.as_path()] {
        let (code, stdout, stderr) = run(&[
            "train",
            "--dp",
            "2",
            "--steps",
            "2",
            "--checkpoint-dir",
            path(dir),
            "--resume",
        ]);
        assert_eq!(code, Some(0), "stderr:\n{stderr}");
        assert!(
            stdout.contains(&format!("no checkpoint to resume from in {}", path(dir)))
                && stdout.contains("starting from scratch"),
            "the run should say it found no checkpoint:\n{stdout}"
        );
        assert!(
            stdout.contains("\n2 steps, ") && stdout.contains("samples/s"),
            "it trained two steps from step 0:\n{stdout}"
        );
        assert!(!stdout.contains("resumed after"), "{stdout}");
        // And it wrote the checkpoint of its end, which the next --resume starts from.
        let (code, stdout, stderr) = run(&[
            "train",
            "--dp",
            "2",
            "--steps",
            "3",
            "--checkpoint-dir",
            path(dir),
            "--resume",
            "--require-checkpoint",
        ]);
        assert_eq!(code, Some(0), "stderr:\n{stderr}");
        assert!(
            stdout.contains("resumed after step 2"),
            "the second run resumes from the first one's checkpoint:\n{stdout}"
        );
    }
    let _ = std::fs::remove_dir_all(root.path());
}

#[test]
fn require_checkpoint_makes_resuming_from_nothing_an_error() {
    let root = scratch("resume-required");
    for pipeline in [&[][..], &["--pp", "2"][..]] {
        let mut args = vec![
            "train",
            "--dp",
            "1",
            "--steps",
            "2",
            "--checkpoint-dir",
            path(root.path()),
            "--resume",
            "--require-checkpoint",
        ];
        args.extend_from_slice(pipeline);
        assert_refused(
            &args,
            &format!("no checkpoint to resume from in {}", path(root.path())),
        );
    }
    // The flag means nothing without --resume: clap refuses it (exit code 2, usage).
    let (code, _, stderr) = run(&["train", "--require-checkpoint"]);
    assert_eq!(code, Some(2), "stderr:\n{stderr}");
    assert!(stderr.contains("--resume"), "stderr:\n{stderr}");
    // A directory that does not exist is not made for a required checkpoint.
    let missing = root.join("never-made");
    assert_refused(
        &[
            "train",
            "--steps",
            "2",
            "--checkpoint-dir",
            path(&missing),
            "--resume",
            "--require-checkpoint",
        ],
        "no checkpoint to resume from",
    );
    assert!(!missing.exists());
    let _ = std::fs::remove_dir_all(root.path());
}

/// `--zero 3 --recompute` trains the demo MLP as blocks, in bf16, and saves it.
#[test]
fn zero_3_with_recompute_in_bf16_trains_blocks_and_saves_the_model() {
    let dir = scratch("zero-3");
    std::fs::create_dir_all(dir.path()).expect("scratch dir");
    let model = dir.join("model.mpk");
    let (code, stdout, stderr) = run(&[
        "train",
        "--zero",
        "3",
        "--precision",
        "bf16",
        "--recompute",
        "--dp",
        "2",
        "--steps",
        "3",
        "--batch-size",
        "16",
        "--hidden",
        "16",
        "--save-model",
        path(&model),
    ]);
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    assert!(stdout.contains("model written to"), "stdout:\n{stdout}");
    assert!(model.exists());
    let _ = std::fs::remove_dir_all(dir.path());
}

#[test]
fn a_pipeline_job_writes_its_checkpoints_and_resumes_from_them() {
    let dir = scratch("pipeline-checkpoints");
    let common = [
        "train",
        "--dp",
        "1",
        "--pp",
        "2",
        "--checkpoint-dir",
        path(dir.path()),
    ];
    let (code, stdout, stderr) = run(&[&common[..], &["--steps", "2"]].concat());
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    assert!(
        stdout.contains("checkpoint after step 2 written"),
        "stdout:\n{stdout}"
    );
    let (code, stdout, stderr) = run(&[&common[..], &["--steps", "3", "--resume"]].concat());
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    assert!(stdout.contains("resumed after step 2"), "stdout:\n{stdout}");
    let _ = std::fs::remove_dir_all(dir.path());
}

#[test]
fn bench_gpt_trains_each_size_and_dp_and_reports_rate_loss_and_flops() {
    let (code, stdout, stderr) = run(&[
        "bench", "gpt", "--sizes", "small", "--dp", "1,2", "--steps", "4", "--json",
    ]);
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for (row, dp) in rows.iter().zip([1, 2]) {
        assert_eq!(row["dp"], dp);
        assert_eq!(row["steps"], 4);
        assert_eq!(row["size"]["d_model"], 64);
        let number = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("{k} in {row}"));
        assert!(number("meshwork_windows_per_s") > 0.0, "{row}");
        // The untrained model's loss is about ln(vocab) = 4.4 nats; four steps move it.
        let loss = number("meshwork_validation_loss");
        assert!(loss > 1.0 && loss < 5.0, "{row}");
        assert!(number("achieved_gflops_per_core") > 0.0, "{row}");
        assert!(number("matmul_gflops_per_core") > 0.0, "{row}");
        assert!(row["pytorch_windows_per_s"].is_null(), "no --pytorch");
    }
    let (code, _, stderr) = run(&["bench", "gpt", "--sizes", "huge"]);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("\"huge\" is not small or large"),
        "{stderr}"
    );
}

#[test]
fn bench_tensor_reports_megatron_s_all_reduce_bytes_as_json() {
    let dir = scratch("bench-tensor");
    let svg = dir.join("split.svg");
    let (code, stdout, stderr) = run(&[
        "bench",
        "tensor",
        "--tp",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--seq",
        "8",
        "--batch",
        "4",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--json",
        "--svg",
        path(&svg),
    ]);
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    let line = stdout.lines().last().expect("one JSON line");
    let f: serde_json::Value = serde_json::from_str(line).expect("the line is JSON");
    for key in [
        "tp",
        "samples_per_s",
        "baseline_samples_per_s",
        "allreduce_bytes_per_layer",
        "expected_allreduce_bytes_per_layer",
        "comm_share",
        "speedup",
    ] {
        assert!(f.get(key).is_some(), "{key} missing from {line}");
    }
    assert_eq!(f["tp"], 2);
    // Megatron: 2 forward + 2 backward all-reduces of b·s·h f32 values per layer.
    let expected = 4 * 4 * 8 * 64 * 4;
    assert_eq!(f["expected_allreduce_bytes_per_layer"], expected);
    assert_eq!(
        f["allreduce_bytes_per_layer"], f["expected_allreduce_bytes_per_layer"],
        "{line}"
    );
    assert_eq!(f["bytes_as_expected"], true);
    assert_eq!(f["allreduces_per_layer"], 4.0);
    // The same layer trained two ways: the losses agree (f32 summation order only).
    let diff = f["loss_max_rel_diff"].as_f64().expect("a number");
    assert!(diff < 1e-5, "{line}");
    let picture = std::fs::read_to_string(&svg).expect("the picture was written");
    assert!(picture.starts_with("<svg") && picture.contains("all-reduce"));
    let _ = std::fs::remove_dir_all(dir.path());
}

#[test]
fn bench_tensor_over_a_mesh_reports_bytes_per_rank_against_the_zero_formula() {
    // The recipe's model over dp 2 × pp 2 × tp 2 with ZeRO-1 in f32, against one device.
    let (code, stdout, stderr) = run(&[
        "bench",
        "tensor",
        "--dp",
        "2",
        "--pp",
        "2",
        "--tp",
        "2",
        "--zero",
        "1",
        "--layers",
        "1",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--seq",
        "8",
        "--batch",
        "8",
        "--micro-batches",
        "2",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--json",
    ]);
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    let line = stdout.lines().last().expect("one JSON line");
    let f: serde_json::Value = serde_json::from_str(line).expect("the line is JSON");
    let num = |key: &str| f[key].as_f64().unwrap_or_else(|| panic!("{key} in {line}"));
    assert!(num("samples_per_s") > 0.0 && num("one_device_samples_per_s") > 0.0);
    // The fullest rank holds its stage's tp slices: less than half the model.
    assert!(num("rank_elements") * 2.0 < num("elements"), "{line}");
    // f32 parameters and gradients whole on the rank (ZeRO-1), Adam's moments over dp 2:
    // the formula's bytes for the rank's own elements, exactly.
    assert_eq!(num("param_bytes"), num("formula_param_bytes"), "{line}");
    assert_eq!(num("grad_bytes"), num("formula_grad_bytes"), "{line}");
    let optim = num("optim_bytes") / num("formula_optim_bytes");
    assert!((0.99..1.01).contains(&optim), "{line}");
    // The same model trained two ways (f32): the losses agree.
    assert!(num("loss_max_rel_diff") < 1e-5, "{line}");
}

#[test]
fn bench_comm_efficiency_prints_one_json_line_per_method_and_draws_the_curves() {
    let dir = scratch("bench-comm");
    let svg = dir.join("comm.svg");
    let (code, stdout, stderr) = run(&[
        "bench",
        "comm-efficiency",
        "--steps",
        "8",
        "--hidden",
        "16",
        "--batch-size",
        "16",
        "--slow-rank-batch-size",
        "64",
        "--methods",
        "bf16,bf16-narrow,local-sgd,ssp-2,backup",
        "--json",
        "--svg",
        path(&svg),
    ]);
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let methods: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| {
            (
                l["scenario"].as_str().expect("a scenario"),
                l["method"].as_str().expect("a method"),
            )
        })
        .collect();
    assert_eq!(
        methods,
        [
            ("slow-links", "sync"),
            ("slow-links", "bf16"),
            ("slow-links", "bf16-narrow"),
            ("slow-links", "local-sgd"),
            ("slow-rank", "sync"),
            ("slow-rank", "ssp-2"),
            ("slow-rank", "backup"),
        ]
    );
    for l in &lines {
        for key in [
            "method",
            "time_to_target_s",
            "steps_to_target",
            "bytes_per_rank",
            "final_loss",
        ] {
            assert!(l.get(key).is_some(), "{key} missing from {l}");
        }
        assert!(l["final_loss"].as_f64().expect("a loss").is_finite(), "{l}");
    }
    // bf16 sends no more than sync (its final values as 2 bytes, its partial sums as 4: at
    // these small sizes the tree sends partial sums only); with 16-bit partial sums every
    // value travels as 2 bytes (COMM-9).
    let bytes = |m: &str| {
        lines
            .iter()
            .find(|l| l["method"] == m)
            .and_then(|l| l["bytes_per_rank"].as_u64())
            .expect("bytes")
    };
    assert!(bytes("bf16") <= bytes("sync"), "{stdout}");
    assert!(bytes("bf16-narrow") < bytes("bf16"), "{stdout}");
    let picture = std::fs::read_to_string(&svg).expect("the picture was written");
    assert!(picture.starts_with("<svg") && picture.contains("polyline"));
    let _ = std::fs::remove_dir_all(dir.path());
}

/// The strategy flags reach the job: each one run alone trains and shows in the plan the
/// CLI prints (`plan: …`, what `JobBuilder::plan` read from the builder), and a combination
/// the library's table refuses fails naming both settings.
#[test]
fn the_strategy_flags_reach_the_job_and_the_table_refuses_what_does_not_combine() {
    let common = [
        "train",
        "--dp",
        "2",
        "--steps",
        "4",
        "--batch-size",
        "16",
        "--hidden",
        "16",
    ];
    for (flags, shown) in [
        (&["--clip", "1.0"][..], ".clip_grad_norm(1)"),
        (&["--accumulate", "2"][..], ".gradient_accumulation(2)"),
        (&["--compression", "topk:0.5"][..], ".compression(topk:0.5)"),
        (
            &["--local-updates", "local-sgd:2"][..],
            ".local_updates(local-sgd:2)",
        ),
        (
            &["--parameter-server", "--staleness", "ssp:1"][..],
            ".parameter_server(ssp:1)",
        ),
        (&["--backup-workers", "1"][..], ".backup_workers(1)"),
    ] {
        let args: Vec<&str> = common.iter().chain(flags).copied().collect();
        let (code, stdout, stderr) = run(&args);
        assert_eq!(code, Some(0), "{flags:?}: stderr:\n{stderr}");
        let plan = stdout
            .lines()
            .find(|l| l.starts_with("plan: "))
            .unwrap_or_else(|| panic!("{flags:?}: no plan line:\n{stdout}"));
        assert!(plan.contains(shown), "{flags:?}: {plan}");
    }
    // The schedule: trains, and a warm-up as long as the run is refused naming the flag.
    let args: Vec<&str> = common
        .iter()
        .chain(&["--lr-schedule", "warmup-cosine:2"])
        .copied()
        .collect();
    let (code, _, stderr) = run(&args);
    assert_eq!(code, Some(0), "stderr:\n{stderr}");
    assert_refused(
        &["train", "--steps", "4", "--lr-schedule", "warmup-cosine:4"],
        "--lr-schedule",
    );
    assert_refused(&["train", "--lr-schedule", "linear"], "--lr-schedule");
    assert_refused(&["train", "--clip", "0"], "--clip 0");
    assert_refused(&["train", "--accumulate", "0"], "--accumulate 0");
    assert_refused(
        &[
            "train",
            "--compression",
            "bf16",
            "--local-updates",
            "local-sgd:2",
        ],
        ".compression(bf16) with .local_updates(local-sgd:2) together",
    );
}
