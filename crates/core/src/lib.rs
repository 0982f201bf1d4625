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
//! - [`ids`], [`time`]: newtype ids and the caller-supplied logical clock. [`knob`], [`policy_name`]:
//!   tunable numbers with their bounds, and the names of the policies and their modes.
//! - [`hashing`]: the router's own chained block keys (XXH3-64).
//! - [`index`]: the KV index built from exact `BlockStored`/`BlockRemoved`/`AllBlocksCleared` events.
//! - [`load`], [`ledger`]: engine load reports, throughput estimates, and the reservation ledger
//!   that reconciles with them without double counting; [`step_cadence`]: the prefill rate an
//!   engine shows in the timing of its own KV event batches.
//! - [`policy`]: `least_load`, `projected` (with the KV barrier, the hard escape and copies of hot
//!   prefixes) and the `cache_aware` baseline; knobs with their bounds. [`prefix_demand`]: how
//!   often each cached prefix is asked for, which the copies are weighed with.
//! - [`decision`]: decision records and reasons.
//! - [`router`]: the object that ties them together behind one lock per concern.
//! - [`replicas`]: reservations shared between gateway replicas, scored like the router's own (the
//!   router applies them); [`outbox`]: when a replica publishes its changes (reservations at once,
//!   the rest batched).
//!
//! Modules depend only downward (ids and time at the bottom, then decision records, policies,
//! the fleet, and the router on top); `crates/kvgate/tests/module_layers.rs` checks it.
//!
//! Time enters as [`Timestamp`] arguments and randomness as an RNG argument, so the gateway, the
//! simulator and the tests run exactly this code.
//!
//! ```
//! use kvgate_core::*;
//! use kvgate_protocol::{BlockStored, EngineHash, KvEvent};
//! use rand::SeedableRng;
//!
//! let router = Router::new(4, PolicyConfig::projected(Mode::Enforce)).unwrap();
//! for name in ["a", "b"] {
//!     router.add_worker(WorkerConfig::new(name), KvState::Synced).unwrap();
//!     router.update_load(&WorkerId::new(name), LoadSnapshot::default()).unwrap();
//! }
//! // Worker "b" reports that it cached the first two blocks of the prompt.
//! let prompt: Vec<u32> = (0..10).collect();
//! let stored = KvEvent::BlockStored(BlockStored {
//!     block_hashes: vec![EngineHash(11), EngineHash(12)],
//!     token_ids: prompt[..8].to_vec(),
//!     block_size: 4,
//!     ..BlockStored::default()
//! });
//! router.apply_kv_events(&WorkerId::new("b"), &[stored], Timestamp::ZERO).unwrap();
//!
//! let keys = router.request_keys(Namespace::DEFAULT, &prompt);
//! let request = RouteRequest { id: RequestId(1), keys: &keys, prompt_tokens: 10, max_tokens: 32, exclude: &[], keys_cover_prompt: true };
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
//! let decision = router.decide(&request, Timestamp::ZERO, &mut rng).unwrap();
//! assert_eq!(decision.worker.as_str(), "b");
//! assert_eq!(decision.cached_tokens, 8);
//! assert_eq!(decision.reason, Reason::CacheAndLoad);
//! // The work is reserved on "b" until the request's first token and release.
//! router.first_token(RequestId(1), Timestamp::from_millis(40)).unwrap();
//! router.release(RequestId(1), Timestamp::from_millis(900)).unwrap();
//! ```

#![forbid(unsafe_code)]

pub mod concurrent_peers;
pub mod decision;
mod decode_cadence;
pub mod error;
mod fleet;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod knob;
pub mod kv_stream;
pub mod ledger;
pub mod load;
pub mod outbox;
mod pending_prefix;
pub mod policy;
pub mod policy_name;
pub mod prefix_demand;
pub mod replicas;
pub mod router;
pub mod step_cadence;
pub mod telemetry;
pub mod time;

pub use concurrent_peers::{stagger_delay, ConcurrentPeers};
pub use decision::{Decision, FallbackReason, Reason, ScoreTerms};
pub use error::CoreError;
pub use fleet::{
    DecodeTiming, WorkerConfig, WorkerStatus, CHUNK_TOKENS, DECODE_TOKENS_PER_S, KV_CAPACITY_TOKENS,
    MAX_RUNNING_REQUESTS, PREFILL_TOKENS_PER_S,
};
pub use hashing::{BlockHasher, Namespace};
pub use ids::{BlockKey, ReplicaId, RequestId, WorkerId, WorkerSlot};
pub use index::{ApplyStats, KvIndex, KvState};
pub use load::{CountEstimate, LoadSnapshot};
pub use outbox::{BatchWindows, Outbox, OutboxWake};
pub use policy::{Mode, PolicyConfig, PolicyName, PolicyPatch};
pub use replicas::{HeldReservation, PeerApply, PeerStatus, ReservationChange};
pub use router::{DecideError, RateKind, RouteRequest, Router, BLOCK_SIZE};
pub use time::Timestamp;
