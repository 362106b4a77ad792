//! The metadata's second copy, on an own node other than the mount's.
//!
//! The mount process (the cluster's driver, an own node) holds the namespace and the
//! stripe tables. When the cluster has another own node, a memory proclet there
//! ([`MetaCopy`]) keeps a copy: the [`Replicator`] ships the inodes changed since its last
//! batch every [`INTERVAL`] (and at once when an fsync waits for it), together with
//! what is needed to reach the stores again (their images, the layouts, the victims'
//! sealing key). An fsync returns only once the copy holds the metadata as it was when
//! the fsync began, so what fsync promised survives the mount process.
//!
//! When the node holding the copy goes, a new copy is made on another own node and sent
//! everything. When the mount process dies while its own nodes live on (`granule fs
//! mount --controller`), the next mount of the same directory under the same controller
//! finds the copy through the mount's record file and adopts it: [`fetch`].

use crate::engine::Engine;
use crate::meta::{Changes, Ino, Inode};
use crate::placement::Layout;
use crate::stores::{StoreImage, StoreState};
use granule_runtime::{Kind, NodeId, Proclet};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often changed inodes go to the copy when nobody waits for them.
pub const INTERVAL: Duration = Duration::from_millis(100);

/// How often an idle replicator checks that its copy is still there.
const PING: Duration = Duration::from_secs(1);

/// What a mount needs besides the namespace to serve its files again.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MountImage {
    pub stores: Vec<StoreImage>,
    pub layouts: Vec<Layout>,
    /// The key victim stripes are sealed under, and how ("aead" or "mac").
    pub master: [u8; 32],
    pub protection: String,
    pub stripe: u64,
    /// Every stripe version in use is below this.
    pub versions_below: u64,
}

/// The copy: a memory proclet's state.
#[derive(Default, Serialize, Deserialize)]
pub struct MetaCopy {
    inodes: HashMap<Ino, Inode>,
    next: Ino,
    /// The namespace's change count the copy has applied.
    seq: u64,
    mount: Option<MountImage>,
}

/// One shipment.
#[derive(Serialize, Deserialize)]
struct Batch {
    /// Everything (a new copy), not only changes.
    full: bool,
    changes: Changes,
    mount: MountImage,
}

impl MetaCopy {
    fn apply(&mut self, b: Batch) -> u64 {
        if b.full {
            self.inodes.clear();
        }
        for i in b.changes.upserts {
            self.inodes.insert(i.ino, i);
        }
        for ino in b.changes.removes {
            self.inodes.remove(&ino);
        }
        self.next = b.changes.next;
        self.seq = b.changes.seq;
        self.mount = Some(b.mount);
        self.seq
    }
}

/// A copy as fetched for recovery.
pub struct Recovered {
    pub inodes: HashMap<Ino, Inode>,
    pub next: Ino,
    pub mount: MountImage,
}

/// Read a copy whole (recovery).
pub async fn fetch(copy: &Proclet<MetaCopy>) -> Result<Recovered, String> {
    let got = copy
        .run_ref_async((), |c: &MetaCopy, ()| {
            c.mount.clone().map(|m| (c.inodes.clone(), c.next, m))
        })
        .await
        .map_err(|e| e.to_string())?;
    match got {
        Some((inodes, next, mount)) => Ok(Recovered {
            inodes,
            next,
            mount,
        }),
        None => Err("the copy is empty (its mount never shipped to it)".into()),
    }
}

/// Stop using a copy. One the record names stays (if it lives) until a new copy is
/// recorded; one never recorded is destroyed at once: nobody will adopt it.
fn retire(retired: &mut Option<Proclet<MetaCopy>>, copy: Proclet<MetaCopy>, unrecorded: bool) {
    if unrecorded || retired.is_some() {
        tokio::spawn(async move {
            let _ = copy.destroy_async().await;
        });
    } else {
        *retired = Some(copy);
    }
}

/// How long [`Replicator::stop`] waits for a turn in progress (a copy being made on a
/// slow node, say) to end.
pub const STOP_PATIENCE: Duration = Duration::from_secs(10);

/// Told each time the copy moves to a new proclet.
pub type OnNewCopy = Box<dyn Fn(&Proclet<MetaCopy>) + Send + Sync>;

/// Keeps the copy up to date; see the module doc.
pub struct Replicator {
    engine: Arc<Engine>,
    copy: Mutex<Option<Proclet<MetaCopy>>>,
    /// The parts of the mount image the engine does not know.
    master: [u8; 32],
    protection: String,
    /// Told each time the copy moves (the mount writes it into its record file).
    on_new_copy: OnNewCopy,
    /// The mount's own node, which holds the first copy: never the second.
    home: NodeId,
    stop: AtomicBool,
    /// Held by [`Replicator::run`] while it runs: [`Replicator::stop`] waits on it, so
    /// no turn (a copy being made, a new copy being recorded) outlives the stop.
    running: tokio::sync::Mutex<()>,
}

impl Replicator {
    /// A replicator for `engine`, starting with `copy` (an adopted one) or none (one is
    /// made on the first turn).
    pub fn new(
        engine: Arc<Engine>,
        copy: Option<Proclet<MetaCopy>>,
        master: [u8; 32],
        protection: String,
        home: NodeId,
        on_new_copy: OnNewCopy,
    ) -> Arc<Replicator> {
        Arc::new(Replicator {
            engine,
            copy: Mutex::new(copy),
            master,
            protection,
            on_new_copy,
            home,
            stop: AtomicBool::new(false),
            running: tokio::sync::Mutex::new(()),
        })
    }

    /// The copy in use.
    pub fn copy(&self) -> Option<Proclet<MetaCopy>> {
        self.copy.lock().clone()
    }

    fn image(&self) -> MountImage {
        let e = &self.engine;
        MountImage {
            stores: e.stores.all().iter().map(|s| s.image()).collect(),
            layouts: e.layouts(),
            master: self.master,
            protection: self.protection.clone(),
            stripe: e.settings.stripe,
            versions_below: e.versions_below(),
        }
    }

    /// The own nodes that may hold the copy: those of live own stores other than the
    /// mount's, in id order.
    fn candidates(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .engine
            .stores
            .all()
            .iter()
            .filter(|s| s.state() != StoreState::Gone)
            .filter_map(|s| s.node())
            .filter(|n| *n != self.home)
            .collect();
        v.sort();
        v.dedup();
        v
    }

    async fn make_copy(&self) -> Option<Proclet<MetaCopy>> {
        for node in self.candidates() {
            let made = Proclet::<MetaCopy>::builder(Kind::Memory)
                .on(node)
                .pinned()
                .create_async((), |()| MetaCopy::default())
                .await;
            match made {
                Ok(p) => {
                    tracing::info!("the metadata copy is on {node}");
                    self.engine.meta.place(format!("on {node}"));
                    return Some(p);
                }
                Err(e) => tracing::warn!("cannot keep the metadata copy on {node}: {e}"),
            }
        }
        None
    }

    /// Ship changes until [`Replicator::finish`]; returns then.
    pub async fn run(self: Arc<Self>) {
        let _running = self.running.lock().await;
        let sync = &self.engine.meta;
        sync.active.store(true, Ordering::Release);
        // An adopted copy already holds what the namespace was restored from.
        let mut full = self.copy.lock().is_none();
        if !full {
            sync.place("adopted from the mount that died".into());
        }
        let mut alone_said = false;
        let mut last_heard = std::time::Instant::now();
        // A new copy is recorded (for the next mount to adopt) once it holds everything,
        // and before any fsync counts on it: until then the record names the copy before
        // it, which holds everything an fsync returned for.
        let mut unrecorded = false;
        // The copy before it, kept (if it still exists) until then: the record names it.
        let mut retired: Option<Proclet<MetaCopy>> = None;
        while !self.stop.load(Ordering::Acquire) {
            let _ = tokio::time::timeout(INTERVAL, sync.poke.notified()).await;
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let copy = match self.copy() {
                Some(c) => c,
                None => {
                    match self.make_copy().await {
                        Some(c) => {
                            // (Only its delay and pause mean something here: they hold
                            // the turn where a stop used to miss the copy being made.)
                            let _ = granule_failpoints::hit("fs.metacopy.made").await;
                            *self.copy.lock() = Some(c.clone());
                            full = true;
                            unrecorded = true;
                            alone_said = false;
                            if self.stop.load(Ordering::Acquire) {
                                // Not recorded: `finish` destroys it.
                                break;
                            }
                            c
                        }
                        None => {
                            if !alone_said {
                                sync.place("none: no other own node, the metadata is on the mount's node only".into());
                                tracing::warn!(
                                "no other own node can hold the metadata copy: the metadata is on the mount's node only"
                            );
                                alone_said = true;
                            }
                            // Nothing to wait for: fsync must not hang on a copy that
                            // cannot exist.
                            let seq = self.engine.ns.lock().seq();
                            sync.shipped(seq);
                            continue;
                        }
                    }
                }
            };
            let changes = {
                let mut ns = self.engine.ns.lock();
                if full {
                    Some(ns.snapshot())
                } else {
                    ns.take_changes()
                }
            };
            let Some(changes) = changes else {
                // Nothing to ship: check now and then that the copy is still there, so
                // a dead node's copy is replaced before the next change needs it.
                if last_heard.elapsed() >= PING {
                    last_heard = std::time::Instant::now();
                    if let Err(e) = copy.run_ref_async((), |c: &MetaCopy, ()| c.seq).await {
                        tracing::warn!("the metadata copy is gone ({e}): making another");
                        *self.copy.lock() = None;
                        retire(&mut retired, copy, unrecorded);
                        full = true;
                    }
                }
                continue;
            };
            let batch = Batch {
                full,
                changes,
                mount: self.image(),
            };
            match copy
                .run_async(batch, |c: &mut MetaCopy, b: Batch| c.apply(b))
                .await
            {
                Ok(seq) => {
                    full = false;
                    last_heard = std::time::Instant::now();
                    if unrecorded {
                        (self.on_new_copy)(&copy);
                        unrecorded = false;
                        if let Some(old) = retired.take() {
                            // It may live on (a call to it failed, not its node): it
                            // must not hold memory nobody will read.
                            tokio::spawn(async move {
                                let _ = old.destroy_async().await;
                            });
                        }
                    }
                    sync.shipped(seq);
                }
                Err(e) => {
                    // The changes taken are not on any copy now: the next copy gets
                    // everything.
                    tracing::warn!("the metadata copy failed ({e}): making another");
                    *self.copy.lock() = None;
                    retire(&mut retired, copy, unrecorded);
                    full = true;
                }
            }
        }
        // The mount ended cleanly: a copy kept for the record goes too.
        if let Some(old) = retired {
            let _ = old.destroy_async().await;
        }
    }

    /// End [`Replicator::run`] and wait until its current turn is over (at most
    /// [`STOP_PATIENCE`]): after this, the record is never written again. Copies stay.
    pub async fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.engine.meta.poke.notify_one();
        if tokio::time::timeout(STOP_PATIENCE, self.running.lock())
            .await
            .is_err()
        {
            tracing::warn!(
                "the metadata replicator did not end within {STOP_PATIENCE:?} of the stop"
            );
        }
    }

    /// [`Replicator::stop`], then destroy the copy: the mount ended cleanly, and its
    /// files with it.
    pub async fn finish(&self) {
        self.stop().await;
        let copy = self.copy.lock().take();
        if let Some(c) = copy {
            let _ = c.destroy_async().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Namespace;

    fn image() -> MountImage {
        MountImage {
            stores: Vec::new(),
            layouts: vec![Layout::default()],
            master: [3; 32],
            protection: "encrypt".into(),
            stripe: 1 << 20,
            versions_below: 10,
        }
    }

    #[test]
    fn batches_bring_a_copy_to_the_namespace() {
        let mut ns = Namespace::new(0o755, 0, 0);
        let mut copy = MetaCopy::default();
        let ship = |ns: &mut Namespace, copy: &mut MetaCopy, full: bool| {
            let changes = if full {
                Some(ns.snapshot())
            } else {
                ns.take_changes()
            };
            if let Some(changes) = changes {
                copy.apply(Batch {
                    full,
                    changes,
                    mount: image(),
                });
            }
        };
        let a = ns
            .create(crate::meta::ROOT, "a".as_ref(), 0o644, 0, 0, 0)
            .unwrap();
        let d = ns
            .mkdir(crate::meta::ROOT, "d".as_ref(), 0o755, 0, 0)
            .unwrap();
        ship(&mut ns, &mut copy, true);
        ns.rename(crate::meta::ROOT, "a".as_ref(), d, "b".as_ref(), false)
            .unwrap();
        ns.get_mut(a).unwrap().size = 77;
        let c = ns
            .create(crate::meta::ROOT, "c".as_ref(), 0o600, 0, 0, 0)
            .unwrap();
        ns.unlink(crate::meta::ROOT, "c".as_ref()).unwrap();
        ship(&mut ns, &mut copy, false);
        assert_eq!(copy.seq, ns.seq());
        assert!(ns.take_changes().is_none(), "nothing left to ship");
        let (restored, freed) = Namespace::restore(copy.inodes.clone(), copy.next);
        assert!(freed.is_empty());
        let mut want: Vec<_> = ns.inodes().cloned().collect();
        let mut got: Vec<_> = restored.inodes().cloned().collect();
        want.sort_by_key(|i| i.ino);
        got.sort_by_key(|i| i.ino);
        assert_eq!(got, want);
        assert!(restored.get(c).is_err());
        assert_eq!(restored.get(a).unwrap().size, 77);
        assert_eq!(
            restored.lookup(d, "b".as_ref()).unwrap(),
            a,
            "the rename reached the copy"
        );

        // A new copy gets everything at once.
        let mut fresh = MetaCopy::default();
        ship(&mut ns, &mut fresh, true);
        assert_eq!(fresh.inodes, copy.inodes);
    }
}
