//! Prompt rendering and tokenization.
//!
//! The router's token ids must equal the engine's for the same request, or cache credit is wrong:
//! configure the HuggingFace tokenizer (and chat template) the engines serve. The built-in tokenizer
//! needs no files and matches kvgate's mock engine; against real engines it still spreads load, but
//! its prefix matches are only approximate.

mod builtin;
mod hf;

use std::sync::Arc;

use serde_json::Value;

pub use builtin::BuiltinTokenizer;
pub use hf::HfTokenizer;

use crate::config::TokenizerSpec;

/// Why a prompt could not be rendered or tokenized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizeError {
    /// The chat template failed on these messages.
    #[error("cannot render the chat template: {0}")]
    Template(String),
    /// The tokenizer failed.
    #[error("cannot tokenize the prompt: {0}")]
    Encode(String),
    /// The tokenizer files could not be loaded.
    #[error("cannot load the tokenizer: {0}")]
    Load(String),
}

/// Renders chat messages into a prompt and turns prompts into token ids.
pub trait PromptTokenizer: Send + Sync {
    /// A short description for logs.
    fn describe(&self) -> String;
    /// Token ids of a raw prompt (as `/v1/completions` sends it).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;
    /// Token ids of a chat request: the messages rendered with the chat template, generation prompt
    /// appended. `body` is the whole request, for templates that read `tools` and the like.
    fn encode_chat(&self, messages: &[Value], body: &Value) -> Result<Vec<u32>, TokenizeError>;
}

/// Builds the configured tokenizer.
pub fn build(spec: &TokenizerSpec) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
    Ok(match spec {
        TokenizerSpec::Builtin => Arc::new(BuiltinTokenizer),
        TokenizerSpec::Hf { path, chat_template } => {
            Arc::new(HfTokenizer::load(path.as_ref(), chat_template.as_deref().map(AsRef::as_ref))?)
        }
    })
}

/// The text of a message's `content`: a string, or the `text` parts of an array of parts.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("")
        }
        _ => String::new(),
    }
}
