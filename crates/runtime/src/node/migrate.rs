//! The migration engine: moving a hosted proclet to another node while callers keep
//! calling.
//!
//! A move of proclet P from source S to destination D:
//! 1. S marks P moving and asks code running on P to yield at its next item boundary
//!    (`should_yield`; only long-running closures look), then takes P's lock: exclusively
//!    for a byte-vector state (taken out to be sent as is), shared for any other (encoded
//!    in place). Calls in flight that change the state finish first; from now on calls
//!    that would change it queue on the lock: they are *held*. With a shared lock,
//!    read-only calls keep being served at S meanwhile — nothing can change the state.
//! 2. S streams P's encoded state to D in `Transfer` chunks over their connection, a
//!    bounded window of chunks in flight. A plain byte-vector state is sent as is, sliced
//!    without copying; any other state is encoded chunk by chunk while earlier chunks are
//!    on the wire, so S never holds a second full copy. D appends the chunks and, at the
//!    last one, decodes the state and installs P with the next epoch.
//! 3. S records P's new location (and epoch) at the controller, remembers it as a
//!    forwarding hint, marks P moved and releases the lock: every held call fails over to
//!    D with a "not here, now at D" answer and is retried there by its caller's runtime.
//!    Held calls never ran at S, so none runs twice and none is lost; callers see no error.
//! 4. If anything fails before D confirmed the install (D unreachable or dying mid-way,
//!    encoding error), S sends `TransferAbort` (D drops what arrived), puts the state
//!    back and releases the lock: P stays usable at S and held calls run there.
//!
//! Cached locations catch up through epochs: a stale cache entry leads to S (or to a node
//! that never had P), whose "not here" answer carries the newer location.

use super::NodeInner;
use crate::context;
use crate::shipping::{self, Expect, StateOps};
use crate::slot::{Guard, Slot, SlotStatus};
use bytes::Bytes;
use granule_transport::{Connection, Responder, TransportError};
use granule_wire::{
    CallMode, ClusterEvent, EventKind, Frame, Kind, Location, MoveStats, Msg, ProcletId,
    RemoteError,
};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a move waits for another move of the same proclet to finish.
const MOVE_WAIT: Duration = Duration::from_secs(30);
/// Size of one transfer chunk.
pub(crate) const CHUNK: usize = 512 << 10;
/// Chunks in flight at once (bounds the memory a move holds besides the state itself).
const WINDOW: usize = 8;
/// States whose last measured footprint is below this are encoded inline on the moving
/// task; larger ones on a blocking thread, so sending overlaps with encoding.
const INLINE_ENCODE: u64 = 256 << 10;

/// Knobs of the engine (from the environment, so a driver passes them to its nodes).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MigrationConfig {
    /// Pace transfers to this many bytes per second (a slow-migration baseline).
    pub throttle: Option<u64>,
    /// Wait this long before starting each move (a slow-to-react baseline).
    pub delay: Duration,
    /// Nice value of the threads that decode arriving states.
    pub nice: i32,
    /// The share of the time a *shedding* move may keep the node's CPU busy encoding and
    /// sending (`GRANULE_MIGRATION_DUTY`, default [`DEFAULT_SHED_DUTY`]; 1 = no pacing):
    /// its encoder rests in proportion to its work after every chunk.
    ///
    /// Why: a node sheds because something else on its machine is taking memory, and
    /// that something usually takes CPU too (a memory antagonist faulting in pages keeps
    /// its core busy). The scheduler (EEVDF) shares a core by recent use: after a
    /// millisecond-long burst of encoding, the node's group has had more than its share,
    /// and a call arriving then waits while the other process runs its whole slice (here
    /// 1.4 ms; traced: waits of 1–2 ms) — the node's workers ask for short slices, but
    /// they cannot preempt a process that is owed time. Resting keeps the node under its
    /// share, so its workers keep preempting on wake-up. Moves the program or an operator
    /// asks for (`Cluster::move_proclet`, the admin API) are not paced; nor are
    /// byte-vector states, which are not encoded (their transfer is a few socket writes). Measured in
    /// `granule bench pressure` (README), two pairs of runs of 5 repetitions: disruption
    /// p99 ÷ steady p99 1.96 and 2.44 with 0.5, 3.52 and 2.89 without; slow requests
    /// about 30 % fewer. Each shedding move takes about twice as long to encode.
    pub shed_duty: f64,
}

/// Default of [`MigrationConfig::shed_duty`].
pub(crate) const DEFAULT_SHED_DUTY: f64 = 0.5;

/// Default nice value of the decoding threads (`GRANULE_MIGRATION_NICE`):
/// below the node's workers, so a worker woken by a call preempts a decoder at once
/// instead of queueing behind it for a scheduler slice (milliseconds on a busy core: the
/// destination's own calls are the tail this protects), yet heavy enough (weight 335
/// against 1024) that a CPU-bound neighbour cannot starve a move the source waits for.
pub(crate) const DEFAULT_MIGRATION_NICE: i32 = 5;

/// Run `f` on a blocking thread at the migration nice value, restoring the thread's own
/// priority afterwards (blocking threads are pooled).
fn in_background<T: Send + 'static>(
    nice: i32,
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(move || {
        let old = granule_host::os::swap_thread_nice(nice);
        let out = f();
        if let Some(old) = old {
            granule_host::os::swap_thread_nice(old);
        }
        out
    })
}

impl MigrationConfig {
    /// `GRANULE_MIGRATION_THROTTLE` (e.g. `600MB/s`) and `GRANULE_MIGRATION_DELAY`
    /// (e.g. `200ms`); bad values are reported and ignored.
    pub(crate) fn from_env() -> MigrationConfig {
        let mut c = MigrationConfig {
            nice: DEFAULT_MIGRATION_NICE,
            shed_duty: DEFAULT_SHED_DUTY,
            ..MigrationConfig::default()
        };
        if let Ok(v) = std::env::var("GRANULE_MIGRATION_THROTTLE") {
            match crate::config::parse_rate(&v) {
                Ok(b) => c.throttle = Some(b),
                Err(e) => {
                    tracing::warn!(
                        "ignoring GRANULE_MIGRATION_THROTTLE: {e} (expected e.g. 600MB/s)"
                    )
                }
            }
        }
        if let Ok(v) = std::env::var("GRANULE_MIGRATION_DELAY") {
            match crate::config::parse_duration(&v) {
                Ok(d) => c.delay = d,
                Err(_) => {
                    tracing::warn!("ignoring GRANULE_MIGRATION_DELAY={v}: expected e.g. 200ms")
                }
            }
        }
        if let Ok(v) = std::env::var("GRANULE_MIGRATION_DUTY") {
            match v.trim().parse::<f64>() {
                Ok(d) if d > 0.0 && d <= 1.0 => c.shed_duty = d,
                _ => tracing::warn!(
                    "ignoring GRANULE_MIGRATION_DUTY={v}: expected a share in (0, 1], e.g. 0.5"
                ),
            }
        }
        if let Ok(v) = std::env::var("GRANULE_MIGRATION_NICE") {
            match v.trim().parse::<i32>() {
                Ok(n) if (-20..=19).contains(&n) => c.nice = n,
                _ => tracing::warn!("ignoring GRANULE_MIGRATION_NICE={v}: expected -20..=19"),
            }
        }
        c
    }
}

/// A state arriving at this node.
pub(crate) struct Incoming {
    buf: Vec<u8>,
    ops: StateOps,
    desc: &'static shipping::Descriptor,
    kind: Kind,
    epoch: u64,
    raw: bool,
    pinned: bool,
    group: Option<String>,
}

type Reply = Pin<Box<dyn Future<Output = Result<Frame, TransportError>> + Send>>;

/// Chunks sent and not yet confirmed, in order.
struct Window {
    replies: VecDeque<Reply>,
    sent: u64,
    started: Instant,
    throttle: Option<u64>,
}

impl Window {
    async fn wait_one(&mut self) -> Result<(), RemoteError> {
        let Some(r) = self.replies.pop_front() else {
            return Ok(());
        };
        match r.await {
            Ok(Frame { msg: Msg::Done, .. }) => Ok(()),
            Ok(Frame {
                msg: Msg::Error(e), ..
            }) => Err(e),
            Ok(f) => Err(RemoteError::Protocol(format!(
                "unexpected answer {} to a transfer",
                f.msg.name()
            ))),
            Err(e) => Err(RemoteError::Internal(format!(
                "the destination is unreachable: {e}"
            ))),
        }
    }

    async fn send(
        &mut self,
        conn: &Arc<Connection>,
        msg: Msg,
        chunk: Bytes,
    ) -> Result<(), RemoteError> {
        while self.replies.len() >= WINDOW {
            self.wait_one().await?;
        }
        if let Some(rate) = self.throttle {
            let due = Duration::from_secs_f64(self.sent as f64 / rate as f64);
            let at = self.started + due;
            if at > Instant::now() {
                tokio::time::sleep_until(at.into()).await;
            }
        }
        self.sent += chunk.len() as u64;
        let fut = conn
            .start_request_bytes(&msg, chunk)
            .map_err(|e| RemoteError::Internal(format!("the destination is unreachable: {e}")))?;
        self.replies.push_back(Box::pin(fut));
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), RemoteError> {
        while !self.replies.is_empty() {
            self.wait_one().await?;
        }
        Ok(())
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

impl NodeInner {
    /// [`NodeInner::move_out`], run on the node's workers, where the connections' tasks
    /// live (no cross-thread wake-ups while streaming). A closure running on the proclet
    /// is asked to yield first, from here: it may be occupying the very worker the move
    /// needs.
    ///
    /// `pace`: the share of the time the move may keep the node's CPU busy (a shedding
    /// move: `MigrationConfig::shed_duty`); `None` for as fast as it can.
    pub(crate) async fn move_out_on_workers(
        self: &Arc<Self>,
        proclet: ProcletId,
        to: Location,
        pace: Option<f64>,
    ) -> Result<MoveStats, RemoteError> {
        let slot = self.local_slot(proclet);
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
            .spawn(async move { node.move_out(proclet, to, pace).await })
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
    pub(crate) async fn move_out(
        self: &Arc<Self>,
        proclet: ProcletId,
        to: Location,
        pace: Option<f64>,
    ) -> Result<MoveStats, RemoteError> {
        let Some(slot) = self.local_slot(proclet) else {
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
            .local_slot(proclet)
            .is_none_or(|s| !Arc::ptr_eq(&s, &slot))
        {
            slot.moving.store(false, Ordering::Release);
            return Err(self.not_here(proclet));
        }
        let _mark = MovingMark(&slot);
        if !self.migration.delay.is_zero() {
            tokio::time::sleep(self.migration.delay).await;
        }
        let ops = slot
            .state_desc
            .state_ops()
            .ok_or_else(|| RemoteError::Internal("slot without a state descriptor".into()))?;
        // A byte-vector state is taken out of the slot and sent as is: that needs the lock
        // exclusively. Any other state is encoded from a shared lock: calls that only read
        // (`run_ref`) keep being served here while it streams — nothing can change it —
        // and calls that would change it are held, then bounced to the new home.
        let exclusive = (ops.from_raw)(Vec::new()).is_some();
        let mode = if exclusive {
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
        crate::accounting::request_yield(slot.serial);
        let guard = match self.lock_slot(&slot, context::new_chain(), mode).await {
            Ok(g) => g,
            Err(e) => {
                failed(format!("could not take the proclet: {e}"));
                return Err(e);
            }
        };
        crate::accounting::clear_yield(slot.serial);
        let drain = t0.elapsed();
        let conn = match self.conn_to(to.node, &to.addr).await {
            Ok(c) => c,
            Err(e) => {
                let e = RemoteError::Refused(format!("cannot reach the destination: {e}"));
                failed(e.to_string());
                return Err(e);
            }
        };
        let epoch = slot.epoch.max(to.epoch.saturating_sub(1)) + 1;
        let streaming = Instant::now();
        let (bytes, sent_state) = match self
            .stream_state(&conn, &guard, &slot, ops, epoch, pace)
            .await
        {
            Ok(b) => {
                tracing::debug!(%proclet, to = %to.node, bytes = b.0,
                    drain_micros = drain.as_micros() as u64,
                    stream_micros = streaming.elapsed().as_micros() as u64,
                    "streamed a state (until the destination installed it)");
                b
            }
            Err(e) => {
                let _ = conn.notify(&Msg::TransferAbort { proclet }, &[]);
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
        self.forwarding.insert(proclet, loc.clone());
        // From here no new call is granted here; readers still inside finish on the old
        // state, which is freed with the slot when the last of them is done.
        guard.set_status(SlotStatus::Moved(loc.clone()));
        let old = exclusive.then(|| guard.take_state());
        self.remove_hosted(&slot);
        drop(guard);
        let took = t0.elapsed();
        if let Err(e) = self
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
            drop(sent_state);
            drop(slot);
            if trim {
                granule_host::os::release_free_memory();
            }
            node.departed_bytes.fetch_add(bytes, Ordering::Relaxed);
        });
        self.moves_out.fetch_add(1, Ordering::Relaxed);
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

    /// Send the state under `guard` to the destination; returns the bytes sent, and the
    /// byte-vector state itself when it was taken out to be sent as is (for the caller to
    /// free off the critical path). On error the state is back in the slot.
    async fn stream_state(
        &self,
        conn: &Arc<Connection>,
        guard: &Guard,
        slot: &Arc<Slot>,
        ops: StateOps,
        epoch: u64,
        pace: Option<f64>,
    ) -> Result<(u64, Option<Bytes>), RemoteError> {
        let header = |offset: u64, total: u64, last: bool, raw: bool| Msg::Transfer {
            proclet: slot.id,
            kind: slot.kind(),
            state: shipping::code_ref(slot.state_desc),
            epoch,
            offset,
            total,
            last,
            raw,
            pinned: false,
            // Only the first chunk needs it (the receiver keeps the first one's).
            group: (offset == 0)
                .then(|| slot.group.as_deref().map(String::from))
                .flatten(),
        };
        let mut window = Window {
            replies: VecDeque::new(),
            sent: 0,
            started: Instant::now(),
            throttle: self.migration.throttle,
        };
        // Plain bytes (under an exclusive lock): take the vector out and send slices of
        // it, no copy, no encoding.
        let taken = match guard.is_exclusive() {
            true => (ops.into_raw)(guard.take_state()),
            false => Err(Box::new(()) as Box<crate::shipping::ErasedState>),
        };
        match taken {
            Ok(vec) => {
                let all = Bytes::from(vec);
                let total = all.len() as u64;
                let r = async {
                    let mut off = 0usize;
                    loop {
                        let end = (off + CHUNK).min(all.len());
                        let last = end == all.len();
                        window
                            .send(
                                conn,
                                header(off as u64, total, last, true),
                                all.slice(off..end),
                            )
                            .await?;
                        off = end;
                        if last {
                            break;
                        }
                    }
                    window.finish().await
                }
                .await;
                if let Err(e) = r {
                    drop(window);
                    let back = (ops.from_raw)(Vec::from(all))
                        .ok_or_else(|| RemoteError::Internal("cannot restore the state".into()))?;
                    guard.put_state(back);
                    return Err(e);
                }
                return Ok((total, Some(all)));
            }
            Err(state) => {
                if guard.is_exclusive() {
                    guard.put_state(state);
                }
            }
        }
        // Encoded states: their length is known only at the end; the footprint tells the
        // destination roughly what to reserve (and whether it has room).
        let hint = slot.stats.footprint.load(Ordering::Relaxed);
        // Small states: encode inline into one chunk.
        if hint < INLINE_ENCODE {
            let mut chunks: Vec<Vec<u8>> = Vec::new();
            guard.inspect(|s| {
                (ops.encode)(s, CHUNK, &mut |c| {
                    chunks.push(c);
                    Ok(())
                })
            })?;
            let n = chunks.len();
            let mut off = 0u64;
            for (i, c) in chunks.into_iter().enumerate() {
                let len = c.len() as u64;
                window
                    .send(conn, header(off, hint, i + 1 == n, false), Bytes::from(c))
                    .await?;
                off += len;
            }
            if n == 0 {
                window
                    .send(conn, header(0, hint, true, false), Bytes::new())
                    .await?;
            }
            window.finish().await?;
            return Ok((off, None));
        }
        // Large states: encode on a blocking thread, chunk by chunk, while sending.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(WINDOW);
        let enc_slot = slot.clone();
        // At the worker's own priority, unlike decoding: this node is the one under
        // pressure, and the sooner the state is out, the sooner it has relief.
        // A shedding move paces its encoder (see `MigrationConfig::shed_duty`).
        let rest = pace.filter(|d| *d < 1.0).map(|d| 1.0 / d - 1.0);
        let encoder = tokio::task::spawn_blocking(move || {
            let d = enc_slot.state_reader();
            let mut since = Instant::now();
            (ops.encode)(&**d, CHUNK, &mut |c| {
                if let Some(rest) = rest {
                    // Rest in proportion to the time since the last rest: encoding, and
                    // waiting for the worker to take the last chunk (it sends meanwhile),
                    // so the rests cover the sending too. Microsecond resolution.
                    std::thread::sleep(since.elapsed().mul_f64(rest));
                    since = Instant::now();
                }
                tx.blocking_send(c)
                    .map_err(|_| RemoteError::Internal("transfer stopped".into()))
            })
        });
        let mut off = 0u64;
        let mut pending: Option<Vec<u8>> = None;
        let sent: Result<(), RemoteError> = async {
            loop {
                let next = rx.recv().await;
                if let Some(c) = pending.take() {
                    let len = c.len() as u64;
                    let last = next.is_none();
                    window
                        .send(conn, header(off, hint, last, false), Bytes::from(c))
                        .await?;
                    off += len;
                }
                match next {
                    Some(c) => pending = Some(c),
                    None => break,
                }
            }
            window.finish().await
        }
        .await;
        drop(rx);
        let encoded = encoder
            .await
            .map_err(|e| RemoteError::Internal(format!("the encoder failed: {e}")))?;
        encoded?;
        sent?;
        if off == 0 {
            return Err(RemoteError::Internal("the state encoded to nothing".into()));
        }
        Ok((off, None))
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
        let key = (conn.id(), proclet);
        if offset == 0 {
            let desc = match shipping::resolve(state, Expect::State) {
                Ok(d) => d,
                Err(e) => return reply.error(e),
            };
            let Some(ops) = desc.state_ops() else {
                return reply.error(RemoteError::CodeMismatch("not a state descriptor".into()));
            };
            if raw && (ops.from_raw)(Vec::new()).is_none() {
                return reply.error(RemoteError::CodeMismatch(
                    "raw transfer of a state that is not a byte vector".into(),
                ));
            }
            let room = self.monitor.mem_room();
            if total > 0 && room < total as i64 {
                return reply.error(RemoteError::NoCapacity(format!(
                    "node {} has {} bytes of room, the proclet needs {total}",
                    self.id,
                    room.max(0)
                )));
            }
            let cap = if total > 0 {
                total as usize
            } else {
                frame.tail.len()
            };
            self.incoming.insert(
                key,
                Incoming {
                    buf: Vec::with_capacity(cap),
                    ops,
                    desc,
                    kind,
                    epoch,
                    raw,
                    pinned,
                    group,
                },
            );
        }
        let Some(mut entry) = self.incoming.get_mut(&key) else {
            return reply.error(RemoteError::Protocol(format!(
                "transfer chunk at offset {offset} for proclet {proclet} without its start"
            )));
        };
        if entry.buf.len() as u64 != offset {
            let have = entry.buf.len();
            drop(entry);
            self.incoming.remove(&key);
            return reply.error(RemoteError::Protocol(format!(
                "transfer chunk at offset {offset}, expected {have}"
            )));
        }
        entry.buf.extend_from_slice(&frame.tail);
        drop(entry);
        if !last {
            let _ = reply.send(&Msg::Done, &[]);
            return;
        }
        let Some((_, inc)) = self.incoming.remove(&key) else {
            return;
        };
        self.received_bytes
            .fetch_add(inc.buf.len() as u64, Ordering::Relaxed);
        let node = self.clone();
        let finish = move |inc: Incoming| {
            let state = if inc.raw {
                (inc.ops.from_raw)(inc.buf)
                    .ok_or_else(|| RemoteError::CodeMismatch("not a byte-vector state".into()))
            } else {
                let t = Instant::now();
                let len = inc.buf.len();
                let s = (inc.ops.decode)(&inc.buf);
                drop(inc.buf);
                tracing::debug!(%proclet, bytes = len, decode_micros = t.elapsed().as_micros() as u64, "decoded an arriving state");
                s
            };
            match state {
                Ok(s) => {
                    let h = super::serve::Hosting {
                        id: proclet,
                        kind: inc.kind,
                        state: inc.desc,
                        epoch: inc.epoch,
                        pinned: inc.pinned,
                        group: inc.group,
                    };
                    node.install(h, s);
                    let _ = reply.send(&Msg::Done, &[]);
                }
                Err(e) => reply.error(e),
            }
        };
        if inc.raw {
            // The bytes are the state: nothing to decode.
            finish(inc);
        } else {
            // Decoding takes a while (about 1 µs per small allocation it makes): not on
            // the node's workers, which keep serving calls meanwhile.
            in_background(self.migration.nice, move || finish(inc));
        }
    }

    /// Drop what arrived of a transfer the source gave up.
    pub(super) fn abort_transfer(&self, conn: &Arc<Connection>, proclet: ProcletId) {
        self.incoming.remove(&(conn.id(), proclet));
    }

    /// A connection closed: transfers arriving on it will never finish.
    pub(super) fn drop_transfers_of(&self, conn: &Arc<Connection>) {
        let id = conn.id();
        self.incoming.retain(|(c, _), _| *c != id);
    }
}
