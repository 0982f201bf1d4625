//! The mock engine as a gRPC worker (`kvgate mock-engine --grpc`): SMG's worker protocol as vLLM's
//! engine servicer or SGLang's scheduler serves it (`smg-grpc-servicer`), whichever runtime the
//! mock's events speak, over the same engine model as the HTTP surface. One core serves both; the
//! two services differ only in their generated message types. Prompts come in as token ids and answers go out
//! as token ids of the mock model's tokenizer ([`crate::vocab`]), which `GetTokenizer` hands over.
//!
//! What a real servicer does and the mock does too: token ids streamed per step with the
//! request's sample index, the final message repeating only the last chunk's ids when streaming,
//! per-chunk completion counts, aborts (by request id, or by the client dropping its stream),
//! `grpc.health.v1`, loads, server and model info, and the KV events relayed on
//! `SubscribeKvEvents` with the engine's load on every batch and in heartbeats while it is idle. A
//! restarted engine ends every event stream, as a real restarted servicer's connection ends.
//! What it does not: sampling (it always generates its filler words and never an EOS, so every
//! sequence ends at its length), stop strings (vLLM's servicer matches them; the gateway trims the
//! mock's output instead), logprobs, embeddings.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use kvgate_core::RequestId;
use kvgate_engine_model::{EngineRequest, EventBatch};
use kvgate_protocol::kv_events::KvEvent;
use kvgate_protocol::telemetry::EngineLoad;
use kvgate_worker_proto::common;
use kvgate_worker_proto::sglang::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use kvgate_worker_proto::sglang::{self as pb, generate_complete, generate_response};
use kvgate_worker_proto::vllm;
use kvgate_worker_proto::vllm::vllm_engine_server::{VllmEngine, VllmEngineServer};
use parking_lot::Mutex;
use rand::Rng;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{broadcast, mpsc};
use tonic::{Request, Response, Status};

use crate::events::NOTHING_PUBLISHED;
use crate::server::{CancelOnDrop, ServerState};
use crate::stepper::{Command, TokenEvent};
use crate::vocab::vocab;

/// Tokens generated when a request gives no `max_new_tokens` (SGLang's default).
const DEFAULT_MAX_NEW_TOKENS: u32 = 128;
/// Most tokens one sequence may generate.
const MAX_NEW_TOKENS: u32 = 32_768;
/// Most sequences one request may ask for.
const MAX_SAMPLES: u32 = 128;
/// The context length the mock model reports.
pub const CONTEXT_LENGTH: i32 = 65_536;
/// How often an idle event stream carries the load alone.
const HEARTBEAT: Duration = Duration::from_millis(100);
/// Pieces of the tokenizer archive, as the servicers send it.
const TOKENIZER_PIECE: usize = 64 << 10;

/// Both runtimes' services over the mock's engine.
#[derive(Clone)]
pub struct MockScheduler {
    /// The engine, as the HTTP surface reaches it (commands, load, faults, model, ids, capacity).
    pub engine: ServerState,
    /// Most requests running at once.
    pub max_running: u32,
    /// The engine's live KV event batches.
    pub live: broadcast::Sender<Arc<(EventBatch, f64)>>,
    /// See [`crate::events::EventSockets::published_seq`].
    pub published_seq: Arc<AtomicU64>,
    /// The engine requests of each client request id still running, for `Abort`.
    pub running: Arc<Mutex<HashMap<String, Vec<RequestId>>>>,
}

impl MockScheduler {
    /// The tonic service as SGLang's scheduler serves it.
    pub fn into_sglang(self) -> SglangSchedulerServer<Self> {
        SglangSchedulerServer::new(self)
    }

    /// The tonic service as vLLM's engine servicer serves it.
    pub fn into_vllm(self) -> VllmEngineServer<Self> {
        VllmEngineServer::new(self)
    }

    /// One rank's load, in the fields both runtimes' `SchedulerLoad` share.
    fn rank_load(&self) -> RankLoad {
        let l: EngineLoad = *self.engine.shared.load.lock();
        RankLoad {
            running: saturate_i32(l.running_requests),
            waiting: saturate_i32(l.waiting_requests),
            used_tokens: saturate_i32(l.active_tokens.unwrap_or(0)),
            capacity: saturate_i32(self.engine.capacity_tokens),
            usage: l.kv_usage.unwrap_or(0.0),
            throughput: l.gen_throughput.unwrap_or(0.0),
            max_running: saturate_i32(u64::from(self.max_running)),
            waiting_uncached: saturate_i32(l.waiting_uncached_tokens.unwrap_or(0)),
        }
    }

    fn load_pushed(&self, sample: u64, load_only: bool) -> common::EngineLoad {
        let l = *self.engine.shared.load.lock();
        common::EngineLoad {
            running_requests: saturate(l.running_requests),
            waiting_requests: saturate(l.waiting_requests),
            waiting_uncached_tokens: l.waiting_uncached_tokens.map(saturate),
            token_usage: l.kv_usage.unwrap_or(0.0),
            gen_throughput: l.gen_throughput.unwrap_or(0.0),
            max_running_requests: self.max_running,
            age_ms: 0,
            sample,
            load_only,
            cache_hit_rate: None,
            num_used_tokens: None,
            max_total_num_tokens: Some(saturate_i32(self.engine.capacity_tokens)),
        }
    }
}

fn saturate(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

fn saturate_i32(v: u64) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

/// The load figures of one rank, as both runtimes' `SchedulerLoad` carry them.
struct RankLoad {
    running: i32,
    waiting: i32,
    used_tokens: i32,
    capacity: i32,
    usage: f64,
    throughput: f64,
    max_running: i32,
    waiting_uncached: i32,
}

/// A [`RankLoad`] as one runtime's `SchedulerLoad` (the same fields under different generated types).
macro_rules! scheduler_load {
    ($proto:ident, $l:expr) => {{
        let l = $l;
        $proto::SchedulerLoad {
            dp_rank: 0,
            num_running_reqs: l.running,
            num_waiting_reqs: l.waiting,
            num_total_reqs: l.running.saturating_add(l.waiting),
            num_used_tokens: l.used_tokens,
            max_total_num_tokens: l.capacity,
            token_usage: l.usage,
            gen_throughput: l.throughput,
            cache_hit_rate: 0.0,
            utilization: 0.0,
            max_running_requests: l.max_running,
            num_waiting_uncached_tokens: l.waiting_uncached,
        }
    }};
}

/// A stream of one runtime's `Generate` messages.
type Messages<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;
type TokenizerChunks = Pin<Box<dyn Stream<Item = Result<common::GetTokenizerChunk, Status>> + Send>>;
type EventBatches = Pin<Box<dyn Stream<Item = Result<common::KvEventBatch, Status>> + Send>>;

/// What a sequence sends next, before it is put in one runtime's message types (the two
/// services' messages have the same fields under different generated types).
enum Out {
    /// One generated token (streaming only).
    Chunk { index: u32, id: u32, prompt_tokens: u32 },
    /// The end: all ids when not streaming, else the last chunk's, as the Python servicers send.
    Complete { index: u32, output_ids: Vec<u32>, prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32 },
}

/// One sequence of a request, as its stream of messages is built.
struct Sequence {
    index: u32,
    events: mpsc::UnboundedReceiver<TokenEvent>,
    guard: CancelOnDrop,
    /// Tokens generated so far (whole answers send them all at the end).
    ids: Vec<u32>,
    last_chunk: Vec<u32>,
    stream: bool,
    prompt_tokens: u32,
    request_id: String,
    running: Arc<Mutex<HashMap<String, Vec<RequestId>>>>,
}

impl Sequence {
    /// The next message of this sequence, or `None` once it ended.
    async fn next(&mut self) -> Option<Result<Out, Status>> {
        if self.guard.finished {
            return None;
        }
        loop {
            match self.events.recv().await {
                Some(TokenEvent::First | TokenEvent::Token) => {
                    let words = &vocab().output_ids;
                    let id = words[self.ids.len() % words.len()];
                    self.ids.push(id);
                    if self.stream {
                        self.last_chunk = vec![id];
                        return Some(Ok(Out::Chunk { index: self.index, id, prompt_tokens: self.prompt_tokens }));
                    }
                }
                Some(TokenEvent::Done { prompt_tokens, cached_tokens, output_tokens }) => {
                    self.guard.finished = true;
                    self.forget();
                    let output_ids =
                        if self.stream { std::mem::take(&mut self.last_chunk) } else { std::mem::take(&mut self.ids) };
                    return Some(Ok(Out::Complete {
                        index: self.index,
                        output_ids,
                        prompt_tokens: saturate(prompt_tokens),
                        completion_tokens: saturate(output_tokens),
                        cached_tokens: saturate(cached_tokens),
                    }));
                }
                Some(TokenEvent::Failed) | None => {
                    self.guard.finished = true;
                    self.forget();
                    return Some(Err(Status::unavailable("the engine dropped the request (it restarted)")));
                }
            }
        }
    }

    fn forget(&self) {
        let mut running = self.running.lock();
        if let Some(ids) = running.get_mut(&self.request_id) {
            ids.retain(|id| *id != self.guard.id);
            if ids.is_empty() {
                running.remove(&self.request_id);
            }
        }
    }
}

/// What a `Generate` asks of the engine, in neither runtime's terms.
struct Ask {
    request_id: String,
    tokens: Vec<u32>,
    max_new_tokens: Option<u32>,
    n: u32,
    stream: bool,
    logprobs: bool,
}

impl MockScheduler {
    /// Checks a generation and submits its sequences; their messages come out in `shape`'s terms,
    /// each sequence's as they come. A client that drops the stream drops the sequences' guards,
    /// which cancel what is still running.
    fn generate_as<T: Send + 'static>(
        &self,
        ask: Ask,
        shape: fn(Out, &str) -> T,
    ) -> Result<Response<Messages<T>>, Status> {
        let tokens = ask.tokens;
        if tokens.is_empty() {
            return Err(Status::invalid_argument("the request has no input_ids"));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id >= vocab().vocab_size) {
            return Err(Status::invalid_argument(format!(
                "input id {bad} is outside the model's vocabulary of {}",
                vocab().vocab_size
            )));
        }
        if ask.logprobs {
            return Err(Status::invalid_argument("the mock engine computes no logprobs"));
        }
        let max_new = ask.max_new_tokens.unwrap_or(DEFAULT_MAX_NEW_TOKENS);
        if max_new == 0 || max_new > MAX_NEW_TOKENS {
            return Err(Status::invalid_argument(format!(
                "max_new_tokens = {max_new}: expected 1 to {MAX_NEW_TOKENS}"
            )));
        }
        let n = ask.n.max(1);
        if n > MAX_SAMPLES {
            return Err(Status::invalid_argument(format!("n = {n}: expected at most {MAX_SAMPLES}")));
        }
        let fail = {
            let p = self.engine.faults.lock().fail_requests;
            p > 0.0 && self.engine.rng.lock().random::<f64>() < p
        };
        if fail {
            return Err(Status::internal("injected failure"));
        }
        let request_id = if ask.request_id.is_empty() {
            format!("mock-{}", self.engine.next_id.load(Ordering::Relaxed))
        } else {
            ask.request_id
        };
        let prompt_tokens = saturate(tokens.len() as u64);
        let mut sequences = Vec::new();
        for index in 0..n {
            let id = RequestId(self.engine.next_id.fetch_add(1, Ordering::Relaxed));
            let (tx, rx) = mpsc::unbounded_channel();
            let engine_request = EngineRequest { id, tokens: tokens.clone(), output_tokens: max_new };
            if self.engine.commands.send(Command::Submit(engine_request, tx)).is_err() {
                return Err(Status::unavailable("the engine stopped"));
            }
            self.running.lock().entry(request_id.clone()).or_default().push(id);
            sequences.push(Sequence {
                index,
                events: rx,
                guard: CancelOnDrop { id, commands: self.engine.commands.clone(), finished: false },
                ids: Vec::new(),
                last_chunk: Vec::new(),
                stream: ask.stream,
                prompt_tokens,
                request_id: request_id.clone(),
                running: self.running.clone(),
            });
        }
        let streams = sequences.into_iter().map(move |s| {
            futures_util::stream::unfold(s, move |mut s| async move {
                let next = s.next().await?;
                Some((next.map(|out| shape(out, &s.request_id)), s))
            })
            .boxed()
        });
        Ok(Response::new(Box::pin(futures_util::stream::select_all(streams))))
    }

    /// Cancels every sequence of `request_id`; whether any was still running.
    fn abort_request(&self, request_id: &str) -> bool {
        let ids = self.running.lock().remove(request_id).unwrap_or_default();
        for engine_id in &ids {
            let _ = self.engine.commands.send(Command::Cancel(*engine_id));
        }
        !ids.is_empty()
    }

    /// The tokenizer archive in pieces, the checksum on the last, as the servicers send it.
    fn tokenizer_chunks() -> TokenizerChunks {
        let v = vocab();
        let pieces: Vec<&[u8]> = v.archive.chunks(TOKENIZER_PIECE).collect();
        let last = pieces.len().saturating_sub(1);
        let chunks: Vec<_> = pieces
            .into_iter()
            .enumerate()
            .map(|(i, data)| {
                Ok(common::GetTokenizerChunk {
                    data: data.to_vec(),
                    sha256: if i == last { v.sha256.clone() } else { String::new() },
                })
            })
            .collect();
        Box::pin(futures_util::stream::iter(chunks))
    }

    /// A `SubscribeKvEvents` stream, live from now.
    fn event_batches(&self, start: u64) -> Result<EventBatches, Status> {
        if start != 0 {
            return Err(Status::out_of_range(format!(
                "a subscription keeps no history: start at 0 (live from now), not {start}"
            )));
        }
        self.engine.shared.event_streams.fetch_add(1, Ordering::Relaxed);
        let relay = Relay {
            scheduler: self.clone(),
            live: self.live.subscribe(),
            published_seq: self.published_seq.clone(),
            started_at: self.engine.shared.started_at(),
            last_seq: None,
            sample: 0,
        };
        let stream = futures_util::stream::unfold(Some(relay), |relay| async move {
            let mut relay = relay?;
            match relay.next().await {
                Ok(batch) => Some((Ok(batch), Some(relay))),
                Err(status) => Some((Err(status), None)),
            }
        });
        Ok(Box::pin(stream))
    }
}

/// An [`Out`] as SGLang's scheduler sends it.
fn sglang_message(out: Out, request_id: &str) -> pb::GenerateResponse {
    let response = match out {
        Out::Chunk { index, id, prompt_tokens } => generate_response::Response::Chunk(pb::GenerateStreamChunk {
            token_ids: vec![id],
            prompt_tokens,
            // The servicer counts a chunk's own tokens, not a running total.
            completion_tokens: 1,
            cached_tokens: 0,
            output_logprobs: None,
            input_logprobs: None,
            index,
        }),
        Out::Complete { index, output_ids, prompt_tokens, completion_tokens, cached_tokens } => {
            generate_response::Response::Complete(pb::GenerateComplete {
                output_ids,
                // The mock never samples an EOS: every sequence runs to its length.
                finish_reason: "length".into(),
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                output_logprobs: None,
                input_logprobs: None,
                matched_stop: None::<generate_complete::MatchedStop>,
                index,
            })
        }
    };
    pb::GenerateResponse { request_id: request_id.to_owned(), response: Some(response) }
}

/// An [`Out`] as vLLM's engine servicer sends it.
fn vllm_message(out: Out, _request_id: &str) -> vllm::GenerateResponse {
    use vllm::generate_response::Response as R;
    let response = match out {
        Out::Chunk { index, id, prompt_tokens } => R::Chunk(vllm::GenerateStreamChunk {
            token_ids: vec![id],
            prompt_tokens,
            completion_tokens: 1,
            cached_tokens: 0,
            output_logprobs: None,
            input_logprobs: None,
            index,
        }),
        Out::Complete { index, output_ids, prompt_tokens, completion_tokens, cached_tokens } => {
            R::Complete(vllm::GenerateComplete {
                output_ids,
                finish_reason: "length".into(),
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                output_logprobs: None,
                input_logprobs: None,
                index,
                matched_stop: None,
            })
        }
    };
    vllm::GenerateResponse { response: Some(response) }
}

#[tonic::async_trait]
impl SglangScheduler for MockScheduler {
    type GenerateStream = Messages<pb::GenerateResponse>;
    type GetTokenizerStream = TokenizerChunks;
    type SubscribeKvEventsStream = EventBatches;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Messages<pb::GenerateResponse>>, Status> {
        let r = request.into_inner();
        let params = r.sampling_params.unwrap_or_default();
        let ask = Ask {
            request_id: r.request_id,
            tokens: r.tokenized.map(|t| t.input_ids).unwrap_or_default(),
            max_new_tokens: params.max_new_tokens,
            n: params.n,
            stream: r.stream,
            logprobs: r.return_logprob,
        };
        self.generate_as(ask, sglang_message)
    }

    async fn embed(&self, _: Request<pb::EmbedRequest>) -> Result<Response<pb::EmbedResponse>, Status> {
        Err(Status::unimplemented("the mock model is not an embedding model"))
    }

    async fn health_check(
        &self,
        _: Request<pb::HealthCheckRequest>,
    ) -> Result<Response<pb::HealthCheckResponse>, Status> {
        Ok(Response::new(pb::HealthCheckResponse { healthy: true, message: String::new() }))
    }

    async fn abort(&self, request: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        let id = request.into_inner().request_id;
        let aborted = self.abort_request(&id);
        let message = if aborted { String::new() } else { format!("no running request {id}") };
        Ok(Response::new(pb::AbortResponse { success: aborted, message }))
    }

    async fn get_model_info(
        &self,
        _: Request<pb::GetModelInfoRequest>,
    ) -> Result<Response<pb::GetModelInfoResponse>, Status> {
        Ok(Response::new(pb::GetModelInfoResponse {
            model_path: self.engine.model.clone(),
            tokenizer_path: self.engine.model.clone(),
            is_generation: true,
            served_model_name: self.engine.model.clone(),
            max_context_length: CONTEXT_LENGTH,
            vocab_size: saturate_i32(u64::from(vocab().vocab_size)),
            model_type: "kvgate-mock".into(),
            eos_token_ids: vec![saturate_i32(u64::from(vocab().eos))],
            pad_token_id: 0,
            bos_token_id: 0,
            max_req_input_len: CONTEXT_LENGTH,
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<pb::GetServerInfoRequest>,
    ) -> Result<Response<pb::GetServerInfoResponse>, Status> {
        let number = |v: f64| prost_types::Value { kind: Some(prost_types::value::Kind::NumberValue(v)) };
        let mut args = prost_types::Struct::default();
        args.fields.insert("page_size".into(), number(f64::from(self.engine.block_size)));
        args.fields.insert("max_running_requests".into(), number(f64::from(self.max_running)));
        args.fields.insert("context_length".into(), number(f64::from(CONTEXT_LENGTH)));
        let load = *self.engine.shared.load.lock();
        Ok(Response::new(pb::GetServerInfoResponse {
            server_args: Some(args),
            scheduler_info: None,
            active_requests: saturate_i32(load.running_requests + load.waiting_requests),
            uptime_seconds: 0.0,
            sglang_version: "kvgate-mock".into(),
            server_type: "grpc".into(),
            max_total_num_tokens: saturate_i32(self.engine.capacity_tokens),
        }))
    }

    async fn get_loads(&self, _: Request<pb::GetLoadsRequest>) -> Result<Response<pb::GetLoadsResponse>, Status> {
        Ok(Response::new(pb::GetLoadsResponse {
            timestamp: String::new(),
            version: "kvgate-mock".into(),
            dp_rank_count: 1,
            loads: vec![scheduler_load!(pb, self.rank_load())],
        }))
    }

    async fn flush_cache(
        &self,
        _: Request<common::FlushCacheRequest>,
    ) -> Result<Response<common::FlushCacheResponse>, Status> {
        Err(Status::unimplemented("the mock engine's cache is emptied by POST /admin/restart on its HTTP port"))
    }

    async fn get_tokenizer(
        &self,
        _: Request<common::GetTokenizerRequest>,
    ) -> Result<Response<TokenizerChunks>, Status> {
        Ok(Response::new(Self::tokenizer_chunks()))
    }

    async fn subscribe_kv_events(
        &self,
        request: Request<common::SubscribeKvEventsRequest>,
    ) -> Result<Response<EventBatches>, Status> {
        self.event_batches(request.into_inner().start_sequence_number).map(Response::new)
    }
}

#[tonic::async_trait]
impl VllmEngine for MockScheduler {
    type GenerateStream = Messages<vllm::GenerateResponse>;
    type GetTokenizerStream = TokenizerChunks;
    type SubscribeKvEventsStream = EventBatches;

    async fn generate(
        &self,
        request: Request<vllm::GenerateRequest>,
    ) -> Result<Response<Messages<vllm::GenerateResponse>>, Status> {
        let r = request.into_inner();
        let tokens = match r.input {
            Some(vllm::generate_request::Input::Tokenized(t)) => t.input_ids,
            Some(vllm::generate_request::Input::Text(_)) => {
                return Err(Status::invalid_argument("the mock engine takes token ids, not text"))
            }
            None => Vec::new(),
        };
        let params = r.sampling_params.unwrap_or_default();
        let ask = Ask {
            request_id: r.request_id,
            tokens,
            max_new_tokens: params.max_tokens,
            n: params.n,
            stream: r.stream,
            logprobs: params.logprobs.is_some() || params.prompt_logprobs.is_some(),
        };
        self.generate_as(ask, vllm_message)
    }

    async fn embed(&self, _: Request<vllm::EmbedRequest>) -> Result<Response<vllm::EmbedResponse>, Status> {
        Err(Status::unimplemented("the mock model is not an embedding model"))
    }

    async fn health_check(
        &self,
        _: Request<vllm::HealthCheckRequest>,
    ) -> Result<Response<vllm::HealthCheckResponse>, Status> {
        Ok(Response::new(vllm::HealthCheckResponse { healthy: true, message: String::new() }))
    }

    async fn flush_cache(
        &self,
        _: Request<common::FlushCacheRequest>,
    ) -> Result<Response<common::FlushCacheResponse>, Status> {
        Err(Status::unimplemented("the mock engine's cache is emptied by POST /admin/restart on its HTTP port"))
    }

    async fn abort(&self, request: Request<vllm::AbortRequest>) -> Result<Response<vllm::AbortResponse>, Status> {
        for id in request.into_inner().request_ids {
            self.abort_request(&id);
        }
        Ok(Response::new(vllm::AbortResponse {}))
    }

    async fn get_model_info(
        &self,
        _: Request<vllm::GetModelInfoRequest>,
    ) -> Result<Response<vllm::GetModelInfoResponse>, Status> {
        Ok(Response::new(vllm::GetModelInfoResponse {
            model_path: self.engine.model.clone(),
            is_generation: true,
            max_context_length: CONTEXT_LENGTH as u32,
            vocab_size: vocab().vocab_size,
            served_model_name: self.engine.model.clone(),
            tokenizer_path: self.engine.model.clone(),
            model_type: "kvgate-mock".into(),
            eos_token_ids: vec![saturate_i32(u64::from(vocab().eos))],
            pad_token_id: 0,
            bos_token_id: 0,
            max_req_input_len: CONTEXT_LENGTH,
        }))
    }

    async fn get_server_info(
        &self,
        _: Request<vllm::GetServerInfoRequest>,
    ) -> Result<Response<vllm::GetServerInfoResponse>, Status> {
        let load = *self.engine.shared.load.lock();
        Ok(Response::new(vllm::GetServerInfoResponse {
            active_requests: saturate(load.running_requests + load.waiting_requests),
            uptime_seconds: 0.0,
            server_type: "grpc".into(),
            data_parallel_size: 1,
            kv_cache_dtype: "auto".into(),
            block_size: saturate_i32(u64::from(self.engine.block_size)),
            max_num_seqs: saturate_i32(u64::from(self.max_running)),
        }))
    }

    async fn get_loads(&self, _: Request<vllm::GetLoadsRequest>) -> Result<Response<vllm::GetLoadsResponse>, Status> {
        Ok(Response::new(vllm::GetLoadsResponse {
            timestamp: String::new(),
            version: "kvgate-mock".into(),
            dp_rank_count: 1,
            loads: vec![scheduler_load!(vllm, self.rank_load())],
        }))
    }

    async fn get_tokenizer(
        &self,
        _: Request<common::GetTokenizerRequest>,
    ) -> Result<Response<TokenizerChunks>, Status> {
        Ok(Response::new(Self::tokenizer_chunks()))
    }

    async fn subscribe_kv_events(
        &self,
        request: Request<common::SubscribeKvEventsRequest>,
    ) -> Result<Response<EventBatches>, Status> {
        self.event_batches(request.into_inner().start_sequence_number).map(Response::new)
    }
}

/// One `SubscribeKvEvents` stream: the engine's batches as they are published, each carrying the
/// load, and the load alone while nothing is published.
struct Relay {
    scheduler: MockScheduler,
    live: broadcast::Receiver<Arc<(EventBatch, f64)>>,
    published_seq: Arc<AtomicU64>,
    /// The engine process's start when the stream opened: a restart ends the stream, as a
    /// restarted worker's connection ends.
    started_at: f64,
    last_seq: Option<u64>,
    sample: u64,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.scheduler.engine.shared.event_streams.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Relay {
    async fn next(&mut self) -> Result<common::KvEventBatch, Status> {
        self.sample += 1;
        loop {
            if self.scheduler.engine.shared.started_at() != self.started_at {
                return Err(Status::unavailable("the engine restarted: subscribe again"));
            }
            let received = match tokio::time::timeout(HEARTBEAT, self.live.recv()).await {
                Ok(received) => received,
                Err(_idle) => match self.last_seq {
                    Some(seq) => return Ok(self.heartbeat(seq)),
                    // A heartbeat sets the gateway's cursor, so before this stream relayed a
                    // batch it may only repeat one sent before the subscription: the last one
                    // published, if none is waiting in this stream (it is stored after it is sent).
                    None => {
                        let published = self.published_seq.load(Ordering::Acquire);
                        match self.live.try_recv() {
                            Ok(batch) => Ok(batch),
                            Err(TryRecvError::Empty) if published == NOTHING_PUBLISHED => continue,
                            Err(TryRecvError::Empty) => {
                                self.last_seq = Some(published);
                                return Ok(self.heartbeat(published));
                            }
                            Err(TryRecvError::Lagged(n)) => Err(RecvError::Lagged(n)),
                            Err(TryRecvError::Closed) => Err(RecvError::Closed),
                        }
                    }
                },
            };
            return match received {
                Ok(published) => {
                    let (batch, ts) = &*published;
                    // A restarted engine numbers its batches from 0 again.
                    if self.last_seq.is_some_and(|last| batch.seq <= last) {
                        return Err(Status::unavailable("the engine restarted: subscribe again"));
                    }
                    self.last_seq = Some(batch.seq);
                    Ok(common::KvEventBatch {
                        sequence_number: batch.seq,
                        timestamp: *ts,
                        events: batch.events.iter().enumerate().map(|(i, e)| event(i as u64, e)).collect(),
                        dp_rank: Some(0),
                        load: Some(self.scheduler.load_pushed(self.sample, false)),
                    })
                }
                Err(RecvError::Lagged(missed)) => {
                    Err(Status::data_loss(format!("the subscriber fell {missed} batches behind: subscribe again")))
                }
                Err(RecvError::Closed) => Err(Status::unavailable("the engine stopped")),
            };
        }
    }

    /// The load alone, repeating the last sequence number.
    fn heartbeat(&self, seq: u64) -> common::KvEventBatch {
        common::KvEventBatch {
            sequence_number: seq,
            timestamp: 0.0,
            events: Vec::new(),
            dp_rank: Some(0),
            load: Some(self.scheduler.load_pushed(self.sample, true)),
        }
    }
}

/// One event in the protocol's terms (the inverse of the gateway's reading of it).
fn event(event_id: u64, e: &KvEvent) -> common::KvCacheEvent {
    use common::kv_cache_event::Data;
    let hash = |h: kvgate_protocol::kv_events::EngineHash| h.0 as i64;
    let data = match e {
        KvEvent::BlockStored(s) => {
            let size = s.block_size.max(1) as usize;
            Data::Stored(common::KvBlocksStored {
                blocks: s
                    .block_hashes
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| common::KvBlock {
                        block_hash: hash(h),
                        token_ids: s.token_ids.iter().skip(i * size).take(size).copied().collect(),
                        block_size: i32::try_from(s.block_size).unwrap_or(i32::MAX),
                        ..Default::default()
                    })
                    .collect(),
                parent_block_hash: s.parent_block_hash.map(hash),
                tier: Some(common::KvCacheTier::Device as i32),
                medium: s.medium.clone(),
                group_idx: s.group_idx,
                kv_cache_spec_kind: s.kv_cache_spec_kind.clone(),
                lora_name: s.lora_name.clone(),
                cache_salt: s.cache_salt.clone(),
            })
        }
        KvEvent::BlockRemoved(r) => Data::Removed(common::KvBlocksRemoved {
            block_hashes: r.block_hashes.iter().map(|&h| hash(h)).collect(),
            tier: Some(common::KvCacheTier::Device as i32),
            medium: r.medium.clone(),
            group_idx: r.group_idx,
        }),
        KvEvent::AllBlocksCleared => Data::Cleared(common::KvCacheCleared {}),
    };
    common::KvCacheEvent { event_id, data: Some(data) }
}

#[cfg(test)]
mod tests {
    use kvgate_protocol::kv_events::{BlockStored, EngineHash};

    use super::*;

    #[test]
    fn a_stored_run_becomes_one_block_per_hash_with_its_tokens() {
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(u64::MAX), EngineHash(7)],
            parent_block_hash: Some(EngineHash(3)),
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            ..Default::default()
        });
        let common::KvCacheEvent { data: Some(common::kv_cache_event::Data::Stored(s)), .. } = event(0, &stored) else {
            panic!("not a stored event")
        };
        let blocks: Vec<(i64, Vec<u32>)> = s.blocks.iter().map(|b| (b.block_hash, b.token_ids.clone())).collect();
        assert_eq!(blocks, vec![(-1, vec![1, 2]), (7, vec![3, 4])]);
        assert_eq!(s.parent_block_hash, Some(3));
    }
}
