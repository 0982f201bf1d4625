//! kvgate's mock engine: the simulator's engine model ([`kvgate_engine_model`]) served in real time
//! (divided by a speed-up) behind the endpoints SGLang and vLLM expose, with KV events over ZMQ.
//!
//! Layout:
//! - [`stepper`]: one task owns the engine, runs its steps in (scaled) real time and reports tokens.
//! - [`server`]: OpenAI chat and completions (streaming with `stream_options.include_usage`, and
//!   not), SGLang `/generate`, `/v1/models`, `/health`, SGLang-style `/v1/loads`, vLLM-style
//!   `/metrics`, and `/admin/fault` + `/admin/restart` for fault injection.
//! - [`events`]: the ZMQ PUB and replay ROUTER, in vLLM's or SGLang's wire format.
//! - [`grpc`]: with [`MockConfig::grpc`], SMG's gRPC worker protocol as vLLM or SGLang serves it
//!   (token ids in and out, KV events and load on `SubscribeKvEvents`), the HTTP surface moving to
//!   a port of its own; [`vocab`]: the mock model's tokenizer it hands over (`GetTokenizer`).
//!
//! Over HTTP, prompts are tokenized with kvgate's built-in tokenizer, so a gateway configured with
//! the built-in tokenizer computes the very token ids this engine caches and publishes. Over gRPC
//! the gateway sends the ids itself, tokenized with the mock model's tokenizer.

#![forbid(unsafe_code)]

pub mod events;
pub mod grpc;
pub mod server;
pub mod stepper;
pub mod vocab;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use kvgate_engine_model::{Engine, EngineProfile, Flavor};
use kvgate_worker_proto::sglang::sglang_scheduler_server::SglangSchedulerServer;
use kvgate_worker_proto::vllm::vllm_engine_server::VllmEngineServer;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub use events::EventFormat;

/// Faults to inject, changeable at runtime through `POST /admin/fault`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Faults {
    /// Fraction of live KV batches dropped (replays still have them).
    pub drop_events: f64,
    /// Delay added to every live KV batch.
    #[serde(with = "millis")]
    pub delay_events: Duration,
    /// Fraction of requests answered with HTTP 500 before any byte.
    pub fail_requests: f64,
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

impl Faults {
    /// Checks the fractions.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [("drop_events", self.drop_events), ("fail_requests", self.fail_requests)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} = {v} is out of range: expected a fraction from 0 to 1"));
            }
        }
        Ok(())
    }
}

/// How to run a mock engine.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Listen address of HTTP and ZMQ.
    pub host: String,
    /// HTTP port (0: any).
    pub port: u16,
    /// KV-event PUB port (0: any).
    pub kv_port: u16,
    /// Replay ROUTER port (0: any).
    pub replay_port: u16,
    /// The engine model's profile.
    pub profile: EngineProfile,
    /// Model time runs this many times faster than real time.
    pub speedup: f64,
    /// Wire format of KV events.
    pub format: EventFormat,
    /// The model name served.
    pub model: String,
    /// Faults at start.
    pub faults: Faults,
    /// Seed of the engine's block hashes.
    pub seed: u64,
    /// Serve SMG's gRPC worker protocol on `port` instead of HTTP, as the runtime `format` names
    /// (vLLM's engine servicer or SGLang's scheduler); the HTTP surface (admin, `/metrics`,
    /// `/v1/loads`) then listens on `http_port`.
    pub grpc: bool,
    /// The HTTP port in gRPC mode (0: any); unused otherwise.
    pub http_port: u16,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            host: "127.0.0.1".into(),
            port: 0,
            kv_port: 0,
            replay_port: 0,
            profile: EngineProfile::llama3_8b_h100(),
            speedup: 1.0,
            format: EventFormat::Vllm,
            model: "mock-model".into(),
            faults: Faults::default(),
            seed: 1,
            grpc: false,
            http_port: 0,
        }
    }
}

/// A running mock engine.
#[derive(Debug, Clone)]
pub struct MockEngine {
    /// The worker URL a gateway is given: the HTTP base URL, or `grpc://host:port` in gRPC mode.
    pub url: String,
    /// The HTTP base URL (admin, metrics, loads), the same as `url` unless in gRPC mode.
    pub http_url: String,
    /// KV-event PUB endpoint.
    pub kv_events: String,
    /// Replay endpoint.
    pub replay: String,
    /// Counters and load.
    pub shared: Arc<stepper::Shared>,
    /// Commands to the engine.
    pub commands: mpsc::UnboundedSender<stepper::Command>,
    /// Current faults.
    pub faults: Arc<Mutex<Faults>>,
    /// Tokens of the block size, for gateways to match.
    pub block_size: u32,
    publisher: Arc<kvgate_zmtp::PubSocket>,
    tasks: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl MockEngine {
    /// Starts the engine, its HTTP server and its event sockets on the current tokio runtime.
    pub async fn start(cfg: MockConfig) -> Result<MockEngine, String> {
        if !(cfg.speedup.is_finite() && cfg.speedup > 0.0 && cfg.speedup <= 10_000.0) {
            return Err(format!("speedup = {} is out of range: expected more than 0, at most 10000", cfg.speedup));
        }
        cfg.faults.validate()?;
        let clock = kvgate_clock::Clock::start();
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (batch_tx, batch_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(stepper::Shared::new());
        let faults = Arc::new(Mutex::new(cfg.faults.clone()));
        let sockets =
            events::start(&cfg.host, cfg.kv_port, cfg.replay_port, cfg.format, faults.clone(), batch_rx, clock)
                .await
                .map_err(|e| format!("cannot bind the KV event sockets: {e}"))?;
        // The model follows the conventions of the engine whose events it speaks: vLLM publishes
        // decode-filled blocks, SGLang opens every process with `AllBlocksCleared`.
        let flavor = match cfg.format {
            EventFormat::Sglang => Flavor::Sglang,
            EventFormat::Vllm => Flavor::Vllm,
        };
        let engine = Engine::new(EngineProfile { flavor, ..cfg.profile.clone() }, cfg.seed);
        let block_size = cfg.profile.block_size;
        let stepper = tokio::spawn(stepper::run(engine, cfg.speedup, cmd_rx, batch_tx, shared.clone(), clock));
        let http_port = if cfg.grpc { cfg.http_port } else { cfg.port };
        let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), http_port))
            .await
            .map_err(|e| format!("cannot listen on {}:{http_port}: {e}", cfg.host))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let port_of = |e: &str| e.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
        // SGLang announces where it publishes (engine-protocols.md §1); vLLM has no such route.
        let server_info = (cfg.format == EventFormat::Sglang).then(|| {
            serde_json::json!({"kv_events": {
                "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": port_of(&sockets.pub_endpoint),
                "topic": cfg.format.topic(), "block_size": cfg.profile.block_size, "dp_size": 1,
                "replay_endpoint_port_base": port_of(&sockets.replay_endpoint)}})
        });
        let http_state = server::ServerState {
            server_info,
            commands: cmd_tx.clone(),
            shared: shared.clone(),
            faults: faults.clone(),
            model: cfg.model.clone(),
            next_id: Arc::new(AtomicU64::new(1)),
            rng: Arc::new(Mutex::new(<rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(cfg.seed))),
            capacity_tokens: cfg.profile.kv_capacity_tokens,
            block_size,
        };
        let app = server::routes(http_state.clone());
        let mut tasks = vec![stepper.abort_handle()];
        let mut url = format!("http://{addr}");
        let http_url = url.clone();
        if cfg.grpc {
            let scheduler = grpc::MockScheduler {
                engine: http_state,
                max_running: cfg.profile.max_running,
                live: sockets.live.clone(),
                published_seq: sockets.published_seq.clone(),
                running: Arc::default(),
            };
            let grpc_listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
                .await
                .map_err(|e| format!("cannot listen on {}:{}: {e}", cfg.host, cfg.port))?;
            url = format!("grpc://{}", grpc_listener.local_addr().map_err(|e| e.to_string())?);
            // The runtime the events speak: vLLM's engine servicer or SGLang's scheduler.
            let (health, health_service) = tonic_health::server::health_reporter();
            let router = match cfg.format {
                EventFormat::Vllm => {
                    health.set_serving::<VllmEngineServer<grpc::MockScheduler>>().await;
                    tonic::transport::Server::builder().add_service(scheduler.into_vllm())
                }
                EventFormat::Sglang => {
                    health.set_serving::<SglangSchedulerServer<grpc::MockScheduler>>().await;
                    tonic::transport::Server::builder().add_service(scheduler.into_sglang())
                }
            };
            let incoming = tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true));
            let server = tokio::spawn(async move {
                let served = router.add_service(health_service).serve_with_incoming(incoming).await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "mock engine gRPC server failed");
                }
            });
            tasks.push(server.abort_handle());
        }
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "mock engine server failed");
            }
        });
        tasks.push(server.abort_handle());
        Ok(MockEngine {
            url,
            http_url,
            kv_events: sockets.pub_endpoint,
            replay: sockets.replay_endpoint,
            publisher: sockets.publisher,
            shared,
            commands: cmd_tx,
            faults,
            block_size,
            tasks: Arc::new(Mutex::new(tasks)),
        })
    }

    /// Stops serving (the process "dies"): HTTP and the engine stop; connections drop.
    pub fn kill(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }

    /// Subscribers listening to the KV events now (a gateway counts once its subscription arrived):
    /// events published before are lost to it, as with a real engine, so tests wait for this.
    pub fn kv_subscribers(&self) -> usize {
        self.publisher.subscribers()
    }

    /// `SubscribeKvEvents` streams open now (gRPC mode): batches published before a gateway's
    /// stream opened are lost to it, as with a real worker, so tests wait for this.
    pub fn grpc_event_streams(&self) -> u64 {
        self.shared.event_streams.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Prompt tokens admitted and cached so far.
    pub fn cache_counters(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.shared.prompt_tokens.load(Relaxed), self.shared.cached_tokens.load(Relaxed))
    }
}
