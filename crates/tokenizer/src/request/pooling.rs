//! The pooling routes: embeddings, rerank and SGLang's score. They compute a prompt and generate
//! nothing, so they fill no decode cache worth routing to: the gateway places them by load alone.
//! Their prompt tokens are still real prefill work on the engine that takes them, so they are
//! counted (every input, not just the first).

use serde_json::Value;

use super::{prompt_ids, RequestError};
use crate::{PromptTokenizer, TokenizeError};

fn tokenize_err(e: TokenizeError) -> RequestError {
    RequestError::whole(e.to_string())
}

/// One text or token-id input: a string, or a list of token ids.
fn one_input(
    v: &Value,
    param: &str,
    tokenizer: &dyn PromptTokenizer,
    add_special: bool,
) -> Result<Vec<u32>, RequestError> {
    match v {
        Value::String(s) => tokenizer.encode_prompt(s, add_special).map_err(tokenize_err),
        Value::Array(_) => prompt_ids(v, param, tokenizer),
        _ => Err(RequestError::invalid(param, format!("`{param}` must be a string or a list of token ids"))),
    }
}

/// `POST /v1/embeddings`: `input` is a string, strings, token ids or lists of token ids. Each
/// input's ids, in order.
pub(super) fn embeddings(
    body: &Value,
    tokenizer: &dyn PromptTokenizer,
    add_special: bool,
) -> Result<Vec<Vec<u32>>, RequestError> {
    let input = body.get("input").ok_or_else(|| RequestError::invalid("input", "`input` is required"))?;
    match input {
        Value::Array(items) if items.is_empty() => Err(RequestError::invalid("input", "`input` must not be empty")),
        Value::Array(items) if items[0].is_number() => Ok(vec![prompt_ids(input, "input", tokenizer)?]),
        Value::Array(items) => items.iter().map(|item| one_input(item, "input", tokenizer, add_special)).collect(),
        other => Ok(vec![one_input(other, "input", tokenizer, add_special)?]),
    }
}

/// The text of a rerank document: a string or an object with a string `text`.
fn document_text(doc: &Value, i: usize) -> Result<&str, RequestError> {
    match doc {
        Value::String(s) => Ok(s),
        Value::Object(o) => o.get("text").and_then(Value::as_str).ok_or_else(|| {
            RequestError::invalid(&format!("documents[{i}]"), format!("`documents[{i}]` has no string `text`"))
        }),
        _ => Err(RequestError::invalid(
            &format!("documents[{i}]"),
            format!("`documents[{i}]` must be a string or an object with `text`"),
        )),
    }
}

/// `POST /v1/rerank`: a `query` scored against each of `documents`; the engine encodes each pair.
pub(super) fn rerank(
    body: &Value,
    tokenizer: &dyn PromptTokenizer,
    add_special: bool,
) -> Result<Vec<u32>, RequestError> {
    let query = body
        .get("query")
        .and_then(Value::as_str)
        .ok_or_else(|| RequestError::invalid("query", "`query` must be a string"))?;
    let documents = body
        .get("documents")
        .and_then(Value::as_array)
        .filter(|d| !d.is_empty())
        .ok_or_else(|| RequestError::invalid("documents", "`documents` must be a non-empty array"))?;
    let query = tokenizer.encode_prompt(query, add_special).map_err(tokenize_err)?;
    let mut tokens = Vec::new();
    for (i, doc) in documents.iter().enumerate() {
        tokens.extend_from_slice(&query);
        tokens.extend(tokenizer.encode_prompt(document_text(doc, i)?, false).map_err(tokenize_err)?);
    }
    Ok(tokens)
}

/// SGLang's `POST /v1/score`: `query` (text or token ids) scored with each of `items` (a string,
/// strings, or lists of token ids).
pub(super) fn score(
    body: &Value,
    tokenizer: &dyn PromptTokenizer,
    add_special: bool,
) -> Result<Vec<u32>, RequestError> {
    let query = body.get("query").ok_or_else(|| RequestError::invalid("query", "`query` is required"))?;
    let query = one_input(query, "query", tokenizer, add_special)?;
    let items = body.get("items").ok_or_else(|| RequestError::invalid("items", "`items` is required"))?;
    let items: Vec<&Value> = match items {
        Value::String(_) => vec![items],
        Value::Array(list) if !list.is_empty() => list.iter().collect(),
        _ => return Err(RequestError::invalid("items", "`items` must be a string or a non-empty list")),
    };
    let mut tokens = Vec::new();
    for item in items {
        tokens.extend_from_slice(&query);
        tokens.extend(one_input(item, "items", tokenizer, false)?);
    }
    Ok(tokens)
}
