//! [`CompressedSync`]: data parallelism whose gradients travel compressed
//! ([`Compression`]): `AllReduceSync`'s update (always Burn's optimizer on the whole model) with its
//! reduction replaced by a [`Compressor`]'s, run over the group's communicator.
//!
//! Invariants (tested in `tests/suite/compression.rs`):
//! - CSYNC-1: every collective of the reduction is recorded as a trace span of this rank's
//!   step (`AllReduce { bytes }`: the buffer handed in, 2 bytes per element for bf16/f16;
//!   `AllGather { bytes }`: the gathered buffer), so a step's spans add up to
//!   [`Compression::predicted_bytes`] (CMP-4).
//! - CSYNC-2: the error-feedback residual is this rank's own state: the checkpoint holds one
//!   optimizer part per rank (Burn's optimizer bytes, equal on every rank, plus the rank's
//!   compressor state), the job's state is not replicated (every rank's part is gathered,
//!   CKPT-8), and a resume onto the same group gives every rank its own residual back. Onto
//!   another group size, rank 0 takes the sum of the residuals (what the group still owes,
//!   CMP-1) and the others start from zero. A checkpoint without compression state (written
//!   uncompressed) restores the optimizer and starts a fresh compressor.
//! - CSYNC-3: the wire: the in-process transport reduces 16-bit buffers in shared memory
//!   (each sum in `f32`, rounded once, COMM-5); the TCP transport sends final values as 2
//!   bytes per element and ring partial sums as `f32` (TCP-7). Top-k's indices ride bit-cast
//!   in `f32` words of an all-gather, which copies them untouched.
//! - CSYNC-4: in block and pipeline jobs each block has its own `CompressedSync` (its
//!   compressor over the block's parameters, its residual in the block's checkpoint part);
//!   the split reduction hands the compressor to the executor inside the collective
//!   (`Collective::Compressed`, shared, used by one collective at a time), so where it runs
//!   changes no bit (COLL-1) and the reduction is the one `reduce` runs.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use serde::{Deserialize, Serialize};

use super::all_reduce::Stepper;
use super::collective::OnComm;
use super::{
    AllReduceSync, Collective, GradientSync, HeldBytes, Reduced, ReducedGrads, SyncContext,
    SyncError, clip_by_global_norm, decode_zero_parts, overflow_in_group, rank_part,
};
use crate::checkpoint::{CheckpointError, OptimizerState};
use crate::parallel::compress::{Compression, Compressor, CompressorState};
use crate::parallel::gradients::{GradientBuffers, ParamLayout};
use crate::trace::TraceKind;

/// Plain data parallelism with compressed gradients and error feedback.
pub(crate) struct CompressedSync {
    inner: AllReduceSync,
    /// Shared with a block executor's collective while it runs (CSYNC-4).
    compressor: Arc<Mutex<Compressor>>,
    /// This rank's place in the group it last stepped or restored in (a checkpoint part is
    /// keyed by it).
    place: (usize, usize),
}

impl std::fmt::Debug for CompressedSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CompressedSync({})", self.compressor().scheme())
    }
}

/// What a rank's checkpoint part holds (CSYNC-2).
#[derive(Serialize, Deserialize)]
struct SavedState {
    /// Burn's optimizer state, as `OptimizerState::capture` writes it.
    optimizer: Vec<u8>,
    compressor: CompressorState,
}

impl CompressedSync {
    /// Compress `inner`'s reduction with `scheme`, for rank `rank` of `world`.
    pub(super) fn new(
        inner: AllReduceSync,
        scheme: Compression,
        rank: usize,
        world: usize,
    ) -> Self {
        Self {
            compressor: Arc::new(Mutex::new(Compressor::new(scheme, &shapes(&inner)))),
            inner,
            place: (rank, world),
        }
    }

    /// The compressor (no collective holds it between a reduction's halves).
    /// Burn's optimizer: a compressed job steps with it (`sync::compressed` builds it so), its
    /// checkpoint part holding Burn's bytes (CSYNC-2).
    fn burn(&self) -> &ModuleOptimizer {
        match &self.inner.stepper {
            Stepper::Burn(optimizer) => optimizer,
            Stepper::Flat(_) => unreachable!("sync::compressed builds Burn's optimizer"),
        }
    }

    fn burn_mut(&mut self) -> &mut ModuleOptimizer {
        match &mut self.inner.stepper {
            Stepper::Burn(optimizer) => optimizer,
            Stepper::Flat(_) => unreachable!("sync::compressed builds Burn's optimizer"),
        }
    }

    fn compressor(&self) -> MutexGuard<'_, Compressor> {
        self.compressor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Note what a rank holds when its reduction starts, as rank `place` of the group.
    fn start(&mut self, place: (usize, usize)) {
        let whole = 4 * self.inner.layout.len() as u64;
        self.inner.held.params = whole;
        self.inner.held.grads = whole;
        self.inner.held.grads_backward = whole;
        self.inner.held.owned = (0, self.inner.layout.len() as u64);
        self.place = place;
    }
}

/// The shapes of the trainable parameters, in the flat order.
fn shapes(inner: &AllReduceSync) -> Vec<Vec<usize>> {
    inner
        .layout
        .slots()
        .iter()
        .map(|s| s.shape.as_slice().to_vec())
        .collect()
}

fn optimizer_error(reason: String) -> CheckpointError {
    CheckpointError::Optimizer { reason }
}

impl<M: Module> GradientSync<M> for CompressedSync {
    fn reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        cx: &mut SyncContext<'_>,
    ) -> Result<Reduced, SyncError> {
        self.start((cx.rank(), cx.world()));
        let layout: &ParamLayout = &self.inner.layout;
        let t = Instant::now();
        let mut flat = GradientBuffers::take(model, layout, grads).into_flat();
        cx.spans.push((TraceKind::Flatten, t, t.elapsed()));
        let mut on = OnComm::new(cx.comm.as_deref_mut());
        let reduced = self.compressor().reduce(&mut flat, &mut on);
        cx.spans.extend(on.spans);
        reduced.map_err(|e| SyncError::Comm(e.0))?;
        if cx.scale != 1.0 {
            flat.iter_mut().for_each(|g| *g *= cx.scale);
        }
        // Every rank holds the same reduced gradient (CMP-3), so every rank clips alike.
        let norm = cx
            .clip
            .map(|max| clip_by_global_norm(&mut [&mut flat[..]], max));
        let overflow = overflow_in_group(&[&flat[..]], false, cx)?;
        Ok(Reduced {
            grads: ReducedGrads::Buffers(GradientBuffers::from_flat(&self.inner.layout, flat)),
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
        self.inner.apply(model, reduced, lr, cx)
    }

    fn start_reduce(
        &mut self,
        model: &M,
        grads: GradientsParams,
        rank_of: (usize, usize),
    ) -> Result<Collective, SyncError> {
        self.start(rank_of);
        Ok(Collective::Compressed {
            buf: GradientBuffers::take(model, &self.inner.layout, grads).into_flat(),
            compressor: self.compressor.clone(),
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
        Ok(Reduced {
            grads: ReducedGrads::Buffers(GradientBuffers::from_flat(&self.inner.layout, out)),
            non_finite: false,
        })
    }

    fn optimizer_state(&self) -> Result<OptimizerState, CheckpointError> {
        let whole = OptimizerState::capture(self.burn())?;
        let optimizer = whole
            .whole_bytes()
            .expect("Burn's optimizer state is whole")
            .to_vec();
        let saved = SavedState {
            optimizer,
            compressor: self.compressor().state(),
        };
        let bytes = bincode::serde::encode_to_vec(&saved, bincode::config::standard())
            .map_err(|e| optimizer_error(format!("encoding the compression state: {e}")))?;
        Ok(rank_part(bytes, self.place))
    }

    fn restore_optimizer(
        &mut self,
        state: &OptimizerState,
        rank: usize,
        world: usize,
    ) -> Result<(), CheckpointError> {
        self.place = (rank, world);
        let Some(parts) = state.parts() else {
            // Written without compression: the optimizer, and a fresh compressor.
            let restored = state.restore(self.inner.burn_fresh.clone())?;
            *self.burn_mut() = restored;
            let fresh = Compressor::new(self.compressor().scheme(), &shapes(&self.inner));
            *self.compressor() = fresh;
            return Ok(());
        };
        if decode_zero_parts(state).is_ok() {
            // A job without compression on CPU devices checkpoints the flat rule's state
            // (OPT-1); this job steps with Burn's optimizer, which cannot take it.
            return Err(optimizer_error(
                "the checkpoint holds the flat optimizer state of a job without compression \
                 (or of a ZeRO job); a compressed job steps with Burn's optimizer and cannot \
                 take it: resume it without compression, or start afresh"
                    .into(),
            ));
        }
        let mut saved = parts
            .iter()
            .map(|p| {
                let (s, used) = bincode::serde::decode_from_slice::<SavedState, _>(
                    &p.bytes,
                    bincode::config::standard(),
                )
                .map_err(|e| {
                    optimizer_error(format!(
                        "a compression part does not decode (written by another strategy?): {e}"
                    ))
                })?;
                if used != p.bytes.len() {
                    return Err(optimizer_error(
                        "a compression part has trailing bytes".into(),
                    ));
                }
                Ok((p.range.start as usize, p.total as usize, s))
            })
            .collect::<Result<Vec<_>, _>>()?;
        saved.sort_by_key(|(at, _, _)| *at);
        let own = saved
            .iter()
            .position(|(at, total, _)| *at == rank && *total == world);
        let mut state = match own {
            Some(i) => saved.swap_remove(i).2,
            None => {
                // Another group size: the shared state from the first part, and the sum of
                // the residuals (what the group owes) on rank 0 only (CSYNC-2).
                let compressor =
                    CompressorState::regrouped(saved.iter().map(|(_, _, p)| &p.compressor), rank);
                let (Some((_, _, first)), Some(compressor)) = (saved.first(), compressor) else {
                    return Err(optimizer_error(
                        "the checkpoint has no compression part".into(),
                    ));
                };
                SavedState {
                    optimizer: first.optimizer.clone(),
                    compressor,
                }
            }
        };
        let optimizer = std::mem::take(&mut state.optimizer);
        let restored =
            OptimizerState::from_bytes(optimizer).restore(self.inner.burn_fresh.clone())?;
        *self.burn_mut() = restored;
        self.compressor()
            .restore(state.compressor)
            .map_err(|e| optimizer_error(e.to_string()))
    }

    fn held(&self) -> HeldBytes {
        let mut held = <AllReduceSync as GradientSync<M>>::held(&self.inner);
        held.optimizer += 4 * self.compressor().state_words() as u64;
        held
    }
}
