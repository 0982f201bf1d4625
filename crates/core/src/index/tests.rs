use kvgate_protocol::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use proptest::prelude::*;
use rustc_hash::FxHashMap;

use super::*;

const BS: u32 = 4;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: tokens,
        block_size: BS,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        ..BlockRemoved::default()
    })
}

fn keys(tokens: &[u32]) -> Vec<BlockKey> {
    BlockHasher::new().prompt_keys(Namespace::DEFAULT, tokens, BS as usize)
}

fn overlap_of(index: &KvIndex, tokens: &[u32]) -> FxHashMap<WorkerSlot, u32> {
    let mut out = Vec::new();
    index.overlaps(&keys(tokens), &mut out);
    out.into_iter().collect()
}

const W0: WorkerSlot = WorkerSlot(0);
const W1: WorkerSlot = WorkerSlot(1);
const T0: Timestamp = Timestamp::ZERO;

#[test]
fn stored_chain_gives_overlap_in_blocks_and_removal_shortens_it() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    index.add_worker(W1, KvState::Synced);
    let tokens: Vec<u32> = (0..16).collect();
    index.apply(W0, &stored(&[10, 11], None, tokens[..8].to_vec()), T0);
    index.apply(W0, &stored(&[12], Some(11), tokens[8..12].to_vec()), T0);
    index.apply(W1, &stored(&[99], None, tokens[..4].to_vec()), T0);
    let o = overlap_of(&index, &tokens);
    assert_eq!(o[&W0], 3);
    assert_eq!(o[&W1], 1);
    index.apply(W0, &removed(&[11]), T0);
    let o = overlap_of(&index, &tokens);
    assert_eq!(o[&W0], 1, "the walk stops at the first block the worker lost");
    assert_eq!(index.blocks_held(W0), 2);
}

#[test]
fn a_stored_run_is_keyed_as_the_prompt_at_that_place_once_the_parent_is_known() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    let tokens: Vec<u32> = (0..16).collect();
    let first_of = |ev: &KvEvent| match ev {
        KvEvent::BlockStored(b) => b.clone(),
        _ => unreachable!("a BlockStored"),
    };
    let root_run = first_of(&stored(&[10, 11], None, tokens[..8].to_vec()));
    let root = Namespace::new(None, None).root();
    assert_eq!(index.stored_run(W0, &root_run), Some(StoredRun { parent: root, first: keys(&tokens)[0], blocks: 2 }));
    let next_run = first_of(&stored(&[12], Some(11), tokens[8..12].to_vec()));
    assert_eq!(index.stored_run(W0, &next_run), None, "the parent is not stored yet");
    index.apply(W0, &KvEvent::BlockStored(root_run), T0);
    assert_eq!(
        index.stored_run(W0, &next_run),
        Some(StoredRun { parent: keys(&tokens)[1], first: keys(&tokens)[2], blocks: 1 })
    );
    let other_size = BlockStored { block_size: 2 * BS, ..next_run.clone() };
    assert_eq!(index.stored_run(W0, &other_size), None, "a run the index would not apply");
    assert_eq!(index.stored_run(W1, &next_run), None, "an unknown worker");
}

#[test]
fn long_walks_count_every_held_key_across_lookup_runs() {
    // Chains longer than one lookup run (16 keys), with ends and holes on and beside run boundaries.
    let blocks = 3 * LOOKUP_RUN + 5;
    let tokens: Vec<u32> = (0..(blocks * BS as usize) as u32).collect();
    let hashes: Vec<u64> = (1..=blocks as u64).collect();
    let mut index = KvIndex::new(BS);
    let held = [blocks, LOOKUP_RUN, LOOKUP_RUN + 1, 2 * LOOKUP_RUN - 1];
    for (w, &n) in held.iter().enumerate() {
        index.add_worker(WorkerSlot(w as u32), KvState::Synced);
        index.apply(WorkerSlot(w as u32), &stored(&hashes[..n], None, tokens[..n * BS as usize].to_vec()), T0);
    }
    let o = overlap_of(&index, &tokens);
    for (w, &n) in held.iter().enumerate() {
        assert_eq!(o[&WorkerSlot(w as u32)], n as u32, "worker {w}");
    }
    index.apply(WorkerSlot(0), &removed(&[2 * LOOKUP_RUN as u64 + 1]), T0);
    assert_eq!(overlap_of(&index, &tokens)[&WorkerSlot(0)], 2 * LOOKUP_RUN as u32, "a hole ends the walk");
    assert_eq!(overlap_of(&index, &tokens[..(LOOKUP_RUN + 3) * BS as usize])[&WorkerSlot(0)], LOOKUP_RUN as u32 + 3);
}

#[test]
fn unknown_parent_drops_the_event_and_marks_the_worker_incomplete_until_cleared() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    let stats = index.apply(W0, &stored(&[5], Some(4), vec![1, 2, 3, 4]), T0);
    assert_eq!(stats.dropped, 1);
    assert_eq!(index.state(W0).map(KvState::name), Some("incomplete"));
    index.apply(W0, &KvEvent::AllBlocksCleared, T0);
    assert_eq!(index.state(W0), Some(&KvState::Synced));
}

#[test]
fn block_size_mismatch_marks_the_worker_invalid_and_forgets_its_blocks() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    index.apply(W0, &stored(&[1], None, vec![1, 2, 3, 4]), T0);
    let mut wrong = stored(&[2], None, vec![1, 2, 3, 4, 5, 6, 7, 8]);
    if let KvEvent::BlockStored(s) = &mut wrong {
        s.block_size = 8;
    }
    index.apply(W0, &wrong, T0);
    let state = index.state(W0).unwrap();
    assert_eq!(state.name(), "invalid");
    assert!(state.reason().unwrap().contains("block_size 8"), "{state}");
    assert_eq!(index.blocks_held(W0), 0);
    assert_eq!(index.distinct_blocks(), 0);
}

#[test]
fn wrong_token_count_is_dropped() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    let stats = index.apply(W0, &stored(&[1, 2], None, vec![1, 2, 3, 4]), T0);
    assert_eq!(stats.dropped, 1);
    assert_eq!(index.blocks_held(W0), 0);
}

#[test]
fn offloaded_media_and_sliding_window_groups_are_not_indexed() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    let mut cpu = stored(&[1], None, vec![1, 2, 3, 4]);
    if let KvEvent::BlockStored(s) = &mut cpu {
        s.medium = Some("CPU".into());
    }
    let mut swa = stored(&[2], None, vec![1, 2, 3, 4]);
    if let KvEvent::BlockStored(s) = &mut swa {
        s.group_idx = Some(1);
        s.kv_cache_spec_kind = Some("sliding_window".into());
    }
    assert_eq!(index.apply(W0, &cpu, T0).ignored, 1);
    assert_eq!(index.apply(W0, &swa, T0).ignored, 1);
    assert_eq!(index.blocks_held(W0), 0);
}

#[test]
fn salted_blocks_only_match_their_namespace() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    let mut salted = stored(&[1], None, vec![1, 2, 3, 4]);
    if let KvEvent::BlockStored(s) = &mut salted {
        s.cache_salt = Some("tenant".into());
    }
    index.apply(W0, &salted, T0);
    assert!(overlap_of(&index, &[1, 2, 3, 4]).is_empty());
    let mut out = Vec::new();
    let k = BlockHasher::new().prompt_keys(Namespace::new(None, Some("tenant")), &[1, 2, 3, 4], 4);
    index.overlaps(&k, &mut out);
    assert_eq!(out, vec![(W0, 1)]);
}

#[test]
fn per_worker_block_cap_marks_a_runaway_stream_invalid() {
    let mut index = KvIndex::with_limit(BS, 2);
    index.add_worker(W0, KvState::Synced);
    index.apply(W0, &stored(&[1, 2, 3], None, (0..12).collect()), T0);
    assert_eq!(index.state(W0).map(KvState::name), Some("invalid"));
    assert_eq!(index.distinct_blocks(), 0);
}

#[test]
fn the_cap_also_bounds_engine_hashes_of_identical_content() {
    let mut index = KvIndex::with_limit(BS, 8);
    index.add_worker(W0, KvState::Synced);
    // The same block content under ever new engine hashes: one key, many hashes.
    for h in 0..8 {
        index.apply(W0, &stored(&[h], None, (0..4).collect()), T0);
    }
    assert_eq!(index.state(W0).map(KvState::name), Some("synced"));
    index.apply(W0, &stored(&[8], None, (0..4).collect()), T0);
    assert_eq!(index.state(W0).map(KvState::name), Some("invalid"));
    assert_eq!(index.distinct_blocks(), 0, "its blocks were cleared");
}

#[test]
fn removing_a_worker_frees_its_blocks_and_its_slot_starts_empty() {
    let mut index = KvIndex::new(BS);
    index.add_worker(W0, KvState::Synced);
    index.apply(W0, &stored(&[1, 2], None, (0..8).collect()), T0);
    index.remove_worker(W0);
    assert_eq!(index.distinct_blocks(), 0);
    index.add_worker(W0, KvState::Synced);
    assert!(overlap_of(&index, &(0..8).collect::<Vec<_>>()).is_empty());
}

/// The naive reference: per worker, engine hash -> the whole token prefix ending at that block.
#[derive(Default)]
struct Reference {
    workers: Vec<FxHashMap<u64, Vec<u32>>>,
}

impl Reference {
    fn apply(&mut self, w: usize, ev: &KvEvent) {
        let map = &mut self.workers[w];
        match ev {
            KvEvent::BlockStored(s) => {
                let mut prefix = match s.parent_block_hash {
                    None => Vec::new(),
                    Some(p) => match map.get(&p.0) {
                        Some(p) => p.clone(),
                        None => return,
                    },
                };
                for (h, block) in s.block_hashes.iter().zip(s.token_ids.chunks(BS as usize)) {
                    prefix.extend_from_slice(block);
                    map.insert(h.0, prefix.clone());
                }
            }
            KvEvent::BlockRemoved(r) => {
                for h in &r.block_hashes {
                    map.remove(&h.0);
                }
            }
            KvEvent::AllBlocksCleared => map.clear(),
        }
    }

    fn overlap(&self, w: usize, tokens: &[u32]) -> u32 {
        let held: Vec<&Vec<u32>> = self.workers[w].values().collect();
        let mut n = 0;
        while (n + 1) * (BS as usize) <= tokens.len() && held.iter().any(|p| p[..] == tokens[..(n + 1) * BS as usize]) {
            n += 1;
        }
        n as u32
    }

    /// Whether any worker holds a block right after `tokens` (a whole number of blocks).
    fn held_after(&self, tokens: &[u32]) -> bool {
        let len = tokens.len() + BS as usize;
        self.workers.iter().flat_map(|m| m.values()).any(|p| p.len() == len && p[..tokens.len()] == *tokens)
    }
}

/// A random event stream over a small token alphabet so that prefixes collide often.
#[derive(Debug, Clone)]
enum Op {
    Store { worker: usize, parent: Option<usize>, hashes: Vec<u64>, tokens: Vec<u32> },
    Remove { worker: usize, hashes: Vec<u64> },
    Clear { worker: usize },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3usize, proptest::option::of(0..24usize), proptest::collection::vec(0..24u64, 1..4), any::<u64>())
            .prop_map(|(worker, parent, hashes, seed)| {
                let tokens = (0..hashes.len() * BS as usize).map(|i| ((seed >> (i % 60)) & 1) as u32).collect();
                Op::Store { worker, parent, hashes, tokens }
            }),
        3 => (0..3usize, proptest::collection::vec(0..24u64, 1..3)).prop_map(|(worker, hashes)| Op::Remove { worker, hashes }),
        1 => (0..3usize).prop_map(|worker| Op::Clear { worker }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_the_reference_in_overlap_and_in_what_may_follow(
        ops in proptest::collection::vec(op_strategy(), 1..80),
        queries in proptest::collection::vec(proptest::collection::vec(0..2u32, 4..24), 1..6),
    ) {
        let mut index = KvIndex::new(BS);
        let mut reference = Reference { workers: vec![FxHashMap::default(); 3] };
        for w in 0..3 {
            index.add_worker(WorkerSlot(w), KvState::Synced);
        }
        for op in &ops {
            let (w, ev) = match op {
                Op::Store { worker, parent, hashes, tokens } => {
                    (*worker, stored(hashes, parent.map(|p| p as u64), tokens.clone()))
                }
                Op::Remove { worker, hashes } => (*worker, removed(hashes)),
                Op::Clear { worker } => (*worker, KvEvent::AllBlocksCleared),
            };
            index.apply(WorkerSlot(w as u32), &ev, T0);
            reference.apply(w, &ev);
        }
        for q in &queries {
            let got = overlap_of(&index, q);
            for w in 0..3 {
                let ours = got.get(&WorkerSlot(w as u32)).copied().unwrap_or(0);
                let theirs = reference.overlap(w, q);
                prop_assert!(ours <= theirs, "worker {} query {:?}: index {} > reference {}", w, q, ours, theirs);
                // With 64-bit keys a collision is out of reach here, so the index is also exact.
                prop_assert_eq!(ours, theirs, "worker {} query {:?}", w, q);
            }
            // Whether a block after each of the query's block prefixes may be held.
            let q_keys = keys(q);
            for n in 0..=q_keys.len() {
                let from = if n == 0 { Namespace::DEFAULT.root() } else { q_keys[n - 1] };
                let theirs = reference.held_after(&q[..n * BS as usize]);
                prop_assert_eq!(index.held_after(from), theirs, "after {} blocks of {:?}", n, q);
            }
        }
    }
}
