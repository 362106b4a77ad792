//! A node: the per-process runtime that hosts proclets and makes calls. Every Granule
//! process that hosts proclets — the driver and each node process — runs exactly one.
//!
//! Its state is split into parts named by their job, each owning its fields:
//!
//! | part | owns | file |
//! |---|---|---|
//! | [`Lifecycle`] | whether the node is stopping, and why | `mod.rs` |
//! | `controller`, [`IdBlocks`] | the link to the controller; proclet ids handed out in blocks; heartbeats | `control.rs` |
//! | [`Peers`] | connections to other nodes, membership, nodes declared dead | `peers.rs` |
//! | [`Locations`] | where proclets hosted elsewhere live; forwarding entries for those that left | `locations.rs` |
//! | [`Hosting`] | the table of hosted proclets, their counts, which workers are inside closures | `hosting.rs` |
//! | [`Migration`] | moves in both directions, over state streams | `migrate.rs`, `stream.rs` |
//! | [`Monitor`] | resource readings, the move cost model, shedding under pressure | `monitor.rs`, `policy.rs` |
//! | [`NodeFaults`] | fault injection: the transport's filter, failpoint orders | `faults.rs` |
//! | `pushdown` | the pool of threads that runs pushed calls (its queue, admission, CPU cap) | `crate::pushdown` |
//! | [`Replication`](replicate::Replication) | replicated proclets: primaries' configurations, backup copies | `replicate.rs` |
//! | [`NodeMetrics`](crate::telemetry::NodeMetrics) | figures kept for `/metrics` | `telemetry.rs` |
//!
//! Each path through them reads top to bottom in one file: a remote call in `calls.rs`
//! (locate the proclet → connect → request → follow "not here"), serving it in
//! `serve.rs`, a move in `migrate.rs`.
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
//!   moving proclets, freeing moved-out states;
//! - *pushdown* threads (`pushdown.threads`, named `granule-push-N`): pushed calls,
//!   queued behind the proclet's shared lock and run apart from the workers, possibly in
//!   a capped cpu cgroup of their own (see `crate::pushdown`).

use crate::busy::BusyBoard;
use crate::context::{self, NodeCell};
use crate::error::ClusterError;
use crate::shipping;
use granule_config::Config;
use granule_controller::{ControllerClient, ControllerError};
use granule_transport::{serve, Handler, Identity, Listener, TransportConfig};
use granule_wire::{Kind, Location, NodeId, NodeSpec, ProcletId, Role};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::runtime::{Handle, Runtime};

mod calls;
mod control;
mod faults;
mod hosting;
mod locations;
mod migrate;
pub(crate) mod monitor;
mod peers;
pub(crate) mod policy;
pub(crate) mod replicate;
mod serve;
pub(crate) mod stream;

pub(crate) use control::IdBlocks;
pub(crate) use faults::NodeFaults;
pub(crate) use hosting::Hosting;
pub(crate) use locations::Locations;
pub(crate) use migrate::Migration;
pub(crate) use monitor::Monitor;
pub(crate) use peers::Peers;
pub(crate) use serve::NodeHandler;

/// How long a node stopping on its own waits for the controller to take its goodbye.
const LEAVE_WAIT: Duration = Duration::from_millis(500);

/// What a node is started with.
#[derive(Clone, Debug)]
pub(crate) struct NodeOptions {
    pub role: Role,
    pub spec: NodeSpec,
    /// The controller to register with.
    pub controller: String,
    /// The whole configuration (listen host, transport, migration, pressure, faults).
    pub config: Arc<Config>,
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
    Value(bytes::Bytes),
    /// The proclet turned out to live on this node now: call it locally.
    Local,
}

/// Whether the node is running, and why it stops.
pub(crate) struct Lifecycle {
    stopped: AtomicBool,
    /// The node was asked to stop from its own side (a signal to `granule node`), not by
    /// the cluster: it says goodbye to the controller as it stops.
    leaving: AtomicBool,
    /// The controller declared this node dead (it found out on waking up, or through a
    /// heartbeat refused): its proclets count as lost, and it may rejoin only as a new
    /// node (`cluster.rejoin`).
    declared_dead: AtomicBool,
    shutdown: Mutex<Option<String>>,
    shutdown_cv: Condvar,
}

impl Lifecycle {
    fn new() -> Lifecycle {
        Lifecycle {
            stopped: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            declared_dead: AtomicBool::new(false),
            shutdown: Mutex::new(None),
            shutdown_cv: Condvar::new(),
        }
    }

    /// The node leaves of its own accord (its program asked): it will say goodbye.
    pub(crate) fn mark_leaving(&self) {
        self.leaving.store(true, Ordering::Release);
    }

    /// The controller declared this node dead.
    pub(crate) fn mark_declared_dead(&self) {
        self.declared_dead.store(true, Ordering::Release);
    }

    /// Whether the controller declared this node dead.
    pub(crate) fn was_declared_dead(&self) -> bool {
        self.declared_dead.load(Ordering::Acquire)
    }
}

/// A node's state: its identity, its configuration, and its parts (see the module doc).
pub(crate) struct NodeInner {
    pub id: NodeId,
    pub role: Role,
    /// The address other nodes dial.
    pub addr: String,
    pub config: Arc<Config>,
    /// The worker runtime.
    pub handle: Handle,
    pub controller: ControllerClient,
    pub ids: IdBlocks,
    pub lifecycle: Lifecycle,
    pub peers: Peers,
    pub locations: Locations,
    pub hosting: Hosting,
    pub migration: Migration,
    pub monitor: Monitor,
    pub faults: NodeFaults,
    pub metrics: crate::telemetry::NodeMetrics,
    /// The pool that runs pushed calls.
    pub pushdown: crate::pushdown::PushPool,
    /// Replicated proclets: primaries here, backup copies kept here.
    pub replication: replicate::Replication,
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

/// The transport settings of the configuration, with the node's fault filter.
fn transport_config(
    c: &granule_config::Transport,
    faults: Arc<granule_transport::FaultFilter>,
) -> TransportConfig {
    TransportConfig {
        max_frame: c.max_frame as usize,
        max_in_flight: c.max_in_flight as usize,
        max_incoming: c.max_incoming as usize,
        handshake_timeout: c.handshake_timeout,
        faults,
        ..TransportConfig::default()
    }
}

impl Node {
    /// Start a node: runtimes, listener, registration with the controller, heartbeats.
    pub(crate) fn start(opts: NodeOptions) -> Result<Node, ClusterError> {
        context::install_panic_hook();
        let config = opts.config.clone();
        let faults = NodeFaults::new(&config.faults).map_err(ClusterError::Config)?;
        if opts.role == Role::Node && granule_failpoints::hit_blocking("node.start").is_err() {
            return Err(ClusterError::Startup(
                "failpoint node.start: this node's start-up fails on purpose".into(),
            ));
        }
        let cell: Arc<NodeCell> = Arc::new(OnceLock::new());
        let workers_n = (opts.spec.cores.ceil() as usize).max(1);
        let slice = config.node.worker_slice;
        let wcell = cell.clone();
        let busy = Arc::new(BusyBoard::new());
        let wbusy = busy.clone();
        let workers = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers_n)
            .thread_name("granule-worker")
            .enable_all()
            .on_thread_start(move || {
                // Workers (and the runtime's blocking threads, which start here too)
                // wake to serve calls: see `node.worker_slice`.
                context::apply_worker_slice(slice);
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
                context::apply_worker_slice(slice);
                context::set_thread_node(&ccell)
            })
            .build()
            .map_err(|e| io_err("cannot start the control runtime", e))?;

        let spin = config.transport.spin;
        let bind_addr = format!("{}:0", config.cluster.listen_host);
        let listener = context::block_on(
            workers
                .handle()
                .spawn(async move { Listener::bind(&bind_addr).await }),
            None,
            spin,
        )
        .ok_or_else(|| io_err("bind", "interrupted"))?
        .map_err(|e| io_err("bind", e))?
        .map_err(|e| io_err("cannot listen for other nodes", e))?;
        let addr = advertised_addr(listener.local_addr(), &opts.controller);
        // Every descriptor the system grants: the HTTP doors keep node.fd_reserve of them
        // free below this limit for cluster traffic.
        if let Err(e) = granule_host::os::raise_nofile_limit() {
            tracing::warn!("cannot raise the limit on open files: {e}");
        }
        let metrics_listener = crate::telemetry::bind(&config.cluster.listen_host)
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
        let tconfig = Arc::new(transport_config(&config.transport, faults.filter()));
        let ctl_identity = Arc::new(Identity {
            role: opts.role,
            node: None,
            binary: Some(binary),
            program: program.clone(),
        });
        let ctl_addr = opts.controller.clone();
        let h: Arc<dyn Handler> = handler.clone();
        let (role, spec) = (opts.role, opts.spec);
        let reg_addr = addr.clone();
        let reg_program = program.clone();
        let ctl_tconfig = tconfig.clone();
        let joined = context::block_on(
            control.handle().spawn(async move {
                let client =
                    ControllerClient::connect_with(&ctl_addr, ctl_identity, ctl_tconfig, h).await?;
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
            spin,
        )
        .ok_or_else(|| io_err("register", "interrupted"))?
        .map_err(|e| io_err("register", e))?;
        let (controller, reg) = joined?;
        faults.set_local(reg.node);

        let identity = Arc::new(Identity {
            role: opts.role,
            node: Some(reg.node),
            binary: Some(binary),
            program,
        });
        let pushdown = crate::pushdown::PushPool::start(&config, opts.spec, cell.clone());
        let inner = Arc::new(NodeInner {
            id: reg.node,
            role: opts.role,
            addr,
            handle: workers.handle().clone(),
            controller,
            ids: IdBlocks::default(),
            lifecycle: Lifecycle::new(),
            peers: Peers::new(
                identity.clone(),
                tconfig.clone(),
                handler.clone(),
                workers.handle().clone(),
            ),
            locations: Locations::default(),
            hosting: Hosting::new(busy),
            migration: Migration::new(config.migration.clone()),
            monitor: Monitor::new(
                opts.spec.mem_bytes,
                opts.spec.cores,
                config.pressure.clone(),
            ),
            faults,
            metrics: Default::default(),
            pushdown,
            replication: Default::default(),
            config,
        });
        let _ = cell.set(Arc::downgrade(&inner));

        let h: Arc<dyn Handler> = handler;
        workers.spawn(serve(listener, identity, tconfig, h));
        // The monitor first: its first sample (immediate) then precedes the first
        // heartbeat, which so reports real readings (cgroup limit, pressure).
        control.spawn(inner.clone().monitor_loop());
        control.spawn(control::heartbeat_loop(inner.clone(), reg.heartbeat));
        control.spawn(crate::telemetry::serve(
            metrics_listener,
            Arc::downgrade(&inner),
        ));
        // With one worker there is no idle worker to wake: no watchdog needed.
        let weak = Arc::downgrade(&inner);
        if workers_n > 1 {
            control.spawn(crate::busy::watchdog(
                inner.hosting.busy.clone(),
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
        let lc = &self.inner.lifecycle;
        let own_decision = lc.shutdown.lock().is_none() || lc.leaving.load(Ordering::Acquire);
        if own_decision {
            self.leave();
        }
        lc.stopped.store(true, Ordering::Release);
        self.inner.pushdown.stop();
        self.inner.peers.close_all();
        self.inner.trigger_shutdown("stopped".into());
        if let Some(rt) = self.workers.take() {
            rt.shutdown_background();
        }
        if let Some(rt) = self.control.take() {
            rt.shutdown_background();
        }
    }

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

impl NodeInner {
    pub(crate) fn is_stopped(&self) -> bool {
        self.lifecycle.stopped.load(Ordering::Acquire)
    }

    /// Ask the node's owner to stop (controller said so, or the controller is gone).
    pub(crate) fn trigger_shutdown(&self, reason: String) {
        let lc = &self.lifecycle;
        let mut r = lc.shutdown.lock();
        if r.is_none() {
            if self.role == Role::Node && reason != "stopped" {
                // Normal at the end of a run (the driver went away); a warning otherwise.
                if reason.contains("shutting down")
                    || reason.contains("lost the controller")
                    || lc.leaving.load(Ordering::Acquire)
                {
                    tracing::info!(node = %self.id, "leaving the cluster: {reason}");
                } else {
                    tracing::warn!(node = %self.id, "leaving the cluster: {reason}");
                }
            }
            *r = Some(reason);
            lc.shutdown_cv.notify_all();
        }
    }

    /// Block until the node is asked to stop; returns why.
    pub(crate) fn wait_shutdown(&self) -> String {
        let lc = &self.lifecycle;
        let mut r = lc.shutdown.lock();
        while r.is_none() {
            lc.shutdown_cv.wait(&mut r);
        }
        r.clone().unwrap_or_default()
    }

    /// Run a future to completion from any thread (the worker runtime drives I/O).
    pub(crate) fn block<F: std::future::Future>(
        &self,
        fut: F,
        deadline: Option<std::time::Instant>,
    ) -> Option<F::Output> {
        let _enter = self.handle.enter();
        context::block_on(fut, deadline, self.config.transport.spin)
    }
}

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
