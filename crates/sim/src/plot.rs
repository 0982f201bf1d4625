//! Charts of simulator and demo runs, drawn with `plotters` into one SVG document: first the TTFT
//! distribution of every policy (a CDF, the picture that shows tails), then, per policy, each
//! engine's waiting queue over time. Every chart has a title saying what is compared, axis
//! descriptions with units, tick labels and a legend. The busiest engines are named in the legend;
//! the rest are drawn in grey as one group, so that a 51-engine fleet stays readable.

use plotters::prelude::*;

use crate::Report;

/// Width of the document, pixels.
const WIDTH: u32 = 960;
/// Height of the CDF chart.
const CDF_HEIGHT: u32 = 460;
/// Height of each queue chart.
const QUEUE_HEIGHT: u32 = 320;
/// Engines named in a queue chart's legend; the others form one grey group.
const NAMED_ENGINES: usize = 3;

/// A chart that could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("cannot draw the plot: {0}")]
pub struct PlotError(String);

fn err(e: impl std::fmt::Display) -> PlotError {
    PlotError(e.to_string())
}

/// The colour of series `i` of `n`, evenly spaced around the hue circle.
fn colour(i: usize, n: usize) -> HSLColor {
    HSLColor(i as f64 / n.max(1) as f64, 0.7, 0.42)
}

/// One SVG document charting `reports` (runs of one scenario, one per policy).
pub fn svg(reports: &[Report]) -> Result<String, PlotError> {
    let with_timeline: Vec<&Report> = reports.iter().filter(|r| !r.timeline.is_empty()).collect();
    let height = CDF_HEIGHT + QUEUE_HEIGHT * with_timeline.len() as u32;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (top, rest) = root.split_vertically(CDF_HEIGHT);
        ttft_cdf(&top, reports)?;
        let mut area = rest;
        for r in with_timeline {
            let (panel, below) = area.split_vertically(QUEUE_HEIGHT);
            queues(&panel, r)?;
            area = below;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

fn scenario_of(reports: &[Report]) -> String {
    reports.first().map_or_else(String::new, |r| r.scenario.clone())
}

fn ttft_cdf<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    reports: &[Report],
) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let max_t = reports.iter().filter_map(|r| r.ttft_cdf.last().copied()).fold(0.0, f64::max).max(1e-3) * 1.05;
    let title = format!("{}: time to first token, {} policies compared (CDF)", scenario_of(reports), reports.len());
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_t, 0.0..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time to first token (s)")
        .y_desc("share of requests")
        .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
        .draw()
        .map_err(err)?;
    for (i, r) in reports.iter().enumerate() {
        let c = colour(i, reports.len());
        let n = r.ttft_cdf.len();
        let points = r.ttft_cdf.iter().enumerate().map(|(k, t)| (*t, k as f64 / (n.max(2) - 1) as f64));
        let label = if n == 0 { format!("{} (no request completed)", r.label()) } else { r.label() };
        chart
            .draw_series(LineSeries::new(points, c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

fn queues<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>, r: &Report) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let engines = r.timeline.first().map_or(0, |(_, d)| d.len());
    let max_t = r.timeline.last().map_or(1.0, |(t, _)| *t).max(1e-3);
    let peak = |e: usize| r.timeline.iter().map(|(_, d)| d[e]).max().unwrap_or(0);
    let max_q = (0..engines).map(peak).max().unwrap_or(0).max(1) as f64 * 1.05;
    let mut busiest: Vec<usize> = (0..engines).collect();
    busiest.sort_by_key(|&e| std::cmp::Reverse(peak(e)));
    let named: Vec<usize> = busiest.iter().copied().take(NAMED_ENGINES).collect();
    let title = format!("{}: waiting requests per engine over time, {}", r.scenario, r.label());
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_t, 0.0..max_q)
        .map_err(err)?;
    chart.configure_mesh().x_desc("time (s)").y_desc("waiting requests").draw().map_err(err)?;
    let series = |e: usize| r.timeline.iter().map(move |(t, d)| (*t, f64::from(d[e])));
    let others: Vec<usize> = busiest.iter().copied().skip(NAMED_ENGINES).collect();
    let grey = RGBColor(170, 170, 170);
    for (k, &e) in others.iter().enumerate() {
        let drawn = chart.draw_series(LineSeries::new(series(e), grey.stroke_width(1))).map_err(err)?;
        if k == 0 {
            drawn
                .label(format!("the other {} engines", others.len()))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(1)));
        }
    }
    for (i, &e) in named.iter().enumerate() {
        let c = colour(i, named.len());
        let id = r.workers.get(e).map_or_else(|| format!("engine {e}"), |w| w.id.clone());
        chart
            .draw_series(LineSeries::new(series(e), c.stroke_width(2)))
            .map_err(err)?
            .label(format!("{id} (peak {})", peak(e)))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}
