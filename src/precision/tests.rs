use proptest::prelude::*;

use super::*;

fn scaler(interval: u32) -> LossScaler {
    LossScaler::new(LossScalerConfig::default().growth_interval(interval)).expect("valid")
}

#[test]
fn defaults_are_grad_scalers() {
    let s = scaler(2000);
    assert_eq!(s.scale(), 65536.0);
    assert_eq!(s.state().clean_steps, 0);
}

#[test]
fn precision_parses_and_prints() {
    for p in [Precision::F32, Precision::Bf16, Precision::F16] {
        assert_eq!(p.name().parse::<Precision>(), Ok(p));
    }
    assert!("f64".parse::<Precision>().is_err());
    assert!(Precision::F16.scales_loss() && !Precision::Bf16.scales_loss());
}

#[test]
fn invalid_configs_are_refused() {
    let c = LossScalerConfig::default();
    for bad in [
        LossScalerConfig {
            init_scale: f32::INFINITY,
            ..c
        },
        LossScalerConfig {
            init_scale: 0.0,
            ..c
        },
        LossScalerConfig {
            growth_factor: 1.0,
            ..c
        },
        LossScalerConfig {
            backoff_factor: 1.0,
            ..c
        },
        LossScalerConfig {
            backoff_factor: 0.0,
            ..c
        },
        LossScalerConfig {
            growth_interval: 0,
            ..c
        },
    ] {
        assert!(LossScaler::new(bad).is_err(), "{bad:?}");
    }
}

proptest! {
    /// The rules, replayed on a model of them: an overflow halves the scale and resets the
    /// count; `n` clean steps in a row double it; PREC-3 keeps it finite and positive.
    #[test]
    fn scaler_follows_grad_scaler_rules(
        interval in 1u32..6,
        overflows in proptest::collection::vec(any::<bool>(), 0..200),
    ) {
        let mut s = scaler(interval);
        let (mut scale, mut clean) = (65536.0f64, 0u32);
        for &o in &overflows {
            let d = s.update(o);
            if o {
                prop_assert_eq!(d, ScaleUpdate::Skip);
                clean = 0;
                if scale * 0.5 >= f64::from(MIN_SCALE) {
                    scale *= 0.5;
                }
            } else {
                prop_assert!(d.steps());
                clean += 1;
                if clean == interval {
                    clean = 0;
                    if scale * 2.0 <= f64::from(f32::MAX) {
                        scale *= 2.0;
                        prop_assert_eq!(d, ScaleUpdate::StepAndGrow);
                    } else {
                        prop_assert_eq!(d, ScaleUpdate::Step);
                    }
                } else {
                    prop_assert_eq!(d, ScaleUpdate::Step);
                }
            }
            prop_assert_eq!(f64::from(s.scale()), scale);
            prop_assert_eq!(s.state().clean_steps, clean);
            prop_assert!(s.scale().is_finite() && s.scale() >= MIN_SCALE);
        }
    }

    /// A scaler restored from another's state decides exactly as the original from then on
    /// (what a checkpoint relies on).
    #[test]
    fn restored_state_continues_identically(
        interval in 1u32..6,
        before in proptest::collection::vec(any::<bool>(), 0..40),
        after in proptest::collection::vec(any::<bool>(), 0..40),
    ) {
        let mut a = scaler(interval);
        for &o in &before {
            a.update(o);
        }
        let json = serde_json::to_string(&a.state()).expect("serialises");
        let mut b = scaler(interval);
        b.restore(serde_json::from_str(&json).expect("deserialises")).expect("valid state");
        for &o in &after {
            prop_assert_eq!(a.update(o), b.update(o));
            prop_assert_eq!(a.state(), b.state());
        }
    }
}

#[test]
fn restore_refuses_bad_states() {
    let mut s = scaler(3);
    assert!(
        s.restore(ScalerState {
            scale: f32::NAN,
            clean_steps: 0
        })
        .is_err()
    );
    assert!(
        s.restore(ScalerState {
            scale: 0.0,
            clean_steps: 0
        })
        .is_err()
    );
    assert!(
        s.restore(ScalerState {
            scale: 8.0,
            clean_steps: 3
        })
        .is_err()
    );
    assert!(
        s.restore(ScalerState {
            scale: 8.0,
            clean_steps: 2
        })
        .is_ok()
    );
    assert_eq!(s.scale(), 8.0);
}
