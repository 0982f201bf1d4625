//! Baselines that learn prefixes from their own routing decisions (no engine events): the classic
//! SGLang cache-aware router (§4), SMG 1.13's `cache_aware` over HTTP workers, AIBrix
//! `prefix-cache` (§7) and LMetric (§8).
//!
//! Their trees match characters or bytes of prompt text; the simulator has token ids, so every tree
//! here matches 16-token pages of the prompt (the router's chained block keys at block size 16),
//! records the pick, and forgets entries idle for longer than the peer's eviction interval.

use std::time::Duration;

use kvgate_core::policy::cache_aware;
use kvgate_core::{BlockKey, LoadSnapshot, PolicyConfig, PolicyName, RequestId, Timestamp};
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;

use super::smg_wait::{SmgLoadBook, SmgPool};
use super::{argmin_set, healthy, uniform, FleetInfo, Pick, PolicyRequest, SimPolicy, WorkerView};

/// Page size of the approximate trees, in tokens.
pub const PAGE_TOKENS: usize = 16;

/// A router-side record of which worker was sent which prefix pages, with idle expiry and a cap.
#[derive(Debug)]
pub struct ApproxIndex {
    entries: FxHashMap<BlockKey, Vec<(usize, Timestamp)>>,
    per_worker: Vec<u64>,
    ttl: Duration,
    max_entries: usize,
}

impl ApproxIndex {
    /// An empty index.
    pub fn new(workers: usize, ttl: Duration, max_entries: usize) -> Self {
        ApproxIndex { entries: FxHashMap::default(), per_worker: vec![0; workers], ttl, max_entries }
    }

    fn live(&self, touched: Timestamp, now: Timestamp) -> bool {
        now.saturating_since(touched) <= self.ttl
    }

    /// Records that `worker` was sent a prompt with these pages.
    pub fn insert(&mut self, keys: &[BlockKey], worker: usize, now: Timestamp) {
        for k in keys {
            let holders = self.entries.entry(*k).or_default();
            match holders.iter_mut().find(|(w, _)| *w == worker) {
                Some(h) => h.1 = now,
                None => {
                    holders.push((worker, now));
                    self.per_worker[worker] += 1;
                }
            }
        }
        if self.entries.len() > self.max_entries + self.max_entries / 8 {
            self.prune(now);
        }
    }

    /// Drops expired entries, then the least recently touched until under the cap.
    fn prune(&mut self, now: Timestamp) {
        let (ttl, per_worker) = (self.ttl, &mut self.per_worker);
        self.entries.retain(|_, holders| {
            holders.retain(|(w, t)| {
                let keep = now.saturating_since(*t) <= ttl;
                if !keep {
                    per_worker[*w] -= 1;
                }
                keep
            });
            !holders.is_empty()
        });
        if self.entries.len() > self.max_entries {
            let mut ages: Vec<Timestamp> =
                self.entries.values().map(|h| h.iter().map(|(_, t)| *t).max().unwrap_or_default()).collect();
            let cut = self.entries.len() - self.max_entries;
            ages.select_nth_unstable(cut);
            let threshold = ages[cut];
            let per_worker = &mut self.per_worker;
            self.entries.retain(|_, holders| {
                let newest = holders.iter().map(|(_, t)| *t).max().unwrap_or_default();
                if newest < threshold {
                    for (w, _) in holders.iter() {
                        per_worker[*w] -= 1;
                    }
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Leading pages each worker holds (live entries only).
    pub fn overlaps(&self, keys: &[BlockKey], now: Timestamp) -> Vec<u32> {
        let mut depth = vec![0u32; self.per_worker.len()];
        let mut alive: Vec<usize> = (0..self.per_worker.len()).collect();
        for (i, k) in keys.iter().enumerate() {
            let Some(holders) = self.entries.get(k) else {
                break;
            };
            alive.retain(|w| holders.iter().any(|(h, t)| h == w && self.live(*t, now)));
            if alive.is_empty() {
                break;
            }
            for &w in &alive {
                depth[w] = i as u32 + 1;
            }
        }
        depth
    }

    /// When `worker` was last sent a prompt with page `key`, if it was.
    pub fn touched(&self, key: &BlockKey, worker: usize) -> Option<Timestamp> {
        self.entries.get(key)?.iter().find(|(w, _)| *w == worker).map(|(_, t)| *t)
    }

    /// Pages recorded for a worker (the tenant's tree size).
    pub fn size_of(&self, worker: usize) -> u64 {
        self.per_worker[worker]
    }
}

/// Classic SGLang cache-aware router (v0.4): balance on in-flight spread, else longest prefix above a
/// match threshold, else the tenant with the smallest tree. Defaults: threshold 0.5, abs 32,
/// rel 1.0001, eviction 60 s.
#[derive(Debug)]
pub struct SglangV04 {
    tree: ApproxIndex,
}

impl SglangV04 {
    /// A router for `fleet`.
    pub fn new(fleet: &FleetInfo) -> Self {
        SglangV04 { tree: ApproxIndex::new(fleet.workers, Duration::from_secs(60), 1 << 20) }
    }
}

impl SimPolicy for SglangV04 {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let h = healthy(view);
        if h.is_empty() {
            return None;
        }
        let keys = req.page_keys;
        let max_i = h.iter().map(|&w| view[w].in_flight).max().unwrap_or(0);
        let min_i = h.iter().map(|&w| view[w].in_flight).min().unwrap_or(0);
        let w = if max_i - min_i > 32 && max_i as f64 > 1.0001 * min_i as f64 {
            uniform(&argmin_set(&h, |w| view[w].in_flight), rng)?
        } else {
            let depth = self.tree.overlaps(keys, now);
            let best = h.iter().map(|&w| depth[w]).max().unwrap_or(0);
            let rate = if keys.is_empty() { 0.0 } else { best as f64 / keys.len() as f64 };
            if rate > 0.5 {
                let holders: Vec<usize> = h.iter().copied().filter(|&w| depth[w] == best).collect();
                uniform(&holders, rng)?
            } else {
                uniform(&argmin_set(&h, |w| self.tree.size_of(w)), rng)?
            }
        };
        self.tree.insert(keys, w, now);
        Some(Pick::of(w))
    }
}

/// SMG 1.13's `cache_aware` over HTTP workers, as it runs there: no engine events, so it matches the
/// request against its own tree of what it sent each worker, crediting a prompt to the chosen worker
/// at routing time (its counters name the branches: `tree_match`, `spill`,
/// `expected_wait_fallback`; 257, 31 and 2 of 290 requests on the paced incident's bursts).
///
/// - Workers SMG's overload veto holds out (8 waiting or 0.8 KV usage in its last 10-second poll)
///   are left out while another is under both; when every worker is vetoed, the fewest in flight
///   takes the request ([`SmgLoadBook::pool`]).
/// - A match rate (matched over the prompt's pages) not over `cache_threshold` (0.3) is a miss: it
///   goes to the least expected wait ([`SmgLoadBook`]: SMG's own 10-second poll of each worker's
///   load, what it sent since, its KV barrier).
/// - Otherwise the deepest holder, **whatever its load**. Measured on SMG 1.13 (its debug log, two
///   workers both holding a 3,600-character prefix): eight concurrent requests of that prefix with
///   new endings all went to the one holder that had been sent the first of them (in flight 0 to 7)
///   while the other sat idle, because its tree matched the ending's first characters too. The
///   character tree gives a family of requests to the holder that got the family's first one;
///   pages of 16 tokens tie there, so the model gives the tie to the holder most recently sent the
///   deepest matched page (then a draw).
/// - The pick then meets SMG's spill gate (`cache_aware::over_spill_gate`, guards on): only past it
///   does load move a request, to the least expected wait among the workers under the gate.
///
/// The gate and the selector are read from SMG 1.13's source (its PyPI sdist:
/// `model_gateway/src/policies/cache_aware.rs`, `least_load.rs`).
///
/// SMG evicts its tree by size every 120 s; the model forgets by size alone (1M pages per fleet).
#[derive(Debug)]
pub struct SmgCacheAwareHttp {
    tree: ApproxIndex,
    cfg: PolicyConfig,
    loads: SmgLoadBook,
}

/// SMG 1.13's `cache_threshold`: the match rate under which a request is routed by load alone.
pub const SMG_CACHE_THRESHOLD: f64 = 0.3;

impl SmgCacheAwareHttp {
    /// A router for `fleet`.
    pub fn new(fleet: &FleetInfo) -> Self {
        SmgCacheAwareHttp {
            tree: ApproxIndex::new(fleet.workers, Duration::MAX, 1 << 20),
            cfg: PolicyConfig { smg_guards: true, ..PolicyConfig::new(PolicyName::CacheAware) },
            loads: SmgLoadBook::new(fleet.workers),
        }
    }
}

impl SimPolicy for SmgCacheAwareHttp {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let eligible = match self.loads.pool(&healthy(view), view, rng) {
            SmgPool::Open(open) if !open.is_empty() => open,
            SmgPool::Open(_) => return None,
            // Every worker vetoed: SMG's fallback sends the request past the policy, so its tree
            // does not learn it.
            SmgPool::AllVetoed(fallback) => {
                let w = fallback?;
                self.loads.sent(w, now);
                return Some(Pick::of(w));
            }
        };
        let keys = req.page_keys;
        let depth = self.tree.overlaps(keys, now);
        let mean = eligible.iter().map(|&w| view[w].in_flight as f64).sum::<f64>() / eligible.len() as f64;
        let over_gate = |w: usize| cache_aware::over_spill_gate(view[w].in_flight as f64, mean, &self.cfg);
        let best = eligible.iter().map(|&w| depth[w]).max().unwrap_or(0);
        let rate = if keys.is_empty() { 0.0 } else { best as f64 / keys.len() as f64 };
        let holder = if best > 0 && rate > SMG_CACHE_THRESHOLD {
            let deepest: Vec<usize> = eligible.iter().copied().filter(|&w| depth[w] == best).collect();
            let last_page = &keys[best as usize - 1];
            let latest = |w: usize| self.tree.touched(last_page, w).unwrap_or_default();
            uniform(&argmin_set(&deepest, |w| std::cmp::Reverse(latest(w))), rng)
        } else {
            None
        };
        let w = match holder {
            Some(w) if !over_gate(w) => w,
            // A spill: the expected-wait choice among the workers under the gate (all if none is).
            Some(_) => {
                let under_gate: Vec<usize> = eligible.iter().copied().filter(|&w| !over_gate(w)).collect();
                self.loads.select(if under_gate.is_empty() { &eligible } else { &under_gate }, view, rng)?
            }
            // A miss: the expected-wait choice among all eligible workers.
            None => self.loads.select(&eligible, view, rng)?,
        };
        self.tree.insert(keys, w, now);
        self.loads.sent(w, now);
        Some(Pick::of(w))
    }

    fn on_load(&mut self, worker: usize, snapshot: &LoadSnapshot) {
        self.loads.on_report(worker, snapshot);
    }
}

/// AIBrix `prefix-cache` (code defaults A = 8, F = 1; one shared LRU of 200k pages, idle > 20 min
/// dropped).
#[derive(Debug)]
pub struct Aibrix {
    tree: ApproxIndex,
}

impl Aibrix {
    /// A router for `fleet`.
    pub fn new(fleet: &FleetInfo) -> Self {
        Aibrix { tree: ApproxIndex::new(fleet.workers, Duration::from_secs(20 * 60), 200_000) }
    }
}

impl SimPolicy for Aibrix {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let ready = healthy(view);
        if ready.is_empty() {
            return None;
        }
        let keys = req.page_keys;
        let r = |w: usize| view[w].in_flight as f64;
        let min_r = ready.iter().map(|&w| r(w)).fold(f64::INFINITY, f64::min);
        let max_r = ready.iter().map(|&w| r(w)).fold(0.0, f64::max);
        let pool: Vec<usize> = if max_r - min_r > 8.0 {
            ready.iter().copied().filter(|&w| r(w) == min_r).collect()
        } else {
            ready.clone()
        };
        let n = ready.len() as f64;
        let mean = ready.iter().map(|&w| r(w)).sum::<f64>() / n;
        let var = if n > 1.0 { ready.iter().map(|&w| (r(w) - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
        let limit = mean + var.sqrt();
        let depth = self.tree.overlaps(keys, now);
        let blocks = keys.len().max(1) as u64;
        let mut matched: Vec<usize> = pool.iter().copied().filter(|&w| depth[w] > 0).collect();
        // Pre-shuffled, then a stable sort: ties keep the random order.
        for i in (1..matched.len()).rev() {
            use rand::Rng;
            matched.swap(i, rng.random_range(0..=i));
        }
        matched.sort_by_key(|&w| (std::cmp::Reverse(100 * depth[w] as u64 / blocks), view[w].in_flight));
        let w = match matched.into_iter().find(|&w| r(w) <= limit) {
            Some(w) => w,
            None => uniform(&argmin_set(&ready, |w| view[w].in_flight), rng)?,
        };
        self.tree.insert(keys, w, now);
        Some(Pick::of(w))
    }
}

/// LMetric: `score = (L − m)·(I + 1)` → argmin, ties by (I, new prefill, index). No thresholds.
#[derive(Debug)]
pub struct Lmetric {
    tree: ApproxIndex,
    inflight: FxHashMap<RequestId, usize>,
}

impl Lmetric {
    /// A router for `fleet`.
    pub fn new(fleet: &FleetInfo) -> Self {
        Lmetric {
            tree: ApproxIndex::new(fleet.workers, Duration::from_secs(120), 1 << 20),
            inflight: FxHashMap::default(),
        }
    }
}

impl SimPolicy for Lmetric {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        now: Timestamp,
        _rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let keys = req.page_keys;
        let depth = self.tree.overlaps(keys, now);
        let l = req.prompt_tokens;
        let new_prefill = |w: usize| l.saturating_sub(depth[w] as u64 * PAGE_TOKENS as u64);
        let w = healthy(view)
            .into_iter()
            .min_by_key(|&w| (new_prefill(w) * (view[w].in_flight + 1), view[w].in_flight, new_prefill(w), w))?;
        self.tree.insert(keys, w, now);
        self.inflight.insert(req.id, w);
        Some(Pick::of(w))
    }

    fn on_finish(&mut self, id: RequestId, _now: Timestamp, _output_tokens: Option<u64>) {
        self.inflight.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn fleet(workers: usize) -> FleetInfo {
        FleetInfo {
            workers,
            block_size: 16,
            prefill_tokens_per_s: 10_000.0,
            decode_tokens_per_s: 1_000.0,
            kv_capacity_tokens: 100_000,
            max_running_requests: 64,
            chunk_tokens: 2_048,
            first_worker_rate_scale: 1.0,
        }
    }

    /// Sends a request of `shared` common pages and `own` pages of its own (keyed by `tag`) through
    /// `policy`, counting it in flight on the worker it chose.
    fn route(policy: &mut SmgCacheAwareHttp, view: &mut [WorkerView], shared: u64, own: u64, tag: u64) -> usize {
        let keys: Vec<BlockKey> =
            (0..shared).map(BlockKey).chain((0..own).map(|i| BlockKey(1_000 * tag + i))).collect();
        let req = PolicyRequest {
            id: RequestId(tag),
            keys: &keys,
            page_keys: &keys,
            prompt_tokens: 16 * keys.len() as u64,
            max_tokens: 8,
        };
        let now = Timestamp::from_millis(tag);
        let w = policy.decide(&req, view, now, &mut ChaCha8Rng::seed_from_u64(tag)).unwrap().worker;
        view[w].in_flight += 1;
        view[w].routed += 1;
        w
    }

    #[test]
    fn smg_over_http_keeps_a_prefix_on_its_latest_holder_until_the_spill_gate() {
        let mut policy = SmgCacheAwareHttp::new(&fleet(4));
        let mut view = vec![WorkerView { healthy: true, ..WorkerView::default() }; 4];
        // Nothing matches: the least loaded (the lowest slot on a tie).
        let owner = route(&mut policy, &mut view, 8, 2, 1);
        for w in (0..4).filter(|&w| w != owner) {
            view[w].in_flight = 3;
        }
        // The prefix goes on to its holder however busy, up to the gate: at 10 in flight against 3
        // on each peer the mean is 4.75 and the margin max(4, ⌈2·√4.75⌉) = 5, so the holder spills
        // the 11th (at 9 the margin was ⌈4.24⌉ = 5 too, and 9 is not over 9.5).
        for tag in 2..=10 {
            assert_eq!(route(&mut policy, &mut view, 8, 2, tag), owner, "request {tag}");
        }
        assert_eq!(view[owner].in_flight, 10);
        let spilled = route(&mut policy, &mut view, 8, 2, 11);
        assert_ne!(spilled, owner, "over the gate: the least loaded");
        // The spill target was credited the prefix when it was sent it, so it now holds it too, and
        // being its latest holder it takes the next request of the prefix though the owner is free.
        view[owner].in_flight = 0;
        assert_eq!(route(&mut policy, &mut view, 8, 2, 12), spilled);
    }

    #[test]
    fn smg_over_http_routes_a_low_match_by_load_alone() {
        let mut policy = SmgCacheAwareHttp::new(&fleet(2));
        let mut view = vec![WorkerView { healthy: true, ..WorkerView::default() }; 2];
        let first = route(&mut policy, &mut view, 2, 0, 1);
        // Two pages of eight held (a match rate of 0.25, under 0.3): load decides.
        let second = route(&mut policy, &mut view, 2, 6, 2);
        assert_ne!(second, first);
        // Two of five (0.4): both hold them; the latest holder wins though it is the busier.
        view[second].in_flight = 5;
        assert_eq!(route(&mut policy, &mut view, 2, 3, 3), second);
    }

    #[test]
    fn smg_over_http_sends_misses_and_spills_by_its_stale_poll_not_by_in_flight() {
        let mut policy = SmgCacheAwareHttp::new(&fleet(3));
        let mut view = vec![WorkerView { healthy: true, ..WorkerView::default() }; 3];
        // SMG's 10-second poll saw engine 0 with its KV nearly full and 8 running, engines 1 and 2
        // with one request each; engine 0 has emptied since, and the router's own view says so.
        let sample = |kv_usage, running| LoadSnapshot {
            running_requests: running,
            kv_usage,
            observed_at: Timestamp::from_millis(10_000),
            ..LoadSnapshot::default()
        };
        for (w, kv, running) in [(0, 0.79, 8), (1, 0.1, 1), (2, 0.1, 1)] {
            policy.on_load(w, &sample(kv, running));
        }
        view[1].in_flight = 1;
        view[2].in_flight = 1;
        // A miss avoids the idle engine 0 for what the poll read (8 × 0.512 s and the KV barrier).
        let miss = route(&mut policy, &mut view, 0, 8, 10_001);
        assert_ne!(miss, 0);
        // Each send is credited until the next poll, so the next miss goes to the other engine.
        let next = route(&mut policy, &mut view, 0, 8, 10_002);
        assert!(next != 0 && next != miss, "{miss} then {next}");
    }

    #[test]
    fn approximate_index_expires_idle_entries_and_respects_its_cap() {
        let mut idx = ApproxIndex::new(2, Duration::from_secs(10), 4);
        let keys: Vec<BlockKey> = (0..3).map(BlockKey).collect();
        idx.insert(&keys, 0, Timestamp::ZERO);
        assert_eq!(idx.overlaps(&keys, Timestamp::from_millis(5_000)), vec![3, 0]);
        assert_eq!(idx.overlaps(&keys, Timestamp::from_millis(11_000)), vec![0, 0]);
        let more: Vec<BlockKey> = (10..16).map(BlockKey).collect();
        idx.insert(&more, 1, Timestamp::from_millis(12_000));
        // Over the cap: the expired pages go first; the fresh ones stay (they are all equally new).
        assert_eq!(idx.entries.len(), 6);
        let older: Vec<BlockKey> = (20..24).map(BlockKey).collect();
        idx.insert(&older[..2], 0, Timestamp::from_millis(13_000));
        idx.insert(&older[2..], 0, Timestamp::from_millis(14_000));
        assert!(idx.entries.len() <= 4 + 4 / 2, "pruned toward the cap: {}", idx.entries.len());
        assert_eq!(idx.size_of(0) + idx.size_of(1), idx.entries.values().map(Vec::len).sum::<usize>() as u64);
    }
}
