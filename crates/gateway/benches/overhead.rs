//! Gateway overhead against direct-to-engine on loopback: added latency to the first byte of a
//! stream at 1 and at 256 concurrent streams, and requests per second through the gateway.
//!
//! Run: `cargo bench -p kvgate-gateway --bench overhead` (fake engine, gateway and client share the
//! machine's cores; figures are ratios against the direct path measured in the same run).

#![allow(missing_docs, clippy::disallowed_methods)] // a benchmark harness measures wall time

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::json;
use support::*;

async fn ttfb(client: &reqwest::Client, url: &str, body: &[u8]) -> Duration {
    let start = Instant::now();
    let resp = client.post(url).header("content-type", "application/json").body(body.to_vec()).send().await.unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    let t = start.elapsed();
    while stream.next().await.is_some() {}
    t
}

async fn ttfb_round(client: &reqwest::Client, url: &str, body: &[u8], concurrency: usize, rounds: usize) -> Vec<f64> {
    let mut all = Vec::new();
    for _ in 0..rounds {
        let futs = (0..concurrency).map(|_| ttfb(client, url, body));
        all.extend(futures_util::future::join_all(futs).await.into_iter().map(|d| d.as_secs_f64() * 1000.0));
    }
    all.sort_by(f64::total_cmp);
    all
}

fn pct(v: &[f64], q: f64) -> f64 {
    v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
}

async fn rps(client: &reqwest::Client, url: &str, body: &[u8], concurrency: usize, total: usize) -> f64 {
    let start = Instant::now();
    let per = total / concurrency;
    let tasks = (0..concurrency).map(|_| {
        let (client, url, body) = (client.clone(), url.to_owned(), body.to_vec());
        tokio::spawn(async move {
            for _ in 0..per {
                let r = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .unwrap();
                assert!(r.status().is_success());
                r.bytes().await.unwrap();
            }
        })
    });
    futures_util::future::join_all(tasks).await;
    (per * concurrency) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let engine = fake_engine().await;
        engine.set(|b| {
            b.chunk_delay = Duration::ZERO;
            b.chat_stream = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n".into();
        });
        let gw = gateway(&base_toml(&[engine.url()], "[policy]\nadmission_wait_s = 0\n")).await;
        gw.wait_for_load().await;
        let client = reqwest::Client::builder().pool_max_idle_per_host(512).build().unwrap();
        let stream_body = serde_json::to_vec(&json!({"model": "test-model", "stream": true, "max_tokens": 16,
            "messages": [{"role": "system", "content": "You are a helpful assistant. ".repeat(40)}, {"role": "user", "content": "Hello!"}]})).unwrap();
        let plain_body = serde_json::to_vec(&json!({"model": "test-model", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello!"}]})).unwrap();
        let direct = format!("{}/v1/chat/completions", engine.url());
        let via = gw.url("/v1/chat/completions");
        // Warm up connections on both paths.
        ttfb_round(&client, &direct, &stream_body, 32, 2).await;
        ttfb_round(&client, &via, &stream_body, 32, 2).await;

        println!("| measurement | direct | via kvgate | added |");
        println!("|---|---|---|---|");
        for (concurrency, rounds) in [(1usize, 300usize), (256, 8)] {
            let d = ttfb_round(&client, &direct, &stream_body, concurrency, rounds).await;
            let g = ttfb_round(&client, &via, &stream_body, concurrency, rounds).await;
            for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
                let (a, b) = (pct(&d, q), pct(&g, q));
                println!("| time to first byte, {concurrency} concurrent stream(s), {name} | {a:.3} ms | {b:.3} ms | {:+.3} ms |", b - a);
            }
        }
        let d = rps(&client, &direct, &plain_body, 64, 20_000).await;
        let g = rps(&client, &via, &plain_body, 64, 20_000).await;
        println!("| non-streaming requests per second, 64 concurrent | {d:.0} | {g:.0} | {:.0}% of direct |", g / d * 100.0);
    });
}
