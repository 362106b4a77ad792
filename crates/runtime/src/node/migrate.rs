//! The migration engine: moving a hosted proclet to another node while callers keep
//! calling, over a state stream (`stream.rs`).
//!
//! A move of proclet P from source S to destination D:
//! 1. S marks P moving and asks code running on P to yield at its next item boundary
//!    (`should_yield`; only long-running closures look), then takes P's lock: exclusively
//!    for a byte-vector state (taken out to be sent as is) and for a state whose reads
//!    change it (`ProcletBuilder::mutating_reads`), shared for any other (encoded in
//!    place). Calls in flight that change the state finish first; from now on calls that
//!    would change it queue on the lock: they are *held*. With a shared lock, read-only
//!    calls keep being served at S meanwhile — nothing can change the state.
//! 2. S streams P's state to D in `Transfer` chunks over their connection. D appends the
//!    chunks and, at the last one, decodes the state and installs P with the next epoch —
//!    *provisionally*: its lock is held, so calls reaching D wait — and confirms.
//! 3. On D's confirmation the move is decided: S remembers the new location as a
//!    forwarding hint, marks P moved (nothing more is granted at S, reads included),
//!    tells D the move is final (`TransferCommit`, one-way: no extra round trip) and
//!    releases the lock: every held call fails over to D with a "not here, now at D"
//!    answer and is retried there by its caller's runtime. D serves P from the commit
//!    on (calls reaching it earlier wait for it). Held calls never ran at S, so none runs twice and none is lost;
//!    callers see no error. Both S and D record P's new location (and epoch) at the
//!    controller, which keeps the newest.
//! 4. If anything fails before D's confirmation reached S (D unreachable, dying or silent
//!    for `migration.stall_timeout`, encoding error), S sends `TransferAbort`, puts the
//!    state back and releases the lock: P stays usable at S and held calls run there. D
//!    drops what arrived, or withdraws a provisional copy (calls waiting on it go back to
//!    S). A commit or abort that never reaches D (a connection cut, a partition) is
//!    resolved by D: it asks S whether the move committed, and, when S cannot answer,
//!    the controller. So a lost confirmation can leave neither two live copies nor none.
//!
//! Cached locations catch up through epochs: a stale cache entry leads to S (or to a node
//! that never had P), whose "not here" answer carries the newer location.
//!
//! Failpoints (see `granule-failpoints`) mark each step: `migrate.before_lock`,
//! `migrate.locked`, `stream.chunk_sent`, `migrate.streamed`, `migrate.before_controller`
//! at the source; `stream.chunk_received`, `migrate.before_install`, `migrate.installed`
//! at the destination.

use super::hosting::NewSlot;
use super::stream::{self, ChunkPos, Inbound, Settings};
use super::NodeInner;
use crate::context;
use crate::shipping::{self, Expect, StateOps};
use crate::slot::Guard;
use crate::slot::{Slot, SlotStatus};
use bytes::Bytes;
use dashmap::DashMap;
use granule_transport::{Connection, Responder};
use granule_wire::{
    CallMode, ClusterEvent, EventKind, Frame, Kind, Location, MoveStats, Msg, NodeId, ProcletId,
    RemoteError,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a move waits for another move of the same proclet to finish.
const MOVE_WAIT: Duration = Duration::from_secs(30);

/// Moves in both directions: the engine's settings, the states arriving, arrivals not
/// yet committed, and what was moved.
pub(crate) struct Migration {
    pub config: granule_config::Migration,
    inbound: Inbound<Arriving>,
    provisional: DashMap<ProcletId, Provisional>,
    pub moves_out: AtomicU64,
    /// Bytes of state received by migration since the node started.
    pub received_bytes: AtomicU64,
    /// Bytes of state moved away and freed since the node started.
    pub departed_bytes: AtomicU64,
}

/// An arrived proclet whose move is not committed yet: hosted, but its lock held.
struct Provisional {
    /// The connection it arrived on (commit and abort must come on it too).
    conn: u64,
    epoch: u64,
    /// The node it came from, to ask when the commit does not come.
    source: Option<NodeId>,
    held: Guard,
}

/// What the first chunk of an arriving state said.
struct Arriving {
    ops: StateOps,
    desc: &'static shipping::Descriptor,
    kind: Kind,
    epoch: u64,
    raw: bool,
    pinned: bool,
    group: Option<String>,
}

impl Migration {
    pub(super) fn new(config: granule_config::Migration) -> Migration {
        Migration {
            config,
            inbound: Inbound::default(),
            provisional: DashMap::new(),
            moves_out: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            departed_bytes: AtomicU64::new(0),
        }
    }
}

/// Clears a slot's "moving" mark when a move ends, however it ends.
struct MovingMark<'a>(&'a Slot);

impl Drop for MovingMark<'_> {
    fn drop(&mut self) {
        crate::accounting::clear_yield(self.0.serial);
        self.0.moving.store(false, Ordering::Release);
    }
}

fn failed_step(f: granule_failpoints::Fired) -> RemoteError {
    RemoteError::Internal(f.to_string())
}

impl NodeInner {
    /// [`NodeInner::move_out`], run on the node's workers, where the connections' tasks
    /// live (no cross-thread wake-ups while streaming). A closure running on the proclet
    /// is asked to yield first, from here: it may be occupying the very worker the move
    /// needs.
    ///
    /// `duty`: the share of the time the move may keep the node's CPU busy (a shedding
    /// move: `migration.duty`); `None` for as fast as it can.
    pub(crate) async fn move_out_on_workers(
        self: &Arc<Self>,
        proclet: ProcletId,
        to: Location,
        duty: Option<f64>,
    ) -> Result<MoveStats, RemoteError> {
        let slot = self.hosting.get(proclet);
        let asked = slot.as_ref().filter(|s| {
            to.node != self.id
                && !s.pinned.load(Ordering::Relaxed)
                && !s.moving.load(Ordering::Relaxed)
        });
        if let Some(s) = asked {
            crate::accounting::request_yield(s.serial);
        }
        let node = self.clone();
        let out = self
            .handle
            .spawn(async move { node.move_out(proclet, to, duty).await })
            .await
            .map_err(|e| RemoteError::Internal(format!("the move task failed: {e}")))?;
        // A move that ended early (refused, or the proclet left meanwhile) never reached
        // the point that withdraws the request: withdraw it here, unless another move of
        // the proclet is under way and still needs it.
        if let Some(s) = asked {
            if !s.moving.load(Ordering::Acquire) {
                crate::accounting::clear_yield(s.serial);
            }
        }
        out
    }

    /// Move hosted proclet `proclet` to `to` (see the module doc). The epoch in `to` is a
    /// floor: the new epoch is always above the proclet's current one.
    async fn move_out(
        self: &Arc<Self>,
        proclet: ProcletId,
        to: Location,
        duty: Option<f64>,
    ) -> Result<MoveStats, RemoteError> {
        let Some(slot) = self.hosting.get(proclet) else {
            if self.replication.has_backup(proclet) && to.node != self.id {
                // A backup copy kept here (the pressure policy sheds those too).
                return self.move_backup_away(proclet, &to).await;
            }
            return Err(self.not_here(proclet));
        };
        if to.node == self.id {
            return Ok(MoveStats::default());
        }
        if slot.pinned.load(Ordering::Relaxed) {
            return Err(RemoteError::Refused(format!(
                "proclet {proclet} is pinned to node {}",
                self.id
            )));
        }
        if slot.replicated.load(Ordering::Acquire) {
            // Its backups come along in the move: see `move_replicated`.
            return self.move_replicated(&slot, &to).await;
        }
        // One move at a time: a second one waits for the first, then moves the proclet
        // on if it is still here, or says where it went.
        let deadline = Instant::now() + MOVE_WAIT;
        while slot.moving.swap(true, Ordering::AcqRel) {
            if Instant::now() > deadline {
                return Err(RemoteError::Refused(format!(
                    "proclet {proclet} is still moving after {MOVE_WAIT:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if self
            .hosting
            .get(proclet)
            .is_none_or(|s| !Arc::ptr_eq(&s, &slot))
        {
            slot.moving.store(false, Ordering::Release);
            return Err(self.not_here(proclet));
        }
        let _mark = MovingMark(&slot);
        let cfg = &self.migration.config;
        if !cfg.delay.is_zero() {
            tokio::time::sleep(cfg.delay).await;
        }
        let ops = slot
            .state_desc
            .state_ops()
            .ok_or_else(|| RemoteError::Internal("slot without a state descriptor".into()))?;
        // A byte-vector state is taken out of the slot and sent as is: that needs the lock
        // exclusively. Any other state is encoded from a shared lock: calls that only read
        // (`run_ref`) keep being served here while it streams — nothing can change it —
        // and calls that would change it are held, then bounced to the new home.
        let raw = (ops.from_raw)(Vec::new()).is_some();
        // A state whose reads change it (`ProcletBuilder::mutating_reads`) is encoded
        // under the exclusive lock too: a read served here while it streams would change
        // the copy that is about to be dropped.
        let mode = if raw || ops.mutating_reads() {
            CallMode::Exclusive
        } else {
            CallMode::Shared
        };
        let t0 = Instant::now();
        crate::telemetry::record_move_started(self);
        let failed = |why: String| {
            let mut e = ClusterEvent::now(EventKind::MigrationFailed, self.id, proclet.to_string());
            e.to = Some(to.node);
            e.micros = t0.elapsed().as_micros() as u64;
            e.detail = why;
            crate::telemetry::record_move(self, e);
        };
        granule_failpoints::hit("migrate.before_lock")
            .await
            .map_err(failed_step)?;
        crate::accounting::request_yield(slot.serial);
        let guard = match self.lock_slot(&slot, context::new_chain(), mode).await {
            Ok(g) => g,
            Err(e) => {
                failed(format!("could not take the proclet: {e}"));
                return Err(e);
            }
        };
        crate::accounting::clear_yield(slot.serial);
        if slot.replicated.load(Ordering::Acquire) {
            // It got its backups while this move waited for the lock: they come along.
            drop(guard);
            drop(_mark);
            return self.move_replicated(&slot, &to).await;
        }
        let drain = t0.elapsed();
        let conn = match self.peers.connect(to.node, &to.addr).await {
            Ok(c) => c,
            Err(e) => {
                let e = RemoteError::Refused(format!("cannot reach the destination: {e}"));
                failed(e.to_string());
                return Err(e);
            }
        };
        // Above the proclet's epoch, the floor the caller gave, and every earlier attempt
        // from here (an abandoned attempt's epoch is never reused).
        let epoch = slot
            .epoch
            .max(to.epoch.saturating_sub(1))
            .max(slot.attempt_epoch.load(Ordering::Acquire))
            + 1;
        slot.attempt_epoch.store(epoch, Ordering::Release);
        let header = |p: ChunkPos| Msg::Transfer {
            proclet,
            kind: slot.kind(),
            state: shipping::code_ref(slot.state_desc),
            epoch,
            offset: p.offset,
            total: p.total,
            last: p.last,
            raw: p.raw,
            pinned: false,
            // Only the first chunk needs it (the receiver keeps the first one's).
            group: (p.offset == 0)
                .then(|| slot.group.as_deref().map(String::from))
                .flatten(),
        };
        let settings = Settings::of(cfg, duty);
        let streaming = Instant::now();
        // A byte-vector state leaves the slot while it streams; it comes back on failure.
        let taken: Option<Bytes> = if raw {
            match (ops.into_raw)(guard.take_state()) {
                Ok(v) => Some(Bytes::from(v)),
                Err(back) => {
                    guard.put_state(back);
                    None
                }
            }
        } else {
            None
        };
        let sent = async {
            granule_failpoints::hit("migrate.locked")
                .await
                .map_err(failed_step)?;
            let bytes = match &taken {
                Some(b) => stream::send_bytes(&conn, b, &header, settings).await?,
                None => stream::send_encoded(&conn, &slot, &guard, ops, &header, settings).await?,
            };
            granule_failpoints::hit("migrate.streamed")
                .await
                .map_err(failed_step)?;
            Ok::<u64, RemoteError>(bytes)
        }
        .await;
        let bytes = match sent {
            Ok(b) => {
                tracing::debug!(%proclet, to = %to.node, bytes = b,
                    drain_micros = drain.as_micros() as u64,
                    stream_micros = streaming.elapsed().as_micros() as u64,
                    "streamed a state (until the destination installed it)");
                b
            }
            Err(e) => {
                let _ = conn.notify(&Msg::TransferAbort { proclet }, &[]);
                if let Some(b) = taken {
                    match (ops.from_raw)(Vec::from(b)) {
                        Some(back) => guard.put_state(back),
                        None => tracing::error!(%proclet, "cannot put a byte-vector state back"),
                    }
                }
                tracing::warn!(%proclet, to = %to.node, "move abandoned, the proclet stays here: {e}");
                failed(format!("abandoned, the proclet stays at its source: {e}"));
                return Err(e);
            }
        };
        // The destination hosts it now: let held calls go there (they are told where),
        // then make it the truth at the controller. Until the controller has it, callers
        // that ask it are sent here and redirected by the forwarding entry; a later move
        // records a higher epoch, which the controller keeps even if this update arrives
        // after it.
        let loc = Location {
            node: to.node,
            addr: to.addr.clone(),
            epoch,
        };
        self.locations.forward(proclet, loc.clone());
        // From here no new call is granted here; readers still inside finish on the old
        // state, which is freed with the slot when the last of them is done.
        guard.set_status(SlotStatus::Moved(loc.clone()));
        // The move is decided: the destination may serve from now on. Only now, after
        // nothing more is granted here, so no read here can miss a write made there.
        let _ = conn.notify(&Msg::TransferCommit { proclet, epoch }, &[]);
        let old = raw.then(|| guard.take_state());
        self.hosting.remove(&slot);
        drop(guard);
        let took = t0.elapsed();
        if let Err(f) = granule_failpoints::hit("migrate.before_controller").await {
            // The move is done; only the controller's record lags (callers follow the
            // forwarding entry meanwhile, and the next move records a newer epoch).
            tracing::warn!(%proclet, "moved, but the controller was not told: {f}");
        } else if let Err(e) = self
            .controller
            .set_location(proclet, loc, slot.kind())
            .await
        {
            tracing::warn!(%proclet, "moved, but the controller was not told: {e}");
        }
        // Freeing a large state takes a while: not on the workers, but at their priority
        // (this is the relief a pressured node moved it for). Under memory pressure the
        // freed pages also go back to the kernel; otherwise the allocator keeps them for
        // the next state this node receives, which then does not pay a page fault per page.
        // Once freed, the bytes count as departed, so the monitor does not mistake the
        // drop for the end of whatever growth it is running from.
        let trim = bytes >= (1 << 20) && self.monitor.reading().mem_pressure;
        drop(_mark);
        let node = self.clone();
        tokio::task::spawn_blocking(move || {
            drop(old);
            drop(taken);
            drop(slot);
            if trim {
                granule_host::os::release_free_memory();
            }
            node.migration
                .departed_bytes
                .fetch_add(bytes, Ordering::Relaxed);
        });
        self.migration.moves_out.fetch_add(1, Ordering::Relaxed);
        self.monitor.record_move(bytes, took - drain);
        let mut e = ClusterEvent::now(EventKind::Migration, self.id, proclet.to_string());
        e.to = Some(to.node);
        e.bytes = bytes;
        e.micros = took.as_micros() as u64;
        crate::telemetry::record_move(self, e);
        Ok(MoveStats {
            bytes,
            micros: took.as_micros() as u64,
            drain_micros: drain.as_micros() as u64,
        })
    }

    /// A `Transfer` chunk arrived (called in arrival order by the connection's reader).
    pub(super) fn receive_transfer(
        self: &Arc<Self>,
        conn: &Arc<Connection>,
        frame: Frame,
        reply: Responder,
    ) {
        let Msg::Transfer {
            proclet,
            kind,
            state,
            epoch,
            offset,
            total,
            last,
            raw,
            pinned,
            group,
        } = frame.msg
        else {
            return;
        };
        // On the connection's reader: `error` and `crash` are what this failpoint is for
        // (a delay or a pause would stall the reader).
        if let Err(f) = granule_failpoints::hit_blocking("stream.chunk_received") {
            return reply.error(failed_step(f));
        }
        let open = || {
            let desc = shipping::resolve(state, Expect::State)?;
            let Some(ops) = desc.state_ops() else {
                return Err(RemoteError::CodeMismatch("not a state descriptor".into()));
            };
            if raw && (ops.from_raw)(Vec::new()).is_none() {
                return Err(RemoteError::CodeMismatch(
                    "raw transfer of a state that is not a byte vector".into(),
                ));
            }
            let room = self.monitor.mem_room();
            if total > 0 && room < total as i64 {
                return Err(RemoteError::NoCapacity(format!(
                    "node {} has {} bytes of room, the proclet needs {total}",
                    self.id,
                    room.max(0)
                )));
            }
            Ok(Arriving {
                ops,
                desc,
                kind,
                epoch,
                raw,
                pinned,
                group,
            })
        };
        let chunk = stream::Chunk {
            conn,
            proclet,
            offset,
            last,
            bytes: &frame.tail,
        };
        let capacity = if total > 0 {
            total as usize
        } else {
            frame.tail.len()
        };
        let (buf, arriving) = match self.migration.inbound.take(chunk, capacity, open) {
            Err(e) => return reply.error(e),
            Ok(None) => {
                let _ = reply.send(&Msg::Done, &[]);
                return;
            }
            Ok(Some(whole)) => whole,
        };
        self.migration
            .received_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        let node = self.clone();
        let conn_id = conn.id();
        let source = conn.peer().and_then(|p| p.node);
        let finish = move |buf: Vec<u8>, a: Arriving| {
            let state = if a.raw {
                (a.ops.from_raw)(buf)
                    .ok_or_else(|| RemoteError::CodeMismatch("not a byte-vector state".into()))
            } else {
                let t = Instant::now();
                let len = buf.len();
                let s = (a.ops.decode)(&buf);
                drop(buf);
                tracing::debug!(%proclet, bytes = len, decode_micros = t.elapsed().as_micros() as u64, "decoded an arriving state");
                s
            };
            let epoch = a.epoch;
            let installed = state.and_then(|s| {
                granule_failpoints::hit_blocking("migrate.before_install").map_err(failed_step)?;
                let slot = NewSlot {
                    id: proclet,
                    kind: a.kind,
                    state: a.desc,
                    epoch,
                    pinned: a.pinned,
                    group: a.group,
                };
                // A copy left pending by an earlier attempt is stale now: the source
                // tried again, so that attempt did not commit.
                let stale = node.migration.provisional.remove(&proclet).map(|(_, p)| p);
                let held = node.install_held(slot, s)?;
                node.migration.provisional.insert(
                    proclet,
                    Provisional {
                        conn: conn_id,
                        epoch,
                        source,
                        held,
                    },
                );
                if let Some(old) = stale {
                    node.withdraw_held(old);
                }
                granule_failpoints::hit_blocking("migrate.installed").map_err(|f| {
                    // Refused at the last moment: the copy must not stay here.
                    node.withdraw_arrival(proclet, epoch);
                    failed_step(f)
                })
            });
            match installed {
                Ok(()) => {
                    let _ = reply.send(&Msg::Done, &[]);
                    // Should the commit not come, find out what happened.
                    let n = node.clone();
                    let wait = node.migration.config.stall_timeout;
                    node.handle.spawn(async move {
                        tokio::time::sleep(wait).await;
                        n.resolve_arrival(proclet, epoch).await;
                    });
                }
                Err(e) => reply.error(e),
            }
        };
        if arriving.raw {
            // The bytes are the state: nothing to decode.
            finish(buf, arriving);
        } else {
            // Decoding takes a while (about 1 µs per small allocation it makes): not on
            // the node's workers, which keep serving calls meanwhile.
            stream::in_background(self.migration.config.nice, move || finish(buf, arriving));
        }
    }
}

impl NodeInner {
    /// The source says the move of `proclet` at `epoch` is final.
    pub(super) fn on_transfer_commit(
        &self,
        conn: &Arc<Connection>,
        proclet: ProcletId,
        epoch: u64,
    ) {
        let ours = self
            .migration
            .provisional
            .get(&proclet)
            .is_some_and(|p| p.conn == conn.id() && p.epoch == epoch);
        if ours {
            self.commit_arrival(proclet, epoch);
        }
    }

    /// The source gave the move up: drop what arrived, or withdraw the copy.
    pub(super) fn on_transfer_abort(&self, conn: &Arc<Connection>, proclet: ProcletId) {
        self.migration.inbound.abort(conn, proclet);
        let epoch = self
            .migration
            .provisional
            .get(&proclet)
            .filter(|p| p.conn == conn.id())
            .map(|p| p.epoch);
        if let Some(epoch) = epoch {
            self.withdraw_arrival(proclet, epoch);
        }
    }

    /// A connection closed: moves arriving on it will never finish, and those installed
    /// but not committed must be resolved.
    pub(super) fn on_transfer_connection_closed(self: &Arc<Self>, conn: &Arc<Connection>) {
        self.migration.inbound.drop_connection(conn);
        let open: Vec<(ProcletId, u64)> = self
            .migration
            .provisional
            .iter()
            .filter(|p| p.conn == conn.id())
            .map(|p| (*p.key(), p.epoch))
            .collect();
        for (proclet, epoch) in open {
            let node = self.clone();
            self.handle
                .spawn(async move { node.resolve_arrival(proclet, epoch).await });
        }
    }

    /// The arrival is final: calls waiting on it run, and the controller learns where it
    /// lives (the source tells it too; it keeps the newest epoch).
    fn commit_arrival(&self, proclet: ProcletId, epoch: u64) {
        let Some((_, p)) = self
            .migration
            .provisional
            .remove_if(&proclet, |_, p| p.epoch == epoch)
        else {
            return;
        };
        let slot = p.held.slot().clone();
        drop(p.held);
        let loc = Location {
            node: self.id,
            addr: self.addr.clone(),
            epoch,
        };
        let client = self.controller.clone();
        let kind = slot.kind();
        self.handle.spawn(async move {
            if let Err(e) = client.set_location(proclet, loc, kind).await {
                tracing::debug!(%proclet, "arrived, but the controller was not told: {e}");
            }
        });
    }

    /// The arrival is not (or no longer) the proclet's home: calls waiting on it go to
    /// wherever the proclet lives.
    fn withdraw_arrival(&self, proclet: ProcletId, epoch: u64) {
        let Some((_, p)) = self
            .migration
            .provisional
            .remove_if(&proclet, |_, p| p.epoch == epoch)
        else {
            return;
        };
        tracing::info!(%proclet, epoch, "withdrew an arrived copy whose move did not commit");
        self.withdraw_held(p);
    }

    /// Withdraw an uncommitted arrival taken out of the provisional table: calls waiting
    /// on it are told it is not here, and its state is freed.
    fn withdraw_held(&self, p: Provisional) {
        p.held.set_status(SlotStatus::Withdrawn);
        let state = p.held.take_state();
        // Only this very slot: a newer arrival of the proclet may be hosted already.
        self.hosting.remove(p.held.slot());
        drop(p.held);
        drop(state);
    }

    /// An arrival whose commit did not come: ask its source whether the move committed;
    /// when the source cannot say, the controller's record decides (recorded here at this
    /// very epoch: the source committed it).
    async fn resolve_arrival(self: &Arc<Self>, proclet: ProcletId, epoch: u64) {
        let patience = self.migration.config.stall_timeout * 2;
        let started = Instant::now();
        loop {
            let source = match self.migration.provisional.get(&proclet) {
                Some(p) if p.epoch == epoch => p.source,
                _ => return, // decided meanwhile
            };
            let answer = match source {
                Some(s) => self.ask_source(s, proclet, epoch).await,
                None => None,
            };
            match answer {
                Some(true) => return self.commit_arrival(proclet, epoch),
                Some(false) => return self.withdraw_arrival(proclet, epoch),
                None if started.elapsed() < patience => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                None => break,
            }
        }
        match self.controller.locate(proclet).await {
            Ok(Some((loc, _))) if loc.node == self.id && loc.epoch == epoch => {
                self.commit_arrival(proclet, epoch)
            }
            Ok(_) => self.withdraw_arrival(proclet, epoch),
            Err(e) => {
                // Without the controller this node is leaving the cluster anyway.
                tracing::warn!(%proclet, "cannot resolve an uncommitted arrival: {e}");
                self.withdraw_arrival(proclet, epoch)
            }
        }
    }

    /// The source's answer to `Resolve` (`None`: undecided, unknown, unreachable, or
    /// silent for the stall timeout).
    async fn ask_source(&self, source: NodeId, proclet: ProcletId, epoch: u64) -> Option<bool> {
        let ask = async {
            let addr = self.addr_of(source).await.ok()?;
            let conn = self.peers.connect(source, &addr).await.ok()?;
            match conn.request(&Msg::Resolve { proclet, epoch }, &[]).await {
                Ok(Frame {
                    msg: Msg::Resolved { committed },
                    ..
                }) => committed,
                _ => None,
            }
        };
        tokio::time::timeout(self.migration.config.stall_timeout, ask)
            .await
            .ok()
            .flatten()
    }

    /// Answer a destination's `Resolve`: did the move attempt of `proclet` that gave it
    /// `epoch` commit? While that destination holds the copy uncommitted, the proclet
    /// cannot have gone on from there, so:
    /// - still hosted here: that attempt is still deciding (`None`), or it was abandoned;
    /// - left from here at exactly that epoch: it committed;
    /// - left from here at a later epoch: a later attempt did, so that one was abandoned;
    /// - nothing known here: `None` (the destination asks the controller).
    pub(super) fn resolve_departure(&self, proclet: ProcletId, epoch: u64) -> Option<bool> {
        if let Some(slot) = self.hosting.get(proclet) {
            let deciding = slot.moving.load(Ordering::Acquire)
                && slot.attempt_epoch.load(Ordering::Acquire) == epoch;
            return (!deciding).then_some(false);
        }
        match self.locations.forwarded_to(proclet) {
            Some(l) if l.epoch == epoch => Some(true),
            Some(l) if l.epoch > epoch => Some(false),
            _ => None,
        }
    }
}
