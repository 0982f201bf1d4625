//! `least_load`: the projected formula with no cache credit. This is what kvgate does in mode `off`
//! and the winner the hard escape falls back to. It follows SMG's expected-wait policy
//! (`peer-policies.md` §1) in spirit, in seconds: queued prefill plus active decode plus this
//! request's full prefill plus the KV barrier.

use crate::decision::Reason;
use crate::policy::projected::Terms;
use crate::policy::{Choice, Choosing, Policy};

/// The `least_load` policy.
pub(crate) struct LeastLoad;

impl Policy for LeastLoad {
    fn choose(&self, c: &mut Choosing<'_>) -> Choice {
        Choice { chosen: c.load_winner, reason: Reason::LoadOnly, enforce: None }
    }
}

/// Index of the load-only winner among `n` candidates whose terms `terms_of` gives (ties broken by
/// `draw`).
pub fn pick<'a>(n: usize, terms_of: impl Fn(usize) -> &'a Terms, draw: u64) -> Option<usize> {
    super::argmin(n, |i| terms_of(i).load_only_s, draw)
}
