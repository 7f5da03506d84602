use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn set(features: &[Feature]) -> BTreeSet<Feature> {
    features.iter().copied().collect()
}

/// COMP-2: each row has one to three distinct features and, with its `without`, two or more;
/// no row's features and `without` contain another's, so every refusal is stated once.
#[test]
fn comp_2_every_refusal_is_stated_once() {
    for r in REFUSALS {
        let s = set(r.features);
        let absent = set(r.without);
        assert!(
            (1..=3).contains(&r.features.len())
                && s.len() == r.features.len()
                && absent.len() == r.without.len()
                && s.is_disjoint(&absent)
                && s.len() + absent.len() >= 2,
            "{:?} without {:?}",
            r.features,
            r.without
        );
        assert!(!r.reason.is_empty() && !r.instead.is_empty());
        for other in REFUSALS.iter().filter(|o| !std::ptr::eq(*o, r)) {
            assert!(
                !(set(other.features).is_subset(&s) && set(other.without).is_subset(&absent)),
                "{:?} is inside {:?}",
                other.features,
                r.features
            );
        }
    }
}

/// A feature implies only more general ones, and a refused set is refused for the feature
/// that implies it: ZeRO-3 with top-k is refused (the ZeRO-3 row), ZeRO-1 with top-k is not.
#[test]
fn implied_features_carry_their_refusals() {
    for f in Feature::ALL {
        for g in f.implies() {
            assert!(
                !g.implies().contains(&f),
                "{f:?} and {g:?} imply each other"
            );
        }
    }
    let refused = |fs: &[Feature]| check(&set(fs), |f| f.to_string()).err();
    let zero_3 = refused(&[Feature::ZeroParameters, Feature::SparseCompression]).unwrap();
    assert_eq!(
        zero_3.features(),
        &[Feature::Compression, Feature::ZeroParameters]
    );
    assert!(refused(&[Feature::Zero, Feature::SparseCompression]).is_none());
    assert!(refused(&[Feature::ZeroGradients, Feature::Compression]).is_none());
    let backup = refused(&[Feature::BackupWorkers, Feature::Pipeline]).unwrap();
    assert_eq!(
        backup.features(),
        &[Feature::ParameterServer, Feature::Pipeline]
    );
    let roll_back = refused(&[Feature::RollBack]).unwrap();
    assert!(
        roll_back
            .to_string()
            .contains(" without .checkpoint_dir(..)"),
        "{roll_back}"
    );
    assert!(refused(&[Feature::RollBack, Feature::Checkpoints]).is_none());
}

/// The combinations users run most are not refused: the plain strategies alone, dp × pp with
/// ZeRO and bf16, blocks with ZeRO and f16, compression and local updates on plain replicas.
#[test]
fn the_common_combinations_pass() {
    for ok in [
        set(&[]),
        set(&[Feature::Pipeline, Feature::Zero, Feature::Bf16]),
        // The recipe: a transformer over dp × pp × tp, ZeRO-1, bf16, clipping, accumulation.
        set(&[
            Feature::Pipeline,
            Feature::TensorParallel,
            Feature::Zero,
            Feature::Bf16,
            Feature::ClipGradNorm,
            Feature::GradientAccumulation,
        ]),
        set(&[Feature::Pipeline, Feature::F16, Feature::ClipGradNorm]),
        set(&[
            Feature::Blocks,
            Feature::Zero,
            Feature::F16,
            Feature::ClipGradNorm,
        ]),
        set(&[Feature::Compression, Feature::Bf16, Feature::ClipGradNorm]),
        set(&[Feature::Compression, Feature::Pipeline, Feature::Zero]),
        set(&[
            Feature::LowPrecisionGradients,
            Feature::Blocks,
            Feature::Bf16,
        ]),
        set(&[Feature::LocalUpdates, Feature::Bf16]),
        set(&[Feature::LocalUpdates, Feature::Pipeline, Feature::Bf16]),
        set(&[Feature::ParameterServer, Feature::BackupWorkers]),
        set(&[Feature::AcrossProcesses, Feature::Pipeline, Feature::Zero]),
        set(&[
            Feature::AcrossProcesses,
            Feature::RollBack,
            Feature::Checkpoints,
        ]),
        set(&[Feature::Zero, Feature::SparseCompression]),
        set(&[Feature::ZeroGradients, Feature::Compression]),
    ] {
        assert_eq!(check(&ok, |f| f.to_string()), Ok(()), "{ok:?}");
    }
}

#[test]
fn a_refusal_names_both_settings_its_reason_and_what_to_do() {
    let e = check(
        &set(&[Feature::ParameterServer, Feature::Pipeline]),
        |f| match f {
            Feature::ParameterServer => "parameter_server(ssp:2)".into(),
            f => f.to_string(),
        },
    )
    .unwrap_err();
    assert_eq!(e.features(), &[Feature::ParameterServer, Feature::Pipeline]);
    let m = e.to_string();
    assert!(
        m.starts_with("parameter_server(ssp:2) with .pipeline(..) together: "),
        "{m}"
    );
    assert!(m.contains("give the model with .model(..)"), "{m}");
}

#[test]
fn the_matrix_marks_each_refused_pair_both_ways_and_lists_every_row() {
    let m = matrix_markdown();
    let mut refused_pairs = 0;
    for a in Feature::ALL {
        for b in Feature::ALL.into_iter().filter(|b| *b != a) {
            // The pair table leaves out rows that refuse a feature alone (a roll-back needs
            // checkpoints): judged with checkpoints on.
            let ok = |fs: &[Feature]| {
                let mut with = set(fs);
                with.insert(Feature::Checkpoints);
                check(&with, |f| f.to_string()).is_ok()
            };
            let pair = pair_refusal(a, b).is_some();
            assert_eq!(
                pair,
                !ok(&[a, b]) && ok(&[a]) && ok(&[b]),
                "{a:?} with {b:?}"
            );
            refused_pairs += usize::from(pair);
        }
    }
    assert_eq!(m.matches('✗').count(), refused_pairs);
    for r in REFUSALS {
        if r.features.len() == 2 && r.without.is_empty() {
            assert!(
                pair_refusal(r.features[0], r.features[1]).is_some(),
                "{r:?}"
            );
        }
        assert!(m.contains(r.reason), "{}", r.reason);
    }
}

proptest! {
    /// COMP-1: a set is refused exactly when it holds every feature of some row, and the error
    /// names the features of the first such row.
    #[test]
    fn comp_1_refused_exactly_when_a_row_is_contained(mask in 0u32..(1 << Feature::ALL.len())) {
        let features: BTreeSet<Feature> = Feature::ALL
            .iter()
            .enumerate()
            .filter(|(i, _)| mask & (1 << i) != 0)
            .map(|(_, f)| *f)
            .collect();
        let closed = closure(&features);
        let first = REFUSALS.iter().find(|r| {
            r.features.iter().all(|f| closed.contains(f))
                && !r.without.iter().any(|f| closed.contains(f))
        });
        match (check(&features, |f| f.to_string()), first) {
            (Ok(()), None) => {}
            (Err(e), Some(r)) => {
                prop_assert_eq!(e.features(), r.features);
                for f in r.features {
                    prop_assert!(e.to_string().contains(f.setting()));
                }
            }
            (got, want) => prop_assert!(false, "{:?} against {:?}", got, want),
        }
    }
}
