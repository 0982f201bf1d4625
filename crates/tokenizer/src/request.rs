//! What an inference request asks for: its prompt as token ids, the tokens it may generate, whether
//! it streams. The gateway (to route) and the mock engine (to serve) read requests with this one
//! parser, so both agree on every body shape the engines accept. The body itself is forwarded
//! unchanged; this only reads it.

use serde_json::Value;

use crate::routed::{PromptIds, RoutingProbe, Untokenized, Whole};
use crate::{PromptTokenizer, TokenizeError};

mod pooling;
mod responses;

/// A request body that is not a valid request, naming the field at fault where there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// The offending field (`messages[2]`, `prompt`, ...), if one is at fault.
    pub param: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl RequestError {
    /// An invalid field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        RequestError { param: Some(param.to_owned()), message: message.into() }
    }

    pub(crate) fn whole(message: impl Into<String>) -> Self {
        RequestError { param: None, message: message.into() }
    }
}

/// Most tokens a request may ask to generate.
pub const MAX_OUTPUT_TOKENS: u64 = 10_000_000;

/// The inference routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// SGLang's `POST /generate`.
    Generate,
    /// OpenAI's Responses API, `POST /v1/responses`.
    Responses,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/rerank` (vLLM and SGLang; Cohere/Jina shape).
    Rerank,
    /// SGLang's `POST /v1/score`.
    Score,
}

impl Endpoint {
    /// Every inference route.
    pub const ALL: [Endpoint; 7] = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Generate,
        Endpoint::Responses,
        Endpoint::Embeddings,
        Endpoint::Rerank,
        Endpoint::Score,
    ];

    /// The path on the gateway and on the engine.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Generate => "/generate",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Rerank => "/v1/rerank",
            Endpoint::Score => "/v1/score",
        }
    }

    /// Other paths vLLM's server answers this route at, which the gateway answers too (the
    /// engine is always sent [`Self::path`]).
    pub fn aliases(self) -> &'static [&'static str] {
        match self {
            Endpoint::Rerank => &["/rerank", "/v2/rerank"],
            Endpoint::Score => &["/score"],
            _ => &[],
        }
    }

    /// Whether the engine keeps this request's prompt in its prefix cache for later requests to
    /// reuse, so that routing it to a cache owner pays. Pooling requests (embeddings, rerank, score)
    /// generate nothing and are placed by load alone.
    pub fn earns_cache_credit(self) -> bool {
        matches!(self, Endpoint::Chat | Endpoint::Completions | Endpoint::Generate | Endpoint::Responses)
    }

    /// Whether a request on this route may ask for a stream.
    pub fn can_stream(self) -> bool {
        self.earns_cache_credit()
    }

    /// Guesses the route of a bare body (for `POST /admin/decide`).
    pub fn infer(body: &Value) -> Endpoint {
        let has = |k: &str| body.get(k).is_some();
        if has("messages") {
            Endpoint::Chat
        } else if has("prompt") {
            Endpoint::Completions
        } else if has("query") && has("documents") {
            Endpoint::Rerank
        } else if has("query") && has("items") {
            Endpoint::Score
        } else if has("input") && (has("instructions") || has("max_output_tokens") || has("stream")) {
            Endpoint::Responses
        } else if has("input") {
            Endpoint::Embeddings
        } else {
            Endpoint::Generate
        }
    }
}

/// What routing needs from a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// Prompt token ids, as the engine will see them: all of them, or the prompt's start when
    /// `rest` is set.
    pub tokens: Vec<u32>,
    /// The end of the prompt that routing did not need tokenized ([`crate::routed`]).
    pub rest: Option<Untokenized>,
    /// Tokens the request may generate.
    pub max_tokens: u64,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// The requested model, if named.
    pub model: Option<String>,
    /// The cache salt, if any: salted prompts only share cache with the same salt.
    pub cache_salt: Option<String>,
    /// Embeddings: how many of `tokens` each input has, in order (`tokens` is them all, one
    /// after another). Empty for every other endpoint.
    pub input_lengths: Vec<usize>,
}

impl Parsed {
    /// Prompt tokens: exact, or with the untokenized rest estimated.
    pub fn prompt_tokens(&self) -> u64 {
        self.tokens.len() as u64 + self.rest.as_ref().map_or(0, |r| r.estimated_tokens)
    }

    /// Tokenizes what routing left untokenized, so that `tokens` holds every id.
    pub fn finish(&mut self, tokenizer: &dyn PromptTokenizer) -> Result<(), TokenizeError> {
        if let Some(rest) = &self.rest {
            let more = tokenizer.finish(rest)?;
            self.tokens.extend(more);
            self.rest = None;
        }
        Ok(())
    }
}

fn opt_str<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, RequestError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(RequestError::invalid(key, format!("`{key}` must be a string"))),
    }
}

fn opt_bool(body: &Value, key: &str) -> Result<bool, RequestError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RequestError::invalid(key, format!("`{key}` must be a boolean"))),
    }
}

fn opt_count(obj: &Value, key: &str) -> Result<Option<u64>, RequestError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= MAX_OUTPUT_TOKENS => Ok(Some(n)),
            _ => Err(RequestError::invalid(key, format!("`{key}` must be an integer from 0 to {MAX_OUTPUT_TOKENS}"))),
        },
    }
}

/// A JSON array of token ids (`param` names the field in the error).
pub fn token_ids(v: &Value, param: &str) -> Result<Vec<u32>, RequestError> {
    let bad = || RequestError::invalid(param, format!("`{param}` token ids must be integers from 0 to {}", u32::MAX));
    v.as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(bad))
        .collect()
}

/// Token ids a client sent as `param`, each within `tokenizer`'s vocabulary when it knows one: an
/// engine fed an id beyond its embedding table fails the request at best (vLLM's server refuses it
/// so) and at worst its whole scheduler (SGLang 0.5's dies, with every request it holds).
fn prompt_ids(v: &Value, param: &str, tokenizer: &dyn PromptTokenizer) -> Result<Vec<u32>, RequestError> {
    let ids = token_ids(v, param)?;
    if let Some(max) = tokenizer.max_token_id() {
        if let Some(bad) = ids.iter().find(|&&id| id > max) {
            return Err(RequestError::invalid(
                param,
                format!("token id {bad} in `{param}` is out of the vocabulary (its largest id is {max})"),
            ));
        }
    }
    Ok(ids)
}

/// The first of several id prompts (each checked as [`prompt_ids`]): it places the request.
fn first_of_id_prompts(
    items: &[Value],
    param: &str,
    tokenizer: &dyn PromptTokenizer,
) -> Result<Vec<u32>, RequestError> {
    for item in items.iter().skip(1) {
        prompt_ids(item, param, tokenizer)?;
    }
    items.first().map_or_else(|| Ok(Vec::new()), |first| prompt_ids(first, param, tokenizer))
}

/// Reads a request body for `endpoint`: validates its shape and tokenizes its whole prompt (token
/// ids the client already sent are used as they are).
pub fn parse(
    endpoint: Endpoint,
    body: &Value,
    tokenizer: &dyn PromptTokenizer,
    default_max_tokens: u64,
) -> Result<Parsed, RequestError> {
    parse_routed(endpoint, body, tokenizer, default_max_tokens, &mut Whole)
}

/// [`parse`], tokenizing a text prompt only for as long as `probe` wants more ids
/// ([`crate::routed`]). Pooling requests are tokenized whole: their count is all routing uses.
pub fn parse_routed(
    endpoint: Endpoint,
    body: &Value,
    tokenizer: &dyn PromptTokenizer,
    default_max_tokens: u64,
    probe: &mut dyn RoutingProbe,
) -> Result<Parsed, RequestError> {
    if !body.is_object() {
        return Err(RequestError::whole("the request body must be a JSON object"));
    }
    let model = opt_str(body, "model")?.map(str::to_owned);
    let cache_salt = opt_str(body, "cache_salt")?.filter(|s| !s.is_empty()).map(str::to_owned);
    let stream = opt_bool(body, "stream")? && endpoint.can_stream();
    // Engines add the tokenizer's special tokens (BOS) to raw prompts unless told not to.
    let add_special = match body.get("add_special_tokens") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(RequestError::invalid("add_special_tokens", "`add_special_tokens` must be a boolean")),
    };
    let tokenize_err = |e: TokenizeError| RequestError::whole(e.to_string());
    let mut input_lengths = Vec::new();
    let (tokens, max_tokens) = match endpoint {
        Endpoint::Chat => {
            let messages = body
                .get("messages")
                .and_then(Value::as_array)
                .filter(|m| !m.is_empty())
                .ok_or_else(|| RequestError::invalid("messages", "`messages` must be a non-empty array"))?;
            for (i, m) in messages.iter().enumerate() {
                let role_ok = m.get("role").is_some_and(Value::is_string);
                let content_ok =
                    matches!(m.get("content"), None | Some(Value::Null | Value::String(_) | Value::Array(_)));
                if !m.is_object() || !role_ok || !content_ok {
                    return Err(RequestError::invalid(
                        &format!("messages[{i}]"),
                        format!(
                            "`messages[{i}]` must be an object with a string `role` and a string or array `content`"
                        ),
                    ));
                }
            }
            let max = opt_count(body, "max_completion_tokens")?.or(opt_count(body, "max_tokens")?);
            (tokenizer.encode_chat_routed(body, probe).map_err(tokenize_err)?, max)
        }
        Endpoint::Completions => {
            let prompt = body.get("prompt").ok_or_else(|| RequestError::invalid("prompt", "`prompt` is required"))?;
            let tokens = match prompt {
                Value::String(s) => tokenizer.encode_prompt_routed(s, add_special, probe).map_err(tokenize_err)?,
                Value::Array(items) if items.is_empty() => {
                    return Err(RequestError::invalid("prompt", "`prompt` must not be empty"))
                }
                Value::Array(items) => match &items[0] {
                    // Several prompts are served by one engine; the first one places the request.
                    Value::String(s) if items.iter().all(Value::is_string) => {
                        tokenizer.encode_prompt_routed(s, add_special, probe).map_err(tokenize_err)?
                    }
                    Value::Number(_) => PromptIds::whole(prompt_ids(prompt, "prompt", tokenizer)?),
                    Value::Array(_) => PromptIds::whole(first_of_id_prompts(items, "prompt", tokenizer)?),
                    _ => {
                        return Err(RequestError::invalid(
                            "prompt",
                            "`prompt` must be a string, strings, token ids or lists of token ids",
                        ))
                    }
                },
                _ => {
                    return Err(RequestError::invalid(
                        "prompt",
                        "`prompt` must be a string, strings, token ids or lists of token ids",
                    ))
                }
            };
            (tokens, opt_count(body, "max_tokens")?)
        }
        Endpoint::Generate => {
            let tokens = match (body.get("input_ids"), body.get("text")) {
                (Some(ids), _) if !ids.is_null() => PromptIds::whole(match ids.as_array() {
                    Some(batch) if batch.first().is_some_and(Value::is_array) => {
                        first_of_id_prompts(batch, "input_ids", tokenizer)?
                    }
                    _ => prompt_ids(ids, "input_ids", tokenizer)?,
                }),
                (_, Some(Value::String(t))) => {
                    tokenizer.encode_prompt_routed(t, add_special, probe).map_err(tokenize_err)?
                }
                (_, Some(Value::Array(ts))) if ts.first().is_some_and(Value::is_string) => tokenizer
                    .encode_prompt_routed(ts[0].as_str().unwrap_or_default(), add_special, probe)
                    .map_err(tokenize_err)?,
                _ => return Err(RequestError::invalid("text", "`/generate` needs `text` or `input_ids`")),
            };
            let max = match body.get("sampling_params") {
                None | Some(Value::Null) => None,
                Some(sp) if sp.is_object() => opt_count(sp, "max_new_tokens")?,
                Some(_) => return Err(RequestError::invalid("sampling_params", "`sampling_params` must be an object")),
            };
            (tokens, max)
        }
        Endpoint::Responses => {
            let chat = responses::as_chat(body, tokenizer.rendering())?;
            let has_messages = chat["messages"].as_array().is_some_and(|m| !m.is_empty());
            // Only tool outputs for a stored conversation: the prompt is the engine's, unseen here.
            let tokens = if has_messages {
                tokenizer.encode_chat_routed(&chat, probe).map_err(tokenize_err)?
            } else {
                PromptIds::whole(Vec::new())
            };
            (tokens, opt_count(body, "max_output_tokens")?)
        }
        Endpoint::Embeddings => {
            let inputs = pooling::embeddings(body, tokenizer, add_special)?;
            input_lengths = inputs.iter().map(Vec::len).collect();
            (PromptIds::whole(inputs.concat()), Some(0))
        }
        Endpoint::Rerank => (PromptIds::whole(pooling::rerank(body, tokenizer, add_special)?), Some(0)),
        Endpoint::Score => (PromptIds::whole(pooling::score(body, tokenizer, add_special)?), Some(0)),
    };
    Ok(Parsed {
        tokens: tokens.ids,
        rest: tokens.rest,
        max_tokens: max_tokens.unwrap_or(default_max_tokens),
        stream,
        model,
        cache_salt,
        input_lengths,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BuiltinTokenizer;
    use serde_json::json;

    fn p(e: Endpoint, v: Value) -> Result<Parsed, RequestError> {
        parse(e, &v, &BuiltinTokenizer, 256)
    }

    #[test]
    fn each_endpoint_reads_its_prompt_and_limits() {
        let chat = p(
            Endpoint::Chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": true}),
        )
        .unwrap();
        assert_eq!((chat.max_tokens, chat.stream, chat.model.as_deref()), (9, true, Some("m")));
        assert!(!chat.tokens.is_empty());
        let ids = p(Endpoint::Completions, json!({"prompt": [1, 2, 3]})).unwrap();
        assert_eq!((ids.tokens, ids.max_tokens), (vec![1, 2, 3], 256));
        let gen =
            p(Endpoint::Generate, json!({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}})).unwrap();
        assert_eq!((gen.tokens, gen.max_tokens), (vec![5, 6], 4));
        let text = p(Endpoint::Generate, json!({"text": "hello there"})).unwrap();
        assert_eq!(text.tokens, BuiltinTokenizer::encode("hello there"));
    }

    #[test]
    fn pooling_routes_count_every_input_and_generate_nothing() {
        let enc = |t: &str| BuiltinTokenizer::encode(t);
        let e = p(Endpoint::Embeddings, json!({"input": ["one two", "three"], "stream": true})).unwrap();
        assert_eq!((e.tokens.len(), e.max_tokens, e.stream), (3, 0, false));
        let lists = p(Endpoint::Embeddings, json!({"input": [[1, 2], [3]]})).unwrap();
        assert_eq!((lists.tokens, lists.input_lengths), (vec![1, 2, 3], vec![2, 1]));
        assert_eq!(p(Endpoint::Embeddings, json!({"input": [7, 8]})).unwrap().tokens, vec![7, 8]);
        let r = p(Endpoint::Rerank, json!({"query": "q", "documents": ["a b", {"text": "c"}]})).unwrap();
        assert_eq!(r.tokens.len(), 2 * enc("q").len() + enc("a b").len() + enc("c").len());
        let s = p(Endpoint::Score, json!({"query": [1, 2], "items": [[3], [4, 5]]})).unwrap();
        assert_eq!(s.tokens, vec![1, 2, 3, 1, 2, 4, 5]);
        // vLLM's forms: one first text for every pair, or one each.
        let pair = 2 * enc("q").len() + enc("a b").len() + enc("c").len();
        for (a, b) in [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2")] {
            assert_eq!(p(Endpoint::Score, json!({a: "q", b: ["a b", "c"]})).unwrap().tokens.len(), pair, "{a} {b}");
        }
        let each = p(Endpoint::Score, json!({"text_1": ["q", "q"], "text_2": ["a b", "c"]})).unwrap();
        assert_eq!(each.tokens.len(), pair);
        assert!(p(Endpoint::Score, json!({"text_1": ["q", "q"], "text_2": ["a", "b", "c"]})).is_err(), "2:3");
        let one = p(Endpoint::Rerank, json!({"query": "q", "documents": "a b"})).unwrap();
        assert_eq!(one.tokens.len(), enc("q").len() + enc("a b").len(), "one document as a string");
        for e in [Endpoint::Embeddings, Endpoint::Rerank, Endpoint::Score] {
            assert!(!e.earns_cache_credit() && !e.can_stream());
        }
    }

    #[test]
    fn a_responses_request_is_tokenized_as_the_chat_it_carries() {
        let r = p(
            Endpoint::Responses,
            json!({"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                   {"type": "function_call_output", "call_id": "c", "output": "42"}], "max_output_tokens": 7, "stream": true}),
        )
        .unwrap();
        let chat = p(
            Endpoint::Chat,
            json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], "add_special_tokens": true}),
        )
        .unwrap();
        assert_eq!((r.tokens, r.max_tokens, r.stream), (chat.tokens, 7, true));
        let plain = p(Endpoint::Responses, json!({"input": "hello"})).unwrap();
        assert!(!plain.tokens.is_empty());
        assert!(Endpoint::Responses.earns_cache_credit());
        assert_eq!(Endpoint::infer(&json!({"input": "x", "stream": true})), Endpoint::Responses);
        assert_eq!(Endpoint::infer(&json!({"input": "x"})), Endpoint::Embeddings);
        assert_eq!(Endpoint::infer(&json!({"query": "x", "documents": []})), Endpoint::Rerank);
    }

    #[test]
    fn malformed_requests_name_the_field() {
        let param = |e: Endpoint, v: Value| match p(e, v) {
            Err(RequestError { param, .. }) => param,
            other => panic!("{other:?}"),
        };
        assert_eq!(param(Endpoint::Chat, json!({"messages": []})), Some("messages".into()));
        assert_eq!(param(Endpoint::Chat, json!({"messages": [{"content": "x"}]})), Some("messages[0]".into()));
        assert_eq!(
            param(Endpoint::Chat, json!({"messages": [{"role": "user", "content": 3}]})),
            Some("messages[0]".into())
        );
        assert_eq!(param(Endpoint::Chat, json!({"model": 7, "messages": [{"role": "u"}]})), Some("model".into()));
        assert_eq!(param(Endpoint::Chat, json!({"stream": "yes", "messages": [{"role": "u"}]})), Some("stream".into()));
        assert_eq!(
            param(Endpoint::Chat, json!({"max_tokens": -1, "messages": [{"role": "u"}]})),
            Some("max_tokens".into())
        );
        assert_eq!(param(Endpoint::Completions, json!({"prompt": [1, -2]})), Some("prompt".into()));
        assert_eq!(param(Endpoint::Completions, json!({})), Some("prompt".into()));
        assert_eq!(param(Endpoint::Generate, json!({})), Some("text".into()));
        assert_eq!(param(Endpoint::Embeddings, json!({"input": []})), Some("input".into()));
        assert_eq!(param(Endpoint::Embeddings, json!({"input": [true]})), Some("input".into()));
        assert_eq!(
            param(Endpoint::Rerank, json!({"query": "q", "documents": [{"title": "t"}]})),
            Some("documents[0]".into())
        );
        assert_eq!(param(Endpoint::Rerank, json!({"documents": ["d"]})), Some("query".into()));
        assert_eq!(param(Endpoint::Score, json!({"query": "q"})), Some("items".into()));
        assert_eq!(param(Endpoint::Responses, json!({"input": 3})), Some("input".into()));
        assert_eq!(param(Endpoint::Responses, json!({"input": [{"content": "x"}]})), Some("input[0]".into()));
        assert_eq!(param(Endpoint::Responses, json!({"input": "x", "instructions": 1})), Some("instructions".into()));
        assert!(matches!(p(Endpoint::Chat, json!([1])), Err(RequestError { param: None, .. })));
    }
}
