//! A real gRPC worker (`g`: the fleet's runtime served by `smg-grpc-servicer`, SMG's worker
//! protocol) behind kvgate, against the same engine's own OpenAI server (`a`): the same requests
//! give the same text, finish reason and usage; the worker's own KV events give credit equal to its
//! `cached_tokens`; a client that goes away aborts the worker's request.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context};
use futures_util::StreamExt;
use kvgate_real_engines::fleet::{Fleet, Runtime, MODEL};
use kvgate_real_engines::gateway::{cached_tokens, http, post, test_overrides, Gateway};
use serde_json::{json, Value};

/// What parity compares: each choice's text and finish reason, by index, the prompt and
/// completion token counts, and each choice's logprobs when asked.
pub type Outcome = (Vec<(String, String)>, u64, u64, Vec<Vec<Shown>>);

/// One token's logprobs as a response shows it: its name, its `bytes` (chat's; null in
/// completions), its log probability and its alternatives (name and log probability, by name).
pub type Shown = (String, Value, f64, Vec<(String, f64)>);

/// Log probabilities may differ in the last bits between two processes' runs of the same model.
const LOGPROB_TOLERANCE: f64 = 1e-3;

/// Whether two outcomes agree: all exactly, but log probabilities within the tolerance.
pub fn agree(a: &Outcome, b: &Outcome) -> bool {
    // NaN stands for a log probability shown as null (a prompt's first token).
    let near = |x: f64, y: f64| (x.is_nan() && y.is_nan()) || (x - y).abs() <= LOGPROB_TOLERANCE;
    let same_shown =
        |x: &Shown, y: &Shown| x.0 == y.0 && x.1 == y.1 && near(x.2, y.2) && same_alternatives(&x.0, &x.3, &y.3, near);
    (&a.0, a.1, a.2) == (&b.0, b.1, b.2)
        && a.3.len() == b.3.len()
        && a.3.iter().zip(&b.3).all(|(p, q)| p.len() == q.len() && p.iter().zip(q).all(|(x, y)| same_shown(x, y)))
}

/// Whether two lists of alternatives (sorted by name) to token `own` agree: the same log
/// probabilities, and the same names but at the cut. Tokens tied at the lowest value of the ranked
/// ones shown (`own` is shown whatever its rank) are cut arbitrarily (the top-k of tied logits),
/// and kvgate asks a vLLM worker one alternative more for completions (see `vllm_alternatives` in
/// the gateway), which may cut such a tie the other way.
fn same_alternatives(own: &str, x: &[(String, f64)], y: &[(String, f64)], near: impl Fn(f64, f64) -> bool) -> bool {
    if x.len() != y.len() {
        return false;
    }
    let values = |l: &[(String, f64)]| {
        let mut v: Vec<f64> = l.iter().map(|a| a.1).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    if !values(x).iter().zip(&values(y)).all(|(a, b)| near(*a, *b)) {
        return false;
    }
    let ranked: Vec<(String, f64)> = x.iter().filter(|a| a.0 != own).cloned().collect();
    let cut = values(&ranked).first().copied().unwrap_or(f64::NAN);
    let above = |l: &[(String, f64)]| l.iter().filter(|a| !near(a.1, cut)).map(|a| a.0.clone()).collect::<Vec<_>>();
    above(x) == above(y)
}

/// The tokens a choice's `logprobs` shows (chat's `content` list, or completions' parallel
/// lists), in order.
fn shown(logprobs: &Value) -> Vec<Shown> {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    if let Some(content) = logprobs["content"].as_array() {
        return content
            .iter()
            .map(|t| {
                let mut top: Vec<(String, f64)> = t["top_logprobs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| (a["token"].as_str().unwrap_or_default().to_owned(), f(&a["logprob"])))
                    .collect();
                top.sort_by(|a, b| a.0.cmp(&b.0));
                (t["token"].as_str().unwrap_or_default().to_owned(), t["bytes"].clone(), f(&t["logprob"]), top)
            })
            .collect();
    }
    let tokens = logprobs["tokens"].as_array().cloned().unwrap_or_default();
    tokens
        .iter()
        .enumerate()
        .map(|(i, token)| {
            // A null in place of the alternatives (a prompt's first token) is told from none.
            let null = logprobs["top_logprobs"][i].is_null().then(|| ("null".to_owned(), f64::NAN));
            let mut top: Vec<(String, f64)> = logprobs["top_logprobs"][i]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(name, lp)| (name.clone(), f(lp)))
                .chain(null)
                .collect();
            top.sort_by(|a, b| a.0.cmp(&b.0));
            (token.as_str().unwrap_or_default().to_owned(), Value::Null, f(&logprobs["token_logprobs"][i]), top)
        })
        .collect()
}

/// Sends `body` to `base` and reads the outcome, from a whole body or from a stream's chunks.
pub async fn outcome(base: &str, path: &str, body: &Value) -> anyhow::Result<Outcome> {
    let resp = http().post(format!("{base}{path}")).json(body).send().await?;
    let status = resp.status();
    let raw = resp.text().await?;
    ensure!(status.is_success(), "{base}{path} answered {status}: {raw}");
    if path == "/v1/responses" {
        return responses_outcome(&raw, body["stream"] == true).with_context(|| format!("{base}{path}"));
    }
    if path == "/generate" {
        return generate_outcome(&raw, body["stream"] == true).with_context(|| format!("{base}{path}"));
    }
    let mut choices: Vec<(String, String)> = Vec::new();
    let mut at = |index: &Value| -> anyhow::Result<usize> {
        let i = index.as_u64().context("a choice without an index")? as usize;
        if choices.len() <= i {
            choices.resize(i + 1, Default::default());
        }
        Ok(i)
    };
    let mut seen: Vec<(usize, String, Option<String>, Vec<Shown>)> = Vec::new();
    let usage = if body["stream"] != true {
        let v: Value = serde_json::from_str(&raw).with_context(|| raw.clone())?;
        for c in v["choices"].as_array().into_iter().flatten() {
            let text = c["message"]["content"].as_str().or(c["text"].as_str()).unwrap_or_default();
            let finish = c["finish_reason"].as_str().map(str::to_owned);
            seen.push((at(&c["index"])?, text.to_owned(), finish, shown(&c["logprobs"])));
        }
        v["usage"].clone()
    } else {
        let mut usage = Value::Null;
        for line in raw.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if line == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(line).with_context(|| line.to_owned())?;
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
            for c in v["choices"].as_array().into_iter().flatten() {
                let text = c["delta"]["content"].as_str().or(c["text"].as_str()).unwrap_or_default();
                let finish = c["finish_reason"].as_str().map(str::to_owned);
                seen.push((at(&c["index"])?, text.to_owned(), finish, shown(&c["logprobs"])));
            }
        }
        ensure!(raw.ends_with("data: [DONE]\n\n"), "{base}{path}: the stream did not end with [DONE]: {raw}");
        usage
    };
    let mut logprobs: Vec<Vec<Shown>> = vec![Vec::new(); choices.len()];
    for (i, text, finish, shown) in seen {
        choices[i].0.push_str(&text);
        if let Some(f) = finish {
            choices[i].1 = f;
        }
        logprobs[i].extend(shown);
    }
    let (prompt, completion) =
        (usage["prompt_tokens"].as_u64().unwrap_or(0), usage["completion_tokens"].as_u64().unwrap_or(0));
    Ok((choices, prompt, completion, logprobs))
}

/// The body to ask the engine's own server for when `body` is a Responses stream that asks for
/// logprobs: the same answer whole. SGLang's server refuses logprobs in a stream, and vLLM's drops
/// the logprobs of a token that shows no text (a character split across tokens), which kvgate
/// carries with the next text; the whole answer lists every token's on both.
pub fn whole_instead(path: &str, body: &Value) -> Option<Value> {
    let asks = body["include"].as_array().is_some_and(|i| i.iter().any(|v| v == "message.output_text.logprobs"));
    (path == "/v1/responses" && body["stream"] == true && asks).then(|| {
        let mut whole = body.clone();
        whole["stream"] = json!(false);
        whole
    })
}

/// `outcome` without the event a stream ended with, to be held against a whole answer.
pub fn without_ending(mut outcome: Outcome) -> Outcome {
    for choice in &mut outcome.0 {
        if let Some(at) = choice.1.find(" via ") {
            choice.1.truncate(at);
        }
    }
    outcome
}

/// A Responses answer's outcome: the message's text with the response's status in place of a
/// finish reason, the input and output token counts, and the message's logprobs when asked. A
/// stream's deltas must add up to the text of the response it ends with, the logprobs they carry
/// must begin the message's list (a token that shows no text has no delta to carry it), and its
/// events must be numbered in order.
fn responses_outcome(raw: &str, stream: bool) -> anyhow::Result<Outcome> {
    let logprobs_of = |response: &Value| -> Vec<Value> {
        let parts = response["output"].as_array().into_iter().flatten().flat_map(|item| {
            item["content"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|p| p["logprobs"].as_array().cloned().unwrap_or_default())
        });
        parts.collect()
    };
    let token_and_value = |t: &Value| (t["token"].clone(), t["logprob"].clone());
    let text_of = |response: &Value| -> String {
        let parts = response["output"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|item| item["content"].as_array().into_iter().flatten().filter_map(|p| p["text"].as_str()));
        parts.collect()
    };
    // A stream's status says which event ended it (the runtimes end a cut response differently).
    let mut ended_by = String::new();
    let response: Value = if stream {
        let mut deltas = String::new();
        let mut delta_logprobs: Vec<Value> = Vec::new();
        let mut last = Value::Null;
        for (i, line) in raw.lines().filter_map(|l| l.strip_prefix("data: ")).enumerate() {
            let event: Value = serde_json::from_str(line).with_context(|| line.to_owned())?;
            ensure!(event["sequence_number"] == i as u64, "event {i} is numbered {}: {raw}", event["sequence_number"]);
            if event["type"] == "response.output_text.delta" {
                deltas.push_str(event["delta"].as_str().unwrap_or_default());
                delta_logprobs.extend(event["logprobs"].as_array().cloned().unwrap_or_default());
            }
            last = event;
        }
        let kind = last["type"].as_str().unwrap_or_default();
        ensure!(matches!(kind, "response.completed" | "response.incomplete"), "the stream ended with {kind}: {raw}");
        ensure!(deltas == text_of(&last["response"]), "the deltas {deltas:?} are not the response's text: {raw}");
        let listed = logprobs_of(&last["response"]);
        let begins = delta_logprobs.len() <= listed.len()
            && delta_logprobs.iter().zip(&listed).all(|(d, l)| token_and_value(d) == token_and_value(l));
        ensure!(begins, "the deltas' logprobs do not begin the message's: {raw}");
        ended_by = format!(" via {kind}");
        last["response"].clone()
    } else {
        serde_json::from_str(raw).with_context(|| raw.to_owned())?
    };
    let status = format!("{}{ended_by}", response["status"].as_str().unwrap_or_default());
    let usage = &response["usage"];
    let (input, output) = (usage["input_tokens"].as_u64().unwrap_or(0), usage["output_tokens"].as_u64().unwrap_or(0));
    // The message's list is chat's `content` list under another name.
    let logprobs = shown(&json!({"content": logprobs_of(&response)}));
    Ok((vec![(text_of(&response), status)], input, output, vec![logprobs]))
}

/// A `/generate` answer's outcome: each sequence's text, with its finish reason and output ids in
/// place of a finish reason, its log probabilities when asked (`meta_info`'s output lists: the
/// token's text, its id in place of `bytes`, its log probability, and its alternatives by text and
/// id), and the prompt and completion token counts (summed over the sequences). Several sequences
/// come as a list, or streamed as events that each name their `index`; each event of a stream
/// carries all of its sequence's text so far, and must extend the one before.
fn generate_outcome(raw: &str, stream: bool) -> anyhow::Result<Outcome> {
    let answers: Vec<Value> = if stream {
        ensure!(raw.ends_with("data: [DONE]\n\n"), "the stream did not end with [DONE]: {raw}");
        let mut last: Vec<Value> = Vec::new();
        for line in raw.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|l| *l != "[DONE]") {
            let event: Value = serde_json::from_str(line).with_context(|| line.to_owned())?;
            let i = event["index"].as_u64().unwrap_or(0) as usize;
            if last.len() <= i {
                last.resize(i + 1, Value::Null);
            }
            let (before, now) =
                (last[i]["text"].as_str().unwrap_or_default(), event["text"].as_str().unwrap_or_default());
            ensure!(now.starts_with(before), "an event's text {now:?} does not extend {before:?}: {raw}");
            last[i] = event;
        }
        last
    } else {
        match serde_json::from_str(raw).with_context(|| raw.to_owned())? {
            Value::Array(list) => list,
            one => vec![one],
        }
    };
    let entry = |e: &Value| -> (String, Value, f64) {
        (e[2].as_str().unwrap_or_default().to_owned(), e[1].clone(), e[0].as_f64().unwrap_or(f64::NAN))
    };
    let (mut choices, mut logprobs, mut prompt, mut completion) = (Vec::new(), Vec::new(), 0, 0);
    for answer in &answers {
        let meta = &answer["meta_info"];
        let ended = format!("{}; output_ids {}", meta["finish_reason"], answer["output_ids"]);
        choices.push((answer["text"].as_str().unwrap_or_default().to_owned(), ended));
        prompt = meta["prompt_tokens"].as_u64().unwrap_or(0);
        completion += meta["completion_tokens"].as_u64().unwrap_or(0);
        // The prompt's entries (`logprob_start_len`), marked as such, then the output's.
        let mut shown = Vec::new();
        for (side, tokens, tops) in [
            ("input", "input_token_logprobs", "input_top_logprobs"),
            ("output", "output_token_logprobs", "output_top_logprobs"),
        ] {
            for (i, t) in meta[tokens].as_array().into_iter().flatten().enumerate() {
                let (text, id, logprob) = entry(t);
                let top = meta[tops][i]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|alt| {
                        let (text, id, logprob) = entry(alt);
                        (format!("{text} ({id})"), logprob)
                    })
                    .collect();
                shown.push((format!("{side}: {text}"), id, logprob, top));
            }
        }
        logprobs.push(shown);
    }
    Ok((choices, prompt, completion, logprobs))
}

/// The parity cases: chat and completions, whole and streamed, with stop strings, output limits,
/// multi-byte prompts (the tiny model's output is full of characters split over byte tokens, some
/// never completed) and special tokens kept.
pub fn cases(runtime: Runtime) -> Vec<(&'static str, Value)> {
    // Several sequences: vLLM refuses `n > 1` with greedy sampling, so they sample, with a seed that
    // makes both servers draw the same; SGLang's worker protocol carries no seed, and it samples
    // greedily for any `n`.
    let several = |mut body: Value| {
        if runtime == Runtime::Vllm {
            body["sampling"] = json!({"temperature": 1.0, "seed": 7});
        }
        body
    };
    let mut out = Vec::new();
    for stream in [false, true] {
        let with = |mut body: Value| {
            body["model"] = json!(MODEL);
            body["temperature"] = json!(0);
            if let Some(Value::Object(sampling)) = body.as_object_mut().and_then(|b| b.remove("sampling")) {
                for (k, v) in sampling {
                    body[k] = v;
                }
            }
            body["stream"] = json!(stream);
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            body
        };
        let chat = "/v1/chat/completions";
        let completions = "/v1/completions";
        out.extend([
            (chat, with(json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 20}))),
            (completions, with(json!({"prompt": "Once upon a time", "max_tokens": 12}))),
            (completions, with(json!({"prompt": "Once upon a time", "max_tokens": 30, "stop": ["stringstring"]}))),
            (completions, with(json!({"prompt": "你好，世界。今天", "max_tokens": 40}))),
            (completions, with(json!({"prompt": "emoji 🙂🚀 naïve", "max_tokens": 40}))),
            (chat, with(json!({"messages": [{"role": "user", "content": "列出三种水果"}], "max_tokens": 40, "skip_special_tokens": false}))),
            (chat, with(json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 25, "stop": ["\n\n"]}))),
            (chat, with(several(json!({"messages": [{"role": "user", "content": "Two answers"}], "max_tokens": 16, "n": 2})))),
            (completions, with(several(json!({"prompt": "Once upon a time", "max_tokens": 10, "n": 3, "stop": ["e"]})))),
            (completions, with(json!({"prompt": "Once upon a time", "max_tokens": 6, "logit_bias": {"300": 100, "301": 5}}))),
            (chat, with(json!({"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 24,
                               "response_format": {"type": "json_object"}}))),
            (chat, with(json!({"messages": [{"role": "user", "content": "A person"}], "max_tokens": 40,
                               "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema":
                                   {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                    "age": {"type": "integer"}}, "required": ["name", "age"]}}}}))),
            (chat, with(json!({"messages": [{"role": "user", "content": "Count: one two"}], "max_tokens": 24, "stop": [" ", "e"], "include_stop_str_in_output": true}))),
            // Logprobs, over characters split across tokens, with alternatives and without, cut
            // at a stop string, and ended by the end-of-sequence token.
            (chat, with(json!({"messages": [{"role": "user", "content": "列出三种水果"}], "max_tokens": 24, "logprobs": true, "top_logprobs": 3}))),
            (chat, with(json!({"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12, "logprobs": true}))),
            (completions, with(json!({"prompt": "你好，世界。今天", "max_tokens": 20, "logprobs": 2}))),
            (completions, with(json!({"prompt": "Once upon a time", "max_tokens": 10, "logprobs": 0, "stop": ["e"]}))),
            (completions, with(json!({"prompt": "Once upon a time", "max_tokens": 8, "echo": true}))),
            // The prompt's own logprobs, echoed before the output's, over split characters; and
            // sampled tokens outside the best ones (a completion then shows one alternative more).
            (completions, with(json!({"prompt": "你好，世界。今天", "max_tokens": 8, "echo": true, "logprobs": 2}))),
            (completions, with(json!({"prompt": "Once upon a time", "max_tokens": 6, "echo": true, "logprobs": 0, "stop": ["e"]}))),
            (completions, with(several(json!({"prompt": "Once upon a time", "max_tokens": 10, "logprobs": 3})))),
            // The tiny model's first token here is 323: a sequence that stops on its first token
            // has no text at all (the prompt the decode is primed with must not come back).
            (completions, with(json!({"prompt": "Hello world, this is", "max_tokens": 8, "stop_token_ids": [323]}))),
        ]);
        // The Responses API: one assistant message, cut by its limit or at a stop string, with
        // instructions and a conversation, and with a JSON schema to follow.
        let responses = "/v1/responses";
        let plain = |mut body: Value| {
            body["model"] = json!(MODEL);
            body["temperature"] = json!(0);
            body["stream"] = json!(stream);
            body
        };
        out.extend([
            (responses, plain(json!({"input": "Tell me a story", "max_output_tokens": 20}))),
            (responses, plain(json!({"instructions": "Answer in French.", "max_output_tokens": 30, "stop": ["\n\n"], "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "列出三种水果"}]},
                {"role": "assistant", "content": "Un"},
                {"type": "message", "role": "user", "content": "Two"}]}))),
            (responses, plain(json!({"input": "A person", "max_output_tokens": 40, "text": {"format": {"type": "json_schema",
                "name": "person", "schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                "required": ["name"]}}}}))),
            // Logprobs, with alternatives over characters split across tokens, and bare, cut at a
            // stop string (a stream's are held against the whole answer: `whole_instead`).
            (responses, plain(json!({"input": "列出三种水果", "max_output_tokens": 16,
                "include": ["message.output_text.logprobs"], "top_logprobs": 2}))),
            (responses, plain(json!({"input": "Tell me a story", "max_output_tokens": 12, "stop": ["e"],
                "include": ["message.output_text.logprobs"]}))),
        ]);
        // SGLang's own `/generate`, on SGLang workers (vLLM's server has none).
        if runtime == Runtime::Sglang {
            let generate = |mut body: Value| {
                body["stream"] = json!(stream);
                body["sampling_params"]["temperature"] = json!(0);
                body
            };
            out.extend([
                ("/generate", generate(json!({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12}}))),
                ("/generate", generate(json!({"text": "你好，世界。今天", "sampling_params": {"max_new_tokens": 30, "stop": ["\n\n", "stringstring"]}}))),
                ("/generate", generate(json!({"input_ids": [100, 200, 300, 400], "sampling_params": {"max_new_tokens": 8, "no_stop_trim": true, "stop": ["e"]}}))),
                ("/generate", generate(json!({"text": "Number:", "sampling_params": {"max_new_tokens": 10, "regex": "[0-9]{1,5}"}}))),
                // Several sequences (greedy: SGLang's worker protocol carries no seed), and log
                // probabilities: with each token's text and alternatives over characters split
                // across tokens, and bare, cut at a stop string.
                ("/generate", generate(json!({"text": "Two answers", "sampling_params": {"max_new_tokens": 8, "n": 2}}))),
                ("/generate", generate(json!({"text": "你好，世界。今天", "return_logprob": true, "top_logprobs_num": 2,
                    "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 16}}))),
                ("/generate", generate(json!({"text": "Once upon a time", "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 10, "stop": ["e"]}}))),
                ("/generate", generate(json!({"text": "Two answers", "return_logprob": true, "top_logprobs_num": 1,
                    "sampling_params": {"max_new_tokens": 6, "n": 2}}))),
                ("/generate", generate(json!({"text": "Hello world, this is", "return_logprob": true,
                    "sampling_params": {"max_new_tokens": 8, "stop_token_ids": [323]}}))),
                // The prompt's own log probabilities, from its start and from its fourth token.
                ("/generate", generate(json!({"text": "你好，世界。今天", "return_logprob": true, "logprob_start_len": 0,
                    "top_logprobs_num": 2, "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 6}}))),
                ("/generate", generate(json!({"text": "Once upon a time", "return_logprob": true, "logprob_start_len": 3,
                    "sampling_params": {"max_new_tokens": 6}}))),
            ]);
        }
    }
    out
}

/// SGLang's `/generate` through kvgate to a vLLM gRPC worker (vLLM's own server has no such route)
/// asks what the equal completions request asks of vLLM's own server: each sequence's text, its
/// finish reason, the token counts and each token's log probability and alternatives' (values
/// only: each API names tokens its own way) must be the same. Whole and streamed, greedy and
/// seeded with `n: 2`. Returns how many were sent, and what differs.
async fn generate_asks_what_completions_ask(own: &str, gateway: &str) -> (usize, Vec<String>) {
    let pairs = [
        (
            json!({"text": "Once upon a time", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}),
            json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}),
        ),
        (
            json!({"text": "你好，世界。今天", "return_logprob": true, "top_logprobs_num": 2, "return_text_in_logprobs": true,
                   "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": ["\n\n"]}}),
            json!({"prompt": "你好，世界。今天", "max_tokens": 16, "temperature": 0, "logprobs": 2, "stop": ["\n\n"]}),
        ),
        (
            json!({"text": "Two answers", "return_logprob": true,
                   "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7, "n": 2}}),
            json!({"prompt": "Two answers", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2, "logprobs": 0}),
        ),
    ];
    // Alternatives only where `/generate` asks for them (completions' `logprobs: 0` still shows
    // the sampled token as one).
    let values = |shown: &[Shown], top: bool| -> Vec<(f64, Vec<f64>)> {
        shown.iter().map(|s| (s.2, if top { s.3.iter().map(|t| t.1).collect() } else { Vec::new() })).collect()
    };
    let near = |a: &[(f64, Vec<f64>)], b: &[(f64, Vec<f64>)]| {
        let close = |x: f64, y: f64| (x - y).abs() <= LOGPROB_TOLERANCE;
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                let (mut p, mut q) = (x.1.clone(), y.1.clone());
                p.sort_by(f64::total_cmp);
                q.sort_by(f64::total_cmp);
                close(x.0, y.0) && p.len() == q.len() && p.iter().zip(&q).all(|(u, v)| close(*u, *v))
            })
    };
    let (mut differ, mut sent) = (Vec::new(), 0);
    for (generate, completions) in &pairs {
        let mut completions = completions.clone();
        completions["model"] = json!(MODEL);
        let expected = match outcome(own, "/v1/completions", &completions).await {
            Ok(e) => e,
            Err(e) => {
                differ.push(format!("/v1/completions {completions} on vLLM's own server: {e:#}"));
                continue;
            }
        };
        for stream in [false, true] {
            let mut body = generate.clone();
            body["stream"] = json!(stream);
            sent += 1;
            let got = match outcome(gateway, "/generate", &body).await {
                Ok(g) => g,
                Err(e) => {
                    differ.push(format!("/generate {body} on the vLLM worker: {e:#}"));
                    continue;
                }
            };
            let same_text = got.0.len() == expected.0.len()
                && got
                    .0
                    .iter()
                    .zip(&expected.0)
                    .all(|(g, e)| g.0 == e.0 && g.1.contains(&format!("\"type\":\"{}\"", e.1)));
            let top = body["top_logprobs_num"].as_u64().is_some_and(|k| k > 0);
            let same_logprobs = got.3.len() == expected.3.len()
                && got.3.iter().zip(&expected.3).all(|(g, e)| near(&values(g, top), &values(e, top)));
            let asked = body["return_logprob"] == true;
            if !same_text || (got.1, got.2) != (expected.1, expected.2) || (asked && !same_logprobs) {
                differ.push(format!(
                    "/generate {body} on the vLLM worker against /v1/completions {completions}:\n    completions: {expected:?}\n    generate:    {got:?}"
                ));
            }
        }
    }
    (sent, differ)
}

/// kvgate in front of `worker` as an SMG user starts it: the worker's URL alone, no tokenizer (the
/// worker hands over its own, `GetTokenizer`), no KV-event endpoints (its own stream carries them).
pub async fn smg_style_gateway(worker: &kvgate_real_engines::fleet::Engine) -> anyhow::Result<Gateway> {
    let mut overrides = test_overrides(&[worker]);
    overrides.tokenizer = None;
    let gw = Gateway::start("", overrides).await?;
    let tokenizer = gw.state.tokenizer.describe();
    ensure!(tokenizer.contains("tokenizer-cache"), "the tokenizer did not come from the worker: {tokenizer}");
    Ok(gw)
}

pub async fn a_grpc_worker_answers_as_the_engines_own_server_does(fleet: Arc<Fleet>) -> anyhow::Result<()> {
    let (own, worker) = (fleet.engine("a"), fleet.engine("g"));
    let gw = smg_style_gateway(worker).await?;
    gw.wait_for("the gRPC worker healthy and described", Duration::from_secs(60), || async {
        let w = gw.worker("g").await?;
        Ok(w["healthy"] == true && w["models"] == json!([MODEL]) && w["engine_block_size"] == 32)
    })
    .await?;
    let mut differ = Vec::new();
    let all = cases(worker.spec.runtime);
    // Every case runs, and a failed one is reported with the rest (with the worker as kvgate saw
    // it), not in place of them.
    for (path, body) in &all {
        let whole = whole_instead(path, body);
        let engine = outcome(&own.url(), path, whole.as_ref().unwrap_or(body)).await.map_err(|e| format!("{e:#}"));
        let through = outcome(&gw.url, path, body).await.map_err(|e| format!("{e:#}"));
        let through = if whole.is_some() { through.map(without_ending) } else { through };
        let equal = matches!((&engine, &through), (Ok(a), Ok(b)) if agree(a, b));
        // A case asking for logprobs compares them, so the engine must have shown some.
        let asked = body.get("logprobs").is_some_and(|l| l != false)
            || body["return_logprob"] == true
            || body["include"].as_array().is_some_and(|i| !i.is_empty());
        if asked && engine.as_ref().is_ok_and(|e| e.3.iter().any(Vec::is_empty)) {
            differ.push(format!("{path} {body}\n    the engine's own server showed no logprobs: {engine:?}"));
        }
        if !equal {
            let seen =
                if through.is_err() { format!("\n    the worker: {}", gw.worker("g").await?) } else { String::new() };
            differ.push(format!("{path} {body}\n    engine: {engine:?}\n    kvgate: {through:?}{seen}"));
        }
    }
    let mut also = String::new();
    if worker.spec.runtime == Runtime::Vllm {
        let (checked, generate_differ) = generate_asks_what_completions_ask(&own.url(), &gw.url).await;
        differ.extend(generate_differ);
        also = format!("; {checked} /generate requests to it, each the same as completions on vLLM's own server");
    }
    // Fields a worker cannot honour yet are refused by name, not dropped.
    let refused = http()
        .post(format!("{}/v1/chat/completions", gw.url))
        .json(&json!({"model": MODEL, "response_format": {"type": "structural_tag"}, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await?;
    let status = refused.status();
    let text = refused.text().await?;
    gw.stop().await;
    ensure!(differ.is_empty(), "{} of {} requests differ:\n{}", differ.len(), all.len(), differ.join("\n"));
    ensure!(status == 400 && text.contains("`response_format`"), "response_format answered {status}: {text}");
    eprintln!("    gRPC parity: {} requests, each equal to the engine's own server{also}", all.len());
    Ok(())
}

pub async fn a_grpc_workers_events_earn_credit_and_a_gone_client_aborts_its_request(
    fleet: Arc<Fleet>,
) -> anyhow::Result<()> {
    let worker = fleet.engine("g");
    let gw = smg_style_gateway(worker).await?;
    gw.wait_for("the gRPC worker healthy", Duration::from_secs(60), || async {
        Ok(gw.worker("g").await?["healthy"] == true)
    })
    .await?;
    // A prompt of several blocks, then the same prefix again: credit from the worker's own KV events
    // must equal what it says it served from cache.
    let prefix = "shared prefix words ".repeat(60);
    let body =
        |q: u32| json!({"model": MODEL, "prompt": format!("{prefix} question {q}"), "max_tokens": 4, "temperature": 0});
    post(&gw.url, "/v1/completions", &body(1)).await?;
    let credit = super::cache::settled_credit(&gw, &body(2), "g").await?;
    let second = post(&gw.url, "/v1/completions", &body(2)).await?;
    let hits = cached_tokens(&second);
    ensure!(
        credit == hits && hits > 0,
        "kvgate credited {credit} tokens; the worker served {hits} from cache: {second}"
    );
    // The credit came over the worker's own event stream, which also pushed its load.
    let events = gw.worker("g").await?["kv_events"].clone();
    ensure!(
        events["transport"] == "grpc"
            && events["batches"].as_u64() > Some(0)
            && events["loads_pushed"].as_u64() > Some(0),
        "the KV events and load did not come over SubscribeKvEvents: {events}"
    );

    // A long stream the client drops after its first text: the worker stops it (its log names each
    // request it aborts: vLLM's servicer `Abort requests: ['kvgate-N']`, SGLang's `Receive abort
    // request: kvgate-N`).
    let aborts = || -> anyhow::Result<usize> {
        let log = std::fs::read_to_string(worker.log())?;
        Ok(log.lines().filter(|l| l.contains("bort") && l.contains("kvgate-")).count())
    };
    let aborted_before = aborts()?;
    let long = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": true,
                      "temperature": 0, "stream": true});
    let resp = http().post(format!("{}/v1/completions", gw.url)).json(&long).send().await?;
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.context("no first chunk")??;
    ensure!(String::from_utf8_lossy(&first).contains("data: "), "not a stream: {first:?}");
    drop(stream);
    gw.wait_for("the worker's log to show the abort", Duration::from_secs(10), || async {
        Ok(aborts()? > aborted_before)
    })
    .await?;
    gw.wait_for("the worker's running count back to 0", Duration::from_secs(30), || async {
        let w = gw.worker("g").await?;
        Ok(w["router"]["running_requests"] == 0 && w["router"]["in_flight"] == 0)
    })
    .await?;
    gw.stop().await;
    if worker.spec.runtime == Runtime::Sglang {
        // Health came from grpc.health.v1. The protocol's own HealthCheck, which makes SGLang
        // generate a token and logs each one, was asked only to confirm a NOT_SERVING: while the
        // servicer's log shows its scheduler as not responsive (its stuck rule, which also fires on
        // the first request after 30 s of idleness), never otherwise.
        let log = std::fs::read_to_string(worker.log())?;
        let (mut stalled, mut generating, mut outside) = (false, 0, Vec::new());
        for line in log.lines() {
            if line.contains("Scheduler not responsive") {
                stalled = true;
            } else if line.contains("Scheduler is responsive again") {
                stalled = false;
            } else if line.contains("Receive health check request") {
                generating += 1;
                if !stalled {
                    outside.push(line.to_owned());
                }
            }
        }
        ensure!(
            outside.is_empty(),
            "kvgate asked SGLang's generating HealthCheck {} of {generating} times without a NOT_SERVING to confirm: {outside:?}",
            outside.len()
        );
    }
    eprintln!(
        "    gRPC worker: credit {credit} = its cached_tokens over SubscribeKvEvents ({} batches, {} loads pushed); a dropped stream was aborted",
        events["batches"], events["loads_pushed"]
    );
    Ok(())
}
