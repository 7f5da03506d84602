//! `StageActor`: one model partition with its optimizer and communicator.
//!
//! Between steps the stage's state (model, optimizer, communicator) sits in the actor; for a
//! step it moves onto the device's compute thread and comes back with the result (RT-1). A
//! panic on the thread loses the state and is reported as [`Error::StageFailed`] naming the
//! device, the stage and the phase (RT-4).
//!
//! Data-parallel step (DP-1..DP-4 in ARCHITECTURE.md):
//! 1. for each of the k micro-batches: forward, backward, accumulate the gradients;
//! 2. all-reduce the replicas' losses; a non-finite loss on any replica makes every replica
//!    skip or stop together (DP-3);
//! 3. all-reduce the gradients bucket by bucket (small tensors fused, large ones in place,
//!    see [`crate::parallel::buckets`]), then divide by `replicas · k`;
//! 4. clip by global norm if asked; hand the gradients back to Burn; optimizer step.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, FloatDType, Tensor};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::device::{DeviceMsg, report_progress, run_on, run_on_slot};
use super::group::{GroupActor, GroupArgs};
use super::spawner::{Capabilities, Rejoin, SpawnFuture, Spawner};
use super::supervisor::{Grow, GrowArgs, GrowStage, SpawnContext, Spawned};
use crate::checkpoint::{ShardId, ShardSnapshot, TrainingState};
use crate::comm::{Communicator, LocalGroup, ReduceOp};
use crate::data::Dataset;
use crate::device::MeshDevice;
use crate::error::{Error, Result};
use crate::faults::{DeviceMessages, FaultHooks, Phase, with_hooks};
use crate::mesh::{DeviceId, StageId};
use crate::mesh::{Generation, Rank};
use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::autocast::low_precision_copy;
use crate::parallel::compress::Compression;
use crate::parallel::gradients::{ParamFilter, ParamLayout, map_parameters, parameter_fingerprint};
use crate::parallel::local::LocalUpdates;
use crate::parallel::sync::{self, GradientSync, Reduced, SyncContext, SyncPrecision};
use crate::parallel::zero::ZeroStage;
use crate::parallel::{ModelContext, NonFinitePolicy};
use crate::precision::{LossScaler, LossScalerConfig, Precision};
use crate::trace::{TraceKind, TraceRecord};

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
    /// Whether every replica holds the whole training state: not where ZeRO shards it, nor
    /// where ranks step alone between synchronisations (LOCAL-4).
    pub(crate) fn replicated_state(&self) -> bool {
        !self.zero.shards_optimizer() && self.local.is_none() && !self.compression.is_on()
    }
}

pub(crate) use crate::report::{InitReport, StepReport};

/// Messages a [`StageActor`] handles.
pub(crate) enum StageMsg<M> {
    /// Build the model, receive rank 0's parameters, build the optimizer.
    Init(RpcReplyPort<Result<InitReport>>),
    /// Run one training step over these micro-batches (sample ids).
    Step {
        /// The step.
        step: u64,
        /// The sample ids of each micro-batch.
        micro_batches: Vec<Vec<usize>>,
        /// Samples in the whole step over all replicas: each micro-batch's gradient is
        /// weighted by its share of them (DP-2), so uneven shares after a replica was lost
        /// still give the global mean.
        global_samples: usize,
        /// Where the report goes.
        reply: RpcReplyPort<Result<StepReport>>,
    },
    /// Fingerprint of the current parameters.
    Fingerprint(RpcReplyPort<Result<u64>>),
    /// Hand the model over (the stage keeps nothing).
    TakeModel(RpcReplyPort<Option<M>>),
    /// Copy the parameters and optimizer state (on the device thread), one shard per model
    /// block the stage holds (a data-parallel replica: one; a pipeline stage: one per chunk),
    /// for a checkpoint, a joining replica or a twin's replacement.
    Snapshot(RpcReplyPort<Result<Vec<ShardSnapshot>>>),
    /// Take the parameters and optimizer state of the shards of the blocks the stage holds
    /// (others in the list are ignored; a missing one is an error).
    Restore {
        /// The shards.
        shard: Vec<ShardSnapshot>,
        /// `Ok` once restored.
        reply: RpcReplyPort<Result<()>>,
    },
    /// Join a rebuilt group (after a recovery) as `id` with rank `rank`.
    Regroup {
        /// The stage's place in the new mesh.
        id: StageId,
        /// Its rank in the new mesh.
        rank: Rank,
        /// Its communicator in the new group.
        comm: Communicator,
        /// `Ok` once it holds its state and the new communicator.
        reply: RpcReplyPort<Result<()>>,
    },
    /// A stage of another process (a cluster job's proxy) joins a new data-plane group under
    /// `generation` as `rank`, with the stages of `slots` (their ranks in the assembled world)
    /// as members in new-rank order. In-process stages get their group with `Regroup`.
    #[cfg_attr(
        not(feature = "cluster"),
        expect(
            dead_code,
            reason = "only a cluster job's proxies (`cluster::remote`) read it"
        )
    )]
    Reconnect {
        /// The stage's place in the new mesh.
        id: StageId,
        /// Its rank in the new mesh.
        rank: Rank,
        /// The new group's generation.
        generation: Generation,
        /// The members, by new rank, as slots of the assembled world.
        slots: Vec<Rank>,
        /// `Ok` once connected.
        reply: RpcReplyPort<Result<()>>,
    },
    /// A pipeline stage takes new links and a new data-parallel communicator (after a stage
    /// of the mesh was replaced, REC-6).
    Rewire {
        /// Its links to its replica's other stages.
        links: Box<crate::parallel::pipeline_exec::StageLinks>,
        /// Its communicator in its stage index's data-parallel group (none at dp = 1).
        comm: Option<Communicator>,
        /// Its communicator in its tensor-parallel group (none at tp = 1).
        tp: Option<Communicator>,
        /// `Ok` once it holds its state and the new wiring.
        reply: RpcReplyPort<Result<()>>,
    },
}

impl<M> std::fmt::Debug for StageMsg<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageMsg::Init(_) => write!(f, "Init"),
            StageMsg::Step { step, .. } => write!(f, "Step({step})"),
            StageMsg::Fingerprint(_) => write!(f, "Fingerprint"),
            StageMsg::TakeModel(_) => write!(f, "TakeModel"),
            StageMsg::Regroup { id, .. } => write!(f, "Regroup({id})"),
            StageMsg::Snapshot(_) => write!(f, "Snapshot"),
            StageMsg::Restore { .. } => write!(f, "Restore"),
            StageMsg::Rewire { .. } => write!(f, "Rewire"),
            StageMsg::Reconnect { id, .. } => write!(f, "Reconnect({id})"),
        }
    }
}

/// The spawner of in-process data-parallel replicas: one replica per rank, all in one
/// collective group, regrouped in this process after a change; a job grows onto devices of
/// this process.
pub(crate) struct LocalReplicas<M, I> {
    pub(crate) spec: Arc<StageSpec<M, I>>,
}

impl<M, I> Spawner<M> for LocalReplicas<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    fn capabilities(&self) -> Capabilities {
        let mut caps = Capabilities::data_parallel(self.spec.replicated_state(), Rejoin::Regroup);
        // LOCAL-4: a rank's own state does not move onto another group size.
        caps.can_grow &= self.spec.local.is_none();
        caps
    }

    fn spawn(self: Box<Self>, cx: SpawnContext) -> SpawnFuture<M> {
        let spec = self.spec;
        Box::pin(async move {
            let world = cx.layout.world_size() as usize;
            let group = LocalGroup::new(world, Generation(0), cx.comm.clone());
            let local_group = group.clone();
            let comms = group.communicators();
            let members: Vec<Rank> = cx.layout.ranks().collect();
            let (group_ref, _) = Actor::spawn_linked(
                None,
                GroupActor,
                GroupArgs {
                    members: members.clone(),
                    group,
                },
                cx.supervisor.clone(),
            )
            .await?;
            let mut stages = Vec::with_capacity(world);
            for ((rank, comm), (device, device_ref)) in members.iter().zip(comms).zip(&cx.devices) {
                let coord = cx
                    .layout
                    .coord_of(*rank)
                    .expect("rank inside its own layout");
                let id = StageId {
                    replica: coord.dp,
                    stage: coord.pp,
                    tp: 0,
                };
                let (r, _) = Actor::spawn_linked(
                    None,
                    StageActor::<M, I>::default(),
                    StageArgs {
                        id,
                        rank: *rank,
                        device: device.clone(),
                        device_actor: device_ref.clone(),
                        comm,
                        spec: spec.clone(),
                    },
                    cx.supervisor.clone(),
                )
                .await?;
                stages.push((r, id));
            }
            Ok(Spawned {
                stages,
                shutdown: Arc::new(move || local_group.shutdown()),
                others: vec![group_ref.get_cell()],
                model_ranks: vec![0],
                assemble: |mut models: Vec<M>| models.pop(),
                grow: Some(Grow::Local(grow_replica(spec))),
                rewire: None,
                devices: None,
            })
        })
    }
}

/// Spawns the stage actor of a replica that joins a running job.
fn grow_replica<M, I>(spec: Arc<StageSpec<M, I>>) -> GrowStage<M>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    Arc::new(move |g: GrowArgs| {
        let spec = spec.clone();
        Box::pin(async move {
            let (r, _) = Actor::spawn_linked(
                None,
                StageActor::<M, I>::default(),
                StageArgs {
                    id: g.id,
                    rank: g.rank,
                    device: g.device,
                    device_actor: g.device_actor,
                    comm: g.comm,
                    spec,
                },
                g.supervisor,
            )
            .await?;
            Ok(r)
        })
    })
}

/// The actor of one stage.
pub(crate) struct StageActor<M, I>(std::marker::PhantomData<fn() -> (M, I)>);

impl<M, I> Default for StageActor<M, I> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<M, I> std::fmt::Debug for StageActor<M, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StageActor")
    }
}

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

impl<M, I> Actor for StageActor<M, I>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    type Msg = StageMsg<M>;
    type State = StageState<M, I>;
    type Arguments = StageArgs<M, I>;

    async fn pre_start(
        &self,
        _myself: ActorRef<StageMsg<M>>,
        a: StageArgs<M, I>,
    ) -> Result<StageState<M, I>, ActorProcessingErr> {
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

    async fn handle(
        &self,
        _myself: ActorRef<StageMsg<M>>,
        msg: StageMsg<M>,
        state: &mut StageState<M, I>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            StageMsg::Init(reply) => {
                let _ = reply.send(init(state).await);
            }
            StageMsg::Step {
                step,
                micro_batches,
                global_samples,
                reply,
            } => {
                let _ =
                    reply.send(step_on_device(state, step, micro_batches, global_samples).await);
            }
            StageMsg::Fingerprint(reply) => {
                let out = run_on_slot(&state.device_actor, "fingerprint", &mut state.slot, |s| {
                    parameter_fingerprint(&s.model)
                })
                .await;
                let r = match out {
                    None => Err(lost(state)),
                    Some(Ok(Ok(f))) => Ok(f),
                    Some(Ok(Err(panic))) => Err(failed(state, "fingerprint", panic)),
                    Some(Err(e)) => Err(e),
                };
                let _ = reply.send(r);
            }
            StageMsg::TakeModel(reply) => {
                let _ = reply.send(state.slot.take().map(|s| s.model));
            }
            StageMsg::Snapshot(reply) => {
                let _ = reply.send(snapshot(state).await.map(|s| vec![s]));
            }
            StageMsg::Restore { shard, reply } => {
                let wanted = ShardId::stage(state.id.stage);
                let r = match shard.into_iter().find(|s| s.shard == wanted) {
                    Some(s) => restore(state, s).await,
                    None => Err(Error::InvalidConfig(format!(
                        "no {wanted} to restore {} from",
                        state.id
                    ))),
                };
                let _ = reply.send(r);
            }
            StageMsg::Regroup {
                id,
                rank,
                comm,
                reply,
            } => {
                let r = match state.slot.as_mut() {
                    Some(slot) => {
                        slot.comm = comm;
                        state.id = id;
                        state.rank = rank;
                        Ok(())
                    }
                    None => Err(lost(state)),
                };
                let _ = reply.send(r);
            }
            StageMsg::Rewire { reply, .. } => {
                let _ = reply.send(Err(Error::InvalidConfig(
                    "a data-parallel replica has no pipeline links".into(),
                )));
            }
            StageMsg::Reconnect { reply, .. } => {
                let _ = reply.send(Err(Error::InvalidConfig(
                    "an in-process stage joins a rebuilt group through Regroup".into(),
                )));
            }
        }
        Ok(())
    }
}

/// The stage's parameters and optimizer state, copied on its device thread.
async fn snapshot<M: Module + 'static, I>(state: &mut StageState<M, I>) -> Result<ShardSnapshot> {
    let Some(slot) = state.slot.take() else {
        return Err(lost(state));
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
        Err(panic) => Err(failed(state, "checkpoint snapshot", panic)),
    }
}

/// Take a checkpoint shard's parameters (by name) and optimizer state.
async fn restore<M: Module + 'static, I>(
    state: &mut StageState<M, I>,
    shard: ShardSnapshot,
) -> Result<()> {
    let Some(mut slot) = state.slot.take() else {
        return Err(lost(state));
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
        Err(panic) => Err(failed(state, "checkpoint restore", panic)),
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

fn lost<M, I>(state: &StageState<M, I>) -> Error {
    Error::StageFailed {
        device: state.device.id(),
        stage: state.id,
        during: "a previous failure".into(),
        reason: "the stage lost its state in an earlier failure".into(),
    }
}

fn failed<M, I>(state: &StageState<M, I>, during: &str, reason: String) -> Error {
    Error::StageFailed {
        device: state.device.id(),
        stage: state.id,
        during: during.into(),
        reason,
    }
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
        let sync = match spec.local {
            Some(updates) => sync::for_local_updates(
                updates,
                &model,
                &spec.optimizer,
                spec.bucket_elems,
                fuse_below,
                rank,
                world,
            ),
            None if spec.compression.is_on() => {
                sync::compressed(spec.compression, &model, &spec.optimizer, rank, world)
            }
            None => sync::for_stage(
                spec.zero,
                &model,
                &spec.optimizer,
                spec.bucket_elems,
                fuse_below,
                rank,
                world,
            )
            .map_err(|e| Error::InvalidConfig(e.to_string()))?,
        };
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
        Err(panic) => Err(failed(state, "building the model", panic)),
    }
}

async fn step_on_device<M, I>(
    state: &mut StageState<M, I>,
    step: u64,
    micro_batches: Vec<Vec<usize>>,
    global: usize,
) -> Result<StepReport>
where
    M: Module + 'static,
    I: Send + Sync + 'static,
{
    let Some(mut slot) = state.slot.take() else {
        return Err(lost(state));
    };
    let spec = state.spec.clone();
    let rank = state.rank;
    let device_id = state.device.id();
    let device = state.device.burn().clone();
    let phase = Arc::new(Mutex::new("starting"));
    let thread_phase = phase.clone();
    let out = run_on(&state.device_actor, format!("step {step}"), move || {
        let sent_before = slot.comm.bytes_sent();
        // LOCAL-4: state restored before this rank knew its place in the group.
        let (r, w) = (slot.comm.rank().index(), slot.comm.world());
        match slot.sync.settle(&slot.model, r, w) {
            Ok(Some(model)) => slot.model = model,
            Ok(None) => {}
            Err(e) => return (slot, Err(e.into())),
        }
        let r = train_step(
            &mut slot,
            &spec,
            (&device, device_id),
            rank,
            (step, global),
            &micro_batches,
            &thread_phase,
        );
        let (report, grads) = match r {
            Ok(x) => x,
            Err(e) => return (slot, Err(e)),
        };
        // DP-4 before the update: the buffer broadcast is the step's last collective, so the
        // update is the only thing after it (REC-1 redoes a step only where nothing was
        // applied; REC-7 evens out survivors that finished it and survivors that did not).
        let (slot, report) = sync_buffers(slot, Ok(report), &thread_phase);
        let mut report = match report {
            Ok(r) => r,
            Err(e) => return (slot, Err(e)),
        };
        let (slot, applied) = match grads {
            Some(grads) => with_hooks(
                spec.faults.as_deref(),
                device_id,
                step,
                0,
                Phase::Update,
                || {
                    apply_update(
                        slot,
                        grads,
                        &mut report,
                        (step, &device),
                        &spec,
                        &thread_phase,
                    )
                },
            ),
            None => (slot, Ok(())),
        };
        let applied = applied.map(|()| {
            report.bytes_sent = slot.comm.bytes_sent().saturating_sub(sent_before);
            report
        });
        (slot, applied)
    })
    .await?;
    match out {
        Ok((slot, r)) => {
            state.slot = Some(slot);
            r
        }
        Err(panic) => {
            let during = *phase.lock().unwrap_or_else(|e| e.into_inner());
            Err(failed(state, during, panic))
        }
    }
}

/// One data-parallel step on the device thread.
fn train_step<M: Module, I: Send + Sync + 'static>(
    slot: &mut Slot<M>,
    spec: &StageSpec<M, I>,
    (device, device_id): (&Device, DeviceId),
    rank: Rank,
    (step, global): (u64, usize),
    micro_batches: &[Vec<usize>],
    phase: &Mutex<&'static str>,
) -> Result<(StepReport, Option<Reduced>)> {
    let hooks = spec.faults.as_deref();
    if let Some(h) = &spec.faults {
        // FaultPlan: this step's collective messages are counted from here (COMM-8 hook).
        h.begin_step(device_id, step);
        if h.has_message_faults() {
            slot.comm
                .set_message_hook(Some(DeviceMessages::new(h.clone(), device_id)));
        }
    }
    let set_phase = |p: &'static str| {
        *phase.lock().unwrap_or_else(|e| e.into_inner()) = p;
        report_progress(|| format!("step {step}: {p}"));
    };
    let world = slot.comm.world();
    let k = micro_batches.len();
    // One device, one micro-batch, no clipping, nothing to unscale or narrow: Burn's
    // gradients go straight to the optimizer.
    let mixed = spec.mixed.sync(slot.scaler.is_some());
    let direct = world == 1
        && k == 1
        && spec.clip_norm.is_none()
        && !mixed.find_overflow
        && !mixed.wire.is_low();
    // f16: the loss is multiplied by the scale before backward, the reduced gradient divided.
    let loss_scale = slot.scaler.as_ref().map(LossScaler::scale);
    let ad = device.clone().autodiff();
    let mut trace = Vec::new();
    let mut span = |kind: TraceKind, start: Instant| {
        let s = start.duration_since(spec.epoch);
        trace.push(TraceRecord {
            rank,
            step,
            kind,
            start_us: s.as_micros() as u64,
            duration_us: start.elapsed().as_micros() as u64,
        });
    };
    let mut loss_sum = 0.0f32;
    let mut accumulated = GradientsAccumulator::<M>::new();
    let mut last = None;
    for (m, ids) in micro_batches.iter().enumerate() {
        set_phase("forward");
        report_progress(|| format!("step {step}: forward of micro-batch {m}"));
        let t = Instant::now();
        let items = ids
            .iter()
            .map(|&i| {
                spec.dataset
                    .get(i)
                    .ok_or_else(|| Error::Data(format!("sample {i} could not be read")))
            })
            .collect::<Result<Vec<I>>>()?;
        let loss = with_hooks(hooks, device_id, step, m as u32, Phase::Forward, || {
            // Mixed precision: forward on a low-precision copy whose casts hand the f32
            // master its gradients (PREC-1); the identity at f32.
            let model = low_precision_copy(&slot.model, spec.mixed.precision);
            (spec.loss_fn)(&model, &items, &ad).cast(FloatDType::F32)
        });
        let value: f32 = loss.clone().into_scalar();
        loss_sum += value * ids.len() as f32;
        span(
            TraceKind::Forward {
                micro_batch: m as u32,
                samples: ids.len() as u32,
            },
            t,
        );
        set_phase("backward");
        report_progress(|| format!("step {step}: backward of micro-batch {m}"));
        let t = Instant::now();
        // DP-2: this micro-batch's share of the step's samples.
        let weight = ids.len() as f32 / global.max(1) as f32 * loss_scale.unwrap_or(1.0);
        let grads = with_hooks(hooks, device_id, step, m as u32, Phase::Backward, || {
            let loss = if weight == 1.0 { loss } else { loss * weight };
            GradientsParams::from_grads(loss.backward(), &slot.model)
        });
        if k == 1 {
            last = Some(grads);
        } else {
            accumulated.accumulate(&slot.model, grads);
        }
        span(
            TraceKind::Backward {
                micro_batch: m as u32,
            },
            t,
        );
    }
    let grads = last.unwrap_or_else(|| accumulated.grads());
    let local_loss = loss_sum / micro_batches.iter().map(Vec::len).sum::<usize>().max(1) as f32;

    // DP-3: every replica learns every replica's loss and decides the same thing.
    set_phase("all-reduce of losses");
    // FaultPlan: a partition holds this device's messages back for a while.
    if let Some(cut_off) = hooks.and_then(|h| h.partition(device_id, step)) {
        std::thread::sleep(cut_off);
    }
    let mut losses = vec![0.0f32; world];
    losses[rank.index() % world.max(1)] = local_loss;
    if world > 1 {
        slot.comm.all_reduce(&mut losses, ReduceOp::Sum)?;
    }
    let bad: Vec<Rank> = losses
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_finite())
        .map(|(r, _)| Rank(r as u32))
        .collect();
    let sample_ids = micro_batches.concat();
    if !bad.is_empty() {
        return match spec.non_finite {
            NonFinitePolicy::Stop => Err(Error::NonFiniteLoss { step, ranks: bad }),
            NonFinitePolicy::Skip => Ok((
                StepReport {
                    rank,
                    sample_ids,
                    local_loss: Some(local_loss),
                    learning_rate: None,
                    trace,
                    pipeline: None,
                    held: None,
                    loss_scale: loss_scale.map(|s| (s, s)),
                    bytes_sent: 0,
                    parameter_server: None,
                },
                None,
            )),
        };
    }

    // DP-2: the mean over replicas of each replica's mean over its micro-batches; the
    // strategy's synchronisation reduces it (all-reduce in buckets, or ZeRO's shards).
    set_phase("gradient reduction");
    let inner = device.clone();
    let local_samples = micro_batches.iter().map(Vec::len).sum::<usize>();
    let mut cx = SyncContext {
        comm: Some(&mut slot.comm),
        device: &inner,
        scale: loss_scale.map_or(1.0, |s| 1.0 / s),
        share: local_samples as f32 / global.max(1) as f32,
        clip: spec.clip_norm,
        direct,
        spans: Vec::new(),
        precision: mixed,
    };
    let reduced = slot.sync.reduce(&slot.model, grads, &mut cx)?;
    let spans = std::mem::take(&mut cx.spans);
    drop(cx);
    record_spans(&mut trace, (rank, step), spec.epoch, spans);
    // PREC-2: every replica holds the same reduced gradient, so every scaler decides alike.
    let scaled = slot.scaler.as_mut().map(|s| {
        let used = s.scale();
        s.update(reduced.non_finite);
        (used, s.scale())
    });
    if reduced.non_finite && spec.non_finite == NonFinitePolicy::Stop && scaled.is_none() {
        return Err(Error::NonFiniteGradient { step });
    }
    let skip = reduced.non_finite;
    Ok((
        StepReport {
            rank,
            sample_ids,
            local_loss: Some(local_loss),
            learning_rate: None,
            trace,
            pipeline: None,
            held: None,
            loss_scale: scaled,
            bytes_sent: 0,
            parameter_server: None,
        },
        (!skip).then_some(reduced),
    ))
}

/// DP-4: buffers (batch-norm statistics, frozen weights) change in forward from each replica's
/// own data; like DDP's `broadcast_buffers`, every replica takes rank 0's after each step, so
/// replicas stay identical.
fn sync_buffers<M: Module>(
    mut slot: Slot<M>,
    report: Result<StepReport>,
    phase: &Mutex<&'static str>,
) -> (Slot<M>, Result<StepReport>) {
    if !slot.has_buffers || slot.comm.world() == 1 {
        return (slot, report);
    }
    *phase.lock().unwrap_or_else(|e| e.into_inner()) = "buffer broadcast";
    let comm = &mut slot.comm;
    let (model, synced) = map_parameters(slot.model, ParamFilter::Buffers, |_, values| {
        comm.broadcast(values, Rank(0))
    });
    slot.model = model;
    match synced {
        Ok(()) => (slot, report),
        Err(e) => (slot, Err(e.into())),
    }
}

/// The optimizer step (and whatever exchange the strategy does after it). Takes the slot by
/// value so that the model moves into the optimizer with no other reference to its tensors
/// (no copy of the parameters).
fn apply_update<M: Module, I>(
    mut slot: Slot<M>,
    reduced: Reduced,
    report: &mut StepReport,
    (step, device): (u64, &Device),
    spec: &StageSpec<M, I>,
    phase: &Mutex<&'static str>,
) -> (Slot<M>, Result<()>) {
    *phase.lock().unwrap_or_else(|e| e.into_inner()) = "optimizer step";
    // LR-1: the schedule advances only with an applied step.
    let (lr, lr_after) = slot.lr.peek_next();
    report.learning_rate = Some(lr.base());
    let model = slot.model;
    let mut cx = SyncContext {
        comm: Some(&mut slot.comm),
        device,
        scale: 1.0,
        share: 1.0,
        clip: None,
        direct: false,
        spans: Vec::new(),
        precision: SyncPrecision::default(),
    };
    let (model, r) = match slot.sync.apply(model, reduced, lr, &mut cx) {
        Ok(model) => (model, Ok(())),
        Err((model, e)) => (model, Err(e)),
    };
    if r.is_ok() {
        slot.lr.commit(lr_after);
    }
    let spans = std::mem::take(&mut cx.spans);
    drop(cx);
    slot.model = model;
    record_spans(&mut report.trace, (report.rank, step), spec.epoch, spans);
    report.held = Some(slot.sync.held());
    (slot, r.map_err(Error::from))
}

/// The synchronisation's spans (what, when it began, how long) as this rank's trace records
/// of `step`, timed from the job's start.
fn record_spans(
    trace: &mut Vec<TraceRecord>,
    (rank, step): (Rank, u64),
    epoch: Instant,
    spans: Vec<(TraceKind, Instant, std::time::Duration)>,
) {
    trace.extend(spans.into_iter().map(|(kind, start, took)| TraceRecord {
        rank,
        step,
        kind,
        start_us: start.duration_since(epoch).as_micros() as u64,
        duration_us: took.as_micros() as u64,
    }));
}
