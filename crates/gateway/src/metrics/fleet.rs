//! What the router believes about each engine, as gauges refreshed at every scrape: queues, KV
//! usage, the KV stream's state. They are read from the router when `/metrics` is asked for, so
//! they are never older than the router's own view, and an engine removed from the fleet leaves no
//! series behind.

use kvgate_core::step_cadence::StepAlignment;
use kvgate_core::{DecodeTiming, WorkerStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::EngineLabel;

/// `engine` and `state` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KvStateLabels {
    /// The engine's worker id.
    pub engine: String,
    /// `synced`, `incomplete`, `stale` or `invalid`.
    pub state: String,
}

/// `engine` and `rate` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RateLabels {
    /// The engine's worker id.
    pub engine: String,
    /// `configured`, `measured` (once calibration has a fit, whether or not it is on) or
    /// `planned` (what decisions use).
    pub rate: String,
}

/// `engine` and `timing` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecodeTimingLabels {
    /// The engine's worker id.
    pub engine: String,
    /// `decode_filled_blocks` or `streams`.
    pub timing: String,
}

/// `engine` and `alignment` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlignmentLabels {
    /// The engine's worker id.
    pub engine: String,
    /// `after_step` or `before_step`.
    pub alignment: String,
}

type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// The per-engine gauges of the router's view.
#[derive(Debug, Default)]
pub struct FleetGauges {
    waiting: Family<EngineLabel, Gauge>,
    running: Family<EngineLabel, Gauge>,
    kv_usage: Family<EngineLabel, FloatGauge>,
    blocks_held: Family<EngineLabel, Gauge>,
    eligible: Family<EngineLabel, Gauge>,
    load_age: Family<EngineLabel, FloatGauge>,
    kv_state: Family<KvStateLabels, Gauge>,
    prefill_rate: Family<RateLabels, FloatGauge>,
    decode_rate: Family<RateLabels, FloatGauge>,
    step_alignment: Family<AlignmentLabels, Gauge>,
    decode_timing: Family<DecodeTimingLabels, Gauge>,
}

const STATES: [&str; 4] = ["synced", "incomplete", "stale", "invalid"];

impl FleetGauges {
    /// Registers the gauges in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let g = FleetGauges::default();
        registry.register(
            "engine_waiting_requests",
            "Waiting requests per engine, as last reported and reconciled with kvgate's reservations",
            g.waiting.clone(),
        );
        registry.register(
            "engine_running_requests",
            "Running requests per engine, as last reported",
            g.running.clone(),
        );
        registry.register("engine_kv_usage_ratio", "KV cache usage per engine, from 0 to 1", g.kv_usage.clone());
        registry.register(
            "engine_blocks_held",
            "KV blocks kvgate's index holds for each engine",
            g.blocks_held.clone(),
        );
        registry.register("engine_eligible", "1 while an engine is in rotation, 0 while it is out", g.eligible.clone());
        registry.register(
            "engine_load_age_seconds",
            "Age of each engine's last load report (absent before the first)",
            g.load_age.clone(),
        );
        registry.register(
            "engine_prefill_tokens_per_second",
            "Each engine's prefill throughput: configured, measured from its step cadence, and planned with",
            g.prefill_rate.clone(),
        );
        registry.register(
            "engine_decode_tokens_per_second",
            "Each engine's full-batch decode throughput: configured, measured (from the blocks it fills while \
             decoding, or from streams' inter-token times), and planned with",
            g.decode_rate.clone(),
        );
        registry.register(
            "engine_step_alignment",
            "1 for how each engine's KV event batches line up with its steps, as the prefill fit found \
             (after_step, or before_step under vLLM's async scheduling), 0 for the other; absent before a fit",
            g.step_alignment.clone(),
        );
        registry.register(
            "engine_decode_timing",
            "1 for what times each engine's decode steps (decode_filled_blocks, once vLLM is seen publishing \
             them; streams otherwise), 0 for the other",
            g.decode_timing.clone(),
        );
        registry.register(
            "kv_state",
            "1 for each engine's current KV stream state (synced, incomplete, stale, invalid), 0 for the others",
            g.kv_state.clone(),
        );
        g
    }

    /// Sets every gauge from the router's view of `workers`, dropping the series of engines gone.
    pub fn observe(&self, workers: &[WorkerStatus]) {
        for family in [&self.waiting, &self.running, &self.blocks_held, &self.eligible] {
            family.clear();
        }
        self.kv_usage.clear();
        self.load_age.clear();
        self.kv_state.clear();
        self.prefill_rate.clear();
        self.decode_rate.clear();
        self.step_alignment.clear();
        self.decode_timing.clear();
        for w in workers {
            let engine = EngineLabel { engine: w.id.to_string() };
            let count = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            self.waiting.get_or_create(&engine).set(count(w.waiting_requests));
            self.running.get_or_create(&engine).set(count(w.running_requests));
            self.blocks_held.get_or_create(&engine).set(count(w.blocks_held as u64));
            self.eligible.get_or_create(&engine).set(i64::from(w.eligible));
            self.kv_usage.get_or_create(&engine).set(w.kv_usage);
            if let Some(ms) = w.load_age_ms {
                self.load_age.get_or_create(&engine).set(ms as f64 / 1000.0);
            }
            let rates =
                |family: &Family<RateLabels, FloatGauge>, configured: f64, measured: Option<f64>, planned: f64| {
                    let named = [("configured", Some(configured)), ("measured", measured), ("planned", Some(planned))];
                    for (rate, value) in named {
                        if let Some(v) = value {
                            family
                                .get_or_create(&RateLabels { engine: engine.engine.clone(), rate: rate.to_owned() })
                                .set(v);
                        }
                    }
                };
            rates(
                &self.prefill_rate,
                w.configured_prefill_tokens_per_s,
                w.measured_prefill_tokens_per_s,
                w.prefill_tokens_per_s,
            );
            rates(
                &self.decode_rate,
                w.configured_decode_tokens_per_s,
                w.measured_decode_tokens_per_s,
                w.decode_tokens_per_s,
            );
            if let Some(found) = w.step_alignment {
                for alignment in StepAlignment::ALL {
                    let labels =
                        AlignmentLabels { engine: engine.engine.clone(), alignment: alignment.name().to_owned() };
                    self.step_alignment.get_or_create(&labels).set(i64::from(alignment == found));
                }
            }
            for timing in DecodeTiming::ALL {
                let labels = DecodeTimingLabels { engine: engine.engine.clone(), timing: timing.name().to_owned() };
                self.decode_timing.get_or_create(&labels).set(i64::from(timing == w.decode_timing));
            }
            for state in STATES {
                let labels = KvStateLabels { engine: engine.engine.clone(), state: state.to_owned() };
                self.kv_state.get_or_create(&labels).set(i64::from(state == w.kv_state.name()));
            }
        }
    }
}
