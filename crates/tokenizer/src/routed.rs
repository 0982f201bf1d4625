//! Tokenizing only as much of a prompt as routing needs.
//!
//! The router keys a prompt by chained blocks of token ids, and a block is worth keying only while
//! some engine may hold it: once no engine holds block `k`, none holds any block after it (each key
//! chains from the one before). So a prompt that no engine holds beyond its first blocks is
//! tokenized from its start, piece by piece at the prompt cache's exact cuts, only until a
//! [`RoutingProbe`] says the blocks so far reach past everything cached; the rest is left
//! untokenized ([`Untokenized`]) and its size estimated from its bytes. A never-seen 32 KB prompt
//! then costs its first chunk instead of 7,000 tokens of BPE.
//!
//! The estimate only sizes the uncached prefill the router projects; the engine still computes the
//! whole prompt. Whoever needs every id (a gRPC worker, an exact length check) asks the tokenizer to
//! [`finish`](crate::PromptTokenizer::finish) it, which tokenizes the rest from the cut it stopped
//! at: the ids are those of a whole tokenization, by the cache's cut argument.

use std::sync::Arc;

/// Asked, as a prompt's ids come in from its start, whether routing needs more of them.
pub trait RoutingProbe {
    /// `ids` is an exact prefix of the prompt's ids (special tokens put before it included), longer
    /// at each call after the first, which comes before any text is tokenized. False: the ids so
    /// far already decide the route; stop tokenizing.
    fn wants_more(&mut self, ids: &[u32]) -> bool;

    /// Asked before `bytes` of text the prompt cache does not hold are run through the tokenizer
    /// (cached pieces cost a lookup and are not asked about). False: stop with
    /// [`TokenizeError::Deferred`](crate::TokenizeError::Deferred), for the caller to go on
    /// where such work may take long; the pieces done so far stay cached.
    fn may_tokenize(&mut self, bytes: usize) -> bool {
        let _ = bytes;
        true
    }
}

/// A probe that always wants more: the whole prompt is tokenized.
#[derive(Debug, Clone, Copy, Default)]
pub struct Whole;

impl RoutingProbe for Whole {
    fn wants_more(&mut self, _ids: &[u32]) -> bool {
        true
    }
}

/// A prompt's ids from its start, up to where routing stopped needing them.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptIds {
    /// Ids of the prompt's start (all of them when `rest` is `None`).
    pub ids: Vec<u32>,
    /// What was left untokenized, if anything.
    pub rest: Option<Untokenized>,
}

impl PromptIds {
    /// Ids of a whole prompt.
    pub fn whole(ids: Vec<u32>) -> Self {
        PromptIds { ids, rest: None }
    }

    /// The prompt's tokens: those tokenized and the estimate for the rest.
    pub fn prompt_tokens(&self) -> u64 {
        self.ids.len() as u64 + self.rest.as_ref().map_or(0, |r| r.estimated_tokens)
    }
}

/// The end of a prompt that routing did not need tokenized, from a cut where the tokenizer provably
/// splits.
#[derive(Debug, Clone, PartialEq)]
pub struct Untokenized {
    /// The whole prompt text.
    pub(crate) text: Arc<str>,
    /// Where the untokenized part starts: a cut.
    pub(crate) from: usize,
    /// Whether the post-processor's closing ids (EOS) come after it.
    pub(crate) add_special_tokens: bool,
    /// Its estimated ids: see [`estimate_tokens`].
    pub estimated_tokens: u64,
}

impl Untokenized {
    /// Bytes of text left untokenized.
    pub fn bytes(&self) -> usize {
        self.text.len() - self.from
    }
}

/// Bytes of a prompt's own text that weigh as much as the traffic's ratio in [`estimate_tokens`]: a
/// prompt's start counts for more than the traffic's average once it is longer than this.
pub const PRIOR_BYTES: u64 = 2048;

/// Tokens per byte assumed before any text has been tokenized: English prose with a byte-level BPE
/// of 100k–150k ids runs at 0.2–0.25.
pub const DEFAULT_TOKENS_PER_BYTE: f64 = 0.25;

/// The ids `rest_bytes` of text are estimated to take, from the prompt's own start (`known_tokens`
/// ids for `known_bytes` bytes) shrunk toward the traffic's ratio `traffic_tokens_per_byte` with a
/// weight of [`PRIOR_BYTES`]. Never more than the bytes: a byte-level BPE id covers at least one
/// byte, and the prompt cache only cuts byte-level tokenizers.
pub fn estimate_tokens(rest_bytes: u64, known_tokens: u64, known_bytes: u64, traffic_tokens_per_byte: f64) -> u64 {
    let prior = if traffic_tokens_per_byte.is_finite() && traffic_tokens_per_byte > 0.0 {
        traffic_tokens_per_byte.min(1.0)
    } else {
        DEFAULT_TOKENS_PER_BYTE
    };
    let ratio = (known_tokens as f64 + prior * PRIOR_BYTES as f64) / (known_bytes + PRIOR_BYTES) as f64;
    ((rest_bytes as f64 * ratio).round() as u64).min(rest_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_leans_on_the_prompt_once_it_has_seen_enough_of_it() {
        // Nothing seen: the traffic's ratio.
        assert_eq!(estimate_tokens(1000, 0, 0, 0.2), 200);
        // Much seen at 0.5: close to 0.5.
        let seen = estimate_tokens(1000, 50_000, 100_000, 0.2);
        assert!((490..=500).contains(&seen), "{seen}");
        // A bad traffic ratio falls back to the default; never more ids than bytes.
        assert_eq!(estimate_tokens(1000, 0, 0, f64::NAN), 250);
        assert_eq!(estimate_tokens(1000, 5000, 1000, 3.0), 1000);
        assert_eq!(estimate_tokens(0, 10, 10, 0.3), 0);
    }
}
