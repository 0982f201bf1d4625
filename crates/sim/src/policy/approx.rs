//! Baselines that learn prefixes from their own routing decisions (no engine events): the classic
//! SGLang cache-aware router (§4), AIBrix `prefix-cache` (§7) and LMetric (§8).
//!
//! Their trees match characters or bytes of prompt text; the simulator has token ids, so every tree
//! here matches 16-token pages of the prompt (the router's chained block keys at block size 16),
//! records the pick, and forgets entries idle for longer than the peer's eviction interval.

use std::time::Duration;

use kvgate_core::{BlockKey, RequestId, Timestamp};
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;

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
