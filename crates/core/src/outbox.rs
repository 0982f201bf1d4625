//! When a replica publishes its reservation changes: the batching rule that the gateway's bus task,
//! the simulator's bus model and the peer emulator all run.
//!
//! Every bus message wakes every peer once to receive it, and at a replica's usual rates (a hundred
//! decisions a second or so) a message tends to carry one change. So the rule spends messages
//! where they matter:
//!
//! - a **reservation** is what keeps simultaneous decisions on several replicas from piling onto one
//!   engine: it goes out at once, unless this replica published less than `spacing` ago; then it
//!   waits for the rest of that gap, with whatever else the burst decided. Spacing bounds the
//!   message rate of a busy replica without delaying a quiet one;
//! - a **first token** or a **release** only lowers the load peers count, and until it arrives they
//!   err on the safe side (they spread a little more). It waits up to `lazy` and nearly always rides
//!   with the next reservation's message instead of costing one of its own. After each
//!   publication the outbox keeps a standing look `lazy` later, so a change that may wait never has
//!   to wake the publisher: it is taken at that look, or earlier with a reservation.
//!
//! Changes leave in the order they happened, so a peer never sees a release before its reservation.

use std::sync::Arc;
use std::time::Duration;

use crate::replicas::ReservationChange;
use crate::time::Timestamp;

/// How the outbox spaces its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchWindows {
    /// The least time between two publications; a reservation waits only for the rest of it.
    pub spacing: Duration,
    /// A first token or a release is published at most this long after it happened.
    pub lazy: Duration,
}

impl BatchWindows {
    /// The gateway's default spacing (`flush_ms`): at most 500 messages a second from a replica.
    pub const SPACING: Duration = Duration::from_millis(2);
    /// The gateway's default lazy window (`lazy_flush_ms`): a tenth of a load poll, so a release
    /// reaches the peers long before the next report would have shown it.
    pub const LAZY: Duration = Duration::from_millis(20);
}

impl Default for BatchWindows {
    fn default() -> Self {
        BatchWindows { spacing: Self::SPACING, lazy: Self::LAZY }
    }
}

impl ReservationChange {
    /// Whether peers need this change at once: a reservation. First tokens and releases only lower
    /// the load they count, so they may wait for a batch.
    pub fn is_urgent(&self) -> bool {
        matches!(self, ReservationChange::Reserved { .. })
    }
}

/// Called when the outbox's next publication moves earlier than the publisher last read it, so
/// that a task sleeping until then wakes up. It runs under the router's lock: it must only signal
/// (a `tokio::sync::Notify`, a channel send), never block.
pub type OutboxWake = Arc<dyn Fn() + Send + Sync>;

/// Reservation changes waiting to be published, and when they are due.
#[derive(Default)]
pub struct Outbox {
    windows: BatchWindows,
    changes: Vec<ReservationChange>,
    /// When the publisher is to look next: the earliest change's deadline, or the standing look.
    due: Option<Timestamp>,
    /// The standing look after the last publication.
    look: Option<Timestamp>,
    last_published: Option<Timestamp>,
    wake: Option<OutboxWake>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("windows", &self.windows)
            .field("changes", &self.changes.len())
            .field("due", &self.due)
            .field("look", &self.look)
            .field("last_published", &self.last_published)
            .field("wake", &self.wake.is_some())
            .finish()
    }
}

impl Outbox {
    /// An empty outbox spacing its messages by `windows`, calling `wake` when its next
    /// publication moves earlier.
    pub fn new(windows: BatchWindows, wake: Option<OutboxWake>) -> Self {
        Outbox { windows, changes: Vec::new(), due: None, look: None, last_published: None, wake }
    }

    /// Queues a change made at `now`.
    pub fn push(&mut self, change: ReservationChange, now: Timestamp) {
        let due = if change.is_urgent() {
            self.last_published.map_or(now, |p| now.max(p.saturating_add(self.windows.spacing)))
        } else {
            let deadline = now.saturating_add(self.windows.lazy);
            self.look.map_or(deadline, |look| look.min(deadline))
        };
        self.changes.push(change);
        if self.due.is_none_or(|d| due < d) {
            self.due = Some(due);
            if let Some(wake) = &self.wake {
                wake();
            }
        }
    }

    /// When the publisher is to look next (a change's deadline, or the standing look after a
    /// publication); `None` when there is nothing to look for.
    pub fn due_at(&self) -> Option<Timestamp> {
        self.due
    }

    /// Every queued change, oldest first, when the outbox is due at `now` (the caller publishes
    /// them); nothing otherwise. A look that finds nothing ends the standing look.
    pub fn take_due(&mut self, now: Timestamp) -> Vec<ReservationChange> {
        if self.due.is_none_or(|d| d > now) {
            return Vec::new();
        }
        if self.changes.is_empty() {
            self.due = None;
            self.look = None;
            return Vec::new();
        }
        self.last_published = Some(now);
        self.look = Some(now.saturating_add(self.windows.lazy));
        self.due = self.look;
        std::mem::take(&mut self.changes)
    }

    /// Every queued change, oldest first, due or not (before a full state, or at goodbye).
    pub fn take_all(&mut self) -> Vec<ReservationChange> {
        self.due = None;
        self.look = None;
        std::mem::take(&mut self.changes)
    }

    /// Changes queued.
    pub fn len(&self) -> usize {
        self.changes.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::ids::{RequestId, WorkerId};
    use crate::ledger::Work;

    fn ms(v: u64) -> Timestamp {
        Timestamp::from_millis(v)
    }

    fn reserved(id: u64) -> ReservationChange {
        ReservationChange::Reserved { request: RequestId(id), worker: WorkerId::new("a"), work: Work::default() }
    }

    fn released(id: u64) -> ReservationChange {
        ReservationChange::Released { request: RequestId(id) }
    }

    #[test]
    fn a_reservation_goes_out_at_once_unless_a_message_just_went_out() {
        let mut out = Outbox::new(BatchWindows::default(), None);
        out.push(reserved(1), ms(100));
        assert_eq!(out.due_at(), Some(ms(100)), "a quiet replica publishes at once");
        assert_eq!(out.take_due(ms(100)), vec![reserved(1)]);
        // 1 ms later a burst: it waits for the rest of the 2 ms gap and goes as one message.
        out.push(reserved(2), ms(101));
        out.push(reserved(3), ms(101));
        assert_eq!(out.due_at(), Some(ms(102)));
        assert!(out.take_due(ms(101)).is_empty());
        assert_eq!(out.take_due(ms(102)), vec![reserved(2), reserved(3)]);
    }

    #[test]
    fn releases_ride_with_the_next_reservation_or_go_at_the_standing_look() {
        let mut out = Outbox::new(BatchWindows::default(), None);
        // Idle: a release alone is due a lazy window after it.
        out.push(released(1), ms(0));
        assert_eq!(out.due_at(), Some(ms(20)));
        assert_eq!(out.take_due(ms(20)), vec![released(1)]);
        // After that publication the outbox looks again at 40; a release at 25 goes then, not at 45.
        out.push(released(2), ms(25));
        assert_eq!(out.due_at(), Some(ms(40)));
        // A reservation at 30 takes it along, in order.
        out.push(reserved(3), ms(30));
        assert_eq!(out.due_at(), Some(ms(30)));
        assert_eq!(out.take_due(ms(30)), vec![released(2), reserved(3)]);
        // A look that finds nothing ends the standing look.
        assert_eq!(out.due_at(), Some(ms(50)));
        assert!(out.take_due(ms(50)).is_empty());
        assert_eq!(out.due_at(), None);
    }

    #[test]
    fn take_all_empties_the_outbox_due_or_not() {
        let mut out = Outbox::new(BatchWindows::default(), None);
        out.push(reserved(1), ms(0));
        out.push(ReservationChange::FirstToken { request: RequestId(1) }, ms(1));
        assert_eq!(out.len(), 2);
        assert_eq!(out.take_all().len(), 2);
        assert!(out.is_empty() && out.due_at().is_none());
    }

    #[test]
    fn the_wake_fires_only_when_the_publisher_must_look_earlier() {
        let woken = Arc::new(AtomicUsize::new(0));
        let counter = woken.clone();
        let wake: OutboxWake = Arc::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        });
        let woken_so_far = || woken.load(Ordering::Relaxed);
        let mut out = Outbox::new(BatchWindows::default(), Some(wake));
        out.push(reserved(1), ms(0));
        assert_eq!(woken_so_far(), 1);
        out.take_due(ms(0));
        // First token and release after a publication wait for the standing look: no wake-up.
        out.push(ReservationChange::FirstToken { request: RequestId(1) }, ms(1));
        out.push(released(1), ms(5));
        assert_eq!(woken_so_far(), 1);
        // The next reservation must go before the look.
        out.push(reserved(2), ms(8));
        assert_eq!(woken_so_far(), 2);
        out.push(reserved(3), ms(8));
        assert_eq!(woken_so_far(), 2, "already due at once");
    }
}
