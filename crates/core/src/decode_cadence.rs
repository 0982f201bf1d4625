//! A worker's decode steps, timed by the blocks its engine fills while decoding.
//!
//! vLLM caches a block of generated tokens as soon as the decode fills it and publishes it as a
//! one-block `BlockStored` chained to the sequence's previous block, in the batch of the step that
//! filled it, stamped with the engine's clock. A sequence decodes one token a step, so two of its
//! consecutive decode-filled blocks are exactly `block_size` steps apart, and in those steps every
//! other sequence that decoded throughout filled exactly one block too. The engine's own batches
//! therefore give both the time of `block_size` steps and the batch they ran with, with nothing
//! timed by the gateway: a stream timed from its first bytes to its end measures the API server
//! and the network as well, and on a busy host its tokens can arrive all at once.
//!
//! A sequence is followed by its tail: the key its next block chains from, first its prompt's
//! last full block. Tails outlive their requests for a while, because the events can reach the
//! router after the response has ended (by 0.3 s typically, and up to 2 s, on the real-engine
//! suite's 2-core machine). SGLang publishes no decode-filled blocks; its workers keep the stream
//! timing ([`crate::fleet`]).

use std::time::Duration;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::ids::BlockKey;
use crate::index::StoredRun;
use crate::time::Timestamp;

/// The longest span between two decode-filled blocks of one sequence that makes a point: longer
/// ones spanned a preemption or a stall, not `block_size` decode steps.
pub const DECODE_SPAN_MAX_SECONDS: f64 = 60.0;

/// How long a sequence is followed after its last block or its dispatch: past its request's end,
/// for the events that arrive after the response.
pub const DECODE_TAIL_KEPT: Duration = Duration::from_secs(30);

/// The most sequences followed on one worker; beyond it new ones are not timed.
pub const MAX_DECODE_TAILS: usize = 1 << 16;

/// Where the engine's batches stood when one of a sequence's decode-filled blocks was stored.
#[derive(Debug, Clone, Copy, PartialEq)]
struct DecodeMark {
    engine_time_s: f64,
    rank: Option<u32>,
    /// Decode-filled blocks its rank's batches had stored, that batch included.
    decode_blocks: u64,
    /// Prompt tokens its rank's batches had stored, that batch included.
    prompt_tokens: u64,
}

/// One followed sequence, under the key its next block chains from.
#[derive(Debug, Clone, Copy, PartialEq)]
struct DecodeTail {
    /// Its latest decode-filled block, once one was stored.
    mark: Option<DecodeMark>,
    /// When the router last heard of it (its dispatch, then its blocks).
    touched: Timestamp,
}

/// `block_size` decode steps of one sequence, as the engine's batches timed them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DecodeSpan {
    /// Engine seconds between the two blocks.
    pub(crate) seconds: f64,
    /// The sequences that decoded through the span: the decode-filled blocks stored in it.
    pub(crate) batch: u64,
    /// Prompt tokens the engine's batches stored in the span: prefill chunks its steps carried.
    pub(crate) prompt_tokens: u64,
}

/// What one publisher rank's batches stored since start: each data-parallel rank runs its own
/// batch, so a span counts only its own rank's blocks.
#[derive(Debug, Clone, Copy, Default)]
struct Stored {
    decode_blocks: u64,
    prompt_tokens: u64,
}

/// One worker's followed sequences and counts of what its batches stored.
#[derive(Debug, Clone, Default)]
pub(crate) struct DecodeCadence {
    tails: FxHashMap<BlockKey, DecodeTail>,
    stored: SmallVec<[(Option<u32>, Stored); 1]>,
    /// Whether any of the worker's sequences was seen filling a block while decoding.
    publishes_decode_blocks: bool,
    last_purge: Option<Timestamp>,
}

impl DecodeCadence {
    /// Whether the engine publishes decode-filled blocks, so its decode is timed by them.
    pub(crate) fn publishes_decode_blocks(&self) -> bool {
        self.publishes_decode_blocks
    }

    /// Follows a sequence dispatched at `now` whose prompt's last full block is `prompt_last`. A
    /// prompt shorter than a block is not followed (its first decode-filled block chains from the
    /// namespace's root, like every other such prompt's), nor one whose prompt another followed
    /// sequence also ends with (its blocks could not be told from the other's).
    pub(crate) fn follow(&mut self, prompt_last: Option<BlockKey>, now: Timestamp) {
        if let Some(key) = prompt_last {
            if self.tails.len() < MAX_DECODE_TAILS {
                self.tails.entry(key).or_insert(DecodeTail { mark: None, touched: now });
            }
        }
    }

    /// Folds in the runs one live batch stored, stamped `engine_time_s` on `rank` and received at
    /// `now`, `stored_tokens` tokens in all; `held[i]` says whether an in-flight prompt holds
    /// `runs[i]`'s first block. A one-block run that no prompt holds is a decode-filled block;
    /// one that chains from a followed sequence's tail is that sequence's. Returns the span each
    /// such sequence decoded since its previous one.
    pub(crate) fn observe_batch(
        &mut self,
        runs: &[StoredRun],
        held: &[bool],
        stored_tokens: u64,
        block_size: u32,
        (engine_time_s, rank): (f64, Option<u32>),
        now: Timestamp,
    ) -> SmallVec<[DecodeSpan; 8]> {
        self.purge(now);
        let mut decoding: SmallVec<[(DecodeTail, BlockKey); 8]> = SmallVec::new();
        let mut decoded_blocks = 0u64;
        for (run, &held) in runs.iter().zip(held) {
            if run.blocks != 1 || held {
                continue;
            }
            // Every one-block run no prompt holds counts in the batch, followed or not: a peer
            // replica's sequences decode in the same steps, and so do prompts shorter than a block.
            decoded_blocks += 1;
            if let Some(tail) = self.tails.remove(&run.parent) {
                decoding.push((tail, run.first));
            }
        }
        self.publishes_decode_blocks |= !decoding.is_empty();
        let stored = self.stored_on(rank);
        stored.decode_blocks += decoded_blocks;
        stored.prompt_tokens += stored_tokens.saturating_sub(decoded_blocks * u64::from(block_size));
        let mark = DecodeMark {
            engine_time_s,
            rank,
            decode_blocks: stored.decode_blocks,
            prompt_tokens: stored.prompt_tokens,
        };
        let mut spans = SmallVec::new();
        for (tail, key) in decoding {
            if let Some(before) = tail.mark.filter(|m| m.rank == rank) {
                let seconds = engine_time_s - before.engine_time_s;
                if seconds > 0.0 && seconds <= DECODE_SPAN_MAX_SECONDS {
                    spans.push(DecodeSpan {
                        seconds,
                        batch: mark.decode_blocks - before.decode_blocks,
                        prompt_tokens: mark.prompt_tokens - before.prompt_tokens,
                    });
                }
            }
            self.tails.insert(key, DecodeTail { mark: Some(mark), touched: now });
        }
        spans
    }

    /// The counts of `rank`'s batches.
    fn stored_on(&mut self, rank: Option<u32>) -> &mut Stored {
        let at = match self.stored.iter().position(|(r, _)| *r == rank) {
            Some(at) => at,
            None => {
                self.stored.push((rank, Stored::default()));
                self.stored.len() - 1
            }
        };
        &mut self.stored[at].1
    }

    /// Forgets sequences not heard of for [`DECODE_TAIL_KEPT`], once a second.
    fn purge(&mut self, now: Timestamp) {
        if self.last_purge.is_some_and(|at| now.saturating_since(at) < Duration::from_secs(1)) {
            return;
        }
        self.last_purge = Some(now);
        self.tails.retain(|_, tail| now.saturating_since(tail.touched) <= DECODE_TAIL_KEPT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> BlockKey {
        BlockKey(n)
    }

    /// A one-block run chained from `parent`.
    fn block(parent: u64, first: u64) -> StoredRun {
        StoredRun { parent: key(parent), first: key(first), blocks: 1 }
    }

    fn at(s: f64) -> Timestamp {
        Timestamp::from_secs_f64(s)
    }

    #[test]
    fn a_span_counts_the_blocks_and_prompt_tokens_stored_after_a_sequences_block_up_to_its_next() {
        let mut cadence = DecodeCadence::default();
        cadence.follow(Some(key(1)), at(0.0));
        cadence.follow(Some(key(10)), at(0.0));
        // Both sequences' first decode-filled blocks; the first starts a span, so no point.
        let none = cadence.observe_batch(&[block(1, 2), block(10, 11)], &[false, false], 32, 16, (1.0, None), at(1.0));
        assert!(none.is_empty() && cadence.publishes_decode_blocks());
        // A prompt of 512 tokens (held by its request), and a block of a sequence not followed (a
        // peer replica's).
        let prompt = StoredRun { parent: key(50), first: key(51), blocks: 32 };
        cadence.observe_batch(&[prompt, block(70, 71)], &[true, false], 512 + 16, 16, (1.1, None), at(1.1));
        cadence.observe_batch(&[block(11, 12)], &[false], 16, 16, (1.2, None), at(1.2));
        let spans = cadence.observe_batch(&[block(2, 3)], &[false], 16, 16, (1.5, None), at(1.5));
        assert_eq!(spans.len(), 1);
        assert!((spans[0].seconds - 0.5).abs() < 1e-12);
        assert_eq!((spans[0].batch, spans[0].prompt_tokens), (3, 512), "its own block and both others'");
    }

    #[test]
    fn a_span_counts_only_the_blocks_of_its_own_rank() {
        let mut cadence = DecodeCadence::default();
        cadence.follow(Some(key(1)), at(0.0));
        cadence.observe_batch(&[block(1, 2)], &[false], 16, 16, (1.0, Some(0)), at(1.0));
        // Rank 1 runs its own batch of three.
        let others = [block(20, 21), block(30, 31), block(40, 41)];
        cadence.observe_batch(&others, &[false; 3], 48 + 256, 16, (1.2, Some(1)), at(1.2));
        let spans = cadence.observe_batch(&[block(2, 3)], &[false], 16, 16, (1.5, Some(0)), at(1.5));
        assert_eq!((spans[0].batch, spans[0].prompt_tokens), (1, 0));
    }

    #[test]
    fn a_block_a_prompt_holds_was_prefilled_even_where_it_continues_a_sequence() {
        let mut cadence = DecodeCadence::default();
        cadence.follow(Some(key(1)), at(0.0));
        // A longer prompt that starts with this one stores its next block.
        cadence.observe_batch(&[block(1, 2)], &[true], 16, 16, (1.0, None), at(1.0));
        assert!(!cadence.publishes_decode_blocks());
        assert_eq!(cadence.observe_batch(&[block(1, 3)], &[false], 16, 16, (1.1, None), at(1.1)).len(), 0);
        assert!(cadence.publishes_decode_blocks(), "the sequence's own block");
    }

    #[test]
    fn spans_across_ranks_or_too_long_make_no_point_and_quiet_sequences_are_forgotten() {
        let mut cadence = DecodeCadence::default();
        cadence.follow(Some(key(1)), at(0.0));
        let mut next = |parent: u64, engine_s: f64, rank: u32, router_s: f64| {
            let run = [block(parent, parent + 1)];
            cadence.observe_batch(&run, &[false], 16, 16, (engine_s, Some(rank)), at(router_s)).len()
        };
        assert_eq!(next(1, 1.0, 0, 1.0), 0);
        assert_eq!(next(2, 1.1, 1, 1.1), 0, "another rank");
        assert_eq!(next(3, 2.0 + DECODE_SPAN_MAX_SECONDS, 1, 2.0), 0, "too long");
        assert_eq!(next(4, 2.2 + DECODE_SPAN_MAX_SECONDS, 1, 2.2), 1);
        let quiet = 2.2 + DECODE_TAIL_KEPT.as_secs_f64() + 1.0;
        assert_eq!(next(5, 3.0 + DECODE_SPAN_MAX_SECONDS, 1, quiet), 0, "forgotten");
        assert!(cadence.tails.is_empty());
    }
}
