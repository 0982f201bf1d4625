//! KV event application: `BlockStored` runs (router keys recomputed from tokens) and the matching
//! `BlockRemoved` events, on one core.
//!
//! Run: `cargo bench -p kvgate-core --bench kv_events`

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_core::{KvIndex, KvState, Timestamp, WorkerSlot};
use kvgate_protocol::{BlockRemoved, BlockStored, EngineHash, KvEvent};

const BLOCK: u32 = 16;
const RUNS: usize = 1024;
const BLOCKS_PER_RUN: usize = 32;

fn events(worker: u64) -> (Vec<KvEvent>, Vec<KvEvent>) {
    let mut stored = Vec::new();
    let mut removed = Vec::new();
    for r in 0..RUNS {
        let tokens = kvgate_core::hashing::synthetic_tokens(worker << 32 | r as u64, BLOCKS_PER_RUN * BLOCK as usize);
        let hashes: Vec<EngineHash> =
            (0..BLOCKS_PER_RUN).map(|b| EngineHash(((r * BLOCKS_PER_RUN + b) as u64) << 8 | worker)).collect();
        // vLLM sends one BlockRemoved per hash.
        removed.extend(
            hashes.iter().map(|h| KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![*h], ..Default::default() })),
        );
        stored.push(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: tokens,
            block_size: BLOCK,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        }));
    }
    (stored, removed)
}

fn bench_events(c: &mut Criterion) {
    let mut group = c.benchmark_group("kv_events");
    let mut index = KvIndex::new(BLOCK);
    // A populated index, so map operations run at a realistic size.
    for w in 0..8u32 {
        index.add_worker(WorkerSlot(w), KvState::Synced);
        index.apply_events(WorkerSlot(w), &events(100 + w as u64).0, Timestamp::ZERO);
    }
    let slot = WorkerSlot(8);
    index.add_worker(slot, KvState::Synced);
    let (stored, removed) = events(8);
    group.throughput(Throughput::Elements((2 * RUNS * BLOCKS_PER_RUN) as u64));
    group.bench_function("store_then_remove_32k_blocks", |b| {
        b.iter(|| {
            let s = index.apply_events(slot, black_box(&stored), Timestamp::ZERO);
            let r = index.apply_events(slot, black_box(&removed), Timestamp::ZERO);
            assert_eq!(s.blocks_stored, r.blocks_removed);
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench_events
}
criterion_main!(benches);
