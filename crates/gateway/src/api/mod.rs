//! The HTTP surface: inference routes, operations routes and the admin API.

mod admin;
mod smg;
/// Request parsing, shared with the mock engine (`kvgate_tokenizer::request`).
pub mod request {
    pub use kvgate_tokenizer::request::*;
}

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::proxy;
use crate::state::AppState;
use request::Endpoint;

/// The gateway's routes.
pub fn routes(state: Arc<AppState>) -> Router {
    let mut router = Router::new();
    for endpoint in Endpoint::ALL {
        for path in std::iter::once(endpoint.path()).chain(endpoint.aliases().iter().copied()) {
            router = router.route(
                path,
                post(move |State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body| {
                    infer(state, endpoint, headers, body)
                }),
            );
        }
    }
    router
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/workers", get(admin::list_workers).post(admin::add_worker).delete(admin::remove_worker_by_body))
        .route("/admin/workers/{id}", delete(admin::remove_worker))
        .route("/workers", get(smg::list).post(smg::add))
        .route("/workers/{id}", get(smg::get).delete(smg::remove))
        .route("/admin/policy", get(admin::get_policy).put(admin::put_policy))
        .route("/admin/decide", post(admin::decide))
        .route("/admin/tokenize", post(admin::tokenize))
        .route("/admin/decisions", get(admin::decisions))
        .route("/admin/discovery", get(admin::discovery))
        .route("/admin/replicas", get(admin::replicas))
        .route("/admin/discovery/reload", post(admin::reload_discovery))
        .fallback(not_found)
        .with_state(state)
}

async fn not_found(req: Request) -> ApiError {
    let (method, path) = (req.method(), req.uri().path());
    if path.starts_with("/v1/") {
        // As OpenAI words it, with what kvgate does serve.
        let served: Vec<&str> = Endpoint::ALL.iter().map(|e| e.path()).filter(|p| p.starts_with("/v1/")).collect();
        return ApiError::NotFound(format!(
            "Invalid URL ({method} {path}): kvgate serves POST {} and GET /v1/models",
            served.join(", ")
        ));
    }
    ApiError::NotFound(format!("no route for {method} {path}"))
}

/// The bearer token or `x-api-key` header.
fn presented_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim)
}

/// Constant-time comparison, so a key can't be guessed byte by byte from response times.
fn key_matches(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn check_client(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if state.config.api_keys.is_empty() {
        return Ok(());
    }
    match presented_key(headers) {
        Some(k) if state.config.api_keys.iter().any(|e| key_matches(k, e)) => Ok(()),
        _ => Err(ApiError::Unauthorized),
    }
}

/// Admin routes take the admin key (never a client key).
pub(crate) fn check_admin(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    match &state.config.admin_key {
        None => Ok(()),
        Some(expected) => match presented_key(headers) {
            Some(k) if key_matches(k, expected) => Ok(()),
            _ => Err(ApiError::Unauthorized),
        },
    }
}

/// Reads the body up to the configured limit (413 beyond it) within `body_timeout_s` (408 beyond
/// it), and parses it as JSON. While it arrives, its size (or the limit, when the client did not
/// say) is held against `max_buffered_body_bytes`: slow clients with large unfinished bodies cannot
/// add up to more than that (503 when the budget is spent).
pub(crate) async fn read_json(state: &AppState, mut body: Body) -> Result<(Bytes, Value), ApiError> {
    let limit = state.config.max_body_bytes;
    let said = hyper::body::Body::size_hint(&body).exact().map(|n| usize::try_from(n).unwrap_or(usize::MAX).min(limit));
    let announced = said.unwrap_or(limit);
    let kib = u32::try_from(announced.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let timeout = state.config.limits.body_timeout;
    let Ok(_budget) = state.body_budget.try_acquire_many(kib) else {
        state.metrics.local_resource_errors.inc();
        let _ = tokio::time::timeout(timeout, drop_rest(&mut body, limit.max(DROP_AT_LEAST_BYTES))).await;
        return Err(ApiError::LocalResources("request body buffer (max_buffered_body_bytes)".into()));
    };
    let started = tokio::time::Instant::now();
    let bytes = match tokio::time::timeout(timeout, read_limited(body, said.unwrap_or(0), limit)).await {
        Err(_) => return Err(ApiError::BodyTimeout(timeout.as_secs_f64())),
        Ok(Ok(bytes)) => bytes,
        Ok(Err(BodyRead::TooLarge(mut rest))) => {
            let left = timeout.saturating_sub(started.elapsed());
            let _ = tokio::time::timeout(left, drop_rest(&mut rest, limit.max(DROP_AT_LEAST_BYTES))).await;
            return Err(ApiError::PayloadTooLarge(limit));
        }
        Ok(Err(BodyRead::Failed(e))) => {
            return Err(ApiError::InvalidRequest { param: None, message: format!("cannot read the request body: {e}") })
        }
    };
    let value = serde_json::from_slice(&bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    Ok((bytes, value))
}

/// A refused body is read and dropped up to this many bytes (or the body limit, if larger) within
/// its time, so that a client sending one a few times too large still reads the answer.
const DROP_AT_LEAST_BYTES: usize = 16 << 20;

/// Why a request body could not be read whole.
enum BodyRead {
    /// It is longer than the limit; what is left of it.
    TooLarge(Body),
    /// The connection failed while it arrived.
    Failed(String),
}

/// Reads a body of at most `limit` bytes, room made at once for the `said` size (the client's
/// Content-Length, already held against the budget); a longer one is handed back unfinished, for the caller to drop the rest
/// before its 413 ([`drop_rest`]).
async fn read_limited(mut body: Body, said: usize, limit: usize) -> Result<Bytes, BodyRead> {
    use http_body_util::BodyExt;
    let mut buf = bytes::BytesMut::with_capacity(said);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyRead::Failed(e.to_string()))?;
        let Ok(data) = frame.into_data() else { continue };
        if buf.len().saturating_add(data.len()) > limit {
            return Err(BodyRead::TooLarge(body));
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

/// Reads and drops what is left of a body the gateway answers without using, up to `limit` bytes,
/// holding none of it. Answered and closed while the client still sends it, the connection is
/// reset under the client (a broken pipe, an incomplete message) before it reads the answer:
/// HTTP/1.1 clients send the whole body first. The caller bounds the time.
async fn drop_rest(body: &mut Body, limit: usize) {
    use http_body_util::BodyExt;
    let mut seen = 0usize;
    while let Some(Ok(frame)) = body.frame().await {
        seen = seen.saturating_add(frame.data_ref().map_or(0, |d| d.len()));
        if seen > limit {
            return;
        }
    }
}

/// Bodies above this size are tokenized on the tokenizing threads, so that no other connection waits
/// behind them: a real BPE tokenizer takes about 12 ms for 32 KB of text (issue 33's
/// measurement), so 4 KiB holds an async worker for a millisecond or two at most. Smaller bodies
/// are cheaper to tokenize in place than to hand to another thread.
const INLINE_TOKENIZE_BYTES: usize = 4 * 1024;

/// Text the tokenizer may run on in a first try on the async worker, when only cached pieces and
/// about a block's worth of new text are expected: a 64-byte head piece, a question after a cached
/// prefix. About 0.3 ms of BPE at most; anything longer is tokenized on the tokenizing threads.
const INLINE_TOKENIZE_MISS_BYTES: usize = 1024;

/// Tokenizing a large prompt is CPU work: keep it off the async workers.
pub(crate) async fn parse_off_thread(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    value: Value,
    body_len: usize,
) -> Result<request::Parsed, ApiError> {
    if body_len <= INLINE_TOKENIZE_BYTES {
        return parse_for_routing(state, endpoint, &value, None).map_err(|(e, _)| e);
    }
    // Routed on its start, a long prompt often needs only cached pieces and a little new text:
    // try that here, and hand the rest to the tokenizing threads only if it turns out longer. What the
    // try tokenized stays in the prompt cache.
    if state.tokenizer.tokenizes_partially() {
        match parse_for_routing(state, endpoint, &value, Some(INLINE_TOKENIZE_MISS_BYTES)) {
            Err((_, true)) => {}
            done => return done.map_err(|(e, _)| e),
        }
    }
    // On the tokenizing threads, in turn: 16 connections tokenizing 32 KB prompts at once on 2
    // cores starved the async workers, and a small request's p99 went from 0.7 ms to 23-29 ms.
    let s = state.clone();
    state
        .tokenize_pool
        .run(move || parse_for_routing(&s, endpoint, &value, None).map_err(|(e, _)| e))
        .await
        .map_err(|_| ApiError::Internal)?
}

/// Reads a request, tokenizing its prompt only as far as routing needs where that is safe
/// ([`kvgate_tokenizer::routed`]): not with `tokenize_whole`, not while a gRPC worker (which takes
/// every id) is registered, and not while `calibrate` learns step times from whole prompts' blocks.
/// With a `budget`, prompts tokenized whole are not tried at all and a routed one stops where it
/// would tokenize more new text than that: the error then says `true`, deferred.
fn parse_for_routing(
    state: &AppState,
    endpoint: Endpoint,
    value: &Value,
    budget: Option<usize>,
) -> Result<request::Parsed, (ApiError, bool)> {
    let tokenizer = state.tokenizer.as_ref();
    let default_max = state.config.assumed_decode_tokens;
    let whole = state.config.tokenize_whole
        || !endpoint.earns_cache_credit()
        || state.router.policy().calibrate
        || state.engines.read().values().any(|e| e.grpc.is_some());
    if whole {
        if budget.is_some() {
            return Err((ApiError::Internal, true));
        }
        return request::parse(endpoint, value, tokenizer, default_max).map_err(|e| (e.into(), false));
    }
    let salt = value.get("cache_salt").and_then(Value::as_str).filter(|s| !s.is_empty());
    let probe = crate::tokenize::HeldPrefixProbe::new(&state.router, kvgate_core::Namespace::new(None, salt));
    let mut probe = match budget {
        Some(bytes) => probe.with_budget(bytes),
        None => probe,
    };
    let parsed = request::parse_routed(endpoint, value, tokenizer, default_max, &mut probe);
    parsed.map_err(|e| (e.into(), probe.deferred()))
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    let known = state.engines.models();
    match model {
        // Until an engine has reported its models, any name is let through to the engines.
        Some(m) if !known.is_empty() && !known.contains(m) => Err(ApiError::ModelNotFound(m.to_owned())),
        _ => Ok(()),
    }
}

async fn infer(state: Arc<AppState>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let result = async {
        check_client(&state, &headers)?;
        let (bytes, value) = read_json(&state, body).await?;
        let parsed = parse_off_thread(&state, endpoint, value, bytes.len()).await?;
        check_model(&state, parsed.model.as_deref())?;
        Ok::<_, ApiError>((bytes, parsed))
    }
    .await;
    match result {
        Ok((bytes, parsed)) => {
            proxy::dispatch(state, endpoint, bytes, parsed).await.unwrap_or_else(IntoResponse::into_response)
        }
        Err(e) => {
            state.metrics.request(e.status().as_u16(), None);
            e.into_response()
        }
    }
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    check_client(&state, &headers)?;
    let data: Vec<Value> =
        state.engines.models().iter().map(|m| json!({"id": m, "object": "model", "owned_by": "kvgate"})).collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Ready once an engine in rotation has passed a health check: engines are in rotation from
/// registration, before anything is known of them.
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let workers = state.router.workers(state.clock.now());
    let eligible: Vec<_> = workers.iter().filter(|w| w.eligible).collect();
    let seen_up = |id| state.engines.get(id).is_some_and(|e| e.seen_up.load(std::sync::atomic::Ordering::Relaxed));
    let up = eligible.iter().filter(|w| seen_up(&w.id)).count();
    let status = if up > 0 { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(json!({"ready": up > 0, "eligible_workers": eligible.len(), "eligible_seen_up": up}))).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state.metrics.fleet.observe(&state.router.workers(state.clock.now()));
    if let Some(stats) = state.tokenizer.prompt_cache_stats() {
        state.metrics.tokenize_cache.observe(&stats);
    }
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.render())
        .into_response()
}

#[cfg(test)]
mod doc_tests {
    use std::collections::BTreeSet;

    const METHODS: [&str; 4] = ["GET", "POST", "PUT", "DELETE"];

    /// `METHOD /path` for every admin and worker-API route this file registers.
    fn registered() -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for line in include_str!("mod.rs").lines().filter(|l| l.trim_start().starts_with(".route(\"")) {
            let path = line.split('"').nth(1).unwrap_or_default();
            if !(path.starts_with("/admin") || path.starts_with("/workers")) {
                continue;
            }
            for method in METHODS {
                let call = format!("{}(", method.to_lowercase());
                if line.split(|c: char| !(c.is_alphanumeric() || c == '(')).any(|w| w.starts_with(&call)) {
                    out.insert(format!("{method} {path}"));
                }
            }
        }
        out
    }

    /// `METHOD /path` for every route named in docs/operations.md's admin table (`GET/DELETE /x`
    /// names two; a query string is not part of the route).
    fn documented() -> BTreeSet<String> {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/operations.md")).unwrap();
        let table = doc.split("## Admin API").nth(1).expect("docs/operations.md has ## Admin API");
        let table = table.split("\n## ").next().unwrap_or_default();
        let mut out = BTreeSet::new();
        for row in table.lines().filter(|l| l.starts_with("| `")) {
            let first_cell = row.split(" | ").next().unwrap_or_default();
            for code in first_cell.split('`').skip(1).step_by(2) {
                let Some((methods, path)) = code.split_once(' ') else { continue };
                if !methods.split('/').all(|m| METHODS.contains(&m)) {
                    continue; // a request body, not a route
                }
                let path = path.split('?').next().unwrap_or_default();
                for method in methods.split('/') {
                    out.insert(format!("{method} {path}"));
                }
            }
        }
        out
    }

    #[test]
    fn operations_doc_lists_every_admin_route_and_no_other() {
        let (code, doc) = (registered(), documented());
        assert!(code.len() >= 15, "the route parser found too few routes: {code:?}");
        let missing: Vec<_> = code.difference(&doc).collect();
        let unknown: Vec<_> = doc.difference(&code).collect();
        assert!(missing.is_empty(), "routes missing from docs/operations.md's admin table: {missing:?}");
        assert!(unknown.is_empty(), "docs/operations.md's admin table names routes that do not exist: {unknown:?}");
    }
}
