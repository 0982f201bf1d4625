//! OpenAI's Responses API (`POST /v1/responses`) for workers that speak token ids (gRPC workers):
//! which request fields such a worker can honour, and the response object and named stream events
//! built from the detokenized text, in the shapes vLLM 0.32's own server sends
//! (`responses/serving.py`, `responses/streaming_events.py`).
//!
//! A Responses request is one conversation turn: `instructions` and the `input` messages are
//! rendered by the chat template (`kvgate_tokenizer::request::responses`), one sequence is
//! generated, and the answer is one assistant message. Items that are not messages (tool calls and
//! their outputs, reasoning) and parts that are not text are refused by name: the gateway does not
//! parse tool calls or reasoning yet, and dropping them would change the prompt.

use serde_json::{json, Map, Value};

use super::openai::{Finish, Usage, BOOKKEEPING_FIELDS, SAMPLING_FIELDS};
use crate::error::ApiError;
use crate::grpc_worker::Constraint;

/// Fields of the Responses API's own a request may carry to a gRPC worker, beside the sampling
/// and bookkeeping fields every endpoint takes ([`SAMPLING_FIELDS`], [`BOOKKEEPING_FIELDS`]). Any
/// other is refused with a 400 that names it.
const FIELDS: &[&str] = &[
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tool_calls",
    "chat_template_kwargs",
    // Checked below: only the values that ask nothing of the worker pass.
    "truncation",
    "reasoning",
    "include",
    "top_logprobs",
    "background",
    "previous_response_id",
    "prompt",
];

fn unsupported(key: &str, why: &str) -> ApiError {
    ApiError::invalid(key, format!("`{key}` {why} is not supported with gRPC workers yet"))
}

/// Whether `body[key]` is absent, null, or `default`.
fn left_at(body: &Value, key: &str, default: &Value) -> bool {
    body.get(key).is_none_or(|v| v.is_null() || v == default)
}

/// Refuses what a gRPC worker cannot serve in a Responses request: unknown fields, settings that
/// need state or parsers the gateway does not have, and `input` items that are not text messages.
pub(super) fn check(body: &Value) -> Result<(), ApiError> {
    let Some(fields) = body.as_object() else {
        return Err(ApiError::InvalidRequest { param: None, message: "the request body must be a JSON object".into() });
    };
    let known = |k: &str| [SAMPLING_FIELDS, BOOKKEEPING_FIELDS, FIELDS].iter().any(|l| l.contains(&k));
    if let Some(key) = fields.keys().find(|k| !known(k)) {
        return Err(unsupported(key, ""));
    }
    if !left_at(body, "truncation", &json!("disabled")) {
        return Err(unsupported("truncation", "other than \"disabled\""));
    }
    if !left_at(body, "reasoning", &Value::Null) {
        return Err(unsupported("reasoning", "(reasoning is not parsed yet)"));
    }
    check_include(body)?;
    if !left_at(body, "background", &json!(false)) {
        return Err(unsupported("background", "(kvgate keeps no responses to run later)"));
    }
    for key in ["previous_response_id", "prompt"] {
        if !left_at(body, key, &Value::Null) {
            return Err(unsupported(key, "(kvgate keeps no stored responses or prompts)"));
        }
    }
    if let Some(Value::Array(items)) = body.get("input") {
        for (i, item) in items.iter().enumerate() {
            check_item(item, i)?;
        }
    }
    Ok(())
}

/// What `include` may ask: the output text's log probabilities. The other values name what this
/// gateway does not produce (tool outputs, images, encrypted reasoning).
fn check_include(body: &Value) -> Result<(), ApiError> {
    let items = match body.get("include") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::invalid("include", "`include` must be an array of strings")),
    };
    for item in items {
        match item.as_str() {
            Some(OUTPUT_LOGPROBS) => {}
            Some(other) => {
                return Err(unsupported(
                    "include",
                    &format!("value {other:?} (only {OUTPUT_LOGPROBS:?} is served with gRPC workers)"),
                ))
            }
            None => return Err(ApiError::invalid("include", "`include` must be an array of strings")),
        }
    }
    Ok(())
}

/// Whether the request asks for the output text's log probabilities (vLLM's server asks its engine
/// for them only then, whatever `top_logprobs` says).
pub(super) fn wants_logprobs(body: &Value) -> bool {
    body.get("include").and_then(Value::as_array).is_some_and(|items| items.iter().any(|i| i == OUTPUT_LOGPROBS))
}

/// The `include` value that asks for the output text's log probabilities.
const OUTPUT_LOGPROBS: &str = "message.output_text.logprobs";

/// An `input` item must be a message of text parts.
fn check_item(item: &Value, i: usize) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    if kind != "message" {
        return Err(ApiError::invalid(
            &at,
            format!("`{at}` is a `{kind}` item: only message items are supported with gRPC workers yet (tool calls and reasoning are not parsed yet)"),
        ));
    }
    for (j, part) in item.get("content").and_then(Value::as_array).into_iter().flatten().enumerate() {
        let part_kind = part.get("type").and_then(Value::as_str).unwrap_or("text");
        if !matches!(part_kind, "input_text" | "output_text" | "text") {
            let at = format!("{at}.content[{j}]");
            return Err(ApiError::invalid(
                &at,
                format!("`{at}` is an `{part_kind}` part: only text parts are supported with gRPC workers"),
            ));
        }
    }
    Ok(())
}

/// What the output must match: `text.format` (`json_object`, `json_schema` with its `schema`) or
/// vLLM's `structured_outputs`, not both, as vLLM's server reads them.
pub(super) fn constraint(
    body: &Value,
    structured_outputs: impl Fn(&Value) -> Result<Option<Constraint>, ApiError>,
) -> Result<Option<Constraint>, ApiError> {
    let format = body.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null());
    let outputs = body.get("structured_outputs").filter(|o| !o.is_null());
    let bad = |why: String| ApiError::invalid("text.format", format!("`text.format` {why}"));
    match (format, outputs) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid("structured_outputs", "give `text.format` or `structured_outputs`, not both"))
        }
        (None, Some(outputs)) => structured_outputs(outputs),
        (None, None) => Ok(None),
        (Some(format), None) => match format.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Constraint::JsonObject)),
            Some("json_schema") => {
                let schema = format
                    .get("schema")
                    .filter(|s| s.is_object())
                    .ok_or_else(|| bad("of type json_schema needs `schema`, a JSON schema object".into()))?;
                Ok(Some(Constraint::JsonSchema(schema.to_string())))
            }
            Some(other) => Err(bad(format!("has type {other:?}; text, json_object or json_schema"))),
            None => Err(bad("needs a `type`".into())),
        },
    }
}

/// The request's own settings a response object repeats, as vLLM's server fills them in.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesEcho {
    fields: Map<String, Value>,
}

impl ResponsesEcho {
    /// Reads the settings from `body`; `max_output_tokens` is the limit the worker was given.
    pub fn from_request(body: &Value) -> ResponsesEcho {
        let given = |key: &str| body.get(key).filter(|v| !v.is_null()).cloned();
        let or = |key: &str, default: Value| given(key).unwrap_or(default);
        let mut fields = Map::new();
        fields.insert("instructions".into(), or("instructions", Value::Null));
        fields.insert("metadata".into(), or("metadata", Value::Null));
        fields.insert("parallel_tool_calls".into(), or("parallel_tool_calls", Value::Bool(true)));
        fields.insert("temperature".into(), or("temperature", json!(1.0)));
        fields.insert("tool_choice".into(), or("tool_choice", json!("auto")));
        fields.insert("tools".into(), or("tools", json!([])));
        fields.insert("top_p".into(), or("top_p", json!(1.0)));
        fields.insert("background".into(), Value::Bool(false));
        fields.insert("max_output_tokens".into(), Value::Null);
        fields.insert("max_tool_calls".into(), or("max_tool_calls", Value::Null));
        fields.insert("previous_response_id".into(), Value::Null);
        fields.insert("prompt".into(), Value::Null);
        fields.insert("reasoning".into(), Value::Null);
        fields.insert("service_tier".into(), or("service_tier", json!("auto")));
        fields.insert("text".into(), or("text", Value::Null));
        fields.insert("top_logprobs".into(), Value::Null);
        fields.insert("truncation".into(), or("truncation", json!("disabled")));
        fields.insert("user".into(), or("user", Value::Null));
        fields.insert("presence_penalty".into(), or("presence_penalty", json!(0.0)));
        fields.insert("frequency_penalty".into(), or("frequency_penalty", json!(0.0)));
        ResponsesEcho { fields }
    }

    /// Records the output limit the worker was given (vLLM shows the one it applied).
    pub fn set_max_output_tokens(&mut self, max_tokens: Option<u32>) {
        self.fields.insert("max_output_tokens".into(), max_tokens.map_or(Value::Null, Value::from));
    }

    /// Records the alternatives per token the worker was asked for (`null` when the request asks
    /// for no logprobs, as vLLM's server shows it).
    pub fn set_top_logprobs(&mut self, top: Option<u32>) {
        self.fields.insert("top_logprobs".into(), top.map_or(Value::Null, Value::from));
    }
}

/// The Responses API's usage object.
fn usage_json(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// A response's status from how its sequence ended: cut by the output limit is `incomplete`.
fn status_of(finish: &Finish) -> &'static str {
    match finish.reason.as_str() {
        "length" => "incomplete",
        "abort" => "cancelled",
        _ => "completed",
    }
}

/// One Responses answer being shaped: its ids, and for a stream the events sent so far.
#[derive(Debug)]
pub(super) struct ResponsesShape {
    id: String,
    item_id: String,
    created_at: u64,
    model: String,
    echo: ResponsesEcho,
    /// The next event's `sequence_number`.
    sequence: u64,
    /// Whether the stream has opened the assistant message (on its first text, as vLLM does).
    opened: bool,
    /// The text streamed so far.
    text: String,
    /// The log probabilities streamed so far, when the request asked for them.
    logprobs: Vec<Value>,
    /// Whether a stream cut by the output limit ends with `response.incomplete` (SGLang's server,
    /// as OpenAI) rather than `response.completed` with status `incomplete` (vLLM's).
    incomplete_event: bool,
}

impl ResponsesShape {
    /// A new answer `resp_{key}` with message `msg_{key}`.
    pub fn new(key: &str, created_at: u64, model: String, echo: ResponsesEcho, incomplete_event: bool) -> Self {
        ResponsesShape {
            id: format!("resp_{key}"),
            item_id: format!("msg_{key}"),
            created_at,
            model,
            echo,
            sequence: 0,
            opened: false,
            text: String::new(),
            logprobs: Vec::new(),
            incomplete_event,
        }
    }

    /// The response object.
    fn object(&self, status: &str, output: Value, usage: Option<Usage>) -> Value {
        let mut m = Map::new();
        m.insert("id".into(), Value::from(self.id.clone()));
        m.insert("object".into(), Value::from("response"));
        m.insert("created_at".into(), Value::from(self.created_at));
        m.insert("model".into(), Value::from(self.model.clone()));
        m.insert("status".into(), Value::from(status));
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        m.insert("incomplete_details".into(), incomplete.unwrap_or(Value::Null));
        m.insert("output".into(), output);
        for (k, v) in &self.echo.fields {
            m.insert(k.clone(), v.clone());
        }
        m.insert("usage".into(), usage.map_or(Value::Null, usage_json));
        Value::Object(m)
    }

    /// The output text part.
    fn part(text: &str, logprobs: Value) -> Value {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
    }

    /// The assistant message item holding `text` and its tokens' `logprobs` (no part when there
    /// is no text, as vLLM's).
    fn message(&self, text: &str, logprobs: Value, status: &str) -> Value {
        let content = if text.is_empty() { json!([]) } else { json!([Self::part(text, logprobs)]) };
        json!({"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content})
    }

    /// The whole response of a request that did not stream; `logprobs` is the list of its tokens'
    /// log probabilities ([`super::logprobs`]), or `null` when not asked.
    pub fn body(&self, text: &str, logprobs: Value, finish: &Finish, usage: Usage) -> Value {
        self.object(status_of(finish), json!([self.message(text, logprobs, "completed")]), Some(usage))
    }

    /// One named event, numbered.
    fn event(&mut self, kind: &str, fields: Value) -> String {
        let mut data = Map::new();
        data.insert("type".into(), Value::from(kind));
        data.insert("sequence_number".into(), Value::from(self.sequence));
        if let Value::Object(f) = fields {
            data.extend(f);
        }
        self.sequence += 1;
        format!("event: {kind}\ndata: {}\n\n", Value::Object(data))
    }

    /// The stream's first events: the response created and in progress.
    pub fn opening(&mut self) -> String {
        let response = self.object("in_progress", json!([]), None);
        let mut out = self.event("response.created", json!({"response": response}));
        out.push_str(&self.event("response.in_progress", json!({"response": response})));
        out
    }

    /// The events for new text: the assistant message opened on the first text, then the delta
    /// with the log probabilities of the tokens it shows (a list, or `null` when not asked). A
    /// delta event names each token and its alternatives without their bytes, as vLLM's does.
    pub fn delta(&mut self, delta: &str, logprobs: Value) -> String {
        if delta.is_empty() {
            return String::new();
        }
        let mut out = String::new();
        if !self.opened {
            self.opened = true;
            let item = json!({"id": self.item_id, "type": "message", "role": "assistant", "content": [], "status": "in_progress"});
            out.push_str(&self.event("response.output_item.added", json!({"output_index": 0, "item": item})));
            let part = Self::part("", json!([]));
            let item_id = self.item_id.clone();
            out.push_str(&self.event(
                "response.content_part.added",
                json!({"output_index": 0, "item_id": item_id, "content_index": 0, "part": part}),
            ));
        }
        self.text.push_str(delta);
        let entries = match logprobs {
            Value::Array(entries) => entries,
            _ => Vec::new(),
        };
        let streamed: Vec<Value> = entries.iter().map(without_bytes).collect();
        self.logprobs.extend(entries);
        let item_id = self.item_id.clone();
        out.push_str(&self.event(
            "response.output_text.delta",
            json!({"content_index": 0, "output_index": 0, "item_id": item_id, "delta": delta, "logprobs": streamed}),
        ));
        out
    }

    /// The stream's last events: the message closed (when it was opened) and the final response.
    /// `trailing` holds the log probabilities of tokens that showed no text (the end-of-sequence
    /// token): no delta carried them, the finished message lists them with the rest.
    pub fn closing(&mut self, finish: &Finish, usage: Usage, trailing: Value) -> String {
        if let Value::Array(entries) = trailing {
            self.logprobs.extend(entries);
        }
        let mut out = String::new();
        let mut output = Vec::new();
        if self.opened {
            let (text, item_id) = (self.text.clone(), self.item_id.clone());
            // vLLM's server shows `null` where no token's logprobs were asked.
            let logprobs = if self.logprobs.is_empty() { Value::Null } else { Value::Array(self.logprobs.clone()) };
            out.push_str(&self.event(
                "response.output_text.done",
                json!({"output_index": 0, "content_index": 0, "text": text, "logprobs": [], "item_id": item_id}),
            ));
            let part = Self::part(&text, logprobs.clone());
            out.push_str(&self.event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
            ));
            let item = self.message(&text, logprobs, "completed");
            out.push_str(&self.event("response.output_item.done", json!({"output_index": 0, "item": item})));
            output.push(item);
        }
        let status = status_of(finish);
        let response = self.object(status, Value::Array(output), Some(usage));
        let kind =
            if status == "incomplete" && self.incomplete_event { "response.incomplete" } else { "response.completed" };
        out.push_str(&self.event(kind, json!({"response": response})));
        out
    }

    /// The `error` event that ends a stream that broke off.
    pub fn error(&mut self, err: &ApiError) -> String {
        let body = err.body();
        let e = &body["error"];
        self.event("error", json!({"code": e["code"], "message": e["message"], "param": e["param"]}))
    }
}

/// A token's log probability as a delta event shows it: its name, value and alternatives, no bytes.
fn without_bytes(entry: &Value) -> Value {
    let alternatives: Vec<Value> = entry["top_logprobs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| json!({"token": t["token"], "logprob": t["logprob"]}))
        .collect();
    json!({"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": alternatives})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop() -> Finish {
        Finish { reason: "stop".into(), stop_reason: Value::Null }
    }

    #[test]
    fn what_needs_state_or_parsers_is_refused_by_name() {
        let err = |body: Value| check(&body).unwrap_err().to_string();
        assert!(check(&json!({"input": "hi", "store": true, "truncation": "disabled", "include": []})).is_ok());
        assert!(err(json!({"input": "hi", "n": 2})).contains("`n`"));
        assert!(err(json!({"input": "hi", "previous_response_id": "resp_1"})).contains("`previous_response_id`"));
        assert!(err(json!({"input": "hi", "truncation": "auto"})).contains("`truncation`"));
        assert!(err(json!({"input": "hi", "reasoning": {"effort": "low"}})).contains("`reasoning`"));
        assert!(check(&json!({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3})).is_ok());
        assert!(err(json!({"input": "hi", "include": ["reasoning.encrypted_content"]})).contains("`include`"));
        assert!(err(json!({"input": "hi", "include": "message.output_text.logprobs"})).contains("`include`"));
        assert!(err(json!({"input": "hi", "background": true})).contains("`background`"));
        let call = json!({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": "1"}]});
        assert!(err(call).contains("`input[1]` is a `function_call_output` item"));
        let image = json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]});
        assert!(err(image).contains("`input[0].content[0]` is an `input_image` part"));
    }

    #[test]
    fn text_format_becomes_the_workers_constraint() {
        let none = |_: &Value| Ok(None);
        let schema = json!({"type": "object"});
        let body = json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}});
        assert_eq!(constraint(&body, none).unwrap(), Some(Constraint::JsonSchema(schema.to_string())));
        let body = json!({"text": {"format": {"type": "json_object"}}});
        assert_eq!(constraint(&body, none).unwrap(), Some(Constraint::JsonObject));
        assert_eq!(constraint(&json!({"text": {"format": {"type": "text"}}}), none).unwrap(), None);
        let both = json!({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}});
        assert!(constraint(&both, none).is_err());
    }

    #[test]
    fn a_whole_response_is_one_assistant_message_with_its_usage() {
        let echo = ResponsesEcho::from_request(&json!({"input": "hi", "instructions": "Be brief."}));
        let shape = ResponsesShape::new("k1", 7, "m".into(), echo, false);
        let usage = Usage { prompt_tokens: 5, completion_tokens: 3, cached_tokens: 2 };
        let body = shape.body("Hello", Value::Null, &stop(), usage);
        assert_eq!((body["object"].as_str(), body["status"].as_str()), (Some("response"), Some("completed")));
        assert_eq!(body["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(body["output"][0]["role"], "assistant");
        assert_eq!(body["instructions"], "Be brief.");
        assert_eq!(body["usage"]["input_tokens_details"]["cached_tokens"], 2);
        assert_eq!(body["usage"]["total_tokens"], 8);
        let cut = shape.body("", Value::Null, &Finish { reason: "length".into(), stop_reason: Value::Null }, usage);
        assert_eq!(cut["status"], "incomplete");
        assert_eq!(cut["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(cut["output"][0]["content"], json!([]));
    }

    #[test]
    fn a_stream_is_numbered_events_that_open_on_the_first_text() {
        let echo = ResponsesEcho::from_request(&json!({"input": "hi"}));
        let mut shape = ResponsesShape::new("k2", 7, "m".into(), echo, true);
        let mut all = shape.opening();
        assert_eq!(shape.delta("", Value::Null), "", "no text yet, no message");
        all.push_str(&shape.delta("Hel", Value::Null));
        all.push_str(&shape.delta("lo", Value::Null));
        let usage = Usage { prompt_tokens: 5, completion_tokens: 3, cached_tokens: 0 };
        all.push_str(&shape.closing(&Finish { reason: "length".into(), stop_reason: Value::Null }, usage, Value::Null));
        let kinds: Vec<&str> = all.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete",
            ]
        );
        let data: Vec<Value> =
            all.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
        for (i, d) in data.iter().enumerate() {
            assert_eq!(d["sequence_number"], i as u64);
        }
        let last = &data[9]["response"];
        assert_eq!(
            (last["status"].as_str(), last["output"][0]["content"][0]["text"].as_str()),
            (Some("incomplete"), Some("Hello"))
        );
        let mut quiet = ResponsesShape::new("k3", 7, "m".into(), ResponsesEcho::from_request(&json!({})), false);
        let end = quiet.closing(&stop(), usage, Value::Null);
        assert!(end.starts_with("event: response.completed\n") && end.contains("\"output\":[]"));
    }

    #[test]
    fn logprobs_ride_with_the_text_and_the_finished_message_lists_them_all() {
        let entry = |token: &str| json!({"token": token, "logprob": -0.5, "bytes": [1], "top_logprobs": [{"token": token, "logprob": -0.5, "bytes": [1]}]});
        let mut echo = ResponsesEcho::from_request(&json!({"input": "hi"}));
        echo.set_top_logprobs(Some(1));
        let usage = Usage { prompt_tokens: 5, completion_tokens: 3, cached_tokens: 0 };
        let whole = ResponsesShape::new("k4", 7, "m".into(), echo.clone(), false);
        let body = whole.body("ab", json!([entry("a"), entry("b")]), &stop(), usage);
        assert_eq!(body["top_logprobs"], 1);
        assert_eq!(body["output"][0]["content"][0]["logprobs"][1], entry("b"));

        let mut shape = ResponsesShape::new("k5", 7, "m".into(), echo, false);
        let mut all = shape.opening();
        all.push_str(&shape.delta("a", json!([entry("a")])));
        all.push_str(&shape.delta("b", json!([entry("b")])));
        all.push_str(&shape.closing(&stop(), usage, json!([entry("</s>")])));
        let data: Vec<Value> =
            all.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
        let delta = data.iter().find(|d| d["type"] == "response.output_text.delta").unwrap();
        assert_eq!(
            delta["logprobs"],
            json!([{"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]}]),
            "a delta's logprobs carry no bytes"
        );
        let done = data.iter().find(|d| d["type"] == "response.content_part.done").unwrap();
        assert_eq!(done["part"]["logprobs"], json!([entry("a"), entry("b"), entry("</s>")]));
        let last = data.last().unwrap();
        assert_eq!(last["response"]["output"][0]["content"][0]["logprobs"], done["part"]["logprobs"]);
        let text_done = data.iter().find(|d| d["type"] == "response.output_text.done").unwrap();
        assert_eq!(text_done["logprobs"], json!([]), "as vLLM's server sends it");
    }
}
