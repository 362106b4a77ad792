//! The controller as a network service: answers registration, heartbeats, id blocks,
//! placement and location queries; detects dead nodes and tells everyone.

use crate::state::{ControllerConfig, PlaceError, RegisterError, State};
use crate::ControllerError;
use granule_transport::{
    serve, Connection, Handler, Identity, Listener, Responder, TransportConfig,
};
use granule_wire::{Frame, Msg, NodeId, RemoteError, ReplicaSet, Role};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Shared by the request handler, the failure sweeper and the handle.
pub(crate) struct Inner {
    pub(crate) state: Mutex<State>,
    /// Registered hosts' connections, by node.
    hosts: Mutex<HashMap<NodeId, Arc<Connection>>>,
    /// Which node a connection registered as (keyed by the connection's unique id).
    by_conn: Mutex<HashMap<u64, NodeId>>,
    stop: Notify,
    /// Set when the cluster is being torn down: node departures are expected then.
    quiet: std::sync::atomic::AtomicBool,
    /// A service sharing the controller's port and dashboard (the market's broker).
    pub(crate) ext: Option<Arc<dyn Extension>>,
}

/// A service that shares the controller's port, connections and dashboard without the
/// controller knowing what it is: `granule controller --broker` runs the memory market's
/// broker this way. The controller hands it the requests it [accepts](Extension::accepts)
/// and tells it about every closed connection; its view joins `/api/cluster` under
/// `extensions.<name>`, and the metrics it records through the `metrics` crate appear on
/// the controller's `/metrics`.
pub trait Extension: Send + Sync + 'static {
    /// Its key in `/api/cluster`'s `extensions`.
    fn name(&self) -> &'static str;
    /// Whether it answers this request.
    fn accepts(&self, msg: &Msg) -> bool;
    /// A request it accepts (same contract as [`Handler::on_request`]).
    fn on_request(&self, conn: &Arc<Connection>, frame: Frame, reply: Responder);
    /// A connection closed (every connection, also the ones it never saw).
    fn on_close(&self, conn: &Arc<Connection>);
    /// What the dashboard shows of it, as JSON.
    fn view(&self) -> serde_json::Value;
    /// Called before `/metrics` is rendered, to bring its gauges up to date.
    fn refresh_metrics(&self) {}
}

/// How long the controller remembers a dead node that had proclets (so calls to its
/// proclets report it unreachable rather than the proclets unknown), listed or not
/// (`ControllerConfig::forget_dead_after` bounds the listing).
const DEAD_NODE_RETENTION: std::time::Duration = std::time::Duration::from_secs(600);

fn conn_key(c: &Arc<Connection>) -> u64 {
    c.id()
}

impl Inner {
    fn registered_node(&self, c: &Arc<Connection>) -> Option<NodeId> {
        self.by_conn.lock().get(&conn_key(c)).copied()
    }

    /// Tell a replicated proclet's primary and backups its new configuration.
    fn tell_replicas(&self, set: &ReplicaSet) {
        let hosts: Vec<Arc<Connection>> = {
            let h = self.hosts.lock();
            std::iter::once(&set.primary)
                .chain(&set.backups)
                .filter_map(|l| h.get(&l.node).cloned())
                .collect()
        };
        for c in hosts {
            let _ = c.notify(&Msg::Replicas(set.clone()), &[]);
        }
    }

    /// Declare nodes dead and tell every live host.
    fn declare_dead(&self, dead: &[NodeId], why: &str) {
        let mut newly = Vec::new();
        // Replicated proclets fail over in the same step as the death is recorded: no
        // caller can see the node dead and the old configuration.
        let mut reconfigured = Vec::new();
        {
            let mut st = self.state.lock();
            let now = Instant::now();
            for n in dead {
                if st.mark_dead(*n, now) {
                    newly.push(*n);
                    reconfigured.extend(st.fail_over(*n));
                }
            }
        }
        if newly.is_empty() {
            return;
        }
        // Each primary (a promoted backup among them) learns its configuration, and
        // its backups learn the new epoch too, so they refuse the replaced primary.
        for set in reconfigured {
            tracing::info!(proclet = %set.proclet, primary = %set.primary.node, epoch = set.epoch,
                backups = set.backups.len(), "replicated proclet reconfigured after a node died");
            self.tell_replicas(&set);
        }
        let hosts: Vec<(NodeId, Arc<Connection>)> = self
            .hosts
            .lock()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        let quiet = self.quiet.load(std::sync::atomic::Ordering::Relaxed);
        for n in &newly {
            if quiet {
                tracing::debug!(node = %n, "node left during shutdown: {why}");
            } else {
                tracing::warn!(node = %n, "node declared dead: {why}");
            }
            for (id, c) in &hosts {
                if id == n {
                    let _ = c.notify(
                        &Msg::Shutdown {
                            reason: format!("the controller declared this node dead: {why}"),
                            declared_dead: true,
                        },
                        &[],
                    );
                } else {
                    let _ = c.notify(&Msg::NodeDown { node: *n }, &[]);
                }
            }
        }
        let mut h = self.hosts.lock();
        for n in &newly {
            h.remove(n);
        }
    }

    /// A node leaves on purpose: record the departure (not a failure) and tell the other
    /// hosts, whose calls to its proclets then fail at once as for a dead node.
    fn depart(&self, node: NodeId, why: &str) {
        if !self.state.lock().mark_left(node, Instant::now()) {
            return;
        }
        tracing::info!(node = %node, "node left the cluster: {why}");
        let others: Vec<Arc<Connection>> = {
            let mut h = self.hosts.lock();
            h.remove(&node);
            h.values().cloned().collect()
        };
        for c in others {
            let _ = c.notify(&Msg::NodeDown { node }, &[]);
        }
    }

    fn answer(&self, conn: &Arc<Connection>, msg: Msg) -> Result<Msg, RemoteError> {
        let now = Instant::now();
        let host = self.registered_node(conn);
        let need_host = || {
            host.ok_or_else(|| {
                RemoteError::Unauthorized("register as a node before sending this".into())
            })
        };
        match msg {
            Msg::Register {
                role,
                spec,
                addr,
                pid,
                binary,
                program,
                cgroups,
                metrics_addr,
            } => {
                if host.is_some() {
                    return Err(RemoteError::Protocol("already registered".into()));
                }
                let r = self
                    .state
                    .lock()
                    .register(role, spec, addr, pid, binary, &program, now);
                if let (Ok(node), Some(c)) = (&r, cgroups) {
                    self.state.lock().set_cgroups(*node, c);
                }
                if let Ok(node) = &r {
                    self.state.lock().set_metrics_addr(*node, metrics_addr);
                }
                match r {
                    Ok(node) => {
                        self.hosts.lock().insert(node, conn.clone());
                        self.by_conn.lock().insert(conn_key(conn), node);
                        // The connection may have closed while this registration was in
                        // its read buffer, after its close was handled: undo.
                        if conn.is_closed() {
                            self.by_conn.lock().remove(&conn_key(conn));
                            self.declare_dead(&[node], "its connection closed during registration");
                            return Err(RemoteError::Refused("connection closed".into()));
                        }
                        let cfg = self.state.lock().config.clone();
                        tracing::info!(%node, ?role, cores = spec.cores, mem = spec.mem_bytes, "node registered");
                        Ok(Msg::Registered {
                            node,
                            heartbeat_ms: cfg.heartbeat.as_millis() as u64,
                            failure_timeout_ms: cfg.failure_timeout.as_millis() as u64,
                        })
                    }
                    Err(RegisterError::BinaryMismatch(m)) | Err(RegisterError::Invalid(m)) => {
                        tracing::warn!("registration refused: {m}");
                        Err(RemoteError::Refused(m))
                    }
                }
            }
            Msg::Heartbeat {
                node,
                usage,
                events,
            } => {
                if need_host()? != node {
                    return Err(RemoteError::Unauthorized(
                        "heartbeat for another node".into(),
                    ));
                }
                let mut st = self.state.lock();
                if st.heartbeat(node, usage, events, now) {
                    Ok(Msg::HeartbeatAck {
                        members_version: st.members_version(),
                    })
                } else {
                    Err(RemoteError::NodeDown(node))
                }
            }
            Msg::Leave { reason } => {
                let node = need_host()?;
                // Its connection closing next is no failure.
                self.by_conn.lock().remove(&conn_key(conn));
                self.depart(node, &reason);
                Ok(Msg::Done)
            }
            Msg::AllocIds { count } => {
                need_host()?;
                let (start, end) = self.state.lock().alloc_ids(count);
                Ok(Msg::IdBlock { start, end })
            }
            Msg::Place {
                proclet,
                kind,
                mem_hint,
            } => {
                need_host()?;
                match self.state.lock().place(proclet, kind, mem_hint) {
                    Ok(location) => Ok(Msg::Located {
                        location,
                        alive: true,
                    }),
                    Err(PlaceError::NoNode) => Err(RemoteError::Refused(
                        "no alive node to place the proclet on".into(),
                    )),
                    Err(PlaceError::NoRoom(m)) => Err(RemoteError::NoCapacity(m)),
                }
            }
            Msg::PlaceBackups { proclet, count } => {
                need_host()?;
                match self.state.lock().place_backups(proclet, count) {
                    Ok(set) => Ok(Msg::Replicas(set)),
                    Err(PlaceError::NoNode) => Err(RemoteError::Gone),
                    Err(PlaceError::NoRoom(m)) => Err(RemoteError::NoCapacity(m)),
                }
            }
            Msg::Replicas(set) => {
                let node = need_host()?;
                if set.primary.node != node {
                    return Err(RemoteError::Unauthorized(
                        "only a proclet's primary records its backups".into(),
                    ));
                }
                if self.state.lock().record_backups(&set) {
                    Ok(Msg::Done)
                } else {
                    Err(RemoteError::Refused(format!(
                        "the configuration of proclet {} at epoch {} is not the current one",
                        set.proclet, set.epoch
                    )))
                }
            }
            Msg::HandOver(set) => {
                let node = need_host()?;
                if self.state.lock().hand_over(node, &set) {
                    self.tell_replicas(&set);
                    Ok(Msg::Done)
                } else {
                    Err(RemoteError::Refused(format!(
                        "proclet {} cannot be handed over to {} at epoch {}: the sender is not \
                         its primary, the epoch is not the next one, or a copy's node is not live",
                        set.proclet, set.primary.node, set.epoch
                    )))
                }
            }
            Msg::SetLocation {
                proclet,
                location,
                kind,
            } => {
                need_host()?;
                self.state
                    .lock()
                    .set_location(proclet, location.node, location.epoch, kind);
                Ok(Msg::Done)
            }
            Msg::Locate { proclet } => match self.state.lock().locate(proclet) {
                Some((location, alive)) => Ok(Msg::Located { location, alive }),
                None => Err(RemoteError::Gone),
            },
            Msg::Forget { proclet } => {
                need_host()?;
                self.state.lock().forget(proclet);
                Ok(Msg::Done)
            }
            Msg::ListNodes => Ok(Msg::Nodes(self.state.lock().list(now))),
            Msg::PublishPanel(panel) => {
                let from = host.map_or_else(|| conn.peer_addr().to_string(), |n| n.to_string());
                self.state
                    .lock()
                    .panels
                    .publish(conn_key(conn), from, panel, now, crate::http::now_ms())
                    .map_err(|e| RemoteError::Refused(e.to_string()))?;
                Ok(Msg::Done)
            }
            Msg::Events { after, limit } => Ok(Msg::EventList(
                self.state
                    .lock()
                    .events_after(after, (limit as usize).min(crate::state::EVENT_LOG)),
            )),
            Msg::Propose {
                from,
                resource,
                amount,
            } => {
                need_host()?;
                Ok(Msg::Proposed(
                    self.state.lock().propose(from, resource, amount),
                ))
            }
            other => Err(RemoteError::Protocol(format!(
                "the controller does not handle {}",
                other.name()
            ))),
        }
    }

    /// Where a proclet is, for a caller that could not reach it on `unreachable`
    /// (`Replicas` for a replicated proclet whose primary lives, else `Located`). A
    /// replicated proclet's answer waits until this controller has decided about that
    /// node — dead (then a backup is the primary now) or alive (then the caller's
    /// trouble was its own) — at most the failure timeout and a little more; any other
    /// proclet's comes at once, as for `Locate`.
    async fn failover(
        &self,
        proclet: granule_wire::ProcletId,
        unreachable: NodeId,
    ) -> Result<Msg, RemoteError> {
        let wait = self.state.lock().config.failure_timeout + Duration::from_millis(500);
        let deadline = Instant::now() + wait;
        loop {
            {
                let st = self.state.lock();
                let (location, alive) = st.locate(proclet).ok_or(RemoteError::Gone)?;
                let replicated = st.is_replicated(proclet);
                let undecided = replicated && location.node == unreachable && alive;
                if !undecided || Instant::now() >= deadline {
                    return Ok(match st.replica_set(proclet) {
                        Some(set) if alive => Msg::Replicas(set),
                        _ => Msg::Located { location, alive },
                    });
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Ask a proclet's host to move it to `to` and wait for the move to finish. If the
    /// proclet moved elsewhere in the meantime (its node shedding it), follow it.
    async fn move_proclet(
        self: Arc<Self>,
        proclet: granule_wire::ProcletId,
        to: NodeId,
    ) -> Result<Msg, RemoteError> {
        let mut hint: Option<granule_wire::Location> = None;
        for attempt in 0..MOVE_ATTEMPTS {
            match self.clone().move_once(proclet, to, hint.take()).await {
                Err(RemoteError::NotHere { hint: h }) if attempt + 1 < MOVE_ATTEMPTS => {
                    hint = h;
                    // The host's update of the location may still be on its way here.
                    tokio::time::sleep(Duration::from_millis(2 * (attempt as u64 + 1))).await;
                }
                other => return other,
            }
        }
        Err(RemoteError::Internal(format!(
            "proclet {proclet} kept moving; gave up after {MOVE_ATTEMPTS} attempts"
        )))
    }

    async fn move_once(
        self: Arc<Self>,
        proclet: granule_wire::ProcletId,
        to: NodeId,
        hint: Option<granule_wire::Location>,
    ) -> Result<Msg, RemoteError> {
        let (loc, alive, dest) = {
            let st = self.state.lock();
            let (mut loc, mut alive) = st.locate(proclet).ok_or(RemoteError::Gone)?;
            if let Some(h) = hint.filter(|h| h.epoch > loc.epoch) {
                alive = st
                    .node(h.node)
                    .is_some_and(|n| n.state == granule_wire::NodeState::Alive);
                loc = h;
            }
            let dest = st
                .node(to)
                .filter(|n| n.state == granule_wire::NodeState::Alive)
                .map(|n| n.addr.clone())
                .ok_or_else(|| RemoteError::Refused(format!("node {to} is not alive")))?;
            (loc, alive, dest)
        };
        if !alive {
            return Err(RemoteError::NodeDown(loc.node));
        }
        if loc.node == to {
            return Ok(Msg::Done);
        }
        let host = self
            .hosts
            .lock()
            .get(&loc.node)
            .cloned()
            .ok_or(RemoteError::NodeDown(loc.node))?;
        let req = Msg::MoveOut {
            proclet,
            to: granule_wire::Location {
                node: to,
                addr: dest,
                epoch: loc.epoch + 1,
            },
        };
        match host.request(&req, &[]).await {
            Ok(f) => match f.msg {
                Msg::Error(e) => Err(e),
                Msg::Moved(s) => Ok(Msg::Moved(s)),
                _ => Ok(Msg::Done),
            },
            Err(e) => Err(RemoteError::Internal(format!(
                "host {} did not answer the move: {e}",
                loc.node
            ))),
        }
    }
}

/// How often a move follows a proclet that keeps moving before giving up.
const MOVE_ATTEMPTS: u32 = 8;

struct ControllerHandler(Arc<Inner>);

impl Handler for ControllerHandler {
    fn on_request(&self, conn: &Arc<Connection>, frame: Frame, reply: Responder) {
        if let Some(ext) = self.0.ext.as_ref().filter(|e| e.accepts(&frame.msg)) {
            ext.on_request(conn, frame, reply);
            return;
        }
        if let Msg::Failover {
            proclet,
            unreachable,
        } = frame.msg
        {
            let inner = self.0.clone();
            tokio::spawn(async move {
                match inner.failover(proclet, unreachable).await {
                    Ok(m) => {
                        let _ = reply.send(&m, &[]);
                    }
                    Err(e) => reply.error(e),
                }
            });
            return;
        }
        if let Msg::MoveProclet { proclet, to } = frame.msg {
            let inner = self.0.clone();
            tokio::spawn(async move {
                match inner.move_proclet(proclet, to).await {
                    Ok(m) => {
                        let _ = reply.send(&m, &[]);
                    }
                    Err(e) => reply.error(e),
                }
            });
            return;
        }
        match self.0.answer(conn, frame.msg) {
            Ok(m) => {
                let _ = reply.send(&m, &[]);
            }
            Err(e) => reply.error(e),
        }
    }

    fn on_close(&self, conn: &Arc<Connection>) {
        if let Some(ext) = &self.0.ext {
            ext.on_close(conn);
        }
        // A publisher that went away takes its panels with it.
        self.0.state.lock().panels.drop_source(conn_key(conn));
        let node = self.0.by_conn.lock().remove(&conn_key(conn));
        if let Some(node) = node {
            let reason = conn.close_reason().unwrap_or_default();
            self.0
                .declare_dead(&[node], &format!("its connection closed ({reason})"));
        }
    }
}

/// A running controller. Dropping the handle does not stop it; call [`ControllerHandle::shutdown`].
pub struct ControllerHandle {
    addr: SocketAddr,
    dashboard: Option<SocketAddr>,
    inner: Arc<Inner>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ControllerHandle {
    /// Start a controller on its own thread (embedded in a driver) listening on `listen`.
    pub fn start(
        listen: &str,
        config: ControllerConfig,
    ) -> Result<ControllerHandle, ControllerError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                ControllerError::Io(format!("cannot start the controller runtime: {e}"))
            })?;
        let listener = rt
            .block_on(Listener::bind(listen))
            .map_err(|e| ControllerError::Io(e.to_string()))?;
        let addr = listener.local_addr();
        let http = config
            .dashboard
            .as_deref()
            .map(crate::http::bind)
            .transpose()?;
        let dashboard = http.as_ref().and_then(|l| l.local_addr().ok());
        let inner = new_inner(config, None);
        let run = inner.clone();
        let thread = std::thread::Builder::new()
            .name("granule-controller".into())
            .spawn(move || rt.block_on(run_controller(listener, http, run)))
            .map_err(|e| ControllerError::Io(format!("cannot start the controller thread: {e}")))?;
        Ok(ControllerHandle {
            addr,
            dashboard,
            inner,
            thread: Some(thread),
        })
    }

    /// The address nodes and tools connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the dashboard, `/api/cluster` and the controller's `/metrics` are served
    /// (`None` when [`ControllerConfig::dashboard`] is off).
    pub fn dashboard_addr(&self) -> Option<SocketAddr> {
        self.dashboard
    }

    /// The dashboard's URL, e.g. `http://127.0.0.1:41234/`.
    pub fn dashboard_url(&self) -> Option<String> {
        self.dashboard.map(|a| format!("http://{a}/"))
    }

    /// The cluster is being torn down: nodes leaving from now on are expected, not
    /// failures (logged at debug level only).
    pub fn quiesce(&self) {
        self.inner
            .quiet
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Tell every host to leave, then stop serving.
    pub fn shutdown(&mut self) {
        self.quiesce();
        let hosts: Vec<Arc<Connection>> = self.inner.hosts.lock().values().cloned().collect();
        for c in hosts {
            let _ = c.notify(
                &Msg::Shutdown {
                    reason: "the cluster is shutting down".into(),
                    declared_dead: false,
                },
                &[],
            );
        }
        self.inner.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Number of proclets in the location map (for tests and status).
    pub fn proclet_count(&self) -> usize {
        self.inner.state.lock().locations_len()
    }
}

impl Drop for ControllerHandle {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

fn new_inner(config: ControllerConfig, ext: Option<Arc<dyn Extension>>) -> Arc<Inner> {
    Arc::new(Inner {
        ext,
        state: Mutex::new(State::new(config)),
        hosts: Mutex::new(HashMap::new()),
        by_conn: Mutex::new(HashMap::new()),
        stop: Notify::new(),
        quiet: std::sync::atomic::AtomicBool::new(false),
    })
}

async fn run_controller(
    listener: Listener,
    http: Option<std::net::TcpListener>,
    inner: Arc<Inner>,
) {
    let identity = Arc::new(Identity::tool(Role::Controller, "granule-controller"));
    let tconfig = Arc::new(TransportConfig::default());
    let handler: Arc<dyn Handler> = Arc::new(ControllerHandler(inner.clone()));
    let sweep = inner.clone();
    let period = {
        let st = inner.state.lock();
        (st.config.heartbeat / 2).max(std::time::Duration::from_millis(10))
    };
    let sweeper = async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            let overdue = sweep.state.lock().overdue(Instant::now());
            if !overdue.is_empty() {
                sweep.declare_dead(&overdue, "no heartbeat within the failure timeout");
            }
            let mut st = sweep.state.lock();
            st.prune_dead(Instant::now(), DEAD_NODE_RETENTION);
            st.panels.prune(Instant::now());
        }
    };
    let dashboard = {
        let inner = inner.clone();
        async move {
            match http {
                Some(l) => crate::http::serve(l, inner).await,
                None => std::future::pending().await,
            }
        }
    };
    tokio::select! {
        _ = serve(listener, identity, tconfig, handler) => {}
        _ = sweeper => {}
        _ = dashboard => std::future::pending().await,
        _ = inner.stop.notified() => {}
    }
}

/// Run a controller on the current tokio runtime until the process ends (the standalone
/// `granule controller` command).
pub async fn run_standalone(listen: &str, config: ControllerConfig) -> Result<(), ControllerError> {
    run_standalone_with(listen, config, None).await
}

/// [`run_standalone`] with an [`Extension`] sharing the port (the market's broker).
pub async fn run_standalone_with(
    listen: &str,
    config: ControllerConfig,
    ext: Option<Arc<dyn Extension>>,
) -> Result<(), ControllerError> {
    let listener = Listener::bind(listen)
        .await
        .map_err(|e| ControllerError::Io(e.to_string()))?;
    tracing::info!("controller listening on {}", listener.local_addr());
    println!("granule controller listening on {}", listener.local_addr());
    let http = config
        .dashboard
        .as_deref()
        .map(crate::http::bind)
        .transpose()?;
    if let Some(a) = http.as_ref().and_then(|l| l.local_addr().ok()) {
        println!("granule dashboard: http://{a}/ (metrics: http://{a}/metrics)");
    }
    run_controller(listener, http, new_inner(config, ext)).await;
    Ok(())
}
