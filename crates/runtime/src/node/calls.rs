//! The calling side of a node, top to bottom: a remote call (find the proclet, connect
//! to its node, send, follow "not here" answers), creating a proclet (an id and a place,
//! then the constructor here or there), destroying one, and the location lookups they
//! share, at the end of the file.

use super::hosting::NewSlot;
use super::peers::unreachable;
use super::{NewProclet, NodeInner, Remote};
use crate::context;
use crate::error::CallError;
use crate::shipping::{self, Descriptor, ErasedState};
use granule_wire::{
    CallMode, ChainId, CodeRef, Frame, Kind, Location, Msg, NodeId, ProcletId, RemoteError,
};
use std::time::{Duration, Instant};

/// How many times a call follows "not here" answers before it may give up...
const MAX_HOPS: u32 = 32;
/// ...and for how long at least: a controller slow to learn of a move or a destroy on a
/// loaded machine must not fail calls that a moment's patience would have served.
const HOP_PATIENCE: Duration = Duration::from_secs(2);

impl NodeInner {
    /// Send a call to wherever the proclet lives and return its encoded result, or
    /// [`Remote::Local`] when the proclet turns out to live here. `call` is the call's
    /// id: a replicated proclet whose primary fails mid-call is called again with it at
    /// the new primary, which answers from its record if the call was applied.
    #[allow(clippy::too_many_arguments)] // a call's whole description
    pub(crate) async fn call_remote(
        &self,
        id: ProcletId,
        hint: Option<&Location>,
        code: CodeRef,
        mode: CallMode,
        chain: ChainId,
        call: u64,
        arg: &[u8],
    ) -> Result<Remote, CallError> {
        let mut chase = Chase::new();
        let mut loc = self.locate(id, hint).await?;
        let mut asked_controller = false;
        loop {
            if loc.node == self.id {
                if self.hosting.contains(id) {
                    return Ok(Remote::Local);
                }
                if chase.exhausted() {
                    return Err(CallError::Internal(format!("cannot find proclet {id}")));
                }
                loc = self.relocate(id, &loc, None, chase.hops).await?;
                continue;
            }
            let conn = match self.peers.connect(loc.node, &loc.addr).await {
                Ok(c) => c,
                Err(e) => match self.moved_off(id, &loc, &mut asked_controller).await {
                    Some(l) => {
                        loc = l;
                        continue;
                    }
                    None => return Err(e),
                },
            };
            let msg = Msg::Call {
                proclet: id,
                code,
                mode,
                chain,
                call,
            };
            match conn.request(&msg, arg).await {
                Ok(Frame {
                    msg: Msg::Value,
                    tail,
                    ..
                }) => return Ok(Remote::Value(tail)),
                Ok(Frame {
                    msg: Msg::Error(RemoteError::NotHere { hint }),
                    ..
                }) => {
                    if chase.exhausted() {
                        return Err(CallError::Internal(format!(
                            "proclet {id} kept moving; gave up after {} hops in {:?}",
                            chase.hops,
                            chase.started.elapsed()
                        )));
                    }
                    loc = self.relocate(id, &loc, hint, chase.hops).await?;
                }
                Ok(Frame {
                    msg: Msg::Error(e), ..
                }) => return Err(CallError::from_remote(e, id)),
                Ok(f) => {
                    return Err(CallError::Internal(format!(
                        "unexpected answer {} to a call",
                        f.msg.name()
                    )))
                }
                Err(e) => {
                    // Sent, and no answer: only a replicated proclet's new primary may
                    // be asked again (it knows the call by its id); any other call may
                    // have run, and is not repeated.
                    match self.failed_over(id, &loc, &mut asked_controller).await {
                        Some(l) => {
                            loc = l;
                            continue;
                        }
                        None => return Err(self.peers.transport_error(loc.node, e)),
                    }
                }
            }
        }
    }

    /// A call to `stale` got no answer. If the proclet is replicated, the controller
    /// answers once it has decided whether that node is dead: a new primary elsewhere
    /// (`Some`) is where to ask again. `None` for any other proclet, or when the
    /// controller still places it there. Asked once per call.
    async fn failed_over(
        &self,
        id: ProcletId,
        stale: &Location,
        asked: &mut bool,
    ) -> Option<Location> {
        self.ask_where_now(id, stale, asked, true).await
    }

    /// First step of creating a proclet: an id and a place (the named node, or where the
    /// controller places it, which also records the location).
    pub(crate) async fn prepare_create(
        &self,
        kind: Kind,
        on: Option<NodeId>,
        mem_hint: u64,
    ) -> Result<NewProclet, CallError> {
        let id = self.next_id().await?;
        let (loc, placed) = match on {
            Some(n) => (
                Location {
                    node: n,
                    addr: self.addr_of(n).await?,
                    epoch: 1,
                },
                false,
            ),
            None => (self.controller.place(id, kind, mem_hint).await?, true),
        };
        Ok(NewProclet {
            id,
            kind,
            loc,
            placed,
            pinned: false,
            group: None,
        })
    }

    /// Finish a creation on this node with a state built here.
    pub(crate) async fn create_here(
        &self,
        new: &NewProclet,
        state: &'static Descriptor,
        s: Box<ErasedState>,
    ) -> Result<(), CallError> {
        let slot = NewSlot {
            id: new.id,
            kind: new.kind,
            state,
            epoch: new.loc.epoch,
            pinned: new.pinned,
            group: new.group.clone(),
        };
        self.install_new(slot, s, !new.placed)
            .await
            .map_err(CallError::from)
    }

    /// Finish a creation on another node: ship the constructor and its encoded argument.
    pub(crate) async fn create_remote(
        &self,
        new: &NewProclet,
        ctor: &'static Descriptor,
        state: &'static Descriptor,
        arg: &[u8],
    ) -> Result<(), CallError> {
        let (id, loc) = (new.id, &new.loc);
        let conn = self.peers.connect(loc.node, &loc.addr).await?;
        let msg = Msg::Create {
            proclet: id,
            kind: new.kind,
            ctor: shipping::code_ref(ctor),
            state: shipping::code_ref(state),
            epoch: loc.epoch,
            chain: context::chain_for_call(),
            register: !new.placed,
            pinned: new.pinned,
            group: new.group.clone(),
        };
        match conn.request(&msg, arg).await {
            Ok(Frame { msg: Msg::Done, .. }) => {
                self.locations.learn(id, loc);
                Ok(())
            }
            Ok(Frame {
                msg: Msg::Error(e), ..
            }) => Err(CallError::from_remote(e, id)),
            Ok(f) => Err(CallError::Internal(format!(
                "unexpected answer {} to a create",
                f.msg.name()
            ))),
            Err(e) => Err(self.peers.transport_error(loc.node, e)),
        }
    }

    /// Give a proclet just created `copies − 1` backups: the controller places them, and
    /// the primary's node streams the state to each.
    pub(crate) async fn replicate_new(
        &self,
        new: &NewProclet,
        copies: u32,
    ) -> Result<(), CallError> {
        // The pressure policy may move the new proclet before it has its backups: then
        // the backups are placed again around where it went, and asked of it there.
        let mut moved = 0;
        loop {
            let set = self.controller.place_backups(new.id, copies - 1).await?;
            let at = set.primary.clone();
            let outcome = if at.node == self.id {
                self.add_backups(set, copies).await.map(|_| ())
            } else {
                let conn = self.peers.connect(at.node, &at.addr).await?;
                match conn.request(&Msg::AddBackups(set), &[]).await {
                    Ok(Frame { msg: Msg::Done, .. }) => Ok(()),
                    Ok(Frame {
                        msg: Msg::Error(e), ..
                    }) => Err(e),
                    Ok(f) => Err(RemoteError::Internal(format!(
                        "unexpected answer {} to adding backups",
                        f.msg.name()
                    ))),
                    Err(e) => return Err(self.peers.transport_error(at.node, e)),
                }
            };
            match outcome {
                Err(RemoteError::NotHere { .. }) if moved < 8 => {
                    moved += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                other => return other.map_err(|e| CallError::from_remote(e, new.id)),
            }
        }
    }

    /// Give up a creation that failed after `prepare_create`.
    pub(crate) async fn abort_create(&self, new: &NewProclet) {
        if new.placed {
            let _ = self.controller.forget(new.id).await;
        }
    }

    /// Destroy a proclet wherever it lives.
    pub(crate) async fn destroy(
        &self,
        id: ProcletId,
        hint: Option<&Location>,
        chain: ChainId,
    ) -> Result<(), CallError> {
        let mut chase = Chase::new();
        let mut next: Option<Location> = None;
        let mut asked_controller = false;
        loop {
            if let Some(slot) = self.hosting.get(id) {
                return self.destroy_local(&slot, chain).await.map_err(|e| match e {
                    RemoteError::NotHere { .. } => CallError::ProcletGone(id),
                    other => CallError::from_remote(other, id),
                });
            }
            let loc = match next.take() {
                Some(l) => l,
                None => self.locate(id, hint).await?,
            };
            if loc.node == self.id {
                if chase.exhausted() {
                    return Err(CallError::ProcletGone(id));
                }
                next = Some(self.relocate(id, &loc, None, chase.hops).await?);
                continue;
            }
            let conn = match self.peers.connect(loc.node, &loc.addr).await {
                Ok(c) => c,
                Err(e) => match self.moved_off(id, &loc, &mut asked_controller).await {
                    Some(l) => {
                        next = Some(l);
                        continue;
                    }
                    None => return Err(e),
                },
            };
            match conn.request(&Msg::Destroy { proclet: id }, &[]).await {
                Ok(Frame { msg: Msg::Done, .. }) => {
                    self.locations.forget(id);
                    return Ok(());
                }
                Ok(Frame {
                    msg: Msg::Error(RemoteError::NotHere { hint }),
                    ..
                }) => {
                    if chase.exhausted() {
                        return Err(CallError::ProcletGone(id));
                    }
                    next = Some(self.relocate(id, &loc, hint, chase.hops).await?);
                }
                Ok(Frame {
                    msg: Msg::Error(e), ..
                }) => return Err(CallError::from_remote(e, id)),
                Ok(f) => {
                    return Err(CallError::Internal(format!(
                        "unexpected answer {} to a destroy",
                        f.msg.name()
                    )))
                }
                Err(e) => return Err(self.peers.transport_error(loc.node, e)),
            }
        }
    }

    // ---- finding proclets and nodes ---------------------------------------------------

    /// Where to send a call first: the cached location, else the handle's hint, else the
    /// controller's answer.
    async fn locate(&self, id: ProcletId, hint: Option<&Location>) -> Result<Location, CallError> {
        if let Some(l) = self.locations.cached(id) {
            return Ok(l);
        }
        if let Some(h) = hint {
            return Ok(h.clone());
        }
        self.locate_at_controller(id).await
    }

    /// The controller's record of where a proclet lives (cached from then on).
    pub(crate) async fn locate_at_controller(&self, id: ProcletId) -> Result<Location, CallError> {
        match self.controller.locate(id).await? {
            Some((loc, true)) => {
                self.locations.learn(id, &loc);
                Ok(loc)
            }
            Some((loc, false)) => Err(unreachable(
                loc.node,
                "the controller declared it dead; its proclets are lost",
            )),
            None => Err(CallError::ProcletGone(id)),
        }
    }

    /// The node at `stale` cannot be reached (nothing was sent). A cached location, or
    /// the handle's hint, may name a node the proclet left before that node went away:
    /// ask the controller once per call, and go on where it says if that is elsewhere.
    /// `None`: the proclet is (as far as anyone knows) on that node, and the caller gets
    /// the connection's error.
    async fn moved_off(
        &self,
        id: ProcletId,
        stale: &Location,
        asked: &mut bool,
    ) -> Option<Location> {
        self.ask_where_now(id, stale, asked, false).await
    }

    /// Ask the controller (once per call: `asked`) where proclet `id` is now that
    /// `stale` failed it: a live place elsewhere, if any — and only for a replicated
    /// proclet when `replicated_only` (another proclet's call that got no answer may
    /// have run, and is not sent again). For a replicated proclet the controller
    /// answers once it knows whether the node is dead (and a backup took over); for
    /// others at once.
    async fn ask_where_now(
        &self,
        id: ProcletId,
        stale: &Location,
        asked: &mut bool,
        replicated_only: bool,
    ) -> Option<Location> {
        if std::mem::replace(asked, true) {
            return None;
        }
        match self.controller.failover(id, stale.node).await {
            Ok(Some((loc, true, replicated)))
                if loc.node != stale.node && (replicated || !replicated_only) =>
            {
                self.locations.learn(id, &loc);
                Some(loc)
            }
            _ => None,
        }
    }

    /// After a "not here" from `stale`: the next place to try.
    async fn relocate(
        &self,
        id: ProcletId,
        stale: &Location,
        hint: Option<Location>,
        hops: u32,
    ) -> Result<Location, CallError> {
        self.locations.forget(id);
        if let Some(h) = hint {
            // Only a newer epoch is news. A forwarding entry no newer than what the caller
            // already knew is left from an earlier stay: two such entries pointing at each
            // other would bounce the call between their nodes until it gave up.
            if h.epoch > stale.epoch {
                self.locations.learn(id, &h);
                return Ok(h);
            }
        }
        let loc = self.locate_at_controller(id).await?;
        if loc.node == stale.node && loc.epoch <= stale.epoch {
            // The controller has not caught up with a move yet: back off a little.
            tokio::time::sleep(Duration::from_micros((200 * hops as u64).min(5_000))).await;
        }
        Ok(loc)
    }

    /// The address of a node (from the membership, refreshed from the controller when
    /// the node is not in it).
    pub(crate) async fn addr_of(&self, node: NodeId) -> Result<String, CallError> {
        if node == self.id {
            return Ok(self.addr.clone());
        }
        if let Some(a) = self.peers.addr_of(node) {
            return Ok(a);
        }
        let list = self.controller.list_nodes().await?;
        for down in self.peers.update_members(list, 0) {
            self.peers.on_node_down(self.id, down);
        }
        self.peers
            .addr_of(node)
            .ok_or_else(|| CallError::Refused(format!("there is no node {node} in this cluster")))
    }
}

/// How far a call has chased a moving proclet.
struct Chase {
    hops: u32,
    started: Instant,
}

impl Chase {
    fn new() -> Chase {
        Chase {
            hops: 0,
            started: Instant::now(),
        }
    }

    /// Count one more hop; whether the chase should give up now (more than [`MAX_HOPS`]
    /// hops and longer than [`HOP_PATIENCE`]).
    fn exhausted(&mut self) -> bool {
        self.hops += 1;
        self.hops > MAX_HOPS && self.started.elapsed() > HOP_PATIENCE
    }
}
