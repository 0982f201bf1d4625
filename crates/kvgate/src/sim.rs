//! `kvgate sim`: flags to a simulator configuration, runs, and output.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use kvgate_core::{Mode, PolicyConfig};
use kvgate_engine_model::{EngineProfile, Flavor};
use kvgate_sim::faults;
use kvgate_sim::matrix::{self, Scenario};
use kvgate_sim::policy::PolicySpec;
use kvgate_sim::workload::{self, Workload, WorkloadParams};
use kvgate_sim::{report, SimConfig};

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A fixed-width table.
    Table,
    /// One JSON report, or `{"runs": [...]}` with --compare, or the matrix's summaries.
    Json,
    /// The matrix as Markdown tables (docs/simulator.md is written from it); --matrix only.
    Markdown,
}

/// Flags of `kvgate sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Scenario: hot-prefix-51, multi-prefix, agentic, incident-bursts, mooncake or azure [default:
    /// hot-prefix-51, or with --trace the replay its extension names: .jsonl mooncake, .csv azure].
    #[arg(long)]
    scenario: Option<String>,
    /// The incident-bursts scenario's shape (the real-fleet bench's, `scripts/real-engines/incident.sh`).
    #[command(flatten)]
    bursts: BurstArgs,
    /// Trace file for mooncake (JSONL) and azure (CSV) replays.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Policy: round_robin, random, power_of_two (the gateway's), smg_least_load, smg_power_of_two,
    /// cache_aware, cache_aware_seeded, smg_cache_aware (SMG 1.13 as shipped: cache_aware with its
    /// guards, on KV events as over gRPC workers), smg_cache_aware_http (the same over HTTP workers:
    /// its own tree of what it sent), sglang_v04, dynamo, llm_d, aibrix, lmetric, projected (or
    /// projected:off|shadow|enforce).
    #[arg(long, default_value = "projected")]
    policy: String,
    /// Mode of the projected policy.
    #[arg(long)]
    mode: Option<String>,
    /// Run several policies on identical arrivals and print one table, e.g.
    /// `cache_aware_seeded,smg_least_load,projected:off,projected:enforce`.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// Seed of arrivals and every random choice.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Write per-engine queue depth over time and TTFT percentiles per policy to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// List every measured request (arrival, engine, TTFT, end to end, cached tokens) in each
    /// JSON report's `per_request`, to compare a run with a real one request by request.
    #[arg(long)]
    per_request: bool,
    /// Engines in the fleet (scenario default: 51 for hot-prefix-51, 16 otherwise).
    #[arg(long)]
    workers: Option<usize>,
    /// Arrivals per second (synthetic scenarios).
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds of arrivals (synthetic scenarios).
    #[arg(long)]
    duration: Option<f64>,
    /// Trace replay: divide trace timestamps by this.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Trace replay: use only the first N requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Engine profile: large-moe-h200 (a, default), llama3-8b-h100 (b), or a JSON file of one (the
    /// form `kvgate profile NAME` prints), e.g. a paced real fleet's.
    #[arg(long, default_value = "large-moe-h200")]
    profile: String,
    /// Queued prompt tokens the router assumes per waiting request when the engines report only
    /// counts (vLLM), as `kvgate serve`'s `[telemetry] assumed_prompt_tokens` [default: 1024].
    #[arg(long)]
    assumed_prompt_tokens: Option<u64>,
    /// Decode tokens the router assumes left per running request, as `kvgate serve`'s `[telemetry]
    /// assumed_decode_tokens` [default: 256].
    #[arg(long)]
    assumed_decode_tokens: Option<u64>,
    /// Mooncake replay: tokens each hash id stands for (the trace's own is 512; the real-engine
    /// benches replay it at 32).
    #[arg(long, default_value_t = workload::MOONCAKE_BLOCK_TOKENS)]
    trace_block_tokens: u32,
    /// Inject a fault (repeatable): kv-delay, kv-loss, kv-loss-no-replay, disconnect, restart,
    /// stale-telemetry. Engine faults hit the hot owner (engine 0 by default).
    #[arg(long = "fault")]
    faults: Vec<String>,
    /// Projected policy: escape when the cache winner's queue exceeds the load-only winner's by this.
    #[arg(long)]
    escape_seconds: Option<f64>,
    /// Projected policy: escape when the cache winner has this many more waiting requests.
    #[arg(long)]
    escape_waiting: Option<u64>,
    /// Projected policy: bound of the weight on uncached prefill, 1 / (1 − fleet prefill load)
    /// [default: 10; 1 weighs prefill as the request's own seconds only].
    #[arg(long)]
    prefill_weight_max: Option<f64>,
    /// Projected policy: weight of the delay uncached prefill adds to the worker's running
    /// sequences [default: 0.15; 0 turns it off].
    #[arg(long)]
    batch_delay_weight: Option<f64>,
    /// Projected policy: a worker holding more of the prompt than the projected winner is chosen
    /// while its cost is at most (1 + this) × the winner's [default: 0, which minimises the cost alone].
    #[arg(long)]
    reuse_slack: Option<f64>,
    /// Projected policy: longest a hot prefix is expected to stay hot when weighing a new copy of
    /// it, seconds [default: 600; 0 turns copying off].
    #[arg(long)]
    replication_horizon_s: Option<f64>,
    /// Projected policy: projected KV usage (with the request) above which the pressure barrier
    /// adds seconds [default: 0.9].
    #[arg(long)]
    kv_barrier_threshold: Option<f64>,
    /// Projected policy: scale of the KV-pressure barrier, seconds [default: 2].
    #[arg(long)]
    kv_barrier_scale_s: Option<f64>,
    /// Router admission: reject above this projected wait in seconds (0 disables).
    #[arg(long, default_value_t = 30.0)]
    admission_wait_s: f64,
    /// Load poll interval in milliseconds.
    #[arg(long, default_value_t = 200)]
    poll_ms: u64,
    /// KV event delivery delay in milliseconds.
    #[arg(long, default_value_t = 5)]
    kv_delay_ms: u64,
    /// Router replicas behind one Service, each with its own reservations (1 to 64).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// How replicas share reservations: none (each sees only its own until the next load report) or
    /// nats (kvgate's [replicas] bus: reservations at once but at most one message per 2 ms, first
    /// tokens and releases with the next message or within 20 ms, a 1 ms hop, full state every
    /// second).
    #[arg(long, default_value = "none", value_parser = ["none", "nats"])]
    replica_sync: String,
    /// With --replica-sync nats: probability that a peer misses a bus message (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    replica_bus_loss: f64,
    /// With --replica-sync nats: milliseconds from publish to a peer applying the message.
    #[arg(long, default_value_t = 1)]
    replica_bus_delay_ms: u64,
    /// Spread the requests a trace records at one instant evenly until its next instant (the
    /// Mooncake trace rounds to 3 s ticks; replayed as is, each tick is a burst of simultaneous
    /// requests).
    #[arg(long)]
    spread_ticks: bool,
    /// Run scenarios × seeds × policies and print, per scenario and policy, the mean and 95%
    /// interval of TTFT p50/p90/p99, throughput, hit rate and rejects, with the p90 over the
    /// oracle's. Scenarios (comma-separated; all when none is given): hot-prefix-51, multi-prefix,
    /// agentic, mooncake-conversation, mooncake-synthetic. Policies: --compare, else every one.
    #[arg(long, num_args = 0.., value_delimiter = ',')]
    matrix: Option<Vec<String>>,
    /// With --matrix: seeds 1 to N.
    #[arg(long, default_value_t = 5)]
    seeds: u64,
    /// With --matrix: runs at once [default: the machine's cores].
    #[arg(long)]
    threads: Option<usize>,
    /// With --matrix: the directory holding the Mooncake traces.
    #[arg(long, default_value = "../shared/data/traces")]
    traces: PathBuf,
    /// The load report the engines serve and the router polls: vllm (request counts and KV usage)
    /// or sglang (/v1/loads, with queued tokens) [default: the profile's engine; profile a is
    /// SGLang, b vLLM]. Only the oracle reads the engines' exact state.
    #[arg(long, value_parser = ["vllm", "sglang"])]
    telemetry: Option<String>,
    /// Configure engine 0's throughputs in the router at this many times its real ones (3: the
    /// router is told it is 3× faster than it is), to watch calibration correct them.
    #[arg(long, default_value_t = 1.0)]
    misconfigure_first: f64,
    /// Calibrate kvgate's rates from the engines' step cadence and inter-token times (the policy knob
    /// `calibrate`; off by default).
    #[arg(long)]
    calibrate: bool,
    /// With --replica-sync nats: the least milliseconds between two messages of a replica (kvgate's
    /// flush_ms).
    #[arg(long, default_value_t = 2)]
    replica_bus_flush_ms: u64,
    /// With --replica-sync nats: how many milliseconds a first token or a release may wait to ride
    /// with the next reservation (kvgate's lazy_flush_ms).
    #[arg(long, default_value_t = 20)]
    replica_bus_lazy_flush_ms: u64,
    /// With --replica-sync nats: the longest milliseconds a replica holds a request before deciding
    /// it while its peers decide in step with it (kvgate's stagger_ms; 0 never holds).
    #[arg(long, default_value_t = 10)]
    replica_stagger_ms: u64,
}

/// Flags of the `incident-bursts` scenario; unset, `scripts/real-engines/incident.sh`'s requests on
/// the tiny model's tokenizer. Any of them with another scenario is an error, not ignored.
#[derive(Debug, Args)]
pub struct BurstArgs {
    /// incident-bursts: tokens of the hot prefix every request shares [default: 1900].
    #[arg(long)]
    prefix_tokens: Option<u32>,
    /// incident-bursts: tokens of each request's own question [default: 680].
    #[arg(long)]
    question_tokens: Option<u32>,
    /// incident-bursts: tokens each request generates [default: 128].
    #[arg(long)]
    output_tokens: Option<u32>,
    /// incident-bursts: clients sending at once, each its next request once its answer is
    /// complete [default: 16].
    #[arg(long)]
    clients: Option<usize>,
    /// incident-bursts: requests in a burst [default: 48].
    #[arg(long)]
    per_burst: Option<usize>,
    /// incident-bursts: bursts, each once the one before has ended [default: 6].
    #[arg(long)]
    bursts: Option<usize>,
    /// incident-bursts: milliseconds from a burst's last answer to the next burst [default: 1100].
    #[arg(long)]
    settle_ms: Option<u64>,
}

impl BurstArgs {
    /// The first of these flags given, by name.
    fn first_given(&self) -> Option<&'static str> {
        [
            ("--prefix-tokens", self.prefix_tokens.is_some()),
            ("--question-tokens", self.question_tokens.is_some()),
            ("--output-tokens", self.output_tokens.is_some()),
            ("--clients", self.clients.is_some()),
            ("--per-burst", self.per_burst.is_some()),
            ("--bursts", self.bursts.is_some()),
            ("--settle-ms", self.settle_ms.is_some()),
        ]
        .into_iter()
        .find_map(|(name, given)| given.then_some(name))
    }

    /// The scenario's shape on `workers` engines, the questions drawn from `seed`.
    fn shape(&self, workers: usize, seed: u64) -> anyhow::Result<workload::IncidentBursts> {
        let b = workload::IncidentBursts {
            workers,
            prefix_tokens: self.prefix_tokens.unwrap_or(1900),
            question_tokens: self.question_tokens.unwrap_or(680),
            output_tokens: self.output_tokens.unwrap_or(128),
            clients: self.clients.unwrap_or(16),
            per_burst: self.per_burst.unwrap_or(48),
            bursts: self.bursts.unwrap_or(6),
            settle: Duration::from_millis(self.settle_ms.unwrap_or(1100)),
            seed,
        };
        for (name, value) in [
            ("--prefix-tokens", b.prefix_tokens as usize),
            ("--output-tokens", b.output_tokens as usize),
            ("--clients", b.clients),
            ("--per-burst", b.per_burst),
            ("--bursts", b.bursts),
        ] {
            if value == 0 {
                bail!("{name} must be at least 1 for incident-bursts");
            }
        }
        Ok(b)
    }
}

fn load_workload(a: &SimArgs) -> anyhow::Result<Workload> {
    let params = WorkloadParams { workers: a.workers, rate: a.rate, duration_s: a.duration, seed: a.seed };
    if let Some(rate) = a.rate {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--rate must be a positive number, got {rate}");
        }
    }
    if let Some(d) = a.duration {
        if !(d.is_finite() && d > 0.0 && d <= 86_400.0) {
            bail!("--duration must be a number of seconds in (0, 86400], got {d}");
        }
    }
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        bail!("--speedup must be a positive number, got {}", a.speedup);
    }
    if a.workers == Some(0) || a.workers.is_some_and(|w| w > 4096) {
        bail!("--workers must be between 1 and 4096");
    }
    let trace = |default: &str| -> PathBuf { a.trace.clone().unwrap_or_else(|| PathBuf::from(default)) };
    let scenario = match (a.scenario.as_deref(), a.trace.as_deref()) {
        (Some(s), None) => s,
        (None, None) => "hot-prefix-51",
        // A trace without a scenario: its extension says which replay it is.
        (None, Some(t)) => match t.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => "mooncake",
            Some("csv") => "azure",
            _ => bail!(
                "cannot tell the format of --trace {}: name it .jsonl (Mooncake) or .csv (Azure), or give --scenario mooncake or azure",
                t.display()
            ),
        },
        (Some(s @ ("hot-prefix-51" | "multi-prefix" | "agentic" | "incident-bursts")), Some(t)) => {
            bail!("--trace {} applies to the mooncake and azure replays, not to the synthetic {s}", t.display())
        }
        (Some(s), Some(_)) => s,
    };
    if let Some(flag) = a.bursts.first_given().filter(|_| scenario != "incident-bursts") {
        bail!("{flag} applies to --scenario incident-bursts, not {scenario}");
    }
    Ok(match scenario {
        "hot-prefix-51" => workload::hot_prefix_51(params),
        "multi-prefix" => workload::multi_prefix(params),
        "agentic" => workload::agentic(params),
        "incident-bursts" => {
            if let Some(flag) = [("--rate", a.rate.is_some()), ("--duration", a.duration.is_some())]
                .into_iter()
                .find_map(|(name, given)| given.then_some(name))
            {
                bail!("{flag} does not apply to incident-bursts: its clients send when their answers come");
            }
            workload::incident_bursts(a.bursts.shape(a.workers.unwrap_or(4), a.seed)?)
        }
        "mooncake" => workload::mooncake_with_blocks(
            &trace("../shared/data/traces/mooncake_conversation_trace.jsonl"),
            a.workers.unwrap_or(16),
            a.speedup,
            a.limit,
            a.trace_block_tokens,
        )?,
        "azure" => workload::azure(
            &trace("../shared/data/traces/AzureLLMInferenceTrace_conv.csv"),
            a.workers.unwrap_or(16),
            a.speedup,
            a.limit,
        )?,
        other => bail!(
            "unknown scenario {other:?}: expected hot-prefix-51, multi-prefix, agentic, incident-bursts, mooncake or azure"
        ),
    })
}

fn specs(a: &SimArgs) -> anyhow::Result<Vec<PolicySpec>> {
    if !a.compare.is_empty() {
        return a.compare.iter().map(|s| PolicySpec::parse(s.trim()).map_err(Into::into)).collect();
    }
    let mut spec = PolicySpec::parse(&a.policy)?;
    if let Some(mode) = &a.mode {
        if spec.name != "projected" {
            bail!("--mode applies to the projected policy, not {}", spec.name);
        }
        spec.mode = Some(mode.parse::<Mode>()?);
    }
    Ok(vec![spec])
}

/// Every policy the simulator has, for the matrix: the gateway's baselines, the peers, kvgate's
/// three modes and the oracle.
fn every_policy() -> anyhow::Result<Vec<PolicySpec>> {
    let mut out = Vec::new();
    for name in kvgate_sim::policy::POLICY_NAMES {
        if *name == "projected" {
            for mode in ["off", "shadow", "enforce"] {
                out.push(PolicySpec::parse(&format!("projected:{mode}"))?);
            }
        } else {
            out.push(PolicySpec::parse(name)?);
        }
    }
    Ok(out)
}

/// The run configuration every flag but the workload's sets, for `spec` and `seed`.
fn configure(a: &SimArgs, profile: &EngineProfile, knobs: &PolicyConfig, spec: PolicySpec, seed: u64) -> SimConfig {
    let mut cfg = SimConfig::new(profile.clone(), spec, seed);
    cfg.telemetry = match a.telemetry.as_deref() {
        Some("vllm") => Flavor::Vllm,
        Some("sglang") => Flavor::Sglang,
        _ => profile.flavor,
    };
    cfg.knobs = knobs.clone();
    if let Some(tokens) = a.assumed_prompt_tokens {
        cfg.count_assumptions.prompt_tokens_per_waiting = tokens;
    }
    if let Some(tokens) = a.assumed_decode_tokens {
        cfg.count_assumptions.decode_tokens_per_running = tokens;
    }
    cfg.admission_wait_s = a.admission_wait_s;
    cfg.poll_interval = Duration::from_millis(a.poll_ms.max(1));
    cfg.kv_delay = Duration::from_millis(a.kv_delay_ms);
    cfg.replicas = a.replicas;
    cfg.misconfigured_rate_scale = a.misconfigure_first;
    cfg.replica_sync = (a.replica_sync == "nats").then(|| kvgate_sim::bus::BusModel {
        loss: a.replica_bus_loss,
        delay: Duration::from_millis(a.replica_bus_delay_ms),
        flush: Duration::from_millis(a.replica_bus_flush_ms),
        lazy_flush: Duration::from_millis(a.replica_bus_lazy_flush_ms),
        stagger: Duration::from_millis(a.replica_stagger_ms),
        ..Default::default()
    });
    cfg.timeline = a.plot.as_ref().map(|_| Duration::from_secs(1));
    cfg.per_request = a.per_request;
    cfg
}

fn run_matrix(a: &SimArgs, names: &[String], profile: &EngineProfile, knobs: &PolicyConfig) -> anyhow::Result<()> {
    let workload_flags = [
        ("--scenario", a.scenario.is_some()),
        ("--trace", a.trace.is_some()),
        ("--workers", a.workers.is_some()),
        ("--rate", a.rate.is_some()),
        ("--duration", a.duration.is_some()),
        ("--limit", a.limit.is_some()),
        ("--speedup", a.speedup != 1.0),
        ("--spread-ticks", a.spread_ticks),
        ("--fault", !a.faults.is_empty()),
        ("--plot", a.plot.is_some()),
        ("--per-request", a.per_request),
        ("--mode", a.mode.is_some()),
    ];
    let burst_flag = a.bursts.first_given().map(|flag| (flag, true));
    let workload_flags: Vec<(&str, bool)> = workload_flags.into_iter().chain(burst_flag).collect();
    if let Some((flag, _)) = workload_flags.iter().find(|(_, set)| *set) {
        bail!("{flag} does not combine with --matrix: the matrix's scenarios fix their own workloads (see --help)");
    }
    if a.seeds == 0 || a.seeds > 100 {
        bail!("--seeds must be between 1 and 100, got {}", a.seeds);
    }
    let scenarios = if names.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        names.iter().map(|n| Scenario::parse(n.trim())).collect::<Result<_, _>>()?
    };
    let specs: Vec<PolicySpec> = if a.compare.is_empty() { every_policy()? } else { specs(a)? };
    let seeds: Vec<u64> = (1..=a.seeds).collect();
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let summaries = matrix::run(&scenarios, &seeds, &specs, &a.traces, threads, &|spec, seed| {
        configure(a, profile, knobs, spec, seed)
    })
    .context("matrix run failed")?;
    match a.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&summaries)?),
        Format::Table | Format::Markdown => print!("{}", matrix::markdown(&summaries)),
    }
    Ok(())
}

/// A profile by name, or from a JSON file (checked: every rate and size positive, the step costs
/// not negative).
fn load_profile(name: &str) -> anyhow::Result<EngineProfile> {
    if let Some(profile) = EngineProfile::by_name(name) {
        return Ok(profile);
    }
    let path = std::path::Path::new(name);
    if !path.is_file() {
        bail!("unknown profile {name:?}: expected large-moe-h200 (a), llama3-8b-h100 (b) or a JSON file of a profile");
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the profile {name}"))?;
    let p: EngineProfile =
        serde_json::from_str(&text).with_context(|| format!("the profile {name} is not a profile's JSON"))?;
    let positive = [("prefill_tokens_per_s", p.prefill_tokens_per_s), ("step_base_ms", p.step_base_ms)];
    if let Some((field, v)) = positive.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
        bail!("the profile {name}: {field} must be above 0, not {v}");
    }
    let costs = [("per_seq_ms", p.per_seq_ms), ("per_kilo_context_ms", p.per_kilo_context_ms)];
    if let Some((field, v)) = costs.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
        bail!("the profile {name}: {field} must be 0 or more, not {v}");
    }
    if p.chunk_budget == 0 || p.max_running == 0 || p.kv_capacity_tokens == 0 || p.block_size == 0 {
        bail!("the profile {name}: chunk_budget, max_running, kv_capacity_tokens and block_size must be above 0");
    }
    if let Err(e) = p.check_scheduling() {
        bail!("the profile {name}: {e}");
    }
    Ok(p)
}

/// Runs `kvgate sim`.
pub fn run(a: SimArgs) -> anyhow::Result<()> {
    let profile = load_profile(&a.profile)?;
    if a.trace_block_tokens == 0 {
        bail!("--trace-block-tokens must be at least 1");
    }
    for (flag, knob, value) in [
        ("--assumed-prompt-tokens", kvgate_core::telemetry::ASSUMED_PROMPT_TOKENS, a.assumed_prompt_tokens),
        ("--assumed-decode-tokens", kvgate_core::telemetry::ASSUMED_DECODE_TOKENS, a.assumed_decode_tokens),
    ] {
        if let Some(v) = value {
            if !(knob.min..=knob.max).contains(&(v as f64)) {
                bail!("{flag} must be between {} and {}, not {v}", knob.min, knob.max);
            }
        }
    }
    let mut knobs = PolicyConfig::default();
    knobs.escape_seconds = a.escape_seconds.unwrap_or(knobs.escape_seconds);
    knobs.escape_waiting = a.escape_waiting.unwrap_or(knobs.escape_waiting);
    knobs.prefill_weight_max = a.prefill_weight_max.unwrap_or(knobs.prefill_weight_max);
    knobs.batch_delay_weight = a.batch_delay_weight.unwrap_or(knobs.batch_delay_weight);
    knobs.reuse_slack = a.reuse_slack.unwrap_or(knobs.reuse_slack);
    knobs.replication_horizon_s = a.replication_horizon_s.unwrap_or(knobs.replication_horizon_s);
    knobs.kv_barrier_threshold = a.kv_barrier_threshold.unwrap_or(knobs.kv_barrier_threshold);
    knobs.kv_barrier_scale_s = a.kv_barrier_scale_s.unwrap_or(knobs.kv_barrier_scale_s);
    knobs.calibrate = a.calibrate;
    knobs.validate()?;
    if !(a.admission_wait_s.is_finite() && a.admission_wait_s >= 0.0) {
        bail!("--admission-wait-s must be a non-negative number of seconds");
    }
    if let Some(names) = &a.matrix {
        return run_matrix(&a, names, &profile, &knobs);
    }
    if a.format == Format::Markdown {
        bail!("--format markdown is the matrix's format: add --matrix, or use table or json");
    }
    if a.per_request && a.format != Format::Json {
        bail!("--per-request lists requests in the JSON report: add --format json");
    }
    let mut workload = load_workload(&a).context("cannot build the workload")?;
    if a.spread_ticks {
        workload.spread_ticks();
    }
    let start = workload.requests.iter().find(|r| r.direct_to.is_none()).map_or(Default::default(), |r| r.arrival);
    let end = workload.requests.last().map_or(start, |r| r.arrival);
    let span = end.saturating_since(start).max(Duration::from_secs(1));
    let target = workload.hot_owner.unwrap_or(0);
    let faults = a.faults.iter().map(|f| faults::named(f, target, start, span)).collect::<Result<Vec<_>, _>>()?;
    let mut reports = Vec::new();
    for spec in specs(&a)? {
        let mut cfg = configure(&a, &profile, &knobs, spec, a.seed);
        cfg.faults = faults.clone();
        reports.push(kvgate_sim::run(&workload, cfg)?);
    }
    let header =
        format!("scenario {} ({} engines, profile {}, seed {})", workload.name, workload.workers, profile.name, a.seed);
    write_reports(&reports, a.plot.as_deref(), a.format, a.compare.is_empty(), &header)
}

/// Writes the plot (if asked) and prints the reports as a table under `header`, or as JSON: one
/// report when `single`, else `{"runs": [...]}`.
pub fn write_reports(
    reports: &[report::Report],
    plot: Option<&std::path::Path>,
    format: Format,
    single: bool,
    header: &str,
) -> anyhow::Result<()> {
    if let Some(path) = plot {
        let svg = kvgate_sim::plot::svg(reports)?;
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    match format {
        Format::Table => {
            println!("{header}");
            print!("{}", report::table(reports));
        }
        Format::Json if single => println!("{}", serde_json::to_string_pretty(&reports[0])?),
        Format::Json => println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "runs": reports }))?),
        Format::Markdown => bail!("--format markdown is the simulator matrix's format: use table or json"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::load_profile;

    #[test]
    fn a_profile_loads_by_name_or_from_its_json_and_a_bad_one_says_which_field() {
        assert_eq!(load_profile("b").unwrap().name, "llama3-8b-h100");
        let dir = std::env::temp_dir().join(format!("kvgate-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut paced = kvgate_engine_model::EngineProfile::llama3_8b_h100();
        paced.step_base_ms *= 4.0;
        paced.block_size = 32;
        let good = dir.join("paced.json");
        std::fs::write(&good, serde_json::to_string(&paced).unwrap()).unwrap();
        assert_eq!(load_profile(good.to_str().unwrap()).unwrap(), paced);
        paced.per_seq_ms = -1.0;
        let bad = dir.join("bad.json");
        std::fs::write(&bad, serde_json::to_string(&paced).unwrap()).unwrap();
        assert!(load_profile(bad.to_str().unwrap()).unwrap_err().to_string().contains("per_seq_ms"));
        assert!(load_profile("no-such-profile").unwrap_err().to_string().contains("unknown profile"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
