//! A chat request turned into what the chat template sees, as SGLang turns it (0.5.23:
//! `entrypoints/openai/serving_chat.py` `_apply_jinja_template`, the request's pydantic models in
//! `protocol.py`, and `parser/jinja_template_utils.py`).
//!
//! SGLang renders the same template as vLLM but hands it different messages, so the prompt differs
//! wherever the two disagree, and a prompt that differs earns no cache credit:
//! - a string `content` stays a string (vLLM wraps it in a text part for templates that loop over
//!   content, so a template's `| trim` on strings sees it only on SGLang), and `null` content is empty;
//! - each message is what its pydantic model keeps: a user message only its role and content, other
//!   roles their declared fields, every field left `null` dropped; `developer` stays `developer`;
//! - list content is flattened by SGLang's own content-format detection, text parts joined with a
//!   space for string templates; a tool message's text parts become one string;
//! - tool calls' arguments are parsed from their JSON strings, each call dumped as
//!   `{id, index, type, function: {name, arguments}}`;
//! - tools reach the template only when `tool_choice` is not `none` (a named choice keeps that tool),
//!   each dumped with `defer_loading` and the function's fields in the client's order;
//! - a final assistant message is continued (`continue_final_message`: its text is tokenized on its
//!   own and appended after the generation prompt) or else turned into a user message;
//! - `add_generation_prompt` is always on and a request's own `chat_template` is ignored (SGLang's
//!   chat completions read neither), and the rendered prompt is tokenized without special tokens.

use serde_json::{json, Map, Value};

use crate::template::ContentFormat;
use crate::TokenizeError;

/// Fields a non-user message keeps, in the order SGLang's model declares them.
const GENERIC_FIELDS: [&str; 8] =
    ["content", "tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools", "prefix"];
/// A tool function's fields; `strict` and `defer_loading` are dropped when unset.
const FUNCTION_FIELDS: [&str; 5] = ["description", "name", "parameters", "strict", "defer_loading"];

/// What SGLang renders for a chat request: the messages the template sees, and the final assistant
/// text it appends as token ids after the rendered prompt. (The tools come from [`tools`], which
/// the caller needs first, to pick the template.)
#[derive(Debug, Clone, PartialEq)]
pub struct SglangChat {
    /// The messages, as the template sees them.
    pub messages: Vec<Value>,
    /// The final assistant message's text when the request continues it.
    pub assistant_prefix: Option<String>,
}

fn invalid(message: String) -> TokenizeError {
    TokenizeError::Template(message)
}

/// A tool as SGLang's `Tool.model_dump()` writes it.
fn tool(t: &Value, i: usize) -> Result<Value, TokenizeError> {
    let function = t
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(format!("tools[{i}] has no `function` object")))?;
    if !function.get("name").is_some_and(Value::is_string) {
        return Err(invalid(format!("tools[{i}].function has no string `name`")));
    }
    let defer = t.get("defer_loading").cloned().unwrap_or(Value::Null);
    let mut declared: Map<String, Value> = Map::new();
    for field in FUNCTION_FIELDS {
        let mut v = function.get(field).cloned().unwrap_or(Value::Null);
        if field == "defer_loading" && v.is_null() {
            v = defer.clone();
        }
        if v.is_null() && matches!(field, "strict" | "defer_loading") {
            continue;
        }
        declared.insert(field.to_owned(), v);
    }
    // The client's key order first, then the declared fields it left out.
    let mut ordered = Map::new();
    for key in function.keys() {
        if let Some(v) = declared.get(key) {
            ordered.insert(key.clone(), v.clone());
        }
    }
    for (k, v) in declared {
        if !ordered.contains_key(&k) {
            ordered.insert(k, v);
        }
    }
    let kind = t.get("type").cloned().filter(|v| !v.is_null()).unwrap_or_else(|| Value::from("function"));
    Ok(json!({"type": kind, "function": Value::Object(ordered), "defer_loading": defer}))
}

/// The tools the template sees: none for `tool_choice: "none"`, only the named one for a named
/// choice, else all of them.
pub fn tools(body: &Value) -> Result<Value, TokenizeError> {
    let Some(list) = body.get("tools").and_then(Value::as_array).filter(|l| !l.is_empty()) else {
        return Ok(Value::Null);
    };
    let named = match body.get("tool_choice") {
        Some(Value::String(s)) if s == "none" => return Ok(Value::Null),
        Some(choice @ Value::Object(_)) => choice["function"]["name"].as_str(),
        _ => None,
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if named.is_none_or(|n| t["function"]["name"].as_str() == Some(n)) {
            out.push(tool(t, i)?);
        }
    }
    Ok(if out.is_empty() { Value::Null } else { Value::Array(out) })
}

/// A tool call as `ToolCall.model_dump()` writes it, its JSON arguments parsed (SGLang refuses
/// arguments that are not a JSON object).
fn tool_call(call: &Value, m: usize) -> Result<Value, TokenizeError> {
    let f = call.get("function").cloned().unwrap_or(Value::Null);
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => v,
            _ => return Err(invalid(format!("messages[{m}]: tool call arguments must be a JSON object"))),
        },
        Some(v) => v.clone(),
        None => Value::Null,
    };
    Ok(json!({
        "id": call.get("id").cloned().unwrap_or(Value::Null),
        "index": call.get("index").cloned().unwrap_or(Value::Null),
        "type": "function",
        "function": {"name": f.get("name").cloned().unwrap_or(Value::Null), "arguments": arguments},
    }))
}

/// List content as SGLang hands it to a template of `format`.
fn list_content(parts: &[Value], format: ContentFormat) -> Value {
    let text = |p: &Value| {
        matches!(p.get("type").and_then(Value::as_str), Some("text" | "input_text"))
            .then(|| p.get("text").and_then(Value::as_str).unwrap_or_default().to_owned())
    };
    if format != ContentFormat::OpenAi {
        return Value::from(parts.iter().filter_map(text).collect::<Vec<_>>().join(" "));
    }
    let out = parts
        .iter()
        .filter_map(|p| match p.get("type").and_then(Value::as_str)? {
            "image_url" | "input_image" => Some(json!({"type": "image"})),
            "video_url" => Some(json!({"type": "video"})),
            "audio_url" => Some(json!({"type": "audio"})),
            "tool_reference" => Some(json!({"type": "tool_reference", "name": p.get("name").cloned()?})),
            _ => text(p).map(|t| json!({"type": "text", "text": t})),
        })
        .collect();
    Value::Array(out)
}

/// One message as the template sees it.
fn message(m: &Value, i: usize, format: ContentFormat) -> Result<Value, TokenizeError> {
    let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
    let role = if role == "user" { role.to_owned() } else { role.to_lowercase() };
    let mut out = Map::new();
    out.insert("role".into(), Value::from(role.as_str()));
    let fields: &[&str] = if role == "user" { &["content"] } else { &GENERIC_FIELDS };
    for &field in fields {
        let v = match (field, m.get(field)) {
            ("content", None | Some(Value::Null)) => Value::from(""),
            ("content", Some(Value::Array(parts))) => list_content(parts, format),
            ("tool_calls", Some(Value::Array(calls))) => {
                Value::Array(calls.iter().map(|c| tool_call(c, i)).collect::<Result<_, _>>()?)
            }
            ("tools", Some(Value::Array(list))) => {
                Value::Array(list.iter().enumerate().map(|(j, t)| tool(t, j)).collect::<Result<_, _>>()?)
            }
            (_, None | Some(Value::Null)) => continue,
            (_, Some(v)) => v.clone(),
        };
        out.insert(field.to_owned(), v);
    }
    // A tool result sent as text parts is one string to the template.
    if role == "tool" {
        if let Some(Value::Array(parts)) = out.get("content") {
            if parts.iter().all(|p| p.is_string() || p.get("type").and_then(Value::as_str) == Some("text")) {
                let joined: Vec<&str> = parts
                    .iter()
                    .map(|p| p.as_str().or_else(|| p.get("text").and_then(Value::as_str)).unwrap_or(""))
                    .collect();
                out.insert("content".into(), Value::from(joined.join(" ")));
            }
        }
    }
    Ok(Value::Object(out))
}

/// The messages and continued assistant text SGLang renders for a chat `body`, the template's
/// content format being `format`.
pub fn chat(body: &Value, format: ContentFormat) -> Result<SglangChat, TokenizeError> {
    let messages = body.get("messages").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    let mut out: Vec<Value> =
        messages.iter().enumerate().map(|(i, m)| message(m, i, format)).collect::<Result<_, _>>()?;
    let mut assistant_prefix = None;
    let last_text = out
        .last()
        .filter(|m| m["role"] == "assistant")
        .and_then(|m| m.get("content").and_then(Value::as_str))
        .map(str::to_owned);
    if let Some(text) = last_text {
        if body.get("continue_final_message").and_then(Value::as_bool).unwrap_or(false) {
            out.pop();
            assistant_prefix = Some(text);
        } else if let Some(last) = out.last_mut() {
            *last = json!({"role": "user", "content": text});
        }
    }
    Ok(SglangChat { messages: out, assistant_prefix })
}

/// The template's keyword arguments besides messages and tools: the generation prompt always,
/// `reasoning_effort` when set, then `chat_template_kwargs` as sent.
pub fn template_kwargs(body: &Value) -> Map<String, Value> {
    let mut kwargs = Map::new();
    kwargs.insert("add_generation_prompt".into(), Value::from(true));
    if let Some(effort) = body.get("reasoning_effort").filter(|v| !v.is_null()) {
        kwargs.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(user) = body.get("chat_template_kwargs").and_then(Value::as_object) {
        kwargs.extend(user.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    kwargs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}, "description": "d", "extra": 1}})
    }

    #[test]
    fn string_content_stays_a_string_and_messages_keep_only_their_models_fields() {
        let body = json!({"messages": [
            {"role": "user", "content": "  hi  ", "name": "alice"},
            {"role": "assistant", "content": null, "reasoning": "r", "reasoning_content": "rc"},
            {"role": "Developer", "content": "rules"},
            {"role": "user", "content": "go"}]});
        let c = chat(&body, ContentFormat::OpenAi).unwrap();
        assert_eq!(
            c.messages,
            vec![
                json!({"role": "user", "content": "  hi  "}),
                json!({"role": "assistant", "content": "", "reasoning_content": "rc"}),
                json!({"role": "developer", "content": "rules"}),
                json!({"role": "user", "content": "go"}),
            ]
        );
        assert_eq!(tools(&body).unwrap(), Value::Null);
        assert_eq!(c.assistant_prefix, None);
    }

    #[test]
    fn list_content_follows_the_templates_format() {
        let parts = json!([{"type": "text", "text": "a", "cache_control": {}}, {"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "b"}]);
        let body = json!({"messages": [{"role": "user", "content": parts}]});
        let openai = chat(&body, ContentFormat::OpenAi).unwrap();
        assert_eq!(
            openai.messages[0]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}])
        );
        assert_eq!(chat(&body, ContentFormat::String).unwrap().messages[0]["content"], "a b");
        let tool = json!({"messages": [{"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]});
        assert_eq!(chat(&tool, ContentFormat::OpenAi).unwrap().messages[0]["content"], "x y");
    }

    #[test]
    fn tools_are_dumped_as_sglangs_models_and_dropped_for_tool_choice_none() {
        let body = json!({"messages": [], "tools": [weather()]});
        let dumped = serde_json::to_string(&tools(&body).unwrap()).unwrap();
        assert_eq!(
            dumped,
            r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"},"description":"d"},"defer_loading":null}]"#
        );
        let none = json!({"messages": [], "tools": [weather()], "tool_choice": "none"});
        assert_eq!(tools(&none).unwrap(), Value::Null);
        let other = json!({"messages": [], "tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "x"}}});
        assert_eq!(tools(&other).unwrap(), Value::Null);
        let bare = json!({"messages": [], "tools": [{"function": {"name": "f"}}]});
        assert_eq!(
            serde_json::to_string(&tools(&bare).unwrap()).unwrap(),
            r#"[{"type":"function","function":{"name":"f","description":null,"parameters":null},"defer_loading":null}]"#
        );
    }

    #[test]
    fn tool_call_arguments_are_parsed_and_bad_ones_refused() {
        let call = |args: &str| {
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"arguments": args, "name": "f"}}]}, {"role": "user", "content": "ok"}]})
        };
        let c = chat(&call(r#"{"city": "Paris"}"#), ContentFormat::OpenAi).unwrap();
        assert_eq!(
            serde_json::to_string(&c.messages[0]["tool_calls"]).unwrap(),
            r#"[{"id":"c1","index":null,"type":"function","function":{"name":"f","arguments":{"city":"Paris"}}}]"#
        );
        let err = chat(&call("[1]"), ContentFormat::OpenAi).unwrap_err().to_string();
        assert!(err.contains("messages[0]") && err.contains("JSON object"), "{err}");
    }

    #[test]
    fn a_final_assistant_message_is_continued_or_becomes_the_users() {
        let messages = json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}]);
        let plain = chat(&json!({"messages": messages}), ContentFormat::OpenAi).unwrap();
        assert_eq!(plain.messages[1], json!({"role": "user", "content": "partial"}));
        let cont = chat(&json!({"messages": messages, "continue_final_message": true}), ContentFormat::OpenAi).unwrap();
        assert_eq!(cont.messages.len(), 1);
        assert_eq!(cont.assistant_prefix.as_deref(), Some("partial"));
    }
}
