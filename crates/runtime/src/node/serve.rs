//! The serving side of a node, top to bottom: the handler every connection of the node
//! uses (who may ask for what), then serving a call (find the proclet, check the code,
//! take the lock, run, answer), a pushed call (the same, but run on the node's pushdown
//! pool: see `crate::pushdown`), a creation, a destroy.

use super::hosting::NewSlot;
use super::NodeInner;
use crate::context::{self, NodeCell};
use crate::shipping::{self, Entry, ErasedState, Expect};
use crate::slot::SlotStatus;
use granule_controller::ControllerError;
use granule_transport::{Connection, Handler, Responder};
use granule_wire::{
    begin_frame, finish_frame, finish_frame_leaving_out, CallMode, ChainId, Frame, FrameKind,
    Location, Msg, RemoteError, Role,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Serves requests and notices on every connection of a node.
pub(crate) struct NodeHandler {
    pub(super) cell: Arc<NodeCell>,
}

impl NodeHandler {
    fn node(&self) -> Option<Arc<NodeInner>> {
        self.cell.get()?.upgrade().filter(|n| !n.is_stopped())
    }
}

impl Handler for NodeHandler {
    fn on_request(&self, conn: &Arc<Connection>, frame: Frame, reply: Responder) {
        let Some(node) = self.node() else {
            reply.error(RemoteError::Internal(
                "the node is starting or stopping".into(),
            ));
            return;
        };
        let peer = conn.peer();
        let verified = peer.is_some_and(|p| p.verified);
        let from_controller = peer.is_some_and(|p| p.role == Role::Controller);
        match &frame.msg {
            Msg::Call { .. }
            | Msg::Apply { .. }
            | Msg::Effects { .. }
            | Msg::MoveBackup { .. }
            | Msg::AddBackups(_)
            | Msg::BackupChunk { .. }
            | Msg::Push { .. }
            | Msg::Create { .. }
            | Msg::Transfer { .. }
            | Msg::Destroy { .. }
            | Msg::Resolve { .. }
            | Msg::Faults { .. } => {
                if !verified {
                    reply.error(RemoteError::Unauthorized(
                        "only a proclet host running the identical binary may ship code or \
                         manage proclets (the hello did not verify the binary)"
                            .into(),
                    ));
                    return;
                }
            }
            Msg::MoveOut { .. } => {
                if !from_controller {
                    reply.error(RemoteError::Unauthorized(
                        "only the controller orders moves".into(),
                    ));
                    return;
                }
            }
            other => {
                reply.error(RemoteError::Protocol(format!(
                    "a node does not handle {}",
                    other.name()
                )));
                return;
            }
        }
        match frame.msg {
            // In order, on the reader: chunks must be appended as they arrive.
            Msg::Transfer { .. } => node.receive_transfer(conn, frame, reply),
            Msg::BackupChunk { .. } => node.receive_backup_chunk(conn, frame, reply),
            Msg::Apply { .. } => {
                tokio::spawn(async move { node.serve_apply(frame, reply).await });
            }
            // On the reader: a backup re-running the call may be waiting for them.
            Msg::Effects { .. } => node.receive_effects(frame, reply),
            Msg::Resolve { proclet, epoch } => {
                let committed = node.resolve_departure(proclet, epoch);
                let _ = reply.send(&Msg::Resolved { committed }, &[]);
            }
            // The arrival is recorded here, on the reader, before the call waits for
            // anything: a `CancelPush` behind it on this connection then always finds it.
            Msg::Push { ticket, memory, .. } => match node.pushdown.arrive(ticket, memory) {
                Ok(arrival) => {
                    tokio::spawn(node.serve_push(frame, reply, arrival));
                }
                Err(refusal) => reply.error(refusal.to_remote(node.id)),
            },
            Msg::Faults { .. } => match node.faults.apply(&frame.msg) {
                Ok(report) => {
                    let _ = reply.send(&Msg::Done, report.unwrap_or_default().as_bytes());
                }
                Err(e) => reply.error(e),
            },
            _ => {
                tokio::spawn(node.serve(frame, reply));
            }
        }
    }

    fn on_notify(&self, conn: &Arc<Connection>, frame: Frame) {
        let Some(node) = self.node() else { return };
        let from_controller = conn.peer().is_some_and(|p| p.role == Role::Controller);
        match frame.msg {
            Msg::NodeDown { node: n } if from_controller => node.peers.on_node_down(node.id, n),
            Msg::Replicas(set) if from_controller => node.on_replicas(set),
            Msg::Shutdown {
                reason,
                declared_dead,
            } if from_controller => {
                if declared_dead {
                    node.lifecycle.mark_declared_dead();
                }
                node.trigger_shutdown(reason)
            }
            Msg::TransferAbort { proclet } => node.on_transfer_abort(conn, proclet),
            Msg::CancelPush { ticket, timed_out } if conn.peer().is_some_and(|p| p.verified) => {
                let why = if timed_out {
                    crate::pushdown::Why::Timeout
                } else {
                    crate::pushdown::Why::Dropped
                };
                node.pushdown.cancel(ticket, why);
            }
            Msg::TransferCommit { proclet, epoch } => node.on_transfer_commit(conn, proclet, epoch),
            other => tracing::debug!("ignored notification {}", other.name()),
        }
    }

    fn on_close(&self, conn: &Arc<Connection>) {
        let Some(node) = self.node() else { return };
        if conn.peer().is_some_and(|p| p.role == Role::Controller) {
            node.trigger_shutdown(format!(
                "lost the controller ({})",
                conn.close_reason().unwrap_or_default()
            ));
        } else {
            node.on_transfer_connection_closed(conn);
            node.peers.forget(conn);
        }
    }
}

impl NodeInner {
    /// Serve one request (not a transfer chunk: those are handled in order on the reader).
    async fn serve(self: Arc<Self>, frame: Frame, reply: Responder) {
        // Every request's task holds this future, copied into place when it is spawned
        // and again when it ends: the rare requests' larger futures are boxed so that a
        // call's task stays small.
        let out = match &frame.msg {
            Msg::Call { .. } => return self.serve_call(frame, reply).await,
            Msg::Create { .. } => Box::pin(self.serve_create(frame)).await,
            Msg::Destroy { proclet } => {
                let id = *proclet;
                match self.hosting.get(id) {
                    Some(slot) => Box::pin(self.destroy_local(&slot, context::new_chain()))
                        .await
                        .map(|()| Msg::Done),
                    None if self.drop_backup(id) => Ok(Msg::Done),
                    None => Err(self.not_here(id)),
                }
            }
            Msg::AddBackups(set) => {
                let set = set.clone();
                let copies = set.backups.len() as u32 + 1;
                Box::pin(self.add_backups(set, copies))
                    .await
                    .map(|_| Msg::Done)
            }
            Msg::MoveBackup { proclet, from, to } => {
                Box::pin(self.serve_move_backup(*proclet, *from, to))
                    .await
                    .map(Msg::Moved)
            }
            Msg::MoveOut { proclet, to } => {
                let (p, t) = (*proclet, to.clone());
                Box::pin(self.move_out_on_workers(p, t, None))
                    .await
                    .map(Msg::Moved)
            }
            other => Err(RemoteError::Protocol(format!(
                "a node does not handle {}",
                other.name()
            ))),
        };
        match out {
            Ok(m) => {
                let _ = reply.send(&m, &[]);
            }
            Err(e) => reply.error(e),
        }
    }

    /// Serve a call: find the proclet, check the shipped code against it, take its lock,
    /// run the closure, answer with its encoded result.
    async fn serve_call(self: Arc<Self>, frame: Frame, reply: Responder) {
        let Msg::Call {
            proclet,
            code,
            mode,
            chain,
            call,
        } = frame.msg
        else {
            return;
        };
        let received = std::time::Instant::now();
        let mut found = self.hosting.get(proclet);
        // A backup the controller just promoted: its notice may still be on its way
        // (callers learn of the failover from the controller too). Wait a moment.
        let promoting = std::time::Instant::now();
        while found.is_none()
            && self.replication.has_backup(proclet)
            && promoting.elapsed() < std::time::Duration::from_secs(2)
        {
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            found = self.hosting.get(proclet);
        }
        let Some(slot) = found else {
            return reply.error(self.not_here(proclet));
        };
        if mode == CallMode::Exclusive && slot.replicated.load(Ordering::Acquire) {
            let r = self
                .call_replicated(&slot, code, chain, call, frame.tail)
                .await;
            match r {
                Ok(value) => {
                    let _ = reply.send(&Msg::Value, &value);
                }
                Err(e) => reply.error(e),
            }
            crate::telemetry::call_served(&self, received.elapsed());
            return;
        }
        let expect = match mode {
            CallMode::Exclusive => Expect::CallMut,
            CallMode::Shared => Expect::CallRef,
        };
        let desc = match shipping::resolve(code, expect) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        if desc.state_type() != slot.state_type {
            return reply.error(RemoteError::CodeMismatch(format!(
                "the closure expects another state type than proclet {proclet} holds"
            )));
        }
        let guard = match self.lock_slot(&slot, chain, mode).await {
            Ok(g) => g,
            Err(e) => return reply.error(e),
        };
        if let Err(f) = granule_failpoints::hit("call.before_run").await {
            // Refused before anything ran: the caller may know it did not run.
            return reply.error(RemoteError::Refused(f.to_string()));
        }
        let mut buf = match begin_frame(FrameKind::Response, reply.id(), &Msg::Value, 64) {
            Ok(b) => b,
            Err(e) => return reply.error(RemoteError::Internal(e.to_string())),
        };
        let (result, left_out) = {
            let _scope = context::ChainScope::enter(chain);
            let _busy = self.hosting.busy.enter();
            // Large blobs in the answer (a file system stripe) are written from their
            // own memory, not copied into the frame first.
            crate::shipping::with_blobs_left_out(|| match desc.entry {
                Entry::CallMut(f) => guard.with_mut(|s| f(s, &frame.tail, &mut buf)),
                Entry::CallRef(f) => guard.with_ref(|s| f(s, &frame.tail, &mut buf)),
                _ => Err(RemoteError::CodeMismatch("not a call".into())),
            })
        };
        drop(guard);
        self.hosting.calls_served.fetch_add(1, Ordering::Relaxed);
        if let Err(f) = granule_failpoints::hit("call.before_reply").await {
            // The closure ran, but its answer is lost: what a connection cut right after
            // the call looks like to the caller.
            return reply.error(RemoteError::Internal(f.to_string()));
        }
        answer_value(reply, buf, result, left_out);
        crate::telemetry::call_served(&self, received.elapsed());
    }

    /// Serve a pushed call (its arrival already recorded): find the proclet, check the
    /// code, take its lock shared, hand lock, argument and trampoline to the pushdown
    /// pool, answer when the pool has run it — or `TimedOut` as soon as the call's
    /// timeout passes, whether it was waiting (then it never runs) or running (then it
    /// finishes on its pool thread, its answer dropped).
    async fn serve_push(
        self: Arc<Self>,
        frame: Frame,
        reply: Responder,
        arrival: crate::pushdown::Arrival,
    ) {
        let Msg::Push {
            proclet,
            code,
            chain,
            ticket,
            timeout_ms,
            ..
        } = frame.msg
        else {
            return;
        };
        let deadline =
            timeout_ms.map(|ms| tokio::time::Instant::now() + std::time::Duration::from_millis(ms));
        let timed_out = |node: &NodeInner| {
            node.pushdown.cancel(ticket, crate::pushdown::Why::Timeout);
            RemoteError::TimedOut {
                after_ms: timeout_ms.unwrap_or_default(),
            }
        };
        let Some(slot) = self.hosting.get(proclet) else {
            return reply.error(self.not_here(proclet));
        };
        let desc = match shipping::resolve(code, Expect::CallRef) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        if desc.state_type() != slot.state_type {
            return reply.error(RemoteError::CodeMismatch(format!(
                "the closure expects another state type than proclet {proclet} holds"
            )));
        }
        let Entry::CallRef(entry) = desc.entry else {
            return reply.error(RemoteError::CodeMismatch("not a read-only call".into()));
        };
        let locking = self.lock_slot(&slot, chain, CallMode::Shared);
        let locked = match deadline {
            Some(d) => match tokio::time::timeout_at(d, locking).await {
                Ok(r) => r,
                Err(_) => return reply.error(timed_out(&self)),
            },
            None => locking.await,
        };
        let guard = match locked {
            Ok(g) => g,
            Err(e) => return reply.error(e),
        };
        let buf = match begin_frame(FrameKind::Response, reply.id(), &Msg::Value, 64) {
            Ok(b) => b,
            Err(e) => return reply.error(RemoteError::Internal(e.to_string())),
        };
        let mut rx = match self
            .pushdown
            .submit(arrival, guard, entry, frame.tail, chain, Some(buf))
        {
            Ok(rx) => rx,
            Err(refusal) => return reply.error(refusal.to_remote(self.id)),
        };
        let done = match deadline {
            Some(d) => {
                tokio::select! {
                    done = &mut rx => done,
                    _ = tokio::time::sleep_until(d) => {
                        let e = timed_out(&self);
                        // Answered in the very instant it timed out: the answer wins.
                        match rx.try_recv() {
                            Ok(done) => Ok(done),
                            Err(_) => return reply.error(e),
                        }
                    }
                }
            }
            None => (&mut rx).await,
        };
        match done {
            Ok(done) => answer_value(reply, done.out, done.result, done.left_out),
            // Cancelled by its caller while queued, or the node stopping.
            Err(_) => reply.error(RemoteError::Internal(
                "the pushed call was dropped before it ran (cancelled, or the node stops)".into(),
            )),
        }
    }

    /// Build a proclet from a shipped constructor and its argument, and host it.
    async fn serve_create(self: Arc<Self>, frame: Frame) -> Result<Msg, RemoteError> {
        let Msg::Create {
            proclet,
            kind,
            ctor,
            state,
            epoch,
            chain,
            register,
            pinned,
            group,
        } = frame.msg
        else {
            return Err(RemoteError::Protocol("not a create".into()));
        };
        let ctor = shipping::resolve(ctor, Expect::Ctor)?;
        let state = shipping::resolve(state, Expect::State)?;
        if ctor.state_type() != state.state_type() {
            return Err(RemoteError::CodeMismatch(
                "constructor and state type disagree".into(),
            ));
        }
        let Entry::Ctor(build) = ctor.entry else {
            return Err(RemoteError::CodeMismatch("not a constructor".into()));
        };
        let s = {
            let _scope = context::ChainScope::enter(chain);
            let _busy = self.hosting.busy.enter();
            build(&frame.tail)?
        };
        let slot = NewSlot {
            id: proclet,
            kind,
            state,
            epoch,
            pinned,
            group,
        };
        self.install_new(slot, s, register).await.map_err(|e| {
            RemoteError::Internal(format!(
                "cannot record the new proclet at the controller: {e}"
            ))
        })?;
        Ok(Msg::Done)
    }

    /// Host a newly created proclet; with `register`, also record its location at the
    /// controller (undoing the install if that fails).
    pub(super) async fn install_new(
        &self,
        n: NewSlot,
        s: Box<ErasedState>,
        register: bool,
    ) -> Result<(), ControllerError> {
        let (id, kind, epoch) = (n.id, n.kind, n.epoch);
        self.install(n, s);
        if register {
            let loc = Location {
                node: self.id,
                addr: self.addr.clone(),
                epoch,
            };
            if let Err(e) = self.controller.set_location(id, loc, kind).await {
                if let Some(slot) = self.hosting.get(id) {
                    self.hosting.remove(&slot);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Destroy a proclet hosted here: calls in flight finish, waiting ones fail with
    /// "gone", the controller forgets it.
    pub(super) async fn destroy_local(
        &self,
        slot: &Arc<crate::slot::Slot>,
        chain: ChainId,
    ) -> Result<(), RemoteError> {
        let guard = self.lock_slot(slot, chain, CallMode::Exclusive).await?;
        if slot.replicated.load(Ordering::Acquire) {
            self.drop_replicas(slot.id).await;
        }
        guard.set_status(SlotStatus::Destroyed);
        let state = guard.take_state();
        self.hosting.remove(slot);
        drop(guard);
        drop(state);
        if let Err(e) = self.controller.forget(slot.id).await {
            tracing::warn!(proclet = %slot.id, "destroyed, but the controller was not told: {e}");
        }
        Ok(())
    }
}

/// Answer a call with its encoded return value: `buf` holds the response frame's head
/// and the value, except for the large blobs `left_out` (sent from their own memory,
/// each at its offset).
fn answer_value(
    reply: Responder,
    mut buf: Vec<u8>,
    result: Result<(), RemoteError>,
    left_out: Vec<(usize, bytes::Bytes)>,
) {
    if left_out.is_empty() {
        match result
            .and_then(|()| finish_frame(&mut buf).map_err(|e| RemoteError::Decode(e.to_string())))
        {
            Ok(()) => {
                let _ = reply.send_raw(buf);
            }
            Err(e) => reply.error(e),
        }
    } else {
        let extra: usize = left_out.iter().map(|(_, b)| b.len()).sum();
        match result.and_then(|()| {
            finish_frame_leaving_out(&mut buf, extra)
                .map_err(|e| RemoteError::Decode(e.to_string()))
        }) {
            Ok(()) => {
                let head = bytes::Bytes::from(buf);
                let mut parts = Vec::with_capacity(2 * left_out.len() + 1);
                let mut at = 0;
                for (o, b) in left_out {
                    parts.push(head.slice(at..o));
                    parts.push(b);
                    at = o;
                }
                parts.push(head.slice(at..));
                parts.retain(|p| !p.is_empty());
                let _ = reply.send_raw_parts(parts);
            }
            Err(e) => reply.error(e),
        }
    }
}
