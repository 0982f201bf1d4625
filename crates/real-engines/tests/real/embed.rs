//! Embeddings over gRPC: the tiny model served as an embedding model twice, by the engine's own
//! OpenAI server and as a gRPC worker (`Embed`); the same inputs through kvgate give the same
//! vectors, bit for bit, and the same usage. Both engines are started for this trial and stopped
//! after it (the suite's fleet serves a generating model).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use base64::Engine as _;
use kvgate_real_engines::fleet::{EngineSpec, Fleet, Runtime, BYTES_PER_TOKEN, MODEL};
use kvgate_real_engines::gateway::http;
use serde_json::{json, Value};

use super::grpc::smg_style_gateway;

/// How long the two embedding engines may take to start beside the suite's fleet.
const START: Duration = Duration::from_secs(300);

/// What an embeddings answer says: each vector (as the float32s it holds, base64 decoded) and the
/// usage's prompt and total tokens.
#[derive(Debug, PartialEq)]
struct Embedded {
    vectors: Vec<Vec<f32>>,
    prompt_tokens: u64,
    total_tokens: u64,
}

fn embedded(answer: &Value) -> anyhow::Result<Embedded> {
    let data = answer["data"].as_array().with_context(|| format!("no data: {answer}"))?;
    let mut vectors = Vec::new();
    for (i, item) in data.iter().enumerate() {
        ensure!(item["index"] == i && item["object"] == "embedding", "item {i}: {item}");
        let vector = match &item["embedding"] {
            Value::String(b64) => base64::engine::general_purpose::STANDARD
                .decode(b64)?
                .chunks(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Value::Array(numbers) => numbers.iter().map(|n| n.as_f64().unwrap_or(f64::NAN) as f32).collect(),
            other => anyhow::bail!("item {i}'s embedding is {other}"),
        };
        vectors.push(vector);
    }
    let count = |k: &str| answer["usage"][k].as_u64().with_context(|| format!("no usage.{k}: {answer}"));
    Ok(Embedded { vectors, prompt_tokens: count("prompt_tokens")?, total_tokens: count("total_tokens")? })
}

async fn embed(base: &str, body: &Value) -> anyhow::Result<Embedded> {
    let response = http().post(format!("{base}/v1/embeddings")).json(body).send().await?;
    let status = response.status();
    let answer: Value = response.json().await?;
    ensure!(status.is_success(), "answered {status}: {answer}");
    embedded(&answer)
}

fn cases(runtime: Runtime) -> Vec<Value> {
    let mut all = vec![
        json!({"model": MODEL, "input": "Say hello."}),
        json!({"model": MODEL, "input": ["first", "a second input, longer, with a multi-byte character: 🙂"]}),
        json!({"model": MODEL, "input": [1, 2, 3, 4, 5]}),
        json!({"model": MODEL, "input": [[5, 6, 7], [8, 9]]}),
        json!({"model": MODEL, "input": ["x", "y z"], "encoding_format": "base64"}),
    ];
    if runtime == Runtime::Vllm {
        // SGLang's server has no such field (it always adds the tokenizer's BOS).
        all.push(json!({"model": MODEL, "input": "without BOS", "add_special_tokens": false}));
    }
    all
}

pub async fn a_grpc_embedding_worker_answers_as_the_engines_own_server_does(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let runtime = fleet.engine("a").spec.runtime;
    let specs = vec![
        EngineSpec::new("eh", 4_096 * BYTES_PER_TOKEN).on(runtime).embedding(),
        EngineSpec::new("eg", 4_096 * BYTES_PER_TOKEN).on(runtime).grpc().embedding(),
    ];
    let pair = tokio::task::spawn_blocking(move || Fleet::start(specs, START)).await??;
    let (own, worker) = (pair.engine("eh"), pair.engine("eg"));
    let gw = smg_style_gateway(worker).await?;
    gw.wait_for("the embedding worker healthy and described", Duration::from_secs(60), || async {
        let w = gw.worker("eg").await?;
        Ok(w["healthy"] == true && w["models"] == json!([MODEL]))
    })
    .await?;
    let all = cases(runtime);
    let mut differ = Vec::new();
    for body in &all {
        let engine = embed(&own.url(), body).await.map_err(|e| format!("{e:#}"));
        let through = embed(&gw.url, body).await.map_err(|e| format!("{e:#}"));
        if !matches!((&engine, &through), (Ok(a), Ok(b)) if a == b) {
            let show = |r: &Result<Embedded, String>| match r {
                Ok(e) => format!(
                    "{} vectors, first starts {:?}, usage {}/{}",
                    e.vectors.len(),
                    e.vectors.first().map(|v| &v[..v.len().min(4)]),
                    e.prompt_tokens,
                    e.total_tokens
                ),
                Err(e) => e.clone(),
            };
            differ.push(format!("{body}\n    engine: {}\n    kvgate: {}", show(&engine), show(&through)));
        }
    }
    // A generating route is not sent to an embedding worker, and what `Embed` cannot carry is
    // refused by name.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]});
    let chat = http().post(format!("{}/v1/chat/completions", gw.url)).json(&chat).send().await?;
    let chat = (chat.status(), chat.text().await?);
    let shorter = json!({"model": MODEL, "input": "x", "dimensions": 8});
    let shorter = http().post(format!("{}/v1/embeddings", gw.url)).json(&shorter).send().await?;
    let shorter = (shorter.status(), shorter.text().await?);
    gw.stop().await;
    drop(pair);
    ensure!(differ.is_empty(), "{} of {} requests differ:\n{}", differ.len(), all.len(), differ.join("\n"));
    ensure!(chat.0 == 400 && chat.1.contains("needs a worker whose model generates"), "chat answered {chat:?}");
    ensure!(shorter.0 == 400 && shorter.1.contains("`dimensions`"), "dimensions answered {shorter:?}");
    eprintln!(
        "    gRPC embeddings: {} requests, each vector equal to the engine's own server's, bit for bit",
        all.len()
    );
    Ok(())
}
