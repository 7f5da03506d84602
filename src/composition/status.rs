//! What works where: every capability in each place a job runs (one process, across
//! processes over TCP, on the MPI transport, on wgpu), each ✓ with the test that proves it, each ✗ with
//! why. The book's "What works where" page is [`status_markdown`]'s output (STATUS-1), and no
//! other page states a status (DOCS-1, in the suite's `docs` tests).
//!
//! - **STATUS-1**: the book's status page is [`status_markdown`]'s output, the FAQ's limits
//!   are [`limitations_markdown`]'s, and every test a ✓ names exists (a test reads the file
//!   for the function).
//! - **STATUS-2**: a cell agrees with the one refusal table: a capability with a
//!   [`Feature`] is [`Proof::Table`] in a place exactly when [`super::check`] refuses the
//!   feature there (a unit test walks every cell).

use std::collections::BTreeSet;

use super::{Feature, REFUSALS};

/// Where a job runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Several devices in one program (`Job::builder()`, `meshwork train --dp N`).
    OneProcess,
    /// A head and node processes over TCP (`meshwork train --listen`, `meshwork node`;
    /// feature `cluster`).
    AcrossProcesses,
    /// On the MPI transport, started by `mpirun` or Slurm's `srun` (`--transport mpi`,
    /// feature `mpi`).
    Mpi,
    /// On Burn's wgpu backend (feature `wgpu`).
    Wgpu,
}

impl Place {
    /// The columns, in order.
    pub const ALL: [Place; 4] = [
        Place::OneProcess,
        Place::AcrossProcesses,
        Place::Mpi,
        Place::Wgpu,
    ];

    fn header(self) -> &'static str {
        match self {
            Place::OneProcess => "one process",
            Place::AcrossProcesses => "across processes",
            Place::Mpi => "MPI (mpirun / srun)",
            Place::Wgpu => "wgpu",
        }
    }

    /// The features a job in this place has, for the refusal table.
    fn features(self) -> &'static [Feature] {
        match self {
            Place::OneProcess | Place::Wgpu => &[],
            Place::AcrossProcesses => &[Feature::AcrossProcesses],
            Place::Mpi => &[Feature::AcrossProcesses, Feature::MpiTransport],
        }
    }
}

/// What a cell says, and what backs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// A test trains it there and checks the result: `tests/FILE.rs::function`.
    Test(&'static str),
    /// Refused there by the one refusal table (the row is found from the capability's
    /// feature and the place).
    Table,
    /// Refused there by a check of its own, with why.
    Refused(&'static str),
    /// Neither tested nor refused: it may work, and nothing proves it.
    Untested,
}

/// One row of the status page.
#[derive(Debug, Clone, Copy)]
pub struct Capability {
    /// What a user calls it.
    pub name: &'static str,
    /// The book chapter (and anchor) that explains it.
    pub chapter: &'static str,
    /// Its feature in the refusal table, if it has one.
    pub feature: Option<Feature>,
    /// One proof per [`Place::ALL`] column.
    pub proofs: [Proof; 4],
}

use Proof::{Refused, Table, Test, Untested};

const fn cap(
    name: &'static str,
    chapter: &'static str,
    feature: Option<Feature>,
    proofs: [Proof; 4],
) -> Capability {
    Capability {
        name,
        chapter,
        feature,
        proofs,
    }
}

// Tests and reasons that prove or explain more than one cell.
const GPT_OVER_MPI: &str = "tests/cluster/cluster_mpi.rs::gpt_dp_pp_tp_over_mpi_equals_its_single_process_run_and_one_device";
const GPT_ACROSS: &str = "tests/cluster/cluster_tensor.rs::gpt_dp_pp_tp_across_node_processes_equals_its_single_process_run_and_one_device";
const RECIPE_FILE_ACROSS: &str = "tests/cluster/cluster_config.rs::the_recipe_from_a_file_trains_across_node_processes_as_in_one_process";
const RECIPE_FILE_OVER_MPI: &str = "tests/cluster/cluster_mpi.rs::the_books_recipe_file_under_mpirun_equals_its_single_process_run";
const DP_AND_ZERO_3_OVER_MPI: &str = "tests/cluster/cluster_mpi.rs::dp_and_zero_3_over_mpi_equal_their_single_process_runs_and_one_device";
const EVERY_SCHEDULE: &str =
    "tests/suite/pipeline.rs::pp_2_and_4_every_schedule_and_micro_batch_count_match_one_device";
const PRECISION_ACROSS: &str = "tests/cluster/cluster_training.rs::bf16_and_f16_across_three_node_processes_equal_their_single_process_run";
const SLOW_LINKS_ACROSS: &str = "tests/cluster/cluster_training.rs::compression_and_local_updates_across_three_node_processes_equal_their_single_process_run";
const LOST_ON_MPI: &str = "a lost process ends an MPI job (MPI's world cannot lose a rank); the same command resumes from the last checkpoint";
const FIXED_LAYOUT: &str =
    "a block or pipeline job across processes keeps the layout it started with";

/// Every capability, each place's proof.
pub const CAPABILITIES: &[Capability] = &[
    cap(
        "Data parallel",
        "data-parallel.md",
        None,
        [
            Test("tests/suite/data_parallel.rs::dp_1_2_4_match_single_device_with_sgd"),
            Test(
                "tests/cluster/cluster_training.rs::dp_3_across_three_node_processes_equals_the_single_device_reference",
            ),
            Test(DP_AND_ZERO_3_OVER_MPI),
            Test("tests/wgpu.rs::dp_2_on_wgpu_matches_single_wgpu_device"),
        ],
    ),
    cap(
        "Pipeline parallel (1F1B, interleaved 1F1B)",
        "pipeline-schedules.md",
        Some(Feature::Pipeline),
        [
            Test(EVERY_SCHEDULE),
            Test(
                "tests/cluster/cluster_training.rs::dp_2_pp_2_across_four_node_processes_equals_the_single_device_reference",
            ),
            Test(GPT_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "The GPipe schedule",
        "pipeline-schedules.md",
        None,
        [Test(EVERY_SCHEDULE), Untested, Untested, Untested],
    ),
    cap(
        "Tensor parallel",
        "tensor-parallel.md",
        Some(Feature::TensorParallel),
        [
            Test("tests/suite/tensor_parallel.rs::tp2_equals_one_device"),
            Test(GPT_ACROSS),
            Test(GPT_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "dp × pp × tp",
        "tensor-parallel.md",
        None,
        [
            Test("tests/suite/tensor_parallel.rs::dp2_pp2_tp2_equals_one_device"),
            Test(GPT_ACROSS),
            Test(GPT_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "The transformer recipe (dp × pp × tp, ZeRO-1, bf16, clipping, accumulation, warm-up/cosine)",
        "recipe.md",
        None,
        [
            Test("tests/suite/tensor_parallel.rs::the_recipe_in_f32_equals_one_device"),
            Test(RECIPE_FILE_ACROSS),
            Test(RECIPE_FILE_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "ZeRO-1 (optimizer state sharded)",
        "zero.md",
        Some(Feature::Zero),
        [
            Test("tests/suite/zero.rs::zero_1_with_adam_at_dp_2_3_4_matches_one_device"),
            Test(RECIPE_FILE_ACROSS),
            Test(RECIPE_FILE_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "ZeRO-2 (gradients sharded too)",
        "zero.md",
        Some(Feature::ZeroGradients),
        [
            Test(
                "tests/suite/zero.rs::zero_2_with_adam_at_dp_2_3_4_matches_one_device_and_plain_data_parallel",
            ),
            Test(
                "tests/cluster/cluster_training.rs::zero_2_across_three_node_processes_equals_the_single_device_reference",
            ),
            Untested,
            Untested,
        ],
    ),
    cap(
        "ZeRO-3 / FSDP (parameters sharded too)",
        "memory.md",
        Some(Feature::ZeroParameters),
        [
            Test(
                "tests/suite/fsdp.rs::fsdp_1_zero_3_at_dp_2_3_4_matches_one_device_with_every_optimizer",
            ),
            Test(
                "tests/cluster/cluster_training.rs::zero_3_across_three_node_processes_hands_back_the_whole_model_equal_to_one_device",
            ),
            Test(DP_AND_ZERO_3_OVER_MPI),
            Test("tests/wgpu.rs::zero_3_blocks_on_wgpu_match_plain_data_parallel"),
        ],
    ),
    cap(
        "Mixed precision (bf16, f16)",
        "memory.md#mixed-precision",
        Some(Feature::Bf16),
        [
            Test("tests/suite/precision.rs::bf16_and_f16_track_the_f32_loss_on_the_demo_mlp"),
            Test(PRECISION_ACROSS),
            Test(RECIPE_FILE_OVER_MPI),
            Test("tests/wgpu.rs::mixed_precision_on_wgpu_tracks_f32_or_is_refused"),
        ],
    ),
    cap(
        "16-bit gradients",
        "memory.md#mixed-precision",
        Some(Feature::LowPrecisionGradients),
        [
            Test(
                "tests/suite/tensor_parallel.rs::sixteen_bit_gradients_over_blocks_and_pipelines_equal_one_device",
            ),
            Test(PRECISION_ACROSS),
            Untested,
            Untested,
        ],
    ),
    cap(
        "Gradient clipping (global norm)",
        "data-parallel.md",
        Some(Feature::ClipGradNorm),
        [
            Test("tests/suite/data_parallel.rs::global_norm_clipping_matches_reference"),
            Test(
                "tests/cluster/cluster_training.rs::f16_and_clipping_in_a_pipeline_across_processes_equal_the_single_process_run",
            ),
            Test(RECIPE_FILE_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "Gradient accumulation",
        "data-parallel.md",
        Some(Feature::GradientAccumulation),
        [
            Test(
                "tests/suite/data_parallel.rs::accumulation_over_4_micro_batches_matches_one_big_batch",
            ),
            Test(
                "tests/cluster/cluster_training.rs::accumulation_and_compression_in_a_pipeline_across_processes_equal_the_single_process_run",
            ),
            Test(RECIPE_FILE_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "Learning-rate schedules (warm-up/cosine)",
        "recipe.md",
        Some(Feature::LrSchedule),
        [
            Test(
                "tests/suite/scheduler.rs::lr_2_a_resumed_warm_up_cosine_run_equals_the_uninterrupted_one",
            ),
            Test(
                "tests/cluster/cluster_training.rs::a_learning_rate_schedule_across_processes_equals_its_single_process_run",
            ),
            Test(RECIPE_FILE_OVER_MPI),
            Untested,
        ],
    ),
    cap(
        "Gradient compression (bf16, top-k, PowerSGD)",
        "slow-links.md",
        Some(Feature::Compression),
        [
            Test(
                "tests/suite/compression.rs::each_compressor_converges_near_plain_data_parallel_with_fewer_bytes",
            ),
            Test(SLOW_LINKS_ACROSS),
            Untested,
            Untested,
        ],
    ),
    cap(
        "Local updates (local SGD, DiLoCo, EASGD)",
        "slow-links.md",
        Some(Feature::LocalUpdates),
        [
            Test(
                "tests/suite/local_updates.rs::local_sgd_diloco_and_easgd_converge_near_synchronous_data_parallel",
            ),
            Test(SLOW_LINKS_ACROSS),
            Untested,
            Untested,
        ],
    ),
    cap(
        "Parameter server (staleness bound, backup workers)",
        "slow-links.md",
        Some(Feature::ParameterServer),
        [
            Test(
                "tests/suite/parameter_server.rs::ssp_0_equals_data_parallel_and_one_device_bitwise_twice",
            ),
            Test(
                "tests/cluster/cluster_training.rs::the_parameter_server_across_three_node_processes_equals_its_single_process_run",
            ),
            Untested,
            Untested,
        ],
    ),
    cap(
        "Checkpoints and resume",
        "failures.md#checkpoints",
        Some(Feature::Checkpoints),
        [
            Test(
                "tests/suite/checkpoints.rs::ckpt_every_2_steps_keeps_the_newest_2_and_a_resumed_run_equals_the_uninterrupted_one",
            ),
            Test(
                "tests/cluster/cluster_training.rs::nodes_stop_when_the_head_dies_and_a_new_head_resumes_from_its_checkpoint",
            ),
            Test(
                "tests/cluster/cluster_slurm.rs::slurm_starts_jobs_on_both_transports_and_requeues_a_killed_one_to_the_same_end",
            ),
            Untested,
        ],
    ),
    cap(
        "Recovery: shrink away a lost replica",
        "failures.md#recovery-without-restarting",
        None,
        [
            Test(
                "tests/suite/faults.rs::rec_1_a_killed_device_is_dropped_and_its_share_is_redone_by_the_survivors",
            ),
            Test(
                "tests/cluster/cluster_training.rs::a_node_killed_mid_run_is_named_and_the_job_shrinks_and_finishes",
            ),
            Refused(LOST_ON_MPI),
            Untested,
        ],
    ),
    cap(
        "Recovery: replace a lost pipeline stage from its twin",
        "failures.md#recovery-without-restarting",
        None,
        [
            Test(
                "tests/suite/pipeline.rs::rec_6_a_lost_stage_is_replaced_from_its_twin_and_training_equals_one_device",
            ),
            Test(
                "tests/cluster/cluster_training.rs::a_lost_pipeline_stage_is_replaced_on_a_spare_from_its_twin_and_the_job_ends_as_an_uninterrupted_one",
            ),
            Refused(LOST_ON_MPI),
            Untested,
        ],
    ),
    cap(
        "Recovery: roll back to the last checkpoint",
        "failures.md#recovery-without-restarting",
        Some(Feature::RollBack),
        [
            Test(
                "tests/suite/faults.rs::rec_5_a_lost_replica_is_replaced_and_the_job_rolls_back_to_its_checkpoint_in_place",
            ),
            Test(
                "tests/cluster/cluster_rollback.rs::a_killed_tensor_parallel_node_rolls_back_onto_a_spare_and_ends_as_an_uninterrupted_run",
            ),
            Table,
            Untested,
        ],
    ),
    cap(
        "Elastic resizing of data-parallel jobs",
        "failures.md#elasticity",
        None,
        [
            Test(
                "tests/suite/faults.rs::elastic_1_growing_and_shrinking_at_step_boundaries_equals_the_reference",
            ),
            Test(
                "tests/cluster/cluster_training.rs::a_node_joining_a_running_job_becomes_a_replica_and_trains",
            ),
            Refused("MPI's world is the job's: a process outside it is refused when it joins"),
            Untested,
        ],
    ),
    cap(
        "Elastic resizing of block and pipeline jobs (along dp)",
        "failures.md#elasticity",
        Some(Feature::Blocks),
        [
            Test(
                "tests/suite/tensor_parallel/elastic.rs::elastic_6_block_and_pipeline_jobs_resize_along_dp_and_equal_one_device",
            ),
            Refused(FIXED_LAYOUT),
            Refused(FIXED_LAYOUT),
            Untested,
        ],
    ),
    cap(
        "Fault plans (slow, panic, kill, resize)",
        "fault-injection.md",
        Some(Feature::FaultPlan),
        [
            Test(
                "tests/suite/faults.rs::fault_2_the_same_plan_gives_the_same_events_and_bitwise_equal_parameters",
            ),
            Test(
                "tests/cluster/cluster_training.rs::a_fault_plan_is_carried_out_by_the_nodes_and_replays_the_single_process_run",
            ),
            Untested,
            Untested,
        ],
    ),
    cap(
        "Message faults (delay, drop, corrupt)",
        "fault-injection.md",
        Some(Feature::MessageFaults),
        [
            Test(
                "tests/suite/faults.rs::rec_4_a_dropped_message_is_detected_and_the_step_is_retried_by_everyone",
            ),
            Table,
            Table,
            Untested,
        ],
    ),
    cap(
        "Straggler detection",
        "failures.md",
        None,
        [
            Test(
                "tests/suite/faults.rs::a_slow_device_slows_its_replica_and_training_still_equals_the_reference",
            ),
            Untested,
            Untested,
            Untested,
        ],
    ),
    cap(
        "A job as a file (`--config`)",
        "job-files.md",
        None,
        [
            Test(
                "tests/suite/job_files.rs::conf_1_a_description_read_from_toml_trains_the_job_its_setters_built",
            ),
            Test(RECIPE_FILE_ACROSS),
            Test(RECIPE_FILE_OVER_MPI),
            Untested,
        ],
    ),
];

/// The table's refusal of `feature` in `place`, if any.
pub fn table_refusal(feature: Feature, place: Place) -> Option<&'static super::Refusal> {
    let mut features: BTreeSet<Feature> = place.features().iter().copied().collect();
    features.insert(feature);
    let features = super::closure(&features);
    let place_alone = super::closure(&place.features().iter().copied().collect());
    // Rows with a `without` refuse a feature alone (a roll-back without checkpoints),
    // whatever the place: they are not a place's status.
    REFUSALS
        .iter()
        .find(|r| r.without.is_empty() && r.applies(&features) && !r.applies(&place_alone))
}

fn cell(proof: Proof) -> &'static str {
    match proof {
        Test(_) => "✓",
        Table | Refused(_) => "✗",
        Untested => "untested",
    }
}

/// The status page's body (STATUS-1): the table, then each capability's proofs.
pub fn status_markdown() -> String {
    let mut out = super::table_head("capability", Place::ALL.map(Place::header));
    for c in CAPABILITIES {
        out.push_str(&format!("| [{}]({}) |", c.name, c.chapter));
        for proof in c.proofs {
            out.push_str(&format!(" {} |", cell(proof)));
        }
        out.push('\n');
    }
    out.push_str("\nWhat proves each cell:\n\n");
    for c in CAPABILITIES {
        out.push_str(&format!("- **{}**:", c.name));
        let mut parts = Vec::new();
        for (place, proof) in Place::ALL.into_iter().zip(c.proofs) {
            let text = match proof {
                Test(test) => format!("{}: `{test}`", place.header()),
                Table => match c.feature.and_then(|f| table_refusal(f, place)) {
                    Some(r) => format!("{}: refused, {} ({})", place.header(), r.reason, r.instead),
                    None => format!("{}: refused by the table", place.header()),
                },
                Refused(why) => format!("{}: refused, {why}", place.header()),
                Untested => continue,
            };
            parts.push(text);
        }
        out.push_str(&format!(" {}.\n", parts.join("; ")));
    }
    out
}

/// The FAQ's list of limits (STATUS-1): every ✗ with why, then every place where a capability
/// is untested.
pub fn limitations_markdown() -> String {
    let mut refused = String::new();
    let mut untested = String::new();
    for c in CAPABILITIES {
        let mut places = Vec::new();
        for (place, proof) in Place::ALL.into_iter().zip(c.proofs) {
            let why = match proof {
                Table => c
                    .feature
                    .and_then(|f| table_refusal(f, place))
                    .map_or("refused by the table of combinations", |r| r.reason),
                Refused(why) => why,
                Untested => {
                    places.push(place.header());
                    continue;
                }
                Test(_) => continue,
            };
            refused.push_str(&format!("- **{}**, {}: {why}.\n", c.name, place.header()));
        }
        if !places.is_empty() {
            untested.push_str(&format!("- **{}**: {}.\n", c.name, places.join(", ")));
        }
    }
    format!(
        "Not available:\n\n{refused}\nNot tested (no test runs it there, and nothing refuses \
         it):\n\n{untested}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// STATUS-2: a cell is `Table` exactly when the table refuses its feature there.
    #[test]
    fn status_2_every_cell_agrees_with_the_refusal_table() {
        for c in CAPABILITIES {
            for (place, proof) in Place::ALL.into_iter().zip(c.proofs) {
                let refused = c.feature.and_then(|f| table_refusal(f, place));
                assert_eq!(
                    proof == Table,
                    refused.is_some(),
                    "{} in {place:?}: the cell says {proof:?}, the table {}",
                    c.name,
                    refused.map_or("combines".into(), |r| r.reason.to_string())
                );
            }
        }
    }

    #[test]
    fn every_test_is_named_as_file_and_function() {
        for c in CAPABILITIES {
            for proof in c.proofs {
                if let Test(t) = proof {
                    let (file, function) = t.split_once("::").expect("file::function");
                    assert!(file.starts_with("tests/") && file.ends_with(".rs"), "{t}");
                    assert!(!function.is_empty() && !function.contains("::"), "{t}");
                }
            }
        }
    }
}
