//! A long prompt is tokenized only as far as routing needs (`kvgate_tokenizer::routed`): up to the
//! first block no worker holds, the rest estimated. Decisions equal those of a gateway that
//! tokenizes whole; the engine gets the body unchanged; the estimate is shown and checked. With
//! DeepSeek V3's tokenizer (fetched by `scripts/fetch-test-tokenizer.sh`).

mod support;

use std::time::Duration;

use kvgate_core::WorkerId;
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use serde_json::{json, Value};
use support::*;

/// Every id of `text`, as the engine computes them (BOS included), with no cache in the way.
fn whole_ids(text: &str) -> Vec<u32> {
    let t = HfTokenizer::load(&tokenizer_path(), HfOptions { prompt_cache_bytes: Some(0), ..HfOptions::default() })
        .unwrap();
    t.encode_prompt(text, true).unwrap()
}

/// About 30 KB of prose that no test has sent before, then `question`.
fn prompt(topic: &str, question: &str) -> String {
    let body: String = (0..400)
        .map(|i| format!("Section {i} of the {topic} manual explains how engine {} keeps its blocks warm. ", i % 7))
        .collect();
    format!("{body}\nQuestion: {question}")
}

async fn gateway_in_front_of(engines: &[&FakeEngine], whole: bool) -> Gateway {
    let mut toml = format!(
        "[server]\nblock_size = 16\ntokenize_whole = {whole}\ntokenize_check_interval_ms = 1\n\
         [tokenizer]\nkind = \"hf\"\npath = \"{}\"\n[telemetry]\npoll_interval_ms = 50\nhealth_interval_ms = 100\n",
        tokenizer_path().display()
    );
    for (i, e) in engines.iter().enumerate() {
        toml.push_str(&format!("[[workers]]\nid = \"{}\"\nurl = \"{}\"\n", ["a", "b"][i], e.url()));
    }
    let gw = gateway(&toml).await;
    gw.wait_for_load().await;
    gw
}

/// `ids`' full blocks, stored on `worker` as one engine event.
fn store(gw: &Gateway, worker: &str, ids: &[u32]) {
    let blocks = ids.len() / 16;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as u64).map(|i| EngineHash(1000 + i)).collect(),
        parent_block_hash: None,
        token_ids: ids[..blocks * 16].to_vec(),
        block_size: 16,
        ..BlockStored::default()
    });
    gw.state.router.apply_kv_events(&WorkerId::new(worker), &[ev], gw.state.clock.now()).unwrap();
}

async fn last_decision(gw: &Gateway) -> Value {
    gw.get_json("/admin/decisions?limit=1").await["decisions"][0].clone()
}

async fn complete(gw: &Gateway, text: &str) -> Value {
    let body = json!({"model": "test-model", "prompt": text, "max_tokens": 8});
    let r = gw.post("/v1/completions", &body).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    last_decision(gw).await
}

#[tokio::test]
async fn a_prompt_no_worker_holds_is_routed_on_its_start_with_the_rest_estimated() {
    let engine = fake_engine().await;
    let gw = gateway_in_front_of(&[&engine], false).await;
    let text = prompt("unseen", "what does section 3 say?");
    let logged = complete(&gw, &text).await;
    let actual = whole_ids(&text).len() as f64;
    let estimated = logged["estimated_prompt_tokens"].as_u64().expect("the rest was estimated") as f64;
    let counted = logged["decision"]["prompt_tokens"].as_u64().unwrap() as f64;
    assert!(estimated > 0.9 * counted, "only the first chunk was tokenized: {logged}");
    assert!((counted / actual - 1.0).abs() < 0.25, "{counted} tokens projected for {actual}: {logged}");
    // The engine got the body as sent, and tokenizes it whole itself.
    let (path, body) = engine.received.lock().last().cloned().unwrap();
    assert_eq!(path, "/v1/completions");
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["prompt"], text.as_str());
    // The estimate was checked off the request path, and the partial prompt counted.
    let checked = gw
        .eventually(Duration::from_secs(5), |s| s.metrics.render().contains("kvgate_tokenize_estimate_ratio_count 1"))
        .await;
    assert!(checked, "the estimate was never checked");
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_tokenize_partial_prompts_total 1"), "{metrics}");
    // Whoever asks for the ids gets every one of them.
    let tokenized = gw.post("/admin/tokenize", &json!({"prompt": text})).await.json::<Value>().await.unwrap();
    let ids: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).unwrap();
    assert_eq!(ids, whole_ids(&text));
}

#[tokio::test]
async fn a_held_prefix_is_tokenized_through_and_decides_as_a_whole_tokenization_does() {
    let (a, b) = (fake_engine().await, fake_engine().await);
    let partial = gateway_in_front_of(&[&a, &b], false).await;
    let whole = gateway_in_front_of(&[&a, &b], true).await;
    let shared = prompt("shared", "first question?");
    let held = whole_ids(&shared);
    // Worker b holds the prompt's first 1,200 tokens, both gateways know it.
    for gw in [&partial, &whole] {
        store(gw, "b", &held[..1200]);
    }
    for question in ["first question?", "a different question about section 12?"] {
        let text = prompt("shared", question);
        let (p, w) = (complete(&partial, &text).await, complete(&whole, &text).await);
        assert_eq!(p["decision"]["worker"], "b", "{p}");
        assert_eq!(p["decision"]["worker"], w["decision"]["worker"]);
        assert_eq!(p["decision"]["cached_tokens"], 1200, "{p}");
        assert_eq!(p["decision"]["cached_tokens"], w["decision"]["cached_tokens"]);
        assert!(w.get("estimated_prompt_tokens").is_none(), "{w}");
        // Tokenized through the held blocks, not much further.
        let estimated = p["estimated_prompt_tokens"].as_u64().expect("the unheld rest was estimated");
        let tokenized = p["decision"]["prompt_tokens"].as_u64().unwrap() - estimated;
        assert!((1200..1200 + 1500).contains(&tokenized), "{tokenized} tokenized: {p}");
    }
}
