//! Decode calibration from the blocks an engine fills while decoding, driven through the core's
//! public API with the KV event batches a vLLM engine would publish.

mod support;

use kvgate_core::{PolicyConfig, Router, Timestamp};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use rand::Rng;
use support::*;

/// The engine's step: 10 ms plus 0.2 ms a decoding sequence.
fn step_s(batch: usize) -> f64 {
    0.010 + 0.0002 * batch as f64
}

/// One sequence decoding on the engine: the hash of its newest full block, and the tokens of the
/// block it is filling.
struct Sequence {
    id: u64,
    tail: EngineHash,
    filling: Vec<u32>,
    generated: u64,
}

/// Runs waves of 2 to 40 sequences through a one-worker fleet whose engine steps take
/// [`step_s`], publishing every decode-filled block as vLLM does. Each stream reaches the gateway
/// as a lagging API server delivers it: its tokens all at once, 5 ms after its first. The KV
/// events reach the router `event_lag_s` late, so a stream's last blocks arrive after its end.
fn decode_waves(router: &Router, event_lag_s: f64) {
    let worker = wid(0);
    let mut rng = rng();
    let mut engine_s = 100.0;
    let mut next_id = 0u64;
    let mut in_transit: std::collections::VecDeque<(f64, Vec<KvEvent>)> = Default::default();
    let deliver = |in_transit: &mut std::collections::VecDeque<(f64, Vec<KvEvent>)>, until_s: f64| {
        while in_transit.front().is_some_and(|(at, _)| *at <= until_s) {
            let (engine_s, events) = in_transit.pop_front().unwrap();
            let received = Timestamp::from_secs_f64(engine_s + event_lag_s);
            router.observe_engine_step(&wid(0), &events, engine_s, None, received).unwrap();
            router.apply_kv_events(&wid(0), &events, received).unwrap();
        }
    };
    for wave in 0..24 {
        let batch = 2 + (wave * 7) % 39;
        let mut sequences: Vec<Sequence> = (0..batch)
            .map(|_| {
                next_id += 1;
                let prompt = tokens(&format!("prompt {next_id}"), 64);
                let req = Req::new(router, next_id, &prompt, 160);
                decide(router, &req, Timestamp::from_secs_f64(engine_s));
                let first = EngineHash(next_id << 32);
                let stored = KvEvent::BlockStored(BlockStored {
                    block_hashes: (0..4).map(|b| EngineHash(first.0 + b)).collect(),
                    token_ids: prompt,
                    block_size: BLOCK,
                    ..BlockStored::default()
                });
                router.apply_kv_events(&worker, &[stored], Timestamp::from_secs_f64(engine_s)).unwrap();
                // Sequences start part-way into a block (their prompts' tails), so their blocks
                // fill on different steps.
                let tail_tokens = rng.random_range(0..BLOCK as usize);
                Sequence { id: next_id, tail: EngineHash(first.0 + 3), filling: vec![7; tail_tokens], generated: 0 }
            })
            .collect();
        for s in &sequences {
            router.first_token(kvgate_core::RequestId(s.id), Timestamp::from_secs_f64(engine_s)).unwrap();
        }
        while !sequences.is_empty() {
            engine_s += step_s(sequences.len()) * rng.random_range(0.97..1.03);
            let mut events = Vec::new();
            for s in &mut sequences {
                s.generated += 1;
                s.filling.push(s.generated as u32);
                if s.filling.len() == BLOCK as usize {
                    let hash = EngineHash(s.tail.0 + 1_000);
                    events.push(KvEvent::BlockStored(BlockStored {
                        block_hashes: vec![hash],
                        parent_block_hash: Some(s.tail),
                        token_ids: std::mem::take(&mut s.filling),
                        block_size: BLOCK,
                        ..BlockStored::default()
                    }));
                    s.tail = hash;
                }
            }
            if !events.is_empty() {
                in_transit.push_back((engine_s, events));
            }
            deliver(&mut in_transit, engine_s - event_lag_s);
            sequences.retain(|s| {
                let done = s.generated == 160;
                if done {
                    let lagged = Timestamp::from_secs_f64(engine_s + 0.005);
                    router.release_with_output(kvgate_core::RequestId(s.id), lagged, Some(160)).unwrap();
                }
                !done
            });
        }
        deliver(&mut in_transit, f64::INFINITY);
        engine_s += 0.5;
    }
}

#[test]
fn decode_is_timed_by_the_engines_decode_filled_blocks_not_by_lagging_streams() {
    // Events 0.5 s late: 20 to 50 steps, after each stream's last block and often its end.
    let router = fleet(1, PolicyConfig::default());
    let before = router.worker_status(&wid(0), T0).unwrap();
    assert_eq!(before.decode_timing, kvgate_core::DecodeTiming::Streams, "until a decode-filled block is seen");
    decode_waves(&router, 0.5);
    // A full batch of 256 decodes 256 tokens in 10 + 51.2 ms.
    let full_batch = 256.0 / step_s(256);
    let status = router.worker_status(&wid(0), T0).unwrap();
    assert_eq!(status.decode_timing, kvgate_core::DecodeTiming::DecodeFilledBlocks);
    let measured = status.measured_decode_tokens_per_s.expect("a decode rate measured from the blocks");
    assert!(
        (measured - full_batch).abs() < 0.1 * full_batch,
        "measured {measured:.0} against the engine's {full_batch:.0}"
    );
}
