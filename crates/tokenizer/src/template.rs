//! A model's chat template, compiled the way HuggingFace `transformers` compiles it.
//!
//! `transformers` renders with Jinja2 in an `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` with the `loopcontrols` extension, its own `tojson` (Python's `json.dumps`,
//! not Jinja's HTML-escaping one), and the globals `raise_exception` and `strftime_now`; it also
//! knows a `{% generation %}` block tag that only marks assistant text. This module sets minijinja up
//! the same way, so the same messages render to the same bytes: one stray newline is one token, and
//! one token shifts every block key after it.
//!
//! It also tells which content format the template expects (`engine-protocols.md` says nothing about
//! it; vLLM's `renderers/hf.py` does): templates that loop over a message's `content` get the OpenAI
//! list of parts, the others get one string.

use std::sync::Arc;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use regex::Regex;

use crate::pyjson::{dumps, DumpOptions};
use crate::strftime::{self, DateTime};
use crate::TokenizeError;

/// How message `content` reaches the template (vLLM's `--chat-template-content-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentFormat {
    /// Detect it from the template, as vLLM does.
    #[default]
    Auto,
    /// One string per message; text parts are joined with newlines.
    String,
    /// The OpenAI list of parts, each `{"type": "text", "text": ...}`.
    OpenAi,
}

impl std::str::FromStr for ContentFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ContentFormat::Auto),
            "string" => Ok(ContentFormat::String),
            "openai" => Ok(ContentFormat::OpenAi),
            other => Err(format!("unknown chat template content format {other:?} (auto, string or openai)")),
        }
    }
}

/// Unix seconds now; templates that print the date read it.
pub type WallClock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    content_format: ContentFormat,
    /// The format configured, or `Auto` when it is detected.
    configured_format: ContentFormat,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("content_format", &self.content_format).finish_non_exhaustive()
    }
}

const NAME: &str = "chat";

/// `{% generation %}` and `{% endgeneration %}` (HuggingFace's assistant-mask markers) render their
/// body unchanged when no mask is asked for, which is always the case when serving.
fn strip_generation_tags(source: &str) -> String {
    static TAG: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let tag = TAG.get_or_init(|| Regex::new(r"\{%(-?)\s*(?:end)?generation\s*(-?)%\}").expect("valid regex"));
    // Keep the whitespace control of the tag: an empty `{%- -%}`-trimmed expression does the same.
    tag.replace_all(source, "{%${1} if true ${2}%}{%${1} endif ${2}%}").into_owned()
}

impl ChatTemplate {
    /// Compiles `source`. `format` is the content format to use, or `Auto` to detect it.
    pub fn compile(source: &str, format: ContentFormat, clock: WallClock) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", move |fmt: String| -> String {
            strftime::format(&DateTime::from_unix(clock()), &fmt)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, strip_generation_tags(source))
            .map_err(|e| TokenizeError::Load(format!("chat template does not compile: {e:#}")))?;
        let content_format = match format {
            ContentFormat::Auto => detect_content_format(source),
            given => given,
        };
        Ok(ChatTemplate { env, source: source.to_owned(), content_format, configured_format: format })
    }

    /// The content format in use (detected or configured).
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// The content format SGLang uses: the configured one, else SGLang's own detection, which
    /// differs from vLLM's ([`detect_sglang_content_format`]).
    pub fn sglang_content_format(&self) -> ContentFormat {
        match self.configured_format {
            ContentFormat::Auto => detect_sglang_content_format(&self.source),
            given => given,
        }
    }

    /// Whether the template mentions the `developer` role (vLLM turns it into `system` otherwise).
    pub fn knows_developer_role(&self) -> bool {
        self.source.contains("\"developer\"") || self.source.contains("'developer'")
    }

    /// Whether the template reads `field` (`continue_final_message` needs it to).
    pub fn mentions(&self, field: &str) -> bool {
        self.source.contains(field)
    }

    /// Renders with `context` (messages, tools, special tokens, kwargs).
    pub fn render(&self, context: Value) -> Result<String, TokenizeError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| TokenizeError::Template(e.to_string()))?;
        tmpl.render(context).map_err(|e| TokenizeError::Template(template_error(&e)))
    }
}

/// The most specific message of a render error: a template's own `raise_exception` text if any.
fn template_error(e: &Error) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation => e.detail().map_or_else(|| e.to_string(), str::to_owned),
        _ => format!("{e:#}"),
    }
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |e: String| Error::new(ErrorKind::InvalidOperation, e);
    let mut opts = DumpOptions {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        ..DumpOptions::default()
    };
    let indent: Option<Value> = kwargs.get("indent")?;
    opts.indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v.as_i64().unwrap_or(0)).unwrap_or(0))),
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    if let Some(sep) = separators.filter(|s| !s.is_none()) {
        let parts: Vec<Value> = sep.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] => {
                opts.separators = Some((item.to_string(), key.to_string()));
            }
            _ => return Err(bad("tojson: separators must be a pair".into())),
        }
    }
    opts.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    // Marked safe so that an auto-escaping template does not escape it a second time.
    dumps(&value, &opts).map(Value::from_safe_string).map_err(bad)
}

/// vLLM's content-format detection (`_detect_content_format`): "openai" if some `{% for %}` loop
/// iterates over a message's content, else "string".
///
/// vLLM walks Jinja's AST; this reads the same statements from the source text. Message variables are
/// the targets of loops over `messages` (or over a variable set from it); a content loop iterates
/// `<message>.content` or `<message>['content']` (through filters and slices), or a bare `content`.
pub fn detect_content_format(source: &str) -> ContentFormat {
    static FOR: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    static SET: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let for_re = FOR.get_or_init(|| {
        Regex::new(r"\{%-?\s*for\s+([A-Za-z_][A-Za-z0-9_]*)(?:\s*,\s*[A-Za-z_][A-Za-z0-9_]*)?\s+in\s+(.+?)\s*-?%\}")
            .expect("valid regex")
    });
    let set_re = SET.get_or_init(|| {
        Regex::new(r"\{%-?\s*set\s+([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+?)\s*-?%\}").expect("valid regex")
    });
    // The variable an iterable expression reads, ignoring filters, tests, slices and calls.
    let base = |expr: &str| -> String {
        let e = expr.trim().trim_start_matches('(');
        let end = e
            .find(|c: char| {
                !(c.is_alphanumeric() || c == '_' || c == '.' || c == '[' || c == ']' || c == '\'' || c == '"')
            })
            .unwrap_or(e.len());
        let mut e = &e[..end];
        // `x[1:]`-style slices were cut at ':'; drop a dangling `[`.
        if let Some(i) = e.rfind('[') {
            if !e[i..].contains(']') {
                e = &e[..i];
            }
        }
        e.to_owned()
    };
    let mut message_lists = vec!["messages".to_owned()];
    for _ in 0..4 {
        for cap in set_re.captures_iter(source) {
            let (name, rhs) = (cap[1].to_owned(), base(&cap[2]));
            if message_lists.contains(&rhs) && !message_lists.contains(&name) {
                message_lists.push(name);
            }
        }
    }
    let mut message_vars = Vec::new();
    for cap in for_re.captures_iter(source) {
        if message_lists.contains(&base(&cap[2])) {
            message_vars.push(cap[1].to_owned());
        }
    }
    for cap in for_re.captures_iter(source) {
        let iter = base(&cap[2]);
        let content_of = |m: &String| {
            iter == format!("{m}.content") || iter == format!("{m}['content']") || iter == format!("{m}[\"content\"]")
        };
        if iter == "content" || message_vars.iter().any(content_of) {
            return ContentFormat::OpenAi;
        }
    }
    ContentFormat::String
}

/// SGLang's content-format detection (`detect_jinja_template_content_format`): "openai" for a
/// template that names a modality or loops over `message`'s, `msg`'s or `m`'s content, else "string".
pub fn detect_sglang_content_format(source: &str) -> ContentFormat {
    static LOOP: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    if ["image", "audio", "video", "vision"].iter().any(|k| source.contains(k)) {
        return ContentFormat::OpenAi;
    }
    let content_loop = LOOP.get_or_init(|| {
        Regex::new(
            r#"\{%-?\s*for\s+[A-Za-z_][A-Za-z0-9_]*(?:\s*,\s*[A-Za-z_][A-Za-z0-9_]*)?\s+in\s+\(?\s*(?:message|msg|m)\s*(?:\.content|\[\s*['"]content['"]\s*\])"#,
        )
        .expect("valid regex")
    });
    if content_loop.is_match(source) {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::context;

    fn clock() -> WallClock {
        Arc::new(|| 1_721_997_296)
    }

    #[test]
    fn blocks_are_trimmed_and_stripped_as_transformers_does() {
        let t = ChatTemplate::compile(
            "{% for m in messages %}\n  {% if true %}\n[{{ m }}]\n  {% endif %}\n{% endfor %}\n",
            ContentFormat::Auto,
            clock(),
        )
        .unwrap();
        assert_eq!(t.render(context! { messages => vec!["a", "b"] }).unwrap(), "[a]\n[b]\n");
    }

    #[test]
    fn tojson_is_pythons_json_dumps_and_the_clock_is_injected() {
        let t = ChatTemplate::compile(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ strftime_now('%d %b %Y') }}|{% generation %}g{% endgeneration %}",
            ContentFormat::Auto,
            clock(),
        )
        .unwrap();
        let x = Value::from_serialize(serde_json::json!({"b": "<é>", "a": [1, 2.0]}));
        assert_eq!(
            t.render(context! { x => x }).unwrap(),
            "{\"b\": \"<é>\", \"a\": [1, 2.0]}|{\n  \"b\": \"<é>\",\n  \"a\": [\n    1,\n    2.0\n  ]\n}|26 Jul 2024|g"
        );
    }

    #[test]
    fn raise_exception_surfaces_the_templates_own_message() {
        let t = ChatTemplate::compile(
            "{{ raise_exception('Only user and assistant roles') }}",
            ContentFormat::Auto,
            clock(),
        )
        .unwrap();
        assert_eq!(
            t.render(context! {}).unwrap_err().to_string(),
            "cannot render the chat template: Only user and assistant roles"
        );
    }

    #[test]
    fn content_loops_select_the_openai_format() {
        let openai = [
            "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}",
            "{%- for m in messages -%}{%- for c in m.content | selectattr('type', 'equalto', 'text') -%}{{ c.text }}{%- endfor -%}{%- endfor -%}",
            "{% set loop_messages = messages[1:] %}{% for msg in loop_messages %}{% for p in msg[\"content\"] %}{% endfor %}{% endfor %}",
            "{% for item in content %}{{ item }}{% endfor %}",
        ];
        for src in openai {
            assert_eq!(detect_content_format(src), ContentFormat::OpenAi, "{src}");
        }
        let string = [
            "{% for message in messages %}{{ message['content'] | trim }}{% endfor %}",
            "{% for message in messages %}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endfor %}",
        ];
        for src in string {
            assert_eq!(detect_content_format(src), ContentFormat::String, "{src}");
        }
    }

    #[test]
    fn the_content_format_is_detected_as_sglang_detects_it() {
        for src in [
            "{% for message in messages %}{% for c in message['content'] %}{% endfor %}{% endfor %}",
            "{% for m in messages %}{%- for part in m.content -%}{% endfor %}{% endfor %}",
            "{{ 'an image' }}",
        ] {
            assert_eq!(detect_sglang_content_format(src), ContentFormat::OpenAi, "{src}");
        }
        for src in [
            "{% for message in messages %}{{ message['content'] }}{% endfor %}",
            "{% for x in turn.content %}{% endfor %}",
        ] {
            assert_eq!(detect_sglang_content_format(src), ContentFormat::String, "{src}");
        }
    }
}
