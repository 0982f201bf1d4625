//! Helpers shared by the core's black-box tests: fleets, prefixes fed through the real event path.

#![allow(dead_code)]

use kvgate_core::{
    BlockKey, Decision, KvState, LoadSnapshot, Namespace, PolicyConfig, RequestId, RouteRequest, Router, Timestamp,
    WorkerConfig, WorkerId,
};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub const BLOCK: u32 = 16;
pub const T0: Timestamp = Timestamp::ZERO;

pub fn rng() -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(7)
}

pub fn wid(i: usize) -> WorkerId {
    WorkerId::new(format!("w{i}"))
}

/// Deterministic tokens for a named piece of text.
pub fn tokens(name: &str, n: usize) -> Vec<u32> {
    kvgate_core::hashing::synthetic_tokens(kvgate_core::hashing::digest_str(name), n)
}

/// A router with `n` workers, each with a fresh idle load report at t = 0.
pub fn fleet(n: usize, policy: PolicyConfig) -> Router {
    let router = Router::new(BLOCK, policy).unwrap();
    for i in 0..n {
        router.add_worker(WorkerConfig::new(wid(i)), KvState::Synced).unwrap();
        router.update_load(&wid(i), idle()).unwrap();
    }
    router
}

pub fn idle() -> LoadSnapshot {
    LoadSnapshot::default()
}

pub fn busy(waiting: u64, waiting_tokens: u64, running: u64, decode_tokens: u64) -> LoadSnapshot {
    LoadSnapshot {
        waiting_requests: waiting,
        waiting_tokens,
        running_requests: running,
        active_decode_tokens: decode_tokens,
        kv_usage: 0.3,
        observed_at: T0,
        estimated: None,
        max_running_requests: None,
    }
}

/// Feeds `tokens` (full blocks only) to `worker` as one BlockStored event, as an engine would.
pub fn store(router: &Router, worker: &WorkerId, tokens: &[u32]) {
    let blocks = tokens.len() / BLOCK as usize;
    let base =
        kvgate_core::hashing::digest_str(worker.as_str()) ^ kvgate_core::hashing::digest_str(&format!("{tokens:?}"));
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as u64).map(|i| EngineHash(base.wrapping_add(i))).collect(),
        parent_block_hash: None,
        token_ids: tokens[..blocks * BLOCK as usize].to_vec(),
        block_size: BLOCK,
        ..BlockStored::default()
    });
    let stats = router.apply_kv_events(worker, &[ev], T0).unwrap();
    assert_eq!(stats.dropped, 0);
}

/// A request for `prompt` with an id.
pub struct Req {
    pub id: RequestId,
    pub keys: Vec<BlockKey>,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
}

impl Req {
    pub fn new(router: &Router, id: u64, prompt: &[u32], max_tokens: u64) -> Self {
        Req {
            id: RequestId(id),
            keys: router.request_keys(Namespace::DEFAULT, prompt),
            prompt_tokens: prompt.len() as u64,
            max_tokens,
        }
    }

    pub fn route(&self) -> RouteRequest<'_> {
        RouteRequest {
            id: self.id,
            keys: &self.keys,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            exclude: &[],
            keys_cover_prompt: true,
        }
    }
}

/// The hot prefix plus a unique suffix.
pub fn hot_prompt(prefix: &[u32], i: u64, suffix: usize) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.extend(tokens(&format!("suffix-{i}"), suffix));
    p
}

pub fn decide(router: &Router, req: &Req, now: Timestamp) -> Decision {
    router.decide(&req.route(), now, &mut rng()).unwrap()
}
