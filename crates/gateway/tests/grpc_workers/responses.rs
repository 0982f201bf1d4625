//! The Responses API through a gRPC worker: the same text as chat, as one assistant message, whole
//! and as numbered events, with its tokens' logprobs when asked; what the gateway cannot serve
//! refused before anything is sent.

use std::time::Duration;

use serde_json::{json, Value};

use super::fake::*;

fn request(stream: bool, extra: Value) -> Value {
    let mut body = json!({"model": "fake-model", "stream": stream, "temperature": 0, "instructions": "Be brief.",
                          "input": [{"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The events of a Responses stream, each event's name with its data.
fn named_events(sse: &str) -> Vec<(String, Value)> {
    sse.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap_or_else(|| panic!("not a named event: {e:?}"));
            let name = name.strip_prefix("event: ").unwrap_or_else(|| panic!("no event name: {e:?}"));
            let data = data.strip_prefix("data: ").unwrap_or_else(|| panic!("no data: {e:?}"));
            (name.to_owned(), serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}")))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_is_one_assistant_message_whole_and_as_numbered_events() {
    let f = fixture(Duration::from_millis(2)).await;
    let resp = f.gw.post("/v1/responses", &request(false, json!({"max_output_tokens": 64}))).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!((body["object"].as_str(), body["status"].as_str()), (Some("response"), Some("completed")), "{body}");
    assert_eq!(body["output"][0]["content"][0]["text"], OUTPUT, "{body}");
    assert_eq!(body["instructions"], "Be brief.");
    assert_eq!(body["max_output_tokens"], 64);
    let sent = f.seen.lock().generated[0].clone();
    let prompt = sent.tokenized.unwrap().input_ids;
    assert_eq!(body["usage"]["input_tokens"], prompt.len(), "{body}");
    assert_eq!(body["usage"]["input_tokens_details"]["cached_tokens"], 3, "{body}");
    // Two tokens kept back, as SGLang's own server keeps them (the fake is an SGLang worker).
    assert_eq!(sent.sampling_params.unwrap().max_new_tokens, Some(62));

    // The same request as chat renders the same prompt.
    let chat_body = json!({"model": "fake-model", "temperature": 0, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]});
    let chat: Value = f.gw.post("/v1/chat/completions", &chat_body).await.json().await.unwrap();
    let chat_prompt = f.seen.lock().generated[1].tokenized.clone().unwrap().input_ids;
    assert_eq!(chat["choices"][0]["message"]["content"], OUTPUT);
    assert_eq!(chat_prompt, prompt, "a Responses request and its chat twin run the same ids");

    let resp = f.gw.post("/v1/responses", &request(true, json!({"max_output_tokens": 3}))).await;
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let sse = resp.text().await.unwrap();
    let events = named_events(&sse);
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"], i as u64, "{sse}");
        assert_eq!(data["type"], name.as_str(), "{sse}");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..4],
        ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    );
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_owned())
        .collect();
    let (last, final_response) = (names.last().copied(), &events.last().unwrap().1["response"]);
    // Cut by its limit: status incomplete, ended as SGLang's server ends it (the fake is SGLang).
    assert_eq!(last, Some("response.incomplete"), "{sse}");
    assert_eq!(final_response["status"], "incomplete");
    assert_eq!(final_response["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(final_response["output"][0]["content"][0]["text"], deltas.as_str(), "{sse}");
    assert_eq!(final_response["usage"]["output_tokens"], 1, "{sse}");
    assert!(!sse.contains("[DONE]"), "a Responses stream ends with its response: {sse}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_response_cannot_carry_to_a_worker_is_refused_by_name_before_it_is_sent() {
    let f = fixture(Duration::ZERO).await;
    let refused = [
        (json!({"previous_response_id": "resp_1"}), "`previous_response_id`"),
        (json!({"reasoning": {"effort": "high"}}), "`reasoning`"),
        (json!({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}), "`input[0]`"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            "`input[0].content[0]`",
        ),
        (json!({"tools": [{"type": "function", "name": "f"}]}), "`tools`"),
        (json!({"text": {"format": {"type": "json_schema", "name": "x"}}}), "`text.format`"),
        (json!({"n": 2}), "`n`"),
        (json!({"include": ["reasoning.encrypted_content"]}), "`include`"),
        (json!({"include": ["message.output_text.logprobs"], "top_logprobs": 21}), "`top_logprobs`"),
    ];
    for (extra, named) in refused {
        let resp = f.gw.post("/v1/responses", &request(false, extra.clone())).await;
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 400, "{extra}: {text}");
        assert!(text.contains(named), "{extra} should name {named}: {text}");
    }
    assert!(f.seen.lock().generated.is_empty(), "nothing refused reached the worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_asked_by_include_list_every_token_whole_and_ride_with_the_streamed_text() {
    let f = fixture(Duration::ZERO).await;
    let asked = json!({"include": ["message.output_text.logprobs"], "top_logprobs": 2, "max_output_tokens": 64});
    let body: Value = f.gw.post("/v1/responses", &request(false, asked.clone())).await.json().await.unwrap();
    let sent = f.seen.lock().generated[0].clone();
    assert!(sent.return_logprob && sent.top_logprobs_num == 2, "the worker is asked for them");
    assert_eq!(body["top_logprobs"], 2, "{body}");
    let listed = body["output"][0]["content"][0]["logprobs"].as_array().unwrap_or_else(|| panic!("{body}")).clone();
    assert_eq!(listed.len() as u64, body["usage"]["output_tokens"].as_u64().unwrap(), "every token: {body}");
    for (at, entry) in listed.iter().enumerate() {
        assert_eq!(entry["logprob"].as_f64(), Some(f64::from(fake_logprob(at))), "{body}");
        assert_eq!(entry["top_logprobs"].as_array().map(Vec::len), Some(2), "{body}");
        let bytes: Vec<u8> = entry["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(bytes, entry["token"].as_str().unwrap().as_bytes(), "{body}");
    }

    let sse = f.gw.post("/v1/responses", &request(true, asked)).await.text().await.unwrap();
    let events = named_events(&sse);
    let streamed: Vec<Value> = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .flat_map(|(_, d)| d["logprobs"].as_array().unwrap().clone())
        .collect();
    let (_, done) = events.iter().find(|(n, _)| n == "response.content_part.done").unwrap_or_else(|| panic!("{sse}"));
    assert_eq!(done["part"]["logprobs"].as_array(), Some(&listed), "the finished message lists them all: {sse}");
    assert!(!streamed.is_empty() && streamed.len() <= listed.len(), "{sse}");
    for (delta, whole) in streamed.iter().zip(&listed) {
        assert!(delta.get("bytes").is_none(), "a delta's carry no bytes: {sse}");
        assert_eq!((&delta["token"], &delta["logprob"]), (&whole["token"], &whole["logprob"]), "{sse}");
    }

    let without = request(false, json!({"top_logprobs": 2}));
    let plain: Value = f.gw.post("/v1/responses", &without).await.json().await.unwrap();
    assert!(!f.seen.lock().generated[2].return_logprob, "top_logprobs alone asks for none");
    assert_eq!(plain["output"][0]["content"][0]["logprobs"], Value::Null, "{plain}");
    assert_eq!(plain["top_logprobs"], Value::Null, "{plain}");
}
