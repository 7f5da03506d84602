//! The data-parallel replica role: one copy of the model with its optimizer, gradient sync and
//! communicator (plain DP, ZeRO 1/2, compressed gradients, local updates).
//!
//! Data-parallel step (DP-1..DP-4 below):
//! 1. for each of the k micro-batches: forward, backward, accumulate the gradients;
//! 2. all-reduce the replicas' losses; a non-finite loss on any replica makes every replica
//!    skip or stop together (DP-3);
//! 3. all-reduce the gradients bucket by bucket (small tensors fused, large ones in place,
//!    see [`crate::parallel::buckets`]), then divide by `replicas · k`;
//! 4. clip by global norm if asked; hand the gradients back to Burn; optimizer step.
//!
//! - **DP-1** replicas start from rank 0's parameters (broadcast) and stay bit-identical: they
//!   apply the same all-reduced gradients with the same optimizer configuration.
//! - **DP-2** the gradient of a step is the mean over replicas of each replica's mean over its
//!   micro-batches: the same as one device on the global batch.
//! - **DP-3** a non-finite loss is decided on all-reduced losses (and, with clipping, a non-finite
//!   gradient on the all-reduced norm), so every replica skips or stops together.
//! - **DP-4** buffers (batch-norm statistics, frozen weights) are broadcast from rank 0 at the end
//!   of every step, before the optimizer update (DDP's `broadcast_buffers`), so replicas stay
//!   identical.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use ractor::ActorRef;

use super::{GradientLoop, Progress, Stage, StageRole, failed, lost, shard_of};
use crate::actors::device::{DeviceMsg, report_progress, run_on, run_on_slot};
use crate::checkpoint::{ShardId, ShardSnapshot, TrainingState};
use crate::comm::{Communicator, ReduceOp};
use crate::data::Dataset;
use crate::device::MeshDevice;
use crate::error::{Error, Result};
use crate::faults::{DeviceMessages, FaultHooks, Phase, with_hooks};
use crate::mesh::Rank;
use crate::mesh::{DeviceId, StageId};
use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::compress::Compression;
use crate::parallel::gradients::{ParamFilter, ParamLayout, map_parameters, parameter_fingerprint};
use crate::parallel::local::LocalUpdates;
use crate::parallel::sync::{self, GradientSync, Reduced, SyncContext, SyncPrecision};
use crate::parallel::zero::ZeroStage;
use crate::parallel::{ModelContext, NonFinitePolicy};
use crate::precision::{LossScaler, LossScalerConfig, Precision};
use crate::trace::{TraceKind, TraceRecord};
mod step;
use step::step_on_device;

/// Builds one replica's model.
pub(crate) type ModelFn<M> = Arc<dyn Fn(&ModelContext) -> M + Send + Sync>;
/// Computes the mean loss of a model over some samples, on a device.
pub(crate) type LossFn<M, I> = Arc<dyn Fn(&M, &[I], &Device) -> Tensor<1> + Send + Sync>;

/// Everything a stage needs to train, shared by all stages of a job.
pub(crate) struct StageSpec<M, I> {
    pub(crate) model_fn: ModelFn<M>,
    pub(crate) loss_fn: LossFn<M, I>,
    pub(crate) dataset: Arc<dyn Dataset<Item = I>>,
    pub(crate) optimizer: OptimizerConfig,
    pub(crate) learning_rate: LearningRate,
    pub(crate) bucket_elems: usize,
    pub(crate) clip_norm: Option<f32>,
    /// How much of the training state each rank keeps (ZeRO).
    pub(crate) zero: ZeroStage,
    /// Ranks step alone and meet every H steps (local SGD, DiLoCo, EASGD); `None`: they
    /// synchronise every step.
    pub(crate) local: Option<LocalUpdates>,
    pub(crate) non_finite: NonFinitePolicy,
    /// The job's start: trace times are measured from it.
    pub(crate) epoch: Instant,
    /// The fault plan's hooks, if the job has one.
    pub(crate) faults: Option<Arc<FaultHooks>>,
    /// Mixed precision: what forward and backward run in, whether gradients travel in it,
    /// and the loss scaler's configuration (used at f16).
    pub(crate) mixed: MixedPrecision,
    /// How gradients travel (`Compression::None`: the strategy's own reduction).
    pub(crate) compression: Compression,
}

/// A job's mixed-precision settings, as the worker applies them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MixedPrecision {
    pub(crate) precision: Precision,
    /// All-reduce gradients in the 16-bit type (else `f32`).
    pub(crate) low_gradients: bool,
    pub(crate) scaler: LossScalerConfig,
}

impl MixedPrecision {
    /// The loss scaler a rank starts with: one at f16, none otherwise.
    pub(crate) fn new_scaler(&self) -> Result<Option<LossScaler>> {
        if !self.precision.scales_loss() {
            return Ok(None);
        }
        Ok(Some(LossScaler::new(self.scaler)?))
    }

    /// What a reduction does for it, with a scaler or not.
    pub(crate) fn sync(&self, scaling: bool) -> SyncPrecision {
        SyncPrecision {
            wire: if self.low_gradients {
                self.precision
            } else {
                Precision::F32
            },
            find_overflow: scaling,
        }
    }
}

impl<M, I> StageSpec<M, I> {
    /// How the replicas keep their training state: (ZeRO shards it, compression keeps a
    /// residual, local updates a rank's own parameters). The spawners' `StateKeeping` is made
    /// of it (the spawner imports the stage, not the other way round: LAYER-2).
    pub(crate) fn keeping(&self) -> (bool, bool, bool) {
        (
            self.zero.shards_optimizer(),
            self.compression.is_on(),
            self.local.is_some(),
        )
    }
}

use crate::report::{InitReport, StepReport};

/// The actor of one data-parallel replica.
pub(crate) type StageActor<M, I> = Stage<StageState<M, I>>;

/// What a stage starts from.
pub(crate) struct StageArgs<M, I> {
    pub(crate) id: StageId,
    pub(crate) rank: Rank,
    pub(crate) device: MeshDevice,
    pub(crate) device_actor: ActorRef<DeviceMsg>,
    pub(crate) comm: Communicator,
    pub(crate) spec: Arc<StageSpec<M, I>>,
}

impl<M, I> std::fmt::Debug for StageArgs<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StageArgs({}, {})", self.id, self.rank)
    }
}

/// The model, optimizer and buffers of a trained stage.
struct Slot<M> {
    model: M,
    /// How the group keeps gradients, parameters and optimizer state in step (all-reduce in
    /// buckets, or ZeRO): the strategy's device side.
    sync: Box<dyn GradientSync<M>>,
    comm: Communicator,
    lr: LearningRate,
    /// Whether the model has float parameters without gradients (buffers, frozen weights).
    has_buffers: bool,
    /// The dynamic loss scaler (f16 mixed precision); the same on every replica (PREC-2).
    scaler: Option<LossScaler>,
}

/// Tensors smaller than this many elements (or a quarter of a bucket, if less) are fused with
/// their neighbours into one bucket; larger ones are reduced in place.
const FUSE_BELOW: usize = 64 * 1024;

/// State of a [`StageActor`].
pub(crate) struct StageState<M, I> {
    id: StageId,
    rank: Rank,
    device: MeshDevice,
    device_actor: ActorRef<DeviceMsg>,
    spec: Arc<StageSpec<M, I>>,
    comm: Option<Communicator>,
    slot: Option<Slot<M>>,
}

impl<M, I> std::fmt::Debug for StageState<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StageState({}, {})", self.id, self.rank)
    }
}

impl<M, I> StageRole for StageState<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    type Model = M;
    type Args = StageArgs<M, I>;
    const KIND: &'static str = "data-parallel replica";

    fn start(a: StageArgs<M, I>) -> std::result::Result<Self, String> {
        Ok(StageState {
            id: a.id,
            rank: a.rank,
            device: a.device,
            device_actor: a.device_actor,
            spec: a.spec,
            comm: Some(a.comm),
            slot: None,
        })
    }

    fn id(&self) -> StageId {
        self.id
    }

    async fn init(&mut self) -> Result<InitReport> {
        init(self).await
    }

    async fn step(
        &mut self,
        step: u64,
        micro_batches: Vec<Vec<usize>>,
        global_samples: usize,
    ) -> Result<StepReport> {
        step_on_device(self, step, micro_batches, global_samples).await
    }

    async fn fingerprint(&mut self) -> Result<u64> {
        let out = run_on_slot(&self.device_actor, "fingerprint", &mut self.slot, |s| {
            parameter_fingerprint(&s.model)
        })
        .await;
        match out {
            None => Err(lost(self.id, &self.device)),
            Some(Ok(Ok(f))) => Ok(f),
            Some(Ok(Err(panic))) => Err(failed(self.id, &self.device, "fingerprint", panic)),
            Some(Err(e)) => Err(e),
        }
    }

    async fn take_model(&mut self) -> Option<M> {
        self.slot.take().map(|s| s.model)
    }

    async fn snapshot(&mut self) -> Result<Vec<ShardSnapshot>> {
        snapshot(self).await.map(|s| vec![s])
    }

    async fn restore(&mut self, shards: Vec<ShardSnapshot>) -> Result<()> {
        let shard = shard_of(shards, ShardId::stage(self.id.stage), self.id)?;
        restore(self, shard).await
    }

    fn regroup(&mut self, id: StageId, rank: Rank, comm: Communicator) -> Result<()> {
        let Some(slot) = self.slot.as_mut() else {
            return Err(lost(self.id, &self.device));
        };
        slot.comm = comm;
        self.id = id;
        self.rank = rank;
        Ok(())
    }
}

/// The stage's parameters and optimizer state, copied on its device thread.
async fn snapshot<M: Module + 'static, I>(state: &mut StageState<M, I>) -> Result<ShardSnapshot> {
    let Some(slot) = state.slot.take() else {
        return Err(lost(state.id, &state.device));
    };
    let shard = ShardId::stage(state.id.stage);
    let out = run_on(&state.device_actor, "checkpoint snapshot", move || {
        // LOCAL-4: a strategy whose ranks differ keeps each rank's parameters in its part.
        let taken = slot.sync.snapshot_state(&slot.model);
        // CKPT-9, LR-2: the scheduler's state travels with the parameters.
        let lr = slot.lr.state();
        let scale = slot.scaler.as_ref().map(LossScaler::state);
        (slot, taken, (lr, scale))
    })
    .await?;
    match out {
        Ok((slot, taken, (lr, scale))) => {
            state.slot = Some(slot);
            let (params, optimizer) = taken?;
            Ok(ShardSnapshot {
                shard,
                params,
                optimizer: Some(optimizer),
                // CKPT-9, MIX-3: the loss scaler's state travels with the parameters.
                training: TrainingState::default()
                    .with_lr_scheduler(lr?)
                    .with_loss_scale(scale),
            })
        }
        Err(panic) => Err(failed(
            state.id,
            &state.device,
            "checkpoint snapshot",
            panic,
        )),
    }
}

/// Take a checkpoint shard's parameters (by name) and optimizer state.
async fn restore<M: Module + 'static, I>(
    state: &mut StageState<M, I>,
    shard: ShardSnapshot,
) -> Result<()> {
    let Some(mut slot) = state.slot.take() else {
        return Err(lost(state.id, &state.device));
    };
    let loss_scale = shard.training.loss_scale;
    let out = run_on(&state.device_actor, "checkpoint restore", move || {
        // LR-2: the schedule continues at the snapshot's step.
        let mut lr = slot.lr.clone();
        let r = lr
            .restore(shard.training.lr_scheduler.as_ref())
            .and_then(|()| {
                let (rank, world) = (slot.comm.rank().index(), slot.comm.world());
                slot.sync.restore_state(
                    slot.model.clone(),
                    &shard.params,
                    shard.optimizer.as_ref(),
                    rank,
                    world,
                )
            });
        match r {
            Ok(model) => {
                slot.model = model;
                slot.lr = lr;
                (slot, Ok(()))
            }
            Err(e) => (slot, Err(e)),
        }
    })
    .await?;
    match out {
        Ok((mut slot, r)) => {
            let r = r
                .map_err(Error::from)
                .and_then(|()| restore_scaler(slot.scaler.as_mut(), loss_scale));
            state.slot = Some(slot);
            r
        }
        Err(panic) => Err(failed(state.id, &state.device, "checkpoint restore", panic)),
    }
}

/// MIX-3: a restored stage's loss scaler continues from the snapshot's state, if it has one
/// (a checkpoint of an earlier format, or of a job without a scaler, leaves it as it is).
pub(crate) fn restore_scaler(
    scaler: Option<&mut LossScaler>,
    state: Option<crate::precision::ScalerState>,
) -> Result<()> {
    if let (Some(s), Some(state)) = (scaler, state) {
        s.restore(state)?;
    }
    Ok(())
}

async fn init<M, I>(state: &mut StageState<M, I>) -> Result<InitReport>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    let Some(mut comm) = state.comm.take() else {
        return Err(Error::Runtime(format!("{} initialized twice", state.id)));
    };
    let spec = state.spec.clone();
    let rank = state.rank;
    let device = state.device.burn().clone().autodiff();
    let out = run_on(&state.device_actor, "init", move || -> Result<_> {
        let ctx = ModelContext {
            rank,
            device: device.clone(),
        };
        let model = (spec.model_fn)(&ctx).fork(&device).train();
        let trainable = ParamLayout::trainable(&model).slots().len();
        let has_buffers = ParamLayout::of(&model).slots().len() > trainable;
        let before = parameter_fingerprint(&model);
        // DP-1: every replica starts from rank 0's parameters, broadcast tensor by tensor.
        let (model, synced) = map_parameters(model, ParamFilter::All, |_, values| {
            comm.broadcast(values, Rank(0))
        });
        synced?;
        let after = parameter_fingerprint(&model);
        let fuse_below = FUSE_BELOW.min(spec.bucket_elems / 4);
        let (rank, world) = (comm.rank().index(), comm.world());
        let reduction = sync::Reduction {
            zero: spec.zero,
            compression: spec.compression,
            local: spec.local,
        };
        let sync = sync::for_reduction(
            reduction,
            &model,
            &device,
            &spec.optimizer,
            spec.bucket_elems,
            fuse_below,
            rank,
            world,
        )
        .map_err(|e| Error::InvalidConfig(e.to_string()))?;
        Ok((
            Slot {
                model,
                sync,
                has_buffers,
                scaler: spec.mixed.new_scaler()?,
                comm,
                lr: spec.learning_rate.clone(),
            },
            InitReport { before, after },
        ))
    })
    .await?;
    match out {
        Ok(Ok((slot, report))) => {
            state.slot = Some(slot);
            Ok(report)
        }
        Ok(Err(e)) => Err(e),
        Err(panic) => Err(failed(state.id, &state.device, "building the model", panic)),
    }
}
