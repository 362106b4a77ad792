//! Provenance stamped into every report: [`Meta`] (git commit, machine, UTC time,
//! thread placement, quick mode, notes) and how it is collected from git, the host
//! (`granule_host::machine`, which reads `/proc`) and the clock.

use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Environment variable consulted for the commit when `git` is unavailable (e.g. when
/// running from a source tarball or a container without `.git`).
pub const COMMIT_ENV: &str = "GRANULE_COMMIT";

/// Provenance of one benchmark run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Meta {
    /// Short commit hash (12 hex digits), with `+dirty` appended when the work tree has
    /// changes; or `$GRANULE_COMMIT`; or `"unknown"`.
    pub commit: String,
    /// Whether `git status --porcelain` (outside `docs/results`) was non-empty.
    pub dirty: bool,
    /// CPU model name (from `/proc/cpuinfo`, through `granule_host::machine`).
    pub cpu_model: String,
    /// Logical CPUs listed in `/proc/cpuinfo`.
    pub vcpus: usize,
    /// CPUs this process may run on (affinity / cgroup quota), as Rust sees it.
    pub available_parallelism: usize,
    /// `MemTotal` from `/proc/meminfo`, in bytes (0 if unknown).
    pub mem_total_bytes: u64,
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// When [`Meta::collect`] ran, RFC 3339 UTC (`2026-11-22T05:46:00Z`).
    pub timestamp: String,
    /// Seconds since the Unix epoch of the same instant.
    pub unix_time: u64,
    /// How threads were placed (set by each benchmark).
    pub placement: String,
    /// Whether this was a `--quick` run.
    pub quick: bool,
    /// Free-form notes.
    pub notes: Vec<String>,
}

impl Meta {
    /// Collects provenance now: runs `git` in the current directory, asks the host what
    /// machine this is, and reads the clock. Never fails: anything unavailable becomes
    /// `"unknown"` or 0.
    pub fn collect(placement: impl Into<String>, quick: bool) -> Meta {
        let (commit, dirty) = git_commit(Path::new("."));
        let granule_host::machine::Machine {
            cpu_model,
            cpus: listed,
            mem_total_bytes,
            kernel,
        } = granule_host::machine::Machine::read();
        let available_parallelism = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let unix_time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Meta {
            commit,
            dirty,
            cpu_model,
            vcpus: if listed > 0 {
                listed
            } else {
                available_parallelism
            },
            available_parallelism,
            mem_total_bytes,
            kernel,
            timestamp: format_utc(unix_time),
            unix_time,
            placement: placement.into(),
            quick,
            notes: Vec::new(),
        }
    }

    /// Adds a note (builder style).
    pub fn with_note(mut self, note: impl Into<String>) -> Meta {
        self.notes.push(note.into());
        self
    }

    /// Adds a note.
    pub fn note(&mut self, note: impl Into<String>) -> &mut Self {
        self.notes.push(note.into());
        self
    }

    /// One-line machine description, e.g.
    /// `AMD EPYC 7B13, 2 vCPUs, 23.5 GiB RAM, Linux 6.1.102`.
    pub fn machine(&self) -> String {
        let mut s = format!(
            "{}, {} vCPU{}",
            self.cpu_model,
            self.vcpus,
            if self.vcpus == 1 { "" } else { "s" }
        );
        if self.available_parallelism != self.vcpus {
            s.push_str(&format!(" ({} usable)", self.available_parallelism));
        }
        if self.mem_total_bytes > 0 {
            let gib = self.mem_total_bytes as f64 / (1u64 << 30) as f64;
            s.push_str(&format!(", {gib:.1} GiB RAM"));
        }
        s.push_str(&format!(", Linux {}", self.kernel));
        s
    }
}

/// `(commit, dirty)` for the repository containing `dir`.
fn git_commit(dir: &Path) -> (String, bool) {
    let run = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let from_git = run(&["rev-parse", "--short=12", "HEAD"])
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty());
    match from_git {
        Some(hash) => {
            // Benchmark reports written earlier in the same session (docs/results) do
            // not make the code dirty; anything else that differs from the commit does.
            let dirty = run(&["status", "--porcelain", "--", ".", ":(exclude)docs/results"])
                .map(|s| !s.trim().is_empty())
                .unwrap_or(false);
            let commit = if dirty { format!("{hash}+dirty") } else { hash };
            (commit, dirty)
        }
        None => {
            let commit = std::env::var(COMMIT_ENV)
                .ok()
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "unknown".to_owned());
            (commit, false)
        }
    }
}

/// RFC 3339 UTC for seconds since the Unix epoch (proleptic Gregorian calendar).
pub fn format_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_formatting() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(format_utc(1_798_761_599), "2026-12-31T23:59:59Z");
        assert_eq!(format_utc(4_107_542_400), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn collect_fills_everything() {
        let m = Meta::collect("all threads on core 0", true).with_note("n1");
        assert!(!m.commit.is_empty());
        assert_eq!(m.dirty, m.commit.ends_with("+dirty"));
        assert!(m.vcpus >= 1);
        assert!(m.available_parallelism >= 1);
        assert_eq!(m.placement, "all threads on core 0");
        assert!(m.quick);
        assert_eq!(m.notes, vec!["n1".to_owned()]);
        assert_eq!(m.timestamp.len(), "2026-11-22T05:46:00Z".len());
        assert!(m.timestamp.ends_with('Z'));
        let machine = m.machine();
        assert!(machine.contains("vCPU"), "{machine}");
        assert!(machine.contains("Linux"), "{machine}");
    }

    #[test]
    fn git_commit_and_dirty_flag() {
        let dir = tempfile::tempdir().unwrap();
        let git = |args: &[&str]| {
            Command::new("git")
                .args(["-c", "user.name=t", "-c", "user.email=t@example.invalid"])
                .args(args)
                .current_dir(dir.path())
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        };
        if !git(&["init", "-q"]) {
            eprintln!("git unavailable; skipping");
            return;
        }
        std::fs::write(dir.path().join("f"), "1").unwrap();
        assert!(git(&["add", "f"]));
        assert!(git(&["commit", "-q", "-m", "x"]));
        let (commit, dirty) = git_commit(dir.path());
        assert_eq!(commit.len(), 12, "{commit}");
        assert!(commit.chars().all(|c| c.is_ascii_hexdigit()), "{commit}");
        assert!(!dirty);
        std::fs::write(dir.path().join("f"), "2").unwrap();
        let (commit2, dirty) = git_commit(dir.path());
        assert!(dirty);
        assert_eq!(commit2, format!("{commit}+dirty"));
    }

    #[test]
    fn git_fallback_outside_a_repository() {
        let dir = tempfile::tempdir().unwrap();
        // Outside any repository, git fails and we fall back to the env var or "unknown".
        let (commit, dirty) = git_commit(dir.path());
        assert!(!dirty);
        match std::env::var(COMMIT_ENV) {
            Ok(v) if !v.trim().is_empty() => assert_eq!(commit, v.trim()),
            _ => assert_eq!(commit, "unknown"),
        }
    }
}
