//! Running a process as a node: started by a driver (its boot payload arrives in one
//! environment variable, read before `main`) or by hand (`granule node`).
//!
//! A driver's node processes get everything from the boot payload: where the controller
//! is, their spec, the cgroups made for them, and the driver's whole configuration — they
//! read no other setting of their own. A node started by hand gets its configuration from
//! its command's flags, a file and the environment (`Config::load` plus flags).

use crate::context;
use crate::error::ClusterError;
use crate::node::{Node, NodeOptions};
use crate::shipping;
use granule_config::{CgroupsMode, Config};
use granule_wire::{CgroupPaths, NodeSpec, Role};
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::io::Read;
use std::sync::Arc;

/// Environment variable through which a driver starts one of its node processes.
pub(crate) const BOOT_ENV: &str = "GRANULE_NODE_BOOT";

/// What a driver tells a node process it spawns.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct BootPayload {
    pub controller: String,
    pub spec: NodeSpec,
    pub index: usize,
    /// The cgroups the driver made for this node (its limits), to join before anything
    /// else runs.
    pub cgroups: Option<CgroupPaths>,
    /// The driver's executable hash and identity (see `shipping::binary_hash_hint`).
    pub binary_hint: Option<String>,
    /// The driver's whole configuration.
    pub config: Config,
}

/// How to run a node by hand.
#[derive(Clone, Debug)]
pub struct NodeArgs {
    /// The controller to join (`host:port`).
    pub controller: String,
    /// Cores and memory this node offers.
    pub spec: NodeSpec,
    /// Every other setting (listen host, transport, migration, pressure, cgroups, log).
    pub config: Config,
}

/// Install the log filter (`cluster.log`) once per process; later calls change nothing.
pub fn init_logging(filter: &str) {
    // The configuration checked the filter; a process-wide subscriber may already exist.
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: a log redirected to a file (a test run, a service's
    // journal) must read as plain text.
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Run this process as a node until the cluster tells it to leave (or it loses the
/// controller). Returns why it left. Errors (unreachable controller, refused
/// registration such as a binary mismatch, bad configuration) come back before the node
/// serves anything.
///
/// A node the controller declared dead while it still ran (it was stopped, or cut off
/// for longer than the failure timeout) finds out when it wakes up. Its proclets count
/// as lost, so it cannot carry on as the same node: with `cluster.rejoin` on (the
/// default) it re-executes this program with the same arguments and joins as a new node
/// with no proclets, and this function does not return; off, it returns the reason.
pub fn run_node(args: NodeArgs) -> Result<String, ClusterError> {
    let rejoin = args.config.cluster.rejoin;
    args.config
        .validate()
        .map_err(|e| ClusterError::Config(e.to_string()))?;
    init_logging(&args.config.cluster.log);
    // Ctrl-C / SIGTERM: leave the cluster cleanly (the controller records a departure,
    // not a failure). Blocked here, before any thread starts, so every thread inherits
    // the mask and only the watcher below receives them; a second signal exits at once.
    let signals = {
        let mut s = nix::sys::signal::SigSet::empty();
        s.add(nix::sys::signal::Signal::SIGINT);
        s.add(nix::sys::signal::Signal::SIGTERM);
        s
    };
    let watched = signals.thread_block().is_ok();
    let groups = own_cgroups(&args.spec, &args.config)?;
    let started = Node::start(NodeOptions {
        role: Role::Node,
        spec: args.spec,
        controller: args.controller,
        config: Arc::new(args.config),
    });
    let node = match started {
        Ok(n) => n,
        Err(e) => {
            if watched {
                let _ = signals.thread_unblock();
            }
            if let Some(g) = groups {
                g.leave_and_remove();
            }
            return Err(e);
        }
    };
    context::offer_default_node(&node.inner);
    if let Some(g) = &groups {
        eprintln!(
            "granule node: in its own cgroups {} (memory limit {} MiB, a CPU quota of {} cores)",
            g.node_paths.memory.as_deref().unwrap_or("?"),
            args.spec.mem_bytes >> 20,
            args.spec.cores
        );
    }
    eprintln!(
        "granule node {} serving on {} (cpu={}, mem={} MiB)",
        node.inner.id,
        node.inner.addr,
        args.spec.cores,
        args.spec.mem_bytes >> 20
    );
    if watched {
        let inner = node.inner.clone();
        let spawned = std::thread::Builder::new()
            .name("granule-signals".into())
            .spawn(move || {
                if let Ok(sig) = signals.wait() {
                    inner.lifecycle.mark_leaving();
                    inner.trigger_shutdown(format!("stopped by {sig}"));
                }
                if signals.wait().is_ok() {
                    std::process::exit(130);
                }
            });
        if spawned.is_err() {
            let _ = signals.thread_unblock();
        }
    }
    let reason = node.inner.wait_shutdown();
    let declared_dead = node.inner.lifecycle.was_declared_dead();
    drop(node);
    if let Some(g) = groups {
        g.leave_and_remove();
    }
    if declared_dead && rejoin {
        eprintln!("granule node: {reason}; rejoining as a new node (cluster.rejoin)");
        if watched {
            // The signal mask survives exec: give the new image the one it started with.
            let _ = signals.thread_unblock();
        }
        let e = reexec(None);
        return Err(ClusterError::Startup(format!(
            "cannot rejoin: re-executing {} failed: {e}",
            granule_host::proc::SELF_EXE
        )));
    }
    Ok(reason)
}

/// Replace this process's image by a fresh run of its own executable with the same
/// arguments (and `env`, if given, added to the environment): how a node declared dead
/// starts over as a new node. Sockets close on exec; the process keeps its pid, its
/// cgroups and its stdin (an embedded node's lifeline). Returns only on failure.
fn reexec(env: Option<(&str, &OsString)>) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(granule_host::proc::SELF_EXE);
    if let Some(arg0) = args.next() {
        cmd.arg0(arg0);
    }
    cmd.args(args);
    if let Some((k, v)) = env {
        cmd.env(k, v);
    }
    cmd.exec()
}

/// A hand-started node's own cgroups: `granule/c<pid>-<start>-<n>/node0` with its spec's
/// memory limit and CPU quota, as an embedded node gets from its driver, so its limits
/// are real and antagonists (`granule antagonist --node`) can target it.
struct OwnGroups {
    cluster: granule_host::ClusterGroups,
    node_paths: CgroupPaths,
    /// Where the process ran before, to return there: a group with a task in it cannot
    /// be removed.
    previous: CgroupPaths,
}

impl OwnGroups {
    fn leave_and_remove(self) {
        if let Err(e) = granule_host::join_self(&self.previous) {
            tracing::warn!("cannot leave the node's cgroups: {e}");
        }
        if let Err(e) = self.cluster.remove() {
            tracing::warn!("cannot remove the node's cgroups: {e}");
        }
    }
}

/// Create and join the node's own cgroups when `cluster.cgroups` allows (default `auto`)
/// and cgroup v1 is usable here (root, memory and cpu controllers mounted); otherwise say
/// why once and run with budget accounting only, as embedded nodes do. Groups left by
/// processes that are gone are removed first ([`crate::cluster::new_cluster_groups`]).
fn own_cgroups(spec: &NodeSpec, config: &Config) -> Result<Option<OwnGroups>, ClusterError> {
    if config.cluster.cgroups == CgroupsMode::Off {
        return Ok(None);
    }
    let unlimited = |why: String| {
        eprintln!(
            "granule node: running without cgroup limits (its budget is only accounted): \
             {why}. For real limits run it as root with the cgroup v1 memory and cpu \
             controllers mounted under /sys/fs/cgroup; GRANULE_CGROUPS=off silences this"
        );
        Ok(None)
    };
    let cluster = match crate::cluster::new_cluster_groups(config) {
        Ok(c) => c,
        Err(why) => return unlimited(why),
    };
    // `current_paths` leaves out a controller's root group: that is where to return then.
    let previous = granule_host::current_paths().unwrap_or_default();
    let previous = CgroupPaths {
        memory: Some(previous.memory.unwrap_or_else(|| "/".into())),
        cpu: Some(previous.cpu.unwrap_or_else(|| "/".into())),
    };
    let joined = cluster
        .node("node0", spec.cores, spec.mem_bytes)
        .and_then(|g| granule_host::join_self(&g.paths()).map(|()| g.paths()));
    match joined {
        Ok(node_paths) => Ok(Some(OwnGroups {
            cluster,
            node_paths,
            previous,
        })),
        Err(e) => {
            let _ = granule_host::join_self(&previous);
            let _ = cluster.remove();
            unlimited(e.to_string())
        }
    }
}

/// Entry from the pre-`main` hook: parse the boot payload, run, exit. Never returns.
fn run_node_process_from_env(raw: OsString) -> ! {
    granule_host::os::ignore_sigpipe();
    // Children of this node (e.g. helper tools) must not boot as nodes too. Still
    // single-threaded here, so changing the environment is safe.
    std::env::remove_var(BOOT_ENV);
    let outcome = std::panic::catch_unwind(|| {
        let text = raw.to_string_lossy().into_owned();
        let boot: BootPayload = match serde_json::from_str(&text) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("granule node: bad {BOOT_ENV} ({e}); this variable is set by a Granule driver, not by hand");
                return 2;
            }
        };
        // Join the node's groups first, while this is the only thread and nothing is
        // allocated yet: everything the node does from here on counts against its limits.
        if let Some(paths) = &boot.cgroups {
            if let Err(e) = granule_host::join_self(paths) {
                eprintln!(
                    "granule node {}: cannot join its cgroups ({e}); running without limits",
                    boot.index
                );
            }
        }
        // The driver holds the other end of our stdin: when it exits, for any reason
        // (even SIGKILL), we read EOF and leave.
        std::thread::Builder::new()
            .name("granule-lifeline".into())
            .spawn(|| {
                let mut buf = [0u8; 64];
                let mut stdin = std::io::stdin();
                loop {
                    match stdin.read(&mut buf) {
                        Ok(0) | Err(_) => std::process::exit(0),
                        Ok(_) => {}
                    }
                }
            })
            .ok();
        if let Some(hint) = &boot.binary_hint {
            shipping::accept_binary_hint(hint);
        }
        init_logging(&boot.config.cluster.log);
        // A driver that replaces dead nodes kills this process once it is declared dead;
        // only without one does it rejoin by itself.
        let rejoin = boot.config.cluster.rejoin && !boot.config.cluster.replace_dead;
        let index = boot.index;
        match Node::start(NodeOptions {
            role: Role::Node,
            spec: boot.spec,
            controller: boot.controller,
            config: Arc::new(boot.config),
        }) {
            Ok(node) => {
                context::offer_default_node(&node.inner);
                let reason = node.inner.wait_shutdown();
                if rejoin && node.inner.lifecycle.was_declared_dead() {
                    tracing::warn!(
                        "node {} (process {index}): {reason}; rejoining as a new node",
                        node.inner.id
                    );
                    let e = reexec(Some((BOOT_ENV, &raw)));
                    eprintln!("granule node {index}: cannot rejoin: {e}");
                    return 4;
                }
                tracing::info!("node {} leaving: {reason}", node.inner.id);
                0
            }
            Err(e) => {
                eprintln!("granule node {}: cannot start: {e}", boot.index);
                3
            }
        }
    });
    let code = outcome.unwrap_or(101);
    std::process::exit(code)
}

granule_host::before_main! {
    /// The pre-`main` hook that turns any executable linking Granule into a node when
    /// its driver starts it in node mode: that is what lets integration tests, whose
    /// `main` belongs to libtest, spawn node processes of their own binary.
    ///
    /// It keeps `before_main!`'s contract: it reads one environment variable and, only
    /// when a Granule driver started this process in node mode, hands the process over
    /// to the node loop, which never returns (it ends with `exit`). Nothing here touches
    /// std state that `main`'s start-up would set up, except SIGPIPE, which the node loop
    /// sets exactly as std would.
    fn boot_node_before_main() {
        if let Some(boot) = std::env::var_os(BOOT_ENV) {
            run_node_process_from_env(boot);
        }
    }
}
