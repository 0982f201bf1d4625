//! A gRPC worker behind the gateway: a fake SGLang scheduler served by tonic on port 0, speaking
//! kvgate's own definitions of SMG's worker protocol, in front of the real gateway with a real
//! model tokenizer (DeepSeek's, fetched by `scripts/fetch-test-tokenizer.sh`). The real engines'
//! gRPC workers are the real-engine suite's business; this checks the gateway's side: health, load
//! and identity over gRPC, token ids in and text out, stop strings matched in the gateway, aborts.

mod embeddings;
mod fake;
mod generate;
mod responses;
#[path = "../support/mod.rs"]
mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::*;
use futures_util::StreamExt;
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use kvgate_worker_proto::common;
use kvgate_worker_proto::sglang as pb;
use kvgate_worker_proto::sglang::sglang_scheduler_server::SglangSchedulerServer;
use serde_json::{json, Value};
use support::*;
use tonic::Status;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_worker_is_healthy_loaded_and_described_over_grpc() {
    let f = fixture(Duration::ZERO).await;
    let workers = f.gw.get_json("/admin/workers").await;
    let w = &workers["workers"][0];
    assert_eq!(w["healthy"], true, "{workers}");
    assert_eq!(w["telemetry"], "sglang", "the runtime was detected from the service that answered: {workers}");
    assert_eq!(w["models"], json!(["fake-model"]), "{workers}");
    assert_eq!(w["engine_block_size"], 16, "{workers}");
    assert_eq!(w["engine_kv_capacity_tokens"], 100_000, "{workers}");
    assert_eq!(w["engine_max_running_requests"], 8, "{workers}");
    let refused = f.gw.eventually(Duration::from_secs(5), |s| s.engines.all()[0].grpc_events_refused.lock().is_some());
    assert!(refused.await, "the worker without a publisher refused its KV event stream");
    let workers = f.gw.get_json("/admin/workers").await;
    let w = &workers["workers"][0];
    assert!(w["kv_events"].is_null(), "routed on load alone: {workers}");
    assert_eq!(w["router"]["kv_state"]["state"], "synced", "{workers}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_come_back_as_text_with_usage() {
    let f = fixture(Duration::ZERO).await;
    let resp = f.gw.post("/v1/chat/completions", &chat(false, json!({}))).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "fake-model");
    assert_eq!(body["choices"][0]["message"]["content"], OUTPUT, "the EOS token is not text: {body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let generated = f.seen.lock().generated.len();
    assert_eq!(generated, 1);
    let sent = f.seen.lock().generated[0].clone();
    let prompt = sent.tokenized.unwrap().input_ids;
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len(), "{body}");
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
    let sampling = sent.sampling_params.unwrap();
    assert_eq!(sampling.temperature, 0.0);
    assert_eq!(sampling.max_new_tokens, Some(4096 - prompt.len() as u32), "chat without a limit: the context's rest");

    let resp = f.gw.post("/v1/completions", &json!({"model": "fake-model", "prompt": "Once", "max_tokens": 3})).await;
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_sends_the_same_text_in_pieces_then_usage_and_done() {
    let f = fixture(Duration::from_millis(5)).await;
    let body = chat(true, json!({"stream_options": {"include_usage": true}}));
    let resp = f.gw.post("/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let sse = resp.text().await.unwrap();
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse}");
    let (text, chunks) = stream_text(&sse);
    assert_eq!(text, OUTPUT, "no character split, nothing lost, the EOS not text: {sse}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks.len() > 4, "the text arrives in pieces: {sse}");
    let usage = &chunks.last().unwrap()["usage"];
    let last_choice = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(last_choice["finish_reason"], "stop", "{sse}");
    let output_tokens = kvgate_tokenizer::HfTokenizer::load(&tokenizer_path(), HfOptions::default())
        .unwrap()
        .encode_prompt(OUTPUT, false)
        .unwrap()
        .len();
    assert_eq!(usage["completion_tokens"], output_tokens + 1, "the chunks' tokens and the EOS, summed: {sse}");
    assert!(f.seen.lock().aborted.is_empty(), "a stream that ended on its own is not aborted");

    // With special tokens kept, the EOS the worker stopped on is still no text: the last token of
    // each chunk waits for the next message to say which it is.
    for stream in [true, false] {
        let body = chat(stream, json!({"skip_special_tokens": false}));
        let resp = f.gw.post("/v1/chat/completions", &body).await;
        let text = if stream {
            stream_text(&resp.text().await.unwrap()).0
        } else {
            let v: Value = resp.json().await.unwrap();
            v["choices"][0]["message"]["content"].as_str().unwrap().to_owned()
        };
        assert_eq!(text, OUTPUT, "stream {stream}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_role_comes_with_the_first_token_not_before_it() {
    // The fake worker sleeps before each message: its first token comes after this long.
    let first_token = Duration::from_millis(300);
    let f = fixture(first_token).await;
    #[allow(clippy::disallowed_methods)] // a lower bound the worker's own sleep guarantees
    let sent = std::time::Instant::now();
    let resp = f.gw.post("/v1/chat/completions", &chat(true, json!({}))).await;
    let mut body = resp.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(sent.elapsed() >= first_token, "a client's first byte is the first token's, as vLLM sends it");
    assert!(String::from_utf8_lossy(&first).contains(r#""role":"assistant""#), "{first:?}");
    // A worker that fails before any token: an error, and no role.
    let failed = f.gw.post("/v1/chat/completions", &chat(true, json!({"max_tokens": 2}))).await.text().await.unwrap();
    assert!(!failed.contains("role") && failed.contains("error"), "{failed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokens_text_goes_out_before_the_worker_sends_the_next_one() {
    let f = fixture(Duration::ZERO).await;
    let resp =
        f.gw.post("/v1/completions", &json!({"model": "fake-model", "prompt": "Hi", "max_tokens": 7, "stream": true}))
            .await;
    let mut body = resp.bytes_stream();
    let mut seen = String::new();
    // The worker sends the second token only once the first one's text reached the client: a
    // gateway that held it back for the next message would wait here forever.
    let first_text = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(bytes) = body.next().await {
            seen.push_str(&String::from_utf8_lossy(&bytes.unwrap()));
            if seen.contains(r#""text":"Hello""#) {
                return true;
            }
        }
        false
    });
    assert!(first_text.await.unwrap_or(false), "the first token's text did not come before the next token: {seen}");
    f.gate.notify_one();
    while let Some(bytes) = body.next().await {
        seen.push_str(&String::from_utf8_lossy(&bytes.unwrap()));
    }
    assert!(seen.ends_with("data: [DONE]\n\n"), "{seen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_ends_the_text_in_the_gateway_and_aborts_the_worker() {
    let f = fixture(Duration::from_millis(5)).await;
    for stream in [false, true] {
        let body = chat(stream, json!({"stop": ["STOP"]}));
        let resp = f.gw.post("/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let (text, finish) = if stream {
            let sse = resp.text().await.unwrap();
            let (text, chunks) = stream_text(&sse);
            (text, chunks.last().unwrap()["choices"][0].clone())
        } else {
            let body: Value = resp.json().await.unwrap();
            (body["choices"][0]["message"]["content"].as_str().unwrap().to_owned(), body["choices"][0].clone())
        };
        assert_eq!(text, "Hello 🙂 world. ", "stream {stream}");
        assert_eq!(finish["finish_reason"], "stop");
        assert_eq!(finish["stop_reason"], "STOP");
        let sent = f.seen.lock().generated.last().unwrap().clone();
        assert!(sent.stream, "a whole answer with stop strings is streamed from the worker, to be cut early");
        assert!(
            sent.sampling_params.unwrap().stop.is_empty(),
            "SGLang's servicer gets no stop strings: it cannot match them"
        );
    }
    // Both stopped mid-way, the worker told to stop the rest each time.
    let ok = f.gw.eventually(Duration::from_secs(5), |_| f.seen.lock().aborted.len() == 2).await;
    assert!(ok, "the worker was told to stop after the gateway's stop-string match: {:?}", f.seen.lock().aborted);
}

/// Each `logprobs.content` entry of a chat response's chunks (or whole body), in order.
fn chat_logprobs(bodies: &[Value]) -> Vec<Value> {
    bodies
        .iter()
        .flat_map(|b| b["choices"].as_array().cloned().unwrap_or_default())
        .flat_map(|c| c["logprobs"]["content"].as_array().cloned().unwrap_or_default())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_follow_the_tokens_the_answer_keeps_whole_and_streamed() {
    let f = fixture(Duration::from_millis(2)).await;
    let tokens =
        HfTokenizer::load(&tokenizer_path(), HfOptions::default()).unwrap().encode_prompt(OUTPUT, false).unwrap();
    let mut seen = Vec::new();
    for stream in [false, true] {
        let body = chat(stream, json!({"logprobs": true, "top_logprobs": 2}));
        let resp = f.gw.post("/v1/chat/completions", &body).await;
        assert_eq!(resp.status(), 200);
        let bodies = if stream { stream_text(&resp.text().await.unwrap()).1 } else { vec![resp.json().await.unwrap()] };
        let sent = f.seen.lock().generated.last().unwrap().clone();
        assert!(sent.return_logprob && sent.top_logprobs_num == 2 && sent.logprob_start_len == -1, "{sent:?}");
        let entries = chat_logprobs(&bodies);
        assert_eq!(entries.len(), tokens.len() + 1, "every token and the EOS, stream {stream}: {entries:?}");
        for (at, e) in entries.iter().enumerate() {
            assert_eq!(e["logprob"], f64::from(fake_logprob(at)), "stream {stream}: {e}");
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 2, "{e}");
        }
        // SGLang's server shows each token's own bytes: the emoji's pieces add up to it.
        let bytes: Vec<u8> = entries[..tokens.len()]
            .iter()
            .flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8))
            .collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), OUTPUT, "stream {stream}");
        assert_eq!(entries[tokens.len()]["token"], "<｜end▁of▁sentence｜>", "the EOS is shown, by its name");
        seen.push(entries);
    }
    assert_eq!(seen[0], seen[1], "streamed and whole show the same logprobs");

    // Cut at a stop string: the tokens after the one that completed it are not shown.
    let body = chat(false, json!({"logprobs": true, "stop": ["STOP"]}));
    let v: Value = f.gw.post("/v1/chat/completions", &body).await.json().await.unwrap();
    let kept = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let entries = chat_logprobs(std::slice::from_ref(&v));
    assert_eq!(entries.len(), kept, "{v}");
    assert!(entries.iter().all(|e| e["top_logprobs"] == json!([])), "no alternatives asked: {v}");

    // Completions: the parallel lists, one alternative per token asked.
    for stream in [false, true] {
        let body = json!({"model": "fake-model", "prompt": "Once", "max_tokens": 5, "logprobs": 1, "stream": stream});
        let resp = f.gw.post("/v1/completions", &body).await;
        let bodies = if stream { stream_text(&resp.text().await.unwrap()).1 } else { vec![resp.json().await.unwrap()] };
        let lists: Vec<Value> =
            bodies.iter().map(|b| b["choices"][0]["logprobs"].clone()).filter(|l| !l.is_null()).collect();
        let count = |key: &str| lists.iter().map(|l| l[key].as_array().unwrap().len()).sum::<usize>();
        assert_eq!(count("tokens"), 5, "stream {stream}: {lists:?}");
        assert_eq!((count("token_logprobs"), count("top_logprobs"), count("text_offset")), (5, 5, 5));
        assert!(
            lists.iter().all(|l| l["text_offset"].as_array().unwrap().iter().all(|o| o == -1)),
            "SGLang shows no offsets"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_puts_the_prompt_before_the_text_whole_and_streamed() {
    let f = fixture(Duration::ZERO).await;
    let tokenizer = HfTokenizer::load(&tokenizer_path(), HfOptions::default()).unwrap();
    let hello = tokenizer.encode_prompt("Hello", false).unwrap();
    for prompt in [json!("Once upon"), json!(tokenizer.encode_prompt("Once upon", false).unwrap())] {
        for stream in [false, true] {
            let body = json!({"model": "fake-model", "prompt": prompt, "max_tokens": hello.len(), "echo": true, "stream": stream});
            let resp = f.gw.post("/v1/completions", &body).await;
            assert_eq!(resp.status(), 200);
            let text = if stream {
                stream_text(&resp.text().await.unwrap()).0
            } else {
                let v: Value = resp.json().await.unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_owned()
            };
            assert_eq!(text, "Once uponHello", "prompt {prompt}, stream {stream}");
        }
    }
    // With logprobs the prompt's own come first, its first token's null (SGLang's server shows
    // them only with alternatives asked).
    let prompt_len = tokenizer.encode_prompt("Once upon", false).unwrap().len();
    for stream in [false, true] {
        let body = json!({"model": "fake-model", "prompt": "Once upon", "max_tokens": hello.len(), "echo": true,
                          "logprobs": 1, "stream": stream});
        let raw = f.gw.post("/v1/completions", &body).await.text().await.unwrap();
        let sent = f.seen.lock().generated.last().cloned().unwrap();
        assert_eq!((sent.return_logprob, sent.logprob_start_len), (true, 0), "{raw}");
        let values: Vec<Value> = if stream {
            raw.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .flat_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default())
                .collect()
        } else {
            let v: Value = serde_json::from_str(&raw).unwrap();
            v["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap()
        };
        assert_eq!(values.len(), prompt_len + hello.len(), "stream {stream}: {raw}");
        assert_eq!(values[0], Value::Null, "stream {stream}: {raw}");
        assert_eq!(values[1], json!(-1.0), "stream {stream}: {raw}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_the_worker_cannot_honour_is_refused_by_name_before_it_is_sent() {
    let f = fixture(Duration::ZERO).await;
    for (extra, field) in [
        (json!({"logit_bias": {"five": 1}}), "logit_bias"),
        (json!({"n": 0}), "`n`"),
        (json!({"response_format": {"type": "structural_tag"}}), "response_format"),
        (json!({"structured_outputs": {"choice": ["a", "b"]}}), "choice"),
        (json!({"logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (json!({"seed": 7}), "seed"),
    ] {
        let resp = f.gw.post("/v1/chat/completions", &chat(false, extra.clone())).await;
        assert_eq!(resp.status(), 400, "{extra}");
        let body: Value = resp.json().await.unwrap();
        assert!(body["error"]["message"].as_str().unwrap().contains(field), "{extra}: {body}");
    }
    assert!(f.seen.lock().generated.is_empty(), "nothing reached the worker");

    // A refusal from the worker itself, after it accepted the stream: the client's error, passed on
    // as a 400, and the worker told to drop the request.
    let resp = f.gw.post("/v1/chat/completions", &chat(false, json!({"max_tokens": 2}))).await;
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("two is too few"), "{body}");
    let ok = f.gw.eventually(Duration::from_secs(5), |_| f.seen.lock().aborted.len() == 1).await;
    assert!(ok, "the refused request was aborted on the worker");
    let workers = f.gw.get_json("/admin/workers").await;
    assert_eq!(workers["workers"][0]["healthy"], true, "the client's mistakes are not the worker's");
    assert_eq!(workers["workers"][0]["consecutive_request_failures"], 0, "{workers}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_aborts_the_workers_request_and_frees_its_reservation() {
    let f = fixture(Duration::from_millis(200)).await;
    let resp = f.gw.post("/v1/chat/completions", &chat(true, json!({}))).await;
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("assistant"));
    drop(stream);
    let ok = f.gw.eventually(Duration::from_secs(5), |_| f.seen.lock().aborted.len() == 1).await;
    assert!(ok, "the worker was told to abort");
    let ok = f.gw.eventually(Duration::from_secs(5), |s| s.router.in_flight() == 0).await;
    assert!(ok, "the reservation was released");
}

/// A stored run of `tokens` (whole blocks of 16) with hashes `first_hash`, `first_hash + 1`, ...
fn stored(tokens: &[u32], first_hash: i64) -> common::KvCacheEvent {
    let blocks = tokens
        .chunks(16)
        .enumerate()
        .map(|(i, t)| common::KvBlock {
            block_hash: first_hash + i as i64,
            token_ids: t.to_vec(),
            block_size: 16,
            ..Default::default()
        })
        .collect();
    common::KvCacheEvent {
        event_id: 0,
        data: Some(common::kv_cache_event::Data::Stored(common::KvBlocksStored { blocks, ..Default::default() })),
    }
}

fn removed(hashes: &[i64]) -> common::KvCacheEvent {
    common::KvCacheEvent {
        event_id: 0,
        data: Some(common::kv_cache_event::Data::Removed(common::KvBlocksRemoved {
            block_hashes: hashes.to_vec(),
            ..Default::default()
        })),
    }
}

fn batch(seq: u64, events: Vec<common::KvCacheEvent>, load: Option<common::EngineLoad>) -> common::KvEventBatch {
    common::KvEventBatch { sequence_number: seq, timestamp: 1.7e9, events, dp_rank: Some(0), load }
}

fn pushed(running: u32, waiting: u32, load_only: bool) -> common::EngineLoad {
    common::EngineLoad {
        running_requests: running,
        waiting_requests: waiting,
        waiting_uncached_tokens: Some(waiting * 100),
        token_usage: 0.25,
        max_running_requests: 8,
        load_only,
        ..Default::default()
    }
}

/// The prompt whose blocks the tests store: 64 ids, four blocks of 16.
fn prompt_ids() -> Vec<u32> {
    (1000..1064).collect()
}

async fn cached(f: &Fixture) -> u64 {
    let body = json!({"model": "fake-model", "prompt": prompt_ids(), "max_tokens": 4});
    let d = f.gw.post("/admin/decide", &body).await.json::<Value>().await.unwrap();
    d["decision"]["scores"][0]["cached_tokens"].as_u64().unwrap_or_else(|| panic!("{d}"))
}

async fn eventually_cached(f: &Fixture, want: u64) {
    for _ in 0..100 {
        if cached(f).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("credit never became {want}: {}", f.gw.get_json("/admin/workers").await);
}

/// The `n`th subscription the worker has served (from 1), once the gateway has opened it.
async fn subscription(f: &Fixture, n: usize) -> Subscription {
    let opened = f.gw.eventually(Duration::from_secs(10), |_| f.events.lock().subscriptions.len() >= n);
    assert!(opened.await, "subscription {n} never came: {}", f.gw.get_json("/admin/workers").await);
    f.events.lock().subscriptions[n - 1].clone()
}

async fn stream_view(f: &Fixture) -> Value {
    f.gw.get_json("/admin/workers").await["workers"][0]["kv_events"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_own_event_stream_earns_credit_and_carries_its_load() {
    // Polled once at start, then only pushed: what the stream carries is all that can move the load.
    let f = fixture_with(Duration::ZERO, true, 60_000, true).await;
    let events = subscription(&f, 1).await;
    assert_eq!(cached(&f).await, 0);
    let ids = prompt_ids();
    events.send(Ok(batch(0, vec![stored(&ids[..48], 1)], Some(pushed(3, 7, false))))).unwrap();
    eventually_cached(&f, 48).await;
    let status = |s: &kvgate_gateway::AppState| s.router.workers(s.clock.now()).remove(0);
    let ok = f.gw.eventually(Duration::from_secs(5), |s| status(s).waiting_requests == 7);
    assert!(ok.await, "the pushed load became the worker's: {}", f.gw.get_json("/admin/workers").await);
    assert_eq!(status(&f.gw.state).running_requests, 3);
    // The counters follow the index by a few instructions.
    let counted = |batches: u64, loads: u64| {
        move |s: &kvgate_gateway::AppState| {
            let v = s.engines.all()[0].stream.view();
            v.batches == batches && v.loads_pushed == loads && v.last_seq == Some(batches - 1)
        }
    };
    assert!(f.gw.eventually(Duration::from_secs(5), counted(1, 1)).await, "{}", stream_view(&f).await);
    assert_eq!(stream_view(&f).await["transport"], "grpc");

    // A heartbeat repeats the last sequence number with the load alone.
    events.send(Ok(batch(0, vec![], Some(pushed(1, 0, true))))).unwrap();
    let ok = f.gw.eventually(Duration::from_secs(5), |s| status(s).waiting_requests == 0);
    assert!(ok.await, "the heartbeat's load was taken");
    assert_eq!(status(&f.gw.state).running_requests, 1);
    let heartbeat_counted = f.gw.eventually(Duration::from_secs(5), counted(1, 2)).await;
    assert!(heartbeat_counted, "a heartbeat is a pushed load and no batch of events: {}", stream_view(&f).await);

    // Eviction shrinks the credit.
    events.send(Ok(batch(1, vec![removed(&[3])], None))).unwrap();
    eventually_cached(&f, 32).await;
    assert_eq!(f.events.lock().subscriptions.len(), 1, "one subscription served it all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_or_skipping_stream_is_cleared_and_subscribed_again_from_zero() {
    let f = fixture_with(Duration::ZERO, true, 50, true).await;
    let ids = prompt_ids();
    let first = subscription(&f, 1).await;
    first.send(Ok(batch(0, vec![stored(&ids[..48], 1)], None))).unwrap();
    eventually_cached(&f, 48).await;

    // The relay could not fill a gap: it ends the stream, and the blocks it told of are forgotten.
    first.send(Err(Status::data_loss("KV event replay of rank 0 ended at 3, before 5"))).unwrap();
    let second = subscription(&f, 2).await;
    eventually_cached(&f, 0).await;
    // The worker registers a subscription before the gateway has its answer: wait for the gateway.
    let resubscribed = |n: u64| move |s: &kvgate_gateway::AppState| s.engines.all()[0].stream.view().resubscribes == n;
    assert!(f.gw.eventually(Duration::from_secs(5), resubscribed(1)).await, "{}", stream_view(&f).await);
    // The new subscription is live from where the engine is: blocks come back as it reports them.
    second.send(Ok(batch(57, vec![stored(&ids[..32], 11)], None))).unwrap();
    eventually_cached(&f, 32).await;
    assert_eq!(stream_view(&f).await["joined_at_seq"], 57, "joined the engine's stream at 57");

    // A sequence number that skips one is not trusted either.
    second.send(Ok(batch(59, vec![stored(&ids[32..48], 13)], None))).unwrap();
    let _third = subscription(&f, 3).await;
    eventually_cached(&f, 0).await;
    assert!(f.gw.eventually(Duration::from_secs(5), resubscribed(2)).await, "{}", stream_view(&f).await);
    assert_eq!(stream_view(&f).await["gaps"], 1);
}

/// A zip archive of `files`, as the servicers bundle a tokenizer.
fn zip_of(files: &[(&str, Vec<u8>)]) -> Vec<u8> {
    use std::io::Write;
    let mut out = std::io::Cursor::new(Vec::new());
    let mut zip = zip::ZipWriter::new(&mut out);
    for (name, bytes) in files {
        zip.start_file(*name, zip::write::SimpleFileOptions::default()).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
    out.into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_a_tokenizer_takes_the_workers_own() {
    let f = fixture(Duration::ZERO).await;
    let cache = std::env::temp_dir().join(format!("kvgate-grpc-tokenizer-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let toml = format!("[server]\nblock_size = 16\n[[workers]]\nurl = \"grpc://{}\"\n", f.addr);
    let unresolved = kvgate_gateway::config::GatewayConfig::from_toml(&toml).unwrap();
    assert!(unresolved.tokenizer_from_workers);
    let wait = Duration::from_secs(2);

    // A worker that has none to give: start-up fails, saying what to do.
    let mut config = unresolved.clone();
    let err = kvgate_gateway::worker_tokenizer::resolve(&mut config, &cache, wait).await.unwrap_err().to_string();
    assert!(err.contains("--tokenizer") && err.contains("no tokenizer here"), "{err}");

    // An archive that does not match its checksum is refused.
    let tokenizer_json = std::fs::read(tokenizer_path()).unwrap();
    let archive = zip_of(&[("tokenizer.json", tokenizer_json.clone())]);
    *f.bundle.lock() = Some((archive.clone(), "0".repeat(64)));
    let err = kvgate_gateway::worker_tokenizer::resolve(&mut config, &cache, wait).await.unwrap_err().to_string();
    assert!(err.contains("SHA-256"), "{err}");

    // A whole archive is taken: the same ids as the file it was made of.
    *f.bundle.lock() = Some((archive.clone(), kvgate_gateway::grpc_worker::sha256_hex(&archive)));
    kvgate_gateway::worker_tokenizer::resolve(&mut config, &cache, wait).await.unwrap();
    let fetched = kvgate_gateway::tokenize::build(&config.tokenizer, config.tokenize_cache_bytes).unwrap();
    assert!(fetched.describe().contains(cache.to_str().unwrap()), "{}", fetched.describe());
    let direct = HfTokenizer::load(&tokenizer_path(), HfOptions::default()).unwrap();
    let text = "Hello 🙂 world, tokenized the same way twice.";
    assert_eq!(fetched.encode_prompt(text, true).unwrap(), direct.encode_prompt(text, true).unwrap());
    let _ = std::fs::remove_dir_all(&cache);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_sequences_come_back_as_n_choices_whole_and_streamed() {
    let f = fixture(Duration::ZERO).await;
    let resp = f.gw.post("/v1/chat/completions", &chat(false, json!({"n": 2}))).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{body}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!((c["index"].as_u64(), c["message"]["content"].as_str()), (Some(i as u64), Some(OUTPUT)), "{body}");
        assert_eq!(c["finish_reason"], "stop");
    }
    let one: Value = f.gw.post("/v1/chat/completions", &chat(false, json!({}))).await.json().await.unwrap();
    let each = one["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(body["usage"]["completion_tokens"].as_u64(), Some(2 * each), "both sequences counted: {body}");
    assert_eq!(f.seen.lock().generated[0].sampling_params.as_ref().unwrap().n, 2);

    // Streamed: each choice's text under its own index, each ended once, then usage and [DONE].
    let body = chat(true, json!({"n": 2, "stream_options": {"include_usage": true}}));
    let sse = f.gw.post("/v1/chat/completions", &body).await.text().await.unwrap();
    let (texts, choices, usage) = streamed_choices(&sse, 2);
    assert_eq!(texts, [OUTPUT, OUTPUT], "{sse}");
    let roles = choices.iter().filter(|c| c["delta"]["role"] == "assistant").count();
    let finishes: Vec<&Value> = choices.iter().filter(|c| !c["finish_reason"].is_null()).collect();
    assert_eq!((roles, finishes.len()), (2, 2), "{sse}");
    assert_eq!(usage["completion_tokens"].as_u64(), Some(2 * each), "{sse}");
    assert!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");

    // A stop string the gateway matches mid-stream ends each choice; the worker is stopped once both
    // have.
    let body = chat(true, json!({"n": 2, "stop": ["STOP"]}));
    let sse = f.gw.post("/v1/chat/completions", &body).await.text().await.unwrap();
    let (texts, choices, _) = streamed_choices(&sse, 2);
    assert_eq!(texts, ["Hello 🙂 world. ", "Hello 🙂 world. "], "{sse}");
    assert!(choices.iter().filter(|c| !c["finish_reason"].is_null()).all(|c| c["stop_reason"] == "STOP"), "{sse}");
    let ok = f.gw.eventually(Duration::from_secs(5), |_| f.seen.lock().aborted.len() == 1).await;
    assert!(ok, "the worker was told to stop once: {:?}", f.seen.lock().aborted);
}

/// A chat stream's text per choice index (of `n`), every choice object it carried, and its usage.
fn streamed_choices(sse: &str, n: usize) -> (Vec<String>, Vec<Value>, Value) {
    let (mut texts, mut choices, mut usage) = (vec![String::new(); n], Vec::new(), Value::Null);
    for event in events(sse) {
        let data = event.trim_end().strip_prefix("data: ").unwrap();
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        for c in v["choices"].as_array().unwrap() {
            texts[c["index"].as_u64().unwrap() as usize].push_str(c["delta"]["content"].as_str().unwrap_or(""));
            choices.push(c.clone());
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (texts, choices, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_and_logit_bias_reach_the_worker_in_its_own_terms() {
    let f = fixture(Duration::ZERO).await;
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    for (extra, want) in [
        (
            json!({"response_format": {"type": "json_object"}}),
            pb::sampling_params::Constraint::JsonSchema(r#"{"type": "object"}"#.into()),
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}),
            pb::sampling_params::Constraint::JsonSchema(schema.to_string()),
        ),
        (
            json!({"structured_outputs": {"grammar": "root ::= \"x\""}}),
            pb::sampling_params::Constraint::EbnfGrammar("root ::= \"x\"".into()),
        ),
    ] {
        let resp = f.gw.post("/v1/chat/completions", &chat(false, extra.clone())).await;
        assert_eq!(resp.status(), 200, "{extra}");
        let sent = f.seen.lock().generated.pop().unwrap();
        assert_eq!(sent.sampling_params.unwrap().constraint, Some(want), "{extra}");
    }
    let resp = f.gw.post("/v1/chat/completions", &chat(false, json!({"logit_bias": {"17": 3.5, "4": -200}}))).await;
    assert_eq!(resp.status(), 200);
    let bias = f.seen.lock().generated.pop().unwrap().sampling_params.unwrap().logit_bias;
    assert_eq!(bias.len(), 2);
    assert_eq!((bias.get("17"), bias.get("4")), (Some(&3.5), Some(&-100.0)), "as SGLang's map, clamped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_comes_from_grpc_health_v1_and_a_not_serving_worker_leaves_rotation() {
    let f = fixture(Duration::ZERO).await;
    assert_eq!(f.seen.lock().own_health_checks, 0, "the standard health service was asked, not the worker's own");
    let health = f.health.as_ref().unwrap();
    // SGLang's NOT_SERVING (its "stuck scheduler" rule, which also fires on the first request after
    // idleness) is checked with the worker's own HealthCheck: a scheduler that answers stays.
    health.set_not_serving::<SglangSchedulerServer<FakeScheduler>>().await;
    let confirmed = f.gw.eventually(Duration::from_secs(10), |_| f.seen.lock().own_health_checks >= 5);
    assert!(confirmed.await, "the worker's own HealthCheck was asked to confirm NOT_SERVING");
    assert!(f.gw.state.engines.all()[0].healthy.load(Ordering::Relaxed), "a worker whose scheduler answers stays");
    // A scheduler that does not answer either is out.
    f.seen.lock().own_unhealthy = true;
    let out = f.gw.eventually(Duration::from_secs(10), |s| !s.engines.all()[0].healthy.load(Ordering::Relaxed));
    assert!(out.await, "a NOT_SERVING worker left rotation: {}", f.gw.get_json("/admin/workers").await);
    health.set_serving::<SglangSchedulerServer<FakeScheduler>>().await;
    let back = f.gw.eventually(Duration::from_secs(10), |s| s.engines.all()[0].healthy.load(Ordering::Relaxed));
    assert!(back.await, "a SERVING worker came back");
    let asked = f.seen.lock().own_health_checks;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(f.seen.lock().own_health_checks, asked, "SERVING needs no confirmation");

    // A worker without grpc.health.v1: its own HealthCheck is asked.
    let f = fixture_with(Duration::ZERO, false, 50, false).await;
    let asked = f.gw.eventually(Duration::from_secs(5), |_| f.seen.lock().own_health_checks > 0);
    assert!(asked.await, "the worker's own HealthCheck was asked");
    assert_eq!(f.gw.get_json("/admin/workers").await["workers"][0]["healthy"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_sent_again_reaches_the_worker_with_its_exact_ids_from_the_prompt_cache() {
    let f = fixture(Duration::ZERO).await;
    let whole = HfTokenizer::load(&tokenizer_path(), HfOptions { prompt_cache_bytes: Some(0), ..HfOptions::default() })
        .unwrap();
    // About 2,400 tokens: well inside the fake worker's 4,096-token context.
    let document: String =
        (0..200).map(|i| format!("Paragraph {i} of the shared document says something new. ")).collect();
    for question in ["What does it say?", "And what else does it say?"] {
        let prompt = format!("{document}{question}");
        let resp =
            f.gw.post("/v1/completions", &json!({"model": "fake-model", "prompt": prompt, "max_tokens": 3})).await;
        assert_eq!(resp.status(), 200);
        let sent = f.seen.lock().generated.last().unwrap().clone();
        let ids = sent.tokenized.unwrap().input_ids;
        assert_eq!(
            ids,
            whole.encode_prompt(&prompt, true).unwrap(),
            "the worker ran other ids than a whole tokenization"
        );
    }
    let metrics = reqwest::get(f.gw.url("/metrics")).await.unwrap().text().await.unwrap();
    let value = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} in {metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let (hit, miss) = (value("kvgate_tokenize_cache_hit_bytes_total"), value("kvgate_tokenize_cache_miss_bytes_total"));
    assert!(
        hit > 0.8 * document.len() as f64,
        "the second prompt's document came from the cache: hit {hit}, miss {miss}"
    );
    assert!(value("kvgate_tokenize_cache_bytes") > 0.0 && value("kvgate_tokenize_cache_capacity_bytes") > 0.0);
}
