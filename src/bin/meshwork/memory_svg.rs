//! The picture of `meshwork bench memory --svg`: one rank's bytes over one step, as stacked
//! areas (parameters, gradients, optimizer state, activations), one panel per configuration,
//! every panel on the same byte scale so their heights compare.

use std::fmt::Write;

/// One rank's holding at one moment of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Point {
    /// Time since the step began, in milliseconds.
    pub(crate) t_ms: f64,
    /// Parameter bytes (full blocks materialised plus shards).
    pub(crate) params: u64,
    /// Gradient bytes.
    pub(crate) grads: u64,
    /// Optimizer-state bytes.
    pub(crate) optimizer: u64,
    /// Activation bytes kept for backward.
    pub(crate) activations: u64,
}

impl Point {
    fn layers(&self) -> [u64; 4] {
        [self.params, self.grads, self.optimizer, self.activations]
    }
}

/// One panel: a title and the step's points in time order.
#[derive(Debug, Clone)]
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) points: Vec<Point>,
}

const WIDTH: f64 = 720.0;
const PANEL_H: f64 = 200.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 28.0;
const GAP: f64 = 48.0;
const NAMES: [&str; 4] = ["parameters", "gradients", "optimizer state", "activations"];
const COLOURS: [&str; 4] = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1"];

/// The SVG document drawing `panels`, stacked vertically.
pub(crate) fn render(panels: &[Panel]) -> String {
    let top = panels
        .iter()
        .flat_map(|p| p.points.iter())
        .map(|p| p.layers().iter().sum::<u64>())
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let height = TOP + panels.len() as f64 * (PANEL_H + GAP) + 10.0;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        svg,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    let plot_w = WIDTH - LEFT - RIGHT;
    for (i, panel) in panels.iter().enumerate() {
        let y0 = TOP + i as f64 * (PANEL_H + GAP);
        let base = y0 + PANEL_H;
        let _ = write!(
            svg,
            r#"<text x="{LEFT}" y="{}" font-weight="bold">{}</text>"#,
            y0 - 8.0,
            escape(&panel.title)
        );
        let span = panel
            .points
            .last()
            .map_or(1.0, |p| p.t_ms)
            .max(f64::MIN_POSITIVE);
        let x = |t: f64| LEFT + plot_w * (t / span).clamp(0.0, 1.0);
        let y = |bytes: f64| base - PANEL_H * bytes / top;
        // Stacked areas, bottom layer first: a step function (a holding lasts until the next
        // point).
        for layer in 0..4 {
            let mut upper = Vec::new();
            let mut lower = Vec::new();
            for (j, p) in panel.points.iter().enumerate() {
                let l = p.layers();
                let below: u64 = l[..layer].iter().sum();
                let above = below + l[layer];
                let next = panel.points.get(j + 1).map_or(p.t_ms, |n| n.t_ms);
                upper.push((x(p.t_ms), y(above as f64)));
                upper.push((x(next), y(above as f64)));
                lower.push((x(p.t_ms), y(below as f64)));
                lower.push((x(next), y(below as f64)));
            }
            if upper.is_empty() {
                continue;
            }
            let mut d = String::new();
            for (k, (px, py)) in upper.iter().enumerate() {
                let _ = write!(d, "{}{px:.1},{py:.1} ", if k == 0 { "M" } else { "L" });
            }
            for (px, py) in lower.iter().rev() {
                let _ = write!(d, "L{px:.1},{py:.1} ");
            }
            let _ = write!(
                svg,
                r#"<path d="{}Z" fill="{}" stroke="none"/>"#,
                d, COLOURS[layer]
            );
        }
        // Axes, the byte scale and the time span.
        let _ = write!(
            svg,
            r##"<path d="M{LEFT},{y0} L{LEFT},{base} L{},{base}" fill="none" stroke="#333"/>"##,
            LEFT + plot_w
        );
        for frac in [0.0, 0.5, 1.0] {
            let _ = write!(
                svg,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                y(top * frac) + 4.0,
                mib(top * frac)
            );
        }
        let _ = write!(
            svg,
            r#"<text x="{LEFT}" y="{}">0 ms</text><text x="{}" y="{}" text-anchor="end">{span:.1} ms (one step)</text>"#,
            base + 16.0,
            LEFT + plot_w,
            base + 16.0
        );
        let peak = panel
            .points
            .iter()
            .map(|p| p.layers().iter().sum::<u64>())
            .max()
            .unwrap_or(0);
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}">peak {}</text>"#,
            LEFT + plot_w + 10.0,
            y0 + 12.0,
            mib(peak as f64)
        );
    }
    for (layer, name) in NAMES.iter().enumerate() {
        let ly = TOP + 40.0 + layer as f64 * 18.0;
        let lx = WIDTH - RIGHT + 10.0;
        let _ = write!(
            svg,
            r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{ly}">{name}</text>"#,
            ly - 10.0,
            COLOURS[layer],
            lx + 18.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / 1_048_576.0)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(t_ms: f64, params: u64) -> Point {
        Point {
            t_ms,
            params,
            grads: params / 2,
            optimizer: 2 * params,
            activations: 10,
        }
    }

    #[test]
    fn every_panel_and_layer_is_drawn_on_one_scale() {
        let panels = [
            Panel {
                title: "ZeRO-0 <dp 4>".into(),
                points: vec![point(0.0, 4 << 20), point(5.0, 4 << 20)],
            },
            Panel {
                title: "ZeRO-3".into(),
                points: vec![
                    point(0.0, 1 << 20),
                    point(2.0, 2 << 20),
                    point(4.0, 1 << 20),
                ],
            },
        ];
        let svg = render(&panels);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        // Four layers per panel, four legend swatches.
        assert_eq!(svg.matches("<path d=\"M").count(), 2 * 4 + 2);
        assert!(svg.contains("ZeRO-0 &lt;dp 4&gt;"));
        // The scale's top is the largest total of any panel: 4 MiB · (1 + ½ + 2) + 10 bytes.
        assert!(svg.contains("14.0 MiB"), "{svg}");
        assert!(svg.contains("peak 7.0 MiB"));
    }

    #[test]
    fn an_empty_panel_draws_axes_only() {
        let svg = render(&[Panel {
            title: "nothing".into(),
            points: Vec::new(),
        }]);
        assert_eq!(svg.matches("fill=\"#4e79a7\"").count(), 1, "legend only");
    }
}
