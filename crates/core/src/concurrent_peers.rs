//! How many peer replicas decide at about the same instant as this one, and so cannot see its
//! reservations, nor it theirs, until the bus carries them.
//!
//! Replicas that share reservations over the bus ([`crate::replicas`]) still decide blind to each
//! other for one bus hop. When requests reach several replicas in the same instant (a client fanning
//! out, a batch job, a trace replayed as recorded), every replica sees the same idle engine and all
//! of them send their request there. Two things undo that, both driven by this estimate:
//!
//! - **Stagger:** while peers decide in step with this replica, more often than their rate alone
//!   would bring, a new request waits a random fraction of a few bus hops before its decision
//!   ([`stagger_delay`]), so the peers' decisions of the same instant reach it first. The caller
//!   sleeps; the core only says how long.
//! - **Spread:** the policy chooses at random among the few best workers whose cost is within a
//!   tolerance that grows with the estimate (`projected`'s `spread`), so decisions that still
//!   coincide differ where their scores are close.
//!
//! The estimate is measured, not configured: after each request reaches it, a replica counts the
//! peers' reservations it hears within [`CONCURRENT_WINDOW`] plus the longest stagger (a peer's
//! request of the same instant may be held that long), and averages that count over its requests.
//! Counting from arrivals, not decisions, keeps the stagger from hiding the very coincidence that
//! calls for it. A lone replica, or one whose peers' requests arrive spread out, stays near zero
//! and decides exactly as before.

use std::collections::VecDeque;
use std::time::Duration;

use crate::time::Timestamp;

/// How long after a request reaches it a replica counts the peers' reservations it hears as made
/// blind to that request's decision, besides the longest stagger: a few bus hops (a NATS hop and
/// the default 2 ms batching gap).
pub const CONCURRENT_WINDOW: Duration = Duration::from_millis(5);

/// The longest a request waits before its decision while peers decide in step, by default: a few
/// bus hops, so most of the peers' decisions of the same instant arrive first, and little against a
/// time to first token.
pub const DEFAULT_STAGGER: Duration = Duration::from_millis(10);

/// The weight of one decision's count in the running average: about the last 20 decisions count.
const AVERAGE_WEIGHT: f64 = 0.05;

/// How long the peers' reservations are counted for their rate.
const RATE_PERIOD: Duration = Duration::from_secs(1);

/// The weight of one period's rate in the running average.
const RATE_WEIGHT: f64 = 0.5;

/// Fewer concurrent peers than this per decision, on average, is no coordination problem.
pub const CONCURRENT_MIN: f64 = 0.5;

/// Peers decide *in step* when this many times more of their decisions fall right after this
/// replica's than their rate brings into any window of the same length: arrivals that are
/// synchronised, not merely frequent. Staggering random arrivals would only add latency.
const IN_STEP_RATIO: f64 = 2.0;

/// At most this many of its own recent requests are remembered (a bound on memory in a burst).
const RECENT_MAX: usize = 4096;

/// What a replica knows about its peers' timing.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct ConcurrentPeers {
    /// Peers' decisions made blind to each of this replica's, on average: heard within
    /// [`CONCURRENT_WINDOW`] after it.
    pub unseen: f64,
    /// Peers' requests that reach them in the same instant as each of this replica's, on average:
    /// their reservations heard within [`CONCURRENT_WINDOW`] plus the longest stagger after it
    /// arrived.
    pub coinciding: f64,
    /// Whether the peers' requests come in step with this replica's (synchronised arrivals, not
    /// merely frequent ones), so that waiting a little before deciding lets their reservations
    /// arrive first.
    pub in_step: bool,
}

/// The peers' reservations heard within a window after each of a series of this replica's own
/// moments, averaged over them.
#[derive(Debug, Default)]
struct Coincidences {
    /// The recent moments, oldest first, with the peers' reservations heard since.
    recent: VecDeque<(Timestamp, u32)>,
    /// The average count per moment whose window has closed.
    average: f64,
}

impl Coincidences {
    fn note(&mut self, now: Timestamp, window: Duration) {
        self.settle(now, window);
        if self.recent.len() >= RECENT_MAX {
            self.fold_oldest();
        }
        self.recent.push_back((now, 0));
    }

    fn heard(&mut self, count: u32, now: Timestamp, window: Duration) {
        self.settle(now, window);
        for (_, heard) in &mut self.recent {
            *heard = heard.saturating_add(count);
        }
    }

    /// Folds the moments whose window has closed into the average.
    fn settle(&mut self, now: Timestamp, window: Duration) {
        while self.recent.front().is_some_and(|&(at, _)| now.saturating_since(at) > window) {
            self.fold_oldest();
        }
    }

    fn fold_oldest(&mut self) {
        if let Some((_, heard)) = self.recent.pop_front() {
            self.average = (1.0 - AVERAGE_WEIGHT) * self.average + AVERAGE_WEIGHT * f64::from(heard);
        }
    }
}

/// The running estimate behind [`ConcurrentPeers`].
#[derive(Debug, Default)]
pub(crate) struct PeerConcurrency {
    /// The peers' reservations after each request's arrival here.
    arrivals: Coincidences,
    /// The peers' reservations after each decision here.
    decisions: Coincidences,
    /// The longest stagger, as the last arrival gave it.
    stagger: Duration,
    /// The start of the period whose peer reservations `period_count` counts.
    period_start: Option<Timestamp>,
    period_count: u64,
    /// The peers' reservations per second, averaged over periods.
    rate_per_s: f64,
}

impl PeerConcurrency {
    /// The estimate now.
    pub(crate) fn estimate(&self) -> ConcurrentPeers {
        let coinciding = self.arrivals.average;
        let by_rate = self.rate_per_s * self.arrival_window().as_secs_f64();
        ConcurrentPeers {
            unseen: self.decisions.average,
            coinciding,
            in_step: coinciding >= CONCURRENT_MIN && coinciding >= IN_STEP_RATIO * by_rate,
        }
    }

    fn arrival_window(&self) -> Duration {
        CONCURRENT_WINDOW + self.stagger
    }

    /// A request reached this replica at `now`; a peer's request of the same instant may be held
    /// up to `stagger` before its decision.
    pub(crate) fn note_arrival(&mut self, now: Timestamp, stagger: Duration) {
        self.stagger = stagger;
        self.settle_rate(now);
        self.arrivals.note(now, self.arrival_window());
    }

    /// This replica decided a request at `now`.
    pub(crate) fn note_decision(&mut self, now: Timestamp) {
        self.settle_rate(now);
        self.decisions.note(now, CONCURRENT_WINDOW);
    }

    /// `count` peer reservations arrived at `now`.
    pub(crate) fn note_peer_decisions(&mut self, count: u32, now: Timestamp) {
        if count == 0 {
            return;
        }
        self.settle_rate(now);
        self.arrivals.heard(count, now, self.arrival_window());
        self.decisions.heard(count, now, CONCURRENT_WINDOW);
        self.period_count += u64::from(count);
    }

    /// Closes a rate period that ended.
    fn settle_rate(&mut self, now: Timestamp) {
        let start = *self.period_start.get_or_insert(now);
        let elapsed = now.saturating_since(start);
        if elapsed >= RATE_PERIOD {
            let rate = self.period_count as f64 / elapsed.as_secs_f64();
            self.rate_per_s = (1.0 - RATE_WEIGHT) * self.rate_per_s + RATE_WEIGHT * rate;
            self.period_start = Some(now);
            self.period_count = 0;
        }
    }
}

/// How long a new request waits before its decision: uniform in `0..max` (from `draw`) while the
/// peers decide in step with this replica, nothing otherwise.
pub fn stagger_delay(peers: ConcurrentPeers, max: Duration, draw: u64) -> Duration {
    if !peers.in_step || max.is_zero() {
        return Duration::ZERO;
    }
    // The top 53 bits as a fraction in [0, 1).
    let fraction = (draw >> 11) as f64 / (1u64 << 53) as f64;
    max.mul_f64(fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(ms: f64) -> Timestamp {
        Timestamp((ms * 1000.0) as u64)
    }

    #[test]
    fn a_lone_replica_sees_no_peers_and_never_waits() {
        let mut p = PeerConcurrency::default();
        for i in 0..1000 {
            p.note_arrival(at_ms(f64::from(i)), DEFAULT_STAGGER);
        }
        assert_eq!(p.estimate(), ConcurrentPeers::default());
        assert_eq!(stagger_delay(p.estimate(), Duration::from_millis(10), u64::MAX), Duration::ZERO);
    }

    #[test]
    fn peers_deciding_in_the_same_instants_are_counted_and_found_in_step() {
        let mut p = PeerConcurrency::default();
        // One request a tick at this replica, three at the peers in the same instant (decided up to
        // the stagger later), ten ticks a second.
        for tick in 0..200 {
            let t = f64::from(tick) * 100.0;
            p.note_arrival(at_ms(t), DEFAULT_STAGGER);
            p.note_peer_decisions(1, at_ms(t + 1.5));
            p.note_decision(at_ms(t + 8.0));
            p.note_peer_decisions(2, at_ms(t + 12.0));
        }
        let e = p.estimate();
        assert!((e.coinciding - 3.0).abs() < 0.05, "{e:?}");
        assert!((e.unseen - 2.0).abs() < 0.05, "two decided within the window after this one: {e:?}");
        assert!(e.in_step, "30 peer reservations a second put 0.45 in a 15 ms window by chance, not 3: {e:?}");
        let wait = stagger_delay(e, Duration::from_millis(10), u64::MAX / 2);
        assert!((wait.as_secs_f64() - 0.005).abs() < 1e-6, "{wait:?}");
    }

    #[test]
    fn frequent_peers_at_random_instants_are_concurrent_but_not_in_step() {
        let mut p = PeerConcurrency::default();
        // A peer reservation every millisecond, steadily, and a request here every 10 ms: fifteen
        // fall in each window because they are frequent, not because they are synchronised.
        for ms in 0..20_000u32 {
            if ms % 10 == 0 {
                p.note_arrival(at_ms(f64::from(ms)), DEFAULT_STAGGER);
            }
            p.note_peer_decisions(1, at_ms(f64::from(ms) + 0.5));
        }
        let e = p.estimate();
        assert!(e.coinciding > 14.0, "{e:?}");
        assert!(!e.in_step, "{e:?}");
    }

    #[test]
    fn the_estimate_decays_when_peers_fall_out_of_step() {
        let mut p = PeerConcurrency::default();
        for tick in 0..200 {
            let t = f64::from(tick) * 100.0;
            p.note_arrival(at_ms(t), DEFAULT_STAGGER);
            p.note_peer_decisions(4, at_ms(t + 1.0));
        }
        for tick in 200..400 {
            p.note_arrival(at_ms(f64::from(tick) * 100.0), DEFAULT_STAGGER);
        }
        assert!(p.estimate().coinciding < 0.01, "{:?}", p.estimate());
    }

    #[test]
    fn a_burst_of_own_decisions_keeps_memory_bounded() {
        let mut p = PeerConcurrency::default();
        for _ in 0..(RECENT_MAX * 3) {
            p.note_arrival(at_ms(0.0), DEFAULT_STAGGER);
            p.note_decision(at_ms(0.0));
        }
        assert!(p.arrivals.recent.len() <= RECENT_MAX && p.decisions.recent.len() <= RECENT_MAX);
    }
}
