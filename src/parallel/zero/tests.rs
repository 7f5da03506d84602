//! ZERO-1..3: ownership, the update rules against Burn's optimizers, re-sharding.

use burn::module::{Module, Param};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use proptest::prelude::*;

use super::*;

#[derive(Module, Debug)]
struct One {
    w: Param<Tensor<1>>,
}

fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40503));
            (x % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// ZERO-2: `FlatRule::step` gives Burn's optimizer's parameters, bit for bit, over several
/// steps (whole buffer and sharded in three).
fn check_against_burn(config: OptimizerConfig) {
    let device = Device::flex().autodiff();
    let n = 37;
    let p0 = values(1, n);
    let mut module = One {
        w: Param::from_tensor(Tensor::from_data(TensorData::new(p0.clone(), [n]), &device)),
    };
    let mut optim = config.init();
    let rule = FlatRule::of(&config).expect("a shardable optimizer");
    let mut shards: Vec<(Range<usize>, FlatState)> = (0..3)
        .map(|r| (owned_range(n, 3, r), FlatState::default()))
        .collect();
    let mut flat = p0;
    for step in 0..4 {
        let g = values(10 + step, n);
        let lr = 0.05;
        let mut grads = GradientsParams::new();
        grads.register(
            module.w.id,
            Tensor::<1>::from_data(TensorData::new(g.clone(), [n]), &device.clone().inner()),
        );
        module = optim.step(lr, module, grads);
        for (range, state) in &mut shards {
            let mut part = flat[range.clone()].to_vec();
            rule.step(state, &mut part, &g[range.clone()], &[(0..range.len(), lr)]);
            flat[range.clone()].copy_from_slice(&part);
        }
        let burn: Vec<f32> = module.w.val().into_data().try_to_vec().expect("f32 values");
        for (i, (a, b)) in burn.iter().zip(&flat).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                "{config:?} step {step} element {i}: Burn {a}, flat rule {b}"
            );
        }
    }
}

#[test]
fn zero_2_sgd_with_momentum_and_decay_follows_burn() {
    check_against_burn(
        SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_nesterov(true)))
            .with_weight_decay(Some(WeightDecayConfig::new(0.01)))
            .into(),
    );
    check_against_burn(SgdConfig::new().into());
}

#[test]
fn zero_2_adam_follows_burn() {
    check_against_burn(AdamConfig::new().into());
    check_against_burn(
        AdamConfig::new()
            .with_amsgrad(true)
            .with_weight_decay(Some(WeightDecayConfig::new(0.02)))
            .into(),
    );
}

#[test]
fn zero_2_adamw_follows_burn() {
    check_against_burn(AdamWConfig::new().into());
    check_against_burn(AdamWConfig::new().with_weight_decay(0.1).into());
}

#[test]
fn an_optimizer_with_its_own_clipping_cannot_be_sharded() {
    let c = AdamConfig::new()
        .with_grad_clipping(Some(
            burn::optim::grad_clipping::GradientClippingConfig::Norm(1.0),
        ))
        .into();
    let e = FlatRule::of(&c).expect_err("per-tensor clipping needs whole tensors");
    assert!(e.to_string().contains("clip_grad_norm"), "{e}");
}

fn adam_rule() -> FlatRule {
    FlatRule::of(&AdamConfig::new().into()).expect("Adam shards")
}

fn stepped_parts(total: usize, world: usize, steps: u32) -> Vec<OptimizerShard> {
    let rule = adam_rule();
    (0..world)
        .map(|r| {
            let mut shard = OptimizerShard::fresh(rule, total, world, r);
            let range = shard.range.clone();
            let mut p = values(3, total)[range.clone()].to_vec();
            for s in 0..steps {
                let g = values(20 + s, total)[range.clone()].to_vec();
                rule.step(&mut shard.state, &mut p, &g, &[(0..range.len(), 0.1)]);
            }
            shard
        })
        .collect()
}

proptest! {
    /// ZERO-1: the owned ranges are disjoint, ordered and cover the buffer.
    #[test]
    fn zero_1_owned_ranges_tile_the_buffer(len in 0usize..5000, world in 1usize..17) {
        let mut at = 0;
        for r in 0..world {
            let range = owned_range(len, world, r);
            prop_assert_eq!(range.start, at);
            prop_assert!(range.len() <= len / world + 1);
            at = range.end;
        }
        prop_assert_eq!(at, len);
    }

    /// ZERO-3: re-sharding from n parts to m and back gives the same parts; every element's
    /// state is where the m-way split says.
    #[test]
    fn zero_3_resharding_moves_state_and_round_trips(
        total in 1usize..300, n in 1usize..6, m in 1usize..6, steps in 0u32..3,
    ) {
        let parts = stepped_parts(total, n, steps);
        let moved: Vec<OptimizerShard> = (0..m)
            .map(|r| reshard(&parts, total, m, r).expect("complete parts"))
            .collect();
        for (r, p) in moved.iter().enumerate() {
            prop_assert_eq!(p.range.clone(), owned_range(total, m, r));
            prop_assert_eq!(p.state.steps, u64::from(steps));
        }
        let mut reversed = moved.clone();
        reversed.reverse();
        for (r, original) in parts.iter().enumerate() {
            let back = reshard(&reversed, total, n, r).expect("complete parts");
            prop_assert_eq!(&back, original);
        }
    }

    /// ZERO-2: stepping the shards one by one equals stepping the whole buffer at once.
    #[test]
    fn zero_2_sharded_steps_equal_the_whole_step(total in 1usize..200, world in 1usize..6) {
        let rule = adam_rule();
        let mut whole = FlatState::default();
        let mut p = values(5, total);
        let g = values(6, total);
        let mut sharded = p.clone();
        rule.step(&mut whole, &mut p, &g, &[(0..total, 0.01)]);
        for r in 0..world {
            let range = owned_range(total, world, r);
            let mut state = FlatState::default();
            let n = range.len();
            rule.step(&mut state, &mut sharded[range.clone()], &g[range.clone()], &[(0..n, 0.01)]);
            prop_assert_eq!(&state.first[..], &whole.first[range.clone()]);
        }
        prop_assert_eq!(p, sharded);
    }
}

#[test]
fn zero_3_incomplete_or_mismatched_parts_are_refused() {
    let parts = stepped_parts(50, 3, 1);
    let missing = [parts[0].clone(), parts[2].clone()];
    assert!(matches!(
        reshard(&missing, 50, 2, 0),
        Err(ReshardError::Coverage { .. })
    ));
    assert!(matches!(
        reshard(&parts, 51, 2, 0),
        Err(ReshardError::Length {
            parts: 50,
            model: 51
        })
    ));
    let mut twice = parts.clone();
    twice.push(parts[1].clone());
    assert!(reshard(&twice, 50, 2, 0).is_err());
    assert!(matches!(reshard(&[], 50, 1, 0), Err(ReshardError::Empty)));
}
