//! The planner's profiler through the embedding API (`meshwork::job::profile`): a user's
//! blocks, measured on one device, give the planner the parameters and stashed bytes the
//! workers themselves count (MEM-1), so a plan's bytes per device are the job's.

use std::time::Duration;

use burn::tensor::Device;
use meshwork::demo::{TeacherTask, mlp_blocks};
use meshwork::error::Error;
use meshwork::job::{BlockOptions, ProfileRuns, profile};
use meshwork::planner::{AlphaBeta, Candidate, Machine, predict};

const WIDTHS: [usize; 4] = [8, 16, 12, 4];

fn blocks(
    options: BlockOptions,
) -> meshwork::Result<meshwork::job::PipelineStages<meshwork::demo::Sample>> {
    let device = Device::flex();
    device.seed(3);
    mlp_blocks(&WIDTHS, options, &device)
        .ok_or_else(|| Error::InvalidConfig("two widths at least".into()))
}

fn data() -> meshwork::data::InMemoryDataset<meshwork::demo::Sample> {
    TeacherTask {
        d_in: 8,
        d_out: 4,
        noise: 0.1,
        seed: 1,
    }
    .dataset(256)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_counts_each_blocks_parameters_and_stash_as_the_workers_do() {
    let runs = ProfileRuns {
        batch: 8,
        small_batch: 2,
        steps: 3,
    };
    let profiled = tokio::time::timeout(
        Duration::from_secs(300),
        profile("mlp", blocks, data(), runs),
    )
    .await
    .expect("the profile finishes within 300 s")
    .expect("the MLP profiles");
    let costs = &profiled.costs;
    assert_eq!(costs.blocks.len(), WIDTHS.len() - 1);
    assert_eq!(costs.tp_degrees, vec![1]);
    let last = WIDTHS.len() - 2;
    for (b, (block, w)) in costs.blocks.iter().zip(WIDTHS.windows(2)).enumerate() {
        assert_eq!(
            block.params,
            vec![(1, (w[0] * w[1] + w[1]) as u64)],
            "block {b}"
        );
        // A block keeps its input and its output until its backward (the last one's output
        // is the loss), a recomputing block its input only: f32 words.
        let input = 4 * w[0] as u64;
        let kept = if b == last {
            input
        } else {
            input + 4 * w[1] as u64
        };
        assert_eq!(block.stash_bytes, kept, "block {b}");
        assert_eq!(block.recompute_stash_bytes, input, "block {b}");
        for t in [
            block.forward_s,
            block.forward_fixed_s,
            block.backward_s,
            block.backward_fixed_s,
        ] {
            assert!(t.is_finite() && t >= 0.0, "block {b}: {block:?}");
        }
    }
    assert!(profiled.optimizer_s_per_param.is_finite() && profiled.optimizer_s_per_param > 0.0);
    // The plan of one device holds what the profile counted: every parameter, its gradient,
    // Adam's two moments, each block's stash for the whole batch.
    let machine = Machine {
        devices: 1,
        devices_per_node: 0,
        cores: 1,
        memory_per_device: 1 << 30,
        link: AlphaBeta::default(),
        inter_link: AlphaBeta::default(),
        tp_wait: Vec::new(),
        replica_sync_s: 0.0,
        optimizer_s_per_param: profiled.optimizer_s_per_param,
        step_overhead_s: profiled.step_overhead_s,
        pipeline_send_s: (0.0, 0.0),
    };
    let p = predict(costs, &machine, &Candidate::ONE_DEVICE, 8).expect("one device fits");
    let params: u64 = WIDTHS.windows(2).map(|w| (w[0] * w[1] + w[1]) as u64).sum();
    assert_eq!(p.bytes.params, 4 * params);
    assert_eq!(p.bytes.grads, 4 * params);
    assert_eq!(p.bytes.optimizer, 8 * params);
    let stash: u64 = costs.blocks.iter().map(|b| b.stash_bytes).sum();
    assert_eq!(p.bytes.activations, 8 * stash);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profile_refuses_sizes_that_cannot_fit_a_line() {
    for (batch, small_batch, steps) in [(8, 8, 3), (8, 0, 3), (8, 2, 2)] {
        let runs = ProfileRuns {
            batch,
            small_batch,
            steps,
        };
        let err = profile("mlp", blocks, data(), runs)
            .await
            .expect_err("refused");
        assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    }
}
