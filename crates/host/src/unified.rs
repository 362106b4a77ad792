//! The cgroup v2 (unified) hierarchy, where one is mounted: at `/sys/fs/cgroup` on a pure
//! v2 system, at `/sys/fs/cgroup/unified` on a hybrid one (this project's test machine:
//! there it holds no memory or cpu controller).
//!
//! Granule makes its own node groups with v1 only ([`crate::Hierarchy`]); v2 is read
//! ([`crate::Reader::for_unified`]) and foreign v2 groups are adjusted
//! ([`crate::ForeignGroup`]). This module only finds the mount and names directories; it
//! creates and writes nothing.

use crate::hierarchy::join_group;
use crate::mem::unescape_octal;
use crate::CgroupError;
use std::path::{Path, PathBuf};

/// The mount table of this process's mount namespace.
pub const MOUNTS: &str = "/proc/self/mounts";

/// A cgroup v2 mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unified {
    root: PathBuf,
}

impl Unified {
    /// The system's v2 mount, if one is mounted (from the mount table, not by guessing
    /// paths).
    pub fn detect() -> Option<Unified> {
        let text = std::fs::read_to_string(MOUNTS).ok()?;
        parse_mounts(&text).unified.map(Unified::at)
    }

    /// A v2 tree at `root`, unchecked (tests point this at a fake tree).
    pub fn at(root: impl Into<PathBuf>) -> Unified {
        Unified { root: root.into() }
    }

    /// The mount point.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The controllers available at the root (`cgroup.controllers`; on a hybrid system
    /// only those v1 does not hold).
    pub fn controllers(&self) -> Vec<String> {
        std::fs::read_to_string(self.root.join("cgroup.controllers"))
            .map(|t| t.split_ascii_whitespace().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// Whether the root offers controller `name` (`memory`, `cpu`, `io`, ...).
    pub fn has_controller(&self, name: &str) -> bool {
        self.controllers().iter().any(|c| c == name)
    }

    /// The directory of group `rel` (as the `0::` line of `/proc/<pid>/cgroup` names
    /// it). Refuses paths that could leave the mount.
    pub fn group_dir(&self, rel: &str) -> Result<PathBuf, CgroupError> {
        join_group(self.root.clone(), rel)
    }
}

/// The cgroup mounts in a mount table (`/proc/self/mounts`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupMounts {
    /// Each v1 mount and the controllers it holds (`name=systemd` included as listed).
    pub v1: Vec<(PathBuf, Vec<String>)>,
    /// The first v2 mount.
    pub unified: Option<PathBuf>,
}

/// The cgroup mounts in the text of a mount table. Mount points are unescaped (`\040` is
/// a blank).
pub fn parse_mounts(text: &str) -> CgroupMounts {
    let mut m = CgroupMounts::default();
    for line in text.lines() {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        let [_dev, point, fstype, options, ..] = f[..] else {
            continue;
        };
        let point = PathBuf::from(unescape_octal(point));
        match fstype {
            "cgroup2" if m.unified.is_none() => m.unified = Some(point),
            "cgroup" => {
                // Options mix mount flags with controller names; keep only the names of
                // controllers (and named hierarchies).
                let controllers = options
                    .split(',')
                    .filter(|o| {
                        !matches!(
                            *o,
                            "rw" | "ro"
                                | "nosuid"
                                | "nodev"
                                | "noexec"
                                | "relatime"
                                | "noatime"
                                | "nodiratime"
                                | "clone_children"
                                | "noprefix"
                                | "xattr"
                        ) && !o.starts_with("release_agent=")
                    })
                    .map(str::to_owned)
                    .collect();
                m.v1.push((point, controllers));
            }
            _ => {}
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_of_a_hybrid_and_a_pure_v2_system() {
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                      cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,relatime,memory 0 0\n\
                      cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,xattr,name=systemd 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        let m = parse_mounts(hybrid);
        assert_eq!(m.unified, Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(m.v1.len(), 3);
        assert_eq!(
            m.v1[1],
            (
                PathBuf::from("/sys/fs/cgroup/memory"),
                vec!["memory".into()]
            )
        );
        assert_eq!(m.v1[2].1, vec!["name=systemd".to_string()]);
        let pure =
            "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n\
                    cgroup2 /other\\040place cgroup2 rw 0 0\n";
        let m = parse_mounts(pure);
        assert_eq!(m.unified, Some(PathBuf::from("/sys/fs/cgroup")));
        assert!(m.v1.is_empty());
        assert_eq!(parse_mounts("garbage\n"), CgroupMounts::default());
    }

    #[test]
    fn a_fake_v2_tree() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.controllers"), "cpu io memory pids\n").unwrap();
        let u = Unified::at(t.path());
        assert!(u.has_controller("memory"));
        assert!(!u.has_controller("hugetlb"));
        assert_eq!(u.group_dir("/a/b").unwrap(), t.path().join("a/b"));
        assert!(u.group_dir("/a/../../etc").is_err());
        assert!(Unified::at(t.path().join("none")).controllers().is_empty());
    }

    #[test]
    fn this_machines_unified_mount_if_any() {
        // This project's machine is hybrid: a v2 mount with none of the memory or cpu
        // controllers. Either way detection must not fail or invent a mount.
        if let Some(u) = Unified::detect() {
            assert!(u.root().join("cgroup.procs").is_file(), "{u:?}");
        }
    }
}
