//! Encoding KV-event messages as the engines do: the inverse of the decoder beside it, for the mock
//! engine and for tests that impersonate an engine. It writes the current map forms
//! (`engine-protocols.md` §3–§5): vLLM ≥ 0.24 with unsigned hashes and the `kv-events` topic, SGLang
//! ≥ 0.5.20 with signed hashes and an empty topic.

use rmpv::Value;

use super::END_MARKER_SEQ;
use crate::kv_events::{EngineHash, KvEvent};

/// Which engine's wire format to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFormat {
    /// vLLM ≥ 0.24 map form, unsigned hashes, topic `kv-events`.
    Vllm,
    /// SGLang ≥ 0.5.20 map form, signed hashes, empty topic.
    Sglang,
}

impl WireFormat {
    /// The topic the engine publishes under.
    pub fn topic(self) -> &'static str {
        match self {
            WireFormat::Vllm => "kv-events",
            WireFormat::Sglang => "",
        }
    }

    fn hash(self, h: EngineHash) -> Value {
        match self {
            WireFormat::Vllm => Value::from(h.0),
            // SGLang hashes are Python ints from a signed 64-bit digest.
            WireFormat::Sglang => Value::from(h.0 as i64),
        }
    }

    fn hashes(self, hashes: &[EngineHash]) -> Value {
        Value::Array(hashes.iter().map(|h| self.hash(*h)).collect())
    }
}

fn entry(key: &str, value: Value) -> (Value, Value) {
    (Value::from(key), value)
}

fn event(format: WireFormat, event: &KvEvent) -> Value {
    let vllm = format == WireFormat::Vllm;
    match event {
        KvEvent::BlockStored(s) => {
            let mut m = vec![
                entry("type", Value::from("BlockStored")),
                entry("block_hashes", format.hashes(&s.block_hashes)),
                entry("parent_block_hash", s.parent_block_hash.map_or(Value::Nil, |h| format.hash(h))),
                entry("token_ids", Value::Array(s.token_ids.iter().map(|t| Value::from(*t)).collect())),
                entry("block_size", Value::from(s.block_size)),
                entry("lora_id", Value::Nil),
            ];
            if vllm {
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
                entry("block_hashes", format.hashes(&r.block_hashes)),
                entry("medium", Value::from("GPU")),
            ];
            if vllm {
                m.push(entry("group_idx", Value::from(0u8)));
            }
            Value::Map(m)
        }
        KvEvent::AllBlocksCleared => Value::Map(vec![entry("type", Value::from("AllBlocksCleared"))]),
    }
}

/// The msgpack payload of a batch: `[ts, events, dp_rank]`, `ts` in seconds since the Unix epoch.
pub fn encode_payload(format: WireFormat, ts: f64, events: &[KvEvent], dp_rank: Option<u32>) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(|e| event(format, e)).collect()),
        dp_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec has no I/O to fail.
    let _ = rmpv::encode::write_value(&mut out, &batch);
    out
}

/// A live message as a PUB sends it: `[topic, seq, payload]`.
pub fn live_frames(topic: &str, seq: u64, payload: Vec<u8>) -> [Vec<u8>; 3] {
    [topic.as_bytes().to_vec(), seq.to_be_bytes().to_vec(), payload]
}

/// One replayed batch as a replay ROUTER answers a DEALER (the newer layout, without the routing
/// identity the ROUTER prepends): `["", topic, seq, payload]`.
pub fn replay_frames(topic: &str, seq: u64, payload: Vec<u8>) -> [Vec<u8>; 4] {
    [Vec::new(), topic.as_bytes().to_vec(), seq.to_be_bytes().to_vec(), payload]
}

/// The message that ends a replay: `["", "", END_MARKER_SEQ, ""]`.
pub fn replay_end_frames() -> [Vec<u8>; 4] {
    [Vec::new(), Vec::new(), END_MARKER_SEQ.to_be_bytes().to_vec(), Vec::new()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::{BlockRemoved, BlockStored};
    use crate::kv_wire::{decode_live, decode_payload, decode_replay, ReplayMessage};

    fn sample() -> Vec<KvEvent> {
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(u64::MAX - 1), EngineHash(7)],
                parent_block_hash: Some(EngineHash(1 << 63)),
                token_ids: (0..32).collect(),
                block_size: 16,
                ..BlockStored::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![EngineHash(7)], ..BlockRemoved::default() }),
            KvEvent::AllBlocksCleared,
        ]
    }

    #[test]
    fn both_formats_decode_back_to_the_same_events() {
        for format in [WireFormat::Vllm, WireFormat::Sglang] {
            let decoded = decode_payload(&encode_payload(format, 1.5, &sample(), Some(2))).unwrap();
            assert!(decoded.skipped.is_empty(), "{format:?}: {:?}", decoded.skipped);
            assert_eq!(decoded.batch.events.len(), 3);
            let KvEvent::BlockStored(s) = &decoded.batch.events[0] else { panic!("{format:?}") };
            assert_eq!(s.block_hashes, vec![EngineHash(u64::MAX - 1), EngineHash(7)]);
            assert_eq!(s.parent_block_hash, Some(EngineHash(1 << 63)));
            assert_eq!(s.token_ids, (0..32).collect::<Vec<u32>>());
            assert_eq!((decoded.batch.ts, decoded.batch.dp_rank), (1.5, Some(2)));
        }
    }

    #[test]
    fn frames_decode_as_live_and_replay_messages() {
        let payload = encode_payload(WireFormat::Vllm, 1.0, &sample(), None);
        let live = decode_live(&live_frames("kv-events", 9, payload.clone())).unwrap();
        assert_eq!((live.topic.as_str(), live.seq, live.batch.batch.events.len()), ("kv-events", 9, 3));
        let ReplayMessage::Batch { seq, .. } = decode_replay(&replay_frames("kv-events", 9, payload)).unwrap() else {
            panic!("a batch")
        };
        assert_eq!(seq, 9);
        assert_eq!(decode_replay(&replay_end_frames()).unwrap(), ReplayMessage::End);
    }
}
