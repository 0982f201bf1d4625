//! The engines' background work: health checks with a circuit breaker, load polling (SGLang
//! `/v1/loads` or Prometheus `/metrics`), model discovery, what the engine says about itself, and
//! passive health from the requests it serves. Health and load run as separate tasks per engine, so
//! a hung `/health` never delays a load poll past `stale_after`. The tasks take an
//! [`EngineContext`], never the gateway's whole state.
//!
//! An engine's prefix cache lives in its process. When the process may have restarted (its
//! `process_start_time_seconds` changed, or it comes back after being out of rotation), the KV view
//! kvgate holds for it is dropped at once and rebuilt from the engine's replay socket: vLLM's block
//! hashes repeat across restarts, so old blocks would otherwise look cached on a cold engine.

mod grpc;
pub(crate) mod grpc_events;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::telemetry::{snapshot_from_report, CountAssumptions};
use kvgate_core::{KvState, LoadSnapshot, Timestamp};
use kvgate_protocol::telemetry::{parse_prometheus, parse_sglang_loads, EngineLoad};

use crate::config::EngineKind;
use crate::metrics::Metrics;
use crate::registry::{EngineContext, EngineHandle};

/// Health checks between model-list refreshes.
const MODELS_EVERY: u32 = 15;

/// Starts the background tasks of every registered engine.
pub fn start_all(ctx: &EngineContext) {
    for e in ctx.registry.all() {
        start(ctx, &e);
    }
}

/// Starts one engine's background tasks: health, load, and its KV event subscribers if it has any.
pub fn start(ctx: &EngineContext, engine: &Arc<EngineHandle>) {
    let mut tasks = engine.tasks.lock();
    tasks.push(tokio::spawn(health_loop(ctx.clone(), engine.clone())).abort_handle());
    tasks.push(tokio::spawn(load_loop(ctx.clone(), engine.clone())).abort_handle());
    drop(tasks);
    if let Some(spec) = engine.kv_spec() {
        start_streams(ctx, engine, &spec);
    } else if engine.subscribes_over_grpc() {
        let task = tokio::spawn(grpc_events::run(ctx.clone(), engine.clone()));
        engine.tasks.lock().push(task.abort_handle());
    }
}

/// Starts the KV event subscribers `spec` describes: one per data-parallel rank, each with its own
/// sequence numbers, all feeding this worker's index (a prefix cached on any rank counts for it).
fn start_streams(ctx: &EngineContext, engine: &Arc<EngineHandle>, spec: &crate::config::WorkerSpec) {
    let Some(endpoint) = spec.kv_events_endpoint() else { return };
    let mut tasks = engine.tasks.lock();
    for rank in 0..spec.dp_size.unwrap_or(1) {
        let Some(endpoint) = crate::config::rank_endpoint(&endpoint, rank) else { continue };
        let cfg = crate::kv_events::StreamConfig {
            worker: engine.id.clone(),
            endpoint,
            bind: spec.binds_kv_events(),
            replay: spec.replay_endpoint().and_then(|r| crate::config::rank_endpoint(&r, rank)),
            topic: spec.topic.clone().unwrap_or_default(),
        };
        let task = tokio::spawn(crate::kv_events::run(ctx.clone(), engine.clone(), cfg));
        tasks.push(task.abort_handle());
    }
}

/// Reads an engine's `GET /server_info` (`/get_server_info` on older SGLang versions) and acts on
/// it: an SGLang engine's page size is checked against the gateway's block size and its KV capacity
/// taken as reported, and an engine configured without `kv_events` is subscribed to the publisher
/// it announces. An engine that answers without a ZMQ publisher is not asked again where it
/// publishes; one that cannot be reached is asked at its next health check.
async fn read_server_info(ctx: &EngineContext, engine: &Arc<EngineHandle>, timeout: Duration) {
    let mut info = None;
    for path in ["/server_info", "/get_server_info"] {
        let Ok(resp) = ctx.http.get(format!("{}{path}", engine.base)).timeout(timeout).send().await else { return };
        if resp.status().is_success() {
            info = resp.json::<serde_json::Value>().await.ok();
            break;
        }
    }
    engine.server_info_read.store(true, Ordering::Relaxed);
    if let Some(info) = &info {
        observe_server_info(ctx, engine, info);
    }
    if engine.wants_kv_discovery() {
        discover_kv_events(ctx, engine, info.as_ref());
    }
}

/// What an SGLang `/server_info` says about the engine itself: its page size (the server argument
/// `page_size`, or the `kv_events` announcement's `block_size`) and its KV capacity
/// (`max_total_num_tokens`).
fn observe_server_info(ctx: &EngineContext, engine: &EngineHandle, info: &serde_json::Value) {
    let (page_size, capacity) = server_info_identity(info);
    if let Some(bs) = page_size {
        observe_block_size(ctx, engine, bs, "page_size in /server_info");
    }
    if let Some(tokens) = capacity {
        observe_capacity(ctx, engine, tokens);
    }
}

/// The page size and KV capacity in tokens an SGLang `/server_info` answer gives, where it gives
/// them (zero or out-of-range values are not taken).
pub fn server_info_identity(info: &serde_json::Value) -> (Option<u32>, Option<u64>) {
    let number = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
    let page_size = number(info.get("page_size"))
        .or_else(|| number(info.get("kv_events").and_then(|k| k.get("block_size"))))
        .and_then(|b| u32::try_from(b).ok())
        .filter(|&b| b > 0);
    let capacity = number(info.get("max_total_num_tokens")).filter(|&t| t > 0);
    (page_size, capacity)
}

/// Subscribes to the KV events an engine configured without `kv_events` announces in its
/// `/server_info` answer (`None`: it answered nothing usable).
fn discover_kv_events(ctx: &EngineContext, engine: &Arc<EngineHandle>, info: Option<&serde_json::Value>) {
    let announced = info.and_then(|i| announced_kv_events(&engine.spec, i));
    *engine.discovered.lock() = Some(announced.clone());
    let Some(spec) = announced else {
        tracing::debug!(engine = %engine.id, "the engine announces no KV event publisher: load-only");
        return;
    };
    tracing::info!(engine = %engine.id, kv_events = ?spec.kv_events, replay = ?spec.replay, "KV events announced by the engine");
    if let Some(b) = spec.block_size {
        observe_block_size(ctx, engine, b, "block_size of the kv_events announcement");
    }
    let state = match engine.config_problem.lock().clone() {
        Some(problem) => KvState::Invalid(problem),
        None => KvState::Incomplete("KV event stream not connected yet".into()),
    };
    let _ = ctx.router.set_kv_state(&engine.id, state);
    start_streams(ctx, engine, &spec);
}

/// The worker's spec with the KV-event settings a `/server_info` answer announces: SGLang's
/// `"kv_events"` object (`engine-protocols.md` §1), or its `kv_events_config` server argument.
fn announced_kv_events(
    spec: &crate::config::WorkerSpec,
    info: &serde_json::Value,
) -> Option<crate::config::WorkerSpec> {
    use serde_json::Value;
    let port = |v: &Value| v.as_u64().and_then(|p| u16::try_from(p).ok());
    // An endpoint on a wildcard host is on the engine's own host.
    let on_host = |host: Option<&str>, port: u16| match host {
        None | Some("" | "*" | "0.0.0.0" | "::" | "[::]") => format!(":{port}"),
        Some(h) => format!("tcp://{h}:{port}"),
    };
    let mut out = spec.clone();
    if let Some(kv) = info.get("kv_events").filter(|v| v.is_object()) {
        if kv.get("publisher").and_then(Value::as_str) != Some("zmq") {
            return None;
        }
        out.kv_events =
            Some(on_host(kv.get("endpoint_host").and_then(Value::as_str), port(kv.get("endpoint_port_base")?)?));
        out.replay = kv
            .get("replay_endpoint_port_base")
            .and_then(port)
            .map(|p| on_host(kv.get("endpoint_host").and_then(Value::as_str), p));
        out.topic = kv.get("topic").and_then(Value::as_str).map(str::to_owned);
        out.block_size =
            out.block_size.or(kv.get("block_size").and_then(|b| b.as_u64()).and_then(|b| u32::try_from(b).ok()));
        out.dp_size = out.dp_size.or(kv.get("dp_size").and_then(|d| d.as_u64()).and_then(|d| u16::try_from(d).ok()));
        return Some(out);
    }
    // The server argument: a JSON string as given to --kv-events-config.
    let config: Value = serde_json::from_str(info.get("kv_events_config")?.as_str()?).ok()?;
    if config.get("publisher").and_then(Value::as_str) != Some("zmq") {
        return None;
    }
    let endpoint = |key: &str| -> Option<String> {
        let raw = config.get(key)?.as_str()?.strip_prefix("tcp://")?;
        let (host, p) = raw.rsplit_once(':')?;
        Some(on_host(Some(host), p.parse().ok()?))
    };
    out.kv_events = Some(endpoint("endpoint")?);
    out.replay = endpoint("replay_endpoint");
    out.topic = config.get("topic").and_then(Value::as_str).map(str::to_owned);
    Some(out)
}

/// Counts a request that the engine failed (a server error, a timeout, a refused connect). After
/// `outlier_failures` in a row the engine is ejected for `outlier_ejection` times the ejections in a
/// row (at most 10), whatever its `/health` says, unless it is the last engine in rotation: an
/// engine that answers 500 to everything must not look like the idlest one.
pub fn request_failed(ctx: &EngineContext, engine: &EngineHandle) {
    Metrics::engine_counter(&ctx.metrics.upstream_failures, engine.id.as_str()).inc();
    let limits = ctx.settings.limits;
    let eject_for = {
        let mut o = engine.outlier.lock();
        o.consecutive += 1;
        if o.consecutive < limits.outlier_failures || !engine.healthy.load(Ordering::Relaxed) {
            return;
        }
        if !ctx.registry.others_in_rotation(&engine.id) {
            return;
        }
        o.consecutive = 0;
        o.ejections = (o.ejections + 1).min(10);
        let eject_for = limits.outlier_ejection * o.ejections;
        o.ejected_until = Some(ctx.clock.instant() + eject_for);
        eject_for
    };
    Metrics::engine_counter(&ctx.metrics.ejections, engine.id.as_str()).inc();
    tracing::warn!(engine = %engine.id, failures = limits.outlier_failures, eject_s = eject_for.as_secs_f64(), "engine failed requests in a row: ejected");
    set_healthy(ctx, engine, false);
}

/// Counts a request that could not connect to the engine (refused, not slow): a failed request,
/// and, for an engine whose health check has never passed, a failed check that takes it out of
/// rotation at once (a gateway started with dead engines in its list would otherwise spend its
/// first requests' retries on them until `failures_to_open` checks had failed).
pub fn connect_failed(ctx: &EngineContext, engine: &EngineHandle) {
    request_failed(ctx, engine);
    if !engine.seen_up.load(Ordering::Relaxed) {
        check_failed(ctx, engine, true);
    }
}

/// Counts a failed health check; `engine_said` when the engine itself failed it (an answer, a
/// refused connect) rather than being slow. `failures_to_open` in a row open the circuit, and so
/// does one the engine said, until it has been seen up.
fn check_failed(ctx: &EngineContext, engine: &EngineHandle, engine_said: bool) {
    let n = engine.failures.fetch_add(1, Ordering::Relaxed) + 1;
    if n >= ctx.settings.failures_to_open || (engine_said && !engine.seen_up.load(Ordering::Relaxed)) {
        set_healthy(ctx, engine, false);
    }
}

/// Counts a request the engine answered (any status but a server error).
pub fn request_succeeded(engine: &EngineHandle) {
    let mut o = engine.outlier.lock();
    o.consecutive = 0;
    if o.ejected_until.is_none() {
        o.ejections = 0;
    }
}

/// Whether an ejection still keeps the engine out (clearing it once it has run out).
fn ejected(ctx: &EngineContext, engine: &EngineHandle) -> bool {
    let mut o = engine.outlier.lock();
    match o.ejected_until {
        Some(until) if ctx.clock.instant() < until => true,
        Some(_) => {
            o.ejected_until = None;
            false
        }
        None => false,
    }
}

/// Drops the engine's KV view now and asks its subscribers to rebuild it from the replay socket.
/// What the engine said about itself in `/server_info` is read again: a restarted engine may run
/// with other settings.
pub fn resync(ctx: &EngineContext, engine: &EngineHandle, why: &str) {
    engine.server_info_read.store(false, Ordering::Relaxed);
    let _ = ctx.router.clear_kv(&engine.id);
    let kv = if !engine.has_kv_events() {
        engine.synced_state()
    } else if engine.subscribes_over_grpc() {
        KvState::Incomplete(format!("{why}: subscribing to its KV events again"))
    } else {
        KvState::Incomplete(format!("{why}: rebuilding its KV view from its replay socket"))
    };
    let _ = ctx.router.set_kv_state(&engine.id, kv);
    engine.resync.send_modify(|g| *g += 1);
}

fn set_healthy(ctx: &EngineContext, engine: &EngineHandle, healthy: bool) {
    if engine.healthy.swap(healthy, Ordering::Relaxed) != healthy {
        if healthy {
            tracing::info!(engine = %engine.id, "engine healthy again: back in rotation");
            // It may have restarted while it was out: never credit the cache of the old process.
            resync(ctx, engine, "engine back in rotation");
        } else {
            tracing::warn!(engine = %engine.id, "engine unhealthy: out of rotation");
        }
    }
    let _ = ctx.router.set_eligible(&engine.id, healthy);
    if healthy {
        ctx.capacity.notify_waiters();
    }
}

/// Runs `work` every `every` (the first time at once) until the task is aborted.
async fn periodically<F, Fut>(every: Duration, mut work: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        work().await;
    }
}

async fn health_loop(ctx: EngineContext, engine: Arc<EngineHandle>) {
    let mut checks = 0u32;
    periodically(ctx.settings.health_interval, || {
        let refresh = checks.is_multiple_of(MODELS_EVERY);
        checks = checks.wrapping_add(1);
        let (ctx, engine) = (ctx.clone(), engine.clone());
        async move { check_health(&ctx, &engine, refresh).await }
    })
    .await;
}

async fn load_loop(ctx: EngineContext, engine: Arc<EngineHandle>) {
    periodically(ctx.settings.poll_interval, || {
        let (ctx, engine) = (ctx.clone(), engine.clone());
        async move { poll_load(&ctx, &engine).await }
    })
    .await;
}

/// Shortest wait for an engine's `/health` answer.
const HEALTH_TIMEOUT_MIN: Duration = Duration::from_secs(1);
/// Longest wait for an engine's `/health` answer.
const HEALTH_TIMEOUT_MAX: Duration = Duration::from_secs(5);
/// Shortest wait for an SGLang engine's `/health` answer: SGLang's `/health` sends the scheduler a
/// one-token request and answers after polling for its reply once a second, so even an idle engine
/// takes just over a second (measured on 0.5.23: 1.00 s idle), and a second's timeout failed every
/// check and took every SGLang engine out of rotation.
const SGLANG_HEALTH_TIMEOUT_MIN: Duration = Duration::from_secs(3);

async fn check_health(ctx: &EngineContext, engine: &Arc<EngineHandle>, refresh_models: bool) {
    // At least a second: a busy gateway (or test machine) must not read its own slowness as a sick
    // engine, which would take it out of rotation and throw away its KV view on return.
    let floor = if engine.is_sglang() { SGLANG_HEALTH_TIMEOUT_MIN } else { HEALTH_TIMEOUT_MIN };
    let timeout = ctx.settings.health_interval.clamp(floor, HEALTH_TIMEOUT_MAX);
    if let Some(worker) = &engine.grpc {
        return grpc::check_health(ctx, engine, worker, timeout, refresh_models).await;
    }
    // Whether the check passed, and, if not, whether the engine itself said so (an answer, a refused
    // connect) rather than being slow to answer, which a busy gateway can cause.
    let (ok, engine_said) = match ctx.http.get(format!("{}/health", engine.base)).timeout(timeout).send().await {
        Ok(r) => (r.status().is_success(), true),
        // The gateway is out of descriptors or ports: that says nothing about the engine.
        Err(e) if crate::error::is_local_resource_error(&e) => {
            ctx.metrics.local_resource_errors.inc();
            return;
        }
        Err(e) => (false, !e.is_timeout()),
    };
    if ok {
        engine.failures.store(0, Ordering::Relaxed);
        engine.seen_up.store(true, Ordering::Relaxed);
        if !ejected(ctx, engine) {
            set_healthy(ctx, engine, true);
        }
        if refresh_models || engine.models.lock().is_empty() {
            refresh_model_list(ctx, engine, timeout).await;
        }
        if engine.wants_server_info() {
            read_server_info(ctx, engine, timeout).await;
        }
    } else {
        check_failed(ctx, engine, engine_said);
    }
}

async fn refresh_model_list(ctx: &EngineContext, engine: &EngineHandle, timeout: Duration) {
    let Ok(resp) = ctx.http.get(format!("{}/v1/models", engine.base)).timeout(timeout).send().await else {
        return;
    };
    let Ok(body) = resp.json::<serde_json::Value>().await else {
        return;
    };
    let ids: Vec<String> = body
        .get("data")
        .and_then(|d| d.as_array())
        .map(|list| list.iter().filter_map(|m| m.get("id").and_then(|v| v.as_str()).map(str::to_owned)).collect())
        .unwrap_or_default();
    *engine.models.lock() = ids;
    ctx.registry.refresh_models();
}

async fn fetch(ctx: &EngineContext, url: String) -> Result<Vec<u8>, String> {
    let timeout = ctx.settings.poll_interval.max(Duration::from_millis(200)).min(Duration::from_secs(5));
    let resp = ctx.http.get(&url).timeout(timeout).send().await.map_err(|e| format!("{url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("{url}: HTTP {}", resp.status()));
    }
    resp.bytes().await.map(|b| b.to_vec()).map_err(|e| format!("{url}: {e}"))
}

async fn poll_load(ctx: &EngineContext, engine: &EngineHandle) {
    if let Some(worker) = &engine.grpc {
        return grpc::poll_load(ctx, engine, worker).await;
    }
    let kinds: &[EngineKind] = match (engine.spec.engine, *engine.telemetry.lock()) {
        (EngineKind::Sglang, _) | (EngineKind::Auto, Some(EngineKind::Sglang)) => &[EngineKind::Sglang],
        (EngineKind::Vllm, _) | (EngineKind::Auto, Some(EngineKind::Vllm)) => &[EngineKind::Vllm],
        (EngineKind::Auto, _) => &[EngineKind::Sglang, EngineKind::Vllm],
    };
    let mut last_err = String::new();
    for kind in kinds {
        // The report is stamped with the time it was asked for: the engine measured it after that,
        // and the ledger counts only what began before the stamp as seen by it. Stamped when the
        // answer arrived instead, a reply held up (a busy engine, a stalled gateway) would say that
        // requests dispatched or started meanwhile were already in it, and they would go uncounted.
        let asked_at = ctx.clock.now();
        let result = match kind {
            EngineKind::Sglang => fetch(ctx, format!("{}/v1/loads", engine.base))
                .await
                .and_then(|b| parse_sglang_loads(&b).map_err(|e| e.to_string())),
            _ => fetch(ctx, format!("{}/metrics", engine.base))
                .await
                .and_then(|b| parse_prometheus(&String::from_utf8_lossy(&b)).map_err(|e| e.to_string())),
        };
        match result {
            Ok(load) => {
                *engine.telemetry.lock() = Some(*kind);
                *engine.telemetry_error.lock() = None;
                observe_identity(ctx, engine, &load);
                let snapshot = to_snapshot(ctx, &load, asked_at);
                let _ = ctx.router.update_load(&engine.id, snapshot);
                return;
            }
            Err(e) => last_err = e,
        }
    }
    tracing::debug!(engine = %engine.id, error = %last_err, "load poll failed");
    *engine.telemetry_error.lock() = Some(last_err);
}

/// Acts on what a load report says about the engine itself: its block size (checked against the
/// gateway's), its KV capacity (used unless configured), its batch limit, and its process start
/// time (a change is a restart).
fn observe_identity(ctx: &EngineContext, engine: &EngineHandle, load: &EngineLoad) {
    let before = {
        let mut id = engine.identity.lock();
        let before = *id;
        id.start_time_s = load.process_start_time_s.or(id.start_time_s);
        id.max_running_requests = load.max_running_requests.or(id.max_running_requests);
        before
    };
    if let Some(bs) = load.block_size {
        observe_block_size(ctx, engine, bs, "vllm:cache_config_info");
    }
    if let Some(tokens) = load.kv_capacity_tokens.filter(|t| *t > 0) {
        observe_capacity(ctx, engine, tokens);
    }
    if let (Some(old), Some(new)) = (before.start_time_s, load.process_start_time_s) {
        if (old - new).abs() > 0.5 {
            tracing::info!(engine = %engine.id, old, new, "engine process restarted (process_start_time_seconds changed)");
            engine.stream.restarts.fetch_add(1, Ordering::Relaxed);
            resync(ctx, engine, "engine restarted");
        }
    }
}

/// Checks the block size an engine reports (`source` says where) against the gateway's: on a
/// mismatch no block key of kvgate's can match the engine's, so its KV view is dropped and marked
/// `invalid` with the fix; once they match again it is rebuilt.
fn observe_block_size(ctx: &EngineContext, engine: &EngineHandle, reported: u32, source: &str) {
    let before = engine.identity.lock().block_size.replace(reported);
    if before == Some(reported) {
        return;
    }
    let gateway = ctx.router.block_size();
    if reported != gateway {
        let problem = format!(
            "the engine reports block_size {reported} ({source}) but kvgate's block_size is {gateway}: \
             start kvgate with --block-size {reported}"
        );
        tracing::warn!(engine = %engine.id, "{problem}; no cache credit for it");
        *engine.config_problem.lock() = Some(problem.clone());
        let _ = ctx.router.clear_kv(&engine.id);
        let _ = ctx.router.set_kv_state(&engine.id, KvState::Invalid(problem));
    } else if engine.config_problem.lock().take().is_some() {
        resync(ctx, engine, "the engine's block size now matches");
    }
}

/// Takes the KV capacity an engine reports, unless the worker's configuration gives one.
fn observe_capacity(ctx: &EngineContext, engine: &EngineHandle, tokens: u64) {
    let before = engine.identity.lock().capacity_tokens.replace(tokens);
    if before != Some(tokens) && engine.spec.kv_capacity_tokens.is_none() {
        let _ = ctx.router.set_kv_capacity(&engine.id, tokens);
    }
}

/// The core's load snapshot from an engine's report (the core's conversion, which the simulator
/// runs too); what the engine does not report is estimated from counts (see
/// `assumed_prompt_tokens` and `assumed_decode_tokens`).
pub fn to_snapshot(ctx: &EngineContext, load: &EngineLoad, observed_at: Timestamp) -> LoadSnapshot {
    let assumed = CountAssumptions {
        prompt_tokens_per_waiting: ctx.settings.assumed_prompt_tokens,
        decode_tokens_per_running: ctx.settings.assumed_decode_tokens,
    };
    snapshot_from_report(load, assumed, observed_at)
}

#[cfg(test)]
mod discovery_tests {
    use super::{announced_kv_events, server_info_identity};
    use crate::config::WorkerSpec;
    use serde_json::json;

    #[test]
    fn sglang_announcements_become_kv_event_settings_on_the_engines_host() {
        let spec = WorkerSpec::new("http://10.0.0.7:30000");
        let info = json!({"kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
            "topic": "", "block_size": 16, "dp_size": 2, "replay_endpoint_port_base": 5558}});
        let s = announced_kv_events(&spec, &info).unwrap();
        assert_eq!((s.kv_events.as_deref(), s.replay.as_deref()), (Some(":5557"), Some(":5558")));
        assert_eq!((s.block_size, s.dp_size, s.topic.as_deref()), (Some(16), Some(2), Some("")));
        assert_eq!(s.kv_events_endpoint().as_deref(), Some("tcp://10.0.0.7:5557"), "a wildcard is the engine's host");
        let named = json!({"kv_events": {"publisher": "zmq", "endpoint_host": "10.0.0.9", "endpoint_port_base": 6000}});
        assert_eq!(announced_kv_events(&spec, &named).unwrap().kv_events.as_deref(), Some("tcp://10.0.0.9:6000"));
        let arg = json!({"kv_events_config": "{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}"});
        let s = announced_kv_events(&spec, &arg).unwrap();
        assert_eq!((s.kv_events.as_deref(), s.replay.as_deref()), (Some(":5557"), Some(":5558")));
        for none in [
            json!({"kv_events": {"publisher": "null"}}),
            json!({"version": "0.5"}),
            json!({"kv_events_config": "{\"publisher\": \"null\"}"}),
        ] {
            assert!(announced_kv_events(&spec, &none).is_none(), "{none}");
        }
    }

    #[test]
    fn an_sglang_server_info_gives_its_page_size_and_capacity() {
        // As SGLang 0.5.23 answers (trimmed): the server arguments at the top level, the announcement
        // under kv_events.
        let info = json!({"page_size": 32, "max_total_num_tokens": 16384, "max_running_requests": null,
            "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "block_size": 32}});
        assert_eq!(server_info_identity(&info), (Some(32), Some(16_384)));
        // Only the announcement: its block size.
        let announced = json!({"kv_events": {"publisher": "zmq", "block_size": 16}});
        assert_eq!(server_info_identity(&announced), (Some(16), None));
        for nothing in [
            json!({}),
            json!({"page_size": 0, "max_total_num_tokens": 0}),
            json!({"page_size": "32"}),
            json!({"page_size": 5_000_000_000u64}),
        ] {
            assert_eq!(server_info_identity(&nothing), (None, None), "{nothing}");
        }
    }
}
