//! ZeRO stage 1 or 2 (`ZeroSync`): gradients reduce-scattered (stage 2) or all-reduced
//! (stage 1), each rank stepping and keeping the optimizer state of its own range of the flat
//! order, the updated ranges all-gathered back.

use super::*;

/// ZeRO stage 1 or 2: each rank keeps the optimizer state of its range of the flat order.
pub(crate) struct ZeroSync {
    pub(super) stage: ZeroStage,
    pub(super) shard: OptimizerShard,
    /// Every part of the state last restored, kept until the first step after it: the group
    /// a restored rank steps in may be rebuilt after the restore (a roll-back restores before
    /// the replacement joins), so the final re-sharding happens against the group it steps in.
    pub(super) restored: Option<Vec<OptimizerShard>>,
    pub(super) layout: ParamLayout,
    pub(super) buckets: Vec<Bucket>,
    pub(super) fusion: Vec<f32>,
    pub(super) held: HeldBytes,
}

impl std::fmt::Debug for ZeroSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ZeroSync({:?}, owns {:?})", self.stage, self.shard.range)
    }
}

impl ZeroSync {
    /// This rank's range in the group the context names, re-sharding onto it if the group
    /// changed: from the state last restored, or a fresh shard if the optimizer never
    /// stepped. A stepped shard with nothing restored cannot move (its neighbours' state is
    /// elsewhere): the caller reports that.
    fn owned(&mut self, cx: &SyncContext<'_>) -> Range<usize> {
        self.owned_as(cx.rank(), cx.world())
    }

    fn owned_as(&mut self, rank: usize, world: usize) -> Range<usize> {
        let want = owned_range(self.layout.len(), world, rank);
        if want != self.shard.range {
            if let Some(parts) = &self.restored {
                if let Ok(shard) = reshard(parts, self.layout.len(), world, rank) {
                    let rule = self.shard.rule;
                    self.shard = OptimizerShard { rule, ..shard };
                }
            } else if self.shard.state.steps == 0 {
                self.shard = OptimizerShard::fresh(self.shard.rule, self.layout.len(), world, rank);
            }
        }
        self.restored = None;
        self.shard.range.clone()
    }
}

impl<M: Module> GradientSync<M> for ZeroSync {
    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError> {
        let range = self.owned(cx);
        if range != owned_range(self.layout.len(), cx.world(), cx.rank()) {
            return Err(SyncError::NotResharded {
                have: range,
                want: owned_range(self.layout.len(), cx.world(), cx.rank()),
                rank: cx.rank(),
                world: cx.world(),
            });
        }
        let t = Instant::now();
        let mut buffers = GradientBuffers::take(model, &self.layout, grads);
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads_backward = whole;
        self.held.owned = (range.start as u64, range.end as u64);
        let world = cx.world();
        let mut shard = match self.stage {
            ZeroStage::Two if world > 1 => {
                let t = Instant::now();
                let flat = buffers.into_flat();
                cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
                let mut shard = vec![0.0f32; range.len()];
                let comm = cx.comm.as_deref_mut().expect("world > 1 has a group");
                let t = Instant::now();
                reduce_scatter_as(comm, &flat, &mut shard, cx.precision.wire)?;
                cx.spans.push((
                    TraceKind::ReduceScatter {
                        bytes: (flat.len() * 4) as u64,
                    },
                    t,
                    t.elapsed(),
                ));
                drop(flat);
                shard
            }
            _ => {
                let mut views = buffers.slices_mut();
                all_reduce_buckets(&mut views, &self.buckets, &mut self.fusion, cx)?;
                drop(views);
                let shard = cx.timed(TraceKind::Flatten, |_| buffers.copy_range(range.clone()));
                drop(buffers);
                shard
            }
        };
        self.held.grads = match self.stage {
            ZeroStage::Two => 4 * shard.len() as u64,
            _ => whole,
        };
        if cx.scale != 1.0 {
            shard.iter_mut().for_each(|g| *g *= cx.scale);
        }
        let norm = match cx.clip {
            None => None,
            Some(max) => {
                // The global norm from the shards: every rank's sum of squares, all-reduced.
                let mut sum = [sum_of_squares(std::iter::once(&shard[..])) as f32];
                if let Some(comm) = cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
                    comm.all_reduce(&mut sum, ReduceOp::Sum)?;
                }
                let norm = f64::from(sum[0]).sqrt() as f32;
                clip_to(&mut [&mut shard[..]], norm, max);
                Some(norm)
            }
        };
        let overflow = overflow_in_group(&[&shard[..]], cx.world() > 1, cx)?;
        Ok(Reduced {
            grads: ReducedGrads::Shard(shard),
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
        let ReducedGrads::Shard(grads) = reduced.grads else {
            unreachable!("ZeroSync reduces shards")
        };
        let range = self.shard.range.clone();
        let t = Instant::now();
        let mut values = trainable_range(&model, &self.layout, range.clone());
        let segments = lr_segments(&self.layout, &range, &lr);
        self.shard
            .rule
            .step(&mut self.shard.state, &mut values, &grads, &segments);
        cx.spans.push((TraceKind::OptimizerStep, t, t.elapsed()));
        self.held.optimizer = self.shard.state.bytes() as u64;
        let flat = match cx.comm.as_deref_mut().filter(|c| c.world() > 1) {
            Some(comm) => {
                let mut flat = vec![0.0f32; self.layout.len()];
                let t = Instant::now();
                if let Err(e) = comm.all_gather(&values, &mut flat) {
                    return Err((model, SyncError::Comm(e)));
                }
                cx.spans.push((
                    TraceKind::AllGather {
                        bytes: (flat.len() * 4) as u64,
                    },
                    t,
                    t.elapsed(),
                ));
                flat
            }
            None => values,
        };
        Ok(set_trainable(model, &self.layout, &flat))
    }

    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        (rank, world): (usize, usize),
    ) -> Result<Collective, SyncError> {
        let range = self.owned_as(rank, world);
        let want = owned_range(self.layout.len(), world, rank);
        if range != want {
            return Err(SyncError::NotResharded {
                have: range,
                want,
                rank,
                world,
            });
        }
        let whole = 4 * self.layout.len() as u64;
        self.held.params = whole;
        self.held.grads_backward = whole;
        self.held.owned = (range.start as u64, range.end as u64);
        let flat = GradientBuffers::take(model, &self.layout, grads).into_flat();
        Ok(match self.stage {
            ZeroStage::Two if world > 1 => Collective::ReduceScatter {
                flat,
                out: range.len(),
                wire: crate::precision::Precision::F32,
            },
            _ => Collective::AllReduce {
                buf: flat,
                buckets: bucket_ranges(&self.buckets, &self.layout),
                wire: crate::precision::Precision::F32,
            },
        })
    }

    fn finish_reduce(
        &mut self,
        out: Vec<f32>,
        scale: f32,
        (rank, world): (usize, usize),
    ) -> Result<Reduced, SyncError> {
        let range = owned_range(self.layout.len(), world, rank);
        // Stage 2 reduce-scattered to the shard; otherwise the whole buffer came back.
        let mut shard = match self.stage {
            ZeroStage::Two if world > 1 => out,
            _ => out[range].to_vec(),
        };
        self.held.grads = match self.stage {
            ZeroStage::Two => 4 * shard.len() as u64,
            _ => 4 * self.layout.len() as u64,
        };
        if scale != 1.0 {
            shard.iter_mut().for_each(|g| *g *= scale);
        }
        Ok(Reduced {
            grads: ReducedGrads::Shard(shard),
            non_finite: false,
        })
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        shard_state(&self.shard)
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<(), CheckpointError> {
        let (shard, decoded) = restore_shard(state, &self.shard, self.layout.len(), rank, world)?;
        self.shard = shard;
        self.restored = Some(decoded);
        Ok(())
    }

    fn held(&self) -> HeldBytes {
        let mut held = self.held;
        held.optimizer = self.shard.state.bytes() as u64;
        held
    }
}
