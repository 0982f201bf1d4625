//! kvgate's built-in tokenizer: deterministic, file-free, roughly word-sized pieces.
//!
//! A piece is a run of letters and digits with at most one leading space, or any other single
//! character. Its id is a hash of the piece. Text that shares a prefix (up to a piece boundary)
//! shares the token prefix, which is all prefix caching needs. Chat messages render as
//! `<|role|>\ncontent\n` per message and end with `<|assistant|>\n`.

use kvgate_core::hashing::digest_str;
use serde_json::Value;

use crate::{content_text, PromptTokenizer, TokenizeError};

/// Vocabulary size of the built-in tokenizer.
pub const BUILTIN_VOCAB: u64 = 100_000;

/// The built-in tokenizer.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltinTokenizer;

impl BuiltinTokenizer {
    /// Token ids of `text`.
    pub fn encode(text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 1);
        let mut start = 0;
        let mut chars = text.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            let word_start =
                c.is_alphanumeric() || (c == ' ' && chars.peek().is_some_and(|(_, n)| n.is_alphanumeric()));
            if word_start {
                while chars.peek().is_some_and(|(_, n)| n.is_alphanumeric()) {
                    chars.next();
                }
            }
            let end = chars.peek().map_or(text.len(), |(j, _)| *j);
            out.push((digest_str(&text[i..end]) % BUILTIN_VOCAB) as u32);
            start = end;
        }
        debug_assert_eq!(start, text.len());
        out
    }

    /// The prompt a chat request renders to.
    pub fn render(messages: &[Value]) -> String {
        let mut s = String::new();
        for m in messages {
            let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
            s.push_str("<|");
            s.push_str(role);
            s.push_str("|>\n");
            s.push_str(&m.get("content").map(content_text).unwrap_or_default());
            s.push('\n');
        }
        s.push_str("<|assistant|>\n");
        s
    }
}

impl PromptTokenizer for BuiltinTokenizer {
    fn describe(&self) -> String {
        "builtin".into()
    }

    fn encode_prompt(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        Ok(Self::encode(text))
    }

    fn render_chat(&self, body: &Value) -> Result<String, TokenizeError> {
        let messages = body.get("messages").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
        Ok(Self::render(messages))
    }

    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        Ok(Self::encode(&self.render_chat(body)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn shared_text_prefixes_share_token_prefixes() {
        let a = BuiltinTokenizer::encode("You are a helpful assistant. Question one?");
        let b = BuiltinTokenizer::encode("You are a helpful assistant. Another question!");
        assert_eq!(a[..6], b[..6]);
        assert_ne!(a, b);
        assert_eq!(BuiltinTokenizer::encode("hello world").len(), 2);
        assert!(BuiltinTokenizer::encode("").is_empty());
        assert_eq!(BuiltinTokenizer::encode("naïve 東京, ok").len(), 4, "naïve | 東京 | , | ok");
    }

    #[test]
    fn chat_renders_every_message_then_the_generation_prompt() {
        let m = vec![
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
        ];
        assert_eq!(BuiltinTokenizer::render(&m), "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n");
    }
}
