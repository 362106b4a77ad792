//! [`ShardedPartitions`]: unordered key–value pairs grouped by key range, one range per
//! shard — the shape of a shuffle's output, where each partition is later processed as a
//! whole.
//!
//! Pairs are kept in arrival order inside a shard (appending is O(1), no index to keep).
//! A split picks the median key by quickselect (`select_nth_unstable_by`, linear time)
//! and moves the pairs at or above it: the halves are even, except that pairs with one
//! key never straddle two shards.

use crate::batch::Pusher;
use crate::map::{MapKey, MapValue};
use crate::sharder::{AutoSharder, Bounds, Cell, Hint, Shard};
use crate::ShardError;
use granule_runtime::{Footprint, Proclet};
use serde::{Deserialize, Serialize};

/// One key range of a [`ShardedPartitions`]: its pairs, unordered.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct PartitionShard<K: MapKey, V: MapValue> {
    pairs: Vec<(K, V)>,
    bytes: u64,
}

impl<K: MapKey, V: MapValue> Default for PartitionShard<K, V> {
    fn default() -> Self {
        PartitionShard {
            pairs: Vec::new(),
            bytes: 0,
        }
    }
}

fn pair_bytes<K: Footprint, V: Footprint>(k: &K, v: &V) -> u64 {
    k.footprint() + v.footprint()
}

impl<K: MapKey, V: MapValue> PartitionShard<K, V> {
    fn add(&mut self, pairs: impl IntoIterator<Item = (K, V)>) {
        for (k, v) in pairs {
            self.bytes += pair_bytes(&k, &v);
            self.pairs.push((k, v));
        }
    }

    fn take_key(&mut self, k: &K) -> Vec<V> {
        let (out, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pairs)
            .into_iter()
            .partition(|(pk, _)| pk == k);
        self.pairs = keep;
        self.bytes -= out.iter().map(|(k, v)| pair_bytes(k, v)).sum::<u64>();
        out.into_iter().map(|(_, v)| v).collect()
    }
}

impl<K: MapKey, V: MapValue> Shard for PartitionShard<K, V> {
    type Key = K;

    fn split(&mut self) -> Option<(K, Self)> {
        if self.pairs.len() < 2 {
            return None;
        }
        let mid = self.pairs.len() / 2;
        self.pairs.select_nth_unstable_by(mid, |a, b| a.0.cmp(&b.0));
        let mut at = self.pairs[mid].0.clone();
        if !self.pairs.iter().any(|(k, _)| k < &at) {
            // The median is the smallest key (many pairs share it): split above it.
            at = self
                .pairs
                .iter()
                .filter(|(k, _)| k > &at)
                .map(|(k, _)| k)
                .min()?
                .clone();
        }
        let (keep, right): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pairs)
            .into_iter()
            .partition(|(k, _)| k < &at);
        self.pairs = keep;
        let moved: u64 = right.iter().map(|(k, v)| pair_bytes(k, v)).sum();
        self.bytes -= moved;
        Some((
            at,
            PartitionShard {
                pairs: right,
                bytes: moved,
            },
        ))
    }

    fn merge(&mut self, mut right: Self) {
        self.bytes += right.bytes;
        self.pairs.append(&mut right.pairs);
    }

    fn footprint(&self) -> u64 {
        self.bytes
    }

    fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

/// Key–value pairs (a key may repeat) grouped into auto-sized partitions by key range.
/// Serializable: pass it to proclets on other nodes and use it there.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct ShardedPartitions<K: MapKey, V: MapValue> {
    sharder: AutoSharder<PartitionShard<K, V>>,
}

impl<K: MapKey, V: MapValue> Clone for ShardedPartitions<K, V> {
    fn clone(&self) -> Self {
        ShardedPartitions {
            sharder: self.sharder.clone(),
        }
    }
}

/// Batching mode's writer for a [`ShardedPartitions`]: see [`Pusher`].
pub type PartitionsPusher<K, V> = Pusher<(K, V)>;

impl<K: MapKey, V: MapValue + Clone> ShardedPartitions<K, V> {
    /// Empty, in low-latency mode (shards of at most 2 MiB).
    pub fn new() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::LOW_LATENCY)
    }

    /// Empty, in batching mode's bounds (shards of at most 32 MiB); add pairs through
    /// [`ShardedPartitions::pusher`].
    pub fn batching() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::BATCHING)
    }

    /// Empty, with these shard bounds.
    pub fn with_bounds(bounds: Bounds) -> Result<Self, ShardError> {
        Ok(ShardedPartitions {
            sharder: AutoSharder::new(bounds)?,
        })
    }

    /// The machinery underneath (shard list, sizes, bounds).
    pub fn sharder(&self) -> &AutoSharder<PartitionShard<K, V>> {
        &self.sharder
    }

    /// Add a pair (one call).
    pub fn insert(&self, k: K, v: V) -> Result<(), ShardError> {
        self.sharder.route(
            &k,
            Hint::Grow,
            (k.clone(), v),
            |s: &mut PartitionShard<K, V>, kv: (K, V)| s.add([kv]),
        )
    }

    /// A batching pusher of pairs: batches of about `batch_bytes` (one call per
    /// partition they touch), up to `in_flight` sent at once.
    pub fn pusher(
        &self,
        batch_bytes: u64,
        in_flight: usize,
    ) -> Result<PartitionsPusher<K, V>, ShardError> {
        Pusher::start(
            self.sharder.clone(),
            batch_bytes,
            in_flight,
            |(k, _): &(K, V)| k.clone(),
            |s: &mut PartitionShard<K, V>, pairs: Vec<(K, V)>| s.add(pairs),
        )
    }

    /// Every value stored under `k` (a scan of its partition).
    pub fn get_all(&self, k: &K) -> Result<Vec<V>, ShardError> {
        self.sharder
            .route_ref(k, k.clone(), |s: &PartitionShard<K, V>, k: K| {
                s.pairs
                    .iter()
                    .filter(|(pk, _)| pk == &k)
                    .map(|(_, v)| v.clone())
                    .collect()
            })
    }

    /// Remove and return every value stored under `k`.
    pub fn remove_all(&self, k: &K) -> Result<Vec<V>, ShardError> {
        self.sharder.route(
            k,
            Hint::Shrink,
            k.clone(),
            |s: &mut PartitionShard<K, V>, k: K| s.take_key(&k),
        )
    }

    /// Number of pairs (a call to every shard).
    pub fn len(&self) -> Result<u64, ShardError> {
        let lens = self
            .sharder
            .map_shards((), |s: &PartitionShard<K, V>, ()| s.pairs.len() as u64)?;
        Ok(lens.into_iter().sum())
    }

    /// Whether there is no pair.
    pub fn is_empty(&self) -> Result<bool, ShardError> {
        Ok(self.len()? == 0)
    }

    /// Seal: no more writes; partitions stop splitting and merging, so they can be
    /// listed and read one by one.
    pub fn seal(&self) -> Result<(), ShardError> {
        self.sharder.seal()
    }

    /// Allow writes again.
    pub fn unseal(&self) -> Result<(), ShardError> {
        self.sharder.unseal()
    }

    /// The partitions of a sealed structure, in key order. Fails with
    /// [`ShardError::NotSealed`] if it is not sealed.
    pub fn partitions(&self) -> Result<Vec<Partition<K, V>>, ShardError> {
        if !self.sharder.is_sealed()? {
            return Err(ShardError::NotSealed);
        }
        let shards = self.sharder.shards()?;
        let his = shards
            .iter()
            .skip(1)
            .map(|(lo, _)| lo.clone())
            .chain([None]);
        Ok(shards
            .iter()
            .zip(his)
            .map(|((lo, shard), hi)| Partition {
                sharder: self.sharder.clone(),
                shard: shard.clone(),
                lo: lo.clone(),
                hi,
            })
            .collect())
    }

    /// Free every shard.
    pub fn destroy(&self) -> Result<(), ShardError> {
        self.sharder.destroy()
    }
}

/// One partition of a sealed [`ShardedPartitions`]: its key range and a handle to read
/// it (wherever its shard has moved). Serializable: hand partitions to workers.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Partition<K: MapKey, V: MapValue> {
    sharder: AutoSharder<PartitionShard<K, V>>,
    shard: Proclet<Cell<PartitionShard<K, V>>>,
    lo: Option<K>,
    hi: Option<K>,
}

impl<K: MapKey, V: MapValue + Clone> Partition<K, V> {
    /// The keys it holds: `[lo, hi)`, `None` being an open end.
    pub fn range(&self) -> (Option<&K>, Option<&K>) {
        (self.lo.as_ref(), self.hi.as_ref())
    }

    /// Its pairs, in no particular order (one call).
    pub fn pairs(&self) -> Result<Vec<(K, V)>, ShardError> {
        self.read((), |s: &PartitionShard<K, V>, ()| s.pairs.clone())
    }

    /// Number of pairs.
    pub fn len(&self) -> Result<u64, ShardError> {
        self.read((), |s: &PartitionShard<K, V>, ()| s.pairs.len() as u64)
    }

    /// Whether it holds no pair.
    pub fn is_empty(&self) -> Result<bool, ShardError> {
        Ok(self.len()? == 0)
    }

    fn read<R, F>(&self, arg: (), f: F) -> Result<R, ShardError>
    where
        R: granule_runtime::Wire,
        F: Fn(&PartitionShard<K, V>, ()) -> R + Copy + Send + Sync + 'static,
    {
        self.sharder
            .shard_ref(&self.shard, arg, f)?
            // Sealed partitions stay put; one that changed was unsealed meanwhile.
            .ok_or(ShardError::NotSealed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(keys: &[u64]) -> PartitionShard<u64, u64> {
        let mut s = PartitionShard::default();
        s.add(keys.iter().map(|&k| (k, k * 10)));
        s
    }

    #[test]
    fn split_is_even_and_keeps_equal_keys_together() {
        // Keys 0..1000 scrambled, each twice.
        let keys: Vec<u64> = (0..2000u64).map(|i| (i % 1000) * 7919 % 1000).collect();
        let mut left = shard(&keys);
        let total = left.bytes;
        let (at, right) = left.split().expect("splits");
        assert!(left.pairs.iter().all(|(k, _)| *k < at));
        assert!(right.pairs.iter().all(|(k, _)| *k >= at));
        assert_eq!(left.pairs.len(), 1000);
        assert_eq!(right.pairs.len(), 1000);
        assert_eq!(left.bytes + right.bytes, total);
        assert_eq!(left.bytes, left.pairs.len() as u64 * 16);
    }

    #[test]
    fn split_with_a_dominant_smallest_key_goes_above_it() {
        let mut keys = vec![5u64; 90];
        keys.extend(6..16);
        let mut left = shard(&keys);
        let (at, right) = left.split().expect("splits");
        assert_eq!(at, 6);
        assert_eq!(left.pairs.len(), 90);
        assert_eq!(right.pairs.len(), 10);
    }

    #[test]
    fn one_key_does_not_split() {
        let mut s = shard(&[3; 50]);
        assert!(s.split().is_none());
        assert_eq!(s.pairs.len(), 50);
    }

    #[test]
    fn take_key_removes_all_its_pairs() {
        let mut s = shard(&[1, 2, 1, 3, 1]);
        assert_eq!(s.take_key(&1), vec![10, 10, 10]);
        assert_eq!(s.pairs.len(), 2);
        assert_eq!(s.bytes, 32);
        let mut other = shard(&[9]);
        s.merge(std::mem::take(&mut other));
        assert_eq!(s.pairs.len(), 3);
        assert_eq!(s.bytes, 48);
    }
}
