//! Plain data parallelism (`AllReduceSync`): gradients all-reduced in buckets, Burn's optimizer
//! stepping the whole model on every rank.

use super::*;

/// Plain data parallelism: all-reduce in buckets, Burn's optimizer on the whole model.
pub(crate) struct AllReduceSync {
    pub(super) optimizer: ModuleOptimizer,
    /// The `f32` words of state Burn's optimizer keeps per parameter element once stepped.
    pub(super) words: usize,
    pub(super) layout: ParamLayout,
    pub(super) buckets: Vec<Bucket>,
    pub(super) fusion: Vec<f32>,
    pub(super) held: HeldBytes,
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
        if cx.direct {
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
        let grads = match reduced.grads {
            ReducedGrads::Whole(grads) => grads,
            ReducedGrads::Buffers(buffers) => cx.timed(TraceKind::Flatten, |cx| {
                buffers.into_gradients(&model, cx.device)
            }),
            ReducedGrads::Shard(_) => unreachable!("AllReduceSync reduces whole gradients"),
        };
        Ok(cx.timed(TraceKind::OptimizerStep, |_| {
            self.optimizer.step(lr, model, grads)
        }))
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
        Ok(Collective::AllReduce {
            buf: GradientBuffers::take(model, &self.layout, grads).into_flat(),
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
        Ok(Reduced {
            grads: ReducedGrads::Buffers(GradientBuffers::from_flat(&self.layout, out)),
            non_finite: false,
        })
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        OptimizerState::capture(&self.optimizer)
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        _rank: usize,
        _world: usize,
    ) -> Result<(), CheckpointError> {
        self.optimizer = state.restore(self.optimizer.clone())?;
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
