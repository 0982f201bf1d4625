//! Paced engines: each scheduler step of a real engine takes its profile's step time (the median
//! step within 2%, all of them together within 5%), and an engine kept busy does not slow its idle
//! neighbour, as on separate GPUs. Unpaced, on two
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

/// What a paced engine's steps took: how many, the median and p90 of wall over target, the whole
/// run's wall over target, and how many steps' own work ran past their target.
struct StepTiming {
    steps: usize,
    median: f64,
    p90: f64,
    total: f64,
    overrun: usize,
}

/// Every step's target is the Rust model's time for its batch, the median step ends within 2% of
/// its target and all steps together within 5% of theirs. Single steps can end a few milliseconds
/// late when the cores are busy (a sleeping engine wakes late); the pacer makes that up in the next
/// step, so it does not add up.
fn check_steps(engine: &Engine, steps: &[PacedStep]) -> anyhow::Result<StepTiming> {
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
    let mut lateness: Vec<f64> = steps.iter().map(PacedStep::lateness).collect();
    lateness.sort_by(f64::total_cmp);
    let timing = StepTiming {
        steps: steps.len(),
        median: quantile(&lateness, 0.5),
        p90: quantile(&lateness, 0.9),
        total: steps.iter().map(|s| s.wall_ms).sum::<f64>() / steps.iter().map(|s| s.target_ms).sum::<f64>(),
        overrun: steps.iter().filter(|s| s.compute_ms > s.target_ms).count(),
    };
    ensure!(
        timing.median <= 1.02 && timing.total <= 1.05,
        "engine {}: steps took {:.3}x their modeled time at the median and {:.3}x in all (p90 {:.3}; {} of {} \
         computed past it)",
        engine.spec.name,
        timing.median,
        timing.total,
        timing.p90,
        timing.overrun,
        timing.steps
    );
    Ok(timing)
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

    let a_timing = check_steps(a, &steps_since(a, a_before)?)?;
    let b_timing = check_steps(b, &steps_since(b, b_before)?)?;
    let busy_batches = steps_since(a, a_before)?.iter().map(|s| s.decode_seqs).max().unwrap_or(0);
    let ms = |s: &[f64], q: f64| quantile(s, q) * 1000.0;
    let show = |t: &StepTiming| {
        format!(
            "{} (wall/target median {:.3}, p90 {:.3}, in all {:.3}; {} computed past it)",
            t.steps, t.median, t.p90, t.total, t.overrun
        )
    };
    eprintln!(
        "  b's time to first token alone p50 {:.1} / p90 {:.1} ms, beside a busy a p50 {:.1} / p90 {:.1} ms; \
         a served {load_requests} load requests, batches up to {busy_batches}; steps: a {}, b {}",
        ms(&alone, 0.5),
        ms(&alone, 0.9),
        ms(&beside, 0.5),
        ms(&beside, 0.9),
        show(&a_timing),
        show(&b_timing)
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
