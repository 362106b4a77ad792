//! Cheap repeated readings of one process's (or node's) groups.
//!
//! Monitors sample these every few milliseconds, so the files are opened once and re-read
//! from offset 0 with `pread`: cgroup files regenerate their content on every read at
//! offset 0, and this costs one system call instead of open + read + close.

use crate::hierarchy::{Controller, Hierarchy};
use crate::procfs::current_paths;
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

/// The value of `key` in `key value` lines; `Err(line)` if its value is not a number.
fn keyed<'t>(text: &'t str, key: &str) -> Result<Option<u64>, &'t str> {
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        if parts.next() == Some(key) {
            return match parts.next().and_then(|v| v.parse().ok()) {
                Some(v) => Ok(Some(v)),
                None => Err(line),
            };
        }
    }
    Ok(None)
}

#[derive(Debug)]
struct MemoryFiles {
    usage: Opened,
    limit: Opened,
    oom_control: Opened,
}

#[derive(Debug)]
struct CpuFiles {
    stat: Opened,
    quota: Opened,
    period: Opened,
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
                Some(CpuFiles {
                    stat: Opened::open(&dir, "cpu.stat")?,
                    quota: Opened::open(&dir, "cpu.cfs_quota_us")?,
                    period: Opened::open(&dir, "cpu.cfs_period_us")?,
                })
            }
            None => None,
        };
        Ok(Reader { memory, cpu })
    }

    /// Readings of this process's own groups in the system hierarchy; `None` when it
    /// runs in no (non-root) v1 memory or cpu group, or their files cannot be opened.
    /// Opening needs no write access, so this works without root.
    pub fn for_self() -> Option<Reader> {
        let paths = current_paths()?;
        match Reader::for_paths(&Hierarchy::default(), &paths) {
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

    /// Memory charged to the group (`memory.usage_in_bytes`: resident pages and page
    /// cache of its tasks, and kernel memory they caused), bytes.
    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        self.mem()?.usage.read_u64()
    }

    /// The group's memory limit in bytes; 0 when it has none.
    pub fn memory_limit(&self) -> Result<u64, CgroupError> {
        let v = self.mem()?.limit.read_u64()?;
        Ok(if v >= UNLIMITED { 0 } else { v })
    }

    /// How many tasks the OOM killer has killed in the group (the `oom_kill` line of
    /// `memory.oom_control`; kernels before 4.13 lack it and read as 0).
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        Ok(self.mem()?.oom_control.read_key("oom_kill")?.unwrap_or(0))
    }

    /// The group's CFS throttling counters.
    pub fn cpu_stat(&self) -> Result<CpuStat, CgroupError> {
        let f = &self.cpu()?.stat;
        let mut buf = [0u8; 1024];
        let text = f.read(&mut buf)?;
        parse_cpu_stat(text).map_err(|line| f.bad(line))
    }

    /// The group's CPU quota in cores (`cfs_quota_us / cfs_period_us`); `None` when it
    /// has no quota.
    pub fn cfs_quota_cores(&self) -> Result<Option<f64>, CgroupError> {
        let c = self.cpu()?;
        let quota = c.quota.read_i64()?;
        if quota <= 0 {
            return Ok(None);
        }
        let period = c.period.read_u64()?;
        if period == 0 {
            return Err(c.period.bad("0"));
        }
        Ok(Some(quota as f64 / period as f64))
    }
}

/// `cpu.stat` counters (`nr_periods`, `nr_throttled`, `throttled_time`; other lines, such
/// as `nr_bursts` on newer kernels, are ignored).
fn parse_cpu_stat(text: &str) -> Result<CpuStat, &str> {
    Ok(CpuStat {
        nr_periods: keyed(text, "nr_periods")?.unwrap_or(0),
        nr_throttled: keyed(text, "nr_throttled")?.unwrap_or(0),
        throttled_time_ns: keyed(text, "throttled_time")?.unwrap_or(0),
    })
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
            parse_cpu_stat("nr_periods 1\n"),
            Ok(CpuStat {
                nr_periods: 1,
                ..Default::default()
            })
        );
        assert_eq!(parse_cpu_stat("nr_periods x\n"), Err("nr_periods x"));
    }
}
