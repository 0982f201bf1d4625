//! The router's own chained block keys.
//!
//! `key_i = XXH3-64(tokens of block i as u32 little-endian, seed = key_{i-1})`, with `key_{-1}` the
//! request's cache namespace (LoRA adapter and cache salt). The same function keys a request's prompt
//! and every `BlockStored` run, so equal keys mean an equal whole prefix in the same namespace. Engine
//! hashes are never reproduced (`engine-protocols.md` §6): they differ across engines, versions and
//! hash algorithms, while token ids do not.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::ids::BlockKey;

/// The cache partition a block belongs to. Blocks of different namespaces never share a prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Namespace(u64);

impl Namespace {
    /// The namespace of requests without a LoRA adapter or cache salt.
    pub const DEFAULT: Namespace = Namespace(0x6b76_6761_7465_0001);

    /// The namespace for a LoRA adapter and a cache salt (either may be absent).
    pub fn new(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        if lora_name.is_none() && cache_salt.is_none() {
            return Namespace::DEFAULT;
        }
        let mut material = Vec::with_capacity(64);
        for part in [lora_name, cache_salt] {
            match part {
                Some(s) => {
                    material.push(1u8);
                    material.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    material.extend_from_slice(s.as_bytes());
                }
                None => material.push(0u8),
            }
        }
        Namespace(xxh3_64_with_seed(&material, Namespace::DEFAULT.0))
    }

    /// The chain seed for the first block.
    pub fn root(self) -> BlockKey {
        BlockKey(self.0)
    }
}

/// Computes chained block keys, reusing one scratch buffer across calls.
#[derive(Debug, Default)]
pub struct BlockHasher {
    #[cfg_attr(target_endian = "little", allow(dead_code))]
    scratch: Vec<u8>,
}

impl BlockHasher {
    /// A hasher with an empty scratch buffer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The key of one block whose predecessor has key `parent`.
    pub fn block_key(&mut self, parent: BlockKey, tokens: &[u32]) -> BlockKey {
        BlockKey(xxh3_64_with_seed(self.le_bytes(tokens), parent.0))
    }

    /// The tokens as little-endian bytes: a view on little-endian machines, a copy elsewhere, so keys
    /// are the same on every architecture.
    #[cfg(target_endian = "little")]
    fn le_bytes<'a>(&'a mut self, tokens: &'a [u32]) -> &'a [u8] {
        bytemuck::cast_slice(tokens)
    }

    #[cfg(not(target_endian = "little"))]
    fn le_bytes<'a>(&'a mut self, tokens: &'a [u32]) -> &'a [u8] {
        self.scratch.clear();
        for t in tokens {
            self.scratch.extend_from_slice(&t.to_le_bytes());
        }
        &self.scratch
    }

    /// Appends to `out` the keys of every full block of `tokens`, chained from `parent`. A trailing
    /// partial block gets no key: engines only publish full blocks.
    pub fn extend_keys(&mut self, parent: BlockKey, tokens: &[u32], block_size: usize, out: &mut Vec<BlockKey>) {
        if block_size == 0 {
            return;
        }
        let mut key = parent;
        for block in tokens.chunks_exact(block_size) {
            key = self.block_key(key, block);
            out.push(key);
        }
    }

    /// The keys of every full block of a prompt in `namespace`.
    pub fn prompt_keys(&mut self, namespace: Namespace, tokens: &[u32], block_size: usize) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        self.extend_keys(namespace.root(), tokens, block_size, &mut out);
        out
    }
}

/// Deterministic pseudo-random token ids for synthetic workloads (fleet snapshots, simulations,
/// trace replay, tests): the same seed always gives the same tokens, position by position, so a
/// shorter expansion is a prefix of a longer one and distinct seeds give unrelated prompts.
pub fn synthetic_tokens(seed: u64, n: usize) -> Vec<u32> {
    // splitmix64 of the position: stateless, so any range can be produced independently.
    (0..n as u64)
        .map(|i| {
            let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % SYNTHETIC_VOCAB) as u32
        })
        .collect()
}

/// Vocabulary size of [`synthetic_tokens`], about that of current large tokenizers.
pub const SYNTHETIC_VOCAB: u64 = 150_000;

/// A stable 64-bit digest of a string, for deriving deterministic synthetic content from names.
pub fn digest_str(s: &str) -> u64 {
    xxh3_64(s.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_give_equal_keys_and_divergence_changes_every_later_key() {
        let mut h = BlockHasher::new();
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 9999;
        let ka = h.prompt_keys(Namespace::DEFAULT, &a, 16);
        let kb = h.prompt_keys(Namespace::DEFAULT, &b, 16);
        assert_eq!(ka.len(), 4);
        assert_eq!(ka[0], kb[0]);
        assert!(ka[1..].iter().zip(&kb[1..]).all(|(x, y)| x != y));
    }

    #[test]
    fn keys_hash_tokens_as_little_endian_u32() {
        let mut h = BlockHasher::new();
        let bytes: Vec<u8> = [1u32, 2, 3].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(h.block_key(BlockKey(5), &[1, 2, 3]), BlockKey(xxh3_64_with_seed(&bytes, 5)));
    }

    #[test]
    fn partial_trailing_block_gets_no_key() {
        let mut h = BlockHasher::new();
        let tokens: Vec<u32> = (0..40).collect();
        assert_eq!(h.prompt_keys(Namespace::DEFAULT, &tokens, 16).len(), 2);
    }

    #[test]
    fn namespaces_separate_identical_tokens() {
        let mut h = BlockHasher::new();
        let t: Vec<u32> = (0..16).collect();
        let plain = h.prompt_keys(Namespace::DEFAULT, &t, 16);
        let salted = h.prompt_keys(Namespace::new(None, Some("tenant-a")), &t, 16);
        let lora = h.prompt_keys(Namespace::new(Some("tenant-a"), None), &t, 16);
        assert_ne!(plain, salted);
        assert_ne!(salted, lora);
        assert_eq!(Namespace::new(None, None), Namespace::DEFAULT);
    }
}
