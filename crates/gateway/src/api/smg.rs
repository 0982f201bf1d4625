//! SMG's worker control API (`GET/POST /workers`, `GET/DELETE /workers/{id}`), with SMG 1.13's JSON
//! shapes, so that scripts written for SMG keep working beside kvgate's own `/admin/workers`. Both
//! act on the same registry and take the admin key. Differences (docs/migrating-from-smg.md): ids are
//! kvgate's worker ids rather than UUIDs, and a worker is registered before the answer (SMG queues
//! it), though the answer keeps SMG's `202 Accepted` shape.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvgate_core::WorkerId;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{check_admin, read_json};
use crate::config::{EngineKind, WorkerSpec};
use crate::error::ApiError;
use crate::registry::EngineView;
use crate::state::AppState;
use crate::{engines, GatewayError};

/// An error in SMG's shape: `{"error": message, "code": CODE}`.
fn smg_error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": message.into(), "code": code}))).into_response()
}

fn worker_json(v: &EngineView) -> Value {
    let in_flight = v.router.as_ref().map_or(0, |r| r.in_flight);
    let runtime = match v.telemetry {
        Some(EngineKind::Vllm) => "vllm",
        Some(EngineKind::Sglang) => "sglang",
        _ => "unknown",
    };
    json!({
        "id": v.id.as_str(),
        "url": v.url,
        "model_id": v.models.first(),
        "models": v.models.iter().map(|m| json!({"id": m})).collect::<Vec<_>>(),
        "worker_type": "regular",
        "connection_mode": "http",
        "runtime_type": runtime,
        "is_healthy": v.healthy,
        "status": if v.healthy { "ready" } else { "unhealthy" },
        "load": in_flight,
    })
}

fn views(state: &AppState) -> Vec<EngineView> {
    let ctx = state.engine_context();
    state.engines.read().values().map(|e| e.view(&ctx)).collect()
}

/// `GET /workers`.
pub async fn list(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    let workers: Vec<Value> = views(&state).iter().map(worker_json).collect();
    let total = workers.len();
    Ok(Json(json!({
        "workers": workers,
        "total": total,
        "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": total},
    })))
}

/// `GET /workers/{id}`.
pub async fn get(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    Ok(match views(&state).iter().find(|v| v.id.as_str() == id) {
        Some(v) => Json(worker_json(v)).into_response(),
        None => smg_error(StatusCode::NOT_FOUND, "WORKER_NOT_FOUND", format!("Worker {id} not found")),
    })
}

/// What SMG's `POST /workers` body may carry that kvgate uses; its other fields (priority, cost,
/// labels, ...) are SMG's own and ignored.
#[derive(Deserialize)]
struct AddBody {
    url: String,
    /// kvgate's worker id (SMG assigns a UUID instead).
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    api_key: Option<String>,
    #[serde(default)]
    worker_type: Option<String>,
}

/// `POST /workers`.
pub async fn add(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    let (_, value) = read_json(&state, body).await?;
    let b: AddBody = match serde_json::from_value(value) {
        Ok(b) => b,
        Err(e) => return Ok(smg_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", format!("Invalid JSON data: {e}"))),
    };
    if b.worker_type.as_deref().is_some_and(|t| t != "regular") {
        let why = "only regular workers: kvgate does not disaggregate prefill and decode";
        return Ok(smg_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", why));
    }
    if b.api_key.is_some() {
        let why = "per-worker api_key is not supported: kvgate sends one key to every engine (--worker-api-key)";
        return Ok(smg_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", why));
    }
    let spec = WorkerSpec { id: b.id, ..WorkerSpec::new(b.url.clone()) };
    let handle = match state.add_engine(&spec) {
        Ok(h) => h,
        Err(GatewayError::Conflict(m)) => return Ok(smg_error(StatusCode::CONFLICT, "WORKER_EXISTS", m)),
        Err(e) => return Ok(smg_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", e.to_string())),
    };
    engines::start(&state.engine_context(), &handle);
    tracing::info!(engine = %handle.id, url = %handle.spec.display_url(), "worker added (SMG API)");
    let location = format!("/workers/{}", handle.id);
    let body = json!({
        "status": "accepted",
        "worker_id": handle.id.as_str(),
        "url": handle.spec.display_url(),
        "location": location,
        "message": "Worker added",
    });
    Ok((StatusCode::ACCEPTED, [(header::LOCATION, location.clone())], Json(body)).into_response())
}

/// `DELETE /workers/{id}`. Streams already on the engine run to their end.
pub async fn remove(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    Ok(match state.remove_engine(&WorkerId::new(&id)) {
        Ok(()) => {
            tracing::info!(engine = id, "worker removed (SMG API)");
            let body = json!({"status": "accepted", "worker_id": id, "message": "Worker removed"});
            (StatusCode::ACCEPTED, Json(body)).into_response()
        }
        Err(_) => smg_error(StatusCode::NOT_FOUND, "WORKER_NOT_FOUND", format!("Worker {id} not found")),
    })
}
