//! The backend for OpenAI-compatible HTTP servers (vLLM's, SGLang's, the mock engine's): the
//! client's body is forwarded as it came and the engine's answer passed back as it comes, status,
//! content type and `Retry-After` included.

use std::time::Instant;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;

use super::flight::{error_event, Flight, Outcome};
use super::{Backend, Outgoing, SendFailure};
use crate::engines;
use crate::error::ApiError;
use crate::state::AppState;

/// Forwards requests over HTTP to the engine's own OpenAI server.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct HttpBackend;

/// The engine's response headers, before any of its body reached the client.
#[derive(Debug)]
pub(super) struct HttpAnswer {
    response: reqwest::Response,
    /// Whether the client asked for a stream.
    stream: bool,
    /// When the request was sent, for the body's share of `request_timeout_s`.
    sent_at: Instant,
}

impl Backend for HttpBackend {
    type Answer = HttpAnswer;

    /// Sends the body and waits for the engine's response headers.
    async fn send(
        &self,
        state: &AppState,
        request: Outgoing<'_>,
        flight: &mut Flight,
    ) -> Result<HttpAnswer, SendFailure> {
        let engine = flight.engine.clone();
        let Some(url) = engine.route_url(request.endpoint) else {
            return Err(SendFailure::Final(ApiError::Internal));
        };
        let sent_at = state.clock.instant();
        let sent = state
            .http
            .post(url)
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-request-id", state.engine_request_id(flight.id))
            .body(request.body.clone())
            .send()
            .await;
        match sent {
            Err(e) if crate::error::is_local_resource_error(&e) => {
                let why = error_chain(&e);
                tracing::error!(engine = %engine.id, request = flight.id.0, error = %why, "out of local resources calling an engine; the engine is not blamed");
                state.metrics.local_resource_errors.inc();
                Err(SendFailure::Final(ApiError::LocalResources("file descriptors or ports".into())))
            }
            Err(e) if e.is_timeout() => {
                flight.engine_failed(&ApiError::UpstreamTimeout);
                Err(SendFailure::Final(ApiError::UpstreamTimeout))
            }
            // Nothing came back, so the client has seen nothing: another engine can take it. A
            // refused connect counts against the engine; a connection that broke before any response
            // (an engine closing a kept-alive connection under load) is retried without blame.
            Err(e) => {
                let why = error_chain(&e);
                if e.is_connect() {
                    tracing::warn!(engine = %engine.id, request = flight.id.0, error = %why, "connect failed");
                    engines::connect_failed(&state.engine_context(), &engine);
                } else {
                    tracing::info!(engine = %engine.id, request = flight.id.0, error = %why, "request failed before any response");
                }
                Err(SendFailure::Retryable(ApiError::UpstreamUnavailable))
            }
            Ok(response) => match client_status(response.status().as_u16()) {
                Some(status) if !status.is_server_error() => {
                    engines::request_succeeded(&engine);
                    Ok(HttpAnswer { response, stream: request.parsed.stream, sent_at })
                }
                _ => {
                    let status = response.status().as_u16();
                    tracing::warn!(engine = %engine.id, request = flight.id.0, status, "upstream answered with a server error");
                    engines::request_failed(&state.engine_context(), &engine);
                    Err(SendFailure::Retryable(ApiError::UpstreamFailed))
                }
            },
        }
    }
    /// Passes the engine's answer on: a body whole, a stream chunk by chunk with an idle timeout.
    async fn respond(&self, answer: HttpAnswer, mut flight: Flight) -> Result<Response, ApiError> {
        let HttpAnswer { response: resp, stream, sent_at } = answer;
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
            let event = error_event(&tail, &failure);
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
}

/// A status an HTTP client can be given: engines' nonstandard codes (999) are not passed on.
fn client_status(code: u16) -> Option<StatusCode> {
    (100..600).contains(&code).then(|| StatusCode::from_u16(code).ok()).flatten()
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
