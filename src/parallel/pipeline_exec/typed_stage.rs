//! `TypedStage`: a block's Burn work behind [`StageWork`] — forward and backward with the
//! block's precision, activation recompute, tensor-parallel collectives and its gradient
//! sync's hooks, and what is stashed between a micro-batch's forward and backward.

use super::*;

pub(super) type ForwardFn<M> = Box<dyn Fn(&M, Boundary, &TensorParallel) -> Boundary + Send>;
pub(super) type LossFn<M, I> =
    Box<dyn Fn(&M, Boundary, &[I], &Device, &TensorParallel) -> Tensor<1> + Send>;

/// One stage of a pipeline: a Burn module, what it computes, its optimizer.
pub(crate) struct TypedStage<M: Module, I> {
    pub(super) model: M,
    pub(super) device: Device,
    pub(super) forward: Option<ForwardFn<M>>,
    pub(super) loss: Option<LossFn<M, I>>,
    /// How the block's replicas keep gradients, parameters and optimizer state in step.
    pub(super) sync: Box<dyn GradientSync<M>>,
    pub(super) optimizer: OptimizerConfig,
    pub(super) lr: LearningRate,
    pub(super) stash: HashMap<u32, (Boundary, Stashed)>,
    pub(super) accumulated: GradientsAccumulator<M>,
    pub(super) losses: Vec<f32>,
    pub(super) recompute: bool,
    /// Release a sharded block's full parameters after each forward (ZeRO-3; the last
    /// block never does: its backward follows its forward).
    pub(super) reshard_after_forward: bool,
    /// Whether the sync shards the parameters (ZeRO-3).
    pub(super) shards_params: bool,
    /// The module a released block's forward ran with, kept for that micro-batch's
    /// backward when the forward is not recomputed: Burn's graph holds its tensors anyway,
    /// and the gradients are found through them.
    pub(super) kept: HashMap<u32, M>,
    /// The step's reduced gradient, between `reduce` and `apply`.
    pub(super) reduced: Option<sync::Reduced>,
    /// Gradient bytes held now.
    pub(super) grads_bytes: u64,
    /// Trainable parameter elements.
    pub(super) param_len: usize,
    /// False on the first stage (set by each forward).
    pub(super) input_grads: bool,
    /// What forward and backward compute in (MIX-1).
    pub(super) precision: Precision,
    /// The type the block's gradient reduction travels in: `f32`, or the 16-bit compute type
    /// with `.low_precision_gradients(true)` (COMM-5: reduced in `f32`, rounded once).
    pub(super) gradient_wire: Precision,
    /// The loss is multiplied by this before backward (MIX-2).
    pub(super) loss_scale: f32,
    /// The rank's tensor-parallel group (a group of one unless the block is
    /// tensor-parallel).
    pub(super) tp: Arc<TensorParallel>,
    /// A tensor-parallel block's split parameters and their axes (TP-1..2).
    pub(super) split: Option<HashMap<ParamId, usize>>,
    /// A tensor-parallel block's flat trainable order (of its slices, unsharded), for the
    /// global norm's count of each element once.
    pub(super) split_layout: Option<crate::parallel::gradients::ParamLayout>,
    /// Builds the model's input from a micro-batch's items, when this is the first block.
    pub(super) inputs: Option<InputsFn<I>>,
}

pub(super) enum Stashed {
    Outputs(Boundary),
    Loss(Box<Tensor<1>>),
    /// Only the inputs are kept; the forward runs again during backward (recompute).
    Nothing,
}

impl<M: Module, I> std::fmt::Debug for TypedStage<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TypedStage({} stashed)", self.stash.len())
    }
}

impl<M: Module + 'static, I: 'static> TypedStage<M, I> {
    /// A middle (or first) stage computing `forward`, on `device` (autodiff is turned on).
    pub(crate) fn new(
        model: M,
        forward: impl Fn(&M, Boundary, &TensorParallel) -> Boundary + Send + 'static,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        Self::build(model, Some(Box::new(forward)), None, optimizer, lr, device)
    }

    /// The last stage: its forward ends in the mean loss over the micro-batch's items.
    pub(crate) fn last(
        model: M,
        loss: impl Fn(&M, Boundary, &[I], &Device, &TensorParallel) -> Tensor<1> + Send + 'static,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        Self::build(model, None, Some(Box::new(loss)), optimizer, lr, device)
    }

    fn build(
        model: M,
        forward: Option<ForwardFn<M>>,
        loss: Option<LossFn<M, I>>,
        optimizer: &OptimizerConfig,
        lr: LearningRate,
        device: &Device,
    ) -> Self {
        let device = device.clone().autodiff();
        let model = model.fork(&device).train();
        let sync = sync::for_stage(
            ZeroStage::Off,
            &model,
            &device,
            optimizer,
            BUCKET_ELEMS,
            FUSE_BELOW,
            0,
            1,
        )
        .expect("whole (unsharded) optimizer state supports every optimizer");
        let param_len = crate::parallel::gradients::ParamLayout::trainable(&model).len();
        Self {
            reshard_after_forward: true,
            shards_params: false,
            kept: HashMap::new(),
            reduced: None,
            grads_bytes: 0,
            param_len,
            sync,
            model,
            device,
            forward,
            loss,
            optimizer: optimizer.clone(),
            lr,
            stash: HashMap::new(),
            accumulated: GradientsAccumulator::new(),
            losses: Vec::new(),
            recompute: false,
            input_grads: true,
            precision: Precision::F32,
            gradient_wire: Precision::F32,
            loss_scale: 1.0,
            tp: Arc::new(TensorParallel::single()),
            split: None,
            split_layout: None,
            inputs: None,
        }
    }

    /// Build the input of a forward from a micro-batch's items with `inputs` when the block
    /// is the model's first (the walk asks for it with [`BlockInput::Data`]).
    pub(crate) fn with_inputs(mut self, inputs: InputsFn<I>) -> Self {
        self.inputs = Some(inputs);
        self
    }

    /// Make this a tensor-parallel block of `tp`'s group, whose module is the rank's part
    /// with these split parameters (TP-1..2).
    pub(crate) fn with_tensor_parallel(
        mut self,
        tp: Arc<TensorParallel>,
        split: HashMap<ParamId, usize>,
    ) -> Self {
        self.tp = tp;
        self.split = Some(split);
        self.split_layout = Some(crate::parallel::gradients::ParamLayout::trainable(
            &self.model,
        ));
        self
    }

    /// Whether the block's backward follows the tensor-parallel rules (TP-1..2).
    fn splits(&self) -> bool {
        self.split.is_some() && self.tp.degree() > 1
    }

    /// The tensor-parallel group's failure during `during`, if one happened (TP-4).
    fn tp_failed(&self, mb: u32, during: &'static str) -> Result<(), ExecError> {
        match self.tp.take_failure() {
            Some(TpFailure::Comm(cause)) => Err(ExecError::TensorParallel {
                stage: u32::MAX,
                block: u32::MAX,
                mb,
                during,
                cause,
            }),
            Some(TpFailure::SecondRegion) => Err(ExecError::TensorParallelRegions {
                stage: u32::MAX,
                block: u32::MAX,
            }),
            None => Ok(()),
        }
    }

    /// TP-2: sum each replicated parameter's gradient over the tensor-parallel group.
    fn sum_replicated(&self, grads: &mut GradientsParams) {
        struct Sum<'a> {
            grads: &'a mut GradientsParams,
            split: &'a HashMap<ParamId, usize>,
            tp: &'a TensorParallel,
        }
        impl burn::module::ModuleVisitor for Sum<'_> {
            fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<D>>) {
                if self.split.contains_key(&param.id) {
                    return;
                }
                let Some(g) = self.grads.remove::<D>(param.id) else {
                    return;
                };
                let device = g.device();
                let dims = g.dims().to_vec();
                let mut values = g
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .unwrap_or_default();
                self.tp.sum_parameter(&mut values);
                self.grads.register::<D>(
                    param.id,
                    Tensor::from_data(TensorData::new(values, dims), &device),
                );
            }
        }
        if let Some(split) = &self.split {
            self.model.visit(&mut Sum {
                grads,
                split,
                tp: &self.tp,
            });
        }
    }

    /// Keep only each micro-batch's inputs between its forward and its backward, and run the
    /// forward again during backward: less memory for more compute (activation
    /// checkpointing). Has no effect on the last stage, whose backward follows its forward. A
    /// forward that draws random numbers (dropout) draws them again when recomputed.
    pub(crate) fn with_recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// Whether a sharded (ZeRO-3) block releases its full parameters after each forward and
    /// gathers them again for the backward (true), or keeps them until its backward.
    pub(crate) fn with_reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }

    fn sync_cx<'a>(
        device: &'a Device,
        scale: f32,
        replicas: Option<&'a mut Communicator>,
    ) -> SyncContext<'a> {
        SyncContext {
            comm: replicas,
            device,
            scale,
            share: 1.0,
            clip: None,
            direct: false,
            spans: Vec::new(),
            precision: sync::SyncPrecision::default(),
        }
    }
}

impl<M: Module + 'static, I: 'static> BlockStep<I> for TypedStage<M, I> {
    fn forward(
        &mut self,
        mb: u32,
        input: BlockInput,
        items: &[I],
    ) -> Result<Option<Vec<WireTensor>>, ExecError> {
        // The first block builds its input from the data (no gradient of it is computed); a
        // later one takes what it received (on the autodiff device, as leaves of the graph).
        let (input, input_grads) = match input {
            BlockInput::Data => {
                let inputs = self.inputs.as_ref().ok_or_else(|| {
                    ExecError::Unsupported(
                        "the first block has no way to build its input from the data".into(),
                    )
                })?;
                (inputs(items, &self.device), false)
            }
            BlockInput::Received(wire) => {
                let device = &self.device;
                // MIX-1: what a block receives comes in its compute type, so a block written
                // in f32 needs no cast of its own input.
                let dtype = crate::parallel::autocast::float_dtype(self.precision);
                let input = wire
                    .into_iter()
                    .map(|w| AnyTensor::from_wire(w, device).map(|t| t.cast(dtype)))
                    .collect::<Result<Boundary, _>>()?;
                (input, true)
            }
        };
        self.input_grads = input_grads;
        let leaves: Boundary = if input_grads {
            input.into_iter().map(AnyTensor::require_grad).collect()
        } else {
            input
        };
        // MIX-1: the forward runs on a low-precision copy whose casts hand the f32 master its
        // gradients (the identity at f32); the loss is f32.
        let model = low_precision_copy(&self.model, self.precision);
        if let Some(loss) = &self.loss {
            self.tp.begin_block();
            let l =
                loss(&model, leaves.clone(), items, &self.device, &self.tp).cast(FloatDType::F32);
            self.tp_failed(mb, "the loss")?;
            self.losses.push(l.clone().into_scalar());
            self.stash.insert(mb, (leaves, Stashed::Loss(Box::new(l))));
            Ok(None)
        } else {
            let forward = self
                .forward
                .as_ref()
                .expect("a stage has a forward or a loss");
            self.tp.begin_block();
            let out = forward(&model, leaves.clone(), &self.tp);
            drop(model);
            self.tp_failed(mb, "the forward")?;
            if self.recompute {
                // Keep the inputs' values only: no graph survives until the backward.
                let inputs = leaves.iter().map(AnyTensor::detached).collect();
                self.stash.insert(mb, (inputs, Stashed::Nothing));
            } else {
                self.stash
                    .insert(mb, (leaves, Stashed::Outputs(out.clone())));
            }
            if self.shards_params && self.reshard_after_forward {
                let used = self.model.clone();
                self.model = self.sync.release(self.model.clone());
                if !self.recompute {
                    self.kept.insert(mb, used);
                }
            }
            Ok(Some(out.iter().map(AnyTensor::to_wire).collect()))
        }
    }

    fn backward(
        &mut self,
        mb: u32,
        grad_out: Option<Vec<WireTensor>>,
    ) -> Result<Vec<WireTensor>, ExecError> {
        let missing = |what: &str| ExecError::MissingInput {
            stage: u32::MAX,
            mb,
            instr: what.to_string(),
        };
        let (leaves, stashed) = self.stash.remove(&mb).ok_or_else(|| missing("backward"))?;
        // The module the graph was built with: the one kept at the forward, or this one.
        let used = self.kept.remove(&mb);
        let (leaves, stashed) = match stashed {
            Stashed::Nothing => {
                let forward = self
                    .forward
                    .as_ref()
                    .expect("recompute is for middle stages");
                let leaves: Boundary = if self.input_grads {
                    leaves.into_iter().map(AnyTensor::require_grad).collect()
                } else {
                    leaves
                };
                self.tp.begin_block();
                let out = forward(
                    &low_precision_copy(&self.model, self.precision),
                    leaves.clone(),
                    &self.tp,
                );
                self.tp_failed(mb, "the recomputed forward")?;
                (leaves, Stashed::Outputs(out))
            }
            other => (leaves, other),
        };
        // TP-1: a tensor-parallel block's backward is seeded with the output gradient / T.
        let seed = if self.splits() {
            1.0 / self.tp.degree() as f32
        } else {
            1.0
        };
        let mut grads = match (stashed, grad_out) {
            (Stashed::Loss(l), _) if self.loss_scale * seed != 1.0 => {
                (*l * (self.loss_scale * seed)).backward()
            }
            (Stashed::Loss(l), _) => l.backward(),
            (Stashed::Outputs(out), Some(g)) => {
                if g.len() != out.len() {
                    return Err(ExecError::ShapeMismatch {
                        stage: u32::MAX,
                        mb,
                    });
                }
                let mut total: Option<Tensor<1>> = None;
                for (h, g) in out.iter().zip(g) {
                    let g = AnyTensor::from_wire(g, &self.device.clone().inner())?;
                    let d = h.dot(&g).ok_or(ExecError::ShapeMismatch {
                        stage: u32::MAX,
                        mb,
                    })?;
                    total = Some(match total {
                        Some(t) => t + d,
                        None => d,
                    });
                }
                let total = total.ok_or_else(|| missing("backward (no outputs)"))?;
                if seed != 1.0 {
                    (total * seed).backward()
                } else {
                    total.backward()
                }
            }
            (Stashed::Outputs(_), None) => return Err(missing("backward (no gradient)")),
            (Stashed::Nothing, _) => unreachable!("recomputed above"),
        };
        let mut upstream: Vec<WireTensor> = if self.input_grads {
            leaves.iter().map(|x| x.grad_wire(&grads)).collect()
        } else {
            Vec::new()
        };
        if self.splits() {
            // TP-1: Megatron's `f` — the inputs' gradients summed over the group.
            for g in &mut upstream {
                self.tp.sum_activation(&mut g.values);
            }
            self.tp_failed(mb, "the sum of the input gradient")?;
        }
        let params = GradientsParams::from_module(&mut grads, used.as_ref().unwrap_or(&self.model));
        drop(used);
        self.accumulated.accumulate(&self.model, params);
        self.grads_bytes = 4 * self.param_len as u64;
        // A sharded block keeps only its shard until its next use (FSDP-1).
        self.model = self.sync.release(self.model.clone());
        Ok(upstream)
    }

    fn gather_plan(&self, uses: &[Option<u32>]) -> Vec<bool> {
        if !self.shards_params {
            return vec![false; uses.len()];
        }
        // What `forward` and `backward` do to the module, replayed: a middle block releases
        // after its forward when resharding (keeping the module for the backward unless it
        // recomputes), every block releases after its backward.
        let middle = self.loss.is_none();
        let releases_after_forward = middle && self.reshard_after_forward;
        let keeps = releases_after_forward && !self.recompute;
        let mut full = self.sync.holds_full();
        uses.iter()
            .map(|u| match u {
                None => {
                    let need = !full;
                    full = !releases_after_forward;
                    need
                }
                Some(_) => {
                    let need = !keeps && !full;
                    full = false;
                    need
                }
            })
            .collect()
    }

    fn start_gather(&mut self, rank_of: (usize, usize)) -> Result<Option<Collective>, ExecError> {
        self.sync
            .start_gather(&self.model, rank_of)
            .map_err(sync_failed)
    }

    fn finish_gather(&mut self, full: Vec<f32>) {
        self.model = self.sync.finish_gather(self.model.clone(), full);
    }

    fn start_reduce(&mut self, rank_of: (usize, usize)) -> Result<Collective, ExecError> {
        let mut grads = self.accumulated.grads();
        if self.splits() {
            self.sum_replicated(&mut grads);
            self.tp_failed(0, "the sum of the replicated parameters' gradients")?;
        }
        let collective = self
            .sync
            .start_reduce(&self.model, grads, rank_of)
            .map_err(sync_failed)?
            .travelling_as(self.gradient_wire);
        // The flat gradient is held (queued or being reduced) until the result comes.
        self.grads_bytes = 4 * self.param_len as u64;
        Ok(collective)
    }

    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        rank_of: (usize, usize),
    ) -> Result<(), ExecError> {
        let reduced = self
            .sync
            .finish_reduce(out, scale, rank_of)
            .map_err(sync_failed)?;
        self.grads_bytes = self.sync.held().grads;
        self.reduced = Some(reduced);
        Ok(())
    }

    fn reduced(&self) -> bool {
        self.reduced.is_some()
    }

    fn norm_part(&self, tp_rank: usize) -> Option<(f64, bool)> {
        let reduced = self.reduced.as_ref()?;
        match (&self.split, &self.split_layout) {
            _ if tp_rank == 0 => reduced.sum_of_squares(),
            // CLIP-1: rank 0 counts what every tensor-parallel rank holds whole, each rank
            // its own slices.
            (Some(split), Some(layout)) if self.splits() => {
                let (lo, hi) = self.sync.held().owned;
                reduced.sum_of_squares_of(layout, lo as usize..hi as usize, |id| {
                    split.contains_key(&id)
                })
            }
            // An ordinary block runs whole on every tensor-parallel rank: nothing of it is
            // this rank's to count (the flag kept, so the data-parallel sum is entered alike).
            _ => reduced.sum_of_squares().map(|(_, shard)| (0.0, shard)),
        }
    }

    fn clip(&mut self, norm: f32, max_norm: f32) {
        if let Some(r) = self.reduced.as_mut() {
            r.clip_to(norm, max_norm);
        }
    }

    fn apply(&mut self, replicas: Option<&mut Communicator>) -> Result<f64, ExecError> {
        let reduced = self.reduced.take().ok_or_else(|| ExecError::MissingInput {
            stage: u32::MAX,
            mb: 0,
            instr: "the update (no reduced gradient)".into(),
        })?;
        let inner = self.device.clone().inner();
        let mut cx = Self::sync_cx(&inner, 1.0, replicas);
        // LR-1: the schedule advances only with an applied step.
        let (lr, lr_after) = self.lr.peek_next();
        let rate = lr.base();
        // The stage holds an empty placeholder while the sync updates the model, so the
        // update owns each parameter's data alone and reads it without a copy (a clone kept
        // here would make every read copy the parameter, and its pages fresh each step).
        let placeholder = crate::parallel::gradients::release_trainable(self.model.clone());
        let model = std::mem::replace(&mut self.model, placeholder);
        self.model = match self.sync.apply(model, reduced, lr, &mut cx) {
            Ok(model) => model,
            Err((model, e)) => {
                self.model = model;
                return Err(sync_failed(e));
            }
        };
        self.grads_bytes = 0;
        self.lr.commit(lr_after);
        Ok(rate)
    }

    fn memory(&self) -> BlockBytes {
        let whole = 4 * self.param_len as u64;
        let held = self.sync.held();
        BlockBytes {
            full_params: whole * (u64::from(self.sync.holds_full()) + self.kept.len() as u64),
            param_shard: if self.shards_params { held.params } else { 0 },
            grads: self.grads_bytes,
            optimizer: held.optimizer,
            activations: self.stashed().1,
        }
    }

    fn take_losses(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.losses)
    }

    fn stashed(&self) -> (u32, u64) {
        let bytes = self
            .stash
            .values()
            .map(|(inputs, kept)| {
                boundary_bytes(inputs)
                    + match kept {
                        Stashed::Outputs(o) => boundary_bytes(o),
                        Stashed::Loss(_) => 4,
                        Stashed::Nothing => 0,
                    }
            })
            .sum();
        (self.stash.len() as u32, bytes)
    }

    fn begin_step(&mut self) {
        // A sharded block starts every step from its shard (an unfinished attempt or a
        // fingerprint may have left it whole), so every replica's `gather_plan` is the same.
        if self.shards_params {
            self.model = self.sync.release(self.model.clone());
        }
        self.stash.clear();
        self.kept.clear();
        self.reduced = None;
        self.grads_bytes = 0;
        self.accumulated = GradientsAccumulator::new();
        self.losses.clear();
        // A failure an unfinished attempt left behind is not this step's (TP-4).
        let _ = self.tp.take_failure();
    }

    fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    fn overflowed(&self) -> bool {
        self.reduced
            .as_ref()
            .is_some_and(sync::Reduced::has_non_finite)
    }
}

impl<M: Module + 'static, I: 'static> StageWork<I> for TypedStage<M, I> {
    fn recompute_always(&mut self) {
        self.recompute = true;
    }

    fn gather_now(&mut self, replicas: Option<&mut Communicator>) -> Result<(), ExecError> {
        match self.sync.gather(self.model.clone(), replicas) {
            Ok(model) => {
                self.model = model;
                Ok(())
            }
            Err((model, e)) => {
                self.model = model;
                Err(sync_failed(e))
            }
        }
    }

    fn shard_parameters(&mut self, replicas: Option<&Communicator>) {
        if !self.shards_params {
            return;
        }
        let (rank, world) = replicas.map_or((0, 1), |c| (c.rank().index(), c.world()));
        self.model = self.sync.shard(self.model.clone(), rank, world);
    }

    fn fingerprint(&self) -> u64 {
        parameter_fingerprint(&self.model)
    }

    fn snapshot(&self) -> Result<(ShardParams, OptimizerState), CheckpointError> {
        self.sync.snapshot_state(&self.model)
    }

    fn module_params(&self) -> ShardParams {
        crate::checkpoint::snapshot_module(&self.model)
    }

    fn restore(
        &mut self,
        params: &ShardParams,
        optimizer: Option<&OptimizerState>,
        (rank, world): (usize, usize),
    ) -> Result<(), CheckpointError> {
        let before = crate::parallel::gradients::ids_in_order(&self.model);
        let mut model =
            self.sync
                .restore_state(self.model.clone(), params, optimizer, rank, world)?;
        // The restored parameters carry the checkpoint's ids (CKPT-5), which another process
        // drew differently: what is keyed by id follows them, matched in visit order.
        let map: HashMap<ParamId, ParamId> = before
            .into_iter()
            .zip(crate::parallel::gradients::ids_in_order(&model))
            .collect();
        // A rank's own state waiting for its place (LOCAL-4) is placed now: a block is
        // restored as the rank it steps as.
        if let Some(placed) = self.sync.settle(&model, rank, world)? {
            model = placed;
        }
        if let Some(split) = self.split.take() {
            self.split = Some(
                split
                    .into_iter()
                    .map(|(id, axis)| (map.get(&id).copied().unwrap_or(id), axis))
                    .collect(),
            );
        }
        if let Some(layout) = self.split_layout.take() {
            self.split_layout = Some(layout.rekeyed(&map));
        }
        self.model = model;
        Ok(())
    }

    fn held_params(&self) -> Option<Vec<crate::parallel::tensor::reslice::HeldParam>> {
        let split = self.split.as_ref()?;
        let layout = crate::parallel::gradients::ParamLayout::trainable(&self.model);
        let trainable: std::collections::HashSet<u64> =
            layout.slots().iter().map(|s| s.id.val()).collect();
        let mut seen = std::collections::HashSet::new();
        Some(
            crate::checkpoint::snapshot_module(&self.model)
                .params()
                .iter()
                .map(|p| crate::parallel::tensor::reslice::HeldParam {
                    name: p.name.clone(),
                    axis: split.get(&ParamId::from(p.id)).copied(),
                    // A tied weight is in the flat order once, at its first visit (FLAT-2).
                    trainable: trainable.contains(&p.id) && seen.insert(p.id),
                })
                .collect(),
        )
    }

    fn lr_state(&self) -> Result<Option<LrSchedulerState>, CheckpointError> {
        self.lr.state()
    }

    fn restore_lr(&mut self, state: Option<&LrSchedulerState>) -> Result<(), CheckpointError> {
        self.lr.restore(state)
    }

    fn set_reduction(&mut self, reduction: Reduction) -> Result<(), UnsupportedOptimizer> {
        self.shards_params = reduction.zero.shards_parameters();
        self.sync = sync::for_reduction(
            reduction,
            &self.model,
            &self.device,
            &self.optimizer,
            BUCKET_ELEMS,
            FUSE_BELOW,
            0,
            1,
        )?;
        Ok(())
    }

    fn set_precision(&mut self, precision: Precision, gradients: Precision) {
        self.precision = precision;
        self.gradient_wire = gradients;
    }

    fn set_tensor_parallel(&mut self, tp: &Arc<TensorParallel>) {
        if self.split.is_some() {
            self.tp = tp.clone();
        }
    }

    fn into_module(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        Box::new(self.model)
    }
}

/// A synchronisation's failure as the executor reports it.
pub(super) fn sync_failed(e: sync::SyncError) -> ExecError {
    match e {
        sync::SyncError::Comm(c) => ExecError::Comm(c),
        other => ExecError::Unsupported(other.to_string()),
    }
}

/// The bytes of a boundary's tensors, as `f32` values.
fn boundary_bytes(b: &Boundary) -> u64 {
    b.iter()
        .map(|t| {
            let n: usize = match t {
                AnyTensor::D1(t) => t.dims().iter().product(),
                AnyTensor::D2(t) => t.dims().iter().product(),
                AnyTensor::D3(t) => t.dims().iter().product(),
                AnyTensor::D4(t) => t.dims().iter().product(),
            };
            4 * n as u64
        })
        .sum()
}
