//! Live KV events through real ZMQ sockets: a publisher (kvgate's own PUB, which says when the
//! gateway's subscription has arrived) and a replay ROUTER (the `zeromq` crate's) in the test, the
//! real gateway on port 0, and fake engines for HTTP.

#![allow(clippy::disallowed_methods)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_gateway::tokenize::BuiltinTokenizer;
use parking_lot::Mutex;
use rmpv::Value;
use serde_json::{json, Value as Json};
use support::*;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const BLOCK: usize = 16;

/// Published batches `(seq, payload)`, kept for replay.
type History = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A vLLM-style publisher: PUB for live batches, ROUTER for replays (newer 4-frame layout).
struct Publisher {
    pub_socket: kvgate_zmtp::PubSocket,
    history: History,
    endpoint: String,
    replay_endpoint: String,
    topic: &'static str,
}

impl Publisher {
    async fn start() -> Publisher {
        Self::start_at("tcp://127.0.0.1:0", "tcp://127.0.0.1:0").await.unwrap()
    }

    /// A publisher on given endpoints; `None` if one of them is taken.
    async fn start_at(pub_at: &str, replay_at: &str) -> Option<Publisher> {
        let pub_socket = kvgate_zmtp::PubSocket::bind(pub_at, kvgate_zmtp::Limits::default()).await.ok()?;
        let endpoint = pub_socket.endpoint();
        let mut router = zeromq::RouterSocket::new();
        let replay_endpoint = router.bind(replay_at).await.ok()?.to_string();
        let history: History = Arc::default();
        let h = history.clone();
        tokio::spawn(async move {
            while let Ok(req) = router.recv().await {
                let frames = req.into_vec();
                let (id, start) = (frames[0].clone(), u64::from_be_bytes(frames[2][..8].try_into().unwrap()));
                let batches: Vec<(u64, Vec<u8>)> = h.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
                for (seq, payload) in batches {
                    let m = vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::from_static(b"kv-events"),
                        Bytes::from(seq.to_be_bytes().to_vec()),
                        Bytes::from(payload),
                    ];
                    router.send(ZmqMessage::try_from(m).unwrap()).await.unwrap();
                }
                let end = vec![id, Bytes::new(), Bytes::new(), Bytes::from(vec![0xff; 8]), Bytes::new()];
                router.send(ZmqMessage::try_from(end).unwrap()).await.unwrap();
            }
        });
        Some(Publisher { pub_socket, history, endpoint, replay_endpoint, topic: "kv-events" })
    }

    /// Records a batch for replay and, unless `drop_live`, publishes it live.
    async fn publish(&mut self, seq: u64, payload: Vec<u8>, drop_live: bool) {
        self.history.lock().push((seq, payload.clone()));
        if !drop_live {
            let m = vec![Bytes::from(self.topic), Bytes::from(seq.to_be_bytes().to_vec()), Bytes::from(payload)];
            assert_eq!(self.pub_socket.send(m), 1, "the gateway is subscribed (wait for `subscribed` first)");
        }
    }

    /// Waits until the gateway's subscription has arrived: what is published before it is lost, as
    /// from a real engine's PUB.
    async fn subscribed(&self) {
        real_wait(&format!("the gateway's subscription to {}", self.endpoint), || self.pub_socket.subscribers() > 0)
            .await;
    }

    /// A new engine process: history starts again at 0.
    fn restart(&self) {
        self.history.lock().clear();
    }
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
}

/// A vLLM 0.33 map-form `BlockStored` of `tokens` (full blocks), hashes `base..`, chained to `parent`.
fn stored(tokens: &[u32], base: u64, parent: Option<u64>) -> Value {
    let blocks = tokens.len() / BLOCK;
    map(vec![
        ("type", Value::from("BlockStored")),
        ("block_hashes", Value::Array((0..blocks as u64).map(|i| Value::from(base + i)).collect())),
        ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
        ("token_ids", Value::Array(tokens[..blocks * BLOCK].iter().map(|t| Value::from(*t)).collect())),
        ("block_size", Value::from(BLOCK as u64)),
        ("lora_id", Value::Nil),
        ("medium", Value::from("GPU")),
        ("lora_name", Value::Nil),
    ])
}

fn removed(hashes: &[u64]) -> Value {
    map(vec![
        ("type", Value::from("BlockRemoved")),
        ("block_hashes", Value::Array(hashes.iter().map(|h| Value::from(*h)).collect())),
        ("medium", Value::from("GPU")),
    ])
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::F64(1.7e9), Value::Array(events), Value::from(0u8)]))
        .unwrap();
    out
}

fn chat(content: &str) -> Json {
    json!({"model": "test-model", "max_tokens": 8, "messages": [{"role": "system", "content": content}, {"role": "user", "content": "go"}]})
}

/// The prompt tokens the gateway computes for `chat(content)`.
fn prompt_tokens(content: &str) -> Vec<u32> {
    let messages = vec![json!({"role": "system", "content": content}), json!({"role": "user", "content": "go"})];
    BuiltinTokenizer::encode(&BuiltinTokenizer::render(&messages))
}

fn system_prompt(name: &str) -> String {
    (0..300).map(|i| format!("{name}{i} ")).collect()
}

fn worker_toml(id: &str, url: &str, p: &Publisher) -> String {
    format!("[[workers]]\nid = \"{id}\"\nurl = \"{url}\"\nkv_events = \"{}\"\nreplay = \"{}\"\ntopic = \"kv-events\"\nblock_size = 16\n", p.endpoint, p.replay_endpoint)
}

async fn cached_on(gw: &Gateway, body: &Json, worker: &str) -> u64 {
    let d = gw.post("/admin/decide", body).await.json::<Json>().await.unwrap();
    d["decision"]["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker"] == worker)
        .map_or(0, |s| s["cached_tokens"].as_u64().unwrap())
}

async fn stream_view(gw: &Gateway, worker: &str) -> Json {
    let w = gw.get_json("/admin/workers").await;
    w["workers"].as_array().unwrap().iter().find(|x| x["id"] == worker).unwrap().clone()
}

async fn wait_until(gw: &Gateway, what: &str, f: impl Fn(&kvgate_gateway::AppState) -> bool) {
    assert!(gw.eventually(Duration::from_secs(5), f).await, "timed out waiting for {what}");
}

fn blocks_held(s: &kvgate_gateway::AppState, w: &str) -> usize {
    s.router.worker_status(&kvgate_core::WorkerId::new(w), s.clock.now()).map_or(0, |x| x.blocks_held)
}

/// Publishes a fixed sequence of stores and removals; `drop` lists live batches lost on the way.
async fn run_stream(drop: &[u64]) -> (usize, Vec<u64>, Json) {
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    wait_until(&gw, "the first catch-up", is_synced).await;
    let prompts: Vec<String> = (0..4).map(|i| system_prompt(&format!("p{i}x"))).collect();
    let mut seq = 0;
    for (i, text) in prompts.iter().enumerate() {
        let t = prompt_tokens(text);
        p.publish(seq, batch(vec![stored(&t, 1000 * (i as u64 + 1), None)]), drop.contains(&seq)).await;
        seq += 1;
    }
    // Evict the tail of prompt 1: its blocks 5.. (hashes 2005..) go.
    let tail: Vec<u64> = (2005..2000 + (prompt_tokens(&prompts[1]).len() / BLOCK) as u64).collect();
    p.publish(seq, batch(vec![removed(&tail)]), drop.contains(&seq)).await;
    seq += 1;
    p.publish(seq, batch(vec![]), false).await;
    let last = seq;
    wait_until(&gw, "the last batch", |s| s.engines.read().values().all(|e| e.stream.view().last_seq == Some(last)))
        .await;
    let mut cached = Vec::new();
    for text in &prompts {
        cached.push(cached_on(&gw, &chat(text), "a").await);
    }
    (blocks_held(&gw.state, "a"), cached, stream_view(&gw, "a").await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_and_the_index_ends_as_without_it() {
    let (held, cached, clean) = run_stream(&[]).await;
    assert!(held > 0);
    assert_eq!(cached[1], 5 * BLOCK as u64, "prompt 1 lost its tail");
    assert!(cached[0] > cached[1] && cached[2] > 0 && cached[3] > 0);
    let (held_gap, cached_gap, gappy) = run_stream(&[1, 2, 4]).await;
    assert_eq!((held_gap, cached_gap), (held, cached), "the replayed index is identical");
    assert!(gappy["kv_events"]["gaps"].as_u64().unwrap() >= 1, "{gappy}");
    assert!(gappy["kv_events"]["replays"].as_u64().unwrap() >= 1);
    assert_eq!(gappy["kv_events"]["history_lost"], 0);
    assert_eq!(gappy["router"]["kv_state"]["state"], "synced");
    assert_eq!(clean["kv_events"]["gaps"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_clears_the_worker_and_rebuilds_it_from_the_new_process() {
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    wait_until(&gw, "the first catch-up", is_synced).await;
    let (old, new) = (system_prompt("old"), system_prompt("new"));
    for seq in 0..3 {
        p.publish(seq, batch(if seq == 0 { vec![stored(&prompt_tokens(&old), 10, None)] } else { vec![] }), false)
            .await;
    }
    wait_until(&gw, "the old stream", |s| blocks_held(s, "a") > 0).await;
    assert!(cached_on(&gw, &chat(&old), "a").await > 0);
    p.restart();
    p.publish(0, batch(vec![stored(&prompt_tokens(&new), 7, None)]), false).await;
    wait_until(&gw, "the restart", |s| s.engines.read().values().all(|e| e.stream.view().restarts == 1)).await;
    wait_until(&gw, "the rebuild", |s| s.engines.read().values().all(|e| e.stream.view().last_seq == Some(0))).await;
    assert_eq!(cached_on(&gw, &chat(&old), "a").await, 0, "the old process's blocks are gone");
    assert!(cached_on(&gw, &chat(&new), "a").await > 0, "the new process's blocks are indexed");
    assert_eq!(stream_view(&gw, "a").await["router"]["kv_state"]["state"], "synced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_is_counted_and_isolated_to_its_worker() {
    let (ea, eb) = (fake_engine().await, fake_engine().await);
    let (mut pa, mut pb) = (Publisher::start().await, Publisher::start().await);
    let toml = base_toml(&[], &format!("{}{}", worker_toml("a", &ea.url(), &pa), worker_toml("b", &eb.url(), &pb)));
    let gw = gateway(&toml).await;
    pa.subscribed().await;
    pb.subscribed().await;
    let text = system_prompt("shared");
    pa.publish(0, vec![0xc1, 0x00, 0x17], false).await;
    pb.publish(0, batch(vec![stored(&prompt_tokens(&text), 1, None)]), false).await;
    wait_until(&gw, "b's batch", |s| blocks_held(s, "b") > 0).await;
    wait_until(&gw, "a's decode error", |s| s.engines.read().values().any(|e| e.stream.view().decode_errors == 1))
        .await;
    let a = stream_view(&gw, "a").await;
    assert_eq!(a["router"]["kv_state"]["state"], "invalid", "{a}");
    assert!(a["router"]["kv_state"]["reason"].as_str().unwrap().contains("undecodable"));
    assert_eq!(stream_view(&gw, "b").await["router"]["kv_state"]["state"], "synced");
    assert!(cached_on(&gw, &chat(&text), "b").await > 0, "the healthy worker's stream is unaffected");
    assert_eq!(gw.post("/v1/chat/completions", &chat(&text)).await.status(), 200, "the gateway keeps serving");
    let metrics = gw.client.get(gw.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_kv_decode_errors_total{engine=\"a\"} 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_decide_reflects_stored_and_removed_blocks() {
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    let text = system_prompt("doc");
    let tokens = prompt_tokens(&text);
    let blocks = (tokens.len() / BLOCK) as u64;
    p.publish(0, batch(vec![stored(&tokens, 100, None)]), false).await;
    wait_until(&gw, "the store", |s| blocks_held(s, "a") == blocks as usize).await;
    gw.wait_for_load().await;
    assert_eq!(cached_on(&gw, &chat(&text), "a").await, blocks * BLOCK as u64);
    p.publish(1, batch(vec![removed(&[100])]), false).await;
    wait_until(&gw, "the removal", |s| blocks_held(s, "a") == blocks as usize - 1).await;
    assert_eq!(cached_on(&gw, &chat(&text), "a").await, 0, "without its first block nothing of the prefix matches");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_prefix_draws_its_requests_to_the_engine_until_that_engine_is_overloaded() {
    let (ea, eb) = (fake_engine().await, fake_engine().await);
    let (pa, mut pb) = (Publisher::start().await, Publisher::start().await);
    let toml = base_toml(&[], &format!("{}{}", worker_toml("a", &ea.url(), &pa), worker_toml("b", &eb.url(), &pb)));
    let gw = gateway(&toml).await;
    pa.subscribed().await;
    pb.subscribed().await;
    gw.wait_for_load().await;
    let text = system_prompt("hot");
    pb.publish(0, batch(vec![stored(&prompt_tokens(&text), 1, None)]), false).await;
    wait_until(&gw, "b's store", |s| blocks_held(s, "b") > 0).await;
    for _ in 0..3 {
        assert_eq!(gw.post("/v1/chat/completions", &chat(&text)).await.status(), 200);
    }
    assert_eq!((ea.requests(), eb.requests()), (0, 3), "an idle owner wins on its cache");
    let log = gw.get_json("/admin/decisions?limit=1").await;
    assert_eq!(log["decisions"][0]["decision"]["reason"], "cache_and_load");
    eb.set(|b| b.load = (60, 600_000, 40));
    wait_until(&gw, "b's load report", |s| s.router.workers(s.clock.now()).iter().any(|w| w.waiting_requests >= 60))
        .await;
    assert_eq!(gw.post("/v1/chat/completions", &chat(&text)).await.status(), 200);
    assert_eq!((ea.requests(), eb.requests()), (1, 3), "an overloaded owner loses to an idle peer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooling_request_earns_no_credit_for_a_prompt_the_engine_holds() {
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    let text = system_prompt("pooled");
    p.publish(0, batch(vec![stored(&BuiltinTokenizer::encode(&text), 10, None)]), false).await;
    wait_until(&gw, "the store", |s| blocks_held(s, "a") > 0).await;
    gw.wait_for_load().await;
    assert!(cached_on(&gw, &json!({"prompt": text}), "a").await > 0, "a completion of the text is credited");
    assert_eq!(cached_on(&gw, &json!({"input": text}), "a").await, 0, "its embedding is not");
    assert_eq!(cached_on(&gw, &json!({"query": text, "documents": ["d"]}), "a").await, 0, "nor a rerank");
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// Two publishers on consecutive ports (ranks 0 and 1 of a data-parallel engine).
async fn two_ranks() -> (Publisher, Publisher) {
    for _ in 0..50 {
        let r0 = Publisher::start().await;
        let (p, q) = (port_of(&r0.endpoint) + 1, port_of(&r0.replay_endpoint) + 1);
        if let Some(r1) = Publisher::start_at(&format!("tcp://127.0.0.1:{p}"), &format!("tcp://127.0.0.1:{q}")).await {
            return (r0, r1);
        }
    }
    panic!("no consecutive free ports");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_data_parallel_rank_feeds_its_engine_index() {
    let engine = fake_engine().await;
    let (mut r0, mut r1) = two_ranks().await;
    let toml = base_toml(&[], &format!("{}dp_size = 2\n", worker_toml("a", &engine.url(), &r0)));
    let gw = gateway(&toml).await;
    r0.subscribed().await;
    r1.subscribed().await;
    let (t0, t1) = (system_prompt("rank0-"), system_prompt("rank1-"));
    r0.publish(0, batch(vec![stored(&prompt_tokens(&t0), 100, None)]), false).await;
    r1.publish(0, batch(vec![stored(&prompt_tokens(&t1), 900, None)]), false).await;
    wait_until(&gw, "both ranks", |s| s.engines.read().values().all(|e| e.stream.view().batches == 2)).await;
    assert!(cached_on(&gw, &chat(&t0), "a").await > 0);
    assert!(cached_on(&gw, &chat(&t1), "a").await > 0, "rank 1's stream on port + 1 is indexed too");
}

/// A wire test vector from `../shared` (which CI always has): a missing one fails the test.
fn vector(name: &str) -> Json {
    let path = format!("{}/../../../shared/data/kv-events/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}; the tests need ../shared/data beside the checkout"));
    serde_json::from_str(&text).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// vLLM 0.33's own bytes (seq 0, 1, then 0 from a restarted process) through real sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_own_restart_vector_replays_through_real_sockets() {
    let v = vector("vllm-0.33-restart-seq-reset.json");
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    let messages = v["frames_hex"].as_array().unwrap();
    let payload = |i: usize| unhex(messages[i][2].as_str().unwrap());
    // 49 tokens: the engine always computes the last prompt token, so the 48 cached ones all count.
    let tokens: Json = json!({"input_ids": (1..=49).collect::<Vec<u32>>(), "sampling_params": {"max_new_tokens": 4}});
    p.publish(0, payload(0), false).await;
    p.publish(1, payload(1), false).await;
    wait_until(&gw, "three blocks", |s| blocks_held(s, "a") == 3).await;
    assert_eq!(cached_on(&gw, &tokens, "a").await, 48, "the chained store links to its parent");
    p.restart();
    p.publish(0, payload(2), false).await;
    wait_until(&gw, "the restart", |s| s.engines.read().values().all(|e| e.stream.view().restarts == 1)).await;
    wait_until(&gw, "the rebuilt index", |s| blocks_held(s, "a") == 2).await;
    assert_eq!(cached_on(&gw, &tokens, "a").await, 32, "only the new process's two blocks remain");
}

/// Greets and shakes hands as a ZMTP 3.0 PUB, then announces a frame of `announced` bytes.
async fn lie_about_a_frame(stream: &mut tokio::net::TcpStream, announced: u64) {
    use tokio::io::AsyncWriteExt;
    let mut bytes = kvgate_zmtp::peer_opening("PUB");
    bytes.push(0x02);
    bytes.extend_from_slice(&announced.to_be_bytes());
    let _ = stream.write_all(&bytes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_event_peer_announcing_a_terabyte_frame_is_dropped_and_the_gateway_serves_on() {
    // Whoever listens on a down engine's event port: every connection it accepts gets a 1 TB header.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                lie_about_a_frame(&mut s, 1 << 40).await;
                tokio::time::sleep(Duration::from_secs(30)).await;
            });
        }
    });
    let engine = fake_engine().await;
    let toml =
        format!("[[workers]]\nid = \"a\"\nurl = \"{}\"\nkv_events = \"{endpoint}\"\nblock_size = 16\n", engine.url());
    let gw = gateway(&base_toml(&[], &toml)).await;
    // The gateway reconnects after each drop and is lied to again: it must survive every time.
    wait_until(&gw, "two dropped connections", |s| {
        s.engines.read().values().all(|e| e.stream.view().decode_errors >= 2)
    })
    .await;
    assert_eq!(gw.post("/v1/chat/completions", &chat_body(false)).await.status(), 200);
    let a = stream_view(&gw, "a").await;
    assert!(a["kv_events"]["connect_failures"].as_u64().unwrap() >= 2, "{a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_subscriber_drops_a_lying_publisher_and_hears_the_honest_one() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let engine = fake_engine().await;
    let toml = format!(
        "[[workers]]\nid = \"a\"\nurl = \"{}\"\nkv_events = \"tcp://127.0.0.1:{port}\"\nkv_events_bind = true\nblock_size = 16\n",
        engine.url()
    );
    let gw = gateway(&base_toml(&[], &toml)).await;
    let mut liar = loop {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    lie_about_a_frame(&mut liar, 64 << 30).await;
    wait_until(&gw, "the liar dropped", |s| s.engines.read().values().all(|e| e.stream.view().decode_errors == 1))
        .await;
    // An engine whose PUB connects, as vLLM's does with a tcp:// endpoint.
    let mut publisher = zeromq::PubSocket::new();
    publisher.connect(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    let text = system_prompt("honest");
    let payload = batch(vec![stored(&prompt_tokens(&text), 1, None)]);
    for _ in 0..250 {
        let m = vec![Bytes::new(), Bytes::from(0u64.to_be_bytes().to_vec()), Bytes::from(payload.clone())];
        publisher.send(ZmqMessage::try_from(m).unwrap()).await.unwrap();
        if blocks_held(&gw.state, "a") > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(blocks_held(&gw.state, "a") > 0, "the honest publisher's events were indexed");
    assert!(cached_on(&gw, &chat(&text), "a").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_repeats_the_last_sequence_number_with_all_blocks_cleared_is_a_restart() {
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    wait_until(&gw, "the first catch-up", is_synced).await;
    let (old, new) = (system_prompt("before"), system_prompt("after"));
    p.publish(0, batch(vec![stored(&prompt_tokens(&old), 10, None)]), false).await;
    wait_until(&gw, "the old stream", |s| blocks_held(s, "a") > 0).await;
    assert!(cached_on(&gw, &chat(&old), "a").await > 0);
    // The new process publishes seq 0 again: it starts by clearing everything.
    p.restart();
    let cleared = map(vec![("type", Value::from("AllBlocksCleared"))]);
    p.publish(0, batch(vec![cleared, stored(&prompt_tokens(&new), 500, None)]), false).await;
    wait_until(&gw, "the restart", |s| s.engines.read().values().all(|e| e.stream.view().restarts == 1)).await;
    wait_until(&gw, "the rebuild", |s| blocks_held(s, "a") > 0).await;
    assert_eq!(cached_on(&gw, &chat(&old), "a").await, 0, "the cleared prefix earns no credit");
    assert!(cached_on(&gw, &chat(&new), "a").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_event_stream_never_connected_is_not_shown_synced() {
    let engine = fake_engine().await;
    let dead = dead_url().await.replace("http://", "tcp://");
    let toml =
        format!("[[workers]]\nid = \"a\"\nurl = \"{}\"\nkv_events = \"{dead}\"\nblock_size = 16\n", engine.url());
    let gw = gateway(&base_toml(&[], &toml)).await;
    wait_until(&gw, "a failed connect", |s| s.engines.read().values().all(|e| e.stream.view().connect_failures >= 1))
        .await;
    let a = stream_view(&gw, "a").await;
    assert_eq!(a["router"]["kv_state"]["state"], "incomplete", "{a}");
    assert!(a["router"]["kv_state"]["reason"].as_str().unwrap().contains("down"), "{a}");
}

// Time-driven behaviour on a paused clock: the sockets are real, time moves only when advanced.

fn connect_failures(s: &kvgate_gateway::AppState) -> u64 {
    s.engines.read().values().map(|e| e.stream.view().connect_failures).sum()
}

fn stream_of(s: &kvgate_gateway::AppState) -> kvgate_gateway::registry::StreamView {
    s.engines.read().values().next().unwrap().stream.view()
}

fn kv_state(s: &kvgate_gateway::AppState) -> kvgate_core::KvState {
    s.router.worker_status(&kvgate_core::WorkerId::new("a"), s.clock.now()).unwrap().kv_state
}

fn is_synced(s: &kvgate_gateway::AppState) -> bool {
    matches!(kv_state(s), kvgate_core::KvState::Synced)
}

/// Lets the gateway run for a moment of real time: whatever it does without a timer shows.
async fn settle() {
    real_sleep(Duration::from_millis(30)).await;
}

#[tokio::test(start_paused = true)]
async fn reconnects_back_off_from_100_ms_doubling_to_10_s_and_start_over_after_a_connection() {
    let _frozen = freeze();
    let engine = fake_engine().await;
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let toml =
        format!("[[workers]]\nid = \"a\"\nurl = \"{}\"\nkv_events = \"{endpoint}\"\nblock_size = 16\n", engine.url());
    let gw = gateway(&base_toml(&[], &toml)).await;
    real_wait("the first refused connect", || connect_failures(&gw.state) == 1).await;
    let ms = Duration::from_millis;
    let waits = [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000];
    assert_eq!(ms(waits[0]), kvgate_gateway::kv_events::BACKOFF_MIN);
    assert_eq!(ms(waits[8]), kvgate_gateway::kv_events::BACKOFF_MAX);
    let mut failures = 1;
    expect_attempts_after(&gw, &mut failures, &waits).await;
    // The engine comes up: the next attempt connects.
    let p = Publisher::start_at(&endpoint, "tcp://127.0.0.1:0").await.unwrap();
    tokio::time::advance(ms(10_002)).await;
    p.subscribed().await;
    real_wait("the stream up", || is_synced(&gw.state)).await;
    // It goes away again: the backoff starts over at 100 ms.
    drop(p);
    failures += 1;
    real_wait("the lost stream", || connect_failures(&gw.state) == failures).await;
    expect_attempts_after(&gw, &mut failures, &[100, 200]).await;
}

/// Checks that each reconnect attempt comes exactly `waits[i]` ms after the last one (none 2 ms
/// before, one 2 ms after), counting them in `failures`.
async fn expect_attempts_after(gw: &Gateway, failures: &mut u64, waits: &[u64]) {
    for &wait in waits {
        tokio::time::advance(Duration::from_millis(wait - 2)).await;
        settle().await;
        assert_eq!(connect_failures(&gw.state), *failures, "no attempt before {wait} ms");
        tokio::time::advance(Duration::from_millis(4)).await;
        *failures += 1;
        let expected = *failures;
        real_wait(&format!("the attempt after {wait} ms"), || connect_failures(&gw.state) == expected).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_lost_last_batch_is_caught_up_after_two_quiet_seconds() {
    let _frozen = freeze();
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let gw = gateway(&base_toml(&[], &worker_toml("a", &engine.url(), &p))).await;
    p.subscribed().await;
    p.publish(0, batch(vec![stored(&prompt_tokens(&system_prompt("first")), 10, None)]), false).await;
    real_wait("batch 0", || stream_of(&gw.state).last_seq == Some(0)).await;
    // The last batch is lost live: no later one reveals the gap.
    let text = system_prompt("quiet");
    p.publish(1, batch(vec![stored(&prompt_tokens(&text), 500, None)]), true).await;
    let quiet = kvgate_gateway::kv_events::IDLE_CATCH_UP;
    assert_eq!(quiet, Duration::from_secs(2), "as documented in docs/kv-events.md");
    tokio::time::advance(quiet - Duration::from_millis(10)).await;
    settle().await;
    assert_eq!(stream_of(&gw.state).last_seq, Some(0), "not before {quiet:?} of quiet");
    tokio::time::advance(Duration::from_millis(20)).await;
    real_wait("the catch-up", || stream_of(&gw.state).last_seq == Some(1)).await;
    let view = stream_of(&gw.state);
    assert_eq!((view.gaps, view.history_lost), (0, 0), "a catch-up is not a gap: {view:?}");
    assert!(cached_on(&gw, &chat(&text), "a").await > 0, "the caught-up batch is indexed");
}

/// A replay socket that shakes hands as a ROUTER and then never answers.
async fn silent_replay_socket() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(&kvgate_zmtp::peer_opening("ROUTER")).await;
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink).await;
            });
        }
    });
    endpoint
}

#[tokio::test(start_paused = true)]
async fn a_replay_that_never_answers_is_given_up_after_two_seconds_and_the_stream_goes_on() {
    let _frozen = freeze();
    let engine = fake_engine().await;
    let mut p = Publisher::start().await;
    let silent = silent_replay_socket().await;
    let toml = worker_toml("a", &engine.url(), &p).replace(&p.replay_endpoint, &silent);
    let gw = gateway(&base_toml(&[], &toml)).await;
    p.subscribed().await;
    let limit = kvgate_gateway::kv_events::REPLAY_TIMEOUT;
    assert_eq!(limit, Duration::from_secs(2), "as documented in docs/kv-events.md");
    let ms = Duration::from_millis;
    // Even the catch-up on connect asks the silent socket: the view is complete only once it gives up.
    settle().await;
    assert!(!is_synced(&gw.state), "{:?}", kv_state(&gw.state));
    tokio::time::advance(limit + ms(10)).await;
    real_wait("the first catch-up given up", || is_synced(&gw.state)).await;
    p.publish(0, batch(vec![stored(&prompt_tokens(&system_prompt("zero")), 10, None)]), false).await;
    real_wait("batch 0", || stream_of(&gw.state).last_seq == Some(0)).await;
    // Batch 1 is lost; batch 2 reveals the gap, and the replay asked for never comes.
    p.publish(1, batch(vec![]), true).await;
    let text = system_prompt("two");
    p.publish(2, batch(vec![stored(&prompt_tokens(&text), 900, None)]), false).await;
    real_wait("the gap", || stream_of(&gw.state).gaps == 1).await;
    tokio::time::advance(limit - ms(10)).await;
    settle().await;
    assert_eq!(stream_of(&gw.state).history_lost, 0, "not given up before {limit:?}");
    assert!(!is_synced(&gw.state), "incomplete while the replay is awaited: {:?}", kv_state(&gw.state));
    tokio::time::advance(ms(20)).await;
    real_wait("the replay given up", || stream_of(&gw.state).history_lost == 1).await;
    real_wait("the view complete again", || is_synced(&gw.state)).await;
    assert!(cached_on(&gw, &chat(&text), "a").await > 0, "the batch after the gap is indexed");
    assert_eq!(
        cached_on(&gw, &chat(&system_prompt("zero")), "a").await,
        0,
        "what came before lost history is forgotten (it can only under-report)"
    );
}
