//! Flat views of a model: its gradients or parameters as one `f32` buffer, and back.
//!
//! Collectives move contiguous buffers, Burn keeps one tensor per parameter. A [`ParamLayout`]
//! records, in `Module::visit` order (stable for a given model type), each float parameter's
//! id, shape and range in the flat buffer (FLAT-1: ranges are consecutive and cover the
//! buffer). Replicas of the same model type share the same layout, so the same range means the
//! same parameter on every rank.

use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Shape, Tensor, TensorData};

/// One float parameter's place in the flat buffer.
#[derive(Debug, Clone)]
pub struct ParamSlot {
    /// The parameter's id (what optimizers key their state by).
    pub id: ParamId,
    /// The parameter's shape.
    pub shape: Shape,
    /// Where its elements sit in the flat buffer.
    pub range: Range<usize>,
}

/// Where every float parameter of a model sits in a flat buffer (FLAT-1).
#[derive(Debug, Clone, Default)]
pub struct ParamLayout {
    slots: Vec<ParamSlot>,
    len: usize,
}

impl ParamLayout {
    /// The layout of `module`'s float parameters, in visit order.
    pub fn of<M: Module>(module: &M) -> Self {
        struct Collect(ParamLayout);
        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
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
        let mut c = Collect(ParamLayout::default());
        module.visit(&mut c);
        c.0
    }

    /// Total number of float elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the model has no float parameter.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slots, in visit order.
    pub fn slots(&self) -> &[ParamSlot] {
        &self.slots
    }
}

/// Copy a tensor's values into `out` (adding to it when `accumulate`).
fn copy_tensor_into<const D: usize>(t: Tensor<D>, out: &mut [f32], accumulate: bool) {
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
    if accumulate {
        for (o, v) in out.iter_mut().zip(values) {
            *o += v;
        }
    } else {
        out.copy_from_slice(values);
    }
}

/// Write `grads` into `out` following `layout`; a parameter without a gradient contributes
/// zeros. With `accumulate`, adds to what `out` holds (gradient accumulation).
pub fn flatten_gradients<M: Module>(
    module: &M,
    layout: &ParamLayout,
    grads: &GradientsParams,
    out: &mut [f32],
    accumulate: bool,
) {
    struct Flatten<'a> {
        grads: &'a GradientsParams,
        slots: std::slice::Iter<'a, ParamSlot>,
        out: &'a mut [f32],
        accumulate: bool,
    }
    impl ModuleVisitor for Flatten<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let slot = self
                .slots
                .next()
                .expect("layout built from this module type");
            let out = &mut self.out[slot.range.clone()];
            match self.grads.get::<D>(param.id) {
                Some(g) => copy_tensor_into(g, out, self.accumulate),
                None if !self.accumulate => out.fill(0.0),
                None => {}
            }
        }
    }
    module.visit(&mut Flatten {
        grads,
        slots: layout.slots.iter(),
        out,
        accumulate,
    });
}

/// Gradients for `module`'s parameters read from `flat` (the inverse of
/// [`flatten_gradients`]), as tensors on `device` (without autodiff).
pub fn unflatten_gradients<M: Module>(
    module: &M,
    layout: &ParamLayout,
    flat: &[f32],
    device: &Device,
) -> GradientsParams {
    struct Unflatten<'a> {
        slots: std::slice::Iter<'a, ParamSlot>,
        flat: &'a [f32],
        device: &'a Device,
        grads: GradientsParams,
    }
    impl ModuleVisitor for Unflatten<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let slot = self
                .slots
                .next()
                .expect("layout built from this module type");
            let data = TensorData::new(self.flat[slot.range.clone()].to_vec(), slot.shape.clone());
            self.grads
                .register::<D>(param.id, Tensor::from_data(data, self.device));
        }
    }
    let mut u = Unflatten {
        slots: layout.slots.iter(),
        flat,
        device,
        grads: GradientsParams::new(),
    };
    module.visit(&mut u);
    u.grads
}

/// The module's float parameters as one buffer, in layout order.
pub fn parameters_to_flat<M: Module>(module: &M, layout: &ParamLayout) -> Vec<f32> {
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
            copy_tensor_into(
                param.val().inner(),
                &mut self.out[slot.range.clone()],
                false,
            );
        }
    }
    let mut r = Read {
        slots: layout.slots.iter(),
        out: vec![0.0; layout.len],
    };
    module.visit(&mut r);
    r.out
}

/// The module with its float parameters replaced by the values in `flat` (ids, devices and
/// training state kept).
pub fn parameters_from_flat<M: Module>(module: M, layout: &ParamLayout, flat: &[f32]) -> M {
    struct Write<'a> {
        slots: std::slice::Iter<'a, ParamSlot>,
        flat: &'a [f32],
    }
    impl ModuleMapper for Write<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let slot = self
                .slots
                .next()
                .expect("layout built from this module type");
            let values = self.flat[slot.range.clone()].to_vec();
            let shape = slot.shape.clone();
            param.map(|old| {
                let device = old.device();
                let grad = old.is_require_grad();
                let t = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
                if grad { t.require_grad() } else { t }
            })
        }
    }
    module.map(&mut Write {
        slots: layout.slots.iter(),
        flat,
    })
}

/// A 64-bit fingerprint of a flat buffer's exact bits (FNV-1a): equal parameters give equal
/// fingerprints on every rank.
pub fn fingerprint(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
