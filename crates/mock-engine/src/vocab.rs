//! The mock model's tokenizer, for gRPC mode: a gRPC worker answers in token ids, so the gateway
//! needs a tokenizer that turns them back into text, which the built-in one (hashed pieces) cannot.
//! Real workers hand over their model's `tokenizer.json` (`GetTokenizer`); the mock hands over this
//! one, written out here rather than trained so that every mock process, in any order, serves the
//! very same file (HuggingFace's trainer breaks ties through hash maps seeded per process).
//!
//! It is a byte-level BPE as GPT-2's: the 256 byte symbols, then merges that make one token of
//! each filler word the mock generates (with its leading space), of every number below 3,000, of
//! some common words and of the demo's prompt words' stems (`sys3w`), so the demo's prompt words
//! cost two tokens each rather than one per byte. Any text at all still encodes (byte by byte where
//! no merge applies) and decodes back exactly.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::sync::OnceLock;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// The filler words the mock generates, in order, each with its leading space.
pub const OUTPUT_WORDS: [&str; 8] = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"];

/// Words given a token of their own besides the output words: the roles of the chat template and
/// common English, so a prompt written in words stays short.
const COMMON_WORDS: [&str; 40] = [
    "system",
    "user",
    "assistant",
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "with",
    "as",
    "on",
    "be",
    "at",
    "by",
    "this",
    "are",
    "from",
    "or",
    "an",
    "what",
    "which",
    "you",
    "your",
    "question",
    "answer",
    "hello",
    "world",
    "say",
    "please",
    "about",
    "request",
    "prompt",
    "warm",
    "up",
    "helpful",
    "brief",
];

/// The special token that ends a sequence.
pub const EOS: &str = "<|end|>";

/// The chat template shipped in `tokenizer_config.json` (the same shape as the built-in
/// tokenizer's rendering).
const CHAT_TEMPLATE: &str = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}\
{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

/// The mock model's tokenizer files and what the mock needs to know of them.
#[derive(Debug)]
pub struct MockVocab {
    /// `tokenizer.json`.
    pub tokenizer_json: String,
    /// `tokenizer_config.json` (the chat template, the EOS token).
    pub tokenizer_config_json: String,
    /// The id of [`EOS`].
    pub eos: u32,
    /// Tokens in the vocabulary, special ones included.
    pub vocab_size: u32,
    /// The id of each of [`OUTPUT_WORDS`] with its leading space.
    pub output_ids: Vec<u32>,
    /// The files as the zip archive `GetTokenizer` sends.
    pub archive: Vec<u8>,
    /// The archive's hex SHA-256.
    pub sha256: String,
}

/// The vocabulary, built once per process.
pub fn vocab() -> &'static MockVocab {
    static VOCAB: OnceLock<MockVocab> = OnceLock::new();
    VOCAB.get_or_init(build)
}

/// GPT-2's map from bytes to the printable characters byte-level BPE writes them as.
fn byte_symbols() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0..256u32)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).expect("below the surrogates")
        })
        .collect()
}

/// The byte-level spelling of `text`.
fn spelled(symbols: &[char], text: &str) -> Vec<String> {
    text.bytes().map(|b| symbols[usize::from(b)].to_string()).collect()
}

/// Merges in rank order, and the vocabulary they and the byte symbols make.
#[derive(Default)]
struct Merges {
    vocab: BTreeMap<String, u32>,
    ranks: HashMap<(String, String), usize>,
    list: Vec<(String, String)>,
}

impl Merges {
    fn add_token(&mut self, token: String) {
        let id = self.vocab.len() as u32;
        self.vocab.entry(token).or_insert(id);
    }

    /// `pieces` as byte-level BPE leaves them: the adjacent pair of the lowest rank merged first
    /// (the leftmost among equals), until no pair has a merge.
    fn apply(&self, mut pieces: Vec<String>) -> Vec<String> {
        loop {
            let best = (0..pieces.len().saturating_sub(1))
                .filter_map(|i| self.ranks.get(&(pieces[i].clone(), pieces[i + 1].clone())).map(|&r| (r, i)))
                .min();
            let Some((_, i)) = best else { return pieces };
            let right = pieces.remove(i + 1);
            pieces[i].push_str(&right);
        }
    }

    /// Makes `text` one token: while BPE leaves it in pieces, the first two are given a merge of
    /// the lowest priority yet. Each new merge fires only once both its pieces exist, so it
    /// changes the tokens of no word made one token before.
    fn make_token(&mut self, symbols: &[char], text: &str) {
        loop {
            let pieces = self.apply(spelled(symbols, text));
            if pieces.len() < 2 {
                return;
            }
            let pair = (pieces[0].clone(), pieces[1].clone());
            self.add_token(format!("{}{}", pair.0, pair.1));
            self.ranks.insert(pair.clone(), self.list.len());
            self.list.push(pair);
        }
    }
}

fn build() -> MockVocab {
    let symbols = byte_symbols();
    let mut merges = Merges::default();
    for c in &symbols {
        merges.add_token(c.to_string());
    }
    for n in 10..3000 {
        merges.make_token(&symbols, &n.to_string());
    }
    for word in OUTPUT_WORDS.iter().chain(&COMMON_WORDS) {
        merges.make_token(&symbols, &format!(" {word}"));
        merges.make_token(&symbols, word);
    }
    for k in 0..10 {
        merges.make_token(&symbols, &format!(" sys{k}w"));
        merges.make_token(&symbols, &format!("sys{k}w"));
    }
    let Merges { vocab, list: merges, .. } = merges;
    let output_ids = OUTPUT_WORDS.iter().map(|w| vocab[&spelled(&symbols, &format!(" {w}")).concat()]).collect();
    let eos = vocab.len() as u32;
    let vocab_size = eos + 1;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": eos, "content": EOS, "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}],
        "normalizer": null,
        // A word with its leading space is one piece (GPT-2's own split would cut `sys3w417` into
        // four); the pieces then become bytes.
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": " ?[^\\s]+|\\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<Value>>()},
    });
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    });
    let tokenizer_json = tokenizer.to_string();
    let tokenizer_config_json = config.to_string();
    let archive = zip_of(&[("tokenizer.json", &tokenizer_json), ("tokenizer_config.json", &tokenizer_config_json)]);
    let sha256 = Sha256::digest(&archive).iter().map(|b| format!("{b:02x}")).collect();
    MockVocab { tokenizer_json, tokenizer_config_json, eos, vocab_size, output_ids, archive, sha256 }
}

/// A zip archive of `files`, stored uncompressed and with fixed times, so that it is the same
/// bytes in every process.
fn zip_of(files: &[(&str, &String)]) -> Vec<u8> {
    let mut out = std::io::Cursor::new(Vec::new());
    let mut zip = zip::ZipWriter::new(&mut out);
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .last_modified_time(zip::DateTime::default());
    for (name, text) in files {
        // Writing into memory cannot fail.
        zip.start_file(*name, options).expect("an in-memory archive");
        zip.write_all(text.as_bytes()).expect("an in-memory archive");
    }
    zip.finish().expect("an in-memory archive");
    out.into_inner()
}

#[cfg(test)]
mod tests {
    use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
    use serde_json::json;

    use super::*;

    /// The files written where a gateway would unpack them (`test`: a directory of its own).
    fn tokenizer(test: &str) -> HfTokenizer {
        let dir = std::env::temp_dir().join(format!("kvgate-mock-vocab-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), &vocab().tokenizer_json).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), &vocab().tokenizer_config_json).unwrap();
        HfTokenizer::load(&dir.join("tokenizer.json"), HfOptions::default()).unwrap()
    }

    /// Ids decoded one at a time, as the gateway decodes a gRPC worker's output.
    fn decode(t: &HfTokenizer, ids: &[u32]) -> String {
        let mut d = t.detokenizer(&[], true).unwrap();
        let mut text: String = ids.iter().map(|&id| d.step(id).unwrap()).collect();
        text.push_str(&d.pending().unwrap());
        text
    }

    #[test]
    fn output_words_are_one_token_each_and_decode_back() {
        let t = tokenizer("output");
        let text: String = OUTPUT_WORDS.iter().map(|w| format!(" {w}")).collect();
        assert_eq!(t.encode_prompt(&text, false).unwrap(), vocab().output_ids);
        assert_eq!(decode(&t, &vocab().output_ids), text);
    }

    #[test]
    fn any_text_round_trips_and_prompt_words_stay_short() {
        let t = tokenizer("any");
        for text in ["naïve 東京 🙂, ok?\n\ttabs", "sys3w417 sys3w418 sys3w419 ", "<|user|>\nhello world\n"] {
            let ids = t.encode_prompt(text, false).unwrap();
            assert_eq!(decode(&t, &ids), text);
        }
        let words: String = (0..100).map(|i| format!(" sys2w{}", i * 29)).collect();
        let per_word = t.encode_prompt(&words, false).unwrap().len() as f64 / 100.0;
        assert_eq!(per_word, 2.0, "tokens a word");
        let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(t.render_chat(&chat).unwrap(), "<|user|>\nhi\n<|assistant|>\n");
    }

    #[test]
    fn the_archive_is_the_same_bytes_every_time() {
        assert_eq!(build().archive, vocab().archive);
        assert_eq!(vocab().sha256.len(), 64);
        assert_eq!(vocab().eos + 1, vocab().vocab_size);
    }
}
