//! The proclets this node hosts: the table of slots, per-kind counts, the calls served,
//! and which workers are inside closures (for the I/O watchdog). Installing and removing
//! a proclet, changing its kind, and taking its lock without blocking a thread.

use super::NodeInner;
use crate::busy::BusyBoard;
use crate::shipping::{Descriptor, ErasedState};
use crate::slot::{Guard, LockError, Slot, TryLock};
use dashmap::DashMap;
use granule_wire::{
    CallMode, ChainId, Epoch, GroupUsage, Kind, ProcletId, ProcletUsage, RemoteError,
};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// The table of hosted proclets and what is counted about it.
pub(crate) struct Hosting {
    table: DashMap<ProcletId, Arc<Slot>>,
    /// Hosted proclets per kind.
    by_kind: [AtomicU32; 3],
    pub calls_served: AtomicU64,
    /// Which workers are inside closures (for the I/O watchdog).
    pub busy: Arc<BusyBoard>,
}

/// What a node records about a proclet it starts hosting.
pub(super) struct NewSlot {
    pub id: ProcletId,
    pub kind: Kind,
    pub state: &'static Descriptor,
    pub epoch: Epoch,
    pub pinned: bool,
    pub group: Option<String>,
}

impl Hosting {
    pub(super) fn new(busy: Arc<BusyBoard>) -> Hosting {
        Hosting {
            table: DashMap::new(),
            by_kind: Default::default(),
            calls_served: AtomicU64::new(0),
            busy,
        }
    }

    /// The slot of a proclet hosted here.
    pub(crate) fn get(&self, id: ProcletId) -> Option<Arc<Slot>> {
        self.table.get(&id).map(|s| s.clone())
    }

    pub(crate) fn contains(&self, id: ProcletId) -> bool {
        self.table.contains_key(&id)
    }

    /// Every hosted slot (a snapshot).
    pub(crate) fn slots(&self) -> Vec<Arc<Slot>> {
        self.table.iter().map(|s| s.value().clone()).collect()
    }

    fn insert(&self, slot: Arc<Slot>) {
        let kind = slot.kind();
        if self.table.insert(slot.id, slot).is_none() {
            self.by_kind[kind.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Stop hosting `slot` — only this very slot: the proclet may have come back and be
    /// hosted anew.
    pub(crate) fn remove(&self, slot: &Slot) {
        if self
            .table
            .remove_if(&slot.id, |_, s| std::ptr::eq(&**s, slot))
            .is_some()
        {
            self.by_kind[slot.kind().index()].fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Change a hosted proclet's kind (counts follow); `false` if it is not here.
    pub(crate) fn retag(&self, id: ProcletId, kind: Kind) -> bool {
        let Some(slot) = self.get(id) else {
            return false;
        };
        let old = slot.set_kind(kind);
        if old != kind {
            self.by_kind[old.index()].fetch_sub(1, Ordering::Relaxed);
            self.by_kind[kind.index()].fetch_add(1, Ordering::Relaxed);
            // Its use is judged afresh against the new kind.
            slot.stats.warned.store(false, Ordering::Relaxed);
        }
        true
    }

    /// The kind of a proclet hosted here.
    pub(crate) fn kind_of(&self, id: ProcletId) -> Option<Kind> {
        self.table.get(&id).map(|s| s.kind())
    }

    /// Hosted proclets per kind (compute, memory, hybrid).
    pub(crate) fn counts(&self) -> [u32; 3] {
        std::array::from_fn(|i| self.by_kind[i].load(Ordering::Relaxed))
    }

    /// Sum of the footprints of hosted proclets.
    pub(crate) fn proclet_bytes(&self) -> u64 {
        self.table
            .iter()
            .map(|s| s.stats.footprint.load(Ordering::Relaxed))
            .sum()
    }

    /// The `n` largest hosted proclets (by memory, then CPU), for heartbeats.
    pub(crate) fn top(&self, n: usize) -> Vec<ProcletUsage> {
        let mut all: Vec<ProcletUsage> = self
            .table
            .iter()
            .map(|s| ProcletUsage {
                id: s.id,
                kind: s.kind(),
                mem_bytes: s.stats.footprint.load(Ordering::Relaxed),
                cores: s.stats.cores(),
                pinned: s.pinned.load(Ordering::Relaxed),
            })
            .collect();
        all.sort_by(|a, b| {
            b.mem_bytes.cmp(&a.mem_bytes).then(
                b.cores
                    .partial_cmp(&a.cores)
                    .unwrap_or(std::cmp::Ordering::Equal),
            )
        });
        all.truncate(n);
        all
    }

    /// Hosted proclets summed by the structure or service they belong to, for heartbeats.
    pub(crate) fn groups(&self) -> Vec<GroupUsage> {
        let mut by: std::collections::BTreeMap<Arc<str>, GroupUsage> = Default::default();
        for s in self.table.iter() {
            if let Some(g) = &s.group {
                let e = by.entry(g.clone()).or_insert_with(|| GroupUsage {
                    group: g.to_string(),
                    proclets: 0,
                    bytes: 0,
                });
                e.proclets += 1;
                e.bytes += s.stats.footprint.load(Ordering::Relaxed);
            }
        }
        by.into_values().collect()
    }
}

impl NodeInner {
    /// Start hosting a proclet whose state is `s`: it is no longer cached or forwarded
    /// elsewhere, and its footprint is measured at once.
    pub(super) fn install(&self, n: NewSlot, s: Box<ErasedState>) {
        let slot = Slot::new(n.id, n.kind, n.state, n.epoch, s, n.group.map(Arc::from));
        slot.pinned.store(n.pinned, Ordering::Relaxed);
        self.locations.hosted_here(n.id);
        self.monitor.measure_now(&slot);
        self.hosting.insert(slot);
    }

    /// Start hosting an arriving proclet whose move is not committed yet: its lock is
    /// taken (exclusively, by nobody's call) before anyone can see it, so calls on it wait
    /// until the returned guard is dropped (commit) or the slot is withdrawn.
    pub(super) fn install_held(
        &self,
        n: NewSlot,
        s: Box<ErasedState>,
    ) -> Result<Guard, RemoteError> {
        let slot = Slot::new(n.id, n.kind, n.state, n.epoch, s, n.group.map(Arc::from));
        slot.pinned.store(n.pinned, Ordering::Relaxed);
        // A slot nobody else has seen yet grants at once.
        let Ok(TryLock::Granted(held)) =
            slot.lock(crate::context::new_chain(), CallMode::Exclusive)
        else {
            return Err(RemoteError::Internal(
                "a new slot's lock was not free".into(),
            ));
        };
        // Measured now, under the held lock: once calls queue on it, a measurement that
        // needs the lock would be skipped and the proclet would count as empty.
        self.monitor.measure_under(&held);
        self.locations.hosted_here(n.id);
        self.hosting.insert(slot);
        Ok(held)
    }

    /// The answer to a call for a proclet this node does not host: "not here", with
    /// where it went if it left from here.
    pub(super) fn not_here(&self, id: ProcletId) -> RemoteError {
        RemoteError::NotHere {
            hint: self.locations.forwarded_to(id),
        }
    }

    /// Take a slot's lock, waiting without blocking the thread.
    pub(super) async fn lock_slot(
        &self,
        slot: &Arc<Slot>,
        chain: ChainId,
        mode: CallMode,
    ) -> Result<Guard, RemoteError> {
        let r = match slot.lock(chain, mode) {
            Ok(TryLock::Granted(g)) => Ok(g),
            Ok(TryLock::Wait(w)) => w.await,
            Err(e) => Err(e),
        };
        r.map_err(|e| match e {
            LockError::Reentrant => RemoteError::Reentrant(slot.id),
            LockError::Moved(l) => RemoteError::NotHere { hint: Some(l) },
            LockError::Withdrawn => RemoteError::NotHere { hint: None },
            LockError::Destroyed => RemoteError::Gone,
        })
    }
}
