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
    /// KV-event conventions, and the scheduler's defaults where the engines differ.
    pub flavor: Flavor,
    /// Whether decodes run in the same step as prefill chunks. `None`: as the flavour's engine does
    /// by default. vLLM's scheduler always mixes them; SGLang runs a prefill step on its own, pausing
    /// its decodes, unless started with `--enable-mixed-chunk` (`Some(true)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixed_chunk: Option<bool>,
    /// The host's time between two steps (scheduling, sampling, sending tokens), which the step
    /// costs above leave out. None by default: the documented profiles' costs are whole steps. A
    /// paced real fleet has it (its pacer logs show it), so the simulator adds it when modelling one.
    #[serde(default, skip_serializing_if = "HostDelay::is_none")]
    pub step_gap: HostDelay,
    /// The host's time from a request reaching the engine to its scheduler being able to run it
    /// (the API server rendering and tokenizing the prompt, the hand-over to the scheduler
    /// process), drawn per request. None by default: the documented profiles leave the host out. A
    /// paced real fleet on a few shared cores has a long one (its pacer logs show it), and it sets
    /// which of a burst's requests an idle engine's first step runs.
    #[serde(default, skip_serializing_if = "HostDelay::is_none")]
    pub intake: HostDelay,
    /// The way from a client sending a request to the engine's API server taking it (the client's
    /// send, the router reading, tokenizing and routing it, the hop to the engine), drawn per
    /// request. None by default. It is the testbed's rather than the engine's, but a paced real
    /// fleet's TTFT includes it, so the profile of such a fleet carries it (`sim-profile.sh` reads
    /// it off the client's records joined to the pacer logs).
    #[serde(default, skip_serializing_if = "HostDelay::is_none")]
    pub dispatch: HostDelay,
    /// The way back: from a step releasing a token to the client receiving it (the engine's API
    /// server detokenizing and streaming it, the router's stream, the client reading it), drawn
    /// for a request's first token and again for its last. None by default, as `dispatch`.
    #[serde(default, skip_serializing_if = "HostDelay::is_none")]
    pub delivery: HostDelay,
}

/// A host's delay (between two steps, or before a request reaches the scheduler), drawn each time
/// from a lognormal fitted to its median and 90th percentile: the delays a real engine's pacer log
/// shows are skewed (a short median, a long tail when the host's CPUs are busy), and a lognormal
/// matches that tail with two numbers one can read off the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HostDelay {
    /// The median delay, ms (0: none).
    pub median_ms: f64,
    /// The 90th-percentile delay, ms (at least the median; equal to it for a fixed delay).
    pub p90_ms: f64,
}

/// The standard normal's 90th percentile.
const Z_P90: f64 = 1.281_551_565_5;

impl HostDelay {
    /// No delay.
    pub const NONE: HostDelay = HostDelay { median_ms: 0.0, p90_ms: 0.0 };

    /// Whether there is no delay.
    pub fn is_none(&self) -> bool {
        self.median_ms <= 0.0
    }

    /// What is wrong with these numbers, if anything, naming them as the profile's `field`.
    pub fn check(&self, field: &str) -> Result<(), String> {
        if !(self.median_ms.is_finite() && self.median_ms >= 0.0) {
            return Err(format!("{field}.median_ms must be 0 or more, not {}", self.median_ms));
        }
        if !(self.p90_ms.is_finite() && self.p90_ms >= self.median_ms) {
            return Err(format!(
                "{field}.p90_ms must be at least the median ({}), not {}",
                self.median_ms, self.p90_ms
            ));
        }
        Ok(())
    }

    /// The delay in microseconds at `z`, a draw of the standard normal (the caller owns the
    /// randomness): the median at `z = 0`, the 90th percentile at `z ≈ 1.28`, at most
    /// [`HostDelay::MAX_MICROS`].
    pub fn micros(&self, z: f64) -> u64 {
        if self.is_none() {
            return 0;
        }
        let sigma = (self.p90_ms / self.median_ms).ln() / Z_P90;
        let micros = (self.median_ms * (sigma * z).exp() * 1000.0).round();
        if micros.is_finite() {
            (micros as u64).min(Self::MAX_MICROS)
        } else {
            Self::MAX_MICROS
        }
    }

    /// The longest delay drawn: past a minute a draw is the far tail of a skewed fit, not a host.
    pub const MAX_MICROS: u64 = 60_000_000;
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
            // The pass model this profile comes from (engine-model.md §4) adds a step's prefill
            // and decode, as SGLang does with `--enable-mixed-chunk`.
            mixed_chunk: Some(true),
            step_gap: HostDelay::NONE,
            intake: HostDelay::NONE,
            dispatch: HostDelay::NONE,
            delivery: HostDelay::NONE,
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
            mixed_chunk: None,
            step_gap: HostDelay::NONE,
            intake: HostDelay::NONE,
            dispatch: HostDelay::NONE,
            delivery: HostDelay::NONE,
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

    /// Whether decodes run in the same step as prefill chunks ([`EngineProfile::mixed_chunk`]).
    pub fn mixes_prefill_and_decode(&self) -> bool {
        self.mixed_chunk.unwrap_or(self.flavor == Flavor::Vllm)
    }

    /// What is wrong with the scheduling settings, if anything.
    pub fn check_scheduling(&self) -> Result<(), String> {
        if self.flavor == Flavor::Vllm && self.mixed_chunk == Some(false) {
            return Err(
                "mixed_chunk false is SGLang's scheduling; vLLM's scheduler always mixes prefill and decode".into()
            );
        }
        self.step_gap.check("step_gap")?;
        self.intake.check("intake")?;
        self.dispatch.check("dispatch")?;
        self.delivery.check("delivery")
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

    #[test]
    fn a_host_delay_has_its_median_and_p90_where_they_were_set() {
        let gap = HostDelay { median_ms: 0.8, p90_ms: 2.4 };
        assert_eq!(gap.micros(0.0), 800);
        assert_eq!(gap.micros(Z_P90), 2400);
        assert!(gap.micros(-3.0) < 800 && gap.micros(3.0) > 2400);
        assert_eq!(HostDelay { median_ms: 1.5, p90_ms: 1.5 }.micros(2.0), 1500, "a fixed gap");
        assert_eq!(HostDelay::NONE.micros(5.0), 0);
        let wild = HostDelay { median_ms: 0.001, p90_ms: 1e9 };
        assert_eq!(wild.micros(40.0), HostDelay::MAX_MICROS, "a far draw is capped, not overflowed");
    }

    #[test]
    fn a_host_delay_names_what_is_wrong_with_it() {
        assert!(HostDelay { median_ms: 0.8, p90_ms: 2.4 }.check("step_gap").is_ok());
        assert!(HostDelay::NONE.check("step_gap").is_ok());
        let low = HostDelay { median_ms: 2.0, p90_ms: 1.0 }.check("step_gap").unwrap_err();
        assert!(low.contains("step_gap.p90_ms must be at least the median"), "{low}");
        let negative = HostDelay { median_ms: -1.0, p90_ms: 1.0 }.check("intake").unwrap_err();
        assert!(negative.contains("intake.median_ms must be 0 or more"), "{negative}");
        assert!(HostDelay { median_ms: f64::NAN, p90_ms: 1.0 }.check("intake").is_err());
        let mut profile = EngineProfile::llama3_8b_h100();
        profile.intake = HostDelay { median_ms: 20.0, p90_ms: 10.0 };
        let why = profile.check_scheduling().unwrap_err();
        assert!(why.contains("intake.p90_ms"), "{why}");
        profile.intake = HostDelay::NONE;
        profile.delivery = HostDelay { median_ms: f64::INFINITY, p90_ms: f64::INFINITY };
        let why = profile.check_scheduling().unwrap_err();
        assert!(why.contains("delivery.median_ms"), "{why}");
        profile.delivery = HostDelay::NONE;
        profile.dispatch = HostDelay { median_ms: 5.0, p90_ms: 4.0 };
        assert!(profile.check_scheduling().unwrap_err().contains("dispatch.p90_ms"));
    }

    #[test]
    fn a_profile_without_host_delays_reads_as_none_and_writes_without_them() {
        let mut json = serde_json::to_value(EngineProfile::llama3_8b_h100()).unwrap();
        for field in ["step_gap", "intake", "dispatch", "delivery"] {
            assert!(json.get(field).is_none(), "{field} is written when it is none");
        }
        json["step_gap"] = serde_json::json!({"median_ms": 0.9, "p90_ms": 3.0});
        json["intake"] = serde_json::json!({"median_ms": 20.0, "p90_ms": 100.0});
        let p: EngineProfile = serde_json::from_value(json).unwrap();
        assert_eq!(p.step_gap, HostDelay { median_ms: 0.9, p90_ms: 3.0 });
        assert_eq!(p.intake, HostDelay { median_ms: 20.0, p90_ms: 100.0 });
        assert!(p.dispatch.is_none() && p.delivery.is_none());
    }
}
