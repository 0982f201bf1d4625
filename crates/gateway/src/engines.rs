//! The engine registry's background work: health checks with a circuit breaker, load polling
//! (SGLang `/v1/loads` or Prometheus `/metrics`), model discovery, and what the engine says about
//! itself. Health and load run as separate tasks per engine, so a hung `/health` never delays a load
//! poll past `stale_after`.
//!
//! An engine's prefix cache lives in its process. When the process may have restarted (its
//! `process_start_time_seconds` changed, or it comes back after being out of rotation), the KV view
//! kvgate holds for it is dropped at once and rebuilt from the engine's replay socket: vLLM's block
//! hashes repeat across restarts, so old blocks would otherwise look cached on a cold engine.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::{KvState, LoadSnapshot, WorkerId};
use kvgate_protocol::telemetry::{parse_prometheus, parse_sglang_loads, EngineLoad};
use parking_lot::Mutex;
use serde::Serialize;

use crate::api::request::Endpoint;
use crate::config::{EngineKind, WorkerSpec};
use crate::metrics::Metrics;
use crate::state::AppState;

/// Health checks between model-list refreshes.
const MODELS_EVERY: u32 = 15;

/// Passive health: what the engine's answers to real requests say (Envoy's outlier detection).
#[derive(Debug, Default, Clone, Copy)]
struct Outlier {
    /// Upstream failures in a row.
    consecutive: u32,
    /// Ejections in a row (no success in between); each lengthens the next.
    ejections: u32,
    /// Out of rotation until then, whatever `/health` says.
    ejected_until: Option<std::time::Instant>,
}

/// What an engine has said about itself in its load reports.
#[derive(Debug, Default, Clone, Copy)]
struct Identity {
    start_time_s: Option<f64>,
    block_size: Option<u32>,
    capacity_tokens: Option<u64>,
}

/// What the gateway knows about one engine besides the core's view.
#[derive(Debug)]
pub struct EngineHandle {
    /// Worker id.
    pub id: WorkerId,
    /// The configuration it was registered with.
    pub spec: WorkerSpec,
    /// Base URL without a trailing slash.
    pub base: String,
    /// Consecutive failed health checks (or a connect failure, which opens the circuit at once).
    pub failures: AtomicU32,
    /// Whether the circuit is closed (health checks pass).
    pub healthy: AtomicBool,
    /// Which load endpoint worked last.
    pub telemetry: Mutex<Option<EngineKind>>,
    /// The last load poll's error, if it failed.
    pub telemetry_error: Mutex<Option<String>>,
    /// Models the engine reports.
    pub models: Mutex<Vec<String>>,
    /// Counters of the engine's KV event stream.
    pub stream: Arc<crate::kv_events::StreamStats>,
    /// Bumped whenever the KV view must be rebuilt from scratch; the subscribers watch it.
    pub resync: tokio::sync::watch::Sender<u64>,
    /// Why the engine's KV events can't be used at all (a block-size mismatch), if they can't.
    pub config_problem: Mutex<Option<String>>,
    /// Its metric series.
    pub metrics: crate::metrics::EngineMetrics,
    identity: Mutex<Identity>,
    outlier: Mutex<Outlier>,
    /// The engine's URL of each inference route, parsed once.
    routes: Vec<(Endpoint, reqwest::Url)>,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

/// An engine as `GET /admin/workers` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct EngineView {
    /// Worker id.
    pub id: WorkerId,
    /// Base URL.
    pub url: String,
    /// Health checks pass.
    pub healthy: bool,
    /// Consecutive failed health checks.
    pub consecutive_failures: u32,
    /// Consecutive failed requests (passive health).
    pub consecutive_request_failures: u32,
    /// Seconds left out of rotation after an ejection for failed requests, if ejected.
    pub ejected_for_s: Option<f64>,
    /// The load endpoint in use.
    pub telemetry: Option<EngineKind>,
    /// The last load poll error.
    pub telemetry_error: Option<String>,
    /// Models served.
    pub models: Vec<String>,
    /// The block size the engine reports, if it does.
    pub engine_block_size: Option<u32>,
    /// The KV capacity in tokens the engine reports, if it does.
    pub engine_kv_capacity_tokens: Option<u64>,
    /// When the engine process started (Unix seconds), if it says.
    pub engine_started_at_s: Option<f64>,
    /// The core's view: reconciled load, KV state, blocks held, reservations.
    pub router: Option<kvgate_core::WorkerStatus>,
    /// Last KV-event sequence number applied.
    pub last_event_seq: Option<u64>,
    /// The KV event stream's counters (absent without a `kv_events` endpoint).
    pub kv_events: Option<crate::kv_events::StreamView>,
}

impl EngineHandle {
    /// A handle for a freshly registered engine (healthy until proven otherwise).
    pub fn new(id: WorkerId, spec: WorkerSpec, metrics: crate::metrics::EngineMetrics) -> Self {
        let base = spec.url.trim_end_matches('/').to_owned();
        let routes = Endpoint::ALL
            .iter()
            .filter_map(|e| reqwest::Url::parse(&format!("{base}{}", e.path())).ok().map(|u| (*e, u)))
            .collect();
        EngineHandle {
            id,
            base,
            metrics,
            routes,
            spec,
            failures: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            telemetry: Mutex::new(None),
            telemetry_error: Mutex::new(None),
            models: Mutex::new(Vec::new()),
            stream: Arc::new(crate::kv_events::StreamStats::new()),
            resync: tokio::sync::watch::Sender::new(0),
            config_problem: Mutex::new(None),
            identity: Mutex::new(Identity::default()),
            outlier: Mutex::new(Outlier::default()),
            tasks: Mutex::new(Vec::new()),
        }
    }

    /// The engine's URL for an inference route (`None` only if the worker URL cannot be joined
    /// with the route's path, which validation rules out).
    pub fn route_url(&self, endpoint: Endpoint) -> Option<reqwest::Url> {
        self.routes.iter().find(|(e, _)| *e == endpoint).map(|(_, u)| u.clone())
    }

    /// Stops the engine's background tasks.
    pub fn stop(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }

    /// The KV state a fully replayed stream earns: `synced`, unless the engine's configuration rules
    /// its events out.
    pub fn synced_state(&self) -> KvState {
        match self.config_problem.lock().clone() {
            Some(problem) => KvState::Invalid(problem),
            None => KvState::Synced,
        }
    }

    /// A snapshot for the admin API.
    pub fn view(&self, state: &AppState) -> EngineView {
        let identity = *self.identity.lock();
        let outlier = *self.outlier.lock();
        EngineView {
            id: self.id.clone(),
            url: self.spec.display_url(),
            healthy: self.healthy.load(Ordering::Relaxed),
            consecutive_failures: self.failures.load(Ordering::Relaxed),
            consecutive_request_failures: outlier.consecutive,
            ejected_for_s: outlier.ejected_until.and_then(|u| {
                let left = u.saturating_duration_since(state.clock.instant());
                (!left.is_zero()).then_some(left.as_secs_f64())
            }),
            telemetry: *self.telemetry.lock(),
            telemetry_error: self.telemetry_error.lock().clone(),
            models: self.models.lock().clone(),
            engine_block_size: identity.block_size,
            engine_kv_capacity_tokens: identity.capacity_tokens,
            engine_started_at_s: identity.start_time_s,
            router: state.router.worker_status(&self.id, state.clock.now()).ok(),
            last_event_seq: self.stream.view().last_seq,
            kv_events: self.spec.kv_events.as_ref().map(|_| self.stream.view()),
        }
    }
}

/// Starts the background task of every registered engine.
pub fn start_all(state: &Arc<AppState>) {
    let engines: Vec<_> = state.engines.read().values().cloned().collect();
    for e in engines {
        start(state, &e);
    }
}

/// Starts one engine's background tasks: health, load, and its KV event subscribers if it has any.
pub fn start(state: &Arc<AppState>, engine: &Arc<EngineHandle>) {
    let mut tasks = engine.tasks.lock();
    tasks.push(tokio::spawn(health_loop(Arc::downgrade(state), engine.clone())).abort_handle());
    tasks.push(tokio::spawn(load_loop(Arc::downgrade(state), engine.clone())).abort_handle());
    if let Some(endpoint) = engine.spec.kv_events_endpoint() {
        // One subscriber per data-parallel rank, each with its own sequence numbers, all feeding
        // this worker's index: a prefix cached on any rank counts for the engine.
        for rank in 0..engine.spec.dp_size.unwrap_or(1) {
            let Some(endpoint) = crate::config::rank_endpoint(&endpoint, rank) else { continue };
            let cfg = crate::kv_events::StreamConfig {
                worker: engine.id.clone(),
                endpoint,
                bind: engine.spec.binds_kv_events(),
                replay: engine.spec.replay_endpoint().and_then(|r| crate::config::rank_endpoint(&r, rank)),
                topic: engine.spec.topic.clone().unwrap_or_default(),
            };
            let task = tokio::spawn(crate::kv_events::run(Arc::downgrade(state), engine.clone(), cfg));
            tasks.push(task.abort_handle());
        }
    }
}

/// Counts a request that the engine failed (a server error, a timeout, a refused connect). After
/// `outlier_failures` in a row the engine is ejected for `outlier_ejection` times the ejections in a
/// row (at most 10), whatever its `/health` says, unless it is the last engine in rotation: an
/// engine that answers 500 to everything must not look like the idlest one.
pub fn request_failed(state: &AppState, engine: &EngineHandle) {
    Metrics::engine_counter(&state.metrics.upstream_failures, engine.id.as_str()).inc();
    let limits = state.config.limits;
    let eject_for = {
        let mut o = engine.outlier.lock();
        o.consecutive += 1;
        if o.consecutive < limits.outlier_failures || !engine.healthy.load(Ordering::Relaxed) {
            return;
        }
        let others_in_rotation =
            state.engines.read().values().any(|e| e.id != engine.id && e.healthy.load(Ordering::Relaxed));
        if !others_in_rotation {
            return;
        }
        o.consecutive = 0;
        o.ejections = (o.ejections + 1).min(10);
        let eject_for = limits.outlier_ejection * o.ejections;
        o.ejected_until = Some(state.clock.instant() + eject_for);
        eject_for
    };
    Metrics::engine_counter(&state.metrics.ejections, engine.id.as_str()).inc();
    tracing::warn!(engine = %engine.id, failures = limits.outlier_failures, eject_s = eject_for.as_secs_f64(), "engine failed requests in a row: ejected");
    set_healthy(state, engine, false);
}

/// Counts a request the engine answered (any status but a server error).
pub fn request_succeeded(engine: &EngineHandle) {
    let mut o = engine.outlier.lock();
    o.consecutive = 0;
    if o.ejected_until.is_none() {
        o.ejections = 0;
    }
}

/// Whether an ejection still keeps the engine out (clearing it once it has run out).
fn ejected(state: &AppState, engine: &EngineHandle) -> bool {
    let mut o = engine.outlier.lock();
    match o.ejected_until {
        Some(until) if state.clock.instant() < until => true,
        Some(_) => {
            o.ejected_until = None;
            false
        }
        None => false,
    }
}

/// Drops the engine's KV view now and asks its subscribers to rebuild it from the replay socket.
pub fn resync(state: &AppState, engine: &EngineHandle, why: &str) {
    let _ = state.router.clear_kv(&engine.id);
    let kv = if engine.spec.kv_events.is_none() {
        engine.synced_state()
    } else {
        KvState::Incomplete(format!("{why}: rebuilding its KV view from its replay socket"))
    };
    let _ = state.router.set_kv_state(&engine.id, kv);
    engine.resync.send_modify(|g| *g += 1);
}

fn set_healthy(state: &AppState, engine: &EngineHandle, healthy: bool) {
    if engine.healthy.swap(healthy, Ordering::Relaxed) != healthy {
        if healthy {
            tracing::info!(engine = %engine.id, "engine healthy again: back in rotation");
            // It may have restarted while it was out: never credit the cache of the old process.
            resync(state, engine, "engine back in rotation");
        } else {
            tracing::warn!(engine = %engine.id, "engine unhealthy: out of rotation");
        }
    }
    let _ = state.router.set_eligible(&engine.id, healthy);
    if healthy {
        state.capacity.notify_waiters();
    }
}

/// Runs `work` every `every` (the first time at once) until the gateway is gone.
async fn periodically<F, Fut>(state: std::sync::Weak<AppState>, every: Duration, mut work: F)
where
    F: FnMut(Arc<AppState>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(s) = state.upgrade() else { return };
        work(s).await;
    }
}

async fn health_loop(state: std::sync::Weak<AppState>, engine: Arc<EngineHandle>) {
    let Some(every) = state.upgrade().map(|s| s.config.health_interval) else { return };
    let mut checks = 0u32;
    periodically(state, every, |s| {
        let refresh = checks.is_multiple_of(MODELS_EVERY);
        checks = checks.wrapping_add(1);
        let engine = engine.clone();
        async move { check_health(&s, &engine, refresh).await }
    })
    .await;
}

async fn load_loop(state: std::sync::Weak<AppState>, engine: Arc<EngineHandle>) {
    let Some(every) = state.upgrade().map(|s| s.config.poll_interval) else { return };
    periodically(state, every, |s| {
        let engine = engine.clone();
        async move { poll_load(&s, &engine).await }
    })
    .await;
}

async fn check_health(state: &AppState, engine: &EngineHandle, refresh_models: bool) {
    let timeout = state.config.health_interval.min(Duration::from_secs(5));
    let ok = match state.http.get(format!("{}/health", engine.base)).timeout(timeout).send().await {
        Ok(r) => r.status().is_success(),
        // The gateway is out of descriptors or ports: that says nothing about the engine.
        Err(e) if crate::error::is_local_resource_error(&e) => {
            state.metrics.local_resource_errors.inc();
            return;
        }
        Err(_) => false,
    };
    if ok {
        engine.failures.store(0, Ordering::Relaxed);
        if !ejected(state, engine) {
            set_healthy(state, engine, true);
        }
        if refresh_models || engine.models.lock().is_empty() {
            refresh_model_list(state, engine, timeout).await;
        }
    } else {
        let n = engine.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= state.config.failures_to_open {
            set_healthy(state, engine, false);
        }
    }
}

async fn refresh_model_list(state: &AppState, engine: &EngineHandle, timeout: Duration) {
    let Ok(resp) = state.http.get(format!("{}/v1/models", engine.base)).timeout(timeout).send().await else {
        return;
    };
    let Ok(body) = resp.json::<serde_json::Value>().await else {
        return;
    };
    let ids: Vec<String> = body
        .get("data")
        .and_then(|d| d.as_array())
        .map(|list| list.iter().filter_map(|m| m.get("id").and_then(|v| v.as_str()).map(str::to_owned)).collect())
        .unwrap_or_default();
    *engine.models.lock() = ids;
    let all: std::collections::BTreeSet<String> =
        state.engines.read().values().flat_map(|e| e.models.lock().clone()).collect();
    *state.models.write() = all;
}

async fn fetch(state: &AppState, url: String) -> Result<Vec<u8>, String> {
    let timeout = state.config.poll_interval.max(Duration::from_millis(200)).min(Duration::from_secs(5));
    let resp = state.http.get(&url).timeout(timeout).send().await.map_err(|e| format!("{url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("{url}: HTTP {}", resp.status()));
    }
    resp.bytes().await.map(|b| b.to_vec()).map_err(|e| format!("{url}: {e}"))
}

async fn poll_load(state: &AppState, engine: &EngineHandle) {
    let kinds: &[EngineKind] = match (engine.spec.engine, *engine.telemetry.lock()) {
        (EngineKind::Sglang, _) | (EngineKind::Auto, Some(EngineKind::Sglang)) => &[EngineKind::Sglang],
        (EngineKind::Vllm, _) | (EngineKind::Auto, Some(EngineKind::Vllm)) => &[EngineKind::Vllm],
        (EngineKind::Auto, _) => &[EngineKind::Sglang, EngineKind::Vllm],
    };
    let mut last_err = String::new();
    for kind in kinds {
        let result = match kind {
            EngineKind::Sglang => fetch(state, format!("{}/v1/loads", engine.base))
                .await
                .and_then(|b| parse_sglang_loads(&b).map_err(|e| e.to_string())),
            _ => fetch(state, format!("{}/metrics", engine.base))
                .await
                .and_then(|b| parse_prometheus(&String::from_utf8_lossy(&b)).map_err(|e| e.to_string())),
        };
        match result {
            Ok(load) => {
                *engine.telemetry.lock() = Some(*kind);
                *engine.telemetry_error.lock() = None;
                observe_identity(state, engine, &load);
                let snapshot = to_snapshot(state, &load);
                let _ = state.router.update_load(&engine.id, snapshot);
                return;
            }
            Err(e) => last_err = e,
        }
    }
    tracing::debug!(engine = %engine.id, error = %last_err, "load poll failed");
    *engine.telemetry_error.lock() = Some(last_err);
}

/// Acts on what a load report says about the engine itself: its block size (checked against the
/// gateway's), its KV capacity (used unless configured), and its process start time (a change is a
/// restart).
fn observe_identity(state: &AppState, engine: &EngineHandle, load: &EngineLoad) {
    let before = {
        let mut id = engine.identity.lock();
        let before = *id;
        id.start_time_s = load.process_start_time_s.or(id.start_time_s);
        id.block_size = load.block_size.or(id.block_size);
        id.capacity_tokens = load.kv_capacity_tokens.or(id.capacity_tokens);
        before
    };
    if let Some(bs) = load.block_size.filter(|b| before.block_size != Some(*b)) {
        let gateway = state.router.block_size();
        if bs != gateway {
            let problem = format!(
                "the engine reports block_size {bs} (vllm:cache_config_info) but kvgate's block_size is {gateway}: \
                 start kvgate with --block-size {bs}"
            );
            tracing::warn!(engine = %engine.id, "{problem}; no cache credit for it");
            *engine.config_problem.lock() = Some(problem.clone());
            let _ = state.router.clear_kv(&engine.id);
            let _ = state.router.set_kv_state(&engine.id, KvState::Invalid(problem));
        } else if engine.config_problem.lock().take().is_some() {
            resync(state, engine, "the engine's block size now matches");
        }
    }
    if let Some(tokens) = load.kv_capacity_tokens.filter(|t| *t > 0 && before.capacity_tokens != Some(*t)) {
        if engine.spec.kv_capacity_tokens.is_none() {
            let _ = state.router.set_kv_capacity(&engine.id, tokens);
        }
    }
    if let (Some(old), Some(new)) = (before.start_time_s, load.process_start_time_s) {
        if (old - new).abs() > 0.5 {
            tracing::info!(engine = %engine.id, old, new, "engine process restarted (process_start_time_seconds changed)");
            engine.stream.restarts.fetch_add(1, Ordering::Relaxed);
            resync(state, engine, "engine restarted");
        }
    }
}

/// The core's load snapshot from an engine's report; what the engine does not report is estimated
/// from counts (see `assumed_prompt_tokens` and `assumed_decode_tokens`).
pub fn to_snapshot(state: &AppState, load: &EngineLoad) -> LoadSnapshot {
    let per_waiting = load.waiting_uncached_tokens.is_none().then_some(state.config.assumed_prompt_tokens);
    let per_running = state.config.assumed_decode_tokens;
    LoadSnapshot {
        waiting_requests: load.waiting_requests,
        waiting_tokens: load
            .waiting_uncached_tokens
            .unwrap_or(load.waiting_requests.saturating_mul(state.config.assumed_prompt_tokens)),
        running_requests: load.running_requests,
        active_decode_tokens: load.running_requests.saturating_mul(per_running),
        kv_usage: load.kv_usage.unwrap_or(0.0),
        observed_at: state.clock.now(),
        // Neither engine reports the prefill left in its running batch, nor per-request decode work.
        estimated: Some(kvgate_core::CountEstimate {
            prompt_tokens_per_waiting: per_waiting,
            decode_tokens_per_running: per_running,
        }),
    }
}
