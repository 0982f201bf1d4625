//! `kvgate demo` and `kvgate mock-engine`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use kvgate_demo::DemoConfig;
use kvgate_engine_model::EngineProfile;
use kvgate_mock_engine::{EventFormat, Faults, MockConfig, MockEngine};

use crate::sim::Format;

/// The engines the demo runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoEngines {
    /// kvgate's mock engines, in process (no set-up, no GPU).
    Mock,
    /// Real vLLM engines on the CPU with a tiny model, set up by scripts/real-engines/setup.sh
    /// (about 3.4 GB the first time) and started once; their prefix caches are reset before each run.
    Vllm,
    /// Real SGLang engines on the CPU with the same model, set up by the same script (about 7 GB the
    /// first time); their prefix caches are flushed before each run.
    Sglang,
}

impl DemoEngines {
    /// The real runtime these engines are, if they are real.
    fn runtime(self) -> Option<kvgate_real_engines::fleet::Runtime> {
        use kvgate_real_engines::fleet::Runtime;
        match self {
            DemoEngines::Mock => None,
            DemoEngines::Vllm => Some(Runtime::Vllm),
            DemoEngines::Sglang => Some(Runtime::Sglang),
        }
    }
}

/// Flags of `kvgate demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Which engines: mock (default), vllm or sglang.
    #[arg(long, value_enum, default_value_t = DemoEngines::Mock)]
    engines: DemoEngines,
    /// Engines [default: 8 mock; vllm, sglang: one per CPU core, 2 to 4].
    #[arg(long)]
    workers: Option<usize>,
    /// Seconds of traffic per run [default: 10 mock, 20 vllm or sglang].
    #[arg(long)]
    duration: Option<f64>,
    /// Requests per second [default: 50 mock; vllm, sglang: 1.5 per engine].
    #[arg(long)]
    rate: Option<f64>,
    /// Engine model speed-up (1: the engines run at the modelled speed).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Seed of arrivals and contents.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Policy entries to run, as `kvgate sim --compare` names them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "projected:off,projected:shadow,projected:enforce,cache_aware_seeded"
    )]
    runs: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
    /// Write per-engine queue depth over time and TTFT percentiles to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Mock engines serve SMG's gRPC worker protocol and the gateway takes them as `grpc://`
    /// workers (tokenizer from a worker, KV events and load on its stream). Prompts are then
    /// tokenized by the mock model's tokenizer, so their token counts differ from HTTP mode's: the
    /// system prompts are halved to keep them about the same.
    #[arg(long)]
    grpc: bool,
}

/// Sets up and starts the real fleet for `kvgate demo --engines vllm|sglang`.
fn start_real_fleet(
    runtime: kvgate_real_engines::fleet::Runtime,
    workers: usize,
) -> anyhow::Result<kvgate_real_engines::fleet::Fleet> {
    use kvgate_real_engines::fleet::{repo_root, EngineSpec, Fleet};
    use kvgate_real_engines::pacing::Pacing;
    let setup = repo_root().join("scripts/real-engines/setup.sh");
    if !setup.exists() {
        bail!("--engines {runtime} runs from the kvgate source tree ({} is missing)", setup.display());
    }
    eprintln!("setting up vLLM and SGLang for CPU and the tiny model (scripts/real-engines/setup.sh)...");
    let status = std::process::Command::new("bash").arg(&setup).status().context("cannot run setup.sh")?;
    if !status.success() {
        bail!("scripts/real-engines/setup.sh failed");
    }
    eprintln!("starting {workers} {runtime} engines, paced like GPUs (about a minute)...");
    // 4,096 tokens of KV each: small enough that the hot prefix's owner queues under the burst.
    // Paced (crates/real-engines/src/pacing.rs): engines that share the machine's cores would
    // otherwise not be independent, as engines on their own GPUs are: one that looks idle has no
    // capacity of its own while the others compute, and every policy that spreads work pays for
    // it (unpaced, four engines on two cores gave `enforce` a TTFT p90 of 2.7–5.0 s against
    // `cache_aware_seeded`'s 1.8–2.8, docs/mock-engine.md).
    let specs = (0..workers)
        .map(|i| EngineSpec::new(&format!("demo{i}"), 4_096).on(runtime).paced(Pacing::cpu_default()))
        .collect();
    Fleet::start(specs, Duration::from_secs(600))
}

/// The CPU cores this process may use (1 if unknown).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Runs `kvgate demo`.
pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    let real = a.engines.runtime();
    let is_real = real.is_some();
    let base = if is_real { DemoConfig::for_real_engines() } else { DemoConfig::default() };
    let workers = match a.workers {
        Some(n) => n,
        None => base.workers,
    };
    // Real engines are offered the same load each, however many there are.
    let default_rate = if is_real { base.rate / base.workers as f64 * workers as f64 } else { base.rate };
    let (duration, rate) = (a.duration.unwrap_or(base.duration_s), a.rate.unwrap_or(default_rate));
    if workers == 0 || workers > 64 || (is_real && workers > 8) {
        bail!("--workers must be between 1 and 64 (at most 8 real engines)");
    }
    let in_range = |v: f64, max: f64| v > 0.0 && v <= max;
    if !in_range(duration, 3600.0) || !in_range(rate, 1000.0) || !in_range(a.speedup, 100.0) {
        bail!("--duration must be in (0, 3600], --rate in (0, 1000] and --speedup in (0, 100]");
    }
    if is_real && a.speedup != 1.0 {
        bail!("--speedup applies to mock engines only: real engines run at their own speed");
    }
    if is_real && workers > 2 * cores() {
        eprintln!(
            "note: {workers} paced engines share {} CPU cores: their own compute may outrun their modeled \
             steps (each engine's steps are in its *.pace.jsonl log)",
            cores()
        );
    }
    if a.grpc && is_real {
        bail!(
            "--grpc runs the demo on mock gRPC workers; real vLLM and SGLang gRPC workers run in the real-engine \
             suite (scripts/real-engines/test.sh grpc)"
        );
    }
    let cfg = DemoConfig {
        workers,
        grpc: a.grpc,
        prefix_scale: if a.grpc { base.prefix_scale * 0.5 } else { base.prefix_scale },
        duration_s: duration,
        rate,
        speedup: a.speedup,
        seed: a.seed,
        runs: a.runs.clone(),
        timeline: a.plot.is_some(),
        ..base
    };
    let fleet = match real {
        Some(runtime) => Some(Arc::new(start_real_fleet(runtime, workers)?)),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let per_run = kvgate_demo::requests_per_run(&cfg) as u64;
    let reports = runtime.block_on(async {
        let mut reports = Vec::new();
        for (i, entry) in cfg.runs.iter().enumerate() {
            let progress = Arc::new(AtomicU64::new(0));
            let interactive = std::io::IsTerminal::is_terminal(&std::io::stderr());
            if !interactive {
                eprintln!("[{}/{}] {entry}: {per_run} requests", i + 1, cfg.runs.len());
            }
            let bar = interactive.then(|| {
                let (progress, entry, n) = (progress.clone(), entry.clone(), cfg.runs.len());
                tokio::spawn(async move {
                    loop {
                        let done = progress.load(Ordering::Relaxed).min(per_run);
                        let width = 30;
                        let filled = (done * width / per_run.max(1)) as usize;
                        eprint!(
                            "\r[{}/{n}] {entry:<20} [{}{}] {done}/{per_run} requests",
                            i + 1,
                            "#".repeat(filled),
                            ".".repeat(width as usize - filled)
                        );
                        let _ = std::io::stderr().flush();
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                })
            });
            let report = kvgate_demo::run_one_on(&cfg, entry, progress, fleet.clone()).await;
            if let Some(bar) = bar {
                bar.abort();
                eprintln!();
            }
            reports.push(report.map_err(|e| anyhow::anyhow!("{entry}: {e}"))?);
        }
        Ok::<_, anyhow::Error>(reports)
    })?;
    drop(fleet);
    let header = if is_real {
        format!(
            "kvgate demo: {} real {} engines (CPU, tiny model) over loopback HTTP, {per_run} requests per run",
            cfg.workers,
            a.engines.runtime().map_or("", |r| r.name())
        )
    } else {
        format!(
            "kvgate demo: {} mock engines over loopback {}, {per_run} requests per run, speed-up {}",
            cfg.workers,
            if cfg.grpc { "gRPC (SMG's worker protocol)" } else { "HTTP" },
            cfg.speedup
        )
    };
    crate::sim::write_reports(&reports, a.plot.as_deref(), a.format, false, &header)?;
    if a.format == Format::Table {
        println!("(maxQ: the busiest engine's peak waiting queue; owner: share of the hottest prompt sent to its first owner)");
    }
    Ok(())
}

/// Flags of `kvgate mock-engine`.
#[derive(Debug, Args)]
pub struct MockEngineArgs {
    /// Address to listen on (HTTP, gRPC and ZMQ).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// HTTP port, or the gRPC port with --grpc (0: any).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Serve SMG's gRPC worker protocol (as --event-format's runtime serves it: token ids in and out, KV
    /// events and load on its SubscribeKvEvents stream, the mock model's tokenizer on
    /// GetTokenizer) instead of the OpenAI HTTP API; a gateway takes it as `grpc://HOST:PORT`.
    #[arg(long)]
    grpc: bool,
    /// With --grpc: the port of the HTTP surface that stays (admin, /metrics, /v1/loads; 0: any).
    #[arg(long, default_value_t = 0)]
    http_port: u16,
    /// KV-event PUB port (0: any).
    #[arg(long, default_value_t = 5557)]
    kv_port: u16,
    /// Replay ROUTER port (0: any).
    #[arg(long, default_value_t = 5558)]
    replay_port: u16,
    /// Engine profile: llama3-8b-h100 (b, default, block 16) or large-moe-h200 (a, block 64).
    #[arg(long, default_value = "llama3-8b-h100")]
    profile: String,
    /// Model time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// KV-event wire format: vllm or sglang.
    #[arg(long, default_value = "vllm")]
    event_format: String,
    /// Model name served.
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// Fraction of live KV batches to drop (replays keep them).
    #[arg(long, default_value_t = 0.0)]
    drop_events: f64,
    /// Milliseconds to delay every live KV batch.
    #[arg(long, default_value_t = 0)]
    delay_events_ms: u64,
    /// Fraction of requests to fail with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    fail_requests: f64,
    /// Seed of block hashes and injected failures.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Runs `kvgate mock-engine` until Ctrl-C.
pub fn mock_engine(a: MockEngineArgs) -> anyhow::Result<()> {
    let profile = EngineProfile::by_name(&a.profile).with_context(|| format!("unknown profile {:?}", a.profile))?;
    let format = match a.event_format.as_str() {
        "vllm" => EventFormat::Vllm,
        "sglang" => EventFormat::Sglang,
        other => bail!("--event-format must be vllm or sglang, not {other:?}"),
    };
    let cfg = MockConfig {
        host: a.host,
        port: a.port,
        kv_port: a.kv_port,
        replay_port: a.replay_port,
        profile,
        speedup: a.speedup,
        format,
        model: a.model,
        faults: Faults {
            drop_events: a.drop_events,
            delay_events: Duration::from_millis(a.delay_events_ms),
            fail_requests: a.fail_requests,
        },
        seed: a.seed,
        grpc: a.grpc,
        http_port: a.http_port,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        let engine = MockEngine::start(cfg).await.map_err(|e| anyhow::anyhow!(e))?;
        if a.grpc {
            println!(
                "mock engine: grpc {}  http {}  kv_events {}  replay {}  block_size {}",
                engine.url, engine.http_url, engine.kv_events, engine.replay, engine.block_size
            );
        } else {
            println!(
                "mock engine: http {}  kv_events {}  replay {}  block_size {}",
                engine.url, engine.kv_events, engine.replay, engine.block_size
            );
        }
        tokio::signal::ctrl_c().await?;
        engine.kill();
        Ok(())
    })
}
