//! The pooling routes: embeddings, rerank and score. They compute a prompt and generate
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
    // vLLM takes one document as a plain string too.
    let one;
    let documents = match body.get("documents") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(single @ Value::String(_)) => {
            one = [single.clone()];
            &one[..]
        }
        _ => return Err(RequestError::invalid("documents", "`documents` must be a string or a non-empty array")),
    };
    let query = tokenizer.encode_prompt(query, add_special).map_err(tokenize_err)?;
    let mut tokens = Vec::new();
    for (i, doc) in documents.iter().enumerate() {
        tokens.extend_from_slice(&query);
        tokens.extend(tokenizer.encode_prompt(document_text(doc, i)?, false).map_err(tokenize_err)?);
    }
    Ok(tokens)
}

/// `POST /v1/score`, in either server's form: SGLang's `query` (text or token ids) scored with each
/// of `items` (a string, strings, or lists of token ids), or vLLM's two sides (`queries` and
/// `documents` or `items`, `data_1` and `data_2`, `text_1` and `text_2`; each a string or a list,
/// one first text for all pairs or one per pair). Counted as each pair read together.
pub(super) fn score(
    body: &Value,
    tokenizer: &dyn PromptTokenizer,
    add_special: bool,
) -> Result<Vec<u32>, RequestError> {
    if body.get("query").is_none() {
        if let Some((first, second)) =
            VLLM_SCORE_SIDES.iter().find(|(a, b)| body.get(*a).is_some() && body.get(*b).is_some())
        {
            return vllm_score(body, first, second, tokenizer, add_special);
        }
    }
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

/// vLLM's names for a score request's two sides, in the order its server tries them.
const VLLM_SCORE_SIDES: &[(&str, &str)] =
    &[("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")];

/// The texts of one side of vLLM's score request: a string or a list. Other items (multimodal
/// content) count no tokens here; the engine reads them.
fn side_texts<'a>(body: &'a Value, key: &str) -> Result<Vec<&'a str>, RequestError> {
    match body.get(key) {
        Some(Value::String(s)) => Ok(vec![s.as_str()]),
        Some(Value::Array(list)) if !list.is_empty() => {
            Ok(list.iter().map(|v| v.as_str().unwrap_or_default()).collect())
        }
        Some(Value::Object(_)) => Ok(vec![""]),
        _ => Err(RequestError::invalid(key, format!("`{key}` must be a string or a non-empty list"))),
    }
}

fn vllm_score(
    body: &Value,
    first: &str,
    second: &str,
    tokenizer: &dyn PromptTokenizer,
    add_special: bool,
) -> Result<Vec<u32>, RequestError> {
    let queries = side_texts(body, first)?;
    let documents = side_texts(body, second)?;
    if queries.len() > 1 && queries.len() != documents.len() {
        return Err(RequestError::invalid(first, "Input lengths must be either 1:1, 1:N or N:N"));
    }
    let mut tokens = Vec::new();
    for (i, document) in documents.iter().enumerate() {
        let query = queries[if queries.len() == 1 { 0 } else { i }];
        tokens.extend(tokenizer.encode_prompt(query, add_special).map_err(tokenize_err)?);
        tokens.extend(tokenizer.encode_prompt(document, false).map_err(tokenize_err)?);
    }
    Ok(tokens)
}
