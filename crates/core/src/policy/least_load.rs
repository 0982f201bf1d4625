//! `least_load`: the projected formula with no cache credit. This is what kvgate does in mode `off`
//! and the winner the hard escape falls back to. It follows SMG's expected-wait policy
//! (`peer-policies.md` §1) in spirit, in seconds: queued prefill plus active decode plus this
//! request's full prefill plus the KV barrier.

use crate::policy::projected::Terms;

/// Index of the load-only winner among `terms` (ties broken by `draw`).
pub fn pick(terms: &[Terms], draw: u64) -> Option<usize> {
    super::argmin(terms.len(), |i| terms[i].load_only_s, draw)
}
