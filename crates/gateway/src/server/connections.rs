//! Which client connections the gateway holds, and which it closes first when descriptors run
//! short.
//!
//! The shape is the one HAProxy's connection limits and Envoy's overload manager use: the cap
//! follows the file descriptors the process really has; near the cap, connections that are not in
//! a request (still sending their headers, or kept alive and idle) are closed first, oldest first,
//! and the header and idle timeout shrinks as the table fills. A connection in a request is never
//! closed here: its request was accepted and runs to its end.
//!
//! To make room, only a *starved* connection is closed: one whose socket the gateway has read dry
//! since it last finished a request (or since it was accepted) without finding a whole request,
//! and that has waited [`ROOM_MIN_WAIT`]. A connection accepted a moment ago whose request is in
//! its socket, or still on its way, is not idle, only not read yet: closing it would turn a burst
//! of real clients beyond the cap into failed connections instead of a short wait in the listen
//! backlog.
//!
//! The table is synchronous and takes time as an input; the accept loop (`super`) drives it.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Descriptors kept out of the connection cap for everything else the gateway opens: engine health
/// and load polls, KV-event sockets, the replica bus, tokenizer and config files. An eighth of the
/// limit, within these bounds.
const FD_RESERVE_MIN: u64 = 32;
/// See [`FD_RESERVE_MIN`].
const FD_RESERVE_MAX: u64 = 1024;

/// Occupancy (open connections over the cap) from which the header and idle timeout shrinks: from
/// the configured timeout here down to the floor at the cap.
const PRESSURE_FROM: f64 = 0.5;

/// How long a starved connection must have waited without a request before it is closed to make
/// room: a client's request follows its connection (or its previous response) within a round
/// trip, and a busy gateway may read the socket before it arrives.
pub const ROOM_MIN_WAIT: Duration = Duration::from_millis(100);

/// The descriptors of `fd_limit` kept for what is not a client connection.
pub fn fd_reserve(fd_limit: u64) -> u64 {
    (fd_limit / 8).clamp(FD_RESERVE_MIN, FD_RESERVE_MAX).min(fd_limit / 2)
}

/// How many client connections the gateway holds at once: `max_connections`, or fewer where the
/// descriptor limit could not carry them. A client connection in a request to an HTTP engine takes
/// two descriptors (its own and the engine's), so the cap is half of what the reserve leaves, and
/// at least 1.
pub fn connection_cap(max_connections: usize, fd_limit: Option<u64>) -> usize {
    let Some(limit) = fd_limit else { return max_connections.max(1) };
    let carried = limit.saturating_sub(fd_reserve(limit)) / 2;
    max_connections.min(usize::try_from(carried).unwrap_or(usize::MAX)).max(1)
}

/// The descriptor limit under which [`connection_cap`] is all of `max_connections`.
pub fn fd_limit_for(max_connections: usize) -> u64 {
    (max_connections as u64).saturating_mul(2).saturating_add(FD_RESERVE_MAX)
}

/// One client connection, numbered in accept order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(u64);

/// What a connection is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not in a request since `since`: sending its first headers, or kept alive between requests;
    /// `starved` once its socket was read dry since.
    Waiting { since: Instant, served: bool, starved: bool },
    /// In a request, from its headers to the last byte of its response.
    InRequest,
    /// Chosen to be closed; still open until its task lets go of it.
    Shed { served: bool },
}

/// A connection chosen to be closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shed<T> {
    /// Which.
    pub id: ConnectionId,
    /// Whether it has answered a request before: then it is closed gracefully (hyper closes an idle
    /// keep-alive connection at once and flushes anything still being written); otherwise it has
    /// nothing to flush and is dropped.
    pub served: bool,
    /// What its owner registered with it (the accept loop's signal to the connection's task).
    pub signal: T,
}

/// The open client connections, by phase.
#[derive(Debug)]
pub struct ConnectionTable<T> {
    cap: usize,
    header_timeout: Duration,
    header_timeout_floor: Duration,
    next: u64,
    phases: HashMap<ConnectionId, (Phase, T)>,
    /// Connections not in a request, oldest first.
    waiting: BTreeSet<(Instant, ConnectionId)>,
    /// Those of `waiting` that are starved.
    starved: BTreeSet<(Instant, ConnectionId)>,
}

impl<T: Clone> ConnectionTable<T> {
    /// An empty table for at most `cap` connections, whose header and idle timeout is
    /// `header_timeout` up to half the cap and shrinks to `header_timeout_floor` at the cap.
    pub fn new(cap: usize, header_timeout: Duration, header_timeout_floor: Duration) -> Self {
        ConnectionTable {
            cap: cap.max(1),
            header_timeout,
            header_timeout_floor: header_timeout_floor.min(header_timeout),
            next: 0,
            phases: HashMap::new(),
            waiting: BTreeSet::new(),
            starved: BTreeSet::new(),
        }
    }

    /// Open connections, those being shed included.
    pub fn len(&self) -> usize {
        self.phases.len()
    }

    /// Whether no connection is open.
    pub fn is_empty(&self) -> bool {
        self.phases.is_empty()
    }

    /// Whether another connection may be accepted at `now`: there is room under the cap, or a
    /// starved connection that has waited [`ROOM_MIN_WAIT`] can be shed to make it.
    pub fn may_accept(&self, now: Instant) -> bool {
        self.phases.len() < self.cap || self.room_at().is_some_and(|at| at <= now)
    }

    /// When the oldest starved connection may be shed to make room, if there is one.
    pub fn room_at(&self) -> Option<Instant> {
        self.starved.first().map(|&(since, _)| since + ROOM_MIN_WAIT)
    }

    /// Registers a connection accepted at `now`. Past the cap, the oldest starved connection that
    /// has waited [`ROOM_MIN_WAIT`] (never the new one) is chosen to make room; its owner must close
    /// it. Without one, the table holds one past its cap until a connection closes.
    pub fn open(&mut self, now: Instant, signal: T) -> (ConnectionId, Option<Shed<T>>) {
        let id = ConnectionId(self.next);
        self.next += 1;
        let full = self.phases.len() >= self.cap;
        let victim = if full && self.room_at().is_some_and(|at| at <= now) { self.shed_first_starved() } else { None };
        self.phases.insert(id, (Phase::Waiting { since: now, served: false, starved: false }, signal));
        self.waiting.insert((now, id));
        (id, victim)
    }

    /// The gateway read `id`'s socket dry without finding a whole request.
    pub fn mark_starved(&mut self, id: ConnectionId) {
        if let Some((Phase::Waiting { since, starved, .. }, _)) = self.phases.get_mut(&id) {
            if !*starved {
                *starved = true;
                self.starved.insert((*since, id));
            }
        }
    }

    /// A request's headers arrived on `id`. False when the connection was already chosen to be
    /// closed: the request must be refused, not started.
    pub fn begin_request(&mut self, id: ConnectionId) -> bool {
        let Some((phase, _)) = self.phases.get_mut(&id) else { return false };
        match *phase {
            Phase::Waiting { since, .. } => {
                self.waiting.remove(&(since, id));
                self.starved.remove(&(since, id));
                *phase = Phase::InRequest;
                true
            }
            Phase::InRequest => true,
            Phase::Shed { .. } => false,
        }
    }

    /// The response on `id` ended at `now`; the connection waits for its next request.
    pub fn end_request(&mut self, id: ConnectionId, now: Instant) {
        if let Some((phase, _)) = self.phases.get_mut(&id) {
            if *phase == Phase::InRequest {
                *phase = Phase::Waiting { since: now, served: true, starved: false };
                self.waiting.insert((now, id));
            }
        }
    }

    /// The connection `id` is closed.
    pub fn close(&mut self, id: ConnectionId) {
        if let Some((Phase::Waiting { since, .. }, _)) = self.phases.remove(&id) {
            self.waiting.remove(&(since, id));
            self.starved.remove(&(since, id));
        }
    }

    /// The header and idle timeout at the current occupancy: the configured one up to half the cap,
    /// then shrinking in proportion to the floor at the cap.
    pub fn header_timeout(&self) -> Duration {
        let occupancy = self.phases.len() as f64 / self.cap as f64;
        let pressure = ((occupancy - PRESSURE_FROM) / (1.0 - PRESSURE_FROM)).clamp(0.0, 1.0);
        let span = self.header_timeout.saturating_sub(self.header_timeout_floor);
        self.header_timeout - span.mul_f64(pressure)
    }

    /// Whether the table is full enough for the timeout to be shorter than configured.
    pub fn under_pressure(&self) -> bool {
        self.header_timeout() < self.header_timeout
    }

    /// Chooses the connections that have waited longer than the current timeout, oldest first.
    /// Without pressure nothing is chosen here: hyper's own header timeout closes those.
    pub fn shed_expired(&mut self, now: Instant) -> Vec<Shed<T>> {
        let mut shed = Vec::new();
        while self.under_pressure() {
            let timeout = self.header_timeout();
            match self.waiting.first() {
                Some(&(since, _)) if now.saturating_duration_since(since) >= timeout => {}
                _ => break,
            }
            shed.extend(self.shed_oldest());
        }
        shed
    }

    /// Chooses every connection not in a request (a drain: those in a request finish).
    pub fn shed_all_waiting(&mut self) -> Vec<Shed<T>> {
        std::iter::from_fn(|| self.shed_oldest()).collect()
    }

    fn shed_oldest(&mut self) -> Option<Shed<T>> {
        let &(_, id) = self.waiting.first()?;
        self.shed(id)
    }

    fn shed_first_starved(&mut self) -> Option<Shed<T>> {
        let &(_, id) = self.starved.first()?;
        self.shed(id)
    }

    fn shed(&mut self, id: ConnectionId) -> Option<Shed<T>> {
        let (phase, signal) = self.phases.get_mut(&id)?;
        let Phase::Waiting { since, served, .. } = *phase else { return None };
        self.waiting.remove(&(since, id));
        self.starved.remove(&(since, id));
        *phase = Phase::Shed { served };
        Some(Shed { id, served, signal: signal.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[allow(clippy::disallowed_methods)] // an arbitrary origin: the table only compares instants
    fn table(cap: usize) -> (ConnectionTable<u32>, Instant) {
        (ConnectionTable::new(cap, 10 * SECOND, SECOND), Instant::now())
    }

    #[test]
    fn the_cap_leaves_a_reserve_and_two_descriptors_per_connection() {
        assert_eq!(connection_cap(16_384, Some(1024)), (1024 - 128) / 2);
        assert_eq!(connection_cap(16_384, Some(64)), (64 - 32) / 2);
        assert_eq!(connection_cap(16_384, Some(1 << 20)), 16_384);
        assert_eq!(connection_cap(100, None), 100);
        assert_eq!(connection_cap(16_384, Some(1)), 1);
        assert_eq!(connection_cap(16_384, Some(0)), 1);
        for max in [1, 100, 16_384, 1_000_000] {
            assert_eq!(connection_cap(max, Some(fd_limit_for(max))), max, "{max}");
        }
    }

    #[test]
    fn past_the_cap_the_oldest_waiting_connection_makes_room() {
        let (mut t, t0) = table(3);
        let (a, _) = t.open(t0, 1);
        let (b, _) = t.open(t0 + SECOND, 2);
        let (c, _) = t.open(t0 + 2 * SECOND, 3);
        for id in [a, b, c] {
            t.mark_starved(id);
        }
        assert!(t.begin_request(a), "a is in a request");
        assert!(t.may_accept(t0 + 3 * SECOND));
        let (d, shed) = t.open(t0 + 3 * SECOND, 4);
        assert_eq!(shed, Some(Shed { id: b, served: false, signal: 2 }), "b is the oldest not in a request");
        assert!(!t.begin_request(b), "a shed connection starts no request");
        assert_eq!(t.len(), 4, "b stays open until its task closes it");
        t.close(b);
        assert!(t.begin_request(c));
        assert!(t.begin_request(d));
        assert!(!t.may_accept(t0 + 4 * SECOND), "full, and every connection is in a request");
        let (_, shed) = t.open(t0 + 4 * SECOND, 5);
        assert_eq!(shed, None, "a connection in a request is never shed");
    }

    #[test]
    fn a_connection_not_yet_read_is_not_shed_for_room() {
        let (mut t, t0) = table(1);
        let (a, _) = t.open(t0, 1);
        assert!(!t.may_accept(t0 + SECOND), "a's request may be waiting in its socket");
        let (b, shed) = t.open(t0 + SECOND, 2);
        assert_eq!(shed, None, "accepted in a race: held one past the cap, a is kept");
        assert_eq!(t.len(), 2);
        t.mark_starved(b);
        assert!(!t.may_accept(t0 + SECOND + ROOM_MIN_WAIT / 2), "b's request may still be on its way");
        assert_eq!(t.room_at(), Some(t0 + SECOND + ROOM_MIN_WAIT));
        t.mark_starved(a);
        assert!(t.may_accept(t0 + SECOND));
        let (_, shed) = t.open(t0 + 2 * SECOND, 3);
        assert_eq!(shed.map(|s| s.id), Some(a), "a was read dry, and is the oldest");
        t.close(a);
        assert!(t.begin_request(b));
    }

    #[test]
    fn an_idle_keep_alive_connection_is_shed_as_served_from_when_its_response_ended() {
        let (mut t, t0) = table(2);
        let (a, _) = t.open(t0, 1);
        let (b, _) = t.open(t0 + SECOND, 2);
        assert!(t.begin_request(a));
        t.end_request(a, t0 + 5 * SECOND);
        t.mark_starved(a);
        t.mark_starved(b);
        let (_, shed) = t.open(t0 + 6 * SECOND, 3);
        assert_eq!(shed.map(|s| (s.id, s.served)), Some((b, false)), "b has waited since 1 s, a since 5 s");
        let (_, shed) = t.open(t0 + 7 * SECOND, 4);
        assert_eq!(shed.map(|s| (s.id, s.served)), Some((a, true)));
    }

    #[test]
    fn the_timeout_shrinks_from_half_the_cap_to_the_floor_at_the_cap() {
        let (mut t, t0) = table(10);
        for i in 0..5 {
            t.open(t0, i);
        }
        assert_eq!(t.header_timeout(), 10 * SECOND, "half full: the configured timeout");
        assert!(t.shed_expired(t0 + 9 * SECOND).is_empty(), "no pressure: hyper's timeout applies");
        t.open(t0 + 8 * SECOND, 5);
        t.open(t0 + 8 * SECOND, 6);
        assert_eq!(t.header_timeout(), Duration::from_millis(6400), "7 of 10: 10 s less 40% of 9 s");
        let shed = t.shed_expired(t0 + 7 * SECOND);
        assert_eq!(shed.len(), 5, "the five that waited 7 s, not the two that waited 1 s: {shed:?}");
        assert_eq!(t.header_timeout(), Duration::from_millis(6400), "shed connections count until closed");
        for s in &shed {
            t.close(s.id);
        }
        assert_eq!(t.header_timeout(), 10 * SECOND, "2 of 10 open");
        assert!(t.shed_expired(t0 + 9 * SECOND).is_empty());
    }

    #[test]
    fn a_drain_sheds_every_connection_not_in_a_request() {
        let (mut t, t0) = table(4);
        let (a, _) = t.open(t0, 1);
        t.open(t0, 2);
        t.open(t0, 3);
        assert!(t.begin_request(a));
        let shed: Vec<u32> = t.shed_all_waiting().into_iter().map(|s| s.signal).collect();
        assert_eq!(shed, vec![2, 3]);
        t.end_request(a, t0);
        assert_eq!(t.shed_all_waiting().len(), 1, "a's request ended: it goes too");
    }

    #[derive(Debug, Clone)]
    enum Step {
        Open,
        Begin(usize),
        End(usize),
        Close(usize),
        Starve(usize),
        Expire(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => Just(Step::Open),
            2 => (0usize..64).prop_map(Step::Begin),
            2 => (0usize..64).prop_map(Step::End),
            1 => (0usize..64).prop_map(Step::Close),
            2 => (0usize..64).prop_map(Step::Starve),
            1 => (0u64..20_000).prop_map(Step::Expire),
        ]
    }

    proptest! {
        /// Whatever happens, a connection in a request is never chosen, the table never holds more
        /// than one past its cap while a connection waits, and its waiting set matches the phases.
        #[test]
        fn no_connection_in_a_request_is_ever_shed(cap in 1usize..12, steps in prop::collection::vec(step(), 1..200)) {
            let (mut t, t0) = table(cap);
            let mut ids: Vec<ConnectionId> = Vec::new();
            let mut in_request = std::collections::HashSet::new();
            let mut now = t0;
            for s in steps {
                now += Duration::from_millis(50);
                let shed = match s {
                    Step::Open => {
                        let (id, shed) = t.open(now, 0);
                        ids.push(id);
                        shed.into_iter().collect()
                    }
                    Step::Begin(i) => {
                        if let Some(&id) = ids.get(i) {
                            if t.begin_request(id) {
                                in_request.insert(id);
                            }
                        }
                        Vec::new()
                    }
                    Step::End(i) => {
                        if let Some(&id) = ids.get(i) {
                            t.end_request(id, now);
                            in_request.remove(&id);
                        }
                        Vec::new()
                    }
                    Step::Close(i) => {
                        if let Some(&id) = ids.get(i) {
                            t.close(id);
                            in_request.remove(&id);
                        }
                        Vec::new()
                    }
                    Step::Starve(i) => {
                        if let Some(&id) = ids.get(i) {
                            t.mark_starved(id);
                        }
                        Vec::new()
                    }
                    Step::Expire(ms) => t.shed_expired(now + Duration::from_millis(ms)),
                };
                for s in shed {
                    prop_assert!(!in_request.contains(&s.id), "{:?} was in a request", s.id);
                }
                let waiting = t.phases.values().filter(|(p, _)| matches!(p, Phase::Waiting { .. })).count();
                prop_assert_eq!(waiting, t.waiting.len());
                let starved =
                    t.phases.values().filter(|(p, _)| matches!(p, Phase::Waiting { starved: true, .. })).count();
                prop_assert_eq!(starved, t.starved.len());
                prop_assert!(t.starved.is_subset(&t.waiting));
            }
        }
    }
}
