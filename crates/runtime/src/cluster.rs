//! The driver's view of a cluster: starting the embedded local cluster (an in-process
//! controller plus node processes of this very executable on 127.0.0.1) or joining an
//! existing one, and tearing it down.
//!
//! Node processes never outlive the driver: each reads its stdin, a pipe whose other end
//! only the driver holds, and exits on EOF — which the kernel delivers however the driver
//! ends (normal exit, panic, Ctrl-C, SIGKILL). They also share a process group the driver
//! kills when the cluster is dropped. (PR_SET_PDEATHSIG is not used: it fires when the
//! *thread* that spawned the child exits, which in a test harness is any test thread.)

use crate::boot::init_logging;
use crate::context;
use crate::error::{CallError, ClusterError};
use crate::fleet::Fleet;
use crate::node::{Node, NodeInner, NodeOptions};
use crate::shipping::binary_hash_hint;
use granule_config::{CgroupsMode, Config, ConfigError, Origin};
use granule_controller::{ControllerConfig, ControllerHandle};
use granule_wire::{MoveStats, NodeId, NodeInfo, NodeSpec, NodeState, Panel, ProcletId, Role};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a [`Cluster::panel_publisher`] call returns.
pub type PanelFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), CallError>> + Send>>;

/// A running cluster, from the driver's side. The driver is itself a node: proclets can
/// live here, and calls to them take the local fast path.
///
/// Dropping the cluster stops every node process it started.
pub struct Cluster {
    node: Option<Node>,
    controller: Option<ControllerHandle>,
    controller_addr: String,
    /// The node processes this driver started, and their supervisor.
    fleet: Option<Arc<Fleet>>,
    supervisor: Option<std::thread::JoinHandle<()>>,
    /// The cgroups of the spawned nodes, when they run with real limits.
    cgroups: Option<granule_host::ClusterGroups>,
    config: Arc<Config>,
}

/// A change the program makes to the configuration in code.
type Edit = Box<dyn Fn(&mut Config) -> Result<(), ConfigError> + Send + Sync>;

/// Builder for [`Cluster`]. Its configuration is, in increasing precedence: the
/// defaults (the built-in ones, or the program's own from [`ClusterBuilder::defaults`]),
/// the TOML file named by `GRANULE_CONFIG` (or [`ClusterBuilder::config_file`]), the
/// `GRANULE_*` environment variables, and what the program sets here — the one
/// precedence of every Granule process. A variable whose setting the program then
/// changes is reported with a warning naming both, never dropped silently. Every value
/// is checked when the cluster starts (or at once, for [`ClusterBuilder::set`] and
/// [`ClusterBuilder::nodes`]).
#[derive(Default)]
pub struct ClusterBuilder {
    file: Option<PathBuf>,
    base: Option<Config>,
    edits: Vec<Edit>,
}

impl std::fmt::Debug for ClusterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterBuilder")
            .field("file", &self.file)
            .field("edits", &self.edits.len())
            .finish()
    }
}

fn config_error(e: ConfigError) -> ClusterError {
    ClusterError::Config(e.to_string())
}

impl ClusterBuilder {
    fn edit(
        mut self,
        f: impl Fn(&mut Config) -> Result<(), ConfigError> + Send + Sync + 'static,
    ) -> Self {
        self.edits.push(Box::new(f));
        self
    }

    /// Any setting by key (`"migration.throttle"`, `"pressure.shed"`, ...: see
    /// `docs/guide/configuration.md`), from its text form; checked now.
    pub fn set(self, key: &str, value: &str) -> Result<Self, ClusterError> {
        Config::default().set(key, value).map_err(config_error)?;
        let (key, value) = (key.to_string(), value.to_string());
        Ok(self.edit(move |c| c.set_with_origin(&key, &value, Origin::Code)))
    }

    /// Change the typed configuration in code, e.g.
    /// `.with(|c| c.migration.throttle = Some(32_000_000))`.
    pub fn with(self, f: impl Fn(&mut Config) + Send + Sync + 'static) -> Self {
        self.edit(move |c| {
            f(c);
            Ok(())
        })
    }

    /// Read settings from this TOML file instead of the one `GRANULE_CONFIG` names.
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.file = Some(path.into());
        self
    }

    /// Start from these values instead of the built-in defaults; the file, the
    /// environment and what is set on the builder still apply on top.
    pub fn defaults(mut self, config: Config) -> Self {
        self.base = Some(config);
        self
    }

    /// Embedded node processes, e.g. `"cpu=1,mem=512MiB;cpu=1,mem=2GiB"` (`cluster.nodes`).
    pub fn nodes(self, specs: &str) -> Result<Self, ClusterError> {
        let specs = granule_config::parse_specs(specs).map_err(ClusterError::Config)?;
        Ok(self.node_specs(specs))
    }

    /// Embedded node processes from specs.
    pub fn node_specs(self, specs: Vec<NodeSpec>) -> Self {
        self.with(move |c| c.cluster.nodes = specs.clone())
    }

    /// The driver's own spec (`cluster.driver`).
    pub fn driver(self, spec: NodeSpec) -> Self {
        self.with(move |c| c.cluster.driver = spec)
    }

    /// Join an existing cluster through its controller instead of starting one.
    pub fn controller(self, addr: impl Into<String>) -> Self {
        let addr = addr.into();
        self.with(move |c| c.cluster.controller = Some(addr.clone()))
    }

    /// Silence after which a node is declared dead; the heartbeat drops to a quarter of
    /// it if it was not shorter.
    pub fn failure_timeout(self, t: Duration) -> Self {
        self.with(move |c| {
            c.cluster.failure_timeout = t;
            if c.cluster.heartbeat >= t {
                c.cluster.heartbeat = t / 4;
            }
        })
    }

    /// How often nodes send heartbeats.
    pub fn heartbeat(self, t: Duration) -> Self {
        self.with(move |c| c.cluster.heartbeat = t)
    }

    /// Whether spawned nodes get cgroup v1 limits (default: when usable).
    pub fn cgroups(self, mode: CgroupsMode) -> Self {
        self.with(move |c| c.cluster.cgroups = mode)
    }

    /// Whether nodes move proclets away on their own under pressure (default on). Off
    /// suits programs that place every proclet themselves, and tests of explicit moves.
    pub fn shed(self, on: bool) -> Self {
        self.with(move |c| c.pressure.shed = on)
    }

    /// Whether nodes take fault-injection orders (tests only; see [`Cluster::faults`]).
    pub fn faults(self, on: bool) -> Self {
        self.with(move |c| c.faults.enabled = on)
    }

    /// The configuration this builder would start with: file, environment, then what was
    /// set here; validated.
    pub fn resolve(&self) -> Result<Config, ClusterError> {
        let base = self.base.clone().unwrap_or_default();
        let env = |k: &str| std::env::var(k).ok();
        let mut c = match &self.file {
            Some(file) => {
                let mut c = base;
                c.apply_toml_file(file).map_err(config_error)?;
                c.apply_env(env).map_err(config_error)?;
                c
            }
            None => Config::load_over(base, env).map_err(config_error)?,
        };
        let from_environment = c.clone();
        for e in &self.edits {
            e(&mut c).map_err(config_error)?;
        }
        c.validate().map_err(config_error)?;
        let overrides = overridden(&from_environment, &c, env);
        if !overrides.is_empty() {
            // Before the cluster starts (which installs it too): the warnings must show.
            init_logging(&c.cluster.log);
        }
        for (setting, var, value) in overrides {
            tracing::warn!(
                "{var}={value} is overridden by the program, which sets {setting} = {} \
                 (Cluster::builder): what a program sets in code wins over the environment",
                c.get(setting).unwrap_or_default()
            );
        }
        Ok(c)
    }

    pub fn start(self) -> Result<Cluster, ClusterError> {
        Cluster::with_config(self.resolve()?)
    }
}

/// The settings whose `GRANULE_*` variable is set but which the program's own settings
/// changed from what the variable gave: (key, variable, the variable's value).
fn overridden(
    from_environment: &Config,
    resolved: &Config,
    env: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, &'static str, String)> {
    granule_config::SETTINGS
        .iter()
        .filter_map(|s| {
            let value = env(s.env).filter(|v| !v.trim().is_empty())?;
            (from_environment.get(s.key) != resolved.get(s.key)).then_some((s.key, s.env, value))
        })
        .collect()
}

impl Cluster {
    /// Start the cluster the environment describes (defaults, the `GRANULE_CONFIG` file,
    /// `GRANULE_*` variables): by default an embedded controller and `cluster.nodes` node
    /// processes; with `cluster.controller` set, join that cluster instead.
    pub fn start() -> Result<Cluster, ClusterError> {
        ClusterBuilder::default().start()
    }

    /// A builder: the environment's configuration, changed in code.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// Start with exactly this configuration (no file, no environment).
    pub fn with_config(config: Config) -> Result<Cluster, ClusterError> {
        config.validate().map_err(config_error)?;
        init_logging(&config.cluster.log);
        let config = Arc::new(config);
        let cl = &config.cluster;
        let (controller, controller_addr) = match &cl.controller {
            Some(addr) => (None, addr.clone()),
            None => {
                let handle = ControllerHandle::start(
                    &format!("{}:0", cl.listen_host),
                    ControllerConfig {
                        heartbeat: cl.heartbeat,
                        failure_timeout: cl.failure_timeout,
                        forget_dead_after: cl.forget_dead_after,
                        dashboard: cl.dashboard.clone(),
                        http: granule_http::Limits::from_config(&config),
                        ..ControllerConfig::default()
                    },
                )?;
                let addr = handle.addr().to_string();
                (Some(handle), addr)
            }
        };
        let node = Node::start(NodeOptions {
            role: Role::Driver,
            spec: cl.driver,
            controller: controller_addr.clone(),
            config: config.clone(),
        })?;
        context::set_thread_node(&cell_of(&node.inner));
        context::offer_default_node(&node.inner);
        let mut cluster = Cluster {
            node: Some(node),
            controller,
            controller_addr,
            fleet: None,
            supervisor: None,
            cgroups: None,
            config,
        };
        if cluster.controller.is_some() {
            cluster.spawn_nodes()?;
        }
        Ok(cluster)
    }

    /// The configuration this cluster runs with (its nodes got the same).
    pub fn config(&self) -> &Config {
        &self.config
    }

    fn spawn_nodes(&mut self) -> Result<(), ClusterError> {
        let config = self.config.clone();
        self.cgroups = cluster_cgroups(&config);
        let cgroups = config
            .cluster
            .nodes
            .iter()
            .enumerate()
            .map(|(index, spec)| node_cgroups(self.cgroups.as_ref(), index, spec))
            .collect();
        let fleet = Arc::new(Fleet::new(
            config,
            self.controller_addr.clone(),
            binary_hash_hint(),
            cgroups,
        ));
        self.fleet = Some(fleet.clone());
        fleet.start_all(|| self.nodes().map_err(|e| e.to_string()))?;
        let node = Arc::downgrade(
            self.inner()
                .map_err(|e| ClusterError::Startup(e.to_string()))?,
        );
        self.supervisor = Some(fleet.supervise(node).map_err(|e| {
            ClusterError::Spawn(format!("cannot start the supervisor thread: {e}"))
        })?);
        Ok(())
    }

    /// Wait until every configured node process is up and registered as a live node
    /// (after a node died, until its replacement joined: see `cluster.replace_dead`).
    /// Returns the worker nodes then, or an error after `timeout`.
    pub fn wait_for_nodes(&self, timeout: Duration) -> Result<Vec<NodeId>, ClusterError> {
        let deadline = Instant::now() + timeout;
        let Some(fleet) = &self.fleet else {
            return self
                .worker_nodes()
                .map_err(|e| ClusterError::Startup(e.to_string()));
        };
        loop {
            let list = self
                .nodes()
                .map_err(|e| ClusterError::Startup(e.to_string()))?;
            if fleet.complete(&list) {
                return self
                    .worker_nodes()
                    .map_err(|e| ClusterError::Startup(e.to_string()));
            }
            if Instant::now() > deadline {
                return Err(ClusterError::Startup(format!(
                    "the cluster did not return to its {} configured node processes within {timeout:?}",
                    self.config.cluster.nodes.len()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many node processes the driver started to replace ones that ended or were
    /// declared dead (`cluster.replace_dead`).
    pub fn replacements(&self) -> u64 {
        self.fleet.as_ref().map_or(0, |f| f.replaced())
    }

    /// Fault injection on this cluster's nodes (tests; nodes must run with
    /// `faults.enabled`, see [`ClusterBuilder::faults`]).
    pub fn faults(&self) -> crate::faults::Faults<'_> {
        crate::faults::Faults { cluster: self }
    }

    pub(crate) fn inner(&self) -> Result<&Arc<NodeInner>, CallError> {
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
    /// serves one (see `cluster.dashboard`).
    pub fn dashboard_url(&self) -> Option<String> {
        self.controller.as_ref().and_then(|c| c.dashboard_url())
    }

    /// The controller's address (give it to `granule node --controller` or
    /// `GRANULE_CONTROLLER` to add machines).
    pub fn controller_addr(&self) -> &str {
        &self.controller_addr
    }

    /// Show (or refresh) a panel on the controller's dashboard (`/`, `/api/panels`,
    /// `/api/cluster`), sent over the driver's own connection to the controller (so it
    /// works whether or not the dashboard is served here). The panel stays while it is
    /// refreshed within its `ttl_ms` and this cluster runs; an oversize one is refused
    /// with the bound it breaks (`CallError::Controller`).
    pub fn publish_panel(&self, panel: Panel) -> Result<(), CallError> {
        let inner = self.inner()?;
        let n = inner.clone();
        inner
            .block(async move { n.controller.publish_panel(panel).await }, None)
            .ok_or_else(|| CallError::Internal("interrupted".into()))?
            .map_err(CallError::from)
    }

    /// [`Cluster::publish_panel`] for a task on any tokio runtime: a function to call
    /// as often as the panel changes, which does not keep the cluster alive (once the
    /// cluster stopped, its futures fail with `NoCluster`).
    pub fn panel_publisher(&self) -> impl Fn(Panel) -> PanelFuture + Clone + Send + Sync + 'static {
        let node = self.node.as_ref().map(|n| Arc::downgrade(&n.inner));
        move |panel: Panel| -> PanelFuture {
            // A node that stopped may still be held for a moment by tasks being dropped.
            let node = node
                .as_ref()
                .and_then(std::sync::Weak::upgrade)
                .filter(|n| !n.is_stopped());
            Box::pin(async move {
                let n = node.ok_or(CallError::NoCluster)?;
                n.controller
                    .publish_panel(panel)
                    .await
                    .map_err(CallError::from)
            })
        }
    }

    /// The cluster's nodes, with spec, reported use and liveness: every live node, and
    /// each dead or departed one for `cluster.forget_dead_after` after it died or left
    /// (then the list forgets it; calls to the proclets it held still fail as
    /// unreachable, and its id is never given to another node).
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

    /// The live node processes this driver started that registered, as (node, pid), in
    /// the order of `cluster.nodes` (a replacement takes its predecessor's place).
    pub fn spawned_nodes(&self) -> Vec<(NodeId, u32)> {
        self.fleet
            .as_ref()
            .map(|f| f.registered())
            .unwrap_or_default()
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

    /// Move the backup copy of replicated proclet `proclet` kept on node `from` to node
    /// `to`: its primary streams the state to `to`, and `from` drops its copy. A `to`
    /// that already keeps a copy is replaced by a node the controller picks. (Moving the
    /// primary is [`Cluster::move_proclet`]; the pressure policy moves both.)
    pub fn move_backup(
        &self,
        proclet: ProcletId,
        from: NodeId,
        to: NodeId,
    ) -> Result<MoveStats, CallError> {
        let inner = self.inner()?;
        let n = inner.clone();
        inner
            .block(
                async move {
                    let nodes = n.controller.list_nodes().await?;
                    let addr = nodes
                        .iter()
                        .find(|i| i.id == to)
                        .map(|i| i.addr.clone())
                        .ok_or_else(|| CallError::Refused(format!("no node {to}")))?;
                    let at = granule_wire::Location {
                        node: to,
                        addr,
                        epoch: 0,
                    };
                    n.ask_backup_move(proclet, from, &at)
                        .await
                        .map_err(|e| CallError::from_remote(e, proclet))
                },
                None,
            )
            .ok_or_else(|| CallError::Internal("interrupted".into()))?
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
    /// With `cluster.replace_dead` on, a replacement joins as a new node soon after.
    pub fn kill_node(&self, node: NodeId) -> Result<(), ClusterError> {
        match &self.fleet {
            Some(f) => f.kill(node),
            None => Err(ClusterError::Config(format!(
                "{node} is not a node this driver started"
            ))),
        }
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
        if let Some(f) = self.fleet.take() {
            f.stop();
        }
        if let Some(t) = self.supervisor.take() {
            let _ = t.join();
        }
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

/// The cgroups for a new cluster's node processes, if `cluster.cgroups` allows and
/// cgroup v1 is usable; groups left by drivers that died are removed first. When
/// unusable, warns once per process and the nodes run with budget accounting only.
fn cluster_cgroups(config: &Config) -> Option<granule_host::ClusterGroups> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if config.cluster.cgroups == CgroupsMode::Off {
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
    match new_cluster_groups(config) {
        Ok(g) => Some(g),
        Err(why) => {
            warn(why);
            None
        }
    }
}

/// A new cluster group (`granule/c<pid>-<start>-<n>`), if cgroup v1 is usable here, after
/// removing the groups of processes that are gone (a driver or a hand-started node killed
/// with SIGKILL); else why not. Shared by drivers and hand-started nodes; node groups
/// made from it get the configured CFS period.
pub(crate) fn new_cluster_groups(config: &Config) -> Result<granule_host::ClusterGroups, String> {
    let h = granule_host::Hierarchy::detect().map_err(|e| e.to_string())?;
    for dir in granule_host::cleanup_stale(&h) {
        tracing::info!("removed the cgroup of a process that is gone: {dir}");
    }
    let mut g = granule_host::ClusterGroups::new(&h).map_err(|e| e.to_string())?;
    g.set_cfs_period(config.cluster.cfs_period);
    Ok(g)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_the_program_overrides_is_reported_and_one_it_keeps_is_not() {
        let env = |k: &str| match k {
            "GRANULE_NODES" => Some("cpu=1,mem=64MiB".to_string()),
            "GRANULE_LOG" => Some("info".to_string()),
            _ => None,
        };
        let from_environment = Config::load_over(Config::default(), env).unwrap();
        let mut resolved = from_environment.clone();
        resolved.set("cluster.nodes", "cpu=2,mem=1GiB").unwrap();
        let o = overridden(&from_environment, &resolved, env);
        assert_eq!(
            o,
            vec![(
                "cluster.nodes",
                "GRANULE_NODES",
                "cpu=1,mem=64MiB".to_string()
            )]
        );
        // Setting a value equal to the variable's is no override.
        resolved.set("cluster.log", "info").unwrap();
        assert_eq!(overridden(&from_environment, &resolved, env).len(), 1);
    }
}
