//! Logical time. The core never reads a clock: callers pass `now` as a [`Timestamp`].

use std::ops::Sub;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Microseconds since an epoch the caller chooses (process start in the gateway, zero in the
/// simulator). Only differences between timestamps of one caller carry meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The epoch.
    pub const ZERO: Timestamp = Timestamp(0);

    /// A timestamp `micros` after the epoch.
    pub const fn from_micros(micros: u64) -> Self {
        Timestamp(micros)
    }

    /// A timestamp `millis` after the epoch.
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis.saturating_mul(1000))
    }

    /// A timestamp `secs` after the epoch (negative and non-finite values clamp to the epoch).
    pub fn from_secs_f64(secs: f64) -> Self {
        if secs.is_finite() && secs > 0.0 {
            Timestamp((secs * 1e6) as u64)
        } else {
            Timestamp::ZERO
        }
    }

    /// Microseconds since the epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    /// This timestamp moved back by `d`, clamped at the epoch.
    pub fn saturating_sub(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_sub(d.as_micros().min(u64::MAX as u128) as u64))
    }

    /// This timestamp moved forward by `d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(d.as_micros().min(u64::MAX as u128) as u64))
    }
}

impl Sub for Timestamp {
    type Output = Duration;

    fn sub(self, rhs: Timestamp) -> Duration {
        self.saturating_since(rhs)
    }
}
