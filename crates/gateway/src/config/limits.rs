//! Bounds on what clients and engines can make the gateway hold, and when it gives up on them.

use std::time::Duration;

use kvgate_core::policy::Knob;

use super::{pick, GatewayError, ServerTable, TelemetryTable};

/// See [`Limits::header_timeout`].
pub const HEADER_TIMEOUT_MS: Knob = Knob {
    name: "header_timeout_ms",
    min: 100.0,
    max: 600_000.0,
    default: 10_000.0,
    meaning: "longest a client may take to send a request's headers, counted from when the connection is ready for one (so also how long a kept-alive connection may sit idle); the connection is then closed",
};
/// See [`Limits::header_timeout_min`].
pub const HEADER_TIMEOUT_MIN_MS: Knob = Knob {
    name: "header_timeout_min_ms",
    min: 10.0,
    max: 600_000.0,
    default: 1_000.0,
    meaning: "the header and idle timeout when the connection cap is reached: from half the cap it shrinks from header_timeout_ms to this, so idle and dribbling sockets give their descriptors back sooner",
};
/// See [`Limits::body_timeout`].
pub const BODY_TIMEOUT_S: Knob = Knob {
    name: "body_timeout_s",
    min: 0.1,
    max: 3600.0,
    default: 30.0,
    meaning: "longest a client may take to send a request's body before 408",
};
/// See [`Limits::max_connections`].
pub const MAX_CONNECTIONS: Knob = Knob {
    name: "max_connections",
    min: 1.0,
    max: 10_000_000.0,
    default: 16_384.0,
    meaning: "client connections held at once, at most; the gateway holds fewer where its file descriptor limit could not carry them ((limit − reserve) / 2). At the cap, a new connection closes the oldest one not in a request; when all are in a request, new ones wait in the listen backlog",
};
/// See [`Limits::max_buffered_body_bytes`].
pub const MAX_BUFFERED_BODY_BYTES: Knob = Knob {
    name: "max_buffered_body_bytes",
    min: 1024.0,
    max: 1e12,
    default: 512.0 * 1024.0 * 1024.0,
    meaning: "request body bytes buffered at once over all connections; a body that would pass it gets 503",
};
/// See [`Limits::stream_idle_timeout`].
pub const STREAM_IDLE_TIMEOUT_S: Knob = Knob {
    name: "stream_idle_timeout_s",
    min: 1.0,
    max: 86_400.0,
    default: 300.0,
    meaning: "longest an engine may go silent in a response after its headers (before the first chunk included) before the response is ended with an error",
};
/// See [`Limits::outlier_failures`].
pub const OUTLIER_FAILURES: Knob = Knob {
    name: "outlier_failures",
    min: 1.0,
    max: 1000.0,
    default: 5.0,
    meaning: "consecutive upstream failures (server errors, timeouts, refused connects) that eject an engine",
};
/// See [`Limits::outlier_ejection`].
pub const OUTLIER_EJECTION_S: Knob = Knob {
    name: "outlier_ejection_s",
    min: 0.1,
    max: 3600.0,
    default: 30.0,
    meaning: "how long an ejected engine stays out of rotation, times the ejections in a row (at most 10)",
};

/// The knobs of this file, for the documentation table.
pub const LIMIT_KNOBS: &[Knob] = &[
    HEADER_TIMEOUT_MS,
    HEADER_TIMEOUT_MIN_MS,
    BODY_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_BUFFERED_BODY_BYTES,
    STREAM_IDLE_TIMEOUT_S,
    OUTLIER_FAILURES,
    OUTLIER_EJECTION_S,
];

/// Timeouts, caps and passive health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// See [`HEADER_TIMEOUT_MS`].
    pub header_timeout: Duration,
    /// See [`HEADER_TIMEOUT_MIN_MS`].
    pub header_timeout_min: Duration,
    /// See [`BODY_TIMEOUT_S`].
    pub body_timeout: Duration,
    /// See [`MAX_CONNECTIONS`].
    pub max_connections: usize,
    /// See [`MAX_BUFFERED_BODY_BYTES`].
    pub max_buffered_body_bytes: usize,
    /// See [`STREAM_IDLE_TIMEOUT_S`].
    pub stream_idle_timeout: Duration,
    /// See [`OUTLIER_FAILURES`].
    pub outlier_failures: u32,
    /// See [`OUTLIER_EJECTION_S`].
    pub outlier_ejection: Duration,
}

impl Limits {
    pub(super) fn build(s: &ServerTable, t: &TelemetryTable) -> Result<Limits, GatewayError> {
        let secs = |knob, v: Option<f64>| pick(knob, v).map(Duration::from_secs_f64);
        Ok(Limits {
            header_timeout: Duration::from_millis(
                pick(HEADER_TIMEOUT_MS, s.header_timeout_ms.map(|v| v as f64))? as u64
            ),
            header_timeout_min: Duration::from_millis(pick(
                HEADER_TIMEOUT_MIN_MS,
                s.header_timeout_min_ms.map(|v| v as f64),
            )? as u64),
            body_timeout: secs(BODY_TIMEOUT_S, s.body_timeout_s)?,
            max_connections: pick(MAX_CONNECTIONS, s.max_connections.map(|v| v as f64))? as usize,
            max_buffered_body_bytes: pick(MAX_BUFFERED_BODY_BYTES, s.max_buffered_body_bytes.map(|v| v as f64))?
                as usize,
            stream_idle_timeout: secs(STREAM_IDLE_TIMEOUT_S, s.stream_idle_timeout_s)?,
            outlier_failures: pick(OUTLIER_FAILURES, t.outlier_failures.map(f64::from))? as u32,
            outlier_ejection: secs(OUTLIER_EJECTION_S, t.outlier_ejection_s)?,
        })
    }
}
