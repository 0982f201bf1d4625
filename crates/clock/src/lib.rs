//! kvgate's one contact with the wall clock: logical timestamps for the core, measured from process
//! start. The gateway and the mock engine read time only through it; the core, the index and the
//! engine model take time as an argument.
//!
//! Time is read from Tokio's clock, which is the wall clock in production and follows a paused
//! runtime in tests (`#[tokio::test(start_paused = true)]`): timestamps, ejection deadlines and
//! every timer of the gateway then move together, only when the test advances them.

use std::time::Instant;

use kvgate_core::Timestamp;

/// Turns `Instant`s into the core's [`Timestamp`]s.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
}

impl Clock {
    /// A clock whose epoch is now.
    pub fn start() -> Self {
        Clock { epoch: read() }
    }

    /// The current time.
    pub fn now(&self) -> Timestamp {
        self.at(read())
    }

    /// The timestamp of an instant.
    pub fn at(&self, instant: Instant) -> Timestamp {
        Timestamp(instant.saturating_duration_since(self.epoch).as_micros() as u64)
    }

    /// The instant of a timestamp (a deadline the core computed).
    pub fn instant_at(&self, at: Timestamp) -> Instant {
        self.epoch + std::time::Duration::from_micros(at.as_micros())
    }

    /// The current instant, for measuring durations and setting deadlines.
    pub fn instant(&self) -> Instant {
        read()
    }
}

/// Tokio's now: the system's, unless a test paused the runtime's clock.
fn read() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Seed material for a tie-breaking RNG: ties should break differently in each replica.
#[allow(clippy::disallowed_methods)] // the edge of the system: the core never reads the clock
pub fn entropy() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_paused_runtime_moves_the_clock_only_when_advanced() {
        let clock = Clock::start();
        let (t0, i0) = (clock.now(), clock.instant());
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(clock.now().0 - t0.0, 1_500_000);
        assert_eq!(clock.instant() - i0, Duration::from_millis(1500));
        assert_eq!(clock.at(clock.instant_at(t0)), t0);
    }
}
