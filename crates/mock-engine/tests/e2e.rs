//! Real gateway in front of real mock engines on loopback: HTTP, load polling and ZMQ KV events.

use std::time::Duration;

use kvgate_gateway::{AppState, GatewayConfig};
use kvgate_mock_engine::{MockConfig, MockEngine};
use serde_json::{json, Value};

async fn engines(n: usize, speedup: f64) -> Vec<MockEngine> {
    let mut out = Vec::new();
    for i in 0..n {
        out.push(MockEngine::start(MockConfig { speedup, seed: i as u64 + 1, ..MockConfig::default() }).await.unwrap());
    }
    out
}

struct Gw {
    url: String,
    state: std::sync::Arc<AppState>,
    client: reqwest::Client,
}

async fn gateway(engines: &[MockEngine], extra: &str) -> Gw {
    let mut toml = format!("[telemetry]\npoll_interval_ms = 50\nhealth_interval_ms = 200\n{extra}\n");
    for (i, e) in engines.iter().enumerate() {
        toml.push_str(&format!(
            "[[workers]]\nid = \"e{i}\"\nurl = \"{}\"\nengine = \"sglang\"\nkv_events = \"{}\"\nreplay = \"{}\"\nprefill_tokens_per_s = 35000\ndecode_tokens_per_s = 4000\nkv_capacity_tokens = 400000\n",
            e.url, e.kv_events, e.replay
        ));
    }
    let mut cfg = GatewayConfig::from_toml(&toml).unwrap();
    cfg.port = 0;
    let state = AppState::new(cfg).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let s = state.clone();
    tokio::spawn(async move { kvgate_gateway::serve(listener, s, std::future::pending()).await.unwrap() });
    Gw { url, state, client: reqwest::Client::new() }
}

fn chat(system: &str, user: &str, stream: bool) -> Value {
    json!({"model": "mock-model", "stream": stream, "max_tokens": 8, "stream_options": {"include_usage": true},
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
}

fn long_prompt(tag: &str) -> String {
    (0..1500).map(|i| format!("{tag}{i} ")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prefix_is_routed_to_its_cache_and_the_engine_reuses_it() {
    let es = engines(3, 50.0).await;
    let gw = gateway(&es, "").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let system = long_prompt("sys");
    let first: Value = gw
        .client
        .post(format!("{}/v1/chat/completions", gw.url))
        .json(&chat(&system, "q1", false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Wait until the owner's KV events reach the gateway.
    let mut owner = None;
    for _ in 0..100 {
        owner = gw.state.router.workers(gw.state.clock.now()).into_iter().find(|w| w.blocks_held > 0).map(|w| w.id);
        if owner.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(owner.is_some(), "the engine's KV events reached the gateway");
    let resp = gw
        .client
        .post(format!("{}/v1/chat/completions", gw.url))
        .json(&chat(&system, "q2", true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let usage_line = text.lines().rfind(|l| l.contains("\"usage\"")).unwrap();
    let usage: Value = serde_json::from_str(usage_line.strip_prefix("data: ").unwrap()).unwrap();
    let cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= 1400, "the second request hit the owner's cache: {cached} cached tokens");
    let log: Value =
        gw.client.get(format!("{}/admin/decisions?limit=1", gw.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(log["decisions"][0]["decision"]["reason"], "cache_and_load");
    assert_eq!(log["decisions"][0]["decision"]["worker"], owner.unwrap().as_str());
}
