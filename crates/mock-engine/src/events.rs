//! KV events on the wire: a ZMQ PUB with `[topic, seq, payload]` frames and a replay ROUTER answering
//! `["", start_seq]` with the newer four-frame layout and the end marker, in vLLM's current map format
//! or SGLang's (signed hashes), written by `kvgate_protocol`'s encoder beside its decoder. The PUB is
//! kvgate's own (it counts the subscribers really listening); the ROUTER is the `zeromq` crate's.
//! Faults drop or delay live batches; replays still have them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kvgate_engine_model::EventBatch;
use kvgate_protocol::kv_wire::{encode_payload, live_frames, replay_end_frames, replay_frames};
use kvgate_zmtp::{Limits, PubSocket};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::Faults;

/// Batches kept for replay (the engines' default `buffer_steps`).
pub const REPLAY_BUFFER: usize = 10_000;

/// Which engine's wire format to publish.
pub use kvgate_protocol::kv_wire::WireFormat as EventFormat;

/// The msgpack payload of a batch, stamped `ts` seconds since the Unix epoch.
pub fn encode(format: EventFormat, batch: &EventBatch, ts: f64) -> Vec<u8> {
    encode_payload(format, ts, &batch.events, Some(0))
}

type History = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// The engine's event sockets, bound.
#[derive(Debug)]
pub struct EventSockets {
    /// Where subscribers connect for live batches.
    pub pub_endpoint: String,
    /// Where replays are asked for.
    pub replay_endpoint: String,
    /// The live publisher (shared with the task that publishes).
    pub publisher: Arc<PubSocket>,
    /// The same live batches for the gRPC worker's `SubscribeKvEvents` streams, after the same
    /// faults; each with the engine clock's Unix seconds.
    pub live: tokio::sync::broadcast::Sender<Arc<(EventBatch, f64)>>,
    /// The sequence number of the last batch sent on `live` ([`NOTHING_PUBLISHED`] before the
    /// first), stored after it was sent: a new subscriber's heartbeat may then repeat it.
    pub published_seq: Arc<AtomicU64>,
}

/// [`EventSockets::published_seq`] before any batch.
pub const NOTHING_PUBLISHED: u64 = u64::MAX;

/// Batches a slow gRPC subscriber may fall behind by before its stream is ended (it then
/// subscribes again and rebuilds, as after a real relay's unfillable gap).
const LIVE_BACKLOG: usize = 4096;

fn message(frames: impl IntoIterator<Item = Vec<u8>>) -> Vec<Bytes> {
    frames.into_iter().map(Bytes::from).collect()
}

/// Binds the PUB and replay sockets and starts the task that publishes batches.
pub async fn start(
    host: &str,
    pub_port: u16,
    replay_port: u16,
    format: EventFormat,
    faults: Arc<Mutex<Faults>>,
    mut batches: mpsc::UnboundedReceiver<EventBatch>,
    clock: kvgate_clock::Clock,
) -> Result<EventSockets, String> {
    let publisher = PubSocket::bind(&format!("tcp://{host}:{pub_port}"), Limits::default())
        .await
        .map_err(|e| format!("KV event PUB on {host}:{pub_port}: {e}"))?;
    let pub_endpoint = publisher.endpoint();
    let publisher = Arc::new(publisher);
    let mut router = zeromq::RouterSocket::new();
    let replay_endpoint = router
        .bind(&format!("tcp://{host}:{replay_port}"))
        .await
        .map_err(|e| format!("replay ROUTER on {host}:{replay_port}: {e}"))?
        .to_string();
    let history: History = Arc::default();
    let h = history.clone();
    tokio::spawn(async move {
        while let Ok(req) = router.recv().await {
            let frames = req.into_vec();
            let start = frames.get(2).and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()).map(u64::from_be_bytes);
            let (Some(id), Some(start)) = (frames.first().cloned(), start) else { continue };
            let replay: Vec<(u64, Vec<u8>)> = h.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
            let addressed = |frames: [Vec<u8>; 4]| {
                let mut m = vec![id.clone()];
                m.extend(message(frames));
                ZmqMessage::try_from(m).expect("non-empty")
            };
            for (seq, payload) in replay {
                if router.send(addressed(replay_frames(format.topic(), seq, payload))).await.is_err() {
                    break;
                }
            }
            let _ = router.send(addressed(replay_end_frames())).await;
        }
    });
    let live = publisher.clone();
    let (grpc_live, _) = tokio::sync::broadcast::channel(LIVE_BACKLOG);
    let grpc = grpc_live.clone();
    let published_seq = Arc::new(AtomicU64::new(NOTHING_PUBLISHED));
    let published = published_seq.clone();
    tokio::spawn(async move {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6b76);
        while let Some(batch) = batches.recv().await {
            let ts = clock.now().as_micros() as f64 / 1e6;
            let payload = encode(format, &batch, ts);
            {
                let mut h = history.lock();
                if batch.seq == 0 {
                    h.clear(); // a new engine process starts its history again
                }
                h.push_back((batch.seq, payload.clone()));
                while h.len() > REPLAY_BUFFER {
                    h.pop_front();
                }
            }
            let (drop, delay) = {
                let f = faults.lock();
                (rng.random::<f64>() < f.drop_events, f.delay_events)
            };
            if drop {
                continue;
            }
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            live.send(message(live_frames(format.topic(), batch.seq, payload)));
            // No gRPC subscriber is no error.
            let seq = batch.seq;
            let _ = grpc.send(Arc::new((batch, ts)));
            published.store(seq, Ordering::Release);
        }
    });
    Ok(EventSockets { pub_endpoint, replay_endpoint, publisher, live: grpc_live, published_seq })
}
