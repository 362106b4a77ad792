//! [`ShardedMap`]: an ordered map split into key ranges, each a memory proclet, and its
//! *staged writes*: a batch job's output parked in the shards that will hold it,
//! invisible to reads until the job commits it once per key (see
//! [`ShardedMap::stage`]).

use crate::batch::Pusher;
use crate::sharder::{AutoSharder, Bounds, Hint, Shard};
use crate::ShardError;
use granule_runtime::{Footprint, Wire};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;

/// One range of a [`ShardedMap`]: a `BTreeMap`, its running byte count, and the staged
/// writes of batch jobs not committed yet (by job, then key).
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct MapShard<K: MapKey, V: MapValue> {
    entries: BTreeMap<K, V>,
    /// Bytes of the entries and of the staged writes (what the shard's size bounds see).
    bytes: u64,
    staged: BTreeMap<u64, BTreeMap<K, Parts<V>>>,
    /// Jobs this shard committed or discarded lately, newest last: a staged write of one
    /// of them arriving afterwards (from a worker declared lost that was still running)
    /// is dropped instead of lingering.
    closed: VecDeque<u64>,
}

/// A key's staged values in one job, by the work call that wrote them: (the first input
/// index the call covered, the call's id). Ordered by input index, so a commit merges
/// them in input order.
type Parts<V> = BTreeMap<(u64, u64), V>;

/// How many closed jobs a shard remembers.
const CLOSED_KEPT: usize = 64;

impl<K: MapKey, V: MapValue> Default for MapShard<K, V> {
    fn default() -> Self {
        MapShard {
            entries: BTreeMap::new(),
            bytes: 0,
            staged: BTreeMap::new(),
            closed: VecDeque::new(),
        }
    }
}

/// One staged write: (job, key, (first input index of the call, call id), value).
pub type StagedPair<K, V> = (u64, K, (u64, u64), V);

/// Bytes one staged value costs: its entry's bytes and the call's tag.
fn staged_bytes<K: Footprint, V: Footprint>(k: &K, v: &V) -> u64 {
    entry_bytes(k, v) + 16
}

/// What a map key must be.
pub trait MapKey: Ord + Clone + Wire + Sync + Footprint + fmt::Debug {}
impl<T: Ord + Clone + Wire + Sync + Footprint + fmt::Debug> MapKey for T {}
/// What a map value must be.
pub trait MapValue: Wire + Sync + Footprint {}
impl<T: Wire + Sync + Footprint> MapValue for T {}

/// Bytes one entry costs: its key and value plus a B-tree slot's share.
fn entry_bytes<K: Footprint, V: Footprint>(k: &K, v: &V) -> u64 {
    k.footprint() + v.footprint() + 16
}

impl<K: MapKey, V: MapValue> MapShard<K, V> {
    fn insert(&mut self, k: K, v: V) -> Option<V> {
        self.bytes += entry_bytes(&k, &v);
        let old = self.entries.insert(k.clone(), v);
        if let Some(o) = &old {
            self.bytes -= entry_bytes(&k, o);
        }
        old
    }

    fn remove(&mut self, k: &K) -> Option<V> {
        let old = self.entries.remove(k);
        if let Some(o) = &old {
            self.bytes -= entry_bytes(k, o);
        }
        old
    }

    /// Park `value` for `key` under `job`, tagged by the call that computed it; the same
    /// tag again replaces it (a batch sent twice changes nothing).
    fn stage(&mut self, (job, key, tag, value): StagedPair<K, V>) {
        if self.closed.contains(&job) {
            return;
        }
        let add = staged_bytes(&key, &value);
        let value_bytes = value.footprint();
        let parts = self.staged.entry(job).or_default().entry(key).or_default();
        if let Some(old) = parts.insert(tag, value) {
            // Same key and tag: the replaced part cost what this one does but for its value.
            self.bytes -= add - value_bytes + old.footprint();
        }
        self.bytes += add;
    }

    /// Fold `job`'s staged values of the accepted calls (sorted ids) into the entries:
    /// per key, the parts in input order with `merge`, then `merge(&mut entry, folded)`
    /// (or an insert when the key is absent). Other calls' parts are dropped. Returns the
    /// keys written; a second commit of the same job finds nothing and writes none.
    fn commit<M: Fn(&mut V, V)>(&mut self, job: u64, accepted: &[u64], merge: &M) -> u64 {
        self.close(job);
        let Some(staged) = self.staged.remove(&job) else {
            return 0;
        };
        let mut written = 0;
        for (k, parts) in staged {
            let mut folded: Option<V> = None;
            for ((_, call), v) in parts {
                self.bytes -= staged_bytes(&k, &v);
                if accepted.binary_search(&call).is_err() {
                    continue;
                }
                match &mut folded {
                    None => folded = Some(v),
                    Some(acc) => merge(acc, v),
                }
            }
            let Some(v) = folded else { continue };
            written += 1;
            match self.remove(&k) {
                Some(mut old) => {
                    merge(&mut old, v);
                    self.insert(k, old);
                }
                None => {
                    self.insert(k, v);
                }
            }
        }
        written
    }

    fn close(&mut self, job: u64) {
        if !self.closed.contains(&job) {
            if self.closed.len() >= CLOSED_KEPT {
                self.closed.pop_front();
            }
            self.closed.push_back(job);
        }
    }

    /// The smallest key `job` has staged here.
    fn first_staged(&self, job: u64) -> Option<K> {
        self.staged.get(&job)?.keys().next().cloned()
    }

    /// Entries in `[from, to)` (either end open when `None`), at most `limit`.
    fn scan(&self, from: &Option<K>, to: &Option<K>, limit: usize) -> Vec<(K, V)>
    where
        V: Clone,
    {
        use std::ops::Bound::*;
        let lo = from.as_ref().map_or(Unbounded, Included);
        let hi = to.as_ref().map_or(Unbounded, Excluded);
        self.entries
            .range((lo, hi))
            .take(limit)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

impl<K: MapKey, V: MapValue> Shard for MapShard<K, V> {
    type Key = K;

    fn split(&mut self) -> Option<(K, Self)> {
        // The middle key of the entries, or of the largest job's staged keys when they
        // are more (a shard filled by a job not committed yet must split too).
        let staged = self.staged.values().max_by_key(|m| m.len());
        let staged_len = staged.map_or(0, |m| m.len());
        let mid = if self.entries.len() >= staged_len {
            if self.entries.len() < 2 {
                return None;
            }
            self.entries.keys().nth(self.entries.len() / 2)?.clone()
        } else {
            if staged_len < 2 {
                return None;
            }
            staged?.keys().nth(staged_len / 2)?.clone()
        };
        let right = self.entries.split_off(&mid);
        let mut moved: u64 = right.iter().map(|(k, v)| entry_bytes(k, v)).sum();
        let mut right_staged = BTreeMap::new();
        for (job, keys) in &mut self.staged {
            let upper = keys.split_off(&mid);
            moved += upper
                .iter()
                .flat_map(|(k, parts)| parts.values().map(move |v| staged_bytes(k, v)))
                .sum::<u64>();
            if !upper.is_empty() {
                right_staged.insert(*job, upper);
            }
        }
        self.staged.retain(|_, keys| !keys.is_empty());
        self.bytes -= moved;
        Some((
            mid,
            MapShard {
                entries: right,
                bytes: moved,
                staged: right_staged,
                // Both halves must drop late writes of the jobs closed here.
                closed: self.closed.clone(),
            },
        ))
    }

    fn merge(&mut self, mut right: Self) {
        self.bytes += right.bytes;
        self.entries.append(&mut right.entries);
        for (job, mut keys) in std::mem::take(&mut right.staged) {
            self.staged.entry(job).or_default().append(&mut keys);
        }
        for job in right.closed {
            self.close(job);
        }
    }

    fn footprint(&self) -> u64 {
        self.bytes
    }

    fn splits_stay_home(&self) -> bool {
        // Staged output of a job in flight: see `granule::batch`'s map sinks.
        !self.staged.is_empty()
    }
}

/// Batching mode's writer for a [`ShardedMap`]: see [`Pusher`].
pub type MapInserter<K, V> = Pusher<(K, V)>;

/// An ordered map whose entries live in auto-sized shards across the cluster.
/// Serializable: pass it to proclets on other nodes and use it there.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct ShardedMap<K: MapKey, V: MapValue> {
    sharder: AutoSharder<MapShard<K, V>>,
}

impl<K: MapKey, V: MapValue> Clone for ShardedMap<K, V> {
    fn clone(&self) -> Self {
        ShardedMap {
            sharder: self.sharder.clone(),
        }
    }
}

// What needs no copy of a value lives in blocks without `V: Clone`, usable in code
// generic over any map value. Writes need it (a routed call's argument is kept to send
// again after a stale route), and so do the reads that hand out copies.
impl<K: MapKey, V: MapValue> ShardedMap<K, V> {
    /// An empty map in low-latency mode (shards of at most 2 MiB).
    pub fn new() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::LOW_LATENCY)
    }

    /// An empty map with these shard bounds.
    pub fn with_bounds(bounds: Bounds) -> Result<Self, ShardError> {
        Ok(ShardedMap {
            sharder: AutoSharder::new(bounds)?,
        })
    }

    /// The machinery underneath (shard list, sizes, bounds).
    pub fn sharder(&self) -> &AutoSharder<MapShard<K, V>> {
        &self.sharder
    }
}

impl<K: MapKey, V: MapValue + Clone> ShardedMap<K, V> {
    /// Insert, returning the previous value.
    pub fn insert(&self, k: K, v: V) -> Result<Option<V>, ShardError> {
        self.sharder.route(
            &k,
            Hint::Grow,
            (k.clone(), v),
            |s: &mut MapShard<K, V>, (k, v)| s.insert(k, v),
        )
    }

    /// An empty map in batching mode's bounds (shards of at most 32 MiB); insert
    /// through [`ShardedMap::inserter`].
    pub fn batching() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::BATCHING)
    }

    /// A batching inserter: pairs buffered and sent in batches of about `batch_bytes`
    /// (one call per shard they touch), up to `in_flight` at once. Within a batch a later
    /// insert of a key wins; across batches in flight together, either may.
    pub fn inserter(
        &self,
        batch_bytes: u64,
        in_flight: usize,
    ) -> Result<MapInserter<K, V>, ShardError> {
        Pusher::start(
            self.sharder.clone(),
            batch_bytes,
            in_flight,
            |(k, _): &(K, V)| k.clone(),
            |s: &mut MapShard<K, V>, pairs: Vec<(K, V)>| {
                for (k, v) in pairs {
                    s.insert(k, v);
                }
            },
        )
    }

    /// Insert every pair in one call per shard they fall in, all sent at once (a later
    /// pair of the same key wins); returns how many were inserted. Shards grown past
    /// their upper bound are split before it returns. Usable from closures on any node
    /// (a batch job's workers write their output this way).
    pub fn insert_many(&self, pairs: Vec<(K, V)>) -> Result<u64, ShardError> {
        let n = pairs.len() as u64;
        self.write_many(
            pairs,
            |(k, _): &(K, V)| k.clone(),
            |s: &mut MapShard<K, V>, pairs: Vec<(K, V)>| {
                for (k, v) in pairs {
                    s.insert(k, v);
                }
            },
        )?;
        Ok(n)
    }

    /// [`AutoSharder::route_many_async`], waited for, then the splits it calls for.
    fn write_many<I, KF, F>(&self, items: Vec<I>, key_of: KF, apply: F) -> Result<(), ShardError>
    where
        I: Wire + Clone,
        KF: Fn(&I) -> K + Copy + Send + Sync + 'static,
        F: Fn(&mut MapShard<K, V>, Vec<I>) + Copy + Send + Sync + 'static,
    {
        if items.is_empty() {
            return Ok(());
        }
        let written =
            granule_runtime::block_on(self.sharder.route_many_async(items, key_of, apply))?;
        let upper = self.sharder.bounds().upper;
        for (key, shard, fp) in written {
            if fp > upper {
                self.sharder.resize_after(&key, Hint::Grow, &shard, fp);
            }
        }
        Ok(())
    }

    /// Stage a batch job's output: `(job, key, (first input index, call id), value)`
    /// values are parked in the shards their keys fall in (one call per shard), counted
    /// in their size, moved along by splits and merges, and invisible to every read
    /// until [`ShardedMap::commit_staged`]. Staging the same `(job, key, tag)` again
    /// replaces the value: resending a batch is harmless. Once a shard has committed or
    /// discarded `job`, it drops further values staged for it.
    ///
    /// This is the exactly-once half of `granule::batch`'s map sinks: a worker stages what
    /// a work call computed before it reports, the job's coordinator accepts one call per
    /// input range, and the commit keeps only the accepted calls' values, so a range
    /// computed twice (its first worker lost) is merged once.
    pub fn stage(&self, staged: Vec<StagedPair<K, V>>) -> Result<(), ShardError> {
        self.write_many(
            staged,
            |(_, k, _, _): &StagedPair<K, V>| k.clone(),
            |s: &mut MapShard<K, V>, staged: Vec<StagedPair<K, V>>| {
                for x in staged {
                    s.stage(x);
                }
            },
        )
    }

    /// Commit what `job` staged, once per key: for each key, the values of the calls in
    /// `accepted` are folded in input order with `merge`, and the result is merged into
    /// the key's entry (`merge(&mut entry, folded)`; inserted when absent). Values of
    /// calls not accepted are dropped. Each shard commits its whole part in one call
    /// (atomically for readers of that shard); a commit repeated after a lost reply finds
    /// nothing left and writes nothing. Returns the keys written.
    pub fn commit_staged<M>(
        &self,
        job: u64,
        accepted: Vec<u64>,
        merge: M,
    ) -> Result<u64, ShardError>
    where
        M: Fn(&mut V, V) + Copy + Send + Sync + 'static,
    {
        let mut accepted = accepted;
        accepted.sort_unstable();
        accepted.dedup();
        let mut written = 0;
        // Every shard holding staged values of the job, by one of their keys; splits
        // and merges in between move staged values with their keys, so the pass ends
        // when no shard holds any.
        loop {
            let firsts = self
                .sharder
                .map_shards(job, |s: &MapShard<K, V>, job: u64| s.first_staged(job))?;
            let firsts: Vec<K> = firsts.into_iter().flatten().collect();
            if firsts.is_empty() {
                return Ok(written);
            }
            for k in firsts {
                written += self.sharder.route_with(
                    &k,
                    Hint::Any,
                    (job, accepted.clone()),
                    merge,
                    |s: &mut MapShard<K, V>, (job, accepted): (u64, Vec<u64>), merge: &M| {
                        s.commit(job, &accepted, merge)
                    },
                )?;
            }
        }
    }

    /// Drop everything `job` staged (a job that failed).
    pub fn discard_staged(&self, job: u64) -> Result<(), ShardError> {
        self.commit_staged(job, Vec::new(), |_: &mut V, _: V| {})
            .map(|_| ())
    }

    /// Run `f(&arg, entries)` next to every shard's entries of a *sealed* map, in key
    /// order, exactly once per shard (fails with [`ShardError::NotSealed`] on a map that
    /// is not sealed, and with [`ShardError::Stuck`] if a shard's range changed anyway:
    /// unlike [`ShardedMap::offload`] it never starts a pass again, so `f` may have side
    /// effects that must not be repeated).
    pub fn visit_sealed<A, R, F>(&self, arg: A, f: F) -> Result<Vec<R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&A, &BTreeMap<K, V>) -> R + Copy + Send + Sync + 'static,
    {
        if !self.sharder.is_sealed()? {
            return Err(ShardError::NotSealed);
        }
        let mut out = Vec::new();
        for (lo, shard) in self.sharder.shards()? {
            // Zero-sized like `f`, which it alone captures: it travels as code.
            let r =
                self.sharder
                    .shard_ref(&shard, arg.clone(), move |s: &MapShard<K, V>, a: A| {
                        f(&a, &s.entries)
                    })?;
            match r {
                Some(r) => out.push(r),
                None => {
                    return Err(ShardError::Stuck(format!(
                        "the shard from {lo:?} of a sealed map changed its range"
                    )))
                }
            }
        }
        Ok(out)
    }
}

impl<K: MapKey, V: MapValue> ShardedMap<K, V> {
    /// Remove `k`, returning its value.
    pub fn remove(&self, k: &K) -> Result<Option<V>, ShardError> {
        self.sharder.route(
            k,
            Hint::Shrink,
            k.clone(),
            |s: &mut MapShard<K, V>, k: K| s.remove(&k),
        )
    }

    /// Run `f(&mut entry, arg)` on `k`'s entry where it lives (`None`: absent; setting
    /// `None` removes it), and return its result.
    pub fn update<A, R, F>(&self, k: &K, arg: A, f: F) -> Result<R, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&mut Option<V>, A) -> R + Copy + Send + Sync + 'static,
    {
        self.sharder.route_with(
            k,
            Hint::Any,
            (k.clone(), arg),
            f,
            |s: &mut MapShard<K, V>, (k, a): (K, A), f: &F| {
                let mut entry = s.remove(&k);
                let r = f(&mut entry, a);
                if let Some(v) = entry {
                    s.insert(k, v);
                }
                r
            },
        )
    }
}

impl<K: MapKey, V: MapValue + Clone> ShardedMap<K, V> {
    /// The value of `k`.
    pub fn get(&self, k: &K) -> Result<Option<V>, ShardError> {
        self.sharder
            .route_ref(k, k.clone(), |s: &MapShard<K, V>, k: K| {
                s.entries.get(&k).cloned()
            })
    }

    /// Entries with keys in `[from, to)` (`None`: open end), in key order, at most
    /// `limit`. Each shard answers for its own range and the scan goes on where that
    /// range ends, so an entry present throughout the scan is seen exactly once, splits
    /// and merges notwithstanding.
    pub fn range(
        &self,
        from: Option<K>,
        to: Option<K>,
        limit: usize,
    ) -> Result<Vec<(K, V)>, ShardError> {
        let mut out = Vec::new();
        let mut at = match from {
            Some(k) => k,
            None => match self.first_key()? {
                Some(k) => k,
                None => return Ok(out),
            },
        };
        while out.len() < limit {
            let want = limit - out.len();
            let (chunk, hi) = self.sharder.route_ref_end(
                &at,
                (at.clone(), to.clone(), want),
                |s: &MapShard<K, V>, (from, to, n): (K, Option<K>, usize)| {
                    s.scan(&Some(from), &to, n)
                },
            )?;
            out.extend(chunk);
            match hi {
                Some(h) if to.as_ref().is_none_or(|t| &h < t) => at = h,
                _ => break,
            }
        }
        Ok(out)
    }
}

impl<K: MapKey, V: MapValue> ShardedMap<K, V> {
    /// The smallest key present.
    fn first_key(&self) -> Result<Option<K>, ShardError> {
        let firsts = self.sharder.map_shards((), |s: &MapShard<K, V>, ()| {
            s.entries.keys().next().cloned()
        })?;
        Ok(firsts.into_iter().flatten().next())
    }

    /// Number of entries (a call to every shard).
    pub fn len(&self) -> Result<u64, ShardError> {
        let lens = self
            .sharder
            .map_shards((), |s: &MapShard<K, V>, ()| s.entries.len() as u64)?;
        Ok(lens.into_iter().sum())
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> Result<bool, ShardError> {
        Ok(self.len()? == 0)
    }

    /// Free every shard.
    pub fn destroy(&self) -> Result<(), ShardError> {
        self.sharder.destroy()
    }

    /// Make the shards hybrid proclets, to run code next to their entries
    /// ([`ShardedMap::offload`]); see [`AutoSharder::hybridize`].
    pub fn hybridize(&self) -> Result<(), ShardError> {
        self.sharder.hybridize()
    }

    /// Make the shards plain memory proclets again.
    pub fn dehybridize(&self) -> Result<(), ShardError> {
        self.sharder.dehybridize()
    }

    /// Run `f(&arg, entries)` next to every shard's entries (a key range each, in key
    /// order); only the results travel.
    pub fn offload<A, R, F>(&self, arg: A, f: F) -> Result<Vec<R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&A, &BTreeMap<K, V>) -> R + Copy + Send + Sync + 'static,
    {
        // Zero-sized like `f`, which it alone captures: it travels as code.
        self.sharder
            .offload(arg, move |s: &MapShard<K, V>, a: A| f(&a, &s.entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte count a shard should have, recomputed from scratch.
    fn recount(s: &MapShard<u64, Vec<u64>>) -> u64 {
        let entries: u64 = s.entries.iter().map(|(k, v)| entry_bytes(k, v)).sum();
        let staged: u64 = s
            .staged
            .values()
            .flat_map(|keys| keys.iter())
            .flat_map(|(k, parts)| parts.values().map(move |v| staged_bytes(k, v)))
            .sum();
        entries + staged
    }

    fn append(a: &mut Vec<u64>, b: Vec<u64>) {
        a.extend(b)
    }

    #[test]
    fn staged_values_are_invisible_until_committed_and_merge_once_in_input_order() {
        let mut s: MapShard<u64, Vec<u64>> = MapShard::default();
        s.insert(1, vec![0]);
        // Calls 7 (input 100..) and 3 (input 0..) of job 9 stage key 1; call 5 was lost
        // (never accepted), and staged a value too.
        s.stage((9, 1, (100, 7), vec![2]));
        s.stage((9, 1, (0, 3), vec![1]));
        s.stage((9, 1, (50, 5), vec![99]));
        s.stage((9, 2, (0, 3), vec![5]));
        // A resent batch replaces its own value: no duplicate.
        s.stage((9, 2, (0, 3), vec![5]));
        assert_eq!(s.entries.len(), 1);
        assert_eq!(s.bytes, recount(&s));
        assert_eq!(s.commit(9, &[3, 7], &append), 2);
        assert_eq!(s.entries[&1], vec![0, 1, 2]);
        assert_eq!(s.entries[&2], vec![5]);
        assert!(s.staged.is_empty());
        assert_eq!(s.bytes, recount(&s));
        // A second commit, and a late write of the closed job, change nothing.
        assert_eq!(s.commit(9, &[3, 7], &append), 0);
        s.stage((9, 3, (200, 8), vec![1]));
        assert!(s.staged.is_empty());
        assert!(!s.entries.contains_key(&3));
    }

    #[test]
    fn splits_and_merges_carry_staged_values_with_their_keys() {
        let mut s: MapShard<u64, Vec<u64>> = MapShard::default();
        // Only staged values: the shard must still split.
        for k in 0..10u64 {
            s.stage((1, k, (k, k), vec![k; 3]));
        }
        s.close(42);
        let (mid, mut right) = s.split().expect("splits on staged keys");
        assert_eq!(mid, 5);
        assert_eq!(s.bytes, recount(&s));
        assert_eq!(right.bytes, recount(&right));
        assert!(right.closed.contains(&42));
        let all: Vec<u64> = (0..10).collect();
        let upper: Vec<u64> = (5..10).collect();
        assert_eq!(right.commit(1, &all, &append), 5);
        assert_eq!(right.entries.keys().copied().collect::<Vec<_>>(), upper);
        // Merge the committed right half back into the left, which still has job 1
        // staged: the left commits its own part afterwards.
        s.merge(right);
        assert_eq!(s.bytes, recount(&s));
        assert_eq!(s.commit(1, &all, &append), 5);
        assert_eq!(s.entries.len(), 10);
        assert_eq!(s.entries[&7], vec![7, 7, 7]);
        assert_eq!(s.bytes, recount(&s));
    }
}
