//! Pipeline schedules as data: build GPipe, 1F1B and interleaved 1F1B for 4 stages and 8
//! micro-batches, simulate them, print the measured bubble and the peak stash, and draw each
//! timeline as an SVG picture.
//!
//! Run with `cargo run --example pipeline_schedules -- book/src/images` (the folder receives
//! `gpipe.svg`, `1f1b.svg` and `interleaved.svg`; without an argument nothing is written).

// ANCHOR: imports
use meshwork::parallel::pipeline::{Costs, Schedule, render_svg, simulate};
// ANCHOR_END: imports

// ANCHOR: main
fn main() -> meshwork::Result<()> {
    let stages = 4;
    let schedules = [
        Schedule::GPipe { micro_batches: 8 },
        Schedule::OneFOneB { micro_batches: 8 },
        Schedule::Interleaved {
            micro_batches: 8,
            virtual_stages: 2,
        },
    ];
    println!(
        "{:<12} {:>9} {:>11} {:>10} {:>10}",
        "schedule", "makespan", "bubble", "theory", "peak stash"
    );
    for schedule in &schedules {
        // One instruction list per stage: what each stage actor will execute, in order.
        let plan = schedule.instructions(stages)?;
        // A stage's layers cost 2 ticks forward and 4 backward; with v model chunks per stage
        // each chunk holds 1/v of them.
        let v = u64::from(schedule.virtual_stages());
        let report = simulate(&plan, &Costs::new(2 / v, 4 / v))?;
        println!(
            "{:<12} {:>9} {:>11.4} {:>10.4} {:>10}",
            schedule.name(),
            report.makespan,
            report.bubble,
            schedule.theoretical_bubble(stages),
            report.peak_stash()
        );
        if let Some(dir) = std::env::args().nth(1) {
            let path = std::path::Path::new(&dir).join(format!("{}.svg", schedule.name()));
            std::fs::write(&path, render_svg(&report.timeline)).map_err(|e| {
                meshwork::Error::Io {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
        }
    }
    Ok(())
}
// ANCHOR_END: main
