//! The real gateway in front of mock engines serving SMG's gRPC worker protocol
//! (`kvgate mock-engine --grpc`), configured as an SMG user configures gRPC workers: URLs alone.
//! The tokenizer comes from a worker (`GetTokenizer`), block size and limits from
//! `GetServerInfo`, KV events and load from `SubscribeKvEvents`; the gateway sends token ids and
//! turns the ids that come back into OpenAI responses.

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt;
use kvgate_mock_engine::vocab::OUTPUT_WORDS;
use kvgate_mock_engine::{EventFormat, MockConfig, MockEngine};
use serde_json::{json, Value};
use support::*;

/// Both runtimes' services: vLLM's engine servicer and SGLang's scheduler.
const RUNTIMES: [EventFormat; 2] = [EventFormat::Vllm, EventFormat::Sglang];

async fn grpc_engines(n: usize, speedup: f64, format: EventFormat) -> Vec<MockEngine> {
    let mut out = Vec::new();
    for i in 0..n {
        let cfg = MockConfig { speedup, seed: i as u64 + 1, grpc: true, format, ..MockConfig::default() };
        out.push(MockEngine::start(cfg).await.unwrap());
    }
    out
}

/// A gateway given nothing but the workers' URLs.
async fn gateway(engines: &[MockEngine]) -> Gw {
    let mut toml = "[telemetry]\npoll_interval_ms = 50\nhealth_interval_ms = 200\n".to_string();
    for (i, e) in engines.iter().enumerate() {
        assert!(e.url.starts_with("grpc://"), "{}", e.url);
        toml.push_str(&format!("[[workers]]\nid = \"g{i}\"\nurl = \"{}\"\n", e.url));
    }
    let gw = start_gateway(&toml).await;
    // Each worker's identity and load, and its event stream open.
    for _ in 0..500 {
        let workers: Value =
            gw.client.get(format!("{}/admin/workers", gw.url)).send().await.unwrap().json().await.unwrap();
        let ready = workers["workers"].as_array().is_some_and(|ws| {
            ws.len() == engines.len()
                && ws.iter().all(|w| w["models"][0] == "mock-model" && w["router"]["load_age_ms"].is_u64())
        });
        if ready && engines.iter().all(|e| e.grpc_event_streams() > 0) {
            return gw;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let workers = gw.client.get(format!("{}/admin/workers", gw.url)).send().await.unwrap().text().await.unwrap();
    panic!("the gRPC workers never became ready: {workers}");
}

/// The mock's output for `n` tokens.
fn filler(n: usize) -> String {
    (0..n).map(|i| format!(" {}", OUTPUT_WORDS[i % OUTPUT_WORDS.len()])).collect()
}

fn chat(system: &str, user: &str, extra: Value) -> Value {
    let mut body = json!({"model": "mock-model", "max_tokens": 8,
                          "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The data events of an SSE body, `[DONE]` last.
fn events(sse: &str) -> Vec<String> {
    sse.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_alone_serves_chat_from_token_ids_and_routes_a_repeated_prefix_to_its_cache() {
    for format in RUNTIMES {
        let es = grpc_engines(3, 50.0, format).await;
        let gw = gateway(&es).await;
        let described: Value =
            gw.client.get(format!("{}/admin/workers", gw.url)).send().await.unwrap().json().await.unwrap();
        let w = &described["workers"][0];
        assert_eq!(w["engine_block_size"], 16, "the page size from GetServerInfo: {w}");
        assert_eq!(w["kv_events"]["transport"], "grpc", "{w}");
        let system = long_prompt("sys");
        let first: Value = post(&gw, &chat(&system, "q1", json!({}))).await.json().await.unwrap();
        assert_eq!(first["choices"][0]["message"]["content"], filler(8), "{first}");
        assert_eq!(first["choices"][0]["finish_reason"], "length");
        assert_eq!(first["usage"]["completion_tokens"], 8);
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt_tokens > 1500, "the mock model's tokenizer took the prompt: {prompt_tokens} tokens");
        wait("the owner's KV events over its gRPC stream", || holder(&gw).is_some()).await;
        let owner = holder(&gw).unwrap();
        // The credit the gateway gives the owner is what the engine then serves from its cache.
        let next = chat(&system, "q2", json!({}));
        let credit = credit_on(&gw, next.clone(), owner.clone()).await;
        assert!(credit >= prompt_tokens - 40, "credit {credit} of {prompt_tokens} prompt tokens");
        let second: Value = post(&gw, &next).await.json().await.unwrap();
        assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(credit), "{second}");
        let log = decisions(&gw, 1).await;
        assert_eq!(log[0]["decision"]["worker"], owner.as_str());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_n_sequences_and_stop_strings_come_back_as_the_engines_own_server_shapes_them() {
    for format in RUNTIMES {
        let es = grpc_engines(1, 50.0, format).await;
        let gw = gateway(&es).await;
        let body = chat("be brief", "hi", json!({"stream": true, "stream_options": {"include_usage": true}}));
        let sse = post(&gw, &body).await.text().await.unwrap();
        let events = events(&sse);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{sse}");
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, filler(8));
        assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 8, "{sse}");
        // n sequences, each its own choice.
        let two: Value = post(&gw, &chat("be brief", "hi", json!({"n": 2}))).await.json().await.unwrap();
        let texts: Vec<&str> =
            two["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap()).collect();
        assert_eq!(texts, vec![filler(8).as_str(), filler(8).as_str()], "{two}");
        assert_eq!(two["usage"]["completion_tokens"], 16);
        // A stop string ends the text where it starts.
        let cancelled = es[0].shared.cancelled.load(Ordering::Relaxed);
        let stopped: Value = post(&gw, &chat("be brief", "hi", json!({"max_tokens": 400, "stop": [" dolor"]})))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(stopped["choices"][0]["message"]["content"], " lorem ipsum", "{stopped}");
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        // SGLang's servicer cannot match stop strings: the gateway streams the answer from it, cuts
        // it and aborts the rest. vLLM's matches them itself (the mock does not, so there the
        // gateway trims the whole output).
        if format == EventFormat::Sglang {
            let aborted = || es[0].shared.cancelled.load(Ordering::Relaxed) == cancelled + 1;
            wait("the engine's abort of the rest", aborted).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_aborts_the_engines_request() {
    for format in RUNTIMES {
        let es = grpc_engines(1, 1.0, format).await;
        let gw = gateway(&es).await;
        let body = chat(&long_prompt("gone"), "q", json!({"max_tokens": 4000, "stream": true}));
        let resp = post(&gw, &body).await;
        let mut stream = resp.bytes_stream();
        stream.next().await.unwrap().unwrap();
        drop(stream);
        wait("the engine's cancel", || es[0].shared.cancelled.load(Ordering::Relaxed) == 1).await;
        wait("an idle engine", || {
            let l = *es[0].shared.load.lock();
            l.running_requests == 0 && l.waiting_requests == 0
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_ends_its_event_stream_and_the_gateway_rebuilds_from_zero() {
    for format in RUNTIMES {
        let es = grpc_engines(1, 50.0, format).await;
        let gw = gateway(&es).await;
        let system = long_prompt("restart");
        let _: Value = post(&gw, &chat(&system, "q1", json!({}))).await.json().await.unwrap();
        wait("the blocks over the stream", || holder(&gw).is_some()).await;
        reqwest::Client::new().post(format!("{}/admin/restart", es[0].http_url)).send().await.unwrap();
        // The restart's AllBlocksCleared, or the stream's end and a fresh subscription, clears them.
        wait("the credit cleared", || holder(&gw).is_none()).await;
        let resubscribed = || async {
            let v: Value =
                gw.client.get(format!("{}/admin/workers", gw.url)).send().await.unwrap().json().await.unwrap();
            v["workers"][0]["kv_events"]["resubscribes"].as_u64().unwrap_or(0)
        };
        for _ in 0..500 {
            if resubscribed().await >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(resubscribed().await >= 1, "the gateway subscribed again after the restart");
        // After it, new blocks earn credit again.
        let _: Value = post(&gw, &chat(&system, "q2", json!({}))).await.json().await.unwrap();
        wait("new blocks over the new stream", || holder(&gw).is_some()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_grpc_workers_do_not_serve_goes_to_the_http_engines_of_a_mixed_fleet() {
    let grpc = grpc_engines(1, 50.0, EventFormat::Sglang).await;
    let http = MockEngine::start(MockConfig { speedup: 50.0, ..MockConfig::default() }).await.unwrap();
    // Round robin would send every other request to the gRPC worker.
    let toml = format!(
        "[policy]\nname = \"round_robin\"\n[telemetry]\npoll_interval_ms = 50\n\
         [[workers]]\nid = \"g0\"\nurl = \"{}\"\n[[workers]]\nid = \"h0\"\nurl = \"{}\"\nengine = \"sglang\"\n",
        grpc[0].url, http.url
    );
    let gw = start_gateway(&toml).await;
    // Embeddings are not sent to a gRPC worker whose model generates (the mock's): every one goes
    // to the HTTP engine (which, a mock, has no such route: its own 404 comes back, not the
    // gateway's refusal).
    let embed = json!({"input": "hello there"});
    for _ in 0..4 {
        let r = gw.client.post(format!("{}/v1/embeddings", gw.url)).json(&embed).send().await.unwrap();
        let status = r.status();
        assert_ne!(status, 400, "{}", r.text().await.unwrap());
    }
    let log = decisions(&gw, 4).await;
    assert_eq!(log.len(), 4, "{log:?}");
    assert!(log.iter().all(|d| d["decision"]["worker"] == "h0"), "{log:?}");
    // SGLang's /generate goes to both, the gRPC worker answering it in SGLang's shape.
    let generate = json!({"text": "hello there", "sampling_params": {"max_new_tokens": 2}});
    for _ in 0..2 {
        let r = gw.client.post(format!("{}/generate", gw.url)).json(&generate).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let answer: Value = r.json().await.unwrap();
        assert_eq!(answer["meta_info"]["completion_tokens"], 2, "{answer}");
    }
    let log = decisions(&gw, 2).await;
    assert_ne!(log[0]["decision"]["worker"], log[1]["decision"]["worker"], "{log:?}");

    // With generating gRPC workers only, the request is refused before any routing, saying what
    // kind of worker it needs.
    let only_grpc = gateway(&grpc).await;
    let r = only_grpc.client.post(format!("{}/v1/embeddings", only_grpc.url)).json(&embed).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let body = r.text().await.unwrap();
    assert!(body.contains("/v1/embeddings needs a worker whose model pools"), "{body}");
    assert!(decisions(&only_grpc, 10).await.is_empty(), "nothing was routed");
}
