//! What a run measured, and the report it prints.

use kvgate_core::{Reason, Timestamp};
use kvgate_engine_model::Finished;
use serde::Serialize;

use crate::policy::Pick;
use crate::policy::PolicySpec;
use crate::workload::Workload;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Refused by router admission.
    Rejected,
    /// Failed: no eligible engine, or its engine went away.
    Failed,
    /// Still running when the run stopped.
    Unfinished,
}

#[derive(Debug, Clone, Default)]
struct RequestRecord {
    /// The engine the policy chose (dispatched or then rejected by admission).
    decided: Option<usize>,
    worker: Option<usize>,
    /// When the step that first ran its prompt began (kept only when rows are listed).
    first_step: Option<Timestamp>,
    first_token: Option<Timestamp>,
    finished: Option<Timestamp>,
    outcome: Option<Outcome>,
    prompt_tokens: u64,
    cached_tokens: u64,
    output_tokens: u64,
    /// The most of its prompt any connected engine held cached when it was last dispatched.
    held_tokens: u64,
}

/// Collects a run's measurements.
#[derive(Debug)]
pub struct Recorder {
    scenario: String,
    policy: String,
    mode: Option<String>,
    seed: u64,
    arrivals: Vec<Timestamp>,
    hot: Vec<bool>,
    measured: Vec<bool>,
    records: Vec<RequestRecord>,
    open: usize,
    worker_requests: Vec<u64>,
    worker_max_waiting: Vec<u64>,
    hot_owner: Option<usize>,
    reasons: std::collections::BTreeMap<String, u64>,
    shadow_decisions: u64,
    shadow_disagreements: u64,
    kv_gaps: u64,
    kv_history_lost: u64,
    restarts: u64,
    credit_while_untrusted: u64,
    timeline: Vec<(f64, Vec<u32>)>,
    keep_requests: bool,
}

impl Recorder {
    /// A recorder for `workload` routed by `policy`, in the run seeded with `seed`.
    pub fn new(workload: &Workload, policy: &PolicySpec, seed: u64) -> Self {
        let n = workload.requests.len();
        let measured: Vec<bool> = workload.requests.iter().map(|r| r.direct_to.is_none() && !r.warm_up).collect();
        let open = measured.iter().filter(|m| **m).count();
        Recorder {
            scenario: workload.name.clone(),
            policy: policy.name.clone(),
            mode: (policy.name == "projected").then(|| policy.mode.unwrap_or(kvgate_core::Mode::Enforce).to_string()),
            seed,
            arrivals: workload.requests.iter().map(|r| r.arrival).collect(),
            hot: workload.requests.iter().map(|r| r.hot).collect(),
            measured,
            records: vec![RequestRecord::default(); n],
            open,
            worker_requests: vec![0; workload.workers],
            worker_max_waiting: vec![0; workload.workers],
            hot_owner: workload.hot_owner,
            reasons: Default::default(),
            shadow_decisions: 0,
            shadow_disagreements: 0,
            kv_gaps: 0,
            kv_history_lost: 0,
            restarts: 0,
            credit_while_untrusted: 0,
            timeline: Vec::new(),
            keep_requests: false,
        }
    }

    /// Also lists every measured request in the report ([`Report::per_request`]).
    pub fn keeping_requests(mut self, keep: bool) -> Self {
        self.keep_requests = keep;
        self
    }

    /// Whether every measured request has ended.
    pub fn all_done(&self) -> bool {
        self.open == 0
    }

    fn close(&mut self, i: usize) {
        if self.measured[i] && self.records[i].outcome.is_none() && self.records[i].finished.is_none() {
            self.open -= 1;
        }
    }

    /// Closed-loop request `i` is sent `at` (its arrival was not known in advance).
    pub fn arrived(&mut self, i: usize, at: Timestamp) {
        self.arrivals[i] = at;
    }

    /// A policy decided request `i`.
    pub fn decision(&mut self, i: usize, pick: &Pick) {
        self.records[i].decided = Some(pick.worker);
        if self.hot[i] && self.hot_owner.is_none() {
            self.hot_owner = Some(pick.worker);
        }
        if let Some(r) = pick.reason {
            *self.reasons.entry(r.as_str().to_owned()).or_default() += 1;
            if r == Reason::Shadow {
                self.shadow_decisions += 1;
                self.shadow_disagreements += u64::from(pick.shadow_disagrees == Some(true));
            }
        }
    }

    /// Request `i` was sent to `worker`; `held_tokens` of its prompt were cached on the engine that
    /// held the most of it at that moment.
    pub fn dispatched(&mut self, i: usize, worker: usize, held_tokens: u64) {
        self.records[i].worker = Some(worker);
        self.records[i].held_tokens = held_tokens;
        if self.measured[i] {
            self.worker_requests[worker] += 1;
        }
    }

    /// Request `i` produced its first token.
    pub fn first_token(&mut self, i: usize, at: Timestamp) {
        self.records[i].first_token.get_or_insert(at);
    }

    /// Whether rows are listed, and so [`Recorder::first_step`] wanted.
    pub fn keeps_requests(&self) -> bool {
        self.keep_requests
    }

    /// A step that runs request `i`'s prompt began (the first such one counts).
    pub fn first_step(&mut self, i: usize, at: Timestamp) {
        self.records[i].first_step.get_or_insert(at);
    }

    /// Request `i` completed.
    pub fn completed(&mut self, i: usize, f: &Finished, at: Timestamp) {
        self.close(i);
        let r = &mut self.records[i];
        r.finished = Some(at);
        r.prompt_tokens = f.prompt_tokens;
        r.cached_tokens = f.cached_tokens;
        r.output_tokens = f.output_tokens;
    }

    /// Request `i` ended without completing.
    pub fn outcome(&mut self, i: usize, outcome: Outcome, _at: Timestamp) {
        self.close(i);
        self.records[i].outcome = Some(outcome);
    }

    /// The event consumer saw a gap or a restart.
    pub fn kv_gap(&mut self) {
        self.kv_gaps += 1;
    }

    /// A replay could not return the history asked for.
    pub fn kv_history_lost(&mut self) {
        self.kv_history_lost += 1;
    }

    /// An engine restarted.
    pub fn restart(&mut self) {
        self.restarts += 1;
    }

    /// A decision credited cache on an engine whose telemetry the router must not trust (restarted
    /// with no new events yet, or load reports stale).
    pub fn credit_while_untrusted(&mut self) {
        self.credit_while_untrusted += 1;
    }

    /// The deepest waiting queue an engine had.
    pub fn worker_max_waiting(&mut self, w: usize, max: u64) {
        self.worker_max_waiting[w] = max;
    }

    /// Per-engine queue depths at `at`.
    pub fn sample(&mut self, at: Timestamp, depths: Vec<u32>) {
        self.timeline.push((at.as_micros() as f64 / 1e6, depths));
    }

    /// The report of the finished run.
    pub fn finish(self, _end: Timestamp) -> Report {
        let measured: Vec<usize> = (0..self.records.len()).filter(|&i| self.measured[i]).collect();
        let completed: Vec<usize> = measured.iter().copied().filter(|&i| self.records[i].finished.is_some()).collect();
        let count = |o: Outcome| measured.iter().filter(|&&i| self.records[i].outcome == Some(o)).count() as u64;
        let secs = |a: Timestamp, b: Timestamp| b.saturating_since(a).as_secs_f64();
        let mut ttft: Vec<f64> =
            measured.iter().filter_map(|&i| self.records[i].first_token.map(|t| secs(self.arrivals[i], t))).collect();
        let mut e2e: Vec<f64> =
            completed.iter().map(|&i| secs(self.arrivals[i], self.records[i].finished.unwrap())).collect();
        let first_arrival = measured.iter().map(|&i| self.arrivals[i]).min().unwrap_or_default();
        let last_finish = completed.iter().filter_map(|&i| self.records[i].finished).max().unwrap_or(first_arrival);
        let span = secs(first_arrival, last_finish).max(1e-9);
        let output: u64 = completed.iter().map(|&i| self.records[i].output_tokens).sum();
        let prompt: u64 = completed.iter().map(|&i| self.records[i].prompt_tokens).sum();
        let cached: u64 = completed.iter().map(|&i| self.records[i].cached_tokens).sum();
        let held: u64 = completed.iter().map(|&i| self.records[i].held_tokens).sum();
        let hot: Vec<usize> =
            measured.iter().copied().filter(|&i| self.hot[i] && self.records[i].decided.is_some()).collect();
        let owner_share = match (self.hot_owner, hot.len()) {
            (Some(owner), n) if n > 0 => {
                hot.iter().filter(|&&i| self.records[i].decided == Some(owner)).count() as f64 / n as f64
            }
            _ => 0.0,
        };
        let per_request = if self.keep_requests {
            measured
                .iter()
                .map(|&i| {
                    let r = &self.records[i];
                    RequestRow {
                        index: i,
                        arrival_s: round(secs(Timestamp::ZERO, self.arrivals[i])),
                        worker: r.worker,
                        first_step_s: r.first_step.map(|t| round(secs(self.arrivals[i], t))),
                        ttft_s: r.first_token.map(|t| round(secs(self.arrivals[i], t))),
                        e2e_s: r.finished.map(|t| round(secs(self.arrivals[i], t))),
                        prompt_tokens: r.prompt_tokens,
                        cached_tokens: r.cached_tokens,
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        Report {
            scenario: self.scenario,
            policy: self.policy,
            mode: self.mode,
            seed: self.seed,
            requests: Requests {
                total: measured.len() as u64,
                completed: completed.len() as u64,
                rejected: count(Outcome::Rejected),
                failed: count(Outcome::Failed),
                unfinished: count(Outcome::Unfinished),
            },
            throughput: Throughput::over(output, completed.len() as u64, span),
            ttft_s: Percentiles3::of(&mut ttft),
            ttft_cdf: quantiles(&mut ttft, CDF_POINTS),
            e2e_s: Percentiles2::of(&mut e2e),
            cache: Cache::of(prompt, cached).held(held),
            workers: (0..self.worker_requests.len())
                .map(|w| WorkerReport {
                    id: format!("w{w}"),
                    requests: self.worker_requests[w],
                    max_waiting: self.worker_max_waiting[w],
                    planned_rates: None,
                    measured_rates: None,
                    true_decode_rate: None,
                    preemptions: None,
                })
                .collect(),
            hot_prefix: HotPrefix {
                owner: self.hot_owner.map(|w| format!("w{w}")),
                owner_share: round(owner_share),
                requests: hot.len() as u64,
            },
            shadow: Shadow { decisions: self.shadow_decisions, disagreements: self.shadow_disagreements },
            decisions_by_reason: self.reasons,
            kv: KvStats {
                gaps: self.kv_gaps,
                history_lost: self.kv_history_lost,
                restarts: self.restarts,
                credit_while_untrusted: self.credit_while_untrusted,
            },
            timeline: self.timeline,
            per_request,
        }
    }
}

/// Rounds a reported figure to 4 decimals, so reports compare byte for byte.
pub fn round(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// `points` quantiles of `samples` from the smallest to the largest (sorted in place), for a CDF:
/// entry i is the value below which i / (points - 1) of the samples lie. Empty without samples.
pub fn quantiles(samples: &mut [f64], points: usize) -> Vec<f64> {
    if samples.is_empty() || points < 2 {
        return Vec::new();
    }
    samples.sort_by(f64::total_cmp);
    let last = samples.len() - 1;
    (0..points).map(|i| samples[(i * last).div_ceil(points - 1)]).collect()
}

/// Points of each TTFT CDF kept in a report (one per percent).
pub const CDF_POINTS: usize = 101;

/// Nearest-rank percentile; NaN without samples, so that a run that completed nothing shows no
/// latency (`-` in tables, `null` in JSON) instead of a 0.00 that reads as the best result.
pub fn pct(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    round(v[rank - 1])
}

/// Request counts. Background load placed directly on engines is not counted.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Requests {
    /// Routed requests.
    pub total: u64,
    /// Completed.
    pub completed: u64,
    /// Refused by admission.
    pub rejected: u64,
    /// Failed (engine gone, nothing eligible).
    pub failed: u64,
    /// Still running at the end.
    pub unfinished: u64,
}

/// Throughput over the span from the first arrival to the last completion.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Throughput {
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
}

impl Throughput {
    /// Output tokens and completed requests over `span` seconds.
    pub fn over(output_tokens: u64, completed: u64, span_s: f64) -> Self {
        let span = span_s.max(1e-9);
        Throughput {
            output_tokens_per_s: round(output_tokens as f64 / span),
            requests_per_s: round(completed as f64 / span),
        }
    }
}

impl Percentiles3 {
    /// The percentiles of `samples` (sorted in place).
    pub fn of(samples: &mut [f64]) -> Self {
        Percentiles3 { p50: pct(samples, 0.50), p90: pct(samples, 0.90), p99: pct(samples, 0.99) }
    }
}

impl Percentiles2 {
    /// The percentiles of `samples` (sorted in place).
    pub fn of(samples: &mut [f64]) -> Self {
        Percentiles2 { p50: pct(samples, 0.50), p99: pct(samples, 0.99) }
    }
}

impl Cache {
    /// The cache effect of `cached` tokens out of `prompt`.
    pub fn of(prompt: u64, cached: u64) -> Self {
        Cache {
            hit_rate: round(if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 }),
            prompt_tokens: prompt,
            prefill_tokens_computed: prompt.saturating_sub(cached),
            held_rate: None,
        }
    }

    /// With the prompt tokens that were held cached somewhere in the fleet at dispatch.
    pub fn held(mut self, held_tokens: u64) -> Self {
        let prompt = self.prompt_tokens;
        self.held_rate = Some(round(if prompt == 0 { 0.0 } else { held_tokens as f64 / prompt as f64 }));
        self
    }
}

/// p50, p90, p99.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles3 {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// p50, p99.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Percentiles2 {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// Prefix-cache effect, over completed requests.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Cache {
    /// Prefill tokens saved / prompt tokens.
    pub hit_rate: f64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens the engines had to compute.
    pub prefill_tokens_computed: u64,
    /// Held tokens / prompt tokens, where a request's held tokens are what the engine holding the
    /// most of its prompt had cached when it was dispatched (less a fully cached prompt's last
    /// block, as admission counts it). What the fleet's caches offered, against `hit_rate`, what
    /// the policy took: a request sent past the deepest holder counts here and not there.
    /// Simulator only (`None` over HTTP, where the engines' caches are not read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_rate: Option<f64>,
}

/// One engine's share.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WorkerReport {
    /// Engine id.
    pub id: String,
    /// Requests routed to it.
    pub requests: u64,
    /// Its deepest waiting queue.
    pub max_waiting: u64,
    /// The prefill and decode rates (tokens/s) the router planned with for it at the end of the run
    /// (kvgate's policies: configured, then calibrated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub planned_rates: Option<(f64, f64)>,
    /// The prefill and decode rates the router measured for it by the end of the run, if it had
    /// (prefill: only when off the configured rate by more than the dead band; decode: dead band
    /// or not).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured_rates: Option<(Option<f64>, Option<f64>)>,
    /// The decode rate of a full batch by the engine model's own step time, at the mean context
    /// its decoding sequences had over the run: what decode calibration should find.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub true_decode_rate: Option<f64>,
    /// Running requests the engine preempted (out of KV blocks: sent back to its queue and
    /// recomputed later, as vLLM's `vllm:num_preemptions` counts them). Simulator only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preemptions: Option<u64>,
}

/// The tracked hot prefix.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HotPrefix {
    /// Its original owner (the scenario's, or the engine that got the first hot request).
    pub owner: Option<String>,
    /// Share of hot-prefix requests the policy sent to the original owner (admission may then have
    /// rejected them).
    pub owner_share: f64,
    /// Hot-prefix requests decided.
    pub requests: u64,
}

/// Shadow-mode counts.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Shadow {
    /// Decisions made in shadow mode.
    pub decisions: u64,
    /// Of those, how many `enforce` would have sent elsewhere.
    pub disagreements: u64,
}

/// KV event path counts.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KvStats {
    /// Sequence gaps and restarts the consumer saw.
    pub gaps: u64,
    /// Replays that could not return the history asked for.
    pub history_lost: u64,
    /// Engine restarts.
    pub restarts: u64,
    /// Decisions that credited cache on an engine whose telemetry could not be trusted: restarted with
    /// no new events yet, or load reports stale (kvgate policies; should be 0).
    pub credit_while_untrusted: u64,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Policy name.
    pub policy: String,
    /// Mode (projected only).
    pub mode: Option<String>,
    /// Seed.
    pub seed: u64,
    /// Request counts.
    pub requests: Requests,
    /// Throughput.
    pub throughput: Throughput,
    /// Time to first token, seconds, over requests that got one.
    pub ttft_s: Percentiles3,
    /// End to end, seconds, over completed requests.
    pub e2e_s: Percentiles2,
    /// Cache effect.
    pub cache: Cache,
    /// Per engine.
    pub workers: Vec<WorkerReport>,
    /// The hot prefix.
    pub hot_prefix: HotPrefix,
    /// Shadow counts.
    pub shadow: Shadow,
    /// Decisions by reason (kvgate policies).
    pub decisions_by_reason: std::collections::BTreeMap<String, u64>,
    /// KV event path.
    pub kv: KvStats,
    /// Per-engine queue depth samples `(seconds, depths)`, when asked for.
    #[serde(skip)]
    pub timeline: Vec<(f64, Vec<u32>)>,
    /// The TTFT distribution, seconds: [`CDF_POINTS`] quantiles from the fastest to the slowest
    /// (empty when nothing completed), for the CDF plot.
    #[serde(skip)]
    pub ttft_cdf: Vec<f64>,
    /// Every measured request, in workload order, when the run was asked to keep them
    /// (`kvgate sim --per-request`); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub per_request: Vec<RequestRow>,
}

/// One measured request of a run, for comparing a simulated run with a real one request by request.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RequestRow {
    /// Its index in the workload (warm-up and background requests are not listed).
    pub index: usize,
    /// When it arrived at the router, seconds from the run's start.
    pub arrival_s: f64,
    /// The engine it was dispatched to; `None` if it never was.
    pub worker: Option<usize>,
    /// Time to the start of the step that first ran its prompt, seconds (its way to the engine,
    /// the intake and the queue; the rest of its TTFT is its prefill and the first token's
    /// delivery); `None` if no step ran it.
    pub first_step_s: Option<f64>,
    /// Time to its first token, seconds; `None` without one.
    pub ttft_s: Option<f64>,
    /// Time to its last token, seconds; `None` if it did not complete.
    pub e2e_s: Option<f64>,
    /// Its prompt tokens (0 if it did not complete).
    pub prompt_tokens: u64,
    /// Prompt tokens its engine had cached (0 if it did not complete).
    pub cached_tokens: u64,
}

impl Report {
    /// The policy as the CLI names it.
    pub fn label(&self) -> String {
        match &self.mode {
            Some(m) => format!("{}:{m}", self.policy),
            None => self.policy.clone(),
        }
    }
}

/// A fixed-width table of reports, one row each. The `held` column (what the fleet's caches held
/// at dispatch) is shown when some report measured it, i.e. in the simulator.
pub fn table(reports: &[Report]) -> String {
    let with_held = reports.iter().any(|r| r.cache.held_rate.is_some());
    let held_column = |text: &str| if with_held { format!(" {text:>6}") } else { String::new() };
    let mut out = format!(
        "{:<20} {:>6} {:>6} {:>5} {:>5} {:>9} {:>8} {:>8} {:>8} {:>8} {:>6}{} {:>9} {:>6} {:>6}\n",
        "policy",
        "total",
        "done",
        "rej",
        "fail",
        "out tok/s",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "e2e p99",
        "hit",
        held_column("held"),
        "prefill M",
        "owner",
        "maxQ"
    );
    // A latency of no request at all is shown as `-`, never as 0.00.
    let secs = |v: f64| if v.is_nan() { "-".to_owned() } else { format!("{v:.2}") };
    for r in reports {
        let max_q = r.workers.iter().map(|w| w.max_waiting).max().unwrap_or(0);
        out += &format!(
            "{:<20} {:>6} {:>6} {:>5} {:>5} {:>9.0} {:>8} {:>8} {:>8} {:>8} {:>6.3}{} {:>9.2} {:>6.2} {:>6}\n",
            r.label(),
            r.requests.total,
            r.requests.completed,
            r.requests.rejected,
            r.requests.failed,
            r.throughput.output_tokens_per_s,
            secs(r.ttft_s.p50),
            secs(r.ttft_s.p90),
            secs(r.ttft_s.p99),
            secs(r.e2e_s.p99),
            r.cache.hit_rate,
            held_column(&r.cache.held_rate.map_or("-".to_owned(), |h| format!("{h:.3}"))),
            r.cache.prefill_tokens_computed as f64 / 1e6,
            r.hot_prefix.owner_share,
            max_q,
        );
    }
    out
}
