//! The background work of a gRPC worker (`grpc://`): its health from `grpc.health.v1` (or the
//! worker's own `HealthCheck`, see `GrpcWorker::health`), its load from `GetLoads`, its block size,
//! capacity and batch limit from `GetServerInfo`, and the model it serves from `GetModelInfo`. The
//! same circuit breaker, identity checks and load snapshot as an HTTP engine's.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{check_failed, ejected, observe_block_size, observe_capacity, set_healthy, to_snapshot};
use crate::config::EngineKind;
use crate::grpc_worker::{GrpcRuntime, GrpcWorker};
use crate::registry::{EngineContext, EngineHandle};

/// The engine kind a gRPC runtime reports its load as.
fn kind_of(runtime: GrpcRuntime) -> EngineKind {
    match runtime {
        GrpcRuntime::Vllm => EngineKind::Vllm,
        GrpcRuntime::Sglang => EngineKind::Sglang,
    }
}

/// One health check of a gRPC worker: whether it is ready to serve; on success, what it says about its
/// model (now and then) and its settings (once per return to rotation).
pub(super) async fn check_health(
    ctx: &EngineContext,
    engine: &EngineHandle,
    worker: &GrpcWorker,
    timeout: Duration,
    refresh_models: bool,
) {
    let (ok, engine_said) = match worker.health(timeout).await {
        Ok(healthy) => (healthy, true),
        Err(status) => {
            tracing::debug!(engine = %engine.id, code = ?status.code(), message = status.message(), "gRPC health check failed");
            (false, status.code() != tonic::Code::DeadlineExceeded)
        }
    };
    if !ok {
        check_failed(ctx, engine, engine_said);
        return;
    }
    if let Some(runtime) = worker.known_runtime() {
        *engine.telemetry.lock() = Some(kind_of(runtime));
    }
    engine.failures.store(0, Ordering::Relaxed);
    engine.seen_up.store(true, Ordering::Relaxed);
    if !ejected(ctx, engine) {
        set_healthy(ctx, engine, true);
    }
    if refresh_models || engine.models.lock().is_empty() {
        match worker.model_info(timeout).await {
            Ok(info) => {
                engine.identity.lock().max_context_tokens = info.max_context_length;
                if !info.served_model_name.is_empty() {
                    *engine.models.lock() = vec![info.served_model_name];
                    ctx.registry.refresh_models();
                }
            }
            Err(status) => tracing::debug!(engine = %engine.id, error = %status, "GetModelInfo failed"),
        }
    }
    if !engine.server_info_read.load(Ordering::Relaxed) {
        match worker.server_info(timeout).await {
            Ok(info) => {
                engine.server_info_read.store(true, Ordering::Relaxed);
                if info.max_running_requests.is_some() {
                    engine.identity.lock().max_running_requests = info.max_running_requests;
                }
                if let Some(b) = info.block_size {
                    observe_block_size(ctx, engine, b, "GetServerInfo");
                }
                if let Some(tokens) = info.capacity_tokens {
                    observe_capacity(ctx, engine, tokens);
                }
            }
            Err(status) => tracing::debug!(engine = %engine.id, error = %status, "GetServerInfo failed"),
        }
    }
}

/// One load poll of a gRPC worker (`GetLoads`).
pub(super) async fn poll_load(ctx: &EngineContext, engine: &EngineHandle, worker: &GrpcWorker) {
    let timeout = ctx.settings.poll_interval.max(Duration::from_millis(200)).min(Duration::from_secs(5));
    // Stamped when asked, as an HTTP engine's report is (see `super::poll_load`).
    let asked_at = ctx.clock.now();
    match worker.loads(timeout).await {
        Ok(load) => {
            if let Some(runtime) = worker.known_runtime() {
                *engine.telemetry.lock() = Some(kind_of(runtime));
            }
            *engine.telemetry_error.lock() = None;
            if let Some(tokens) = load.kv_capacity_tokens.filter(|t| *t > 0) {
                observe_capacity(ctx, engine, tokens);
            }
            if load.max_running_requests.is_some() {
                engine.identity.lock().max_running_requests = load.max_running_requests;
            }
            let snapshot = to_snapshot(ctx, &load, asked_at);
            let _ = ctx.router.update_load(&engine.id, snapshot);
        }
        Err(status) => {
            let error = format!("GetLoads: {status}");
            tracing::debug!(engine = %engine.id, %error, "load poll failed");
            *engine.telemetry_error.lock() = Some(error);
        }
    }
}
