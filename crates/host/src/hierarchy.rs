//! The cgroup v1 mount root, whether Granule may make its own groups in it, and where a
//! group's directory is.

use crate::CgroupError;
use nix::unistd::AccessFlags;
use std::fmt;
use std::path::{Path, PathBuf};

/// Where cgroup v1 controllers are mounted on every mainstream distribution.
pub const DEFAULT_ROOT: &str = "/sys/fs/cgroup";

/// The cgroup v1 controllers Granule uses: memory and cpu limit its node groups; cpuset
/// pins processes to CPUs (benchmarks); cpuacct counts CPU time per CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Controller {
    Memory,
    Cpu,
    Cpuset,
    Cpuacct,
}

impl Controller {
    /// The controllers every node group has (and [`Hierarchy::detect`] requires).
    pub const ALL: [Controller; 2] = [Controller::Memory, Controller::Cpu];

    /// The controller's name, as in `/proc/<pid>/cgroup` and as its mount directory.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
            Controller::Cpuset => "cpuset",
            Controller::Cpuacct => "cpuacct",
        }
    }

    /// A file only a usable v1 mount of this controller has (for cpu: CFS bandwidth
    /// control, which kernels built without CONFIG_CFS_BANDWIDTH lack).
    fn probe_file(self) -> &'static str {
        match self {
            Controller::Memory => "memory.limit_in_bytes",
            Controller::Cpu => "cpu.cfs_quota_us",
            Controller::Cpuset => "cpuset.cpus",
            Controller::Cpuacct => "cpuacct.usage",
        }
    }
}

impl fmt::Display for Controller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why cgroup limits cannot be used here, in words for a log line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
pub struct Unavailable {
    pub reason: String,
}

impl Unavailable {
    fn new(reason: impl Into<String>) -> Self {
        Unavailable {
            reason: reason.into(),
        }
    }
}

/// A cgroup v1 mount root: the directory holding one mount per controller
/// (`<root>/memory`, `<root>/cpu`; `cpu` is often a symlink to `cpu,cpuacct`, which is
/// followed like any directory).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hierarchy {
    root: PathBuf,
}

impl Default for Hierarchy {
    fn default() -> Self {
        Hierarchy::at(DEFAULT_ROOT)
    }
}

impl Hierarchy {
    /// A hierarchy at `root`, unchecked (tests point this at a fake tree in a tempdir).
    pub fn at(root: impl Into<PathBuf>) -> Hierarchy {
        Hierarchy { root: root.into() }
    }

    /// The system hierarchy, if Granule can create groups in it.
    pub fn detect() -> Result<Hierarchy, Unavailable> {
        Hierarchy::detect_at(DEFAULT_ROOT)
    }

    /// The hierarchy at `root`, if it has v1 memory and cpu controllers this process may
    /// create groups in. Checks only; creates nothing.
    pub fn detect_at(root: impl Into<PathBuf>) -> Result<Hierarchy, Unavailable> {
        let h = Hierarchy::at(root);
        if !h.root.is_dir() {
            return Err(Unavailable::new(format!(
                "no cgroup file system at {}",
                h.root.display()
            )));
        }
        // A unified (v2) mount at the root has this file; v1 roots are a tmpfs of mounts.
        // Granule makes its node groups with v1 only; v2 groups can still be read, and
        // adjusted as foreign groups (`ForeignGroup`).
        if h.root.join("cgroup.controllers").exists() {
            return Err(Unavailable::new(format!(
                "{} is a cgroup v2 (unified) hierarchy; Granule makes its node groups with the cgroup v1 memory and cpu controllers",
                h.root.display()
            )));
        }
        for c in Controller::ALL {
            let dir = h.controller_dir(c);
            if !dir.join(c.probe_file()).is_file() {
                return Err(Unavailable::new(if dir.is_dir() && c == Controller::Cpu {
                    format!(
                        "{} has no {} (kernel without CFS bandwidth control)",
                        dir.display(),
                        c.probe_file()
                    )
                } else {
                    format!(
                        "the cgroup v1 {c} controller is not mounted at {}",
                        dir.display()
                    )
                }));
            }
        }
        for c in Controller::ALL {
            let dir = h.controller_dir(c);
            // access(2) judges with the effective uid and also reports read-only mounts,
            // so this is exactly "could mkdir here" without creating anything.
            if let Err(e) = nix::unistd::access(&dir, AccessFlags::W_OK) {
                let euid = nix::unistd::geteuid();
                return Err(Unavailable::new(if !euid.is_root() {
                    format!("cgroup v1 not writable: not root (euid {euid})")
                } else {
                    format!("cgroup v1 not writable: {}: {}", dir.display(), e.desc())
                }));
            }
        }
        Ok(h)
    }

    /// The mount root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where a controller is mounted (`<root>/memory`, `<root>/cpu`).
    pub fn controller_dir(&self, c: Controller) -> PathBuf {
        self.root.join(c.name())
    }

    /// Whether controller `c` is mounted here (readable; says nothing of writing).
    pub fn has(&self, c: Controller) -> bool {
        self.controller_dir(c).join(c.probe_file()).is_file()
    }

    /// The directory of the group `rel` (as `/proc/<pid>/cgroup` names it, e.g.
    /// `/granule/c1-2-0/node0`) in controller `c`. Refuses paths that could leave the
    /// hierarchy: they may come from the network (a node's reported cgroups).
    pub fn group_dir(&self, c: Controller, rel: &str) -> Result<PathBuf, CgroupError> {
        join_group(self.controller_dir(c), rel)
    }
}

/// `base` joined with a group path as `/proc/<pid>/cgroup` names it, refusing paths that
/// could leave `base` (they may come from the network or a record file).
pub(crate) fn join_group(mut dir: PathBuf, rel: &str) -> Result<PathBuf, CgroupError> {
    let bad = |why| CgroupError::BadPath {
        path: rel.to_string(),
        why,
    };
    if !rel.starts_with('/') {
        return Err(bad("not absolute"));
    }
    if rel.contains('\0') {
        return Err(bad("contains NUL"));
    }
    for part in rel.split('/').filter(|p| !p.is_empty()) {
        if part == "." || part == ".." {
            return Err(bad("contains . or .."));
        }
        dir.push(part);
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A fake v1 tree: `<root>/memory/memory.limit_in_bytes`, `<root>/cpu/cpu.cfs_quota_us`.
    fn fake_v1(root: &Path) {
        fs::create_dir_all(root.join("memory")).unwrap();
        fs::create_dir_all(root.join("cpu")).unwrap();
        fs::write(
            root.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        fs::write(root.join("cpu/cpu.cfs_quota_us"), "-1\n").unwrap();
    }

    #[test]
    fn a_fake_v1_tree_is_usable_when_writable() {
        let t = tempfile::tempdir().unwrap();
        fake_v1(t.path());
        let h = Hierarchy::detect_at(t.path()).unwrap();
        assert_eq!(h.controller_dir(Controller::Cpu), t.path().join("cpu"));
    }

    #[test]
    fn unusable_trees_say_why() {
        let t = tempfile::tempdir().unwrap();
        let missing = Hierarchy::detect_at(t.path().join("nope")).unwrap_err();
        assert!(
            missing.reason.contains("no cgroup file system"),
            "{missing}"
        );

        // Nothing mounted.
        let e = Hierarchy::detect_at(t.path()).unwrap_err();
        assert!(e.reason.contains("memory controller is not mounted"), "{e}");

        // cgroup v2 only.
        fs::write(t.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        let e = Hierarchy::detect_at(t.path()).unwrap_err();
        assert!(e.reason.contains("cgroup v2"), "{e}");
        fs::remove_file(t.path().join("cgroup.controllers")).unwrap();

        // cpu without CFS bandwidth control.
        fake_v1(t.path());
        fs::remove_file(t.path().join("cpu/cpu.cfs_quota_us")).unwrap();
        let e = Hierarchy::detect_at(t.path()).unwrap_err();
        assert!(e.reason.contains("CFS bandwidth"), "{e}");
    }

    const AS_NOBODY: &str = "GRANULE_CGROUPS_TEST_AS_NOBODY";

    /// Without root the system hierarchy is unavailable, and the reason says so. Run as
    /// root, this re-runs the test binary as `nobody` for the check.
    #[test]
    fn not_root_means_unavailable() {
        use std::os::unix::process::CommandExt;
        if std::env::var_os(AS_NOBODY).is_some() || !nix::unistd::geteuid().is_root() {
            if Path::new(DEFAULT_ROOT).join("memory").is_dir() {
                let e = Hierarchy::detect().unwrap_err();
                assert!(e.reason.contains("not root"), "{e}");
            }
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "hierarchy::tests::not_root_means_unavailable"])
            .env(AS_NOBODY, "1")
            .uid(65534)
            .gid(65534)
            .output();
        match out {
            Ok(out) => assert!(
                out.status.success(),
                "as nobody: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("skipping the non-root check: cannot run as nobody: {e}"),
        }
    }

    #[test]
    fn group_dirs_stay_inside_the_hierarchy() {
        let h = Hierarchy::at("/cg");
        assert_eq!(
            h.group_dir(Controller::Memory, "/granule/c1-2-0/node0")
                .unwrap(),
            Path::new("/cg/memory/granule/c1-2-0/node0")
        );
        assert_eq!(
            h.group_dir(Controller::Cpu, "/").unwrap(),
            Path::new("/cg/cpu")
        );
        for bad in ["granule/x", "/granule/../../etc", "/a/./b", "/a\0b"] {
            assert!(h.group_dir(Controller::Cpu, bad).is_err(), "{bad:?}");
        }
    }
}
