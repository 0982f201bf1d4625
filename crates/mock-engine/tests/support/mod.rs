//! What the mock-engine suites share: the real gateway on port 0 and the calls they make of it.

#![allow(dead_code)] // each suite uses its own part

use std::time::Duration;

use kvgate_gateway::{AppState, GatewayConfig};
use serde_json::Value;

/// A running gateway.
pub struct Gw {
    pub url: String,
    pub state: std::sync::Arc<AppState>,
    pub client: reqwest::Client,
}

/// The real gateway on port 0 with `toml`; without a tokenizer configured, gRPC workers hand
/// over theirs, as `kvgate serve` takes it (into a cache of this test's own).
pub async fn start_gateway(toml: &str) -> Gw {
    let mut cfg = GatewayConfig::from_toml(toml).unwrap();
    cfg.port = 0;
    let cache = std::env::temp_dir().join(format!("kvgate-mock-e2e-{}", std::process::id()));
    kvgate_gateway::worker_tokenizer::resolve(&mut cfg, &cache, Duration::from_secs(10)).await.unwrap();
    let state = AppState::new(cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let s = state.clone();
    tokio::spawn(async move { kvgate_gateway::serve(listener, s, std::future::pending()).await.unwrap() });
    Gw { url, state, client: reqwest::Client::new() }
}

/// A prompt of 1,500 words, each tagged.
pub fn long_prompt(tag: &str) -> String {
    (0..1500).map(|i| format!("{tag}{i} ")).collect()
}

/// `POST /v1/chat/completions`.
pub async fn post(gw: &Gw, body: &Value) -> reqwest::Response {
    gw.client.post(format!("{}/v1/chat/completions", gw.url)).json(body).send().await.unwrap()
}

/// The last `n` decisions.
pub async fn decisions(gw: &Gw, n: usize) -> Vec<Value> {
    let v: Value =
        gw.client.get(format!("{}/admin/decisions?limit={n}", gw.url)).send().await.unwrap().json().await.unwrap();
    v["decisions"].as_array().unwrap().clone()
}

/// Waits up to 5 s for `f`.
pub async fn wait(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// The cached tokens `POST /admin/decide` credits `worker` with for `body`.
pub async fn credit_on(gw: &Gw, body: Value, worker: String) -> u64 {
    let d: Value =
        gw.client.post(format!("{}/admin/decide", gw.url)).json(&body).send().await.unwrap().json().await.unwrap();
    let scores = d["decision"]["scores"].as_array().unwrap();
    let score =
        scores.iter().find(|s| s["worker"] == worker.as_str()).unwrap_or_else(|| panic!("{worker} unscored: {d}"));
    score["cached_tokens"].as_u64().unwrap()
}

/// The first worker the gateway sees holding blocks.
pub fn holder(gw: &Gw) -> Option<String> {
    gw.state.router.workers(gw.state.clock.now()).into_iter().find(|w| w.blocks_held > 0).map(|w| w.id.to_string())
}
