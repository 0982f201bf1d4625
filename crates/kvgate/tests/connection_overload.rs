//! `kvgate serve` limited to 1,024 file descriptors is flooded with sockets that each send one byte
//! of a request and then nothing: 1,200, then 5,000. Streams already in flight all finish, and a
//! normal client's requests, each on a new connection, are all answered: the gateway caps its
//! connections to what its descriptors carry and closes the oldest idle sockets to make room.

#![allow(clippy::disallowed_methods)] // the client times its own requests, for the report only

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvgate_mock_engine::{MockConfig, MockEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The gateway's descriptors: a common default `LimitNOFILE`.
const GATEWAY_FDS: u64 = 1024;
/// Streams in flight through the whole flood.
const STREAMS: usize = 16;
/// Requests of the normal client per flood.
const CLIENT_REQUESTS: usize = 40;
/// Far longer than the gateway needs, and far shorter than the header timeout the test configures
/// (60 s): a gateway that only frees descriptors when idle sockets time out misses it.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Sends `request` on a new connection and reads until the gateway closes it.
async fn exchange(addr: &str, request: String) -> Result<String, String> {
    let mut s = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    s.write_all(request.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.map_err(|e| format!("read: {e}"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn chat(max_tokens: u32, stream: bool) -> String {
    let body = format!(
        r#"{{"model":"mock-model","max_tokens":{max_tokens},"stream":{stream},"messages":[{{"role":"user","content":"hello there"}}]}}"#
    );
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Opens `n` sockets that each send the first byte of a request; those the gateway has not closed
/// stay open until dropped.
async fn flood(addr: &str, n: usize) -> Vec<TcpStream> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let addr = addr.to_owned();
            tokio::spawn(async move {
                let mut s =
                    tokio::time::timeout(Duration::from_secs(20), TcpStream::connect(&addr)).await.ok()?.ok()?;
                s.write_all(b"P").await.ok()?;
                Some(s)
            })
        })
        .collect();
    let mut held = Vec::new();
    for t in tasks {
        held.extend(t.await.expect("flood task"));
    }
    held
}

/// The value of a metric line `name` (with its labels) in a Prometheus text page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_never_finish_their_headers_never_starve_a_client() {
    let needed = 5_000 + 3 * GATEWAY_FDS;
    let limit = rlimit::increase_nofile_limit(needed).expect("read the test's own descriptor limit");
    assert!(
        limit >= needed,
        "this test holds 5,000 sockets and needs a descriptor limit of {needed}; the hard limit is {limit} (raise it: ulimit -Hn)"
    );
    // Real time: a stream of 400 tokens lasts seconds, through both floods.
    let engine = MockEngine::start(MockConfig { speedup: 1.0, ..MockConfig::default() }).await.unwrap();
    let config = std::env::temp_dir().join(format!("kvgate-overload-{}.toml", std::process::id()));
    std::fs::write(&config, "[server]\nheader_timeout_ms = 60000\n").unwrap();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -n {GATEWAY_FDS} && exec {} serve --config {} --log-format json --port 0 --admission-wait-s 0 --worker {}",
            env!("CARGO_BIN_EXE_kvgate"),
            config.display(),
            engine.url
        ))
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("bash");
    let addr = support::listening_address(&mut child);

    let streams: Vec<_> = (0..STREAMS)
        .map(|_| {
            let addr = addr.clone();
            tokio::spawn(async move { exchange(&addr, chat(400, true)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    for sockets in [1_200, 5_000] {
        let held = flood(&addr, sockets).await;
        assert!(held.len() >= 1_000, "only {} of {sockets} flood sockets connected", held.len());
        let mut latencies = Vec::new();
        for i in 0..CLIENT_REQUESTS {
            let started = Instant::now();
            let answer = tokio::time::timeout(ANSWER_WITHIN, exchange(&addr, chat(4, false)))
                .await
                .unwrap_or_else(|_| {
                    panic!("with {sockets} flood sockets, request {i} had no answer in {ANSWER_WITHIN:?}")
                })
                .unwrap_or_else(|e| panic!("with {sockets} flood sockets, request {i} failed: {e}"));
            assert!(answer.starts_with("HTTP/1.1 200"), "with {sockets} flood sockets, request {i}: {answer}");
            latencies.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        latencies.sort_by(f64::total_cmp);
        eprintln!(
            "{sockets} flood sockets ({} connected): the client's p50 {:.1} ms, max {:.1} ms",
            held.len(),
            latencies[latencies.len() / 2],
            latencies[latencies.len() - 1]
        );
        drop(held);
    }

    let mut unfinished = 0;
    for (i, s) in streams.into_iter().enumerate() {
        let answer = s.await.unwrap().unwrap_or_else(|e| panic!("stream {i}: {e}"));
        assert!(answer.starts_with("HTTP/1.1 200"), "stream {i}: {answer}");
        if !answer.contains("data: [DONE]") {
            unfinished += 1;
        }
    }
    assert_eq!(unfinished, 0, "streams in flight were cut by the flood");

    let page = exchange(&addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".into()).await.unwrap();
    let cap = metric(&page, "kvgate_connections_cap").expect("kvgate_connections_cap");
    assert_eq!(cap, kvgate_gateway::connection_cap(16_384, Some(GATEWAY_FDS)) as f64);
    let shed = metric(&page, r#"kvgate_connections_shed_total{reason="cap"}"#).unwrap_or(0.0)
        + metric(&page, r#"kvgate_connections_shed_total{reason="pressure_timeout"}"#).unwrap_or(0.0);
    assert!(shed >= 5_000.0 - cap, "the flood sockets past the cap were shed to make room: {shed}");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&config);
}
