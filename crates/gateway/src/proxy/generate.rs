//! SGLang's native `POST /generate` for workers that speak token ids (gRPC workers): the request's
//! `sampling_params` read under SGLang's names and turned into the OpenAI fields [`super::openai`]
//! plans from, and the answer shaped as SGLang 0.5.23's own server shapes it
//! (`http_server.py` `generate_request`, `tokenizer_manager.py`): `text`, `output_ids` and
//! `meta_info`, whole, or streamed as `data:` events that each carry the whole text so far (SGLang's
//! default, without `--incremental-streaming-output`), then `data: [DONE]`.
//!
//! `n` above 1 is answered as SGLang's server answers it: a list of `n` answers, or a stream whose
//! events each carry one sequence's `index`. Log probabilities (`return_logprob`) come in
//! `meta_info` as SGLang's server shows them: `[logprob, token id, text or null]` for each output
//! token, the alternatives with `top_logprobs_num`, each event of a stream carrying all of them so
//! far. The prompt's own (`logprob_start_len` from 0) come under `input_token_logprobs` and
//! `input_top_logprobs` from that position on, the prompt's first token with a `null` log
//! probability. `token_ids_logprob` is refused with a 400 that names it: the worker is not asked
//! for chosen tokens' log probabilities yet.
//!
//! One prompt per request: a batch (a list of texts or of id lists) is refused with a 400 that names
//! it, as SMG 1.13 refuses it over gRPC: each prompt is its own routing decision, so a client sends
//! them as requests of their own.

use serde_json::{json, Map, Value};

use super::openai::{Finish, Usage, MAX_N, MAX_TOP_LOGPROBS};
use crate::error::ApiError;

/// Top-level fields a `/generate` request may carry to a gRPC worker; any other is refused.
const FIELDS: &[&str] = &[
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "model",
    "return_logprob",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "logprob_start_len",
    "token_ids_logprob",
];

/// SGLang's sampling settings and the OpenAI field each becomes (`None`: checked and taken here).
const SAMPLING: &[(&str, Option<&str>)] = &[
    ("max_new_tokens", Some("max_tokens")),
    ("min_new_tokens", Some("min_tokens")),
    ("temperature", Some("temperature")),
    ("top_p", Some("top_p")),
    ("top_k", Some("top_k")),
    ("min_p", Some("min_p")),
    ("frequency_penalty", Some("frequency_penalty")),
    ("presence_penalty", Some("presence_penalty")),
    ("repetition_penalty", Some("repetition_penalty")),
    ("stop", Some("stop")),
    ("stop_token_ids", Some("stop_token_ids")),
    ("ignore_eos", Some("ignore_eos")),
    ("skip_special_tokens", Some("skip_special_tokens")),
    ("no_stop_trim", Some("include_stop_str_in_output")),
    ("sampling_seed", Some("seed")),
    ("logit_bias", Some("logit_bias")),
    ("n", None),
    ("json_schema", None),
    ("regex", None),
    ("ebnf", None),
    ("spaces_between_special_tokens", None),
];

/// SGLang's default output limit (`SamplingParams.max_new_tokens`).
const DEFAULT_MAX_NEW_TOKENS: u64 = 128;

fn unsupported(key: &str, why: &str) -> ApiError {
    ApiError::invalid(key, format!("`{key}` {why} is not supported with gRPC workers yet"))
}

/// The OpenAI completions body that asks the worker what `body` asks (its log probabilities as
/// `asked`, read by [`LogprobAsk::from_request`]), for the planner; the request's own names are
/// checked here so that its errors name them.
pub(super) fn as_completions(body: &Value, asked: Option<LogprobAsk>) -> Result<Value, ApiError> {
    let Some(fields) = body.as_object() else {
        return Err(ApiError::InvalidRequest { param: None, message: "the request body must be a JSON object".into() });
    };
    if let Some(key) = fields.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(unsupported(key, ""));
    }
    let batch = match (body.get("text"), body.get("input_ids")) {
        (Some(Value::Array(_)), _) => Some("text"),
        (_, Some(Value::Array(ids))) if ids.first().is_some_and(Value::is_array) => Some("input_ids"),
        _ => None,
    };
    if let Some(key) = batch {
        return Err(unsupported(key, "as a batch (a list of prompts)"));
    }
    let mut out = Map::new();
    out.insert("stream".into(), body.get("stream").cloned().unwrap_or(Value::Bool(false)));
    out.insert("max_tokens".into(), Value::from(DEFAULT_MAX_NEW_TOKENS));
    if let Some(ask) = asked {
        // Completions' `logprobs` asks the worker for the sampled token's and `top` alternatives.
        out.insert("logprobs".into(), Value::from(ask.top));
    }
    let empty = Map::new();
    let sampling = match body.get("sampling_params") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(m)) => m,
        Some(_) => return Err(ApiError::invalid("sampling_params", "`sampling_params` must be an object")),
    };
    let mut structured = Map::new();
    for (key, value) in sampling.iter().filter(|(_, v)| !v.is_null()) {
        let name = format!("sampling_params.{key}");
        let Some((_, openai)) = SAMPLING.iter().find(|(k, _)| k == key) else {
            return Err(unsupported(&name, ""));
        };
        if let Some(openai) = openai {
            // Settings under another name are checked here, so that an error names the request's.
            let well_typed = match key.as_str() {
                "min_new_tokens" => value.is_u64(),
                "sampling_seed" => value.is_i64() || value.is_u64(),
                "no_stop_trim" => value.is_boolean(),
                _ => true,
            };
            if !well_typed {
                let kind = match key.as_str() {
                    "no_stop_trim" => "a boolean",
                    "min_new_tokens" => "a non-negative integer",
                    _ => "an integer",
                };
                return Err(ApiError::invalid(&name, format!("`{name}` must be {kind}")));
            }
            out.insert((*openai).into(), value.clone());
            continue;
        }
        match (key.as_str(), value) {
            ("n", v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|n| (1..=MAX_N).contains(n)) {
                Some(n) => {
                    out.insert("n".into(), Value::from(n));
                }
                None => return Err(ApiError::invalid(&name, format!("`{name}` must be from 1 to {MAX_N}"))),
            },
            ("spaces_between_special_tokens", Value::Bool(true)) => {}
            ("spaces_between_special_tokens", _) => return Err(unsupported(&name, "other than true")),
            ("json_schema", Value::String(s)) => {
                structured.insert("json".into(), Value::from(s.clone()));
            }
            ("regex", Value::String(s)) => {
                structured.insert("regex".into(), Value::from(s.clone()));
            }
            ("ebnf", Value::String(s)) => {
                structured.insert("grammar".into(), Value::from(s.clone()));
            }
            _ => return Err(ApiError::invalid(&name, format!("`{name}` must be a string"))),
        }
    }
    if structured.len() > 1 {
        return Err(ApiError::invalid("sampling_params", "give only one of json_schema, regex and ebnf"));
    }
    if !structured.is_empty() {
        out.insert("structured_outputs".into(), Value::Object(structured));
    }
    Ok(Value::Object(out))
}

/// SGLang's `finish_reason` object for how a sequence ended; `max_tokens` is the limit it was given.
fn finish_reason(finish: &Finish, max_tokens: Option<u32>) -> Value {
    match finish.reason.as_str() {
        "length" => json!({"type": "length", "length": max_tokens}),
        "abort" => json!({"type": "abort", "message": null}),
        _ => json!({"type": "stop", "matched": finish.stop_reason}),
    }
}

/// What a `/generate` request asks of log probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobAsk {
    /// Alternatives shown per output token (`top_logprobs_num`); 0 shows none.
    pub top: u32,
    /// Whether each entry carries its token's text (`return_text_in_logprobs`).
    pub with_text: bool,
    /// The prompt position from which the prompt's own log probabilities are shown
    /// (`logprob_start_len`; `None`, SGLang's -1: none).
    pub prompt_from: Option<u32>,
}

impl LogprobAsk {
    /// What `body` asks; `None` without `return_logprob` (SGLang then ignores the other settings).
    pub fn from_request(body: &Value) -> Result<Option<LogprobAsk>, ApiError> {
        let flag = |key: &str| match body.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::invalid(key, format!("`{key}` must be a boolean"))),
        };
        let with_text = flag("return_text_in_logprobs")?;
        if !flag("return_logprob")? {
            return Ok(None);
        }
        let top = match body.get("top_logprobs_num") {
            None | Some(Value::Null) => 0,
            Some(v) => v
                .as_u64()
                .filter(|&k| k <= MAX_TOP_LOGPROBS.unsigned_abs())
                .and_then(|k| u32::try_from(k).ok())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "top_logprobs_num",
                        format!("`top_logprobs_num` must be from 0 to {MAX_TOP_LOGPROBS}"),
                    )
                })?,
        };
        // SGLang's default (-1) asks for no prompt logprobs when output ones are asked.
        let prompt_from = match body.get("logprob_start_len") {
            None | Some(Value::Null) => None,
            Some(v) if v.as_i64() == Some(-1) => None,
            Some(v) => Some(v.as_u64().and_then(|k| u32::try_from(k).ok()).ok_or_else(|| {
                ApiError::invalid("logprob_start_len", "`logprob_start_len` must be -1 or a prompt position from 0")
            })?),
        };
        match body.get("token_ids_logprob") {
            None | Some(Value::Null) => {}
            Some(Value::Array(ids)) if ids.is_empty() => {}
            Some(_) => return Err(unsupported("token_ids_logprob", "")),
        }
        Ok(Some(LogprobAsk { top, with_text, prompt_from }))
    }
}

/// One sequence of a `/generate` answer being shaped.
#[derive(Debug, Default)]
struct Sequence {
    /// The text a stream has sent so far (each event carries all of it).
    text: String,
    /// `[logprob, token id, text or null]` of each output token so far.
    token_logprobs: Vec<Value>,
    /// Each output token's alternatives so far, as such lists (null where none came).
    top_logprobs: Vec<Value>,
    /// `[logprob, token id, text or null]` of each prompt token shown (from `logprob_start_len`).
    input_token_logprobs: Vec<Value>,
    /// Each such prompt token's alternatives.
    input_top_logprobs: Vec<Value>,
    /// Whether log probabilities came since the last event.
    fresh: bool,
}

/// One `/generate` answer being shaped.
#[derive(Debug)]
pub(super) struct GenerateShape {
    rid: String,
    max_tokens: Option<u32>,
    logprobs: Option<LogprobAsk>,
    /// One per sequence asked for (`n`), by index.
    sequences: Vec<Sequence>,
}

impl GenerateShape {
    /// An answer of `n` sequences to request `rid` (the client's own `rid` when it gave one), with
    /// the log probabilities `logprobs` asks for.
    pub fn new(rid: String, max_tokens: Option<u32>, n: u32, logprobs: Option<LogprobAsk>) -> Self {
        let sequences = (0..n.max(1)).map(|_| Sequence::default()).collect();
        GenerateShape { rid, max_tokens, logprobs, sequences }
    }

    fn several(&self) -> bool {
        self.sequences.len() > 1
    }

    /// Adds sequence `index`'s next log probabilities, as [`super::logprobs::SequenceLogprobs`]
    /// takes them for `/generate` (`null`: none asked).
    pub fn push_logprobs(&mut self, index: usize, taken: Value) {
        let Some(seq) = self.sequences.get_mut(index) else { return };
        let Value::Object(mut taken) = taken else { return };
        if let Some(Value::Array(tokens)) = taken.remove("tokens") {
            seq.fresh |= !tokens.is_empty();
            seq.token_logprobs.extend(tokens);
        }
        if let Some(Value::Array(top)) = taken.remove("top") {
            seq.top_logprobs.extend(top);
        }
        if let Some(Value::Array(tokens)) = taken.remove("input_tokens") {
            seq.fresh |= !tokens.is_empty();
            seq.input_token_logprobs.extend(tokens);
        }
        if let Some(Value::Array(top)) = taken.remove("input_top") {
            seq.input_top_logprobs.extend(top);
        }
    }

    fn meta_info(&self, index: usize, finish: Option<&Finish>, usage: Usage) -> Value {
        // Each of several sequences is a request of its own to SGLang's server, with its own id.
        let id = if self.several() { format!("{}-{index}", self.rid) } else { self.rid.clone() };
        let mut meta = json!({
            "id": id,
            "finish_reason": finish.map_or(Value::Null, |f| finish_reason(f, self.max_tokens)),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        });
        if let (Some(ask), Some(seq)) = (self.logprobs, self.sequences.get(index)) {
            meta["input_token_logprobs"] = Value::Array(seq.input_token_logprobs.clone());
            meta["output_token_logprobs"] = Value::Array(seq.token_logprobs.clone());
            meta["output_token_logprobs_length"] = Value::from(seq.token_logprobs.len());
            if ask.top > 0 {
                meta["input_top_logprobs"] = Value::Array(seq.input_top_logprobs.clone());
                meta["output_top_logprobs"] = Value::Array(seq.top_logprobs.clone());
            }
        }
        meta
    }

    /// Sequence `index` of an answer that did not stream.
    pub fn sequence_body(&self, index: usize, text: &str, output_ids: &[u32], finish: &Finish, usage: Usage) -> Value {
        json!({"text": text, "output_ids": output_ids, "meta_info": self.meta_info(index, Some(finish), usage)})
    }

    /// The whole answer from its sequences' bodies: the one, or the list of several.
    pub fn answer(&self, mut bodies: Vec<Value>) -> Value {
        if self.several() || bodies.len() != 1 {
            return Value::Array(bodies);
        }
        bodies.pop().unwrap_or(Value::Null)
    }

    /// A stream's event for sequence `index` after `delta` more text: all its text so far, its ids
    /// so far, and with `finish` how it ended. `None` when there is nothing new to say.
    pub fn event(
        &mut self,
        index: usize,
        delta: &str,
        output_ids: &[u32],
        finish: Option<&Finish>,
        usage: Usage,
    ) -> Option<String> {
        let seq = self.sequences.get_mut(index)?;
        if delta.is_empty() && finish.is_none() && !seq.fresh {
            return None;
        }
        seq.fresh = false;
        seq.text.push_str(delta);
        let mut v =
            json!({"text": seq.text, "output_ids": output_ids, "meta_info": self.meta_info(index, finish, usage)});
        if self.several() {
            v["index"] = Value::from(index);
        }
        Some(format!("data: {v}\n\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_tokenizer::request::Endpoint;

    #[test]
    fn sglang_names_become_the_planners_and_what_cannot_be_served_is_named() {
        let body = json!({"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 8, "no_stop_trim": true,
                          "stop": ["\n"], "regex": "[a-z]+", "n": 1, "top_k": -1}});
        let c = as_completions(&body, None).unwrap();
        assert_eq!((c["max_tokens"].clone(), c["include_stop_str_in_output"].clone()), (json!(8), json!(true)));
        assert_eq!((c["stream"].clone(), c["top_k"].clone()), (json!(true), json!(-1)));
        assert_eq!(c["structured_outputs"], json!({"regex": "[a-z]+"}));
        assert_eq!(as_completions(&json!({"text": "hi"}), None).unwrap()["max_tokens"], 128, "SGLang's default");
        let err = |body: Value| as_completions(&body, None).unwrap_err().to_string();
        assert!(err(json!({"text": ["a", "b"]})).contains("`text` as a batch"));
        assert!(err(json!({"input_ids": [[1], [2]]})).contains("`input_ids` as a batch"));
        assert!(err(json!({"text": "a", "sampling_params": {"n": 0}})).contains("`sampling_params.n` must be from 1"));
        assert!(err(json!({"text": "a", "sampling_params": {"custom_params": {}}}))
            .contains("`sampling_params.custom_params`"));
        assert!(err(json!({"text": "a", "lora_path": "x"})).contains("`lora_path`"));
        assert!(err(json!({"text": "a", "sampling_params": {"regex": "a", "ebnf": "b"}})).contains("only one"));
        assert!(err(json!({"text": "a", "sampling_params": {"min_new_tokens": "x"}}))
            .contains("`sampling_params.min_new_tokens`"));
        assert!(err(json!({"text": "a", "sampling_params": {"no_stop_trim": 1}}))
            .contains("`sampling_params.no_stop_trim`"));
    }

    #[test]
    fn answers_carry_sglangs_meta_info_and_a_stream_the_whole_text_so_far() {
        let usage = Usage { prompt_tokens: 4, completion_tokens: 2, cached_tokens: 1 };
        let mut shape = GenerateShape::new("r1".into(), Some(2), 1, None);
        let cut = Finish { reason: "length".into(), stop_reason: Value::Null };
        let body = shape.answer(vec![shape.sequence_body(0, "ab", &[5, 6], &cut, usage)]);
        assert_eq!(body["meta_info"]["finish_reason"], json!({"type": "length", "length": 2}));
        assert_eq!((body["meta_info"]["id"].as_str(), body["output_ids"].clone()), (Some("r1"), json!([5, 6])));
        assert!(body["meta_info"].get("output_token_logprobs").is_none(), "not asked");
        let eos = Finish { reason: "stop".into(), stop_reason: json!(2) };
        assert_eq!(
            shape.sequence_body(0, "", &[2], &eos, usage)["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": 2})
        );
        assert_eq!(shape.event(0, "", &[], None, usage), None);
        let first = shape.event(0, "a", &[5], None, usage).unwrap();
        let last = shape.event(0, "b", &[5, 6], Some(&cut), usage).unwrap();
        let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert!(first.contains("\"text\":\"a\""));
        assert_eq!(
            (v["text"].as_str(), v["meta_info"]["finish_reason"]["type"].as_str()),
            (Some("ab"), Some("length"))
        );
        assert!(v.get("index").is_none(), "one sequence: no index, as SGLang's server");
    }

    #[test]
    fn several_sequences_are_a_list_or_indexed_events_each_with_its_own_logprobs() {
        let usage = Usage { prompt_tokens: 4, completion_tokens: 1, cached_tokens: 0 };
        let ask = LogprobAsk { top: 1, with_text: false, prompt_from: None };
        let mut shape = GenerateShape::new("r".into(), Some(1), 2, Some(ask));
        let cut = Finish { reason: "length".into(), stop_reason: Value::Null };
        shape.push_logprobs(1, json!({"tokens": [[-0.5, 7, null]], "top": [[[-0.5, 7, null]]]}));
        // Log probabilities alone are worth an event (a token whose text is not out yet).
        let event = shape.event(1, "", &[7], None, usage).unwrap();
        let v: Value = serde_json::from_str(event.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert_eq!((v["index"].clone(), v["meta_info"]["id"].clone()), (json!(1), json!("r-1")));
        assert_eq!(v["meta_info"]["output_token_logprobs"], json!([[-0.5, 7, null]]));
        assert_eq!(v["meta_info"]["output_top_logprobs"], json!([[[-0.5, 7, null]]]));
        assert_eq!(
            (v["meta_info"]["input_token_logprobs"].clone(), v["meta_info"]["output_token_logprobs_length"].clone()),
            (json!([]), json!(1))
        );
        assert_eq!(shape.event(1, "", &[7], None, usage), None, "nothing new since");
        let bodies = (0..2).map(|i| shape.sequence_body(i, "x", &[7], &cut, usage)).collect();
        let answer = shape.answer(bodies);
        assert_eq!(answer.as_array().map(Vec::len), Some(2));
        assert_eq!(answer[0]["meta_info"]["output_token_logprobs"], json!([]), "sequence 0 got none");
        assert!(answer[0].get("index").is_none(), "a whole answer's sequences carry no index");
    }

    #[test]
    fn logprob_settings_are_read_as_sglang_reads_them() {
        let ask = |body: Value| LogprobAsk::from_request(&body);
        assert_eq!(ask(json!({"text": "a", "top_logprobs_num": 3})).unwrap(), None, "ignored without return_logprob");
        assert_eq!(
            ask(json!({"return_logprob": true, "top_logprobs_num": 3, "return_text_in_logprobs": true})).unwrap(),
            Some(LogprobAsk { top: 3, with_text: true, prompt_from: None })
        );
        assert_eq!(ask(json!({"return_logprob": true, "logprob_start_len": -1})).unwrap().map(|a| a.top), Some(0));
        let err = |body: Value| ask(body).unwrap_err().to_string();
        let from = |body: Value| ask(body).unwrap().and_then(|a| a.prompt_from);
        assert_eq!(from(json!({"return_logprob": true, "logprob_start_len": 0})), Some(0));
        assert_eq!(from(json!({"return_logprob": true, "logprob_start_len": 3})), Some(3));
        assert_eq!(from(json!({"logprob_start_len": 3})), None, "ignored without return_logprob, as SGLang");
        assert!(err(json!({"return_logprob": true, "logprob_start_len": -2})).contains("`logprob_start_len`"));
        assert!(err(json!({"return_logprob": true, "logprob_start_len": "0"})).contains("`logprob_start_len`"));
        assert!(err(json!({"return_logprob": true, "token_ids_logprob": [1]})).contains("`token_ids_logprob`"));
        assert!(err(json!({"return_logprob": true, "top_logprobs_num": 99})).contains("`top_logprobs_num`"));
        assert!(err(json!({"return_logprob": "yes"})).contains("`return_logprob` must be a boolean"));
        let body = json!({"text": "a", "return_logprob": true, "top_logprobs_num": 2, "sampling_params": {"n": 3}});
        let c = as_completions(&body, ask(body.clone()).unwrap()).unwrap();
        assert_eq!((c["logprobs"].clone(), c["n"].clone()), (json!(2), json!(3)));
        let plan = super::super::openai::Plan::from_request(Endpoint::Generate, &body, "m").unwrap();
        assert_eq!(
            plan.generate_logprobs,
            Some(LogprobAsk { top: 2, with_text: false, prompt_from: None }),
            "the plan carries them"
        );
        assert_eq!(plan.top_logprobs(), Some(2));
    }
}
