//! [`ShardedVec`]: a vector split into index ranges, each a memory proclet; it grows at
//! the tail, and once sealed it is iterated with blocks prefetched in the background.

use crate::batch::Pusher;
use crate::sharder::{AutoSharder, Bounds, Hint, Shard};
use crate::ShardError;
use granule_runtime::{Footprint, Wire};
use serde::{Deserialize, Serialize};

/// What a vector element must be.
pub trait Element: Wire + Clone + Sync + Footprint {}
impl<T: Wire + Clone + Sync + Footprint> Element for T {}

/// One index range of a [`ShardedVec`]: elements `start..start + items.len()`.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct VecShard<T: Element> {
    start: u64,
    items: Vec<T>,
    bytes: u64,
}

impl<T: Element> Default for VecShard<T> {
    fn default() -> Self {
        VecShard {
            start: 0,
            items: Vec::new(),
            bytes: 0,
        }
    }
}

impl<T: Element> Shard for VecShard<T> {
    type Key = u64;

    fn split(&mut self) -> Option<(u64, Self)> {
        if self.items.len() < 2 {
            return None;
        }
        let at = self.items.len() / 2;
        let right = self.items.split_off(at);
        let moved: u64 = right.iter().map(|t| t.footprint()).sum();
        self.bytes -= moved;
        let start = self.start + at as u64;
        Some((
            start,
            VecShard {
                start,
                items: right,
                bytes: moved,
            },
        ))
    }

    fn merge(&mut self, mut right: Self) {
        self.bytes += right.bytes;
        self.items.append(&mut right.items);
    }

    fn footprint(&self) -> u64 {
        self.bytes
    }
}

/// The elements of `from..to` that `s` holds (a prefix of them: the rest is on the next
/// shards).
fn read_part<T: Element>(s: &VecShard<T>, (from, to): (u64, u64)) -> Vec<T> {
    let lo = from.saturating_sub(s.start) as usize;
    let hi = (to.saturating_sub(s.start) as usize).min(s.items.len());
    s.items.get(lo..hi).map(|x| x.to_vec()).unwrap_or_default()
}

/// The key that reaches the tail shard (the one whose range is open upwards).
const TAIL: u64 = u64::MAX;

/// A vector whose elements live in auto-sized shards across the cluster. Serializable:
/// pass it to proclets on other nodes and use it there.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct ShardedVec<T: Element> {
    sharder: AutoSharder<VecShard<T>>,
}

impl<T: Element> Clone for ShardedVec<T> {
    fn clone(&self) -> Self {
        ShardedVec {
            sharder: self.sharder.clone(),
        }
    }
}

impl<T: Element> ShardedVec<T> {
    /// An empty vector in low-latency mode (shards of at most 2 MiB).
    pub fn new() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::LOW_LATENCY)
    }

    /// An empty vector with these shard bounds.
    pub fn with_bounds(bounds: Bounds) -> Result<Self, ShardError> {
        Ok(ShardedVec {
            sharder: AutoSharder::new(bounds)?,
        })
    }

    /// The machinery underneath (shard list, sizes, bounds).
    pub fn sharder(&self) -> &AutoSharder<VecShard<T>> {
        &self.sharder
    }

    /// Append `v`; returns its index.
    pub fn push(&self, v: T) -> Result<u64, ShardError> {
        self.sharder
            .route(&TAIL, Hint::Grow, v, |s: &mut VecShard<T>, v: T| {
                s.bytes += v.footprint();
                s.items.push(v);
                s.start + s.items.len() as u64 - 1
            })
    }

    /// Append every element of `vs` in one call; returns the index of the first.
    pub fn extend(&self, vs: Vec<T>) -> Result<u64, ShardError> {
        self.sharder
            .route(&TAIL, Hint::Grow, vs, |s: &mut VecShard<T>, vs: Vec<T>| {
                let first = s.start + s.items.len() as u64;
                s.bytes += vs.iter().map(|v| v.footprint()).sum::<u64>();
                s.items.extend(vs);
                first
            })
    }

    /// Element `i` (`None` past the end).
    pub fn get(&self, i: u64) -> Result<Option<T>, ShardError> {
        self.sharder.route_ref(&i, i, |s: &VecShard<T>, i: u64| {
            i.checked_sub(s.start)
                .and_then(|k| s.items.get(k as usize))
                .cloned()
        })
    }

    /// Replace element `i`; returns the old one.
    pub fn set(&self, i: u64, v: T) -> Result<T, ShardError> {
        let r = self.sharder.route(
            &i,
            Hint::Grow,
            (i, v),
            |s: &mut VecShard<T>, (i, v): (u64, T)| {
                let k = i.checked_sub(s.start)? as usize;
                let slot = s.items.get_mut(k)?;
                s.bytes = s.bytes + v.footprint() - slot.footprint();
                Some(std::mem::replace(slot, v))
            },
        )?;
        match r {
            Some(old) => Ok(old),
            None => Err(ShardError::OutOfRange {
                index: i,
                len: self.len()?,
            }),
        }
    }

    /// Number of elements (asks the tail shard).
    pub fn len(&self) -> Result<u64, ShardError> {
        self.sharder.route_ref(&TAIL, (), |s: &VecShard<T>, ()| {
            s.start + s.items.len() as u64
        })
    }

    /// Whether the vector is empty.
    pub fn is_empty(&self) -> Result<bool, ShardError> {
        Ok(self.len()? == 0)
    }

    /// Seal: no more writes; shards stop splitting and merging, so iteration can plan
    /// its reads.
    pub fn seal(&self) -> Result<(), ShardError> {
        self.sharder.seal()
    }

    /// Allow writes again.
    pub fn unseal(&self) -> Result<(), ShardError> {
        self.sharder.unseal()
    }

    /// Elements `from..to`, read in one call per shard they span.
    pub fn read_range(&self, from: u64, to: u64) -> Result<Vec<T>, ShardError> {
        let mut out = Vec::with_capacity(to.saturating_sub(from) as usize);
        let mut at = from;
        while at < to {
            let (chunk, _) = self.sharder.route_ref_end(&at, (at, to), read_part::<T>)?;
            if chunk.is_empty() {
                break;
            }
            at += chunk.len() as u64;
            out.extend(chunk);
        }
        Ok(out)
    }

    /// [`ShardedVec::read_range`] as a future that owns what it needs (spawn it to keep a
    /// read in flight while computing); for sealed vectors, like the iterator.
    pub fn read_range_async(
        &self,
        from: u64,
        to: u64,
    ) -> impl std::future::Future<Output = Result<Vec<T>, ShardError>> + Send + 'static {
        let me = self.clone();
        async move {
            let mut out = Vec::with_capacity(to.saturating_sub(from) as usize);
            let mut at = from;
            while at < to {
                let chunk = me
                    .sharder
                    .route_ref_async(&at, (at, to), read_part::<T>)
                    .await?;
                if chunk.is_empty() {
                    break;
                }
                at += chunk.len() as u64;
                out.extend(chunk);
            }
            Ok(out)
        }
    }

    /// Iterate a sealed vector, `depth` blocks of `block` elements fetched ahead in the
    /// background. Fails with [`ShardError::NotSealed`] if the vector is not sealed
    /// (elements could move between shards under the iterator).
    pub fn iter(&self, block: usize, depth: usize) -> Result<VecIter<T>, ShardError> {
        let len = self.len()?;
        self.iter_range(0..len, block, depth)
    }

    /// [`ShardedVec::iter`] over elements `range` only (clipped to the vector).
    pub fn iter_range(
        &self,
        range: std::ops::Range<u64>,
        block: usize,
        depth: usize,
    ) -> Result<VecIter<T>, ShardError> {
        if !self.sharder.is_sealed()? {
            return Err(ShardError::NotSealed);
        }
        let end = range.end.min(self.len()?);
        VecIter::start(self.clone(), range.start..end, block.max(1), depth.max(1))
    }

    /// Free every shard.
    pub fn destroy(&self) -> Result<(), ShardError> {
        self.sharder.destroy()
    }

    /// Make the shards hybrid proclets, to run code next to their elements
    /// ([`ShardedVec::offload`]); see [`AutoSharder::hybridize`].
    pub fn hybridize(&self) -> Result<(), ShardError> {
        self.sharder.hybridize()
    }

    /// Make the shards plain memory proclets again.
    pub fn dehybridize(&self) -> Result<(), ShardError> {
        self.sharder.dehybridize()
    }

    /// Run `f(&arg, first_index, elements)` next to every shard's elements, in index
    /// order; only the results travel.
    pub fn offload<A, R, F>(&self, arg: A, f: F) -> Result<Vec<R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&A, u64, &[T]) -> R + Copy + Send + Sync + 'static,
    {
        // The wrapper captures only `f`, itself a capture-less (zero-sized) closure, so it
        // is zero-sized too and travels as code like any shipped closure.
        self.sharder
            .offload(arg, move |s: &VecShard<T>, a: A| f(&a, s.start, &s.items))
    }
}

/// An iterator over a sealed [`ShardedVec`] that prefetches blocks in the background.
pub struct VecIter<T: Element> {
    rx: std::sync::mpsc::Receiver<Result<Vec<T>, ShardError>>,
    current: std::vec::IntoIter<T>,
    done: bool,
    _fetcher: Option<std::thread::JoinHandle<()>>,
}

impl<T: Element> VecIter<T> {
    fn start(
        v: ShardedVec<T>,
        range: std::ops::Range<u64>,
        block: usize,
        depth: usize,
    ) -> Result<Self, ShardError> {
        // Blocks are fetched by a thread of their own with up to `depth` calls in flight,
        // delivered in order through a channel that holds at most `depth` blocks.
        let (tx, rx) = std::sync::mpsc::sync_channel(depth);
        // The fetcher acts through the caller's cluster.
        let ctx = granule_runtime::thread_context();
        let h = std::thread::Builder::new()
            .name("granule-vec-prefetch".into())
            .spawn(move || {
                ctx.enter();
                // Ahead of its consumer, this thread gains nothing by spinning for replies,
                // and would take the CPU from the consumer where they share one.
                granule_runtime::set_spin(false);
                fetch_blocks(&v, range, block, depth, &tx)
            })
            .map_err(|e| ShardError::Stuck(format!("cannot start the prefetch thread: {e}")))?;
        Ok(VecIter {
            rx,
            current: Vec::new().into_iter(),
            done: false,
            _fetcher: Some(h),
        })
    }
}

/// Fetch `range` in blocks, up to `depth` in flight, in order.
fn fetch_blocks<T: Element>(
    v: &ShardedVec<T>,
    range: std::ops::Range<u64>,
    block: usize,
    depth: usize,
    tx: &std::sync::mpsc::SyncSender<Result<Vec<T>, ShardError>>,
) {
    use futures::stream::{FuturesOrdered, StreamExt};
    let len = range.end;
    let starts = range.step_by(block);
    let fetch = |from: u64| {
        let to = (from + block as u64).min(len);
        let v = v.clone();
        async move { v.read_range_async(from, to).await }
    };
    granule_runtime::block_on(async {
        let mut starts = starts.peekable();
        let mut inflight = FuturesOrdered::new();
        while inflight.len() < depth {
            match starts.next() {
                Some(s) => inflight.push_back(fetch(s)),
                None => break,
            }
        }
        while let Some(r) = inflight.next().await {
            let failed = r.is_err();
            if tx.send(r).is_err() || failed {
                return;
            }
            if let Some(s) = starts.next() {
                inflight.push_back(fetch(s));
            }
        }
    });
}

impl<T: Element> Iterator for VecIter<T> {
    type Item = Result<T, ShardError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(x) = self.current.next() {
                return Some(Ok(x));
            }
            if self.done {
                return None;
            }
            match self.rx.recv() {
                Ok(Ok(block)) => self.current = block.into_iter(),
                Ok(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                Err(_) => {
                    self.done = true;
                    return None;
                }
            }
        }
    }
}

/// Batching mode's writer for a [`ShardedVec`]: see [`Pusher`]. Each batch lands
/// contiguously at the tail.
pub type VecPusher<T> = Pusher<T>;

impl<T: Element> ShardedVec<T> {
    /// An empty vector in batching mode's bounds (shards of at most 32 MiB); push to it
    /// through [`ShardedVec::pusher`].
    pub fn batching() -> Result<Self, ShardError> {
        Self::with_bounds(Bounds::BATCHING)
    }

    /// A batching pusher: batches of about `batch_bytes`, up to `in_flight` sent at once.
    pub fn pusher(&self, batch_bytes: u64, in_flight: usize) -> Result<VecPusher<T>, ShardError> {
        Pusher::start(
            self.sharder.clone(),
            batch_bytes,
            in_flight,
            |_: &T| TAIL,
            |s: &mut VecShard<T>, vs: Vec<T>| {
                s.bytes += vs.iter().map(|x| x.footprint()).sum::<u64>();
                s.items.extend(vs);
            },
        )
    }
}

/// One shard of a sealed [`ShardedVec`]: elements `start..start + len` (see
/// [`ShardedVec::parts`]).
pub struct VecPart<T: Element> {
    /// Index of its first element.
    pub start: u64,
    /// Elements it holds.
    pub len: u64,
    shard: crate::parts::SealedShard<VecShard<T>>,
}

impl<T: Element> VecPart<T> {
    /// The node holding it now.
    pub fn location(&self) -> Result<granule_runtime::NodeId, ShardError> {
        self.shard.location()
    }

    /// Run `f(&arg, first_index, elements)` on it as an ordinary shared call.
    pub fn read_async<A, R, F>(
        &self,
        arg: A,
        f: F,
    ) -> impl std::future::Future<Output = Result<R, ShardError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&A, u64, &[T]) -> R + Copy + Send + Sync + 'static,
    {
        self.shard
            .read_async(arg, move |s: &VecShard<T>, a: A| f(&a, s.start, &s.items))
    }

    /// Run `f(&arg, first_index, elements)` next to it as a pushed call (on its node's
    /// pushdown pool).
    pub fn push_async<A, R, F>(
        &self,
        opts: granule_runtime::PushOpts,
        arg: A,
        f: F,
    ) -> impl std::future::Future<Output = Result<R, ShardError>> + Send + 'static
    where
        A: Wire,
        R: Wire,
        F: Fn(&A, u64, &[T]) -> R + Copy + Send + Sync + 'static,
    {
        self.shard
            .push_async(opts, arg, move |s: &VecShard<T>, a: A| {
                f(&a, s.start, &s.items)
            })
    }
}

impl<T: Element> ShardedVec<T> {
    /// The shards of a sealed vector, in index order, for calls to one at a time (an
    /// executor deciding per shard where to compute). Fails with
    /// [`ShardError::NotSealed`] otherwise.
    pub fn parts(&self) -> Result<Vec<VecPart<T>>, ShardError> {
        let mut out = Vec::new();
        for shard in self.sharder.sealed_shards()? {
            let (start, len) =
                shard.read((), |s: &VecShard<T>, ()| (s.start, s.items.len() as u64))?;
            out.push(VecPart { start, len, shard });
        }
        Ok(out)
    }

    /// [`ShardedVec::offload`] as pushed calls: `f` runs on each shard node's pushdown
    /// pool (bounded, CPU-capped, with `opts`' memory budget and timeout) instead of the
    /// thread that receives the call. The vector must be sealed.
    pub fn offload_pushed<A, R, F>(
        &self,
        opts: granule_runtime::PushOpts,
        arg: A,
        f: F,
    ) -> Result<Vec<R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&A, u64, &[T]) -> R + Copy + Send + Sync + 'static,
    {
        let calls: Vec<_> = self
            .parts()?
            .iter()
            .map(|p| p.push_async(opts, arg.clone(), f))
            .collect();
        granule_runtime::block_on(futures::future::join_all(calls))
            .into_iter()
            .collect()
    }
}
