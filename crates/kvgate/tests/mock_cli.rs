//! `kvgate mock-engine` as a separate process: it announces its endpoints and serves them.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn mock_engine_announces_its_endpoints_and_serves_http() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["mock-engine", "--port", "0", "--kv-port", "0", "--replay-port", "0", "--speedup", "50"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = announced(&mut child);
    assert!(
        line.contains("kv_events tcp://") && line.contains("replay tcp://") && line.contains("block_size 16"),
        "{line}"
    );
    let addr = line.split_whitespace().nth(3).unwrap().trim_start_matches("http://").to_owned();
    let body = r#"{"model":"mock-model","max_tokens":3,"messages":[{"role":"user","content":"hello there"}]}"#;
    let resp = post_chat(&addr, body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"completion_tokens\":3"), "{resp}");
    child.kill().unwrap();
    let _ = child.wait();
}

#[test]
fn mock_engine_rejects_bad_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate")).args(["mock-engine", "--drop-events", "2"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("drop_events"), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        Command::new(env!("CARGO_BIN_EXE_kvgate")).args(["mock-engine", "--event-format", "zmq9"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--event-format"));
}

/// The line a `kvgate mock-engine` child prints with its endpoints (its stdout must be piped).
fn announced(child: &mut std::process::Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if let Some(Ok(line)) = BufReader::new(stdout).lines().next() {
            let _ = tx.send(line);
        }
    });
    rx.recv_timeout(Duration::from_secs(20)).expect("the mock engine printed its endpoints")
}

/// `POST /v1/chat/completions` with `body`, answered whole.
fn post_chat(addr: &str, body: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp
}

#[test]
fn an_smg_grpc_launch_line_runs_as_is_against_mock_grpc_workers() {
    let mut mock = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["mock-engine", "--grpc", "--port", "0", "--kv-port", "0", "--replay-port", "0", "--speedup", "50"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = announced(&mut mock);
    assert!(line.starts_with("mock engine: grpc grpc://") && line.contains(" http http://"), "{line}");
    let worker = line.split_whitespace().nth(3).unwrap().to_owned();
    // `smg launch --worker-urls grpc://... --policy cache_aware`: no tokenizer, no model path.
    let cache = std::env::temp_dir().join(format!("kvgate-mock-cli-{}", std::process::id()));
    let mut gateway = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--log-format", "json", "--port", "0", "--worker-urls", &worker, "--policy", "cache_aware"])
        .env("KVGATE_CACHE_DIR", &cache)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = support::listening_address(&mut gateway);
    let body = r#"{"model":"mock-model","max_tokens":3,"messages":[{"role":"user","content":"hello there"}]}"#;
    let resp = post_chat(&addr, body);
    let _ = std::fs::remove_dir_all(&cache);
    for child in [&mut gateway, &mut mock] {
        child.kill().unwrap();
        let _ = child.wait();
    }
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains(r#""content":" lorem ipsum dolor""#) && resp.contains(r#""completion_tokens":3"#), "{resp}");
}
