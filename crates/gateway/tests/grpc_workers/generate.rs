//! SGLang's `/generate` through a gRPC worker: the text, ids and `meta_info` SGLang's server
//! gives, whole and streamed with the whole text in each event; several sequences and their log
//! probabilities as SGLang's server lists them; batches and prompt logprobs refused by name.

use std::time::Duration;

use serde_json::{json, Value};

use super::fake::*;

/// A `/generate` stream's events, `[DONE]` left out.
fn events(sse: &str) -> Vec<Value> {
    sse.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_answers_as_sglangs_server_whole_and_streamed() {
    let f = fixture(Duration::from_millis(2)).await;
    let body =
        json!({"text": "Say hello.", "rid": "mine", "sampling_params": {"max_new_tokens": 64, "temperature": 0}});
    let resp = f.gw.post("/generate", &body).await;
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["text"], OUTPUT, "{answer}");
    let meta = &answer["meta_info"];
    assert_eq!(meta["id"], "mine");
    assert_eq!(meta["finish_reason"]["type"], "stop", "{answer}");
    let sent = f.seen.lock().generated[0].clone();
    let eos = answer["output_ids"].as_array().unwrap().last().cloned().unwrap();
    assert_eq!(meta["finish_reason"]["matched"], eos, "the EOS it stopped on: {answer}");
    assert_eq!(meta["prompt_tokens"], sent.tokenized.unwrap().input_ids.len());
    assert_eq!(meta["completion_tokens"], answer["output_ids"].as_array().unwrap().len());
    assert_eq!(sent.sampling_params.unwrap().max_new_tokens, Some(64));

    let body = json!({"text": "Say hello.", "stream": true, "sampling_params": {"max_new_tokens": 5}});
    let sse = f.gw.post("/generate", &body).await.text().await.unwrap();
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    let events = events(&sse);
    assert!(events.len() > 1, "{sse}");
    for pair in events.windows(2) {
        assert!(pair[1]["text"].as_str().unwrap().starts_with(pair[0]["text"].as_str().unwrap()), "{sse}");
    }
    let last = events.last().unwrap();
    assert_eq!(last["meta_info"]["finish_reason"], json!({"type": "length", "length": 5}), "{sse}");
    assert_eq!(last["output_ids"].as_array().unwrap().len(), 5, "{sse}");
    assert!(events[..events.len() - 1].iter().all(|e| e["meta_info"]["finish_reason"].is_null()), "{sse}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_sequences_and_their_logprobs_come_as_sglangs_server_lists_them() {
    let f = fixture(Duration::ZERO).await;
    let body = json!({"text": "Say hello.", "rid": "r", "return_logprob": true, "top_logprobs_num": 2,
                      "sampling_params": {"max_new_tokens": 4, "n": 2}});
    let answer: Value = f.gw.post("/generate", &body).await.json().await.unwrap();
    let sent = f.seen.lock().generated[0].clone();
    assert!(sent.return_logprob && sent.top_logprobs_num == 2, "the worker is asked for them");
    assert_eq!(sent.sampling_params.map(|s| s.n), Some(2));
    let list = answer.as_array().unwrap_or_else(|| panic!("n = 2 answers a list: {answer}"));
    assert_eq!(list.len(), 2, "{answer}");
    for (i, one) in list.iter().enumerate() {
        let meta = &one["meta_info"];
        assert_eq!(meta["id"], format!("r-{i}"), "each sequence its own id: {one}");
        let ids: Vec<u64> = one["output_ids"].as_array().unwrap().iter().filter_map(Value::as_u64).collect();
        let entries = meta["output_token_logprobs"].as_array().unwrap();
        assert_eq!(entries.len(), ids.len(), "{one}");
        for (at, (entry, id)) in entries.iter().zip(&ids).enumerate() {
            assert_eq!(entry, &json!([f64::from(fake_logprob(at)), id, null]), "{one}");
        }
        let top = &meta["output_top_logprobs"][0];
        assert_eq!(top.as_array().map(Vec::len), Some(2), "{one}");
        assert_eq!(
            (meta["input_token_logprobs"].clone(), meta["output_token_logprobs_length"].clone()),
            (json!([]), json!(ids.len()))
        );
    }

    // Streamed: each event names its sequence and carries its logprobs so far.
    let mut body = body;
    body["stream"] = json!(true);
    body["return_text_in_logprobs"] = json!(true);
    let sse = f.gw.post("/generate", &body).await.text().await.unwrap();
    let events = events(&sse);
    for index in 0..2 {
        let last = events.iter().rfind(|e| e["index"] == index).unwrap_or_else(|| panic!("{sse}"));
        let entries = last["meta_info"]["output_token_logprobs"].as_array().unwrap();
        assert_eq!(entries.len(), last["output_ids"].as_array().unwrap().len(), "{sse}");
        assert!(entries.iter().all(|e| e[2].is_string()), "each with its token's text: {sse}");
        assert_eq!(last["meta_info"]["finish_reason"]["type"], "length", "{sse}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompts_own_logprobs_come_from_the_position_asked_whole_and_streamed() {
    let f = fixture(Duration::ZERO).await;
    let ids = [11, 12, 13, 14, 15];
    let body = json!({"input_ids": ids, "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": 1,
                      "sampling_params": {"max_new_tokens": 3}});
    let answer: Value = f.gw.post("/generate", &body).await.json().await.unwrap();
    let sent = f.seen.lock().generated[0].clone();
    assert_eq!((sent.return_logprob, sent.logprob_start_len), (true, 0), "the worker is asked for them");
    let meta = &answer["meta_info"];
    let input: Vec<Value> = meta["input_token_logprobs"].as_array().unwrap_or_else(|| panic!("{answer}")).clone();
    assert_eq!(input.len(), ids.len(), "{answer}");
    assert_eq!(input[0], json!([null, 11, null]), "nothing predicts the first token: {answer}");
    assert_eq!(input[2], json!([-2.0, 13, null]), "{answer}");
    assert_eq!(meta["input_top_logprobs"][0], Value::Null, "{answer}");
    assert_eq!(meta["input_top_logprobs"][2], json!([[-2.0, 13, null]]), "{answer}");
    assert_eq!(meta["output_token_logprobs"].as_array().map(Vec::len), Some(3), "and the output's: {answer}");

    // From the fourth token, streamed: every event carries them, as it carries the output's so far.
    let mut body = body;
    body["logprob_start_len"] = json!(3);
    body["stream"] = json!(true);
    let sse = f.gw.post("/generate", &body).await.text().await.unwrap();
    assert_eq!(f.seen.lock().generated[1].logprob_start_len, 3);
    for event in events(&sse) {
        assert_eq!(event["meta_info"]["input_token_logprobs"], json!([[-3.0, 14, null], [-4.0, 15, null]]), "{sse}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_generate_cannot_carry_to_a_worker_is_refused_by_name() {
    let f = fixture(Duration::ZERO).await;
    let refused = [
        (json!({"text": ["a", "b"]}), "`text` as a batch"),
        (json!({"text": "a", "sampling_params": {"n": 0}}), "`sampling_params.n`"),
        (json!({"text": "a", "return_logprob": true, "logprob_start_len": -3}), "`logprob_start_len`"),
        (json!({"text": "a", "return_logprob": true, "token_ids_logprob": [5]}), "`token_ids_logprob`"),
        (json!({"text": "a", "return_logprob": true, "top_logprobs_num": 21}), "`top_logprobs_num`"),
        (json!({"text": "a", "lora_path": "l"}), "`lora_path`"),
        (json!({"text": "a", "sampling_params": {"max_new_tokens": "many"}}), "`max_new_tokens`"),
        (json!({"text": "a", "sampling_params": {"min_new_tokens": -1}}), "`sampling_params.min_new_tokens`"),
    ];
    for (body, named) in refused {
        let resp = f.gw.post("/generate", &body).await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(named), "{body} should name {named}: {text}");
    }
    assert!(f.seen.lock().generated.is_empty(), "nothing refused reached the worker");
}
