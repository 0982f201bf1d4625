//! The mock engine's HTTP surface, shaped like SGLang's and vLLM's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_core::RequestId;
use kvgate_engine_model::EngineRequest;
use kvgate_tokenizer::request::{self, Endpoint};
use kvgate_tokenizer::BuiltinTokenizer;
use parking_lot::Mutex;
use rand::Rng;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::stepper::{Command, Shared, TokenEvent};
use crate::Faults;

/// Tokens generated when a request does not say.
pub const DEFAULT_MAX_TOKENS: u64 = 16;
/// Most tokens one request may generate.
const MAX_TOKENS_LIMIT: u64 = 32_768;

/// Handler state.
#[derive(Clone)]
pub struct ServerState {
    /// Commands to the engine.
    pub commands: mpsc::UnboundedSender<Command>,
    /// Load and counters.
    pub shared: Arc<Shared>,
    /// Current faults.
    pub faults: Arc<Mutex<Faults>>,
    /// Model name.
    pub model: String,
    /// Next request id.
    pub next_id: Arc<AtomicU64>,
    /// Randomness for injected failures.
    pub rng: Arc<Mutex<rand_chacha::ChaCha8Rng>>,
    /// KV capacity, for `/v1/loads` and `/metrics`.
    pub capacity_tokens: u64,
    /// Tokens per KV block, for `/metrics`.
    pub block_size: u32,
    /// What `GET /server_info` answers, as SGLang does (its KV-events announcement); `None` (404)
    /// for a vLLM-format engine, which has no such route.
    pub server_info: Option<serde_json::Value>,
}

/// The routes.
pub fn routes(state: ServerState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(|s: State<ServerState>, b: Bytes| infer(s, Kind::Chat, b)))
        .route("/v1/completions", post(|s: State<ServerState>, b: Bytes| infer(s, Kind::Completion, b)))
        .route("/generate", post(|s: State<ServerState>, b: Bytes| infer(s, Kind::Generate, b)))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/loads", get(loads))
        .route("/metrics", get(metrics))
        .route("/admin/fault", post(set_faults).get(get_faults))
        .route("/admin/restart", post(restart))
        .route("/admin/stall", post(stall))
        .route("/server_info", get(server_info))
        .with_state(state)
}

async fn server_info(State(s): State<ServerState>) -> Response {
    match s.server_info {
        Some(info) => Json(info).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
    Generate,
}

fn bad(msg: impl Into<String>) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": msg.into(), "type": "invalid_request_error"}})))
        .into_response()
}

/// Prompt tokens and output length of a request body.
/// The prompt tokens and the tokens to generate, read by the gateway's own parser: the mock accepts
/// exactly the bodies the gateway does.
fn read(kind: Kind, body: &Value) -> Result<(Vec<u32>, u64), String> {
    let endpoint = match kind {
        Kind::Chat => Endpoint::Chat,
        Kind::Completion => Endpoint::Completions,
        Kind::Generate => Endpoint::Generate,
    };
    let parsed = request::parse(endpoint, body, &BuiltinTokenizer, DEFAULT_MAX_TOKENS).map_err(|e| e.to_string())?;
    if parsed.tokens.is_empty() {
        return Err("the prompt is empty".into());
    }
    Ok((parsed.tokens, parsed.max_tokens.clamp(1, MAX_TOKENS_LIMIT)))
}

/// Deterministic filler text for token `i`.
fn word(i: u64) -> &'static str {
    const WORDS: [&str; 8] = ["lorem ", "ipsum ", "dolor ", "sit ", "amet ", "consectetur ", "adipiscing ", "elit "];
    WORDS[(i % 8) as usize]
}

fn usage(prompt: u64, cached: u64, output: u64) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Cancels its request in the engine when dropped before the request finished: the client went away
/// (the handler or the response stream was dropped with it).
pub(crate) struct CancelOnDrop {
    pub(crate) id: RequestId,
    pub(crate) commands: mpsc::UnboundedSender<Command>,
    pub(crate) finished: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

async fn infer(State(s): State<ServerState>, kind: Kind, body: Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(&body) else { return bad("the body is not JSON") };
    let (tokens, max_tokens) = match read(kind, &v) {
        Ok(x) => x,
        Err(e) => return bad(e),
    };
    let fail = {
        let p = s.faults.lock().fail_requests;
        p > 0.0 && s.rng.lock().random::<f64>() < p
    };
    if fail {
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "injected failure"}})))
            .into_response();
    }
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let request = EngineRequest { id: RequestId(id), tokens, output_tokens: max_tokens as u32 };
    if s.commands.send(Command::Submit(request, tx)).is_err() {
        return (StatusCode::SERVICE_UNAVAILABLE, "engine stopped").into_response();
    }
    let mut guard = CancelOnDrop { id: RequestId(id), commands: s.commands.clone(), finished: false };
    let model = s.model.clone();
    let object_id = format!("{}-{id}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" });
    if !stream {
        let mut generated = 0u64;
        loop {
            match rx.recv().await {
                Some(TokenEvent::First | TokenEvent::Token) => generated += 1,
                Some(TokenEvent::Done { prompt_tokens, cached_tokens, output_tokens }) => {
                    guard.finished = true;
                    let text: String = (0..output_tokens).map(word).collect();
                    let body = match kind {
                        Kind::Chat => json!({"id": object_id, "object": "chat.completion", "model": model,
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                            "usage": usage(prompt_tokens, cached_tokens, output_tokens)}),
                        Kind::Completion => json!({"id": object_id, "object": "text_completion", "model": model,
                            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                            "usage": usage(prompt_tokens, cached_tokens, output_tokens)}),
                        Kind::Generate => json!({"text": text, "meta_info": {"prompt_tokens": prompt_tokens,
                            "completion_tokens": output_tokens, "cached_tokens": cached_tokens, "finish_reason": {"type": "length"}}}),
                    };
                    return Json(body).into_response();
                }
                Some(TokenEvent::Failed) | None => {
                    let _ = generated;
                    guard.finished = true;
                    return (
                        StatusCode::INTERNAL_SERVER_ERROR,
                        Json(json!({"error": {"message": "the engine dropped the request"}})),
                    )
                        .into_response();
                }
            }
        }
    }
    // The guard travels with the stream: a client that disconnects drops it.
    let sse = futures_util::stream::unfold((rx, 0u64, guard), move |(mut rx, n, mut guard)| {
        let (model, object_id) = (model.clone(), object_id.clone());
        async move {
            if guard.finished {
                return None;
            }
            let chunk = |delta: Value, finish: Value| match kind {
                Kind::Chat => json!({"id": object_id, "object": "chat.completion.chunk", "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
                Kind::Completion => json!({"id": object_id, "object": "text_completion", "model": model,
                    "choices": [{"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish}]}),
                Kind::Generate => {
                    json!({"text": delta.get("content").cloned().unwrap_or(json!("")), "meta_info": {"finish_reason": finish}})
                }
            };
            let event = |v: Value| Bytes::from(format!("data: {v}\n\n"));
            match rx.recv().await {
                Some(TokenEvent::First) => {
                    let mut delta = json!({"content": word(0)});
                    if kind == Kind::Chat {
                        delta["role"] = json!("assistant");
                    }
                    Some((Ok::<Bytes, std::io::Error>(event(chunk(delta, Value::Null))), (rx, 1, guard)))
                }
                Some(TokenEvent::Token) => {
                    Some((Ok(event(chunk(json!({"content": word(n)}), Value::Null))), (rx, n + 1, guard)))
                }
                Some(TokenEvent::Done { prompt_tokens, cached_tokens, output_tokens }) => {
                    let mut out = String::new();
                    let mut last = chunk(json!({}), json!("length"));
                    if include_usage && kind != Kind::Generate {
                        out.push_str(&format!("data: {last}\n\n"));
                        last = json!({"id": object_id, "object": "chat.completion.chunk", "model": model, "choices": [],
                            "usage": usage(prompt_tokens, cached_tokens, output_tokens)});
                    }
                    out.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
                    guard.finished = true;
                    Some((Ok(Bytes::from(out)), (rx, n, guard)))
                }
                Some(TokenEvent::Failed) | None => {
                    guard.finished = true;
                    Some((Err(std::io::Error::other("the engine dropped the request")), (rx, n, guard)))
                }
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(sse))
        .expect("static headers")
}

async fn models(State(s): State<ServerState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": s.model, "object": "model", "owned_by": "kvgate-mock"}]}))
}

async fn loads(State(s): State<ServerState>) -> Json<Value> {
    let l = *s.shared.load.lock();
    Json(json!({"version": "kvgate-mock", "loads": [{
        "dp_rank": 0,
        "num_running_reqs": l.running_requests,
        "num_waiting_reqs": l.waiting_requests,
        "num_waiting_uncached_tokens": l.waiting_uncached_tokens.unwrap_or(0),
        "num_active_tokens": l.active_tokens.unwrap_or(0),
        "token_usage": l.kv_usage.unwrap_or(0.0),
        "max_total_num_tokens": s.capacity_tokens,
    }]}))
}

/// What vLLM 0.32's `/metrics` carries that kvgate reads: load gauges, prefix-cache counters, the
/// cache configuration (block size and block count as labels) and the process start time.
async fn metrics(State(s): State<ServerState>) -> String {
    let l = *s.shared.load.lock();
    let bs = s.block_size.max(1);
    format!(
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {start}\n\
         # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"{m}\"}} {}\n\
         # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{bs}\",enable_prefix_caching=\"True\",engine=\"0\",\
         num_gpu_blocks=\"{blocks}\",prefix_caching_hash_algo=\"sha256\"}} 1.0\n",
        l.running_requests,
        l.waiting_requests,
        l.kv_usage.unwrap_or(0.0),
        s.shared.prompt_tokens.load(Ordering::Relaxed),
        s.shared.cached_tokens.load(Ordering::Relaxed),
        m = s.model,
        start = s.shared.started_at(),
        blocks = s.capacity_tokens / u64::from(bs),
    )
}

async fn get_faults(State(s): State<ServerState>) -> Json<Faults> {
    Json(s.faults.lock().clone())
}

async fn set_faults(State(s): State<ServerState>, body: Bytes) -> Response {
    match serde_json::from_slice::<Faults>(&body).map_err(|e| e.to_string()).and_then(|f| f.validate().map(|_| f)) {
        Ok(f) => {
            *s.faults.lock() = f.clone();
            Json(f).into_response()
        }
        Err(e) => bad(e),
    }
}

async fn restart(State(s): State<ServerState>) -> StatusCode {
    if s.commands.send(Command::Restart).is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn stall(State(s): State<ServerState>, body: Bytes) -> Response {
    let ms = serde_json::from_slice::<Value>(&body).ok().and_then(|v| v.get("ms").and_then(Value::as_u64));
    match ms {
        Some(ms) if ms <= 600_000 => {
            let _ = s.commands.send(Command::Stall(std::time::Duration::from_millis(ms)));
            StatusCode::OK.into_response()
        }
        _ => bad("send {\"ms\": N} with N at most 600000"),
    }
}
