//! Reservations shared between gateway replicas.
//!
//! Each replica reserves work in its own ledger when it decides. With sharing on, the router also
//! queues every change of its reservations ([`ReservationChange`]) for the caller to publish, and
//! applies what its peers publish to a second ledger per worker, the *peer ledger*. The policy scores
//! the sum of both, and a load report reconciles the peer ledger exactly as it reconciles the own one:
//! a peer's request the report already counts stops contributing, so nothing is counted twice.
//!
//! The bus is lossy (a reconnect drops messages), so every replica also publishes its whole set of
//! reservations now and then ([`HeldReservation`]); applying it replaces what this router held for
//! that peer. A peer that goes silent is expired: its reservations end, and the next load report
//! shows whatever the engine still runs for it.
//!
//! Peer timestamps are never compared with local ones: a change takes effect at the local time it
//! is applied, which is when this router learns of it.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::ids::{ReplicaId, RequestId, WorkerId, WorkerSlot};
use crate::ledger::Work;
use crate::time::Timestamp;

/// Peers tracked at once; the oldest-heard is forgotten to make room for a new one.
pub const MAX_PEERS: usize = 256;
/// Reservations one peer may hold here; more are refused (counted, not applied).
pub const MAX_PEER_RESERVATIONS: usize = 1 << 16;

/// One change of a replica's reservations, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReservationChange {
    /// A decision reserved `work` on `worker`.
    Reserved {
        /// The deciding replica's request id.
        request: RequestId,
        /// Where it went.
        worker: WorkerId,
        /// What it will cost there.
        work: Work,
    },
    /// The request's first token arrived: its prefill is done, it decodes now.
    FirstToken {
        /// The deciding replica's request id.
        request: RequestId,
    },
    /// The request finished, failed or was abandoned.
    Released {
        /// The deciding replica's request id.
        request: RequestId,
    },
}

/// One reservation a replica holds, as its periodic full state lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldReservation {
    /// The replica's request id.
    pub request: RequestId,
    /// Where it went.
    pub worker: WorkerId,
    /// What it costs there.
    pub work: Work,
    /// Whether its first token has arrived.
    pub decoding: bool,
}

/// What applying a peer's message did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PeerApply {
    /// Changes that altered a reservation.
    pub applied: u64,
    /// Changes naming a worker this router does not have (a peer with another fleet list).
    pub unknown_worker: u64,
    /// Changes for requests this router does not hold for the peer (already released, or lost).
    pub unknown_request: u64,
    /// Reservations refused because the peer holds [`MAX_PEER_RESERVATIONS`] here already.
    pub over_limit: u64,
}

impl PeerApply {
    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: PeerApply) {
        self.applied += other.applied;
        self.unknown_worker += other.unknown_worker;
        self.unknown_request += other.unknown_request;
        self.over_limit += other.over_limit;
    }
}

/// What an operator sees of one peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerStatus {
    /// The peer.
    pub replica: ReplicaId,
    /// Milliseconds since this router last heard from it.
    pub heard_ms_ago: u64,
    /// Its reservations this router holds.
    pub reservations: usize,
}

/// A peer's reservation as this router holds it.
#[derive(Debug)]
pub(crate) struct PeerReservation {
    /// The worker it is on.
    pub(crate) slot: WorkerSlot,
    /// The id under which the worker's peer ledger tracks it (unique across peers).
    pub(crate) local: RequestId,
}

/// One peer: when it was last heard from, and its reservations here by its own request ids.
#[derive(Debug)]
pub(crate) struct Peer {
    pub(crate) last_heard: Timestamp,
    pub(crate) requests: FxHashMap<RequestId, PeerReservation>,
}

/// Every peer and the reservations it shared, behind the router's fleet lock.
#[derive(Debug, Default)]
pub(crate) struct PeerBook {
    pub(crate) peers: FxHashMap<ReplicaId, Peer>,
    pub(crate) next_local: u64,
}

impl PeerBook {
    /// Drops the reservations on a removed worker (its ledgers are gone with it).
    pub(crate) fn forget_slot(&mut self, slot: WorkerSlot) {
        for peer in self.peers.values_mut() {
            peer.requests.retain(|_, r| r.slot != slot);
        }
    }

    /// The peer's entry (created if new) and the synthetic id counter, marking it heard at `now`.
    pub(crate) fn heard(&mut self, id: &ReplicaId, now: Timestamp) -> (&mut Peer, &mut u64) {
        if !self.peers.contains_key(id) && self.peers.len() >= MAX_PEERS {
            // Bounded memory: the longest-silent peer makes room (expiry would soon end it anyway).
            if let Some(oldest) = self.peers.iter().min_by_key(|(_, p)| p.last_heard).map(|(k, _)| k.clone()) {
                self.peers.remove(&oldest);
            }
        }
        let peer =
            self.peers.entry(id.clone()).or_insert_with(|| Peer { last_heard: now, requests: FxHashMap::default() });
        peer.last_heard = peer.last_heard.max(now);
        (peer, &mut self.next_local)
    }
}
