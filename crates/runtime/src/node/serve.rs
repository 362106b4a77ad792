//! The hosting side of a node: the proclet table, serving calls, creations, destroys,
//! installs and moves, and the handler every connection of the node uses.

use super::NodeInner;
use crate::context::{self, NodeCell};
use crate::shipping::{self, Descriptor, Entry, ErasedState, Expect};
use crate::slot::{Guard, LockError, Slot, SlotStatus, TryLock};
use granule_controller::ControllerError;
use granule_transport::{Connection, Handler, Responder};
use granule_wire::{
    begin_frame, finish_frame, CallMode, ChainId, Epoch, Frame, FrameKind, Kind, Location, Msg,
    ProcletId, RemoteError, Role,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a node records about a proclet it starts hosting.
pub(super) struct Hosting {
    pub id: ProcletId,
    pub kind: Kind,
    pub state: &'static Descriptor,
    pub epoch: Epoch,
    pub pinned: bool,
    pub group: Option<String>,
}

impl NodeInner {
    pub(super) fn install(&self, h: Hosting, s: Box<ErasedState>) {
        let Hosting {
            id,
            kind,
            state,
            epoch,
            pinned,
            group,
        } = h;
        let slot = Slot::new(id, kind, state, epoch, s, group.map(Arc::from));
        slot.pinned.store(pinned, Ordering::Relaxed);
        self.forwarding.remove(&id);
        self.locations.remove(&id);
        self.monitor.measure_now(&slot);
        if self.table.insert(id, slot).is_none() {
            self.hosted[kind.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Change a hosted proclet's kind (counters follow); `false` if it is not here.
    pub(crate) fn retag(&self, id: ProcletId, kind: Kind) -> bool {
        let Some(slot) = self.table.get(&id).map(|s| s.clone()) else {
            return false;
        };
        let old = slot.set_kind(kind);
        if old != kind {
            self.hosted[old.index()].fetch_sub(1, Ordering::Relaxed);
            self.hosted[kind.index()].fetch_add(1, Ordering::Relaxed);
            // Its use is judged afresh against the new kind.
            slot.stats.warned.store(false, Ordering::Relaxed);
        }
        true
    }

    /// The kind of a proclet hosted here.
    pub(crate) fn hosted_kind(&self, id: ProcletId) -> Option<Kind> {
        self.table.get(&id).map(|s| s.kind())
    }

    pub(super) fn remove_hosted(&self, slot: &Slot) {
        // Only this very slot: the proclet may have come back and be hosted anew.
        if self
            .table
            .remove_if(&slot.id, |_, s| std::ptr::eq(&**s, slot))
            .is_some()
        {
            self.hosted[slot.kind().index()].fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub(super) fn not_here(&self, id: ProcletId) -> RemoteError {
        RemoteError::NotHere {
            hint: self.forwarding.get(&id).map(|l| l.clone()),
        }
    }

    pub(super) fn lock_error(&self, id: ProcletId, e: LockError) -> RemoteError {
        match e {
            LockError::Reentrant => RemoteError::Reentrant(id),
            LockError::Moved(l) => RemoteError::NotHere { hint: Some(l) },
            LockError::Destroyed => RemoteError::Gone,
        }
    }

    /// Take a slot's lock, waiting without blocking the thread.
    pub(super) async fn lock_slot(
        &self,
        slot: &Arc<Slot>,
        chain: ChainId,
        mode: CallMode,
    ) -> Result<Guard, RemoteError> {
        let r = match slot.lock(chain, mode) {
            Ok(TryLock::Granted(g)) => Ok(g),
            Ok(TryLock::Wait(w)) => w.await,
            Err(e) => Err(e),
        };
        r.map_err(|e| self.lock_error(slot.id, e))
    }

    pub(super) async fn destroy_local(
        &self,
        slot: &Arc<Slot>,
        chain: ChainId,
    ) -> Result<(), RemoteError> {
        let guard = self.lock_slot(slot, chain, CallMode::Exclusive).await?;
        guard.set_status(SlotStatus::Destroyed);
        let state = guard.take_state();
        self.remove_hosted(slot);
        drop(guard);
        drop(state);
        if let Err(e) = self.controller.forget(slot.id).await {
            tracing::warn!(proclet = %slot.id, "destroyed, but the controller was not told: {e}");
        }
        Ok(())
    }

    pub(super) async fn serve_call(self: Arc<Self>, frame: Frame, reply: Responder) {
        let Msg::Call {
            proclet,
            code,
            mode,
            chain,
        } = frame.msg
        else {
            return;
        };
        let received = std::time::Instant::now();
        let Some(slot) = self.local_slot(proclet) else {
            return reply.error(self.not_here(proclet));
        };
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
        let mut buf = match begin_frame(FrameKind::Response, reply.id(), &Msg::Value, 64) {
            Ok(b) => b,
            Err(e) => return reply.error(RemoteError::Internal(e.to_string())),
        };
        let result = {
            let _scope = context::ChainScope::enter(chain);
            let _busy = self.busy.enter();
            match desc.entry {
                Entry::CallMut(f) => guard.with_mut(|s| f(s, &frame.tail, &mut buf)),
                Entry::CallRef(f) => guard.with_ref(|s| f(s, &frame.tail, &mut buf)),
                _ => Err(RemoteError::CodeMismatch("not a call".into())),
            }
        };
        drop(guard);
        self.calls_served.fetch_add(1, Ordering::Relaxed);
        match result
            .and_then(|()| finish_frame(&mut buf).map_err(|e| RemoteError::Decode(e.to_string())))
        {
            Ok(()) => {
                let _ = reply.send_raw(buf);
            }
            Err(e) => reply.error(e),
        }
        crate::telemetry::call_served(&self, received.elapsed());
    }

    /// Host a newly created proclet; with `register`, also record its location at the
    /// controller (undoing the install if that fails).
    pub(super) async fn install_new(
        &self,
        h: Hosting,
        s: Box<ErasedState>,
        register: bool,
    ) -> Result<(), ControllerError> {
        let (id, kind, epoch) = (h.id, h.kind, h.epoch);
        self.install(h, s);
        if register {
            let loc = Location {
                node: self.id,
                addr: self.addr.clone(),
                epoch,
            };
            if let Err(e) = self.controller.set_location(id, loc, kind).await {
                if let Some(slot) = self.local_slot(id) {
                    self.remove_hosted(&slot);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    pub(super) async fn serve_create(self: Arc<Self>, frame: Frame) -> Result<Msg, RemoteError> {
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
            let _busy = self.busy.enter();
            build(&frame.tail)?
        };
        let h = Hosting {
            id: proclet,
            kind,
            state,
            epoch,
            pinned,
            group,
        };
        self.install_new(h, s, register).await.map_err(|e| {
            RemoteError::Internal(format!(
                "cannot record the new proclet at the controller: {e}"
            ))
        })?;
        Ok(Msg::Done)
    }

    pub(super) async fn serve(self: Arc<Self>, frame: Frame, reply: Responder) {
        let out = match &frame.msg {
            Msg::Call { .. } => return self.serve_call(frame, reply).await,
            Msg::Create { .. } => self.serve_create(frame).await,
            Msg::Destroy { proclet } => {
                let id = *proclet;
                match self.local_slot(id) {
                    Some(slot) => self
                        .destroy_local(&slot, context::new_chain())
                        .await
                        .map(|()| Msg::Done),
                    None => Err(self.not_here(id)),
                }
            }
            Msg::MoveOut { proclet, to } => {
                let (p, t) = (*proclet, to.clone());
                self.move_out_on_workers(p, t, None).await.map(Msg::Moved)
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
}

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
            Msg::Call { .. } | Msg::Create { .. } | Msg::Transfer { .. } | Msg::Destroy { .. } => {
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
        if let Msg::Transfer { .. } = &frame.msg {
            // In order, on the reader: chunks must be appended as they arrive.
            node.receive_transfer(conn, frame, reply);
            return;
        }
        tokio::spawn(node.serve(frame, reply));
    }

    fn on_notify(&self, conn: &Arc<Connection>, frame: Frame) {
        let Some(node) = self.node() else { return };
        let from_controller = conn.peer().is_some_and(|p| p.role == Role::Controller);
        match frame.msg {
            Msg::NodeDown { node: n } if from_controller => node.on_node_down(n),
            Msg::Shutdown { reason } if from_controller => node.trigger_shutdown(reason),
            Msg::TransferAbort { proclet } => node.abort_transfer(conn, proclet),
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
            node.drop_transfers_of(conn);
            node.forget_conn(conn);
        }
    }
}
