//! The first step: decide and reserve, admit, or queue until capacity appears.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_core::{BlockKey, DecideError, Decision, FallbackReason, Mode, Reason, RequestId, RouteRequest, WorkerId};
use kvgate_tokenizer::request::{Endpoint, Parsed};
use rand::RngCore;

use super::flight::Flight;
use crate::error::ApiError;
use crate::state::AppState;

/// Longest a queued request sleeps before deciding again when nothing wakes it: load reports can
/// make room without any release or health change.
const QUEUE_RECHECK: Duration = Duration::from_millis(200);

/// Counts a decision in the metrics and moves it into the decision log.
fn record(state: &AppState, endpoint: Endpoint, d: Decision, started: Instant, estimated: Option<u64>) {
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
    state.log_decision(endpoint_name(endpoint), d, estimated);
}

fn fallback_label(r: FallbackReason) -> String {
    r.as_str().to_owned()
}

/// The route's name in the decision log.
fn endpoint_name(e: Endpoint) -> &'static str {
    e.path()
}

/// A place in the bounded queue, given back however the request ends (a client that goes away
/// while queued included).
pub(super) struct QueueSlot<'a> {
    state: &'a AppState,
    held: bool,
    /// When the request stops waiting for an engine.
    deadline: Instant,
}

impl<'a> QueueSlot<'a> {
    /// No place in the queue yet: one is taken only when the request must wait, until `deadline`.
    pub(super) fn new(state: &'a AppState, deadline: Instant) -> Self {
        QueueSlot { state, held: false, deadline }
    }
}

impl QueueSlot<'_> {
    /// Waits for capacity if bounded queueing allows; false when the request must be answered now.
    async fn wait(&mut self) -> bool {
        let (now, deadline) = (self.state.clock.instant(), self.deadline);
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
/// `skipped` are the engines not to choose: those `tried` already, and any that cannot serve the
/// endpoint.
pub(super) async fn place(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    keys: &[BlockKey],
    parsed: &Parsed,
    tried: &[WorkerId],
    skipped: &[WorkerId],
    queue: &mut QueueSlot<'_>,
) -> Result<Flight, ApiError> {
    if tried.is_empty() {
        // Peers deciding in the same instants would all choose the same engine: let their
        // reservations arrive first (kvgate_core::concurrent_peers).
        let draw = state.rng.lock().next_u64();
        let wait = state.replicas.stagger(&state.router, state.clock.now(), draw);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
    loop {
        let id = RequestId(state.next_request.fetch_add(1, Ordering::Relaxed));
        let route = RouteRequest {
            id,
            keys,
            prompt_tokens: parsed.prompt_tokens(),
            max_tokens: parsed.max_tokens,
            exclude: skipped,
            keys_cover_prompt: parsed.rest.is_none(),
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
                if queue.wait().await {
                    continue;
                }
                return Err(ApiError::NoEligibleWorker);
            }
            Err(DecideError::DuplicateRequest(_)) => return Err(ApiError::Internal),
        };
        let wait = decision.admission_wait_s();
        let worker = decision.worker.clone();
        record(state, endpoint, decision, started, parsed.rest.as_ref().map(|r| r.estimated_tokens));
        let limit = state.runtime.read().admission_wait_s;
        if limit > 0.0 && wait > limit {
            let _ = state.router.release(id, state.clock.now());
            if queue.wait().await {
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
