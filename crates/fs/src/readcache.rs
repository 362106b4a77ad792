//! The mount's cache of stripes read from stores, bounded in bytes, oldest out first.
//!
//! Keys are (inode, stripe, version): a rewritten stripe has a new version, so a stale
//! copy is never served, only aged out. Each entry is a cell filled once by the first
//! reader, so readers of the same stripe share one fetch. A failed fetch is not kept: a
//! later read tries the stores again.

use crate::meta::Ino;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use tokio::sync::OnceCell;

/// A stripe's bytes, or the errno its fetch failed with.
pub type Fetched = Result<Bytes, i32>;
/// One cached stripe: filled once.
pub type Entry = Arc<OnceCell<Fetched>>;
/// (inode, stripe, version).
pub type Key = (Ino, u64, u64);

#[derive(Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    order: VecDeque<(Key, u64)>,
    bytes: u64,
}

pub struct ReadCache {
    /// Bytes kept at most (never below two stripes: a reader and its read-ahead).
    limit: u64,
    /// Bytes an entry counts for.
    stripe: u64,
    inner: Mutex<Inner>,
}

impl ReadCache {
    pub fn new(limit: u64, stripe: u64) -> ReadCache {
        ReadCache {
            limit: limit.max(stripe * 2),
            stripe,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Whether the stripe's bytes are here already.
    pub fn has(&self, key: Key) -> bool {
        self.inner
            .lock()
            .entries
            .get(&key)
            .is_some_and(|e| e.initialized())
    }

    /// The stripe's entry, and whether it was there (a hit); a new one makes room by
    /// dropping the oldest.
    pub fn entry(&self, key: Key) -> (Entry, bool) {
        let mut c = self.inner.lock();
        if let Some(e) = c.entries.get(&key) {
            return (e.clone(), true);
        }
        let e: Entry = Arc::new(OnceCell::new());
        c.entries.insert(key, e.clone());
        c.order.push_back((key, self.stripe));
        c.bytes += self.stripe;
        while c.bytes > self.limit {
            let Some((k, b)) = c.order.pop_front() else {
                break;
            };
            c.entries.remove(&k);
            c.bytes -= b;
        }
        (e, false)
    }

    /// Drop `entry` (its fetch failed), unless the key has another entry by now.
    pub fn forget(&self, key: Key, entry: &Entry) {
        let mut c = self.inner.lock();
        if c.entries.get(&key).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            c.entries.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_stripes_leave_first_when_the_bytes_run_out() {
        let c = ReadCache::new(3 * 10, 10);
        for v in 1..=3 {
            let (e, hit) = c.entry((1, 0, v));
            assert!(!hit);
            e.set(Ok(Bytes::from_static(b"x"))).unwrap();
        }
        assert!(c.entry((1, 0, 2)).1, "a hit");
        c.entry((1, 0, 4));
        assert!(!c.has((1, 0, 1)), "the oldest went");
        assert!(c.has((1, 0, 2)) && c.has((1, 0, 3)));
        assert!(!c.has((1, 0, 4)), "there but not filled");
    }

    #[test]
    fn a_failed_fetch_is_forgotten_but_not_a_newer_entry() {
        let c = ReadCache::new(100, 10);
        let (e, _) = c.entry((1, 0, 1));
        c.forget((1, 0, 1), &e);
        let (e2, hit) = c.entry((1, 0, 1));
        assert!(!hit, "forgotten");
        c.forget((1, 0, 1), &e);
        assert!(c.entry((1, 0, 1)).1, "the newer entry stays");
        drop(e2);
    }

    #[test]
    fn never_less_than_two_stripes() {
        let c = ReadCache::new(0, 10);
        c.entry((1, 0, 1));
        c.entry((1, 1, 1));
        assert!(c.entry((1, 0, 1)).1);
    }
}
