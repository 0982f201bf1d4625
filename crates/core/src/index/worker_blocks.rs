//! One worker's view in the index: its engine hashes, the router keys they map to, and its state.

use std::fmt;

use kvgate_protocol::EngineHash;
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::ids::BlockKey;
use crate::time::Timestamp;

/// How far the router trusts a worker's KV events. Only `synced` workers earn cache credit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum KvState {
    /// Every event since the worker's cache was empty (or since a replay) has been applied.
    Synced,
    /// Some events are missing: a sequence gap not yet replayed, an unknown parent, or a new worker
    /// without a snapshot.
    Incomplete(String),
    /// No events or heartbeats for longer than the bound while traffic flowed to the worker.
    Stale(String),
    /// The stream can't be trusted: undecodable events or a block-size mismatch.
    Invalid(String),
}

impl KvState {
    /// The state's name as it appears in records: `synced`, `incomplete`, `stale` or `invalid`.
    pub fn name(&self) -> &'static str {
        match self {
            KvState::Synced => "synced",
            KvState::Incomplete(_) => "incomplete",
            KvState::Stale(_) => "stale",
            KvState::Invalid(_) => "invalid",
        }
    }

    /// Why the worker is not synced, if it isn't.
    pub fn reason(&self) -> Option<&str> {
        match self {
            KvState::Synced => None,
            KvState::Incomplete(r) | KvState::Stale(r) | KvState::Invalid(r) => Some(r),
        }
    }
}

impl fmt::Display for KvState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason() {
            None => f.write_str(self.name()),
            Some(r) => write!(f, "{} ({r})", self.name()),
        }
    }
}

/// Outcome of mapping an engine hash to a router key.
pub(super) struct MapOutcome {
    /// The worker did not hold the new key before.
    pub(super) newly_held: bool,
    /// The engine hash used to map to this other key, which the worker no longer holds.
    pub(super) released: Option<BlockKey>,
}

#[derive(Debug)]
pub(super) struct WorkerBlocks {
    pub(super) engine_to_key: FxHashMap<EngineHash, BlockKey>,
    /// How many engine hashes map to each key: the same content can be stored under several engine
    /// hashes (for example two hash algorithms across a restart), and the worker holds the key until
    /// the last of them is removed.
    pub(super) key_refs: FxHashMap<BlockKey, u32>,
    pub(super) state: KvState,
    pub(super) last_event_at: Option<Timestamp>,
}

impl WorkerBlocks {
    pub(super) fn new(state: KvState) -> Self {
        WorkerBlocks { engine_to_key: FxHashMap::default(), key_refs: FxHashMap::default(), state, last_event_at: None }
    }

    /// Marks the view incomplete (it misses events), unless it is already invalid.
    pub(super) fn mark_incomplete(&mut self, reason: String) {
        if !matches!(self.state, KvState::Invalid(_)) {
            self.state = KvState::Incomplete(reason);
        }
    }

    pub(super) fn map_engine_hash(&mut self, hash: EngineHash, key: BlockKey) -> MapOutcome {
        let previous = self.engine_to_key.insert(hash, key);
        if previous == Some(key) {
            return MapOutcome { newly_held: false, released: None };
        }
        let released = previous.filter(|old| self.release_key(*old));
        let refs = self.key_refs.entry(key).or_insert(0);
        *refs += 1;
        MapOutcome { newly_held: *refs == 1, released }
    }

    /// Drops one reference to `key`; true when the worker no longer holds it.
    pub(super) fn release_key(&mut self, key: BlockKey) -> bool {
        match self.key_refs.get_mut(&key) {
            Some(refs) if *refs > 1 => {
                *refs -= 1;
                false
            }
            Some(_) => {
                self.key_refs.remove(&key);
                true
            }
            None => false,
        }
    }

    /// Removes an engine hash; returns its key and whether the worker no longer holds that key.
    pub(super) fn unmap_engine_hash(&mut self, hash: EngineHash) -> Option<(BlockKey, bool)> {
        let key = self.engine_to_key.remove(&hash)?;
        let gone = self.release_key(key);
        Some((key, gone))
    }

    pub(super) fn take_all(&mut self) -> Vec<BlockKey> {
        self.engine_to_key.clear();
        self.key_refs.drain().map(|(k, _)| k).collect()
    }
}
