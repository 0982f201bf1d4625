//! The prompt cache's counters (`kvgate-tokenizer`'s `prompt_cache`), copied from the tokenizer at
//! each scrape: how many chunks and bytes of prompts came from the cache, and its memory.

use kvgate_tokenizer::prompt_cache::PromptCacheStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The prompt cache's metrics; all stay 0 without a cache.
#[derive(Debug, Default)]
pub struct TokenizeCacheMetrics {
    hits: Counter,
    misses: Counter,
    hit_bytes: Counter,
    miss_bytes: Counter,
    bytes: Gauge,
    entries: Gauge,
    capacity: Gauge,
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
        m
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
        let gauge = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        gauge(&self.bytes, stats.bytes);
        gauge(&self.entries, stats.entries);
        gauge(&self.capacity, stats.capacity_bytes);
    }
}
