//! `kvgate decide` as operators run it: the real binary, JSON in, JSON out.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

fn kvgate(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvgate");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn decide(input: &Value) -> Value {
    let out = kvgate(&["decide", "--compact"], &input.to_string());
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

fn decide_err(input: &str) -> String {
    let out = kvgate(&["decide"], input);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "expected failure for {input}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn example_path(name: &str) -> String {
    format!("{}/../../examples/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// The schema exactly as the issue gives it, with one idle peer added.
fn issue_schema() -> Value {
    json!({
      "block_size": 16,
      "policy": {"name": "projected", "mode": "enforce", "escape_seconds": 5.0, "escape_waiting": 64},
      "defaults": {"prefill_tokens_per_s": 20000, "decode_tokens_per_s": 2000, "stale_after_ms": 5000},
      "workers": [
        {"id": "w0",
         "prefill_tokens_per_s": 20000, "decode_tokens_per_s": 2000,
         "load": {"waiting_requests": 109, "waiting_tokens": 915600, "running_requests": 38,
                  "active_decode_tokens": 11400, "kv_usage": 0.62, "age_ms": 40},
         "kv": {"state": "synced", "cached": [{"prefix": "hot", "tokens": 8192}]}},
        {"id": "w1", "load": {"age_ms": 40}}
      ],
      "requests": [{"prefix": "hot", "prefix_tokens": 8192, "suffix_tokens": 200, "max_tokens": 256, "repeat": 1}]
    })
}

#[test]
fn issue_schema_routes_the_hot_request_to_the_idle_peer_with_full_terms() {
    let out = decide(&issue_schema());
    let d = &out["decisions"][0];
    assert_eq!(d["request"], 0);
    assert_eq!(d["worker"], "w1");
    assert_eq!(d["mode"], "enforce");
    assert_eq!(d["reason"], "cache_and_load");
    assert_eq!(d["load_only_worker"], "w1");
    assert_eq!(d["enforce_worker"], "w1");
    let owner = d["scores"].as_array().unwrap().iter().find(|s| s["worker"] == "w0").unwrap();
    assert_eq!(owner["cached_tokens"], 8192, "the prefix arrived through BlockStored events");
    for key in ["projected_s", "wait_s", "decode_s", "prefill_s", "barrier_s"] {
        assert!(owner[key].is_f64(), "{key} in {owner}");
    }
    assert!((owner["wait_s"].as_f64().unwrap() - 45.78).abs() < 1e-9);
}

#[test]
fn bundled_incident_example_spreads_hot_requests_over_idle_peers() {
    let out = kvgate(&["decide", &example_path("incident-51.json")], "");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let decisions = v["decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 8);
    let mut workers: Vec<&str> = decisions.iter().map(|d| d["worker"].as_str().unwrap()).collect();
    assert!(!workers.contains(&"w0") && !workers.contains(&"w50"), "{workers:?}");
    workers.sort();
    workers.dedup();
    assert_eq!(workers.len(), 8, "eight simultaneous identical requests, eight workers");
    for d in decisions {
        let scores = d["scores"].as_array().unwrap();
        assert!(scores.len() == 16 || scores.len() == 17, "best 16 plus the load-only winner");
        assert!(scores.iter().any(|s| s["worker"] == d["load_only_worker"]));
    }
}

#[test]
fn repeat_makes_simultaneous_requests_that_see_each_other() {
    let mut input = issue_schema();
    input["workers"][1] = json!({"id": "w1", "load": {}});
    input["workers"].as_array_mut().unwrap().push(json!({"id": "w2", "load": {}}));
    input["requests"][0]["repeat"] = json!(2);
    let out = decide(&input);
    let w: Vec<&str> = out["decisions"].as_array().unwrap().iter().map(|d| d["worker"].as_str().unwrap()).collect();
    assert_eq!(w.len(), 2);
    assert_ne!(w[0], w[1]);
}

#[test]
fn shadow_mode_dispatches_load_only_and_records_enforce() {
    let out = kvgate(&["decide", "--compact", &example_path("shadow-small.json")], "");
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &v["decisions"][0];
    assert_eq!(d["reason"], "shadow");
    assert_eq!(d["worker"], d["load_only_worker"]);
    assert_eq!(d["enforce_worker"], "owner");
}

#[test]
fn missing_and_invalid_telemetry_are_reported_as_fallbacks() {
    let mut input = issue_schema();
    input["workers"][0]["load"] = json!({"waiting_tokens": 1000, "age_ms": 40});
    input["workers"][0]["kv"]["state"] = json!("invalid");
    assert_eq!(decide(&input)["decisions"][0]["reason"], "fallback:invalid");
    input["workers"][0]["kv"]["state"] = json!("synced");
    input["workers"][0].as_object_mut().unwrap().remove("load");
    assert_eq!(decide(&input)["decisions"][0]["reason"], "fallback:missing");
    input["workers"][0]["load"] = json!({"waiting_tokens": 1000, "age_ms": 60000});
    assert_eq!(decide(&input)["decisions"][0]["reason"], "fallback:stale");
    input["workers"][0]["load"] = json!({"waiting_tokens": 1000, "age_ms": 40});
    let d = &decide(&input)["decisions"][0];
    assert_eq!((d["worker"].as_str(), d["reason"].as_str()), (Some("w0"), Some("cache_and_load")));
}

#[test]
fn malformed_input_is_rejected_with_a_message_naming_the_problem() {
    assert!(decide_err("{not json").contains("invalid fleet snapshot"));
    let mut extra = issue_schema();
    extra["workers"][0]["colour"] = json!("red");
    assert!(decide_err(&extra.to_string()).contains("unknown field `colour`"));
    let mut wrong_type = issue_schema();
    wrong_type["workers"][0]["load"]["waiting_requests"] = json!("many");
    assert!(decide_err(&wrong_type.to_string()).contains("invalid type"));
    let mut knob = issue_schema();
    knob["policy"]["escape_seconds"] = json!(-2.0);
    let err = decide_err(&knob.to_string());
    assert!(err.contains("escape_seconds") && err.contains("0 to 3600"), "{err}");
    let mut seeding = issue_schema();
    seeding["policy"]["distribution_seeding"] = json!(true);
    assert!(decide_err(&seeding.to_string()).contains("distribution_seeding belongs to the cache_aware policy"));
    let mut dup = issue_schema();
    dup["workers"][1]["id"] = json!("w0");
    assert!(decide_err(&dup.to_string()).contains("duplicate worker id"));
    let mut usage = issue_schema();
    usage["workers"][0]["load"]["kv_usage"] = json!(3.0);
    assert!(decide_err(&usage.to_string()).contains("kv_usage"));
    let mut state = issue_schema();
    state["workers"][0]["kv"]["state"] = json!("fine");
    assert!(decide_err(&state.to_string()).contains("kv.state \"fine\""));
    let mut no_workers = issue_schema();
    no_workers["workers"] = json!([]);
    assert!(decide_err(&no_workers.to_string()).contains("no workers"));
    let mut block = issue_schema();
    block["block_size"] = json!(0);
    assert!(decide_err(&block.to_string()).contains("block_size"));
    let mut tps = issue_schema();
    tps["defaults"]["prefill_tokens_per_s"] = json!(0);
    assert!(decide_err(&tps.to_string()).contains("prefill_tokens_per_s"));
    let mut huge = issue_schema();
    huge["requests"][0]["repeat"] = json!(1_000_000_000u64);
    assert!(decide_err(&huge.to_string()).contains("at most"));
    let mut nothing = issue_schema();
    nothing["requests"][0] = json!({});
    assert!(decide_err(&nothing.to_string()).contains("no tokens"));
    assert!(kvgate(&["decide", "/nonexistent/fleet.json"], "").stderr.starts_with(b"kvgate: cannot read"));
}

#[test]
fn no_eligible_worker_is_an_error_not_a_panic() {
    let mut input = issue_schema();
    input["workers"][0]["eligible"] = json!(false);
    input["workers"][1]["eligible"] = json!(false);
    assert!(decide_err(&input.to_string()).contains("no eligible worker"));
}

#[test]
fn routing_doc_lists_every_knob_with_its_code_bounds() {
    let doc = std::fs::read_to_string(format!("{}/../../docs/routing.md", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let mut knobs = kvgate_core::policy::KNOBS.to_vec();
    knobs.extend([
        kvgate_core::BLOCK_SIZE,
        kvgate_core::PREFILL_TOKENS_PER_S,
        kvgate_core::DECODE_TOKENS_PER_S,
        kvgate_core::KV_CAPACITY_TOKENS,
        kvgate_core::MAX_RUNNING_REQUESTS,
        kvgate_core::CHUNK_TOKENS,
    ]);
    for k in knobs {
        let row = format!("| `{}` | {} | {} | {} |", k.name, k.min, k.max, k.default);
        assert!(doc.contains(&row), "docs/routing.md lacks the row starting {row}");
    }
}

#[test]
fn decide_doc_input_example_runs_as_documented() {
    let doc = std::fs::read_to_string(format!("{}/../../docs/decide.md", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let start = doc.find("```json\n").expect("an input example") + "```json\n".len();
    let end = start + doc[start..].find("```").unwrap();
    let input: Value = serde_json::from_str(&doc[start..end]).expect("the documented input is valid JSON");
    assert_eq!(input, issue_schema(), "the doc shows the schema the tests use");
    let out = decide(&input);
    assert_eq!(out["decisions"][0]["worker"], "w1");
    assert_eq!(out["decisions"][0]["scores"][0]["projected_s"], 0.4196);
}
