//! Decision records: what was chosen, why, and the score terms behind it.

use std::fmt;

use serde::{Serialize, Serializer};

use crate::ids::{RequestId, WorkerId};
use crate::policy_name::{Mode, PolicyName};

/// Why a worker's telemetry could not be trusted for cache credit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FallbackReason {
    /// No load report has ever arrived.
    Missing,
    /// The load report is older than `stale_after_ms`, or KV events went quiet under traffic.
    Stale,
    /// KV events are missing (gap, unknown parent, no snapshot).
    Incomplete,
    /// KV events can't be trusted (undecodable, block-size mismatch).
    Invalid,
}

impl FallbackReason {
    /// The reason's name: `missing`, `stale`, `incomplete` or `invalid`.
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::Missing => "missing",
            FallbackReason::Stale => "stale",
            FallbackReason::Incomplete => "incomplete",
            FallbackReason::Invalid => "invalid",
        }
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FallbackReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Why the chosen worker was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The projected decision with cache credit (or the cache-aware affinity pick).
    CacheAndLoad,
    /// A load-only decision: mode `off`, `least_load`, or nothing cached anywhere.
    LoadOnly,
    /// `enforce` escaped from the cache winner to the load-only winner.
    Escape,
    /// `enforce` sent the request to the worker holding the longest cached prefix of it, dearer than
    /// the projected winner by at most `reuse_slack` of the winner's cost.
    Reuse,
    /// `enforce` sent the request to the load-only winner to make it a new copy of a hot prefix:
    /// the time the copy saves the prefix's later requests outweighs what it costs this one.
    Replicate,
    /// `enforce` chose at random among the few best workers, close in cost, because peer replicas
    /// decide at the same instants and would all have chosen the best one
    /// ([`crate::concurrent_peers`]).
    Spread,
    /// Cache credit was withheld because telemetry could not be trusted; the decision is load-only.
    Fallback(FallbackReason),
    /// `shadow`: dispatched as `off`, the enforce choice recorded beside it.
    Shadow,
    /// A baseline's own rule chose (`round_robin`, `random`, `power_of_two`); its name is the reason.
    Baseline(PolicyName),
}

impl Reason {
    /// The reason as it appears in records and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CacheAndLoad => "cache_and_load",
            Reason::LoadOnly => "load_only",
            Reason::Escape => "escape",
            Reason::Reuse => "reuse",
            Reason::Replicate => "replicate",
            Reason::Spread => "spread",
            Reason::Fallback(FallbackReason::Missing) => "fallback:missing",
            Reason::Fallback(FallbackReason::Stale) => "fallback:stale",
            Reason::Fallback(FallbackReason::Incomplete) => "fallback:incomplete",
            Reason::Fallback(FallbackReason::Invalid) => "fallback:invalid",
            Reason::Shadow => "shadow",
            Reason::Baseline(name) => name.as_str(),
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Reason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One worker's terms for one request, in seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreTerms {
    /// The worker.
    pub worker: WorkerId,
    /// `wait_s + decode_s + prefill_s + barrier_s`: seconds until this request's prefill would end.
    pub projected_s: f64,
    /// What `enforce` minimises: `projected_s` plus `(prefill_weight − 1) × prefill_s`, the time
    /// this request's uncached prefill keeps a busy fleet from the requests after it, plus
    /// `batch_delay_weight × batch_delay_s`.
    pub cost_s: f64,
    /// Prompt tokens credited as cached on this worker (0 unless its telemetry is trusted).
    pub cached_tokens: u64,
    /// Queued prefill work (engine-reported plus reserved) over prefill throughput.
    pub wait_s: f64,
    /// What the running batch adds: its share of each prefill step, and the wait for a slot when
    /// the batch is full.
    pub decode_s: f64,
    /// This request's uncached prompt over prefill throughput.
    pub prefill_s: f64,
    /// KV-pressure barrier for the projected usage with this request.
    pub barrier_s: f64,
    /// `prefill_s` times the running sequences: the delay this prefill adds to their next tokens.
    pub batch_delay_s: f64,
    /// The same sum with no cache credit: the least_load score.
    pub load_only_s: f64,
    /// Waiting requests (engine-reported plus reserved), used by the escape.
    pub waiting_requests: u64,
    /// The prefill rate this score used: configured, or calibrated from the engine's step cadence.
    pub prefill_tokens_per_s: f64,
    /// The decode rate this score used: configured, or calibrated from inter-token times.
    pub decode_tokens_per_s: f64,
    /// Why cache credit was withheld, when the worker holds a prefix of the request but its
    /// telemetry can't be trusted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credit_withheld: Option<FallbackReason>,
}

/// Everything about one decision. The chosen worker already holds the request's reservation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    /// The request.
    pub request: RequestId,
    /// The policy that decided.
    pub policy: PolicyName,
    /// The mode it ran in.
    pub mode: Mode,
    /// The worker the request is dispatched to.
    pub worker: WorkerId,
    /// Why.
    pub reason: Reason,
    /// The least_load winner for the same request.
    pub load_only_worker: WorkerId,
    /// What `enforce` chooses (in `shadow`, the counterfactual); `None` in `off`.
    pub enforce_worker: Option<WorkerId>,
    /// Why `enforce` chooses `enforce_worker` (in `shadow`: the escape or fallback it would have
    /// taken); `None` in `off`.
    pub enforce_reason: Option<Reason>,
    /// Prompt tokens of the request.
    pub prompt_tokens: u64,
    /// Prompt tokens credited as cached on the chosen worker.
    pub cached_tokens: u64,
    /// The weight of uncached prefill in `cost_s`: `1 / (1 − fleet prefill load)`, bounded by
    /// `prefill_weight_max`; 1 on an idle fleet.
    pub prefill_weight: f64,
    /// Score terms: every eligible worker when there are at most [`MAX_SCORES`], else the
    /// lowest-scoring ones plus the chosen worker and the load-only winner.
    pub scores: Vec<ScoreTerms>,
}

/// Workers listed in a decision's scores before the list is cut to the best ones.
pub const MAX_SCORES: usize = 16;

impl Decision {
    /// The admission measure: the chosen worker's projected queue (`wait_s + decode_s`), the
    /// seconds this request would wait there before its own prefill. The gateway and the simulator
    /// both refuse a request above their `admission_wait_s` on this number.
    pub fn admission_wait_s(&self) -> f64 {
        self.scores.iter().find(|s| s.worker == self.worker).map_or(0.0, |s| s.wait_s + s.decode_s)
    }

    /// In `shadow`, whether enforce would have chosen differently.
    pub fn shadow_disagrees(&self) -> bool {
        self.mode == Mode::Shadow && self.enforce_worker.as_ref() != Some(&self.worker)
    }
}
