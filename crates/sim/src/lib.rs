//! kvgate's deterministic discrete-event simulator.
//!
//! Layout and flow:
//! - [`workload`]: scenarios (`hot-prefix-51`, `multi-prefix`, `agentic`) and trace replays (Mooncake, Azure).
//! - [`queue`]: the event queue, ordered by `(time, sequence number)`.
//! - [`sim`]: the loop. Arrivals go to the policy, then (after admission) to an engine
//!   ([`kvgate_engine_model`]); engine steps produce first tokens, completions and KV-event batches;
//!   batches reach the router through a modelled delivery path (delay, loss, reordering, gaps with
//!   replay, restarts) handled by the core's [`kvgate_core::kv_stream`] tracker; load reaches it
//!   through periodic polls.
//! - [`policy`]: kvgate's core `Router` and the peer baselines behind one trait.
//! - [`faults`]: KV-event delay and loss, disconnects, restarts, stale telemetry.
//! - [`report`]: metrics, the JSON report and the comparison table; [`plot`]: SVG charts;
//!   [`matrix`]: scenarios × seeds × policies with means and 95% intervals.
//!
//! No wall clock and no thread RNG: a run is a function of its workload, configuration and seed.

#![forbid(unsafe_code)]

pub mod bus;
pub mod faults;
pub mod matrix;
pub mod plot;
pub mod policy;
pub mod queue;
pub mod report;
pub mod sim;
pub mod workload;

pub use report::Report;
pub use sim::{SimConfig, Simulation};

/// Errors of simulator set-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A bad setting.
    #[error("{0}")]
    Config(String),
    /// A trace file could not be read or parsed.
    #[error("trace: {0}")]
    Trace(String),
}

/// Runs `workload` under `cfg`.
pub fn run(workload: &workload::Workload, cfg: SimConfig) -> Result<Report, SimError> {
    Ok(Simulation::new(workload, cfg)?.run())
}
