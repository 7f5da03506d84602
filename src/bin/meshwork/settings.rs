//! What `meshwork train`'s flags set beyond the mesh: the flags checked before anything
//! starts, the default global batch fitted to the world, the fault plan and recovery policy,
//! the learning rate and its schedule, the training settings and the checkpoint flags on a
//! job builder. Shared by the one-process job, the GPT and a cluster's head.

use std::path::PathBuf;

use meshwork::error::Error;
use meshwork::faults::FaultPlan;
use meshwork::job::JobBuilder;
use meshwork::optim::LearningRate;
use meshwork::parallel::parameter_server::ParameterServer;
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

/// The fault plan and recovery policy the flags ask for.
pub(crate) fn fault_settings(
    args: &TrainArgs,
) -> meshwork::error::Result<(Option<FaultPlan>, RecoveryPolicy)> {
    let plan = match &args.faults {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
            Some(FaultPlan::from_json(&text)?)
        }
        None => None,
    };
    let mut policy = match args.on_replica_loss.as_str() {
        "fail" => RecoveryPolicy::default(),
        "shrink" => RecoveryPolicy::shrink(),
        "rollback" => RecoveryPolicy::roll_back(),
        "shrink-or-rollback" => RecoveryPolicy::shrink().or_roll_back(),
        other => {
            return Err(Error::InvalidConfig(format!(
                "--on-replica-loss {other}: fail, shrink, rollback or shrink-or-rollback"
            )));
        }
    };
    policy.max_restarts = args.max_restarts;
    Ok((plan, policy))
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
    learning_rate(args)?;
    if args.checkpoint_dir.is_none() {
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

/// The learning rate `--lr` and `--lr-schedule` ask for (refused here, naming the flag, when
/// they do not make a schedule).
pub(crate) fn learning_rate(args: &TrainArgs) -> meshwork::error::Result<LearningRate> {
    match warmup_steps(args)? {
        None => Ok(LearningRate::Constant(args.lr)),
        Some(warmup) => LearningRate::warmup_cosine(args.lr, warmup, args.steps as usize)
            .map_err(|e| Error::InvalidConfig(format!("--lr-schedule: {}", e.0))),
    }
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

/// The flags that choose how the job trains beyond the mesh — the learning rate and its
/// schedule, clipping, accumulation, and the way gradients are exchanged — on `builder`. The
/// library refuses what does not combine (one table, `meshwork::composition`).
pub(crate) fn training_settings<M: Send + 'static, I: Send + Sync + 'static>(
    args: &TrainArgs,
    lr: LearningRate,
    mut builder: JobBuilder<M, I>,
) -> JobBuilder<M, I> {
    builder = builder
        .learning_rate(lr)
        .gradient_accumulation(args.accumulate)
        .compression(args.compression)
        .algorithm(args.algorithm);
    if let Some(clip) = args.clip {
        builder = builder.clip_grad_norm(clip);
    }
    if let Some(updates) = args.local_updates {
        builder = builder.local_updates(updates);
    }
    if args.parameter_server {
        builder = builder.parameter_server(ParameterServer::new(args.staleness));
    }
    if let Some(b) = args.backup_workers {
        builder = builder.backup_workers(b);
    }
    builder
}

/// The checkpoint flags on a builder.
pub(crate) fn checkpoint_settings<M: Send + 'static, I: Send + Sync + 'static>(
    flags: &CheckpointFlags,
    mut builder: meshwork::job::JobBuilder<M, I>,
) -> meshwork::job::JobBuilder<M, I> {
    if let Some(dir) = &flags.dir {
        builder = builder
            .checkpoint_dir(dir)
            .resume_from_checkpoint(flags.resume)
            .require_checkpoint(flags.require);
    }
    if let Some(n) = flags.every {
        builder = builder.checkpoint_every(n);
    }
    builder
}

/// The checkpoint flags of `meshwork train` (in one process or on a cluster's head).
#[derive(Debug, Clone)]
pub(crate) struct CheckpointFlags {
    dir: Option<PathBuf>,
    every: Option<u64>,
    resume: bool,
    require: bool,
}

impl TrainArgs {
    pub(crate) fn checkpoint_flags(&self) -> CheckpointFlags {
        CheckpointFlags {
            dir: self.checkpoint_dir.clone(),
            every: self.checkpoint_every,
            resume: self.resume,
            require: self.require_checkpoint,
        }
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
