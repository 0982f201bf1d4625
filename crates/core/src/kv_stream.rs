//! The per-endpoint sequence state machine of a KV-event consumer (`engine-protocols.md` §8).
//!
//! It decides, for each live or replayed batch, whether to apply it now, buffer it until a gap is
//! filled, drop it as a duplicate, ask for a replay, or treat the publisher as restarted. It holds the
//! batches it buffers but never applies them itself, so the gateway's ZMQ subscriber and the
//! simulator's modelled delivery path share it and feed the index the same way.

use std::collections::BTreeMap;

/// Most live batches buffered while a gap is being replayed; beyond it the oldest are dropped and
/// the replay decides what is lost.
pub const MAX_BUFFERED: usize = 65_536;

/// What the consumer must do after a live batch.
#[derive(Debug, PartialEq)]
pub enum LiveAction<T> {
    /// Apply these batches, in order.
    Apply(Vec<T>),
    /// A duplicate of something already applied: nothing to do.
    Duplicate,
    /// A gap: the batch is buffered; ask the publisher's replay socket for batches from `from` on.
    Replay {
        /// First missing sequence number.
        from: u64,
    },
    /// Sequence numbers went backwards: the engine restarted. Forget the worker's blocks, then ask
    /// for a replay from 0 (the batch that revealed the restart is buffered).
    Restart,
    /// A gap is already being replayed; the batch is buffered.
    Buffered,
}

/// The outcome of a replay.
#[derive(Debug, PartialEq)]
pub struct ReplayOutcome<T> {
    /// Batches to apply, in order (replayed ones and buffered live ones that now follow on).
    pub apply: Vec<T>,
    /// The publisher no longer had the first batch asked for: events were lost for good.
    pub history_lost: bool,
}

/// What a batch says about the process that sent it, beyond its sequence number. A restarted
/// engine that publishes the same sequence number again (its first batch was seq 0 both times)
/// reveals itself this way: its batch clears everything, or its timestamp is older than the one
/// already seen at that sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BatchMark {
    /// The batch carries `AllBlocksCleared`.
    pub clears_all: bool,
    /// The engine's timestamp on the batch, if it sent one.
    pub timestamp: Option<f64>,
}

/// Sequence tracking for one publisher (one engine, one data-parallel rank).
#[derive(Debug)]
pub struct StreamTracker<T> {
    last_live: Option<u64>,
    /// The mark of the last live batch, to tell a same-sequence restart from a duplicate.
    last_mark: BatchMark,
    applied: Option<u64>,
    buffered: BTreeMap<u64, T>,
    replay_from: Option<u64>,
}

impl<T> Default for StreamTracker<T> {
    fn default() -> Self {
        StreamTracker {
            last_live: None,
            last_mark: BatchMark::default(),
            applied: None,
            buffered: BTreeMap::new(),
            replay_from: None,
        }
    }
}

impl<T> StreamTracker<T> {
    /// A tracker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The last applied sequence number.
    pub fn applied(&self) -> Option<u64> {
        self.applied
    }

    /// Whether a replay is outstanding.
    pub fn awaiting_replay(&self) -> Option<u64> {
        self.replay_from
    }

    fn next_expected(&self) -> u64 {
        self.applied.map_or(0, |a| a + 1)
    }

    /// Starts following a publisher at `seq`, the first batch a fresh subscriber received, when no
    /// replay socket can supply what came before: earlier batches are not a gap to replay but
    /// history this subscriber never had (an engine publishes from its start, and a subscriber that
    /// joins later misses its first batches; SGLang's first is `AllBlocksCleared` at 0). Does
    /// nothing, and says so, once a batch was seen or a replay is outstanding.
    pub fn join_at(&mut self, seq: u64) -> bool {
        let fresh = self.applied.is_none() && self.replay_from.is_none() && self.last_live.is_none();
        if fresh {
            self.applied = seq.checked_sub(1);
        }
        fresh
    }

    /// Handles a batch from the live stream, knowing nothing about it but its sequence number.
    pub fn on_live(&mut self, seq: u64, batch: T) -> LiveAction<T> {
        self.on_live_marked(seq, BatchMark::default(), batch)
    }

    /// Handles a batch from the live stream. Sequence numbers going backwards are a restart; so is
    /// the last sequence number again with a batch that clears everything (when the one seen did
    /// not) or that is older than the one seen.
    pub fn on_live_marked(&mut self, seq: u64, mark: BatchMark, batch: T) -> LiveAction<T> {
        let same_seq_restart = self.last_live == Some(seq)
            && ((mark.clears_all && !self.last_mark.clears_all)
                || matches!((mark.timestamp, self.last_mark.timestamp), (Some(new), Some(old)) if new < old));
        if self.last_live.is_some_and(|last| seq < last) || same_seq_restart {
            *self = StreamTracker::default();
            self.last_live = Some(seq);
            self.last_mark = mark;
            self.buffer(seq, batch);
            self.replay_from = Some(0);
            return LiveAction::Restart;
        }
        self.last_live = Some(seq);
        self.last_mark = mark;
        self.accept(seq, batch)
    }

    /// Handles a batch fetched from the replay socket to catch up while the live stream is quiet:
    /// like a live batch, except that it says nothing about restarts and leaves the live stream's
    /// position alone (live batches it overtook arrive later and are dropped as duplicates).
    pub fn on_catch_up(&mut self, seq: u64, batch: T) -> LiveAction<T> {
        self.accept(seq, batch)
    }

    fn accept(&mut self, seq: u64, batch: T) -> LiveAction<T> {
        let expected = self.next_expected();
        if seq < expected {
            return LiveAction::Duplicate;
        }
        if seq == expected && self.replay_from.is_none() {
            let mut out = vec![batch];
            self.applied = Some(seq);
            out.extend(self.drain_contiguous());
            return LiveAction::Apply(out);
        }
        self.buffer(seq, batch);
        if self.replay_from.is_some() {
            return LiveAction::Buffered;
        }
        self.replay_from = Some(expected);
        LiveAction::Replay { from: expected }
    }

    /// Handles the reply to the outstanding replay request: the batches the publisher still had,
    /// with `seq >= from`, in any order. An empty or failed reply is `replayed = []`.
    pub fn on_replay(&mut self, replayed: Vec<(u64, T)>) -> ReplayOutcome<T> {
        let from = self.replay_from.take().unwrap_or_else(|| self.next_expected());
        let mut replayed: BTreeMap<u64, T> = replayed.into_iter().filter(|(s, _)| *s >= from).collect();
        let first_available = replayed.keys().next().copied().or_else(|| self.buffered.keys().next().copied());
        let history_lost = first_available.is_some_and(|first| first > from);
        for (seq, batch) in std::mem::take(&mut self.buffered) {
            replayed.entry(seq).or_insert(batch);
        }
        self.buffered = replayed;
        if history_lost {
            // Accept a partial view: continue from the first batch still available.
            if let Some(&first) = self.buffered.keys().next() {
                self.applied = first.checked_sub(1);
            }
        }
        let apply = self.drain_contiguous();
        ReplayOutcome { apply, history_lost }
    }

    fn buffer(&mut self, seq: u64, batch: T) {
        self.buffered.insert(seq, batch);
        while self.buffered.len() > MAX_BUFFERED {
            self.buffered.pop_first();
        }
    }

    fn drain_contiguous(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        loop {
            let expected = self.next_expected();
            match self.buffered.first_key_value() {
                Some((&seq, _)) if seq < expected => {
                    self.buffered.pop_first();
                }
                Some((&seq, _)) if seq == expected => {
                    let (_, batch) = self.buffered.pop_first().expect("present");
                    self.applied = Some(seq);
                    out.push(batch);
                }
                _ => return out,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_batches_apply_and_duplicates_drop() {
        let mut t = StreamTracker::new();
        assert_eq!(t.on_live(0, "a"), LiveAction::Apply(vec!["a"]));
        assert_eq!(t.on_live(1, "b"), LiveAction::Apply(vec!["b"]));
        assert_eq!(t.on_live(1, "b"), LiveAction::Duplicate);
    }

    #[test]
    fn a_gap_is_buffered_replayed_and_drained_in_order() {
        let mut t = StreamTracker::new();
        t.on_live(0, 0);
        assert_eq!(t.on_live(3, 3), LiveAction::Replay { from: 1 });
        assert_eq!(t.on_live(4, 4), LiveAction::Buffered);
        let out = t.on_replay(vec![(2, 2), (1, 1), (3, 3)]);
        assert_eq!(out, ReplayOutcome { apply: vec![1, 2, 3, 4], history_lost: false });
        assert_eq!(t.on_live(5, 5), LiveAction::Apply(vec![5]));
    }

    #[test]
    fn a_late_subscriber_joins_where_it_came_in_without_a_gap() {
        let mut t = StreamTracker::new();
        assert!(t.join_at(12));
        assert_eq!(t.on_live(12, 12), LiveAction::Apply(vec![12]));
        assert_eq!(t.on_live(14, 14), LiveAction::Replay { from: 13 }, "a later gap is still a gap");
        // Joining is only for a subscriber that has seen nothing.
        let mut t = StreamTracker::new();
        t.on_live(0, 0);
        assert!(!t.join_at(9));
        assert_eq!(t.on_live(9, 9), LiveAction::Replay { from: 1 });
        let mut t = StreamTracker::new();
        t.join_at(0);
        assert_eq!(t.on_live(0, 0), LiveAction::Apply(vec![0]));
    }

    #[test]
    fn lost_history_is_reported_and_the_stream_continues_from_what_remains() {
        let mut t = StreamTracker::new();
        assert_eq!(t.on_live(7, 7), LiveAction::Replay { from: 0 });
        let out = t.on_replay(vec![(5, 5), (6, 6)]);
        assert_eq!(out, ReplayOutcome { apply: vec![5, 6, 7], history_lost: true });
        let mut t = StreamTracker::new();
        t.on_live(3, 3);
        assert_eq!(t.on_replay(vec![]), ReplayOutcome { apply: vec![3], history_lost: true });
    }

    #[test]
    fn the_same_sequence_again_is_a_restart_when_it_clears_all_or_goes_back_in_time() {
        let at = |ts: f64, clears_all: bool| BatchMark { clears_all, timestamp: Some(ts) };
        let mut t = StreamTracker::new();
        assert_eq!(t.on_live_marked(0, at(100.0, false), "old"), LiveAction::Apply(vec!["old"]));
        assert_eq!(t.on_live_marked(0, at(100.0, false), "old"), LiveAction::Duplicate);
        assert_eq!(t.on_live_marked(0, at(200.0, true), "new"), LiveAction::Restart);
        assert_eq!(t.on_replay(vec![(0, "new")]).apply, vec!["new"]);
        let mut t = StreamTracker::new();
        t.on_live_marked(0, at(100.0, false), "old");
        assert_eq!(t.on_live_marked(0, at(50.0, false), "new"), LiveAction::Restart, "an older timestamp");
    }

    #[test]
    fn live_batches_overtaken_by_a_catch_up_are_duplicates_not_a_restart() {
        let mut t = StreamTracker::new();
        t.on_live(0, 0);
        assert_eq!(t.on_catch_up(1, 1), LiveAction::Apply(vec![1]));
        assert_eq!(t.on_catch_up(2, 2), LiveAction::Apply(vec![2]));
        assert_eq!(t.on_live(1, 1), LiveAction::Duplicate);
        assert_eq!(t.on_live(3, 3), LiveAction::Apply(vec![3]));
    }

    #[test]
    fn sequence_going_backwards_is_a_restart() {
        let mut t = StreamTracker::new();
        t.on_live(0, 0);
        t.on_live(1, 1);
        assert_eq!(t.on_live(0, 100), LiveAction::Restart);
        assert_eq!(t.on_replay(vec![(0, 100)]), ReplayOutcome { apply: vec![100], history_lost: false });
        assert_eq!(t.on_live(1, 101), LiveAction::Apply(vec![101]));
    }
}
