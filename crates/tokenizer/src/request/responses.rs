//! OpenAI's Responses API (`POST /v1/responses`): `instructions` and `input` become the chat
//! messages the engine renders (vLLM turns them into a chat conversation the same way), so the
//! prompt is tokenized with the chat template and earns cache credit like a chat request.
//!
//! One difference from chat completions, checked against real vLLM 0.32 in the real-engine suite:
//! vLLM tokenizes a rendered Responses prompt with `add_special_tokens` on (its Responses
//! request builds its tokenizer parameters without the chat request's `False`), so the tokenizer's
//! BOS comes before the template's own. The chat body built here asks for the same.

use serde_json::{json, Value};

use super::RequestError;

/// The text of a content part the engine puts in the prompt (`input_text`, `output_text`, `text`).
fn part_text(part: &Value) -> Option<&str> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") | None => part.get("text").and_then(Value::as_str),
        _ => None,
    }
}

/// One `input` item as a chat message, or `None` for items that are not messages (tool calls and
/// their outputs, reasoning): they change the prompt's tail, not its shared prefix.
fn message(item: &Value, i: usize) -> Result<Option<Value>, RequestError> {
    let bad = || {
        RequestError::invalid(
            &format!("input[{i}]"),
            format!("`input[{i}]` must be a message with a string `role` and a string or list `content`"),
        )
    };
    if !item.is_object() {
        return Err(bad());
    }
    if item.get("type").and_then(Value::as_str).is_some_and(|t| t != "message") {
        return Ok(None);
    }
    let role = item.get("role").and_then(Value::as_str).ok_or_else(bad)?;
    let content = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts.iter().filter_map(part_text).collect::<Vec<_>>().join(""),
        _ => return Err(bad()),
    };
    // The Responses API's `developer` role is the chat template's system role.
    let role = if role == "developer" { "system" } else { role };
    Ok(Some(json!({"role": role, "content": content})))
}

/// A chat-completions body carrying the same conversation, for the chat template.
pub(super) fn as_chat(body: &Value) -> Result<Value, RequestError> {
    let mut messages = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(RequestError::invalid("instructions", "`instructions` must be a string")),
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                messages.extend(message(item, i)?);
            }
        }
        Some(_) => return Err(RequestError::invalid("input", "`input` must be a string or a non-empty list of items")),
        None => return Err(RequestError::invalid("input", "`input` is required")),
    }
    let mut chat = json!({"messages": messages, "add_special_tokens": true});
    if let Some(tools) = body.get("tools") {
        chat["tools"] = tools.clone();
    }
    Ok(chat)
}
