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
//! - *control* (one thread): the controller connection, heartbeats, move orders, the
//!   resource monitor and the pressure policy. It is separate so a node whose cores are
//!   saturated by long closures still heartbeats, notices pressure and asks closures to
//!   yield;
//! - *blocking* threads (tokio's pool, on demand): encoding and decoding large states of
//!   moving proclets, freeing moved-out states.
//!
//! `calls` holds the calling side (finding proclets, sending calls, creating, destroying),
//! `serve` the hosting side (the proclet table, serving requests), `migrate` the migration
//! engine (both ends of a move), `monitor` resource accounting, pressure detection and the
//! policy that sheds proclets.

use crate::busy::BusyBoard;
use crate::context::{self, NodeCell};
use crate::error::{CallError, ClusterError};
use crate::shipping::{self};
use crate::slot::Slot;
use crate::usage::CpuMeter;
use bytes::Bytes;
use dashmap::DashMap;
use granule_controller::{ControllerClient, ControllerError};
use granule_transport::{
    serve, Connection, Handler, Identity, Listener, TransportConfig, TransportError,
};
use granule_wire::{
    Kind, Location, NodeId, NodeInfo, NodeSpec, NodeState, ProcletId, RemoteError, Role, Usage,
};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::runtime::{Handle, Runtime};
use tokio::sync::OnceCell;

/// How many times a call follows "not here" answers before it may give up...
const MAX_HOPS: u32 = 32;
/// ...and for how long at least: a controller slow to learn of a move or a destroy on a
/// loaded machine must not fail calls that a moment's patience would have served.
const HOP_PATIENCE: Duration = Duration::from_secs(2);

/// Whether a chase of a proclet's location that began at `started` should give up.
fn chase_exhausted(hops: u32, started: Instant) -> bool {
    hops > MAX_HOPS && started.elapsed() > HOP_PATIENCE
}
/// Proclet ids fetched from the controller at once.
const ID_BLOCK: u32 = 1024;
/// How long a node stopping on its own waits for the controller to take its goodbye.
const LEAVE_WAIT: Duration = Duration::from_millis(500);

/// What a node is started with.
#[derive(Clone, Debug)]
pub(crate) struct NodeOptions {
    pub role: Role,
    pub spec: NodeSpec,
    pub controller: String,
    pub listen_host: String,
    /// Shed proclets under pressure (unless `GRANULE_SHED=off`).
    pub shed: bool,
}

/// A proclet being created: its id and where it goes.
pub(crate) struct NewProclet {
    pub id: ProcletId,
    pub kind: Kind,
    pub loc: Location,
    /// The controller chose the node (and already recorded the location).
    pub placed: bool,
    /// Never move it.
    pub pinned: bool,
    /// The structure or service it belongs to.
    pub group: Option<String>,
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
    identity: Arc<Identity>,
    tconfig: Arc<TransportConfig>,
    pub controller: ControllerClient,
    pub(crate) table: DashMap<ProcletId, Arc<Slot>>,
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
    pub(crate) hosted: [AtomicU32; 3],
    stopped: AtomicBool,
    /// The node was asked to stop from its own side (a signal to `granule node`), not by
    /// the cluster: it says goodbye to the controller as it stops.
    pub(crate) leaving: AtomicBool,
    shutdown: (Mutex<Option<String>>, Condvar),
    handler: Arc<NodeHandler>,
    /// Which workers are inside closures (for the I/O watchdog).
    pub(crate) busy: Arc<BusyBoard>,
    /// States arriving from other nodes, by (connection, proclet).
    incoming: DashMap<(u64, ProcletId), migrate::Incoming>,
    migration: migrate::MigrationConfig,
    pub(crate) monitor: monitor::Monitor,
    pub(crate) moves_out: AtomicU64,
    /// Cores busy at the last heartbeat (`f64` bits), for `/metrics`.
    pub(crate) cores_busy: AtomicU64,
    /// The histogram of remote calls' service time (made on first use: registering
    /// it per call would allocate its labels every time).
    pub(crate) call_latency: OnceLock<metrics::Histogram>,
    /// Bytes of state received by migration since the node started.
    pub(crate) received_bytes: AtomicU64,
    /// Bytes of state moved away and freed since the node started.
    pub(crate) departed_bytes: AtomicU64,
}

/// Owns a node's runtimes; stopping it stops the node.
pub(crate) struct Node {
    pub inner: Arc<NodeInner>,
    workers: Option<Runtime>,
    control: Option<Runtime>,
}

/// The address other nodes should dial: the listening address, except that a wildcard
/// (`0.0.0.0`, `::`) is replaced by this machine's address on the route to the
/// controller (what other machines can reach).
fn advertised_addr(bound: std::net::SocketAddr, controller: &str) -> String {
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let local = std::net::UdpSocket::bind(if bound.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })
    .and_then(|u| {
        u.connect(controller)?;
        u.local_addr()
    });
    match local {
        Ok(l) => std::net::SocketAddr::new(l.ip(), bound.port()).to_string(),
        Err(_) => bound.to_string(),
    }
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
                // Workers (and the runtime's blocking threads, which start here too)
                // wake to serve calls: see `config::worker_slice`.
                crate::context::apply_worker_slice();
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
            .on_thread_start(move || {
                // Heartbeats and the pressure monitor must not wait out a neighbour's slice.
                crate::context::apply_worker_slice();
                context::set_thread_node(&ccell)
            })
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
        let addr = advertised_addr(listener.local_addr(), &opts.controller);
        let metrics_listener = crate::telemetry::bind(&opts.listen_host)
            .map_err(|e| io_err("cannot serve /metrics", e))?;
        let metrics_addr = metrics_listener
            .local_addr()
            .ok()
            .map(|a| advertised_addr(a, &opts.controller));

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
                    .register(
                        role,
                        spec,
                        reg_addr,
                        binary,
                        reg_program,
                        granule_host::current_paths(),
                        metrics_addr,
                    )
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
            leaving: AtomicBool::new(false),
            shutdown: (Mutex::new(None), Condvar::new()),
            handler: handler.clone(),
            busy,
            incoming: DashMap::new(),
            migration: migrate::MigrationConfig::from_env(),
            monitor: monitor::Monitor::new(opts.spec.mem_bytes, opts.spec.cores, {
                let mut pc = monitor::PressureConfig::from_env();
                pc.shed &= opts.shed;
                pc
            }),
            moves_out: AtomicU64::new(0),
            cores_busy: AtomicU64::new(0),
            call_latency: OnceLock::new(),
            received_bytes: AtomicU64::new(0),
            departed_bytes: AtomicU64::new(0),
        });
        let _ = cell.set(Arc::downgrade(&inner));

        let h: Arc<dyn Handler> = handler;
        let tconfig = inner.tconfig.clone();
        workers.spawn(serve(listener, identity, tconfig, h));
        // The monitor first: its first sample (immediate) then precedes the first
        // heartbeat, which so reports real readings (cgroup limit, pressure).
        control.spawn(inner.clone().monitor_loop());
        control.spawn(heartbeat_loop(inner.clone(), reg.heartbeat));
        control.spawn(crate::telemetry::serve(
            metrics_listener,
            Arc::downgrade(&inner),
        ));
        // With one worker there is no idle worker to wake: no watchdog needed.
        let weak = Arc::downgrade(&inner);
        if workers_n > 1 {
            control.spawn(crate::busy::watchdog(
                inner.busy.clone(),
                workers.handle().clone(),
                move || weak.upgrade().is_none_or(|n| n.is_stopped()),
            ));
        }
        tracing::info!(node = %inner.id, role = ?inner.role, addr = %inner.addr, "node started");
        Ok(Node {
            inner,
            workers: Some(workers),
            control: Some(control),
        })
    }

    /// Stop serving: mark the node stopped and shut its runtimes down. A node stopping
    /// on its own (its program ends, rather than the cluster telling it to go) first tells
    /// the controller it leaves, so that is recorded as a departure, not a failure.
    pub(crate) fn stop(&mut self) {
        let own_decision =
            self.inner.shutdown.0.lock().is_none() || self.inner.leaving.load(Ordering::Acquire);
        if own_decision {
            self.leave();
        }
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

impl Node {
    /// Say goodbye to the controller, waiting at most [`LEAVE_WAIT`] for its answer (it
    /// may be gone already). Runs on the control runtime and waits on a channel, so it
    /// works from any thread, including one inside another tokio runtime.
    fn leave(&self) {
        let Some(rt) = &self.control else { return };
        let inner = self.inner.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            let _ = tx.send(inner.controller.leave("its program ended").await);
        });
        match rx.recv_timeout(LEAVE_WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!("the controller did not take the goodbye: {e}"),
            Err(_) => tracing::debug!("no answer from the controller to the goodbye"),
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
        let r = node.monitor.reading();
        let cores_busy = meter.sample();
        node.cores_busy
            .store(cores_busy.to_bits(), Ordering::Relaxed);
        let usage = Usage {
            cores_busy,
            // The monitor read these at most one memory interval ago.
            mem_used: r.rss,
            proclets: [
                node.hosted[0].load(Ordering::Relaxed),
                node.hosted[1].load(Ordering::Relaxed),
                node.hosted[2].load(Ordering::Relaxed),
            ],
            calls_served: node.calls_served.load(Ordering::Relaxed),
            mem_budget: node.monitor.budget(),
            proclet_bytes: r.proclet_bytes,
            cgroup_mem_limit: r.cgroup_limit,
            cgroup_mem_usage: r.cgroup_usage,
            cpu_throttled: r.cpu_throttled,
            runq_delay: r.runq_delay,
            mem_pressure: r.mem_pressure,
            cpu_pressure: r.cpu_pressure,
            moves_out: node.moves_out.load(Ordering::Relaxed),
            top: node.top_proclets(16),
            groups: crate::telemetry::groups(&node),
        };
        match node
            .controller
            .heartbeat(node.id, usage, crate::telemetry::drain())
            .await
        {
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
                if reason.contains("shutting down")
                    || reason.contains("lost the controller")
                    || self.leaving.load(Ordering::Acquire)
                {
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

    pub(super) fn update_members(&self, list: Vec<NodeInfo>) {
        let mut dead = Vec::new();
        {
            let mut m = self.members.lock();
            m.clear();
            for n in list {
                if n.state != NodeState::Alive {
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

    pub(super) fn is_dead(&self, node: NodeId) -> bool {
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

    pub(super) fn unreachable(node: NodeId, e: impl std::fmt::Display) -> CallError {
        CallError::NodeUnreachable {
            node,
            reason: e.to_string(),
        }
    }

    pub(super) fn transport_error(&self, node: NodeId, e: TransportError) -> CallError {
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

    pub(super) fn forget_conn(&self, conn: &Arc<Connection>) {
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
    pub(super) async fn resolve(
        &self,
        id: ProcletId,
        hint: Option<&Location>,
    ) -> Result<Location, CallError> {
        if let Some(l) = self.cached_location(id) {
            return Ok(l);
        }
        if let Some(h) = hint {
            return Ok(h.clone());
        }
        self.locate_at_controller(id).await
    }

    pub(super) async fn locate_at_controller(&self, id: ProcletId) -> Result<Location, CallError> {
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
    pub(super) async fn relocate(
        &self,
        id: ProcletId,
        stale: &Location,
        hint: Option<Location>,
        hops: u32,
    ) -> Result<Location, CallError> {
        self.locations.remove(&id);
        if let Some(h) = hint {
            // Only a newer epoch is news. A forwarding entry no newer than what the caller
            // already knew is left from an earlier stay: two such entries pointing at each
            // other would bounce the call between their nodes until it gave up.
            if h.epoch > stale.epoch {
                self.learn_location(id, &h);
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

    /// Run a future to completion from any thread (the worker runtime drives I/O).
    pub(crate) fn block<F: std::future::Future>(
        &self,
        fut: F,
        deadline: Option<Instant>,
    ) -> Option<F::Output> {
        let _enter = self.handle.enter();
        context::block_on(fut, deadline)
    }
}

mod calls;
mod migrate;
pub(crate) mod monitor;
mod serve;

pub(crate) use serve::NodeHandler;

#[cfg(test)]
mod tests {
    use super::advertised_addr;

    #[test]
    fn wildcard_listen_addresses_are_advertised_as_a_reachable_address() {
        let a = advertised_addr("0.0.0.0:4000".parse().unwrap(), "127.0.0.1:7070");
        assert_eq!(a, "127.0.0.1:4000");
        let b = advertised_addr("127.0.0.1:4001".parse().unwrap(), "10.0.0.1:7070");
        assert_eq!(b, "127.0.0.1:4001");
    }
}
