use burn::nn::{Linear, LinearConfig};

use super::*;

/// Every parameter of `module` with a fresh id, as a checkpoint restore leaves them.
fn new_ids(module: Linear) -> Linear {
    struct Renew;
    impl ModuleMapper for Renew {
        fn map_float<const D: usize>(&mut self, mut p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            p.id = ParamId::new();
            p
        }
    }
    module.map(&mut Renew)
}

/// FLAT-3: a layout read before the ids changed still writes, releases and reads the
/// module, by order.
#[test]
fn flat_3_a_layout_meets_a_restored_module_by_order() {
    let device = Device::flex().autodiff();
    let module = LinearConfig::new(3, 2).init(&device);
    let layout = ParamLayout::trainable(&module);
    assert_eq!(layout.len(), 3 * 2 + 2, "weight and bias take part");
    let module = new_ids(module);
    let flat: Vec<f32> = (0..layout.len()).map(|i| i as f32).collect();
    let written = set_trainable(module, &layout, &flat);
    assert_eq!(trainable_range(&written, &layout, 0..layout.len()), flat);
    let released = release_trainable(written);
    assert!(
        released.weight.val().shape().num_elements() == 0,
        "released"
    );
    let back = set_trainable(released, &layout, &flat);
    assert_eq!(trainable_range(&back, &layout, 0..layout.len()), flat);
}
