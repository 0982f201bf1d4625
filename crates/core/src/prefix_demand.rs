//! How often requests ask for each cached prefix, and since when: what a new copy of a hot prefix
//! would serve.
//!
//! A prefix is named by its deepest block key that some worker holds (the longest cached match of a
//! request). Requests that share a system prompt and differ after it all name the system prompt's
//! last block; a session's turns each name a different, deeper block of their own history, so a
//! session is never mistaken for a hot prefix.

use rustc_hash::FxHashMap;

use crate::ids::{BlockKey, WorkerSlot};
use crate::load::{PrefillDemand, DEMAND_WINDOW};
use crate::time::Timestamp;
use std::time::Duration;

/// Prefixes tracked at most. Past it, the ones asked for least lately are forgotten.
pub const MAX_TRACKED_PREFIXES: usize = 8_192;

/// One prefix's requests: a rate decayed over [`DEMAND_WINDOW`], like the fleet's prefill.
#[derive(Debug, Clone, PartialEq)]
struct Demand {
    requests: PrefillDemand,
    /// When the prefix was first asked for (as tracked: a forgotten prefix starts again).
    since: Timestamp,
    /// When it was last asked for: a reading from before then is taken as of then.
    last: Timestamp,
    /// Copies sent and not yet seen: each worker a copy went to, until when it is expected to hold
    /// the prefix.
    copies: Vec<(WorkerSlot, Timestamp)>,
}

/// What the router knows of a prefix's demand at a decision.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefixHeat {
    /// Requests per second that asked for the prefix lately.
    pub rate_per_s: f64,
    /// Seconds since it was first asked for: how long it has been hot so far, and so about how
    /// long it can be expected to stay hot.
    pub age_s: f64,
}

/// Decayed request rates per prefix.
#[derive(Debug, Clone, Default)]
pub struct PrefixDemand {
    prefixes: FxHashMap<BlockKey, Demand>,
}

impl PrefixDemand {
    /// Counts one request for `prefix` at `now`. Observations older than the prefix's last count
    /// as of that last one.
    pub fn add(&mut self, prefix: BlockKey, now: Timestamp) {
        if self.prefixes.len() >= MAX_TRACKED_PREFIXES && !self.prefixes.contains_key(&prefix) {
            self.forget_coldest(now);
        }
        let d = self.prefixes.entry(prefix).or_insert(Demand {
            requests: PrefillDemand::default(),
            since: now,
            last: now,
            copies: Vec::new(),
        });
        d.requests.add(1, now);
        d.last = d.last.max(now);
    }

    /// The prefix's demand at `now`; zero for one never asked for.
    pub fn heat(&self, prefix: BlockKey, now: Timestamp) -> PrefixHeat {
        let Some(d) = self.prefixes.get(&prefix) else {
            return PrefixHeat::default();
        };
        let now = now.max(d.last);
        let age_s = now.saturating_since(d.since).as_secs_f64();
        // The decayed rate of a steady stream reaches its rate once the stream has run for a few
        // windows; a younger one has filled only `1 − exp(−age / window)` of it.
        let filled = 1.0 - (-age_s.max(1.0) / DEMAND_WINDOW.as_secs_f64()).exp();
        PrefixHeat { rate_per_s: d.requests.rate(now) / filled, age_s }
    }

    /// Records a copy of `prefix` sent to `worker` at `now`, expected to hold it within `lands_in`:
    /// until its KV events show it or that time passes, it counts as a holder
    /// ([`Self::copies_in_flight`]), so that a burst of requests, all decided before the first copy
    /// has computed anything, does not copy the prefix to every idle worker at once.
    pub fn copy_sent(&mut self, prefix: BlockKey, worker: WorkerSlot, now: Timestamp, lands_in: Duration) {
        if let Some(d) = self.prefixes.get_mut(&prefix) {
            d.copies.retain(|&(w, until)| until > now && w != worker);
            d.copies.push((worker, now.saturating_add(lands_in)));
        }
    }

    /// The workers a copy of `prefix` was sent to that may not hold it yet, as of `now`.
    pub fn copies_in_flight(&self, prefix: BlockKey, now: Timestamp) -> impl Iterator<Item = WorkerSlot> + '_ {
        self.prefixes
            .get(&prefix)
            .into_iter()
            .flat_map(move |d| d.copies.iter().filter(move |&&(_, until)| until > now).map(|&(w, _)| w))
    }

    /// Prefixes tracked.
    pub fn len(&self) -> usize {
        self.prefixes.len()
    }

    /// Whether no prefix is tracked.
    pub fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// Forgets the half of the prefixes asked for least lately.
    fn forget_coldest(&mut self, now: Timestamp) {
        let mut rates: Vec<f64> = self.prefixes.values().map(|d| d.requests.rate(now)).collect();
        let mid = rates.len() / 2;
        let (_, median, _) = rates.select_nth_unstable_by(mid, f64::total_cmp);
        let median = *median;
        self.prefixes.retain(|_, d| d.requests.rate(now) > median);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn a_steady_stream_reads_its_rate_young_and_old() {
        let mut d = PrefixDemand::default();
        let hot = BlockKey(7);
        // 10 requests a second.
        for i in 0..=50 {
            d.add(hot, at_ms(i * 100));
        }
        let young = d.heat(hot, at_ms(5_000));
        assert!((young.rate_per_s / 10.0 - 1.0).abs() < 0.15, "{young:?}");
        assert_eq!(young.age_s, 5.0);
        for i in 51..=1_200 {
            d.add(hot, at_ms(i * 100));
        }
        let old = d.heat(hot, at_ms(120_000));
        assert!((old.rate_per_s / 10.0 - 1.0).abs() < 0.05, "{old:?}");
        assert_eq!(old.age_s, 120.0);
        // A window of silence later it has decayed by e.
        let later = d.heat(hot, at_ms(140_000)).rate_per_s;
        assert!((later * std::f64::consts::E / old.rate_per_s - 1.0).abs() < 0.01, "{later}");
        assert_eq!(d.heat(BlockKey(8), at_ms(0)), PrefixHeat::default());
    }

    #[test]
    fn a_copy_is_in_flight_until_it_should_have_landed() {
        let mut d = PrefixDemand::default();
        let (hot, a, b) = (BlockKey(7), WorkerSlot(1), WorkerSlot(2));
        let flying = |d: &PrefixDemand, ms| d.copies_in_flight(hot, at_ms(ms)).collect::<Vec<_>>();
        // A prefix never asked for has nothing to copy.
        d.copy_sent(hot, a, at_ms(0), Duration::from_secs(2));
        assert!(flying(&d, 0).is_empty());
        d.add(hot, at_ms(0));
        d.copy_sent(hot, a, at_ms(0), Duration::from_secs(2));
        d.copy_sent(hot, b, at_ms(500), Duration::from_secs(2));
        assert_eq!(flying(&d, 1_000), [a, b]);
        assert_eq!(flying(&d, 2_000), [b], "a's copy should have landed by now");
        // Sent again, a copy to the same worker counts once, from the later send.
        d.copy_sent(hot, b, at_ms(2_000), Duration::from_secs(2));
        assert_eq!(flying(&d, 3_000), [b]);
        assert!(flying(&d, 4_000).is_empty());
        assert_eq!(d.copies_in_flight(BlockKey(8), at_ms(0)).count(), 0);
    }

    #[test]
    fn past_the_bound_the_coldest_prefixes_are_forgotten() {
        let mut d = PrefixDemand::default();
        let hot = BlockKey(u64::MAX);
        for i in 0..MAX_TRACKED_PREFIXES as u64 * 2 {
            d.add(BlockKey(i), at_ms(i));
            d.add(hot, at_ms(i));
        }
        assert!(d.len() <= MAX_TRACKED_PREFIXES, "{}", d.len());
        assert!(d.heat(hot, at_ms(MAX_TRACKED_PREFIXES as u64 * 2)).rate_per_s > 100.0);
        // An observation from the past counts as of the prefix's last one.
        d.add(hot, at_ms(0));
        assert!(d.heat(hot, at_ms(0)).age_s > 0.0);
    }
}
