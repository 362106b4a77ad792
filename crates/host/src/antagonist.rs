//! Antagonists: load put into a node's groups from outside, to exercise how a node reacts
//! to pressure it did not cause (shedding proclets, throttling, the OOM killer).
//!
//! A memory antagonist joins a node's *memory* group only, so its pages are charged to
//! the node, and volunteers as the OOM killer's victim ([`set_oom_score_adj`]). For CPU it
//! sits in a group of its own ([`OwnCpuGroup`]) so that its page faulting is not billed to
//! the node's CPU quota: next to the node's own cpu group when the node has one, so the
//! two compete as a node and a co-tenant on one machine would. A CPU antagonist joins the
//! node's cpu group and [`spin`]s. An antagonist that is a thread of a benchmark driver
//! rather than a process gets a [`ThreadCpuGroup`] beside the node's. The same type, with
//! a quota ([`ThreadCpuGroup::capped`]), holds a node's pushdown pool: threads of the
//! node whose CPU is capped apart from the rest of the node.

use crate::group::{join_pid, remove_tree, sweep};
use crate::hierarchy::{Controller, Hierarchy};
use crate::procfs::{current_paths, process_start_time};
use crate::{CgroupError, ANTAGONIST_DIR};
use granule_wire::CgroupPaths;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Memory is taken in steps of this size.
pub const STEP: usize = 4 << 20;
/// One byte in every this many is written, so that every page is really allocated.
pub const PAGE: usize = 4096;

/// Set this process's `oom_score_adj` (-1000 ..= 1000; 1000 makes it the first victim
/// of the OOM killer in any group it is charged to).
pub fn set_oom_score_adj(score: i32) -> Result<(), CgroupError> {
    crate::group::write_value(std::path::Path::new("/proc/self/oom_score_adj"), score)
}

/// A cpu group of this process's own, `a<pid>-<start>`, with no quota and the default
/// weight. Entering it moves the process; removing it (or dropping it) moves the process
/// back to the cpu group it came from and deletes the directory. If the process dies
/// first (an OOM kill), the next antagonist, [`crate::cleanup_stale`] or the cluster's
/// own clean-up removes it.
///
/// Where: beside the node's cpu group (in its parent, the cluster's group) when the node
/// runs in a group Granule made for it, else under `granule-antagonists/`. Beside is what
/// a co-tenant on the node's machine would be. At the top, on one vCPU of a one-machine
/// test cluster, it would compete with the *whole cluster's* group, whose weight the
/// kernel splits over the CPUs by where the cluster's load runs, so the node's standing
/// would depend on what the other nodes do on other vCPUs. (Measured in `granule-bench
/// pressure`, the move made no clear difference there: the victim uses less than half of
/// its vCPU either way.)
#[derive(Debug)]
pub struct OwnCpuGroup {
    h: Hierarchy,
    dir: PathBuf,
    previous: String,
    removed: bool,
}

impl OwnCpuGroup {
    /// Create the group under `granule-antagonists/` and move this process into it.
    pub fn enter(h: &Hierarchy) -> Result<OwnCpuGroup, CgroupError> {
        Self::enter_in(h, format!("/{ANTAGONIST_DIR}"))
    }

    /// Create the group beside the node cpu group `node_cpu` (a path as the node reports
    /// it, e.g. `/granule/c1-2-0/node0`) when that is a group Granule made for a node —
    /// under `granule/` and with a CPU quota — else as [`OwnCpuGroup::enter`] does; then
    /// move this process into it.
    pub fn enter_beside(h: &Hierarchy, node_cpu: Option<&str>) -> Result<OwnCpuGroup, CgroupError> {
        match node_cpu.and_then(|p| Self::cluster_group_of(h, p)) {
            Some(parent) => Self::enter_in(h, parent),
            None => Self::enter(h),
        }
    }

    /// The parent (relative path) of a node's own cpu group, if `node_cpu` is one.
    fn cluster_group_of(h: &Hierarchy, node_cpu: &str) -> Option<String> {
        let under_granule = node_cpu.starts_with(&format!("/{}/", crate::GRANULE_DIR));
        let dir = h.group_dir(Controller::Cpu, node_cpu).ok()?;
        let quota: i64 = std::fs::read_to_string(dir.join("cpu.cfs_quota_us"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let parent = node_cpu.rsplit_once('/')?.0;
        (under_granule && quota > 0 && !parent.is_empty()).then(|| parent.to_string())
    }

    /// Create `a<pid>-<start>` in the group `parent_rel` and move this process into it.
    fn enter_in(h: &Hierarchy, parent_rel: String) -> Result<OwnCpuGroup, CgroupError> {
        let parent = h.group_dir(Controller::Cpu, &parent_rel)?;
        // Groups left by earlier antagonists that were killed.
        let mut removed = Vec::new();
        sweep(&parent, 'a', &mut removed);
        for d in removed {
            tracing::info!("removed the cgroup of a dead antagonist: {d}");
        }
        let pid = std::process::id();
        let start = process_start_time(pid).ok_or_else(|| CgroupError::Parse {
            path: PathBuf::from("/proc/self/stat"),
            text: "no start time".into(),
        })?;
        let dir = parent.join(format!("a{pid}-{start}"));
        std::fs::create_dir_all(&dir).map_err(|e| CgroupError::io("create", &dir, e))?;
        let previous = current_paths()
            .and_then(|p| p.cpu)
            .unwrap_or_else(|| "/".into());
        let g = OwnCpuGroup {
            h: h.clone(),
            previous,
            removed: false,
            dir,
        };
        let rel = format!("{parent_rel}/a{pid}-{start}");
        join_pid(
            &g.h,
            pid,
            &CgroupPaths {
                memory: None,
                cpu: Some(rel),
            },
        )?;
        Ok(g)
    }

    /// The group's directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Limit the group to `cores` of CPU (a CFS quota): the antagonist is a tenant with
    /// its own CPU allocation, not a process free to take the whole machine.
    pub fn limit_cores(&self, cores: f64) -> Result<(), CgroupError> {
        crate::group::write_value(&self.dir.join("cpu.cfs_period_us"), crate::CFS_PERIOD_US)?;
        crate::group::write_value(
            &self.dir.join("cpu.cfs_quota_us"),
            crate::group::quota_us(cores, crate::CFS_PERIOD_US),
        )
    }

    /// Leave the group and delete it.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.leave()
    }

    fn leave(&mut self) -> Result<(), CgroupError> {
        self.removed = true;
        join_pid(
            &self.h,
            std::process::id(),
            &CgroupPaths {
                memory: None,
                cpu: Some(self.previous.clone()),
            },
        )?;
        remove_tree(&self.dir)
    }
}

impl Drop for OwnCpuGroup {
    fn drop(&mut self) {
        if !self.removed {
            if let Err(e) = self.leave() {
                tracing::warn!("cannot remove {}: {e}", self.dir.display());
            }
        }
    }
}

/// Names of [`ThreadCpuGroup`]s made by this process (`a<pid>-<start>-<n>`,
/// `p<pid>-<start>-<n>`).
static THREAD_GROUP_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A cpu group for some threads of this process (not the whole process), in two forms:
///
/// - [`ThreadCpuGroup::beside`]: beside a node's own cpu group, another tenant on the
///   node's CPU with the same weight and no quota, for an antagonist that is a thread of
///   a benchmark driver. Named `a<pid>-<start>-<n>` in the node group's parent, so a dead
///   process's group is swept like an [`OwnCpuGroup`].
/// - [`ThreadCpuGroup::capped`]: a group with a CFS quota for a node's pushdown pool,
///   inside the node's own cpu group (so the pool's CPU also counts against the node's
///   quota), or under `granule-pushdown/` for a process that runs in no group Granule
///   made for a node. Named `p<pid>-<start>-<n>`; groups of processes that are gone are
///   swept when the next one is made there, by [`crate::cleanup_stale`], and with the
///   cluster's groups.
///
/// Threads enter with [`ThreadCpuGroup::join_current_thread`]. Removing the group (or
/// dropping it) first moves threads still inside back to the cpu group the process ran
/// in when the group was made (a thread cannot leave a v1 group except by being written
/// into another), then deletes the directory.
#[derive(Debug)]
pub struct ThreadCpuGroup {
    dir: PathBuf,
    /// Where threads still inside go back before removal: the process's cpu group when
    /// this group was made.
    home: Option<PathBuf>,
    removed: bool,
}

/// `(pid, start time)` of this process, for group names.
fn own_name_parts() -> Result<(u32, u64), CgroupError> {
    let pid = std::process::id();
    let start = process_start_time(pid).ok_or_else(|| CgroupError::Parse {
        path: PathBuf::from("/proc/self/stat"),
        text: "no start time".into(),
    })?;
    Ok((pid, start))
}

/// The CPU cap of the cpu group in `dir` (quota ÷ period), `None` without a quota.
fn read_cap(dir: &std::path::Path) -> Result<Option<f64>, CgroupError> {
    let read = |name: &str| -> Result<i64, CgroupError> {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).map_err(|e| CgroupError::io("read", &path, e))?;
        text.trim()
            .parse()
            .map_err(|_| CgroupError::Parse { path, text })
    };
    let quota = read("cpu.cfs_quota_us")?;
    let period = read("cpu.cfs_period_us")?;
    Ok((quota > 0 && period > 0).then(|| quota as f64 / period as f64))
}

/// The directory of this process's own cpu group (the controller's root when it runs
/// in none).
fn own_cpu_dir(h: &Hierarchy) -> Option<PathBuf> {
    let rel = current_paths()
        .and_then(|p| p.cpu)
        .unwrap_or_else(|| "/".into());
    h.group_dir(Controller::Cpu, &rel).ok()
}

impl ThreadCpuGroup {
    /// Create the group beside `node_cpu` (a node's cpu group as it reports it, e.g.
    /// `/granule/c1-2-0/node0`), which must be a group Granule made for a node (under
    /// `granule/`, with a CPU quota).
    pub fn beside(h: &Hierarchy, node_cpu: &str) -> Result<ThreadCpuGroup, CgroupError> {
        let parent =
            OwnCpuGroup::cluster_group_of(h, node_cpu).ok_or_else(|| CgroupError::BadPath {
                path: node_cpu.to_string(),
                why: "not a node's own cpu group (under granule/, with a quota)",
            })?;
        let (pid, start) = own_name_parts()?;
        let n = THREAD_GROUP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = h
            .group_dir(Controller::Cpu, &parent)?
            .join(format!("a{pid}-{start}-{n}"));
        std::fs::create_dir_all(&dir).map_err(|e| CgroupError::io("create", &dir, e))?;
        Ok(ThreadCpuGroup {
            dir,
            home: own_cpu_dir(h),
            removed: false,
        })
    }

    /// Create a group capped at `cores` of CPU (a CFS period of `period_us`, clamped to
    /// the kernel's 1 ms..=1 s, and a quota of `cores` periods, at least
    /// [`crate::MIN_CFS_QUOTA_US`]) for threads of this process: inside `node_cpu` when
    /// that is the cpu group Granule made for this node (under `granule/`, with a
    /// quota; a cap above the node's own is lowered to it), else under
    /// `granule-pushdown/` (made if missing). Groups left there by processes that are
    /// gone are removed first. [`ThreadCpuGroup::cap_cores`] gives the cap in force.
    pub fn capped(
        h: &Hierarchy,
        node_cpu: Option<&str>,
        cores: f64,
        period_us: u64,
    ) -> Result<ThreadCpuGroup, CgroupError> {
        if !(cores.is_finite() && cores > 0.0) {
            return Err(CgroupError::BadPath {
                path: format!("{cores}"),
                why: "a CPU cap must be a positive number of cores",
            });
        }
        let (parent_rel, cores) = match node_cpu {
            Some(node) if OwnCpuGroup::cluster_group_of(h, node).is_some() => {
                // Cgroup v1 refuses a child quota above its parent's (EINVAL), and the
                // node's quota bounds the pool anyway: a larger cap is the node's.
                let node_cores = read_cap(&h.group_dir(Controller::Cpu, node)?)?;
                (node.to_string(), node_cores.map_or(cores, |n| cores.min(n)))
            }
            _ => (format!("/{}", crate::PUSHDOWN_DIR), cores),
        };
        let parent = h.group_dir(Controller::Cpu, &parent_rel)?;
        std::fs::create_dir_all(&parent).map_err(|e| CgroupError::io("create", &parent, e))?;
        let mut removed = Vec::new();
        sweep(&parent, 'p', &mut removed);
        for d in removed {
            tracing::info!("removed the pushdown cgroup of a process that is gone: {d}");
        }
        let (pid, start) = own_name_parts()?;
        let n = THREAD_GROUP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = parent.join(format!("p{pid}-{start}-{n}"));
        std::fs::create_dir_all(&dir).map_err(|e| CgroupError::io("create", &dir, e))?;
        let g = ThreadCpuGroup {
            dir,
            home: own_cpu_dir(h),
            removed: false,
        };
        let period_us = period_us.clamp(1_000, 1_000_000);
        // The period first: the quota is validated against it. On an error the group is
        // dropped, which removes it.
        crate::group::write_value(&g.dir.join("cpu.cfs_period_us"), period_us)?;
        crate::group::write_value(
            &g.dir.join("cpu.cfs_quota_us"),
            crate::group::quota_us(cores, period_us),
        )?;
        Ok(g)
    }

    /// The group's directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The group's CPU cap as the kernel has it (quota ÷ period), `None` without a quota.
    pub fn cap_cores(&self) -> Result<Option<f64>, CgroupError> {
        read_cap(&self.dir)
    }

    /// Move the calling thread (only it) into the group.
    pub fn join_current_thread(&self) -> Result<(), CgroupError> {
        crate::group::write_value(&self.dir.join("tasks"), crate::proc::current_tid())
    }

    /// Delete the group, moving threads still inside back to the process's group first.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.removed = true;
        self.send_home();
        remove_tree(&self.dir)
    }

    /// Move every thread still in the group back where the process ran (threads that
    /// exit meanwhile are gone from the list anyway).
    fn send_home(&self) {
        let Some(home) = &self.home else { return };
        let Ok(tasks) = std::fs::read_to_string(self.dir.join("tasks")) else {
            return;
        };
        for tid in tasks.split_whitespace() {
            if let Err(e) = std::fs::write(home.join("tasks"), tid) {
                // ESRCH: it exited between the read and the write.
                if e.raw_os_error() != Some(nix::errno::Errno::ESRCH as i32) {
                    tracing::warn!(
                        "cannot move thread {tid} out of {} to {}: {e}",
                        self.dir.display(),
                        home.display()
                    );
                }
            }
        }
    }
}

impl Drop for ThreadCpuGroup {
    fn drop(&mut self) {
        if !self.removed {
            self.send_home();
            if let Err(e) = remove_tree(&self.dir) {
                tracing::warn!("cannot remove {}: {e}", self.dir.display());
            }
        }
    }
}

/// Memory held by [`allocate_paced`]; freed (unmapped) on drop.
#[derive(Debug, Default)]
pub struct Hog {
    chunks: Vec<memmap2::MmapMut>,
}

impl Hog {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.len() as u64).sum()
    }
}

/// Allocate `size` bytes in [`STEP`]s at about `rate` bytes per second (0: as fast as
/// possible), paced against the wall clock from the start, so a slow step is caught up
/// rather than lowering the rate. Every page of every step is written, so the memory is
/// resident (and charged) at once. `progress` gets the total after each step. A mapping
/// the kernel refuses ends it with an error; a cgroup limit does not, it ends in the OOM
/// killer.
pub fn allocate_paced(size: u64, rate: u64, mut progress: impl FnMut(u64)) -> std::io::Result<Hog> {
    let started = Instant::now();
    let mut hog = Hog::default();
    let mut total = 0u64;
    while total < size {
        let n = STEP.min((size - total) as usize);
        // A fresh anonymous map, faulted in 4 KiB at a time by touching one byte per page
        // (which is what charges the cgroup), as any program's heap grows.
        //
        // No transparent-huge-page advice: it looks cheaper (one fault per 2 MiB) but on
        // this VM it is the slow path. Measured here, alternating, 64 MiB steps, one
        // thread: 0.42–0.46 GiB/s advised against 0.67–1.85 GiB/s not. Our reading (not
        // proven): a huge page needs a free 2 MiB block, and large free blocks are the
        // ones the balloon hands back to the host (free page reporting: this VM boots with
        // page_reporting.page_reporting_order=11, blocks of 8 MiB and up, reported ~2 s
        // after they are freed), so such first touches exit to the hypervisor, while
        // 4 KiB faults are often served from smaller free pieces that are still backed.
        // A `rate` the machine cannot give is not reached; the antagonist reports what it
        // achieved.
        let mut chunk = memmap2::MmapMut::map_anon(n)?;
        for i in (0..n).step_by(PAGE) {
            chunk[i] = 0xa5;
        }
        // Keep the writes: nothing ever reads this memory.
        hog.chunks.push(std::hint::black_box(chunk));
        total += n as u64;
        progress(total);
        if rate > 0 {
            let due = started + Duration::from_secs_f64(total as f64 / rate as f64);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
    }
    Ok(hog)
}

/// Busy-loop on `threads` threads for `duration`. Returns the loop iterations done (the
/// work is real and observable, so it cannot be optimized away).
pub fn spin(threads: usize, duration: Duration) -> u64 {
    let end = Instant::now() + duration;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(move || {
                    let mut n = 0u64;
                    let mut x = 1u64;
                    while Instant::now() < end {
                        for _ in 0..1000 {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                        n += 1000;
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs::paths_of;

    #[test]
    fn allocation_is_paced_and_reported() {
        let mut seen = Vec::new();
        let t = Instant::now();
        // 10 MiB at 100 MiB/s: three steps (4 + 4 + 2 MiB), about 100 ms.
        let hog = allocate_paced(10 << 20, 100 << 20, |b| seen.push(b)).unwrap();
        let took = t.elapsed();
        assert_eq!(hog.bytes(), 10 << 20);
        assert_eq!(seen, vec![4 << 20, 8 << 20, 10 << 20]);
        assert!(took >= Duration::from_millis(95), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Unpaced.
        assert_eq!(allocate_paced(1 << 20, 0, |_| {}).unwrap().bytes(), 1 << 20);
    }

    #[test]
    fn spinning_lasts_as_long_as_asked() {
        let t = Instant::now();
        assert!(spin(2, Duration::from_millis(50)) > 0);
        assert!(t.elapsed() >= Duration::from_millis(50));
    }

    /// Held by the tests that move this process, or one of its threads, between cpu
    /// groups: they must not see each other's moves (writing the pid moves every thread).
    static MOVES: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn own_cpu_group_is_entered_and_left() {
        let _moves = MOVES.lock().unwrap_or_else(|p| p.into_inner());
        let h = match Hierarchy::detect() {
            Ok(h) => h,
            Err(e) => {
                eprintln!("skipping a real-cgroup test: {e}");
                return;
            }
        };
        let me = std::process::id();
        let before = paths_of(me).and_then(|p| p.cpu);
        let g = OwnCpuGroup::enter(&h).unwrap();
        let dir = g.dir.clone();
        let inside = paths_of(me).and_then(|p| p.cpu).unwrap_or_default();
        assert!(
            inside.starts_with(&format!("/{ANTAGONIST_DIR}/a{me}-")),
            "{inside}"
        );
        g.remove().unwrap();
        assert!(!dir.exists());
        assert_eq!(paths_of(me).and_then(|p| p.cpu), before);

        // Beside a node's own group (under granule/, with a quota): in the same parent.
        // (In this test, not another: both move this whole process between groups.)
        let cluster = format!("/{}/t{me}-antagonist-test", crate::GRANULE_DIR);
        let cluster_dir = h.group_dir(Controller::Cpu, &cluster).unwrap();
        let node_dir = cluster_dir.join("node0");
        std::fs::create_dir_all(&node_dir).unwrap();
        let node = format!("{cluster}/node0");
        std::fs::write(node_dir.join("cpu.cfs_quota_us"), "20000").unwrap();
        let g = OwnCpuGroup::enter_beside(&h, Some(&node)).unwrap();
        let inside = paths_of(me).and_then(|p| p.cpu).unwrap_or_default();
        assert!(inside.starts_with(&format!("{cluster}/a{me}-")), "{inside}");
        g.remove().unwrap();
        // A thread's group beside the node's: a spawned thread joins, exits, the group goes.
        let tg = ThreadCpuGroup::beside(&h, &node).unwrap();
        assert_eq!(tg.dir().parent(), Some(cluster_dir.as_path()));
        let joined = std::thread::scope(|s| {
            s.spawn(|| {
                tg.join_current_thread().unwrap();
                std::fs::read_to_string(tg.dir().join("tasks")).unwrap()
            })
            .join()
            .unwrap()
        });
        assert_eq!(joined.split_whitespace().count(), 1, "{joined}");
        let tdir = tg.dir().to_path_buf();
        tg.remove().unwrap();
        assert!(!tdir.exists());
        assert_eq!(
            paths_of(me).and_then(|p| p.cpu),
            before,
            "the process stayed put"
        );
        // A group without a quota is not a node's own: the shared place instead.
        std::fs::write(node_dir.join("cpu.cfs_quota_us"), "-1").unwrap();
        let g = OwnCpuGroup::enter_beside(&h, Some(&node)).unwrap();
        let inside = paths_of(me).and_then(|p| p.cpu).unwrap_or_default();
        assert!(
            inside.starts_with(&format!("/{ANTAGONIST_DIR}/a{me}-")),
            "{inside}"
        );
        g.remove().unwrap();
        assert!(ThreadCpuGroup::beside(&h, &node).is_err());
        // Nor is a group outside granule/, or none at all.
        for other in [Some("/"), Some("/user.slice"), None] {
            let g = OwnCpuGroup::enter_beside(&h, other).unwrap();
            let inside = paths_of(me).and_then(|p| p.cpu).unwrap_or_default();
            assert!(
                inside.starts_with(&format!("/{ANTAGONIST_DIR}/a{me}-")),
                "{other:?}: {inside}"
            );
            g.remove().unwrap();
        }
        crate::group::remove_tree(&cluster_dir).unwrap();
        assert_eq!(paths_of(me).and_then(|p| p.cpu), before);
    }

    #[test]
    fn capped_thread_groups_sit_in_the_node_group_and_send_threads_home() {
        let _moves = MOVES.lock().unwrap_or_else(|p| p.into_inner());
        let h = match Hierarchy::detect() {
            Ok(h) => h,
            Err(e) => {
                eprintln!("skipping a real-cgroup test: {e}");
                return;
            }
        };
        let me = std::process::id();
        let before = paths_of(me).and_then(|p| p.cpu);
        let cluster = format!("/{}/t{me}-capped-test", crate::GRANULE_DIR);
        let cluster_dir = h.group_dir(Controller::Cpu, &cluster).unwrap();
        // Removes the test's groups even when an assertion fails.
        struct Cleanup(PathBuf);
        impl Drop for Cleanup {
            fn drop(&mut self) {
                let _ = crate::group::remove_tree(&self.0);
            }
        }
        let _cleanup = Cleanup(cluster_dir.clone());
        let node_dir = cluster_dir.join("node0");
        std::fs::create_dir_all(&node_dir).unwrap();
        let node = format!("{cluster}/node0");
        // Half a core (at the kernel's default period).
        std::fs::write(node_dir.join("cpu.cfs_period_us"), "100000").unwrap();
        std::fs::write(node_dir.join("cpu.cfs_quota_us"), "50000").unwrap();
        // A stale group of a process that is gone (a reaped child's pid) is swept.
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let dead = gone.id();
        gone.wait().unwrap();
        let stale = node_dir.join(format!("p{dead}-1-0"));
        std::fs::create_dir_all(&stale).unwrap();

        // Inside a node's own group, with the quota asked for.
        let g = ThreadCpuGroup::capped(&h, Some(&node), 0.25, 20_000).unwrap();
        assert_eq!(g.dir().parent(), Some(node_dir.as_path()));
        assert!(!stale.exists(), "the stale group was not swept");
        assert_eq!(g.cap_cores().unwrap(), Some(0.25));
        // A cap above the node's own is the node's.
        let big = ThreadCpuGroup::capped(&h, Some(&node), 2.0, 20_000).unwrap();
        assert_eq!(big.cap_cores().unwrap(), Some(0.5));
        big.remove().unwrap();
        // A thread joins and stays (a pool thread that outlives nothing): removal moves it
        // back to the process's group first.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (joined_tx, joined_rx) = std::sync::mpsc::channel();
        let dir = g.dir().to_path_buf();
        let t = std::thread::spawn({
            let dir = dir.clone();
            move || {
                crate::group::write_value(&dir.join("tasks"), crate::proc::current_tid()).unwrap();
                joined_tx.send(crate::proc::current_tid()).unwrap();
                rx.recv().ok();
            }
        });
        let tid = joined_rx.recv().unwrap();
        assert_eq!(
            crate::procfs::current_thread_paths().and_then(|p| p.cpu),
            before,
            "only the thread that joined moved"
        );
        let tasks = std::fs::read_to_string(dir.join("tasks")).unwrap();
        assert_eq!(tasks.trim(), tid.to_string());
        g.remove().unwrap();
        assert!(!dir.exists());
        let home = h
            .group_dir(Controller::Cpu, before.as_deref().unwrap_or("/"))
            .unwrap();
        let home_tasks = std::fs::read_to_string(home.join("tasks")).unwrap();
        assert!(
            home_tasks.split_whitespace().any(|t| t == tid.to_string()),
            "thread {tid} went home"
        );
        tx.send(()).unwrap();
        t.join().unwrap();

        // A process in no node group of its own: under granule-pushdown/.
        let g = ThreadCpuGroup::capped(&h, None, 1.0, 20_000).unwrap();
        assert_eq!(
            g.dir().parent(),
            Some(
                h.controller_dir(Controller::Cpu)
                    .join(crate::PUSHDOWN_DIR)
                    .as_path()
            )
        );
        assert_eq!(g.cap_cores().unwrap(), Some(1.0));
        let dir = g.dir().to_path_buf();
        drop(g);
        assert!(!dir.exists(), "dropping removes it");
        assert!(ThreadCpuGroup::capped(&h, None, 0.0, 20_000).is_err());
        crate::group::remove_tree(&cluster_dir).unwrap();
        assert_eq!(paths_of(me).and_then(|p| p.cpu), before);
    }
}
