//! A picture of a timeline: one row per stage, one box per forward or backward.

use std::fmt::Write as _;

use super::{Instr, TimedInstr};

const LABEL_WIDTH: f64 = 64.0;
const PLOT_WIDTH: f64 = 960.0;
const ROW_HEIGHT: f64 = 28.0;
const BOX_HEIGHT: f64 = 22.0;
const MARGIN: f64 = 4.0;
/// Forward colours for even and odd chunks.
const FORWARD: [&str; 2] = ["#4c78a8", "#9ecae9"];
/// Backward colours for even and odd chunks.
const BACKWARD: [&str; 2] = ["#f58518", "#ffbf79"];

/// An SVG picture of `timeline` (one list per stage, as in [`super::SimReport::timeline`] or
/// a measured step): stages as rows from the top, time left to right, one `<rect>` per
/// forward (blue) and backward (orange) with its micro-batch number inside; odd chunks of
/// interleaved schedules in lighter shades. Sends and receives are not drawn. Self-contained:
/// no scripts, no external fonts or styles.
pub fn render_svg(timeline: &[Vec<TimedInstr>]) -> String {
    let start = timeline
        .iter()
        .flatten()
        .map(|t| t.start)
        .min()
        .unwrap_or(0);
    let end = timeline
        .iter()
        .flatten()
        .map(|t| t.end)
        .max()
        .unwrap_or(start);
    let span = end.saturating_sub(start).max(1) as f64;
    let scale = PLOT_WIDTH / span;
    let width = LABEL_WIDTH + PLOT_WIDTH + 2.0 * MARGIN;
    let height = ROW_HEIGHT * timeline.len() as f64 + 2.0 * MARGIN;
    let mut svg = String::new();
    // Writing into a String cannot fail.
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    for (row, instrs) in timeline.iter().enumerate() {
        let y = MARGIN + ROW_HEIGHT * row as f64;
        let _ = writeln!(
            svg,
            r#"<text x="{MARGIN}" y="{ty}" dominant-baseline="middle">stage {row}</text>"#,
            ty = y + BOX_HEIGHT / 2.0
        );
        for timed in instrs {
            let (palette, kind) = match timed.instr {
                Instr::Forward { .. } => (FORWARD, "forward"),
                Instr::Backward { .. } => (BACKWARD, "backward"),
                _ => continue,
            };
            let chunk = timed.instr.chunk().0;
            let fill = palette[(chunk % 2) as usize];
            let x = MARGIN + LABEL_WIDTH + (timed.start - start) as f64 * scale;
            let w = (timed.end.saturating_sub(timed.start)) as f64 * scale;
            let mb = timed.instr.mb().0;
            let _ = writeln!(
                svg,
                r##"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{BOX_HEIGHT}" fill="{fill}" stroke="#ffffff" stroke-width="0.5"><title>{kind} micro-batch {mb} chunk {chunk}: {s}..{e}</title></rect>"##,
                s = timed.start,
                e = timed.end,
            );
            let _ = writeln!(
                svg,
                r#"<text x="{tx:.2}" y="{ty:.2}" text-anchor="middle" dominant-baseline="middle">{mb}</text>"#,
                tx = x + w / 2.0,
                ty = y + BOX_HEIGHT / 2.0,
            );
        }
    }
    svg.push_str("</svg>\n");
    svg
}
