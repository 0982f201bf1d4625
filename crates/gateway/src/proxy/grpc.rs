//! The backend for gRPC workers (SMG's worker protocol): the prompt goes as the token ids kvgate
//! routed on, the worker's token ids come back and are detokenized, trimmed at stop strings and
//! shaped into the OpenAI response here, streamed or whole, with the log probabilities the worker
//! sends when they are asked (named as the runtime's own server names tokens, [`super::logprobs`]).
//!
//! A stop string the worker did not match itself (SGLang's servicer runs without a tokenizer) ends
//! the response in the gateway, and the worker is told to abort the rest; so is a client that goes
//! away (its body dropped). Embeddings, from a worker whose model pools, go through `Embed`
//! instead ([`super::embed`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use kvgate_tokenizer::detokenize::SequenceText;
use kvgate_tokenizer::request::Endpoint;
use kvgate_tokenizer::token_names::NameStyle;
use serde_json::Value;
use tonic::Code;

use super::embed::{self, EmbedAsk};
use super::flight::{error_event, Flight, Outcome};
use super::generate::GenerateShape;
use super::logprobs::SequenceLogprobs;
use super::openai::{sse, Finish, Plan, ResponseHead, Usage};
use super::responses::ResponsesShape;
use super::score::ScoreAsk;
use super::{Backend, Outgoing, SendFailure};
use crate::engines;
use crate::error::ApiError;
use crate::grpc_worker::{
    Generation, GrpcRuntime, GrpcWorker, MatchedStop, Piece, PieceStream, PromptLogprobs, TokenLogprobs,
};
use crate::registry::EngineHandle;
use crate::state::AppState;

/// How long an abort may take; it is sent in the background.
const ABORT_TIMEOUT: Duration = Duration::from_secs(5);

/// Generates through the engine's gRPC worker.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct GrpcBackend;

/// A gRPC worker's answer, before any of it reached the client.
pub(super) enum GrpcAnswer {
    /// A started generation.
    Generating(Box<Generating>),
    /// Embeddings, whole: the response body.
    Embedded(Vec<u8>),
}

/// A started generation, before any of it reached the client.
pub(super) struct Generating {
    pieces: PieceStream,
    request_id: String,
    plan: Plan,
    head: ResponseHead,
    /// One per sequence asked for (`n`), by index.
    choices: Vec<Choice>,
    stream: bool,
    prompt_tokens: u64,
    /// Whether a finished sequence ends with the text of characters that never completed (SGLang's
    /// server shows them, replaced; vLLM's does not).
    flush_incomplete: bool,
    /// A Responses request's answer, shaped as that API's object and events.
    responses: Option<ResponsesShape>,
    /// A `/generate` request's answer, shaped as SGLang's server shapes it.
    generate: Option<GenerateShape>,
}

/// One sequence of an answer.
struct Choice {
    text: SequenceText,
    /// Tokens a worker may stop on (special tokens and the request's stop token ids): a chunk's
    /// last token of these is held back (see `held`); any other token is text at once.
    may_stop: Arc<HashSet<u32>>,
    /// The last token received, not yet text: it is one the worker may stop on, and only the next
    /// message says whether it did (the token is then no text) or generated on.
    held: Option<u32>,
    /// How it ended, once it has.
    finish: Option<Finish>,
    /// It ended at a stop string the gateway matched: the worker may still be generating it.
    cut_short: bool,
    /// The tokens' log probabilities, when asked.
    logprobs: Option<SequenceLogprobs>,
    /// Characters of text a stream has sent (completions' logprobs count offsets from there).
    sent_chars: usize,
    /// The prompt, echoed before the text and not yet sent (completions' `echo`).
    echo: Option<String>,
    /// Every token id the worker sent, when the answer shows them (`/generate`'s `output_ids`).
    ids: Option<Vec<u32>>,
}

impl Choice {
    /// Adds a chunk's tokens, holding its last one back when the worker may have stopped on it
    /// (see `held`). A stop string the worker does not match (SGLang's servicer has no tokenizer)
    /// ends the sequence here.
    fn push_chunk(&mut self, ids: &[u32], logprobs: Option<&TokenLogprobs>) -> Result<(), ApiError> {
        if self.finish.is_some() {
            return Ok(()); // already cut at a stop string: the rest is not text
        }
        self.push_logprobs(logprobs)?;
        if let Some(all) = &mut self.ids {
            all.extend_from_slice(ids);
        }
        let Some((&last, rest)) = ids.split_last() else { return Ok(()) };
        let mut run: Vec<u32> = self.held.take().into_iter().collect();
        run.extend_from_slice(rest);
        // Holding every chunk's last token would delay each token's text by a step (the first
        // token's too: a whole step added to the time to first token).
        if self.may_stop.contains(&last) {
            self.held = Some(last);
        } else {
            run.push(last);
        }
        self.text.push(&run, false).map_err(|_| ApiError::Internal)?;
        if self.text.stopped().is_some() {
            self.finish = Some(finish_of(&self.text, "stop", None));
            self.cut_short = true;
        }
        Ok(())
    }

    /// Adds the end: the held token with how the worker stopped, or, when no chunk came (an answer
    /// that did not stream), the whole output.
    fn push_end(&mut self, end: &End<'_>, flush_incomplete: bool) -> Result<(), ApiError> {
        if self.finish.is_some() {
            self.cut_short = false; // the worker is done with it too
            return Ok(());
        }
        let (finish_reason, matched) = (end.finish_reason, end.matched);
        let on_token = stopped_on_token(finish_reason, matched);
        let ids: Vec<u32> = match self.held.take() {
            Some(last) => vec![last],
            None if self.text.tokens() == 0 => {
                // No chunk came: the end carries the whole sequence, its logprobs included.
                self.push_logprobs(end.logprobs)?;
                if let Some(all) = &mut self.ids {
                    all.extend_from_slice(end.output_ids);
                }
                end.output_ids.to_vec()
            }
            None => Vec::new(),
        };
        self.text.push(&ids, on_token).map_err(|_| ApiError::Internal)?;
        if flush_incomplete {
            self.text.flush_incomplete().map_err(|_| ApiError::Internal)?;
        }
        self.finish = Some(finish_of(&self.text, finish_reason, matched));
        Ok(())
    }

    fn push_logprobs(&mut self, logprobs: Option<&TokenLogprobs>) -> Result<(), ApiError> {
        match (&mut self.logprobs, logprobs) {
            (Some(seq), Some(lp)) => seq.push(lp),
            _ => Ok(()),
        }
    }

    /// The `logprobs` of the tokens the text holds that were not shown yet (JSON `null` when
    /// not asked). A stream gives the characters it sent before them.
    fn take_logprobs(&mut self, text_before: Option<usize>) -> Result<Value, ApiError> {
        let kept = self.text.tokens();
        match &mut self.logprobs {
            Some(seq) => seq.take(kept, text_before),
            None => Ok(Value::Null),
        }
    }

    /// The stream's next chunk of this sequence: the text not sent yet (the echoed prompt first),
    /// and with `finish` all the rest and how it ended. `None` while it has nothing to show.
    fn next_chunk(
        &mut self,
        head: &ResponseHead,
        index: u32,
        finish: Option<&Finish>,
    ) -> Result<Option<Value>, ApiError> {
        let mut delta = self.text.take_delta(finish.is_some());
        // The echoed prompt comes with the first output, as vLLM's server sends it.
        if let Some(echo) = self.echo.take() {
            delta.insert_str(0, &echo);
        }
        // Tokens whose text is not out yet still show their logprobs, as vLLM's server shows
        // each step's.
        if finish.is_none() && delta.is_empty() && !self.logprobs_pending() {
            return Ok(None);
        }
        let logprobs = self.take_logprobs(Some(self.sent_chars))?;
        self.sent_chars += delta.chars().count();
        Ok(Some(head.text_chunk(index, &delta, logprobs, finish)))
    }

    /// The ids of the tokens the sequence keeps (none past a stop string the gateway matched).
    fn output_ids(&self) -> &[u32] {
        let all = self.ids.as_deref().unwrap_or_default();
        &all[..self.text.tokens().min(all.len())]
    }

    /// Whether tokens the text holds have logprobs not shown yet.
    fn logprobs_pending(&self) -> bool {
        self.logprobs.as_ref().is_some_and(|seq| seq.pending(self.text.tokens()))
    }
}

/// A worker's end of one sequence.
struct End<'a> {
    output_ids: &'a [u32],
    finish_reason: &'a str,
    matched: Option<&'a MatchedStop>,
    logprobs: Option<&'a TokenLogprobs>,
}

impl Generating {
    /// The choice a piece belongs to; a worker naming one that was not asked for is at fault.
    fn choice(&mut self, index: u32) -> Result<&mut Choice, ApiError> {
        let n = self.choices.len();
        self.choices.get_mut(index as usize).ok_or_else(|| {
            tracing::warn!(index, n, "the gRPC worker answered for a sequence that was not asked for");
            ApiError::UpstreamFailed
        })
    }

    /// The choice a whole (non-streamed) sequence's `Complete` belongs to. SGLang's Python servicer
    /// (0.14.1) numbers every sequence of a whole `n > 1` answer 0: a second end for a choice the
    /// worker already ended is taken as the next choice still open, in order.
    fn whole_sequence_slot(&self, index: u32) -> u32 {
        match self.choices.get(index as usize) {
            Some(c) if c.finish.is_some() && !c.cut_short => {
                self.choices.iter().position(|c| c.finish.is_none()).map_or(index, |i| i as u32)
            }
            _ => index,
        }
    }

    /// Gives the prompt's log probabilities, when a piece brings them, to every sequence that
    /// shows them and has none yet (each of `n` sequences echoes the prompt with its entries).
    fn push_prompt_logprobs(&mut self, lp: Option<&PromptLogprobs>) -> Result<(), ApiError> {
        let Some(lp) = lp else { return Ok(()) };
        let prompt_len = usize::try_from(self.prompt_tokens).unwrap_or(usize::MAX);
        for seq in self.choices.iter_mut().filter_map(|c| c.logprobs.as_mut()) {
            seq.push_prompt(lp, prompt_len)?;
        }
        Ok(())
    }

    fn all_finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Whether the worker may still be generating a sequence the gateway cut at a stop string.
    fn worker_still_busy(&self) -> bool {
        self.choices.iter().any(|c| c.cut_short)
    }

    fn completion_tokens(&self) -> u64 {
        self.choices.iter().map(|c| c.text.tokens() as u64).sum()
    }
}

/// The gRPC status a worker answered with, as the client's error; whether it blames the worker.
fn status_error(status: &tonic::Status) -> (ApiError, bool) {
    match status.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => (
            ApiError::InvalidRequest {
                param: None,
                message: format!("the worker refused the request: {}", status.message()),
            },
            false,
        ),
        Code::DeadlineExceeded => (ApiError::UpstreamTimeout, true),
        Code::Unavailable => (ApiError::UpstreamUnavailable, true),
        _ => (ApiError::UpstreamFailed, true),
    }
}

/// An error while reading a worker's answer, with whether it blames the worker (what it sent did
/// not add up) or the gateway.
fn blame(e: ApiError) -> (ApiError, bool) {
    let blames = matches!(e, ApiError::UpstreamFailed);
    (e, blames)
}

/// Tells the worker to stop a request, without waiting for its answer.
fn abort_in_background(engine: &Arc<EngineHandle>, request_id: String) {
    let engine = engine.clone();
    tokio::spawn(async move {
        if let Some(worker) = &engine.grpc {
            if let Err(status) = worker.abort(&request_id, ABORT_TIMEOUT).await {
                tracing::debug!(engine = %engine.id, request = %request_id, error = %status, "abort failed");
            }
        }
    });
}

/// A whole JSON answer, with kvgate's request id.
fn json_response(body: Vec<u8>, request_id: Option<HeaderValue>) -> Response {
    let mut out = Response::new(Body::from(body));
    out.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(v) = request_id {
        out.headers_mut().insert("x-kvgate-request-id", v);
    }
    out
}

/// A worker's refusal or failure of a call (`Generate`, `Embed`) as the attempt's failure, fed to
/// passive health when it blames the worker. Nothing was produced, so a worker that could not be
/// reached leaves the request to another.
fn worker_failed(state: &AppState, flight: &mut Flight, status: &tonic::Status, call: &str) -> SendFailure {
    let (err, blames) = status_error(status);
    let engine = flight.engine.clone();
    tracing::warn!(engine = %engine.id, request = flight.id.0, code = ?status.code(), message = status.message(), "gRPC {call} failed");
    if !blames {
        return SendFailure::Final(err);
    }
    if status.code() == Code::Unavailable {
        engines::connect_failed(&state.engine_context(), &engine);
        return SendFailure::Retryable(err);
    }
    flight.engine_failed(&err);
    SendFailure::Final(err)
}

/// Rerank or score (`endpoint`) on a worker whose model pools: every text embedded (the worker
/// batches them), each pair scored by the cosine of its vectors, as vLLM's server scores them.
async fn score(
    state: &AppState,
    worker: &GrpcWorker,
    endpoint: Endpoint,
    body: &Value,
    served: &str,
    flight: &mut Flight,
) -> Result<GrpcAnswer, SendFailure> {
    let ask = ScoreAsk::from_request(endpoint, body, served).map_err(SendFailure::Final)?;
    if worker.known_runtime() == Some(GrpcRuntime::Sglang) {
        return Err(SendFailure::Final(ApiError::InvalidRequest {
            param: None,
            message: format!(
                "{} is not served by SGLang gRPC workers: SGLang scores with a cross-encoder or a generating model, \
                 which `Embed` does not carry (vLLM workers score by the cosine of embeddings)",
                endpoint.path()
            ),
        }));
    }
    // Each text on its own with the tokenizer's special tokens, as vLLM embeds a bi-encoder's
    // inputs. (The routing parse counted the pairs as a cross-encoder reads them; these ids are
    // the worker's input, so they are tokenized here, on the tokenizing threads: documents can be
    // long, and the async workers serve every other connection.)
    let tokenizer = state.tokenizer.clone();
    let texts: Vec<String> = ask.texts().map(str::to_owned).collect();
    let tokenized = state
        .tokenize_pool
        .run(move || texts.iter().map(|t| tokenizer.encode_prompt(t, true)).collect::<Result<Vec<_>, _>>())
        .await
        .map_err(|_| SendFailure::Final(ApiError::Internal))?;
    let inputs = tokenized.map_err(|e| {
        SendFailure::Final(ApiError::InvalidRequest { param: None, message: format!("tokenizing failed: {e}") })
    })?;
    let request_id = state.engine_request_id(flight.id);
    let embedded = embed::embed_each(worker, inputs, &request_id, state.config.request_timeout).await;
    let embeddings = embedded.map_err(|status| worker_failed(state, flight, &status, "Embed"))?;
    engines::request_succeeded(&flight.engine);
    let body = ask.shape(&embeddings, &request_id, unix_now()).map_err(SendFailure::Final)?;
    Ok(GrpcAnswer::Embedded(body))
}

/// Unix seconds now, for `created`.
#[allow(clippy::disallowed_methods)] // the response's wall-clock stamp, read at the edge
fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Backend for GrpcBackend {
    type Answer = GrpcAnswer;

    /// Sends the token ids and sampling settings, and waits for the worker to accept the stream.
    async fn send(
        &self,
        state: &AppState,
        request: Outgoing<'_>,
        flight: &mut Flight,
    ) -> Result<GrpcAnswer, SendFailure> {
        let engine = flight.engine.clone();
        let Some(worker) = &engine.grpc else {
            return Err(SendFailure::Final(ApiError::Internal));
        };
        let body: Value = serde_json::from_slice(request.body)
            .map_err(|e| SendFailure::Final(ApiError::InvalidJson(e.to_string())))?;
        let served = engine.models.lock().first().cloned().unwrap_or_default();
        if request.endpoint == Endpoint::Embeddings {
            let ask = EmbedAsk::from_request(&body, &served).map_err(SendFailure::Final)?;
            let request_id = state.engine_request_id(flight.id);
            let embedded = embed::embed_all(worker, request.parsed, &request_id, state.config.request_timeout).await;
            let embeddings = embedded.map_err(|status| worker_failed(state, flight, &status, "Embed"))?;
            engines::request_succeeded(&engine);
            let body = ask.shape(embeddings, worker.known_runtime(), &request_id, unix_now());
            return Ok(GrpcAnswer::Embedded(body));
        }
        if matches!(request.endpoint, Endpoint::Rerank | Endpoint::Score) {
            return score(state, worker, request.endpoint, &body, &served, flight).await;
        }
        let mut plan = Plan::from_request(request.endpoint, &body, &served).map_err(SendFailure::Final)?;
        let prompt = &request.parsed.tokens;
        if plan.sampling.seed.is_some() && worker.known_runtime() == Some(GrpcRuntime::Sglang) {
            // SGLang's worker protocol carries no sampler seed: refused, not dropped.
            return Err(SendFailure::Final(ApiError::invalid(
                "seed",
                "`seed` is not supported by SGLang gRPC workers (their protocol carries no sampler seed)",
            )));
        }
        if matches!(plan.sampling.constraint, Some(crate::grpc_worker::Constraint::Choice(_)))
            && worker.known_runtime() == Some(GrpcRuntime::Sglang)
        {
            return Err(SendFailure::Final(ApiError::invalid(
                "structured_outputs",
                "`structured_outputs.choice` is not supported by SGLang gRPC workers (their protocol has no choice \
                 constraint): use a regex of the alternatives",
            )));
        }
        if plan.max_tokens_from_context {
            // vLLM's default for chat: whatever the context leaves after the prompt.
            // Unknown (the worker has not said): the worker's own default.
            let context = engine.identity.lock().max_context_tokens;
            plan.sampling.max_tokens =
                context.map(|c| u32::try_from(c.saturating_sub(prompt.len() as u64)).unwrap_or(u32::MAX));
        }
        if let Some(echo) = plan.responses.as_mut() {
            echo.set_max_output_tokens(plan.sampling.max_tokens);
            if worker.known_runtime() == Some(GrpcRuntime::Sglang) && !plan.max_tokens_from_context {
                // SGLang's server keeps two of a response's `max_output_tokens` back (headroom it
                // leaves for BOS and EOS): its workers' answers are as long as its server's.
                plan.sampling.max_tokens = plan.sampling.max_tokens.map(|m| m.saturating_sub(2));
            }
        }
        // The prompt as the client wrote it; token ids are decoded (special tokens skipped, as
        // SGLang's server does).
        let echo = if plan.echo { body.get("prompt").and_then(Value::as_str).map(str::to_owned) } else { None };
        let mut choices = Vec::with_capacity(plan.sampling.n as usize);
        let mut may_stop: Option<Arc<HashSet<u32>>> = None;
        // Token names in logprobs follow the runtime's own server (`/generate` is SGLang's).
        let is_generate = plan.endpoint == Endpoint::Generate;
        let generate_logprobs = plan.generate_logprobs;
        let style = if worker.known_runtime() == Some(GrpcRuntime::Sglang) || is_generate {
            NameStyle::Sglang
        } else {
            NameStyle::Vllm
        };
        for _ in 0..plan.sampling.n.max(1) {
            let Some(detokenizer) = state.tokenizer.detokenizer(prompt, plan.sampling.skip_special_tokens) else {
                return Err(SendFailure::Final(ApiError::Internal));
            };
            let logprobs = plan.top_logprobs().map(|top| {
                let mut seq = SequenceLogprobs::new(detokenizer.token_names(style), plan.endpoint, top);
                if let Some(from) = plan.sampling.prompt_logprobs_from {
                    seq = seq.with_prompt_from(from);
                }
                if generate_logprobs.is_some_and(|ask| !ask.with_text) {
                    seq.without_text()
                } else {
                    seq
                }
            });
            let echo = match &echo {
                Some(prompt) => Some(prompt.clone()),
                None if plan.echo => Some(detokenizer.text_of(prompt, true).map_err(|e| {
                    tracing::warn!(error = %e, "the prompt to echo could not be decoded");
                    SendFailure::Final(ApiError::Internal)
                })?),
                None => None,
            };
            let may_stop = may_stop
                .get_or_insert_with(|| {
                    let special = detokenizer.special_ids();
                    if plan.sampling.stop_token_ids.is_empty() {
                        return special.clone(); // the tokenizer's own set, shared
                    }
                    let mut ids = HashSet::clone(special);
                    ids.extend(&plan.sampling.stop_token_ids);
                    Arc::new(ids)
                })
                .clone();
            let text = SequenceText::new(detokenizer, plan.stop.clone());
            choices.push(Choice {
                text,
                may_stop,
                held: None,
                finish: None,
                cut_short: false,
                logprobs,
                sent_chars: 0,
                echo,
                ids: is_generate.then(Vec::new),
            });
        }
        let request_id = state.engine_request_id(flight.id);
        let generation = Generation {
            request_id: request_id.clone(),
            input_ids: prompt.clone(),
            sampling: plan.sampling.clone(),
            stream: request.parsed.stream,
        };
        let pieces = worker
            .generate(generation, state.config.request_timeout)
            .await
            .map_err(|status| worker_failed(state, flight, &status, "Generate"))?;
        engines::request_succeeded(&engine);
        let prefix = if plan.endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        let head = ResponseHead {
            id: format!("{prefix}-{request_id}"),
            created: unix_now(),
            model: plan.model.clone(),
            endpoint: plan.endpoint,
        };
        let sglang = worker.known_runtime() == Some(GrpcRuntime::Sglang);
        let responses = plan.responses.take().map(|echo| {
            // SGLang's server ends a stream cut by the output limit with `response.incomplete`.
            ResponsesShape::new(&request_id, head.created, plan.model.clone(), echo, sglang)
        });
        let generate = is_generate.then(|| {
            let rid = body.get("rid").and_then(Value::as_str).map_or_else(|| request_id.clone(), str::to_owned);
            GenerateShape::new(rid, plan.sampling.max_tokens, plan.sampling.n, generate_logprobs)
        });
        Ok(GrpcAnswer::Generating(Box::new(Generating {
            flush_incomplete: sglang,
            responses,
            generate,
            pieces,
            request_id,
            plan,
            head,
            choices,
            stream: request.parsed.stream,
            prompt_tokens: prompt.len() as u64,
        })))
    }

    /// Detokenizes the worker's pieces into the client's response.
    async fn respond(&self, answer: GrpcAnswer, mut flight: Flight) -> Result<Response, ApiError> {
        let request_id = HeaderValue::from_str(&flight.id.0.to_string()).ok();
        let answer = match answer {
            GrpcAnswer::Generating(answer) => *answer,
            GrpcAnswer::Embedded(body) => {
                flight.first_byte(false);
                flight.outcome = Outcome::Status(StatusCode::OK.as_u16());
                return Ok(json_response(body, request_id));
            }
        };
        if !answer.stream {
            let state = flight.state.clone();
            let worker_request = answer.request_id.clone();
            let collected = tokio::time::timeout(state.config.request_timeout, collect(answer, &mut flight)).await;
            let (status, body) = match collected {
                Ok(Ok(body)) => (StatusCode::OK, body),
                Ok(Err(err)) => return Err(err),
                Err(_) => {
                    flight.engine_failed(&ApiError::UpstreamTimeout);
                    abort_in_background(&flight.engine, worker_request);
                    return Err(ApiError::UpstreamTimeout);
                }
            };
            flight.first_byte(false);
            flight.outcome = Outcome::Status(status.as_u16());
            return Ok(json_response(body.to_string().into_bytes(), request_id));
        }
        let idle = flight.state.config.limits.stream_idle_timeout;
        let stream = Streamer { answer, flight: Some(flight), usage: Usage::default(), started: false, done: false };
        let body = futures_util::stream::unfold(stream, move |mut s| async move {
            let event = s.next_event(idle).await?;
            Some((Ok::<Bytes, std::io::Error>(Bytes::from(event)), s))
        });
        let mut out = Response::new(Body::from_stream(body));
        out.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        out.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        if let Some(v) = request_id {
            out.headers_mut().insert("x-kvgate-request-id", v);
        }
        Ok(out)
    }
}

/// How the worker's `Complete` ends the sequence, unless the gateway's own stop-string match did.
fn finish_of(text: &SequenceText, reason: &str, matched: Option<&MatchedStop>) -> Finish {
    if let Some(stop) = text.stopped() {
        return Finish { reason: "stop".into(), stop_reason: Value::from(stop) };
    }
    let stop_reason = match matched {
        Some(MatchedStop::Text(s)) => Value::from(s.clone()),
        Some(MatchedStop::Token(t)) => Value::from(*t),
        None => Value::Null,
    };
    // vLLM names an end-of-sequence token `stop` with a null stop_reason; so does kvgate.
    Finish { reason: if reason.is_empty() { "stop".into() } else { reason.to_owned() }, stop_reason }
}

/// Whether the worker stopped on a token (EOS or a stop token id), which is then not text.
fn stopped_on_token(reason: &str, matched: Option<&MatchedStop>) -> bool {
    reason == "stop" && !matches!(matched, Some(MatchedStop::Text(_)))
}

/// The whole response of a request that did not stream. On an error the flight's outcome is set
/// (the worker blamed where it failed) and the worker is told to stop what it may still run.
async fn collect(answer: Generating, flight: &mut Flight) -> Result<Value, ApiError> {
    let request_id = answer.request_id.clone();
    let collected = collect_answer(answer, flight).await;
    if let Err((err, blames_worker)) = &collected {
        if *blames_worker {
            flight.engine_failed(err);
        } else {
            flight.outcome = Outcome::Status(err.status().as_u16());
        }
        abort_in_background(&flight.engine, request_id);
    }
    collected.map_err(|(err, _)| err)
}

/// The pieces of an answer that did not stream, read until every sequence has ended; an error says
/// whether it blames the worker.
async fn collect_answer(mut answer: Generating, flight: &mut Flight) -> Result<Value, (ApiError, bool)> {
    let internal = |e: ApiError| (e, false);
    let blamed = |e: ApiError| (e, true);
    let mut usage = Usage { prompt_tokens: answer.prompt_tokens, ..Usage::default() };
    let flush = answer.flush_incomplete;
    while let Some(piece) = answer.pieces.next().await {
        match piece {
            Ok(Piece::Chunk { index, token_ids, cached_tokens, logprobs, prompt_logprobs, .. }) => {
                usage.cached_tokens = u64::from(cached_tokens);
                answer.push_prompt_logprobs(prompt_logprobs.as_ref()).map_err(blame)?;
                answer.choice(index).map_err(blamed)?.push_chunk(&token_ids, logprobs.as_ref()).map_err(blame)?;
            }
            Ok(Piece::Complete {
                index,
                output_ids,
                finish_reason,
                prompt_tokens,
                cached_tokens,
                matched_stop,
                logprobs,
                prompt_logprobs,
                ..
            }) => {
                answer.push_prompt_logprobs(prompt_logprobs.as_ref()).map_err(blame)?;
                let index = answer.whole_sequence_slot(index);
                let choice = answer.choice(index).map_err(blamed)?;
                let end = End {
                    output_ids: &output_ids,
                    finish_reason: &finish_reason,
                    matched: matched_stop.as_ref(),
                    logprobs: logprobs.as_ref(),
                };
                choice.push_end(&end, flush).map_err(blame)?;
                usage.prompt_tokens = u64::from(prompt_tokens).max(usage.prompt_tokens);
                usage.cached_tokens = u64::from(cached_tokens);
            }
            Err(status) => {
                tracing::warn!(engine = %flight.engine.id, request = flight.id.0, error = %status, "gRPC stream failed");
                return Err(status_error(&status));
            }
        }
        if answer.all_finished() {
            if answer.worker_still_busy() {
                // Cut at a stop string the worker does not match: it is told to stop the rest.
                abort_in_background(&flight.engine, answer.request_id.clone());
            }
            usage.completion_tokens = answer.completion_tokens();
            flight.output_tokens = Some(usage.completion_tokens);
            let mut choices: Vec<(String, Value, Finish)> = Vec::with_capacity(answer.choices.len());
            for c in &mut answer.choices {
                let logprobs = c.take_logprobs(None).map_err(internal)?;
                let finish = c.finish.clone().unwrap_or_else(|| finish_of(&c.text, "stop", None));
                let text = format!("{}{}", c.echo.take().unwrap_or_default(), c.text.text());
                choices.push((text, logprobs, finish));
            }
            if let (Some(shape), Some((text, logprobs, finish))) = (&answer.responses, choices.first()) {
                return Ok(shape.body(text, logprobs.clone(), finish, usage));
            }
            if let Some(shape) = answer.generate.as_mut() {
                let mut bodies = Vec::with_capacity(choices.len());
                for (i, ((text, logprobs, finish), c)) in choices.into_iter().zip(&answer.choices).enumerate() {
                    shape.push_logprobs(i, logprobs);
                    let usage = Usage { completion_tokens: c.text.tokens() as u64, ..usage };
                    bodies.push(shape.sequence_body(i, &text, c.output_ids(), &finish, usage));
                }
                return Ok(shape.answer(bodies));
            }
            return Ok(answer.head.body(&choices, usage));
        }
    }
    tracing::warn!(engine = %flight.engine.id, request = flight.id.0, "the gRPC stream ended without a completion");
    Err((ApiError::UpstreamFailed, true))
}

/// A streamed response in progress: the worker's pieces turned into SSE events one at a time. When
/// it is dropped before the end (the client went away), the worker is told to abort.
struct Streamer {
    answer: Generating,
    flight: Option<Flight>,
    usage: Usage,
    started: bool,
    done: bool,
}

impl Drop for Streamer {
    fn drop(&mut self) {
        if !self.done {
            if let Some(flight) = &self.flight {
                abort_in_background(&flight.engine, self.answer.request_id.clone());
            }
        }
    }
}

impl Streamer {
    /// The next SSE text to send; `None` when the stream is over.
    async fn next_event(&mut self, idle: Duration) -> Option<String> {
        if self.done {
            return None;
        }
        let mut out = String::new();
        let flush = self.answer.flush_incomplete;
        loop {
            let piece = match tokio::time::timeout(idle, self.answer.pieces.next()).await {
                Ok(piece) => piece,
                Err(_) => return Some(self.fail(out, ApiError::UpstreamTimeout, true)),
            };
            if !self.started && matches!(piece, Some(Ok(_))) {
                self.started = true;
                self.usage.prompt_tokens = self.answer.prompt_tokens;
                // The assistant's role for every choice with the first output, as vLLM and SGLang
                // send it: after the prefill, so the first byte a client sees is the first token's.
                if self.answer.plan.endpoint == Endpoint::Chat {
                    for index in 0..self.answer.choices.len() as u32 {
                        out.push_str(&sse(&self.answer.head.role_chunk(index)));
                    }
                }
                if let Some(shape) = self.answer.responses.as_mut() {
                    out.push_str(&shape.opening());
                }
            }
            let index = match piece {
                Some(Ok(Piece::Chunk { index, token_ids, cached_tokens, logprobs, prompt_logprobs, .. })) => {
                    self.usage.cached_tokens = u64::from(cached_tokens);
                    if let Some(f) = self.flight.as_mut() {
                        f.first_byte(true);
                    }
                    if let Err(err) = self.answer.push_prompt_logprobs(prompt_logprobs.as_ref()) {
                        return Some(self.fail(out, err, true));
                    }
                    let pushed = match self.answer.choice(index) {
                        Ok(choice) if choice.finish.is_some() => continue, // cut at a stop string already
                        Ok(choice) => choice.push_chunk(&token_ids, logprobs.as_ref()).map_err(blame),
                        Err(e) => Err((e, true)),
                    };
                    if let Err((err, blames)) = pushed {
                        return Some(self.fail(out, err, blames));
                    }
                    index
                }
                Some(Ok(Piece::Complete {
                    index,
                    finish_reason,
                    prompt_tokens,
                    cached_tokens,
                    matched_stop,
                    output_ids,
                    logprobs,
                    prompt_logprobs,
                    ..
                })) => {
                    if let Err(err) = self.answer.push_prompt_logprobs(prompt_logprobs.as_ref()) {
                        return Some(self.fail(out, err, true));
                    }
                    self.usage.prompt_tokens = u64::from(prompt_tokens).max(self.usage.prompt_tokens);
                    self.usage.cached_tokens = u64::from(cached_tokens);
                    let pushed = match self.answer.choice(index) {
                        Ok(choice) if choice.finish.is_some() => {
                            choice.cut_short = false;
                            continue; // its end was sent when the gateway cut it
                        }
                        Ok(choice) => {
                            let end = End {
                                output_ids: &output_ids,
                                finish_reason: &finish_reason,
                                matched: matched_stop.as_ref(),
                                logprobs: logprobs.as_ref(),
                            };
                            choice.push_end(&end, flush).map_err(blame)
                        }
                        Err(e) => Err((e, true)),
                    };
                    if let Err((err, blames)) = pushed {
                        return Some(self.fail(out, err, blames));
                    }
                    index
                }
                Some(Err(status)) => {
                    let (err, blames) = status_error(&status);
                    tracing::warn!(engine = ?self.flight.as_ref().map(|f| f.engine.id.clone()), error = %status, "gRPC stream broke mid-response");
                    return Some(self.fail(out, err, blames));
                }
                None => return Some(self.fail(out, ApiError::UpstreamFailed, true)),
            };
            let answer = &mut self.answer;
            let choice = &mut answer.choices[index as usize];
            let finish = choice.finish.clone();
            let shaped = match (answer.responses.as_mut(), answer.generate.as_mut()) {
                (Some(shape), _) => {
                    // A token's logprobs go with the first delta that shows its text: the API has
                    // no event for a token without text (vLLM's server drops such a step's).
                    let delta = choice.text.take_delta(finish.is_some());
                    let logprobs = if delta.is_empty() { Ok(Value::Null) } else { choice.take_logprobs(None) };
                    logprobs.map(|logprobs| shape.delta(&delta, logprobs))
                }
                (None, Some(shape)) => {
                    let delta = choice.text.take_delta(finish.is_some());
                    let usage = Usage { completion_tokens: choice.text.tokens() as u64, ..self.usage };
                    choice.take_logprobs(None).map(|logprobs| {
                        shape.push_logprobs(index as usize, logprobs);
                        shape
                            .event(index as usize, &delta, choice.output_ids(), finish.as_ref(), usage)
                            .unwrap_or_default()
                    })
                }
                (None, None) => choice
                    .next_chunk(&answer.head, index, finish.as_ref())
                    .map(|c| c.map(|c| sse(&c)).unwrap_or_default()),
            };
            match shaped {
                Ok(events) => out.push_str(&events),
                Err(e) => {
                    let (e, blames) = blame(e);
                    return Some(self.fail(out, e, blames));
                }
            }
            // A sequence that ended sent the rest of its text with how it ended.
            if finish.is_some() && self.answer.all_finished() {
                return Some(self.finish(out));
            }
            // Text, or the roles alone when the first token is not text yet.
            if finish.is_some() || !out.is_empty() {
                return Some(out);
            }
        }
    }

    /// The last events once every sequence has ended: the usage if asked, `[DONE]`. A sequence the
    /// gateway cut at a stop string is stopped on the worker.
    fn finish(&mut self, mut out: String) -> String {
        if self.answer.worker_still_busy() {
            if let Some(f) = &self.flight {
                abort_in_background(&f.engine, self.answer.request_id.clone());
            }
        }
        self.usage.completion_tokens = self.answer.completion_tokens();
        if self.answer.responses.is_some() {
            let first = self.answer.choices.first_mut();
            let finish = first.as_ref().and_then(|c| c.finish.clone());
            let finish = finish.unwrap_or_else(|| Finish { reason: "stop".into(), stop_reason: Value::Null });
            let trailing = match first.map_or(Ok(Value::Null), |c| c.take_logprobs(None)) {
                Ok(trailing) => trailing,
                Err(e) => return self.fail(out, e, false),
            };
            if let Some(shape) = self.answer.responses.as_mut() {
                // A Responses stream ends with its final response, without `[DONE]` (as vLLM's).
                out.push_str(&shape.closing(&finish, self.usage, trailing));
            }
        } else if self.answer.generate.is_some() {
            // The last event carried how it ended; SGLang's server ends the stream so.
            out.push_str("data: [DONE]\n\n");
        } else {
            if self.answer.plan.include_usage {
                out.push_str(&sse(&self.answer.head.usage_chunk(self.usage)));
            }
            out.push_str("data: [DONE]\n\n");
        }
        if let Some(mut f) = self.flight.take() {
            f.first_byte(true);
            f.output_tokens = Some(self.usage.completion_tokens);
            f.outcome = Outcome::Status(200);
        }
        self.done = true;
        out
    }

    /// An error event that ends the stream.
    fn fail(&mut self, out: String, err: ApiError, blames_worker: bool) -> String {
        if let Some(mut f) = self.flight.take() {
            if blames_worker {
                f.engine_failed(&err);
            } else {
                f.outcome = Outcome::Status(err.status().as_u16());
            }
            abort_in_background(&f.engine, self.answer.request_id.clone());
        }
        self.done = true;
        if let Some(shape) = self.answer.responses.as_mut() {
            // Every event out so far is whole: the error event follows as the API names it.
            return format!("{out}{}", shape.error(&err));
        }
        let tail = out.as_bytes()[out.len().saturating_sub(2)..].to_vec();
        format!("{out}{}", error_event(&tail, &err))
    }
}
