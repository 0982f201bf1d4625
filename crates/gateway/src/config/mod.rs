//! Gateway configuration: a TOML file, overridden by flags and environment ([`Overrides`], which
//! the binary parses as they are), validated as a whole. Every bound is checked with a message
//! naming the key.

use std::path::Path;
use std::time::Duration;

use kvgate_core::policy::Knob;
use kvgate_core::{PolicyConfig, PolicyPatch, BLOCK_SIZE};
use serde::{Deserialize, Serialize};

use crate::GatewayError;

mod limits;
mod overrides;
mod replicas;
mod worker;

pub use limits::*;
pub use overrides::Overrides;
pub use replicas::{
    ReplicasConfig, DEFAULT_SUBJECT, REPLICA_EXPIRY_MS, REPLICA_FLUSH_MS, REPLICA_LAZY_FLUSH_MS, REPLICA_STAGGER_MS,
    REPLICA_STATE_INTERVAL_MS,
};
pub use worker::{rank_endpoint, redact_url, EngineKind, WorkerSpec};

/// Which tokenizer renders and tokenizes prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TokenizerSpec {
    /// kvgate's built-in tokenizer: no files, deterministic; matches kvgate's mock engine.
    #[default]
    Builtin,
    /// A HuggingFace `tokenizer.json`, with the chat template from `tokenizer_config.json` (or a
    /// Jinja file).
    Hf {
        /// Path to `tokenizer.json`.
        path: String,
        /// Path to `tokenizer_config.json` or to a `.jinja` chat template (default: found beside
        /// `tokenizer.json`, as `transformers` saves it).
        #[serde(default)]
        chat_template: Option<String>,
        /// `auto` (detect from the template, as vLLM does), `string` or `openai`: vLLM's
        /// `--chat-template-content-format`.
        #[serde(default)]
        content_format: Option<String>,
        /// Whose way of rendering a request into prompt ids to reproduce: `vllm`, `sglang`, or
        /// `auto` (the default: `sglang` when every configured HTTP worker is `engine = "sglang"`,
        /// else `vllm`), resolved when the configuration is read.
        #[serde(default)]
        render: Option<String>,
    },
}

impl TokenizerSpec {
    /// Resolves `render = "auto"` (or unset) against the configured workers, and checks the value.
    pub(crate) fn resolve_render(&mut self, workers: &[WorkerSpec]) -> Result<(), GatewayError> {
        self.resolve_render_detected(workers, &[])
    }

    /// [`Self::resolve_render`], with the runtimes gRPC workers that name none were seen to run.
    /// `auto` is `sglang` when every worker whose runtime is known runs SGLang: HTTP workers by
    /// their `engine` (unset counts as not SGLang), gRPC workers by their `engine` or by
    /// `detected`.
    pub(crate) fn resolve_render_detected(
        &mut self,
        workers: &[WorkerSpec],
        detected: &[EngineKind],
    ) -> Result<(), GatewayError> {
        let TokenizerSpec::Hf { render, .. } = self else { return Ok(()) };
        let resolved = match render.as_deref() {
            None | Some("auto") => {
                let known: Vec<EngineKind> = workers
                    .iter()
                    .filter(|w| !w.is_grpc() || w.engine != EngineKind::Auto)
                    .map(|w| w.engine)
                    .chain(detected.iter().copied())
                    .collect();
                if !known.is_empty() && known.iter().all(|k| *k == EngineKind::Sglang) {
                    "sglang"
                } else {
                    "vllm"
                }
            }
            Some(r @ ("vllm" | "sglang")) => r,
            Some(other) => {
                return Err(GatewayError::Config(format!(
                    "tokenizer render {other:?} is not one of auto, vllm or sglang"
                )))
            }
        };
        *render = Some(resolved.to_owned());
        Ok(())
    }
}

/// The `[server]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServerTable {
    host: Option<String>,
    port: Option<u16>,
    max_body_bytes: Option<usize>,
    tokenize_cache_mib: Option<u64>,
    tokenize_whole: Option<bool>,
    tokenize_check_interval_ms: Option<u64>,
    request_timeout_s: Option<f64>,
    connect_timeout_ms: Option<u64>,
    upstream_keepalive_ms: Option<u64>,
    shutdown_grace_s: Option<f64>,
    block_size: Option<u32>,
    decision_log: Option<usize>,
    header_timeout_ms: Option<u64>,
    header_timeout_min_ms: Option<u64>,
    body_timeout_s: Option<f64>,
    max_connections: Option<usize>,
    max_buffered_body_bytes: Option<usize>,
    stream_idle_timeout_s: Option<f64>,
}

/// The gateway's own keys in the `[policy]` table; the rest is a [`PolicyPatch`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmissionKeys {
    admission_wait_s: Option<f64>,
    queue_timeout_ms: Option<u64>,
    max_queued: Option<usize>,
}

/// Splits `[policy]` into the routing knobs and the gateway's admission keys.
fn split_policy(mut table: toml::Table) -> Result<(PolicyPatch, AdmissionKeys), GatewayError> {
    let mut admission = toml::Table::new();
    for key in ["admission_wait_s", "queue_timeout_ms", "max_queued"] {
        if let Some(v) = table.remove(key) {
            admission.insert(key.to_owned(), v);
        }
    }
    let bad = |e: toml::de::Error| GatewayError::Config(format!("[policy]: {}", e.message()));
    Ok((table.try_into().map_err(bad)?, admission.try_into().map_err(bad)?))
}

/// The `[telemetry]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TelemetryTable {
    poll_interval_ms: Option<u64>,
    health_interval_ms: Option<u64>,
    failures_to_open: Option<u32>,
    assumed_prompt_tokens: Option<u64>,
    assumed_decode_tokens: Option<u64>,
    outlier_failures: Option<u32>,
    outlier_ejection_s: Option<f64>,
}

/// The `[discovery]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DiscoveryTable {
    workers_file: Option<String>,
    workers_file_poll_ms: Option<u64>,
}

/// The `[security]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SecurityTable {
    #[serde(default)]
    api_keys: Vec<String>,
    admin_key: Option<String>,
    worker_api_key: Option<String>,
}

/// The whole TOML file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    server: ServerTable,
    #[serde(default)]
    policy: toml::Table,
    #[serde(default)]
    telemetry: TelemetryTable,
    #[serde(default)]
    security: SecurityTable,
    #[serde(default)]
    discovery: DiscoveryTable,
    #[serde(default)]
    replicas: replicas::ReplicasTable,
    tokenizer: Option<TokenizerSpec>,
    #[serde(default)]
    workers: Vec<WorkerSpec>,
}

/// See [`GatewayConfig::workers_file_poll`].
pub const WORKERS_FILE_POLL_MS: Knob = Knob {
    name: "workers_file_poll_ms",
    min: 100.0,
    max: 3_600_000.0,
    default: 2000.0,
    meaning: "how often the workers file is checked for changes (SIGHUP rereads it at once)",
};
/// Bounds of the gateway's own settings.
pub const MAX_BODY_BYTES: Knob = Knob {
    name: "max_body_bytes",
    min: 1024.0,
    max: 1_073_741_824.0,
    default: 8_388_608.0,
    meaning: "largest request body accepted; larger ones get 413",
};
/// See [`GatewayConfig::tokenize_cache_bytes`].
pub const TOKENIZE_CACHE_MIB: Knob = Knob {
    name: "tokenize_cache_mib",
    min: 0.0,
    max: 65_536.0,
    default: 64.0,
    meaning: "memory for the token ids of long prompts' chunks, reused by later prompts that repeat the text (a HuggingFace tokenizer's; 0 turns it off)",
};
/// See [`GatewayConfig::tokenize_check_interval`].
pub const TOKENIZE_CHECK_INTERVAL_MS: Knob = Knob {
    name: "tokenize_check_interval_ms",
    min: 0.0,
    max: 86_400_000.0,
    default: 1000.0,
    meaning: "at most once in this long, a prompt that was routed on its start is then tokenized whole, off the request path, to measure the estimate of its rest (kvgate_tokenize_estimate_ratio); 0 never",
};
/// See [`GatewayConfig::admission_wait_s`].
pub const ADMISSION_WAIT_S: Knob = Knob {
    name: "admission_wait_s",
    min: 0.0,
    max: 3600.0,
    default: 30.0,
    meaning: "429 when the chosen worker's projected queue (wait + decode) exceeds this; 0 disables",
};
/// See [`GatewayConfig::queue_timeout`].
pub const QUEUE_TIMEOUT_MS: Knob = Knob {
    name: "queue_timeout_ms",
    min: 0.0,
    max: 600_000.0,
    default: 0.0,
    meaning: "how long a request may wait for an eligible worker or for admission before 503/429; 0 answers at once",
};
/// See [`GatewayConfig::max_queued`].
pub const MAX_QUEUED: Knob = Knob {
    name: "max_queued",
    min: 0.0,
    max: 1_000_000.0,
    default: 1024.0,
    meaning: "requests that may wait at once when queue_timeout_ms > 0",
};
/// See [`GatewayConfig::request_timeout`].
pub const REQUEST_TIMEOUT_S: Knob = Knob {
    name: "request_timeout_s",
    min: 1.0,
    max: 86_400.0,
    default: 600.0,
    meaning: "longest wait for an engine's response headers, and for the whole body of a response that does not stream, before 504",
};
/// See [`GatewayConfig::connect_timeout`].
pub const CONNECT_TIMEOUT_MS: Knob = Knob {
    name: "connect_timeout_ms",
    min: 10.0,
    max: 60_000.0,
    default: 2000.0,
    meaning: "TCP connect timeout to an engine; a failed connect is retried on another worker",
};
/// See [`GatewayConfig::upstream_keepalive`].
pub const UPSTREAM_KEEPALIVE_MS: Knob = Knob {
    name: "upstream_keepalive_ms",
    min: 0.0,
    max: 3_600_000.0,
    default: 4000.0,
    meaning: "how long an idle connection to an engine is kept for reuse; keep it below the engine's own keep-alive (vLLM and SGLang: 5 s), or a request can be sent on a connection the engine is closing; 0 opens one per request",
};
/// See [`GatewayConfig::poll_interval`].
pub const POLL_INTERVAL_MS: Knob = Knob {
    name: "poll_interval_ms",
    min: 50.0,
    max: 60_000.0,
    default: 500.0,
    meaning: "how often each engine's load is polled",
};
/// See [`GatewayConfig::health_interval`].
pub const HEALTH_INTERVAL_MS: Knob = Knob {
    name: "health_interval_ms",
    min: 100.0,
    max: 60_000.0,
    default: 2000.0,
    meaning: "how often each engine's /health is checked",
};
/// See [`GatewayConfig::failures_to_open`].
pub const FAILURES_TO_OPEN: Knob = Knob {
    name: "failures_to_open",
    min: 1.0,
    max: 100.0,
    default: 3.0,
    meaning: "consecutive failed health checks that take a worker out of rotation",
};
/// See [`GatewayConfig::shutdown_grace`].
pub const SHUTDOWN_GRACE_S: Knob = Knob {
    name: "shutdown_grace_s",
    min: 0.0,
    max: 3600.0,
    default: 30.0,
    meaning: "how long in-flight streams may drain after a shutdown signal",
};
/// See [`GatewayConfig::decision_log`].
pub const DECISION_LOG: Knob = Knob {
    name: "decision_log",
    min: 0.0,
    max: 1_000_000.0,
    default: 1000.0,
    meaning: "recent decisions kept for GET /admin/decisions",
};
pub use kvgate_core::telemetry::{ASSUMED_DECODE_TOKENS, ASSUMED_PROMPT_TOKENS};

/// The gateway's validated configuration.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Listen address.
    pub host: String,
    /// Listen port (0: any free port).
    pub port: u16,
    /// The routing policy and its knobs.
    pub policy: PolicyConfig,
    /// Fleet block size (must equal the engines').
    pub block_size: u32,
    /// See [`ADMISSION_WAIT_S`].
    pub admission_wait_s: f64,
    /// See [`QUEUE_TIMEOUT_MS`].
    pub queue_timeout: Duration,
    /// See [`MAX_QUEUED`].
    pub max_queued: usize,
    /// Engines at start-up.
    pub workers: Vec<WorkerSpec>,
    /// Tokenizer.
    pub tokenizer: TokenizerSpec,
    /// No tokenizer was configured: with gRPC workers, take the model's from one of them at
    /// start-up (`crate::worker_tokenizer::resolve`); without, the built-in one.
    pub tokenizer_from_workers: bool,
    /// Client API keys (empty: no client authentication).
    pub api_keys: Vec<String>,
    /// Admin key (none: admin routes are open; a warning is logged).
    pub admin_key: Option<String>,
    /// A file of engines to watch (`[discovery] workers_file`): reread on change and on SIGHUP,
    /// adding and draining its engines beside the configured ones.
    pub workers_file: Option<std::path::PathBuf>,
    /// How often the workers file is checked for changes.
    pub workers_file_poll: Duration,
    /// Key sent to every engine as `Authorization: Bearer KEY`: `[security] worker_api_key`, or
    /// the one client key when exactly one is configured (as SMG's `--api-key` does); `""` sends
    /// none.
    pub worker_api_key: Option<String>,
    /// See [`MAX_BODY_BYTES`].
    pub max_body_bytes: usize,
    /// See [`TOKENIZE_CACHE_MIB`]; in bytes.
    pub tokenize_cache_bytes: usize,
    /// Tokenize every prompt whole, even where routing needs only its start (`[server]
    /// tokenize_whole`, `--tokenize-whole`); off by default ([`kvgate_tokenizer::routed`]).
    pub tokenize_whole: bool,
    /// See [`TOKENIZE_CHECK_INTERVAL_MS`]; zero: never.
    pub tokenize_check_interval: Duration,
    /// See [`REQUEST_TIMEOUT_S`].
    pub request_timeout: Duration,
    /// See [`CONNECT_TIMEOUT_MS`].
    pub connect_timeout: Duration,
    /// See [`UPSTREAM_KEEPALIVE_MS`].
    pub upstream_keepalive: Duration,
    /// See [`POLL_INTERVAL_MS`].
    pub poll_interval: Duration,
    /// See [`HEALTH_INTERVAL_MS`].
    pub health_interval: Duration,
    /// See [`FAILURES_TO_OPEN`].
    pub failures_to_open: u32,
    /// See [`SHUTDOWN_GRACE_S`].
    pub shutdown_grace: Duration,
    /// See [`DECISION_LOG`].
    pub decision_log: usize,
    /// See [`ASSUMED_PROMPT_TOKENS`].
    pub assumed_prompt_tokens: u64,
    /// See [`ASSUMED_DECODE_TOKENS`].
    pub assumed_decode_tokens: u64,
    /// Timeouts, caps and passive health.
    pub limits: Limits,
    /// Reservation sharing with the other replicas (`[replicas]`); `None`: this replica decides alone.
    pub replicas: Option<ReplicasConfig>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig::build(FileConfig::default(), Overrides::default()).expect("defaults are valid")
    }
}

fn check(knob: Knob, v: f64) -> Result<f64, GatewayError> {
    knob.check(v).map_err(|e| GatewayError::Config(e.to_string()))
}

fn pick<T: Copy + Into<f64>>(knob: Knob, value: Option<T>) -> Result<f64, GatewayError> {
    check(knob, value.map_or(knob.default, Into::into))
}

impl GatewayConfig {
    /// Reads `path` (if any), applies `overrides`, and validates.
    pub fn load(path: Option<&Path>, overrides: Overrides) -> Result<Self, GatewayError> {
        let file = match path {
            None => FileConfig::default(),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| GatewayError::Config(format!("cannot read {}: {e}", p.display())))?;
                toml::from_str(&text).map_err(|e| GatewayError::Config(format!("{}: {e}", p.display())))?
            }
        };
        Self::build(file, overrides)
    }

    /// The settings given as flags and environment laid over the file's, then validated.
    fn build(mut file: FileConfig, overrides: Overrides) -> Result<Self, GatewayError> {
        overrides.apply(&mut file)?;
        Self::from_file(file)
    }

    /// Parses TOML text (for tests and embedding) with no overrides.
    pub fn from_toml(text: &str) -> Result<Self, GatewayError> {
        let file: FileConfig = toml::from_str(text).map_err(|e| GatewayError::Config(e.to_string()))?;
        Self::build(file, Overrides::default())
    }

    fn from_file(f: FileConfig) -> Result<Self, GatewayError> {
        let (patch, p) = split_policy(f.policy.clone())?;
        let policy = patch.build().map_err(cfg_err)?;
        let workers = f.workers;
        check_distinct(&workers)?;
        let tokenizer_from_workers = f.tokenizer.is_none();
        let mut tokenizer = f.tokenizer.unwrap_or_default();
        tokenizer.resolve_render(&workers)?;
        let s = &f.server;
        let t = &f.telemetry;
        let block_size = pick(BLOCK_SIZE, s.block_size)? as u32;
        let api_keys = f.security.api_keys.clone();
        if api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(GatewayError::Config("api_keys: empty keys are not allowed".into()));
        }
        let admin_key = f.security.admin_key.clone();
        if admin_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            return Err(GatewayError::Config("admin_key: an empty key is not allowed".into()));
        }
        if admin_key.as_ref().is_some_and(|a| api_keys.contains(a)) {
            return Err(GatewayError::Config(
                "admin_key is also one of the api_keys: every client could administer the gateway; choose a distinct admin key".into(),
            ));
        }
        let worker_api_key = match &f.security.worker_api_key {
            Some(k) if k.trim().is_empty() => None, // "": send none, even with a single client key
            Some(k) => Some(k.clone()),
            // As SMG's --api-key: one client key is also the engines' key.
            None if api_keys.len() == 1 => Some(api_keys[0].clone()),
            None => None,
        };
        Ok(GatewayConfig {
            host: s.host.clone().unwrap_or_else(|| "127.0.0.1".into()),
            port: s.port.unwrap_or(8080),
            worker_api_key,
            workers_file: f.discovery.workers_file.clone().map(Into::into),
            workers_file_poll: Duration::from_millis(pick(
                WORKERS_FILE_POLL_MS,
                f.discovery.workers_file_poll_ms.map(|v| v as f64),
            )? as u64),
            policy,
            block_size,
            admission_wait_s: pick(ADMISSION_WAIT_S, p.admission_wait_s)?,
            queue_timeout: Duration::from_millis(pick(QUEUE_TIMEOUT_MS, p.queue_timeout_ms.map(|v| v as f64))? as u64),
            max_queued: pick(MAX_QUEUED, p.max_queued.map(|v| v as f64))? as usize,
            workers,
            tokenizer,
            tokenizer_from_workers,
            api_keys,
            admin_key,
            max_body_bytes: pick(MAX_BODY_BYTES, s.max_body_bytes.map(|v| v as f64))? as usize,
            tokenize_cache_bytes: (pick(TOKENIZE_CACHE_MIB, s.tokenize_cache_mib.map(|v| v as f64))? as usize) << 20,
            tokenize_whole: s.tokenize_whole.unwrap_or(false),
            tokenize_check_interval: Duration::from_millis(pick(
                TOKENIZE_CHECK_INTERVAL_MS,
                s.tokenize_check_interval_ms.map(|v| v as f64),
            )? as u64),
            request_timeout: Duration::from_secs_f64(pick(REQUEST_TIMEOUT_S, s.request_timeout_s)?),
            connect_timeout: Duration::from_millis(
                pick(CONNECT_TIMEOUT_MS, s.connect_timeout_ms.map(|v| v as f64))? as u64
            ),
            upstream_keepalive: Duration::from_millis(pick(
                UPSTREAM_KEEPALIVE_MS,
                s.upstream_keepalive_ms.map(|v| v as f64),
            )? as u64),
            poll_interval: Duration::from_millis(pick(POLL_INTERVAL_MS, t.poll_interval_ms.map(|v| v as f64))? as u64),
            health_interval: Duration::from_millis(
                pick(HEALTH_INTERVAL_MS, t.health_interval_ms.map(|v| v as f64))? as u64
            ),
            failures_to_open: pick(FAILURES_TO_OPEN, t.failures_to_open.map(f64::from))? as u32,
            shutdown_grace: Duration::from_secs_f64(pick(SHUTDOWN_GRACE_S, s.shutdown_grace_s)?),
            decision_log: pick(DECISION_LOG, s.decision_log.map(|v| v as f64))? as usize,
            assumed_prompt_tokens: pick(ASSUMED_PROMPT_TOKENS, t.assumed_prompt_tokens.map(|v| v as f64))? as u64,
            assumed_decode_tokens: pick(ASSUMED_DECODE_TOKENS, t.assumed_decode_tokens.map(|v| v as f64))? as u64,
            limits: Limits::build(s, t)?,
            replicas: f.replicas.build()?,
        })
    }
}

/// Two workers may not share an id, a URL, or a KV-event endpoint (one engine's events would be
/// credited to both, or the second bind would fail at run time).
pub fn check_distinct(workers: &[WorkerSpec]) -> Result<(), GatewayError> {
    let mut ids = std::collections::HashSet::new();
    let mut urls = std::collections::HashSet::new();
    let mut streams = std::collections::HashMap::new();
    for w in workers {
        w.validate()?;
        if !ids.insert(w.id()) {
            return Err(GatewayError::Config(format!("two workers are named {:?}; give them distinct ids", w.id())));
        }
        if !urls.insert(w.url.trim_end_matches('/').to_owned()) {
            return Err(GatewayError::Config(format!("two workers have the url {:?}", w.display_url())));
        }
        if let Some(ep) = w.kv_events_endpoint() {
            for rank in 0..w.dp_size.unwrap_or(1) {
                let key = (rank_endpoint(&ep, rank).unwrap_or_default(), w.binds_kv_events());
                if let Some(other) = streams.insert(key.clone(), w.id()) {
                    return Err(GatewayError::Config(format!(
                        "workers {other} and {} both use the KV-event endpoint {}",
                        w.id(),
                        key.0
                    )));
                }
            }
        }
    }
    Ok(())
}

fn cfg_err(e: kvgate_core::CoreError) -> GatewayError {
    GatewayError::Config(e.to_string())
}

/// Every gateway knob, for documentation.
pub const KNOBS: &[Knob] = &[
    WORKERS_FILE_POLL_MS,
    MAX_BODY_BYTES,
    TOKENIZE_CACHE_MIB,
    TOKENIZE_CHECK_INTERVAL_MS,
    ADMISSION_WAIT_S,
    QUEUE_TIMEOUT_MS,
    MAX_QUEUED,
    REQUEST_TIMEOUT_S,
    CONNECT_TIMEOUT_MS,
    UPSTREAM_KEEPALIVE_MS,
    POLL_INTERVAL_MS,
    HEALTH_INTERVAL_MS,
    FAILURES_TO_OPEN,
    SHUTDOWN_GRACE_S,
    DECISION_LOG,
    ASSUMED_PROMPT_TOKENS,
    ASSUMED_DECODE_TOKENS,
];

#[cfg(test)]
mod tests {
    use super::*;

    fn render_of(toml: &str) -> Result<Option<String>, GatewayError> {
        let cfg = GatewayConfig::from_toml(toml)?;
        Ok(match cfg.tokenizer {
            TokenizerSpec::Hf { render, .. } => render,
            TokenizerSpec::Builtin => None,
        })
    }

    #[test]
    fn the_rendering_follows_an_all_sglang_fleet_unless_set() {
        let tok = "[tokenizer]\nkind = \"hf\"\npath = \"/m/tokenizer.json\"\n";
        let sglang = "[[workers]]\nurl = \"http://a:1\"\nengine = \"sglang\"\n";
        let vllm = "[[workers]]\nurl = \"http://b:1\"\nengine = \"vllm\"\n";
        let grpc = "[[workers]]\nurl = \"grpc://g:1\"\n";
        assert_eq!(render_of(&format!("{tok}{sglang}")).unwrap().as_deref(), Some("sglang"));
        assert_eq!(render_of(&format!("{tok}{sglang}{grpc}")).unwrap().as_deref(), Some("sglang"));
        let grpc_sglang = "[[workers]]\nurl = \"grpc://h:1\"\nengine = \"sglang\"\n";
        assert_eq!(render_of(&format!("{tok}{grpc_sglang}")).unwrap().as_deref(), Some("sglang"));
        assert_eq!(render_of(&format!("{tok}{grpc_sglang}{vllm}")).unwrap().as_deref(), Some("vllm"));
        assert_eq!(render_of(&format!("{tok}{grpc}")).unwrap().as_deref(), Some("vllm"));
        assert_eq!(render_of(&format!("{tok}{sglang}{vllm}")).unwrap().as_deref(), Some("vllm"));
        assert_eq!(render_of(tok).unwrap().as_deref(), Some("vllm"));
        let set = format!("{tok}render = \"vllm\"\n{sglang}");
        assert_eq!(render_of(&set).unwrap().as_deref(), Some("vllm"));
        let bad = render_of(&format!("{tok}render = \"tgi\"\n")).unwrap_err().to_string();
        assert!(bad.contains("\"tgi\"") && bad.contains("auto, vllm or sglang"), "{bad}");
    }

    #[test]
    fn the_documented_file_form_parses() {
        let cfg = GatewayConfig::from_toml(
            r#"
            [server]
            host = "0.0.0.0"
            port = 9000
            [policy]
            name = "projected"
            mode = "shadow"
            escape_seconds = 3.0
            escape_waiting = 32
            [[workers]]
            url = "http://10.0.0.1:8000"
            kv_events = "tcp://10.0.0.1:5557"
            replay = "tcp://10.0.0.1:5558"
            topic = "kv-events"
            block_size = 16
            [[workers]]
            url = "http://10.0.0.2:8000"
            id = "b"
            "#,
        )
        .unwrap();
        assert_eq!((cfg.host.as_str(), cfg.port), ("0.0.0.0", 9000));
        assert_eq!(cfg.policy.mode, kvgate_core::Mode::Shadow);
        assert_eq!(cfg.workers[0].id(), "10.0.0.1:8000");
        assert_eq!(cfg.workers[1].id(), "b");
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = |t: &str| GatewayConfig::from_toml(t).unwrap_err().to_string();
        assert!(err("[policy]\nescape_seconds = -1").contains("escape_seconds"));
        assert!(err("[server]\nmax_body_bytes = 10").contains("max_body_bytes"));
        assert!(err("[server]\ncolour = 1").contains("unknown field `colour`"));
        assert!(err("[[workers]]\nurl = \"ftp://x\"").contains("scheme"));
        assert!(err("[[workers]]\nurl = \"not a url\"").contains("worker url"));
        assert!(err("[[workers]]\nurl = \"http://a:1\"\nkv_events = \"a:5557\"").contains("tcp://host:port"));
        assert!(err("[[workers]]\nurl = \"http://a:1\"\n[[workers]]\nurl = \"http://a:1\"").contains("distinct ids"));
        assert!(err("[policy]\nname = \"projected\"\ndistribution_seeding = true").contains("distribution_seeding"));
        assert!(
            err("[policy]\nname = \"projected\"\nsmg_guards = true").contains("smg_guards belongs to the cache_aware")
        );
        let guarded = GatewayConfig::from_toml("[policy]\nname = \"cache_aware\"\nsmg_guards = true").unwrap();
        assert!(guarded.policy.smg_guards, "SMG 1.13's guards, configured");
    }

    #[test]
    fn an_admin_key_that_is_also_a_client_key_is_refused() {
        let toml = "[security]\napi_keys = [\"k1\", \"k2\"]\nadmin_key = \"k2\"\n";
        let err = GatewayConfig::from_toml(toml).unwrap_err().to_string();
        assert!(err.contains("admin_key is also one of the api_keys"), "{err}");
    }

    #[test]
    fn workers_that_would_collide_are_refused_naming_the_clash() {
        let refused = |toml: &str, needle: &str| {
            let err = GatewayConfig::from_toml(toml).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        };
        refused(
            "[[workers]]\nurl = \"http://a:1\"\nid = \"x\"\n[[workers]]\nurl = \"http://a:1/\"\nid = \"y\"\n",
            "two workers have the url",
        );
        refused(
            "[[workers]]\nurl = \"http://a:1\"\nkv_events = \"tcp://e:5557\"\n[[workers]]\nurl = \"http://b:1\"\nkv_events = \"tcp://e:5557\"\n",
            "both use the KV-event endpoint",
        );
        refused("[[workers]]\nurl = \"http://a:1\"\nkv_events = \"tcp://e:65535\"\ndp_size = 2\n", "past 65535");
    }

    #[test]
    fn dp_size_zero_is_refused() {
        let err = GatewayConfig::from_toml("[[workers]]\nurl = \"http://a:1\"\ndp_size = 0").unwrap_err().to_string();
        assert!(err.contains("dp_size"), "{err}");
    }

    #[test]
    fn flags_override_the_file() {
        let o = Overrides {
            port: Some(1234),
            workers: vec!["http://x:1".into()],
            mode: Some("off".into()),
            ..Overrides::default()
        };
        let cfg = GatewayConfig::build(FileConfig::default(), o).unwrap();
        assert_eq!(cfg.port, 1234);
        assert_eq!(cfg.workers.len(), 1);
        assert_eq!(cfg.policy.mode, kvgate_core::Mode::Off);
    }
}

#[cfg(test)]
mod doc_tests {
    use super::{
        KNOBS, LIMIT_KNOBS, REPLICA_EXPIRY_MS, REPLICA_FLUSH_MS, REPLICA_LAZY_FLUSH_MS, REPLICA_STAGGER_MS,
        REPLICA_STATE_INTERVAL_MS,
    };

    #[test]
    fn operations_doc_lists_every_gateway_knob_with_its_code_bounds() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/operations.md")).unwrap();
        for k in KNOBS.iter().chain(LIMIT_KNOBS).chain(&[
            REPLICA_EXPIRY_MS,
            REPLICA_FLUSH_MS,
            REPLICA_LAZY_FLUSH_MS,
            REPLICA_STATE_INTERVAL_MS,
            REPLICA_STAGGER_MS,
        ]) {
            let row = format!("| `{}` |", k.name);
            let line = doc
                .lines()
                .find(|l| l.starts_with(&row))
                .unwrap_or_else(|| panic!("docs/operations.md lacks {}", k.name));
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            assert_eq!(cells[3..6], [k.min.to_string(), k.max.to_string(), k.default.to_string()], "{line}");
        }
    }
}
