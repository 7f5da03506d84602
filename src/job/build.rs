//! `JobBuilder::build`: check the configuration (JOB-1) and assemble the specs the
//! Supervisor and the stage actors are spawned from.

use super::*;

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
        let Some(global) = self.batch_size else {
            return invalid("no batch size: call .batch_size(global_batch)".into());
        };
        if self.dp == 0 {
            return invalid("data_parallel(0): use at least 1 replica".into());
        }
        if self.accumulation == 0 {
            return invalid("gradient_accumulation(0): use at least 1 micro-batch".into());
        }
        if self.bucket_bytes < 4 {
            return invalid("bucket_bytes below one f32: use at least 4 bytes".into());
        }
        if self.event_capacity == 0 {
            return invalid("event_capacity(0): keep at least 1 event".into());
        }
        self.check_link_and_timeouts()?;
        if self.zero.shards_optimizer()
            && let Err(e) = FlatRule::of(&self.optimizer)
        {
            return invalid(format!("zero({:?}): {e}", self.zero));
        }
        let remote = self.is_remote();
        #[cfg(feature = "cluster")]
        if let Some(problem) = &self.spec_problem {
            return invalid(problem.clone());
        }
        // Every refused combination of strategies, from the one table (COMP-1).
        self.plan().check()?;
        self.check_strategy_values(self.dp)?;
        let server = parameter_server::check(
            self.parameter_server.0,
            self.parameter_server.1,
            parameter_server::JobShape {
                workers: self.workers(),
                optimizer: &self.optimizer,
                learning_rate: &self.learning_rate,
            },
        )?;
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
        let precision = self.mixed.precision;
        let dtype = crate::parallel::autocast::float_dtype(precision);
        if let Some(d) = devices.iter().find(|d| !d.burn().supports_dtype(dtype)) {
            return invalid(format!(
                "precision({precision}): device {} does not compute in {precision}; use \
                 Precision::F32 or devices that support it",
                d.id()
            ));
        }
        if let Some(f) = &self.faults {
            f.plan().check()?;
            // COMM-8: a corrupted message is only caught where payloads are checked.
            if f.corrupts_messages() {
                self.comm.verify_payloads = true;
            }
        }
        let sink = match (self.checkpoint_sink.take(), &self.checkpoint_dir) {
            (Some(sink), _) => Some(sink),
            (None, Some(dir)) => Some(Arc::new(CheckpointStore::open(
                dir.clone(),
                self.keep_checkpoints,
            )?) as Arc<dyn CheckpointSink>),
            (None, None) => None,
        };

        let checkpoints = match sink {
            Some(sink) => Some(CheckpointSettings {
                sink,
                every: self.checkpoint_every,
                resume: self.resume,
                require: self.require_checkpoint,
            }),
            None if self.checkpoint_every.is_some() || self.resume => {
                return invalid(
                    "checkpoint_every or resume without a place for checkpoints: add \
                     .checkpoint_dir(dir)"
                        .into(),
                );
            }
            None => None,
        };
        if self.comm.timeout >= self.step_timeout {
            return invalid(format!(
                "collective_timeout {:?} is not below step_timeout {:?}: a rank that never \
                 arrives must be named by its collective before the step gives up",
                self.comm.timeout, self.step_timeout
            ));
        }
        if self.elastic.0 > self.elastic.1 {
            return invalid(format!(
                "elastic({}, {}): the minimum is above the maximum",
                self.elastic.0, self.elastic.1
            ));
        }
        if self.checkpoint_every == Some(0) {
            return invalid("checkpoint_every(0): use at least 1 step".into());
        }
        let sampler = DistributedSampler::new(dataset.len(), global, self.seed)?;
        // Last, once nothing else refuses the job: a required checkpoint in a directory that
        // does not exist is missing (the directory is not made for it), and a place checkpoints
        // cannot be written to is refused before any training (CKPT-7).
        if let (Some(settings), Some(dir)) = (&checkpoints, &self.checkpoint_dir)
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
            args: Some(JobParts {
                spawn,
                items: std::marker::PhantomData,
                devices,
                remote,
                layout,
                steps: self.steps,
                accumulation,
                sampler,
                comm: self.comm,
                step_timeout: self.step_timeout,
                event_capacity: self.event_capacity,
                faults: self.faults,
                recovery: self.recovery,
                checkpoints,
                seed: self.seed,
                elastic: self.elastic,
                elastic_wait: self.elastic_wait,
                stragglers: self.stragglers,
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
        let Some(spawn) = self.replicas else {
            return Err(Error::InvalidConfig(
                "no model: call .model(..) or .initial_model(..), or .pipeline(stages, schedule)"
                    .into(),
            ));
        };
        if self.tp != 1 {
            return Err(Error::InvalidConfig(format!(
                "tensor_parallel({}) splits blocks: give the model as tensor-parallel blocks \
                 with .blocks(stages) or .pipeline(stages, schedule) instead of .model(..)",
                self.tp
            )));
        }
        #[cfg(feature = "cluster")]
        if let Some(mesh) = self.cluster.take() {
            let world = mesh.world_size() as u32;
            if self.dp != 1 && self.dp != world {
                return Err(Error::InvalidConfig(format!(
                    "data_parallel({}) on a cluster of {world} rank(s): a job across processes \
                     has one replica per rank; leave data_parallel unset",
                    self.dp
                )));
            }
            let Some(fns) = self.replica_cluster.take() else {
                return Err(Error::InvalidConfig(
                    "no model: call .model(..) or .initial_model(..)".into(),
                ));
            };
            self.dp = world;
            let spec = self.stage_spec(global, dataset)?;
            let layout = Layout::data_parallel(world)?;
            if let (Some(server), Some(ps)) = (server, self.ps_cluster.take()) {
                return Ok(((ps.spawn)(mesh, spec, server), layout, self.accumulation));
            }
            return Ok(((fns.spawn)(mesh, spec, layout), layout, self.accumulation));
        }
        let spec = self.stage_spec(global, dataset)?;
        if let (Some(server), Some(ps)) = (server, self.parameter_server.2) {
            let layout = Layout::data_parallel(self.dp)?;
            return Ok((ps(spec, server), layout, self.accumulation));
        }
        Ok((
            spawn(spec),
            Layout::data_parallel(self.dp)?,
            self.accumulation,
        ))
    }

    /// JOB-1 of the emulated link, the time-outs and the loss scaler (what a job spec carries
    /// of them is checked by a node too: `check_across_processes`).
    pub(super) fn check_link_and_timeouts(&self) -> Result<()> {
        if let Some(link) = &self.comm.link
            && let Err(e) = link.validate()
        {
            return Err(Error::InvalidConfig(format!("link_emulation: {e}")));
        }
        if self.comm.timeout.is_zero() || self.step_timeout.is_zero() {
            return Err(Error::InvalidConfig(
                "a time-out of zero: use a positive duration".into(),
            ));
        }
        if self.mixed.precision.scales_loss() {
            self.mixed.scaler.validate()?;
        }
        Ok(())
    }

    /// JOB-1 of the compression (and its ZeRO stage) and the local updates over `replicas`.
    pub(super) fn check_strategy_values(&self, replicas: u32) -> Result<()> {
        self.compression.validate()?;
        if let Some(updates) = &self.local_updates {
            local_updates::check(updates, replicas, self.steps)?;
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
        self.dp
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
        if self.zero.shards_parameters() {
            return invalid(
                "zero(Three) shards each block's parameters between uses, so it needs the \
                 model as blocks: give it with .blocks(stages) (or .pipeline(..)) instead of \
                 .model(..) / .initial_model(..), or use zero(Two)"
                    .into(),
            );
        }
        let dp = self.dp as usize;
        let k = self.accumulation as usize;
        check_batch(global, dp, k)?;
        Ok(Arc::new(StageSpec {
            model_fn,
            loss_fn,
            dataset,
            optimizer: self.optimizer.clone(),
            learning_rate: self.learning_rate.clone(),
            bucket_elems: self.bucket_bytes / 4,
            clip_norm: self.clip_norm,
            zero: self.zero,
            local: self.local_updates,
            non_finite: self.non_finite,
            epoch: Instant::now(),
            faults: self.faults.clone(),
            mixed: self.mixed,
            compression: self.compression,
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
        let Some(schedule) = p.schedule else {
            return self.blocks_spec(p.stages, global, dataset, world);
        };
        // Accumulation over n passes is the schedule over n times its micro-batches.
        let Some(schedule) = schedule.accumulated(self.accumulation) else {
            return invalid(format!(
                "gradient_accumulation({}) × {} micro-batches does not fit a step",
                self.accumulation,
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
        if let Some(world) = world {
            self.dp = self.replicas_in(world, pp)?;
        }
        let plan = schedule.instructions(pp)?;
        let dp = self.dp as usize;
        let m = schedule.micro_batches() as usize;
        check_batch(global, dp, m)?;
        let spec = self.stages_spec(p.stages, plan, dataset);
        Ok((spec, Layout::new(self.dp, pp, self.tp)?))
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
            self.dp = self.replicas_in(world, 1)?;
        }
        let plan = crate::parallel::pipeline::PipelineSchedule::sequential(
            stages.len() as u32,
            self.accumulation,
        )?;
        check_batch(global, self.dp as usize, self.accumulation as usize)?;
        let spec = self.stages_spec(stages, plan, dataset);
        Ok((spec, Layout::new(self.dp, 1, self.tp)?))
    }

    /// The replicas of a job across processes whose world is `world` ranks, each replica `pp`
    /// stages × `tensor_parallel` ranks.
    fn replicas_in(&self, world: u32, pp: u32) -> Result<u32> {
        let per_replica = pp * self.tp.max(1);
        if world.is_multiple_of(per_replica) && (self.dp == 1 || self.dp * per_replica == world) {
            return Ok(world / per_replica);
        }
        Err(Error::InvalidConfig(format!(
            "a mesh of {pp} stage(s) × tensor_parallel({}) on a cluster of {world} rank(s): the \
             world must be replicas × {per_replica}; leave data_parallel unset",
            self.tp
        )))
    }

    /// Why this job cannot be split `tensor_parallel(t)` ways (t > 1): what is not done yet
    /// is refused here, with what to change.
    fn tensor_parallel_problem(&self, stages: &PipelineStages<I>) -> Option<String> {
        let t = self.tp;
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
    ) -> Arc<PipelineSpec<I>> {
        Arc::new(PipelineSpec {
            stages,
            plan: Arc::new(plan),
            dataset,
            optimizer: self.optimizer.clone(),
            learning_rate: self.learning_rate.clone(),
            zero: self.zero,
            compression: self.compression,
            local: self.local_updates,
            clip: self.clip_norm,
            blocks_in_flight: self.blocks_in_flight,
            epoch: Instant::now(),
            faults: self.faults.clone(),
            mixed: self.mixed,
        })
    }
}
