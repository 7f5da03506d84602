//! Planning a layout before renting the machines: a model's blocks with their measured
//! costs, a machine description, and `meshwork::planner::plan` ranking every layout by
//! predicted step time, with the bytes per device and why the others do not fit. Then
//! Amdahl's law for a run's serial fraction.
//!
//! Run with `cargo run --release --example plan`.

// ANCHOR: model
use meshwork::planner::{AlphaBeta, BlockCosts, Machine, ModelCosts, plan};
use meshwork::scaling::Amdahl;

/// Twelve equal transformer-like blocks of 7 M parameters each (half on each of 2
/// tensor-parallel ranks), as a profile of one device would give them.
fn model() -> ModelCosts {
    let block = BlockCosts {
        params: vec![(1, 7_000_000), (2, 3_500_000), (4, 1_750_000)],
        forward_s: 2.0e-3,
        forward_fixed_s: 0.2e-3,
        backward_s: 4.0e-3,
        backward_fixed_s: 0.4e-3,
        stash_bytes: 2 * 4 * 512 * 768,
        recompute_stash_bytes: 4 * 512 * 768,
        splits: true,
        tp_bytes: 2 * 4 * 512 * 768,
    };
    ModelCosts {
        name: "12 blocks of 7 M parameters".into(),
        blocks: vec![block; 12],
        tp_degrees: vec![1, 2, 4],
    }
}
// ANCHOR_END: model

fn main() {
    // ANCHOR: machine
    // Two nodes of 8 devices: a fast link inside a node, a slower one between nodes.
    let machine = Machine {
        devices: 16,
        devices_per_node: 8,
        cores: 16,
        memory_per_device: 1 << 30,
        link: AlphaBeta {
            alpha_s: 10e-6,
            bytes_per_s: 100e9,
        },
        inter_link: AlphaBeta {
            alpha_s: 20e-6,
            bytes_per_s: 12.5e9,
        },
        tp_wait: Vec::new(),
        replica_sync_s: 0.5e-3,
        optimizer_s_per_param: 1e-9,
        step_overhead_s: 1e-3,
        pipeline_send_s: (20e-6, 20e-6),
    };
    let ranked = plan(&model(), &machine, 64, &[2, 4, 8]);
    for (layout, verdict) in ranked.iter().take(5) {
        match verdict {
            Ok(p) => println!(
                "{layout}: {:.1} ms a step (bubble {:.2}), {:.0} MiB per device",
                p.step_s * 1e3,
                p.bubble,
                p.bytes.total() as f64 / 1048576.0
            ),
            Err(why) => println!("{layout}: {why}"),
        }
    }
    let unfit = ranked.iter().filter(|(_, v)| v.is_err()).count();
    println!("{unfit} of {} layouts do not fit", ranked.len());
    // ANCHOR_END: machine

    // ANCHOR: amdahl
    // A run of 4 ranks whose steps took 10 s in all, each rank computing 8 s of them.
    let amdahl = Amdahl::from_times(10.0, 8.0, 4).expect("a run with time");
    println!("{amdahl}");
    // ANCHOR_END: amdahl
}
