//! `JobBuilder::build`: check the configuration (JOB-1) and assemble the specs the
//! Supervisor and the stage actors are spawned from.

use super::*;

/// The most events a job keeps for a slow consumer (a bigger buffer is an allocation the
/// size of a mistake).
const MAX_EVENT_CAPACITY: usize = 1 << 20;

/// # Building
impl<M, I> JobBuilder<M, I>
where
    M: Send + 'static,
    I: Send + Sync + 'static,
{
    /// Check the configuration (JOB-1) and produce the job.
    pub fn build(mut self) -> Result<Job<M, I>> {
        let invalid = |m: String| Err(Error::InvalidConfig(m));
        let Some(dataset) = self.data.clone() else {
            return invalid("no data: call .data(dataset)".into());
        };
        let Some(global) = self.config.batch_size else {
            return invalid("no batch size: call .batch_size(global_batch)".into());
        };
        if self.config.data_parallel == 0 {
            return invalid("data_parallel(0): use at least 1 replica".into());
        }
        if self.config.accumulation == 0 {
            return invalid("gradient_accumulation(0): use at least 1 micro-batch".into());
        }
        if self.config.reduction.bucket_bytes < 4 {
            return invalid("bucket_bytes below one f32: use at least 4 bytes".into());
        }
        if self.config.event_capacity > MAX_EVENT_CAPACITY {
            return invalid(format!(
                "event_capacity {}: keep at most {MAX_EVENT_CAPACITY} events",
                self.config.event_capacity
            ));
        }
        if self.config.event_capacity == 0 {
            return invalid("event_capacity(0): keep at least 1 event".into());
        }
        self.check_link_and_timeouts()?;
        let zero = self.config.reduction.zero;
        if zero.shards_optimizer()
            && let Err(e) = FlatRule::of(&self.config.optimizer)
        {
            return invalid(format!("zero({zero:?}): {e}"));
        }
        let remote = self.is_remote();
        #[cfg(feature = "cluster")]
        if remote {
            // The head's stages step what the nodes' do.
            self.check_schedule_travels()?;
        }
        let learning_rate = self.learning_rate_now()?;
        // Every refused combination of strategies, from the one table (COMP-1).
        self.plan().check()?;
        self.check_strategy_values(self.config.data_parallel)?;
        let server = parameter_server::check(
            self.config.reduction.parameter_server,
            self.config.reduction.backup_workers,
            parameter_server::JobShape {
                workers: self.workers(),
                optimizer: &self.config.optimizer,
                learning_rate: &learning_rate,
            },
        )?;
        if let Some(plan) = &self.config.fault_tolerance.fault_plan {
            plan.check()?;
        }
        self.hook_faults();
        let (spawn, layout, accumulation) = match self.pipeline.take() {
            Some(p) => self.pipeline_parts(p, global, dataset.clone())?,
            None => self.replica_parts(global, dataset.clone(), server)?,
        };
        let world = layout.world_size() as usize;
        let devices = match self.devices {
            Some(d) if remote => d.into_iter().take(1).collect(),
            Some(d) => d,
            // A cluster job needs only the template its model is assembled on.
            None => MeshDevice::of_kind(
                crate::device::BackendKind::Flex,
                if remote { 1 } else { world },
            )?,
        };
        if devices.len() < world && !remote {
            return invalid(format!(
                "a {} × {} mesh (data × pipeline) needs {world} devices but {} were given: add \
                 devices or use a smaller mesh",
                layout.dp(),
                layout.pp(),
                devices.len()
            ));
        }
        let precision = self.config.precision.compute;
        let dtype = crate::parallel::autocast::float_dtype(precision);
        if let Some(d) = devices.iter().find(|d| !d.burn().supports_dtype(dtype)) {
            return invalid(format!(
                "precision({precision}): device {} does not compute in {precision}; use \
                 Precision::F32 or devices that support it",
                d.id()
            ));
        }
        // COMM-8: a corrupted message is only caught where payloads are checked.
        let mut comm = self.config.comm.clone();
        if self.faults.as_ref().is_some_and(|f| f.corrupts_messages()) {
            comm.verify_payloads = true;
        }
        let c = &self.config.checkpoints;
        let sink =
            match (self.checkpoint_sink.take(), &c.dir) {
                (Some(sink), _) => Some(sink),
                (None, Some(dir)) => Some(Arc::new(CheckpointStore::open(dir.clone(), c.keep)?)
                    as Arc<dyn CheckpointSink>),
                (None, None) => None,
            };

        let checkpoints = match sink {
            Some(sink) => Some(CheckpointSettings {
                sink,
                every: c.every,
                // A required checkpoint is one resumed from.
                resume: c.resume || c.require,
                require: c.require,
            }),
            None if c.every.is_some() || c.resume => {
                return invalid(
                    "checkpoint_every or resume without a place for checkpoints: add \
                     .checkpoint_dir(dir)"
                        .into(),
                );
            }
            None => None,
        };
        if comm.timeout >= self.config.step_timeout {
            return invalid(format!(
                "collective_timeout {:?} is not below step_timeout {:?}: a rank that never \
                 arrives must be named by its collective before the step gives up",
                comm.timeout, self.config.step_timeout
            ));
        }
        let ft = &self.config.fault_tolerance;
        if ft.elastic_min > ft.elastic_max {
            return invalid(format!(
                "elastic({}, {}): the minimum is above the maximum",
                ft.elastic_min, ft.elastic_max
            ));
        }
        if c.every == Some(0) {
            return invalid("checkpoint_every(0): use at least 1 step".into());
        }
        let sampler = DistributedSampler::new(dataset.len(), global, self.config.seed)?;
        // Last, once nothing else refuses the job: a required checkpoint in a directory that
        // does not exist is missing (the directory is not made for it), and a place checkpoints
        // cannot be written to is refused before any training (CKPT-7).
        if let (Some(settings), Some(dir)) = (&checkpoints, &c.dir)
            && settings.require
            && !dir.exists()
        {
            return Err(crate::checkpoint::CheckpointError::NothingToResume {
                location: dir.display().to_string(),
            }
            .into());
        }
        if let Some(settings) = &checkpoints {
            settings.sink.check_writable()?;
        }
        Ok(Job {
            args: Some(PreparedJob {
                config: self.config,
                spawn,
                items: std::marker::PhantomData,
                devices,
                remote,
                layout,
                accumulation,
                sampler,
                comm,
                faults: self.faults,
                checkpoints,
            }),
        })
    }

    /// The data-parallel job's spawner, layout and accumulation.
    fn replica_parts(
        &mut self,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
        server: Option<(parameter_server::Mode, FlatRule, f64)>,
    ) -> Result<(Box<dyn Spawner<M>>, Layout, u32)> {
        if self.config.recompute {
            return Err(Error::InvalidConfig(
                "recompute (activation checkpointing) works per block: give the model as \
                 blocks with .blocks(stages) or .pipeline(stages, schedule)"
                    .into(),
            ));
        }
        if let Some(pipeline) = &self.config.pipeline {
            return Err(Error::InvalidConfig(format!(
                "the description names a pipeline of {} stage(s), but the model was given \
                 whole: cut it into blocks with .pipeline(stages, schedule)",
                pipeline.stages
            )));
        }
        let Some(spawn) = self.replicas else {
            return Err(Error::InvalidConfig(
                "no model: call .model(..) or .initial_model(..), or .pipeline(stages, schedule)"
                    .into(),
            ));
        };
        if self.config.tensor_parallel != 1 {
            return Err(Error::InvalidConfig(format!(
                "tensor_parallel({}) splits blocks: give the model as tensor-parallel blocks \
                 with .blocks(stages) or .pipeline(stages, schedule) instead of .model(..)",
                self.config.tensor_parallel
            )));
        }
        #[cfg(feature = "cluster")]
        if let Some(mesh) = self.cluster.take() {
            let world = mesh.world_size() as u32;
            if self.config.data_parallel != 1 && self.config.data_parallel != world {
                return Err(Error::InvalidConfig(format!(
                    "data_parallel({}) on a cluster of {world} rank(s): a job across processes \
                     has one replica per rank; leave data_parallel unset",
                    self.config.data_parallel
                )));
            }
            let Some(fns) = self.replica_cluster.take() else {
                return Err(Error::InvalidConfig(
                    "no model: call .model(..) or .initial_model(..)".into(),
                ));
            };
            self.config.data_parallel = world;
            let spec = self.stage_spec(global, dataset)?;
            let layout = Layout::data_parallel(world)?;
            if let (Some(server), Some(ps)) = (server, self.ps_cluster.take()) {
                return Ok((
                    (ps.spawn)(mesh, spec, server),
                    layout,
                    self.config.accumulation,
                ));
            }
            return Ok((
                (fns.spawn)(mesh, spec, layout),
                layout,
                self.config.accumulation,
            ));
        }
        let spec = self.stage_spec(global, dataset)?;
        if let (Some(server), Some(ps)) = (server, self.ps_spawn) {
            let layout = Layout::data_parallel(self.config.data_parallel)?;
            return Ok((ps(spec, server), layout, self.config.accumulation));
        }
        Ok((
            spawn(spec),
            Layout::data_parallel(self.config.data_parallel)?,
            self.config.accumulation,
        ))
    }

    /// JOB-1 of the emulated link, the time-outs and the loss scaler (what a job spec carries
    /// of them is checked by a node too: `check_across_processes`).
    pub(super) fn check_link_and_timeouts(&self) -> Result<()> {
        if let Some(link) = &self.config.comm.link
            && let Err(e) = link.validate()
        {
            return Err(Error::InvalidConfig(format!("link_emulation: {e}")));
        }
        if self.config.comm.timeout.is_zero() || self.config.step_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "a time-out of zero: use a positive duration".into(),
            ));
        }
        if self.config.precision.compute.scales_loss() {
            self.config.precision.loss_scaler.validate()?;
        }
        Ok(())
    }

    /// JOB-1 of the compression (and its ZeRO stage) and the local updates over `replicas`.
    pub(super) fn check_strategy_values(&self, replicas: u32) -> Result<()> {
        self.config.reduction.compression.validate()?;
        if let Some(updates) = &self.config.reduction.local_updates {
            local_updates::check(updates, replicas, self.config.steps)?;
        }
        Ok(())
    }

    /// The data-parallel workers a parameter server would serve: the world's ranks across
    /// processes, else `data_parallel`.
    fn workers(&self) -> u32 {
        #[cfg(feature = "cluster")]
        if let Some(mesh) = &self.cluster {
            return mesh.world_size() as u32;
        }
        self.config.data_parallel
    }

    /// Whether the job runs across processes (`JobBuilder::cluster`).
    pub(super) fn is_remote(&self) -> bool {
        #[cfg(feature = "cluster")]
        return self.cluster.is_some();
        #[cfg(not(feature = "cluster"))]
        false
    }

    /// What every data-parallel stage trains with (JOB-1 checks of the model, loss and batch).
    pub(super) fn stage_spec(
        &mut self,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
    ) -> Result<Arc<StageSpec<M, I>>> {
        let invalid = |m: String| Err(Error::InvalidConfig(m));
        let Some(model_fn) = self.model.take() else {
            return invalid(
                "no model: call .model(..) or .initial_model(..), or .pipeline(stages, schedule)"
                    .into(),
            );
        };
        let Some(loss_fn) = self.loss.take() else {
            return invalid("no loss: call .loss(|model, samples, device| ..)".into());
        };
        if self.config.reduction.zero.shards_parameters() {
            return invalid(
                "zero(Three) shards each block's parameters between uses, so it needs the \
                 model as blocks: give it with .blocks(stages) (or .pipeline(..)) instead of \
                 .model(..) / .initial_model(..), or use zero(Two)"
                    .into(),
            );
        }
        let dp = self.config.data_parallel as usize;
        let k = self.config.accumulation as usize;
        check_batch(global, dp, k)?;
        Ok(Arc::new(StageSpec {
            model_fn,
            loss_fn,
            dataset,
            optimizer: self.config.optimizer.clone(),
            learning_rate: self.learning_rate_now()?,
            bucket_elems: self.config.reduction.bucket_bytes / 4,
            clip_norm: self.config.clip_norm,
            zero: self.config.reduction.zero,
            local: self.config.reduction.local_updates,
            non_finite: self.config.non_finite,
            epoch: Instant::now(),
            faults: self.faults.clone(),
            mixed: self.mixed(),
            compression: self.config.reduction.compression,
        }))
    }

    /// The pipeline job's spawner, layout and accumulation (its micro-batches).
    fn pipeline_parts(
        &mut self,
        p: PipelineParts<M, I>,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
    ) -> Result<(Box<dyn Spawner<M>>, Layout, u32)> {
        #[cfg(feature = "cluster")]
        if let Some(mesh) = self.cluster.take() {
            let spawn = p.cluster.spawn;
            let world = Some(mesh.world_size() as u32);
            let (spec, layout) = self.pipeline_spec(p, global, dataset, world)?;
            let m = spec.plan.micro_batches();
            return Ok((spawn(mesh, spec, layout), layout, m));
        }
        let spawn = p.spawn;
        let (spec, layout) = self.pipeline_spec(p, global, dataset, None)?;
        let m = spec.plan.micro_batches();
        Ok((spawn(spec), layout, m))
    }

    /// What every stage of a pipeline job trains with, and the dp × pp layout (JOB-1 checks).
    /// `world`: the ranks of a job across processes (its replicas are world ÷ stages).
    pub(super) fn pipeline_spec(
        &mut self,
        p: PipelineParts<M, I>,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
        world: Option<u32>,
    ) -> Result<(Arc<PipelineSpec<I>>, Layout)> {
        let invalid = |m: String| Err(Error::InvalidConfig(m));
        if let Some(problem) = p.stages.problem() {
            return invalid(problem);
        }
        if let Some(problem) = self.tensor_parallel_problem(&p.stages) {
            return invalid(problem);
        }
        let Some(pipeline) = self.config.pipeline else {
            return self.blocks_spec(p.stages, global, dataset, world);
        };
        let schedule = pipeline.schedule;
        // Accumulation over n passes is the schedule over n times its micro-batches.
        let Some(schedule) = schedule.accumulated(self.config.accumulation) else {
            return invalid(format!(
                "gradient_accumulation({}) × {} micro-batches does not fit a step",
                self.config.accumulation,
                schedule.micro_batches()
            ));
        };
        let v = schedule.virtual_stages() as usize;
        let blocks = p.stages.len();
        if !blocks.is_multiple_of(v) {
            return invalid(format!(
                "{blocks} blocks do not split into stages of {v} virtual stages each: give a \
                 multiple of {v} blocks"
            ));
        }
        let pp = (blocks / v) as u32;
        if pipeline.stages != pp {
            return invalid(format!(
                "the description's pipeline has {} stage(s), but {blocks} blocks of {v} virtual \
                 stage(s) each make {pp}: give stages = {pp}, or cut the model into {} blocks",
                pipeline.stages,
                pipeline.stages as usize * v
            ));
        }
        if let Some(world) = world {
            self.config.data_parallel = self.replicas_in(world, pp)?;
        }
        let plan = schedule.instructions(pp)?;
        let dp = self.config.data_parallel as usize;
        let m = schedule.micro_batches() as usize;
        check_batch(global, dp, m)?;
        let spec = self.stages_spec(p.stages, plan, dataset)?;
        Ok((
            spec,
            Layout::new(self.config.data_parallel, pp, self.config.tensor_parallel)?,
        ))
    }

    /// A block job's spec: one stage per replica holding every block, running
    /// [`PipelineSchedule::sequential`](crate::parallel::pipeline::PipelineSchedule::sequential)
    /// over the accumulation's micro-batches.
    fn blocks_spec(
        &mut self,
        stages: PipelineStages<I>,
        global: usize,
        dataset: Arc<dyn Dataset<Item = I>>,
        world: Option<u32>,
    ) -> Result<(Arc<PipelineSpec<I>>, Layout)> {
        if let Some(world) = world {
            self.config.data_parallel = self.replicas_in(world, 1)?;
        }
        let plan = crate::parallel::pipeline::PipelineSchedule::sequential(
            stages.len() as u32,
            self.config.accumulation,
        )?;
        check_batch(
            global,
            self.config.data_parallel as usize,
            self.config.accumulation as usize,
        )?;
        let spec = self.stages_spec(stages, plan, dataset)?;
        Ok((
            spec,
            Layout::new(self.config.data_parallel, 1, self.config.tensor_parallel)?,
        ))
    }

    /// The replicas of a job across processes whose world is `world` ranks, each replica `pp`
    /// stages × `tensor_parallel` ranks.
    fn replicas_in(&self, world: u32, pp: u32) -> Result<u32> {
        let per_replica = pp * self.config.tensor_parallel.max(1);
        if world.is_multiple_of(per_replica)
            && (self.config.data_parallel == 1 || self.config.data_parallel * per_replica == world)
        {
            return Ok(world / per_replica);
        }
        Err(Error::InvalidConfig(format!(
            "a mesh of {pp} stage(s) × tensor_parallel({}) on a cluster of {world} rank(s): the \
             world must be replicas × {per_replica}; leave data_parallel unset",
            self.config.tensor_parallel
        )))
    }

    /// Why this job cannot be split `tensor_parallel(t)` ways (t > 1): what is not done yet
    /// is refused here, with what to change.
    fn tensor_parallel_problem(&self, stages: &PipelineStages<I>) -> Option<String> {
        let t = self.config.tensor_parallel;
        if t == 0 {
            return Some("tensor_parallel(0): the degree must be at least 1".into());
        }
        if t == 1 {
            return None;
        }
        stages.tensor_parallel_problem(t as usize)
    }

    fn stages_spec(
        &self,
        stages: PipelineStages<I>,
        plan: crate::parallel::pipeline::PipelineSchedule,
        dataset: Arc<dyn Dataset<Item = I>>,
    ) -> Result<Arc<PipelineSpec<I>>> {
        Ok(Arc::new(PipelineSpec {
            stages,
            plan: Arc::new(plan),
            dataset,
            optimizer: self.config.optimizer.clone(),
            learning_rate: self.learning_rate_now()?,
            zero: self.config.reduction.zero,
            compression: self.config.reduction.compression,
            local: self.config.reduction.local_updates,
            clip: self.config.clip_norm,
            blocks_in_flight: self.config.blocks_in_flight,
            recompute: self.config.recompute,
            epoch: Instant::now(),
            faults: self.faults.clone(),
            mixed: self.mixed(),
        }))
    }
}
