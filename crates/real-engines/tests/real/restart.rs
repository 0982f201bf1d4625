//! An engine killed with SIGKILL in the middle of a stream: the client gets a clean error, kvgate
//! takes the engine out, and after the restart its credit starts from zero (vLLM's and SGLang's block
//! hashes repeat across restarts, so only the restart itself can tell kvgate the old blocks are gone).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use futures_util::StreamExt;
use kvgate_real_engines::fleet::{Engine, Fleet, Runtime, MODEL};
use kvgate_real_engines::gateway::{http, post, test_overrides, Gateway};
use kvgate_real_engines::text;
use serde_json::json;

use super::cache::{completion, engine_hits, settled_credit};

pub async fn an_engine_killed_mid_stream_is_marked_down_and_its_credit_rebuilt_from_zero(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    let gw = Gateway::start("", test_overrides(&[a])).await?;
    let cached = completion(json!(text("restart-prefix", 300)));
    post(&gw.url, "/v1/completions", &cached).await?;
    let before = settled_credit(&gw, &cached, "a").await?;

    kill_mid_stream(&gw, a, "restart-stream").await?;

    gw.wait_for("kvgate to mark the killed engine down", Duration::from_secs(10), || async {
        Ok(gw.worker("a").await?["healthy"] == false)
    })
    .await?;
    let started_before = gw.worker("a").await?["engine_started_at_s"].as_f64();

    a.start()?;
    a.wait_ready(Duration::from_secs(240))?;
    gw.wait_synced("a", Duration::from_secs(30)).await?;
    // Same prompt, same block hashes as before the restart; the new process has none of them.
    ensure!(gw.blocks_held("a").await? == 0, "the restarted engine still has blocks in kvgate's index");
    let credit = gw.credit(&cached, "a").await?;
    ensure!(credit == 0, "kvgate credits the restarted engine with {credit} tokens (before the kill: {before})");
    if a.spec.runtime == Runtime::Vllm {
        // vLLM's /metrics has the process start time; SGLang reports none, and its restart is known
        // by its time out of rotation and by its KV event sequence starting over.
        gw.wait_for("the new process start time", Duration::from_secs(10), || async {
            Ok(gw.worker("a").await?["engine_started_at_s"].as_f64() != started_before)
        })
        .await?;
    }

    // Its credit grows again from its own new events, and matches what it really caches.
    post(&gw.url, "/v1/completions", &cached).await?;
    let rebuilt = settled_credit(&gw, &cached, "a").await?;
    let hits = engine_hits(a, &cached).await?;
    ensure!(rebuilt == hits, "after the restart kvgate credits {rebuilt} tokens, the engine served {hits}");
    gw.stop().await;
    Ok(())
}

/// Sends a long stream of a prompt made from `tag` through `gw`, kills `engine` (which must be the
/// one serving it) with SIGKILL as soon as its first bytes arrive, and checks that the client got
/// a clean error event to end the stream, not `[DONE]`.
pub async fn kill_mid_stream(gw: &Gateway, engine: &Engine, tag: &str) -> anyhow::Result<()> {
    // Waiting for more than the first bytes let a busy CI machine fall so far behind that vLLM,
    // which merges the output a slow reader has not taken, had finished all 3,000 tokens before
    // the kill.
    let body = json!({"model": MODEL, "stream": true, "max_tokens": 3000, "ignore_eos": true,
                      "prompt": text(tag, 50)});
    let resp = http().post(format!("{}/v1/completions", gw.url)).json(&body).send().await?;
    ensure!(resp.status().is_success(), "stream answered {}", resp.status());
    let mut stream = resp.bytes_stream();
    let mut received = Vec::new();
    while received.is_empty() {
        let chunk = stream.next().await.context("the stream ended before the kill")??;
        received.extend_from_slice(&chunk);
    }
    engine.kill()?;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => received.extend_from_slice(&c),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&received);
    ensure!(!text.contains("[DONE]"), "the stream finished although its engine was killed");
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    ensure!(
        last.starts_with("data: {\"error\"") && last.contains("upstream_error"),
        "the client did not get a clean error event at the end; the stream ended with {last:?}"
    );
    Ok(())
}
