//! Calibration on a real engine: the prefill rate kvgate measures from the cadence of the engine's
//! own KV event batches agrees with the marginal prefill cost of lone cold prompts, as the engine
//! itself reports their prefill time (the client's round trips are shown beside it); the decode
//! rate kvgate measures from the blocks the engine fills while decoding agrees with the engine's
//! own inter-token latency of a full batch. With calibration off they are measured and shown but
//! not planned with; turned on, they replace configured rates three times too fast.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use futures_util::StreamExt;
use kvgate_real_engines::fleet::{Engine, Fleet, Runtime, MODEL};
use kvgate_real_engines::gateway::{engine_metric, http, post, test_overrides, Gateway};
use serde_json::{json, Value};

/// A completions body whose prompt is `tokens` token ids no other trial or run sends (so the engine
/// computes all of it).
pub(super) fn cold_prompt(tag: u64, tokens: usize, max_tokens: u32) -> Value {
    let mut x = tag ^ u64::from(std::process::id()) << 32 ^ 0x9e37_79b9_7f4a_7c15;
    let ids: Vec<u32> = (0..tokens)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            10 + (x % 890) as u32
        })
        .collect();
    json!({"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": true})
}

/// The `n`th of a series of exponential gaps of mean `mean`, the same in every run.
fn arrival_gap(n: u64, mean: Duration) -> Duration {
    let mut x = n.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    // Uniform in (0, 1], never 0: its logarithm is finite.
    let uniform = ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    mean.mul_f64(-uniform.ln())
}

/// The engine's own time in prefill for one request (`vllm:request_prefill_time_seconds`: from
/// being scheduled to its first token, so without HTTP, queueing or output), sent alone; and the
/// client's whole round trip.
async fn cold_request(url: &str, body: &Value) -> anyhow::Result<(f64, f64)> {
    let sum = "vllm:request_prefill_time_seconds_sum";
    let count = "vllm:request_prefill_time_seconds_count";
    let (sum_before, count_before) = (engine_metric(url, sum).await?, engine_metric(url, count).await?);
    let started = Instant::now();
    post(url, "/v1/completions", body).await?;
    let round_trip = started.elapsed().as_secs_f64();
    // The engine's metrics follow its outputs by a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine_metric(url, count).await? < count_before + 1.0 {
        ensure!(Instant::now() < deadline, "{count} did not count the request");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((engine_metric(url, sum).await? - sum_before, round_trip))
}

/// The fastest of five cold requests each of `short` and `long` prompt tokens (one output token,
/// sent to the engine directly, the sizes taking turns so that a busy moment of the shared cores
/// slows both alike): `[short, long]`, each as (the engine's prefill time, the client's round trip).
async fn fastest_cold(url: &str, short: usize, long: usize) -> anyhow::Result<[(f64, f64); 2]> {
    let mut best = [(f64::INFINITY, f64::INFINITY); 2];
    for i in 0..5 {
        for (k, tokens) in [short, long].into_iter().enumerate() {
            let (engine, client) = cold_request(url, &cold_prompt(1_000 * tokens as u64 + i, tokens, 1)).await?;
            best[k] = (best[k].0.min(engine), best[k].1.min(client));
        }
    }
    Ok(best)
}

/// The share of the engine's prefill rate that the prefill trial's prompts bring.
const PREFILL_LOAD: f64 = 0.35;

pub async fn the_prefill_rate_is_measured_from_the_engines_own_step_cadence(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    // The reference: the extra prefill time 1,920 more prompt tokens take (128 against 2,048, the
    // range of the steps the traffic below makes, within the engine's 2,048-token step budget), as
    // the engine reports it. The difference leaves out the per-step costs; the engine's own times
    // leave out HTTP and the API server's handling of the longer body, which made the client's
    // round trips read about 8% slower (117k against 126k tokens/s, 2026-12-02). The tiny model's
    // attention makes long prompts cost more per token on the CPU, so "the" rate depends on the
    // sizes; these are the ones the cadence sees.
    let [(short, short_rt), (long, long_rt)] = fastest_cold(&a.url(), 128, 2_048).await?;
    ensure!(long > short, "2,048 tokens took {long:.4} s in prefill, no longer than 128 ({short:.4} s)");
    let reference_rate = 1_920.0 / (long - short);
    let round_trip_rate = 1_920.0 / (long_rt - short_rt);

    // kvgate in front of `a` alone, told `a` is three times faster than that.
    // Whole tokens per second: what the worker flag below says exactly.
    let configured = (3.0 * reference_rate).round();
    let mut overrides = test_overrides(&[a]);
    overrides.workers = vec![format!("{},prefill_tokens_per_s={configured:.0}", a.worker_flag())];
    let gw = Gateway::start("", overrides).await?;
    gw.wait_idle("a").await?;

    // Traffic: most prompts a few hundred tokens, one in seven of 2,000 to 3,500 (steps the size of
    // the engine's budget), arriving as independent clients do, the gaps exponential. Requests sent in
    // waves all reach the engine between two of its steps, so every step computes several prompts and
    // none is large beside the typical one: the envelope then has nothing to anchor its slope (three
    // of five suites failed so, once the engines stopped starving this process of CPU and the waves
    // really arrived together). An engine given more prefill than it computes runs every step at
    // its full budget, all of one size, which fits no rate either: the arrivals bring about a third
    // of what the engine's own prefill times say it computes (one every 20 ms where it computes
    // 85k tokens a second; on a CPU without AVX-512 it computed 6.3k, and 20 ms left no step short).
    const PROMPTS: u64 = 120;
    let prompt_tokens = |n: u64| if n % 7 == 3 { 2_000 + (n as usize % 4) * 500 } else { 64 + (n as usize * 97) % 400 };
    let mean_tokens = (0..PROMPTS).map(prompt_tokens).sum::<usize>() as f64 / PROMPTS as f64;
    let mean_gap = Duration::from_secs_f64(mean_tokens / (PREFILL_LOAD * reference_rate));
    let sending = mean_gap * (PROMPTS as u32);
    ensure!(
        sending < Duration::from_secs(180),
        "the engine's prefill times give {reference_rate:.0} tokens/s (128 in {short:.4} s, 2,048 in {long:.4} s): \
         {PROMPTS} prompts at about a third of that would take {:.0} s, too long for a trial",
        sending.as_secs_f64()
    );
    let mut requests = Vec::new();
    for n in 0..PROMPTS {
        tokio::time::sleep(arrival_gap(n, mean_gap)).await;
        let body = cold_prompt(10_000 + n, prompt_tokens(n), 8);
        let url = gw.url.clone();
        requests.push(tokio::spawn(async move { post(&url, "/v1/completions", &body).await }));
    }
    let sent = requests.len();
    for r in requests {
        r.await??;
    }

    // The last steps' events may still be on their way.
    let deadline = Instant::now() + Duration::from_secs(10);
    let router = loop {
        let router = gw.worker("a").await?["router"].clone();
        if router["measured_prefill_tokens_per_s"].is_number() {
            break router;
        }
        ensure!(
            Instant::now() < deadline,
            "no prefill rate measured from a's steps after {sent} requests, one every {:.0} ms on average (the \
             engine's prefill times give {reference_rate:.0} tokens/s: 128 in {short:.4} s, 2,048 in {long:.4} s): \
             {router}",
            mean_gap.as_secs_f64() * 1e3
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let measured_off = router["measured_prefill_tokens_per_s"].as_f64().context("a number")?;
    let planned_off = router["prefill_tokens_per_s"].as_f64().context("a number")?;
    ensure!(
        planned_off == configured,
        "calibration off, yet a plans with {planned_off:.0}, not the configured {configured:.0}"
    );
    // vLLM turns async scheduling off on the CPU, so the engine publishes each step's events once
    // the step has run; the fit must have found that pairing, not the one async scheduling needs.
    ensure!(
        router["step_alignment"] == "after_step",
        "vLLM on the CPU publishes after each step, yet the fit paired batches as {} (measured {measured_off:.0} \
         tokens/s, the engine's prefill times {reference_rate:.0})",
        router["step_alignment"]
    );
    let metrics = http().get(format!("{}/metrics", gw.url)).send().await?.text().await?;
    ensure!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvgate_engine_prefill_tokens_per_second{engine=\"a\",rate=\"measured\"}")),
        "the measured rate is not among the gauges"
    );
    ensure!(
        metrics.lines().any(|l| l == "kvgate_engine_step_alignment{engine=\"a\",alignment=\"after_step\"} 1"),
        "the alignment the fit found is not among the gauges"
    );

    // Turned on, the next decisions plan with what was measured.
    let (measured, planned) = rates_with_calibration_on(&gw, "prefill").await?;
    eprintln!(
        "engine-reported {reference_rate:.0} tokens/s (128: {short:.4} s, 2,048: {long:.4} s in prefill; client round trips \
         {round_trip_rate:.0}); configured {configured:.0}; prompts every {:.0} ms on average; \
         measured from steps {measured_off:.0} with calibration off (planned {planned_off:.0}), {measured:.0} on (planned {planned:.0})",
        mean_gap.as_secs_f64() * 1e3
    );
    // The steps read 1.1–1.8× the client's round trips on this engine (docs/routing-advanced.md: the fit
    // gives part of each busy step's time to its running sequences, and the lone prompts run alone);
    // what must hold is that a rate configured 3× off is replaced by one within 2× of the truth.
    Rates { measured, planned, reference: reference_rate, configured }.ensure_replaced("prefill", 0.6..=2.0)?;
    gw.stop().await;
    Ok(())
}

/// Turns calibration on and reads `a`'s measured and planned `kind` rate (`prefill` or `decode`).
async fn rates_with_calibration_on(gw: &Gateway, kind: &str) -> anyhow::Result<(f64, f64)> {
    let resp = http().put(format!("{}/admin/policy", gw.url)).json(&json!({"calibrate": true})).send().await?;
    ensure!(resp.status().is_success(), "PUT /admin/policy answered {}", resp.status());
    let router = gw.worker("a").await?["router"].clone();
    let rate = |field: String| router[&field].as_f64().with_context(|| format!("no {field} in {router}"));
    Ok((rate(format!("measured_{kind}_tokens_per_s"))?, rate(format!("{kind}_tokens_per_s"))?))
}

/// One rate of `a` with calibration on, beside what it was configured at and what it really is.
struct Rates {
    measured: f64,
    planned: f64,
    reference: f64,
    configured: f64,
}

impl Rates {
    /// The measured rate is within `within` times the reference and replaced the configured one.
    fn ensure_replaced(&self, kind: &str, within: std::ops::RangeInclusive<f64>) -> anyhow::Result<()> {
        let Rates { measured, planned, reference, configured } = *self;
        let ratio = measured / reference;
        ensure!(
            within.contains(&ratio),
            "kvgate measured {kind} at {measured:.0} tokens/s, the reference is {reference:.0} ({ratio:.2}×)"
        );
        ensure!(
            planned == measured,
            "configured at {configured:.0}, a plans {kind} at {planned:.0}, not the measured {measured:.0}"
        );
        Ok(())
    }
}

/// A full batch in the decode trial: kvgate is told the engine runs at most this many sequences.
pub(super) const DECODE_BATCH: u64 = 8;

/// Tokens each stream of the decode trial decodes: five of the engine's 32-token blocks.
const DECODE_TOKENS: u32 = 160;

/// A streamed completions body of a one-block cold prompt, decoding [`DECODE_TOKENS`].
fn streamed(tag: u64) -> Value {
    let mut body = cold_prompt(tag, 32, DECODE_TOKENS);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body
}

/// Streams `bodies` to `url` at once, each to its end.
async fn stream_all(url: &str, bodies: Vec<Value>) -> anyhow::Result<()> {
    let streams: Vec<_> = bodies
        .into_iter()
        .map(|body| {
            let url = format!("{url}/v1/completions");
            tokio::spawn(async move {
                let resp = http().post(url).json(&body).send().await?;
                ensure!(resp.status().is_success(), "a stream answered {}", resp.status());
                let mut chunks = resp.bytes_stream();
                while let Some(chunk) = chunks.next().await {
                    chunk?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for s in streams {
        s.await??;
    }
    Ok(())
}

/// The decode rate of a full batch sent to the engine at `url` directly, by its own inter-token
/// times: `DECODE_BATCH` streams, tagged from `first_tag` so that no other request shares them.
pub(super) async fn direct_full_batch_decode_rate(engine: &Engine, first_tag: u64) -> anyhow::Result<f64> {
    let bodies = (0..DECODE_BATCH).map(|i| streamed(first_tag + i)).collect();
    let url = engine.url();
    Ok(DECODE_BATCH as f64 / engine_inter_token_s(engine.spec.runtime, &url, &url, bodies).await?)
}

/// `bodies` streamed to `url` at once, and the engine's mean inter-token latency over them (its
/// `inter_token_latency_seconds` histogram at `engine`: vLLM's is timed by the engine core's own
/// clock, so without the API server's or the client's delays; SGLang's by its tokenizer process).
async fn engine_inter_token_s(runtime: Runtime, engine: &str, url: &str, bodies: Vec<Value>) -> anyhow::Result<f64> {
    let histogram = runtime.inter_token_metric();
    let (sum, count) = (format!("{histogram}_sum"), format!("{histogram}_count"));
    let (sum, count) = (sum.as_str(), count.as_str());
    let (sum_before, count_before) = (engine_metric(engine, sum).await?, engine_metric(engine, count).await?);
    let expected = count_before + (bodies.len() as u64 * u64::from(DECODE_TOKENS - 1)) as f64;
    stream_all(url, bodies).await?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while engine_metric(engine, count).await? < expected {
        ensure!(Instant::now() < deadline, "{count} did not count the streams' tokens");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tokens = engine_metric(engine, count).await? - count_before;
    Ok((engine_metric(engine, sum).await? - sum_before) / tokens)
}

pub async fn the_decode_rate_is_measured_from_the_engines_decode_filled_blocks(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    // A first guess at a full batch's decode rate, to configure kvgate 3× off it: the engine's
    // inter-token times of a full batch sent to it directly.
    let direct_rate = direct_full_batch_decode_rate(a, 50_000).await?;

    // kvgate in front of `a`, told its full batch is 8 sequences and that it decodes 3× faster.
    // The prefill rate is left at its default: a wave's one-block prompts are computed before its
    // first decode-filled block and the next wave starts after its last, so no span carries a
    // prompt to take out at that rate.
    let configured = (3.0 * direct_rate).round();
    let mut overrides = test_overrides(&[a]);
    overrides.workers =
        vec![format!("{},max_running_requests={DECODE_BATCH},decode_tokens_per_s={configured:.0}", a.worker_flag())];
    let gw = Gateway::start("", overrides).await?;
    gw.wait_idle("a").await?;

    // Waves of 1 to 8 streams at once: the batch sizes the fit needs to tell a step's fixed cost
    // from each sequence's. The streams are what broke the decode timing before it came from the
    // engine: on this machine a stream's tokens can reach the client all at once. The reference
    // is the engine's own inter-token time in the full waves, under the same load (kvgate and
    // its streams share the cores with the engine: a full batch sent directly decoded 0.83–1.15×
    // as fast in the runs of 2026-12-03).
    let mut sent = 0u64;
    let mut full_wave_inter_token_s = Vec::new();
    for wave in 0..16u64 {
        let width = 1 + wave % DECODE_BATCH;
        let bodies: Vec<Value> = (0..width).map(|i| streamed(60_000 + wave * 100 + i)).collect();
        if width == DECODE_BATCH {
            full_wave_inter_token_s.push(engine_inter_token_s(a.spec.runtime, &a.url(), &gw.url, bodies).await?);
        } else {
            stream_all(&gw.url, bodies).await?;
        }
        sent += width;
    }
    let inter_token_s = full_wave_inter_token_s.iter().sum::<f64>() / full_wave_inter_token_s.len() as f64;
    let reference_rate = DECODE_BATCH as f64 / inter_token_s;
    let router = gw.worker("a").await?["router"].clone();
    let measured_off = router["measured_decode_tokens_per_s"]
        .as_f64()
        .with_context(|| format!("no decode rate measured from {sent} streams: {router}"))?;
    let planned_off = router["decode_tokens_per_s"].as_f64().context("a number")?;
    ensure!(planned_off == configured, "calibration off, yet a plans decode at {planned_off:.0}, not {configured:.0}");
    ensure!(
        router["decode_timing"] == "decode_filled_blocks",
        "vLLM publishes the blocks its decoding fills, yet a's decode is timed by {}",
        router["decode_timing"]
    );
    let metrics = http().get(format!("{}/metrics", gw.url)).send().await?.text().await?;
    ensure!(
        metrics.lines().any(|l| l == "kvgate_engine_decode_timing{engine=\"a\",timing=\"decode_filled_blocks\"} 1"),
        "what times a's decode is not among the gauges"
    );

    let (measured, planned) = rates_with_calibration_on(&gw, "decode").await?;
    eprintln!(
        "a full batch of {DECODE_BATCH} decodes {reference_rate:.0} tokens/s by the engine's inter-token times \
         ({:.2} ms; sent directly {direct_rate:.0}); configured {configured:.0}; measured from the \
         decode-filled blocks of {sent} streams {measured_off:.0} with calibration off (planned {planned_off:.0}), \
         {measured:.0} on (planned {planned:.0})",
        inter_token_s * 1e3
    );
    // 0.81–1.07× in fifteen local runs of 2026-12-03 (docs/routing-advanced.md).
    Rates { measured, planned, reference: reference_rate, configured }.ensure_replaced("decode", 0.6..=1.6)?;
    gw.stop().await;
    Ok(())
}
