//! Baselines on an exact KV-event index (the core's [`KvIndex`], fed the same events as kvgate):
//! NVIDIA Dynamo's KV router (§5) and llm-d's precise prefix scorer with its default weights (§6).

use kvgate_core::{BlockKey, KvIndex, KvState, RequestId, Timestamp, WorkerSlot};
use kvgate_protocol::KvEvent;
use rand_chacha::ChaCha8Rng;
use rustc_hash::FxHashMap;

use super::{argmin_set, healthy, uniform, FleetInfo, Pick, PolicyRequest, SimPolicy, WorkerView};

/// The exact-event index both baselines keep, fed exactly as kvgate's is.
#[derive(Debug)]
struct ExactIndex(KvIndex);

impl ExactIndex {
    fn new(fleet: &FleetInfo) -> Self {
        let mut index = KvIndex::new(fleet.block_size);
        for w in 0..fleet.workers {
            index.add_worker(WorkerSlot(w as u32), KvState::Synced);
        }
        ExactIndex(index)
    }

    /// Leading blocks of `keys` each worker holds.
    fn overlaps(&self, keys: &[BlockKey], workers: usize) -> Vec<u64> {
        let mut out = Vec::new();
        self.0.overlaps(keys, &mut out);
        let mut o = vec![0u64; workers];
        for (slot, blocks) in out {
            o[slot.index()] = blocks as u64;
        }
        o
    }

    fn apply(&mut self, worker: usize, events: &[KvEvent], now: Timestamp) {
        self.0.apply_events(WorkerSlot(worker as u32), events, now);
    }

    fn set_state(&mut self, worker: usize, state: KvState, clear: bool) {
        if clear {
            self.0.clear_worker(WorkerSlot(worker as u32));
        }
        self.0.set_state(WorkerSlot(worker as u32), state);
    }
}

#[derive(Debug)]
struct DynamoReservation {
    worker: usize,
    keys: Vec<BlockKey>,
    prefill_tokens: u64,
    prefill_done: bool,
}

/// Dynamo's default worker selector: `logit = α·P/B + D` with α = 1, τ = 0.
///
/// `P` = the worker's active prefill tokens plus this request's uncached prompt; `D` = its active
/// blocks plus the prompt blocks not already active there. Reservations add the prompt's blocks
/// (refcounted, shared blocks once) and its uncached tokens at routing; the tokens go at first token,
/// the blocks at completion. Ties go to the smaller index tree, then uniform.
#[derive(Debug)]
pub struct Dynamo {
    index: ExactIndex,
    block: u64,
    active_blocks: Vec<FxHashMap<BlockKey, u32>>,
    active_prefill: Vec<u64>,
    reservations: FxHashMap<RequestId, DynamoReservation>,
}

impl Dynamo {
    /// A router for `fleet`.
    pub fn new(fleet: &FleetInfo) -> Self {
        Dynamo {
            index: ExactIndex::new(fleet),
            block: fleet.block_size as u64,
            active_blocks: vec![FxHashMap::default(); fleet.workers],
            active_prefill: vec![0; fleet.workers],
            reservations: FxHashMap::default(),
        }
    }
}

impl SimPolicy for Dynamo {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        _now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let h = healthy(view);
        let o = self.index.overlaps(req.keys, view.len());
        let uncached = |w: usize| req.prompt_tokens.saturating_sub(o[w] * self.block);
        let logit = |w: usize| {
            let p = self.active_prefill[w] + uncached(w);
            let new_blocks = req.keys.iter().filter(|k| !self.active_blocks[w].contains_key(k)).count();
            let d = self.active_blocks[w].len() + new_blocks;
            p as f64 / self.block as f64 + d as f64
        };
        let best = argmin_set(&h, logit);
        let best = argmin_set(&best, |w| self.index.0.blocks_held(WorkerSlot(w as u32)));
        let w = uniform(&best, rng)?;
        for k in req.keys {
            *self.active_blocks[w].entry(*k).or_insert(0) += 1;
        }
        let prefill_tokens = uncached(w);
        self.active_prefill[w] += prefill_tokens;
        self.reservations.insert(
            req.id,
            DynamoReservation { worker: w, keys: req.keys.to_vec(), prefill_tokens, prefill_done: false },
        );
        Some(Pick::of(w))
    }

    fn on_kv_events(&mut self, worker: usize, events: &[KvEvent], now: Timestamp) {
        self.index.apply(worker, events, now);
    }

    fn on_kv_state(&mut self, worker: usize, state: KvState, clear: bool) {
        self.index.set_state(worker, state, clear);
    }

    fn on_first_token(&mut self, id: RequestId, _now: Timestamp) {
        if let Some(r) = self.reservations.get_mut(&id) {
            if !r.prefill_done {
                r.prefill_done = true;
                self.active_prefill[r.worker] -= r.prefill_tokens;
            }
        }
    }

    fn on_finish(&mut self, id: RequestId, now: Timestamp, _output_tokens: Option<u64>) {
        self.on_first_token(id, now);
        if let Some(r) = self.reservations.remove(&id) {
            let active = &mut self.active_blocks[r.worker];
            for k in r.keys {
                if let Some(n) = active.get_mut(&k) {
                    *n -= 1;
                    if *n == 0 {
                        active.remove(&k);
                    }
                }
            }
        }
    }
}

/// llm-d's default scheduler with the precise prefix scorer: `3·prefix + 2·queue + 2·kv` → max.
///
/// prefix = leading blocks held / prompt blocks (exact events); queue = (Qmax − Q)/(Qmax − Qmin) over
/// the engines' waiting queues (all 1 when equal); kv = 1 − KV usage. Scrapes are the simulator's
/// polls; the last value is used whatever its age, and nothing is reserved at decision time.
#[derive(Debug)]
pub struct LlmD {
    index: ExactIndex,
}

impl LlmD {
    /// A router for `fleet`.
    pub fn new(fleet: &FleetInfo) -> Self {
        LlmD { index: ExactIndex::new(fleet) }
    }
}

impl SimPolicy for LlmD {
    fn decide(
        &mut self,
        req: &PolicyRequest<'_>,
        view: &[WorkerView],
        _now: Timestamp,
        rng: &mut ChaCha8Rng,
    ) -> Option<Pick> {
        let h = healthy(view);
        let o = self.index.overlaps(req.keys, view.len());
        let total = req.keys.len().max(1) as f64;
        let q = |w: usize| view[w].snapshot.map_or(0, |s| s.waiting_requests) as f64;
        let qmax = h.iter().map(|&w| q(w)).fold(f64::MIN, f64::max);
        let qmin = h.iter().map(|&w| q(w)).fold(f64::MAX, f64::min);
        let score = |w: usize| {
            let prefix = o[w] as f64 / total;
            let queue = if qmax > qmin { (qmax - q(w)) / (qmax - qmin) } else { 1.0 };
            let kv = 1.0 - view[w].snapshot.map_or(0.0, |s| s.kv_usage);
            -(3.0 * prefix + 2.0 * queue + 2.0 * kv)
        };
        uniform(&argmin_set(&h, score), rng).map(Pick::of)
    }

    fn on_kv_events(&mut self, worker: usize, events: &[KvEvent], now: Timestamp) {
        self.index.apply(worker, events, now);
    }

    fn on_kv_state(&mut self, worker: usize, state: KvState, clear: bool) {
        self.index.set_state(worker, state, clear);
    }
}
