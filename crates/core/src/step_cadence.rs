//! A worker's prefill rate, measured from the cadence of its KV event batches.
//!
//! Engines publish one batch of KV events per scheduler step that changed the cache, stamped with
//! the engine's clock (vLLM and SGLang both write `time.time()`). A step that computed `C` new
//! prompt tokens stores `C / block_size` full blocks, and took `a + C / R` seconds: `a` the fixed
//! and per-sequence cost of the step, `R` the prefill rate. Two consecutive batches are therefore a
//! point `(C, Δt)` on that line, with one catch: steps that filled no block publish nothing, so a
//! pair of batches can span several steps, and an idle engine's next batch comes seconds after its
//! last. Such points lie *above* the line, never below it. The line is the lower envelope of the
//! points, which a low-quantile regression finds without being pulled up by them.
//!
//! Unlike times to first token, this measures the engine, not the router's own projections: what
//! the router chose to send there (cache hits to busy owners, misses to idle engines) does not
//! bias it, nor does a queue the router counted wrong.

use std::collections::VecDeque;

use kvgate_protocol::KvEvent;
use serde::Serialize;

/// Points kept: a minute of an engine taking a few requests a second. A shorter window often holds
/// no step that missed the cache by much, and small steps alone leave the slope loose.
pub const STEP_WINDOW: usize = 256;

/// Points needed before the envelope is trusted.
pub const MIN_STEP_POINTS: usize = 32;

/// The envelope is refitted after this many new points.
const REFIT_EVERY: u32 = 8;

/// The quantile of step times the fit follows: low enough to sit on the envelope when most pairs of
/// batches span idle time or silent steps, high enough that one early timestamp cannot move it.
const ENVELOPE_QUANTILE: f64 = 0.05;

/// Iterations of the reweighted least squares that solve the quantile regression.
const IRLS_ITERATIONS: usize = 30;

/// A step computing this many times the median step's tokens anchors the slope ...
const LARGE_STEP_FACTOR: f64 = 4.0;

/// ... and a fit needs this many of them.
const MIN_LARGE_STEPS: usize = 2;

/// Seconds between batches beyond which the pair says nothing about a step (the engine idled).
const MAX_STEP_SECONDS: f64 = 10.0;

/// Prompt tokens an engine computed in the step that published `events`: the tokens of the full
/// blocks it stored in device memory. Blocks of other KV groups of a hybrid model (the same tokens
/// again) and copies to other media (offloading, not computing) are not counted.
pub fn computed_tokens(events: &[KvEvent]) -> u64 {
    events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(b)
                if b.group_idx.unwrap_or(0) == 0
                    && b.medium.as_deref().is_none_or(|m| m.eq_ignore_ascii_case("gpu")) =>
            {
                b.block_hashes.len() as u64 * u64::from(b.block_size)
            }
            _ => 0,
        })
        .sum()
}

/// The prefill cost per token (seconds) measured from one worker's event batches.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepCadence {
    /// The publisher (data-parallel rank) and engine time of the last batch.
    #[serde(skip)]
    last: Option<(Option<u32>, f64)>,
    /// `(tokens computed, seconds since the previous batch)`, newest last.
    #[serde(skip)]
    points: VecDeque<(f64, f64)>,
    #[serde(skip)]
    since_fit: u32,
    /// The fitted seconds per prefill token, once the points allow a fit.
    seconds_per_token: Option<f64>,
}

impl Default for StepCadence {
    fn default() -> Self {
        StepCadence { last: None, points: VecDeque::with_capacity(STEP_WINDOW), since_fit: 0, seconds_per_token: None }
    }
}

impl StepCadence {
    /// A batch that computed `tokens` prompt tokens was published at `engine_time_s` (seconds, the
    /// engine's clock) by publisher `rank`. Batches of different ranks, out of order, or far apart
    /// start a new pair instead of making a point. Returns whether the fit changed.
    pub fn observe(&mut self, tokens: u64, engine_time_s: f64, rank: Option<u32>) -> bool {
        if !engine_time_s.is_finite() {
            return false;
        }
        let mut refitted = false;
        if let Some((last_rank, last_time)) = self.last {
            let seconds = engine_time_s - last_time;
            if last_rank == rank && tokens > 0 && seconds > 0.0 && seconds <= MAX_STEP_SECONDS {
                if self.points.len() == STEP_WINDOW {
                    self.points.pop_front();
                }
                self.points.push_back((tokens as f64, seconds));
                self.since_fit += 1;
                if self.points.len() >= MIN_STEP_POINTS && self.since_fit >= REFIT_EVERY {
                    self.since_fit = 0;
                    if let Some(s) = lower_envelope_slope(&self.points) {
                        refitted = self.seconds_per_token != Some(s);
                        self.seconds_per_token = Some(s);
                    }
                }
            }
        }
        self.last = Some((rank, engine_time_s));
        refitted
    }

    /// The measured seconds per prefill token, once there is a fit.
    pub fn seconds_per_token(&self) -> Option<f64> {
        self.seconds_per_token
    }
}

/// The slope of the low-quantile line through `points`, when a few steps computed far more tokens
/// than the typical one: without them the per-token cost of small steps hides in their per-step
/// cost, and the slope is loose (measured on the simulator: 13k to 70k tokens/s for an engine of
/// 20k).
fn lower_envelope_slope(points: &VecDeque<(f64, f64)>) -> Option<f64> {
    let mut tokens: Vec<f64> = points.iter().map(|p| p.0).collect();
    tokens.sort_by(f64::total_cmp);
    let typical = tokens[tokens.len() / 2];
    if tokens.iter().rev().take_while(|&&x| x >= LARGE_STEP_FACTOR * typical).count() < MIN_LARGE_STEPS {
        return None;
    }
    // Quantile regression by iteratively reweighted least squares: each point weighs
    // `τ / |r|` above the line and `(1 − τ) / |r|` below it, which makes the weighted squares the
    // check loss of the τ-quantile.
    let mut weights = vec![1.0; points.len()];
    let mut line = (0.0, 0.0);
    for _ in 0..IRLS_ITERATIONS {
        line = weighted_line(points, &weights)?;
        for (w, &(x, y)) in weights.iter_mut().zip(points) {
            let r = y - line.0 - line.1 * x;
            let side = if r > 0.0 { ENVELOPE_QUANTILE } else { 1.0 - ENVELOPE_QUANTILE };
            *w = side / r.abs().max(1e-4);
        }
    }
    let slope = line.1;
    (slope.is_finite() && slope > 0.0).then_some(slope)
}

/// Weighted least squares: `(intercept, slope)`.
fn weighted_line(points: &VecDeque<(f64, f64)>, weights: &[f64]) -> Option<(f64, f64)> {
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for (&w, &(x, y)) in weights.iter().zip(points) {
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let (mean_x, mean_y) = (sx / sw, sy / sw);
    let var_x = sxx / sw - mean_x * mean_x;
    if !(var_x > 0.0 && sw > 0.0) {
        return None;
    }
    let slope = (sxy / sw - mean_x * mean_y) / var_x;
    Some((mean_y - slope * mean_x, slope))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_protocol::{BlockRemoved, BlockStored, EngineHash};
    use rand::{Rng, SeedableRng};

    /// A busy engine's steps at `rate` tokens/s with 20–40 ms of per-step cost: most store one to
    /// sixteen blocks, one in ten a prompt of 4k to 8k tokens; half the pairs of batches span one to
    /// five silent steps and one in ten an idle second or more.
    fn feed(cadence: &mut StepCadence, rate: f64, steps: usize, seed: u64) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut t = 1_000.0;
        for _ in 0..steps {
            let tokens = 64
                * if rng.random::<f64>() < 0.1 { rng.random_range(64..=128u64) } else { rng.random_range(1..=16u64) };
            let step = |rng: &mut rand_chacha::ChaCha8Rng| 0.020 + 0.020 * rng.random::<f64>();
            if rng.random::<f64>() < 0.5 {
                for _ in 0..rng.random_range(1..=5) {
                    t += step(&mut rng);
                }
            }
            if rng.random::<f64>() < 0.1 {
                t += 1.0 + 3.0 * rng.random::<f64>();
            }
            t += step(&mut rng) + tokens as f64 / rate;
            cadence.observe(tokens, t, None);
        }
    }

    #[test]
    fn the_envelope_finds_the_prefill_rate_under_silent_steps_and_idle_gaps() {
        for (rate, seed) in [(20_000.0, 1), (6_000.0, 2), (60_000.0, 3)] {
            let mut c = StepCadence::default();
            feed(&mut c, rate, 200, seed);
            let measured = 1.0 / c.seconds_per_token().expect("enough points");
            assert!((measured / rate - 1.0).abs() < 0.1, "measured {measured:.0} for {rate:.0}");
        }
    }

    #[test]
    fn no_fit_before_enough_points_nor_from_steps_all_of_one_size() {
        let mut c = StepCadence::default();
        feed(&mut c, 20_000.0, MIN_STEP_POINTS / 2, 4);
        assert_eq!(c.seconds_per_token(), None);
        let mut same = StepCadence::default();
        for i in 0..200 {
            same.observe(512, f64::from(i) * 0.05, None);
        }
        assert_eq!(same.seconds_per_token(), None);
    }

    #[test]
    fn pairs_across_ranks_out_of_order_or_without_tokens_make_no_point() {
        let mut c = StepCadence::default();
        c.observe(512, 10.0, Some(0));
        c.observe(512, 10.1, Some(1));
        c.observe(512, 10.05, Some(1));
        c.observe(0, 10.2, Some(1));
        c.observe(512, f64::NAN, Some(1));
        c.observe(512, 30.0, Some(1));
        assert!(c.points.is_empty(), "{:?}", c.points);
        c.observe(512, 30.1, Some(1));
        assert_eq!(c.points.len(), 1);
    }

    #[test]
    fn computed_tokens_count_stored_device_blocks_of_the_first_group_only() {
        let stored = |n: usize, group: Option<u32>, medium: Option<&str>| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..n as u64).map(EngineHash).collect(),
                block_size: 16,
                group_idx: group,
                medium: medium.map(String::from),
                ..BlockStored::default()
            })
        };
        let events = [
            stored(3, None, None),
            stored(2, Some(0), Some("GPU")),
            stored(3, Some(1), None),
            stored(4, None, Some("CPU")),
            KvEvent::BlockRemoved(BlockRemoved::default()),
            KvEvent::AllBlocksCleared,
        ];
        assert_eq!(computed_tokens(&events), 5 * 16);
    }
}
