//! A gRPC worker's own KV event stream (`SubscribeKvEvents`), so a `grpc://` worker needs no ZMQ
//! configuration, as SMG's gRPC mode needs none.
//!
//! ```text
//! worker relay ─► SubscribeKvEvents{0} ─► batches per rank ─► core index
//!                        │ lost (DATA_LOSS, gap, end)         └─► pushed load ─► load snapshot
//!                        └─► clear the worker's view, resubscribe from 0 (backoff)
//! ```
//!
//! The worker's relay follows each rank's publisher itself and fills its gaps from the rank's replay
//! socket; what it cannot fill ends the stream. Its cursors belong to one subscription and it keeps
//! no history, so a new subscription is live from now: the worker's view is cleared and rebuilt from
//! what arrives (a prefix stored before can only be under-reported, never credited falsely). A
//! batch repeating the last sequence number is the load alone (a heartbeat); a sequence number that
//! skips one is a stream the gateway can no longer trust, so it resubscribes rather than guess.
//! A worker that has no publisher to relay answers `UNIMPLEMENTED` and is routed on load alone
//! until it comes back into rotation.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvgate_core::{KvState, Timestamp};
use kvgate_protocol::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use kvgate_worker_proto::common::{self, kv_cache_event, KvCacheTier};

use super::to_snapshot;
use crate::grpc_worker::{GrpcWorker, PushedLoads};
use crate::metrics::Metrics;
use crate::registry::{EngineContext, EngineHandle};

/// First wait before subscribing again after a lost stream; it doubles with each loss in a row that
/// delivered nothing, up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest wait before subscribing again.
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How long opening a subscription may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);

/// How one subscription ended.
enum Ended {
    /// The engine was removed from the gateway.
    Removed,
    /// The view must be rebuilt (the engine came back into rotation): subscribe again at once.
    Resync,
    /// The worker has no KV events to stream.
    Refused(String),
    /// The stream failed or ended; `delivered` says whether it carried anything first.
    Lost { why: String, delivered: bool },
}

/// Runs one gRPC worker's event subscriber until the task is aborted or the engine is removed.
pub(super) async fn run(ctx: EngineContext, engine: Arc<EngineHandle>) {
    let Some(worker) = engine.grpc.as_ref() else { return };
    engine.stream.over_grpc.store(true, Ordering::Relaxed);
    let mut resync = engine.resync.subscribe();
    let mut backoff = BACKOFF_MIN;
    let mut lost_before = false;
    loop {
        match subscription(&ctx, &engine, worker, &mut resync, lost_before).await {
            Ended::Removed => return,
            Ended::Resync => {
                backoff = BACKOFF_MIN;
                lost_before = false;
            }
            Ended::Refused(why) => {
                tracing::info!(engine = %engine.id, reason = %why, "the gRPC worker streams no KV events: routing it on load alone");
                *engine.grpc_events_refused.lock() = Some(why);
                let _ = ctx.router.set_kv_state(&engine.id, engine.synced_state());
                // Asked again when the worker comes back into rotation (it may restart with a
                // publisher).
                if resync.changed().await.is_err() {
                    return;
                }
                *engine.grpc_events_refused.lock() = None;
                backoff = BACKOFF_MIN;
                lost_before = false;
            }
            Ended::Lost { why, delivered } => {
                if delivered {
                    backoff = BACKOFF_MIN;
                }
                lost_before = true;
                let _ = ctx.router.clear_kv(&engine.id);
                let state = KvState::Incomplete(format!("KV event stream lost ({why}): subscribing again from zero"));
                let _ = ctx.router.set_kv_state(&engine.id, state);
                engine.stream.connect_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(engine = %engine.id, error = %why, "gRPC KV event stream lost; subscribing again");
                tokio::select! {
                    changed = resync.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// One subscription, from opening it to its end.
async fn subscription(
    ctx: &EngineContext,
    engine: &EngineHandle,
    worker: &GrpcWorker,
    resync: &mut tokio::sync::watch::Receiver<u64>,
    lost_before: bool,
) -> Ended {
    let mut stream = match worker.subscribe_kv_events(OPEN_TIMEOUT).await {
        Ok(stream) => stream,
        Err(status) if status.code() == tonic::Code::Unimplemented => return Ended::Refused(status.message().into()),
        Err(status) => return Ended::Lost { why: describe(&status), delivered: false },
    };
    // Nothing is known of what the worker stored before this subscription.
    let _ = ctx.router.clear_kv(&engine.id);
    engine.stream.last_seq.store(u64::MAX, Ordering::Relaxed);
    engine.stream.joined_at_seq.store(u64::MAX, Ordering::Relaxed);
    if lost_before {
        engine.stream.resubscribes.fetch_add(1, Ordering::Relaxed);
    }
    let _ = ctx.router.set_kv_state(&engine.id, engine.synced_state());
    tracing::info!(engine = %engine.id, "subscribed to the gRPC worker's KV events");
    let mut reader = StreamReader::default();
    loop {
        let message = tokio::select! {
            changed = resync.changed() => {
                return if changed.is_err() { Ended::Removed } else { Ended::Resync };
            }
            message = stream.message() => message,
        };
        let delivered = reader.delivered;
        match message {
            Ok(Some(batch)) => {
                if let Err(why) = reader.take(ctx, engine, worker, batch) {
                    engine.stream.gaps.fetch_add(1, Ordering::Relaxed);
                    Metrics::engine_counter(&ctx.metrics.kv_gaps, engine.id.as_str()).inc_by(1);
                    return Ended::Lost { why, delivered: true };
                }
            }
            Ok(None) => return Ended::Lost { why: "the worker ended the stream".into(), delivered },
            Err(status) => return Ended::Lost { why: describe(&status), delivered },
        }
    }
}

fn describe(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// What one subscription has seen: each rank's last sequence number and pushed load.
#[derive(Default)]
struct StreamReader {
    cursors: HashMap<i32, u64>,
    loads: PushedLoads,
    delivered: bool,
}

impl StreamReader {
    /// Applies one batch. `Err` names a skipped sequence number: the stream can no longer be
    /// trusted.
    fn take(
        &mut self,
        ctx: &EngineContext,
        engine: &EngineHandle,
        worker: &GrpcWorker,
        batch: common::KvEventBatch,
    ) -> Result<(), String> {
        self.delivered = true;
        let now = ctx.clock.now();
        if let Some(load) = &batch.load {
            self.take_load(ctx, engine, worker, batch.dp_rank, load, now);
        }
        let rank = batch.dp_rank.unwrap_or(0);
        let seq = batch.sequence_number;
        let stats = &engine.stream;
        match self.cursors.get(&rank).copied() {
            // A heartbeat repeats the last sequence number; nothing older can arrive again.
            Some(last) if seq <= last => return Ok(()),
            Some(last) if seq > last + 1 => {
                return Err(format!("rank {rank} skipped from sequence {last} to {seq}"));
            }
            Some(_) => {}
            None => {
                let clears_all = batch.events.iter().any(|e| matches!(e.data, Some(kv_cache_event::Data::Cleared(_))));
                if seq > 0 && !clears_all && self.cursors.is_empty() {
                    stats.joined_at_seq.store(seq, Ordering::Relaxed);
                }
            }
        }
        self.cursors.insert(rank, seq);
        let (events, skipped) = events_of(&batch);
        if skipped > 0 {
            stats.decode_errors.fetch_add(skipped, Ordering::Relaxed);
            Metrics::engine_counter(&ctx.metrics.kv_decode_errors, engine.id.as_str()).inc_by(skipped);
        }
        if !events.is_empty() {
            let rank = u32::try_from(rank).ok();
            let _ = ctx.router.observe_engine_step(&engine.id, &events, batch.timestamp, rank, now);
        }
        if ctx.router.apply_kv_events(&engine.id, &events, now).is_ok() {
            stats.last_seq.store(seq, Ordering::Relaxed);
            stats.batches.fetch_add(1, Ordering::Relaxed);
            stats.events.fetch_add(events.len() as u64, Ordering::Relaxed);
            Metrics::engine_counter(&ctx.metrics.kv_events, engine.id.as_str()).inc_by(events.len() as u64);
        }
        Ok(())
    }

    /// The load the worker pushed with a batch: fresher than the next poll, so it becomes the
    /// worker's load snapshot (stamped with the figures' own age) once every rank has reported.
    fn take_load(
        &mut self,
        ctx: &EngineContext,
        engine: &EngineHandle,
        worker: &GrpcWorker,
        rank: Option<i32>,
        load: &common::EngineLoad,
        now: Timestamp,
    ) {
        let Some(report) = self.loads.record(rank, load, worker.known_ranks()) else { return };
        let observed_at = Timestamp::from_micros(now.as_micros().saturating_sub(u64::from(load.age_ms) * 1000));
        if report.max_running_requests.is_some() {
            engine.identity.lock().max_running_requests = report.max_running_requests;
        }
        let _ = ctx.router.update_load(&engine.id, to_snapshot(ctx, &report, observed_at));
        engine.stream.loads_pushed.fetch_add(1, Ordering::Relaxed);
    }
}

/// A batch's events in kvgate's terms, and how many could not be read (an event without a kind).
pub(crate) fn events_of(batch: &common::KvEventBatch) -> (Vec<KvEvent>, u64) {
    let mut skipped = 0;
    let events = batch
        .events
        .iter()
        .filter_map(|e| {
            let event = match e.data.as_ref() {
                Some(kv_cache_event::Data::Stored(s)) => KvEvent::BlockStored(stored(s)),
                Some(kv_cache_event::Data::Removed(r)) => KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: r.block_hashes.iter().map(|&h| engine_hash(h)).collect(),
                    medium: medium(r.medium.as_deref(), r.tier),
                    group_idx: r.group_idx,
                }),
                Some(kv_cache_event::Data::Cleared(_)) => KvEvent::AllBlocksCleared,
                None => {
                    skipped += 1;
                    return None;
                }
            };
            Some(event)
        })
        .collect();
    (events, skipped)
}

fn stored(s: &common::KvBlocksStored) -> BlockStored {
    BlockStored {
        block_hashes: s.blocks.iter().map(|b| engine_hash(b.block_hash)).collect(),
        parent_block_hash: s.parent_block_hash.map(engine_hash),
        token_ids: s.blocks.iter().flat_map(|b| b.token_ids.iter().copied()).collect(),
        // The relay gives every block the run's width; a run without blocks has none to check.
        block_size: s.blocks.first().map_or(0, |b| u32::try_from(b.block_size).unwrap_or(0)),
        lora_name: s.lora_name.clone(),
        medium: medium(s.medium.as_deref(), s.tier),
        cache_salt: s.cache_salt.clone(),
        group_idx: s.group_idx,
        kv_cache_spec_kind: s.kv_cache_spec_kind.clone(),
    }
}

/// The engine's hash as the stream carries it (`int64`: vLLM's low 64 bits, SGLang's high 64 bits),
/// taken as its bit pattern: it is only ever compared with hashes of the same worker.
fn engine_hash(h: i64) -> EngineHash {
    EngineHash(h as u64)
}

/// Where a block lives: the medium the engine named, else the tier's (the device tier and an unset
/// one are the accelerator, which the index credits).
fn medium(named: Option<&str>, tier: Option<i32>) -> Option<String> {
    if let Some(m) = named {
        return Some(m.to_owned());
    }
    match tier.map(KvCacheTier::try_from) {
        None | Some(Ok(KvCacheTier::Unspecified | KvCacheTier::Device)) => None,
        Some(Ok(KvCacheTier::Host)) => Some("CPU".into()),
        Some(Ok(KvCacheTier::Disk)) => Some("DISK".into()),
        Some(Ok(KvCacheTier::External)) => Some("EXTERNAL".into()),
        Some(Err(_)) => Some("UNKNOWN".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::{KvBlock, KvBlocksRemoved, KvBlocksStored, KvCacheCleared, KvCacheEvent};

    fn block(hash: i64, tokens: &[u32]) -> KvBlock {
        KvBlock { block_hash: hash, token_ids: tokens.to_vec(), block_size: tokens.len() as i32, ..Default::default() }
    }

    #[test]
    fn a_batch_becomes_the_same_events_the_zmq_decoder_gives() {
        let batch = common::KvEventBatch {
            sequence_number: 4,
            events: vec![
                KvCacheEvent {
                    event_id: 1,
                    data: Some(kv_cache_event::Data::Stored(KvBlocksStored {
                        blocks: vec![block(-5, &[1, 2]), block(7, &[3, 4])],
                        parent_block_hash: Some(-1),
                        tier: Some(KvCacheTier::Device as i32),
                        lora_name: Some("adapter".into()),
                        ..Default::default()
                    })),
                },
                KvCacheEvent {
                    event_id: 2,
                    data: Some(kv_cache_event::Data::Removed(KvBlocksRemoved {
                        block_hashes: vec![7],
                        tier: Some(KvCacheTier::Host as i32),
                        ..Default::default()
                    })),
                },
                KvCacheEvent { event_id: 3, data: Some(kv_cache_event::Data::Cleared(KvCacheCleared {})) },
                KvCacheEvent { event_id: 4, data: None },
            ],
            ..Default::default()
        };
        let (events, skipped) = events_of(&batch);
        assert_eq!(skipped, 1, "an event without a kind is counted, not applied");
        assert_eq!(
            events,
            vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![EngineHash(-5i64 as u64), EngineHash(7)],
                    parent_block_hash: Some(EngineHash(u64::MAX)),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    lora_name: Some("adapter".into()),
                    ..Default::default()
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![EngineHash(7)],
                    medium: Some("CPU".into()),
                    group_idx: None
                }),
                KvEvent::AllBlocksCleared,
            ]
        );
    }

    #[test]
    fn only_the_device_tier_is_the_accelerator() {
        assert_eq!(medium(None, None), None);
        assert_eq!(medium(None, Some(KvCacheTier::Device as i32)), None);
        assert_eq!(medium(None, Some(KvCacheTier::Unspecified as i32)), None);
        assert_eq!(medium(None, Some(KvCacheTier::Disk as i32)).as_deref(), Some("DISK"));
        assert_eq!(medium(None, Some(99)).as_deref(), Some("UNKNOWN"));
        assert_eq!(medium(Some("GPU"), Some(KvCacheTier::Host as i32)).as_deref(), Some("GPU"), "a named medium wins");
    }
}
