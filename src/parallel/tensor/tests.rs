//! Sharding is pure slicing: property tests of `shard` and `unshard` (TP-3).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use proptest::prelude::*;

use super::layers::{ColumnParallelLinear, RowParallelLinear};
use super::{TensorParallelModule, UnshardError, shard, split_axes, unshard};
use crate::mesh::chunk_range;

/// A column-parallel and a row-parallel linear with a replicated one: every kind of
/// parameter a tensor-parallel block holds (also the re-slicing tests' block).
#[derive(Module, Debug)]
pub(super) struct Pair {
    column: ColumnParallelLinear,
    row: RowParallelLinear,
    replicated: Linear,
}

impl TensorParallelModule for Pair {
    fn split_params(&self, split: &mut dyn FnMut(burn::module::ParamId, usize)) {
        self.column.split_params(split);
        self.row.split_params(split);
    }
}

fn flat<M: Module>(m: &M) -> Vec<Vec<f32>> {
    struct All(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor for All {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            self.0.push(
                p.val()
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec()
                    .expect("f32"),
            );
        }
    }
    let mut a = All(Vec::new());
    m.visit(&mut a);
    a.0
}

pub(super) fn pair(d_in: usize, hidden: usize, device: &Device) -> Pair {
    Pair {
        column: ColumnParallelLinear::new(d_in, hidden, true, device),
        row: RowParallelLinear::new(hidden, d_in, true, device),
        replicated: crate::parallel::stages::materialize(LinearConfig::new(d_in, 2).init(device)),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// TP-3: each rank keeps its chunk of every split axis, the replicated parameters whole;
    /// unsharding the parts gives the record back bitwise, for any degree (even uneven).
    #[test]
    fn shard_then_unshard_is_the_identity(d_in in 4usize..7, hidden in 4usize..9, degree in 1usize..5) {
        let device = Device::default();
        let whole = pair(d_in, hidden, &device);
        let parts: Vec<Pair> = (0..degree).map(|r| shard(whole.clone(), r, degree).expect("axes ≥ degree")).collect();
        for (r, p) in parts.iter().enumerate() {
            prop_assert_eq!(p.column.local_out(), chunk_range(hidden, degree, r).len());
            prop_assert_eq!(flat(&p.replicated), flat(&whole.replicated));
        }
        prop_assert_eq!(split_axes(&whole).len(), 3);
        let back = unshard(parts).expect("the parts fit");
        prop_assert_eq!(flat(&back), flat(&whole));
    }
}

#[test]
fn unshard_refuses_nothing_and_foreign_parts() {
    let device = Device::default();
    assert_eq!(
        unshard::<Pair>(Vec::new()).unwrap_err(),
        UnshardError::Empty
    );
    let a = pair(3, 4, &device);
    let b = pair(3, 4, &device); // other parameter ids
    let e = unshard(vec![
        shard(a, 0, 2).expect("splits"),
        shard(b, 1, 2).expect("splits"),
    ])
    .expect_err("foreign part");
    assert!(
        matches!(e, UnshardError::MissingParam { part: 1, .. }),
        "{e}"
    );
}

#[test]
fn a_degree_above_an_axis_is_refused() {
    let whole = pair(3, 2, &Device::default());
    let e = shard(whole, 0, 3).expect_err("2 columns over 3 ranks");
    assert!(e.0.contains("a rank would hold nothing"), "{e}");
}
