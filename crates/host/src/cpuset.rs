//! cpuset groups Granule creates for itself, to pin processes to CPUs (the benchmarks pin
//! node k to vCPU k this way: unlike thread affinity, a cpuset also holds the threads a
//! process starts later, and the kernel keeps it when the process changes its own
//! affinity).
//!
//! A [`CpusetGroup`] is `cpuset/granule/s<pid>-<start>-<n>` in the v1 cpuset hierarchy,
//! with groups below it ([`Cpuset`], e.g. one per vCPU). Removing it (explicitly or on
//! drop) moves the processes still inside back to the cpuset each came from (the root
//! when that is gone) and deletes the directories: a cpuset only pins, so unlike a
//! node's memory and cpu groups it never kills what runs inside. [`crate::cleanup_stale`]
//! removes the groups of a process that died without removing its own, the same way.
//! Nothing outside `cpuset/granule/s*` is ever written, except the `cgroup.procs` of the
//! groups processes go back to.

use crate::file::{read_text, write_text};
use crate::group::{check_name, parse_owner};
use crate::hierarchy::{Controller, Hierarchy};
use crate::procfs::{proc_cgroup_text, process_start_time, v1_path};
use crate::{CgroupError, GRANULE_DIR};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Prefix of the cpuset groups' names (`s<pid>-<start>-<n>`).
pub(crate) const PREFIX: char = 's';

/// How long removal retries a directory whose last task is still on its way out.
const RMDIR_TIMEOUT: Duration = Duration::from_secs(2);

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Processes this group's tree moved, and the cpuset (path) each came from.
type Joined = Arc<Mutex<Vec<(u32, String)>>>;

/// A cpuset group of this process's own, with groups below it; removed with everything
/// below on drop (see the module doc).
#[derive(Debug)]
pub struct CpusetGroup {
    h: Hierarchy,
    top: Cpuset,
    removed: bool,
}

/// One cpuset group of a [`CpusetGroup`]'s tree (the top one or one below it).
#[derive(Clone, Debug)]
pub struct Cpuset {
    h: Hierarchy,
    rel: String,
    joined: Joined,
}

impl CpusetGroup {
    /// Create a group with the CPUs `cpus` (a kernel CPU list: `0-1`, `0,2`) and the
    /// memory nodes `mems` (`None`: all the parent has).
    pub fn create(
        h: &Hierarchy,
        cpus: &str,
        mems: Option<&str>,
    ) -> Result<CpusetGroup, CgroupError> {
        let pid = std::process::id();
        let start = process_start_time(pid).ok_or_else(|| CgroupError::Parse {
            path: PathBuf::from(format!("/proc/{pid}/stat")),
            text: "no start time".into(),
        })?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let parent = format!("/{GRANULE_DIR}");
        let root = h.controller_dir(Controller::Cpuset);
        if !h.has(Controller::Cpuset) {
            return Err(CgroupError::io(
                "use",
                root,
                std::io::Error::new(
                    ErrorKind::NotFound,
                    "the cgroup v1 cpuset controller is not mounted",
                ),
            ));
        }
        // `granule/` itself needs CPUs and memory nodes before any group below it can.
        make_cpuset(&h.group_dir(Controller::Cpuset, &parent)?, None, None)?;
        let g = CpusetGroup {
            h: h.clone(),
            top: Cpuset {
                h: h.clone(),
                rel: format!("{parent}/{PREFIX}{pid}-{start}-{seq}"),
                joined: Arc::default(),
            },
            removed: false,
        };
        // From here on a failure removes what was made (on drop).
        make_cpuset(&g.top.dir()?, Some(cpus), mems)?;
        Ok(g)
    }

    /// A group below this one with the CPUs `cpus` (a subset of this group's) and all of
    /// its memory nodes; removed with this group.
    pub fn child(&self, name: &str, cpus: &str) -> Result<Cpuset, CgroupError> {
        check_name(name)?;
        let c = Cpuset {
            h: self.h.clone(),
            rel: format!("{}/{name}", self.top.rel),
            joined: self.top.joined.clone(),
        };
        make_cpuset(&c.dir()?, Some(cpus), None)?;
        Ok(c)
    }

    /// The top group.
    pub fn cpuset(&self) -> &Cpuset {
        &self.top
    }

    /// Move process `pid` (all its threads) into the top group.
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        self.top.join(pid)
    }

    /// Move the processes still inside back where they came from and delete every
    /// directory of the tree.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.remove_all()
    }

    fn remove_all(&mut self) -> Result<(), CgroupError> {
        self.removed = true;
        let back = lock(&self.top.joined).clone();
        remove_moving_out(&self.h, &self.top.dir()?, &back)
    }
}

impl Drop for CpusetGroup {
    fn drop(&mut self) {
        if !self.removed {
            if let Err(e) = self.remove_all() {
                tracing::warn!("cannot remove cpuset {}: {e}", self.top.rel);
            }
        }
    }
}

impl Cpuset {
    /// The group's path as `/proc/<pid>/cgroup` shows it.
    pub fn rel(&self) -> &str {
        &self.rel
    }

    /// The group's directory.
    pub fn dir(&self) -> Result<PathBuf, CgroupError> {
        self.h.group_dir(Controller::Cpuset, &self.rel)
    }

    /// Move process `pid` (all its threads) into this group.
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        let previous = proc_cgroup_text(pid)
            .and_then(|t| v1_path(&t, Controller::Cpuset.name()))
            .unwrap_or_else(|| "/".into());
        let procs = self.dir()?.join("cgroup.procs");
        write_text(&procs, &pid.to_string())?;
        let mut joined = lock(&self.joined);
        if !joined.iter().any(|(p, _)| *p == pid) {
            joined.push((pid, previous));
        }
        Ok(())
    }

    /// The group's CPUs as the kernel lists them.
    pub fn cpus(&self) -> Result<String, CgroupError> {
        Ok(read_text(&self.dir()?.join("cpuset.cpus"))?
            .trim()
            .to_string())
    }
}

/// The list of joined processes (a panic while it was held leaves it usable: it is a
/// plain list).
fn lock(j: &Joined) -> MutexGuard<'_, Vec<(u32, String)>> {
    j.lock().unwrap_or_else(|e| e.into_inner())
}

/// Create a cpuset directory (if it does not exist) and give it CPUs and memory nodes:
/// those asked for, or where none are asked and it has none yet, all of its parent's.
fn make_cpuset(dir: &Path, cpus: Option<&str>, mems: Option<&str>) -> Result<(), CgroupError> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CgroupError::io("create", dir, e)),
    }
    let parent = dir.parent().unwrap_or(dir);
    for (file, asked) in [("cpuset.cpus", cpus), ("cpuset.mems", mems)] {
        let value = match asked {
            Some(v) => v.to_string(),
            None => {
                let own = read_text(&dir.join(file))?;
                if !own.trim().is_empty() {
                    continue;
                }
                read_text(&parent.join(file))?.trim().to_string()
            }
        };
        write_text(&dir.join(file), &value)?;
    }
    Ok(())
}

/// Remove a cpuset tree bottom-up: processes inside go back to the cpuset `back` names
/// for them (or to the root), then the directory goes. Never kills anything.
pub(crate) fn remove_moving_out(
    h: &Hierarchy,
    dir: &Path,
    back: &[(u32, String)],
) -> Result<(), CgroupError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CgroupError::io("list", dir, e)),
    };
    for entry in entries.flatten() {
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            remove_moving_out(h, &entry.path(), back)?;
        }
    }
    let root = h.controller_dir(Controller::Cpuset);
    let deadline = Instant::now() + RMDIR_TIMEOUT;
    loop {
        for pid in crate::group::group_pids(dir)? {
            let to = back
                .iter()
                .find(|(p, _)| *p == pid)
                .and_then(|(_, rel)| h.group_dir(Controller::Cpuset, rel).ok())
                .filter(|d| d.is_dir() && !d.starts_with(dir))
                .unwrap_or_else(|| root.clone());
            // A process that exits meanwhile cannot be moved, and need not be.
            let _ = write_text(&to.join("cgroup.procs"), &pid.to_string());
        }
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(CgroupError::io("remove", dir, e)),
        }
    }
}

/// Remove the cpuset groups under `cpuset/granule/` of processes that are gone (moving any
/// process still inside to the root cpuset). Returns the directories removed.
pub(crate) fn sweep_stale(h: &Hierarchy, removed: &mut Vec<String>) {
    let parent = h.controller_dir(Controller::Cpuset).join(GRANULE_DIR);
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((pid, start)) = name.to_str().and_then(|n| parse_owner(n, PREFIX)) else {
            continue;
        };
        if process_start_time(pid) == Some(start) {
            continue;
        }
        let dir = entry.path();
        match remove_moving_out(h, &dir, &[]) {
            Ok(()) => removed.push(dir.display().to_string()),
            Err(e) => tracing::warn!("cannot remove stale cpuset {}: {e}", dir.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::process::{Child, Command};

    /// A fake cpuset mount: a directory whose CPU and memory lists are plain files (the
    /// kernel's appear in every new directory; here `make_cpuset` creates them).
    #[test]
    fn groups_get_cpus_and_mems_in_a_fake_tree() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("cpuset");
        fs::create_dir_all(&root).unwrap();
        fs::write(root.join("cpuset.cpus"), "0-3\n").unwrap();
        fs::write(root.join("cpuset.mems"), "0\n").unwrap();
        // A fake tree has no kernel files in new directories: seed them empty, as the
        // kernel does, by creating the granule directory first.
        fs::create_dir_all(root.join("granule")).unwrap();
        fs::write(root.join("granule/cpuset.cpus"), "").unwrap();
        fs::write(root.join("granule/cpuset.mems"), "").unwrap();
        make_cpuset(&root.join("granule"), None, None).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("granule/cpuset.cpus")).unwrap(),
            "0-3"
        );
        assert_eq!(
            fs::read_to_string(root.join("granule/cpuset.mems")).unwrap(),
            "0"
        );
        // Asked-for values are written as given.
        let g = root.join("granule/x");
        fs::create_dir_all(&g).unwrap();
        make_cpuset(&g, Some("1"), Some("0")).unwrap();
        assert_eq!(fs::read_to_string(g.join("cpuset.cpus")).unwrap(), "1");
        // Already set: kept.
        make_cpuset(&root.join("granule"), None, None).unwrap();
        assert_eq!(
            fs::read_to_string(root.join("granule/cpuset.cpus")).unwrap(),
            "0-3"
        );
    }

    struct Reaped(Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn real() -> Option<Hierarchy> {
        let h = Hierarchy::default();
        let usable = h.has(Controller::Cpuset)
            && nix::unistd::access(
                &h.controller_dir(Controller::Cpuset),
                nix::unistd::AccessFlags::W_OK,
            )
            .is_ok();
        if !usable {
            eprintln!("skipping a real-cpuset test: no writable cgroup v1 cpuset hierarchy");
            return None;
        }
        Some(h)
    }

    #[test]
    fn a_process_is_pinned_and_let_go() {
        let Some(h) = real() else { return };
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        let g = CpusetGroup::create(&h, &format!("0-{}", ncpu - 1), None).unwrap();
        let vcpu0 = g.child("vcpu0", "0").unwrap();
        assert_eq!(vcpu0.cpus().unwrap(), "0");
        let child = Reaped(Command::new("sleep").arg("5").spawn().unwrap());
        let pid = child.0.id();
        let before = v1_path(&proc_cgroup_text(pid).unwrap(), "cpuset").unwrap();
        vcpu0.join(pid).unwrap();
        assert_eq!(
            v1_path(&proc_cgroup_text(pid).unwrap(), "cpuset").as_deref(),
            Some(vcpu0.rel())
        );
        assert_eq!(crate::os::affinity(pid as i32).unwrap(), vec![0]);
        let dir = g.cpuset().dir().unwrap();
        g.remove().unwrap();
        assert!(!dir.exists());
        // Still alive, back where it was.
        assert!(!crate::proc::process_gone(pid));
        assert_eq!(
            v1_path(&proc_cgroup_text(pid).unwrap(), "cpuset"),
            Some(before)
        );
        assert!(CpusetGroup::create(&h, "0", None)
            .unwrap()
            .child("../x", "0")
            .is_err());
    }

    #[test]
    fn stale_cpusets_are_swept() {
        let Some(h) = real() else { return };
        // A group named for this pid with another start time: a dead process's.
        let me = std::process::id();
        let dir = h
            .group_dir(Controller::Cpuset, &format!("/{GRANULE_DIR}/s{me}-1-0"))
            .unwrap();
        make_cpuset(
            &h.group_dir(Controller::Cpuset, &format!("/{GRANULE_DIR}"))
                .unwrap(),
            None,
            None,
        )
        .unwrap();
        make_cpuset(&dir, Some("0"), None).unwrap();
        let live = CpusetGroup::create(&h, "0", None).unwrap();
        let removed = crate::cleanup_stale(&h);
        assert!(!dir.exists());
        assert!(removed.contains(&dir.display().to_string()), "{removed:?}");
        assert!(
            live.cpuset().dir().unwrap().exists(),
            "a live group is kept"
        );
    }
}
