//! kvgate's HTTP gateway.
//!
//! Layout and flow:
//!
//! ```text
//! client ─► api (auth, body limit, JSON, validation) ─► request::parse (render + tokenize)
//!        ─► proxy::dispatch: core decide+reserve ─► admission ─► engine (retry a failed connect)
//!        ◄─ streamed chunk by chunk; first byte moves the reservation to decode; end, error or
//!           client disconnect releases it
//! engines: one background task each (engines.rs): /health with a circuit breaker, load polling
//!          (SGLang /v1/loads, Prometheus /metrics), model discovery
//! ```
//!
//! - [`config`]: TOML + overrides, validated. [`error`]: the one error-to-status mapping.
//! - [`state`]: shared state. [`metrics`]: `kvgate_*` Prometheus metrics. [`clock`]: the one place the
//!   wall clock is read. [`tokenize`]: built-in and HuggingFace tokenizers with chat templates.
//!
//! [`serve`] runs the server on a listener until a shutdown future resolves, then drains in-flight
//! streams for the configured grace period.

#![forbid(unsafe_code)]

pub mod api;
pub mod clock;
pub mod config;
pub mod engines;
pub mod error;
pub mod kv_events;
pub mod metrics;
pub mod proxy;
pub mod state;
pub mod tokenize;

use std::future::Future;
use std::sync::Arc;

pub use config::{GatewayConfig, Overrides, WorkerSpec};
pub use state::AppState;

/// Errors of gateway set-up and administration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// A name already in use.
    #[error("{0}")]
    Conflict(String),
    /// Nothing by that name.
    #[error("{0}")]
    NotFound(String),
    /// The listener failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
/// requests and streams finish for up to the configured grace period, and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    if state.config.admin_key.is_none() {
        tracing::warn!("no admin key configured: /admin routes are open to anyone who can reach the gateway");
    }
    engines::start_all(&state);
    let app = api::routes(state.clone());
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    let graceful = async move {
        shutdown.await;
        tracing::info!("shutting down: no new connections; draining in-flight requests");
        let _ = signalled_tx.send(());
    };
    // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm and delayed ACKs add
    // tens of milliseconds to the first token.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    let server = axum::serve(listener, app).with_graceful_shutdown(graceful);
    let grace = state.config.shutdown_grace;
    let deadline = async move {
        if signalled_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        r = server => r?,
        _ = deadline => tracing::warn!(grace_s = grace.as_secs_f64(), "shutdown grace period over; dropping remaining streams"),
    }
    for e in state.engines.read().values() {
        e.stop();
    }
    Ok(())
}
