//! A chat request turned into what the chat template sees, as vLLM turns it (`renderers/chat_utils.py`
//! `parse_chat_messages`, `renderers/hf.py` `safe_apply_chat_template`, and the request's
//! `build_chat_params`).
//!
//! The template never sees the request's messages as sent. vLLM rebuilds each one: text parts become
//! one newline-joined string (or a list of `{"type": "text", "text": ...}` for templates that loop over
//! content), `null` content becomes empty, only known keys survive, tool-call arguments are parsed from
//! their JSON strings, tool results are flattened, and `developer` messages become `system` for
//! templates that do not know the role. Tools are rebuilt in their declared field order. Whatever
//! kvgate renders differently is a different prompt, and a different prompt earns no cache credit.

use serde_json::{json, Map, Value};

use crate::template::ContentFormat;

/// Part types vLLM reads as text, and the field holding the text.
const TEXT_PARTS: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];
/// Part types that carry media: the template sees only their modality.
const MEDIA_PARTS: [(&str, &str); 11] = [
    ("image_url", "image"),
    ("input_image", "image"),
    ("image_pil", "image"),
    ("image_embeds", "image"),
    ("audio_url", "audio"),
    ("input_audio", "audio"),
    ("audio_embeds", "audio"),
    ("video_url", "video"),
    ("video_embeds", "video"),
    ("file", "file"),
    ("prompt_embeds", "prompt_embeds"),
];
/// Keys of OpenAI content parts; any others are extra fields vLLM passes on to the template.
const KNOWN_PART_FIELDS: [&str; 18] = [
    "type",
    "text",
    "refusal",
    "thinking",
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
    "file",
    "prompt_embeds",
    "data",
    "uuid",
    "name",
];
/// Claude Code's per-request attribution line, which vLLM drops from system text (it would defeat
/// prefix caching).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The messages a template renders, built from a request's `messages`.
pub fn conversation(messages: &[Value], format: ContentFormat, knows_developer: bool) -> Vec<Value> {
    let mut out: Vec<Value> = messages.iter().map(|m| message(m, format)).collect();
    for m in &mut out {
        postprocess_tool_calls(m);
    }
    let has_developer = out.iter().any(|m| m.get("role").and_then(Value::as_str) == Some("developer"));
    if has_developer && !knows_developer {
        for m in &mut out {
            if m.get("role").and_then(Value::as_str) == Some("developer") {
                if let Some(obj) = m.as_object_mut() {
                    obj.insert("role".into(), Value::from("system"));
                    obj.shift_remove("tools");
                }
            }
        }
        out = consolidate_system(out);
    }
    out
}

fn extra_fields(part: &Map<String, Value>) -> impl Iterator<Item = (&String, &Value)> {
    part.iter().filter(|(k, _)| !KNOWN_PART_FIELDS.contains(&k.as_str()))
}

/// One content part: a string for the string format, an object for the OpenAI format, or nothing.
fn part(p: &Value, format: ContentFormat) -> Option<Value> {
    let wrap = format == ContentFormat::OpenAi;
    let obj = match p {
        Value::String(s) => {
            return Some(if wrap { json!({"type": "text", "text": s}) } else { Value::from(s.as_str()) })
        }
        Value::Object(obj) => obj,
        _ => return None,
    };
    let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
    if let Some((_, field)) = TEXT_PARTS.iter().find(|(t, _)| *t == kind) {
        let text = obj.get(*field).and_then(Value::as_str)?;
        if !wrap {
            return Some(Value::from(text));
        }
        let mut out = Map::new();
        out.insert("type".into(), Value::from("text"));
        out.insert("text".into(), Value::from(text));
        out.extend(extra_fields(obj).map(|(k, v)| (k.clone(), v.clone())));
        return Some(Value::Object(out));
    }
    if kind == "tool_reference" {
        let name = obj.get("name").and_then(Value::as_str)?;
        return Some(if wrap { json!({"type": "tool_reference", "name": name}) } else { Value::from(name) });
    }
    let modality = MEDIA_PARTS.iter().find(|(t, _)| *t == kind).map(|(_, m)| *m)?;
    // Media have no text to match; the string format drops them (no interleaved placeholders).
    wrap.then(|| {
        let mut out = Map::new();
        out.insert("type".into(), Value::from(modality));
        out.extend(extra_fields(obj).map(|(k, v)| (k.clone(), v.clone())));
        Value::Object(out)
    })
}

fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let strip = |text: &str| -> Option<String> {
        if !text.starts_with(BILLING_HEADER) {
            return Some(text.to_owned());
        }
        let rest = text.split_once('\n').map_or("", |(_, r)| r);
        (!rest.is_empty()).then(|| rest.to_owned())
    };
    parts
        .into_iter()
        .filter_map(|p| match &p {
            Value::String(s) => strip(s).map(Value::from),
            Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("text") => {
                match o.get("text").and_then(Value::as_str) {
                    Some(t) => strip(t).map(|t| {
                        let mut o = o.clone();
                        o.insert("text".into(), Value::from(t));
                        Value::Object(o)
                    }),
                    None => Some(p),
                }
            }
            _ => Some(p),
        })
        .collect()
}

/// A message's content as the template sees it: its parts in the OpenAI format, or their texts
/// joined by newlines in the string format.
fn content_of(content: Option<&Value>, role: &str, format: ContentFormat) -> Value {
    let mut parts = match content {
        // Plain text, nearly every message: the same result as wrapping it as a text part and
        // unwrapping it again below, with one copy of the text instead of three (a long
        // conversation's largest cost before its template is rendered).
        Some(Value::String(s)) if role != "system" || !s.starts_with(BILLING_HEADER) => {
            return match format {
                ContentFormat::OpenAi => json!([{"type": "text", "text": s}]),
                _ => Value::from(s.as_str()),
            };
        }
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(list)) => list.clone(),
        Some(other) => vec![other.clone()],
    };
    if role == "system" {
        parts = strip_billing_header(parts);
    }
    let parsed: Vec<Value> = parts.iter().filter_map(|p| part(p, format)).collect();
    match format {
        ContentFormat::OpenAi => Value::Array(parsed),
        _ => Value::from(parsed.iter().filter_map(Value::as_str).collect::<Vec<_>>().join("\n")),
    }
}

fn message(m: &Value, format: ContentFormat) -> Value {
    let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
    let content = content_of(m.get("content"), role, format);
    let mut out = Map::new();
    out.insert("role".into(), Value::from(role));
    out.insert("content".into(), content);
    match role {
        "assistant" => {
            if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                out.insert("tool_calls".into(), calls.clone());
            }
            if let Some(reasoning) = m.get("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".into(), reasoning.clone());
                out.insert("reasoning_content".into(), reasoning.clone());
            }
        }
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
            // Tool results reach the template as one string unless they hold structured parts.
            if let Some(Value::Array(items)) = out.get("content") {
                let only_text = items.iter().all(|i| i.get("type").and_then(Value::as_str) == Some("text"));
                if only_text {
                    let texts: Vec<&str> = items.iter().filter_map(|i| i.get("text").and_then(Value::as_str)).collect();
                    out.insert("content".into(), Value::from(texts.join("\n")));
                }
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(Value::String(s)) = m.get(key) {
            out.insert(key.into(), Value::from(s.as_str()));
        }
    }
    if role == "developer" {
        out.insert("tools".into(), m.get("tools").cloned().unwrap_or(Value::Null));
    }
    Value::Object(out)
}

/// Tool-call arguments reach templates as objects (the Transformers convention), not JSON strings.
fn postprocess_tool_calls(m: &mut Value) {
    let Some(obj) = m.as_object_mut() else { return };
    if obj.get("role").and_then(Value::as_str) != Some("assistant") {
        return;
    }
    let Some(Value::Array(calls)) = obj.get_mut("tool_calls") else { return };
    if calls.is_empty() {
        obj.shift_remove("tool_calls");
        return;
    }
    for call in calls.iter_mut() {
        *call = declared_order(call);
        let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else { continue };
        let parsed = match function.get("arguments") {
            Some(Value::Object(o)) => Value::Object(o.clone()),
            Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str::<Value>(s) {
                Ok(Value::Object(o)) => Value::Object(o),
                _ => json!({}),
            },
            _ => json!({}),
        };
        function.insert("arguments".into(), parsed);
    }
}

/// `obj` with `fields` first, in that order, then its other keys as they came: what pydantic's
/// validation of a `TypedDict` gives back.
fn reorder(obj: &Map<String, Value>, fields: &[&str]) -> Map<String, Value> {
    let mut out = Map::new();
    for f in fields {
        if let Some(v) = obj.get(*f) {
            out.insert((*f).to_owned(), v.clone());
        }
    }
    for (k, v) in obj {
        if !fields.contains(&k.as_str()) {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

/// A tool call as vLLM's request validation returns it: the OpenAI `TypedDict`s' field order
/// (`id`, `function` {`arguments`, `name`}, `type`; or `custom` {`input`, `name`}).
fn declared_order(call: &Value) -> Value {
    let Some(obj) = call.as_object() else { return call.clone() };
    let custom = obj.get("type").and_then(Value::as_str) == Some("custom");
    let (body, inner): (&str, &[&str]) =
        if custom { ("custom", &["input", "name"]) } else { ("function", &["arguments", "name"]) };
    let mut out = reorder(obj, &["id", body, "type"]);
    if let Some(Value::Object(f)) = out.get(body) {
        let f = reorder(f, inner);
        out.insert(body.to_owned(), Value::Object(f));
    }
    Value::Object(out)
}

/// vLLM merges system messages into one at the front after turning `developer` into `system`.
fn consolidate_system(conversation: Vec<Value>) -> Vec<Value> {
    let mut contents = Vec::new();
    let mut others = Vec::new();
    let mut needed = false;
    for (i, m) in conversation.iter().enumerate() {
        if m.get("role").and_then(Value::as_str) == Some("system") {
            needed |= i > 0 || !contents.is_empty();
            let text = match m.get("content") {
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| p.as_str().or_else(|| p.get("text").and_then(Value::as_str)))
                    .collect::<Vec<_>>()
                    .join("\n"),
                Some(Value::String(s)) => s.clone(),
                _ => String::new(),
            };
            if !text.is_empty() {
                contents.push(text);
            }
        } else {
            others.push(m.clone());
        }
    }
    if !needed {
        return conversation;
    }
    let mut out = vec![json!({"role": "system", "content": contents.join("\n\n")})];
    out.extend(others);
    out
}

/// The request's tools as vLLM hands them to the template: `model_dump()` of its tool models, so
/// `{"type", "function": {"name", "description", "parameters", ["strict"], ["defer_loading"]}}` with
/// nulls for missing descriptions and parameters, and unknown fields dropped.
pub fn tools(body: &Value) -> Option<Vec<Value>> {
    let list = body.get("tools")?.as_array()?;
    Some(
        list.iter()
            .map(|t| {
                let f = t.get("function").cloned().unwrap_or(Value::Null);
                let tool_defer = t.get("defer_loading").filter(|v| !v.is_null()).cloned();
                let mut function = Map::new();
                function.insert("name".into(), f.get("name").cloned().unwrap_or(Value::Null));
                function.insert("description".into(), f.get("description").cloned().unwrap_or(Value::Null));
                function.insert("parameters".into(), f.get("parameters").cloned().unwrap_or(Value::Null));
                if let Some(strict) = f.get("strict").filter(|v| !v.is_null()) {
                    function.insert("strict".into(), strict.clone());
                }
                if let Some(defer) = f.get("defer_loading").filter(|v| !v.is_null()).cloned().or(tool_defer.clone()) {
                    function.insert("defer_loading".into(), defer);
                }
                let mut tool = Map::new();
                tool.insert("type".into(), t.get("type").cloned().unwrap_or_else(|| Value::from("function")));
                tool.insert("function".into(), Value::Object(function));
                if let Some(defer) = tool_defer {
                    tool.insert("defer_loading".into(), defer);
                }
                Value::Object(tool)
            })
            .collect(),
    )
}

/// The template's keyword arguments for a chat request, merged as vLLM merges them: the tools, under
/// the request's `chat_template_kwargs`, under its `add_generation_prompt`, `continue_final_message`,
/// `documents` and `reasoning_effort`. `null` and `"auto"` never override.
pub fn template_kwargs(body: &Value) -> Map<String, Value> {
    let unset = |v: &Value| v.is_null() || v.as_str() == Some("auto");
    let mut kwargs = Map::new();
    kwargs.insert("tools".into(), tools(body).map_or(Value::Null, Value::Array));
    let user = body.get("chat_template_kwargs").and_then(Value::as_object);
    if let Some(user) = user {
        for (k, v) in user {
            if !unset(v) {
                kwargs.insert(k.clone(), v.clone());
            }
        }
    }
    let flag = |key: &str, default: bool| body.get(key).and_then(Value::as_bool).unwrap_or(default);
    kwargs.insert("add_generation_prompt".into(), Value::from(flag("add_generation_prompt", true)));
    kwargs.insert("continue_final_message".into(), Value::from(flag("continue_final_message", false)));
    for key in ["documents", "reasoning_effort"] {
        if let Some(v) = body.get(key).filter(|v| !unset(v)) {
            kwargs.insert(key.into(), v.clone());
        }
    }
    if let Some(effort) = body.get("reasoning_effort").filter(|v| !v.is_null()) {
        if !user.is_some_and(|u| u.contains_key("enable_thinking")) {
            kwargs.insert("enable_thinking".into(), Value::from(effort.as_str() != Some("none")));
        }
    }
    kwargs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain text content takes a short cut; it must give what the same text as one text part
    /// gives, in both formats and for every role (a system message's billing header included).
    #[test]
    fn plain_text_content_is_what_the_same_text_as_a_part_gives() {
        let texts = ["", "hello", "two\nlines ", "x-anthropic-billing-header: a\nkept", "x-anthropic-billing-header"];
        for format in [ContentFormat::String, ContentFormat::OpenAi] {
            for role in ["system", "user", "assistant", "tool", "developer"] {
                for text in texts {
                    let as_part = json!([{"type": "text", "text": text}]);
                    assert_eq!(
                        content_of(Some(&Value::from(text)), role, format),
                        content_of(Some(&as_part), role, format),
                        "{role} {format:?} {text:?}"
                    );
                }
            }
        }
    }

    fn conv(messages: Value, format: ContentFormat) -> Value {
        Value::Array(conversation(messages.as_array().unwrap(), format, false))
    }

    #[test]
    fn text_parts_join_with_newlines_for_string_templates_and_stay_parts_for_openai_ones() {
        let messages = json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": null, "extra": 1}
        ]);
        assert_eq!(
            conv(messages.clone(), ContentFormat::String),
            json!([{"role": "user", "content": "a\nb\nc"}, {"role": "assistant", "content": ""}])
        );
        assert_eq!(
            conv(messages, ContentFormat::OpenAi),
            json!([
                {"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "image"},
                    {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": []}
            ])
        );
    }

    #[test]
    fn tool_calls_get_object_arguments_and_tool_results_become_strings() {
        let messages = json!([
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "assistant", "content": "", "tool_calls": []},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}
        ]);
        let out = conv(messages, ContentFormat::OpenAi);
        assert_eq!(out[0]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert!(out[1].get("tool_calls").is_none());
        assert_eq!(out[2], json!({"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"}));
    }

    #[test]
    fn developer_becomes_system_merged_at_the_front_for_templates_without_it() {
        let messages = json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "d", "tools": []}
        ]);
        let out = conv(messages.clone(), ContentFormat::String);
        assert_eq!(out, json!([{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]));
        let kept = conversation(messages.as_array().unwrap(), ContentFormat::String, true);
        assert_eq!(kept[2], json!({"role": "developer", "content": "d", "tools": []}));
    }

    #[test]
    fn tools_are_rebuilt_in_declared_order_with_nulls() {
        let body = json!({"tools": [{"function": {"parameters": {"type": "object"}, "name": "f", "x": 1}, "type": "function"}]});
        assert_eq!(
            serde_json::to_string(&tools(&body).unwrap()).unwrap(),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":{"type":"object"}}}]"#
        );
        let kw = template_kwargs(
            &json!({"chat_template_kwargs": {"enable_thinking": false, "x": "auto"}, "reasoning_effort": "low"}),
        );
        assert_eq!(kw["enable_thinking"], json!(false));
        assert!(!kw.contains_key("x"));
        assert_eq!(kw["add_generation_prompt"], json!(true));
    }
}
