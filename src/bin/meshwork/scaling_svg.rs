//! The picture of `meshwork bench dp --svg`: speed-up against devices on log–log axes, 1 to
//! 1,024: perfect scaling, Amdahl's curve for the serial fraction the run measured, and the
//! measured points (the job's samples/s over one plain Burn loop, and the machine's ceiling of
//! independent loops).

use std::fmt::Write;

use meshwork::scaling::Amdahl;

const W: f64 = 560.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const TOP: f64 = 40.0;
const PLOT_W: f64 = 440.0;
const PLOT_H: f64 = 300.0;
/// log2 of the largest device count and speed-up drawn.
const MAX_LOG2: f64 = 10.0;

fn x(devices: f64) -> f64 {
    LEFT + devices.max(1.0).log2().min(MAX_LOG2) / MAX_LOG2 * PLOT_W
}

fn y(speedup: f64) -> f64 {
    TOP + PLOT_H - speedup.max(1.0).log2().min(MAX_LOG2) / MAX_LOG2 * PLOT_H
}

/// The SVG document: `amdahl`'s curve, and `points` (label, devices, speed-up) measured.
pub(crate) fn render(amdahl: &Amdahl, points: &[(&str, f64, f64)]) -> String {
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" \
         font-family=\"sans-serif\" font-size=\"12\">\
         <rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>\
         <text x=\"{LEFT}\" y=\"22\" font-size=\"14\">Speed-up against devices: Amdahl's law \
         for serial fraction {:.3}</text>",
        amdahl.serial_fraction
    );
    for k in 0..=10u32 {
        let v = f64::from(1u32 << k);
        let _ = write!(
            svg,
            "<line x1=\"{0:.1}\" y1=\"{TOP}\" x2=\"{0:.1}\" y2=\"{1:.1}\" stroke=\"#eee\"/>\
             <text x=\"{0:.1}\" y=\"{2:.1}\" text-anchor=\"middle\">{3}</text>\
             <line x1=\"{LEFT}\" y1=\"{4:.1}\" x2=\"{5:.1}\" y2=\"{4:.1}\" stroke=\"#eee\"/>\
             <text x=\"{6:.1}\" y=\"{7:.1}\" text-anchor=\"end\">{3}</text>",
            x(v),
            TOP + PLOT_H,
            TOP + PLOT_H + 16.0,
            1u32 << k,
            y(v),
            LEFT + PLOT_W,
            LEFT - 6.0,
            y(v) + 4.0
        );
    }
    let _ = write!(
        svg,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">devices</text>\
         <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" \
         text-anchor=\"middle\">speed-up</text>",
        LEFT + PLOT_W / 2.0,
        H - 12.0,
        TOP + PLOT_H / 2.0,
        TOP + PLOT_H / 2.0
    );
    let curve = |f: &dyn Fn(f64) -> f64| -> String {
        (0..=100)
            .map(|i| {
                let n = 2f64.powf(f64::from(i) / 100.0 * MAX_LOG2);
                format!("{:.1},{:.1}", x(n), y(f(n)))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = write!(
        svg,
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#bbb\" stroke-dasharray=\"4 3\"/>\
         <polyline points=\"{}\" fill=\"none\" stroke=\"#4e79a7\" stroke-width=\"2\"/>",
        curve(&|n| n),
        curve(&|n| amdahl.speedup(n))
    );
    let mut legend = vec![
        ("#bbb", "perfect scaling".to_string()),
        (
            "#4e79a7",
            format!("Amdahl, s = {:.3}", amdahl.serial_fraction),
        ),
    ];
    let colours = ["#e15759", "#59a14f", "#f28e2b"];
    for (i, (label, devices, speedup)) in points.iter().enumerate() {
        let c = colours[i % colours.len()];
        let _ = write!(
            svg,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"5\" fill=\"{c}\"/>",
            x(*devices),
            y(*speedup)
        );
        legend.push((c, format!("{label}: {speedup:.2}× at {devices}")));
    }
    for (i, (c, text)) in legend.iter().enumerate() {
        let ly = TOP + 14.0 + 18.0 * i as f64;
        let _ = write!(
            svg,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{c}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            LEFT + 12.0,
            ly - 10.0,
            LEFT + 30.0,
            ly,
            text.replace('&', "&amp;").replace('<', "&lt;")
        );
    }
    svg.push_str("</svg>\n");
    svg
}
