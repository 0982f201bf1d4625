//! The KV index: which worker holds which prefix, from exact engine events only.
//!
//! ```text
//!  BlockStored{hashes, parent, tokens} ──► per worker: engine hash ──► router BlockKey (refcounted)
//!                                                                   │
//!                                          holders: BlockKey ──► sorted [WorkerSlot], parent key
//!  request keys k0 k1 k2 … ─────────────────────────────────────────┘ walk, narrowing the set
//!                                          children: parent key ──► held keys chaining from it
//! ```
//!
//! Every stored block is re-keyed with the router's own chained content hash ([`crate::hashing`]),
//! starting from the key already mapped to the event's parent hash. Engine hashes stay per worker and
//! only resolve parents and removals.
//!
//! | operation | cost |
//! |---|---|
//! | `BlockStored` of b blocks | O(b · (block hash + map insert + holder insert)) |
//! | `BlockRemoved` of b blocks | O(b · holder remove) |
//! | `AllBlocksCleared` on w | O(blocks held by w) |
//! | overlap of a k-key request | O(Σ holders of matched keys), stops at the first key nobody holds |
//! | memory | O(blocks held, summed over workers) |
//!
//! Holder lists are sorted vectors: lookups merge them in one pass and most blocks have few holders.
//!
//! The child counts answer "may any block after this one be held?" without the next block's
//! tokens: a prompt whose held run ends at a block no held block chains from needs no more ids to
//! be routed (`kvgate_tokenizer::routed`), so its next text is not tokenized at all.

mod worker_blocks;

use kvgate_protocol::{is_accelerator_medium, is_prefix_group, BlockRemoved, BlockStored, EngineHash, KvEvent};
use rustc_hash::FxHashMap;
use serde::Serialize;
use smallvec::SmallVec;

use crate::hashing::{BlockHasher, Namespace};
use crate::ids::{BlockKey, WorkerSlot};
use crate::time::Timestamp;
pub use worker_blocks::KvState;
use worker_blocks::WorkerBlocks;

/// Workers holding one block, sorted by slot.
type Holders = SmallVec<[WorkerSlot; 4]>;

/// One block some worker holds: who, and the key it chains from (to count it off its parent's
/// children when the last holder lets it go).
#[derive(Debug, Clone)]
struct Held {
    parent: BlockKey,
    holders: Holders,
}

/// The held blocks, and how many distinct held blocks chain from each key.
#[derive(Debug, Default)]
struct HeldBlocks {
    blocks: FxHashMap<BlockKey, Held>,
    children: FxHashMap<BlockKey, u32>,
}

impl HeldBlocks {
    fn get(&self, key: &BlockKey) -> Option<&Holders> {
        self.blocks.get(key).map(|h| &h.holders)
    }

    fn insert(&mut self, key: BlockKey, parent: BlockKey, slot: WorkerSlot) {
        let held = self.blocks.entry(key).or_insert_with(|| {
            *self.children.entry(parent).or_default() += 1;
            Held { parent, holders: Holders::new() }
        });
        if let Err(pos) = held.holders.binary_search(&slot) {
            held.holders.insert(pos, slot);
        }
    }

    fn remove(&mut self, key: BlockKey, slot: WorkerSlot) {
        let Some(held) = self.blocks.get_mut(&key) else {
            return;
        };
        if let Ok(pos) = held.holders.binary_search(&slot) {
            held.holders.remove(pos);
        }
        if !held.holders.is_empty() {
            return;
        }
        let parent = held.parent;
        self.blocks.remove(&key);
        if let Some(n) = self.children.get_mut(&parent) {
            *n -= 1;
            if *n == 0 {
                self.children.remove(&parent);
            }
        }
    }
}

/// Keys an overlap walk looks up before merging any of them.
const LOOKUP_RUN: usize = 16;

/// Default cap on blocks one worker may hold in the index. A large engine (500k KV tokens at block
/// size 16) holds about 31k blocks; a worker whose events claim 64 times that is missing removals.
pub const DEFAULT_MAX_BLOCKS_PER_WORKER: usize = 2 << 20;

/// What applying events did, summed over the events given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ApplyStats {
    /// Blocks newly recorded as held.
    pub blocks_stored: u64,
    /// Blocks no longer held.
    pub blocks_removed: u64,
    /// `AllBlocksCleared` events applied.
    pub clears: u64,
    /// Events or blocks skipped on purpose: other media, non-prefix groups, removals of blocks the
    /// index never held.
    pub ignored: u64,
    /// Events dropped because they could not be applied (unknown parent, wrong token count, block
    /// size mismatch, unknown worker). Each also moves the worker's state away from `synced`.
    pub dropped: u64,
}

impl ApplyStats {
    fn add(&mut self, other: ApplyStats) {
        self.blocks_stored += other.blocks_stored;
        self.blocks_removed += other.blocks_removed;
        self.clears += other.clears;
        self.ignored += other.ignored;
        self.dropped += other.dropped;
    }
}

/// The key `ev`'s first block chains from on `worker`: its namespace's root, or the key the worker
/// mapped its parent hash to; the parent hash when the worker never stored it.
fn chain_parent(worker: &WorkerBlocks, ev: &BlockStored) -> Result<BlockKey, EngineHash> {
    match ev.parent_block_hash {
        None => Ok(Namespace::new(ev.lora_name.as_deref(), ev.cache_salt.as_deref()).root()),
        Some(parent) => worker.engine_to_key.get(&parent).copied().ok_or(parent),
    }
}

/// A run of blocks one `BlockStored` event stores, as the router keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredRun {
    /// The key the run chains from (a namespace's root for a run that starts a sequence).
    pub parent: BlockKey,
    /// The key of the run's first block.
    pub first: BlockKey,
    /// How many blocks the run stores.
    pub blocks: usize,
}

/// The fleet-wide prefix index.
#[derive(Debug)]
pub struct KvIndex {
    block_size: u32,
    max_blocks_per_worker: usize,
    holders: HeldBlocks,
    workers: Vec<Option<WorkerBlocks>>,
    hasher: BlockHasher,
}

impl KvIndex {
    /// An empty index for engines that publish blocks of `block_size` tokens.
    pub fn new(block_size: u32) -> Self {
        Self::with_limit(block_size, DEFAULT_MAX_BLOCKS_PER_WORKER)
    }

    /// An empty index that marks a worker `invalid` (and forgets its blocks) once it claims more than
    /// `max_blocks_per_worker` blocks. A block size of 0 is taken as 1.
    pub fn with_limit(block_size: u32, max_blocks_per_worker: usize) -> Self {
        KvIndex {
            block_size: block_size.max(1),
            max_blocks_per_worker,
            holders: HeldBlocks::default(),
            workers: Vec::new(),
            hasher: BlockHasher::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Starts tracking `slot` with the given state. Any blocks a previous occupant of the slot held are
    /// forgotten first.
    pub fn add_worker(&mut self, slot: WorkerSlot, state: KvState) {
        self.remove_worker(slot);
        if self.workers.len() <= slot.index() {
            self.workers.resize_with(slot.index() + 1, || None);
        }
        self.workers[slot.index()] = Some(WorkerBlocks::new(state));
    }

    /// Stops tracking `slot` and forgets its blocks.
    pub fn remove_worker(&mut self, slot: WorkerSlot) {
        if self.worker(slot).is_some() {
            self.clear_worker(slot);
            self.workers[slot.index()] = None;
        }
    }

    /// The worker's KV state, or `None` if the slot is not tracked.
    pub fn state(&self, slot: WorkerSlot) -> Option<&KvState> {
        self.worker(slot).map(|w| &w.state)
    }

    /// Overrides the worker's state (the event consumer does this after a gap, a replay or a decode
    /// failure). Blocks are kept: an untrusted worker earns no credit, and its decisions can still say
    /// that its telemetry was the reason. A resync (`AllBlocksCleared` or [`KvIndex::clear_worker`])
    /// drops them.
    pub fn set_state(&mut self, slot: WorkerSlot, state: KvState) {
        if let Some(w) = self.worker_mut(slot) {
            w.state = state;
        }
    }

    /// When the worker's last event (or heartbeat) arrived.
    pub fn last_event_at(&self, slot: WorkerSlot) -> Option<Timestamp> {
        self.worker(slot).and_then(|w| w.last_event_at)
    }

    /// Records that the worker's event stream is alive without carrying events.
    pub fn note_alive(&mut self, slot: WorkerSlot, now: Timestamp) {
        if let Some(w) = self.worker_mut(slot) {
            w.last_event_at = Some(now);
        }
    }

    /// Blocks the worker holds.
    pub fn blocks_held(&self, slot: WorkerSlot) -> usize {
        self.worker(slot).map_or(0, |w| w.key_refs.len())
    }

    /// Distinct blocks held by any worker.
    pub fn distinct_blocks(&self) -> usize {
        self.holders.blocks.len()
    }

    /// Applies one worker's events in order.
    pub fn apply_events(&mut self, slot: WorkerSlot, events: &[KvEvent], now: Timestamp) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for event in events {
            stats.add(self.apply(slot, event, now));
        }
        stats
    }

    /// Applies one event from `slot`'s stream.
    pub fn apply(&mut self, slot: WorkerSlot, event: &KvEvent, now: Timestamp) -> ApplyStats {
        let Some(w) = self.worker_mut(slot) else {
            return ApplyStats { dropped: 1, ..ApplyStats::default() };
        };
        w.last_event_at = Some(now);
        match event {
            KvEvent::BlockStored(stored) => self.apply_stored(slot, stored),
            KvEvent::BlockRemoved(removed) => self.apply_removed(slot, removed),
            KvEvent::AllBlocksCleared => {
                self.clear_worker(slot);
                if let Some(w) = self.worker_mut(slot) {
                    if matches!(w.state, KvState::Incomplete(_) | KvState::Stale(_)) {
                        w.state = KvState::Synced;
                    }
                }
                ApplyStats { clears: 1, ..ApplyStats::default() }
            }
        }
    }

    /// The run of blocks `ev` stores on `slot` as the router keys it, when the event is one the
    /// index would apply and its parent is already known: which prompt a step was computing, or
    /// which sequence's decode filled a block.
    pub fn stored_run(&self, slot: WorkerSlot, ev: &BlockStored) -> Option<StoredRun> {
        let applies = is_prefix_group(ev.group_idx, ev.kv_cache_spec_kind.as_deref())
            && is_accelerator_medium(ev.medium.as_deref())
            && ev.block_size == self.block_size;
        let first_tokens = ev.token_ids.get(..self.block_size as usize).filter(|_| applies)?;
        let parent = chain_parent(self.worker(slot)?, ev).ok()?;
        Some(StoredRun {
            parent,
            first: BlockHasher::new().block_key(parent, first_tokens),
            blocks: ev.token_ids.len() / self.block_size.max(1) as usize,
        })
    }

    fn apply_stored(&mut self, slot: WorkerSlot, ev: &BlockStored) -> ApplyStats {
        let ignored = ApplyStats { ignored: 1, ..ApplyStats::default() };
        let dropped = ApplyStats { dropped: 1, ..ApplyStats::default() };
        if !is_prefix_group(ev.group_idx, ev.kv_cache_spec_kind.as_deref())
            || !is_accelerator_medium(ev.medium.as_deref())
        {
            return ignored;
        }
        if ev.block_size != self.block_size {
            let reason =
                format!("engine block_size {} differs from the router's block_size {}", ev.block_size, self.block_size);
            self.clear_worker(slot);
            self.set_state(slot, KvState::Invalid(reason));
            return dropped;
        }
        let block_size = self.block_size as usize;
        if ev.token_ids.len() != block_size * ev.block_hashes.len() {
            let reason = format!(
                "BlockStored carries {} tokens for {} blocks of {}",
                ev.token_ids.len(),
                ev.block_hashes.len(),
                block_size
            );
            self.mark_incomplete(slot, reason);
            return dropped;
        }
        let cap = self.max_blocks_per_worker;
        // Disjoint borrows: the worker's own maps, the shared holder lists and the hasher.
        let Self { workers, holders, hasher, .. } = self;
        let Some(worker) = workers.get_mut(slot.index()).and_then(Option::as_mut) else {
            return dropped;
        };
        let mut key = match chain_parent(worker, ev) {
            Ok(key) => key,
            Err(parent) => {
                worker.mark_incomplete(format!("BlockStored names unknown parent block {:#018x}", parent.0));
                return dropped;
            }
        };
        let mut stats = ApplyStats::default();
        for (hash, tokens) in ev.block_hashes.iter().zip(ev.token_ids.chunks_exact(block_size)) {
            let parent = key;
            key = hasher.block_key(parent, tokens);
            // Both maps are bounded: distinct contents, and engine hashes (the same content stored
            // under ever new hashes grows only the second).
            let too_many_keys = worker.key_refs.len() >= cap && !worker.key_refs.contains_key(&key);
            let too_many_hashes = worker.engine_to_key.len() >= cap && !worker.engine_to_key.contains_key(hash);
            if too_many_keys || too_many_hashes {
                let reason = format!("worker claims more than {cap} blocks; its stream is missing removals");
                self.clear_worker(slot);
                self.set_state(slot, KvState::Invalid(reason));
                stats.dropped += 1;
                return stats;
            }
            let outcome = worker.map_engine_hash(*hash, key);
            if let Some(old) = outcome.released {
                holders.remove(old, slot);
            }
            if outcome.newly_held {
                holders.insert(key, parent, slot);
                stats.blocks_stored += 1;
            }
        }
        stats
    }

    fn apply_removed(&mut self, slot: WorkerSlot, ev: &BlockRemoved) -> ApplyStats {
        let mut stats = ApplyStats::default();
        if !is_prefix_group(ev.group_idx, None) || !is_accelerator_medium(ev.medium.as_deref()) {
            stats.ignored += 1;
            return stats;
        }
        let Self { workers, holders, .. } = self;
        let Some(worker) = workers.get_mut(slot.index()).and_then(Option::as_mut) else {
            stats.dropped += 1;
            return stats;
        };
        for hash in &ev.block_hashes {
            match worker.unmap_engine_hash(*hash) {
                Some((key, true)) => {
                    holders.remove(key, slot);
                    stats.blocks_removed += 1;
                }
                Some((_, false)) => {}
                None => stats.ignored += 1,
            }
        }
        stats
    }

    fn mark_incomplete(&mut self, slot: WorkerSlot, reason: String) {
        if let Some(w) = self.worker_mut(slot) {
            w.mark_incomplete(reason);
        }
    }

    /// Forgets every block the worker holds, keeping its state.
    pub fn clear_worker(&mut self, slot: WorkerSlot) {
        let Some(w) = self.worker_mut(slot) else {
            return;
        };
        let keys: Vec<BlockKey> = w.take_all();
        for key in keys {
            self.holders.remove(key, slot);
        }
    }

    /// For each worker holding a prefix of `keys`, how many leading keys it holds, whatever its state.
    /// Workers holding none are not listed. `out` is cleared first.
    pub fn overlaps(&self, keys: &[BlockKey], out: &mut Vec<(WorkerSlot, u32)>) {
        out.clear();
        let Some((first, rest)) = keys.split_first() else {
            return;
        };
        let Some(first_holders) = self.holders.get(first) else {
            return;
        };
        let mut alive: SmallVec<[WorkerSlot; 32]> = first_holders.iter().copied().collect();
        let mut depth = 1u32;
        // The keys are known up front, so a run of them is looked up before any is merged: the
        // lookups' cache misses overlap instead of each waiting behind the previous merge's
        // branches (the walk is memory-bound: a 1M-block index does not fit in cache). A walk that
        // stops early wastes at most one run's lookups.
        let mut found: [Option<&Holders>; LOOKUP_RUN] = [None; LOOKUP_RUN];
        for run in rest.chunks(LOOKUP_RUN) {
            for (slot, key) in found.iter_mut().zip(run) {
                *slot = self.holders.get(key);
            }
            for next in &found[..run.len()] {
                let Some(next) = next else {
                    out.extend(alive.iter().map(|&slot| (slot, depth)));
                    return;
                };
                // Along a shared prefix most blocks have the very holders of the block before.
                if next.as_slice() == alive.as_slice() {
                    depth += 1;
                    continue;
                }
                let mut kept = 0;
                let mut j = 0;
                for i in 0..alive.len() {
                    let slot = alive[i];
                    while j < next.len() && next[j] < slot {
                        j += 1;
                    }
                    if j < next.len() && next[j] == slot {
                        alive[kept] = slot;
                        kept += 1;
                    } else {
                        out.push((slot, depth));
                    }
                }
                alive.truncate(kept);
                if alive.is_empty() {
                    return;
                }
                depth += 1;
            }
        }
        out.extend(alive.iter().map(|&slot| (slot, depth)));
    }

    /// Whether any worker holds block `key`.
    pub fn held_by_any(&self, key: BlockKey) -> bool {
        self.holders.blocks.contains_key(&key)
    }

    /// Whether any worker holds a block that chains from `key` (a block key or a namespace's
    /// root): if none does, no block after `key` in any prompt is held anywhere.
    pub fn held_after(&self, key: BlockKey) -> bool {
        self.holders.children.contains_key(&key)
    }

    /// Whether `slot` holds block `key`.
    pub fn holds(&self, slot: WorkerSlot, key: BlockKey) -> bool {
        self.holders.get(&key).is_some_and(|h| h.binary_search(&slot).is_ok())
    }

    fn worker(&self, slot: WorkerSlot) -> Option<&WorkerBlocks> {
        self.workers.get(slot.index()).and_then(Option::as_ref)
    }

    fn worker_mut(&mut self, slot: WorkerSlot) -> Option<&mut WorkerBlocks> {
        self.workers.get_mut(slot.index()).and_then(Option::as_mut)
    }
}

#[cfg(test)]
mod tests;
