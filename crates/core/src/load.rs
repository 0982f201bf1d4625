//! Engine load telemetry and throughput estimates.

use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// One load report from an engine, as the telemetry poller (or the simulator) normalised it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LoadSnapshot {
    /// Requests queued and not yet admitted to the running batch.
    pub waiting_requests: u64,
    /// Uncached prompt tokens of the queued requests: the prefill work ahead of a new request.
    pub waiting_tokens: u64,
    /// Requests in the running batch.
    pub running_requests: u64,
    /// Decode work the running batch still has to do, in tokens.
    pub active_decode_tokens: u64,
    /// Fraction of KV capacity in use, 0 to 1.
    pub kv_usage: f64,
    /// When the engine measured this (not when the router received it).
    pub observed_at: Timestamp,
    /// Set when the token fields were estimated from request counts (vLLM reports only counts).
    /// Such a report cannot show how much prefill a running request has left, so the router keeps
    /// counting the prefill of its own requests until their first token instead of trusting the
    /// estimate for them.
    #[serde(default)]
    pub estimated: Option<CountEstimate>,
}

/// How a load report's token fields were estimated from its request counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CountEstimate {
    /// Queued prefill tokens counted per waiting request; `None` when the engine reported its
    /// queued tokens (SGLang's `num_waiting_uncached_tokens`).
    pub prompt_tokens_per_waiting: Option<u64>,
    /// Decode tokens counted per running request.
    pub decode_tokens_per_running: u64,
}

/// Smoothing weight of a new throughput observation. 0.2 halves an old estimate's weight in about
/// three observations: fast enough to follow a profile change, slow enough to ride out one odd step.
pub const THROUGHPUT_EWMA_ALPHA: f64 = 0.2;

/// How far observations may move a configured throughput, as a factor either way. Observations come
/// from engines under varying batch shapes; a bound keeps one misleading stretch (an idle engine
/// reporting a tiny rate) from making a worker look 100× slower than its hardware.
pub const THROUGHPUT_CORRECTION_BOUND: f64 = 4.0;

/// A configured throughput with online correction from observed rates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Throughput {
    configured: f64,
    ewma: Option<f64>,
}

impl Throughput {
    /// A throughput of `configured` tokens per second with no observations yet.
    pub fn new(configured: f64) -> Self {
        Throughput { configured, ewma: None }
    }

    /// The configured value.
    pub fn configured(&self) -> f64 {
        self.configured
    }

    /// Folds in an observed rate of `tokens` in `seconds`. Degenerate observations (no tokens, no
    /// time, non-finite values) are ignored.
    pub fn observe(&mut self, tokens: f64, seconds: f64) {
        if !(tokens > 0.0 && seconds > 0.0 && tokens.is_finite() && seconds.is_finite()) {
            return;
        }
        let rate = tokens / seconds;
        self.ewma = Some(match self.ewma {
            None => rate,
            Some(prev) => prev + THROUGHPUT_EWMA_ALPHA * (rate - prev),
        });
    }

    /// The rate to plan with: the smoothed observation within the correction bound, or the
    /// configured value before any observation.
    pub fn effective(&self) -> f64 {
        match self.ewma {
            None => self.configured,
            Some(rate) => {
                rate.clamp(self.configured / THROUGHPUT_CORRECTION_BOUND, self.configured * THROUGHPUT_CORRECTION_BOUND)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_follows_observations_within_the_correction_bound() {
        let mut t = Throughput::new(1000.0);
        assert_eq!(t.effective(), 1000.0);
        t.observe(1500.0, 1.0);
        assert_eq!(t.effective(), 1500.0);
        t.observe(500.0, 1.0);
        assert!((t.effective() - 1300.0).abs() < 1e-9);
        for _ in 0..100 {
            t.observe(1.0, 1.0);
        }
        assert_eq!(t.effective(), 250.0);
    }

    #[test]
    fn degenerate_observations_are_ignored() {
        let mut t = Throughput::new(1000.0);
        t.observe(0.0, 1.0);
        t.observe(10.0, 0.0);
        t.observe(f64::NAN, 1.0);
        assert_eq!(t.effective(), 1000.0);
    }
}
