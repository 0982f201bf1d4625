//! The plots are readable charts: parsed back from the SVG, each has a title that says what is
//! compared, axis descriptions with units, tick labels, one line per policy with a legend entry, and
//! queue charts whose legend names the busiest engines and groups the rest.

use std::time::Duration;

use kvgate_engine_model::EngineProfile;
use kvgate_sim::policy::PolicySpec;
use kvgate_sim::workload::{self, WorkloadParams};
use kvgate_sim::SimConfig;

fn texts(svg: &str) -> Vec<String> {
    let doc = roxmltree::Document::parse(svg).expect("the plot is well-formed SVG");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or_default().trim().to_owned())
        .collect()
}

#[test]
fn a_comparison_plot_has_a_ttft_cdf_and_a_queue_chart_per_policy_with_axes_and_legends() {
    let w = workload::hot_prefix_51(WorkloadParams { workers: None, rate: None, duration_s: Some(4.0), seed: 1 });
    let reports: Vec<_> = ["smg_least_load", "projected:enforce"]
        .iter()
        .map(|p| {
            let mut cfg = SimConfig::new(EngineProfile::large_moe_h200(), PolicySpec::parse(p).unwrap(), 1);
            cfg.timeline = Some(Duration::from_millis(250));
            kvgate_sim::run(&w, cfg).unwrap()
        })
        .collect();
    assert!(reports.iter().all(|r| r.ttft_cdf.len() == kvgate_sim::report::CDF_POINTS));
    assert!(reports.iter().all(|r| r.ttft_cdf.windows(2).all(|p| p[0] <= p[1])), "a CDF rises");
    let svg = kvgate_sim::plot::svg(&reports).unwrap();
    let t = texts(&svg);
    let has = |s: &str| t.iter().any(|x| x.contains(s));
    assert!(has("hot-prefix-51: time to first token, 2 policies compared (CDF)"), "{t:?}");
    for axis in ["time to first token (s)", "share of requests", "time (s)", "waiting requests"] {
        assert!(has(axis), "axis description {axis:?} missing: {t:?}");
    }
    assert!(has("50%") && has("100%"), "share ticks: {t:?}");
    for label in ["smg_least_load", "projected:enforce"] {
        assert!(t.iter().any(|x| x == label), "legend entry {label}: {t:?}");
        assert!(has(&format!("waiting requests per engine over time, {label}")), "queue chart title: {t:?}");
    }
    assert!(has("the other 48 engines"), "51 engines: 3 named, the rest grouped: {t:?}");
    assert!(has("(peak "), "named engines carry their peak: {t:?}");
    let doc = roxmltree::Document::parse(&svg).unwrap();
    let lines = doc.descendants().filter(|n| n.has_tag_name("polyline")).count();
    assert!(lines >= 2 + 2 * 51, "a line per policy and per engine in each queue chart: {lines}");
}

#[test]
fn a_run_that_completed_nothing_says_so_in_the_legend() {
    let w = workload::hot_prefix_51(WorkloadParams { workers: None, rate: None, duration_s: Some(2.0), seed: 1 });
    let mut r =
        kvgate_sim::run(&w, SimConfig::new(EngineProfile::large_moe_h200(), PolicySpec::parse("random").unwrap(), 1))
            .unwrap();
    r.ttft_cdf.clear();
    let t = texts(&kvgate_sim::plot::svg(&[r]).unwrap());
    assert!(t.iter().any(|x| x == "random (no request completed)"), "{t:?}");
}
