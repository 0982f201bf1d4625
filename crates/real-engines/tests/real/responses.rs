//! The Responses API on a real engine: the prompt kvgate tokenizes for `/v1/responses` is the one
//! the engine runs (its own `usage.input_tokens`), on vLLM and on SGLang (whose conversation and
//! special tokens differ, `kvgate_tokenizer::request::responses`), and a streamed response arrives
//! as the engine's named events.

use std::sync::Arc;

use anyhow::{ensure, Context};
use kvgate_real_engines::fleet::{Fleet, MODEL};
use kvgate_real_engines::gateway::{http, post, test_overrides, Gateway};
use kvgate_real_engines::text;
use serde_json::{json, Value};

fn bodies() -> Vec<Value> {
    vec![
        json!({"input": "Hello there!"}),
        json!({"instructions": "You are terse.", "input": "Why is the sky blue?"}),
        json!({"instructions": "Answer in French.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "One"}]},
            {"role": "assistant", "content": "Un"},
            {"role": "user", "content": "Two"}]}),
        json!({"input": [{"type": "message", "role": "developer", "content": "House rules apply."},
                         {"type": "message", "role": "user", "content": text("responses-long", 200)}]}),
    ]
}

pub async fn the_responses_api_prompt_is_the_one_the_engine_runs(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    let gw = Gateway::start("", test_overrides(&[a])).await?;
    for mut body in bodies() {
        body["model"] = MODEL.into();
        body["max_output_tokens"] = 4.into();
        let answer = post(&gw.url, "/v1/responses", &body).await?;
        let engine_count = answer["usage"]["input_tokens"].as_u64().with_context(|| format!("no usage: {answer}"))?;
        let log: Value = http().get(format!("{}/admin/decisions?limit=1", gw.url)).send().await?.json().await?;
        let ours = log["decisions"][0]["decision"]["prompt_tokens"].as_u64().context("no decision")?;
        ensure!(
            ours == engine_count,
            "kvgate tokenized {ours} prompt tokens, {} ran {engine_count}; body {body}",
            a.spec.runtime
        );
    }
    let body = json!({"model": MODEL, "input": "Count to three.", "max_output_tokens": 8, "stream": true});
    let resp = http().post(format!("{}/v1/responses", gw.url)).json(&body).send().await?;
    ensure!(resp.status().is_success(), "streamed /v1/responses answered {}", resp.status());
    let events = resp.text().await?;
    ensure!(events.contains("event: response.created"), "no response.created event: {events}");
    // A response cut by max_output_tokens ends `response.incomplete` (SGLang, as OpenAI does) or
    // `response.completed` (vLLM); either is the stream's last event.
    let last = events.trim_end().rsplit("event: ").next().unwrap_or_default();
    ensure!(
        events.trim_end().ends_with('}')
            && (last.starts_with("response.completed") || last.starts_with("response.incomplete")),
        "the stream did not end with response.completed or response.incomplete: {events}"
    );
    gw.stop().await;
    Ok(())
}
