//! Prefill calibration from the engine's step cadence: what live KV event batches cost the router.
//! Every 8th batch copies the 256-point window under the fleet's lock (what a decision can wait
//! behind); the envelope refit of that copy runs after the lock is let go. Through the router, each
//! batch also looks for the in-flight requests whose prompts it began, under the same lock.
//!
//! Run: `cargo bench -p kvgate-core --bench step_cadence`

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_core::step_cadence::{StepCadence, STEP_WINDOW};
use kvgate_core::{KvState, Mode, PolicyConfig, RequestId, RouteRequest, Router, Timestamp, WorkerConfig, WorkerId};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use rand::SeedableRng;

const BLOCK: u32 = 16;

/// A router with one worker and `in_flight` requests of 8k-token prompts nobody holds on it: the
/// most prompt keys a batch is matched against.
fn router_with_requests_in_flight(in_flight: u64) -> (Router, WorkerId) {
    let router = Router::new(BLOCK, PolicyConfig::projected(Mode::Enforce)).unwrap();
    let worker = WorkerId::new("w");
    router.add_worker(WorkerConfig::new(worker.clone()), KvState::Synced).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    for i in 0..in_flight {
        let prompt = kvgate_core::hashing::synthetic_tokens(i, 8_192);
        let keys = router.request_keys(kvgate_core::Namespace::DEFAULT, &prompt);
        let req = RouteRequest {
            id: RequestId(i),
            keys: &keys,
            prompt_tokens: 8_192,
            max_tokens: 256,
            exclude: &[],
            keys_cover_prompt: true,
        };
        router.decide(&req, Timestamp::ZERO, &mut rng).unwrap();
    }
    (router, worker)
}

/// A full window of a busy engine's steps: mostly small, one in ten large, with silent steps.
fn warm() -> (StepCadence, f64) {
    let mut cadence = StepCadence::default();
    let mut t = 1_000.0;
    for i in 0..STEP_WINDOW as u64 * 2 {
        let tokens = if i % 10 == 9 { 6_400 } else { 64 * (1 + i % 12) };
        t += 0.020 + (i % 3) as f64 * 0.020 + tokens as f64 / 20_000.0;
        if let Some(window) = cadence.observe(tokens, 8 + i % 24, t, None) {
            cadence.set_fit(window.fit());
        }
    }
    (cadence, t)
}

fn bench_step_cadence(c: &mut Criterion) {
    let mut group = c.benchmark_group("step_cadence_256_points");
    group.bench_function("eight_batches_under_the_lock", |b| {
        let (mut cadence, mut t) = warm();
        let mut i = 0u64;
        b.iter(|| {
            for _ in 0..8 {
                i += 1;
                let tokens = if i % 10 == 9 { 6_400 } else { 64 * (1 + i % 12) };
                t += 0.025 + tokens as f64 / 20_000.0;
                black_box(cadence.observe(tokens, 8 + i % 24, t, None));
            }
        })
    });
    group.bench_function("refit_outside_the_lock", |b| {
        let (mut cadence, mut t) = warm();
        let window = loop {
            t += 0.025;
            if let Some(window) = cadence.observe(64, 8, t, None) {
                break window;
            }
        };
        b.iter(|| black_box(window.fit()))
    });
    group.finish();

    let mut group = c.benchmark_group("step_batch_through_the_router");
    for in_flight in [8u64, 64] {
        let (router, worker) = router_with_requests_in_flight(in_flight);
        // One decode-filled block: no prompt in flight holds it, so every key is looked at.
        let batch = [KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(1)],
            token_ids: (0..BLOCK).collect(),
            block_size: BLOCK,
            ..BlockStored::default()
        })];
        let mut t = 1_000.0;
        group.bench_function(format!("one_block_with_{in_flight}_8k_prompts_in_flight"), |b| {
            b.iter(|| {
                t += 0.025;
                router.observe_engine_step(&worker, &batch, t, None, Timestamp::from_secs_f64(t)).unwrap();
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50);
    targets = bench_step_cadence
}
criterion_main!(benches);
