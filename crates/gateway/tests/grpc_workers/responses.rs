//! The Responses API through a gRPC worker: the same text as chat, as one assistant message, whole
//! and as numbered events; what the gateway cannot serve refused before anything is sent.

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
