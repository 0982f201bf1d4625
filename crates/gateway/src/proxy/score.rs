//! vLLM's `/score` and `/rerank` on gRPC workers whose model pools, as vLLM 0.32's server answers
//! them for an embedding model (`pooling/scoring/io_processor.py` `BiEncoderIOProcessor`,
//! `serving.py`): every query and document is embedded on its own through `Embed` (with the
//! tokenizer's special tokens), and each pair scores the cosine similarity of its two vectors.
//!
//! Only vLLM workers: SGLang's server scores with a cross-encoder or a generating model's log
//! probabilities, neither of which `Embed` carries, so there these routes are a 400 that says so.
//! What the protocol cannot carry (truncation, another activation, instructions for a template)
//! is refused by name, never dropped.

use serde::Serialize;
use serde_json::{Map, Value};

use kvgate_tokenizer::request::Endpoint;

use super::embed::EmbedUsage;
use crate::error::ApiError;
use crate::grpc_worker::Embedding;

/// Fields a score or rerank request may carry; those vLLM reads but `Embed` cannot carry are
/// checked in [`ScoreAsk::from_request`].
const FIELDS: &[&str] = &[
    "model",
    "user",
    "request_id",
    "priority",
    "text_1",
    "text_2",
    "queries",
    "documents",
    "items",
    "data_1",
    "data_2",
    "query",
    "top_n",
    "truncate_prompt_tokens",
    "truncation_side",
    "padding",
    "use_activation",
    "max_tokens_per_query",
    "max_tokens_per_doc",
    "instruction",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "cache_salt",
];

/// vLLM's names for the two sides of a score request, in the order its server tries them.
const SCORE_SIDES: &[(&str, &str)] =
    &[("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")];

/// A score or rerank request, read.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ScoreAsk {
    endpoint: Endpoint,
    /// The response's `model`.
    model: String,
    /// The first side of each pair: one text for all pairs, or one per pair.
    queries: Vec<String>,
    /// The second side of each pair.
    documents: Vec<String>,
    /// Rerank: the best this many (0: all).
    top_n: usize,
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidRequest { param: Some(param.to_owned()), message: message.into() }
}

/// A side of the pairs: a string or a list of strings.
fn texts(fields: &Map<String, Value>, key: &str) -> Result<Vec<String>, ApiError> {
    let one = |v: &Value| match v {
        Value::String(s) => Ok(s.clone()),
        _ => Err(invalid(
            key,
            format!(
                "`{key}` must be a string or a list of strings on gRPC workers (multimodal content is not carried)"
            ),
        )),
    };
    match fields.get(key) {
        None | Some(Value::Null) => Err(invalid(key, format!("`{key}` is required"))),
        Some(Value::Array(list)) => list.iter().map(one).collect(),
        Some(other) => Ok(vec![one(other)?]),
    }
}

impl ScoreAsk {
    /// Reads and checks `body` for `endpoint` (rerank or score). `served` names the response's
    /// model when the request does not.
    pub(super) fn from_request(endpoint: Endpoint, body: &Value, served: &str) -> Result<ScoreAsk, ApiError> {
        let Some(fields) = body.as_object() else {
            return Err(ApiError::InvalidRequest {
                param: None,
                message: "the request body must be a JSON object".into(),
            });
        };
        if let Some(unknown) = fields.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(invalid(unknown, format!("`{unknown}` is not a {} field kvgate knows", endpoint.path())));
        }
        let refused = |key: &str, why: &str| -> Result<(), ApiError> {
            let set = match fields.get(key) {
                None | Some(Value::Null) => false,
                Some(Value::Number(n)) if key.starts_with("max_tokens_per") || key == "priority" => {
                    n.as_i64() != Some(0)
                }
                Some(_) => true,
            };
            if set {
                return Err(invalid(key, format!("`{key}` is not supported by gRPC workers: {why}")));
            }
            Ok(())
        };
        refused("truncate_prompt_tokens", "`Embed` truncates nothing; shorten the input")?;
        refused("truncation_side", "`Embed` truncates nothing")?;
        refused("padding", "`Embed` pads nothing")?;
        refused("max_tokens_per_query", "`Embed` truncates nothing")?;
        refused("max_tokens_per_doc", "`Embed` truncates nothing")?;
        refused("use_activation", "`Embed` applies the model's own pooler as it is")?;
        refused("instruction", "an embedding model's scores use no template")?;
        refused("chat_template_kwargs", "an embedding model's scores use no template")?;
        refused("mm_processor_kwargs", "multimodal content is not carried")?;
        refused("cache_salt", "`Embed` carries no cache salt")?;
        refused("priority", "`Embed` carries none")?;
        let model = match fields.get("model") {
            Some(Value::String(m)) => m.clone(),
            None | Some(Value::Null) => served.to_owned(),
            Some(_) => return Err(invalid("model", "`model` must be a string")),
        };
        let (queries, documents, top_n) = match endpoint {
            Endpoint::Rerank => {
                let query = match fields.get("query") {
                    Some(Value::String(q)) => q.clone(),
                    _ => return Err(invalid("query", "`query` must be a string")),
                };
                let top_n = match fields.get("top_n") {
                    None | Some(Value::Null) => 0,
                    Some(v) => v
                        .as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| invalid("top_n", "`top_n` must be a non-negative integer"))?,
                };
                (vec![query], texts(fields, "documents")?, top_n)
            }
            _ => {
                if fields.contains_key("query") {
                    return Err(invalid(
                        "query",
                        "SGLang's score (`query` with `items`) reads a generating model's log probabilities, which \
                         gRPC workers are not asked for: send vLLM's form (`queries` and `documents`) to a worker \
                         whose model pools",
                    ));
                }
                let Some((first, second)) =
                    SCORE_SIDES.iter().find(|(a, b)| fields.contains_key(*a) && fields.contains_key(*b))
                else {
                    return Err(invalid(
                        "text_1",
                        "a score request needs two sides: `queries` and `documents` (or `items`), `data_1` and \
                         `data_2`, or `text_1` and `text_2`",
                    ));
                };
                (texts(fields, first)?, texts(fields, second)?, 0)
            }
        };
        // vLLM's checks, in its words.
        if queries.is_empty() {
            return Err(invalid("queries", "At least one text element must be given"));
        }
        if documents.is_empty() {
            return Err(invalid("documents", "At least one text_pair element must be given"));
        }
        if queries.len() > 1 && queries.len() != documents.len() {
            return Err(invalid("queries", "Input lengths must be either 1:1, 1:N or N:N"));
        }
        Ok(ScoreAsk { endpoint, model, queries, documents, top_n })
    }

    /// The texts to embed, in order: the queries, then the documents.
    pub(super) fn texts(&self) -> impl Iterator<Item = &str> {
        self.queries.iter().chain(&self.documents).map(String::as_str)
    }

    /// The response body, as vLLM's server writes it, from the embeddings of [`Self::texts`] in
    /// order (each with the count of ids it was embedded from). `id` names the response.
    pub(super) fn shape(self, embeddings: &[Embedding], id: &str, created: u64) -> Result<Vec<u8>, ApiError> {
        let n_queries = self.queries.len();
        if embeddings.len() != n_queries + self.documents.len() {
            tracing::warn!(got = embeddings.len(), "the gRPC worker answered a different number of embeddings");
            return Err(ApiError::UpstreamFailed);
        }
        let (queries, documents) = embeddings.split_at(n_queries);
        // One query for every document, or one each.
        let scores: Vec<f32> = documents
            .iter()
            .enumerate()
            .map(|(i, document)| cosine(&queries[if n_queries == 1 { 0 } else { i }].values, &document.values))
            .collect();
        // Every text embedded counts once, as vLLM counts its engine inputs.
        let prompt_tokens: u64 = embeddings.iter().map(|e| u64::from(e.prompt_tokens)).sum();
        let id = format!("score-{id}");
        let written = if self.endpoint == Endpoint::Rerank {
            let mut results: Vec<RerankResult> = scores
                .into_iter()
                .zip(self.documents)
                .enumerate()
                .map(|(index, (relevance_score, text))| RerankResult {
                    index,
                    document: RerankDocument { text, multi_modal: None },
                    relevance_score,
                })
                .collect();
            // Best first, ties in the documents' order (Python's stable sort, reversed).
            results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
            if self.top_n > 0 {
                results.truncate(self.top_n);
            }
            let usage = RerankUsage { prompt_tokens, total_tokens: prompt_tokens };
            serde_json::to_vec(&RerankResponse { id, model: self.model, usage, results })
        } else {
            let data = scores
                .into_iter()
                .enumerate()
                .map(|(index, score)| ScoreItem { index, object: "score", score })
                .collect();
            let usage = EmbedUsage::prompt_only(prompt_tokens, false);
            serde_json::to_vec(&ScoreResponse { id, object: "list", created, model: self.model, data, usage })
        };
        written.map_err(|_| ApiError::Internal)
    }
}

/// The cosine similarity of two vectors as torch's `cosine_similarity` computes it: the dot
/// product over the product of the norms, that product kept above `eps²` (1e-8 squared).
/// Summed in f64, so the result may differ from torch's float32 sums in the last bits.
fn cosine(a: &[f32], b: &[f32]) -> f32 {
    const EPS: f64 = 1e-8;
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
    let aa: f64 = a.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let bb: f64 = b.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    (dot / (aa * bb).max(EPS * EPS).sqrt()) as f32
}

#[derive(Serialize)]
struct ScoreItem {
    index: usize,
    object: &'static str,
    score: f32,
}

#[derive(Serialize)]
struct ScoreResponse {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    data: Vec<ScoreItem>,
    usage: EmbedUsage,
}

#[derive(Serialize)]
struct RerankDocument {
    text: String,
    multi_modal: Option<()>,
}

#[derive(Serialize)]
struct RerankResult {
    index: usize,
    document: RerankDocument,
    relevance_score: f32,
}

#[derive(Serialize)]
struct RerankUsage {
    prompt_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
struct RerankResponse {
    id: String,
    model: String,
    usage: RerankUsage,
    results: Vec<RerankResult>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn embedding(values: &[f32], prompt_tokens: u32) -> Embedding {
        Embedding { values: values.to_vec(), prompt_tokens }
    }

    #[test]
    fn every_form_of_vllms_score_request_is_read_and_bad_ones_named() {
        let ask = |body: Value| ScoreAsk::from_request(Endpoint::Score, &body, "m");
        for (a, b) in SCORE_SIDES {
            let read = ask(json!({*a: "q", *b: ["x", "y"]})).unwrap();
            assert_eq!(read.texts().collect::<Vec<_>>(), ["q", "x", "y"], "{a} {b}");
        }
        let err = |body: Value| ask(body).unwrap_err().to_string();
        assert!(err(json!({"queries": ["a", "b"], "documents": ["x", "y", "z"]})).contains("1:1, 1:N or N:N"));
        assert!(err(json!({"queries": [], "documents": ["x"]})).contains("At least one text element"));
        assert!(err(json!({"query": "q", "items": ["x"]})).contains("SGLang's score"));
        assert!(err(json!({"text_1": "q"})).contains("two sides"));
        assert!(err(json!({"text_1": "q", "text_2": [{"type": "image_url"}]})).contains("multimodal"));
        assert!(err(json!({"text_1": "q", "text_2": "x", "truncate_prompt_tokens": 4}))
            .contains("`truncate_prompt_tokens`"));
        assert!(err(json!({"text_1": "q", "text_2": "x", "use_activation": false})).contains("`use_activation`"));
        assert!(err(json!({"text_1": "q", "text_2": "x", "label_token_ids": [1]})).contains("`label_token_ids`"));
        assert!(ask(json!({"text_1": "q", "text_2": "x", "max_tokens_per_doc": 0, "priority": 0})).is_ok());
        let rerank = |body: Value| ScoreAsk::from_request(Endpoint::Rerank, &body, "m");
        assert_eq!(rerank(json!({"query": "q", "documents": "d", "top_n": 1})).unwrap().top_n, 1);
        assert!(rerank(json!({"query": ["q"], "documents": "d"})).unwrap_err().to_string().contains("`query`"));
        assert!(rerank(json!({"query": "q", "documents": "d", "top_n": -1}))
            .unwrap_err()
            .to_string()
            .contains("`top_n`"));
    }

    #[test]
    fn scores_are_cosines_and_a_rerank_is_best_first_and_cut_at_top_n() {
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-7);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 1.0]), 0.0, "a zero vector scores 0, not NaN");
        let ask = ScoreAsk::from_request(Endpoint::Score, &json!({"text_1": "q", "text_2": ["a", "b"]}), "m").unwrap();
        let vectors = [embedding(&[1.0, 0.0], 2), embedding(&[1.0, 0.0], 3), embedding(&[0.0, 1.0], 4)];
        let body: Value = serde_json::from_slice(&ask.shape(&vectors, "r", 7).unwrap()).unwrap();
        assert_eq!(body["id"], "score-r");
        assert_eq!(
            body["data"],
            json!([{"index": 0, "object": "score", "score": 1.0}, {"index": 1, "object": "score", "score": 0.0}])
        );
        assert_eq!(body["usage"]["prompt_tokens"], 9, "every text embedded counted once");

        let body = json!({"query": "q", "documents": ["a", "b", "c"], "top_n": 2});
        let ask = ScoreAsk::from_request(Endpoint::Rerank, &body, "m").unwrap();
        let vectors = [
            embedding(&[1.0, 0.0], 1),
            embedding(&[0.0, 1.0], 1),
            embedding(&[1.0, 0.0], 1),
            embedding(&[1.0, 0.0], 1),
        ];
        let body: Value = serde_json::from_slice(&ask.clone().shape(&vectors, "r", 7).unwrap()).unwrap();
        let order: Vec<u64> =
            body["results"].as_array().unwrap().iter().map(|r| r["index"].as_u64().unwrap()).collect();
        assert_eq!(order, [1, 2], "best first, ties in the documents' order, the best two");
        assert_eq!(body["results"][0]["document"], json!({"text": "b", "multi_modal": null}));
        assert!(ask.shape(&vectors[..3], "r", 7).is_err(), "a worker that answers fewer vectors is at fault");
    }
}
