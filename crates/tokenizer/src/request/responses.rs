//! OpenAI's Responses API (`POST /v1/responses`): `instructions` and `input` become the chat
//! messages the engine renders (vLLM turns them into a chat conversation the same way), so the
//! prompt is tokenized with the chat template and earns cache credit like a chat request.
//!
//! One difference from chat completions, checked against real vLLM 0.32 in the real-engine suite:
//! vLLM tokenizes a rendered Responses prompt with `add_special_tokens` on (its Responses
//! request builds its tokenizer parameters without the chat request's `False`), so the tokenizer's
//! BOS comes before the template's own. The chat body built here asks for the same.
//!
//! SGLang (0.5.23, `serving_responses.py` `_construct_input_messages`) builds its conversation
//! otherwise, checked in the same suite: a `developer` item becomes a system message labelled
//! "Developer instructions:", every system text is gathered into one leading system message joined
//! by blank lines, list content stays a list of text parts, consecutive assistant messages merge,
//! and the tools are not rendered; its chat rendering then adds no special tokens.

use serde_json::{json, Value};

use super::RequestError;
use crate::Rendering;

/// The label SGLang puts before a `developer` item's text.
const SGLANG_DEVELOPER_LABEL: &str = "Developer instructions:";

/// The text of a content part the engine puts in the prompt (`input_text`, `output_text`, `text`).
fn part_text(part: &Value) -> Option<&str> {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") | None => part.get("text").and_then(Value::as_str),
        _ => None,
    }
}

/// One `input` item's role and content (a string or a list of parts), or `None` for items that are
/// not messages (tool calls and their outputs, reasoning): they change the prompt's tail, not its
/// shared prefix.
fn message_item(item: &Value, i: usize) -> Result<Option<(&str, &Value)>, RequestError> {
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
    match item.get("content") {
        Some(content @ (Value::String(_) | Value::Array(_))) => Ok(Some((role, content))),
        _ => Err(bad()),
    }
}

/// One `input` item as vLLM's chat message, or `None` for items that are not messages.
fn message(item: &Value, i: usize) -> Result<Option<Value>, RequestError> {
    let Some((role, content)) = message_item(item, i)? else { return Ok(None) };
    let content = match content {
        Value::Array(parts) => parts.iter().filter_map(part_text).collect::<Vec<_>>().join(""),
        other => other.as_str().unwrap_or_default().to_owned(),
    };
    // The Responses API's `developer` role is the chat template's system role.
    let role = if role == "developer" { "system" } else { role };
    Ok(Some(json!({"role": role, "content": content})))
}

/// A Responses request's `input`.
enum Input<'a> {
    Text(&'a str),
    Items(&'a [Value]),
}

/// A request's `instructions` and `input`, checked.
fn instructions_and_input(body: &Value) -> Result<(Option<&str>, Input<'_>), RequestError> {
    let instructions = match body.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => return Err(RequestError::invalid("instructions", "`instructions` must be a string")),
    };
    let input = match body.get("input") {
        Some(Value::String(s)) => Input::Text(s),
        Some(Value::Array(items)) if !items.is_empty() => Input::Items(items),
        Some(_) => return Err(RequestError::invalid("input", "`input` must be a string or a non-empty list of items")),
        None => return Err(RequestError::invalid("input", "`input` is required")),
    };
    Ok((instructions, input))
}

/// A chat-completions body carrying the same conversation, for the chat template, as the engine
/// whose `rendering` is reproduced builds it.
pub(super) fn as_chat(body: &Value, rendering: Rendering) -> Result<Value, RequestError> {
    if rendering == Rendering::Sglang {
        return as_sglang_chat(body);
    }
    let (instructions, input) = instructions_and_input(body)?;
    let mut messages = Vec::new();
    // vLLM leaves empty instructions out.
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        messages.push(json!({"role": "system", "content": text}));
    }
    let mut continue_final = false;
    match input {
        Input::Text(text) => messages.push(json!({"role": "user", "content": text})),
        Input::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                messages.extend(message(item, i)?);
            }
            continue_final = items.last().is_some_and(is_partial);
        }
    }
    let mut chat = json!({"messages": messages, "add_special_tokens": true});
    if continue_final {
        // vLLM continues a last message left unfinished instead of opening a new turn.
        chat["continue_final_message"] = Value::Bool(true);
        chat["add_generation_prompt"] = Value::Bool(false);
    }
    for key in ["tools", "chat_template_kwargs"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            chat[key] = v.clone();
        }
    }
    Ok(chat)
}

/// Whether an `input` item is a message (or reasoning) the client left unfinished, which vLLM
/// continues rather than answering (`status` `in_progress` or `incomplete`).
fn is_partial(item: &Value) -> bool {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    matches!(kind, "message" | "reasoning")
        && matches!(item.get("status").and_then(Value::as_str), Some("in_progress" | "incomplete"))
}

/// One `input` message item as SGLang turns it into a chat message (`None`: not a message).
fn sglang_message(item: &Value, i: usize) -> Result<Option<Value>, RequestError> {
    let Some((role, content)) = message_item(item, i)? else { return Ok(None) };
    let mut content = match content {
        Value::Array(parts) => Value::Array(
            parts
                .iter()
                .map(|p| match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text") => {
                        json!({"type": "text", "text": p.get("text").cloned().unwrap_or_else(|| Value::from(""))})
                    }
                    _ => p.clone(),
                })
                .collect(),
        ),
        other => other.clone(),
    };
    let role = if role == "developer" {
        match &mut content {
            Value::String(s) => *s = format!("{SGLANG_DEVELOPER_LABEL}\n{s}"),
            Value::Array(parts) => match parts.iter_mut().find(|p| p.get("text").is_some_and(Value::is_string)) {
                Some(p) => {
                    p["text"] = Value::from(format!("{SGLANG_DEVELOPER_LABEL}\n{}", p["text"].as_str().unwrap_or("")))
                }
                None => parts.insert(0, json!({"type": "input_text", "text": SGLANG_DEVELOPER_LABEL})),
            },
            _ => {}
        }
        "system"
    } else {
        role
    };
    Ok(Some(json!({"role": role, "content": content})))
}

/// [`as_chat`] as SGLang builds the conversation.
fn as_sglang_chat(body: &Value) -> Result<Value, RequestError> {
    let (instructions, input) = instructions_and_input(body)?;
    let mut messages: Vec<Value> = Vec::new();
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        messages.push(json!({"role": "system", "content": text}));
    }
    match input {
        Input::Text(text) => messages.push(json!({"role": "user", "content": text})),
        Input::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                let Some(m) = sglang_message(item, i)? else { continue };
                // Consecutive assistant text is one turn.
                if let (Some(prev), "assistant") = (messages.last_mut(), m["role"].as_str().unwrap_or("")) {
                    if prev["role"] == "assistant" {
                        if let (Some(a), Some(b)) = (prev["content"].as_str(), m["content"].as_str()) {
                            let sep = if a.is_empty() || b.is_empty() { "" } else { "\n\n" };
                            prev["content"] = Value::from(format!("{a}{sep}{b}"));
                            continue;
                        }
                    }
                }
                messages.push(m);
            }
        }
    }
    // One leading system message holds every system text.
    let mut system = Vec::new();
    let mut rest = Vec::new();
    for m in messages {
        if m["role"] != "system" {
            rest.push(m);
            continue;
        }
        match &m["content"] {
            Value::String(s) => system.push(s.clone()),
            Value::Array(parts) => system.extend(parts.iter().filter_map(|p| p["text"].as_str().map(str::to_owned))),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if !system.is_empty() {
        out.push(json!({"role": "system", "content": system.join("\n\n")}));
    }
    out.extend(rest);
    Ok(json!({"messages": out, "tool_choice": "none"}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_gathers_system_text_labels_developers_and_keeps_parts() {
        let body = json!({"instructions": "Be terse.", "input": [
            {"type": "message", "role": "developer", "content": "House rules."},
            {"role": "user", "content": [{"type": "input_text", "text": "One"}]},
            {"role": "assistant", "content": "Un"},
            {"role": "assistant", "content": "Deux"},
            {"type": "function_call", "name": "f", "arguments": "{}"},
            {"role": "user", "content": "Two"}]});
        let chat = as_chat(&body, Rendering::Sglang).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be terse.\n\nDeveloper instructions:\nHouse rules."},
                {"role": "user", "content": [{"type": "text", "text": "One"}]},
                {"role": "assistant", "content": "Un\n\nDeux"},
                {"role": "user", "content": "Two"}])
        );
        let vllm = as_chat(&body, Rendering::Vllm).unwrap();
        assert_eq!(vllm["messages"][1], json!({"role": "system", "content": "House rules."}));
        assert_eq!(vllm["add_special_tokens"], true);
    }

    #[test]
    fn vllm_continues_an_unfinished_last_message_and_drops_empty_instructions() {
        let body = json!({"instructions": "", "chat_template_kwargs": {"x": 1}, "input": [
            {"role": "user", "content": "Say hi"},
            {"type": "message", "role": "assistant", "status": "incomplete", "content": "H"}]});
        let chat = as_chat(&body, Rendering::Vllm).unwrap();
        assert_eq!(chat["messages"][0], json!({"role": "user", "content": "Say hi"}));
        assert_eq!(
            (chat["continue_final_message"].clone(), chat["add_generation_prompt"].clone()),
            (json!(true), json!(false))
        );
        assert_eq!(chat["chat_template_kwargs"], json!({"x": 1}));
        let done = json!({"input": [{"role": "user", "content": "Say hi"},
                                    {"role": "assistant", "status": "completed", "content": "Hi"}]});
        assert!(as_chat(&done, Rendering::Vllm).unwrap().get("continue_final_message").is_none());
    }
}
