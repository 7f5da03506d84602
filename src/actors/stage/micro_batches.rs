//! The micro-batch gradient loop, written once for every role that computes a whole model's
//! gradient (a data-parallel replica, a parameter-server worker): read each micro-batch's
//! items, run its forward and backward under the fault plan's hooks, weight its loss by its
//! share of the step's samples (DP-2) and accumulate the gradients. A pipeline stage reads
//! its items with [`read_items`] too; its micro-batches are walked by the schedule.

use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, FloatDType};

use super::replica::StageSpec;
use crate::data::Dataset;
use crate::error::{Error, Result};
use crate::faults::{Phase, with_hooks};
use crate::mesh::DeviceId;
use crate::parallel::autocast::low_precision_copy;
use crate::precision::Precision;

/// The items of one micro-batch; a sample the data set cannot give is a typed error naming it.
pub(crate) fn read_items<I: Send + Sync + 'static>(
    dataset: &dyn Dataset<Item = I>,
    ids: &[usize],
) -> Result<Vec<I>> {
    ids.iter()
        .map(|&i| {
            dataset
                .get(i)
                .ok_or_else(|| Error::Data(format!("sample {i} could not be read")))
        })
        .collect()
}

/// Where the loop is, for the caller's phase, progress and trace.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Progress {
    /// The forward of a micro-batch begins.
    Forward(u32),
    /// The forward of a micro-batch of `samples` items, begun at `start`, is done (its loss
    /// read back).
    ForwardDone {
        micro_batch: u32,
        samples: u32,
        start: Instant,
    },
    /// The backward of a micro-batch begins.
    Backward(u32),
    /// The backward of a micro-batch, begun at `start`, is done.
    BackwardDone { micro_batch: u32, start: Instant },
}

/// What the loop computes with, besides the model and the micro-batches.
pub(crate) struct GradientLoop<'a, M, I> {
    /// The job's loss, data set and fault plan.
    pub(crate) spec: &'a StageSpec<M, I>,
    /// The autodiff device the forward runs on.
    pub(crate) device: &'a Device,
    /// The device and the step, for the fault plan's hooks.
    pub(crate) at: (DeviceId, u64),
    /// The step's samples over every rank: each micro-batch's loss is weighted by its share.
    pub(crate) global: usize,
    /// What the forward runs in: a low-precision copy of the `f32` master whose casts hand
    /// the master its gradients (PREC-1; the identity at f32), the loss cast to `f32`.
    pub(crate) precision: Precision,
    /// f16's loss scale: the loss is multiplied by it before backward.
    pub(crate) loss_scale: Option<f32>,
}

impl<M: Module, I: Send + Sync + 'static> GradientLoop<'_, M, I> {
    /// The gradient of `model` over `micro_batches` (the sum of the weighted micro-batch
    /// gradients) and each micro-batch's loss, the mean over its items.
    pub(crate) fn run(
        &self,
        model: &M,
        micro_batches: &[Vec<usize>],
        observe: &mut dyn FnMut(Progress),
    ) -> Result<(GradientsParams, Vec<f32>)> {
        let hooks = self.spec.faults.as_deref();
        let (device_id, step) = self.at;
        let mut accumulated = GradientsAccumulator::<M>::new();
        let mut last = None;
        let mut losses = Vec::with_capacity(micro_batches.len());
        for (m, ids) in micro_batches.iter().enumerate() {
            let micro_batch = m as u32;
            observe(Progress::Forward(micro_batch));
            let start = Instant::now();
            let items = read_items(&*self.spec.dataset, ids)?;
            let loss = with_hooks(hooks, device_id, step, micro_batch, Phase::Forward, || {
                let copy = low_precision_copy(model, self.precision);
                (self.spec.loss_fn)(&copy, &items, self.device).cast(FloatDType::F32)
            });
            losses.push(loss.clone().into_scalar());
            observe(Progress::ForwardDone {
                micro_batch,
                samples: ids.len() as u32,
                start,
            });
            observe(Progress::Backward(micro_batch));
            let start = Instant::now();
            // DP-2: this micro-batch's share of the step's samples.
            let weight =
                ids.len() as f32 / self.global.max(1) as f32 * self.loss_scale.unwrap_or(1.0);
            let grads = with_hooks(hooks, device_id, step, micro_batch, Phase::Backward, || {
                let loss = if weight == 1.0 { loss } else { loss * weight };
                GradientsParams::from_grads(loss.backward(), model)
            });
            // One micro-batch: its gradients are the step's, without a copy.
            if micro_batches.len() == 1 {
                last = Some(grads);
            } else {
                accumulated.accumulate(model, grads);
            }
            observe(Progress::BackwardDone { micro_batch, start });
        }
        let grads = last.unwrap_or_else(|| accumulated.grads());
        Ok((grads, losses))
    }
}
