//! The file system's engine, below FUSE: the namespace behind one lock and the layouts;
//! the I/O of write-behind ([`crate::writebehind`] keeps its state), reads through the
//! read cache ([`crate::readcache`]) and readahead; stripe placement onto stores and
//! replicas. Moving stripes off a store that drains or is lost is in `drain`.
//!
//! A write takes room for each stripe buffer it opens before it is acknowledged
//! ([`crate::room`]): a full mount fails the writer's `write()` with ENOSPC (a write that
//! fits only in part is cut short), never a later `fsync` after acknowledged bytes.
//! Writes land in a per-stripe buffer; a stripe that fills (or any buffer at `flush`,
//! `fsync`, `release`, or when `fs.dirty` is buffered) is sent to its stores by a task,
//! with at most `fs.write_behind` stripes in flight (a writer waits for a slot). Each
//! write of a stripe takes a fresh version number: the store key, the sealing counter,
//! and the rule that decides which of two racing writes of a stripe wins (the newer).
//! Errors of write-behind (a store that refuses or is lost) are kept and reported by the
//! next `fsync` or `flush` of the file, as local file systems report write-back errors.
//!
//! Reads take the newest bytes there are: a buffer not yet sent, a stripe being sent,
//! the cache, then the stores — the copies the metadata names first, then every store in
//! the stripe's hash order (a stripe that moved during a drain is found there). A copy
//! that fails verification is skipped (the replica serves) and counted; when no copy is
//! left the read fails with EIO and a log line names the file. Never wrong bytes.
//!
//! Lock order. The engine's mutexes are held briefly and never across an `await`. Where
//! one is taken while another is held, it is in this order: the write-behind's `dirty` →
//! its `inflight` → its `pending` (a buffer staged under `dirty` moves to `inflight` and
//! is counted in `pending`), and `dirty` → `ns` (a writer checks the stripe's stored
//! version before it opens a buffer). `ns`, `layouts`, `cache` and the stores' table are
//! otherwise taken alone; the FUSE layer takes `ns` alone too. Room ([`crate::room`])
//! and the counters are atomics, taken under any lock or none.

use crate::meta::{Freed, Ino, Namespace, Node, Stripe};
use crate::placement::{stripe_key, Layout, StoreId};
use crate::stores::{Store, StoreError, StoreState, Stores};
use crate::writebehind::{Piece, Put, Staged, WriteBehind};
use bytes::Bytes;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

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

use crate::readcache::{Fetched, ReadCache};

mod drain;

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
    /// Stripes written and not stored yet.
    wb: WriteBehind,
    cache: ReadCache,
    pub rt: tokio::runtime::Handle,
    pub n: Counters,
    /// When the mount started (status).
    pub started: Instant,
    /// How far the metadata copy has caught up (fsync waits on it).
    pub meta: crate::metasync::MetaSync,
}

/// The byte range of stripe `idx` a request at `offset..offset+len` covers, as
/// (stripe, offset in the stripe, length).
pub(crate) fn pieces(
    offset: u64,
    len: u64,
    stripe: u64,
) -> impl Iterator<Item = (u64, usize, usize)> {
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
        let wb = WriteBehind::new(
            settings.stripe,
            settings.replicas,
            settings.write_behind,
            settings.dirty,
        );
        let cache = ReadCache::new(settings.cache_bytes, settings.stripe);
        Arc::new(Engine {
            settings,
            ns: Mutex::new(ns),
            layouts: Mutex::new(vec![Layout::default()]),
            stores: Stores::default(),
            // Versions start from a random point: two mounts sharing a victim store
            // (never the same lease) still never collide on a key.
            next_version: AtomicU64::new(rand::random::<u64>() >> 8 | 1),
            wb,
            cache,
            rt,
            n: Counters::default(),
            started: Instant::now(),
            meta: crate::metasync::MetaSync::default(),
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
        (cap, stored + self.wb.promised())
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
        if let Some((_, d)) = self.wb.in_flight(ino, idx) {
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
        let idxs: Vec<u64> = all.iter().map(|p| p.0).collect();
        let (fits, mut promised) = self.wb.promise(ino, &idxs, || self.room_for_stripes());
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
        self.wb.unpromise(promised);
        result?;
        self.n.writes.fetch_add(1, Ordering::Relaxed);
        self.n
            .bytes_written
            .fetch_add(len as u64, Ordering::Relaxed);
        // Bound what is buffered: flush this file's partial stripes when over. A random
        // writer rewrites buffered stripes for free until then (its first write to a
        // stored stripe fetches it once).
        if self.wb.over_limit() {
            self.flush_buffers(ino).await;
        }
        Ok(len)
    }

    fn existing_len(&self, ino: Ino, idx: u64) -> u64 {
        if let Some((_, d)) = self.wb.in_flight(ino, idx) {
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
        let n = part.len();
        loop {
            // Outside the lock (fetching may take a store round trip): the content a new
            // buffer would start from, and which version of the stripe that is.
            let seen = self.content_version(ino, idx);
            let mut base = None;
            if !self.wb.is_buffered(ino, idx) {
                let existing = self.existing_len(ino, idx);
                if existing > 0 && !(o == 0 && n as u64 >= existing) {
                    base = Some(self.current_stripe(ino, idx).await?);
                }
            }
            let put = self.wb.put(
                Piece {
                    ino,
                    idx,
                    o,
                    data: part,
                },
                &mut base,
                promised,
                // Another writer may have sent the stripe meanwhile: then the base is
                // stale; start again from the newer content.
                || self.content_version(ino, idx) == seen,
                || self.fresh_version(),
            );
            match put {
                Put::Stale => continue,
                Put::Written(Some(staged)) => self.send(ino, staged).await,
                Put::Written(None) => {}
            }
            return Ok(());
        }
    }

    /// The version of the stripe's newest content outside the buffers (0: none).
    fn content_version(&self, ino: Ino, idx: u64) -> u64 {
        if let Some((v, _)) = self.wb.in_flight(ino, idx) {
            return v;
        }
        let ns = self.ns.lock();
        match ns.get(ino).map(|i| &i.node) {
            Ok(Node::File { stripes, .. }) => stripes.get(&idx).map_or(0, |s| s.version),
            _ => 0,
        }
    }

    /// Store a staged stripe (waits for a write-behind slot, not for the write).
    async fn send(self: &Arc<Self>, ino: Ino, staged: Staged) {
        let permit = self.wb.slot().await;
        let me = self.clone();
        self.rt.spawn(async move {
            let Staged { idx, version, data } = staged;
            let r = me.store_stripe(ino, idx, version, data).await;
            drop(permit);
            // Stored (the stores count it now) or failed: the buffer's room ends.
            me.wb.finished(ino, idx, version, r);
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
        for staged in self.wb.take_file(ino, || self.fresh_version()) {
            self.send(ino, staged).await;
        }
    }

    /// fsync/flush: every byte written to `ino` so far is on its stores; the first
    /// write-behind error since the last call, if any.
    pub async fn sync(self: &Arc<Self>, ino: Ino) -> Result<(), i32> {
        self.flush_buffers(ino).await;
        self.wb.wait(ino).await
    }

    /// Set the size of `ino` (truncate or extend with zeros).
    pub async fn truncate(self: &Arc<Self>, ino: Ino, size: u64) -> Result<(), i32> {
        // Buffers and writes in flight could land after the truncate: finish them first.
        // Their error, if any, stays for the file's next fsync or flush to report.
        if let Err(e) = self.sync(ino).await {
            self.wb.keep_error(ino, e);
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
        let buffered = (!unsent).then(|| self.wb.unstored(ino));
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
            && !self.wb.is_buffered(ino, idx)
            && self.wb.in_flight(ino, idx).is_none()
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
            if self.wb.copy_buffered(ino, idx, o, dst) {
                continue;
            }
            if let Some((_, d)) = self.wb.in_flight(ino, idx) {
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
        self.cache.has((ino, idx, version))
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
        let (slot, hit) = self.cache.entry(key);
        if hit {
            self.n.cache_hits.fetch_add(1, Ordering::Relaxed);
        }
        let r = slot
            .get_or_init(|| self.fetch_from_stores(idx, meta, layout, ino, name))
            .await
            .clone();
        if r.is_err() {
            // A failure is not cached: a later read tries again.
            self.cache.forget(key, &slot);
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

/// Copy `src[o..]` into `dst` (zeros past the end of `src`).
pub(crate) fn copy_part(src: &[u8], o: usize, dst: &mut [u8]) {
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
