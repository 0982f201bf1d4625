//! `kvgate mock-engine` as a separate process: it announces its endpoints and serves them.

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
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if let Some(Ok(line)) = BufReader::new(stdout).lines().next() {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(20)).expect("the mock engine printed its endpoints");
    assert!(
        line.contains("kv_events tcp://") && line.contains("replay tcp://") && line.contains("block_size 16"),
        "{line}"
    );
    let addr = line.split_whitespace().nth(3).unwrap().trim_start_matches("http://").to_owned();
    let body = r#"{"model":"mock-model","max_tokens":3,"messages":[{"role":"user","content":"hello there"}]}"#;
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
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
