//! The pipeline stage role (`PipelineStageActor` = [`Stage`] of [`PipelineStageState`]): one
//! pipeline stage of one data-parallel replica.
//!
//! It holds the stage's model chunks (one, or v with an interleaved schedule), its ends of the
//! pipeline links and the communicator of its data-parallel group (the same stage in every
//! replica). For a step, all of it moves onto the device's compute thread, which runs the
//! stage's instruction list literally ([`run_stage_step`], EXEC-1..3), and comes back with the
//! record (RT-1). The stage actor is the one every stage kind shares, so the Supervisor drives
//! a pipeline stage and a data-parallel replica the same way.
//!
//! - PP-1: a failure anywhere in the pipeline (an error, a panic, a neighbour that never sends)
//!   ends the step on every stage within the step time-out: the Supervisor's shutdown sets the
//!   links' abort flag and shuts the data-parallel groups down, a panicking stage drops its
//!   links (its neighbours see them closed), and every wait on a link is bounded.
//! - PP-2: the error names the stage (replica and stage index), and the micro-batch: for a
//!   panic through the phase ("backward of micro-batch 3, chunk 0"), for a link through
//!   [`ExecError`].

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::device::{DeviceMsg, report_progress, run_on, run_on_slot};
use super::group::{GroupActor, GroupArgs};
use super::spawner::{Capabilities, SpawnFuture, Spawner};
use super::spawner::{RewireArgs, RewireStages, Rewired, SpawnContext, Spawned};
use super::stage::{InitReport, Stage, StageMsg, StageRole, StepReport, failed, lost, read_items};
use crate::checkpoint::{CheckpointError, ShardId, ShardSnapshot, TrainingState};
use crate::comm::{Communicator, LocalGroup};
use crate::data::Dataset;
use crate::device::MeshDevice;
use crate::error::{Error, Result};
use crate::events::PipelineStageStep;
use crate::faults::DeviceMessages;
use crate::mesh::StageId;
use crate::mesh::{Coord, Generation, Layout, Rank};
use crate::optim::{LearningRate, OptimizerConfig};
use crate::parallel::pipeline::{Chunk, Instr, PipelineSchedule, StageIndex, TimedInstr};
use crate::parallel::pipeline_exec::{
    ModelGroups, StageLinks, StageStepRecord, StageWork, StepContext, links, run_stage_step,
};
use crate::parallel::stages::{BlockPart, PipelineModel, PipelineStages};
use crate::parallel::tensor::TensorParallel;
use crate::parallel::tensor::reslice::reslice;
use crate::precision::LossScaler;
use crate::trace::{TraceKind, TraceRecord};
mod spawn;
pub(crate) use spawn::LocalPipeline;
use spawn::RankWiring;
#[cfg(feature = "cluster")]
pub(crate) use spawn::spawn_unlinked;

/// Everything the stages of a pipeline job share.
pub(crate) struct PipelineSpec<I> {
    pub(crate) stages: PipelineStages<I>,
    pub(crate) plan: Arc<PipelineSchedule>,
    pub(crate) dataset: Arc<dyn Dataset<Item = I>>,
    pub(crate) optimizer: OptimizerConfig,
    pub(crate) learning_rate: LearningRate,
    /// How much of each block's training state each data-parallel rank keeps (ZeRO).
    pub(crate) zero: crate::parallel::zero::ZeroStage,
    /// Each block's reduction compressed (CSYNC-4, ZSYNC-1).
    pub(crate) compression: crate::parallel::compress::Compression,
    /// Each block's ranks stepping alone and meeting every few steps (LOCAL-6).
    pub(crate) local: Option<crate::parallel::local::LocalUpdates>,
    /// Clip each step's gradient to this global norm over the stage's blocks (block jobs).
    pub(crate) clip: Option<f32>,
    /// Blocks whose gathered parameters may wait for their use at once, the collectives
    /// overlapping the compute (`JobBuilder::blocks_in_flight`; 0: no overlap).
    pub(crate) blocks_in_flight: usize,
    /// Every block recomputes its forward during its backward (`JobConfig::recompute`).
    pub(crate) recompute: bool,
    /// The job's start: trace times are measured from it.
    pub(crate) epoch: Instant,
    /// The fault plan's hooks, if the job has one.
    pub(crate) faults: Option<Arc<crate::faults::FaultHooks>>,
    /// What every block's forward and backward compute in (MIX-1), the type its gradients
    /// travel in, and f16's loss scaler (MIX-2).
    pub(crate) mixed: super::stage::MixedPrecision,
}

impl<I> PipelineSpec<I> {
    /// How the mesh's ranks keep their training state (what their capabilities derive from).
    pub(crate) fn keeping(&self) -> crate::actors::spawner::StateKeeping {
        crate::actors::spawner::StateKeeping {
            sharded: self.zero.shards_optimizer(),
            compressed: self.compression.is_on(),
            local: self.local.is_some(),
        }
    }
}

/// The actor of one pipeline stage.
pub(crate) type PipelineStageActor<I> = Stage<PipelineStageState<I>>;

/// What a pipeline stage starts from.
pub(crate) struct PipelineStageArgs<I> {
    id: StageId,
    rank: Rank,
    /// Its rank in its tensor-parallel group.
    tp_rank: u32,
    device: MeshDevice,
    device_actor: ActorRef<DeviceMsg>,
    spec: Arc<PipelineSpec<I>>,
    links: Option<StageLinks>,
    comm: Option<Communicator>,
    /// Its tensor-parallel group and its replica's model group.
    model: ModelGroups,
}

impl<I> std::fmt::Debug for PipelineStageArgs<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PipelineStageArgs({})", self.id)
    }
}

/// What moves onto the device thread for a step.
struct Slot<I> {
    chunks: Vec<Box<dyn StageWork<I>>>,
    links: StageLinks,
    comm: Option<Communicator>,
    /// f16's dynamic loss scaler, the same on every replica (MIX-2).
    scaler: Option<LossScaler>,
    /// The rank's tensor-parallel group, shared by its blocks.
    tp: Arc<TensorParallel>,
    /// Every stage × tensor-parallel rank of the rank's replica (none when it is one rank):
    /// the global norm and f16's overflow are agreed over it.
    replica: Option<Communicator>,
}

/// State of a [`PipelineStageActor`].
pub(crate) struct PipelineStageState<I> {
    id: StageId,
    rank: Rank,
    /// Its rank in its tensor-parallel group.
    tp_rank: u32,
    device: MeshDevice,
    device_actor: ActorRef<DeviceMsg>,
    spec: Arc<PipelineSpec<I>>,
    /// Links and communicators until `Init` builds the chunks.
    pending: Option<RankWiring>,
    slot: Option<Slot<I>>,
}

impl<I> std::fmt::Debug for PipelineStageState<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PipelineStageState({})", self.id)
    }
}

impl<I> StageRole for PipelineStageState<I>
where
    I: Send + Sync + 'static,
{
    type Model = PipelineModel;
    type Args = PipelineStageArgs<I>;
    const KIND: &'static str = "pipeline stage";

    fn start(a: PipelineStageArgs<I>) -> std::result::Result<Self, String> {
        let links = a
            .links
            .ok_or_else(|| format!("{}: no pipeline links", a.id))?;
        Ok(PipelineStageState {
            id: a.id,
            rank: a.rank,
            tp_rank: a.tp_rank,
            device: a.device,
            device_actor: a.device_actor,
            spec: a.spec,
            pending: Some((links, a.comm, a.model)),
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
        _global_samples: usize,
    ) -> Result<StepReport> {
        step_on_device(self, step, micro_batches).await
    }

    async fn fingerprint(&mut self) -> Result<u64> {
        // A ZeRO-3 stage gathers its blocks' full parameters first (every replica of
        // the stage is asked at once): the fingerprint, and the model handed over
        // after it, are the whole blocks.
        let out = run_on_slot(&self.device_actor, "fingerprint", &mut self.slot, |s| {
            for chunk in s.chunks.iter_mut() {
                chunk.gather_now(s.comm.as_mut())?;
            }
            Ok::<_, crate::parallel::pipeline_exec::ExecError>(fingerprint(&s.chunks))
        })
        .await;
        match out {
            None => Err(lost(self.id, &self.device)),
            Some(Ok(Ok(Ok(f)))) => Ok(f),
            Some(Ok(Ok(Err(e)))) => Err(Error::from(e)),
            Some(Ok(Err(panic))) => Err(failed(self.id, &self.device, "fingerprint", panic)),
            Some(Err(e)) => Err(e),
        }
    }

    async fn take_model(&mut self) -> Option<PipelineModel> {
        let plan = self.spec.plan.clone();
        let stage = StageIndex(self.id.stage);
        let tp_rank = self.tp_rank;
        let blocks = &self.spec.stages.blocks;
        self.slot.take().map(|slot| {
            PipelineModel::from_parts(
                slot.chunks
                    .into_iter()
                    .enumerate()
                    .map(|(c, w)| {
                        let block = plan.block(stage, Chunk(c as u32));
                        BlockPart {
                            block,
                            tp_rank,
                            module: w.into_module(),
                            unshard: blocks
                                .get(block as usize)
                                .and_then(|b| b.tensor_parallel.as_ref())
                                .map(|(_, u)| u.clone()),
                        }
                    })
                    .collect(),
            )
        })
    }

    async fn snapshot(&mut self) -> Result<Vec<ShardSnapshot>> {
        let plan = self.spec.plan.clone();
        let tp_rank = self.tp_rank;
        let stage = StageIndex(self.id.stage);
        let out = run_on_slot(&self.device_actor, "snapshot", &mut self.slot, move |s| {
            let scale = s.scaler.as_ref().map(LossScaler::state);
            // One shard per block the stage holds (CKPT-6).
            s.chunks
                .iter()
                .enumerate()
                .map(|(c, w)| {
                    let (params, optimizer) = w.snapshot()?;
                    Ok(ShardSnapshot {
                        // A tensor-parallel rank's slices are a shard of their own.
                        shard: ShardId {
                            pp: plan.block(stage, Chunk(c as u32)),
                            tp: tp_rank,
                        },
                        params,
                        optimizer: Some(optimizer),
                        // CKPT-9, LR-2: the scheduler travels with the block.
                        // MIX-3: and the stage's loss scaler.
                        training: TrainingState::default()
                            .with_lr_scheduler(w.lr_state()?)
                            .with_loss_scale(scale),
                    })
                })
                .collect::<std::result::Result<Vec<_>, CheckpointError>>()
        })
        .await;
        match out {
            None => Err(lost(self.id, &self.device)),
            Some(Ok(Ok(r))) => r.map_err(Error::from),
            Some(Ok(Err(panic))) => Err(failed(self.id, &self.device, "snapshot", panic)),
            Some(Err(e)) => Err(e),
        }
    }

    async fn snapshot_model(&mut self) -> Result<Vec<ShardSnapshot>> {
        let plan = self.spec.plan.clone();
        let tp_rank = self.tp_rank;
        let stage = StageIndex(self.id.stage);
        let out = run_on_slot(
            &self.device_actor,
            "model snapshot",
            &mut self.slot,
            move |s| {
                s.chunks
                    .iter()
                    .enumerate()
                    .map(|(c, w)| ShardSnapshot {
                        shard: ShardId {
                            pp: plan.block(stage, Chunk(c as u32)),
                            tp: tp_rank,
                        },
                        params: w.module_params(),
                        optimizer: None,
                        training: TrainingState::default(),
                    })
                    .collect::<Vec<_>>()
            },
        )
        .await;
        match out {
            None => Err(lost(self.id, &self.device)),
            Some(Ok(Ok(r))) => Ok(r),
            Some(Ok(Err(panic))) => Err(failed(self.id, &self.device, "model snapshot", panic)),
            Some(Err(e)) => Err(e),
        }
    }

    async fn restore(&mut self, shard: Vec<ShardSnapshot>) -> Result<()> {
        let plan = self.spec.plan.clone();
        let tp_rank = self.tp_rank;
        let stage = StageIndex(self.id.stage);
        let id = self.id;
        let out = run_on_slot(&self.device_actor, "restore", &mut self.slot, move |s| {
            // Its place in the block's data-parallel group, for sharded self.
            let rank_of = s
                .comm
                .as_ref()
                .map_or((0, 1), |c| (c.rank().index(), c.world()));
            let degree = s.tp.degree();
            for (c, w) in s.chunks.iter_mut().enumerate() {
                let wanted = ShardId {
                    pp: plan.block(stage, Chunk(c as u32)),
                    tp: tp_rank,
                };
                let resliced;
                let shard = match slices_of(&shard, wanted.pp, degree) {
                    Slices::Own => shard.iter().find(|x| x.shard == wanted),
                    Slices::None => None,
                    // TP-7: written at another tensor-parallel degree: re-sliced here.
                    Slices::Other(parts) => {
                        let Some(held) = w.held_params() else {
                            return Err(Error::InvalidConfig(format!(
                                "the checkpoint holds {} tensor-parallel slices of block {}; \
                                 {id}'s block is not tensor-parallel",
                                parts.len(),
                                wanted.pp
                            )));
                        };
                        resliced =
                            reslice(&parts, &held, tp_rank as usize, degree).map_err(|e| {
                                Error::InvalidConfig(format!(
                                    "{id} (tp rank {tp_rank} of {degree}) from the {} slices \
                                     of block {}: {e}",
                                    parts.len(),
                                    wanted.pp
                                ))
                            })?;
                        Some(&resliced)
                    }
                };
                let Some(shard) = shard else {
                    return Err(Error::InvalidConfig(format!(
                        "no {wanted} to restore {id} from"
                    )));
                };
                w.restore_lr(shard.training.lr_scheduler.as_ref())?;
                w.restore(&shard.params, shard.optimizer.as_ref(), rank_of)?;
            }
            // MIX-3: every shard of a checkpoint carries the same training self.
            let scale = shard.first().and_then(|x| x.training.loss_scale);
            crate::actors::stage::restore_scaler(s.scaler.as_mut(), scale)
        })
        .await;
        match out {
            None => Err(lost(self.id, &self.device)),
            Some(Ok(Ok(r))) => r,
            Some(Ok(Err(panic))) => Err(failed(self.id, &self.device, "restore", panic)),
            Some(Err(e)) => Err(e),
        }
    }

    fn regroup(&mut self, _id: StageId, _rank: Rank, _comm: Communicator) -> Result<()> {
        Err(Error::InvalidConfig(
            "pipeline stages cannot join a rebuilt group yet".into(),
        ))
    }

    fn rewire(
        &mut self,
        rank: Rank,
        links: StageLinks,
        comm: Option<Communicator>,
        model: ModelGroups,
    ) -> Result<()> {
        match self.slot.as_mut() {
            Some(slot) => {
                // ELASTIC-6: a resize along dp moves the stage's rank, never its place.
                self.rank = rank;
                slot.links = links;
                slot.comm = comm;
                slot.replica = model.replica;
                // The tensor-parallel group of the new generation, for every block.
                slot.tp = Arc::new(
                    model
                        .tp
                        .map_or_else(TensorParallel::single, TensorParallel::new),
                );
                for chunk in &mut slot.chunks {
                    chunk.set_tensor_parallel(&slot.tp);
                }
                Ok(())
            }
            None => Err(lost(self.id, &self.device)),
        }
    }
}

/// One fingerprint of all the stage's chunks.
fn fingerprint<I>(chunks: &[Box<dyn StageWork<I>>]) -> u64 {
    chunks.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, c| {
        (h ^ c.fingerprint()).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

async fn init<I: Send + Sync + 'static>(state: &mut PipelineStageState<I>) -> Result<InitReport> {
    let Some((links, comm, model)) = state.pending.take() else {
        return Err(Error::Runtime(format!("{} initialized twice", state.id)));
    };
    let (tp, replica) = (model.tp, model.replica);
    let spec = state.spec.clone();
    let stage = StageIndex(state.id.stage);
    let device = state.device.burn().clone();
    let tp = Arc::new(tp.map_or_else(TensorParallel::single, TensorParallel::new));
    let tp_group = tp.clone();
    let out = run_on(&state.device_actor, "init", move || {
        // Every replica builds its chunks from the same records: they start identical; a
        // tensor-parallel block keeps the rank's slice (TP-3).
        let built: Result<Vec<Box<dyn StageWork<I>>>, crate::config::InvalidConfig> =
            (0..spec.plan.virtual_stages())
                .map(|c| {
                    let block = &spec.stages.blocks[spec.plan.block(stage, Chunk(c)) as usize];
                    let mut work =
                        (block.build)(&device, &spec.optimizer, spec.learning_rate.clone(), &tp)?;
                    work.set_reduction(crate::parallel::sync::Reduction {
                        zero: spec.zero,
                        compression: spec.compression,
                        local: spec.local,
                    })
                    .expect("the job refuses an optimizer ZeRO cannot shard when it is built");
                    work.set_precision(spec.mixed.precision, spec.mixed.sync(false).wire);
                    if spec.recompute {
                        work.recompute_always();
                    }
                    Ok(work)
                })
                .collect();
        let chunks = match built {
            Ok(chunks) => chunks,
            Err(e) => return Err(e),
        };
        let f = fingerprint(&chunks);
        // At ZeRO-3 each rank keeps only its shard from the start (FSDP-1); no collective.
        let mut chunks = chunks;
        for chunk in chunks.iter_mut() {
            chunk.shard_parameters(comm.as_ref());
        }
        Ok((chunks, f, comm))
    })
    .await?;
    match out {
        Ok(Err(e)) => Err(Error::InvalidConfig(format!("{}: {e}", state.id))),
        Ok(Ok((chunks, f, comm))) => {
            state.slot = Some(Slot {
                chunks,
                links,
                comm,
                scaler: state.spec.mixed.new_scaler()?,
                tp: tp_group,
                replica,
            });
            Ok(InitReport {
                before: f,
                after: f,
            })
        }
        Err(panic) => Err(failed(state.id, &state.device, "building the stage", panic)),
    }
}

/// What a running instruction is called in a failure report.
fn describe(instr: &Instr) -> String {
    let what = match instr {
        Instr::RecvActivation { .. } => "receiving the activation",
        Instr::Forward { .. } => "forward",
        Instr::SendActivation { .. } => "sending the activation",
        Instr::RecvGradient { .. } => "receiving the gradient",
        Instr::Backward { .. } => "backward",
        Instr::SendGradient { .. } => "sending the gradient",
    };
    format!(
        "{what} of micro-batch {} (chunk {})",
        instr.mb().0,
        instr.chunk().0
    )
}

async fn step_on_device<I: Send + Sync + 'static>(
    state: &mut PipelineStageState<I>,
    step: u64,
    micro_batches: Vec<Vec<usize>>,
) -> Result<StepReport> {
    let Some(mut slot) = state.slot.take() else {
        return Err(lost(state.id, &state.device));
    };
    let spec = state.spec.clone();
    let stage = StageIndex(state.id.stage);
    let device_id = state.device.id();
    let phase = Arc::new(Mutex::new(String::from("loading the micro-batches")));
    let thread_phase = phase.clone();
    let ids = micro_batches.clone();
    let out = run_on(&state.device_actor, format!("step {step}"), move || {
        if let Some(h) = &spec.faults {
            // FaultPlan: this step's collective messages are counted from here (COMM-8 hook),
            // on whichever thread runs the stage's collectives.
            h.begin_step(device_id, step);
            if h.has_message_faults()
                && let Some(comm) = slot.comm.as_mut()
            {
                comm.set_message_hook(Some(DeviceMessages::new(h.clone(), device_id)));
            }
        }
        let items: Result<Vec<Vec<I>>> = ids
            .iter()
            .map(|mb| read_items(&*spec.dataset, mb))
            .collect();
        let items = match items {
            Ok(items) => items,
            Err(e) => return (slot, Err(e)),
        };
        let on_instr = |instr: &Instr| {
            let what = describe(instr);
            report_progress(|| format!("step {step}: {what}"));
            *thread_phase.lock().unwrap_or_else(|e| e.into_inner()) = what;
        };
        let loss_scale = slot.scaler.as_ref().map(LossScaler::scale);
        let r = run_stage_step(
            &mut slot.chunks,
            StepContext {
                schedule: &spec.plan,
                stage,
                links: &slot.links,
                micro_batches: &items,
                replicas: slot.comm.as_mut(),
                model: slot.replica.as_mut(),
                clip: spec.clip,
                tp_rank: slot.tp.rank(),
                on_instr: &on_instr,
                blocks_in_flight: spec.blocks_in_flight,
                faults: spec.faults.as_deref().map(|h| (h, device_id, step)),
                loss_scale,
            },
        );
        (slot, r.map_err(Error::from))
    })
    .await?;
    match out {
        Ok((mut slot, r)) => {
            // MIX-2: every replica saw the same overflow flag, so every scaler decides alike.
            let scaled = match (&r, slot.scaler.as_mut()) {
                (Ok(record), Some(s)) => {
                    let used = s.scale();
                    s.update(record.overflow.unwrap_or(false));
                    Some((used, s.scale()))
                }
                _ => None,
            };
            let traffic = (slot.tp.degree() > 1).then(|| slot.tp.take_traffic());
            state.slot = Some(slot);
            let record = r?;
            let mut report = report(state, step, micro_batches, record);
            report.loss_scale = scaled;
            if let Some(p) = report.pipeline.as_mut() {
                p.tensor_parallel = traffic;
            }
            Ok(report)
        }
        Err(panic) => {
            let during = phase.lock().unwrap_or_else(|e| e.into_inner()).clone();
            Err(failed(state.id, &state.device, &during, panic))
        }
    }
}

/// The step's report: trace records and the timeline in microseconds since the job started.
fn report<I>(
    state: &PipelineStageState<I>,
    step: u64,
    micro_batches: Vec<Vec<usize>>,
    record: StageStepRecord,
) -> StepReport {
    let epoch = state.spec.epoch;
    let us = |t: Instant| t.saturating_duration_since(epoch).as_micros() as u64;
    let samples = micro_batches.first().map_or(0, Vec::len) as u32;
    let mut trace: Vec<TraceRecord> = record
        .executed
        .iter()
        .map(|(instr, s, e)| TraceRecord {
            rank: state.rank,
            step,
            kind: match *instr {
                Instr::Forward { mb, .. } => TraceKind::Forward {
                    micro_batch: mb.0,
                    samples,
                },
                Instr::Backward { mb, .. } => TraceKind::Backward { micro_batch: mb.0 },
                Instr::SendActivation { mb, to, .. } | Instr::SendGradient { mb, to, .. } => {
                    TraceKind::Send {
                        micro_batch: mb.0,
                        to: to.0,
                    }
                }
                Instr::RecvActivation { mb, from, .. } | Instr::RecvGradient { mb, from, .. } => {
                    TraceKind::Recv {
                        micro_batch: mb.0,
                        from: from.0,
                    }
                }
            },
            start_us: us(*s),
            duration_us: e.saturating_duration_since(*s).as_micros() as u64,
        })
        .collect();
    // The blocks' gathers and reductions, as the communication thread ran them beside the
    // instructions: the time breakdown shows how much of them the compute hid.
    trace.extend(
        record
            .collectives
            .iter()
            .map(|(kind, start, took)| TraceRecord {
                rank: state.rank,
                step,
                kind: kind.clone(),
                start_us: us(*start),
                duration_us: took.as_micros() as u64,
            }),
    );
    if let Some((s, e)) = record.update {
        trace.push(TraceRecord {
            rank: state.rank,
            step,
            kind: TraceKind::OptimizerStep,
            start_us: us(s),
            duration_us: e.saturating_duration_since(s).as_micros() as u64,
        });
    }
    let local_loss = (!record.losses.is_empty())
        .then(|| record.losses.iter().sum::<f32>() / record.losses.len() as f32);
    StepReport {
        rank: state.rank,
        sample_ids: micro_batches.concat(),
        local_loss,
        learning_rate: record.learning_rate,
        trace,
        pipeline: Some(PipelineStageStep {
            executed: record
                .executed
                .iter()
                .map(|(instr, s, e)| TimedInstr {
                    instr: *instr,
                    start: us(*s),
                    end: us(*e),
                })
                .collect(),
            peak_stash: record.peak_stash,
            peak_activation_bytes: record.peak_stash_bytes,
            memory: record.memory,
            tensor_parallel: None,
        }),
        held: None,
        loss_scale: None,
        bytes_sent: 0,
        parameter_server: None,
    }
}

/// How a checkpoint holds one block for a stage of a tensor-parallel group of `degree`.
enum Slices<'a> {
    /// One slice per rank of the same degree: the rank takes its own.
    Own,
    /// None at all.
    None,
    /// The slices of another degree, in rank order: re-sliced (TP-7).
    Other(Vec<&'a ShardSnapshot>),
}

/// How `shards` hold block `pp` for a group of `degree` ranks: slices `0..T` of the block,
/// `T` being the degree that wrote them.
fn slices_of(shards: &[ShardSnapshot], pp: u32, degree: usize) -> Slices<'_> {
    let mut parts: Vec<&ShardSnapshot> = shards.iter().filter(|s| s.shard.pp == pp).collect();
    parts.sort_by_key(|s| s.shard.tp);
    let complete = parts
        .iter()
        .enumerate()
        .all(|(t, s)| s.shard.tp as usize == t);
    match parts.len() {
        0 => Slices::None,
        n if n == degree || !complete => Slices::Own,
        _ => Slices::Other(parts),
    }
}
