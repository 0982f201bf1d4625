//! Cache credit from real KV events: the block size the engine publishes, both socket roles, credit
//! equal to the engine's own prefix-cache hits, and eviction.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use kvgate_real_engines::fleet::{Engine, Fleet, Runtime, BLOCK_SIZE, MODEL};
use kvgate_real_engines::gateway::{cached_tokens, engine_metric, post, test_overrides, Gateway};
use kvgate_real_engines::text;
use serde_json::{json, Value};

/// How long real events may take to show up in kvgate's index.
const SETTLE: Duration = Duration::from_secs(20);

/// A completion request for `prompt` (text or token ids) with a few output tokens.
pub fn completion(prompt: Value) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
}

/// A chat request with a long system prompt.
pub fn chat(system: &str, user: &str) -> Value {
    json!({"model": MODEL, "max_tokens": 4, "temperature": 0,
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
}

/// The engine's path for a body.
pub fn path_of(body: &Value) -> &'static str {
    if body.get("messages").is_some() {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// Waits until kvgate's credit for `body` on `worker` is positive and has not changed for half a
/// second (the engine's events for it have all arrived), and returns it.
pub async fn settled_credit(gw: &Gateway, body: &Value, worker: &str) -> anyhow::Result<u64> {
    let mut last = (0u64, std::time::Instant::now());
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        // A worker briefly out of rotation (a health check that timed out on the shared cores)
        // is not scored; its credit is read once it is back.
        match gw.credit_if_scored(body, worker).await? {
            Some(c) if c != last.0 => last = (c, std::time::Instant::now()),
            Some(c) if c > 0 && last.1.elapsed() > Duration::from_millis(500) => return Ok(c),
            _ => {}
        }
        if std::time::Instant::now() > deadline {
            let status = gw.worker(worker).await?;
            bail!("kvgate's credit for {worker} never settled above 0 (last {}); the worker: {status}", last.0);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends `body` straight to the engine and returns the prompt tokens it served from its prefix
/// cache, checked against the cached-tokens counter it moved (`vllm:prefix_cache_hits_total`,
/// `sglang:cached_tokens_total`).
pub async fn engine_hits(engine: &Engine, body: &Value) -> anyhow::Result<u64> {
    let counter = engine.spec.runtime.cached_tokens_metric();
    let before = engine_metric(&engine.url(), counter).await?;
    let r = post(&engine.url(), path_of(body), body).await?;
    let reported = cached_tokens(&r);
    // The counter follows the response by a moment on SGLang (its tokenizer process counts it).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut after = engine_metric(&engine.url(), counter).await?;
    while ((after - before) as u64) < reported && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        after = engine_metric(&engine.url(), counter).await?;
    }
    ensure!(
        (after - before) as u64 == reported,
        "engine {} reported {reported} cached tokens in usage but its {counter} moved by {}",
        engine.spec.name,
        after - before
    );
    Ok(reported)
}

async fn no_decode_errors(gw: &Gateway, worker: &str) -> anyhow::Result<()> {
    let w = gw.worker(worker).await?;
    let stream = &w["kv_events"];
    ensure!(stream["decode_errors"] == 0, "worker {worker}: KV events failed to decode: {stream}");
    ensure!(stream["events"].as_u64().unwrap_or(0) > 0, "worker {worker}: no KV events applied: {stream}");
    Ok(())
}

pub async fn the_block_size_is_read_from_the_engine_and_a_mismatch_is_invalid(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    let mut o = test_overrides(&[a]);
    o.block_size = Some(16);
    let gw = Gateway::start("", o).await?;
    gw.wait_for("the mismatch to be reported", Duration::from_secs(10), || async {
        let kv = gw.kv_state("a").await?;
        Ok(kv["state"] == "invalid" && kv["reason"].as_str().is_some_and(|r| r.contains("block_size 32")))
    })
    .await?;
    let w = gw.worker("a").await?;
    ensure!(w["engine_block_size"] == 32, "engine_block_size: {}", w["engine_block_size"]);
    ensure!(w["engine_kv_capacity_tokens"] == 16_384, "capacity: {}", w["engine_kv_capacity_tokens"]);
    // Its events are refused: a prompt it serves earns no credit.
    let body = completion(json!(text("block-size-16", 300)));
    post(&gw.url, "/v1/completions", &body).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(gw.credit(&body, "a").await? == 0, "a mismatched worker earned credit");
    ensure!(gw.kv_state("a").await?["state"] == "invalid", "the mismatch was forgotten");
    gw.stop().await;

    let gw = Gateway::start("", test_overrides(&[a])).await?;
    gw.wait_for("a synced worker with the engine's capacity", Duration::from_secs(10), || async {
        let w = gw.worker("a").await?;
        Ok(w["router"]["kv_state"]["state"] == "synced" && w["engine_block_size"] == 32)
    })
    .await?;
    gw.stop().await;
    Ok(())
}

pub async fn kv_events_arrive_in_both_socket_roles(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let (a, b) = (fleet.engine("a"), fleet.engine("b"));
    let gw = Gateway::start("", test_overrides(&[a, b])).await?;
    for e in [a, b] {
        let body = completion(json!(text(&format!("roles-{}", e.spec.name), 200)));
        post(&e.url(), "/v1/completions", &body).await?;
        let credit = settled_credit(&gw, &body, &e.spec.name).await.with_context(|| {
            format!("engine {} (endpoint {}) sent no usable KV events", e.spec.name, e.engine_endpoint())
        })?;
        ensure!(credit > 0);
        no_decode_errors(&gw, &e.spec.name).await?;
    }
    gw.stop().await;
    Ok(())
}

pub async fn cache_credit_equals_the_engines_own_prefix_cache_hits(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let (a, b) = (fleet.engine("a"), fleet.engine("b"));
    let gw = Gateway::start("", test_overrides(&[a, b])).await?;
    for e in [a, b] {
        let n = &e.spec.name;
        let bodies = [
            completion(json!(text(&format!("credit-text-{n}"), 350))),
            chat(&text(&format!("credit-chat-{n}"), 250), "What now?"),
            // Exactly 20 blocks: the engine recomputes the last token, so only 19 are reusable.
            completion(json!((0..640).map(|i| 100 + (i * 7 + n.len()) % 5000).collect::<Vec<usize>>())),
            completion(json!((0..641).map(|i| 200 + (i * 11 + n.len()) % 5000).collect::<Vec<usize>>())),
        ];
        for body in &bodies {
            // The engine serves it once (cold), then kvgate's index must know what it cached.
            let first = engine_hits(e, body).await?;
            ensure!(first == 0, "engine {n} had the prompt cached before the test ({first} tokens)");
            let credit = settled_credit(&gw, body, n).await?;
            let hits = engine_hits(e, body).await?;
            ensure!(
                credit == hits,
                "engine {n}: kvgate credits {credit} cached tokens, the engine served {hits} from its cache; body {body}"
            );
            ensure!(credit % u64::from(BLOCK_SIZE) == 0, "credit {credit} is not whole blocks");
        }
        // And kvgate routes the same prompt to that engine, once its load report shows it idle: the
        // requests above went to the engine directly, so no reservation of kvgate's reconciles a
        // report taken while the last one still ran.
        gw.wait_idle(n).await?;
        let body = &bodies[0];
        let decision = gw.preview(body).await?;
        ensure!(decision["worker"] == n.as_str(), "kvgate would send {n}'s cached prompt elsewhere: {decision}");
        no_decode_errors(&gw, n).await?;
    }
    gw.stop().await;
    Ok(())
}

pub async fn eviction_shrinks_credit_with_the_engines_block_removed_events(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let c = fleet.engine("c");
    let gw = Gateway::start("", test_overrides(&[c])).await?;
    let capacity_blocks = 2_048 / u64::from(BLOCK_SIZE);
    let first = completion(json!(text("evict-first", 360)));
    post(&c.url(), "/v1/completions", &first).await?;
    let before = settled_credit(&gw, &first, "c").await?;
    ensure!(before >= 20 * u64::from(BLOCK_SIZE), "the first prompt should hold 20+ blocks, got {before} tokens");
    // Three more prompts of the same size do not fit beside it: the engine evicts the oldest.
    for i in 0..3 {
        post(&c.url(), "/v1/completions", &completion(json!(text(&format!("evict-next-{i}"), 360)))).await?;
    }
    gw.wait_for("the first prompt's credit to shrink", Duration::from_secs(20), || async {
        Ok(gw.credit(&first, "c").await? < before)
    })
    .await?;
    let w = gw.worker("c").await?;
    let held = w["router"]["blocks_held"].as_u64().unwrap_or(u64::MAX);
    ensure!(held <= capacity_blocks, "kvgate believes c holds {held} blocks; it has {capacity_blocks}");
    ensure!(w["kv_events"]["events"].as_u64().unwrap_or(0) > 0);
    // What kvgate credits now is what the engine really still has.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let credit = gw.credit(&first, "c").await?;
    let hits = engine_hits(c, &first).await?;
    ensure!(credit == hits, "after eviction kvgate credits {credit} tokens, the engine served {hits}");
    no_decode_errors(&gw, "c").await?;
    gw.stop().await;
    Ok(())
}

pub async fn a_prefix_cache_reset_clears_credit_through_all_blocks_cleared(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    let runtime = a.spec.runtime;
    let gw = Gateway::start("", test_overrides(&[a])).await?;
    let body = completion(json!(text("reset-prefix", 300)));
    post(&a.url(), "/v1/completions", &body).await?;
    settled_credit(&gw, &body, "a").await?;
    kvgate_real_engines::gateway::flush_prefix_cache(a).await?;
    if runtime == Runtime::Vllm {
        // vLLM queues AllBlocksCleared and publishes it with its next scheduler step, not at the
        // reset: until the engine runs something, its old blocks are still announced. (SGLang
        // publishes it at the flush.)
        tokio::time::sleep(Duration::from_millis(500)).await;
        ensure!(gw.blocks_held("a").await? > 0, "the reset was announced before the engine's next step");
        post(&a.url(), "/v1/completions", &completion(json!("an unrelated short prompt"))).await?;
    }
    gw.wait_for("the engine's AllBlocksCleared to clear its credit", Duration::from_secs(10), || async {
        Ok(gw.blocks_held("a").await? == 0 && gw.credit(&body, "a").await? == 0)
    })
    .await?;
    ensure!(gw.kv_state("a").await?["state"] == "synced", "a cleared cache is still a synced view");
    let hits = engine_hits(a, &body).await?;
    ensure!(hits == 0, "the engine still had {hits} tokens of the prompt cached after the reset");
    let credit = settled_credit(&gw, &body, "a").await?;
    ensure!(credit == engine_hits(a, &body).await?, "credit after the reset differs from the engine's hits");
    no_decode_errors(&gw, "a").await?;
    gw.stop().await;
    Ok(())
}

pub async fn a_late_subscriber_without_a_replay_socket_joins_without_a_gap(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    // The engine has published for a while (every trial before this one), and kvgate is told of no
    // replay socket: its first batch is seq N > 0, which is where it joined, not a gap.
    post(&a.url(), "/v1/completions", &completion(json!(text("late-join-before", 120)))).await?;
    let mut o = test_overrides(&[a]);
    o.workers = vec![format!("{},id=a,engine={},kv_events=:{}", a.url(), a.spec.runtime, a.kv_port)];
    let gw = Gateway::start("", o).await?;
    gw.wait_for("a synced worker", Duration::from_secs(10), || async {
        Ok(gw.kv_state("a").await?["state"] == "synced")
    })
    .await?;
    let body = completion(json!(text("late-join-after", 300)));
    // The subscription joins the publisher a moment after the socket connects; until a batch
    // arrives, kvgate has joined nothing. Requests until one has.
    for i in 0..20 {
        post(&a.url(), "/v1/completions", &completion(json!(text(&format!("late-join-probe-{i}"), 40)))).await?;
        if gw.worker("a").await?["kv_events"]["batches"].as_u64().unwrap_or(0) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    post(&a.url(), "/v1/completions", &body).await?;
    let credit = settled_credit(&gw, &body, "a").await?;
    let hits = engine_hits(a, &body).await?;
    ensure!(credit == hits, "kvgate credits {credit} tokens, the engine served {hits}");
    let stream = gw.worker("a").await?["kv_events"].clone();
    ensure!(stream["gaps"] == 0 && stream["history_lost"] == 0, "joining counted as a gap: {stream}");
    ensure!(
        stream["joined_at_seq"].as_u64().is_some_and(|s| s > 0),
        "kvgate did not say it joined the stream late: {stream}"
    );
    eprintln!("    joined {}'s KV event stream at seq {}, no gap", a.spec.runtime, stream["joined_at_seq"]);
    gw.stop().await;
    Ok(())
}
