//! [`ShardedQueue`]: a FIFO queue whose elements live in shards by sequence number.
//!
//! Every element gets the next sequence number of the tail shard (the one whose range is
//! open upwards), so only the tail grows and splits, in halves by sequence number: the
//! older half stays, the newer half becomes the new tail. Consumers take from the first
//! shard; once it is drained (and not the tail) it is dropped: its right neighbour takes
//! over its range, and no element moves ([`AutoSharder::drop_empty_first`]).
//!
//! Pops run exclusively on the shard that holds the element, so with any number of
//! producers and consumers on any nodes every element is taken exactly once, in the order
//! the elements were pushed (a producer's pushes keep their order).

use crate::batch::Pusher;
use crate::sharder::{AutoSharder, Bounds, Hint, Shard};
use crate::vec::Element;
use crate::ShardError;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One range of sequence numbers of a [`ShardedQueue`]: elements `head..head + len`.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct QueueShard<T: Element> {
    /// Sequence number of the element at the front.
    head: u64,
    items: VecDeque<T>,
    bytes: u64,
}

impl<T: Element> Default for QueueShard<T> {
    fn default() -> Self {
        QueueShard {
            head: 0,
            items: VecDeque::new(),
            bytes: 0,
        }
    }
}

impl<T: Element> QueueShard<T> {
    fn push_all(&mut self, vs: impl IntoIterator<Item = T>) {
        for v in vs {
            self.bytes += v.footprint();
            self.items.push_back(v);
        }
    }

    fn take(&mut self, n: usize) -> Vec<T> {
        let n = n.min(self.items.len());
        let out: Vec<T> = self.items.drain(..n).collect();
        self.head += n as u64;
        self.bytes -= out.iter().map(|v| v.footprint()).sum::<u64>();
        out
    }
}

impl<T: Element> Shard for QueueShard<T> {
    type Key = u64;

    fn split(&mut self) -> Option<(u64, Self)> {
        if self.items.len() < 2 {
            return None;
        }
        let at = self.items.len() / 2;
        let right = self.items.split_off(at);
        let moved: u64 = right.iter().map(|t| t.footprint()).sum();
        self.bytes -= moved;
        let start = self.head + at as u64;
        Some((
            start,
            QueueShard {
                head: start,
                items: right,
                bytes: moved,
            },
        ))
    }

    fn merge(&mut self, mut right: Self) {
        // Only reached by a rebalance of neighbours, which are consecutive.
        self.bytes += right.bytes;
        self.items.append(&mut right.items);
    }

    fn footprint(&self) -> u64 {
        self.bytes
    }

    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// The key that reaches the tail shard.
const TAIL: u64 = u64::MAX;
/// The key that reaches the first shard (whose range is open downwards).
const FRONT: u64 = 0;

/// A FIFO queue across the cluster, for any number of producers and consumers on any
/// nodes. Serializable: pass it to proclets on other nodes and use it there.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct ShardedQueue<T: Element> {
    sharder: AutoSharder<QueueShard<T>>,
}

impl<T: Element> Clone for ShardedQueue<T> {
    fn clone(&self) -> Self {
        ShardedQueue {
            sharder: self.sharder.clone(),
        }
    }
}

/// Batching mode's writer for a [`ShardedQueue`]: see [`Pusher`]. Each batch is
/// appended contiguously.
pub type QueuePusher<T> = Pusher<T>;

impl<T: Element> ShardedQueue<T> {
    /// An empty queue in low-latency mode (shards of at most 2 MiB).
    pub fn new() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::LOW_LATENCY)
    }

    /// An empty queue in batching mode's bounds (shards of at most 32 MiB); push to it
    /// through [`ShardedQueue::pusher`] and take from it with [`ShardedQueue::try_pop`].
    pub fn batching() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::BATCHING)
    }

    /// An empty queue with these shard bounds.
    pub fn with_bounds(bounds: Bounds) -> Result<Self, ShardError> {
        Ok(ShardedQueue {
            sharder: AutoSharder::new(bounds)?,
        })
    }

    /// The machinery underneath (shard list, sizes, bounds).
    pub fn sharder(&self) -> &AutoSharder<QueueShard<T>> {
        &self.sharder
    }

    /// Append `v` at the back; returns its sequence number.
    pub fn push(&self, v: T) -> Result<u64, ShardError> {
        self.sharder
            .route(&TAIL, Hint::Grow, v, |s: &mut QueueShard<T>, v: T| {
                s.push_all([v]);
                s.head + s.items.len() as u64 - 1
            })
    }

    /// Append every element of `vs` in one call, in order; returns the sequence number
    /// of the first.
    pub fn extend(&self, vs: Vec<T>) -> Result<u64, ShardError> {
        self.sharder.route(
            &TAIL,
            Hint::Grow,
            vs,
            |s: &mut QueueShard<T>, vs: Vec<T>| {
                let first = s.head + s.items.len() as u64;
                s.push_all(vs);
                first
            },
        )
    }

    /// A batching pusher: batches of about `batch_bytes`, up to `in_flight` sent at once.
    pub fn pusher(&self, batch_bytes: u64, in_flight: usize) -> Result<QueuePusher<T>, ShardError> {
        Pusher::start(
            self.sharder.clone(),
            batch_bytes,
            in_flight,
            |_: &T| TAIL,
            |s: &mut QueueShard<T>, vs: Vec<T>| s.push_all(vs),
        )
    }

    /// Take up to `n` elements from the front, in order, in one call per shard they
    /// span; empty only if the queue was empty. Does not wait.
    pub fn try_pop(&self, n: usize) -> Result<Vec<T>, ShardError> {
        let mut out = Vec::new();
        let mut backoff = Duration::from_micros(20);
        while out.len() < n {
            let (got, last) = self.sharder.route_with_last(
                &FRONT,
                n - out.len(),
                (),
                |s: &mut QueueShard<T>, n: usize, _: &()| s.take(n),
            )?;
            let drained = got.len() < n - out.len();
            out.extend(got);
            if !drained || last {
                break;
            }
            // The first shard is drained but newer shards follow: drop it and go on.
            if !self.sharder.drop_empty_first()? {
                // Another consumer is at it, or a split is being finished: a moment.
                crate::pause(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(2));
            }
        }
        Ok(out)
    }

    /// Take the front element, waiting for one as long as it takes.
    pub fn pop(&self) -> Result<T, ShardError> {
        loop {
            if let Some(v) = self.pop_timeout(Duration::from_secs(3600))? {
                return Ok(v);
            }
        }
    }

    /// Take the front element, waiting at most `timeout` for one (`None`: still empty).
    pub fn pop_timeout(&self, timeout: Duration) -> Result<Option<T>, ShardError> {
        let started = Instant::now();
        let mut backoff = Duration::from_micros(20);
        loop {
            if let Some(v) = self.try_pop(1)?.pop() {
                return Ok(Some(v));
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Ok(None);
            }
            // Polling: an empty queue costs one small call per backoff interval.
            crate::pause(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(2));
        }
    }

    /// Number of elements (a call to every shard).
    pub fn len(&self) -> Result<u64, ShardError> {
        let lens = self
            .sharder
            .map_shards((), |s: &QueueShard<T>, ()| s.items.len() as u64)?;
        Ok(lens.into_iter().sum())
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> Result<bool, ShardError> {
        Ok(self.len()? == 0)
    }

    /// Free every shard.
    pub fn destroy(&self) -> Result<(), ShardError> {
        self.sharder.destroy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_the_older_half_and_numbers_the_newer() {
        let mut s = QueueShard::<u64>::default();
        s.push_all(0..10u64);
        assert_eq!(s.take(3), vec![0, 1, 2]);
        assert_eq!(s.head, 3);
        let (at, right) = s.split().expect("splits");
        // 7 left: 3 stay (3, 4, 5), 4 go (6..10) starting at sequence number 6.
        assert_eq!(at, 6);
        assert_eq!(right.head, 6);
        assert_eq!(s.items, [3, 4, 5]);
        assert_eq!(right.items, [6, 7, 8, 9]);
        assert_eq!(s.bytes + right.bytes, 7 * 8);
        assert!(!Shard::is_empty(&s));
        s.take(10);
        assert!(Shard::is_empty(&s));
        assert_eq!(s.bytes, 0);
    }
}
