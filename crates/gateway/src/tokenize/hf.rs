//! A HuggingFace `tokenizer.json` with the model's chat template (Jinja, rendered by minijinja).

use std::path::Path;

use minijinja::{context, Environment, Error, ErrorKind};
use serde_json::Value;
use tokenizers::Tokenizer;

use super::{PromptTokenizer, TokenizeError};

/// A HuggingFace tokenizer and chat template.
pub struct HfTokenizer {
    tokenizer: Tokenizer,
    env: Environment<'static>,
    has_template: bool,
    bos_token: String,
    eos_token: String,
    source: String,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer").field("source", &self.source).finish_non_exhaustive()
    }
}

fn special(config: &Value, key: &str) -> String {
    match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_owned(),
        _ => String::new(),
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json`. The chat template comes from `template` (a `tokenizer_config.json` or
    /// a `.jinja` file), or from a `tokenizer_config.json` next to the tokenizer.
    pub fn load(path: &Path, template: Option<&Path>) -> Result<Self, TokenizeError> {
        let tokenizer =
            Tokenizer::from_file(path).map_err(|e| TokenizeError::Load(format!("{}: {e}", path.display())))?;
        let sibling = path.with_file_name("tokenizer_config.json");
        let template_path = template.map(Path::to_path_buf).or_else(|| sibling.exists().then_some(sibling));
        let (mut source, mut bos_token, mut eos_token) = (None, String::new(), String::new());
        if let Some(tp) = &template_path {
            let text =
                std::fs::read_to_string(tp).map_err(|e| TokenizeError::Load(format!("{}: {e}", tp.display())))?;
            if tp.extension().is_some_and(|e| e == "json") {
                let config: Value =
                    serde_json::from_str(&text).map_err(|e| TokenizeError::Load(format!("{}: {e}", tp.display())))?;
                bos_token = special(&config, "bos_token");
                eos_token = special(&config, "eos_token");
                source = match config.get("chat_template") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Array(list)) => list
                        .iter()
                        .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                        .and_then(|t| t.get("template").and_then(Value::as_str))
                        .map(str::to_owned),
                    _ => None,
                };
            } else {
                source = Some(text);
            }
        }
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        let has_template = source.is_some();
        if let Some(src) = source {
            env.add_template_owned("chat", src).map_err(|e| TokenizeError::Load(format!("chat template: {e}")))?;
        }
        Ok(HfTokenizer { tokenizer, env, has_template, bos_token, eos_token, source: format!("hf:{}", path.display()) })
    }

    /// Renders chat messages with the template.
    pub fn render(&self, messages: &[Value], body: &Value) -> Result<String, TokenizeError> {
        if !self.has_template {
            return Err(TokenizeError::Template(
                "no chat template: pass --chat-template or put tokenizer_config.json beside tokenizer.json".into(),
            ));
        }
        let tmpl = self.env.get_template("chat").map_err(|e| TokenizeError::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            tools => body.get("tools"),
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| TokenizeError::Template(e.to_string()))
    }

    fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }
}

impl PromptTokenizer for HfTokenizer {
    fn describe(&self) -> String {
        self.source.clone()
    }

    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        // Engines add the tokenizer's special tokens (BOS) to raw completion prompts.
        self.encode(text, true)
    }

    fn encode_chat(&self, messages: &[Value], body: &Value) -> Result<Vec<u32>, TokenizeError> {
        // The template already writes BOS and role markers.
        self.encode(&self.render(messages, body)?, false)
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

    #[test]
    fn a_tokenizer_json_and_its_chat_template_load_and_encode() {
        let dir = std::env::temp_dir().join(format!("kvgate-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "bos"}, "chat_template": "{{ bos_token }}{% for m in messages %} {{ m['role'] }} : {{ m['content'].strip() }}{% endfor %}{% if add_generation_prompt %} assistant :{% endif %}"}"#,
        )
        .unwrap();
        let t = HfTokenizer::load(&dir.join("tokenizer.json"), None).unwrap();
        assert_eq!(t.encode_prompt("hello world").unwrap(), vec![1, 2]);
        let ids = t.encode_chat(&[json!({"role": "user", "content": " hello "})], &json!({})).unwrap();
        assert_eq!(ids, vec![3, 4, 5, 1, 6, 5]);
        let no_template = HfTokenizer::load(&dir.join("tokenizer.json"), Some(&dir.join("missing.jinja")));
        assert!(no_template.is_err());
        std::fs::remove_dir_all(dir).ok();
    }
}
