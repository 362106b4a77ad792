//! Statistics files of cgroups, v1 and v2: `memory.stat` (what a group's memory is made
//! of, and its fault and refault counters, which a harvester watches), v2 `cpu.stat`, and
//! v1 `cpuacct.usage_percpu` (busy nanoseconds per CPU; at the root, of every task on the
//! machine). Parsing is pure and tested on fixed text; readers only read.

use crate::file::{pairs, read_text};
use crate::hierarchy::{Controller, Hierarchy};
use crate::CgroupError;
use std::path::Path;
use std::time::Duration;

/// Which cgroup interface a group's files follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl std::fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        })
    }
}

/// A group's `memory.stat`, the same fields whichever version wrote it. Sizes in bytes;
/// `pg*` and `workingset_*` are event counters (monotonic). Hierarchical: a v1 group's
/// `total_*` lines (itself and its children) are used where present, as v2 always is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStat {
    /// Anonymous memory (v1 `rss`, v2 `anon`), transparent huge pages included.
    pub anon: u64,
    /// Page cache (v1 `cache`, v2 `file`), tmpfs and shared memory included.
    pub file: u64,
    pub shmem: u64,
    /// Page cache mapped into processes (v1 `mapped_file`, v2 `file_mapped`).
    pub file_mapped: u64,
    pub active_anon: u64,
    pub inactive_anon: u64,
    pub active_file: u64,
    pub inactive_file: u64,
    pub unevictable: u64,
    /// Swap used by the group: v1 `swap` (with swap accounting on), v2 from
    /// `memory.swap.current` (filled in by the reader; `None` from the parser alone).
    pub swap: Option<u64>,
    /// What the group's pages in zswap take compressed / would take uncompressed (v2,
    /// 5.19+; `None` elsewhere).
    pub zswap: Option<u64>,
    pub zswapped: Option<u64>,
    pub pgfault: u64,
    pub pgmajfault: u64,
    pub workingset_refault_anon: u64,
    pub workingset_refault_file: u64,
}

/// Parse a `memory.stat` written by a group of `version`. Unknown lines are skipped; a
/// field the kernel does not write reads as 0 (or `None`).
pub fn parse_memory_stat(text: &str, version: CgroupVersion) -> MemoryStat {
    let mut s = MemoryStat::default();
    // v1: the hierarchical `total_<name>` wins over `<name>`, whichever comes first.
    let mut from_total = std::collections::HashSet::new();
    for (key, value) in pairs(text) {
        let (name, total) = match (version, key.strip_prefix("total_")) {
            (CgroupVersion::V1, Some(name)) => (name, true),
            _ => (key, false),
        };
        if !total && from_total.contains(name) {
            continue;
        }
        let field: &mut u64 = match (version, name) {
            (CgroupVersion::V1, "rss") | (CgroupVersion::V2, "anon") => &mut s.anon,
            (CgroupVersion::V1, "cache") | (CgroupVersion::V2, "file") => &mut s.file,
            (_, "shmem") => &mut s.shmem,
            (CgroupVersion::V1, "mapped_file") | (CgroupVersion::V2, "file_mapped") => {
                &mut s.file_mapped
            }
            (_, "active_anon") => &mut s.active_anon,
            (_, "inactive_anon") => &mut s.inactive_anon,
            (_, "active_file") => &mut s.active_file,
            (_, "inactive_file") => &mut s.inactive_file,
            (_, "unevictable") => &mut s.unevictable,
            (CgroupVersion::V1, "swap") => s.swap.insert(0),
            (CgroupVersion::V2, "zswap") => s.zswap.insert(0),
            (CgroupVersion::V2, "zswapped") => s.zswapped.insert(0),
            (_, "pgfault") => &mut s.pgfault,
            (_, "pgmajfault") => &mut s.pgmajfault,
            (_, "workingset_refault_anon") => &mut s.workingset_refault_anon,
            (_, "workingset_refault_file") => &mut s.workingset_refault_file,
            _ => continue,
        };
        *field = value;
        if total {
            from_total.insert(name);
        }
    }
    s
}

/// The `memory.stat` of one of Granule's own v1 memory groups (or any v1 group, read
/// only).
pub fn memory_stat(h: &Hierarchy, rel: &str) -> Result<MemoryStat, CgroupError> {
    let path = h.group_dir(Controller::Memory, rel)?.join("memory.stat");
    Ok(parse_memory_stat(&read_text(&path)?, CgroupVersion::V1))
}

/// A v2 group's `cpu.stat`: CPU time used, and CFS bandwidth throttling (present only
/// where the cpu controller is enabled for the group).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnifiedCpuStat {
    pub usage: Duration,
    pub user: Duration,
    pub system: Duration,
    pub nr_periods: u64,
    pub nr_throttled: u64,
    pub throttled: Duration,
}

/// Parse a v2 `cpu.stat` (`usage_usec 834407579` ...). `Err` when `usage_usec`, which
/// every v2 group has, is missing.
pub fn parse_unified_cpu_stat(text: &str) -> Result<UnifiedCpuStat, &'static str> {
    let mut s = UnifiedCpuStat::default();
    let mut usage = false;
    for (k, v) in pairs(text) {
        match k {
            "usage_usec" => (s.usage, usage) = (Duration::from_micros(v), true),
            "user_usec" => s.user = Duration::from_micros(v),
            "system_usec" => s.system = Duration::from_micros(v),
            "nr_periods" => s.nr_periods = v,
            "nr_throttled" => s.nr_throttled = v,
            "throttled_usec" => s.throttled = Duration::from_micros(v),
            _ => {}
        }
    }
    if usage {
        Ok(s)
    } else {
        Err("no usage_usec line")
    }
}

/// Busy nanoseconds of each CPU (index = CPU number) in the text of
/// `cpuacct.usage_percpu`. `Err(word)` names a value that is not a number.
pub fn parse_percpu(text: &str) -> Result<Vec<u64>, &str> {
    text.split_ascii_whitespace()
        .map(|v| v.parse().map_err(|_| v))
        .collect()
}

/// Busy nanoseconds of each CPU of the v1 cpuacct group `rel` (`/`: every task on the
/// machine), index = CPU number.
pub fn cpuacct_usage_percpu(h: &Hierarchy, rel: &str) -> Result<Vec<u64>, CgroupError> {
    let path = h
        .group_dir(Controller::Cpuacct, rel)?
        .join("cpuacct.usage_percpu");
    let text = read_text(&path)?;
    parse_percpu(&text).map_err(|w| CgroupError::Parse {
        path: path.clone(),
        text: w.to_string(),
    })
}

/// The v1 cpuacct group `rel`'s CPU time, all CPUs (`cpuacct.usage`).
pub fn cpuacct_usage(h: &Hierarchy, rel: &str) -> Result<Duration, CgroupError> {
    let path = h.group_dir(Controller::Cpuacct, rel)?.join("cpuacct.usage");
    Ok(Duration::from_nanos(read_u64(&path)?))
}

pub(crate) fn read_u64(path: &Path) -> Result<u64, CgroupError> {
    Ok(crate::file::read_parsed(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_memory_stat_prefers_the_hierarchical_totals() {
        let text = "cache 10448896\nrss 7159808\nshmem 9084928\nmapped_file 7573504\n\
                    workingset_refault_anon 1\nworkingset_refault_file 430\nswap 0\n\
                    pgfault 36849\npgmajfault 2\ninactive_anon 0\nactive_anon 1531904\n\
                    hierarchical_memory_limit 9223372036854771712\n\
                    total_cache 20000000\ntotal_rss 8000000\ntotal_swap 4096\n\
                    total_pgmajfault 3639\ntotal_workingset_refault_file 465870\n";
        let s = parse_memory_stat(text, CgroupVersion::V1);
        assert_eq!(s.file, 20_000_000);
        assert_eq!(s.anon, 8_000_000);
        assert_eq!(s.swap, Some(4096));
        assert_eq!(s.pgmajfault, 3639);
        assert_eq!(s.workingset_refault_file, 465_870);
        // No total line: the group's own.
        assert_eq!(s.workingset_refault_anon, 1);
        assert_eq!(s.shmem, 9_084_928);
        assert_eq!(s.file_mapped, 7_573_504);
        assert_eq!(s.active_anon, 1_531_904);
        assert_eq!(s.zswap, None);
        // Without swap accounting there is no swap line.
        assert_eq!(parse_memory_stat("rss 1\n", CgroupVersion::V1).swap, None);
    }

    #[test]
    fn v2_memory_stat() {
        let text = "anon 4096\nfile 8192\nkernel 100\nshmem 0\nfile_mapped 4096\n\
                    zswap 10\nzswapped 40\nactive_anon 1\ninactive_anon 2\n\
                    workingset_refault_anon 3\nworkingset_refault_file 4\npgfault 5\n\
                    pgmajfault 6\ntotal_cache 99\nrss 77\n";
        let s = parse_memory_stat(text, CgroupVersion::V2);
        assert_eq!((s.anon, s.file, s.file_mapped), (4096, 8192, 4096));
        assert_eq!((s.zswap, s.zswapped), (Some(10), Some(40)));
        assert_eq!((s.pgfault, s.pgmajfault), (5, 6));
        assert_eq!(s.workingset_refault_anon, 3);
        assert_eq!(s.swap, None, "v2 swap is in memory.swap.current");
    }

    #[test]
    fn unified_cpu_stat() {
        let s = parse_unified_cpu_stat(
            "usage_usec 834407579\nuser_usec 706467178\nsystem_usec 127940401\n\
             nr_periods 10\nnr_throttled 2\nthrottled_usec 3000\n",
        )
        .unwrap();
        assert_eq!(s.usage, Duration::from_micros(834_407_579));
        assert_eq!(s.nr_throttled, 2);
        assert_eq!(s.throttled, Duration::from_millis(3));
        assert!(parse_unified_cpu_stat("user_usec 1\n").is_err());
    }

    #[test]
    fn percpu_counters() {
        assert_eq!(
            parse_percpu("407638957079 434635495192 \n"),
            Ok(vec![407_638_957_079, 434_635_495_192])
        );
        assert_eq!(parse_percpu("1 x"), Err("x"));
        assert_eq!(parse_percpu(""), Ok(vec![]));
    }

    #[test]
    fn this_machines_root_cpuacct_and_memory_stat() {
        let h = Hierarchy::default();
        if h.has(Controller::Cpuacct) {
            let a = cpuacct_usage_percpu(&h, "/").unwrap();
            assert!(!a.is_empty());
            assert!(cpuacct_usage(&h, "/").unwrap() > Duration::ZERO);
        } else {
            eprintln!("skipping cpuacct: not mounted at {}", h.root().display());
        }
        if h.has(Controller::Memory) {
            let s = memory_stat(&h, "/").unwrap();
            assert!(s.file + s.anon > 0, "{s:?}");
        }
    }
}
