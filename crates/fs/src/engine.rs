//! The file system's engine, below FUSE: the namespace behind one lock, the write-behind
//! buffers, the read cache and readahead, stripe placement onto stores, replicas, and
//! moving stripes off a store that drains or is lost.
//!
//! A write takes room for each stripe buffer it opens before it is acknowledged
//! ([`crate::room`]): a full mount fails the writer's `write()` with ENOSPC (a write that
//! fits only in part is cut short), never a later `fsync` after acknowledged bytes.
//! Writes land in a per-stripe buffer; a stripe that fills (or any buffer at `flush`,
//! `fsync`, `release`, or when too much is buffered) is sent to its stores by a task,
//! with at most `fs.write_behind` stripes in flight (a writer waits for a slot). Each
//! write of a stripe takes a fresh version number: the store key, the sealing counter,
//! and the rule that decides which of two racing writes of a stripe wins (the newer).
//! Errors of write-behind (a store that refuses or is lost) are kept and reported by the next `fsync`
//! or `flush` of the file, as local file systems report write-back errors.
//!
//! Reads take the newest bytes there are: a buffer not yet sent, a stripe being sent,
//! the cache, then the stores — the copies the metadata names first, then every store in
//! the stripe's hash order (a stripe that moved during a drain is found there). A copy
//! that fails verification is skipped (the replica serves) and counted; when no copy is
//! left the read fails with EIO and a log line names the file. Never wrong bytes.
//!
//! Lock order. The engine's mutexes are held briefly and never across an `await`. Where
//! one is taken while another is held, it is in this order: `dirty` → `inflight` →
//! `pending` (a buffer staged under `dirty` moves to `inflight` and is counted in
//! `pending`), and `dirty` → `ns` (a writer checks the stripe's stored version before it
//! opens a buffer). `ns`, `layouts`, `cache` and the stores' table are otherwise taken
//! alone; the FUSE layer takes `ns` alone too. Room ([`crate::room`]) and the counters
//! are atomics, taken under any lock or none.

use crate::meta::{Freed, Ino, Namespace, Node, Stripe};
use crate::placement::{stripe_key, Layout, StoreId};
use crate::stores::{Store, StoreError, StoreState, Stores};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};
use tokio::sync::{Notify, OnceCell, Semaphore};

/// The engine's settings (from `[fs]`).
#[derive(Clone, Debug)]
pub struct Settings {
    pub stripe: u64,
    pub replicas: usize,
    pub cache_bytes: u64,
    pub readahead: u32,
    pub write_behind: u32,
    /// Bytes of partly written stripes buffered before a writer sends its file's.
    pub dirty: u64,
}

type Fetched = Result<Bytes, i32>;
/// A stripe being written: its version and bytes.
type InFlight = (u64, Bytes);
type Slot = Arc<OnceCell<Fetched>>;

/// Stripes read, by (inode, stripe, version): a stale version is never served because
/// the version is part of the key.
#[derive(Default)]
struct Cache {
    slots: HashMap<(Ino, u64, u64), Slot>,
    order: VecDeque<((Ino, u64, u64), u64)>,
    bytes: u64,
}

/// A file's stripes buffered in the mount.
#[derive(Default)]
struct Dirty {
    /// Stripe index → its content from byte 0 (its length is the stripe's valid length).
    stripes: HashMap<u64, Vec<u8>>,
}

/// Per-inode write-behind bookkeeping.
#[derive(Default)]
struct Pending {
    /// Stripe writes in flight.
    inflight: u64,
    /// The first error of write-behind since the last fsync/flush.
    error: Option<i32>,
}

/// Counters for status and metrics.
#[derive(Default)]
pub struct Counters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub stripes_fetched: AtomicU64,
    pub stripes_stored: AtomicU64,
    pub cache_hits: AtomicU64,
    pub verification_failures: AtomicU64,
    pub lost_stripes: AtomicU64,
    pub draining: AtomicU64,
    pub moved: AtomicU64,
}

pub struct Engine {
    pub settings: Settings,
    pub ns: Mutex<Namespace>,
    layouts: Mutex<Vec<Layout>>,
    pub stores: Stores,
    next_version: AtomicU64,
    dirty: Mutex<HashMap<Ino, Dirty>>,
    dirty_bytes: AtomicU64,
    /// Room promised to buffered and in-flight stripes.
    room: crate::room::Room,
    /// Stripes being written: the newest data, for readers.
    inflight: Mutex<HashMap<(Ino, u64), InFlight>>,
    pending: Mutex<HashMap<Ino, Pending>>,
    pending_changed: Notify,
    cache: Mutex<Cache>,
    write_slots: Arc<Semaphore>,
    pub rt: tokio::runtime::Handle,
    pub n: Counters,
    /// When the mount started (status).
    pub started: Instant,
    /// How far the metadata copy has caught up (fsync waits on it).
    pub meta: crate::metacopy::MetaSync,
}

/// The byte range of stripe `idx` a request at `offset..offset+len` covers, as
/// (stripe, offset in the stripe, length).
fn pieces(offset: u64, len: u64, stripe: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let idx = pos / stripe;
        let o = pos % stripe;
        let n = (stripe - o).min(end - pos);
        pos += n;
        Some((idx, o as usize, n as usize))
    })
}

impl Engine {
    pub fn new(settings: Settings, rt: tokio::runtime::Handle, ns: Namespace) -> Arc<Engine> {
        let slots = settings.write_behind.max(1) as usize;
        Arc::new(Engine {
            settings,
            ns: Mutex::new(ns),
            layouts: Mutex::new(vec![Layout::default()]),
            stores: Stores::default(),
            // Versions start from a random point: two mounts sharing a victim store
            // (never the same lease) still never collide on a key.
            next_version: AtomicU64::new(rand::random::<u64>() >> 8 | 1),
            dirty: Mutex::new(HashMap::new()),
            dirty_bytes: AtomicU64::new(0),
            room: crate::room::Room::default(),
            inflight: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            pending_changed: Notify::new(),
            cache: Mutex::new(Cache::default()),
            write_slots: Arc::new(Semaphore::new(slots)),
            rt,
            n: Counters::default(),
            started: Instant::now(),
            meta: crate::metacopy::MetaSync::default(),
        })
    }

    // ---- layouts and stores -----------------------------------------------------------

    /// Make `layout` the one new files are placed with; returns its index.
    pub fn push_layout(&self, layout: Layout) -> u32 {
        let mut l = self.layouts.lock();
        l.push(layout);
        (l.len() - 1) as u32
    }

    pub fn current_layout(&self) -> u32 {
        (self.layouts.lock().len() - 1) as u32
    }

    pub fn layout(&self, i: u32) -> Layout {
        let l = self.layouts.lock();
        l.get(i as usize)
            .or_else(|| l.last())
            .cloned()
            .unwrap_or_default()
    }

    /// Add a store to the current layout's class `class` (new files place over it).
    pub fn add_store(&self, store: Store, class_name: &str, weight: f64) -> Arc<Store> {
        let class = store.class;
        let id = store.id;
        let s = self.stores.insert(store);
        let mut next = self.layout(self.current_layout());
        while next.classes.len() <= class {
            next.classes.push(crate::placement::Class {
                name: String::new(),
                weight: 1.0,
                stores: Vec::new(),
            });
        }
        let c = &mut next.classes[class];
        c.name = class_name.to_string();
        c.weight = weight;
        c.stores.push(id);
        self.push_layout(next);
        s
    }

    /// Every layout so far (the metadata copy keeps them).
    pub fn layouts(&self) -> Vec<Layout> {
        self.layouts.lock().clone()
    }

    /// Every stripe version handed out so far is below this.
    pub fn versions_below(&self) -> u64 {
        self.next_version.load(Ordering::Relaxed)
    }

    /// Serve what a metadata copy kept (recovery; before the mount takes requests): the
    /// namespace, the layouts and the stores. Store accounting is counted again from the
    /// stripe tables. Stripes orphaned by the dead mount are deleted.
    pub fn restore(
        self: &Arc<Self>,
        ns: Namespace,
        orphans: Vec<Freed>,
        layouts: Vec<Layout>,
        stores: Vec<Store>,
        versions_below: u64,
    ) {
        // Versions are also the sealing counter: none may be used twice. The dead mount
        // may have handed out versions after its last shipment, but never billions.
        self.next_version
            .fetch_max(versions_below.saturating_add(1 << 32), Ordering::Relaxed);
        for s in stores {
            self.stores.insert(s);
        }
        if !layouts.is_empty() {
            *self.layouts.lock() = layouts;
        }
        {
            for i in ns.inodes() {
                if let Node::File { stripes, .. } = &i.node {
                    for st in stripes.values() {
                        for c in &st.copies {
                            if let Some(s) = self.stores.get(*c) {
                                let size = s.stored_size(st.stored as usize);
                                s.used.fetch_add(size, Ordering::Relaxed);
                                s.stripes.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                }
            }
        }
        *self.ns.lock() = ns;
        self.release_freed(orphans);
    }

    /// fsync: [`Engine::sync`], then wait until the metadata copy holds the namespace
    /// as it is now.
    pub async fn fsync(self: &Arc<Self>, ino: Ino) -> Result<(), i32> {
        let r = self.sync(ino).await;
        self.sync_meta().await;
        r
    }

    /// Wait until the metadata copy holds the namespace as it is now.
    pub async fn sync_meta(&self) {
        let seq = self.ns.lock().seq();
        self.meta.wait(seq).await;
    }

    /// Bytes (capacity, used) over stores that take stripes; used counts the room
    /// promised to stripes not stored yet.
    pub fn space(&self) -> (u64, u64) {
        let (cap, stored) = self.stored_space();
        (cap, stored + self.room.promised())
    }

    /// Bytes (capacity, used by the stores' own accounting) over stores that take
    /// stripes.
    fn stored_space(&self) -> (u64, u64) {
        let (mut cap, mut used) = (0u64, 0u64);
        for s in self.stores.all() {
            if s.state() == StoreState::Active {
                cap += s.capacity.load(Ordering::Relaxed);
                used += s.used.load(Ordering::Relaxed);
            }
        }
        (cap, used)
    }

    /// Bytes of whole stripes the stores that take stripes can still hold: a store
    /// keeps whole stripes, so its last part-stripe of room holds none.
    fn room_for_stripes(&self) -> u64 {
        let stripe = self.settings.stripe;
        self.stores
            .all()
            .iter()
            .filter(|s| s.state() == StoreState::Active)
            .map(|s| s.free() / s.stored_size(stripe as usize).max(1) * stripe)
            .sum()
    }

    /// The room one stripe buffer takes: a whole stripe per copy (a buffer may grow to
    /// a stripe).
    fn stripe_room(&self) -> u64 {
        self.settings.stripe * self.settings.replicas.max(1) as u64
    }

    fn fresh_version(&self) -> u64 {
        self.next_version.fetch_add(1, Ordering::Relaxed)
    }

    /// Choose and reserve stores for `copies` copies of `size` bytes of stripe `key`
    /// under `layout`, never one of `exclude`.
    fn place(
        &self,
        layout: &Layout,
        key: u64,
        size: usize,
        copies: usize,
        exclude: &[StoreId],
    ) -> Vec<Arc<Store>> {
        for _attempt in 0..4 {
            let ok = |id: StoreId| {
                !exclude.contains(&id)
                    && self.stores.get(id).is_some_and(|s| {
                        s.state() == StoreState::Active && s.free() >= s.stored_size(size)
                    })
            };
            let ids = layout.targets(key, copies, ok);
            let mut got: Vec<Arc<Store>> = Vec::new();
            let mut raced = false;
            for id in ids {
                let Some(s) = self.stores.get(id) else {
                    continue;
                };
                if s.reserve(s.stored_size(size)) {
                    got.push(s);
                } else {
                    raced = true;
                }
            }
            if !raced || got.len() >= copies {
                return got;
            }
            for s in &got {
                s.unreserve(s.stored_size(size));
            }
        }
        Vec::new()
    }

    // ---- writing ----------------------------------------------------------------------

    /// The stripe's current content (newest first: buffered, in flight, stored), for a
    /// write that changes only part of it.
    async fn current_stripe(self: &Arc<Self>, ino: Ino, idx: u64) -> Result<Vec<u8>, i32> {
        if let Some((_, d)) = self.inflight.lock().get(&(ino, idx)) {
            return Ok(d.to_vec());
        }
        let (meta, layout, name) = {
            let ns = self.ns.lock();
            let i = ns.get(ino)?;
            match &i.node {
                Node::File { stripes, layout } => {
                    (stripes.get(&idx).cloned(), *layout, i.name.clone())
                }
                _ => return Err(libc::EISDIR),
            }
        };
        let Some(meta) = meta else {
            return Ok(Vec::new());
        };
        let data = self.fetch(ino, idx, &meta, layout, &name).await?;
        Ok(data[..(meta.len as usize).min(data.len())].to_vec())
    }

    /// Write `data` at `offset` of file `ino`; returns the bytes written, fewer than
    /// `data` when the mount fills part-way (ENOSPC when not one byte fits).
    pub async fn write(self: &Arc<Self>, ino: Ino, offset: u64, data: &[u8]) -> Result<usize, i32> {
        let stripe = self.settings.stripe;
        offset.checked_add(data.len() as u64).ok_or(libc::EFBIG)?;
        if data.is_empty() {
            return Ok(0);
        }
        // Room for every buffer this write opens, before anything changes: a rewrite
        // too, since its new version is stored before the old one is deleted. A write
        // that finds room for only its first stripes is cut short there.
        let all: Vec<(u64, usize, usize)> = pieces(offset, data.len() as u64, stripe).collect();
        let charge = self.stripe_room();
        let mut free = None; // looked up only when the write opens a buffer
        let mut promised = 0u64;
        let mut fits = all.len();
        for (k, &(idx, _, _)) in all.iter().enumerate() {
            if self.is_buffered(ino, idx) {
                continue;
            }
            let free = *free.get_or_insert_with(|| self.room_for_stripes());
            if !self.room.try_take(charge, free) {
                fits = k;
                break;
            }
            promised += 1;
        }
        if fits == 0 {
            return Err(libc::ENOSPC);
        }
        let len: usize = all[..fits].iter().map(|p| p.2).sum();
        let end = offset + len as u64;
        // The size first: a stripe sent below is installed only within the file.
        let mut result = {
            let mut ns = self.ns.lock();
            ns.get_mut(ino).and_then(|i| {
                if !matches!(i.node, Node::File { .. }) {
                    return Err(libc::EISDIR);
                }
                if end > i.size {
                    i.size = end;
                }
                let now = SystemTime::now();
                i.mtime = now;
                i.ctime = now;
                Ok(())
            })
        };
        let mut consumed = 0usize;
        for &(idx, o, n) in &all[..fits] {
            if result.is_err() {
                break;
            }
            let part = &data[consumed..consumed + n];
            consumed += n;
            result = self.write_piece(ino, idx, o, part, &mut promised).await;
        }
        // Promises no buffer took: another writer opened it meanwhile, or a piece failed.
        self.room.give_back(promised * charge);
        result?;
        self.n.writes.fetch_add(1, Ordering::Relaxed);
        self.n
            .bytes_written
            .fetch_add(len as u64, Ordering::Relaxed);
        // Bound what is buffered: flush this file's partial stripes when over. A random
        // writer rewrites buffered stripes for free until then (its first write to a
        // stored stripe fetches it once).
        if self.dirty_bytes.load(Ordering::Relaxed) > self.settings.dirty {
            self.flush_buffers(ino).await;
        }
        Ok(len)
    }

    fn is_buffered(&self, ino: Ino, idx: u64) -> bool {
        self.dirty
            .lock()
            .get(&ino)
            .is_some_and(|d| d.stripes.contains_key(&idx))
    }

    fn existing_len(&self, ino: Ino, idx: u64) -> u64 {
        if let Some((_, d)) = self.inflight.lock().get(&(ino, idx)) {
            return d.len() as u64;
        }
        let ns = self.ns.lock();
        match ns.get(ino).map(|i| &i.node) {
            Ok(Node::File { stripes, .. }) => stripes.get(&idx).map_or(0, |s| u64::from(s.len)),
            _ => 0,
        }
    }

    /// Write `part` at `o` of stripe `idx`: into the stripe's buffer, which starts from
    /// the stripe's newest content unless this write replaces all of it. A buffer written
    /// up to the stripe's end is sent at once (sequential writers). A new buffer takes
    /// one of the writer's `promised` stripes of room.
    async fn write_piece(
        self: &Arc<Self>,
        ino: Ino,
        idx: u64,
        o: usize,
        part: &[u8],
        promised: &mut u64,
    ) -> Result<(), i32> {
        let stripe = self.settings.stripe;
        let n = part.len();
        loop {
            // Outside the lock (fetching may take a store round trip): the content a new
            // buffer would start from, and which version of the stripe that is.
            let seen = self.content_version(ino, idx);
            let mut base = None;
            if !self.is_buffered(ino, idx) {
                let existing = self.existing_len(ino, idx);
                if existing > 0 && !(o == 0 && n as u64 >= existing) {
                    base = Some(self.current_stripe(ino, idx).await?);
                }
            }
            let staged = {
                let mut dirty = self.dirty.lock();
                let d = dirty.entry(ino).or_default();
                // Bytes a new buffer starts with count as buffered too.
                let (buf, before) = match d.stripes.entry(idx) {
                    std::collections::hash_map::Entry::Occupied(e) => {
                        let b = e.into_mut();
                        let len = b.len();
                        (b, len)
                    }
                    std::collections::hash_map::Entry::Vacant(e) => {
                        // Another writer may have sent the stripe meanwhile: then the
                        // base is stale; start again from the newer content.
                        if self.content_version(ino, idx) != seen {
                            continue;
                        }
                        // The buffer holds room until its stripe is stored. A writer
                        // that found the stripe buffered promised nothing for it: if
                        // it was sent meanwhile, take the room now (one stripe over at
                        // most; the stores still refuse what does not fit).
                        if *promised > 0 {
                            *promised -= 1;
                        } else {
                            self.room.force_take(self.stripe_room());
                        }
                        (e.insert(base.take().unwrap_or_default()), 0)
                    }
                };
                // Appending extends the buffer without zero-filling it first.
                if buf.len() <= o {
                    buf.resize(o, 0);
                    buf.extend_from_slice(part);
                } else {
                    let overlap = (buf.len() - o).min(n);
                    buf[o..o + overlap].copy_from_slice(&part[..overlap]);
                    buf.extend_from_slice(&part[overlap..]);
                }
                self.dirty_bytes
                    .fetch_add((buf.len() - before) as u64, Ordering::Relaxed);
                if (o + n) as u64 == stripe {
                    d.stripes.remove(&idx).map(|buf| self.stage(ino, idx, buf))
                } else {
                    None
                }
            };
            if let Some((version, data)) = staged {
                self.send(ino, idx, version, data).await;
            }
            return Ok(());
        }
    }

    /// The version of the stripe's newest content outside the buffers (0: none).
    fn content_version(&self, ino: Ino, idx: u64) -> u64 {
        if let Some((v, _)) = self.inflight.lock().get(&(ino, idx)) {
            return *v;
        }
        let ns = self.ns.lock();
        match ns.get(ino).map(|i| &i.node) {
            Ok(Node::File { stripes, .. }) => stripes.get(&idx).map_or(0, |s| s.version),
            _ => 0,
        }
    }

    /// A buffer leaves the buffers: it takes its version and becomes the stripe's newest
    /// content for readers at once (called under the buffers' lock, so no reader or
    /// writer sees the stripe in neither place).
    fn stage(&self, ino: Ino, idx: u64, buf: Vec<u8>) -> (u64, Bytes) {
        self.dirty_bytes
            .fetch_sub(buf.len() as u64, Ordering::Relaxed);
        let version = self.fresh_version();
        let data = Bytes::from(buf);
        self.inflight
            .lock()
            .insert((ino, idx), (version, data.clone()));
        self.pending.lock().entry(ino).or_default().inflight += 1;
        (version, data)
    }

    /// Send a staged stripe to its stores (waits for a write-behind slot, not for the
    /// write).
    async fn send(self: &Arc<Self>, ino: Ino, idx: u64, version: u64, data: Bytes) {
        let permit = self.write_slots.clone().acquire_owned().await.ok();
        let me = self.clone();
        self.rt.spawn(async move {
            let r = me.store_stripe(ino, idx, version, data).await;
            // Stored (the stores count it now) or failed: the buffer's room ends.
            me.room.give_back(me.stripe_room());
            drop(permit);
            {
                let mut inf = me.inflight.lock();
                if inf.get(&(ino, idx)).is_some_and(|(v, _)| *v == version) {
                    inf.remove(&(ino, idx));
                }
            }
            let mut p = me.pending.lock();
            let e = p.entry(ino).or_default();
            e.inflight = e.inflight.saturating_sub(1);
            if let Err(errno) = r {
                e.error.get_or_insert(errno);
            }
            drop(p);
            me.pending_changed.notify_waiters();
        });
    }

    /// Write `data` as `version` of stripe `idx` to its stores and record it.
    async fn store_stripe(
        self: &Arc<Self>,
        ino: Ino,
        idx: u64,
        version: u64,
        data: Bytes,
    ) -> Result<(), i32> {
        let layout_i = {
            let ns = self.ns.lock();
            match ns.get(ino).map(|i| &i.node) {
                Ok(Node::File { layout, .. }) => *layout,
                _ => return Ok(()), // the file is gone: nothing to keep
            }
        };
        let layout = self.layout(layout_i);
        let key = stripe_key(ino, idx);
        let want = self.settings.replicas;
        let mut copies: Vec<StoreId> = Vec::new();
        let mut tried: Vec<StoreId> = Vec::new();
        let mut last_err = libc::ENOSPC;
        while copies.len() < want {
            let targets = self.place(&layout, key, data.len(), want - copies.len(), &tried);
            if targets.is_empty() {
                break;
            }
            let puts = targets.iter().map(|s| s.put(version, &data));
            let results = futures::future::join_all(puts).await;
            for (s, r) in targets.iter().zip(results) {
                tried.push(s.id);
                match r {
                    Ok(()) => copies.push(s.id),
                    Err(e) => {
                        s.unreserve(s.stored_size(data.len()));
                        last_err = if e == StoreError::Full {
                            libc::ENOSPC
                        } else {
                            libc::EIO
                        };
                        if e == StoreError::Full {
                            // Our accounting was ahead of the store's: stop placing there.
                            s.capacity
                                .store(s.used.load(Ordering::Relaxed), Ordering::Relaxed);
                        }
                        tracing::warn!(store = %s.name, "stripe write failed: {e}");
                        if matches!(e, StoreError::Lost(_)) {
                            self.store_lost(s.id);
                        }
                    }
                }
            }
        }
        if copies.is_empty() {
            tracing::warn!(ino, stripe = idx, "no store took the stripe");
            return Err(last_err);
        }
        self.n.stripes_stored.fetch_add(1, Ordering::Relaxed);
        // Install it unless a newer version got there first or the file went away (or
        // was truncated below the stripe meanwhile).
        let ours = Freed {
            version,
            stored: data.len() as u32,
            copies: copies.clone(),
        };
        let stale = {
            let mut ns = self.ns.lock();
            let start = idx * self.settings.stripe;
            match ns.get_mut(ino) {
                Ok(i) => {
                    let size = i.size;
                    match &mut i.node {
                        Node::File { stripes, .. } => {
                            let newer = stripes.get(&idx).is_some_and(|s| s.version > version);
                            if newer || start >= size {
                                Some(ours)
                            } else {
                                let len = data.len().min((size - start) as usize) as u32;
                                let new = Stripe {
                                    version,
                                    len,
                                    stored: data.len() as u32,
                                    copies: copies.clone(),
                                };
                                stripes.insert(idx, new).map(|old| Freed {
                                    version: old.version,
                                    stored: old.stored,
                                    copies: old.copies,
                                })
                            }
                        }
                        _ => Some(ours),
                    }
                }
                Err(_) => Some(ours),
            }
        };
        if let Some(f) = stale {
            self.release_freed(vec![f]);
        }
        Ok(())
    }

    /// Delete freed stripe copies from their stores, in the background.
    pub fn release_freed(self: &Arc<Self>, freed: Vec<Freed>) {
        if freed.is_empty() {
            return;
        }
        let me = self.clone();
        self.rt.spawn(async move {
            for f in freed {
                for id in f.copies {
                    if let Some(s) = me.stores.get(id) {
                        let bytes = s.stored_size(f.stored as usize);
                        if let Err(e) = s.delete(f.version, bytes).await {
                            tracing::debug!(store = %s.name, "delete failed: {e}");
                        }
                    }
                }
            }
        });
    }

    /// Send every buffered stripe of `ino`.
    pub async fn flush_buffers(self: &Arc<Self>, ino: Ino) {
        let staged: Vec<(u64, u64, Bytes)> = {
            let mut dirty = self.dirty.lock();
            match dirty.remove(&ino) {
                Some(d) => d
                    .stripes
                    .into_iter()
                    .map(|(idx, buf)| {
                        let (v, data) = self.stage(ino, idx, buf);
                        (idx, v, data)
                    })
                    .collect(),
                None => Vec::new(),
            }
        };
        for (idx, version, data) in staged {
            self.send(ino, idx, version, data).await;
        }
    }

    /// fsync/flush: every byte written to `ino` so far is on its stores; the first
    /// write-behind error since the last call, if any.
    pub async fn sync(self: &Arc<Self>, ino: Ino) -> Result<(), i32> {
        self.flush_buffers(ino).await;
        loop {
            let notified = self.pending_changed.notified();
            {
                let mut p = self.pending.lock();
                let e = p.entry(ino).or_default();
                if e.inflight == 0 {
                    let err = e.error.take();
                    p.remove(&ino);
                    return err.map_or(Ok(()), Err);
                }
            }
            notified.await;
        }
    }

    /// Set the size of `ino` (truncate or extend with zeros).
    pub async fn truncate(self: &Arc<Self>, ino: Ino, size: u64) -> Result<(), i32> {
        // Buffers and writes in flight could land after the truncate: finish them first.
        // Their error, if any, stays for the file's next fsync or flush to report.
        if let Err(e) = self.sync(ino).await {
            self.pending
                .lock()
                .entry(ino)
                .or_default()
                .error
                .get_or_insert(e);
        }
        let freed = self.ns.lock().truncate(ino, size, self.settings.stripe)?;
        self.release_freed(freed);
        Ok(())
    }

    /// lseek SEEK_DATA (`hole` false) or SEEK_HOLE from `offset` of `ino`, to the stripe:
    /// stripes stored, buffered or in flight are data; any other is a hole. `unsent`:
    /// a writer has the file open, so pages the kernel has not sent yet may be anywhere,
    /// and the whole file counts as data.
    pub fn seek(&self, ino: Ino, offset: u64, hole: bool, unsent: bool) -> Result<u64, i32> {
        // Buffers, then stripes in flight, then the table: a stripe moves on in that
        // order, so one looked at in none of them was stored before the table is read.
        let buffered = (!unsent).then(|| {
            let mut b: BTreeSet<u64> = self
                .dirty
                .lock()
                .get(&ino)
                .map(|d| d.stripes.keys().copied().collect())
                .unwrap_or_default();
            let inflight = self.inflight.lock();
            b.extend(inflight.keys().filter(|k| k.0 == ino).map(|k| k.1));
            b
        });
        self.ns
            .lock()
            .seek(ino, offset, hole, self.settings.stripe, buffered.as_ref())
    }

    // ---- reading ----------------------------------------------------------------------

    /// Read `size` bytes at `offset` of `ino`.
    pub async fn read(
        self: &Arc<Self>,
        ino: Ino,
        offset: u64,
        size: u32,
        sequential: bool,
    ) -> Result<ReadOut, i32> {
        let stripe = self.settings.stripe;
        let (file_size, layout, name) = {
            let ns = self.ns.lock();
            let i = ns.get(ino)?;
            match &i.node {
                Node::File { layout, .. } => (i.size, *layout, i.name.clone()),
                _ => return Err(libc::EISDIR),
            }
        };
        if offset >= file_size {
            return Ok(ReadOut::Owned(Vec::new()));
        }
        let len = u64::from(size).min(file_size - offset);
        if sequential && self.settings.readahead > 0 && offset % stripe < len {
            // Once per stripe a sequential reader enters: fetch the next ones.
            let last = (offset + len - 1) / stripe;
            let max = file_size.saturating_sub(1) / stripe;
            let me = self.clone();
            let ra = u64::from(self.settings.readahead);
            self.rt
                .spawn(async move { me.read_ahead(ino, last + 1, (last + ra).min(max)).await });
        }
        self.n.reads.fetch_add(1, Ordering::Relaxed);
        self.n.bytes_read.fetch_add(len, Ordering::Relaxed);
        // The common case: within one stored stripe, answered from the fetched stripe
        // itself without copying.
        let (idx, o) = (offset / stripe, (offset % stripe) as usize);
        if o as u64 + len <= stripe
            && !self.is_buffered(ino, idx)
            && !self.inflight.lock().contains_key(&(ino, idx))
        {
            let meta = {
                let ns = self.ns.lock();
                match ns.get(ino).map(|i| &i.node) {
                    Ok(Node::File { stripes, .. }) => stripes.get(&idx).cloned(),
                    _ => None,
                }
            };
            if let Some(meta) = meta.filter(|m| o + len as usize <= m.len as usize) {
                // A small read out of sequence takes only its bytes from an own store
                // (random 4 KiB reads would otherwise move a whole stripe each).
                if !sequential && len * 8 <= stripe && !self.is_cached(ino, idx, meta.version) {
                    if let Some(d) = self.fetch_range(&meta, o, len as usize).await {
                        let n = d.len();
                        return Ok(ReadOut::Shared(d, 0, n));
                    }
                }
                let data = self.fetch(ino, idx, &meta, layout, &name).await?;
                if o + len as usize <= data.len() {
                    return Ok(ReadOut::Shared(data, o, o + len as usize));
                }
            }
        }
        let mut out = Vec::with_capacity(len as usize);
        for (idx, o, n) in pieces(offset, len, stripe) {
            let start = out.len();
            out.resize(start + n, 0);
            let dst = &mut out[start..start + n];
            // Buffered or in flight: newest bytes.
            let copied = {
                let dirty = self.dirty.lock();
                dirty
                    .get(&ino)
                    .and_then(|d| d.stripes.get(&idx))
                    .map(|b| copy_part(b, o, dst))
            };
            if copied.is_some() {
                continue;
            }
            let inflight = self
                .inflight
                .lock()
                .get(&(ino, idx))
                .map(|(_, d)| d.clone());
            if let Some(d) = inflight {
                copy_part(&d, o, dst);
                continue;
            }
            let meta = {
                let ns = self.ns.lock();
                match ns.get(ino).map(|i| &i.node) {
                    Ok(Node::File { stripes, .. }) => stripes.get(&idx).cloned(),
                    _ => None,
                }
            };
            let Some(meta) = meta else {
                continue; // a hole: zeros
            };
            let data = self.fetch(ino, idx, &meta, layout, &name).await?;
            let valid = &data[..(meta.len as usize).min(data.len())];
            copy_part(valid, o, dst);
        }
        Ok(ReadOut::Owned(out))
    }

    async fn read_ahead(self: &Arc<Self>, ino: Ino, from: u64, to: u64) {
        if from > to {
            return;
        }
        let (metas, layout, name) = {
            let ns = self.ns.lock();
            let Ok(i) = ns.get(ino) else { return };
            match &i.node {
                Node::File { stripes, layout } => (
                    stripes
                        .range(from..=to)
                        .map(|(k, s)| (*k, s.clone()))
                        .collect::<Vec<_>>(),
                    *layout,
                    i.name.clone(),
                ),
                _ => return,
            }
        };
        // Stripes read in place need no fetching ahead: a read answers them at once.
        let fetches = metas
            .iter()
            .filter(|(_, m)| {
                !m.copies.iter().any(|id| {
                    self.stores
                        .get(*id)
                        .is_some_and(|s| s.holds_in_place(m.version))
                })
            })
            .map(|(idx, m)| self.fetch(ino, *idx, m, layout, &name));
        let _ = futures::future::join_all(fetches).await;
    }

    fn is_cached(&self, ino: Ino, idx: u64, version: u64) -> bool {
        self.cache
            .lock()
            .slots
            .get(&(ino, idx, version))
            .is_some_and(|s| s.initialized())
    }

    /// Part of a stripe from the first own store holding it; `None` when no own copy
    /// answers with it (the caller reads the whole stripe, with all its fallbacks).
    async fn fetch_range(&self, meta: &Stripe, o: usize, n: usize) -> Option<Bytes> {
        if let Some(d) = self.in_place(meta).await {
            return (o + n <= d.len()).then(|| d.slice(o..o + n));
        }
        for id in &meta.copies {
            let s = self.stores.get(*id)?;
            if s.state() == StoreState::Gone {
                continue;
            }
            match s.get_range(meta.version, o, n).await {
                Some(Ok(Some(d))) if d.len() == n => {
                    self.n.stripes_fetched.fetch_add(1, Ordering::Relaxed);
                    return Some(d);
                }
                None => return None,
                _ => continue,
            }
        }
        None
    }

    /// A stripe read in place from an own store on this machine that holds a copy (no
    /// call, no cache: the bytes are the store's own). Held briefly: a delete of the
    /// stripe waits for it.
    async fn in_place(&self, meta: &Stripe) -> Option<Bytes> {
        let d = meta.copies.iter().find_map(|id| {
            let d = self.stores.get(*id)?.get_in_place(meta.version)?;
            (d.len() >= meta.len as usize).then_some(d)
        })?;
        // Tests hold the stripe here while a rewrite deletes it (the delete must wait).
        let _ = granule_failpoints::hit("fs.read.in_place").await;
        Some(d)
    }

    /// A stripe's stored bytes: in place, or through the cache.
    async fn fetch(
        self: &Arc<Self>,
        ino: Ino,
        idx: u64,
        meta: &Stripe,
        layout: u32,
        name: &std::ffi::OsStr,
    ) -> Fetched {
        if let Some(d) = self.in_place(meta).await {
            return Ok(d);
        }
        let key = (ino, idx, meta.version);
        let slot = {
            let mut c = self.cache.lock();
            match c.slots.get(&key) {
                Some(s) => {
                    self.n.cache_hits.fetch_add(1, Ordering::Relaxed);
                    s.clone()
                }
                None => {
                    let s: Slot = Arc::new(OnceCell::new());
                    c.slots.insert(key, s.clone());
                    c.order.push_back((key, self.settings.stripe));
                    c.bytes += self.settings.stripe;
                    while c.bytes > self.settings.cache_bytes.max(self.settings.stripe * 2) {
                        let Some((k, b)) = c.order.pop_front() else {
                            break;
                        };
                        c.slots.remove(&k);
                        c.bytes -= b;
                    }
                    s
                }
            }
        };
        let r = slot
            .get_or_init(|| self.fetch_from_stores(idx, meta, layout, ino, name))
            .await
            .clone();
        if r.is_err() {
            // A failure is not cached: a later read tries again.
            let mut c = self.cache.lock();
            if c.slots.get(&key).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                c.slots.remove(&key);
            }
        }
        r
    }

    async fn fetch_from_stores(
        self: &Arc<Self>,
        idx: u64,
        meta: &Stripe,
        layout: u32,
        ino: Ino,
        name: &std::ffi::OsStr,
    ) -> Fetched {
        self.n.stripes_fetched.fetch_add(1, Ordering::Relaxed);
        // The copies the metadata names, then every store in the stripe's order.
        let mut order: Vec<StoreId> = meta.copies.clone();
        for (_, s) in self.layout(layout).order(stripe_key(ino, idx)) {
            if !order.contains(&s) {
                order.push(s);
            }
        }
        for id in order {
            let Some(s) = self.stores.get(id) else {
                continue;
            };
            if s.state() == StoreState::Gone && !meta.copies.contains(&id) {
                continue;
            }
            match s.get(meta.version).await {
                Ok(Some(d)) if d.len() >= meta.len as usize => return Ok(d),
                Ok(Some(d)) => {
                    tracing::warn!(store = %s.name, "stripe {idx} of {name:?} is short ({} bytes)", d.len());
                }
                Ok(None) => {}
                Err(StoreError::Tampered) => {
                    self.n.verification_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(store = %s.name, "stripe {idx} of {name:?} failed verification: copy discarded");
                }
                Err(StoreError::Lost(e)) => {
                    tracing::warn!(store = %s.name, "store lost: {e}");
                    self.store_lost(id);
                }
                Err(e) => tracing::warn!(store = %s.name, "reading stripe {idx} of {name:?}: {e}"),
            }
        }
        self.n.lost_stripes.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            "stripe {idx} of file {name:?} (inode {ino}) has no readable copy: the read fails with EIO"
        );
        Err(libc::EIO)
    }

    // ---- stores leaving -----------------------------------------------------------------

    /// A store stopped answering: its copies are dropped from the metadata, and stripes
    /// left with fewer copies than wanted get new ones from what remains.
    pub fn store_lost(self: &Arc<Self>, id: StoreId) {
        let Some(s) = self.stores.get(id) else { return };
        if s.state() == StoreState::Gone {
            return;
        }
        s.set_state(StoreState::Gone);
        tracing::warn!(store = %s.name, "store lost: its stripes are re-replicated where copies remain");
        let me = self.clone();
        self.rt
            .spawn(async move { me.evacuate(id, false, None).await });
    }

    /// Move every stripe off store `id` (drain): each goes to the next store in its
    /// order; the store is then retired. Returns stripes moved and stripes lost. With a
    /// `deadline` (a revoked lease's grace), stripes with no other copy go first, and the
    /// drain widens when its pace would miss the deadline.
    pub async fn drain(
        self: &Arc<Self>,
        id: StoreId,
        deadline: Option<Instant>,
    ) -> Result<(u64, u64), String> {
        let s = self
            .stores
            .get(id)
            .ok_or_else(|| format!("no store {id}"))?;
        // One drain per store: a second request (a refused lease renewal after the
        // revocation, an operator's `granule fs drain`) finds it draining already.
        match s.begin_drain() {
            Ok(()) => {}
            Err(StoreState::Gone) => return Err(format!("store {} is already gone", s.name)),
            Err(_) => return Err(format!("store {} is already draining", s.name)),
        }
        self.evacuate_drained(&s, deadline).await
    }

    /// [`Engine::drain`] started now (the store takes no new stripes from this moment),
    /// finished on the mount's runtime.
    pub fn start_drain(self: &Arc<Self>, id: StoreId) -> Result<(), String> {
        let s = self
            .stores
            .get(id)
            .ok_or_else(|| format!("no store {id}"))?;
        s.begin_drain()
            .map_err(|st| format!("store {} is {st:?}, not active", s.name))?;
        let e = self.clone();
        self.rt
            .spawn(async move { e.evacuate_drained(&s, None).await });
        Ok(())
    }

    async fn evacuate_drained(
        self: &Arc<Self>,
        s: &Arc<Store>,
        deadline: Option<Instant>,
    ) -> Result<(u64, u64), String> {
        let id = s.id;
        tracing::info!(store = %s.name, "draining");
        let (moved, mut lost) = self.evacuate(id, true, deadline).await;
        s.set_state(StoreState::Gone);
        let (left, sole) = {
            let ns = self.ns.lock();
            (ns.stripes_on(id).len(), ns.sole_copies_on(id))
        };
        if left > 0 {
            tracing::error!(
                store = %s.name,
                "{left} stripes could not move off the store (no room elsewhere): the {sole} with no other copy are lost when it goes"
            );
            lost += sole as u64;
        }
        tracing::info!(store = %s.name, moved, lost, "drained");
        Ok((moved, lost))
    }

    async fn evacuate(
        self: &Arc<Self>,
        id: StoreId,
        readable: bool,
        deadline: Option<Instant>,
    ) -> (u64, u64) {
        let Some(src) = self.stores.get(id) else {
            return (0, 0);
        };
        let (mut moved, mut lost) = (0u64, 0u64);
        let started = Instant::now();
        let mut late = false;
        loop {
            // Stripes with no other copy first (see `stripes_on`).
            let todo = self.ns.lock().stripes_on(id);
            if todo.is_empty() {
                break;
            }
            self.n.draining.store(todo.len() as u64, Ordering::Relaxed);
            let mut progress = false;
            let mut at = 0;
            while at < todo.len() {
                // Four stripes at a time leaves room for the mount's own I/O; sixteen when
                // that pace would not empty the store before its deadline.
                let width = match deadline {
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() && !late {
                            late = true;
                            tracing::warn!(
                                store = %src.name,
                                "{} stripes are still on the store after its grace ended: those with no other copy are lost if it goes now",
                                todo.len() - at
                            );
                        }
                        let done = moved + lost;
                        let pace = done as f64 / started.elapsed().as_secs_f64().max(1e-3);
                        let need = (todo.len() - at) as f64;
                        if done == 0 || need > pace * left.as_secs_f64() * 0.8 {
                            16
                        } else {
                            4
                        }
                    }
                    None => 4,
                };
                let chunk = &todo[at..(at + width).min(todo.len())];
                at += chunk.len();
                let jobs = chunk
                    .iter()
                    .map(|&(ino, idx, version)| self.move_one(&src, ino, idx, version, readable));
                for r in futures::future::join_all(jobs).await {
                    match r {
                        Move::Moved | Move::Dropped => {
                            moved += 1;
                            progress = true;
                        }
                        Move::Lost => {
                            lost += 1;
                            progress = true;
                        }
                        Move::Raced => progress = true,
                        Move::Stuck => {}
                    }
                }
            }
            if !progress {
                tracing::error!(store = %src.name, "stripes cannot move off the store (no room elsewhere)");
                break;
            }
        }
        self.n.draining.store(0, Ordering::Relaxed);
        self.n.moved.fetch_add(moved, Ordering::Relaxed);
        (moved, lost)
    }

    async fn move_one(
        self: &Arc<Self>,
        src: &Arc<Store>,
        ino: Ino,
        idx: u64,
        version: u64,
        readable: bool,
    ) -> Move {
        let (meta, layout, name) = {
            let ns = self.ns.lock();
            let Ok(i) = ns.get(ino) else {
                return Move::Raced;
            };
            match &i.node {
                Node::File { stripes, layout } => match stripes.get(&idx) {
                    Some(s) if s.version == version && s.copies.contains(&src.id) => {
                        (s.clone(), *layout, i.name.clone())
                    }
                    _ => return Move::Raced,
                },
                _ => return Move::Raced,
            }
        };
        let others: Vec<StoreId> = meta
            .copies
            .iter()
            .copied()
            .filter(|&c| c != src.id)
            .collect();
        let want_new = others.len() < self.settings.replicas;
        // The bytes: from the leaving store while it still answers, else from a copy.
        let mut data = None;
        if readable {
            match src.get(version).await {
                Ok(Some(d)) => data = Some(d),
                Ok(None) => {}
                // Not answering just now: try again later rather than give the copy up.
                Err(_) if others.is_empty() => return Move::Stuck,
                Err(_) => {}
            }
        }
        if data.is_none() && want_new {
            let m = Stripe {
                copies: others.clone(),
                ..meta.clone()
            };
            if !others.is_empty() {
                data = self
                    .fetch_from_stores(idx, &m, layout, ino, &name)
                    .await
                    .ok();
            }
        }
        let mut new_copy = None;
        if want_new {
            if let Some(d) = &data {
                let mut exclude = meta.copies.clone();
                exclude.push(src.id);
                let targets = self.place(
                    &self.layout(layout),
                    stripe_key(ino, idx),
                    d.len(),
                    1,
                    &exclude,
                );
                if let Some(t) = targets.first() {
                    match t.put(version, d).await {
                        Ok(()) => new_copy = Some(t.clone()),
                        Err(e) => {
                            t.unreserve(t.stored_size(d.len()));
                            tracing::warn!(store = %t.name, "moving a stripe: {e}");
                        }
                    }
                }
            }
            // No store to take it: with a copy elsewhere the stripe lives on with one
            // copy fewer (status counts it under "replicas missing"); with none, it stays
            // on the leaving store while that still answers.
            if new_copy.is_none() && others.is_empty() && readable && data.is_some() {
                return Move::Stuck;
            }
        }
        let stored = meta.stored as usize;
        // Switch the metadata over, unless the stripe changed meanwhile.
        let switched = {
            let mut ns = self.ns.lock();
            match ns.get_mut(ino).map(|i| &mut i.node) {
                Ok(Node::File { stripes, .. }) => match stripes.get_mut(&idx) {
                    Some(s) if s.version == version => {
                        s.copies.retain(|&c| c != src.id);
                        if let Some(t) = &new_copy {
                            s.copies.push(t.id);
                        }
                        true
                    }
                    _ => false,
                },
                _ => false,
            }
        };
        if !switched {
            if let Some(t) = new_copy {
                let _ = t.delete(version, t.stored_size(stored)).await;
            }
            return Move::Raced;
        }
        let _ = src.delete(version, src.stored_size(stored)).await;
        if new_copy.is_none() && others.is_empty() {
            self.n.lost_stripes.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                store = %src.name,
                "stripe {idx} of file {name:?} (inode {ino}) was only on a store that is gone: it is lost; reads of it fail with EIO"
            );
            return Move::Lost;
        }
        if new_copy.is_none() {
            return Move::Dropped;
        }
        Move::Moved
    }

    /// Close every store (own proclets are destroyed).
    pub async fn close(&self) {
        for s in self.stores.all() {
            s.close().await;
        }
    }
}

/// What a read returns: bytes of its own, or a range of a fetched stripe (no copy).
pub enum ReadOut {
    Owned(Vec<u8>),
    Shared(Bytes, usize, usize),
}

impl ReadOut {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            ReadOut::Owned(v) => v,
            ReadOut::Shared(d, a, b) => &d[*a..*b],
        }
    }
}

enum Move {
    Moved,
    /// The leaving copy was dropped; another copy remains.
    Dropped,
    Lost,
    Raced,
    Stuck,
}

/// Copy `src[o..]` into `dst` (zeros past the end of `src`).
fn copy_part(src: &[u8], o: usize, dst: &mut [u8]) {
    if o < src.len() {
        let n = dst.len().min(src.len() - o);
        dst[..n].copy_from_slice(&src[o..o + n]);
        dst[n..].fill(0);
    } else {
        dst.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_at_stripe_boundaries() {
        let v: Vec<_> = pieces(5, 20, 10).collect();
        assert_eq!(v, vec![(0, 5, 5), (1, 0, 10), (2, 0, 5)]);
        assert_eq!(pieces(0, 0, 10).count(), 0);
        let v: Vec<_> = pieces(10, 10, 10).collect();
        assert_eq!(v, vec![(1, 0, 10)]);
    }

    #[test]
    fn copy_part_zero_fills() {
        let mut d = [9u8; 4];
        copy_part(&[1, 2, 3], 1, &mut d);
        assert_eq!(d, [2, 3, 0, 0]);
        copy_part(&[1], 5, &mut d);
        assert_eq!(d, [0; 4]);
    }
}
