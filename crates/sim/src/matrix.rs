//! Scenarios × seeds × policies, summarised per policy as a mean and a 95% interval.
//!
//! One run says little: a policy that wins seed 1 by 5% may lose seed 2 by as much. The matrix runs
//! every policy on the same arrivals of each seed and reports, per scenario and policy, the mean over
//! seeds of each metric with a Student-t 95% confidence interval, the policy's TTFT p90 over the
//! `oracle`'s (the information gap), and a check of projected:enforce against the targets of
//! issue 10.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde::Serialize;

use crate::policy::PolicySpec;
use crate::workload::{self, Workload, WorkloadParams};
use crate::{Report, SimConfig, SimError};

/// A scenario of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// The production incident on 51 engines.
    HotPrefix51,
    /// Eight Zipf-popular prefixes on 16 engines.
    MultiPrefix,
    /// Tool-using agent sessions on 16 engines.
    Agentic,
    /// The Mooncake conversation trace on 16 engines at 6× its recorded rate.
    MooncakeConversation,
    /// The Mooncake synthetic trace on 8 engines at its recorded rate.
    MooncakeSynthetic,
}

impl Scenario {
    /// Every scenario, in the order the matrix reports them.
    pub const ALL: [Scenario; 5] = [
        Scenario::HotPrefix51,
        Scenario::MultiPrefix,
        Scenario::Agentic,
        Scenario::MooncakeConversation,
        Scenario::MooncakeSynthetic,
    ];

    /// The name `--matrix` takes.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::HotPrefix51 => "hot-prefix-51",
            Scenario::MultiPrefix => "multi-prefix",
            Scenario::Agentic => "agentic",
            Scenario::MooncakeConversation => "mooncake-conversation",
            Scenario::MooncakeSynthetic => "mooncake-synthetic",
        }
    }

    /// The scenario called `name`.
    pub fn parse(name: &str) -> Result<Self, SimError> {
        Self::ALL.into_iter().find(|s| s.name() == name).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
            SimError::Config(format!("unknown matrix scenario {name:?}: expected one of {}", names.join(", ")))
        })
    }

    /// What the scenario is, for a report's heading.
    pub fn describe(self) -> &'static str {
        match self {
            Scenario::HotPrefix51 => "51 engines, the incident's hot owner and a 60/s burst on its prefix",
            Scenario::MultiPrefix => "16 engines, 60 requests/s over 8 Zipf-popular prefixes",
            Scenario::Agentic => "16 engines, 6 agent sessions/s growing their own prefix turn by turn",
            Scenario::MooncakeConversation => "16 engines, Mooncake conversation trace at 6×",
            Scenario::MooncakeSynthetic => "8 engines, Mooncake synthetic trace as recorded",
        }
    }

    /// The workload of `seed`. Synthetic scenarios draw their arrivals and contents from the seed.
    /// The traces record arrivals rounded to ticks (3 s in the conversation trace), so each seed
    /// places a tick's requests at uniform random instants within it; contents are the trace's.
    pub fn workload(self, seed: u64, traces: &Path) -> Result<Workload, SimError> {
        let params = WorkloadParams { workers: None, rate: None, duration_s: None, seed };
        let mut w = match self {
            Scenario::HotPrefix51 => return Ok(workload::hot_prefix_51(params)),
            Scenario::MultiPrefix => return Ok(workload::multi_prefix(params)),
            Scenario::Agentic => return Ok(workload::agentic(params)),
            Scenario::MooncakeConversation => {
                workload::mooncake(&traces.join("mooncake_conversation_trace.jsonl"), 16, 6.0, None)?
            }
            Scenario::MooncakeSynthetic => {
                workload::mooncake(&traces.join("mooncake_synthetic_trace.jsonl"), 8, 1.0, None)?
            }
        };
        w.name = self.name().into();
        w.jitter_ticks(seed);
        Ok(w)
    }
}

/// A mean over seeds and the half-width of its 95% confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    /// The mean; NaN when no seed had a value.
    pub mean: f64,
    /// Half-width of the 95% interval (Student t); 0 with a single value.
    pub ci95: f64,
    /// Seeds that had a value (a run that completed nothing has no latency).
    pub n: usize,
}

impl Estimate {
    /// The estimate of `values`, skipping NaNs.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let v: Vec<f64> = values.into_iter().filter(|x| !x.is_nan()).collect();
        let n = v.len();
        if n == 0 {
            return Estimate { mean: f64::NAN, ci95: 0.0, n };
        }
        let mean = v.iter().sum::<f64>() / n as f64;
        if n == 1 {
            return Estimate { mean, ci95: 0.0, n };
        }
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        Estimate { mean, ci95: student_t95(n - 1) * (var / n as f64).sqrt(), n }
    }

    /// Whether `self` is no worse than `best` where lower is better: lower, or the two intervals
    /// overlap (a tie within the noise counts as a win).
    pub fn ties_or_beats_low(&self, best: &Estimate) -> bool {
        self.mean <= best.mean || self.mean - self.ci95 <= best.mean + best.ci95
    }
}

/// The two-sided 97.5% quantile of Student's t with `df` degrees of freedom.
fn student_t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.wrapping_sub(1)).copied().unwrap_or(1.960)
}

/// One policy on one scenario, over every seed.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    /// The policy as the CLI names it.
    pub policy: String,
    /// TTFT percentiles, seconds.
    pub ttft_p50_s: Estimate,
    /// TTFT p90, seconds.
    pub ttft_p90_s: Estimate,
    /// TTFT p99, seconds.
    pub ttft_p99_s: Estimate,
    /// Output tokens per second.
    pub output_tokens_per_s: Estimate,
    /// Prefix-cache hit rate.
    pub hit_rate: Estimate,
    /// What the fleet's caches held of each prompt at dispatch ([`crate::report::Cache::held_rate`]).
    pub held_rate: Estimate,
    /// Rejected requests per run.
    pub rejected: Estimate,
    /// Runs that completed no request at all.
    pub runs_completing_nothing: usize,
    /// Mean TTFT p90 over the oracle's mean TTFT p90 (the information gap), when the oracle ran.
    pub p90_over_oracle: Option<f64>,
}

/// One scenario's summaries and the per-seed reports behind them.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioSummary {
    /// The scenario's name.
    pub scenario: String,
    /// What it is.
    pub description: String,
    /// Engines in its fleet.
    pub engines: usize,
    /// Requests per seed (the first seed's; synthetic scenarios vary a little by seed).
    pub requests: usize,
    /// Seeds run.
    pub seeds: Vec<u64>,
    /// One summary per policy, in the order asked.
    pub policies: Vec<PolicySummary>,
    /// projected:enforce against the targets, when it and at least one peer ran.
    pub targets: Option<Targets>,
}

/// projected:enforce against issue 10's targets on one scenario (means, ties within the interval
/// count as wins).
#[derive(Debug, Clone, Serialize)]
pub struct Targets {
    /// Lowest TTFT p90 of all policies (the oracle excluded, which no gateway can be).
    pub lowest_p90: bool,
    /// Lowest TTFT p99 of all policies (the oracle excluded).
    pub lowest_p99: bool,
    /// Output throughput within 1% of the best policy's.
    pub throughput_within_1pct: bool,
    /// No rejects where some peer has none.
    pub no_rejects_where_a_peer_has_none: bool,
    /// Hit rate at least 0.97× the best peer's; the ratio.
    pub hit_rate_over_best_peer: f64,
    /// TTFT p90 within 10% of the oracle's; the ratio.
    pub p90_over_oracle: Option<f64>,
}

/// The policies named `projected:*` or `oracle` are kvgate's; the rest are the peers it is judged
/// against.
fn is_peer(label: &str) -> bool {
    !(label.starts_with("projected") || label == "oracle")
}

/// Summarises the reports of one scenario (any order; grouped by policy label in `labels` order).
pub fn summarise(
    scenario: Scenario,
    workload: &Workload,
    seeds: &[u64],
    labels: &[String],
    reports: &[Report],
) -> ScenarioSummary {
    let of = |label: &str| -> Vec<&Report> { reports.iter().filter(|r| r.label() == label).collect() };
    let oracle_p90 = labels
        .iter()
        .any(|l| l == "oracle")
        .then(|| Estimate::of(of("oracle").iter().map(|r| r.ttft_s.p90)).mean)
        .filter(|m| m.is_finite() && *m > 0.0);
    let policies: Vec<PolicySummary> = labels
        .iter()
        .map(|label| {
            let p90 = Estimate::of(of(label).iter().map(|r| r.ttft_s.p90));
            PolicySummary {
                policy: label.clone(),
                ttft_p50_s: Estimate::of(of(label).iter().map(|r| r.ttft_s.p50)),
                ttft_p90_s: p90,
                ttft_p99_s: Estimate::of(of(label).iter().map(|r| r.ttft_s.p99)),
                output_tokens_per_s: Estimate::of(of(label).iter().map(|r| r.throughput.output_tokens_per_s)),
                hit_rate: Estimate::of(of(label).iter().map(|r| r.cache.hit_rate)),
                held_rate: Estimate::of(of(label).iter().map(|r| r.cache.held_rate.unwrap_or(0.0))),
                rejected: Estimate::of(of(label).iter().map(|r| r.requests.rejected as f64)),
                runs_completing_nothing: of(label).iter().filter(|r| r.requests.completed == 0).count(),
                p90_over_oracle: oracle_p90.map(|o| p90.mean / o).filter(|r| r.is_finite()),
            }
        })
        .collect();
    let targets = targets(&policies);
    ScenarioSummary {
        scenario: scenario.name().into(),
        description: scenario.describe().into(),
        engines: workload.workers,
        requests: workload.requests.iter().filter(|r| r.direct_to.is_none()).count(),
        seeds: seeds.to_vec(),
        policies,
        targets,
    }
}

fn targets(policies: &[PolicySummary]) -> Option<Targets> {
    let enforce = policies.iter().find(|p| p.policy == "projected:enforce")?;
    let peers: Vec<&PolicySummary> = policies.iter().filter(|p| is_peer(&p.policy)).collect();
    if peers.is_empty() {
        return None;
    }
    // A policy that completed nothing has no latency and cannot be "best" at it.
    let gateways: Vec<&PolicySummary> =
        policies.iter().filter(|p| p.policy != "oracle" && p.ttft_p90_s.mean.is_finite()).collect();
    let best_low = |f: fn(&PolicySummary) -> Estimate| {
        gateways.iter().map(|p| f(p)).min_by(|a, b| a.mean.total_cmp(&b.mean)).unwrap_or(f(enforce))
    };
    let best_tps = policies.iter().map(|p| p.output_tokens_per_s.mean).fold(0.0, f64::max);
    let best_peer_hit = peers.iter().map(|p| p.hit_rate.mean).fold(0.0, f64::max);
    Some(Targets {
        lowest_p90: enforce.ttft_p90_s.ties_or_beats_low(&best_low(|p| p.ttft_p90_s)),
        lowest_p99: enforce.ttft_p99_s.ties_or_beats_low(&best_low(|p| p.ttft_p99_s)),
        throughput_within_1pct: enforce.output_tokens_per_s.mean >= 0.99 * best_tps,
        no_rejects_where_a_peer_has_none: enforce.rejected.mean == 0.0 || peers.iter().all(|p| p.rejected.mean > 0.0),
        hit_rate_over_best_peer: if best_peer_hit > 0.0 { enforce.hit_rate.mean / best_peer_hit } else { 1.0 },
        p90_over_oracle: enforce.p90_over_oracle,
    })
}

/// Runs every policy of `specs` on every seed of every scenario, on up to `threads` threads, and
/// summarises them. `configure` turns a policy and a seed into a run's configuration.
pub fn run(
    scenarios: &[Scenario],
    seeds: &[u64],
    specs: &[PolicySpec],
    traces: &Path,
    threads: usize,
    configure: &(dyn Fn(PolicySpec, u64) -> SimConfig + Sync),
) -> Result<Vec<ScenarioSummary>, SimError> {
    let mut cells = Vec::new();
    for &scenario in scenarios {
        let workloads = seeds.iter().map(|&seed| scenario.workload(seed, traces)).collect::<Result<_, _>>()?;
        cells.push((scenario, workloads));
    }
    run_workloads(&cells, seeds, specs, threads, configure)
}

/// [`run`] on workloads already built: per scenario, one workload per seed.
pub fn run_workloads(
    cells: &[(Scenario, Vec<Workload>)],
    seeds: &[u64],
    specs: &[PolicySpec],
    threads: usize,
    configure: &(dyn Fn(PolicySpec, u64) -> SimConfig + Sync),
) -> Result<Vec<ScenarioSummary>, SimError> {
    // One job per (scenario, seed, policy); results come back tagged with the job.
    let jobs: Vec<(usize, usize, &PolicySpec)> = (0..cells.len())
        .flat_map(|c| (0..seeds.len()).flat_map(move |k| specs.iter().map(move |s| (c, k, s))))
        .collect();
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, Report)>> = Mutex::new(Vec::with_capacity(jobs.len()));
    let failure: Mutex<Option<SimError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, jobs.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(c, k, spec)) = jobs.get(i) else { return };
                let Some(workload) = cells[c].1.get(k) else { return };
                match crate::run(workload, configure(spec.clone(), seeds[k])) {
                    Ok(report) => done.lock().unwrap_or_else(|e| e.into_inner()).push((c, report)),
                    Err(e) => {
                        *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        next.store(jobs.len(), Ordering::Relaxed);
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    let done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    let labels: Vec<String> = specs.iter().map(PolicySpec::label).collect();
    cells
        .iter()
        .enumerate()
        .map(|(c, (scenario, workloads))| {
            let reports: Vec<Report> = done.iter().filter(|(dc, _)| *dc == c).map(|(_, r)| r.clone()).collect();
            let first = workloads
                .first()
                .ok_or_else(|| SimError::Config(format!("scenario {} has no workload", scenario.name())))?;
            Ok(summarise(*scenario, first, seeds, &labels, &reports))
        })
        .collect()
}

fn fmt_est(e: &Estimate, digits: usize) -> String {
    if e.mean.is_nan() {
        "-".into()
    } else {
        format!("{:.*} ± {:.*}", digits, e.mean, digits, e.ci95)
    }
}

fn yes_no(ok: bool) -> &'static str {
    if ok {
        "yes"
    } else {
        "**no**"
    }
}

/// The summaries as Markdown: per scenario a heading, a table of every policy, and the targets.
pub fn markdown(summaries: &[ScenarioSummary]) -> String {
    let mut out = String::new();
    for s in summaries {
        out += &format!(
            "### {}\n\n{}; {} requests; seeds {}. Mean ± 95% interval over seeds; held is the share of prompt tokens the fleet held cached at dispatch; p90/oracle is the mean TTFT p90 over the oracle's.\n\n",
            s.scenario,
            s.description,
            s.requests,
            seed_list(&s.seeds)
        );
        out +=
            "| policy | TTFT p50 s | TTFT p90 s | TTFT p99 s | out tok/s | hit rate | held | rejected | p90/oracle |\n";
        out += "|---|---|---|---|---|---|---|---|---|\n";
        for p in &s.policies {
            let nothing = if p.runs_completing_nothing > 0 {
                format!(" ({} of {} runs completed nothing)", p.runs_completing_nothing, s.seeds.len())
            } else {
                String::new()
            };
            out += &format!(
                "| {}{} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                p.policy,
                nothing,
                fmt_est(&p.ttft_p50_s, 3),
                fmt_est(&p.ttft_p90_s, 3),
                fmt_est(&p.ttft_p99_s, 3),
                fmt_est(&p.output_tokens_per_s, 0),
                fmt_est(&p.hit_rate, 3),
                fmt_est(&p.held_rate, 3),
                fmt_est(&p.rejected, 1),
                p.p90_over_oracle.filter(|r| r.is_finite()).map_or("-".into(), |r| format!("{r:.2}")),
            );
        }
        if let Some(t) = &s.targets {
            out += &format!(
                "\nprojected:enforce: lowest p90 {}; lowest p99 {}; throughput within 1% of the best {}; no rejects where a peer has none {}; hit rate {:.3}× the best peer's ({}); p90 {} the oracle's ({}).\n",
                yes_no(t.lowest_p90),
                yes_no(t.lowest_p99),
                yes_no(t.throughput_within_1pct),
                yes_no(t.no_rejects_where_a_peer_has_none),
                t.hit_rate_over_best_peer,
                yes_no(t.hit_rate_over_best_peer >= 0.97),
                t.p90_over_oracle.map_or("-".into(), |r| format!("{r:.2}×")),
                t.p90_over_oracle.map_or("-", |r| yes_no(r <= 1.10)),
            );
        }
        out += "\n";
    }
    out
}

fn seed_list(seeds: &[u64]) -> String {
    match seeds {
        [] => String::new(),
        [one] => one.to_string(),
        [first, .., last] if seeds.windows(2).all(|p| p[1] == p[0] + 1) => format!("{first}–{last}"),
        _ => seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_has_the_student_t_interval() {
        let e = Estimate::of([1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!((e.mean, e.n), (3.0, 5));
        // s = √2.5, t(4) = 2.776: 2.776 × √(2.5 / 5).
        assert!((e.ci95 - 2.776 * (0.5f64).sqrt()).abs() < 1e-9, "{e:?}");
        let single = Estimate::of([7.0]);
        assert_eq!((single.mean, single.ci95), (7.0, 0.0));
        let none = Estimate::of([f64::NAN, f64::NAN]);
        assert!(none.mean.is_nan() && none.n == 0);
    }

    #[test]
    fn overlapping_intervals_tie_and_separate_ones_do_not() {
        let best = Estimate { mean: 1.0, ci95: 0.1, n: 5 };
        assert!(Estimate { mean: 1.15, ci95: 0.1, n: 5 }.ties_or_beats_low(&best));
        assert!(!Estimate { mean: 1.3, ci95: 0.1, n: 5 }.ties_or_beats_low(&best));
        assert!(Estimate { mean: 0.5, ci95: 0.0, n: 5 }.ties_or_beats_low(&best));
    }

    #[test]
    fn scenarios_parse_by_name_and_refuse_others() {
        for s in Scenario::ALL {
            assert_eq!(Scenario::parse(s.name()).unwrap(), s);
        }
        let err = Scenario::parse("mooncake").unwrap_err().to_string();
        assert!(err.contains("mooncake-conversation"), "{err}");
    }

    #[test]
    fn the_matrix_judges_enforce_against_peers_and_the_oracle() {
        let specs: Vec<PolicySpec> =
            ["smg_least_load", "projected:enforce", "oracle"].iter().map(|s| PolicySpec::parse(s).unwrap()).collect();
        let configure = |spec: PolicySpec, seed: u64| {
            let mut cfg = SimConfig::new(kvgate_engine_model::EngineProfile::large_moe_h200(), spec, seed);
            cfg.drain = std::time::Duration::from_secs(60);
            cfg
        };
        // A short multi-prefix: the matrix machinery, not the result, is under test.
        let short = |seed| {
            workload::multi_prefix(WorkloadParams { workers: None, rate: Some(30.0), duration_s: Some(5.0), seed })
        };
        let cells = [(Scenario::MultiPrefix, vec![short(1), short(2)])];
        let out = run_workloads(&cells, &[1, 2], &specs, 2, &configure).unwrap();
        let s = &out[0];
        assert_eq!(s.policies.len(), 3);
        for p in &s.policies {
            assert_eq!(p.ttft_p90_s.n, 2, "{}: one value per seed", p.policy);
        }
        let oracle = s.policies.iter().find(|p| p.policy == "oracle").unwrap();
        assert_eq!(oracle.p90_over_oracle, Some(1.0));
        assert!(s.targets.is_some());
        let md = markdown(&out);
        assert!(md.contains("### multi-prefix") && md.contains("| projected:enforce |") && md.contains("seeds 1–2"));
    }
}
