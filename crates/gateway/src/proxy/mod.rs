//! Dispatch, in three steps: **place** the request (decide and reserve, admit, or queue until
//! capacity appears), **send** it (retrying on another engine while the client has seen nothing),
//! and **respond** (the answer turned into the client's response, streamed chunk by chunk while
//! the reservation follows it).
//!
//! ```text
//! route ─► place (place.rs) ─► Flight (flight.rs) ─► Backend::send ─► Backend::respond
//!            ▲                                          │ retryable failure, not the last attempt
//!            └──────────────── another engine ◄──────────┘
//! ```
//!
//! Placing, retrying and accounting are the same for every engine; how a request reaches an engine
//! and how its answer comes back is a [`Backend`]'s job ([`http::HttpBackend`] for OpenAI-compatible
//! HTTP servers, [`grpc::GrpcBackend`] for gRPC workers, which answer in token ids that
//! [`openai`] shapes into OpenAI responses), so the routing policy never knows which backend
//! carries a request.
//!
//! Every request is counted once, when its [`Flight`] ends or, if it never got one, by
//! [`dispatch`]. Engine failures (server errors, timeouts, refused connects, broken streams) feed
//! passive health ([`crate::engines::request_failed`]); the gateway's own shortages never do.

mod embed;
mod flight;
mod generate;
mod grpc;
mod http;
mod logprobs;
mod openai;
mod place;
mod responses;
mod score;

use std::future::Future;
use std::sync::Arc;

use axum::response::Response;
use bytes::Bytes;
use kvgate_core::{BlockKey, Namespace, WorkerId};
use kvgate_tokenizer::request::{Endpoint, Parsed};

use crate::error::ApiError;
use crate::state::AppState;
use flight::{Flight, Outcome};
use place::{place, QueueSlot};

/// Most engines one request is tried on.
const MAX_ATTEMPTS: usize = 3;

/// A request as the backends see it: the route, the client's body as it came, and what kvgate
/// parsed from it (the rendered prompt's token ids included).
#[derive(Debug, Clone, Copy)]
struct Outgoing<'a> {
    /// The API route that was called.
    pub endpoint: Endpoint,
    /// The client's JSON body.
    pub body: &'a Bytes,
    /// The parsed request.
    pub parsed: &'a Parsed,
}

/// Why an attempt on one engine failed.
#[derive(Debug)]
enum SendFailure {
    /// Nothing came back and the client has seen nothing: another engine may take the request
    /// (on the last attempt, the client gets this error).
    Retryable(ApiError),
    /// The request is answered with this error.
    Final(ApiError),
}

/// How a request reaches one engine and how the engine's answer becomes the client's response.
///
/// A backend feeds passive health from what it sees ([`crate::engines::request_succeeded`],
/// [`crate::engines::request_failed`], [`crate::engines::connect_failed`], or [`Flight::engine_failed`]) and marks the
/// flight's first byte; placing, retries, timeouts until the answer starts, and counting are done
/// around it, the same for every backend.
trait Backend: Sync {
    /// What an engine answered with, before any of it reached the client.
    type Answer: Send;

    /// Sends the request to the flight's engine and waits for the start of its answer.
    fn send(
        &self,
        state: &AppState,
        request: Outgoing<'_>,
        flight: &mut Flight,
    ) -> impl Future<Output = Result<Self::Answer, SendFailure>> + Send;

    /// Turns the answer into the client's response; the flight follows the body to its end.
    fn respond(&self, answer: Self::Answer, flight: Flight) -> impl Future<Output = Result<Response, ApiError>> + Send;
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
    let mut parsed = parsed;
    if let Some(limit) = state.router.largest_kv_capacity() {
        // An estimate near the limit is no ground to refuse: count every id first.
        if parsed.rest.is_some() && parsed.prompt_tokens() > limit / 2 {
            parsed = finish_off_thread(state, parsed).await.map_err(|e| (e, false))?;
        }
        let prompt_tokens = parsed.prompt_tokens();
        if prompt_tokens > limit {
            return Err((ApiError::PromptTooLong { tokens: prompt_tokens, limit }, false));
        }
    }
    if let Some(rest) = &parsed.rest {
        check_estimate(state, rest);
    }
    // gRPC workers that cannot take the endpoint (an embedding model asked to generate, a
    // generating one asked to embed, rerank and score on any) are passed over.
    let unserved: Vec<WorkerId> = {
        let engines = state.engines.read();
        let unserved: Vec<WorkerId> = engines
            .values()
            .filter(|e| e.grpc.as_ref().is_some_and(|w| !openai::grpc_serves(endpoint, w.generates())))
            .map(|e| e.id.clone())
            .collect();
        if !unserved.is_empty() && unserved.len() == engines.len() {
            return Err((openai::grpc_unserved(endpoint), false));
        }
        unserved
    };
    let keys = routing_keys(state, endpoint, &parsed);
    let mut queue = QueueSlot::new(state, state.clock.instant() + state.config.queue_timeout);
    let attempts = state.engines.read().len().saturating_sub(unserved.len()).clamp(1, MAX_ATTEMPTS);
    let mut tried: Vec<WorkerId> = Vec::new();
    loop {
        let skipped: Vec<WorkerId> = tried.iter().chain(&unserved).cloned().collect();
        let flight =
            place(state, endpoint, &keys, &parsed, &tried, &skipped, &mut queue).await.map_err(|e| (e, false))?;
        let last_attempt = tried.len() + 1 >= attempts;
        // A gRPC worker takes every id (one registered after the request was read may be chosen).
        if flight.engine.grpc.is_some() && parsed.rest.is_some() {
            parsed = finish_off_thread(state, parsed).await.map_err(|e| (e, false))?;
        }
        let request = Outgoing { endpoint, body: &body, parsed: &parsed };
        let attempted = if flight.engine.grpc.is_some() {
            attempt(&grpc::GrpcBackend, state, request, flight, last_attempt).await
        } else {
            attempt(&http::HttpBackend, state, request, flight, last_attempt).await
        };
        match attempted {
            Attempted::Done(result) => return result.map_err(|e| (e, true)),
            Attempted::Retry(engine) => tried.push(engine),
        }
    }
}

/// Tokenizes what routing left of the prompt, on the tokenizing threads like the rest of it.
async fn finish_off_thread(state: &Arc<AppState>, mut parsed: Parsed) -> Result<Parsed, ApiError> {
    let s = state.clone();
    state
        .tokenize_pool
        .run(move || {
            parsed
                .finish(s.tokenizer.as_ref())
                .map_err(|e| ApiError::InvalidRequest { param: None, message: e.to_string() })?;
            Ok(parsed)
        })
        .await
        .map_err(|_| ApiError::Internal)?
}

/// At most once per `tokenize_check_interval_ms`, tokenizes a partial prompt's rest after all, off
/// the request path and only when a tokenizing thread is free, and records how far the estimate
/// was off.
fn check_estimate(state: &Arc<AppState>, rest: &kvgate_tokenizer::Untokenized) {
    let metrics = &state.metrics.tokenize_cache;
    let interval = state.config.tokenize_check_interval.as_micros() as u64;
    if !metrics.check_now(state.clock.now().as_micros(), interval) {
        return;
    }
    let (s, rest) = (state.clone(), rest.clone());
    state.tokenize_pool.run_if_idle(move || {
        if let Ok(ids) = s.tokenizer.finish(&rest) {
            let ratio = rest.estimated_tokens as f64 / ids.len().max(1) as f64;
            s.metrics.tokenize_cache.estimate_ratio.observe(ratio);
        }
    });
}

/// What one attempt on one engine came to.
enum Attempted {
    /// The client's response, or the error it is answered with.
    Done(Result<Response, ApiError>),
    /// Nothing reached the client; the request goes on to another engine than this one.
    Retry(WorkerId),
}

/// One attempt on the flight's engine through `backend`, bounded by `request_timeout_s` until the
/// answer starts.
async fn attempt<B: Backend>(
    backend: &B,
    state: &AppState,
    request: Outgoing<'_>,
    mut flight: Flight,
    last_attempt: bool,
) -> Attempted {
    let sent = tokio::time::timeout(state.config.request_timeout, backend.send(state, request, &mut flight)).await;
    let failure = match sent {
        Ok(Ok(answer)) => return Attempted::Done(backend.respond(answer, flight).await),
        Ok(Err(failure)) => failure,
        Err(_) => {
            tracing::warn!(engine = %flight.engine.id, request = flight.id.0, "upstream timed out before responding");
            flight.engine_failed(&ApiError::UpstreamTimeout);
            SendFailure::Final(ApiError::UpstreamTimeout)
        }
    };
    match failure {
        SendFailure::Retryable(_) if !last_attempt => {
            state.metrics.retries.inc();
            flight.outcome = Outcome::Retried;
            Attempted::Retry(flight.engine.id.clone())
        }
        SendFailure::Retryable(err) | SendFailure::Final(err) => {
            flight.outcome = Outcome::Status(err.status().as_u16());
            Attempted::Done(Err(err))
        }
    }
}
