//! The fake SGLang scheduler the gRPC-worker tests run the gateway against, and the gateway in
//! front of it (see `main.rs`).

use super::support::*;
use futures_util::{Stream, StreamExt};
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer};
use kvgate_worker_proto::common;
use kvgate_worker_proto::sglang::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use kvgate_worker_proto::sglang::{self as pb, generate_complete, generate_response};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// The text the fake worker generates (an emoji split over byte-level tokens included).
pub const OUTPUT: &str = "Hello 🙂 world. STOP and more text";

/// What the fake worker saw.
#[derive(Default)]
pub struct Seen {
    pub generated: Vec<pb::GenerateRequest>,
    pub embedded: Vec<pb::EmbedRequest>,
    pub aborted: Vec<String>,
    /// Calls of the protocol's own `HealthCheck` (SGLang's generates a token for each).
    pub own_health_checks: usize,
    /// The protocol's own `HealthCheck` answers unhealthy (a stuck scheduler).
    pub own_unhealthy: bool,
}

/// One subscription's sending end: what the test sends, the gateway receives.
pub type Subscription = tokio::sync::mpsc::UnboundedSender<Result<common::KvEventBatch, Status>>;

/// The worker's KV event stream: refused (no publisher), or one channel per subscription.
#[derive(Default)]
pub struct Events {
    pub streamed: bool,
    pub subscriptions: Vec<Subscription>,
}

#[derive(Clone)]
pub struct FakeScheduler {
    pub output: Vec<u32>,
    pub eos: u32,
    pub chunk_delay: Duration,
    pub seen: Arc<Mutex<Seen>>,
    pub events: Arc<Mutex<Events>>,
    pub bundle: Bundle,
    /// A request for 7 tokens streams its first token alone, then waits for this before the rest.
    pub gate: Arc<tokio::sync::Notify>,
    /// Its model pools (an embedding model): `GetModelInfo` says it does not generate, and
    /// `Embed` answers with [`fake_embedding`].
    pub embeds: bool,
}

/// The fake worker's embedding of `ids`: their count, the first id, and a fraction a float32
/// cannot hold exactly.
pub fn fake_embedding(ids: &[u32]) -> Vec<f32> {
    vec![ids.len() as f32, ids.first().copied().unwrap_or(0) as f32, 0.1]
}

/// The tokenizer archive `GetTokenizer` sends, and the SHA-256 it gives for it (`None`: it has none).
pub type Bundle = Arc<Mutex<Option<(Vec<u8>, String)>>>;

pub type Pieces = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

pub fn chunk(index: u32, ids: &[u32], prompt: u32, logprobs: Option<pb::OutputLogProbs>) -> pb::GenerateResponse {
    pb::GenerateResponse {
        request_id: String::new(),
        response: Some(generate_response::Response::Chunk(pb::GenerateStreamChunk {
            token_ids: ids.to_vec(),
            prompt_tokens: prompt,
            completion_tokens: ids.len() as u32,
            cached_tokens: 3,
            index,
            output_logprobs: logprobs,
            input_logprobs: None,
        })),
    }
}

/// What the fake worker sends of the prompt `ids` from position `from` (SGLang's
/// `logprob_start_len`): the first token without a log probability, then -1, -2, ... with
/// `top` alternatives each (the token itself first).
pub fn fake_input_logprobs(ids: &[u32], from: usize, top: i32) -> pb::InputLogProbs {
    let tail = &ids[from.min(ids.len())..];
    pb::InputLogProbs {
        token_logprobs: (from..from + tail.len())
            .map(|at| pb::InputTokenLogProb { value: (at > 0).then(|| -(at as f32)) })
            .collect(),
        token_ids: tail.to_vec(),
        top_logprobs: (from..from + tail.len())
            .zip(tail)
            .map(|(at, &id)| pb::TopLogProbs {
                values: if at == 0 { Vec::new() } else { (0..top).map(|k| -(at as f32) - k as f32).collect() },
                token_ids: if at == 0 { Vec::new() } else { (0..top as u32).map(|k| id + k).collect() },
            })
            .collect(),
    }
}

/// Puts the prompt's log probabilities in each sequence's first message, as the servicers send
/// them.
fn with_input_logprobs(messages: &mut [pb::GenerateResponse], input: &pb::InputLogProbs) {
    let mut seen = std::collections::HashSet::new();
    for m in messages {
        match &mut m.response {
            Some(generate_response::Response::Chunk(c)) if seen.insert(c.index) => {
                c.input_logprobs = Some(input.clone());
            }
            Some(generate_response::Response::Complete(c)) if seen.insert(c.index) => {
                c.input_logprobs = Some(input.clone());
            }
            _ => {}
        }
    }
}

/// The fake worker's log probability of the token at output position `at`.
pub fn fake_logprob(at: usize) -> f32 {
    -0.25 * (at + 1) as f32
}

/// What the fake worker sends for `ids` from output position `from`, with `top` alternatives
/// each (the sampled token first, then the ids after it), when logprobs were asked.
pub fn fake_logprobs(ids: &[u32], from: usize, top: i32, asked: bool) -> Option<pb::OutputLogProbs> {
    asked.then(|| pb::OutputLogProbs {
        token_logprobs: (from..from + ids.len()).map(fake_logprob).collect(),
        token_ids: ids.to_vec(),
        top_logprobs: ids
            .iter()
            .enumerate()
            .map(|(i, &id)| pb::TopLogProbs {
                values: (0..top).map(|k| fake_logprob(from + i) - k as f32).collect(),
                token_ids: (0..top as u32).map(|k| id + k).collect(),
            })
            .collect(),
    })
}

#[tonic::async_trait]
impl SglangScheduler for FakeScheduler {
    type GenerateStream = Pieces;
    type GetTokenizerStream = Pin<Box<dyn Stream<Item = Result<common::GetTokenizerChunk, Status>> + Send>>;
    type SubscribeKvEventsStream = Pin<Box<dyn Stream<Item = Result<common::KvEventBatch, Status>> + Send>>;

    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<Pieces>, Status> {
        let r = request.into_inner();
        let prompt_ids = r.tokenized.as_ref().map(|t| t.input_ids.clone()).unwrap_or_default();
        let prompt = prompt_ids.len() as u32;
        let input = (r.return_logprob && r.logprob_start_len >= 0)
            .then(|| fake_input_logprobs(&prompt_ids, r.logprob_start_len as usize, r.top_logprobs_num));
        let max = r.sampling_params.as_ref().and_then(|s| s.max_new_tokens).unwrap_or(u32::MAX) as usize;
        let stream = r.stream;
        let r_n = r.sampling_params.as_ref().map_or(1, |s| s.n);
        let (asked, top) = (r.return_logprob, r.top_logprobs_num);
        self.seen.lock().generated.push(r);
        if max == 2 {
            // The worker refuses the request after accepting the stream.
            let refusal: Pieces =
                Box::pin(futures_util::stream::iter([Err(Status::invalid_argument("two is too few"))]));
            return Ok(Response::new(refusal));
        }
        // The whole output, then EOS, cut at max_new_tokens.
        let mut ids = self.output.clone();
        ids.push(self.eos);
        let hit_length = ids.len() > max;
        ids.truncate(max);
        let (finish, matched) = if hit_length {
            ("length", None)
        } else {
            ("stop", Some(generate_complete::MatchedStop::MatchedTokenId(self.eos)))
        };
        let n = r_n.max(1);
        let complete = move |index: u32, output_ids: Vec<u32>, completion: u32, from: usize| pb::GenerateResponse {
            request_id: String::new(),
            response: Some(generate_response::Response::Complete(pb::GenerateComplete {
                output_logprobs: fake_logprobs(&output_ids, from, top, asked),
                output_ids,
                finish_reason: finish.into(),
                prompt_tokens: prompt,
                completion_tokens: completion,
                cached_tokens: 3,
                matched_stop: matched.clone(),
                index,
                input_logprobs: None,
            })),
        };
        let delay = self.chunk_delay;
        if stream && max == 7 {
            let gate = self.gate.clone();
            let first = chunk(0, &ids[..1], prompt, None);
            let rest = chunk(0, &ids[1..], prompt, None);
            let end = complete(0, ids[1..].to_vec(), ids.len() as u32, 1);
            let gated = futures_util::stream::iter([Ok(first)]).chain(futures_util::stream::once(async move {
                gate.notified().await;
                Ok(rest)
            }));
            let pieces: Pieces = Box::pin(gated.chain(futures_util::stream::iter([Ok(end)])));
            return Ok(Response::new(pieces));
        }
        let pieces: Pieces = if stream {
            // Two tokens per chunk, as a worker with a stream interval sends them; the final
            // message repeats only the last chunk's ids, as the Python servicers do.
            let chunks: Vec<Vec<u32>> = ids.chunks(2).map(<[u32]>::to_vec).collect();
            let last = chunks.last().cloned().unwrap_or_default();
            let count = ids.len() as u32;
            let last_from = ids.len() - last.len();
            // Every sequence's chunks interleaved, as a worker batching them sends them.
            let mut messages: Vec<pb::GenerateResponse> = chunks
                .iter()
                .enumerate()
                .flat_map(|(k, c)| (0..n).map(move |i| chunk(i, c, prompt, fake_logprobs(c, 2 * k, top, asked))))
                .collect();
            // The end repeats the last chunk's ids and logprobs, as the Python servicers do.
            messages.extend((0..n).map(|i| complete(i, last.clone(), count, last_from)));
            if let Some(input) = &input {
                with_input_logprobs(&mut messages, input);
            }
            Box::pin(futures_util::stream::iter(messages).then(move |m| async move {
                tokio::time::sleep(delay).await;
                Ok(m)
            }))
        } else {
            let count = ids.len() as u32;
            // Every sequence numbered 0, as SGLang's Python servicer (0.14.1) numbers a whole answer's.
            let mut messages: Vec<pb::GenerateResponse> = (0..n).map(|_| complete(0, ids.clone(), count, 0)).collect();
            if let Some(input) = &input {
                with_input_logprobs(&mut messages, input);
            }
            Box::pin(futures_util::stream::iter(messages.into_iter().map(Ok)))
        };
        Ok(Response::new(pieces))
    }

    async fn embed(&self, request: Request<pb::EmbedRequest>) -> Result<Response<pb::EmbedResponse>, Status> {
        if !self.embeds {
            // As the servicers answer when their engine's model generates.
            return Err(Status::invalid_argument("the model does not support embeddings"));
        }
        let r = request.into_inner();
        let ids = r.tokenized.as_ref().map(|t| t.input_ids.clone()).unwrap_or_default();
        self.seen.lock().embedded.push(r);
        let embedding = fake_embedding(&ids);
        Ok(Response::new(pb::EmbedResponse {
            embedding_dim: embedding.len() as u32,
            embedding,
            prompt_tokens: ids.len() as u32,
        }))
    }

    async fn health_check(
        &self,
        _: Request<pb::HealthCheckRequest>,
    ) -> Result<Response<pb::HealthCheckResponse>, Status> {
        let mut seen = self.seen.lock();
        seen.own_health_checks += 1;
        Ok(Response::new(pb::HealthCheckResponse { healthy: !seen.own_unhealthy, message: String::new() }))
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        self.seen.lock().aborted.push(request.into_inner().request_id);
        Ok(Response::new(pb::AbortResponse { success: true, message: String::new() }))
    }

    async fn get_model_info(
        &self,
        _: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::GetModelInfoResponse>, Status> {
        Ok(Response::new(pb::GetModelInfoResponse {
            served_model_name: "fake-model".into(),
            max_context_length: 4096,
            is_generation: !self.embeds,
            ..Default::default()
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<pb::GetServerInfoRequest>,
    ) -> Result<Response<pb::GetServerInfoResponse>, Status> {
        let mut args = prost_types::Struct::default();
        args.fields
            .insert("page_size".into(), prost_types::Value { kind: Some(prost_types::value::Kind::NumberValue(16.0)) });
        Ok(Response::new(pb::GetServerInfoResponse {
            server_args: Some(args),
            max_total_num_tokens: 100_000,
            ..Default::default()
        }))
    }

    async fn get_loads(&self, _: Request<pb::GetLoadsRequest>) -> Result<Response<pb::GetLoadsResponse>, Status> {
        Ok(Response::new(pb::GetLoadsResponse {
            dp_rank_count: 1,
            loads: vec![pb::SchedulerLoad {
                num_running_reqs: 0,
                max_total_num_tokens: 100_000,
                max_running_requests: 8,
                ..Default::default()
            }],
            ..Default::default()
        }))
    }

    async fn flush_cache(
        &self,
        _: Request<common::FlushCacheRequest>,
    ) -> Result<Response<common::FlushCacheResponse>, Status> {
        Ok(Response::new(common::FlushCacheResponse { success: true, message: String::new() }))
    }

    async fn get_tokenizer(
        &self,
        _: Request<common::GetTokenizerRequest>,
    ) -> Result<Response<Self::GetTokenizerStream>, Status> {
        let Some((archive, sha256)) = self.bundle.lock().clone() else {
            return Err(Status::unimplemented("no tokenizer here"));
        };
        // In pieces, the checksum on the last, as the servicers send it.
        let pieces: Vec<_> = archive.chunks(64 << 10).map(<[u8]>::to_vec).collect();
        let last = pieces.len() - 1;
        let chunks = pieces.into_iter().enumerate().map(move |(i, data)| {
            Ok(common::GetTokenizerChunk { data, sha256: if i == last { sha256.clone() } else { String::new() } })
        });
        Ok(Response::new(Box::pin(futures_util::stream::iter(chunks.collect::<Vec<_>>()))))
    }

    async fn subscribe_kv_events(
        &self,
        request: Request<common::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let mut events = self.events.lock();
        if !events.streamed {
            return Err(Status::unimplemented("KV cache events have no publisher to relay"));
        }
        if request.into_inner().start_sequence_number != 0 {
            return Err(Status::out_of_range("resubscribe with zero and rebuild"));
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        events.subscriptions.push(tx);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(stream)))
    }
}

pub struct Fixture {
    pub gw: Gateway,
    pub seen: Arc<Mutex<Seen>>,
    pub events: Arc<Mutex<Events>>,
    pub bundle: Bundle,
    pub addr: std::net::SocketAddr,
    /// The worker's `grpc.health.v1` service (`None`: it has none).
    pub health: Option<tonic_health::server::HealthReporter>,
    pub gate: Arc<tokio::sync::Notify>,
}

pub async fn fixture(chunk_delay: Duration) -> Fixture {
    fixture_with(chunk_delay, false, 50, true).await
}

/// A gateway in front of the fake worker; `streamed`: the worker streams KV events;
/// `poll_interval_ms`: how often the gateway asks for its load; `standard_health`: the worker serves
/// `grpc.health.v1`, as the servicers do.
pub async fn fixture_with(
    chunk_delay: Duration,
    streamed: bool,
    poll_interval_ms: u64,
    standard_health: bool,
) -> Fixture {
    start(chunk_delay, streamed, poll_interval_ms, standard_health, false).await
}

/// A gateway in front of the fake worker serving an embedding model.
pub async fn embedding_fixture() -> Fixture {
    start(Duration::from_millis(2), false, 50, true, true).await
}

async fn start(
    chunk_delay: Duration,
    streamed: bool,
    poll_interval_ms: u64,
    standard_health: bool,
    embeds: bool,
) -> Fixture {
    let tokenizer_file = tokenizer_path();
    let tokenizer = HfTokenizer::load(&tokenizer_file, HfOptions::default()).unwrap();
    let output = tokenizer.encode_prompt(OUTPUT, false).unwrap();
    let eos = tokenizer.encode_prompt("<｜end▁of▁sentence｜>", false).unwrap()[0];
    let seen = Arc::new(Mutex::new(Seen::default()));
    let events = Arc::new(Mutex::new(Events { streamed, subscriptions: Vec::new() }));
    let bundle = Arc::new(Mutex::new(None));
    let gate = Arc::new(tokio::sync::Notify::new());
    let fake = FakeScheduler {
        output,
        eos,
        chunk_delay,
        seen: seen.clone(),
        events: events.clone(),
        bundle: bundle.clone(),
        gate: gate.clone(),
        embeds,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter.set_serving::<SglangSchedulerServer<FakeScheduler>>().await;
    let health = standard_health.then_some(reporter);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SglangSchedulerServer::new(fake))
            .add_optional_service(health.is_some().then_some(health_service))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    // DeepSeek's tokenizer files carry no chat template: a small one of the test's own.
    let template = std::env::temp_dir().join(format!("kvgate-grpc-test-{}.jinja", std::process::id()));
    std::fs::write(&template, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
        .unwrap();
    let toml = format!(
        "[server]\nblock_size = 16\n[tokenizer]\nkind = \"hf\"\npath = \"{}\"\nchat_template = \"{}\"\n[telemetry]\npoll_interval_ms = {poll_interval_ms}\nhealth_interval_ms = 100\n\n[[workers]]\nurl = \"grpc://{addr}\"\n",
        tokenizer_file.display(),
        template.display()
    );
    let gw = gateway(&toml).await;
    let ok = gw
        .eventually(Duration::from_secs(10), |s| {
            s.engines.all().iter().all(|e| !e.models.lock().is_empty())
                && s.router.workers(s.clock.now()).iter().all(|w| w.load_age_ms.is_some())
        })
        .await;
    assert!(ok, "the gRPC worker's health, model and load never arrived: {}", gw.get_json("/admin/workers").await);
    Fixture { gw, seen, events, bundle, addr, health, gate }
}

pub fn chat(stream: bool, extra: Value) -> Value {
    let mut body = json!({"model": "fake-model", "stream": stream, "temperature": 0,
                          "messages": [{"role": "user", "content": "Say hello."}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

pub fn stream_text(sse: &str) -> (String, Vec<Value>) {
    let mut text = String::new();
    let mut chunks = Vec::new();
    for event in events(sse) {
        let event =
            event.trim_end().strip_prefix("data: ").unwrap_or_else(|| panic!("not an SSE data event: {event:?}"));
        if event == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(event).unwrap_or_else(|e| panic!("{e}: {event}"));
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str().or(v["choices"][0]["text"].as_str()) {
            text.push_str(c);
        }
        chunks.push(v);
    }
    (text, chunks)
}
