//! SMG's load baselines without prefix knowledge, as SMG 1.13 runs them over HTTP workers:
//! `least_load` (its expected wait; `smg_least_load` here) and `power_of_two` (the expected wait of
//! a random pair, its default metric; `smg_power_of_two` here), both behind SMG's overload veto.
//! `round_robin`, `random` and kvgate's `power_of_two` run the core's own policies
//! (`core_backed.rs`).

use kvgate_core::{LoadSnapshot, Timestamp};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::smg_wait::{SmgLoadBook, SmgPool};
use super::{healthy, FleetInfo, Pick, PolicyRequest, SimPolicy, WorkerView};

/// SMG `least_load` and, on a random pair, `power_of_two` (SMG's `least_load.rs` and
/// `power_of_two.rs`): the least expected wait ([`SmgLoadBook`]: SMG's own 10-second poll of each
/// worker's load and what it sent since) among the workers its overload veto leaves.
#[derive(Debug)]
pub struct SmgLeastLoad {
    pair: bool,
    loads: SmgLoadBook,
}

impl SmgLeastLoad {
    /// A router for `fleet`; `pair`: score only two random distinct workers (`power_of_two`).
    pub fn new(fleet: &FleetInfo, pair: bool) -> Self {
        SmgLeastLoad { pair, loads: SmgLoadBook::new(fleet.workers) }
    }
}

impl SimPolicy for SmgLeastLoad {
    fn decide(
        &mut self,
        _req: &PolicyRequest<'_>,
        view: &[WorkerView],
        now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let w = match self.loads.pool(&healthy(view), view, rng) {
            SmgPool::AllVetoed(fallback) => fallback?,
            SmgPool::Open(mut candidates) => {
                if self.pair && candidates.len() >= 2 {
                    let n = candidates.len();
                    let i = rng.random_range(0..n);
                    let j = (i + 1 + rng.random_range(0..n - 1)) % n;
                    candidates = vec![candidates[i], candidates[j]];
                }
                self.loads.select(&candidates, view, rng)?
            }
        };
        self.loads.sent(w, now);
        Some(Pick::of(w))
    }

    fn on_load(&mut self, worker: usize, snapshot: &LoadSnapshot) {
        self.loads.on_report(worker, snapshot);
    }
}
