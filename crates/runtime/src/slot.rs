//! A hosted proclet (its *slot*) and the lock that serializes calls on it.
//!
//! Synchronization rule (documented in docs/guide/programming.md and on `Proclet::run`):
//! - `run` calls get `&mut S` and are serialized per proclet (one at a time);
//! - `run_ref` calls get `&S` and run concurrently with each other, never with a `run`;
//! - waiting calls are granted in arrival order (a waiting `run` is not starved by a
//!   stream of `run_ref`s);
//! - a nested call that re-enters a proclet its own call chain already holds is granted at
//!   once if both are shared (`run_ref` inside `run_ref`, even past waiting writers), and
//!   refused with `Reentrant` otherwise, because it could never be granted: the outer call
//!   cannot finish before the inner one does. It fails instead of deadlocking.
//!
//! Waiting never blocks a thread inside the runtime: remote calls wait asynchronously;
//! synchronous local callers park (and, on a node's worker thread, first hand the core to
//! another thread, see `context::block_on`).
//!
//! The lock also carries the slot's status: a move or a destroy takes the lock
//! exclusively, changes the status, and on release every waiting call fails with the new
//! status (moved: retry at the new home; destroyed: gone).

use crate::shipping::{Descriptor, ErasedState};
use granule_wire::{CallMode, ChainId, Epoch, Kind, Location, ProcletId};
use parking_lot::{Mutex, RwLock};
use std::any::TypeId;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

/// Where a slot stands.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum SlotStatus {
    Active,
    Moved(Location),
    Destroyed,
    /// An arrived copy whose move was not committed: the proclet lives elsewhere.
    Withdrawn,
}

/// Why a lock request failed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum LockError {
    Reentrant,
    Moved(Location),
    Destroyed,
    /// Not here (an uncommitted arrival was withdrawn); ask where it lives.
    Withdrawn,
}

const WAITING: u8 = 0;
const GRANTED: u8 = 1;
const FAILED: u8 = 2;

struct Waiter {
    chain: ChainId,
    mode: CallMode,
    state: AtomicU8,
    failure: Mutex<Option<LockError>>,
    waker: Mutex<Option<Waker>>,
}

impl Waiter {
    fn finish(&self, outcome: Result<(), LockError>) {
        match outcome {
            Ok(()) => self.state.store(GRANTED, Ordering::Release),
            Err(e) => {
                *self.failure.lock() = Some(e);
                self.state.store(FAILED, Ordering::Release);
            }
        }
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }
}

struct LockState {
    excl: Option<ChainId>,
    shared: Vec<(ChainId, u32)>,
    waiters: VecDeque<Arc<Waiter>>,
    status: SlotStatus,
}

impl LockState {
    fn status_error(&self) -> Option<LockError> {
        match &self.status {
            SlotStatus::Active => None,
            SlotStatus::Moved(l) => Some(LockError::Moved(l.clone())),
            SlotStatus::Destroyed => Some(LockError::Destroyed),
            SlotStatus::Withdrawn => Some(LockError::Withdrawn),
        }
    }

    fn add_shared(&mut self, chain: ChainId) {
        if let Some(e) = self.shared.iter_mut().find(|(c, _)| *c == chain) {
            e.1 += 1;
        } else {
            self.shared.push((chain, 1));
        }
    }

    /// Grant what can be granted from the head of the queue; fail everyone if the slot
    /// is no longer active.
    fn grant_waiters(&mut self) -> Vec<(Arc<Waiter>, Result<(), LockError>)> {
        let mut woken = Vec::new();
        if let Some(err) = self.status_error() {
            if self.excl.is_none() {
                for w in self.waiters.drain(..) {
                    woken.push((w, Err(err.clone())));
                }
            }
            return woken;
        }
        while let Some(front) = self.waiters.front() {
            match front.mode {
                CallMode::Exclusive => {
                    if self.excl.is_none() && self.shared.is_empty() {
                        self.excl = Some(front.chain);
                        if let Some(w) = self.waiters.pop_front() {
                            woken.push((w, Ok(())));
                        }
                    }
                    break;
                }
                CallMode::Shared => {
                    if self.excl.is_some() {
                        break;
                    }
                    let chain = front.chain;
                    self.add_shared(chain);
                    if let Some(w) = self.waiters.pop_front() {
                        woken.push((w, Ok(())));
                    }
                }
            }
        }
        woken
    }
}

/// Process-unique slot serials (proclet ids are only unique within one cluster).
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// Resource accounting of one hosted proclet (see `accounting` and `monitor`).
#[derive(Default)]
pub(crate) struct SlotStats {
    /// Last measured footprint, bytes.
    pub footprint: AtomicU64,
    /// An exclusive call ran since the footprint was measured.
    pub dirty: AtomicBool,
    /// When the footprint was last measured (ns since the monitor's epoch).
    pub measured_at: AtomicU64,
    /// CPU charged by the monitor's samples and not yet folded into `cores`, ns.
    pub cpu_pending_ns: AtomicU64,
    /// Cores used, averaged over the accounting window (f64 bits).
    pub cores: AtomicU64,
    /// The kind-vs-use warning was given.
    pub warned: AtomicBool,
}

impl SlotStats {
    pub fn cores(&self) -> f64 {
        f64::from_bits(self.cores.load(Ordering::Relaxed))
    }
}

/// A proclet hosted on this node.
pub(crate) struct Slot {
    pub id: ProcletId,
    /// Its kind (index, see `Kind::index`): a memory proclet can be made hybrid and
    /// back while hosted (`Proclet::set_kind`).
    kind: std::sync::atomic::AtomicU8,
    pub state_type: TypeId,
    /// Encode/decode of the state type, for moves.
    pub state_desc: &'static Descriptor,
    pub epoch: Epoch,
    /// Process-unique serial (what threads record while running the proclet's code).
    pub serial: u64,
    /// Never moved (by the policy or by an explicit move).
    pub pinned: AtomicBool,
    /// A move of this proclet is under way.
    pub moving: AtomicBool,
    /// It has backups: its mutating calls go through `node/replicate.rs` (never the
    /// local fast path), and it does not move.
    pub replicated: AtomicBool,
    /// The epoch the latest move attempt from here gave the proclet (0: none). Every
    /// attempt takes a new one, so an abandoned attempt and a later retry to the same
    /// node are never confused (see `node/migrate.rs`).
    pub attempt_epoch: AtomicU64,
    /// The structure or service it belongs to (operators see proclets grouped by it).
    pub group: Option<Arc<str>>,
    pub stats: SlotStats,
    /// When this node started hosting it.
    pub since: std::time::Instant,
    lock: Mutex<LockState>,
    /// The state. Only touched by holders of the slot lock, so this inner lock is never
    /// contended; it exists so that no unsafe code is needed to hand out `&mut S`.
    data: RwLock<Box<ErasedState>>,
}

/// Outcome of a non-blocking lock attempt.
pub(crate) enum TryLock {
    Granted(Guard),
    /// Must wait: poll the future.
    Wait(Acquire),
}

impl Slot {
    pub fn kind(&self) -> Kind {
        Kind::from_index(self.kind.load(Ordering::Relaxed) as usize)
    }

    /// Change the kind; returns the previous one.
    pub fn set_kind(&self, kind: Kind) -> Kind {
        Kind::from_index(self.kind.swap(kind.index() as u8, Ordering::Relaxed) as usize)
    }

    pub fn new(
        id: ProcletId,
        kind: Kind,
        state_desc: &'static Descriptor,
        epoch: Epoch,
        state: Box<ErasedState>,
        group: Option<Arc<str>>,
    ) -> Arc<Slot> {
        Arc::new(Slot {
            id,
            kind: std::sync::atomic::AtomicU8::new(kind.index() as u8),
            state_type: state_desc.state_type(),
            state_desc,
            epoch,
            serial: NEXT_SERIAL.fetch_add(1, Ordering::Relaxed),
            pinned: AtomicBool::new(false),
            group,
            moving: AtomicBool::new(false),
            replicated: AtomicBool::new(false),
            attempt_epoch: AtomicU64::new(0),
            stats: SlotStats::default(),
            since: std::time::Instant::now(),
            lock: Mutex::new(LockState {
                excl: None,
                shared: Vec::new(),
                waiters: VecDeque::new(),
                status: SlotStatus::Active,
            }),
            data: RwLock::new(state),
        })
    }

    /// Try to take the lock; if it must wait, the returned future completes when granted.
    pub fn lock(self: &Arc<Self>, chain: ChainId, mode: CallMode) -> Result<TryLock, LockError> {
        let mut st = self.lock.lock();
        if let Some(e) = st.status_error() {
            return Err(e);
        }
        let holds_excl = st.excl == Some(chain);
        let holds_shared = st.shared.iter().any(|(c, _)| *c == chain);
        let grant = match mode {
            CallMode::Exclusive => {
                if holds_excl || holds_shared {
                    return Err(LockError::Reentrant);
                }
                st.excl.is_none() && st.shared.is_empty() && st.waiters.is_empty()
            }
            CallMode::Shared => {
                if holds_excl {
                    return Err(LockError::Reentrant);
                }
                holds_shared || (st.excl.is_none() && st.waiters.is_empty())
            }
        };
        if grant {
            match mode {
                CallMode::Exclusive => st.excl = Some(chain),
                CallMode::Shared => st.add_shared(chain),
            }
            return Ok(TryLock::Granted(Guard {
                slot: self.clone(),
                chain,
                mode,
            }));
        }
        let waiter = Arc::new(Waiter {
            chain,
            mode,
            state: AtomicU8::new(WAITING),
            failure: Mutex::new(None),
            waker: Mutex::new(None),
        });
        st.waiters.push_back(waiter.clone());
        Ok(TryLock::Wait(Acquire {
            slot: self.clone(),
            waiter,
            done: false,
        }))
    }

    fn release(&self, chain: ChainId, mode: CallMode) {
        let woken = {
            let mut st = self.lock.lock();
            match mode {
                CallMode::Exclusive => {
                    if st.excl == Some(chain) {
                        st.excl = None;
                    }
                }
                CallMode::Shared => {
                    if let Some(i) = st.shared.iter().position(|(c, _)| *c == chain) {
                        st.shared[i].1 -= 1;
                        if st.shared[i].1 == 0 {
                            st.shared.swap_remove(i);
                        }
                    }
                }
            }
            st.grant_waiters()
        };
        for (w, outcome) in woken {
            w.finish(outcome);
        }
    }

    /// Read access to the state for the runtime's own work on it (encoding for a move)
    /// while the caller holds the slot's exclusive lock through a guard, possibly on
    /// another thread.
    pub fn state_reader(&self) -> parking_lot::RwLockReadGuard<'_, Box<ErasedState>> {
        self.data.read()
    }

    /// Current status (for diagnostics).
    #[allow(dead_code)]
    pub fn status(&self) -> SlotStatus {
        self.lock.lock().status.clone()
    }

    /// Who holds the lock and who waits, in words (for the log of a call that waited
    /// too long for it).
    pub fn describe_lock(&self) -> String {
        let st = self.lock.lock();
        let holder = match (st.excl, st.shared.len()) {
            (Some(c), _) => format!("held exclusively by call chain {c}"),
            (None, 0) => "free".to_string(),
            (None, n) => format!(
                "held shared by {n} call chain(s) ({})",
                st.shared
                    .iter()
                    .map(|(c, k)| format!("{c}x{k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let waiting = st
            .waiters
            .iter()
            .map(|w| {
                let state = match w.state.load(Ordering::Acquire) {
                    WAITING => "waiting",
                    GRANTED => "granted",
                    _ => "failed",
                };
                let mode = match w.mode {
                    CallMode::Exclusive => "exclusive",
                    CallMode::Shared => "shared",
                };
                format!("{} {mode} {state}", w.chain)
            })
            .collect::<Vec<_>>();
        format!(
            "{holder}; status {:?}; moving {}; queue [{}]",
            st.status,
            self.moving.load(Ordering::Relaxed),
            waiting.join(", ")
        )
    }
}

/// Waits for a queued lock request. Dropping it withdraws the request (or releases the
/// lock if it was granted in the meantime).
pub(crate) struct Acquire {
    slot: Arc<Slot>,
    waiter: Arc<Waiter>,
    done: bool,
}

impl Future for Acquire {
    type Output = Result<Guard, LockError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let check = |this: &mut Acquire| -> Option<Result<Guard, LockError>> {
            match this.waiter.state.load(Ordering::Acquire) {
                GRANTED => {
                    this.done = true;
                    Some(Ok(Guard {
                        slot: this.slot.clone(),
                        chain: this.waiter.chain,
                        mode: this.waiter.mode,
                    }))
                }
                FAILED => {
                    this.done = true;
                    let e = this
                        .waiter
                        .failure
                        .lock()
                        .take()
                        .unwrap_or(LockError::Destroyed);
                    Some(Err(e))
                }
                _ => None,
            }
        };
        if let Some(r) = check(&mut self) {
            return Poll::Ready(r);
        }
        *self.waiter.waker.lock() = Some(cx.waker().clone());
        // Re-check: the grant may have happened between the first check and storing the
        // waker (the granter takes the waker under the same mutex).
        match check(&mut self) {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let granted = {
            let mut st = self.slot.lock.lock();
            if let Some(i) = st.waiters.iter().position(|w| Arc::ptr_eq(w, &self.waiter)) {
                st.waiters.remove(i);
                // Removing a waiter may let those behind it go.
                let woken = st.grant_waiters();
                drop(st);
                for (w, outcome) in woken {
                    w.finish(outcome);
                }
                false
            } else {
                self.waiter.state.load(Ordering::Acquire) == GRANTED
            }
        };
        if granted {
            self.slot.release(self.waiter.chain, self.waiter.mode);
        }
    }
}

/// A granted lock. Releases on drop.
pub(crate) struct Guard {
    slot: Arc<Slot>,
    chain: ChainId,
    mode: CallMode,
}

impl Guard {
    pub fn slot(&self) -> &Arc<Slot> {
        &self.slot
    }

    /// Run `f` on the state with exclusive access. Only valid for exclusive guards.
    /// The thread counts as running this proclet meanwhile (CPU accounting), and the
    /// footprint is marked for re-measuring.
    pub fn with_mut<T>(&self, f: impl FnOnce(&mut ErasedState) -> T) -> T {
        debug_assert_eq!(self.mode, CallMode::Exclusive);
        let _running = crate::accounting::enter(self.slot.serial);
        let mut d = self.slot.data.write();
        let r = f(d.as_mut());
        self.slot.stats.dirty.store(true, Ordering::Relaxed);
        r
    }

    /// Run `f` on the state with shared access (accounted like `with_mut`).
    pub fn with_ref<T>(&self, f: impl FnOnce(&ErasedState) -> T) -> T {
        let _running = crate::accounting::enter(self.slot.serial);
        let d = self.slot.data.read();
        f(d.as_ref())
    }

    /// Run `f` on the state without counting it as the proclet's work (the runtime's own
    /// reads: encoding for a move, measuring the footprint).
    pub fn inspect<T>(&self, f: impl FnOnce(&ErasedState) -> T) -> T {
        let d = self.slot.data.read();
        f(d.as_ref())
    }

    /// Put a state back (a move that took it out failed). Exclusive guards only.
    pub fn put_state(&self, state: Box<ErasedState>) {
        assert_eq!(
            self.mode,
            CallMode::Exclusive,
            "put_state needs exclusive access"
        );
        *self.slot.data.write() = state;
    }

    /// Change the slot's status. New lock requests see it at once; waiters see it when
    /// the guard is released. A shared guard may do this only if nothing else changes
    /// the status meanwhile (a move holding its proclet shared: writers are excluded).
    pub fn set_status(&self, status: SlotStatus) {
        self.slot.lock.lock().status = status;
    }

    /// Replace the state with a placeholder and return the old one (for destroy and
    /// moves). Exclusive guards only.
    pub fn take_state(&self) -> Box<ErasedState> {
        assert_eq!(
            self.mode,
            CallMode::Exclusive,
            "take_state needs exclusive access"
        );
        let mut d = self.slot.data.write();
        std::mem::replace(&mut *d, Box::new(()))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.slot.release(self.chain, self.mode);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shipping::state_desc;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn slot() -> Arc<Slot> {
        Slot::new(
            ProcletId(1),
            Kind::Memory,
            state_desc::<u64>(0),
            1,
            Box::new(0u64),
            None,
        )
    }

    fn poll(a: &mut Acquire) -> Poll<Result<Guard, LockError>> {
        let flag = Arc::new(Flag(Default::default()));
        let waker = Waker::from(flag);
        Pin::new(a).poll(&mut Context::from_waker(&waker))
    }

    fn granted(r: Result<TryLock, LockError>) -> Guard {
        match r {
            Ok(TryLock::Granted(g)) => g,
            _ => panic!("expected an immediate grant"),
        }
    }

    fn waits(r: Result<TryLock, LockError>) -> Acquire {
        match r {
            Ok(TryLock::Wait(w)) => w,
            _ => panic!("expected to wait"),
        }
    }

    #[test]
    fn exclusive_calls_are_serialized_in_order() {
        let s = slot();
        let g1 = granted(s.lock(1, CallMode::Exclusive));
        let mut w2 = waits(s.lock(2, CallMode::Exclusive));
        let mut w3 = waits(s.lock(3, CallMode::Shared));
        assert!(poll(&mut w2).is_pending());
        drop(g1);
        let g2 = match poll(&mut w2) {
            Poll::Ready(Ok(g)) => g,
            _ => panic!("w2 should be granted"),
        };
        assert!(poll(&mut w3).is_pending());
        drop(g2);
        assert!(matches!(poll(&mut w3), Poll::Ready(Ok(_))));
    }

    #[test]
    fn shared_calls_run_together_but_queue_behind_a_waiting_writer() {
        let s = slot();
        let r1 = granted(s.lock(1, CallMode::Shared));
        let _r2 = granted(s.lock(2, CallMode::Shared));
        let mut w = waits(s.lock(3, CallMode::Exclusive));
        let mut r4 = waits(s.lock(4, CallMode::Shared));
        // Re-entry by a chain that already holds shared access is granted at once.
        let _r1b = granted(s.lock(1, CallMode::Shared));
        drop(r1);
        assert!(poll(&mut w).is_pending());
        assert!(poll(&mut r4).is_pending());
    }

    #[test]
    fn reentry_that_can_never_be_granted_is_refused() {
        let s = slot();
        let _g = granted(s.lock(7, CallMode::Exclusive));
        assert!(matches!(
            s.lock(7, CallMode::Exclusive),
            Err(LockError::Reentrant)
        ));
        assert!(matches!(
            s.lock(7, CallMode::Shared),
            Err(LockError::Reentrant)
        ));
        let s2 = slot();
        let _r = granted(s2.lock(8, CallMode::Shared));
        assert!(matches!(
            s2.lock(8, CallMode::Exclusive),
            Err(LockError::Reentrant)
        ));
    }

    #[test]
    fn status_change_fails_waiters() {
        let s = slot();
        let g = granted(s.lock(1, CallMode::Exclusive));
        let mut w = waits(s.lock(2, CallMode::Exclusive));
        g.set_status(SlotStatus::Destroyed);
        drop(g);
        assert!(matches!(
            poll(&mut w),
            Poll::Ready(Err(LockError::Destroyed))
        ));
        assert!(matches!(
            s.lock(3, CallMode::Shared),
            Err(LockError::Destroyed)
        ));
    }

    #[test]
    fn dropped_waiter_lets_others_through() {
        let s = slot();
        let g = granted(s.lock(1, CallMode::Exclusive));
        let w2 = waits(s.lock(2, CallMode::Exclusive));
        let mut w3 = waits(s.lock(3, CallMode::Exclusive));
        drop(w2);
        drop(g);
        assert!(matches!(poll(&mut w3), Poll::Ready(Ok(_))));
        // A waiter granted but dropped before noticing releases the lock.
        let s = slot();
        let g = granted(s.lock(1, CallMode::Exclusive));
        let w = waits(s.lock(2, CallMode::Exclusive));
        drop(g);
        drop(w);
        let _ = granted(s.lock(3, CallMode::Exclusive));
    }

    #[test]
    fn threads_hammering_one_slot_never_overlap_writers() {
        let s = slot();
        let inside = Arc::new(AtomicU8::new(0));
        let mut hs = Vec::new();
        for t in 0..4u64 {
            let s = s.clone();
            let inside = inside.clone();
            hs.push(std::thread::spawn(move || {
                for i in 0..2000u64 {
                    let chain = t * 1_000_000 + i + 1;
                    let g = match s.lock(chain, CallMode::Exclusive).unwrap() {
                        TryLock::Granted(g) => g,
                        TryLock::Wait(w) => {
                            crate::context::block_on(w, None, std::time::Duration::ZERO)
                                .unwrap()
                                .unwrap()
                        }
                    };
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                    g.with_mut(|st| *st.downcast_mut::<u64>().unwrap() += 1);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    drop(g);
                }
            }));
        }
        for h in hs {
            h.join().unwrap();
        }
        let g = granted(s.lock(99, CallMode::Shared));
        assert_eq!(g.with_ref(|st| *st.downcast_ref::<u64>().unwrap()), 8000);
    }
}
