//! A short demo run through the real stack: mock engines, ZMQ events, the gateway, HTTP clients.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kvgate_demo::{run_one, DemoConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_demo_serves_every_request_and_enforce_reuses_the_cache() {
    let cfg =
        DemoConfig { workers: 3, duration_s: 3.0, rate: 12.0, min_output: 8, max_output: 24, ..DemoConfig::default() };
    let off = run_one(&cfg, "projected:off", Arc::new(AtomicU64::new(0))).await.unwrap();
    let enforce = run_one(&cfg, "projected:enforce", Arc::new(AtomicU64::new(0))).await.unwrap();
    for r in [&off, &enforce] {
        assert!(r.requests.total > 10, "{:?}", r.requests);
        assert_eq!(r.requests.completed, r.requests.total, "{}: {:?}", r.label(), r.requests);
        assert!(r.throughput.output_tokens_per_s > 0.0);
        assert_eq!(r.workers.len(), 3);
    }
    assert!(enforce.cache.hit_rate > 0.5, "the shared system prompts are reused: {}", enforce.cache.hit_rate);
    assert!(
        enforce.decisions_by_reason.get("cache_and_load").copied().unwrap_or(0) > 0,
        "{:?}",
        enforce.decisions_by_reason
    );
    assert_eq!(off.decisions_by_reason.keys().collect::<Vec<_>>(), vec!["load_only"], "off is load-only");
    let json = serde_json::to_value(&enforce).unwrap();
    for key in [
        "scenario",
        "policy",
        "mode",
        "requests",
        "throughput",
        "ttft_s",
        "e2e_s",
        "cache",
        "workers",
        "hot_prefix",
        "shadow",
    ] {
        assert!(json.get(key).is_some(), "the report has the simulator's shape: {key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_runs_are_refused() {
    let err = run_one(&DemoConfig::default(), "dynamo", Arc::new(AtomicU64::new(0))).await.unwrap_err();
    assert!(err.contains("dynamo") && err.contains("only in the simulator"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baseline_the_gateway_runs_can_be_demonstrated_too() {
    let cfg =
        DemoConfig { workers: 3, duration_s: 2.0, rate: 12.0, min_output: 8, max_output: 16, ..DemoConfig::default() };
    let rr = run_one(&cfg, "round_robin", Arc::new(AtomicU64::new(0))).await.unwrap();
    assert_eq!(rr.requests.completed, rr.requests.total, "{:?}", rr.requests);
    assert_eq!(rr.decisions_by_reason.keys().collect::<Vec<_>>(), vec!["round_robin"]);
    let per_worker: Vec<u64> = rr.workers.iter().map(|w| w.requests).collect();
    let (min, max) = (per_worker.iter().min().unwrap(), per_worker.iter().max().unwrap());
    assert!(max - min <= 1, "each engine in turn: {per_worker:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_over_grpc_workers_too() {
    let cfg = DemoConfig {
        workers: 3,
        duration_s: 3.0,
        rate: 12.0,
        min_output: 8,
        max_output: 24,
        grpc: true,
        prefix_scale: 0.5,
        ..DemoConfig::default()
    };
    let enforce = run_one(&cfg, "projected:enforce", Arc::new(AtomicU64::new(0))).await.unwrap();
    assert!(enforce.requests.total > 10, "{:?}", enforce.requests);
    assert_eq!(enforce.requests.completed, enforce.requests.total, "{:?}", enforce.requests);
    assert!(enforce.throughput.output_tokens_per_s > 0.0);
    // The KV events come over the workers' own streams, and earn the cache its credit.
    assert!(enforce.cache.hit_rate > 0.5, "the shared system prompts are reused: {}", enforce.cache.hit_rate);
    assert!(
        enforce.decisions_by_reason.get("cache_and_load").copied().unwrap_or(0) > 0,
        "{:?}",
        enforce.decisions_by_reason
    );
}
