//! One engine: FCFS waiting queue, continuous batching with chunked prefill, decode steps, the paged
//! cache, KV events and load telemetry. It is stepped by its caller: `begin_step` plans a step and
//! says how long it takes, `end_step` applies it. Nothing here reads a clock.

use std::collections::VecDeque;

use kvgate_core::{BlockHasher, BlockKey, LoadSnapshot, RequestId, Timestamp};
use kvgate_protocol::telemetry::EngineLoad;
use kvgate_protocol::{BlockStored, EngineHash, KvEvent};

use crate::cache::PagedCache;
use crate::profile::{EngineProfile, Flavor};

/// Batches kept for replay (vLLM and SGLang `buffer_steps` default).
pub const REPLAY_BUFFER_STEPS: usize = 10_000;

/// A request as submitted to the engine.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    /// The caller's id.
    pub id: RequestId,
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Tokens the request generates before it finishes (at least 1).
    pub output_tokens: u32,
}

/// One published batch of KV events.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Sequence number: 0 for the first batch of each engine process, then +1 per batch.
    pub seq: u64,
    /// The events.
    pub events: Vec<KvEvent>,
}

/// A request that left the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub output_tokens: u64,
}

/// What a step did.
#[derive(Debug, Clone, Default)]
pub struct StepOutcome {
    /// Requests whose first token was produced in this step.
    pub first_tokens: Vec<RequestId>,
    /// Requests that produced a further (not first) token in this step.
    pub decoded: Vec<RequestId>,
    /// Requests that finished in this step.
    pub finished: Vec<Finished>,
    /// KV events published at the end of the step, if any.
    pub batch: Option<EventBatch>,
}

#[derive(Debug)]
struct Active {
    id: RequestId,
    /// The sequence's tokens: the prompt, then (vLLM flavour) every sampled token, which a
    /// recompute after preemption and the blocks decoding fills need. SGLang flavour drops them once
    /// the prompt's blocks are published.
    tokens: Vec<u32>,
    /// Chained hashes of the sequence's full blocks: the prompt's from submission, then (vLLM
    /// flavour) each block the decoding fills, once computed.
    hashes: Vec<EngineHash>,
    prompt_tokens: u64,
    /// Prompt tokens served from the cache at the first admission (what the engine reports; a
    /// recompute after preemption does not change it, as in vLLM's `num_cached_tokens`).
    cached_tokens: u64,
    /// Whether the request was ever admitted (counted in the engine's totals).
    admitted: bool,
    /// Leading blocks referenced in the prefix cache: those found cached at admission, then those
    /// it computed and published.
    published_blocks: usize,
    /// Tokens of the sequence whose KV is computed (vLLM's `num_computed_tokens`).
    computed: u64,
    output_tokens: u32,
    generated: u32,
    /// Private blocks held (partial tail, decode, and full blocks until published).
    private_blocks: u64,
    /// Uncached tokens estimated when it was queued, for telemetry while it waits.
    uncached_at_arrival: u64,
}

impl Active {
    /// Tokens the sequence has: the prompt and every token sampled so far.
    fn seq_len(&self) -> u64 {
        self.prompt_tokens + u64::from(self.generated)
    }

    /// Tokens still to compute before the next token is sampled: 1 while decoding.
    fn uncomputed(&self) -> u64 {
        self.seq_len() - self.computed
    }

    /// Tokens left to prefill: the prompt's, or a preempted sequence's recompute; 0 while decoding.
    fn prefill_left(&self) -> u64 {
        let left = self.uncomputed();
        if self.generated == 0 || left > 1 {
            left
        } else {
            0
        }
    }

    /// Blocks the request holds, cached and private.
    fn held_blocks(&self) -> u64 {
        self.published_blocks as u64 + self.private_blocks
    }
}

/// The plan of the step in progress: per running request (by position), the tokens it computes.
#[derive(Debug, Default)]
struct Plan {
    work: Vec<(usize, u64)>,
}

/// One engine process and its successors across restarts.
#[derive(Debug)]
pub struct Engine {
    profile: EngineProfile,
    hasher: BlockHasher,
    salt: u64,
    next_seq: u64,
    waiting: VecDeque<Active>,
    running: Vec<Active>,
    cache: PagedCache,
    plan: Option<Plan>,
    pending_events: Vec<KvEvent>,
    history: VecDeque<EventBatch>,
    replay_buffer: usize,
    /// Totals since start: prompt tokens admitted and those served from the cache.
    pub prompt_tokens_total: u64,
    /// Prompt tokens served from the prefix cache since start.
    pub cached_tokens_total: u64,
    /// Running requests preempted since start (vLLM flavour: out of KV blocks, the newest is sent
    /// back to the queue and recomputed later).
    pub preemptions_total: u64,
    /// Since start, over every step: decoding sequences, and their context tokens.
    decoded: (u64, u64),
}

impl Engine {
    /// A fresh engine with an empty cache. `salt` seeds its block hashes, as a process-random seed
    /// does in vLLM before 0.29; a restart changes it.
    pub fn new(profile: EngineProfile, salt: u64) -> Self {
        let capacity = profile.kv_capacity_tokens / profile.block_size.max(1) as u64;
        let mut engine = Engine {
            hasher: BlockHasher::new(),
            salt,
            next_seq: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache: PagedCache::new(capacity),
            plan: None,
            pending_events: Vec::new(),
            history: VecDeque::new(),
            replay_buffer: REPLAY_BUFFER_STEPS,
            prompt_tokens_total: 0,
            cached_tokens_total: 0,
            preemptions_total: 0,
            decoded: (0, 0),
            profile,
        };
        engine.start_process();
        engine
    }

    /// Keeps only the last `batches` batches for replay (vLLM and SGLang `buffer_steps`).
    pub fn with_replay_buffer(mut self, batches: usize) -> Self {
        self.replay_buffer = batches.max(1);
        self
    }

    fn start_process(&mut self) {
        if self.profile.flavor == Flavor::Sglang {
            self.pending_events.push(KvEvent::AllBlocksCleared);
        }
    }

    /// The engine's profile.
    pub fn profile(&self) -> &EngineProfile {
        &self.profile
    }

    /// Queues a request.
    pub fn submit(&mut self, req: EngineRequest) {
        let bs = self.profile.block_size as usize;
        let mut hashes = Vec::with_capacity(req.tokens.len() / bs);
        let mut keys = Vec::with_capacity(req.tokens.len() / bs);
        self.hasher.extend_keys(BlockKey(self.salt), &req.tokens, bs, &mut keys);
        hashes.extend(keys.into_iter().map(|k| EngineHash(k.0)));
        let prompt_tokens = req.tokens.len() as u64;
        let matched = self.cache.match_prefix(&hashes) as u64 * bs as u64;
        self.waiting.push_back(Active {
            id: req.id,
            tokens: req.tokens,
            hashes,
            prompt_tokens,
            cached_tokens: 0,
            admitted: false,
            published_blocks: 0,
            computed: 0,
            output_tokens: req.output_tokens.max(1),
            generated: 0,
            private_blocks: 0,
            uncached_at_arrival: prompt_tokens - reusable_tokens(matched, prompt_tokens, bs as u64),
        });
    }

    /// Whether a step is planned or could be.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The mean context of a decoding sequence over every step since start, if one decoded: what
    /// a full batch's decode rate depends on besides its size.
    pub fn mean_decode_context(&self) -> Option<f64> {
        (self.decoded.0 > 0).then(|| self.decoded.1 as f64 / self.decoded.0 as f64)
    }

    /// Plans the next step and returns its duration in microseconds, or `None` when there is nothing
    /// to do (or nothing can be admitted and nothing runs).
    pub fn begin_step(&mut self) -> Option<u64> {
        debug_assert!(self.plan.is_none(), "begin_step twice");
        let plan = match self.profile.flavor {
            Flavor::Vllm => self.plan_allocating(),
            Flavor::Sglang => self.plan_reserving(),
        };
        if plan.work.is_empty() {
            return None;
        }
        let (mut n, mut context, mut prefill) = (0u64, 0u64, 0u64);
        for &(i, tokens) in &plan.work {
            let r = &self.running[i];
            if r.prefill_left() == 0 {
                n += 1;
                context += r.seq_len();
            } else {
                prefill += tokens;
            }
        }
        let micros = self.profile.step_micros(n, context, prefill);
        self.decoded = (self.decoded.0 + n, self.decoded.1 + context);
        self.plan = Some(plan);
        Some(micros)
    }

    /// SGLang flavour: a prefill step whenever there is prefill to do (a chunk left of a running
    /// request, then queued requests admitted in order while the budget lasts and each one's
    /// uncached prompt and whole output fit in KV, reserved at admission), and otherwise a decode
    /// step of every running request. SGLang does not mix the two unless started with
    /// `--enable-mixed-chunk` (off by default): its decodes pause while it prefills, as the paced
    /// engines' step logs show (no step carries both). Mixed, the decodes go first, one budget token
    /// each, and prefill takes what is left. (SGLang reserves an estimated share of the output and
    /// retracts when it runs out; reserving it all errs towards smaller batches.)
    fn plan_reserving(&mut self) -> Plan {
        let bs = self.profile.block_size as u64;
        let mut budget = self.profile.chunk_budget as u64;
        let mut plan = Plan::default();
        let mixed = self.profile.mixes_prefill_and_decode();
        if mixed {
            for (i, r) in self.running.iter().enumerate() {
                if r.prefill_left() == 0 && budget > 0 {
                    plan.work.push((i, 1));
                    budget -= 1;
                }
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            let left = r.prefill_left();
            if left > 0 && budget > 0 {
                let chunk = left.min(budget);
                plan.work.push((i, chunk));
                budget -= chunk;
            }
        }
        while budget > 0 && (self.running.len() as u32) < self.profile.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            let matched = self.cache.match_prefix(&next.hashes);
            let full = next.hashes.len();
            let tail = u64::from(next.prompt_tokens % bs != 0);
            let decode = (next.output_tokens as u64).div_ceil(bs);
            let need = (full - matched) as u64 + tail + decode;
            let pinned = self.cache.unreferenced_among(&next.hashes[..matched]);
            if !self.cache.can_allocate(need, pinned) {
                break;
            }
            let computed = reusable_tokens(matched as u64 * bs, next.prompt_tokens, bs);
            budget -= self.admit_front(matched, computed, need, budget, &mut plan);
        }
        if !mixed && plan.work.is_empty() {
            // Nothing to prefill: every running request has its prompt computed and decodes.
            plan.work = (0..self.running.len()).map(|i| (i, 1)).collect();
        }
        plan
    }

    /// vLLM flavour (v1 scheduler): running requests in order, each given the blocks its tokens of
    /// this step need; when none are left the newest running request is preempted (its blocks
    /// freed, its computed tokens forgotten, back to the front of the queue) until the allocation
    /// fits or the request itself was the one preempted. Queued requests are admitted only in a step
    /// that preempted nothing, each with the blocks of its first chunk alone.
    fn plan_allocating(&mut self) -> Plan {
        let bs = self.profile.block_size as u64;
        let mut budget = self.profile.chunk_budget as u64;
        let mut plan = Plan::default();
        let mut preempted = false;
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let tokens = self.running[i].uncomputed().min(budget);
            loop {
                let r = &self.running[i];
                let need = (r.computed + tokens).div_ceil(bs).saturating_sub(r.held_blocks());
                if self.cache.can_allocate(need, 0) {
                    self.cache.allocate_private(need, &mut self.pending_events);
                    self.running[i].private_blocks += need;
                    break;
                }
                let newest = self.running.pop().expect("request i is running");
                let was_this_one = self.running.len() == i;
                self.preempt(newest);
                preempted = true;
                if was_this_one {
                    break 'running;
                }
            }
            plan.work.push((i, tokens));
            budget -= tokens;
            i += 1;
        }
        while !preempted && budget > 0 && (self.running.len() as u32) < self.profile.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            let matched = self.cache.match_prefix(&next.hashes);
            let computed = reusable_tokens(matched as u64 * bs, next.seq_len(), bs);
            let reused = (computed / bs) as usize;
            let tokens = (next.seq_len() - computed).min(budget);
            let need = (computed + tokens).div_ceil(bs) - reused as u64;
            let pinned = self.cache.unreferenced_among(&next.hashes[..reused]);
            if !self.cache.can_allocate(need, pinned) {
                break;
            }
            budget -= self.admit_front(reused, computed, need, budget, &mut plan);
        }
        plan
    }

    /// Moves the queue's front request into the batch: it references its first `matched` cached
    /// blocks, holds `need` new ones, has `computed` tokens already, and computes up to `budget` in
    /// this step; returns how many. Its first admission sets what it reports as cached and counts it
    /// in the totals.
    fn admit_front(&mut self, matched: usize, computed: u64, need: u64, budget: u64, plan: &mut Plan) -> u64 {
        let mut r = self.waiting.pop_front().expect("the caller looked at the front");
        for h in &r.hashes[..matched] {
            self.cache.acquire(*h);
        }
        let allocated = self.cache.allocate_private(need, &mut self.pending_events);
        debug_assert!(allocated);
        r.private_blocks = need;
        r.published_blocks = matched;
        r.computed = computed;
        if !r.admitted {
            r.admitted = true;
            r.cached_tokens = computed;
            self.prompt_tokens_total += r.prompt_tokens;
            self.cached_tokens_total += r.cached_tokens;
        }
        let tokens = r.uncomputed().min(budget);
        self.running.push(r);
        plan.work.push((self.running.len() - 1, tokens));
        tokens
    }

    /// Sends a running request back to the front of the queue: its blocks are freed (what it
    /// published stays cached, so its recompute may find much of it) and its computed tokens are
    /// forgotten; its sampled tokens are kept, so it resumes where it was without a new first token.
    fn preempt(&mut self, mut r: Active) {
        self.release(&r);
        r.computed = 0;
        r.published_blocks = 0;
        r.private_blocks = 0;
        let bs = u64::from(self.profile.block_size);
        let matched = self.cache.match_prefix(&r.hashes) as u64 * bs;
        r.uncached_at_arrival = r.seq_len() - reusable_tokens(matched, r.seq_len(), bs);
        self.preemptions_total += 1;
        self.waiting.push_front(r);
    }

    /// The requests the step [`Engine::begin_step`] planned runs, prefilling or decoding (none
    /// when no step is planned).
    pub fn planned(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.plan.iter().flat_map(|plan| plan.work.iter().map(|&(i, _)| self.running[i].id))
    }

    /// Applies the planned step.
    pub fn end_step(&mut self) -> StepOutcome {
        let mut out = StepOutcome::default();
        let Some(plan) = self.plan.take() else {
            return out;
        };
        let vllm = self.profile.flavor == Flavor::Vllm;
        for (i, tokens) in plan.work {
            self.running[i].computed += tokens;
            self.publish_computed(i);
            let r = &mut self.running[i];
            if r.computed < r.seq_len() {
                continue;
            }
            r.generated += 1;
            if r.generated == 1 {
                out.first_tokens.push(r.id);
            } else {
                out.decoded.push(r.id);
            }
            if vllm {
                // Fed back in next step: vLLM caches the blocks decoding fills. The model's output
                // tokens are pseudo-random ids of the request, so such a block only ever matches
                // its own sequence.
                let index = u64::from(r.generated - 1);
                r.tokens.extend(kvgate_core::hashing::synthetic_tokens(r.id.0 ^ index.rotate_left(32), 1));
            } else if r.generated == 1 {
                r.tokens = Vec::new();
            }
        }
        // Finished requests leave; the rest keep their FCFS order for the next step.
        let mut kept = Vec::with_capacity(self.running.len());
        for r in std::mem::take(&mut self.running) {
            if r.prefill_left() == 0 && r.generated >= r.output_tokens {
                self.release(&r);
                out.finished.push(Finished {
                    id: r.id,
                    prompt_tokens: r.prompt_tokens,
                    cached_tokens: r.cached_tokens,
                    output_tokens: r.generated as u64,
                });
            } else {
                kept.push(r);
            }
        }
        self.running = kept;
        out.batch = self.flush_events();
        out
    }

    /// Publishes running request `i`'s full blocks computed so far, as vLLM and SGLang publish them
    /// chunk by chunk; in vLLM flavour also the blocks its decoding fills, each chained to the
    /// sequence's last.
    fn publish_computed(&mut self, i: usize) {
        let bs = self.profile.block_size as usize;
        let r = &mut self.running[i];
        let full = (r.computed / bs as u64) as usize;
        if self.profile.flavor == Flavor::Vllm {
            while r.hashes.len() < full {
                let j = r.hashes.len();
                let parent = r.hashes.last().map_or(self.salt, |h| h.0);
                let key = self.hasher.block_key(BlockKey(parent), &r.tokens[j * bs..(j + 1) * bs]);
                r.hashes.push(EngineHash(key.0));
            }
        }
        let upto = full.min(r.hashes.len());
        let start = r.published_blocks;
        if upto <= start {
            return;
        }
        r.private_blocks -= (upto - start) as u64;
        r.published_blocks = upto;
        let hashes = std::mem::take(&mut r.hashes);
        let tokens = std::mem::take(&mut r.tokens);
        self.publish(&hashes[..upto], &tokens, start);
        let r = &mut self.running[i];
        r.hashes = hashes;
        r.tokens = tokens;
    }

    /// Publishes the prompt blocks from `start` on, as chained `BlockStored` runs.
    fn publish(&mut self, hashes: &[EngineHash], tokens: &[u32], start: usize) {
        let bs = self.profile.block_size as usize;
        let mut run: Vec<usize> = Vec::new();
        let flush = |run: &mut Vec<usize>, events: &mut Vec<KvEvent>| {
            if let (Some(&first), Some(&last)) = (run.first(), run.last()) {
                events.push(KvEvent::BlockStored(BlockStored {
                    block_hashes: run.iter().map(|&j| hashes[j]).collect(),
                    parent_block_hash: first.checked_sub(1).map(|p| hashes[p]),
                    token_ids: tokens[first * bs..(last + 1) * bs].to_vec(),
                    block_size: bs as u32,
                    medium: Some("GPU".into()),
                    ..BlockStored::default()
                }));
                run.clear();
            }
        };
        for (j, hash) in hashes.iter().enumerate().skip(start) {
            if self.cache.publish(*hash) {
                run.push(j);
            } else {
                flush(&mut run, &mut self.pending_events);
            }
        }
        flush(&mut run, &mut self.pending_events);
    }

    fn flush_events(&mut self) -> Option<EventBatch> {
        if self.pending_events.is_empty() {
            return None;
        }
        let batch = EventBatch { seq: self.next_seq, events: std::mem::take(&mut self.pending_events) };
        self.next_seq += 1;
        self.history.push_back(batch.clone());
        if self.history.len() > self.replay_buffer {
            self.history.pop_front();
        }
        Some(batch)
    }

    /// Publishes events queued outside a step (SGLang's start-up clear), if any.
    pub fn flush_idle(&mut self) -> Option<EventBatch> {
        if self.plan.is_some() {
            return None;
        }
        self.flush_events()
    }

    /// The buffered batches with `seq >= from`, as the replay socket returns them.
    pub fn replay(&self, from: u64) -> Vec<EventBatch> {
        self.history.iter().filter(|b| b.seq >= from).cloned().collect()
    }

    /// Load telemetry as the engine would report it at `now`.
    pub fn load(&self, now: Timestamp) -> LoadSnapshot {
        let queued: u64 = self.waiting.iter().map(|r| r.uncached_at_arrival).sum();
        let prefilling: u64 = self.running.iter().map(Active::prefill_left).sum();
        let decode: u64 =
            self.running.iter().map(|r| (r.output_tokens - r.generated.min(r.output_tokens)) as u64).sum();
        LoadSnapshot {
            waiting_requests: self.waiting.len() as u64,
            waiting_tokens: queued + prefilling,
            running_requests: self.running.len() as u64,
            active_decode_tokens: decode,
            kv_usage: self.cache.used_blocks() as f64 / self.cache.capacity_blocks().max(1) as f64,
            observed_at: now,
            estimated: None,
            max_running_requests: None,
        }
    }

    /// The load report this engine serves, in the wire format of `flavor`, as kvgate's poller
    /// parses it: vLLM's `/metrics` (request counts and KV usage, no token counts) or SGLang's
    /// `/v1/loads` (counts, the queued requests' uncached tokens, the running requests' KV tokens,
    /// KV usage). Neither says what the running batch still has to prefill or decode; [`Engine::load`]
    /// is the exact state, for the simulator's oracle only.
    pub fn report(&self, flavor: Flavor) -> EngineLoad {
        let kv_usage = self.cache.used_blocks() as f64 / self.cache.capacity_blocks().max(1) as f64;
        let counts = EngineLoad {
            waiting_requests: self.waiting.len() as u64,
            running_requests: self.running.len() as u64,
            kv_usage: Some(kv_usage),
            kv_capacity_tokens: Some(self.profile.kv_capacity_tokens),
            ..EngineLoad::default()
        };
        match flavor {
            Flavor::Vllm => EngineLoad { block_size: Some(self.profile.block_size), ..counts },
            Flavor::Sglang => EngineLoad {
                waiting_uncached_tokens: Some(self.waiting.iter().map(|r| r.uncached_at_arrival).sum()),
                active_tokens: Some(self.running.iter().map(|r| r.prompt_tokens + u64::from(r.generated)).sum()),
                ..counts
            },
        }
    }

    /// Leading tokens of `tokens` whose full blocks are in the prefix cache right now. Hashing
    /// stops at the first block not cached, so asking every engine of a fleet costs little.
    pub fn cached_prefix_tokens(&mut self, tokens: &[u32]) -> u64 {
        let bs = self.profile.block_size as usize;
        let mut key = BlockKey(self.salt);
        let mut matched = 0u64;
        for block in tokens.chunks_exact(bs.max(1)) {
            key = self.hasher.block_key(key, block);
            if !self.cache.contains(EngineHash(key.0)) {
                break;
            }
            matched += bs as u64;
        }
        matched
    }

    /// The prompt tokens a request for `tokens` would find cached if it were admitted now: the
    /// cached prefix, less the last token, which a fully cached prompt still computes.
    pub fn reusable_prompt_tokens(&mut self, tokens: &[u32]) -> u64 {
        let matched = self.cached_prefix_tokens(tokens);
        reusable_tokens(matched, tokens.len() as u64, u64::from(self.profile.block_size))
    }

    /// Requests queued.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in the running batch.
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Blocks in the prefix cache.
    pub fn cached_blocks(&self) -> usize {
        self.cache.cached_blocks()
    }

    /// Aborts every queued and running request (their clients went away, or the network to the
    /// router broke), keeping the prefix cache. Returns the aborted requests.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        self.plan = None;
        let mut aborted = Vec::new();
        for r in self.waiting.drain(..) {
            aborted.push(r.id);
        }
        for r in std::mem::take(&mut self.running) {
            aborted.push(r.id);
            self.release(&r);
        }
        aborted
    }

    /// Aborts one request (its client went away), queued or running, between steps: its KV blocks
    /// go back to the pool and what it stored stays cached. False if the engine does not have it.
    pub fn abort(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            return true;
        }
        let Some(i) = self.running.iter().position(|r| r.id == id) else { return false };
        // A planned step refers to running requests by position: plan again.
        self.plan = None;
        let r = self.running.remove(i);
        self.release(&r);
        true
    }

    /// Drops a request's hold on its blocks: cached ones become evictable, last block first (its
    /// tail goes before its head, as vLLM frees a request's blocks in reverse and SGLang's radix tree
    /// evicts leaves first), and private ones return to the pool.
    fn release(&mut self, r: &Active) {
        for h in r.hashes[..r.published_blocks.min(r.hashes.len())].iter().rev() {
            self.cache.release(*h);
        }
        self.cache.free_private(r.private_blocks);
    }

    /// Kills the process and starts a new one: every request fails, the cache is empty and sequence
    /// numbers restart at 0. Block hashes stay what they were: vLLM's are deterministic (sha256 from a
    /// fixed root since 0.29), so only the sequence numbers and the empty cache tell that the engine
    /// restarted. Returns the failed requests.
    pub fn restart(&mut self) -> Vec<RequestId> {
        let failed = self.waiting.drain(..).chain(self.running.drain(..)).map(|r| r.id).collect();
        self.cache.clear();
        self.plan = None;
        self.pending_events.clear();
        self.history.clear();
        self.next_seq = 0;
        self.start_process();
        failed
    }
}

/// Of `matched_tokens` cached at the start of a prompt of `prompt_tokens`, those the engine reuses:
/// whole blocks, less the last token's, since a fully cached prompt still computes its last token
/// to produce logits.
fn reusable_tokens(matched_tokens: u64, prompt_tokens: u64, block_size: u64) -> u64 {
    let bs = block_size.max(1);
    matched_tokens.min(prompt_tokens.saturating_sub(1) / bs * bs)
}
