//! Paced engines: each scheduler step of a real engine takes its profile's step time (within 5%),
//! and an engine kept busy does not slow its idle neighbour, as on separate GPUs. Unpaced, on two
//! shared cores, the same load on `a` doubled `b`'s median time to first token and took its p90
//! from 9 to 246 ms (docs/real-engines.md).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use futures_util::StreamExt;
use kvgate_real_engines::fleet::{Engine, Fleet};
use kvgate_real_engines::gateway::http;
use kvgate_real_engines::pacing::{read_steps, PacedStep};

use super::calibration::cold_prompt;

/// Probes per phase.
const PROBES: u64 = 24;
/// Clients that keep the neighbour busy.
const LOADERS: u64 = 12;

/// Time to the first streamed bytes of a cold 256-token prompt sent straight to the engine.
async fn first_token_s(engine: &Engine, tag: u64) -> anyhow::Result<f64> {
    let mut body = cold_prompt(tag, 256, 4);
    body["stream"] = true.into();
    let started = Instant::now();
    let response = http().post(format!("{}/v1/completions", engine.url())).json(&body).send().await?;
    ensure!(response.status().is_success(), "a probe answered {}", response.status());
    let mut stream = response.bytes_stream();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if first.is_none() && chunk.windows(5).any(|w| w == b"data:") {
            first = Some(started.elapsed().as_secs_f64());
        }
    }
    first.context("a probe's stream sent no data")
}

/// `PROBES` probes one after another: their times to first token, sorted.
async fn probe(engine: &Engine, tag: u64) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::new();
    for i in 0..PROBES {
        times.push(first_token_s(engine, tag + i).await?);
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// The steps an engine logged after its first `skip`.
fn steps_since(engine: &Engine, skip: usize) -> anyhow::Result<Vec<PacedStep>> {
    Ok(read_steps(&engine.pace_log())?.into_iter().skip(skip).collect())
}

/// Every step's target is the Rust model's time for its batch; of the steps whose own work took
/// under 80% of the target, at least 95% ended within 5% of it. Returns (steps, median lateness,
/// steps whose own work ran past the target).
fn check_steps(engine: &Engine, steps: &[PacedStep]) -> anyhow::Result<(usize, f64, usize)> {
    let pacing = engine.spec.pacing.as_ref().context("the engine is not paced")?;
    ensure!(!steps.is_empty(), "engine {} logged no steps during the trial", engine.spec.name);
    for s in steps {
        let modeled = pacing.step_ms(s.decode_seqs, s.decode_context, s.prefill_tokens);
        ensure!(
            (s.target_ms - modeled).abs() < 0.01,
            "engine {}: the pacer's target {} ms differs from the model's {modeled} ms for {s:?}",
            engine.spec.name,
            s.target_ms
        );
    }
    let in_budget: Vec<&PacedStep> = steps.iter().filter(|s| s.compute_ms < 0.8 * s.target_ms).collect();
    let on_time = in_budget.iter().filter(|s| s.lateness() <= 1.05).count();
    ensure!(
        on_time as f64 >= 0.95 * in_budget.len() as f64,
        "engine {}: {on_time} of {} steps ended within 5% of the modeled time",
        engine.spec.name,
        in_budget.len()
    );
    let mut lateness: Vec<f64> = steps.iter().map(PacedStep::lateness).collect();
    lateness.sort_by(f64::total_cmp);
    let overrun = steps.iter().filter(|s| s.compute_ms > s.target_ms).count();
    Ok((steps.len(), quantile(&lateness, 0.5), overrun))
}

pub async fn a_paced_engine_steps_at_its_profiles_time_and_a_busy_neighbour_does_not_slow_it(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let (a, b) = (fleet.engine("a"), fleet.engine("b"));
    let (a_before, b_before) = (read_steps(&a.pace_log())?.len(), read_steps(&b.pace_log())?.len());

    let alone = probe(b, 7_000_000).await?;

    // `a` kept busy: clients each sending cold 800-token prompts for 96 tokens, one after another.
    let stop = Arc::new(AtomicBool::new(false));
    let loaders: Vec<_> = (0..LOADERS)
        .map(|k| {
            let (url, stop) = (a.url(), stop.clone());
            tokio::spawn(async move {
                let mut sent = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let body = cold_prompt(7_100_000 + k * 10_000 + sent, 800, 96);
                    let r = http().post(format!("{url}/v1/completions")).json(&body).send().await?;
                    ensure!(r.status().is_success(), "a load request answered {}", r.status());
                    r.bytes().await?;
                    sent += 1;
                }
                anyhow::Ok(sent)
            })
        })
        .collect();
    // Until the neighbour's batch is full and its queue steady.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let beside = probe(b, 7_500_000).await?;
    stop.store(true, Ordering::Relaxed);
    let mut load_requests = 0;
    for l in loaders {
        load_requests += l.await??;
    }

    let (a_steps, a_late, a_overrun) = check_steps(a, &steps_since(a, a_before)?)?;
    let (b_steps, b_late, b_overrun) = check_steps(b, &steps_since(b, b_before)?)?;
    let busy_batches = steps_since(a, a_before)?.iter().map(|s| s.decode_seqs).max().unwrap_or(0);
    let ms = |s: &[f64], q: f64| quantile(s, q) * 1000.0;
    eprintln!(
        "  b's time to first token alone p50 {:.1} / p90 {:.1} ms, beside a busy a p50 {:.1} / p90 {:.1} ms; \
         a served {load_requests} load requests, batches up to {busy_batches}; steps: a {a_steps} \
         (median wall/target {a_late:.3}, {a_overrun} computed past the target), b {b_steps} ({b_late:.3}, {b_overrun})",
        ms(&alone, 0.5),
        ms(&alone, 0.9),
        ms(&beside, 0.5),
        ms(&beside, 0.9)
    );
    ensure!(busy_batches >= 4, "a never ran a batch of 4 or more: the load did not load it ({busy_batches})");
    ensure!(
        quantile(&beside, 0.5) <= 1.15 * quantile(&alone, 0.5),
        "b's median time to first token went from {:.1} ms alone to {:.1} ms beside a busy a",
        ms(&alone, 0.5),
        ms(&beside, 0.5)
    );
    ensure!(
        quantile(&beside, 0.9) <= 1.5 * quantile(&alone, 0.9),
        "b's p90 time to first token went from {:.1} ms alone to {:.1} ms beside a busy a",
        ms(&alone, 0.9),
        ms(&beside, 0.9)
    );
    Ok(())
}
