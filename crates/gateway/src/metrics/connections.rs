//! The client connections the gateway holds: how many, its cap, and those it closed to stay
//! within its file descriptors.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::ReasonLabel;

/// Why a connection was closed by the gateway: see [`ConnectionMetrics::shed`].
pub const SHED_FOR_ROOM: &str = "cap";
/// See [`SHED_FOR_ROOM`].
pub const SHED_BY_PRESSURE_TIMEOUT: &str = "pressure_timeout";
/// See [`SHED_FOR_ROOM`].
pub const SHED_BY_DRAIN: &str = "drain";

/// The connection metrics.
#[derive(Debug, Default)]
pub struct ConnectionMetrics {
    /// Client connections accepted.
    pub accepted: Counter,
    /// Client connections open now, those being closed included.
    pub open: Gauge,
    /// The connection cap in force (`max_connections`, or less by the descriptor limit).
    pub cap: Gauge,
    /// The header and idle timeout in force, seconds: shorter than `header_timeout_ms` under
    /// pressure.
    pub header_timeout_seconds: Gauge<f64, AtomicU64>,
    /// Connections closed by the gateway while not in a request, by reason: `cap` (the oldest,
    /// to make room for a new one), `pressure_timeout` (waited longer than the shortened timeout),
    /// `drain` (at shutdown).
    pub shed: Family<ReasonLabel, Counter>,
}

impl ConnectionMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = ConnectionMetrics::default();
        registry.register("connections_accepted", "Client connections accepted", m.accepted.clone());
        registry.register("connections_open", "Client connections open now", m.open.clone());
        registry.register(
            "connections_cap",
            "Client connections held at once, at most: max_connections, or less by the file descriptor limit",
            m.cap.clone(),
        );
        registry.register(
            "header_timeout_seconds",
            "The header and idle timeout in force: header_timeout_ms, shrinking towards header_timeout_min_ms as connections near the cap",
            m.header_timeout_seconds.clone(),
        );
        registry.register(
            "connections_shed",
            "Connections closed while not in a request, by reason: cap (oldest, to make room), pressure_timeout, drain",
            m.shed.clone(),
        );
        m
    }

    /// Counts one connection closed for `reason`.
    pub fn count_shed(&self, reason: &str) {
        self.shed.get_or_create(&ReasonLabel { reason: reason.to_owned() }).inc();
    }
}
