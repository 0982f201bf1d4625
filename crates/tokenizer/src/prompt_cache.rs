//! Token ids of long prompts, reused chunk by chunk across requests.
//!
//! A shared system prompt, a document sent again, or an agent's growing transcript would otherwise
//! be tokenized in full by every request: about 12 ms for 7,000 tokens of a real BPE tokenizer, and
//! nearly all of the gateway's work. This cache cuts a prompt's text into chunks at positions where
//! the tokenizer provably splits it, tokenizes each chunk on its own, and keeps the ids of every
//! chunk it has seen, so text met before costs a hash and a compare.
//!
//! # Why the cuts are exact
//!
//! A HuggingFace tokenizer splits the text at added tokens, normalizes each part, pre-tokenizes it
//! into pieces and runs the model (BPE) on every piece on its own. If no piece and no added token
//! spans a cut, the ids of the whole text are the ids of the chunks one after the other. A cut is
//! placed only between an ASCII letter or digit and a space that is followed by an ASCII letter
//! (`…word| next…`), and is used only for tokenizers whose pipeline is known to split there:
//!
//! - pre-tokenizer: GPT-2's byte-level regex, or `Split` regexes from [`SPLITTING_REGEXES`] (DeepSeek
//!   V3's, Llama 3's, Qwen 2's) with only refining stages (digits, CJK runs, byte-level mapping)
//!   around them. In each of these regexes no alternative matches a letter or digit followed by a
//!   space, and every character is matched by some alternative, so a piece always ends at the cut;
//! - normalizer: none, or Unicode normalization forms, which never combine a space with what
//!   precedes it;
//! - added tokens: none contains a space, starts with an ASCII letter or ends with an ASCII letter
//!   or digit, so none can match across a cut or strip the space after one;
//! - no truncation or padding, and a post-processor that only puts fixed ids around the sequence.
//!
//! A chunk after the first begins with the space, so neither byte-level `add_prefix_space` nor any
//! "first piece" rule treats it differently from the same text inside the whole prompt; the first
//! chunk is cached apart from the same text met later in a prompt. The property tests in
//! `tests/prompt_cache.rs` check ids equal to a full tokenization, with the real tokenizers.
//!
//! Cuts are content-defined (chosen from the word before them, with a minimum and a maximum chunk
//! length), so the same text is cut the same way wherever it starts.
//!
//! A chunk the cache lacks is often a shared text's last chunk run on into this request's own words
//! (a content-defined cut fell in them, one request in about `one_in`): it is looked up again in
//! [`TAIL_PIECE`] pieces, cut as a prompt's tail is, which the requests before cached, and only
//! from the first piece missing on is it tokenized. Without this, such a request tokenized up to
//! `max_chunk` bytes (about 1.2 ms with DeepSeek V3's tokenizer) where the others took 70 bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lru::LruCache;
use serde_json::Value;
use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::routed::{estimate_tokens, PromptIds, RoutingProbe, Untokenized, Whole};
use crate::TokenizeError;

/// Default memory for cached chunks (their text and ids).
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// Pre-tokenizer regexes known to end a piece between an ASCII letter or digit and a following
/// space, and to match every character (see the module docs): DeepSeek V3's, Llama 3's and
/// Qwen 2's, as their `tokenizer.json` files spell them.
pub const SPLITTING_REGEXES: [&str; 3] = [
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];

/// Regexes that only refine pieces: their matches never hold a space (digit runs, CJK runs).
const REFINING_REGEXES: [&str; 3] = ["\\p{N}{1,3}", "\\p{N}", "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"];

/// How a prompt's text is cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunking {
    /// No cut closer than this to the previous one.
    pub min_chunk: usize,
    /// At the first possible cut past this length, cut whatever the word.
    pub max_chunk: usize,
    /// Between those, cut after one word in this many (by the word's hash).
    pub one_in: u64,
    /// Shorter prompts are tokenized whole: their chunks would cost more to look up than to compute.
    pub min_prompt: usize,
}

impl Chunking {
    /// Whether the word whose [`word_hash`] is `hash` ends a content-defined chunk. A mask when
    /// `one_in` is a power of two (the default): a 64-bit division per candidate word was the
    /// largest single cost of finding a prompt's cuts.
    fn cuts_after(&self, hash: u64) -> bool {
        let one_in = self.one_in.max(1);
        if one_in.is_power_of_two() {
            hash & (one_in - 1) == 0
        } else {
            hash.is_multiple_of(one_in)
        }
    }
}

impl Default for Chunking {
    fn default() -> Self {
        Chunking { min_chunk: 256, max_chunk: 4096, one_in: 16, min_prompt: 2048 }
    }
}

/// Past a prompt's last content-defined cut, its tail is cut at every possible cut at least this
/// many bytes apart. A shared prefix's tail is the same text in every request that shares it, so
/// its pieces come from the cache, and only the piece where the request's own text begins is
/// tokenized; that piece is where routing usually stops ([`crate::routed`]).
pub const TAIL_PIECE: usize = 64;

/// Whether the space at `b` may be a cut: `…word| next…`.
fn may_cut(bytes: &[u8], b: usize) -> bool {
    b > 0 && b + 1 < bytes.len() && bytes[b - 1].is_ascii_alphanumeric() && bytes[b + 1].is_ascii_alphabetic()
}

/// The cuts strictly between `from` and `to` that a prompt's tail would get if it began at `from`:
/// each the first possible cut at least [`TAIL_PIECE`] bytes past the one before.
fn piece_cuts(bytes: &[u8], from: usize, to: usize) -> impl Iterator<Item = usize> + '_ {
    let mut last = from;
    memchr::memchr_iter(b' ', &bytes[from..to]).map(move |i| from + i).filter(move |&b| {
        let cut = b - last >= TAIL_PIECE && may_cut(bytes, b);
        if cut {
            last = b;
        }
        cut
    })
}

/// Where `text` may be cut, in byte offsets, by `chunking`'s rule: content-defined, so a text is
/// cut the same way wherever it starts (after its first cut).
pub fn cut_points(text: &str, chunking: &Chunking) -> Vec<usize> {
    let bytes = text.as_bytes();
    let mut cuts = Vec::new();
    let mut last = 0usize;
    // Every request scans its whole prompt: spaces are found with memchr's vectorised search.
    for b in memchr::memchr_iter(b' ', bytes) {
        if !may_cut(bytes, b) {
            continue;
        }
        let len = b - last;
        if len < chunking.min_chunk {
            continue;
        }
        if len >= chunking.max_chunk || chunking.cuts_after(word_hash(&bytes[last..b])) {
            cuts.push(b);
            last = b;
        }
    }
    cuts
}

/// Every cut a prompt is tokenized at: [`cut_points`]; before the first of them, head pieces of
/// [`TAIL_PIECE`] bytes or more, each at least twice the one before; past the last of them, the
/// tail cut every [`TAIL_PIECE`] bytes or more. Without a content-defined cut there is no tail.
pub fn cut_points_with_tail(text: &str, chunking: &Chunking) -> Vec<usize> {
    Cuts::new(text, *chunking).collect()
}

/// [`cut_points_with_tail`] found as they are asked for, so that a prompt routing stops tokenizing
/// early is scanned no further ([`crate::routed`]).
///
/// The head pieces serve routing: whether any worker holds a prompt's first block is known after
/// its first few dozen ids, so a never-seen prompt costs a 64-byte piece instead of a first chunk
/// of up to 4 KiB. They are cut from the prompt's start, so prompts that begin alike (a shared
/// system prompt) share them in the cache; doubling keeps a long head to a few pieces.
pub struct Cuts<'a> {
    bytes: &'a [u8],
    chunking: Chunking,
    /// Where the scan reads its next 8 bytes from.
    pos: usize,
    /// Where the 8 bytes `spaces` marks were read from.
    word_at: usize,
    /// The spaces not yet looked at in those 8 bytes: the high bit of each byte that is one.
    spaces: u64,
    /// The last cut given.
    last: usize,
    /// The last content-defined cut (0 before the first).
    last_content: usize,
    /// The least length of the next head piece; 0 once past the head.
    head_piece: usize,
    /// Whether the scan has passed the last content-defined cut.
    in_tail: bool,
}

/// The high bit of every byte of `word` that is a space, and no other bit: SWAR's exact zero-byte
/// test (no carry crosses a byte, so no false positive).
fn space_bits(word: u64) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    let x = word ^ 0x2020_2020_2020_2020;
    !(((x & LOW7) + LOW7) | x | LOW7)
}

impl<'a> Cuts<'a> {
    /// The cuts of `text`.
    pub fn new(text: &'a str, chunking: Chunking) -> Self {
        let bytes = text.as_bytes();
        Cuts {
            bytes,
            chunking,
            pos: 0,
            word_at: 0,
            spaces: 0,
            last: 0,
            last_content: 0,
            head_piece: TAIL_PIECE,
            in_tail: false,
        }
    }

    /// Goes on scanning from `pos`, forgetting what was read ahead.
    fn seek(&mut self, pos: usize) {
        self.pos = pos;
        self.spaces = 0;
    }

    /// The next space from the scan's position on that [`may_cut`] allows.
    ///
    /// Every request scans its prompt, a space every few bytes: reading 8 bytes at a time and
    /// marking their spaces with a few word operations took 27% fewer instructions over a 32 KB
    /// prompt than one `memchr` call per space (callgrind); with the inline hash and the mask, the
    /// `cut_points` bench took 42% less time. Written by hand: `memchr` finds one byte at a time,
    /// not every match in a word.
    fn next_candidate(&mut self) -> Option<usize> {
        loop {
            while self.spaces == 0 {
                let rest = self.bytes.get(self.pos..).filter(|r| !r.is_empty())?;
                let word = match rest.first_chunk::<8>() {
                    Some(eight) => *eight,
                    None => {
                        // The text's last few bytes, padded with zeros (which are not spaces).
                        let mut padded = [0u8; 8];
                        padded[..rest.len()].copy_from_slice(rest);
                        padded
                    }
                };
                self.word_at = self.pos;
                self.pos += 8;
                self.spaces = space_bits(u64::from_le_bytes(word));
            }
            let b = self.word_at + (self.spaces.trailing_zeros() / 8) as usize;
            self.spaces &= self.spaces - 1;
            if may_cut(self.bytes, b) {
                return Some(b);
            }
        }
    }
}

impl Iterator for Cuts<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        loop {
            let Some(b) = self.next_candidate() else {
                if self.in_tail || self.last_content == 0 {
                    return None;
                }
                self.in_tail = true;
                self.last = self.last_content;
                self.seek(self.last_content);
                continue;
            };
            if self.in_tail {
                if b - self.last >= TAIL_PIECE {
                    self.last = b;
                    return Some(b);
                }
                continue;
            }
            let len = b - self.last_content;
            let content = len >= self.chunking.min_chunk
                && (len >= self.chunking.max_chunk
                    || self.chunking.cuts_after(word_hash(&self.bytes[self.last_content..b])));
            if content {
                self.last_content = b;
                self.head_piece = 0;
                // No content-defined cut comes closer than `min_chunk` to this one, and past the
                // head no other kind does before the tail (which is scanned again): skip there.
                self.seek(b + self.chunking.min_chunk);
            } else if self.head_piece > 0 && b - self.last >= self.head_piece {
                self.head_piece *= 2;
            } else {
                continue;
            }
            self.last = b;
            return Some(b);
        }
    }
}

/// The hash of the last 8 bytes of `text` (all of it if shorter): the end of the word just before
/// a cut, which alone decides whether to cut there, so a text is cut the same way wherever it
/// starts (callers pass the chunk so far, so these bytes are always the chunk's own).
///
/// One load and one multiply, not a general-purpose hash: every request hashes about one word in
/// twenty of its prompt, and a call into xxh3 for each was a third of finding a prompt's cuts.
fn word_hash(text: &[u8]) -> u64 {
    let packed = match text.last_chunk::<8>() {
        Some(last) => u64::from_le_bytes(*last),
        None => text.iter().fold(u64::from(0x80u8), |v, &c| (v << 8) | u64::from(c)),
    };
    // A folded 128-bit multiply (as foldhash and wyhash mix): every output bit depends on every
    // input bit, so the low bits [`Chunking::cuts_after`] tests are well spread.
    let product = u128::from(packed) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Why a tokenizer's prompts cannot be cut (the first rule of the module docs it breaks).
pub fn why_not_cuttable(tokenizer: &Tokenizer) -> Option<String> {
    if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
        return Some("it truncates or pads".into());
    }
    let normalizer = serde_json::to_value(tokenizer.get_normalizer()).unwrap_or(Value::Bool(false));
    if !normalizer_keeps_cuts(&normalizer) {
        return Some(format!("its normalizer {} may change text across a cut", normalizer["type"]));
    }
    let pre_tokenizer = serde_json::to_value(tokenizer.get_pre_tokenizer()).unwrap_or(Value::Null);
    if pre_tokenizer_splits(&pre_tokenizer) != Some(true) {
        return Some("its pre-tokenizer is not one known to split between a word and a space".into());
    }
    let mut added: Vec<String> = tokenizer.get_added_tokens_decoder().into_values().map(|t| t.content).collect();
    added.sort();
    for content in added {
        let starts = content.bytes().next().is_some_and(|c| c.is_ascii_alphabetic());
        let ends = content.bytes().last().is_some_and(|c| c.is_ascii_alphanumeric());
        if content.contains(' ') || starts || ends {
            return Some(format!("its added token {content:?} could match across a cut"));
        }
    }
    None
}

fn normalizer_keeps_cuts(n: &Value) -> bool {
    match n["type"].as_str() {
        None => n.is_null(),
        Some("NFC" | "NFD" | "NFKC" | "NFKD") => true,
        Some("Sequence") => n["normalizers"].as_array().is_some_and(|l| l.iter().all(normalizer_keeps_cuts)),
        Some(_) => false,
    }
}

/// `Some(true)`: the pre-tokenizer ends a piece at every cut; `Some(false)`: it only refines pieces
/// (so something else must split); `None`: unknown, or it could join text across a cut.
fn pre_tokenizer_splits(p: &Value) -> Option<bool> {
    match p["type"].as_str()? {
        "ByteLevel" => Some(p["use_regex"].as_bool().unwrap_or(true)),
        "Digits" => Some(false),
        "Split" => {
            let isolated = p["behavior"] == "Isolated" && p["invert"] == false;
            let regex = p["pattern"]["Regex"].as_str()?;
            if !isolated {
                None
            } else if SPLITTING_REGEXES.contains(&regex) {
                Some(true)
            } else if REFINING_REGEXES.contains(&regex) {
                Some(false)
            } else {
                None
            }
        }
        "Sequence" => {
            let mut splits = false;
            for stage in p["pretokenizers"].as_array()? {
                splits |= pre_tokenizer_splits(stage)?;
            }
            Some(splits)
        }
        _ => None,
    }
}

/// What the cache has done, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    /// Chunks found in the cache.
    pub hits: u64,
    /// Chunks tokenized (and then kept).
    pub misses: u64,
    /// Prompt bytes whose ids came from the cache.
    pub hit_bytes: u64,
    /// Prompt bytes tokenized, uncut tails included.
    pub miss_bytes: u64,
    /// Ids the hit and tokenized bytes came to: with the bytes, the traffic's ids per byte, which
    /// sizes what routing leaves untokenized ([`crate::routed`]).
    pub seen_tokens: u64,
    /// Prompts routed on their start, the rest left untokenized.
    pub partial_prompts: u64,
    /// Bytes those prompts left untokenized.
    pub untokenized_bytes: u64,
    /// Memory the cached chunks take now.
    pub bytes: u64,
    /// Chunks cached now.
    pub entries: u64,
    /// The memory budget.
    pub capacity_bytes: u64,
}

/// One cached chunk: its text (compared on every hit, so a hash collision costs a miss, never
/// wrong ids) and its ids.
struct Chunk {
    first: bool,
    text: Box<str>,
    ids: Box<[u32]>,
}

impl Chunk {
    fn cost(&self) -> usize {
        self.text.len() + 4 * self.ids.len() + 64
    }
}

struct Inner {
    /// Keyed by the chunk's xxh3 hash already: Fx mixes it cheaply instead of SipHash-ing it again.
    chunks: LruCache<u64, Chunk, rustc_hash::FxBuildHasher>,
    bytes: usize,
}

/// The ids a tokenizer's post-processor puts before and after a sequence (BOS, EOS).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Affixes {
    before: Vec<u32>,
    after: Vec<u32>,
}

/// The chunk cache of one tokenizer. Shared by all requests; lookups take a short lock, tokenizing
/// a missed chunk does not.
pub struct PromptCache {
    tokenizer: Arc<Tokenizer>,
    chunking: Chunking,
    capacity: usize,
    inner: Mutex<Inner>,
    /// `None` when the post-processor adds something other than fixed ids: such prompts with
    /// special tokens are tokenized whole.
    affixes: Option<Affixes>,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_bytes: AtomicU64,
    miss_bytes: AtomicU64,
    seen_tokens: AtomicU64,
    partial_prompts: AtomicU64,
    untokenized_bytes: AtomicU64,
}

impl std::fmt::Debug for PromptCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptCache").field("capacity", &self.capacity).field("stats", &self.stats()).finish()
    }
}

/// Token ids only: `encode_fast` skips the offsets `encode` computes, and gives the same ids.
pub(crate) fn ids_of(tokenizer: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
    tokenizer.encode_fast(text, special).map(|e| e.get_ids().to_vec()).map_err(|e| TokenizeError::Encode(e.to_string()))
}

/// The fixed ids the post-processor adds, if that is all it does (checked on a few texts).
fn affixes(tokenizer: &Tokenizer) -> Option<Affixes> {
    let mut found: Option<Affixes> = None;
    for probe in ["a", "Hello world 12", " x\n y"] {
        let with = ids_of(tokenizer, probe, true).ok()?;
        let without = ids_of(tokenizer, probe, false).ok()?;
        let at = (0..=with.len().checked_sub(without.len())?).find(|&i| with[i..i + without.len()] == without[..])?;
        let this = Affixes { before: with[..at].to_vec(), after: with[at + without.len()..].to_vec() };
        match &found {
            Some(f) if *f != this => return None,
            _ => found = Some(this),
        }
    }
    found
}

impl PromptCache {
    /// A cache for `tokenizer`'s prompts of at most `capacity_bytes`, or why its prompts cannot be
    /// cut (they are then tokenized whole).
    pub fn new(tokenizer: Arc<Tokenizer>, capacity_bytes: usize, chunking: Chunking) -> Result<PromptCache, String> {
        if let Some(why) = why_not_cuttable(&tokenizer) {
            return Err(why);
        }
        let affixes = affixes(&tokenizer);
        Ok(PromptCache {
            tokenizer,
            chunking,
            capacity: capacity_bytes,
            inner: Mutex::new(Inner { chunks: LruCache::unbounded_with_hasher(rustc_hash::FxBuildHasher), bytes: 0 }),
            affixes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hit_bytes: AtomicU64::new(0),
            miss_bytes: AtomicU64::new(0),
            seen_tokens: AtomicU64::new(0),
            partial_prompts: AtomicU64::new(0),
            untokenized_bytes: AtomicU64::new(0),
        })
    }

    /// The ids of `text`, from cached chunks where possible; `None` when the text is not worth
    /// cutting (short, or no cut) or its special tokens cannot be added here: tokenize it whole.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Option<Result<Vec<u32>, TokenizeError>> {
        let mut whole = Whole;
        let encoded = self.encode_routed(text, add_special_tokens, &mut whole)?;
        Some(encoded.map(|p| p.ids))
    }

    /// The ids of `text` from its start, piece by piece, for as long as `probe` wants more
    /// ([`crate::routed`]); `None` as for [`PromptCache::encode`].
    pub fn encode_routed(
        &self,
        text: &str,
        add_special_tokens: bool,
        probe: &mut dyn RoutingProbe,
    ) -> Option<Result<PromptIds, TokenizeError>> {
        if text.len() < self.chunking.min_prompt || (add_special_tokens && self.affixes.is_none()) {
            return None;
        }
        let mut cuts = Cuts::new(text, self.chunking).peekable();
        cuts.peek()?;
        let mut ids = Vec::with_capacity(text.len() / 3);
        let affixes = self.affixes.as_ref().filter(|_| add_special_tokens);
        if let Some(a) = affixes {
            ids.extend_from_slice(&a.before);
        }
        let opened = ids.len();
        // Asked before any text: a prompt that routing already has enough of (nothing held at all
        // in its namespace) costs no tokenizing.
        let encoded = if probe.wants_more(&ids) {
            self.encode_from(text, 0, cuts, add_special_tokens, &mut ids, probe)
        } else {
            Ok(Some(0))
        };
        Some(encoded.map(|stopped| match stopped {
            None => PromptIds::whole(ids),
            Some(from) => {
                let known = ids.len() - opened;
                let rest = self.untokenized(text, from, add_special_tokens, known as u64);
                PromptIds { ids, rest: Some(rest) }
            }
        }))
    }

    /// The ids of what [`PromptCache::encode_routed`] left untokenized, the closing special ids
    /// included: appended to the ids it returned, they are a whole tokenization's.
    pub fn finish(&self, rest: &Untokenized) -> Result<Vec<u32>, TokenizeError> {
        let cuts = Cuts::new(&rest.text, self.chunking).skip_while(|&c| c <= rest.from);
        let mut ids = Vec::with_capacity(rest.bytes() / 3);
        self.encode_from(&rest.text, rest.from, cuts, rest.add_special_tokens, &mut ids, &mut Whole)?;
        Ok(ids)
    }

    /// Appends the ids of `text[from..]` (`from` 0 or a cut; `cuts` those past it) to `ids`, asking
    /// `probe` after each piece; returns where it stopped, if it did.
    fn encode_from(
        &self,
        text: &str,
        from: usize,
        cuts: impl Iterator<Item = usize>,
        add_special_tokens: bool,
        ids: &mut Vec<u32>,
        probe: &mut dyn RoutingProbe,
    ) -> Result<Option<usize>, TokenizeError> {
        let mut start = from;
        for end in cuts {
            if !self.append_cached(&text[start..end], start == 0, ids) {
                if let Some(stopped) = self.append_missed(text, start, end, ids, probe)? {
                    return Ok(Some(stopped));
                }
            }
            start = end;
            if !probe.wants_more(ids) {
                return Ok(Some(start));
            }
        }
        // The tail ends the prompt, not at a cut: likely this request's own text, so not kept.
        let tail = &text[start..];
        if !probe.may_tokenize(tail.len()) {
            return Err(TokenizeError::Deferred);
        }
        let own = ids_of(&self.tokenizer, tail, false)?;
        self.miss_bytes.fetch_add(tail.len() as u64, Ordering::Relaxed);
        self.seen_tokens.fetch_add(own.len() as u64, Ordering::Relaxed);
        ids.extend(own);
        if add_special_tokens {
            ids.extend_from_slice(&self.affixes.as_ref().expect("checked by encode_routed").after);
        }
        Ok(None)
    }

    /// The part of `text` from `from` on, left untokenized after `known_tokens` ids of its start,
    /// with its size estimated ([`crate::routed::estimate_tokens`]).
    fn untokenized(&self, text: &str, from: usize, add_special_tokens: bool, known_tokens: u64) -> Untokenized {
        let rest_bytes = (text.len() - from) as u64;
        let seen_bytes = self.hit_bytes.load(Ordering::Relaxed) + self.miss_bytes.load(Ordering::Relaxed);
        let traffic = self.seen_tokens.load(Ordering::Relaxed) as f64 / seen_bytes.max(1) as f64;
        let mut estimated_tokens = estimate_tokens(rest_bytes, known_tokens, from as u64, traffic);
        if add_special_tokens {
            estimated_tokens += self.affixes.as_ref().map_or(0, |a| a.after.len() as u64);
        }
        self.partial_prompts.fetch_add(1, Ordering::Relaxed);
        self.untokenized_bytes.fetch_add(rest_bytes, Ordering::Relaxed);
        Untokenized { text: text.into(), from, add_special_tokens, estimated_tokens }
    }

    /// Appends the cached ids of `piece` to `ids`, if it is cached.
    fn append_cached(&self, piece: &str, first: bool, ids: &mut Vec<u32>) -> bool {
        let key = xxh3_64_with_seed(piece.as_bytes(), u64::from(first));
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(c) = inner.chunks.get(&key).filter(|c| c.first == first && *c.text == *piece) else {
            return false;
        };
        ids.extend_from_slice(&c.ids);
        self.hits.fetch_add(1, Ordering::Relaxed);
        self.hit_bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
        self.seen_tokens.fetch_add(c.ids.len() as u64, Ordering::Relaxed);
        true
    }

    /// Appends the ids of the chunk `text[start..end]`, which the cache lacks: from its cached
    /// pieces as far as they go (see the module docs), asking `probe` after each, then tokenized;
    /// the whole chunk is cached. Returns where it stopped, if `probe` stopped it.
    fn append_missed(
        &self,
        text: &str,
        start: usize,
        end: usize,
        ids: &mut Vec<u32>,
        probe: &mut dyn RoutingProbe,
    ) -> Result<Option<usize>, TokenizeError> {
        let opened = ids.len();
        let mut at = start;
        for cut in piece_cuts(text.as_bytes(), start, end) {
            if !self.append_cached(&text[at..cut], at == 0, ids) {
                break;
            }
            at = cut;
            if !probe.wants_more(ids) {
                return Ok(Some(at));
            }
        }
        let own = &text[at..end];
        if !probe.may_tokenize(own.len()) {
            return Err(TokenizeError::Deferred);
        }
        let own_ids = ids_of(&self.tokenizer, own, false)?;
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.miss_bytes.fetch_add(own.len() as u64, Ordering::Relaxed);
        self.seen_tokens.fetch_add(own_ids.len() as u64, Ordering::Relaxed);
        ids.extend_from_slice(&own_ids);
        let chunk = &text[start..end];
        let first = start == 0;
        self.keep(
            xxh3_64_with_seed(chunk.as_bytes(), u64::from(first)),
            Chunk { first, text: chunk.into(), ids: ids[opened..].into() },
        );
        Ok(None)
    }

    /// Caches `entry` under `key`, letting the least recently used chunks go past the budget.
    fn keep(&self, key: u64, entry: Chunk) {
        if entry.cost() > self.capacity {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.bytes += entry.cost();
        if let Some(old) = inner.chunks.put(key, entry) {
            inner.bytes -= old.cost();
        }
        while inner.bytes > self.capacity {
            match inner.chunks.pop_lru() {
                Some((_, old)) => inner.bytes -= old.cost(),
                None => break,
            }
        }
    }

    /// Counters and the memory in use.
    pub fn stats(&self) -> PromptCacheStats {
        let inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        PromptCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            hit_bytes: self.hit_bytes.load(Ordering::Relaxed),
            miss_bytes: self.miss_bytes.load(Ordering::Relaxed),
            seen_tokens: self.seen_tokens.load(Ordering::Relaxed),
            partial_prompts: self.partial_prompts.load(Ordering::Relaxed),
            untokenized_bytes: self.untokenized_bytes.load(Ordering::Relaxed),
            bytes: inner.bytes as u64,
            entries: inner.chunks.len() as u64,
            capacity_bytes: self.capacity as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Chunking {
        Chunking { min_chunk: 8, max_chunk: 32, one_in: 2, min_prompt: 0 }
    }

    #[test]
    fn cuts_fall_between_a_word_and_a_space_before_a_letter() {
        let text = "alpha beta gamma delta 12 epsilon, zeta eta theta iota kappa lambda mu nu xi omicron pi";
        let cuts = cut_points(text, &small());
        assert!(!cuts.is_empty());
        for &c in &cuts {
            let b = text.as_bytes();
            assert!(b[c] == b' ' && b[c - 1].is_ascii_alphanumeric() && b[c + 1].is_ascii_alphabetic(), "{c}");
        }
        assert!(cuts.windows(2).all(|w| w[1] - w[0] >= 8 && w[1] - w[0] <= 32 + 16));
    }

    #[test]
    fn the_same_text_is_cut_the_same_way_wherever_it_starts() {
        let body: String = (0..200).map(|i| format!("word{} ", i * 7919 % 1000)).collect();
        let a = cut_points(&format!("one preamble here {body}"), &small());
        let b = cut_points(&format!("a different and longer preamble {body}"), &small());
        let tail_a: Vec<usize> = a.iter().rev().take(20).map(|c| c - "one preamble here ".len()).collect();
        let tail_b: Vec<usize> =
            b.iter().rev().take(20).map(|c| c - "a different and longer preamble ".len()).collect();
        assert_eq!(tail_a, tail_b);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, failure_persistence: None, ..Default::default() })]

        /// The scan reads 8 bytes at a time and skips ahead; whatever the text's alignment, its
        /// content-defined cuts are the one-space-at-a-time rule's, and every cut is allowed.
        #[test]
        fn the_scan_finds_the_content_cuts_of_the_simple_rule(
            words in proptest::collection::vec("[a-z0-9]{1,7}|[ ,.]{1,3}|\\n|é", 0..400),
        ) {
            let text = words.join(" ");
            let chunking = small();
            let all = cut_points_with_tail(&text, &chunking);
            let content = cut_points(&text, &chunking);
            proptest::prop_assert!(all.windows(2).all(|w| w[0] < w[1]));
            proptest::prop_assert!(all.iter().all(|&c| may_cut(text.as_bytes(), c)));
            let mut rest = all.iter();
            proptest::prop_assert!(content.iter().all(|c| rest.any(|a| a == c)), "{content:?} in {all:?}");
        }
    }

    #[test]
    fn space_bits_mark_exactly_the_spaces() {
        for byte in 0..=255u8 {
            for at in 0..8 {
                let mut word = [b'x'; 8];
                word[at] = byte;
                let expected = if byte == b' ' { 0x80 << (8 * at) } else { 0 };
                assert_eq!(space_bits(u64::from_le_bytes(word)), expected, "byte {byte:#x} at {at}");
            }
        }
        assert_eq!(space_bits(u64::from_le_bytes(*b"  \x21\x1f\xa0 \x00 ")), 0x8000_8000_0000_8080);
    }

    #[test]
    fn text_without_spaces_or_too_short_is_not_cut() {
        assert!(cut_points("日本語のテキスト。日本語のテキスト。", &small()).is_empty());
        assert!(cut_points("a b", &small()).is_empty());
        assert!(cut_points("", &small()).is_empty());
    }

    #[test]
    fn unknown_pipelines_are_refused_with_the_reason() {
        let json = |pre: &str, normalizer: &str, added: &str| {
            format!(
                r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{added}],
                   "normalizer": {normalizer}, "pre_tokenizer": {pre}, "post_processor": null, "decoder": null,
                   "model": {{"type": "WordLevel", "vocab": {{"[UNK]": 0}}, "unk_token": "[UNK]"}}}}"#
            )
        };
        let load = |s: String| Tokenizer::from_bytes(s.as_bytes()).unwrap();
        let byte_level = r#"{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}"#;
        assert_eq!(why_not_cuttable(&load(json(byte_level, "null", ""))), None);
        let whitespace = r#"{"type": "Whitespace"}"#;
        assert!(why_not_cuttable(&load(json(whitespace, "null", ""))).unwrap().contains("pre-tokenizer"));
        let lowercase = r#"{"type": "Lowercase"}"#;
        assert!(why_not_cuttable(&load(json(byte_level, lowercase, ""))).unwrap().contains("normalizer"));
        let word_token = r#"{"id": 1, "content": "Assistant:", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}"#;
        assert!(why_not_cuttable(&load(json(byte_level, "null", word_token))).unwrap().contains("Assistant:"));
    }
}
