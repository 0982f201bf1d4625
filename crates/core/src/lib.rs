//! kvgate's routing core: a synchronous library with no I/O and no clock of its own.
//!
//! Layout and flow:
//!
//! ```text
//! KV events ──► index (router keys from token ids, per-worker state) ─┐
//! load reports ──► fleet (snapshot + reservation ledger + throughput) ─┼─► policy ─► Decision
//! request tokens ──► hashing (chained block keys) ─────────────────────┘      │
//!                                                        router: decide + reserve, atomically
//! ```
//!
//! - [`ids`], [`time`]: newtype ids and the caller-supplied logical clock.
//! - [`hashing`]: the router's own chained block keys (XXH3-64).
//! - [`index`]: the KV index built from exact `BlockStored`/`BlockRemoved`/`AllBlocksCleared` events.
//! - [`load`], [`ledger`]: engine load reports, throughput estimates, and the reservation ledger
//!   that reconciles with them without double counting.
//! - [`policy`]: `least_load`, `projected` (with the KV barrier and the hard escape) and the
//!   `cache_aware` baseline; knobs with their bounds.
//! - [`decision`]: decision records and reasons.
//! - [`router`]: the object that ties them together behind one lock per concern.
//!
//! Time enters as [`Timestamp`] arguments and randomness as an RNG argument, so the gateway, the
//! simulator and the tests run exactly this code.

#![forbid(unsafe_code)]

pub mod decision;
pub mod error;
mod fleet;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod ledger;
pub mod load;
pub mod policy;
pub mod router;
pub mod time;

pub use decision::{Decision, FallbackReason, Reason, ScoreTerms};
pub use error::CoreError;
pub use fleet::{
    WorkerConfig, WorkerStatus, DECODE_TOKENS_PER_S, KV_CAPACITY_TOKENS, PREFILL_TOKENS_PER_S,
};
pub use hashing::{BlockHasher, Namespace};
pub use ids::{BlockKey, RequestId, WorkerId, WorkerSlot};
pub use index::{ApplyStats, KvIndex, KvState};
pub use load::LoadSnapshot;
pub use policy::{Mode, PolicyConfig, PolicyName};
pub use router::{DecideError, RouteRequest, Router, BLOCK_SIZE};
pub use time::Timestamp;
