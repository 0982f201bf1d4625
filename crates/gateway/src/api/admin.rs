//! The admin API: workers, policy, decision previews and the decision log. Guarded by the admin key.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvgate_core::{PolicyPatch, RequestId, RouteRequest, WorkerId};
use serde::Deserialize;
use serde_json::{json, Value};

use super::request::Endpoint;
use super::{check_admin, parse_off_thread, read_json};
use crate::config::{WorkerSpec, ADMISSION_WAIT_S};
use crate::error::ApiError;
use crate::state::AppState;
use crate::{engines, GatewayError};

fn gateway_error(e: GatewayError) -> ApiError {
    match e {
        GatewayError::NotFound(m) => ApiError::NotFound(m),
        GatewayError::Conflict(m) | GatewayError::Config(m) => ApiError::InvalidRequest { param: None, message: m },
        other => ApiError::InvalidRequest { param: None, message: other.to_string() },
    }
}

/// `GET /admin/workers`.
pub async fn list_workers(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    let ctx = state.engine_context();
    let views: Vec<_> = state.engines.read().values().map(|e| e.view(&ctx)).collect();
    Ok(Json(json!({ "workers": views })))
}

/// `POST /admin/workers` with a worker table (`{"url": ..., "id": ...}`).
pub async fn add_worker(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    let (_, value) = read_json(&state, body).await?;
    let spec: WorkerSpec =
        serde_json::from_value(value).map_err(|e| ApiError::InvalidRequest { param: None, message: e.to_string() })?;
    let handle = state.add_engine(&spec).map_err(gateway_error)?;
    engines::start(&state.engine_context(), &handle);
    tracing::info!(engine = %handle.id, url = %handle.spec.display_url(), "worker added");
    Ok((StatusCode::CREATED, Json(json!({ "worker": handle.view(&state.engine_context()) }))).into_response())
}

#[derive(Deserialize)]
struct RemoveBody {
    id: String,
}

/// `DELETE /admin/workers/{id}`.
pub async fn remove_worker(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    remove(&state, &id)
}

/// `DELETE /admin/workers` with `{"id": ...}`.
pub async fn remove_worker_by_body(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    let (_, value) = read_json(&state, body).await?;
    let b: RemoveBody = serde_json::from_value(value).map_err(|e| ApiError::invalid("id", e.to_string()))?;
    remove(&state, &b.id)
}

fn remove(state: &AppState, id: &str) -> Result<Json<Value>, ApiError> {
    state.remove_engine(&WorkerId::new(id)).map_err(gateway_error)?;
    tracing::info!(engine = id, "worker removed");
    Ok(Json(json!({ "removed": id })))
}

fn policy_json(state: &AppState) -> Value {
    let mut v = serde_json::to_value(state.router.policy()).unwrap_or(Value::Null);
    v["admission_wait_s"] = json!(state.runtime.read().admission_wait_s);
    v
}

/// `GET /admin/policy`.
pub async fn get_policy(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    Ok(Json(policy_json(&state)))
}

/// `PUT /admin/policy`: changes any knobs (a [`PolicyPatch`] plus `admission_wait_s`), validated as
/// a whole; nothing changes on error.
pub async fn put_policy(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    let (_, mut value) = read_json(&state, body).await?;
    let admission = match value.as_object_mut().and_then(|o| o.remove("admission_wait_s")) {
        None => None,
        Some(v) => {
            let v = v
                .as_f64()
                .ok_or_else(|| ApiError::invalid("admission_wait_s", "`admission_wait_s` must be a number"))?;
            Some(ADMISSION_WAIT_S.check(v).map_err(|e| ApiError::invalid("admission_wait_s", e.to_string()))?)
        }
    };
    let patch: PolicyPatch =
        serde_json::from_value(value).map_err(|e| ApiError::InvalidRequest { param: None, message: e.to_string() })?;
    let cfg = patch
        .apply(&state.router.policy())
        .map_err(|e| ApiError::InvalidRequest { param: None, message: e.to_string() })?;
    state.router.set_policy(cfg).map_err(|e| ApiError::InvalidRequest { param: None, message: e.to_string() })?;
    if let Some(a) = admission {
        state.runtime.write().admission_wait_s = a;
    }
    tracing::info!(policy = %policy_json(&state), "policy changed");
    Ok(Json(policy_json(&state)))
}

/// An inference body sent to an admin route: its route (inferred from its keys), the body, and what
/// routing reads from it.
async fn admin_request(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Endpoint, Value, super::request::Parsed), ApiError> {
    check_admin(state, headers)?;
    let (bytes, value) = read_json(state, body).await?;
    let endpoint = Endpoint::infer(&value);
    let parsed = parse_off_thread(state, endpoint, value.clone(), bytes.len()).await?;
    Ok((endpoint, value, parsed))
}

/// `POST /admin/decide`: the decision record for a request body, without dispatching or reserving.
pub async fn decide(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let (endpoint, _, parsed) = admin_request(&state, &headers, body).await?;
    let keys = crate::proxy::routing_keys(&state, endpoint, &parsed);
    let route = RouteRequest {
        id: RequestId(0),
        keys: &keys,
        prompt_tokens: parsed.prompt_tokens(),
        max_tokens: parsed.max_tokens,
        exclude: &[],
        keys_cover_prompt: parsed.rest.is_none(),
    };
    let decision = {
        let mut rng = state.rng.lock();
        state.router.preview(&route, state.clock.now(), &mut *rng)
    }
    .map_err(|_| ApiError::NoEligibleWorker)?;
    let estimated = parsed.rest.as_ref().map(|r| r.estimated_tokens);
    Ok(Json(json!({ "endpoint": endpoint.path(), "decision": decision, "estimated_prompt_tokens": estimated })))
}

/// `POST /admin/tokenize`: the token ids kvgate computes for a request body (chat, completions or
/// generate, inferred from its keys), to compare with the engine's own `/tokenize`. For chat it also
/// returns the rendered prompt.
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let (endpoint, value, mut parsed) = admin_request(&state, &headers, body).await?;
    // Every id, also where routing would have stopped early.
    parsed
        .finish(state.tokenizer.as_ref())
        .map_err(|e| ApiError::InvalidRequest { param: None, message: e.to_string() })?;
    let prompt = match endpoint {
        Endpoint::Chat => state.tokenizer.render_chat(&value).ok(),
        _ => None,
    };
    Ok(Json(json!({
        "count": parsed.tokens.len(),
        "tokens": parsed.tokens,
        "prompt": prompt,
        "tokenizer": state.tokenizer.describe(),
    })))
}

/// Query of `GET /admin/decisions`.
#[derive(Deserialize)]
pub struct DecisionsQuery {
    limit: Option<usize>,
}

/// `GET /admin/decisions?limit=N`: the most recent decisions, oldest first.
pub async fn decisions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(q): Query<DecisionsQuery>,
) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    let log = state.decisions.lock();
    let n = q.limit.unwrap_or(100).min(log.len());
    let recent: Vec<_> = log.iter().skip(log.len() - n).cloned().collect();
    Ok(Json(json!({ "decisions": recent })))
}

/// `GET /admin/discovery`: the workers file and what its last reread found.
pub async fn discovery(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    Ok(Json(serde_json::to_value(&*state.discovery.lock()).unwrap_or(Value::Null)))
}

/// `POST /admin/discovery/reload`: rereads the workers file now, as SIGHUP does.
pub async fn reload_discovery(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    if state.config.workers_file.is_none() {
        return Err(ApiError::NotFound(
            "no workers file is configured ([discovery] workers_file, --workers-file)".into(),
        ));
    }
    state.discovery_reload.notify_one();
    Ok((StatusCode::ACCEPTED, Json(json!({"reload": "requested"}))).into_response())
}

/// `GET /admin/replicas`: this replica's id, the bus, its peers and what sharing has done.
pub async fn replicas(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    check_admin(&state, &headers)?;
    Ok(Json(serde_json::to_value(state.replicas.view(&state.router, state.clock.now())).unwrap_or(Value::Null)))
}
