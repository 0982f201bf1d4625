//! Prompt rendering and tokenization (the `kvgate-tokenizer` crate), built from the configuration.

use std::sync::Arc;

use kvgate_core::router::Router;
use kvgate_core::{BlockHasher, BlockKey, Namespace};
pub use kvgate_tokenizer::*;

mod pool;
pub use pool::{PoolError, TokenizePool, TOKENIZE_NICE};

use crate::config::TokenizerSpec;

/// Builds the configured tokenizer, with `cache_bytes` for its prompt cache (HuggingFace ones).
pub fn build(spec: &TokenizerSpec, cache_bytes: usize) -> Result<Arc<dyn PromptTokenizer>, TokenizeError> {
    Ok(match spec {
        TokenizerSpec::Builtin => Arc::new(BuiltinTokenizer),
        TokenizerSpec::Hf { path, chat_template, content_format, render } => {
            let content_format = match content_format.as_deref() {
                None => ContentFormat::Auto,
                Some(f) => f.parse().map_err(TokenizeError::Load)?,
            };
            // `auto` was resolved against the workers when the configuration was read.
            let rendering = match render.as_deref() {
                None | Some("auto") => Rendering::Vllm,
                Some(r) => r.parse().map_err(TokenizeError::Load)?,
            };
            let options = HfOptions {
                chat_template: chat_template.as_ref().map(Into::into),
                content_format,
                clock: None,
                prompt_cache_bytes: Some(cache_bytes),
                rendering,
            };
            // A model directory (SMG's --tokenizer-path, a HuggingFace snapshot) holds tokenizer.json.
            let path = std::path::Path::new(path);
            let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
            let tokenizer = HfTokenizer::load(&file, options)?;
            tracing::info!(%rendering, "chat requests are rendered into prompt ids as {rendering} renders them");
            if let Err(why) = tokenizer.prompt_cache() {
                tracing::info!(%why, "no prompt cache: every prompt is tokenized whole");
            }
            Arc::new(tokenizer)
        }
    })
}

/// Wants a prompt's ids only while every block of them so far is held by some worker and some held
/// block chains from the last of them ([`kvgate_tokenizer::routed`]): past the first block no
/// worker holds, none holds any later block either, and the route is decided by the blocks before
/// it.
pub struct HeldPrefixProbe<'a> {
    router: &'a Router,
    hasher: BlockHasher,
    block_size: usize,
    /// The key of the last block checked (the namespace's root before any).
    last: BlockKey,
    /// Blocks checked so far, all held.
    blocks: usize,
    keys: Vec<BlockKey>,
    /// Bytes it still lets the tokenizer run on (cache misses); `None`: no limit.
    budget: Option<usize>,
    /// Whether it declined a piece for the budget.
    deferred: bool,
}

impl<'a> HeldPrefixProbe<'a> {
    /// A probe for a prompt in `namespace`, against what `router`'s index holds now.
    pub fn new(router: &'a Router, namespace: Namespace) -> Self {
        HeldPrefixProbe {
            router,
            hasher: BlockHasher::new(),
            block_size: router.block_size().max(1) as usize,
            last: namespace.root(),
            blocks: 0,
            keys: Vec::new(),
            budget: None,
            deferred: false,
        }
    }

    /// Lets the tokenizer run on at most `bytes` of text the prompt cache does not hold: for a try
    /// on a thread that serves connections, where a long tokenization must not run.
    pub fn with_budget(mut self, bytes: usize) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Whether it declined to let the tokenizer run on more text (the tokenization then ended with
    /// `TokenizeError::Deferred`, whatever error the request reports).
    pub fn deferred(&self) -> bool {
        self.deferred
    }
}

impl RoutingProbe for HeldPrefixProbe<'_> {
    fn wants_more(&mut self, ids: &[u32]) -> bool {
        self.keys.clear();
        let mut parent = self.last;
        for block in ids[self.blocks * self.block_size..].chunks_exact(self.block_size) {
            parent = self.hasher.block_key(parent, block);
            self.keys.push(parent);
        }
        // All of them in one look at the index, which also says whether a block after them may be
        // held: when none chains from the last, the next text is not tokenized at all.
        if !self.router.may_hold_more(self.last, &self.keys) {
            return false;
        }
        self.blocks += self.keys.len();
        self.last = parent;
        true
    }

    fn may_tokenize(&mut self, bytes: usize) -> bool {
        match &mut self.budget {
            Some(left) if *left < bytes => {
                self.deferred = true;
                false
            }
            Some(left) => {
                *left -= bytes;
                true
            }
            None => true,
        }
    }
}
