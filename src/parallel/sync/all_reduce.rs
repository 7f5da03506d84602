//! Plain data parallelism (`AllReduceSync`): gradients all-reduced in buckets, then every rank
//! steps the whole model: with meshwork's flat rule in one pass over the flat order (OPT-1),
//! or with Burn's optimizer where the configuration has no flat rule.
//!
//! - **OPT-1** a job without ZeRO on CPU devices (`flex`, `sync::steps_on_host`) whose optimizer
//!   has a flat rule steps with it, element for element Burn's arithmetic (the data-parallel tests
//!   compare it with a plain Burn loop at 1e-5, the precision test bit for bit with Burn's SGD),
//!   each parameter at the rate Burn would give it (by its current id and its module path, so
//!   learning-rate groups of either kind apply), and checkpoints its state as one part of the whole
//!   flat order. A flat checkpoint is restored into the flat rule on any device; Burn's whole
//!   state, from an older checkpoint or a GPU job, into Burn's optimizer, which then steps on. A
//!   compressed job (Burn's optimizer, CSYNC-2) refuses a flat checkpoint, naming it. A parameter
//!   that got no gradient is stepped with a zero gradient, as at dp > 1 and under ZeRO.

use super::*;

/// How an [`AllReduceSync`] steps the model.
pub(crate) enum Stepper {
    /// Burn's optimizer on the model's tensors: on GPUs (the parameters stay on the device),
    /// configurations with their own per-tensor gradient clipping (no flat rule), compressed
    /// jobs (their checkpoints hold Burn's bytes), and state restored from a checkpoint
    /// Burn's optimizer wrote.
    Burn(ModuleOptimizer),
    /// The flat rule (`FlatRule`, ZeRO's) over the whole flat order, the rank being the one
    /// owner of all of it (OPT-1): the gradient taken out of Burn once, one pass that reads
    /// and writes each element's parameter and state once, the parameters written back.
    Flat(OptimizerShard),
}

/// Plain data parallelism: all-reduce in buckets, one optimizer step on the whole model.
pub(crate) struct AllReduceSync {
    pub(super) stepper: Stepper,
    /// Burn's optimizer as configured, fresh: what a checkpoint of Burn's state is restored
    /// into.
    pub(super) burn_fresh: ModuleOptimizer,
    /// The configuration's flat rule, if it has one: what a checkpoint of flat state is
    /// restored into, on any device (on a GPU the parameters then make the trip to the host).
    pub(super) flat_rule: Option<FlatRule>,
    /// The `f32` words of state Burn's optimizer keeps per parameter element once stepped.
    pub(super) words: usize,
    pub(super) layout: ParamLayout,
    pub(super) buckets: Vec<Bucket>,
    pub(super) fusion: Vec<f32>,
    pub(super) held: HeldBytes,
    /// The last step's flat gradient, kept for the next one's: a block's buffer can be tens
    /// of MiB, and a fresh one each step costs page faults on every page (and, freed on
    /// another thread than its own, mimalloc hands its pages back to the kernel).
    pub(super) spare: Vec<f32>,
}

impl AllReduceSync {
    /// Plain data parallelism over `layout`, reducing in `buckets`: stepping with the flat
    /// rule of `optimizer` where `flat` (the device computes on the host) and the
    /// configuration has one, with Burn's optimizer otherwise.
    pub(super) fn new(
        optimizer: &OptimizerConfig,
        flat: bool,
        layout: ParamLayout,
        buckets: Vec<Bucket>,
    ) -> Self {
        let flat_rule = FlatRule::of(optimizer).ok();
        let stepper = match flat_rule {
            Some(rule) if flat => Stepper::Flat(OptimizerShard::fresh(rule, layout.len(), 1, 0)),
            _ => Stepper::Burn(optimizer.init()),
        };
        Self {
            stepper,
            burn_fresh: optimizer.init(),
            flat_rule,
            words: flat_rule.map_or(0, |r| r.state_words()),
            layout,
            buckets,
            fusion: Vec::new(),
            held: HeldBytes::default(),
            spare: Vec::new(),
        }
    }
}

impl std::fmt::Debug for AllReduceSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AllReduceSync({} buckets)", self.buckets.len())
    }
}

impl<M: Module> GradientSync<M> for AllReduceSync {
    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError> {
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads = whole;
        self.held.grads_backward = whole;
        self.held.owned = (0, self.layout.len() as u64);
        // The flat rule takes the gradient out of Burn here in any case (its one copy).
        if cx.direct && matches!(self.stepper, Stepper::Burn(_)) {
            return Ok(Reduced {
                grads: ReducedGrads::Whole(grads),
                non_finite: false,
            });
        }
        let t = Instant::now();
        let mut buffers = GradientBuffers::take(model, &self.layout, grads);
        let mut views = buffers.slices_mut();
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        all_reduce_buckets(&mut views, &self.buckets, &mut self.fusion, cx)?;
        let t = Instant::now();
        if cx.scale != 1.0 {
            for v in views.iter_mut() {
                v.iter_mut().for_each(|g| *g *= cx.scale);
            }
        }
        // The norm of the all-reduced gradient is the same on every rank, so every rank takes
        // the same decision (DP-3).
        let norm = cx.clip.map(|max| clip_by_global_norm(&mut views, max));
        let parts: Vec<&[f32]> = views.iter().map(|v| &**v).collect();
        let overflow = overflow_in_group(&parts, false, cx)?;
        drop(views);
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        Ok(Reduced {
            grads: ReducedGrads::Buffers(buffers),
            non_finite: overflow || norm.is_some_and(|n| !n.is_finite()),
        })
    }

    fn apply(
        &mut self,
        model: M,
        reduced: Reduced,
        lr: ModuleLearningRate,
        cx: &mut SyncContext<'_>,
    ) -> Result<M, (M, SyncError)> {
        let shard = match &mut self.stepper {
            Stepper::Flat(shard) => shard,
            Stepper::Burn(optimizer) => {
                let grads = match reduced.grads {
                    ReducedGrads::Whole(grads) => grads,
                    ReducedGrads::Buffers(buffers) => cx.timed(TraceKind::Flatten, |cx| {
                        buffers.into_gradients(&model, cx.device)
                    }),
                    ReducedGrads::Flat(flat) => cx.timed(TraceKind::Flatten, |cx| {
                        GradientBuffers::from_flat(&self.layout, flat)
                            .into_gradients(&model, cx.device)
                    }),
                    ReducedGrads::Shard(_) => {
                        unreachable!("AllReduceSync reduces whole gradients")
                    }
                };
                return Ok(cx.timed(TraceKind::OptimizerStep, |_| {
                    optimizer.step(lr, model, grads)
                }));
            }
        };
        // With the flat rule, `reduce` hands the gradient as buffers, `finish_reduce` flat.
        let layout = &self.layout;
        let grads = reduced.grads;
        let model = cx.timed(TraceKind::OptimizerStep, |_| {
            let grads: Vec<&[f32]> = match &grads {
                ReducedGrads::Buffers(b) => b.slices(),
                ReducedGrads::Flat(f) => {
                    layout.slots().iter().map(|s| &f[s.range.clone()]).collect()
                }
                ReducedGrads::Whole(_) | ReducedGrads::Shard(_) => {
                    unreachable!(
                        "AllReduceSync's flat step reduces into buffers or one flat buffer"
                    )
                }
            };
            shard.rule.begin_step(&mut shard.state, layout.len());
            // The rate Burn's optimizer would give the parameter: by its id and its path,
            // so learning-rate groups of either kind apply as they do there.
            let model = update_trainable(model, layout, |index, slot, place, values| {
                let lr = lr.lr_from_param(place.id, Some(place.path));
                let range = slot.range.clone();
                shard
                    .rule
                    .step_range(&mut shard.state, range, values, grads[index], lr);
            });
            FlatRule::end_step(&mut shard.state);
            model
        });
        if let ReducedGrads::Flat(flat) = grads {
            self.spare = flat;
        }
        Ok(model)
    }

    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        _rank_of: (usize, usize),
    ) -> Result<Collective, SyncError> {
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads_backward = whole;
        self.held.owned = (0, self.layout.len() as u64);
        let spare = std::mem::take(&mut self.spare);
        Ok(Collective::AllReduce {
            buf: GradientBuffers::take(model, &self.layout, grads).into_flat_in(spare),
            buckets: bucket_ranges(&self.buckets, &self.layout),
            wire: crate::precision::Precision::F32,
        })
    }

    fn finish_reduce(
        &mut self,
        mut out: Vec<f32>,
        scale: f32,
        _rank_of: (usize, usize),
    ) -> Result<Reduced, SyncError> {
        if scale != 1.0 {
            out.iter_mut().for_each(|g| *g *= scale);
        }
        self.held.grads = 4 * out.len() as u64;
        // The flat rule steps from the flat buffer itself (and keeps it for the next step);
        // Burn's optimizer takes one buffer per parameter.
        let grads = match self.stepper {
            Stepper::Flat(_) => ReducedGrads::Flat(out),
            Stepper::Burn(_) => {
                ReducedGrads::Buffers(GradientBuffers::from_flat(&self.layout, out))
            }
        };
        Ok(Reduced {
            grads,
            non_finite: false,
        })
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        match &self.stepper {
            Stepper::Burn(optimizer) => OptimizerState::capture(optimizer),
            // One part covering the whole flat order: the form ZeRO writes, so a plain and a
            // ZeRO-1/2 job resume each other's checkpoints (re-sharded, ZERO-3).
            Stepper::Flat(shard) => shard_state(shard),
        }
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        _rank: usize,
        _world: usize,
    ) -> Result<(), CheckpointError> {
        if state.parts().is_none() {
            // Burn's whole state (a checkpoint written before OPT-1, or by a configuration
            // without a flat rule): Burn's optimizer steps on from it.
            self.stepper = Stepper::Burn(state.restore(self.burn_fresh.clone())?);
            return Ok(());
        }
        let len = self.layout.len();
        let own = match (&self.stepper, self.flat_rule) {
            (Stepper::Flat(own), _) => own.clone(),
            (Stepper::Burn(_), Some(rule)) => OptimizerShard::fresh(rule, len, 1, 0),
            (Stepper::Burn(_), None) => {
                return Err(CheckpointError::Optimizer {
                    reason: "the checkpoint holds a flat (ZeRO) optimizer state and this job's \
                             optimizer has no flat rule (its own per-tensor gradient \
                             clipping): use the job's global-norm clipping (`clip_grad_norm`) \
                             instead"
                        .into(),
                });
            }
        };
        let (shard, _) = restore_shard(state, &own, len, 0, 1)?;
        self.stepper = Stepper::Flat(shard);
        Ok(())
    }

    fn held(&self) -> HeldBytes {
        let mut held = self.held;
        // Burn keeps `words` tensors the size of each parameter once it has stepped it
        // (counted, not serialized: this runs every step).
        if held.params > 0 {
            held.optimizer = self.words as u64 * held.params;
        }
        held
    }
}
