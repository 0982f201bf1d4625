//! Settings from flags and environment, declared once: each field is a `kvgate serve` flag and its
//! environment variable (through clap), and [`Overrides::apply`] writes it where the TOML file keeps
//! the same setting, so the file, the environment and the flags meet in one structure and are
//! validated together. Spellings of SMG's flags that mean the same thing are accepted as aliases
//! (see docs/migrating-from-smg.md).

use clap::Args;

use super::{FileConfig, TokenizerSpec, WorkerSpec};
use crate::GatewayError;

/// Values from flags and environment; each one given overrides the file.
#[derive(Debug, Clone, Default, Args)]
pub struct Overrides {
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long, env = "KVGATE_HOST")]
    pub host: Option<String>,
    /// Port to listen on (0: any free port) [default: 8080].
    #[arg(long, env = "KVGATE_PORT")]
    pub port: Option<u16>,
    /// Engines: each a base URL, then any [[workers]] keys as ,key=value; replaces the file's
    /// [[workers]]. E.g. http://10.0.0.7:8000,engine=vllm,kv_events=:5557,replay=:5558 (`:PORT` is on
    /// the engine's host). Repeat the flag or give several after it (SMG's --worker-urls A B); the
    /// environment variable separates engines with spaces.
    #[arg(long = "worker", visible_alias = "worker-urls", env = "KVGATE_WORKERS", value_delimiter = ' ', num_args = 1..)]
    pub workers: Vec<String>,
    /// A file of engines (TOML [[workers]] or JSON) to watch: reread when it changes and on SIGHUP,
    /// adding and draining its engines beside the --worker ones.
    #[arg(long, env = "KVGATE_WORKERS_FILE")]
    pub workers_file: Option<String>,
    /// KV-event port of every engine without its own kv_events (each engine's own host).
    #[arg(long, env = "KVGATE_KV_EVENTS_PORT")]
    pub kv_events_port: Option<u16>,
    /// Replay port of every engine with KV events but without its own replay.
    #[arg(long, env = "KVGATE_REPLAY_PORT")]
    pub replay_port: Option<u16>,
    /// Policy: projected, least_load, cache_aware, or a baseline to A/B against: round_robin,
    /// random, power_of_two [default: projected].
    #[arg(long, env = "KVGATE_POLICY")]
    pub policy: Option<String>,
    /// Mode of the projected policy: off, shadow or enforce [default: enforce].
    #[arg(long, env = "KVGATE_MODE")]
    pub mode: Option<String>,
    /// Escape to the load-only winner when the cache winner's queue is this many seconds longer.
    #[arg(long, env = "KVGATE_ESCAPE_SECONDS")]
    pub escape_seconds: Option<f64>,
    /// Escape when the cache winner has this many more waiting requests.
    #[arg(long, env = "KVGATE_ESCAPE_WAITING")]
    pub escape_waiting: Option<u64>,
    /// cache_aware: leave the affinity pick when its load exceeds the mean by this many requests
    /// (and by --balance-rel).
    #[arg(long, visible_alias = "balance-abs-threshold", alias = "spill-abs-threshold", env = "KVGATE_BALANCE_ABS")]
    pub balance_abs: Option<u64>,
    /// cache_aware: leave the affinity pick when its load exceeds the mean times this (and by
    /// --balance-abs).
    #[arg(long, visible_alias = "balance-rel-threshold", alias = "spill-rel-threshold", env = "KVGATE_BALANCE_REL")]
    pub balance_rel: Option<f64>,
    /// 429 when the chosen engine's projected queue exceeds this many seconds (0 disables) [default: 30].
    #[arg(long, env = "KVGATE_ADMISSION_WAIT_S")]
    pub admission_wait_s: Option<f64>,
    /// Most requests waiting for an engine to become eligible [default: 1024].
    #[arg(long, visible_alias = "queue-size", env = "KVGATE_MAX_QUEUED")]
    pub max_queued: Option<usize>,
    /// Longest a request waits for an engine to become eligible, milliseconds (0: answer at once) [default: 0].
    #[arg(long, env = "KVGATE_QUEUE_TIMEOUT_MS", conflicts_with = "queue_timeout_secs")]
    pub queue_timeout_ms: Option<u64>,
    /// SMG's --queue-timeout-secs: --queue-timeout-ms in seconds.
    #[arg(long, hide = true)]
    pub queue_timeout_secs: Option<u64>,
    /// KV block size of the engines (vLLM block_size, SGLang page_size) [default: 16].
    #[arg(long, env = "KVGATE_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Tokenizer: `builtin`, a HuggingFace tokenizer.json, or the directory holding one [default: builtin].
    #[arg(long, visible_alias = "tokenizer-path", env = "KVGATE_TOKENIZER")]
    pub tokenizer: Option<String>,
    /// Chat template: a .jinja file, or a tokenizer_config.json holding one (default: found beside the
    /// tokenizer as transformers saves it: chat_template.jinja, then tokenizer_config.json).
    #[arg(long, env = "KVGATE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,
    /// How message content reaches the chat template, as vLLM's flag of the same name: auto (detect
    /// from the template), string or openai [default: auto].
    #[arg(long, env = "KVGATE_CHAT_TEMPLATE_CONTENT_FORMAT")]
    pub chat_template_content_format: Option<String>,
    /// Whose rendering of requests into prompt ids to reproduce, so that ids equal the engines':
    /// vllm, sglang, or auto (sglang when every HTTP worker is engine=sglang) [default: auto].
    #[arg(long, env = "KVGATE_TOKENIZER_RENDER")]
    pub tokenizer_render: Option<String>,
    /// Client API key (repeatable); without any, clients are not authenticated. With exactly one, it
    /// is also sent to the engines unless --worker-api-key says otherwise (as SMG's --api-key does).
    #[arg(long = "api-key", env = "KVGATE_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Key sent to every engine as `Authorization: Bearer KEY` (engines started with --api-key).
    #[arg(long, env = "KVGATE_WORKER_API_KEY", hide_env_values = true)]
    pub worker_api_key: Option<String>,
    /// Admin API key; without one, /admin is open (a warning is logged).
    #[arg(long, env = "KVGATE_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Largest request body in bytes [default: 8388608].
    #[arg(long, visible_alias = "max-payload-size", env = "KVGATE_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Memory in MiB for the token ids of long prompts' chunks, reused when later prompts repeat
    /// the text; 0 turns the cache off [default: 64].
    #[arg(long, env = "KVGATE_TOKENIZE_CACHE_MIB")]
    pub tokenize_cache_mib: Option<u64>,
    /// Tokenize every prompt whole, even where routing needs only its start (the rest of a prompt
    /// no engine holds is otherwise estimated from its bytes).
    #[arg(long, env = "KVGATE_TOKENIZE_WHOLE")]
    pub tokenize_whole: bool,
    /// Longest a non-streaming response may take, seconds [default: 600].
    #[arg(long, visible_alias = "request-timeout-secs", env = "KVGATE_REQUEST_TIMEOUT_S")]
    pub request_timeout_s: Option<f64>,
    /// Load poll interval per engine, milliseconds [default: 500].
    #[arg(long, env = "KVGATE_POLL_INTERVAL_MS")]
    pub poll_interval_ms: Option<u64>,
    /// Health check interval per engine, milliseconds [default: 2000].
    #[arg(long, env = "KVGATE_HEALTH_INTERVAL_MS", conflicts_with = "health_check_interval_secs")]
    pub health_interval_ms: Option<u64>,
    /// SMG's --health-check-interval-secs: --health-interval-ms in seconds.
    #[arg(long, hide = true)]
    pub health_check_interval_secs: Option<u64>,
    /// Consecutive failed health checks that take an engine out of rotation [default: 3].
    #[arg(long, visible_alias = "health-failure-threshold", env = "KVGATE_FAILURES_TO_OPEN")]
    pub failures_to_open: Option<u32>,
    /// SMG's --header-read-timeout-secs: `header_timeout_ms` in seconds.
    #[arg(long, hide = true)]
    pub header_read_timeout_secs: Option<u64>,
    /// NATS server(s) to share reservations with the other replicas on, e.g. nats://nats:4222
    /// (several separated by commas); without one, this replica decides alone.
    #[arg(long, env = "KVGATE_REPLICA_BUS")]
    pub replica_bus: Option<String>,
    /// Subject the replicas of this fleet share [default: kvgate.reservations].
    #[arg(long, env = "KVGATE_REPLICA_SUBJECT")]
    pub replica_subject: Option<String>,
    /// This replica's name, unique among its peers [default: host name, process id, random suffix].
    #[arg(long, env = "KVGATE_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// A peer not heard from for this many milliseconds is gone and its reservations end [default: 5000].
    #[arg(long, env = "KVGATE_REPLICA_EXPIRY_MS")]
    pub replica_expiry_ms: Option<u64>,
    /// Seconds to drain in-flight streams after SIGTERM or Ctrl-C [default: 30].
    #[arg(long, visible_alias = "shutdown-grace-period-secs", env = "KVGATE_SHUTDOWN_GRACE_S")]
    pub shutdown_grace_s: Option<f64>,
}

fn set<T>(slot: &mut Option<T>, value: Option<T>) {
    if value.is_some() {
        *slot = value;
    }
}

fn put(table: &mut toml::Table, key: &str, value: Option<toml::Value>) {
    if let Some(v) = value {
        table.insert(key.to_owned(), v);
    }
}

fn int(v: u64) -> toml::Value {
    toml::Value::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}

impl Overrides {
    /// Writes every setting given into `file`, where the TOML file keeps it.
    pub(super) fn apply(self, file: &mut FileConfig) -> Result<(), GatewayError> {
        let s = &mut file.server;
        set(&mut s.host, self.host);
        set(&mut s.port, self.port);
        set(&mut s.block_size, self.block_size);
        set(&mut s.max_body_bytes, self.max_body_bytes);
        set(&mut s.tokenize_cache_mib, self.tokenize_cache_mib);
        if self.tokenize_whole {
            s.tokenize_whole = Some(true);
        }
        set(&mut s.request_timeout_s, self.request_timeout_s);
        set(&mut s.shutdown_grace_s, self.shutdown_grace_s);
        set(&mut s.header_timeout_ms, self.header_read_timeout_secs.map(|v| v.saturating_mul(1000)));

        let p = &mut file.policy;
        put(p, "name", self.policy.map(toml::Value::String));
        put(p, "mode", self.mode.map(toml::Value::String));
        put(p, "escape_seconds", self.escape_seconds.map(toml::Value::Float));
        put(p, "escape_waiting", self.escape_waiting.map(int));
        put(p, "balance_abs", self.balance_abs.map(int));
        put(p, "balance_rel", self.balance_rel.map(toml::Value::Float));
        put(p, "admission_wait_s", self.admission_wait_s.map(toml::Value::Float));
        put(p, "max_queued", self.max_queued.map(|v| int(v as u64)));
        let queue_ms = self.queue_timeout_ms.or(self.queue_timeout_secs.map(|v| v.saturating_mul(1000)));
        put(p, "queue_timeout_ms", queue_ms.map(int));

        let t = &mut file.telemetry;
        set(&mut t.poll_interval_ms, self.poll_interval_ms);
        set(&mut t.health_interval_ms, self.health_interval_ms.or(self.health_check_interval_secs.map(|v| v * 1000)));
        set(&mut t.failures_to_open, self.failures_to_open);

        set(&mut file.discovery.workers_file, self.workers_file);

        let r = &mut file.replicas;
        set(&mut r.bus, self.replica_bus);
        set(&mut r.subject, self.replica_subject);
        set(&mut r.replica_id, self.replica_id);
        set(&mut r.expiry_ms, self.replica_expiry_ms);

        let k = &mut file.security;
        k.api_keys.extend(self.api_keys);
        set(&mut k.admin_key, self.admin_key);
        set(&mut k.worker_api_key, self.worker_api_key);

        match self.tokenizer.as_deref() {
            None => {}
            Some("builtin") => file.tokenizer = Some(TokenizerSpec::Builtin),
            Some(path) => {
                file.tokenizer = Some(TokenizerSpec::Hf {
                    path: path.to_owned(),
                    chat_template: self.chat_template,
                    content_format: self.chat_template_content_format,
                    render: self.tokenizer_render,
                })
            }
        }

        if !self.workers.is_empty() {
            file.workers = self.workers.iter().map(|w| WorkerSpec::parse_compact(w)).collect::<Result<_, _>>()?;
        }
        for w in &mut file.workers {
            if w.kv_events.is_none() {
                w.kv_events = self.kv_events_port.map(|p| format!(":{p}"));
            }
            if w.replay.is_none() && w.kv_events.is_some() {
                w.replay = self.replay_port.map(|p| format!(":{p}"));
            }
        }
        Ok(())
    }
}
