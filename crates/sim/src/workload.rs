//! Workloads: who asks for what, when.
//!
//! Prompts are described compactly as segments of deterministic synthetic tokens
//! ([`kvgate_core::hashing::synthetic_tokens`]); two requests that share a segment share its exact
//! tokens, which is what engines' prefix caches and KV events see. Tokens are produced only when a
//! request arrives, so a 12k-request trace of 12k-token prompts stays small in memory.

use std::io::BufRead;
use std::path::Path;
use std::time::Duration;

use kvgate_core::hashing::{digest_str, synthetic_tokens};
use kvgate_core::Timestamp;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::SimError;

/// Tokens per Mooncake hash id (`shared/data/README.md`).
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// A run of synthetic tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Seed of the tokens; equal seeds give equal tokens.
    pub seed: u64,
    /// Tokens taken from the start of the seed's expansion.
    pub len: u32,
}

/// A prompt as a list of segments.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptSpec {
    /// The segments, in order.
    pub segments: Vec<Segment>,
}

impl PromptSpec {
    /// Prompt length in tokens.
    pub fn len(&self) -> u64 {
        self.segments.iter().map(|s| s.len as u64).sum()
    }

    /// Whether the prompt is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The prompt's tokens.
    pub fn tokens(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len() as usize);
        for s in &self.segments {
            out.extend(synthetic_tokens(s.seed, s.len as usize));
        }
        out
    }
}

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// When it reaches the router.
    pub arrival: Timestamp,
    /// Its prompt.
    pub prompt: PromptSpec,
    /// Tokens it generates (its `max_tokens`).
    pub output_tokens: u32,
    /// Whether it carries the scenario's hot prefix.
    pub hot: bool,
    /// Background load placed directly on an engine before the measured traffic (not routed, not
    /// reported).
    pub direct_to: Option<usize>,
    /// Sent only once earlier requests have ended (a client that waits for its answer), `arrival`
    /// then being unused; `None`: sent at `arrival`.
    pub after: Option<After>,
    /// Routed like the rest but not reported (a request that sets the scene, as a real client's
    /// warm-up).
    pub warm_up: bool,
}

/// What a closed-loop request waits for before it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// `gap` after request `index` ended (its client's previous request).
    Request {
        /// The request waited for.
        index: usize,
        /// Time from its end to this one's arrival.
        gap: Duration,
    },
    /// `gap` after every request listed before `index` ended (the fleet idle between bursts).
    AllBefore {
        /// The requests waited for are those listed before this index.
        index: usize,
        /// Time from the last one's end to this one's arrival.
        gap: Duration,
    },
}

/// A generated workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Scenario name.
    pub name: String,
    /// Engines in the fleet.
    pub workers: usize,
    /// Requests sorted by arrival.
    pub requests: Vec<SimRequest>,
    /// The engine that owns the hot prefix at the start, if the scenario has one.
    pub hot_owner: Option<usize>,
}

impl Workload {
    /// Spreads requests that share an arrival instant evenly over the time until the next distinct
    /// arrival. Recorded traces round their timestamps (the Mooncake conversation trace to 3 s ticks,
    /// about 10 requests each, up to 28): replayed as recorded, every tick is a burst of truly
    /// simultaneous requests, which several router replicas cannot tell each other about in time,
    /// however fast their bus. The last instant's requests stay together.
    pub fn spread_ticks(&mut self) {
        self.replace_ticks(|at, gap, k, same| at + gap * k as u64 / same as u64);
    }

    /// Places the requests a trace records at one instant at uniform random instants (drawn from
    /// `seed`) between it and the next recorded instant. Each seed is then one plausible arrival
    /// order behind the trace's rounded timestamps. The last instant's requests stay together.
    pub fn jitter_ticks(&mut self, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7469_636b);
        self.replace_ticks(|at, gap, _, _| at + rng.random_range(0..gap));
    }

    /// Moves the `same` requests of each recorded instant `at` (µs) to `place(at, gap, k, same)`
    /// for the k-th of them, `gap` being the time to the next instant; then re-sorts.
    fn replace_ticks(&mut self, mut place: impl FnMut(u64, u64, usize, usize) -> u64) {
        let mut i = 0;
        while i < self.requests.len() {
            let at = self.requests[i].arrival;
            let same = self.requests[i..].iter().take_while(|r| r.arrival == at).count();
            if let Some(next) = self.requests.get(i + same).map(|r| r.arrival) {
                let gap = next.0 - at.0;
                for (k, r) in self.requests[i..i + same].iter_mut().enumerate() {
                    r.arrival = Timestamp(place(at.0, gap, k, same));
                }
            }
            i += same;
        }
        self.requests.sort_by_key(|r| r.arrival);
    }
}

/// Knobs every synthetic scenario takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadParams {
    /// Engines (`None`: the scenario's default).
    pub workers: Option<usize>,
    /// Arrivals per second (`None`: the scenario's default).
    pub rate: Option<f64>,
    /// Seconds of arrivals (`None`: the scenario's default).
    pub duration_s: Option<f64>,
    /// Seed of the arrival process and of request contents.
    pub seed: u64,
}

fn poisson_arrivals(rng: &mut ChaCha8Rng, rate: f64, duration_s: f64, start_s: f64) -> Vec<Timestamp> {
    let mut t = start_s;
    let mut out = Vec::new();
    loop {
        let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        t += -u.ln() / rate;
        if t >= start_s + duration_s {
            return out;
        }
        out.push(Timestamp::from_secs_f64(t));
    }
}

fn unique(seed: u64, what: &str, i: u64) -> u64 {
    digest_str(what) ^ seed.rotate_left(29) ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Tokens of the incident's hot prefix (a long shared system prompt).
pub const HOT_PREFIX_TOKENS: u32 = 8192;

/// `hot-prefix-51`: the production incident. Engine 0 holds the hot prefix and a KV-bound backlog
/// (about 38 running and 109 waiting long conversations) when a burst of streaming chat requests that
/// share the prefix arrives; the other engines are idle.
pub fn hot_prefix_51(p: WorkloadParams) -> Workload {
    let workers = p.workers.unwrap_or(51);
    let rate = p.rate.unwrap_or(60.0);
    let duration = p.duration_s.unwrap_or(30.0);
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let hot = Segment { seed: digest_str("hot-prefix-51/system"), len: HOT_PREFIX_TOKENS };
    let mut requests = Vec::new();
    // The owner's backlog: long conversations on the hot system prompt whose KV use (~12.5k tokens
    // each) lets about 38 of them run at once on a 500k-token engine; the rest wait.
    for i in 0..148u64 {
        requests.push(SimRequest {
            arrival: Timestamp::ZERO,
            prompt: PromptSpec { segments: vec![hot, Segment { seed: unique(p.seed, "backlog", i), len: 12_000 }] },
            output_tokens: 512,
            hot: false,
            direct_to: Some(0),
            after: None,
            warm_up: false,
        });
    }
    // The burst starts once the owner has published the prefix and filled its batch.
    for (i, at) in poisson_arrivals(&mut rng, rate, duration, 2.0).into_iter().enumerate() {
        requests.push(SimRequest {
            arrival: at,
            prompt: PromptSpec { segments: vec![hot, Segment { seed: unique(p.seed, "chat", i as u64), len: 200 }] },
            output_tokens: 256,
            hot: true,
            direct_to: None,
            after: None,
            warm_up: false,
        });
    }
    Workload { name: "hot-prefix-51".into(), workers, requests, hot_owner: Some(0) }
}

/// The incident's bursts as `scripts/real-engines/incident-client.py` sends them to a real fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IncidentBursts {
    /// Engines in the fleet.
    pub workers: usize,
    /// Tokens of the hot prefix every request starts with.
    pub prefix_tokens: u32,
    /// Tokens of each request's own question after it.
    pub question_tokens: u32,
    /// Tokens each request generates.
    pub output_tokens: u32,
    /// Clients sending at once, each its next request when its answer is complete.
    pub clients: usize,
    /// Requests in a burst.
    pub per_burst: usize,
    /// Bursts, each sent once the one before has ended.
    pub bursts: usize,
    /// Time from a burst's last answer to the next burst (the client waits for the fleet to idle).
    pub settle: Duration,
    /// Seed of the questions.
    pub seed: u64,
}

/// `incident-bursts`: the incident's shape as the real-fleet bench sends it. One request of the
/// hot prefix makes an engine its owner (a warm-up, not reported); then `bursts` bursts of
/// `per_burst` requests that share the prefix, each with its own question, from `clients` closed-loop
/// clients: client k sends the burst's requests k, k + clients, ..., each once its previous answer
/// is complete, and a burst starts `settle` after the one before has ended.
pub fn incident_bursts(p: IncidentBursts) -> Workload {
    let hot = Segment { seed: digest_str("incident-bursts/prefix"), len: p.prefix_tokens };
    let with_question = |what: &str, i: u64, len: u32| PromptSpec {
        segments: vec![hot, Segment { seed: unique(p.seed, what, i), len }],
    };
    let mut requests = vec![SimRequest {
        arrival: Timestamp::ZERO,
        prompt: with_question("incident/warm-up", 0, 4),
        output_tokens: 1,
        hot: true,
        direct_to: None,
        after: None,
        warm_up: true,
    }];
    let clients = p.clients.max(1);
    for _ in 0..p.bursts {
        let first = requests.len();
        for j in 0..p.per_burst {
            let after = if j < clients {
                After::AllBefore { index: first, gap: p.settle }
            } else {
                After::Request { index: first + j - clients, gap: Duration::ZERO }
            };
            let i = requests.len() as u64;
            requests.push(SimRequest {
                arrival: Timestamp::ZERO,
                prompt: with_question("incident/question", i, p.question_tokens),
                output_tokens: p.output_tokens,
                hot: true,
                direct_to: None,
                after: Some(after),
                warm_up: false,
            });
        }
    }
    Workload { name: "incident-bursts".into(), workers: p.workers, requests, hot_owner: None }
}

/// `multi-prefix`: several hot prefixes of different lengths with Zipf popularity (s = 1.1); each
/// request adds a unique suffix. Prefix 0, the most popular, is the tracked hot prefix.
pub fn multi_prefix(p: WorkloadParams) -> Workload {
    const PREFIXES: [u32; 8] = [12_288, 4_096, 8_192, 2_048, 16_384, 6_144, 3_072, 10_240];
    let workers = p.workers.unwrap_or(16);
    let rate = p.rate.unwrap_or(60.0);
    let duration = p.duration_s.unwrap_or(60.0);
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let weights: Vec<f64> = (1..=PREFIXES.len()).map(|k| 1.0 / (k as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    let mut requests = Vec::new();
    for (i, at) in poisson_arrivals(&mut rng, rate, duration, 0.0).into_iter().enumerate() {
        let mut x = rng.random::<f64>() * total;
        let k = weights.iter().position(|w| {
            x -= w;
            x < 0.0
        });
        let k = k.unwrap_or(PREFIXES.len() - 1);
        let prefix = Segment { seed: digest_str(&format!("multi-prefix/{k}")), len: PREFIXES[k] };
        let suffix = Segment { seed: unique(p.seed, "multi", i as u64), len: rng.random_range(100..1000) };
        requests.push(SimRequest {
            arrival: at,
            prompt: PromptSpec { segments: vec![prefix, suffix] },
            output_tokens: rng.random_range(50..500),
            hot: k == 0,
            direct_to: None,
            after: None,
            warm_up: false,
        });
    }
    Workload { name: "multi-prefix".into(), workers, requests, hot_owner: None }
}

/// Agent types of the `agentic` scenario: each has its own system prompt (instructions and tool
/// schemas), of this many tokens; popularity is Zipf (s = 1).
const AGENT_SYSTEM_PROMPTS: [u32; 6] = [6_144, 3_072, 4_096, 8_192, 2_048, 5_120];

/// `agentic`: tool-using agent sessions. Sessions start as a Poisson process (default 6 a second for
/// 120 s on 16 engines), each on one of six shared system prompts. A session runs 1 + a
/// geometric number of turns (mean 6, at most 24); every turn resends the whole conversation so far
/// (system prompt, task, then each earlier turn's model output and tool result) and adds the newest
/// tool result, so a session grows its own prefix turn by turn. Between turns the agent waits for
/// its tool (think time, exponential, mean 2 s) after the model's answer; the answer's time is
/// allowed for as 0.5 s plus 30 ms per output token, so the arrivals are fixed in advance (an
/// open-loop replay, like a trace) rather than reacting to the policy's latency.
pub fn agentic(p: WorkloadParams) -> Workload {
    let workers = p.workers.unwrap_or(16);
    let rate = p.rate.unwrap_or(6.0);
    let duration = p.duration_s.unwrap_or(120.0);
    let mut rng = ChaCha8Rng::seed_from_u64(p.seed);
    let weights: Vec<f64> = (1..=AGENT_SYSTEM_PROMPTS.len()).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut requests = Vec::new();
    for (session, start) in poisson_arrivals(&mut rng, rate, duration, 0.0).into_iter().enumerate() {
        let session = session as u64;
        let mut x = rng.random::<f64>() * total;
        let agent = weights
            .iter()
            .position(|w| {
                x -= w;
                x < 0.0
            })
            .unwrap_or(AGENT_SYSTEM_PROMPTS.len() - 1);
        let mut segments = vec![
            Segment { seed: digest_str(&format!("agentic/system/{agent}")), len: AGENT_SYSTEM_PROMPTS[agent] },
            Segment { seed: unique(p.seed, "agentic/task", session), len: rng.random_range(200..1500) },
        ];
        let mut turns = 1u32;
        while turns < 24 && rng.random::<f64>() < 5.0 / 6.0 {
            turns += 1;
        }
        let mut at = start.saturating_since(Timestamp::ZERO).as_secs_f64();
        for turn in 0..u64::from(turns) {
            let output_tokens = rng.random_range(50..400);
            requests.push(SimRequest {
                arrival: Timestamp::from_secs_f64(at),
                prompt: PromptSpec { segments: segments.clone() },
                output_tokens,
                hot: agent == 0,
                direct_to: None,
                after: None,
                warm_up: false,
            });
            let key = session << 8 | turn;
            segments.push(Segment { seed: unique(p.seed, "agentic/output", key), len: output_tokens });
            segments.push(Segment { seed: unique(p.seed, "agentic/tool", key), len: rng.random_range(100..2500) });
            let think = -rng.random::<f64>().max(f64::MIN_POSITIVE).ln() * 2.0;
            at += 0.5 + 0.03 * f64::from(output_tokens) + think;
        }
    }
    requests.sort_by_key(|r| r.arrival);
    Workload { name: "agentic".into(), workers, requests, hot_owner: None }
}

#[derive(Deserialize)]
struct MooncakeRow {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Replays a Mooncake trace: arrivals at `timestamp / speedup`, each hash id expanded into 512
/// deterministic tokens seeded by the id (the last block cut to `input_length`). Requests whose first
/// hash id is 0 (the shared system prompt) are the tracked hot prefix.
pub fn mooncake(path: &Path, workers: usize, speedup: f64, limit: Option<usize>) -> Result<Workload, SimError> {
    mooncake_with_blocks(path, workers, speedup, limit, MOONCAKE_BLOCK_TOKENS)
}

/// [`mooncake`] with each hash id standing for `block_tokens` tokens, as the real-engine benches
/// replay the trace (`scripts/real-engines/bench.sh`, 32 tokens a hash id).
pub fn mooncake_with_blocks(
    path: &Path,
    workers: usize,
    speedup: f64,
    limit: Option<usize>,
    block_tokens: u32,
) -> Result<Workload, SimError> {
    let block_tokens = u64::from(block_tokens.max(1));
    let file = std::fs::File::open(path).map_err(|e| SimError::Trace(format!("{}: {e}", path.display())))?;
    let mut requests = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| requests.len() >= l) {
            break;
        }
        let line = line.map_err(|e| SimError::Trace(format!("{}: {e}", path.display())))?;
        if line.trim().is_empty() {
            continue;
        }
        let row: MooncakeRow = serde_json::from_str(&line)
            .map_err(|e| SimError::Trace(format!("{} line {}: {e}", path.display(), n + 1)))?;
        let mut left = row.input_length;
        let mut segments = Vec::with_capacity(row.hash_ids.len());
        for id in &row.hash_ids {
            if left == 0 {
                break;
            }
            let len = left.min(block_tokens) as u32;
            segments.push(Segment { seed: digest_str("mooncake") ^ id.wrapping_mul(0x2545_f491_4f6c_dd1d), len });
            left -= len as u64;
        }
        if left > 0 {
            segments.push(Segment { seed: unique(0, "mooncake-tail", n as u64), len: left as u32 });
        }
        requests.push(SimRequest {
            arrival: Timestamp::from_secs_f64(row.timestamp / 1000.0 / speedup),
            prompt: PromptSpec { segments },
            output_tokens: row.output_length.clamp(1, u32::MAX as u64) as u32,
            hot: row.hash_ids.first() == Some(&0),
            direct_to: None,
            after: None,
            warm_up: false,
        });
    }
    Ok(trace_workload("mooncake", path, workers, requests))
}

/// Replays an Azure LLM inference trace (`TIMESTAMP,ContextTokens,GeneratedTokens`): unique prompts,
/// no prefix sharing: a load-only workload.
pub fn azure(path: &Path, workers: usize, speedup: f64, limit: Option<usize>) -> Result<Workload, SimError> {
    let file = std::fs::File::open(path).map_err(|e| SimError::Trace(format!("{}: {e}", path.display())))?;
    let mut requests = Vec::new();
    let mut first: Option<f64> = None;
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| SimError::Trace(format!("{}: {e}", path.display())))?;
        if n == 0 || line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|l| requests.len() >= l) {
            break;
        }
        let bad = |what: &str| SimError::Trace(format!("{} line {}: {what}: {line:?}", path.display(), n + 1));
        let mut fields = line.split(',');
        let ts = fields.next().and_then(parse_azure_time).ok_or_else(|| bad("bad TIMESTAMP"))?;
        let context: u32 = fields.next().and_then(|f| f.trim().parse().ok()).ok_or_else(|| bad("bad ContextTokens"))?;
        let generated: u32 =
            fields.next().and_then(|f| f.trim().parse().ok()).ok_or_else(|| bad("bad GeneratedTokens"))?;
        let start = *first.get_or_insert(ts);
        requests.push(SimRequest {
            arrival: Timestamp::from_secs_f64((ts - start) / speedup),
            prompt: PromptSpec { segments: vec![Segment { seed: unique(0, "azure", n as u64), len: context.max(1) }] },
            output_tokens: generated.max(1),
            hot: false,
            direct_to: None,
            after: None,
            warm_up: false,
        });
    }
    Ok(trace_workload("azure", path, workers, requests))
}

/// A replayed trace's workload, requests in arrival order.
fn trace_workload(kind: &str, path: &Path, workers: usize, mut requests: Vec<SimRequest>) -> Workload {
    requests.sort_by_key(|r| r.arrival);
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("trace");
    Workload { name: format!("{kind}:{file}"), workers, requests, hot_owner: None }
}

/// Seconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]`.
fn parse_azure_time(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (hh, mm) = (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    let ss = t.next()?.parse::<f64>().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_mooncake_hash_id_stands_for_the_block_tokens_asked_for() {
        let path = std::env::temp_dir().join(format!("kvgate-mooncake-blocks-{}.jsonl", std::process::id()));
        let rows = concat!(
            r#"{"timestamp": 0, "input_length": 64, "output_length": 5, "hash_ids": [0, 7]}"#,
            "\n",
            r#"{"timestamp": 1000, "input_length": 80, "output_length": 5, "hash_ids": [0, 7]}"#,
            "\n"
        );
        std::fs::write(&path, rows).unwrap();
        let lens = |w: &Workload| -> Vec<Vec<u32>> {
            w.requests.iter().map(|r| r.prompt.segments.iter().map(|s| s.len).collect()).collect()
        };
        let at_32 = super::mooncake_with_blocks(&path, 2, 1.0, None, 32).unwrap();
        // Each id a block of 32; what the ids leave over is a segment of the row's own.
        assert_eq!(lens(&at_32), vec![vec![32, 32], vec![32, 32, 16]]);
        assert_eq!(at_32.requests[0].prompt.segments[1].seed, at_32.requests[1].prompt.segments[1].seed);
        let at_512 = super::mooncake(&path, 2, 1.0, None).unwrap();
        assert_eq!(lens(&at_512), vec![vec![64], vec![80]]);
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn requests_of_one_instant_are_spread_until_the_next() {
        let at = |ms: &[u64]| Workload {
            name: "t".into(),
            workers: 1,
            requests: ms
                .iter()
                .map(|&m| SimRequest {
                    arrival: Timestamp::from_millis(m),
                    prompt: PromptSpec { segments: Vec::new() },
                    output_tokens: 1,
                    hot: false,
                    direct_to: None,
                    after: None,
                    warm_up: false,
                })
                .collect(),
            hot_owner: None,
        };
        let mut w = at(&[0, 0, 0, 0, 3000, 6000, 6000]);
        w.spread_ticks();
        let got: Vec<u64> = w.requests.iter().map(|r| r.arrival.as_micros() / 1000).collect();
        assert_eq!(got, [0, 750, 1500, 2250, 3000, 6000, 6000], "the last instant has no next to spread to");
    }

    use super::*;

    #[test]
    fn azure_timestamps_parse_to_seconds() {
        let a = parse_azure_time("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_azure_time("2023-11-17 00:00:00").unwrap();
        assert!((b - a - (5.0 * 3600.0 + 44.0 * 60.0 + 13.31941)).abs() < 1e-3);
        assert_eq!(parse_azure_time("2023-01-01 00:00:00").unwrap(), 1_672_531_200.0);
        assert!(parse_azure_time("garbage").is_none());
    }

    #[test]
    fn shared_segments_give_shared_tokens() {
        let w = multi_prefix(WorkloadParams { workers: None, rate: Some(50.0), duration_s: Some(5.0), seed: 1 });
        let hot: Vec<_> = w.requests.iter().filter(|r| r.hot).take(2).collect();
        assert_eq!(hot.len(), 2);
        let (a, b) = (hot[0].prompt.tokens(), hot[1].prompt.tokens());
        assert_eq!(a[..12_288], b[..12_288]);
        assert_ne!(a[12_288..12_300], b[12_288..12_300]);
    }

    #[test]
    fn agentic_sessions_grow_their_own_prefix_turn_by_turn() {
        let w = agentic(WorkloadParams { workers: None, rate: Some(0.5), duration_s: Some(20.0), seed: 3 });
        assert!(w.requests.windows(2).all(|p| p[0].arrival <= p[1].arrival));
        // Group the turns of each session by their task segment; each turn extends the one before.
        let mut sessions: std::collections::HashMap<u64, Vec<&SimRequest>> = Default::default();
        for r in &w.requests {
            sessions.entry(r.prompt.segments[1].seed).or_default().push(r);
        }
        assert!(sessions.len() >= 5, "{} sessions", sessions.len());
        assert!(sessions.values().any(|t| t.len() >= 3), "some session has several turns");
        let systems: std::collections::HashSet<u64> = w.requests.iter().map(|r| r.prompt.segments[0].seed).collect();
        assert!(systems.len() >= 2, "several shared system prompts");
        for turns in sessions.values() {
            for pair in turns.windows(2) {
                let (a, b) = (&pair[0].prompt.segments, &pair[1].prompt.segments);
                assert_eq!(&b[..a.len()], &a[..], "a turn resends the conversation so far");
                assert_eq!(b.len(), a.len() + 2, "and adds the model's answer and a tool result");
                assert_eq!(b[a.len()].len, pair[0].output_tokens, "the answer is as long as the output");
                assert!(pair[1].arrival > pair[0].arrival, "after a think time");
            }
        }
    }

    #[test]
    fn hot_prefix_scenario_has_the_owner_backlog_and_a_burst() {
        let w = hot_prefix_51(WorkloadParams { workers: None, rate: None, duration_s: Some(10.0), seed: 3 });
        assert_eq!(w.workers, 51);
        assert_eq!(w.requests.iter().filter(|r| r.direct_to == Some(0)).count(), 148);
        let burst = w.requests.iter().filter(|r| r.hot).count();
        assert!((450..750).contains(&burst), "{burst}");
    }
}
