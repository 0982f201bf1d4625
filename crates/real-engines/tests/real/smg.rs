//! SMG 1.13 in gRPC mode (the gateway kvgate's users come from) and kvgate in front of the same real
//! gRPC worker `g`, given the gRPC parity trial's requests: SMG answers as kvgate does, except where
//! SMG departs from the engine's own server, each such departure named below and checked to be one
//! (kvgate equal to the engine there, SMG not, in the named way). Anything else fails the trial.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use kvgate_real_engines::fleet::{free_ports, model_dir, smg_binary, Fleet, Runtime};
use kvgate_real_engines::gateway::http;
use serde_json::Value;

use super::grpc::{agree, cases, outcome, smg_style_gateway, whole_instead, without_ending, Outcome};

/// SMG running, stopped when dropped.
struct Smg {
    child: Child,
    url: String,
}

impl Drop for Smg {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SMG in gRPC mode in front of `worker` alone, as an SMG user launches it (docs/migrating-from-smg.md),
/// ready once it lists the worker's model.
async fn start_smg(fleet: &Fleet, worker: &str) -> anyhow::Result<Smg> {
    let ports = free_ports(2)?;
    let log = std::fs::File::create(fleet.run_dir().join("smg.log"))?;
    let model = model_dir();
    let child = Command::new(smg_binary())
        .args(["launch", "--host", "127.0.0.1", "--port", &ports[0].to_string()])
        .args(["--prometheus-port", &ports[1].to_string()])
        .args(["--worker-urls", &format!("grpc://127.0.0.1:{}", fleet.engine(worker).port)])
        .args(["--policy", "round_robin", "--block-size", "32", "--log-level", "warn"])
        .arg("--model-path")
        .arg(&model)
        .arg("--tokenizer-path")
        .arg(&model)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", smg_binary().display()))?;
    let smg = Smg { child, url: format!("http://127.0.0.1:{}", ports[0]) };
    for _ in 0..240 {
        let models = http().get(format!("{}/v1/models", smg.url)).send().await;
        if let Ok(resp) = models {
            let v: Value = resp.json().await.unwrap_or_default();
            if v["data"].as_array().is_some_and(|d| !d.is_empty()) {
                return Ok(smg);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    anyhow::bail!(
        "SMG did not list the worker's model within 60 s (log: {})",
        fleet.run_dir().join("smg.log").display()
    )
}

/// A way SMG 1.13 in gRPC mode answers otherwise than the engine's own server, seen on the tiny
/// model: `a` is kvgate's answer (equal to the engine's), `b` SMG's.
struct Departure {
    name: &'static str,
    fits: fn(path: &str, body: &Value, a: &Outcome, b: &Outcome) -> bool,
}

/// Whether a one-choice outcome `b` goes on past `a`'s text with more tokens (the same prompt).
fn runs_on(a: &Outcome, b: &Outcome) -> bool {
    let (Some(x), Some(y)) = (a.0.first(), b.0.first()) else { return false };
    a.1 == b.1 && b.2 > a.2 && y.0.starts_with(&x.0)
}

const DEPARTURES: &[Departure] = &[
    // SMG tokenizes a completions prompt without the BOS token the engine's server adds: one prompt
    // token fewer, and so (the model seeing another prompt) other text.
    Departure {
        name: "completions prompt without BOS",
        fits: |path, _, a, b| path == "/v1/completions" && b.1 + 1 == a.1,
    },
    // The same for a Responses prompt, which vLLM's server tokenizes with its special tokens (the
    // BOS before the template's own).
    Departure { name: "Responses prompt without BOS", fits: |path, _, a, b| path == "/v1/responses" && b.1 + 1 == a.1 },
    // SMG does not apply a Responses request's `stop` (vLLM's extra, which both engines' servers
    // honour): its text runs on through the stop string (or, whitespace only, is left out whole,
    // as SMG leaves out blank chat content).
    Departure {
        name: "Responses stop ignored",
        fits: |path, body, a, b| {
            let stops: Vec<&str> = body["stop"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            let after = b.0.first().zip(a.0.first()).and_then(|(y, x)| y.0.get(x.0.len()..));
            let through_stop = after.is_some_and(|rest| rest.is_empty() || stops.iter().any(|s| rest.starts_with(s)));
            path == "/v1/responses" && !stops.is_empty() && runs_on(a, b) && through_stop
        },
    },
    // SGLang's server keeps two of a Responses request's `max_output_tokens` back; SMG generates
    // all of them.
    Departure {
        name: "Responses without SGLang's two-token headroom",
        fits: |path, body, a, b| {
            path == "/v1/responses" && runs_on(a, b) && b.2 == a.2 + 2 && body["max_output_tokens"] == b.2
        },
    },
    // SMG leaves out a Responses message whose text is only whitespace (and with it the tokens'
    // logprobs), as it leaves out blank chat content; on SGLang workers it also generates the two
    // tokens SGLang's server keeps back.
    Departure {
        name: "blank Responses message left out",
        fits: |path, _, a, b| {
            let (Some(x), Some(y)) = (a.0.first(), b.0.first()) else { return false };
            let headroom = b.2 == a.2 || b.2 == a.2 + 2;
            path == "/v1/responses"
                && x.0.trim().is_empty()
                && !x.0.is_empty()
                && y.0.is_empty()
                && a.1 == b.1
                && headroom
        },
    },
    // SMG answers a chat message whose text is only whitespace (or empty) with `content: null`.
    Departure {
        name: "blank chat content as null",
        fits: |path, _, a, b| {
            path == "/v1/chat/completions"
                && (a.1, a.2) == (b.1, b.2)
                && a.0.len() == b.0.len()
                && a.0.iter().zip(&b.0).all(|(x, y)| x == y || (x.1 == y.1 && x.0.trim().is_empty() && y.0.is_empty()))
        },
    },
];

pub async fn smg_in_grpc_mode_answers_as_kvgate_does_but_where_it_departs_from_the_engine(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let (own, worker) = (fleet.engine("a"), fleet.engine("g"));
    let gw = smg_style_gateway(worker).await?;
    let smg = start_smg(&fleet, "g").await?;
    let all = cases(worker.spec.runtime);
    let (mut same, mut departed, mut unexplained) = (0, Vec::new(), Vec::new());
    for (path, body) in &all {
        // A Responses stream with logprobs is held against the engine's whole answer.
        let whole = whole_instead(path, body);
        let ended = |o: Outcome| if whole.is_some() { without_ending(o) } else { o };
        let through = outcome(&gw.url, path, body).await.map(ended).map_err(|e| format!("{e:#}"));
        let by_smg = outcome(&smg.url, path, body).await.map(ended).map_err(|e| format!("{e:#}"));
        if matches!((&through, &by_smg), (Ok(a), Ok(b)) if agree(a, b)) {
            same += 1;
            continue;
        }
        let engine = outcome(&own.url(), path, whole.as_ref().unwrap_or(body)).await.map_err(|e| format!("{e:#}"));
        let named = match (&through, &by_smg, &engine) {
            (Ok(a), Ok(b), Ok(e)) if agree(a, e) => {
                DEPARTURES.iter().find(|d| (d.fits)(path, body, a, b)).map(|d| d.name)
            }
            // SGLang's `/generate` names no model (its server takes none); SMG routes it by model.
            (Ok(a), Err(refused), Ok(e))
                if agree(a, e) && *path == "/generate" && refused.contains("No worker available for model") =>
            {
                Some("/generate refused for want of a model")
            }
            _ => None,
        };
        match named {
            Some(name) => departed.push(name),
            None => unexplained.push(format!(
                "{path} {body}\n    engine: {engine:?}\n    kvgate: {through:?}\n    SMG:    {by_smg:?}"
            )),
        }
    }
    drop(smg);
    gw.stop().await;
    ensure!(
        unexplained.is_empty(),
        "{} of {} requests answered otherwise by SMG, in no known way:\n{}",
        unexplained.len(),
        all.len(),
        unexplained.join("\n")
    );
    ensure!(same > 0, "SMG agreed with kvgate on no request");
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for name in departed {
        match counts.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => counts.push((name, 1)),
        }
    }
    let runtime = if worker.spec.runtime == Runtime::Sglang { "SGLang" } else { "vLLM" };
    eprintln!(
        "    SMG in gRPC mode ({runtime} worker): {same} of {} requests as kvgate; departures from the engine: {counts:?}",
        all.len()
    );
    Ok(())
}
