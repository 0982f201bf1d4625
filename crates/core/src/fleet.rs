//! Per-worker state the router keeps: configuration, throughput estimates, the latest load report,
//! the reservation ledger and health. All of it sits behind the router's one fleet lock.

use std::time::Duration;

use rustc_hash::FxHashMap;
use serde::Serialize;
use smallvec::SmallVec;

use crate::decision::FallbackReason;
use crate::decode_cadence::DecodeCadence;
use crate::error::CoreError;
use crate::ids::{BlockKey, RequestId, WorkerId, WorkerSlot};
use crate::index::StoredRun;
use crate::ledger::{LoadDelta, WorkerLedger};
use crate::load::{bounded_rate, DecodeRate, LoadSnapshot, Throughput};
use crate::policy::projected::WorkerLoad;
use crate::policy::Knob;
use crate::step_cadence::StepCadence;
use crate::time::Timestamp;

/// Bounds of a worker's configured prefill throughput.
pub const PREFILL_TOKENS_PER_S: Knob = Knob {
    name: "prefill_tokens_per_s",
    min: 1.0,
    max: 1e9,
    default: 20_000.0,
    meaning: "configured prefill throughput of one worker, new tokens per second (profile A: a large MoE on one 8×H200 engine)",
};
/// Bounds of a worker's configured decode throughput.
pub const DECODE_TOKENS_PER_S: Knob = Knob {
    name: "decode_tokens_per_s",
    min: 1.0,
    max: 1e9,
    default: 2_000.0,
    meaning: "configured aggregate decode throughput of one worker at a full batch (max_running_requests sequences), tokens per second",
};
/// Bounds of a worker's KV capacity.
pub const KV_CAPACITY_TOKENS: Knob = Knob {
    name: "kv_capacity_tokens",
    min: 1.0,
    max: 1e12,
    default: 500_000.0,
    meaning: "tokens of KV cache one worker holds (profile A: 500k); turns reserved tokens into usage for the barrier",
};

/// Bounds of a worker's running-batch limit.
pub const MAX_RUNNING_REQUESTS: Knob = Knob {
    name: "max_running_requests",
    min: 1.0,
    max: 1e6,
    default: 256.0,
    meaning: "largest running batch of one worker (vLLM --max-num-seqs, SGLang --max-running-requests); past it a new request waits for a slot",
};
/// Bounds of a worker's step token budget.
pub const CHUNK_TOKENS: Knob = Knob {
    name: "chunk_tokens",
    min: 1.0,
    max: 1e9,
    default: 8192.0,
    meaning: "tokens one engine step computes (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size); a prefill takes one step per chunk, and every step carries the running batch",
};

/// A worker as configured.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// The worker's name.
    pub id: WorkerId,
    /// See [`PREFILL_TOKENS_PER_S`].
    pub prefill_tokens_per_s: f64,
    /// See [`DECODE_TOKENS_PER_S`].
    pub decode_tokens_per_s: f64,
    /// See [`KV_CAPACITY_TOKENS`].
    pub kv_capacity_tokens: u64,
    /// See [`MAX_RUNNING_REQUESTS`].
    pub max_running_requests: u64,
    /// See [`CHUNK_TOKENS`].
    pub chunk_tokens: u64,
}

impl WorkerConfig {
    /// A worker with default throughputs and capacity.
    pub fn new(id: impl Into<WorkerId>) -> Self {
        WorkerConfig {
            id: id.into(),
            prefill_tokens_per_s: PREFILL_TOKENS_PER_S.default,
            decode_tokens_per_s: DECODE_TOKENS_PER_S.default,
            kv_capacity_tokens: KV_CAPACITY_TOKENS.default as u64,
            max_running_requests: MAX_RUNNING_REQUESTS.default as u64,
            chunk_tokens: CHUNK_TOKENS.default as u64,
        }
    }

    /// Checks the bounds of every field.
    pub fn validate(&self) -> Result<(), CoreError> {
        PREFILL_TOKENS_PER_S.check(self.prefill_tokens_per_s)?;
        DECODE_TOKENS_PER_S.check(self.decode_tokens_per_s)?;
        KV_CAPACITY_TOKENS.check(self.kv_capacity_tokens as f64)?;
        MAX_RUNNING_REQUESTS.check(self.max_running_requests as f64)?;
        CHUNK_TOKENS.check(self.chunk_tokens as f64)?;
        Ok(())
    }
}

impl From<WorkerId> for WorkerConfig {
    fn from(id: WorkerId) -> Self {
        WorkerConfig::new(id)
    }
}

/// What an operator sees of one worker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkerStatus {
    /// The worker.
    pub id: WorkerId,
    /// Whether decisions may pick it.
    pub eligible: bool,
    /// Its KV state (as last set; KV staleness under traffic is evaluated per decision).
    pub kv_state: crate::index::KvState,
    /// Blocks it holds in the index.
    pub blocks_held: usize,
    /// Reconciled load (latest report plus the ledger).
    pub waiting_requests: u64,
    /// Reconciled queued prefill tokens.
    pub waiting_tokens: u64,
    /// Reconciled running requests.
    pub running_requests: u64,
    /// Reconciled active decode tokens.
    pub decode_tokens: u64,
    /// Reconciled KV usage fraction.
    pub kv_usage: f64,
    /// Age of the latest load report, if any.
    pub load_age_ms: Option<u64>,
    /// Requests this router has in flight on it.
    pub in_flight: u32,
    /// The ledger's adjustment on top of the latest report.
    pub reserved: LoadDelta,
    /// Requests peer replicas have told this router they have in flight on it.
    pub peer_in_flight: u32,
    /// The adjustment for the peers' requests, reconciled with the report the same way.
    pub peer_reserved: LoadDelta,
    /// The configured prefill throughput.
    pub configured_prefill_tokens_per_s: f64,
    /// Effective prefill throughput: what decisions plan with.
    pub prefill_tokens_per_s: f64,
    /// The prefill throughput measured from the engine's step cadence (once there are enough
    /// steps), within the correction bound of the configured one; planned with only when
    /// calibration is on and it is off that by more than the dead band. Measured with calibration
    /// off too, so that an operator can see what it would plan with before turning it on.
    pub measured_prefill_tokens_per_s: Option<f64>,
    /// Whether the engine publishes a step's KV events after the step or before it runs (vLLM's
    /// async scheduling), as the step-cadence fit found; none before a fit.
    pub step_alignment: Option<crate::step_cadence::StepAlignment>,
    /// The configured decode throughput.
    pub configured_decode_tokens_per_s: f64,
    /// Effective decode throughput.
    pub decode_tokens_per_s: f64,
    /// The decode throughput of a full batch measured from the engine's decode-filled blocks or
    /// from streams' inter-token times (see `decode_timing`), within the correction bound of the
    /// configured one, once their batch sizes allow a fit; planned with only when calibration is
    /// on and it is off the configured one by more than the dead band.
    pub measured_decode_tokens_per_s: Option<f64>,
    /// What times the engine's decode steps.
    pub decode_timing: DecodeTiming,
}

/// What times a worker's decode steps for calibration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeTiming {
    /// Streams from their first token to their end, as the gateway sees them: until the engine is
    /// seen publishing decode-filled blocks (SGLang never is).
    Streams,
    /// The blocks the engine fills while decoding, on its own clock (vLLM).
    DecodeFilledBlocks,
}

impl DecodeTiming {
    /// Every timing, in a fixed order.
    pub const ALL: [DecodeTiming; 2] = [DecodeTiming::Streams, DecodeTiming::DecodeFilledBlocks];

    /// The name it serializes as.
    pub fn name(self) -> &'static str {
        match self {
            DecodeTiming::Streams => "streams",
            DecodeTiming::DecodeFilledBlocks => "decode_filled_blocks",
        }
    }
}

#[derive(Debug)]
pub(crate) struct WorkerState {
    pub(crate) config: WorkerConfig,
    pub(crate) prefill: Throughput,
    /// The prefill rate measured from the engine's own step cadence, which takes precedence over
    /// the fit from first tokens once it has enough points.
    pub(crate) steps: StepCadence,
    /// The median prefill rate measured on the fleet's other workers, while this one has no
    /// measurement of its own (see [`WorkerState::prefill_rate`]).
    pub(crate) fleet_measured_prefill: Option<f64>,
    pub(crate) decode: DecodeRate,
    /// The sequences the engine's decode-filled blocks are followed by, to time its decode steps.
    pub(crate) decode_steps: DecodeCadence,
    /// Whether decisions plan with the measured rates (the policy's `calibrate`); they are
    /// measured either way.
    pub(crate) plan_measured: bool,
    /// What each in-flight request of this router was projected to take, to calibrate the rates
    /// against what it really took.
    pub(crate) timings: FxHashMap<RequestId, Timing>,
    pub(crate) eligible: bool,
    pub(crate) snapshot: Option<LoadSnapshot>,
    pub(crate) ledger: WorkerLedger,
    /// Reservations peer replicas shared (`crate::replicas`), under local synthetic request ids.
    pub(crate) peer_ledger: WorkerLedger,
    pub(crate) routed: u64,
    /// The earliest dispatch not yet followed by a KV event: if it is old, events went quiet while
    /// traffic flowed and the worker's KV view is stale.
    pub(crate) unanswered_dispatch_since: Option<Timestamp>,
    /// The block keys of this router's requests in flight here, so that the KV a prompt shares with
    /// them is counted once ([`crate::pending_prefix`]).
    pub(crate) pending: crate::pending_prefix::PendingPrefixes,
}

/// How far (as a fraction) a measured rate may be off the configured one and still leave the
/// configured one in use. Measurements of identical engines scatter by about this much, and
/// identical engines planned at slightly different rates are no longer tied: the one measured
/// fastest would win every close call (on the simulator's multi-prefix run that cost 4–8% of TTFT
/// p90 with rates within ±10% of the truth). Calibration is for engines configured wrong.
pub const CALIBRATION_DEAD_BAND: f64 = 0.5;

/// When one in-flight request's first token came, and the running batch then: the start of the
/// inter-token times that calibrate the decode rate.
#[derive(Debug, Clone)]
pub(crate) struct Timing {
    /// When, the running batch then, and the prompt tokens the engine had computed by then.
    first_token: Option<(Timestamp, u64, u64)>,
    /// When the request was dispatched: a step that stored one of `prompt` may have computed it,
    /// and then started after that.
    dispatched: Timestamp,
    /// The prompt's block keys the engine may compute (see [`crate::router`]'s evicted-block margin).
    prompt: Box<[BlockKey]>,
}

impl Timing {
    /// A request dispatched at `at` with a prompt of block keys `keys`.
    pub(crate) fn dispatched(keys: &[BlockKey], at: Timestamp) -> Self {
        Timing { first_token: None, dispatched: at, prompt: keys.into() }
    }
}

/// `measured` when it is off `configured` by more than [`CALIBRATION_DEAD_BAND`], else `configured`.
fn outside_dead_band(configured: f64, measured: f64) -> f64 {
    let off_by = (measured / configured).max(configured / measured);
    if off_by > 1.0 + CALIBRATION_DEAD_BAND {
        measured
    } else {
        configured
    }
}

fn add_signed(base: u64, delta: i64) -> u64 {
    (base as i64).saturating_add(delta).max(0) as u64
}

impl WorkerState {
    pub(crate) fn new(config: WorkerConfig) -> Self {
        WorkerState {
            prefill: Throughput::new(config.prefill_tokens_per_s),
            steps: StepCadence::default(),
            fleet_measured_prefill: None,
            decode: DecodeRate::new(config.decode_tokens_per_s),
            decode_steps: DecodeCadence::default(),
            plan_measured: false,
            timings: FxHashMap::default(),
            config,
            eligible: true,
            snapshot: None,
            ledger: WorkerLedger::default(),
            peer_ledger: WorkerLedger::default(),
            routed: 0,
            unanswered_dispatch_since: None,
            pending: Default::default(),
        }
    }

    /// A request was sent to this worker (by this router or a peer replica) at `now`: if the events
    /// have answered every earlier dispatch, the wait for an answer starts over.
    pub(crate) fn note_dispatch(&mut self, now: Timestamp, last_event_at: Option<Timestamp>) {
        let answered = match (self.unanswered_dispatch_since, last_event_at) {
            (None, _) => true,
            (Some(since), Some(event)) => event >= since,
            (Some(_), None) => false,
        };
        if answered {
            self.unanswered_dispatch_since = Some(now);
        }
    }

    /// The prefill rate the router plans with: the rate measured from the engine's step cadence
    /// when it is off the configured one by more than [`CALIBRATION_DEAD_BAND`]; else the configured
    /// rate (or what [`crate::Router::observe_rate`] made of it).
    ///
    /// A worker not yet measured is assumed at least as fast as the median measured worker (within
    /// the correction bound of its configured rate). Optimism is what gets it measured: a worker
    /// configured too slow would otherwise draw no traffic, publish no steps, and never be found
    /// out. One that really is slower is measured from the traffic that draws.
    pub(crate) fn prefill_rate(&self) -> f64 {
        let configured = self.prefill.effective();
        if !self.plan_measured {
            return configured;
        }
        match (self.measured_prefill_rate(), self.fleet_measured_prefill) {
            (Some(measured), _) => measured,
            (None, Some(fleet)) => configured.max(bounded_rate(configured, Some(1.0 / fleet))),
            (None, None) => configured,
        }
    }

    /// The prefill rate measured from this worker's own step cadence, within the correction bound,
    /// if there is one yet and it is off the configured rate by more than the dead band.
    pub(crate) fn measured_prefill_rate(&self) -> Option<f64> {
        Some(outside_dead_band(self.prefill.effective(), self.step_measured_prefill_rate()?))
    }

    /// The prefill rate the step cadence measured, within the correction bound, dead band or not.
    fn step_measured_prefill_rate(&self) -> Option<f64> {
        Some(bounded_rate(self.prefill.effective(), Some(self.steps.seconds_per_token()?)))
    }

    /// The decode rate the router plans with: with calibration on, the measured one when it is off
    /// the configured one by more than the dead band.
    pub(crate) fn decode_rate(&self) -> f64 {
        match self.measured_decode_rate() {
            Some(measured) if self.plan_measured => outside_dead_band(self.decode.configured(), measured),
            _ => self.decode.configured(),
        }
    }

    /// The decode rate of a full batch measured from inter-token times, dead band or not.
    fn measured_decode_rate(&self) -> Option<f64> {
        self.decode.measured(self.config.max_running_requests)
    }

    /// The latest report plus the ledger's adjustment, clamped at zero.
    pub(crate) fn load(&self) -> WorkerLoad {
        let s = self.snapshot.unwrap_or_default();
        let mut d = self.ledger.delta().plus(self.peer_ledger.delta());
        if let Some(est) = s.estimated {
            // The report counted this router's requests still in prefill as one request each, with
            // an estimate; put back their real prefill work. The first of them sit in the queue
            // (counted at the per-waiting estimate), the rest run (counted as decode).
            let seen = self.ledger.seen_in_prefill().plus(self.peer_ledger.seen_in_prefill());
            let queued = seen.requests.min(s.waiting_requests);
            let estimated_queued = match est.prompt_tokens_per_waiting {
                Some(per) => queued.saturating_mul(per),
                None => seen.tokens.saturating_mul(queued) / seen.requests.max(1),
            };
            d.waiting_tokens += seen.tokens as i64 - estimated_queued as i64;
            d.decode_tokens -= (seen.requests - queued).saturating_mul(est.decode_tokens_per_running) as i64;
        }
        let capacity = self.config.kv_capacity_tokens;
        let reported_kv = (s.kv_usage.clamp(0.0, 1.0) * capacity as f64).round() as u64;
        WorkerLoad {
            waiting_requests: add_signed(s.waiting_requests, d.waiting_requests),
            waiting_tokens: add_signed(s.waiting_tokens, d.waiting_tokens),
            running_requests: add_signed(s.running_requests, d.running_requests),
            decode_tokens: add_signed(s.active_decode_tokens, d.decode_tokens),
            kv_tokens: add_signed(reported_kv, d.kv_tokens),
            kv_capacity_tokens: capacity,
            // The engine's own limit where it reports one: it is what admits or queues. The configured
            // one still names the full batch the decode rate is expressed at.
            max_running_requests: s.max_running_requests.filter(|&m| m > 0).unwrap_or(self.config.max_running_requests),
            chunk_tokens: self.config.chunk_tokens,
            prefill_tps: self.prefill_rate(),
            decode_tps: self.decode_rate(),
        }
    }

    /// Folds in the runs of blocks one live batch stored, `stored_tokens` tokens in all, stamped
    /// `engine_time` (seconds, publisher rank) and received at `now`: the decode-filled blocks
    /// among them time their sequences' decode steps ([`crate::decode_cadence`]). Returns the time
    /// after which the batch's step started, by the dispatch of the prompts it computed.
    ///
    /// Each run of prompt blocks was computed for one of the in-flight requests whose prompts hold
    /// its first block; which one is not known (a shared prefix, or a later chunk of a long
    /// prompt), so each run bounds the step by the earliest of them. A run no in-flight prompt
    /// holds (generated tokens, a peer's request) bounds nothing.
    pub(crate) fn observe_stored_runs(
        &mut self,
        runs: &[StoredRun],
        stored_tokens: u64,
        block_size: u32,
        engine_time: (f64, Option<u32>),
        now: Timestamp,
    ) -> Option<Timestamp> {
        let holders: SmallVec<[Option<Timestamp>; 8]> =
            runs.iter().map(|run| self.earliest_dispatch_holding(run.first)).collect();
        let held: SmallVec<[bool; 8]> = holders.iter().map(Option::is_some).collect();
        let spans = self.decode_steps.observe_batch(runs, &held, stored_tokens, block_size, engine_time, now);
        for span in spans {
            // The steps also carried other requests' prefill chunks; their time, at the planned
            // prefill rate, is not decode.
            let prefill_s = span.prompt_tokens as f64 / self.prefill_rate();
            let step_s = (span.seconds - prefill_s) / f64::from(block_size.max(1));
            self.decode.observe_step(span.batch as f64, step_s);
        }
        holders.into_iter().max().flatten()
    }

    /// The earliest dispatch of the in-flight requests whose prompts hold `key`.
    fn earliest_dispatch_holding(&self, key: BlockKey) -> Option<Timestamp> {
        self.timings.values().filter(|t| t.prompt.contains(&key)).map(|t| t.dispatched).min()
    }

    /// The first token of `id` came at `now`, with the running batch it joined.
    pub(crate) fn calibrate_first_token(&mut self, id: RequestId, now: Timestamp) {
        if self.timings.get(&id).is_none_or(|t| t.first_token.is_some()) {
            return;
        }
        let running = self.load().running_requests;
        if let Some(t) = self.timings.get_mut(&id) {
            t.first_token = Some((now, running, self.steps.computed_total()));
        }
    }

    /// `id` ends at `now` having generated `output_tokens` (when known): its inter-token time at
    /// the batch size it ran in is one point of the decode fit.
    pub(crate) fn calibrate_end(&mut self, id: RequestId, now: Timestamp, output_tokens: Option<u64>) {
        let Some(t) = self.timings.remove(&id) else {
            return;
        };
        let (Some((first_at, running_then, computed_then)), Some(tokens)) = (t.first_token, output_tokens) else {
            return;
        };
        // An engine that publishes decode-filled blocks times its own steps; a stream's first
        // bytes to its end measure the API server and the network as well.
        if tokens < 2 || self.decode_steps.publishes_decode_blocks() {
            return;
        }
        let batch = (running_then + self.load().running_requests) as f64 / 2.0;
        // The steps also carried other requests' prefill chunks, more of them in bigger batches;
        // their time (the tokens the engine's batches say it computed meanwhile, at the planned
        // prefill rate) is not decode.
        let prefill_s = self.steps.computed_total().saturating_sub(computed_then) as f64 / self.prefill_rate();
        let step_s = (now.saturating_since(first_at).as_secs_f64() - prefill_s) / (tokens - 1) as f64;
        self.decode.observe_step(batch.max(1.0), step_s);
    }

    /// Why the load report can't be trusted for cache credit, if it can't.
    pub(crate) fn load_problem(&self, now: Timestamp, stale_after: Duration) -> Option<FallbackReason> {
        match &self.snapshot {
            None => Some(FallbackReason::Missing),
            Some(s) if now.saturating_since(s.observed_at) > stale_after => Some(FallbackReason::Stale),
            Some(_) => None,
        }
    }

    pub(crate) fn status(&self, now: Timestamp, kv_state: crate::index::KvState, blocks_held: usize) -> WorkerStatus {
        let load = self.load();
        WorkerStatus {
            id: self.config.id.clone(),
            eligible: self.eligible,
            kv_state,
            blocks_held,
            waiting_requests: load.waiting_requests,
            waiting_tokens: load.waiting_tokens,
            running_requests: load.running_requests,
            decode_tokens: load.decode_tokens,
            kv_usage: load.kv_tokens as f64 / load.kv_capacity_tokens.max(1) as f64,
            load_age_ms: self.snapshot.map(|s| now.saturating_since(s.observed_at).as_millis() as u64),
            in_flight: self.ledger.in_flight(),
            reserved: self.ledger.delta(),
            peer_in_flight: self.peer_ledger.in_flight(),
            peer_reserved: self.peer_ledger.delta(),
            configured_prefill_tokens_per_s: self.config.prefill_tokens_per_s,
            prefill_tokens_per_s: load.prefill_tps,
            measured_prefill_tokens_per_s: self.step_measured_prefill_rate(),
            step_alignment: self.steps.alignment(),
            configured_decode_tokens_per_s: self.config.decode_tokens_per_s,
            decode_tokens_per_s: load.decode_tps,
            measured_decode_tokens_per_s: self.measured_decode_rate(),
            decode_timing: if self.decode_steps.publishes_decode_blocks() {
                DecodeTiming::DecodeFilledBlocks
            } else {
                DecodeTiming::Streams
            },
        }
    }
}

/// Every worker's state, indexed by slot.
#[derive(Debug, Default)]
pub(crate) struct Fleet {
    pub(crate) workers: Vec<Option<WorkerState>>,
    pub(crate) by_id: FxHashMap<WorkerId, WorkerSlot>,
    /// The worker holding each in-flight request's reservation.
    pub(crate) requests: FxHashMap<RequestId, WorkerSlot>,
    /// cache_aware with distribution seeding: the one owner each prefix (first block key) is pinned to.
    pub(crate) seeds: FxHashMap<BlockKey, WorkerSlot>,
    free_slots: Vec<WorkerSlot>,
    /// Raw overlap per slot for the decision in progress; kept to avoid an allocation per decision.
    pub(crate) scratch_overlap: Vec<u32>,
    /// Decisions committed so far (round_robin's turn).
    pub(crate) turns: u64,
    /// Peer replicas and the reservations they shared.
    pub(crate) peers: crate::replicas::PeerBook,
    /// How many peers decide blind to this router's decisions.
    pub(crate) concurrency: crate::concurrent_peers::PeerConcurrency,
    /// The prefill sent to the fleet, by this router and its peers: the fleet's load.
    pub(crate) demand: crate::load::PrefillDemand,
    /// How often each cached prefix is asked for: what a new copy of it would serve.
    pub(crate) prefix_demand: crate::prefix_demand::PrefixDemand,
    /// This router's reservation changes not yet taken for sharing (`None`: not sharing).
    pub(crate) outbox: Option<crate::outbox::Outbox>,
    /// Whether decisions plan with measured rates (the policy's `calibrate`).
    pub(crate) plan_measured: bool,
}

impl Fleet {
    /// Queues a change of this router's reservations for its peers, when sharing.
    pub(crate) fn share(&mut self, change: crate::replicas::ReservationChange, now: Timestamp) {
        if let Some(outbox) = self.outbox.as_mut() {
            outbox.push(change, now);
        }
    }

    /// A worker's step-cadence fit changed: every worker not yet measured plans with the new median
    /// of the measured ones.
    /// Turns planning with measured rates on or off, for every worker and those added later.
    pub(crate) fn set_plan_measured(&mut self, on: bool) {
        self.plan_measured = on;
        for w in self.workers.iter_mut().flatten() {
            w.plan_measured = on;
        }
    }

    pub(crate) fn refresh_measured_prefill(&mut self) {
        let mut rates: Vec<f64> =
            self.workers.iter().flatten().filter_map(WorkerState::measured_prefill_rate).collect();
        let median = (!rates.is_empty()).then(|| {
            rates.sort_by(f64::total_cmp);
            rates[rates.len() / 2]
        });
        for w in self.workers.iter_mut().flatten() {
            w.fleet_measured_prefill = median;
        }
    }

    pub(crate) fn slot_of(&self, id: &WorkerId) -> Result<WorkerSlot, CoreError> {
        self.by_id.get(id).copied().ok_or_else(|| CoreError::UnknownWorker(id.clone()))
    }

    pub(crate) fn worker_mut(&mut self, id: &WorkerId) -> Result<&mut WorkerState, CoreError> {
        let slot = self.slot_of(id)?;
        Ok(self.workers[slot.index()].as_mut().expect("by_id names live slots"))
    }

    pub(crate) fn insert(&mut self, config: WorkerConfig) -> Result<WorkerSlot, CoreError> {
        if self.by_id.contains_key(&config.id) {
            return Err(CoreError::DuplicateWorker(config.id));
        }
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.workers.push(None);
            WorkerSlot(self.workers.len() as u32 - 1)
        });
        self.by_id.insert(config.id.clone(), slot);
        let mut worker = WorkerState::new(config);
        worker.plan_measured = self.plan_measured;
        self.workers[slot.index()] = Some(worker);
        Ok(slot)
    }

    /// Removes a worker; returns its slot and the requests that were in flight on it.
    pub(crate) fn remove(&mut self, id: &WorkerId, now: Timestamp) -> Result<(WorkerSlot, Vec<RequestId>), CoreError> {
        let slot = self.slot_of(id)?;
        let mut state = self.workers[slot.index()].take().expect("by_id names live slots");
        self.by_id.remove(id);
        let dropped = state.ledger.drain();
        for req in &dropped {
            self.requests.remove(req);
            self.share(crate::replicas::ReservationChange::Released { request: *req }, now);
        }
        self.peers.forget_slot(slot);
        self.seeds.retain(|_, owner| *owner != slot);
        self.free_slots.push(slot);
        Ok((slot, dropped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_timing_names_are_the_serialized_ones() {
        for timing in DecodeTiming::ALL {
            assert_eq!(serde_json::to_value(timing).unwrap(), timing.name());
        }
    }

    #[test]
    fn a_step_started_after_the_earliest_dispatch_of_the_prompts_holding_each_run_it_stored() {
        let mut w = WorkerState::new(WorkerConfig::new("w"));
        let key = |k: u64| BlockKey(k);
        let at = |s: u64| Timestamp::from_millis(s * 1_000);
        // The second prompt shares the first's leading blocks: a run starting in them may be the
        // first prompt's later chunk, so only the first's dispatch bounds it.
        w.timings.insert(RequestId(1), Timing::dispatched(&[key(1), key(2), key(3)], at(1)));
        w.timings.insert(RequestId(2), Timing::dispatched(&[key(1), key(2), key(4)], at(5)));
        let run = |parent: u64, first: u64| StoredRun { parent: key(parent), first: key(first), blocks: 2 };
        let mut started_after = |runs: &[StoredRun]| w.observe_stored_runs(runs, 0, 16, (0.0, None), at(6));
        assert_eq!(started_after(&[run(1, 2)]), Some(at(1)));
        assert_eq!(started_after(&[run(2, 4)]), Some(at(5)));
        assert_eq!(started_after(&[run(1, 2), run(2, 4)]), Some(at(5)), "the step computed both runs");
        assert_eq!(started_after(&[run(8, 9)]), None, "generated tokens, or a peer's prompt");
        assert_eq!(started_after(&[]), None);
        // A request released is no longer a candidate.
        w.calibrate_end(RequestId(1), at(6), None);
        assert_eq!(w.observe_stored_runs(&[run(1, 2)], 0, 16, (0.0, None), at(6)), Some(at(5)));
    }
}
