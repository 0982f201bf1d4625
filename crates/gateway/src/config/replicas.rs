//! The `[replicas]` table: sharing reservations with the other gateway replicas over NATS.

use std::time::Duration;

use kvgate_core::policy::Knob;
use serde::Deserialize;

use super::check;
use crate::GatewayError;

/// The `[replicas]` table as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReplicasTable {
    pub(super) bus: Option<String>,
    pub(super) subject: Option<String>,
    pub(super) replica_id: Option<String>,
    pub(super) expiry_ms: Option<u64>,
    pub(super) flush_ms: Option<u64>,
    pub(super) lazy_flush_ms: Option<u64>,
    pub(super) state_interval_ms: Option<u64>,
    pub(super) stagger_ms: Option<u64>,
}

/// The subject replicas share reservations on when none is configured.
pub const DEFAULT_SUBJECT: &str = "kvgate.reservations";

/// See [`ReplicasConfig::expiry`].
pub const REPLICA_EXPIRY_MS: Knob = Knob {
    name: "expiry_ms",
    min: 500.0,
    max: 600_000.0,
    default: 5000.0,
    meaning: "a peer replica not heard from for this long is gone: its reservations end",
};
/// See [`ReplicasConfig::flush`].
pub const REPLICA_FLUSH_MS: Knob = Knob {
    name: "flush_ms",
    min: 1.0,
    max: 1000.0,
    default: 2.0,
    meaning: "the least time between two bus messages of this replica: a reservation is published at once unless a message went out less than this ago, then with the rest of its burst when the gap ends",
};
/// See [`ReplicasConfig::lazy_flush`].
pub const REPLICA_LAZY_FLUSH_MS: Knob = Knob {
    name: "lazy_flush_ms",
    min: 1.0,
    max: 1000.0,
    default: 20.0,
    meaning: "first tokens and releases wait at most this long to ride with the next reservation's message; they only lower the load peers count, so waiting errs on the safe side; must be at least flush_ms",
};
/// See [`ReplicasConfig::state_interval`].
pub const REPLICA_STATE_INTERVAL_MS: Knob = Knob {
    name: "state_interval_ms",
    min: 50.0,
    max: 60_000.0,
    default: 1000.0,
    meaning: "how often a replica publishes all its reservations (heals lost messages; doubles as its heartbeat); must be under half of expiry_ms",
};

/// See [`ReplicasConfig::stagger`].
pub const REPLICA_STAGGER_MS: Knob = Knob {
    name: "stagger_ms",
    min: 0.0,
    max: 1000.0,
    default: 10.0,
    meaning: "while peer replicas decide in step with this one (requests reaching several replicas in the same instant), a new request waits a random 0 to this long before its decision, so the peers' reservations of that instant arrive first; 0 never waits",
};

/// Validated `[replicas]` settings; present only when a bus is configured.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicasConfig {
    /// NATS server URL(s), comma-separated (`nats://host:4222`).
    pub bus: String,
    /// Subject the replicas of one fleet share; replicas of different fleets need different ones.
    pub subject: String,
    /// This replica's name; unique among the replicas (default: host name, process id and a random
    /// suffix, so a restarted pod is a new replica).
    pub replica_id: String,
    /// See [`REPLICA_EXPIRY_MS`].
    pub expiry: Duration,
    /// See [`REPLICA_FLUSH_MS`].
    pub flush: Duration,
    /// See [`REPLICA_LAZY_FLUSH_MS`].
    pub lazy_flush: Duration,
    /// See [`REPLICA_STATE_INTERVAL_MS`].
    pub state_interval: Duration,
    /// See [`REPLICA_STAGGER_MS`].
    pub stagger: Duration,
}

fn millis(knob: Knob, value: Option<u64>) -> Result<Duration, GatewayError> {
    let v = check(knob, value.map_or(knob.default, |v| v as f64))
        .map_err(|e| GatewayError::Config(format!("[replicas] {e}")))?;
    Ok(Duration::from_millis(v as u64))
}

/// A subject the replicas can publish on: dot-separated tokens, none empty, no wildcards or spaces.
fn check_subject(subject: &str) -> Result<(), GatewayError> {
    let bad = |why: &str| Err(GatewayError::Config(format!("[replicas] subject {subject:?}: {why}")));
    if subject.is_empty() || subject.len() > 256 {
        return bad("must be 1 to 256 characters");
    }
    if subject.split('.').any(str::is_empty) {
        return bad("has an empty token (two dots in a row, or a dot at an end)");
    }
    if subject.chars().any(|c| c.is_whitespace() || c == '*' || c == '>') {
        return bad("may not contain whitespace or the wildcards * and >");
    }
    Ok(())
}

/// The default replica id: the host name (the pod name in Kubernetes), the process id and a
/// random suffix.
fn default_replica_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kvgate".into());
    format!("{host}-{}-{:04x}", std::process::id(), crate::clock::entropy() & 0xffff)
}

impl ReplicasTable {
    /// Validates the table; `None` when no bus is configured (the replica decides alone).
    pub(super) fn build(&self) -> Result<Option<ReplicasConfig>, GatewayError> {
        let Some(bus) = self.bus.as_deref().map(str::trim).filter(|b| !b.is_empty()) else {
            let set = self.subject.is_some()
                || self.replica_id.is_some()
                || self.expiry_ms.is_some()
                || self.flush_ms.is_some()
                || self.lazy_flush_ms.is_some()
                || self.state_interval_ms.is_some()
                || self.stagger_ms.is_some();
            if set {
                return Err(GatewayError::Config(
                    "[replicas]: settings are given but no bus; set bus = \"nats://HOST:4222\"".into(),
                ));
            }
            return Ok(None);
        };
        for url in bus.split(',') {
            let url = url.trim();
            if url.parse::<async_nats::ServerAddr>().is_err() {
                return Err(GatewayError::Config(format!(
                    "[replicas] bus {:?}: expected nats://HOST:PORT (several separated by commas)",
                    super::redact_url(url)
                )));
            }
        }
        let subject = self.subject.clone().unwrap_or_else(|| DEFAULT_SUBJECT.into());
        check_subject(&subject)?;
        let replica_id = match &self.replica_id {
            Some(id) if id.trim().is_empty() || id.len() > 128 || id.chars().any(char::is_control) => {
                return Err(GatewayError::Config(format!(
                    "[replicas] replica_id {id:?}: must be 1 to 128 printable characters"
                )))
            }
            Some(id) => id.clone(),
            None => default_replica_id(),
        };
        let expiry = millis(REPLICA_EXPIRY_MS, self.expiry_ms)?;
        let state_interval = millis(REPLICA_STATE_INTERVAL_MS, self.state_interval_ms)?;
        if state_interval * 2 > expiry {
            return Err(GatewayError::Config(format!(
                "[replicas] state_interval_ms {} must be under half of expiry_ms {}: a replica would expire between two heartbeats",
                state_interval.as_millis(),
                expiry.as_millis()
            )));
        }
        let flush = millis(REPLICA_FLUSH_MS, self.flush_ms)?;
        let lazy_flush = millis(REPLICA_LAZY_FLUSH_MS, self.lazy_flush_ms)?;
        if lazy_flush < flush {
            return Err(GatewayError::Config(format!(
                "[replicas] lazy_flush_ms {} must be at least flush_ms {}: first tokens and releases are never more urgent than reservations",
                lazy_flush.as_millis(),
                flush.as_millis()
            )));
        }
        let stagger = millis(REPLICA_STAGGER_MS, self.stagger_ms)?;
        Ok(Some(ReplicasConfig {
            bus: bus.to_owned(),
            subject,
            replica_id,
            expiry,
            flush,
            lazy_flush,
            state_interval,
            stagger,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(bus: Option<&str>) -> ReplicasTable {
        ReplicasTable { bus: bus.map(Into::into), ..ReplicasTable::default() }
    }

    #[test]
    fn no_bus_means_no_sharing_and_the_defaults_are_sane() {
        assert_eq!(table(None).build().unwrap(), None);
        let c = table(Some("nats://127.0.0.1:4222")).build().unwrap().unwrap();
        assert_eq!(c.subject, DEFAULT_SUBJECT);
        assert_eq!((c.expiry, c.state_interval), (Duration::from_secs(5), Duration::from_secs(1)));
        assert_eq!((c.flush, c.lazy_flush), (Duration::from_millis(2), Duration::from_millis(20)));
        assert_eq!(c.stagger, Duration::from_millis(10));
        let off = ReplicasTable { stagger_ms: Some(0), ..table(Some("nats://h:1")) }.build().unwrap().unwrap();
        assert_eq!(off.stagger, Duration::ZERO);
        let other = table(Some("nats://127.0.0.1:4222")).build().unwrap().unwrap();
        assert_ne!(c.replica_id, other.replica_id, "two replicas started alike still differ");
    }

    #[test]
    fn bad_settings_are_refused_naming_the_key() {
        let err = |t: ReplicasTable| t.build().unwrap_err().to_string();
        assert!(err(ReplicasTable { subject: Some("x".into()), ..table(None) }).contains("no bus"));
        assert!(err(table(Some("http://nats:4222"))).contains("expected nats://"));
        for s in ["a..b", "a.*", "a b", "", "a.>"] {
            assert!(
                err(ReplicasTable { subject: Some(s.into()), ..table(Some("nats://h:1")) }).contains("subject"),
                "{s:?}"
            );
        }
        assert!(err(ReplicasTable { replica_id: Some(" ".into()), ..table(Some("nats://h:1")) }).contains("replica_id"));
        assert!(err(ReplicasTable { expiry_ms: Some(10), ..table(Some("nats://h:1")) }).contains("expiry_ms"));
        let e = err(ReplicasTable { expiry_ms: Some(1000), state_interval_ms: Some(600), ..table(Some("nats://h:1")) });
        assert!(e.contains("under half"), "{e}");
        let e = err(ReplicasTable { flush_ms: Some(10), lazy_flush_ms: Some(5), ..table(Some("nats://h:1")) });
        assert!(e.contains("lazy_flush_ms 5 must be at least flush_ms 10"), "{e}");
    }
}
