//! A node: the per-process runtime that hosts proclets and makes calls.
//!
//! Owns the proclet table, the location cache, the pool of connections to other nodes,
//! the controller connection and heartbeats, and serving requests (calls, creations,
//! destroys, moves). Every Granule process that hosts proclets — the driver and each node
//! process — runs exactly one.
//!
//! Threads:
//! - *workers* (a tokio runtime with one thread per core of the node's spec): accept and
//!   read connections and run incoming calls to completion on the thread that read them
//!   (each call is its own task, so a call blocked in a nested call never stops its
//!   connection from being read);
//! - *control* (one thread): the controller connection, heartbeats, move orders. It is
//!   separate so a node whose cores are saturated by long closures still heartbeats and is
//!   not declared dead.

use crate::busy::BusyBoard;
use crate::context::{self, NodeCell};
use crate::error::{CallError, ClusterError};
use crate::shipping::{self, Descriptor, Entry, ErasedState, Expect};
use crate::slot::{Guard, LockError, Slot, SlotStatus, TryLock};
use crate::usage::{resident_bytes, CpuMeter};
use bytes::Bytes;
use dashmap::DashMap;
use granule_controller::{ControllerClient, ControllerError};
use granule_transport::{
    serve, Connection, Handler, Identity, Listener, Responder, TransportConfig, TransportError,
};
use granule_wire::{
    begin_frame, finish_frame, CallMode, ChainId, CodeRef, Epoch, Frame, FrameKind, Kind, Location,
    Msg, NodeId, NodeInfo, NodeSpec, NodeState, ProcletId, RemoteError, Role, Usage,
};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::OnceCell;

/// How many times a call follows "not here" answers before giving up.
const MAX_HOPS: u32 = 32;
/// Proclet ids fetched from the controller at once.
const ID_BLOCK: u32 = 1024;

/// What a node is started with.
#[derive(Clone, Debug)]
pub(crate) struct NodeOptions {
    pub role: Role,
    pub spec: NodeSpec,
    pub controller: String,
    pub listen_host: String,
}

/// A proclet being created: its id and where it goes.
pub(crate) struct NewProclet {
    pub id: ProcletId,
    pub kind: Kind,
    pub loc: Location,
    /// The controller chose the node (and already recorded the location).
    pub placed: bool,
}

/// The result of trying a call remotely.
pub(crate) enum Remote {
    /// The encoded return value.
    Value(Bytes),
    /// The proclet turned out to live on this node now: call it locally.
    Local,
}

pub(crate) struct NodeInner {
    pub id: NodeId,
    pub role: Role,
    pub addr: String,
    /// The worker runtime.
    pub handle: Handle,
    control: Handle,
    identity: Arc<Identity>,
    tconfig: Arc<TransportConfig>,
    pub controller: ControllerClient,
    table: DashMap<ProcletId, Arc<Slot>>,
    /// Where proclets that left this node went (answers "not here" with a hint).
    forwarding: DashMap<ProcletId, Location>,
    /// Cached locations of proclets hosted elsewhere.
    locations: DashMap<ProcletId, Location>,
    peers: Mutex<HashMap<NodeId, Arc<OnceCell<Arc<Connection>>>>>,
    dead: Mutex<HashSet<NodeId>>,
    members: Mutex<HashMap<NodeId, NodeInfo>>,
    members_version: AtomicU64,
    ids: Mutex<Range<u64>>,
    pub calls_served: AtomicU64,
    hosted: [AtomicU32; 3],
    stopped: AtomicBool,
    shutdown: (Mutex<Option<String>>, Condvar),
    handler: Arc<NodeHandler>,
    /// Which workers are inside closures (for the I/O watchdog).
    pub(crate) busy: Arc<BusyBoard>,
}

/// Owns a node's runtimes; stopping it stops the node.
pub(crate) struct Node {
    pub inner: Arc<NodeInner>,
    workers: Option<Runtime>,
    control: Option<Runtime>,
}

fn io_err(what: &str, e: impl std::fmt::Display) -> ClusterError {
    ClusterError::Io(format!("{what}: {e}"))
}

impl Node {
    /// Start a node: runtimes, listener, registration with the controller, heartbeats.
    pub(crate) fn start(opts: NodeOptions) -> Result<Node, ClusterError> {
        context::install_panic_hook();
        let cell: Arc<NodeCell> = Arc::new(OnceLock::new());
        let workers_n = (opts.spec.cores.ceil() as usize).max(1);
        let wcell = cell.clone();
        let busy = Arc::new(BusyBoard::new());
        let wbusy = busy.clone();
        let workers = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers_n)
            .thread_name("granule-worker")
            .enable_all()
            .on_thread_start(move || {
                context::mark_worker();
                context::set_thread_node(&wcell);
                wbusy.register_thread();
            })
            .build()
            .map_err(|e| io_err("cannot start the worker runtime", e))?;
        let ccell = cell.clone();
        let control = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("granule-control")
            .enable_all()
            .on_thread_start(move || context::set_thread_node(&ccell))
            .build()
            .map_err(|e| io_err("cannot start the control runtime", e))?;

        let bind_addr = format!("{}:0", opts.listen_host);
        let listener = context::block_on(
            workers
                .handle()
                .spawn(async move { Listener::bind(&bind_addr).await }),
            None,
        )
        .ok_or_else(|| io_err("bind", "interrupted"))?
        .map_err(|e| io_err("bind", e))?
        .map_err(|e| io_err("cannot listen for other nodes", e))?;
        let addr = listener.local_addr().to_string();

        let program = std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| "unknown".into());
        let binary = shipping::binary_hash();
        let handler = Arc::new(NodeHandler { cell: cell.clone() });
        let ctl_identity = Arc::new(Identity {
            role: opts.role,
            node: None,
            binary: Some(binary),
            program: program.clone(),
        });
        let ctl_addr = opts.controller.clone();
        let h: Arc<dyn Handler> = handler.clone();
        let role = opts.role;
        let spec = opts.spec;
        let reg_addr = addr.clone();
        let reg_program = program.clone();
        let joined = context::block_on(
            control.handle().spawn(async move {
                let client = ControllerClient::connect(&ctl_addr, ctl_identity, h).await?;
                let reg = client
                    .register(role, spec, reg_addr, binary, reg_program)
                    .await?;
                Ok::<_, ControllerError>((client, reg))
            }),
            None,
        )
        .ok_or_else(|| io_err("register", "interrupted"))?
        .map_err(|e| io_err("register", e))?;
        let (controller, reg) = joined?;

        let identity = Arc::new(Identity {
            role: opts.role,
            node: Some(reg.node),
            binary: Some(binary),
            program,
        });
        let inner = Arc::new(NodeInner {
            id: reg.node,
            role: opts.role,
            addr,
            handle: workers.handle().clone(),
            control: control.handle().clone(),
            identity: identity.clone(),
            tconfig: Arc::new(TransportConfig::default()),
            controller,
            table: DashMap::new(),
            forwarding: DashMap::new(),
            locations: DashMap::new(),
            peers: Mutex::new(HashMap::new()),
            dead: Mutex::new(HashSet::new()),
            members: Mutex::new(HashMap::new()),
            members_version: AtomicU64::new(0),
            ids: Mutex::new(0..0),
            calls_served: AtomicU64::new(0),
            hosted: Default::default(),
            stopped: AtomicBool::new(false),
            shutdown: (Mutex::new(None), Condvar::new()),
            handler: handler.clone(),
            busy,
        });
        let _ = cell.set(Arc::downgrade(&inner));

        let h: Arc<dyn Handler> = handler;
        let tconfig = inner.tconfig.clone();
        workers.spawn(serve(listener, identity, tconfig, h));
        control.spawn(heartbeat_loop(inner.clone(), reg.heartbeat));
        let weak = Arc::downgrade(&inner);
        control.spawn(crate::busy::watchdog(
            inner.busy.clone(),
            workers.handle().clone(),
            move || weak.upgrade().is_none_or(|n| n.is_stopped()),
        ));
        tracing::info!(node = %inner.id, role = ?inner.role, addr = %inner.addr, "node started");
        Ok(Node {
            inner,
            workers: Some(workers),
            control: Some(control),
        })
    }

    /// Stop serving: mark the node stopped and shut its runtimes down.
    pub(crate) fn stop(&mut self) {
        self.inner.stopped.store(true, Ordering::Release);
        self.inner.trigger_shutdown("stopped".into());
        if let Some(rt) = self.workers.take() {
            rt.shutdown_background();
        }
        if let Some(rt) = self.control.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn heartbeat_loop(node: Arc<NodeInner>, every: Duration) {
    let mut meter = CpuMeter::new();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if node.is_stopped() {
            return;
        }
        let usage = Usage {
            cores_busy: meter.sample(),
            mem_used: resident_bytes(),
            proclets: [
                node.hosted[0].load(Ordering::Relaxed),
                node.hosted[1].load(Ordering::Relaxed),
                node.hosted[2].load(Ordering::Relaxed),
            ],
            calls_served: node.calls_served.load(Ordering::Relaxed),
        };
        match node.controller.heartbeat(node.id, usage).await {
            Ok(version) => {
                if version != node.members_version.load(Ordering::Relaxed) {
                    if let Ok(list) = node.controller.list_nodes().await {
                        node.update_members(list);
                        node.members_version.store(version, Ordering::Relaxed);
                    }
                }
            }
            Err(ControllerError::Remote(RemoteError::NodeDown(_))) => {
                node.trigger_shutdown("the controller declared this node dead".into());
                return;
            }
            Err(e) => {
                node.trigger_shutdown(format!("lost the controller: {e}"));
                return;
            }
        }
    }
}

impl NodeInner {
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Ask the node's owner to stop (controller said so, or the controller is gone).
    pub(crate) fn trigger_shutdown(&self, reason: String) {
        let mut r = self.shutdown.0.lock();
        if r.is_none() {
            if self.role == Role::Node && reason != "stopped" {
                // Normal at the end of a run (the driver went away); a warning otherwise.
                if reason.contains("shutting down") || reason.contains("lost the controller") {
                    tracing::info!(node = %self.id, "leaving the cluster: {reason}");
                } else {
                    tracing::warn!(node = %self.id, "leaving the cluster: {reason}");
                }
            }
            *r = Some(reason);
            self.shutdown.1.notify_all();
        }
    }

    /// Block until the node is asked to stop; returns why.
    pub(crate) fn wait_shutdown(&self) -> String {
        let mut r = self.shutdown.0.lock();
        while r.is_none() {
            self.shutdown.1.wait(&mut r);
        }
        r.clone().unwrap_or_default()
    }

    fn update_members(&self, list: Vec<NodeInfo>) {
        let mut dead = Vec::new();
        {
            let mut m = self.members.lock();
            m.clear();
            for n in list {
                if n.state == NodeState::Dead {
                    dead.push(n.id);
                }
                m.insert(n.id, n);
            }
        }
        for d in dead {
            self.on_node_down(d);
        }
    }

    /// The address of a node (from the membership cache, refreshed on a miss).
    pub(crate) async fn addr_of(&self, node: NodeId) -> Result<String, CallError> {
        if node == self.id {
            return Ok(self.addr.clone());
        }
        if let Some(n) = self.members.lock().get(&node) {
            return Ok(n.addr.clone());
        }
        let list = self.controller.list_nodes().await?;
        self.update_members(list);
        self.members
            .lock()
            .get(&node)
            .map(|n| n.addr.clone())
            .ok_or_else(|| CallError::Refused(format!("there is no node {node} in this cluster")))
    }

    /// A node was declared dead: fail everything waiting on it.
    pub(crate) fn on_node_down(&self, node: NodeId) {
        if !self.dead.lock().insert(node) {
            return;
        }
        tracing::info!(node = %self.id, dead = %node, "peer declared dead");
        let cell = self.peers.lock().remove(&node);
        if let Some(conn) = cell.and_then(|c| c.get().cloned()) {
            conn.close(format!("node {node} was declared dead"));
        }
    }

    fn is_dead(&self, node: NodeId) -> bool {
        self.dead.lock().contains(&node)
    }

    /// The next proclet id (a controller round trip once per block).
    pub(crate) async fn next_id(&self) -> Result<ProcletId, CallError> {
        {
            let mut ids = self.ids.lock();
            if let Some(id) = ids.next() {
                return Ok(ProcletId(id));
            }
        }
        let block = self.controller.alloc_ids(ID_BLOCK).await?;
        let mut ids = self.ids.lock();
        if ids.is_empty() {
            *ids = block;
        }
        ids.next()
            .map(ProcletId)
            .ok_or_else(|| CallError::Internal("empty id block".into()))
    }

    // ---- connections ----------------------------------------------------------------

    fn unreachable(node: NodeId, e: impl std::fmt::Display) -> CallError {
        CallError::NodeUnreachable {
            node,
            reason: e.to_string(),
        }
    }

    fn transport_error(&self, node: NodeId, e: TransportError) -> CallError {
        match e {
            TransportError::BinaryMismatch(m) => CallError::BinaryMismatch(m),
            TransportError::Wire(w) => CallError::Decode(w.to_string()),
            other => {
                if self.is_dead(node) {
                    Self::unreachable(node, "the controller declared it dead")
                } else {
                    Self::unreachable(node, other)
                }
            }
        }
    }

    /// The connection to `node`, opened on first use.
    pub(crate) async fn conn_to(
        &self,
        node: NodeId,
        addr: &str,
    ) -> Result<Arc<Connection>, CallError> {
        for _ in 0..2 {
            if self.is_dead(node) {
                return Err(Self::unreachable(node, "the controller declared it dead"));
            }
            if self.is_stopped() {
                return Err(CallError::NoCluster);
            }
            let cell = self
                .peers
                .lock()
                .entry(node)
                .or_insert_with(|| Arc::new(OnceCell::new()))
                .clone();
            let identity = self.identity.clone();
            let tconfig = self.tconfig.clone();
            let handler: Arc<dyn Handler> = self.handler.clone();
            let addr_s = addr.to_string();
            let handle = self.handle.clone();
            let conn = cell
                .get_or_try_init(|| async move {
                    // Connect on the worker runtime (its tasks must live there), whatever
                    // thread asked.
                    match handle
                        .spawn(async move {
                            Connection::connect(&addr_s, identity, tconfig, handler).await
                        })
                        .await
                    {
                        Ok(r) => r,
                        Err(e) => Err(TransportError::Closed {
                            peer: "?".into(),
                            reason: format!("connect task failed: {e}"),
                        }),
                    }
                })
                .await
                .map_err(|e| self.transport_error(node, e))?
                .clone();
            if !conn.is_closed() {
                return Ok(conn);
            }
            let mut peers = self.peers.lock();
            if peers.get(&node).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                peers.remove(&node);
            }
        }
        Err(Self::unreachable(node, "connection keeps closing"))
    }

    fn forget_conn(&self, conn: &Arc<Connection>) {
        let Some(node) = conn.peer().and_then(|p| p.node) else {
            return;
        };
        let mut peers = self.peers.lock();
        if let Some(cell) = peers.get(&node) {
            if cell.get().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                peers.remove(&node);
            }
        }
    }

    // ---- locations --------------------------------------------------------------------

    pub(crate) fn local_slot(&self, id: ProcletId) -> Option<Arc<Slot>> {
        self.table.get(&id).map(|s| s.clone())
    }

    /// Best known location of a proclet hosted elsewhere.
    pub(crate) fn cached_location(&self, id: ProcletId) -> Option<Location> {
        self.locations.get(&id).map(|l| l.clone())
    }

    /// Remember a location unless a newer one is known.
    pub(crate) fn learn_location(&self, id: ProcletId, loc: &Location) {
        match self.locations.get_mut(&id) {
            Some(mut cur) => {
                if cur.epoch < loc.epoch {
                    *cur = loc.clone();
                }
            }
            None => {
                self.locations.insert(id, loc.clone());
            }
        }
    }

    /// Current location, asking the controller when nothing is cached.
    async fn resolve(&self, id: ProcletId, hint: Option<&Location>) -> Result<Location, CallError> {
        if let Some(l) = self.cached_location(id) {
            return Ok(l);
        }
        if let Some(h) = hint {
            return Ok(h.clone());
        }
        self.locate_at_controller(id).await
    }

    async fn locate_at_controller(&self, id: ProcletId) -> Result<Location, CallError> {
        match self.controller.locate(id).await? {
            Some((loc, true)) => {
                self.learn_location(id, &loc);
                Ok(loc)
            }
            Some((loc, false)) => Err(Self::unreachable(
                loc.node,
                "the controller declared it dead; its proclets are lost",
            )),
            None => Err(CallError::ProcletGone(id)),
        }
    }

    /// After a "not here": the next place to try.
    async fn relocate(
        &self,
        id: ProcletId,
        stale: &Location,
        hint: Option<Location>,
        hops: u32,
    ) -> Result<Location, CallError> {
        self.locations.remove(&id);
        if let Some(h) = hint {
            if h.epoch > stale.epoch || h.node != stale.node {
                self.learn_location(id, &h);
                return Ok(h);
            }
        }
        let loc = self.locate_at_controller(id).await?;
        if loc.node == stale.node && loc.epoch <= stale.epoch {
            // The controller has not caught up with a move yet: back off a little.
            tokio::time::sleep(Duration::from_micros(200 * hops as u64)).await;
        }
        Ok(loc)
    }

    // ---- making calls -------------------------------------------------------------------

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
        let mut loc = self.resolve(id, hint).await?;
        let mut hops = 0;
        loop {
            if loc.node == self.id {
                if self.table.contains_key(&id) {
                    return Ok(Remote::Local);
                }
                hops += 1;
                if hops > MAX_HOPS {
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
            let r = conn
                .request_with(|rid| {
                    let mut buf = begin_frame(FrameKind::Request, rid, &msg, arg.len())?;
                    buf.extend_from_slice(arg);
                    finish_frame(&mut buf)?;
                    Ok(buf)
                })
                .await;
            match r {
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
                    if hops > MAX_HOPS {
                        return Err(CallError::Internal(format!(
                            "proclet {id} kept moving; gave up after {MAX_HOPS} hops"
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
                Err(TransportError::Wire(granule_wire::WireError::Encode(m))) => {
                    return Err(CallError::Decode(m))
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
        })
    }

    /// Finish a creation on this node with a state built here.
    pub(crate) async fn create_here(
        &self,
        new: &NewProclet,
        state: &'static Descriptor,
        s: Box<ErasedState>,
    ) -> Result<(), CallError> {
        self.install(new.id, new.kind, state, new.loc.epoch, s);
        if !new.placed {
            if let Err(e) = self
                .controller
                .set_location(new.id, new.loc.clone(), new.kind)
                .await
            {
                if let Some(slot) = self.local_slot(new.id) {
                    self.remove_hosted(&slot);
                }
                return Err(e.into());
            }
        }
        Ok(())
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
        };
        let r = conn
            .request_with(|rid| {
                let mut buf = begin_frame(FrameKind::Request, rid, &msg, arg.len())?;
                buf.extend_from_slice(arg);
                finish_frame(&mut buf)?;
                Ok(buf)
            })
            .await;
        match r {
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
                if hops > MAX_HOPS {
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
                    if hops > MAX_HOPS {
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

    // ---- hosting ----------------------------------------------------------------------

    fn install(
        &self,
        id: ProcletId,
        kind: Kind,
        state: &'static Descriptor,
        epoch: Epoch,
        s: Box<ErasedState>,
    ) {
        let slot = Slot::new(id, kind, state, epoch, s);
        self.forwarding.remove(&id);
        self.locations.remove(&id);
        if self.table.insert(id, slot).is_none() {
            self.hosted[kind.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    fn remove_hosted(&self, slot: &Slot) {
        if self.table.remove(&slot.id).is_some() {
            self.hosted[slot.kind.index()].fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn not_here(&self, id: ProcletId) -> RemoteError {
        RemoteError::NotHere {
            hint: self.forwarding.get(&id).map(|l| l.clone()),
        }
    }

    fn lock_error(&self, id: ProcletId, e: LockError) -> RemoteError {
        match e {
            LockError::Reentrant => RemoteError::Reentrant(id),
            LockError::Moved(l) => RemoteError::NotHere { hint: Some(l) },
            LockError::Destroyed => RemoteError::Gone,
        }
    }

    /// Take a slot's lock, waiting without blocking the thread.
    async fn lock_slot(
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

    async fn destroy_local(&self, slot: &Arc<Slot>, chain: ChainId) -> Result<(), RemoteError> {
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

    async fn serve_call(self: Arc<Self>, frame: Frame, reply: Responder) {
        let Msg::Call {
            proclet,
            code,
            mode,
            chain,
        } = frame.msg
        else {
            return;
        };
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
    }

    async fn serve_create(self: Arc<Self>, frame: Frame) -> Result<Msg, RemoteError> {
        let Msg::Create {
            proclet,
            kind,
            ctor,
            state,
            epoch,
            chain,
            register,
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
        self.install(proclet, kind, state, epoch, s);
        if register {
            let loc = Location {
                node: self.id,
                addr: self.addr.clone(),
                epoch,
            };
            if let Err(e) = self.controller.set_location(proclet, loc, kind).await {
                if let Some(slot) = self.local_slot(proclet) {
                    self.remove_hosted(&slot);
                }
                return Err(RemoteError::Internal(format!(
                    "cannot record the new proclet at the controller: {e}"
                )));
            }
        }
        Ok(Msg::Done)
    }

    async fn serve_install(self: Arc<Self>, frame: Frame) -> Result<Msg, RemoteError> {
        let Msg::Install {
            proclet,
            kind,
            state,
            epoch,
        } = frame.msg
        else {
            return Err(RemoteError::Protocol("not an install".into()));
        };
        let desc = shipping::resolve(state, Expect::State)?;
        let Entry::State { decode, .. } = desc.entry else {
            return Err(RemoteError::CodeMismatch("not a state descriptor".into()));
        };
        let s = decode(&frame.tail)?;
        self.install(proclet, kind, desc, epoch, s);
        Ok(Msg::Done)
    }

    /// Move a hosted proclet to `to` (stop-the-world: calls wait on the lock meanwhile,
    /// then fail over to the new home with a "not here" hint).
    pub(crate) async fn move_out(
        self: Arc<Self>,
        proclet: ProcletId,
        to: Location,
    ) -> Result<Msg, RemoteError> {
        let Some(slot) = self.local_slot(proclet) else {
            return Err(self.not_here(proclet));
        };
        if to.node == self.id {
            return Ok(Msg::Done);
        }
        let guard = self
            .lock_slot(&slot, context::new_chain(), CallMode::Exclusive)
            .await?;
        let conn = self
            .conn_to(to.node, &to.addr)
            .await
            .map_err(|e| RemoteError::Refused(format!("cannot reach the destination: {e}")))?;
        let Entry::State { encode, .. } = slot.state_desc.entry else {
            return Err(RemoteError::Internal(
                "slot without a state descriptor".into(),
            ));
        };
        let msg = Msg::Install {
            proclet,
            kind: slot.kind,
            state: shipping::code_ref(slot.state_desc),
            epoch: to.epoch,
        };
        let mut encode_error = None;
        let r = conn
            .request_with(|rid| {
                let mut buf = begin_frame(FrameKind::Request, rid, &msg, 4096)?;
                if let Err(e) = guard.with_ref(|s| encode(s, &mut buf)) {
                    encode_error = Some(e.clone());
                    return Err(granule_wire::WireError::Encode(e.to_string()));
                }
                finish_frame(&mut buf)?;
                Ok(buf)
            })
            .await;
        if let Some(e) = encode_error {
            return Err(e);
        }
        match r {
            Ok(Frame { msg: Msg::Done, .. }) => {}
            Ok(Frame {
                msg: Msg::Error(e), ..
            }) => return Err(e),
            Ok(f) => {
                return Err(RemoteError::Internal(format!(
                    "unexpected answer {}",
                    f.msg.name()
                )))
            }
            Err(e) => return Err(RemoteError::Internal(format!("transfer failed: {e}"))),
        }
        if let Err(e) = self
            .controller
            .set_location(proclet, to.clone(), slot.kind)
            .await
        {
            tracing::warn!(%proclet, "moved, but the controller was not told: {e}");
        }
        self.forwarding.insert(proclet, to.clone());
        guard.set_status(SlotStatus::Moved(to));
        let old = guard.take_state();
        self.remove_hosted(&slot);
        drop(guard);
        drop(old);
        Ok(Msg::Done)
    }

    async fn serve(self: Arc<Self>, frame: Frame, reply: Responder) {
        let out = match &frame.msg {
            Msg::Call { .. } => return self.serve_call(frame, reply).await,
            Msg::Create { .. } => self.serve_create(frame).await,
            Msg::Install { .. } => self.serve_install(frame).await,
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
                self.move_out(p, t).await
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

    /// Run a future to completion from any thread (the worker runtime drives I/O).
    pub(crate) fn block<F: std::future::Future>(
        &self,
        fut: F,
        deadline: Option<Instant>,
    ) -> Option<F::Output> {
        let _enter = self.handle.enter();
        context::block_on(fut, deadline)
    }

    /// Spawn onto the control runtime.
    #[allow(dead_code)]
    pub(crate) fn spawn_control<F>(&self, fut: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.control.spawn(fut);
    }
}

/// Serves requests and notices on every connection of a node.
pub(crate) struct NodeHandler {
    cell: Arc<NodeCell>,
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
            Msg::Call { .. } | Msg::Create { .. } | Msg::Install { .. } | Msg::Destroy { .. } => {
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
        tokio::spawn(node.serve(frame, reply));
    }

    fn on_notify(&self, conn: &Arc<Connection>, frame: Frame) {
        let Some(node) = self.node() else { return };
        let from_controller = conn.peer().is_some_and(|p| p.role == Role::Controller);
        match frame.msg {
            Msg::NodeDown { node: n } if from_controller => node.on_node_down(n),
            Msg::Shutdown { reason } if from_controller => node.trigger_shutdown(reason),
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
            node.forget_conn(conn);
        }
    }
}
