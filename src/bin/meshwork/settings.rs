//! What `meshwork train`'s flags set beyond the mesh: the flags checked before anything
//! starts, the default global batch fitted to the world, and the job description
//! ([`job_config`]) the flags (over a `--config` file's) make. Shared by the one-process job,
//! the GPT and a cluster's head.

use std::time::Duration;

use meshwork::error::Error;
use meshwork::faults::FaultPlan;
use meshwork::job_config::{JobConfig, LrSchedule, PipelineConfig};
use meshwork::parallel::parameter_server::ParameterServer;
use meshwork::parallel::zero::ZeroStage;
use meshwork::recovery::RecoveryPolicy;

use crate::train::TrainArgs;

impl TrainArgs {
    /// `--batch-size`, or the model's default `base` fitted to `unit` (replicas × each
    /// replica's micro-batches, [`fit_batch`]).
    pub(crate) fn global_batch(&self, base: usize, unit: usize) -> usize {
        self.batch_size.unwrap_or_else(|| fit_batch(base, unit))
    }

    /// Whether `--batch-size` was given (a default is fitted to the world; a given batch is
    /// the user's and refused if it does not divide).
    pub(crate) fn batch_given(&self) -> bool {
        self.batch_size.is_some()
    }

    /// Micro-batches each replica computes per step: a pipeline's schedule's, times the
    /// accumulation.
    pub(crate) fn micro_batches_per_replica(&self) -> usize {
        let schedule = if self.pp > 1 { self.micro_batches } else { 1 };
        (schedule.max(1) * self.accumulate.max(1)) as usize
    }

    /// How the first line of output states the global batch: the number, and when it is a
    /// fitted default, from what.
    pub(crate) fn batch_line(&self, base: usize, unit: usize) -> String {
        let batch = self.global_batch(base, unit);
        if self.batch_given() || batch == base {
            format!("global batch {batch}")
        } else {
            format!(
                "global batch {batch} (the default {base} rounded to a multiple of {unit} \
                 replica micro-batches; --batch-size sets it)"
            )
        }
    }
}

/// A default global batch for a world: `base` rounded to the nearest multiple of `unit`
/// (replicas × each replica's micro-batches), at least `unit`, so that a default works at
/// every size a launcher can start (`mpirun -n 3` has 3 replicas; 256 does not divide).
pub(crate) fn fit_batch(base: usize, unit: usize) -> usize {
    let unit = unit.max(1);
    ((base + unit / 2) / unit).max(1) * unit
}

/// The recovery policy `--on-replica-loss` names.
fn recovery_policy(args: &TrainArgs) -> meshwork::error::Result<RecoveryPolicy> {
    match args.on_replica_loss.as_str() {
        "fail" => Ok(RecoveryPolicy::default()),
        "shrink" => Ok(RecoveryPolicy::shrink()),
        "rollback" => Ok(RecoveryPolicy::roll_back()),
        "shrink-or-rollback" => Ok(RecoveryPolicy::shrink().or_roll_back()),
        other => Err(Error::InvalidConfig(format!(
            "--on-replica-loss {other}: fail, shrink, rollback or shrink-or-rollback"
        ))),
    }
}

/// `meshwork train`'s defaults beyond the library's: Adam at its flags' default rate, a
/// 120 s step time-out. A `--config` file's missing keys take these.
pub(crate) fn cli_defaults() -> JobConfig {
    JobConfig {
        optimizer: burn::optim::AdamConfig::new().into(),
        learning_rate: 3e-3,
        step_timeout: Duration::from_secs(120),
        ..JobConfig::default()
    }
}

/// What the flow of `meshwork train` decides beyond the flags: the replicas, the pipeline
/// the model is cut into, and the global batch (a default fitted to the world).
pub(crate) struct Shape {
    pub(crate) data_parallel: u32,
    pub(crate) pipeline: Option<PipelineConfig>,
    pub(crate) batch_size: usize,
}

/// The job description of a command line (CONF-1): the file's (`--config`), or `meshwork
/// train`'s defaults (Adam, a 120 s step time-out), with every flag the command line gave
/// over its key (every flag, without a file) and the flow's `shape`. `read_faults`: read
/// `--faults` (a process a launcher made a node takes the head's plan instead).
pub(crate) fn job_config(
    args: &TrainArgs,
    shape: Shape,
    read_faults: bool,
) -> meshwork::error::Result<JobConfig> {
    let given = |flag: &str| args.file.is_none() || args.given.contains(flag);
    let mut c = args.file.clone().unwrap_or_else(cli_defaults);
    // What the flow read (from the flags, which a file fills: `job_file::apply`).
    c.data_parallel = shape.data_parallel;
    c.pipeline = shape.pipeline;
    c.batch_size = Some(shape.batch_size);
    c.seed = args.seed;
    c.steps = args.steps;
    c.tensor_parallel = args.tp;
    c.accumulation = args.accumulate;
    c.recompute = args.recompute;
    c.reduction.zero = ZeroStage::from_number(args.zero).unwrap_or_default();
    if given("lr") {
        c.learning_rate = args.lr;
    }
    if given("lr_schedule") {
        c.lr_schedule = match warmup_steps(args)? {
            None => LrSchedule::Constant,
            Some(warmup) => LrSchedule::WarmupCosine {
                warmup: warmup as u64,
                total: None,
            },
        };
    }
    c.learning_rate()
        .map_err(|e| Error::InvalidConfig(format!("lr_schedule (--lr-schedule): {}", e.0)))?;
    if given("precision") {
        c.precision.compute = args.precision;
    }
    if given("low_precision_gradients") {
        c.precision.low_precision_gradients = args.low_precision_gradients;
    }
    if given("partial_sums") {
        c.comm.partial_sums = args.partial_sums;
    }
    if given("clip") {
        c.clip_norm = args.clip;
    }
    if given("compression") {
        c.reduction.compression = args.compression;
    }
    if given("local_updates") {
        c.reduction.local_updates = args.local_updates;
    }
    if given("algorithm") {
        c.comm.algorithm = args.algorithm;
    }
    if given("parameter_server") || given("staleness") {
        c.reduction.parameter_server = args
            .parameter_server
            .then(|| ParameterServer::new(args.staleness));
    }
    if given("backup_workers") {
        c.reduction.backup_workers = args.backup_workers;
    }
    if given("collective_timeout") {
        c.comm.timeout = Duration::from_secs_f64(args.collective_timeout);
    }
    if given("step_timeout") {
        c.step_timeout = Duration::from_secs_f64(args.step_timeout);
    }
    if given("on_replica_loss") {
        // What happens to a lost replica; the file's limits (restarts, window, minimum) stay.
        let named = recovery_policy(args)?;
        let r = &mut c.fault_tolerance.recovery;
        r.on_replica_loss = named.on_replica_loss;
        r.roll_back = named.roll_back;
    }
    if given("max_restarts") {
        c.fault_tolerance.recovery.max_restarts = args.max_restarts;
    }
    if let (true, Some(path)) = (read_faults, &args.faults) {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        c.fault_tolerance.fault_plan = Some(FaultPlan::from_json(&text)?);
    }
    let k = &mut c.checkpoints;
    if given("checkpoint_dir") {
        k.dir = args.checkpoint_dir.clone();
    }
    if given("checkpoint_every") {
        k.every = args.checkpoint_every;
    }
    if given("resume") {
        k.resume = args.resume;
    }
    if given("require_checkpoint") {
        k.require = args.require_checkpoint;
        k.resume |= args.require_checkpoint;
    }
    Ok(c)
}

/// Refuses flag values no job can run with, naming the flag, before anything starts.
pub(crate) fn check_flags(args: &TrainArgs) -> meshwork::error::Result<()> {
    let at_least_one = [
        ("--dp", args.dp.map(u64::from)),
        ("--pp", Some(u64::from(args.pp))),
        ("--batch-size", args.batch_size.map(|b| b as u64)),
        ("--tp", Some(u64::from(args.tp))),
        ("--layers", Some(args.layers as u64)),
        ("--d-model", Some(args.d_model as u64)),
        ("--heads", Some(args.heads as u64)),
        ("--context", Some(args.context as u64)),
        ("--hidden", Some(args.hidden as u64)),
        ("--micro-batches", Some(u64::from(args.micro_batches))),
        ("--virtual-stages", Some(u64::from(args.virtual_stages))),
        ("--checkpoint-every", args.checkpoint_every),
        ("--accumulate", Some(u64::from(args.accumulate))),
    ];
    for (flag, value) in at_least_one {
        if value == Some(0) {
            return Err(Error::InvalidConfig(format!("{flag} 0: use at least 1")));
        }
    }
    for (flag, seconds) in [
        ("--collective-timeout", args.collective_timeout),
        ("--step-timeout", args.step_timeout),
    ] {
        if !(seconds > 0.0 && seconds.is_finite()) {
            return Err(Error::InvalidConfig(format!(
                "{flag} {seconds}: a positive number of seconds"
            )));
        }
    }
    if args.collective_timeout >= args.step_timeout {
        return Err(Error::InvalidConfig(format!(
            "--collective-timeout {} is not below --step-timeout {}: a rank that never arrives \
             must be named by its collective before the step as a whole gives up",
            args.collective_timeout, args.step_timeout
        )));
    }
    if !(args.lr >= 0.0 && args.lr.is_finite()) {
        return Err(Error::InvalidConfig(format!(
            "--lr {}: a finite learning rate of at least 0",
            args.lr
        )));
    }
    if let Some(clip) = args.clip
        && !(clip > 0.0 && clip.is_finite())
    {
        return Err(Error::InvalidConfig(format!(
            "--clip {clip}: a positive, finite norm"
        )));
    }
    warmup_steps(args)?;
    if args.checkpoint_dir.is_none() && args.file.is_none() {
        for (flag, given) in [
            ("--resume", args.resume),
            ("--checkpoint-every", args.checkpoint_every.is_some()),
        ] {
            if given {
                return Err(Error::InvalidConfig(format!(
                    "{flag} needs --checkpoint-dir: the directory checkpoints go to and come from"
                )));
            }
        }
    }
    Ok(())
}

/// `--lr-schedule`'s warm-up steps (`warmup-cosine[:W]`, W a tenth of the steps by default),
/// or `None` for `constant`.
pub(crate) fn warmup_steps(args: &TrainArgs) -> meshwork::error::Result<Option<usize>> {
    let bad = || {
        Error::InvalidConfig(format!(
            "--lr-schedule {}: constant, or warmup-cosine[:WARMUP_STEPS]",
            args.lr_schedule
        ))
    };
    let (name, warmup) = match args.lr_schedule.split_once(':') {
        Some((name, w)) => (name, Some(w.parse::<usize>().map_err(|_| bad())?)),
        None => (args.lr_schedule.as_str(), None),
    };
    match name {
        "constant" if warmup.is_none() => Ok(None),
        "warmup-cosine" => Ok(Some(warmup.unwrap_or((args.steps as usize / 10).max(1)))),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::fit_batch;

    #[test]
    fn a_default_batch_fits_every_world_size() {
        assert_eq!(fit_batch(256, 2), 256);
        assert_eq!(fit_batch(256, 3), 255);
        assert_eq!(fit_batch(256, 6), 258);
        assert_eq!(fit_batch(32, 3), 33);
        assert_eq!(
            fit_batch(256, 1000),
            1000,
            "at least one sample a micro-batch"
        );
        for unit in 1..600 {
            for base in [32, 256] {
                let b = fit_batch(base, unit);
                assert!(
                    b.is_multiple_of(unit) && b >= unit,
                    "{base} for {unit}: {b}"
                );
                if base >= unit {
                    assert!(
                        b.abs_diff(base) <= unit / 2,
                        "the nearest: {base} for {unit}: {b}"
                    );
                } else {
                    assert_eq!(b, unit, "one sample a micro-batch: {base} for {unit}");
                }
            }
        }
    }
}
