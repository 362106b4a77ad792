//! Replicated proclets (primary–backup, Nu §3.5): the copies a node keeps of proclets
//! whose primary is elsewhere, what a primary knows of its backups, and the paths that
//! use them, top to bottom — making backups (the state streamed to each), a mutating
//! call on a primary (numbered, sent to the backups while it runs here, answered once
//! every backup of the current configuration applied it), applying it on a backup,
//! and a backup becoming the primary when the controller says so.
//!
//! Invariants:
//! - a primary answers a mutating call only after every backup of its configuration
//!   answered `Applied` for it; a backup that does not answer holds the call until the
//!   controller removes it from the configuration (a new epoch), so a primary cut off
//!   from the controller can never acknowledge a write a backup does not have;
//! - a backup applies calls in their order (`seq`), each once; a call it already applied
//!   is answered from what it recorded, and a copy of an older epoch is refused; a
//!   backup that missed a call (or applied a replaced primary's call under a number
//!   the new primary gave another) is refused as "behind" and sent the whole state;
//! - every call carries its caller's id: a retry after a failover of a call that was
//!   applied before the primary died is answered with the recorded result, not run
//!   again;
//! - a backup runs the same closure on the same state: a digest of each result is
//!   compared with the primary's, and a mismatch is counted and logged with the proclet
//!   and the call (the closure is not deterministic: see docs/guide/replication.md);
//! - what a closure does outside its state (calling, creating or destroying proclets,
//!   failpoints, questions to the runtime) happens on the primary only: its outcomes
//!   are recorded there and replayed on the backups (`crate::effects`). A proclet's
//!   calls go to the backups before they run on the primary until one of them turns out
//!   to have effects; from then on each is sent after it ran, with its effects.
//!
//! After a loss the primary restores the number of copies (`restore_copies`), trying
//! again until it has them. Moves keep the number of copies: a primary hands over to a
//! node holding a copy it streamed (or to a backup, swapping roles) under a new epoch
//! (`move_replicated`), and a backup is replaced by a copy streamed to another node
//! (`serve_move_backup`). Not yet: pipelining several calls of one proclet to its
//! backups (a call holds the proclet's lock until every backup applied it).

use super::hosting::NewSlot;
use super::stream::{self, ChunkPos, Inbound, Settings};
use super::NodeInner;
use crate::context;
use crate::effects::{self, Late, Recorder, Replayer, Scope};
use crate::shipping::{self, Entry, Expect};
use crate::slot::Slot;
use bytes::Bytes;
use dashmap::DashMap;
use granule_transport::{Connection, Responder};
use granule_wire::{
    CallMode, ChainId, CodeRef, Epoch, Frame, Kind, Location, Msg, NodeId, ProcletId, RemoteError,
    ReplicaSet,
};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a backup's refusal says when it cannot apply a call in order (it missed one,
/// or keeps no copy): the primary then streams it the whole state instead.
const BEHIND: &str = "this copy is behind";

/// How many answered calls each copy remembers by call id (for retries after a
/// failover, which come within moments of it)...
const REMEMBERED_CALLS: usize = 1024;
/// ...and how many bytes of their results at most: a proclet whose calls return large
/// values keeps fewer (the newest are kept; the newest call is always kept).
const REMEMBERED_BYTES: usize = 16 << 20;

/// The replication part of a node.
#[derive(Default)]
pub(crate) struct Replication {
    /// Proclets hosted here as primaries with backups.
    primaries: DashMap<ProcletId, Arc<Primary>>,
    /// Backup copies kept here.
    backups: DashMap<ProcletId, Arc<Backup>>,
    /// Backup states arriving.
    inbound: Inbound<ArrivingBackup>,
    /// The next call id's counter (the node's id is in the high bits).
    next_call: AtomicU64,
    /// Results of backups that differed from their primary's (seen on primaries).
    pub divergences: AtomicU64,
    /// Mutating calls replicated by primaries here.
    pub replicated_calls: AtomicU64,
    /// Replicated calls running on primaries here now.
    running: AtomicUsize,
}

/// One replicated call counted in [`Replication::running`] while it lives.
struct Running<'a>(&'a AtomicUsize);

impl<'a> Running<'a> {
    /// Count a call in; whether it is the only one running.
    fn enter(n: &'a AtomicUsize) -> (Running<'a>, bool) {
        let before = n.fetch_add(1, Ordering::Relaxed);
        (Running(n), before == 0)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A primary's view of its configuration.
pub(crate) struct Primary {
    config: tokio::sync::watch::Sender<Config>,
    /// Calls numbered so far (the last one's `seq`).
    seq: Mutex<u64>,
    answered: Mutex<Answered>,
    /// How many copies the proclet was made with.
    copies: u32,
    /// A call of this proclet had effects: calls go to the backups after they ran here,
    /// with theirs.
    effectful: AtomicBool,
    /// A task restoring its number of copies is running.
    restoring: AtomicBool,
}

impl Primary {
    /// A primary at configuration `config` whose state has applied calls up to `seq`.
    fn new(
        config: Config,
        seq: u64,
        answered: Answered,
        copies: u32,
        effectful: bool,
    ) -> Arc<Primary> {
        Arc::new(Primary {
            config: tokio::sync::watch::channel(config).0,
            seq: Mutex::new(seq),
            answered: Mutex::new(answered),
            copies,
            effectful: AtomicBool::new(effectful),
            restoring: AtomicBool::new(false),
        })
    }

    /// Take configuration `config` unless a newer one is in place already (the
    /// controller's notices and a primary's own records can arrive in either order).
    fn adopt(&self, config: Config) {
        self.config.send_if_modified(|c| {
            let newer = config.epoch >= c.epoch;
            if newer {
                *c = config;
            }
            newer
        });
    }
}

#[derive(Clone, Debug)]
struct Config {
    epoch: Epoch,
    backups: Arc<[Location]>,
}

/// A backup copy.
pub(crate) struct Backup {
    slot: Arc<Slot>,
    progress: Mutex<Progress>,
    answered: Mutex<Answered>,
    copies: u32,
    /// Effects of a call that follow it (`Msg::Effects`), or the news of a promotion,
    /// for a re-run of the call waiting for them.
    late: tokio::sync::watch::Sender<Late>,
    /// A call applied here had effects (carried over when this copy is promoted).
    effectful: AtomicBool,
    /// The state's size when it arrived (encoded bytes).
    bytes: u64,
}

impl Backup {
    /// A copy (its state in `slot`) as `copy` says; `bytes`: the state's size, for the
    /// pressure policy.
    fn new(
        slot: Arc<Slot>,
        copy: Copy,
        answered: Answered,
        effectful: bool,
        bytes: u64,
    ) -> Arc<Backup> {
        let Copy { epoch, copies, seq } = copy;
        Arc::new(Backup {
            slot,
            progress: Mutex::new(Progress {
                epoch,
                applied: seq,
                last_call: 0,
                last_digest: 0,
            }),
            answered: Mutex::new(answered),
            copies,
            late: tokio::sync::watch::channel(Late::Nothing).0,
            effectful: AtomicBool::new(effectful),
            bytes,
        })
    }
}

struct Progress {
    epoch: Epoch,
    applied: u64,
    /// The id and result digest of call `applied`.
    last_call: u64,
    last_digest: u64,
}

/// Results of recent calls by call id, oldest first out.
#[derive(Default)]
struct Answered {
    /// Keyed by call ids, which no peer chooses to collide: a fast hash will do (every
    /// replicated call looks one up and records one).
    by_call: HashMap<u64, Result<Bytes, RemoteError>, foldhash::fast::FixedState>,
    order: VecDeque<u64>,
    /// Bytes of the results kept.
    bytes: usize,
}

fn result_len(r: &Result<Bytes, RemoteError>) -> usize {
    r.as_ref().map_or(0, |b| b.len())
}

impl Answered {
    fn get(&self, call: u64) -> Option<Result<Bytes, RemoteError>> {
        self.by_call.get(&call).cloned()
    }

    fn record(&mut self, call: u64, r: &Result<Bytes, RemoteError>) {
        if call == 0 {
            return;
        }
        self.bytes += result_len(r);
        match self.by_call.insert(call, r.clone()) {
            None => self.order.push_back(call),
            Some(old) => self.bytes -= result_len(&old),
        }
        while self.order.len() > REMEMBERED_CALLS
            || (self.bytes > REMEMBERED_BYTES && self.order.len() > 1)
        {
            if let Some(old) = self.order.pop_front() {
                if let Some(r) = self.by_call.remove(&old) {
                    self.bytes -= result_len(&r);
                }
            }
        }
    }
}

struct ArrivingBackup {
    desc: &'static shipping::Descriptor,
    ops: shipping::StateOps,
    kind: Kind,
    copy: Copy,
}

/// The digest backups and primary compare: of the encoded result, or of the error.
fn digest(r: &Result<Bytes, RemoteError>) -> u64 {
    // `DefaultHasher::new()` has fixed keys: the same in every process of the binary.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match r {
        Ok(b) => {
            0u8.hash(&mut h);
            b.hash(&mut h);
        }
        Err(e) => {
            1u8.hash(&mut h);
            e.to_string().hash(&mut h);
        }
    }
    h.finish()
}

impl Replication {
    pub(crate) fn primary(&self, id: ProcletId) -> Option<Arc<Primary>> {
        self.primaries.get(&id).map(|p| p.clone())
    }

    /// The backup copies kept here, with their sizes (encoded bytes, as streamed): the
    /// pressure policy moves them like proclets.
    pub(crate) fn backup_sizes(&self) -> Vec<(ProcletId, u64)> {
        self.backups.iter().map(|b| (*b.key(), b.bytes)).collect()
    }

    /// Whether a backup copy of `id` is kept here.
    pub(crate) fn has_backup(&self, id: ProcletId) -> bool {
        self.backups.contains_key(&id)
    }

    /// Replicated primaries and backup copies kept here.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.primaries.len(), self.backups.len())
    }
}

impl NodeInner {
    /// A new id for a call made from this node: unique in the cluster (the node's id is
    /// in the high bits), never 0.
    pub(crate) fn new_call_id(&self) -> u64 {
        let n = self.replication.next_call.fetch_add(1, Ordering::Relaxed) + 1;
        (u64::from(self.id.0) << 40) | (n & ((1 << 40) - 1))
    }

    /// Give proclet `set.proclet`, hosted here, the backups in `set`: stream its state to
    /// each (under its exclusive lock, so no call changes it meanwhile), then replicate
    /// every mutating call to them. Backups not in `set` are no longer sent calls.
    /// Returns the bytes streamed.
    pub(crate) async fn add_backups(
        &self,
        set: ReplicaSet,
        copies: u32,
    ) -> Result<u64, RemoteError> {
        let id = set.proclet;
        if set.backups.iter().any(|b| b.node == self.id) {
            return Err(RemoteError::Refused(format!(
                "node {} would keep both the primary and a backup of proclet {id}",
                self.id
            )));
        }
        let slot = self.hosting.get(id).ok_or_else(|| self.not_here(id))?;
        let guard = self
            .lock_slot(&slot, context::new_chain(), CallMode::Exclusive)
            .await?;
        let existing = self.replication.primary(id);
        let have: Vec<Location> = existing
            .as_ref()
            .map(|p| p.config.borrow().backups.to_vec())
            .unwrap_or_default();
        // Calls applied to the state being sent: the new backups go on from there.
        let seq = existing.as_ref().map_or(0, |p| *p.seq.lock());
        let new: Vec<&Location> = set
            .backups
            .iter()
            .filter(|b| !have.iter().any(|h| h.node == b.node))
            .collect();
        let streaming = std::time::Instant::now();
        let mut sent_bytes = Vec::with_capacity(new.len());
        for b in &new {
            let copy = Copy {
                epoch: set.epoch,
                copies,
                seq,
            };
            match self.stream_copy(&slot, &guard, b, copy).await {
                Ok(bytes) => sent_bytes.push((b.node, bytes)),
                Err(e) => {
                    self.drop_copies(id, &new).await;
                    return Err(e);
                }
            }
        }
        // Recorded at the controller only now that they hold the state: a failover
        // before this cannot pick a backup that has nothing.
        if let Err(e) = self.controller.record_backups(set.clone()).await {
            self.drop_copies(id, &new).await;
            return Err(RemoteError::Refused(format!(
                "the controller did not record the new backups of {id}: {e}"
            )));
        }
        let config = Config {
            epoch: set.epoch,
            backups: set.backups.clone().into(),
        };
        match self.replication.primary(id) {
            Some(p) => {
                // The controller may have sent a newer configuration meanwhile (one of
                // these backups died after it was recorded): that one stands.
                p.adopt(config);
            }
            None => {
                self.replication.primaries.insert(
                    id,
                    Primary::new(config, 0, Answered::default(), copies, false),
                );
            }
        }
        slot.replicated.store(true, Ordering::Release);
        drop(guard);
        let held = streaming.elapsed();
        let total = sent_bytes.iter().map(|(_, b)| b).sum();
        for (to, bytes) in sent_bytes {
            let mut e = granule_wire::ClusterEvent::now(
                granule_wire::EventKind::BackupMade,
                self.id,
                id.to_string(),
            );
            e.to = Some(to);
            e.bytes = bytes;
            e.micros = held.as_micros() as u64;
            crate::telemetry::report_event(e);
        }
        Ok(total)
    }

    /// Move the backup copy of proclet `id` (a primary here) on node `from` to `to`
    /// (`Msg::MoveBackup`): the state streams to `to`, the controller records `to` in
    /// `from`'s place, and `from` drops its copy.
    pub(super) async fn serve_move_backup(
        &self,
        id: ProcletId,
        from: NodeId,
        to: &Location,
    ) -> Result<granule_wire::MoveStats, RemoteError> {
        let t0 = std::time::Instant::now();
        let primary = self
            .replication
            .primary(id)
            .ok_or_else(|| self.not_here(id))?;
        let config = primary.config.borrow().clone();
        let Some(old) = config.backups.iter().find(|b| b.node == from).cloned() else {
            return Err(RemoteError::Refused(format!(
                "node {from} keeps no backup of proclet {id}"
            )));
        };
        let mut to = to.clone();
        if to.node == self.id || config.backups.iter().any(|b| b.node == to.node) {
            // The pressure policy's destination is chosen for room, not for copies:
            // the controller picks a node with room that keeps no copy instead.
            let placed = self.controller.place_backups(id, 1).await.map_err(|e| {
                RemoteError::Refused(format!(
                    "node {} already keeps a copy of proclet {id}, and no other node can: {e}",
                    to.node
                ))
            })?;
            match placed
                .backups
                .iter()
                .find(|b| b.node != self.id && !config.backups.iter().any(|h| h.node == b.node))
            {
                Some(b) => to = b.clone(),
                None => {
                    return Err(RemoteError::Refused(format!(
                        "no node without a copy of proclet {id} to move its backup to"
                    )))
                }
            }
        }
        let to = &to;
        let mut backups: Vec<Location> = config
            .backups
            .iter()
            .filter(|b| b.node != from)
            .cloned()
            .collect();
        backups.push(Location {
            node: to.node,
            addr: to.addr.clone(),
            epoch: 0,
        });
        let set = ReplicaSet {
            proclet: id,
            epoch: config.epoch,
            primary: Location {
                node: self.id,
                addr: self.addr.clone(),
                epoch: config.epoch,
            },
            backups,
        };
        let bytes = self.add_backups(set, primary.copies).await?;
        // No call goes to the old copy any more: it can go.
        self.drop_copies(id, &[&old]).await;
        let took = t0.elapsed();
        tracing::info!(proclet = %id, from = %from, to = %to.node, bytes,
            micros = took.as_micros() as u64, "a backup copy moved");
        let mut e = granule_wire::ClusterEvent::now(
            granule_wire::EventKind::Migration,
            from,
            format!("{id} (backup)"),
        );
        e.to = Some(to.node);
        e.bytes = bytes;
        e.micros = took.as_micros() as u64;
        crate::telemetry::record_move(self, e);
        Ok(granule_wire::MoveStats {
            bytes,
            micros: took.as_micros() as u64,
            drain_micros: 0,
        })
    }

    /// Move the backup copy of `id` kept here to `to`: asked of its primary.
    pub(super) async fn move_backup_away(
        &self,
        id: ProcletId,
        to: &Location,
    ) -> Result<granule_wire::MoveStats, RemoteError> {
        self.ask_backup_move(id, self.id, to).await
    }

    /// Ask the primary of `id` to move its backup copy on `from` to `to`.
    pub(crate) async fn ask_backup_move(
        &self,
        id: ProcletId,
        from: NodeId,
        to: &Location,
    ) -> Result<granule_wire::MoveStats, RemoteError> {
        let (primary, _) = self
            .controller
            .locate(id)
            .await
            .map_err(|e| RemoteError::Internal(format!("cannot locate {id}'s primary: {e}")))?
            .ok_or(RemoteError::Gone)?;
        let conn = self
            .peers
            .connect(primary.node, &primary.addr)
            .await
            .map_err(|e| RemoteError::Internal(e.to_string()))?;
        let ask = Msg::MoveBackup {
            proclet: id,
            from,
            to: to.clone(),
        };
        match conn.request(&ask, &[]).await {
            Ok(Frame {
                msg: Msg::Moved(stats),
                ..
            }) => Ok(stats),
            Ok(Frame {
                msg: Msg::Error(e), ..
            }) => Err(e),
            Ok(f) => Err(RemoteError::Protocol(format!(
                "unexpected answer {} to MoveBackup",
                f.msg.name()
            ))),
            Err(e) => Err(RemoteError::Internal(e.to_string())),
        }
    }

    /// Drop the backup copies of `id` on these nodes: ones streamed that will not be
    /// used (the stream, the controller's record or a hand-over failed), or one a move
    /// replaced, so they do not stay in those nodes' memory.
    async fn drop_copies(&self, id: ProcletId, new: &[&Location]) {
        for b in new {
            if let Ok(conn) = self.peers.connect(b.node, &b.addr).await {
                let _ = conn.request(&Msg::Destroy { proclet: id }, &[]).await;
            }
        }
    }

    /// A mutating call on a replicated proclet hosted here: numbered, sent to every
    /// backup while it runs here, answered once they all applied it (see the module
    /// doc). `arg` is the encoded argument; the result is the encoded return value.
    pub(crate) async fn call_replicated(
        &self,
        slot: &Arc<Slot>,
        code: CodeRef,
        chain: ChainId,
        call: u64,
        arg: Bytes,
    ) -> Result<Bytes, RemoteError> {
        let id = slot.id;
        let Some(primary) = self.replication.primary(id) else {
            return Err(RemoteError::Internal(format!(
                "proclet {id} is marked replicated but has no configuration here"
            )));
        };
        let desc = shipping::resolve(code, Expect::CallMut)?;
        if desc.state_type() != slot.state_type {
            return Err(RemoteError::CodeMismatch(format!(
                "the closure expects another state type than proclet {id} holds"
            )));
        }
        let Entry::CallMut(f) = desc.entry else {
            return Err(RemoteError::CodeMismatch("not a mutating call".into()));
        };
        let guard = self.lock_slot(slot, chain, CallMode::Exclusive).await?;
        // A call alone on this node (a caller waiting on it, nothing else to do) waits
        // for its backups by polling rather than sleeping: see `await_applied`.
        let (_running, alone) = Running::enter(&self.replication.running);
        // A retry of a call this copy (or the backup it was) already answered.
        if let Some(r) = primary.answered.lock().get(call) {
            return r;
        }
        let seq = {
            let mut s = primary.seq.lock();
            *s += 1;
            *s
        };
        let config = primary.config.borrow().clone();
        let mut apply = Msg::Apply {
            proclet: id,
            epoch: config.epoch,
            seq,
            call,
            code,
            chain,
            effects: 0,
        };
        // Sent before the closure runs here, so the backups run it at the same time —
        // unless the proclet's calls have effects, which the backups need first.
        let early = !primary.effectful.load(Ordering::Relaxed);
        let mut pending = Vec::with_capacity(config.backups.len());
        if early {
            self.send_to_backups(&config, &apply, &arg, &mut pending)
                .await?;
        }
        let recorder = Recorder::new(call);
        let result: Result<Bytes, RemoteError> = {
            let _scope = context::ChainScope::enter(chain);
            let _effects = effects::enter(Scope::Record(recorder.clone()));
            let _busy = self.hosting.busy.enter();
            let mut out = Vec::new();
            guard
                .with_mut(|s| f(s, &arg, &mut out))
                .map(|()| Bytes::from(out))
        };
        let recorded = recorder.finish();
        let mut tail = arg.clone();
        // Sent after the run, the effects go along even when there are none: the backup
        // then knows there are none, and does not wait for any.
        if !recorded.is_empty() || !early {
            let fx = effects::encode(&recorded);
            if let Msg::Apply { effects, .. } = &mut apply {
                *effects = fx.len() as u32;
            }
            let mut t = Vec::with_capacity(arg.len() + fx.len());
            t.extend_from_slice(&arg);
            t.extend_from_slice(&fx);
            tail = Bytes::from(t);
            if early && !recorded.is_empty() {
                // The backups got the call without them and wait at its first effect.
                primary.effectful.store(true, Ordering::Relaxed);
                Box::pin(self.send_late_effects(&config, id, seq, Bytes::from(fx))).await;
            }
        }
        if !early {
            self.send_to_backups(&config, &apply, &tail, &mut pending)
                .await?;
        }
        let mine = digest(&result);
        let ctx = Pending {
            slot,
            guard: &guard,
            primary: &primary,
            apply: &apply,
            tail: &tail,
            epoch: config.epoch,
            seq,
            mine,
            alone,
        };
        for (b, sent) in pending {
            self.await_applied(&ctx, &b, sent).await?;
        }
        primary.answered.lock().record(call, &result);
        self.replication
            .replicated_calls
            .fetch_add(1, Ordering::Relaxed);
        drop(guard);
        self.hosting.calls_served.fetch_add(1, Ordering::Relaxed);
        if let Err(f) = granule_failpoints::hit("replicate.before_reply").await {
            // Applied everywhere, but the answer is lost: what a primary dying right
            // after its backups applied a call looks like to the caller.
            return Err(RemoteError::Internal(f.to_string()));
        }
        result
    }

    /// Start sending call `apply` (with `tail`) to every backup of `config`.
    async fn send_to_backups(
        &self,
        config: &Config,
        apply: &Msg,
        tail: &Bytes,
        pending: &mut Vec<(Location, Result<ApplyReply, RemoteError>)>,
    ) -> Result<(), RemoteError> {
        for b in config.backups.iter() {
            pending.push((b.clone(), self.send_apply(b, apply, tail.clone()).await));
            if let Err(f) = granule_failpoints::hit("replicate.after_send").await {
                // Crash: some backups have the call and some do not.
                return Err(RemoteError::Internal(f.to_string()));
            }
        }
        Ok(())
    }

    /// Send the effects of call `seq`, sent before it ran here, to the backups waiting
    /// for them. Not waited for: a backup that misses them is sent the call again with
    /// them (`await_applied`), or gives up and is sent the whole state.
    async fn send_late_effects(&self, config: &Config, id: ProcletId, seq: u64, fx: Bytes) {
        let msg = Msg::Effects {
            proclet: id,
            epoch: config.epoch,
            seq,
        };
        for b in config.backups.iter() {
            if let Ok(conn) = self.peers.connect(b.node, &b.addr).await {
                if let Ok(fut) = conn.start_request_bytes(&msg, fx.clone()) {
                    self.handle.spawn(async move {
                        let _ = fut.await;
                    });
                }
            }
        }
    }

    /// Start sending call `apply` to backup `b`.
    async fn send_apply(
        &self,
        b: &Location,
        apply: &Msg,
        arg: Bytes,
    ) -> Result<ApplyReply, RemoteError> {
        let conn = self
            .peers
            .connect(b.node, &b.addr)
            .await
            .map_err(|e| RemoteError::Internal(e.to_string()))?;
        let fut = conn
            .start_request_bytes(apply, arg)
            .map_err(|e| RemoteError::Internal(e.to_string()))?;
        Ok(Box::pin(fut))
    }

    /// Wait until backup `b` applied call `seq`, or left the configuration. A backup
    /// that fails to answer is asked again (the same `seq`: it answers from what it
    /// recorded if it had applied it) until the controller removes it. A backup that
    /// is behind (it missed a call: a primary died between its backups, and a backup
    /// became primary ahead of another) is sent the whole state, which includes this
    /// call.
    async fn await_applied(
        &self,
        ctx: &Pending<'_>,
        b: &Location,
        mut sent: Result<ApplyReply, RemoteError>,
    ) -> Result<(), RemoteError> {
        let (id, primary, apply, tail, seq, mine) = (
            ctx.slot.id,
            ctx.primary,
            ctx.apply,
            ctx.tail,
            ctx.seq,
            ctx.mine,
        );
        let mut changes = primary.config.subscribe();
        let still_backup = |c: &Config| c.backups.iter().any(|x| x.node == b.node);
        // Said once per call: the call is retried every 50 ms meanwhile.
        let mut said = false;
        let mut polled = if ctx.alone {
            self.poll_for_applied(&mut sent).await
        } else {
            None
        };
        loop {
            let outcome = match &mut sent {
                _ if polled.is_some() => polled.take(),
                Ok(fut) => {
                    tokio::select! {
                        r = fut => Some(r),
                        changed = changes.changed() => {
                            if changed.is_err() || !still_backup(&changes.borrow()) {
                                return Ok(());
                            }
                            None
                        }
                    }
                }
                Err(_) => None,
            };
            match outcome {
                Some(Ok(Frame {
                    msg: Msg::Applied { digest, .. },
                    ..
                })) => {
                    if digest != mine {
                        self.replication.divergences.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(proclet = %id, seq, backup = %b.node,
                            "a backup's result differs from the primary's: the closure is not \
                             deterministic (see docs/guide/replication.md); the copies may now differ");
                    }
                    return Ok(());
                }
                Some(Ok(Frame {
                    msg: Msg::Error(RemoteError::Refused(m)),
                    ..
                })) if m.contains(BEHIND) => match Box::pin(self.resync(ctx, b)).await {
                    Ok(()) => return Ok(()),
                    Err(e) if !std::mem::replace(&mut said, true) => {
                        tracing::warn!(proclet = %id, seq, backup = %b.node,
                                "a backup is behind and could not be sent the state: {e}");
                    }
                    Err(_) => {}
                },
                Some(Ok(Frame {
                    msg: Msg::Error(e), ..
                })) if !std::mem::replace(&mut said, true) => {
                    tracing::warn!(proclet = %id, seq, backup = %b.node,
                        "a backup refused a call (held until it applies it or leaves the configuration): {e}");
                }
                Some(Ok(f)) if !std::mem::replace(&mut said, true) => {
                    tracing::warn!(proclet = %id, seq, backup = %b.node,
                        "unexpected answer {} to a replicated call", f.msg.name());
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::debug!(proclet = %id, seq, backup = %b.node, "a backup did not answer: {e}");
                }
                None => {}
            }
            // Not applied there (yet): hold the call until the controller removes the
            // backup, asking it again now and then in case it was only slow to connect.
            if !still_backup(&changes.borrow()) {
                return Ok(());
            }
            let retry = tokio::time::sleep(Duration::from_millis(50));
            tokio::select! {
                _ = retry => {}
                changed = changes.changed() => {
                    if changed.is_err() || !still_backup(&changes.borrow()) {
                        return Ok(());
                    }
                }
            }
            if self.is_stopped() {
                return Err(RemoteError::Internal("the node is stopping".into()));
            }
            // Under the configuration's epoch now: a backup that has heard of a newer
            // one (another copy was lost meanwhile) refuses the old.
            let mut again = apply.clone();
            if let Msg::Apply { epoch, .. } = &mut again {
                *epoch = (*epoch).max(changes.borrow().epoch);
            }
            sent = self.send_apply(b, &again, tail.clone()).await;
        }
    }

    /// Poll for a backup's answer for up to `transport.spin`, yielding to this worker's
    /// other tasks (and to its poll of the sockets) between polls. A worker that went to
    /// sleep instead would leave its vCPU idle, and waking an idle vCPU costs ~50–100 µs
    /// on this class of VM: more than the backup takes to answer. Only a call alone on its
    /// node polls: under load the worker has other calls to run meanwhile, and the answer
    /// finds it awake.
    async fn poll_for_applied(
        &self,
        sent: &mut Result<ApplyReply, RemoteError>,
    ) -> Option<Result<Frame, granule_transport::TransportError>> {
        use futures::FutureExt;
        let Ok(fut) = sent else {
            return None;
        };
        let until = std::time::Instant::now() + self.config.transport.spin;
        loop {
            if let Some(r) = fut.as_mut().now_or_never() {
                return Some(r);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            tokio::task::yield_now().await;
        }
    }

    /// Send backup `b`, which is behind, the whole state as it is after call
    /// `ctx.seq` (the call's lock is held: nothing changes it meanwhile).
    async fn resync(&self, ctx: &Pending<'_>, b: &Location) -> Result<(), RemoteError> {
        let copy = Copy {
            epoch: ctx.epoch,
            copies: ctx.primary.copies,
            seq: ctx.seq,
        };
        let bytes = self.stream_copy(ctx.slot, ctx.guard, b, copy).await?;
        tracing::info!(proclet = %ctx.slot.id, seq = ctx.seq, backup = %b.node, bytes,
            "a backup that was behind was sent the whole state");
        Ok(())
    }

    /// Stream the state of `slot` (its exclusive lock `guard` held) to node `to` as a
    /// backup copy: encoded bytes sent.
    async fn stream_copy(
        &self,
        slot: &Arc<Slot>,
        guard: &crate::slot::Guard,
        to: &Location,
        copy: Copy,
    ) -> Result<u64, RemoteError> {
        let ops = slot
            .state_desc
            .state_ops()
            .ok_or_else(|| RemoteError::Internal("slot without a state descriptor".into()))?;
        let conn = self.peers.connect(to.node, &to.addr).await.map_err(|e| {
            RemoteError::Internal(format!("cannot reach node {} for a copy: {e}", to.node))
        })?;
        let header = |p: ChunkPos| Msg::BackupChunk {
            proclet: slot.id,
            kind: slot.kind(),
            state: shipping::code_ref(slot.state_desc),
            epoch: copy.epoch,
            offset: p.offset,
            total: p.total,
            last: p.last,
            copies: copy.copies,
            seq: copy.seq,
        };
        let settings = Settings::of(&self.migration.config, None);
        stream::send_encoded(&conn, slot, guard, ops, &header, settings).await
    }

    /// Move replicated proclet `id`, whose primary is here, to node `to` (the pressure
    /// policy's moves and explicit ones), keeping its number of copies. Under the
    /// proclet's exclusive lock (every call so far applied on every backup): a node with
    /// no copy is streamed one; the controller then makes `to` the primary under a new
    /// epoch (`Msg::HandOver`) and tells it and the backups. If `to` was a backup, this
    /// node keeps the state as a backup in its place; otherwise it drops its copy.
    pub(super) async fn move_replicated(
        &self,
        slot: &Arc<Slot>,
        to: &Location,
    ) -> Result<granule_wire::MoveStats, RemoteError> {
        let id = slot.id;
        let t0 = std::time::Instant::now();
        let primary = self.replication.primary(id).ok_or_else(|| {
            RemoteError::Internal(format!("replicated proclet {id} has no configuration here"))
        })?;
        let guard = self
            .lock_slot(slot, context::new_chain(), CallMode::Exclusive)
            .await?;
        let drained = t0.elapsed();
        let config = primary.config.borrow().clone();
        let seq = *primary.seq.lock();
        let swap = config.backups.iter().any(|b| b.node == to.node);
        let mut bytes = 0;
        if !swap {
            let copy = Copy {
                epoch: config.epoch,
                copies: primary.copies,
                seq,
            };
            bytes = self.stream_copy(slot, &guard, to, copy).await?;
            if let Err(f) = granule_failpoints::hit("replicate.move.streamed").await {
                self.drop_copies(id, &[to]).await;
                return Err(RemoteError::Refused(f.to_string()));
            }
        }
        let mut backups: Vec<Location> = config
            .backups
            .iter()
            .filter(|b| b.node != to.node)
            .cloned()
            .collect();
        if swap {
            backups.push(Location {
                node: self.id,
                addr: self.addr.clone(),
                epoch: 0,
            });
        }
        let epoch = config.epoch + 1;
        let at = Location {
            node: to.node,
            addr: to.addr.clone(),
            epoch,
        };
        let set = ReplicaSet {
            proclet: id,
            epoch,
            primary: at.clone(),
            backups,
        };
        if let Err(e) = self.controller.hand_over(set.clone()).await {
            // The answer may be lost after the controller recorded it: ask.
            let recorded = matches!(self.controller.locate(id).await,
                Ok(Some((l, _))) if l.node == to.node && l.epoch == epoch);
            if !recorded {
                if !swap {
                    self.drop_copies(id, &[to]).await;
                }
                return Err(RemoteError::Refused(format!(
                    "the controller did not hand proclet {id} over to {}: {e}",
                    to.node
                )));
            }
        }
        if let Err(f) = granule_failpoints::hit("replicate.move.handed_over").await {
            // Only `crash` means anything here: the hand-over stands either way.
            tracing::warn!(proclet = %id, "{f}");
        }
        // `to` is the primary now: nothing more is granted here, and callers waiting
        // for the lock go there.
        self.locations.forward(id, at.clone());
        guard.set_status(crate::slot::SlotStatus::Moved(at));
        let state = guard.take_state();
        self.hosting.remove(slot);
        self.replication.primaries.remove(&id);
        if swap {
            let answered = std::mem::take(&mut *primary.answered.lock());
            let copy = Slot::new(id, slot.kind(), slot.state_desc, epoch, state, None);
            self.replication.backups.insert(
                id,
                Backup::new(
                    copy,
                    Copy {
                        epoch,
                        copies: primary.copies,
                        seq,
                    },
                    answered,
                    primary.effectful.load(Ordering::Relaxed),
                    slot.stats.footprint.load(Ordering::Relaxed),
                ),
            );
        } else {
            drop(state);
            self.migration.departed_bytes.fetch_add(
                slot.stats.footprint.load(Ordering::Relaxed),
                Ordering::Relaxed,
            );
        }
        drop(guard);
        let took = t0.elapsed();
        let mut e = granule_wire::ClusterEvent::now(
            granule_wire::EventKind::Migration,
            self.id,
            id.to_string(),
        );
        e.to = Some(to.node);
        e.bytes = bytes;
        e.micros = took.as_micros() as u64;
        crate::telemetry::record_move(self, e);
        tracing::info!(proclet = %id, to = %to.node, epoch, swap, bytes,
            micros = took.as_micros() as u64, "replicated proclet's primary moved");
        Ok(granule_wire::MoveStats {
            bytes,
            micros: took.as_micros() as u64,
            drain_micros: drained.as_micros() as u64,
        })
    }

    /// A backup applies call `seq` (see the module doc).
    pub(super) async fn serve_apply(&self, frame: Frame, reply: Responder) {
        let Msg::Apply {
            proclet,
            epoch,
            seq,
            call,
            code,
            chain,
            effects: fx_len,
        } = frame.msg
        else {
            return;
        };
        let Some(split) = frame.tail.len().checked_sub(fx_len as usize) else {
            return reply.error(RemoteError::Protocol(format!(
                "call {seq} of proclet {proclet} says {fx_len} bytes of effects in a tail of {}",
                frame.tail.len()
            )));
        };
        let arg = frame.tail.slice(..split);
        let recorded = if fx_len == 0 {
            None
        } else {
            match effects::decode(&frame.tail[split..]) {
                Ok(fx) => Some(Arc::new(fx)),
                Err(e) => return reply.error(e),
            }
        };
        if let Err(f) = granule_failpoints::hit("replicate.before_apply").await {
            return reply.error(RemoteError::Refused(f.to_string()));
        }
        if self.hosting.contains(proclet) {
            // A backup promoted since: the sender is a primary that was replaced, and
            // must not be acknowledged.
            return reply.error(RemoteError::Refused(format!(
                "node {} is the primary of proclet {proclet} now",
                self.id
            )));
        }
        let Some(backup) = self.replication.backups.get(&proclet).map(|b| b.clone()) else {
            return reply.error(RemoteError::Refused(format!(
                "node {} keeps no backup of proclet {proclet}: {BEHIND}",
                self.id
            )));
        };
        let desc = match shipping::resolve(code, Expect::CallMut) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let Entry::CallMut(f) = desc.entry else {
            return reply.error(RemoteError::CodeMismatch("not a mutating call".into()));
        };
        if desc.state_type() != backup.slot.state_type {
            return reply.error(RemoteError::CodeMismatch(format!(
                "the closure expects another state type than proclet {proclet} holds"
            )));
        }
        if let Some(fx) = &recorded {
            // A re-sent call carrying the effects an earlier copy of it waits for.
            backup.late.send_replace(Late::Effects {
                seq,
                effects: fx.clone(),
            });
        }
        let guard = match self
            .lock_slot(&backup.slot, chain, CallMode::Exclusive)
            .await
        {
            Ok(g) => g,
            Err(e) => return reply.error(e),
        };
        {
            let mut p = backup.progress.lock();
            if epoch < p.epoch {
                return reply.error(RemoteError::Refused(format!(
                    "call {seq} of proclet {proclet} comes from epoch {epoch}; this copy is at {}",
                    p.epoch
                )));
            }
            if epoch > p.epoch && seq <= p.applied {
                // Calls this copy applied under the old epoch may not be the new
                // primary's (a replaced primary reached it first): start over from the
                // new primary's state.
                return reply.error(RemoteError::Refused(format!(
                    "call {seq} of proclet {proclet} comes from a new epoch {epoch}, and this \
                     copy applied calls up to {} under {}: {BEHIND}",
                    p.applied, p.epoch
                )));
            }
            p.epoch = epoch;
            if seq <= p.applied {
                if seq == p.applied && call != p.last_call {
                    // Another call under the same number: a replaced primary's, which
                    // the new primary never had. Start over from the new primary's state.
                    return reply.error(RemoteError::Refused(format!(
                        "call {seq} of proclet {proclet} here was another call: {BEHIND}"
                    )));
                }
                if seq == p.applied {
                    let digest = p.last_digest;
                    drop(p);
                    let _ = reply.send(&Msg::Applied { seq, digest }, &[]);
                    return;
                }
                return reply.error(RemoteError::Refused(format!(
                    "call {seq} of proclet {proclet} was applied long ago (now at {})",
                    p.applied
                )));
            }
            if seq != p.applied + 1 {
                return reply.error(RemoteError::Refused(format!(
                    "call {seq} of proclet {proclet} arrived after {}: {BEHIND}",
                    p.applied
                )));
            }
        }
        let replayer = Replayer::new(call, seq, recorded, backup.late.subscribe());
        let result: Result<Bytes, RemoteError> = {
            let _scope = context::ChainScope::enter(chain);
            let _effects = effects::enter(Scope::Replay(replayer.clone()));
            let _busy = self.hosting.busy.enter();
            let mut out = Vec::new();
            guard
                .with_mut(|s| f(s, &arg, &mut out))
                .map(|()| Bytes::from(out))
        };
        if replayer.abandoned() {
            // Part of the call ran without what it did on the primary: this copy is no
            // longer the primary's. Dropped; the primary sends the whole state again.
            drop(guard);
            self.replication.backups.remove(&proclet);
            return reply.error(RemoteError::Refused(format!(
                "call {seq} of proclet {proclet} could not be re-run here: {BEHIND}"
            )));
        }
        if replayer.used() {
            backup.effectful.store(true, Ordering::Relaxed);
        }
        let mut digest = digest(&result);
        if replayer.mismatched() {
            // Logged where it was found; the primary counts it.
            digest = !digest;
        }
        {
            let mut p = backup.progress.lock();
            p.applied = seq;
            p.last_call = call;
            p.last_digest = digest;
        }
        backup.answered.lock().record(call, &result);
        drop(guard);
        let _ = reply.send(&Msg::Applied { seq, digest }, &[]);
    }

    /// The effects of a call sent before it ran on the primary (on the connection's
    /// reader): for the backup's re-run of it, which waits for them.
    pub(super) fn receive_effects(&self, frame: Frame, reply: Responder) {
        let Msg::Effects { proclet, seq, .. } = frame.msg else {
            return;
        };
        let fx = match effects::decode(&frame.tail) {
            Ok(fx) => fx,
            Err(e) => return reply.error(e),
        };
        match self.replication.backups.get(&proclet) {
            Some(b) => {
                b.late.send_replace(Late::Effects {
                    seq,
                    effects: Arc::new(fx),
                });
                let _ = reply.send(&Msg::Done, &[]);
            }
            None => reply.error(RemoteError::Refused(format!(
                "node {} keeps no backup of proclet {proclet}",
                self.id
            ))),
        }
    }

    /// One chunk of a backup's state (on the connection's reader, in order); the last
    /// one installs the copy.
    pub(super) fn receive_backup_chunk(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        frame: Frame,
        reply: Responder,
    ) {
        let Msg::BackupChunk {
            proclet,
            kind,
            state,
            epoch,
            offset,
            total,
            last,
            copies,
            seq,
        } = frame.msg
        else {
            return;
        };
        let open = || {
            if self.hosting.contains(proclet) {
                return Err(RemoteError::Refused(format!(
                    "node {} is the primary of proclet {proclet}",
                    self.id
                )));
            }
            if let Some(b) = self.replication.backups.get(&proclet) {
                let have = b.progress.lock().epoch;
                if have > epoch {
                    return Err(RemoteError::Refused(format!(
                        "the copy of proclet {proclet} here is at epoch {have}, the state sent at {epoch}"
                    )));
                }
            }
            let desc = shipping::resolve(state, Expect::State)?;
            let ops = desc
                .state_ops()
                .ok_or_else(|| RemoteError::CodeMismatch("not a state descriptor".into()))?;
            let room = self.monitor.mem_room();
            if total > 0 && room < total as i64 {
                return Err(RemoteError::NoCapacity(format!(
                    "node {} has {} bytes of room, the backup needs {total}",
                    self.id,
                    room.max(0)
                )));
            }
            Ok(ArrivingBackup {
                desc,
                ops,
                kind,
                copy: Copy { epoch, copies, seq },
            })
        };
        if let Err(f) = granule_failpoints::hit_blocking("stream.chunk_received") {
            return reply.error(RemoteError::Internal(f.to_string()));
        }
        let chunk = stream::Chunk {
            conn,
            proclet,
            offset,
            last,
            bytes: &frame.tail,
        };
        let (buf, a) = match self.replication.inbound.take(chunk, total as usize, open) {
            Err(e) => return reply.error(e),
            Ok(None) => {
                let _ = reply.send(&Msg::Done, &[]);
                return;
            }
            Ok(Some(whole)) => whole,
        };
        let node = self.clone();
        let nice = self.migration.config.nice;
        let size = buf.len() as u64;
        // An arrival, not growth of the node's own: the pressure monitor counts it out
        // (as it does a moved proclet), or it would shed what just came.
        self.migration
            .received_bytes
            .fetch_add(size, Ordering::Relaxed);
        self.handle.spawn(async move {
            let decoded = stream::in_background(nice, move || (a.ops.decode)(&buf)).await;
            let state = match decoded {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return reply.error(e),
                Err(e) => {
                    return reply.error(RemoteError::Internal(format!("decoding failed: {e}")))
                }
            };
            let slot = Slot::new(proclet, a.kind, a.desc, a.copy.epoch, state, None);
            node.replication.backups.insert(
                proclet,
                Backup::new(slot, a.copy, Answered::default(), false, size),
            );
            let _ = reply.send(&Msg::Done, &[]);
        });
    }

    /// The controller's new configuration of a replicated proclet whose primary is this
    /// node: a backup kept here becomes the primary (promotion), or a primary here learns
    /// it lost a backup.
    pub(super) fn on_replicas(self: &Arc<Self>, set: ReplicaSet) {
        if set.primary.node != self.id {
            // A backup here learns the new epoch: calls from the replaced primary are
            // refused from now on.
            if let Some(b) = self.replication.backups.get(&set.proclet) {
                let mut p = b.progress.lock();
                p.epoch = p.epoch.max(set.epoch);
            }
            return;
        }
        let id = set.proclet;
        let config = Config {
            epoch: set.epoch,
            backups: set.backups.clone().into(),
        };
        if let Some(p) = self.replication.primary(id) {
            p.adopt(config);
            self.clone().restore_copies(id, p.copies, set.backups.len());
            return;
        }
        // Kept in the table until it is installed as the primary: a call arriving
        // meanwhile waits for the promotion instead of being told "not here".
        let Some(backup) = self.replication.backups.get(&id).map(|b| b.clone()) else {
            tracing::warn!(proclet = %id, "told to be the primary of a proclet with no copy here");
            return;
        };
        // From now on the replaced primary's calls are refused here.
        {
            let mut p = backup.progress.lock();
            p.epoch = p.epoch.max(set.epoch);
        }
        // A call re-running here that waits for its effects from the replaced primary
        // performs them itself now.
        backup.late.send_replace(Late::Promoted);
        let node = self.clone();
        self.handle.spawn(async move {
            // Whatever the copy is applying finishes first.
            let guard = match node
                .lock_slot(&backup.slot, context::new_chain(), CallMode::Exclusive)
                .await
            {
                Ok(g) => g,
                Err(e) => {
                    tracing::error!(proclet = %id, "cannot promote the backup: {e}");
                    return;
                }
            };
            let state = guard.take_state();
            let applied = backup.progress.lock().applied;
            let answered = std::mem::take(&mut *backup.answered.lock());
            node.replication.primaries.insert(
                id,
                Primary::new(
                    config,
                    applied,
                    answered,
                    backup.copies,
                    backup.effectful.load(Ordering::Relaxed),
                ),
            );
            node.install(
                NewSlot {
                    id,
                    kind: backup.slot.kind(),
                    state: backup.slot.state_desc,
                    epoch: set.epoch,
                    pinned: false,
                    group: None,
                },
                state,
            );
            if let Some(slot) = node.hosting.get(id) {
                slot.replicated.store(true, Ordering::Release);
            }
            node.replication.backups.remove(&id);
            drop(guard);
            tracing::info!(proclet = %id, epoch = set.epoch, backups = set.backups.len(),
                "this node's backup became the proclet's primary");
            node.clone()
                .restore_copies(id, backup.copies, set.backups.len());
        });
    }

    /// After a loss: give proclet `id` (a primary here) new backups until it has
    /// `copies` copies again, in the background. Calls are held only while the state
    /// streams to them (under the proclet's exclusive lock). An attempt that fails (too
    /// few live nodes, or the node receiving the copy died) is tried again, less and less
    /// often, for as long as this node is the primary and a copy is missing: a node that
    /// joins later takes the copy. One such task per proclet.
    fn restore_copies(self: Arc<Self>, id: ProcletId, copies: u32, backups: usize) {
        if (copies as usize) <= backups + 1 {
            return;
        }
        let Some(primary) = self.replication.primary(id) else {
            return;
        };
        if primary.restoring.swap(true, Ordering::AcqRel) {
            return;
        }
        let node = self.clone();
        self.handle.spawn(async move {
            let started = std::time::Instant::now();
            let mut wait = Duration::from_millis(100);
            let mut said = false;
            loop {
                // Still the primary, still short of copies?
                let current = node.replication.primary(id);
                let missing = match &current {
                    Some(p) if Arc::ptr_eq(p, &primary) => {
                        (copies as usize).saturating_sub(p.config.borrow().backups.len() + 1) as u32
                    }
                    _ => 0,
                };
                if missing == 0 || node.is_stopped() {
                    break;
                }
                let outcome = match node.controller.place_backups(id, missing).await {
                    Ok(set) => node.add_backups(set, copies).await.map(|_| ()),
                    Err(e) => Err(RemoteError::NoCapacity(e.to_string())),
                };
                match outcome {
                    Ok(()) => tracing::info!(proclet = %id, copies,
                        micros = started.elapsed().as_micros() as u64, "copies restored"),
                    Err(e) if !std::mem::replace(&mut said, true) => {
                        tracing::warn!(proclet = %id, copies,
                            "running with fewer copies, trying again: {e}")
                    }
                    Err(e) => tracing::debug!(proclet = %id, "copies not restored yet: {e}"),
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            primary.restoring.store(false, Ordering::Release);
        });
    }

    /// A replicated proclet hosted here was destroyed: its backups go too.
    pub(super) async fn drop_replicas(&self, id: ProcletId) {
        let Some((_, p)) = self.replication.primaries.remove(&id) else {
            return;
        };
        let backups = p.config.borrow().backups.clone();
        for b in backups.iter() {
            if let Ok(conn) = self.peers.connect(b.node, &b.addr).await {
                let _ = conn.request(&Msg::Destroy { proclet: id }, &[]).await;
            }
        }
    }

    /// Drop a backup copy kept here (its proclet was destroyed, or the copy moved);
    /// whether there was one.
    pub(super) fn drop_backup(&self, id: ProcletId) -> bool {
        match self.replication.backups.remove(&id) {
            Some((_, b)) => {
                self.migration
                    .departed_bytes
                    .fetch_add(b.bytes, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }
}

/// Which copy of the state a stream makes (see `Msg::BackupChunk`), or a backup holds.
#[derive(Clone, Copy)]
struct Copy {
    epoch: Epoch,
    copies: u32,
    seq: u64,
}

/// A replicated call waiting for its backups: what `await_applied` needs.
struct Pending<'a> {
    slot: &'a Arc<Slot>,
    guard: &'a crate::slot::Guard,
    primary: &'a Primary,
    apply: &'a Msg,
    /// The call's argument, then its effects (as `apply` says).
    tail: &'a Bytes,
    epoch: Epoch,
    seq: u64,
    /// The digest of the primary's result.
    mine: u64,
    /// The only replicated call running on this node.
    alone: bool,
}

type ApplyReply = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Frame, granule_transport::TransportError>> + Send>,
>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_of_answered_calls_is_bounded_in_count_and_bytes() {
        let mut a = Answered::default();
        for call in 1..=(REMEMBERED_CALLS as u64 + 10) {
            a.record(call, &Ok(Bytes::from_static(b"x")));
        }
        assert_eq!(a.order.len(), REMEMBERED_CALLS);
        assert!(a.get(1).is_none() && a.get(REMEMBERED_CALLS as u64 + 10).is_some());
        // Large results: only as many as fit in the byte bound, the newest always.
        let big = Bytes::from(vec![0u8; 6 << 20]);
        for call in 5000..5010 {
            a.record(call, &Ok(big.clone()));
        }
        assert!(a.bytes <= REMEMBERED_BYTES, "{}", a.bytes);
        assert!(a.get(5009).is_some() && a.get(5000).is_none());
        let huge = Bytes::from(vec![0u8; 32 << 20]);
        a.record(6000, &Ok(huge));
        assert_eq!(a.order.len(), 1);
        assert!(a.get(6000).is_some());
        // Call 0 (no id) is never recorded.
        a.record(0, &Ok(Bytes::new()));
        assert!(a.get(0).is_none());
    }

    #[test]
    fn digests_tell_results_and_errors_apart() {
        let ok = digest(&Ok(Bytes::from_static(b"1")));
        assert_eq!(ok, digest(&Ok(Bytes::from_static(b"1"))));
        assert_ne!(ok, digest(&Ok(Bytes::from_static(b"2"))));
        assert_ne!(ok, digest(&Err(RemoteError::Panic("1".into()))));
    }
}
