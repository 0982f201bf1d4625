//! The API surface beyond chat and completions: the Responses API (streaming too), embeddings,
//! rerank and SGLang's score, each forwarded to a fake engine; and OpenAI's 404 for the rest of /v1/.

mod support;

use serde_json::{json, Value};
use support::*;

async fn last_decision(gw: &Gateway) -> Value {
    gw.get_json("/admin/decisions?limit=1").await["decisions"][0]["decision"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooling_requests_are_forwarded_as_sent_and_placed_by_load_alone() {
    let (busy, idle) = (fake_engine().await, fake_engine().await);
    busy.set(|b| b.load = (40, 80_000, 10));
    let gw = gateway(&base_toml(&[busy.url(), idle.url()], "")).await;
    gw.wait_for_load().await;
    let cases = [
        ("/v1/embeddings", json!({"model": "test-model", "input": ["the first text", "and a second"]}), "data"),
        (
            "/v1/rerank",
            json!({"model": "test-model", "query": "which?", "documents": ["this one", {"text": "that one"}]}),
            "results",
        ),
        (
            "/v1/score",
            json!({"model": "test-model", "query": "q", "items": ["yes", "no"], "label_token_ids": [1, 2]}),
            "scores",
        ),
    ];
    for (i, (path, body, answer_key)) in cases.iter().enumerate() {
        let r = gw.post(path, body).await;
        assert_eq!(r.status(), 200, "{path}");
        let answer: Value = r.json().await.unwrap();
        assert!(answer.get(*answer_key).is_some(), "{path}: the engine's answer comes back: {answer}");
        let (got_path, got_body) = idle.received.lock()[i].clone();
        assert_eq!(got_path, *path);
        assert_eq!(serde_json::from_slice::<Value>(&got_body).unwrap(), *body, "{path}: forwarded unchanged");
        let d = last_decision(&gw).await;
        assert_eq!(d["reason"], "load_only", "{path}: {d}");
        assert!(d["prompt_tokens"].as_u64().unwrap() > 0, "{path}: its prefill is real work: {d}");
        assert_eq!(d["cached_tokens"], 0, "{path}");
    }
    assert_eq!(busy.requests(), 0, "the loaded engine got none");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_responses_api_is_routed_on_the_chat_it_carries_and_streams_through() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    let body = json!({"model": "test-model", "instructions": "You are terse.", "stream": true, "max_output_tokens": 9,
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}]});
    let r = gw.post("/v1/responses", &body).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    assert_eq!(r.text().await.unwrap(), RESPONSES_STREAM, "every event, in order, unchanged");
    let d = last_decision(&gw).await;
    // Tokenized as the chat completion with the same messages.
    let chat = gw.post("/admin/tokenize", &chat_body(false)).await.json::<Value>().await.unwrap();
    assert_eq!(d["prompt_tokens"], chat["count"], "{d}");
    let plain = gw.post("/v1/responses", &json!({"model": "test-model", "input": "hello"})).await;
    assert_eq!(plain.status(), 200);
    assert_eq!(plain.json::<Value>().await.unwrap()["object"], "response");
    assert_eq!(engine.received.lock()[0].0, "/v1/responses");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_name_their_field_and_unknown_v1_routes_answer_as_openai_does() {
    let engine = fake_engine().await;
    let gw = gateway(&base_toml(&[engine.url()], "")).await;
    for (path, body, param) in [
        ("/v1/embeddings", json!({"input": []}), "input"),
        ("/v1/rerank", json!({"query": "q", "documents": [3]}), "documents[0]"),
        ("/v1/score", json!({"query": "q"}), "items"),
        ("/v1/responses", json!({"input": [{"content": "no role"}]}), "input[0]"),
    ] {
        let r = gw.post(path, &body).await;
        assert_eq!(r.status(), 400, "{path}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{path}: {e}");
    }
    assert_eq!(engine.requests(), 0, "nothing invalid reached the engine");
    let r = gw.post("/v1/images/generations", &json!({"prompt": "a cat"})).await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("Invalid URL (POST /v1/images/generations)"), "{message}");
    assert!(message.contains("/v1/embeddings"), "it says what is served: {message}");
}
