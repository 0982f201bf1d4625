//! Engine load reports, parsed.
//!
//! SGLang's `GET /v1/loads` returns JSON with one entry per data-parallel rank; vLLM and SGLang both
//! expose Prometheus text at `/metrics`. Both parse into [`EngineLoad`], summed over ranks (KV usage is
//! averaged). Fields an engine does not report are `None`; the gateway decides how to estimate them.

use serde::Deserialize;

use crate::prometheus::samples;

/// Why a load report could not be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// The body is not the JSON the endpoint documents.
    #[error("invalid /v1/loads body: {0}")]
    Json(String),
    /// The body has no series kvgate understands.
    #[error("no known load series in the report (expected vllm:num_requests_running or sglang:num_running_reqs)")]
    NoKnownSeries,
}

/// One engine's load, as reported.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    /// Requests queued.
    pub waiting_requests: u64,
    /// Requests running.
    pub running_requests: u64,
    /// Uncached prompt tokens of queued requests (SGLang only).
    pub waiting_uncached_tokens: Option<u64>,
    /// KV-cache usage, 0 to 1.
    pub kv_usage: Option<f64>,
    /// Tokens of running requests in the KV cache (SGLang only).
    pub active_tokens: Option<u64>,
    /// Generated tokens per second (SGLang only).
    pub gen_throughput: Option<f64>,
    /// The engine's KV block size, where it publishes it (vLLM `vllm:cache_config_info`).
    pub block_size: Option<u32>,
    /// KV capacity in tokens, where the engine publishes it (vLLM `num_gpu_blocks` × `block_size`,
    /// SGLang `max_total_num_tokens`), summed over data-parallel ranks.
    pub kv_capacity_tokens: Option<u64>,
    /// When the engine process started (Unix seconds, `process_start_time_seconds`): a new value
    /// means the engine restarted and its prefix cache is empty.
    pub process_start_time_s: Option<f64>,
    /// Prompt tokens served from the prefix cache since start (vLLM `prefix_cache_hits_total`).
    pub prefix_cache_hits: Option<u64>,
    /// Prompt tokens looked up in the prefix cache since start (vLLM `prefix_cache_queries_total`).
    pub prefix_cache_queries: Option<u64>,
    /// The largest running batch the engine admits (SGLang `max_running_requests`), summed over
    /// data-parallel ranks.
    pub max_running_requests: Option<u64>,
}

#[derive(Deserialize)]
struct LoadsBody {
    loads: Vec<RankLoad>,
}

#[derive(Deserialize)]
struct RankLoad {
    #[serde(default)]
    num_running_reqs: u64,
    #[serde(default)]
    num_waiting_reqs: u64,
    num_waiting_uncached_tokens: Option<u64>,
    num_active_tokens: Option<u64>,
    token_usage: Option<f64>,
    gen_throughput: Option<f64>,
    max_total_num_tokens: Option<u64>,
    max_running_requests: Option<u64>,
}

/// Sums that stay sums: counts saturate at `u64::MAX` instead of overflowing (an engine that
/// reports nonsense must not crash or wrap the gateway), rates add as floats.
trait Total: Copy {
    fn total(self, other: Self) -> Self;
}

impl Total for u64 {
    fn total(self, other: u64) -> u64 {
        self.saturating_add(other)
    }
}

impl Total for f64 {
    fn total(self, other: f64) -> f64 {
        self + other
    }
}

fn sum_opt<T: Total>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.total(b)),
        (a, b) => a.or(b),
    }
}

/// Parses SGLang's `GET /v1/loads` JSON.
pub fn parse_sglang_loads(body: &[u8]) -> Result<EngineLoad, TelemetryError> {
    let parsed: LoadsBody = serde_json::from_slice(body).map_err(|e| TelemetryError::Json(e.to_string()))?;
    if parsed.loads.is_empty() {
        return Err(TelemetryError::Json("`loads` is empty".into()));
    }
    let mut out = EngineLoad::default();
    let mut usage = Vec::new();
    for r in &parsed.loads {
        out.waiting_requests = out.waiting_requests.total(r.num_waiting_reqs);
        out.running_requests = out.running_requests.total(r.num_running_reqs);
        out.waiting_uncached_tokens = sum_opt(out.waiting_uncached_tokens, r.num_waiting_uncached_tokens);
        out.active_tokens = sum_opt(out.active_tokens, r.num_active_tokens);
        out.gen_throughput = sum_opt(out.gen_throughput, r.gen_throughput);
        out.kv_capacity_tokens = sum_opt(out.kv_capacity_tokens, r.max_total_num_tokens);
        out.max_running_requests = sum_opt(out.max_running_requests, r.max_running_requests);
        usage.extend(r.token_usage);
    }
    out.kv_usage = mean(&usage);
    Ok(out)
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| (v.iter().sum::<f64>() / v.len() as f64).clamp(0.0, 1.0))
}

/// Parses Prometheus text from vLLM (`vllm:*`) or SGLang (`sglang:*`), summing series over labels
/// (data-parallel engines report one series per rank).
pub fn parse_prometheus(text: &str) -> Result<EngineLoad, TelemetryError> {
    let mut out = EngineLoad::default();
    let mut known = false;
    let mut usage = Vec::new();
    let mut uncached: Option<u64> = None;
    // Counts arrive as floats; sums saturate instead of wrapping.
    let add = |total: &mut u64, v: f64| *total = total.saturating_add(v as u64);
    for s in samples(text) {
        let value = s.value;
        if s.name == "process_start_time_seconds" && value.is_finite() && value > 0.0 {
            out.process_start_time_s = Some(value);
            continue;
        }
        if s.name == "vllm:cache_config_info" {
            let block_size = s.label("block_size").and_then(|b| b.parse::<u32>().ok()).filter(|b| *b > 0);
            let blocks = s.label("num_gpu_blocks").and_then(|b| b.parse::<u64>().ok());
            out.block_size = out.block_size.or(block_size);
            if let (Some(bs), Some(n)) = (block_size, blocks) {
                out.kv_capacity_tokens =
                    Some(out.kv_capacity_tokens.unwrap_or(0).saturating_add(n.saturating_mul(u64::from(bs))));
            }
            continue;
        }
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        match s.name.as_str() {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                add(&mut out.running_requests, value);
                known = true;
            }
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                add(&mut out.waiting_requests, value);
                known = true;
            }
            "vllm:kv_cache_usage_perc" | "sglang:token_usage" => usage.push(value),
            "sglang:gen_throughput" => out.gen_throughput = sum_opt(out.gen_throughput, Some(value)),
            "sglang:num_waiting_uncached_tokens" => uncached = Some(uncached.unwrap_or(0).saturating_add(value as u64)),
            "sglang:max_total_num_tokens" => {
                out.kv_capacity_tokens = Some(out.kv_capacity_tokens.unwrap_or(0).saturating_add(value as u64));
            }
            "vllm:prefix_cache_hits_total" => add(out.prefix_cache_hits.get_or_insert(0), value),
            "vllm:prefix_cache_queries_total" => add(out.prefix_cache_queries.get_or_insert(0), value),
            _ => {}
        }
    }
    if !known {
        return Err(TelemetryError::NoKnownSeries);
    }
    out.kv_usage = mean(&usage);
    out.waiting_uncached_tokens = uncached;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_loads_example_from_the_protocol_doc_parses() {
        let body = br#"{"timestamp":"2023-11-14T22:21:40.250000+00:00","version":"0.5.23","accelerator":"NVIDIA H200","num_accelerators":1,
 "loads":[{"timestamp":1700000500.25,"dp_rank":0,"num_running_reqs":3,"num_waiting_reqs":1,
  "num_waiting_uncached_tokens":812,"num_used_tokens":5120,"num_total_tokens":5120,"num_active_tokens":4608,
  "num_prealloc_ready_tokens":0,"max_total_num_tokens":411136,"max_running_requests":256,"token_usage":0.0125,
  "gen_throughput":412.5,"cache_hit_rate":0.62,"utilization":0.4,"total_prefill_uncached_tokens":91234,
  "total_prefill_busy_us":51234000,"decode_moments":null,
  "queues":{"waiting":1,"grammar":0,"paused":0,"retracted":0,"prealloc_ready":0}}]}"#;
        let l = parse_sglang_loads(body).unwrap();
        assert_eq!((l.running_requests, l.waiting_requests), (3, 1));
        assert_eq!(l.waiting_uncached_tokens, Some(812));
        assert_eq!(l.kv_usage, Some(0.0125));
        assert_eq!(l.gen_throughput, Some(412.5));
        assert_eq!((l.kv_capacity_tokens, l.max_running_requests), (Some(411_136), Some(256)));
    }

    #[test]
    fn counts_past_u64_saturate_instead_of_overflowing() {
        let max = u64::MAX;
        let body = format!(
            r#"{{"loads": [{{"num_waiting_reqs": {max}, "num_running_reqs": {max}, "num_waiting_uncached_tokens": {max}, "max_total_num_tokens": {max}}},
                          {{"num_waiting_reqs": 5, "num_running_reqs": 5, "num_waiting_uncached_tokens": 5, "max_total_num_tokens": 5}}]}}"#
        );
        let load = parse_sglang_loads(body.as_bytes()).unwrap();
        assert_eq!((load.waiting_requests, load.running_requests), (max, max));
        assert_eq!((load.waiting_uncached_tokens, load.kv_capacity_tokens), (Some(max), Some(max)));
    }

    #[test]
    fn dp_ranks_are_summed_and_usage_averaged() {
        let body = br#"{"loads":[{"num_running_reqs":2,"num_waiting_reqs":1,"token_usage":0.2},
                                   {"num_running_reqs":3,"num_waiting_reqs":0,"token_usage":0.4}]}"#;
        let l = parse_sglang_loads(body).unwrap();
        assert_eq!((l.running_requests, l.waiting_requests), (5, 1));
        assert!((l.kv_usage.unwrap() - 0.3).abs() < 1e-12);
        assert!(parse_sglang_loads(b"{}").is_err());
        assert!(parse_sglang_loads(br#"{"loads":[]}"#).is_err());
        assert!(parse_sglang_loads(b"not json").is_err());
    }

    /// Lines of a real vLLM 0.32 (CPU) `/metrics` scrape, trimmed.
    const VLLM_032: &str = r#"# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.796114799e+09
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 3218.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1600.0
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",kv_cache_dtype_skip_layers="[]",kv_cache_memory_bytes="4194304",kv_cache_size_tokens="8192",num_cpu_blocks="None",num_gpu_blocks="256",prefix_caching_hash_algo="sha256",sliding_window="None"} 1.0
"#;

    #[test]
    fn a_real_vllm_scrape_yields_load_block_size_capacity_and_start_time() {
        let l = parse_prometheus(VLLM_032).unwrap();
        assert_eq!((l.running_requests, l.waiting_requests, l.kv_usage), (2, 5, Some(0.25)));
        assert_eq!(l.block_size, Some(32));
        assert_eq!(l.kv_capacity_tokens, Some(8192));
        assert_eq!(l.process_start_time_s, Some(1_796_114_799.0));
        assert_eq!((l.prefix_cache_hits, l.prefix_cache_queries), (Some(1600), Some(3218)));
        // A brace inside a label value no longer ends the labels.
        let braces = "vllm:num_requests_running{model_name=\"a}b\"} 3\n";
        assert_eq!(parse_prometheus(braces).unwrap().running_requests, 3);
        let huge = "vllm:num_requests_running{engine=\"0\"} 1e30\nvllm:num_requests_running{engine=\"1\"} 1e30\n";
        assert_eq!(parse_prometheus(huge).unwrap().running_requests, u64::MAX);
        // A block count whose size in tokens passes u64 saturates (found by the prometheus fuzz target).
        let blocks = format!(
            "{}\nvllm:cache_config_info{{block_size=\"4096\",num_gpu_blocks=\"{}\"}} 1\n",
            "vllm:num_requests_running 1",
            u64::MAX / 2
        );
        assert_eq!(parse_prometheus(&blocks).unwrap().kv_capacity_tokens, Some(u64::MAX));
    }

    #[test]
    fn vllm_and_sglang_prometheus_text_parse() {
        let vllm = "# HELP vllm:num_requests_running Number of requests\n# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"M\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"M\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"M\"} 7.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"M\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"M\"} 0.7\n\
            vllm:prefix_cache_hits_total{model_name=\"M\"} 1234\n";
        let l = parse_prometheus(vllm).unwrap();
        assert_eq!((l.running_requests, l.waiting_requests), (5, 7));
        assert!((l.kv_usage.unwrap() - 0.6).abs() < 1e-12);
        let sglang = "sglang:num_running_reqs{model_name=\"M\",tp_rank=\"0\"} 4\nsglang:num_queue_reqs 2\nsglang:token_usage 0.25\n";
        let l = parse_prometheus(sglang).unwrap();
        assert_eq!((l.running_requests, l.waiting_requests, l.kv_usage), (4, 2, Some(0.25)));
        assert_eq!(parse_prometheus("up 1\n"), Err(TelemetryError::NoKnownSeries));
        assert!(parse_prometheus("vllm:num_requests_running{engine=\"0\"} NaN\nvllm:num_requests_waiting 1\n").is_ok());
    }
}
