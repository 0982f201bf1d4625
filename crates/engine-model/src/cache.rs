//! A paged KV cache with prefix reuse and LRU eviction of unreferenced blocks.
//!
//! Blocks in the prefix cache are keyed by the engine's own chained hash. A block is referenced while
//! a running request uses it; unreferenced blocks stay cached (reusable by later requests) until space
//! is needed, then the least recently released goes first and a `BlockRemoved` is emitted. Blocks a
//! request owns that are not in the prefix cache (the partial last prompt block, decode blocks, and
//! full prompt blocks still being prefilled) are counted as private.

use std::collections::BTreeSet;

use kvgate_protocol::{BlockRemoved, EngineHash, KvEvent};
use rustc_hash::FxHashMap;

#[derive(Debug, Clone, Copy)]
struct Cached {
    refs: u32,
    released_at: u64,
}

/// The cache of one engine.
#[derive(Debug)]
pub(crate) struct PagedCache {
    capacity_blocks: u64,
    blocks: FxHashMap<EngineHash, Cached>,
    lru: BTreeSet<(u64, EngineHash)>,
    private_blocks: u64,
    tick: u64,
}

impl PagedCache {
    pub(crate) fn new(capacity_blocks: u64) -> Self {
        PagedCache { capacity_blocks, blocks: FxHashMap::default(), lru: BTreeSet::new(), private_blocks: 0, tick: 0 }
    }

    /// Blocks in use by running requests (referenced cached blocks plus private ones).
    pub(crate) fn used_blocks(&self) -> u64 {
        (self.blocks.len() - self.lru.len()) as u64 + self.private_blocks
    }

    pub(crate) fn capacity_blocks(&self) -> u64 {
        self.capacity_blocks
    }

    /// Blocks held in the prefix cache, referenced or not.
    pub(crate) fn cached_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn free_blocks(&self) -> u64 {
        self.capacity_blocks.saturating_sub(self.blocks.len() as u64 + self.private_blocks)
    }

    /// Whether a block is in the prefix cache.
    pub(crate) fn contains(&self, hash: EngineHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// How many leading hashes are cached.
    pub(crate) fn match_prefix(&self, hashes: &[EngineHash]) -> usize {
        hashes.iter().take_while(|h| self.blocks.contains_key(h)).count()
    }

    /// Whether `n` more private blocks fit once every unreferenced block is evicted, given that
    /// `pinned` of the unreferenced blocks are about to be referenced.
    pub(crate) fn can_allocate(&self, n: u64, pinned: u64) -> bool {
        self.free_blocks() + (self.lru.len() as u64).saturating_sub(pinned) >= n
    }

    /// How many of these cached blocks are unreferenced (and so would be pinned by acquiring them).
    pub(crate) fn unreferenced_among(&self, hashes: &[EngineHash]) -> u64 {
        hashes.iter().filter(|h| self.blocks.get(h).is_some_and(|b| b.refs == 0)).count() as u64
    }

    /// References a cached block.
    pub(crate) fn acquire(&mut self, hash: EngineHash) {
        if let Some(b) = self.blocks.get_mut(&hash) {
            if b.refs == 0 {
                self.lru.remove(&(b.released_at, hash));
            }
            b.refs += 1;
        }
    }

    /// Drops a reference; an unreferenced block becomes evictable.
    pub(crate) fn release(&mut self, hash: EngineHash) {
        if let Some(b) = self.blocks.get_mut(&hash) {
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.tick += 1;
                b.released_at = self.tick;
                self.lru.insert((self.tick, hash));
            }
        }
    }

    /// Allocates `n` private blocks, evicting least recently released blocks as needed.
    pub(crate) fn allocate_private(&mut self, n: u64, events: &mut Vec<KvEvent>) -> bool {
        while self.free_blocks() < n {
            let Some((tick, hash)) = self.lru.pop_first() else {
                return false;
            };
            debug_assert!(self.blocks.get(&hash).is_some_and(|b| b.released_at == tick));
            self.blocks.remove(&hash);
            events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![hash],
                medium: Some("GPU".into()),
                group_idx: None,
            }));
        }
        self.private_blocks += n;
        true
    }

    /// Returns private blocks to the free pool.
    pub(crate) fn free_private(&mut self, n: u64) {
        self.private_blocks = self.private_blocks.saturating_sub(n);
    }

    /// Moves one private block into the prefix cache under `hash`, referenced once. Returns false if
    /// an identical block was already cached (the private copy is freed and the cached one is used).
    pub(crate) fn publish(&mut self, hash: EngineHash) -> bool {
        self.private_blocks = self.private_blocks.saturating_sub(1);
        match self.blocks.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => {
                self.acquire(hash);
                false
            }
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(Cached { refs: 1, released_at: 0 });
                true
            }
        }
    }

    /// Forgets everything (the engine process died).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
        self.private_blocks = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreferenced_blocks_are_evicted_least_recently_released_first() {
        let mut c = PagedCache::new(3);
        let mut ev = Vec::new();
        for h in 1..=3 {
            assert!(c.allocate_private(1, &mut ev));
            assert!(c.publish(EngineHash(h)));
        }
        c.release(EngineHash(2));
        c.release(EngineHash(1));
        assert_eq!(c.used_blocks(), 1);
        assert!(c.can_allocate(2, 0));
        assert!(!c.can_allocate(3, 0));
        assert!(c.allocate_private(1, &mut ev));
        assert_eq!(ev.len(), 1);
        assert!(matches!(&ev[0], KvEvent::BlockRemoved(r) if r.block_hashes == vec![EngineHash(2)]));
        assert_eq!(c.match_prefix(&[EngineHash(1), EngineHash(2)]), 1);
    }

    #[test]
    fn publishing_a_block_someone_else_cached_reuses_it() {
        let mut c = PagedCache::new(4);
        let mut ev = Vec::new();
        c.allocate_private(2, &mut ev);
        assert!(c.publish(EngineHash(9)));
        assert!(!c.publish(EngineHash(9)));
        assert_eq!(c.cached_blocks(), 1);
        assert_eq!(c.used_blocks(), 1);
        c.release(EngineHash(9));
        assert_eq!(c.used_blocks(), 1, "still referenced once");
        c.release(EngineHash(9));
        assert_eq!(c.used_blocks(), 0);
    }
}
