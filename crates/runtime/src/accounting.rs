//! Which proclet each thread is running: the basis of per-proclet CPU accounting and of
//! cooperative yields.
//!
//! Every thread that runs a proclet's code (node workers, and application threads making
//! local calls) has a cell saying which proclet it is inside right now (by the slot's
//! process-unique serial). Entering and leaving a call are two plain stores into the
//! thread's own cell, so accounting costs the call path almost nothing. The pressure
//! monitor samples each thread's CPU clock (`/proc/self/task/TID/schedstat`) every few
//! milliseconds (through the host crate) and charges what the thread used since the previous sample to the proclet
//! it is inside at the sample: a sampling profiler, exact for long calls and statistically
//! right for many short ones. The same schedstat line gives the thread's run-queue delay.
//!
//! A long-running closure (a compute proclet working through a range) checks
//! [`should_yield`] at item boundaries; the migration engine asks it to yield so it can
//! move the proclet without waiting for the whole call to finish.

use parking_lot::Mutex;
use std::cell::OnceCell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// One thread's record.
pub(crate) struct ThreadCell {
    pub tid: i32,
    /// Serial of the slot whose code the thread is running; 0 outside proclet code.
    pub current: AtomicU64,
}

static THREADS: Mutex<Vec<Arc<ThreadCell>>> = Mutex::new(Vec::new());
/// Number of slots asked to yield (a fast "nothing to do" check for `should_yield`).
static YIELD_COUNT: AtomicUsize = AtomicUsize::new(0);
static YIELD_SET: Mutex<Option<HashSet<u64>>> = Mutex::new(None);

thread_local! {
    static CELL: OnceCell<Arc<ThreadCell>> = const { OnceCell::new() };
}

fn register() -> Arc<ThreadCell> {
    let cell = Arc::new(ThreadCell {
        tid: nix::unistd::gettid().as_raw(),
        current: AtomicU64::new(0),
    });
    THREADS.lock().push(cell.clone());
    cell
}

/// Marks the calling thread as running a proclet until dropped (restores the previous
/// one, for nested local calls).
pub(crate) struct Running {
    prev: u64,
}

/// The calling thread now runs the proclet with slot serial `serial`.
#[inline]
pub(crate) fn enter(serial: u64) -> Running {
    let prev = CELL.with(|c| {
        let cell = c.get_or_init(register);
        // Only this thread writes its cell: a load and a store, no read-modify-write.
        let prev = cell.current.load(Ordering::Relaxed);
        cell.current.store(serial, Ordering::Relaxed);
        prev
    });
    Running { prev }
}

impl Drop for Running {
    #[inline]
    fn drop(&mut self) {
        let prev = self.prev;
        let _ = CELL.try_with(|c| {
            if let Some(cell) = c.get() {
                cell.current.store(prev, Ordering::Relaxed);
            }
        });
    }
}

/// Serial of the slot the calling thread is running, 0 if none.
pub(crate) fn current_serial() -> u64 {
    CELL.try_with(|c| {
        c.get()
            .map_or(0, |cell| cell.current.load(Ordering::Relaxed))
    })
    .unwrap_or(0)
}

/// Every thread that ever ran proclet code and is still alive (cells of threads that
/// exited are dropped by `prune`).
pub(crate) fn threads() -> Vec<Arc<ThreadCell>> {
    THREADS.lock().clone()
}

/// Forget threads that no longer exist.
pub(crate) fn prune(gone: &[i32]) {
    if !gone.is_empty() {
        THREADS.lock().retain(|c| !gone.contains(&c.tid));
    }
}

/// Ask the code running on slot `serial` to yield at its next item boundary.
pub(crate) fn request_yield(serial: u64) {
    let mut set = YIELD_SET.lock();
    if set.get_or_insert_with(HashSet::new).insert(serial) {
        YIELD_COUNT.fetch_add(1, Ordering::Release);
    }
}

/// Withdraw a yield request.
pub(crate) fn clear_yield(serial: u64) {
    let mut set = YIELD_SET.lock();
    if set.as_mut().is_some_and(|s| s.remove(&serial)) {
        YIELD_COUNT.fetch_sub(1, Ordering::Release);
    }
}

/// Whether the proclet whose closure is running on this thread should stop at the next
/// item boundary (because the runtime wants to move it). Long-running closures that
/// check this and return early let their proclet migrate without waiting for them; see
/// `granule::RangeJob`, which does it for ranges of items. One relaxed load when no yield
/// is pending.
pub fn should_yield() -> bool {
    if YIELD_COUNT.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let serial = current_serial();
    serial != 0
        && YIELD_SET
            .lock()
            .as_ref()
            .is_some_and(|s| s.contains(&serial))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_track_nested_entries_and_yields() {
        assert_eq!(current_serial(), 0);
        {
            let _a = enter(7);
            assert_eq!(current_serial(), 7);
            {
                let _b = enter(9);
                assert_eq!(current_serial(), 9);
                assert!(!should_yield());
                request_yield(9);
                assert!(should_yield());
                clear_yield(9);
                assert!(!should_yield());
            }
            assert_eq!(current_serial(), 7);
        }
        assert_eq!(current_serial(), 0);
        let me = nix::unistd::gettid().as_raw();
        assert!(threads().iter().any(|c| c.tid == me));
        // The kernel folds running time in at ticks and switches: spin past a few ticks.
        let t = std::time::Instant::now();
        while t.elapsed() < std::time::Duration::from_millis(30) {
            std::hint::black_box(0u64);
        }
        std::thread::yield_now();
        assert!(granule_host::proc::thread_schedstat(me).unwrap().cpu_ns > 0);
    }
}
