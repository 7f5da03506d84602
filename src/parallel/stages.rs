//! How a user hands a model to a pipeline job: an ordered list of stage modules, each with its
//! forward (or, for the last, its loss), and what comes back: the trained modules.
//!
//! ```text
//! let stages = PipelineStages::new(|items: &[Sample], d: &Device| vec![AnyTensor::D2(x(items, d))])
//!     .stage(encoder, |m: &Encoder, x: Boundary| vec![AnyTensor::D2(m.forward(two(&x)))])
//!     .last(head, |m: &Head, x: Boundary, items: &[Sample], d: &Device| mse(m.forward(two(&x)), y(items, d)));
//! Job::builder().pipeline(stages, Schedule::OneFOneB { micro_batches: 8 }).data_parallel(2) …
//! ```
//!
//! The modules are ordinary Burn modules: nothing in them knows about meshwork. With an
//! interleaved schedule of v virtual stages per device, the list holds K·v blocks; block `b`
//! runs on device `b mod K` (Megatron-LM's layout).

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use super::pipeline_exec::{Boundary, InputsFn, StageWork, TypedStage};
use super::tensor::{
    TensorParallel, TensorParallelModule, UnshardError, check_split, shard, split_axes,
};
use crate::config::InvalidConfig;
use crate::optim::{LearningRate, OptimizerConfig};

pub use super::materialize;

/// How one block trains, beyond what it computes ([`PipelineStages::block`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BlockOptions {
    /// Keep only the block's inputs between a micro-batch's forward and its backward and run
    /// the forward again during the backward (activation checkpointing): less memory for
    /// more compute. Default: off.
    pub recompute: bool,
    /// At ZeRO stage 3, release the block's full parameters right after its forward and
    /// all-gather them again for its backward (FSDP's `reshard_after_forward`). Without
    /// `recompute`, Burn's autodiff graph keeps the forward's parameter tensors until the
    /// backward, so they stay counted as held and are not gathered again; with it, the
    /// memory is really freed. Default: on. Has no effect below stage 3.
    pub reshard_after_forward: bool,
}

impl Default for BlockOptions {
    fn default() -> Self {
        Self {
            recompute: false,
            reshard_after_forward: true,
        }
    }
}

impl BlockOptions {
    /// Set [`recompute`](Self::recompute).
    pub fn recompute(mut self, recompute: bool) -> Self {
        self.recompute = recompute;
        self
    }

    /// Set [`reshard_after_forward`](Self::reshard_after_forward).
    pub fn reshard_after_forward(mut self, reshard: bool) -> Self {
        self.reshard_after_forward = reshard;
        self
    }
}

/// Builds one block's stage on a device (called once per rank holding the block), as its
/// rank of its tensor-parallel group; fails when a tensor-parallel block cannot be split over
/// that group.
type BuildFn<I> = Arc<
    dyn Fn(
            &Device,
            &OptimizerConfig,
            LearningRate,
            &Arc<TensorParallel>,
        ) -> Result<Box<dyn StageWork<I>>, InvalidConfig>
        + Send
        + Sync,
>;

/// A trained block's module, type-erased.
pub(crate) type AnyModule = Box<dyn Any + Send>;

/// Puts a tensor-parallel block's parts (in rank order) back into the whole module.
pub(crate) type UnshardFn =
    Arc<dyn Fn(Vec<AnyModule>) -> Result<AnyModule, UnshardError> + Send + Sync>;

/// Why a tensor-parallel block cannot be split over a group of this size.
type CheckFn = Arc<dyn Fn(usize) -> Result<(), InvalidConfig> + Send + Sync>;

/// One block of the model: how to build its stage.
pub(crate) struct Block<I> {
    pub(crate) build: BuildFn<I>,
    pub(crate) is_last: bool,
    /// A tensor-parallel block: how to check a degree and put its parts back together.
    pub(crate) tensor_parallel: Option<(CheckFn, UnshardFn)>,
    /// Its parameter elements, whole (`Module::num_params`).
    pub(crate) params: usize,
}

impl<I> Clone for Block<I> {
    fn clone(&self) -> Self {
        Self {
            build: self.build.clone(),
            is_last: self.is_last,
            tensor_parallel: self.tensor_parallel.clone(),
            params: self.params,
        }
    }
}

/// The model of a pipeline job: its blocks in order, and how the first block's input is built.
pub struct PipelineStages<I> {
    pub(crate) inputs: InputsFn<I>,
    pub(crate) blocks: Vec<Block<I>>,
}

impl<I> Clone for PipelineStages<I> {
    fn clone(&self) -> Self {
        Self {
            inputs: self.inputs.clone(),
            blocks: self.blocks.clone(),
        }
    }
}

impl<I> std::fmt::Debug for PipelineStages<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PipelineStages({} blocks)", self.blocks.len())
    }
}

impl<I: 'static> PipelineStages<I> {
    /// An empty list; `inputs` builds the first block's boundary from a micro-batch's items on
    /// the first stage's device.
    pub fn new(inputs: impl Fn(&[I], &Device) -> Boundary + Send + Sync + 'static) -> Self {
        Self {
            inputs: Arc::new(inputs),
            blocks: Vec::new(),
        }
    }

    /// Add a block computing `forward`: its output crosses to the next block.
    pub fn stage<M: Module + 'static>(
        self,
        module: M,
        forward: impl Fn(&M, Boundary) -> Boundary + Send + Sync + Clone + 'static,
    ) -> Self {
        self.push(module, false, move |m, d, o, lr| {
            let forward = forward.clone();
            TypedStage::new(m, move |m, x, _| forward(m, x), o, lr, d)
        })
    }

    /// Like [`stage`](Self::stage), keeping only the block's inputs between a micro-batch's
    /// forward and its backward and running the forward again during the backward
    /// (activation checkpointing): less memory for more compute.
    pub fn stage_recomputed<M: Module + 'static>(
        self,
        module: M,
        forward: impl Fn(&M, Boundary) -> Boundary + Send + Sync + Clone + 'static,
    ) -> Self {
        self.block(module, BlockOptions::default().recompute(true), forward)
    }

    /// Like [`stage`](Self::stage), with `options` choosing how the block trains:
    /// activation checkpointing, and whether a ZeRO-3 job releases its parameters between
    /// the block's forward and its backward.
    pub fn block<M: Module + 'static>(
        self,
        module: M,
        options: BlockOptions,
        forward: impl Fn(&M, Boundary) -> Boundary + Send + Sync + Clone + 'static,
    ) -> Self {
        self.push(module, false, move |m, d, o, lr| {
            let forward = forward.clone();
            TypedStage::new(m, move |m, x, _| forward(m, x), o, lr, d)
                .with_recompute(options.recompute)
                .with_reshard_after_forward(options.reshard_after_forward)
        })
    }

    /// Add the last block: its forward ends in the mean loss over the micro-batch's items
    /// (targets are read from the items on the last stage).
    pub fn last<M: Module + 'static>(
        self,
        module: M,
        loss: impl Fn(&M, Boundary, &[I], &Device) -> Tensor<1> + Send + Sync + Clone + 'static,
    ) -> Self {
        self.push(module, true, move |m, d, o, lr| {
            let loss = loss.clone();
            TypedStage::last(m, move |m, x, items, d, _| loss(m, x, items, d), o, lr, d)
        })
    }

    /// Add a tensor-parallel block ([`crate::parallel::tensor`]): each rank of the job's
    /// tensor-parallel group keeps its slice of `module`'s split parameters and computes
    /// `forward` with its [`TensorParallel`] handle. The block's inputs' gradients are summed
    /// over the group after its backward (Megatron's `f`, TP-1), its replicated parameters'
    /// gradients once per step (TP-2). Without `JobBuilder::tensor_parallel` (a group of one)
    /// it is an ordinary block.
    pub fn tp_block<M: TensorParallelModule + 'static>(
        self,
        module: M,
        forward: impl Fn(&M, Boundary, &TensorParallel) -> Boundary + Send + Sync + Clone + 'static,
    ) -> Self {
        self.tp_block_with(module, BlockOptions::default(), forward)
    }

    /// Like [`tp_block`](Self::tp_block), with `options` choosing how the block trains
    /// (activation checkpointing; a recomputed forward runs its collectives again).
    pub fn tp_block_with<M: TensorParallelModule + 'static>(
        self,
        module: M,
        options: BlockOptions,
        forward: impl Fn(&M, Boundary, &TensorParallel) -> Boundary + Send + Sync + Clone + 'static,
    ) -> Self {
        self.push_tp(module, false, move |m, d, o, lr| {
            TypedStage::new(m, forward.clone(), o, lr, d)
                .with_recompute(options.recompute)
                .with_reshard_after_forward(options.reshard_after_forward)
        })
    }

    /// Add the last block as a tensor-parallel block: its loss (the mean over the
    /// micro-batch's items, the same on every rank of the group) is computed with the rank's
    /// [`TensorParallel`] handle, e.g. by
    /// [`vocab_parallel_cross_entropy`](crate::parallel::tensor::layers::vocab_parallel_cross_entropy).
    pub fn tp_last<M: TensorParallelModule + 'static>(
        self,
        module: M,
        loss: impl Fn(&M, Boundary, &[I], &Device, &TensorParallel) -> Tensor<1>
        + Send
        + Sync
        + Clone
        + 'static,
    ) -> Self {
        self.push_tp(module, true, move |m, d, o, lr| {
            TypedStage::last(m, loss.clone(), o, lr, d)
        })
    }

    fn push_tp<M: TensorParallelModule + 'static>(
        mut self,
        module: M,
        is_last: bool,
        make: impl Fn(M, &Device, &OptimizerConfig, LearningRate) -> TypedStage<M, I>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        let module = materialize(module);
        let params = module.num_params();
        let check_module = Mutex::new(module.clone());
        let check: CheckFn = Arc::new(move |degree| {
            check_split(
                &*check_module.lock().unwrap_or_else(|e| e.into_inner()),
                degree,
            )
        });
        let unshard: UnshardFn = Arc::new(|parts: Vec<AnyModule>| {
            let parts = parts
                .into_iter()
                .map(|p| p.downcast::<M>().map(|m| *m))
                .collect::<Result<Vec<M>, _>>()
                .map_err(|_| UnshardError::Empty)?;
            super::tensor::unshard(parts).map(|m| Box::new(m) as AnyModule)
        });
        let module = Mutex::new(module);
        let inputs = self.inputs.clone();
        self.blocks.push(Block {
            build: Arc::new(move |device, optimizer, lr, tp| {
                let m = module.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let axes = split_axes(&m);
                let part = shard(m, tp.rank(), tp.degree())?;
                let stage = make(part, device, optimizer, lr)
                    .with_tensor_parallel(tp.clone(), axes)
                    .with_inputs(inputs.clone());
                Ok(Box::new(stage) as Box<dyn StageWork<I>>)
            }),
            is_last,
            tensor_parallel: Some((check, unshard)),
            params,
        });
        self
    }

    fn push<M: Module + 'static>(
        mut self,
        module: M,
        is_last: bool,
        make: impl Fn(M, &Device, &OptimizerConfig, LearningRate) -> TypedStage<M, I>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        // Each replica builds its stage from a copy of the same record, drawn now (REPRO-1).
        let module = materialize(module);
        let params = module.num_params();
        let module = Mutex::new(module);
        let inputs = self.inputs.clone();
        self.blocks.push(Block {
            build: Arc::new(move |device, optimizer, lr, _| {
                let m = module.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let stage = make(m, device, optimizer, lr).with_inputs(inputs.clone());
                Ok(Box::new(stage) as Box<dyn StageWork<I>>)
            }),
            is_last,
            tensor_parallel: None,
            params,
        });
        self
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block was added.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Each block's parameter elements, whole (frozen ones too), in order.
    pub fn parameters(&self) -> Vec<usize> {
        self.blocks.iter().map(|b| b.params).collect()
    }

    /// Why these blocks cannot form a pipeline, if they cannot: at least one block, exactly one
    /// `last` block and it is the final one.
    pub(crate) fn problem(&self) -> Option<String> {
        let lasts = self.blocks.iter().filter(|b| b.is_last).count();
        if self.blocks.is_empty() {
            return Some(
                "the pipeline has no stages: add them with .stage(..) and .last(..)".into(),
            );
        }
        if lasts != 1 || !self.blocks.last().is_some_and(|b| b.is_last) {
            return Some(format!(
                "the pipeline needs exactly one .last(..) block, at the end ({lasts} found)"
            ));
        }
        None
    }

    /// Why these blocks cannot be trained over a tensor-parallel group of `degree`: no block
    /// is tensor-parallel (the group would compute the same thing `degree` times), or a block
    /// cannot be split over it.
    pub(crate) fn tensor_parallel_problem(&self, degree: usize) -> Option<String> {
        if degree <= 1 {
            return None;
        }
        let checks: Vec<_> = self
            .blocks
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.tensor_parallel.as_ref().map(|(check, _)| (i, check)))
            .collect();
        if checks.is_empty() {
            return Some(format!(
                "tensor_parallel({degree}) needs tensor-parallel blocks: add them with \
                 .tp_block(..) / .tp_last(..) (no block here splits its parameters, so every \
                 rank of the group would compute the same thing)"
            ));
        }
        checks
            .into_iter()
            .find_map(|(i, check)| check(degree).err().map(|e| format!("block {i}: {e}")))
    }
}

/// One rank's trained block, before a tensor-parallel block's parts are put together.
pub(crate) struct BlockPart {
    /// The block's index in the model.
    pub(crate) block: u32,
    /// The rank in its tensor-parallel group.
    pub(crate) tp_rank: u32,
    /// The module.
    pub(crate) module: AnyModule,
    /// How to put the parts together (tensor-parallel blocks).
    pub(crate) unshard: Option<UnshardFn>,
}

/// The trained modules of a pipeline job, block by block.
pub struct PipelineModel {
    blocks: Vec<(u32, Box<dyn Any + Send>)>,
    /// Parts not yet put together (a tensor-parallel rank's slices).
    parts: Vec<BlockPart>,
}

impl std::fmt::Debug for PipelineModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PipelineModel({} blocks)", self.blocks.len())
    }
}

impl Clone for PipelineModel {
    /// Only the block indices survive a clone (the modules are type-erased); the runtime never
    /// clones a pipeline model.
    fn clone(&self) -> Self {
        Self {
            blocks: Vec::new(),
            parts: Vec::new(),
        }
    }
}

impl PipelineModel {
    /// One rank's blocks, to be merged with the other ranks' ([`merge`](Self::merge)).
    pub(crate) fn from_parts(parts: Vec<BlockPart>) -> Self {
        Self {
            blocks: Vec::new(),
            parts,
        }
    }

    /// Merge the blocks of several ranks, in block order: a tensor-parallel block's parts
    /// (one per rank of its group) are put back together (TP-3); of a replicated block, the
    /// group's first rank's copy is kept. `None` if a block's parts do not fit together.
    pub(crate) fn merge(models: Vec<PipelineModel>) -> Option<Self> {
        let mut parts: Vec<BlockPart> = Vec::new();
        let mut blocks: Vec<(u32, AnyModule)> = Vec::new();
        for m in models {
            blocks.extend(m.blocks);
            parts.extend(m.parts);
        }
        parts.sort_by_key(|p| (p.block, p.tp_rank));
        let mut parts = parts.into_iter().peekable();
        while let Some(first) = parts.next() {
            let mut same = vec![first];
            while let Some(p) = parts.next_if(|p| p.block == same[0].block) {
                same.push(p);
            }
            let block = same[0].block;
            let unshard = same[0].unshard.clone();
            let module = match unshard {
                Some(unshard) if same.len() > 1 => {
                    unshard(same.into_iter().map(|p| p.module).collect()).ok()?
                }
                _ => same.into_iter().next()?.module,
            };
            blocks.push((block, module));
        }
        blocks.sort_by_key(|(i, _)| *i);
        Some(Self {
            blocks,
            parts: Vec::new(),
        })
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether there is no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Block `index`, if it is an `M`.
    pub fn block<M: 'static>(&self, index: usize) -> Option<&M> {
        self.blocks
            .iter()
            .find(|(i, _)| *i as usize == index)
            .and_then(|(_, b)| b.downcast_ref::<M>())
    }

    /// Take block `index` out, if it is an `M`.
    pub fn take_block<M: 'static>(&mut self, index: usize) -> Option<M> {
        let pos = self
            .blocks
            .iter()
            .position(|(i, b)| *i as usize == index && b.downcast_ref::<M>().is_some())?;
        let (_, b) = self.blocks.remove(pos);
        b.downcast::<M>().ok().map(|b| *b)
    }
}
