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
    /// Dropped once the prompt's blocks are published.
    tokens: Vec<u32>,
    hashes: Vec<EngineHash>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Leading prompt blocks taken from the cache at admission.
    matched_blocks: usize,
    /// Leading prompt blocks published to the prefix cache so far (matched ones included).
    published_blocks: usize,
    prefilled: u64,
    output_tokens: u32,
    generated: u32,
    /// Private blocks held (partial prompt tail, decode, and full blocks until published).
    private_blocks: u64,
    /// Uncached tokens estimated at arrival, for telemetry while queued.
    uncached_at_arrival: u64,
    /// Tokens computed after the sequence's last full block: the prompt's tail, then the generated
    /// tokens fed back in (vLLM flavour, which caches a block of them as soon as it is full).
    tail: Vec<u32>,
}

impl Active {
    fn prefill_left(&self) -> u64 {
        self.prompt_tokens - self.cached_tokens - self.prefilled
    }
}

/// The plan of the step in progress: per running request, decode (true) or a prefill chunk.
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
            matched_blocks: 0,
            published_blocks: 0,
            prefilled: 0,
            output_tokens: req.output_tokens.max(1),
            generated: 0,
            private_blocks: 0,
            uncached_at_arrival: prompt_tokens - reusable_tokens(matched, prompt_tokens, bs as u64),
            tail: Vec::new(),
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
        let bs = self.profile.block_size as u64;
        let mut budget = self.profile.chunk_budget as u64;
        let mut plan = Plan::default();
        let (mut n, mut context, mut prefill) = (0u64, 0u64, 0u64);
        for (i, r) in self.running.iter().enumerate() {
            if r.prefill_left() == 0 && budget > 0 {
                plan.work.push((i, 0));
                n += 1;
                context += r.prompt_tokens + r.generated as u64;
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            let left = r.prefill_left();
            if left > 0 && budget > 0 {
                let chunk = left.min(budget);
                plan.work.push((i, chunk));
                prefill += chunk;
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
            let mut r = self.waiting.pop_front().expect("front exists");
            for h in &r.hashes[..matched] {
                self.cache.acquire(*h);
            }
            let allocated = self.cache.allocate_private(need, &mut self.pending_events);
            debug_assert!(allocated);
            r.private_blocks = need;
            r.matched_blocks = matched;
            r.cached_tokens = reusable_tokens(matched as u64 * bs, r.prompt_tokens, bs);
            self.prompt_tokens_total += r.prompt_tokens;
            self.cached_tokens_total += r.cached_tokens;
            let chunk = r.prefill_left().min(budget);
            self.running.push(r);
            plan.work.push((self.running.len() - 1, chunk));
            prefill += chunk;
            budget -= chunk;
        }
        if plan.work.is_empty() {
            return None;
        }
        let micros = self.profile.step_micros(n, context, prefill);
        self.decoded = (self.decoded.0 + n, self.decoded.1 + context);
        self.plan = Some(plan);
        Some(micros)
    }

    /// Applies the planned step.
    pub fn end_step(&mut self) -> StepOutcome {
        let mut out = StepOutcome::default();
        let Some(plan) = self.plan.take() else {
            return out;
        };
        for (i, chunk) in plan.work {
            let r = &mut self.running[i];
            if chunk == 0 {
                r.generated += 1;
                out.decoded.push(r.id);
                if self.profile.flavor == Flavor::Vllm {
                    self.cache_generated_block(i);
                }
                continue;
            }
            r.prefilled += chunk;
            // Full blocks enter the prefix cache as soon as their tokens are computed, chunk by chunk,
            // as vLLM and SGLang publish them.
            let bs = self.profile.block_size as u64;
            let computed_blocks = (((r.cached_tokens + r.prefilled) / bs) as usize).min(r.hashes.len());
            let start = r.published_blocks.max(r.matched_blocks);
            if computed_blocks > start {
                let hashes = std::mem::take(&mut r.hashes);
                r.private_blocks -= (computed_blocks - start) as u64;
                r.published_blocks = computed_blocks;
                let tokens = std::mem::take(&mut r.tokens);
                self.publish(&hashes[..computed_blocks], &tokens, start);
                let r = &mut self.running[i];
                r.hashes = hashes;
                r.tokens = tokens;
            }
            let r = &mut self.running[i];
            if r.prefill_left() == 0 {
                r.generated = 1;
                let tokens = std::mem::take(&mut r.tokens);
                if self.profile.flavor == Flavor::Vllm {
                    r.tail = tokens[tokens.len() / bs as usize * bs as usize..].to_vec();
                }
                out.first_tokens.push(r.id);
            }
        }
        // Finished requests leave; the rest keep their FCFS order for the next step's prefill chunks.
        let mut kept = Vec::with_capacity(self.running.len());
        for r in std::mem::take(&mut self.running) {
            if r.prefill_left() == 0 && r.generated >= r.output_tokens {
                for h in &r.hashes {
                    self.cache.release(*h);
                }
                self.cache.free_private(r.private_blocks);
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

    /// Feeds running request `i`'s newest generated token back in (it has just decoded one): once
    /// that fills a block, vLLM caches the block and publishes it, one block chained to the
    /// sequence's last, as it does every decode-filled block. The model's output tokens are
    /// pseudo-random ids of the request, so such a block only ever matches its own sequence.
    fn cache_generated_block(&mut self, i: usize) {
        let bs = self.profile.block_size as usize;
        let r = &mut self.running[i];
        // The token sampled last step is computed this step: the `generated − 1`-th, from 1.
        let fed = u64::from(r.generated).saturating_sub(2);
        r.tail.extend(kvgate_core::hashing::synthetic_tokens(r.id.0 ^ fed.rotate_left(32), 1));
        if r.tail.len() < bs {
            return;
        }
        let tokens = std::mem::take(&mut r.tail);
        let parent = r.hashes.last().copied();
        let hash = EngineHash(self.hasher.block_key(BlockKey(parent.map_or(self.salt, |h| h.0)), &tokens).0);
        let r = &mut self.running[i];
        r.hashes.push(hash);
        r.published_blocks = r.hashes.len();
        r.private_blocks = r.private_blocks.saturating_sub(1);
        if self.cache.publish(hash) {
            self.pending_events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: bs as u32,
                medium: Some("GPU".into()),
                ..BlockStored::default()
            }));
        }
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
            self.release(r);
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
        self.release(r);
        true
    }

    fn release(&mut self, r: Active) {
        for h in &r.hashes[..r.published_blocks.max(r.matched_blocks).min(r.hashes.len())] {
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
