//! Decode as occupancy on a real engine: vLLM and SGLang admit a new prompt at its next step while a batch
//! decodes, so the running batch costs the prompt a share of its steps, not the time the batch
//! takes to finish. kvgate's projection for the prompt says the same: its `decode_s` is the steps
//! the batch rides, and the batch's remaining decode is nowhere in the prompt's projected time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use kvgate_real_engines::fleet::Fleet;
use kvgate_real_engines::gateway::{http, post, test_overrides, Gateway};
use serde_json::Value;

use super::calibration::{cold_prompt, direct_full_batch_decode_rate, DECODE_BATCH};

/// Prompt tokens of each probe: one of the engine's steps.
const PROBE_TOKENS: usize = 512;

/// Tokens each request of the running batch decodes.
const BATCH_DECODE_TOKENS: u32 = 1_200;

/// Probes sent one at a time, alone and then beside the batch.
const PROBES: u64 = 5;

/// One probe through kvgate (a cold prompt, one output token): the client's round trip, which is
/// its time to first token, and kvgate's score of worker `a` for it.
async fn probe(gw: &Gateway, tag: u64) -> anyhow::Result<(f64, Value)> {
    let started = Instant::now();
    post(&gw.url, "/v1/completions", &cold_prompt(tag, PROBE_TOKENS, 1)).await?;
    let seconds = started.elapsed().as_secs_f64();
    let log: Value = http().get(format!("{}/admin/decisions?limit=1", gw.url)).send().await?.json().await?;
    let decision = &log["decisions"][0]["decision"];
    let score = decision["scores"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["worker"] == "a"))
        .with_context(|| format!("no score for a in {decision}"))?;
    Ok((seconds, score.clone()))
}

/// The middle value (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub async fn a_running_batch_delays_a_new_prompt_by_its_steps_not_by_its_drain(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let a = fleet.engine("a");
    // kvgate is told a's decode as the engine runs it: a batch of 8 takes one inter-token time a
    // step, so 8 running sequences add that much to each step (the batch limit is left far above).
    let decode_rate = direct_full_batch_decode_rate(a, 70_000).await?;
    let mut overrides = test_overrides(&[a]);
    overrides.workers = vec![format!("{},decode_tokens_per_s={decode_rate:.0}", a.worker_flag())];
    let gw = Gateway::start("", overrides).await?;
    gw.wait_idle("a").await?;

    let mut alone = Vec::new();
    for i in 0..PROBES {
        alone.push(probe(&gw, 80_000 + i).await?.0);
    }

    // The batch: eight requests through kvgate, each decoding 1,200 tokens. They do not stream: a
    // token stream relayed behind its engine outlasts the decoding it is meant to time. Each answer
    // arrives when the engine has decoded its last token.
    let batch: Vec<_> = (0..DECODE_BATCH)
        .map(|i| {
            let url = gw.url.clone();
            let body = cold_prompt(81_000 + i, 32, BATCH_DECODE_TOKENS);
            tokio::spawn(async move {
                post(&url, "/v1/completions", &body).await?;
                anyhow::Ok(Instant::now())
            })
        })
        .collect();
    // A load report of a with the whole batch running, so that kvgate projects with it.
    let batch_started = Instant::now();
    let mut trace = Vec::new();
    loop {
        let r = gw.worker("a").await?["router"].clone();
        let (in_flight, running) = (r["in_flight"].as_u64().unwrap_or(0), r["running_requests"].as_u64().unwrap_or(0));
        if in_flight == DECODE_BATCH && running >= DECODE_BATCH {
            break;
        }
        trace.push(format!(
            "{:.2} s: in flight {in_flight}, running {running}, waiting {}, load age {} ms",
            batch_started.elapsed().as_secs_f64(),
            r["waiting_requests"],
            r["load_age_ms"]
        ));
        ensure!(batch.iter().all(|b| !b.is_finished()), "a request of the batch ended early:\n{}", trace.join("\n"));
        ensure!(
            batch_started.elapsed() < Duration::from_secs(30),
            "kvgate never saw `a` run the whole batch:\n{}",
            trace.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let probes_started = Instant::now();
    let mut beside = Vec::new();
    let mut scores = Vec::new();
    for i in 0..PROBES {
        let (seconds, score) = probe(&gw, 82_000 + i).await?;
        beside.push(seconds);
        scores.push(score);
    }
    let probes_done = Instant::now();
    let mut batch_done = probes_done;
    for b in batch {
        batch_done = batch_done.max(b.await??);
    }
    let decode_s: Vec<f64> = scores.iter().map(|s| s["decode_s"].as_f64().unwrap_or(f64::NAN)).collect();
    ensure!(
        probes_done < batch_done,
        "the batch ended before the probes did: nothing was measured beside it (scores {scores:?})"
    );
    // What a drain model would have charged the first probe: the decoding the batch still had.
    let drain_s = (batch_done - probes_started).as_secs_f64();
    let (alone, beside, decode_s) = (median(alone), median(beside), median(decode_s));
    eprintln!(
        "{PROBE_TOKENS}-token probes: {:.1} ms alone, {:.1} ms beside a batch of {DECODE_BATCH} decoding (median of \
         {PROBES}); the batch still had {drain_s:.2} s to decode at the first; kvgate's decode_s {:.1} ms (a step of \
         the batch: {:.1} ms at {decode_rate:.0} tokens/s)",
        alone * 1e3,
        beside * 1e3,
        decode_s * 1e3,
        DECODE_BATCH as f64 / decode_rate * 1e3
    );
    ensure!(
        beside < 0.25 * drain_s,
        "a probe beside the batch took {beside:.3} s to its first token, not far below the {drain_s:.2} s the batch still \
         had to decode: the engine did not admit it at its next step"
    );
    ensure!(
        decode_s > 0.0 && decode_s < 0.25 * drain_s,
        "kvgate's decode_s for a probe beside the batch was {decode_s:.4} s (the batch still had {drain_s:.2} s to \
         decode); scores: {scores:?}"
    );
    // A probe's prefill fits one step, so the batch costs it the one step it rides: 8 sequences at
    // the rate kvgate was told. Half to twice that leaves room for a request of the batch that
    // kvgate saw finish or a probe it counted as queued, not for a second step.
    let step_s = DECODE_BATCH as f64 / decode_rate;
    ensure!(
        (0.5 * step_s..=2.0 * step_s).contains(&decode_s),
        "kvgate's decode_s for a probe beside the batch was {decode_s:.4} s, not the batch's one step of {step_s:.4} s; \
         scores: {scores:?}"
    );
    gw.stop().await;
    Ok(())
}
