//! Views of a model's parameters and gradients as `f32` buffers a collective can move.
//!
//! Collectives move contiguous buffers, Burn keeps one tensor per parameter. A [`ParamLayout`]
//! records, in `Module::visit` order (stable for a given model type), each float parameter's
//! id, shape and range in the flat buffer (FLAT-1: ranges are consecutive and cover the
//! buffer). Replicas of the same model type share the same layout, so the same range means the
//! same parameter on every rank.
//!
//! - **FLAT-2** only parameters that require a gradient take part in the gradient all-reduce, each
//!   id once (tied weights): frozen weights and buffers are never stepped by the optimizer.
//! - **FLAT-3** a flat buffer meets a module by visit order, never by parameter id: reading
//!   (`trainable_range`, `GradientBuffers::take`), writing (`set_trainable`) and releasing
//!   (`release_trainable`) walk the trainable parameters in order, so a module restored from a
//!   checkpoint (which takes the saved ids, for Burn's optimizer state) is still written by a
//!   layout read before the restore (`compression_under_zero_1_and_2` in
//!   `tests/suite/compression.rs` resumes ZeRO-1 and checks the run bitwise against an
//!   uninterrupted one).

use std::collections::HashSet;
use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};

use super::buckets::Bucket;

/// One float parameter's place in the flat buffer.
#[derive(Debug, Clone)]
pub(crate) struct ParamSlot {
    /// The parameter's id (what optimizers key their state by).
    pub id: ParamId,
    /// The parameter's shape.
    pub shape: Shape,
    /// Where its elements sit in the flat buffer.
    pub range: Range<usize>,
}

/// Where every float parameter of a model sits in a flat buffer (FLAT-1).
#[derive(Debug, Clone, Default)]
pub(crate) struct ParamLayout {
    slots: Vec<ParamSlot>,
    len: usize,
}

/// Whether a parameter takes part in the gradient all-reduce: it requires a gradient and its
/// id was not seen before (a tied weight is reduced once). Frozen weights and buffers such as
/// batch-norm running statistics do not (FLAT-2).
fn is_trainable<const D: usize>(param: &Param<Tensor<D>>, seen: &mut HashSet<ParamId>) -> bool {
    param.val().is_require_grad() && seen.insert(param.id)
}

impl ParamLayout {
    /// The layout of all of `module`'s float parameters, in visit order.
    pub(crate) fn of<M: Module>(module: &M) -> Self {
        Self::collect(module, false)
    }

    /// The layout of the parameters that receive gradients (FLAT-2), in visit order.
    pub(crate) fn trainable<M: Module>(module: &M) -> Self {
        Self::collect(module, true)
    }

    fn collect<M: Module>(module: &M, trainable_only: bool) -> Self {
        struct Collect(ParamLayout, bool, HashSet<ParamId>);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.1 && !is_trainable(param, &mut self.2) {
                    return;
                }
                let shape = param.val().shape();
                let n = shape.num_elements();
                let start = self.0.len;
                self.0.slots.push(ParamSlot {
                    id: param.id,
                    shape,
                    range: start..start + n,
                });
                self.0.len += n;
            }
        }
        let mut c = Collect(ParamLayout::default(), trainable_only, HashSet::new());
        module.visit(&mut c);
        c.0
    }

    /// Total number of float elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The slots, in visit order.
    pub(crate) fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The same layout with each slot's id replaced as `map` says (a restored module's
    /// parameters take their saved ids: CKPT-5); an id not in `map` stays.
    pub(crate) fn rekeyed(&self, map: &std::collections::HashMap<ParamId, ParamId>) -> Self {
        let mut out = self.clone();
        for s in &mut out.slots {
            if let Some(&id) = map.get(&s.id) {
                s.id = id;
            }
        }
        out
    }
}

/// Each float parameter's id in `module`'s visit order.
pub(crate) fn ids_in_order<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
}

/// Copy a tensor's values into `out`.
fn copy_tensor_into<const D: usize>(t: Tensor<D>, out: &mut [f32]) {
    let data = t.into_data();
    let owned;
    let values: &[f32] = match data.as_slice::<f32>() {
        Ok(s) => s,
        Err(_) => {
            owned = data
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap_or_default();
            &owned
        }
    };
    if values.len() != out.len() {
        // A gradient of the wrong size is an internal invariant violation (FLAT-1).
        panic!(
            "gradient has {} elements, its parameter {}",
            values.len(),
            out.len()
        );
    }
    out.copy_from_slice(values);
}

/// A model's gradients taken out of Burn: one mutable `f32` buffer per float parameter, in
/// layout order (a parameter without a gradient gets zeros). Large buffers are reduced in place,
/// so the gradients are never copied into one flat buffer.
#[derive(Debug)]
pub(crate) struct GradientBuffers {
    datas: Vec<TensorData>,
}

fn into_f32(data: TensorData) -> TensorData {
    if data.dtype() == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    }
}

impl GradientBuffers {
    /// Take `grads` out of Burn following `module`'s trainable layout
    /// ([`ParamLayout::trainable`]).
    pub(crate) fn take<M: Module>(
        module: &M,
        layout: &ParamLayout,
        grads: GradientsParams,
    ) -> Self {
        struct Take<'a> {
            grads: GradientsParams,
            slots: std::slice::Iter<'a, ParamSlot>,
            datas: Vec<TensorData>,
            seen: HashSet<ParamId>,
        }
        impl ModuleVisitor for Take<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if !is_trainable(param, &mut self.seen) {
                    return;
                }
                let slot = self
                    .slots
                    .next()
                    .expect("layout built from this module type");
                let data = match self.grads.remove::<D>(param.id) {
                    Some(g) => into_f32(g.into_data()),
                    None => TensorData::zeros::<f32, _>(slot.shape.clone()),
                };
                self.datas.push(data);
            }
        }
        let mut t = Take {
            grads,
            slots: layout.slots.iter(),
            datas: Vec::with_capacity(layout.slots.len()),
            seen: HashSet::new(),
        };
        module.visit(&mut t);
        Self { datas: t.datas }
    }

    /// Views of every buffer, in layout order.
    pub(crate) fn slices(&self) -> Vec<&[f32]> {
        self.datas
            .iter()
            .map(|d| {
                d.as_slice::<f32>()
                    .expect("gradient buffers are converted to f32 when taken")
            })
            .collect()
    }

    /// Mutable views of every buffer, in layout order.
    pub(crate) fn slices_mut(&mut self) -> Vec<&mut [f32]> {
        self.datas
            .iter_mut()
            .map(|d| {
                d.as_mut_slice::<f32>()
                    .expect("gradient buffers are converted to f32 when taken")
            })
            .collect()
    }

    /// The elements `range` of the buffers laid end to end (the flat order), copied out.
    pub(crate) fn copy_range(&self, range: Range<usize>) -> Vec<f32> {
        let mut out = Vec::with_capacity(range.len());
        let mut at = 0;
        for d in &self.datas {
            let values = d
                .as_slice::<f32>()
                .expect("gradient buffers are converted to f32 when taken");
            let (lo, hi) = (at, at + values.len());
            at = hi;
            let (s, e) = (range.start.max(lo), range.end.min(hi));
            if s < e {
                out.extend_from_slice(&values[s - lo..e - lo]);
            }
        }
        out
    }

    /// The buffers laid end to end in one flat buffer; each is dropped once copied, so at
    /// most one tensor is held twice.
    pub(crate) fn into_flat(self) -> Vec<f32> {
        self.into_flat_in(Vec::new())
    }

    /// [`into_flat`](Self::into_flat) into `out`'s allocation (its contents replaced): a
    /// buffer kept from the last step is written again rather than allocated fresh.
    pub(crate) fn into_flat_in(self, mut out: Vec<f32>) -> Vec<f32> {
        let len = self.datas.iter().map(TensorData::num_elements).sum();
        out.clear();
        out.reserve(len);
        for d in self.datas {
            out.extend_from_slice(
                d.as_slice::<f32>()
                    .expect("gradient buffers are converted to f32 when taken"),
            );
        }
        out
    }

    /// `flat` cut back into one buffer per parameter of `layout` (the inverse of
    /// [`into_flat`](Self::into_flat)).
    pub(crate) fn from_flat(layout: &ParamLayout, flat: Vec<f32>) -> Self {
        let datas = layout
            .slots
            .iter()
            .map(|s| TensorData::new(flat[s.range.clone()].to_vec(), s.shape.clone()))
            .collect();
        Self { datas }
    }

    /// Give the buffers back to Burn as gradients of `module`'s parameters on `device`.
    pub(crate) fn into_gradients<M: Module>(self, module: &M, device: &Device) -> GradientsParams {
        struct Give<'a> {
            datas: std::vec::IntoIter<TensorData>,
            device: &'a Device,
            grads: GradientsParams,
            seen: HashSet<ParamId>,
        }
        impl ModuleVisitor for Give<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if !is_trainable(param, &mut self.seen) {
                    return;
                }
                let data = self.datas.next().expect("one buffer per parameter");
                self.grads
                    .register::<D>(param.id, Tensor::from_data(data, self.device));
            }
        }
        let mut g = Give {
            datas: self.datas.into_iter(),
            device,
            grads: GradientsParams::new(),
            seen: HashSet::new(),
        };
        module.visit(&mut g);
        g.grads
    }
}

/// Where each of `buckets` (planned over `layout`'s slots) sits in the flat buffer: a fused
/// bucket's tensors and an in-place chunk are each one range (BUCKET-2), so reducing these
/// ranges of the flat buffer makes the same calls as [`reduce_buckets`] on the same values.
pub(crate) fn bucket_ranges(buckets: &[Bucket], layout: &ParamLayout) -> Vec<Range<usize>> {
    buckets
        .iter()
        .map(|b| match b {
            Bucket::Fused { tensors, len } => {
                let start = layout.slots[tensors.start].range.start;
                start..start + len
            }
            Bucket::InPlace { tensor, range } => {
                let start = layout.slots[*tensor].range.start;
                start + range.start..start + range.end
            }
        })
        .collect()
}

/// Reduce `buffers` bucket by bucket with `reduce` (a collective): a fused bucket is copied
/// into `fusion`, reduced, and copied back; an in-place bucket is reduced where it lies.
/// Returns the elements reduced per bucket, for the trace.
pub(crate) fn reduce_buckets<E>(
    buffers: &mut [&mut [f32]],
    buckets: &[Bucket],
    fusion: &mut Vec<f32>,
    mut reduce: impl FnMut(&mut [f32]) -> Result<(), E>,
) -> Result<(), E> {
    for bucket in buckets {
        match bucket {
            Bucket::InPlace { tensor, range } => reduce(&mut buffers[*tensor][range.clone()])?,
            Bucket::Fused { tensors, len } => {
                fusion.clear();
                fusion.reserve(*len);
                for t in tensors.clone() {
                    fusion.extend_from_slice(buffers[t]);
                }
                reduce(fusion)?;
                let mut at = 0;
                for t in tensors.clone() {
                    let n = buffers[t].len();
                    buffers[t].copy_from_slice(&fusion[at..at + n]);
                    at += n;
                }
            }
        }
    }
    Ok(())
}

/// Which float parameters [`map_parameters`] rewrites.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParamFilter {
    /// Every float parameter.
    All,
    /// Only those that take no gradient: buffers (batch-norm statistics) and frozen weights.
    Buffers,
}

/// Rewrite the float parameters of `module` selected by `filter` in place: `f(index, values)`
/// may change the values (ids, devices and training state are kept; `index` counts the
/// selected parameters). The first error stops the rewriting and is returned beside the
/// module, so the caller keeps the module either way.
pub(crate) fn map_parameters<M: Module, E>(
    module: M,
    filter: ParamFilter,
    mut f: impl FnMut(usize, &mut [f32]) -> Result<(), E>,
) -> (M, Result<(), E>) {
    type Rewriter<'a, E> = &'a mut dyn FnMut(usize, &mut [f32]) -> Result<(), E>;
    struct Rewrite<'a, E> {
        f: Rewriter<'a, E>,
        filter: ParamFilter,
        index: usize,
        error: Option<E>,
    }
    impl<E> ModuleMapper for Rewrite<'_, E> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if self.filter == ParamFilter::Buffers && param.val().is_require_grad() {
                return param;
            }
            let index = self.index;
            self.index += 1;
            if self.error.is_some() {
                return param;
            }
            let f = &mut self.f;
            let error = &mut self.error;
            param.map(|old| {
                let device = old.device();
                let grad = old.is_require_grad();
                let mut data = into_f32(old.inner().into_data());
                let values = data
                    .as_mut_slice::<f32>()
                    .expect("parameter data converted to f32");
                if let Err(e) = f(index, values) {
                    *error = Some(e);
                }
                let t = Tensor::<D>::from_data(data, &device);
                if grad { t.require_grad() } else { t }
            })
        }
    }
    let mut r = Rewrite {
        f: &mut f,
        filter,
        index: 0,
        error: None,
    };
    let module = module.map(&mut r);
    (module, r.error.map_or(Ok(()), Err))
}

/// The elements `range` of the module's trainable parameters in the flat order of `layout`
/// ([`ParamLayout::trainable`]), copied out; parameters outside the range are not read.
pub(crate) fn trainable_range<M: Module>(
    module: &M,
    layout: &ParamLayout,
    range: Range<usize>,
) -> Vec<f32> {
    struct Read<'a> {
        slots: std::slice::Iter<'a, ParamSlot>,
        range: Range<usize>,
        out: Vec<f32>,
        seen: HashSet<ParamId>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !is_trainable(param, &mut self.seen) {
                return;
            }
            let slot = self
                .slots
                .next()
                .expect("layout built from this module type");
            let (s, e) = (
                self.range.start.max(slot.range.start),
                self.range.end.min(slot.range.end),
            );
            if s >= e {
                return;
            }
            // Only the range is read: a view of it is made contiguous (a copy of the range
            // alone), not the whole parameter.
            let whole = param.val().inner().reshape([slot.range.len()]);
            let part = if s == slot.range.start && e == slot.range.end {
                whole
            } else {
                whole.slice(s - slot.range.start..e - slot.range.start)
            };
            let data = into_f32(part.into_data());
            self.out.extend_from_slice(
                data.as_slice::<f32>()
                    .expect("parameter data converted to f32"),
            );
        }
    }
    let mut r = Read {
        slots: layout.slots.iter(),
        out: Vec::with_capacity(range.len()),
        range,
        seen: HashSet::new(),
    };
    module.visit(&mut r);
    r.out
}

/// The layout's slots met in `module`'s visit order, as [`ParamLayout::trainable`] met
/// them (FLAT-2): the next trainable parameter takes the next slot, a tied parameter met
/// again its first slot. By order, not by id: a module restored from a checkpoint carries
/// the ids it was saved with (`checkpoint::restore_module`, so Burn's optimizer state
/// applies), not those of the module the layout was read from (FLAT-3).
struct SlotsInOrder<'a> {
    slots: std::iter::Enumerate<std::slice::Iter<'a, ParamSlot>>,
    met: std::collections::HashMap<ParamId, (usize, &'a ParamSlot)>,
}

impl<'a> SlotsInOrder<'a> {
    fn new(layout: &'a ParamLayout) -> Self {
        Self {
            slots: layout.slots.iter().enumerate(),
            met: std::collections::HashMap::new(),
        }
    }

    /// The slot and its index in the layout.
    fn indexed<const D: usize>(
        &mut self,
        param: &Param<Tensor<D>>,
    ) -> Option<(usize, &'a ParamSlot)> {
        if let Some(s) = self.met.get(&param.id) {
            return Some(*s);
        }
        if !param.val().is_require_grad() {
            return None;
        }
        let s = self.slots.next()?;
        self.met.insert(param.id, s);
        Some(s)
    }
}

/// Where [`update_trainable`] is in the module: the parameter's current id and its path
/// (`"layers.0.weight"`), as Burn's optimizer names a parameter to a learning-rate group.
pub(crate) struct ParamPlace<'a> {
    /// The parameter's id in the module being updated.
    pub(crate) id: ParamId,
    /// The names of the fields and indices leading to it, joined by `.`.
    pub(crate) path: &'a str,
}

/// `module` with each trainable parameter of `layout` updated in place: `update(index, slot,
/// place, values)` changes a copy of the slot's `f32` values, which becomes the parameter (ids,
/// devices and training state kept). One read and one write of each parameter, where
/// [`trainable_range`] then [`set_trainable`] copy each twice. A tied parameter is updated at
/// its first use and takes the same tensor at every other.
pub(crate) fn update_trainable<M: Module>(
    module: M,
    layout: &ParamLayout,
    update: impl FnMut(usize, &ParamSlot, ParamPlace<'_>, &mut [f32]),
) -> M {
    struct Update<'a, F> {
        slots: SlotsInOrder<'a>,
        update: F,
        done: std::collections::HashMap<ParamId, Box<dyn std::any::Any>>,
        path: Vec<String>,
    }
    impl<F: FnMut(usize, &ParamSlot, ParamPlace<'_>, &mut [f32])> ModuleMapper for Update<'_, F> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((index, slot)) = self.slots.indexed(&param) else {
                return param;
            };
            let id = param.id;
            if let Some(t) = self
                .done
                .get(&id)
                .and_then(|t| t.downcast_ref::<Tensor<D>>())
            {
                let t = t.clone();
                return param.map(|_| t);
            }
            let update = &mut self.update;
            let path = self.path.join(".");
            let mut updated = None;
            let param = param.map(|old| {
                let device = old.device();
                let grad = old.is_require_grad();
                let mut data = into_f32(old.inner().into_data());
                update(
                    index,
                    slot,
                    ParamPlace { id, path: &path },
                    data.as_mut_slice::<f32>()
                        .expect("parameter data converted to f32"),
                );
                let t = Tensor::<D>::from_data(data, &device);
                let t = if grad { t.require_grad() } else { t };
                updated = Some(t.clone());
                t
            });
            if let Some(t) = updated {
                self.done.insert(id, Box::new(t));
            }
            param
        }
    }
    module.map(&mut Update {
        slots: SlotsInOrder::new(layout),
        update,
        done: std::collections::HashMap::new(),
        path: Vec::new(),
    })
}

/// `module` with its trainable parameters set from `flat`, laid out as `layout`
/// ([`ParamLayout::trainable`]); ids, devices and training state are kept, a tied weight
/// gets its one range at every use.
pub(crate) fn set_trainable<M: Module>(module: M, layout: &ParamLayout, flat: &[f32]) -> M {
    assert_eq!(
        flat.len(),
        layout.len(),
        "a flat buffer of the layout's length"
    );
    write_slots(module, layout, |_, slot| flat[slot.range.clone()].to_vec())
}

/// [`set_trainable`] taking the flat buffer: each slot's elements become its parameter's
/// data without a copy where they can (the first slot's, the buffer itself; the others are
/// split off it, one copy each).
pub(crate) fn set_trainable_owned<M: Module>(module: M, layout: &ParamLayout, flat: Vec<f32>) -> M {
    assert_eq!(
        flat.len(),
        layout.len(),
        "a flat buffer of the layout's length"
    );
    // FLAT-1: the slots' ranges are consecutive, so the last slot is the buffer's tail.
    let mut rest = flat;
    let mut parts: Vec<Vec<f32>> = vec![Vec::new(); layout.slots.len()];
    for (part, slot) in parts.iter_mut().zip(&layout.slots).rev() {
        debug_assert_eq!(slot.range.end, rest.len(), "FLAT-1");
        *part = rest.split_off(slot.range.start);
    }
    write_slots(module, layout, |index, _| std::mem::take(&mut parts[index]))
}

/// `module` with each trainable parameter of `layout` made from `values(index, slot)`, in the
/// layout's shape (a released parameter, see [`release_trainable`], is empty), its id, device
/// and training state kept. A tied weight takes the tensor made at its first use.
fn write_slots<M: Module>(
    module: M,
    layout: &ParamLayout,
    values: impl FnMut(usize, &ParamSlot) -> Vec<f32>,
) -> M {
    struct Write<'a, F> {
        slots: SlotsInOrder<'a>,
        values: F,
        made: std::collections::HashMap<usize, Box<dyn std::any::Any>>,
    }
    impl<F: FnMut(usize, &ParamSlot) -> Vec<f32>> ModuleMapper for Write<'_, F> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((index, slot)) = self.slots.indexed(&param) else {
                return param;
            };
            if let Some(t) = self
                .made
                .get(&index)
                .and_then(|t| t.downcast_ref::<Tensor<D>>())
            {
                let t = t.clone();
                return param.map(|_| t);
            }
            let data = TensorData::new((self.values)(index, slot), slot.shape.clone());
            let mut made = None;
            let param = param.map(|old| {
                let device = old.device();
                let grad = old.is_require_grad();
                let t = Tensor::<D>::from_data(data, &device);
                let t = if grad { t.require_grad() } else { t };
                made = Some(t.clone());
                t
            });
            if let Some(t) = made {
                self.made.insert(index, Box::new(t));
            }
            param
        }
    }
    module.map(&mut Write {
        slots: SlotsInOrder::new(layout),
        values,
        made: std::collections::HashMap::new(),
    })
}

/// `module` with its trainable parameters (those that require a gradient) replaced by empty
/// tensors (every dimension 0; ids, devices and training state kept): what a ZeRO-3 rank
/// keeps of a block between uses, and what a stage holds while its update owns the
/// parameters. [`set_trainable`] gives them their values and shapes back.
pub(crate) fn release_trainable<M: Module>(module: M) -> M {
    struct Empty;
    impl ModuleMapper for Empty {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !param.val().is_require_grad() {
                return param;
            }
            param.map(|old| {
                let device = old.device();
                let data = TensorData::new(Vec::<f32>::new(), [0usize; D]);
                Tensor::<D>::from_data(data, &device).require_grad()
            })
        }
    }
    module.map(&mut Empty)
}

/// Fingerprint of a module's float parameters (the exact bits, in layout order), computed
/// without copying them into one buffer.
pub(crate) fn parameter_fingerprint<M: Module>(module: &M) -> u64 {
    struct Hash(Fingerprint);
    impl ModuleVisitor for Hash {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = into_f32(param.val().inner().into_data());
            if let Ok(values) = data.as_slice::<f32>() {
                self.0.update(values);
            }
        }
    }
    let mut h = Hash(Fingerprint::new());
    module.visit(&mut h);
    h.0.finish()
}

/// The module's float parameters as one buffer, in layout order.
pub(crate) fn parameters_to_flat<M: Module>(module: &M, layout: &ParamLayout) -> Vec<f32> {
    struct Read<'a> {
        slots: std::slice::Iter<'a, ParamSlot>,
        out: Vec<f32>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let slot = self
                .slots
                .next()
                .expect("layout built from this module type");
            copy_tensor_into(param.val().inner(), &mut self.out[slot.range.clone()]);
        }
    }
    let mut r = Read {
        slots: layout.slots.iter(),
        out: vec![0.0; layout.len],
    };
    module.visit(&mut r);
    r.out
}

/// A 64-bit fingerprint of `f32` values' exact bits (FNV-1a), fed in pieces: equal
/// parameters give equal fingerprints on every rank.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fingerprint(u64);

impl Fingerprint {
    /// The fingerprint of nothing.
    pub(crate) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    /// Feed more values.
    pub(crate) fn update(&mut self, values: &[f32]) {
        for v in values {
            for b in v.to_bits().to_le_bytes() {
                self.0 ^= u64::from(b);
                self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }

    /// The fingerprint so far.
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests;
