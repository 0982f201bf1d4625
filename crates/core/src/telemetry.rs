//! Engine load reports to the router's view: the one conversion the gateway's poller and the
//! simulator both use.
//!
//! Engines report less than the router plans with. vLLM's `/metrics` gives request counts and KV
//! usage, no token counts; SGLang's `/v1/loads` adds the queued requests' uncached tokens. Neither
//! says how much prefill its running batch has left or how much its running requests will still
//! decode. What is missing is estimated from counts, and the snapshot says so, so that the ledger
//! keeps counting the real prefill of the router's own requests until their first token.

use kvgate_protocol::telemetry::EngineLoad;

use crate::load::{CountEstimate, LoadSnapshot};
use crate::policy::Knob;
use crate::time::Timestamp;

/// Bounds of the queued tokens assumed per waiting request when an engine reports only counts.
pub const ASSUMED_PROMPT_TOKENS: Knob = Knob {
    name: "assumed_prompt_tokens",
    min: 1.0,
    max: 10_000_000.0,
    default: 1024.0,
    meaning: "queued tokens per waiting request for engines that report only counts (vLLM)",
};
/// Bounds of the decode tokens assumed left per running request.
pub const ASSUMED_DECODE_TOKENS: Knob = Knob {
    name: "assumed_decode_tokens",
    min: 1.0,
    max: 10_000_000.0,
    default: 256.0,
    meaning: "decode tokens left per running request, since engines do not report it",
};

/// What a report that counts requests is taken to mean in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountAssumptions {
    /// See [`ASSUMED_PROMPT_TOKENS`].
    pub prompt_tokens_per_waiting: u64,
    /// See [`ASSUMED_DECODE_TOKENS`].
    pub decode_tokens_per_running: u64,
}

impl Default for CountAssumptions {
    fn default() -> Self {
        CountAssumptions {
            prompt_tokens_per_waiting: ASSUMED_PROMPT_TOKENS.default as u64,
            decode_tokens_per_running: ASSUMED_DECODE_TOKENS.default as u64,
        }
    }
}

/// The router's load snapshot from an engine's report, measured at `observed_at`; what the engine
/// does not report is estimated from its counts under `assumed`.
pub fn snapshot_from_report(load: &EngineLoad, assumed: CountAssumptions, observed_at: Timestamp) -> LoadSnapshot {
    let per_waiting = load.waiting_uncached_tokens.is_none().then_some(assumed.prompt_tokens_per_waiting);
    let per_running = assumed.decode_tokens_per_running;
    LoadSnapshot {
        waiting_requests: load.waiting_requests,
        waiting_tokens: load
            .waiting_uncached_tokens
            .unwrap_or(load.waiting_requests.saturating_mul(assumed.prompt_tokens_per_waiting)),
        running_requests: load.running_requests,
        active_decode_tokens: load.running_requests.saturating_mul(per_running),
        kv_usage: load.kv_usage.unwrap_or(0.0),
        observed_at,
        estimated: Some(CountEstimate {
            prompt_tokens_per_waiting: per_waiting,
            decode_tokens_per_running: per_running,
        }),
        max_running_requests: load.max_running_requests,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_only_report_is_estimated_from_its_counts_and_says_so() {
        let vllm =
            EngineLoad { waiting_requests: 3, running_requests: 5, kv_usage: Some(0.4), ..EngineLoad::default() };
        let s = snapshot_from_report(&vllm, CountAssumptions::default(), Timestamp::from_millis(7));
        assert_eq!((s.waiting_tokens, s.active_decode_tokens), (3 * 1024, 5 * 256));
        assert_eq!((s.kv_usage, s.observed_at), (0.4, Timestamp::from_millis(7)));
        let est = s.estimated.unwrap();
        assert_eq!((est.prompt_tokens_per_waiting, est.decode_tokens_per_running), (Some(1024), 256));
    }

    #[test]
    fn reported_queued_tokens_are_taken_as_they_are() {
        let sglang = EngineLoad { waiting_requests: 3, waiting_uncached_tokens: Some(777), ..EngineLoad::default() };
        let s = snapshot_from_report(&sglang, CountAssumptions::default(), Timestamp::ZERO);
        assert_eq!(s.waiting_tokens, 777);
        assert_eq!(s.estimated.unwrap().prompt_tokens_per_waiting, None);
    }
}
