//! Readings of processes and threads from `/proc`: CPU time, resident memory, each
//! thread's scheduler statistics, the task list, a process's state, its open file
//! descriptors.
//!
//! Monitors call some of these every few milliseconds; they allocate little and never
//! panic on odd content (a reading that cannot be made is `None` or 0).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

/// This process's executable, as the kernel names it (a node process is started from it,
/// and the identical-binary check hashes it).
pub const SELF_EXE: &str = "/proc/self/exe";

/// CPU seconds (user + system) this process has used so far (`/proc/self/stat`).
pub fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let f = stat_fields(&stat)?;
    // After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// The fields of a `/proc/<pid>/stat` line after the command name (field 3 first). The
/// name (field 2) is in parentheses and may itself contain spaces and parentheses, so
/// fields are counted after the last `)`.
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_ascii_whitespace().collect())
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map(|v| v as f64)
        .unwrap_or(100.0)
}

/// The size of a memory page, bytes.
pub fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(4096) as u64
}

/// Resident memory of this process, bytes (`/proc/self/statm`; 0 if unreadable).
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_ascii_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|pages| pages * page_size())
        .unwrap_or(0)
}

/// The CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`; a system call of
/// ~350 ns on this class of VM, so not for every call of a hot path). Zero if the clock
/// cannot be read.
pub fn thread_cpu_time() -> Duration {
    clock(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
}

/// The CPU time this process has used, all threads (`CLOCK_PROCESS_CPUTIME_ID`).
pub fn process_cpu_time() -> Duration {
    clock(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
}

/// `CLOCK_MONOTONIC` now, as time since boot (not counting suspend): the clock `Instant`
/// reads and `perf` can stamp events with, for lining up a trace with our timings.
pub fn monotonic_clock() -> Duration {
    clock(nix::time::ClockId::CLOCK_MONOTONIC)
}

/// CPU time on a CPU of every living thread of process `pid`, summed from each thread's
/// schedstat (nanosecond resolution, unlike the tick-based [`process_cpu_time_of`]; exited
/// threads are not counted). 0 if the process is gone.
pub fn threads_cpu_ns(pid: u32) -> u64 {
    tasks_of(pid)
        .into_iter()
        .filter_map(|tid| task_schedstat(pid, tid))
        .map(|s| s.cpu_ns)
        .sum()
}

fn clock(id: nix::time::ClockId) -> Duration {
    nix::time::clock_gettime(id)
        .map(|t| Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32))
        .unwrap_or_default()
}

/// One thread's scheduler statistics (`schedstat`): time on a CPU, time runnable but
/// waiting on a run queue, and the number of times it was scheduled.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Schedstat {
    pub cpu_ns: u64,
    pub runq_delay_ns: u64,
    pub slices: u64,
}

/// Parse the text of a `schedstat` file: `cpu_ns delay_ns slices`.
pub fn parse_schedstat(text: &str) -> Option<Schedstat> {
    let mut f = text.split_ascii_whitespace();
    Some(Schedstat {
        cpu_ns: f.next()?.parse().ok()?,
        runq_delay_ns: f.next()?.parse().ok()?,
        slices: f.next().and_then(|s| s.parse().ok()).unwrap_or(0),
    })
}

/// A thread of this process's statistics (`/proc/self/task/TID/schedstat`); `None` if the
/// thread is gone.
pub fn thread_schedstat(tid: i32) -> Option<Schedstat> {
    parse_schedstat(&std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?)
}

/// A thread of any process's statistics (`/proc/PID/task/TID/schedstat`).
pub fn task_schedstat(pid: u32, tid: i32) -> Option<Schedstat> {
    parse_schedstat(&std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?)
}

/// The calling thread's statistics, read again and again cheaply: the file is opened once
/// and re-read from offset 0 with `pread` (the kernel regenerates it on every read).
/// Belongs to the thread that made it.
#[derive(Debug)]
pub struct OwnSchedstat {
    file: Option<File>,
}

impl OwnSchedstat {
    /// Open the calling thread's `/proc/thread-self/schedstat`.
    pub fn open() -> OwnSchedstat {
        OwnSchedstat {
            file: File::open("/proc/thread-self/schedstat").ok(),
        }
    }

    /// The current reading; `None` where there is no such file.
    pub fn read(&self) -> Option<Schedstat> {
        let f = self.file.as_ref()?;
        let mut buf = [0u8; 128];
        let n = f.read_at(&mut buf, 0).ok()?;
        parse_schedstat(std::str::from_utf8(&buf[..n]).ok()?)
    }
}

/// The ids of this process's threads (`/proc/self/task`).
pub fn thread_ids() -> Vec<i32> {
    tasks_in(Path::new("/proc/self/task"))
}

/// The ids of another process's threads (empty if it is gone).
pub fn tasks_of(pid: u32) -> Vec<i32> {
    tasks_in(&Path::new("/proc").join(pid.to_string()).join("task"))
}

fn tasks_in(dir: &Path) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// The name (`comm`, at most 15 bytes) of one of this process's threads.
pub fn thread_name(tid: i32) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
    Some(s.trim_end().to_string())
}

/// The calling thread's id.
pub fn current_tid() -> i32 {
    nix::unistd::gettid().as_raw()
}

/// A process's state letter (`R`, `S`, `D`, `Z`, ...; field 3 of `/proc/PID/stat`), or
/// `None` if there is no such process.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_fields(&stat)?.first()?.chars().next()
}

/// One thread's state letter (field 3 of `/proc/PID/task/TID/stat`), or `None` if that
/// thread is gone.
pub fn task_state(pid: u32, tid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    stat_fields(&stat)?.first()?.chars().next()
}

/// Whether every thread of a live process is stopped (`T`, as after SIGSTOP). `kill(2)`
/// returns before the signal has stopped all threads, so a test that freezes a process
/// waits for this before it relies on the process being silent.
pub fn process_stopped(pid: u32) -> bool {
    let tasks = tasks_of(pid);
    !tasks.is_empty() && tasks.iter().all(|&tid| task_state(pid, tid) == Some('T'))
}

/// Whether a process is gone: no such process, a zombie nobody reaped yet, or dead
/// (`X`, seen only for an instant).
pub fn process_gone(pid: u32) -> bool {
    matches!(process_state(pid), None | Some('Z') | Some('X'))
}

/// A process's resident memory, bytes (field 24 of `/proc/PID/stat`, in pages).
pub fn process_resident_bytes(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let pages: u64 = stat_fields(&stat)?.get(24 - 3)?.parse().ok()?;
    Some(pages * page_size())
}

/// A process's CPU time so far (utime + stime of `/proc/PID/stat`).
pub fn process_cpu_time_of(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f = stat_fields(&stat)?;
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some(Duration::from_secs_f64((utime + stime) / clock_ticks()))
}

/// Each vCPU's time so far from `/proc/stat`, in clock ticks: (busy, total), where busy
/// is everything but idle and iowait. Indexed by vCPU; empty when it cannot be read.
pub fn cpu_ticks() -> Vec<(u64, u64)> {
    let Ok(text) = std::fs::read_to_string("/proc/stat") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(name) = words.next() else { continue };
        let Some(n) = name.strip_prefix("cpu").filter(|n| !n.is_empty()) else {
            continue;
        };
        let Ok(cpu) = n.parse::<usize>() else {
            continue;
        };
        let v: Vec<u64> = words.filter_map(|w| w.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal (guest time is in user).
        let total: u64 = v.iter().take(8).sum();
        let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
        if out.len() <= cpu {
            out.resize(cpu + 1, (0, 0));
        }
        out[cpu] = (total.saturating_sub(idle), total);
    }
    out
}

/// Whether the calling process runs as root (uid 0), as `/proc/self/status` would say.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// A process's `oom_score_adj` (-1000 ..= 1000).
pub fn oom_score_adj(pid: u32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The calling thread's scheduler slice as the kernel reports it (`se.slice` in
/// `/proc/thread-self/sched`, nanoseconds; Linux 6.6+ only).
pub fn thread_slice_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/sched").ok()?;
    let line = text.lines().find(|l| l.starts_with("se.slice"))?;
    line.split(':').nth(1)?.trim().parse().ok()
}

/// How many file descriptors this process has open (entries of `/proc/self/fd`, less the
/// one the listing itself opens). The HTTP doors count them to keep a reserve for cluster
/// traffic.
pub fn open_fds() -> std::io::Result<u64> {
    let n = std::fs::read_dir("/proc/self/fd")?.count() as u64;
    Ok(n.saturating_sub(1))
}

/// How many file descriptors process `pid` has open (`/proc/<pid>/fd`; `None` when it
/// cannot be read: gone, or another user's).
pub fn open_fds_of(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_descriptors_are_counted() {
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        // The standard streams and `f` at least.
        assert!(open_fds().unwrap() >= 4);
        assert!(open_fds_of(std::process::id()).unwrap() >= 4);
        drop(f);
        assert!(crate::os::raise_nofile_limit().unwrap() >= crate::os::nofile_limit().unwrap().0);
        let (soft, hard) = crate::os::nofile_limit().unwrap();
        assert_eq!(soft, hard, "raised to the hard limit");
    }

    #[test]
    fn own_readings_are_plausible() {
        assert!(process_cpu_seconds().is_some());
        assert!(resident_bytes() > 1 << 20);
        let me = current_tid();
        assert!(thread_ids().contains(&me));
        // Other tests start and end threads meanwhile: the two readings agree once the
        // harness holds still between them.
        assert!(
            (0..100).any(|_| tasks_of(std::process::id()).len() == thread_ids().len()),
            "tasks_of(own pid) and thread_ids() never agreed"
        );
        assert!(tasks_of(std::process::id()).contains(&me));
        // The kernel folds running time in at ticks and switches: spin past a few ticks.
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(30) {
            std::hint::black_box(0u64);
        }
        std::thread::yield_now();
        assert!(thread_schedstat(me).unwrap().cpu_ns > 0);
        assert!(OwnSchedstat::open().read().unwrap().cpu_ns > 0);
        assert!(thread_cpu_time() > Duration::ZERO);
        assert!(process_cpu_time() >= thread_cpu_time());
        assert!(process_state(std::process::id()).is_some());
        assert!(!process_gone(std::process::id()));
        assert!(process_resident_bytes(std::process::id()).unwrap() > 1 << 20);
        assert!(thread_name(me).is_some());
        assert!(threads_cpu_ns(std::process::id()) > 0);
        assert_eq!(threads_cpu_ns(u32::MAX), 0);
        let a = monotonic_clock();
        assert!(monotonic_clock() >= a && a > Duration::ZERO);
    }

    #[test]
    fn schedstat_lines() {
        assert_eq!(
            parse_schedstat("123 45 6\n"),
            Some(Schedstat {
                cpu_ns: 123,
                runq_delay_ns: 45,
                slices: 6
            })
        );
        assert_eq!(parse_schedstat("1 2").map(|s| s.slices), Some(0));
        assert_eq!(parse_schedstat("x y z"), None);
        assert_eq!(parse_schedstat(""), None);
    }

    #[test]
    fn a_stopped_child_reads_as_stopped_and_a_running_one_does_not() {
        use nix::sys::signal::{kill, Signal};
        use nix::unistd::Pid;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!process_stopped(pid));
        kill(Pid::from_raw(pid as i32), Signal::SIGSTOP).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !process_stopped(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "never read as stopped"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        kill(Pid::from_raw(pid as i32), Signal::SIGCONT).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!process_stopped(pid), "a reaped process is not stopped");
    }

    #[test]
    fn stat_fields_survive_odd_names() {
        let f = stat_fields("1 (a (b) c) S 1 2").unwrap();
        assert_eq!(f[0], "S");
        assert!(stat_fields("no parens").is_none());
    }

    #[test]
    fn a_process_that_is_reaped_is_gone() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(process_gone(pid));
    }
}
