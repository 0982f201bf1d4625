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

use super::grpc::{agree, cases, outcome, smg_style_gateway, Outcome};

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
    fits: fn(path: &str, a: &Outcome, b: &Outcome) -> bool,
}

const DEPARTURES: &[Departure] = &[
    // SMG tokenizes a completions prompt without the BOS token the engine's server adds: one prompt
    // token fewer, and so (the model seeing another prompt) other text.
    Departure {
        name: "completions prompt without BOS",
        fits: |path, a, b| path == "/v1/completions" && b.1 + 1 == a.1,
    },
    // SMG answers a chat message whose text is only whitespace (or empty) with `content: null`.
    Departure {
        name: "blank chat content as null",
        fits: |path, a, b| {
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
        let through = outcome(&gw.url, path, body).await.map_err(|e| format!("{e:#}"));
        let by_smg = outcome(&smg.url, path, body).await.map_err(|e| format!("{e:#}"));
        if matches!((&through, &by_smg), (Ok(a), Ok(b)) if agree(a, b)) {
            same += 1;
            continue;
        }
        let engine = outcome(&own.url(), path, body).await.map_err(|e| format!("{e:#}"));
        let named = match (&through, &by_smg, &engine) {
            (Ok(a), Ok(b), Ok(e)) if agree(a, e) => DEPARTURES.iter().find(|d| (d.fits)(path, a, b)),
            _ => None,
        };
        match named {
            Some(d) => departed.push(d.name),
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
