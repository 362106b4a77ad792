//! The machine's memory: `/proc/meminfo`, the `/proc/vmstat` counters, the active swap
//! areas (`/proc/swaps`) and zswap (its parameters under `/sys/module/zswap/parameters`,
//! its statistics under debugfs).
//!
//! What it owns: parsing those files (pure functions, tested on fixed text), one-shot
//! readings, cheap repeated readers for monitors ([`MeminfoReader`], [`VmstatReader`]:
//! opened once, re-read from offset 0), and two zswap settings a harvester changes
//! (`enabled`, `max_pool_percent`), each returning the value it replaced so the caller
//! can put it back. It must not touch anything else under `/sys/module` or debugfs, and
//! it never mounts debugfs: zswap statistics are `None` where it is not mounted.
//!
//! Sizes are bytes (the kernel's kB are KiB); counters are the kernel's (pages for
//! `pswpin`/`pswpout`, events for faults and refaults).

use crate::file::{pairs, read_text, write_text, Sampled};
use crate::HostError;
use std::path::{Path, PathBuf};

/// The system's memory summary.
pub const MEMINFO: &str = "/proc/meminfo";
/// The system's virtual memory counters.
pub const VMSTAT: &str = "/proc/vmstat";
/// The active swap areas.
pub const SWAPS: &str = "/proc/swaps";
/// zswap's module parameters.
pub const ZSWAP_PARAMETERS: &str = "/sys/module/zswap/parameters";
/// zswap's statistics, present only while debugfs is mounted at its usual place.
pub const ZSWAP_DEBUGFS: &str = "/sys/kernel/debug/zswap";

/// `/proc/meminfo`, the fields Granule uses, in bytes. A field this kernel does not
/// report reads as 0 (`Zswap` and `Zswapped` appeared in 5.19).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meminfo {
    /// `MemTotal`: usable RAM.
    pub total: u64,
    /// `MemFree`: RAM nobody uses, not even the page cache.
    pub free: u64,
    /// `MemAvailable`: the kernel's estimate of what could be allocated without swapping.
    pub available: u64,
    pub buffers: u64,
    /// `Cached`: page cache (including tmpfs and shared memory).
    pub cached: u64,
    /// `SwapCached`: swapped-out pages also still in RAM.
    pub swap_cached: u64,
    pub active_anon: u64,
    pub inactive_anon: u64,
    pub active_file: u64,
    pub inactive_file: u64,
    /// `AnonPages`: anonymous memory mapped into processes.
    pub anon_pages: u64,
    pub shmem: u64,
    pub dirty: u64,
    pub swap_total: u64,
    pub swap_free: u64,
    /// `Zswap`: RAM the zswap pool takes (compressed).
    pub zswap: u64,
    /// `Zswapped`: what the pages in zswap would take uncompressed.
    pub zswapped: u64,
}

impl Meminfo {
    /// Swap space in use, bytes.
    pub fn swap_used(&self) -> u64 {
        self.swap_total.saturating_sub(self.swap_free)
    }
}

/// Parse the text of `/proc/meminfo`. `Err(line)` names a line of a known field whose
/// value is not a number; `MemTotal` must be there.
pub fn parse_meminfo(text: &str) -> Result<Meminfo, &str> {
    let mut m = Meminfo::default();
    let mut seen_total = false;
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let field = match key {
            "MemTotal" => {
                seen_total = true;
                &mut m.total
            }
            "MemFree" => &mut m.free,
            "MemAvailable" => &mut m.available,
            "Buffers" => &mut m.buffers,
            "Cached" => &mut m.cached,
            "SwapCached" => &mut m.swap_cached,
            "Active(anon)" => &mut m.active_anon,
            "Inactive(anon)" => &mut m.inactive_anon,
            "Active(file)" => &mut m.active_file,
            "Inactive(file)" => &mut m.inactive_file,
            "AnonPages" => &mut m.anon_pages,
            "Shmem" => &mut m.shmem,
            "Dirty" => &mut m.dirty,
            "SwapTotal" => &mut m.swap_total,
            "SwapFree" => &mut m.swap_free,
            "Zswap" => &mut m.zswap,
            "Zswapped" => &mut m.zswapped,
            _ => continue,
        };
        *field = meminfo_bytes(rest).ok_or(line)?;
    }
    if seen_total {
        Ok(m)
    } else {
        Err("no MemTotal line")
    }
}

/// `   24684084 kB` → bytes. Lines without a unit (`HugePages_Total`) are counts.
fn meminfo_bytes(value: &str) -> Option<u64> {
    let mut parts = value.split_ascii_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        None => Some(n),
        Some("kB") => n.checked_mul(1024),
        Some(_) => None,
    }
}

/// The system's memory summary now.
pub fn meminfo() -> Result<Meminfo, HostError> {
    let text = read_text(Path::new(MEMINFO))?;
    parse_meminfo(&text).map_err(|line| HostError::parse(MEMINFO, line))
}

/// `/proc/meminfo` read again and again cheaply (see the module doc).
#[derive(Debug)]
pub struct MeminfoReader(Sampled);

impl MeminfoReader {
    /// The system's `/proc/meminfo`.
    pub fn open() -> Result<MeminfoReader, HostError> {
        Self::open_at(MEMINFO)
    }

    /// A file in the same format elsewhere (tests use a fake one).
    pub fn open_at(path: impl Into<PathBuf>) -> Result<MeminfoReader, HostError> {
        Ok(MeminfoReader(Sampled::open(path)?))
    }

    pub fn read(&mut self) -> Result<Meminfo, HostError> {
        let path = self.0.path().to_path_buf();
        let text = self.0.read()?;
        parse_meminfo(text).map_err(|line| HostError::parse(path, line))
    }
}

/// Counters from `/proc/vmstat` (monotonic since boot; compare two readings with
/// [`Vmstat::since`]). A counter this kernel lacks reads as 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vmstat {
    /// Pages read in from swap.
    pub pswpin: u64,
    /// Pages written out to swap.
    pub pswpout: u64,
    /// Page faults, minor and major.
    pub pgfault: u64,
    /// Faults that had to read from disk or swap.
    pub pgmajfault: u64,
    /// Anonymous pages faulted back soon after they were reclaimed (thrashing).
    pub workingset_refault_anon: u64,
    /// File pages faulted back soon after they were reclaimed.
    pub workingset_refault_file: u64,
    pub workingset_activate_anon: u64,
    pub workingset_activate_file: u64,
    /// Pages scanned and reclaimed by kswapd and by allocating tasks (direct reclaim).
    pub pgscan_kswapd: u64,
    pub pgscan_direct: u64,
    pub pgsteal_kswapd: u64,
    pub pgsteal_direct: u64,
    /// Pages loaded from / stored into zswap, and written back from it to swap.
    pub zswpin: u64,
    pub zswpout: u64,
    pub zswpwb: u64,
    /// OOM kills, machine-wide.
    pub oom_kill: u64,
}

impl Vmstat {
    /// What each counter grew by since `earlier` (0 where it went back: a wrap or a
    /// reading of another machine).
    pub fn since(&self, earlier: &Vmstat) -> Vmstat {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        Vmstat {
            pswpin: d(self.pswpin, earlier.pswpin),
            pswpout: d(self.pswpout, earlier.pswpout),
            pgfault: d(self.pgfault, earlier.pgfault),
            pgmajfault: d(self.pgmajfault, earlier.pgmajfault),
            workingset_refault_anon: d(
                self.workingset_refault_anon,
                earlier.workingset_refault_anon,
            ),
            workingset_refault_file: d(
                self.workingset_refault_file,
                earlier.workingset_refault_file,
            ),
            workingset_activate_anon: d(
                self.workingset_activate_anon,
                earlier.workingset_activate_anon,
            ),
            workingset_activate_file: d(
                self.workingset_activate_file,
                earlier.workingset_activate_file,
            ),
            pgscan_kswapd: d(self.pgscan_kswapd, earlier.pgscan_kswapd),
            pgscan_direct: d(self.pgscan_direct, earlier.pgscan_direct),
            pgsteal_kswapd: d(self.pgsteal_kswapd, earlier.pgsteal_kswapd),
            pgsteal_direct: d(self.pgsteal_direct, earlier.pgsteal_direct),
            zswpin: d(self.zswpin, earlier.zswpin),
            zswpout: d(self.zswpout, earlier.zswpout),
            zswpwb: d(self.zswpwb, earlier.zswpwb),
            oom_kill: d(self.oom_kill, earlier.oom_kill),
        }
    }
}

/// Parse the text of `/proc/vmstat` (lines `name value`; unknown names are skipped).
pub fn parse_vmstat(text: &str) -> Vmstat {
    let mut v = Vmstat::default();
    for (key, value) in pairs(text) {
        let field = match key {
            "pswpin" => &mut v.pswpin,
            "pswpout" => &mut v.pswpout,
            "pgfault" => &mut v.pgfault,
            "pgmajfault" => &mut v.pgmajfault,
            "workingset_refault_anon" => &mut v.workingset_refault_anon,
            "workingset_refault_file" => &mut v.workingset_refault_file,
            "workingset_activate_anon" => &mut v.workingset_activate_anon,
            "workingset_activate_file" => &mut v.workingset_activate_file,
            "pgscan_kswapd" => &mut v.pgscan_kswapd,
            "pgscan_direct" => &mut v.pgscan_direct,
            "pgsteal_kswapd" => &mut v.pgsteal_kswapd,
            "pgsteal_direct" => &mut v.pgsteal_direct,
            "zswpin" => &mut v.zswpin,
            "zswpout" => &mut v.zswpout,
            "zswpwb" => &mut v.zswpwb,
            "oom_kill" => &mut v.oom_kill,
            _ => continue,
        };
        *field = value;
    }
    v
}

/// The system's counters now.
pub fn vmstat() -> Result<Vmstat, HostError> {
    Ok(parse_vmstat(&read_text(Path::new(VMSTAT))?))
}

/// One counter of `/proc/vmstat` by name (for counters [`Vmstat`] does not name);
/// `None` when this kernel lacks it.
pub fn vmstat_counter(name: &str) -> Result<Option<u64>, HostError> {
    let text = read_text(Path::new(VMSTAT))?;
    let value = pairs(&text).find(|(k, _)| *k == name).map(|(_, v)| v);
    Ok(value)
}

/// `/proc/vmstat` read again and again cheaply (see the module doc).
#[derive(Debug)]
pub struct VmstatReader(Sampled);

impl VmstatReader {
    /// The system's `/proc/vmstat`.
    pub fn open() -> Result<VmstatReader, HostError> {
        Self::open_at(VMSTAT)
    }

    /// A file in the same format elsewhere (tests use a fake one).
    pub fn open_at(path: impl Into<PathBuf>) -> Result<VmstatReader, HostError> {
        Ok(VmstatReader(Sampled::open(path)?))
    }

    pub fn read(&mut self) -> Result<Vmstat, HostError> {
        Ok(parse_vmstat(self.0.read()?))
    }
}

/// One active swap area (a line of `/proc/swaps`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwapArea {
    /// The file or device.
    pub path: String,
    /// `file` or `partition`.
    pub kind: String,
    pub size_bytes: u64,
    pub used_bytes: u64,
    /// Higher is used first.
    pub priority: i32,
}

/// Parse the text of `/proc/swaps` (a header line, then one line per area). `Err(line)`
/// names a line that is not an area.
pub fn parse_swaps(text: &str) -> Result<Vec<SwapArea>, &str> {
    let mut areas = Vec::new();
    for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        // The kernel escapes blanks in the path (`\040`), so fields split on blanks.
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        let [path, kind, size, used, prio] = f[..] else {
            return Err(line);
        };
        let kib = |v: &str| v.parse::<u64>().ok().and_then(|k| k.checked_mul(1024));
        areas.push(SwapArea {
            path: unescape_octal(path),
            kind: kind.to_string(),
            size_bytes: kib(size).ok_or(line)?,
            used_bytes: kib(used).ok_or(line)?,
            priority: prio.parse().map_err(|_| line)?,
        });
    }
    Ok(areas)
}

/// Undo the kernel's `\ooo` escapes of blanks and backslashes in paths it prints.
pub(crate) fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let digits = b.get(i + 1..i + 4);
        if let (b'\\', Some(&[d1, d2, d3])) = (b[i], digits) {
            if [d1, d2, d3].iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = u32::from(d1 - b'0') * 64 + u32::from(d2 - b'0') * 8 + u32::from(d3 - b'0');
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The active swap areas now (empty when there is no swap).
pub fn swaps() -> Result<Vec<SwapArea>, HostError> {
    let text = read_text(Path::new(SWAPS))?;
    parse_swaps(&text).map_err(|line| HostError::parse(SWAPS, line))
}

/// zswap's parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZswapParams {
    pub enabled: bool,
    /// The compression algorithm (`lzo`, `lz4`, `zstd`, ...).
    pub compressor: String,
    /// The largest share of RAM the pool may take, percent.
    pub max_pool_percent: u32,
    /// The allocator of the pool (`zsmalloc`, ...); kernels from 6.15 have only one and no
    /// parameter.
    pub zpool: Option<String>,
    /// Once full, the pool accepts pages again below this share of its maximum, percent.
    pub accept_threshold_percent: Option<u32>,
    /// Whether the pool is shrunk (written back to swap) under memory pressure.
    pub shrinker_enabled: Option<bool>,
}

/// zswap's statistics (from debugfs). Sizes in bytes, the rest are counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZswapStats {
    /// RAM the compressed pool takes.
    pub pool_total_size: u64,
    /// Pages stored in the pool.
    pub stored_pages: u64,
    /// Pages written back from the pool to the swap device.
    pub written_back_pages: u64,
    /// Times the pool was full.
    pub pool_limit_hit: u64,
    /// Stores refused: no memory to allocate, compression failed or was poor, ...
    pub reject_alloc_fail: u64,
    pub reject_compress_fail: u64,
    pub reject_compress_poor: u64,
    pub reject_kmemcache_fail: u64,
    pub reject_reclaim_fail: u64,
}

/// zswap: its parameters and statistics, at the system's places or in a fake tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Zswap {
    params: PathBuf,
    debugfs: PathBuf,
}

impl Default for Zswap {
    fn default() -> Self {
        Zswap::system()
    }
}

impl Zswap {
    /// The system's zswap.
    pub fn system() -> Zswap {
        Zswap::at(ZSWAP_PARAMETERS, ZSWAP_DEBUGFS)
    }

    /// A zswap whose parameters and statistics directories are given (tests).
    pub fn at(params: impl Into<PathBuf>, debugfs: impl Into<PathBuf>) -> Zswap {
        Zswap {
            params: params.into(),
            debugfs: debugfs.into(),
        }
    }

    /// Whether this kernel has zswap at all.
    pub fn present(&self) -> bool {
        self.params.join("enabled").is_file()
    }

    /// The parameters now.
    pub fn params(&self) -> Result<ZswapParams, HostError> {
        let read = |name: &str| -> Result<String, HostError> {
            Ok(read_text(&self.params.join(name))?.trim().to_string())
        };
        let optional = |name: &str| -> Option<String> {
            let p = self.params.join(name);
            p.is_file()
                .then(|| read_text(&p).ok())
                .flatten()
                .map(|s| s.trim().to_string())
        };
        let enabled = read("enabled")?;
        let max_pool = read("max_pool_percent")?;
        Ok(ZswapParams {
            enabled: parse_bool(&enabled)
                .ok_or_else(|| HostError::parse(self.params.join("enabled"), &enabled))?,
            compressor: read("compressor")?,
            max_pool_percent: max_pool
                .parse()
                .map_err(|_| HostError::parse(self.params.join("max_pool_percent"), &max_pool))?,
            zpool: optional("zpool"),
            accept_threshold_percent: optional("accept_threshold_percent")
                .and_then(|v| v.parse().ok()),
            shrinker_enabled: optional("shrinker_enabled").and_then(|v| parse_bool(&v)),
        })
    }

    /// Turn zswap on or off; returns whether it was on, to restore it with. Turning it
    /// off leaves pages already in the pool there (they are loaded back as they fault).
    pub fn set_enabled(&self, on: bool) -> Result<bool, HostError> {
        let previous = self.params()?.enabled;
        write_text(&self.params.join("enabled"), if on { "Y" } else { "N" })?;
        Ok(previous)
    }

    /// Set the largest share of RAM the pool may take (0..=100 percent); returns the
    /// previous share.
    pub fn set_max_pool_percent(&self, percent: u32) -> Result<u32, HostError> {
        if percent > 100 {
            return Err(HostError::Invalid {
                what: "zswap max_pool_percent (0..=100)",
                value: percent.to_string(),
            });
        }
        let previous = self.params()?.max_pool_percent;
        write_text(&self.params.join("max_pool_percent"), &percent.to_string())?;
        Ok(previous)
    }

    /// The statistics, or `None` when they cannot be seen: debugfs not mounted (the
    /// usual case; mounting it is the operator's choice, not Granule's) or zswap absent.
    /// A statistic this kernel does not have reads as 0.
    pub fn stats(&self) -> Result<Option<ZswapStats>, HostError> {
        if !self.debugfs.join("stored_pages").is_file() {
            return Ok(None);
        }
        let mut s = ZswapStats::default();
        for (name, field) in [
            ("pool_total_size", &mut s.pool_total_size),
            ("stored_pages", &mut s.stored_pages),
            ("written_back_pages", &mut s.written_back_pages),
            ("pool_limit_hit", &mut s.pool_limit_hit),
            ("reject_alloc_fail", &mut s.reject_alloc_fail),
            ("reject_compress_fail", &mut s.reject_compress_fail),
            ("reject_compress_poor", &mut s.reject_compress_poor),
            ("reject_kmemcache_fail", &mut s.reject_kmemcache_fail),
            ("reject_reclaim_fail", &mut s.reject_reclaim_fail),
        ] {
            let p = self.debugfs.join(name);
            if p.is_file() {
                *field = crate::file::read_parsed(&p)?;
            }
        }
        Ok(Some(s))
    }
}

/// A kernel boolean parameter: `Y`/`N` (also `1`/`0`).
fn parse_bool(s: &str) -> Option<bool> {
    match s.trim() {
        "Y" | "y" | "1" => Some(true),
        "N" | "n" | "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const MEMINFO_TEXT: &str = "MemTotal:       24684084 kB\nMemFree:        19055704 kB\n\
        MemAvailable:   24202852 kB\nBuffers:           15436 kB\nCached:          5148660 kB\n\
        SwapCached:            0 kB\nActive:          1377600 kB\nActive(anon):       1528 kB\n\
        Inactive(anon):     5132 kB\nActive(file):    1376072 kB\nInactive(file):  3779148 kB\n\
        SwapTotal:       1048576 kB\nSwapFree:         524288 kB\nZswap:               100 kB\n\
        Zswapped:            400 kB\nDirty:               200 kB\nAnonPages:         12168 kB\n\
        Shmem:              8872 kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n";

    #[test]
    fn meminfo_fields_are_bytes() {
        let m = parse_meminfo(MEMINFO_TEXT).unwrap();
        assert_eq!(m.total, 24_684_084 * 1024);
        assert_eq!(m.available, 24_202_852 * 1024);
        assert_eq!(m.cached, 5_148_660 * 1024);
        assert_eq!(m.active_anon, 1528 * 1024);
        assert_eq!(m.inactive_file, 3_779_148 * 1024);
        assert_eq!(m.swap_used(), 512 << 20);
        assert_eq!((m.zswap, m.zswapped), (100 * 1024, 400 * 1024));
        // Old kernels: missing fields are 0; MemTotal is required; garbage is an error.
        let old = parse_meminfo("MemTotal: 1 kB\nMemFree: 1 kB\n").unwrap();
        assert_eq!((old.total, old.available, old.zswap), (1024, 0, 0));
        assert!(parse_meminfo("MemFree: 1 kB\n").is_err());
        assert_eq!(
            parse_meminfo("MemTotal: 1 kB\nMemFree: lots\n"),
            Err("MemFree: lots")
        );
        assert_eq!(parse_meminfo("MemTotal: 1 MB\n"), Err("MemTotal: 1 MB"));
    }

    #[test]
    fn vmstat_counters_and_deltas() {
        let a = parse_vmstat(
            "nr_free_pages 1952144\npswpin 10\npswpout 20\npgfault 1000\npgmajfault 3639\n\
             workingset_refault_anon 5\nworkingset_refault_file 465812\nzswpout 7\nbogus\n",
        );
        assert_eq!(a.pswpin, 10);
        assert_eq!(a.pgmajfault, 3639);
        assert_eq!(a.workingset_refault_file, 465_812);
        assert_eq!(a.zswpout, 7);
        assert_eq!(a.oom_kill, 0);
        let b = Vmstat {
            pswpin: 15,
            pgmajfault: 3640,
            ..a
        };
        let d = b.since(&a);
        assert_eq!((d.pswpin, d.pgmajfault, d.pswpout), (5, 1, 0));
        assert_eq!(a.since(&b).pswpin, 0, "never negative");
    }

    #[test]
    fn swap_areas() {
        let text = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n\
                    /swapfile                               file\t\t1048572\t\t0\t\t-2\n\
                    /dev/vdb                                partition\t2097148\t\t1024\t\t10\n\
                    /my\\040swap                             file\t\t4\t\t0\t\t-3\n";
        let a = parse_swaps(text).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0].path, "/swapfile");
        assert_eq!(a[0].kind, "file");
        assert_eq!(a[0].size_bytes, 1_048_572 * 1024);
        assert_eq!(a[0].priority, -2);
        assert_eq!(a[1].used_bytes, 1024 * 1024);
        assert_eq!(a[2].path, "/my swap");
        // No swap: a header only.
        assert_eq!(
            parse_swaps("Filename\tType\tSize\tUsed\tPriority\n").unwrap(),
            vec![]
        );
        assert!(parse_swaps("h\n/x file 1 2\n").is_err());
        assert_eq!(unescape_octal("a\\134b\\"), "a\\b\\");
    }

    #[test]
    fn this_machines_memory_reads() {
        let m = meminfo().unwrap();
        assert!(m.total > 0 && m.free <= m.total, "{m:?}");
        let mut r = MeminfoReader::open().unwrap();
        assert_eq!(r.read().unwrap().total, m.total);
        let v = vmstat().unwrap();
        let mut vr = VmstatReader::open().unwrap();
        assert!(vr.read().unwrap().pgfault >= v.pgfault);
        assert!(vmstat_counter("pgfault").unwrap().is_some());
        assert_eq!(vmstat_counter("no_such_counter").unwrap(), None);
        let areas = swaps().unwrap();
        let total: u64 = areas.iter().map(|a| a.size_bytes).sum();
        // /proc/swaps and SwapTotal agree (within a page of rounding per area).
        assert!(total.abs_diff(m.swap_total) <= 4096 * areas.len() as u64 + 4096);
        let z = Zswap::system();
        if z.present() {
            let p = z.params().unwrap();
            assert!(!p.compressor.is_empty());
            assert!(p.max_pool_percent <= 100);
            // Without debugfs (this machine) there are no statistics; with it, some.
            let _ = z.stats().unwrap();
        }
    }

    /// A fake zswap: parameters are set and the old values come back for restoring.
    #[test]
    fn zswap_settings_in_a_fake_tree() {
        let t = tempfile::tempdir().unwrap();
        let params = t.path().join("parameters");
        let debug = t.path().join("debug");
        fs::create_dir_all(&params).unwrap();
        for (f, v) in [
            ("enabled", "N\n"),
            ("compressor", "lzo\n"),
            ("max_pool_percent", "20\n"),
            ("accept_threshold_percent", "90\n"),
            ("shrinker_enabled", "N\n"),
        ] {
            fs::write(params.join(f), v).unwrap();
        }
        let z = Zswap::at(&params, &debug);
        assert!(z.present());
        let p = z.params().unwrap();
        assert_eq!(
            p,
            ZswapParams {
                enabled: false,
                compressor: "lzo".into(),
                max_pool_percent: 20,
                zpool: None,
                accept_threshold_percent: Some(90),
                shrinker_enabled: Some(false),
            }
        );
        assert!(!z.set_enabled(true).unwrap());
        assert_eq!(fs::read_to_string(params.join("enabled")).unwrap(), "Y");
        assert!(z.params().unwrap().enabled);
        assert!(
            z.set_enabled(false).unwrap(),
            "the previous value, to restore"
        );
        assert_eq!(z.set_max_pool_percent(35).unwrap(), 20);
        assert_eq!(z.params().unwrap().max_pool_percent, 35);
        assert!(z.set_max_pool_percent(101).is_err());
        assert_eq!(z.params().unwrap().max_pool_percent, 35);

        // Statistics: none without debugfs, then what the files say.
        assert_eq!(z.stats().unwrap(), None);
        fs::create_dir_all(&debug).unwrap();
        fs::write(debug.join("stored_pages"), "12\n").unwrap();
        fs::write(debug.join("pool_total_size"), "16384\n").unwrap();
        let s = z.stats().unwrap().unwrap();
        assert_eq!(
            (s.stored_pages, s.pool_total_size, s.pool_limit_hit),
            (12, 16384, 0)
        );
        fs::write(debug.join("stored_pages"), "many\n").unwrap();
        assert!(z.stats().is_err());

        // Garbage and a kernel without zswap.
        fs::write(params.join("enabled"), "maybe\n").unwrap();
        assert!(z.params().is_err());
        assert!(!Zswap::at(t.path().join("none"), &debug).present());
    }
}
