//! The router's side of sharing reservations between gateway replicas ([`crate::replicas`]): queueing
//! its own changes for the caller to publish, and applying what its peers publish.

use std::time::Duration;

use rustc_hash::FxHashMap;

use super::Router;
use crate::fleet::{Fleet, WorkerState};
use crate::ids::{ReplicaId, RequestId, WorkerId, WorkerSlot};
use crate::index::KvIndex;
use crate::load::PrefillDemand;
use crate::outbox::{BatchWindows, Outbox, OutboxWake};
use crate::replicas::{
    HeldReservation, Peer, PeerApply, PeerReservation, PeerStatus, ReservationChange, MAX_PEER_RESERVATIONS,
};
use crate::time::Timestamp;

/// What a peer's change touches besides the peer's own entry.
struct PeerTargets<'a> {
    workers: &'a mut [Option<WorkerState>],
    by_id: &'a FxHashMap<WorkerId, WorkerSlot>,
    demand: &'a mut PrefillDemand,
    index: &'a KvIndex,
}

/// What one change does to the peer's reservations and the workers' peer ledgers.
fn apply_change(
    peer: &mut Peer,
    next_local: &mut u64,
    fleet: PeerTargets<'_>,
    change: &ReservationChange,
    now: Timestamp,
) -> PeerApply {
    let PeerTargets { workers, by_id, demand, index } = fleet;
    let mut stats = PeerApply::default();
    match change {
        ReservationChange::Reserved { request, worker, work } => {
            if peer.requests.contains_key(request) {
                // A repeat (a change racing the full state that already listed it).
                return stats;
            }
            if peer.requests.len() >= MAX_PEER_RESERVATIONS {
                stats.over_limit += 1;
                return stats;
            }
            let Some(&slot) = by_id.get(worker) else {
                stats.unknown_worker += 1;
                return stats;
            };
            *next_local += 1;
            let local = RequestId(*next_local);
            let w = workers[slot.index()].as_mut().expect("by_id names live slots");
            w.peer_ledger.reserve(local, *work, now);
            // The peer's prefill loads the fleet as this router's own does.
            demand.add(work.prefill_tokens, now);
            // A peer's dispatch waits for the engine's events as this router's own do, or a
            // worker served mostly by peers would look quiet and lose its credit.
            w.note_dispatch(now, index.last_event_at(slot));
            peer.requests.insert(*request, PeerReservation { slot, local });
            stats.applied += 1;
        }
        ReservationChange::FirstToken { request } => {
            let Some(r) = peer.requests.get(request) else {
                stats.unknown_request += 1;
                return stats;
            };
            let ledger = &mut workers[r.slot.index()].as_mut().expect("peer reservations name live slots").peer_ledger;
            if ledger.first_token(r.local, now).is_ok() {
                stats.applied += 1;
            }
        }
        ReservationChange::Released { request } => {
            let Some(r) = peer.requests.remove(request) else {
                stats.unknown_request += 1;
                return stats;
            };
            let ledger = &mut workers[r.slot.index()].as_mut().expect("peer reservations name live slots").peer_ledger;
            if ledger.finish(r.local, now).is_ok() {
                stats.applied += 1;
            }
        }
    }
    stats
}

impl Router {
    /// Starts or stops queueing this router's reservation changes for its peers, batched with the
    /// default [`BatchWindows`]. Stopping drops the queue.
    pub fn share_reservations(&self, on: bool) {
        if on {
            if self.fleet.lock().outbox.is_none() {
                self.batch_reservation_changes(BatchWindows::default(), None);
            }
        } else {
            self.fleet.lock().outbox = None;
        }
    }

    /// Starts queueing this router's reservation changes for its peers (or restarts, dropping what
    /// was queued), due by `windows`; `wake` is called whenever the next publication moves earlier.
    pub fn batch_reservation_changes(&self, windows: BatchWindows, wake: Option<OutboxWake>) {
        self.fleet.lock().outbox = Some(Outbox::new(windows, wake));
    }

    /// When the queued changes are due to be published; `None` when none are queued.
    pub fn reservation_changes_due_at(&self) -> Option<Timestamp> {
        self.fleet.lock().outbox.as_ref().and_then(Outbox::due_at)
    }

    /// The queued changes, oldest first, if they are due at `now` ([`crate::outbox`]); nothing
    /// otherwise, or when not sharing.
    pub fn take_due_reservation_changes(&self, now: Timestamp) -> Vec<ReservationChange> {
        self.fleet.lock().outbox.as_mut().map(|o| o.take_due(now)).unwrap_or_default()
    }

    /// Every queued change, oldest first, due or not (empty when not sharing).
    pub fn take_reservation_changes(&self) -> Vec<ReservationChange> {
        self.fleet.lock().outbox.as_mut().map(Outbox::take_all).unwrap_or_default()
    }

    /// Every reservation this router holds now, for its periodic full state.
    pub fn held_reservations(&self) -> Vec<HeldReservation> {
        let fleet = self.fleet.lock();
        fleet
            .workers
            .iter()
            .flatten()
            .flat_map(|w| {
                w.ledger.unfinished().map(|(request, work, decoding)| HeldReservation {
                    request,
                    worker: w.config.id.clone(),
                    work,
                    decoding,
                })
            })
            .collect()
    }

    /// Applies a peer's reservation changes, in order, at local time `now`.
    pub fn apply_peer_changes(&self, peer: &ReplicaId, changes: &[ReservationChange], now: Timestamp) -> PeerApply {
        let mut guard = self.fleet.lock();
        let index = self.index.read();
        let decisions = changes.iter().filter(|c| matches!(c, ReservationChange::Reserved { .. })).count();
        guard.concurrency.note_peer_decisions(u32::try_from(decisions).unwrap_or(u32::MAX), now);
        let Fleet { workers, by_id, peers, demand, .. } = &mut *guard;
        let (p, next_local) = peers.heard(peer, now);
        let mut stats = PeerApply::default();
        for change in changes {
            let targets = PeerTargets { workers: workers.as_mut_slice(), by_id, demand, index: &index };
            stats.merge(apply_change(p, next_local, targets, change, now));
        }
        stats
    }

    /// Replaces what this router holds for `peer` with its full state: reservations it no longer
    /// lists end, new ones start, and ones that reached decode move there.
    pub fn apply_peer_state(&self, peer: &ReplicaId, held: &[HeldReservation], now: Timestamp) -> PeerApply {
        let mut guard = self.fleet.lock();
        let index = self.index.read();
        let Fleet { workers, by_id, peers, demand, .. } = &mut *guard;
        let (p, next_local) = peers.heard(peer, now);
        let mut stats = PeerApply::default();
        let listed: FxHashMap<RequestId, &HeldReservation> = held.iter().map(|h| (h.request, h)).collect();
        let gone: Vec<RequestId> = p
            .requests
            .iter()
            .filter(|(id, r)| listed.get(id).is_none_or(|h| by_id.get(&h.worker) != Some(&r.slot)))
            .map(|(id, _)| *id)
            .collect();
        for request in gone {
            let targets = PeerTargets { workers: workers.as_mut_slice(), by_id, demand, index: &index };
            stats.merge(apply_change(p, next_local, targets, &ReservationChange::Released { request }, now));
        }
        for h in held {
            let change = ReservationChange::Reserved { request: h.request, worker: h.worker.clone(), work: h.work };
            let targets = PeerTargets { workers: workers.as_mut_slice(), by_id, demand, index: &index };
            stats.merge(apply_change(p, next_local, targets, &change, now));
            if h.decoding {
                let ledger_says_decoding = p.requests.get(&h.request).is_some_and(|r| {
                    workers[r.slot.index()].as_ref().is_some_and(|w| w.peer_ledger.is_decoding(r.local))
                });
                if !ledger_says_decoding {
                    let change = ReservationChange::FirstToken { request: h.request };
                    let targets = PeerTargets { workers: workers.as_mut_slice(), by_id, demand, index: &index };
                    stats.merge(apply_change(p, next_local, targets, &change, now));
                }
            }
        }
        stats
    }

    /// Ends the reservations of every peer not heard from for longer than `after` and forgets it.
    /// Returns the peers expired.
    pub fn expire_peers(&self, now: Timestamp, after: Duration) -> Vec<ReplicaId> {
        let silent: Vec<ReplicaId> = {
            let fleet = self.fleet.lock();
            fleet
                .peers
                .peers
                .iter()
                .filter(|(_, p)| now.saturating_since(p.last_heard) > after)
                .map(|(k, _)| k.clone())
                .collect()
        };
        for peer in &silent {
            self.forget_peer(peer, now);
        }
        silent
    }

    /// Ends every reservation of `peer` at `now` and forgets it (it said goodbye, or went silent).
    pub fn forget_peer(&self, peer: &ReplicaId, now: Timestamp) {
        let mut guard = self.fleet.lock();
        let Fleet { workers, peers, .. } = &mut *guard;
        let Some(p) = peers.peers.remove(peer) else {
            return;
        };
        for r in p.requests.into_values() {
            if let Some(w) = workers[r.slot.index()].as_mut() {
                let _ = w.peer_ledger.finish(r.local, now);
            }
        }
    }

    /// Every peer this router has heard from and not expired, by name.
    pub fn peers(&self, now: Timestamp) -> Vec<PeerStatus> {
        let fleet = self.fleet.lock();
        let mut out: Vec<PeerStatus> = fleet
            .peers
            .peers
            .iter()
            .map(|(id, p)| PeerStatus {
                replica: id.clone(),
                heard_ms_ago: now.saturating_since(p.last_heard).as_millis() as u64,
                reservations: p.requests.len(),
            })
            .collect();
        out.sort_by(|a, b| a.replica.cmp(&b.replica));
        out
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::ledger::Work;
    use crate::{KvState, LoadSnapshot, Mode, PolicyConfig, RouteRequest, WorkerConfig};

    fn router(workers: &[&str]) -> Router {
        let r = Router::new(16, PolicyConfig::projected(Mode::Enforce)).unwrap();
        for w in workers {
            r.add_worker(WorkerConfig::new(*w), KvState::Synced).unwrap();
            r.update_load(&WorkerId::new(*w), LoadSnapshot::default()).unwrap();
        }
        r
    }

    fn ms(v: u64) -> Timestamp {
        Timestamp::from_millis(v)
    }

    fn reserved(request: u64, worker: &str, prefill: u64) -> ReservationChange {
        ReservationChange::Reserved {
            request: RequestId(request),
            worker: WorkerId::new(worker),
            work: Work { prefill_tokens: prefill, decode_tokens: 10, kv_tokens: prefill + 10 },
        }
    }

    fn status(r: &Router, w: &str, now: Timestamp) -> crate::WorkerStatus {
        r.worker_status(&WorkerId::new(w), now).unwrap()
    }

    #[test]
    fn a_peer_reservation_loads_the_worker_until_a_report_includes_it() {
        let r = router(&["a", "b"]);
        let peer = ReplicaId::new("p");
        let stats = r.apply_peer_changes(&peer, &[reserved(1, "a", 500)], ms(10));
        assert_eq!(stats.applied, 1);
        let a = status(&r, "a", ms(11));
        assert_eq!((a.waiting_tokens, a.peer_in_flight, a.in_flight), (500, 1, 0));
        // The engine's next report counts the request itself: the peer ledger stops adding it.
        r.update_load(
            &WorkerId::new("a"),
            LoadSnapshot { observed_at: ms(20), waiting_requests: 1, waiting_tokens: 500, ..LoadSnapshot::default() },
        )
        .unwrap();
        assert_eq!(status(&r, "a", ms(21)).waiting_tokens, 500, "counted once, not twice");
        r.apply_peer_changes(&peer, &[ReservationChange::FirstToken { request: RequestId(1) }], ms(30));
        let a = status(&r, "a", ms(31));
        assert_eq!(
            (a.waiting_tokens, a.running_requests),
            (0, 1),
            "the report still shows it waiting; the peer moved it to decode"
        );
        r.apply_peer_changes(&peer, &[ReservationChange::Released { request: RequestId(1) }], ms(40));
        r.update_load(&WorkerId::new("a"), LoadSnapshot { observed_at: ms(50), ..LoadSnapshot::default() }).unwrap();
        let a = status(&r, "a", ms(51));
        assert!(a.peer_reserved.is_zero() && a.peer_in_flight == 0, "{a:?}");
    }

    #[test]
    fn a_replica_that_knows_its_peers_reservations_spreads_a_burst() {
        let (one, two) = (router(&["a", "b", "c"]), router(&["a", "b", "c"]));
        one.share_reservations(true);
        two.share_reservations(true);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let keys = one.request_keys(crate::Namespace::DEFAULT, &[7; 64]);
        let mut chosen = Vec::new();
        for i in 0..3u64 {
            let (me, other, other_name) = if i % 2 == 0 { (&one, &two, "one") } else { (&two, &one, "two") };
            let req = RouteRequest {
                id: RequestId(i),
                keys: &keys,
                prompt_tokens: 64,
                max_tokens: 8,
                exclude: &[],
                keys_cover_prompt: true,
            };
            chosen.push(me.decide(&req, ms(i), &mut rng).unwrap().worker.as_str().to_owned());
            let changes = me.take_reservation_changes();
            other.apply_peer_changes(&ReplicaId::new(other_name), &changes, ms(i));
        }
        chosen.sort();
        // Without sharing, `two` would not know of `one`'s first request and pick "a" as well.
        assert_eq!(chosen, ["a", "b", "c"]);
    }

    #[test]
    fn the_outbox_lists_every_change_in_order_and_only_when_sharing() {
        let r = router(&["a"]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let req = RouteRequest {
            id: RequestId(1),
            keys: &[],
            prompt_tokens: 40,
            max_tokens: 8,
            exclude: &[],
            keys_cover_prompt: true,
        };
        r.decide(&req, ms(0), &mut rng).unwrap();
        assert!(r.take_reservation_changes().is_empty(), "not sharing");
        r.release(RequestId(1), ms(1)).unwrap();
        r.share_reservations(true);
        r.decide(&req, ms(2), &mut rng).unwrap();
        assert_eq!(r.held_reservations().len(), 1);
        r.first_token(RequestId(1), ms(3)).unwrap();
        assert!(r.held_reservations()[0].decoding);
        r.release(RequestId(1), ms(4)).unwrap();
        let changes = r.take_reservation_changes();
        let work = Work { prefill_tokens: 40, decode_tokens: 8, kv_tokens: 48 };
        assert_eq!(
            changes,
            vec![
                ReservationChange::Reserved { request: RequestId(1), worker: WorkerId::new("a"), work },
                ReservationChange::FirstToken { request: RequestId(1) },
                ReservationChange::Released { request: RequestId(1) },
            ]
        );
        assert!(r.take_reservation_changes().is_empty());
        assert!(r.held_reservations().is_empty());
    }

    #[test]
    fn a_full_state_replaces_what_was_held_for_the_peer() {
        let r = router(&["a", "b"]);
        let peer = ReplicaId::new("p");
        r.apply_peer_changes(&peer, &[reserved(1, "a", 100), reserved(2, "b", 200)], ms(0));
        let work = Work { prefill_tokens: 300, decode_tokens: 10, kv_tokens: 310 };
        let held = [
            HeldReservation { request: RequestId(2), worker: WorkerId::new("b"), work, decoding: true },
            HeldReservation { request: RequestId(3), worker: WorkerId::new("a"), work, decoding: false },
        ];
        r.apply_peer_state(&peer, &held, ms(5));
        let (a, b) = (status(&r, "a", ms(6)), status(&r, "b", ms(6)));
        assert_eq!((a.waiting_tokens, a.peer_in_flight), (300, 1), "1 ended (the state lost it), 3 started");
        assert_eq!(
            (b.waiting_tokens, b.running_requests, b.peer_in_flight),
            (0, 1, 1),
            "2 kept its first work and moved to decode"
        );
        assert_eq!(r.peers(ms(6))[0].reservations, 2);
        // Applying the same state again changes nothing.
        assert_eq!(r.apply_peer_state(&peer, &held, ms(7)).applied, 0);
    }

    #[test]
    fn a_silent_peer_expires_and_its_reservations_end() {
        let r = router(&["a"]);
        r.apply_peer_changes(&ReplicaId::new("quiet"), &[reserved(1, "a", 100)], ms(0));
        r.apply_peer_changes(&ReplicaId::new("chatty"), &[reserved(1, "a", 50)], ms(0));
        r.apply_peer_changes(&ReplicaId::new("chatty"), &[], ms(4_000));
        assert!(r.expire_peers(ms(5_000), Duration::from_secs(5)).is_empty(), "not silent for longer than 5 s yet");
        assert_eq!(r.expire_peers(ms(5_001), Duration::from_secs(5)), vec![ReplicaId::new("quiet")]);
        let a = status(&r, "a", ms(5_001));
        assert_eq!((a.waiting_tokens, a.peer_in_flight), (50, 1));
        assert_eq!(r.peers(ms(5_001)).iter().map(|p| p.replica.as_str()).collect::<Vec<_>>(), ["chatty"]);
    }

    #[test]
    fn unknown_workers_and_requests_are_counted_and_ignored() {
        let r = router(&["a"]);
        let peer = ReplicaId::new("p");
        let stats = r.apply_peer_changes(
            &peer,
            &[
                reserved(1, "elsewhere", 10),
                ReservationChange::Released { request: RequestId(9) },
                reserved(2, "a", 10),
                reserved(2, "a", 10),
            ],
            ms(0),
        );
        assert_eq!(stats, PeerApply { applied: 1, unknown_worker: 1, unknown_request: 1, over_limit: 0 });
        assert_eq!(status(&r, "a", ms(0)).peer_in_flight, 1, "the repeated reservation is applied once");
    }

    #[test]
    fn removing_a_worker_releases_its_reservations_for_the_peers() {
        let r = router(&["a", "b"]);
        r.share_reservations(true);
        r.apply_peer_changes(&ReplicaId::new("p"), &[reserved(1, "a", 10)], ms(0));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let req = RouteRequest {
            id: RequestId(5),
            keys: &[],
            prompt_tokens: 40,
            max_tokens: 8,
            exclude: &[WorkerId::new("b")],
            keys_cover_prompt: true,
        };
        r.decide(&req, ms(0), &mut rng).unwrap();
        r.remove_worker(&WorkerId::new("a"), ms(0)).unwrap();
        assert_eq!(r.take_reservation_changes().last(), Some(&ReservationChange::Released { request: RequestId(5) }));
        assert_eq!(r.peers(ms(0))[0].reservations, 0);
        // A new worker in the reused slot starts with no peer reservation.
        r.add_worker(WorkerConfig::new("c"), KvState::Synced).unwrap();
        assert_eq!(status(&r, "c", ms(0)).peer_in_flight, 0);
    }

    proptest::proptest! {
        #[test]
        fn peer_changes_in_any_order_leave_nothing_once_all_are_released(ops in proptest::collection::vec((0u64..8, 0u8..3, 0usize..2), 0..60)) {
            let r = router(&["a", "b"]);
            let peer = ReplicaId::new("p");
            for (i, (request, op, worker)) in ops.iter().enumerate() {
                let change = match op {
                    0 => reserved(*request, ["a", "b"][*worker], 100),
                    1 => ReservationChange::FirstToken { request: RequestId(*request) },
                    _ => ReservationChange::Released { request: RequestId(*request) },
                };
                r.apply_peer_changes(&peer, &[change], ms(i as u64));
            }
            r.apply_peer_state(&peer, &[], ms(100));
            for w in ["a", "b"] {
                let s = status(&r, w, ms(100));
                proptest::prop_assert!(s.peer_reserved.is_zero() && s.peer_in_flight == 0, "{:?}", s);
            }
        }
    }
}
