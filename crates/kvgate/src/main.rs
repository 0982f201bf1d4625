//! The `kvgate` command: one binary for every job. It parses flags and hands off; the work lives in
//! the library crates.

mod decide;
mod demo;
mod serve;
mod sim;
mod smg;

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// The gateway allocates and frees small buffers for every request (headers, bodies, JSON);
/// mimalloc's thread-local free lists make that cheaper than glibc's malloc (docs/benchmarks-gateway.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// kvgate: an LLM inference gateway that routes each request to the engine where it would finish its
/// prefill soonest, counting cache reuse and load together.
#[derive(Debug, Parser)]
#[command(name = "kvgate", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the routing core on a fleet snapshot (JSON) and print its decisions as JSON.
    ///
    /// The snapshot schema is documented in docs/decide.md; examples/ holds ready-made fleets.
    Decide {
        /// Fleet snapshot file; `-` or nothing reads standard input.
        file: Option<PathBuf>,
        /// Seed of the RNG that breaks exact ties between equally scored workers.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print one line of JSON instead of indented JSON.
        #[arg(long)]
        compact: bool,
    },
    /// Simulate a fleet under a routing policy, deterministically, on the CPU.
    ///
    /// Scenarios: hot-prefix-51, multi-prefix, mooncake (--trace FILE.jsonl), azure (--trace FILE.csv).
    /// See docs/simulator.md.
    Sim(Box<sim::SimArgs>),
    /// Run the gateway: an OpenAI-compatible proxy in front of SGLang or vLLM engines.
    ///
    /// Settings come from --config FILE (TOML), then environment variables, then flags.
    /// See docs/operations.md.
    Serve(Box<serve::ServeArgs>),
    /// Run a mock engine: the simulator's engine model in real time behind SGLang/vLLM endpoints,
    /// with KV events over ZMQ. No GPU needed.
    MockEngine(Box<demo::MockEngineArgs>),
    /// The one-command demo: mock engines and the gateway on loopback, a multi-prefix burst over
    /// real HTTP, once per mode (off, shadow, enforce) and once with the cache_aware baseline.
    Demo(Box<demo::DemoArgs>),
    /// Print an engine profile as JSON: the step-time model and capacity that the simulator, mock
    /// engines and paced real engines (`scripts/real-engines/pacer`) use.
    Profile {
        /// large-moe-h200 (a) or llama3-8b-h100 (b).
        #[arg(default_value = "large-moe-h200")]
        name: String,
        /// Also print, under `paced`, the rates of a real engine paced this many times slower than
        /// the profile (what kvgate's `prefill_tokens_per_s` and `decode_tokens_per_s` should be).
        #[arg(long)]
        scale: Option<f64>,
        /// Print one line of JSON instead of indented JSON.
        #[arg(long)]
        compact: bool,
    },
}

fn main() -> ExitCode {
    // SMG's flags are refused with what to use instead, before clap calls them unknown.
    let mut args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        if let Err(err) = smg::check(&args[2..]) {
            eprintln!("kvgate: {err:#}");
            return ExitCode::from(2);
        }
        args = smg::translate(args);
    }
    let cli = Cli::parse_from(args);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvgate: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Decide { file, seed, compact } => {
            let input = read_input(file.as_deref())?;
            let output = decide::run(&input, seed)?;
            let text = if compact { serde_json::to_string(&output)? } else { serde_json::to_string_pretty(&output)? };
            println!("{text}");
            Ok(())
        }
        Command::Sim(args) => sim::run(*args),
        Command::Serve(args) => serve::run(*args),
        Command::MockEngine(args) => demo::mock_engine(*args),
        Command::Demo(args) => demo::run(*args),
        Command::Profile { name, scale, compact } => {
            let profile = kvgate_engine_model::EngineProfile::by_name(&name).with_context(|| {
                format!("unknown profile {name:?}: expected large-moe-h200 (a) or llama3-8b-h100 (b)")
            })?;
            let mut json = serde_json::to_value(&profile)?;
            if let Some(scale) = scale {
                anyhow::ensure!(scale > 0.0 && scale <= 1000.0, "--scale must be in (0, 1000], not {scale}");
                let pacing = kvgate_real_engines::pacing::Pacing { profile, scale };
                json["paced"] = serde_json::json!({
                    "scale": scale,
                    "prefill_tokens_per_s": pacing.prefill_tokens_per_s().round(),
                    "decode_tokens_per_s": pacing.decode_tokens_per_s().round(),
                });
            }
            let text = if compact { serde_json::to_string(&json)? } else { serde_json::to_string_pretty(&json)? };
            println!("{text}");
            Ok(())
        }
    }
}

fn read_input(file: Option<&std::path::Path>) -> anyhow::Result<String> {
    match file {
        Some(path) if path.as_os_str() != "-" => {
            std::fs::read_to_string(path).with_context(|| format!("cannot read fleet snapshot {}", path.display()))
        }
        _ => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("cannot read the fleet snapshot from standard input")?;
            Ok(s)
        }
    }
}
