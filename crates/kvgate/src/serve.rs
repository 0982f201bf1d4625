//! `kvgate serve`: flags and environment onto the gateway configuration, logging, the runtime, and
//! signals.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvgate_gateway::{AppState, GatewayConfig, Overrides};

/// Log output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Flags of `kvgate serve`. Each also reads the environment variable shown in `--help`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML configuration file (see docs/operations.md); flags and environment override it.
    #[arg(long, env = "KVGATE_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long, env = "KVGATE_HOST")]
    host: Option<String>,
    /// Port to listen on (0: any free port) [default: 8080].
    #[arg(long, env = "KVGATE_PORT")]
    port: Option<u16>,
    /// An engine (repeatable): its base URL, then any [[workers]] keys as ,key=value; replaces the
    /// file's [[workers]]. E.g. http://10.0.0.7:8000,engine=vllm,kv_events=:5557,replay=:5558 (`:PORT` is
    /// on the engine's host). The environment variable separates engines with spaces.
    #[arg(long = "worker", env = "KVGATE_WORKERS", value_delimiter = ' ')]
    workers: Vec<String>,
    /// KV-event port of every engine without its own kv_events (each engine's own host).
    #[arg(long, env = "KVGATE_KV_EVENTS_PORT")]
    kv_events_port: Option<u16>,
    /// Replay port of every engine with KV events but without its own replay.
    #[arg(long, env = "KVGATE_REPLAY_PORT")]
    replay_port: Option<u16>,
    /// Policy: projected, least_load, cache_aware, or a baseline to A/B against: round_robin,
    /// random, power_of_two [default: projected].
    #[arg(long, env = "KVGATE_POLICY")]
    policy: Option<String>,
    /// Mode of the projected policy: off, shadow or enforce [default: enforce].
    #[arg(long, env = "KVGATE_MODE")]
    mode: Option<String>,
    /// Escape to the load-only winner when the cache winner's queue is this many seconds longer.
    #[arg(long, env = "KVGATE_ESCAPE_SECONDS")]
    escape_seconds: Option<f64>,
    /// Escape when the cache winner has this many more waiting requests.
    #[arg(long, env = "KVGATE_ESCAPE_WAITING")]
    escape_waiting: Option<u64>,
    /// 429 when the chosen engine's projected queue exceeds this many seconds (0 disables) [default: 30].
    #[arg(long, env = "KVGATE_ADMISSION_WAIT_S")]
    admission_wait_s: Option<f64>,
    /// KV block size of the engines (vLLM block_size, SGLang page_size) [default: 16].
    #[arg(long, env = "KVGATE_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// Tokenizer: `builtin` or the path of a HuggingFace tokenizer.json [default: builtin].
    #[arg(long, env = "KVGATE_TOKENIZER")]
    tokenizer: Option<String>,
    /// Chat template: a .jinja file, or a tokenizer_config.json holding one (default: found beside the
    /// tokenizer as transformers saves it: chat_template.jinja, then tokenizer_config.json).
    #[arg(long, env = "KVGATE_CHAT_TEMPLATE")]
    chat_template: Option<String>,
    /// How message content reaches the chat template, as vLLM's flag of the same name: auto (detect
    /// from the template), string or openai [default: auto].
    #[arg(long, env = "KVGATE_CHAT_TEMPLATE_CONTENT_FORMAT")]
    chat_template_content_format: Option<String>,
    /// Client API key (repeatable); without any, clients are not authenticated.
    #[arg(long = "api-key", env = "KVGATE_API_KEYS", value_delimiter = ',', hide_env_values = true)]
    api_keys: Vec<String>,
    /// Admin API key; without one, /admin is open (a warning is logged).
    #[arg(long, env = "KVGATE_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String>,
    /// Largest request body in bytes [default: 8388608].
    #[arg(long, env = "KVGATE_MAX_BODY_BYTES")]
    max_body_bytes: Option<usize>,
    /// Load poll interval per engine, milliseconds [default: 500].
    #[arg(long, env = "KVGATE_POLL_INTERVAL_MS")]
    poll_interval_ms: Option<u64>,
    /// Health check interval per engine, milliseconds [default: 2000].
    #[arg(long, env = "KVGATE_HEALTH_INTERVAL_MS")]
    health_interval_ms: Option<u64>,
    /// Seconds to drain in-flight streams after SIGTERM or Ctrl-C [default: 30].
    #[arg(long, env = "KVGATE_SHUTDOWN_GRACE_S")]
    shutdown_grace_s: Option<f64>,
    /// Log format.
    #[arg(long, env = "KVGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log filter (tracing env-filter syntax).
    #[arg(long, env = "KVGATE_LOG", default_value = "info")]
    log: String,
}

fn init_logging(format: LogFormat, filter: &str) -> anyhow::Result<()> {
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).with_context(|| format!("bad --log filter {filter:?}"))?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    }
    .map_err(|e| anyhow::anyhow!("cannot start logging: {e}"))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Every client stream holds two descriptors (client and engine); the default soft limit (often
/// 1024) would run out long before `max_connections`. Raise it as far as the hard limit allows, and
/// say so when that is still short.
fn raise_fd_limit(max_connections: usize) {
    let needed = (max_connections as u64).saturating_mul(2).saturating_add(256);
    match rlimit::increase_nofile_limit(needed) {
        Ok(limit) if limit < needed => tracing::warn!(
            limit,
            needed,
            "the file descriptor limit is below 2 × max_connections: raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections"
        ),
        Ok(limit) => tracing::debug!(limit, "file descriptor limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the file descriptor limit"),
    }
}

/// Runs `kvgate serve`.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    init_logging(a.log_format, &a.log)?;
    let overrides = Overrides {
        host: a.host,
        port: a.port,
        workers: a.workers,
        kv_events_port: a.kv_events_port,
        replay_port: a.replay_port,
        policy: a.policy,
        mode: a.mode,
        escape_seconds: a.escape_seconds,
        escape_waiting: a.escape_waiting,
        admission_wait_s: a.admission_wait_s,
        block_size: a.block_size,
        tokenizer: a.tokenizer,
        chat_template: a.chat_template,
        chat_template_content_format: a.chat_template_content_format,
        api_keys: a.api_keys,
        admin_key: a.admin_key,
        max_body_bytes: a.max_body_bytes,
        poll_interval_ms: a.poll_interval_ms,
        health_interval_ms: a.health_interval_ms,
        shutdown_grace_s: a.shutdown_grace_s,
    };
    let config = GatewayConfig::load(a.config.as_deref(), overrides)?;
    raise_fd_limit(config.limits.max_connections);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", config.host, config.port);
        let listener =
            tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        let state = AppState::new(config)?;
        tracing::info!(
            address = %local,
            workers = state.engines.read().len(),
            policy = %state.router.policy().name,
            mode = %state.router.policy().mode,
            tokenizer = %state.tokenizer.describe(),
            "kvgate listening"
        );
        kvgate_gateway::serve(listener, state, shutdown_signal()).await?;
        tracing::info!("stopped");
        Ok(())
    })
}
