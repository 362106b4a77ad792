//! The driver's view of a cluster: starting the embedded local cluster (an in-process
//! controller plus node processes of this very executable on 127.0.0.1) or joining an
//! existing one, and tearing it down.
//!
//! Node processes never outlive the driver: each reads its stdin, a pipe whose other end
//! only the driver holds, and exits on EOF — which the kernel delivers however the driver
//! ends (normal exit, panic, Ctrl-C, SIGKILL). They also share a process group the driver
//! kills when the cluster is dropped. (PR_SET_PDEATHSIG is not used: it fires when the
//! *thread* that spawned the child exits, which in a test harness is any test thread.)

use crate::boot::{init_logging, BootConfig, BOOT_ENV};
use crate::config::ClusterConfig;
use crate::context;
use crate::error::{CallError, ClusterError};
use crate::node::{Node, NodeInner, NodeOptions};
use crate::shipping::{binary_hash_hint, HASH_HINT_ENV};
use granule_controller::{ControllerConfig, ControllerHandle};
use granule_wire::{MoveStats, NodeId, NodeInfo, NodeSpec, NodeState, ProcletId, Role};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use parking_lot::Mutex;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Spawned {
    child: Child,
    index: usize,
    node: Option<NodeId>,
}

/// A running cluster, from the driver's side. The driver is itself a node: proclets can
/// live here, and calls to them take the local fast path.
///
/// Dropping the cluster stops every node process it started.
pub struct Cluster {
    node: Option<Node>,
    controller: Option<ControllerHandle>,
    controller_addr: String,
    spawned: Mutex<Vec<Spawned>>,
    pgid: Option<Pid>,
    /// The cgroups of the spawned nodes, when they run with real limits.
    cgroups: Option<granule_host::ClusterGroups>,
}

/// Builder for [`Cluster`]: starts from [`ClusterConfig::default`] (not the environment).
#[derive(Clone, Debug, Default)]
pub struct ClusterBuilder {
    config: ClusterConfig,
}

impl ClusterBuilder {
    /// Embedded node processes, e.g. `"cpu=1,mem=512MiB;cpu=1,mem=2GiB"`.
    pub fn nodes(mut self, specs: &str) -> Result<Self, ClusterError> {
        self.config.nodes = crate::config::parse_specs(specs).map_err(ClusterError::Config)?;
        Ok(self)
    }
    /// Embedded node processes from specs.
    pub fn node_specs(mut self, specs: Vec<NodeSpec>) -> Self {
        self.config.nodes = specs;
        self
    }
    /// The driver's own spec.
    pub fn driver(mut self, spec: NodeSpec) -> Self {
        self.config.driver = spec;
        self
    }
    /// Join an existing cluster through its controller instead of starting one.
    pub fn controller(mut self, addr: impl Into<String>) -> Self {
        self.config.controller = Some(addr.into());
        self
    }
    pub fn failure_timeout(mut self, t: Duration) -> Self {
        self.config.failure_timeout = t;
        if self.config.heartbeat >= t {
            self.config.heartbeat = t / 4;
        }
        self
    }
    pub fn heartbeat(mut self, t: Duration) -> Self {
        self.config.heartbeat = t;
        self
    }
    /// Whether spawned nodes get cgroup v1 limits (default: when usable).
    pub fn cgroups(mut self, mode: crate::config::CgroupsMode) -> Self {
        self.config.cgroups = mode;
        self
    }

    /// Whether nodes move proclets away on their own under pressure (default on). Off
    /// suits programs that place every proclet themselves, and tests of explicit moves.
    pub fn shed(mut self, on: bool) -> Self {
        self.config.shed = on;
        self
    }
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }
    pub fn start(self) -> Result<Cluster, ClusterError> {
        Cluster::with_config(self.config)
    }
}

impl Cluster {
    /// Start the cluster the environment describes (see [`ClusterConfig::from_env`]):
    /// by default an embedded controller and `GRANULE_NODES` node processes; with
    /// `GRANULE_CONTROLLER` set, join that cluster instead.
    pub fn start() -> Result<Cluster, ClusterError> {
        Cluster::with_config(ClusterConfig::from_env()?)
    }

    /// A builder starting from defaults.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// Start with an explicit configuration.
    pub fn with_config(config: ClusterConfig) -> Result<Cluster, ClusterError> {
        init_logging();
        config.validate()?;
        let (controller, controller_addr) = match &config.controller {
            Some(addr) => (None, addr.clone()),
            None => {
                let handle = ControllerHandle::start(
                    &format!("{}:0", config.listen_host),
                    ControllerConfig {
                        heartbeat: config.heartbeat,
                        failure_timeout: config.failure_timeout,
                        ..ControllerConfig::default()
                    },
                )?;
                let addr = handle.addr().to_string();
                (Some(handle), addr)
            }
        };
        let node = Node::start(NodeOptions {
            role: Role::Driver,
            spec: config.driver,
            controller: controller_addr.clone(),
            listen_host: config.listen_host.clone(),
            shed: config.shed,
        })?;
        context::set_thread_node(&cell_of(&node.inner));
        context::offer_default_node(&node.inner);
        let mut cluster = Cluster {
            node: Some(node),
            controller,
            controller_addr,
            spawned: Mutex::new(Vec::new()),
            pgid: None,
            cgroups: None,
        };
        if cluster.controller.is_some() {
            cluster.spawn_nodes(&config)?;
        }
        Ok(cluster)
    }

    fn spawn_nodes(&mut self, config: &ClusterConfig) -> Result<(), ClusterError> {
        let hint = binary_hash_hint();
        let program = std::env::args()
            .next()
            .unwrap_or_else(|| "granule-app".into());
        self.cgroups = cluster_cgroups(config.cgroups);
        for (index, spec) in config.nodes.iter().enumerate() {
            let cgroups = node_cgroups(self.cgroups.as_ref(), index, spec);
            let boot = BootConfig {
                controller: self.controller_addr.clone(),
                spec: *spec,
                listen_host: config.listen_host.clone(),
                index,
                cgroups,
                shed: config.shed,
            };
            let boot = serde_json::to_string(&boot)
                .map_err(|e| ClusterError::Spawn(format!("cannot encode the boot config: {e}")))?;
            let mut cmd = Command::new("/proc/self/exe");
            cmd.arg0(format!("{program} [granule node {index}]"))
                .env(BOOT_ENV, boot)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
            if let Some(h) = &hint {
                cmd.env(HASH_HINT_ENV, h);
            }
            cmd.process_group(self.pgid.map(|p| p.as_raw()).unwrap_or(0));
            let child = cmd.spawn().map_err(|e| {
                ClusterError::Spawn(format!(
                    "cannot start node process {index} from /proc/self/exe: {e}"
                ))
            })?;
            if self.pgid.is_none() {
                self.pgid = Some(Pid::from_raw(child.id() as i32));
            }
            self.spawned.lock().push(Spawned {
                child,
                index,
                node: None,
            });
        }
        self.wait_for_nodes(config.start_timeout)
    }

    fn wait_for_nodes(&self, timeout: Duration) -> Result<(), ClusterError> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut sp = self.spawned.lock();
                for s in sp.iter_mut() {
                    if let Ok(Some(status)) = s.child.try_wait() {
                        return Err(ClusterError::Startup(format!(
                            "node process {} exited during start-up ({status}); its messages are above on stderr",
                            s.index
                        )));
                    }
                }
            }
            let nodes = self
                .nodes()
                .map_err(|e| ClusterError::Startup(e.to_string()))?;
            let mut sp = self.spawned.lock();
            for s in sp.iter_mut() {
                s.node = nodes
                    .iter()
                    .find(|n| {
                        n.pid == s.child.id() && n.role == Role::Node && n.state == NodeState::Alive
                    })
                    .map(|n| n.id);
            }
            if sp.iter().all(|s| s.node.is_some()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let missing: Vec<usize> = sp
                    .iter()
                    .filter(|s| s.node.is_none())
                    .map(|s| s.index)
                    .collect();
                return Err(ClusterError::Startup(format!(
                    "node processes {missing:?} did not register within {timeout:?}"
                )));
            }
            drop(sp);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn inner(&self) -> Result<&Arc<NodeInner>, CallError> {
        self.node
            .as_ref()
            .map(|n| &n.inner)
            .ok_or(CallError::NoCluster)
    }

    /// The driver's node id.
    pub fn node_id(&self) -> NodeId {
        self.node.as_ref().map(|n| n.inner.id).unwrap_or(NodeId(0))
    }

    /// The dashboard's URL (`http://IP:PORT/`; it also serves `/api/cluster` and the
    /// controller's `/metrics`), when this cluster's controller is embedded here and
    /// serves one (see `GRANULE_DASHBOARD`).
    pub fn dashboard_url(&self) -> Option<String> {
        self.controller.as_ref().and_then(|c| c.dashboard_url())
    }

    /// The controller's address (give it to `granule node --controller` or
    /// `GRANULE_CONTROLLER` to add machines).
    pub fn controller_addr(&self) -> &str {
        &self.controller_addr
    }

    /// Every node the controller knows, with spec, reported use and liveness.
    pub fn nodes(&self) -> Result<Vec<NodeInfo>, CallError> {
        let inner = self.inner()?;
        let n = inner.clone();
        inner
            .block(async move { n.controller.list_nodes().await }, None)
            .ok_or_else(|| CallError::Internal("interrupted".into()))?
            .map_err(CallError::from)
    }

    /// Ids of the alive nodes other than the driver, in id order.
    pub fn worker_nodes(&self) -> Result<Vec<NodeId>, CallError> {
        let me = self.node_id();
        let mut v: Vec<NodeId> = self
            .nodes()?
            .into_iter()
            .filter(|n| n.state == NodeState::Alive && n.id != me)
            .map(|n| n.id)
            .collect();
        v.sort();
        Ok(v)
    }

    /// Whether the spawned node processes run in cgroups with their specs as limits.
    pub fn cgroups_active(&self) -> bool {
        self.cgroups.is_some()
    }

    /// The node processes this driver started, as (node, pid), in start order.
    pub fn spawned_nodes(&self) -> Vec<(NodeId, u32)> {
        self.spawned
            .lock()
            .iter()
            .filter_map(|s| Some((s.node?, s.child.id())))
            .collect()
    }

    /// Move a proclet to another node through the controller while callers keep calling:
    /// calls that would change it are held during the transfer and then served at the new
    /// home (read-only calls keep being served at the source, except for `Vec<u8>` states),
    /// and cached locations catch up. If the node is moving the proclet already (its
    /// pressure policy), this waits for that move and then moves it on from where it went.
    /// Returns what the move cost, as the source measured it (all zero if the proclet
    /// already was on `to`). Fails with `Refused` for a pinned proclet.
    pub fn move_proclet(&self, proclet: ProcletId, to: NodeId) -> Result<MoveStats, CallError> {
        let inner = self.inner()?;
        let n = inner.clone();
        inner
            .block(
                async move { n.controller.move_proclet(proclet, to).await },
                None,
            )
            .ok_or_else(|| CallError::Internal("interrupted".into()))?
            .map_err(|e| match e {
                granule_controller::ControllerError::Remote(r) => {
                    CallError::from_remote(r, proclet)
                }
                granule_controller::ControllerError::Refused(m) => CallError::Refused(m),
                other => CallError::from(other),
            })
    }

    /// The node a proclet lives on, as the controller knows it.
    pub fn locate(&self, proclet: ProcletId) -> Result<NodeId, CallError> {
        let inner = self.inner()?;
        let n = inner.clone();
        inner
            .block(async move { n.controller.locate(proclet).await }, None)
            .ok_or_else(|| CallError::Internal("interrupted".into()))?
            .map_err(CallError::from)?
            .map(|(loc, _alive)| loc.node)
            .ok_or(CallError::ProcletGone(proclet))
    }

    /// Kill one of the node processes this driver started (SIGKILL), as a failure would.
    pub fn kill_node(&self, node: NodeId) -> Result<(), ClusterError> {
        let mut sp = self.spawned.lock();
        let s = sp
            .iter_mut()
            .find(|s| s.node == Some(node))
            .ok_or_else(|| {
                ClusterError::Config(format!("{node} is not a node this driver started"))
            })?;
        let _ = s.child.kill();
        let _ = s.child.wait();
        Ok(())
    }

    /// Make this cluster the one the calling thread's proclet calls go through (the
    /// thread that started it already is; other threads fall back to the process's first
    /// cluster).
    pub fn enter(&self) {
        if let Some(n) = &self.node {
            context::set_thread_node(&cell_of(&n.inner));
        }
    }

    /// Stop every node process, the driver node and the embedded controller.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(c) = &self.controller {
            c.quiesce();
        }
        let mut sp = self.spawned.lock();
        if let Some(pg) = self.pgid.take() {
            let _ = killpg(pg, Signal::SIGKILL);
        }
        for s in sp.iter_mut() {
            let _ = kill(Pid::from_raw(s.child.id() as i32), Signal::SIGKILL);
            let _ = s.child.wait();
        }
        sp.clear();
        drop(sp);
        // The node processes are gone (killed and reaped): their groups can go too.
        if let Some(g) = self.cgroups.take() {
            if let Err(e) = g.remove() {
                tracing::warn!("cannot remove the cluster's cgroups: {e}");
            }
        }
        if let Some(mut n) = self.node.take() {
            n.stop();
        }
        if let Some(mut c) = self.controller.take() {
            c.shutdown();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

fn cell_of(node: &Arc<NodeInner>) -> Arc<context::NodeCell> {
    let cell: Arc<context::NodeCell> = Arc::new(std::sync::OnceLock::new());
    let _ = cell.set(Arc::downgrade(node));
    cell
}

/// The cgroups for a new cluster's node processes, if `mode` allows and cgroup v1 is
/// usable; groups left by drivers that died are removed first. When unusable, warns once
/// per process and the nodes run with budget accounting only.
fn cluster_cgroups(mode: crate::config::CgroupsMode) -> Option<granule_host::ClusterGroups> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if mode == crate::config::CgroupsMode::Off {
        return None;
    }
    let warn = |why: String| {
        WARNED.call_once(|| {
            tracing::warn!(
                "node processes run without cgroup limits (budgets are only accounted): {why}. \
                 For real limits run the driver as root with the cgroup v1 memory and cpu \
                 controllers mounted under /sys/fs/cgroup; GRANULE_CGROUPS=off silences this"
            )
        })
    };
    match new_cluster_groups() {
        Ok(g) => Some(g),
        Err(why) => {
            warn(why);
            None
        }
    }
}

/// A new cluster group (`granule/c<pid>-<start>-<n>`), if cgroup v1 is usable here, after
/// removing the groups of processes that are gone (a driver or a hand-started node killed
/// with SIGKILL); else why not. Shared by drivers and hand-started nodes.
pub(crate) fn new_cluster_groups() -> Result<granule_host::ClusterGroups, String> {
    let h = granule_host::Hierarchy::detect().map_err(|e| e.to_string())?;
    for dir in granule_host::cleanup_stale(&h) {
        tracing::info!("removed the cgroup of a process that is gone: {dir}");
    }
    granule_host::ClusterGroups::new(&h).map_err(|e| e.to_string())
}

/// Create the group of spawned node `index`, if the cluster has groups; without one the
/// node runs unlimited.
fn node_cgroups(
    groups: Option<&granule_host::ClusterGroups>,
    index: usize,
    spec: &NodeSpec,
) -> Option<granule_wire::CgroupPaths> {
    match groups?.node(&format!("node{index}"), spec.cores, spec.mem_bytes) {
        Ok(g) => Some(g.paths()),
        Err(e) => {
            tracing::warn!("node process {index} runs without cgroup limits: {e}");
            None
        }
    }
}

/// Start the cluster the environment describes, run `f` with it, shut it down.
pub fn run<T>(f: impl FnOnce(&Cluster) -> T) -> Result<T, ClusterError> {
    let cluster = Cluster::start()?;
    let out = f(&cluster);
    cluster.shutdown();
    Ok(out)
}
