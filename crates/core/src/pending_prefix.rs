//! Prompts of the requests this router has in flight on a worker, so that the worker's projected KV
//! counts a prefix they share once.
//!
//! A reservation holds the KV tokens its request will need. A burst of requests sharing a prefix
//! was counted in full once per request, though the engine holds the prefix's blocks once for all
//! of them (a request queued behind one carrying its prefix finds those blocks computed; requests
//! running together share them); and a cached prefix was counted as free, though the engines report
//! cached blocks no request uses as free and they are in use again once a request runs on them.
//! Measured on four paced vLLM engines with 8,192 KV tokens each and 24 clients sending a
//! 1,900-token prefix at once (`CLIENTS=24 scripts/real-engines/incident.sh 4 1`): every peer's
//! projected KV went over capacity after three requests, every score then carried the full cache's
//! barrier, and the owner took 15 of the first 24 requests.
//!
//! This is no cache credit: the request is still scored as computing its whole uncached prompt,
//! and `cached_tokens` stays what the events show. It applies on workers whose KV events show they
//! cache prefixes, and lasts while a request carrying the prefix is in flight there (an engine does
//! not evict the blocks of a request it is running; once the request has ended its blocks are in the
//! events, or evicted, which the events say too).

use rustc_hash::FxHashMap;

use crate::ids::{BlockKey, RequestId};

/// The prompts of the requests in flight on one worker, by request.
#[derive(Debug, Default)]
pub(crate) struct PendingPrefixes {
    carriers: FxHashMap<RequestId, Box<[BlockKey]>>,
}

impl PendingPrefixes {
    /// Request `id`, whose prompt has these leading block keys, was sent here.
    pub(crate) fn note(&mut self, id: RequestId, keys: &[BlockKey]) {
        if !keys.is_empty() {
            self.carriers.insert(id, keys.into());
        }
    }

    /// Request `id` ended (or was dropped): its prompt no longer counts.
    pub(crate) fn release(&mut self, id: RequestId) {
        self.carriers.remove(&id);
    }

    /// The longest leading run of `keys` that a request in flight here carries.
    ///
    /// Keys are chained (a block's key names every block before it), so two prompts agree on a
    /// leading run and nowhere after it: each carrier's run is found by bisection.
    pub(crate) fn leading(&self, keys: &[BlockKey]) -> u32 {
        let Some(first) = keys.first() else {
            return 0;
        };
        let mut longest = 0;
        for carried in self.carriers.values().filter(|carried| carried.first() == Some(first)) {
            let (mut lo, mut hi) = (1, keys.len().min(carried.len()));
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if carried[mid] == keys[mid] {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            longest = longest.max(lo);
            if longest == keys.len() {
                break;
            }
        }
        longest as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey).collect()
    }

    #[test]
    fn a_prefix_counts_while_a_request_carrying_it_is_in_flight() {
        let mut pending = PendingPrefixes::default();
        pending.note(RequestId(1), &keys(0..4));
        let mut longer = keys(0..4);
        longer.extend(keys(100..102));
        assert_eq!(pending.leading(&longer), 4);
        assert_eq!(pending.leading(&keys(0..2)), 2);
        assert_eq!(pending.leading(&keys(7..9)), 0);
        assert_eq!(pending.leading(&[]), 0);
        // The deepest carrier counts; each counts until it ends.
        pending.note(RequestId(2), &longer);
        assert_eq!(pending.leading(&longer), 6);
        pending.release(RequestId(2));
        assert_eq!(pending.leading(&longer), 4);
        pending.release(RequestId(1));
        assert_eq!(pending.leading(&longer), 0);
    }

    #[test]
    fn prompts_that_part_count_only_their_common_run() {
        let mut pending = PendingPrefixes::default();
        // Chained keys: once two prompts differ, every later key differs too.
        let mut sent = keys(0..6);
        sent.extend(keys(600..604));
        pending.note(RequestId(1), &sent);
        assert_eq!(pending.leading(&keys(0..10)), 6);
        assert_eq!(pending.leading(&keys(0..1)), 1);
    }
}
