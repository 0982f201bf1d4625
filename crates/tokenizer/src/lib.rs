//! Prompt rendering and tokenization: the token ids an engine will compute for a request.
//!
//! The router's token ids must equal the engine's for the same request, byte for byte, or every block
//! key after the first difference is different and a prompt the engine holds in cache earns no
//! credit. So this crate renders chat requests exactly as vLLM renders them:
//!
//! ```text
//! chat body ─► conversation (vLLM's message rebuilding) ─► template (HF's Jinja settings) ─► text
//!           ─► tokenizer.json (HuggingFace `tokenizers`, special tokens as the engine adds them) ─► ids
//! ```
//!
//! - [`builtin`]: kvgate's file-free tokenizer, which kvgate's mock engine shares.
//! - [`hf`]: a model's `tokenizer.json` with its chat template, found wherever `transformers` saves
//!   it (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`).
//! - [`template`]: the chat template compiled as `transformers` compiles it, and vLLM's detection of
//!   whether it wants content as a string or as a list of parts.
//! - [`prompt_cache`]: token ids of long prompts reused chunk by chunk, cut only where the
//!   tokenizer provably splits.
//! - [`routed`]: a prompt tokenized only as far as routing needs, the rest estimated.
//! - [`detokenize`]: output token ids back to text as the engine's own server does, stop strings
//!   included, for workers that answer with token ids only; [`token_names`]: each token's text in
//!   a response's `logprobs`, as each runtime's server shows it.
//! - [`conversation`]: a request's messages, tools and template arguments as vLLM hands them over;
//!   [`sglang`]: the same as SGLang hands them over ([`Rendering`] picks one).
//! - [`pyjson`], [`strftime`]: Python's `json.dumps` and `strftime`, which templates call.
//!
//! The real-engine suite (`crates/real-engines`) checks all of it against the prompt ids a running
//! vLLM and SGLang report.

#![forbid(unsafe_code)]

pub mod builtin;
pub mod conversation;
pub mod detokenize;
pub mod hf;
pub mod prompt_cache;
pub mod pyjson;
pub mod request;
pub mod routed;
pub mod sglang;
pub mod strftime;
pub mod template;
pub mod token_names;

use serde_json::Value;

pub use builtin::BuiltinTokenizer;
pub use hf::{HfOptions, HfTokenizer, Rendering};
pub use routed::{PromptIds, RoutingProbe, Untokenized};
pub use template::ContentFormat;

/// Why a prompt could not be rendered or tokenized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizeError {
    /// The chat template failed on these messages.
    #[error("cannot render the chat template: {0}")]
    Template(String),
    /// The tokenizer failed.
    #[error("cannot tokenize the prompt: {0}")]
    Encode(String),
    /// Token ids could not be turned back into text.
    #[error("cannot decode token ids: {0}")]
    Decode(String),
    /// The tokenizer files could not be loaded.
    #[error("cannot load the tokenizer: {0}")]
    Load(String),
    /// The routing probe declined to tokenize more here ([`RoutingProbe::may_tokenize`]).
    #[error("tokenizing was deferred to where it may take long")]
    Deferred,
}

/// Renders chat requests into prompts and turns prompts into token ids.
pub trait PromptTokenizer: Send + Sync {
    /// A short description for logs.
    fn describe(&self) -> String;
    /// Token ids of a raw prompt (as `/v1/completions` sends it). `add_special_tokens` adds what the
    /// tokenizer's post-processor adds (BOS), as engines do for completions unless told otherwise.
    fn encode_prompt(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError>;
    /// The prompt text a chat request renders to (`body` is the whole request: messages, tools,
    /// `chat_template_kwargs`, `add_generation_prompt`, ...).
    fn render_chat(&self, body: &Value) -> Result<String, TokenizeError>;
    /// Token ids of a chat request, as the engine computes them.
    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError>;
    /// [`encode_prompt`](Self::encode_prompt) from the start only for as long as `probe` wants more
    /// ids ([`routed`]); tokenizers without exact cuts tokenize the whole prompt.
    fn encode_prompt_routed(
        &self,
        text: &str,
        add_special_tokens: bool,
        probe: &mut dyn RoutingProbe,
    ) -> Result<PromptIds, TokenizeError> {
        if !probe.may_tokenize(text.len()) {
            return Err(TokenizeError::Deferred);
        }
        self.encode_prompt(text, add_special_tokens).map(PromptIds::whole)
    }
    /// [`encode_chat`](Self::encode_chat) from the start only for as long as `probe` wants more.
    fn encode_chat_routed(&self, body: &Value, probe: &mut dyn RoutingProbe) -> Result<PromptIds, TokenizeError> {
        // The prompt's length is known only once rendered, and rendering is half the work: ask
        // for all of it rather than render twice.
        if !probe.may_tokenize(usize::MAX) {
            return Err(TokenizeError::Deferred);
        }
        self.encode_chat(body).map(PromptIds::whole)
    }
    /// Whether the `_routed` calls can stop early; tokenizers that always tokenize whole say no,
    /// and a caller need not try them where only a short tokenization may run.
    fn tokenizes_partially(&self) -> bool {
        false
    }
    /// The ids of what an `_routed` call left untokenized, to append to the ids it returned.
    fn finish(&self, rest: &Untokenized) -> Result<Vec<u32>, TokenizeError> {
        let _ = rest;
        Err(TokenizeError::Encode("this tokenizer never leaves part of a prompt untokenized".into()))
    }
    /// Whose way of turning requests into prompts this tokenizer reproduces.
    fn rendering(&self) -> Rendering {
        Rendering::Vllm
    }
    /// The largest token id of the vocabulary, special tokens included, where ids name vocabulary
    /// entries (`None` for the built-in tokenizer, whose ids are hashes): a client's token-id
    /// prompt beyond it is refused.
    fn max_token_id(&self) -> Option<u32> {
        None
    }
    /// What the prompt cache has done, for tokenizers that have one.
    fn prompt_cache_stats(&self) -> Option<prompt_cache::PromptCacheStats> {
        None
    }
    /// A detokenizer for the output of a sequence generated after `prompt`; `None` for a tokenizer
    /// whose ids cannot be turned back into text (the built-in one, which hashes its pieces).
    fn detokenizer(&self, prompt: &[u32], skip_special_tokens: bool) -> Option<detokenize::Detokenizer> {
        let _ = (prompt, skip_special_tokens);
        None
    }
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
