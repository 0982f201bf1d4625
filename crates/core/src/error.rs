//! The core's error type.

use crate::ids::{RequestId, WorkerId};

/// Errors of configuration and of calls that name things the router does not know.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A knob was set outside its documented range.
    #[error("{knob} = {value} is out of range: expected {range}")]
    KnobOutOfRange {
        /// The knob's name as configured.
        knob: &'static str,
        /// The rejected value.
        value: String,
        /// The accepted range, in words.
        range: String,
    },
    /// The combination of policy settings is not allowed.
    #[error("invalid policy configuration: {0}")]
    InvalidPolicy(String),
    /// A worker with this id is already registered.
    #[error("worker {0} is already registered")]
    DuplicateWorker(WorkerId),
    /// No worker with this id is registered.
    #[error("no worker named {0}")]
    UnknownWorker(WorkerId),
    /// A request with this id already holds a reservation.
    #[error("request {0} already holds a reservation")]
    DuplicateRequest(RequestId),
    /// No reservation is held for this request.
    #[error("request {0} holds no reservation")]
    UnknownRequest(RequestId),
}
