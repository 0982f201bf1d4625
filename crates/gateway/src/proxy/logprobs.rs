//! A sequence's `logprobs` for a worker that answers with token ids (a gRPC worker): the log
//! probabilities it sends per token, named and shaped as the runtime's own OpenAI server shows
//! them (chat's `content` list, completions' four parallel lists, the Responses API's list of
//! tokens), or as SGLang's `/generate` shows them (`[logprob, token id, text]` per token).
//!
//! Entries follow the tokens the response keeps: the end-of-sequence token the worker stopped on
//! is shown (vLLM's server shows it), tokens after a stop string the gateway matched are not.

use serde_json::{json, Map, Value};

use kvgate_tokenizer::request::Endpoint;
use kvgate_tokenizer::token_names::{NameStyle, TokenNames};

use crate::error::ApiError;
use crate::grpc_worker::TokenLogprobs;

/// vLLM's floor for a log probability (JSON has no -inf).
const FLOOR: f64 = -9999.0;

/// One output token: its id, its log probability, the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    id: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

/// The logprobs of one sequence, received and not yet shown.
#[derive(Debug, Clone)]
pub struct SequenceLogprobs {
    names: TokenNames,
    endpoint: Endpoint,
    /// Alternatives asked per token.
    top: u32,
    entries: Vec<Entry>,
    /// Entries already shown.
    shown: usize,
    /// Characters of text before the next entry shown (completions' `text_offset`).
    offset: usize,
    /// Whether `/generate`'s entries carry their token's text (`return_text_in_logprobs`).
    with_text: bool,
}

impl SequenceLogprobs {
    /// Logprobs for a sequence of `endpoint` with `top` alternatives per token, named and shaped
    /// as the server `names` follows.
    pub fn new(names: TokenNames, endpoint: Endpoint, top: u32) -> Self {
        SequenceLogprobs { names, endpoint, top, entries: Vec::new(), shown: 0, offset: 0, with_text: true }
    }

    /// The same, but `/generate`'s entries show `null` in place of each token's text.
    pub fn without_text(self) -> Self {
        SequenceLogprobs { with_text: false, ..self }
    }

    /// Adds a worker's log probabilities for its next tokens. A message whose lists do not line
    /// up is the worker's fault.
    pub fn push(&mut self, lp: &TokenLogprobs) -> Result<(), ApiError> {
        if lp.values.len() != lp.token_ids.len() || (!lp.top.is_empty() && lp.top.len() != lp.token_ids.len()) {
            tracing::warn!(
                tokens = lp.token_ids.len(),
                values = lp.values.len(),
                top = lp.top.len(),
                "the gRPC worker sent logprobs that do not line up"
            );
            return Err(ApiError::UpstreamFailed);
        }
        for (i, (&id, &logprob)) in lp.token_ids.iter().zip(&lp.values).enumerate() {
            self.entries.push(Entry { id, logprob, top: lp.top.get(i).cloned().unwrap_or_default() });
        }
        Ok(())
    }

    /// Whether any of the first `kept` tokens was received and not shown yet.
    pub fn pending(&self, kept: usize) -> bool {
        kept.min(self.entries.len()) > self.shown
    }

    /// The `logprobs` of the tokens after those already shown, up to the `upto`th: chat's
    /// `{"content": [...]}`, the Responses API's list (chat's entries) or completions' parallel
    /// lists. `text_before` is the length in
    /// characters of the text the client has before them, when a stream sets it (vLLM counts a
    /// streamed chunk's offsets from there; a whole answer's from 0).
    pub fn take(&mut self, upto: usize, text_before: Option<usize>) -> Result<Value, ApiError> {
        let upto = upto.min(self.entries.len()).max(self.shown);
        let range = self.shown..upto;
        self.shown = upto;
        if let Some(chars) = text_before {
            self.offset = chars;
        }
        if self.endpoint == Endpoint::Generate {
            return self.generate_lists(range);
        }
        let mut named = Vec::with_capacity(range.len());
        for i in range {
            named.push(self.named(i)?);
        }
        Ok(match self.endpoint {
            Endpoint::Chat => json!({"content": named.into_iter().map(|n| n.chat).collect::<Vec<_>>()}),
            Endpoint::Responses => Value::Array(named.into_iter().map(|n| n.chat).collect()),
            _ => {
                let mut offsets: Vec<i64> = Vec::with_capacity(named.len());
                for n in &named {
                    // SGLang's server does not compute offsets: it shows -1.
                    offsets.push(if self.names.style() == NameStyle::Sglang { -1 } else { self.offset as i64 });
                    self.offset += n.name.chars().count();
                }
                json!({
                    "text_offset": offsets,
                    "token_logprobs": named.iter().map(|n| n.logprob).collect::<Vec<_>>(),
                    "tokens": named.iter().map(|n| n.name.clone()).collect::<Vec<_>>(),
                    "top_logprobs": named.into_iter().map(|n| n.top_map).collect::<Vec<_>>(),
                })
            }
        })
    }

    /// The alternatives shown for entry `i`: vLLM's server keeps the sampled token first and then
    /// the ranked ones (each once), chat and the Responses API showing `top` of them and
    /// completions one more; SGLang's shows the ranked ones as they are.
    fn alternatives(&self, e: &Entry) -> Vec<(u32, f32)> {
        match self.names.style() {
            NameStyle::Sglang => e.top.clone(),
            NameStyle::Vllm => {
                let shown = match self.endpoint {
                    Endpoint::Chat | Endpoint::Responses => self.top as usize,
                    _ => self.top as usize + 1,
                };
                let mut out: Vec<(u32, f32)> = vec![(e.id, e.logprob)];
                for &(id, lp) in &e.top {
                    if !out.iter().any(|&(seen, _)| seen == id) {
                        out.push((id, lp));
                    }
                }
                out.truncate(shown);
                out
            }
        }
    }

    /// `/generate`'s form of entries `range`: `{"tokens": [[logprob, id, text], ...], "top": [...]}`,
    /// each alternatives list ranked as the worker sent it (`null` where it sent none), a log
    /// probability JSON cannot hold (-inf) as `null`, as SGLang's server writes it.
    fn generate_lists(&self, range: std::ops::Range<usize>) -> Result<Value, ApiError> {
        let entry = |id: u32, logprob: f32| -> Result<Value, ApiError> {
            let logprob = Some(f64::from(logprob)).filter(|v| v.is_finite());
            let text =
                if self.with_text { Some(self.names.name(id, &[]).map_err(|_| ApiError::Internal)?) } else { None };
            Ok(json!([logprob, id, text]))
        };
        let mut tokens = Vec::with_capacity(range.len());
        let mut tops = Vec::with_capacity(range.len());
        for e in &self.entries[range] {
            tokens.push(entry(e.id, e.logprob)?);
            let top =
                e.top.iter().take(self.top as usize).map(|&(id, lp)| entry(id, lp)).collect::<Result<Vec<_>, _>>()?;
            tops.push(if top.is_empty() { Value::Null } else { Value::Array(top) });
        }
        Ok(json!({"tokens": tokens, "top": tops}))
    }

    fn named(&self, i: usize) -> Result<Named, ApiError> {
        let e = &self.entries[i];
        let context: Vec<u32> = self.entries[i.saturating_sub(4)..i].iter().map(|e| e.id).collect();
        let name_of = |id: u32| self.names.name(id, &context).map_err(|_| ApiError::Internal);
        // SGLang's server gives the Responses API each name's UTF-8 and its alternatives keyed by
        // name (a later one of the same name takes the earlier one's place); chat gets the
        // token's own bytes.
        let by_name = self.endpoint == Endpoint::Responses && self.names.style() == NameStyle::Sglang;
        let bytes = |id: u32, n: &str| if by_name { n.as_bytes().to_vec() } else { self.names.bytes(id, n) };
        let logprob = clamp(e.logprob);
        let name = name_of(e.id)?;
        let mut top_list: Vec<Value> = Vec::new();
        let mut top_map = Map::new();
        for (id, lp) in self.alternatives(e) {
            let n = name_of(id)?;
            let alternative = json!({"token": n, "logprob": clamp(lp), "bytes": bytes(id, &n)});
            match top_list.iter_mut().find(|t| by_name && t["token"] == n.as_str()) {
                Some(earlier) => *earlier = alternative,
                None => top_list.push(alternative),
            }
            top_map.insert(self.names.completions_name(id, n), Value::from(clamp(lp)));
        }
        let chat = json!({"token": name, "logprob": logprob, "bytes": bytes(e.id, &name), "top_logprobs": top_list});
        let name = self.names.completions_name(e.id, name);
        Ok(Named { name, logprob, chat, top_map: Value::Object(top_map) })
    }
}

/// An entry as shown: its completions name and log probability, its chat form, its completions
/// alternatives.
struct Named {
    name: String,
    logprob: f64,
    chat: Value,
    top_map: Value,
}

fn clamp(logprob: f32) -> f64 {
    f64::from(logprob).max(FLOOR)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(style: NameStyle) -> TokenNames {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
            "post_processor":null,
            "decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
            "model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
                     "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
                     "vocab":{"a":0,"b":1,"c":2},"merges":[]}}"#;
        let tokenizer = tokenizers::Tokenizer::from_bytes(json.as_bytes()).expect("a tiny tokenizer");
        TokenNames::new(std::sync::Arc::new(tokenizer), style)
    }

    fn lp(ids: &[u32], values: &[f32], top: Vec<Vec<(u32, f32)>>) -> TokenLogprobs {
        TokenLogprobs { token_ids: ids.to_vec(), values: values.to_vec(), top }
    }

    #[test]
    fn chat_shows_the_sampled_token_first_then_the_ranked_ones_as_vllm_does() {
        let mut s = SequenceLogprobs::new(names(NameStyle::Vllm), Endpoint::Chat, 2);
        s.push(&lp(&[1, 2], &[-0.5, f32::NEG_INFINITY], vec![vec![(1, -0.5), (0, -1.0)], vec![(0, -0.1), (1, -0.2)]]))
            .unwrap();
        let v = s.take(2, None).unwrap();
        let content = v["content"].as_array().unwrap();
        assert_eq!(content[0]["token"], "b");
        assert_eq!(content[0]["bytes"], json!([98]));
        assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(content[1]["logprob"], -9999.0, "-inf is floored");
        let second: Vec<&str> =
            content[1]["top_logprobs"].as_array().unwrap().iter().map(|t| t["token"].as_str().unwrap()).collect();
        assert_eq!(second, ["c", "a"], "the sampled token first, then the best other one");
        assert_eq!(s.take(2, None).unwrap()["content"], json!([]), "nothing is shown twice");
    }

    #[test]
    fn completions_show_one_alternative_more_with_offsets_in_characters() {
        let mut s = SequenceLogprobs::new(names(NameStyle::Vllm), Endpoint::Completions, 0);
        s.push(&lp(&[0, 1, 2], &[-0.1, -0.2, -0.3], Vec::new())).unwrap();
        let v = s.take(2, None).unwrap();
        assert_eq!(v["tokens"], json!(["a", "b"]));
        assert_eq!(v["text_offset"], json!([0, 1]));
        assert_eq!(v["top_logprobs"][0].as_object().unwrap().len(), 1, "logprobs 0 still shows the sampled token");
        let rest = s.take(3, Some(7)).unwrap();
        assert_eq!(rest["text_offset"], json!([7]));
        assert!(s.push(&lp(&[0, 1], &[-0.1], Vec::new())).is_err(), "lists that do not line up");
    }

    #[test]
    fn generate_shows_id_triples_ranked_alternatives_and_no_infinity() {
        let mut s = SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Generate, 1);
        s.push(&lp(&[1, 2], &[-0.5, f32::NEG_INFINITY], vec![vec![(0, -0.25), (1, -0.5)], Vec::new()])).unwrap();
        let v = s.take(2, None).unwrap();
        assert_eq!(v["tokens"], json!([[-0.5, 1, "b"], [null, 2, "c"]]));
        assert_eq!(v["top"], json!([[[-0.25, 0, "a"]], null]), "top 1 of the ranked list; none sent is null");
        let mut bare = SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Generate, 0).without_text();
        bare.push(&lp(&[0], &[-1.0], vec![vec![(0, -1.0)]])).unwrap();
        assert_eq!(bare.take(1, None).unwrap(), json!({"tokens": [[-1.0, 0, null]], "top": [null]}));
    }
}
