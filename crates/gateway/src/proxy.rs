//! Dispatch, in three steps: **place** the request (decide and reserve, admit, or queue until
//! capacity appears), **send** it (retrying on another engine while the client has seen nothing),
//! and **respond** (the body streamed back chunk by chunk while the reservation follows it).
//!
//! Every request is counted once, when its [`Flight`] ends or, if it never got one, by
//! [`dispatch`]. Engine failures (server errors, timeouts, refused connects, broken streams) feed
//! passive health ([`engines::request_failed`]); the gateway's own shortages never do.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use kvgate_core::{
    BlockKey, DecideError, Decision, FallbackReason, Mode, Namespace, Reason, RequestId, RouteRequest, WorkerId,
};

use crate::api::request::{Endpoint, Parsed};
use crate::engines::{self, EngineHandle};
use crate::error::ApiError;
use crate::state::AppState;

/// Longest a queued request sleeps before deciding again when nothing wakes it: load reports can
/// make room without any release or health change.
const QUEUE_RECHECK: Duration = Duration::from_millis(200);
/// Most engines one request is tried on.
const MAX_ATTEMPTS: usize = 3;

/// How a flight ended, for the request counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The client went away before the response was complete (499, nginx's convention).
    ClientGone,
    /// The response ended with this status.
    Status(u16),
    /// Not counted here: the request goes on to another engine, or [`dispatch`] counts it.
    Retried,
}

/// A request's reservation and in-flight accounting on one engine, released when the response is
/// done with: at the last byte, on an upstream error, or when the client goes away and the body is
/// dropped.
struct Flight {
    state: Arc<AppState>,
    id: RequestId,
    engine: Arc<EngineHandle>,
    started: Instant,
    first_byte: bool,
    outcome: Outcome,
    /// Tokens the response says it generated (a streamed `usage` chunk), for decode calibration.
    output_tokens: Option<u64>,
}

impl Flight {
    fn new(state: &Arc<AppState>, id: RequestId, engine: Arc<EngineHandle>) -> Flight {
        engine.metrics.in_flight.inc();
        Flight {
            state: state.clone(),
            id,
            engine,
            started: state.clock.instant(),
            first_byte: false,
            outcome: Outcome::ClientGone,
            output_tokens: None,
        }
    }

    /// The response's first bytes arrived. A stream's first bytes are its first token, which moves
    /// the reservation to decode and times the prefill; a body that does not stream arrives whole,
    /// so its time says nothing about the prefill and the reservation is simply released at the end.
    fn first_byte(&mut self, streamed: bool) {
        if !self.first_byte {
            self.first_byte = true;
            if streamed {
                let _ = self.state.router.first_token(self.id, self.state.clock.now());
            }
            self.engine.metrics.ttft.observe(self.started.elapsed().as_secs_f64());
        }
    }

    /// The engine failed this request: count it against the engine and end with `err`'s status.
    fn engine_failed(&mut self, err: &ApiError) {
        engines::request_failed(&self.state.engine_context(), &self.engine);
        self.outcome = Outcome::Status(err.status().as_u16());
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let _ = self.state.router.release_with_output(self.id, self.state.clock.now(), self.output_tokens);
        self.state.capacity.notify_one();
        let m = &self.engine.metrics;
        m.in_flight.dec();
        m.duration.observe(self.started.elapsed().as_secs_f64());
        match self.outcome {
            Outcome::Status(200) => {
                m.ok.inc();
            }
            Outcome::Status(s) => self.state.metrics.request(s, Some(self.engine.id.as_str())),
            Outcome::ClientGone => self.state.metrics.request(499, Some(self.engine.id.as_str())),
            Outcome::Retried => {}
        }
    }
}

/// Counts a decision in the metrics and moves it into the decision log.
fn record(state: &AppState, endpoint: Endpoint, d: Decision, started: Instant) {
    let m = &state.metrics;
    m.decision_latency.observe(started.elapsed().as_secs_f64());
    m.decisions.get_or_create(&crate::metrics::ReasonLabel { reason: d.reason.as_str().to_owned() }).inc();
    if d.shadow_disagrees() {
        m.shadow_disagreements.inc();
    }
    // Escapes, copies, reuses and fallbacks are counted where enforce takes them, and in shadow where it would.
    if matches!(d.mode, Mode::Enforce | Mode::Shadow) {
        match d.enforce_reason {
            Some(Reason::Escape) => {
                m.escapes.inc();
            }
            Some(Reason::Replicate) => {
                m.replications.inc();
            }
            Some(Reason::Reuse) => {
                m.reuses.inc();
            }
            Some(Reason::Fallback(r)) => {
                m.fallbacks.get_or_create(&crate::metrics::ReasonLabel { reason: fallback_label(r) }).inc();
            }
            _ => {}
        }
    }
    state.metrics.prefill_weight.set(d.prefill_weight);
    {
        let engines = state.engines.read();
        for s in &d.scores {
            if let Some(e) = engines.get(&s.worker) {
                e.metrics.projected.set(s.projected_s);
            }
        }
    }
    state.log_decision(endpoint_name(endpoint), d);
}

fn fallback_label(r: FallbackReason) -> String {
    r.as_str().to_owned()
}

/// The route's name in the decision log.
pub fn endpoint_name(e: Endpoint) -> &'static str {
    e.path()
}

/// A place in the bounded queue, given back however the request ends (a client that goes away
/// while queued included).
struct QueueSlot<'a> {
    state: &'a AppState,
    held: bool,
}

impl QueueSlot<'_> {
    /// Waits for capacity if bounded queueing allows; false when the request must be answered now.
    async fn wait(&mut self, deadline: Instant) -> bool {
        let now = self.state.clock.instant();
        if self.state.config.queue_timeout.is_zero() || now >= deadline {
            return false;
        }
        if !self.held {
            if self.state.queued.fetch_add(1, Ordering::Relaxed) >= self.state.config.max_queued {
                self.state.queued.fetch_sub(1, Ordering::Relaxed);
                return false;
            }
            self.held = true;
        }
        let _ = tokio::time::timeout(QUEUE_RECHECK.min(deadline - now), self.state.capacity.notified()).await;
        true
    }
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        if self.held {
            self.state.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Decides, reserves and admits; queues while nothing can take the request and the queue allows.
async fn place(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    keys: &[BlockKey],
    parsed: &Parsed,
    tried: &[WorkerId],
    queue: &mut QueueSlot<'_>,
    deadline: Instant,
) -> Result<Flight, ApiError> {
    loop {
        let id = RequestId(state.next_request.fetch_add(1, Ordering::Relaxed));
        let route = RouteRequest {
            id,
            keys,
            prompt_tokens: parsed.tokens.len() as u64,
            max_tokens: parsed.max_tokens,
            exclude: tried,
        };
        let started = state.clock.instant();
        let decided = {
            let mut rng = state.rng.lock();
            state.router.decide(&route, state.clock.now(), &mut *rng)
        };
        let decision = match decided {
            Ok(d) => d,
            // Every engine left has already failed this request: say so, not "no engine".
            Err(DecideError::NoEligibleWorker) if !tried.is_empty() => return Err(ApiError::UpstreamUnavailable),
            Err(DecideError::NoEligibleWorker) => {
                if queue.wait(deadline).await {
                    continue;
                }
                return Err(ApiError::NoEligibleWorker);
            }
            Err(DecideError::DuplicateRequest(_)) => return Err(ApiError::Internal),
        };
        let wait = decision.admission_wait_s();
        let worker = decision.worker.clone();
        record(state, endpoint, decision, started);
        let limit = state.runtime.read().admission_wait_s;
        if limit > 0.0 && wait > limit {
            let _ = state.router.release(id, state.clock.now());
            if queue.wait(deadline).await {
                continue;
            }
            return Err(ApiError::Overloaded { wait_s: wait, limit_s: limit });
        }
        let Some(engine) = state.engine(&worker) else {
            let _ = state.router.release(id, state.clock.now());
            return Err(ApiError::Internal);
        };
        return Ok(Flight::new(state, id, engine));
    }
}

/// What one attempt on one engine came to.
enum Sent {
    /// The engine answered (any status a client may see).
    Answered(reqwest::Response),
    /// Nothing reached the client; another engine may take the request.
    Retry,
    /// The request is answered with this error.
    Failed(ApiError),
}

/// A status an HTTP client can be given: engines' nonstandard codes (999) are not passed on.
fn client_status(code: u16) -> Option<StatusCode> {
    (100..600).contains(&code).then(|| StatusCode::from_u16(code).ok()).flatten()
}

/// One attempt: sends the body to the flight's engine and waits for its response headers.
async fn send(state: &AppState, endpoint: Endpoint, body: &Bytes, flight: &mut Flight, last_attempt: bool) -> Sent {
    let engine = flight.engine.clone();
    let Some(url) = engine.route_url(endpoint) else {
        flight.outcome = Outcome::Status(ApiError::Internal.status().as_u16());
        return Sent::Failed(ApiError::Internal);
    };
    let request = state
        .http
        .post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", flight.id.0.to_string())
        .body(body.clone())
        .send();
    let retry_or = |flight: &mut Flight, err: ApiError| {
        if last_attempt {
            flight.outcome = Outcome::Status(err.status().as_u16());
            Sent::Failed(err)
        } else {
            state.metrics.retries.inc();
            flight.outcome = Outcome::Retried;
            Sent::Retry
        }
    };
    match tokio::time::timeout(state.config.request_timeout, request).await {
        Err(_) => {
            tracing::warn!(engine = %engine.id, request = flight.id.0, "upstream timed out before responding");
            flight.engine_failed(&ApiError::UpstreamTimeout);
            Sent::Failed(ApiError::UpstreamTimeout)
        }
        Ok(Err(e)) if crate::error::is_local_resource_error(&e) => {
            let why = error_chain(&e);
            tracing::error!(engine = %engine.id, request = flight.id.0, error = %why, "out of local resources calling an engine; the engine is not blamed");
            state.metrics.local_resource_errors.inc();
            let err = ApiError::LocalResources("file descriptors or ports".into());
            flight.outcome = Outcome::Status(err.status().as_u16());
            Sent::Failed(err)
        }
        Ok(Err(e)) if e.is_timeout() => {
            flight.engine_failed(&ApiError::UpstreamTimeout);
            Sent::Failed(ApiError::UpstreamTimeout)
        }
        // Nothing came back, so the client has seen nothing: another engine can take it. A
        // refused connect counts against the engine; a connection that broke before any response
        // (an engine closing a kept-alive connection under load) is retried without blame.
        Ok(Err(e)) => {
            let why = error_chain(&e);
            if e.is_connect() {
                tracing::warn!(engine = %engine.id, request = flight.id.0, error = %why, "connect failed");
                engines::connect_failed(&state.engine_context(), &engine);
            } else {
                tracing::info!(engine = %engine.id, request = flight.id.0, error = %why, "request failed before any response");
            }
            retry_or(flight, ApiError::UpstreamUnavailable)
        }
        Ok(Ok(resp)) => match client_status(resp.status().as_u16()) {
            Some(status) if !status.is_server_error() => {
                engines::request_succeeded(&engine);
                Sent::Answered(resp)
            }
            _ => {
                let status = resp.status().as_u16();
                tracing::warn!(engine = %engine.id, request = flight.id.0, status, "upstream answered with a server error");
                engines::request_failed(&state.engine_context(), &engine);
                retry_or(flight, ApiError::UpstreamFailed)
            }
        },
    }
}

/// Routes and proxies one request.
pub async fn dispatch(
    state: Arc<AppState>,
    endpoint: Endpoint,
    body: Bytes,
    parsed: Parsed,
) -> Result<Response, ApiError> {
    let result = route(&state, endpoint, body, parsed).await;
    // Requests that got a flight were counted with their engine when it ended.
    if let Err((e, false)) = &result {
        state.metrics.request(e.status().as_u16(), None);
    }
    result.map_err(|(e, _)| e)
}

/// The block keys a request is routed on. Pooling requests (embeddings, rerank, score) leave
/// nothing in the cache worth following: they get none and are placed by load alone.
pub(crate) fn routing_keys(state: &AppState, endpoint: Endpoint, parsed: &Parsed) -> Vec<BlockKey> {
    if endpoint.earns_cache_credit() {
        state.router.request_keys(Namespace::new(None, parsed.cache_salt.as_deref()), &parsed.tokens)
    } else {
        Vec::new()
    }
}

/// The request's response, or its error and whether a flight already counted it.
async fn route(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    body: Bytes,
    parsed: Parsed,
) -> Result<Response, (ApiError, bool)> {
    let prompt_tokens = parsed.tokens.len() as u64;
    if let Some(limit) = state.router.largest_kv_capacity().filter(|&l| prompt_tokens > l) {
        return Err((ApiError::PromptTooLong { tokens: prompt_tokens, limit }, false));
    }
    let keys = routing_keys(state, endpoint, &parsed);
    let deadline = state.clock.instant() + state.config.queue_timeout;
    let mut queue = QueueSlot { state, held: false };
    let attempts = state.engines.read().len().clamp(1, MAX_ATTEMPTS);
    let mut tried: Vec<WorkerId> = Vec::new();
    loop {
        let mut flight =
            place(state, endpoint, &keys, &parsed, &tried, &mut queue, deadline).await.map_err(|e| (e, false))?;
        let sent_at = state.clock.instant();
        match send(state, endpoint, &body, &mut flight, tried.len() + 1 >= attempts).await {
            Sent::Answered(resp) => return respond(resp, flight, parsed.stream, sent_at).await.map_err(|e| (e, true)),
            Sent::Retry => tried.push(flight.engine.id.clone()),
            Sent::Failed(e) => return Err((e, true)),
        }
    }
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

/// The engine's headers a client should see: its content type and, on 429 or 503, when to retry.
fn copy_headers(from: &reqwest::header::HeaderMap, to: &mut Response) {
    let ct = from.get(reqwest::header::CONTENT_TYPE).and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok());
    to.headers_mut().insert(header::CONTENT_TYPE, ct.unwrap_or(HeaderValue::from_static("application/json")));
    if let Some(v) = from.get(reqwest::header::RETRY_AFTER).and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
        to.headers_mut().insert(header::RETRY_AFTER, v);
    }
}

/// What to write before an error event so that it stands alone: a stream cut mid-line or mid-event
/// would otherwise glue the error onto the engine's partial output.
fn event_separator(sent_tail: &[u8]) -> &'static str {
    if sent_tail.is_empty() || sent_tail.ends_with(b"\n\n") {
        ""
    } else if sent_tail.ends_with(b"\n") {
        "\n"
    } else {
        "\n\n"
    }
}

/// The `completion_tokens` of a `usage` object in an SSE chunk (OpenAI's `stream_options.include_usage`
/// and SGLang's and vLLM's final chunks carry one). A key split across two chunks is missed, which
/// only costs one calibration point.
fn completion_tokens_in(chunk: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"completion_tokens\":";
    let at = chunk.windows(KEY.len()).rposition(|w| w == KEY)? + KEY.len();
    let rest = &chunk[at..];
    let start = rest.iter().position(|b| !b.is_ascii_whitespace())?;
    let digits = rest[start..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[start..start + digits]).ok()?.parse().ok()
}

async fn respond(
    resp: reqwest::Response,
    mut flight: Flight,
    stream: bool,
    sent_at: Instant,
) -> Result<Response, ApiError> {
    let status = client_status(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = resp.headers().clone();
    let request_id = HeaderValue::from_str(&flight.id.0.to_string()).ok();
    let state = flight.state.clone();
    if !stream || !status.is_success() {
        // Client errors from the engine (its own validation) are passed through as they are.
        let left = state.config.request_timeout.saturating_sub(sent_at.elapsed());
        let body = match tokio::time::timeout(left, resp.bytes()).await {
            Ok(Ok(body)) => body,
            Ok(Err(e)) => {
                tracing::warn!(engine = %flight.engine.id, request = flight.id.0, error = %e, "upstream body failed");
                flight.engine_failed(&ApiError::UpstreamFailed);
                return Err(ApiError::UpstreamFailed);
            }
            Err(_) => {
                tracing::warn!(engine = %flight.engine.id, request = flight.id.0, "upstream body did not arrive within request_timeout_s");
                flight.engine_failed(&ApiError::UpstreamTimeout);
                return Err(ApiError::UpstreamTimeout);
            }
        };
        flight.first_byte(false);
        flight.outcome = Outcome::Status(status.as_u16());
        let mut out = Response::new(Body::from(body));
        *out.status_mut() = status;
        copy_headers(&headers, &mut out);
        if let Some(v) = request_id {
            out.headers_mut().insert("x-kvgate-request-id", v);
        }
        return Ok(out);
    }
    let idle = state.config.limits.stream_idle_timeout;
    let upstream = resp.bytes_stream();
    // The state: the upstream, the flight while the stream lasts, and the last bytes sent.
    let init = (upstream, Some(flight), Vec::<u8>::new());
    let body = futures_util::stream::unfold(init, move |(mut upstream, mut flight, mut tail)| async move {
        let f = flight.as_mut()?;
        let failure = match tokio::time::timeout(idle, upstream.next()).await {
            Ok(Some(Ok(chunk))) => {
                f.first_byte(true);
                if let Some(n) = completion_tokens_in(&chunk) {
                    f.output_tokens = Some(n);
                }
                tail.clear();
                tail.extend_from_slice(&chunk[chunk.len().saturating_sub(2)..]);
                return Some((Ok::<Bytes, std::io::Error>(chunk), (upstream, flight, tail)));
            }
            Ok(None) => {
                f.outcome = Outcome::Status(200);
                drop(flight.take());
                return None;
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(engine = %f.engine.id, request = f.id.0, error = %e, "upstream stream broke mid-response");
                ApiError::UpstreamFailed
            }
            Err(_) => {
                tracing::warn!(engine = %f.engine.id, request = f.id.0, idle_s = idle.as_secs_f64(), "upstream stream went silent; ending it");
                ApiError::UpstreamTimeout
            }
        };
        f.engine_failed(&failure);
        drop(flight.take());
        let event = format!("{}data: {}\n\n", event_separator(&tail), failure.body());
        Some((Ok(Bytes::from(event)), (upstream, None, tail)))
    });
    let mut out = Response::new(Body::from_stream(body));
    *out.status_mut() = status;
    copy_headers(&headers, &mut out);
    out.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Some(v) = request_id {
        out.headers_mut().insert("x-kvgate-request-id", v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usage_chunk_gives_the_completion_tokens() {
        let chunk = br#"data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens": 345,"total_tokens":357}}

"#;
        assert_eq!(completion_tokens_in(chunk), Some(345));
        assert_eq!(completion_tokens_in(br#"data: {"choices":[{"delta":{"content":"hi"}}]}"#), None);
        assert_eq!(completion_tokens_in(br#""completion_tokens":"#), None);
    }

    #[test]
    fn an_error_event_never_continues_a_partial_line() {
        assert_eq!(event_separator(b""), "");
        assert_eq!(event_separator(b"}\n\n"), "");
        assert_eq!(event_separator(b"}\n"), "\n");
        assert_eq!(event_separator(b"{\"cho"), "\n\n");
    }

    #[test]
    fn only_standard_statuses_reach_clients() {
        assert_eq!(client_status(200), Some(StatusCode::OK));
        assert_eq!(client_status(429), Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(client_status(999), None);
        assert_eq!(client_status(42), None);
    }

    #[test]
    fn descriptor_exhaustion_is_local() {
        let emfile = std::io::Error::from_raw_os_error(24);
        assert!(crate::error::is_local_resource_error(&emfile));
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!crate::error::is_local_resource_error(&refused));
    }
}
