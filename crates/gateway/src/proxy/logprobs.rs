//! A sequence's `logprobs` for a worker that answers with token ids (a gRPC worker): the log
//! probabilities it sends per token, named and shaped as the runtime's own OpenAI server shows
//! them (chat's `content` list, completions' four parallel lists, the Responses API's list of
//! tokens), or as SGLang's `/generate` shows them (`[logprob, token id, text]` per token).
//!
//! Entries follow the tokens the response keeps: the end-of-sequence token the worker stopped on
//! is shown (vLLM's server shows it), tokens after a stop string the gateway matched are not.
//! The prompt's own entries, when asked (completions' `echo` with `logprobs`, `/generate`'s
//! `logprob_start_len`), come before the first output token's.

use serde_json::{json, Map, Value};

use kvgate_tokenizer::request::Endpoint;
use kvgate_tokenizer::token_names::{NameStyle, TokenNames};

use crate::error::ApiError;
use crate::grpc_worker::{PromptLogprobs, TokenLogprobs};

/// vLLM's floor for a log probability (JSON has no -inf).
const FLOOR: f64 = -9999.0;

/// One token: its id, its log probability (none for a prompt's first token), the most likely
/// alternatives.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    id: u32,
    logprob: Option<f32>,
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
    /// The prompt position whose entry is shown first, when the prompt's entries are shown.
    prompt_from: Option<usize>,
    /// The prompt's entries, once a worker sent them; emptied when shown.
    prompt: Option<Vec<Entry>>,
}

impl SequenceLogprobs {
    /// Logprobs for a sequence of `endpoint` with `top` alternatives per token, named and shaped
    /// as the server `names` follows.
    pub fn new(names: TokenNames, endpoint: Endpoint, top: u32) -> Self {
        SequenceLogprobs {
            names,
            endpoint,
            top,
            entries: Vec::new(),
            shown: 0,
            offset: 0,
            with_text: true,
            prompt_from: None,
            prompt: None,
        }
    }

    /// The same, but `/generate`'s entries show `null` in place of each token's text.
    pub fn without_text(self) -> Self {
        SequenceLogprobs { with_text: false, ..self }
    }

    /// The same, showing the prompt's entries from position `from` on before the first output
    /// token's. SGLang's server shows a completion's only when alternatives are asked
    /// (`logprobs` above 0), so there `echo` with `logprobs: 0` shows none.
    pub fn with_prompt_from(self, from: u32) -> Self {
        let sglang_completion = self.endpoint == Endpoint::Completions && self.names.style() == NameStyle::Sglang;
        if sglang_completion && self.top == 0 {
            return self;
        }
        SequenceLogprobs { prompt_from: usize::try_from(from).ok(), ..self }
    }

    /// Adds a worker's log probabilities for its next tokens. A message whose lists do not line
    /// up is the worker's fault.
    pub fn push(&mut self, lp: &TokenLogprobs) -> Result<(), ApiError> {
        if lp.values.len() != lp.token_ids.len() || (!lp.top.is_empty() && lp.top.len() != lp.token_ids.len()) {
            return Err(misaligned(lp.token_ids.len(), lp.values.len(), lp.top.len()));
        }
        for (i, (&id, &logprob)) in lp.token_ids.iter().zip(&lp.values).enumerate() {
            self.entries.push(Entry { id, logprob: Some(logprob), top: lp.top.get(i).cloned().unwrap_or_default() });
        }
        Ok(())
    }

    /// Takes a worker's log probabilities of the prompt (`prompt_len` tokens), when they are
    /// shown and none came before. A worker may send them from the prompt's start (vLLM) or from
    /// the position asked (SGLang): the list is the prompt's tail either way.
    pub fn push_prompt(&mut self, lp: &PromptLogprobs, prompt_len: usize) -> Result<(), ApiError> {
        let Some(from) = self.prompt_from else { return Ok(()) };
        if self.prompt.is_some() {
            return Ok(());
        }
        let sent = lp.token_ids.len();
        if lp.values.len() != sent || (!lp.top.is_empty() && lp.top.len() != sent) || sent > prompt_len {
            return Err(misaligned(sent, lp.values.len(), lp.top.len()));
        }
        let skip = from.saturating_sub(prompt_len - sent);
        let entries = lp.token_ids.iter().zip(&lp.values).enumerate().skip(skip);
        self.prompt = Some(
            entries
                .map(|(i, (&id, &logprob))| Entry { id, logprob, top: lp.top.get(i).cloned().unwrap_or_default() })
                .collect(),
        );
        Ok(())
    }

    /// Whether any of the first `kept` tokens was received and not shown yet.
    pub fn pending(&self, kept: usize) -> bool {
        kept.min(self.entries.len()) > self.shown
    }

    /// The `logprobs` of the tokens after those already shown, up to the `upto`th, the prompt's
    /// first when they are shown and were not yet: chat's `{"content": [...]}`, the Responses
    /// API's list (chat's entries), completions' parallel lists, or `/generate`'s lists (the
    /// prompt's under `input_tokens` and `input_top`). `text_before` is the length in characters
    /// of the text the client has before them, when a stream sets it (vLLM counts a streamed
    /// chunk's offsets from there; a whole answer's from 0).
    pub fn take(&mut self, upto: usize, text_before: Option<usize>) -> Result<Value, ApiError> {
        let upto = upto.min(self.entries.len()).max(self.shown);
        let range = self.shown..upto;
        self.shown = upto;
        if let Some(chars) = text_before {
            self.offset = chars;
        }
        let prompt = self.prompt.as_mut().map(std::mem::take).unwrap_or_default();
        if self.endpoint == Endpoint::Generate {
            let mut lists = self.generate_lists(&self.entries[range])?;
            if !prompt.is_empty() {
                let input = self.generate_lists(&prompt)?;
                lists["input_tokens"] = input["tokens"].clone();
                lists["input_top"] = input["top"].clone();
            }
            return Ok(lists);
        }
        let mut named = Vec::with_capacity(prompt.len() + range.len());
        for i in 0..prompt.len() {
            named.push(self.named(&prompt, i)?);
        }
        for i in range {
            named.push(self.named(&self.entries, i)?);
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
                // SGLang's server lists no alternatives at all when none are asked (`logprobs: 0`).
                let no_top = self.names.style() == NameStyle::Sglang && self.top == 0;
                let tops: Vec<Value> =
                    if no_top { Vec::new() } else { named.iter().map(|n| n.top_map.clone()).collect() };
                json!({
                    "text_offset": offsets,
                    "token_logprobs": named.iter().map(|n| n.logprob).collect::<Vec<_>>(),
                    "tokens": named.into_iter().map(|n| n.name).collect::<Vec<_>>(),
                    "top_logprobs": tops,
                })
            }
        })
    }

    /// The alternatives shown for an entry with log probability `logprob`: vLLM's server keeps
    /// the sampled (or prompt) token first and then the ranked ones (each once), chat and the
    /// Responses API showing `top` of them; completions show the best `top` and the sampled token,
    /// so `top` when it is among them and one more when it is not (its rank is read from the
    /// alternatives, of which the worker was asked one more). SGLang's shows the ranked ones as
    /// they are.
    fn alternatives(&self, e: &Entry, logprob: f32) -> Vec<(u32, f32)> {
        match self.names.style() {
            NameStyle::Sglang => e.top.clone(),
            NameStyle::Vllm => {
                let top = self.top as usize;
                let shown = match self.endpoint {
                    Endpoint::Chat | Endpoint::Responses => top,
                    _ => {
                        let better = e.top.iter().filter(|&&(id, lp)| id != e.id && lp > logprob).count();
                        if better < top {
                            top
                        } else {
                            top + 1
                        }
                    }
                };
                let mut out: Vec<(u32, f32)> = vec![(e.id, logprob)];
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
    fn generate_lists(&self, entries: &[Entry]) -> Result<Value, ApiError> {
        let entry = |id: u32, logprob: Option<f32>| -> Result<Value, ApiError> {
            let logprob = logprob.map(f64::from).filter(|v| v.is_finite());
            let text =
                if self.with_text { Some(self.names.name(id, &[]).map_err(|_| ApiError::Internal)?) } else { None };
            Ok(json!([logprob, id, text]))
        };
        let mut tokens = Vec::with_capacity(entries.len());
        let mut tops = Vec::with_capacity(entries.len());
        for e in entries {
            tokens.push(entry(e.id, e.logprob)?);
            let top = e
                .top
                .iter()
                .take(self.top as usize)
                .map(|&(id, lp)| entry(id, Some(lp)))
                .collect::<Result<Vec<_>, _>>()?;
            tops.push(if top.is_empty() { Value::Null } else { Value::Array(top) });
        }
        Ok(json!({"tokens": tokens, "top": tops}))
    }

    /// Entry `i` of `list` (the prompt's or the output's) as shown; its context is the entries
    /// before it in the same list, as vLLM names prompt and output tokens apart.
    fn named(&self, list: &[Entry], i: usize) -> Result<Named, ApiError> {
        let e = &list[i];
        let Some(logprob) = e.logprob else {
            // A prompt's first token: vLLM's server shows it decoded alone, SGLang's as any other.
            let name = match self.names.style() {
                NameStyle::Vllm => self.names.decoded(e.id),
                NameStyle::Sglang => self.names.name(e.id, &[]),
            }
            .map_err(|_| ApiError::Internal)?;
            let name = self.names.completions_name(e.id, name);
            let chat = json!({"token": name, "logprob": null, "bytes": null, "top_logprobs": []});
            return Ok(Named { name, logprob: None, chat, top_map: Value::Null });
        };
        let context: Vec<u32> = list[i.saturating_sub(4)..i].iter().map(|e| e.id).collect();
        let name_of = |id: u32| self.names.name(id, &context).map_err(|_| ApiError::Internal);
        // SGLang's server gives the Responses API each name's UTF-8 and its alternatives keyed by
        // name (a later one of the same name takes the earlier one's place); chat gets the
        // token's own bytes.
        let by_name = self.endpoint == Endpoint::Responses && self.names.style() == NameStyle::Sglang;
        let bytes = |id: u32, n: &str| if by_name { n.as_bytes().to_vec() } else { self.names.bytes(id, n) };
        let name = name_of(e.id)?;
        let mut top_list: Vec<Value> = Vec::new();
        let mut top_map = Map::new();
        for (id, lp) in self.alternatives(e, logprob) {
            let n = name_of(id)?;
            let alternative = json!({"token": n, "logprob": clamp(lp), "bytes": bytes(id, &n)});
            match top_list.iter_mut().find(|t| by_name && t["token"] == n.as_str()) {
                Some(earlier) => *earlier = alternative,
                None => top_list.push(alternative),
            }
            top_map.insert(self.names.completions_name(id, n), Value::from(clamp(lp)));
        }
        let logprob = clamp(logprob);
        let chat = json!({"token": name, "logprob": logprob, "bytes": bytes(e.id, &name), "top_logprobs": top_list});
        let name = self.names.completions_name(e.id, name);
        Ok(Named { name, logprob: Some(logprob), chat, top_map: Value::Object(top_map) })
    }
}

fn misaligned(tokens: usize, values: usize, top: usize) -> ApiError {
    tracing::warn!(tokens, values, top, "the gRPC worker sent logprobs that do not line up");
    ApiError::UpstreamFailed
}

/// An entry as shown: its completions name and log probability (none for a prompt's first
/// token), its chat form, its completions alternatives (`null` for a prompt's first token).
struct Named {
    name: String,
    logprob: Option<f64>,
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

    fn prompt(ids: &[u32], values: &[Option<f32>], top: Vec<Vec<(u32, f32)>>) -> PromptLogprobs {
        PromptLogprobs { token_ids: ids.to_vec(), values: values.to_vec(), top }
    }

    #[test]
    fn an_echoed_prompt_shows_its_entries_first_its_first_token_without_a_logprob() {
        let mut s = SequenceLogprobs::new(names(NameStyle::Vllm), Endpoint::Completions, 1).with_prompt_from(0);
        s.push_prompt(&prompt(&[0, 1], &[None, Some(-2.0)], vec![vec![], vec![(1, -2.0), (2, -0.5)]]), 2).unwrap();
        s.push(&lp(&[2], &[-0.5], vec![vec![(2, -0.5), (0, -1.5)]])).unwrap();
        let v = s.take(1, None).unwrap();
        assert_eq!(v["tokens"], json!(["a", "b", "c"]));
        assert_eq!(v["token_logprobs"], json!([null, -2.0, -0.5]));
        assert_eq!(v["text_offset"], json!([0, 1, 2]), "offsets run on from the prompt's names");
        assert_eq!(v["top_logprobs"][0], Value::Null, "nothing predicts the prompt's first token");
        assert_eq!(v["top_logprobs"][1], json!({"b": -2.0, "c": -0.5}), "not among the best 1: one more");
        assert_eq!(v["top_logprobs"][2], json!({"c": -0.5}), "the best itself: `logprobs` entries");
        assert_eq!(s.take(1, None).unwrap()["tokens"], json!([]), "the prompt is shown once");
    }

    #[test]
    fn a_prompt_sent_whole_is_shown_from_the_position_asked_and_a_tail_as_it_is() {
        let whole = prompt(&[0, 1, 2], &[None, Some(-1.0), Some(-2.0)], Vec::new());
        let mut from_vllm = SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Generate, 0).with_prompt_from(2);
        from_vllm.push_prompt(&whole, 3).unwrap();
        let v = from_vllm.take(0, None).unwrap();
        assert_eq!(v["input_tokens"], json!([[-2.0, 2, "c"]]));
        assert_eq!(v["input_top"], json!([null]));
        let tail = prompt(&[2], &[Some(-2.0)], Vec::new());
        let mut from_sglang =
            SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Generate, 0).with_prompt_from(2);
        from_sglang.push_prompt(&tail, 3).unwrap();
        assert_eq!(from_sglang.take(0, None).unwrap()["input_tokens"], json!([[-2.0, 2, "c"]]));
        let mut start = SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Generate, 0).with_prompt_from(0);
        start.push_prompt(&whole, 3).unwrap();
        assert_eq!(start.take(0, None).unwrap()["input_tokens"][0], json!([null, 0, "a"]));
        let mut bad = SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Generate, 0).with_prompt_from(0);
        assert!(bad.push_prompt(&whole, 2).is_err(), "more entries than the prompt has tokens");
    }

    #[test]
    fn sglang_completions_show_no_prompt_entries_without_alternatives_and_unasked_ones_are_ignored() {
        let first = prompt(&[0, 1], &[None, Some(-1.0)], Vec::new());
        let mut bare = SequenceLogprobs::new(names(NameStyle::Sglang), Endpoint::Completions, 0).with_prompt_from(0);
        bare.push_prompt(&first, 2).unwrap();
        bare.push(&lp(&[2], &[-0.5], Vec::new())).unwrap();
        let v = bare.take(1, None).unwrap();
        assert_eq!(v["tokens"], json!(["c"]), "as SGLang's server, for `logprobs: 0`");
        assert_eq!(v["top_logprobs"], json!([]), "and no alternatives at all");
        let mut unasked = SequenceLogprobs::new(names(NameStyle::Vllm), Endpoint::Completions, 2);
        unasked.push_prompt(&first, 2).unwrap();
        assert_eq!(unasked.take(0, None).unwrap()["tokens"], json!([]));
    }
}
