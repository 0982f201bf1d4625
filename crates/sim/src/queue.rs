//! The event queue: ordered by `(time, sequence number)`, so events at the same instant run in the
//! order they were scheduled and every run with the same seed is identical.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvgate_core::Timestamp;

/// A min-queue of events by time, FIFO among equal times.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(Timestamp, u64, Slot<E>)>>,
    next_seq: u64,
}

/// Wraps an event so that ordering never looks at it.
#[derive(Debug)]
struct Slot<E>(E);

impl<E> PartialEq for Slot<E> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<E> Eq for Slot<E> {}
impl<E> PartialOrd for Slot<E> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Slot<E> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue { heap: BinaryHeap::new(), next_seq: 0 }
    }
}

impl<E> EventQueue<E> {
    /// Schedules `event` at `at`.
    pub fn push(&mut self, at: Timestamp, event: E) {
        self.heap.push(Reverse((at, self.next_seq, Slot(event))));
        self.next_seq += 1;
    }

    /// The earliest event.
    pub fn pop(&mut self) -> Option<(Timestamp, E)> {
        self.heap.pop().map(|Reverse((at, _, Slot(e)))| (at, e))
    }

    /// Events pending.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_times_pop_in_scheduling_order() {
        let mut q = EventQueue::default();
        q.push(Timestamp(5), "b");
        q.push(Timestamp(1), "a");
        q.push(Timestamp(5), "c");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).map(|(_, e)| e).collect();
        assert_eq!(order, vec!["a", "b", "c"]);
    }
}
