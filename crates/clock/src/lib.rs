//! kvgate's one contact with the wall clock: logical timestamps for the core, measured from process
//! start. The gateway and the mock engine read time only through it; the core, the index and the
//! engine model take time as an argument.

use std::time::Instant;

use kvgate_core::Timestamp;

/// Turns `Instant`s into the core's [`Timestamp`]s.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
}

impl Clock {
    /// A clock whose epoch is now.
    #[allow(clippy::disallowed_methods)] // the edge of the system: the core never reads the clock
    pub fn start() -> Self {
        Clock { epoch: Instant::now() }
    }

    /// The current time.
    #[allow(clippy::disallowed_methods)] // see above
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }

    /// The timestamp of an instant.
    pub fn at(&self, instant: Instant) -> Timestamp {
        Timestamp(instant.saturating_duration_since(self.epoch).as_micros() as u64)
    }

    /// The current instant, for measuring durations.
    #[allow(clippy::disallowed_methods)] // see above
    pub fn instant(&self) -> Instant {
        Instant::now()
    }
}

/// Seed material for a tie-breaking RNG: ties should break differently in each replica.
#[allow(clippy::disallowed_methods)] // see above
pub fn entropy() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}
