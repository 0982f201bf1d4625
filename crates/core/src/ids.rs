//! Identifier newtypes.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A worker (one engine endpoint, or one data-parallel rank of it) as operators name it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(Arc<str>);

impl WorkerId {
    /// Wraps an operator-chosen name.
    pub fn new(name: impl AsRef<str>) -> Self {
        WorkerId(Arc::from(name.as_ref()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for WorkerId {
    fn from(name: &str) -> Self {
        WorkerId::new(name)
    }
}

/// A gateway replica, as it names itself to its peers on the replica bus.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReplicaId(Arc<str>);

impl ReplicaId {
    /// Wraps a replica's chosen name.
    pub fn new(name: impl AsRef<str>) -> Self {
        ReplicaId(Arc::from(name.as_ref()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A request the router has decided and holds a reservation for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// The router's own chained content key of one full block: equal keys mean an equal whole prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockKey(pub u64);

/// A worker's position in the router's dense tables. Slots are reused after a worker is removed, so
/// a slot is only meaningful together with the table that handed it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerSlot(pub u32);

impl WorkerSlot {
    /// The slot as a vector index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
