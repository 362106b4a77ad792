//! Sinks: where a job's output goes when it should not come back to the job's driver.
//! This module owns the [`Sink`] trait, its two targets ([`ShardedVec`]: append;
//! [`ShardedMap`]: insert), the *shelves* that keep a vector sink's output on the nodes
//! that computed it, the check that every accepted call's output is still there, the
//! commit of a job's output once the job is done, and [`SinkSummary`]. The workers' side
//! (staging what a work call computed) is in `worker`; the structures' storage and their
//! staged writes are `granule-sharded`'s.
//!
//! Exactly once, whatever workers are lost: a worker *stages* the output of every work
//! call, tagged with the call's id, before it replies; the coordinator accepts exactly
//! one call per input range (a range whose worker was lost is computed again by a new
//! call, with a new id); when the job is done the sink *commits* the accepted calls'
//! output and drops the rest. Staging is invisible to readers and idempotent, so a call
//! whose worker died before, during or after staging costs only its recomputation.
//!
//! Where the staged output lives decides what a dead node costs:
//! - Into a map, output is staged in the target map's own shards (next to the keys it
//!   will land on) and committed there, one call per shard, each key merged once
//!   ([`ShardedMap::stage`], [`ShardedMap::commit_staged`]). Staged bytes count in a
//!   shard's footprint, but a shard that staging grows past its upper bound splits
//!   *on its own node*: staging never spreads the target to nodes that held none of it,
//!   so a node that only ran workers can die at any moment and cost only recomputation.
//! - Into a vector, each work call's output is kept on a [`Shelf`]: a memory proclet on
//!   the node of the worker that computed it (one per node and job). A node that dies
//!   takes its shelf along: before committing, the job asks every shelf for the calls it
//!   should hold, and computes the ranges of the missing ones again (their output goes
//!   to shelves on live nodes). Then the shelves append their parts to the target, in
//!   input order, straight from their nodes, and are freed.
//!
//! Either way the job's coordinator sees counts only.

use crate::BatchError;
use granule_runtime::{CallError, Footprint, Kind, NodeId, Proclet, ProcletId, Wire};
use granule_sharded::{Element, MapKey, MapValue, ShardError, ShardedMap, ShardedVec};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// What a sink work call reports instead of its output: its id, how many outputs it
/// staged, and the shelf that keeps them (vector sinks; `None` when the output went to
/// the target's own shards, or there was none).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Put {
    pub call: u64,
    pub items: u64,
    pub shelf: Option<ProcletId>,
}

/// What a job that wrote into a structure did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SinkSummary {
    /// Input items the job went through.
    pub items: u64,
    /// Outputs the job produced (counted once per input item, however often an item was
    /// computed). Into a map, pairs of the same key from the items of one work call
    /// count once: a worker combines them before it writes.
    pub produced: u64,
    /// What the target took: elements appended to a vector, keys written to a map.
    pub written: u64,
    /// Input items computed again because the output they had staged was lost with a
    /// node (vector sinks: a shelf's node died after its calls were accepted).
    pub recomputed: u64,
}

mod private {
    pub trait Sealed {}
}

/// Why staging a work call's output failed.
#[derive(Debug)]
pub(crate) enum PutError {
    /// Where it was to be kept is gone (a shelf's node died): compute the range again
    /// elsewhere.
    Lost(String),
    /// Nothing a retry fixes (the target itself failed).
    Failed(String),
}

/// A structure a batch job can write its output into, from its workers: a
/// [`ShardedVec<U>`] (the output appended, in input order) or a
/// [`ShardedMap<K, V>`] for output `(K, V)` (each pair inserted; of pairs with the same
/// key, the one from the latest item in input order wins). Implemented for those two
/// only. See `Batch::map_into`.
pub trait Sink<U>: private::Sealed + 'static {
    /// What the workers write into (the target map itself; nothing for a vector, whose
    /// workers write to their shelves).
    #[doc(hidden)]
    type Stage: Wire + Clone + Sync;

    /// Whether the output is kept on shelves on the workers' nodes.
    #[doc(hidden)]
    const SHELVED: bool;

    /// Before the job: make the stage (and check the target takes output).
    #[doc(hidden)]
    fn open(&self) -> Result<Self::Stage, BatchError>;

    /// Where a shelved sink gathers its output before the commit: the node of the
    /// target's tail (`None` for sinks that are not shelved).
    #[doc(hidden)]
    fn home(&self) -> Result<Option<NodeId>, BatchError>;

    /// On a worker: stage the output of call `tag = (first input index, call id)`, on
    /// `shelf` when the sink is shelved. Returns the shelf used.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn put(
        stage: &Self::Stage,
        shelf: Option<&Proclet<Shelf>>,
        job: u64,
        tag: (u64, u64),
        items: Vec<U>,
    ) -> Result<Option<ProcletId>, PutError>;

    /// After the job: commit the output of the `accepted` calls, in input order (their
    /// first input index and report); what the target took.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn close(
        &self,
        stage: &Self::Stage,
        job: u64,
        accepted: &[(u64, Put)],
        shelves: &Shelves,
    ) -> Result<u64, BatchError>;

    /// After a failed job: drop what was staged (best effort).
    #[doc(hidden)]
    fn abort(&self, stage: &Self::Stage, job: u64);
}

// ---- shelves ---------------------------------------------------------------------------

/// A node's shelf for one job: the encoded output of the work calls computed there, by
/// (first input index, call id), until the job commits it. A memory proclet (the
/// pressure policy may move it, its parts with it).
#[derive(Serialize, Deserialize, Default)]
pub(crate) struct Shelf {
    /// (first input index, call id) → (outputs, their encoding as a `Vec<U>`).
    parts: BTreeMap<(u64, u64), (u64, Vec<u8>)>,
    bytes: u64,
}

impl Footprint for Shelf {
    fn footprint(&self) -> u64 {
        std::mem::size_of::<Self>() as u64 + self.bytes + 48 * self.parts.len() as u64
    }
}

impl Shelf {
    fn keep(&mut self, tag: (u64, u64), count: u64, bytes: Vec<u8>) {
        self.bytes += bytes.len() as u64;
        if let Some((_, old)) = self.parts.insert(tag, (count, bytes)) {
            self.bytes -= old.len() as u64;
        }
    }

    /// Of `tags`, those not kept here.
    fn missing(&self, tags: &[(u64, u64)]) -> Vec<(u64, u64)> {
        tags.iter()
            .filter(|t| !self.parts.contains_key(t))
            .copied()
            .collect()
    }
}

/// The shelves of a job, by proclet id, and the shelf on the target's node that
/// gathers the accepted output before the commit.
#[derive(Default)]
pub(crate) struct Shelves {
    by_id: HashMap<ProcletId, Proclet<Shelf>>,
    gathered: Option<Proclet<Shelf>>,
}

impl Shelves {
    pub fn add(&mut self, s: Proclet<Shelf>) {
        self.by_id.insert(s.id(), s);
    }

    pub fn extend(&mut self, other: Shelves) {
        self.by_id.extend(other.by_id);
    }

    /// Free every shelf (after the commit, or a failed job).
    pub fn destroy(self) {
        let all: Vec<Proclet<Shelf>> = self.by_id.into_values().chain(self.gathered).collect();
        granule_runtime::block_on(futures::future::join_all(all.into_iter().map(
            |s| async move {
                let _ = s.destroy_async().await;
            },
        )));
    }
}

/// Make a shelf on `node`.
pub(crate) async fn new_shelf(node: NodeId) -> Result<Proclet<Shelf>, CallError> {
    Proclet::builder(Kind::Memory)
        .on(node)
        .footprint()
        .group("batch shelf")
        .create_async((), |()| Shelf::default())
        .await
}

/// Largest batch of parts one forwarding call carries to the gathering shelf.
const FORWARD_BYTES: u64 = 8 << 20;

impl Shelves {
    /// Phase one of a vector sink's commit: bring the accepted calls' parts from the
    /// shelves on the workers' nodes to one shelf on `home` (the target's tail node),
    /// straight from shelf to shelf. Idempotent (parts are keyed by call), so a shelf
    /// lost on the way costs only its parts: returns the first input indices of the
    /// accepted calls whose parts the gathering shelf still lacks, to compute again.
    pub fn gather(
        &mut self,
        accepted: &[(u64, Put)],
        home: NodeId,
    ) -> Result<Vec<u64>, BatchError> {
        let dst = match &self.gathered {
            Some(d) => d.clone(),
            None => {
                // On the target's node, and left there: what it holds is the commit.
                let d = Proclet::builder(Kind::Memory)
                    .on(home)
                    .owner_placed()
                    .footprint()
                    .group("batch shelf")
                    .create((), |()| Shelf::default())?;
                self.gathered = Some(d.clone());
                d
            }
        };
        let wanted: Vec<(u64, u64)> = accepted
            .iter()
            .filter(|(_, p)| p.shelf.is_some())
            .map(|(s, p)| (*s, p.call))
            .collect();
        let lacking: Vec<(u64, u64)> = dst
            .run_ref(wanted.clone(), |s: &Shelf, t: Vec<(u64, u64)>| {
                s.missing(&t)
            })?;
        let lacking: std::collections::HashSet<(u64, u64)> = lacking.into_iter().collect();
        let mut by_shelf: BTreeMap<ProcletId, Vec<(u64, u64)>> = BTreeMap::new();
        for (start, p) in accepted {
            if let Some(id) = p.shelf.filter(|_| lacking.contains(&(*start, p.call))) {
                by_shelf.entry(id).or_default().push((*start, p.call));
            }
        }
        for (id, tags) in by_shelf {
            let Some(src) = self.by_id.get(&id) else {
                continue;
            };
            let sent = src.run_ref(
                (tags, dst.clone()),
                |s: &Shelf, (tags, dst): (Vec<(u64, u64)>, Proclet<Shelf>)| forward(s, &tags, &dst),
            );
            match sent {
                Ok(Ok(())) => {}
                // The shelf, or its node, is gone: what it did not send is computed again.
                Ok(Err(e)) => tracing::info!("shelf {id} could not hand its output on: {e}"),
                Err(e) if gone(&e) => tracing::info!("shelf {id} is lost ({e})"),
                Err(e) => return Err(BatchError::Call(e)),
            }
        }
        let still: Vec<(u64, u64)> =
            dst.run_ref(wanted, |s: &Shelf, t: Vec<(u64, u64)>| s.missing(&t))?;
        Ok(still.into_iter().map(|(s, _)| s).collect())
    }
}

/// Runs on a shelf: send the parts of `tags` to `dst`, in batches of about
/// [`FORWARD_BYTES`].
fn forward(s: &Shelf, tags: &[(u64, u64)], dst: &Proclet<Shelf>) -> Result<(), String> {
    type Batch = Vec<((u64, u64), u64, Vec<u8>)>;
    let send = |batch: Batch| {
        dst.run(batch, |d: &mut Shelf, batch: Batch| {
            for (tag, count, bytes) in batch {
                d.keep(tag, count, bytes);
            }
        })
        .map_err(|e| e.to_string())
    };
    let mut batch: Batch = Vec::new();
    let mut bytes = 0u64;
    for tag in tags {
        let Some((count, part)) = s.parts.get(tag) else {
            return Err(format!("the output of call {} is not on its shelf", tag.1));
        };
        bytes += part.len() as u64;
        batch.push((*tag, *count, part.clone()));
        if bytes >= FORWARD_BYTES {
            send(std::mem::take(&mut batch))?;
            bytes = 0;
        }
    }
    if !batch.is_empty() {
        send(batch)?;
    }
    Ok(())
}

/// Whether a call's error means its proclet is gone with its node (what recomputation
/// fixes), rather than a failure no retry can fix.
pub(crate) fn gone(e: &CallError) -> bool {
    matches!(
        e,
        CallError::NodeUnreachable { .. } | CallError::ProcletGone(_) | CallError::Timeout(_)
    )
}

// ---- vector sinks ----------------------------------------------------------------------

/// Items per append to the target vector.
const APPEND_ITEMS: usize = 4096;

impl<U: Element> private::Sealed for ShardedVec<U> {}

impl<U: Element> Sink<U> for ShardedVec<U> {
    type Stage = ();

    const SHELVED: bool = true;

    fn open(&self) -> Result<(), BatchError> {
        if self.sharder().is_sealed()? {
            return Err(BatchError::Data(ShardError::Sealed));
        }
        Ok(())
    }

    fn home(&self) -> Result<Option<NodeId>, BatchError> {
        let shards = self.sharder().shards()?;
        let Some((_, tail)) = shards.last() else {
            return Ok(None);
        };
        Ok(Some(tail.location()?))
    }

    #[allow(private_interfaces)]
    fn put(
        _: &(),
        shelf: Option<&Proclet<Shelf>>,
        _job: u64,
        tag: (u64, u64),
        items: Vec<U>,
    ) -> Result<Option<ProcletId>, PutError> {
        if items.is_empty() {
            return Ok(None);
        }
        let Some(shelf) = shelf else {
            return Err(PutError::Failed(
                "internal: a vector sink's worker has no shelf".into(),
            ));
        };
        let count = items.len() as u64;
        let bytes = postcard::to_allocvec(&items)
            .map_err(|e| PutError::Failed(format!("encoding the output: {e}")))?;
        match shelf.run(
            (tag, count, bytes),
            |s: &mut Shelf, (tag, count, bytes): ((u64, u64), u64, Vec<u8>)| {
                s.keep(tag, count, bytes)
            },
        ) {
            Ok(()) => Ok(Some(shelf.id())),
            Err(e) if gone(&e) => Err(PutError::Lost(format!("keeping the output: {e}"))),
            Err(e) => Err(PutError::Failed(format!("keeping the output: {e}"))),
        }
    }

    #[allow(private_interfaces)]
    fn close(
        &self,
        _: &(),
        _job: u64,
        accepted: &[(u64, Put)],
        shelves: &Shelves,
    ) -> Result<u64, BatchError> {
        // Phase two: the gathering shelf, on the target's node, appends every accepted
        // part in input order.
        let tags: Vec<(u64, u64)> = accepted
            .iter()
            .filter(|(_, p)| p.shelf.is_some())
            .map(|(s, p)| (*s, p.call))
            .collect();
        if tags.is_empty() {
            return Ok(0);
        }
        let Some(home) = &shelves.gathered else {
            return Err(BatchError::Worker(
                "internal: the output was not gathered before the commit".into(),
            ));
        };
        let failed = |e: String| {
            BatchError::Worker(format!(
                "appending the output to the target vector failed part-way: {e}"
            ))
        };
        home.run_ref(
            (tags, self.clone()),
            |s: &Shelf, (tags, target): (Vec<(u64, u64)>, ShardedVec<U>)| {
                append_parts(s, &tags, &target)
            },
        )
        .map_err(|e| failed(e.to_string()))?
        .map_err(failed)
    }

    fn abort(&self, _: &(), _job: u64) {}
}

/// Runs on a shelf: append the parts of `tags` (in input order) to `target`.
fn append_parts<U: Element>(
    s: &Shelf,
    tags: &[(u64, u64)],
    target: &ShardedVec<U>,
) -> Result<u64, String> {
    let mut n = 0;
    let mut batch: Vec<U> = Vec::new();
    for tag in tags {
        let Some((_, bytes)) = s.parts.get(tag) else {
            return Err(format!("the output of call {} is not on its shelf", tag.1));
        };
        let part: Vec<U> =
            postcard::from_bytes(bytes).map_err(|e| format!("decoding a kept part: {e}"))?;
        batch.extend(part);
        if batch.len() >= APPEND_ITEMS {
            n += batch.len() as u64;
            target
                .extend(std::mem::take(&mut batch))
                .map_err(|e| e.to_string())?;
        }
    }
    if !batch.is_empty() {
        n += batch.len() as u64;
        target.extend(batch).map_err(|e| e.to_string())?;
    }
    Ok(n)
}

// ---- map sinks -------------------------------------------------------------------------

impl<K: MapKey, V: MapValue + Clone> private::Sealed for ShardedMap<K, V> {}

impl<K: MapKey, V: MapValue + Clone> Sink<(K, V)> for ShardedMap<K, V> {
    type Stage = ShardedMap<K, V>;

    const SHELVED: bool = false;

    fn open(&self) -> Result<ShardedMap<K, V>, BatchError> {
        Ok(self.clone())
    }

    fn home(&self) -> Result<Option<NodeId>, BatchError> {
        Ok(None)
    }

    #[allow(private_interfaces)]
    fn put(
        stage: &ShardedMap<K, V>,
        _: Option<&Proclet<Shelf>>,
        job: u64,
        tag: (u64, u64),
        items: Vec<(K, V)>,
    ) -> Result<Option<ProcletId>, PutError> {
        // The latest item of the call wins within it, as the commit makes the latest
        // call win across calls.
        let last: BTreeMap<K, V> = items.into_iter().collect();
        stage
            .stage(last.into_iter().map(|(k, v)| (job, k, tag, v)).collect())
            .map(|()| None)
            .map_err(|e| PutError::Failed(format!("staging in the target map: {e}")))
    }

    #[allow(private_interfaces)]
    fn close(
        &self,
        _: &ShardedMap<K, V>,
        job: u64,
        accepted: &[(u64, Put)],
        _: &Shelves,
    ) -> Result<u64, BatchError> {
        let ids = accepted.iter().map(|(_, p)| p.call).collect();
        Ok(self.commit_staged(job, ids, overwrite::<V>)?)
    }

    fn abort(&self, _: &ShardedMap<K, V>, job: u64) {
        if let Err(e) = self.discard_staged(job) {
            tracing::warn!("dropping a failed job's staged output: {e}");
        }
    }
}

/// The merge of a map sink: the later value wins.
fn overwrite<V>(old: &mut V, new: V) {
    *old = new;
}

/// A job id, unique among the jobs writing into the same structure at once: staged
/// output is kept apart by it.
pub(crate) fn new_job_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = nanos
        ^ (u64::from(std::process::id()) << 40)
        ^ NEXT.fetch_add(1, Ordering::Relaxed).rotate_left(20);
    // splitmix64: spreads ids made close together in time.
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shelf_keeps_parts_once_and_names_what_it_lacks() {
        let mut s = Shelf::default();
        s.keep((0, 9), 2, vec![1, 2, 3]);
        s.keep((50, 5), 1, vec![4]);
        // A call's output sent twice (a resent request) replaces the first copy.
        s.keep((0, 9), 2, vec![1, 2, 3]);
        assert_eq!(s.bytes, 4);
        assert_eq!(s.missing(&[(0, 9), (50, 4), (50, 5)]), vec![(50, 4)]);
    }

    #[test]
    fn job_ids_differ() {
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| new_job_id()).collect();
        assert_eq!(ids.len(), 1000);
    }
}
