//! One routing decision (block hashing of the prompt included) at 51 and 1,024 workers, with an
//! 8k-token prompt and an index holding about 1M blocks.
//!
//! Run: `cargo bench -p kvgate-core --bench decision`

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_core::{
    KvState, LoadSnapshot, Mode, Namespace, PolicyConfig, RequestId, RouteRequest, Router, Timestamp, WorkerConfig,
    WorkerId,
};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const BLOCK: u32 = 16;
const PROMPT_TOKENS: usize = 8192;
const INDEX_BLOCKS: usize = 1 << 20;

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    kvgate_core::hashing::synthetic_tokens(seed, n)
}

fn store(router: &Router, worker: &WorkerId, prompt: &[u32], hash_base: u64) {
    let blocks = prompt.len() / BLOCK as usize;
    let mut parent = None;
    let mut events = Vec::new();
    for start in (0..blocks).step_by(64) {
        let end = (start + 64).min(blocks);
        let hashes: Vec<EngineHash> = (start..end).map(|b| EngineHash(hash_base + b as u64)).collect();
        let last = hashes.last().copied();
        events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: prompt[start * BLOCK as usize..end * BLOCK as usize].to_vec(),
            block_size: BLOCK,
            ..BlockStored::default()
        }));
        parent = last;
    }
    router.apply_kv_events(worker, &events, Timestamp::ZERO).unwrap();
}

/// A fleet of `workers` with varied load, ~1M indexed blocks of unrelated prefixes, and the request's
/// 8k-token prefix (minus its last 512 tokens) held by a few workers so the overlap walk is long.
fn setup(workers: usize) -> (Router, Vec<u32>) {
    let router = Router::new(BLOCK, PolicyConfig::projected(Mode::Enforce)).unwrap();
    let ids: Vec<WorkerId> = (0..workers).map(|i| WorkerId::new(format!("w{i}"))).collect();
    for (i, id) in ids.iter().enumerate() {
        router.add_worker(WorkerConfig::new(id.clone()), KvState::Synced).unwrap();
        let load = LoadSnapshot {
            waiting_requests: (i % 7) as u64,
            waiting_tokens: (i % 7) as u64 * 3000,
            running_requests: (i % 13) as u64,
            active_decode_tokens: (i % 13) as u64 * 250,
            kv_usage: 0.3,
            observed_at: Timestamp::ZERO,
            estimated: None,
            max_running_requests: None,
        };
        router.update_load(id, load).unwrap();
    }
    let blocks_per_prefix = PROMPT_TOKENS / BLOCK as usize;
    for p in 0..INDEX_BLOCKS / blocks_per_prefix {
        let prefix = tokens(1000 + p as u64, PROMPT_TOKENS);
        store(&router, &ids[p % workers], &prefix, (p as u64) << 20);
    }
    let prompt = tokens(7, PROMPT_TOKENS);
    for (k, id) in ids.iter().enumerate().take(4) {
        store(&router, id, &prompt[..PROMPT_TOKENS - 512], 1 << 40 | (k as u64) << 32);
    }
    (router, prompt)
}

fn bench_decision(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision_8k_prompt_1m_blocks");
    for workers in [51usize, 1024] {
        let (router, prompt) = setup(workers);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut next = 0u64;
        let mut decide_and_release = |keys: &[kvgate_core::BlockKey]| {
            let req = RouteRequest {
                id: RequestId(next),
                keys,
                prompt_tokens: prompt.len() as u64,
                max_tokens: 256,
                exclude: &[],
                keys_cover_prompt: true,
            };
            next += 1;
            // Every decision at the same instant: the fleet's prefill demand never decays, so the
            // weight on prefill sits at its bound (the path that weighs every score).
            let d = router.decide(&req, Timestamp::ZERO, &mut rng).unwrap();
            router.release(d.request, Timestamp::ZERO).unwrap();
            black_box(d.worker);
        };
        group.bench_function(BenchmarkId::new("hash_decide_release", workers), |b| {
            b.iter(|| decide_and_release(&router.request_keys(Namespace::DEFAULT, black_box(&prompt))))
        });
        let keys = router.request_keys(Namespace::DEFAULT, &prompt);
        group.bench_function(BenchmarkId::new("decide_release_prehashed", workers), |b| {
            b.iter(|| decide_and_release(black_box(&keys)))
        });
        // With replica sharing on, every decision and release also queues its change and may signal
        // the bus task (here a counter); the queue is taken after every decision (the worst case).
        let signals = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let signal = signals.clone();
        router.batch_reservation_changes(
            kvgate_core::BatchWindows::default(),
            Some(std::sync::Arc::new(move || {
                signal.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })),
        );
        group.bench_function(BenchmarkId::new("hash_decide_release_sharing", workers), |b| {
            b.iter(|| {
                decide_and_release(&router.request_keys(Namespace::DEFAULT, black_box(&prompt)));
                black_box(router.take_reservation_changes());
            })
        });
        router.share_reservations(false);
        // 512 requests in flight that share the prompt's first 7,680 tokens and end apart: each
        // worker's carriers are walked for the KV the prompt shares with them (`pending_prefix`),
        // and none covers it whole, so every one is searched (the worst case).
        let held: Vec<RequestId> = (0..512u64)
            .map(|i| {
                let mut other = prompt[..PROMPT_TOKENS - 512].to_vec();
                other.extend(tokens(1 << 30 | i, 512));
                let other_keys = router.request_keys(Namespace::DEFAULT, &other);
                let req = RouteRequest {
                    id: RequestId(u64::MAX - i),
                    keys: &other_keys,
                    prompt_tokens: prompt.len() as u64,
                    max_tokens: 256,
                    exclude: &[],
                    keys_cover_prompt: true,
                };
                router.decide(&req, Timestamp::ZERO, &mut ChaCha8Rng::seed_from_u64(i)).unwrap().request
            })
            .collect();
        group.bench_function(BenchmarkId::new("decide_release_prehashed_512_in_flight", workers), |b| {
            b.iter(|| decide_and_release(black_box(&keys)))
        });
        for id in held {
            router.release(id, Timestamp::ZERO).unwrap();
        }
    }
    group.bench_function("hash_8k_prompt", |b| {
        let prompt = tokens(7, PROMPT_TOKENS);
        let mut hasher = kvgate_core::BlockHasher::new();
        b.iter(|| black_box(hasher.prompt_keys(Namespace::DEFAULT, black_box(&prompt), BLOCK as usize)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50);
    targets = bench_decision
}
criterion_main!(benches);
