//! `meshwork train --config FILE` and `--print-config`: a job as a file.
//!
//! The file is a [`JobConfig`] (TOML, or JSON for a `.json` name) with one more table,
//! `[model]`, naming the demo model and its size (what the model flags say). Reading it fills
//! every flag the command line did not give from the key the file has ([`apply`]); the flags
//! given override their keys; the job then runs from the description the flags and the file
//! make together ([`crate::settings::job_config`]), which `--print-config` writes out.

use std::path::Path;

use meshwork::device::BackendKind;
use meshwork::error::Error;
use meshwork::job_config::{ConfigError, ConfigFormat, JobConfig, LrSchedule};
use meshwork::parallel::pipeline::Schedule;
use serde::{Deserialize, Serialize};

use crate::train::TrainArgs;

/// The `[model]` table: the model flags of `meshwork train`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct ModelSection {
    /// `mlp` or `gpt` (`--model`).
    pub(crate) kind: Option<String>,
    /// The devices' backend (`--device`).
    pub(crate) device: Option<BackendKind>,
    /// The MLP's hidden width (`--hidden`).
    pub(crate) hidden: Option<usize>,
    /// The GPT's layers (`--layers`).
    pub(crate) layers: Option<usize>,
    /// The GPT's features per character (`--d-model`).
    pub(crate) d_model: Option<usize>,
    /// The GPT's attention heads (`--heads`).
    pub(crate) heads: Option<usize>,
    /// The GPT's characters of context (`--context`).
    pub(crate) context: Option<usize>,
}

impl ModelSection {
    /// The model the flags name.
    pub(crate) fn of(args: &TrainArgs) -> Self {
        let gpt = args.model == "gpt";
        Self {
            kind: Some(args.model.clone()),
            device: Some(args.device),
            hidden: (!gpt).then_some(args.hidden),
            layers: gpt.then_some(args.layers),
            d_model: gpt.then_some(args.d_model),
            heads: gpt.then_some(args.heads),
            context: gpt.then_some(args.context),
        }
    }
}

/// Why a file cannot be the job: the file named, then the key.
fn bad(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::InvalidConfig(format!("--config {}: {e}", path.display()))
}

/// Reads `args.config` (if given) and fills every flag the command line did not give from the
/// file's key; the file's whole description becomes the base the flags go over.
pub(crate) fn apply(args: &mut TrainArgs) -> meshwork::error::Result<()> {
    let Some(path) = args.config.clone() else {
        return Ok(());
    };
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let mut table: toml::Table = match ConfigFormat::of(&path) {
        ConfigFormat::Toml => toml::from_str(&text).map_err(|e| {
            bad(
                &path,
                ConfigError::Syntax {
                    format: "TOML",
                    reason: e.to_string(),
                },
            )
        })?,
        ConfigFormat::Json => {
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                bad(
                    &path,
                    ConfigError::Syntax {
                        format: "JSON",
                        reason: e.to_string(),
                    },
                )
            })?;
            toml::Table::try_from(without_nulls(json)).map_err(|e| bad(&path, e))?
        }
    };
    let model = match table.remove("model") {
        Some(m) => serde_path_to_error::deserialize::<_, ModelSection>(m).map_err(|e| {
            bad(
                &path,
                ConfigError::Key {
                    key: format!("model.{}", e.path()),
                    reason: e.into_inner().to_string(),
                },
            )
        })?,
        None => ModelSection::default(),
    };
    let has = |keys: &[&str]| {
        let mut at = Some(&table);
        for (i, k) in keys.iter().enumerate() {
            let value = at.and_then(|t| t.get(*k));
            if i + 1 == keys.len() {
                return value.is_some();
            }
            at = value.and_then(toml::Value::as_table);
        }
        false
    };
    let presence = Presence {
        keys: [
            ("seed", has(&["seed"])),
            ("steps", has(&["steps"])),
            ("batch_size", has(&["batch_size"])),
            ("data_parallel", has(&["data_parallel"])),
            ("tensor_parallel", has(&["tensor_parallel"])),
            ("pipeline", has(&["pipeline"])),
            ("accumulation", has(&["accumulation"])),
            ("recompute", has(&["recompute"])),
            ("zero", has(&["reduction", "zero"])),
            ("checkpoint_dir", has(&["checkpoints", "dir"])),
            ("resume", has(&["checkpoints", "resume"])),
            ("require", has(&["checkpoints", "require"])),
            ("learning_rate", has(&["learning_rate"])),
            ("lr_schedule", has(&["lr_schedule"])),
            ("collective_timeout", has(&["comm", "timeout"])),
            ("step_timeout", has(&["step_timeout"])),
        ]
        .into_iter()
        .filter(|(_, there)| *there)
        .map(|(k, _)| k)
        .collect(),
    };
    // A key the file leaves out keeps `meshwork train`'s default, as its flag would.
    let mut merged = toml::Table::try_from(crate::settings::cli_defaults())
        .map_err(|e| bad(&path, ConfigError::Write(e.to_string())))?;
    merge(&mut merged, table, "");
    let job =
        JobConfig::from_deserializer(toml::Value::Table(merged)).map_err(|e| bad(&path, e))?;
    fill(args, &model, &job, &presence)?;
    args.file = Some(job);
    Ok(())
}

/// The sections of a description that are tables of settings (merged key by key); any other
/// table is one value (an enumeration's variant, a fault plan) and replaces the default.
const SECTIONS: [&str; 7] = [
    "checkpoints",
    "comm",
    "fault_tolerance",
    "fault_tolerance.recovery",
    "precision",
    "precision.loss_scaler",
    "reduction",
];

/// `file` over `base`: each section's keys over the default's.
fn merge(base: &mut toml::Table, file: toml::Table, prefix: &str) {
    for (key, value) in file {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(f))
                if SECTIONS.contains(&path.as_str()) =>
            {
                merge(b, f, &path)
            }
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// A JSON file as TOML holds it: a `null` (a setting that is off, as `to_json` writes it) is
/// a key left out.
fn without_nulls(json: serde_json::Value) -> serde_json::Value {
    match json {
        serde_json::Value::Object(map) => serde_json::Value::Object(
            map.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.into_iter().map(without_nulls).collect())
        }
        other => other,
    }
}

/// The job keys a file states (a key left out keeps the flag's default).
struct Presence {
    keys: Vec<&'static str>,
}

/// Every flag the command line did not give, from the file: the model's, and the job's that
/// the flow of `meshwork train` reads to shape the job (the others reach the job through the
/// file's description itself).
fn fill(
    args: &mut TrainArgs,
    model: &ModelSection,
    job: &JobConfig,
    presence: &Presence,
) -> meshwork::error::Result<()> {
    let open = |flag: &str| !args.given.contains(flag);
    let stated = |key: &str| presence.keys.contains(&key);
    macro_rules! take {
        ($flag:literal, $field:ident, $value:expr) => {
            if open($flag) {
                if let Some(v) = $value {
                    args.$field = v;
                }
            }
        };
    }
    take!("model", model, model.kind.clone());
    take!("device", device, model.device);
    take!("hidden", hidden, model.hidden);
    take!("layers", layers, model.layers);
    take!("d_model", d_model, model.d_model);
    take!("heads", heads, model.heads);
    take!("context", context, model.context);
    take!("seed", seed, stated("seed").then_some(job.seed));
    take!("steps", steps, stated("steps").then_some(job.steps));
    take!(
        "batch_size",
        batch_size,
        stated("batch_size").then_some(job.batch_size)
    );
    take!(
        "dp",
        dp,
        stated("data_parallel").then_some(Some(job.data_parallel))
    );
    take!(
        "tp",
        tp,
        stated("tensor_parallel").then_some(job.tensor_parallel)
    );
    take!(
        "accumulate",
        accumulate,
        stated("accumulation").then_some(job.accumulation)
    );
    take!(
        "recompute",
        recompute,
        stated("recompute").then_some(job.recompute)
    );
    take!(
        "zero",
        zero,
        stated("zero").then_some(job.reduction.zero.number())
    );
    take!(
        "checkpoint_dir",
        checkpoint_dir,
        stated("checkpoint_dir").then_some(job.checkpoints.dir.clone())
    );
    take!(
        "resume",
        resume,
        stated("resume").then_some(job.checkpoints.resume)
    );
    take!(
        "require_checkpoint",
        require_checkpoint,
        stated("require").then_some(job.checkpoints.require)
    );
    take!(
        "lr",
        lr,
        stated("learning_rate").then_some(job.learning_rate)
    );
    if open("lr_schedule") && stated("lr_schedule") {
        args.lr_schedule = match job.lr_schedule {
            LrSchedule::Constant => "constant".into(),
            LrSchedule::WarmupCosine { warmup, .. } => format!("warmup-cosine:{warmup}"),
            LrSchedule::Program => {
                return Err(Error::InvalidConfig(
                    "lr_schedule Program: meshwork train has no scheduler of its own; use \
                     Constant or WarmupCosine"
                        .into(),
                ));
            }
        };
    }
    if stated("pipeline") {
        match job.pipeline {
            Some(p) => {
                let (name, m, v) = match p.schedule {
                    Schedule::GPipe { micro_batches } => ("gpipe", micro_batches, 1),
                    Schedule::OneFOneB { micro_batches } => ("1f1b", micro_batches, 1),
                    Schedule::Interleaved {
                        micro_batches,
                        virtual_stages,
                    } => ("interleaved", micro_batches, virtual_stages),
                };
                take!("pp", pp, Some(p.stages));
                take!("schedule", schedule, Some(name.to_string()));
                take!("micro_batches", micro_batches, Some(m));
                take!("virtual_stages", virtual_stages, Some(v));
            }
            None => take!("pp", pp, Some(1)),
        }
    }
    take!(
        "collective_timeout",
        collective_timeout,
        stated("collective_timeout").then_some(job.comm.timeout.as_secs_f64())
    );
    take!(
        "step_timeout",
        step_timeout,
        stated("step_timeout").then_some(job.step_timeout.as_secs_f64())
    );
    Ok(())
}

/// A job as the file `--config` reads: the description, and the `[model]` table.
pub(crate) fn text(model: &ModelSection, job: &JobConfig) -> meshwork::error::Result<String> {
    #[derive(Serialize)]
    struct ModelTable<'a> {
        model: &'a ModelSection,
    }
    let write =
        |e: String| Error::InvalidConfig(format!("the job description: {}", ConfigError::Write(e)));
    let job = job.to_toml().map_err(|e| write(e.to_string()))?;
    let model = toml::to_string(&ModelTable { model }).map_err(|e| write(e.to_string()))?;
    Ok(format!("{job}\n{model}"))
}

/// `--print-config`: the job the command line describes, as a file `--config` reads back.
pub(crate) fn print(args: &TrainArgs, job: &JobConfig) -> meshwork::error::Result<()> {
    print!("{}", text(&ModelSection::of(args), job)?);
    Ok(())
}
