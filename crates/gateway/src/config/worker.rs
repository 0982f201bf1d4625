//! One engine's settings: a `[[workers]]` table, or the same keys given compactly on the command line
//! (`--worker 'http://10.0.0.7:8000,kv_events=:5557,replay=:5558'`).
//!
//! KV events come over ZMQ, and which side binds depends on how the engine was started. vLLM's
//! `--kv-events-config` `endpoint` binds its PUB socket when the host is a wildcard (`tcp://*:5557`)
//! and *connects* otherwise (`tcp://10.0.0.2:5557` dials the gateway at 10.0.0.2). So kvgate connects
//! by default (`kv_events = "tcp://ENGINE:5557"`, or `:5557` for the engine's own host) and binds with
//! `kv_events_bind = true` (`kv_events = "tcp://*:5557"` or `:5557` then listen on every interface).
//! The replay endpoint is always bound by the engine, so kvgate always connects to it.

use serde::{Deserialize, Serialize};

use kvgate_core::{CHUNK_TOKENS, DECODE_TOKENS_PER_S, KV_CAPACITY_TOKENS, MAX_RUNNING_REQUESTS, PREFILL_TOKENS_PER_S};

use crate::GatewayError;

/// Which engine a worker runs; decides how its load is polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Try SGLang's `/v1/loads`, then Prometheus `/metrics`.
    #[default]
    Auto,
    /// SGLang: `/v1/loads`.
    Sglang,
    /// vLLM: `/metrics`.
    Vllm,
}

/// One engine endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    /// Base URL, e.g. `http://10.0.0.7:8000`.
    pub url: String,
    /// Name in logs, metrics and the admin API (default: the URL's host:port).
    #[serde(default)]
    pub id: Option<String>,
    /// Engine kind.
    #[serde(default)]
    pub engine: EngineKind,
    /// Prefill throughput, tokens per second.
    #[serde(default)]
    pub prefill_tokens_per_s: Option<f64>,
    /// Decode throughput, tokens per second.
    #[serde(default)]
    pub decode_tokens_per_s: Option<f64>,
    /// KV capacity in tokens (default: what the engine reports, else 500,000).
    #[serde(default)]
    pub kv_capacity_tokens: Option<u64>,
    /// Largest running batch (the engine's `--max-num-seqs` or `--max-running-requests`).
    #[serde(default)]
    pub max_running_requests: Option<u64>,
    /// Tokens one engine step computes (`--max-num-batched-tokens` or `--chunked-prefill-size`).
    #[serde(default)]
    pub chunk_tokens: Option<u64>,
    /// ZMQ endpoint of the engine's KV-event stream: `tcp://host:port`, or `:port` on the worker's
    /// own host.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Bind `kv_events` instead of connecting to it, for engines whose PUB socket connects (vLLM
    /// with a non-wildcard `endpoint`).
    #[serde(default)]
    pub kv_events_bind: Option<bool>,
    /// ZMQ endpoint of the engine's replay socket (`tcp://host:port` or `:port`).
    #[serde(default)]
    pub replay: Option<String>,
    /// KV-event topic.
    #[serde(default)]
    pub topic: Option<String>,
    /// The engine's block size, when it differs from the fleet's (such a worker is refused cache
    /// credit).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Data-parallel ranks publishing events: rank r publishes on the `kv_events` port + r (and
    /// replays on the `replay` port + r), as vLLM and SGLang do. Default 1.
    #[serde(default)]
    pub dp_size: Option<u16>,
    /// Without `kv_events`, find the engine's KV events by themselves: an HTTP engine's `GET
    /// /server_info` says where it publishes them (SGLang announces its KV-events configuration
    /// there); a gRPC worker streams them itself (`SubscribeKvEvents`). Default: on, unless
    /// `engine = "vllm"` on an HTTP engine; always on for gRPC workers unless set to false.
    #[serde(default)]
    pub discover_kv_events: Option<bool>,
}

/// `url` without its userinfo (`user:secret@`), which must never reach a label, a log line or a
/// response.
pub fn redact_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut u) if !u.username().is_empty() || u.password().is_some() => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        Ok(_) => url.to_owned(),
        // Unparseable (refused by validation anyway): cut the authority up to its last `@`.
        Err(_) => {
            let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
                None => url.to_owned(),
            }
        }
    }
}

/// `tcp://host:port` with the port moved up by `offset` (the endpoint of data-parallel rank `offset`).
pub fn rank_endpoint(endpoint: &str, offset: u16) -> Option<String> {
    let (head, port) = endpoint.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    Some(format!("{head}:{}", port.checked_add(offset)?))
}

/// Hosts that mean "every interface", which only a binding socket can use.
fn is_wildcard(host: &str) -> bool {
    matches!(host, "*" | "0.0.0.0" | "[::]" | "::")
}

impl WorkerSpec {
    /// A worker at `url` with defaults.
    pub fn new(url: impl Into<String>) -> Self {
        WorkerSpec {
            url: url.into(),
            id: None,
            engine: EngineKind::Auto,
            prefill_tokens_per_s: None,
            decode_tokens_per_s: None,
            kv_capacity_tokens: None,
            max_running_requests: None,
            chunk_tokens: None,
            kv_events: None,
            kv_events_bind: None,
            replay: None,
            topic: None,
            block_size: None,
            dp_size: None,
            discover_kv_events: None,
        }
    }

    /// Parses the compact form: a URL, then any `[[workers]]` keys as `key=value`, comma-separated,
    /// e.g. `http://10.0.0.7:8000,id=a,engine=vllm,kv_events=:5557,replay=:5558,block_size=32`.
    pub fn parse_compact(text: &str) -> Result<Self, GatewayError> {
        let mut parts = text.split(',');
        let url = parts.next().unwrap_or_default().trim();
        let mut table = toml::Table::new();
        table.insert("url".into(), toml::Value::String(url.to_owned()));
        for part in parts.map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| {
                GatewayError::Config(format!("--worker {text:?}: {part:?} is not key=value (keys as in [[workers]])"))
            })?;
            let (key, value) = (key.trim(), value.trim());
            // Numbers and booleans as TOML reads them; anything else is a string.
            let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .filter(|v| !v.is_str() && !v.is_table() && !v.is_array())
                .unwrap_or_else(|| toml::Value::String(value.to_owned()));
            if table.insert(key.to_owned(), parsed).is_some() {
                return Err(GatewayError::Config(format!("--worker {text:?}: {key} is given twice")));
            }
        }
        let spec: WorkerSpec = table
            .try_into()
            .map_err(|e: toml::de::Error| GatewayError::Config(format!("--worker {text:?}: {}", e.message())))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Whether the worker speaks SMG's gRPC worker protocol (`grpc://host:port`) rather than serving
    /// the OpenAI API over HTTP.
    pub fn is_grpc(&self) -> bool {
        self.url.starts_with("grpc://")
    }

    /// The worker's id: the configured one, or the URL without its scheme.
    pub fn id(&self) -> String {
        self.id.clone().unwrap_or_else(|| {
            let u = redact_url(&self.url);
            let u = u.trim_end_matches('/');
            u.split_once("://").map_or(u, |(_, rest)| rest).to_owned()
        })
    }

    /// The URL as logs and the admin API show it: any `user:password@` removed.
    pub fn display_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The host of the worker's URL.
    fn url_host(&self) -> Option<String> {
        let url = reqwest::Url::parse(&self.url).ok()?;
        let host = url.host_str()?;
        Some(if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_owned() })
    }
    /// The gRPC worker behind a `grpc://` URL, with the runtime `engine` names (`None`: not a gRPC
    /// worker, or a URL validation refuses). Nothing connects yet.
    pub fn grpc_worker(&self, connect_timeout: std::time::Duration) -> Option<crate::grpc_worker::GrpcWorker> {
        let runtime = match self.engine {
            EngineKind::Vllm => Some(crate::grpc_worker::GrpcRuntime::Vllm),
            EngineKind::Sglang => Some(crate::grpc_worker::GrpcRuntime::Sglang),
            EngineKind::Auto => None,
        };
        self.is_grpc().then(|| crate::grpc_worker::GrpcWorker::new(&self.url, runtime, connect_timeout).ok()).flatten()
    }

    /// Whether kvgate binds the KV-event endpoint.
    pub fn binds_kv_events(&self) -> bool {
        self.kv_events_bind.unwrap_or(false)
    }

    /// The endpoint kvgate's subscriber connects to or binds, resolved: `:port` takes the worker's
    /// host (or every interface when binding), and a wildcard host is written as ZMQ needs it.
    pub fn kv_events_endpoint(&self) -> Option<String> {
        let raw = self.kv_events.as_deref()?;
        self.resolve(raw, self.binds_kv_events())
    }

    /// The replay endpoint, resolved like [`Self::kv_events_endpoint`] (always connected to).
    pub fn replay_endpoint(&self) -> Option<String> {
        let raw = self.replay.as_deref()?;
        self.resolve(raw, false)
    }

    fn resolve(&self, raw: &str, bind: bool) -> Option<String> {
        let (host, port) = match raw.strip_prefix("tcp://") {
            Some(rest) => rest.rsplit_once(':')?,
            None => ("", raw.strip_prefix(':')?),
        };
        let host = match host {
            "" if bind => "0.0.0.0".to_owned(),
            "" => self.url_host()?,
            "*" => "0.0.0.0".to_owned(),
            h => h.to_owned(),
        };
        Some(format!("tcp://{host}:{port}"))
    }

    /// Checks the URL, the endpoints and the numbers.
    pub fn validate(&self) -> Result<(), GatewayError> {
        let url = reqwest::Url::parse(&self.url)
            .map_err(|e| GatewayError::Config(format!("worker url {:?}: {e}", self.url)))?;
        if !matches!(url.scheme(), "http" | "https" | "grpc") {
            return Err(GatewayError::Config(format!(
                "worker url {:?}: scheme must be http or https (an OpenAI HTTP server) or grpc (SMG's gRPC worker protocol)",
                self.url
            )));
        }
        if self.is_grpc() {
            crate::grpc_worker::channel_uri(&self.url).map_err(|e| GatewayError::Config(format!("worker url {e}")))?;
        }
        if url.host_str().is_none() {
            return Err(GatewayError::Config(format!("worker url {:?}: no host", self.url)));
        }
        let id = self.id();
        for (key, v) in [("kv_events", &self.kv_events), ("replay", &self.replay)] {
            let Some(ep) = v else { continue };
            let shape_ok = match ep.strip_prefix("tcp://") {
                Some(rest) => rest.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok()),
                None => ep.strip_prefix(':').is_some_and(|p| p.parse::<u16>().is_ok()),
            };
            if !shape_ok {
                return Err(GatewayError::Config(format!(
                    "worker {id}: {key} {ep:?} must look like tcp://host:port or :port (ipc:// is not supported)"
                )));
            }
            let host = ep.strip_prefix("tcp://").and_then(|r| r.rsplit_once(':')).map_or("", |(h, _)| h);
            let binds = key == "kv_events" && self.binds_kv_events();
            if is_wildcard(host) && !binds {
                let hint = if key == "replay" {
                    "the engine binds its replay socket; give the engine's address (tcp://ENGINE:port or :port)"
                } else {
                    "a wildcard is the engine binding its PUB socket: give the engine's address (tcp://ENGINE:port \
                     or :port), or set kv_events_bind = true if kvgate should listen"
                };
                return Err(GatewayError::Config(format!("worker {id}: {key} {ep:?} has a wildcard host: {hint}")));
            }
        }
        if self.kv_events_bind.is_some() && self.kv_events.is_none() {
            return Err(GatewayError::Config(format!("worker {id}: kv_events_bind needs kv_events")));
        }
        if self.dp_size == Some(0) || self.dp_size.is_some_and(|d| d > 1024) {
            return Err(GatewayError::Config(format!("worker {id}: dp_size must be from 1 to 1024")));
        }
        if let Some(ep) = self.kv_events.as_deref().and(self.kv_events_endpoint()) {
            let top = self.dp_size.unwrap_or(1).saturating_sub(1);
            for (key, ep) in [("kv_events", Some(ep)), ("replay", self.replay_endpoint())] {
                if let Some(ep) = ep {
                    if rank_endpoint(&ep, top).is_none() {
                        return Err(GatewayError::Config(format!(
                            "worker {id}: {key} port + dp_size - 1 is past 65535"
                        )));
                    }
                }
            }
        }
        if id.trim().is_empty() {
            return Err(GatewayError::Config(format!("worker url {:?}: empty id", self.url)));
        }
        if self.block_size == Some(0) {
            return Err(GatewayError::Config(format!("worker {id}: block_size must be at least 1")));
        }
        for (knob, v) in [
            (PREFILL_TOKENS_PER_S, self.prefill_tokens_per_s),
            (DECODE_TOKENS_PER_S, self.decode_tokens_per_s),
            (KV_CAPACITY_TOKENS, self.kv_capacity_tokens.map(|v| v as f64)),
            (MAX_RUNNING_REQUESTS, self.max_running_requests.map(|v| v as f64)),
            (CHUNK_TOKENS, self.chunk_tokens.map(|v| v as f64)),
        ] {
            if let Some(v) = v {
                knob.check(v).map_err(|e| GatewayError::Config(format!("worker {id}: {e}")))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_a_worker_url_never_reach_its_name_or_display() {
        let w = WorkerSpec::parse_compact("http://user:s3cret@10.0.0.7:8000/").unwrap();
        assert_eq!(w.id(), "10.0.0.7:8000");
        assert_eq!(w.display_url(), "http://10.0.0.7:8000/");
        assert_eq!(redact_url("http://10.0.0.7:8000"), "http://10.0.0.7:8000");
        assert_eq!(redact_url("http://u:p@c@host:99999/x"), "http://host:99999/x");
    }

    #[test]
    fn data_parallel_ranks_publish_on_consecutive_ports() {
        assert_eq!(rank_endpoint("tcp://10.0.0.1:5557", 0).as_deref(), Some("tcp://10.0.0.1:5557"));
        assert_eq!(rank_endpoint("tcp://10.0.0.1:5557", 3).as_deref(), Some("tcp://10.0.0.1:5560"));
        assert_eq!(rank_endpoint("tcp://h:65535", 1), None);
    }

    #[test]
    fn the_compact_form_takes_any_workers_key() {
        let w = WorkerSpec::parse_compact(
            "http://10.0.0.7:8000,id=a,engine=vllm,kv_events=:5557,replay=:5558,block_size=32,dp_size=2,prefill_tokens_per_s=9000.5",
        )
        .unwrap();
        assert_eq!(w.id(), "a");
        assert_eq!(w.engine, EngineKind::Vllm);
        assert_eq!((w.block_size, w.dp_size, w.prefill_tokens_per_s), (Some(32), Some(2), Some(9000.5)));
        assert_eq!(w.kv_events_endpoint().as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(w.replay_endpoint().as_deref(), Some("tcp://10.0.0.7:5558"));
        assert!(!w.binds_kv_events());
        let plain = WorkerSpec::parse_compact("http://h:1").unwrap();
        assert_eq!(plain, WorkerSpec::new("http://h:1"));
    }

    #[test]
    fn binding_resolves_wildcards_and_bare_ports_to_every_interface() {
        let w = WorkerSpec::parse_compact("http://10.0.0.7:8000,kv_events=:5557,kv_events_bind=true").unwrap();
        assert!(w.binds_kv_events());
        assert_eq!(w.kv_events_endpoint().as_deref(), Some("tcp://0.0.0.0:5557"));
        let w = WorkerSpec::parse_compact("http://h:1,kv_events=tcp://*:5557,kv_events_bind=true").unwrap();
        assert_eq!(w.kv_events_endpoint().as_deref(), Some("tcp://0.0.0.0:5557"));
        let w = WorkerSpec::parse_compact("http://[::1]:8000,kv_events=:5557").unwrap();
        assert_eq!(w.kv_events_endpoint().as_deref(), Some("tcp://[::1]:5557"));
    }

    #[test]
    fn mistakes_are_named() {
        let err = |t: &str| WorkerSpec::parse_compact(t).unwrap_err().to_string();
        assert!(err("http://h:1,colour=red").contains("unknown field `colour`"), "{}", err("http://h:1,colour=red"));
        assert!(err("http://h:1,kv_events").contains("not key=value"));
        assert!(err("http://h:1,id=a,id=b").contains("twice"));
        assert!(err("http://h:1,kv_events=tcp://*:5557").contains("wildcard"));
        assert!(err("http://h:1,kv_events=:5557,replay=tcp://*:5558").contains("replay"));
        assert!(err("http://h:1,kv_events=ipc:///tmp/x").contains("ipc"));
        assert!(err("http://h:1,kv_events_bind=true").contains("needs kv_events"));
        assert!(err("http://h:1,kv_events=:65535,dp_size=2").contains("65535"));
        assert!(err("http://h:1,dp_size=0").contains("dp_size"));
        assert!(err("ftp://h:1").contains("scheme"));
        assert!(err("grpc://h:1/v1").contains("without a path"));
        assert!(WorkerSpec::parse_compact("grpc://10.0.0.7:50051,engine=sglang").unwrap().is_grpc());
    }
}
