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
//! **Cap-one distribution seeding** (optional) replaces the gate's spill with a controlled replica
//! build-up: while the gate fires for a prefix, only one request at a time is sent to `min_idx` to
//! seed a new copy of the prefix (its seed slot is held until that request's first token, when the
//! new copy's KV events start to arrive); every other request stays on the affinity pick. A burst on
//! a popular prefix therefore piles onto its one owner — the behaviour of the 51-engine incident.
//! The projected policy never seeds: replicas grow from ordinary misses once an owner's queue costs
//! more than recomputing the prefix.
//!
//! In-flight counts are the reconciled waiting plus running requests, which equal SMG's router-local
//! counts when one router sends all traffic and also see load from other routers when telemetry does.
//! Only `synced` workers count as holders, as for every kvgate policy.

use crate::policy::PolicyConfig;

/// One eligible worker as the cache-aware rule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// In-flight requests.
    pub in_flight: u64,
    /// Requests routed to it so far.
    pub routed: u64,
    /// Leading request blocks it holds.
    pub overlap_blocks: u32,
}

/// The rule's outcome, as an index into the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The cache-affinity pick.
    Affinity(usize),
    /// `min_idx`: nothing cached, or the balance gate fired.
    Balance(usize),
    /// `min_idx`, as the prefix's one seeding request.
    Seed(usize),
}

impl Pick {
    /// The chosen candidate.
    pub fn index(self) -> usize {
        match self {
            Pick::Affinity(i) | Pick::Balance(i) | Pick::Seed(i) => i,
        }
    }
}

/// Applies the rule. `seed_slot_free` says whether the request's prefix has no seeding request in
/// flight (only consulted with distribution seeding on). Returns `None` with no candidates.
pub fn pick(
    candidates: &[Candidate],
    request_blocks: usize,
    cfg: &PolicyConfig,
    seed_slot_free: bool,
    draw: u64,
) -> Option<Pick> {
    let min_idx = (0..candidates.len())
        .min_by_key(|&i| (candidates[i].in_flight, candidates[i].routed, i))?;
    let best_overlap = candidates
        .iter()
        .map(|c| c.overlap_blocks)
        .max()
        .unwrap_or(0);
    if request_blocks == 0 || best_overlap == 0 {
        return Some(Pick::Balance(min_idx));
    }
    let holders: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].overlap_blocks == best_overlap)
        .collect();
    let least = holders
        .iter()
        .map(|&i| candidates[i].in_flight)
        .min()
        .unwrap_or(0);
    let tied: Vec<usize> = holders
        .into_iter()
        .filter(|&i| candidates[i].in_flight == least)
        .collect();
    let selected = tied[(draw % tied.len() as u64) as usize];

    let mean = candidates.iter().map(|c| c.in_flight as f64).sum::<f64>() / candidates.len() as f64;
    let load = candidates[selected].in_flight as f64;
    let gate = load > mean * cfg.balance_rel && load > mean + cfg.balance_abs as f64;
    Some(match (gate, cfg.distribution_seeding) {
        (false, _) => Pick::Affinity(selected),
        (true, false) => Pick::Balance(min_idx),
        (true, true) if seed_slot_free && min_idx != selected => Pick::Seed(min_idx),
        (true, true) => Pick::Affinity(selected),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyName;

    fn cands(loads: &[(u64, u32)]) -> Vec<Candidate> {
        loads
            .iter()
            .map(|&(in_flight, overlap_blocks)| Candidate {
                in_flight,
                routed: 0,
                overlap_blocks,
            })
            .collect()
    }

    #[test]
    fn longest_holder_wins_until_the_balance_gate_fires() {
        let cfg = PolicyConfig::new(PolicyName::CacheAware);
        let c = cands(&[(5, 4), (0, 0), (0, 2)]);
        assert_eq!(pick(&c, 4, &cfg, true, 0), Some(Pick::Affinity(0)));
        let c = cands(&[(200, 4), (0, 0), (0, 2)]);
        assert_eq!(pick(&c, 4, &cfg, true, 0), Some(Pick::Balance(1)));
    }

    #[test]
    fn cap_one_seeding_sends_one_request_away_and_keeps_the_rest_on_the_owner() {
        let cfg = PolicyConfig {
            distribution_seeding: true,
            ..PolicyConfig::new(PolicyName::CacheAware)
        };
        let c = cands(&[(200, 4), (0, 0), (0, 0)]);
        assert_eq!(pick(&c, 4, &cfg, true, 0), Some(Pick::Seed(1)));
        assert_eq!(pick(&c, 4, &cfg, false, 0), Some(Pick::Affinity(0)));
    }

    #[test]
    fn nothing_cached_goes_to_the_least_loaded() {
        let cfg = PolicyConfig::new(PolicyName::CacheAware);
        let c = cands(&[(3, 0), (1, 0), (2, 0)]);
        assert_eq!(pick(&c, 4, &cfg, true, 7), Some(Pick::Balance(1)));
        assert_eq!(pick(&[], 4, &cfg, true, 7), None);
    }
}
