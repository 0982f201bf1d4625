//! Tokenizer and chat-template parity: the token ids kvgate computes are the ids the engine runs.
//! Without parity every block key differs and no cached prompt earns credit.

use std::sync::Arc;

use anyhow::bail;
use kvgate_real_engines::fleet::{model_dir, Fleet, Runtime};
use kvgate_real_engines::gateway::{engine_prompt_ids, engine_tokenize, test_overrides, Gateway};
use kvgate_real_engines::text;
use kvgate_tokenizer::{HfOptions, HfTokenizer, PromptTokenizer, Rendering};
use serde_json::{json, Value};

/// A string-content template (no loop over content), so text parts are joined as vLLM joins them.
const STRING_TEMPLATE: &str = include_str!("../../../../scripts/real-engines/templates/chatml-string.jinja");

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "The weather <now> in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Paris, 東京"},
        "days": {"type": "integer", "default": 3}, "scale": {"type": "number", "minimum": 0.5}}, "required": ["city"]}}})
}

/// Twenty chat requests covering what clients send.
fn chats() -> Vec<Value> {
    let long = text("long", 400);
    let turns: Vec<Value> = (0..10)
        .flat_map(|i| {
            [
                json!({"role": "user", "content": format!("question {i}: {}", text(&format!("q{i}"), 12))}),
                json!({"role": "assistant", "content": format!("answer {i}: {}", text(&format!("a{i}"), 9))}),
            ]
        })
        .chain([json!({"role": "user", "content": "and finally?"})])
        .collect();
    vec![
        json!({"messages": [{"role": "user", "content": "Hello there!"}]}),
        json!({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]}),
        json!({"messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "One"}, {"role": "assistant", "content": "Un"},
            {"role": "user", "content": "Two"}, {"role": "assistant", "content": "Deux"},
            {"role": "user", "content": "Three"}]}),
        json!({"messages": [{"role": "user", "content": "naïve café, 東京の天気は？ 你好，世界 🙂🚀 Привет ß ü"}]}),
        json!({"messages": [{"role": "system", "content": long}, {"role": "user", "content": "Summarise."}]}),
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]}]}),
        json!({"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": [weather_tool()]}),
        json!({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
            {"role": "user", "content": "Thanks"}], "tools": [weather_tool()]}),
        json!({"messages": [{"role": "developer", "content": "Follow the house rules."}, {"role": "user", "content": "hi"}]}),
        json!({"messages": [{"role": "user", "content": "  leading and trailing whitespace\t\n\n  "}]}),
        json!({"messages": [{"role": "user", "content": ""}]}),
        json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null}, {"role": "user", "content": "y"}]}),
        json!({"messages": [{"role": "user", "name": "alice", "content": "I am Alice."}, {"role": "user", "name": "bob", "content": "I am Bob."}]}),
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "cached part", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "rest"}]}]}),
        json!({"messages": [{"role": "user", "content": "No generation prompt."}], "add_generation_prompt": false}),
        json!({"messages": [{"role": "user", "content": "Start the answer"}, {"role": "assistant", "content": "Sure, the answer is"}],
               "continue_final_message": true, "add_generation_prompt": false}),
        json!({"messages": [{"role": "user", "content": "kwargs"}], "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"messages": [{"role": "system", "content": "Rule one."}, {"role": "system", "content": "Rule two."}, {"role": "user", "content": "go"}]}),
        json!({"messages": [{"role": "user", "content": "think"}, {"role": "assistant", "content": "done", "reasoning": "hmm"}, {"role": "user", "content": "ok"}]}),
        json!({"messages": turns}),
    ]
}

/// Completion prompts: what `/v1/completions` sends, with and without BOS.
fn prompts() -> Vec<Value> {
    let mut out = Vec::new();
    for p in [
        "Hello, world!",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "naïve café 東京 🙂",
        "   leading spaces\tand\ttabs\n\n\nnewlines   ",
        "text with a special token inside <|eot_id|> and after",
        &text("completion", 300),
    ] {
        out.push(json!({"prompt": p}));
        out.push(json!({"prompt": p, "add_special_tokens": false}));
    }
    out
}

/// The chats a runtime is asked: vLLM refuses `tool_choice: "auto"` without a tool parser, so its
/// requests with tools say `"none"` (which still renders them there); SGLang renders tools only when
/// the choice is not `"none"`, so it is asked both ways.
fn chats_for(runtime: Runtime) -> Vec<Value> {
    let mut out = Vec::new();
    for body in chats() {
        if body.get("tools").is_none() {
            out.push(body);
            continue;
        }
        let choices: &[&str] = if runtime == Runtime::Sglang { &["auto", "none"] } else { &["none"] };
        for choice in choices {
            let mut b = body.clone();
            b["tool_choice"] = json!(choice);
            out.push(b);
        }
    }
    out
}

/// Compares kvgate's ids for each body with the prompt ids the engine ran and, on vLLM, with its
/// `/tokenize`. (SGLang's `/tokenize` reads `add_generation_prompt`, which its chat completions
/// ignore, so there the ids it ran are the reference.)
async fn compare(
    label: &str,
    engine: &str,
    runtime: Runtime,
    bodies: &[Value],
    kvgate: impl Fn(&Value) -> anyhow::Result<Vec<u32>>,
    failures: &mut Vec<String>,
) -> anyhow::Result<usize> {
    let mut checked = 0;
    for (i, body) in bodies.iter().enumerate() {
        let ours = match kvgate(body) {
            Ok(ids) => ids,
            Err(e) => {
                failures.push(format!("{label} #{i}: kvgate failed: {e:#}"));
                continue;
            }
        };
        let ran = engine_prompt_ids(engine, body).await?;
        let tokenize = match runtime {
            Runtime::Vllm => engine_tokenize(engine, body).await?,
            Runtime::Sglang => ran.clone(),
        };
        if ours != tokenize || ours != ran {
            failures.push(format!(
                "{label} #{i}: kvgate {} tokens, engine /tokenize {}, engine ran {}; first difference at {:?}; body {body}",
                ours.len(),
                tokenize.len(),
                ran.len(),
                ours.iter().zip(&tokenize).position(|(a, b)| a != b)
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

pub async fn chat_and_completion_token_ids_match_the_engines_own(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let engine = fleet.engine("a");
    let gw = Gateway::start("", test_overrides(&[engine])).await?;
    let runtime = engine.spec.runtime;
    let mut failures = Vec::new();
    assert_eq!(chats().len(), 20);
    let chats = chats_for(runtime);
    let prompts = prompts();

    // Through the gateway, configured as a user would: tokenizer.json, template found beside it
    // (current transformers writes chat_template.jinja).
    let mut through_gateway = Vec::new();
    for body in chats.iter().chain(&prompts) {
        through_gateway.push(gw.tokenize(body).await);
    }
    let by_gateway = std::sync::Mutex::new(through_gateway.into_iter());
    let all: Vec<Value> = chats.iter().chain(&prompts).cloned().collect();
    let mut n =
        compare("gateway", &engine.url(), runtime, &all, |_| by_gateway.lock().unwrap().next().unwrap(), &mut failures)
            .await?;

    // The older layout: the template inline in tokenizer_config.json.
    let rendering = match runtime {
        Runtime::Vllm => Rendering::Vllm,
        Runtime::Sglang => Rendering::Sglang,
    };
    let inline = HfTokenizer::load(
        &model_dir().join("tokenizer-inline/tokenizer.json"),
        HfOptions { rendering, ..HfOptions::default() },
    )?;
    if !inline.template_origin().is_some_and(|p| p.ends_with("tokenizer_config.json")) {
        bail!("the inline tokenizer's template came from {:?}", inline.template_origin());
    }
    n += compare(
        "tokenizer_config.json template",
        &engine.url(),
        runtime,
        &chats,
        |b| Ok(inline.encode_chat(b)?),
        &mut failures,
    )
    .await?;

    // A template that takes content as one string: vLLM joins parts with newlines; SGLang ignores a
    // request's own template, and so must kvgate rendering as SGLang does.
    let string_chats: Vec<Value> = chats
        .iter()
        .filter(|c| c.get("continue_final_message").is_none())
        .map(|c| {
            let mut c = c.clone();
            c["chat_template"] = json!(STRING_TEMPLATE);
            c
        })
        .collect();
    n += compare(
        "string-content template",
        &engine.url(),
        runtime,
        &string_chats,
        |b| Ok(inline.encode_chat(b)?),
        &mut failures,
    )
    .await?;
    gw.stop().await;
    if !failures.is_empty() {
        bail!("{} of {n} requests differ:\n{}", failures.len(), failures.join("\n"));
    }
    eprintln!("    parity on {runtime}: {n} requests, every one equal to the prompt the engine ran");
    Ok(())
}
