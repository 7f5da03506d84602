use proptest::prelude::*;

use super::{LocalUpdates, OuterState};

/// One synchronisation of a simulated group: every rank's contribution summed (in rank
/// order, as the all-reduce does), then every rank's `after_sync` on its own copy of the
/// outer state. Returns the ranks' parameters and outer states afterwards.
fn sync_group(
    rule: &LocalUpdates,
    ranks: &[Vec<f32>],
    outer: &OuterState,
) -> (Vec<Vec<f32>>, Vec<OuterState>) {
    let len = ranks[0].len();
    let mut sum = vec![0.0f32; len];
    for r in ranks {
        let c = rule.contribution(r, outer);
        sum.iter_mut().zip(&c).for_each(|(s, v)| *s += v);
    }
    ranks
        .iter()
        .map(|r| {
            let (mut params, mut o) = (r.clone(), outer.clone());
            rule.after_sync(&mut params, &mut o, &sum, ranks.len());
            (params, o)
        })
        .unzip()
}

fn close(a: f32, b: f32, scale: f32) -> bool {
    (a - b).abs() <= 1e-5 * scale.max(1.0)
}

fn group(world: usize, len: usize) -> impl Strategy<Value = Vec<Vec<f32>>> {
    prop::collection::vec(prop::collection::vec(-10.0f32..10.0, len), world)
}

proptest! {
    /// LOCAL-3: averaging equal parameters gives them back.
    #[test]
    fn local_sgd_of_equal_ranks_is_identity(
        x in prop::collection::vec(-100.0f32..100.0, 1..40),
        world in 1usize..9,
    ) {
        let rule = LocalUpdates::local_sgd(4);
        let ranks = vec![x.clone(); world];
        let (after, _) = sync_group(&rule, &ranks, &OuterState::default());
        for r in &after {
            for (a, b) in r.iter().zip(&x) {
                prop_assert!(close(*a, *b, b.abs()), "{a} vs {b}");
            }
        }
    }

    /// Local SGD leaves every rank with the mean, the same bits on every rank.
    #[test]
    fn local_sgd_gives_every_rank_the_mean(
        (world, ranks) in (1usize..7).prop_flat_map(|w| (Just(w), group(w, 12))),
    ) {
        let (after, _) = sync_group(&LocalUpdates::local_sgd(2), &ranks, &OuterState::default());
        for i in 0..12 {
            let mean = ranks.iter().map(|r| f64::from(r[i])).sum::<f64>() / world as f64;
            prop_assert!(close(after[0][i], mean as f32, 10.0));
        }
        prop_assert!(after.iter().all(|r| r == &after[0]));
    }

    /// LOCAL-3: DiLoCo with an outer SGD of learning rate 1 and no momentum is local SGD.
    #[test]
    fn diloco_with_unit_lr_and_no_momentum_averages(
        (_world, ranks) in (1usize..7).prop_flat_map(|w| (Just(w), group(w, 12))),
        start in prop::collection::vec(-10.0f32..10.0, 12),
    ) {
        let rule = LocalUpdates::DiLoCo { every: 3, outer_lr: 1.0, outer_momentum: 0.0, nesterov: false };
        let mut outer = OuterState::default();
        outer.start(&rule, &start);
        let (after, outers) = sync_group(&rule, &ranks, &outer);
        let (avg, _) = sync_group(&LocalUpdates::local_sgd(3), &ranks, &OuterState::default());
        for (a, b) in after[0].iter().zip(&avg[0]) {
            prop_assert!(close(*a, *b, 10.0), "{a} vs {b}");
        }
        // LOCAL-2: every rank's outer state and parameters are the same bits.
        prop_assert!(after.iter().all(|r| r == &after[0]));
        prop_assert!(outers.iter().all(|o| o == &outers[0]));
        prop_assert_eq!(&outers[0].anchor, &after[0]);
    }

    /// DiLoCo's outer step is SGD with (Nesterov) momentum on the mean outer gradient,
    /// step after step (PyTorch's `SGD(momentum, nesterov)` from a zero buffer).
    #[test]
    fn diloco_outer_step_is_momentum_sgd(
        deltas in prop::collection::vec(-1.0f32..1.0, 1..5),
        lr in 0.1f32..1.0,
        mu in 0.0f32..0.95,
        nesterov in any::<bool>(),
    ) {
        let rule = LocalUpdates::DiLoCo { every: 1, outer_lr: lr, outer_momentum: mu, nesterov };
        let mut outer = OuterState::default();
        outer.start(&rule, &[1.0]);
        let (mut g, mut m) = (1.0f64, 0.0f64);
        for d in deltas {
            // One rank whose parameter moved by `-d` from the global one.
            let mut x = [outer.anchor[0] - d];
            let sum = rule.contribution(&x, &outer);
            rule.after_sync(&mut x, &mut outer, &sum, 1);
            let d = f64::from(sum[0]);
            m = f64::from(mu) * m + d;
            g -= f64::from(lr) * if nesterov { d + f64::from(mu) * m } else { m };
            prop_assert!((f64::from(outer.anchor[0]) - g).abs() < 1e-4, "{} vs {g}", outer.anchor[0]);
            prop_assert_eq!(x[0], outer.anchor[0]);
        }
    }

    /// LOCAL-3: EASGD's elastic step conserves the centre plus the workers' sum, pulls each
    /// worker toward the centre by alpha, and keeps the centre the same bits on every rank.
    #[test]
    fn easgd_conserves_centre_plus_workers(
        (world, ranks) in (1usize..7).prop_flat_map(|w| (Just(w), group(w, 10))),
        centre in prop::collection::vec(-10.0f32..10.0, 10),
        alpha in 0.01f32..1.0,
    ) {
        let alpha = alpha / world as f32;
        let rule = LocalUpdates::easgd(2, alpha);
        let mut outer = OuterState::default();
        outer.start(&rule, &centre);
        let (after, outers) = sync_group(&rule, &ranks, &outer);
        prop_assert!(outers.iter().all(|o| o == &outers[0]));
        for i in 0..10 {
            let before: f64 = ranks.iter().map(|r| f64::from(r[i])).sum::<f64>() + f64::from(centre[i]);
            let now: f64 = after.iter().map(|r| f64::from(r[i])).sum::<f64>() + f64::from(outers[0].anchor[i]);
            prop_assert!((before - now).abs() < 1e-4 * (world as f64 + 1.0) * 10.0, "{before} vs {now}");
            for (r, a) in ranks.iter().zip(&after) {
                let want = r[i] - alpha * (r[i] - centre[i]);
                prop_assert!(close(a[i], want, 10.0));
            }
        }
    }

    /// EASGD with every worker at the centre changes nothing, bit for bit.
    #[test]
    fn easgd_at_the_centre_is_a_fixed_point(
        x in prop::collection::vec(-10.0f32..10.0, 1..20),
        world in 1usize..6,
    ) {
        let rule = LocalUpdates::easgd(1, 0.9 / world as f32);
        let mut outer = OuterState::default();
        outer.start(&rule, &x);
        let (after, outers) = sync_group(&rule, &vec![x.clone(); world], &outer);
        prop_assert!(after.iter().all(|r| r == &x));
        prop_assert_eq!(&outers[0].anchor, &x);
    }

    /// LOCAL-1: a sync after every `every`-th applied step, none before the first.
    #[test]
    fn syncs_every_h_applied_steps(every in 1u32..20, steps in 0u64..200) {
        let rule = LocalUpdates::local_sgd(every);
        let n = (1..=steps).filter(|&s| rule.syncs_after(s)).count() as u64;
        prop_assert_eq!(n, steps / u64::from(every));
        prop_assert!(!rule.syncs_after(0));
    }

    /// The text form round-trips through `Display`.
    #[test]
    fn cli_form_round_trips(every in 1u32..100, lr in 0.01f32..2.0, mu in 0.0f32..0.99, nesterov in any::<bool>(), alpha in 0.01f32..1.0) {
        for m in [
            LocalUpdates::local_sgd(every),
            LocalUpdates::DiLoCo { every, outer_lr: lr, outer_momentum: mu, nesterov },
            LocalUpdates::easgd(every, alpha),
        ] {
            prop_assert_eq!(m.to_string().parse::<LocalUpdates>().ok(), Some(m));
        }
    }
}

#[test]
fn cli_defaults_are_the_papers() {
    assert_eq!(
        "diloco:8".parse::<LocalUpdates>().ok(),
        Some(LocalUpdates::DiLoCo {
            every: 8,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            nesterov: true
        })
    );
    assert_eq!(
        "local-sgd:8".parse::<LocalUpdates>().ok(),
        Some(LocalUpdates::local_sgd(8))
    );
    assert_eq!(
        "easgd:4:0.1".parse::<LocalUpdates>().ok(),
        Some(LocalUpdates::easgd(4, 0.1))
    );
    assert_eq!(
        "easgd".parse::<LocalUpdates>().ok(),
        Some(LocalUpdates::easgd(8, 0.1))
    );
    for bad in [
        "sgd:4",
        "local-sgd:x",
        "local-sgd:4:1",
        "diloco:4:a",
        "diloco:4:0.7:0.9:maybe",
    ] {
        assert!(bad.parse::<LocalUpdates>().is_err(), "{bad} parsed");
    }
}

#[test]
fn validation_names_what_is_wrong() {
    assert!(LocalUpdates::local_sgd(0).validate(2).is_err());
    assert!(LocalUpdates::diloco(0).validate(2).is_err());
    assert!(LocalUpdates::diloco(4).validate(4).is_ok());
    let bad_mu = LocalUpdates::DiLoCo {
        every: 4,
        outer_lr: 0.7,
        outer_momentum: 1.0,
        nesterov: true,
    };
    assert!(bad_mu.validate(4).is_err());
    assert!(LocalUpdates::easgd(4, 0.1).validate(4).is_ok());
    let e = LocalUpdates::easgd(4, 0.3).validate(4).unwrap_err();
    assert!(e.0.contains("overshoots"), "{}", e.0);
    assert!(LocalUpdates::easgd(4, 0.0).validate(1).is_err());
}
