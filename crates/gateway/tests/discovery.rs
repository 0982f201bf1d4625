//! A watched workers file: engines appear, drain and change as the file does, a bad entry is
//! reported while the others load, and a stream on a drained engine runs to its end.

mod support;

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::Value;
use support::*;

fn temp_file(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-discovery-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn ids(gw: &kvgate_gateway::AppState) -> Vec<String> {
    let mut ids: Vec<String> = gw.engines.read().keys().map(ToString::to_string).collect();
    ids.sort();
    ids
}

async fn until(gw: &Gateway, what: &str, f: impl FnMut(&kvgate_gateway::AppState) -> bool) {
    assert!(gw.eventually(Duration::from_secs(5), f).await, "timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_follow_the_workers_file_and_a_drained_engine_finishes_its_streams() {
    let (fixed, a, b) = (fake_engine().await, fake_engine().await, fake_engine().await);
    // Slow enough that the file changes while the stream still runs.
    a.set(|x| x.chunk_delay = Duration::from_millis(50));
    let file = temp_file("workers.toml");
    std::fs::write(&file, format!("[[workers]]\nid = \"a\"\nurl = \"{}\"\n", a.url())).unwrap();
    let extra = format!(
        "[discovery]\nworkers_file = \"{}\"\nworkers_file_poll_ms = 100\n[[workers]]\nid = \"fixed\"\nurl = \"{}\"\n",
        file.display(),
        fixed.url()
    );
    let gw = gateway(&base_toml(&[], &extra)).await;
    until(&gw, "a from the file", |s| ids(s) == ["a", "fixed"]).await;
    // A long stream that lands on a: only a and fixed exist, and fixed is made to look busy.
    fixed.set(|x| x.load = (50, 100_000, 10));
    gw.wait_for_load().await;
    until(&gw, "fixed's load report", |s| {
        s.router.workers(s.clock.now()).iter().any(|w| w.id.as_str() == "fixed" && w.waiting_requests >= 50)
    })
    .await;
    let resp = gw.post("/v1/chat/completions", &chat_body(true)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.get_json("/admin/decisions?limit=1").await["decisions"][0]["decision"]["worker"], "a");
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    // a leaves the file, b joins, and one entry is broken.
    std::fs::write(
        &file,
        format!("[[workers]]\nid = \"b\"\nurl = \"{}\"\n\n[[workers]]\nurl = \"http://c:1\"\ncolour = 1\n", b.url()),
    )
    .unwrap();
    until(&gw, "b in and a drained", |s| ids(s) == ["b", "fixed"]).await;
    let mut rest = first.to_vec();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(rest).unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "the stream on the drained engine ran to its end: {text}");
    assert!(!text.contains("upstream_error"), "{text}");
    let status = gw.get_json("/admin/discovery").await;
    assert_eq!(status["workers"], serde_json::json!(["b"]), "{status}");
    let errors = status["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 1, "{status}");
    assert!(
        errors[0].as_str().unwrap().contains("entry 2 (http://c:1)") && errors[0].as_str().unwrap().contains("colour")
    );
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_workers_file_errors 1"), "{metrics}");
    std::fs::remove_dir_all(file.parent().unwrap()).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_file_a_changed_entry_and_a_missing_file_are_handled() {
    let (a, b) = (fake_engine().await, fake_engine().await);
    let file = temp_file("workers.json");
    std::fs::write(&file, format!(r#"[{{"id": "w", "url": "{}"}}]"#, a.url())).unwrap();
    let extra = format!("[discovery]\nworkers_file = \"{}\"\nworkers_file_poll_ms = 100\n", file.display());
    let gw = gateway(&base_toml(&[], &extra)).await;
    let url_of_w =
        |s: &kvgate_gateway::AppState| s.engines.get(&kvgate_core::WorkerId::new("w")).map(|e| e.spec.url.clone());
    until(&gw, "w", |s| url_of_w(s).as_deref() == Some(&*a.url())).await;
    // The same id now points elsewhere: the engine is replaced.
    std::fs::write(&file, format!(r#"{{"workers": [{{"id": "w", "url": "{}"}}]}}"#, b.url())).unwrap();
    until(&gw, "w moved to b", |s| url_of_w(s).as_deref() == Some(&*b.url())).await;
    assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
    assert_eq!((a.requests(), b.requests()), (0, 1));
    // The file goes away: reported, and its engines stay until it is back.
    std::fs::remove_file(&file).unwrap();
    until(&gw, "the missing file reported", |s| s.discovery.lock().errors.iter().any(|e| e.contains("cannot read")))
        .await;
    assert!(url_of_w(&gw.state).is_some(), "w stays while the file is missing");
    let r = gw.client.post(gw.url("/admin/discovery/reload")).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let status: Value = gw.get_json("/admin/discovery").await;
    assert!(status["reloads"].as_u64().unwrap() >= 3, "{status}");
    std::fs::remove_dir_all(file.parent().unwrap()).ok();
}
