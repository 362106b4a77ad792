//! The node processes an embedded cluster's driver starts, and their supervision.
//!
//! This module owns the driver's child processes: starting one per configured spec,
//! waiting for them to register, and, for as long as the cluster runs, a supervisor
//! thread that
//! - **reaps** every node process that ends, at once (no zombies until the driver exits);
//! - **fences** a node process the controller declared dead while it still runs (stopped,
//!   or cut off): its proclets already count as lost, so it is killed rather than left
//!   to wake up as a node nobody knows;
//! - **replaces** a node process that ended, with `cluster.replace_dead` (the default): a
//!   new process with the same spec and cgroups joins as a new node, so the cluster
//!   returns to its configured size. A slot whose processes keep dying young is retried
//!   with a growing delay (up to a minute), not in a tight loop.
//!
//! Proclets of a node that died are not brought back: a replacement starts empty (see
//! "What a failure costs" in docs/guide/concepts.md).

use crate::boot::{BootPayload, BOOT_ENV};
use crate::error::ClusterError;
use crate::node::NodeInner;
use granule_config::Config;
use granule_wire::{CgroupPaths, NodeId, NodeInfo, NodeState, Role};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use parking_lot::{Condvar, Mutex};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A process that lived shorter than this before ending counts as dying young: its slot
/// waits longer before the next replacement.
const YOUNG: Duration = Duration::from_secs(10);
/// The longest wait before replacing a slot's process again.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// One node process of the driver.
struct Spawned {
    child: Child,
    /// Which configured spec (and cgroup) it runs: `cluster.nodes[index]`.
    index: usize,
    /// The node it registered as, once it has (a process that rejoined after being
    /// declared dead registers again, under a new id).
    node: Option<NodeId>,
    started: Instant,
}

/// A slot of the configured cluster: one spec, its process's history.
#[derive(Default)]
struct Slot {
    /// Consecutive processes of this slot that died young.
    young_deaths: u32,
    /// When to start its next process (no live process and replacement on).
    respawn_at: Option<Instant>,
}

#[derive(Default)]
struct Procs {
    live: Vec<Spawned>,
    slots: Vec<Slot>,
    /// The process groups the node processes are in (the first process's, and a new one
    /// if that group was gone when a replacement started): killed as a whole at the end.
    groups: Vec<Pid>,
}

/// The driver's node processes (see the module doc).
pub(crate) struct Fleet {
    config: Arc<Config>,
    controller_addr: String,
    program: String,
    binary_hint: Option<String>,
    /// Each slot's cgroups, made once: a replacement joins its predecessor's groups.
    cgroups: Vec<Option<CgroupPaths>>,
    procs: Mutex<Procs>,
    stopping: AtomicBool,
    wake: Condvar,
    wake_lock: Mutex<()>,
    replaced: AtomicU64,
}

impl Fleet {
    pub(crate) fn new(
        config: Arc<Config>,
        controller_addr: String,
        binary_hint: Option<String>,
        cgroups: Vec<Option<CgroupPaths>>,
    ) -> Fleet {
        let program = std::env::args()
            .next()
            .unwrap_or_else(|| "granule-app".into());
        let slots = config
            .cluster
            .nodes
            .iter()
            .map(|_| Slot::default())
            .collect();
        Fleet {
            config,
            controller_addr,
            program,
            binary_hint,
            cgroups,
            procs: Mutex::new(Procs {
                slots,
                ..Procs::default()
            }),
            stopping: AtomicBool::new(false),
            wake: Condvar::new(),
            wake_lock: Mutex::new(()),
            replaced: AtomicU64::new(0),
        }
    }

    /// Start the process of slot `index`.
    fn spawn(&self, procs: &mut Procs, index: usize) -> Result<(), ClusterError> {
        let spec = self.config.cluster.nodes[index];
        let boot = BootPayload {
            controller: self.controller_addr.clone(),
            spec,
            index,
            cgroups: self.cgroups.get(index).cloned().flatten(),
            binary_hint: self.binary_hint.clone(),
            config: (*self.config).clone(),
        };
        let boot = serde_json::to_string(&boot)
            .map_err(|e| ClusterError::Spawn(format!("cannot encode the boot payload: {e}")))?;
        let command = |group: i32| {
            let mut cmd = Command::new(granule_host::proc::SELF_EXE);
            cmd.arg0(format!("{} [granule node {index}]", self.program))
                .env(BOOT_ENV, &boot)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .process_group(group);
            cmd
        };
        let spawned = match procs.groups.first() {
            None => command(0).spawn(),
            // The group is gone once all its processes are: then start a new one.
            Some(g) => command(g.as_raw()).spawn().or_else(|_| command(0).spawn()),
        };
        let child = spawned.map_err(|e| {
            ClusterError::Spawn(format!(
                "cannot start node process {index} from {}: {e}",
                granule_host::proc::SELF_EXE
            ))
        })?;
        let pid = Pid::from_raw(child.id() as i32);
        if nix::unistd::getpgid(Some(pid)).is_ok_and(|g| g == pid) {
            procs.groups.push(pid);
        }
        procs.live.push(Spawned {
            child,
            index,
            node: None,
            started: Instant::now(),
        });
        Ok(())
    }

    /// Start every configured node process and wait until all registered.
    pub(crate) fn start_all(
        &self,
        nodes: impl Fn() -> Result<Vec<NodeInfo>, String>,
    ) -> Result<(), ClusterError> {
        {
            let mut procs = self.procs.lock();
            for index in 0..self.config.cluster.nodes.len() {
                self.spawn(&mut procs, index)?;
            }
        }
        let timeout = self.config.cluster.start_timeout;
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut procs = self.procs.lock();
                for s in procs.live.iter_mut() {
                    if let Ok(Some(status)) = s.child.try_wait() {
                        return Err(ClusterError::Startup(format!(
                            "node process {} exited during start-up ({status}); its messages are above on stderr",
                            s.index
                        )));
                    }
                }
            }
            let list = nodes().map_err(ClusterError::Startup)?;
            let mut procs = self.procs.lock();
            match_registrations(&mut procs.live, &list);
            if procs.live.iter().all(|s| s.node.is_some()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                let missing: Vec<usize> = procs
                    .live
                    .iter()
                    .filter(|s| s.node.is_none())
                    .map(|s| s.index)
                    .collect();
                return Err(ClusterError::Startup(format!(
                    "node processes {missing:?} did not register within {timeout:?}"
                )));
            }
            drop(procs);
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Run the supervisor (see the module doc) until [`Fleet::stop`].
    pub(crate) fn supervise(
        self: &Arc<Fleet>,
        node: Weak<NodeInner>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let fleet = self.clone();
        std::thread::Builder::new()
            .name("granule-supervisor".into())
            .spawn(move || fleet.supervisor_loop(node))
    }

    fn supervisor_loop(&self, node: Weak<NodeInner>) {
        let c = &self.config.cluster;
        let tick = c
            .heartbeat
            .clamp(Duration::from_millis(10), Duration::from_millis(100));
        loop {
            {
                let mut g = self.wake_lock.lock();
                if !self.stopping.load(Ordering::Acquire) {
                    self.wake.wait_for(&mut g, tick);
                }
            }
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            self.reap();
            if let Some(n) = node.upgrade() {
                let n2 = n.clone();
                let deadline = Instant::now() + Duration::from_secs(5);
                let list = n.block(
                    async move { n2.controller.list_nodes().await },
                    Some(deadline),
                );
                drop(n);
                if let Some(Ok(list)) = list {
                    self.on_membership(&list);
                }
            }
            if c.replace_dead {
                self.respawn_due();
            }
        }
    }

    /// Collect every node process that ended; schedule its replacement.
    fn reap(&self) {
        let mut procs = self.procs.lock();
        let mut i = 0;
        while i < procs.live.len() {
            let status = match procs.live[i].child.try_wait() {
                Ok(Some(status)) => status,
                // Still running (or cannot tell: look again next tick).
                Ok(None) | Err(_) => {
                    i += 1;
                    continue;
                }
            };
            let s = procs.live.swap_remove(i);
            self.ended(&mut procs, s, status);
        }
    }

    fn ended(&self, procs: &mut Procs, s: Spawned, status: ExitStatus) {
        let stopping = self.stopping.load(Ordering::Acquire);
        let name = match s.node {
            Some(n) => format!("node process {} ({n}, pid {})", s.index, s.child.id()),
            None => format!("node process {} (pid {})", s.index, s.child.id()),
        };
        let slot = &mut procs.slots[s.index];
        if s.started.elapsed() < YOUNG {
            slot.young_deaths += 1;
        } else {
            slot.young_deaths = 0;
        }
        if stopping || !self.config.cluster.replace_dead {
            if !stopping {
                tracing::warn!(
                    "{name} ended ({status}); not replaced (cluster.replace_dead is off)"
                );
            }
            return;
        }
        let delay = backoff(slot.young_deaths);
        slot.respawn_at = Some(Instant::now() + delay);
        if delay.is_zero() {
            tracing::warn!("{name} ended ({status}); starting a replacement");
        } else {
            tracing::warn!(
                "{name} ended ({status}); its slot's processes keep ending young, so the \
                 replacement starts in {delay:?}"
            );
        }
    }

    /// Note which node each process registered as; kill the ones the controller
    /// declared dead (with replacement on: they are replaced once reaped).
    fn on_membership(&self, list: &[NodeInfo]) {
        let mut procs = self.procs.lock();
        match_registrations(&mut procs.live, list);
        if !self.config.cluster.replace_dead {
            return;
        }
        for s in procs.live.iter() {
            let Some(id) = s.node else { continue };
            let alive = list
                .iter()
                .any(|n| n.id == id && n.state == NodeState::Alive);
            if !alive {
                tracing::warn!(
                    "node process {} ({id}, pid {}) was declared dead: killing it so that a \
                     replacement takes its place",
                    s.index,
                    s.child.id()
                );
                let _ = kill(Pid::from_raw(s.child.id() as i32), Signal::SIGKILL);
            }
        }
    }

    fn respawn_due(&self) {
        let mut procs = self.procs.lock();
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        for index in 0..procs.slots.len() {
            if procs.slots[index].respawn_at.is_none_or(|t| t > now)
                || procs.live.iter().any(|s| s.index == index)
            {
                continue;
            }
            procs.slots[index].respawn_at = None;
            match self.spawn(&mut procs, index) {
                Ok(()) => {
                    self.replaced.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    let slot = &mut procs.slots[index];
                    slot.young_deaths += 1;
                    let delay = backoff(slot.young_deaths).max(Duration::from_secs(1));
                    slot.respawn_at = Some(now + delay);
                    tracing::error!("{e}; trying again in {delay:?}");
                }
            }
        }
    }

    /// How many replacement processes were started.
    pub(crate) fn replaced(&self) -> u64 {
        self.replaced.load(Ordering::Relaxed)
    }

    /// The live node processes that registered, as (node, pid), in slot order.
    pub(crate) fn registered(&self) -> Vec<(NodeId, u32)> {
        let procs = self.procs.lock();
        let mut v: Vec<(usize, NodeId, u32)> = procs
            .live
            .iter()
            .filter_map(|s| Some((s.index, s.node?, s.child.id())))
            .collect();
        v.sort();
        v.into_iter().map(|(_, n, p)| (n, p)).collect()
    }

    /// Whether every slot has a live process registered as a node the controller lists
    /// as alive.
    pub(crate) fn complete(&self, list: &[NodeInfo]) -> bool {
        let mut procs = self.procs.lock();
        match_registrations(&mut procs.live, list);
        (0..procs.slots.len()).all(|index| {
            procs.live.iter().any(|s| {
                s.index == index
                    && s.node.is_some_and(|id| {
                        list.iter()
                            .any(|n| n.id == id && n.state == NodeState::Alive)
                    })
            })
        })
    }

    /// Kill the process registered as `node` (SIGKILL) and collect it.
    pub(crate) fn kill(&self, node: NodeId) -> Result<(), ClusterError> {
        let mut procs = self.procs.lock();
        let s = procs
            .live
            .iter_mut()
            .find(|s| s.node == Some(node))
            .ok_or_else(|| {
                ClusterError::Config(format!("{node} is not a live node this driver started"))
            })?;
        let _ = s.child.kill();
        let _ = s.child.wait();
        Ok(())
    }

    /// Stop supervising and kill every node process (and anything in their groups).
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        {
            let _g = self.wake_lock.lock();
            self.wake.notify_all();
        }
        let mut procs = self.procs.lock();
        for g in procs.groups.drain(..) {
            let _ = killpg(g, Signal::SIGKILL);
        }
        for s in procs.live.iter_mut() {
            let _ = kill(Pid::from_raw(s.child.id() as i32), Signal::SIGKILL);
            let _ = s.child.wait();
        }
        procs.live.clear();
    }
}

/// Match live processes to the nodes they registered as (by pid: the newest alive node
/// of a process that rejoined wins).
fn match_registrations(live: &mut [Spawned], list: &[NodeInfo]) {
    for s in live.iter_mut() {
        let newest = list
            .iter()
            .filter(|n| {
                n.pid == s.child.id() && n.role == Role::Node && n.state == NodeState::Alive
            })
            .map(|n| n.id)
            .max();
        if newest.is_some() {
            s.node = newest;
        }
    }
}

/// The wait before replacing a slot whose last `young_deaths` processes died young: none
/// for the first, then 1 s, doubling up to [`MAX_BACKOFF`].
fn backoff(young_deaths: u32) -> Duration {
    match young_deaths {
        0 | 1 => Duration::ZERO,
        n => Duration::from_secs(1u64 << (n - 2).min(6)).min(MAX_BACKOFF),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_that_keeps_dying_young_waits_longer_up_to_a_minute() {
        assert_eq!(backoff(0), Duration::ZERO);
        assert_eq!(backoff(1), Duration::ZERO);
        assert_eq!(backoff(2), Duration::from_secs(1));
        assert_eq!(backoff(3), Duration::from_secs(2));
        assert_eq!(backoff(7), Duration::from_secs(32));
        assert_eq!(backoff(8), MAX_BACKOFF);
        assert_eq!(backoff(100), MAX_BACKOFF);
    }
}
