//! Foreign groups: cgroups Granule did not create — another program's container or
//! service — whose memory limit the memory market's harvester lowers to free memory, and
//! raises again when the program suffers. Deliberately a separate API from the groups
//! Granule makes for itself ([`crate::ClusterGroups`], [`crate::NodeGroup`]): those it
//! owns, creates and removes, and may kill what runs in them; a foreign group it only
//! borrows.
//!
//! # The contract
//!
//! - **Adopting** ([`ForeignGroup::adopt_v1`], [`ForeignGroup::adopt_v2`],
//!   [`ForeignGroup::adopt_dir`], [`ForeignGroup::of_pid`]) reads the group's memory limit
//!   and remembers it as the *found* limit. It refuses a hierarchy's root group (its limit
//!   is the machine's) and Granule's own groups (anything below `granule/` or
//!   `granule-antagonists/`: change those through the API that made them).
//! - **Reading** (usage, limit, `memory.stat`, OOM kills, CPU time, pressure) never
//!   changes anything.
//! - **Adjusting** writes only the group's memory limit: v1 `memory.limit_in_bytes`, v2
//!   `memory.max` (and, to lower a v2 limit below the usage, `memory.reclaim`). It never
//!   removes the group, never moves or signals its tasks, and never asks the kernel to
//!   kill them: on v1 the kernel itself refuses (EBUSY) a limit it cannot reclaim down
//!   to; on v2, where a `memory.max` below what can be reclaimed would wake the OOM
//!   killer, the memory is reclaimed first through `memory.reclaim` and the limit is
//!   written only once the usage is below it. Either way a refused lowering is
//!   [`CgroupError::LimitRefused`] and leaves the limit as it was. (A limit that holds
//!   can of course still be reached later by the program's own growth: then the kernel
//!   reclaims, swaps, or — with nothing left to reclaim — OOM-kills inside the group, as
//!   it would under the limit its owner set. Lowering gradually and watching the
//!   program, as the harvester does, is the caller's part.)
//! - **Restoring** writes the found limit back: explicitly with
//!   [`ForeignGroup::restore`], or when the `ForeignGroup` is dropped (unless
//!   [`ForeignGroup::keep`] said to leave the adjusted limit in place).
//! - **Surviving SIGKILL**: with [`ForeignGroup::record_to`], the found limit is written to
//!   a small record file *before* the first change (atomically: a temporary file renamed
//!   into place). A later process calls [`restore_from_record`] to put the limit back
//!   after the adjusting process was killed; it refuses while the recorded adjuster is
//!   still running, so it cannot undo a live harvester's work. A record that exists
//!   already when a group is adopted is the truth about the original limit:
//!   [`ForeignGroup::record_to`] continues from it instead of taking the (lowered)
//!   current limit as the found one, and takes the record over — unless its adjuster
//!   still runs, which is an error. [`ForeignGroup::restore`] deletes the record once the
//!   limit is back.
//! - One adjuster per group: records enforce it between processes that use the same
//!   record file; without records, two `ForeignGroup`s adjusting one group would each
//!   restore their own found limit.

use crate::file::{read_text, write_text};
use crate::hierarchy::{Controller, Hierarchy};
use crate::procfs::{proc_cgroup_text, process_start_time, unified_path, v1_path};
use crate::psi::Pressure;
use crate::stat::{parse_memory_stat, parse_unified_cpu_stat, CgroupVersion, MemoryStat};
use crate::unified::Unified;
use crate::{CgroupError, ANTAGONIST_DIR, GRANULE_DIR};
use std::fmt;
use std::io::{ErrorKind, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

/// Above this a v1 limit means "none" (the kernel reports `PAGE_COUNTER_MAX` pages).
const UNLIMITED_V1: u64 = 1 << 62;

/// The first line of a record file.
const RECORD_MAGIC: &str =
    "# granule foreign cgroup memory limit, as found before Granule changed it";

/// A memory limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    Bytes(u64),
    Unlimited,
}

impl Limit {
    /// The limit in bytes, `None` when unlimited.
    pub fn bytes(self) -> Option<u64> {
        match self {
            Limit::Bytes(b) => Some(b),
            Limit::Unlimited => None,
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Limit::Bytes(b) => write!(f, "{b}"),
            Limit::Unlimited => f.write_str("max"),
        }
    }
}

impl std::str::FromStr for Limit {
    type Err = ();
    fn from_str(s: &str) -> Result<Limit, ()> {
        match s.trim() {
            "max" => Ok(Limit::Unlimited),
            v => v.parse().map(Limit::Bytes).map_err(|_| ()),
        }
    }
}

/// A cgroup Granule did not create, adopted to read it and adjust its memory limit; see
/// the module doc for the contract.
#[derive(Debug)]
pub struct ForeignGroup {
    version: CgroupVersion,
    /// The group's directory (v1: in the memory hierarchy).
    dir: PathBuf,
    /// v1: the directory of the same processes' cpuacct group, where known.
    cpuacct: Option<PathBuf>,
    found: Limit,
    /// The limit may differ from the found one (we changed it, or a record says a
    /// previous adjuster did).
    changed: bool,
    record: Option<PathBuf>,
    /// `keep()` was called: leave the limit on drop.
    kept: bool,
}

impl ForeignGroup {
    /// The v1 memory group `rel` (as `/proc/<pid>/cgroup` names it) of hierarchy `h`.
    pub fn adopt_v1(h: &Hierarchy, rel: &str) -> Result<ForeignGroup, CgroupError> {
        let dir = h.group_dir(Controller::Memory, rel)?;
        Self::adopt(CgroupVersion::V1, dir, None)
    }

    /// The v2 group `rel` of the unified hierarchy `u` (its memory controller enabled).
    pub fn adopt_v2(u: &Unified, rel: &str) -> Result<ForeignGroup, CgroupError> {
        Self::adopt(CgroupVersion::V2, u.group_dir(rel)?, None)
    }

    /// The group whose directory is `dir`: v1 if it has `memory.limit_in_bytes`, v2 if it
    /// has `memory.max`.
    pub fn adopt_dir(dir: impl Into<PathBuf>) -> Result<ForeignGroup, CgroupError> {
        let dir = dir.into();
        let version = version_of(&dir)?;
        Self::adopt(version, dir, None)
    }

    /// The memory group process `pid` runs in, in the system's hierarchies: its v1
    /// memory group where v1 has the memory controller, else its v2 group.
    pub fn of_pid(pid: u32) -> Result<ForeignGroup, CgroupError> {
        let text = proc_cgroup_text(pid).ok_or_else(|| CgroupError::BadPath {
            path: pid.to_string(),
            why: "no such process",
        })?;
        Self::of_cgroup_text(&Hierarchy::default(), Unified::detect().as_ref(), &text)
    }

    /// The memory group named by the text of a `/proc/<pid>/cgroup` file, in the given
    /// hierarchies (tests pass fake ones).
    pub fn of_cgroup_text(
        h: &Hierarchy,
        unified: Option<&Unified>,
        text: &str,
    ) -> Result<ForeignGroup, CgroupError> {
        if h.has(Controller::Memory) {
            if let Some(rel) = v1_path(text, Controller::Memory.name()) {
                let cpuacct = v1_path(text, Controller::Cpuacct.name())
                    .filter(|r| r != "/")
                    .and_then(|r| h.group_dir(Controller::Cpuacct, &r).ok())
                    .filter(|d| d.is_dir());
                return Self::adopt(
                    CgroupVersion::V1,
                    h.group_dir(Controller::Memory, &rel)?,
                    cpuacct,
                );
            }
        }
        match (unified, unified_path(text)) {
            (Some(u), Some(rel)) => Self::adopt(CgroupVersion::V2, u.group_dir(&rel)?, None),
            _ => Err(CgroupError::NoController(Controller::Memory)),
        }
    }

    fn adopt(
        version: CgroupVersion,
        dir: PathBuf,
        cpuacct: Option<PathBuf>,
    ) -> Result<ForeignGroup, CgroupError> {
        check_foreign(version, &dir)?;
        let mut g = ForeignGroup {
            version,
            dir,
            cpuacct,
            found: Limit::Unlimited,
            changed: false,
            record: None,
            kept: false,
        };
        g.found = g.limit()?;
        Ok(g)
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The group's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The limit the group had when it was adopted (or, with a record from an earlier
    /// adjuster, the one the record names).
    pub fn found_limit(&self) -> Limit {
        self.found
    }

    fn limit_file(&self) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        })
    }

    /// Memory charged to the group now, bytes.
    pub fn usage(&self) -> Result<u64, CgroupError> {
        crate::stat::read_u64(&self.dir.join(match self.version {
            CgroupVersion::V1 => "memory.usage_in_bytes",
            CgroupVersion::V2 => "memory.current",
        }))
    }

    /// The group's memory limit now.
    pub fn limit(&self) -> Result<Limit, CgroupError> {
        read_limit(self.version, &self.limit_file())
    }

    /// The group's `memory.stat` (for v2 with its swap use from `memory.swap.current`).
    pub fn memory_stat(&self) -> Result<MemoryStat, CgroupError> {
        let text = read_text(&self.dir.join("memory.stat"))?;
        let mut s = parse_memory_stat(&text, self.version);
        if self.version == CgroupVersion::V2 {
            let swap = self.dir.join("memory.swap.current");
            if swap.is_file() {
                s.swap = Some(crate::stat::read_u64(&swap)?);
            }
        }
        Ok(s)
    }

    /// Tasks the OOM killer killed in the group (v1 `memory.oom_control`, v2
    /// `memory.events`; 0 where the kernel does not count them).
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        let path = self.dir.join(match self.version {
            CgroupVersion::V1 => "memory.oom_control",
            CgroupVersion::V2 => "memory.events",
        });
        let text = read_text(&path)?;
        crate::file::keyed(&text, "oom_kill")
            .map(|v| v.unwrap_or(0))
            .map_err(|line| CgroupError::Parse {
                path,
                text: line.to_string(),
            })
    }

    /// CPU time the group's tasks used: v2 `cpu.stat`'s `usage_usec`; v1 the
    /// `cpuacct.usage` of the processes' cpuacct group, known only when adopted by pid
    /// (`None` otherwise).
    pub fn cpu_usage(&self) -> Result<Option<Duration>, CgroupError> {
        match (self.version, &self.cpuacct) {
            (CgroupVersion::V2, _) => {
                let path = self.dir.join("cpu.stat");
                let text = read_text(&path)?;
                let s = parse_unified_cpu_stat(&text).map_err(|why| CgroupError::Parse {
                    path,
                    text: why.to_string(),
                })?;
                Ok(Some(s.usage))
            }
            (CgroupVersion::V1, Some(dir)) => Ok(Some(Duration::from_nanos(
                crate::stat::read_u64(&dir.join("cpuacct.usage"))?,
            ))),
            (CgroupVersion::V1, None) => Ok(None),
        }
    }

    /// The group's memory pressure (v2 `memory.pressure`); `None` on v1, which has no
    /// per-group stall accounting (use [`crate::psi::system`]).
    pub fn pressure(&self) -> Result<Option<Pressure>, CgroupError> {
        match self.version {
            CgroupVersion::V1 => Ok(None),
            CgroupVersion::V2 => Ok(Some(crate::psi::read_file(
                &self.dir.join("memory.pressure"),
            )?)),
        }
    }

    /// The processes in the group now.
    pub fn pids(&self) -> Result<Vec<u32>, CgroupError> {
        crate::group::group_pids(&self.dir)
    }

    /// Keep a record of the found limit in the file `path` (written before the first
    /// change), so that [`restore_from_record`] can restore it if this process dies. If
    /// the file exists already and names this group, an earlier adjuster died without
    /// restoring: its found limit becomes this one's, and the record is rewritten to name
    /// this process as the adjuster. A record naming another group, or one whose adjuster
    /// still runs, is an error (one record file per group, one adjuster per record).
    pub fn record_to(&mut self, path: impl Into<PathBuf>) -> Result<(), CgroupError> {
        let path = path.into();
        match read_record(&path)? {
            Some(r) if r.dir == self.dir => {
                let me = std::process::id();
                if let Some((pid, start)) = r.adjuster.filter(|(pid, _)| *pid != me) {
                    if process_start_time(pid) == Some(start) {
                        return Err(CgroupError::Record {
                            path,
                            why: format!("process {pid} is adjusting this group"),
                        });
                    }
                }
                self.found = r.limit;
                // The current limit may be the earlier adjuster's: restore must write.
                self.changed = true;
                // The record now speaks for this process, so that nobody restores behind
                // its back while it runs.
                write_record(
                    &path,
                    &Record {
                        adjuster: process_start_time(me).map(|s| (me, s)),
                        ..r
                    },
                )?;
            }
            Some(r) => {
                return Err(CgroupError::Record {
                    path,
                    why: format!("it records the group {}, not this one", r.dir.display()),
                })
            }
            None => {}
        }
        self.record = Some(path);
        Ok(())
    }

    /// Set the memory limit; returns the limit it replaced. Lowering below the usage
    /// reclaims first and fails with [`CgroupError::LimitRefused`] (the limit unchanged)
    /// if the kernel cannot get the usage under it.
    pub fn set_limit(&mut self, limit: Limit) -> Result<Limit, CgroupError> {
        let previous = self.limit()?;
        self.write_record_once()?;
        self.changed = true;
        write_limit(self.version, &self.dir, limit)?;
        Ok(previous)
    }

    /// Lower the limit by `bytes` (from the current limit, or from the usage when there
    /// is none); returns the new limit.
    pub fn lower_by(&mut self, bytes: u64) -> Result<u64, CgroupError> {
        let base = match self.limit()? {
            Limit::Bytes(b) => b,
            Limit::Unlimited => self.usage()?,
        };
        let new = base.saturating_sub(bytes);
        self.set_limit(Limit::Bytes(new))?;
        Ok(new)
    }

    /// Raise the limit by `bytes` (an unlimited group stays unlimited); returns the new
    /// limit. Nothing stops it above the found limit: that is the caller's choice.
    pub fn raise_by(&mut self, bytes: u64) -> Result<Limit, CgroupError> {
        let new = match self.limit()? {
            Limit::Bytes(b) => Limit::Bytes(b.saturating_add(bytes)),
            Limit::Unlimited => return Ok(Limit::Unlimited),
        };
        self.set_limit(new)?;
        Ok(new)
    }

    /// Remove the limit; returns the one it replaced.
    pub fn set_unlimited(&mut self) -> Result<Limit, CgroupError> {
        self.set_limit(Limit::Unlimited)
    }

    /// Put the found limit back and delete the record file, if any.
    pub fn restore(&mut self) -> Result<(), CgroupError> {
        if self.changed {
            write_limit(self.version, &self.dir, self.found)?;
            self.changed = false;
        }
        if let Some(r) = &self.record {
            match std::fs::remove_file(r) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(CgroupError::io("remove", r, e)),
            }
        }
        Ok(())
    }

    /// Let go of the group leaving its limit as it is now (and the record file, if any,
    /// for a later [`restore_from_record`]).
    pub fn keep(mut self) {
        self.kept = true;
    }

    fn write_record_once(&self) -> Result<(), CgroupError> {
        let Some(path) = &self.record else {
            return Ok(());
        };
        if path.exists() {
            return Ok(());
        }
        let me = std::process::id();
        write_record(
            path,
            &Record {
                version: self.version,
                dir: self.dir.clone(),
                limit: self.found,
                adjuster: process_start_time(me).map(|s| (me, s)),
            },
        )
    }
}

impl Drop for ForeignGroup {
    fn drop(&mut self) {
        if self.kept || !self.changed {
            return;
        }
        if let Err(e) = self.restore() {
            tracing::warn!(
                "cannot restore the memory limit {} of {}: {e}",
                self.found,
                self.dir.display()
            );
        }
    }
}

/// What [`restore_from_record`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Restored {
    /// The limit of `dir` is back to `limit`; the record is deleted.
    Restored { dir: PathBuf, limit: Limit },
    /// The group no longer exists (nothing to restore); the record is deleted.
    GroupGone { dir: PathBuf },
    /// There was no record file.
    NoRecord,
}

/// Restore the limit a record file (see [`ForeignGroup::record_to`]) names, then delete
/// the record. Refused while the process that wrote it is still running. The record's
/// group must still be a foreign memory group of the version it says; only its limit
/// file is written.
pub fn restore_from_record(path: impl AsRef<Path>) -> Result<Restored, CgroupError> {
    let path = path.as_ref();
    let Some(r) = read_record(path)? else {
        return Ok(Restored::NoRecord);
    };
    if let Some((pid, start)) = r.adjuster {
        if process_start_time(pid) == Some(start) {
            return Err(CgroupError::Record {
                path: path.to_path_buf(),
                why: format!("its adjuster, process {pid}, is still running"),
            });
        }
    }
    let remove = || std::fs::remove_file(path).map_err(|e| CgroupError::io("remove", path, e));
    if !r.dir.is_dir() {
        remove()?;
        return Ok(Restored::GroupGone { dir: r.dir });
    }
    if version_of(&r.dir)? != r.version {
        return Err(CgroupError::Record {
            path: path.to_path_buf(),
            why: format!(
                "{} is no longer a cgroup {} memory group",
                r.dir.display(),
                r.version
            ),
        });
    }
    check_foreign(r.version, &r.dir)?;
    write_limit(r.version, &r.dir, r.limit)?;
    remove()?;
    Ok(Restored::Restored {
        dir: r.dir,
        limit: r.limit,
    })
}

/// Which version a memory group directory follows, by the limit file it has.
fn version_of(dir: &Path) -> Result<CgroupVersion, CgroupError> {
    if dir.join("memory.limit_in_bytes").is_file() {
        Ok(CgroupVersion::V1)
    } else if dir.join("memory.max").is_file() {
        Ok(CgroupVersion::V2)
    } else {
        Err(CgroupError::BadPath {
            path: dir.display().to_string(),
            why: "not a memory cgroup with a limit (no memory.limit_in_bytes or memory.max)",
        })
    }
}

/// Refuse a root group, Granule's own groups, and paths that are not plain.
fn check_foreign(version: CgroupVersion, dir: &Path) -> Result<(), CgroupError> {
    let bad = |why| CgroupError::BadPath {
        path: dir.display().to_string(),
        why,
    };
    if !dir.is_absolute()
        || dir
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return Err(bad("not a plain absolute path"));
    }
    if dir
        .components()
        .any(|c| matches!(c, Component::Normal(n) if n == GRANULE_DIR || n == ANTAGONIST_DIR))
    {
        return Err(bad(
            "one of Granule's own groups: adjust it through the API that created it",
        ));
    }
    // Only a v1 hierarchy's root has `release_agent`; a v2 root has no `memory.max`.
    match version {
        CgroupVersion::V1 if dir.join("release_agent").exists() => {
            return Err(bad("a root group (its limit is the whole machine's)"));
        }
        CgroupVersion::V2 if !dir.join("memory.max").exists() => {
            return Err(bad(
                "no memory.max: a root group, or one without the memory controller enabled",
            ));
        }
        _ => {}
    }
    if !dir.is_dir() {
        return Err(bad("no such group"));
    }
    Ok(())
}

fn read_limit(version: CgroupVersion, path: &Path) -> Result<Limit, CgroupError> {
    let text = read_text(path)?;
    let t = text.trim();
    let bad = || CgroupError::Parse {
        path: path.to_path_buf(),
        text: t.to_string(),
    };
    Ok(match version {
        // The kernel writes ~2^63 for "none"; a fake tree may hold -1 as written.
        CgroupVersion::V1 => match t.parse::<i64>() {
            Ok(v) if v < 0 => Limit::Unlimited,
            Ok(v) if v as u64 >= UNLIMITED_V1 => Limit::Unlimited,
            Ok(v) => Limit::Bytes(v as u64),
            Err(_) => match t.parse::<u64>() {
                Ok(_) => Limit::Unlimited, // above i64: also "none"
                Err(_) => return Err(bad()),
            },
        },
        CgroupVersion::V2 => t.parse().map_err(|()| bad())?,
    })
}

/// Write a limit to a group of `version` (see the module doc for how lowering avoids the
/// OOM killer).
fn write_limit(version: CgroupVersion, dir: &Path, limit: Limit) -> Result<(), CgroupError> {
    let usage_file = match version {
        CgroupVersion::V1 => "memory.usage_in_bytes",
        CgroupVersion::V2 => "memory.current",
    };
    let refused = |usage: u64, bytes: u64| CgroupError::LimitRefused {
        path: dir.to_path_buf(),
        limit: bytes,
        usage,
    };
    match (version, limit) {
        (CgroupVersion::V1, Limit::Unlimited) => {
            write_text(&dir.join("memory.limit_in_bytes"), "-1")?;
        }
        (CgroupVersion::V1, Limit::Bytes(b)) => {
            let path = dir.join("memory.limit_in_bytes");
            if let Err(e) = std::fs::write(&path, b.to_string()) {
                // The kernel tried to reclaim down to the limit and could not.
                if e.raw_os_error() == Some(libc::EBUSY) {
                    let usage = crate::stat::read_u64(&dir.join(usage_file)).unwrap_or(0);
                    return Err(refused(usage, b));
                }
                return Err(CgroupError::io("write", path, e));
            }
        }
        (CgroupVersion::V2, Limit::Unlimited) => write_text(&dir.join("memory.max"), "max")?,
        (CgroupVersion::V2, Limit::Bytes(b)) => {
            let usage = crate::stat::read_u64(&dir.join(usage_file))?;
            if usage > b {
                // memory.max below what the kernel can reclaim would OOM-kill; reclaim
                // first, and write the limit only if that got the usage under it.
                let reclaim = dir.join("memory.reclaim");
                if !reclaim.is_file() {
                    return Err(refused(usage, b));
                }
                if let Err(e) = std::fs::write(&reclaim, (usage - b).to_string()) {
                    if e.raw_os_error() == Some(libc::EAGAIN) {
                        return Err(refused(usage, b));
                    }
                    return Err(CgroupError::io("write", reclaim, e));
                }
                let now = crate::stat::read_u64(&dir.join(usage_file))?;
                if now > b {
                    return Err(refused(now, b));
                }
            }
            write_text(&dir.join("memory.max"), &b.to_string())?;
        }
    }
    Ok(())
}

/// The content of a record file.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    version: CgroupVersion,
    dir: PathBuf,
    limit: Limit,
    /// The process that wrote it: pid and start time.
    adjuster: Option<(u32, u64)>,
}

fn format_record(r: &Record) -> String {
    let adjuster = r
        .adjuster
        .map_or_else(|| "unknown".to_string(), |(p, s)| format!("{p} {s}"));
    format!(
        "{RECORD_MAGIC}\nversion {}\ndir {}\nlimit {}\nadjuster {adjuster}\n",
        r.version,
        r.dir.display(),
        r.limit
    )
}

fn parse_record(text: &str) -> Option<Record> {
    let mut lines = text.lines();
    if lines.next()? != RECORD_MAGIC {
        return None;
    }
    let (mut version, mut dir, mut limit, mut adjuster) = (None, None, None, None);
    for line in lines {
        let (k, v) = line.split_once(' ')?;
        match k {
            "version" => {
                version = Some(match v {
                    "v1" => CgroupVersion::V1,
                    "v2" => CgroupVersion::V2,
                    _ => return None,
                })
            }
            "dir" => dir = Some(PathBuf::from(v)),
            "limit" => limit = Some(v.parse().ok()?),
            "adjuster" => {
                adjuster = Some(match v.split_once(' ') {
                    Some((p, s)) => Some((p.parse().ok()?, s.parse().ok()?)),
                    None if v == "unknown" => None,
                    None => return None,
                })
            }
            _ => {}
        }
    }
    Some(Record {
        version: version?,
        dir: dir?,
        limit: limit?,
        adjuster: adjuster?,
    })
}

fn read_record(path: &Path) -> Result<Option<Record>, CgroupError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(CgroupError::io("read", path, e)),
    };
    parse_record(&text)
        .map(Some)
        .ok_or_else(|| CgroupError::Record {
            path: path.to_path_buf(),
            why: "not a record file Granule wrote".into(),
        })
}

/// Write a record atomically: a temporary file beside it, synced, renamed into place, so
/// a reader finds the old state or the whole new one, never half of it.
fn write_record(path: &Path, r: &Record) -> Result<(), CgroupError> {
    if r.dir.to_str().is_none_or(|d| d.contains('\n')) {
        return Err(CgroupError::BadPath {
            path: r.dir.display().to_string(),
            why: "cannot be recorded (not UTF-8, or a newline in it)",
        });
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let io = |op, e| CgroupError::io(op, &tmp, e);
    let mut f = std::fs::File::create(&tmp).map_err(|e| io("create", e))?;
    f.write_all(format_record(r).as_bytes())
        .map_err(|e| io("write", e))?;
    f.sync_all().map_err(|e| io("sync", e))?;
    std::fs::rename(&tmp, path).map_err(|e| CgroupError::io("rename into", path, e))?;
    // The rename itself reaches the disk with the directory (best effort: the record
    // matters after a process kill, which the page cache survives anyway).
    if let Some(parent) = path.parent() {
        if let Ok(d) = std::fs::File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};

    /// A fake v1 memory group `<root>/memory/<rel>` (and the hierarchy's root files).
    fn fake_v1(root: &Path, rel: &str) -> PathBuf {
        let mem = root.join("memory");
        fs::create_dir_all(&mem).unwrap();
        fs::write(mem.join("release_agent"), "").unwrap();
        fs::write(mem.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let dir = mem.join(rel.trim_start_matches('/'));
        fs::create_dir_all(&dir).unwrap();
        for (f, v) in [
            ("memory.limit_in_bytes", "9223372036854771712\n"),
            ("memory.usage_in_bytes", "104857600\n"),
            (
                "memory.stat",
                "rss 1000\ncache 2000\ntotal_rss 3000\nswap 0\npgmajfault 4\n",
            ),
            (
                "memory.oom_control",
                "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            ),
            ("cgroup.procs", "10\n11\n"),
        ] {
            fs::write(dir.join(f), v).unwrap();
        }
        dir
    }

    /// A fake v2 group `<root>/<rel>` with its memory controller enabled.
    fn fake_v2(root: &Path, rel: &str) -> PathBuf {
        fs::create_dir_all(root).unwrap();
        fs::write(root.join("cgroup.controllers"), "cpu memory\n").unwrap();
        let dir = root.join(rel.trim_start_matches('/'));
        fs::create_dir_all(&dir).unwrap();
        for (f, v) in [
            ("memory.max", "max\n"),
            ("memory.current", "104857600\n"),
            ("memory.stat", "anon 3000\nfile 2000\npgmajfault 4\n"),
            ("memory.swap.current", "4096\n"),
            ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\n"),
            (
                "memory.pressure",
                "some avg10=0.00 avg60=0.00 avg300=0.00 total=5\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=2\n",
            ),
            ("cpu.stat", "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n"),
            ("memory.reclaim", ""),
            ("cgroup.procs", "20\n"),
        ] {
            fs::write(dir.join(f), v).unwrap();
        }
        dir
    }

    fn read(p: &Path) -> String {
        fs::read_to_string(p).unwrap().trim().to_string()
    }

    #[test]
    fn a_fake_v1_group_is_read_adjusted_and_restored() {
        let t = tempfile::tempdir().unwrap();
        let dir = fake_v1(t.path(), "/producer");
        let h = Hierarchy::at(t.path());
        let mut g = ForeignGroup::adopt_v1(&h, "/producer").unwrap();
        assert_eq!(g.version(), CgroupVersion::V1);
        assert_eq!(g.found_limit(), Limit::Unlimited);
        assert_eq!(g.usage().unwrap(), 100 << 20);
        let s = g.memory_stat().unwrap();
        assert_eq!(
            (s.anon, s.file, s.swap, s.pgmajfault),
            (3000, 2000, Some(0), 4)
        );
        assert_eq!(g.oom_kills().unwrap(), 2);
        assert_eq!(g.pids().unwrap(), vec![10, 11]);
        assert_eq!(
            g.cpu_usage().unwrap(),
            None,
            "v1 by path: no cpuacct group known"
        );
        assert_eq!(g.pressure().unwrap(), None);

        // Lowering from unlimited starts at the usage.
        assert_eq!(g.lower_by(20 << 20).unwrap(), 80 << 20);
        let limit = dir.join("memory.limit_in_bytes");
        assert_eq!(read(&limit), (80u64 << 20).to_string());
        assert_eq!(g.limit().unwrap(), Limit::Bytes(80 << 20));
        assert_eq!(g.lower_by(16 << 20).unwrap(), 64 << 20);
        assert_eq!(g.raise_by(8 << 20).unwrap(), Limit::Bytes(72 << 20));
        assert_eq!(g.set_unlimited().unwrap(), Limit::Bytes(72 << 20));
        assert_eq!(read(&limit), "-1");
        assert_eq!(g.raise_by(1).unwrap(), Limit::Unlimited);
        g.set_limit(Limit::Bytes(50 << 20)).unwrap();
        g.restore().unwrap();
        assert_eq!(read(&limit), "-1", "the found limit (none) is back");

        // Dropping restores too, unless kept.
        fs::write(&limit, "1073741824\n").unwrap();
        let mut g = ForeignGroup::adopt_dir(&dir).unwrap();
        assert_eq!(g.found_limit(), Limit::Bytes(1 << 30));
        g.lower_by(1 << 20).unwrap();
        drop(g);
        assert_eq!(read(&limit), "1073741824");
        let mut g = ForeignGroup::adopt_dir(&dir).unwrap();
        g.set_limit(Limit::Bytes(1 << 29)).unwrap();
        g.keep();
        assert_eq!(read(&limit), (1u64 << 29).to_string());
        // Nothing else in the group was written.
        assert_eq!(read(&dir.join("cgroup.procs")), "10\n11");
        assert!(dir.is_dir());
    }

    #[test]
    fn a_fake_v2_group_reclaims_before_it_lowers() {
        let t = tempfile::tempdir().unwrap();
        let dir = fake_v2(t.path(), "/work.slice/producer");
        let u = Unified::at(t.path());
        let mut g = ForeignGroup::adopt_v2(&u, "/work.slice/producer").unwrap();
        assert_eq!(g.version(), CgroupVersion::V2);
        assert_eq!(g.found_limit(), Limit::Unlimited);
        let s = g.memory_stat().unwrap();
        assert_eq!((s.anon, s.swap), (3000, Some(4096)));
        assert_eq!(g.oom_kills().unwrap(), 1);
        assert_eq!(g.cpu_usage().unwrap(), Some(Duration::from_micros(1500)));
        assert_eq!(g.pressure().unwrap().unwrap().full.unwrap().total_us, 2);

        // Above the usage: written at once.
        let max = dir.join("memory.max");
        g.set_limit(Limit::Bytes(200 << 20)).unwrap();
        assert_eq!(read(&max), (200u64 << 20).to_string());
        // Below it: memory.reclaim is asked for the difference; a fake group's usage does
        // not drop, so the lowering is refused and the limit stays.
        let e = g.set_limit(Limit::Bytes(60 << 20)).unwrap_err();
        assert!(
            matches!(e, CgroupError::LimitRefused { usage, limit, .. } if usage == 100 << 20 && limit == 60 << 20),
            "{e}"
        );
        assert_eq!(read(&dir.join("memory.reclaim")), (40u64 << 20).to_string());
        assert_eq!(read(&max), (200u64 << 20).to_string());
        // Once the kernel has reclaimed (here: the usage file says so), it is written.
        fs::write(dir.join("memory.current"), "52428800\n").unwrap();
        g.set_limit(Limit::Bytes(60 << 20)).unwrap();
        assert_eq!(read(&max), (60u64 << 20).to_string());
        // Without memory.reclaim (before 5.19) a lowering below the usage is refused.
        fs::remove_file(dir.join("memory.reclaim")).unwrap();
        assert!(matches!(
            g.set_limit(Limit::Bytes(1 << 20)),
            Err(CgroupError::LimitRefused { .. })
        ));
        g.restore().unwrap();
        assert_eq!(read(&max), "max");
    }

    #[test]
    fn roots_and_granules_own_groups_are_refused() {
        let t = tempfile::tempdir().unwrap();
        fake_v1(t.path(), "/granule/c1-2-0/node0");
        fake_v1(t.path(), "/granule-antagonists/a1-2");
        let h = Hierarchy::at(t.path());
        for rel in ["/", "/granule/c1-2-0/node0", "/granule-antagonists/a1-2"] {
            let e = ForeignGroup::adopt_v1(&h, rel).unwrap_err();
            assert!(matches!(e, CgroupError::BadPath { .. }), "{rel}: {e}");
        }
        assert!(ForeignGroup::adopt_v1(&h, "/nope").is_err());
        assert!(ForeignGroup::adopt_v1(&h, "/../etc").is_err());
        assert!(
            ForeignGroup::adopt_dir(t.path()).is_err(),
            "not a memory group"
        );
        assert!(ForeignGroup::adopt_dir("relative/x").is_err());
        // A v2 root has no memory.max: refused as not a group with a limit.
        let v2 = t.path().join("v2");
        fake_v2(&v2, "/a");
        assert!(ForeignGroup::adopt_dir(&v2).is_err());
        assert!(ForeignGroup::adopt_v2(&Unified::at(&v2), "/").is_err());
    }

    #[test]
    fn the_group_of_a_process_by_its_cgroup_file() {
        let t = tempfile::tempdir().unwrap();
        fake_v1(t.path(), "/producer");
        let cpuacct = t.path().join("cpuacct/producer");
        fs::create_dir_all(&cpuacct).unwrap();
        fs::write(t.path().join("cpuacct/cpuacct.usage"), "1\n").unwrap();
        fs::write(cpuacct.join("cpuacct.usage"), "2500\n").unwrap();
        let v2root = t.path().join("unified");
        fake_v2(&v2root, "/svc");
        let h = Hierarchy::at(t.path());
        let u = Unified::at(&v2root);
        let text = "4:memory:/producer\n2:cpuacct:/producer\n0::/svc\n";
        let g = ForeignGroup::of_cgroup_text(&h, Some(&u), text).unwrap();
        assert_eq!(g.version(), CgroupVersion::V1);
        assert_eq!(g.cpu_usage().unwrap(), Some(Duration::from_nanos(2500)));
        // Where v1 has no memory controller: the v2 group.
        let no_v1 = Hierarchy::at(t.path().join("none"));
        let g = ForeignGroup::of_cgroup_text(&no_v1, Some(&u), text).unwrap();
        assert_eq!(g.version(), CgroupVersion::V2);
        assert_eq!(g.dir(), v2root.join("svc"));
        assert!(matches!(
            ForeignGroup::of_cgroup_text(&no_v1, None, text),
            Err(CgroupError::NoController(Controller::Memory))
        ));
        assert!(ForeignGroup::of_pid(u32::MAX).is_err());
    }

    /// A reaped child's pid: a process that certainly no longer runs.
    fn dead_adjuster() -> (u32, u64) {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        let start = process_start_time(pid).unwrap_or(1);
        c.wait().unwrap();
        (pid, start)
    }

    #[test]
    fn records_survive_the_adjuster_and_restore_later() {
        let t = tempfile::tempdir().unwrap();
        let dir = fake_v1(t.path(), "/producer");
        let limit = dir.join("memory.limit_in_bytes");
        fs::write(&limit, "536870912\n").unwrap();
        let rec = t.path().join("producer.limit");

        // No change, no record.
        let mut g = ForeignGroup::adopt_dir(&dir).unwrap();
        g.record_to(&rec).unwrap();
        assert!(!rec.exists());
        // The record is there before the limit changes, and names the found limit.
        g.lower_by(128 << 20).unwrap();
        let r = read_record(&rec).unwrap().unwrap();
        assert_eq!(r.limit, Limit::Bytes(512 << 20));
        assert_eq!(r.dir, dir);
        assert_eq!(r.adjuster.map(|a| a.0), Some(std::process::id()));
        g.lower_by(64 << 20).unwrap();
        assert_eq!(
            read_record(&rec).unwrap().unwrap().limit,
            Limit::Bytes(512 << 20)
        );
        // While its adjuster runs, nobody else restores.
        assert!(matches!(
            restore_from_record(&rec),
            Err(CgroupError::Record { .. })
        ));
        // The adjuster "dies" (kept, as SIGKILL would leave it); a record from a dead one.
        g.keep();
        assert_eq!(read(&limit), (320u64 << 20).to_string());
        let mut r = read_record(&rec).unwrap().unwrap();
        r.adjuster = Some(dead_adjuster());
        write_record(&rec, &r).unwrap();

        // A new adjuster adopting the group continues from the record's original limit,
        // and the record now names it.
        let mut g2 = ForeignGroup::adopt_dir(&dir).unwrap();
        assert_eq!(g2.found_limit(), Limit::Bytes(320 << 20));
        g2.record_to(&rec).unwrap();
        assert_eq!(g2.found_limit(), Limit::Bytes(512 << 20));
        let r2 = read_record(&rec).unwrap().unwrap();
        assert_eq!(r2.adjuster.map(|a| a.0), Some(std::process::id()));
        assert_eq!(r2.limit, Limit::Bytes(512 << 20));
        g2.keep();
        // ...and dies too.
        write_record(
            &rec,
            &Record {
                adjuster: Some(dead_adjuster()),
                ..r2
            },
        )
        .unwrap();

        // A later process restores from the record and removes it.
        assert_eq!(
            restore_from_record(&rec).unwrap(),
            Restored::Restored {
                dir: dir.clone(),
                limit: Limit::Bytes(512 << 20)
            }
        );
        assert_eq!(read(&limit), "536870912");
        assert!(!rec.exists());
        assert_eq!(restore_from_record(&rec).unwrap(), Restored::NoRecord);

        // A record of a group that is gone is simply dropped.
        let gone = Record {
            version: CgroupVersion::V1,
            dir: t.path().join("memory/gone"),
            limit: Limit::Unlimited,
            adjuster: Some(dead_adjuster()),
        };
        write_record(&rec, &gone).unwrap();
        assert!(matches!(
            restore_from_record(&rec).unwrap(),
            Restored::GroupGone { .. }
        ));
        assert!(!rec.exists());

        // A record of another group is not taken over; garbage is not a record; a record
        // cannot point restore at Granule's own groups or at a non-group.
        let other = fake_v1(t.path(), "/other");
        write_record(
            &rec,
            &Record {
                dir: other,
                ..gone.clone()
            },
        )
        .unwrap();
        let mut g3 = ForeignGroup::adopt_dir(&dir).unwrap();
        assert!(matches!(
            g3.record_to(&rec),
            Err(CgroupError::Record { .. })
        ));
        // A record of this group held by another live adjuster is not taken over either.
        let mut live = Command::new("sleep").arg("5").spawn().unwrap();
        let held = Record {
            version: CgroupVersion::V1,
            dir: dir.clone(),
            limit: Limit::Unlimited,
            adjuster: process_start_time(live.id()).map(|s| (live.id(), s)),
        };
        write_record(&rec, &held).unwrap();
        let e = g3.record_to(&rec).unwrap_err();
        let _ = live.kill();
        let _ = live.wait();
        assert!(e.to_string().contains("is adjusting"), "{e}");
        fs::write(&rec, "limit 1\n").unwrap();
        assert!(restore_from_record(&rec).is_err());
        let own = fake_v1(t.path(), "/granule/c1-2-3");
        write_record(
            &rec,
            &Record {
                dir: own,
                ..gone.clone()
            },
        )
        .unwrap();
        assert!(restore_from_record(&rec).is_err());
        write_record(
            &rec,
            &Record {
                dir: t.path().to_path_buf(),
                ..gone
            },
        )
        .unwrap();
        assert!(restore_from_record(&rec).is_err());
    }

    #[test]
    fn record_text_round_trips() {
        let r = Record {
            version: CgroupVersion::V2,
            dir: PathBuf::from("/sys/fs/cgroup/a b/c"),
            limit: Limit::Bytes(123),
            adjuster: Some((5, 6)),
        };
        assert_eq!(parse_record(&format_record(&r)), Some(r.clone()));
        let r = Record {
            limit: Limit::Unlimited,
            adjuster: None,
            ..r
        };
        assert_eq!(parse_record(&format_record(&r)), Some(r));
        assert_eq!(parse_record("version v1\n"), None);
        assert_eq!(parse_record(&format!("{RECORD_MAGIC}\nversion v3\n")), None);
    }

    // ---- against the real cgroup v1 memory controller ----

    const HELPER: &str = "GRANULE_HOST_FOREIGN_HELPER";

    /// Run by the real tests below as a child process: `alloc` waits for a line on stdin,
    /// then allocates and touches 48 MiB, says `ready` and waits for stdin to close;
    /// `adjust <dir> <record>` adopts the group, lowers its limit with a record, says
    /// `lowered` and waits to be killed.
    #[test]
    fn foreign_helper() {
        let Ok(what) = std::env::var(HELPER) else {
            return; // only meaningful as a child of the tests below
        };
        let mut stdin = BufReader::new(std::io::stdin());
        let mut line = String::new();
        let words: Vec<&str> = what.split('\n').collect();
        match words[..] {
            ["alloc"] => {
                stdin.read_line(&mut line).unwrap();
                let mut v = vec![0u8; 48 << 20];
                for i in (0..v.len()).step_by(4096) {
                    v[i] = 1;
                }
                println!("ready");
                let _ = stdin.read_line(&mut line);
                std::hint::black_box(&v);
            }
            ["adjust", dir, record] => {
                let mut g = ForeignGroup::adopt_dir(dir).unwrap();
                g.record_to(record).unwrap();
                let usage = g.usage().unwrap();
                g.set_limit(Limit::Bytes(usage + (64 << 20))).unwrap();
                println!("lowered");
                std::thread::sleep(Duration::from_secs(30));
            }
            _ => panic!("unknown helper task {what:?}"),
        }
    }

    /// A child running `foreign_helper` with `task`; killed and reaped on drop.
    struct Helper(Child);
    impl Helper {
        fn start(task: &str) -> Helper {
            let exe = std::env::current_exe().unwrap();
            Helper(
                Command::new(exe)
                    .args(["--exact", "foreign::tests::foreign_helper", "--nocapture"])
                    .env(HELPER, task)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .unwrap(),
            )
        }
        /// Wait until the helper prints a line containing `word`.
        fn wait_for(&mut self, word: &str) {
            let out = self.0.stdout.as_mut().unwrap();
            let mut r = BufReader::new(out);
            let mut line = String::new();
            loop {
                line.clear();
                assert!(
                    r.read_line(&mut line).unwrap() > 0,
                    "helper ended before {word}"
                );
                if line.contains(word) {
                    return;
                }
            }
        }
    }
    impl Drop for Helper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A v1 memory group of the test's own, outside `granule/` (a foreign group as far as
    /// the API can tell); removed on drop.
    struct TestGroup(PathBuf);
    impl Drop for TestGroup {
        fn drop(&mut self) {
            for _ in 0..200 {
                if fs::remove_dir(&self.0).is_ok() || !self.0.exists() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn real_v1_memory() -> Option<Hierarchy> {
        let h = Hierarchy::default();
        let dir = h.controller_dir(Controller::Memory);
        if !h.has(Controller::Memory)
            || nix::unistd::access(&dir, nix::unistd::AccessFlags::W_OK).is_err()
        {
            eprintln!("skipping a real-cgroup test: no writable cgroup v1 memory controller");
            return None;
        }
        Some(h)
    }

    #[test]
    fn a_real_v1_group_is_lowered_refused_and_restored_even_after_sigkill() {
        let Some(h) = real_v1_memory() else { return };
        let group = TestGroup(
            h.controller_dir(Controller::Memory)
                .join(format!("granule-host-test-foreign-{}", std::process::id())),
        );
        fs::create_dir_all(&group.0).unwrap();
        let mut alloc = Helper::start("alloc");
        let pid = alloc.0.id();
        fs::write(group.0.join("cgroup.procs"), pid.to_string()).unwrap();
        // Allocate only once inside, so the memory is charged to the group.
        writeln!(alloc.0.stdin.as_mut().unwrap(), "go").unwrap();
        alloc.wait_for("ready");

        let mut g = ForeignGroup::of_pid(pid).unwrap();
        assert_eq!(g.version(), CgroupVersion::V1);
        assert_eq!(g.dir(), group.0);
        assert_eq!(g.found_limit(), Limit::Unlimited);
        let usage = g.usage().unwrap();
        assert!(usage >= 40 << 20, "{usage}");
        assert!(g.memory_stat().unwrap().anon >= 40 << 20);
        assert_eq!(g.pids().unwrap(), vec![pid]);

        // Above the usage: accepted (the kernel rounds to pages).
        let above = usage + (32 << 20);
        g.set_limit(Limit::Bytes(above)).unwrap();
        assert_eq!(g.limit().unwrap(), Limit::Bytes(above / 4096 * 4096));
        // Far below: anonymous memory with no swap cannot be reclaimed; the kernel refuses
        // and the process lives on. (With swap it could succeed: then it swapped.)
        match g.set_limit(Limit::Bytes(8 << 20)) {
            Err(CgroupError::LimitRefused { limit, .. }) => {
                assert_eq!(limit, 8 << 20);
                assert_eq!(g.limit().unwrap(), Limit::Bytes(above / 4096 * 4096));
            }
            Ok(_) => eprintln!("the kernel reclaimed down to 8 MiB (swap available)"),
            Err(e) => panic!("{e}"),
        }
        assert!(
            !crate::proc::process_gone(pid),
            "the group's task was not killed"
        );
        g.restore().unwrap();
        assert_eq!(g.limit().unwrap(), Limit::Unlimited);
        drop(g);

        // An adjuster killed with SIGKILL leaves its record; a later process restores.
        let t = tempfile::tempdir().unwrap();
        let record = t.path().join("limit.record");
        let mut adjuster = Helper::start(&format!(
            "adjust\n{}\n{}",
            group.0.display(),
            record.display()
        ));
        adjuster.wait_for("lowered");
        let g = ForeignGroup::adopt_dir(&group.0).unwrap();
        assert!(matches!(g.limit().unwrap(), Limit::Bytes(_)));
        g.keep();
        assert!(matches!(
            restore_from_record(&record),
            Err(CgroupError::Record { .. })
        ));
        adjuster.0.kill().unwrap(); // SIGKILL
        adjuster.0.wait().unwrap();
        assert_eq!(
            restore_from_record(&record).unwrap(),
            Restored::Restored {
                dir: group.0.clone(),
                limit: Limit::Unlimited
            }
        );
        assert_eq!(
            ForeignGroup::adopt_dir(&group.0).unwrap().limit().unwrap(),
            Limit::Unlimited
        );
        assert!(!record.exists());
        assert!(!crate::proc::process_gone(pid));
        drop(alloc);
    }
}
