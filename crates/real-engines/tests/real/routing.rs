//! Routing on real engines: a prefix follows its owner while the owner is idle, and a burst that
//! would queue on a small-KV owner spreads to its peers, which then own the prefix too; a prefix
//! asked for steadily is copied to an idle peer once the copy pays.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use kvgate_real_engines::fleet::{Engine, Fleet};
use kvgate_real_engines::gateway::{engine_metric, http, post, test_overrides, Gateway};
use kvgate_real_engines::text;
use serde_json::Value;

use super::cache::{chat, settled_credit};

pub async fn a_prefix_follows_its_idle_owner_and_a_burst_spreads_to_peers_that_become_owners(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let (a, b, c) = (fleet.engine("a"), fleet.engine("b"), fleet.engine("c"));
    let gw = Gateway::start("", test_overrides(&[a, b, c])).await?;
    // A system prompt of about 900 tokens, first computed by the small-KV engine c.
    let system = text("shared-system-prompt", 320);
    post(&c.url(), "/v1/chat/completions", &chat(&system, "seed")).await?;
    settled_credit(&gw, &chat(&system, "probe"), "c").await?;

    // Repeated requests, one at a time: the idle owner wins each.
    for i in 0..5 {
        // A load report taken after the previous request finished, so c is seen idle again, and
        // c's credit for the prompt settled (the previous request's KV events applied).
        gw.wait_idle("c").await?;
        let body = chat(&system, &format!("sequential question {i}"));
        settled_credit(&gw, &body, "c").await?;
        let r = post(&gw.url, "/v1/chat/completions", &body).await?;
        let served = gw.last_choice().await?;
        if served != "c" {
            let log: Value = http().get(format!("{}/admin/decisions?limit=1", gw.url)).send().await?.json().await?;
            let workers: Value = http().get(format!("{}/admin/workers", gw.url)).send().await?.json().await?;
            anyhow::bail!(
                "sequential request {i} went to {served}, not the idle owner c: {r}\ndecision: {}\nworkers: {workers}",
                log["decisions"][0]
            );
        }
    }

    // A burst of 24 at once: c holds 2,048 tokens of KV, so most would queue there.
    let (served, peak) = burst(&gw, c, &system).await?;
    eprintln!("    burst of 24: {served:?}; c's own peak waiting queue {peak}");
    let on_owner = served.get("c").copied().unwrap_or(0);
    let on_peers = served.get("a").copied().unwrap_or(0) + served.get("b").copied().unwrap_or(0);
    ensure!(on_owner >= 1, "the owner got none of the burst: {served:?}");
    ensure!(on_peers >= 8, "the burst stayed on the owner: {served:?}");

    // The peers computed the prefix themselves: their own events make them owners (the credit is
    // read once it has stopped changing).
    let probe = chat(&system, "after the burst");
    for peer in ["a", "b"] {
        if served.get(peer).copied().unwrap_or(0) > 0 {
            let credit = settled_credit(&gw, &probe, peer).await?;
            ensure!(credit > 800, "peer {peer} served the burst but is credited only {credit} tokens");
        }
    }
    gw.stop().await;
    Ok(())
}

/// Sends a burst of 24 chats holding `system` at once through `gw`, each needing about 9 blocks of
/// its own besides the shared prefix, and returns how many each worker served and the peak waiting
/// queue of `owner` (an engine with its own HTTP server) meanwhile.
pub async fn burst(gw: &Gateway, owner: &Engine, system: &str) -> anyhow::Result<(BTreeMap<String, u32>, u64)> {
    gw.wait_idle(&owner.spec.name).await?;
    let peak_waiting = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let watcher = {
        let (url, peak, waiting) = (owner.url(), peak_waiting.clone(), owner.spec.runtime.waiting_metric());
        tokio::spawn(async move {
            loop {
                if let Ok(w) = engine_metric(&url, waiting).await {
                    peak.fetch_max(w as u64, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let requests: Vec<_> = (0..24)
        .map(|i| {
            let mut body = chat(system, &text(&format!("burst question {i}"), 60));
            body["max_tokens"] = 128.into();
            body["ignore_eos"] = true.into();
            let url = gw.url.clone();
            tokio::spawn(async move {
                let r = http().post(format!("{url}/v1/chat/completions")).json(&body).send().await?;
                anyhow::Ok(r.status())
            })
        })
        .collect();
    for r in requests {
        let status = r.await??;
        ensure!(status.is_success(), "a burst request failed with {status}");
    }
    watcher.abort();
    let log: Value = http().get(format!("{}/admin/decisions?limit=24", gw.url)).send().await?.json().await?;
    let mut served: BTreeMap<String, u32> = BTreeMap::new();
    for d in log["decisions"].as_array().into_iter().flatten() {
        *served.entry(d["decision"]["worker"].as_str().unwrap_or("?").to_owned()).or_default() += 1;
    }
    Ok((served, peak_waiting.load(std::sync::atomic::Ordering::Relaxed)))
}

/// Requests each holding a system prompt a real engine holds, sent by `clients` clients one after
/// another until `stop` is set.
fn stream_of(
    gw: &Gateway,
    system: &str,
    clients: usize,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<u32>>> {
    (0..clients)
        .map(|client| {
            let (url, system, stop) = (gw.url.clone(), system.to_owned(), stop.clone());
            tokio::spawn(async move {
                let mut sent = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let mut body = chat(&system, &format!("{sent}.{client}: and now?"));
                    body["max_tokens"] = 24.into();
                    body["ignore_eos"] = true.into();
                    let status = http().post(format!("{url}/v1/chat/completions")).json(&body).send().await?.status();
                    ensure!(status.is_success(), "a request of the stream failed with {status}");
                    sent += 1;
                }
                Ok(sent)
            })
        })
        .collect()
}

pub async fn a_prefix_asked_for_steadily_is_copied_to_an_idle_peer_that_then_holds_it(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let (a, b) = (fleet.engine("a"), fleet.engine("b"));
    let mut overrides = test_overrides(&[a, b]);
    // Rates that make a's running batch cost each request about what it really does. The paced
    // engines prefill 8,750 tokens a second, and a step of a few sequences takes about 29 ms, most
    // of it the step's fixed cost: kvgate's linear model charges a running sequence 1/decode rate
    // of a step, so a few sequences' 29 ms is some 100-200 tokens a second, not the full batch's
    // 1,034 (a's batch here is the three clients').
    overrides.workers = [a, b]
        .iter()
        .map(|e| format!("{},prefill_tokens_per_s=5000,decode_tokens_per_s=200", e.worker_flag()))
        .collect();
    let gw = Gateway::start("", overrides).await?;
    let system = text("steadily-asked-system-prompt", 320);
    post(&a.url(), "/v1/chat/completions", &chat(&system, "seed")).await?;
    settled_credit(&gw, &chat(&system, "probe"), "a").await?;

    // Three clients ask for the prompt back to back. Each request on its own is best served by a,
    // which holds the prompt (b would compute its ~900 tokens, 0.18 s, against a's running batch's
    // few ms); once the prompt has been asked for long enough, a copy on b pays.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients = stream_of(&gw, &system, 3, &stop);
    let started = std::time::Instant::now();
    let mut copied = None;
    while copied.is_none() && started.elapsed() < Duration::from_secs(90) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let log: Value = http().get(format!("{}/admin/decisions?limit=1000", gw.url)).send().await?.json().await?;
        copied = log["decisions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|d| d["decision"]["reason"] == "replicate")
            .map(|d| d["decision"].clone());
    }
    // A few seconds more traffic, now with two holders.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sent = 0;
    for c in clients {
        sent += c.await??;
    }
    let log: Value = http().get(format!("{}/admin/decisions?limit=1000", gw.url)).send().await?.json().await?;
    let mut reasons: BTreeMap<String, u32> = BTreeMap::new();
    for d in log["decisions"].as_array().into_iter().flatten() {
        let key = format!(
            "{} {}",
            d["decision"]["worker"].as_str().unwrap_or("?"),
            d["decision"]["reason"].as_str().unwrap_or("?")
        );
        *reasons.entry(key).or_default() += 1;
    }
    eprintln!("    {sent} requests in {:.0} s: {reasons:?}", started.elapsed().as_secs_f64());
    let copied = copied.with_context(|| format!("no copy of the prompt in 90 s of {sent} requests: {reasons:?}"))?;
    ensure!(copied["worker"] == "b", "the copy went to {}, not the idle peer b", copied["worker"]);
    let decisions: Vec<&Value> = log["decisions"].as_array().into_iter().flatten().map(|d| &d["decision"]).collect();
    let before_copy = decisions.iter().take_while(|d| d["reason"] != "replicate");
    ensure!(
        before_copy.clone().all(|d| d["worker"] == "a"),
        "before the copy a served the prompt: {:?}",
        before_copy.map(|d| (&d["worker"], &d["reason"])).collect::<Vec<_>>()
    );
    ensure!(copied["cached_tokens"] == 0, "a copy computes the prompt: {copied}");

    // b computed the prompt itself: its own KV events make it a holder.
    let credit = settled_credit(&gw, &chat(&system, "after the copy"), "b").await?;
    ensure!(credit > 800, "b made the copy but is credited only {credit} tokens");
    let metrics = http().get(format!("{}/metrics", gw.url)).send().await?.text().await?;
    ensure!(
        metrics.lines().any(|l| l.starts_with("kvgate_replications_total ") && !l.ends_with(" 0")),
        "kvgate_replications_total did not count the copy"
    );
    gw.stop().await;
    Ok(())
}
