//! OpenAI's `/v1/embeddings` on gRPC workers whose model pools: each input goes to the worker's
//! `Embed` as the token ids kvgate counted when it parsed the request, every input at once, and
//! the vectors come back shaped as the runtime's own server shapes them (vLLM 0.32's
//! `pooling/embed/serving.py`, SGLang's `serving_embedding.py`).
//!
//! What the protocol's `Embed` cannot carry (a shortened vector, truncation, a priority, another
//! activation) is refused by name, never dropped.

use std::time::Duration;

use base64::Engine as _;
use kvgate_tokenizer::request::Parsed;
use serde::Serialize;
use serde_json::Value;
use tonic::Status;

use crate::error::ApiError;
use crate::grpc_worker::{Embedding, GrpcRuntime, GrpcWorker};

/// Fields an embeddings request may carry, with what each must be when the protocol cannot
/// carry it. `input` and `add_special_tokens` are read when the request is parsed.
const FIELDS: &[&str] = &[
    "input",
    "model",
    "user",
    "encoding_format",
    "add_special_tokens",
    "request_id",
    "rid",
    "dimensions",
    "priority",
    "truncate_prompt_tokens",
    "truncation_side",
    "padding",
    "use_activation",
    "embed_dtype",
    "endianness",
    "cache_salt",
];

/// What a client asked of an embeddings request, besides its inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct EmbedAsk {
    /// The response's `model`.
    model: String,
    /// Vectors as base64 of little-endian float32s rather than lists of numbers.
    base64: bool,
    /// The client's request id (vLLM's `request_id`), for the response's `id`.
    request_id: Option<String>,
}

fn invalid(param: &str, message: String) -> ApiError {
    ApiError::InvalidRequest { param: Some(param.to_owned()), message }
}

/// `field` must be absent or null: `Embed` has nothing to carry it in.
fn refuse_unless_null(body: &serde_json::Map<String, Value>, field: &str, what: &str) -> Result<(), ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(_) => Err(invalid(field, format!("`{field}` is not supported by gRPC workers: {what}"))),
    }
}

impl EmbedAsk {
    /// Reads and checks the request's fields. `served` names the response's model when the
    /// request does not.
    pub(super) fn from_request(body: &Value, served: &str) -> Result<EmbedAsk, ApiError> {
        let Some(fields) = body.as_object() else {
            return Err(ApiError::InvalidRequest {
                param: None,
                message: "the request body must be a JSON object".into(),
            });
        };
        if let Some(unknown) = fields.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(invalid(unknown, format!("`{unknown}` is not an embeddings field kvgate knows")));
        }
        let string = |field: &str| -> Result<Option<String>, ApiError> {
            match fields.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(invalid(field, format!("`{field}` must be a string"))),
            }
        };
        let base64 = match string("encoding_format")?.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(invalid(
                    "encoding_format",
                    format!("`encoding_format` must be \"float\" or \"base64\", not {other:?}"),
                ))
            }
        };
        if !matches!(string("embed_dtype")?.as_deref(), None | Some("float32")) {
            return Err(invalid("embed_dtype", "`embed_dtype` must be \"float32\" on gRPC workers".into()));
        }
        if !matches!(string("endianness")?.as_deref(), None | Some("native" | "little")) {
            return Err(invalid(
                "endianness",
                "`endianness` must be \"little\" (or \"native\", which is little on the machines kvgate runs on) on \
                 gRPC workers"
                    .into(),
            ));
        }
        match fields.get("priority") {
            None | Some(Value::Null) => {}
            Some(p) if p.as_i64() == Some(0) => {}
            Some(_) => {
                return Err(invalid(
                    "priority",
                    "`priority` is not supported by gRPC workers: `Embed` carries none".into(),
                ))
            }
        }
        refuse_unless_null(fields, "dimensions", "`Embed` returns the model's whole vector")?;
        refuse_unless_null(fields, "truncate_prompt_tokens", "`Embed` truncates nothing; shorten the input")?;
        refuse_unless_null(fields, "truncation_side", "`Embed` truncates nothing")?;
        refuse_unless_null(fields, "padding", "`Embed` pads nothing")?;
        refuse_unless_null(fields, "use_activation", "`Embed` applies the model's own pooler as it is")?;
        refuse_unless_null(fields, "cache_salt", "`Embed` carries no cache salt")?;
        string("user")?;
        string("rid")?;
        Ok(EmbedAsk {
            model: string("model")?.unwrap_or_else(|| served.to_owned()),
            base64,
            request_id: string("request_id")?,
        })
    }
}

/// Each input's ids, as parsed: `None` when the inputs' lengths do not add up to the ids the
/// parse kept (a parser bug, answered as an error rather than a wrong vector or a panic).
fn inputs(parsed: &Parsed) -> Option<Vec<Vec<u32>>> {
    let mut at = 0usize;
    let mut split = Vec::with_capacity(parsed.input_lengths.len());
    for &n in &parsed.input_lengths {
        let end = at.checked_add(n)?;
        split.push(parsed.tokens.get(at..end)?.to_vec());
        at = end;
    }
    (at == parsed.tokens.len()).then_some(split)
}

/// Every input's embedding, asked for at once (the worker batches them). `request_id` names them
/// on the worker, with the input's index after it.
pub(super) async fn embed_all(
    worker: &GrpcWorker,
    parsed: &Parsed,
    request_id: &str,
    timeout: Duration,
) -> Result<Vec<Embedding>, Status> {
    let Some(split) = inputs(parsed) else {
        return Err(Status::internal(format!(
            "the embeddings inputs' lengths ({} in all) do not match the {} token ids parsed",
            parsed.input_lengths.iter().sum::<usize>(),
            parsed.tokens.len()
        )));
    };
    embed_each(worker, split, request_id, timeout).await
}

/// The embedding of each of `inputs` (token ids), asked for at once; `request_id` names them on
/// the worker, with the input's index after it.
pub(super) async fn embed_each(
    worker: &GrpcWorker,
    inputs: Vec<Vec<u32>>,
    request_id: &str,
    timeout: Duration,
) -> Result<Vec<Embedding>, Status> {
    let asked = inputs.into_iter().enumerate().map(|(i, ids)| worker.embed(format!("{request_id}-{i}"), ids, timeout));
    futures_util::future::try_join_all(asked).await
}

/// One vector as the response carries it.
#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Floats(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Item {
    index: usize,
    object: &'static str,
    embedding: Vector,
}

/// Both servers' `UsageInfo` as an embedding (or vLLM's score) fills it; SGLang's has
/// `reasoning_tokens` too.
#[derive(Serialize)]
pub(super) struct EmbedUsage {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u64,
    prompt_tokens_details: Option<()>,
    completion_tokens_details: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_tokens: Option<u64>,
}

impl EmbedUsage {
    /// The usage of a request that read `prompt_tokens` and generated nothing; `sglang` adds
    /// SGLang's `reasoning_tokens`.
    pub(super) fn prompt_only(prompt_tokens: u64, sglang: bool) -> Self {
        EmbedUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
            completion_tokens: 0,
            prompt_tokens_details: None,
            completion_tokens_details: None,
            reasoning_tokens: sglang.then_some(0),
        }
    }
}

/// vLLM's answer.
#[derive(Serialize)]
struct VllmEmbeddings {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    data: Vec<Item>,
    usage: EmbedUsage,
}

/// SGLang's answer: no `id` or `created`.
#[derive(Serialize)]
struct SglangEmbeddings {
    data: Vec<Item>,
    model: String,
    object: &'static str,
    usage: EmbedUsage,
}

impl EmbedAsk {
    /// The response body, as `runtime`'s own server writes it. `fallback_id` names it when the
    /// client gave no `request_id`. Numbers are written as the float32s they are.
    pub(super) fn shape(
        self,
        embeddings: Vec<Embedding>,
        runtime: Option<GrpcRuntime>,
        fallback_id: &str,
        created: u64,
    ) -> Vec<u8> {
        let prompt_tokens: u64 = embeddings.iter().map(|e| u64::from(e.prompt_tokens)).sum();
        let sglang = runtime == Some(GrpcRuntime::Sglang);
        let usage = EmbedUsage::prompt_only(prompt_tokens, sglang);
        let data = embeddings
            .into_iter()
            .enumerate()
            .map(|(index, e)| {
                let embedding = if self.base64 {
                    let bytes: Vec<u8> = e.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    Vector::Floats(e.values)
                };
                Item { index, object: "embedding", embedding }
            })
            .collect();
        let written = if sglang {
            serde_json::to_vec(&SglangEmbeddings { data, model: self.model, object: "list", usage })
        } else {
            let id = format!("embd-{}", self.request_id.as_deref().unwrap_or(fallback_id));
            serde_json::to_vec(&VllmEmbeddings { id, object: "list", created, model: self.model, data, usage })
        };
        // Plain structs of strings and numbers: serializing cannot fail.
        written.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ask(body: Value) -> Result<EmbedAsk, ApiError> {
        EmbedAsk::from_request(&body, "served")
    }

    fn param(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn what_embed_cannot_carry_is_refused_by_name() {
        assert!(ask(json!({"input": "x", "dimensions": null, "priority": 0, "user": "u"})).is_ok());
        for (field, value) in [
            ("dimensions", json!(8)),
            ("priority", json!(1)),
            ("truncate_prompt_tokens", json!(4)),
            ("use_activation", json!(false)),
            ("cache_salt", json!("s")),
            ("encoding_format", json!("bytes")),
            ("embed_dtype", json!("float16")),
            ("endianness", json!("big")),
            ("colour", json!(1)),
        ] {
            let mut body = json!({"input": "x"});
            body[field] = value;
            assert_eq!(param(ask(body).unwrap_err()).as_deref(), Some(field));
        }
    }

    fn vectors() -> Vec<Embedding> {
        vec![
            Embedding { values: vec![0.1, -2.5], prompt_tokens: 3 },
            Embedding { values: vec![1.0, 0.0], prompt_tokens: 2 },
        ]
    }

    #[test]
    fn vllm_and_sglang_answers_are_shaped_as_their_servers_shape_them() {
        let vllm: Value = serde_json::from_slice(&ask(json!({"input": ["a", "b"]})).unwrap().shape(
            vectors(),
            Some(GrpcRuntime::Vllm),
            "kvgate-7",
            100,
        ))
        .unwrap();
        assert_eq!(
            vllm,
            json!({"id": "embd-kvgate-7", "object": "list", "created": 100, "model": "served",
                   "data": [{"index": 0, "object": "embedding", "embedding": [0.1, -2.5]},
                            {"index": 1, "object": "embedding", "embedding": [1.0, 0.0]}],
                   "usage": {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0,
                             "prompt_tokens_details": null, "completion_tokens_details": null}})
        );
        let named = ask(json!({"input": "a", "request_id": "r1", "model": "m"})).unwrap();
        let named: Value =
            serde_json::from_slice(&named.shape(vectors(), Some(GrpcRuntime::Vllm), "kvgate-7", 100)).unwrap();
        assert_eq!((&named["id"], &named["model"]), (&json!("embd-r1"), &json!("m")));
        let sglang: Value = serde_json::from_slice(&ask(json!({"input": "a"})).unwrap().shape(
            vectors(),
            Some(GrpcRuntime::Sglang),
            "kvgate-7",
            100,
        ))
        .unwrap();
        assert!(sglang.get("id").is_none() && sglang.get("created").is_none(), "{sglang}");
        assert_eq!(sglang["usage"]["prompt_tokens"], 5);
    }

    #[test]
    fn floats_are_written_as_float32s_and_base64_as_little_endian_float32s() {
        let text = String::from_utf8(ask(json!({"input": "a"})).unwrap().shape(vectors(), None, "x", 0)).unwrap();
        assert!(text.contains("[0.1,-2.5]"), "{text}");
        let b64: Value = serde_json::from_slice(
            &ask(json!({"input": "a", "encoding_format": "base64"})).unwrap().shape(vectors(), None, "x", 0),
        )
        .unwrap();
        let bytes =
            base64::engine::general_purpose::STANDARD.decode(b64["data"][0]["embedding"].as_str().unwrap()).unwrap();
        let back: Vec<f32> = bytes.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(back, vec![0.1, -2.5]);
    }

    fn parsed(input_lengths: Vec<usize>) -> Parsed {
        Parsed {
            tokens: vec![1, 2, 3, 4],
            rest: None,
            max_tokens: 0,
            stream: false,
            model: None,
            cache_salt: None,
            input_lengths,
        }
    }

    #[test]
    fn each_input_gets_its_own_ids() {
        assert_eq!(inputs(&parsed(vec![3, 1])), Some(vec![vec![1, 2, 3], vec![4]]));
    }

    #[test]
    fn lengths_that_do_not_add_up_are_refused_not_sliced() {
        for lengths in [vec![3, 3], vec![5], vec![2, 1], vec![usize::MAX, 1]] {
            assert_eq!(inputs(&parsed(lengths.clone())), None, "{lengths:?}");
        }
    }
}
