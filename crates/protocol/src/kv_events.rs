//! Decoded KV-cache events, engine-neutral.
//!
//! Both engines publish batches `[ts, events, dp_rank]` whose events are one of three classes. The
//! decoder normalises every hash to a `u64` bit pattern ([`EngineHash`]) and every optional field to
//! `Option`, so consumers never see which engine, version or msgpack form produced an event.

/// An engine's own block hash, normalised to its 64-bit pattern.
///
/// It is an opaque key scoped to one worker: the router uses it only to resolve parent links and
/// removals, never to compare content across workers (`engine-protocols.md` §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// Blocks that entered an engine's prefix cache: a run of consecutive blocks of one sequence.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in sequence order.
    pub block_hashes: Vec<EngineHash>,
    /// The block just before the run, or `None` when the run starts the sequence.
    pub parent_block_hash: Option<EngineHash>,
    /// The tokens of all blocks in the run (`block_size × block_hashes.len()` for indexed groups).
    pub token_ids: Vec<u32>,
    /// Tokens per block as the engine reports it (vLLM `block_size`, SGLang `page_size`).
    pub block_size: u32,
    /// LoRA adapter name; blocks of different adapters never share a prefix.
    pub lora_name: Option<String>,
    /// Where the block lives (`GPU`, `CPU`, ...); `None` when the engine does not say.
    pub medium: Option<String>,
    /// Cache salt; salted blocks only match requests with the same salt.
    pub cache_salt: Option<String>,
    /// KV-cache group of hybrid models; `None` for single-group models.
    pub group_idx: Option<u32>,
    /// Attention kind of the group (`full_attention`, `sliding_window`, `mamba`, ...).
    pub kv_cache_spec_kind: Option<String>,
}

/// Blocks that left an engine's prefix cache.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Where the blocks lived; `None` when the engine does not say.
    pub medium: Option<String>,
    /// KV-cache group of hybrid models.
    pub group_idx: Option<u32>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// See [`BlockStored`].
    BlockStored(BlockStored),
    /// See [`BlockRemoved`].
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole prefix cache (reset, weight update, or SGLang start-up).
    AllBlocksCleared,
}

/// One published batch: the events of one scheduler step.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Engine timestamp in seconds since the Unix epoch, as the engine wrote it.
    pub ts: f64,
    /// The events in the order the engine emitted them.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publisher, when the engine sends one.
    pub dp_rank: Option<u32>,
}

impl KvEvent {
    /// The event's class name as the engines spell it on the wire.
    pub fn tag(&self) -> &'static str {
        match self {
            KvEvent::BlockStored(_) => "BlockStored",
            KvEvent::BlockRemoved(_) => "BlockRemoved",
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// Media whose blocks the prefix index treats as resident: the engine's own accelerator memory.
///
/// Offloaded tiers (`CPU`, `CPU_PINNED`, `DISK`, ...) still cost a transfer, so they are not credited
/// as cached prefill; an event without a medium is the accelerator tier.
pub fn is_accelerator_medium(medium: Option<&str>) -> bool {
    matches!(medium, None | Some("GPU"))
}

/// Whether blocks of this KV-cache group feed the prefix index.
///
/// Hybrid models report the same hash once per group; only full-attention groups describe a reusable
/// prefix (`engine-protocols.md` §4).
pub fn is_prefix_group(group_idx: Option<u32>, kind: Option<&str>) -> bool {
    match kind {
        Some(kind) => matches!(kind, "full_attention" | "mla_attention"),
        None => matches!(group_idx, None | Some(0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerator_medium_includes_unlabelled_blocks_only_for_gpu() {
        assert!(is_accelerator_medium(None));
        assert!(is_accelerator_medium(Some("GPU")));
        assert!(!is_accelerator_medium(Some("CPU")));
        assert!(!is_accelerator_medium(Some("CPU_PINNED")));
    }

    #[test]
    fn only_full_attention_groups_feed_the_prefix_index() {
        assert!(is_prefix_group(None, None));
        assert!(is_prefix_group(Some(0), Some("full_attention")));
        assert!(!is_prefix_group(Some(1), Some("sliding_window")));
        assert!(!is_prefix_group(Some(2), Some("mamba")));
        assert!(!is_prefix_group(Some(1), None));
    }
}
