//! Several gateway replicas that decide as one: every replica shares its reservations with the
//! others over NATS, and scores theirs like its own (`kvgate_core::replicas`).
//!
//! One background task per replica. It publishes the reservation changes the router queued when the
//! core's batching rule says they are due (`kvgate_core::outbox`: a reservation at once, but at
//! most one message per `flush_ms`; first tokens and releases with the next message, at most
//! `lazy_flush_ms` later), one message per batch, and sleeps while nothing is due. Every
//! `state_interval_ms` it publishes its whole state, which heals what a lossy bus dropped and doubles
//! as its heartbeat, and expires peers that went silent. Messages from peers are applied as they
//! arrive. The decision path only appends to the router's queue (and signals the task when the next
//! message moves earlier); it never waits on the bus.
//!
//! Without the bus (unreachable at start, lost later) the replica keeps routing on its own ledger,
//! says so (`GET /admin/replicas`, `kvgate_replica_bus_connected`, a log line), lets its peers'
//! reservations expire, and shares again once the client reconnects.

pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State as BusState;
use futures_util::{FutureExt, StreamExt};
use kvgate_core::{BatchWindows, PeerApply, PeerStatus, ReplicaId, Router, Timestamp};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{oneshot, Notify};

use crate::clock::Clock;
use crate::config::{redact_url, ReplicasConfig};
use crate::metrics::replicas::ReplicaMetrics;
use wire::{Body, Decoded, Envelope};

/// Counters and connection state, for `GET /admin/replicas`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaCounters {
    /// `connecting`, `connected` or `disconnected`.
    pub bus_state: &'static str,
    /// Milliseconds since the gateway started at the last change of `bus_state`.
    pub bus_state_since_ms: u64,
    /// The last error the bus client reported.
    pub last_error: Option<String>,
    /// Messages published.
    pub published: u64,
    /// Batches of changes not published because the bus was down (the next full state heals).
    pub dropped: u64,
    /// Peer messages applied.
    pub received: u64,
    /// This replica's own messages echoed back by the bus, ignored.
    pub own_echoes: u64,
    /// Messages from another process using this replica's id, ignored.
    pub duplicate_id: u64,
    /// Payloads that were not kvgate envelopes.
    pub garbage: u64,
    /// kvgate envelopes of another version.
    pub foreign: u64,
    /// Full states too large for the server's payload limit, not sent.
    pub state_too_large: u64,
    /// Peers expired for silence.
    pub peers_expired: u64,
    /// What applying peer messages did, summed.
    pub applied: PeerApply,
}

/// A replica's sharing state, shared by its task and the admin API.
#[derive(Debug)]
pub struct Replicas {
    /// The configuration; `None`: sharing is off.
    pub config: Option<ReplicasConfig>,
    /// This process's random instance number.
    pub instance: u64,
    /// Counters.
    pub counters: Mutex<ReplicaCounters>,
    metrics: ReplicaMetrics,
}

/// What `GET /admin/replicas` shows.
#[derive(Debug, Serialize)]
pub struct ReplicasView {
    /// Whether reservations are shared.
    pub enabled: bool,
    /// This replica's id.
    pub replica_id: Option<String>,
    /// The bus, credentials hidden.
    pub bus: Option<String>,
    /// The subject.
    pub subject: Option<String>,
    /// Whether the bus is connected now.
    pub connected: bool,
    /// Counters.
    #[serde(flatten)]
    pub counters: ReplicaCounters,
    /// Peers heard from and not expired.
    pub peers: Vec<PeerStatus>,
    /// How the peers' requests coincide with this replica's ([`kvgate_core::concurrent_peers`]).
    pub concurrency: kvgate_core::ConcurrentPeers,
}

impl Replicas {
    /// Sharing state for `config`.
    pub fn new(config: Option<ReplicasConfig>, metrics: ReplicaMetrics) -> Self {
        let counters =
            ReplicaCounters { bus_state: if config.is_some() { "connecting" } else { "off" }, ..Default::default() };
        Replicas { config, instance: crate::clock::entropy() | 1, counters: Mutex::new(counters), metrics }
    }

    /// The view for the admin API, with the peers `router` holds reservations of at `now`.
    pub fn view(&self, router: &Router, now: Timestamp) -> ReplicasView {
        let counters = self.counters.lock().clone();
        let c = self.config.as_ref();
        ReplicasView {
            enabled: c.is_some(),
            replica_id: c.map(|c| c.replica_id.clone()),
            bus: c.map(|c| c.bus.split(',').map(|u| redact_url(u.trim())).collect::<Vec<_>>().join(",")),
            subject: c.map(|c| c.subject.clone()),
            connected: counters.bus_state == "connected",
            counters,
            peers: router.peers(now),
            concurrency: router.concurrent_peers(),
        }
    }

    /// A new request arrived at `now`: how long it waits before its decision
    /// ([`kvgate_core::Router::arrived`]): nothing unless sharing is on and the peers decide in
    /// step with this replica.
    pub fn stagger(&self, router: &Router, now: Timestamp, draw: u64) -> Duration {
        let Some(max) = self.config.as_ref().map(|c| c.stagger) else {
            return Duration::ZERO;
        };
        let (wait, peers) = router.arrived(now, max, draw);
        self.metrics.concurrent_peers.set(peers.unseen);
        if !wait.is_zero() {
            self.metrics.staggered.inc();
        }
        wait
    }

    fn set_bus_state(&self, bus_state: &'static str, at_ms: u64) {
        let mut c = self.counters.lock();
        if c.bus_state != bus_state {
            c.bus_state = bus_state;
            c.bus_state_since_ms = at_ms;
        }
        self.metrics.connected.set(i64::from(bus_state == "connected"));
    }
}

/// What the sharing task uses of the gateway: the router whose reservations it shares, the clock,
/// the sharing state, and the signal that wakes queued requests when a peer's reservations end.
#[derive(Debug, Clone)]
pub struct SharingContext {
    /// The routing core.
    pub router: Arc<Router>,
    /// The gateway's clock.
    pub clock: Clock,
    /// This replica's sharing state.
    pub replicas: Arc<Replicas>,
    /// Notified when capacity may have appeared.
    pub capacity: Arc<Notify>,
}

/// A running sharing task; [`ReplicaTask::stop`] says goodbye to the peers and ends it.
#[derive(Debug)]
pub struct ReplicaTask {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl ReplicaTask {
    /// Tells the peers this replica's reservations end, and stops sharing.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
    }
}

/// Starts sharing when `[replicas]` configures a bus.
pub fn start(state: &SharingContext) -> Option<ReplicaTask> {
    let config = state.replicas.config.clone()?;
    let (stop, stopped) = oneshot::channel();
    let due_earlier = Arc::new(Notify::new());
    let wake = due_earlier.clone();
    state.router.batch_reservation_changes(
        BatchWindows { spacing: config.flush, lazy: config.lazy_flush },
        Some(Arc::new(move || wake.notify_one())),
    );
    let task = tokio::spawn(run(state.clone(), config, stopped, due_earlier));
    Some(ReplicaTask { stop, task })
}

/// Reconnect delays: quick at first (a restarted NATS is back in a second), at most two seconds.
fn reconnect_delay(attempts: usize) -> Duration {
    Duration::from_millis((100u64 << attempts.min(5)).min(2000))
}

async fn run(
    state: SharingContext,
    config: ReplicasConfig,
    mut stopped: oneshot::Receiver<()>,
    due_earlier: Arc<Notify>,
) {
    let replicas = &state.replicas;
    let on_event = {
        let state = state.clone();
        move |event: async_nats::Event| {
            let state = state.clone();
            async move { observe(&state, &event) }
        }
    };
    let options = async_nats::ConnectOptions::new()
        .name(format!("kvgate {}", config.replica_id))
        .retry_on_initial_connect()
        // The server would send every message back to its sender: one wake-up and one decode per
        // message for nothing. Echoes that still arrive (a bridged bus) are recognised and ignored.
        .no_echo()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(2))
        .reconnect_delay_callback(reconnect_delay)
        .event_callback(on_event);
    let addrs: Result<Vec<async_nats::ServerAddr>, _> = config.bus.split(',').map(|s| s.trim().parse()).collect();
    let client = match addrs {
        Ok(addrs) => options.connect(addrs).await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let client = match client {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "replica bus: cannot use it; this replica decides alone");
            replicas.counters.lock().last_error = Some(e);
            replicas.set_bus_state("disconnected", now_ms(&state));
            return;
        }
    };
    let mut subscription = match client.subscribe(config.subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, subject = %config.subject, "replica bus: cannot subscribe; this replica decides alone");
            replicas.counters.lock().last_error = Some(e.to_string());
            return;
        }
    };
    tracing::info!(replica = %config.replica_id, subject = %config.subject, "sharing reservations with the other replicas");
    let me = ReplicaId::new(&config.replica_id);
    let mut sender = Sender { client: &client, subject: &config.subject, me: &me, instance: replicas.instance, seq: 0 };
    // One timer, re-armed only when the outbox's deadline changes: no wake-ups while nothing is queued.
    let flush = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(flush);
    let mut armed = None;
    // Only this task's own steps and the outbox's wake move the deadline; a peer's message does not.
    let mut recheck = true;
    let mut heartbeat = tokio::time::interval(config.state_interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        if std::mem::take(&mut recheck) {
            let due = state.router.reservation_changes_due_at();
            if due != armed {
                if let Some(at) = due {
                    flush.as_mut().reset(tokio::time::Instant::from_std(state.clock.instant_at(at)));
                }
                armed = due;
            }
        }
        tokio::select! {
            _ = &mut stopped => break,
            _ = due_earlier.notified() => recheck = true,
            _ = &mut flush, if armed.is_some() => {
                (armed, recheck) = (None, true);
                let changes = state.router.take_due_reservation_changes(state.clock.now());
                if !changes.is_empty() {
                    sender.send(&state, Body::Changes(changes)).await;
                }
            }
            _ = heartbeat.tick() => {
                recheck = true;
                // Changes first, so the state a peer applies last is the newest.
                let changes = state.router.take_reservation_changes();
                if !changes.is_empty() {
                    sender.send(&state, Body::Changes(changes)).await;
                }
                sender.send(&state, wire::state_body(state.router.held_reservations())).await;
                let expired = state.router.expire_peers(state.clock.now(), config.expiry);
                for peer in &expired {
                    tracing::warn!(peer = %peer, expiry_ms = config.expiry.as_millis() as u64, "replica bus: peer went silent; its reservations end");
                }
                if !expired.is_empty() {
                    replicas.counters.lock().peers_expired += expired.len() as u64;
                    replicas.metrics.peers_expired.inc_by(expired.len() as u64);
                }
                replicas.metrics.peers.set(state.router.peers(state.clock.now()).len() as i64);
            }
            message = subscription.next() => match message {
                Some(m) => {
                    receive(&state, &me, &m.payload);
                    // What else has arrived is applied at once, without going round the loop.
                    while let Some(Some(m)) = subscription.next().now_or_never() {
                        receive(&state, &me, &m.payload);
                    }
                }
                None => {
                    tracing::error!("replica bus: the subscription ended; this replica decides alone");
                    break;
                }
            },
        }
    }
    sender.send(&state, Body::Goodbye).await;
    let _ = tokio::time::timeout(Duration::from_millis(500), client.flush()).await;
    state.router.share_reservations(false);
}

fn now_ms(state: &SharingContext) -> u64 {
    state.clock.now().as_micros() / 1000
}

/// Follows the bus client's connection events.
fn observe(state: &SharingContext, event: &async_nats::Event) {
    let replicas = &state.replicas;
    match event {
        async_nats::Event::Connected => {
            tracing::info!("replica bus connected: sharing reservations");
            replicas.set_bus_state("connected", now_ms(state));
        }
        async_nats::Event::Disconnected => {
            tracing::warn!("replica bus lost: routing on this replica's own reservations until it returns");
            replicas.set_bus_state("disconnected", now_ms(state));
        }
        async_nats::Event::ServerError(e) => replicas.counters.lock().last_error = Some(e.to_string()),
        async_nats::Event::ClientError(e) => replicas.counters.lock().last_error = Some(e.to_string()),
        other => tracing::debug!(event = %other, "replica bus event"),
    }
}

struct Sender<'a> {
    client: &'a async_nats::Client,
    subject: &'a str,
    me: &'a ReplicaId,
    instance: u64,
    seq: u64,
}

impl Sender<'_> {
    /// Publishes one body; while the bus is down the body is dropped (the next full state heals).
    async fn send(&mut self, state: &SharingContext, body: Body) {
        let replicas = &state.replicas;
        if self.client.connection_state() != BusState::Connected {
            replicas.counters.lock().dropped += 1;
            replicas.metrics.messages("sent", "dropped").inc();
            return;
        }
        let is_state = matches!(body, Body::State { .. });
        let envelope = Envelope {
            kind: wire::KIND.into(),
            replica: self.me.clone(),
            instance: self.instance,
            seq: self.seq,
            body,
        };
        let payload = wire::encode(&envelope);
        let limit = self.client.server_info().max_payload;
        if limit > 0 && payload.len() > limit {
            // Only a full state can grow this large; changes keep flowing.
            replicas.counters.lock().state_too_large += u64::from(is_state);
            replicas.metrics.messages("sent", "too_large").inc();
            tracing::warn!(
                bytes = payload.len(),
                limit,
                "replica bus: a message exceeds the server's max_payload; not sent"
            );
            return;
        }
        self.seq += 1;
        match self.client.publish(self.subject.to_owned(), payload.into()).await {
            Ok(()) => {
                replicas.counters.lock().published += 1;
                replicas.metrics.messages("sent", "ok").inc();
            }
            Err(e) => {
                replicas.counters.lock().dropped += 1;
                replicas.metrics.messages("sent", "dropped").inc();
                tracing::debug!(error = %e, "replica bus: publish failed");
            }
        }
    }
}

/// Applies one payload from the subject.
fn receive(state: &SharingContext, me: &ReplicaId, payload: &[u8]) {
    let replicas = &state.replicas;
    let now = state.clock.now();
    let mut frees_capacity = false;
    let outcome = match wire::decode(payload) {
        Decoded::Garbage(why) => {
            let n = bump(&replicas.counters, |c| &mut c.garbage);
            if n.is_power_of_two() {
                tracing::warn!(count = n, error = %why, "replica bus: ignored a message that is not a kvgate envelope");
            }
            "garbage"
        }
        Decoded::Foreign(kind) => {
            let n = bump(&replicas.counters, |c| &mut c.foreign);
            if n.is_power_of_two() {
                tracing::warn!(count = n, kind = %kind, expected = wire::KIND, "replica bus: ignored a message of another kvgate version");
            }
            "foreign"
        }
        Decoded::Message(env) if env.replica == *me => {
            if env.instance == replicas.instance {
                bump(&replicas.counters, |c| &mut c.own_echoes);
                "own"
            } else {
                let n = bump(&replicas.counters, |c| &mut c.duplicate_id);
                if n.is_power_of_two() {
                    tracing::error!(replica = %me, "replica bus: another process uses this replica id; its reservations are ignored (give every replica its own id)");
                }
                "duplicate_id"
            }
        }
        Decoded::Message(env) => {
            // Only a message that can end or shrink a reservation may free capacity.
            frees_capacity = match &env.body {
                Body::Changes(changes) => changes.iter().any(|c| !c.is_urgent()),
                Body::State { .. } | Body::Goodbye => true,
            };
            let applied = match &env.body {
                Body::Changes(changes) => Some(state.router.apply_peer_changes(&env.replica, changes, now)),
                Body::State { workers, held } => {
                    wire::held_of(workers, held).map(|held| state.router.apply_peer_state(&env.replica, &held, now))
                }
                Body::Goodbye => {
                    tracing::info!(peer = %env.replica, "replica bus: peer said goodbye; its reservations end");
                    state.router.forget_peer(&env.replica, now);
                    Some(PeerApply::default())
                }
            };
            match applied {
                Some(a) => {
                    let mut c = replicas.counters.lock();
                    c.received += 1;
                    c.applied.merge(a);
                    replicas.metrics.changes_applied.inc_by(a.applied);
                    "ok"
                }
                None => {
                    bump(&replicas.counters, |c| &mut c.garbage);
                    "garbage"
                }
            }
        }
    };
    replicas.metrics.messages("received", outcome).inc();
    if outcome == "ok" && frees_capacity {
        // A peer's release may have freed the capacity a queued request waits for.
        state.capacity.notify_waiters();
    }
}

fn bump(counters: &Mutex<ReplicaCounters>, field: impl FnOnce(&mut ReplicaCounters) -> &mut u64) -> u64 {
    let mut c = counters.lock();
    let f = field(&mut c);
    *f += 1;
    *f
}
