//! The Grafana dashboard (`deploy/grafana/kvgate.json`) names only metrics the gateway exports, and
//! the per-engine gauges it draws carry each engine's state.

mod support;

use serde_json::Value;
use support::*;

fn dashboard() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/grafana/kvgate.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} is not JSON: {e}"))
}

/// Every PromQL expression of the dashboard: panel targets and template-variable queries.
fn expressions(d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in d["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    for var in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["definition"].as_str() {
            out.push(q.to_owned());
        }
    }
    out
}

/// The `kvgate_*` names in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kvgate_") {
        let name: String =
            rest[i..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
        rest = &rest[i + name.len()..];
        names.push(name);
    }
    names
}

/// Whether `/metrics` has `name`: a sample of it, or the family it belongs to (a counter's
/// `_total`, a histogram's `_bucket`, `_sum`, `_count`) declared with no sample yet.
fn exported(metrics: &str, name: &str) -> bool {
    let sample =
        metrics.lines().any(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')));
    let family = ["_total", "_bucket", "_sum", "_count"].iter().fold(name, |n, s| n.strip_suffix(s).unwrap_or(n));
    sample || metrics.lines().any(|l| l.strip_prefix("# TYPE ").is_some_and(|r| r.split(' ').next() == Some(family)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_draws_is_exported() {
    let d = dashboard();
    let engine = fake_engine().await;
    let dead_events = format!("tcp://127.0.0.1:{}", free_port());
    let toml = format!(
        "[[workers]]\nid = \"a\"\nurl = \"{}\"\nkv_events = \"{dead_events}\"\nblock_size = 16\n",
        engine.url()
    );
    let gw = gateway(&base_toml(&[], &toml)).await;
    gw.wait_for_load().await;
    assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let names: std::collections::BTreeSet<String> = expressions(&d).iter().flat_map(|e| metric_names(e)).collect();
    assert!(names.len() >= 20, "the dashboard draws the gateway's metrics: {names:?}");
    let missing: Vec<&String> = names.iter().filter(|n| !exported(&metrics, n)).collect();
    assert!(missing.is_empty(), "the dashboard names metrics /metrics does not have: {missing:?}\n{metrics}");
    // The per-engine gauges say what the router sees.
    assert!(metrics.contains("kvgate_engine_eligible{engine=\"a\"} 1"), "{metrics}");
    assert!(metrics.contains("kvgate_kv_state{engine=\"a\",state=\"incomplete\"} 1"), "never connected: {metrics}");
    assert!(metrics.contains("kvgate_kv_state{engine=\"a\",state=\"synced\"} 0"), "{metrics}");
    assert!(metrics.contains("kvgate_engine_waiting_requests{engine=\"a\"} 0"), "{metrics}");
    // Rates: configured and planned from the start; measured only once calibration has a fit.
    assert!(
        metrics.contains("kvgate_engine_prefill_tokens_per_second{engine=\"a\",rate=\"configured\"} 20000"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_engine_prefill_tokens_per_second{engine=\"a\",rate=\"planned\"} 20000"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_engine_decode_tokens_per_second{engine=\"a\",rate=\"planned\"} 2000"),
        "{metrics}"
    );
    assert!(!metrics.contains("rate=\"measured\""), "nothing measured yet: {metrics}");
    // What times decode: one of the two series is 1, the other 0.
    let timing = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("kvgate_engine_decode_timing{{engine=\"a\",timing=\"{name}\"}} ")))
            .map(str::to_owned)
    };
    let (streams, blocks) = (timing("streams"), timing("decode_filled_blocks"));
    assert!(
        matches!((streams.as_deref(), blocks.as_deref()), (Some("1"), Some("0")) | (Some("0"), Some("1"))),
        "{metrics}"
    );
}

#[test]
fn the_dashboard_is_a_grafana_dashboard_with_a_datasource_choice_and_titled_panels() {
    let d = dashboard();
    assert_eq!(d["uid"], "kvgate-overview");
    let vars = d["templating"]["list"].as_array().unwrap();
    assert!(vars.iter().any(|v| v["type"] == "datasource" && v["query"] == "prometheus"), "importable anywhere");
    for panel in d["panels"].as_array().unwrap() {
        assert!(!panel["title"].as_str().unwrap().is_empty(), "{panel}");
        let g = &panel["gridPos"];
        let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
        assert!(x + w <= 24, "panel {} overflows the 24-column grid", panel["title"]);
        if panel["type"] != "row" {
            assert!(!panel["targets"].as_array().unwrap().is_empty(), "panel {} draws nothing", panel["title"]);
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {}", panel["title"]);
        }
    }
    assert!(metric_names("rate(kvgate_kv_gaps_total{engine=~\"$engine\"}[5m])") == ["kvgate_kv_gaps_total"]);
}
