//! Engine profiles: the step-time model and capacity of one engine.
//!
//! Step time (`shared/docs/engine-model.md` §4): `t = a + b·n + c·K/1000 + C/R` milliseconds, with n
//! decode sequences in the step, K their total context tokens, C new prefill tokens in the step (up to
//! the chunk budget minus n) and R the prefill rate. A cached prefix costs nothing.

use serde::{Deserialize, Serialize};

/// Which engine's KV-event conventions the model follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flavor {
    /// vLLM: no event at start-up; `AllBlocksCleared` only on a cache reset.
    Vllm,
    /// SGLang: the first batch of every process (seq 0) is `[AllBlocksCleared]`.
    Sglang,
}

/// The parameters of one engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineProfile {
    /// Profile name.
    pub name: String,
    /// R: new prefill tokens per second (vLLM/SGLang: set by model, hardware and parallelism).
    pub prefill_tokens_per_s: f64,
    /// Token budget of one step (vLLM `max_num_batched_tokens`, SGLang `chunked_prefill_size`).
    pub chunk_budget: u32,
    /// a: fixed cost of a step, ms (weights read once per step).
    pub step_base_ms: f64,
    /// b: cost per decode sequence in the step, ms.
    pub per_seq_ms: f64,
    /// c: cost per 1,000 context tokens of the decode sequences, ms (attention over the KV cache).
    pub per_kilo_context_ms: f64,
    /// Largest running batch (vLLM `max_num_seqs`, SGLang `max_running_requests`).
    pub max_running: u32,
    /// KV cache capacity in tokens (vLLM `num_gpu_blocks × block_size`, SGLang `max_total_num_tokens`).
    pub kv_capacity_tokens: u64,
    /// Tokens per KV block (vLLM `block_size`, SGLang `page_size`).
    pub block_size: u32,
    /// KV-event conventions.
    pub flavor: Flavor,
}

impl EngineProfile {
    /// Profile A (the default): a DeepSeek-V3-class MoE in FP8 on one 8×H200 engine.
    pub fn large_moe_h200() -> Self {
        EngineProfile {
            name: "large-moe-h200".into(),
            prefill_tokens_per_s: 20_000.0,
            chunk_budget: 8192,
            step_base_ms: 18.0,
            per_seq_ms: 0.12,
            per_kilo_context_ms: 0.01,
            max_running: 256,
            kv_capacity_tokens: 500_000,
            block_size: 64,
            flavor: Flavor::Sglang,
        }
    }

    /// Profile B: Llama-3-8B in BF16 on one H100.
    pub fn llama3_8b_h100() -> Self {
        EngineProfile {
            name: "llama3-8b-h100".into(),
            prefill_tokens_per_s: 35_000.0,
            chunk_budget: 8192,
            step_base_ms: 7.0,
            per_seq_ms: 0.03,
            per_kilo_context_ms: 0.045,
            max_running: 256,
            kv_capacity_tokens: 400_000,
            block_size: 16,
            flavor: Flavor::Vllm,
        }
    }

    /// A profile by name: `large-moe-h200` (alias `a`) or `llama3-8b-h100` (alias `b`).
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "large-moe-h200" | "a" | "A" => Some(Self::large_moe_h200()),
            "llama3-8b-h100" | "b" | "B" => Some(Self::llama3_8b_h100()),
            _ => None,
        }
    }

    /// Duration of one step in microseconds.
    pub fn step_micros(&self, decode_seqs: u64, decode_context_tokens: u64, prefill_tokens: u64) -> u64 {
        let ms = self.step_base_ms
            + self.per_seq_ms * decode_seqs as f64
            + self.per_kilo_context_ms * decode_context_tokens as f64 / 1000.0
            + prefill_tokens as f64 / self.prefill_tokens_per_s * 1000.0;
        (ms * 1000.0).round().max(1.0) as u64
    }

    /// Decode tokens per second of a full-ish batch, a starting point for the router's estimate:
    /// `n / step time` at n sequences of `context` tokens.
    pub fn decode_tokens_per_s(&self, n: u64, context: u64) -> f64 {
        n as f64 / (self.step_micros(n, n * context, 0) as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_a_matches_the_documented_checks() {
        let a = EngineProfile::large_moe_h200();
        // 38 sequences of 16k context: 18 + 4.6 + 6.1 ≈ 29 ms.
        let t = a.step_micros(38, 38 * 16_000, 0) as f64 / 1000.0;
        assert!((t - 28.64).abs() < 0.1, "{t}");
        // An 8k chunk adds about 410 ms.
        let t8k = a.step_micros(38, 38 * 16_000, 8192) as f64 / 1000.0;
        assert!((t8k - t - 409.6).abs() < 0.5, "{t8k}");
    }

    #[test]
    fn profile_b_matches_the_documented_checks() {
        let b = EngineProfile::llama3_8b_h100();
        // 64 sequences of 4k context: 7 + 1.9 + 11.8 ≈ 21 ms.
        let t = b.step_micros(64, 64 * 4096, 0) as f64 / 1000.0;
        assert!((t - 20.7).abs() < 0.2, "{t}");
    }
}
