//! Prometheus metrics, all named `kvgate_*`: counters and histograms updated on the request path,
//! and [`fleet`] gauges of the router's view refreshed at each scrape.

pub mod connections;
pub mod fleet;
pub mod replicas;
pub mod tokenize;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// `status` and `engine` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// HTTP status code sent to the client.
    pub status: String,
    /// Engine that served it (`none` when no engine was chosen).
    pub engine: String,
}

/// An `engine` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabel {
    /// The engine's worker id.
    pub engine: String,
}

/// A `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Decision reason or fallback reason.
    pub reason: String,
}

/// Every metric the gateway exports.
pub struct Metrics {
    registry: Registry,
    /// Requests by final status and engine.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to decide (tokenizing excluded), seconds.
    pub decision_latency: Histogram,
    /// Decisions by reason.
    pub decisions: Family<ReasonLabel, Counter>,
    /// Shadow decisions where enforce would have chosen another engine.
    pub shadow_disagreements: Counter,
    /// Escapes to the load-only winner (enforce, or would-be in shadow).
    pub escapes: Counter,
    /// New copies of a hot prefix made on the load-only winner (enforce, or would-be in shadow).
    pub replications: Counter,
    /// Requests sent to a worker holding more of the prompt than the projected winner, within the
    /// reuse slack (enforce, or would-be in shadow).
    pub reuses: Counter,
    /// Fallbacks to load-only by reason (enforce, or would-be in shadow).
    pub fallbacks: Family<ReasonLabel, Counter>,
    /// Upstream time to first byte, by engine.
    pub upstream_ttft: Family<EngineLabel, Histogram>,
    /// Upstream request duration, by engine.
    pub upstream_duration: Family<EngineLabel, Histogram>,
    /// Requests in flight, by engine.
    pub in_flight: Family<EngineLabel, Gauge>,
    /// Projected seconds of each engine at its latest scoring.
    pub projected_seconds: Family<EngineLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// The weight of uncached prefill at the latest decision: 1 / (1 − fleet prefill load).
    pub prefill_weight: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Requests retried on another engine before any byte reached the client.
    pub retries: Counter,
    /// KV events applied, by engine.
    pub kv_events: Family<EngineLabel, Counter>,
    /// KV event sequence gaps, by engine.
    pub kv_gaps: Family<EngineLabel, Counter>,
    /// KV event replays requested, by engine.
    pub kv_replays: Family<EngineLabel, Counter>,
    /// Engine restarts detected from sequence numbers, by engine.
    pub kv_restarts: Family<EngineLabel, Counter>,
    /// Undecodable KV event messages or events, by engine.
    pub kv_decode_errors: Family<EngineLabel, Counter>,
    /// Upstream failures blamed on the engine (5xx, timeouts, refused connects), by engine.
    pub upstream_failures: Family<EngineLabel, Counter>,
    /// Engines taken out of rotation by passive health (consecutive upstream failures).
    pub ejections: Family<EngineLabel, Counter>,
    /// Upstream calls that failed for lack of local resources (file descriptors, ports), not blamed
    /// on any engine.
    pub local_resource_errors: Counter,
    /// Per-engine gauges of the router's view, set at each scrape.
    pub fleet: fleet::FleetGauges,
    /// The prompt cache's counters, copied at each scrape.
    pub tokenize_cache: tokenize::TokenizeCacheMetrics,
    /// Rereads of the workers file.
    pub workers_file_reloads: Counter,
    /// Entries of the workers file that could not be used at its last reread.
    pub workers_file_errors: Gauge,
    /// The replica bus.
    pub replicas: replicas::ReplicaMetrics,
    /// Client connections: open, cap, shed.
    pub connections: connections::ConnectionMetrics,
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvgate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("requests", "Requests by final status and engine", requests.clone());
        let decision_latency = Histogram::new(exponential_buckets(1e-6, 2.0, 20));
        registry.register("decision_duration_seconds", "Time to decide and reserve", decision_latency.clone());
        let decisions = Family::<ReasonLabel, Counter>::default();
        registry.register("decisions", "Routing decisions by reason", decisions.clone());
        let shadow_disagreements = Counter::default();
        registry.register(
            "shadow_disagreements",
            "Shadow decisions where enforce would choose another engine",
            shadow_disagreements.clone(),
        );
        let escapes = Counter::default();
        registry.register("escapes", "Escapes from the cache winner to the load-only winner", escapes.clone());
        let replications = Counter::default();
        registry.register(
            "replications",
            "Requests sent to the load-only winner to copy a hot prefix there",
            replications.clone(),
        );
        let reuses = Counter::default();
        registry.register(
            "reuses",
            "Requests sent to a worker holding more of the prompt than the projected winner, within reuse_slack",
            reuses.clone(),
        );
        let fallbacks = Family::<ReasonLabel, Counter>::default();
        registry.register("fallbacks", "Load-only fallbacks by telemetry problem", fallbacks.clone());
        let upstream_ttft =
            Family::<EngineLabel, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register("upstream_ttft_seconds", "Upstream time to first byte", upstream_ttft.clone());
        let upstream_duration =
            Family::<EngineLabel, Histogram>::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register("upstream_duration_seconds", "Upstream request duration", upstream_duration.clone());
        let in_flight = Family::<EngineLabel, Gauge>::default();
        registry.register("in_flight", "Requests in flight per engine", in_flight.clone());
        let projected_seconds = Family::<EngineLabel, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "projected_seconds",
            "Projected seconds per engine at its latest scoring",
            projected_seconds.clone(),
        );
        let prefill_weight = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "prefill_weight",
            "Weight of uncached prefill at the latest decision: 1 / (1 - the fleet's prefill load), bounded by prefill_weight_max",
            prefill_weight.clone(),
        );
        let retries = Counter::default();
        registry.register(
            "retries",
            "Requests retried on another engine after a failure before any byte reached the client",
            retries.clone(),
        );
        let kv_events = Family::<EngineLabel, Counter>::default();
        registry.register("kv_events", "KV events applied to the index", kv_events.clone());
        let kv_gaps = Family::<EngineLabel, Counter>::default();
        registry.register("kv_gaps", "KV event sequence gaps", kv_gaps.clone());
        let kv_replays = Family::<EngineLabel, Counter>::default();
        registry.register("kv_replays", "KV event replays requested", kv_replays.clone());
        let kv_restarts = Family::<EngineLabel, Counter>::default();
        registry.register(
            "kv_restarts",
            "Engine restarts detected from KV event sequence numbers",
            kv_restarts.clone(),
        );
        let kv_decode_errors = Family::<EngineLabel, Counter>::default();
        registry.register("kv_decode_errors", "Undecodable KV event messages or events", kv_decode_errors.clone());
        let upstream_failures = Family::<EngineLabel, Counter>::default();
        registry.register(
            "upstream_failures",
            "Upstream failures blamed on the engine: server errors, timeouts, refused connects",
            upstream_failures.clone(),
        );
        let ejections = Family::<EngineLabel, Counter>::default();
        registry.register("ejections", "Engines ejected after consecutive upstream failures", ejections.clone());
        let local_resource_errors = Counter::default();
        registry.register(
            "local_resource_errors",
            "Upstream calls that failed for lack of the gateway's own resources (file descriptors, ports)",
            local_resource_errors.clone(),
        );
        let fleet = fleet::FleetGauges::register(&mut registry);
        let tokenize_cache = tokenize::TokenizeCacheMetrics::register(&mut registry);
        let workers_file_reloads = Counter::default();
        registry.register("workers_file_reloads", "Rereads of the workers file", workers_file_reloads.clone());
        let workers_file_errors = Gauge::default();
        registry.register(
            "workers_file_errors",
            "Entries of the workers file that could not be used at its last reread",
            workers_file_errors.clone(),
        );
        let replicas = replicas::ReplicaMetrics::register(&mut registry);
        let connections = connections::ConnectionMetrics::register(&mut registry);
        Metrics {
            connections,
            replicas,
            registry,
            fleet,
            tokenize_cache,
            workers_file_reloads,
            workers_file_errors,
            requests,
            decision_latency,
            decisions,
            shadow_disagreements,
            escapes,
            replications,
            reuses,
            fallbacks,
            upstream_ttft,
            upstream_duration,
            in_flight,
            projected_seconds,
            prefill_weight,
            retries,
            kv_events,
            kv_gaps,
            kv_replays,
            kv_restarts,
            kv_decode_errors,
            upstream_failures,
            ejections,
            local_resource_errors,
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        encode(&mut s, &self.registry).expect("writing to a String cannot fail");
        s
    }

    /// Counts a finished request.
    pub fn request(&self, status: u16, engine: Option<&str>) {
        self.requests
            .get_or_create(&RequestLabels { status: status.to_string(), engine: engine.unwrap_or("none").to_owned() })
            .inc();
    }

    /// A per-engine counter of `family`.
    pub fn engine_counter(family: &Family<EngineLabel, Counter>, engine: &str) -> Counter {
        family.get_or_create(&EngineLabel { engine: engine.to_owned() }).clone()
    }
}

/// One engine's metric handles, looked up once at registration so the request path allocates no
/// labels.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    /// `kvgate_in_flight{engine}`.
    pub in_flight: Gauge,
    /// `kvgate_upstream_ttft_seconds{engine}`.
    pub ttft: Histogram,
    /// `kvgate_upstream_duration_seconds{engine}`.
    pub duration: Histogram,
    /// `kvgate_projected_seconds{engine}`.
    pub projected: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// `kvgate_requests_total{status="200",engine}`, the common case.
    pub ok: Counter,
}

impl Metrics {
    /// The handles of one engine's series.
    pub fn for_engine(&self, engine: &str) -> EngineMetrics {
        let label = EngineLabel { engine: engine.to_owned() };
        let ok = RequestLabels { status: "200".into(), engine: engine.to_owned() };
        EngineMetrics {
            in_flight: self.in_flight.get_or_create(&label).clone(),
            ttft: self.upstream_ttft.get_or_create(&label).clone(),
            duration: self.upstream_duration.get_or_create(&label).clone(),
            projected: self.projected_seconds.get_or_create(&label).clone(),
            ok: self.requests.get_or_create(&ok).clone(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

#[cfg(test)]
mod doc_tests {
    use super::Metrics;

    /// Every metric the gateway registers has its row in docs/metrics.md's tables (a
    /// counter under its `_total` sample name), and every `kvgate_` row there is registered.
    #[test]
    fn metrics_doc_lists_every_metric_and_no_other() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/metrics.md")).unwrap();
        let documented: std::collections::BTreeSet<String> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `kvgate_")?.split('`').next().map(|n| format!("kvgate_{n}")))
            .collect();
        let registered: std::collections::BTreeSet<String> = Metrics::new()
            .render()
            .lines()
            .filter_map(|l| {
                let mut words = l.strip_prefix("# TYPE ")?.split_whitespace();
                let (name, kind) = (words.next()?, words.next()?);
                Some(if kind == "counter" { format!("{name}_total") } else { name.to_owned() })
            })
            .collect();
        let undocumented: Vec<_> = registered.difference(&documented).collect();
        let unknown: Vec<_> = documented.difference(&registered).collect();
        assert!(undocumented.is_empty(), "metrics missing from docs/metrics.md: {undocumented:?}");
        assert!(unknown.is_empty(), "docs/metrics.md lists metrics the gateway does not register: {unknown:?}");
    }
}
