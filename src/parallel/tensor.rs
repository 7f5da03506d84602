//! Tensor parallelism (Megatron-LM): each layer's matrices split over a tensor-parallel
//! group, joined by all-reduces where Burn's autodiff cannot see them.
//!
//! A **tensor-parallel block** is a block of a [`PipelineStages`](super::stages::PipelineStages)
//! list added with `tp_block`/`tp_last`: a Burn module implementing [`TensorParallelModule`]
//! (which of its parameters are split, and along which axis) whose forward gets the rank's
//! [`TensorParallel`] handle. The layers in [`layers`] are the building blocks:
//! [`ColumnParallelLinear`](layers::ColumnParallelLinear) (output features split),
//! [`RowParallelLinear`](layers::RowParallelLinear) (input features split, partial outputs
//! summed), self-attention split by heads, a feed-forward block, a vocabulary-parallel
//! embedding and cross-entropy.
//!
//! **Where the collectives are, and how the backward finds them.** Megatron's two conjugate
//! operators are `f` (forward: identity; backward: all-reduce) before a column-parallel
//! layer and `g` (forward: all-reduce; backward: identity) after a row-parallel one. Burn 0.22
//! has no public way to register a custom backward on the dispatching `Tensor`, so:
//!
//! - `g` is [`TensorParallel::reduce`]: the all-reduced value enters the graph as a constant
//!   plus `y·T − (y·T).detach()`, which is zero in the forward and passes the gradient,
//!   multiplied by `T`, to the rank's partial `y`.
//! - `f` sits at the **block's input**: the executor all-reduces (sums) the gradient of a
//!   tensor-parallel block's inputs over the group after the block's backward, and seeds the
//!   block's backward with the output gradient divided by `T` (TP-1).
//!
//! With one `f` region per block (a transformer's attention and its feed-forward are two
//! blocks), this is exact: a path through a split layer carries `T·(G/T) = G` to the rank's
//! slice (whose gradient is complete on that rank), every replicated path carries `G/T`, and
//! summing over the group gives each replicated parameter and the block's input their whole
//! gradient — the replicated parameters' sum is taken once per step, before the data-parallel
//! reduction (TP-2). The forward costs one all-reduce of the block's output per `g`, the
//! backward one of its input: Megatron's two per layer each way.
//!
//! Invariants:
//! - TP-1: a tensor-parallel block's backward is seeded with `G/T` and its inputs' gradients
//!   are summed over the group; `reduce`'s backward multiplies by `T`. At `T = 1` every
//!   operation here is the identity: the one-device model is the same code.
//! - TP-2: a split parameter's gradient is complete on its rank; a replicated parameter's
//!   gradient is summed over the group once per step.
//! - TP-3: every rank of a group starts from the same full record and keeps its
//!   [`chunk_range`] along the split axis ([`shard`]); [`unshard`] concatenates the slices
//!   back, so `shard` then `unshard` gives the record back bitwise.
//! - TP-4: a collective that fails inside a forward does not panic and does not wait again:
//!   the failure is kept, later collectives of the block return at once, and the executor
//!   turns it into an error naming the block.
//! - TP-6: a block holds one split region: at `T > 1` a split layer that runs after a
//!   `reduce` of the same block's forward ([`TensorParallel::enter_split`]) fails the step
//!   with an error naming the block, instead of training with wrong gradients.
//! - TP-7: a checkpoint written at another degree is re-sliced when it is restored
//!   (`reslice`): a block's old slices joined, the new rank's cut, for parameters and
//!   optimizer state.
//!
//! - **TP-5** a checkpoint holds every tp rank's slices.

pub mod layers;
pub(crate) mod reslice;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

use crate::comm::{CommError, Communicator, ReduceOp};
use crate::config::InvalidConfig;
use crate::mesh::chunk_range;

/// A rank's place in its tensor-parallel group, and the group's collectives, as a block's
/// forward sees them.
///
/// [`TensorParallel::single`] is the group of one: every collective is the identity, so a
/// model written with the tensor-parallel layers runs unchanged on one device.
#[derive(Debug)]
pub struct TensorParallel {
    rank: usize,
    degree: usize,
    comm: Option<Mutex<Communicator>>,
    failure: Mutex<Option<TpFailure>>,
    /// A `reduce` (Megatron's `g`) ran since the block's forward began: a split layer may
    /// not follow it in the same block (TP-6).
    closed: std::sync::atomic::AtomicBool,
    stats: TpCounters,
}

/// Why a tensor-parallel block's forward could not be computed right (TP-4, TP-6).
#[derive(Debug, Clone)]
pub(crate) enum TpFailure {
    /// A collective of the group failed.
    Comm(CommError),
    /// A split layer ran after a `reduce` in the same block: a second split region, whose
    /// gradients the executor's rules would get wrong.
    SecondRegion,
}

#[derive(Debug, Default)]
struct TpCounters {
    activation_bytes: AtomicU64,
    activation_reduces: AtomicU64,
    parameter_bytes: AtomicU64,
    nanos: AtomicU64,
}

/// What a rank's tensor-parallel collectives moved since the counters were last taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TpTraffic {
    /// Bytes of activations and activation gradients all-reduced (the forward's `g` and the
    /// backward's `f`), counted as the buffer's length in bytes once per all-reduce.
    pub activation_bytes: u64,
    /// How many such all-reduces.
    pub activation_reduces: u64,
    /// Bytes of replicated parameters' gradients summed over the group (TP-2).
    pub parameter_bytes: u64,
    /// Seconds spent in the group's collectives (waiting for the peers included).
    #[serde(default)]
    pub seconds: f64,
}

impl TensorParallel {
    /// The group of one rank: every collective is the identity.
    pub fn single() -> Self {
        Self {
            rank: 0,
            degree: 1,
            comm: None,
            failure: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            stats: TpCounters::default(),
        }
    }

    /// Rank `rank` of a group of `degree` with no communicator: what builds (or restores) a
    /// rank's slices outside a job, as the head rebuilding a trained model does. Its
    /// collectives must not run (they would be the identity, not the group's).
    #[cfg_attr(
        not(feature = "cluster"),
        expect(
            dead_code,
            reason = "only the head of a job across processes rebuilds slices"
        )
    )]
    pub(crate) fn detached(rank: usize, degree: usize) -> Self {
        Self {
            rank,
            degree,
            ..Self::single()
        }
    }

    /// The rank of `comm` in a group of `comm.world()`.
    pub fn new(comm: Communicator) -> Self {
        let (rank, degree) = (comm.rank().index(), comm.world());
        Self {
            rank,
            degree,
            comm: (degree > 1).then(|| Mutex::new(comm)),
            failure: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
            stats: TpCounters::default(),
        }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The group's size `T`.
    pub fn degree(&self) -> usize {
        self.degree
    }

    /// The part of `len` elements this rank holds along a split axis.
    pub fn range(&self, len: usize) -> std::ops::Range<usize> {
        chunk_range(len, self.degree, self.rank)
    }

    /// A split layer is about to compute: at `T > 1`, one after a `reduce` of the same
    /// block is a second split region, refused (the block's forward then fails, TP-6).
    pub fn enter_split(&self) {
        if self.degree > 1 && self.closed.load(Ordering::Relaxed) {
            self.fail(TpFailure::SecondRegion);
        }
    }

    /// A tensor-parallel block's forward begins (the executor calls this).
    pub(crate) fn begin_block(&self) {
        self.closed.store(false, Ordering::Relaxed);
    }

    /// Megatron's `g`: the sum of every rank's `partial` (forward), the gradient passed to
    /// `partial` times `T` (backward; TP-1).
    pub fn reduce<const D: usize>(&self, partial: Tensor<D>) -> Tensor<D> {
        if self.degree == 1 {
            return partial;
        }
        self.closed.store(true, Ordering::Relaxed);
        let mut values = values_of(&partial);
        self.collective(&mut values, ReduceOp::Sum, Traffic::Activation);
        let full = Tensor::<D>::from_data(
            TensorData::new(values, partial.dims().to_vec()),
            &partial.device(),
        )
        .cast(partial.dtype());
        let scaled = partial * self.degree as f32;
        full + (scaled.clone() - scaled.detach())
    }

    /// The element-wise maximum of every rank's `t`, outside the graph (no gradient).
    pub fn max_detached<const D: usize>(&self, t: Tensor<D>) -> Tensor<D> {
        let t = t.detach();
        if self.degree == 1 {
            return t;
        }
        let mut values = values_of(&t);
        self.collective(&mut values, ReduceOp::Max, Traffic::None);
        Tensor::<D>::from_data(TensorData::new(values, t.dims().to_vec()), &t.device())
            .cast(t.dtype())
    }

    /// Every rank's `local` concatenated along the last axis, in rank order (a column-parallel
    /// layer's `gather_output`); the gradient of the rank's own part, times `T`, flows back to
    /// `local` (TP-1). The last axis must have the same length on every rank.
    pub fn gather_last<const D: usize>(&self, local: Tensor<D>) -> Tensor<D> {
        if self.degree == 1 {
            return local;
        }
        let dims = local.dims();
        let part = dims[D - 1];
        let rows: usize = dims[..D - 1].iter().product();
        let mine = values_of(&local);
        let mut all = vec![0.0f32; mine.len() * self.degree];
        if !self.failed() {
            let started = std::time::Instant::now();
            let r = match self.comm.as_ref() {
                Some(c) => c
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .all_gather(&mine, &mut all),
                None => Ok(()),
            };
            self.stats
                .nanos
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Err(e) = r {
                self.fail(TpFailure::Comm(e));
            }
        }
        let device = local.device();
        // [T, rows, part] → [rows, T, part] → [.., T·part]
        let gathered =
            Tensor::<3>::from_data(TensorData::new(all, vec![self.degree, rows, part]), &device)
                .swap_dims(0, 1)
                .reshape([rows, self.degree * part]);
        let mut full_dims = dims;
        full_dims[D - 1] = self.degree * part;
        let full: Tensor<D> = gathered.reshape(full_dims).cast(local.dtype());
        // The rank's own columns carry the gradient back to `local`.
        let scaled = local * self.degree as f32;
        let own = scaled.clone() - scaled.detach();
        let start = self.rank * part;
        let zeros_before = (start > 0).then(|| {
            let mut d = dims;
            d[D - 1] = start;
            Tensor::<D>::zeros(d, &device).cast(own.dtype())
        });
        let after = (self.degree - 1 - self.rank) * part;
        let zeros_after = (after > 0).then(|| {
            let mut d = dims;
            d[D - 1] = after;
            Tensor::<D>::zeros(d, &device).cast(own.dtype())
        });
        let pieces: Vec<Tensor<D>> = zeros_before
            .into_iter()
            .chain(std::iter::once(own))
            .chain(zeros_after)
            .collect();
        full + Tensor::cat(pieces, D - 1)
    }

    /// Sum `values` over the group in place (the executor's `f`: a block input's gradient).
    pub(crate) fn sum_activation(&self, values: &mut [f32]) {
        self.collective(values, ReduceOp::Sum, Traffic::Activation);
    }

    /// Sum a replicated parameter's gradient over the group in place (TP-2).
    pub(crate) fn sum_parameter(&self, values: &mut [f32]) {
        self.collective(values, ReduceOp::Sum, Traffic::Parameter);
    }

    /// The counters since the last call, reset.
    pub fn take_traffic(&self) -> TpTraffic {
        TpTraffic {
            activation_bytes: self.stats.activation_bytes.swap(0, Ordering::Relaxed),
            activation_reduces: self.stats.activation_reduces.swap(0, Ordering::Relaxed),
            parameter_bytes: self.stats.parameter_bytes.swap(0, Ordering::Relaxed),
            seconds: self.stats.nanos.swap(0, Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// The first failure since the last call (TP-4, TP-6).
    pub(crate) fn take_failure(&self) -> Option<TpFailure> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn failed(&self) -> bool {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn fail(&self, e: TpFailure) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(e);
        }
    }

    fn collective(&self, values: &mut [f32], op: ReduceOp, traffic: Traffic) {
        let Some(comm) = self.comm.as_ref() else {
            return;
        };
        if self.failed() {
            return;
        }
        let bytes = 4 * values.len() as u64;
        match traffic {
            Traffic::Activation => {
                self.stats
                    .activation_bytes
                    .fetch_add(bytes, Ordering::Relaxed);
                self.stats
                    .activation_reduces
                    .fetch_add(1, Ordering::Relaxed);
            }
            Traffic::Parameter => {
                self.stats
                    .parameter_bytes
                    .fetch_add(bytes, Ordering::Relaxed);
            }
            Traffic::None => {}
        }
        let started = std::time::Instant::now();
        let r = comm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .all_reduce(values, op);
        self.stats
            .nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if let Err(e) = r {
            self.fail(TpFailure::Comm(e));
        }
    }
}

#[derive(Clone, Copy)]
enum Traffic {
    Activation,
    Parameter,
    None,
}

fn values_of<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone()
        .detach()
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}

/// A Burn module whose parameters may be split over a tensor-parallel group.
///
/// Implement it for a block by listing its split layers' parameters (each layer of
/// [`layers`] implements it); every parameter not listed is replicated.
pub trait TensorParallelModule: Module {
    /// Call `split` with each split parameter and the axis it is split along.
    fn split_params(&self, split: &mut dyn FnMut(ParamId, usize));

    /// Why this module cannot be split over `degree` ranks (e.g. heads not divisible).
    fn check_degree(&self, degree: usize) -> Result<(), InvalidConfig> {
        let _ = degree;
        Ok(())
    }
}

/// Each split parameter of `module` and its axis.
pub fn split_axes<M: TensorParallelModule>(module: &M) -> HashMap<ParamId, usize> {
    let mut axes = HashMap::new();
    module.split_params(&mut |id, axis| {
        axes.insert(id, axis);
    });
    axes
}

/// Why `module` cannot be split over `degree` ranks: its own rule
/// ([`TensorParallelModule::check_degree`]) or a split axis shorter than `degree`.
pub fn check_split<M: TensorParallelModule>(
    module: &M,
    degree: usize,
) -> Result<(), InvalidConfig> {
    if degree <= 1 {
        return Ok(());
    }
    module.check_degree(degree)?;
    struct Lengths<'a> {
        axes: &'a HashMap<ParamId, usize>,
        degree: usize,
        short: Option<String>,
    }
    impl ModuleVisitor for Lengths<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(&axis) = self.axes.get(&param.id) {
                let len = param.dims().get(axis).copied().unwrap_or(0);
                if len < self.degree && self.short.is_none() {
                    self.short = Some(format!(
                        "parameter {} is split along axis {axis} of length {len} over a \
                         tensor-parallel group of {}: a rank would hold nothing; use a degree \
                         of at most {len}",
                        param.id, self.degree
                    ));
                }
            }
        }
    }
    let axes = split_axes(module);
    let mut l = Lengths {
        axes: &axes,
        degree,
        short: None,
    };
    module.visit(&mut l);
    l.short.map_or(Ok(()), |e| Err(InvalidConfig(e)))
}

/// Rank `rank` of `degree`'s part of `module`: every split parameter cut to its
/// [`chunk_range`] along its axis (a copy: the full tensor is not kept), every other parameter
/// as it is; ids are kept (TP-3). Refused when the module cannot be split over `degree`
/// ([`TensorParallelModule::check_degree`]) or a split axis is shorter than `degree` (a rank
/// would hold nothing).
pub fn shard<M: TensorParallelModule>(
    module: M,
    rank: usize,
    degree: usize,
) -> Result<M, InvalidConfig> {
    if degree <= 1 {
        return Ok(module);
    }
    module.check_degree(degree)?;
    struct Slice {
        axes: HashMap<ParamId, usize>,
        rank: usize,
        degree: usize,
        short: Option<(ParamId, usize, usize)>,
    }
    impl ModuleMapper for Slice {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&axis) = self.axes.get(&param.id) else {
                return param;
            };
            let len = param.dims().get(axis).copied().unwrap_or(0);
            if len < self.degree {
                self.short.get_or_insert((param.id, axis, len));
                return param;
            }
            let (rank, degree) = (self.rank, self.degree);
            param.map(|t| {
                let r = chunk_range(len, degree, rank);
                let device = t.device();
                let dtype = t.dtype();
                let part = t.narrow(axis, r.start, r.len()).into_data();
                Tensor::<D>::from_data(part, &device).cast(dtype)
            })
        }
    }
    let axes = split_axes(&module);
    let mut slice = Slice {
        axes,
        rank,
        degree,
        short: None,
    };
    let part = module.map(&mut slice);
    match slice.short {
        Some((id, axis, len)) => Err(InvalidConfig(format!(
            "parameter {id} is split along axis {axis} of length {len} over a tensor-parallel \
             group of {degree}: a rank would hold nothing; use a degree of at most {len}"
        ))),
        None => Ok(part),
    }
}

/// Why [`unshard`] could not rebuild a module.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnshardError {
    /// No parts were given.
    #[error("no tensor-parallel parts to put together")]
    Empty,
    /// A part lacks a split parameter the first part has.
    #[error("tensor-parallel part {part} has no parameter {param}")]
    MissingParam {
        /// The part (its rank in the group).
        part: usize,
        /// The parameter id.
        param: String,
    },
    /// The parts' slices do not agree on the other axes.
    #[error("tensor-parallel parts of {param} do not fit together: {shapes:?}")]
    Shapes {
        /// The parameter id.
        param: String,
        /// Each part's shape.
        shapes: Vec<Vec<usize>>,
    },
}

/// The full module from every rank's part, in rank order: each split parameter's slices
/// concatenated along its axis, the replicated ones taken from the first part (TP-3).
pub fn unshard<M: TensorParallelModule>(parts: Vec<M>) -> Result<M, UnshardError> {
    let mut parts = parts.into_iter();
    let first = parts.next().ok_or(UnshardError::Empty)?;
    let rest: Vec<M> = parts.collect();
    if rest.is_empty() {
        return Ok(first);
    }
    let axes = split_axes(&first);
    // Every other part's split parameters, as data.
    struct Collect<'a> {
        axes: &'a HashMap<ParamId, usize>,
        found: HashMap<ParamId, TensorData>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.axes.contains_key(&param.id) {
                self.found.insert(param.id, param.val().into_data());
            }
        }
    }
    let mut others = Vec::new();
    for part in &rest {
        let mut c = Collect {
            axes: &axes,
            found: HashMap::new(),
        };
        part.visit(&mut c);
        others.push(c.found);
    }
    for (i, found) in others.iter().enumerate() {
        if let Some(id) = axes.keys().find(|id| !found.contains_key(id)) {
            return Err(UnshardError::MissingParam {
                part: i + 1,
                param: id.to_string(),
            });
        }
    }
    struct Join {
        axes: HashMap<ParamId, usize>,
        others: Vec<HashMap<ParamId, TensorData>>,
        error: Option<UnshardError>,
    }
    impl ModuleMapper for Join {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(&axis) = self.axes.get(&param.id) else {
                return param;
            };
            let id = param.id;
            let others = &mut self.others;
            let mut error = None;
            let param = param.map(|t| {
                let device = t.device();
                let dtype = t.dtype();
                let mut shapes = vec![t.dims().to_vec()];
                let mut pieces = vec![t.clone()];
                for found in others.iter_mut() {
                    let Some(data) = found.remove(&id) else {
                        continue;
                    };
                    shapes.push(data.shape().to_vec());
                    pieces.push(Tensor::<D>::from_data(data, &device).cast(dtype));
                }
                let fits = shapes.iter().all(|s| {
                    s.len() == D
                        && s.iter()
                            .zip(&shapes[0])
                            .enumerate()
                            .all(|(a, (x, y))| a == axis || x == y)
                });
                if !fits {
                    error = Some(UnshardError::Shapes {
                        param: id.to_string(),
                        shapes,
                    });
                    return t;
                }
                Tensor::cat(pieces, axis)
            });
            if self.error.is_none() {
                self.error = error;
            }
            param
        }
    }
    let mut join = Join {
        axes,
        others,
        error: None,
    };
    let full = first.map(&mut join);
    match join.error {
        Some(e) => Err(e),
        None => Ok(full),
    }
}

#[cfg(test)]
mod tests;
