//! `kvgate_replica_*`: the replica bus, seen from one replica.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// `direction` and `outcome` labels of bus messages.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MessageLabels {
    /// `sent` or `received`.
    pub direction: &'static str,
    /// sent: `ok`, `dropped` (bus down), `too_large`; received: `ok`, `own`, `duplicate_id`,
    /// `garbage`, `foreign`.
    pub outcome: &'static str,
}

/// The replica bus metrics.
#[derive(Debug, Clone, Default)]
pub struct ReplicaMetrics {
    /// 1 while the bus is connected.
    pub connected: Gauge,
    /// Peers heard from and not expired.
    pub peers: Gauge,
    /// Peers expired for silence.
    pub peers_expired: Counter,
    /// Peer reservation changes applied.
    pub changes_applied: Counter,
    /// Peer decisions made blind to each of this replica's, on average, as of its last request.
    pub concurrent_peers: Gauge<f64, AtomicU64>,
    /// Requests held back before their decision because peers decided in step.
    pub staggered: Counter,
    messages: Family<MessageLabels, Counter>,
    /// Every direction and outcome, created at registration: a message counts without a lookup
    /// in the family (a lock and a hash each), and every series shows from the start.
    by_outcome: Vec<(MessageLabels, Counter)>,
}

/// Every `direction` and `outcome` pair [`ReplicaMetrics::messages`] counts.
const OUTCOMES: [(&str, &str); 8] = [
    ("sent", "ok"),
    ("sent", "dropped"),
    ("sent", "too_large"),
    ("received", "ok"),
    ("received", "own"),
    ("received", "duplicate_id"),
    ("received", "garbage"),
    ("received", "foreign"),
];

impl ReplicaMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let mut m = ReplicaMetrics::default();
        m.by_outcome = OUTCOMES
            .iter()
            .map(|&(direction, outcome)| {
                let labels = MessageLabels { direction, outcome };
                let counter = m.messages.get_or_create(&labels).clone();
                (labels, counter)
            })
            .collect();
        registry.register("replica_bus_connected", "1 while the replica bus (NATS) is connected", m.connected.clone());
        registry.register("replica_peers", "Peer replicas heard from and not expired", m.peers.clone());
        registry.register("replica_peers_expired", "Peer replicas expired for silence", m.peers_expired.clone());
        registry.register(
            "replica_changes_applied",
            "Peer reservation changes applied to this replica's view",
            m.changes_applied.clone(),
        );
        registry.register(
            "replica_concurrent_peers",
            "Peer replicas' decisions made blind to each of this replica's, on average (as of its last request)",
            m.concurrent_peers.clone(),
        );
        registry.register(
            "replica_staggered",
            "Requests held up to stagger_ms before their decision because peers decided in step",
            m.staggered.clone(),
        );
        registry.register("replica_messages", "Replica bus messages by direction and outcome", m.messages.clone());
        m
    }

    /// The counter of one direction and outcome.
    pub fn messages(&self, direction: &'static str, outcome: &'static str) -> Counter {
        let labels = MessageLabels { direction, outcome };
        match self.by_outcome.iter().find(|(l, _)| *l == labels) {
            Some((_, counter)) => counter.clone(),
            None => self.messages.get_or_create(&labels).clone(),
        }
    }
}
