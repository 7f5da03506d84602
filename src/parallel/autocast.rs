//! The device side of mixed precision ([`crate::precision`]): the low-precision copy of a
//! model that a micro-batch's forward and backward run on, and the dtype helpers a model
//! needs to accept `f32` inputs.
//!
//! The copy is made inside the autodiff graph: each float parameter of the `f32` master model
//! is cast (`Tensor::cast`) to the low dtype, keeping its `ParamId`. Forward and backward then
//! run in the low dtype, and Burn's backward of the cast hands each master parameter its
//! gradient in `f32` (like PyTorch's autocast, where the weights stay `f32` and each use casts
//! them). So `GradientsParams::from_grads(grads, &master)` maps the gradients back unchanged,
//! they are accumulated and reduced in `f32` (or sent as 16-bit when asked), and the optimizer
//! steps the `f32` master weights (PREC-1).
//!
//! **What a model must do.** Burn does not promote dtypes: a matmul of an `f32` input with
//! `bf16` weights panics ("dtype mismatch"). A model trained in low precision casts its input
//! to its parameters' dtype in its first op (`x.cast(compute_dtype(self))`, or the dtype of
//! its first weight), and the loss function casts the model's output to `f32` before the loss
//! (`output.cast(FloatDType::F32)`), so the loss and its reduction are `f32`. Both casts are
//! no-ops in an `f32` job (Burn returns the tensor itself), so the same code trains in every
//! precision; [`crate::demo::Mlp`] and [`crate::demo::mse_loss`] do this.
//!
//! Buffers (parameters without gradient, e.g. frozen weights) are cast too: a forward that
//! updates a running statistic in place updates the copy, not the master; models with
//! running statistics (batch norm) should train in `f32`.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{FloatDType, Tensor};

use crate::precision::Precision;

/// The tensor float type forward and backward run in at `precision`.
pub fn float_dtype(precision: Precision) -> FloatDType {
    match precision {
        Precision::F32 => FloatDType::F32,
        Precision::Bf16 => FloatDType::BF16,
        Precision::F16 => FloatDType::F16,
    }
}

/// The dtype of `model`'s first float parameter (what its inputs must be cast to), `None`
/// for a model without float parameters.
pub fn compute_dtype<M: Module>(model: &M) -> Option<FloatDType> {
    struct First(Option<FloatDType>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().dtype().into());
            }
        }
    }
    let mut v = First(None);
    model.visit(&mut v);
    v.0
}

/// `model` with every float parameter cast to `precision`'s dtype, each keeping its
/// `ParamId`; inside the autodiff graph, so the gradients reach the master's parameters as
/// `f32`. At [`Precision::F32`] the model itself (the casts are no-ops).
pub fn low_precision_copy<M: Module>(model: &M, precision: Precision) -> M {
    struct Cast(FloatDType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| t.cast(dtype))
        }
    }
    let copy = model.clone();
    if precision.is_low() {
        copy.map(&mut Cast(float_dtype(precision)))
    } else {
        copy
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Module;
    use burn::optim::GradientsParams;
    use burn::tensor::{DType, Tensor};

    use super::*;
    use crate::demo::Mlp;

    /// PREC-1: the copy computes in the low dtype, and its backward hands the master's
    /// parameters `f32` gradients under their own ids.
    #[test]
    fn low_precision_copy_computes_low_and_grads_reach_the_f32_master() {
        let device = burn::tensor::Device::default().autodiff();
        let master = Mlp::new(&[4, 8, 2], &device);
        for p in [Precision::Bf16, Precision::F16] {
            let low = low_precision_copy(&master, p);
            assert_eq!(compute_dtype(&low), Some(float_dtype(p)));
            assert_eq!(compute_dtype(&master), Some(FloatDType::F32));
            let x = Tensor::<2>::ones([3, 4], &device);
            let y = low.forward(x);
            assert_eq!(y.dtype(), float_dtype(p).into());
            let loss = y.cast(FloatDType::F32).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &master);
            assert_eq!(grads.len(), 4, "every master parameter has its gradient");
            struct Check<'a>(&'a GradientsParams, usize);
            impl burn::module::ModuleVisitor for Check<'_> {
                fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                    let g = self.0.get::<D>(param.id).expect("a gradient per parameter");
                    assert_eq!(g.dtype(), DType::F32);
                    self.1 += 1;
                }
            }
            let mut check = Check(&grads, 0);
            master.visit(&mut check);
            assert_eq!(check.1, 4);
        }
    }
}
