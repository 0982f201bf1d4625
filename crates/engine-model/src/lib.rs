//! A continuous-batching LLM engine model, stepped by a clock its caller owns.
//!
//! Layout:
//! - [`profile`]: the step-time model `t = a + b·n + c·K/1000 + C/R` and capacities, with the two
//!   documented profiles (`shared/docs/engine-model.md` §4).
//! - `cache`: the paged KV cache with prefix reuse and LRU eviction of unreferenced blocks.
//! - [`engine`]: FCFS queue, chunked prefill within a token budget, decode steps, a batch bounded by
//!   KV capacity (vLLM flavour: blocks allocated step by step and the newest request preempted when
//!   none is left, as vLLM's v1 scheduler does; SGLang flavour: a request reserves its prompt and
//!   whole output at admission), KV events with per-process sequence numbers and a replay buffer,
//!   and load telemetry as SGLang and vLLM report it.
//!
//! The simulator drives it in logical time; the mock engine will drive it in real time.

#![forbid(unsafe_code)]

mod cache;
pub mod engine;
pub mod profile;

pub use engine::{Engine, EngineRequest, EventBatch, Finished, StepOutcome};
pub use profile::{EngineProfile, Flavor, HostDelay};

#[cfg(test)]
mod tests;
