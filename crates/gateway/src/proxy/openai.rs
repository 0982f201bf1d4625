//! The OpenAI side of a worker that speaks token ids (a gRPC worker): what a chat or completions
//! request asks of the sampler, and the response bodies and SSE chunks built from the detokenized
//! output, in the shapes vLLM's own server sends.

use serde_json::{json, Map, Value};

use kvgate_tokenizer::detokenize::StopRule;
use kvgate_tokenizer::request::Endpoint;

use super::generate;
use super::responses::{self, ResponsesEcho};
use crate::error::ApiError;
use crate::grpc_worker::{Constraint, Sampling};

/// Sampling fields every generating endpoint takes under the same names (chat, completions, and
/// vLLM's extras on the Responses API).
pub(super) const SAMPLING_FIELDS: &[&str] = &[
    "model",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "structured_outputs",
];

/// Bookkeeping that changes nothing the worker generates (vLLM's own server ignores it too).
pub(super) const BOOKKEEPING_FIELDS: &[&str] =
    &["user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "cache_salt"];

/// Chat and completions fields beyond [`SAMPLING_FIELDS`] and [`BOOKKEEPING_FIELDS`]. A field in
/// none of the lists is refused with a 400 that names it, never dropped: the worker would not
/// honour it.
const ACCEPTED: &[&str] = &[
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "min_tokens",
    "logprobs",
    "echo",
    "response_format",
];

/// The most alternatives a request may ask for at each position (vLLM's default `max_logprobs`).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// The most sequences one request may ask for: each is a sequence in the worker's batch.
pub const MAX_N: u32 = 128;

/// Chat-only fields, all consumed when the prompt is rendered.
const CHAT_ONLY: &[&str] = &[
    "messages",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
];

/// Completions-only fields.
const COMPLETIONS_ONLY: &[&str] = &["prompt", "add_special_tokens"];

/// What a request asks of the worker and of the response.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Chat or completions.
    pub endpoint: Endpoint,
    /// The model name the response carries.
    pub model: String,
    /// Sampling settings for the worker.
    pub sampling: Sampling,
    /// Stop strings, matched in the gateway.
    pub stop: StopRule,
    /// Whether the client wants a usage chunk at the end of a stream.
    pub include_usage: bool,
    /// Whether `max_tokens` was left to the context length (chat without a limit).
    pub max_tokens_from_context: bool,
    /// Completions' `echo`: each choice's text starts with the prompt.
    pub echo: bool,
    /// A Responses request's own settings, repeated in its response object (`None` for chat and
    /// completions).
    pub responses: Option<ResponsesEcho>,
    /// What a `/generate` request asks of log probabilities (`None` for other routes, or when it
    /// asks none).
    pub generate_logprobs: Option<generate::LogprobAsk>,
}

impl Plan {
    /// Alternatives per token the response shows, when logprobs were asked.
    pub fn top_logprobs(&self) -> Option<u32> {
        self.sampling.logprobs
    }
}

fn number(body: &Value, key: &str) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| ApiError::invalid(key, format!("`{key}` must be a number"))),
    }
}

fn integer(body: &Value, key: &str) -> Result<Option<i64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| ApiError::invalid(key, format!("`{key}` must be an integer"))),
    }
}

fn flag(body: &Value, key: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
    }
}

/// OpenAI's `logit_bias`: token ids (as strings) to a bias, clamped to ±100 as vLLM's server
/// clamps it.
fn logit_bias(body: &Value) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |why: &str| ApiError::invalid("logit_bias", format!("`logit_bias` {why}"));
    let entries = match body.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("must be an object of token ids to numbers")),
    };
    let mut out = Vec::with_capacity(entries.len());
    for (token, bias) in entries {
        let token: u32 = token.parse().map_err(|_| bad(&format!("has {token:?}, which is not a token id")))?;
        let bias = bias.as_f64().ok_or_else(|| bad(&format!("gives token {token} a bias that is not a number")))?;
        out.push((token, bias.clamp(-100.0, 100.0) as f32));
    }
    Ok(out)
}

/// What the output must match: OpenAI's `response_format` (`json_object`, `json_schema`) or vLLM's
/// `structured_outputs` (`json`, `json_object`, `regex`, `grammar`, `choice`), mapped as vLLM's
/// server maps them.
fn constraint(body: &Value) -> Result<Option<Constraint>, ApiError> {
    let given = |key: &str| body.get(key).filter(|v| !v.is_null());
    match (given("response_format"), given("structured_outputs")) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid("structured_outputs", "give `response_format` or `structured_outputs`, not both"))
        }
        (Some(format), None) => response_format(format),
        (None, Some(outputs)) => structured_outputs(outputs),
        (None, None) => Ok(None),
    }
}

fn response_format(format: &Value) -> Result<Option<Constraint>, ApiError> {
    let bad = |why: String| ApiError::invalid("response_format", format!("`response_format` {why}"));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let schema =
                format.get("json_schema").and_then(|j| j.get("schema")).filter(|s| s.is_object()).ok_or_else(|| {
                    bad("of type json_schema needs `json_schema.schema`, a JSON schema object".into())
                })?;
            Ok(Some(Constraint::JsonSchema(schema.to_string())))
        }
        Some("structural_tag") => Err(unsupported("response_format", "of type structural_tag")),
        Some(other) => Err(bad(format!("has type {other:?}; text, json_object or json_schema"))),
        None => Err(bad("needs a `type`".into())),
    }
}

fn structured_outputs(outputs: &Value) -> Result<Option<Constraint>, ApiError> {
    let bad = |why: &str| ApiError::invalid("structured_outputs", format!("`structured_outputs` {why}"));
    let Some(fields) = outputs.as_object() else { return Err(bad("must be an object")) };
    let mut found = Vec::new();
    for (key, v) in fields.iter().filter(|(_, v)| !v.is_null()) {
        let c = match (key.as_str(), v) {
            ("json", Value::String(schema)) => Constraint::JsonSchema(schema.clone()),
            ("json", schema @ Value::Object(_)) => Constraint::JsonSchema(schema.to_string()),
            ("json_object", Value::Bool(true)) => Constraint::JsonObject,
            ("json_object", Value::Bool(false)) => continue,
            ("regex", Value::String(r)) => Constraint::Regex(r.clone()),
            ("grammar", Value::String(g)) => Constraint::Grammar(g.clone()),
            ("choice", Value::Array(items)) => Constraint::Choice(
                items
                    .iter()
                    .map(|i| i.as_str().map(str::to_owned))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("`choice` must be an array of strings"))?,
            ),
            ("json" | "json_object" | "regex" | "grammar" | "choice", _) => {
                return Err(bad(&format!("`{key}` has the wrong type")));
            }
            (other, _) => return Err(unsupported(&format!("structured_outputs.{other}"), "")),
        };
        found.push(c);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(bad("may give only one of json, json_object, regex, grammar and choice")),
    }
}

/// How many alternatives per output token the request asks log probabilities for (`None`: no
/// logprobs): chat's `logprobs` and `top_logprobs`, completions' `logprobs`, the Responses API's
/// `include` and `top_logprobs`, checked as vLLM's server checks them.
fn logprobs(endpoint: Endpoint, body: &Value) -> Result<Option<u32>, ApiError> {
    let within = |key: &str, k: i64| {
        u32::try_from(k).ok().filter(|&k| i64::from(k) <= MAX_TOP_LOGPROBS).ok_or_else(|| {
            ApiError::invalid(key, format!("`{key}` must be from 0 to {MAX_TOP_LOGPROBS} with gRPC workers"))
        })
    };
    match endpoint {
        Endpoint::Chat => {
            let asked = flag(body, "logprobs", false)?;
            let top = integer(body, "top_logprobs")?;
            match (asked, top) {
                (false, Some(k)) if k != 0 => {
                    Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`".to_owned()))
                }
                (false, _) => Ok(None),
                (true, top) => within("top_logprobs", top.unwrap_or(0)).map(Some),
            }
        }
        // `top_logprobs` alone asks for nothing (vLLM's server reads it only with the `include`).
        Endpoint::Responses if !responses::wants_logprobs(body) => Ok(None),
        Endpoint::Responses => within("top_logprobs", integer(body, "top_logprobs")?.unwrap_or(0)).map(Some),
        _ => integer(body, "logprobs")?.map(|k| within("logprobs", k)).transpose(),
    }
}

fn unsupported(key: &str, why: &str) -> ApiError {
    ApiError::invalid(key, format!("`{key}` {why} is not supported with gRPC workers yet"))
}

/// Whether a gRPC worker serves `endpoint`: the generating routes on a worker whose model
/// generates (or has not said yet); embeddings, rerank and score on one whose model pools
/// (`Embed`; rerank and score on vLLM workers only, checked when the worker is known).
pub fn grpc_serves(endpoint: Endpoint, generates: Option<bool>) -> bool {
    match endpoint {
        Endpoint::Chat | Endpoint::Completions | Endpoint::Responses | Endpoint::Generate => generates != Some(false),
        Endpoint::Embeddings | Endpoint::Rerank | Endpoint::Score => generates == Some(false),
    }
}

/// The answer to a request for `endpoint` when no worker of an all-gRPC fleet serves it.
pub fn grpc_unserved(endpoint: Endpoint) -> ApiError {
    let message = match endpoint {
        Endpoint::Embeddings => "/v1/embeddings needs a worker whose model pools: every gRPC worker here serves a \
                                 generating model (or has not said what it serves yet)"
            .to_owned(),
        Endpoint::Rerank | Endpoint::Score => format!(
            "{} needs a vLLM worker whose model pools (it scores by the cosine of embeddings): every gRPC worker \
             here serves a generating model (or has not said what it serves yet)",
            endpoint.path()
        ),
        _ => format!(
            "{} needs a worker whose model generates: every gRPC worker here serves an embedding model",
            endpoint.path()
        ),
    };
    ApiError::InvalidRequest { param: None, message }
}

impl Plan {
    /// Reads what `body` asks for. `model` names the response's model when the request does not.
    pub fn from_request(endpoint: Endpoint, body: &Value, model: &str) -> Result<Plan, ApiError> {
        if !grpc_serves(endpoint, None) {
            return Err(grpc_unserved(endpoint));
        }
        if endpoint == Endpoint::Generate {
            // SGLang's own request, read under its names, asks what this completions body asks.
            let asked = generate::LogprobAsk::from_request(body)?;
            let mut plan = Plan::from_request(Endpoint::Completions, &generate::as_completions(body, asked)?, model)?;
            plan.endpoint = Endpoint::Generate;
            plan.generate_logprobs = asked;
            plan.sampling.prompt_logprobs_from = asked.and_then(|ask| ask.prompt_from);
            // `/generate` shows the best alternatives alone.
            plan.sampling.logprobs_beside_best = false;
            return Ok(plan);
        }
        let Some(fields) = body.as_object() else {
            return Err(ApiError::InvalidRequest {
                param: None,
                message: "the request body must be a JSON object".into(),
            });
        };
        let is_responses = endpoint == Endpoint::Responses;
        if is_responses {
            responses::check(body)?;
        } else {
            let own: &[&str] = if endpoint == Endpoint::Chat { CHAT_ONLY } else { COMPLETIONS_ONLY };
            let known = |k: &str| [SAMPLING_FIELDS, BOOKKEEPING_FIELDS, ACCEPTED, own].iter().any(|l| l.contains(&k));
            if let Some(key) = fields.keys().find(|k| !known(k)) {
                return Err(unsupported(key, ""));
            }
        }
        if body.get("tools").is_some_and(|t| !t.is_null())
            && body.get("tool_choice").and_then(Value::as_str) != Some("none")
        {
            // As vLLM's server answers without a tool-call parser (measured on vLLM 0.32: "auto",
            // the default with `tools`, "required" and a named function are each a 400); tool
            // calls are parsed in the gateway in a later step.
            let choice = match body.get("tool_choice") {
                None | Some(Value::Null) => "\"auto\" (the default with `tools`)".to_owned(),
                Some(Value::String(c)) => format!("{c:?}"),
                Some(named) => format!("function {}", named.pointer("/function/name").unwrap_or(&Value::Null)),
            };
            return Err(ApiError::invalid(
                "tool_choice",
                format!(
                    "`tool_choice` {choice} needs a tool-call parser, which kvgate does not run for gRPC workers yet \
                     (as vLLM's server without --tool-call-parser): `tool_choice: \"none\"` renders the tools and \
                     answers with text"
                ),
            ));
        }
        let logprobs = logprobs(endpoint, body)?;
        let echo = flag(body, "echo", false)?;
        if echo && endpoint == Endpoint::Chat {
            return Err(unsupported("echo", "in chat completions"));
        }
        let n = integer(body, "n")?.unwrap_or(1);
        let n = u32::try_from(n)
            .ok()
            .filter(|n| (1..=MAX_N).contains(n))
            .ok_or_else(|| ApiError::invalid("n", format!("`n` must be from 1 to {MAX_N}")))?;
        let stop = match body.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or an array of strings"))?,
            Some(_) => return Err(ApiError::invalid("stop", "`stop` must be a string or an array of strings")),
        };
        let stop_token_ids = match body.get("stop_token_ids") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => kvgate_tokenizer::request::token_ids(v, "stop_token_ids")
                .map_err(|e| ApiError::invalid("stop_token_ids", e.message))?,
        };
        let max_tokens = match endpoint {
            Endpoint::Chat => integer(body, "max_completion_tokens")?.or(integer(body, "max_tokens")?),
            Endpoint::Responses => integer(body, "max_output_tokens")?,
            // OpenAI's and vLLM's default for completions.
            _ => Some(integer(body, "max_tokens")?.unwrap_or(16)),
        };
        let max_tokens = max_tokens
            .map(|m| {
                let key = if is_responses { "max_output_tokens" } else { "max_tokens" };
                u32::try_from(m).map_err(|_| ApiError::invalid(key, format!("`{key}` must be from 0 to 2^32-1")))
            })
            .transpose()?;
        let min_tokens = integer(body, "min_tokens")?.unwrap_or(0);
        let min_tokens = u32::try_from(min_tokens)
            .map_err(|_| ApiError::invalid("min_tokens", "`min_tokens` must be a non-negative integer"))?;
        let seed = integer(body, "seed")?
            .map(|s| i32::try_from(s).map_err(|_| ApiError::invalid("seed", "`seed` must fit in 32 bits")))
            .transpose()?;
        let top_k = integer(body, "top_k")?
            .map(|k| i32::try_from(k).map_err(|_| ApiError::invalid("top_k", "`top_k` must fit in 32 bits")))
            .transpose()?;
        let logit_bias = logit_bias(body)?;
        let constraint =
            if is_responses { responses::constraint(body, structured_outputs)? } else { constraint(body)? };
        let f = |key| number(body, key).map(|v| v.map(|x| x as f32));
        let include_stop = flag(body, "include_stop_str_in_output", false)?;
        let sampling = Sampling {
            temperature: f("temperature")?,
            top_p: f("top_p")?,
            top_k,
            min_p: f("min_p")?,
            frequency_penalty: f("frequency_penalty")?,
            presence_penalty: f("presence_penalty")?,
            repetition_penalty: f("repetition_penalty")?,
            max_tokens,
            min_tokens,
            stop_token_ids,
            stop: stop.clone(),
            include_stop_str_in_output: include_stop,
            skip_special_tokens: flag(body, "skip_special_tokens", true)?,
            ignore_eos: flag(body, "ignore_eos", false)?,
            n,
            seed,
            logit_bias,
            constraint,
            logprobs,
            // Echoed with its logprobs, the prompt shows its own, as vLLM's server shows them.
            prompt_logprobs_from: (echo && logprobs.is_some()).then_some(0),
            logprobs_beside_best: endpoint == Endpoint::Completions,
        };
        let include_usage =
            body.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
        Ok(Plan {
            endpoint,
            model: body.get("model").and_then(Value::as_str).unwrap_or(model).to_owned(),
            max_tokens_from_context: max_tokens.is_none(),
            echo,
            responses: is_responses.then(|| {
                let mut echo = ResponsesEcho::from_request(body);
                echo.set_top_logprobs(logprobs);
                echo
            }),
            generate_logprobs: None,
            sampling,
            stop: StopRule { stop, include_stop_str_in_output: include_stop, min_tokens: min_tokens as usize },
            include_usage,
        })
    }
}

/// How a finished sequence ended, as OpenAI names it, and what `stop_reason` vLLM adds.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// `stop`, `length` or `abort`.
    pub reason: String,
    /// The stop string or token id that ended it.
    pub stop_reason: Value,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Prompt tokens the worker served from its prefix cache.
    pub cached_tokens: u64,
}

impl Usage {
    fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// The identity every chunk and body of one response carries.
#[derive(Debug, Clone)]
pub struct ResponseHead {
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// Chat or completions.
    pub endpoint: Endpoint,
}

impl ResponseHead {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
            _ => "text_completion",
        }
    }

    fn with(&self, chunk: bool, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), Value::from(self.id.clone()));
        m.insert("object".into(), Value::from(self.object(chunk)));
        m.insert("created".into(), Value::from(self.created));
        m.insert("model".into(), Value::from(self.model.clone()));
        m.insert("choices".into(), choices);
        m
    }

    /// The first chunk of a chat stream for choice `index`: the assistant's role.
    pub fn role_chunk(&self, index: u32) -> Value {
        Value::Object(self.with(
            true,
            json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        ))
    }

    /// A chunk of new text of choice `index` with its tokens' `logprobs` (JSON `null` when not
    /// asked), and, on its last one, how the sequence ended.
    pub fn text_chunk(&self, index: u32, text: &str, logprobs: Value, finish: Option<&Finish>) -> Value {
        let (finish_reason, stop_reason) = match finish {
            Some(f) => (Value::from(f.reason.clone()), f.stop_reason.clone()),
            None => (Value::Null, Value::Null),
        };
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = if text.is_empty() && finish.is_some() { json!({}) } else { json!({"content": text}) };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason})
            }
            _ => {
                json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason})
            }
        };
        Value::Object(self.with(true, json!([choice])))
    }

    /// The usage chunk that ends a stream when `stream_options.include_usage` asks for it.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut m = self.with(true, json!([]));
        m.insert("usage".into(), usage.to_json());
        Value::Object(m)
    }

    /// The whole response of a request that did not stream: each choice's text, its tokens'
    /// `logprobs` (JSON `null` when not asked) and how it ended, in index order.
    pub fn body(&self, choices: &[(String, Value, Finish)], usage: Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, (text, logprobs, finish))| match self.endpoint {
                Endpoint::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": logprobs,
                    "finish_reason": finish.reason,
                    "stop_reason": finish.stop_reason,
                }),
                _ => json!({
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish.reason,
                    "stop_reason": finish.stop_reason,
                }),
            })
            .collect();
        let mut m = self.with(false, Value::Array(choices));
        m.insert("usage".into(), usage.to_json());
        Value::Object(m)
    }
}

/// One SSE event.
pub fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_fields_are_read_and_defaults_follow_openai() {
        let body = json!({"model": "m", "prompt": "hi", "temperature": 0, "top_k": 5, "stop": "\n", "seed": 7,
                          "stream_options": {"include_usage": true}});
        let plan = Plan::from_request(Endpoint::Completions, &body, "served").unwrap();
        assert_eq!(plan.sampling.temperature, Some(0.0));
        assert_eq!(plan.sampling.top_k, Some(5));
        assert_eq!(plan.sampling.max_tokens, Some(16), "completions default to 16 tokens, as OpenAI and vLLM do");
        assert_eq!(plan.stop.stop, vec!["\n".to_owned()]);
        assert_eq!(plan.sampling.seed, Some(7));
        assert!(plan.include_usage);
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9});
        let plan = Plan::from_request(Endpoint::Chat, &chat, "served").unwrap();
        assert_eq!((plan.sampling.max_tokens, plan.model.as_str()), (Some(9), "served"));
        let open = Plan::from_request(Endpoint::Chat, &json!({"messages": []}), "m").unwrap();
        assert!(open.max_tokens_from_context);
    }

    #[test]
    fn what_a_worker_cannot_honour_is_refused_by_name() {
        let err = |endpoint, body: Value| Plan::from_request(endpoint, &body, "m").unwrap_err().to_string();
        assert!(err(Endpoint::Chat, json!({"messages": [], "logit_bias": {"x": 2}})).contains("not a token id"));
        assert!(err(Endpoint::Chat, json!({"messages": [], "logit_bias": {"1": "a"}})).contains("`logit_bias`"));
        let biased = json!({"messages": [], "logit_bias": {"7": 500, "9": -1.5}});
        let plan = Plan::from_request(Endpoint::Chat, &biased, "m").unwrap();
        assert_eq!(plan.sampling.logit_bias, vec![(7, 100.0), (9, -1.5)], "clamped to ±100 as vLLM does");
        assert!(err(Endpoint::Chat, json!({"messages": [], "response_format": {}})).contains("`response_format`"));
        let structural = json!({"messages": [], "response_format": {"type": "structural_tag"}});
        assert!(err(Endpoint::Chat, structural).contains("structural_tag"));
        let two = json!({"messages": [], "structured_outputs": {"regex": "a", "choice": ["b"]}});
        assert!(err(Endpoint::Chat, two).contains("only one"));
        let unknown = json!({"messages": [], "structured_outputs": {"whitespace_pattern": " "}});
        assert!(err(Endpoint::Chat, unknown).contains("structured_outputs.whitespace_pattern"));
        assert!(err(Endpoint::Chat, json!({"messages": [], "n": 0})).contains("`n` must be from 1"));
        assert!(err(Endpoint::Chat, json!({"messages": [], "n": 129})).contains("`n` must be from 1"));
        assert_eq!(Plan::from_request(Endpoint::Chat, &json!({"messages": [], "n": 3}), "m").unwrap().sampling.n, 3);
        // Bookkeeping fields change nothing the worker generates: taken, not refused.
        let benign = json!({"messages": [], "metadata": {"a": "b"}, "store": false, "service_tier": "auto"});
        assert!(Plan::from_request(Endpoint::Chat, &benign, "m").is_ok());
        assert!(
            err(Endpoint::Completions, json!({"prompt": "x", "logprobs": 21})).contains("`logprobs` must be from 0")
        );
        assert!(err(Endpoint::Completions, json!({"prompt": "x", "logprobs": -1})).contains("`logprobs`"));
        assert!(err(Endpoint::Chat, json!({"messages": [], "top_logprobs": 2})).contains("needs `logprobs: true`"));
        assert!(err(Endpoint::Completions, json!({"prompt": "x", "top_logprobs": 2})).contains("`top_logprobs`"));
        let echoed =
            Plan::from_request(Endpoint::Completions, &json!({"prompt": "x", "echo": true, "logprobs": 1}), "m");
        assert_eq!(echoed.unwrap().sampling.prompt_logprobs_from, Some(0), "the prompt's own logprobs are asked");
        let bare = Plan::from_request(Endpoint::Completions, &json!({"prompt": "x", "logprobs": 1}), "m");
        assert_eq!(bare.unwrap().sampling.prompt_logprobs_from, None);
        assert!(err(Endpoint::Chat, json!({"messages": [], "echo": true})).contains("`echo`"));
        assert!(Plan::from_request(Endpoint::Completions, &json!({"prompt": "x", "echo": true}), "m").unwrap().echo);
        assert!(err(Endpoint::Completions, json!({"prompt": "x", "messages": []})).contains("`messages`"));
        assert!(err(Endpoint::Chat, json!({"messages": [], "tools": [{}]})).contains("\"auto\" (the default"));
        let named =
            json!({"messages": [], "tools": [{}], "tool_choice": {"type": "function", "function": {"name": "f"}}});
        assert!(err(Endpoint::Chat, named).contains("function \"f\" needs a tool-call parser"));
        assert!(err(Endpoint::Chat, json!({"messages": [], "tools": [{}], "tool_choice": "required"}))
            .contains("\"required\""));
        assert!(err(Endpoint::Embeddings, json!({"input": "x"})).contains("/v1/embeddings"));
        assert!(Plan::from_request(
            Endpoint::Chat,
            &json!({"messages": [], "tools": [{}], "tool_choice": "none"}),
            "m"
        )
        .is_ok());
    }

    #[test]
    fn logprobs_are_asked_as_vllms_server_reads_them() {
        let top = |endpoint, body: Value| Plan::from_request(endpoint, &body, "m").unwrap().top_logprobs();
        assert_eq!(top(Endpoint::Chat, json!({"messages": []})), None);
        assert_eq!(top(Endpoint::Chat, json!({"messages": [], "logprobs": true})), Some(0));
        assert_eq!(top(Endpoint::Chat, json!({"messages": [], "logprobs": true, "top_logprobs": 3})), Some(3));
        assert_eq!(top(Endpoint::Chat, json!({"messages": [], "logprobs": false, "top_logprobs": 0})), None);
        assert_eq!(top(Endpoint::Completions, json!({"prompt": "x", "logprobs": 0})), Some(0));
        assert_eq!(top(Endpoint::Completions, json!({"prompt": "x", "logprobs": 5})), Some(5));
        assert_eq!(top(Endpoint::Completions, json!({"prompt": "x", "logprobs": null})), None);
        let asked = json!(["message.output_text.logprobs"]);
        assert_eq!(top(Endpoint::Responses, json!({"input": "x", "top_logprobs": 3})), None, "no `include`");
        assert_eq!(top(Endpoint::Responses, json!({"input": "x", "include": asked})), Some(0));
        assert_eq!(top(Endpoint::Responses, json!({"input": "x", "include": asked, "top_logprobs": 4})), Some(4));
        let too_many =
            Plan::from_request(Endpoint::Responses, &json!({"input": "x", "include": asked, "top_logprobs": 21}), "m");
        assert!(too_many.unwrap_err().to_string().contains("`top_logprobs`"));
        let echo = |body: Value| Plan::from_request(Endpoint::Responses, &body, "m").unwrap().responses.unwrap();
        let shown = |body: Value| {
            let shape = super::super::responses::ResponsesShape::new("k", 0, "m".into(), echo(body), false);
            let finish = Finish { reason: "stop".into(), stop_reason: Value::Null };
            shape.body("", Value::Null, &finish, Usage::default())["top_logprobs"].clone()
        };
        assert_eq!(shown(json!({"input": "x", "top_logprobs": 3})), Value::Null, "as vLLM's server echoes it");
        assert_eq!(shown(json!({"input": "x", "include": asked, "top_logprobs": 3})), json!(3));
    }

    #[test]
    fn structured_outputs_are_mapped_as_vllms_server_maps_them() {
        let plan = |body: Value| Plan::from_request(Endpoint::Chat, &body, "m").unwrap().sampling.constraint;
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
        assert_eq!(
            plan(json!({"messages": [], "response_format": format})),
            Some(Constraint::JsonSchema(schema.to_string()))
        );
        assert_eq!(
            plan(json!({"messages": [], "response_format": {"type": "json_object"}})),
            Some(Constraint::JsonObject)
        );
        assert_eq!(plan(json!({"messages": [], "response_format": {"type": "text"}})), None);
        assert_eq!(
            plan(json!({"messages": [], "structured_outputs": {"regex": "[0-9]+"}})),
            Some(Constraint::Regex("[0-9]+".into()))
        );
        assert_eq!(
            plan(json!({"messages": [], "structured_outputs": {"choice": ["yes", "no"]}})),
            Some(Constraint::Choice(vec!["yes".into(), "no".into()]))
        );
    }

    #[test]
    fn chunks_and_bodies_have_vllms_shapes() {
        let head = ResponseHead { id: "chatcmpl-1".into(), created: 5, model: "m".into(), endpoint: Endpoint::Chat };
        assert_eq!(head.role_chunk(1)["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(head.role_chunk(1)["choices"][0]["index"], 1);
        let stop = Finish { reason: "stop".into(), stop_reason: Value::from("\n") };
        let last = head.text_chunk(0, "", Value::Null, Some(&stop));
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(last["choices"][0]["delta"], json!({}));
        let usage = Usage { prompt_tokens: 3, completion_tokens: 4, cached_tokens: 2 };
        let body = head.body(&[("hello".into(), Value::Null, stop.clone()), ("bye".into(), Value::Null, stop)], usage);
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["choices"][0]["message"]["content"], "hello");
        assert_eq!(
            (body["choices"][1]["index"].as_u64(), body["choices"][1]["message"]["content"].as_str()),
            (Some(1), Some("bye"))
        );
        assert_eq!(body["usage"]["total_tokens"], 7);
        assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
        assert_eq!(sse(&head.usage_chunk(usage)).lines().next().unwrap().get(..6), Some("data: "));
    }
}
