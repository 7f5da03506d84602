//! The picture of `meshwork bench comm-efficiency --svg`: the loss (smoothed over the bench's
//! window) against wall time, one line per method, one panel per scenario, the target loss
//! dashed. Every panel shares the loss axis (logarithmic) so that the panels compare.

use std::fmt::Write;

use crate::comm_bench::{MethodRun, SMOOTH};

const PANEL_W: f64 = 430.0;
const PANEL_H: f64 = 300.0;
const LEFT: f64 = 64.0;
const TOP: f64 = 40.0;
const GAP: f64 = 70.0;
/// One colour per method (Tableau 10, then two more).
const PALETTE: [&str; 12] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f",
    "#e15759", "#17becf", "#7f7f7f", "#bcbd22",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The smoothed curve of a run: (seconds, loss).
fn smooth(curve: &[(f64, f32)]) -> Vec<(f64, f64)> {
    (0..curve.len())
        .map(|i| {
            let w = &curve[(i + 1).saturating_sub(SMOOTH)..=i];
            let l = w.iter().map(|(_, l)| f64::from(*l)).sum::<f64>() / w.len() as f64;
            (curve[i].0, l)
        })
        .collect()
}

/// The SVG document for `runs` (grouped by scenario, in their order; each scenario's target
/// dashed).
pub(crate) fn render(runs: &[MethodRun]) -> String {
    let mut scenarios: Vec<&str> = Vec::new();
    for r in runs {
        if !scenarios.contains(&r.scenario) {
            scenarios.push(r.scenario);
        }
    }
    let mut methods: Vec<&str> = Vec::new();
    for r in runs {
        if !methods.contains(&r.method.as_str()) {
            methods.push(&r.method);
        }
    }
    let colour = |m: &str| {
        let i = methods.iter().position(|x| *x == m).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    };
    let curves: Vec<Vec<(f64, f64)>> = runs.iter().map(|r| smooth(&r.curve)).collect();
    let positive = |l: f64| l.is_finite() && l > 0.0;
    let losses = curves
        .iter()
        .flatten()
        .map(|p| p.1)
        .filter(|l| positive(*l));
    let (lo, hi) = losses.fold((f64::INFINITY, 0.0f64), |(lo, hi), l| {
        (lo.min(l), hi.max(l))
    });
    let (lo, hi) = if lo < hi {
        let target = runs
            .iter()
            .map(|r| f64::from(r.target_loss))
            .filter(|t| positive(*t))
            .fold(lo, f64::min);
        ((target * 0.9).max(1e-12), hi * 1.1)
    } else {
        (1e-3, 1.0)
    };
    let panels = scenarios.len().max(1) as f64;
    let width = LEFT + panels * (PANEL_W + GAP);
    let legend_y = TOP + PANEL_H + 50.0;
    let height = legend_y + 22.0 * (methods.len().div_ceil(4) as f64) + 20.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{LEFT}" y="20" font-size="14">Loss (mean of {SMOOTH} steps, log scale) against wall time, 4 ranks</text>"#
    );
    let y_of = |l: f64| TOP + PANEL_H * (hi.ln() - l.max(lo).ln()) / (hi.ln() - lo.ln());
    for (p, scenario) in scenarios.iter().enumerate() {
        let x0 = LEFT + p as f64 * (PANEL_W + GAP);
        let t_max = runs
            .iter()
            .zip(&curves)
            .filter(|(r, _)| r.scenario == *scenario)
            .flat_map(|(_, c)| c.iter().map(|p| p.0))
            .fold(0.0f64, f64::max)
            .max(1e-3);
        let x_of = |t: f64| x0 + PANEL_W * t / t_max;
        let _ = writeln!(
            svg,
            r##"<rect x="{x0}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#888"/><text x="{x0}" y="{:.0}">{}</text>"##,
            TOP - 6.0,
            escape(scenario)
        );
        for k in 0..=4 {
            let t = t_max * k as f64 / 4.0;
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{t:.1} s</text>"#,
                x_of(t),
                TOP + PANEL_H + 16.0
            );
        }
        for k in 0..=4 {
            let l = (lo.ln() + (hi.ln() - lo.ln()) * k as f64 / 4.0).exp();
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{l:.3}</text>"#,
                x0 - 4.0,
                y_of(l) + 4.0
            );
        }
        let target = runs
            .iter()
            .find(|r| r.scenario == *scenario)
            .map_or(f64::NAN, |r| f64::from(r.target_loss));
        if positive(target) {
            let y = y_of(target);
            let _ = writeln!(
                svg,
                r##"<line x1="{x0}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#333" stroke-dasharray="5,4"/><text x="{:.1}" y="{:.1}" text-anchor="end">target</text>"##,
                x0 + PANEL_W,
                x0 + PANEL_W - 4.0,
                y - 4.0
            );
        }
        for (r, c) in runs.iter().zip(&curves) {
            if r.scenario != *scenario || c.is_empty() {
                continue;
            }
            let points: Vec<String> = c
                .iter()
                .filter(|p| positive(p.1))
                .map(|&(t, l)| format!("{:.1},{:.1}", x_of(t), y_of(l)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.6" points="{}"/>"#,
                colour(&r.method),
                points.join(" ")
            );
        }
    }
    for (i, m) in methods.iter().enumerate() {
        let x = LEFT + (i % 4) as f64 * 150.0;
        let y = legend_y + (i / 4) as f64 * 22.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{x}" y="{:.0}" width="14" height="4" fill="{}"/><text x="{:.0}" y="{y:.0}">{}</text>"#,
            y - 5.0,
            colour(m),
            x + 20.0,
            escape(m)
        );
    }
    svg.push_str("</svg>\n");
    svg
}
