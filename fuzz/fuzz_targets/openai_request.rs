//! A client's request body for each OpenAI endpoint (the first byte picks it), parsed, rendered
//! with a chat template of the usual shape (system prompt, tools, tool calls and results, content
//! parts) and tokenized, as the gateway does before routing.
#![no_main]

use std::sync::OnceLock;

use kvgate_tokenizer::request::{parse, Endpoint};
use kvgate_tokenizer::{HfOptions, HfTokenizer};
use libfuzzer_sys::fuzz_target;

/// A chat template exercising what real ones do with hostile messages: loops over messages and
/// their parts, tool calls with JSON arguments, filters, conditionals on roles, raising errors.
const TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' ~ message.role) }}{% endif %}
{%- if message.content is string %}{% set text = message.content %}
{%- elif message.content is iterable %}{% set text = namespace(v='') %}{% for part in message.content %}{% if part.type == 'text' %}{% set text.v = text.v ~ part.text %}{% endif %}{% endfor %}{% set text = text.v %}
{%- else %}{% set text = '' %}{% endif %}
<|im_start|>{{ message.role }}
{{ text | trim }}
{%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% endif %}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"#;

/// A small word-level tokenizer: the parsing and rendering are what is fuzzed, not BPE.
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
"added_tokens":[{"id":1,"content":"<|im_start|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
{"id":2,"content":"<|im_end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"[UNK]":0,"<|im_start|>":1,"<|im_end|>":2,"user":3,"assistant":4,"system":5,"hello":6},"unk_token":"[UNK]"}}"#;

fn tokenizer() -> &'static HfTokenizer {
    static TOKENIZER_ONCE: OnceLock<HfTokenizer> = OnceLock::new();
    TOKENIZER_ONCE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvgate-fuzz-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary folder");
        std::fs::write(dir.join("tokenizer.json"), TOKENIZER).expect("write tokenizer.json");
        let config =
            serde_json::json!({"chat_template": TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write tokenizer_config.json");
        HfTokenizer::load(&dir.join("tokenizer.json"), HfOptions::default()).expect("the fuzz tokenizer loads")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(rest) else { return };
    let endpoint = Endpoint::ALL[usize::from(mode) % Endpoint::ALL.len()];
    if let Ok(parsed) = parse(endpoint, &body, tokenizer(), 256) {
        let _ = parsed.prompt_tokens();
    }
});
