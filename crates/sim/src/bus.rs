//! The replica bus as the simulator models it: what `kvgate serve` does with `[replicas]` over NATS.
//!
//! Each replica's router queues its reservation changes and publishes them by the core's batching
//! rule (`kvgate_core::outbox`): a reservation at once, or `flush` after the previous message if
//! that was sooner; first tokens and releases with the next message, at most `lazy_flush` later. Every peer applies a batch `delay` later, in
//! order, unless the message is lost (probability `loss`, each message and peer on its own). Every `state_interval` every
//! replica also publishes its whole state, which heals what was lost, as the gateway does. Only
//! policies run by the core (`projected`, `cache_aware`, the baselines) keep reservations to share;
//! the peers' reimplementations ignore the bus.

use std::sync::Arc;
use std::time::Duration;

use kvgate_core::{BatchWindows, HeldReservation, ReservationChange};

/// The bus between replicas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BusModel {
    /// The least time between two messages of a replica: a reservation waits only for the rest
    /// of this gap.
    pub flush: Duration,
    /// How long a first token or a release may wait to ride with the next reservation.
    pub lazy_flush: Duration,
    /// Time from publish to a peer applying the message.
    pub delay: Duration,
    /// Probability that one peer misses one message.
    pub loss: f64,
    /// How often each replica publishes its whole state.
    pub state_interval: Duration,
    /// The longest a replica holds a request before deciding it while its peers decide in step
    /// ([`kvgate_core::stagger_delay`]); zero never holds.
    pub stagger: Duration,
}

impl Default for BusModel {
    /// The gateway's defaults (`flush_ms` 2, `lazy_flush_ms` 20, `state_interval_ms` 1000,
    /// `stagger_ms` 10) and a
    /// loopback-class NATS hop of 1 ms, lossless.
    fn default() -> Self {
        BusModel {
            flush: BatchWindows::SPACING,
            lazy_flush: BatchWindows::LAZY,
            delay: Duration::from_millis(1),
            loss: 0.0,
            state_interval: Duration::from_secs(1),
            stagger: kvgate_core::concurrent_peers::DEFAULT_STAGGER,
        }
    }
}

impl BusModel {
    /// The core's batching windows for this bus.
    pub fn windows(&self) -> BatchWindows {
        BatchWindows { spacing: self.flush, lazy: self.lazy_flush }
    }

    /// Checks the loss probability.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.loss) {
            return Err(format!("replica bus loss {} is not in 0..1", self.loss));
        }
        Ok(())
    }
}

/// One message on the bus.
#[derive(Debug, Clone)]
pub enum BusMessage {
    /// A batch of changes.
    Changes(Arc<Vec<ReservationChange>>),
    /// A replica's whole state.
    State(Arc<Vec<HeldReservation>>),
}
