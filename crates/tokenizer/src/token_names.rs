//! The text a server shows for one token in a response's `logprobs`: what a gateway must compute
//! itself when a worker answers with token ids and logprobs only (SMG's gRPC worker protocol).
//!
//! The runtimes' own servers name tokens differently, and a client comparing answers sees it:
//! - **vLLM** (0.32, `v1/engine/logprobs.py`, `tokenizers/detokenizer_utils.py`) decodes each id
//!   alone (special tokens kept), puts back leading spaces a Metaspace tokenizer's decode strips,
//!   and names a byte-fallback token that ends mid-character (decoding to U+FFFD) by what it
//!   completes after the sequence's last four sampled tokens (the empty string while the character
//!   is still incomplete). Its `bytes` are the UTF-8 of that name.
//! - **SGLang** (0.5.23, `tokenizer_manager.py`, `openai/serving_chat.py`) decodes each id alone,
//!   U+FFFD and all, and gives a byte-level tokenizer's token its true bytes (GPT-2's byte decoder
//!   over the vocabulary piece), falling back to the name's UTF-8.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use tokenizers::{DecoderWrapper, PreTokenizerWrapper, Tokenizer};

use crate::TokenizeError;

/// Whose server's token names to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameStyle {
    /// vLLM's OpenAI server.
    Vllm,
    /// SGLang's OpenAI server.
    Sglang,
}

/// How many earlier sampled tokens vLLM tries as context for a token that ends mid-character:
/// enough for any UTF-8 sequence.
const VLLM_CONTEXT: usize = 4;

/// Names tokens as one runtime's server does.
#[derive(Clone)]
pub struct TokenNames {
    tokenizer: Arc<Tokenizer>,
    style: NameStyle,
    /// The Metaspace replacement character, when the tokenizer pre-tokenizes with one (vLLM then
    /// puts back the leading spaces decode strips).
    marker: Option<char>,
    /// GPT-2's byte decoder, when the tokenizer decodes byte-level (SGLang's `bytes`).
    byte_decoder: Option<&'static HashMap<char, u8>>,
}

impl std::fmt::Debug for TokenNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenNames").field("style", &self.style).field("marker", &self.marker).finish_non_exhaustive()
    }
}

/// The Metaspace replacement of a pre-tokenizer, looking inside sequences.
fn metaspace_marker(pre: &PreTokenizerWrapper) -> Option<char> {
    match pre {
        PreTokenizerWrapper::Metaspace(m) => Some(m.get_replacement()),
        PreTokenizerWrapper::Sequence(s) => s.as_ref().iter().find_map(metaspace_marker),
        _ => None,
    }
}

/// Whether a decoder turns GPT-2's byte-level characters back into bytes.
fn decodes_byte_level(decoder: &DecoderWrapper) -> bool {
    match decoder {
        DecoderWrapper::ByteLevel(_) => true,
        DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(decodes_byte_level),
        _ => false,
    }
}

/// GPT-2's byte decoder, built once.
fn byte_decoder() -> &'static HashMap<char, u8> {
    static DECODER: OnceLock<HashMap<char, u8>> = OnceLock::new();
    DECODER.get_or_init(gpt2_byte_decoder)
}

/// GPT-2's `bytes_to_unicode`, inverted: the character each byte is written as in a byte-level
/// vocabulary, back to the byte. Written out because `tokenizers` keeps its table private.
fn gpt2_byte_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap_or('\u{FFFD}')
            };
            (c, b)
        })
        .collect()
}

impl TokenNames {
    /// Names tokens of `tokenizer` as `style`'s server does.
    pub fn new(tokenizer: Arc<Tokenizer>, style: NameStyle) -> Self {
        let marker = tokenizer.get_pre_tokenizer().and_then(metaspace_marker);
        let byte_decoder = tokenizer.get_decoder().filter(|d| decodes_byte_level(d)).map(|_| byte_decoder());
        TokenNames { tokenizer, style, marker, byte_decoder }
    }

    /// Whose server's names these are.
    pub fn style(&self) -> NameStyle {
        self.style
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        self.tokenizer.decode(ids, false).map_err(|e| TokenizeError::Decode(e.to_string()))
    }

    /// Token `id` decoded on its own, special tokens kept: what vLLM's server shows for a token
    /// that has no log probability (a prompt's first).
    pub fn decoded(&self, id: u32) -> Result<String, TokenizeError> {
        self.decode(&[id])
    }

    /// The name of token `id` sampled after `context` (the sequence's earlier sampled tokens,
    /// most recent last; only vLLM reads it).
    pub fn name(&self, id: u32, context: &[u32]) -> Result<String, TokenizeError> {
        let alone = self.decode(&[id])?;
        if self.style == NameStyle::Sglang {
            return Ok(alone);
        }
        let alone = match (self.marker, self.tokenizer.id_to_token(id)) {
            (Some(marker), Some(raw)) => {
                let markers = raw.chars().take_while(|&c| c == marker).count();
                let spaces = alone.chars().take_while(|&c| c == ' ').count();
                format!("{}{alone}", " ".repeat(markers.saturating_sub(spaces)))
            }
            _ => alone,
        };
        if !alone.ends_with('\u{FFFD}') {
            return Ok(alone);
        }
        self.complete_in_context(id, context)
    }

    /// vLLM's name for a token that decodes alone to an incomplete character: the text it adds
    /// after the shortest run of earlier tokens with which it completes one; empty if none does.
    fn complete_in_context(&self, id: u32, context: &[u32]) -> Result<String, TokenizeError> {
        let most = context.len().min(VLLM_CONTEXT);
        for k in 1..=most {
            let window = &context[context.len() - k..];
            let mut ids = window.to_vec();
            ids.push(id);
            let full = self.decode(&ids)?;
            if full.ends_with('\u{FFFD}') {
                continue;
            }
            // Earlier tokens that were themselves incomplete belong to this token's character:
            // only the clean ones before them are taken off.
            let mut clean_end = window.len();
            while clean_end > 0 && self.decode(&window[clean_end - 1..clean_end])?.ends_with('\u{FFFD}') {
                clean_end -= 1;
            }
            let clean = if clean_end > 0 { self.decode(&window[..clean_end])? } else { String::new() };
            if let Some(rest) = full.strip_prefix(clean.as_str()) {
                return Ok(rest.to_owned());
            }
            let common: usize =
                clean.chars().zip(full.chars()).take_while(|(a, b)| a == b).map(|(a, _)| a.len_utf8()).sum();
            return Ok(full[common..].to_owned());
        }
        Ok(String::new())
    }

    /// A byte-level token's own bytes (GPT-2's byte decoder over its vocabulary piece).
    fn raw_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let decoder = self.byte_decoder?;
        let piece = self.tokenizer.id_to_token(id)?;
        let raw: Option<Vec<u8>> = piece.chars().map(|c| decoder.get(&c).copied()).collect();
        raw.filter(|r| !r.is_empty())
    }

    /// The `bytes` shown beside a token's `name` (chat).
    pub fn bytes(&self, id: u32, name: &str) -> Vec<u8> {
        if self.style == NameStyle::Sglang {
            if let Some(raw) = self.raw_bytes(id) {
                return raw;
            }
        }
        name.as_bytes().to_vec()
    }

    /// The name completions show, which have no `bytes` beside it: SGLang writes a token that is
    /// a fragment of a character (its bytes not UTF-8 on their own) one character per byte
    /// (Latin-1), so no byte is lost; vLLM shows `name` as it is.
    pub fn completions_name(&self, id: u32, name: String) -> String {
        if self.style == NameStyle::Vllm || !name.contains('\u{FFFD}') {
            return name;
        }
        match self.raw_bytes(id) {
            Some(raw) if std::str::from_utf8(&raw).is_err() => raw.iter().map(|&b| char::from(b)).collect(),
            _ => name,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_decoder_covers_every_byte_once() {
        let d = gpt2_byte_decoder();
        assert_eq!(d.len(), 256);
        assert_eq!(d[&'A'], b'A');
        assert_eq!(d[&'Ġ'], b' ', "GPT-2 writes a space as Ġ");
        assert_eq!(d[&'Ċ'], b'\n');
    }
}
