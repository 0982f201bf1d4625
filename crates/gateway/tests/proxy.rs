//! The gateway as clients and operators see it: the real server on port 0 in front of fake engines.

#![allow(clippy::disallowed_methods)] // black-box tests measure wall time between chunks

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{json, Value};
use support::*;

fn idle(state: &kvgate_gateway::AppState) -> bool {
    state.router.in_flight() == 0 && state.router.workers(state.clock.now()).iter().all(|w| w.in_flight == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_chunk_by_chunk_unchanged() {
    let engine = fake_engine().await;
    engine.set(|b| b.chunk_delay = Duration::from_millis(15));
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let body = chat_body(true);
    let sent = serde_json::to_vec(&body).unwrap();
    let started = Instant::now();
    let resp = gw
        .client
        .post(gw.url("/v1/chat/completions"))
        .body(sent.clone())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let mut received = Vec::new();
    let mut first_chunk_at = None;
    let mut chunks = 0;
    while let Some(chunk) = stream.next().await {
        first_chunk_at.get_or_insert(started.elapsed());
        chunks += 1;
        received.extend_from_slice(&chunk.unwrap());
    }
    let total = started.elapsed();
    let expected = recorded_stream("chat_completions_chat-completion.streaming.1");
    assert_eq!(String::from_utf8(received).unwrap(), expected, "the stream arrives byte for byte");
    assert!(chunks > 10, "forwarded as chunks, not one buffered body: {chunks}");
    assert!(first_chunk_at.unwrap() * 4 < total, "first chunk at {:?} of {total:?}", first_chunk_at.unwrap());
    assert_eq!(engine.received.lock()[0].1.as_ref(), &sent[..], "the request body is forwarded unchanged");
    assert!(gw.eventually(Duration::from_secs(2), idle).await, "the reservation is released at the end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_and_generate_and_completions_are_proxied() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["choices"][0]["message"]["content"], "hello");
    let r = gw.post("/generate", &json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["text"], "ok");
    let r = gw.post("/v1/completions", &json!({"model": "test-model", "prompt": "Once upon", "stream": true})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), recorded_stream("completions_completion.streaming.1"));
    let paths: Vec<String> = engine.received.lock().iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(paths, vec!["/v1/chat/completions", "/generate", "/v1/completions"]);
    let log = gw.get_json("/admin/decisions").await;
    let generate = &log["decisions"][1];
    assert_eq!(generate["endpoint"], "/generate");
    assert_eq!(generate["decision"]["prompt_tokens"], 3, "client token ids are used as they are");
    assert!(gw.eventually(Duration::from_secs(2), idle).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_mid_stream_releases_the_reservation() {
    let engine = fake_engine().await;
    engine.set(|b| b.chunk_delay = Duration::from_millis(100));
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let resp = gw.post("/v1/chat/completions", &chat_body(true)).await;
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    assert_eq!(gw.state.router.in_flight(), 1);
    drop(stream);
    assert!(gw.eventually(Duration::from_secs(3), idle).await, "dropping the client frees the reservation");
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("status=\"499\""), "{metrics}");
}

/// Whether every engine has passed a health check.
fn all_seen_up(state: &kvgate_gateway::AppState) -> bool {
    state.engines.all().iter().all(|e| e.seen_up.load(Ordering::Relaxed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_is_retried_on_another_engine() {
    let engine = fake_engine().await;
    let dying = HangUpEngine::start().await;
    // Health checks would take the dead engine out within 300 ms; passive health is under test.
    let gw = gateway(&base_toml(&[dying.url.clone(), engine.url()], "[telemetry]\nfailures_to_open = 100\n")).await;
    assert!(gw.eventually(Duration::from_secs(3), all_seen_up).await, "both engines pass a health check");
    dying.stop();
    // Ties break at random: send until one has been tried on the dead engine first.
    let mut sent = 0;
    while !metrics_text(&gw).await.contains("kvgate_retries_total 1") {
        assert!(sent < 50, "no request was ever tried on the dead engine");
        let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
        assert_eq!(r.status(), 200);
        sent += 1;
    }
    assert_eq!(engine.requests(), sent, "every request reached the live engine");
    let metrics = metrics_text(&gw).await;
    let dead_label = dying.url.trim_start_matches("http://");
    assert!(metrics.contains(&format!("kvgate_upstream_failures_total{{engine=\"{dead_label}\"}} 1")), "{metrics}");
    let workers = gw.get_json("/admin/workers").await;
    let dead = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"].as_str().unwrap().starts_with(&dying.url))
        .unwrap();
    assert_eq!(dead["healthy"], true, "an engine that has served stays in until its checks or passive health say");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_were_never_up_leave_rotation_at_their_first_failed_check() {
    let engine = fake_engine().await;
    let mut urls = vec![engine.url()];
    for _ in 0..8 {
        urls.push(dead_url().await);
    }
    // Only the first health check runs in this test: three failed checks would take a minute each.
    let toml = base_toml(&urls, "[telemetry]\n").replace("health_interval_ms = 100", "health_interval_ms = 60000");
    let gw = gateway(&toml).await;
    let out = |s: &kvgate_gateway::AppState| s.router.workers(s.clock.now()).iter().filter(|w| !w.eligible).count();
    assert!(gw.eventually(Duration::from_secs(3), |s| out(s) == 8).await, "the 8 dead engines leave at once");
    for _ in 0..20 {
        let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(engine.requests(), 20);
    let workers = gw.get_json("/admin/workers").await;
    for w in workers["workers"].as_array().unwrap() {
        let live = w["url"].as_str().unwrap().starts_with(&engine.url());
        assert_eq!((w["healthy"] == true, w["seen_up"] == true), (live, live), "{w}");
    }
    let ready = gw.get_json("/ready").await;
    assert_eq!((ready["ready"].as_bool(), ready["eligible_seen_up"].as_u64()), (Some(true), Some(1)), "{ready}");

    // An engine whose first health check has not come back yet (it takes 5 s to time out) is in
    // rotation, but the gateway is not ready on it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let toml = base_toml(&[silent], "[telemetry]\n").replace("health_interval_ms = 100", "health_interval_ms = 60000");
    let gw = gateway(&toml).await;
    let r = gw.client.get(gw.url("/ready")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let ready: Value = r.json().await.unwrap();
    assert_eq!((ready["eligible_workers"].as_u64(), ready["eligible_seen_up"].as_u64()), (Some(1), Some(0)));
}

async fn metrics_text(gw: &Gateway) -> String {
    gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap()
}

/// An "engine" whose `/health` answers 200 and which reads every other request and closes the
/// connection without answering, as an engine closing a kept-alive connection does. Every answer
/// closes its connection, so none is pooled: once stopped, its port refuses connects.
struct HangUpEngine {
    url: String,
    accept: tokio::task::JoinHandle<()>,
}

impl HangUpEngine {
    async fn start() -> HangUpEngine {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let accept = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buf = [0u8; 4096];
                    let n = sock.read(&mut buf).await.unwrap_or(0);
                    if buf[..n].starts_with(b"GET /health") {
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                        let _ = sock.write_all(ok).await;
                    }
                });
            }
        });
        HangUpEngine { url, accept }
    }

    /// Closes its port.
    fn stop(&self) {
        self.accept.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_breaks_before_any_response_is_retried_elsewhere() {
    let engine = fake_engine().await;
    let hang_up = HangUpEngine::start().await.url;
    // Slow health checks: the hang-up engine stays in rotation, so requests do reach it.
    let toml = format!(
        "[telemetry]\npoll_interval_ms = 50\nhealth_interval_ms = 60000\n[[workers]]\nurl = \"{hang_up}\"\n[[workers]]\nurl = \"{}\"\n",
        engine.url()
    );
    let gw = gateway(&toml).await;
    assert!(gw.eventually(Duration::from_secs(3), all_seen_up).await, "both engines pass their first health check");
    for _ in 0..8 {
        let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
        assert_eq!(r.status(), 200, "the client never sees the broken connection");
    }
    assert_eq!(engine.requests(), 8);
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let retries = metrics.lines().find(|l| l.starts_with("kvgate_retries_total")).unwrap();
    assert!(!retries.ends_with(" 0"), "{retries}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failing_mid_stream_is_reported_to_the_client() {
    let engine = fake_engine().await;
    engine.set(|b| b.fail_after = Some(3));
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let text = gw.post("/v1/chat/completions", &chat_body(true)).await.text().await.unwrap();
    let evs = events(&text);
    assert_eq!(evs.len(), 4, "{text}");
    let expected = events(&recorded_stream("chat_completions_chat-completion.streaming.1"));
    assert_eq!(evs[..3], expected[..3]);
    let err: Value = serde_json::from_str(evs[3].trim().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "upstream_error");
    assert!(!text.contains(&engine.addr.to_string()), "the engine is never named to the client");
    assert!(gw.eventually(Duration::from_secs(2), idle).await);
}

async fn status_of(resp: reqwest::Response) -> (u16, Value) {
    let s = resp.status().as_u16();
    (s, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_get_openai_style_bodies() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "[server]\nmax_body_bytes = 4096\n")).await;
    let raw = |body: &'static str| {
        gw.client.post(gw.url("/v1/chat/completions")).header("content-type", "application/json").body(body).send()
    };
    let (s, b) = status_of(raw("{not json").await.unwrap()).await;
    assert_eq!((s, b["error"]["code"].as_str()), (400, Some("invalid_json")));
    let (s, b) = status_of(gw.post("/v1/chat/completions", &json!({"messages": "hi"})).await).await;
    assert_eq!((s, b["error"]["param"].as_str()), (400, Some("messages")));
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]});
    let (s, b) = status_of(gw.post("/v1/chat/completions", &big).await).await;
    assert_eq!((s, b["error"]["code"].as_str()), (413, Some("payload_too_large")));
    assert!(gw.eventually(Duration::from_secs(2), |s| !s.engines.models().is_empty()).await, "models discovered");
    let (s, b) = status_of(
        gw.post("/v1/chat/completions", &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}))
            .await,
    )
    .await;
    assert_eq!((s, b["error"]["code"].as_str()), (404, Some("model_not_found")));
    let (s, _) = status_of(gw.post("/v2/everything", &json!({})).await).await;
    assert_eq!(s, 404);
    let models = gw.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "test-model");
    assert_eq!(engine.requests(), 0, "nothing invalid reached the engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_clients_and_the_admin_key_guards_admin() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(
        &[engine.url()],
        "[security]\napi_keys = [\"client-secret\"]\nadmin_key = \"admin-secret\"\n",
    ))
    .await;
    let (s, b) = status_of(gw.post("/v1/chat/completions", &chat_body(false)).await).await;
    assert_eq!((s, b["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    let with = |key: &str, path: &str| gw.client.post(gw.url(path)).bearer_auth(key).json(&chat_body(false)).send();
    assert_eq!(with("wrong", "/v1/chat/completions").await.unwrap().status(), 401);
    assert_eq!(with("client-secret", "/v1/chat/completions").await.unwrap().status(), 200);
    let admin = |key: &str| gw.client.get(gw.url("/admin/workers")).bearer_auth(key).send();
    assert_eq!(admin("client-secret").await.unwrap().status(), 401, "a client key is not an admin key");
    assert_eq!(admin("admin-secret").await.unwrap().status(), 200);
    assert_eq!(gw.client.get(gw.url("/health")).send().await.unwrap().status(), 200, "health needs no key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_answers_429_with_retry_after_and_503_without_engines() {
    let engine = fake_engine().await;
    engine.set(|b| b.load = (400, 4_000_000, 200));
    let gw = gateway(&base_toml(&[engine.url()], "[policy]\nadmission_wait_s = 5\n")).await;
    assert!(
        gw.eventually(Duration::from_secs(3), |s| s.router.workers(s.clock.now())[0].waiting_requests >= 400).await,
        "the load report arrives"
    );
    let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    assert_eq!(engine.requests(), 0);
    assert!(idle(&gw.state), "a refused request holds no reservation");
    let empty = gateway(&base_toml(&[], "")).await;
    let (s, b) = status_of(empty.post("/v1/chat/completions", &chat_body(false)).await).await;
    assert_eq!((s, b["error"]["code"].as_str()), (503, Some("no_engine_available")));
    assert_eq!(empty.client.get(empty.url("/ready")).send().await.unwrap().status(), 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_queueing_waits_for_an_engine_to_come_back() {
    let engine = fake_engine().await;
    engine.set(|b| b.healthy = false);
    let gw = gateway(&base_toml(
        &[engine.url()],
        "[policy]\nqueue_timeout_ms = 3000\nmax_queued = 4\n[telemetry]\nfailures_to_open = 1\n",
    ))
    .await;
    assert!(
        gw.eventually(Duration::from_secs(2), |s| s.router.workers(s.clock.now()).iter().all(|w| !w.eligible)).await
    );
    let e = engine.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        e.set(|b| b.healthy = true);
    });
    let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
    assert_eq!(r.status(), 200, "queued until the engine was healthy again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_mode_and_knobs_change_at_runtime_and_bad_values_change_nothing() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let put = |v: Value| gw.client.put(gw.url("/admin/policy")).json(&v).send();
    let r = put(json!({"mode": "shadow", "escape_seconds": 2.5})).await.unwrap();
    assert_eq!(r.status(), 200);
    let p = gw.get_json("/admin/policy").await;
    assert_eq!((p["mode"].as_str(), p["escape_seconds"].as_f64()), (Some("shadow"), Some(2.5)));
    gw.post("/v1/chat/completions", &chat_body(false)).await;
    let log = gw.get_json("/admin/decisions?limit=1").await;
    assert_eq!(log["decisions"][0]["decision"]["reason"], "shadow");
    let (s, b) = status_of(put(json!({"escape_seconds": -1})).await.unwrap()).await;
    assert_eq!(s, 400);
    assert!(b["error"]["message"].as_str().unwrap().contains("escape_seconds"), "{b}");
    let (s, _) = status_of(put(json!({"distribution_seeding": true})).await.unwrap()).await;
    assert_eq!(s, 400);
    let (s, _) = status_of(put(json!({"colour": 1})).await.unwrap()).await;
    assert_eq!(s, 400);
    assert_eq!(gw.get_json("/admin/policy").await["escape_seconds"], 2.5, "unchanged after bad updates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baseline_policy_can_be_switched_on_at_runtime_to_ab_the_fleet_and_off_again() {
    let engines = [fake_engine().await, fake_engine().await, fake_engine().await];
    let gw = gateway(&base_toml(&engines.iter().map(|e| e.url()).collect::<Vec<_>>(), "")).await;
    gw.wait_for_load().await;
    let put = |v: Value| gw.client.put(gw.url("/admin/policy")).json(&v).send();
    assert_eq!(put(json!({"name": "round_robin"})).await.unwrap().status(), 200);
    let p = gw.get_json("/admin/policy").await;
    assert_eq!((p["name"].as_str(), p["mode"].as_str()), (Some("round_robin"), Some("off")));
    for _ in 0..6 {
        assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
    }
    let served: Vec<usize> = engines.iter().map(FakeEngine::requests).collect();
    assert_eq!(served, [2, 2, 2], "each engine in turn");
    let log = gw.get_json("/admin/decisions?limit=6").await;
    assert!(log["decisions"].as_array().unwrap().iter().all(|d| d["decision"]["reason"] == "round_robin"), "{log}");
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("reason=\"round_robin\""), "decisions are counted by the baseline's reason");
    let (s, b) = status_of(put(json!({"name": "power_of_two", "mode": "enforce"})).await.unwrap()).await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(put(json!({"name": "projected"})).await.unwrap().status(), 200);
    assert_eq!(gw.get_json("/admin/policy").await["mode"], "enforce", "back to the projected policy's default mode");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_can_be_added_and_removed_at_runtime() {
    let a = fake_engine().await;
    let b = fake_engine().await;
    let gw = gateway(&base_toml(&[a.url()], "")).await;
    let r = gw.client.post(gw.url("/admin/workers")).json(&json!({"url": b.url(), "id": "b"})).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let dup = gw.client.post(gw.url("/admin/workers")).json(&json!({"url": b.url(), "id": "b"})).send().await.unwrap();
    assert_eq!(dup.status(), 400);
    assert_eq!(gw.get_json("/admin/workers").await["workers"].as_array().unwrap().len(), 2);
    // Until its first load report is in, b's telemetry is missing and a may win every request: wait
    // for b's second report (so the first has been read), then both are idle and ties are drawn.
    for _ in 0..200 {
        if b.load_polls.1.load(std::sync::atomic::Ordering::SeqCst) >= 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    for _ in 0..16 {
        assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
    }
    assert!(b.requests() > 0, "the new worker takes traffic");
    let r = gw.client.delete(gw.url("/admin/workers/b")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let before = b.requests();
    for _ in 0..4 {
        gw.post("/v1/chat/completions", &chat_body(false)).await;
    }
    assert_eq!(b.requests(), before, "a removed worker gets nothing");
    assert_eq!(gw.client.delete(gw.url("/admin/workers/b")).send().await.unwrap().status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_decide_previews_without_dispatching() {
    let engine = fake_engine().await;
    engine.set(|b| b.reports_load = false);
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let before = gw.post("/admin/decide", &chat_body(false)).await.json::<Value>().await.unwrap();
    assert_eq!(before["decision"]["reason"], "fallback:missing", "no load report yet");
    engine.set(|b| b.reports_load = true);
    gw.wait_for_load().await;
    let r = gw.post("/admin/decide", &chat_body(false)).await.json::<Value>().await.unwrap();
    assert_eq!(r["endpoint"], "/v1/chat/completions");
    assert_eq!(r["decision"]["reason"], "load_only");
    assert!(r["decision"]["scores"][0]["projected_s"].is_f64());
    assert_eq!(engine.requests(), 0);
    assert!(idle(&gw.state));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_prompts_work() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "[server]\nmax_body_bytes = 2000000\n")).await;
    let prompt = "lorem ipsum dolor sit amet ".repeat(20_000);
    let body = json!({"model": "test-model", "messages": [{"role": "user", "content": prompt}]});
    assert!(serde_json::to_vec(&body).unwrap().len() > 500_000);
    let r = gw.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(engine.received.lock()[0].1.len(), serde_json::to_vec(&body).unwrap().len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_a_stream_in_flight_finish() {
    let engine = fake_engine().await;
    engine.set(|b| b.chunk_delay = Duration::from_millis(10));
    let mut gw = gateway(&base_toml(&[engine.url()], "")).await;
    let resp = gw.post("/v1/chat/completions", &chat_body(true)).await;
    let mut stream = resp.bytes_stream();
    let mut got = stream.next().await.unwrap().unwrap().to_vec();
    gw.shutdown();
    while let Some(chunk) = stream.next().await {
        got.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(String::from_utf8(got).unwrap(), recorded_stream("chat_completions_chat-completion.streaming.1"));
    tokio::time::timeout(Duration::from_secs(5), &mut gw.task).await.expect("the server stops after draining").unwrap();
    assert!(reqwest::get(gw.url("/health")).await.is_err(), "no new connections after shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_cover_requests_decisions_and_engines() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    gw.wait_for_load().await;
    gw.post("/v1/chat/completions", &chat_body(true)).await.text().await.unwrap();
    gw.post("/v1/chat/completions", &json!({"messages": 1})).await;
    let text = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for needle in [
        "kvgate_requests_total{status=\"200\",engine=\"127.0.0.1",
        "kvgate_requests_total{status=\"400\",engine=\"none\"} 1",
        "kvgate_decision_duration_seconds_count 1",
        "kvgate_decisions_total{reason=\"load_only\"} 1",
        "kvgate_upstream_ttft_seconds_count",
        "kvgate_in_flight{engine=",
        "kvgate_projected_seconds{engine=",
        "kvgate_shadow_disagreements_total 0",
        "kvgate_escapes_total 0",
        "kvgate_replications_total 0",
        "kvgate_reuses_total 0",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_report_counts_as_of_when_it_was_asked_for_not_when_it_arrived() {
    // The engine reads its (idle) load when the poll arrives and answers 150 ms later.
    let engine = fake_engine().await;
    engine.set(|b| {
        b.load_delay = Duration::from_millis(150);
        b.response_delay = Duration::from_secs(2);
    });
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    gw.wait_for_load().await;
    // Right after a poll reaches the engine, a request is dispatched there.
    let asked = engine.load_polls.0.load(Ordering::SeqCst);
    real_wait("a new load poll", || engine.load_polls.0.load(Ordering::SeqCst) > asked).await;
    let polled = engine.load_polls.0.load(Ordering::SeqCst);
    let request = {
        let (client, url) = (gw.client.clone(), gw.url("/v1/chat/completions"));
        tokio::spawn(async move { client.post(url).json(&chat_body(false)).send().await })
    };
    real_wait("the request reaching the engine", || engine.requests() == 1).await;
    // That poll's answer, measured before the request arrived, does not cover it: the request stays
    // counted as waiting until a report asked for after it says otherwise. The gateway asks for the
    // next report once it has applied an answer, and that one takes 150 ms to come back.
    real_wait("the poll's answer applied", || engine.load_polls.0.load(Ordering::SeqCst) > polled).await;
    assert_eq!(engine.load_polls.1.load(Ordering::SeqCst), polled, "the next poll is still unanswered");
    let status = gw.state.router.workers(gw.state.clock.now()).remove(0);
    assert_eq!(
        (status.waiting_requests, status.in_flight),
        (1, 1),
        "a report asked for before the request arrived hid it: {status:?}"
    );
    request.await.unwrap().unwrap();
}
