//! The calling side of a node: finding proclets, sending calls, creating and destroying.

use super::{chase_exhausted, NewProclet, NodeInner, Remote};
use crate::context;
use crate::error::CallError;
use crate::shipping::{self, Descriptor, ErasedState};
use granule_wire::{
    CallMode, ChainId, CodeRef, Frame, Kind, Location, Msg, NodeId, ProcletId, RemoteError,
};

impl NodeInner {
    /// Send a call to wherever the proclet lives; follows "not here" answers.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn call_remote(
        &self,
        id: ProcletId,
        hint: Option<&Location>,
        code: CodeRef,
        mode: CallMode,
        chain: ChainId,
        arg: &[u8],
    ) -> Result<Remote, CallError> {
        let started = std::time::Instant::now();
        let mut loc = self.resolve(id, hint).await?;
        let mut hops = 0;
        loop {
            if loc.node == self.id {
                if self.table.contains_key(&id) {
                    return Ok(Remote::Local);
                }
                hops += 1;
                if chase_exhausted(hops, started) {
                    return Err(CallError::Internal(format!("cannot find proclet {id}")));
                }
                loc = self.relocate(id, &loc, None, hops).await?;
                continue;
            }
            let conn = self.conn_to(loc.node, &loc.addr).await?;
            let msg = Msg::Call {
                proclet: id,
                code,
                mode,
                chain,
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
                    hops += 1;
                    if chase_exhausted(hops, started) {
                        return Err(CallError::Internal(format!(
                            "proclet {id} kept moving; gave up after {hops} hops in {:?}",
                            started.elapsed()
                        )));
                    }
                    loc = self.relocate(id, &loc, hint, hops).await?;
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
                Err(e) => return Err(self.transport_error(loc.node, e)),
            }
        }
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
        let h = super::serve::Hosting {
            id: new.id,
            kind: new.kind,
            state,
            epoch: new.loc.epoch,
            pinned: new.pinned,
            group: new.group.clone(),
        };
        self.install_new(h, s, !new.placed)
            .await
            .map_err(CallError::from)
    }

    /// Give up a creation that failed after `prepare_create`.
    pub(crate) async fn abort_create(&self, new: &NewProclet) {
        if new.placed {
            let _ = self.controller.forget(new.id).await;
        }
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
        let conn = self.conn_to(loc.node, &loc.addr).await?;
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
                self.learn_location(id, loc);
                Ok(())
            }
            Ok(Frame {
                msg: Msg::Error(e), ..
            }) => Err(CallError::from_remote(e, id)),
            Ok(f) => Err(CallError::Internal(format!(
                "unexpected answer {} to a create",
                f.msg.name()
            ))),
            Err(e) => Err(self.transport_error(loc.node, e)),
        }
    }

    /// Destroy a proclet wherever it lives.
    pub(crate) async fn destroy(
        &self,
        id: ProcletId,
        hint: Option<&Location>,
        chain: ChainId,
    ) -> Result<(), CallError> {
        let started = std::time::Instant::now();
        let mut hops = 0;
        let mut loc: Option<Location> = None;
        loop {
            if let Some(slot) = self.local_slot(id) {
                return self.destroy_local(&slot, chain).await.map_err(|e| match e {
                    RemoteError::NotHere { .. } => CallError::ProcletGone(id),
                    other => CallError::from_remote(other, id),
                });
            }
            let l = match loc.take() {
                Some(l) => l,
                None => self.resolve(id, hint).await?,
            };
            if l.node == self.id {
                hops += 1;
                if chase_exhausted(hops, started) {
                    return Err(CallError::ProcletGone(id));
                }
                loc = Some(self.relocate(id, &l, None, hops).await?);
                continue;
            }
            let conn = self.conn_to(l.node, &l.addr).await?;
            match conn.request(&Msg::Destroy { proclet: id }, &[]).await {
                Ok(Frame { msg: Msg::Done, .. }) => {
                    self.locations.remove(&id);
                    return Ok(());
                }
                Ok(Frame {
                    msg: Msg::Error(RemoteError::NotHere { hint }),
                    ..
                }) => {
                    hops += 1;
                    if chase_exhausted(hops, started) {
                        return Err(CallError::ProcletGone(id));
                    }
                    loc = Some(self.relocate(id, &l, hint, hops).await?);
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
                Err(e) => return Err(self.transport_error(l.node, e)),
            }
        }
    }
}
