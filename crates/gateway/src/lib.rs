//! kvgate's HTTP gateway.
//!
//! Layout and flow:
//!
//! ```text
//! server: accept under a connection cap that follows the fd limit (the oldest idle connection
//!         makes room) ─► hyper http1 with a header timeout that shrinks under pressure ─► drain
//! client ─► api (auth, body limit and timeout, JSON, validation) ─► request::parse (render + tokenize)
//!        ─► proxy: place (decide+reserve, admit, queue) ─► the engine's backend: send (retry on
//!           another engine while the client has seen nothing) ─► respond (streamed chunk by chunk
//!           with an idle timeout)
//!        ◄─ first byte moves the reservation to decode; end, error or client disconnect releases it
//! replicas: reservations shared with the other gateway replicas over NATS (replicas/)
//! engines: two background tasks each (engines.rs): /health with a circuit breaker, load polling
//!          (SGLang /v1/loads, Prometheus /metrics), model discovery; passive health from real
//!          requests ejects engines that keep failing
//! ```
//!
//! - [`config`]: TOML + overrides, validated. [`error`]: the one error-to-status mapping.
//! - [`registry`]: engine handles and the narrow context their background tasks get; [`state`]:
//!   shared state, composed above everything the tasks and handlers use (modules depend only
//!   downward). [`metrics`]: `kvgate_*` Prometheus metrics. [`clock`]: the one place the
//!   wall clock is read. [`tokenize`]: built-in and HuggingFace tokenizers with chat templates.
//!
//! [`serve`] runs the server on a listener until a shutdown future resolves, then drains in-flight
//! streams for the configured grace period.

#![forbid(unsafe_code)]

pub mod api;
pub use kvgate_clock as clock;
pub mod config;
pub mod discovery;
pub mod engines;
pub mod error;
#[cfg(fuzzing)]
pub mod fuzzing;
pub mod grpc_worker;
pub mod kv_events;
pub mod metrics;
pub mod proxy;
pub mod registry;
pub mod replicas;
mod server;
pub mod state;
pub mod tokenize;
pub mod worker_tokenizer;

use std::future::Future;
use std::sync::Arc;

pub use config::{GatewayConfig, Overrides, WorkerSpec};
pub use server::{connection_cap, fd_limit_for, fd_reserve, listen};
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
    engines::start_all(&state.engine_context());
    let watcher = state.config.workers_file.clone().map(|path| {
        *state.discovery.lock() =
            state::DiscoveryStatus { path: Some(path.display().to_string()), ..Default::default() };
        tokio::spawn(discovery::run(state.clone(), path, state.config.workers_file_poll))
    });
    let sharing = replicas::start(&state.sharing_context());
    let app = api::routes(state.clone());
    let served = server::run(listener, &state, app, shutdown).await;
    if let Some(w) = watcher {
        w.abort();
    }
    if let Some(s) = sharing {
        s.stop().await;
    }
    for e in state.engines.read().values() {
        e.stop();
    }
    served
}
