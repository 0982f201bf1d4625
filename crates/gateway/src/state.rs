//! The gateway's state, composed: the core router, the engine registry, the tokenizer, metrics and
//! the decision log. Background tasks get an [`EngineContext`] instead of all of it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use kvgate_core::{Decision, KvState, RequestId, Router, WorkerConfig, WorkerId};
use parking_lot::{Mutex, RwLock};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::clock::Clock;
use crate::config::{GatewayConfig, WorkerSpec};
use crate::metrics::Metrics;
use crate::registry::{EngineContext, EngineHandle, EngineRegistry, EngineSettings};
use crate::replicas::{Replicas, SharingContext};
use crate::tokenize::{PromptTokenizer, TokenizePool};
use crate::GatewayError;

/// One entry of the decision log.
#[derive(Debug, Clone, Serialize)]
pub struct LoggedDecision {
    /// Milliseconds since the gateway started.
    pub at_ms: u64,
    /// The API route that was called.
    pub endpoint: &'static str,
    /// The decision record (shadow counterfactuals included).
    pub decision: Decision,
    /// Of the decision's `prompt_tokens`, how many were estimated: the end of a prompt that no
    /// worker holds was left untokenized (`kvgate_tokenizer::routed`). Absent when all were counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_prompt_tokens: Option<u64>,
}

/// What the last reread of the workers file found, for `GET /admin/discovery` (see
/// [`crate::discovery`]).
#[derive(Debug, Clone, Default, Serialize)]
pub struct DiscoveryStatus {
    /// The watched file.
    pub path: Option<String>,
    /// Rereads so far (each one that found the content changed, or was asked for).
    pub reloads: u64,
    /// Engines the file manages now.
    pub workers: Vec<String>,
    /// Entries (or the whole file) that could not be used, and why.
    pub errors: Vec<String>,
}

/// Settings that can change at runtime besides the policy.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Runtime {
    /// See [`crate::config::ADMISSION_WAIT_S`].
    pub admission_wait_s: f64,
}

/// Everything the handlers share.
pub struct AppState {
    /// The configuration the gateway started with.
    pub config: GatewayConfig,
    /// Runtime-tunable settings.
    pub runtime: RwLock<Runtime>,
    /// The routing core.
    pub router: Arc<Router>,
    /// The clock the core's timestamps come from.
    pub clock: Clock,
    /// Registered engines and the models they serve.
    pub engines: Arc<EngineRegistry>,
    /// Prompt tokenizer.
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// The threads large prompts are tokenized on: one fewer than the cores (at least one), at a
    /// lower priority, so the async workers that serve every other connection always come first.
    pub tokenize_pool: TokenizePool,
    /// HTTP client for engines.
    pub http: reqwest::Client,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Recent decisions.
    pub decisions: Mutex<VecDeque<LoggedDecision>>,
    /// Next request id.
    pub next_request: AtomicU64,
    /// This process's own random tag, in every request id kvgate gives an engine
    /// ([`AppState::engine_request_id`]).
    pub request_tag: String,
    /// Requests waiting for capacity (bounded queueing).
    pub queued: AtomicUsize,
    /// Woken when capacity may have appeared (a request released its reservation, an engine came
    /// back), so queued requests decide again at once.
    pub capacity: Arc<tokio::sync::Notify>,
    /// Request body bytes that may be buffered at once, over all connections, in KiB.
    pub body_budget: Arc<tokio::sync::Semaphore>,
    /// Tie-breaking randomness.
    pub rng: Mutex<ChaCha8Rng>,
    /// What the workers file's last reread found.
    pub discovery: Mutex<DiscoveryStatus>,
    /// Notified to reread the workers file at once (SIGHUP, `POST /admin/discovery/reload`).
    pub discovery_reload: Arc<tokio::sync::Notify>,
    /// Reservation sharing with the other replicas.
    pub replicas: Arc<Replicas>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").field("engines", &self.engines.read().len()).finish_non_exhaustive()
    }
}

impl AppState {
    /// The id an engine is given for request `id` (`x-request-id` to an HTTP engine, the request id
    /// of a gRPC call): `kvgate-<tag>-<id>`, where `id` is the one `x-kvgate-request-id` and the
    /// decision log show. The tag is drawn at start so that no other kvgate process, a replica or
    /// this one restarted, gives an engine the same id: SGLang's gRPC servicer forgets a finished
    /// request's id 5 s after it ends, taking with it a new request of that id (which then never
    /// answers), and vLLM aborts every request of the id it is asked to abort.
    pub fn engine_request_id(&self, id: RequestId) -> String {
        format!("kvgate-{}-{}", self.request_tag, id.0)
    }
    /// Builds the state (no background tasks yet: [`crate::serve`] starts them).
    pub fn new(config: GatewayConfig) -> Result<Arc<Self>, GatewayError> {
        let router =
            Router::new(config.block_size, config.policy.clone()).map_err(|e| GatewayError::Config(e.to_string()))?;
        let tokenizer = crate::tokenize::build(&config.tokenizer, config.tokenize_cache_bytes)
            .map_err(|e| GatewayError::Config(e.to_string()))?;
        let mut engine_headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &config.worker_api_key {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| GatewayError::Config("worker_api_key: not a valid header value".into()))?;
            value.set_sensitive(true);
            engine_headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        let http = reqwest::Client::builder()
            // Every call to an engine (inference, health, load, models) carries the worker key.
            .default_headers(engine_headers)
            .connect_timeout(config.connect_timeout)
            // Engines close idle keep-alive connections themselves (uvicorn after 5 s); reusing one
            // they are about to close loses the request, so kvgate lets go first.
            .pool_idle_timeout(config.upstream_keepalive)
            .pool_max_idle_per_host(if config.upstream_keepalive.is_zero() { 0 } else { usize::MAX })
            .build()
            .map_err(|e| GatewayError::Config(format!("http client: {e}")))?;
        let tokenize_pool = TokenizePool::for_this_machine()
            .map_err(|e| GatewayError::Io(std::io::Error::other(format!("starting the tokenizing threads: {e}"))))?;
        let clock = Clock::start();
        let metrics = Arc::new(Metrics::new());
        let replicas = Arc::new(Replicas::new(config.replicas.clone(), metrics.replicas.clone()));
        let mut rng = ChaCha8Rng::seed_from_u64(crate::clock::entropy());
        let request_tag = format!("{:012x}", rng.next_u64() >> 16);
        let state = Arc::new(AppState {
            runtime: RwLock::new(Runtime { admission_wait_s: config.admission_wait_s }),
            router: Arc::new(router),
            clock,
            engines: Arc::new(EngineRegistry::default()),
            tokenizer,
            tokenize_pool,
            http,
            metrics,
            replicas,
            decisions: Mutex::new(VecDeque::new()),
            next_request: AtomicU64::new(1),
            request_tag,
            queued: AtomicUsize::new(0),
            capacity: Arc::new(tokio::sync::Notify::new()),
            body_budget: Arc::new(tokio::sync::Semaphore::new(config.limits.max_buffered_body_bytes.div_ceil(1024))),
            rng: Mutex::new(rng),
            discovery: Mutex::new(DiscoveryStatus::default()),
            discovery_reload: Arc::new(tokio::sync::Notify::new()),
            config,
        });
        for w in state.config.workers.clone() {
            state.add_engine(&w)?;
        }
        Ok(state)
    }

    /// Registers an engine (the caller starts its background task).
    pub fn add_engine(&self, spec: &WorkerSpec) -> Result<Arc<EngineHandle>, GatewayError> {
        spec.validate()?;
        if spec.is_grpc() && self.tokenizer.detokenizer(&[], true).is_none() {
            return Err(GatewayError::Config(format!(
                "worker {}: a gRPC worker answers with token ids, which the {} tokenizer cannot turn back into \
                 text: give the model's tokenizer (--tokenizer DIR or `tokenizer` in the configuration)",
                spec.id(),
                self.tokenizer.describe()
            )));
        }
        let id = WorkerId::new(spec.id());
        let mut wc = WorkerConfig::new(id.clone());
        wc.prefill_tokens_per_s = spec.prefill_tokens_per_s.unwrap_or(wc.prefill_tokens_per_s);
        wc.decode_tokens_per_s = spec.decode_tokens_per_s.unwrap_or(wc.decode_tokens_per_s);
        wc.kv_capacity_tokens = spec.kv_capacity_tokens.unwrap_or(wc.kv_capacity_tokens);
        wc.max_running_requests = spec.max_running_requests.unwrap_or(wc.max_running_requests);
        wc.chunk_tokens = spec.chunk_tokens.unwrap_or(wc.chunk_tokens);
        // No event stream yet: the worker holds no blocks, so it earns no credit either way, and
        // says so until its stream is up; a block-size mismatch is refused outright.
        let state = match spec.block_size {
            Some(b) if b != self.config.block_size => KvState::Invalid(format!(
                "engine block_size {b} differs from the gateway's block_size {}",
                self.config.block_size
            )),
            _ if spec.kv_events.is_some() || (spec.is_grpc() && spec.discover_kv_events != Some(false)) => {
                KvState::Incomplete("KV event stream not connected yet".into())
            }
            _ => KvState::Synced,
        };
        self.router.add_worker(wc, state).map_err(|e| match e {
            kvgate_core::CoreError::DuplicateWorker(id) => {
                GatewayError::Conflict(format!("worker {id} is already registered"))
            }
            other => GatewayError::Config(other.to_string()),
        })?;
        let handle = Arc::new(EngineHandle::new(
            id.clone(),
            spec.clone(),
            self.metrics.for_engine(id.as_str()),
            self.config.connect_timeout,
        ));
        self.engines.insert(handle.clone());
        Ok(handle)
    }

    /// Removes an engine; in-flight requests finish, but their reservations are dropped.
    pub fn remove_engine(&self, id: &WorkerId) -> Result<(), GatewayError> {
        let handle = self.engines.remove(id).ok_or_else(|| GatewayError::NotFound(format!("no worker named {id}")))?;
        handle.stop();
        self.router.remove_worker(id, self.clock.now()).map_err(|e| GatewayError::NotFound(e.to_string()))?;
        Ok(())
    }

    /// The engine handle of a worker.
    pub fn engine(&self, id: &WorkerId) -> Option<Arc<EngineHandle>> {
        self.engines.get(id)
    }

    /// What the engines' background tasks (and passive health) are given.
    pub fn engine_context(&self) -> EngineContext {
        EngineContext {
            router: self.router.clone(),
            clock: self.clock,
            http: self.http.clone(),
            metrics: self.metrics.clone(),
            registry: self.engines.clone(),
            capacity: self.capacity.clone(),
            settings: EngineSettings::from_config(&self.config),
        }
    }

    /// What the replica-sharing task is given.
    pub fn sharing_context(&self) -> SharingContext {
        SharingContext {
            router: self.router.clone(),
            clock: self.clock,
            replicas: self.replicas.clone(),
            capacity: self.capacity.clone(),
        }
    }

    /// Appends to the bounded decision log.
    pub fn log_decision(&self, endpoint: &'static str, decision: Decision, estimated_prompt_tokens: Option<u64>) {
        let cap = self.config.decision_log;
        if cap == 0 {
            return;
        }
        let mut log = self.decisions.lock();
        if log.len() >= cap {
            log.pop_front();
        }
        let at_ms = self.clock.now().as_micros() / 1000;
        log.push_back(LoggedDecision { at_ms, endpoint, decision, estimated_prompt_tokens });
    }
}

#[cfg(test)]
mod tests {
    use kvgate_core::RequestId;

    use super::AppState;
    use crate::config::GatewayConfig;

    /// Two gateway processes (replicas, or one restarted) never give an engine the same request
    /// id: each id carries its process's own tag beside the request's number.
    #[tokio::test]
    async fn engine_request_ids_carry_a_tag_of_their_own_process() {
        let state = || AppState::new(GatewayConfig::from_toml("").unwrap()).unwrap();
        let (one, other) = (state(), state());
        let (a, b) = (one.engine_request_id(RequestId(7)), other.engine_request_id(RequestId(7)));
        assert_ne!(a, b);
        for id in [&a, &b] {
            let tag = id.strip_prefix("kvgate-").and_then(|rest| rest.strip_suffix("-7")).unwrap();
            assert!(tag.len() == 12 && tag.bytes().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        assert_eq!(one.engine_request_id(RequestId(8)), format!("kvgate-{}-8", one.request_tag));
    }
}

#[cfg(test)]
mod doc_tests {
    use std::collections::BTreeSet;

    use kvgate_core::{Decision, FallbackReason, Mode, PolicyName, Reason, RequestId, ScoreTerms, WorkerId};
    use serde_json::Value;

    use super::LoggedDecision;

    /// The `| `field` |` rows of each `## ` section of docs/decisions.md.
    fn documented() -> Vec<(String, BTreeSet<String>)> {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/decisions.md")).unwrap();
        let mut sections: Vec<(String, BTreeSet<String>)> = Vec::new();
        for line in doc.lines() {
            if let Some(title) = line.strip_prefix("## ") {
                sections.push((title.to_owned(), BTreeSet::new()));
            } else if let (Some(field), Some((_, rows))) = (line.strip_prefix("| `"), sections.last_mut()) {
                rows.insert(field.split('`').next().unwrap_or_default().to_owned());
            }
        }
        sections
    }

    fn keys(v: &Value) -> BTreeSet<String> {
        v.as_object().expect("an object").keys().cloned().collect()
    }

    /// Every field a decision log entry can carry (each optional one present) is in
    /// docs/decisions.md, in the section for its level, and the page lists no other.
    #[test]
    fn decisions_doc_lists_every_record_field() {
        let score = ScoreTerms {
            worker: WorkerId::new("a"),
            projected_s: 0.5,
            cost_s: 0.5,
            cached_tokens: 0,
            wait_s: 0.1,
            decode_s: 0.1,
            prefill_s: 0.3,
            barrier_s: 0.0,
            batch_delay_s: 0.0,
            load_only_s: 0.5,
            waiting_requests: 1,
            prefill_tokens_per_s: 1.0,
            decode_tokens_per_s: 1.0,
            credit_withheld: Some(FallbackReason::Stale),
        };
        let decision = Decision {
            request: RequestId(1),
            policy: PolicyName::Projected,
            mode: Mode::Enforce,
            worker: WorkerId::new("a"),
            reason: Reason::LoadOnly,
            load_only_worker: WorkerId::new("a"),
            enforce_worker: Some(WorkerId::new("a")),
            enforce_reason: Some(Reason::LoadOnly),
            prompt_tokens: 10,
            cached_tokens: 0,
            prefill_weight: 1.0,
            scores: vec![score],
        };
        let entry =
            LoggedDecision { at_ms: 1, endpoint: "/v1/completions", decision, estimated_prompt_tokens: Some(3) };
        let v = serde_json::to_value(&entry).unwrap();
        let sections = documented();
        let section = |title: &str| {
            sections
                .iter()
                .find(|(t, _)| t == title)
                .unwrap_or_else(|| panic!("docs/decisions.md lacks ## {title}"))
                .1
                .clone()
        };
        assert_eq!(section("The log entry"), keys(&v));
        assert_eq!(section("The decision"), keys(&v["decision"]));
        assert_eq!(section("Each engine's score"), keys(&v["decision"]["scores"][0]));
    }
}
