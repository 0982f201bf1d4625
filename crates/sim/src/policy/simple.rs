//! SMG's load baselines without prefix knowledge, as SMG scores them: `least_load` (expected wait,
//! §1; `smg_least_load` here) and `power_of_two` (§2; `smg_power_of_two` here). `round_robin`,
//! `random` and kvgate's `power_of_two` run the core's own policies (`core_backed.rs`).

use kvgate_core::Timestamp;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{argmin_set, healthy, uniform, Pick, PolicyRequest, SimPolicy, WorkerView};

// SMG's defaults (code = CLI): λ 0.15 s, p̄ 1024 tokens, T_def 2000 tok/s, as its cache-aware
// policy's expected wait uses them.
use super::smg_wait::{DEFAULT_THROUGHPUT as T_DEF, KV_PRESSURE_WEIGHT_S as LAMBDA_S, MEAN_PREFILL_TOKENS as P_BAR};

/// SMG `least_load` (expected wait) and, on a random pair, `power_of_two`.
///
/// `score = (q + c) / T + λ·k / (1 − k)`: q the reported waiting uncached tokens (or waiting requests
/// × p̄), c the tokens sent since the last report, k the KV usage. The engine model reports no
/// `gen_throughput`, so T is T_def, as SMG uses when that field is 0. A worker that never reported
/// while a peer has scores `I·p̄/T_def`; with no reports at all the argmin of in-flight counts wins.
#[derive(Debug)]
pub struct SmgLeastLoad {
    pair: bool,
}

impl SmgLeastLoad {
    /// `pair`: score only two random distinct workers (`power_of_two`).
    pub fn new(pair: bool) -> Self {
        SmgLeastLoad { pair }
    }
}

fn smg_score(v: &WorkerView, anyone_reported: bool) -> f64 {
    match &v.snapshot {
        Some(s) => {
            let k = s.kv_usage.clamp(0.0, 0.999);
            let q = if s.waiting_tokens > 0 { s.waiting_tokens as f64 } else { s.waiting_requests as f64 * P_BAR };
            (q + v.sent_tokens_since_poll as f64) / T_DEF + LAMBDA_S * k / (1.0 - k)
        }
        None if anyone_reported => v.in_flight as f64 * P_BAR / T_DEF,
        None => v.in_flight as f64,
    }
}

impl SimPolicy for SmgLeastLoad {
    fn decide(
        &mut self,
        _req: &PolicyRequest<'_>,
        view: &[WorkerView],
        _now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let mut candidates = healthy(view);
        if candidates.is_empty() {
            return None;
        }
        if self.pair && candidates.len() >= 2 {
            let n = candidates.len();
            let i = rng.random_range(0..n);
            let j = (i + 1 + rng.random_range(0..n - 1)) % n;
            candidates = vec![candidates[i], candidates[j]];
        }
        let anyone = candidates.iter().any(|&c| view[c].snapshot.is_some());
        let best = argmin_set(&candidates, |c| smg_score(&view[c], anyone));
        uniform(&best, rng).map(Pick::of)
    }
}
