//! Sinks: where a job's output goes when it should not come back to the job's driver.
//! This module owns the [`Sink`] trait, its two targets ([`ShardedVec`]: append;
//! [`ShardedMap`]: insert), the commit of a job's output once the job is done, and
//! [`SinkSummary`]. The workers' side (staging what a work call computed) is in
//! `worker`; the structures' storage and their staged writes are `granule-sharded`'s.
//!
//! Exactly once, whatever workers are lost: a worker *stages* the output of every work
//! call, tagged with the call's id, before it replies; the coordinator accepts exactly
//! one call per input range (a range whose worker was lost is computed again by a new
//! call, with a new id); when the job is done the sink *commits* the accepted calls'
//! output and drops the rest. Staging is invisible to readers and idempotent, so a call
//! whose worker died before, during or after staging costs only its recomputation.
//!
//! - Into a map, output is staged in the target map's own shards (next to the keys it
//!   will land on) and committed there, one call per shard, each key merged once
//!   ([`ShardedMap::stage`], [`ShardedMap::commit_staged`]).
//! - Into a vector, output is staged in a private map keyed by input position, then each
//!   of its shards appends its accepted part to the target, in input order, straight
//!   from its node; the private map is freed.
//!
//! Either way the job's coordinator sees counts only.

use crate::BatchError;
use granule_runtime::Wire;
use granule_sharded::{Element, MapKey, MapValue, ShardError, ShardedMap, ShardedVec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What a sink work call reports instead of its output: its id and how many outputs it
/// staged.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Put {
    pub call: u64,
    pub items: u64,
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
}

mod private {
    pub trait Sealed {}
}

/// A structure a batch job can write its output into, from its workers: a
/// [`ShardedVec<U>`] (the output appended, in input order) or a
/// [`ShardedMap<K, V>`] for output `(K, V)` (each pair inserted; of pairs with the same
/// key, the one from the latest item in input order wins). Implemented for those two
/// only. See `Batch::map_into`.
pub trait Sink<U>: private::Sealed + 'static {
    /// What the workers write into (the target itself, or a staging structure).
    #[doc(hidden)]
    type Stage: Wire + Clone + Sync;

    /// Before the job: make the stage.
    #[doc(hidden)]
    fn open(&self) -> Result<Self::Stage, BatchError>;

    /// On a worker: stage the output of call `tag = (first input index, call id)`.
    #[doc(hidden)]
    fn put(stage: &Self::Stage, job: u64, tag: (u64, u64), items: Vec<U>)
        -> Result<(), ShardError>;

    /// After the job: commit the output of the `accepted` calls (ids); what the target
    /// took.
    #[doc(hidden)]
    fn close(&self, stage: &Self::Stage, job: u64, accepted: Vec<u64>) -> Result<u64, BatchError>;

    /// After a failed job: drop what was staged (best effort).
    #[doc(hidden)]
    fn abort(&self, stage: &Self::Stage, job: u64);
}

/// Staged vector output: (first input index of the call, call id, part), in input order.
type VecStage<U> = ShardedMap<(u64, u64, u32), Vec<U>>;

/// Items per staged part of a vector's output (a call's output may be large; parts let
/// the staging map split).
const PART_ITEMS: usize = 4096;
/// Items per append to the target vector.
const APPEND_ITEMS: usize = 4096;

impl<U: Element> private::Sealed for ShardedVec<U> {}

impl<U: Element> Sink<U> for ShardedVec<U> {
    type Stage = VecStage<U>;

    fn open(&self) -> Result<VecStage<U>, BatchError> {
        if self.sharder().is_sealed()? {
            return Err(BatchError::Data(ShardError::Sealed));
        }
        Ok(ShardedMap::batching()?)
    }

    fn put(
        stage: &VecStage<U>,
        _job: u64,
        (start, call): (u64, u64),
        items: Vec<U>,
    ) -> Result<(), ShardError> {
        let mut parts = Vec::new();
        let mut items = items.into_iter().peekable();
        let mut part = 0u32;
        while items.peek().is_some() {
            let chunk: Vec<U> = items.by_ref().take(PART_ITEMS).collect();
            parts.push(((start, call, part), chunk));
            part += 1;
        }
        stage.insert_many(parts).map(|_| ())
    }

    fn close(&self, stage: &VecStage<U>, _job: u64, accepted: Vec<u64>) -> Result<u64, BatchError> {
        // Sealed, the staging map's shards stay put: each is visited exactly once, in
        // key order, so the appends happen once each and in input order.
        stage.sharder().seal()?;
        let appended = stage.visit_sealed(
            (accepted, self.clone()),
            |(accepted, target): &(Vec<u64>, ShardedVec<U>),
             parts: &BTreeMap<(u64, u64, u32), Vec<U>>|
             -> Result<u64, String> { append_accepted(accepted, target, parts) },
        );
        let _ = stage.destroy();
        let mut total = 0;
        for r in appended? {
            total += r.map_err(|e| {
                BatchError::Worker(format!(
                    "appending the output to the target vector failed part-way: {e}"
                ))
            })?;
        }
        Ok(total)
    }

    fn abort(&self, stage: &VecStage<U>, _job: u64) {
        let _ = stage.destroy();
    }
}

/// Runs next to a staging shard: append the accepted calls' parts (sorted ids) to
/// `target`, in key (input) order.
fn append_accepted<U: Element>(
    accepted: &[u64],
    target: &ShardedVec<U>,
    parts: &BTreeMap<(u64, u64, u32), Vec<U>>,
) -> Result<u64, String> {
    let mut n = 0;
    let mut batch: Vec<U> = Vec::new();
    for part in accepted_parts(accepted, parts) {
        batch.extend(part.iter().cloned());
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

/// The staged parts of the accepted calls (`accepted` sorted), in input order.
fn accepted_parts<'a, U>(
    accepted: &'a [u64],
    parts: &'a BTreeMap<(u64, u64, u32), Vec<U>>,
) -> impl Iterator<Item = &'a Vec<U>> + 'a {
    parts
        .iter()
        .filter(|((_, call, _), _)| accepted.binary_search(call).is_ok())
        .map(|(_, part)| part)
}

impl<K: MapKey, V: MapValue + Clone> private::Sealed for ShardedMap<K, V> {}

impl<K: MapKey, V: MapValue + Clone> Sink<(K, V)> for ShardedMap<K, V> {
    type Stage = ShardedMap<K, V>;

    fn open(&self) -> Result<ShardedMap<K, V>, BatchError> {
        Ok(self.clone())
    }

    fn put(
        stage: &ShardedMap<K, V>,
        job: u64,
        tag: (u64, u64),
        items: Vec<(K, V)>,
    ) -> Result<(), ShardError> {
        // The latest item of the call wins within it, as the commit makes the latest
        // call win across calls.
        let last: BTreeMap<K, V> = items.into_iter().collect();
        stage.stage(last.into_iter().map(|(k, v)| (job, k, tag, v)).collect())
    }

    fn close(&self, _: &ShardedMap<K, V>, job: u64, accepted: Vec<u64>) -> Result<u64, BatchError> {
        Ok(self.commit_staged(job, accepted, overwrite::<V>)?)
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
    fn only_accepted_calls_parts_are_appended_in_input_order() {
        // Calls 9 (input 0..), 2 (input 100..) and 5 (input 50..) were accepted; call 4
        // covered 50.. too but its worker was lost after staging.
        let mut parts: BTreeMap<(u64, u64, u32), Vec<u64>> = BTreeMap::new();
        parts.insert((100, 2, 0), vec![100, 101]);
        parts.insert((0, 9, 0), vec![0, 1]);
        parts.insert((0, 9, 1), vec![2]);
        parts.insert((50, 4, 0), vec![50, 50, 50]);
        parts.insert((50, 5, 0), vec![50]);
        let accepted = [2, 5, 9];
        let got: Vec<u64> = accepted_parts(&accepted, &parts)
            .flatten()
            .copied()
            .collect();
        assert_eq!(got, vec![0, 1, 2, 50, 100, 101]);
    }

    #[test]
    fn job_ids_differ() {
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| new_job_id()).collect();
        assert_eq!(ids.len(), 1000);
    }
}
