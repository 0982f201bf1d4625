//! SMG 1.13's expected-wait selector as its `cache_aware` policy uses it for misses and spills
//! (SMG's `least_load.rs`, which its PyPI sdist carries): each worker scores
//!
//! `(q + r·p̄ + u·p̄ + s·p̄) / T + λ·k / (1 − k)` seconds,
//!
//! from SMG's own poll of the worker's load, every 10 s (`load_check_interval_secs`): q the queued
//! prompt tokens it reported (its waiting requests × p̄ where it reports only counts, as vLLM's
//! metrics do), r its running requests, k its KV usage; s the requests SMG sent it since the sample
//! that poll read; u the requests SMG holds on it beyond both (sent before the sample but not in
//! the report). p̄ is 1,024 tokens (over HTTP SMG does not know a request's length), T 2,000
//! tokens/s (the engines report no generation rate), λ 0.15 s. Before its first poll a worker
//! scores as the best polled peer plus its in-flight × p̄ / T; before any poll, its in-flight count.
//! Scores within a microsecond are a tie, drawn uniformly.
//!
//! The poll's staleness is the point: an engine whose last sample showed its KV nearly full scores
//! seconds (0.15 · 0.97 / 0.03 ≈ 4.9 s) for up to 10 s after it has emptied.
//!
//! SMG's worker overload veto rides the same poll (`worker/monitor.rs` `apply_overload_verdict`,
//! `worker/overload.rs`): a worker whose polled report is over 8 waiting or 0.8 KV usage is left
//! out of every policy's selection until a poll finds it under both; when every worker is vetoed the
//! request goes to the one with the fewest in flight, ties drawn (`routers/common/overload.rs`
//! `fallback_if_all_vetoed`), past the policy.

use std::collections::VecDeque;
use std::time::Duration;

use kvgate_core::policy::cache_aware::over_smg_overload_thresholds;
use kvgate_core::{LoadSnapshot, Timestamp};
use rand_chacha::ChaCha8Rng;

use super::{argmin_set, uniform, WorkerView};

/// SMG's default load poll interval.
pub const SMG_POLL_INTERVAL: Duration = Duration::from_secs(10);
/// p̄: SMG's per-request token estimate where a request's length is unknown.
const MEAN_PREFILL_TOKENS: f64 = 1024.0;
/// T: SMG's drain rate where the engine reports none, tokens per second.
const DEFAULT_THROUGHPUT: f64 = 2000.0;
/// λ: the weight of SMG's KV-pressure barrier, seconds.
const KV_PRESSURE_WEIGHT_S: f64 = 0.15;
/// Scores closer than this are one tie.
const TIE_EPSILON_S: f64 = 1e-6;

/// Where SMG may send a request, by its overload veto ([`SmgLoadBook::pool`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SmgPool {
    /// The workers not vetoed (none only when no worker is healthy): the policy chooses among them.
    Open(Vec<usize>),
    /// Every healthy worker is vetoed: the request goes to this one (the fewest in flight), or
    /// nowhere when none is healthy.
    AllVetoed(Option<usize>),
}

/// SMG's view of each worker's load: its last poll and what it sent since.
#[derive(Debug)]
pub struct SmgLoadBook {
    polled: Vec<Option<LoadSnapshot>>,
    next_poll: Vec<Timestamp>,
    /// Dispatch instants not yet covered by a poll's sample, oldest first.
    since_poll: Vec<VecDeque<Timestamp>>,
}

impl SmgLoadBook {
    /// A book for `workers` workers. SMG polls a worker group as soon as it starts (its monitor's
    /// `tokio::time::interval` ticks at once), then every `SMG_POLL_INTERVAL`: the first report is
    /// read, then the first at or after each 10 s.
    pub fn new(workers: usize) -> Self {
        SmgLoadBook {
            polled: vec![None; workers],
            next_poll: vec![Timestamp::ZERO; workers],
            since_poll: vec![VecDeque::new(); workers],
        }
    }

    /// A load report reached the router: SMG reads it if its own poll of the worker is due.
    pub fn on_report(&mut self, worker: usize, snapshot: &LoadSnapshot) {
        let Some(due) = self.next_poll.get_mut(worker) else {
            return;
        };
        if snapshot.observed_at < *due {
            return;
        }
        while *due <= snapshot.observed_at {
            *due = due.saturating_add(SMG_POLL_INTERVAL);
        }
        self.polled[worker] = Some(*snapshot);
        let sent = &mut self.since_poll[worker];
        while sent.front().is_some_and(|&at| at <= snapshot.observed_at) {
            sent.pop_front();
        }
    }

    /// SMG sent `worker` a request at `now`.
    pub fn sent(&mut self, worker: usize, now: Timestamp) {
        if let Some(sent) = self.since_poll.get_mut(worker) {
            sent.push_back(now);
        }
    }

    fn polled_score(&self, worker: usize, snapshot: &LoadSnapshot, in_flight: u64) -> f64 {
        let queued = if snapshot.estimated.is_none() && snapshot.waiting_tokens > 0 {
            snapshot.waiting_tokens as f64
        } else {
            snapshot.waiting_requests as f64 * MEAN_PREFILL_TOKENS
        };
        let since = self.since_poll[worker].len() as u64;
        let reported = snapshot.waiting_requests + snapshot.running_requests;
        let unaccounted = in_flight.saturating_sub(reported + since);
        let requests = (snapshot.running_requests + unaccounted + since) as f64;
        let k = snapshot.kv_usage.clamp(0.0, 0.999);
        (queued + requests * MEAN_PREFILL_TOKENS) / DEFAULT_THROUGHPUT + KV_PRESSURE_WEIGHT_S * k / (1.0 - k)
    }

    /// Each candidate's expected wait, in `candidates`' order.
    pub fn scores(&self, candidates: &[usize], view: &[WorkerView]) -> Vec<f64> {
        let polled: Vec<Option<f64>> = candidates
            .iter()
            .map(|&w| self.polled[w].as_ref().map(|s| self.polled_score(w, s, view[w].in_flight)))
            .collect();
        let baseline = polled.iter().flatten().copied().fold(f64::INFINITY, f64::min);
        candidates
            .iter()
            .zip(&polled)
            .map(|(&w, score)| match score {
                Some(s) => *s,
                None if baseline.is_finite() => {
                    baseline + view[w].in_flight as f64 * MEAN_PREFILL_TOKENS / DEFAULT_THROUGHPUT
                }
                None => view[w].in_flight as f64,
            })
            .collect()
    }

    /// Whether SMG's overload veto holds `worker` out: its last poll was over SMG's thresholds. An
    /// unpolled worker is not vetoed.
    pub fn vetoed(&self, worker: usize) -> bool {
        self.polled
            .get(worker)
            .and_then(Option::as_ref)
            .is_some_and(|s| over_smg_overload_thresholds(s.waiting_requests, s.kv_usage))
    }

    /// Where SMG may send a request among the `healthy` workers: those its veto leaves, or, when it
    /// vetoes every one, the fallback SMG takes then, past the policy.
    pub fn pool(&self, healthy: &[usize], view: &[WorkerView], rng: &mut ChaCha8Rng) -> SmgPool {
        let open: Vec<usize> = healthy.iter().copied().filter(|&w| !self.vetoed(w)).collect();
        if !open.is_empty() || healthy.is_empty() {
            return SmgPool::Open(open);
        }
        SmgPool::AllVetoed(uniform(&argmin_set(healthy, |w| view[w].in_flight), rng))
    }

    /// The candidate with the least expected wait (ties drawn), or `None` if there is none.
    pub fn select(&self, candidates: &[usize], view: &[WorkerView], rng: &mut ChaCha8Rng) -> Option<usize> {
        let scores = self.scores(candidates, view);
        let best = scores.iter().copied().fold(f64::INFINITY, f64::min);
        let tied: Vec<usize> =
            candidates.iter().zip(&scores).filter(|(_, s)| **s - best <= TIE_EPSILON_S).map(|(&w, _)| w).collect();
        uniform(&tied, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn report(kv_usage: f64, waiting: u64, running: u64, at_s: u64) -> LoadSnapshot {
        LoadSnapshot {
            waiting_requests: waiting,
            running_requests: running,
            kv_usage,
            observed_at: Timestamp::from_millis(at_s * 1000),
            ..LoadSnapshot::default()
        }
    }

    fn views(in_flight: &[u64]) -> Vec<WorkerView> {
        in_flight.iter().map(|&n| WorkerView { healthy: true, in_flight: n, ..WorkerView::default() }).collect()
    }

    #[test]
    fn before_any_poll_the_fewest_in_flight_win() {
        let book = SmgLoadBook::new(3);
        let view = views(&[2, 1, 3]);
        assert_eq!(book.scores(&[0, 1, 2], &view), vec![2.0, 1.0, 3.0]);
        assert_eq!(book.select(&[0, 1, 2], &view, &mut ChaCha8Rng::seed_from_u64(1)), Some(1));
    }

    #[test]
    fn a_stale_poll_of_a_full_cache_keeps_smg_off_an_engine_until_the_next_poll() {
        let mut book = SmgLoadBook::new(2);
        assert_eq!(book.scores(&[0, 1], &views(&[0, 1])), vec![0.0, 1.0], "no poll read yet");
        // Polled at once, then every 10 s: the report at 5 s is read, the one at 8 s is not.
        book.on_report(0, &report(0.97, 0, 8, 5));
        book.on_report(1, &report(0.10, 0, 1, 5));
        book.on_report(1, &report(0.0, 0, 0, 8));
        // Engine 0 has emptied since (0 in flight), but SMG scores the sample: 8 running × 0.512 s
        // plus 0.15 · 0.97 / 0.03 s; engine 1 with its one request is far cheaper.
        let scores = book.scores(&[0, 1], &views(&[0, 1]));
        assert!((scores[0] - (8.0 * 0.512 + 0.15 * 0.97 / 0.03)).abs() < 1e-9, "{scores:?}");
        assert!((scores[1] - (0.512 + 0.15 * 0.10 / 0.90)).abs() < 1e-9, "{scores:?}");
        // A report between polls is not read; the next poll, at 10 s, is.
        book.on_report(0, &report(0.0, 0, 0, 9));
        assert!(book.scores(&[0], &views(&[0]))[0] > 4.0);
        book.on_report(0, &report(0.0, 0, 0, 10));
        assert_eq!(book.scores(&[0], &views(&[0]))[0], 0.0);
    }

    #[test]
    fn requests_sent_since_the_sample_count_and_the_next_sample_releases_them() {
        let mut book = SmgLoadBook::new(2);
        book.on_report(0, &report(0.0, 0, 0, 10));
        book.on_report(1, &report(0.0, 0, 0, 10));
        let view = views(&[2, 0]);
        book.sent(0, Timestamp::from_millis(11_000));
        book.sent(0, Timestamp::from_millis(12_000));
        assert_eq!(book.scores(&[0, 1], &view), vec![2.0 * 0.512, 0.0]);
        // The next sample, at 20 s, saw both (running): they leave the since-poll credit.
        book.on_report(0, &report(0.0, 0, 2, 20));
        assert_eq!(book.scores(&[0], &view), vec![2.0 * 0.512]);
        // Held beyond the report: two in flight that a sample shows none of count as unaccounted.
        book.on_report(0, &report(0.0, 0, 0, 30));
        assert_eq!(book.scores(&[0], &view), vec![2.0 * 0.512]);
    }

    #[test]
    fn the_overload_veto_holds_from_one_poll_to_the_next_and_a_fully_vetoed_fleet_takes_the_fewest_in_flight() {
        let mut book = SmgLoadBook::new(3);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let view = views(&[5, 2, 9]);
        assert_eq!(book.pool(&[0, 1, 2], &view, &mut rng), SmgPool::Open(vec![0, 1, 2]), "no poll, no veto");
        // At the 10 s poll, engine 0 has 8 waiting and engine 2 a cache 0.8 full.
        book.on_report(0, &report(0.1, 8, 4, 10));
        book.on_report(1, &report(0.1, 7, 4, 10));
        book.on_report(2, &report(0.8, 0, 4, 10));
        assert!(book.vetoed(0) && !book.vetoed(1) && book.vetoed(2));
        assert_eq!(book.pool(&[0, 1, 2], &view, &mut rng), SmgPool::Open(vec![1]));
        // Engine 0 drains, but a report between polls is not read: the veto holds until 20 s.
        book.on_report(0, &report(0.0, 0, 0, 15));
        assert!(book.vetoed(0));
        book.on_report(0, &report(0.0, 0, 0, 20));
        assert!(!book.vetoed(0));
        // Every healthy worker vetoed: the fewest in flight, past the policy.
        book.on_report(0, &report(0.9, 0, 0, 30));
        book.on_report(1, &report(0.1, 9, 0, 30));
        assert_eq!(book.pool(&[0, 1, 2], &view, &mut rng), SmgPool::AllVetoed(Some(1)));
        assert_eq!(book.pool(&[], &view, &mut rng), SmgPool::Open(vec![]), "no healthy worker, no pool");
    }

    #[test]
    fn an_unpolled_worker_scores_the_best_polled_peer_plus_its_own_in_flight() {
        let mut book = SmgLoadBook::new(2);
        book.on_report(0, &report(0.0, 1, 0, 10));
        let scores = book.scores(&[0, 1], &views(&[1, 3]));
        assert_eq!(scores, vec![0.512, 0.512 + 3.0 * 0.512]);
    }
}
