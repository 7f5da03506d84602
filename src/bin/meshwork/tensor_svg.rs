//! The picture of `meshwork bench tensor --svg`: how one transformer layer splits over `T`
//! tensor-parallel ranks (Megatron-LM). Attention: the query, key and value weights by
//! columns (each rank whole heads), the output projection by rows; MLP: up by columns, down
//! by rows. One colour per rank shows which rank holds which slice; grey is replicated. The
//! markers show where the group all-reduces: `g` after each row-parallel layer in the
//! forward, `f` at each block's input in the backward.

use std::fmt::Write;

const WIDTH: f64 = 780.0;
/// The drawn size of `hidden` features.
const U: f64 = 60.0;
const TOP: f64 = 34.0;
const REPLICATED: &str = "#bab0ac";
const MARKER: &str = "#c0392b";
/// One colour per rank (Tableau 10); beyond ten ranks, hues spread around the wheel.
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f",
    "#e15759", "#17becf",
];

/// Rank `r`'s colour in a group of `t`.
fn colour(r: usize, t: usize) -> String {
    if t <= PALETTE.len() {
        PALETTE[r].to_string()
    } else {
        format!("hsl({:.0},60%,55%)", 360.0 * r as f64 / t as f64)
    }
}

/// The SVG document drawing one transformer layer split over `t` ranks, the attention with
/// `heads` heads (`t` at least 1).
pub(crate) fn render(t: usize, heads: usize) -> String {
    let t = t.max(1);
    let mut svg = String::new();
    let attention_h = 3.0 * U + 2.0 * 12.0;
    let mlp_h = 4.0 * U;
    let legend_y = TOP + attention_h + 70.0 + mlp_h + 40.0;
    let height = legend_y + 24.0 * (t.div_ceil(4) as f64 + 4.0);
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        svg,
        r##"<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#333"/></marker></defs><rect width="{WIDTH}" height="{height}" fill="white"/>"##
    );
    let _ = write!(
        svg,
        r#"<text x="20" y="20" font-weight="bold" font-size="14">One transformer layer over a tensor-parallel group of {t} (Megatron-LM)</text>"#
    );

    // Self-attention: x → f → Q, K, V (columns) → attention per rank → W_O (rows) → g → y.
    let y0 = TOP + 26.0;
    let cy = y0 + attention_h / 2.0;
    let _ = write!(
        svg,
        r#"<text x="20" y="{}" font-weight="bold">Self-attention: heads split over the ranks</text>"#,
        y0 - 8.0
    );
    block(&mut svg, 20.0, cy - U / 2.0, 36.0, U, "x");
    arrow(&mut svg, 56.0, cy, 78.0, cy);
    marker(&mut svg, 92.0, cy, "f");
    for (i, name) in ["W_Q", "W_K", "W_V"].iter().enumerate() {
        let y = y0 + i as f64 * (U + 12.0);
        arrow(&mut svg, 104.0, cy, 140.0, y + U / 2.0);
        matrix(&mut svg, 142.0, y, U, U, t, Split::Columns);
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}">{name} by columns</text>"#,
            142.0 + U + 6.0,
            y + 12.0
        );
        arrow(&mut svg, 142.0 + U, y + U / 2.0, 318.0, cy);
    }
    let box_gap = 4.0;
    let box_h = (attention_h - box_gap * (t - 1) as f64) / t as f64;
    let per_rank = heads / t;
    for r in 0..t {
        let y = y0 + r as f64 * (box_h + box_gap);
        let _ = write!(
            svg,
            r##"<rect x="320" y="{y:.1}" width="150" height="{box_h:.1}" fill="{}" stroke="#333"/>"##,
            colour(r, t)
        );
        if box_h >= 14.0 {
            let label = if per_rank > 0 {
                format!(
                    "rank {r}: heads {}–{}",
                    r * per_rank,
                    (r + 1) * per_rank - 1
                )
            } else {
                format!("rank {r}")
            };
            let _ = write!(
                svg,
                r#"<text x="326" y="{:.1}" fill="white">{label}</text>"#,
                y + box_h / 2.0 + 4.0
            );
        }
    }
    let _ = write!(
        svg,
        r#"<text x="320" y="{:.1}" font-size="11">softmax(QKᵀ/√d)·V, each rank its heads</text>"#,
        y0 + attention_h + 14.0
    );
    arrow(&mut svg, 470.0, cy, 506.0, cy);
    matrix(&mut svg, 508.0, cy - U / 2.0, U, U, t, Split::Rows);
    let _ = write!(
        svg,
        r#"<text x="508" y="{:.1}">W_O by rows</text>"#,
        cy - U / 2.0 - 6.0
    );
    arrow(&mut svg, 508.0 + U, cy, 606.0, cy);
    marker(&mut svg, 620.0, cy, "g");
    arrow(&mut svg, 632.0, cy, 668.0, cy);
    block(&mut svg, 670.0, cy - U / 2.0, 36.0, U, "y");

    // MLP: x → f → W_up (columns) → GeLU per rank → W_down (rows) → g → y.
    let y1 = y0 + attention_h + 70.0;
    let cy = y1 + mlp_h / 2.0;
    let _ = write!(
        svg,
        r#"<text x="20" y="{}" font-weight="bold">MLP: up by columns, down by rows</text>"#,
        y1 - 8.0
    );
    block(&mut svg, 20.0, cy - U / 2.0, 36.0, U, "x");
    arrow(&mut svg, 56.0, cy, 78.0, cy);
    marker(&mut svg, 92.0, cy, "f");
    arrow(&mut svg, 104.0, cy, 140.0, cy);
    matrix(&mut svg, 142.0, cy - U / 2.0, 4.0 * U, U, t, Split::Columns);
    let _ = write!(
        svg,
        r#"<text x="142" y="{:.1}">W_up [h, 4h] by columns</text><text x="142" y="{:.1}">GeLU on each rank's columns</text>"#,
        cy - U / 2.0 - 6.0,
        cy + U / 2.0 + 16.0
    );
    arrow(&mut svg, 142.0 + 4.0 * U, cy, 438.0, cy);
    matrix(&mut svg, 440.0, y1, U, mlp_h, t, Split::Rows);
    let _ = write!(
        svg,
        r#"<text x="{:.1}" y="{:.1}">W_down [4h, h] by rows</text>"#,
        440.0 + U + 6.0,
        y1 + 12.0
    );
    arrow(&mut svg, 440.0 + U, cy, 606.0, cy);
    marker(&mut svg, 620.0, cy, "g");
    arrow(&mut svg, 632.0, cy, 668.0, cy);
    block(&mut svg, 670.0, cy - U / 2.0, 36.0, U, "y");

    // Legend: the ranks, replicated, the two markers.
    for r in 0..t {
        let x = 20.0 + (r % 4) as f64 * 110.0;
        let y = legend_y + (r / 4) as f64 * 24.0;
        let _ = write!(
            svg,
            r#"<rect x="{x}" y="{}" width="14" height="14" fill="{}"/><text x="{}" y="{y}">rank {r}</text>"#,
            y - 11.0,
            colour(r, t),
            x + 20.0
        );
    }
    let mut y = legend_y + t.div_ceil(4) as f64 * 24.0;
    let _ = write!(
        svg,
        r#"<rect x="20" y="{}" width="14" height="14" fill="{REPLICATED}"/><text x="40" y="{y}">replicated: every rank holds the whole tensor (inputs, outputs, norms, the row-parallel bias)</text>"#,
        y - 11.0
    );
    y += 24.0;
    marker(&mut svg, 27.0, y - 4.0, "f");
    let _ = write!(
        svg,
        r#"<text x="44" y="{y}">f: forward identity; backward all-reduce (sum) of the block input's gradient, b·s·h values</text>"#
    );
    y += 24.0;
    marker(&mut svg, 27.0, y - 4.0, "g");
    let _ = write!(
        svg,
        r#"<text x="44" y="{y}">g: forward all-reduce (sum) of the row-parallel partial outputs, b·s·h values; backward identity</text>"#
    );
    y += 24.0;
    let _ = write!(
        svg,
        r#"<text x="20" y="{y}">Per layer and micro-batch: 2 all-reduces forward + 2 backward of b·s·h values (b batch, s sequence, h hidden).</text>"#
    );
    svg.push_str("</svg>\n");
    svg
}

/// How a weight `[in, out]` (drawn `out` wide, `in` tall) is split over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// Output features: vertical strips.
    Columns,
    /// Input features: horizontal strips.
    Rows,
}

fn matrix(svg: &mut String, x: f64, y: f64, w: f64, h: f64, t: usize, split: Split) {
    for r in 0..t {
        let (sx, sy, sw, sh) = match split {
            Split::Columns => (x + w * r as f64 / t as f64, y, w / t as f64, h),
            Split::Rows => (x, y + h * r as f64 / t as f64, w, h / t as f64),
        };
        let _ = write!(
            svg,
            r#"<rect x="{sx:.1}" y="{sy:.1}" width="{sw:.1}" height="{sh:.1}" fill="{}" stroke="white" stroke-width="0.5"/>"#,
            colour(r, t)
        );
    }
    let _ = write!(
        svg,
        r##"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="none" stroke="#333"/>"##
    );
}

fn block(svg: &mut String, x: f64, y: f64, w: f64, h: f64, label: &str) {
    let _ = write!(
        svg,
        r##"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{REPLICATED}" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{label}</text>"##,
        x + w / 2.0,
        y + h / 2.0 + 4.0
    );
}

fn marker(svg: &mut String, cx: f64, cy: f64, name: &str) {
    let _ = write!(
        svg,
        r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="11" fill="white" stroke="{MARKER}" stroke-width="2.5"/><text x="{cx:.1}" y="{:.1}" text-anchor="middle" font-weight="bold" font-style="italic" fill="{MARKER}">{name}</text>"#,
        cy + 4.0
    );
}

fn arrow(svg: &mut String, x1: f64, y1: f64, x2: f64, y2: f64) {
    let _ = write!(
        svg,
        r##"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="#333" marker-end="url(#arrow)"/>"##
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_has_its_own_colour_and_the_all_reduces_are_marked() {
        for t in [1, 2, 4, 12] {
            let svg = render(t, 16);
            assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"), "{t}");
            assert_eq!(
                svg.matches("<text").count(),
                svg.matches("</text>").count(),
                "every text closed"
            );
            let colours: Vec<String> = (0..t).map(|r| colour(r, t)).collect();
            let mut distinct = colours.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), t, "one colour per rank");
            for (r, c) in colours.iter().enumerate() {
                // Q, K, V, W_O, W_up, W_down strips, the attention box and the legend.
                assert!(
                    svg.matches(&format!("fill=\"{c}\"")).count() >= 8,
                    "rank {r} of {t} holds a slice of every split weight"
                );
                assert!(svg.contains(&format!("rank {r}")));
            }
            assert!(svg.contains("all-reduce"));
            // f and g on both blocks, and once each in the legend.
            assert_eq!(svg.matches(&format!("stroke=\"{MARKER}\"")).count(), 6);
        }
        assert!(render(2, 16).contains("rank 1: heads 8–15"));
    }
}
