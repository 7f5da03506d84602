//! Re-slicing is pure (TP-7): property tests of `cut` and `join`, and checkpoints of a block
//! stepped at one degree re-sliced onto another equal the block stepped at that degree.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, SgdConfig, momentum::MomentumConfig};
use burn::tensor::{Device, Tensor, TensorData};
use proptest::prelude::*;

use super::*;
use crate::checkpoint::{TrainingState, snapshot_module};
use crate::optim::OptimizerConfig;
use crate::parallel::tensor::tests::{Pair, pair};
use crate::parallel::tensor::{shard, split_axes};
use crate::parallel::zero::FlatRule;

proptest! {
    /// Cutting a tensor for every rank of a degree and joining the slices gives it back
    /// bitwise, along any axis, evenly divisible or not.
    #[test]
    fn cut_then_join_is_the_identity(
        dims in prop::collection::vec(1usize..6, 1..4),
        axis_pick in 0usize..3,
        degree in 1usize..5,
    ) {
        let axis = axis_pick % dims.len();
        prop_assume!(dims[axis] >= degree);
        let n: usize = dims.iter().product();
        let whole: Vec<u32> = (0..n as u32).collect();
        let slices: Vec<(Vec<usize>, Vec<u32>)> =
            (0..degree).map(|r| cut(&dims, &whole, axis, r, degree)).collect();
        let borrowed: Vec<(&[usize], &[u32])> =
            slices.iter().map(|(d, v)| (d.as_slice(), v.as_slice())).collect();
        let (back_dims, back) = join(&borrowed, axis, "t").expect("slices of one tensor");
        prop_assert_eq!(back_dims, dims);
        prop_assert_eq!(back, whole);
    }

    /// A shard's parameters re-sliced from one degree onto another are the slices cut from
    /// the whole at the new degree.
    #[test]
    fn parameters_reslice_onto_any_degree(from in 1usize..5, to in 1usize..5) {
        let whole = whole_pair();
        let held = held_of(&whole);
        let old: Vec<ShardSnapshot> = (0..from)
            .map(|r| snapshot(r, &shard(whole.clone(), r, from).expect("splits"), None))
            .collect();
        let refs: Vec<&ShardSnapshot> = old.iter().collect();
        for r in 0..to {
            let got = reslice(&refs, &held, r, to).expect("re-slices");
            let want = snapshot_module(&shard(whole.clone(), r, to).expect("splits"));
            prop_assert_eq!(got.params.params(), want.params());
            prop_assert_eq!(got.shard, ShardId { pp: 0, tp: r as u32 });
        }
    }
}

fn whole_pair() -> Pair {
    let device = Device::flex();
    let _draw = crate::testing::draw_lock();
    device.seed(7);
    // Optimizer steps need autodiff tensors.
    let device = device.autodiff();
    pair(3, 8, &device)
}

fn held_of(whole: &Pair) -> Vec<HeldParam> {
    let axes = split_axes(whole);
    snapshot_module(whole)
        .params()
        .iter()
        .map(|p| HeldParam {
            name: p.name.clone(),
            axis: axes.get(&ParamId::from(p.id)).copied(),
            trainable: true,
        })
        .collect()
}

fn snapshot(rank: usize, m: &Pair, optimizer: Option<OptimizerState>) -> ShardSnapshot {
    ShardSnapshot {
        shard: ShardId {
            pp: 0,
            tp: rank as u32,
        },
        params: snapshot_module(m),
        optimizer,
        training: TrainingState::default(),
    }
}

/// A gradient for every parameter of the whole module (seeded values), as rank `rank` of
/// `degree` sees it: split parameters' gradients cut like the parameters.
fn gradients(whole: &Pair, part: &Pair, rank: usize, degree: usize) -> GradientsParams {
    let axes = split_axes(whole);
    struct Dims(HashMap<ParamId, Vec<usize>>);
    impl ModuleVisitor for Dims {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.insert(p.id, p.dims().to_vec());
        }
    }
    let mut dims = Dims(HashMap::new());
    whole.visit(&mut dims);
    struct Register<'a> {
        dims: &'a HashMap<ParamId, Vec<usize>>,
        axes: &'a HashMap<ParamId, usize>,
        rank: usize,
        degree: usize,
        grads: GradientsParams,
    }
    impl ModuleVisitor for Register<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let whole = &self.dims[&p.id];
            let n: usize = whole.iter().product();
            let seed = p.id.val() % 97;
            let values: Vec<f32> = (0..n)
                .map(|i| ((i as u64 * 31 + seed) % 17) as f32 / 8.0 - 1.0)
                .collect();
            let (d, v) = match self.axes.get(&p.id) {
                Some(&axis) => cut(whole, &values, axis, self.rank, self.degree),
                None => (whole.clone(), values),
            };
            let device = p.val().device();
            self.grads
                .register::<D>(p.id, Tensor::from_data(TensorData::new(v, d), &device));
        }
    }
    let mut r = Register {
        dims: &dims.0,
        axes: &axes,
        rank,
        degree,
        grads: GradientsParams::new(),
    };
    part.visit(&mut r);
    r.grads
}

/// Rank `rank` of `degree` after two steps of `config` from the whole module's slice.
fn stepped(whole: &Pair, config: &OptimizerConfig, rank: usize, degree: usize) -> ShardSnapshot {
    let mut optimizer = config.init();
    let mut part = shard(whole.clone(), rank, degree).expect("splits");
    for _ in 0..2 {
        let grads = gradients(whole, &part, rank, degree);
        part = optimizer.step(0.1, part, grads);
    }
    let state = OptimizerState::capture(&optimizer).expect("captures");
    snapshot(rank, &part, Some(state))
}

/// Burn's record as (name, dims, bytes), in its order.
fn tensors_of(state: &OptimizerState) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let bytes = state.whole_bytes().expect("whole state");
    BurnRecord::read(bytes)
        .expect("a record")
        .tensors
        .into_iter()
        .map(|e| (e.name, e.dims, e.bytes))
        .collect()
}

/// SGD with momentum, Adam and AdamW: a block stepped at tp 2 and re-sliced onto tp 1, 3 and
/// 4 holds, bitwise, the parameters and optimizer state of the block stepped at that degree
/// (every update is element-wise, so the slices' steps are the whole's).
#[test]
fn burn_optimizer_state_reslices_onto_another_degree() {
    let whole = whole_pair();
    let held = held_of(&whole);
    let configs: [(&str, OptimizerConfig); 3] = [
        (
            "sgd",
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
                .into(),
        ),
        ("adam", AdamConfig::new().into()),
        ("adamw", AdamWConfig::new().into()),
    ];
    for (name, config) in configs {
        let old: Vec<ShardSnapshot> = (0..2).map(|r| stepped(&whole, &config, r, 2)).collect();
        let refs: Vec<&ShardSnapshot> = old.iter().collect();
        for to in [1, 3, 4] {
            for r in 0..to {
                let got = reslice(&refs, &held, r, to).expect("re-slices");
                let want = stepped(&whole, &config, r, to);
                assert_eq!(got.params, want.params, "{name}: tp 2 → {to}, rank {r}");
                let (g, w) = (
                    got.optimizer.as_ref().expect("state"),
                    want.optimizer.as_ref().expect("state"),
                );
                assert_eq!(
                    tensors_of(g),
                    tensors_of(w),
                    "{name}: tp 2 → {to}, rank {r}"
                );
            }
        }
    }
}

/// ZeRO's flat state (Adam's two moments over each rank's flat order, in parts over a
/// data-parallel group of 2): re-sliced from tp 2 onto tp 3, each buffer is the whole's
/// elements in the new rank's flat order.
#[test]
fn zero_state_reslices_onto_another_degree() {
    let whole = whole_pair();
    let held = held_of(&whole);
    // A flat state whose element values say where they are: parameter `p`'s element `i` of
    // the whole is `1000 p + i`.
    let whole_params = snapshot_module(&whole);
    let axes: Vec<Option<usize>> = held.iter().map(|h| h.axis).collect();
    let values = |degree: usize, rank: usize, offset: f32| -> Vec<f32> {
        let mut out = Vec::new();
        for (k, p) in whole_params.params().iter().enumerate() {
            let tagged: Vec<f32> = (0..p.values.len())
                .map(|i| 1000.0 * k as f32 + i as f32 + offset)
                .collect();
            match axes[k] {
                Some(axis) => out.extend(cut(&p.dims, &tagged, axis, rank, degree).1),
                None => out.extend(tagged),
            }
        }
        out
    };
    let rule = FlatRule::Adam {
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-8,
        amsgrad: false,
        weight_decay: None,
    };
    let state_of = |degree: usize, rank: usize| -> FlatState {
        FlatState {
            steps: 3,
            first: values(degree, rank, 0.25).into(),
            second: values(degree, rank, 0.5).into(),
            max_second: Default::default(),
        }
    };
    let old: Vec<ShardSnapshot> = (0..2)
        .map(|r| {
            let s = state_of(2, r);
            let total = s.first.len();
            // Two data-parallel parts of the rank's flat order.
            let whole_shard = OptimizerShard {
                rule,
                range: 0..total,
                total,
                state: s,
            };
            let parts = (0..2)
                .map(|d| {
                    reshard(std::slice::from_ref(&whole_shard), total, 2, d).expect("re-shards")
                })
                .map(|p| shard_state(&p).expect("encodes"))
                .collect::<Vec<_>>();
            let merged = OptimizerState::merge_parts(parts).expect("parts");
            snapshot(
                r,
                &shard(whole.clone(), r, 2).expect("splits"),
                Some(merged),
            )
        })
        .collect();
    let refs: Vec<&ShardSnapshot> = old.iter().collect();
    for r in 0..3 {
        let got = reslice(&refs, &held, r, 3).expect("re-slices");
        let decoded = decode_zero_parts(got.optimizer.as_ref().expect("state")).expect("ZeRO");
        assert_eq!(
            decoded.len(),
            1,
            "one part: the restore re-shards it over dp"
        );
        let want = state_of(3, r);
        assert_eq!(decoded[0].range, 0..want.first.len());
        assert_eq!(decoded[0].state, want, "tp 2 → 3, rank {r}");
    }
}

/// What is not re-sliced says so: ZeRO-3's parameter parts.
#[test]
fn zero_3_parameter_parts_are_refused_by_name() {
    let whole = whole_pair();
    let held = held_of(&whole);
    let mut s = snapshot(0, &shard(whole.clone(), 0, 2).expect("splits"), None);
    s.params = ShardParams::with_part(
        ShardParams::default(),
        crate::checkpoint::ParamPart {
            range: 0..2,
            total: 2,
            values: vec![1.0, 2.0],
        },
    );
    let e = reslice(&[&s, &s], &held, 0, 1).expect_err("refused");
    assert!(e.to_string().contains("ZeRO-3"), "{e}");
}
