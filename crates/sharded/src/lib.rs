//! Granule's sharded data structures (the Quicksand layer): a structure is a set of memory
//! proclets (*shards*), each holding one key range, kept between a lower and an upper size
//! bound by splitting and merging on their own, while clients keep a cached map of the
//! ranges. Developers never size shards.
//!
//! - [`AutoSharder`] owns the machinery: the range map (in a mapping proclet, as a
//!   compacted log of changes), routing with stale-cache catch-up, split and merge. The
//!   map, its log, the clients' cache and the routing loop are `granule-router`'s, which
//!   services share; the shards and their split and merge steps are this crate's.
//! - Built on it: [`ShardedVec`] (index ranges; a prefetching iterator once sealed),
//!   [`ShardedMap`] (ordered key ranges; range scans), [`ShardedQueue`] (FIFO; only the
//!   tail grows, drained head shards are dropped) and [`ShardedPartitions`] (unordered
//!   pairs per key range, split by quickselect).
//!
//! Each structure runs in one of two modes. **Low-latency** (`new()`): one call per
//! operation, shards of at most 2 MiB ([`Bounds::LOW_LATENCY`]). **Batching**
//! (`batching()`): writes buffered on the client in a [`Pusher`] and flushed in large
//! messages with several flushes in flight, reads in blocks (`try_pop(n)`, the vector's
//! prefetching iterator, range scans), shards of at most 32 MiB ([`Bounds::BATCHING`]).
//! Both bounds are configurable (`with_bounds`).
//!
//! This crate owns no transport, placement or migration: shards are ordinary proclets of
//! `granule-runtime`, placed by the controller and moved by the pressure policy.
//!
//! # Elements, keys and values: `Footprint`
//!
//! Every element of a [`ShardedVec`] and every key and value of a [`ShardedMap`] must
//! implement [`Footprint`] (besides serde's traits): each shard keeps an exact count of
//! the bytes it holds, and splits and merges by it. The primitive types, `String`, the
//! standard containers, `Option`, `Box`, arrays and small tuples implement it; for a type
//! of your own, derive it (`#[derive(granule::Footprint)]` in an application, which gets
//! it from the `granule` facade; `#[derive(granule_runtime::Footprint)]` in a crate that
//! depends on the runtime directly). The derive counts the type's inline size plus what
//! each field owns on the heap, so every field must implement it too.
//!
//! ```no_run
//! use granule_runtime::Footprint;
//! use granule_sharded::ShardedVec;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Clone, Serialize, Deserialize, Footprint)]
//! struct Reading { sensor: u32, values: Vec<f64> }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let cluster = granule_runtime::Cluster::start()?;
//! let v: ShardedVec<Reading> = ShardedVec::new()?;
//! v.push(Reading { sensor: 7, values: vec![1.5, 2.0] })?;
//! # cluster.shutdown();
//! # Ok(()) }
//! ```
//!
//! A map also holds *staged writes* ([`ShardedMap::stage`]): a batch job's output parked
//! in the shards its keys fall in, invisible to reads until the job commits it, once per
//! key. `granule-batch`'s sinks write through them.
//!
//! # A structure of your own in a page
//!
//! A sharded set of `u64`: a shard type, its [`Shard`] impl, and two routed calls.
//!
//! ```no_run
//! use granule_sharded::{AutoSharder, Bounds, Hint, Shard, ShardError};
//! use serde::{Deserialize, Serialize};
//! use std::collections::BTreeSet;
//!
//! #[derive(Default, Serialize, Deserialize)]
//! struct SetShard { keys: BTreeSet<u64> }
//!
//! impl Shard for SetShard {
//!     type Key = u64;
//!     fn split(&mut self) -> Option<(u64, Self)> {
//!         let mid = *self.keys.iter().nth(self.keys.len() / 2)?;
//!         if mid == *self.keys.iter().next()? { return None; }
//!         Some((mid, SetShard { keys: self.keys.split_off(&mid) }))
//!     }
//!     fn merge(&mut self, mut right: Self) { self.keys.append(&mut right.keys) }
//!     fn footprint(&self) -> u64 { 48 * self.keys.len() as u64 }
//! }
//!
//! struct ShardedSet(AutoSharder<SetShard>);
//!
//! impl ShardedSet {
//!     fn new() -> Result<Self, ShardError> { Ok(ShardedSet(AutoSharder::new(Bounds::LOW_LATENCY)?)) }
//!     fn insert(&self, k: u64) -> Result<bool, ShardError> {
//!         self.0.route(&k, Hint::Grow, k, |s: &mut SetShard, k: u64| s.keys.insert(k))
//!     }
//!     fn contains(&self, k: u64) -> Result<bool, ShardError> {
//!         self.0.route_ref(&k, k, |s: &SetShard, k: u64| s.keys.contains(&k))
//!     }
//! }
//! ```
#![forbid(unsafe_code)]

mod batch;
mod map;
mod partitions;
mod parts;
mod queue;
mod sharder;
mod vec;

pub use batch::Pusher;
pub use map::{MapInserter, MapKey, MapShard, MapValue, ShardedMap, StagedPair};
pub use partitions::{Partition, PartitionShard, PartitionsPusher, ShardedPartitions};
pub use parts::SealedShard;
pub use queue::{QueuePusher, QueueShard, ShardedQueue};
pub use sharder::{AutoSharder, Bounds, Cell, Hint, MapLog, Shard};
pub use vec::{Element, ShardedVec, VecIter, VecPart, VecPusher, VecShard};

use granule_runtime::CallError;
/// The trait every element, key and value must implement, and its derive (see the crate
/// docs).
pub use granule_runtime::Footprint;

/// What can go wrong with a sharded structure.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// A call to a shard or to the mapping proclet failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The structure is sealed: no writes until it is unsealed.
    #[error("the structure is sealed")]
    Sealed,
    /// The map has no shard for the key (a structure whose mapping proclet was reset).
    #[error("no shard holds this key")]
    Unmapped,
    /// A route kept failing to find its key's shard.
    #[error("could not route key {0} to a shard in time")]
    Stuck(String),
    /// Bad size bounds.
    #[error("bad shard bounds: lower {lower} B, upper {upper} B (need 0 < 2 × lower ≤ upper)")]
    BadBounds { lower: u64, upper: u64 },
    /// A split or merge step failed on a shard's node.
    #[error("resizing a shard: {0}")]
    Step(String),
    /// Iterating needs a sealed structure.
    #[error("the structure is not sealed (seal it before iterating)")]
    NotSealed,
    /// An index past the end of a vector.
    #[error("index {index} out of range (length {len})")]
    OutOfRange { index: u64, len: u64 },
}

impl From<granule_router::RouteError> for ShardError {
    fn from(e: granule_router::RouteError) -> Self {
        match e {
            granule_router::RouteError::Call(e) => ShardError::Call(e),
            granule_router::RouteError::Unmapped => ShardError::Unmapped,
            granule_router::RouteError::Stuck(key) => ShardError::Stuck(key),
        }
    }
}

impl From<granule_router::BoundsError> for ShardError {
    fn from(e: granule_router::BoundsError) -> Self {
        ShardError::BadBounds {
            lower: e.lower,
            upper: e.upper,
        }
    }
}

/// Sleep without holding a node's worker (see [`granule_router::pause`]).
pub(crate) use granule_router::pause;
