//! Hostile probes of a running gateway, one role per process so that no process needs the file
//! descriptors of all three (scripts/hostile-probe.sh runs them):
//!
//! - `engine PORT`: an engine that streams slowly (20 events, 250 ms apart) and answers at once when
//!   not streaming;
//! - `streams URL N`: N concurrent streams through the gateway; counts the ones that end cleanly;
//! - `idle URL N`: N idle or dribbling sockets held open while a normal client sends 200 requests;
//!   prints the normal client's latency.
//! - `flood URL N`: N sockets that each send one byte of a request and then nothing, then 200
//!   requests from a normal client, each on a new connection; prints its latency.

#![allow(clippy::disallowed_methods)] // a probe measures wall time

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::{get, post};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

fn body(stream: bool) -> Value {
    json!({"model": "probe", "stream": stream, "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]})
}

async fn engine(port: u16) {
    let chat = post(|b: Bytes| async move {
        let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        if v["stream"].as_bool() != Some(true) {
            let done = json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]});
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(done.to_string()))
                .unwrap();
        }
        let events = futures_util::stream::unfold(0, |i| async move {
            if i == 21 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            let e = if i == 20 {
                "data: [DONE]\n\n".to_owned()
            } else {
                format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n")
            };
            Some((Ok::<_, std::io::Error>(Bytes::from(e)), i + 1))
        });
        Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(events)).unwrap()
    });
    let app = axum::Router::new()
        .route("/v1/chat/completions", chat)
        .route("/health", get(|| async { "ok" }))
        .route("/v1/models", get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "probe"}]})) }));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind");
    axum::serve(listener, app).await.expect("serve");
}

async fn streams(url: String, n: usize) {
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let resp = client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body(true))
                    .send()
                    .await
                    .map_err(|e| format!("send: {e:?}"))?;
                if resp.status() != 200 {
                    return Err(format!("status {}: {}", resp.status(), resp.text().await.unwrap_or_default()));
                }
                let mut text = Vec::new();
                let mut s = resp.bytes_stream();
                while let Some(chunk) = s.next().await {
                    text.extend_from_slice(&chunk.map_err(|e| format!("stream: {e}"))?);
                }
                let text = String::from_utf8_lossy(&text).into_owned();
                if text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\"") {
                    Ok(())
                } else {
                    Err(format!("incomplete: {}", &text[text.len().saturating_sub(200)..]))
                }
            })
        })
        .collect();
    let mut ok = 0;
    let mut errors: std::collections::BTreeMap<String, usize> = Default::default();
    for t in tasks {
        match t.await {
            Ok(Ok(())) => ok += 1,
            Ok(Err(e)) => *errors.entry(e.chars().take(160).collect()).or_default() += 1,
            Err(e) => *errors.entry(e.to_string()).or_default() += 1,
        }
    }
    for (e, count) in errors.iter().take(5) {
        println!("  {count} × {e}");
    }
    println!("streams: {n} concurrent, {ok} complete, {} failed, {:.1} s", n - ok, started.elapsed().as_secs_f64());
}

/// 200 small requests one after another; their latency percentiles and how many failed (not 200,
/// or no answer within 5 s).
async fn normal_client(client: &reqwest::Client, url: &str) -> String {
    let mut latencies = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            client.post(format!("{url}/v1/chat/completions")).json(&body(false)).send(),
        )
        .await;
        let ok = matches!(&r, Ok(Ok(r)) if r.status() == 200);
        if let Ok(Ok(r)) = r {
            let _ = r.bytes().await;
        }
        latencies.push((t.elapsed(), ok));
    }
    let failed = latencies.iter().filter(|(_, ok)| !ok).count();
    let mut ms: Vec<f64> = latencies.iter().map(|(d, _)| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q) as usize];
    format!("p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms, {failed} failed or over 5 s of 200", at(0.5), at(0.99), at(1.0))
}

async fn idle(url: String, n: usize) {
    let addr = url.trim_start_matches("http://").to_owned();
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let Ok(mut s) = tokio::net::TcpStream::connect(&addr).await else {
            println!("idle: could connect only {i} sockets");
            break;
        };
        if i % 2 == 0 {
            let _ = s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: probe\r\nX-Slow: ").await;
        }
        held.push(s);
    }
    let client = reqwest::Client::new();
    let latency = normal_client(&client, &url).await;
    println!("idle: {} sockets held ({} dribbling); a normal client: {latency}", held.len(), held.len().div_ceil(2));
    drop(held);
}

async fn flood(url: String, n: usize) {
    let addr = url.trim_start_matches("http://").to_owned();
    let connects: Vec<_> = (0..n)
        .map(|_| {
            let addr = addr.clone();
            tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(&addr).await.ok()?;
                s.write_all(b"P").await.ok()?;
                Some(s)
            })
        })
        .collect();
    let mut held = Vec::with_capacity(n);
    for c in connects {
        held.extend(c.await.ok().flatten());
    }
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let latency = normal_client(&client, &url).await;
    println!(
        "flood: {} of {n} one-byte sockets connected; a normal client, new connection each: {latency}",
        held.len()
    );
    drop(held);
}

#[tokio::main]
async fn main() {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let number = |i: usize| arg(i).parse::<usize>().expect("a number");
    match arg(0).as_str() {
        "engine" => engine(number(1) as u16).await,
        "streams" => streams(arg(1), number(2)).await,
        "idle" => idle(arg(1), number(2)).await,
        "flood" => flood(arg(1), number(2)).await,
        _ => eprintln!("usage: hostile_probe engine PORT | streams URL N | idle URL N | flood URL N"),
    }
}
