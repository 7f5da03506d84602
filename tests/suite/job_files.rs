//! A job as a file (issue 51, CONF-1/2): the library reads the description a builder writes
//! and trains the same job bitwise; `meshwork train --print-config` writes what `--config`
//! runs unchanged; `meshwork plan --emit-config` writes a layout `train` runs; bad files are
//! refused naming the key.

use burn::optim::AdamConfig;
use meshwork::demo::{Mlp, Sample, TeacherTask, mse_loss};
use meshwork::job::{Job, JobBuilder, JobConfig};
use meshwork::parallel::zero::ZeroStage;
use meshwork::testing::{draw_lock, parameter_bits};

use crate::cli::{assert_refused, path, run, scratch};

fn task() -> TeacherTask {
    TeacherTask {
        d_in: 8,
        d_out: 2,
        noise: 0.1,
        seed: 4,
    }
}

/// A data-parallel job of the demo MLP with the data and devices a file cannot hold.
fn job_of(builder: JobBuilder<Mlp, Sample>) -> JobBuilder<Mlp, Sample> {
    let model = {
        // Burn's generator is the process's: no other test draws between the seed and the draw.
        let _draw = draw_lock();
        let device = burn::tensor::Device::flex();
        device.seed(9);
        Mlp::new(&[8, 16, 2], &device)
    };
    builder
        .initial_model(model)
        .loss(mse_loss)
        .data(task().dataset(256))
}

fn train(builder: JobBuilder<Mlp, Sample>) -> Vec<Vec<u32>> {
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let trained = rt
        .block_on(async {
            let handle = builder.build()?.spawn().await?;
            handle.join().await
        })
        .expect("the job trains");
    assert_eq!(trained.summary.steps, 6, "every step ran");
    parameter_bits(&trained.model)
}

/// CONF-1: a builder's settings written as TOML and read back by another builder train the
/// same job, bitwise, and the description names the strategies (dp 2, ZeRO-1, clipping,
/// accumulation, Adam): not a one-device fallback.
#[test]
fn conf_1_a_description_read_from_toml_trains_the_job_its_setters_built() {
    let by_setters = job_of(Job::builder())
        .data_parallel(2)
        .zero(ZeroStage::One)
        .clip_grad_norm(0.5)
        .gradient_accumulation(2)
        .optimizer(AdamConfig::new().with_beta_1(0.8))
        .learning_rate(0.01)
        .batch_size(32)
        .steps(6)
        .seed(3);
    let text = by_setters.config().to_toml().expect("writes");
    assert!(text.contains("data_parallel = 2"), "{text}");
    assert!(text.contains("zero = \"One\""), "{text}");
    assert!(text.contains("beta_1 = 0.8"), "{text}");
    let read = JobConfig::from_toml(&text).expect("reads back");
    assert_eq!(&read, by_setters.config());
    let from_file = job_of(Job::builder()).with_config(read);
    let plan = from_file.plan().to_string();
    assert!(
        plan.contains(".zero(One)") && plan.contains(".clip_grad_norm(0.5)"),
        "{plan}"
    );
    let (a, b) = (train(by_setters), train(from_file));
    assert!(a == b, "the file's job equals the setters' bitwise");
}

/// CONF-2: a combination the refusal table refuses is refused when read from a file as from
/// the setters, naming both settings.
#[test]
fn conf_2_a_refused_combination_in_a_file_is_refused_by_build() {
    let config = JobConfig::from_toml(
        "batch_size = 32\n[reduction]\ncompression = { TopK = { fraction = 0.5 } }\n\
         local_updates = { LocalSgd = { every = 2 } }\n",
    )
    .expect("reads");
    let Err(e) = job_of(Job::builder()).with_config(config).build() else {
        panic!("the table refuses top-k with local updates");
    };
    let message = e.to_string();
    assert!(
        message.contains(".compression(topk:0.5)") && message.contains(".local_updates("),
        "{message}"
    );
}

/// The recipe chapter's job (`book/snippets/recipe.toml`) is what its command line prints,
/// and runs from the file.
#[test]
fn the_books_recipe_file_is_what_its_flags_print_and_runs_unchanged() {
    let recipe = [
        "train",
        "--model",
        "gpt",
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
        "warmup-cosine",
        "--steps",
        "20",
        "--print-config",
    ];
    let (code, printed, stderr) = run(&recipe);
    assert_eq!(code, Some(0), "{stderr}");
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/book/snippets/recipe.toml");
    let shipped = std::fs::read_to_string(file).expect("the book's recipe file");
    assert_eq!(
        printed,
        shipped,
        "book/snippets/recipe.toml is stale: write it with `meshwork {}`",
        recipe.join(" ")
    );
    let (code, again, stderr) = run(&["train", "--config", file, "--print-config"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(again, shipped, "the file reads back as itself");
    // The file's job trains (shortened with a flag, which overrides its key), exactly as
    // its flags do.
    let (code, from_file, stderr) = run(&["train", "--config", file, "--steps", "4"]);
    assert_eq!(code, Some(0), "{stderr}");
    let mut flags: Vec<&str> = recipe[..recipe.len() - 5].to_vec();
    flags.extend(["--steps", "4", "--lr-schedule", "warmup-cosine:2"]);
    let (code, from_flags, stderr) = run(&flags);
    assert_eq!(code, Some(0), "{stderr}");
    let result = |out: &str| -> String {
        out.lines()
            .filter(|l| l.starts_with("plan: ") || l.starts_with("training loss"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        result(&from_file).contains("training loss")
            && result(&from_file).contains(".tensor_parallel(2)"),
        "{from_file}"
    );
    assert_eq!(result(&from_file), result(&from_flags));
}

/// `plan --emit-config` writes the fastest layout that fits as a file `train --config` runs
/// unchanged (and prints back as itself).
#[test]
fn plan_emit_config_writes_a_layout_train_runs_unchanged() {
    let dir = scratch("emit-config");
    let file = dir.path().join("layout.toml");
    let (code, _, stderr) = run(&[
        "plan",
        "--model",
        "gpt",
        "--devices",
        "2",
        "--batch",
        "8",
        "--steps",
        "3",
        "--emit-config",
        path(&file),
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let emitted = std::fs::read_to_string(&file).expect("the emitted file");
    assert!(
        emitted.contains("[model]") && emitted.contains("steps = 3"),
        "{emitted}"
    );
    let (code, printed, stderr) = run(&["train", "--config", path(&file), "--print-config"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(printed, emitted, "train reads the emitted layout as it is");
    let (code, out, stderr) = run(&["train", "--config", path(&file)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(out.contains("3 steps"), "{out}");
}

/// A file names only what it changes: the keys it leaves out keep `meshwork train`'s defaults
/// (Adam, 120 s), a flag overrides one key and keeps the rest of its section, and a JSON file
/// written by `JobConfig::to_json` (its settings that are off are `null`) runs.
#[test]
fn a_file_changes_only_its_keys_and_json_files_run() {
    let dir = scratch("partial-config");
    let file = dir.path().join("short.toml");
    std::fs::write(
        &file,
        "steps = 3\nbatch_size = 16\n[fault_tolerance.recovery]\nmax_restarts = 7\n",
    )
    .expect("writes");
    let (code, printed, stderr) = run(&[
        "train",
        "--config",
        path(&file),
        "--on-replica-loss",
        "shrink",
        "--print-config",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let c = JobConfig::from_toml(printed.split("\n[model]").next().unwrap_or_default())
        .expect("the printed description reads");
    assert_eq!(c.steps, 3);
    assert_eq!(c.optimizer, AdamConfig::new().into());
    assert_eq!(c.step_timeout, std::time::Duration::from_secs(120));
    let r = c.fault_tolerance.recovery;
    assert_eq!(r.max_restarts, 7, "the flag kept the file's limit");
    assert_eq!(r.on_replica_loss, meshwork::recovery::OnReplicaLoss::Shrink);
    let json = dir.path().join("job.json");
    std::fs::write(&json, c.to_json().expect("writes")).expect("writes");
    let (code, out, stderr) = run(&["train", "--config", path(&json)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(out.contains("3 steps"), "{out}");
}

/// CONF-2 on the command line: an unknown key, a value of the wrong type, a bad value, a
/// refused combination and a file that is not TOML end with an error naming the key (or the
/// combination), before any training.
#[test]
fn conf_2_bad_files_are_refused_naming_the_key() {
    let dir = scratch("bad-configs");
    for (name, text, expected) in [
        (
            "unknown.toml",
            "[reduction]\nzeroo = \"One\"\n",
            "key `reduction.zeroo`: unknown field `zeroo`, expected one of `zero`",
        ),
        (
            "type.toml",
            "steps = \"many\"\n",
            "key `steps`: invalid type: string \"many\"",
        ),
        (
            "value.toml",
            "[precision]\ncompute = \"F8\"\n",
            "key `precision.compute`: unknown variant `F8`, expected one of `F32`, `Bf16`, `F16`",
        ),
        (
            "model.toml",
            "[model]\nwidth = 3\n",
            "key `model.width`: unknown field `width`",
        ),
        ("syntax.toml", "steps = \n", "not valid TOML"),
        (
            "refused.toml",
            "batch_size = 16\n[reduction]\ncompression = { TopK = { fraction = 0.5 } }\n\
             local_updates = { LocalSgd = { every = 2 } }\n",
            ".compression(topk:0.5) with .local_updates(local-sgd:2) together",
        ),
        (
            "duration.json",
            "{\"step_timeout\": \"soon\"}",
            "key `step_timeout`",
        ),
    ] {
        let file = dir.path().join(name);
        std::fs::write(&file, text).expect("writes");
        assert_refused(
            &["train", "--config", path(&file), "--steps", "2"],
            expected,
        );
    }
    assert_refused(
        &["train", "--config", "/nonexistent/job.toml"],
        "/nonexistent/job.toml",
    );
}
