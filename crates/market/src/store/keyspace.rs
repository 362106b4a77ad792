//! A store's keyspace: keys and values in one vector of slots indexed by a hash table of
//! slot numbers, the byte accounting against the lease size, expiry, and approximate-LRU
//! eviction (like Redis: sample a few slots at random, evict the least recently used).
//!
//! Why a slot vector rather than a map with a linked LRU list: random sampling needs a
//! uniformly random entry in O(1) (a slot number), and touching a key on every hit is then
//! one store of a counter instead of relinking list nodes. A removal moves the last slot
//! into the hole and fixes its table entry.

use granule_wire::market::EvictionMode;
use hashbrown::HashTable;
use std::hash::BuildHasher;

/// Bytes counted per entry on top of its key and value: the slot (key and value boxes,
/// hash, expiry, LRU clock), its table entry and control byte, and the allocator's
/// headers of the two boxes. Counting it keeps a store of many small values within its
/// lease in real memory, not only in payload.
pub const ENTRY_OVERHEAD: u64 = 96;

/// Slots sampled per eviction (Redis's `maxmemory-samples` default).
const SAMPLES: usize = 5;

/// Slots sampled per round of the active expiry cycle.
const EXPIRE_SAMPLES: usize = 20;

struct Slot {
    key: Box<[u8]>,
    val: Box<[u8]>,
    hash: u64,
    /// Milliseconds since the store's epoch at which the entry expires; 0: never.
    expire_ms: u64,
    /// The logical clock of the last access.
    lru: u64,
}

impl Slot {
    fn size(&self) -> u64 {
        entry_size(self.key.len(), self.val.len())
    }

    fn expired(&self, now_ms: u64) -> bool {
        self.expire_ms != 0 && self.expire_ms <= now_ms
    }
}

/// The bytes an entry with this key and value counts against the capacity.
pub fn entry_size(key: usize, val: usize) -> u64 {
    key as u64 + val as u64 + ENTRY_OVERHEAD
}

/// When `SET` may write.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SetCond {
    Always,
    /// Only when the key does not exist.
    Nx,
    /// Only when the key exists.
    Xx,
}

/// What `SET` does to the key's expiry.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SetTtl {
    /// Remove any expiry (plain `SET`).
    Clear,
    /// Keep the key's expiry (`KEEPTTL`).
    Keep,
    /// Expire at this many milliseconds since the store's epoch.
    At(u64),
}

/// How a write went.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SetOutcome {
    Written,
    /// `NX` or `XX` did not hold.
    NotWritten,
    /// A no-eviction store without room, or an entry larger than the whole store.
    NoRoom,
}

/// The keyspace of one store.
pub struct Keyspace {
    slots: Vec<Slot>,
    table: HashTable<usize>,
    hasher: foldhash::fast::RandomState,
    used: u64,
    capacity: u64,
    /// Bytes of the capacity the store's connections hold in buffers (read buffers,
    /// replies being written, queued transactions): the data gets what is left.
    buffers: u64,
    mode: EvictionMode,
    clock: u64,
    rng: u64,
    /// Keys with an expiry.
    volatile: u64,
    pub evicted_bytes: u64,
    pub evicted_keys: u64,
    pub expired_keys: u64,
}

impl Keyspace {
    pub fn new(capacity: u64, mode: EvictionMode) -> Keyspace {
        Keyspace {
            slots: Vec::new(),
            table: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            used: 0,
            capacity,
            buffers: 0,
            mode,
            clock: 0,
            // Any odd non-zero seed; the sampling only needs to be spread, not secret.
            rng: rand::random::<u64>() | 1,
            volatile: 0,
            evicted_bytes: 0,
            evicted_keys: 0,
            expired_keys: 0,
        }
    }

    /// A keyspace whose eviction sampling follows `seed`, so a test's run reproduces.
    #[cfg(test)]
    fn with_seed(capacity: u64, mode: EvictionMode, seed: u64) -> Keyspace {
        let mut ks = Keyspace::new(capacity, mode);
        ks.rng = seed | 1;
        ks
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The room the data has: the capacity less the connections' buffers.
    fn room(&self) -> u64 {
        self.capacity.saturating_sub(self.buffers)
    }

    /// Bytes the connections hold in buffers, as last told by [`Keyspace::set_buffers`].
    pub fn buffers(&self) -> u64 {
        self.buffers
    }

    /// Count `bytes` of connection buffers against the capacity. An LRU store evicts to
    /// keep data and buffers within it; a no-eviction store refuses writes until they fit.
    pub fn set_buffers(&mut self, bytes: u64) {
        self.buffers = bytes;
        if self.mode == EvictionMode::Lru && self.used > self.room() {
            self.evict_to(self.room(), None);
        }
    }

    pub fn mode(&self) -> EvictionMode {
        self.mode
    }

    pub fn volatile(&self) -> u64 {
        self.volatile
    }

    fn next_rand(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn find(&self, key: &[u8]) -> Option<usize> {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        self.table.find(hash, |&i| &*slots[i].key == key).copied()
    }

    /// The live slot of `key`, dropping it if it has expired.
    fn live(&mut self, key: &[u8], now_ms: u64) -> Option<usize> {
        let i = self.find(key)?;
        if self.slots[i].expired(now_ms) {
            self.remove(i);
            self.expired_keys += 1;
            return None;
        }
        Some(i)
    }

    /// Remove slot `i`, moving the last slot into its place. Returns the entry's size.
    fn remove(&mut self, i: usize) -> u64 {
        let hash = self.slots[i].hash;
        if let Ok(e) = self.table.find_entry(hash, |&j| j == i) {
            e.remove();
        }
        let last = self.slots.len() - 1;
        if i != last {
            let h = self.slots[last].hash;
            if let Some(p) = self.table.find_mut(h, |&j| j == last) {
                *p = i;
            }
        }
        let s = self.slots.swap_remove(i);
        if s.expire_ms != 0 {
            self.volatile -= 1;
        }
        let size = s.size();
        self.used -= size;
        size
    }

    fn set_expire(&mut self, i: usize, at: u64) {
        let s = &mut self.slots[i];
        match (s.expire_ms != 0, at != 0) {
            (false, true) => self.volatile += 1,
            (true, false) => self.volatile -= 1,
            _ => {}
        }
        s.expire_ms = at;
    }

    /// The value of `key`, marking it used.
    pub fn get(&mut self, key: &[u8], now_ms: u64) -> Option<&[u8]> {
        let i = self.live(key, now_ms)?;
        let t = self.tick();
        let s = &mut self.slots[i];
        s.lru = t;
        Some(&s.val)
    }

    /// Whether `key` exists (marks it used, as in Redis).
    pub fn exists(&mut self, key: &[u8], now_ms: u64) -> bool {
        match self.live(key, now_ms) {
            Some(i) => {
                let t = self.tick();
                self.slots[i].lru = t;
                true
            }
            None => false,
        }
    }

    /// Whether a write adding `extra` bytes fits a no-eviction store (always true for an
    /// LRU store, which evicts instead).
    pub fn fits(&self, extra: u64) -> bool {
        self.mode == EvictionMode::Lru || self.used.saturating_add(extra) <= self.room()
    }

    /// The bytes the store would grow by if `key` were set to a value of `val_len` bytes.
    pub fn growth(&self, key: &[u8], val_len: usize) -> u64 {
        let old = self.find(key).map_or(0, |i| self.slots[i].size());
        entry_size(key.len(), val_len).saturating_sub(old)
    }

    pub fn set(
        &mut self,
        key: &[u8],
        val: &[u8],
        cond: SetCond,
        ttl: SetTtl,
        now_ms: u64,
    ) -> SetOutcome {
        let new_size = entry_size(key.len(), val.len());
        let existing = self.live(key, now_ms);
        match (existing, cond) {
            (Some(_), SetCond::Nx) | (None, SetCond::Xx) => return SetOutcome::NotWritten,
            _ => {}
        }
        let room = self.room();
        if new_size > room {
            return SetOutcome::NoRoom;
        }
        let old_size = existing.map_or(0, |i| self.slots[i].size());
        if self.mode == EvictionMode::NoEviction && self.used - old_size + new_size > room {
            return SetOutcome::NoRoom;
        }
        let t = self.tick();
        let i = match existing {
            Some(i) => {
                let s = &mut self.slots[i];
                if s.val.len() == val.len() {
                    // Same length (the usual overwrite): reuse the allocation.
                    s.val.copy_from_slice(val);
                } else {
                    s.val = val.into();
                }
                s.lru = t;
                self.used = self.used - old_size + new_size;
                if ttl == SetTtl::Clear {
                    self.set_expire(i, 0);
                }
                i
            }
            None => {
                let hash = self.hasher.hash_one(key);
                let i = self.slots.len();
                self.slots.push(Slot {
                    key: key.into(),
                    val: val.into(),
                    hash,
                    expire_ms: 0,
                    lru: t,
                });
                let slots = &self.slots;
                self.table.insert_unique(hash, i, |&j| slots[j].hash);
                self.used += new_size;
                i
            }
        };
        if let SetTtl::At(at) = ttl {
            self.set_expire(i, at.max(1));
        }
        if self.used > room {
            self.evict_to(room, Some(i));
        }
        SetOutcome::Written
    }

    /// Delete `key`; whether it existed.
    pub fn del(&mut self, key: &[u8], now_ms: u64) -> bool {
        match self.live(key, now_ms) {
            Some(i) => {
                self.remove(i);
                true
            }
            None => false,
        }
    }

    /// Set `key`'s expiry to `at` (ms since the epoch; at or before `now_ms`: delete it).
    /// Whether the key existed.
    pub fn expire(&mut self, key: &[u8], at: u64, now_ms: u64) -> bool {
        let Some(i) = self.live(key, now_ms) else {
            return false;
        };
        if at <= now_ms {
            self.remove(i);
            self.expired_keys += 1;
        } else {
            self.set_expire(i, at);
        }
        true
    }

    /// Remove `key`'s expiry; whether it had one.
    pub fn persist(&mut self, key: &[u8], now_ms: u64) -> bool {
        match self.live(key, now_ms) {
            Some(i) if self.slots[i].expire_ms != 0 => {
                self.set_expire(i, 0);
                true
            }
            _ => false,
        }
    }

    /// `None`: no such key; `Some(None)`: no expiry; `Some(Some(ms))`: ms left.
    pub fn ttl_ms(&mut self, key: &[u8], now_ms: u64) -> Option<Option<u64>> {
        let i = self.live(key, now_ms)?;
        let at = self.slots[i].expire_ms;
        Some((at != 0).then(|| at - now_ms))
    }

    /// Drop everything (the capacity stays).
    pub fn clear(&mut self) {
        self.slots = Vec::new();
        self.table = HashTable::new();
        self.used = 0;
        self.volatile = 0;
    }

    /// Change the capacity. An LRU store evicts down to it and returns the bytes evicted;
    /// a no-eviction store keeps its data (refusing writes until it is under) and returns 0.
    pub fn set_capacity(&mut self, bytes: u64) -> u64 {
        self.capacity = bytes;
        match self.mode {
            EvictionMode::Lru => self.evict_to(self.room(), None),
            EvictionMode::NoEviction => 0,
        }
    }

    /// Evict (approximate LRU: the least recently used of a few random slots) until `used <= limit`, never the slot `protect`. Returns bytes evicted.
    fn evict_to(&mut self, limit: u64, mut protect: Option<usize>) -> u64 {
        let mut evicted = 0;
        while self.used > limit && !self.slots.is_empty() {
            let n = self.slots.len();
            if n == 1 && protect == Some(0) {
                break;
            }
            let mut best: Option<usize> = None;
            for _ in 0..SAMPLES {
                let j = (self.next_rand() % n as u64) as usize;
                if Some(j) == protect {
                    continue;
                }
                match best {
                    Some(b) if self.slots[b].lru <= self.slots[j].lru => {}
                    _ => best = Some(j),
                }
            }
            let Some(b) = best else { continue };
            let last = n - 1;
            evicted += self.remove(b);
            self.evicted_keys += 1;
            if protect == Some(last) {
                protect = Some(b);
            }
        }
        self.evicted_bytes += evicted;
        evicted
    }

    /// One round of active expiry: sample slots at random and drop the expired ones.
    /// Returns how many were sampled and how many dropped (Redis repeats while a quarter
    /// or more of a round had expired).
    pub fn expire_round(&mut self, now_ms: u64) -> (usize, usize) {
        if self.volatile == 0 {
            return (0, 0);
        }
        let mut dropped = 0;
        let rounds = EXPIRE_SAMPLES.min(self.slots.len());
        for _ in 0..rounds {
            if self.slots.is_empty() {
                break;
            }
            let j = (self.next_rand() % self.slots.len() as u64) as usize;
            if self.slots[j].expired(now_ms) {
                self.remove(j);
                self.expired_keys += 1;
                dropped += 1;
            }
        }
        (rounds, dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> Vec<u8> {
        format!("key:{i:06}").into_bytes()
    }

    /// Connection buffers count against the capacity: an LRU store evicts to keep data
    /// and buffers within it, a no-eviction store refuses writes that would not fit.
    #[test]
    fn buffers_take_room_from_the_data() {
        let per = entry_size(2, 1000);
        let mut ks = Keyspace::with_seed(per * 10, EvictionMode::Lru, 7);
        for i in 0..10 {
            ks.set(
                format!("k{i}").as_bytes(),
                &[0; 1000],
                SetCond::Always,
                SetTtl::Clear,
                0,
            );
        }
        assert_eq!(ks.len(), 10);
        ks.set_buffers(per * 3);
        assert!(ks.used() + ks.buffers() <= ks.capacity());
        assert_eq!(ks.len(), 7);
        let mut ks = Keyspace::new(per * 10, EvictionMode::NoEviction);
        ks.set_buffers(per * 9);
        let w =
            |ks: &mut Keyspace, k: &[u8]| ks.set(k, &[0; 1000], SetCond::Always, SetTtl::Clear, 0);
        assert_eq!(w(&mut ks, b"k1"), SetOutcome::Written);
        assert_eq!(w(&mut ks, b"k2"), SetOutcome::NoRoom);
        assert!(!ks.fits(per));
        ks.set_buffers(0);
        assert_eq!(w(&mut ks, b"k2"), SetOutcome::Written);
    }

    #[test]
    fn eviction_keeps_used_within_capacity() {
        let cap = 64 << 10;
        let mut ks = Keyspace::new(cap, EvictionMode::Lru);
        for i in 0..5000 {
            let val = vec![b'x'; 100 + (i % 7) * 50];
            assert_eq!(
                ks.set(&key(i), &val, SetCond::Always, SetTtl::Clear, 1),
                SetOutcome::Written
            );
            assert!(ks.used() <= cap, "used {} > cap {cap}", ks.used());
        }
        assert!(ks.evicted_keys > 0);
        // The accounting matches what is stored.
        let sum: u64 = ks.slots.iter().map(|s| s.size()).sum();
        assert_eq!(sum, ks.used());
        // Every remaining key is still found through the table.
        for i in 0..ks.slots.len() {
            let k = ks.slots[i].key.clone();
            assert_eq!(ks.find(&k), Some(i));
        }
    }

    #[test]
    fn lru_keeps_recently_used_keys() {
        // Sampled LRU is approximate: a hot key goes when all five samples land on keys
        // touched more recently than the oldest of them (here about 1 in 13 000 evictions).
        // So the claim is statistical, checked over fixed seeds so a failure reproduces:
        // hot keys are almost never evicted and almost every cold key is.
        let val = [b'v'; 200];
        let per = entry_size(key(0).len(), val.len());
        let cap = per * 1000;
        let (mut hot_misses, mut hot_reads) = (0u64, 0u64);
        for seed in 1..=20u64 {
            let mut ks = Keyspace::with_seed(cap, EvictionMode::Lru, seed * 0x9E37_79B9);
            for i in 0..1000 {
                ks.set(&key(i), &val, SetCond::Always, SetTtl::Clear, 1);
            }
            assert_eq!(ks.len(), 1000);
            // Keys 0..100 are hot: read them between every batch of new keys.
            for round in 0..20 {
                for h in 0..100 {
                    hot_reads += 1;
                    if ks.get(&key(h), 1).is_none() {
                        hot_misses += 1;
                        ks.set(&key(h), &val, SetCond::Always, SetTtl::Clear, 1);
                    }
                }
                for i in 0..50 {
                    ks.set(
                        &key(1000 + round * 50 + i),
                        &val,
                        SetCond::Always,
                        SetTtl::Clear,
                        1,
                    );
                }
            }
            assert!(ks.evicted_keys >= 1000 - 100, "seed {seed}");
            assert!(ks.used() <= cap, "seed {seed}");
            let cold_left = (100..1000).filter(|&i| ks.find(&key(i)).is_some()).count();
            assert!(
                cold_left < 100,
                "seed {seed}: {cold_left} cold keys survived"
            );
        }
        assert!(
            hot_misses * 200 <= hot_reads,
            "{hot_misses} of {hot_reads} hot reads missed (over 0.5 %)"
        );
    }

    #[test]
    fn no_eviction_refuses_and_resize_keeps_data() {
        let val = [b'v'; 100];
        let per = entry_size(key(0).len(), val.len());
        let mut ks = Keyspace::new(per * 10, EvictionMode::NoEviction);
        for i in 0..10 {
            assert_eq!(
                ks.set(&key(i), &val, SetCond::Always, SetTtl::Clear, 1),
                SetOutcome::Written
            );
        }
        assert_eq!(
            ks.set(&key(10), &val, SetCond::Always, SetTtl::Clear, 1),
            SetOutcome::NoRoom
        );
        // Overwriting in place with a value of the same size still fits.
        assert_eq!(
            ks.set(&key(3), &val, SetCond::Always, SetTtl::Clear, 1),
            SetOutcome::Written
        );
        assert_eq!(ks.set_capacity(per * 5), 0);
        assert_eq!(ks.len(), 10);
        assert!(ks.del(&key(0), 1));
        assert_eq!(
            ks.set(&key(0), &val, SetCond::Always, SetTtl::Clear, 1),
            SetOutcome::NoRoom
        );
    }

    #[test]
    fn expiry_and_conditions() {
        let mut ks = Keyspace::new(1 << 20, EvictionMode::Lru);
        assert_eq!(
            ks.set(b"a", b"1", SetCond::Xx, SetTtl::Clear, 0),
            SetOutcome::NotWritten
        );
        assert_eq!(
            ks.set(b"a", b"1", SetCond::Nx, SetTtl::At(100), 0),
            SetOutcome::Written
        );
        assert_eq!(ks.volatile(), 1);
        assert_eq!(
            ks.set(b"a", b"2", SetCond::Nx, SetTtl::Clear, 50),
            SetOutcome::NotWritten
        );
        assert_eq!(ks.ttl_ms(b"a", 40), Some(Some(60)));
        assert_eq!(ks.get(b"a", 99), Some(&b"1"[..]));
        assert_eq!(ks.get(b"a", 100), None);
        assert_eq!(ks.expired_keys, 1);
        assert_eq!(ks.used(), 0);
        ks.set(b"b", b"1", SetCond::Always, SetTtl::At(10), 0);
        ks.set(b"b", b"2", SetCond::Always, SetTtl::Keep, 0);
        assert_eq!(ks.ttl_ms(b"b", 0), Some(Some(10)));
        ks.set(b"b", b"3", SetCond::Always, SetTtl::Clear, 0);
        assert_eq!(ks.ttl_ms(b"b", 0), Some(None));
        assert_eq!(ks.volatile(), 0);
        for i in 0..100 {
            ks.set(&key(i), b"x", SetCond::Always, SetTtl::At(5), 0);
        }
        let mut rounds = 0;
        while ks.len() > 1 && rounds < 1000 {
            ks.expire_round(6);
            rounds += 1;
        }
        assert_eq!(ks.len(), 1, "the active cycle drops expired keys");
    }
}
