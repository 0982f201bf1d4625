//! `/v1/embeddings` through a gRPC worker whose model pools: every input goes to `Embed` as the
//! ids the gateway counted, the vectors come back as SGLang's server shapes them; a generating
//! worker is never asked to embed, nor an embedding one to generate.

use std::time::Duration;

use base64::Engine as _;
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use serde_json::{json, Value};

use super::fake::*;
use super::support::tokenizer_path;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_input_is_embedded_from_the_ids_the_gateway_counted() {
    let f = embedding_fixture().await;
    let tokenizer = HfTokenizer::load(&tokenizer_path(), HfOptions::default()).unwrap();
    let texts = ["Say hello.", "And a second, longer input: 🙂"];
    let resp = f.gw.post("/v1/embeddings", &json!({"model": "fake-model", "input": texts})).await;
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    let mut prompt_tokens = 0;
    for (i, text) in texts.iter().enumerate() {
        // The engines add BOS to an embedding input, as to any raw prompt, unless told not to.
        let ids = tokenizer.encode_prompt(text, true).unwrap();
        prompt_tokens += ids.len();
        let item = &answer["data"][i];
        assert_eq!((item["index"].as_u64(), item["object"].as_str()), (Some(i as u64), Some("embedding")));
        let got: Vec<f32> = item["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(got, fake_embedding(&ids), "input {i}: {answer}");
    }
    assert_eq!(answer["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(answer["usage"]["total_tokens"], prompt_tokens);
    // SGLang's server gives neither `id` nor `created`.
    assert!(answer.get("id").is_none() && answer.get("created").is_none(), "{answer}");
    let mut sent: Vec<Vec<u32>> =
        f.seen.lock().embedded.iter().map(|r| r.tokenized.as_ref().unwrap().input_ids.clone()).collect();
    sent.sort_by_key(Vec::len);
    assert_eq!(sent, texts.iter().map(|t| tokenizer.encode_prompt(t, true).unwrap()).collect::<Vec<_>>());

    let ids = json!({"input": [[5, 6, 7]], "encoding_format": "base64", "add_special_tokens": false});
    let answer: Value = f.gw.post("/v1/embeddings", &ids).await.json().await.unwrap();
    let b64 = answer["data"][0]["embedding"].as_str().unwrap_or_else(|| panic!("{answer}"));
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
    let back: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(back, fake_embedding(&[5, 6, 7]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_embed_cannot_carry_is_refused_before_it_is_sent() {
    let f = embedding_fixture().await;
    for (field, value) in [("dimensions", json!(2)), ("truncate_prompt_tokens", json!(3)), ("priority", json!(5))] {
        let mut body = json!({"input": "Say hello."});
        body[field] = value;
        let resp = f.gw.post("/v1/embeddings", &body).await;
        assert_eq!(resp.status(), 400);
        let err: Value = resp.json().await.unwrap();
        assert_eq!(err["error"]["param"], field, "{err}");
    }
    assert!(f.seen.lock().embedded.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_asked_only_for_what_its_model_does() {
    let embedding = embedding_fixture().await;
    let resp = embedding.gw.post("/v1/chat/completions", &chat(false, json!({}))).await;
    assert_eq!(resp.status(), 400);
    let err = resp.text().await.unwrap();
    assert!(err.contains("needs a worker whose model generates"), "{err}");
    assert!(embedding.seen.lock().generated.is_empty());

    let generating = fixture(Duration::from_millis(2)).await;
    let resp = generating.gw.post("/v1/embeddings", &json!({"input": "Say hello."})).await;
    assert_eq!(resp.status(), 400);
    let err = resp.text().await.unwrap();
    assert!(err.contains("needs a worker whose model pools"), "{err}");
    assert!(generating.seen.lock().embedded.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn score_and_rerank_go_to_a_worker_whose_model_pools_and_sglang_says_it_cannot() {
    // The fake worker is SGLang's: its server scores only with a cross-encoder or a generating
    // model, which `Embed` does not carry (vLLM workers score by cosine: the real-engine suite).
    let embedding = embedding_fixture().await;
    // vLLM's other paths for them are answered too.
    let asks = [
        ("/v1/score", json!({"text_1": "a", "text_2": ["b", "c"]})),
        ("/score", json!({"queries": "a", "documents": "b"})),
        ("/v1/rerank", json!({"query": "a", "documents": ["b", "c"]})),
        ("/v2/rerank", json!({"query": "a", "documents": "b"})),
    ];
    for (path, body) in &asks {
        let resp = embedding.gw.post(path, body).await;
        assert_eq!(resp.status(), 400, "{path}");
        let err = resp.text().await.unwrap();
        assert!(err.contains("not served by SGLang gRPC workers"), "{path}: {err}");
    }
    assert!(embedding.seen.lock().embedded.is_empty(), "refused before anything is sent");

    let generating = fixture(Duration::from_millis(2)).await;
    for (path, body) in &asks {
        let resp = generating.gw.post(path, body).await;
        assert_eq!(resp.status(), 400, "{path}");
        let err = resp.text().await.unwrap();
        assert!(err.contains("needs a vLLM worker whose model pools"), "{path}: {err}");
    }
}
