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
    /// The largest running batch the engine admits, where it reports one (SGLang's
    /// `max_running_requests` in `/v1/loads`): past it a new request waits for a slot. `None`: the
    /// worker's configured `max_running_requests` stands in.
    #[serde(default)]
    pub max_running_requests: Option<u64>,
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

/// Weight a new prefill observation takes from the old ones: an old one's weight halves in about
/// 35 new ones.
pub const PREFILL_FIT_ALPHA: f64 = 0.02;

/// Weight a new decode observation takes. Every streamed request yields one, so the fit can afford
/// to remember about twenty.
pub const DECODE_FIT_ALPHA: f64 = 0.01;

/// The largest standard error of a full batch's step time as the decode fit extrapolates it, as a
/// fraction of that time, for the fit to be planned with.
pub const DECODE_STEP_MAX_RELATIVE_ERROR: f64 = 0.3;

/// How far observations may move a configured throughput, as a factor either way. Observations come
/// from engines under varying batch shapes; a bound keeps one misleading stretch (an idle engine
/// reporting a tiny rate) from making a worker look 100× slower than its hardware.
pub const THROUGHPUT_CORRECTION_BOUND: f64 = 4.0;

/// Decayed observations before a fit replaces the configured rate.
const FIT_MIN_WEIGHT: f64 = 5.0;

/// A least-squares line `y = intercept + slope · x` through points whose weight decays by
/// `1 − alpha` with every new point.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
struct LinearFit {
    alpha: f64,
    /// Decayed sums: weight, Σx, Σy, Σx², Σx·y, Σy².
    sums: [f64; 6],
    /// The decayed sum of the squared weights, for the effective number of points.
    squared_weights: f64,
}

impl LinearFit {
    fn new(alpha: f64) -> Self {
        LinearFit { alpha, sums: [0.0; 6], squared_weights: 0.0 }
    }

    fn observe(&mut self, x: f64, y: f64) {
        let keep = 1.0 - self.alpha;
        for (sum, v) in self.sums.iter_mut().zip([1.0, x, y, x * x, x * y, y * y]) {
            *sum = *sum * keep + v;
        }
        self.squared_weights = self.squared_weights * keep * keep + 1.0;
    }

    /// The standard error of the line's value at `x`: how far the points pin it down there, which
    /// grows with the distance from the points' mean.
    fn standard_error_at(&self, x: f64) -> Option<f64> {
        let (_, slope) = self.line()?;
        let [w, sx, sy, sxx, _, syy] = self.sums;
        let effective_points = w * w / self.squared_weights;
        if effective_points <= 2.0 {
            return None;
        }
        let mean_x = sx / w;
        let var_x = sxx / w - mean_x * mean_x;
        let var_y = syy / w - (sy / w).powi(2);
        let residual = (var_y - slope * slope * var_x).max(0.0) * effective_points / (effective_points - 2.0);
        Some((residual * (1.0 + (x - mean_x).powi(2) / var_x) / effective_points).sqrt())
    }

    /// Σy / Σx inverted: the mean rate of the points, when there are any.
    fn ratio(&self) -> Option<f64> {
        let [w, sx, sy, ..] = self.sums;
        (w > 0.0 && sx > 0.0 && sy > 0.0).then(|| sx / sy)
    }

    /// The slope, once there are enough points spread widely enough (x within ±10% of its mean
    /// cannot tell a slope from an intercept).
    fn slope(&self) -> Option<f64> {
        self.line().map(|(_, slope)| slope)
    }

    /// The line's `(intercept, slope)`, on the same conditions as [`Self::slope`].
    fn line(&self) -> Option<(f64, f64)> {
        let [w, sx, sy, sxx, sxy, _] = self.sums;
        if w < FIT_MIN_WEIGHT {
            return None;
        }
        let (mean_x, mean_y) = (sx / w, sy / w);
        let var_x = sxx / w - mean_x * mean_x;
        if var_x <= (0.1 * mean_x).powi(2) {
            return None;
        }
        let slope = (sxy / w - mean_x * mean_y) / var_x;
        Some((mean_y - slope * mean_x, slope))
    }
}

/// The rate a fitted seconds-per-unit slope implies, within the correction bound of `configured`;
/// `configured` without a fit. A flat or falling line says the cost per unit is below what the
/// points resolve: the fastest the bound allows.
pub(crate) fn bounded_rate(configured: f64, slope: Option<f64>) -> f64 {
    let (lo, hi) = (configured / THROUGHPUT_CORRECTION_BOUND, configured * THROUGHPUT_CORRECTION_BOUND);
    match slope {
        None => configured,
        Some(s) if s <= 0.0 => hi,
        Some(s) => (1.0 / s).clamp(lo, hi),
    }
}

/// A worker's configured prefill rate, corrected by timings a caller reports through
/// [`crate::Router::observe_rate`] (the router's own calibration measures the engine's step
/// cadence instead: [`crate::step_cadence`]).
///
/// Work of `p` tokens takes about `overhead + p / rate` seconds, the overhead being what does not
/// grow with tokens (per-step cost, the network). A line through (tokens, seconds) points gives the
/// rate as the inverse of its slope, so the overhead does not pass for a slow engine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Throughput {
    configured: f64,
    fit: LinearFit,
}

impl Throughput {
    /// A throughput of `configured` tokens per second with no observations yet.
    pub fn new(configured: f64) -> Self {
        Throughput { configured, fit: LinearFit::new(PREFILL_FIT_ALPHA) }
    }

    /// The configured value.
    pub fn configured(&self) -> f64 {
        self.configured
    }

    /// Folds in an observation of `tokens` processed in `seconds`. Degenerate observations (no
    /// tokens, no time, non-finite values) are ignored.
    pub fn observe(&mut self, tokens: f64, seconds: f64) {
        if tokens > 0.0 && seconds > 0.0 && tokens.is_finite() && seconds.is_finite() {
            self.fit.observe(tokens, seconds);
        }
    }

    /// The rate to plan with: the fitted rate within the correction bound; before the observations
    /// allow a fit, their plain ratio (overhead included, so on the slow side); the configured
    /// value before any observation.
    pub fn effective(&self) -> f64 {
        match self.fit.slope() {
            Some(slope) => bounded_rate(self.configured, Some(slope)),
            None => match self.fit.ratio() {
                Some(rate) => bounded_rate(self.configured, Some(1.0 / rate)),
                None => self.configured,
            },
        }
    }
}

/// Time constant of the fleet's prefill demand: long enough to smooth Poisson noise and a trace's
/// bursts, short enough to follow a change of load within a minute.
pub const DEMAND_WINDOW: std::time::Duration = std::time::Duration::from_secs(20);

/// The prefill the fleet is being sent, in tokens per second: an exponentially decayed sum of every
/// decision's uncached prompt tokens (this router's and, when replicas share reservations, its
/// peers'), over [`DEMAND_WINDOW`]. The same decayed rate counts each prefix's requests
/// ([`crate::prefix_demand`]).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct PrefillDemand {
    sum: f64,
    at: Timestamp,
}

impl PrefillDemand {
    fn decayed(&self, now: Timestamp) -> f64 {
        let dt = now.saturating_since(self.at).as_secs_f64();
        self.sum * (-dt / DEMAND_WINDOW.as_secs_f64()).exp()
    }

    /// Counts `tokens` of prefill sent at `now`. An observation older than the last is counted as
    /// of the last (peers' clocks and this router's are never compared).
    pub fn add(&mut self, tokens: u64, now: Timestamp) {
        let now = now.max(self.at);
        self.sum = self.decayed(now) + tokens as f64;
        self.at = now;
    }

    /// Tokens per second at `now`: in a steady stream of `r` tokens a second the decayed sum is
    /// `r × window`.
    pub fn rate(&self, now: Timestamp) -> f64 {
        self.decayed(now.max(self.at)) / DEMAND_WINDOW.as_secs_f64()
    }
}

/// How many seconds of the fleet's time one second of new prefill costs when the fleet's prefill
/// capacity is `load` busy (demand over capacity): `1 / (1 − load)`, at most `max`.
///
/// Work added to a server at utilisation ρ keeps it busy `1 / (1 − ρ)` times as long, because what
/// arrives meanwhile queues behind it (the mean M/G/1 busy period; Kleinrock, *Queueing Systems* vol. 1,
/// ch. 5): a prefill a cached owner would have saved is paid by the requests that come after it.
/// On an idle fleet the factor is 1 and the score is the request's own projected seconds.
pub fn prefill_weight(load: f64, max: f64) -> f64 {
    let max = max.max(1.0);
    if !load.is_finite() || load >= 1.0 {
        return max;
    }
    (1.0 / (1.0 - load.max(0.0))).min(max)
}

/// A worker's decode rate, calibrated from inter-token times against batch size.
///
/// An engine step takes about `base + per_sequence × n` seconds with `n` sequences in the batch
/// (`shared/docs/engine-model.md` §4). A request that streamed `k` tokens over `d` seconds in a
/// batch of about `n` saw steps of `d / (k − 1)` seconds at `n`; a line through those points gives
/// `base` and `per_sequence`. The rate is the one configured: tokens per second of a full batch,
/// `N / (base + per_sequence × N)` at the worker's largest batch `N`. Its inverse per sequence
/// (what one running sequence adds to a step, as the router plans) is then the full batch's mean
/// share of a step, fixed cost included; the line's slope alone would read a third to a half
/// faster than a rate configured the usual way, and leave the dead band on engines configured
/// right.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecodeRate {
    configured: f64,
    fit: LinearFit,
}

impl DecodeRate {
    /// A decode rate of `configured` tokens per second (aggregate, at a full batch).
    pub fn new(configured: f64) -> Self {
        DecodeRate { configured, fit: LinearFit::new(DECODE_FIT_ALPHA) }
    }

    /// The configured value.
    pub fn configured(&self) -> f64 {
        self.configured
    }

    /// Folds in one step time `step_s` seen with `batch` sequences running. Degenerate values are
    /// ignored.
    pub fn observe_step(&mut self, batch: f64, step_s: f64) {
        if batch >= 1.0 && step_s > 0.0 && batch.is_finite() && step_s.is_finite() {
            self.fit.observe(batch, step_s);
        }
    }

    /// The fitted line's rate at a batch of `full_batch` sequences within the correction bound,
    /// once the points span enough batch sizes and pin a full batch's step time down (its
    /// standard error within [`DECODE_STEP_MAX_RELATIVE_ERROR`] of it): a full batch is often
    /// several times the batches seen, and a loose slope extrapolated that far read engines up to
    /// 3× fast.
    pub fn measured(&self, full_batch: u64) -> Option<f64> {
        let (base, per_sequence) = self.fit.line()?;
        let n = full_batch.max(1) as f64;
        // A line that falls or starts below zero says that part costs less than the points resolve.
        let full_step = base.max(0.0) + n * per_sequence.max(0.0);
        if self.fit.standard_error_at(n)? > DECODE_STEP_MAX_RELATIVE_ERROR * full_step {
            return None;
        }
        Some(bounded_rate(self.configured, Some(full_step / n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_fit_finds_the_rate_and_leaves_the_overhead_out() {
        // 30 ms of overhead plus tokens at 12,000 a second, configured at 20,000.
        let mut t = Throughput::new(20_000.0);
        assert_eq!(t.effective(), 20_000.0);
        for i in 0..30 {
            let tokens = 500.0 + f64::from(i % 6) * 1_500.0;
            t.observe(tokens, 0.030 + tokens / 12_000.0);
        }
        assert!((t.effective() - 12_000.0).abs() < 1.0, "{}", t.effective());
        // A rate far outside the bound stops at it.
        for i in 0..200 {
            let tokens = 500.0 + f64::from(i % 6) * 1_500.0;
            t.observe(tokens, tokens / 1_000.0);
        }
        assert_eq!(t.effective(), 5_000.0);
    }

    #[test]
    fn the_decode_fit_finds_the_full_batch_rate_from_smaller_batches() {
        // Steps of 18 ms + 0.2 ms per sequence, seen at 10 to 80 sequences; configured at 10,000.
        // A full batch of 256 takes 69.2 ms a step: 3,699 tokens/s. The slope alone says 5,000.
        let mut d = DecodeRate::new(10_000.0);
        for i in 0..40 {
            let n = 10.0 + f64::from(i % 8) * 10.0;
            d.observe_step(n, 0.018 + 0.0002 * n);
        }
        let at = |n| d.measured(n).expect("a fit");
        assert!((at(256) - 256.0 / 0.0692).abs() < 1.0, "{}", at(256));
        // A smaller largest batch pays more of the fixed cost per sequence.
        assert!((at(128) - 128.0 / 0.0436).abs() < 1.0, "{}", at(128));
    }

    #[test]
    fn a_decode_line_that_does_not_pin_a_full_batch_down_is_not_extrapolated() {
        // Steps of 10 ms + 0.4 ms per sequence, seen at 12 to 18 sequences with ±5 ms of noise:
        // the slope is loose, and 256 sequences are far past the points.
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut noise = || (rng.random::<f64>() - 0.5) * 0.010;
        let mut loose = DecodeRate::new(2_000.0);
        for i in 0..60 {
            let n = 12.0 + f64::from(i % 7);
            loose.observe_step(n, 0.010 + 0.0004 * n + noise());
        }
        assert!(loose.fit.line().is_some(), "the points span enough batch sizes for a line");
        assert_eq!(loose.measured(256), None);
        // The same engine seen at 10 to 80 sequences is measured.
        let mut wide = DecodeRate::new(2_000.0);
        for i in 0..60 {
            let n = 10.0 + f64::from(i % 8) * 10.0;
            wide.observe_step(n, 0.010 + 0.0004 * n + noise());
        }
        let measured = wide.measured(256).expect("a fit");
        let real = 256.0 / (0.010 + 0.0004 * 256.0);
        assert!((measured / real - 1.0).abs() < 0.1, "{measured:.0} against {real:.0}");
    }

    #[test]
    fn a_flat_decode_line_reads_the_fixed_cost_shared_by_a_full_batch() {
        let mut d = DecodeRate::new(2_000.0);
        for i in 0..40 {
            d.observe_step(10.0 + f64::from(i % 8) * 10.0, 0.020);
        }
        // 256 sequences share 20 ms: 12,800 tokens/s, past the 4× bound.
        assert_eq!(d.measured(256), Some(8_000.0));
        let at_32 = d.measured(32).expect("a fit");
        assert!((at_32 - 1_600.0).abs() < 1e-6, "{at_32}");
    }

    #[test]
    fn the_decode_fit_waits_for_batch_sizes_that_tell_slope_from_base() {
        let mut d = DecodeRate::new(3_000.0);
        for _ in 0..50 {
            d.observe_step(32.0, 0.025);
        }
        assert_eq!(d.measured(256), None, "one batch size cannot separate base and slope");
        d.observe_step(f64::NAN, 1.0);
        d.observe_step(0.0, 1.0);
        assert_eq!(d.measured(256), None);
    }

    #[test]
    fn demand_is_the_decayed_rate_of_prefill_sent() {
        let mut d = PrefillDemand::default();
        // 1,000 tokens every 100 ms for two minutes: 10,000 tokens a second.
        for i in 0..1200 {
            d.add(1_000, Timestamp::from_millis(i * 100));
        }
        let rate = d.rate(Timestamp::from_millis(119_900));
        assert!((rate - 10_000.0).abs() < 300.0, "{rate}");
        // A window later with nothing sent, it has decayed by e.
        let later = d.rate(Timestamp::from_millis(119_900 + DEMAND_WINDOW.as_millis() as u64));
        assert!((later * std::f64::consts::E - rate).abs() < 1.0, "{later}");
        // An observation from the past counts as of now, and never makes the rate go backwards in time.
        d.add(500, Timestamp::from_millis(10));
        assert!(d.rate(Timestamp::from_millis(119_900)) > rate);
    }

    #[test]
    fn the_prefill_weight_grows_with_the_fleet_load_and_stops_at_its_bound() {
        assert_eq!(prefill_weight(0.0, 10.0), 1.0);
        assert!((prefill_weight(0.5, 10.0) - 2.0).abs() < 1e-12);
        assert!((prefill_weight(0.75, 10.0) - 4.0).abs() < 1e-12);
        assert_eq!(prefill_weight(0.95, 10.0), 10.0);
        assert_eq!(prefill_weight(3.0, 10.0), 10.0);
        assert_eq!(prefill_weight(f64::NAN, 10.0), 10.0);
        assert_eq!(prefill_weight(-1.0, 10.0), 1.0);
        assert_eq!(prefill_weight(0.9, 1.0), 1.0, "a bound of 1 turns the weighting off");
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
