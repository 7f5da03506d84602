//! CONF-1 and CONF-2: every field round-trips through TOML, JSON and the control plane's
//! bincode; a bad key or value is refused naming its path.

use std::time::Duration;

use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamConfig, AdamWConfig};

use super::*;
use crate::comm::Algorithm;
use crate::comm::emulate::LinkEmulation;
use crate::faults::{Fault, FaultKind, FaultPlan, Phase};
use crate::parallel::parameter_server::Staleness;
use crate::recovery::RecoveryPolicy;

/// A description with every field away from its default.
pub(crate) fn everything() -> JobConfig {
    let mut c = JobConfig {
        seed: 7,
        steps: 40,
        batch_size: Some(96),
        data_parallel: 3,
        tensor_parallel: 2,
        pipeline: Some(PipelineConfig {
            stages: 2,
            schedule: Schedule::Interleaved {
                micro_batches: 4,
                virtual_stages: 2,
            },
        }),
        recompute: true,
        blocks_in_flight: 2,
        accumulation: 2,
        optimizer: OptimizerConfig::AdamW(
            AdamWConfig::new()
                .with_beta_2(0.95)
                .with_grad_clipping(Some(GradientClippingConfig::Norm(1.5))),
        ),
        learning_rate: 3e-3,
        lr_schedule: LrSchedule::WarmupCosine {
            warmup: 5,
            total: Some(40),
        },
        clip_norm: Some(1.0),
        non_finite: NonFinitePolicy::Skip,
        precision: PrecisionConfig {
            compute: Precision::Bf16,
            low_precision_gradients: true,
            loss_scaler: LossScalerConfig {
                growth_interval: 100,
                ..Default::default()
            },
        },
        reduction: ReductionConfig {
            zero: ZeroStage::Two,
            compression: Compression::TopK { fraction: 0.25 },
            local_updates: Some(LocalUpdates::LocalSgd { every: 4 }),
            parameter_server: Some(ParameterServer::new(Staleness::Bounded(2))),
            backup_workers: Some(1),
            bucket_bytes: 4096,
        },
        step_timeout: Duration::from_millis(90_500),
        checkpoints: CheckpointConfig {
            dir: Some("ckpt".into()),
            every: Some(10),
            keep: 2,
            resume: true,
            require: true,
        },
        fault_tolerance: FaultTolerance::new()
            .recovery(RecoveryPolicy::shrink().or_roll_back())
            .elastic(2, 6)
            .elastic_wait(Duration::from_secs(30))
            .fault_plan(FaultPlan {
                seed: 3,
                faults: vec![Fault {
                    device: 1,
                    step: 5,
                    micro_batch: None,
                    phase: Phase::Backward,
                    kind: FaultKind::Stall { seconds: 2.5 },
                }],
            }),
        stragglers: None,
        transport: DataTransport::Mpi,
        event_capacity: 64,
        ..JobConfig::default()
    };
    c.comm.algorithm = Algorithm::Ring;
    c.comm.timeout = Duration::from_millis(2500);
    c.comm.verify_payloads = true;
    c.comm.link = Some(LinkEmulation {
        bandwidth: 1e9,
        latency: Duration::from_micros(50),
        slow: Vec::new(),
    });
    c.comm.partial_sums = crate::comm::PartialSums::Narrow;
    c
}

#[test]
fn conf_1_every_field_round_trips_through_toml_json_and_bincode() {
    let c = everything();
    let toml = c.to_toml().expect("writes");
    assert_eq!(
        JobConfig::from_toml(&toml).expect("reads back"),
        c,
        "{toml}"
    );
    let json = c.to_json().expect("writes");
    assert_eq!(
        JobConfig::from_json(&json).expect("reads back"),
        c,
        "{json}"
    );
    let bytes = bincode::serde::encode_to_vec(&c, bincode::config::standard()).expect("encodes");
    let (back, _): (JobConfig, usize) =
        bincode::serde::decode_from_slice(&bytes, bincode::config::standard()).expect("decodes");
    assert_eq!(back, c);
    // Not vacuous: every section differs from the default.
    assert_ne!(c, JobConfig::default());
    let default = JobConfig::default();
    assert_eq!(
        JobConfig::from_toml(&default.to_toml().expect("writes")).expect("reads"),
        default
    );
}

#[test]
fn conf_1_an_empty_file_is_the_default_and_keys_left_out_keep_it() {
    assert_eq!(
        JobConfig::from_toml("").expect("reads"),
        JobConfig::default()
    );
    let c =
        JobConfig::from_toml("steps = 5\noptimizer = { Adam = {} }\n[reduction]\nzero = \"One\"\n")
            .expect("reads");
    assert_eq!(c.steps, 5);
    assert_eq!(c.reduction.zero, ZeroStage::One);
    assert_eq!(c.reduction.bucket_bytes, DEFAULT_BUCKET_BYTES);
    assert_eq!(c.optimizer, OptimizerConfig::Adam(AdamConfig::new()));
    assert_eq!(c.stragglers, Some(StragglerDetection::default()));
    let off = JobConfig::from_toml("stragglers = \"off\"\nstep_timeout = \"2m\"").expect("reads");
    assert_eq!(off.stragglers, None);
    assert_eq!(off.step_timeout, Duration::from_secs(120));
}

/// The key a refused text names, and its reason.
fn refused(text: &str) -> (String, String) {
    match JobConfig::from_toml(text) {
        Err(ConfigError::Key { key, reason }) => (key, reason),
        other => panic!("{text}: expected a key error, got {other:?}"),
    }
}

#[test]
fn conf_2_unknown_keys_wrong_types_and_bad_values_name_the_key() {
    let (key, reason) = refused("[reduction]\nzeroo = \"One\"");
    assert_eq!(key, "reduction.zeroo");
    assert!(
        reason.contains("unknown field `zeroo`") && reason.contains("`zero`"),
        "{reason}"
    );
    let (key, reason) = refused("steps = \"many\"");
    assert_eq!(key, "steps");
    assert!(reason.contains("invalid type"), "{reason}");
    let (key, reason) = refused("[reduction]\nzero = \"Four\"");
    assert_eq!(key, "reduction.zero");
    assert!(reason.contains("`Three`"), "the accepted values: {reason}");
    let (key, reason) = refused("step_timeout = \"soon\"");
    assert_eq!(key, "step_timeout");
    assert!(reason.contains("250ms"), "{reason}");
    let (key, reason) = refused("optimizer = { Adam = { beta1 = 0.8 } }");
    assert!(key.starts_with("optimizer"), "{key}");
    assert!(reason.contains("beta_1"), "{reason}");
    // Inside an enumeration's variant and a default-on table too.
    let (key, reason) = refused("lr_schedule = { WarmupCosine = { warmup = 10, totl = 200 } }");
    assert!(key.starts_with("lr_schedule"), "{key}");
    assert!(reason.contains("unknown field `totl`"), "{reason}");
    let (key, reason) = refused("[stragglers]\nwindw = 3");
    assert_eq!(key, "stragglers.windw");
    assert!(reason.contains("`window`"), "{reason}");
    // Only the f32 settings are shortened: an f64 keeps its bits.
    let c = JobConfig {
        learning_rate: f64::from(0.1f32),
        ..JobConfig::default()
    };
    assert_eq!(
        JobConfig::from_toml(&c.to_toml().expect("writes")).expect("reads"),
        c
    );
    assert!(matches!(
        JobConfig::from_toml("steps = "),
        Err(ConfigError::Syntax { .. })
    ));
    assert!(matches!(
        JobConfig::from_json("{\"steps\": 1} trailing"),
        Err(ConfigError::Syntax { .. })
    ));
}

#[test]
fn conf_1_the_optimizer_file_form_holds_burns_defaults() {
    for (text, burn) in [
        (
            "optimizer = { Sgd = {} }",
            OptimizerConfig::Sgd(burn::optim::SgdConfig::new()),
        ),
        (
            "optimizer = { Adam = {} }",
            OptimizerConfig::Adam(AdamConfig::new()),
        ),
        (
            "optimizer = { AdamW = {} }",
            OptimizerConfig::AdamW(AdamWConfig::new()),
        ),
    ] {
        assert_eq!(JobConfig::from_toml(text).expect("reads").optimizer, burn);
    }
}

proptest::proptest! {
    /// A planned layout's description holds the layout and nothing else changes: the mesh,
    /// ZeRO stage and recomputation are the candidate's, a pipeline runs the planner's
    /// schedule over its micro-batches, and it reads back from TOML as it is.
    #[test]
    fn conf_1_a_planned_layout_is_a_description(
        dp in 1u32..8, pp in 1u32..5, tp in 1u32..5, zero in 0u8..4,
        micro in 1u32..9, recompute: bool, extra in 0u32..3,
    ) {
        let layout = crate::planner::Candidate { dp, pp, tp, zero, micro_batches: micro, recompute };
        let blocks = pp * (1 + extra);
        let base = JobConfig { steps: 7, ..JobConfig::default() };
        let c = base.clone().with_layout(&layout, blocks);
        proptest::prop_assert_eq!((c.data_parallel, c.tensor_parallel), (dp, tp));
        proptest::prop_assert_eq!(c.reduction.zero.number(), zero);
        proptest::prop_assert_eq!(c.recompute, recompute);
        match c.pipeline {
            None => proptest::prop_assert_eq!(pp, 1),
            Some(p) => {
                proptest::prop_assert_eq!(p.stages, pp);
                proptest::prop_assert_eq!(p.schedule.micro_batches(), micro);
                proptest::prop_assert_eq!(p.schedule, crate::planner::pipeline_schedule(&layout, blocks));
            }
        }
        proptest::prop_assert_eq!(c.steps, base.steps);
        let text = c.to_toml().expect("writes");
        proptest::prop_assert_eq!(JobConfig::from_toml(&text).expect("reads"), c);
    }
}
