//! `kvgate demo --engines vllm` in short: the demo's run on this suite's real fleet.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use anyhow::ensure;
use kvgate_demo::{run_one_on, DemoConfig};
use kvgate_real_engines::fleet::Fleet;

pub async fn the_demo_runs_on_real_engines_and_reuses_their_caches(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let cfg = DemoConfig {
        workers: fleet.http_engines().len(),
        duration_s: 6.0,
        rate: 3.0,
        ..DemoConfig::for_real_engines()
    };
    let report = run_one_on(&cfg, "projected:enforce", Arc::new(AtomicU64::new(0)), Some(fleet.clone()))
        .await
        .map_err(anyhow::Error::msg)?;
    let r = &report.requests;
    ensure!(r.total >= 10 && r.completed == r.total, "the demo's requests: {r:?}");
    ensure!(report.workers.len() == fleet.http_engines().len());
    ensure!(report.throughput.output_tokens_per_s > 0.0);
    // The engines' own counters: the system prompts are shared, so much of the prompt comes from cache
    // (each run's first requests of each prompt compute it, and 6 s at 3 a second is 18 requests).
    ensure!(report.cache.hit_rate > 0.3, "engine-reported hit rate {}", report.cache.hit_rate);
    ensure!(
        report.decisions_by_reason.get("cache_and_load").copied().unwrap_or(0) > 0,
        "{:?}",
        report.decisions_by_reason
    );
    eprintln!(
        "    demo on real engines: {} requests, TTFT p90 {:.3} s, engine hit rate {:.3}",
        r.total, report.ttft_s.p90, report.cache.hit_rate
    );
    Ok(())
}
