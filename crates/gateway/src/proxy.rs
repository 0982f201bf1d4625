//! Dispatch: decide and reserve, admission, the upstream call with retry before any byte, and the
//! response streamed back chunk by chunk while the reservation follows it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use kvgate_core::{DecideError, Decision, FallbackReason, Mode, Namespace, Reason, RequestId, RouteRequest, WorkerId};
use prometheus_client::metrics::gauge::Gauge;

use crate::api::request::{Endpoint, Parsed};
use crate::engines;
use crate::error::ApiError;
use crate::metrics::EngineLabel;
use crate::state::AppState;

/// Pause between attempts while a request waits for capacity (bounded queueing).
const QUEUE_POLL: std::time::Duration = std::time::Duration::from_millis(25);

/// A request's reservation and in-flight accounting, released when the response is done with: at the
/// last byte, on an upstream error, or when the client goes away and the body is dropped.
struct Flight {
    state: Arc<AppState>,
    id: RequestId,
    engine: WorkerId,
    started: Instant,
    first_byte: bool,
    gauge: Gauge,
    /// Status to count when the flight ends (499 if the client went away first; 0: not counted).
    outcome: u16,
}

impl Flight {
    fn first_byte(&mut self) {
        if !self.first_byte {
            self.first_byte = true;
            let _ = self.state.router.first_token(self.id, self.state.clock.now());
            self.state
                .metrics
                .upstream_ttft
                .get_or_create(&EngineLabel { engine: self.engine.to_string() })
                .observe(self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let _ = self.state.router.release(self.id, self.state.clock.now());
        self.gauge.dec();
        self.state
            .metrics
            .upstream_duration
            .get_or_create(&EngineLabel { engine: self.engine.to_string() })
            .observe(self.started.elapsed().as_secs_f64());
        if self.outcome != 0 {
            self.state.metrics.request(self.outcome, Some(self.engine.as_str()));
        }
    }
}

/// Counts a decision in the metrics and the decision log.
fn record(state: &AppState, endpoint: Endpoint, d: &Decision, started: Instant) {
    let m = &state.metrics;
    m.decision_latency.observe(started.elapsed().as_secs_f64());
    m.decisions.get_or_create(&crate::metrics::ReasonLabel { reason: d.reason.as_str().to_owned() }).inc();
    if d.shadow_disagrees() {
        m.shadow_disagreements.inc();
    }
    // Escapes and fallbacks are counted where enforce takes them, and in shadow where it would.
    if matches!(d.mode, Mode::Enforce | Mode::Shadow) {
        match d.enforce_reason {
            Some(Reason::Escape) => {
                m.escapes.inc();
            }
            Some(Reason::Fallback(r)) => {
                m.fallbacks.get_or_create(&crate::metrics::ReasonLabel { reason: fallback_label(r) }).inc();
            }
            _ => {}
        }
    }
    for s in &d.scores {
        m.projected_seconds.get_or_create(&EngineLabel { engine: s.worker.to_string() }).set(s.projected_s);
    }
    state.log_decision(endpoint_name(endpoint), d.clone());
}

fn fallback_label(r: FallbackReason) -> String {
    r.as_str().to_owned()
}

/// The route's name in the decision log.
pub fn endpoint_name(e: Endpoint) -> &'static str {
    e.path()
}

/// The chosen engine's projected queue, the admission measure.
fn chosen_wait_s(d: &Decision) -> f64 {
    d.scores.iter().find(|s| s.worker == d.worker).map_or(0.0, |s| s.wait_s + s.decode_s)
}

/// Routes and proxies one request.
pub async fn dispatch(
    state: Arc<AppState>,
    endpoint: Endpoint,
    body: Bytes,
    parsed: Parsed,
) -> Result<Response, ApiError> {
    let keys = state.router.request_keys(Namespace::new(None, parsed.cache_salt.as_deref()), &parsed.tokens);
    let deadline = state.clock.instant() + state.config.queue_timeout;
    let mut queued = false;
    let attempts = state.engines.read().len().clamp(1, 3);
    let mut attempt = 0;
    let mut tried: Vec<WorkerId> = Vec::new();
    let result = loop {
        let id = RequestId(state.next_request.fetch_add(1, Ordering::Relaxed));
        let route = RouteRequest {
            id,
            keys: &keys,
            prompt_tokens: parsed.tokens.len() as u64,
            max_tokens: parsed.max_tokens,
            exclude: &tried,
        };
        let started = state.clock.instant();
        let decided = {
            let mut rng = state.rng.lock();
            state.router.decide(&route, state.clock.now(), &mut *rng)
        };
        let decision = match decided {
            Ok(d) => d,
            // Every engine left has already failed this request: say so, not "no engine".
            Err(DecideError::NoEligibleWorker) if !tried.is_empty() => {
                state.metrics.request(ApiError::UpstreamUnavailable.status().as_u16(), None);
                break Err(ApiError::UpstreamUnavailable);
            }
            Err(DecideError::NoEligibleWorker) => {
                if wait_for_capacity(&state, deadline, &mut queued).await {
                    continue;
                }
                break Err(ApiError::NoEligibleWorker);
            }
            Err(DecideError::DuplicateRequest(_)) => break Err(ApiError::Internal),
        };
        record(&state, endpoint, &decision, started);
        let limit = state.runtime.read().admission_wait_s;
        let wait = chosen_wait_s(&decision);
        if limit > 0.0 && wait > limit {
            let _ = state.router.release(id, state.clock.now());
            if wait_for_capacity(&state, deadline, &mut queued).await {
                continue;
            }
            break Err(ApiError::Overloaded { wait_s: wait, limit_s: limit });
        }
        let Some(engine) = state.engine(&decision.worker) else {
            let _ = state.router.release(id, state.clock.now());
            break Err(ApiError::Internal);
        };
        let gauge = state.metrics.in_flight_of(engine.id.as_str());
        gauge.inc();
        let flight = Flight {
            state: state.clone(),
            id,
            engine: engine.id.clone(),
            started: state.clock.instant(),
            first_byte: false,
            gauge,
            outcome: 502,
        };
        let url = format!("{}{}", engine.base, endpoint.path());
        let send = state
            .http
            .post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-request-id", id.0.to_string())
            .body(body.clone())
            .send();
        match tokio::time::timeout(state.config.request_timeout, send).await {
            Err(_) => {
                tracing::warn!(engine = %engine.id, request = id.0, "upstream timed out before responding");
                let mut flight = flight;
                flight.outcome = 504;
                break Err(ApiError::UpstreamTimeout);
            }
            // Nothing came back, so the client has seen nothing: another engine can take it. A
            // failed connect takes the engine out; a connection that broke before any response (an
            // engine closing a kept-alive connection under load) is retried without blame.
            Ok(Err(e)) if !e.is_timeout() && attempt + 1 < attempts => {
                let why = error_chain(&e);
                if e.is_connect() {
                    tracing::warn!(engine = %engine.id, request = id.0, error = %why, "connect failed; retrying on another engine");
                    engines::connect_failed(&state, &engine);
                } else {
                    tracing::info!(engine = %engine.id, request = id.0, error = %why, "request failed before any response; retrying");
                }
                state.metrics.retries.inc();
                attempt += 1;
                tried.push(engine.id.clone());
                let mut flight = flight;
                flight.outcome = 0;
                drop(flight);
                continue;
            }
            Ok(Err(e)) => {
                tracing::warn!(engine = %engine.id, request = id.0, error = %error_chain(&e), "upstream request failed");
                if e.is_connect() {
                    engines::connect_failed(&state, &engine);
                }
                let err = if e.is_timeout() { ApiError::UpstreamTimeout } else { ApiError::UpstreamUnavailable };
                let mut flight = flight;
                flight.outcome = err.status().as_u16();
                break Err(err);
            }
            Ok(Ok(resp)) => break respond(resp, flight, parsed.stream).await,
        }
    };
    if queued {
        state.queued.fetch_sub(1, Ordering::Relaxed);
    }
    // Upstream failures were counted with their engine when their flight ended.
    if let Err(e) = &result {
        if e.origin() != crate::error::Origin::Upstream {
            state.metrics.request(e.status().as_u16(), None);
        }
    }
    result
}

/// An error with its causes, `outer: inner: innermost` (reqwest's own text omits them).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Waits a moment for capacity if bounded queueing allows; false when the request must be answered.
async fn wait_for_capacity(state: &AppState, deadline: Instant, queued: &mut bool) -> bool {
    if state.config.queue_timeout.is_zero() || state.clock.instant() + QUEUE_POLL > deadline {
        return false;
    }
    if !*queued {
        if state.queued.fetch_add(1, Ordering::Relaxed) >= state.config.max_queued {
            state.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        *queued = true;
    }
    tokio::time::sleep(QUEUE_POLL).await;
    true
}

fn copy_content_type(from: &reqwest::header::HeaderMap, to: &mut Response) {
    let ct = from.get(reqwest::header::CONTENT_TYPE).and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok());
    to.headers_mut().insert(header::CONTENT_TYPE, ct.unwrap_or(HeaderValue::from_static("application/json")));
}

async fn respond(resp: reqwest::Response, mut flight: Flight, stream: bool) -> Result<Response, ApiError> {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if status.is_server_error() {
        tracing::warn!(engine = %flight.engine, request = flight.id.0, %status, "upstream answered with a server error");
        return Err(ApiError::UpstreamFailed);
    }
    let headers = resp.headers().clone();
    let request_id = HeaderValue::from_str(&flight.id.0.to_string()).ok();
    if !stream || !status.is_success() {
        // Client errors from the engine (its own validation) are passed through as they are.
        let body = resp.bytes().await.map_err(|e| {
            tracing::warn!(engine = %flight.engine, request = flight.id.0, error = %e, "upstream body failed");
            ApiError::UpstreamFailed
        })?;
        flight.first_byte();
        flight.outcome = status.as_u16();
        let mut out = Response::new(Body::from(body));
        *out.status_mut() = status;
        copy_content_type(&headers, &mut out);
        if let Some(v) = request_id {
            out.headers_mut().insert("x-kvgate-request-id", v);
        }
        return Ok(out);
    }
    flight.outcome = 499;
    let upstream = resp.bytes_stream();
    let body = futures_util::stream::unfold((upstream, Some(flight)), |(mut upstream, mut flight)| async move {
        let f = flight.as_mut()?;
        match upstream.next().await {
            Some(Ok(chunk)) => {
                f.first_byte();
                Some((Ok::<Bytes, std::io::Error>(chunk), (upstream, flight)))
            }
            Some(Err(e)) => {
                tracing::warn!(engine = %f.engine, request = f.id.0, error = %e, "upstream stream broke mid-response");
                f.outcome = 502;
                let event = format!("data: {}\n\n", ApiError::UpstreamFailed.body());
                drop(flight.take());
                Some((Ok(Bytes::from(event)), (upstream, None)))
            }
            None => {
                f.outcome = 200;
                drop(flight.take());
                None
            }
        }
    });
    let mut out = Response::new(Body::from_stream(body));
    *out.status_mut() = status;
    copy_content_type(&headers, &mut out);
    out.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Some(v) = request_id {
        out.headers_mut().insert("x-kvgate-request-id", v);
    }
    Ok(out)
}
