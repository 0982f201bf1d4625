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
    /// Every setting that has a place in the file, as a flag and an environment variable.
    #[command(flatten)]
    settings: Overrides,
    /// Log format.
    #[arg(long, env = "KVGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// SMG's --log-json: --log-format json.
    #[arg(long, hide = true)]
    log_json: bool,
    /// Log filter (tracing env-filter syntax; SMG's --log-level values work too).
    #[arg(long, visible_alias = "log-level", env = "KVGATE_LOG", default_value = "info")]
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
/// say so when that is still short (the gateway then caps its connections to what the limit carries).
fn raise_fd_limit(max_connections: usize) {
    let needed = kvgate_gateway::fd_limit_for(max_connections);
    match rlimit::increase_nofile_limit(needed) {
        Ok(limit) if limit < needed => tracing::warn!(
            limit,
            needed,
            connection_cap = kvgate_gateway::connection_cap(max_connections, Some(limit)),
            "the file descriptor limit cannot carry max_connections: client connections are capped lower; raise the hard limit (ulimit -Hn, LimitNOFILE=) or lower max_connections"
        ),
        Ok(limit) => tracing::debug!(limit, "file descriptor limit"),
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the file descriptor limit"),
    }
}

/// Runs `kvgate serve`.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let format = if a.log_json { LogFormat::Json } else { a.log_format };
    init_logging(format, &a.log)?;
    let mut config = GatewayConfig::load(a.config.as_deref(), a.settings)?;
    raise_fd_limit(config.limits.max_connections);
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", config.host, config.port);
        let listener = kvgate_gateway::listen(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let local = listener.local_addr()?;
        // SMG's gRPC mode takes the model's tokenizer from its workers; so does kvgate when none is
        // configured.
        let cache = kvgate_gateway::worker_tokenizer::cache_root();
        kvgate_gateway::worker_tokenizer::resolve(&mut config, &cache, kvgate_gateway::worker_tokenizer::FETCH_WAIT)
            .await?;
        let state = AppState::new(config)?;
        #[cfg(unix)]
        {
            // SIGHUP rereads the workers file at once.
            let reload = state.discovery_reload.clone();
            let has_file = state.config.workers_file.is_some();
            let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .context("cannot listen for SIGHUP")?;
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    if has_file {
                        tracing::info!("SIGHUP: rereading the workers file");
                        reload.notify_one();
                    } else {
                        tracing::warn!("SIGHUP ignored: no workers file is configured (--workers-file)");
                    }
                }
            });
        }
        tracing::info!(
            address = %local,
            workers = state.engines.read().len(),
            policy = %state.router.policy().name,
            mode = %state.router.policy().mode,
            tokenizer = %state.tokenizer.describe(),
            engine_request_ids = %format!("kvgate-{}-N", state.request_tag),
            "kvgate listening"
        );
        kvgate_gateway::serve(listener, state, shutdown_signal()).await?;
        tracing::info!("stopped");
        Ok(())
    })
}
