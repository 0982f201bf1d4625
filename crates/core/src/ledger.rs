//! The router's own ledger of work it has sent to one worker, reconciled with engine telemetry.
//!
//! A load snapshot already counts the requests the engine had seen when it measured; the ledger must
//! add only what the snapshot cannot know. For every tracked request the ledger keeps its phase
//! timeline (reserved → first token → finished) and contributes
//!
//! ```text
//! delta = Σ_requests  contribution(phase now) − contribution(phase when the snapshot was taken)
//! ```
//!
//! so a request reserved after the snapshot adds its whole work, one that moved from prefill to
//! decode since then moves its work between the two terms, and one that finished since then
//! subtracts what the snapshot still shows for it. When a fresher snapshot arrives the requests it
//! covers stop contributing: reservations decay into the engine's own report without being counted
//! twice. A request is visible to a snapshot if its phase began strictly before the measurement.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::ids::RequestId;
use crate::time::Timestamp;

/// Finished requests kept for reconciliation beyond which the oldest are forgotten. They are
/// normally dropped at the next snapshot; the cap bounds memory when a worker's telemetry stops.
pub const MAX_RETAINED_FINISHED: usize = 4096;

/// The work one request puts on a worker, fixed at decision time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Work {
    /// Prompt tokens the worker must prefill (the prompt minus its cached prefix there).
    pub prefill_tokens: u64,
    /// Tokens the request may decode (its `max_tokens`).
    pub decode_tokens: u64,
    /// KV-cache tokens the request will occupy: its uncached prompt plus its output.
    pub kv_tokens: u64,
}

/// Signed load adjustments the ledger applies on top of a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct LoadDelta {
    /// Change in queued requests.
    pub waiting_requests: i64,
    /// Change in queued prefill tokens.
    pub waiting_tokens: i64,
    /// Change in running requests.
    pub running_requests: i64,
    /// Change in active decode tokens.
    pub decode_tokens: i64,
    /// Change in KV tokens in use.
    pub kv_tokens: i64,
}

impl LoadDelta {
    /// Both adjustments summed.
    pub fn plus(mut self, other: LoadDelta) -> LoadDelta {
        self.add(other, 1);
        self
    }

    fn add(&mut self, other: LoadDelta, sign: i64) {
        self.waiting_requests += sign * other.waiting_requests;
        self.waiting_tokens += sign * other.waiting_tokens;
        self.running_requests += sign * other.running_requests;
        self.decode_tokens += sign * other.decode_tokens;
        self.kv_tokens += sign * other.kv_tokens;
    }

    /// True when every term is zero.
    pub fn is_zero(&self) -> bool {
        *self == LoadDelta::default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Absent,
    Prefill,
    Decode,
}

#[derive(Debug, Clone)]
struct Tracked {
    work: Work,
    reserved_at: Timestamp,
    first_token_at: Option<Timestamp>,
    finished_at: Option<Timestamp>,
}

impl Tracked {
    fn phase_now(&self) -> Phase {
        match (self.finished_at, self.first_token_at) {
            (Some(_), _) => Phase::Absent,
            (None, Some(_)) => Phase::Decode,
            (None, None) => Phase::Prefill,
        }
    }

    fn phase_seen_by(&self, snapshot_at: Option<Timestamp>) -> Phase {
        let Some(t) = snapshot_at else {
            return Phase::Absent;
        };
        if self.reserved_at >= t || self.finished_at.is_some_and(|f| f < t) {
            Phase::Absent
        } else if self.first_token_at.is_some_and(|f| f < t) {
            Phase::Decode
        } else {
            Phase::Prefill
        }
    }

    fn contribution(&self, phase: Phase) -> LoadDelta {
        let w = &self.work;
        match phase {
            Phase::Absent => LoadDelta::default(),
            Phase::Prefill => LoadDelta {
                waiting_requests: 1,
                waiting_tokens: w.prefill_tokens as i64,
                kv_tokens: w.kv_tokens as i64,
                ..LoadDelta::default()
            },
            Phase::Decode => LoadDelta {
                running_requests: 1,
                decode_tokens: w.decode_tokens as i64,
                kv_tokens: w.kv_tokens as i64,
                ..LoadDelta::default()
            },
        }
    }

    /// The prefill tokens of a request that is still in prefill and that the snapshot already saw,
    /// for snapshots that count requests without measuring their prefill work.
    fn seen_in_prefill(&self, snapshot_at: Option<Timestamp>) -> Option<u64> {
        (self.phase_now() == Phase::Prefill && self.phase_seen_by(snapshot_at) == Phase::Prefill)
            .then_some(self.work.prefill_tokens)
    }

    fn term(&self, snapshot_at: Option<Timestamp>) -> LoadDelta {
        let mut d = self.contribution(self.phase_now());
        d.add(self.contribution(self.phase_seen_by(snapshot_at)), -1);
        d
    }
}

/// Errors of ledger transitions; the router maps them to its own error type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LedgerMiss {
    /// No request with that id is tracked.
    Unknown,
    /// The request already finished.
    Finished,
}

/// Requests a snapshot saw while they were in prefill, and their prefill tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SeenInPrefill {
    /// How many.
    pub requests: u64,
    /// Their prefill tokens (the prompt minus its cached prefix).
    pub tokens: u64,
}

impl SeenInPrefill {
    /// Both counts summed (this router's and its peers' requests).
    pub fn plus(self, other: SeenInPrefill) -> SeenInPrefill {
        SeenInPrefill { requests: self.requests + other.requests, tokens: self.tokens + other.tokens }
    }

    fn add(&mut self, tokens: Option<u64>, sign: i64) {
        if let Some(t) = tokens {
            self.requests = (self.requests as i64 + sign).max(0) as u64;
            self.tokens = (self.tokens as i64 + sign * t as i64).max(0) as u64;
        }
    }
}

/// The ledger of one worker.
#[derive(Debug, Default)]
pub struct WorkerLedger {
    requests: FxHashMap<RequestId, Tracked>,
    delta: LoadDelta,
    snapshot_at: Option<Timestamp>,
    in_flight: u32,
    finished_retained: usize,
    seen_in_prefill: SeenInPrefill,
}

impl WorkerLedger {
    /// The adjustment to apply to the worker's latest snapshot (or to zero load without one).
    pub fn delta(&self) -> LoadDelta {
        self.delta
    }

    /// This router's requests that the latest snapshot saw while they were in prefill and that are
    /// still in prefill. An engine that reports only request counts (vLLM) cannot say how much of
    /// their prefill is left, so the router keeps counting it itself (see `LoadSnapshot::estimated`).
    pub fn seen_in_prefill(&self) -> SeenInPrefill {
        self.seen_in_prefill
    }

    /// Requests reserved and not yet finished.
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    /// Whether the request is tracked and unfinished.
    pub fn is_in_flight(&self, id: RequestId) -> bool {
        self.requests.get(&id).is_some_and(|t| t.finished_at.is_none())
    }

    /// Requests tracked, finished ones awaiting reconciliation included.
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }

    /// Every unfinished request: its id, its work and whether it has reached decode.
    pub fn unfinished(&self) -> impl Iterator<Item = (RequestId, Work, bool)> + '_ {
        self.requests
            .iter()
            .filter(|(_, t)| t.finished_at.is_none())
            .map(|(id, t)| (*id, t.work, t.first_token_at.is_some()))
    }

    /// Whether the request is tracked, unfinished and past its first token.
    pub fn is_decoding(&self, id: RequestId) -> bool {
        self.requests.get(&id).is_some_and(|t| t.finished_at.is_none() && t.first_token_at.is_some())
    }

    /// Starts tracking a request in its prefill phase. Returns false if the id is already tracked.
    pub fn reserve(&mut self, id: RequestId, work: Work, now: Timestamp) -> bool {
        if self.requests.contains_key(&id) {
            return false;
        }
        let tracked = Tracked { work, reserved_at: now, first_token_at: None, finished_at: None };
        self.delta.add(tracked.term(self.snapshot_at), 1);
        self.requests.insert(id, tracked);
        self.in_flight += 1;
        true
    }

    /// Moves a request from prefill to decode. A repeated first token is a no-op.
    pub fn first_token(&mut self, id: RequestId, now: Timestamp) -> Result<(), LedgerMiss> {
        self.update(id, |t| {
            if t.first_token_at.is_none() {
                t.first_token_at = Some(now.max(t.reserved_at));
            }
        })
    }

    /// Ends a request (finished, failed or disconnected).
    pub fn finish(&mut self, id: RequestId, now: Timestamp) -> Result<(), LedgerMiss> {
        self.update(id, |t| t.finished_at = Some(now.max(t.reserved_at)))?;
        self.in_flight -= 1;
        self.finished_retained += 1;
        let tracked = &self.requests[&id];
        if tracked.term(self.snapshot_at).is_zero() && tracked.phase_seen_by(self.snapshot_at) == Phase::Absent {
            self.requests.remove(&id);
            self.finished_retained -= 1;
        } else if self.finished_retained > MAX_RETAINED_FINISHED {
            self.forget_finished(|_| true);
        }
        Ok(())
    }

    /// Reconciles with a snapshot the engine measured at `observed_at`. Older snapshots than the one
    /// already applied are ignored (returns false).
    pub fn on_snapshot(&mut self, observed_at: Timestamp) -> bool {
        if self.snapshot_at.is_some_and(|t| observed_at < t) {
            return false;
        }
        self.snapshot_at = Some(observed_at);
        self.forget_finished(|t| t.finished_at.is_some_and(|f| f < observed_at));
        self.delta = LoadDelta::default();
        self.seen_in_prefill = SeenInPrefill::default();
        for t in self.requests.values() {
            self.delta.add(t.term(self.snapshot_at), 1);
            self.seen_in_prefill.add(t.seen_in_prefill(self.snapshot_at), 1);
        }
        true
    }

    /// Forgets every tracked request (the worker restarted or was removed). Returns the unfinished ids.
    pub fn drain(&mut self) -> Vec<RequestId> {
        let ids = self.requests.iter().filter(|(_, t)| t.finished_at.is_none()).map(|(id, _)| *id).collect();
        *self = WorkerLedger { snapshot_at: self.snapshot_at, ..WorkerLedger::default() };
        ids
    }

    fn forget_finished(&mut self, pred: impl Fn(&Tracked) -> bool) {
        let snapshot_at = self.snapshot_at;
        let delta = &mut self.delta;
        let mut removed = 0;
        self.requests.retain(|_, t| {
            let drop = t.finished_at.is_some() && pred(t);
            if drop {
                delta.add(t.term(snapshot_at), -1);
                removed += 1;
            }
            !drop
        });
        self.finished_retained -= removed;
    }

    fn update(&mut self, id: RequestId, f: impl FnOnce(&mut Tracked)) -> Result<(), LedgerMiss> {
        let t = self.requests.get_mut(&id).ok_or(LedgerMiss::Unknown)?;
        if t.finished_at.is_some() {
            return Err(LedgerMiss::Finished);
        }
        let (before, seen_before) = (t.term(self.snapshot_at), t.seen_in_prefill(self.snapshot_at));
        f(t);
        let (after, seen_after) = (t.term(self.snapshot_at), t.seen_in_prefill(self.snapshot_at));
        self.delta.add(before, -1);
        self.delta.add(after, 1);
        self.seen_in_prefill.add(seen_before, -1);
        self.seen_in_prefill.add(seen_after, 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(p: u64, d: u64) -> Work {
        Work { prefill_tokens: p, decode_tokens: d, kv_tokens: p + d }
    }

    fn ms(v: u64) -> Timestamp {
        Timestamp::from_millis(v)
    }

    #[test]
    fn reservation_moves_from_prefill_to_decode_and_returns_to_zero() {
        let mut l = WorkerLedger::default();
        assert!(l.reserve(RequestId(1), work(100, 10), ms(0)));
        assert_eq!(l.delta().waiting_tokens, 100);
        assert_eq!(l.delta().waiting_requests, 1);
        l.first_token(RequestId(1), ms(5)).unwrap();
        assert_eq!(l.delta().waiting_tokens, 0);
        assert_eq!(l.delta().decode_tokens, 10);
        assert_eq!(l.delta().running_requests, 1);
        l.finish(RequestId(1), ms(9)).unwrap();
        assert!(l.delta().is_zero());
        assert_eq!(l.in_flight(), 0);
        assert_eq!(l.tracked(), 0);
    }

    #[test]
    fn snapshot_that_saw_the_request_absorbs_its_reservation() {
        let mut l = WorkerLedger::default();
        l.reserve(RequestId(1), work(100, 10), ms(0));
        l.on_snapshot(ms(10));
        assert!(l.delta().is_zero(), "the engine's report already counts it");
        l.first_token(RequestId(1), ms(20)).unwrap();
        // The engine still reports it waiting; the ledger moves it to decode.
        assert_eq!(l.delta().waiting_tokens, -100);
        assert_eq!(l.delta().decode_tokens, 10);
        l.finish(RequestId(1), ms(30)).unwrap();
        assert_eq!(l.delta().waiting_tokens, -100, "the snapshot still shows it until a newer one");
        assert_eq!(l.delta().decode_tokens, 0);
        l.on_snapshot(ms(40));
        assert!(l.delta().is_zero());
        assert_eq!(l.tracked(), 0);
    }

    #[test]
    fn stale_snapshot_is_ignored_and_unknown_requests_are_reported() {
        let mut l = WorkerLedger::default();
        assert!(l.on_snapshot(ms(10)));
        assert!(!l.on_snapshot(ms(5)));
        assert_eq!(l.first_token(RequestId(9), ms(1)), Err(LedgerMiss::Unknown));
        l.reserve(RequestId(1), work(1, 1), ms(11));
        l.finish(RequestId(1), ms(12)).unwrap();
        assert_eq!(l.finish(RequestId(1), ms(13)), Err(LedgerMiss::Unknown));
    }
}
