//! The prompt cache's counters (`kvgate-tokenizer`'s `prompt_cache`), copied from the tokenizer at
//! each scrape: how many chunks and bytes of prompts came from the cache, and its memory; how many
//! prompts were routed on their start with the rest left untokenized, and how good the estimate of
//! that rest was where it was checked.

use std::sync::atomic::{AtomicU64, Ordering};

use kvgate_tokenizer::prompt_cache::PromptCacheStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Buckets of estimated over actual tokens: the router's projection is a few percent off at most
/// in the middle buckets.
const RATIO_BUCKETS: [f64; 13] = [0.5, 0.67, 0.8, 0.9, 0.95, 0.98, 1.0, 1.02, 1.05, 1.1, 1.25, 1.5, 2.0];

/// The prompt cache's metrics; all stay 0 without a cache.
#[derive(Debug)]
pub struct TokenizeCacheMetrics {
    hits: Counter,
    misses: Counter,
    hit_bytes: Counter,
    miss_bytes: Counter,
    bytes: Gauge,
    entries: Gauge,
    capacity: Gauge,
    partial_prompts: Counter,
    untokenized_bytes: Counter,
    /// Estimated over actual tokens of checked rests.
    pub estimate_ratio: Histogram,
    /// When the estimate was last checked, in microseconds of the gateway's clock (`u64::MAX`:
    /// never).
    last_check_us: AtomicU64,
}

impl Default for TokenizeCacheMetrics {
    fn default() -> Self {
        TokenizeCacheMetrics {
            hits: Counter::default(),
            misses: Counter::default(),
            hit_bytes: Counter::default(),
            miss_bytes: Counter::default(),
            bytes: Gauge::default(),
            entries: Gauge::default(),
            capacity: Gauge::default(),
            partial_prompts: Counter::default(),
            untokenized_bytes: Counter::default(),
            estimate_ratio: Histogram::new(RATIO_BUCKETS),
            last_check_us: AtomicU64::new(u64::MAX),
        }
    }
}

impl TokenizeCacheMetrics {
    /// Registers the metrics in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = TokenizeCacheMetrics::default();
        registry.register("tokenize_cache_hits", "Prompt chunks whose token ids came from the cache", m.hits.clone());
        registry.register("tokenize_cache_misses", "Prompt chunks tokenized and then cached", m.misses.clone());
        registry.register(
            "tokenize_cache_hit_bytes",
            "Prompt bytes whose token ids came from the cache",
            m.hit_bytes.clone(),
        );
        registry.register(
            "tokenize_cache_miss_bytes",
            "Bytes of cut prompts that were tokenized: new chunks and each prompt's uncut tail",
            m.miss_bytes.clone(),
        );
        registry.register("tokenize_cache_bytes", "Memory the cached chunks take", m.bytes.clone());
        registry.register("tokenize_cache_entries", "Chunks in the cache", m.entries.clone());
        registry.register("tokenize_cache_capacity_bytes", "The cache's memory budget", m.capacity.clone());
        registry.register(
            "tokenize_partial_prompts",
            "Prompts routed on their start: no worker held a block past it, and the rest was left untokenized",
            m.partial_prompts.clone(),
        );
        registry.register(
            "tokenize_untokenized_bytes",
            "Prompt bytes left untokenized because no worker held them",
            m.untokenized_bytes.clone(),
        );
        registry.register(
            "tokenize_estimate_ratio",
            "Estimated over actual tokens of an untokenized prompt end, for the ones tokenized afterwards to check (tokenize_check_interval_ms)",
            m.estimate_ratio.clone(),
        );
        m
    }

    /// Whether to check the estimate of a partial prompt seen at `now_us`: the first one, then at
    /// most one per `interval_us` (never for 0). A check costs a whole tokenization (12 ms for a
    /// never-seen 32 KB prompt), so it is paced by time, not by traffic.
    pub fn check_now(&self, now_us: u64, interval_us: u64) -> bool {
        if interval_us == 0 {
            return false;
        }
        let last = self.last_check_us.load(Ordering::Relaxed);
        if last != u64::MAX && now_us.saturating_sub(last) < interval_us {
            return false;
        }
        self.last_check_us.compare_exchange(last, now_us, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    /// Copies the tokenizer's counters.
    pub fn observe(&self, stats: &PromptCacheStats) {
        let catch_up = |c: &Counter, to: u64| {
            c.inc_by(to.saturating_sub(c.get()));
        };
        catch_up(&self.hits, stats.hits);
        catch_up(&self.misses, stats.misses);
        catch_up(&self.hit_bytes, stats.hit_bytes);
        catch_up(&self.miss_bytes, stats.miss_bytes);
        catch_up(&self.partial_prompts, stats.partial_prompts);
        catch_up(&self.untokenized_bytes, stats.untokenized_bytes);
        let gauge = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        gauge(&self.bytes, stats.bytes);
        gauge(&self.entries, stats.entries);
        gauge(&self.capacity, stats.capacity_bytes);
    }
}
