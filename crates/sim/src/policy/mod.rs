//! Routing policies in the loop: kvgate's own (the real core `Router`) and faithful reimplementations
//! of the peers' algorithms (`shared/docs/peer-policies.md`), behind one trait.
//!
//! | CLI name | what | file |
//! |---|---|---|
//! | `projected` (`:off`, `:shadow`, `:enforce`) | kvgate's core, projected policy | `core_backed.rs` |
//! | `oracle` | `projected:enforce` handed every engine's true load at each decision | `core_backed.rs` |
//! | `cache_aware`, `cache_aware_seeded` | SMG cache_aware, event-driven, via the core | `core_backed.rs` |
//! | `smg_cache_aware` | SMG 1.13's cache_aware as shipped: `cache_aware` with its guards (capped spill margin, worker overload protection) | `core_backed.rs` |
//! | `round_robin`, `random`, `power_of_two` | kvgate's core baselines, as the gateway runs them (SMG §9; §2 scored with kvgate's load-only seconds) | `core_backed.rs` |
//! | `smg_least_load`, `smg_power_of_two` | SMG 1.13's `least_load` (its expected wait, on its 10-second poll) §1, and on a random pair §2, over HTTP workers, overload veto on | `simple.rs` |
//! | `smg_cache_aware_http` | SMG 1.13's cache_aware over HTTP workers: its own tree of what it sent, guards on | `approx.rs` |
//! | `sglang_v04`, `aibrix`, `lmetric` | approximate prefix trees §4, §7, §8 | `approx.rs` |
//! | `dynamo`, `llm_d` | exact-event KV indexes §5, §6 | `exact.rs` |

pub mod approx;
pub mod core_backed;
pub mod exact;
pub mod simple;
pub mod smg_wait;

use kvgate_core::{
    BatchWindows, BlockKey, HeldReservation, KvState, LoadSnapshot, Mode, PolicyConfig, Reason, ReplicaId, RequestId,
    ReservationChange, Timestamp,
};
use kvgate_protocol::KvEvent;
use rand_chacha::ChaCha8Rng;

use crate::SimError;

/// What the router knows about one engine, kept by the simulator for every policy alike.
#[derive(Debug, Clone, Default)]
pub struct WorkerView {
    /// The last polled load report.
    pub snapshot: Option<LoadSnapshot>,
    /// Requests dispatched by this router and not yet finished.
    pub in_flight: u64,
    /// Prompt tokens dispatched since the last report (SMG's since-poll credit).
    pub sent_tokens_since_poll: u64,
    /// Requests dispatched since the last report.
    pub sent_requests_since_poll: u64,
    /// Requests routed here so far.
    pub routed: u64,
    /// Whether the engine is reachable (health checks pass).
    pub healthy: bool,
}

/// A request as a policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct PolicyRequest<'a> {
    /// Its id.
    pub id: RequestId,
    /// Router block keys of the prompt at the fleet's block size.
    pub keys: &'a [BlockKey],
    /// Router block keys of the prompt at 16-token pages, for the approximate trees.
    pub page_keys: &'a [BlockKey],
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens it may generate.
    pub max_tokens: u64,
}

/// The rates a policy holds for one worker (tokens per second, prefill then decode).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerRates {
    /// What decisions plan with.
    pub planned: (f64, f64),
    /// What was measured, where something was (see [`crate::report::WorkerReport`]).
    pub measured: (Option<f64>, Option<f64>),
}

/// A policy's choice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    /// The engine.
    pub worker: usize,
    /// kvgate policies: why.
    pub reason: Option<Reason>,
    /// `shadow`: whether `enforce` would have chosen differently.
    pub shadow_disagrees: Option<bool>,
    /// kvgate policies: prompt tokens credited as cached on the chosen engine.
    pub cached_tokens: Option<u64>,
    /// kvgate policies: the decision's admission measure ([`kvgate_core::Decision::admission_wait_s`]).
    pub admission_wait_s: Option<f64>,
}

impl Pick {
    /// A pick with nothing else to say.
    pub fn of(worker: usize) -> Self {
        Pick { worker, reason: None, shadow_disagrees: None, cached_tokens: None, admission_wait_s: None }
    }
}

/// The fleet facts a policy is built with.
#[derive(Debug, Clone)]
pub struct FleetInfo {
    /// Engines.
    pub workers: usize,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Engine prefill throughput.
    pub prefill_tokens_per_s: f64,
    /// Engine decode throughput estimate.
    pub decode_tokens_per_s: f64,
    /// Engine KV capacity.
    pub kv_capacity_tokens: u64,
    /// Engine running-batch limit.
    pub max_running_requests: u64,
    /// Engine step token budget.
    pub chunk_tokens: u64,
    /// Engine 0's configured throughputs over its real ones (a misconfigured worker; 1 = right).
    pub first_worker_rate_scale: f64,
}

/// A routing policy driven by the simulator.
pub trait SimPolicy {
    /// Chooses an engine among the healthy ones, or `None` if none is.
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick>;
    /// A load report arrived.
    fn on_load(&mut self, _worker: usize, _snapshot: &LoadSnapshot) {}
    /// KV events from an engine, in sequence order.
    fn on_kv_events(&mut self, _worker: usize, _events: &[KvEvent], _now: Timestamp) {}
    /// A live batch of KV events arrived, published at the end of the engine step that ended at
    /// `engine_time` (the engine's clock, as the real engines stamp their batches), at `received`.
    fn on_engine_step(&mut self, _worker: usize, _events: &[KvEvent], _engine_time: Timestamp, _received: Timestamp) {}
    /// The event consumer's verdict on an engine's stream; `clear` first forgets its blocks.
    fn on_kv_state(&mut self, _worker: usize, _state: KvState, _clear: bool) {}
    /// A request produced its first token.
    fn on_first_token(&mut self, _id: RequestId, _now: Timestamp) {}
    /// A request left the system: finished (with the tokens it generated), failed, or rejected
    /// after `decide` (`None`).
    fn on_finish(&mut self, _id: RequestId, _now: Timestamp, _output_tokens: Option<u64>) {}
    /// Health changed.
    fn on_health(&mut self, _worker: usize, _healthy: bool) {}
    /// The prefill and decode rates the policy plans with for `worker`, and those it measured,
    /// if it has any.
    fn rates(&self, _worker: usize) -> Option<WorkerRates> {
        None
    }
    /// Starts queueing reservation changes for the replica bus, batched by `windows`; false if the
    /// policy keeps no reservations to share.
    fn share_reservations(&mut self, _windows: BatchWindows) -> bool {
        false
    }
    /// A request reached this sharing replica: how long it waits before its decision, at most
    /// `max_stagger` ([`kvgate_core::Router::arrived`]).
    fn arrived(&mut self, _now: Timestamp, _max_stagger: std::time::Duration, _draw: u64) -> std::time::Duration {
        std::time::Duration::ZERO
    }
    /// When the queued reservation changes are due to be published.
    fn reservation_changes_due_at(&self) -> Option<Timestamp> {
        None
    }
    /// The queued reservation changes, if they are due at `now`.
    fn take_due_reservation_changes(&mut self, _now: Timestamp) -> Vec<ReservationChange> {
        Vec::new()
    }
    /// Every queued reservation change, due or not.
    fn take_reservation_changes(&mut self) -> Vec<ReservationChange> {
        Vec::new()
    }
    /// Every reservation held now.
    fn held_reservations(&self) -> Vec<HeldReservation> {
        Vec::new()
    }
    /// A peer replica's changes arrived.
    fn apply_peer_changes(&mut self, _peer: &ReplicaId, _changes: &[ReservationChange], _now: Timestamp) {}
    /// A peer replica's whole state arrived.
    fn apply_peer_state(&mut self, _peer: &ReplicaId, _held: &[HeldReservation], _now: Timestamp) {}
    /// Whether the simulator hands this policy every engine's true load at each decision, instead
    /// of the polled reports (`oracle`: what perfect telemetry would be worth).
    fn reads_true_state(&self) -> bool {
        false
    }
}

/// Every policy name the simulator accepts.
pub const POLICY_NAMES: &[&str] = &[
    "round_robin",
    "random",
    "power_of_two",
    "smg_least_load",
    "smg_power_of_two",
    "cache_aware",
    "cache_aware_seeded",
    "smg_cache_aware",
    "smg_cache_aware_http",
    "sglang_v04",
    "dynamo",
    "llm_d",
    "aibrix",
    "lmetric",
    "projected",
    "oracle",
];

/// A policy entry as the CLI names it: `NAME` or `projected:MODE`.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// The policy name.
    pub name: String,
    /// The mode, for `projected`.
    pub mode: Option<Mode>,
}

impl PolicySpec {
    /// Parses `NAME` or `NAME:MODE`.
    pub fn parse(s: &str) -> Result<Self, SimError> {
        let (name, mode) = match s.split_once(':') {
            Some((n, m)) => (n, Some(m.parse::<Mode>().map_err(|e| SimError::Config(e.to_string()))?)),
            None => (s, None),
        };
        if name == "least_load" {
            return Err(SimError::Config(
                "the simulator's least_load is now smg_least_load (SMG's load policy); kvgate's own load-only routing is projected:off".into(),
            ));
        }
        if !POLICY_NAMES.contains(&name) {
            return Err(SimError::Config(format!(
                "unknown policy {name:?}: expected one of {}",
                POLICY_NAMES.join(", ")
            )));
        }
        if mode.is_some() && name != "projected" {
            return Err(SimError::Config(format!(
                "{name} has no modes; only projected takes :off, :shadow or :enforce"
            )));
        }
        Ok(PolicySpec { name: name.to_owned(), mode })
    }

    /// The label used in reports: `projected:enforce`, `cache_aware`, ...
    pub fn label(&self) -> String {
        match (self.name.as_str(), self.mode) {
            ("projected", mode) => format!("projected:{}", mode.unwrap_or(Mode::Enforce)),
            (name, _) => name.to_owned(),
        }
    }
}

/// Builds a policy. `knobs` carries the projected policy's knobs (mode and name are overridden).
pub fn build(spec: &PolicySpec, fleet: &FleetInfo, knobs: &PolicyConfig) -> Result<Box<dyn SimPolicy>, SimError> {
    Ok(match spec.name.as_str() {
        "projected" => {
            let cfg = PolicyConfig { mode: spec.mode.unwrap_or(Mode::Enforce), ..knobs.clone() };
            Box::new(core_backed::CorePolicy::new(fleet, cfg)?)
        }
        "oracle" => {
            let cfg = PolicyConfig { mode: Mode::Enforce, ..knobs.clone() };
            Box::new(core_backed::CorePolicy::new(fleet, cfg)?.reading_true_state())
        }
        "cache_aware" | "cache_aware_seeded" | "smg_cache_aware" => {
            let cfg = PolicyConfig {
                distribution_seeding: spec.name == "cache_aware_seeded",
                smg_guards: spec.name == "smg_cache_aware",
                ..PolicyConfig::new(kvgate_core::PolicyName::CacheAware)
            };
            Box::new(core_backed::CorePolicy::new(fleet, cfg)?)
        }
        "round_robin" | "random" | "power_of_two" => {
            let name: kvgate_core::PolicyName =
                spec.name.parse().map_err(|e: kvgate_core::CoreError| SimError::Config(e.to_string()))?;
            Box::new(core_backed::CorePolicy::new(fleet, PolicyConfig::new(name))?)
        }
        "smg_least_load" => Box::new(simple::SmgLeastLoad::new(fleet, false)),
        "smg_power_of_two" => Box::new(simple::SmgLeastLoad::new(fleet, true)),
        "smg_cache_aware_http" => Box::new(approx::SmgCacheAwareHttp::new(fleet)),
        "sglang_v04" => Box::new(approx::SglangV04::new(fleet)),
        "aibrix" => Box::new(approx::Aibrix::new(fleet)),
        "lmetric" => Box::new(approx::Lmetric::new(fleet)),
        "dynamo" => Box::new(exact::Dynamo::new(fleet)),
        "llm_d" => Box::new(exact::LlmD::new(fleet)),
        other => return Err(SimError::Config(format!("unknown policy {other:?}"))),
    })
}

/// Indices of healthy workers.
pub(crate) fn healthy(view: &[WorkerView]) -> Vec<usize> {
    (0..view.len()).filter(|&i| view[i].healthy).collect()
}

/// Uniform choice among `candidates` by the RNG.
pub(crate) fn uniform(candidates: &[usize], rng: &mut ChaCha8Rng) -> Option<usize> {
    use rand::Rng;
    if candidates.is_empty() {
        None
    } else {
        Some(candidates[rng.random_range(0..candidates.len())])
    }
}

/// The candidates with the smallest key (exact ties kept), for a uniform tie-break.
pub(crate) fn argmin_set<K: PartialOrd + Copy>(candidates: &[usize], key: impl Fn(usize) -> K) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::new();
    let mut best_key: Option<K> = None;
    for &c in candidates {
        let k = key(c);
        match best_key {
            Some(b) if k > b => {}
            Some(b) if k == b => best.push(c),
            _ => {
                best_key = Some(k);
                best.clear();
                best.push(c);
            }
        }
    }
    best
}
