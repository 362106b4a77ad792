//! The harvester: the control loop that lowers a producer workload's memory limit, one
//! chunk per cooling period, while the workload's performance holds, and gives memory
//! back when it does not (Memtrade's harvester; a second policy after Senpai/TMO).
//!
//! - [`policy`]: the baseline policy, free of I/O — swap-free performance samples in an
//!   ordered structure with expiry, drop and severe-drop detection;
//! - [`psi`]: the pressure-stall policy, free of I/O (Senpai's control law);
//! - `guard`: bookkeeping free of I/O — which refaults are the workload's (not the
//!   harvester's prefetch's, not zswap writeback's), and the floor a drop leaves;
//! - `metric`: the performance signal (refault rate, samples pushed over a Unix socket,
//!   or an HTTP endpoint polled);
//! - `machine`: a swap file when the machine has none and zswap in front of it, with a
//!   record so that a SIGKILLed producer's changes are undone by the next start;
//! - `run`: the loop on its own thread: epochs, headroom checks, bursts, prefetch.
//!
//! The producer is a process of its own (not a Granule node): it runs beside a foreign
//! workload on a machine that need not belong to a Granule cluster. Every read and write
//! of the kernel's files goes through `granule-host`; the workload's group is adopted as
//! a [`granule_host::ForeignGroup`], whose only write is its memory limit.
//!
//! Safety against OOM kills: a lowering needs free swap of the chunk plus
//! `market.headroom`; the kernel refuses (and the harvester skips) a limit it cannot
//! reclaim down to; a burst of refaults lifts the limit at once (checked four times a
//! second, not once per cooling period).

pub mod policy;
pub mod psi;

mod guard;
mod machine;
mod metric;
mod run;

use granule_host::workload::WorkloadGroup;
use granule_host::{CgroupError, Controller, ForeignGroup, Hierarchy, HostError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What the producer harvests from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Workload {
    /// An existing memory cgroup: an absolute directory, or a path relative to the v1
    /// memory hierarchy's root.
    Cgroup(PathBuf),
    /// A command to spawn in a new memory cgroup the producer creates (and removes after
    /// stopping the command).
    Command(Vec<String>),
}

/// Where the workload's performance comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricSource {
    /// The anonymous refault / swap-in rate.
    SwapIn,
    /// The application pushes latency samples, one per line, to this Unix socket.
    Socket(PathBuf),
    /// A URL polled once per epoch whose body is the application's p99.
    Http(String),
}

impl MetricSource {
    /// From the `market.metric` setting: `swapin`, `socket:PATH` or `http:URL`.
    pub fn from_setting(v: &str) -> Result<MetricSource, HarvestError> {
        let v = v.trim();
        if v == "swapin" {
            Ok(MetricSource::SwapIn)
        } else if let Some(p) = v.strip_prefix("socket:").filter(|p| !p.is_empty()) {
            Ok(MetricSource::Socket(PathBuf::from(p)))
        } else if let Some(u) = v.strip_prefix("http:").filter(|u| !u.is_empty()) {
            // `http:http://host/p` and `http://host/p` both name the URL.
            let url = if u.starts_with("http://") {
                u.to_string()
            } else {
                format!("http:{u}")
            };
            Ok(MetricSource::Http(url))
        } else {
            Err(HarvestError::Metric {
                what: format!("'{v}' is none of swapin, socket:PATH, http:URL"),
            })
        }
    }
}

/// The harvester's state, updated every step and at once on a burst.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct HarvestStatus {
    pub limit_bytes: u64,
    pub original_limit_bytes: u64,
    pub usage_bytes: u64,
    /// Limit reduction minus zswap pool growth: what may be leased.
    pub harvested_bytes: u64,
    pub zswap_pool_bytes: u64,
    /// "baseline" | "psi"
    pub policy: String,
    /// probing, holding, recovering, prefetching, stopped
    pub state: String,
    pub p99_recent: Option<f64>,
    pub p99_baseline: Option<f64>,
    pub swapin_per_s: f64,
    pub stall_per_s: f64,
    pub oom_kills: u64,
    pub steps: u64,
    pub recoveries: u64,
    pub prefetches: u64,
    /// Bytes the prefetches advised the kernel to read back, in all.
    pub prefetched_bytes: u64,
    /// CPU time the harvester's thread used so far, seconds (the reclaim its lowering
    /// triggers runs on it; zswap's writeback runs in kernel workers and is not counted).
    pub cpu_seconds: f64,
}

/// What can go wrong harvesting.
#[derive(Debug, thiserror::Error)]
pub enum HarvestError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error("no cgroup v1 memory controller at {0}")]
    NoMemoryController(PathBuf),
    #[error("the workload command is empty")]
    EmptyCommand,
    #[error("cannot start the workload {cmd:?}: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: std::io::Error,
    },
    #[error("metric: {what}")]
    Metric { what: String },
    #[error("state file {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("record {path}: {why}")]
    Record { path: PathBuf, why: String },
    #[error("cannot start the harvester thread: {0}")]
    Thread(std::io::Error),
    #[error("the harvester thread panicked")]
    Panicked,
}

/// A running harvester (see the module doc). Stopping it — [`Harvester::stop`] or drop —
/// restores the limit, swap and zswap.
pub struct Harvester {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<ForeignGroup>>,
    rx: tokio::sync::watch::Receiver<HarvestStatus>,
    changes: Vec<String>,
    machine: Option<machine::Machine>,
    child: Option<std::process::Child>,
    group: Option<WorkloadGroup>,
    done: bool,
}

/// The state directory, created if needed.
fn state_dir(cfg: &granule_config::Market) -> Result<PathBuf, HarvestError> {
    let dir = PathBuf::from(&cfg.state_dir);
    std::fs::create_dir_all(&dir).map_err(|e| HarvestError::State {
        path: dir.clone(),
        source: e,
    })?;
    Ok(dir)
}

/// The limit record file of the group `dir`.
fn limit_record(state_dir: &Path, dir: &Path) -> PathBuf {
    let name: String = dir
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    state_dir.join(format!("limit{name}.record"))
}

impl Harvester {
    /// Undo what a killed producer left (limit, swap, zswap) from the records in
    /// `cfg.state_dir`; returns one line per thing restored.
    pub fn recover(cfg: &granule_config::Market) -> Result<Vec<String>, HarvestError> {
        let dir = PathBuf::from(&cfg.state_dir);
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => {
                return Err(HarvestError::State {
                    path: dir,
                    source: e,
                })
            }
        };
        let mut records: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("limit") && n.ends_with(".record"))
            })
            .collect();
        records.sort();
        // Limits first: a swapoff must be able to bring pages back under the old limit.
        for r in records {
            match granule_host::restore_from_record(&r)? {
                granule_host::Restored::Restored { dir, limit } => out.push(format!(
                    "restored {} limit to {}",
                    dir.display(),
                    human_limit(limit)
                )),
                granule_host::Restored::GroupGone { dir } => out.push(format!(
                    "{} is gone: nothing to restore, record removed",
                    dir.display()
                )),
                granule_host::Restored::NoRecord => {}
            }
        }
        out.extend(machine::recover(&dir)?);
        Ok(out)
    }

    /// Set up the machine if needed (swap file, zswap), adopt or create the cgroup,
    /// record everything for recovery, and start the control loop on its own thread.
    /// Callable inside or outside a tokio runtime.
    pub fn start(
        cfg: &granule_config::Market,
        workload: Workload,
        metric: MetricSource,
    ) -> Result<Harvester, HarvestError> {
        let state = state_dir(cfg)?;
        let mut changes = Harvester::recover(cfg)?;
        let h = Hierarchy::default();
        let mem_root = h.controller_dir(Controller::Memory);
        let (mut group, workload_group, child) = match workload {
            Workload::Cgroup(p) => {
                let dir = if p.is_absolute() {
                    p
                } else {
                    if !h.has(Controller::Memory) {
                        return Err(HarvestError::NoMemoryController(mem_root));
                    }
                    h.group_dir(Controller::Memory, &format!("/{}", p.display()))?
                };
                (ForeignGroup::adopt_dir(dir)?, None, None)
            }
            Workload::Command(argv) => {
                let Some((prog, args)) = argv.split_first() else {
                    return Err(HarvestError::EmptyCommand);
                };
                if !h.has(Controller::Memory) {
                    return Err(HarvestError::NoMemoryController(mem_root));
                }
                let wg = WorkloadGroup::create(&h, &format!("producer-{}", std::process::id()))?;
                // The child runs briefly in the producer's group before it is moved: its
                // first allocations stay charged there (v1 does not move charges).
                let child = std::process::Command::new(prog)
                    .args(args)
                    .spawn()
                    .map_err(|e| HarvestError::Spawn {
                        cmd: argv.join(" "),
                        source: e,
                    })?;
                wg.join(child.id())?;
                changes.push(format!(
                    "started {} (pid {}) in memory cgroup {}",
                    argv.join(" "),
                    child.id(),
                    wg.dir().display()
                ));
                let g = ForeignGroup::adopt_dir(wg.dir())?;
                (g, Some(wg), Some(child))
            }
        };
        group.record_to(limit_record(&state, group.dir()))?;
        let metric = metric::Metric::open(&metric)?;
        let (machine, said) = machine::Machine::setup(cfg, &state)?;
        changes.extend(said);
        for c in &changes {
            tracing::info!("producer: {c}");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = tokio::sync::watch::channel(HarvestStatus::default());
        let lp = run::Loop::new(cfg.clone(), group, metric, tx, stop.clone())?;
        let thread = std::thread::Builder::new()
            .name("harvester".into())
            .spawn(move || lp.run())
            .map_err(HarvestError::Thread)?;
        Ok(Harvester {
            stop,
            thread: Some(thread),
            rx,
            changes,
            machine: Some(machine),
            child,
            group: workload_group,
            done: false,
        })
    }

    /// What it changed on the machine, for printing.
    pub fn changes(&self) -> Vec<String> {
        self.changes.clone()
    }

    pub fn status(&self) -> HarvestStatus {
        self.rx.borrow().clone()
    }

    /// Updated every step and at once on a burst.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<HarvestStatus> {
        self.rx.clone()
    }

    /// The spawned workload's pid ([`Workload::Command`]).
    pub fn child_pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Stop the loop, restore the limit, swap and zswap; return what was undone. A
    /// spawned workload is killed and its group removed. Also done on drop.
    pub fn stop(mut self) -> Result<Vec<String>, HarvestError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<Vec<String>, HarvestError> {
        if self.done {
            return Ok(Vec::new());
        }
        self.done = true;
        self.stop.store(true, Ordering::Relaxed);
        let mut out = Vec::new();
        let mut first_err = None;
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(mut g) => {
                    let was = g.limit().ok();
                    match g.restore() {
                        Ok(()) => out.push(format!(
                            "restored {} limit to {}{}",
                            g.dir().display(),
                            human_limit(g.found_limit()),
                            was.map(|w| format!(" (was {})", human_limit(w)))
                                .unwrap_or_default()
                        )),
                        Err(e) => first_err = Some(e.into()),
                    }
                }
                Err(_) => first_err = Some(HarvestError::Panicked),
            }
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            out.push(format!("stopped the workload (pid {})", c.id()));
        }
        if let Some(g) = self.group.take() {
            let dir = g.dir().display().to_string();
            match g.remove() {
                Ok(()) => out.push(format!("removed memory cgroup {dir}")),
                Err(e) => {
                    first_err.get_or_insert(e.into());
                }
            }
        }
        if let Some(mut m) = self.machine.take() {
            match m.undo() {
                Ok(lines) => out.extend(lines),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

impl Drop for Harvester {
    fn drop(&mut self) {
        match self.shutdown() {
            Ok(lines) => {
                for l in lines {
                    tracing::info!("producer: {l}");
                }
            }
            Err(e) => tracing::warn!("producer: cannot undo everything: {e}"),
        }
    }
}

/// A limit for people: `max`, or MiB/GiB.
pub(crate) fn human_limit(l: granule_host::Limit) -> String {
    match l.bytes() {
        None => "max".into(),
        Some(b) if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        Some(b) => format!("{} MiB", b >> 20),
    }
}

#[cfg(test)]
mod tests {
    //! The machine set-up and its undoing, for real: a cgroup, a swap file and zswap on
    //! this machine, a producer killed with SIGKILL and the next start's recovery. Needs
    //! root, cgroup v1's memory controller and a machine without swap; skipped (with the
    //! reason printed) otherwise.
    use super::*;
    use std::io::BufRead;
    use std::time::{Duration, Instant};

    fn skip_reason() -> Option<String> {
        if !granule_host::proc::is_root() {
            return Some("needs root".into());
        }
        if !Hierarchy::default().has(Controller::Memory) {
            return Some("no cgroup v1 memory controller".into());
        }
        match granule_host::mem::swaps() {
            Ok(a) if a.is_empty() => None,
            Ok(_) => Some("the machine has swap already: nothing to set up".into()),
            Err(e) => Some(format!("cannot read the swap areas: {e}")),
        }
    }

    fn cfg(dir: &Path) -> granule_config::Market {
        granule_config::Market {
            state_dir: dir.join("state").display().to_string(),
            swap_file: Some(dir.join("test.swap").display().to_string()),
            swap_size: 128 << 20,
            chunk: 4 << 20,
            headroom: 8 << 20,
            cooling_period: Duration::from_millis(300),
            observe: Duration::ZERO,
            ..granule_config::Market::default()
        }
    }

    /// The helper file a SIGKILL helper reads: (test dir, cgroup dir).
    fn helper_file(parent: u32) -> PathBuf {
        std::env::temp_dir().join(format!("granule-harvest-helper-{parent}"))
    }

    /// Run only as the child of `setup_undo_and_sigkill_recovery`: start a harvester on
    /// the given group, say so once the limit went down, and wait to be killed.
    #[test]
    #[ignore = "a helper process of setup_undo_and_sigkill_recovery"]
    fn sigkill_helper() {
        let Ok(text) = std::fs::read_to_string(helper_file(std::os::unix::process::parent_id()))
        else {
            return;
        };
        let mut lines = text.lines();
        let (Some(dir), Some(group)) = (lines.next(), lines.next()) else {
            return;
        };
        let h = Harvester::start(
            &cfg(Path::new(dir)),
            Workload::Cgroup(PathBuf::from(group)),
            MetricSource::SwapIn,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let s = h.status();
            if s.steps > 0 && s.limit_bytes < s.original_limit_bytes {
                println!("LOWERED {}", s.limit_bytes);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_secs(30));
        std::mem::forget(h);
    }

    #[test]
    fn setup_undo_and_sigkill_recovery() {
        if let Some(why) = skip_reason() {
            eprintln!("skipped: {why}");
            return;
        }
        let tmp = std::env::temp_dir().join(format!("granule-harvest-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let c = cfg(&tmp);
        // Whatever happens below, undo what is left (a failed assertion must not leave a
        // swap file on or a limit lowered).
        struct Cleanup(granule_config::Market, PathBuf);
        impl Drop for Cleanup {
            fn drop(&mut self) {
                if let Err(e) = Harvester::recover(&self.0) {
                    eprintln!("cleanup: {e}");
                }
                let _ = std::fs::remove_dir_all(&self.1);
            }
        }
        let _cleanup = Cleanup(c.clone(), tmp.clone());
        let zswap = granule_host::mem::Zswap::system();
        let zswap_before = zswap.present().then(|| zswap.params().unwrap());
        let swap = PathBuf::from(c.swap_file.clone().unwrap());

        // 1. Start and stop: a swap file appears and goes, zswap comes back as it was, the
        // spawned workload's group is removed.
        let h = Harvester::start(
            &c,
            Workload::Command(vec!["sleep".into(), "30".into()]),
            MetricSource::SwapIn,
        )
        .unwrap();
        let changes = h.changes();
        assert!(
            changes.iter().any(|l| l.contains("swap file")),
            "{changes:?}"
        );
        assert!(granule_host::swapfile::is_active(&swap).unwrap());
        let pid = h.child_pid().unwrap();
        let group = granule_host::paths_of(pid).and_then(|p| p.memory).unwrap();
        assert!(group.contains("granule-workloads/producer-"), "{group}");
        let undone = h.stop().unwrap();
        assert!(
            undone.iter().any(|l| l.contains("removed swap file")),
            "{undone:?}"
        );
        assert!(!granule_host::swapfile::is_active(&swap).unwrap());
        assert!(!swap.exists());
        assert_eq!(
            zswap.present().then(|| zswap.params().unwrap()),
            zswap_before
        );
        assert!(granule_host::proc::process_gone(pid));

        // 2. A producer killed with SIGKILL after lowering a limit: the next start's
        // recovery puts the limit, swap and zswap back.
        let wg = WorkloadGroup::create(
            &Hierarchy::default(),
            &format!("test-harvest-{}", std::process::id()),
        )
        .unwrap();
        // A workload with 48 MiB of anonymous memory: a shell variable, kept until the
        // shell is killed (`read` is a builtin: no child process outlives it).
        let work = std::process::Command::new("sh")
            .args(["-c", "x=$(head -c 50000000 /dev/zero | tr '\\0' a); read y"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        struct Kill(std::process::Child);
        impl Drop for Kill {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let work = Kill(work);
        wg.join(work.0.id()).unwrap();
        let fg = ForeignGroup::adopt_dir(wg.dir()).unwrap();
        let found = fg.found_limit();
        // Wait for the shell's memory to be there.
        let deadline = Instant::now() + Duration::from_secs(10);
        while fg.usage().unwrap() < 40 << 20 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::fs::write(
            helper_file(std::process::id()),
            format!("{}\n{}\n", tmp.display(), wg.dir().display()),
        )
        .unwrap();
        let mut helper = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "harvester::tests::sigkill_helper",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(helper.stdout.take().unwrap());
        let lowered = out
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("LOWERED"));
        helper.kill().unwrap(); // SIGKILL
        helper.wait().unwrap();
        let _ = std::fs::remove_file(helper_file(std::process::id()));
        assert!(lowered.is_some(), "the helper never lowered the limit");
        assert_ne!(
            fg.limit().unwrap(),
            found,
            "the kill left the limit lowered"
        );
        assert!(granule_host::swapfile::is_active(&swap).unwrap());
        let restored = Harvester::recover(&c).unwrap();
        assert!(
            restored
                .iter()
                .any(|l| l.starts_with("restored") && l.contains("limit")),
            "{restored:?}"
        );
        assert!(
            restored.iter().any(|l| l.contains("removed swap file")),
            "{restored:?}"
        );
        assert_eq!(fg.limit().unwrap(), found);
        assert!(!granule_host::swapfile::is_active(&swap).unwrap());
        assert_eq!(
            zswap.present().then(|| zswap.params().unwrap()),
            zswap_before
        );
        // Nothing left to recover.
        assert!(Harvester::recover(&c).unwrap().is_empty());
        drop(work);
        drop(fg);
        wg.remove().unwrap();
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
