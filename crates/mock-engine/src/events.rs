//! KV events on the wire: a ZMQ PUB with `[topic, seq, payload]` frames and a replay ROUTER answering
//! `["", start_seq]` with the newer four-frame layout and the end marker, in vLLM's current map format
//! or SGLang's (signed hashes). Faults drop or delay live batches; replays still have them.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use kvgate_engine_model::EventBatch;
use kvgate_protocol::KvEvent;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rmpv::Value;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::Faults;

/// Batches kept for replay (the engines' default `buffer_steps`).
pub const REPLAY_BUFFER: usize = 10_000;

/// Which engine's wire format to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventFormat {
    /// vLLM ≥ 0.24 map form, unsigned hashes, topic `kv-events`.
    Vllm,
    /// SGLang ≥ 0.5.20 map form, signed hashes, empty topic.
    Sglang,
}

impl EventFormat {
    /// The topic the engine publishes under.
    pub fn topic(self) -> &'static str {
        match self {
            EventFormat::Vllm => "kv-events",
            EventFormat::Sglang => "",
        }
    }
}

fn hash(format: EventFormat, h: u64) -> Value {
    match format {
        EventFormat::Vllm => Value::from(h),
        EventFormat::Sglang => Value::from(h as i64),
    }
}

fn entry(k: &str, v: Value) -> (Value, Value) {
    (Value::from(k), v)
}

/// The msgpack payload of a batch.
pub fn encode(format: EventFormat, batch: &EventBatch, ts: f64) -> Vec<u8> {
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored(s) => {
                let mut m = vec![
                    entry("type", Value::from("BlockStored")),
                    entry("block_hashes", Value::Array(s.block_hashes.iter().map(|h| hash(format, h.0)).collect())),
                    entry("parent_block_hash", s.parent_block_hash.map_or(Value::Nil, |h| hash(format, h.0))),
                    entry("token_ids", Value::Array(s.token_ids.iter().map(|t| Value::from(*t)).collect())),
                    entry("block_size", Value::from(s.block_size)),
                    entry("lora_id", Value::Nil),
                ];
                if format == EventFormat::Vllm {
                    // As vLLM 0.32 sends them: one (empty) extra-keys entry per block, and the KV group.
                    m.push(entry("medium", Value::from("GPU")));
                    m.push(entry("lora_name", Value::Nil));
                    m.push(entry("extra_keys", Value::Array(vec![Value::Nil; s.block_hashes.len()])));
                    m.push(entry("group_idx", Value::from(0u8)));
                    m.push(entry("kv_cache_spec_kind", Value::from("full_attention")));
                }
                Value::Map(m)
            }
            KvEvent::BlockRemoved(r) => {
                let mut m = vec![
                    entry("type", Value::from("BlockRemoved")),
                    entry("block_hashes", Value::Array(r.block_hashes.iter().map(|h| hash(format, h.0)).collect())),
                    entry("medium", Value::from("GPU")),
                ];
                if format == EventFormat::Vllm {
                    m.push(entry("group_idx", Value::from(0u8)));
                }
                Value::Map(m)
            }
            KvEvent::AllBlocksCleared => Value::Map(vec![entry("type", Value::from("AllBlocksCleared"))]),
        })
        .collect();
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::F64(ts), Value::Array(events), Value::from(0u8)]))
        .expect("writing to a Vec cannot fail");
    out
}

type History = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// Binds the PUB and replay sockets; returns their endpoints and the task that publishes batches.
pub async fn start(
    host: &str,
    pub_port: u16,
    replay_port: u16,
    format: EventFormat,
    faults: Arc<Mutex<Faults>>,
    mut batches: mpsc::UnboundedReceiver<EventBatch>,
    clock: kvgate_clock::Clock,
) -> Result<(String, String), zeromq::ZmqError> {
    let mut publisher = zeromq::PubSocket::new();
    let pub_endpoint = publisher.bind(&format!("tcp://{host}:{pub_port}")).await?.to_string();
    let mut router = zeromq::RouterSocket::new();
    let replay_endpoint = router.bind(&format!("tcp://{host}:{replay_port}")).await?.to_string();
    let history: History = Arc::default();
    let h = history.clone();
    tokio::spawn(async move {
        while let Ok(req) = router.recv().await {
            let frames = req.into_vec();
            let start = frames.get(2).and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()).map(u64::from_be_bytes);
            let (Some(id), Some(start)) = (frames.first().cloned(), start) else { continue };
            let replay: Vec<(u64, Vec<u8>)> = h.lock().iter().filter(|(s, _)| *s >= start).cloned().collect();
            for (seq, payload) in replay {
                let m = vec![
                    id.clone(),
                    Bytes::new(),
                    Bytes::from(format.topic()),
                    Bytes::from(seq.to_be_bytes().to_vec()),
                    Bytes::from(payload),
                ];
                if router.send(ZmqMessage::try_from(m).expect("non-empty")).await.is_err() {
                    break;
                }
            }
            let end = vec![id, Bytes::new(), Bytes::new(), Bytes::from(vec![0xff; 8]), Bytes::new()];
            let _ = router.send(ZmqMessage::try_from(end).expect("non-empty")).await;
        }
    });
    tokio::spawn(async move {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6b76);
        while let Some(batch) = batches.recv().await {
            let payload = encode(format, &batch, clock.now().as_micros() as f64 / 1e6);
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
            let m =
                vec![Bytes::from(format.topic()), Bytes::from(batch.seq.to_be_bytes().to_vec()), Bytes::from(payload)];
            if publisher.send(ZmqMessage::try_from(m).expect("non-empty")).await.is_err() {
                tracing::warn!("KV event publisher failed");
            }
        }
    });
    Ok((pub_endpoint, replay_endpoint))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_protocol::kv_wire::decode_payload;
    use kvgate_protocol::{BlockRemoved, BlockStored, EngineHash};

    #[test]
    fn both_formats_decode_back_to_the_same_events() {
        let batch = EventBatch {
            seq: 3,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![EngineHash(u64::MAX - 1), EngineHash(7)],
                    parent_block_hash: Some(EngineHash(1 << 63)),
                    token_ids: (0..32).collect(),
                    block_size: 16,
                    ..BlockStored::default()
                }),
                KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![EngineHash(7)], ..BlockRemoved::default() }),
                KvEvent::AllBlocksCleared,
            ],
        };
        for format in [EventFormat::Vllm, EventFormat::Sglang] {
            let decoded = decode_payload(&encode(format, &batch, 1.0)).unwrap();
            assert!(decoded.skipped.is_empty());
            let KvEvent::BlockStored(s) = &decoded.batch.events[0] else { panic!() };
            assert_eq!(s.block_hashes, vec![EngineHash(u64::MAX - 1), EngineHash(7)]);
            assert_eq!(s.parent_block_hash, Some(EngineHash(1 << 63)));
            assert_eq!(decoded.batch.events.len(), 3);
        }
    }
}
