//! The engines a demo run talks to: fresh mock engines in process, or a real vLLM or SGLang fleet
//! whose prefix caches are emptied before each run.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvgate_mock_engine::{MockConfig, MockEngine};
use kvgate_real_engines::fleet::Fleet;
use kvgate_real_engines::gateway::{engine_metric, http};

use crate::DemoConfig;

/// Per-engine counters between two moments of a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    /// Prompt tokens looked up in the prefix cache.
    pub prompt_tokens: u64,
    /// Of those, served from it.
    pub cached_tokens: u64,
    /// Requests finished.
    pub finished: u64,
}

/// The engines of one run.
#[derive(Clone)]
pub enum RunEngines {
    /// Mock engines started for this run.
    Mock(Vec<MockEngine>),
    /// A real vLLM or SGLang fleet, shared by every run.
    Real(Arc<Fleet>),
}

/// Rates of unpaced engines, measured on the development machine's CPU for the tiny model on vLLM
/// (docs/benchmarks.md): ~20k prefill tokens/s, ~3k aggregate decode tokens/s at 16 streams.
/// SGLang's engines are given the same: the demo compares policies on one fleet, not the engines
/// with each other. Paced engines are given their pacing's rates.
const REAL_PREFILL_TPS: f64 = 20_000.0;
const REAL_DECODE_TPS: f64 = 3_000.0;

impl RunEngines {
    /// Fresh mock engines, or the real fleet with every prefix cache emptied.
    pub async fn start(cfg: &DemoConfig, fleet: Option<Arc<Fleet>>) -> Result<RunEngines, String> {
        if let Some(fleet) = fleet {
            for e in fleet.http_engines() {
                // vLLM's dev-mode reset or SGLang's flush: the engine publishes AllBlocksCleared, as
                // on a restart.
                kvgate_real_engines::gateway::flush_prefix_cache(e).await.map_err(|e| format!("{e:#}"))?;
                // vLLM publishes AllBlocksCleared with its next scheduler step: give it one, so the
                // run's gateway (which replays the engine's history from 0) ends with an empty view.
                let step =
                    serde_json::json!({"model": kvgate_real_engines::fleet::MODEL, "prompt": "x", "max_tokens": 1});
                let r = http()
                    .post(format!("{}/v1/completions", e.url()))
                    .json(&step)
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !r.status().is_success() {
                    return Err(format!(
                        "engine {}: a one-token request after the reset answered {}",
                        e.spec.name,
                        r.status()
                    ));
                }
            }
            return Ok(RunEngines::Real(fleet));
        }
        let profile = crate::demo_profile();
        let mut engines = Vec::new();
        for i in 0..cfg.workers {
            let mock = MockConfig {
                speedup: cfg.speedup,
                seed: i as u64 + 1,
                profile: profile.clone(),
                grpc: cfg.grpc,
                ..MockConfig::default()
            };
            engines.push(MockEngine::start(mock).await?);
        }
        Ok(RunEngines::Mock(engines))
    }

    /// How many engines.
    pub fn len(&self) -> usize {
        match self {
            RunEngines::Mock(e) => e.len(),
            RunEngines::Real(f) => f.http_engines().len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The served model's name.
    pub fn model(&self) -> &'static str {
        match self {
            RunEngines::Mock(_) => "mock-model",
            RunEngines::Real(_) => kvgate_real_engines::fleet::MODEL,
        }
    }

    /// The gateway's TOML for these engines: block size, tokenizer, and one `[[workers]]` each.
    pub fn gateway_toml(&self, cfg: &DemoConfig) -> String {
        match self {
            RunEngines::Mock(engines) => {
                let profile = crate::demo_profile();
                let mut toml = format!("[server]\nblock_size = {}\n", profile.block_size);
                // The router plans in model seconds; the engines run `speedup` times faster than that.
                let decode = profile.decode_tokens_per_s(profile.max_running as u64, 4096);
                for (i, e) in engines.iter().enumerate() {
                    // A gRPC worker's KV events come on its own stream, and its runtime from the
                    // service it serves.
                    let events = if cfg.grpc {
                        String::new()
                    } else {
                        format!("engine = \"sglang\"\nkv_events = \"{}\"\nreplay = \"{}\"\n", e.kv_events, e.replay)
                    };
                    toml.push_str(&format!(
                        "[[workers]]\nid = \"w{i}\"\nurl = \"{}\"\n{events}prefill_tokens_per_s = {}\ndecode_tokens_per_s = {}\nkv_capacity_tokens = {}\nmax_running_requests = {}\nchunk_tokens = {}\n",
                        e.url,
                        profile.prefill_tokens_per_s * cfg.speedup,
                        decode * cfg.speedup,
                        profile.kv_capacity_tokens,
                        profile.max_running,
                        profile.chunk_budget
                    ));
                }
                toml
            }
            RunEngines::Real(fleet) => {
                let tokenizer = kvgate_real_engines::fleet::model_dir().join("tokenizer.json");
                let mut toml = format!(
                    "[server]\nblock_size = {}\n[tokenizer]\nkind = \"hf\"\npath = \"{}\"\n",
                    kvgate_real_engines::fleet::BLOCK_SIZE,
                    tokenizer.display()
                );
                for (i, e) in fleet.http_engines().into_iter().enumerate() {
                    let (prefill, decode) = e.spec.pacing.as_ref().map_or((REAL_PREFILL_TPS, REAL_DECODE_TPS), |p| {
                        (p.prefill_tokens_per_s(), p.decode_tokens_per_s())
                    });
                    toml.push_str(&format!(
                        "[[workers]]\nid = \"w{i}\"\nurl = \"{}\"\nengine = \"{}\"\nkv_events = \":{}\"\nreplay = \":{}\"\nprefill_tokens_per_s = {prefill:.0}\ndecode_tokens_per_s = {decode:.0}\n",
                        e.url(),
                        e.spec.runtime,
                        e.kv_port,
                        e.replay_port
                    ));
                }
                toml
            }
        }
    }

    /// Every engine's counters now.
    pub async fn counters(&self) -> Result<Vec<Counters>, String> {
        match self {
            RunEngines::Mock(engines) => Ok(engines
                .iter()
                .map(|e| {
                    let (prompt_tokens, cached_tokens) = e.cache_counters();
                    Counters { prompt_tokens, cached_tokens, finished: e.shared.finished.load(Ordering::Relaxed) }
                })
                .collect()),
            RunEngines::Real(fleet) => {
                let mut out = Vec::new();
                for e in fleet.http_engines() {
                    let (url, runtime) = (e.url(), e.spec.runtime);
                    let m = |name: &'static str| engine_metric(&url, name);
                    let read = async {
                        Ok::<_, anyhow::Error>(Counters {
                            prompt_tokens: m(runtime.prompt_tokens_metric()).await? as u64,
                            cached_tokens: m(runtime.cached_tokens_metric()).await? as u64,
                            finished: m(runtime.finished_metric()).await? as u64,
                        })
                    };
                    out.push(read.await.map_err(|err| format!("engine {}: {err:#}", e.spec.name))?);
                }
                Ok(out)
            }
        }
    }

    /// Every engine's waiting queue now.
    pub async fn waiting(&self) -> Vec<u32> {
        match self {
            RunEngines::Mock(engines) => engines.iter().map(|e| e.shared.load.lock().waiting_requests as u32).collect(),
            RunEngines::Real(fleet) => {
                let mut out = Vec::new();
                for e in fleet.http_engines() {
                    out.push(engine_metric(&e.url(), e.spec.runtime.waiting_metric()).await.unwrap_or(0.0) as u32);
                }
                out
            }
        }
    }

    /// Starts a sampler of waiting queues every `every`, for the timeline and the peaks; stop it with
    /// [`Sampler::finish`].
    pub fn sample(&self, every: Duration) -> Sampler {
        let engines = self.clone();
        let samples: Arc<std::sync::Mutex<Timeline>> = Arc::default();
        let out = samples.clone();
        let task = tokio::spawn(async move {
            let start = std::time::Instant::now();
            loop {
                let depths = engines.waiting().await;
                if let Ok(mut s) = out.lock() {
                    s.push((start.elapsed().as_secs_f64(), depths));
                }
                tokio::time::sleep(every).await;
            }
        });
        Sampler { samples, task }
    }

    /// Ends the run: mock engines stop; a real fleet stays up for the next run.
    pub fn finish(&self) {
        if let RunEngines::Mock(engines) = self {
            for e in engines {
                e.kill();
            }
        }
    }

    /// The deepest waiting queue of each engine since the run's counters were reset (mock engines
    /// track it themselves; real ones are sampled).
    pub fn peak_waiting(&self, sampled: &[(f64, Vec<u32>)]) -> Vec<u64> {
        match self {
            RunEngines::Mock(engines) => engines.iter().map(|e| e.shared.max_waiting.load(Ordering::Relaxed)).collect(),
            RunEngines::Real(fleet) => (0..fleet.http_engines().len())
                .map(|i| sampled.iter().filter_map(|(_, d)| d.get(i)).copied().max().unwrap_or(0) as u64)
                .collect(),
        }
    }

    /// Resets the mock engines' own peak trackers at the start of the measured part of a run.
    pub fn reset_peaks(&self) {
        if let RunEngines::Mock(engines) = self {
            for e in engines {
                e.shared.max_waiting.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// `(seconds, per-engine waiting)` samples.
type Timeline = Vec<(f64, Vec<u32>)>;

/// A running queue sampler.
pub struct Sampler {
    samples: Arc<std::sync::Mutex<Timeline>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    /// Stops sampling and returns `(seconds, per-engine waiting)` samples.
    pub fn finish(self) -> Vec<(f64, Vec<u32>)> {
        self.task.abort();
        self.samples.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
}
