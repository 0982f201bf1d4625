//! The projected-time policy: seconds until the request's prefill would end on each worker.
//!
//! ```text
//! wait_s    = (waiting_tokens + reserved prefill tokens) / prefill_tps
//! decode_s  = steps × running / decode_tps                 the running batch rides every step
//!           + slots_short × decode_tokens / (running × decode_tps)   the wait for a batch slot
//!   steps       = ⌈(waiting_tokens + uncached prompt) / chunk_tokens⌉, at least 1
//!   slots_short = running + waiting + 1 − max_running_requests, when positive
//! prefill_s = (prompt − cached prefix) / prefill_tps
//! barrier_s = f(projected KV usage with this request)      0 below the threshold, steep above
//! projected = wait_s + decode_s + prefill_s + barrier_s
//! batch_delay_s = prefill_s × running                       what the prefill's steps add to the
//!                                                            running sequences' next tokens, summed
//! cost      = projected + (prefill_weight − 1) × prefill_s
//!           + batch_delay_weight × batch_delay_s               what `enforce` minimises
//! ```
//!
//! A continuous-batching engine admits a new request at its next step: its running decodes do not
//! have to drain first. They cost the request what they add to each step of its prefill (at the
//! aggregate decode rate, one running sequence adds `1 / decode_tps` seconds to a step), and, when
//! the batch is full, the wait until enough running requests finish (they finish at about
//! `running × decode_tps / decode_tokens` a second). A full KV cache is the barrier's part.
//!
//! `projected` is this request's own time to its first token. The choice also counts what the
//! request's uncached prefill costs the requests that come after it: on a fleet whose prefill
//! capacity is a fraction ρ busy, a second of new work keeps it busy `1 / (1 − ρ)` seconds
//! ([`crate::load::prefill_weight`]). On an idle fleet the two are the same. And the steps that
//! carry its prefill are longer for every sequence running on that worker: `batch_delay_s` sums
//! that delay, and `batch_delay_weight` says what a second of it is worth against a second of time
//! to first token. Prefill sent to a worker already busy decoding for many sessions delays all of
//! them, and brings that session's later turns there too.
//!
//! The cached owner wins only while the prefill it saves outweighs its queue. In `enforce`, the hard
//! escape hands the request to the load-only winner when the cache winner's queue (wait + decode)
//! or waiting count exceeds the load-only winner's by more than `escape_seconds` / `escape_waiting`.
//!
//! Each request on its own is best served by a holder of its prefix, so a hot prefix's holders
//! would carry its whole traffic for good. `enforce` also sends a request to the load-only winner
//! when that makes it a copy of the hot prefix worth more to the prefix's later requests than it
//! costs this one (reason `replicate`; docs/routing-advanced.md, "Copying a hot prefix").

use crate::decision::Reason;
use crate::policy::{Choice, Choosing, Mode, Policy, PolicyConfig, KV_BARRIER_MAX_S};

/// What the scorer needs to know about one eligible worker, load already reconciled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerLoad {
    /// Waiting requests, reported plus reserved.
    pub waiting_requests: u64,
    /// Queued prefill tokens, reported plus reserved.
    pub waiting_tokens: u64,
    /// Running requests, reported plus reserved.
    pub running_requests: u64,
    /// Active decode tokens, reported plus reserved.
    pub decode_tokens: u64,
    /// KV tokens in use, reported plus reserved.
    pub kv_tokens: u64,
    /// KV capacity in tokens.
    pub kv_capacity_tokens: u64,
    /// Largest running batch.
    pub max_running_requests: u64,
    /// Tokens one engine step computes.
    pub chunk_tokens: u64,
    /// Effective prefill throughput, tokens per second.
    pub prefill_tps: f64,
    /// Effective decode throughput, tokens per second.
    pub decode_tps: f64,
}

/// The terms of one worker for one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Terms {
    /// Queued prefill seconds.
    pub wait_s: f64,
    /// Seconds the running batch adds to this request: its share of each prefill step, and the
    /// wait for a batch slot when the batch is full.
    pub decode_s: f64,
    /// Uncached prefill seconds with cache credit.
    pub prefill_s: f64,
    /// Barrier seconds with cache credit.
    pub barrier_s: f64,
    /// The uncached prefill seconds times the running sequences: the delay this prefill adds to
    /// their next tokens, summed over them.
    pub batch_delay_s: f64,
    /// The projected score with cache credit.
    pub projected_s: f64,
    /// The score with no cache credit (least_load).
    pub load_only_s: f64,
}

impl Terms {
    /// The queueing part the escape compares: wait plus decode.
    pub fn queue_s(&self) -> f64 {
        self.wait_s + self.decode_s
    }

    /// What `enforce` minimises: `projected_s` with the uncached prefill weighted by
    /// `prefill_weight` ([`crate::load::prefill_weight`] of the fleet's load), plus the delay it
    /// adds to the running batch weighted by `batch_delay_weight`.
    pub fn cost_s(&self, prefill_weight: f64, batch_delay_weight: f64) -> f64 {
        self.projected_s + (prefill_weight - 1.0) * self.prefill_s + batch_delay_weight * self.batch_delay_s
    }
}

/// The KV-pressure barrier for a projected usage fraction.
pub fn kv_barrier_s(usage: f64, cfg: &PolicyConfig) -> f64 {
    if usage <= cfg.kv_barrier_threshold {
        0.0
    } else if usage >= 1.0 {
        KV_BARRIER_MAX_S
    } else {
        (cfg.kv_barrier_scale_s * (usage - cfg.kv_barrier_threshold) / (1.0 - usage)).min(KV_BARRIER_MAX_S)
    }
}

/// The request a worker is scored for: its prompt, the part of it credited as cached on the worker,
/// and the tokens it may decode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens credited as cached on this worker.
    pub cached_tokens: u64,
    /// Tokens it may decode.
    pub max_tokens: u64,
    /// Leading prompt tokens whose KV blocks it would share with a request already in flight on
    /// this worker (`crate::pending_prefix`): counted once in the projected KV usage, never as
    /// saved prefill.
    pub kv_shared_tokens: u64,
}

impl Ask {
    /// A request sharing no KV blocks with one in flight.
    pub fn new(prompt_tokens: u64, cached_tokens: u64, max_tokens: u64) -> Self {
        Ask { prompt_tokens, cached_tokens, max_tokens, kv_shared_tokens: 0 }
    }

    /// The KV tokens it would add to the worker's usage: its prompt beyond the blocks it shares with
    /// a request in flight there, and its output. A cached prefix no request is using counts: the
    /// engines report such blocks as free (evictable), and they are in use again once this request
    /// runs on them.
    pub fn new_kv_tokens(&self) -> u64 {
        self.prompt_tokens - self.kv_shared_tokens.min(self.prompt_tokens) + self.max_tokens
    }
}

/// Scores one worker for a request.
pub fn score(load: &WorkerLoad, ask: Ask, cfg: &PolicyConfig) -> Terms {
    let Ask { prompt_tokens, cached_tokens, max_tokens, .. } = ask;
    let cached = cached_tokens.min(prompt_tokens);
    let wait_s = load.waiting_tokens as f64 / load.prefill_tps;
    let decode_s = occupancy_s(load, prompt_tokens - cached);
    let usage = |new_kv_tokens: u64| (load.kv_tokens + new_kv_tokens) as f64 / load.kv_capacity_tokens.max(1) as f64;
    let prefill_s = (prompt_tokens - cached) as f64 / load.prefill_tps;
    let barrier_s = kv_barrier_s(usage(ask.new_kv_tokens()), cfg);
    let full_prefill_s = prompt_tokens as f64 / load.prefill_tps;
    let full_barrier_s = kv_barrier_s(usage(prompt_tokens + max_tokens), cfg);
    Terms {
        wait_s,
        decode_s,
        prefill_s,
        barrier_s,
        batch_delay_s: prefill_s * load.running_requests as f64,
        projected_s: wait_s + decode_s + prefill_s + barrier_s,
        load_only_s: wait_s + occupancy_s(load, prompt_tokens) + full_prefill_s + full_barrier_s,
    }
}

/// What the running batch costs a request that brings `new_tokens` of prefill (see the module
/// docs): its share of every step until that prefill ends, and the wait for a slot in a full batch.
fn occupancy_s(load: &WorkerLoad, new_tokens: u64) -> f64 {
    let running = load.running_requests as f64;
    let steps = load.waiting_tokens.saturating_add(new_tokens).div_ceil(load.chunk_tokens.max(1)).max(1);
    let riding = steps as f64 * running / load.decode_tps;
    let slots_short = (load.running_requests + load.waiting_requests + 1).saturating_sub(load.max_running_requests);
    let slot_wait = if slots_short == 0 || load.running_requests == 0 {
        0.0
    } else {
        slots_short as f64 * load.decode_tokens as f64 / (running * load.decode_tps)
    };
    riding + slot_wait
}

/// Whether a new copy of the request's hot prefix on the load-only winner saves the prefix's later
/// requests more than it costs this one (see the module docs).
///
/// With `k` workers holding the prefix (copies sent and not yet seen in the KV events count), each
/// carries about `1 / k` of its requests and of their running decodes. A copy on the load-only
/// winner takes its share: every later request of the prefix rides steps with about
/// `(running on the holder − the fleet's mean running) / (k + 1)` fewer sequences, each costing
/// `1 / decode_tps` of a step. A request rides one such step to its first token and one per token
/// it decodes after; a second of the decode's delay is worth `batch_delay_weight` of a second to a
/// first token, as in the batch delay. Over the time the prefix stays hot (taken to be as long as
/// it has been hot so far, up to `replication_horizon_s`) its `rate` requests save that much each;
/// the copy costs this request the difference of the two costs.
fn copy_pays(c: &Choosing<'_>, cache_winner: usize) -> bool {
    let (w, l) = (&c.scored[cache_winner], &c.scored[c.load_winner]);
    let horizon_s = c.heat.age_s.min(c.cfg.replication_horizon_s);
    let deepest = c.scored.iter().map(|s| s.cached_tokens).max().unwrap_or(0);
    // Only the holder of the hot prefix itself is copied from, and only to a worker without it.
    if horizon_s <= 0.0
        || w.cached_tokens < deepest
        || l.cached_tokens >= deepest
        || c.copies_in_flight.contains(&l.slot)
    {
        return false;
    }
    // A copy sent and not yet seen in the KV events will hold the prefix.
    let holders = (c.scored.iter().filter(|s| s.cached_tokens >= deepest).count() + c.copies_in_flight.len()) as f64;
    let mean_running =
        c.scored.iter().map(|s| s.load.running_requests as f64).sum::<f64>() / c.scored.len().max(1) as f64;
    let crowding_s = (w.load.running_requests as f64 - mean_running) / w.load.decode_tps;
    let steps_ridden = 1.0 + c.cfg.batch_delay_weight * c.decode_tokens as f64;
    let saved_s = c.heat.rate_per_s * horizon_s * crowding_s * steps_ridden / (holders + 1.0);
    let cost = |s: &super::Scored| s.terms.cost_s(c.prefill_weight, c.cfg.batch_delay_weight);
    saved_s > cost(l) - cost(w)
}

/// Whether `enforce` must leave the cache winner for the load-only winner.
pub fn escape_fires(
    cache_winner: (&Terms, &WorkerLoad),
    load_winner: (&Terms, &WorkerLoad),
    cfg: &PolicyConfig,
) -> bool {
    let (ct, cl) = cache_winner;
    let (lt, ll) = load_winner;
    ct.queue_s() - lt.queue_s() > cfg.escape_seconds
        || cl.waiting_requests.saturating_sub(ll.waiting_requests) > cfg.escape_waiting
}

/// The projected policy: the lowest projected seconds, cache credit included, unless the hard
/// escape fires; in mode `off` the load-only winner, in `shadow` the load-only winner with the
/// `enforce` choice recorded.
pub(crate) struct Projected;

impl Policy for Projected {
    fn choose(&self, c: &mut Choosing<'_>) -> Choice {
        let enforce = enforce_choice(c);
        match c.cfg.mode {
            Mode::Off => Choice { chosen: c.load_winner, reason: Reason::LoadOnly, enforce: None },
            Mode::Shadow => Choice { chosen: c.load_winner, reason: Reason::Shadow, enforce: Some(enforce) },
            Mode::Enforce => Choice { chosen: enforce.0, reason: enforce.1, enforce: Some(enforce) },
        }
    }
}

/// The enforce choice and its reason.
fn enforce_choice(c: &Choosing<'_>) -> (usize, Reason) {
    let scored = c.scored;
    let cost = |i: usize| scored[i].terms.cost_s(c.prefill_weight, c.cfg.batch_delay_weight);
    if scored.iter().any(|s| s.cached_tokens > 0) {
        let best = super::argmin(scored.len(), cost, c.draw).unwrap_or(c.load_winner);
        let spread = spread_among_near_ties(c, best, cost);
        let projected_winner = spread.unwrap_or(best);
        let reuse = deeper_holder_within_slack(c, projected_winner);
        let cache_winner = reuse.unwrap_or(projected_winner);
        let (w, l) = (&scored[cache_winner], &scored[c.load_winner]);
        if cache_winner != c.load_winner && escape_fires((&w.terms, &w.load), (&l.terms, &l.load), c.cfg) {
            return (c.load_winner, Reason::Escape);
        }
        if reuse.is_some() {
            return (cache_winner, Reason::Reuse);
        }
        if cache_winner != c.load_winner && copy_pays(c, cache_winner) {
            return (c.load_winner, Reason::Replicate);
        }
        return (cache_winner, if spread.is_some() { Reason::Spread } else { Reason::CacheAndLoad });
    }
    match super::load_only(c) {
        (winner, Reason::LoadOnly) => {
            spread_among_near_ties(c, winner, cost).map_or((winner, Reason::LoadOnly), |i| (i, Reason::Spread))
        }
        fallback => fallback,
    }
}

/// How far above the best cost a worker may be to share in a spread, in seconds of the best
/// worker's uncached prefill per peer deciding blind: a near-tie is closer than a fraction of the
/// prefill each coinciding request brings.
pub const SPREAD_TOLERANCE: f64 = 0.2;

/// How many of the best workers a spread draws from per request deciding at the same instant
/// (this one and its blind peers): twice as many as there are requests, so that independent draws
/// seldom coincide.
pub const SPREAD_WIDTH: f64 = 2.0;

/// When peer replicas decide blind to this decision ([`crate::concurrent_peers`]), a worker drawn
/// at random among the `⌈SPREAD_WIDTH × (k + 1)⌉` cheapest whose cost is within
/// `SPREAD_TOLERANCE × k` of the best worker's uncached prefill seconds above the best, `k` the
/// blind peers; `None` when the draw is the best worker itself, or no peer decides blind.
///
/// Every replica scores the same fleet alike, so without this they all choose the same best worker
/// for requests that arrive together, and it gets all of them. Workers much dearer than the best
/// are never drawn: a request whose cached owner is clearly best still goes there.
fn spread_among_near_ties(c: &Choosing<'_>, best: usize, cost: impl Fn(usize) -> f64) -> Option<usize> {
    let k = c.unseen_peers;
    if k < crate::concurrent_peers::CONCURRENT_MIN {
        return None;
    }
    let ceiling = cost(best) + SPREAD_TOLERANCE * k * c.scored[best].terms.prefill_s;
    let mut near: Vec<usize> = (0..c.scored.len()).filter(|&i| cost(i) <= ceiling).collect();
    near.sort_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)));
    let width = near.len().min((SPREAD_WIDTH * (k + 1.0)).ceil() as usize).max(1);
    // Bits of the draw that the tie-break above does not use.
    let drawn = near[(c.draw.rotate_right(32) % width as u64) as usize];
    (drawn != best).then_some(drawn)
}

/// The worker holding the longest cached prefix of the request, when it holds more than the
/// projected winner and costs at most `(1 + reuse_slack)` times the winner's cost (the cheapest
/// such worker when several hold as much). Off (`reuse_slack` 0) by default: the projected
/// winner minimises this request's time to its first token with the fleet's prefill load on its
/// uncached part, and a slack trades some of that time for prefill the fleet does not compute
/// twice (measured in docs/routing-advanced.md, "Reuse slack").
fn deeper_holder_within_slack(c: &Choosing<'_>, projected_winner: usize) -> Option<usize> {
    if c.cfg.reuse_slack <= 0.0 {
        return None;
    }
    let scored = c.scored;
    let cost = |i: usize| scored[i].terms.cost_s(c.prefill_weight, c.cfg.batch_delay_weight);
    let ceiling = cost(projected_winner) * (1.0 + c.cfg.reuse_slack);
    let winner_holds = scored[projected_winner].cached_tokens;
    (0..scored.len())
        .filter(|&i| scored[i].cached_tokens > winner_holds && cost(i) <= ceiling)
        .max_by(|&a, &b| scored[a].cached_tokens.cmp(&scored[b].cached_tokens).then(cost(b).total_cmp(&cost(a))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Mode;

    fn ask(prompt_tokens: u64, cached_tokens: u64, max_tokens: u64) -> Ask {
        Ask::new(prompt_tokens, cached_tokens, max_tokens)
    }

    fn idle() -> WorkerLoad {
        WorkerLoad {
            waiting_requests: 0,
            waiting_tokens: 0,
            running_requests: 0,
            decode_tokens: 0,
            kv_tokens: 0,
            kv_capacity_tokens: 500_000,
            max_running_requests: 256,
            chunk_tokens: 8192,
            prefill_tps: 20_000.0,
            decode_tps: 2_000.0,
        }
    }

    #[test]
    fn terms_follow_the_formula() {
        let cfg = PolicyConfig::projected(Mode::Enforce);
        // 40 running requests with 4,000 decode tokens; 40k queued prefill tokens.
        let load = WorkerLoad { waiting_tokens: 40_000, running_requests: 40, decode_tokens: 4_000, ..idle() };
        let t = score(&load, ask(10_000, 8_000, 100), &cfg);
        assert_eq!(t.wait_s, 2.0);
        // 42,000 tokens of prefill to our end take 6 steps of 8,192, each carrying 40 sequences.
        assert!((t.decode_s - 6.0 * 40.0 / 2_000.0).abs() < 1e-12, "{}", t.decode_s);
        assert_eq!(t.prefill_s, 0.1);
        assert_eq!(t.barrier_s, 0.0);
        assert!((t.projected_s - (2.0 + 0.12 + 0.1)).abs() < 1e-12);
        // Without credit, 50,000 tokens: 7 steps.
        assert!((t.load_only_s - (2.0 + 7.0 * 0.02 + 0.5)).abs() < 1e-12);
    }

    #[test]
    fn a_busy_fleet_weighs_the_prefill_a_request_brings_and_reports_its_own_seconds_unweighted() {
        let cfg = PolicyConfig::projected(Mode::Enforce);
        let load = WorkerLoad { waiting_tokens: 20_000, ..idle() };
        let t = score(&load, ask(10_000, 2_000, 100), &cfg);
        // 8,000 uncached tokens are 0.4 s of this request's time and, at weight 3, 1.2 s of the fleet's.
        assert!((t.cost_s(3.0, 0.0) - t.projected_s - 2.0 * 0.4).abs() < 1e-12, "{t:?}");
        assert_eq!(t.cost_s(1.0, 0.0), t.projected_s, "an idle fleet: cost = projected");
    }

    #[test]
    fn prefill_on_a_worker_with_a_running_batch_counts_the_delay_it_adds_to_every_sequence() {
        let cfg = PolicyConfig::projected(Mode::Enforce);
        let idle_worker = score(&idle(), ask(10_000, 2_000, 100), &cfg);
        assert_eq!(idle_worker.batch_delay_s, 0.0, "no one to delay");
        let busy = score(&WorkerLoad { running_requests: 30, ..idle() }, ask(10_000, 2_000, 100), &cfg);
        // 8,000 uncached tokens: 0.4 s more for each of the 30 running sequences.
        assert!((busy.batch_delay_s - 12.0).abs() < 1e-12, "{busy:?}");
        assert!((busy.cost_s(1.0, 0.15) - busy.projected_s - 0.15 * 12.0).abs() < 1e-12);
        let cached = score(&WorkerLoad { running_requests: 30, ..idle() }, ask(10_000, 9_984, 100), &cfg);
        assert!(cached.batch_delay_s < 0.03, "a cache hit delays the batch by its suffix only: {cached:?}");
    }

    #[test]
    fn a_running_batch_costs_its_share_of_each_step_not_its_whole_drain() {
        let cfg = PolicyConfig::projected(Mode::Enforce);
        // 30 running requests with 300 tokens left each would take 4.5 s to drain at 2,000 tokens/s;
        // a new 4k prompt is admitted at the next step and shares one step with them.
        let busy = WorkerLoad { running_requests: 30, decode_tokens: 9_000, ..idle() };
        let t = score(&busy, ask(4_096, 0, 100), &cfg);
        assert!((t.decode_s - 30.0 / 2_000.0).abs() < 1e-12, "{}", t.decode_s);
        assert!(t.decode_s < 0.1 * 9_000.0 / 2_000.0);
    }

    #[test]
    fn a_full_batch_makes_a_request_wait_for_running_ones_to_finish() {
        let cfg = PolicyConfig::projected(Mode::Enforce);
        let room = WorkerLoad { running_requests: 8, decode_tokens: 800, max_running_requests: 10, ..idle() };
        let full = WorkerLoad { waiting_requests: 2, ..room };
        let (t_room, t_full) = (score(&room, ask(100, 0, 10), &cfg), score(&full, ask(100, 0, 10), &cfg));
        assert!((t_room.decode_s - 8.0 / 2_000.0).abs() < 1e-12, "{}", t_room.decode_s);
        // 8 + 2 + 1 = 11 wanted, 10 slots: one must finish. They finish at 8 × 2,000 / 800 = 20 a second.
        assert!((t_full.decode_s - t_room.decode_s - 1.0 / 20.0).abs() < 1e-12, "{}", t_full.decode_s);
    }

    #[test]
    fn a_request_adds_to_kv_what_it_shares_with_no_request_in_flight() {
        // A cached prefix nobody uses is free KV in the engine's report and in use once this runs.
        assert_eq!(ask(2_600, 1_900, 128).new_kv_tokens(), 2_728);
        let sharing = Ask { kv_shared_tokens: 1_900, ..ask(2_600, 1_900, 128) };
        assert_eq!(sharing.new_kv_tokens(), 828);
        let over = Ask { kv_shared_tokens: 5_000, ..ask(2_600, 0, 128) };
        assert_eq!(over.new_kv_tokens(), 128);
    }

    #[test]
    fn barrier_is_zero_below_threshold_and_steep_above() {
        let cfg = PolicyConfig::projected(Mode::Enforce);
        assert_eq!(kv_barrier_s(0.5, &cfg), 0.0);
        assert_eq!(kv_barrier_s(0.9, &cfg), 0.0);
        let b95 = kv_barrier_s(0.95, &cfg);
        let b99 = kv_barrier_s(0.99, &cfg);
        assert!(b95 > 0.0 && b99 > 5.0 * b95, "{b95} {b99}");
        assert_eq!(kv_barrier_s(1.2, &cfg), KV_BARRIER_MAX_S);
    }

    #[test]
    fn escape_compares_queue_seconds_and_waiting_counts() {
        let cfg = PolicyConfig { escape_seconds: 1.0, escape_waiting: 3, ..PolicyConfig::default() };
        let busy = WorkerLoad { waiting_requests: 2, waiting_tokens: 30_000, ..idle() };
        let (tb, ti) = (score(&busy, ask(100, 100, 0), &cfg), score(&idle(), ask(100, 0, 0), &cfg));
        assert!(escape_fires((&tb, &busy), (&ti, &idle()), &cfg));
        let crowded = WorkerLoad { waiting_requests: 10, ..idle() };
        let tc = score(&crowded, ask(100, 100, 0), &cfg);
        assert!(escape_fires((&tc, &crowded), (&ti, &idle()), &cfg));
        assert!(!escape_fires((&ti, &idle()), (&ti, &idle()), &cfg));
    }
}
