//! Clients that hold connections, dribble headers or never finish their bodies: bounded, timed out,
//! and never in the way of a normal client.

#![allow(clippy::disallowed_methods)] // tests measure elapsed wall time against timeouts

mod support;

use std::time::{Duration, Instant};

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection (or `within` passes); what it sent.
async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Option<String> {
    let mut out = Vec::new();
    match tokio::time::timeout(within, s.read_to_end(&mut out)).await {
        Ok(_) => Some(String::from_utf8_lossy(&out).into_owned()),
        Err(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "[server]\nheader_timeout_ms = 300\n")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-").await.unwrap();
    let started = Instant::now();
    assert!(read_until_closed(&mut s, Duration::from_secs(10)).await.is_some(), "still open after 10 s");
    assert!(started.elapsed() >= Duration::from_millis(250));
    // An idle kept-alive connection is closed the same way.
    let mut idle = TcpStream::connect(gw.addr).await.unwrap();
    assert!(read_until_closed(&mut idle, Duration::from_secs(10)).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_gets_408() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "[server]\nbody_timeout_s = 0.3\n")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await.expect("an answer").unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(head.contains("body_timeout"), "{head}");
    assert_eq!(engine.requests(), 0);
}

/// A gateway with a 100 kB body budget, its full budget (in permits), and a slow client that
/// announced 80 kB and sent little of it, holding most of the budget.
async fn budget_mostly_held(engine: &FakeEngine) -> (Gateway, usize, TcpStream) {
    let gw = gateway(&base_toml(&[engine.url()], "[server]\nmax_buffered_body_bytes = 100000\n")).await;
    let full = gw.state.body_budget.available_permits();
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 80000\r\n\r\n{")
        .await
        .unwrap();
    let held = gw.eventually(Duration::from_secs(10), |s| s.body_budget.available_permits() < full).await;
    assert!(held, "the slow body holds its share of the budget");
    (gw, full, slow)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_bodies_share_one_bounded_buffer() {
    let engine = fake_engine().await;
    let (gw, full, slow) = budget_mostly_held(&engine).await;
    // A second large body does not fit; a small one does.
    let big = serde_json::json!({"model": "test-model", "messages": [{"role": "user", "content": "x".repeat(40_000)}]});
    let r = gw.post("/v1/chat/completions", &big).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<serde_json::Value>().await.unwrap()["error"]["code"], "gateway_out_of_resources");
    assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
    drop(slow);
    let back = gw.eventually(Duration::from_secs(10), |s| s.body_budget.available_permits() == full).await;
    assert!(back, "a client that leaves gives its share back");
    assert_eq!(gw.post("/v1/chat/completions", &big).await.status(), 200, "the budget comes back");
}

/// Sends a completions request of `prompt_bytes` in two halves, asks that nothing was answered (nor
/// the connection closed) between them, and returns the answer's status line.
async fn answer_after_the_whole_body(gw: &Gateway, prompt_bytes: usize) -> String {
    let body = format!("{{\"model\": \"test-model\", \"prompt\": \"{}\"}}", "x".repeat(prompt_bytes));
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let half = body.len() / 2;
    let mut client = TcpStream::connect(gw.addr).await.unwrap();
    client.write_all(head.as_bytes()).await.unwrap();
    client.write_all(&body.as_bytes()[..half]).await.unwrap();
    let mut early = [0u8; 64];
    let before_the_rest = tokio::time::timeout(Duration::from_millis(300), client.read(&mut early)).await;
    assert!(before_the_rest.is_err(), "answered (or closed) before the body was sent: {before_the_rest:?}");
    client.write_all(&body.as_bytes()[half..]).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), client.read(&mut answer)).await.unwrap().unwrap();
    String::from_utf8_lossy(&answer[..n]).lines().next().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_bodies_are_read_before_the_answer() {
    // Answered at the headers and closed while the client still sent its body, the connection was
    // reset under the client (a broken pipe, an incomplete message: 4 failures in 160 loaded runs
    // of the test above), which never read the answer.
    let engine = fake_engine().await;
    let (gw, _, slow) = budget_mostly_held(&engine).await;
    assert_eq!(answer_after_the_whole_body(&gw, 60_000).await, "HTTP/1.1 503 Service Unavailable");
    drop(slow);

    let small = gateway(&base_toml(&[engine.url()], "[server]\nmax_body_bytes = 4096\n")).await;
    assert_eq!(answer_after_the_whole_body(&small, 40_000).await, "HTTP/1.1 413 Payload Too Large");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_does_not_hold_shutdown_for_the_grace_period() {
    let engine = fake_engine().await;
    let toml = "[server]\nheader_timeout_ms = 300\nshutdown_grace_s = 60\n";
    let mut gw = gateway(&base_toml(&[engine.url()], toml)).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    gw.shutdown();
    tokio::time::timeout(Duration::from_secs(20), &mut gw.task)
        .await
        .expect("shut down well before the 60 s grace")
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_idle_and_dribbling_sockets_do_not_keep_a_normal_client_waiting() {
    let limit = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0);
    assert!(
        limit >= 5000,
        "this test needs 5000 file descriptors (ulimit -n); the process may raise its limit only to {limit}"
    );
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let mut held = Vec::new();
    for i in 0..2000 {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        if i % 2 == 0 {
            // Dribbling: a few header bytes, never the end.
            s.write_all(b"GET /health HTTP/1.1\r\nX-Slow: ").await.unwrap();
        }
        held.push(s);
    }
    // A normal client is still served. The timeout only tells "served" from "stuck behind them"
    // (which is what happened before: every new client timed out); latency is measured by
    // scripts/hostile-probe.sh, not asserted here.
    let body = chat_body(false);
    for _ in 0..5 {
        let served = tokio::time::timeout(Duration::from_secs(10), gw.post("/v1/chat/completions", &body));
        assert_eq!(served.await.expect("a normal client was left waiting").status(), 200);
    }
    drop(held);
}
