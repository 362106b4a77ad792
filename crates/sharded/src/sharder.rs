//! [`AutoSharder`]: key ranges kept in memory proclets (*shards*) that split when they grow
//! past an upper bound and merge when they shrink under a lower one, and the map from key
//! ranges to shards.
//!
//! **The map** lives in a mapping proclet as an append-only log of changes (`Set` a range's
//! shard, `Remove` a range), its length being the map's version. Every client caches the
//! map and catches up from its version when a shard answers that a key is not its own
//! (stale). The controller only knows where proclets are, never the key ranges. The
//! table, its compacted log, the clients' cache and the routing loop are
//! `granule-router`'s ([`granule_router::Router`]); this module owns the shards: their
//! ranges, the split and merge steps, and what a shard answers a routed call. Shards
//! split and merge by bytes held ([`Bounds`], the router's bytes-held trigger).
//!
//! **Every shard knows its own range** `[lo, hi)`, and serves a key only inside it, so a
//! stale cache can cost a retry, never a wrong answer.
//!
//! **Splitting** (the shard over its upper bound) runs in three steps, none of which
//! blocks readers for more than an in-memory split:
//! 1. *Begin* (exclusive, in memory): the shard's data splits; the upper part is kept in
//!    the shard as *pending* and the shard's own range ends at the split key. Reads of
//!    the split-off keys are served from pending; writes to them answer *busy*.
//! 2. *Publish* (shared: reads go on): on the shard's node, a new shard is created from a
//!    copy of pending, *frozen* (reads only, since its parent still holds a copy), and the
//!    mapping proclet records it — only if no other client did so first (the loser
//!    destroys its copy).
//! 3. *Finish*: the parent drops pending, then the new shard thaws.
//!    A client that dies between steps leaves a shard that answers busy; the next client
//!    that keeps getting busy finishes the steps itself (every step is idempotent).
//!
//! **Merging** (a shard under its lower bound) always runs on the left shard of a pair,
//! in one exclusive call, and hands data over so that a lost answer loses nothing:
//! 1. *Hand over* (a nested call on the right shard): the right shard marks itself as
//!    handing its range over to the left one — from then on it serves nothing and sends
//!    callers there — and answers with a *copy* of its data (encoded: `Shard` needs no
//!    `Clone`), keeping the data itself. Repeatable: asked again by the same left shard,
//!    it hands the same copy.
//! 2. *Take*: the left shard adds the copy, extends its range, and notes which shard it
//!    took (`took_from`).
//! 3. *Complete*: the map forgets the right shard, which is then freed; then the note
//!    goes. Until the note goes the left shard takes no other merge and is not merged
//!    or dropped itself.
//!
//! A merge whose author fails, or never hears an answer (a connection cut, the
//! `call.before_reply` failpoint), leaves a right shard handing over. Whoever meets it
//! (a routed call sent on to the left shard, a scan, a resize, a seal) settles it by
//! asking the left shard, in an exclusive call there — so after the merge call and
//! before any later one, and its answer is final: if its note names the right shard, it
//! took it, and the merge is completed; if not, it did not and cannot while the call
//! holds it, and the right shard thaws and serves its range again. A left shard gone
//! (freed only once its notes are cleared, so it took nothing, or lost with its node)
//! is settled from the map. The empty first shard's *drop* into its right neighbour
//! ([`AutoSharder::drop_empty_first`], no data moves) is made repeatable the same way:
//! the first shard stops serving before it asks its neighbour to take its range, and a
//! lost answer is settled by asking again. Lock order is always left then right, so
//! concurrent merges and settlements cannot deadlock. Readers of the two shards wait for
//! a merge (milliseconds; merges happen only to shards smaller than the lower bound).
//!
//! Shards are ordinary proclets: the controller places them and the pressure policy moves
//! them; a moved shard is reached through the runtime's forwarding, without the map.
//!
//! **Placement.** The mapping proclet, the first shard and every shard a split creates
//! are placed by the controller as any new memory proclet is (hybrid shards as hybrid
//! ones): among the nodes with room for it (and, if any, not under memory pressure), those
//! whose free memory is within 5 % of the largest node's memory of the roomiest one, the
//! one with the fewest such proclets placed so far. So a structure's shards spread over
//! the nodes that have room rather than piling up where the first one was, and losing one
//! node loses only the shards it held (nothing is replicated yet). A split's new half is
//! therefore usually created on another node: its bytes cross the network once, during
//! the split. Under memory pressure the pressure policy moves shards on from there. One
//! exception: a shard whose data asks for it ([`Shard::splits_stay_home`]: a map shard
//! holding a batch job's staged output) splits on its own node, so that a job's staging
//! never spreads the structure to nodes that held none of it.

use crate::ShardError;
pub use granule_router::Bounds;
use granule_router::{
    pause, Answer, Change, ChangeLog, MapState, Outcome, Retry, RetryPolicy, Router, Step, Trigger,
};
use granule_runtime::{CallError, Footprint, Kind, Proclet, ProcletState, Wire};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a shard of a sharded structure must do.
pub trait Shard: ProcletState + Default {
    /// The keys that route to shards.
    type Key: Ord + Clone + Wire + Sync + fmt::Debug;

    /// Split off an upper part: the first key of the new shard, and the new shard (all
    /// keys ≥ that key leave `self`). `None` if the shard cannot split (too few keys).
    fn split(&mut self) -> Option<(Self::Key, Self)>;

    /// Take in the right neighbour's contents (all its keys are above this shard's).
    fn merge(&mut self, right: Self);

    /// Bytes this shard holds (cheap: kept up to date, not recomputed).
    fn footprint(&self) -> u64;

    /// Whether the shard holds nothing (an empty first shard can be dropped without
    /// moving data: see [`AutoSharder::drop_empty_first`]).
    fn is_empty(&self) -> bool {
        self.footprint() == 0
    }

    /// Whether a part split off this shard must stay on the shard's node rather than go
    /// where the controller places new proclets: a map shard holding a batch job's
    /// staged output says so, so that staging never spreads the structure to nodes that
    /// held none of it (a node that only ran the job's workers must be able to die
    /// without taking any of the target along).
    fn splits_stay_home(&self) -> bool {
        false
    }
}

/// What a routed operation may change, so the router knows what to check afterwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hint {
    /// Neither grows nor shrinks the shard.
    Same,
    /// May grow it (check for a split).
    Grow,
    /// May shrink it (check for a merge).
    Shrink,
    /// May do either.
    Any,
}

// ----- the shard proclet's state -----------------------------------------------------

/// Keys `[lo, hi)`; `None` is −∞ for `lo` and +∞ for `hi`.
fn in_range<K: Ord>(k: &K, lo: &Option<K>, hi: &Option<K>) -> bool {
    lo.as_ref().is_none_or(|l| k >= l) && hi.as_ref().is_none_or(|h| k < h)
}

/// An upper part split off, not yet published as a shard of its own.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
struct Pending<S: Shard> {
    lo: S::Key,
    hi: Option<S::Key>,
    data: S,
}

/// The state of a shard proclet: the user's shard and its place in the structure.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Cell<S: Shard> {
    lo: Option<S::Key>,
    hi: Option<S::Key>,
    data: S,
    pending: Option<Pending<S>>,
    /// Set on a shard just split off while its parent may still hold a copy: no writes.
    frozen_by: Option<Proclet<Cell<S>>>,
    /// Handing its range over to that neighbour: into its left one (a merge; this shard's
    /// range starts at a key) or, the empty first shard, into its right one (a drop; its
    /// range starts at −∞). It serves nothing and sends callers there, but keeps its data
    /// until the hand-over is known to be complete, so one whose answer was lost can be
    /// repeated, finished or undone ([`AutoSharder::settle_handover`]).
    handing_to: Option<Proclet<Cell<S>>>,
    /// Took a copy of that right neighbour's data and range (which started at that key)
    /// in a merge that is complete once the map no longer names it and it is freed
    /// ([`finish_took`]). Until then this shard takes no other, nor hands itself over:
    /// this is what tells whoever meets the right shard, still handing over, that its
    /// range was taken.
    took_from: Option<(S::Key, Proclet<Cell<S>>)>,
    /// No writes, no splits, no merges (a sealed structure).
    sealed: bool,
}

impl<S: Shard> Cell<S> {
    fn new(lo: Option<S::Key>, hi: Option<S::Key>, data: S) -> Cell<S> {
        Cell {
            lo,
            hi,
            data,
            pending: None,
            frozen_by: None,
            handing_to: None,
            took_from: None,
            sealed: false,
        }
    }

    fn covers(&self, k: &S::Key) -> bool {
        self.handing_to.is_none() && in_range(k, &self.lo, &self.hi)
    }

    fn pending_covers(&self, k: &S::Key) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|p| in_range(k, &Some(p.lo.clone()), &p.hi))
    }

    /// A merge's first step, on its right shard: if its range still starts at `lo` (the
    /// left shard's end) and it is in the middle of no other change, it hands its range
    /// over to `into` — it serves nothing from now on — and a copy of its data, keeping
    /// the data itself. Repeatable: a second call for the same `into` (the first one's
    /// answer lost) hands the same copy again, since nothing was written meanwhile.
    /// `None`: it cannot now. A merge of its own not yet complete (`took_from`) is
    /// finished by the caller first ([`finish_took`]).
    fn hand_over(
        &mut self,
        lo: &S::Key,
        into: &Proclet<Cell<S>>,
    ) -> Result<Option<Handed<S::Key>>, String> {
        if self.lo.as_ref() != Some(lo)
            || self.pending.is_some()
            || self.frozen_by.is_some()
            || self.took_from.is_some()
            || self.sealed
            || self.handing_to.as_ref().is_some_and(|t| t != into)
        {
            return Ok(None);
        }
        // `Shard` needs no `Clone`: its serialized form is the copy (as for a split).
        let bytes = postcard::to_allocvec(&self.data)
            .map_err(|e| format!("encoding the right shard's data: {e}"))?;
        self.handing_to = Some(into.clone());
        Ok(Some((self.hi.clone(), bytes)))
    }

    /// A merge's second step, on its left shard: take the copy `right` handed over, which
    /// begins where this shard's range ends, and remember the merge until it is complete
    /// ([`finish_took`]).
    fn take_handed(
        &mut self,
        right: Proclet<Cell<S>>,
        (hi, bytes): Handed<S::Key>,
    ) -> Result<(), String> {
        let Some(lo) = self.hi.clone() else {
            return Err("the last shard has no right neighbour to take".into());
        };
        // Decoded before anything changes: should it fail, this shard took nothing and
        // the right shard's hand-over is undone by the next client that meets it.
        let data: S = postcard::from_bytes(&bytes)
            .map_err(|e| format!("decoding the right shard's data: {e}"))?;
        self.data.merge(data);
        self.hi = hi;
        self.took_from = Some((lo, right));
        Ok(())
    }

    /// Undo a hand-over to `to` that nobody took: serve the range again. Whether it was
    /// handing over to `to`.
    fn thaw(&mut self, to: &Proclet<Cell<S>>) -> bool {
        if self.handing_to.as_ref() == Some(to) {
            self.handing_to = None;
            true
        } else {
            false
        }
    }

    /// A drop's step on the right neighbour of the empty first shard, whose range ends
    /// at `lo`: take over that range too (no data moves). Whether this shard's range now
    /// starts at −∞: extended now, or by an earlier try of the same drop whose answer
    /// was lost (nothing else extends a shard downwards, and the first shard takes
    /// nothing while it drops).
    fn extend_down(&mut self, lo: &S::Key) -> bool {
        if self.lo.is_none() {
            return true;
        }
        if self.lo.as_ref() != Some(lo) || self.handing_to.is_some() || self.frozen_by.is_some() {
            return false;
        }
        self.lo = None;
        true
    }
}

/// What a merge's right shard hands its left one: where its range ends, and a copy of
/// its data, encoded.
type Handed<K> = (Option<K>, Vec<u8>);

impl<S: Shard> Footprint for Cell<S> {
    fn footprint(&self) -> u64 {
        std::mem::size_of::<Self>() as u64
            + self.data.footprint()
            + self.pending.as_ref().map_or(0, |p| p.data.footprint())
    }
}

/// What a shard that ran a routed call hands back.
#[derive(Serialize, Deserialize)]
enum Reply<R> {
    /// The result, the shard's footprint (0 unless asked for), and whether the shard is
    /// the last one (its range open upwards).
    Done(R, u64, bool),
    /// The structure is sealed: no writes (nothing ran).
    Sealed,
}

/// What a shard answers a routed call: served (a [`Reply`]), stale (not this shard's
/// key: catch up with the map), busy (in the middle of a split: try again shortly), or
/// moved (merged away into that shard). The argument comes back whenever nothing ran.
type Routed<R, A, S> = Answer<Reply<R>, A, Proclet<Cell<S>>>;

/// A routed call's argument: the key, the caller's argument, and whether the footprint
/// is wanted back.
type Keyed<K, A> = (K, A, bool);

// ----- the mapping proclet's state ---------------------------------------------------

/// The mapping proclet: the map as a compacted log of changes
/// ([`granule_router::ChangeLog`]), and whether the structure is sealed.
///
/// Version `v` of the map is the state after its first `v` changes. Clients cache the map
/// and catch up by asking for the changes since their version; the log keeps only the
/// last ones (about as many as the map has shards), so a structure that splits and merges
/// for ever keeps a bounded log. A client further behind gets the whole current map
/// instead, which is no bigger than the changes it missed.
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct MapLog<S: Shard> {
    log: ChangeLog<S::Key, Proclet<Cell<S>>>,
    sealed: bool,
}

impl<S: Shard> MapState<S::Key, Proclet<Cell<S>>> for MapLog<S> {
    fn log(&self) -> &ChangeLog<S::Key, Proclet<Cell<S>>> {
        &self.log
    }
}

impl<S: Shard> Footprint for MapLog<S> {
    fn footprint(&self) -> u64 {
        self.log.footprint() + std::mem::size_of::<bool>() as u64
    }
}

/// A shard and where its range starts (`None`: −∞).
pub type Range<S> = (Option<<S as Shard>::Key>, Proclet<Cell<S>>);

/// Items bound for one shard: the shard, one item's key, the items.
type Group<S, I> = (Proclet<Cell<S>>, <S as Shard>::Key, Vec<I>);

/// A routed write's outcome: result, the shard's footprint, whether it is the last shard,
/// and the shard that answered.
type Answered<S, R> = (R, u64, bool, Proclet<Cell<S>>);

/// The router of a structure: its map's client.
type ShardRouter<S> = Router<MapLog<S>, <S as Shard>::Key, Proclet<Cell<S>>>;

// ----- the client --------------------------------------------------------------------

/// How a routed call retries: 30 s in all; a shard that stays busy 200 ms is presumed
/// abandoned mid-split by a client that died, and the caller finishes the split; waits
/// from 50 µs doubling to 5 ms.
const ROUTE: RetryPolicy = RetryPolicy::DEFAULT;

/// How a batch of writes retries the items shards turned away: as [`ROUTE`], but
/// polling every 200 µs (other shards' items are applied meanwhile).
const ROUTE_MANY: RetryPolicy = RetryPolicy {
    min_wait: Duration::from_micros(200),
    max_wait: Duration::from_micros(200),
    ..RetryPolicy::DEFAULT
};

/// The first wait before a shard this client failed to resize is tried again; it
/// doubles on every further failure, up to [`OWED_MAX_WAIT`]. Short: most failures are
/// a moment's (a call refused under load, a split the shard was busy with).
const OWED_MIN_WAIT: Duration = Duration::from_millis(1);

/// The longest wait between two tries of a shard this client keeps failing to resize:
/// a cause that lasts (no node with room for a new shard) costs writes one failed try a
/// second, not one each.
const OWED_MAX_WAIT: Duration = Duration::from_secs(1);

/// A shard this client failed to split or merge after a write, to try again: a key it
/// held, when to try next, and why the last try failed.
struct Owed<S: Shard> {
    key: S::Key,
    shard: Proclet<Cell<S>>,
    next: Instant,
    wait: Duration,
    why: String,
}

/// What the first step of a split found on the shard (see [`AutoSharder::split`]).
#[derive(Serialize, Deserialize)]
enum Begin<K> {
    /// Within its bounds, or it cannot split (sealed, merged away, too few keys).
    No,
    /// The split began at this key: the part from it on is pending.
    Began(K),
    /// Another client's split is under way on it: its part from this key on is pending,
    /// or (`None`) the shard is that split's new part, still frozen.
    Busy(Option<K>),
}

/// Key ranges → shards. Cheap to clone (clones share the cached map and the shards owed
/// a resize); serializable, so proclets on other nodes can use the same structure (they
/// start with an empty cache).
#[derive(Serialize, Deserialize)]
#[serde(bound = "")]
pub struct AutoSharder<S: Shard> {
    /// The map's client: the mapping proclet and the cached map.
    router: ShardRouter<S>,
    bounds: Bounds,
    /// Shards whose split or merge after a write failed (so they may stay out of their
    /// bounds): tried again by this client's later writes and by
    /// [`AutoSharder::settle`]. Not a mark in the shard: a shard a write grew past the
    /// bound is split again by any client's next write to it anyway (every write sees
    /// its footprint); what only the failing client knows of is a shard nobody writes
    /// to any more (a vector's old tail, the upper half of a split that went on).
    #[serde(skip)]
    owed: Arc<Mutex<Vec<Owed<S>>>>,
}

impl<S: Shard> Clone for AutoSharder<S> {
    fn clone(&self) -> Self {
        AutoSharder {
            router: self.router.clone(),
            bounds: self.bounds,
            owed: self.owed.clone(),
        }
    }
}

impl<S: Shard> fmt::Debug for AutoSharder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutoSharder")
            .field("map", &self.router.map().id())
            .field("bounds", &self.bounds)
            .finish()
    }
}

impl<S: Shard> AutoSharder<S> {
    /// A new structure: its mapping proclet and one empty shard covering every key.
    pub fn new(bounds: Bounds) -> Result<AutoSharder<S>, ShardError> {
        // The map first: its id names the structure, which every shard carries as its
        // group (what operators see shards summed by).
        let map = Proclet::builder(Kind::Memory)
            .footprint()
            .create((), |()| MapLog::<S> {
                log: ChangeLog::new(),
                sealed: false,
            })?;
        let first = match Proclet::builder(Kind::Memory)
            .footprint()
            .group(label_of::<S>(map.id()))
            .create((), |()| Cell::<S>::new(None, None, S::default()))
        {
            Ok(f) => f,
            Err(e) => {
                let _ = map.destroy();
                return Err(e.into());
            }
        };
        map.run(first, |m: &mut MapLog<S>, first: Proclet<Cell<S>>| {
            m.log.set_if_absent(None, first)
        })?;
        Ok(AutoSharder {
            router: Router::new(map),
            bounds,
            owed: Arc::default(),
        })
    }

    /// The size bounds.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// The mapping proclet.
    pub fn map_proclet(&self) -> &Proclet<MapLog<S>> {
        self.router.map()
    }

    fn map(&self) -> &Proclet<MapLog<S>> {
        self.router.map()
    }

    /// Bring the cached map up to date.
    pub fn refresh(&self) -> Result<(), ShardError> {
        Ok(self.router.refresh()?)
    }

    /// The map's latest version (changes made since it was created) and how many of the
    /// latest changes its log still holds (the rest were compacted away).
    pub fn log_extent(&self) -> Result<(usize, usize), ShardError> {
        let (version, kept) = self
            .map()
            .run_ref((), |m: &MapLog<S>, ()| (m.log.version(), m.log.kept()))?;
        Ok((usize::try_from(version).unwrap_or(usize::MAX), kept))
    }

    /// The map's version in this client's cache.
    pub fn cached_version(&self) -> usize {
        usize::try_from(self.router.cached_version()).unwrap_or(usize::MAX)
    }

    /// Every shard in key order, with the first key of its range (`None`: −∞), as of a
    /// fresh copy of the map.
    pub fn shards(&self) -> Result<Vec<Range<S>>, ShardError> {
        Ok(self.router.ranges()?)
    }

    /// Run `f(&mut shard, arg)` on the shard holding `key`, then split or merge it if the
    /// hint says it may have grown or shrunk past its bounds.
    ///
    /// The argument is cloned once per attempt (a shard merged away under the call does
    /// not hand it back).
    pub fn route<A, R, F>(&self, key: &S::Key, hint: Hint, arg: A, f: F) -> Result<R, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&mut S, A) -> R + Copy + Send + Sync + 'static,
    {
        self.route_with(key, hint, arg, f, |s: &mut S, a: A, f: &F| f(s, a))
    }

    /// [`AutoSharder::route`] for a structure's own wrapper `via` around its user's
    /// closure `f` (both capture nothing): `via(&mut shard, arg, &f)` runs on the shard.
    pub fn route_with<A, R, F, W>(
        &self,
        key: &S::Key,
        hint: Hint,
        arg: A,
        f: F,
        via: W,
    ) -> Result<R, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Copy + Send + Sync + 'static,
        W: Fn(&mut S, A, &F) -> R + Copy + Send + Sync + 'static,
    {
        let want = hint != Hint::Same;
        let (r, fp, _, shard) = self.route_mut_loop(key, arg, want, f, via)?;
        self.after(key, hint, &shard, fp);
        Ok(r)
    }

    /// [`AutoSharder::route_with`] that also says whether the answering shard was the
    /// last one (its range open upwards): what a queue needs to tell "this shard is
    /// drained" from "the structure is empty". Checks no bounds afterwards.
    pub fn route_with_last<A, R, F, W>(
        &self,
        key: &S::Key,
        arg: A,
        f: F,
        via: W,
    ) -> Result<(R, bool), ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Copy + Send + Sync + 'static,
        W: Fn(&mut S, A, &F) -> R + Copy + Send + Sync + 'static,
    {
        let (r, _, last, _) = self.route_mut_loop(key, arg, false, f, via)?;
        Ok((r, last))
    }

    /// Route a write: the result, the shard's footprint (if `want`ed), whether the shard
    /// is the last one, and the shard.
    fn route_mut_loop<A, R, F, W>(
        &self,
        key: &S::Key,
        arg: A,
        want: bool,
        f: F,
        via: W,
    ) -> Result<Answered<S, R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Copy + Send + Sync + 'static,
        W: Fn(&mut S, A, &F) -> R + Copy + Send + Sync + 'static,
    {
        // Two zero-sized closures make a zero-sized pair, shipped as one.
        let (reply, shard) = self.router.route(
            key,
            (key.clone(), arg, want),
            ROUTE,
            |shard: &Proclet<Cell<S>>, a| {
                let r = shard.run_with(a, (f, via), route_mut::<S, A, R, F, W>);
                if let Ok(Answer::Moved(..)) = &r {
                    self.settle_handover(shard);
                }
                r
            },
            |shard: &Proclet<Cell<S>>| self.finish_split_of(shard).map(|_| ()),
        )?;
        match reply {
            Reply::Done(r, fp, last) => Ok((r, fp, last, shard)),
            Reply::Sealed => Err(ShardError::Sealed),
        }
    }

    /// Drop the first shard if it holds nothing and is not the last: its right
    /// neighbour takes over its range, no data moves (a queue's drained head). A split of
    /// either shard still in progress is finished first, and so is a drop left half done
    /// (its answer lost: see the module doc's "Merging"). Returns whether the first
    /// shard is gone (dropped by this call or another).
    pub fn drop_empty_first(&self) -> Result<bool, ShardError> {
        self.refresh()?;
        let (first, second) = self.router.cached(|c| {
            let mut it = c.table().iter();
            let first = it.next().map(|(_, s)| s.clone());
            let second = it.next().map(|(lo, s)| (lo.clone(), s.clone()));
            (first, second)
        });
        let Some(first) = first else {
            return Ok(false);
        };
        let Some((Some(lo), second)) = second else {
            // One shard: a split of it may be half done, its upper part not yet a shard.
            if self.split_in_progress(&first)? {
                self.finish_split_of(&first)?;
            }
            return Ok(false);
        };
        for s in [&first, &second] {
            if self.split_in_progress(s)? {
                self.finish_split_of(s)?;
            }
        }
        let r = first.run(
            (first.clone(), second.clone(), lo, self.map().clone()),
            |c: &mut Cell<S>, a: DropArgs<S>| drop_into_right(c, a),
        );
        match r {
            Ok(Ok(true)) => {
                // Callers still holding it are forwarded until it is freed, then told it
                // is gone and read the map, which already names its successor.
                let _ = first.destroy();
                Ok(true)
            }
            Ok(Ok(false)) => Ok(false),
            Ok(Err(e)) => Err(ShardError::Step(e)),
            Err(CallError::ProcletGone(_)) => Ok(true),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether `shard` is in the middle of a split (its parent's or its own).
    fn split_in_progress(&self, shard: &Proclet<Cell<S>>) -> Result<bool, ShardError> {
        match shard.run_ref((), |c: &Cell<S>, ()| {
            c.pending.is_some() || c.frozen_by.is_some()
        }) {
            Ok(b) => Ok(b),
            Err(CallError::ProcletGone(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Run `f(&data, arg)` on one shard got from [`AutoSharder::shards`], if it still
    /// holds the range it held then (`None` if it was merged away or is splitting: read
    /// the map again). Meant for sealed structures, whose shards stay put.
    pub fn shard_ref<A, R, F>(
        &self,
        shard: &Proclet<Cell<S>>,
        arg: A,
        f: F,
    ) -> Result<Option<R>, ShardError>
    where
        A: Wire,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let r = shard.run_ref_with(arg, f, |c: &Cell<S>, a: A, f: &F| -> Option<R> {
            if c.pending.is_some() || c.frozen_by.is_some() || c.handing_to.is_some() {
                return None;
            }
            Some(f(&c.data, a))
        });
        match r {
            Ok(r) => Ok(r),
            Err(CallError::ProcletGone(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Apply many items in as few calls as there are shards they fall in, all sent at
    /// once: `apply(&mut shard, items)` runs on each shard with the items whose
    /// `key_of` lies in its range. Items a shard does not cover (a stale map, a split in
    /// progress) come back and are sent again after the map is read. Returns each shard
    /// written and its footprint afterwards, for [`AutoSharder::resize_after`].
    pub async fn route_many_async<I, K, F>(
        &self,
        items: Vec<I>,
        key_of: K,
        apply: F,
    ) -> Result<Vec<(S::Key, Proclet<Cell<S>>, u64)>, ShardError>
    where
        I: Wire + Clone,
        K: Fn(&I) -> S::Key + Copy + Send + Sync + 'static,
        F: Fn(&mut S, Vec<I>) + Copy + Send + Sync + 'static,
    {
        // Items turned away count as a busy answer: shards not covering them are
        // splitting, or the cached map is behind.
        let mut retry = Retry::new(ROUTE_MANY, Instant::now());
        let mut todo = items;
        let mut written = Vec::new();
        while !todo.is_empty() {
            if self.router.cached(|c| c.table().is_empty()) {
                self.router.refresh_async().await?;
            }
            // Group by the cached map: one call per shard.
            let mut groups: BTreeMap<Option<S::Key>, Group<S, I>> = BTreeMap::new();
            self.router.cached(|c| {
                for item in todo.drain(..) {
                    let k = key_of(&item);
                    let (lo, shard) = c.table().lookup(&k).ok_or(ShardError::Unmapped)?;
                    groups
                        .entry(lo.clone())
                        .or_insert_with(|| (shard.clone(), k, Vec::new()))
                        .2
                        .push(item);
                }
                Ok::<(), ShardError>(())
            })?;
            let calls = groups.into_values().map(|(shard, k, group)| {
                let backup = group.clone();
                let call =
                    shard.run_with_async(group, (key_of, apply), route_many_mut::<S, I, K, F>);
                async move { (shard, k, backup, call.await) }
            });
            let mut busy = Vec::new();
            for (shard, k, backup, r) in futures::future::join_all(calls).await {
                match r {
                    Ok(RoutedMany::Done { rest, fp, applied }) => {
                        if applied {
                            written.push((k, shard.clone(), fp));
                        }
                        if !rest.is_empty() {
                            busy.push(shard);
                        }
                        todo.extend(rest);
                    }
                    Ok(RoutedMany::Sealed) => return Err(ShardError::Sealed),
                    // Nothing ran: send the whole group again.
                    Ok(RoutedMany::Moved(group)) => {
                        self.settle_handover_async(&shard).await;
                        busy.push(shard);
                        todo.extend(group);
                    }
                    // Merged away and destroyed: it refused before running anything.
                    Err(CallError::ProcletGone(_)) => todo.extend(backup),
                    Err(e) => return Err(e.into()),
                }
            }
            if todo.is_empty() {
                break;
            }
            let wait = match retry.step(Outcome::Busy, Instant::now()) {
                Step::Again { wait, .. } => wait,
                Step::Finish { wait } => {
                    // The client that started a split there may be gone: finish it (every
                    // step is idempotent; shards not splitting answer at once).
                    for shard in &busy {
                        self.finish_split_quietly(shard).await?;
                    }
                    wait
                }
                Step::Return | Step::GiveUp => {
                    let first = todo.first().map(|i| format!("{:?}", key_of(i)));
                    return Err(ShardError::Stuck(first.unwrap_or_default()));
                }
            };
            tokio::time::sleep(wait).await;
            self.router.refresh_async().await?;
        }
        Ok(written)
    }

    /// Run `f(&shard, arg)` on the shard holding `key`, read-only (served during splits).
    pub fn route_ref<A, R, F>(&self, key: &S::Key, arg: A, f: F) -> Result<R, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        self.route_ref_end(key, arg, f).map(|(r, _)| r)
    }

    /// [`AutoSharder::route_ref`], also returning where the answering shard's range ends
    /// (`None`: +∞) — where a scan continues.
    pub fn route_ref_end<A, R, F>(
        &self,
        key: &S::Key,
        arg: A,
        f: F,
    ) -> Result<(R, Option<S::Key>), ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let (reply, _) = self.router.route(
            key,
            (key.clone(), arg, false),
            ROUTE,
            |shard: &Proclet<Cell<S>>, a| {
                let r = shard.run_ref_with(a, f, route_ref::<S, A, R, F>);
                if let Ok(Answer::Moved(..)) = &r {
                    self.settle_handover(shard);
                }
                r
            },
            |shard: &Proclet<Cell<S>>| self.finish_split_of(shard).map(|_| ()),
        )?;
        match reply {
            Reply::Done(r, _, _) => Ok(r),
            Reply::Sealed => Err(ShardError::Sealed),
        }
    }

    /// [`AutoSharder::route_ref`] as a future, for reads of a structure whose shards do
    /// not change meanwhile (sealed): a stale answer is met by catching up with the map;
    /// a shard busy splitting, by waiting a little.
    pub async fn route_ref_async<A, R, F>(
        &self,
        key: &S::Key,
        arg: A,
        f: F,
    ) -> Result<R, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let (reply, _) = self
            .router
            .route_async(
                key,
                (key.clone(), arg, false),
                ROUTE,
                |shard: &Proclet<Cell<S>>, a| {
                    let shard = shard.clone();
                    async move {
                        let r = shard
                            .run_ref_with_async(a, f, route_ref::<S, A, R, F>)
                            .await;
                        if let Ok(Answer::Moved(..)) = &r {
                            self.settle_handover_async(&shard).await;
                        }
                        r
                    }
                },
                |shard: &Proclet<Cell<S>>| self.finish_split_quietly_owned(shard.clone()),
            )
            .await?;
        match reply {
            Reply::Done((r, _), _, _) => Ok(r),
            Reply::Sealed => Err(ShardError::Sealed),
        }
    }

    /// [`AutoSharder::route`] as a future, for writes sent several at a time (batching).
    /// Returns the result with the shard that answered and its footprint; the caller
    /// then calls [`AutoSharder::resize_after`] (splits are synchronous work).
    pub async fn route_async<A, R, F>(
        &self,
        key: &S::Key,
        arg: A,
        f: F,
    ) -> Result<(R, Proclet<Cell<S>>, u64), ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&mut S, A) -> R + Copy + Send + Sync + 'static,
    {
        let via = |s: &mut S, a: A, f: &F| f(s, a);
        let (reply, shard) = self
            .router
            .route_async(
                key,
                (key.clone(), arg, true),
                ROUTE,
                |shard: &Proclet<Cell<S>>, a| {
                    let shard = shard.clone();
                    async move {
                        let r = shard
                            .run_with_async(a, (f, via), route_mut::<S, A, R, F, _>)
                            .await;
                        if let Ok(Answer::Moved(..)) = &r {
                            self.settle_handover_async(&shard).await;
                        }
                        r
                    }
                },
                |shard: &Proclet<Cell<S>>| self.finish_split_quietly_owned(shard.clone()),
            )
            .await?;
        match reply {
            Reply::Done(r, fp, _) => Ok((r, shard, fp)),
            Reply::Sealed => Err(ShardError::Sealed),
        }
    }

    /// After a write that may have changed a shard's size (`fp`, its footprint): split
    /// or merge it as the hint allows (what [`AutoSharder::route`] does by itself). A
    /// resize that fails is remembered and tried again (see [`AutoSharder::settle`]).
    pub fn resize_after(&self, key: &S::Key, hint: Hint, shard: &Proclet<Cell<S>>, fp: u64) {
        self.after(key, hint, shard, fp)
    }

    /// Make every shard a *hybrid* proclet: a memory proclet that also runs code next to
    /// its data ([`AutoSharder::offload`]), which placement and the pressure policy then
    /// weigh for both its memory and its CPU. Shards split off a hybrid shard are hybrid
    /// too. Undo with [`AutoSharder::dehybridize`].
    pub fn hybridize(&self) -> Result<(), ShardError> {
        self.set_kind(Kind::Hybrid)
    }

    /// Make every shard a plain memory proclet again.
    pub fn dehybridize(&self) -> Result<(), ShardError> {
        self.set_kind(Kind::Memory)
    }

    fn set_kind(&self, kind: Kind) -> Result<(), ShardError> {
        for (_, s) in self.shards()? {
            match s.set_kind(kind) {
                // Merged away meanwhile: its data lives on in a neighbour, already seen.
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Run `f(&shard, arg)` next to the data of every shard (on the shards' nodes, not
    /// the caller's): only `f`'s results travel. The same as
    /// [`AutoSharder::map_shards`]; the name says what a hybrid structure is for.
    pub fn offload<A, R, F>(&self, arg: A, f: F) -> Result<Vec<R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        self.map_shards(arg, f)
    }

    /// Run `f(&shard, arg)` on every shard, in key order (a split in progress is finished
    /// first, so every element is seen exactly once).
    pub fn map_shards<A, R, F>(&self, arg: A, f: F) -> Result<Vec<R>, ShardError>
    where
        A: Wire + Clone,
        R: Wire,
        F: Fn(&S, A) -> R + Copy + Send + Sync + 'static,
    {
        let mut out = Vec::new();
        // A pass that meets a change (a shard merged away, freed or splitting) starts
        // again. Passes over a map that changes in between are progress (a long `offload`
        // may restart often); the same map answering the same way for the routing patience
        // is a structure stuck, and an error rather than a loop for ever.
        let mut unchanged: Option<(usize, Retry)> = None;
        loop {
            out.clear();
            let shards = self.shards()?;
            let version = self.cached_version();
            let mut restart = false;
            for (_, s) in shards {
                let r = s.run_ref_with(
                    arg.clone(),
                    f,
                    |c: &Cell<S>, a: A, f: &F| -> Option<Option<R>> {
                        if c.pending.is_some() || c.frozen_by.is_some() {
                            return None;
                        }
                        Some(c.handing_to.is_none().then(|| f(&c.data, a)))
                    },
                );
                match r {
                    Ok(Some(Some(r))) => out.push(r),
                    // Handing its range over since the map was read (a merge or drop
                    // in progress, or one left half done), or destroyed: read the map
                    // again.
                    Ok(Some(None)) => {
                        self.settle_handover(&s);
                        restart = true;
                    }
                    Err(CallError::ProcletGone(_)) => restart = true,
                    Ok(None) => {
                        self.finish_split_of(&s)?;
                        restart = true;
                    }
                    Err(e) => return Err(e.into()),
                }
                if restart {
                    break;
                }
            }
            if !restart {
                return Ok(out);
            }
            let now = Instant::now();
            match &mut unchanged {
                Some((v, retry)) if *v == version => {
                    if let Step::Return | Step::GiveUp = retry.step(Outcome::Stale, now) {
                        return Err(ShardError::Stuck("every shard".into()));
                    }
                }
                _ => unchanged = Some((version, Retry::new(ROUTE, now))),
            }
        }
    }

    /// After a routed write: split or merge if the bytes-held trigger says the shard left
    /// its bounds. A shard over its upper bound splits whatever the write did (a write
    /// that shrank it may find it still over: an earlier split of it may have failed).
    /// A failure does not fail the write, which succeeded: the shard is remembered and
    /// tried again by this client's later writes and by [`AutoSharder::settle`]. Shards
    /// remembered so whose next try is due are tried here too.
    fn after(&self, key: &S::Key, hint: Hint, shard: &Proclet<Cell<S>>, fp: u64) {
        let b = &self.bounds;
        let r = match hint {
            Hint::Grow | Hint::Shrink | Hint::Any if b.should_split(fp) => self.split(shard),
            Hint::Shrink | Hint::Any if b.should_merge(fp) => self.merge_around(key, shard, fp),
            _ => Ok(()),
        };
        match r {
            Ok(()) => {}
            // Merged away and freed meanwhile: its keys are in a neighbour, which the
            // merge sized.
            Err(ShardError::Call(CallError::ProcletGone(_))) => {}
            Err(e) => self.owe(key, shard, &e),
        }
        self.retry_owed();
    }

    /// Remember that resizing `shard` (holding `key`) failed with `e`.
    fn owe(&self, key: &S::Key, shard: &Proclet<Cell<S>>, e: &ShardError) {
        tracing::debug!(shard = %shard.id(), "resizing a shard failed (tried again later): {e}");
        let mut owed = self.owed.lock();
        match owed.iter_mut().find(|o| o.shard == *shard) {
            Some(o) => o.why = e.to_string(),
            None => owed.push(Owed {
                key: key.clone(),
                shard: shard.clone(),
                next: Instant::now() + OWED_MIN_WAIT,
                wait: OWED_MIN_WAIT,
                why: e.to_string(),
            }),
        }
    }

    /// Try once more to resize each shard owed a resize whose next try is due; returns
    /// how many stay owed. Entries being tried are out of the list meanwhile, so two
    /// threads sharing this client never try the same shard at once.
    fn retry_owed(&self) -> usize {
        let now = Instant::now();
        let due: Vec<Owed<S>> = {
            let mut owed = self.owed.lock();
            if owed.is_empty() {
                return 0;
            }
            let (due, later) = std::mem::take(&mut *owed)
                .into_iter()
                .partition(|o| o.next <= now);
            *owed = later;
            due
        };
        for mut o in due {
            if let Err(e) = self.resize_now(&o.key, &o.shard) {
                tracing::debug!(shard = %o.shard.id(), "resizing a shard failed again: {e}");
                o.wait = (o.wait * 2).min(OWED_MAX_WAIT);
                o.next = Instant::now() + o.wait;
                o.why = e.to_string();
                let mut owed = self.owed.lock();
                // A write that failed on it meanwhile remembered it already.
                if !owed.iter().any(|x| x.shard == o.shard) {
                    owed.push(o);
                }
            }
        }
        self.owed.lock().len()
    }

    /// Resize `shard` (holding `key`, as far as this client knew) as its size now calls
    /// for: split it if it is over its upper bound or in the middle of a split (which
    /// may be a failed one of this client's), merge it if it is under its lower one. A
    /// hand-over of its left half done (a merge of this client's that failed midway) is
    /// settled first.
    fn resize_now(&self, key: &S::Key, shard: &Proclet<Cell<S>>) -> Result<(), ShardError> {
        let mut settled_once = false;
        let (splitting, settled, fp) = loop {
            let seen = shard.run_ref((), |c: &Cell<S>, ()| {
                (
                    c.pending.is_some() || c.frozen_by.is_some(),
                    c.handing_to.is_some() || c.took_from.is_some(),
                    c.handing_to.is_some() || c.sealed,
                    c.data.footprint(),
                )
            });
            let (splitting, half_done, settled, fp) = match seen {
                Ok(s) => s,
                // Merged away and freed: its keys are in a neighbour, which its merge
                // sized.
                Err(CallError::ProcletGone(_)) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            if half_done && !settled_once {
                // Finished (then the shard is freed, or took its neighbour in) or undone
                // (then it serves its range again, maybe still under its lower bound).
                self.try_settle_handover(shard)?;
                settled_once = true;
                continue;
            }
            break (splitting, settled, fp);
        };
        if settled {
            // Handed over (its taker sizes the result) or sealed (shards stay put).
            Ok(())
        } else if splitting || self.bounds.should_split(fp) {
            self.split(shard)
        } else if self.bounds.should_merge(fp) {
            self.merge_around(key, shard, fp)
        } else {
            Ok(())
        }
    }

    /// Resize the shards this client failed to split or merge after its writes (a call
    /// that failed, a new shard that found no node with room, ...), trying each again,
    /// with a wait doubling from 1 ms to 1 s between tries, for up to `patience`. A
    /// later write through this client (or a clone of it) tries again only the ones
    /// whose next try is due; a batching [`crate::Pusher`]'s flush calls this,
    /// so the shards its batches grew are within their bounds when it returns. Fails
    /// if some shard still could not be resized (it stays remembered).
    pub fn settle(&self, patience: Duration) -> Result<(), ShardError> {
        let deadline = Instant::now() + patience;
        loop {
            if self.retry_owed() == 0 {
                return Ok(());
            }
            let (next, n, why) = {
                let owed = self.owed.lock();
                let next = owed.iter().map(|o| o.next).min();
                let why = owed.last().map(|o| o.why.clone()).unwrap_or_default();
                (next, owed.len(), why)
            };
            match next {
                // Tried by another thread meanwhile, and resized.
                None => return Ok(()),
                Some(t) if t <= deadline => pause(t.saturating_duration_since(Instant::now())),
                Some(_) => {
                    return Err(ShardError::Step(format!(
                        "{n} shard(s) stay out of their bounds after {patience:?} of tries; the last failure: {why}"
                    )))
                }
            }
        }
    }

    /// Split `shard` in halves until every part is within the upper bound (a batch may
    /// have grown it far past it). A split of it that another client has under way is
    /// waited for, and the shard checked again after it.
    pub fn split(&self, shard: &Proclet<Cell<S>>) -> Result<(), ShardError> {
        let mut work = vec![shard.clone()];
        while let Some(s) = work.pop() {
            work.extend(self.split_once(&s)?);
        }
        Ok(())
    }

    /// Split `shard` once if it is over the upper bound. Returns the shards to check
    /// again: none if it is within its bounds (or cannot split), else the shard and the
    /// new one. Another client's split of it (or of its parent, `shard` being that
    /// split's new part) is waited for, and finished after the busy patience (its client
    /// may be gone); then the shard is checked again — it may still be over, that
    /// split's size check having come before the last writes — and so is that split's
    /// new part, whose client may not be there to check it.
    fn split_once(&self, shard: &Proclet<Cell<S>>) -> Result<Vec<Proclet<Cell<S>>>, ShardError> {
        granule_failpoints::hit_blocking("sharded.split.before_begin")
            .map_err(|f| ShardError::Step(format!("beginning a split: {f}")))?;
        let mut retry = Retry::new(ROUTE, Instant::now());
        loop {
            let begun = match self.try_begin_split(shard) {
                // Merged away and freed meanwhile (a part of an earlier round, say):
                // nothing of it left to split.
                Err(ShardError::Call(CallError::ProcletGone(_))) => return Ok(Vec::new()),
                r => r?,
            };
            let (key, child) = match begun {
                Begin::No => return Ok(Vec::new()),
                Begin::Began(k) => (Some(k), self.finish_split_of(shard)?),
                Begin::Busy(k) => match retry.step(Outcome::Busy, Instant::now()) {
                    Step::Again { wait, .. } => {
                        pause(wait);
                        continue;
                    }
                    Step::Finish { .. } => (k, self.finish_split_of(shard)?),
                    Step::Return | Step::GiveUp => {
                        return Err(ShardError::Step(format!(
                            "shard {} stayed in the middle of another split for {:?}",
                            shard.id(),
                            ROUTE.patience
                        )))
                    }
                },
            };
            let child = match (child, key) {
                (Some(c), _) => Some(c),
                // Another client finished the split meanwhile: its new part is the shard
                // the map names at the split key.
                (None, Some(k)) => self.shard_at(&k)?,
                (None, None) => None,
            };
            let mut again = vec![shard.clone()];
            if let Some(c) = child.filter(|c| c != shard) {
                granule_runtime::telemetry::record_split(
                    "sharded",
                    self.label(),
                    format!("{} split off {}", shard.id(), c.id()),
                );
                again.push(c);
            }
            return Ok(again);
        }
    }

    /// The shard the map names at range start `lo`, as of a fresh copy of the map.
    fn shard_at(&self, lo: &S::Key) -> Result<Option<Proclet<Cell<S>>>, ShardError> {
        self.refresh()?;
        let lo = Some(lo.clone());
        Ok(self.router.cached(|c| c.table().get(&lo).cloned()))
    }

    /// How operators see this structure: its shard type and its mapping proclet, e.g.
    /// `"MapShard p12"`.
    pub fn label(&self) -> String {
        label_of::<S>(self.map().id())
    }

    /// Only the first step of a split, as a client that dies right after it would leave
    /// it (for tests of the recovery: the next client kept busy finishes it). Returns
    /// whether a split began.
    #[doc(hidden)]
    pub fn begin_split(&self, shard: &Proclet<Cell<S>>) -> Result<bool, ShardError> {
        Ok(matches!(self.try_begin_split(shard)?, Begin::Began(_)))
    }

    /// The first step of a split, if `shard` is over its upper bound and in the middle
    /// of no other split.
    fn try_begin_split(&self, shard: &Proclet<Cell<S>>) -> Result<Begin<S::Key>, ShardError> {
        Ok(shard.run(self.bounds, |c: &mut Cell<S>, bounds: Bounds| {
            if let Some(p) = &c.pending {
                return Begin::Busy(Some(p.lo.clone()));
            }
            if c.frozen_by.is_some() {
                return Begin::Busy(None);
            }
            if c.handing_to.is_some() || c.sealed || !bounds.should_split(c.data.footprint()) {
                return Begin::No;
            }
            let Some((k, right)) = c.data.split() else {
                return Begin::No;
            };
            let hi = c.hi.replace(k.clone());
            c.pending = Some(Pending {
                lo: k.clone(),
                hi,
                data: right,
            });
            Begin::Began(k)
        })?)
    }

    /// `shard` answered that it hands its range over to a neighbour (a merge or a drop in
    /// progress, or one left half done: its author failed, never heard an answer, or was
    /// cut off from the mapping proclet), or it is a merge's left shard whose merge is not
    /// complete. Finish or undo that, so the range is served again; failures are logged
    /// and left for the next client that meets the shard.
    fn settle_handover(&self, shard: &Proclet<Cell<S>>) {
        granule_runtime::block_on(self.settle_handover_async(shard))
    }

    /// [`AutoSharder::settle_handover`] as a future.
    async fn settle_handover_async(&self, shard: &Proclet<Cell<S>>) {
        if let Err(e) = self.try_settle_handover_async(shard).await {
            // Left for the next client that meets the shard.
            tracing::debug!(shard = %shard.id(), "settling a hand-over failed: {e}");
        }
    }

    /// [`AutoSharder::settle_handover`], saying whether it failed.
    fn try_settle_handover(&self, shard: &Proclet<Cell<S>>) -> Result<(), ShardError> {
        granule_runtime::block_on(self.try_settle_handover_async(shard))
    }

    /// Settle what `shard` is in the middle of. Every step is idempotent and asks the
    /// shard that decides, under its exclusive lock (so after any merge or drop call of
    /// its own: its answer is final), so clients settling the same shard at once, or
    /// settling it while its author tries again, agree:
    /// - a merge `shard` took a copy for is completed ([`finish_took`]);
    /// - `shard` handing its range to its left neighbour (a merge): that neighbour says
    ///   whether it took it, and finishes the merge or thaws `shard` ([`settle_on_left`]);
    /// - the empty first shard handing its range to its right neighbour (a drop): it
    ///   finishes or undoes the drop itself ([`drop_into_right`]), and is freed if done.
    async fn try_settle_handover_async(&self, shard: &Proclet<Cell<S>>) -> Result<(), ShardError> {
        let seen = shard
            .run_ref_async((), |c: &Cell<S>, ()| {
                (
                    c.handing_to.clone(),
                    c.lo.clone(),
                    c.hi.clone(),
                    c.took_from.is_some(),
                )
            })
            .await;
        let (to, lo, hi, took) = match seen {
            Ok(s) => s,
            // Freed: whatever it was in the middle of is complete.
            Err(CallError::ProcletGone(_)) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let map = self.map().clone();
        if took {
            shard
                .run_async(map.clone(), |c: &mut Cell<S>, map: Proclet<MapLog<S>>| {
                    finish_took(c, &map)
                })
                .await?
                .map_err(ShardError::Step)?;
        }
        let Some(to) = to else { return Ok(()) };
        match (lo, hi) {
            (Some(lo), _) => self.settle_merge_async(shard, &to, lo).await,
            (None, Some(hi)) => {
                let dropped = shard
                    .run_async(
                        (shard.clone(), to, hi, map),
                        |c: &mut Cell<S>, a: DropArgs<S>| drop_into_right(c, a),
                    )
                    .await;
                match dropped {
                    Ok(Ok(true)) => match shard.destroy_async().await {
                        Ok(()) | Err(CallError::ProcletGone(_)) => Ok(()),
                        Err(e) => Err(e.into()),
                    },
                    Ok(Ok(false)) | Err(CallError::ProcletGone(_)) => Ok(()),
                    Ok(Err(e)) => Err(ShardError::Step(e)),
                    Err(e) => Err(e.into()),
                }
            }
            // The last shard of a structure of one: it has no neighbour to hand to.
            (None, None) => Ok(()),
        }
    }

    /// Settle the hand-over `right` (its range starting at `right_lo`) began towards its
    /// left neighbour `left` in a merge.
    async fn settle_merge_async(
        &self,
        right: &Proclet<Cell<S>>,
        left: &Proclet<Cell<S>>,
        right_lo: S::Key,
    ) -> Result<(), ShardError> {
        let settled = left
            .run_async(
                (left.clone(), right.clone(), self.map().clone()),
                |c: &mut Cell<S>, a: SettleArgs<S>| settle_on_left(c, a),
            )
            .await;
        match settled {
            Ok(r) => r.map_err(ShardError::Step),
            Err(CallError::ProcletGone(_)) => {
                // The left shard is gone. It is freed (merged on, or dropped) only once a
                // merge it took a copy for is complete, its right shard freed: this one
                // being here, it took nothing, and the map still names this one. Else
                // its node was lost with the range: the map says whether the merge was
                // recorded. Not recorded: this shard's copy is the range's only one, and
                // it serves it again; recorded: the range is the lost shard's, and this
                // shard, named by the map no more, is freed.
                let named = self
                    .map()
                    .run_ref_async(
                        (right_lo, right.clone()),
                        |m: &MapLog<S>, (lo, r): (S::Key, Proclet<Cell<S>>)| {
                            m.log.table().get(&Some(lo)) == Some(&r)
                        },
                    )
                    .await?;
                let done = if named {
                    right
                        .run_async(left.clone(), |c: &mut Cell<S>, to: Proclet<Cell<S>>| {
                            c.thaw(&to)
                        })
                        .await
                        .map(|_| ())
                } else {
                    right.destroy_async().await
                };
                match done {
                    Ok(()) | Err(CallError::ProcletGone(_)) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Steps 2 and 3 of a split whose first step `shard` (the parent, or the new shard
    /// still frozen) went through. Idempotent.
    fn finish_split_of(
        &self,
        shard: &Proclet<Cell<S>>,
    ) -> Result<Option<Proclet<Cell<S>>>, ShardError> {
        match granule_runtime::block_on(self.finish_split_async(shard)) {
            // A shard of the split is gone: another client finished it, and the shard was
            // merged or dropped since. Nothing is left to do.
            Err(ShardError::Call(CallError::ProcletGone(_))) => Ok(None),
            r => r,
        }
    }

    /// Steps 2 and 3 of a split (see [`AutoSharder::finish_split_of`]) as a future: the
    /// batching path's thread keeps other calls in flight and must not block on
    /// synchronous ones. Returns the new shard.
    async fn finish_split_async(
        &self,
        shard: &Proclet<Cell<S>>,
    ) -> Result<Option<Proclet<Cell<S>>>, ShardError> {
        let frozen_by = shard
            .run_ref_async((), |c: &Cell<S>, ()| c.frozen_by.clone())
            .await?;
        let (parent, child) = match frozen_by {
            Some(parent) => (parent, Some(shard.clone())),
            None => (shard.clone(), None),
        };
        // A new shard whose parent is gone is its part's only holder: a shard merges (and
        // is freed) only with no split pending, so the parent had dropped its copy — the
        // client that did so failed before the thaw. Only the thaw is left.
        let is_child = child.is_some();
        let parent_gone = |e: &CallError| is_child && matches!(e, CallError::ProcletGone(_));
        let published = match parent
            .run_ref_async(
                (parent.clone(), self.map().clone()),
                |c: &Cell<S>, (me, map): (Proclet<Cell<S>>, Proclet<MapLog<S>>)| {
                    publish_pending(c, me, map)
                },
            )
            .await
        {
            Ok(r) => r.map_err(ShardError::Step)?,
            Err(e) if parent_gone(&e) => None,
            Err(e) => return Err(e.into()),
        };
        let child = match (published, child) {
            (Some((lo, s)), _) => Some((lo, s)),
            (None, Some(c)) => {
                let lo = c.run_ref_async((), |c: &Cell<S>, ()| c.lo.clone()).await?;
                lo.map(|lo| (lo, c))
            }
            (None, None) => None,
        };
        let Some((lo, child)) = child else {
            return Ok(None);
        };
        let dropped = parent
            .run_async(lo, |c: &mut Cell<S>, lo: S::Key| {
                if c.pending.as_ref().is_some_and(|p| p.lo == lo) {
                    c.pending = None;
                }
            })
            .await;
        match dropped {
            Ok(()) => {}
            Err(e) if parent_gone(&e) => {}
            Err(e) => return Err(e.into()),
        }
        granule_failpoints::hit("sharded.split.before_thaw")
            .await
            .map_err(|f| ShardError::Step(format!("thawing the split-off shard: {f}")))?;
        child
            .run_async((), |c: &mut Cell<S>, ()| c.frozen_by = None)
            .await?;
        Ok(Some(child))
    }

    /// [`AutoSharder::finish_split_async`] where a shard of the split being gone means
    /// another client finished it (and the shard was merged or dropped since).
    async fn finish_split_quietly(&self, shard: &Proclet<Cell<S>>) -> Result<(), ShardError> {
        match self.finish_split_async(shard).await {
            Ok(_) | Err(ShardError::Call(CallError::ProcletGone(_))) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// [`AutoSharder::finish_split_quietly`] owning its shard handle (what a routed
    /// future's busy hook needs).
    async fn finish_split_quietly_owned(&self, shard: Proclet<Cell<S>>) -> Result<(), ShardError> {
        self.finish_split_quietly(&shard).await
    }

    /// Merge the small `shard` (holding `key`) with a neighbour: into its left one, or the
    /// right one into it when it is the first shard.
    fn merge_around(
        &self,
        key: &S::Key,
        shard: &Proclet<Cell<S>>,
        fp: u64,
    ) -> Result<(), ShardError> {
        self.refresh()?;
        let pair = self.router.cached(|c| {
            let t = c.table();
            let (lo, _) = t.lookup(key)?;
            match t.before(lo) {
                Some((_, l)) => Some((l.clone(), shard.clone())),
                // The first shard: take in its right neighbour instead.
                None => t.after(lo).map(|(_, r)| (shard.clone(), r.clone())),
            }
        });
        let Some((left, right)) = pair else {
            return Ok(());
        };
        let right_id = right.id();
        let merged = left
            .run(
                (left.clone(), right, self.map().clone(), fp, self.bounds),
                |c: &mut Cell<S>, a: MergeArgs<S>| merge_right_into(c, a),
            )?
            .map_err(ShardError::Step)?;
        if merged {
            granule_runtime::telemetry::record_merge(
                "sharded",
                self.label(),
                format!("{right_id} into {}", left.id()),
            );
        }
        // A merge past the upper bound is a rebalance: split the result.
        self.split(&left)
    }

    /// Seal the structure: writes fail with [`ShardError::Sealed`]; shards stop splitting
    /// and merging, so their ranges stay put (what an iterator needs).
    pub fn seal(&self) -> Result<(), ShardError> {
        self.set_sealed(true)
    }

    /// Undo [`AutoSharder::seal`].
    pub fn unseal(&self) -> Result<(), ShardError> {
        self.set_sealed(false)
    }

    fn set_sealed(&self, sealed: bool) -> Result<(), ShardError> {
        self.map()
            .run(sealed, |m: &mut MapLog<S>, s: bool| m.sealed = s)?;
        // A shard gets the flag only in the middle of no change: a split in progress
        // ends first (its new shard would come in unsealed), and so does a hand-over (a
        // merge's right shard keeps a copy of what its left shard took until the merge is
        // complete: named by the map still, a sealed structure's readers would see it
        // twice). Flagged, a shard starts no split or merge, but one begun before may
        // still change the map: passes go on until one finds every shard the map names
        // flagged and settled.
        let mut retry = Retry::new(ROUTE, Instant::now());
        loop {
            let mut clean = true;
            for (_, s) in self.shards()? {
                let seen = s.run(sealed, |c: &mut Cell<S>, sealed: bool| {
                    let splitting = c.pending.is_some() || c.frozen_by.is_some();
                    let handing = c.handing_to.is_some() || c.took_from.is_some();
                    if !splitting && !handing {
                        c.sealed = sealed;
                    }
                    (splitting, handing)
                });
                match seen {
                    Ok((false, false)) => {}
                    Ok((true, _)) => {
                        self.finish_split_of(&s)?;
                        clean = false;
                    }
                    Ok((false, true)) => {
                        self.try_settle_handover(&s)?;
                        clean = false;
                    }
                    // Merged away and freed since the map was read.
                    Err(CallError::ProcletGone(_)) => clean = false,
                    Err(e) => return Err(e.into()),
                }
            }
            if clean {
                return Ok(());
            }
            if let Step::Return | Step::GiveUp = retry.step(Outcome::Stale, Instant::now()) {
                return Err(ShardError::Stuck("sealing every shard".into()));
            }
        }
    }

    /// Whether the structure is sealed.
    pub fn is_sealed(&self) -> Result<bool, ShardError> {
        Ok(self.map().run_ref((), |m: &MapLog<S>, ()| m.sealed)?)
    }

    /// Every shard in the map, in key order, as it sees itself: its range, a split it
    /// is in the middle of, whether it is frozen, handing its range over, in the middle
    /// of a merge it took a neighbour's copy for, or sealed, and its bytes.
    /// For diagnosing a structure that does not answer (tests, operators).
    pub fn describe(&self) -> Result<Vec<String>, ShardError> {
        let mut out = Vec::new();
        for (lo, s) in self.shards()? {
            let seen = s.run_ref((), |c: &Cell<S>, ()| {
                format!(
                    "[{:?}, {:?}) pending={:?} frozen_by={:?} handing_to={:?} took_from={:?} sealed={} bytes={}",
                    c.lo,
                    c.hi,
                    c.pending.as_ref().map(|p| (p.lo.clone(), p.hi.clone())),
                    c.frozen_by.as_ref().map(|p| p.id()),
                    c.handing_to.as_ref().map(|p| p.id()),
                    c.took_from.as_ref().map(|(lo, p)| (lo.clone(), p.id())),
                    c.sealed,
                    c.data.footprint()
                )
            });
            let seen = match seen {
                Ok(s) => s,
                Err(e) => format!("unreadable: {e}"),
            };
            out.push(format!("map {lo:?} -> {}: {seen}", s.id()));
        }
        Ok(out)
    }

    /// Footprint of every shard, in key order (for tests and reports).
    pub fn shard_sizes(&self) -> Result<Vec<u64>, ShardError> {
        self.map_shards((), |s: &S, ()| s.footprint())
    }

    /// Destroy every shard and the mapping proclet.
    pub fn destroy(&self) -> Result<(), ShardError> {
        for (_, s) in self.shards()? {
            match s.destroy() {
                Ok(()) | Err(CallError::ProcletGone(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.map().destroy()?;
        Ok(())
    }
}

/// The wrapper a routed write runs in: the key must be the shard's.
fn route_mut<S: Shard, A, R, F, W: Fn(&mut S, A, &F) -> R>(
    c: &mut Cell<S>,
    (key, arg, want): Keyed<S::Key, A>,
    (f, via): &(F, W),
) -> Routed<R, Keyed<S::Key, A>, S> {
    if let Some(to) = &c.handing_to {
        return Answer::Moved((key, arg, want), to.clone());
    }
    if !c.covers(&key) {
        return if c.pending_covers(&key) {
            Answer::Busy((key, arg, want))
        } else {
            Answer::Stale((key, arg, want))
        };
    }
    if c.frozen_by.is_some() {
        return Answer::Busy((key, arg, want));
    }
    if c.sealed {
        return Answer::Served(Reply::Sealed);
    }
    let r = via(&mut c.data, arg, f);
    let fp = if want { c.data.footprint() } else { 0 };
    Answer::Served(Reply::Done(r, fp, c.hi.is_none()))
}

/// What a call of [`AutoSharder::route_many_async`] answers.
#[derive(Serialize, Deserialize)]
#[serde(bound(
    serialize = "I: Serialize",
    deserialize = "I: serde::de::DeserializeOwned"
))]
enum RoutedMany<I> {
    /// The covered items were applied (if any: `applied`); `rest` belong elsewhere.
    Done {
        rest: Vec<I>,
        fp: u64,
        applied: bool,
    },
    /// Nothing applied: handing its range over (a merge or a drop), or frozen after a
    /// split.
    Moved(Vec<I>),
    /// The structure is sealed.
    Sealed,
}

/// The wrapper a batch of writes runs in: the items this shard covers are applied.
fn route_many_mut<S: Shard, I, K: Fn(&I) -> S::Key, F: Fn(&mut S, Vec<I>)>(
    c: &mut Cell<S>,
    items: Vec<I>,
    (key_of, apply): &(K, F),
) -> RoutedMany<I> {
    if c.handing_to.is_some() || c.frozen_by.is_some() {
        return RoutedMany::Moved(items);
    }
    if c.sealed {
        return RoutedMany::Sealed;
    }
    let (mine, rest): (Vec<I>, Vec<I>) = items.into_iter().partition(|i| c.covers(&key_of(i)));
    let applied = !mine.is_empty();
    if applied {
        apply(&mut c.data, mine);
    }
    RoutedMany::Done {
        rest,
        fp: c.data.footprint(),
        applied,
    }
}

/// The wrapper a routed read runs in: served from a split's pending part too.
#[allow(clippy::type_complexity)]
fn route_ref<S: Shard, A, R, F: Fn(&S, A) -> R>(
    c: &Cell<S>,
    (key, arg, want): Keyed<S::Key, A>,
    f: &F,
) -> Routed<(R, Option<S::Key>), Keyed<S::Key, A>, S> {
    if let Some(to) = &c.handing_to {
        return Answer::Moved((key, arg, want), to.clone());
    }
    if c.covers(&key) {
        let r = (f(&c.data, arg), c.hi.clone());
        return Answer::Served(Reply::Done(r, 0, c.hi.is_none()));
    }
    match &c.pending {
        Some(p) if in_range(&key, &Some(p.lo.clone()), &p.hi) => {
            let r = (f(&p.data, arg), p.hi.clone());
            Answer::Served(Reply::Done(r, 0, p.hi.is_none()))
        }
        _ => Answer::Stale((key, arg, want)),
    }
}

/// How operators see a structure: its shard type and its mapping proclet's id.
fn label_of<S>(map: granule_runtime::ProcletId) -> String {
    let full = std::any::type_name::<S>();
    let base = full.split('<').next().unwrap_or(full);
    let short = base.rsplit("::").next().unwrap_or(base);
    format!("{short} {map}")
}

/// Step 2 of a split, on the parent's node under a shared lock: create the new shard
/// (frozen) from a copy of pending and record it in the map, unless a client did so
/// already. Returns the new shard's range start and handle, or `None` if nothing is
/// pending.
#[allow(clippy::type_complexity)]
fn publish_pending<S: Shard>(
    c: &Cell<S>,
    me: Proclet<Cell<S>>,
    map: Proclet<MapLog<S>>,
) -> Result<Option<(S::Key, Proclet<Cell<S>>)>, String> {
    let Some(p) = &c.pending else {
        return Ok(None);
    };
    let bytes =
        postcard::to_allocvec(&p.data).map_err(|e| format!("encoding a split-off part: {e}"))?;
    // The part keeps its parent's kind (a hybrid shard's parts are hybrid).
    let kind = granule_runtime::hosted_kind(me.id()).unwrap_or(Kind::Memory);
    // The controller places the new shard as any new proclet (see the crate doc's
    // "Placement"): not next to its parent by default, so that a structure's shards
    // spread over the nodes with room and one node's loss does not take all of it. The
    // part's bytes cross the network once, inside this split.
    let builder = Proclet::builder(kind)
        .footprint()
        .group(label_of::<S>(map.id()));
    // Unless the shard says its parts stay home (see `Shard::splits_stay_home`).
    let builder = match granule_runtime::here() {
        Some(here) if c.data.splits_stay_home() || p.data.splits_stay_home() => builder.on(here),
        _ => builder,
    };
    let child = builder
        .create(
            (p.lo.clone(), p.hi.clone(), bytes, me),
            |(lo, hi, bytes, parent): (S::Key, Option<S::Key>, Vec<u8>, Proclet<Cell<S>>)| {
                // The bytes were encoded from this very type by this very binary a moment
                // ago. Should decoding fail anyway, the creation fails (the runtime hands
                // the panic back to the caller) and the parent keeps its pending copy; an
                // empty shard in its place would lose the elements.
                let data: S = postcard::from_bytes(&bytes)
                    .unwrap_or_else(|e| panic!("decoding a split-off part failed: {e}"));
                let mut c = Cell::new(Some(lo), hi, data);
                c.frozen_by = Some(parent);
                c
            },
        )
        .map_err(|e| format!("creating the split-off shard: {e}"))?;
    let winner = map
        .run(
            (p.lo.clone(), child.clone()),
            |m: &mut MapLog<S>, (lo, shard): (S::Key, Proclet<Cell<S>>)| {
                m.log.set_if_absent(Some(lo), shard)
            },
        )
        .map_err(|e| format!("recording the split-off shard: {e}"))?;
    let mut winner = winner;
    if winner != child {
        // Another client's copy of this very split — or a shard merged away whose merge
        // was never recorded (see `finish_took`), still named at this key: no split at
        // all. Taking that one for the new shard would drop the pending part's elements.
        // (A shard handing over at a key inside the splitting shard's range was taken by
        // it: only a shard's left neighbour takes its range.)
        let stale = match winner.run_ref((), |c: &Cell<S>, ()| c.handing_to.is_some()) {
            Ok(merged) => merged,
            Err(CallError::ProcletGone(_)) => true,
            Err(e) => {
                return Err(format!(
                    "checking the shard the map names at the split key: {e}"
                ))
            }
        };
        if stale {
            let old = winner.clone();
            winner = map
                .run(
                    (p.lo.clone(), winner, child.clone()),
                    |m: &mut MapLog<S>, (lo, stale, new): (S::Key, Proclet<Cell<S>>, Proclet<Cell<S>>)| {
                        let lo = Some(lo);
                        if m.log.table().get(&lo) == Some(&stale) {
                            m.log.apply(Change::Set { lo, target: new.clone() });
                            new
                        } else {
                            m.log.set_if_absent(lo, new)
                        }
                    },
                )
                .map_err(|e| format!("recording the split-off shard: {e}"))?;
            if winner == child {
                // Named by the map no more: free it (it only forwarded).
                let _ = old.destroy();
            }
        }
    }
    if winner != child {
        let _ = child.destroy();
    }
    Ok(Some((p.lo.clone(), winner)))
}

/// On the mapping proclet: drop the entry at `lo` if it names `shard` (merged away), and
/// say whether the map names it no more. Conditional, so that a late repeat cannot drop
/// the entry of a shard that a split created at the same key since.
fn forget_merged<S: Shard>(m: &mut MapLog<S>, (lo, shard): (S::Key, Proclet<Cell<S>>)) -> bool {
    let lo = Some(lo);
    if m.log.table().get(&lo) == Some(&shard) {
        m.log.remove_if_present(lo);
    }
    !m.log.table().iter().any(|(_, s)| *s == shard)
}

/// (the first shard, where its right neighbour's range starts, that neighbour)
type DropRecord<S> = (Proclet<Cell<S>>, <S as Shard>::Key, Proclet<Cell<S>>);

/// On the mapping proclet: record that the first shard's range is its right
/// neighbour's. Each half only if not done yet, so a repeat (a drop settled by a client
/// after its author's record was lost) changes nothing.
fn record_drop<S: Shard>(m: &mut MapLog<S>, (first, lo, right): DropRecord<S>) {
    if m.log.table().get(&None) == Some(&first) {
        m.log.apply(Change::Set {
            lo: None,
            target: right.clone(),
        });
    }
    let lo = Some(lo);
    if m.log.table().get(&lo) == Some(&right) {
        m.log.remove_if_present(lo);
    }
}

/// (the first shard itself, its right neighbour, where that one's range starts, the map)
type DropArgs<S> = (
    Proclet<Cell<S>>,
    Proclet<Cell<S>>,
    <S as Shard>::Key,
    Proclet<MapLog<S>>,
);

/// Hand the empty first shard `c`'s range to its right neighbour (running on `c`,
/// exclusively; lock order left then right, as for merges), or finish or undo such a
/// hand-over begun before. Returns whether it is done (the caller frees `c`).
///
/// `c` stops serving before it asks its neighbour to take the range: should that answer
/// be lost, it cannot know whether the neighbour covers the range now, and must not
/// serve it meanwhile (callers are sent to the neighbour). The next try — a client that
/// meets `c` ([`AutoSharder::settle_handover`]) or drops the first shard again — asks
/// again; the neighbour's answer is the same whether it took the range now or before.
fn drop_into_right<S: Shard>(
    c: &mut Cell<S>,
    (me, right, right_lo, map): DropArgs<S>,
) -> Result<bool, String> {
    // A merge of its own not yet complete first: freed, it would leave its right shard
    // handing over to a shard that is gone.
    finish_took(c, &map)?;
    let again = c.handing_to.as_ref() == Some(&right);
    if c.lo.is_some()
        || c.hi.as_ref() != Some(&right_lo)
        || c.pending.is_some()
        || c.frozen_by.is_some()
        || (!again && (c.handing_to.is_some() || c.sealed || !c.data.is_empty()))
    {
        return Ok(false);
    }
    c.handing_to = Some(right.clone());
    let took = match right.run(right_lo.clone(), |r: &mut Cell<S>, lo: S::Key| {
        r.extend_down(&lo)
    }) {
        Ok(took) => took,
        Err(CallError::ProcletGone(_)) => {
            // The neighbour is gone: freed only once it is the first shard in the map
            // (this drop recorded), or lost with its node. The map says which.
            let first = map
                .run_ref(me, |m: &MapLog<S>, first: Proclet<Cell<S>>| {
                    m.log.table().get(&None) == Some(&first)
                })
                .map_err(|e| format!("reading the map after a lost neighbour: {e}"))?;
            if first {
                c.handing_to = None;
            }
            return Ok(!first);
        }
        Err(e) => return Err(format!("extending the second shard's range: {e}")),
    };
    if !took {
        // The neighbour does not cover this range (it would have said so): serve it.
        c.handing_to = None;
        return Ok(false);
    }
    map.run((me, right_lo, right), record_drop::<S>)
        .map_err(|e| format!("recording a dropped first shard: {e}"))?;
    Ok(true)
}

/// Complete the merge `c` took a copy for, if any: the map forgets its right shard,
/// which is then freed (each step idempotent). Until then the right shard keeps its data
/// and sends callers to `c`; should a step fail, `took_from` stays, and the next client
/// that meets the right shard ([`AutoSharder::settle_handover`]) or `c`'s next merge,
/// hand-over or drop completes it.
fn finish_took<S: Shard>(c: &mut Cell<S>, map: &Proclet<MapLog<S>>) -> Result<(), String> {
    let Some((lo, right)) = c.took_from.clone() else {
        return Ok(());
    };
    granule_failpoints::hit_blocking("sharded.merge.before_record")
        .map_err(|f| format!("recording a merge: {f}"))?;
    let unnamed = map
        .run((lo, right.clone()), forget_merged::<S>)
        .map_err(|e| format!("recording a merge: {e}"))?;
    if !unnamed {
        return Err(format!(
            "the map still names {} after its merge",
            right.id()
        ));
    }
    // Freed only once the map no longer names it: callers holding it are sent here
    // until then, and told it is gone after (they read the map again).
    match right.destroy() {
        Ok(()) | Err(CallError::ProcletGone(_)) => {}
        Err(e) => return Err(format!("freeing a merged-away shard: {e}")),
    }
    c.took_from = None;
    Ok(())
}

/// (left itself, right, map, right's footprint as the client saw it, the bounds)
type MergeArgs<S> = (
    Proclet<Cell<S>>,
    Proclet<Cell<S>>,
    Proclet<MapLog<S>>,
    u64,
    Bounds,
);

/// Merge `right` into the left shard `c` (running on the left shard, exclusively), in
/// three steps: the right shard hands its range over with a copy of its data, keeping
/// the data ([`Cell::hand_over`]); this shard takes the copy and extends its range
/// ([`Cell::take_handed`]); the map forgets the right shard, which is freed
/// ([`finish_took`]). Should a step's answer be lost, what was done stays visible in the
/// two shards and the rest is done, or undone, by whoever meets them next.
fn merge_right_into<S: Shard>(
    c: &mut Cell<S>,
    (me, right, map, right_fp, bounds): MergeArgs<S>,
) -> Result<bool, String> {
    // One merge at a time: an earlier one not complete first.
    finish_took(c, &map)?;
    // Two shards over the upper bound together may still merge (a rebalance: the client
    // splits the result in halves): the trigger says how far (see `Bounds::may_merge`).
    if c.pending.is_some()
        || c.frozen_by.is_some()
        || c.handing_to.is_some()
        || c.sealed
        || !bounds.may_merge(c.data.footprint(), right_fp)
    {
        return Ok(false);
    }
    let Some(my_hi) = c.hi.clone() else {
        return Ok(false);
    };
    // A lost answer leaves the right shard handing over to this one, which took nothing:
    // trying this merge again takes the same copy; a client that meets the right shard
    // first thaws it ([`settle_on_left`]).
    let handed = right
        .run(
            (my_hi, me, map.clone()),
            |r: &mut Cell<S>, (lo, into, map): (S::Key, Proclet<Cell<S>>, Proclet<MapLog<S>>)| {
                finish_took(r, &map)?;
                r.hand_over(&lo, &into)
            },
        )
        .map_err(|e| format!("taking the right shard's data: {e}"))??;
    let Some(handed) = handed else {
        return Ok(false);
    };
    c.take_handed(right, handed)?;
    finish_took(c, &map)?;
    Ok(true)
}

/// (the left shard itself, the right shard handing its range over to it, the map)
type SettleArgs<S> = (Proclet<Cell<S>>, Proclet<Cell<S>>, Proclet<MapLog<S>>);

/// Settle the hand-over `right` began towards the left shard `c` in a merge (running on
/// `c`, exclusively: after any merge call of its own, and before any later one, so what
/// it says is final). If `c` took the copy (`took_from` names `right`, until `right` is
/// freed), the merge is completed; else `c` did not take it and cannot until this call
/// ends: `right` serves its range again.
fn settle_on_left<S: Shard>(
    c: &mut Cell<S>,
    (me, right, map): SettleArgs<S>,
) -> Result<(), String> {
    if c.took_from.as_ref().is_some_and(|(_, r)| *r == right) {
        return finish_took(c, &map);
    }
    match right.run(me, |r: &mut Cell<S>, to: Proclet<Cell<S>>| r.thaw(&to)) {
        // Freed: its merge was completed (by this shard, before this call).
        Ok(_) | Err(CallError::ProcletGone(_)) => Ok(()),
        Err(e) => Err(format!("thawing the right shard: {e}")),
    }
}

// ---- calls to one shard of a sealed structure (see `parts`) ----------------------------

impl<S: Shard> Cell<S> {
    /// The shard's data (for `parts`' wrappers, which run caller code on it).
    pub(crate) fn data(&self) -> &S {
        &self.data
    }
}

impl<S: Shard> AutoSharder<S> {
    /// Handles to every shard of a sealed structure, in key order, for calls to one shard
    /// at a time ([`crate::SealedShard`]). Fails with [`ShardError::NotSealed`] otherwise:
    /// shards could split or merge under the handles.
    pub fn sealed_shards(&self) -> Result<Vec<crate::SealedShard<S>>, ShardError> {
        if !self.is_sealed()? {
            return Err(ShardError::NotSealed);
        }
        Ok(self
            .shards()?
            .into_iter()
            .map(|(_, p)| crate::SealedShard::new(p))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    //! The steps' pure halves: what a shard does with its own state when asked to hand
    //! over, take, thaw or extend, what it answers callers meanwhile, and the map's
    //! records. The calls between shards are tested on a cluster
    //! (`crates/granule/tests/sharded.rs`).
    use super::*;
    use granule_runtime::ProcletId;
    use std::collections::BTreeSet;

    #[derive(Default, Serialize, Deserialize)]
    struct Keys(BTreeSet<u64>);

    impl Shard for Keys {
        type Key = u64;
        fn split(&mut self) -> Option<(u64, Self)> {
            let mid = *self.0.iter().nth(self.0.len() / 2)?;
            Some((mid, Keys(self.0.split_off(&mid))))
        }
        fn merge(&mut self, mut right: Self) {
            self.0.append(&mut right.0)
        }
        fn footprint(&self) -> u64 {
            8 * self.0.len() as u64
        }
    }

    /// A handle to proclet `id` as a process without a cluster decodes one (no calls).
    fn handle<T>(id: u64) -> Proclet<T> {
        let bytes = postcard::to_allocvec(&(ProcletId(id), None::<()>)).expect("encode");
        postcard::from_bytes(&bytes).expect("decode")
    }

    fn cell(lo: Option<u64>, hi: Option<u64>, keys: impl IntoIterator<Item = u64>) -> Cell<Keys> {
        Cell::new(lo, hi, Keys(keys.into_iter().collect()))
    }

    fn insert(s: &mut Keys, k: u64, _: &()) -> bool {
        s.0.insert(k)
    }

    fn contains(s: &Keys, k: u64) -> bool {
        s.0.contains(&k)
    }

    /// What a routed write of `k` gets from `c`: moved (and where), served, or neither.
    fn write(c: &mut Cell<Keys>, k: u64) -> Result<Option<ProcletId>, ()> {
        match route_mut(c, (k, k, false), &((), insert)) {
            Answer::Moved(_, to) => Ok(Some(to.id())),
            Answer::Served(_) => Ok(None),
            _ => Err(()),
        }
    }

    fn read(c: &Cell<Keys>, k: u64) -> Result<Option<ProcletId>, ()> {
        match route_ref(c, (k, k, false), &contains) {
            Answer::Moved(_, to) => Ok(Some(to.id())),
            Answer::Served(_) => Ok(None),
            _ => Err(()),
        }
    }

    #[test]
    fn a_right_shard_hands_over_a_copy_and_keeps_its_data_until_freed() {
        let left = handle::<Cell<Keys>>(1);
        let mut r = cell(Some(10), Some(20), [10, 12, 15]);
        assert_eq!(write(&mut r, 11), Ok(None));
        let (hi, bytes) = r.hand_over(&10, &left).expect("encode").expect("handed");
        assert_eq!(hi, Some(20));
        // It keeps its data, serves nothing, and sends callers to the left shard.
        assert_eq!(r.data.0, BTreeSet::from([10, 11, 12, 15]));
        assert_eq!(write(&mut r, 13), Ok(Some(ProcletId(1))));
        assert_eq!(read(&r, 12), Ok(Some(ProcletId(1))));
        assert!(!r.data.0.contains(&13));
        let mut batch = route_many_mut(
            &mut r,
            vec![14u64],
            &(|k: &u64| *k, |_: &mut Keys, _: Vec<u64>| {}),
        );
        assert!(matches!(&mut batch, RoutedMany::Moved(v) if *v == vec![14]));
        // Asked again (the first answer lost), it hands the same copy.
        let again = r
            .hand_over(&10, &left)
            .expect("encode")
            .expect("handed again");
        assert_eq!(again, (hi, bytes));
        // To another shard it does not, nor at another key.
        assert_eq!(r.hand_over(&10, &handle(2)), Ok(None));
        let mut other = cell(Some(10), Some(20), [10]);
        assert_eq!(other.hand_over(&9, &left), Ok(None));
    }

    #[test]
    fn a_shard_in_the_middle_of_another_change_does_not_hand_over() {
        let left = handle::<Cell<Keys>>(1);
        let mut splitting = cell(Some(10), Some(15), [10]);
        splitting.pending = Some(Pending {
            lo: 15,
            hi: None,
            data: Keys::default(),
        });
        let mut frozen = cell(Some(10), None, [10]);
        frozen.frozen_by = Some(handle(3));
        let mut sealed = cell(Some(10), None, [10]);
        sealed.sealed = true;
        // A merge of its own not complete: its caller finishes it first.
        let mut taker = cell(Some(10), None, [10]);
        taker.took_from = Some((20, handle(4)));
        for mut c in [splitting, frozen, sealed, taker] {
            assert_eq!(c.hand_over(&10, &left), Ok(None));
            assert!(c.handing_to.is_none());
        }
    }

    #[test]
    fn the_left_shard_takes_the_copy_and_notes_the_merge() {
        let right = handle::<Cell<Keys>>(2);
        let mut r = cell(Some(10), Some(20), [10, 15]);
        let handed = r
            .hand_over(&10, &handle(1))
            .expect("encode")
            .expect("handed");
        let mut l = cell(None, Some(10), [1, 5]);
        l.take_handed(right.clone(), handed).expect("take");
        assert_eq!((l.lo, l.hi), (None, Some(20)));
        assert_eq!(l.data.0, BTreeSet::from([1, 5, 10, 15]));
        assert_eq!(l.took_from, Some((10, right)));
        assert_eq!(write(&mut l, 17), Ok(None));
        // A copy that does not decode changes nothing.
        let mut l2 = cell(None, Some(10), [1]);
        assert!(l2.take_handed(handle(2), (None, vec![0xff; 3])).is_err());
        assert_eq!((l2.hi, l2.took_from.is_none()), (Some(10), true));
        assert_eq!(l2.data.0, BTreeSet::from([1]));
    }

    #[test]
    fn an_untaken_hand_over_thaws_only_for_its_own_left_shard() {
        let left = handle::<Cell<Keys>>(1);
        let mut r = cell(Some(10), None, [10]);
        r.hand_over(&10, &left).expect("encode").expect("handed");
        assert!(!r.thaw(&handle(7)));
        assert_eq!(read(&r, 10), Ok(Some(ProcletId(1))));
        assert!(r.thaw(&left));
        assert_eq!(read(&r, 10), Ok(None));
        assert_eq!(write(&mut r, 11), Ok(None));
        // Thawing twice (two clients settling at once) is the same as once.
        assert!(!r.thaw(&left));
        assert_eq!(r.data.0, BTreeSet::from([10, 11]));
    }

    #[test]
    fn the_right_neighbour_of_a_drop_extends_once_and_says_so_again() {
        let mut r = cell(Some(10), None, [10]);
        assert!(!r.extend_down(&9));
        assert!(r.extend_down(&10));
        assert_eq!(r.lo, None);
        // The answer lost, the first shard asks again: the same answer.
        assert!(r.extend_down(&10));
        let mut frozen = cell(Some(10), None, []);
        frozen.frozen_by = Some(handle(3));
        assert!(!frozen.extend_down(&10));
        let mut handing = cell(Some(10), None, []);
        handing.handing_to = Some(handle(3));
        assert!(!handing.extend_down(&10));
    }

    fn map_of(entries: &[(Option<u64>, u64)]) -> MapLog<Keys> {
        let mut m = MapLog {
            log: ChangeLog::new(),
            sealed: false,
        };
        for (lo, id) in entries {
            m.log.apply(Change::Set {
                lo: *lo,
                target: handle(*id),
            });
        }
        m
    }

    fn table(m: &MapLog<Keys>) -> Vec<(Option<u64>, u64)> {
        m.log
            .table()
            .iter()
            .map(|(lo, s)| (*lo, s.id().0))
            .collect()
    }

    #[test]
    fn recording_a_merge_is_conditional_and_repeatable() {
        let mut m = map_of(&[(None, 1), (Some(10), 2), (Some(20), 3)]);
        assert!(forget_merged(&mut m, (10, handle(2))));
        assert_eq!(table(&m), vec![(None, 1), (Some(20), 3)]);
        let v = m.log.version();
        assert!(forget_merged(&mut m, (10, handle(2))));
        assert_eq!(m.log.version(), v, "a repeat changed the map");
        // A shard a split created since at that key keeps its entry.
        let mut m = map_of(&[(None, 1), (Some(10), 5)]);
        assert!(forget_merged(&mut m, (10, handle(2))));
        assert_eq!(table(&m), vec![(None, 1), (Some(10), 5)]);
    }

    #[test]
    fn recording_a_drop_is_conditional_and_repeatable() {
        let mut m = map_of(&[(None, 1), (Some(10), 2), (Some(20), 3)]);
        record_drop(&mut m, (handle(1), 10, handle(2)));
        assert_eq!(table(&m), vec![(None, 2), (Some(20), 3)]);
        let v = m.log.version();
        record_drop(&mut m, (handle(1), 10, handle(2)));
        assert_eq!(m.log.version(), v, "a repeat changed the map");
        assert_eq!(table(&m), vec![(None, 2), (Some(20), 3)]);
    }
}
