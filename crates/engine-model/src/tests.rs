use kvgate_core::hashing::synthetic_tokens;
use kvgate_core::{KvIndex, KvState, Namespace, RequestId, Timestamp, WorkerSlot};
use kvgate_protocol::KvEvent;

use crate::{Engine, EngineProfile, EngineRequest, Flavor, StepOutcome};

fn small_profile(kv_tokens: u64) -> EngineProfile {
    EngineProfile {
        name: "test".into(),
        prefill_tokens_per_s: 10_000.0,
        chunk_budget: 1024,
        step_base_ms: 10.0,
        per_seq_ms: 0.0,
        per_kilo_context_ms: 0.0,
        max_running: 8,
        kv_capacity_tokens: kv_tokens,
        block_size: 16,
        flavor: Flavor::Vllm,
    }
}

fn req(id: u64, tokens: Vec<u32>, out: u32) -> EngineRequest {
    EngineRequest { id: RequestId(id), tokens, output_tokens: out }
}

/// Runs steps until the engine is idle; returns (elapsed micros, outcomes).
fn run(engine: &mut Engine) -> (u64, Vec<StepOutcome>) {
    let mut t = 0;
    let mut outs = Vec::new();
    while let Some(d) = engine.begin_step() {
        t += d;
        outs.push(engine.end_step());
    }
    (t, outs)
}

fn events(outs: &[StepOutcome]) -> Vec<KvEvent> {
    outs.iter().filter_map(|o| o.batch.as_ref()).flat_map(|b| b.events.clone()).collect()
}

#[test]
fn prefill_is_chunked_and_the_first_token_follows_the_last_chunk() {
    let mut e = Engine::new(small_profile(100_000), 1);
    e.submit(req(1, synthetic_tokens(1, 2000), 3));
    let mut first_token_step = None;
    let mut steps = 0;
    while let Some(d) = e.begin_step() {
        steps += 1;
        if steps == 1 {
            // 1,024 prefill tokens at 10k tok/s + 10 ms.
            assert_eq!(d, 112_400);
        }
        let out = e.end_step();
        if !out.first_tokens.is_empty() {
            first_token_step = Some(steps);
        }
        if !out.finished.is_empty() {
            assert_eq!(out.finished[0].output_tokens, 3);
        }
    }
    assert_eq!(first_token_step, Some(2), "2,000 tokens take two 1,024-token chunks");
    assert_eq!(steps, 4, "two prefill steps, then two decode steps");
}

#[test]
fn a_shared_prefix_is_reused_and_published_once() {
    let mut e = Engine::new(small_profile(100_000), 1);
    let prefix = synthetic_tokens(7, 640);
    let with_suffix = |s: u64| [prefix.clone(), synthetic_tokens(s, 100)].concat();
    e.submit(req(1, with_suffix(1), 1));
    let (_, outs) = run(&mut e);
    e.submit(req(2, with_suffix(2), 1));
    let (_, outs2) = run(&mut e);
    let f1 = outs.iter().flat_map(|o| o.finished.clone()).next().unwrap();
    let f2 = outs2.iter().flat_map(|o| o.finished.clone()).next().unwrap();
    assert_eq!(f1.cached_tokens, 0);
    assert_eq!(f2.cached_tokens, 640);
    let stored2: usize = events(&outs2)
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored(s) => s.block_hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(stored2, 6, "only the second request's own full blocks (740 - 640 = 100 tokens, 6 blocks)");
}

#[test]
fn kv_capacity_limits_admission_and_eviction_emits_removals() {
    // 40 blocks of 16 tokens; each request needs 20 prompt blocks + 1 decode block.
    let mut e = Engine::new(small_profile(640), 1);
    e.submit(req(1, synthetic_tokens(1, 320), 1));
    e.submit(req(2, synthetic_tokens(2, 320), 1));
    e.begin_step().unwrap();
    assert_eq!(e.running_len(), 1, "the second request does not fit next to the first");
    assert_eq!(e.waiting_len(), 1);
    e.end_step();
    let (_, outs) = run(&mut e);
    let removed = events(&outs).iter().filter(|ev| matches!(ev, KvEvent::BlockRemoved(_))).count();
    assert!(removed > 0, "the first request's cached blocks are evicted to make room");
}

#[test]
fn router_index_fed_with_the_engine_events_matches_the_engine_cache() {
    let mut e = Engine::new(small_profile(4_000), 3);
    let mut index = KvIndex::new(16);
    index.add_worker(WorkerSlot(0), KvState::Synced);
    let prefixes: Vec<Vec<u32>> = (0..5).map(|p| synthetic_tokens(100 + p, 480)).collect();
    for i in 0..40u64 {
        let p = &prefixes[(i * 7 % 5) as usize];
        e.submit(req(i, [p.clone(), synthetic_tokens(1000 + i, 50)].concat(), 4));
        if i % 3 == 0 {
            let (_, outs) = run(&mut e);
            for ev in events(&outs) {
                index.apply(WorkerSlot(0), &ev, Timestamp::ZERO);
            }
        }
    }
    let (_, outs) = run(&mut e);
    for ev in events(&outs) {
        index.apply(WorkerSlot(0), &ev, Timestamp::ZERO);
    }
    assert_eq!(index.blocks_held(WorkerSlot(0)), e.cached_blocks());
    let mut hasher = kvgate_core::BlockHasher::new();
    let mut some_cached = false;
    for p in &prefixes {
        let mut out = Vec::new();
        index.overlaps(&hasher.prompt_keys(Namespace::DEFAULT, p, 16), &mut out);
        let engine_view = e.cached_prefix_tokens(p);
        let index_view = out.first().map_or(0, |&(_, blocks)| blocks as u64 * 16);
        assert_eq!(engine_view, index_view);
        some_cached |= engine_view > 0;
    }
    assert!(some_cached, "the check compared something");
}

#[test]
fn restart_fails_in_flight_work_and_restarts_sequence_numbers() {
    let mut profile = small_profile(100_000);
    profile.flavor = Flavor::Sglang;
    let mut e = Engine::new(profile, 1);
    let startup = e.flush_idle().unwrap();
    assert_eq!(startup.seq, 0);
    assert_eq!(startup.events, vec![KvEvent::AllBlocksCleared]);
    e.submit(req(1, synthetic_tokens(1, 100), 10));
    e.begin_step().unwrap();
    let out = e.end_step();
    assert_eq!(out.batch.as_ref().map(|b| b.seq), Some(1));
    e.submit(req(2, synthetic_tokens(2, 100), 10));
    let failed = e.restart();
    assert_eq!(failed, vec![RequestId(2), RequestId(1)]);
    assert_eq!(e.cached_blocks(), 0);
    assert_eq!(e.flush_idle().map(|b| b.seq), Some(0));
    assert!(e.replay(0).len() == 1, "history restarts with the new process");
}

#[test]
fn telemetry_reports_queue_decode_and_kv_usage() {
    let mut e = Engine::new(small_profile(1_600), 1);
    e.submit(req(1, synthetic_tokens(1, 200), 50));
    e.submit(req(2, synthetic_tokens(2, 200), 50));
    let idle = e.load(Timestamp::ZERO);
    assert_eq!((idle.waiting_requests, idle.waiting_tokens), (2, 400));
    e.begin_step();
    e.end_step();
    let busy = e.load(Timestamp::from_millis(1));
    assert_eq!((busy.waiting_requests, busy.running_requests), (0, 2));
    assert_eq!(busy.active_decode_tokens, 98);
    assert!(busy.kv_usage > 0.0 && busy.kv_usage <= 1.0);
}

#[test]
fn aborting_keeps_the_cache_and_frees_every_block_in_use() {
    let mut e = Engine::new(small_profile(100_000), 1);
    e.submit(req(1, synthetic_tokens(1, 3000), 100));
    e.submit(req(2, synthetic_tokens(2, 300), 100));
    e.begin_step();
    e.end_step();
    let aborted = e.abort_all();
    assert_eq!(aborted.len(), 2);
    assert!(e.cached_blocks() > 0, "published blocks stay cached");
    assert_eq!(e.load(Timestamp::ZERO).kv_usage, 0.0, "nothing is in use");
    assert!(!e.has_work());
}

#[test]
fn aborting_one_request_frees_its_blocks_and_leaves_the_others_running() {
    let mut e = Engine::new(small_profile(100_000), 1);
    e.submit(req(1, synthetic_tokens(1, 3000), 100));
    e.submit(req(2, synthetic_tokens(2, 300), 100));
    e.submit(req(3, synthetic_tokens(3, 300), 100));
    e.begin_step();
    e.end_step();
    let before = e.load(Timestamp::ZERO).kv_usage;
    assert!(e.abort(RequestId(1)), "running");
    assert!(!e.abort(RequestId(1)), "already gone");
    assert!(e.load(Timestamp::ZERO).kv_usage < before);
    assert!(e.abort(RequestId(3)), "queued or running, it is there");
    let (_, outs) = run(&mut e);
    let finished: Vec<_> = outs.iter().flat_map(|o| o.finished.iter().map(|f| f.id)).collect();
    assert_eq!(finished, vec![RequestId(2)]);
    assert_eq!(e.load(Timestamp::ZERO).kv_usage, 0.0);
}

#[test]
fn vllm_publishes_each_block_its_decoding_fills_and_sglang_does_not() {
    // 40 prompt tokens: two full blocks and 8 tokens of tail. 30 generated, of which 29 are fed
    // back in (the last is never computed): 69 tokens, so the decode fills blocks 3 and 4.
    let prompt = synthetic_tokens(3, 40);
    let stored = |flavor| {
        let mut e = Engine::new(EngineProfile { flavor, ..small_profile(100_000) }, 1);
        e.submit(req(1, prompt.clone(), 30));
        let (_, outs) = run(&mut e);
        let stored: Vec<_> = events(&outs)
            .into_iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored(s) => Some(s),
                _ => None,
            })
            .collect();
        (stored, e.cached_blocks())
    };
    let (vllm, cached) = stored(Flavor::Vllm);
    assert_eq!(vllm.len(), 3, "the prompt's two blocks in one run, then one event per filled block: {vllm:?}");
    let (prompt_run, fills) = (&vllm[0], &vllm[1..]);
    assert_eq!(prompt_run.block_hashes.len(), 2);
    assert_eq!(fills[0].parent_block_hash, prompt_run.block_hashes.last().copied(), "chained to the sequence");
    assert_eq!(fills[1].parent_block_hash, Some(fills[0].block_hashes[0]));
    assert_eq!(fills[0].token_ids[..8], prompt[32..], "the prompt's tail starts the first filled block");
    assert!(fills.iter().all(|f| f.block_hashes.len() == 1 && f.token_ids.len() == 16));
    assert_eq!(cached, 4, "the filled blocks stay cached once the request finishes");
    let mut index = KvIndex::new(16);
    index.add_worker(WorkerSlot(0), KvState::Synced);
    for s in vllm {
        index.apply(WorkerSlot(0), &KvEvent::BlockStored(s), Timestamp::ZERO);
    }
    assert_eq!(index.blocks_held(WorkerSlot(0)), 4, "the router indexes them as the engine holds them");

    let (sglang, cached) = stored(Flavor::Sglang);
    assert_eq!(sglang.len(), 1, "SGLang publishes the prompt's blocks only: {sglang:?}");
    assert_eq!(cached, 2);
}

#[test]
fn reusable_prompt_tokens_is_what_admission_then_finds_cached() {
    let mut e = Engine::new(small_profile(100_000), 1);
    let prompt = synthetic_tokens(3, 640);
    e.submit(req(1, prompt.clone(), 1));
    run(&mut e);
    let extended = [prompt.clone(), synthetic_tokens(4, 100)].concat();
    let other = synthetic_tokens(5, 640);
    for (id, tokens) in [(2, prompt), (3, extended), (4, other)] {
        let reusable = e.reusable_prompt_tokens(&tokens);
        e.submit(req(id, tokens, 1));
        let (_, outs) = run(&mut e);
        let finished = outs.iter().flat_map(|o| o.finished.clone()).next().unwrap();
        assert_eq!(reusable, finished.cached_tokens, "request {id}");
    }
    let cached_whole = synthetic_tokens(3, 640);
    assert_eq!(e.cached_prefix_tokens(&cached_whole), 640);
    assert_eq!(e.reusable_prompt_tokens(&cached_whole), 624, "a fully cached prompt computes its last block");
}
