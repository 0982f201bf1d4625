//! `kvgate decide`: the routing core on a fleet snapshot, for operators and tests.
//!
//! Named prefixes expand into deterministic tokens; each worker's `kv.cached` entries are fed to the
//! core as real `BlockStored` events (chained runs with parent hashes), so the decision path is the
//! one the gateway runs. Requests are decided one after another at the same instant with their
//! reservations held, as simultaneous arrivals would be.

use std::collections::HashSet;

use anyhow::{anyhow, bail, Context};
use kvgate_core::hashing::{digest_str, synthetic_tokens};
use kvgate_core::{
    Decision, KvState, LoadSnapshot, Mode, Namespace, PolicyConfig, PolicyPatch, RequestId, RouteRequest, Router,
    Timestamp, WorkerConfig, WorkerId, BLOCK_SIZE,
};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Largest prompt (prefix plus suffix) one request may describe.
const MAX_REQUEST_TOKENS: u64 = 2_000_000;
/// Largest cached prefix one worker entry may describe.
const MAX_CACHED_TOKENS: u64 = 10_000_000;
/// Most requests one snapshot may expand into.
const MAX_REQUESTS: u64 = 100_000;
/// Oldest load report a snapshot may describe.
const MAX_AGE_MS: u64 = 1_000_000_000;
/// Blocks per `BlockStored` run when feeding cached prefixes, so parent links are exercised.
const BLOCKS_PER_EVENT: usize = 32;

/// The input document.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetSnapshot {
    #[serde(default = "default_block_size")]
    block_size: u32,
    #[serde(default)]
    policy: PolicyPatch,
    #[serde(default)]
    defaults: Defaults,
    workers: Vec<WorkerInput>,
    requests: Vec<RequestInput>,
}

fn default_block_size() -> u32 {
    BLOCK_SIZE.default as u32
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Defaults {
    prefill_tokens_per_s: Option<f64>,
    decode_tokens_per_s: Option<f64>,
    kv_capacity_tokens: Option<u64>,
    max_running_requests: Option<u64>,
    chunk_tokens: Option<u64>,
    stale_after_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkerInput {
    id: String,
    prefill_tokens_per_s: Option<f64>,
    decode_tokens_per_s: Option<f64>,
    kv_capacity_tokens: Option<u64>,
    max_running_requests: Option<u64>,
    chunk_tokens: Option<u64>,
    #[serde(default = "yes")]
    eligible: bool,
    load: Option<LoadInput>,
    #[serde(default)]
    kv: KvInput,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadInput {
    #[serde(default)]
    waiting_requests: u64,
    #[serde(default)]
    waiting_tokens: u64,
    #[serde(default)]
    running_requests: u64,
    #[serde(default)]
    active_decode_tokens: u64,
    #[serde(default)]
    kv_usage: f64,
    #[serde(default)]
    age_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvInput {
    #[serde(default = "synced")]
    state: String,
    reason: Option<String>,
    #[serde(default)]
    cached: Vec<CachedInput>,
}

impl Default for KvInput {
    fn default() -> Self {
        KvInput { state: synced(), reason: None, cached: Vec::new() }
    }
}

fn synced() -> String {
    "synced".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CachedInput {
    prefix: String,
    tokens: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestInput {
    prefix: Option<String>,
    #[serde(default)]
    prefix_tokens: u64,
    #[serde(default)]
    suffix_tokens: u64,
    #[serde(default = "default_max_tokens")]
    max_tokens: u64,
    #[serde(default = "one")]
    repeat: u64,
}

fn default_max_tokens() -> u64 {
    256
}

fn one() -> u64 {
    1
}

/// The output document.
#[derive(Debug, Serialize)]
pub struct DecideOutput {
    decisions: Vec<DecisionOut>,
}

#[derive(Debug, Serialize)]
struct DecisionOut {
    request: u64,
    worker: WorkerId,
    mode: Mode,
    reason: String,
    load_only_worker: WorkerId,
    enforce_worker: Option<WorkerId>,
    prefill_weight: f64,
    scores: Vec<ScoreOut>,
}

#[derive(Debug, Serialize)]
struct ScoreOut {
    worker: WorkerId,
    projected_s: f64,
    cost_s: f64,
    cached_tokens: u64,
    wait_s: f64,
    decode_s: f64,
    prefill_s: f64,
    barrier_s: f64,
}

impl From<Decision> for DecisionOut {
    fn from(d: Decision) -> Self {
        DecisionOut {
            request: d.request.0,
            worker: d.worker,
            mode: d.mode,
            reason: d.reason.as_str().to_owned(),
            load_only_worker: d.load_only_worker,
            enforce_worker: d.enforce_worker,
            prefill_weight: d.prefill_weight,
            scores: d
                .scores
                .into_iter()
                .map(|s| ScoreOut {
                    worker: s.worker,
                    projected_s: s.projected_s,
                    cost_s: s.cost_s,
                    cached_tokens: s.cached_tokens,
                    wait_s: s.wait_s,
                    decode_s: s.decode_s,
                    prefill_s: s.prefill_s,
                    barrier_s: s.barrier_s,
                })
                .collect(),
        }
    }
}

/// Parses a fleet snapshot, runs the core on it and returns the decisions.
pub fn run(input: &str, seed: u64) -> anyhow::Result<DecideOutput> {
    let snapshot: FleetSnapshot = serde_json::from_str(input).context("invalid fleet snapshot")?;
    let policy = policy_config(&snapshot.policy, &snapshot.defaults)?;
    BLOCK_SIZE.check(snapshot.block_size as f64)?;
    let router = Router::new(snapshot.block_size, policy)?;
    let now = Timestamp::from_millis(MAX_AGE_MS);
    let block = snapshot.block_size as usize;

    if snapshot.workers.is_empty() {
        bail!("workers: the fleet has no workers");
    }
    let mut seen = HashSet::new();
    for (i, w) in snapshot.workers.iter().enumerate() {
        if !seen.insert(w.id.as_str()) {
            bail!("workers[{i}]: duplicate worker id {:?}", w.id);
        }
        add_worker(&router, w, &snapshot.defaults, block, now).with_context(|| format!("workers[{i}] ({:?})", w.id))?;
    }

    let total: u64 = snapshot.requests.iter().map(|r| r.repeat).sum();
    if total > MAX_REQUESTS {
        bail!("requests: {total} requests after repeat; at most {MAX_REQUESTS} are accepted");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut decisions = Vec::new();
    let mut next = 0u64;
    for (i, r) in snapshot.requests.iter().enumerate() {
        let prompt = request_tokens(r, i).with_context(|| format!("requests[{i}]"))?;
        let keys = router.request_keys(Namespace::DEFAULT, &prompt);
        for _ in 0..r.repeat {
            let route = RouteRequest {
                id: RequestId(next),
                keys: &keys,
                prompt_tokens: prompt.len() as u64,
                max_tokens: r.max_tokens,
                exclude: &[],
                keys_cover_prompt: true,
            };
            let decision = router.decide(&route, now, &mut rng).map_err(|e| anyhow!("requests[{i}]: {e}"))?;
            decisions.push(decision.into());
            next += 1;
        }
    }
    Ok(DecideOutput { decisions })
}

fn policy_config(p: &PolicyPatch, d: &Defaults) -> anyhow::Result<PolicyConfig> {
    let patch = PolicyPatch { stale_after_ms: p.stale_after_ms.or(d.stale_after_ms), ..p.clone() };
    patch.build().context("policy")
}

fn add_worker(router: &Router, w: &WorkerInput, d: &Defaults, block: usize, now: Timestamp) -> anyhow::Result<()> {
    if w.id.trim().is_empty() {
        bail!("id must not be empty");
    }
    let mut config = WorkerConfig::new(WorkerId::new(&w.id));
    config.prefill_tokens_per_s =
        w.prefill_tokens_per_s.or(d.prefill_tokens_per_s).unwrap_or(config.prefill_tokens_per_s);
    config.decode_tokens_per_s = w.decode_tokens_per_s.or(d.decode_tokens_per_s).unwrap_or(config.decode_tokens_per_s);
    config.kv_capacity_tokens = w.kv_capacity_tokens.or(d.kv_capacity_tokens).unwrap_or(config.kv_capacity_tokens);
    config.max_running_requests =
        w.max_running_requests.or(d.max_running_requests).unwrap_or(config.max_running_requests);
    config.chunk_tokens = w.chunk_tokens.or(d.chunk_tokens).unwrap_or(config.chunk_tokens);
    let id = config.id.clone();
    let state = kv_state(&w.kv)?;
    // The state is set before the events so that an untrusted worker still holds its blocks.
    router.add_worker(config, state)?;
    router.set_eligible(&id, w.eligible)?;
    if let Some(load) = &w.load {
        if !(0.0..=1.0).contains(&load.kv_usage) {
            bail!("load.kv_usage = {} is out of range: expected a fraction from 0 to 1", load.kv_usage);
        }
        if load.age_ms > MAX_AGE_MS {
            bail!("load.age_ms = {} is out of range: expected at most {MAX_AGE_MS}", load.age_ms);
        }
        let snapshot = LoadSnapshot {
            waiting_requests: load.waiting_requests,
            waiting_tokens: load.waiting_tokens,
            running_requests: load.running_requests,
            active_decode_tokens: load.active_decode_tokens,
            kv_usage: load.kv_usage,
            observed_at: now.saturating_sub(std::time::Duration::from_millis(load.age_ms)),
            estimated: None,
            max_running_requests: None,
        };
        router.update_load(&id, snapshot)?;
    }
    for (j, cached) in w.kv.cached.iter().enumerate() {
        if cached.tokens > MAX_CACHED_TOKENS {
            bail!("kv.cached[{j}].tokens = {} is out of range: expected at most {MAX_CACHED_TOKENS}", cached.tokens);
        }
        let tokens = prefix_tokens(&cached.prefix, cached.tokens as usize);
        let events = stored_events(&w.id, &cached.prefix, &tokens, block);
        let stats = router.apply_kv_events(&id, &events, now)?;
        if stats.dropped > 0 {
            bail!("kv.cached[{j}]: {} events were refused by the index", stats.dropped);
        }
    }
    Ok(())
}

fn kv_state(kv: &KvInput) -> anyhow::Result<KvState> {
    let reason = || kv.reason.clone().unwrap_or_else(|| "as given in the fleet snapshot".into());
    Ok(match kv.state.as_str() {
        "synced" => KvState::Synced,
        "incomplete" => KvState::Incomplete(reason()),
        "stale" => KvState::Stale(reason()),
        "invalid" => KvState::Invalid(reason()),
        other => bail!("kv.state {other:?} is not one of synced, incomplete, stale, invalid"),
    })
}

/// The engine would publish a cached prefix as chained runs of blocks; only full blocks are stored.
fn stored_events(worker: &str, prefix: &str, tokens: &[u32], block: usize) -> Vec<KvEvent> {
    let base = digest_str(worker) ^ digest_str(prefix).rotate_left(17);
    let blocks = tokens.len() / block;
    let mut events = Vec::new();
    let mut parent = None;
    for start in (0..blocks).step_by(BLOCKS_PER_EVENT) {
        let end = (start + BLOCKS_PER_EVENT).min(blocks);
        let hashes: Vec<EngineHash> = (start..end).map(|b| EngineHash(base.wrapping_add(b as u64))).collect();
        let next_parent = hashes.last().copied();
        events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens[start * block..end * block].to_vec(),
            block_size: block as u32,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        }));
        parent = next_parent;
    }
    events
}

/// Deterministic tokens for a named prefix: the same name always expands to the same tokens, and a
/// shorter expansion is a prefix of a longer one.
pub fn prefix_tokens(name: &str, n: usize) -> Vec<u32> {
    synthetic_tokens(digest_str(name), n)
}

fn request_tokens(r: &RequestInput, index: usize) -> anyhow::Result<Vec<u32>> {
    if r.prefix_tokens.saturating_add(r.suffix_tokens) > MAX_REQUEST_TOKENS {
        bail!("prefix_tokens + suffix_tokens exceeds {MAX_REQUEST_TOKENS}");
    }
    if r.prefix_tokens > 0 && r.prefix.is_none() {
        bail!("prefix_tokens = {} needs a prefix name", r.prefix_tokens);
    }
    if r.repeat == 0 {
        bail!("repeat must be at least 1");
    }
    if r.prefix_tokens + r.suffix_tokens == 0 {
        bail!("the request has no tokens: set prefix_tokens or suffix_tokens");
    }
    let mut tokens = r.prefix.as_deref().map_or_else(Vec::new, |p| prefix_tokens(p, r.prefix_tokens as usize));
    // Suffixes are unique per request entry; repeats of an entry are identical requests.
    tokens.extend(synthetic_tokens(digest_str(&format!("kvgate-decide-suffix-{index}")), r.suffix_tokens as usize));
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorter_prefix_expansions_are_prefixes_of_longer_ones() {
        let long = prefix_tokens("hot", 100);
        assert_eq!(&long[..40], &prefix_tokens("hot", 40)[..]);
        assert_ne!(prefix_tokens("hot", 16), prefix_tokens("cold", 16));
    }

    #[test]
    fn cached_prefixes_are_fed_as_chained_runs() {
        let tokens = prefix_tokens("p", 16 * 70 + 5);
        let events = stored_events("w", "p", &tokens, 16);
        assert_eq!(events.len(), 3);
        let KvEvent::BlockStored(second) = &events[1] else { panic!("stored") };
        let KvEvent::BlockStored(first) = &events[0] else { panic!("stored") };
        assert_eq!(second.parent_block_hash, first.block_hashes.last().copied());
    }
}
