//! A worker's prefill rate, measured from the cadence of its KV event batches.
//!
//! Engines publish one batch of KV events per scheduler step that changed the cache, stamped with
//! the engine's clock (vLLM and SGLang both write `time.time()`). A step that computed `C` new
//! prompt tokens stores `C / block_size` full blocks, and took `a + C / R` seconds: `a` the fixed
//! and per-sequence cost of the step, `R` the prefill rate. Two consecutive batches are therefore a
//! point `(C, Δt)` on that line, with one catch: steps that filled no block publish nothing, so a
//! pair of batches can span several steps, and an idle engine's next batch comes seconds after its
//! last. Such points lie *above* the line, never below it. The line is the lower envelope of the
//! points, which a low-quantile regression finds without being pulled up by them. The slope needs
//! steps that computed whole prompts; a fleet that hits its cache computes few, so those that
//! leave the window of recent steps are kept a while longer.
//!
//! Which interval a batch's tokens took depends on when the engine publishes: vLLM publishes a
//! step's blocks once it has run, unless async scheduling is on (vLLM's default where the executor
//! supports it, off on the CPU); then the blocks of the next step, scheduled while this one ran,
//! go out as this one ends. Both pairings are fitted and the steeper kept ([`StepAlignment`]).
//!
//! Unlike times to first token, this measures the engine, not the router's own projections: what
//! the router chose to send there (cache hits to busy owners, misses to idle engines) does not
//! bias it, nor does a queue the router counted wrong.

use std::collections::VecDeque;

use kvgate_protocol::KvEvent;

/// Points kept: a minute of an engine taking a few requests a second. A shorter window often holds
/// no step that missed the cache by much, and small steps alone leave the slope loose.
pub const STEP_WINDOW: usize = 256;

/// Large steps kept after they leave the window, newest last. A fleet that hits its prefix cache
/// computes a long prompt rarely, and a busy engine's 256 steps last a minute or less.
pub const LARGE_STEPS_KEPT: usize = 16;

/// Engine seconds a large step is kept after it left the window, so the fit follows a rate that
/// changes (a restarted or reconfigured engine) within minutes.
pub const LARGE_STEPS_KEPT_SECONDS: f64 = 300.0;

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

/// ... and a fit needs this many of them: with fewer, one of them spanning a silent step tilts the
/// line (on the simulator, two or three read engines of 20k tokens/s at 12k–13k).
const MIN_LARGE_STEPS: usize = 4;

/// A size class of fewer points than this weighs that much less than a full one.
const MIN_CLASS_WEIGHT_POINTS: u32 = 4;

/// The running count must span this many sequences over the points before its cost is fitted.
const MIN_RUNNING_SPREAD: f64 = 4.0;

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

/// One pair of consecutive batches.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepPoint {
    /// Prompt tokens the later batch's step computed.
    tokens: f64,
    /// Sequences the engine was running then, as the router reckons them.
    running: f64,
    /// Seconds since the previous batch.
    seconds: f64,
    /// The later batch's engine time.
    at: f64,
}

/// What the envelope says a step costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Seconds per prefill token.
    pub seconds_per_token: f64,
    /// Seconds each running sequence adds to a step, when the running count varied enough to say.
    /// Fitted so that busy steps do not flatten the token slope, not to plan with: on the simulator
    /// it scatters from a quarter to four times the engine's decode rate, because a sequence's cost
    /// (well under a millisecond) is small beside the steps' other variation.
    pub seconds_per_sequence: Option<f64>,
}

/// When an engine publishes the KV events of a step, relative to the step that computes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepAlignment {
    /// Once the step has run (vLLM without async scheduling, which vLLM turns off on the CPU):
    /// a batch's tokens took the time since the batch before it.
    AfterStep,
    /// When the step is scheduled, while the one before it still runs (vLLM's async scheduling,
    /// its default where the executor supports it): the batch published as one step ends carries
    /// the blocks of the next, so its tokens take the time until the batch after it.
    BeforeStep,
}

impl StepAlignment {
    /// Both alignments.
    pub const ALL: [StepAlignment; 2] = [StepAlignment::AfterStep, StepAlignment::BeforeStep];

    /// The name `/admin/workers` and the metrics use.
    pub fn name(self) -> &'static str {
        match self {
            StepAlignment::AfterStep => "after_step",
            StepAlignment::BeforeStep => "before_step",
        }
    }
}

/// One alignment's points: the window of recent steps and the large steps kept past it.
#[derive(Debug, Clone, PartialEq)]
struct AlignedSteps {
    /// Newest last.
    points: VecDeque<StepPoint>,
    /// Large steps that left `points`, newest last (see [`LARGE_STEPS_KEPT`]).
    large: VecDeque<StepPoint>,
    /// Tokens from which a step leaving `points` is kept in `large`: [`LARGE_STEP_FACTOR`] × the
    /// median step of the last window fitted; infinite before any.
    large_from_tokens: f64,
}

impl Default for AlignedSteps {
    fn default() -> Self {
        AlignedSteps {
            points: VecDeque::with_capacity(STEP_WINDOW),
            large: VecDeque::with_capacity(LARGE_STEPS_KEPT),
            large_from_tokens: f64::INFINITY,
        }
    }
}

impl AlignedSteps {
    fn push(&mut self, point: StepPoint) {
        if self.points.len() == STEP_WINDOW {
            if let Some(old) = self.points.pop_front().filter(|p| p.tokens >= self.large_from_tokens) {
                if self.large.len() == LARGE_STEPS_KEPT {
                    self.large.pop_front();
                }
                self.large.push_back(old);
            }
        }
        self.points.push_back(point);
    }

    /// The points to fit at engine time `now`: the kept large steps still fresh, then the window.
    fn window(&self, now: f64) -> VecDeque<StepPoint> {
        let fresh = |p: &&StepPoint| (0.0..=LARGE_STEPS_KEPT_SECONDS).contains(&(now - p.at));
        self.large.iter().filter(fresh).chain(&self.points).copied().collect()
    }
}

/// The last batch seen: its publisher (data-parallel rank), engine time, tokens and running count.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LastBatch {
    rank: Option<u32>,
    at: f64,
    tokens: u64,
    running: u64,
}

/// Batches over which the engine clock's lead is the largest seen (two such spans are kept), so a
/// clock that is stepped back is followed within a few hundred batches.
const LEAD_SPAN_BATCHES: u32 = 128;

/// How far the engine's clock runs ahead of the router's, less the quickest delivery of a batch:
/// the largest `engine time − arrival` of recent batches. It never exceeds the clocks' true offset,
/// so a dispatch at router time `d` reaches the engine no earlier than engine time `d + lead`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ClockLead {
    current: f64,
    previous: f64,
    in_current: u32,
}

impl Default for ClockLead {
    fn default() -> Self {
        ClockLead { current: f64::NEG_INFINITY, previous: f64::NEG_INFINITY, in_current: 0 }
    }
}

impl ClockLead {
    fn observe(&mut self, lead: f64) {
        self.current = self.current.max(lead);
        self.in_current += 1;
        if self.in_current == LEAD_SPAN_BATCHES {
            self.previous = self.current;
            self.current = f64::NEG_INFINITY;
            self.in_current = 0;
        }
    }

    fn get(&self) -> Option<f64> {
        Some(self.current.max(self.previous)).filter(|l| l.is_finite())
    }
}

/// One live batch of KV events: the step it closes, and when the router saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepBatch {
    /// Prompt tokens the step computed ([`computed_tokens`]).
    pub tokens: u64,
    /// Sequences in the engine's batch, as the router reckons them.
    pub running: u64,
    /// When the engine published it, in seconds of the engine's clock.
    pub engine_time_s: f64,
    /// Its publisher (data-parallel rank).
    pub rank: Option<u32>,
    /// When it reached the router, in seconds of the router's clock.
    pub received_s: Option<f64>,
    /// The latest router-clock dispatch of a request whose prompt the step began: the step cannot
    /// have started before that request reached the engine.
    pub dispatched_s: Option<f64>,
}

/// The prefill (and per-sequence) cost measured from one worker's event batches.
///
/// Whether the engine publishes a step's events after the step or before it (see
/// [`StepAlignment`]) is not announced anywhere the router can read, so both pairings are fitted.
/// Pairing tokens with the wrong interval gives each large step the time of a neighbour, mostly a
/// small one, which flattens the slope: the steeper of the two fits is the engine's.
///
/// A step that began a prompt the router dispatched started no earlier than the dispatch reached
/// the engine. The router sends cache misses, the large steps, to idle engines, so the batch before
/// such a step is often seconds older than its request: without that bound every large step looked
/// as long as the idle time or silent decode steps before it (on the simulator, engines of 20k
/// tokens/s read 13k).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepCadence {
    last: Option<LastBatch>,
    lead: ClockLead,
    after_step: AlignedSteps,
    before_step: AlignedSteps,
    since_fit: u32,
    /// The fitted costs, once the points allow a fit, and the alignment they were fitted with.
    cost: Option<(StepCost, StepAlignment)>,
    /// Prompt tokens computed in all live batches seen.
    computed_total: u64,
}

impl StepCadence {
    /// A batch that computed `tokens` prompt tokens, with `running` sequences in the engine's batch,
    /// was published at `engine_time_s` (seconds, the engine's clock) by publisher `rank`; the
    /// router's arrival and dispatch times are unknown (see [`StepCadence::observe_batch`]).
    pub fn observe(&mut self, tokens: u64, running: u64, engine_time_s: f64, rank: Option<u32>) -> Option<StepWindow> {
        self.observe_batch(StepBatch { tokens, running, engine_time_s, rank, received_s: None, dispatched_s: None })
    }

    /// One live batch. Batches of different ranks, out of order, or far apart start a new pair
    /// instead of making a point, unless the batch began a prompt dispatched shortly before.
    /// Returns the windows to fit when a refit is due: the caller fits them ([`StepWindow::fit`]),
    /// outside any lock it holds, and hands the result to [`StepCadence::set_fit`].
    pub fn observe_batch(&mut self, batch: StepBatch) -> Option<StepWindow> {
        let StepBatch { tokens, running, engine_time_s: at, rank, received_s, dispatched_s } = batch;
        if !at.is_finite() {
            return None;
        }
        if let Some(received) = received_s.filter(|r| r.is_finite()) {
            self.lead.observe(at - received);
        }
        self.computed_total = self.computed_total.saturating_add(tokens);
        let since_last = self.last.filter(|l| l.rank == rank).map(|l| at - l.at);
        if since_last.is_some_and(|s| s <= 0.0) {
            self.last = Some(LastBatch { rank, at, tokens, running });
            return None;
        }
        let since_dispatch = dispatched_s.zip(self.lead.get()).map(|(d, lead)| at - (d + lead)).filter(|s| *s > 0.0);
        let within = |s: &f64| *s <= MAX_STEP_SECONDS;
        let after_step_s = match (since_last, since_dispatch) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
        .filter(within);
        let point = |tokens: u64, running: u64, seconds: f64| StepPoint {
            tokens: tokens as f64,
            running: running as f64,
            seconds,
            at,
        };
        let mut added = false;
        if let Some(seconds) = after_step_s.filter(|_| tokens > 0) {
            self.after_step.push(point(tokens, running, seconds));
            added = true;
        }
        if let (Some(last), Some(seconds)) = (self.last, since_last.filter(within)) {
            if last.tokens > 0 {
                self.before_step.push(point(last.tokens, last.running, seconds));
                added = true;
            }
        }
        self.last = Some(LastBatch { rank, at, tokens, running });
        if !added {
            return None;
        }
        self.since_fit += 1;
        let enough = self.after_step.points.len().max(self.before_step.points.len()) >= MIN_STEP_POINTS;
        if !enough || self.since_fit < REFIT_EVERY {
            return None;
        }
        self.since_fit = 0;
        Some(StepWindow { after_step: self.after_step.window(at), before_step: self.before_step.window(at) })
    }

    /// Installs the fit of a window [`StepCadence::observe`] handed out. Returns whether the
    /// measured cost changed. A window with no fit (too few large steps) leaves the last fit.
    pub fn set_fit(&mut self, fit: StepFit) -> bool {
        self.after_step.large_from_tokens = LARGE_STEP_FACTOR * fit.after_step.typical_tokens;
        self.before_step.large_from_tokens = LARGE_STEP_FACTOR * fit.before_step.typical_tokens;
        let chosen = match fit.chosen() {
            Some(chosen) if self.cost != Some(chosen) => chosen,
            _ => return false,
        };
        self.cost = Some(chosen);
        true
    }

    /// Prompt tokens the engine computed in all the live batches seen so far: the difference over
    /// a stream's decode is the prefill its steps also carried.
    pub fn computed_total(&self) -> u64 {
        self.computed_total
    }

    /// The measured seconds per prefill token, once there is a fit.
    pub fn seconds_per_token(&self) -> Option<f64> {
        self.cost.map(|(c, _)| c.seconds_per_token)
    }

    /// How the engine's batches line up with its steps, as the last fit found.
    pub fn alignment(&self) -> Option<StepAlignment> {
        self.cost.map(|(_, a)| a)
    }
}

/// A copy of a worker's step points, to fit away from the lock that guards the worker.
#[derive(Debug, Clone, PartialEq)]
pub struct StepWindow {
    after_step: VecDeque<StepPoint>,
    before_step: VecDeque<StepPoint>,
}

/// What fitting one alignment's points found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlignedFit {
    /// The envelope, when the points allow one.
    pub cost: Option<StepCost>,
    /// The median step's tokens: what makes a step large.
    pub typical_tokens: f64,
    /// Whether enough steps were large to fit at all; an anchored window without a cost fitted a
    /// plane that is flat or falling in tokens.
    pub anchored: bool,
}

/// What fitting a [`StepWindow`] found, for [`StepCadence::set_fit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepFit {
    /// Each batch's tokens paired with the time since the batch before it.
    pub after_step: AlignedFit,
    /// Each batch's tokens paired with the time until the batch after it.
    pub before_step: AlignedFit,
}

/// How much steeper the pairing of each batch with the time after it must be to be taken for the
/// engine's. The wrong pairing of an engine that publishes ahead of its steps reads it many times
/// too fast (21× on a synthetic engine), or finds no fit. The wrong pairing of one that publishes
/// after its steps can read it slow instead: a step followed by idle time, or by a prompt's next
/// chunk, is paired with that. Once the dispatch bound had made the right pairing exact, the
/// wrong one read the simulator's profile A engines of 20k at 13,975 (1.43× slower) and won.
const BEFORE_STEP_STEEPER_BY: f64 = 2.0;

impl StepFit {
    /// The fit of the alignment the engine follows: the steeper one (see [`StepCadence`]), the
    /// before-the-step pairing only when it is [`BEFORE_STEP_STEEPER_BY`] steeper. Both
    /// must fit: the points of the wrong one can allow a fit where the right one's do not yet (on
    /// the simulator, engines of 35k tokens/s then read up to the 4× bound).
    /// A pairing anchored by enough large steps whose plane is flat or falling has no fit, and
    /// loses to the other.
    pub fn chosen(&self) -> Option<(StepCost, StepAlignment)> {
        if !self.after_step.anchored || !self.before_step.anchored {
            return None;
        }
        let slope = |c: Option<StepCost>| c.map_or(0.0, |c| c.seconds_per_token);
        if slope(self.before_step.cost) > BEFORE_STEP_STEEPER_BY * slope(self.after_step.cost) {
            self.before_step.cost.map(|c| (c, StepAlignment::BeforeStep))
        } else {
            self.after_step.cost.map(|c| (c, StepAlignment::AfterStep))
        }
    }
}

impl StepWindow {
    /// The envelopes of the window's points in both alignments, when they allow one (see
    /// [`StepCadence`]).
    pub fn fit(&self) -> StepFit {
        StepFit { after_step: fit_aligned(&self.after_step), before_step: fit_aligned(&self.before_step) }
    }
}

fn fit_aligned(points: &VecDeque<StepPoint>) -> AlignedFit {
    let tokens = sorted_tokens(points);
    let typical_tokens = tokens.get(tokens.len() / 2).copied().unwrap_or(f64::INFINITY);
    AlignedFit { cost: lower_envelope(points, &tokens), typical_tokens, anchored: anchored(&tokens) }
}

/// Whether at least [`MIN_LARGE_STEPS`] of the steps (tokens smallest first) are large.
fn anchored(tokens: &[f64]) -> bool {
    tokens.get(tokens.len() / 2).is_some_and(|&typical| {
        tokens.iter().rev().take_while(|&&x| x >= LARGE_STEP_FACTOR * typical).count() >= MIN_LARGE_STEPS
    })
}

/// The points' tokens, smallest first.
fn sorted_tokens(points: &VecDeque<StepPoint>) -> Vec<f64> {
    let mut tokens: Vec<f64> = points.iter().map(|p| p.tokens).collect();
    tokens.sort_by(f64::total_cmp);
    tokens
}

/// The low-quantile plane `seconds = a + tokens · s + running · b` under `points`, when a few steps
/// computed far more tokens than the typical one: without them the per-token cost of small steps
/// hides in their per-step cost, and the slope is loose (measured on the simulator: 13k to 70k
/// tokens/s for an engine of 20k). The running count enters when it varied: busy steps, with more
/// sequences, are mostly small ones, and leaving their cost out flattens the token slope.
///
/// `tokens` are the points' tokens, smallest first ([`sorted_tokens`]).
fn lower_envelope(points: &VecDeque<StepPoint>, tokens: &[f64]) -> Option<StepCost> {
    if !anchored(tokens) {
        return None;
    }
    let size_weights = size_class_weights(points);
    let (lo, hi) = points.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), p| (lo.min(p.running), hi.max(p.running)));
    if hi - lo >= MIN_RUNNING_SPREAD {
        let coef = quantile_plane(points, &size_weights, true)?;
        // A sequence cannot make a step faster. A negative cost per sequence means the running count
        // stood in for the tokens (large steps with few sequences, small ones with many): the plane
        // then tilts, and read an engine of 20k tokens/s at 33k on the simulator. The fit constrained
        // to a cost of at least zero is the fit without the running count.
        if coef[2] >= 0.0 {
            return step_cost(coef, true);
        }
    }
    step_cost(quantile_plane(points, &size_weights, false)?, false)
}

/// The costs a fitted plane `[per step, per token, per sequence]` states, when its token slope is
/// a cost.
fn step_cost(coef: [f64; 3], with_running: bool) -> Option<StepCost> {
    let [_, per_token, per_sequence] = coef;
    (per_token.is_finite() && per_token > 0.0).then_some(StepCost {
        seconds_per_token: per_token,
        seconds_per_sequence: (with_running && per_sequence.is_finite() && per_sequence > 0.0).then_some(per_sequence),
    })
}

/// The `ENVELOPE_QUANTILE` plane of `seconds` over `[1, tokens, running]` (running left out unless
/// `with_running`), each point's check loss weighed by its `size_weights` entry.
fn quantile_plane(points: &VecDeque<StepPoint>, size_weights: &[f64], with_running: bool) -> Option<[f64; 3]> {
    // Quantile regression by iteratively reweighted least squares: each point weighs
    // `τ / |r|` above the plane and `(1 − τ) / |r|` below it, which makes the weighted squares the
    // check loss of the τ-quantile.
    let mut weights = size_weights.to_vec();
    let mut coef = [0.0; 3];
    for _ in 0..IRLS_ITERATIONS {
        coef = weighted_plane(points, &weights, with_running)?;
        for ((w, p), size_weight) in weights.iter_mut().zip(points).zip(size_weights) {
            let r = p.seconds - coef[0] - coef[1] * p.tokens - coef[2] * p.running;
            let side = if r > 0.0 { ENVELOPE_QUANTILE } else { 1.0 - ENVELOPE_QUANTILE };
            *w = size_weight * side / r.abs().max(1e-4);
        }
    }
    Some(coef)
}

/// Each point's weight in the fit: one over the number of points of its size class (tokens within
/// a factor of two), so every class of step size weighs about the same in total. Small steps are
/// most of the points and most of them span a silent step: weighed one point one vote, their floor
/// sat a step's time above the true line and tilted it (a simulated engine of 20k tokens/s read
/// 31k). A class of fewer than [`MIN_CLASS_WEIGHT_POINTS`] weighs less, so that one large step
/// that spanned a silent one cannot tilt the line the other way alone.
fn size_class_weights(points: &VecDeque<StepPoint>) -> Vec<f64> {
    let class = |p: &StepPoint| (p.tokens.max(1.0).log2().floor() as usize).min(63);
    let mut counts = [0u32; 64];
    for p in points {
        counts[class(p)] += 1;
    }
    points.iter().map(|p| 1.0 / f64::from(counts[class(p)].max(MIN_CLASS_WEIGHT_POINTS))).collect()
}

/// Weighted least squares of `seconds` on `[1, tokens, running]` (the last left out, its
/// coefficient 0, unless `with_running`).
fn weighted_plane(points: &VecDeque<StepPoint>, weights: &[f64], with_running: bool) -> Option<[f64; 3]> {
    let k = if with_running { 3 } else { 2 };
    // Normal equations, augmented: [XᵀWX | XᵀWy].
    let mut m = [[0.0f64; 4]; 3];
    for (&w, p) in weights.iter().zip(points) {
        let x = [1.0, p.tokens, p.running];
        for i in 0..k {
            for j in 0..k {
                m[i][j] += w * x[i] * x[j];
            }
            m[i][3] += w * x[i] * p.seconds;
        }
    }
    for col in 0..k {
        let pivot = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        m.swap(col, pivot);
        let pivot_row = m[col];
        if pivot_row[col].abs() < 1e-300 {
            return None;
        }
        for (row, r) in m.iter_mut().enumerate().take(k) {
            if row != col {
                let f = r[col] / pivot_row[col];
                for (x, p) in r.iter_mut().zip(pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut coef = [0.0; 3];
    for (i, (c, r)) in coef.iter_mut().zip(&m).enumerate().take(k) {
        *c = r[3] / r[i];
    }
    coef.iter().all(|c| c.is_finite()).then_some(coef)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_protocol::{BlockRemoved, BlockStored, EngineHash};
    use rand::{Rng, SeedableRng};

    /// What each running sequence adds to a step in [`feed`].
    const PER_SEQUENCE_S: f64 = 0.000_5;

    /// A busy engine's steps at `rate` tokens/s with 20–40 ms of per-step cost: most store one to
    /// sixteen blocks, one in ten a prompt of 4k to 8k tokens; half the pairs of batches span one to
    /// five silent steps and one in ten an idle second or more. Each step's batch is published as
    /// it ends.
    fn feed(cadence: &mut StepCadence, rate: f64, steps: usize, seed: u64) {
        publish(cadence, &engine_steps(rate, steps, seed), StepAlignment::AfterStep);
    }

    /// Each step that stored blocks, in engine seconds (see [`feed`]).
    struct EngineStep {
        tokens: u64,
        running: u64,
        start: f64,
        end: f64,
    }

    fn engine_steps(rate: f64, steps: usize, seed: u64) -> Vec<EngineStep> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut t = 1_000.0;
        let mut out = Vec::with_capacity(steps);
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
            // Busy steps are small ones: the running batch is larger when the step computes less.
            let running = if tokens < 1_024 { rng.random_range(20..=60u64) } else { rng.random_range(0..=10u64) };
            let start = t;
            t += step(&mut rng) + running as f64 * PER_SEQUENCE_S + tokens as f64 / rate;
            out.push(EngineStep { tokens, running, start, end: t });
        }
        out
    }

    /// Publishes `steps` as an engine of `alignment` does: each step's blocks once it has run, or
    /// (async scheduling) as the step before it ends, which is when it starts.
    fn publish(cadence: &mut StepCadence, steps: &[EngineStep], alignment: StepAlignment) {
        for s in steps {
            let at = match alignment {
                StepAlignment::AfterStep => s.end,
                StepAlignment::BeforeStep => s.start,
            };
            if let Some(window) = cadence.observe(s.tokens, s.running, at, None) {
                cadence.set_fit(window.fit());
            }
        }
    }

    #[test]
    fn an_engine_that_publishes_before_its_steps_is_fitted_with_the_time_after_each_batch() {
        for (rate, seed) in [(20_000.0, 1), (6_000.0, 2), (60_000.0, 3)] {
            let steps = engine_steps(rate, 200, seed);
            let mut ahead = StepCadence::default();
            publish(&mut ahead, &steps, StepAlignment::BeforeStep);
            let measured = 1.0 / ahead.seconds_per_token().expect("enough points");
            assert!((measured / rate - 1.0).abs() < 0.1, "measured {measured:.0} for {rate:.0}");
            assert_eq!(ahead.alignment(), Some(StepAlignment::BeforeStep));
            // The case under test: pairing each batch with the time before it reads the engine
            // far too fast, or not at all.
            let window = &ahead.after_step.window(f64::INFINITY);
            let misread = fit_aligned(window).cost.map(|c| 1.0 / c.seconds_per_token);
            assert!(misread.is_none_or(|m| m > 1.5 * rate), "paired with the time before: {misread:?} for {rate:.0}");
        }
    }

    /// An engine at `rate` tokens/s that a router feeds as kvgate does: every eighth step computes
    /// a whole prompt (4k to 8k tokens) sent to it idle, a quarter to three seconds after its last
    /// step, or after two to six silent decode steps; the others store a block or a few. Returns
    /// each batch as the router sees it: published as the step ends, arriving 2 ms later, and the
    /// prompt's dispatch 3 ms before its step starts (one clock for both sides).
    fn idle_fed_batches(rate: f64, seed: u64) -> Vec<StepBatch> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut t = 1_000.0;
        let step = |rng: &mut rand_chacha::ChaCha8Rng| 0.020 + 0.020 * rng.random::<f64>();
        (0..240)
            .map(|i| {
                let whole_prompt = i % 8 == 0;
                if whole_prompt && rng.random::<bool>() {
                    t += 0.25 + 2.75 * rng.random::<f64>();
                } else if whole_prompt || rng.random::<f64>() < 0.5 {
                    for _ in 0..rng.random_range(if whole_prompt { 2..=6 } else { 1..=5 }) {
                        t += step(&mut rng);
                    }
                }
                let tokens = 64 * if whole_prompt { rng.random_range(64..=128) } else { rng.random_range(1..=4u64) };
                let running = rng.random_range(0..=8u64);
                let start = t;
                t += step(&mut rng) + running as f64 * PER_SEQUENCE_S + tokens as f64 / rate;
                StepBatch {
                    tokens,
                    running,
                    engine_time_s: t,
                    rank: None,
                    received_s: Some(t + 0.002),
                    dispatched_s: whole_prompt.then_some(start - 0.003),
                }
            })
            .collect()
    }

    #[test]
    fn a_step_is_timed_from_the_dispatch_of_the_prompt_it_began_when_that_came_later() {
        for (rate, seed) in [(20_000.0, 1), (35_000.0, 2), (60_000.0, 3)] {
            let measure = |batches: &mut dyn Iterator<Item = StepBatch>| {
                let mut c = StepCadence::default();
                for b in batches {
                    if let Some(window) = c.observe_batch(b) {
                        c.set_fit(window.fit());
                    }
                }
                c.seconds_per_token().map(|s| 1.0 / s)
            };
            let batches = idle_fed_batches(rate, seed);
            let measured = measure(&mut batches.iter().copied()).expect("enough points");
            assert!((measured / rate - 1.0).abs() < 0.1, "measured {measured:.0} for {rate:.0}");
            // The case under test: timed from the batch before alone, every whole prompt carries
            // the idle time or the silent steps before it.
            let undated = measure(&mut batches.iter().map(|b| StepBatch { dispatched_s: None, ..*b }));
            assert!(undated.is_none_or(|m| m < 0.85 * rate), "without the dispatches: {undated:?} for {rate:.0}");
        }
    }

    #[test]
    fn a_dispatch_reaches_the_engine_no_sooner_than_the_quickest_batch_says() {
        let mut c = StepCadence::default();
        // The engine's clock runs 100 s ahead of the router's; batches take 5 to 50 ms to arrive.
        for (i, delay) in [0.050, 0.005, 0.020].into_iter().enumerate() {
            let at = 1_100.0 + i as f64;
            c.observe_batch(StepBatch {
                tokens: 0,
                running: 0,
                engine_time_s: at,
                rank: None,
                received_s: Some(at - 100.0 + delay),
                dispatched_s: None,
            });
        }
        assert_eq!(c.lead.get(), Some(100.0 - 0.005));
        // A prompt dispatched at router time 1,010 began a step that ended at engine time 1,110.5:
        // it took at most 0.5 s and the quickest delivery.
        c.observe_batch(StepBatch {
            tokens: 4_096,
            running: 1,
            engine_time_s: 1_110.5,
            rank: None,
            received_s: Some(1_010.6),
            dispatched_s: Some(1_010.0),
        });
        let point = c.after_step.points.back().expect("a point, though 8.5 s passed since the last batch");
        assert!((point.seconds - 0.505).abs() < 1e-9, "{point:?}");
        assert!(c.before_step.points.is_empty(), "the batch before had no tokens");
    }

    #[test]
    fn the_pairing_with_the_time_after_each_batch_must_be_twice_as_steep_to_be_taken() {
        let fit = |seconds_per_token: f64| AlignedFit {
            cost: Some(StepCost { seconds_per_token, seconds_per_sequence: None }),
            typical_tokens: 64.0,
            anchored: true,
        };
        let chosen = |after: f64, before: f64| {
            StepFit { after_step: fit(after), before_step: fit(before) }.chosen().map(|(c, a)| (c.seconds_per_token, a))
        };
        assert_eq!(chosen(1.0 / 20_000.0, 1.0 / 14_000.0), Some((1.0 / 20_000.0, StepAlignment::AfterStep)));
        assert_eq!(chosen(1.0 / 424_000.0, 1.0 / 20_000.0), Some((1.0 / 20_000.0, StepAlignment::BeforeStep)));
        let no_after = StepFit { after_step: AlignedFit { cost: None, ..fit(0.0) }, before_step: fit(1.0 / 20_000.0) };
        assert_eq!(no_after.chosen().map(|(_, a)| a), Some(StepAlignment::BeforeStep));
    }

    #[test]
    fn the_envelope_finds_the_prefill_rate_under_silent_steps_and_idle_gaps() {
        for (rate, seed) in [(20_000.0, 1), (6_000.0, 2), (60_000.0, 3)] {
            let mut c = StepCadence::default();
            feed(&mut c, rate, 200, seed);
            let measured = 1.0 / c.seconds_per_token().expect("enough points");
            assert!((measured / rate - 1.0).abs() < 0.1, "measured {measured:.0} for {rate:.0}");
            let per_sequence = c.cost.and_then(|(c, _)| c.seconds_per_sequence).expect("the running count varied");
            assert_eq!(c.alignment(), Some(StepAlignment::AfterStep));
            assert!((per_sequence / PER_SEQUENCE_S - 1.0).abs() < 0.2, "{per_sequence} s per sequence");
        }
    }

    #[test]
    fn every_size_of_step_weighs_alike_in_the_fit() {
        // A window recorded from the simulator (multi-prefix, seed 3, an engine of 20k tokens/s):
        // most steps store a block or two and most pairs of them span a silent step, so their
        // floor sits a step above the line; five whole prompts sit on it. Weighed one point one
        // vote, the small steps tilted the line (32.9k with the running count, 30.9k without).
        let points: VecDeque<StepPoint> = include_str!("../testdata/step_window_multi_prefix_seed3.txt")
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| {
                let v: Vec<f64> = l.split_whitespace().map(|x| x.parse().expect("a number")).collect();
                StepPoint { tokens: v[0], running: v[1], seconds: v[2], at: 0.0 }
            })
            .collect();
        assert_eq!(points.len(), 240);
        let one_vote_each = 1.0 / quantile_plane(&points, &vec![1.0; points.len()], false).expect("a plane")[1];
        assert!(one_vote_each > 30_000.0, "the case under test: {one_vote_each:.0}");
        let measured = 1.0 / lower_envelope(&points, &sorted_tokens(&points)).expect("a fit").seconds_per_token;
        assert!((measured / 20_000.0 - 1.0).abs() < 0.05, "measured {measured:.0} for 20,000");
    }

    /// A window recorded from the simulator: `(points, kept)`, `kept` marking the large steps kept
    /// after they left the 256-point window.
    fn recorded_window(text: &str) -> (VecDeque<StepPoint>, Vec<bool>) {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| {
                let v: Vec<f64> = l.split_whitespace().map(|x| x.parse().expect("a number")).collect();
                (StepPoint { tokens: v[0], running: v[1], seconds: v[2], at: 0.0 }, v.get(3) == Some(&1.0))
            })
            .unzip()
    }

    #[test]
    fn large_steps_kept_past_the_window_anchor_a_fleet_that_hits_its_cache() {
        // Minutes into a run, the engine's steps are mostly a few hundred tokens; the last 256 hold
        // steps of a thousand or two with 40 to 80 sequences running, and no whole prompt.
        let (points, kept) = recorded_window(include_str!("../testdata/step_window_multi_prefix_300s_seed2.txt"));
        let window: VecDeque<StepPoint> = points.iter().zip(&kept).filter(|(_, k)| !**k).map(|(p, _)| *p).collect();
        assert_eq!(window.len(), STEP_WINDOW);
        let measured = |points: &VecDeque<StepPoint>| {
            1.0 / lower_envelope(points, &sorted_tokens(points)).expect("a fit").seconds_per_token
        };
        let alone = measured(&window);
        assert!(alone > 25_000.0, "the case under test: the window alone reads {alone:.0}");
        let with_kept = measured(&points);
        assert!((with_kept / 20_000.0 - 1.0).abs() < 0.1, "measured {with_kept:.0} for 20,000");
    }

    #[test]
    fn large_steps_leaving_the_window_are_kept_for_five_minutes() {
        let mut c = StepCadence::default();
        feed(&mut c, 20_000.0, 200, 4);
        let steps = &c.after_step;
        assert!(steps.large_from_tokens.is_finite(), "a window was fitted");
        let large_before = steps.points.iter().filter(|p| p.tokens >= steps.large_from_tokens).count();
        assert!(large_before >= MIN_LARGE_STEPS, "{large_before} large steps");
        // Small steps only, 40 ms apart, until the window holds none of the first ones.
        let mut t = c.last.expect("a batch").at;
        let mut window = None;
        for _ in 0..STEP_WINDOW {
            t += 0.040;
            window = c.observe(64, 10, t, None).or(window);
        }
        assert!(c.after_step.points.iter().all(|p| p.tokens == 64.0));
        assert!(c.after_step.large.len() >= MIN_LARGE_STEPS, "{} kept", c.after_step.large.len());
        let with_kept = window.expect("a refit was due").fit();
        assert!(with_kept.after_step.cost.is_some(), "the kept large steps still anchor the fit");
        // Five minutes on, they are too old to be handed out.
        let mut due = None;
        for _ in 0..48 {
            t += 8.0;
            due = c.observe(64, 10, t, None).or(due);
        }
        let stale = due.expect("a refit was due");
        assert!(stale.after_step.iter().all(|p| p.tokens == 64.0), "old large steps left out");
    }

    #[test]
    fn a_negative_cost_per_sequence_leaves_the_running_count_out() {
        // Steps that look faster with more sequences, and the large steps run with few: the
        // running count stands in for step size, and the fit falls back to tokens alone.
        let rate = 20_000.0;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let points: VecDeque<StepPoint> = (0..STEP_WINDOW)
            .map(|i| {
                let large = i % 8 == 0;
                let tokens = 64.0 * if large { rng.random_range(64..=128) } else { rng.random_range(1..=16) } as f64;
                let running = if large { rng.random_range(0..=5) } else { rng.random_range(30..=40) } as f64;
                StepPoint { tokens, running, seconds: 0.060 + tokens / rate - 0.001 * running, at: 0.0 }
            })
            .collect();
        let weights = size_class_weights(&points);
        let free = quantile_plane(&points, &weights, true).expect("a plane");
        let tokens_only = quantile_plane(&points, &weights, false).expect("a plane");
        assert!(free[2] < 0.0, "the case under test: a negative cost per sequence, {free:?}");
        assert!((free[1] / tokens_only[1] - 1.0).abs() > 0.05, "the two fits must differ: {free:?} {tokens_only:?}");
        let cost = lower_envelope(&points, &sorted_tokens(&points)).expect("a fit");
        assert_eq!(cost.seconds_per_token, tokens_only[1], "the token-only fit's slope, not the free plane's");
        assert_eq!(cost.seconds_per_sequence, None);
    }

    #[test]
    fn no_fit_before_enough_points_nor_from_steps_all_of_one_size() {
        let mut c = StepCadence::default();
        feed(&mut c, 20_000.0, MIN_STEP_POINTS / 2, 4);
        assert_eq!(c.seconds_per_token(), None);
        let mut same = StepCadence::default();
        for i in 0..200 {
            if let Some(window) = same.observe(512, 8, f64::from(i) * 0.05, None) {
                same.set_fit(window.fit());
            }
        }
        assert_eq!(same.seconds_per_token(), None);
    }

    #[test]
    fn alignment_names_are_the_serialized_ones() {
        for a in StepAlignment::ALL {
            assert_eq!(serde_json::to_value(a).expect("serializes"), a.name());
        }
    }

    #[test]
    fn pairs_across_ranks_out_of_order_or_without_tokens_make_no_point() {
        let mut c = StepCadence::default();
        c.observe(512, 1, 10.0, Some(0));
        c.observe(512, 1, 10.1, Some(1));
        c.observe(512, 1, 10.05, Some(1));
        c.observe(512, 1, f64::NAN, Some(1));
        c.observe(512, 1, 30.0, Some(1));
        assert!(c.after_step.points.is_empty(), "{:?}", c.after_step.points);
        assert!(c.before_step.points.is_empty(), "{:?}", c.before_step.points);
        // A batch without tokens makes no point of its own, but it ends the step of the batch
        // before it when the engine publishes before its steps.
        c.observe(0, 1, 30.1, Some(1));
        assert!(c.after_step.points.is_empty());
        let ended: Vec<_> = c.before_step.points.iter().map(|p| (p.tokens, (p.seconds * 1e3).round())).collect();
        assert_eq!(ended, [(512.0, 100.0)]);
        c.observe(256, 1, 30.3, Some(1));
        assert_eq!(c.after_step.points.len(), 1);
        assert_eq!(c.before_step.points.len(), 1, "the batch before had no tokens");
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
