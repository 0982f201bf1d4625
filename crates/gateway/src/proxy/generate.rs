//! SGLang's native `POST /generate` for workers that speak token ids (gRPC workers): the request's
//! `sampling_params` read under SGLang's names and turned into the OpenAI fields [`super::openai`]
//! plans from, and the answer shaped as SGLang 0.5.23's own server shapes it
//! (`http_server.py` `generate_request`, `tokenizer_manager.py`): `text`, `output_ids` and
//! `meta_info`, whole, or streamed as `data:` events that each carry the whole text so far (SGLang's
//! default, without `--incremental-streaming-output`), then `data: [DONE]`.
//!
//! One prompt per request: batches (a list of texts or of id lists) and `n` above 1, which SGLang's
//! server answers with lists, are refused with a 400 that names them, as are log probabilities.

use serde_json::{json, Map, Value};

use super::openai::{Finish, Usage};
use crate::error::ApiError;

/// Top-level fields a `/generate` request may carry to a gRPC worker; any other is refused.
const FIELDS: &[&str] = &["text", "input_ids", "sampling_params", "stream", "rid", "model", "return_logprob"];

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

/// The OpenAI completions body that asks the worker what `body` asks, for the planner; the
/// request's own names are checked here so that its errors name them.
pub(super) fn as_completions(body: &Value) -> Result<Value, ApiError> {
    let Some(fields) = body.as_object() else {
        return Err(ApiError::InvalidRequest { param: None, message: "the request body must be a JSON object".into() });
    };
    if let Some(key) = fields.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(unsupported(key, ""));
    }
    if body.get("return_logprob").is_some_and(|v| v != false && !v.is_null()) {
        return Err(unsupported("return_logprob", "on /generate"));
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
            ("n", v) if v.as_u64() == Some(1) => {}
            ("n", _) => return Err(unsupported(&name, "other than 1")),
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

/// One `/generate` answer being shaped.
#[derive(Debug)]
pub(super) struct GenerateShape {
    rid: String,
    max_tokens: Option<u32>,
    /// The text a stream has sent so far (each event carries all of it).
    text: String,
}

impl GenerateShape {
    /// An answer to request `rid` (the client's own `rid` when it gave one).
    pub fn new(rid: String, max_tokens: Option<u32>) -> Self {
        GenerateShape { rid, max_tokens, text: String::new() }
    }

    fn meta_info(&self, finish: Option<&Finish>, usage: Usage) -> Value {
        json!({
            "id": self.rid,
            "finish_reason": finish.map_or(Value::Null, |f| finish_reason(f, self.max_tokens)),
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        })
    }

    /// The whole answer of a request that did not stream.
    pub fn body(&self, text: &str, output_ids: &[u32], finish: &Finish, usage: Usage) -> Value {
        json!({"text": text, "output_ids": output_ids, "meta_info": self.meta_info(Some(finish), usage)})
    }

    /// A stream's event after `delta` more text: all the text so far, the ids so far, and with
    /// `finish` how it ended. `None` when there is nothing new to say.
    pub fn event(&mut self, delta: &str, output_ids: &[u32], finish: Option<&Finish>, usage: Usage) -> Option<String> {
        if delta.is_empty() && finish.is_none() {
            return None;
        }
        self.text.push_str(delta);
        let v = json!({"text": self.text, "output_ids": output_ids, "meta_info": self.meta_info(finish, usage)});
        Some(format!("data: {v}\n\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_names_become_the_planners_and_what_cannot_be_served_is_named() {
        let body = json!({"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 8, "no_stop_trim": true,
                          "stop": ["\n"], "regex": "[a-z]+", "n": 1, "top_k": -1}});
        let c = as_completions(&body).unwrap();
        assert_eq!((c["max_tokens"].clone(), c["include_stop_str_in_output"].clone()), (json!(8), json!(true)));
        assert_eq!((c["stream"].clone(), c["top_k"].clone()), (json!(true), json!(-1)));
        assert_eq!(c["structured_outputs"], json!({"regex": "[a-z]+"}));
        assert_eq!(as_completions(&json!({"text": "hi"})).unwrap()["max_tokens"], 128, "SGLang's default");
        let err = |body: Value| as_completions(&body).unwrap_err().to_string();
        assert!(err(json!({"text": ["a", "b"]})).contains("`text` as a batch"));
        assert!(err(json!({"input_ids": [[1], [2]]})).contains("`input_ids` as a batch"));
        assert!(err(json!({"text": "a", "sampling_params": {"n": 2}})).contains("`sampling_params.n`"));
        assert!(err(json!({"text": "a", "sampling_params": {"custom_params": {}}}))
            .contains("`sampling_params.custom_params`"));
        assert!(err(json!({"text": "a", "return_logprob": true})).contains("`return_logprob`"));
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
        let mut shape = GenerateShape::new("r1".into(), Some(2));
        let cut = Finish { reason: "length".into(), stop_reason: Value::Null };
        let body = shape.body("ab", &[5, 6], &cut, usage);
        assert_eq!(body["meta_info"]["finish_reason"], json!({"type": "length", "length": 2}));
        assert_eq!((body["meta_info"]["id"].as_str(), body["output_ids"].clone()), (Some("r1"), json!([5, 6])));
        let eos = Finish { reason: "stop".into(), stop_reason: json!(2) };
        assert_eq!(
            shape.body("", &[2], &eos, usage)["meta_info"]["finish_reason"],
            json!({"type": "stop", "matched": 2})
        );
        assert_eq!(shape.event("", &[], None, usage), None);
        let first = shape.event("a", &[5], None, usage).unwrap();
        let last = shape.event("b", &[5, 6], Some(&cut), usage).unwrap();
        let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap().trim_end()).unwrap();
        assert!(first.contains("\"text\":\"a\""));
        assert_eq!(
            (v["text"].as_str(), v["meta_info"]["finish_reason"]["type"].as_str()),
            (Some("ab"), Some("length"))
        );
    }
}
