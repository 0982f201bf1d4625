//! kvgate in process, in front of real engines, and the HTTP calls the suite makes to both.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvgate_gateway::{AppState, GatewayConfig, Overrides};
use serde_json::{json, Value};

use crate::fleet::{Engine, BLOCK_SIZE};

/// A running kvgate.
pub struct Gateway {
    /// Its shared state (the router, the engine registry).
    pub state: Arc<AppState>,
    /// Base URL.
    pub url: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// The settings the suite runs kvgate with: each engine with the rates of its pacing, quick polls
/// and health checks so tests see changes within a fraction of a second, and no drain on shutdown.
pub fn test_overrides(engines: &[&Engine]) -> Overrides {
    Overrides {
        port: Some(0),
        workers: engines.iter().map(|e| e.paced_worker_flag()).collect(),
        block_size: Some(BLOCK_SIZE),
        tokenizer: Some(crate::fleet::model_dir().join("tokenizer.json").to_string_lossy().into_owned()),
        poll_interval_ms: Some(100),
        health_interval_ms: Some(250),
        shutdown_grace_s: Some(0.0),
        ..Overrides::default()
    }
}

impl Gateway {
    /// Starts kvgate with `overrides` (see [`test_overrides`]) and an optional TOML file body.
    pub async fn start(toml: &str, overrides: Overrides) -> anyhow::Result<Gateway> {
        let dir = std::env::temp_dir().join(format!("kvgate-real-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("gateway.toml");
        std::fs::write(&path, toml)?;
        let mut config = GatewayConfig::load(Some(&path), overrides)?;
        // Without a tokenizer, one of the gRPC workers hands over its own, as `kvgate serve` takes it
        // (a cache of this process's own, so each run downloads it).
        let cache = dir.join("tokenizer-cache");
        kvgate_gateway::worker_tokenizer::resolve(&mut config, &cache, Duration::from_secs(60)).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let state = AppState::new(config)?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let serving = state.clone();
        let task = tokio::spawn(async move {
            let shutdown = async {
                let _ = rx.await;
            };
            if let Err(e) = kvgate_gateway::serve(listener, serving, shutdown).await {
                eprintln!("kvgate stopped with an error: {e}");
            }
        });
        Ok(Gateway { state, url, shutdown: Some(tx), task: Some(task) })
    }

    /// Stops kvgate and waits until its sockets are closed.
    pub async fn stop(mut self) {
        self.stop_now().await;
    }

    async fn stop_now(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
        for e in self.state.engines.read().values() {
            e.stop();
        }
    }

    /// `GET /admin/workers`, the worker named `id`.
    pub async fn worker(&self, id: &str) -> anyhow::Result<Value> {
        let all: Value = http().get(format!("{}/admin/workers", self.url)).send().await?.json().await?;
        all["workers"]
            .as_array()
            .and_then(|w| w.iter().find(|w| w["id"] == id))
            .cloned()
            .with_context(|| format!("no worker {id} in /admin/workers"))
    }

    /// The KV state of worker `id` as `/admin/workers` shows it (`synced`, `invalid`, ...).
    pub async fn kv_state(&self, id: &str) -> anyhow::Result<Value> {
        Ok(self.worker(id).await?["router"]["kv_state"].clone())
    }

    /// Blocks the index holds for worker `id`.
    pub async fn blocks_held(&self, id: &str) -> anyhow::Result<u64> {
        self.worker(id).await?["router"]["blocks_held"].as_u64().context("no blocks_held")
    }

    /// `POST /admin/decide`: the decision record kvgate would make for `body`.
    pub async fn preview(&self, body: &Value) -> anyhow::Result<Value> {
        let r: Value = http().post(format!("{}/admin/decide", self.url)).json(body).send().await?.json().await?;
        Ok(r["decision"].clone())
    }

    /// Prompt tokens kvgate credits as cached on worker `id` for `body`.
    pub async fn credit(&self, body: &Value, id: &str) -> anyhow::Result<u64> {
        let d = self.preview(body).await?;
        scored_credit(&d, id).with_context(|| format!("no score for {id} in {d}"))
    }

    /// Like [`Gateway::credit`], but `None` while `id` is not scored (out of rotation: a health
    /// check of an engine busy on two shared cores can time out).
    pub async fn credit_if_scored(&self, body: &Value, id: &str) -> anyhow::Result<Option<u64>> {
        Ok(scored_credit(&self.preview(body).await?, id))
    }

    /// `POST /admin/tokenize`: kvgate's token ids for `body`.
    pub async fn tokenize(&self, body: &Value) -> anyhow::Result<Vec<u32>> {
        let r: Value = http().post(format!("{}/admin/tokenize", self.url)).json(body).send().await?.json().await?;
        ids(&r["tokens"]).with_context(|| format!("kvgate /admin/tokenize answered {r}"))
    }

    /// The engine the last decision chose.
    pub async fn last_choice(&self) -> anyhow::Result<String> {
        let r: Value = http().get(format!("{}/admin/decisions?limit=1", self.url)).send().await?.json().await?;
        r["decisions"][0]["decision"]["worker"].as_str().map(str::to_owned).context("no decision yet")
    }

    /// Waits until a load report of `id` taken after this call began shows it idle (nothing running
    /// or waiting). An older report, even one that says idle, predates the request that just ended,
    /// and the ledger keeps that request's work until a report covers it.
    pub async fn wait_idle(&self, id: &str) -> anyhow::Result<()> {
        let since = Instant::now();
        self.wait_for(&format!("a fresh load report showing {id} idle"), Duration::from_secs(10), || async {
            let r = &self.worker(id).await?["router"];
            let fresh = r["load_age_ms"].as_u64().is_some_and(|age| u128::from(age) < since.elapsed().as_millis());
            Ok(fresh && r["running_requests"] == 0 && r["waiting_requests"] == 0)
        })
        .await
    }

    /// Waits until `id` is in rotation (healthy) with a synced KV view.
    pub async fn wait_synced(&self, id: &str, timeout: Duration) -> anyhow::Result<()> {
        self.wait_for(&format!("{id} in rotation with a synced KV view"), timeout, || async {
            let w = self.worker(id).await?;
            Ok(w["healthy"] == true && w["router"]["kv_state"]["state"] == "synced")
        })
        .await
    }

    /// Polls `check` every 50 ms until it holds or `timeout` passes.
    pub async fn wait_for<F, Fut>(&self, what: &str, timeout: Duration, mut check: F) -> anyhow::Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<bool>>,
    {
        let deadline = Instant::now() + timeout;
        let mut last_err = None;
        loop {
            match check().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last_err = Some(e),
            }
            if Instant::now() > deadline {
                match last_err {
                    Some(e) => bail!("timed out after {timeout:?} waiting for {what}; last error: {e:#}"),
                    None => bail!("timed out after {timeout:?} waiting for {what}"),
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        for e in self.state.engines.read().values() {
            e.stop();
        }
    }
}

/// A shared HTTP client with a generous timeout (the engines are on 2 shared cores).
pub fn http() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| reqwest::Client::builder().timeout(Duration::from_secs(120)).build().expect("http client"))
        .clone()
}

/// Token ids from a JSON array.
pub fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

/// POSTs `body` to `base + path` and returns the JSON answer, failing on a non-2xx status.
pub async fn post(base: &str, path: &str, body: &Value) -> anyhow::Result<Value> {
    let resp = http().post(format!("{base}{path}")).json(body).send().await?;
    let status = resp.status();
    let text = resp.text().await?;
    if !status.is_success() {
        bail!("POST {path} answered {status}: {text}");
    }
    serde_json::from_str(&text).with_context(|| format!("POST {path}: not JSON: {text}"))
}

/// How long [`flush_prefix_cache`] keeps asking an engine that refuses because it is busy.
const FLUSH_PATIENCE: Duration = Duration::from_secs(30);

/// Empties the engine's prefix cache (vLLM's dev-mode `/reset_prefix_cache`, SGLang's
/// `/flush_cache`), asking again while the engine refuses because it still holds requests.
///
/// SGLang answers 400 while its scheduler has a running or waiting request, and a request the
/// client has already been answered can still be in its running batch: the scheduler handles
/// the flush at the top of its next loop, before that loop drops finished requests from the
/// batch. A flush sent right after a response therefore sometimes finds the engine "busy" with
/// nothing left to do (a clean-clone CI run failed so); a moment later it succeeds.
pub async fn flush_prefix_cache(engine: &Engine) -> anyhow::Result<()> {
    let path = engine.spec.runtime.flush_cache_path();
    let started = Instant::now();
    loop {
        let r = http().post(format!("{}{path}", engine.url())).send().await?;
        let status = r.status();
        if status.is_success() {
            return Ok(());
        }
        let text = r.text().await.unwrap_or_default();
        if status != reqwest::StatusCode::BAD_REQUEST || started.elapsed() > FLUSH_PATIENCE {
            bail!(
                "engine {}: POST {path} answered {status} (after {:.1} s of asking): {text}",
                engine.spec.name,
                started.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The engine's own token ids for a chat or completions body (its `/tokenize`).
pub async fn engine_tokenize(engine: &str, body: &Value) -> anyhow::Result<Vec<u32>> {
    let mut b = body.clone();
    b["model"] = json!(crate::fleet::MODEL);
    let r = post(engine, "/tokenize", &b).await?;
    ids(&r["tokens"]).context("no tokens in /tokenize")
}

/// The prompt token ids the engine really ran for a request (`return_token_ids`, one output token).
pub async fn engine_prompt_ids(base: &str, body: &Value) -> anyhow::Result<Vec<u32>> {
    let chat = body.get("messages").is_some();
    let mut b = body.clone();
    b["model"] = json!(crate::fleet::MODEL);
    b["max_tokens"] = json!(1);
    // vLLM's flag for both routes; SGLang's for completions, and its own for chat. Each engine
    // ignores the other's.
    b["return_token_ids"] = json!(true);
    if chat {
        b["return_prompt_token_ids"] = json!(true);
    }
    if b.get("tools").is_some() && b.get("tool_choice").is_none() {
        // vLLM refuses "auto" without a tool parser; "none" still renders the tools.
        b["tool_choice"] = json!("none");
    }
    let r = post(base, if chat { "/v1/chat/completions" } else { "/v1/completions" }, &b).await?;
    // vLLM puts a chat's ids at the top level, SGLang in its choice; both put a completion's in its
    // choice.
    ids(&r["prompt_token_ids"])
        .or_else(|| ids(&r["choices"][0]["prompt_token_ids"]))
        .with_context(|| format!("no prompt_token_ids in {r}"))
}

/// Prompt tokens the engine served from its prefix cache for a request it just answered.
pub fn cached_tokens(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)
}

/// A value of the engine's `/metrics`, summed over series.
pub async fn engine_metric(base: &str, name: &str) -> anyhow::Result<f64> {
    let text = http().get(format!("{base}/metrics")).send().await?.text().await?;
    Ok(kvgate_protocol::prometheus::samples(&text).filter(|s| s.name == name).map(|s| s.value).sum())
}

/// The cached tokens a decision preview credits worker `id` with, if it scored `id`.
fn scored_credit(decision: &Value, id: &str) -> Option<u64> {
    decision["scores"].as_array()?.iter().find(|s| s["worker"] == id)?["cached_tokens"].as_u64()
}
