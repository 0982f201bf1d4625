//! Decoding KV-event messages as vLLM and SGLang publish them (`engine-protocols.md` §2–§5, §9).
//!
//! Leniency follows §9: both event forms, any container or integer width, unknown map keys skipped,
//! missing keys and trailing array elements taken as nil, extra trailing elements ignored, unknown
//! event tags skipped and counted. An event is dropped (and counted) only when its `block_hashes` is
//! not an array, a `BlockStored` has no `block_size`, or an indexed store's token count is not
//! `block_size × len(block_hashes)`. A message whose frames or batch can't be read at all is an error.

use rmpv::Value;

mod encode;
pub use encode::{encode_payload, live_frames, replay_end_frames, replay_frames, WireFormat};

use crate::kv_events::{is_prefix_group, BlockRemoved, BlockStored, EngineHash, KvEvent, KvEventBatch};

/// The sequence number of a replay's end marker.
pub const END_MARKER_SEQ: u64 = u64::MAX;

/// Why a message could not be decoded at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Wrong number of frames.
    #[error("expected {expected} frames, got {got}")]
    FrameCount {
        /// What the layout needs.
        expected: &'static str,
        /// What arrived.
        got: usize,
    },
    /// The sequence frame is not 8 bytes.
    #[error("the sequence frame has {0} bytes, not 8")]
    SeqFrame(usize),
    /// The topic is not UTF-8.
    #[error("the topic frame is not UTF-8")]
    Topic,
    /// The payload is not msgpack, or not a batch.
    #[error("undecodable payload: {0}")]
    Payload(String),
}

/// An event the decoder skipped or dropped, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skipped {
    /// An event class the decoder does not know (a newer engine).
    UnknownTag(String),
    /// An event that was neither an array nor a map, or had no tag.
    Malformed(String),
    /// A known event that broke a rule of §9 (details in the string).
    Dropped(String),
}

/// A decoded batch and what was skipped in it.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The batch.
    pub batch: KvEventBatch,
    /// Events skipped or dropped.
    pub skipped: Vec<Skipped>,
}

/// One live message from a SUB socket.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveMessage {
    /// Topic (may be empty).
    pub topic: String,
    /// Sequence number.
    pub seq: u64,
    /// The payload.
    pub batch: DecodedBatch,
}

/// One message of a replay reply, as a DEALER sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayMessage {
    /// A replayed batch (byte-identical to the live one).
    Batch {
        /// Topic, in the newer layout (`None` in the old one).
        topic: Option<String>,
        /// Sequence number.
        seq: u64,
        /// The payload.
        batch: DecodedBatch,
    },
    /// The end marker: no more batches.
    End,
}

fn seq_of(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| DecodeError::SeqFrame(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

fn topic_of(frame: &[u8]) -> Result<String, DecodeError> {
    String::from_utf8(frame.to_vec()).map_err(|_| DecodeError::Topic)
}

/// Decodes a live PUB message `[topic, seq, payload]`.
pub fn decode_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<LiveMessage, DecodeError> {
    if frames.len() != 3 {
        return Err(DecodeError::FrameCount { expected: "3 ([topic, seq, payload])", got: frames.len() });
    }
    Ok(LiveMessage {
        topic: topic_of(frames[0].as_ref())?,
        seq: seq_of(frames[1].as_ref())?,
        batch: decode_payload(frames[2].as_ref())?,
    })
}

/// Decodes one replay reply message. The layout is told apart by frame count, never by contents:
/// `["", seq, payload]` (vLLM ≤ 0.25, SGLang ≤ 0.5.21) or `["", topic, seq, payload]` (newer).
pub fn decode_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayMessage, DecodeError> {
    let (topic, seq, payload) = match frames {
        [_, seq, payload] => (None, seq.as_ref(), payload.as_ref()),
        [_, topic, seq, payload] => (Some(topic_of(topic.as_ref())?), seq.as_ref(), payload.as_ref()),
        other => return Err(DecodeError::FrameCount { expected: "3 or 4 (replay layouts)", got: other.len() }),
    };
    let seq = seq_of(seq)?;
    if seq == END_MARKER_SEQ && payload.is_empty() {
        return Ok(ReplayMessage::End);
    }
    Ok(ReplayMessage::Batch { topic, seq, batch: decode_payload(payload)? })
}

/// The replay request a DEALER sends: `["", start_seq]`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// Decodes a batch payload `[ts, events, dp_rank?, ...]`.
pub fn decode_payload(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value(&mut reader).map_err(|e| DecodeError::Payload(e.to_string()))?;
    let Value::Array(items) = value else {
        return Err(DecodeError::Payload("the batch is not an array".into()));
    };
    if items.len() < 2 {
        return Err(DecodeError::Payload(format!("the batch has {} elements, expected at least 2", items.len())));
    }
    let ts = match &items[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        Value::Integer(i) => i.as_f64().unwrap_or(0.0),
        other => return Err(DecodeError::Payload(format!("the batch timestamp is {other}, not a number"))),
    };
    let Value::Array(raw_events) = &items[1] else {
        return Err(DecodeError::Payload("the batch's events are not an array".into()));
    };
    let dp_rank = items.get(2).and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok());
    let mut events = Vec::with_capacity(raw_events.len());
    let mut skipped = Vec::new();
    for raw in raw_events {
        match decode_event(raw) {
            Ok(ev) => events.push(ev),
            Err(s) => skipped.push(s),
        }
    }
    Ok(DecodedBatch { batch: KvEventBatch { ts, events, dp_rank }, skipped })
}

/// Field access over both event forms.
enum Fields<'a> {
    Array(&'a [Value]),
    Map(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    fn get(&self, pos: usize, key: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Array(a) => a.get(pos),
            Fields::Map(m) => m.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
        };
        v.filter(|v| !v.is_nil())
    }

    fn string(&self, pos: usize, key: &str) -> Option<String> {
        self.get(pos, key).and_then(Value::as_str).map(str::to_owned)
    }

    fn u32(&self, pos: usize, key: &str) -> Option<u32> {
        self.get(pos, key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok())
    }
}

/// An engine hash from any integer width (bit pattern kept) or bytes (last 8, big-endian).
pub fn normalise_hash(v: &Value) -> Option<EngineHash> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)).map(EngineHash),
        Value::Binary(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut bytes = [0u8; 8];
            bytes[8 - tail.len()..].copy_from_slice(tail);
            Some(EngineHash(u64::from_be_bytes(bytes)))
        }
        _ => None,
    }
}

fn hashes(f: &Fields<'_>) -> Result<Vec<EngineHash>, Skipped> {
    let Some(Value::Array(list)) = f.get(1, "block_hashes") else {
        return Err(Skipped::Dropped("block_hashes is not an array".into()));
    };
    list.iter()
        .map(|h| {
            normalise_hash(h).ok_or_else(|| Skipped::Dropped(format!("block hash {h} is not an integer or bytes")))
        })
        .collect()
}

/// A token id; EAGLE bigram mode sends pairs, whose first element is the token.
fn token(v: &Value) -> Option<u32> {
    match v {
        Value::Integer(i) => i.as_u64().and_then(|t| u32::try_from(t).ok()),
        Value::Array(pair) => pair.first().and_then(token),
        _ => None,
    }
}

fn decode_event(raw: &Value) -> Result<KvEvent, Skipped> {
    let (tag, fields) = match raw {
        Value::Array(a) => (a.first().and_then(Value::as_str), Fields::Array(a)),
        Value::Map(m) => {
            (m.iter().find(|(k, _)| k.as_str() == Some("type")).and_then(|(_, v)| v.as_str()), Fields::Map(m))
        }
        other => return Err(Skipped::Malformed(format!("an event is {other}, neither an array nor a map"))),
    };
    let Some(tag) = tag else { return Err(Skipped::Malformed("an event has no tag".into())) };
    match tag {
        "BlockStored" => {
            let block_hashes = hashes(&fields)?;
            let block_size =
                fields.u32(4, "block_size").ok_or_else(|| Skipped::Dropped("BlockStored without block_size".into()))?;
            let token_ids = match fields.get(3, "token_ids") {
                Some(Value::Array(ts)) => ts
                    .iter()
                    .map(token)
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| Skipped::Dropped("a token id is not a u32 or a pair".into()))?,
                _ => Vec::new(),
            };
            // SGLang 0.5.18–0.5.19 put `{"cache_salt": ...}` at position 7, where vLLM has `lora_name`.
            let (lora_name, salt_from_metadata) = match &fields {
                Fields::Array(a) => match a.get(7) {
                    Some(Value::Map(meta)) => (
                        None,
                        meta.iter()
                            .find(|(k, _)| k.as_str() == Some("cache_salt"))
                            .and_then(|(_, v)| v.as_str())
                            .map(str::to_owned),
                    ),
                    Some(Value::String(s)) => (s.as_str().map(str::to_owned), None),
                    _ => (None, None),
                },
                Fields::Map(_) => (fields.string(usize::MAX, "lora_name"), None),
            };
            let ev = BlockStored {
                parent_block_hash: fields.get(2, "parent_block_hash").and_then(normalise_hash),
                medium: fields.string(6, "medium"),
                lora_name,
                cache_salt: fields.string(usize::MAX, "cache_salt").or(salt_from_metadata),
                group_idx: fields.u32(9, "group_idx"),
                kv_cache_spec_kind: fields.string(10, "kv_cache_spec_kind"),
                block_hashes,
                token_ids,
                block_size,
            };
            let indexed = is_prefix_group(ev.group_idx, ev.kv_cache_spec_kind.as_deref());
            if indexed && ev.token_ids.len() != ev.block_size as usize * ev.block_hashes.len() {
                return Err(Skipped::Dropped(format!(
                    "BlockStored has {} tokens for {} blocks of {}",
                    ev.token_ids.len(),
                    ev.block_hashes.len(),
                    ev.block_size
                )));
            }
            Ok(KvEvent::BlockStored(ev))
        }
        "BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(&fields)?,
            medium: fields.string(2, "medium"),
            group_idx: fields.u32(3, "group_idx"),
        })),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(Skipped::UnknownTag(other.to_owned())),
    }
}

#[cfg(test)]
mod tests;
