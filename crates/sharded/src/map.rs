//! [`ShardedMap`]: an ordered map split into key ranges, each a memory proclet.

use crate::batch::Pusher;
use crate::sharder::{AutoSharder, Bounds, Hint, Shard};
use crate::ShardError;
use granule_runtime::{Footprint, Wire};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// One range of a [`ShardedMap`]: a `BTreeMap` and its running byte count.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct MapShard<K: MapKey, V: MapValue> {
    entries: BTreeMap<K, V>,
    bytes: u64,
}

impl<K: MapKey, V: MapValue> Default for MapShard<K, V> {
    fn default() -> Self {
        MapShard {
            entries: BTreeMap::new(),
            bytes: 0,
        }
    }
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
        if self.entries.len() < 2 {
            return None;
        }
        let mid = self.entries.keys().nth(self.entries.len() / 2)?.clone();
        let right = self.entries.split_off(&mid);
        let moved: u64 = right.iter().map(|(k, v)| entry_bytes(k, v)).sum();
        self.bytes -= moved;
        Some((
            mid,
            MapShard {
                entries: right,
                bytes: moved,
            },
        ))
    }

    fn merge(&mut self, mut right: Self) {
        self.bytes += right.bytes;
        self.entries.append(&mut right.entries);
    }

    fn footprint(&self) -> u64 {
        self.bytes
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

impl<K: MapKey, V: MapValue + Clone> ShardedMap<K, V> {
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

    /// The value of `k`.
    pub fn get(&self, k: &K) -> Result<Option<V>, ShardError> {
        self.sharder
            .route_ref(k, k.clone(), |s: &MapShard<K, V>, k: K| {
                s.entries.get(&k).cloned()
            })
    }

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
