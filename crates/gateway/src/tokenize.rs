//! Prompt rendering and tokenization (the `kvgate-tokenizer` crate), built from the configuration.

use std::sync::Arc;

pub use kvgate_tokenizer::*;

use crate::config::TokenizerSpec;

/// Builds the configured tokenizer, with `cache_bytes` for its prompt cache (HuggingFace ones).
pub fn build(spec: &TokenizerSpec, cache_bytes: usize) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
    Ok(match spec {
        TokenizerSpec::Builtin => Arc::new(BuiltinTokenizer),
        TokenizerSpec::Hf { path, chat_template, content_format } => {
            let content_format = match content_format.as_deref() {
                None => ContentFormat::Auto,
                Some(f) => f.parse().map_err(TokenizeError::Load)?,
            };
            let options = HfOptions {
                chat_template: chat_template.as_ref().map(Into::into),
                content_format,
                clock: None,
                prompt_cache_bytes: Some(cache_bytes),
            };
            // A model directory (SMG's --tokenizer-path, a HuggingFace snapshot) holds tokenizer.json.
            let path = std::path::Path::new(path);
            let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
            let tokenizer = HfTokenizer::load(&file, options)?;
            if let Err(why) = tokenizer.prompt_cache() {
                tracing::info!(%why, "no prompt cache: every prompt is tokenized whole");
            }
            Arc::new(tokenizer)
        }
    })
}
