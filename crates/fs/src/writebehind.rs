//! Write-behind: the stripes a mount has acknowledged and not stored yet.
//!
//! A written stripe goes through two stages, each kept here:
//! - **buffered**: its bytes from byte 0 of the stripe in a buffer (`dirty`), which later
//!   writes change in place. A buffer holds room ([`crate::room`]) promised by the write
//!   that opened it.
//! - **in flight**: *staged* with a fresh version (the buffer leaves `dirty` and its
//!   bytes become the stripe's newest content in `inflight`), while the engine stores it.
//!   At most `fs.write_behind` stripes are stored at once ([`WriteBehind::slot`]).
//!
//! Per file it counts the stripes in flight and keeps the first error of storing one,
//! which the next `fsync` or `flush` reports ([`WriteBehind::wait`]).
//!
//! The engine does the I/O: it fetches the content a new buffer starts from, and stores
//! staged stripes, telling [`WriteBehind::finished`] how that went. Staging happens
//! under the buffers' lock, so a reader or writer never finds a stripe in neither place.
//!
//! Lock order: `dirty` → `inflight` → `pending`; callers may take the engine's `ns`
//! inside `dirty` (in the `current` check of [`WriteBehind::put`]), never the reverse.

use crate::meta::Ino;
use crate::room::Room;
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// A stripe in flight: its version and bytes.
pub type InFlight = (u64, Bytes);

/// A file's buffered stripes: stripe index → its content from byte 0 (its length is the
/// stripe's valid length).
#[derive(Default)]
struct Dirty {
    stripes: HashMap<u64, Vec<u8>>,
}

/// A file's stripes in flight, and the first error of storing one since the last wait.
#[derive(Default)]
struct Pending {
    inflight: u64,
    error: Option<i32>,
}

/// A stripe leaving the buffers, for the engine to store.
#[derive(Debug)]
pub struct Staged {
    pub idx: u64,
    pub version: u64,
    pub data: Bytes,
}

/// A write's bytes within one stripe: `data` at byte `o` of stripe `idx` of file `ino`.
#[derive(Clone, Copy, Debug)]
pub struct Piece<'a> {
    pub ino: Ino,
    pub idx: u64,
    pub o: usize,
    pub data: &'a [u8],
}

/// What [`WriteBehind::put`] did.
#[derive(Debug)]
pub enum Put {
    /// Written into the stripe's buffer; a buffer written to the stripe's end was
    /// staged and must be stored.
    Written(Option<Staged>),
    /// The stripe had no buffer and the content the write meant to start one from is no
    /// longer the stripe's newest: fetch it again and retry.
    Stale,
}

/// The write-behind of one mount.
pub struct WriteBehind {
    stripe: u64,
    /// Room a buffer holds: a stripe per copy.
    stripe_room: u64,
    /// Buffered bytes past which a writer sends its file's buffers.
    limit: u64,
    dirty: Mutex<HashMap<Ino, Dirty>>,
    dirty_bytes: AtomicU64,
    room: Room,
    inflight: Mutex<HashMap<(Ino, u64), InFlight>>,
    pending: Mutex<HashMap<Ino, Pending>>,
    pending_changed: Notify,
    slots: Arc<Semaphore>,
}

impl WriteBehind {
    /// `stripe` bytes per stripe, `replicas` copies of each, `write_behind` stripes
    /// stored at once, `limit` bytes buffered before a writer sends its file's buffers.
    pub fn new(stripe: u64, replicas: usize, write_behind: u32, limit: u64) -> WriteBehind {
        WriteBehind {
            stripe,
            stripe_room: stripe * replicas.max(1) as u64,
            limit,
            dirty: Mutex::new(HashMap::new()),
            dirty_bytes: AtomicU64::new(0),
            room: Room::default(),
            inflight: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            pending_changed: Notify::new(),
            slots: Arc::new(Semaphore::new(write_behind.max(1) as usize)),
        }
    }

    /// Bytes of room promised to buffered and in-flight stripes.
    pub fn promised(&self) -> u64 {
        self.room.promised()
    }

    /// Promise room for the buffers a write of stripes `idxs` (in order) of `ino` opens,
    /// with `free()` bytes of whole stripes left on the stores (asked at most once, and
    /// only if the write opens a buffer). Returns how many of the stripes the write may
    /// touch (the rest do not fit) and the promises made; what a write does not use goes
    /// back through [`WriteBehind::unpromise`].
    pub fn promise(&self, ino: Ino, idxs: &[u64], free: impl FnOnce() -> u64) -> (usize, u64) {
        let mut free = Some(free);
        let mut known = None;
        let mut promised = 0;
        for (k, &idx) in idxs.iter().enumerate() {
            if self.is_buffered(ino, idx) {
                continue;
            }
            let f = *known.get_or_insert_with(|| free.take().map_or(0, |f| f()));
            if !self.room.try_take(self.stripe_room, f) {
                return (k, promised);
            }
            promised += 1;
        }
        (idxs.len(), promised)
    }

    /// Give back `n` promises no buffer took.
    pub fn unpromise(&self, n: u64) {
        self.room.give_back(n * self.stripe_room);
    }

    /// Write a piece into its stripe's buffer. Without a buffer for the stripe one
    /// is opened from `base` (the stripe's newest content, or `None` when the write
    /// replaces all of it), if `current()` says that content is still the newest; it
    /// takes one of the writer's `promised` (or forces one: another thread staged the
    /// stripe between the writer's promise and now).
    pub fn put(
        &self,
        piece: Piece<'_>,
        base: &mut Option<Vec<u8>>,
        promised: &mut u64,
        current: impl FnOnce() -> bool,
        version: impl FnOnce() -> u64,
    ) -> Put {
        let Piece {
            ino,
            idx,
            o,
            data: part,
        } = piece;
        let n = part.len();
        let mut dirty = self.dirty.lock();
        let d = dirty.entry(ino).or_default();
        let (buf, before) = match d.stripes.entry(idx) {
            std::collections::hash_map::Entry::Occupied(e) => {
                let b = e.into_mut();
                let len = b.len();
                (b, len)
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                if !current() {
                    return Put::Stale;
                }
                if *promised > 0 {
                    *promised -= 1;
                } else {
                    self.room.force_take(self.stripe_room);
                }
                // Bytes a new buffer starts with count as buffered too.
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
        if (o + n) as u64 == self.stripe {
            let buf = d.stripes.remove(&idx).unwrap_or_default();
            Put::Written(Some(self.stage(ino, idx, buf, version())))
        } else {
            Put::Written(None)
        }
    }

    /// A buffer leaves the buffers (called under the buffers' lock).
    fn stage(&self, ino: Ino, idx: u64, buf: Vec<u8>, version: u64) -> Staged {
        self.dirty_bytes
            .fetch_sub(buf.len() as u64, Ordering::Relaxed);
        let data = Bytes::from(buf);
        self.inflight
            .lock()
            .insert((ino, idx), (version, data.clone()));
        self.pending.lock().entry(ino).or_default().inflight += 1;
        Staged { idx, version, data }
    }

    /// Stage every buffered stripe of `ino`, each with a fresh `version()`.
    pub fn take_file(&self, ino: Ino, mut version: impl FnMut() -> u64) -> Vec<Staged> {
        let mut dirty = self.dirty.lock();
        match dirty.remove(&ino) {
            Some(d) => d
                .stripes
                .into_iter()
                .map(|(idx, buf)| self.stage(ino, idx, buf, version()))
                .collect(),
            None => Vec::new(),
        }
    }

    /// A place among the stripes stored at once (waits for one). `None` only if the
    /// semaphore was closed.
    pub async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().acquire_owned().await.ok()
    }

    /// Storing a staged stripe ended: it leaves the stripes in flight (unless a newer
    /// version replaced it there), its room ends, and a failure is kept for the file's
    /// next wait.
    pub fn finished(&self, ino: Ino, idx: u64, version: u64, result: Result<(), i32>) {
        self.room.give_back(self.stripe_room);
        {
            let mut inf = self.inflight.lock();
            if inf.get(&(ino, idx)).is_some_and(|(v, _)| *v == version) {
                inf.remove(&(ino, idx));
            }
        }
        {
            let mut p = self.pending.lock();
            let e = p.entry(ino).or_default();
            e.inflight = e.inflight.saturating_sub(1);
            if let Err(errno) = result {
                e.error.get_or_insert(errno);
            }
        }
        self.pending_changed.notify_waiters();
    }

    /// Wait until no stripe of `ino` is in flight; the first error of storing one since
    /// the last wait, if any (reported once).
    pub async fn wait(&self, ino: Ino) -> Result<(), i32> {
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

    /// Keep `errno` for the file's next wait (unless an earlier error is kept).
    pub fn keep_error(&self, ino: Ino, errno: i32) {
        self.pending
            .lock()
            .entry(ino)
            .or_default()
            .error
            .get_or_insert(errno);
    }

    /// Whether stripe `idx` of `ino` has a buffer.
    pub fn is_buffered(&self, ino: Ino, idx: u64) -> bool {
        self.dirty
            .lock()
            .get(&ino)
            .is_some_and(|d| d.stripes.contains_key(&idx))
    }

    /// The stripe's version and bytes being stored, if it is in flight.
    pub fn in_flight(&self, ino: Ino, idx: u64) -> Option<InFlight> {
        self.inflight.lock().get(&(ino, idx)).cloned()
    }

    /// Copy bytes `o..o + dst.len()` of the stripe's buffer into `dst` (zeros past its
    /// end); false when it has no buffer.
    pub fn copy_buffered(&self, ino: Ino, idx: u64, o: usize, dst: &mut [u8]) -> bool {
        let dirty = self.dirty.lock();
        match dirty.get(&ino).and_then(|d| d.stripes.get(&idx)) {
            Some(b) => {
                crate::engine::copy_part(b, o, dst);
                true
            }
            None => false,
        }
    }

    /// Stripes of `ino` buffered or in flight (looked at in that order: a stripe moves
    /// on in that order, so one found in neither was stored before the caller looks at
    /// the stripe table).
    pub fn unstored(&self, ino: Ino) -> BTreeSet<u64> {
        let mut b: BTreeSet<u64> = self
            .dirty
            .lock()
            .get(&ino)
            .map(|d| d.stripes.keys().copied().collect())
            .unwrap_or_default();
        let inflight = self.inflight.lock();
        b.extend(inflight.keys().filter(|k| k.0 == ino).map(|k| k.1));
        b
    }

    /// Whether more than the limit is buffered.
    pub fn over_limit(&self) -> bool {
        self.dirty_bytes.load(Ordering::Relaxed) > self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    const STRIPE: u64 = 16;

    /// `data` at byte `o` of stripe `idx` of file `ino`.
    fn at(ino: Ino, idx: u64, o: usize, data: &[u8]) -> Piece<'_> {
        Piece { ino, idx, o, data }
    }

    /// A fake store: the newest version of each stripe it took, refusing when told.
    #[derive(Default)]
    struct FakeStore {
        stripes: Mutex<HashMap<(Ino, u64), (u64, Bytes)>>,
        refuse: std::sync::atomic::AtomicBool,
    }

    impl FakeStore {
        fn store(&self, ino: Ino, s: &Staged) -> Result<(), i32> {
            if self.refuse.load(Ordering::Relaxed) {
                return Err(libc::ENOSPC);
            }
            let mut m = self.stripes.lock();
            let e = m.entry((ino, s.idx)).or_insert((0, Bytes::new()));
            if s.version > e.0 {
                *e = (s.version, s.data.clone());
            }
            Ok(())
        }
        fn get(&self, ino: Ino, idx: u64) -> Option<Bytes> {
            self.stripes.lock().get(&(ino, idx)).map(|e| e.1.clone())
        }
    }

    struct Rig {
        wb: WriteBehind,
        store: FakeStore,
        versions: AtomicU64,
        free: u64,
    }

    impl Rig {
        fn new(free: u64) -> Rig {
            Rig {
                wb: WriteBehind::new(STRIPE, 1, 4, 1 << 20),
                store: FakeStore::default(),
                versions: AtomicU64::new(1),
                free,
            }
        }

        /// A write as the engine does it (pieces within one stripe each), storing what
        /// is staged at once; returns the bytes written.
        fn write(&self, ino: Ino, offset: u64, data: &[u8]) -> Result<usize, i32> {
            let pieces: Vec<(u64, usize, usize)> =
                crate::engine::pieces(offset, data.len() as u64, STRIPE).collect();
            let idxs: Vec<u64> = pieces.iter().map(|p| p.0).collect();
            let (fits, mut promised) = self.wb.promise(ino, &idxs, || self.free);
            if fits == 0 {
                return Err(libc::ENOSPC);
            }
            let mut done = 0;
            for &(idx, o, n) in &pieces[..fits] {
                // The newest content outside the buffers, for a buffer that starts here.
                let mut base = self
                    .wb
                    .in_flight(ino, idx)
                    .map(|(_, d)| d)
                    .or_else(|| self.store.get(ino, idx))
                    .map(|b| b.to_vec());
                let put = self.wb.put(
                    at(ino, idx, o, &data[done..done + n]),
                    &mut base,
                    &mut promised,
                    || true,
                    || self.versions.fetch_add(1, Ordering::Relaxed),
                );
                done += n;
                match put {
                    Put::Written(Some(s)) => self.send(ino, s),
                    Put::Written(None) => {}
                    Put::Stale => unreachable!("nothing else writes"),
                }
            }
            self.wb.unpromise(promised);
            Ok(done)
        }

        fn send(&self, ino: Ino, s: Staged) {
            let r = self.store.store(ino, &s);
            self.wb.finished(ino, s.idx, s.version, r);
        }

        fn sync(&self, ino: Ino) -> Result<(), i32> {
            for s in self
                .wb
                .take_file(ino, || self.versions.fetch_add(1, Ordering::Relaxed))
            {
                self.send(ino, s);
            }
            futures::executor::block_on(self.wb.wait(ino))
        }

        /// What a reader sees of stripe `idx`: buffer, in flight, store.
        fn read(&self, ino: Ino, idx: u64) -> Vec<u8> {
            let mut out = vec![0u8; STRIPE as usize];
            if self.wb.copy_buffered(ino, idx, 0, &mut out) {
                return out;
            }
            let src = self
                .wb
                .in_flight(ino, idx)
                .map(|(_, d)| d)
                .or_else(|| self.store.get(ino, idx))
                .unwrap_or_default();
            out[..src.len()].copy_from_slice(&src);
            out
        }
    }

    #[test]
    fn a_partial_stripe_waits_in_its_buffer_and_a_full_one_is_stored_at_once() {
        let r = Rig::new(1 << 20);
        assert_eq!(r.write(1, 0, &[7u8; 20]), Ok(20));
        // Stripe 0 was filled: stored. Stripe 1 has 4 bytes buffered.
        assert_eq!(r.store.get(1, 0).as_deref(), Some(&[7u8; 16][..]));
        assert!(r.wb.is_buffered(1, 1));
        assert_eq!(r.store.get(1, 1), None);
        assert_eq!(r.wb.unstored(1), BTreeSet::from([1]));
        assert_eq!(r.wb.promised(), STRIPE, "the buffer holds a stripe of room");
        assert_eq!(r.sync(1), Ok(()));
        assert_eq!(r.store.get(1, 1).as_deref(), Some(&[7u8; 4][..]));
        assert_eq!(r.wb.promised(), 0, "stored: the room is the store's now");
        assert!(r.wb.unstored(1).is_empty());
    }

    #[test]
    fn a_rewrite_starts_from_the_newest_content() {
        let r = Rig::new(1 << 20);
        r.write(1, 0, &[1u8; 16]).unwrap();
        r.write(1, 4, &[2u8; 4]).unwrap();
        let mut want = [1u8; 16];
        want[4..8].copy_from_slice(&[2; 4]);
        assert_eq!(r.read(1, 0), want, "readers see the buffer");
        r.sync(1).unwrap();
        assert_eq!(r.store.get(1, 0).as_deref(), Some(&want[..]));
    }

    #[test]
    fn no_room_fails_the_write_and_part_room_cuts_it_short() {
        // Room for two stripes (this rig's free room stays fixed: only promises count).
        let r = Rig::new(2 * STRIPE);
        assert_eq!(r.write(1, 0, &[1u8; 8]), Ok(8), "opens file 1's stripe 0");
        assert_eq!(r.write(2, 0, &[2u8; 4]), Ok(4), "opens file 2's stripe 0");
        // Stripe 0 is buffered (no new room), stripe 1 does not fit: cut short.
        assert_eq!(r.write(1, 8, &[1u8; 40]), Ok(8));
        assert_eq!(
            r.wb.promised(),
            STRIPE,
            "file 1's stripe 0 stored, file 2's buffered"
        );
        assert_eq!(r.write(3, 0, &[3u8; 4]), Ok(4));
        assert_eq!(r.write(4, 0, &[4u8; 4]), Err(libc::ENOSPC));
        assert_eq!(r.sync(2), Ok(()));
        assert_eq!(r.sync(3), Ok(()));
        assert_eq!(r.wb.promised(), 0);
        assert_eq!(r.write(4, 0, &[4u8; 4]), Ok(4), "room came back");
    }

    #[test]
    fn a_store_error_is_reported_once_by_the_next_wait() {
        let r = Rig::new(1 << 20);
        r.store.refuse.store(true, Ordering::Relaxed);
        r.write(1, 0, &[1u8; 16]).unwrap();
        r.write(2, 0, &[1u8; 16]).unwrap();
        r.store.refuse.store(false, Ordering::Relaxed);
        assert_eq!(r.sync(1), Err(libc::ENOSPC));
        assert_eq!(r.sync(1), Ok(()), "reported once");
        // The other file keeps its own error.
        assert_eq!(r.sync(2), Err(libc::ENOSPC));
        assert_eq!(r.wb.promised(), 0, "a failed stripe's room ends too");
        r.wb.keep_error(3, libc::EIO);
        assert_eq!(r.sync(3), Err(libc::EIO));
    }

    #[test]
    fn a_stale_base_is_refused_and_a_buffer_is_written_whatever_the_check_says() {
        let wb = WriteBehind::new(STRIPE, 1, 4, 1 << 20);
        let mut base = Some(vec![9u8; 16]);
        let mut promised = 1;
        let put = wb.put(at(1, 0, 0, &[1]), &mut base, &mut promised, || false, || 1);
        assert!(matches!(put, Put::Stale));
        assert_eq!((base.is_some(), promised), (true, 1), "nothing taken");
        let put = wb.put(at(1, 0, 0, &[1]), &mut base, &mut promised, || true, || 1);
        assert!(matches!(put, Put::Written(None)));
        assert_eq!(promised, 0);
        // With a buffer the check is not asked (the buffer is the newest content), and
        // a writer with no promise left forces one only for a new buffer.
        let put = wb.put(
            at(1, 0, 1, &[2]),
            &mut None,
            &mut 0,
            || panic!("asked"),
            || 1,
        );
        assert!(matches!(put, Put::Written(None)));
        assert_eq!(wb.promised(), 0, "promises are the rig's to count here");
        let put = wb.put(at(1, 1, 0, &[3]), &mut None, &mut 0, || true, || 2);
        assert!(matches!(put, Put::Written(None)));
        assert_eq!(wb.promised(), STRIPE, "forced for the new buffer");
    }

    #[test]
    fn an_older_store_finishing_late_leaves_the_newer_in_flight() {
        let wb = WriteBehind::new(STRIPE, 1, 4, 1 << 20);
        let full = [5u8; 16];
        let Put::Written(Some(old)) = wb.put(at(1, 0, 0, &full), &mut None, &mut 0, || true, || 1)
        else {
            panic!("a full stripe is staged")
        };
        let Put::Written(Some(new)) = wb.put(at(1, 0, 0, &full), &mut None, &mut 0, || true, || 2)
        else {
            panic!("a full stripe is staged")
        };
        wb.finished(1, old.idx, old.version, Ok(()));
        assert_eq!(wb.in_flight(1, 0).map(|f| f.0), Some(2));
        wb.finished(1, new.idx, new.version, Ok(()));
        assert_eq!(wb.in_flight(1, 0), None);
        assert_eq!(wb.promised(), 0);
    }

    /// Seeded random writes over a few stripes of two files, synced now and then, read
    /// back against a plain model of the files after every step.
    #[test]
    fn random_writes_read_back_as_a_model_says() {
        use rand::{Rng, SeedableRng};
        for seed in 0..20u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let r = Rig::new(1 << 20);
            let mut model: HashMap<Ino, Vec<u8>> = HashMap::new();
            for step in 0..300 {
                let ino = rng.random_range(1..=2);
                let off = rng.random_range(0..4 * STRIPE);
                let len = rng.random_range(1..2 * STRIPE as usize);
                let byte = rng.random::<u8>();
                let data = vec![byte; len];
                assert_eq!(r.write(ino, off, &data), Ok(len));
                let m = model.entry(ino).or_default();
                let end = off as usize + len;
                if m.len() < end {
                    m.resize(end, 0);
                }
                m[off as usize..end].copy_from_slice(&data);
                if rng.random_bool(0.1) {
                    assert_eq!(r.sync(ino), Ok(()));
                }
                for (&ino, m) in &model {
                    for idx in 0..(m.len() as u64).div_ceil(STRIPE) {
                        let lo = (idx * STRIPE) as usize;
                        let hi = (lo + STRIPE as usize).min(m.len());
                        let got = r.read(ino, idx);
                        assert_eq!(
                            &got[..hi - lo],
                            &m[lo..hi],
                            "seed {seed} step {step}: file {ino} stripe {idx}"
                        );
                    }
                }
            }
            for ino in [1, 2] {
                assert_eq!(r.sync(ino), Ok(()));
            }
            assert_eq!(r.wb.promised(), 0, "seed {seed}: room left promised");
        }
    }
}
