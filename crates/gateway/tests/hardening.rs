//! The gateway against engines that fail, stall or lie, and clients that go away: no black hole,
//! no hang, nothing leaked into labels.

mod support;

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use support::*;

async fn metrics(gw: &Gateway) -> String {
    gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap()
}

fn worker<'a>(workers: &'a Value, url: &str) -> &'a Value {
    workers["workers"].as_array().unwrap().iter().find(|w| w["url"].as_str().unwrap().starts_with(url)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_fails_every_request_loses_no_accepted_request_and_is_ejected() {
    let (good1, good2, bad) = (fake_engine().await, fake_engine().await, fake_engine().await);
    bad.set(|b| b.status = Some(500));
    let gw = gateway(&base_toml(&[good1.url(), good2.url(), bad.url()], "[telemetry]\noutlier_failures = 3\n")).await;
    gw.wait_for_load().await;
    for i in 0..60 {
        let r = gw.post("/v1/chat/completions", &chat_body(i % 2 == 0)).await;
        assert_eq!(r.status(), 200, "request {i}");
        let body = r.text().await.unwrap();
        assert!(!body.contains("upstream_error"), "request {i}: {body}");
    }
    // /health says the bad engine is fine; its answers say otherwise.
    let workers = gw.get_json("/admin/workers").await;
    let view = worker(&workers, &bad.url());
    assert_eq!(view["healthy"], false, "{view}");
    assert!(view["ejected_for_s"].as_f64().unwrap() > 0.0, "{view}");
    assert!(bad.requests() <= 4, "the failing engine drew {} requests", bad.requests());
    let m = metrics(&gw).await;
    let label = bad.url().trim_start_matches("http://").to_owned();
    assert!(m.contains(&format!("kvgate_ejections_total{{engine=\"{label}\"}} 1")), "{m}");
    assert!(m.contains(&format!("kvgate_upstream_failures_total{{engine=\"{label}\"}} 3")), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_engine_in_rotation_is_never_ejected() {
    let bad = fake_engine().await;
    bad.set(|b| b.status = Some(503));
    let gw = gateway(&base_toml(&[bad.url()], "[telemetry]\noutlier_failures = 2\n")).await;
    for _ in 0..4 {
        let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
        assert_eq!(r.status(), 502);
        assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "upstream_error");
    }
    let workers = gw.get_json("/admin/workers").await;
    assert_eq!(worker(&workers, &bad.url())["healthy"], true, "ejecting it would turn 502s into 503s and hide it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_429_is_passed_through_with_its_retry_after() {
    let engine = fake_engine().await;
    engine.set(|b| {
        b.status = Some(429);
        b.retry_after = Some("7".into());
    });
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    let workers = gw.get_json("/admin/workers").await;
    assert_eq!(worker(&workers, &engine.url())["consecutive_request_failures"], 0, "a 429 is not a fault");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nonstandard_engine_status_becomes_a_502() {
    let engine = fake_engine().await;
    engine.set(|b| b.status = Some(999));
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
    assert_eq!(r.status(), 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_stalls_after_its_headers_is_cut_off() {
    let engine = fake_engine().await;
    engine.set(|b| b.stall_after_headers = true);
    let gw = gateway(&base_toml(&[engine.url()], "[server]\nstream_idle_timeout_s = 1\nrequest_timeout_s = 1\n")).await;
    // Streaming: the first event arrives, then silence; the stream ends with an error event.
    let resp = gw.post("/v1/chat/completions", &chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(10), resp.text()).await.expect("the stream ended").unwrap();
    let last = events(&text).pop().unwrap();
    assert!(last.starts_with("data: {\"error\"") && last.contains("upstream_timeout"), "{text}");
    // Not streaming: the headers arrive, the body never does.
    let resp = tokio::time::timeout(Duration::from_secs(10), gw.post("/v1/chat/completions", &chat_body(false)))
        .await
        .expect("the request ended");
    assert_eq!(resp.status(), 504);
    assert!(gw.eventually(Duration::from_secs(3), |s| s.router.in_flight() == 0).await, "reservations released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_mid_line_gets_its_error_as_an_event_of_its_own() {
    let engine = fake_engine().await;
    engine.set(|b| {
        b.chat_stream = "data: {\"a\":1}\n\ndata: {\"cho".into();
        b.fail_after = Some(2);
    });
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let text = gw.post("/v1/chat/completions", &chat_body(true)).await.text().await.unwrap();
    assert!(text.starts_with("data: {\"a\":1}\n\ndata: {\"cho\n\ndata: {\"error\""), "{text:?}");
    assert!(text.ends_with("}\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_a_non_streaming_request_counts_as_499() {
    let engine = fake_engine().await;
    engine.set(|b| b.response_delay = Duration::from_millis(800));
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(200)).build().unwrap();
    assert!(impatient.post(gw.url("/v1/chat/completions")).json(&chat_body(false)).send().await.is_err());
    assert!(gw.eventually(Duration::from_secs(3), |s| s.router.in_flight() == 0).await);
    let m = metrics(&gw).await;
    assert!(m.contains("status=\"499\""), "{m}");
    assert!(!m.contains("status=\"502\""), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_larger_than_every_engines_kv_cache_is_refused() {
    let engine = fake_engine().await;
    let toml = format!("[[workers]]\nurl = \"{}\"\nkv_capacity_tokens = 1000\n", engine.url());
    let gw = gateway(&base_toml(&[], &toml)).await;
    let long: String = (0..3000).map(|i| format!("w{i} ")).collect();
    let body = json!({"model": "test-model", "messages": [{"role": "user", "content": long}]});
    let r = gw.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 400);
    let err = r.json::<Value>().await.unwrap();
    assert_eq!(err["error"]["code"], "context_length_exceeded");
    assert!(err["error"]["message"].as_str().unwrap().contains("1000 tokens"), "{err}");
    assert_eq!(engine.requests(), 0, "never forwarded");
    assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_a_worker_url_stay_out_of_metrics_admin_and_names() {
    let engine = fake_engine().await;
    let url = engine.url().replace("http://", "http://user:s3cret@");
    let gw = gateway(&base_toml(&[url], "")).await;
    for stream in [false, true] {
        let r = gw.post("/v1/chat/completions", &chat_body(stream)).await;
        assert_eq!(r.status(), 200);
        let _ = r.bytes_stream().collect::<Vec<_>>().await;
    }
    let m = metrics(&gw).await;
    assert!(m.contains(&format!("engine=\"{}\"", engine.addr)), "{m}");
    let admin = gw.client.get(gw.url("/admin/workers")).send().await.unwrap().text().await.unwrap();
    for text in [&m, &admin] {
        assert!(!text.contains("s3cret") && !text.contains("user:"), "{text}");
    }
}

/// Sends requests until the engine at `url` is out of rotation; each one still succeeds elsewhere.
async fn fail_until_ejected(gw: &Gateway, url: &str) -> Value {
    for i in 0..40 {
        let r = gw.post("/v1/chat/completions", &chat_body(false)).await;
        assert_eq!(r.status(), 200, "request {i} is retried on the healthy engine");
        let workers = gw.get_json("/admin/workers").await;
        if worker(&workers, url)["healthy"] == false {
            return worker(&workers, url).clone();
        }
    }
    panic!("40 requests and {url} is still in rotation");
}

async fn in_rotation(gw: &Gateway, url: &str) -> bool {
    worker(&gw.get_json("/admin/workers").await, url)["healthy"] == true
}

/// Moves a paused clock by `d` once nothing is in flight (a request in flight when time jumps would
/// time out), and lets the health checks that fall due run.
async fn advance(d: Duration) {
    real_sleep(Duration::from_millis(20)).await;
    tokio::time::advance(d).await;
    real_sleep(Duration::from_millis(50)).await;
}

#[tokio::test(start_paused = true)]
async fn an_ejection_lasts_its_time_and_doubles_when_the_engine_fails_again_on_return() {
    let _frozen = freeze();
    let (good, bad) = (fake_engine().await, fake_engine().await);
    bad.set(|b| b.status = Some(500));
    let toml = "[telemetry]\noutlier_failures = 2\noutlier_ejection_s = 10\n";
    let gw = gateway(&base_toml(&[good.url(), bad.url()], toml)).await;
    let bad_url = bad.url();
    let first = fail_until_ejected(&gw, &bad_url).await;
    assert_eq!(first["ejected_for_s"], 10.0, "{first}");
    assert_eq!(bad.requests(), 2, "ejected after 2 failures in a row");
    // Its /health says it is fine all along: only the ejection's time brings it back.
    advance(Duration::from_millis(9_800)).await;
    assert!(!in_rotation(&gw, &bad.url()).await, "still ejected at 9.8 s");
    advance(Duration::from_millis(400)).await;
    real_wait_async("the engine back in rotation after 10 s", || in_rotation(&gw, &bad_url)).await;
    // It fails again at once: the second ejection in a row lasts twice as long.
    let second = fail_until_ejected(&gw, &bad.url()).await;
    assert_eq!(second["ejected_for_s"], 20.0, "{second}");
    assert_eq!(bad.requests(), 4);
    advance(Duration::from_millis(10_200)).await;
    assert!(!in_rotation(&gw, &bad.url()).await, "still ejected at 10.2 s of 20");
    advance(Duration::from_millis(10_000)).await;
    real_wait_async("the engine back after 20 s", || in_rotation(&gw, &bad_url)).await;
}
