//! Faults that combine with any workload.

use std::time::Duration;

use kvgate_core::Timestamp;

use crate::SimError;

/// One injected fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// KV events reach the router `extra` later than normal, with up to `jitter` more at random. One
    /// publisher's stream keeps its order (ZMQ over TCP); live and replayed batches interleave.
    KvDelay {
        /// Added delay.
        extra: Duration,
        /// Random extra delay per batch, up to this.
        jitter: Duration,
    },
    /// Each live KV batch is lost with this probability (the replay socket still answers).
    KvLoss {
        /// Loss probability, 0 to 1.
        probability: f64,
        /// Whether engines serve replays (false: lost batches are lost for good).
        replay: bool,
    },
    /// The network to `worker` breaks at `at` for `duration`: in-flight requests fail, events and
    /// polls are lost, and health checks notice after the detection delay.
    Disconnect {
        /// Engine index.
        worker: usize,
        /// When.
        at: Timestamp,
        /// For how long.
        duration: Duration,
    },
    /// `worker`'s engine process restarts at `at`: requests fail, its cache is empty, event sequence
    /// numbers restart at 0 and its block hashes change.
    Restart {
        /// Engine index.
        worker: usize,
        /// When.
        at: Timestamp,
    },
    /// The load poller of `worker` fails from `from` to `until`: its last report ages.
    StaleTelemetry {
        /// Engine index.
        worker: usize,
        /// From.
        from: Timestamp,
        /// Until.
        until: Timestamp,
    },
}

/// Fault names the CLI accepts.
pub const FAULT_NAMES: &[&str] =
    &["kv-delay", "kv-loss", "kv-loss-no-replay", "disconnect", "restart", "stale-telemetry"];

/// Builds a named fault for a run whose traffic starts at `start` and lasts `span`; `target` is the
/// engine the fault hits (the hot owner where the scenario has one).
pub fn named(name: &str, target: usize, start: Timestamp, span: Duration) -> Result<Fault, SimError> {
    let at = start.saturating_add(span / 3);
    Ok(match name {
        "kv-delay" => Fault::KvDelay { extra: Duration::from_millis(500), jitter: Duration::from_millis(200) },
        "kv-loss" => Fault::KvLoss { probability: 0.2, replay: true },
        "kv-loss-no-replay" => Fault::KvLoss { probability: 0.2, replay: false },
        "disconnect" => Fault::Disconnect { worker: target, at, duration: span / 3 },
        "restart" => Fault::Restart { worker: target, at },
        "stale-telemetry" => Fault::StaleTelemetry { worker: target, from: at, until: at.saturating_add(span / 3) },
        other => {
            return Err(SimError::Config(format!(
                "unknown fault {other:?}: expected one of {}",
                FAULT_NAMES.join(", ")
            )))
        }
    })
}
