//! Cheap repeated readings of one process's (or node's) groups, v1 or v2.
//!
//! Monitors sample these every few milliseconds, so the files are opened once and re-read
//! from offset 0 with `pread`: cgroup files regenerate their content on every read at
//! offset 0, and this costs one system call instead of open + read + close.

use crate::file::keyed;
use crate::hierarchy::{Controller, Hierarchy};
use crate::procfs::{current_paths, proc_cgroup_text, unified_path};
use crate::stat::CgroupVersion;
use crate::unified::Unified;
use crate::CgroupError;
use granule_wire::CgroupPaths;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Above this a memory limit means "none": the kernel reports an unlimited group as
/// `PAGE_COUNTER_MAX` pages, i.e. about 2^63 bytes rounded down to a page.
const UNLIMITED: u64 = 1 << 62;

/// CFS bandwidth counters from `cpu.stat` (monotonic; compare two readings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuStat {
    /// Enforcement periods that have elapsed with runnable tasks.
    pub nr_periods: u64,
    /// Of which periods in which the group was throttled.
    pub nr_throttled: u64,
    /// Total time the group's tasks spent throttled, nanoseconds.
    pub throttled_time_ns: u64,
}

/// An open cgroup file and its name (for errors).
#[derive(Debug)]
struct Opened {
    file: File,
    path: PathBuf,
}

impl Opened {
    fn open(dir: &Path, name: &str) -> Result<Opened, CgroupError> {
        let path = dir.join(name);
        let file = File::open(&path).map_err(|e| CgroupError::io("open", &path, e))?;
        Ok(Opened { file, path })
    }

    /// The whole file, read from offset 0 into `buf`.
    fn read<'b>(&self, buf: &'b mut [u8]) -> Result<&'b str, CgroupError> {
        let mut len = 0;
        while len < buf.len() {
            let n = self
                .file
                .read_at(&mut buf[len..], len as u64)
                .map_err(|e| CgroupError::io("read", &self.path, e))?;
            if n == 0 {
                break;
            }
            len += n;
        }
        std::str::from_utf8(&buf[..len]).map_err(|_| self.bad("not UTF-8"))
    }

    fn read_u64(&self) -> Result<u64, CgroupError> {
        let mut buf = [0u8; 64];
        let text = self.read(&mut buf)?.trim();
        text.parse().map_err(|_| self.bad(text))
    }

    fn read_i64(&self) -> Result<i64, CgroupError> {
        let mut buf = [0u8; 64];
        let text = self.read(&mut buf)?.trim();
        text.parse().map_err(|_| self.bad(text))
    }

    /// A v2 limit: a number, or `max` (no limit: `None`).
    fn read_max(&self) -> Result<Option<u64>, CgroupError> {
        let mut buf = [0u8; 64];
        let text = self.read(&mut buf)?.trim();
        if text == "max" {
            return Ok(None);
        }
        text.parse().map(Some).map_err(|_| self.bad(text))
    }

    /// The value of `key` in a `key value` per line file (`None` if the key is absent).
    fn read_key(&self, key: &str) -> Result<Option<u64>, CgroupError> {
        let mut buf = [0u8; 1024];
        let text = self.read(&mut buf)?;
        keyed(text, key).map_err(|line| self.bad(line))
    }

    fn bad(&self, text: &str) -> CgroupError {
        CgroupError::Parse {
            path: self.path.clone(),
            text: text.to_string(),
        }
    }
}

#[derive(Debug)]
struct MemoryFiles {
    version: CgroupVersion,
    /// v1 `memory.usage_in_bytes`, v2 `memory.current`.
    usage: Opened,
    /// v1 `memory.limit_in_bytes`, v2 `memory.max`.
    limit: Opened,
    /// v1 `memory.oom_control`, v2 `memory.events`: both have an `oom_kill` line.
    oom_control: Opened,
}

#[derive(Debug)]
enum CpuFiles {
    V1 {
        stat: Opened,
        quota: Opened,
        period: Opened,
    },
    V2 {
        stat: Opened,
        /// `cpu.max`: `<quota|max> <period>`.
        max: Opened,
    },
}

/// Open files of a memory group and/or a cpu group, for repeated readings.
#[derive(Debug)]
pub struct Reader {
    memory: Option<MemoryFiles>,
    cpu: Option<CpuFiles>,
}

impl Reader {
    /// Readings of the groups `paths` names in hierarchy `h` (either may be absent).
    pub fn for_paths(h: &Hierarchy, paths: &CgroupPaths) -> Result<Reader, CgroupError> {
        let memory = match &paths.memory {
            Some(rel) => {
                let dir = h.group_dir(Controller::Memory, rel)?;
                Some(MemoryFiles {
                    version: CgroupVersion::V1,
                    usage: Opened::open(&dir, "memory.usage_in_bytes")?,
                    limit: Opened::open(&dir, "memory.limit_in_bytes")?,
                    oom_control: Opened::open(&dir, "memory.oom_control")?,
                })
            }
            None => None,
        };
        let cpu = match &paths.cpu {
            Some(rel) => {
                let dir = h.group_dir(Controller::Cpu, rel)?;
                Some(CpuFiles::V1 {
                    stat: Opened::open(&dir, "cpu.stat")?,
                    quota: Opened::open(&dir, "cpu.cfs_quota_us")?,
                    period: Opened::open(&dir, "cpu.cfs_period_us")?,
                })
            }
            None => None,
        };
        Ok(Reader { memory, cpu })
    }

    /// Readings of the v2 group `rel` of a unified hierarchy: its memory files where the
    /// memory controller is enabled for it (`memory.current`, `memory.max`,
    /// `memory.events`), its cpu files where the cpu controller is (`cpu.stat`,
    /// `cpu.max`). Fails with [`CgroupError::NoController`] when it has neither.
    pub fn for_unified(u: &Unified, rel: &str) -> Result<Reader, CgroupError> {
        let dir = u.group_dir(rel)?;
        let memory = if dir.join("memory.current").is_file() {
            Some(MemoryFiles {
                version: CgroupVersion::V2,
                usage: Opened::open(&dir, "memory.current")?,
                limit: Opened::open(&dir, "memory.max")?,
                oom_control: Opened::open(&dir, "memory.events")?,
            })
        } else {
            None
        };
        let cpu = if dir.join("cpu.max").is_file() {
            Some(CpuFiles::V2 {
                stat: Opened::open(&dir, "cpu.stat")?,
                max: Opened::open(&dir, "cpu.max")?,
            })
        } else {
            None
        };
        if memory.is_none() && cpu.is_none() {
            return Err(CgroupError::NoController(Controller::Memory));
        }
        Ok(Reader { memory, cpu })
    }

    /// Readings of this process's own groups: its v1 memory and cpu groups in the system
    /// hierarchy; where it runs in none (a pure v2 system, e.g. inside a container), its
    /// v2 group if that has memory or cpu files. `None` when there is nothing of its own
    /// to read (root groups only) or the files cannot be opened. Opening needs no write
    /// access, so this works without root.
    pub fn for_self() -> Option<Reader> {
        let opened = match current_paths() {
            Some(paths) => Reader::for_paths(&Hierarchy::default(), &paths),
            None => {
                let rel = unified_path(&proc_cgroup_text(std::process::id())?)?;
                if rel == "/" {
                    return None;
                }
                Reader::for_unified(&Unified::detect()?, &rel)
            }
        };
        match opened {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::debug!("not reading this process's cgroups: {e}");
                None
            }
        }
    }

    /// Whether a memory group is being read.
    pub fn has_memory(&self) -> bool {
        self.memory.is_some()
    }

    /// Whether a cpu group is being read.
    pub fn has_cpu(&self) -> bool {
        self.cpu.is_some()
    }

    fn mem(&self) -> Result<&MemoryFiles, CgroupError> {
        self.memory
            .as_ref()
            .ok_or(CgroupError::NoController(Controller::Memory))
    }

    fn cpu(&self) -> Result<&CpuFiles, CgroupError> {
        self.cpu
            .as_ref()
            .ok_or(CgroupError::NoController(Controller::Cpu))
    }

    /// Memory charged to the group (v1 `memory.usage_in_bytes`, v2 `memory.current`:
    /// resident pages and page cache of its tasks, and kernel memory they caused), bytes.
    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        self.mem()?.usage.read_u64()
    }

    /// The group's memory limit in bytes; 0 when it has none.
    pub fn memory_limit(&self) -> Result<u64, CgroupError> {
        let m = self.mem()?;
        let v = match m.version {
            CgroupVersion::V1 => Some(m.limit.read_u64()?),
            CgroupVersion::V2 => m.limit.read_max()?,
        };
        Ok(v.filter(|&v| v < UNLIMITED).unwrap_or(0))
    }

    /// Which interface the memory files follow (`None` without a memory group).
    pub fn memory_version(&self) -> Option<CgroupVersion> {
        self.memory.as_ref().map(|m| m.version)
    }

    /// How many tasks the OOM killer has killed in the group (the `oom_kill` line of v1
    /// `memory.oom_control` or v2 `memory.events`; v1 kernels before 4.13 lack it and read
    /// as 0).
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        Ok(self.mem()?.oom_control.read_key("oom_kill")?.unwrap_or(0))
    }

    /// The group's CFS throttling counters.
    pub fn cpu_stat(&self) -> Result<CpuStat, CgroupError> {
        let (f, version) = match self.cpu()? {
            CpuFiles::V1 { stat, .. } => (stat, CgroupVersion::V1),
            CpuFiles::V2 { stat, .. } => (stat, CgroupVersion::V2),
        };
        let mut buf = [0u8; 1024];
        let text = f.read(&mut buf)?;
        parse_cpu_stat(text, version).map_err(|line| f.bad(line))
    }

    /// The group's CPU quota in cores (v1 `cfs_quota_us / cfs_period_us`, v2 `cpu.max`);
    /// `None` when it has no quota.
    pub fn cfs_quota_cores(&self) -> Result<Option<f64>, CgroupError> {
        match self.cpu()? {
            CpuFiles::V1 { quota, period, .. } => {
                let quota = quota.read_i64()?;
                if quota <= 0 {
                    return Ok(None);
                }
                let period_us = period.read_u64()?;
                if period_us == 0 {
                    return Err(period.bad("0"));
                }
                Ok(Some(quota as f64 / period_us as f64))
            }
            CpuFiles::V2 { max, .. } => {
                let mut buf = [0u8; 64];
                let text = max.read(&mut buf)?.trim();
                parse_cpu_max(text).map_err(|t| max.bad(t))
            }
        }
    }
}

/// `cpu.stat` throttling counters: v1 `nr_periods`, `nr_throttled`, `throttled_time`
/// (ns); v2 the same counts and `throttled_usec`. Other lines (`nr_bursts`, v2's usage)
/// are ignored.
fn parse_cpu_stat(text: &str, version: CgroupVersion) -> Result<CpuStat, &str> {
    let throttled_time_ns = match version {
        CgroupVersion::V1 => keyed(text, "throttled_time")?.unwrap_or(0),
        CgroupVersion::V2 => keyed(text, "throttled_usec")?
            .unwrap_or(0)
            .saturating_mul(1000),
    };
    Ok(CpuStat {
        nr_periods: keyed(text, "nr_periods")?.unwrap_or(0),
        nr_throttled: keyed(text, "nr_throttled")?.unwrap_or(0),
        throttled_time_ns,
    })
}

/// A v2 `cpu.max` (`max 100000` or `50000 100000`) as cores; `None` without a quota.
fn parse_cpu_max(text: &str) -> Result<Option<f64>, &str> {
    let mut parts = text.split_ascii_whitespace();
    let quota = parts.next().ok_or(text)?;
    if quota == "max" {
        return Ok(None);
    }
    let quota: u64 = quota.parse().map_err(|_| text)?;
    let period: u64 = match parts.next() {
        Some(p) => p.parse().map_err(|_| text)?,
        None => 100_000,
    };
    if period == 0 {
        return Err(text);
    }
    Ok(Some(quota as f64 / period as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// A fake group with the files a Reader opens.
    fn fake_group(root: &Path, rel: &str) {
        let mem = root.join("memory").join(rel.trim_start_matches('/'));
        let cpu = root.join("cpu").join(rel.trim_start_matches('/'));
        fs::create_dir_all(&mem).unwrap();
        fs::create_dir_all(&cpu).unwrap();
        fs::write(mem.join("memory.usage_in_bytes"), "1048576\n").unwrap();
        fs::write(mem.join("memory.limit_in_bytes"), "268435456\n").unwrap();
        fs::write(
            mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        )
        .unwrap();
        fs::write(
            cpu.join("cpu.stat"),
            "nr_periods 120\nnr_throttled 7\nthrottled_time 3500000\nnr_bursts 0\nburst_time 0\n",
        )
        .unwrap();
        fs::write(cpu.join("cpu.cfs_quota_us"), "150000\n").unwrap();
        fs::write(cpu.join("cpu.cfs_period_us"), "100000\n").unwrap();
    }

    #[test]
    fn readings_from_a_fake_group() {
        let t = tempfile::tempdir().unwrap();
        fake_group(t.path(), "/granule/c1-2-0/node0");
        let h = Hierarchy::at(t.path());
        let paths = CgroupPaths {
            memory: Some("/granule/c1-2-0/node0".into()),
            cpu: Some("/granule/c1-2-0/node0".into()),
        };
        let r = Reader::for_paths(&h, &paths).unwrap();
        assert_eq!(r.memory_usage().unwrap(), 1 << 20);
        assert_eq!(r.memory_limit().unwrap(), 256 << 20);
        assert_eq!(r.oom_kills().unwrap(), 3);
        assert_eq!(
            r.cpu_stat().unwrap(),
            CpuStat {
                nr_periods: 120,
                nr_throttled: 7,
                throttled_time_ns: 3_500_000
            }
        );
        assert_eq!(r.cfs_quota_cores().unwrap(), Some(1.5));

        // Re-reading sees new content (the file stays open).
        let dir = t.path().join("memory/granule/c1-2-0/node0");
        fs::write(dir.join("memory.usage_in_bytes"), "2097152\n").unwrap();
        assert_eq!(r.memory_usage().unwrap(), 2 << 20);
        // Unlimited reads as 0; no quota as None; an old kernel's oom_control as 0 kills.
        fs::write(dir.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(r.memory_limit().unwrap(), 0);
        fs::write(
            dir.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\n",
        )
        .unwrap();
        assert_eq!(r.oom_kills().unwrap(), 0);
        let cpu = t.path().join("cpu/granule/c1-2-0/node0");
        fs::write(cpu.join("cpu.cfs_quota_us"), "-1\n").unwrap();
        assert_eq!(r.cfs_quota_cores().unwrap(), None);
        // Garbage is an error naming the file, not a panic.
        fs::write(dir.join("memory.usage_in_bytes"), "lots\n").unwrap();
        let e = r.memory_usage().unwrap_err().to_string();
        assert!(
            e.contains("memory.usage_in_bytes") && e.contains("lots"),
            "{e}"
        );
    }

    #[test]
    fn only_the_named_controllers_are_read() {
        let t = tempfile::tempdir().unwrap();
        fake_group(t.path(), "/g");
        let h = Hierarchy::at(t.path());
        let r = Reader::for_paths(
            &h,
            &CgroupPaths {
                memory: Some("/g".into()),
                cpu: None,
            },
        )
        .unwrap();
        assert!(r.has_memory() && !r.has_cpu());
        assert!(matches!(
            r.cpu_stat(),
            Err(CgroupError::NoController(Controller::Cpu))
        ));
        // A group that does not exist cannot be read.
        let e = Reader::for_paths(
            &h,
            &CgroupPaths {
                memory: Some("/nope".into()),
                cpu: None,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn cpu_stat_lines() {
        assert_eq!(
            parse_cpu_stat("nr_periods 1\n", CgroupVersion::V1),
            Ok(CpuStat {
                nr_periods: 1,
                ..Default::default()
            })
        );
        assert_eq!(
            parse_cpu_stat("nr_periods x\n", CgroupVersion::V1),
            Err("nr_periods x")
        );
        assert_eq!(
            parse_cpu_stat(
                "usage_usec 5\nnr_periods 3\nnr_throttled 1\nthrottled_usec 7\n",
                CgroupVersion::V2
            ),
            Ok(CpuStat {
                nr_periods: 3,
                nr_throttled: 1,
                throttled_time_ns: 7000
            })
        );
        assert_eq!(parse_cpu_max("max 100000"), Ok(None));
        assert_eq!(parse_cpu_max("50000 100000"), Ok(Some(0.5)));
        assert_eq!(parse_cpu_max("150000"), Ok(Some(1.5)));
        assert!(parse_cpu_max("x 1").is_err());
        assert!(parse_cpu_max("1 0").is_err());
        assert!(parse_cpu_max("").is_err());
    }

    /// A fake v2 group: the same readings from v2 files.
    #[test]
    fn readings_from_a_fake_v2_group() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("prod.slice/a");
        fs::create_dir_all(&dir).unwrap();
        for (f, v) in [
            ("memory.current", "1048576\n"),
            ("memory.max", "max\n"),
            ("memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n"),
            (
                "cpu.stat",
                "usage_usec 10\nnr_periods 5\nnr_throttled 2\nthrottled_usec 30\n",
            ),
            ("cpu.max", "200000 100000\n"),
        ] {
            fs::write(dir.join(f), v).unwrap();
        }
        let u = Unified::at(t.path());
        let r = Reader::for_unified(&u, "/prod.slice/a").unwrap();
        assert_eq!(r.memory_version(), Some(CgroupVersion::V2));
        assert_eq!(r.memory_usage().unwrap(), 1 << 20);
        assert_eq!(r.memory_limit().unwrap(), 0, "max is no limit");
        fs::write(dir.join("memory.max"), "268435456\n").unwrap();
        assert_eq!(r.memory_limit().unwrap(), 256 << 20);
        assert_eq!(r.oom_kills().unwrap(), 1);
        assert_eq!(r.cpu_stat().unwrap().throttled_time_ns, 30_000);
        assert_eq!(r.cfs_quota_cores().unwrap(), Some(2.0));
        // A group with neither controller enabled has nothing to read.
        fs::create_dir_all(t.path().join("bare")).unwrap();
        fs::write(t.path().join("bare/cpu.stat"), "usage_usec 1\n").unwrap();
        assert!(matches!(
            Reader::for_unified(&u, "/bare"),
            Err(CgroupError::NoController(_))
        ));
        // Only memory: cpu readings say so.
        fs::remove_file(dir.join("cpu.max")).unwrap();
        let r = Reader::for_unified(&u, "/prod.slice/a").unwrap();
        assert!(r.has_memory() && !r.has_cpu());
    }
}
