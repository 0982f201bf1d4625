//! SVG charts of simulator runs: per-engine queue depth over time (one panel per policy) and TTFT
//! percentiles per policy. Hand-written SVG: a few dozen lines do not justify a plotting stack.

use std::fmt::Write;

use crate::Report;

const PANEL_W: f64 = 520.0;
const PANEL_H: f64 = 180.0;
const MARGIN: f64 = 50.0;

/// One SVG document for the reports.
pub fn svg(reports: &[Report]) -> String {
    let panels = reports.len() as f64;
    let height = MARGIN + panels * (PANEL_H + MARGIN) + PANEL_H + 2.0 * MARGIN;
    let width = PANEL_W + 2.0 * MARGIN;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let max_t = reports.iter().flat_map(|r| r.timeline.last().map(|(t, _)| *t)).fold(1.0, f64::max);
    let max_q =
        reports.iter().flat_map(|r| r.timeline.iter().flat_map(|(_, d)| d.iter().copied())).max().unwrap_or(1).max(1)
            as f64;
    for (p, r) in reports.iter().enumerate() {
        let top = MARGIN + p as f64 * (PANEL_H + MARGIN);
        let _ = writeln!(
            s,
            "<text x=\"{MARGIN}\" y=\"{}\">{} — waiting requests per engine over time (max {max_q})</text>",
            top - 8.0,
            r.label()
        );
        axes(&mut s, top, "s", max_t);
        let engines = r.timeline.first().map_or(0, |(_, d)| d.len());
        for e in 0..engines {
            let mut path = String::new();
            for (i, (t, d)) in r.timeline.iter().enumerate() {
                let x = MARGIN + t / max_t * PANEL_W;
                let y = top + PANEL_H - d[e] as f64 / max_q * PANEL_H;
                let _ = write!(path, "{}{x:.1},{y:.1} ", if i == 0 { "M" } else { "L" });
            }
            let hue = (e * 137) % 360;
            let _ = writeln!(s, "<path d=\"{path}\" fill=\"none\" stroke=\"hsl({hue},70%,45%)\" stroke-width=\"1\"/>");
        }
    }
    let top = MARGIN + panels * (PANEL_H + MARGIN);
    let max_ttft = reports.iter().map(|r| r.ttft_s.p99).fold(0.001, f64::max);
    let _ = writeln!(
        s,
        "<text x=\"{MARGIN}\" y=\"{}\">TTFT p50 / p90 / p99 per policy, seconds (max {max_ttft:.2})</text>",
        top - 8.0
    );
    axes(&mut s, top, "", 0.0);
    let slot = PANEL_W / reports.len().max(1) as f64;
    for (i, r) in reports.iter().enumerate() {
        for (j, (v, shade)) in [(r.ttft_s.p50, 75), (r.ttft_s.p90, 55), (r.ttft_s.p99, 35)].into_iter().enumerate() {
            let h = v / max_ttft * PANEL_H;
            let x = MARGIN + i as f64 * slot + 4.0 + j as f64 * (slot - 8.0) / 3.0;
            let _ = writeln!(
                s,
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"hsl(210,60%,{shade}%)\"/>",
                top + PANEL_H - h,
                (slot - 8.0) / 3.0 - 1.0
            );
        }
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"9\">{}</text>",
            MARGIN + i as f64 * slot + 2.0,
            top + PANEL_H + 12.0,
            r.label()
        );
    }
    s.push_str("</svg>\n");
    s
}

fn axes(s: &mut String, top: f64, unit: &str, max_x: f64) {
    let _ = writeln!(
        s,
        "<path d=\"M{MARGIN},{top} L{MARGIN},{b} L{r},{b}\" fill=\"none\" stroke=\"black\"/>",
        b = top + PANEL_H,
        r = MARGIN + PANEL_W
    );
    if max_x > 0.0 {
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{max_x:.0} {unit}</text>",
            MARGIN + PANEL_W,
            top + PANEL_H + 12.0
        );
    }
}
