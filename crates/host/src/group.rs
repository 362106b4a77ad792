//! Creating, joining and removing the groups of a local cluster.

use crate::hierarchy::{Controller, Hierarchy};
use crate::procfs::process_start_time;
use crate::{CgroupError, ANTAGONIST_DIR, GRANULE_DIR, MIN_CFS_QUOTA_US};
use granule_wire::CgroupPaths;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long removal waits for killed tasks to leave a group before giving up on it.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(3);

/// Clusters this process created groups for: one process may run several clusters at
/// once (tests do), and each must remove only its own nodes' groups.
static CLUSTER_SEQ: AtomicU32 = AtomicU32::new(0);

/// The groups of one local cluster: `granule/<name>` in the memory and cpu hierarchies,
/// with one [`NodeGroup`] per node process below.
///
/// The name is `c<pid>-<start>-<n>`: the driver's pid, its start time in clock ticks
/// (`/proc/<pid>/stat` field 22, so a reused pid is not mistaken for a live driver) and
/// a per-process sequence number. [`cleanup_stale`] removes clusters whose driver is gone.
///
/// Removal (explicit, or on drop) kills whatever still runs inside and deletes every
/// directory below the cluster's, bottom-up.
#[derive(Debug)]
pub struct ClusterGroups {
    h: Hierarchy,
    name: String,
    /// The CFS period of the node groups made from here, microseconds.
    period_us: u64,
    removed: bool,
}

impl ClusterGroups {
    /// Create the groups of a new cluster driven by this process.
    pub fn new(h: &Hierarchy) -> Result<ClusterGroups, CgroupError> {
        let pid = std::process::id();
        let start = process_start_time(pid).ok_or_else(|| CgroupError::Parse {
            path: PathBuf::from("/proc/self/stat"),
            text: "no start time".into(),
        })?;
        let seq = CLUSTER_SEQ.fetch_add(1, Ordering::Relaxed);
        ClusterGroups::named(h, format!("c{pid}-{start}-{seq}"))
    }

    /// Create the groups under an explicit name (which [`cleanup_stale`] will judge by
    /// the pid and start time it encodes, if it has the `c<pid>-<start>[-<n>]` shape).
    pub fn named(h: &Hierarchy, name: String) -> Result<ClusterGroups, CgroupError> {
        check_name(&name)?;
        let g = ClusterGroups {
            h: h.clone(),
            name,
            period_us: crate::CFS_PERIOD_US,
            removed: false,
        };
        for c in Controller::ALL {
            let dir = g.dir(c);
            std::fs::create_dir_all(&dir).map_err(|e| CgroupError::io("create", dir, e))?;
        }
        Ok(g)
    }

    /// The cluster's directory name below `granule/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn hierarchy(&self) -> &Hierarchy {
        &self.h
    }

    /// The cluster's directory in one controller's hierarchy.
    pub fn dir(&self, c: Controller) -> PathBuf {
        self.h.controller_dir(c).join(GRANULE_DIR).join(&self.name)
    }

    /// The CFS period of the node groups made from now on (clamped to the kernel's
    /// 1 ms..=1 s; default [`crate::CFS_PERIOD_US`]).
    pub fn set_cfs_period(&mut self, period: std::time::Duration) {
        self.period_us = (period.as_micros() as u64).clamp(1_000, 1_000_000);
    }

    /// Create the group of one node of this cluster (see [`NodeGroup::create`]).
    pub fn node(&self, node: &str, cores: f64, mem_bytes: u64) -> Result<NodeGroup, CgroupError> {
        NodeGroup::create(&self.h, &self.name, node, cores, mem_bytes, self.period_us)
    }

    /// Kill anything still inside and remove every directory of the cluster.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.remove_all()
    }

    fn remove_all(&mut self) -> Result<(), CgroupError> {
        self.removed = true;
        let mut first_err = None;
        for c in Controller::ALL {
            if let Err(e) = remove_tree(&self.dir(c)) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for ClusterGroups {
    fn drop(&mut self) {
        if !self.removed {
            if let Err(e) = self.remove_all() {
                tracing::warn!("cannot remove cgroups of cluster {}: {e}", self.name);
            }
        }
    }
}

/// One node's groups: `granule/<cluster>/<node>` in the memory and cpu hierarchies.
///
/// It does not remove itself: its cluster's [`ClusterGroups`] does, after the node
/// processes have exited.
#[derive(Clone, Debug)]
pub struct NodeGroup {
    h: Hierarchy,
    rel: String,
}

impl NodeGroup {
    /// Create (or reuse) the node's groups and set their limits: `memory.limit_in_bytes`
    /// = `mem_bytes`, a CFS period of `period_us` and a quota of `cores` periods (at
    /// least 1 ms, the kernel's minimum).
    pub fn create(
        h: &Hierarchy,
        cluster: &str,
        node: &str,
        cores: f64,
        mem_bytes: u64,
        period_us: u64,
    ) -> Result<NodeGroup, CgroupError> {
        check_name(cluster)?;
        check_name(node)?;
        if !(cores.is_finite() && cores > 0.0) {
            return Err(CgroupError::BadPath {
                path: node.to_string(),
                why: "cores must be a positive number",
            });
        }
        let g = NodeGroup {
            h: h.clone(),
            rel: format!("/{GRANULE_DIR}/{cluster}/{node}"),
        };
        let mem = g.dir(Controller::Memory)?;
        let cpu = g.dir(Controller::Cpu)?;
        for dir in [&mem, &cpu] {
            std::fs::create_dir_all(dir).map_err(|e| CgroupError::io("create", dir, e))?;
        }
        write_value(&mem.join("memory.limit_in_bytes"), mem_bytes)?;
        // The period first: the quota is validated against it.
        write_value(&cpu.join("cpu.cfs_period_us"), period_us)?;
        write_value(&cpu.join("cpu.cfs_quota_us"), quota_us(cores, period_us))?;
        Ok(g)
    }

    /// Move a process (all its threads) into both groups.
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        join_pid(&self.h, pid, &self.paths())
    }

    /// The group paths as `/proc/<pid>/cgroup` shows them (`/granule/<cluster>/<node>`).
    pub fn paths(&self) -> CgroupPaths {
        CgroupPaths {
            memory: Some(self.rel.clone()),
            cpu: Some(self.rel.clone()),
        }
    }

    /// The group's directory in one controller's hierarchy.
    pub fn dir(&self, c: Controller) -> Result<PathBuf, CgroupError> {
        self.h.group_dir(c, &self.rel)
    }
}

/// The CFS quota for `cores` cores at the node groups' period.
pub(crate) fn quota_us(cores: f64, period_us: u64) -> u64 {
    ((cores * period_us as f64).round() as u64).max(MIN_CFS_QUOTA_US)
}

/// Move process `pid` into the groups `paths` names (a `None` field leaves that
/// controller alone). Writing to `cgroup.procs` moves every thread of the process.
pub fn join_pid(h: &Hierarchy, pid: u32, paths: &CgroupPaths) -> Result<(), CgroupError> {
    for (c, rel) in [
        (Controller::Memory, &paths.memory),
        (Controller::Cpu, &paths.cpu),
    ] {
        if let Some(rel) = rel {
            let dir = h.group_dir(c, rel)?;
            if !dir.is_dir() {
                return Err(CgroupError::io(
                    "join",
                    dir,
                    std::io::Error::new(
                        ErrorKind::NotFound,
                        "no such cgroup (is the node on this machine, and still running?)",
                    ),
                ));
            }
            write_value(&dir.join("cgroup.procs"), pid)?;
        }
    }
    Ok(())
}

/// Move this process into the groups `paths` names, in the system hierarchy.
pub fn join_self(paths: &CgroupPaths) -> Result<(), CgroupError> {
    join_pid(&Hierarchy::default(), std::process::id(), paths)
}

/// Remove the groups of clusters whose driver is gone (and of antagonists and pushdown
/// pools of processes that died without removing theirs, e.g. OOM-killed ones): for every `granule/c<pid>-<start>...`
/// whose pid is not a process started at `<start>`, kill what still runs inside and
/// remove it. Cpusets of a process that is gone (`cpuset/granule/s<pid>-<start>-<n>`) are
/// removed too, their tasks moved out rather than killed. Returns the directories
/// removed. Names it cannot parse are left alone.
pub fn cleanup_stale(h: &Hierarchy) -> Vec<String> {
    let mut removed = Vec::new();
    for c in Controller::ALL {
        sweep(&h.controller_dir(c).join(GRANULE_DIR), 'c', &mut removed);
    }
    sweep(
        &h.controller_dir(Controller::Cpu).join(ANTAGONIST_DIR),
        'a',
        &mut removed,
    );
    sweep(
        &h.controller_dir(Controller::Cpu).join(crate::PUSHDOWN_DIR),
        'p',
        &mut removed,
    );
    crate::cpuset::sweep_stale(h, &mut removed);
    removed
}

/// Remove the groups in `parent` named `<prefix><pid>-<start>[-<n>]` whose process is
/// gone, adding their paths to `removed`.
pub(crate) fn sweep(parent: &Path, prefix: char, removed: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((pid, start)) = name.to_str().and_then(|n| parse_owner(n, prefix)) else {
            continue;
        };
        if process_start_time(pid) == Some(start) {
            continue;
        }
        let dir = entry.path();
        match remove_tree(&dir) {
            Ok(()) => removed.push(dir.display().to_string()),
            Err(e) => tracing::warn!("cannot remove stale cgroup {}: {e}", dir.display()),
        }
    }
}

/// `(pid, start)` from a name `<prefix><pid>-<start>` or `<prefix><pid>-<start>-<n>`.
pub(crate) fn parse_owner(name: &str, prefix: char) -> Option<(u32, u64)> {
    let rest = name.strip_prefix(prefix)?;
    let mut parts = rest.split('-');
    let pid = parts.next()?.parse().ok()?;
    let start = parts.next()?.parse().ok()?;
    match (parts.next(), parts.next()) {
        (None, _) => Some((pid, start)),
        (Some(n), None) if n.parse::<u32>().is_ok() => Some((pid, start)),
        _ => None,
    }
}

/// A group name must be one directory name.
pub(crate) fn check_name(name: &str) -> Result<(), CgroupError> {
    let why = if name.is_empty() {
        "empty name"
    } else if name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        "not a single directory name"
    } else {
        return Ok(());
    };
    Err(CgroupError::BadPath {
        path: name.to_string(),
        why,
    })
}

pub(crate) fn write_value(path: &Path, value: impl std::fmt::Display) -> Result<(), CgroupError> {
    std::fs::write(path, value.to_string()).map_err(|e| CgroupError::io("write", path, e))
}

/// The processes in a group (empty if the group is gone).
pub(crate) fn group_pids(dir: &Path) -> Result<Vec<u32>, CgroupError> {
    let path = dir.join("cgroup.procs");
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(text
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(CgroupError::io("read", path, e)),
    }
}

/// Remove a group and everything below it, bottom-up: a cgroup directory goes away with
/// rmdir alone (its files are the kernel's), once it has no child groups and no tasks.
/// Tasks still inside are killed (SIGKILL) — never this process, which is reported as
/// [`CgroupError::Busy`] instead. A directory already gone is fine: another cleaner may
/// have been faster.
pub(crate) fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CgroupError::io("list", dir, e)),
    };
    let mut first_err = None;
    for entry in entries.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            if let Err(e) = remove_tree(&entry.path()) {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let me = std::process::id();
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        let pids = group_pids(dir)?;
        if pids.contains(&me) {
            return Err(CgroupError::Busy {
                path: dir.to_path_buf(),
                pids,
            });
        }
        for &pid in &pids {
            if let Ok(p) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
        }
        if pids.is_empty() {
            match std::fs::remove_dir(dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
                // EBUSY: a task is still on its way out (or one just joined).
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EBUSY as i32) => {}
                Err(e) => return Err(CgroupError::io("remove", dir, e)),
            }
        }
        if Instant::now() > deadline {
            return Err(CgroupError::Busy {
                path: dir.to_path_buf(),
                pids,
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs::paths_of;
    use crate::reader::Reader;
    use std::process::{Child, Command};

    #[test]
    fn owner_names() {
        assert_eq!(parse_owner("c12-345", 'c'), Some((12, 345)));
        assert_eq!(parse_owner("c12-345-7", 'c'), Some((12, 345)));
        assert_eq!(parse_owner("a12-345", 'a'), Some((12, 345)));
        for bad in [
            "c12",
            "x12-345",
            "c12-345-7-8",
            "c-1-2",
            "c12-abc",
            "c12-345-x",
            "node0",
        ] {
            assert_eq!(parse_owner(bad, 'c'), None, "{bad}");
        }
    }

    #[test]
    fn quotas() {
        assert_eq!(quota_us(1.0, 20_000), 20_000);
        assert_eq!(quota_us(2.5, 20_000), 50_000);
        assert_eq!(quota_us(0.001, 20_000), MIN_CFS_QUOTA_US);
    }

    /// Limits are written where they belong (a fake tree: plain files stand in for the
    /// kernel's).
    #[test]
    fn node_limits_in_a_fake_tree() {
        let t = tempfile::tempdir().unwrap();
        let h = Hierarchy::at(t.path());
        let g =
            NodeGroup::create(&h, "c1-2-0", "node0", 1.5, 256 << 20, crate::CFS_PERIOD_US).unwrap();
        let read = |p: &str| std::fs::read_to_string(t.path().join(p)).unwrap();
        assert_eq!(
            read("memory/granule/c1-2-0/node0/memory.limit_in_bytes"),
            (256u64 << 20).to_string()
        );
        assert_eq!(read("cpu/granule/c1-2-0/node0/cpu.cfs_period_us"), "20000");
        assert_eq!(read("cpu/granule/c1-2-0/node0/cpu.cfs_quota_us"), "30000");
        assert_eq!(g.paths().memory.as_deref(), Some("/granule/c1-2-0/node0"));
        assert!(
            NodeGroup::create(&h, "c1-2-0", "../x", 1.0, 1 << 20, crate::CFS_PERIOD_US).is_err()
        );
        assert!(NodeGroup::create(&h, "c1-2-0", "n", 0.0, 1 << 20, crate::CFS_PERIOD_US).is_err());
    }

    /// The real hierarchy, or why these tests are skipped.
    fn real() -> Option<Hierarchy> {
        match Hierarchy::detect() {
            Ok(h) => Some(h),
            Err(e) => {
                eprintln!("skipping a real-cgroup test: {e}");
                None
            }
        }
    }

    /// Kills and reaps the child when dropped, so a failed assertion leaves nothing.
    struct Reaped(Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn a_real_node_group_limits_a_child() {
        let Some(h) = real() else { return };
        let cluster = ClusterGroups::new(&h).unwrap();
        let node = cluster.node("node0", 0.5, 64 << 20).unwrap();
        let mut child = Reaped(Command::new("sleep").arg("5").spawn().unwrap());
        node.join(child.0.id()).unwrap();
        assert_eq!(paths_of(child.0.id()), Some(node.paths()));

        let r = Reader::for_paths(&h, &node.paths()).unwrap();
        assert_eq!(r.memory_limit().unwrap(), 64 << 20);
        assert_eq!(r.cfs_quota_cores().unwrap(), Some(0.5));
        assert_eq!(r.oom_kills().unwrap(), 0);
        let _ = r.memory_usage().unwrap();
        let _ = r.cpu_stat().unwrap();

        // Removal kills what is still inside (the sleep) and leaves no directory.
        let dirs: Vec<PathBuf> = Controller::ALL.iter().map(|&c| cluster.dir(c)).collect();
        cluster.remove().unwrap();
        for d in dirs {
            assert!(!d.exists(), "{} is left", d.display());
        }
        let status = child.0.wait().unwrap();
        assert!(!status.success(), "the sleep was killed: {status}");
    }

    #[test]
    fn stale_clusters_are_removed_live_ones_kept() {
        let Some(h) = real() else { return };
        // Our own pid with a start time that is not ours: a previous process that had
        // this pid. Its groups hold a process still (an orphaned node, as it were).
        let me = std::process::id();
        let stale = ClusterGroups::named(&h, format!("c{me}-1-99")).unwrap();
        let node = stale.node("node0", 1.0, 64 << 20).unwrap();
        let mut child = Reaped(Command::new("sleep").arg("5").spawn().unwrap());
        node.join(child.0.id()).unwrap();
        // The group of an antagonist whose process is gone (a reaped child's pid).
        let mut gone = Command::new("true").spawn().unwrap();
        let dead_pid = gone.id();
        gone.wait().unwrap();
        let ant = h
            .controller_dir(Controller::Cpu)
            .join(ANTAGONIST_DIR)
            .join(format!("a{dead_pid}-2"));
        std::fs::create_dir_all(&ant).unwrap();
        let live = ClusterGroups::new(&h).unwrap();

        let removed = cleanup_stale(&h);
        let stale_dirs: Vec<PathBuf> = Controller::ALL.iter().map(|&c| stale.dir(c)).collect();
        for d in &stale_dirs {
            assert!(!d.exists(), "{} is left", d.display());
            assert!(removed.contains(&d.display().to_string()), "{removed:?}");
        }
        assert!(!ant.exists());
        for c in Controller::ALL {
            assert!(live.dir(c).exists(), "a live cluster's groups are kept");
        }
        assert!(!child.0.wait().unwrap().success(), "its task was killed");
        drop(stale); // already gone: dropping is a no-op
        live.remove().unwrap();
    }
}
