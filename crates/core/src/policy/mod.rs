//! Routing policies and their knobs.
//!
//! - [`least_load`]: the projected formula with no cache credit (today's behaviour; mode `off`).
//! - [`projected`]: cache and load in projected seconds, with the KV-pressure barrier and the hard
//!   escape to the load-only winner.
//! - [`cache_aware`]: the SMG event-driven cache-aware baseline, optionally with cap-one distribution
//!   seeding. Seeding lives only here: the projected policy never seeds.
//! - [`round_robin`], [`random`], [`power_of_two`]: the baselines users compare with, without cache
//!   credit, so that one gateway can A/B them on a real fleet.
//!
//! Every knob has documented bounds ([`KNOBS`]); [`PolicyConfig::validate`] rejects values outside
//! them with a message that names the knob and its range.

pub mod cache_aware;
pub mod least_load;
pub mod power_of_two;
pub mod projected;
pub mod random;
pub mod round_robin;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use rustc_hash::FxHashMap;

use crate::decision::{FallbackReason, Reason};
use crate::error::CoreError;
use crate::ids::{BlockKey, WorkerSlot};
pub use crate::knob::Knob;
pub use crate::policy_name::{Mode, PolicyName};
use projected::{Terms, WorkerLoad};

/// Seconds by which the cache winner's queue (wait + decode) may exceed the load-only winner's.
pub const ESCAPE_SECONDS: Knob = Knob {
    name: "escape_seconds",
    min: 0.0,
    max: 3600.0,
    default: 5.0,
    meaning: "enforce falls back to the load-only winner when the cache winner's queue (wait + decode) exceeds it by more than this many seconds",
};
/// Waiting requests by which the cache winner may exceed the load-only winner.
pub const ESCAPE_WAITING: Knob = Knob {
    name: "escape_waiting",
    min: 0.0,
    max: 1_000_000.0,
    default: 64.0,
    meaning: "enforce falls back to the load-only winner when the cache winner has more than this many waiting requests beyond it",
};
/// Age after which a load snapshot is stale.
pub const STALE_AFTER_MS: Knob = Knob {
    name: "stale_after_ms",
    min: 10.0,
    max: 3_600_000.0,
    default: 5000.0,
    meaning: "a load snapshot older than this is stale: the worker keeps load-only scoring but earns no cache credit",
};
/// Silence after a dispatch after which a worker's KV events are stale.
pub const KV_STALE_AFTER_MS: Knob = Knob {
    name: "kv_stale_after_ms",
    min: 100.0,
    max: 3_600_000.0,
    default: 30_000.0,
    meaning:
        "a worker that has had traffic but no KV event or heartbeat for this long is `stale` and earns no cache credit",
};
/// KV usage above which the pressure barrier applies.
pub const KV_BARRIER_THRESHOLD: Knob = Knob {
    name: "kv_barrier_threshold",
    min: 0.5,
    max: 1.0,
    default: 0.9,
    meaning: "projected KV usage (with this request) above which the pressure barrier adds seconds",
};
/// Scale of the pressure barrier.
pub const KV_BARRIER_SCALE_S: Knob = Knob {
    name: "kv_barrier_scale_s",
    min: 0.0,
    max: 600.0,
    default: 2.0,
    meaning: "barrier seconds = scale × (usage − threshold) / (1 − usage); a full cache costs KV_BARRIER_MAX_S",
};
/// Bound of the weight on uncached prefill (see [`crate::load::prefill_weight`]).
pub const PREFILL_WEIGHT_MAX: Knob = Knob {
    name: "prefill_weight_max",
    min: 1.0,
    max: 100.0,
    default: 10.0,
    meaning: "enforce weighs uncached prefill seconds by 1 / (1 − fleet prefill load), the time the work keeps the fleet busy while later requests queue behind it, up to this factor; 1 turns the weighting off",
};
/// Weight of the delay a worker's uncached prefill adds to its running sequences.
pub const BATCH_DELAY_WEIGHT: Knob = Knob {
    name: "batch_delay_weight",
    min: 0.0,
    max: 10.0,
    default: 0.15,
    meaning: "enforce adds this weight × uncached prefill seconds × running sequences: the steps that carry the prefill delay every running sequence's next token; 0 turns it off",
};
/// How much dearer than the projected winner a worker holding more of the prompt may be and still
/// be chosen.
pub const REUSE_SLACK: Knob = Knob {
    name: "reuse_slack",
    min: 0.0,
    max: 100.0,
    default: 0.0,
    meaning: "enforce sends a request to the worker holding the longest cached prefix of it when that worker's cost is at most (1 + this) × the projected winner's: more prefill saved for a longer projected first token; 0 (the default) minimises the projected cost alone",
};
/// Longest a hot prefix is expected to stay hot when weighing a new copy of it.
pub const REPLICATION_HORIZON_S: Knob = Knob {
    name: "replication_horizon_s",
    min: 0.0,
    max: 86_400.0,
    default: 600.0,
    meaning: "enforce copies a hot prefix to the load-only winner when the time the copy would save the prefix's requests over min(its age, this horizon) exceeds what the copy costs this request; 0 turns copying off",
};
/// SMG cache_aware absolute balance gate.
pub const BALANCE_ABS: Knob = Knob {
    name: "balance_abs",
    min: 0.0,
    max: 1_000_000.0,
    default: 64.0,
    meaning: "cache_aware: the affinity pick is overridden when its load exceeds the mean by this many requests (and by balance_rel)",
};
/// SMG cache_aware relative balance gate.
pub const BALANCE_REL: Knob = Knob {
    name: "balance_rel",
    min: 1.0,
    max: 1000.0,
    default: 1.5,
    meaning:
        "cache_aware: the affinity pick is overridden when its load exceeds the mean times this (and by balance_abs)",
};

/// Every policy knob, for documentation and `--help` texts.
pub const KNOBS: &[Knob] = &[
    ESCAPE_SECONDS,
    ESCAPE_WAITING,
    STALE_AFTER_MS,
    KV_STALE_AFTER_MS,
    KV_BARRIER_THRESHOLD,
    KV_BARRIER_SCALE_S,
    PREFILL_WEIGHT_MAX,
    BATCH_DELAY_WEIGHT,
    REUSE_SLACK,
    REPLICATION_HORIZON_S,
    BALANCE_ABS,
    BALANCE_REL,
];

/// Barrier seconds for a projected KV usage of 100% or more: large enough to lose to any worker
/// with room, finite so that a fleet that is full everywhere still ranks by load.
pub const KV_BARRIER_MAX_S: f64 = 3600.0;

/// The policy and its knobs, validated as a whole.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// Which policy decides.
    pub name: PolicyName,
    /// Rollout mode (projected: off/shadow/enforce; least_load is always off; cache_aware enforce).
    pub mode: Mode,
    /// See [`ESCAPE_SECONDS`].
    pub escape_seconds: f64,
    /// See [`ESCAPE_WAITING`].
    pub escape_waiting: u64,
    /// See [`STALE_AFTER_MS`].
    pub stale_after_ms: u64,
    /// See [`KV_STALE_AFTER_MS`].
    pub kv_stale_after_ms: u64,
    /// See [`KV_BARRIER_THRESHOLD`].
    pub kv_barrier_threshold: f64,
    /// See [`KV_BARRIER_SCALE_S`].
    pub kv_barrier_scale_s: f64,
    /// See [`PREFILL_WEIGHT_MAX`].
    pub prefill_weight_max: f64,
    /// See [`BATCH_DELAY_WEIGHT`].
    pub batch_delay_weight: f64,
    /// See [`REUSE_SLACK`].
    pub reuse_slack: f64,
    /// See [`REPLICATION_HORIZON_S`].
    pub replication_horizon_s: f64,
    /// See [`BALANCE_ABS`].
    pub balance_abs: u64,
    /// See [`BALANCE_REL`].
    pub balance_rel: f64,
    /// cache_aware only: cap-one distribution seeding (see [`cache_aware`]).
    pub distribution_seeding: bool,
    /// cache_aware only: SMG 1.13's guards against a hot owner, on by default there (see
    /// [`cache_aware`]): the spill gate's absolute margin capped at the in-flight count's natural
    /// swing, and worker overload protection. Off, the rule is SMG's before 1.13 (or 1.13 with
    /// `--disable-worker-overload-protection` and a margin it never caps).
    #[serde(default)]
    pub smg_guards: bool,
    /// Plan with each worker's prefill rate measured from the cadence of its KV event batches
    /// ([`crate::step_cadence`]) and its decode rate measured from inter-token times (both are
    /// measured and shown either way). Off by default: on the simulator's Llama-3-8B profile an
    /// engine with only cache hits goes unmeasured for minutes, and engines configured right are
    /// sometimes read off (docs/routing.md).
    pub calibrate: bool,
}

impl PolicyConfig {
    /// The defaults for `name`, in its default mode.
    pub fn new(name: PolicyName) -> Self {
        PolicyConfig {
            name,
            mode: name.default_mode(),
            escape_seconds: ESCAPE_SECONDS.default,
            escape_waiting: ESCAPE_WAITING.default as u64,
            stale_after_ms: STALE_AFTER_MS.default as u64,
            kv_stale_after_ms: KV_STALE_AFTER_MS.default as u64,
            kv_barrier_threshold: KV_BARRIER_THRESHOLD.default,
            kv_barrier_scale_s: KV_BARRIER_SCALE_S.default,
            prefill_weight_max: PREFILL_WEIGHT_MAX.default,
            batch_delay_weight: BATCH_DELAY_WEIGHT.default,
            reuse_slack: REUSE_SLACK.default,
            replication_horizon_s: REPLICATION_HORIZON_S.default,
            balance_abs: BALANCE_ABS.default as u64,
            balance_rel: BALANCE_REL.default,
            distribution_seeding: false,
            smg_guards: false,
            calibrate: false,
        }
    }

    /// The projected policy in `mode`.
    pub fn projected(mode: Mode) -> Self {
        PolicyConfig { mode, ..PolicyConfig::new(PolicyName::Projected) }
    }

    /// Checks every knob's bounds and the combination of settings.
    pub fn validate(&self) -> Result<(), CoreError> {
        ESCAPE_SECONDS.check(self.escape_seconds)?;
        ESCAPE_WAITING.check(self.escape_waiting as f64)?;
        STALE_AFTER_MS.check(self.stale_after_ms as f64)?;
        KV_STALE_AFTER_MS.check(self.kv_stale_after_ms as f64)?;
        KV_BARRIER_THRESHOLD.check(self.kv_barrier_threshold)?;
        KV_BARRIER_SCALE_S.check(self.kv_barrier_scale_s)?;
        PREFILL_WEIGHT_MAX.check(self.prefill_weight_max)?;
        BATCH_DELAY_WEIGHT.check(self.batch_delay_weight)?;
        REUSE_SLACK.check(self.reuse_slack)?;
        REPLICATION_HORIZON_S.check(self.replication_horizon_s)?;
        BALANCE_ABS.check(self.balance_abs as f64)?;
        BALANCE_REL.check(self.balance_rel)?;
        if self.distribution_seeding && self.name != PolicyName::CacheAware {
            return Err(CoreError::InvalidPolicy(format!(
                "distribution_seeding belongs to the cache_aware policy and cannot be combined with {}: \
                 the projected policy never seeds, hot prefixes gain owners through ordinary misses",
                self.name
            )));
        }
        if self.smg_guards && self.name != PolicyName::CacheAware {
            return Err(CoreError::InvalidPolicy(format!(
                "smg_guards belongs to the cache_aware policy (SMG 1.13's guards on it) and cannot be combined with {}",
                self.name
            )));
        }
        match (self.name, self.mode) {
            (PolicyName::Projected, _) => Ok(()),
            (name, mode) if mode == name.default_mode() => Ok(()),
            (name, mode) => Err(CoreError::InvalidPolicy(format!(
                "mode {mode} applies to the projected policy; {name} always runs in mode {}",
                name.default_mode()
            ))),
        }
    }

    /// Load snapshots older than this are stale.
    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }

    /// Workers silent this long after traffic have stale KV state.
    pub fn kv_stale_after(&self) -> Duration {
        Duration::from_millis(self.kv_stale_after_ms)
    }
}

/// A partial policy: any subset of the knobs, laid over a [`PolicyConfig`]. One shape for every
/// place a policy is written down (a fleet snapshot, a config file, an admin update).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyPatch {
    /// Policy name; a new name without a mode takes that policy's default mode.
    pub name: Option<PolicyName>,
    /// Mode.
    pub mode: Option<Mode>,
    /// See [`ESCAPE_SECONDS`].
    pub escape_seconds: Option<f64>,
    /// See [`ESCAPE_WAITING`].
    pub escape_waiting: Option<u64>,
    /// See [`STALE_AFTER_MS`].
    pub stale_after_ms: Option<u64>,
    /// See [`KV_STALE_AFTER_MS`].
    pub kv_stale_after_ms: Option<u64>,
    /// See [`KV_BARRIER_THRESHOLD`].
    pub kv_barrier_threshold: Option<f64>,
    /// See [`KV_BARRIER_SCALE_S`].
    pub kv_barrier_scale_s: Option<f64>,
    /// See [`PREFILL_WEIGHT_MAX`].
    pub prefill_weight_max: Option<f64>,
    /// See [`BATCH_DELAY_WEIGHT`].
    pub batch_delay_weight: Option<f64>,
    /// See [`REUSE_SLACK`].
    pub reuse_slack: Option<f64>,
    /// See [`REPLICATION_HORIZON_S`].
    pub replication_horizon_s: Option<f64>,
    /// See [`BALANCE_ABS`].
    pub balance_abs: Option<u64>,
    /// See [`BALANCE_REL`].
    pub balance_rel: Option<f64>,
    /// cache_aware only: cap-one distribution seeding.
    pub distribution_seeding: Option<bool>,
    /// cache_aware only: SMG 1.13's guards against a hot owner.
    pub smg_guards: Option<bool>,
    /// Calibrate the rates from observations (default off).
    pub calibrate: Option<bool>,
}

impl PolicyPatch {
    /// `base` with this patch laid over it, validated as a whole.
    pub fn apply(&self, base: &PolicyConfig) -> Result<PolicyConfig, CoreError> {
        let mut cfg = base.clone();
        if let Some(name) = self.name {
            if name != cfg.name {
                cfg.name = name;
                cfg.mode = name.default_mode();
            }
        }
        cfg.mode = self.mode.unwrap_or(cfg.mode);
        cfg.escape_seconds = self.escape_seconds.unwrap_or(cfg.escape_seconds);
        cfg.escape_waiting = self.escape_waiting.unwrap_or(cfg.escape_waiting);
        cfg.stale_after_ms = self.stale_after_ms.unwrap_or(cfg.stale_after_ms);
        cfg.kv_stale_after_ms = self.kv_stale_after_ms.unwrap_or(cfg.kv_stale_after_ms);
        cfg.kv_barrier_threshold = self.kv_barrier_threshold.unwrap_or(cfg.kv_barrier_threshold);
        cfg.kv_barrier_scale_s = self.kv_barrier_scale_s.unwrap_or(cfg.kv_barrier_scale_s);
        cfg.prefill_weight_max = self.prefill_weight_max.unwrap_or(cfg.prefill_weight_max);
        cfg.batch_delay_weight = self.batch_delay_weight.unwrap_or(cfg.batch_delay_weight);
        cfg.reuse_slack = self.reuse_slack.unwrap_or(cfg.reuse_slack);
        cfg.replication_horizon_s = self.replication_horizon_s.unwrap_or(cfg.replication_horizon_s);
        cfg.balance_abs = self.balance_abs.unwrap_or(cfg.balance_abs);
        cfg.balance_rel = self.balance_rel.unwrap_or(cfg.balance_rel);
        cfg.distribution_seeding = self.distribution_seeding.unwrap_or(cfg.distribution_seeding);
        cfg.smg_guards = self.smg_guards.unwrap_or(cfg.smg_guards);
        cfg.calibrate = self.calibrate.unwrap_or(cfg.calibrate);
        cfg.validate()?;
        Ok(cfg)
    }

    /// The patch on the defaults of its policy (projected when unnamed).
    pub fn build(&self) -> Result<PolicyConfig, CoreError> {
        self.apply(&PolicyConfig::new(self.name.unwrap_or(PolicyName::Projected)))
    }
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::projected(Mode::Enforce)
    }
}

/// One eligible worker as scored for a request: the router builds these under its lock, and a
/// [`Policy`] chooses among them.
#[derive(Debug, Clone)]
pub(crate) struct Scored {
    pub(crate) slot: WorkerSlot,
    pub(crate) load: WorkerLoad,
    pub(crate) terms: Terms,
    pub(crate) cached_tokens: u64,
    /// The KV tokens the request would add there (see [`projected::Ask::new_kv_tokens`]).
    pub(crate) new_kv_tokens: u64,
    pub(crate) raw_blocks: u32,
    pub(crate) withheld: Option<FallbackReason>,
    pub(crate) load_problem: Option<FallbackReason>,
}

/// The prefix pins of distribution seeding: changed by a real decision, only read by a preview.
pub(crate) enum SeedBook<'a> {
    /// A decision: pins may be made or moved.
    Commit(&'a mut FxHashMap<BlockKey, WorkerSlot>),
    /// A preview: pins are read, never changed.
    Peek(&'a FxHashMap<BlockKey, WorkerSlot>),
}

impl SeedBook<'_> {
    fn get(&self, prefix: &BlockKey) -> Option<WorkerSlot> {
        match self {
            SeedBook::Commit(m) => m.get(prefix).copied(),
            SeedBook::Peek(m) => m.get(prefix).copied(),
        }
    }
}

/// What a policy chooses from.
pub(crate) struct Choosing<'a> {
    /// The eligible workers, scored.
    pub(crate) scored: &'a [Scored],
    /// The load-only winner among them (the escape's target, mode `off`'s choice).
    pub(crate) load_winner: usize,
    /// Tie-breaking randomness.
    pub(crate) draw: u64,
    /// The weight of uncached prefill in the projected policy's cost.
    pub(crate) prefill_weight: f64,
    /// The policy's knobs.
    pub(crate) cfg: &'a PolicyConfig,
    /// The request's block keys.
    pub(crate) keys: &'a [BlockKey],
    /// Requests routed so far to a worker.
    pub(crate) routed: &'a dyn Fn(WorkerSlot) -> u64,
    /// Decisions this router has committed so far.
    pub(crate) turn: u64,
    /// Distribution seeding's pins.
    pub(crate) seeds: SeedBook<'a>,
    /// The demand for the longest prefix of the request that a worker holds (zero when none does).
    pub(crate) heat: crate::prefix_demand::PrefixHeat,
    /// The tokens the request may decode: as many steps as a later request of its prefix rides.
    pub(crate) decode_tokens: u64,
    /// Workers a copy of that prefix was sent to that do not show it yet.
    pub(crate) copies_in_flight: &'a [WorkerSlot],
    /// Peer replicas deciding blind to this decision, on average ([`crate::concurrent_peers`]).
    pub(crate) unseen_peers: f64,
}

/// What a policy chose, as indices into [`Choosing::scored`].
pub(crate) struct Choice {
    /// The worker the request goes to.
    pub(crate) chosen: usize,
    /// Why.
    pub(crate) reason: Reason,
    /// What mode `enforce` chooses, recorded beside the choice (shadow's counterfactual).
    pub(crate) enforce: Option<(usize, Reason)>,
}

/// A routing policy: how one request's worker is chosen from the scored candidates. The router
/// keeps the locking, the scoring and the ledger; each policy's rule lives in its own file.
pub(crate) trait Policy {
    /// Chooses a worker.
    fn choose(&self, c: &mut Choosing<'_>) -> Choice;
}

/// The policy of a name.
pub(crate) fn policy_for(name: PolicyName) -> &'static dyn Policy {
    match name {
        PolicyName::LeastLoad => &least_load::LeastLoad,
        PolicyName::Projected => &projected::Projected,
        PolicyName::CacheAware => &cache_aware::CacheAware,
        PolicyName::RoundRobin => &round_robin::RoundRobin,
        PolicyName::Random => &random::Random,
        PolicyName::PowerOfTwo => &power_of_two::PowerOfTwo,
    }
}

/// Why no worker earned cache credit, when telemetry is to blame: the withheld reason of the worker
/// holding the longest prefix, or the fleet-wide load problem when no worker has fresh load.
pub(crate) fn fallback_reason(scored: &[Scored]) -> Option<FallbackReason> {
    let withheld = scored
        .iter()
        .filter_map(|s| s.withheld.map(|r| (s.raw_blocks, std::cmp::Reverse(r))))
        .max()
        .map(|(_, std::cmp::Reverse(r))| r);
    withheld.or_else(|| {
        if scored.iter().all(|s| s.load_problem.is_some()) {
            scored.iter().filter_map(|s| s.load_problem).min()
        } else {
            None
        }
    })
}

/// The load-only winner, or the reason telemetry gave none of them cache credit.
pub(crate) fn load_only(c: &Choosing<'_>) -> (usize, Reason) {
    (c.load_winner, fallback_reason(c.scored).map_or(Reason::LoadOnly, Reason::Fallback))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_knob_is_named_with_its_range() {
        let cfg = PolicyConfig { escape_seconds: -1.0, ..PolicyConfig::default() };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("escape_seconds"), "{err}");
        assert!(err.contains("0 to 3600"), "{err}");
        let cfg = PolicyConfig { kv_barrier_threshold: 1.5, ..PolicyConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("kv_barrier_threshold"));
        let cfg = PolicyConfig { escape_seconds: f64::NAN, ..PolicyConfig::default() };
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn distribution_seeding_is_rejected_for_projected_and_accepted_for_cache_aware() {
        let projected = PolicyConfig { distribution_seeding: true, ..PolicyConfig::default() };
        let err = projected.validate().unwrap_err().to_string();
        assert!(err.contains("distribution_seeding"), "{err}");
        assert!(err.contains("projected"), "{err}");
        let cache_aware = PolicyConfig { distribution_seeding: true, ..PolicyConfig::new(PolicyName::CacheAware) };
        cache_aware.validate().unwrap();
    }

    #[test]
    fn a_patch_overlays_knobs_and_a_new_name_takes_its_default_mode() {
        let base = PolicyConfig::projected(Mode::Shadow);
        let p = PolicyPatch { escape_seconds: Some(2.0), ..PolicyPatch::default() };
        assert_eq!(p.apply(&base).unwrap(), PolicyConfig { escape_seconds: 2.0, ..base.clone() });
        let ll = PolicyPatch { name: Some(PolicyName::LeastLoad), ..PolicyPatch::default() }.apply(&base).unwrap();
        assert_eq!(ll.mode, Mode::Off);
        assert!(PolicyPatch { escape_waiting: Some(u64::MAX), ..PolicyPatch::default() }.apply(&base).is_err());
        let parsed: PolicyPatch =
            serde_json::from_str(r#"{"name": "cache_aware", "distribution_seeding": true}"#).unwrap();
        assert!(parsed.build().unwrap().distribution_seeding);
        assert!(serde_json::from_str::<PolicyPatch>(r#"{"colour": 1}"#).is_err());
    }

    #[test]
    fn modes_other_than_the_policy_own_are_rejected_outside_projected() {
        let ll = PolicyConfig { mode: Mode::Enforce, ..PolicyConfig::new(PolicyName::LeastLoad) };
        assert!(ll.validate().unwrap_err().to_string().contains("always runs in mode off"));
        for mode in [Mode::Off, Mode::Shadow, Mode::Enforce] {
            PolicyConfig::projected(mode).validate().unwrap();
        }
    }
}

/// Index of the smallest `key(i)` for `i < n`. Exact ties (within floating-point noise) are broken
/// by `draw`, uniformly over the tied indices, so that the caller's seeded RNG decides and replicas
/// with different seeds spread instead of all picking the first idle worker.
pub(crate) fn argmin(n: usize, key: impl Fn(usize) -> f64, draw: u64) -> Option<usize> {
    let min = (0..n).map(&key).fold(f64::INFINITY, f64::min);
    if n == 0 {
        return None;
    }
    let tolerance = 1e-9 * min.abs().max(1.0);
    let tied = |i: &usize| key(*i) - min <= tolerance;
    let count = (0..n).filter(tied).count().max(1);
    (0..n).filter(tied).nth((draw % count as u64) as usize).or(Some(0))
}

#[cfg(test)]
mod argmin_tests {
    use super::argmin;

    #[test]
    fn ties_are_broken_by_the_draw_and_the_minimum_always_wins() {
        let keys = [3.0, 1.0, 2.0, 1.0];
        assert_eq!(argmin(4, |i| keys[i], 0), Some(1));
        assert_eq!(argmin(4, |i| keys[i], 1), Some(3));
        assert_eq!(argmin(4, |i| keys[i], 2), Some(1));
        assert_eq!(argmin(0, |i| keys[i], 0), None);
    }
}
