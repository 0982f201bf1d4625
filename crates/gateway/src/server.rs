//! The accept loop: bounded connections, header timeouts, graceful drain.
//!
//! `axum::serve` has no header timeout and no connection cap: idle or dribbling sockets could hold
//! every file descriptor and a half-sent request could hold shutdown for its whole grace period. So
//! each connection is served by hyper directly, with a header timeout (which also closes kept-alive
//! connections left idle), under a semaphore of `max_connections`, and watched for a graceful drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::state::AppState;
use crate::GatewayError;

/// Pause after an accept error (out of descriptors): the error would repeat at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting, lets open
/// connections finish for up to the grace period, and returns.
pub(crate) async fn run(
    listener: TcpListener,
    state: &Arc<AppState>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let limits = state.config.limits;
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout).keep_alive(true);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut accept_errors = 0u64;
    loop {
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (tcp, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    accept_errors += 1;
                    if accept_errors.is_power_of_two() {
                        tracing::error!(error = %e, errors = accept_errors, "cannot accept a connection (out of file descriptors?)");
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm and delayed ACKs add
        // tens of milliseconds to the first token.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let service = TowerToHyperService::new(app.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(tcp), service));
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "client connection ended with an error");
            }
        });
    }
    drop(listener);
    tracing::info!("shutting down: no new connections; draining in-flight requests");
    let grace = state.config.shutdown_grace;
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(grace) => {
            tracing::warn!(grace_s = grace.as_secs_f64(), "shutdown grace period over; dropping remaining streams");
        }
    }
    Ok(())
}
