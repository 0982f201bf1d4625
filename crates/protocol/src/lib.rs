//! Wire-level types that kvgate's crates share.
//!
//! Layout:
//! - [`kv_events`]: the decoded form of the KV-cache events that vLLM and SGLang publish
//!   (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), as described in
//!   `shared/docs/engine-protocols.md` §3–§5; the routing core only ever sees the decoded values.
//! - [`kv_wire`]: the byte-level decoder for those events: ZMQ frames `[topic, seq, payload]`, replay
//!   replies in both layouts, the msgpack batch, array and map event forms of every vLLM and SGLang
//!   version in `engine-protocols.md`, hashes of any integer width or as bytes; and beside it the
//!   encoder that writes the current forms, for the mock engine and for tests.
//! - [`telemetry`]: engine load reports: SGLang `GET /v1/loads` and the Prometheus `/metrics` text
//!   of vLLM and SGLang (`engine-protocols.md` §10), parsed into one engine-neutral shape, with what
//!   the engine says about itself (block size, KV capacity, process start time).
//! - [`prometheus`]: the text exposition format's sample lines, labels included.
//!
//! Nothing in this crate performs I/O or reads a clock.

#![forbid(unsafe_code)]

pub mod kv_events;
pub mod kv_wire;
pub mod prometheus;
pub mod telemetry;

pub use kv_events::{
    is_accelerator_medium, is_prefix_group, BlockRemoved, BlockStored, EngineHash, KvEvent, KvEventBatch,
};
