//! The host: everything Granule reads or writes under `/proc` and `/sys`, and the few
//! requests to the operating system that need `unsafe` code.
//!
//! No other crate of the workspace opens those paths (a test in `crates/granule/tests/
//! layout.rs` checks it); the runtime, the libraries, the benchmarks and the command use
//! this crate instead. What it owns:
//!
//! - [`proc`]: readings of this process and its threads (CPU clocks, resident memory,
//!   per-thread schedstat, the task list) and of other processes (state, start time,
//!   CPU time);
//! - [`os`]: thread nice values and scheduler slices, returning free memory to the
//!   kernel, ignoring SIGPIPE, CPU affinity — the crate's only `unsafe` code;
//! - [`mem`]: the machine's memory (`/proc/meminfo`, `/proc/vmstat`, `/proc/swaps`) and
//!   zswap (parameters, two settings with their previous values returned, statistics
//!   where debugfs is mounted);
//! - [`psi`]: pressure stall information, system-wide and per v2 group;
//! - [`machine`]: CPU model and count, memory, kernel release;
//! - [`shm`]: memory files of fixed-size slots that one process writes and other
//!   processes of the machine map and read in place (the file system's stripe stores and
//!   its mount), found through `/proc/<pid>/fd`;
//! - [`mounts`]: whether a directory is a mount point, and a mount's read-ahead (for
//!   the file system's FUSE mount);
//! - cgroup v1 groups *Granule creates for itself*: detecting whether cgroup v1 is usable
//!   ([`Hierarchy::detect`], with a human reason when it is not, so callers can fall back
//!   to budget accounting); one directory per local cluster,
//!   `granule/c<driver pid>-<driver start time>-<n>`, with one group per node process
//!   below it ([`ClusterGroups`], [`NodeGroup`]): a memory limit and a CFS quota from the
//!   node's spec; removing those directories when the cluster ends, and those of
//!   processes that died without removing theirs ([`cleanup_stale`]); moving processes
//!   into groups ([`join_pid`], [`join_self`]) and naming the groups a process runs in
//!   ([`current_paths`]); cpusets that pin processes to CPUs ([`CpusetGroup`]);
//!   antagonists that put memory or CPU load into a node's groups ([`antagonist`]);
//!   capped cpu groups for some threads of a process, such as a node's pushdown pool
//!   ([`antagonist::ThreadCpuGroup::capped`]);
//! - cgroup readings, v1 and v2: cheap repeated readings of a group's usage, limit, OOM
//!   kills and throttling ([`Reader`]), `memory.stat` ([`MemoryStat`]), per-CPU usage
//!   ([`cpuacct_usage_percpu`]), the unified hierarchy where one is mounted
//!   ([`Unified`]);
//! - *foreign* groups, which Granule did not create and must leave as it found them:
//!   adopting one, reading it, and adjusting its memory limit with an explicit restore
//!   and a record that survives the adjuster's death ([`ForeignGroup`]; the contract is
//!   in [`foreign`]). A separate API on purpose: nothing in it creates, removes or kills.
//! - for the memory market's harvester: swap files ([`swapfile`]: create, format, turn on
//!   and off), memory groups for foreign workloads the producer or a benchmark starts
//!   ([`workload::WorkloadGroup`], under `granule-workloads/`), the swapped mappings of a
//!   process and the prefetch that reads them back (`process_madvise`), and idle memory
//!   at page granularity (`clear_refs`, `smaps_rollup`) ([`workload`]).
//!
//! It must not touch cgroups it did not create through the API for its own groups: only
//! directories below `granule/`, `granule-antagonists/` and `granule-pushdown/` whose
//! names it can parse are
//! ever removed, and only tasks inside them are ever killed; a foreign group's memory
//! limit is the only thing written outside them (and the `cgroup.procs` a pinned process
//! goes back to). It knows nothing of proclets, the controller or the transport; the
//! runtime decides when to create and remove groups, the market when to harvest.
//!
//! Processes are identified by pid within one pid namespace: a driver in another pid
//! namespace that shares this cgroup file system would look dead to [`cleanup_stale`].
#![deny(unsafe_code)]

pub mod antagonist;
mod cpuset;
mod file;
pub mod foreign;
mod group;
mod hierarchy;
pub mod machine;
pub mod mem;
pub mod mounts;
pub mod os;
pub mod proc;
mod procfs;
pub mod psi;
mod reader;
pub mod shm;
mod stat;
pub mod swapfile;
mod unified;
pub mod workload;

pub use cpuset::{Cpuset, CpusetGroup};
pub use foreign::{restore_from_record, ForeignGroup, Limit, Restored};
pub use granule_wire::CgroupPaths;
pub use group::{cleanup_stale, join_pid, join_self, ClusterGroups, NodeGroup};
pub use hierarchy::{Controller, Hierarchy, Unavailable, DEFAULT_ROOT};
pub use procfs::{
    current_paths, current_thread_paths, parse_proc_cgroup, paths_of, proc_cgroup_text,
    process_start_time, unified_path, v1_path,
};
pub use reader::{CpuStat, Reader};
pub use stat::{
    cpuacct_usage, cpuacct_usage_percpu, memory_stat, parse_memory_stat, parse_percpu,
    parse_unified_cpu_stat, CgroupVersion, MemoryStat, UnifiedCpuStat,
};
pub use unified::{parse_mounts, CgroupMounts, Unified};

use std::path::PathBuf;

/// The directory (in every controller's hierarchy) that holds one directory per cluster.
pub const GRANULE_DIR: &str = "granule";
/// The directory (in the cpu hierarchy) that holds one directory per antagonist process.
pub const ANTAGONIST_DIR: &str = "granule-antagonists";
/// The directory (in the cpu hierarchy) that holds the capped pushdown-pool groups of
/// processes that run in no node group of their own ([`antagonist::ThreadCpuGroup::capped`]).
pub const PUSHDOWN_DIR: &str = "granule-pushdown";
/// The default CFS period of node groups, microseconds (the runtime passes the
/// configured one, `cluster.cfs_period`). A fifth of the kernel's default: a group that
/// used its quota early in a period is frozen until the period ends, so the period bounds
/// the stall a throttled node's calls see (20 ms, not 100).
pub const CFS_PERIOD_US: u64 = 20_000;

/// The smallest CFS quota the kernel accepts, microseconds.
pub const MIN_CFS_QUOTA_US: u64 = 1_000;

/// What can go wrong with a cgroup operation.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroup v1 unavailable: {0}")]
    Unavailable(#[from] Unavailable),
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unexpected content in {path}: {text:?}")]
    Parse { path: PathBuf, text: String },
    #[error("no {0} cgroup to read (the process runs in none, or the paths named none)")]
    NoController(Controller),
    #[error("refused cgroup path {path:?}: {why}")]
    BadPath { path: String, why: &'static str },
    #[error("cgroup {path} still has tasks {pids:?}; cannot remove it")]
    Busy { path: PathBuf, pids: Vec<u32> },
    #[error(
        "cgroup {path}: the kernel cannot get the usage ({usage} bytes) under a memory limit of {limit} bytes; the limit is unchanged"
    )]
    LimitRefused {
        path: PathBuf,
        limit: u64,
        usage: u64,
    },
    #[error("limit record {path}: {why}")]
    Record { path: PathBuf, why: String },
    #[error(transparent)]
    Host(#[from] HostError),
}

/// What can go wrong reading or writing a file under `/proc` or `/sys` outside cgroups.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("cannot {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unexpected content in {path}: {text:?}")]
    Parse { path: PathBuf, text: String },
    #[error("{value} is not a valid {what}")]
    Invalid { what: &'static str, value: String },
}

impl HostError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        HostError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn parse(path: impl Into<PathBuf>, text: &str) -> Self {
        HostError::Parse {
            path: path.into(),
            text: text.to_string(),
        }
    }
}

impl CgroupError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CgroupError::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
