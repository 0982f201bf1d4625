//! `kvgate demo`: N mock engines and the gateway in one process on loopback, a multi-prefix chat
//! workload driven through real HTTP, once per policy entry, reported in the simulator's report shape.
//!
//! Each run gets fresh engines (cold caches) and a fresh gateway, so runs see identical arrivals.
//! The workload: several long system prompts with Zipf popularity, each request adding a unique
//! question, streamed with `stream_options.include_usage`. The first request of the run warms one
//! engine with the hottest prompt, so that engine starts as its owner.

#![allow(clippy::disallowed_methods)] // the demo drives real servers in real time and measures wall time

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvgate_gateway::{AppState, GatewayConfig};
use kvgate_real_engines::fleet::Fleet;
use kvgate_sim::report::{
    round, Cache, HotPrefix, KvStats, Percentiles2, Percentiles3, Report, Requests, Shadow, Throughput, WorkerReport,
};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

pub mod engines;

pub use engines::RunEngines;

/// What the demo runs.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Mock engines.
    pub workers: usize,
    /// Seconds of arrivals per run.
    pub duration_s: f64,
    /// Arrivals per second.
    pub rate: f64,
    /// Engine model speed-up (model seconds per real second).
    pub speedup: f64,
    /// Seed of arrivals and contents.
    pub seed: u64,
    /// Policy entries, as `kvgate sim --compare` names them (`projected:off`, `cache_aware_seeded`, ...).
    pub runs: Vec<String>,
    /// Sample per-engine queues for a plot.
    pub timeline: bool,
    /// Shortest and longest output, in tokens.
    pub min_output: u64,
    /// See `min_output`.
    pub max_output: u64,
    /// Words of each system prompt, as a fraction of [`PREFIX_WORDS`] (the tiny real model's context
    /// is 4,096 tokens).
    pub prefix_scale: f64,
    /// Shortest and longest question, in words.
    pub question_words: (usize, usize),
    /// Mock engines serve SMG's gRPC worker protocol (`grpc://` workers) instead of HTTP: the
    /// gateway tokenizes with the mock model's tokenizer, taken from a worker, and detokenizes the
    /// answers itself.
    pub grpc: bool,
}

impl DemoConfig {
    /// The demo scaled to real vLLM or SGLang engines on the CPU: four engines (`kvgate demo` starts one per core,
    /// 2 to 4, at the same rate per engine), 6 requests a second for 20 s,
    /// system prompts of 100–300 words and short outputs.
    pub fn for_real_engines() -> Self {
        DemoConfig {
            workers: 4,
            duration_s: 20.0,
            rate: 6.0,
            min_output: 16,
            max_output: 64,
            prefix_scale: 0.1,
            question_words: (5, 30),
            ..DemoConfig::default()
        }
    }
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            workers: 8,
            duration_s: 10.0,
            rate: 50.0,
            speedup: 1.0,
            seed: 1,
            runs: vec![
                "projected:off".into(),
                "projected:shadow".into(),
                "projected:enforce".into(),
                "cache_aware_seeded".into(),
            ],
            timeline: false,
            min_output: 100,
            max_output: 300,
            prefix_scale: 1.0,
            question_words: (20, 120),
            grpc: false,
        }
    }
}

/// The demo's engine: profile B (Llama-3-8B on one H100) made small enough (48 running sequences,
/// 100k KV tokens) that a laptop can saturate a few of them over loopback.
pub fn demo_profile() -> kvgate_engine_model::EngineProfile {
    kvgate_engine_model::EngineProfile {
        name: "demo-small".into(),
        max_running: 48,
        kv_capacity_tokens: 100_000,
        ..kvgate_engine_model::EngineProfile::llama3_8b_h100()
    }
}

/// System prompts (words, before [`DemoConfig::prefix_scale`]) and their Zipf weights.
pub const PREFIX_WORDS: [usize; 6] = [2400, 1600, 2000, 1200, 2800, 1000];

fn system_prompt(k: usize, scale: f64) -> String {
    let words = ((PREFIX_WORDS[k] as f64 * scale).round() as usize).max(1);
    (0..words).map(|i| format!("sys{k}w{i} ")).collect()
}

struct Arrival {
    at: Duration,
    prefix: usize,
    question: String,
    max_tokens: u64,
}

fn arrivals(cfg: &DemoConfig) -> Vec<Arrival> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed);
    let weights: Vec<f64> = (1..=PREFIX_WORDS.len()).map(|k| 1.0 / (k as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let mut t = 0.0;
    let mut out = Vec::new();
    loop {
        t += -rng.random::<f64>().max(1e-12).ln() / cfg.rate;
        if t >= cfg.duration_s {
            return out;
        }
        let mut x = rng.random::<f64>() * total;
        let prefix = weights.iter().position(|w| {
            x -= w;
            x < 0.0
        });
        let n = out.len();
        out.push(Arrival {
            at: Duration::from_secs_f64(t),
            prefix: prefix.unwrap_or(0),
            question: (0..rng.random_range(cfg.question_words.0..cfg.question_words.1.max(cfg.question_words.0 + 1)))
                .map(|i| format!("q{n}w{i} "))
                .collect(),
            max_tokens: rng.random_range(cfg.min_output..cfg.max_output),
        });
    }
}

/// What one request saw.
#[derive(Debug, Clone, Default)]
struct Outcome {
    status: u16,
    ttft: Option<f64>,
    e2e: Option<f64>,
    output_tokens: u64,
    hot: bool,
    /// The gateway's request id (`x-kvgate-request-id`), to find its decision.
    request_id: Option<u64>,
}

async fn one_request(client: &reqwest::Client, url: &str, body: Value, hot: bool) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome { hot, ..Outcome::default() };
    let Ok(resp) = client.post(url).json(&body).send().await else { return out };
    out.status = resp.status().as_u16();
    out.request_id =
        resp.headers().get("x-kvgate-request-id").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    if out.status != 200 {
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            out.status = 502;
            return out;
        };
        out.ttft.get_or_insert(start.elapsed().as_secs_f64());
        buf.push_str(&String::from_utf8_lossy(&chunk));
    }
    if let Some(usage) = buf.lines().rev().find_map(|l| {
        let v: Value = serde_json::from_str(l.strip_prefix("data: ")?).ok()?;
        v.get("usage").filter(|u| !u.is_null()).cloned()
    }) {
        out.output_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
    }
    out.e2e = Some(start.elapsed().as_secs_f64());
    out
}

/// Runs one policy entry on fresh mock engines and a fresh gateway; `progress` counts finished
/// requests.
pub async fn run_one(cfg: &DemoConfig, entry: &str, progress: Arc<AtomicU64>) -> Result<Report, String> {
    run_one_on(cfg, entry, progress, None).await
}

/// Runs one policy entry on `fleet` (real vLLM engines, prefix caches reset first) or, without one,
/// on fresh mock engines; always with a fresh gateway.
pub async fn run_one_on(
    cfg: &DemoConfig,
    entry: &str,
    progress: Arc<AtomicU64>,
    fleet: Option<Arc<Fleet>>,
) -> Result<Report, String> {
    let spec = kvgate_sim::policy::PolicySpec::parse(entry).map_err(|e| e.to_string())?;
    let (name, mode, seeding) = match spec.name.as_str() {
        "projected" => ("projected", spec.mode.unwrap_or(kvgate_core::Mode::Enforce).to_string(), false),
        "cache_aware" => ("cache_aware", "enforce".to_string(), false),
        "cache_aware_seeded" => ("cache_aware", "enforce".to_string(), true),
        baseline @ ("round_robin" | "random" | "power_of_two") => (baseline, "off".to_string(), false),
        other => {
            return Err(format!(
                "the demo runs the gateway's own policies (projected modes, cache_aware, cache_aware_seeded, \
                 round_robin, random, power_of_two), not {other}: the other peers exist only in the simulator"
            ))
        }
    };
    let engines = RunEngines::start(cfg, fleet).await?;
    let toml = format!(
        "{}[policy]\nname = \"{name}\"\nmode = \"{mode}\"\ndistribution_seeding = {seeding}\nadmission_wait_s = 20\n[telemetry]\npoll_interval_ms = 100\nhealth_interval_ms = 500\n",
        engines.gateway_toml(cfg)
    );
    let mut gcfg = GatewayConfig::from_toml(&toml).map_err(|e| e.to_string())?;
    gcfg.port = 0;
    // gRPC workers hand over their tokenizer, as `kvgate serve` takes it when none is configured.
    let cache = std::env::temp_dir().join(format!("kvgate-demo-{}", std::process::id()));
    kvgate_gateway::worker_tokenizer::resolve(&mut gcfg, &cache, Duration::from_secs(30))
        .await
        .map_err(|e| e.to_string())?;
    let state = AppState::new(gcfg).map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let url = format!("http://{}/v1/chat/completions", listener.local_addr().map_err(|e| e.to_string())?);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvgate_gateway::serve(listener, state.clone(), async move {
        let _ = stop_rx.await;
    }));
    tokio::time::sleep(Duration::from_millis(600)).await; // first polls and subscriptions
    let client = reqwest::Client::builder().pool_max_idle_per_host(256).build().map_err(|e| e.to_string())?;
    let (model, scale) = (engines.model(), cfg.prefix_scale);
    let body = move |prefix: usize, question: &str, max_tokens: u64| {
        json!({"model": model, "stream": true, "max_tokens": max_tokens, "ignore_eos": true,
               "stream_options": {"include_usage": true},
               "messages": [{"role": "system", "content": system_prompt(prefix, scale)}, {"role": "user", "content": question}]})
    };
    // Warm one engine with the hottest prompt: it starts as that prompt's owner.
    one_request(&client, &url, body(0, "warm up", 8), false).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let owner =
        state.router.workers(state.clock.now()).into_iter().max_by_key(|w| w.blocks_held).map(|w| w.id.to_string());
    let before = engines.counters().await?;
    engines.reset_peaks();
    let sampler = engines.sample(Duration::from_millis(if cfg.timeline { 250 } else { 100 }));
    let decisions_before = state.decisions.lock().len();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for a in arrivals(cfg) {
        let wait = a.at.saturating_sub(started.elapsed());
        tokio::time::sleep(wait).await;
        let (client, url, progress) = (client.clone(), url.clone(), progress.clone());
        let b = body(a.prefix, &a.question, a.max_tokens);
        tasks.push(tokio::spawn(async move {
            let o = one_request(&client, &url, b, a.prefix == 0).await;
            progress.fetch_add(1, Ordering::Relaxed);
            o
        }));
    }
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(t.await.map_err(|e| e.to_string())?);
    }
    let span = started.elapsed().as_secs_f64();
    let samples = sampler.finish();
    let log: Vec<kvgate_core::Decision> =
        state.decisions.lock().iter().skip(decisions_before).map(|d| d.decision.clone()).collect();
    let _ = stop_tx.send(());
    let _ = server.await;
    let after = engines.counters().await?;
    let peaks = engines.peak_waiting(&samples);
    engines.finish();

    let mut reasons: BTreeMap<String, u64> = BTreeMap::new();
    for d in &log {
        *reasons.entry(d.reason.as_str().to_owned()).or_default() += 1;
    }
    let worker_of: BTreeMap<u64, &str> = log.iter().map(|d| (d.request.0, d.worker.as_str())).collect();
    let hot: Vec<Option<&str>> =
        outcomes.iter().filter(|o| o.hot).map(|o| o.request_id.and_then(|id| worker_of.get(&id).copied())).collect();
    let owner_share = match &owner {
        Some(o) if !hot.is_empty() => hot.iter().filter(|w| **w == Some(o.as_str())).count() as f64 / hot.len() as f64,
        _ => 0.0,
    };
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.status == 200 && o.e2e.is_some()).collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|o| o.ttft).collect();
    let mut e2e: Vec<f64> = ok.iter().filter_map(|o| o.e2e).collect();
    let prompt: u64 = after.iter().zip(&before).map(|(a, b)| a.prompt_tokens.saturating_sub(b.prompt_tokens)).sum();
    let cached: u64 = after.iter().zip(&before).map(|(a, b)| a.cached_tokens.saturating_sub(b.cached_tokens)).sum();
    let output: u64 = ok.iter().map(|o| o.output_tokens).sum();
    let shadow = log.iter().filter(|d| d.mode == kvgate_core::Mode::Shadow).count() as u64;
    let streams: Vec<kvgate_gateway::registry::StreamView> =
        state.engines.read().values().map(|e| e.stream.view()).collect();
    let rates: BTreeMap<String, (f64, f64)> = state
        .router
        .workers(state.clock.now())
        .into_iter()
        .map(|w| (w.id.to_string(), (w.prefill_tokens_per_s, w.decode_tokens_per_s)))
        .collect();
    Ok(Report {
        scenario: "demo".into(),
        policy: spec.name.clone(),
        mode: (spec.name == "projected").then_some(mode),
        seed: cfg.seed,
        requests: Requests {
            total: outcomes.len() as u64,
            completed: ok.len() as u64,
            rejected: outcomes.iter().filter(|o| o.status == 429).count() as u64,
            failed: outcomes.iter().filter(|o| o.status != 200 && o.status != 429).count() as u64,
            unfinished: 0,
        },
        throughput: Throughput::over(output, ok.len() as u64, span),
        ttft_s: Percentiles3::of(&mut ttft),
        ttft_cdf: kvgate_sim::report::quantiles(&mut ttft, kvgate_sim::report::CDF_POINTS),
        e2e_s: Percentiles2::of(&mut e2e),
        cache: Cache::of(prompt, cached),
        workers: after
            .iter()
            .zip(&before)
            .zip(&peaks)
            .enumerate()
            .map(|(i, ((a, b), peak))| WorkerReport {
                id: format!("w{i}"),
                requests: a.finished.saturating_sub(b.finished),
                max_waiting: *peak,
                planned_rates: rates.get(&format!("w{i}")).copied(),
                measured_rates: None,
                true_decode_rate: None,
                preemptions: None,
            })
            .collect(),
        hot_prefix: HotPrefix { owner, owner_share: round(owner_share), requests: hot.len() as u64 },
        shadow: Shadow { decisions: shadow, disagreements: log.iter().filter(|d| d.shadow_disagrees()).count() as u64 },
        decisions_by_reason: reasons,
        kv: KvStats {
            gaps: streams.iter().map(|s| s.gaps).sum(),
            history_lost: streams.iter().map(|s| s.history_lost).sum(),
            restarts: streams.iter().map(|s| s.restarts).sum(),
            credit_while_untrusted: 0,
        },
        timeline: if cfg.timeline { samples } else { Vec::new() },
        per_request: Vec::new(),
    })
}

/// The number of requests one run sends.
pub fn requests_per_run(cfg: &DemoConfig) -> usize {
    arrivals(cfg).len()
}
