//! A gRPC worker in a fleet: a burst spreads from an HTTP owner to it and its own KV events make it
//! an owner; it evicts and kvgate's credit follows; killed mid-stream, the client gets a clean
//! error, and after its restart kvgate's view of it is rebuilt from a new subscription.

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use kvgate_real_engines::fleet::{Fleet, BLOCK_SIZE};
use kvgate_real_engines::gateway::{cached_tokens, post, test_overrides, Gateway};
use kvgate_real_engines::text;
use serde_json::{json, Value};

use super::cache::{chat, completion, settled_credit};
use super::grpc::smg_style_gateway;
use super::restart::kill_mid_stream;
use super::routing::burst;

/// How long a restarted gRPC worker may take to serve again beside the rest of the fleet.
const RESTART: Duration = Duration::from_secs(240);

pub async fn a_burst_spreads_from_an_http_owner_to_a_grpc_peer_that_becomes_an_owner(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let (c, g) = (fleet.engine("c"), fleet.engine("g"));
    // One fleet of both backends: c over HTTP with its ZMQ events, g over gRPC with its own stream.
    let gw = Gateway::start("", test_overrides(&[c, g])).await?;
    gw.wait_synced("g", Duration::from_secs(60)).await?;
    let system = text("grpc-burst-system-prompt", 320);
    post(&c.url(), "/v1/chat/completions", &chat(&system, "seed")).await?;
    settled_credit(&gw, &chat(&system, "probe"), "c").await?;

    let (served, peak) = burst(&gw, c, &system).await?;
    eprintln!("    burst of 24 from HTTP owner c: {served:?}; c's own peak waiting queue {peak}");
    let (on_owner, on_grpc) = (served.get("c").copied().unwrap_or(0), served.get("g").copied().unwrap_or(0));
    ensure!(on_owner >= 1, "the owner got none of the burst: {served:?}");
    ensure!(on_grpc >= 8, "the burst did not spread to the gRPC worker: {served:?}");
    let stream = gw.worker("g").await?["kv_events"].clone();
    ensure!(stream["transport"] == "grpc", "g's events did not come over its own stream: {stream}");

    // g computed the prefix itself: the events its stream carried make it an owner, credited what
    // it then serves from its cache.
    let probe = chat(&system, "after the burst");
    let credit = settled_credit(&gw, &probe, "g").await?;
    ensure!(credit > 800, "g served {on_grpc} of the burst but is credited only {credit} tokens");
    gw.stop().await;
    Ok(())
}

/// The credit kvgate gives `worker` for `body`, sent before, once settled, and what the worker then
/// serves of it from its cache through `gw` (a fleet of that worker alone).
async fn credit_and_hits(gw: &Gateway, body: &Value, worker: &str) -> anyhow::Result<(u64, u64)> {
    let credit = settled_credit(gw, body, worker).await?;
    let hits = cached_tokens(&post(&gw.url, "/v1/completions", body).await?);
    Ok((credit, hits))
}

pub async fn a_grpc_worker_evicts_and_killed_mid_stream_is_rebuilt_from_a_new_subscription(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let g = fleet.engine("g");
    let gw = smg_style_gateway(g).await?;
    gw.wait_synced("g", Duration::from_secs(60)).await?;
    let capacity = gw.worker("g").await?["engine_kv_capacity_tokens"].as_u64().unwrap_or(0);
    ensure!(capacity == 16_384, "g's KV capacity from GetServerInfo: {capacity} tokens");

    // Eviction: a prompt of about 3,300 tokens, then five more that do not fit beside it (16,384
    // tokens in all): the worker evicts the oldest, and its stream says so.
    let first = completion(json!(text("grpc-evict-first", 1_200)));
    post(&gw.url, "/v1/completions", &first).await?;
    let before = settled_credit(&gw, &first, "g").await?;
    ensure!(before >= 64 * u64::from(BLOCK_SIZE), "the first prompt should hold 64+ blocks, got {before} tokens");
    for i in 0..5 {
        post(&gw.url, "/v1/completions", &completion(json!(text(&format!("grpc-evict-next-{i}"), 1_200)))).await?;
    }
    gw.wait_for("the first prompt's credit to shrink", Duration::from_secs(20), || async {
        Ok(gw.credit(&first, "g").await? < before)
    })
    .await?;
    let held = gw.worker("g").await?["router"]["blocks_held"].as_u64().unwrap_or(u64::MAX);
    let capacity_blocks = capacity / u64::from(BLOCK_SIZE);
    ensure!(held <= capacity_blocks, "kvgate believes g holds {held} blocks; it has {capacity_blocks}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let evicted = gw.credit(&first, "g").await?;
    let hits = cached_tokens(&post(&gw.url, "/v1/completions", &first).await?);
    ensure!(evicted == hits, "after eviction kvgate credits {evicted} tokens, the worker served {hits}");

    // Killed mid-stream: a clean error for the client, the worker out of rotation.
    let cached = completion(json!(text("grpc-restart-prefix", 300)));
    post(&gw.url, "/v1/completions", &cached).await?;
    let (credit, hits) = credit_and_hits(&gw, &cached, "g").await?;
    ensure!(credit == hits && hits > 0, "before the kill kvgate credits {credit} tokens, the worker served {hits}");
    let resubscribed_before = gw.worker("g").await?["kv_events"]["resubscribes"].as_u64().unwrap_or(0);
    gw.wait_idle("g").await?;
    kill_mid_stream(&gw, g, "grpc-restart-stream").await?;
    gw.wait_for("kvgate to take the killed worker out", Duration::from_secs(10), || async {
        Ok(gw.worker("g").await?["healthy"] == false)
    })
    .await?;

    // Restarted on the same port: the same prompt has the same block hashes as before, and the
    // new process holds none of them. Only a new subscription, which starts from nothing, says so.
    g.start()?;
    g.wait_ready(RESTART)?;
    gw.wait_for("the restarted worker back in rotation, resubscribed", Duration::from_secs(30), || async {
        let w = gw.worker("g").await?;
        Ok(w["healthy"] == true
            && w["router"]["kv_state"]["state"] == "synced"
            && w["kv_events"]["resubscribes"].as_u64().unwrap_or(0) > resubscribed_before)
    })
    .await?;
    ensure!(gw.blocks_held("g").await? == 0, "the restarted worker still has blocks in kvgate's index");
    let stale = gw.credit(&cached, "g").await?;
    ensure!(stale == 0, "kvgate credits the restarted worker with {stale} tokens (before the kill: {credit})");

    // Its credit grows again from the new stream's events, and matches what it really caches.
    post(&gw.url, "/v1/completions", &cached).await?;
    let (rebuilt, hits) = credit_and_hits(&gw, &cached, "g").await?;
    ensure!(rebuilt == hits && hits > 0, "after the restart kvgate credits {rebuilt} tokens, the worker served {hits}");
    let stream = gw.worker("g").await?["kv_events"].clone();
    eprintln!(
        "    gRPC worker: credit {before} -> {evicted} after eviction (= its cached_tokens); killed mid-stream, \
         restarted, resubscribed ({} resubscribes), credit 0 -> {rebuilt}",
        stream["resubscribes"]
    );
    gw.stop().await;
    Ok(())
}
