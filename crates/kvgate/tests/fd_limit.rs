//! `kvgate serve` with far too few file descriptors (`ulimit -n 64`) in front of three healthy
//! engines: the shortage is the gateway's, so it answers 503 `gateway_out_of_resources` or makes
//! clients wait, and never takes an engine out of rotation.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use kvgate_mock_engine::{MockConfig, MockEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request over a fresh connection; the status line and body, or `None` if the connection failed.
async fn request(addr: &str, method: &str, path: &str, body: &str) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out)).await.ok()?.ok()?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_blames_no_engine() {
    let mut engines = Vec::new();
    for seed in 1..=3 {
        engines.push(MockEngine::start(MockConfig { speedup: 20.0, seed, ..MockConfig::default() }).await.unwrap());
    }
    let workers: Vec<String> = engines.iter().flat_map(|e| ["--worker".to_owned(), e.url.clone()]).collect();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -n 64 && exec {} serve --log-format json --port 0 --admission-wait-s 0 --health-interval-ms 200 {}",
            env!("CARGO_BIN_EXE_kvgate"),
            workers.join(" ")
        ))
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("bash");
    let addr = support::listening_address(&mut child);
    let body =
        r#"{"model":"mock-model","max_tokens":200,"stream":true,"messages":[{"role":"user","content":"hello there"}]}"#;
    // Far more streams than 64 descriptors can carry at once.
    let tasks: Vec<_> = (0..80)
        .map(|_| {
            let addr = addr.clone();
            tokio::spawn(async move { request(&addr, "POST", "/v1/chat/completions", body).await })
        })
        .collect();
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    for t in tasks {
        let answer = t.await.unwrap().unwrap_or_else(|| "no answer".into());
        let status = answer.lines().next().unwrap_or_default().to_owned();
        let code = ["no_engine_available", "gateway_out_of_resources", "upstream_error"]
            .into_iter()
            .find(|c| answer.contains(c));
        let status = format!("{status} {}", code.unwrap_or(""));
        *statuses.entry(status).or_default() += 1;
    }
    let expected = ["HTTP/1.1 200 OK ", "HTTP/1.1 503 Service Unavailable gateway_out_of_resources"];
    assert!(statuses.keys().all(|s| expected.contains(&s.as_str())), "{statuses:?}");
    assert!(statuses.get(expected[0]).copied().unwrap_or(0) > 0, "{statuses:?}");
    let workers = request(&addr, "GET", "/admin/workers", "").await.expect("admin answers");
    let json = &workers[workers.find("\r\n\r\n").unwrap() + 4..];
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|_| panic!("{workers}"));
    for w in v["workers"].as_array().unwrap() {
        assert_eq!(w["healthy"], true, "a healthy engine was taken out: {w}");
    }
    let _ = child.kill();
    let _ = child.wait();
    eprintln!("statuses with 64 descriptors: {statuses:?}");
}
