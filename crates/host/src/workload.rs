//! Workload groups and page-level readings of other processes, for the memory market.
//!
//! - [`WorkloadGroup`]: a v1 memory cgroup made for a program that is *not* Granule's —
//!   the producer's workload started by `granule producer run -- CMD`, or the
//!   `redis-server` of the harvest benchmark — under `granule-workloads/` (not below
//!   `granule/`, so that it can be adopted as a [`crate::ForeignGroup`] and its limit
//!   adjusted under the foreign-group contract). It is created without a limit, and
//!   removed (rmdir) when it has no tasks left; it never kills anything.
//! - [`swapped_ranges`]: the mappings of a process that have pages in swap
//!   (`/proc/<pid>/smaps`), what the harvester's prefetch advises the kernel to read back.
//! - [`swapped_pages`]: which pages of those mappings are in swap, and in which swap
//!   slot (`/proc/<pid>/pagemap`): the prefetch reads the most recently swapped-out
//!   first, within a budget.
//! - [`clear_referenced`] / [`rollup`]: clearing the pages' referenced bits
//!   (`/proc/<pid>/clear_refs`) and reading back how much of the resident memory was
//!   referenced since (`/proc/<pid>/smaps_rollup`): idle memory at page granularity.

use crate::file::{read_text, write_text};
use crate::hierarchy::{join_group, Controller, Hierarchy};
use crate::{CgroupError, HostError};
use std::path::{Path, PathBuf};

/// The directory (in the memory hierarchy) that holds one group per workload.
pub const WORKLOAD_DIR: &str = "granule-workloads";

/// A memory group for one foreign workload (see the module doc).
#[derive(Debug)]
pub struct WorkloadGroup {
    dir: PathBuf,
    rel: String,
    removed: bool,
}

impl WorkloadGroup {
    /// Create `granule-workloads/<name>` in the memory hierarchy of `h` (a group of that
    /// name left from before is taken over as it is).
    pub fn create(h: &Hierarchy, name: &str) -> Result<WorkloadGroup, CgroupError> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(CgroupError::BadPath {
                path: name.to_string(),
                why: "a workload group's name is one plain path component",
            });
        }
        let rel = format!("/{WORKLOAD_DIR}/{name}");
        let dir = join_group(h.controller_dir(Controller::Memory), &rel)?;
        std::fs::create_dir_all(&dir).map_err(|e| CgroupError::io("create", &dir, e))?;
        Ok(WorkloadGroup {
            dir,
            rel,
            removed: false,
        })
    }

    /// The group's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The group's path as `/proc/<pid>/cgroup` names it (`/granule-workloads/<name>`).
    pub fn rel(&self) -> &str {
        &self.rel
    }

    /// Move process `pid` into the group.
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        crate::group::write_value(&self.dir.join("cgroup.procs"), pid)
    }

    /// The processes in the group.
    pub fn pids(&self) -> Result<Vec<u32>, CgroupError> {
        crate::group::group_pids(&self.dir)
    }

    /// Remove the group; [`CgroupError::Busy`] while processes are still in it (stop them
    /// first: this never kills). A group already gone is fine.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.try_remove()
    }

    fn try_remove(&mut self) -> Result<(), CgroupError> {
        if self.removed {
            return Ok(());
        }
        let pids = self.pids()?;
        if !pids.is_empty() {
            return Err(CgroupError::Busy {
                path: self.dir.clone(),
                pids,
            });
        }
        // A task that just exited may keep the group busy for a moment.
        let mut last = None;
        for _ in 0..50 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => {
                    self.removed = true;
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.removed = true;
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Err(CgroupError::io(
            "remove",
            &self.dir,
            last.unwrap_or_else(|| std::io::Error::other("busy")),
        ))
    }
}

impl Drop for WorkloadGroup {
    fn drop(&mut self) {
        if let Err(e) = self.try_remove() {
            tracing::warn!("cannot remove workload group {}: {e}", self.dir.display());
        }
    }
}

/// One mapping with pages in swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwappedRange {
    pub start: u64,
    pub len: u64,
    /// Bytes of the mapping in swap (or zswap).
    pub swap_bytes: u64,
}

/// Parse the text of `/proc/<pid>/smaps`: the mappings whose `Swap:` is above zero.
pub fn parse_swapped(text: &str) -> Vec<SwappedRange> {
    let mut out = Vec::new();
    let mut current: Option<(u64, u64)> = None;
    for line in text.lines() {
        let first = line.split_ascii_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                current = Some((a, b.saturating_sub(a)));
                continue;
            }
        }
        if let (Some(rest), Some((start, len))) = (line.strip_prefix("Swap:"), current) {
            let kib = rest
                .split_ascii_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            if kib > 0 {
                out.push(SwappedRange {
                    start,
                    len,
                    swap_bytes: kib * 1024,
                });
            }
        }
    }
    out
}

/// The mappings of process `pid` with pages in swap now.
pub fn swapped_ranges(pid: u32) -> Result<Vec<SwappedRange>, HostError> {
    let text = read_text(&PathBuf::from(format!("/proc/{pid}/smaps")))?;
    Ok(parse_swapped(&text))
}

/// Advise the kernel to read the swapped pages of `ranges` of `pid` back (see
/// [`crate::os::prefetch_ranges`]); returns the bytes advised.
pub fn prefetch(pid: u32, ranges: &[SwappedRange]) -> Result<u64, HostError> {
    let r: Vec<(u64, u64)> = ranges.iter().map(|r| (r.start, r.len)).collect();
    crate::os::prefetch_ranges(pid, &r)
        .map_err(|e| HostError::io("process_madvise", format!("/proc/{pid}"), e))
}

/// One page of a process that is in swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwappedPage {
    /// Its virtual address in the process.
    pub addr: u64,
    /// Its swap slot: the swap area's index in the top bits, the offset in the area
    /// below (`type << 50 | offset`). On a swap area that has not wrapped around, slots
    /// are handed out in increasing order, so a larger slot was (roughly) swapped out
    /// later.
    pub slot: u64,
}

/// The swap slot a `/proc/<pid>/pagemap` entry names, if the page is swapped (bit 62 set,
/// bit 63 "present" clear; type in bits 0–4, offset in bits 5–54).
pub fn pagemap_swap_slot(entry: u64) -> Option<u64> {
    if entry & (1 << 62) == 0 || entry & (1 << 63) != 0 {
        return None;
    }
    let kind = entry & 0x1f;
    let offset = (entry >> 5) & ((1 << 50) - 1);
    Some((kind << 50) | offset)
}

/// The pages of `pid` in `ranges` that are in swap now, with their slots
/// (`/proc/<pid>/pagemap`; the slots read as 0 without CAP_SYS_ADMIN, so this needs
/// root to be useful).
pub fn swapped_pages(pid: u32, ranges: &[SwappedRange]) -> Result<Vec<SwappedPage>, HostError> {
    use std::os::unix::fs::FileExt;
    let path = PathBuf::from(format!("/proc/{pid}/pagemap"));
    let file = std::fs::File::open(&path).map_err(|e| HostError::io("open", &path, e))?;
    let page = crate::proc::page_size().max(1);
    let mut out = Vec::new();
    // 64 Ki entries (256 MiB of address space) a read.
    let mut buf = vec![0u8; 8 << 16];
    for r in ranges {
        let first = r.start / page;
        let pages = r.len / page;
        let mut done = 0;
        while done < pages {
            let n = (pages - done).min(1 << 16) as usize;
            let bytes = &mut buf[..n * 8];
            let at = (first + done) * 8;
            let got = file
                .read_at(bytes, at)
                .map_err(|e| HostError::io("read", &path, e))?;
            if got == 0 {
                break;
            }
            for (i, e) in bytes[..got - got % 8].chunks_exact(8).enumerate() {
                let entry = u64::from_le_bytes(e.try_into().unwrap_or([0; 8]));
                if let Some(slot) = pagemap_swap_slot(entry) {
                    out.push(SwappedPage {
                        addr: (first + done + i as u64) * page,
                        slot,
                    });
                }
            }
            done += (got / 8) as u64;
        }
    }
    Ok(out)
}

/// Contiguous address ranges `(start, len)` covering `addrs` (page addresses, any
/// order), adjacent pages merged.
pub fn coalesce_pages(mut addrs: Vec<u64>, page: u64) -> Vec<(u64, u64)> {
    addrs.sort_unstable();
    addrs.dedup();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for a in addrs {
        match out.last_mut() {
            Some((start, len)) if *start + *len == a => *len += page,
            _ => out.push((a, page)),
        }
    }
    out
}

/// Advise the kernel to read back exactly `ranges` (`(start, len)`) of `pid`; returns
/// the bytes advised.
pub fn prefetch_exact(pid: u32, ranges: &[(u64, u64)]) -> Result<u64, HostError> {
    crate::os::prefetch_ranges(pid, ranges)
        .map_err(|e| HostError::io("process_madvise", format!("/proc/{pid}"), e))
}

/// Clear the referenced bits of every page of `pid` (`clear_refs` 1), starting an idle
/// measurement: what is still unreferenced at the next [`rollup`] was idle in between.
pub fn clear_referenced(pid: u32) -> Result<(), HostError> {
    write_text(&PathBuf::from(format!("/proc/{pid}/clear_refs")), "1")
}

/// A process's memory totals (`/proc/<pid>/smaps_rollup`), bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rollup {
    pub rss: u64,
    /// Resident bytes referenced since the last [`clear_referenced`].
    pub referenced: u64,
    pub anonymous: u64,
    pub swap: u64,
}

/// Parse the text of `/proc/<pid>/smaps_rollup`.
pub fn parse_rollup(text: &str) -> Rollup {
    let mut r = Rollup::default();
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(key), Some(v)) = (f.next(), f.next().and_then(|v| v.parse::<u64>().ok())) else {
            continue;
        };
        let field = match key {
            "Rss:" => &mut r.rss,
            "Referenced:" => &mut r.referenced,
            "Anonymous:" => &mut r.anonymous,
            "Swap:" => &mut r.swap,
            _ => continue,
        };
        *field = v * 1024;
    }
    r
}

/// The memory totals of `pid` now.
pub fn rollup(pid: u32) -> Result<Rollup, HostError> {
    let text = read_text(&PathBuf::from(format!("/proc/{pid}/smaps_rollup")))?;
    Ok(parse_rollup(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swapped_mappings_are_found() {
        let text = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
Rss:                  40 kB
Swap:                  8 kB
SwapPss:               8 kB
7f00000000-7f00001000 r-xp 00000000 fd:01 123  /usr/lib/x.so
Size:                  4 kB
Swap:                  0 kB
";
        let r = parse_swapped(text);
        assert_eq!(
            r,
            vec![SwappedRange {
                start: 0x55d0c0000000,
                len: 0x21000,
                swap_bytes: 8192
            }]
        );
    }

    #[test]
    fn rollup_fields() {
        let r = parse_rollup(
            "55d0c0000000-7ffd0000 ---p 00000000 00:00 0  [rollup]\nRss:  100 kB\nReferenced: 40 kB\nAnonymous: 90 kB\nSwap: 3 kB\n",
        );
        assert_eq!(
            r,
            Rollup {
                rss: 102400,
                referenced: 40960,
                anonymous: 92160,
                swap: 3072
            }
        );
    }

    /// The idle measurement of this very process: a buffer written after clearing is
    /// referenced, and the swapped-range reading works (nothing swapped is fine).
    #[test]
    fn referenced_bits_clear_and_come_back() {
        if !crate::proc::is_root() {
            eprintln!("skipped: clear_refs of a process needs its owner or root");
            return;
        }
        let me = std::process::id();
        let mut buf = vec![1u8; 32 << 20];
        clear_referenced(me).unwrap();
        let before = rollup(me).unwrap();
        for b in buf.iter_mut().step_by(4096) {
            *b = 2;
        }
        let after = rollup(me).unwrap();
        assert!(
            after.referenced >= before.referenced + (24 << 20),
            "{before:?} {after:?}"
        );
        std::hint::black_box(&buf);
        swapped_ranges(me).unwrap();
    }

    #[test]
    fn pagemap_entries_name_swap_slots() {
        // Present: not swapped, whatever else is set.
        assert_eq!(pagemap_swap_slot(1 << 63 | 1234), None);
        // Neither present nor swapped.
        assert_eq!(pagemap_swap_slot(0), None);
        // Swapped: type 2, offset 0x1234.
        let e = 1 << 62 | 0x1234 << 5 | 2;
        assert_eq!(pagemap_swap_slot(e), Some(2 << 50 | 0x1234));
    }

    #[test]
    fn pages_coalesce_into_ranges() {
        let r = coalesce_pages(vec![0x3000, 0x1000, 0x2000, 0x6000, 0x2000], 0x1000);
        assert_eq!(r, vec![(0x1000, 0x3000), (0x6000, 0x1000)]);
        assert!(coalesce_pages(Vec::new(), 4096).is_empty());
    }

    /// This process's own pagemap reads, over a buffer it holds: nothing of it is in swap
    /// on a machine without swap pressure, and the read covers the range.
    #[test]
    fn own_pagemap_reads() {
        let buf = vec![7u8; 1 << 20];
        let start = buf.as_ptr() as u64 & !4095;
        let pages = swapped_pages(
            std::process::id(),
            &[SwappedRange {
                start,
                len: 1 << 20,
                swap_bytes: 0,
            }],
        )
        .unwrap();
        assert!(pages
            .iter()
            .all(|p| p.addr >= start && p.addr < start + (1 << 20)));
        std::hint::black_box(&buf);
    }
}
