use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn set(features: &[Feature]) -> BTreeSet<Feature> {
    features.iter().copied().collect()
}

/// COMP-2: each row has two or three distinct features, and no row's features contain
/// another's, so every refusal is stated once and the order of the rows decides nothing.
#[test]
fn comp_2_every_refusal_is_stated_once() {
    for r in REFUSALS {
        let s = set(r.features);
        assert!(
            (2..=3).contains(&r.features.len()) && s.len() == r.features.len(),
            "{:?}",
            r.features
        );
        assert!(!r.reason.is_empty() && !r.instead.is_empty());
        for other in REFUSALS.iter().filter(|o| !std::ptr::eq(*o, r)) {
            assert!(
                !set(other.features).is_subset(&s),
                "{:?} is inside {:?}",
                other.features,
                r.features
            );
        }
    }
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
        set(&[Feature::AcrossProcesses, Feature::RollBack]),
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
fn the_matrix_marks_each_pair_row_both_ways_and_lists_every_row() {
    let m = matrix_markdown();
    assert_eq!(
        m.matches('✗').count(),
        2 * REFUSALS.iter().filter(|r| r.features.len() == 2).count()
    );
    for r in REFUSALS {
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
        let first = REFUSALS.iter().find(|r| r.features.iter().all(|f| features.contains(f)));
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
