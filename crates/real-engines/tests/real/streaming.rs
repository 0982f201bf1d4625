//! Streams through kvgate are the engine's bytes, unchanged.

use std::sync::Arc;

use anyhow::{ensure, Context};
use futures_util::StreamExt;
use kvgate_real_engines::fleet::{Fleet, MODEL};
use kvgate_real_engines::gateway::{http, test_overrides, Gateway};
use kvgate_real_engines::recorder::Recorder;
use kvgate_real_engines::text;
use serde_json::{json, Value};

async fn stream_body(url: &str, path: &str, body: &Value) -> anyhow::Result<Vec<u8>> {
    let resp = http().post(format!("{url}{path}")).json(body).send().await?;
    ensure!(resp.status().is_success(), "{path} answered {}", resp.status());
    let ct = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    ensure!(ct.starts_with("text/event-stream"), "content-type {ct}");
    let mut out = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        out.extend_from_slice(&chunk?);
    }
    Ok(out)
}

pub async fn streaming_through_kvgate_is_byte_for_byte_what_the_engine_sent(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    let recorder = Recorder::start(format!("127.0.0.1:{}", a.port)).await?;
    let mut o = test_overrides(&[a]);
    o.workers = vec![format!("{},id=a,engine={}", recorder.url, a.spec.runtime)];
    let gw = Gateway::start("", o).await?;
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 24, "ignore_eos": true,
                   "messages": [{"role": "user", "content": text("stream-chat", 40)}]}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 24, "ignore_eos": true,
                   "prompt": text("stream-completion", 40)}),
        ),
    ];
    for (path, body) in cases {
        let received = stream_body(&gw.url, path, &body).await?;
        let exchanges = recorder.exchanges().await?;
        let sent = exchanges
            .iter()
            .rev()
            .find(|x| x.request_line == format!("POST {path}"))
            .with_context(|| format!("the recorder saw no POST {path}"))?;
        ensure!(sent.status == 200, "engine status {}", sent.status);
        ensure!(
            received == sent.body.as_ref(),
            "{path}: the client got {} bytes, the engine sent {}; client:\n{}\nengine:\n{}",
            received.len(),
            sent.body.len(),
            String::from_utf8_lossy(&received),
            String::from_utf8_lossy(&sent.body)
        );
        let text = String::from_utf8_lossy(&received);
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        // vLLM's output collector (and SGLang's detokenizer) merges the tokens a slow reader has not yet taken into one chunk, so on a
        // busy machine all 24 tokens can arrive as a single content event: one or more content events, then
        // usage, then [DONE].
        ensure!(events.len() >= 3, "{path}: only {} events", events.len());
        let content: Vec<Value> = events[..events.len() - 2]
            .iter()
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap_or(e)))
            .collect::<Result<_, _>>()
            .with_context(|| format!("{path}: a content event is not `data: <json>`"))?;
        ensure!(
            content.iter().all(|c| c["choices"].as_array().is_some_and(|a| !a.is_empty())),
            "{path}: an event before usage carries no choice: {content:?}"
        );
        ensure!(events.last() == Some(&"data: [DONE]"), "{path}: the stream does not end with [DONE]");
        let usage = events.iter().rev().nth(1).and_then(|e| e.strip_prefix("data: ")).context("no usage event")?;
        let usage: Value = serde_json::from_str(usage)?;
        ensure!(
            usage["usage"]["completion_tokens"] == 24,
            "{path}: the last chunk before [DONE] is not usage: {usage}"
        );
    }
    gw.stop().await;
    Ok(())
}
