//! A mixed fleet: kvgate routes over a vLLM and an SGLang engine serving the same model at once, each
//! read through its own telemetry (vLLM's Prometheus `/metrics`, SGLang's `/v1/loads`) and its own
//! KV events, and the credit and load it shows for each are that engine's own.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use kvgate_real_engines::fleet::{Engine, Fleet, Runtime, MODEL};
use kvgate_real_engines::gateway::{http, post, test_overrides, Gateway};
use kvgate_real_engines::text;
use serde_json::json;

use super::cache::{chat, engine_hits, settled_credit};

/// Streams `n` long answers to `engine` directly (no kvgate), so that it runs them for a while.
fn keep_busy(engine: &Engine, n: usize, tag: &str) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    (0..n)
        .map(|i| {
            let url = engine.url();
            let body = json!({"model": MODEL, "prompt": text(&format!("{tag}-{i}"), 30), "max_tokens": 400,
                              "ignore_eos": true});
            tokio::spawn(async move {
                let status = http().post(format!("{url}/v1/completions")).json(&body).send().await?.status();
                ensure!(status.is_success(), "a busy request answered {status}");
                Ok(())
            })
        })
        .collect()
}

pub async fn a_mixed_fleet_gets_credit_and_load_from_each_engines_own_telemetry(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let sglang = fleet.of(Runtime::Sglang).first().copied().context("no SGLang engine in the fleet")?;
    let vllm = fleet.of(Runtime::Vllm).first().copied().context("no vLLM engine in the fleet")?;
    let gw = Gateway::start("", test_overrides(&[sglang, vllm])).await?;
    let (s, v) = (sglang.spec.name.as_str(), vllm.spec.name.as_str());

    // Each engine's telemetry path is its own.
    // (SGLang's page size comes from its /server_info, read after its first passing health check,
    // which takes SGLang a second.)
    gw.wait_for("both engines' first load reports and block sizes", Duration::from_secs(15), || async {
        let (ws, wv) = (gw.worker(s).await?, gw.worker(v).await?);
        Ok(ws["telemetry"] == "sglang"
            && wv["telemetry"] == "vllm"
            && ws["engine_block_size"].is_number()
            && wv["engine_block_size"].is_number())
    })
    .await?;
    for id in [s, v] {
        let w = gw.worker(id).await?;
        ensure!(w["engine_block_size"] == 32, "{id}: engine_block_size {}", w["engine_block_size"]);
        ensure!(w["engine_kv_capacity_tokens"] == 16_384, "{id}: capacity {}", w["engine_kv_capacity_tokens"]);
        ensure!(w["router"]["kv_state"]["state"] == "synced", "{id}: {}", w["router"]["kv_state"]);
    }
    ensure!(
        gw.worker(s).await?["engine_max_running_requests"].as_u64().is_some_and(|m| m > 0),
        "SGLang's max_running_requests was not read from its /v1/loads"
    );

    // Credit: one system prompt on each engine; each is credited exactly what it serves from cache,
    // and the other is credited nothing for it.
    for (owner, other) in [(sglang, vllm), (vllm, sglang)] {
        let system = text(&format!("mixed-{}", owner.spec.name), 250);
        post(&owner.url(), "/v1/chat/completions", &chat(&system, "seed")).await?;
        let body = chat(&system, "and again");
        let credit = settled_credit(&gw, &body, &owner.spec.name).await?;
        let hits = engine_hits(owner, &body).await?;
        ensure!(
            credit == hits,
            "{} ({}): kvgate credits {credit}, the engine served {hits}",
            owner.spec.name,
            owner.spec.runtime
        );
        let elsewhere = gw.credit(&body, &other.spec.name).await?;
        ensure!(
            elsewhere == 0,
            "{} is credited {elsewhere} tokens of a prompt only {} computed",
            other.spec.name,
            owner.spec.name
        );
        // The idle owner gets the prompt.
        gw.wait_idle(&owner.spec.name).await?;
        gw.wait_idle(&other.spec.name).await?;
        let decision = gw.preview(&body).await?;
        ensure!(
            decision["worker"] == owner.spec.name.as_str(),
            "kvgate would send {}'s prompt elsewhere: {decision}",
            owner.spec.name
        );
    }

    // Load: work sent to each engine directly shows up in kvgate's view of that engine alone.
    for (busy, idle) in [(sglang, vllm), (vllm, sglang)] {
        gw.wait_idle(&idle.spec.name).await?;
        let work = keep_busy(busy, 4, &format!("mixed-busy-{}", busy.spec.name));
        let seen = gw
            .wait_for(&format!("kvgate to see {} running", busy.spec.name), Duration::from_secs(20), || async {
                Ok(gw.worker(&busy.spec.name).await?["router"]["running_requests"].as_u64().unwrap_or(0) >= 2)
            })
            .await;
        let idle_running = gw.worker(&idle.spec.name).await?["router"]["running_requests"].clone();
        for w in work {
            w.await??;
        }
        seen?;
        ensure!(idle_running == 0, "{} ran nothing, kvgate shows {idle_running} running", idle.spec.name);
    }
    gw.stop().await;
    eprintln!("    mixed fleet: {s} (sglang) and {v} (vllm), credit and load each from its own telemetry");
    Ok(())
}
