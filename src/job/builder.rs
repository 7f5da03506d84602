//! The builder's settings: what to train, on what layout, with which strategies, for how long,
//! and what to do on failure. Each method records one choice; `build()` checks them together.

use super::*;

/// # What to train
///
/// The model (built per replica, or one model copied to every replica) and its loss.
impl<M, I> JobBuilder<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    /// How each replica builds its model; replicas then start from rank 0's parameters
    /// (broadcast), whatever the factory returned on the other ranks.
    ///
    /// The factory runs on every replica's device thread at once. A factory that draws random
    /// parameters (Burn's generator is process-global) shares the generator with the others,
    /// so rank 0's draws depend on how the threads interleave: for a bitwise-reproducible start
    /// (REPRO-1) build the model once and hand it to
    /// [`initial_model`](Self::initial_model), or load a record in the factory.
    pub fn model(mut self, f: impl Fn(&ModelContext) -> M + Send + Sync + 'static) -> Self {
        self.model = Some(Arc::new(f));
        self.replicas = Some(|spec| Box::new(LocalReplicas { spec }));
        self.ps_spawn = Some(crate::actors::parameter_server::spawner::<M, I>);
        #[cfg(feature = "cluster")]
        {
            self.replica_cluster = Some(ClusterFns {
                spawn: |mesh, spec, _| {
                    Box::new(crate::cluster::remote::ClusterReplicas { mesh, spec })
                },
                slots: |spec, _| Arc::new(crate::cluster::remote::ReplicaSlots(spec)),
            });
            self.ps_cluster = Some(PsClusterFns {
                spawn: |mesh, spec, (mode, rule, lr)| {
                    Box::new(crate::cluster::remote::ClusterParameterServer {
                        mesh,
                        spec,
                        mode,
                        rule,
                        lr,
                    })
                },
                slots: |spec, (rule, lr)| {
                    Arc::new(crate::cluster::remote::PsWorkerSlots { spec, rule, lr })
                },
            });
        }
        self
    }

    /// Start every replica from this model (its record is copied to every device). Parameters
    /// Burn has not drawn yet are drawn now, on the calling thread
    /// ([`materialize`](crate::parallel::stages::materialize), REPRO-1).
    pub fn initial_model(self, model: M) -> Self {
        let model = Mutex::new(crate::parallel::stages::materialize(model));
        self.model(move |_| model.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// The mean loss of the model over some samples, built on the given device.
    pub fn loss(
        mut self,
        f: impl Fn(&M, &[I], &Device) -> Tensor<1> + Send + Sync + 'static,
    ) -> Self {
        self.loss = Some(Arc::new(f));
        self
    }
}

/// # What to train: a pipeline
impl<I> JobBuilder<PipelineModel, I>
where
    I: Send + Sync + 'static,
{
    /// Train `stages` as a pipeline running `schedule`, in place of a single model and loss.
    /// With `Schedule::Interleaved { virtual_stages: v, .. }` the list holds K·v blocks and
    /// each of the K stages runs v of them; otherwise each block is one stage. Combine with
    /// [`data_parallel`](JobBuilder::data_parallel) for a dp × pp mesh; `batch_size` stays the
    /// global batch, cut per replica into the schedule's micro-batches. The trained blocks
    /// come back in a [`PipelineModel`].
    pub fn pipeline(self, stages: PipelineStages<I>, schedule: Schedule) -> Self {
        self.with_blocks(stages, Some(schedule))
    }

    /// Train the model given as `stages` (its blocks in order) with data parallelism only:
    /// every replica holds every block and runs them one after the other, micro-batch after
    /// micro-batch ([`gradient_accumulation`](JobBuilder::gradient_accumulation) of them),
    /// forwards through the blocks then backwards through them in reverse. Each block's
    /// gradient is reduced as soon as its last backward of the step is done. This is how a
    /// model trains with [`ZeroStage::Three`] (fully sharded: each replica keeps only its
    /// shard of every block's parameters between uses) and with per-block activation
    /// checkpointing ([`BlockOptions`]); ZeRO stages 0–2 and
    /// [`clip_grad_norm`](JobBuilder::clip_grad_norm) work as with a single model. The
    /// trained blocks come back in a [`PipelineModel`].
    pub fn blocks(self, stages: PipelineStages<I>) -> Self {
        self.with_blocks(stages, None)
    }

    /// Overlap a block or pipeline job's collectives with its compute, like FSDP's
    /// `limit_all_gathers` prefetch: a communication thread beside each stage runs them while
    /// the blocks compute. A [`ZeroStage::Three`] block's parameters are all-gathered up to
    /// `n` blocks ahead of their use (forwards, then backwards, then the next micro-batch),
    /// so at most `n` gathered-but-unused blocks exist at once besides the one computing; and
    /// each block's gradient reduction (all-reduce or reduce-scatter, at every ZeRO stage)
    /// runs while the earlier blocks' backwards compute, at most `n` at once, all of them
    /// finished before clipping and the update. `0` runs every collective in place when its
    /// result is needed (no overlap). The result is bitwise the same for every `n`.
    /// Default 1.
    pub fn blocks_in_flight(mut self, n: usize) -> Self {
        self.config.blocks_in_flight = n;
        self
    }

    /// Recompute every block's forward during its backward (activation checkpointing),
    /// whatever each block's [`BlockOptions`] say: less memory for more compute, the same
    /// result. Default off (the blocks' own options hold).
    pub fn recompute(mut self, on: bool) -> Self {
        self.config.recompute = on;
        self
    }

    fn with_blocks(mut self, stages: PipelineStages<I>, schedule: Option<Schedule>) -> Self {
        self.config.pipeline = schedule.map(|schedule| crate::job_config::PipelineConfig {
            stages: (stages.len() / schedule.virtual_stages().max(1) as usize) as u32,
            schedule,
        });
        self.pipeline = Some(PipelineParts {
            stages,
            spawn: |spec| Box::new(LocalPipeline { spec }),
            #[cfg(feature = "cluster")]
            cluster: ClusterFns {
                spawn: |mesh, spec, layout| {
                    Box::new(crate::cluster::remote::ClusterPipeline { mesh, spec, layout })
                },
                slots: |spec, _| Arc::new(crate::cluster::remote::pipeline::PipelineSlots { spec }),
            },
        });
        self
    }
}

/// # The common path
///
/// What the quickstart sets: the data, the optimizer and its learning rate, how many
/// replicas, the global batch and how many steps (the model and loss are set above, or a
/// pipeline with [`pipeline`](JobBuilder::pipeline)).
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// The training data.
    pub fn data(mut self, data: impl Dataset<Item = I>) -> Self {
        self.data = Some(Arc::new(data));
        self
    }

    /// The optimizer (SGD, Adam, AdamW configs convert into it).
    pub fn optimizer(mut self, optimizer: impl Into<OptimizerConfig>) -> Self {
        self.config.optimizer = optimizer.into();
        self
    }

    /// The learning rate, the one setter for it: a constant (`.learning_rate(1e-3)`), one of
    /// Burn's schedulers as a `ModuleLrScheduler` (e.g. a `SequentialLrSchedulerConfig`'s
    /// `init()?`), or a [`LearningRate`] such as [`LearningRate::warmup_cosine`] (Megatron-LM's
    /// warm-up then cosine). A scheduler is stepped once per applied optimizer step (LR-1); its
    /// state is saved with every checkpoint and copied with every snapshot (LR-2, CKPT-9), so a
    /// resumed or rolled-back job and a replica that joins continue the schedule where it was.
    pub fn learning_rate(mut self, lr: impl Into<LearningRate>) -> Self {
        use crate::job_config::LrSchedule;
        self.program_lr = None;
        match lr.into() {
            LearningRate::Constant(rate) => {
                self.config.learning_rate = rate;
                self.config.lr_schedule = LrSchedule::Constant;
            }
            LearningRate::WarmupCosine {
                peak,
                warmup,
                total,
                ..
            } => {
                self.config.learning_rate = peak;
                self.config.lr_schedule = LrSchedule::WarmupCosine {
                    warmup: warmup as u64,
                    total: Some(total as u64),
                };
            }
            program => {
                self.config.lr_schedule = LrSchedule::Program;
                self.program_lr = Some(program);
            }
        }
        self
    }

    /// Number of data-parallel replicas.
    pub fn data_parallel(mut self, dp: u32) -> Self {
        self.config.data_parallel = dp;
        self
    }

    /// The **global** batch size: each replica takes `batch_size / data_parallel` per step.
    pub fn batch_size(mut self, global: usize) -> Self {
        self.config.batch_size = Some(global);
        self
    }

    /// Number of optimizer steps.
    pub fn steps(mut self, steps: u64) -> Self {
        self.config.steps = steps;
        self
    }

    /// Seed of the data order.
    pub fn seed(mut self, seed: u64) -> Self {
        self.config.seed = seed;
        self
    }

    /// The devices to run on (default: one logical Flex CPU device per replica).
    pub fn devices(mut self, devices: Vec<MeshDevice>) -> Self {
        self.devices = Some(devices);
        self
    }
}

/// # The job description
///
/// Every setting of this builder lives in one [`JobConfig`] (CONF-1): read it, or replace it
/// with one from a file or from the head.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Replace every setting with `config`'s (a file's: [`JobConfig::from_file`], or the
    /// head's job spec on a node): the setters called before are overwritten, the ones
    /// called after override its keys. What a description cannot hold stays: the model,
    /// loss, data, devices, a checkpoint store, and the blocks (a pipeline's schedule and
    /// stage count are the description's).
    pub fn with_config(mut self, config: JobConfig) -> Self {
        if config.lr_schedule != crate::job_config::LrSchedule::Program {
            self.program_lr = None;
        }
        self.config = config;
        self
    }

    /// The job's description as the setters left it (`meshwork train --print-config`
    /// writes it).
    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    /// The learning rate every stage steps (refused: a warm-up the steps do not fit, or
    /// `LrSchedule::Program` without the program's scheduler).
    pub(super) fn learning_rate_now(&self) -> Result<LearningRate> {
        let schedule = self
            .config
            .learning_rate()
            .map_err(|e| Error::InvalidConfig(format!("lr_schedule: {}", e.0)))?;
        match schedule {
            Some(lr) => Ok(lr),
            None => self.program_lr.clone().ok_or_else(|| {
                Error::InvalidConfig(
                    "lr_schedule Program names the program's own scheduler, and none was \
                     given: call .learning_rate(scheduler), or name a schedule in the \
                     description"
                        .into(),
                )
            }),
        }
    }

    /// Makes the injected faults' hooks from the description's plan: one set, shared by the
    /// Supervisor and every stage of this process.
    pub(super) fn hook_faults(&mut self) {
        self.faults = self
            .config
            .fault_tolerance
            .fault_plan
            .clone()
            .map(FaultHooks::new);
    }

    /// Refuses a learning-rate scheduler built by the program in a job across processes:
    /// every process must step the same schedule, and only the description's travel.
    #[cfg(feature = "cluster")]
    pub(super) fn check_schedule_travels(&self) -> Result<()> {
        if self.config.lr_schedule != crate::job_config::LrSchedule::Program {
            return Ok(());
        }
        Err(Error::InvalidConfig(
            "a learning-rate scheduler built by the program cannot travel to the other \
             processes: use a constant rate or LearningRate::warmup_cosine (lr_schedule in \
             the job description)"
                .into(),
        ))
    }

    /// The compute type, 16-bit gradients and loss scaler every stage runs with.
    pub(super) fn mixed(&self) -> MixedPrecision {
        let p = &self.config.precision;
        MixedPrecision {
            precision: p.compute,
            low_gradients: p.low_precision_gradients,
            scaler: p.loss_scaler,
        }
    }
}

/// # Checkpoints
///
/// Where checkpoints go, how often, how many are kept, and whether the job resumes from one.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Write checkpoints into `dir` (one subdirectory per checkpoint; see
    /// [`crate::checkpoint`]): every [`checkpoint_every`](Self::checkpoint_every) steps, at
    /// the end of the run, and on [`JobHandle::checkpoint_now`].
    pub fn checkpoint_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.config.checkpoints.dir = Some(dir.into());
        self
    }

    /// Write checkpoints through `sink` (a [`crate::checkpoint::CheckpointStore`] over any
    /// file system) instead of a directory.
    pub fn checkpoint_store(mut self, sink: impl CheckpointSink + 'static) -> Self {
        self.checkpoint_sink = Some(Arc::new(sink));
        self
    }

    /// Checkpoint every `n` steps (needs a checkpoint directory or store).
    pub fn checkpoint_every(mut self, n: u64) -> Self {
        self.config.checkpoints.every = Some(n);
        self
    }

    /// Keep the newest `k` complete checkpoints (default 3).
    pub fn keep_checkpoints(mut self, k: usize) -> Self {
        self.config.checkpoints.keep = k;
        self
    }

    /// Start from the newest valid checkpoint of the directory or store, if there is one
    /// (newer ones that do not verify are refused and reported in the `Restored` event). The
    /// job also writes checkpoints there (at least one when it ends), so the directory must be
    /// writable (CKPT-7); to resume from a read-only copy, copy it first.
    pub fn resume_from_checkpoint(mut self, resume: bool) -> Self {
        self.config.checkpoints.resume = resume;
        self
    }

    /// With `true`: resume from a checkpoint, and fail the job with
    /// [`CheckpointError::NothingToResume`](crate::checkpoint::CheckpointError::NothingToResume)
    /// when none verifies, instead of starting afresh with a `NothingToResume` event.
    pub fn require_checkpoint(mut self, require: bool) -> Self {
        self.config.checkpoints.require = require;
        if require {
            self.config.checkpoints.resume = true;
        }
        self
    }
}

/// # Tuning
///
/// Settings with working defaults: micro-batches, mixed precision, gradient buckets and
/// clipping, sharded optimizer state, the non-finite-loss policy, the all-reduce algorithm,
/// payload checks, time-outs and the event buffer.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Accumulate gradients over `k` micro-batches per step (each replica's share of the
    /// global batch is cut into `k` equal micro-batches).
    pub fn gradient_accumulation(mut self, k: u32) -> Self {
        self.config.accumulation = k;
        self
    }

    /// Split every tensor-parallel block ([`PipelineStages::tp_block`]) over `t` ranks, as
    /// Megatron-LM does: each rank holds its slice of the block's split matrices, and the
    /// ranks' partial results meet in all-reduces (one per split region in the forward, one
    /// in the backward). Combines with [`data_parallel`](Self::data_parallel) and
    /// [`pipeline`](Self::pipeline) into a dp × pp × tp mesh (tp ranks fastest in the rank
    /// order, MESH-1); works with [`blocks`](Self::blocks) and `pipeline` jobs. Checkpoints
    /// hold each rank's slices (`shard-ppB-tpT`) and restore onto any degree and data-parallel
    /// size, re-sliced (TP-7); a lost rank is replaced from its twin in another replica or
    /// rolled back, as a pipeline stage is. Composes with ZeRO, mixed precision,
    /// `clip_grad_norm`, accumulation and local updates; what it does not compose with
    /// (compression, the parameter server, jobs across processes) is a row of
    /// [`REFUSALS`](crate::composition::REFUSALS), refused when the job is built.
    pub fn tensor_parallel(mut self, t: u32) -> Self {
        self.config.tensor_parallel = t;
        self
    }

    /// Shard the training state over the data-parallel replicas, as DeepSpeed's ZeRO and
    /// PyTorch's `ZeroRedundancyOptimizer` do: [`ZeroStage::One`] keeps each replica's share
    /// of the optimizer state only, [`ZeroStage::Two`] also reduce-scatters the gradients.
    /// The trained parameters equal plain data parallelism's. Works with SGD, Adam and AdamW
    /// (without the optimizer's own per-tensor clipping: use [`Self::clip_grad_norm`]).
    pub fn zero(mut self, stage: ZeroStage) -> Self {
        self.config.reduction.zero = stage;
        self
    }

    /// Send gradients compressed (PyTorch's DDP communication hooks): bf16/f16 values,
    /// top-k sparsification or PowerSGD, each with error feedback (the part a rank does not
    /// send waits in its residual, kept in checkpoints). In block and pipeline jobs each
    /// block's reduction goes through its own compressor, also over tensor-parallel blocks
    /// and across processes. Top-k and PowerSGD are refused with ZeRO-2 and 3, any scheme with
    /// `low_precision_gradients`, f16 loss scaling, local updates and the parameter server
    /// (`composition::REFUSALS`, and the ZeRO rule of `ZeroStage`). See
    /// [`crate::parallel::compress`].
    pub fn compression(mut self, compression: Compression) -> Self {
        self.config.reduction.compression = compression;
        self
    }

    /// Synchronise less often: each data-parallel replica steps its own copy of the model
    /// with the job's optimizer on its own samples, and every `every` steps the replicas meet
    /// in one all-reduce of their parameters: [`LocalUpdates::LocalSgd`] averages them,
    /// [`LocalUpdates::DiLoCo`] takes an outer Nesterov-SGD step on their mean change,
    /// [`LocalUpdates::Easgd`] pulls them toward a centre variable
    /// ([`crate::parallel::local`]). With `every` 1 and SGD (and a global batch that splits
    /// evenly over the replicas), local SGD equals plain data parallelism. Checkpoints hold every replica's own parameters, optimizer and the outer
    /// state (LOCAL-4), so a lost replica rolls back (never dropped) and a resumed run equals
    /// the uninterrupted one; resuming or resizing onto another number of replicas is
    /// refused (the job cannot grow; a shrink fails at its next step). The job
    /// must end on a synchronisation (`steps` a multiple of `every`): the trained model is
    /// replica 0's (for EASGD its own variable after the last elastic step). Data-parallel,
    /// block and pipeline jobs (block by block), in one process or across processes; not with
    /// ZeRO, clipping, compression or f16 (`composition::REFUSALS`).
    pub fn local_updates(mut self, updates: LocalUpdates) -> Self {
        self.config.reduction.local_updates = Some(updates);
        self
    }

    /// Train through a parameter server instead of all-reduce: the replicas become workers
    /// that pull parameters, push gradients and wait only as the staleness bound says
    /// (stale-synchronous parallel; `Staleness::Bounded(0)` equals data parallelism,
    /// `Unbounded` is asynchronous SGD). A step is a round over its global batch, in which a
    /// fast worker computes more of it than a slow one; `StepDone`'s replicas report every
    /// applied gradient's staleness (see [`crate::parallel::parameter_server`]). In-process
    /// `.model(..)` jobs with SGD, Adam or AdamW at a constant rate, in `f32`, without
    /// clipping, ZeRO, pipelines or tensor parallelism; the rest is refused by `build()`.
    pub fn parameter_server(mut self, server: ParameterServer) -> Self {
        self.config.reduction.parameter_server = Some(server);
        self
    }

    /// Synchronous training with `b` backup workers (Chen et al., 2016): each step applies
    /// the mean gradient of the first `replicas − b` workers to finish and drops the rest
    /// (their sample ids are in `StepDone`'s replicas). Runs on the parameter server
    /// (`parameter_server`, with `Staleness::Bounded(0)` if given); `b` must be below the
    /// number of replicas.
    pub fn backup_workers(mut self, b: u32) -> Self {
        self.config.reduction.backup_workers = Some(b);
        self
    }

    /// Run forward and backward in `precision` (mixed precision, like PyTorch's autocast):
    /// each micro-batch computes on a copy of the model cast to the 16-bit type, its
    /// gradients reach the `f32` master weights as `f32`, and the optimizer steps the master
    /// weights, which are what checkpoints and the trained model hold (PREC-1). At
    /// [`Precision::F16`] the loss is scaled dynamically ([`Self::loss_scaler`]): a step
    /// whose all-reduced gradient overflows is skipped on every replica (PREC-2,
    /// `JobEvent::GradientOverflow`). The model must cast its input to its parameters' dtype
    /// and the loss function its output to `f32` (no-ops in `f32`; see
    /// [`crate::parallel::autocast`]; a block or pipeline stage receives its input in the
    /// compute type already). Replicas, `.blocks(..)`, `.pipeline(..)` and tensor-parallel
    /// jobs take it (f16's overflow agreed over every stage and tp rank); refused when the
    /// job is built: f16 with a pipeline across processes (`composition::REFUSALS`).
    /// Across processes the library is not refused, but `meshwork train`'s job spec does not
    /// carry a precision yet, so its CLI refuses the flag there.
    pub fn precision(mut self, precision: Precision) -> Self {
        self.config.precision.compute = precision;
        self
    }

    /// All-reduce gradients in the 16-bit type of [`Self::precision`] instead of `f32`:
    /// half the bytes on the wire, each sum still accumulated in `f32` and rounded once
    /// (COMM-5). Off by default; no effect at `f32`. In block and pipeline jobs each block's
    /// reduction (an all-reduce, or ZeRO's reduce-scatter) travels 16-bit; ZeRO-3's
    /// parameter gathers and tensor parallelism's collectives stay `f32`.
    pub fn low_precision_gradients(mut self, low: bool) -> Self {
        self.config.precision.low_precision_gradients = low;
        self
    }

    /// How 16-bit gradients' partial sums travel in ring and tree reductions (COMM-9):
    /// [`PartialSums::F32`](crate::comm::PartialSums::F32) (default: every sum accumulated in `f32`, rounded once) or
    /// [`PartialSums::Narrow`](crate::comm::PartialSums::Narrow) (in the 16-bit type, as NCCL's 16-bit all-reduce: a ring moves
    /// 4 bytes per element per pass instead of 6, each hop rounding once). Acts on the
    /// reductions that travel 16-bit: [`Self::low_precision_gradients`] and
    /// `Compression::Bf16`; set it alike on every process of a job across processes.
    pub fn partial_sums(mut self, partial_sums: crate::comm::PartialSums) -> Self {
        self.config.comm.partial_sums = partial_sums;
        self
    }

    /// How f16's dynamic loss scaling moves its scale (default: `torch.amp.GradScaler`'s,
    /// 2^16, ×2 every 2000 clean steps, ×0.5 on an overflow).
    pub fn loss_scaler(mut self, config: LossScalerConfig) -> Self {
        self.config.precision.loss_scaler = config;
        self
    }

    /// Clip gradients so that their global L2 norm is at most `max_norm`.
    pub fn clip_grad_norm(mut self, max_norm: f32) -> Self {
        self.config.clip_norm = Some(max_norm);
        self
    }

    /// What to do on a NaN or infinite loss.
    pub fn on_non_finite_loss(mut self, policy: NonFinitePolicy) -> Self {
        self.config.non_finite = policy;
        self
    }

    /// The most bytes one gradient all-reduce carries (default [`DEFAULT_BUCKET_BYTES`],
    /// 25 MiB, as PyTorch DDP's `bucket_cap_mb`; at least 4, one `f32`). A `.model(..)` job
    /// with plain data parallelism or ZeRO stage 1 all-reduces its gradients bucket by bucket
    /// ([`crate::parallel::buckets`]): tensors under a quarter of a bucket (and under 64 Ki
    /// elements) packed together, larger ones reduced in place in chunks of at most this
    /// size; [`local_updates`](Self::local_updates) all-reduces its parameters the same way.
    /// The other reductions ignore it: `.blocks(..)` and `.pipeline(..)` jobs reduce in fixed
    /// 25 MiB buckets, ZeRO stage 2 (and stage 1 in `.blocks(..)` jobs) reduce-scatters the whole gradient at once, compression
    /// runs its own collectives and the parameter server none.
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.config.reduction.bucket_bytes = bytes;
        self
    }

    /// Check every collective message's payload against a crc32 its sender computed (COMM-8):
    /// a message spoiled in transit fails its op with `CommError::CorruptMessage` naming the
    /// sender, and under a recovering policy the step is retried (REC-4). The group then runs
    /// message plans (ring, tree) only, never the shared-memory direct plan, which has no
    /// messages to check. It acts on in-process groups; across processes every TCP frame
    /// carries its payload's crc32 whatever this says. Off by default; a fault plan that
    /// corrupts messages turns it on.
    pub fn verify_payloads(mut self, on: bool) -> Self {
        self.config.comm.verify_payloads = on;
        self
    }

    /// The all-reduce algorithm (default: chosen by size and group).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.config.comm.algorithm = algorithm;
        self
    }

    /// Emulate a slower network (`comm::emulate`): every message a rank sends waits for its
    /// link's latency and its bytes at the link's bandwidth before it leaves (EMU-1), so
    /// the methods for slow links can be measured on a fast machine. In-process the group
    /// then runs ring and tree plans only; across processes each process emulates the links
    /// it sends on (set it on every process's builder). Values are unchanged (EMU-2).
    pub fn link_emulation(mut self, link: crate::comm::emulate::LinkEmulation) -> Self {
        self.config.comm.link = Some(link);
        self
    }

    /// How a persistently slow rank is found and named in the events
    /// (`JobEvent::Straggler`, STRAG-1..3), or `None` to look for none. The default names a
    /// rank whose median compute time (forward and backward) over its last 5 steps is at least
    /// 1.5 × the median of the other ranks' medians and at least 5 ms above it
    /// ([`crate::stragglers::StragglerDetection`]'s default); it is named again only after a
    /// `StragglerRecovered`.
    pub fn straggler_detection(
        mut self,
        detection: Option<crate::stragglers::StragglerDetection>,
    ) -> Self {
        self.config.stragglers = detection;
        self
    }

    /// Time-out of every collective operation (default 60 s): a rank that does not arrive
    /// within it is named in the error. Must be below [`Self::step_timeout`] (refused when the
    /// job is built otherwise), so that a missing rank is named by its collective before the
    /// step as a whole gives up.
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.config.comm.timeout = timeout;
        self
    }

    /// Time-out of one step on every stage (default 600 s; `meshwork train --step-timeout`,
    /// default 120 s): a step not done within it ends the job or starts recovery, naming what
    /// each silent stage was busy with. Above [`Self::collective_timeout`].
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.config.step_timeout = timeout;
        self
    }

    /// How many events are kept for a slow consumer before the oldest are dropped for it.
    pub fn event_capacity(mut self, events: usize) -> Self {
        self.config.event_capacity = events;
        self
    }
}

/// # Failures and elasticity
///
/// What the job does when a device is lost, the sizes it may run at, and faults to inject
/// for a rehearsal: one [`FaultTolerance`] value, or its shorthands one setting at a time.
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// What the job does about failures, in one value: the recovery policy, the elastic range
    /// and wait, and any faults to inject. Replaces all four settings (a value without a plan
    /// injects no faults); [`recovery`](Self::recovery), [`elastic`](Self::elastic),
    /// [`elastic_wait`](Self::elastic_wait) and [`fault_plan`](Self::fault_plan) are
    /// shorthands that set one of them.
    pub fn fault_tolerance(mut self, tolerance: FaultTolerance) -> Self {
        self.config.fault_tolerance = tolerance;
        self
    }

    /// How to recover from a lost device (default: the job fails with the device's error).
    pub fn recovery(mut self, policy: RecoveryPolicy) -> Self {
        self.config.fault_tolerance.recovery = policy;
        self
    }

    /// The data-parallel sizes [`JobHandle::scale_to`] may ask for (default: 1 and up).
    ///
    /// When failures leave fewer than `min` replicas (with a shrinking recovery policy whose
    /// own `min_replicas` floor still holds), the job waits for devices rather than train on
    /// (ELASTIC-3): it publishes `WaitingForDevices` and holds its next step until
    /// `scale_to(n ≥ min)` or `resume()`, and ends with `Error::BelowMinimum` after
    /// [`JobBuilder::elastic_wait`].
    pub fn elastic(mut self, min: u32, max: u32) -> Self {
        self.config.fault_tolerance.elastic_min = min;
        self.config.fault_tolerance.elastic_max = max;
        self
    }

    /// How long a job below its elastic minimum waits for devices (default 5 minutes).
    pub fn elastic_wait(mut self, wait: Duration) -> Self {
        self.config.fault_tolerance.elastic_wait = wait;
        self
    }

    /// Inject the faults of `plan` (a rehearsal of failures: see [`crate::faults`]).
    pub fn fault_plan(mut self, plan: FaultPlan) -> Self {
        self.config.fault_tolerance.fault_plan = Some(plan);
        self
    }
}

/// # Across processes (feature `cluster`)
#[cfg(feature = "cluster")]
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Train across processes on `mesh` (the world the head assembled): each rank in the
    /// process that holds its device, gradients (and a pipeline's activations) meeting over the
    /// TCP data plane. A data-parallel job has one replica per rank; a pipeline job
    /// (`.pipeline(..)`) has world ÷ stages replicas. Every process builds its stages from the
    /// same builder settings ([`JobBuilder::stage_host`] on the nodes); `data_parallel` follows
    /// the world. A data-parallel job across processes recovers by shrinking, growing onto
    /// nodes that joined it, or rolling back; a block or pipeline job replaces a lost stage
    /// from its twin on a node that joined it (REMOTE-7), rolls back onto such a node, or fails
    /// with the lost stage named. A fault plan is carried out by every process (the spec
    /// carries the whole description: [`JobBuilder::with_config`]), except message faults, a
    /// row of the refusal table (feature `cluster`).
    pub fn cluster(mut self, mesh: crate::cluster::remote::ClusterMesh) -> Self {
        self.cluster = Some(mesh);
        self
    }

    /// Checks the builder as a job across processes of `world` ranks: the one table of
    /// refused combinations (COMP-1, with `.cluster(..)` counted on) and the checks `build`
    /// runs on the values a job spec carries (JOB-1: accumulation, time-outs, the emulated
    /// link, the loss scaler, compression and its ZeRO stage, local updates). A node runs it
    /// on the spec it receives ([`JobBuilder::stage_host`]), so it refuses what it cannot train
    /// rather than failing later; a head runs it before it waits for its nodes, so a job it
    /// would refuse once they joined is refused before anyone joins (feature `cluster`).
    pub fn check_across_processes(&self, world: u32) -> Result<()> {
        self.check_schedule_travels()?;
        self.learning_rate_now()?;
        self.plan().across_processes().check()?;
        if self.config.accumulation == 0 {
            return Err(Error::InvalidConfig(
                "gradient_accumulation(0): use at least 1 micro-batch".into(),
            ));
        }
        self.check_link_and_timeouts()?;
        self.check_strategy_values(world)
    }

    /// The stages of one process of a job across processes (a node's, or the head's own
    /// devices'), trained with this builder's model (or pipeline), loss, data, optimizer and
    /// settings: what a node's [`crate::cluster::control::HostFactory`] returns. Each slot gets
    /// a device of the backend the job's spec names (feature `cluster`).
    pub fn stage_host(
        mut self,
        args: crate::cluster::control::HostArgs,
    ) -> Result<Arc<dyn crate::cluster::control::StageHost>> {
        let Some(dataset) = self.data.clone() else {
            return Err(Error::InvalidConfig("no data: call .data(dataset)".into()));
        };
        let Some(global) = self.config.batch_size else {
            return Err(Error::InvalidConfig(
                "no batch size: call .batch_size(global_batch)".into(),
            ));
        };
        // The spec's values come from the network: a node checks them as the head did.
        let world = args.plan.world_size as u32;
        self.check_across_processes(world)?;
        self.hook_faults();
        tracing::info!(description = ?self.config, "meshwork node: the job it runs");
        let slots = match self.pipeline.take() {
            Some(p) => {
                // The head checks the mesh against the world it assembled; a node's slots learn
                // whom they group with from the head's Wire (and a node that joined the running
                // job as a spare counts a world that is no multiple of the stages).
                let slots = p.cluster.slots;
                let (spec, layout) = self.pipeline_spec(p, global, dataset, None)?;
                slots(spec, layout)
            }
            None => {
                let Some(fns) = self.replica_cluster.take() else {
                    return Err(Error::InvalidConfig(
                        "no model: call .model(..) or .initial_model(..), or .pipeline(stages, \
                         schedule)"
                            .into(),
                    ));
                };
                let learning_rate = self.learning_rate_now()?;
                let server = crate::parallel::parameter_server::check(
                    self.config.reduction.parameter_server,
                    self.config.reduction.backup_workers,
                    crate::parallel::parameter_server::JobShape {
                        workers: world,
                        optimizer: &self.config.optimizer,
                        learning_rate: &learning_rate,
                    },
                )?;
                // The head checks the batch against the replicas it drives; a node's world
                // counts every rank ever joined (it grows with late nodes, REMOTE-5).
                self.config.data_parallel = 1;
                let spec = self.stage_spec(global, dataset)?;
                match (server, self.ps_cluster.take()) {
                    (Some((_, rule, lr)), Some(ps)) => (ps.slots)(spec, (rule, lr)),
                    _ => (fns.slots)(spec, Layout::data_parallel(world)?),
                }
            }
        };
        let link = crate::comm::net::link::LinkConfig {
            io_timeout: self.config.comm.timeout,
            ..Default::default()
        };
        let tcp = crate::comm::tcp::TcpConfig {
            comm: self.config.comm.clone(),
            ..Default::default()
        }
        .with_link(link);
        Ok(Arc::new(crate::cluster::remote::NodeStages::new(
            slots,
            args,
            tcp,
            self.faults.clone(),
        )?))
    }
}
