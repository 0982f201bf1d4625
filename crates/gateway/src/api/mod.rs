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
        router = router.route(
            endpoint.path(),
            post(move |State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body| {
                infer(state, endpoint, headers, body)
            }),
        );
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
pub(crate) async fn read_json(state: &AppState, body: Body) -> Result<(Bytes, Value), ApiError> {
    let limit = state.config.max_body_bytes;
    let announced = hyper::body::Body::size_hint(&body).exact().map_or(limit, |n| (n as usize).min(limit));
    let kib = u32::try_from(announced.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let timeout = state.config.limits.body_timeout;
    let Ok(_budget) = state.body_budget.try_acquire_many(kib) else {
        state.metrics.local_resource_errors.inc();
        discard(body, limit, timeout).await;
        return Err(ApiError::LocalResources("request body buffer (max_buffered_body_bytes)".into()));
    };
    let read = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await;
    let bytes = read.map_err(|_| ApiError::BodyTimeout(timeout.as_secs_f64()))?.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.downcast_ref::<http_body_util::LengthLimitError>().is_some())
            || e.to_string().contains("length limit");
        if too_large {
            ApiError::PayloadTooLarge(limit)
        } else {
            ApiError::InvalidRequest { param: None, message: format!("cannot read the request body: {e}") }
        }
    })?;
    let value = serde_json::from_slice(&bytes).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    Ok((bytes, value))
}

/// Reads and drops a body the gateway refuses before reading it, up to `limit` bytes and for at
/// most `timeout`, holding none of it. A client still sending it when the answer came and the
/// connection closed would otherwise see the connection reset (a broken pipe, an incomplete
/// message) instead of the answer; HTTP/1.1 clients send the whole body before they read.
async fn discard(mut body: Body, limit: usize, timeout: std::time::Duration) {
    use http_body_util::BodyExt;
    let mut seen = 0usize;
    let drain = async {
        while let Some(Ok(frame)) = body.frame().await {
            seen = seen.saturating_add(frame.data_ref().map_or(0, |d| d.len()));
            if seen > limit {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(timeout, drain).await;
}

/// Bodies above this size are tokenized on the blocking pool; smaller ones take microseconds and
/// are cheaper to tokenize in place than to hand to another thread.
const INLINE_TOKENIZE_BYTES: usize = 64 * 1024;

/// Tokenizing a large prompt is CPU work: keep it off the async workers.
pub(crate) async fn parse_off_thread(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    value: Value,
    body_len: usize,
) -> Result<request::Parsed, ApiError> {
    if body_len <= INLINE_TOKENIZE_BYTES {
        return Ok(request::parse(endpoint, &value, state.tokenizer.as_ref(), state.config.assumed_decode_tokens)?);
    }
    let s = state.clone();
    tokio::task::spawn_blocking(move || {
        request::parse(endpoint, &value, s.tokenizer.as_ref(), s.config.assumed_decode_tokens).map_err(ApiError::from)
    })
    .await
    .map_err(|_| ApiError::Internal)?
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
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.render())
        .into_response()
}
