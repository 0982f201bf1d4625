//! `kvgate sim` as users run it: the real binary, its flags, its outputs.

use std::process::{Command, Output};

use serde_json::Value;

fn kvgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate")).args(args).output().expect("spawn kvgate")
}

fn ok_json(args: &[&str]) -> Value {
    let out = kvgate(args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON")
}

const SMALL: &[&str] = &["sim", "--scenario", "multi-prefix", "--rate", "20", "--duration", "5", "--workers", "4"];

#[test]
fn json_report_has_the_documented_keys() {
    let r = ok_json(&[SMALL, &["--policy", "projected", "--mode", "shadow", "--format", "json"]].concat());
    for path in [
        "/scenario",
        "/policy",
        "/mode",
        "/seed",
        "/requests/total",
        "/requests/completed",
        "/requests/rejected",
        "/requests/failed",
        "/throughput/output_tokens_per_s",
        "/throughput/requests_per_s",
        "/ttft_s/p50",
        "/ttft_s/p90",
        "/ttft_s/p99",
        "/e2e_s/p50",
        "/e2e_s/p99",
        "/cache/hit_rate",
        "/workers/0/id",
        "/workers/0/requests",
        "/workers/0/max_waiting",
        "/hot_prefix/owner_share",
        "/shadow/decisions",
        "/shadow/disagreements",
    ] {
        assert!(r.pointer(path).is_some(), "missing {path} in {r}");
    }
    assert_eq!(r["mode"], "shadow");
    assert_eq!(r["shadow"]["decisions"], r["requests"]["total"]);
}

#[test]
fn compare_runs_every_entry_on_identical_arrivals() {
    let r =
        ok_json(&[SMALL, &["--compare", "round_robin,projected:off,projected:enforce", "--format", "json"]].concat());
    let runs = r["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert!(runs.iter().all(|x| x["requests"]["total"] == runs[0]["requests"]["total"]));
    assert_eq!(runs[1]["mode"], "off");
    let table = kvgate(&[SMALL, &["--compare", "smg_least_load,projected"]].concat());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("smg_least_load") && text.contains("projected:enforce"), "{text}");
}

#[test]
fn same_seed_same_output_byte_for_byte() {
    let a = kvgate(&[SMALL, &["--format", "json", "--seed", "3", "--fault", "kv-loss"]].concat());
    let b = kvgate(&[SMALL, &["--format", "json", "--seed", "3", "--fault", "kv-loss"]].concat());
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout);
}

#[test]
fn plot_writes_an_svg() {
    let dir = std::env::temp_dir().join(format!("kvgate-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("runs.svg");
    let out = kvgate(&[SMALL, &["--compare", "smg_least_load,projected", "--plot", path.to_str().unwrap()]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("projected:enforce") && svg.contains("<polyline"), "{svg}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_flags_are_rejected_with_a_message() {
    for (args, needle) in [
        (vec!["sim", "--policy", "fastest"], "unknown policy"),
        (vec!["sim", "--policy", "smg_least_load:enforce"], "no modes"),
        (vec!["sim", "--policy", "least_load"], "now smg_least_load"),
        (vec!["sim", "--policy", "round_robin", "--mode", "shadow"], "--mode applies"),
        (vec!["sim", "--scenario", "nope"], "unknown scenario"),
        (vec!["sim", "--fault", "meteor"], "unknown fault"),
        (vec!["sim", "--rate=-3"], "--rate"),
        (vec!["sim", "--workers", "0"], "--workers"),
        (vec!["sim", "--escape-seconds=-1"], "escape_seconds"),
        (vec!["sim", "--profile", "tpu"], "unknown profile"),
        (vec!["sim", "--scenario", "mooncake", "--trace", "/nonexistent.jsonl"], "nonexistent"),
        (
            vec!["sim", "--scenario", "multi-prefix", "--clients", "8"],
            "--clients applies to --scenario incident-bursts",
        ),
        (vec!["sim", "--scenario", "incident-bursts", "--rate", "5"], "--rate does not apply"),
        (vec!["sim", "--scenario", "incident-bursts", "--per-burst", "0"], "--per-burst must be at least 1"),
        (vec!["sim", "--per-request"], "--per-request lists requests in the JSON report"),
        (vec!["sim", "--matrix", "--per-request"], "--per-request does not combine with --matrix"),
    ] {
        let out = kvgate(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_trace_alone_picks_its_replay_by_extension_and_an_unknown_one_is_refused() {
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/traces/mooncake_conversation_trace.jsonl");
    assert!(std::path::Path::new(trace).exists(), "{trace}: the tests need ../shared/data beside the checkout");
    let r = ok_json(&["sim", "--trace", trace, "--limit", "40", "--speedup", "6", "--format", "json"]);
    assert_eq!(
        r["scenario"], "mooncake:mooncake_conversation_trace.jsonl",
        "the .jsonl trace is replayed, not ignored"
    );
    let out = kvgate(&["sim", "--trace", "/tmp/trace.txt"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("give --scenario mooncake or azure"));
    let out = kvgate(&["sim", "--scenario", "multi-prefix", "--trace", trace]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("applies to the mooncake and azure replays"));
}

#[test]
fn a_run_that_completed_nothing_shows_no_latency_rather_than_zero() {
    // Cap-one seeding piles the hot prefix onto its overloaded owner: every request is refused.
    let args = ["sim", "--scenario", "hot-prefix-51", "--duration", "2", "--policy", "cache_aware_seeded"];
    let r = ok_json(&[&args[..], &["--format", "json"]].concat());
    assert_eq!(r["requests"]["completed"], 0, "{}", r["requests"]);
    assert!(r["ttft_s"]["p99"].is_null() && r["e2e_s"]["p99"].is_null(), "{} {}", r["ttft_s"], r["e2e_s"]);
    let table = String::from_utf8(kvgate(&args).stdout).unwrap();
    let row = table.lines().find(|l| l.starts_with("cache_aware_seeded")).unwrap();
    assert_eq!(row.split_whitespace().nth(6), Some("-"), "ttft p50 is '-': {row}");
}

#[test]
fn the_matrix_summarises_every_policy_over_seeds_and_checks_enforce() {
    let out = ok_json(&[
        "sim",
        "--matrix",
        "hot-prefix-51",
        "--seeds",
        "2",
        "--compare",
        "smg_least_load,projected:enforce,oracle",
        "--format",
        "json",
    ]);
    let s = &out[0];
    assert_eq!(s["scenario"], "hot-prefix-51");
    assert_eq!(s["seeds"], serde_json::json!([1, 2]));
    let policies = s["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 3);
    for p in policies {
        assert_eq!(p["ttft_p90_s"]["n"], 2, "one value per seed: {p}");
        assert!(p["ttft_p90_s"]["ci95"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(policies[2]["p90_over_oracle"], 1.0);
    assert!(s["targets"]["lowest_p99"].is_boolean(), "{}", s["targets"]);
}

#[test]
fn the_matrix_refuses_workload_flags_and_markdown_needs_it() {
    let err = |args: &[&str]| {
        let out = kvgate(args);
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(err(&["sim", "--matrix", "--rate", "5"]).contains("--rate does not combine with --matrix"));
    assert!(err(&["sim", "--matrix", "--bursts", "2"]).contains("--bursts does not combine with --matrix"));
    assert!(err(&["sim", "--matrix", "mooncake"]).contains("mooncake-conversation"));
    assert!(err(&["sim", "--matrix", "--seeds", "0"]).contains("--seeds"));
    assert!(err(&["sim", "--format", "markdown"]).contains("--matrix"));
}

#[test]
fn incident_bursts_replay_the_benchs_closed_loop_clients() {
    let args = ["sim", "--scenario", "incident-bursts", "--bursts", "2", "--per-burst", "16", "--clients", "4"];
    let r = ok_json(&[&args[..], &["--compare", "cache_aware,projected:enforce", "--format", "json"]].concat());
    let runs = r["runs"].as_array().unwrap();
    for run in runs {
        assert_eq!(run["requests"]["total"], 32, "the warm-up is not reported: {run}");
        assert_eq!(run["requests"]["completed"], 32, "{run}");
        assert_eq!(run["workers"].as_array().map(Vec::len), Some(4), "four engines by default: {run}");
    }
    assert_eq!(runs[0]["hot_prefix"]["owner_share"], 1.0, "cache_aware pins the prefix: {}", runs[0]);
    assert!(runs[0].get("per_request").is_none(), "listed only with --per-request: {}", runs[0]);
    let listed = ok_json(&[&args[..], &["--format", "json", "--per-request"]].concat());
    let rows = listed["per_request"].as_array().unwrap();
    assert_eq!(rows.len(), 32, "every measured request: {listed}");
    assert!(rows.iter().all(|r| r["ttft_s"].as_f64().is_some() && r["worker"].as_u64().is_some()), "{listed}");
}
