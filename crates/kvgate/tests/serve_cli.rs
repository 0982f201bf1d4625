//! `kvgate serve` started as operators start it, in both documented forms.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Starts `kvgate serve` with `args` and returns the child and the address it logged.
fn start(args: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--log-format", "json"])
        .args(args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn kvgate serve");
    let addr = support::listening_address(&mut child);
    (child, addr)
}

fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn stop(mut child: Child) {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-TERM", &pid]).status();
    for _ in 0..100 {
        if let Ok(Some(status)) = child.try_wait() {
            assert!(status.success(), "kvgate exited with {status}");
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    panic!("kvgate did not stop on SIGTERM");
}

#[test]
fn serve_with_flags_only() {
    let (child, addr) = start(&[
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--worker",
        "http://127.0.0.1:9",
        "--worker",
        "http://127.0.0.1:10",
    ]);
    assert!(http_get(&addr, "/health").starts_with("HTTP/1.1 200"));
    let workers = http_get(&addr, "/admin/workers");
    assert!(workers.contains("127.0.0.1:9") && workers.contains("127.0.0.1:10"), "{workers}");
    stop(child);
}

#[test]
fn serve_with_a_config_file() {
    let dir = std::env::temp_dir().join(format!("kvgate-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvgate.toml");
    std::fs::write(
        &path,
        "[server]\nhost = \"127.0.0.1\"\nport = 0\n\n[policy]\nname = \"projected\"\nmode = \"shadow\"\nescape_seconds = 4.0\nescape_waiting = 16\n\n\
         [[workers]]\nurl = \"http://127.0.0.1:9\"\nkv_events = \"tcp://127.0.0.1:5557\"\nreplay = \"tcp://127.0.0.1:5558\"\ntopic = \"kv-events\"\nblock_size = 16\n",
    )
    .unwrap();
    let (child, addr) = start(&["--config", path.to_str().unwrap()]);
    let policy = http_get(&addr, "/admin/policy");
    assert!(policy.contains("\"mode\":\"shadow\"") && policy.contains("\"escape_waiting\":16"), "{policy}");
    stop(child);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_configuration_exits_with_a_message() {
    for (args, expected) in [
        (["--worker", "http://127.0.0.1:9", "--escape-seconds=-3"], "escape_seconds"),
        (["--worker", "ftp://nowhere", "--escape-seconds=3"], "scheme must be http or https"),
    ] {
        let out =
            Command::new(env!("CARGO_BIN_EXE_kvgate")).args(["serve", "--port", "0"]).args(args).output().unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{err}");
    }
    let out =
        Command::new(env!("CARGO_BIN_EXE_kvgate")).args(["serve", "--config", "/nonexistent.toml"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent.toml"));
}

#[test]
fn kv_events_are_given_on_the_command_line() {
    let (child, addr) = start(&[
        "--port",
        "0",
        "--block-size",
        "32",
        "--worker",
        "http://127.0.0.1:9,id=a,engine=vllm,kv_events=:45557,replay=:45558",
        "--worker",
        "http://127.0.0.1:10,id=b,kv_events=:45567,kv_events_bind=true",
        "--worker",
        "http://127.0.0.1:11,id=c",
        "--kv-events-port",
        "45577",
        "--replay-port",
        "45578",
    ]);
    let workers: serde_json::Value = {
        let text = http_get(&addr, "/admin/workers");
        serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap()
    };
    let list = workers["workers"].as_array().unwrap();
    assert_eq!(list.len(), 3);
    for w in list {
        assert!(w["kv_events"].is_object(), "every worker has a KV-event stream: {w}");
    }
    stop(child);
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--port", "0", "--worker", "http://127.0.0.1:9,kv_events=tcp://*:5557"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("wildcard") && err.contains("kv_events_bind"), "{err}");
}

#[test]
fn an_smg_launch_line_runs_as_is_with_kvgate_serve() {
    // `smg launch --worker-urls A B --policy cache_aware --api-key K`, plus a free port.
    let (child, addr) = start(&[
        "--worker-urls",
        "http://127.0.0.1:9",
        "http://127.0.0.1:10",
        "--policy",
        "cache_aware",
        "--api-key",
        "K",
        "--port",
        "0",
    ]);
    let workers = http_get(&addr, "/workers");
    assert!(workers.contains("\"total\":2"), "both engines, in SMG's list shape: {workers}");
    assert!(http_get(&addr, "/admin/policy").contains("\"name\":\"cache_aware\""));
    assert!(http_get(&addr, "/v1/models").starts_with("HTTP/1.1 401"), "the key guards clients, as in SMG");
    stop(child);
}

#[test]
fn an_smg_flag_kvgate_does_not_take_is_refused_with_what_to_use_instead() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["serve", "--worker-urls", "http://127.0.0.1:9", "--prometheus-port", "29000"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--prometheus-port is an SMG flag"), "{err}");
    assert!(err.contains("/metrics on its own --host and --port"), "{err}");
}

#[test]
fn sighup_rereads_the_workers_file() {
    let dir = std::env::temp_dir().join(format!("kvgate-sighup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("workers.toml");
    std::fs::write(&file, "[[workers]]\nid = \"first\"\nurl = \"http://127.0.0.1:9\"\n").unwrap();
    // Checked for changes only once an hour: the second engine can only come from the signal.
    let config = dir.join("kvgate.toml");
    std::fs::write(
        &config,
        format!("[discovery]\nworkers_file = \"{}\"\nworkers_file_poll_ms = 3600000\n", file.display()),
    )
    .unwrap();
    let (child, addr) = start(&["--port", "0", "--config", config.to_str().unwrap()]);
    let has = |id: &str| http_get(&addr, "/admin/workers").contains(&format!("\"id\":\"{id}\""));
    for _ in 0..100 {
        if has("first") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(has("first"), "the file was read at start");
    std::fs::write(&file, "[[workers]]\nid = \"second\"\nurl = \"http://127.0.0.1:10\"\n").unwrap();
    let _ = Command::new("kill").args(["-HUP", &child.id().to_string()]).status();
    for _ in 0..100 {
        if has("second") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(has("second") && !has("first"), "{}", http_get(&addr, "/admin/workers"));
    stop(child);
    std::fs::remove_dir_all(dir).ok();
}
