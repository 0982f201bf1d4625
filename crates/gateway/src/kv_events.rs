//! Live KV events: one subscriber task per engine with a `kv_events` endpoint.
//!
//! ```text
//! engine PUB ─► SUB ─► kv_wire::decode_live ─► kv_stream::StreamTracker ─► core index
//!                               │ gap / restart            │
//!                               └─► DEALER replay ["", from] ◄┘ (2 s timeout, both reply layouts)
//! ```
//!
//! A gap marks the worker `incomplete` until the replay fills it; a sequence going backwards is an
//! engine restart (its blocks are forgotten and a replay from 0 rebuilds them); history the replay
//! no longer has is counted and the worker continues from a cleared, partial view (which can only
//! under-report). An undecodable message is counted and marks the worker `invalid` with the reason;
//! the next restart or full replay makes it usable again. Nothing here can panic the gateway.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::kv_stream::{BatchMark, LiveAction, StreamTracker};
use kvgate_core::{KvState, WorkerId};
use kvgate_protocol::kv_wire::{decode_live, decode_replay, replay_request, ReplayMessage};
use kvgate_protocol::{KvEvent, KvEventBatch};
use kvgate_zmtp::{Limits, SubSocket, ZmtpError};

use crate::registry::{EngineContext, EngineHandle, StreamStats};

/// How long a replay may take before the gap is treated as lost history.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// After this long without a live message, ask the replay socket for anything newer than what was
/// applied. PUB drops silently above its high-water mark (and before a new subscription is joined),
/// and a lost last message is otherwise revealed only by the next one.
pub const IDLE_CATCH_UP: Duration = Duration::from_secs(2);
/// First wait between reconnect attempts; it doubles with each failure in a row, up to
/// [`BACKOFF_MAX`], and starts over once a publisher was connected.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait between reconnect attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Where one engine publishes.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// The worker.
    pub worker: WorkerId,
    /// PUB endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub endpoint: String,
    /// Bind `endpoint` (the engine's PUB socket connects to kvgate) instead of connecting to it.
    pub bind: bool,
    /// Replay ROUTER endpoint, if any.
    pub replay: Option<String>,
    /// Topic prefix to subscribe to (empty: everything).
    pub topic: String,
}

type Batch = (u64, Vec<KvEvent>);

/// What a batch says about the process that sent it (see [`BatchMark`]).
fn mark(batch: &KvEventBatch) -> BatchMark {
    BatchMark {
        clears_all: batch.events.iter().any(|e| matches!(e, KvEvent::AllBlocksCleared)),
        timestamp: Some(batch.ts),
    }
}

struct Subscriber {
    ctx: EngineContext,
    engine: Arc<EngineHandle>,
    cfg: StreamConfig,
    stats: Arc<StreamStats>,
    tracker: StreamTracker<Batch>,
    resync: tokio::sync::watch::Receiver<u64>,
    /// The stream failed since the view was last complete: events may have been missed.
    lost: bool,
    /// Sessions that got as far as a connected publisher (a reconnect after one starts its backoff
    /// over).
    connections: u64,
    warnings: WarnLimiter,
}

/// At most one warning per [`WARN_EVERY`] for a recurring problem, saying how many were held back.
#[derive(Debug, Default)]
struct WarnLimiter {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

/// See [`WarnLimiter`].
const WARN_EVERY: Duration = Duration::from_secs(10);

impl WarnLimiter {
    /// Whether to log now, and how many were held back since the last one logged.
    fn allow(&mut self, now: std::time::Instant) -> Option<u64> {
        if self.last.is_some_and(|l| now.duration_since(l) < WARN_EVERY) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// Runs one engine's subscriber until the task is aborted or the gateway is gone.
pub async fn run(ctx: EngineContext, engine: Arc<EngineHandle>, cfg: StreamConfig) {
    let stats = engine.stream.clone();
    let resync = engine.resync.subscribe();
    let mut sub = Subscriber {
        ctx,
        engine,
        cfg,
        stats,
        tracker: StreamTracker::new(),
        resync,
        lost: false,
        connections: 0,
        warnings: WarnLimiter::default(),
    };
    let mut backoff = BACKOFF_MIN;
    loop {
        let connections = sub.connections;
        match sub.session().await {
            Ok(()) => return,
            Err(e) => {
                if sub.connections > connections {
                    backoff = BACKOFF_MIN; // it was up: the engine may be back at once
                }
                sub.lost = true;
                let why = format!("KV event stream from {} down: {e}", sub.cfg.endpoint);
                let _ = sub.ctx.router.set_kv_state(&sub.cfg.worker, KvState::Incomplete(why));
                sub.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(engine = %sub.cfg.worker, endpoint = %sub.cfg.endpoint, error = %e, "KV event stream lost; reconnecting");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

impl Subscriber {
    /// One socket: subscribe (connecting, or binding for an engine that connects) and consume until
    /// the socket fails. `Ok` means stop for good.
    async fn session(&mut self) -> Result<(), String> {
        let topic = self.cfg.topic.as_bytes();
        let mut socket = if self.cfg.bind {
            SubSocket::bind(&self.cfg.endpoint, topic, Limits::default())
                .await
                .map_err(|e| format!("cannot bind {}: {e}", self.cfg.endpoint))?
        } else {
            SubSocket::connect(&self.cfg.endpoint, topic, Limits::default()).await.map_err(|e| e.to_string())?
        };
        let role = if self.cfg.bind { "listening for" } else { "subscribed to" };
        tracing::info!(engine = %self.cfg.worker, endpoint = %self.cfg.endpoint, "{role} KV events");
        if self.cfg.bind {
            let _ = self.ctx.router.set_kv_state(
                &self.cfg.worker,
                KvState::Incomplete(format!("listening on {}; the engine has not connected yet", self.cfg.endpoint)),
            );
        }
        let mut connected = false;
        loop {
            if !connected && socket.connected_peers() > 0 {
                connected = true;
                self.on_connected().await;
            }
            let msg = tokio::select! {
                changed = self.resync.changed() => {
                    if changed.is_err() {
                        return Ok(()); // the engine was removed
                    }
                    self.rebuild().await;
                    continue;
                }
                msg = tokio::time::timeout(IDLE_CATCH_UP, socket.recv()) => msg,
            };
            let msg = match msg {
                Ok(Ok(msg)) => msg,
                // One publisher of a binding socket misbehaved; it is gone, the socket listens on.
                Ok(Err(e)) if e.is_peer() => {
                    self.peer_failed(&e);
                    continue;
                }
                Ok(Err(e)) => {
                    if e.is_protocol_violation() {
                        self.peer_failed(&e);
                    }
                    return Err(e.to_string());
                }
                Err(_) => {
                    if self.cfg.replay.is_some() {
                        self.catch_up().await;
                    }
                    continue;
                }
            };
            self.on_message(msg).await;
        }
    }

    /// The stream is up: catch up on what the engine published before (§8: a replay from the next
    /// sequence number), or, without a replay socket, forget what may have been missed while it was
    /// down. Then the view is complete.
    async fn on_connected(&mut self) {
        self.connections += 1;
        if self.cfg.replay.is_some() {
            self.catch_up().await;
        } else if self.lost {
            let _ = self.ctx.router.clear_kv(&self.cfg.worker);
        }
        self.lost = false;
        if self.tracker.awaiting_replay().is_none() {
            let _ = self.ctx.router.set_kv_state(&self.cfg.worker, self.engine.synced_state());
        }
    }

    /// Counts a publisher that broke the protocol (an oversized frame, a bad handshake). Whatever it
    /// sent is dropped before it reaches the index; if the peer is the engine, the gap it leaves is
    /// found by the sequence numbers and replayed.
    fn peer_failed(&mut self, e: &ZmtpError) {
        self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
        self.count(|m| &m.kv_decode_errors, 1);
        if let Some(held_back) = self.warnings.allow(self.ctx.clock.instant()) {
            tracing::warn!(engine = %self.cfg.worker, endpoint = %self.cfg.endpoint, error = %e, held_back, "KV event peer broke the protocol; disconnected it");
        }
    }

    /// Starts over from an empty view, as for a restarted engine: forget the sequence numbers and
    /// rebuild from the replay socket (the registry has already cleared the blocks).
    async fn rebuild(&mut self) {
        self.tracker = StreamTracker::new();
        self.stats.last_seq.store(u64::MAX, Ordering::Relaxed);
        self.stats.joined_at_seq.store(u64::MAX, Ordering::Relaxed);
        if self.cfg.replay.is_some() {
            self.replay(0).await;
        } else {
            let _ = self.ctx.router.set_kv_state(&self.cfg.worker, self.engine.synced_state());
        }
    }

    async fn on_message(&mut self, frames: Vec<Bytes>) {
        let msg = match decode_live(&frames) {
            Ok(m) => m,
            Err(e) => {
                self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                self.count(|m| &m.kv_decode_errors, 1);
                if let Some(held_back) = self.warnings.allow(self.ctx.clock.instant()) {
                    tracing::warn!(engine = %self.cfg.worker, error = %e, held_back, "undecodable KV event message");
                }
                let _ = self
                    .ctx
                    .router
                    .set_kv_state(&self.cfg.worker, KvState::Invalid(format!("undecodable KV event message: {e}")));
                return;
            }
        };
        if !msg.batch.skipped.is_empty() {
            self.stats.decode_errors.fetch_add(msg.batch.skipped.len() as u64, Ordering::Relaxed);
            self.count(|m| &m.kv_decode_errors, msg.batch.skipped.len() as u64);
            tracing::debug!(engine = %self.cfg.worker, skipped = ?msg.batch.skipped, "KV events skipped");
        }
        let batch = &msg.batch.batch;
        // Live batches only: replayed ones come all at once, and their spacing is not the engine's.
        let _ = self.ctx.router.observe_engine_step(
            &self.cfg.worker,
            &batch.events,
            batch.ts,
            batch.dp_rank,
            self.ctx.clock.now(),
        );
        let mark = mark(batch);
        if self.cfg.replay.is_none() {
            self.join(msg.seq, mark);
        }
        let action = self.tracker.on_live_marked(msg.seq, mark, (msg.seq, msg.batch.batch.events));
        self.act(action).await;
    }

    /// A subscriber without a replay socket takes the first batch of a fresh tracker as where it joined the
    /// stream: the engine's earlier batches were published before it subscribed, which is no gap
    /// to replay (there is nothing to replay from). A batch that clears everything starts a
    /// complete view; any other leaves the blocks stored before it unknown, which is said.
    fn join(&mut self, seq: u64, mark: BatchMark) {
        if self.tracker.join_at(seq) && seq > 0 && !mark.clears_all {
            self.stats.joined_at_seq.store(seq, Ordering::Relaxed);
            tracing::info!(engine = %self.cfg.worker, seq, "joined the KV event stream after the engine began publishing, without a replay socket: blocks it stored before are not credited");
        }
    }

    /// Carries out what the tracker decided about a batch.
    async fn act(&mut self, action: LiveAction<Batch>) {
        match action {
            LiveAction::Apply(batches) => self.apply(batches),
            LiveAction::Duplicate | LiveAction::Buffered => {}
            LiveAction::Replay { from } => {
                self.stats.gaps.fetch_add(1, Ordering::Relaxed);
                self.count(|m| &m.kv_gaps, 1);
                let _ = self.ctx.router.set_kv_state(
                    &self.cfg.worker,
                    KvState::Incomplete(format!("sequence gap from {from}: replaying")),
                );
                self.replay(from).await;
            }
            LiveAction::Restart => {
                self.stats.restarts.fetch_add(1, Ordering::Relaxed);
                self.count(|m| &m.kv_restarts, 1);
                tracing::info!(engine = %self.cfg.worker, "KV event sequence went backwards: engine restarted");
                let _ = self.ctx.router.clear_kv(&self.cfg.worker);
                let _ = self
                    .ctx
                    .router
                    .set_kv_state(&self.cfg.worker, KvState::Incomplete("engine restarted: replaying from 0".into()));
                self.replay(0).await;
            }
        }
    }

    fn count(
        &self,
        family: impl Fn(
            &crate::metrics::Metrics,
        ) -> &prometheus_client::metrics::family::Family<
            crate::metrics::EngineLabel,
            prometheus_client::metrics::counter::Counter,
        >,
        n: u64,
    ) {
        crate::metrics::Metrics::engine_counter(family(&self.ctx.metrics), self.cfg.worker.as_str()).inc_by(n);
    }

    fn apply(&self, batches: Vec<Batch>) {
        let now = self.ctx.clock.now();
        for (seq, events) in batches {
            if self.ctx.router.apply_kv_events(&self.cfg.worker, &events, now).is_err() {
                return; // the worker was removed
            }
            self.stats.last_seq.store(seq, Ordering::Relaxed);
            self.stats.batches.fetch_add(1, Ordering::Relaxed);
            self.stats.events.fetch_add(events.len() as u64, Ordering::Relaxed);
            self.count(|m| &m.kv_events, events.len() as u64);
        }
    }

    /// Applies anything the replay socket has beyond what was applied, without counting a gap.
    async fn catch_up(&mut self) {
        let from = self.tracker.applied().map_or(0, |a| a + 1);
        let Some(endpoint) = self.cfg.replay.clone() else { return };
        let Ok(Ok(batches)) = tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(&endpoint, from)).await else { return };
        if batches.is_empty() {
            return;
        }
        for (seq, batch) in batches {
            let action = self.tracker.on_catch_up(seq, (seq, batch.events));
            let resolves_itself = matches!(action, LiveAction::Replay { .. } | LiveAction::Restart);
            self.act(action).await;
            if resolves_itself {
                break; // that replay fetched the rest
            }
        }
    }

    async fn replay(&mut self, from: u64) {
        self.stats.replays.fetch_add(1, Ordering::Relaxed);
        self.count(|m| &m.kv_replays, 1);
        let replayed = match &self.cfg.replay {
            Some(endpoint) => match tokio::time::timeout(REPLAY_TIMEOUT, fetch_replay(endpoint, from)).await {
                Ok(Ok(batches)) => batches,
                Ok(Err(e)) => {
                    tracing::warn!(engine = %self.cfg.worker, error = %e, "replay failed");
                    Vec::new()
                }
                Err(_) => {
                    tracing::warn!(engine = %self.cfg.worker, "replay timed out");
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        let outcome =
            self.tracker.on_replay(replayed.into_iter().map(|(seq, batch)| (seq, (seq, batch.events))).collect());
        if outcome.history_lost {
            self.stats.history_lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(engine = %self.cfg.worker, from, "KV event history lost: continuing from a cleared, partial view");
            let _ = self.ctx.router.clear_kv(&self.cfg.worker);
        }
        self.apply(outcome.apply);
        if self.tracker.awaiting_replay().is_none() {
            let _ = self.ctx.router.set_kv_state(&self.cfg.worker, self.engine.synced_state());
        }
    }
}

/// Asks a replay ROUTER for the batches from `from` on, until its end marker.
async fn fetch_replay(endpoint: &str, from: u64) -> Result<Vec<(u64, KvEventBatch)>, String> {
    let mut dealer = kvgate_zmtp::connect_dealer(endpoint, Limits::default()).await.map_err(|e| e.to_string())?;
    let [delimiter, seq] = replay_request(from);
    dealer.send(&[&delimiter[..], &seq[..]]).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    loop {
        let frames = dealer.recv().await.map_err(|e| e.to_string())?;
        match decode_replay(&frames).map_err(|e| e.to_string())? {
            ReplayMessage::End => return Ok(out),
            ReplayMessage::Batch { seq, batch, .. } => out.push((seq, batch.batch)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::disallowed_methods)] // an arbitrary starting instant
    fn a_recurring_warning_is_logged_at_most_every_ten_seconds_with_the_count_held_back() {
        let mut w = WarnLimiter::default();
        let t0 = std::time::Instant::now();
        assert_eq!(w.allow(t0), Some(0));
        assert_eq!(w.allow(t0 + Duration::from_secs(1)), None);
        assert_eq!(w.allow(t0 + Duration::from_secs(9)), None);
        assert_eq!(w.allow(t0 + WARN_EVERY), Some(2));
        assert_eq!(w.allow(t0 + WARN_EVERY + Duration::from_millis(1)), None);
    }
}
