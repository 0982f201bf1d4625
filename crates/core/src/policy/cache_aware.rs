//! SMG `cache_aware` in its event-driven mode (`peer-policies.md` §3), a baseline.
//!
//! 1. `min_idx` = the worker with the fewest in-flight requests (then fewest routed so far, then
//!    lowest slot).
//! 2. Candidates are workers holding at least one leading block of the request (exact KV events);
//!    none, or a prompt shorter than one block, sends the request to `min_idx`.
//! 3. The affinity pick is the longest holder, then the least loaded, then a seeded draw.
//! 4. Balance gate: if the pick's load exceeds both `mean × balance_rel` and `mean + balance_abs`,
//!    the request goes to `min_idx` instead.
//!
//! **SMG 1.13's guards** (`smg_guards`, on by default in SMG 1.13, as `smg launch --help` describes
//! them and its source, shipped in the PyPI sdist, implements them: `model_gateway/src/policies/
//! cache_aware.rs`, `absolute_margin` and `over_count_pressure_gate`):
//! - *Worker overload protection*: a worker with [`SMG_OVERLOAD_WAITING`] or more waiting requests,
//!   or KV usage at or above [`SMG_OVERLOAD_KV_USAGE`], is left out while another worker is under
//!   both; when every worker is over them the request goes to the least loaded.
//! - *The spill gate's margin is capped* at the in-flight count's natural swing at the fleet's mean
//!   load: `min(balance_abs, max(4, ⌈2·√mean⌉))`, two standard deviations of a Poisson count rounded
//!   up to whole requests, so that a small fleet can spill at all (with the default 64, four engines
//!   never would).
//!
//! **Cap-one distribution seeding** (optional) pins each prefix (keyed by the request's first block)
//! to one owner, at most one replica per prefix, so that the fleet's KV cache holds as many distinct
//! prefixes as possible. The first request of a prefix is placed by the rule above, except that the
//! balance gate does not move it off a worker that already holds the prefix; every later request of
//! that prefix goes to the pinned owner while it is eligible. A popular prefix therefore stays on one
//! engine however long its queue grows: the behaviour of the 51-engine incident. The projected policy
//! never seeds: replicas grow from ordinary misses once an owner's queue costs more than recomputing
//! the prefix.
//!
//! In-flight counts are the reconciled waiting plus running requests, which equal SMG's router-local
//! counts when one router sends all traffic and also see load from other routers when telemetry does.
//! Only `synced` workers count as holders, as for every kvgate policy.

use rustc_hash::FxHashMap;

use crate::decision::Reason;
use crate::ids::{BlockKey, WorkerSlot};
use crate::policy::projected::WorkerLoad;
use crate::policy::{Choice, Choosing, Policy, PolicyConfig, SeedBook};

/// SMG 1.13's worker overload protection: waiting requests at or above which a worker is left out.
pub const SMG_OVERLOAD_WAITING: u64 = 8;
/// SMG 1.13's worker overload protection: KV usage at or above which a worker is left out.
pub const SMG_OVERLOAD_KV_USAGE: f64 = 0.8;
/// SMG 1.13's floor under the spill gate's capped margin, in requests.
const SMG_SWING_FLOOR: f64 = 4.0;

/// The `cache_aware` policy, with or without distribution seeding.
pub(crate) struct CacheAware;

impl Policy for CacheAware {
    fn choose(&self, c: &mut Choosing<'_>) -> Choice {
        let scored = c.scored;
        let candidates: Vec<Candidate> = scored
            .iter()
            .map(|s| Candidate {
                in_flight: s.load.waiting_requests + s.load.running_requests,
                routed: (c.routed)(s.slot),
                overlap_blocks: if s.withheld.is_none() { s.raw_blocks } else { 0 },
                overloaded: overloaded(&s.load),
            })
            .collect();
        let prefix = c.keys.first().copied().filter(|_| c.cfg.distribution_seeding);
        let seeded = prefix.and_then(|k| c.seeds.get(&k)).and_then(|owner| scored.iter().position(|s| s.slot == owner));
        let Some(picked) = pick(&candidates, c.keys.len(), c.cfg, seeded, c.draw) else {
            let (chosen, reason) = super::load_only(c);
            return Choice { chosen, reason, enforce: Some((chosen, reason)) };
        };
        if let (Some(k), SeedBook::Commit(seeds)) = (prefix, &mut c.seeds) {
            if seeded.is_none() {
                // No pin, or its owner is gone or ineligible: the prefix is seeded anew.
                seeds.remove(&k);
            }
            seed(seeds, k, scored[picked.index()].slot);
        }
        let (chosen, reason) = match picked {
            Pick::Affinity(i) | Pick::Seeded(i) => (i, Reason::CacheAndLoad),
            Pick::Balance(i) => (i, super::fallback_reason(scored).map_or(Reason::LoadOnly, Reason::Fallback)),
        };
        Choice { chosen, reason, enforce: Some((chosen, reason)) }
    }
}

/// Over SMG 1.13's overload thresholds, by the loads the router holds (reported plus its own
/// reservations; SMG reads the polled reports alone).
fn overloaded(load: &WorkerLoad) -> bool {
    let kv_usage =
        if load.kv_capacity_tokens > 0 { load.kv_tokens as f64 / load.kv_capacity_tokens as f64 } else { 0.0 };
    over_smg_overload_thresholds(load.waiting_requests, kv_usage)
}

/// Whether a worker with these waiting requests and KV usage (0 to 1) is over SMG 1.13's worker
/// overload thresholds.
pub fn over_smg_overload_thresholds(waiting_requests: u64, kv_usage: f64) -> bool {
    waiting_requests >= SMG_OVERLOAD_WAITING || kv_usage >= SMG_OVERLOAD_KV_USAGE
}

/// One eligible worker as the cache-aware rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// In-flight requests.
    pub in_flight: u64,
    /// Requests routed to it so far.
    pub routed: u64,
    /// Leading request blocks it holds.
    pub overlap_blocks: u32,
    /// Over SMG 1.13's overload thresholds (waiting requests or KV usage); only read with
    /// `smg_guards`.
    pub overloaded: bool,
}

/// The rule's outcome, as an index into the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The cache-affinity pick.
    Affinity(usize),
    /// `min_idx`: nothing cached, or the balance gate fired.
    Balance(usize),
    /// The prefix's pinned owner (distribution seeding).
    Seeded(usize),
}

impl Pick {
    /// The chosen candidate.
    pub fn index(self) -> usize {
        match self {
            Pick::Affinity(i) | Pick::Balance(i) | Pick::Seeded(i) => i,
        }
    }
}

/// Applies the rule. `seeded_owner` is the candidate the request's prefix is pinned to, if any (only
/// consulted with distribution seeding on). Returns `None` with no candidates.
pub fn pick(
    candidates: &[Candidate],
    request_blocks: usize,
    cfg: &PolicyConfig,
    seeded_owner: Option<usize>,
    draw: u64,
) -> Option<Pick> {
    if let Some(owner) = seeded_owner.filter(|o| cfg.distribution_seeding && *o < candidates.len()) {
        return Some(Pick::Seeded(owner));
    }
    let least_loaded =
        |among: &[usize]| among.iter().copied().min_by_key(|&i| (candidates[i].in_flight, candidates[i].routed, i));
    let all: Vec<usize> = (0..candidates.len()).collect();
    let all_least = least_loaded(&all)?;
    let eligible: Vec<usize> =
        (0..candidates.len()).filter(|&i| !(cfg.smg_guards && candidates[i].overloaded)).collect();
    let Some(min_idx) = least_loaded(&eligible) else {
        // Every worker is overloaded: SMG 1.13 sends the request to the least loaded.
        return Some(Pick::Balance(all_least));
    };
    let best_overlap = eligible.iter().map(|&i| candidates[i].overlap_blocks).max().unwrap_or(0);
    if request_blocks == 0 || best_overlap == 0 {
        return Some(Pick::Balance(min_idx));
    }
    let holders: Vec<usize> = eligible.into_iter().filter(|&i| candidates[i].overlap_blocks == best_overlap).collect();
    let least = holders.iter().map(|&i| candidates[i].in_flight).min().unwrap_or(0);
    let tied: Vec<usize> = holders.into_iter().filter(|&i| candidates[i].in_flight == least).collect();
    let selected = tied[(draw % tied.len() as u64) as usize];

    let mean = candidates.iter().map(|c| c.in_flight as f64).sum::<f64>() / candidates.len() as f64;
    let load = candidates[selected].in_flight as f64;
    let gate = over_spill_gate(load, mean, cfg);
    Some(if gate && !cfg.distribution_seeding { Pick::Balance(min_idx) } else { Pick::Affinity(selected) })
}

/// Whether a worker with `load` requests in flight is over the balance gate at a fleet mean of
/// `mean`: over both `mean × balance_rel` and `mean` plus the margin, `balance_abs` (with SMG 1.13's
/// guards capped at the in-flight count's natural swing, `max(4, ⌈2·√mean⌉)`).
pub fn over_spill_gate(load: f64, mean: f64, cfg: &PolicyConfig) -> bool {
    let margin = if cfg.smg_guards {
        (cfg.balance_abs as f64).min((2.0 * mean.sqrt()).ceil().max(SMG_SWING_FLOOR))
    } else {
        cfg.balance_abs as f64
    };
    load > mean * cfg.balance_rel && load > mean + margin
}

/// Prefixes pinned by distribution seeding beyond which old pins are forgotten.
pub const MAX_SEEDED_PREFIXES: usize = 1 << 16;

/// Pins `prefix` to `owner` in `seeds` (cap one: an existing pin is kept).
pub(crate) fn seed(seeds: &mut FxHashMap<BlockKey, WorkerSlot>, prefix: BlockKey, owner: WorkerSlot) {
    if seeds.len() >= MAX_SEEDED_PREFIXES && !seeds.contains_key(&prefix) {
        // Bounded memory: forget one pin (deterministically, the first in table order).
        if let Some(&old) = seeds.keys().next() {
            seeds.remove(&old);
        }
    }
    seeds.entry(prefix).or_insert(owner);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyName;

    fn cands(loads: &[(u64, u32)]) -> Vec<Candidate> {
        loads
            .iter()
            .map(|&(in_flight, overlap_blocks)| Candidate { in_flight, routed: 0, overlap_blocks, overloaded: false })
            .collect()
    }

    #[test]
    fn longest_holder_wins_until_the_balance_gate_fires() {
        let cfg = PolicyConfig::new(PolicyName::CacheAware);
        let c = cands(&[(5, 4), (0, 0), (0, 2)]);
        assert_eq!(pick(&c, 4, &cfg, None, 0), Some(Pick::Affinity(0)));
        let c = cands(&[(200, 4), (0, 0), (0, 2)]);
        assert_eq!(pick(&c, 4, &cfg, None, 0), Some(Pick::Balance(1)));
    }

    #[test]
    fn cap_one_seeding_keeps_a_prefix_on_its_one_owner_past_the_balance_gate() {
        let cfg = PolicyConfig { distribution_seeding: true, ..PolicyConfig::new(PolicyName::CacheAware) };
        let c = cands(&[(200, 4), (0, 0), (0, 0)]);
        assert_eq!(pick(&c, 4, &cfg, None, 0), Some(Pick::Affinity(0)), "the holder is seeded, gate or not");
        assert_eq!(pick(&c, 4, &cfg, Some(2), 0), Some(Pick::Seeded(2)), "a pinned prefix goes to its owner");
        let plain = PolicyConfig::new(PolicyName::CacheAware);
        assert_eq!(pick(&c, 4, &plain, Some(2), 0), Some(Pick::Balance(1)), "pins mean nothing without seeding");
    }

    #[test]
    fn nothing_cached_goes_to_the_least_loaded() {
        let cfg = PolicyConfig::new(PolicyName::CacheAware);
        let c = cands(&[(3, 0), (1, 0), (2, 0)]);
        assert_eq!(pick(&c, 4, &cfg, None, 7), Some(Pick::Balance(1)));
        assert_eq!(pick(&[], 4, &cfg, None, 7), None);
    }

    #[test]
    fn smg_guards_cap_the_spill_margin_at_the_fleets_natural_swing() {
        // Four workers, 16 in flight, 10 of them on the holder: the mean is 4, the capped margin
        // max(4, 2·√4) = 4, so the holder spills (10 > 4 + 4 and > 1.5 × 4); without the guards
        // the margin is balance_abs (64) and it never would.
        let c = cands(&[(10, 4), (2, 0), (2, 0), (2, 0)]);
        let plain = PolicyConfig::new(PolicyName::CacheAware);
        assert_eq!(pick(&c, 4, &plain, None, 0), Some(Pick::Affinity(0)));
        let guarded = PolicyConfig { smg_guards: true, ..plain.clone() };
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Balance(1)));
        // Within the swing it stays: 7 is not over 3.25 + 4 (mean 3.25, margin max(4, ⌈3.6⌉)).
        let c = cands(&[(7, 4), (2, 0), (2, 0), (2, 0)]);
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Affinity(0)));
        // A balance_abs under the floor is the margin.
        let tight = PolicyConfig { balance_abs: 2, ..guarded.clone() };
        assert_eq!(pick(&c, 4, &tight, None, 0), Some(Pick::Balance(1)));
        // The swing is whole requests: at a mean of 4.25 the margin is ⌈4.12⌉ = 5, so 9 stays.
        let c = cands(&[(9, 4), (3, 0), (3, 0), (2, 0)]);
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Affinity(0)));
        let c = cands(&[(10, 4), (3, 0), (3, 0), (2, 0)]);
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Balance(3)), "10 is over 4.5 + 5");
    }

    #[test]
    fn smg_guards_leave_an_overloaded_worker_out_until_every_one_is() {
        let guarded = PolicyConfig { smg_guards: true, ..PolicyConfig::new(PolicyName::CacheAware) };
        let mut c = cands(&[(3, 4), (5, 2), (1, 0)]);
        c[0].overloaded = true;
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Affinity(1)), "the next-longest holder");
        let plain = PolicyConfig::new(PolicyName::CacheAware);
        assert_eq!(pick(&c, 4, &plain, None, 0), Some(Pick::Affinity(0)), "without the guards it is ignored");
        c[1].overloaded = true;
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Balance(2)), "no holder left: the least loaded");
        c[2].overloaded = true;
        assert_eq!(pick(&c, 4, &guarded, None, 0), Some(Pick::Balance(2)), "all over: the least loaded of all");
    }
}
