//! How often requests ask for each cached prefix, and since when: what a new copy of a hot prefix
//! would serve.
//!
//! A prefix is named by its deepest block key that some worker holds (the longest cached match of a
//! request). Requests that share a system prompt and differ after it all name the system prompt's
//! last block; a session's turns each name a different, deeper block of their own history, so a
//! session is never mistaken for a hot prefix.

use rustc_hash::FxHashMap;

use crate::ids::BlockKey;
use crate::time::Timestamp;

/// Prefixes tracked at most. Past it, the ones asked for least lately are forgotten.
pub const MAX_TRACKED_PREFIXES: usize = 8_192;

/// The decay time of a prefix's request count: its rate follows changes within about this long.
pub const PREFIX_RATE_WINDOW_S: f64 = 20.0;

/// One prefix's decayed request count.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Demand {
    /// Requests, each decayed by `exp(−age / window)`, as of `at`.
    count: f64,
    at: Timestamp,
    /// When the prefix was first asked for (as tracked: a forgotten prefix starts again).
    since: Timestamp,
}

impl Demand {
    fn count_at(&self, now: Timestamp) -> f64 {
        self.count * (-now.saturating_since(self.at).as_secs_f64() / PREFIX_RATE_WINDOW_S).exp()
    }
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
        let d = self.prefixes.entry(prefix).or_insert(Demand { count: 0.0, at: now, since: now });
        let now = now.max(d.at);
        d.count = d.count_at(now) + 1.0;
        d.at = now;
    }

    /// The prefix's demand at `now`; zero for one never asked for.
    pub fn heat(&self, prefix: BlockKey, now: Timestamp) -> PrefixHeat {
        let Some(d) = self.prefixes.get(&prefix) else {
            return PrefixHeat::default();
        };
        let now = now.max(d.at);
        let age_s = now.saturating_since(d.since).as_secs_f64();
        // A steady stream of `r` a second keeps the decayed count at `r × window` once it has run
        // for a few windows; a younger one has filled only `1 − exp(−age / window)` of that.
        let filled = 1.0 - (-age_s.max(1.0) / PREFIX_RATE_WINDOW_S).exp();
        PrefixHeat { rate_per_s: d.count_at(now) / (PREFIX_RATE_WINDOW_S * filled), age_s }
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
        let mut counts: Vec<f64> = self.prefixes.values().map(|d| d.count_at(now)).collect();
        let mid = counts.len() / 2;
        let (_, median, _) = counts.select_nth_unstable_by(mid, f64::total_cmp);
        let median = *median;
        self.prefixes.retain(|_, d| d.count_at(now) > median);
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
