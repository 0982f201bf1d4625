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
        mixed_chunk: None,
        step_gap: crate::HostDelay::NONE,
        intake: crate::HostDelay::NONE,
        dispatch: crate::HostDelay::NONE,
        delivery: crate::HostDelay::NONE,
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
    // 40 blocks of 16 tokens; each 330-token prompt needs 21 blocks (20 full and its tail).
    for flavor in [Flavor::Vllm, Flavor::Sglang] {
        let mut e = Engine::new(EngineProfile { flavor, ..small_profile(640) }, 1);
        e.submit(req(1, synthetic_tokens(1, 330), 1));
        e.submit(req(2, synthetic_tokens(2, 330), 1));
        e.begin_step().unwrap();
        assert_eq!(e.running_len(), 1, "{flavor:?}: the second request does not fit next to the first");
        assert_eq!(e.waiting_len(), 1);
        e.end_step();
        let (_, outs) = run(&mut e);
        let removed = events(&outs).iter().filter(|ev| matches!(ev, KvEvent::BlockRemoved(_))).count();
        assert!(removed > 0, "{flavor:?}: the first request's cached blocks are evicted to make room");
    }
}

#[test]
fn vllm_admits_by_the_first_chunk_and_preempts_the_newest_when_decoding_runs_out() {
    // 40 blocks. Two 300-token prompts (19 blocks each) fit side by side; decoding 100 tokens each
    // would need 25 blocks apiece. vLLM admits both and, out of blocks, preempts the newest, which
    // resumes once the first is done, recomputing from the blocks it left cached: its tokens are
    // kept, so it neither starts over nor produces a second first token.
    let mut e = Engine::new(small_profile(640), 1);
    e.submit(req(1, synthetic_tokens(1, 300), 100));
    e.submit(req(2, synthetic_tokens(2, 300), 100));
    e.begin_step().unwrap();
    assert_eq!(e.running_len(), 2, "admission needs only the prompt's blocks");
    e.end_step();
    let (mut firsts, mut decoded, mut finished) = (Vec::new(), Vec::new(), Vec::new());
    let mut peak_waiting = 0;
    while e.begin_step().is_some() {
        peak_waiting = peak_waiting.max(e.waiting_len());
        let out = e.end_step();
        firsts.extend(out.first_tokens);
        decoded.extend(out.decoded);
        finished.extend(out.finished);
    }
    assert!(e.preemptions_total >= 1, "the newest was preempted");
    assert_eq!(peak_waiting, 1);
    assert!(firsts.is_empty(), "both first tokens came with the first step");
    for id in [RequestId(1), RequestId(2)] {
        assert_eq!(decoded.iter().filter(|d| **d == id).count(), 99, "{id:?} decodes each further token once");
    }
    let order: Vec<_> = finished.iter().map(|f| (f.id, f.output_tokens, f.cached_tokens)).collect();
    assert_eq!(order, vec![(RequestId(1), 100, 0), (RequestId(2), 100, 0)], "the oldest runs through first");
    assert_eq!(e.load(Timestamp::ZERO).kv_usage, 0.0, "every block is back");

    // SGLang flavour reserves the whole output at admission: the second waits instead.
    let mut e = Engine::new(EngineProfile { flavor: Flavor::Sglang, ..small_profile(640) }, 1);
    e.submit(req(1, synthetic_tokens(1, 300), 100));
    e.submit(req(2, synthetic_tokens(2, 300), 100));
    e.begin_step().unwrap();
    assert_eq!(e.running_len(), 1);
    e.end_step();
    run(&mut e);
    assert_eq!(e.preemptions_total, 0);
}

#[test]
fn a_preempted_request_recomputes_only_what_was_evicted() {
    // 28 blocks. Two 200-token prompts (13 blocks each) decode side by side until each holds 14
    // and request 1 needs a 15th: request 2, the newest, is preempted and its blocks stay cached.
    // Request 1 takes one of them, the tail (a request's blocks are freed last first), and runs to
    // its end; request 2 then comes back recomputing that one block and the token it had sampled.
    let mut e = Engine::new(small_profile(448), 1);
    let prompt = synthetic_tokens(2, 200);
    e.submit(req(1, synthetic_tokens(1, 200), 40));
    e.submit(req(2, prompt.clone(), 40));
    let (mut steps, mut resumed_step) = (0, None);
    let mut removed = Vec::new();
    while let Some(d) = e.begin_step() {
        steps += 1;
        if e.preemptions_total > 0 && resumed_step.is_none() && e.waiting_len() == 0 {
            resumed_step = Some(d);
        }
        let out = e.end_step();
        assert!(steps == 1 || out.first_tokens.is_empty(), "no second first token");
        for f in out.finished {
            assert_eq!((f.output_tokens, f.cached_tokens), (40, 0));
        }
        for ev in out.batch.map(|b| b.events).unwrap_or_default() {
            if let KvEvent::BlockRemoved(r) = ev {
                removed.extend(r.block_hashes);
            }
        }
        if e.waiting_len() == 1 {
            assert_eq!(e.cached_prefix_tokens(&prompt), 192, "request 2's prompt blocks stay cached while it waits");
        }
    }
    assert_eq!(e.preemptions_total, 1);
    assert!(!removed.is_empty());
    // 225 tokens (its prompt and 25 sampled), 13 full blocks found cached: 17 to compute, 1.7 ms at
    // 10 tokens per ms over the 10 ms base. From zero it would be 22.5 ms.
    assert_eq!(resumed_step, Some(11_700), "only the evicted block and the sampled token are recomputed");
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

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// However tight the KV cache, every request is served whole: one first token, each further
    /// token once, the cache's blocks all returned, and the router's view from the events equal to
    /// the engine's cache (preemption and eviction included).
    #[test]
    fn tight_kv_serves_every_request_whole_and_the_events_track_the_cache(
        vllm: bool,
        // At least 34 blocks: the longest request (29 prompt blocks, 60 tokens out) fits alone.
        capacity_blocks in 34u64..80,
        requests in proptest::collection::vec((0u64..4, 1usize..300, 1u32..60), 1..24),
    ) {
        let flavor = if vllm { Flavor::Vllm } else { Flavor::Sglang };
        let mut e = Engine::new(EngineProfile { flavor, ..small_profile(capacity_blocks * 16) }, 5);
        let mut index = KvIndex::new(16);
        index.add_worker(WorkerSlot(0), KvState::Synced);
        let prefixes: Vec<Vec<u32>> = (0..4).map(|p| synthetic_tokens(50 + p, 160)).collect();
        let mut firsts = std::collections::HashMap::new();
        let mut decoded = std::collections::HashMap::new();
        let mut finished = std::collections::HashMap::new();
        let mut expected = std::collections::HashMap::new();
        let mut pending = requests.into_iter().enumerate();
        loop {
            // Requests arrive between steps, a few at a time.
            for (i, (prefix, suffix, out)) in pending.by_ref().take(2) {
                let tokens = [prefixes[prefix as usize].clone(), synthetic_tokens(900 + i as u64, suffix)].concat();
                expected.insert(RequestId(i as u64), out);
                e.submit(req(i as u64, tokens, out));
            }
            let Some(_) = e.begin_step() else {
                if e.has_work() && pending.len() == 0 {
                    proptest::prop_assert!(false, "stuck with work left");
                }
                if pending.len() == 0 { break; }
                continue;
            };
            let out = e.end_step();
            for id in out.first_tokens { *firsts.entry(id).or_insert(0) += 1; }
            for id in out.decoded { *decoded.entry(id).or_insert(0u32) += 1; }
            for f in out.finished {
                proptest::prop_assert!(finished.insert(f.id, f.output_tokens).is_none(), "finished twice");
            }
            for ev in out.batch.map(|b| b.events).unwrap_or_default() {
                index.apply(WorkerSlot(0), &ev, Timestamp::ZERO);
            }
        }
        for (id, out) in &expected {
            proptest::prop_assert_eq!(firsts.get(id), Some(&1), "{:?}", id);
            proptest::prop_assert_eq!(decoded.get(id).copied().unwrap_or(0), out - 1);
            proptest::prop_assert_eq!(finished.get(id), Some(&u64::from(*out)));
        }
        proptest::prop_assert_eq!(e.load(Timestamp::ZERO).kv_usage, 0.0);
        proptest::prop_assert_eq!(index.blocks_held(WorkerSlot(0)), e.cached_blocks());
    }
}

/// Runs `e` until `id` has its first token.
fn until_first_token(e: &mut Engine, id: RequestId) {
    while e.begin_step().is_some() {
        if e.end_step().first_tokens.contains(&id) {
            return;
        }
    }
    panic!("{id:?} never got its first token");
}

#[test]
fn sglang_pauses_its_decodes_while_it_prefills_unless_it_mixes_chunks() {
    // Request 1 decodes; request 2 arrives with 500 uncached tokens (10,000 tokens/s: 50 ms).
    for (mixed_chunk, decodes_meanwhile) in [(None, false), (Some(false), false), (Some(true), true)] {
        let profile = EngineProfile { flavor: Flavor::Sglang, mixed_chunk, ..small_profile(100_000) };
        let mut e = Engine::new(profile, 1);
        e.submit(req(1, synthetic_tokens(1, 100), 50));
        until_first_token(&mut e, RequestId(1));
        e.submit(req(2, synthetic_tokens(2, 500), 5));
        let micros = e.begin_step().unwrap();
        let out = e.end_step();
        assert_eq!(out.first_tokens, vec![RequestId(2)], "{mixed_chunk:?}: the prefill step gives the first token");
        assert_eq!(out.decoded.contains(&RequestId(1)), decodes_meanwhile, "{mixed_chunk:?}");
        // 10 ms a step plus the prefill's 50 ms (a decode costs nothing more in this profile).
        assert_eq!(micros, 60_000, "{mixed_chunk:?}: the step costs the prefill alone");
        let micros = e.begin_step().unwrap();
        let out = e.end_step();
        assert_eq!(micros, 10_000, "{mixed_chunk:?}: then both decode");
        assert!(out.decoded.contains(&RequestId(1)) && out.decoded.contains(&RequestId(2)));
    }
}

#[test]
fn vllm_always_mixes_and_a_profile_saying_otherwise_is_refused() {
    let mut e = Engine::new(small_profile(100_000), 1);
    e.submit(req(1, synthetic_tokens(1, 100), 50));
    until_first_token(&mut e, RequestId(1));
    e.submit(req(2, synthetic_tokens(2, 500), 5));
    e.begin_step().unwrap();
    let out = e.end_step();
    assert!(out.decoded.contains(&RequestId(1)) && out.first_tokens == vec![RequestId(2)]);
    let refused = EngineProfile { mixed_chunk: Some(false), ..small_profile(640) }.check_scheduling().unwrap_err();
    assert!(refused.contains("vLLM's scheduler always mixes"), "{refused}");
    assert!(EngineProfile { mixed_chunk: Some(false), flavor: Flavor::Sglang, ..small_profile(640) }
        .check_scheduling()
        .is_ok());
}
