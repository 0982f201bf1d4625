//! The engine registry: each engine's handle (what the gateway knows of it besides the core's view),
//! the registry of them all, and what the engines' background tasks are given.
//!
//! Health checks, load polls and KV-event subscribers take an [`EngineContext`]: the router, the
//! clock, the HTTP client, the metrics, the registry and their settings, and nothing else. They never
//! hold the whole gateway state, so `engines` and `kv_events` depend on this module, not on `state`,
//! and `state` only composes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::{KvState, Router, WorkerId};
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use serde::Serialize;
use tokio::sync::Notify;

use crate::clock::Clock;
use crate::config::{EngineKind, GatewayConfig, Limits, WorkerSpec};
use crate::metrics::Metrics;
use kvgate_tokenizer::request::Endpoint;

/// Passive health: what the engine's answers to real requests say (Envoy's outlier detection).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Outlier {
    /// Upstream failures in a row.
    pub(crate) consecutive: u32,
    /// Ejections in a row (no success in between); each lengthens the next.
    pub(crate) ejections: u32,
    /// Out of rotation until then, whatever `/health` says.
    pub(crate) ejected_until: Option<std::time::Instant>,
}

/// What an engine has said about itself in its load reports.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Identity {
    pub(crate) start_time_s: Option<f64>,
    pub(crate) block_size: Option<u32>,
    pub(crate) capacity_tokens: Option<u64>,
    pub(crate) max_running_requests: Option<u64>,
    /// The longest sequence (prompt and output) its model takes, where it says (a gRPC worker's
    /// `GetModelInfo`).
    pub(crate) max_context_tokens: Option<u64>,
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
    /// Consecutive failed health checks (a refused connect counts as one until the engine is seen up).
    pub failures: AtomicU32,
    /// Whether the circuit is closed (health checks pass).
    pub healthy: AtomicBool,
    /// Whether a health check has ever passed. Until one has, a check the engine fails (an answer
    /// other than 2xx, a refused connect; not a timeout) or a refused request takes it out at once:
    /// `failures_to_open` shields an engine that has served from a blip, and one that was never up
    /// has nothing to shield.
    pub seen_up: AtomicBool,
    /// Which load endpoint worked last.
    pub telemetry: Mutex<Option<EngineKind>>,
    /// The last load poll's error, if it failed.
    pub telemetry_error: Mutex<Option<String>>,
    /// Models the engine reports.
    pub models: Mutex<Vec<String>>,
    /// Counters of the engine's KV event stream.
    pub stream: Arc<StreamStats>,
    /// Bumped whenever the KV view must be rebuilt from scratch; the subscribers watch it.
    pub resync: tokio::sync::watch::Sender<u64>,
    /// Why the engine's KV events can't be used at all (a block-size mismatch), if they can't.
    pub config_problem: Mutex<Option<String>>,
    /// The KV-event settings the engine announced (`GET /server_info`), for an engine configured
    /// without `kv_events`; `Some(None)` once it said it publishes none.
    pub discovered: Mutex<Option<Option<WorkerSpec>>>,
    /// Whether the engine's `GET /server_info` was read since it last came (back) into rotation:
    /// an SGLang engine publishes its page size and KV capacity there, and a restarted one may
    /// come back with other settings.
    pub server_info_read: AtomicBool,
    /// Its metric series.
    pub metrics: crate::metrics::EngineMetrics,
    pub(crate) identity: Mutex<Identity>,
    pub(crate) outlier: Mutex<Outlier>,
    /// The gRPC worker behind a `grpc://` URL (`None`: an HTTP engine).
    pub grpc: Option<crate::grpc_worker::GrpcWorker>,
    /// Why the gRPC worker refused its KV event stream (it has no publisher to relay), if it did:
    /// the worker is then routed on load alone until it comes back into rotation.
    pub grpc_events_refused: Mutex<Option<String>>,
    /// The engine's URL of each inference route, parsed once.
    routes: Vec<(Endpoint, reqwest::Url)>,
    pub(crate) tasks: Mutex<Vec<tokio::task::AbortHandle>>,
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
    /// A health check has passed at least once since the engine was registered.
    pub seen_up: bool,
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
    /// The largest running batch the engine reports admitting (SGLang `max_running_requests`): the
    /// slot limit kvgate plans with for it.
    pub engine_max_running_requests: Option<u64>,
    /// When the engine process started (Unix seconds), if it says.
    pub engine_started_at_s: Option<f64>,
    /// The core's view: reconciled load, KV state, blocks held, reservations.
    pub router: Option<kvgate_core::WorkerStatus>,
    /// Last KV-event sequence number applied.
    pub last_event_seq: Option<u64>,
    /// The KV event stream's counters (absent without a `kv_events` endpoint).
    pub kv_events: Option<StreamView>,
}

impl EngineHandle {
    /// A handle for a freshly registered engine (in rotation until proven otherwise);
    /// `connect_timeout` bounds a gRPC worker's connection attempts.
    pub fn new(
        id: WorkerId,
        spec: WorkerSpec,
        metrics: crate::metrics::EngineMetrics,
        connect_timeout: std::time::Duration,
    ) -> Self {
        let base = spec.url.trim_end_matches('/').to_owned();
        let grpc = spec.grpc_worker(connect_timeout);
        let routes = Endpoint::ALL
            .iter()
            .filter_map(|e| reqwest::Url::parse(&format!("{base}{}", e.path())).ok().map(|u| (*e, u)))
            .collect();
        EngineHandle {
            id,
            base,
            metrics,
            routes,
            grpc,
            spec,
            failures: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            seen_up: AtomicBool::new(false),
            telemetry: Mutex::new(None),
            telemetry_error: Mutex::new(None),
            models: Mutex::new(Vec::new()),
            stream: Arc::new(StreamStats::new()),
            resync: tokio::sync::watch::Sender::new(0),
            config_problem: Mutex::new(None),
            discovered: Mutex::new(None),
            grpc_events_refused: Mutex::new(None),
            server_info_read: AtomicBool::new(false),
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

    /// The settings its KV events come with: the configured ones, or those the engine announced.
    pub fn kv_spec(&self) -> Option<WorkerSpec> {
        if self.spec.kv_events.is_some() {
            return Some(self.spec.clone());
        }
        self.discovered.lock().clone().flatten()
    }

    /// Whether it has a KV event stream (configured, announced, or its gRPC worker's own).
    pub fn has_kv_events(&self) -> bool {
        self.spec.kv_events.is_some()
            || matches!(*self.discovered.lock(), Some(Some(_)))
            || (self.subscribes_over_grpc() && self.grpc_events_refused.lock().is_none())
    }

    /// Whether its KV events come from its gRPC worker's own stream (`SubscribeKvEvents`): a gRPC
    /// worker without a configured ZMQ `kv_events` endpoint, unless `discover_kv_events = false`.
    pub fn subscribes_over_grpc(&self) -> bool {
        self.grpc.is_some() && self.spec.kv_events.is_none() && self.spec.discover_kv_events != Some(false)
    }

    /// Whether it is (or reports like) an SGLang engine, which describes itself in `/server_info`.
    pub fn is_sglang(&self) -> bool {
        self.spec.engine == EngineKind::Sglang
            || (self.spec.engine == EngineKind::Auto && *self.telemetry.lock() == Some(EngineKind::Sglang))
    }

    /// Whether its `GET /server_info` should be read now: to learn where it publishes KV events,
    /// or, for an SGLang engine, its page size and capacity since it last came into rotation.
    pub fn wants_server_info(&self) -> bool {
        self.grpc.is_none()
            && (self.wants_kv_discovery() || (self.is_sglang() && !self.server_info_read.load(Ordering::Relaxed)))
    }

    /// Whether its `GET /server_info` should still be asked where it publishes KV events.
    pub fn wants_kv_discovery(&self) -> bool {
        self.grpc.is_none()
            && self.spec.kv_events.is_none()
            && self.spec.discover_kv_events.unwrap_or(self.spec.engine != EngineKind::Vllm)
            && self.discovered.lock().is_none()
    }

    /// A snapshot for the admin API.
    pub fn view(&self, ctx: &EngineContext) -> EngineView {
        let identity = *self.identity.lock();
        let outlier = *self.outlier.lock();
        EngineView {
            id: self.id.clone(),
            url: self.spec.display_url(),
            healthy: self.healthy.load(Ordering::Relaxed),
            seen_up: self.seen_up.load(Ordering::Relaxed),
            consecutive_failures: self.failures.load(Ordering::Relaxed),
            consecutive_request_failures: outlier.consecutive,
            ejected_for_s: outlier.ejected_until.and_then(|u| {
                let left = u.saturating_duration_since(ctx.clock.instant());
                (!left.is_zero()).then_some(left.as_secs_f64())
            }),
            telemetry: *self.telemetry.lock(),
            telemetry_error: self.telemetry_error.lock().clone(),
            models: self.models.lock().clone(),
            engine_block_size: identity.block_size,
            engine_kv_capacity_tokens: identity.capacity_tokens,
            engine_max_running_requests: identity.max_running_requests,
            engine_started_at_s: identity.start_time_s,
            router: ctx.router.worker_status(&self.id, ctx.clock.now()).ok(),
            last_event_seq: self.stream.view().last_seq,
            kv_events: self.has_kv_events().then(|| self.stream.view()),
        }
    }
}

/// Counters of one engine's event stream.
#[derive(Debug, Default)]
pub struct StreamStats {
    /// Last sequence number applied (`u64::MAX`: none yet).
    pub last_seq: AtomicU64,
    /// Batches applied.
    pub batches: AtomicU64,
    /// Events applied.
    pub events: AtomicU64,
    /// Gaps seen (each triggers a replay).
    pub gaps: AtomicU64,
    /// Replays requested.
    pub replays: AtomicU64,
    /// Replays that could not return the history asked for.
    pub history_lost: AtomicU64,
    /// Restarts detected.
    pub restarts: AtomicU64,
    /// The sequence number this subscriber joined the stream at, when it joined after the engine
    /// had published and no replay socket could supply the batches before (`u64::MAX`: it did not):
    /// blocks stored before then are unknown, so credit can only be under-reported.
    pub joined_at_seq: AtomicU64,
    /// Messages or events that could not be decoded.
    pub decode_errors: AtomicU64,
    /// Connection attempts that failed.
    pub connect_failures: AtomicU64,
    /// Times a gRPC worker's event stream (`SubscribeKvEvents`) was opened again after it was lost:
    /// each new subscription starts from an empty view, as the protocol keeps no history.
    pub resubscribes: AtomicU64,
    /// Load records the worker pushed on its gRPC event stream and the gateway took.
    pub loads_pushed: AtomicU64,
    /// The events come over the worker's gRPC stream, not a ZMQ publisher.
    pub over_grpc: AtomicBool,
}

/// A snapshot of [`StreamStats`] for the admin API.
#[derive(Debug, Clone, Serialize)]
pub struct StreamView {
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
    /// Batches applied.
    pub batches: u64,
    /// Events applied.
    pub events: u64,
    /// Gaps seen.
    pub gaps: u64,
    /// Replays requested.
    pub replays: u64,
    /// Replays that lost history.
    pub history_lost: u64,
    /// Restarts detected.
    pub restarts: u64,
    /// See [`StreamStats::joined_at_seq`].
    pub joined_at_seq: Option<u64>,
    /// Undecodable messages or events.
    pub decode_errors: u64,
    /// Failed connection attempts.
    pub connect_failures: u64,
    /// Where the events come from: `zmq` (the engine's publisher) or `grpc` (the worker's
    /// `SubscribeKvEvents`).
    pub transport: &'static str,
    /// See [`StreamStats::resubscribes`].
    pub resubscribes: u64,
    /// See [`StreamStats::loads_pushed`].
    pub loads_pushed: u64,
}

impl StreamStats {
    /// Fresh counters.
    pub fn new() -> Self {
        let s = StreamStats::default();
        s.last_seq.store(u64::MAX, Ordering::Relaxed);
        s.joined_at_seq.store(u64::MAX, Ordering::Relaxed);
        s
    }

    /// The counters now.
    pub fn view(&self) -> StreamView {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let last = g(&self.last_seq);
        let joined = g(&self.joined_at_seq);
        StreamView {
            last_seq: (last != u64::MAX).then_some(last),
            batches: g(&self.batches),
            events: g(&self.events),
            gaps: g(&self.gaps),
            replays: g(&self.replays),
            history_lost: g(&self.history_lost),
            restarts: g(&self.restarts),
            joined_at_seq: (joined != u64::MAX).then_some(joined),
            decode_errors: g(&self.decode_errors),
            connect_failures: g(&self.connect_failures),
            transport: if self.over_grpc.load(Ordering::Relaxed) { "grpc" } else { "zmq" },
            resubscribes: g(&self.resubscribes),
            loads_pushed: g(&self.loads_pushed),
        }
    }
}

/// The registered engines, by id, and the models they serve.
#[derive(Debug, Default)]
pub struct EngineRegistry {
    engines: RwLock<BTreeMap<WorkerId, Arc<EngineHandle>>>,
    models: RwLock<BTreeSet<String>>,
}

impl EngineRegistry {
    /// The engines, locked for reading (hold the guard briefly).
    pub fn read(&self) -> RwLockReadGuard<'_, BTreeMap<WorkerId, Arc<EngineHandle>>> {
        self.engines.read()
    }

    /// One engine.
    pub fn get(&self, id: &WorkerId) -> Option<Arc<EngineHandle>> {
        self.engines.read().get(id).cloned()
    }

    /// Every engine, in id order.
    pub fn all(&self) -> Vec<Arc<EngineHandle>> {
        self.engines.read().values().cloned().collect()
    }

    /// How many are registered.
    pub fn len(&self) -> usize {
        self.engines.read().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.engines.read().is_empty()
    }

    pub(crate) fn insert(&self, handle: Arc<EngineHandle>) {
        self.engines.write().insert(handle.id.clone(), handle);
    }

    pub(crate) fn remove(&self, id: &WorkerId) -> Option<Arc<EngineHandle>> {
        let removed = self.engines.write().remove(id);
        self.refresh_models();
        removed
    }

    /// Whether an engine other than `id` is in rotation.
    pub fn others_in_rotation(&self, id: &WorkerId) -> bool {
        self.engines.read().values().any(|e| &e.id != id && e.healthy.load(Ordering::Relaxed))
    }

    /// The models the engines serve (the union), locked for reading.
    pub fn models(&self) -> RwLockReadGuard<'_, BTreeSet<String>> {
        self.models.read()
    }

    /// Recomputes the union of the engines' models.
    pub(crate) fn refresh_models(&self) {
        let all: BTreeSet<String> = self.engines.read().values().flat_map(|e| e.models.lock().clone()).collect();
        *self.models.write() = all;
    }
}

/// The settings of the engines' background tasks.
#[derive(Debug, Clone, Copy)]
pub struct EngineSettings {
    /// See [`GatewayConfig::health_interval`].
    pub health_interval: Duration,
    /// See [`GatewayConfig::poll_interval`].
    pub poll_interval: Duration,
    /// See [`GatewayConfig::failures_to_open`].
    pub failures_to_open: u32,
    /// See [`GatewayConfig::assumed_prompt_tokens`].
    pub assumed_prompt_tokens: u64,
    /// See [`GatewayConfig::assumed_decode_tokens`].
    pub assumed_decode_tokens: u64,
    /// Passive health among them.
    pub limits: Limits,
    /// See [`GatewayConfig::block_size`].
    pub block_size: u32,
}

impl EngineSettings {
    /// The settings from the gateway's configuration.
    pub fn from_config(c: &GatewayConfig) -> Self {
        EngineSettings {
            health_interval: c.health_interval,
            poll_interval: c.poll_interval,
            failures_to_open: c.failures_to_open,
            assumed_prompt_tokens: c.assumed_prompt_tokens,
            assumed_decode_tokens: c.assumed_decode_tokens,
            limits: c.limits,
            block_size: c.block_size,
        }
    }
}

/// What an engine's background tasks (and passive health on the request path) use.
#[derive(Debug, Clone)]
pub struct EngineContext {
    /// The routing core.
    pub router: Arc<Router>,
    /// The clock the core's timestamps come from.
    pub clock: Clock,
    /// The HTTP client for engines.
    pub http: reqwest::Client,
    /// The gateway's metrics.
    pub metrics: Arc<Metrics>,
    /// Every engine, for what concerns them all (models, who else is in rotation).
    pub registry: Arc<EngineRegistry>,
    /// Woken when an engine comes back into rotation, so queued requests decide again.
    pub capacity: Arc<Notify>,
    /// Intervals, thresholds and estimates.
    pub settings: EngineSettings,
}
