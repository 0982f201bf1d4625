//! What an SMG user's scripts and engines expect: SMG's worker control API with its JSON shapes, and
//! `--api-key` sent to the engines as SMG sends it.

mod support;

use serde_json::{json, Value};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smgs_worker_api_lists_adds_and_removes_workers_with_smgs_shapes() {
    let (a, b) = (fake_engine().await, fake_engine().await);
    let gw = gateway(&base_toml(&[a.url()], "[security]\nadmin_key = \"ops\"\n")).await;
    let ops = |r: reqwest::RequestBuilder| r.bearer_auth("ops");
    assert_eq!(gw.client.get(gw.url("/workers")).send().await.unwrap().status(), 401, "the admin key guards it");
    gw.wait_for_load().await;
    assert!(
        gw.eventually(std::time::Duration::from_secs(3), |s| !s.engines.models().is_empty()).await,
        "models listed"
    );
    let list: Value = ops(gw.client.get(gw.url("/workers"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(list["total"], 1, "{list}");
    assert_eq!(list["stats"]["regular_count"], 1);
    let w = &list["workers"][0];
    assert_eq!(
        (w["url"].as_str(), w["is_healthy"].as_bool(), w["status"].as_str()),
        (Some(&*a.url()), Some(true), Some("ready"))
    );
    assert_eq!(w["model_id"], "test-model", "{w}");
    // Add: 202 with a location, as SMG answers; the worker serves at once.
    let r =
        ops(gw.client.post(gw.url("/workers"))).json(&json!({"url": b.url(), "priority": 50})).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let location = r.headers()["location"].to_str().unwrap().to_owned();
    let added: Value = r.json().await.unwrap();
    assert_eq!(added["status"], "accepted");
    assert_eq!(format!("/workers/{}", added["worker_id"].as_str().unwrap()), location);
    let one = ops(gw.client.get(gw.url(&location))).send().await.unwrap();
    assert_eq!(one.status(), 200);
    assert_eq!(one.json::<Value>().await.unwrap()["url"], b.url());
    // SMG's errors keep SMG's shape.
    let bad = ops(gw.client.post(gw.url("/workers"))).json(&json!({"nourl": 1})).send().await.unwrap();
    assert_eq!(bad.status(), 400);
    let e: Value = bad.json().await.unwrap();
    assert_eq!(e["code"], "BAD_REQUEST");
    assert!(e["error"].as_str().unwrap().contains("url"), "{e}");
    let dup = ops(gw.client.post(gw.url("/workers"))).json(&json!({"url": b.url()})).send().await.unwrap();
    assert!(dup.status().is_client_error(), "{}", dup.status());
    let pd = ops(gw.client.post(gw.url("/workers"))).json(&json!({"url": "http://c:1", "worker_type": "prefill"}));
    assert_eq!(pd.send().await.unwrap().status(), 400);
    // Remove.
    let r = ops(gw.client.delete(gw.url(&location))).send().await.unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "accepted");
    let gone = ops(gw.client.delete(gw.url(&location))).send().await.unwrap();
    assert_eq!(gone.status(), 404);
    assert_eq!(gone.json::<Value>().await.unwrap()["code"], "WORKER_NOT_FOUND");
    let list: Value = ops(gw.client.get(gw.url("/workers"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(list["total"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_api_key_guards_clients_and_is_sent_to_the_engines_as_smg_does() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "[security]\napi_keys = [\"K\"]\n")).await;
    gw.wait_for_load().await;
    let post = |key: Option<&str>| {
        let r = gw.client.post(gw.url("/v1/chat/completions")).json(&chat_body(false));
        match key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    };
    assert_eq!(post(None).send().await.unwrap().status(), 401);
    assert_eq!(post(Some("K")).send().await.unwrap().status(), 200);
    let probed = |s: &kvgate_gateway::AppState| {
        let _ = s;
        engine.authorization.lock().iter().any(|(p, _)| p == "/health")
    };
    assert!(gw.eventually(std::time::Duration::from_secs(3), probed).await, "a health probe arrived");
    let seen = engine.authorization.lock().clone();
    for path in ["/health", "/v1/loads", "/v1/chat/completions"] {
        let auth: Vec<_> = seen.iter().filter(|(p, _)| p == path).map(|(_, a)| a.clone()).collect();
        assert!(!auth.is_empty(), "no {path} seen: {seen:?}");
        assert!(auth.iter().all(|a| a.as_deref() == Some("Bearer K")), "{path}: {auth:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_separate_worker_key_or_none_at_all_can_be_configured() {
    let (e1, e2) = (fake_engine().await, fake_engine().await);
    let own =
        gateway(&base_toml(&[e1.url()], "[security]\napi_keys = [\"K\"]\nworker_api_key = \"engine-secret\"\n")).await;
    own.wait_for_load().await;
    assert!(!e1.authorization.lock().is_empty());
    assert!(e1.authorization.lock().iter().all(|(_, a)| a.as_deref() == Some("Bearer engine-secret")));
    let none = gateway(&base_toml(&[e2.url()], "[security]\napi_keys = [\"K\"]\nworker_api_key = \"\"\n")).await;
    none.wait_for_load().await;
    assert!(!e2.authorization.lock().is_empty());
    assert!(e2.authorization.lock().iter().all(|(_, a)| a.is_none()), "{:?}", e2.authorization.lock());
}
