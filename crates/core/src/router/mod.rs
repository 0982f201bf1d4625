//! The router: one object the gateway, the simulator and the tests share.
//!
//! A decision and the reservation of its work happen under one lock, so N simultaneous identical
//! requests see each other's reservations and spread. Lock order is always fleet, then index; event
//! application takes only the index lock.

use kvgate_protocol::KvEvent;
use parking_lot::{Mutex, RwLock};
use rand::RngCore;

mod sharing;

use crate::decision::{Decision, FallbackReason, Reason, ScoreTerms, MAX_SCORES};
use crate::error::CoreError;
use crate::fleet::{Fleet, Timing, WorkerConfig, WorkerStatus};
use crate::hashing::{BlockHasher, Namespace};
use crate::ids::{BlockKey, RequestId, WorkerId, WorkerSlot};
use crate::index::{ApplyStats, KvIndex, KvState, StoredRun};
use crate::ledger::Work;
use crate::load::{LoadSnapshot, PrefillDemand};
use crate::policy::projected;
use crate::policy::{least_load, policy_for, Choice, Choosing, PolicyConfig, Scored, SeedBook};
use crate::replicas::ReservationChange;
use crate::step_cadence::StepBatch;
use crate::time::Timestamp;
use smallvec::SmallVec;
use std::time::Duration;

/// How long after its projected first token a copy of a hot prefix is still expected to show in
/// the worker's KV events (their delivery, and a reply to a gap), during which it counts as a
/// holder.
const COPY_EVENTS_GRACE: Duration = Duration::from_secs(1);

/// The longest a copy is taken to need to land: a worker scored further off is no copy target for
/// long.
const MAX_COPY_LANDING_S: f64 = 60.0;

/// Blocks of a prompt's cached prefix that its engine may have evicted without the router having
/// heard yet: the engine then computes the prompt from there. A request's dispatch is matched to
/// the steps that stored its blocks from that far back on ([`crate::step_cadence`]); the cached
/// prefix before it, often shared by many requests, is not kept per request.
const EVICTED_BLOCKS_ALLOWED: usize = 16;

/// Bounds of the fleet's block size, in tokens.
pub const BLOCK_SIZE: crate::policy::Knob = crate::policy::Knob {
    name: "block_size",
    min: 1.0,
    max: 4096.0,
    default: 16.0,
    meaning: "tokens per KV block; must equal the engines' (vLLM block_size, SGLang page_size)",
};

/// A request to route.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The caller's id for the request; reservations are released by it.
    pub id: RequestId,
    /// The prompt's chained block keys ([`Router::request_keys`]).
    pub keys: &'a [BlockKey],
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Tokens the request may generate.
    pub max_tokens: u64,
    /// Workers not to choose: those a retry of this request has already failed on.
    pub exclude: &'a [WorkerId],
    /// False when `keys` stop where no worker holds the next block and `prompt_tokens` is partly
    /// estimated (the gateway left the prompt's end untokenized): the request then teaches the
    /// step and decode timings nothing, since its later blocks cannot be recognised.
    pub keys_cover_prompt: bool,
}

/// Which throughput an observation corrects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateKind {
    /// New prompt tokens per second.
    Prefill,
    /// Generated tokens per second, summed over the running batch.
    Decode,
}

/// Why no decision was made. These are expected outcomes, not faults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecideError {
    /// No registered worker is eligible.
    NoEligibleWorker,
    /// The request id already holds a reservation.
    DuplicateRequest(RequestId),
}

impl std::fmt::Display for DecideError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecideError::NoEligibleWorker => f.write_str("no eligible worker"),
            DecideError::DuplicateRequest(id) => {
                write!(f, "request {id} already holds a reservation")
            }
        }
    }
}

/// The routing core.
#[derive(Debug)]
pub struct Router {
    block_size: u32,
    policy: RwLock<PolicyConfig>,
    pub(crate) index: RwLock<KvIndex>,
    pub(crate) fleet: Mutex<Fleet>,
}

impl Router {
    /// A router for engines with blocks of `block_size` tokens.
    pub fn new(block_size: u32, policy: PolicyConfig) -> Result<Self, CoreError> {
        BLOCK_SIZE.check(block_size as f64)?;
        Self::with_index(KvIndex::new(block_size), policy)
    }

    /// A router around an existing (empty) index, for custom index limits.
    pub fn with_index(index: KvIndex, policy: PolicyConfig) -> Result<Self, CoreError> {
        BLOCK_SIZE.check(index.block_size() as f64)?;
        policy.validate()?;
        let mut fleet = Fleet::default();
        fleet.set_plan_measured(policy.calibrate);
        Ok(Router {
            block_size: index.block_size(),
            policy: RwLock::new(policy),
            index: RwLock::new(index),
            fleet: Mutex::new(fleet),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The current policy.
    pub fn policy(&self) -> PolicyConfig {
        self.policy.read().clone()
    }

    /// Replaces the policy after validating it; the old one stays on error.
    pub fn set_policy(&self, policy: PolicyConfig) -> Result<(), CoreError> {
        policy.validate()?;
        self.fleet.lock().set_plan_measured(policy.calibrate);
        *self.policy.write() = policy;
        Ok(())
    }

    /// Registers a worker with the given initial KV state.
    pub fn add_worker(&self, config: WorkerConfig, kv_state: KvState) -> Result<WorkerSlot, CoreError> {
        config.validate()?;
        let mut fleet = self.fleet.lock();
        let slot = fleet.insert(config)?;
        self.index.write().add_worker(slot, kv_state);
        Ok(slot)
    }

    /// Removes a worker, its blocks and its reservations at `now`. Returns the requests that were in
    /// flight on it (their reservations are gone; later calls for them report `UnknownRequest`).
    pub fn remove_worker(&self, id: &WorkerId, now: Timestamp) -> Result<Vec<RequestId>, CoreError> {
        let mut fleet = self.fleet.lock();
        let (slot, dropped) = fleet.remove(id, now)?;
        self.index.write().remove_worker(slot);
        Ok(dropped)
    }

    /// Marks a worker eligible or not (health checks, circuit breaking, draining).
    pub fn set_eligible(&self, id: &WorkerId, eligible: bool) -> Result<(), CoreError> {
        self.fleet.lock().worker_mut(id)?.eligible = eligible;
        Ok(())
    }

    /// Records a load report. Reports older than the one held are ignored.
    pub fn update_load(&self, id: &WorkerId, snapshot: LoadSnapshot) -> Result<(), CoreError> {
        let mut fleet = self.fleet.lock();
        let worker = fleet.worker_mut(id)?;
        if worker.ledger.on_snapshot(snapshot.observed_at) {
            worker.peer_ledger.on_snapshot(snapshot.observed_at);
            worker.snapshot = Some(snapshot);
        }
        Ok(())
    }

    /// Sets a worker's KV capacity in tokens (what the engine reports, when it was not configured).
    pub fn set_kv_capacity(&self, id: &WorkerId, tokens: u64) -> Result<(), CoreError> {
        crate::fleet::KV_CAPACITY_TOKENS.check(tokens as f64)?;
        self.fleet.lock().worker_mut(id)?.config.kv_capacity_tokens = tokens;
        Ok(())
    }

    /// The largest KV capacity in tokens of any registered worker (`None` without workers): a
    /// prompt longer than this cannot be served anywhere.
    pub fn largest_kv_capacity(&self) -> Option<u64> {
        self.fleet.lock().workers.iter().flatten().map(|w| w.config.kv_capacity_tokens).max()
    }

    /// Folds an observed rate (`tokens` processed in `seconds`) into the worker's prefill or decode
    /// throughput estimate.
    pub fn observe_rate(&self, id: &WorkerId, kind: RateKind, tokens: f64, seconds: f64) -> Result<(), CoreError> {
        let mut fleet = self.fleet.lock();
        let worker = fleet.worker_mut(id)?;
        match kind {
            RateKind::Prefill => worker.prefill.observe(tokens, seconds),
            // A full batch decoding `tokens` in `seconds`: steps of `batch × seconds / tokens`.
            RateKind::Decode if tokens > 0.0 => {
                let batch = worker.config.max_running_requests as f64;
                worker.decode.observe_step(batch, batch * seconds / tokens);
            }
            RateKind::Decode => {}
        }
        Ok(())
    }

    /// One scheduler step's KV events arrived live from a worker at `received`, stamped
    /// `engine_time_s` by the engine (publisher `rank`): the step's computed tokens and its time are
    /// a point of the worker's prefill-rate fit ([`crate::step_cadence`]), and its decode-filled
    /// blocks time the decode steps of their sequences ([`crate::decode_cadence`]); decisions plan
    /// with both when calibration is on. The step's time is bounded by the batch before it and by the
    /// dispatch of the requests whose prompts it began. Replayed batches must not be passed here:
    /// their spacing is not the engine's.
    pub fn observe_engine_step(
        &self,
        id: &WorkerId,
        events: &[KvEvent],
        engine_time_s: f64,
        rank: Option<u32>,
        received: Timestamp,
    ) -> Result<(), CoreError> {
        let seconds = |t: Timestamp| t.as_micros() as f64 / 1e6;
        let window = {
            let mut fleet = self.fleet.lock();
            let slot = fleet.slot_of(id)?;
            let runs: SmallVec<[StoredRun; 8]> = {
                let index = self.index.read();
                events
                    .iter()
                    .filter_map(|e| match e {
                        KvEvent::BlockStored(stored) => index.stored_run(slot, stored),
                        _ => None,
                    })
                    .collect()
            };
            let worker = fleet.workers[slot.index()].as_mut().expect("by_id names live slots");
            let tokens = crate::step_cadence::computed_tokens(events);
            let running = worker.load().running_requests;
            let started_after =
                worker.observe_stored_runs(&runs, tokens, self.block_size, (engine_time_s, rank), received);
            let batch = StepBatch {
                tokens,
                running,
                engine_time_s,
                rank,
                received_s: Some(seconds(received)),
                dispatched_s: started_after.map(seconds),
            };
            worker.steps.observe_batch(batch)
        };
        let Some(window) = window else {
            return Ok(());
        };
        // The refit (tens of microseconds) runs with the lock let go, so no decision waits on it.
        // One worker's batches come from one stream, one at a time, so no newer fit can be
        // overwritten by this one; a worker removed meanwhile has nothing to install it in.
        let cost = window.fit();
        let mut fleet = self.fleet.lock();
        if let Ok(worker) = fleet.worker_mut(id) {
            if worker.steps.set_fit(cost) {
                fleet.refresh_measured_prefill();
            }
        }
        Ok(())
    }

    /// Applies decoded KV events from one worker's stream.
    pub fn apply_kv_events(&self, id: &WorkerId, events: &[KvEvent], now: Timestamp) -> Result<ApplyStats, CoreError> {
        let slot = self.fleet.lock().slot_of(id)?;
        Ok(self.index.write().apply_events(slot, events, now))
    }

    /// Sets a worker's KV state (the event consumer's verdict after gaps, replays or decode errors).
    pub fn set_kv_state(&self, id: &WorkerId, state: KvState) -> Result<(), CoreError> {
        let fleet = self.fleet.lock();
        let slot = fleet.slot_of(id)?;
        self.index.write().set_state(slot, state);
        Ok(())
    }

    /// Forgets every block a worker holds, keeping its state (a restarted engine, a lost history).
    pub fn clear_kv(&self, id: &WorkerId) -> Result<(), CoreError> {
        let fleet = self.fleet.lock();
        let slot = fleet.slot_of(id)?;
        self.index.write().clear_worker(slot);
        Ok(())
    }

    /// What an operator sees of one worker.
    pub fn worker_status(&self, id: &WorkerId, now: Timestamp) -> Result<WorkerStatus, CoreError> {
        let fleet = self.fleet.lock();
        let slot = fleet.slot_of(id)?;
        let index = self.index.read();
        let state = index.state(slot).cloned().unwrap_or(KvState::Synced);
        Ok(fleet.workers[slot.index()].as_ref().expect("live slot").status(now, state, index.blocks_held(slot)))
    }

    /// Every worker's status, in registration-slot order.
    pub fn workers(&self, now: Timestamp) -> Vec<WorkerStatus> {
        let fleet = self.fleet.lock();
        let index = self.index.read();
        fleet
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, w)| {
                let slot = WorkerSlot(i as u32);
                let state = index.state(slot).cloned().unwrap_or(KvState::Synced);
                w.as_ref().map(|w| w.status(now, state, index.blocks_held(slot)))
            })
            .collect()
    }

    /// How many peer replicas decide blind to this one's decisions, and whether in step with it
    /// ([`crate::concurrent_peers`]).
    pub fn concurrent_peers(&self) -> crate::ConcurrentPeers {
        self.fleet.lock().concurrency.estimate()
    }

    /// A request reached this replica at `now`: counts it for [`Router::concurrent_peers`], and
    /// says how long it should wait before its decision, at most `max_stagger`
    /// ([`crate::stagger_delay`], `draw` its randomness). Call it once per request, before the
    /// first decision, while sharing reservations with peer replicas.
    pub fn arrived(&self, now: Timestamp, max_stagger: Duration, draw: u64) -> (Duration, crate::ConcurrentPeers) {
        let mut fleet = self.fleet.lock();
        let peers = fleet.concurrency.estimate();
        fleet.concurrency.note_arrival(now, max_stagger);
        (crate::stagger_delay(peers, max_stagger, draw), peers)
    }

    /// Requests holding reservations.
    pub fn in_flight(&self) -> usize {
        self.fleet.lock().requests.len()
    }

    /// The chained block keys of a prompt, with this router's block size.
    pub fn request_keys(&self, namespace: Namespace, tokens: &[u32]) -> Vec<BlockKey> {
        BlockHasher::new().prompt_keys(namespace, tokens, self.block_size as usize)
    }

    /// Whether a prompt whose next blocks are `keys` (chained from `from`: the key before the first,
    /// or a namespace's root) may earn cache credit past them: every one of them is held by some
    /// worker in any KV state, and some held block chains from the last. If not, routing needs no
    /// ids beyond them: blocks past the first that nobody holds earn no credit anywhere.
    pub fn may_hold_more(&self, from: BlockKey, keys: &[BlockKey]) -> bool {
        let index = self.index.read();
        keys.iter().all(|&k| index.held_by_any(k)) && index.held_after(keys.last().copied().unwrap_or(from))
    }

    /// Moves a request's reservation from prefill to decode.
    pub fn first_token(&self, id: RequestId, now: Timestamp) -> Result<(), CoreError> {
        let mut fleet = self.fleet.lock();
        let slot = *fleet.requests.get(&id).ok_or(CoreError::UnknownRequest(id))?;
        if let Some(w) = fleet.workers[slot.index()].as_mut() {
            w.ledger.first_token(id, now).map_err(|_| CoreError::UnknownRequest(id))?;
            w.calibrate_first_token(id, now);
        }
        fleet.share(ReservationChange::FirstToken { request: id }, now);
        Ok(())
    }

    /// Releases a request's reservation: it finished, failed or its client went away.
    pub fn release(&self, id: RequestId, now: Timestamp) -> Result<(), CoreError> {
        self.release_with_output(id, now, None)
    }

    /// Releases a request that generated `output_tokens` (when the response said so). A request
    /// that streamed from [`Router::first_token`] to here over that many tokens calibrates the
    /// worker's decode rate.
    pub fn release_with_output(
        &self,
        id: RequestId,
        now: Timestamp,
        output_tokens: Option<u64>,
    ) -> Result<(), CoreError> {
        let mut fleet = self.fleet.lock();
        let slot = fleet.requests.remove(&id).ok_or(CoreError::UnknownRequest(id))?;
        if let Some(w) = fleet.workers[slot.index()].as_mut() {
            w.calibrate_end(id, now, output_tokens);
            w.pending.release(id);
            w.ledger.finish(id, now).map_err(|_| CoreError::UnknownRequest(id))?;
        }
        fleet.share(ReservationChange::Released { request: id }, now);
        Ok(())
    }

    /// Decides where `req` goes and reserves its work there, atomically.
    pub fn decide<R: RngCore + ?Sized>(
        &self,
        req: &RouteRequest<'_>,
        now: Timestamp,
        rng: &mut R,
    ) -> Result<Decision, DecideError> {
        self.decide_inner(req, now, rng.next_u64(), true)
    }

    /// What [`Router::decide`] would decide now, without reserving anything or changing any state
    /// (for `POST /admin/decide`).
    pub fn preview<R: RngCore + ?Sized>(
        &self,
        req: &RouteRequest<'_>,
        now: Timestamp,
        rng: &mut R,
    ) -> Result<Decision, DecideError> {
        self.decide_inner(req, now, rng.next_u64(), false)
    }

    fn decide_inner(
        &self,
        req: &RouteRequest<'_>,
        now: Timestamp,
        draw: u64,
        commit: bool,
    ) -> Result<Decision, DecideError> {
        let cfg = self.policy.read().clone();
        let mut guard = self.fleet.lock();
        let fleet = &mut *guard;
        if fleet.requests.contains_key(&req.id) {
            return Err(DecideError::DuplicateRequest(req.id));
        }
        let (scored, prefill_weight) = self.score_all(fleet, req, now, &cfg);
        let load_winner =
            least_load::pick(scored.len(), |i| &scored[i].terms, draw).ok_or(DecideError::NoEligibleWorker)?;
        // The request's longest prefix that a worker holds (with credit), named by its last block.
        let deepest = scored.iter().map(|s| s.cached_tokens).max().unwrap_or(0) / u64::from(self.block_size.max(1));
        let hot_prefix = (deepest as usize).checked_sub(1).and_then(|i| req.keys.get(i)).copied();
        let heat = hot_prefix.map(|key| fleet.prefix_demand.heat(key, now)).unwrap_or_default();
        let deepest_tokens = deepest * u64::from(self.block_size.max(1));
        let copies_in_flight: Vec<WorkerSlot> = hot_prefix
            .map(|key| {
                fleet
                    .prefix_demand
                    .copies_in_flight(key, now)
                    .filter(|&slot| scored.iter().any(|s| s.slot == slot && s.cached_tokens < deepest_tokens))
                    .collect()
            })
            .unwrap_or_default();
        let unseen_peers = fleet.concurrency.estimate().unseen;
        if commit {
            fleet.concurrency.note_decision(now);
        }

        let mut choosing = Choosing {
            scored: &scored,
            load_winner,
            draw,
            prefill_weight,
            cfg: &cfg,
            keys: req.keys,
            routed: &|slot| fleet.workers[slot.index()].as_ref().map_or(0, |w| w.routed),
            turn: fleet.turns,
            seeds: if commit { SeedBook::Commit(&mut fleet.seeds) } else { SeedBook::Peek(&fleet.seeds) },
            heat,
            decode_tokens: req.max_tokens,
            copies_in_flight: &copies_in_flight,
            unseen_peers,
        };
        let Choice { chosen, reason, enforce } = policy_for(cfg.name).choose(&mut choosing);

        let winner = &scored[chosen];
        let prefill_tokens = req.prompt_tokens - winner.cached_tokens;
        let work = Work { prefill_tokens, decode_tokens: req.max_tokens, kv_tokens: winner.new_kv_tokens };
        if commit {
            let last_event_at = self.index.read().last_event_at(winner.slot);
            let state = fleet.workers[winner.slot.index()].as_mut().expect("scored slots are live");
            state.ledger.reserve(req.id, work, now);
            let first_uncached = (winner.cached_tokens / u64::from(self.block_size.max(1))) as usize;
            let computed_from = first_uncached.saturating_sub(EVICTED_BLOCKS_ALLOWED).min(req.keys.len());
            if req.keys_cover_prompt {
                state.timings.insert(req.id, Timing::dispatched(&req.keys[computed_from..], now));
                state.decode_steps.follow(req.keys.last().copied(), now);
            }
            state.routed += 1;
            state.note_dispatch(now, last_event_at);
            state.pending.note(req.id, req.keys);
            fleet.demand.add(work.prefill_tokens, now);
            if let Some(key) = hot_prefix {
                fleet.prefix_demand.add(key, now);
                if reason == Reason::Replicate {
                    let lands_in = Duration::from_secs_f64(winner.terms.projected_s.clamp(0.0, MAX_COPY_LANDING_S))
                        + COPY_EVENTS_GRACE;
                    fleet.prefix_demand.copy_sent(key, winner.slot, now, lands_in);
                }
            }
            fleet.requests.insert(req.id, winner.slot);
            fleet.turns += 1;
            if fleet.outbox.is_some() {
                let worker = state_id(fleet, winner.slot);
                fleet.share(ReservationChange::Reserved { request: req.id, worker, work }, now);
            }
        }

        let id_of = |i: usize| fleet.workers[scored[i].slot.index()].as_ref().expect("live").config.id.clone();
        Ok(Decision {
            request: req.id,
            policy: cfg.name,
            mode: cfg.mode,
            worker: id_of(chosen),
            reason,
            load_only_worker: id_of(load_winner),
            enforce_worker: enforce.map(|(i, _)| id_of(i)),
            enforce_reason: enforce.map(|(_, r)| r),
            prompt_tokens: req.prompt_tokens,
            cached_tokens: winner.cached_tokens,
            prefill_weight,
            scores: score_list(&scored, chosen, load_winner, (prefill_weight, cfg.batch_delay_weight), id_of),
        })
    }

    /// Every eligible worker scored for `req`, and the weight of uncached prefill their costs use.
    fn score_all(
        &self,
        fleet: &mut Fleet,
        req: &RouteRequest<'_>,
        now: Timestamp,
        cfg: &PolicyConfig,
    ) -> (Vec<Scored>, f64) {
        let index = self.index.read();
        let mut overlaps = Vec::new();
        index.overlaps(req.keys, &mut overlaps);
        let mut raw = std::mem::take(&mut fleet.scratch_overlap);
        raw.clear();
        raw.resize(fleet.workers.len(), 0);
        for &(slot, blocks) in &overlaps {
            if let Some(r) = raw.get_mut(slot.index()) {
                *r = blocks;
            }
        }
        let stale_after = cfg.stale_after();
        let kv_stale_after = cfg.kv_stale_after();
        let mut scored = Vec::with_capacity(fleet.by_id.len());
        for (i, worker) in fleet.workers.iter().enumerate() {
            let Some(w) = worker.as_ref().filter(|w| w.eligible && !req.exclude.contains(&w.config.id)) else {
                continue;
            };
            let slot = WorkerSlot(i as u32);
            let raw_blocks = raw[i];
            let load_problem = w.load_problem(now, stale_after);
            let withheld = if raw_blocks == 0 {
                None
            } else {
                load_problem.or_else(|| {
                    let quiet = w.unanswered_dispatch_since.is_some_and(|since| {
                        index.last_event_at(slot).is_none_or(|e| e < since)
                            && now.saturating_since(since) > kv_stale_after
                    });
                    match index.state(slot) {
                        Some(KvState::Synced) if quiet => Some(FallbackReason::Stale),
                        Some(KvState::Synced) | None => None,
                        Some(KvState::Incomplete(_)) => Some(FallbackReason::Incomplete),
                        Some(KvState::Stale(_)) => Some(FallbackReason::Stale),
                        Some(KvState::Invalid(_)) => Some(FallbackReason::Invalid),
                    }
                })
            };
            let cached_tokens =
                if withheld.is_none() { reusable_tokens(raw_blocks, req.prompt_tokens, self.block_size) } else { 0 };
            // Blocks a request in flight here carries are counted once in its KV, on an engine whose
            // events show it caches and shares prefixes (`crate::pending_prefix`). Whole blocks are
            // shared, the prompt's last token included.
            let shares_prefixes = matches!(index.state(slot), Some(KvState::Synced));
            let shared_blocks = if shares_prefixes { w.pending.leading(req.keys) } else { 0 };
            let ask = projected::Ask {
                kv_shared_tokens: u64::from(shared_blocks) * u64::from(self.block_size),
                ..projected::Ask::new(req.prompt_tokens, cached_tokens, req.max_tokens)
            };
            let load = w.load();
            let terms = projected::score(&load, ask, cfg);
            let new_kv_tokens = ask.new_kv_tokens();
            scored.push(Scored { slot, load, terms, cached_tokens, new_kv_tokens, raw_blocks, withheld, load_problem });
        }
        fleet.scratch_overlap = raw;
        let capacity = scored.iter().map(|s| s.load.prefill_tps).sum();
        let prefill_weight = fleet_prefill_weight(&fleet.demand, capacity, now, cfg);
        (scored, prefill_weight)
    }
}

/// The weight of uncached prefill on the fleet now: the prefill sent lately over the prefill
/// `capacity` of the workers that can take this request (see [`crate::load::prefill_weight`]).
fn fleet_prefill_weight(demand: &PrefillDemand, capacity: f64, now: Timestamp, cfg: &PolicyConfig) -> f64 {
    if cfg.prefill_weight_max <= 1.0 || capacity <= 0.0 {
        return 1.0;
    }
    crate::load::prefill_weight(demand.rate(now) / capacity, cfg.prefill_weight_max)
}

fn state_id(fleet: &Fleet, slot: WorkerSlot) -> WorkerId {
    fleet.workers[slot.index()].as_ref().expect("live slot").config.id.clone()
}

/// Prompt tokens an engine can serve from `blocks` cached leading blocks: whole blocks only, and
/// never the prompt's last token, which is always computed to produce the first output token (vLLM's
/// `max_cache_hit_length = prompt - 1`, rounded down to a block; SGLang likewise).
pub fn reusable_tokens(blocks: u32, prompt_tokens: u64, block_size: u32) -> u64 {
    let bs = u64::from(block_size.max(1));
    u64::from(blocks).min(prompt_tokens.saturating_sub(1) / bs) * bs
}

/// The scores a decision lists: every worker's when there are few, else the best few, and always
/// the chosen worker and the load-only winner (admission reads the chosen one's queue).
fn score_list(
    scored: &[Scored],
    chosen: usize,
    load_winner: usize,
    weights: (f64, f64),
    id_of: impl Fn(usize) -> WorkerId,
) -> Vec<ScoreTerms> {
    let (prefill_weight, batch_delay_weight) = weights;
    let cost = |i: usize| scored[i].terms.cost_s(prefill_weight, batch_delay_weight);
    let by_score = |a: &usize, b: &usize| cost(*a).total_cmp(&cost(*b)).then(a.cmp(b));
    let mut order: Vec<usize> = (0..scored.len()).collect();
    if order.len() > MAX_SCORES {
        // Only the best few are listed: select them in linear time, then sort just those.
        order.select_nth_unstable_by(MAX_SCORES - 1, by_score);
        order.truncate(MAX_SCORES);
        order.sort_by(by_score);
        for must in [chosen, load_winner] {
            if !order.contains(&must) {
                order.push(must);
            }
        }
    } else {
        order.sort_by(by_score);
    }
    order
        .into_iter()
        .map(|i| {
            let s = &scored[i];
            ScoreTerms {
                worker: id_of(i),
                projected_s: s.terms.projected_s,
                cost_s: cost(i),
                cached_tokens: s.cached_tokens,
                wait_s: s.terms.wait_s,
                decode_s: s.terms.decode_s,
                prefill_s: s.terms.prefill_s,
                barrier_s: s.terms.barrier_s,
                batch_delay_s: s.terms.batch_delay_s,
                load_only_s: s.terms.load_only_s,
                waiting_requests: s.load.waiting_requests,
                prefill_tokens_per_s: s.load.prefill_tps,
                decode_tokens_per_s: s.load.decode_tps,
                credit_withheld: s.withheld,
            }
        })
        .collect()
}
