//! Room promised to writes whose stripes are not on a store yet.
//!
//! The kernel hands the mount each `write()` as it happens (no write-back cache), and the
//! mount acknowledges it before the stripe reaches its stores. To make that
//! acknowledgement a promise it can keep, a write takes room for every stripe buffer it
//! opens *before* it is acknowledged: a stripe's worth per copy. The room is held while
//! the stripe is buffered and while it is being sent, and given back once the stores
//! have taken it (their own accounting counts it then) or refused it. A write that finds
//! no room fails with ENOSPC at once, in the writer's `write()`, instead of at a later
//! `fsync` after the bytes were already acknowledged.
//!
//! While a stripe is being sent it is counted twice (here and by the store's own
//! reservation), so the mount reports full at most `fs.write_behind` stripes early;
//! never late.

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes promised to buffered and in-flight stripes.
#[derive(Debug, Default)]
pub struct Room {
    promised: AtomicU64,
}

impl Room {
    /// Promise `bytes` if stores with `free` bytes left can still hold them beside what
    /// is promised already. Returns whether the promise was made.
    pub fn try_take(&self, bytes: u64, free: u64) -> bool {
        self.promised
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                p.checked_add(bytes).filter(|&after| after <= free)
            })
            .is_ok()
    }

    /// Promise `bytes` whatever is left: for a buffer a writer must open after all
    /// (another thread sent the stripe between the writer's look and its write). At
    /// most one stripe per such race; the stores' own accounting still refuses what
    /// does not fit, and write-behind reports that at the next fsync.
    pub fn force_take(&self, bytes: u64) {
        self.promised.fetch_add(bytes, Ordering::AcqRel);
    }

    /// A promise ends: the stripe is on its stores, or failed, or was never opened.
    pub fn give_back(&self, bytes: u64) {
        let r = self
            .promised
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                Some(p.saturating_sub(bytes))
            });
        debug_assert!(
            r.is_ok_and(|p| p >= bytes),
            "gave back more room than promised"
        );
    }

    /// Bytes promised now.
    pub fn promised(&self) -> u64 {
        self.promised.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn promises_stop_at_the_free_bytes_and_come_back() {
        let r = Room::default();
        assert!(r.try_take(4, 10));
        assert!(r.try_take(6, 10));
        assert!(!r.try_take(1, 10), "10 of 10 promised");
        r.give_back(6);
        assert_eq!(r.promised(), 4);
        assert!(r.try_take(6, 10));
        assert!(!r.try_take(u64::MAX, u64::MAX), "no overflow");
    }

    #[test]
    fn forced_promises_count_against_later_ones() {
        let r = Room::default();
        r.force_take(8);
        assert!(!r.try_take(4, 10));
        assert!(r.try_take(2, 10));
        r.give_back(8);
        r.give_back(2);
        assert_eq!(r.promised(), 0);
    }

    /// Many writers racing for the last room: never more promised than free, and every
    /// promise given back leaves nothing behind.
    #[test]
    fn racing_writers_never_overcommit() {
        let r = Arc::new(Room::default());
        let free = 1000u64;
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let r = r.clone();
                std::thread::spawn(move || {
                    let mut held = 0u64;
                    for i in 0..20_000u64 {
                        if i % 3 == 2 && held > 0 {
                            r.give_back(7);
                            held -= 7;
                        } else if r.try_take(7, free) {
                            held += 7;
                        }
                        assert!(r.promised() <= free);
                    }
                    r.give_back(held);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(r.promised(), 0);
    }
}
