//! Which worker threads are inside a closure, and since when; and the watchdog that keeps
//! a node's I/O moving while some of its workers run long closures.
//!
//! Closures run to completion on the worker thread that received the call (no hand-off,
//! see the thread-placement note in EVALUATION.md). In tokio, though, only a *parked*
//! worker polls the sockets: if the worker that was polling wakes up to run a closure that
//! takes 100 ms, the node's other workers sleep on and nobody reads new calls. The
//! watchdog notices a closure running for more than [`NUDGE_AFTER`] and spawns an empty
//! task, which wakes an idle worker; that worker then parks on the I/O driver and keeps
//! serving. With every worker busy there is no one to wake, which is right: the node's
//! cores are all in use.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Board size: worker slots are taken modulo this.
const SLOTS: usize = 64;
/// A closure running longer than this gets the node's idle workers woken.
pub(crate) const NUDGE_AFTER: Duration = Duration::from_millis(1);

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// Start times (µs since `epoch`, +1; 0 = idle) of the closures running on each worker.
pub(crate) struct BusyBoard {
    start_us: [AtomicU64; SLOTS],
    next_slot: AtomicUsize,
    epoch: Instant,
}

impl BusyBoard {
    pub(crate) fn new() -> Self {
        BusyBoard {
            start_us: std::array::from_fn(|_| AtomicU64::new(0)),
            next_slot: AtomicUsize::new(0),
            epoch: Instant::now(),
        }
    }

    /// Give the calling (worker) thread a slot.
    pub(crate) fn register_thread(&self) {
        let s = self.next_slot.fetch_add(1, Ordering::Relaxed) % SLOTS;
        SLOT.with(|c| c.set(s));
    }

    /// Mark the calling thread busy until the guard drops (no-op off worker threads).
    pub(crate) fn enter(&self) -> BusyGuard<'_> {
        let slot = SLOT.with(|c| c.get());
        if slot < SLOTS {
            let now = self.epoch.elapsed().as_micros() as u64 + 1;
            self.start_us[slot].store(now, Ordering::Relaxed);
        }
        BusyGuard { board: self, slot }
    }

    /// How long the longest-running closure has been running.
    pub(crate) fn longest(&self) -> Option<Duration> {
        let now = self.epoch.elapsed().as_micros() as u64 + 1;
        self.start_us
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|s| *s != 0)
            .min()
            .map(|start| Duration::from_micros(now.saturating_sub(start)))
    }
}

pub(crate) struct BusyGuard<'a> {
    board: &'a BusyBoard,
    slot: usize,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        if self.slot < SLOTS {
            self.board.start_us[self.slot].store(0, Ordering::Relaxed);
        }
    }
}

/// Keep I/O moving while closures run long (see the module doc).
pub(crate) async fn watchdog(
    board: std::sync::Arc<BusyBoard>,
    workers: tokio::runtime::Handle,
    stop: impl Fn() -> bool,
) {
    loop {
        if stop() {
            return;
        }
        let pause = match board.longest() {
            Some(d) if d >= NUDGE_AFTER => {
                workers.spawn(async {});
                NUDGE_AFTER
            }
            Some(_) => NUDGE_AFTER,
            None => Duration::from_millis(5),
        };
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn board_tracks_running_closures() {
        let b = BusyBoard::new();
        assert!(b.longest().is_none());
        b.register_thread();
        {
            let _g = b.enter();
            std::thread::sleep(Duration::from_millis(3));
            assert!(b.longest().unwrap() >= Duration::from_millis(2));
        }
        assert!(b.longest().is_none());
    }
}
