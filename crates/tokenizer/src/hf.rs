//! A HuggingFace `tokenizer.json` with the model's chat template, loaded as `transformers` loads a
//! saved tokenizer and rendered as vLLM renders a chat request.
//!
//! Where the template lives depends on the `transformers` version that saved the model:
//! `chat_template.jinja` beside the tokenizer (current versions, and it wins when both exist), or
//! `chat_template` inside `tokenizer_config.json` (a string, or a list of named templates with a
//! `default` and often a `tool_use` one), or, for some multimodal models, `chat_template.json`.
//! Special tokens (`bos_token`, `eos_token`, ...) come from `tokenizer_config.json` or
//! `special_tokens_map.json` and are template variables, as in `transformers`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::Value as JinjaValue;
use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use crate::conversation::{conversation, template_kwargs};
use crate::detokenize::Detokenizer;
use crate::prompt_cache::{Chunking, PromptCache, PromptCacheStats, DEFAULT_CACHE_BYTES};
use crate::routed::{PromptIds, RoutingProbe, Untokenized};
use crate::template::{ChatTemplate, ContentFormat, WallClock};
use crate::{PromptTokenizer, TokenizeError};

/// Options for loading a HuggingFace tokenizer.
#[derive(Clone, Default)]
pub struct HfOptions {
    /// The chat template: a `.jinja` file, or a `tokenizer_config.json` / `chat_template.json` that
    /// holds one. Without it the template is looked for beside `tokenizer.json`.
    pub chat_template: Option<PathBuf>,
    /// How message content reaches the template (vLLM's `--chat-template-content-format`).
    pub content_format: ContentFormat,
    /// Unix seconds for templates that print the date; the system clock when `None`.
    pub clock: Option<WallClock>,
    /// Memory for the token ids of long prompts' chunks, reused across requests
    /// ([`crate::prompt_cache`]); `None` for [`DEFAULT_CACHE_BYTES`], `Some(0)` for no cache.
    pub prompt_cache_bytes: Option<usize>,
    /// Whose rendering of a request to reproduce: the engines' prompt ids differ between vLLM and
    /// SGLang for some requests, and only equal ids earn cache credit.
    pub rendering: Rendering,
}

/// Which engine's way of turning a request into prompt ids to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rendering {
    /// vLLM's ([`crate::conversation`]): the default.
    #[default]
    Vllm,
    /// SGLang's ([`crate::sglang`]); completions always get the tokenizer's special tokens.
    Sglang,
}

impl std::str::FromStr for Rendering {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm" => Ok(Rendering::Vllm),
            "sglang" => Ok(Rendering::Sglang),
            other => Err(format!("unknown rendering {other:?} (vllm or sglang)")),
        }
    }
}

impl std::fmt::Display for Rendering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Rendering::Vllm => "vllm",
            Rendering::Sglang => "sglang",
        })
    }
}

impl std::fmt::Debug for HfOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfOptions")
            .field("chat_template", &self.chat_template)
            .field("content_format", &self.content_format)
            .field("prompt_cache_bytes", &self.prompt_cache_bytes)
            .field("rendering", &self.rendering)
            .finish_non_exhaustive()
    }
}

/// The special-token attributes `transformers` passes to every template.
const SPECIAL_TOKENS: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// The marker `transformers` appends to the final message for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A HuggingFace tokenizer and chat template.
pub struct HfTokenizer {
    /// Shared with the detokenizers of responses in flight.
    tokenizer: Arc<Tokenizer>,
    /// The default template, and named ones (`tool_use`, ...).
    template: Option<ChatTemplate>,
    named: BTreeMap<String, ChatTemplate>,
    special: Map<String, Value>,
    content_format: ContentFormat,
    clock: WallClock,
    source: String,
    template_origin: Option<PathBuf>,
    /// Ids of long prompts' chunks; `Err` says why there is none.
    prompt_cache: Result<PromptCache, String>,
    rendering: Rendering,
    /// The special tokens' ids, found once: every gRPC response asks for them.
    special_ids: Arc<HashSet<u32>>,
    /// The largest id of the vocabulary, added tokens included.
    max_token_id: Option<u32>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer").field("source", &self.source).finish_non_exhaustive()
    }
}

/// The system clock, for `strftime_now`: templates read the date when the engine renders them.
#[allow(clippy::disallowed_methods)] // the engine reads its own wall clock here; so must we
pub fn wall_clock() -> WallClock {
    Arc::new(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64))
}

fn read_json(path: &Path) -> Result<Value, TokenizeError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizeError::Load(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| TokenizeError::Load(format!("{}: {e}", path.display())))
}

fn special_token(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// Templates held by a JSON config's `chat_template`: one string, or `[{"name", "template"}]`.
fn templates_in(config: &Value) -> Vec<(String, String)> {
    match config.get("chat_template") {
        Some(Value::String(s)) => vec![("default".into(), s.clone())],
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(|t| Some((t.get("name")?.as_str()?.to_owned(), t.get("template")?.as_str()?.to_owned())))
            .collect(),
        _ => Vec::new(),
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json` and finds its chat template (see the module docs). A model without a
    /// template still tokenizes completion prompts; chat requests then fail with a message saying
    /// where the template was looked for.
    pub fn load(path: &Path, options: HfOptions) -> Result<Self, TokenizeError> {
        let tokenizer =
            Tokenizer::from_file(path).map_err(|e| TokenizeError::Load(format!("{}: {e}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() { read_json(&config_path)? } else { Value::Null };
        let mut special = Map::new();
        let map_path = dir.join("special_tokens_map.json");
        let map = if map_path.exists() { read_json(&map_path)? } else { Value::Null };
        for key in SPECIAL_TOKENS {
            if let Some(tok) = config.get(key).and_then(special_token).or_else(|| map.get(key).and_then(special_token))
            {
                special.insert(key.into(), Value::from(tok));
            }
        }
        let clock = options.clock.clone().unwrap_or_else(wall_clock);
        let (sources, origin) = Self::find_templates(dir, &config, options.chat_template.as_deref())?;
        let mut template = None;
        let mut named = BTreeMap::new();
        for (name, src) in sources {
            let compiled = ChatTemplate::compile(&src, options.content_format, clock.clone())
                .map_err(|e| TokenizeError::Load(format!("{name} chat template: {e}")))?;
            if name == "default" {
                template = Some(compiled);
            } else {
                named.insert(name, compiled);
            }
        }
        let tokenizer = Arc::new(tokenizer);
        let special_ids = Arc::new(crate::detokenize::special_ids(&tokenizer));
        let max_token_id = tokenizer.get_vocab(true).into_values().max();
        let prompt_cache = match options.prompt_cache_bytes.unwrap_or(DEFAULT_CACHE_BYTES) {
            0 => Err("turned off".to_owned()),
            bytes => PromptCache::new(tokenizer.clone(), bytes, Chunking::default()),
        };
        Ok(HfTokenizer {
            tokenizer,
            template,
            named,
            special,
            content_format: options.content_format,
            clock,
            source: match options.rendering {
                Rendering::Vllm => format!("hf:{}", path.display()),
                Rendering::Sglang => format!("hf:{} (rendered as SGLang renders)", path.display()),
            },
            template_origin: origin,
            prompt_cache,
            rendering: options.rendering,
            special_ids,
            max_token_id,
        })
    }

    /// The chat templates, by name, and the file they came from.
    #[allow(clippy::type_complexity)]
    fn find_templates(
        dir: &Path,
        config: &Value,
        given: Option<&Path>,
    ) -> Result<(Vec<(String, String)>, Option<PathBuf>), TokenizeError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|e| TokenizeError::Load(format!("chat template {}: {e}", p.display())))
        };
        if let Some(p) = given {
            if p.extension().is_some_and(|e| e == "json") {
                let found = templates_in(&read_json(p)?);
                if found.is_empty() {
                    return Err(TokenizeError::Load(format!("{} has no chat_template", p.display())));
                }
                return Ok((found, Some(p.to_path_buf())));
            }
            return Ok((vec![("default".into(), read(p)?)], Some(p.to_path_buf())));
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let mut found = vec![("default".to_owned(), read(&jinja)?)];
            // Named templates saved by `transformers` as `additional_chat_templates/NAME.jinja`.
            if let Ok(entries) = std::fs::read_dir(dir.join("additional_chat_templates")) {
                let mut extra: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
                extra.sort();
                for p in extra.into_iter().filter(|p| p.extension().is_some_and(|e| e == "jinja")) {
                    let name = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                    found.push((name, read(&p)?));
                }
            }
            return Ok((found, Some(jinja)));
        }
        let inline = templates_in(config);
        if !inline.is_empty() {
            return Ok((inline, Some(dir.join("tokenizer_config.json"))));
        }
        let processor = dir.join("chat_template.json");
        if processor.exists() {
            let found = templates_in(&read_json(&processor)?);
            if !found.is_empty() {
                return Ok((found, Some(processor)));
            }
        }
        Ok((Vec::new(), None))
    }

    /// Where the chat template came from, if there is one.
    pub fn template_origin(&self) -> Option<&Path> {
        self.template_origin.as_deref()
    }

    /// The template a request renders with: its own `chat_template` (vLLM accepts one with
    /// `--trust-request-chat-template`), the `tool_use` one when it has tools, or the default.
    fn template_for(&self, body: &Value) -> Result<std::borrow::Cow<'_, ChatTemplate>, TokenizeError> {
        if let Some(src) = body.get("chat_template").and_then(Value::as_str) {
            if let Some(named) = self.named.get(src) {
                return Ok(std::borrow::Cow::Borrowed(named));
            }
            let compiled = ChatTemplate::compile(src, self.content_format, self.clock.clone())?;
            return Ok(std::borrow::Cow::Owned(compiled));
        }
        self.template_by_tools(body.get("tools").is_some_and(|t| !t.is_null()))
    }

    /// The `tool_use` template when the template is handed tools and the model has one, else the
    /// default, as `transformers` picks.
    fn template_by_tools(&self, has_tools: bool) -> Result<std::borrow::Cow<'_, ChatTemplate>, TokenizeError> {
        if has_tools {
            if let Some(t) = self.named.get("tool_use") {
                return Ok(std::borrow::Cow::Borrowed(t));
            }
        }
        self.template.as_ref().or_else(|| self.named.values().next()).map(std::borrow::Cow::Borrowed).ok_or_else(|| {
            TokenizeError::Template(
                "no chat template: the model has no chat_template.jinja and no chat_template in tokenizer_config.json; \
                 pass --chat-template FILE"
                    .into(),
            )
        })
    }

    /// The prompt cache, or why there is none (turned off, or a tokenizer whose prompts cannot be
    /// cut exactly).
    pub fn prompt_cache(&self) -> Result<&PromptCache, &str> {
        self.prompt_cache.as_ref().map_err(String::as_str)
    }

    fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        if let Ok(cache) = &self.prompt_cache {
            if let Some(ids) = cache.encode(text, special_tokens) {
                return ids;
            }
        }
        crate::prompt_cache::ids_of(&self.tokenizer, text, special_tokens)
    }

    /// Whether raw prompts get the tokenizer's special tokens: SGLang adds them whatever the request
    /// says.
    fn adds_special_tokens(&self, asked: bool) -> bool {
        asked || self.rendering == Rendering::Sglang
    }

    /// A chat request rendered as SGLang renders it (never with a request's own template: its chat
    /// completions have none), and the continued assistant text it appends.
    fn render_sglang(&self, body: &Value) -> Result<(String, Option<String>), TokenizeError> {
        // SGLang hands the template tools only when the request's tool choice allows them.
        let tools = crate::sglang::tools(body)?;
        let template = self.template_by_tools(!tools.is_null())?;
        let chat = crate::sglang::chat(body, template.sglang_content_format())?;
        let mut context = self.special.clone();
        context.insert("tools".into(), tools);
        context.insert("documents".into(), Value::Null);
        context.extend(crate::sglang::template_kwargs(body));
        context.insert("messages".into(), Value::Array(chat.messages));
        Ok((template.render(JinjaValue::from_serialize(&context))?, chat.assistant_prefix))
    }

    /// The ids SGLang appends for continued assistant text: its own tokenization, a leading BOS
    /// taken off.
    fn assistant_prefix_ids(&self, prefix: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = crate::prompt_cache::ids_of(&self.tokenizer, prefix, true)?;
        let bos = self.special.get("bos_token").and_then(Value::as_str).and_then(|t| self.tokenizer.token_to_id(t));
        if bos.is_some() && ids.first().copied() == bos {
            ids.remove(0);
        }
        Ok(ids)
    }

    /// SGLang's chat ids for a rendered prompt: the prompt without special tokens, then any
    /// continued text.
    fn encode_sglang_rendered(&self, text: &str, prefix: Option<&str>) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = self.encode(text, false)?;
        if let Some(prefix) = prefix {
            ids.extend(self.assistant_prefix_ids(prefix)?);
        }
        Ok(ids)
    }

    fn encode_routed(
        &self,
        text: &str,
        special_tokens: bool,
        probe: &mut dyn RoutingProbe,
    ) -> Result<PromptIds, TokenizeError> {
        if let Ok(cache) = &self.prompt_cache {
            if let Some(ids) = cache.encode_routed(text, special_tokens, probe) {
                return ids;
            }
        }
        if !probe.may_tokenize(text.len()) {
            return Err(TokenizeError::Deferred);
        }
        crate::prompt_cache::ids_of(&self.tokenizer, text, special_tokens).map(PromptIds::whole)
    }
}

/// vLLM's chat default: the template writes BOS and role markers, so nothing more is added unless
/// the request asks.
fn chat_adds_special_tokens(body: &Value) -> bool {
    body.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(false)
}

/// Appends the continue tag to the final message's content (its last text part for lists).
fn tag_final_message(messages: &mut [Value]) -> Result<(), TokenizeError> {
    let missing =
        || TokenizeError::Template("continue_final_message is set but the final message has no content".into());
    let last = messages.last_mut().ok_or_else(missing)?;
    match last.get_mut("content") {
        Some(Value::String(s)) => s.push_str(CONTINUE_TAG),
        Some(Value::Array(parts)) => {
            let part = parts.iter_mut().rev().find_map(|p| p.get_mut("text")).ok_or_else(missing)?;
            let text = part.as_str().unwrap_or_default().to_owned();
            *part = Value::from(text + CONTINUE_TAG);
        }
        _ => return Err(missing()),
    }
    Ok(())
}

impl PromptTokenizer for HfTokenizer {
    fn describe(&self) -> String {
        self.source.clone()
    }

    fn max_token_id(&self) -> Option<u32> {
        self.max_token_id
    }

    fn encode_prompt(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.encode(text, self.adds_special_tokens(add_special_tokens))
    }

    fn encode_prompt_routed(
        &self,
        text: &str,
        add_special_tokens: bool,
        probe: &mut dyn RoutingProbe,
    ) -> Result<PromptIds, TokenizeError> {
        self.encode_routed(text, self.adds_special_tokens(add_special_tokens), probe)
    }

    fn tokenizes_partially(&self) -> bool {
        self.prompt_cache.is_ok()
    }

    fn encode_chat_routed(&self, body: &Value, probe: &mut dyn RoutingProbe) -> Result<PromptIds, TokenizeError> {
        if self.rendering == Rendering::Sglang {
            return match self.render_sglang(body)? {
                (text, None) => self.encode_routed(&text, false, probe),
                // Continued text is tokenized apart and appended: rare enough to tokenize whole.
                (_, Some(_)) if !probe.may_tokenize(usize::MAX) => Err(TokenizeError::Deferred),
                (text, Some(prefix)) => self.encode_sglang_rendered(&text, Some(&prefix)).map(PromptIds::whole),
            };
        }
        self.encode_routed(&self.render_chat(body)?, chat_adds_special_tokens(body), probe)
    }

    fn finish(&self, rest: &Untokenized) -> Result<Vec<u32>, TokenizeError> {
        match &self.prompt_cache {
            Ok(cache) => cache.finish(rest),
            Err(why) => Err(TokenizeError::Encode(format!("no prompt cache to finish a prompt with: {why}"))),
        }
    }

    fn rendering(&self) -> Rendering {
        self.rendering
    }

    fn prompt_cache_stats(&self) -> Option<PromptCacheStats> {
        self.prompt_cache.as_ref().ok().map(PromptCache::stats)
    }

    fn detokenizer(&self, prompt: &[u32], skip_special_tokens: bool) -> Option<Detokenizer> {
        Some(Detokenizer::new(self.tokenizer.clone(), self.special_ids.clone(), prompt, skip_special_tokens))
    }

    fn render_chat(&self, body: &Value) -> Result<String, TokenizeError> {
        if self.rendering == Rendering::Sglang {
            let (text, prefix) = self.render_sglang(body)?;
            return Ok(text + prefix.as_deref().unwrap_or_default());
        }
        let template = self.template_for(body)?;
        let messages = body.get("messages").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
        let mut messages = conversation(messages, template.content_format(), template.knows_developer_role());
        let mut kwargs = template_kwargs(body);
        // `transformers` consumes this one itself instead of passing it on.
        let continue_final = kwargs.shift_remove("continue_final_message").and_then(|v| v.as_bool()).unwrap_or(false);
        if continue_final {
            if !template.mentions("content") {
                return Err(TokenizeError::Template(
                    "continue_final_message is set but the chat template never reads `content`".into(),
                ));
            }
            tag_final_message(&mut messages)?;
        }
        let mut context = self.special.clone();
        context.extend(kwargs);
        context.insert("messages".into(), Value::Array(messages));
        context.entry("documents").or_insert(Value::Null);
        let rendered = template.render(JinjaValue::from_serialize(&context))?;
        if !continue_final {
            return Ok(rendered);
        }
        let tag = CONTINUE_TAG.trim();
        let at = rendered.rfind(tag).ok_or_else(|| {
            TokenizeError::Template("continue_final_message is set but the template dropped the final message".into())
        })?;
        Ok(if rendered[at..].starts_with(CONTINUE_TAG) {
            rendered[..at].to_owned()
        } else {
            rendered[..at].trim_end().to_owned()
        })
    }

    fn encode_chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        if self.rendering == Rendering::Sglang {
            let (text, prefix) = self.render_sglang(body)?;
            return self.encode_sglang_rendered(&text, prefix.as_deref());
        }
        self.encode(&self.render_chat(body)?, chat_adds_special_tokens(body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TOKENIZER: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "bos": 3, "user": 4, ":": 5, "assistant": 6}, "unk_token": "[UNK]"}
    }"#;
    const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %} {{ m['role'] }} : {{ m['content'].strip() }}{% endfor %}{% if add_generation_prompt %} assistant :{% endif %}";

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvgate-hf-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
        d
    }

    fn chat(t: &HfTokenizer) -> Vec<u32> {
        t.encode_chat(&json!({"messages": [{"role": "user", "content": " hello "}]})).unwrap()
    }

    #[test]
    fn the_template_is_found_in_tokenizer_config_json() {
        let d = dir("inline");
        std::fs::write(
            d.join("tokenizer_config.json"),
            json!({"bos_token": {"content": "bos"}, "chat_template": TEMPLATE}).to_string(),
        )
        .unwrap();
        let t = HfTokenizer::load(&d.join("tokenizer.json"), HfOptions::default()).unwrap();
        assert_eq!(t.encode_prompt("hello world", true).unwrap(), vec![1, 2]);
        assert_eq!(chat(&t), vec![3, 4, 5, 1, 6, 5]);
        assert_eq!(t.template_origin(), Some(d.join("tokenizer_config.json").as_path()));
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn chat_template_jinja_beside_the_tokenizer_wins() {
        let d = dir("jinja");
        std::fs::write(
            d.join("tokenizer_config.json"),
            json!({"bos_token": "bos", "chat_template": "ignored"}).to_string(),
        )
        .unwrap();
        std::fs::write(d.join("chat_template.jinja"), TEMPLATE).unwrap();
        let t = HfTokenizer::load(&d.join("tokenizer.json"), HfOptions::default()).unwrap();
        assert_eq!(chat(&t), vec![3, 4, 5, 1, 6, 5]);
        assert_eq!(t.template_origin(), Some(d.join("chat_template.jinja").as_path()));
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn named_templates_pick_tool_use_for_requests_with_tools() {
        let d = dir("named");
        let config = json!({"chat_template": [
            {"name": "default", "template": "{{ 'hello' }}"},
            {"name": "tool_use", "template": "{{ 'world' }}"}
        ]});
        std::fs::write(d.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = HfTokenizer::load(&d.join("tokenizer.json"), HfOptions::default()).unwrap();
        assert_eq!(t.render_chat(&json!({"messages": []})).unwrap(), "hello");
        assert_eq!(t.render_chat(&json!({"messages": [], "tools": []})).unwrap(), "world");
        // SGLang hands the template no tools for tool_choice none, so the default template renders.
        let sglang = HfOptions { rendering: Rendering::Sglang, ..HfOptions::default() };
        let t = HfTokenizer::load(&d.join("tokenizer.json"), sglang).unwrap();
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        assert_eq!(t.render_chat(&json!({"messages": [], "tools": tools})).unwrap(), "world");
        assert_eq!(t.render_chat(&json!({"messages": [], "tools": tools, "tool_choice": "none"})).unwrap(), "hello");
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn a_model_without_a_template_says_where_it_looked() {
        let d = dir("none");
        let t = HfTokenizer::load(&d.join("tokenizer.json"), HfOptions::default()).unwrap();
        let err = t.encode_chat(&json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap_err().to_string();
        assert!(err.contains("no chat template") && err.contains("chat_template.jinja"), "{err}");
        let missing = HfOptions { chat_template: Some(d.join("missing.jinja")), ..HfOptions::default() };
        assert!(HfTokenizer::load(&d.join("tokenizer.json"), missing).is_err());
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn continue_final_message_cuts_the_prompt_after_the_last_message() {
        let d = dir("continue");
        std::fs::write(d.join("chat_template.jinja"), "{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
            .unwrap();
        let t = HfTokenizer::load(&d.join("tokenizer.json"), HfOptions::default()).unwrap();
        let body = json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial"}],
                          "continue_final_message": true, "add_generation_prompt": false});
        assert_eq!(t.render_chat(&body).unwrap(), "<q><partial");
        std::fs::remove_dir_all(d).ok();
    }

    #[test]
    fn rendering_as_sglang_continues_a_final_assistant_message_with_its_own_ids() {
        let d = dir("sglang");
        std::fs::write(
            d.join("tokenizer_config.json"),
            json!({"bos_token": "bos", "chat_template": TEMPLATE}).to_string(),
        )
        .unwrap();
        let sglang = HfOptions { rendering: Rendering::Sglang, ..HfOptions::default() };
        let t = HfTokenizer::load(&d.join("tokenizer.json"), sglang).unwrap();
        assert_eq!(t.rendering(), Rendering::Sglang);
        assert!(t.describe().contains("SGLang"), "{}", t.describe());
        let messages = json!([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]);
        // Continued: the prompt up to the generation prompt, then the assistant's text on its own.
        let body = json!({"messages": messages, "continue_final_message": true, "add_generation_prompt": false});
        assert_eq!(t.encode_chat(&body).unwrap(), vec![3, 4, 5, 1, 6, 5, 2]);
        // Not continued: the final assistant message is the user's, and the generation prompt follows.
        assert_eq!(t.encode_chat(&json!({"messages": messages})).unwrap(), vec![3, 4, 5, 1, 4, 5, 2, 6, 5]);
        // A request's own template is not SGLang's to use.
        let own = json!({"messages": [{"role": "user", "content": "hello"}], "chat_template": "{{ 'world' }}"});
        assert_eq!(t.encode_chat(&own).unwrap(), vec![3, 4, 5, 1, 6, 5]);
        std::fs::remove_dir_all(d).ok();
    }
}
