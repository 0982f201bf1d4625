//! A gRPC worker (SMG's worker protocol, `kvgate_worker_proto`) as the gateway talks to it: one
//! lazily connected HTTP/2 channel, the runtime behind it (vLLM's `VllmEngine` or SGLang's
//! `SglangScheduler`, configured or detected), and the calls the gateway makes, the same for both
//! runtimes: health, load, server and model information, generation, abort, and the worker's own
//! KV event stream with the load it pushes.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use kvgate_protocol::telemetry::EngineLoad;
use kvgate_worker_proto::{common, sglang, vllm};
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// Which service a gRPC worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcRuntime {
    /// `vllm.grpc.engine.VllmEngine` (`vllm.entrypoints.launchers.grpc_server`).
    Vllm,
    /// `sglang.grpc.scheduler.SglangScheduler` (`--smg-grpc-mode`).
    Sglang,
}

impl GrpcRuntime {
    /// The runtime's name, as `engine =` configures it.
    pub fn as_str(self) -> &'static str {
        match self {
            GrpcRuntime::Vllm => "vllm",
            GrpcRuntime::Sglang => "sglang",
        }
    }
}

/// What a worker says about its own settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerInfo {
    /// Its KV block (page) size in tokens, where it gives one.
    pub block_size: Option<u32>,
    /// Its KV capacity in tokens, where it gives one.
    pub capacity_tokens: Option<u64>,
    /// Its largest running batch, where it gives one.
    pub max_running_requests: Option<u64>,
}

/// What a worker says about its model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelInfo {
    /// The name it serves the model under.
    pub served_model_name: String,
    /// The longest sequence (prompt and output) it takes.
    pub max_context_length: Option<u64>,
    /// Whether its model generates (`false`: it pools, as an embedding model does).
    pub is_generation: bool,
}

/// A worker's embedding of one input (`Embed`).
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding {
    /// The vector, as the worker's model pools it.
    pub values: Vec<f32>,
    /// The input's tokens, as the worker counted them.
    pub prompt_tokens: u32,
}

/// Sampling settings in the runtimes' common terms. `None` leaves a setting to the worker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    /// Temperature (0: greedy).
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Top-k sampling (`None` or -1: off).
    pub top_k: Option<i32>,
    /// Minimum probability relative to the top token.
    pub min_p: Option<f32>,
    /// OpenAI frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// OpenAI presence penalty.
    pub presence_penalty: Option<f32>,
    /// Multiplicative repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// Most tokens to generate.
    pub max_tokens: Option<u32>,
    /// Fewest tokens to generate before a stop may end the sequence.
    pub min_tokens: u32,
    /// Token ids that end the sequence.
    pub stop_token_ids: Vec<u32>,
    /// Stop strings (matched by the worker where it can; the gateway matches them too).
    pub stop: Vec<String>,
    /// Keep a matched stop string in the output.
    pub include_stop_str_in_output: bool,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// Generate past the end-of-sequence token.
    pub ignore_eos: bool,
    /// Sequences to generate.
    pub n: u32,
    /// Seed of the sampler.
    pub seed: Option<i32>,
    /// Added to the logits of these token ids before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// What the output must match (structured outputs), if anything.
    pub constraint: Option<Constraint>,
    /// Log probabilities of each output token, with this many of the most likely alternatives
    /// (`None`: none asked).
    pub logprobs: Option<u32>,
    /// Log probabilities of the prompt's tokens from this position on, with as many alternatives
    /// as `logprobs` asks (`None`: none asked).
    pub prompt_logprobs_from: Option<u32>,
    /// The response shows each token beside the best `logprobs` alternatives, one more when it
    /// is not among them (completions): a vLLM worker is asked for one alternative more.
    pub logprobs_beside_best: bool,
}

/// A structured-output constraint the worker's grammar engine enforces while sampling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// A JSON document matching this JSON schema (given as JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression.
    Regex(String),
    /// Text of this EBNF grammar.
    Grammar(String),
    /// Exactly one of these strings (vLLM workers only).
    Choice(Vec<String>),
}

/// The constraint SGLang's server sends for OpenAI's `json_object` response format.
const SGLANG_JSON_OBJECT: &str = r#"{"type": "object"}"#;

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// The id the worker knows the request by (and aborts it by).
    pub request_id: String,
    /// The prompt's token ids.
    pub input_ids: Vec<u32>,
    /// Sampling settings.
    pub sampling: Sampling,
    /// Stream pieces as they are generated (else one final piece per sequence).
    pub stream: bool,
}

/// How a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchedStop {
    /// A stop token id (an EOS or one of `stop_token_ids`).
    Token(u32),
    /// A stop string the worker matched.
    Text(String),
}

/// Log probabilities of a run of output tokens, as a worker sends them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled tokens.
    pub token_ids: Vec<u32>,
    /// Each sampled token's log probability.
    pub values: Vec<f32>,
    /// Each position's most likely tokens with their log probabilities, most likely first (empty
    /// rows when no alternatives were asked).
    pub top: Vec<Vec<(u32, f32)>>,
}

/// Log probabilities of a run of prompt tokens, as a worker sends them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptLogprobs {
    /// The prompt's tokens.
    pub token_ids: Vec<u32>,
    /// Each token's log probability; `None` for the prompt's first token, which nothing predicts.
    pub values: Vec<Option<f32>>,
    /// Each position's most likely tokens with their log probabilities (empty rows when no
    /// alternatives were asked).
    pub top: Vec<Vec<(u32, f32)>>,
}

/// One message of a worker's answer, in the runtimes' common terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// New tokens of sequence `index`.
    Chunk {
        /// Which of the request's sequences.
        index: u32,
        /// The new token ids.
        token_ids: Vec<u32>,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Prompt tokens served from the worker's prefix cache.
        cached_tokens: u32,
        /// The new tokens' log probabilities, when asked.
        logprobs: Option<TokenLogprobs>,
        /// The prompt's log probabilities, when asked (in a sequence's first chunk).
        prompt_logprobs: Option<PromptLogprobs>,
    },
    /// Sequence `index` ended.
    Complete {
        /// Which of the request's sequences.
        index: u32,
        /// Token ids the message carries (all of the sequence when not streaming; the Python
        /// servicers repeat the last chunk's ids when streaming, so a stream ignores them).
        output_ids: Vec<u32>,
        /// `stop`, `length`, `abort`, ...
        finish_reason: String,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Generated tokens as the worker counts them.
        completion_tokens: u32,
        /// Prompt tokens served from the worker's prefix cache.
        cached_tokens: u32,
        /// What stopped it, when a stop did.
        matched_stop: Option<MatchedStop>,
        /// Log probabilities of `output_ids`, when asked.
        logprobs: Option<TokenLogprobs>,
        /// The prompt's log probabilities, when asked and no chunk brought them.
        prompt_logprobs: Option<PromptLogprobs>,
    },
}

/// A worker's answer: its messages, as they arrive.
pub type PieceStream = Pin<Box<dyn Stream<Item = Result<Piece, Status>> + Send>>;

/// One gRPC worker.
#[derive(Debug)]
pub struct GrpcWorker {
    endpoint: Endpoint,
    channel: OnceLock<Channel>,
    configured: Option<GrpcRuntime>,
    detected: Mutex<Option<GrpcRuntime>>,
    /// Data-parallel ranks in its last `GetLoads` answer (0: not known yet).
    ranks: AtomicUsize,
    /// It answered `UNIMPLEMENTED` to `grpc.health.v1`: its own `HealthCheck` is asked instead.
    without_standard_health: AtomicBool,
    /// Whether its model generates, from its last `GetModelInfo` (0: not asked yet, 1: it
    /// generates, 2: it embeds).
    generates: AtomicU8,
}

/// A worker's KV event stream (`SubscribeKvEvents`), as it arrives.
pub type KvEventStream = tonic::Streaming<common::KvEventBatch>;

/// The `http://host:port` a `grpc://host:port` worker URL is reached at.
pub fn channel_uri(url: &str) -> Result<String, String> {
    let rest = url.strip_prefix("grpc://").ok_or_else(|| format!("{url:?} is not a grpc:// URL"))?;
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        return Err(format!("{url:?}: a gRPC worker URL is grpc://host:port, without a path"));
    }
    Ok(format!("http://{authority}"))
}

impl GrpcWorker {
    /// A worker at `url` (`grpc://host:port`), running `runtime` if known. Nothing connects yet.
    pub fn new(url: &str, runtime: Option<GrpcRuntime>, connect_timeout: Duration) -> Result<Self, String> {
        let endpoint = Endpoint::from_shared(channel_uri(url)?)
            .map_err(|e| format!("{url:?}: {e}"))?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            // A worker that went away is noticed between requests, not only by the next one.
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_while_idle(true);
        Ok(GrpcWorker {
            endpoint,
            channel: OnceLock::new(),
            configured: runtime,
            detected: Mutex::new(None),
            ranks: AtomicUsize::new(0),
            without_standard_health: AtomicBool::new(false),
            generates: AtomicU8::new(0),
        })
    }

    fn channel(&self) -> Channel {
        // Connects on first use and reconnects after a failure, from within the runtime.
        self.channel.get_or_init(|| self.endpoint.connect_lazy()).clone()
    }

    fn vllm(&self) -> vllm::vllm_engine_client::VllmEngineClient<Channel> {
        vllm::vllm_engine_client::VllmEngineClient::new(self.channel()).max_decoding_message_size(64 << 20)
    }

    fn sglang(&self) -> sglang::sglang_scheduler_client::SglangSchedulerClient<Channel> {
        sglang::sglang_scheduler_client::SglangSchedulerClient::new(self.channel()).max_decoding_message_size(64 << 20)
    }

    /// Whether the worker's model generates (`Some(false)`: an embedding model), once its
    /// `GetModelInfo` has been read.
    pub fn generates(&self) -> Option<bool> {
        match self.generates.load(Ordering::Relaxed) {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        }
    }

    /// The runtime, as configured or as detected so far.
    pub fn known_runtime(&self) -> Option<GrpcRuntime> {
        self.configured.or(*self.detected.lock())
    }

    /// The worker's runtime: as configured, else detected by which service answers (SGLang's is
    /// asked first; a worker that does not serve it answers `UNIMPLEMENTED`).
    pub async fn runtime(&self, timeout: Duration) -> Result<GrpcRuntime, Status> {
        if let Some(r) = self.known_runtime() {
            return Ok(r);
        }
        let asked = self.sglang().get_model_info(request(sglang::GetModelInfoRequest {}, timeout)).await;
        let runtime = match asked {
            Ok(_) => GrpcRuntime::Sglang,
            Err(s) if s.code() == Code::Unimplemented => {
                self.vllm().get_model_info(request(vllm::GetModelInfoRequest {}, timeout)).await?;
                GrpcRuntime::Vllm
            }
            Err(s) => return Err(s),
        };
        *self.detected.lock() = Some(runtime);
        Ok(runtime)
    }

    /// Whether the worker is ready to serve: the standard `grpc.health.v1` check of its runtime's
    /// service (the servicers answer it from the engine's state, and SGLang's from whether its
    /// scheduler is stuck, without generating anything), or, from a worker without the standard
    /// service, the protocol's own `HealthCheck` (which makes an SGLang worker generate a token).
    /// An SGLang worker's NOT_SERVING is confirmed with its own `HealthCheck` before it counts.
    pub async fn health(&self, timeout: Duration) -> Result<bool, Status> {
        let runtime = self.runtime(timeout).await?;
        if !self.without_standard_health.load(Ordering::Relaxed) {
            let service = match runtime {
                GrpcRuntime::Vllm => "vllm.grpc.engine.VllmEngine",
                GrpcRuntime::Sglang => "sglang.grpc.scheduler.SglangScheduler",
            };
            let asked = tonic_health::pb::HealthCheckRequest { service: service.into() };
            let mut client = tonic_health::pb::health_client::HealthClient::new(self.channel());
            match client.check(request(asked, timeout)).await {
                Ok(answer) => {
                    let serving = answer.into_inner().status
                        == tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
                    // SGLang's servicer says NOT_SERVING when its scheduler has been silent for 30 s
                    // with a request pending, and counts the silence from the scheduler's last
                    // output, not from when the request came: the first request after half a
                    // minute of idleness reads as a stuck scheduler until its first output (seen:
                    // "Scheduler not responsive: 75.8s since last receive, 1 pending requests" for
                    // a 115-ms request; in CI a slower one took the worker out of rotation). The
                    // worker's own HealthCheck settles it: healthy as soon as the scheduler outputs
                    // anything, unhealthy at the deadline if it is really stuck.
                    if serving || runtime != GrpcRuntime::Sglang {
                        return Ok(serving);
                    }
                    tracing::debug!("the gRPC worker's readiness probe says NOT_SERVING: asking its own HealthCheck");
                }
                Err(s) if s.code() == Code::Unimplemented => {
                    tracing::info!("the gRPC worker has no grpc.health.v1 service: asking its own HealthCheck");
                    self.without_standard_health.store(true, Ordering::Relaxed);
                }
                Err(s) => return Err(s),
            }
        }
        Ok(match runtime {
            GrpcRuntime::Vllm => {
                self.vllm().health_check(request(vllm::HealthCheckRequest {}, timeout)).await?.into_inner().healthy
            }
            GrpcRuntime::Sglang => {
                self.sglang().health_check(request(sglang::HealthCheckRequest {}, timeout)).await?.into_inner().healthy
            }
        })
    }

    /// The worker's load, summed over its data-parallel ranks.
    pub async fn loads(&self, timeout: Duration) -> Result<EngineLoad, Status> {
        let ranks: Vec<RankLoad> = match self.runtime(timeout).await? {
            GrpcRuntime::Vllm => {
                let asked = vllm::GetLoadsRequest { dp_rank: None, include: Vec::new() };
                let answer = self.vllm().get_loads(request(asked, timeout)).await?.into_inner();
                answer.loads.iter().map(RankLoad::from_vllm).collect()
            }
            GrpcRuntime::Sglang => {
                let asked = sglang::GetLoadsRequest { dp_rank: None, include: Vec::new() };
                let answer = self.sglang().get_loads(request(asked, timeout)).await?.into_inner();
                answer.loads.iter().map(RankLoad::from_sglang).collect()
            }
        };
        if ranks.is_empty() {
            return Err(Status::internal("GetLoads answered without any rank"));
        }
        self.ranks.store(ranks.len(), Ordering::Relaxed);
        Ok(sum_ranks(&ranks))
    }

    /// Data-parallel ranks the worker reported in its last `GetLoads` answer (0: none yet).
    pub fn known_ranks(&self) -> usize {
        self.ranks.load(Ordering::Relaxed)
    }

    /// The worker's tokenizer files as one zip archive (`GetTokenizer`), with the hex SHA-256 the
    /// worker gives for it (checked here). `timeout` bounds the whole download.
    pub async fn tokenizer_archive(&self, timeout: Duration) -> Result<Vec<u8>, Status> {
        /// Far beyond any tokenizer (the largest are tens of MB): a worker sending more is wrong.
        const MOST: usize = 512 << 20;
        let download = async {
            let asked = common::GetTokenizerRequest {};
            let mut chunks = match self.runtime(timeout).await? {
                GrpcRuntime::Vllm => self.vllm().get_tokenizer(tonic::Request::new(asked)).await?.into_inner(),
                GrpcRuntime::Sglang => self.sglang().get_tokenizer(tonic::Request::new(asked)).await?.into_inner(),
            };
            let (mut archive, mut checksum) = (Vec::new(), String::new());
            while let Some(chunk) = chunks.message().await? {
                archive.extend_from_slice(&chunk.data);
                if archive.len() > MOST {
                    return Err(Status::resource_exhausted(format!("the tokenizer archive is over {MOST} bytes")));
                }
                if !chunk.sha256.is_empty() {
                    checksum = chunk.sha256;
                }
            }
            Ok((archive, checksum))
        };
        let (archive, checksum) = tokio::time::timeout(timeout, download)
            .await
            .map_err(|_| Status::deadline_exceeded("GetTokenizer did not finish in time"))??;
        let digest = sha256_hex(&archive);
        if !checksum.eq_ignore_ascii_case(&digest) {
            return Err(Status::data_loss(format!(
                "the tokenizer archive's SHA-256 is {digest}, the worker said {checksum:?}"
            )));
        }
        Ok(archive)
    }

    /// Opens the worker's KV event stream, live from now: the protocol keeps no history between
    /// subscriptions, so the only cursor a new one takes is 0. `timeout` bounds the opening only.
    pub async fn subscribe_kv_events(&self, timeout: Duration) -> Result<KvEventStream, Status> {
        let asked = common::SubscribeKvEventsRequest { start_sequence_number: 0 };
        let opening = async {
            Ok::<_, Status>(match self.runtime(timeout).await? {
                GrpcRuntime::Vllm => self.vllm().subscribe_kv_events(tonic::Request::new(asked)).await?,
                GrpcRuntime::Sglang => self.sglang().subscribe_kv_events(tonic::Request::new(asked)).await?,
            })
        };
        match tokio::time::timeout(timeout, opening).await {
            Ok(opened) => Ok(opened?.into_inner()),
            Err(_) => Err(Status::deadline_exceeded("SubscribeKvEvents did not open in time")),
        }
    }

    /// What the worker says about its settings.
    pub async fn server_info(&self, timeout: Duration) -> Result<ServerInfo, Status> {
        Ok(match self.runtime(timeout).await? {
            GrpcRuntime::Vllm => {
                let info =
                    self.vllm().get_server_info(request(vllm::GetServerInfoRequest {}, timeout)).await?.into_inner();
                ServerInfo {
                    block_size: u32::try_from(info.block_size).ok().filter(|&b| b > 0),
                    capacity_tokens: None,
                    max_running_requests: u64::try_from(info.max_num_seqs).ok().filter(|&n| n > 0),
                }
            }
            GrpcRuntime::Sglang => {
                let info = self
                    .sglang()
                    .get_server_info(request(sglang::GetServerInfoRequest {}, timeout))
                    .await?
                    .into_inner();
                let arg = |name: &str| -> Option<u64> {
                    let v = info.server_args.as_ref()?.fields.get(name)?;
                    match v.kind.as_ref()? {
                        prost_types::value::Kind::NumberValue(n) if *n >= 1.0 && n.fract() == 0.0 => Some(*n as u64),
                        _ => None,
                    }
                };
                ServerInfo {
                    block_size: arg("page_size").and_then(|b| u32::try_from(b).ok()),
                    capacity_tokens: u64::try_from(info.max_total_num_tokens).ok().filter(|&t| t > 0),
                    max_running_requests: arg("max_running_requests"),
                }
            }
        })
    }

    /// What the worker says about its model.
    pub async fn model_info(&self, timeout: Duration) -> Result<ModelInfo, Status> {
        let info = match self.runtime(timeout).await? {
            GrpcRuntime::Vllm => {
                let info =
                    self.vllm().get_model_info(request(vllm::GetModelInfoRequest {}, timeout)).await?.into_inner();
                let name = if info.served_model_name.is_empty() { info.model_path } else { info.served_model_name };
                ModelInfo {
                    served_model_name: name,
                    max_context_length: Some(u64::from(info.max_context_length)).filter(|&l| l > 0),
                    is_generation: info.is_generation,
                }
            }
            GrpcRuntime::Sglang => {
                let info =
                    self.sglang().get_model_info(request(sglang::GetModelInfoRequest {}, timeout)).await?.into_inner();
                let name = if info.served_model_name.is_empty() { info.model_path } else { info.served_model_name };
                ModelInfo {
                    served_model_name: name,
                    max_context_length: u64::try_from(info.max_context_length).ok().filter(|&l| l > 0),
                    is_generation: info.is_generation,
                }
            }
        };
        self.generates.store(if info.is_generation { 1 } else { 2 }, Ordering::Relaxed);
        Ok(info)
    }

    /// The embedding of one input's token ids, from a worker whose model pools (`Embed`).
    pub async fn embed(&self, request_id: String, input_ids: Vec<u32>, timeout: Duration) -> Result<Embedding, Status> {
        Ok(match self.runtime(timeout).await? {
            GrpcRuntime::Vllm => {
                let tokenized = Some(vllm::TokenizedInput { original_text: String::new(), input_ids });
                let asked = vllm::EmbedRequest { request_id, tokenized };
                let answer = self.vllm().embed(request(asked, timeout)).await?.into_inner();
                Embedding { values: answer.embedding, prompt_tokens: answer.prompt_tokens }
            }
            GrpcRuntime::Sglang => {
                let tokenized = Some(sglang::TokenizedInput { original_text: String::new(), input_ids });
                // The servicer converts sampling settings even for an embedding (it sets the output
                // length to 0 itself): the protocol's defaults.
                let asked = sglang::EmbedRequest { request_id, tokenized, sampling_params: Some(Default::default()) };
                let answer = self.sglang().embed(request(asked, timeout)).await?.into_inner();
                Embedding { values: answer.embedding, prompt_tokens: answer.prompt_tokens }
            }
        })
    }

    /// Starts a generation; the answer's messages come as the worker sends them.
    pub async fn generate(&self, generation: Generation, timeout: Duration) -> Result<PieceStream, Status> {
        match self.runtime(timeout).await? {
            GrpcRuntime::Vllm => {
                let answer = self.vllm().generate(tonic::Request::new(to_vllm(generation))).await?.into_inner();
                Ok(Box::pin(answer.map(|m| m.and_then(from_vllm))))
            }
            GrpcRuntime::Sglang => {
                let answer = self.sglang().generate(tonic::Request::new(to_sglang(generation))).await?.into_inner();
                Ok(Box::pin(answer.map(|m| m.and_then(from_sglang))))
            }
        }
    }

    /// Asks the worker to stop a request (a client went away, a stop string matched).
    pub async fn abort(&self, request_id: &str, timeout: Duration) -> Result<(), Status> {
        match self.runtime(timeout).await? {
            GrpcRuntime::Vllm => {
                let asked = vllm::AbortRequest { request_ids: vec![request_id.to_owned()] };
                self.vllm().abort(request(asked, timeout)).await?;
            }
            GrpcRuntime::Sglang => {
                let asked = sglang::AbortRequest { request_id: request_id.to_owned(), reason: "client gone".into() };
                self.sglang().abort(request(asked, timeout)).await?;
            }
        }
        Ok(())
    }
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.set_timeout(timeout);
    r
}

/// One rank's load in common terms.
#[derive(Debug, Clone, Copy)]
struct RankLoad {
    running: u64,
    waiting: u64,
    waiting_uncached_tokens: Option<u64>,
    used_tokens: Option<u64>,
    capacity_tokens: Option<u64>,
    token_usage: f64,
    gen_throughput: f64,
    max_running_requests: Option<u64>,
}

/// A count the worker sends as a signed number: negative values are not counts.
fn count(v: i32) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn positive(v: i32) -> Option<u64> {
    u64::try_from(v).ok().filter(|&n| n > 0)
}

/// One rank's load from either runtime's `SchedulerLoad`: the same fields under different generated
/// types, so one macro body serves both.
macro_rules! rank_load_from {
    ($l:expr) => {
        RankLoad {
            running: count($l.num_running_reqs),
            waiting: count($l.num_waiting_reqs),
            waiting_uncached_tokens: Some(count($l.num_waiting_uncached_tokens)),
            used_tokens: Some(count($l.num_used_tokens)),
            capacity_tokens: positive($l.max_total_num_tokens),
            token_usage: $l.token_usage,
            gen_throughput: $l.gen_throughput,
            max_running_requests: positive($l.max_running_requests),
        }
    };
}

impl RankLoad {
    fn from_vllm(l: &vllm::SchedulerLoad) -> Self {
        rank_load_from!(l)
    }

    fn from_sglang(l: &sglang::SchedulerLoad) -> Self {
        rank_load_from!(l)
    }
}

impl RankLoad {
    /// One rank's record as the worker pushes it on its event stream. Records on event batches
    /// carry the core figures only (the servicer sends its token counts on the first record and the
    /// heartbeats): a figure a record leaves out keeps the rank's last known value.
    fn from_pushed(l: &common::EngineLoad, last: Option<&RankLoad>) -> Self {
        let held = |now: Option<u64>, then: fn(&RankLoad) -> Option<u64>| now.or_else(|| last.and_then(then));
        RankLoad {
            running: u64::from(l.running_requests),
            waiting: u64::from(l.waiting_requests),
            waiting_uncached_tokens: l.waiting_uncached_tokens.map(u64::from),
            used_tokens: held(l.num_used_tokens.and_then(|t| u64::try_from(t).ok()), |r| r.used_tokens),
            capacity_tokens: held(l.max_total_num_tokens.and_then(positive), |r| r.capacity_tokens),
            token_usage: l.token_usage,
            gen_throughput: l.gen_throughput,
            max_running_requests: Some(u64::from(l.max_running_requests)).filter(|&n| n > 0),
        }
    }
}

/// The load a worker pushes on its KV event stream, one record per data-parallel rank, folded into
/// one report as `GetLoads`' answer is.
#[derive(Debug, Default)]
pub struct PushedLoads {
    ranks: BTreeMap<i32, RankLoad>,
}

impl PushedLoads {
    /// Takes the record of `rank` (`None`: a worker without ranks). The worker's report comes back
    /// once a record of each of its `ranks` is known (a report of some ranks only would read as a
    /// lighter load than the worker carries).
    pub fn record(&mut self, rank: Option<i32>, load: &common::EngineLoad, ranks: usize) -> Option<EngineLoad> {
        let rank = rank.unwrap_or(0);
        let folded = RankLoad::from_pushed(load, self.ranks.get(&rank));
        self.ranks.insert(rank, folded);
        let all: Vec<RankLoad> = self.ranks.values().copied().collect();
        (all.len() >= ranks.max(1)).then(|| sum_ranks(&all))
    }
}

/// The ranks' loads as one report, summed as SGLang's `/v1/loads` is (`kvgate_protocol::telemetry`).
fn sum_ranks(ranks: &[RankLoad]) -> EngineLoad {
    let sum = |f: fn(&RankLoad) -> Option<u64>| ranks.iter().map(f).sum::<Option<u64>>();
    EngineLoad {
        waiting_requests: ranks.iter().map(|r| r.waiting).sum(),
        running_requests: ranks.iter().map(|r| r.running).sum(),
        waiting_uncached_tokens: sum(|r| r.waiting_uncached_tokens),
        kv_usage: Some((ranks.iter().map(|r| r.token_usage).sum::<f64>() / ranks.len() as f64).clamp(0.0, 1.0)),
        active_tokens: sum(|r| r.used_tokens),
        gen_throughput: Some(ranks.iter().map(|r| r.gen_throughput).sum()),
        kv_capacity_tokens: sum(|r| r.capacity_tokens),
        max_running_requests: sum(|r| r.max_running_requests),
        ..EngineLoad::default()
    }
}

fn to_vllm(g: Generation) -> vllm::GenerateRequest {
    let s = g.sampling;
    vllm::GenerateRequest {
        request_id: g.request_id,
        input: Some(vllm::generate_request::Input::Tokenized(vllm::TokenizedInput {
            original_text: String::new(),
            input_ids: g.input_ids,
        })),
        sampling_params: Some(vllm::SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p.unwrap_or(0.0),
            top_k: s.top_k.and_then(|k| u32::try_from(k).ok()).unwrap_or(0),
            min_p: s.min_p.unwrap_or(0.0),
            frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
            presence_penalty: s.presence_penalty.unwrap_or(0.0),
            repetition_penalty: s.repetition_penalty.unwrap_or(0.0),
            max_tokens: s.max_tokens,
            min_tokens: s.min_tokens,
            stop: s.stop,
            stop_token_ids: s.stop_token_ids,
            skip_special_tokens: s.skip_special_tokens,
            spaces_between_special_tokens: true,
            ignore_eos: s.ignore_eos,
            n: s.n,
            seed: s.seed,
            include_stop_str_in_output: s.include_stop_str_in_output,
            logit_bias: s.logit_bias.iter().filter_map(|&(t, b)| Some((i32::try_from(t).ok()?, b))).collect(),
            // vLLM lists the sampled (or prompt) token first and then the ranked ones; the servicer
            // sends the first `k`, which leaves out the last one a completion shows when that
            // token is not among the best `k`: such a response asks one more (and
            // `SequenceLogprobs` shows what vLLM's server shows of them). Others ask `k`, since
            // `k + 1` may break a tie at the cut the other way from vLLM's own server.
            logprobs: s.logprobs.map(|k| vllm_alternatives(k, s.logprobs_beside_best)),
            prompt_logprobs: s
                .prompt_logprobs_from
                .map(|_| vllm_alternatives(s.logprobs.unwrap_or(0), s.logprobs_beside_best)),
            constraint: s.constraint.map(|c| {
                use vllm::sampling_params::Constraint as C;
                match c {
                    Constraint::JsonSchema(schema) => C::JsonSchema(schema),
                    Constraint::JsonObject => C::JsonObject(true),
                    Constraint::Regex(r) => C::Regex(r),
                    Constraint::Grammar(g) => C::Grammar(g),
                    Constraint::Choice(choices) => C::Choice(vllm::ChoiceConstraint { choices }),
                }
            }),
        }),
        stream: g.stream,
        data_parallel_rank: None,
    }
}

fn to_sglang(g: Generation) -> sglang::GenerateRequest {
    let s = g.sampling;
    // Stop strings are matched in the gateway (below), which can end a sequence early only if
    // its tokens come as they are generated: a whole answer would run on to its length first.
    let stream = g.stream || !s.stop.is_empty();
    sglang::GenerateRequest {
        request_id: g.request_id,
        tokenized: Some(sglang::TokenizedInput { original_text: String::new(), input_ids: g.input_ids }),
        sampling_params: Some(sglang::SamplingParams {
            // proto3 cannot leave it unset: OpenAI's default.
            temperature: s.temperature.unwrap_or(1.0),
            top_p: s.top_p.unwrap_or(0.0),
            top_k: s.top_k.unwrap_or(0),
            min_p: s.min_p.unwrap_or(0.0),
            frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
            presence_penalty: s.presence_penalty.unwrap_or(0.0),
            repetition_penalty: s.repetition_penalty.unwrap_or(0.0),
            max_new_tokens: s.max_tokens,
            // The servicer runs without a tokenizer: stop strings are matched in the gateway.
            stop: Vec::new(),
            stop_token_ids: s.stop_token_ids,
            skip_special_tokens: s.skip_special_tokens,
            spaces_between_special_tokens: true,
            n: s.n,
            min_new_tokens: s.min_tokens,
            ignore_eos: s.ignore_eos,
            no_stop_trim: false,
            logit_bias: s.logit_bias.iter().map(|&(t, b)| (t.to_string(), b)).collect(),
            constraint: s.constraint.and_then(|c| {
                use sglang::sampling_params::Constraint as C;
                match c {
                    Constraint::JsonSchema(schema) => Some(C::JsonSchema(schema)),
                    Constraint::JsonObject => Some(C::JsonSchema(SGLANG_JSON_OBJECT.into())),
                    Constraint::Regex(r) => Some(C::Regex(r)),
                    Constraint::Grammar(g) => Some(C::EbnfGrammar(g)),
                    // Refused before it is sent (`GrpcRuntime::takes`).
                    Constraint::Choice(_) => None,
                }
            }),
            ..Default::default()
        }),
        stream,
        return_logprob: s.logprobs.is_some() || s.prompt_logprobs_from.is_some(),
        top_logprobs_num: s.logprobs.map_or(0, |k| i32::try_from(k).unwrap_or(i32::MAX)),
        // -1 asks for none of the prompt's own log probabilities.
        logprob_start_len: s.prompt_logprobs_from.map_or(-1, |from| i32::try_from(from).unwrap_or(i32::MAX)),
        ..Default::default()
    }
}

/// A worker's `OutputLogProbs` in common terms; `None` when it carries no token.
macro_rules! logprobs_from {
    ($lp:expr) => {
        $lp.filter(|l| !l.token_ids.is_empty()).map(|l| TokenLogprobs {
            token_ids: l.token_ids,
            values: l.token_logprobs,
            top: l.top_logprobs.into_iter().map(|t| t.token_ids.into_iter().zip(t.values).collect()).collect(),
        })
    };
}

/// A worker's `InputLogProbs` in common terms; `None` when it carries no token.
macro_rules! prompt_logprobs_from {
    ($lp:expr) => {
        $lp.filter(|l| !l.token_ids.is_empty()).map(|l| PromptLogprobs {
            token_ids: l.token_ids,
            values: l.token_logprobs.into_iter().map(|v| v.value).collect(),
            top: l.top_logprobs.into_iter().map(|t| t.token_ids.into_iter().zip(t.values).collect()).collect(),
        })
    };
}

/// Alternatives to ask a vLLM worker for when the client asks `k`: one more for a response that
/// shows the token beside the best ones (see `to_vllm`), within vLLM's default `max_logprobs`.
fn vllm_alternatives(k: u32, beside_best: bool) -> i32 {
    let asked = if beside_best { k.saturating_add(1).min(VLLM_MAX_LOGPROBS) } else { k };
    i32::try_from(asked).unwrap_or(i32::MAX)
}

/// vLLM's default `max_logprobs`: a worker refuses a request asking more.
const VLLM_MAX_LOGPROBS: u32 = 20;

/// One Generate message as a [`Piece`]. The two runtimes' messages have the same fields under
/// different generated types, so one macro body serves both instead of two copies.
macro_rules! piece_from {
    ($proto:ident, $m:expr) => {{
        use $proto::generate_complete::MatchedStop as M;
        match $m.response {
            Some($proto::generate_response::Response::Chunk(c)) => Ok(Piece::Chunk {
                index: c.index,
                token_ids: c.token_ids,
                prompt_tokens: c.prompt_tokens,
                cached_tokens: c.cached_tokens,
                logprobs: logprobs_from!(c.output_logprobs),
                prompt_logprobs: prompt_logprobs_from!(c.input_logprobs),
            }),
            Some($proto::generate_response::Response::Complete(c)) => Ok(Piece::Complete {
                index: c.index,
                output_ids: c.output_ids,
                finish_reason: c.finish_reason,
                prompt_tokens: c.prompt_tokens,
                completion_tokens: c.completion_tokens,
                cached_tokens: c.cached_tokens,
                matched_stop: c.matched_stop.map(|s| match s {
                    M::MatchedTokenId(t) => MatchedStop::Token(t),
                    M::MatchedStopStr(s) => MatchedStop::Text(s),
                }),
                logprobs: logprobs_from!(c.output_logprobs),
                prompt_logprobs: prompt_logprobs_from!(c.input_logprobs),
            }),
            None => Err(Status::internal("a Generate message without a chunk or a completion")),
        }
    }};
}

pub(crate) fn from_vllm(m: vllm::GenerateResponse) -> Result<Piece, Status> {
    piece_from!(vllm, m)
}

pub(crate) fn from_sglang(m: sglang::GenerateResponse) -> Result<Piece, Status> {
    piece_from!(sglang, m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_url_is_reached_over_http2_at_its_authority() {
        assert_eq!(channel_uri("grpc://10.0.0.7:50051").unwrap(), "http://10.0.0.7:50051");
        assert_eq!(channel_uri("grpc://h:1/").unwrap(), "http://h:1");
        assert!(channel_uri("grpc://h:1/v1").unwrap_err().contains("without a path"));
        assert!(channel_uri("http://h:1").is_err());
    }

    #[test]
    fn ranks_sum_as_sglangs_loads_do() {
        let rank = |running, waiting, usage| RankLoad {
            running,
            waiting,
            waiting_uncached_tokens: Some(10),
            used_tokens: Some(5),
            capacity_tokens: Some(1000),
            token_usage: usage,
            gen_throughput: 2.0,
            max_running_requests: Some(8),
        };
        let load = sum_ranks(&[rank(1, 2, 0.2), rank(3, 4, 0.4)]);
        assert_eq!((load.running_requests, load.waiting_requests), (4, 6));
        assert_eq!(load.waiting_uncached_tokens, Some(20));
        assert_eq!(load.kv_capacity_tokens, Some(2000));
        assert_eq!(load.max_running_requests, Some(16));
        assert!((load.kv_usage.unwrap() - 0.3).abs() < 1e-9);
    }
}
