//! Embeddings over gRPC: the tiny model served as an embedding model twice, by the engine's own
//! OpenAI server and as a gRPC worker (`Embed`); the same inputs through kvgate give the same
//! vectors, bit for bit, and the same usage. Both engines are started for this trial and stopped
//! after it (the suite's fleet serves a generating model).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use base64::Engine as _;
use kvgate_real_engines::fleet::{EngineSpec, Fleet, Runtime, MODEL};
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

/// Scores may differ from the engine's in the last bits: kvgate sums the cosine in f64, torch in
/// float32.
const SCORE_TOLERANCE: f64 = 1e-5;

/// vLLM's score requests in each of its forms, and rerank with a cut and without.
fn score_cases() -> Vec<(&'static str, Value)> {
    vec![
        ("/v1/score", json!({"model": MODEL, "text_1": "hello", "text_2": ["hello world", "bye 🙂", "hello"]})),
        (
            "/v1/score",
            json!({"model": MODEL, "queries": ["a cat", "a dog"], "documents": ["the cat sat", "dogs bark"]}),
        ),
        ("/v1/score", json!({"model": MODEL, "data_1": "one", "data_2": "one two"})),
        (
            "/v1/rerank",
            json!({"model": MODEL, "query": "fruit", "documents": ["apple", "car", "banana 🍌", "fruit"], "top_n": 2}),
        ),
        ("/v1/rerank", json!({"model": MODEL, "query": "weather", "documents": ["rain", "sun", "code"]})),
    ]
}

/// A score or rerank answer, by index: each pair's index, its score and (rerank) the document's
/// text, in the answer's order; and the usage's prompt tokens.
type Scored = (Vec<(u64, f64, Value)>, u64);

async fn scores(base: &str, path: &str, body: &Value) -> Result<Scored, String> {
    let response = http().post(format!("{base}{path}")).json(body).send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    let answer: Value = response.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("answered {status}: {answer}"));
    }
    let items =
        answer["data"].as_array().or_else(|| answer["results"].as_array()).ok_or(format!("no data: {answer}"))?;
    let pairs = items
        .iter()
        .map(|i| {
            let score = i["score"].as_f64().or_else(|| i["relevance_score"].as_f64()).unwrap_or(f64::NAN);
            (i["index"].as_u64().unwrap_or(u64::MAX), score, i["document"].clone())
        })
        .collect();
    Ok((pairs, answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0)))
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
        EngineSpec::new("eh", 4_096).on(runtime).embedding(),
        EngineSpec::new("eg", 4_096).on(runtime).grpc().embedding(),
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
    // Score and rerank: on vLLM the cosine of the two vectors, as its server scores an embedding
    // model; SGLang's server scores only with a cross-encoder or a generating model, so there
    // kvgate says so.
    let scored = score_cases();
    let mut score_refusals = Vec::new();
    for (path, body) in &scored {
        let through = scores(&gw.url, path, body).await;
        if runtime == Runtime::Sglang {
            let refused =
                through.as_ref().err().is_some_and(|e| e.contains("400") && e.contains("not served by SGLang"));
            if !refused {
                score_refusals.push(format!("{path} {body}: {through:?}"));
            }
            continue;
        }
        let engine = scores(&own.url(), path, body).await;
        let same = match (&engine, &through) {
            (Ok(a), Ok(b)) => {
                a.0.len() == b.0.len()
                    && a.1 == b.1
                    && a.0
                        .iter()
                        .zip(&b.0)
                        .all(|(x, y)| x.0 == y.0 && x.2 == y.2 && (x.1 - y.1).abs() <= SCORE_TOLERANCE)
            }
            _ => false,
        };
        if !same {
            differ.push(format!("{path} {body}\n    engine: {engine:?}\n    kvgate: {through:?}"));
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
    let asked = all.len() + if runtime == Runtime::Vllm { scored.len() } else { 0 };
    ensure!(differ.is_empty(), "{} of {} requests differ:\n{}", differ.len(), asked, differ.join("\n"));
    ensure!(score_refusals.is_empty(), "SGLang workers took score or rerank:\n{}", score_refusals.join("\n"));
    ensure!(chat.0 == 400 && chat.1.contains("needs a worker whose model generates"), "chat answered {chat:?}");
    ensure!(shorter.0 == 400 && shorter.1.contains("`dimensions`"), "dimensions answered {shorter:?}");
    eprintln!(
        "    gRPC embeddings: {} requests, each vector equal to the engine's own server's, bit for bit; {} score \
         and rerank requests {}",
        all.len(),
        scored.len(),
        if runtime == Runtime::Vllm { "scored as the engine's own server scores them" } else { "refused by name" }
    );
    Ok(())
}
