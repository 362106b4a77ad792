//! `granule-bench fs`: the scavenging file system's mount (`granule fs mount`) against
//! tmpfs and against a FUSE passthrough (Debian's `bindfs`) over tmpfs, with one raw
//! loopback TCP stream as the ceiling for reads, all in the same run.
//!
//! **The file systems.** A fresh tmpfs mounted for the run; `bindfs` over a directory of
//! that tmpfs, mounted with `-o big_writes,max_write=1048576` (bindfs links libfuse 2,
//! which negotiates no `max_pages` with the kernel, so its writes reach the daemon in
//! 128 KiB requests, not 4 KiB ones; single-threaded, bindfs's default); the Granule
//! mount, a child process of this executable (`granule fs mount DIR --nodes NODES`, its
//! own embedded nodes, default stripe and one replica), used once it prints its
//! `mounted` line. Every mount is undone on every way out (a guard per mount; the
//! Granule mount gets SIGTERM, then SIGKILL, then `fusermount3 -uz`), and a run first
//! undoes whatever a killed earlier run left under its work directory.
//!
//! **The tests**, on each file system in turn (the order rotates each repetition):
//! 1. sequential write: `dd if=/dev/zero bs=1M conv=fsync` of 1 GiB (`--quick`: 64 MiB),
//!    dd's own time, which ends after its fsync;
//! 2. cold sequential read of that file: `sync`, `sysctl vm.drop_caches=3`, then
//!    `dd of=/dev/null bs=1M`. For the two FUSE mounts the page cache in front of the
//!    daemon is dropped, so every byte crosses FUSE; tmpfs's pages *are* the file and
//!    cannot be dropped, so its figure is a memory read (`seq_read_vs_tmpfs` is reported,
//!    not judged);
//! 3. random 4 KiB I/O with `fio --ioengine=psync --bs=4k` on a 256 MiB file (`--quick`:
//!    32 MiB) written beforehand with dd: random overwrites (`--end_fsync=1`, fsync
//!    timed), then — after `sync` and dropping caches — random reads, one pass over the
//!    file in random order (fio's random map: every block read once, so no read is
//!    served by an earlier one's page), each bounded by `--runtime`;
//! 4. small files: create (empty; `open(O_CREAT|O_TRUNC)` and close), stat, unlink
//!    10,000 files (`--quick`: 1,000) in one directory, from this process with `std::fs`,
//!    each phase timed, the phases back to back as a tool would run them.
//!
//! Once per repetition, one loopback TCP stream carries the same bytes as the
//! sequential file (a writer and a reader thread of this process, 1 MiB buffers): the
//! most a network file system could read over one connection on this machine. Before
//! the tests, a pseudo-random 3 MiB + 4099 B file is written, read back cold and compared
//! on each file system (not timed): a mount that returns wrong bytes fails the benchmark.
//!
//! Figures are medians of 3 repetitions (`--quick`: 1; `--reps` overrides); ratios are
//! ratios of medians. Needs root (mounts, dropping caches), `/dev/fuse`, `dd`, `fio`,
//! `bindfs`, `fusermount3` and `sysctl`; says which is missing otherwise.

use crate::interrupt::{catch_signals, check_interrupted, Active};
use crate::BenchOpts;
use anyhow::{bail, Context};
use granule_report::{Cell, Meta, Plot, Report, Table};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The Granule mount's own nodes: two embedded node processes, each with room for the
/// whole sequential file.
const NODES: &str = "cpu=1,mem=2GiB;cpu=1,mem=2GiB";
/// bindfs's mount options: large writes (see the module doc).
const BINDFS_OPTS: &str = "big_writes,max_write=1048576";
/// How long the Granule mount may take to print its `mounted` line.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a stopped mount process may take to unmount and exit after SIGTERM.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// Targets (judged).
const TARGET_SEQ_WRITE_VS_TMPFS: f64 = 0.25;
const TARGET_SEQ_READ_COLD_VS_PASSTHROUGH: f64 = 1.0;
const TARGET_SEQ_READ_COLD_VS_RAW_TCP: f64 = 0.5;
const MIB: u64 = 1 << 20;

/// The run's size.
#[derive(Clone, Debug)]
struct Params {
    reps: usize,
    seq_bytes: u64,
    fio_bytes: u64,
    fio_runtime_s: u64,
    files: usize,
}

impl Params {
    fn new(quick: bool, reps: Option<usize>) -> Params {
        if quick {
            Params {
                reps: reps.unwrap_or(1),
                seq_bytes: 64 * MIB,
                fio_bytes: 32 * MIB,
                fio_runtime_s: 10,
                files: 1_000,
            }
        } else {
            Params {
                reps: reps.unwrap_or(3),
                seq_bytes: 1024 * MIB,
                fio_bytes: 256 * MIB,
                fio_runtime_s: 30,
                files: 10_000,
            }
        }
    }
}

/// The file systems measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fs {
    Tmpfs,
    Bindfs,
    Granule,
}

impl Fs {
    const ALL: [Fs; 3] = [Fs::Tmpfs, Fs::Bindfs, Fs::Granule];

    fn name(self) -> &'static str {
        match self {
            Fs::Tmpfs => "tmpfs",
            Fs::Bindfs => "bindfs",
            Fs::Granule => "granule",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One repetition's figures on one file system.
#[derive(Clone, Copy, Debug)]
struct Sample {
    write_gbps: f64,
    read_gbps: f64,
    randwrite_iops: f64,
    randread_iops: f64,
    create_ops: f64,
    stat_ops: f64,
    unlink_ops: f64,
    /// All three small-file phases together: 3 × files ÷ their total time.
    small_ops: f64,
}

// ---------------------------------------------------------------------------------------
// Commands and the machine.

/// Run `cmd` to completion; an error (with its stderr) when it cannot start or fails.
fn run_cmd(cmd: &mut Command, what: &str) -> anyhow::Result<Output> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// Whether `tool` can be started (`tool ARG` exits at all).
fn has_tool(tool: &str, arg: &str) -> bool {
    Command::new(tool)
        .arg(arg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// What is missing on this machine to run the benchmark.
fn check_machine() -> anyhow::Result<()> {
    if !granule_host::proc::is_root() {
        bail!(
            "the fs benchmark needs root: it mounts tmpfs and FUSE file systems and drops the page cache \
             (run it with sudo)"
        );
    }
    if !Path::new("/dev/fuse").exists() {
        bail!(
            "the fs benchmark needs /dev/fuse: load the module (`modprobe fuse`), or in a container pass \
             the device (`--device /dev/fuse`, with CAP_SYS_ADMIN)"
        );
    }
    for (tool, arg, package) in [
        ("dd", "--version", "coreutils"),
        ("fio", "--version", "fio"),
        ("bindfs", "--version", "bindfs"),
        ("fusermount3", "-V", "fuse3"),
        ("sysctl", "--version", "procps"),
        ("mount", "--version", "mount"),
    ] {
        if !has_tool(tool, arg) {
            bail!("{tool} not found (Debian package {package}; scripts/deps.sh installs it)");
        }
    }
    Ok(())
}

/// Write back dirty pages, then drop the page cache, dentries and inodes (machine-wide).
fn drop_caches() -> anyhow::Result<()> {
    nix::unistd::sync();
    run_cmd(
        Command::new("sysctl").args(["-q", "-w", "vm.drop_caches=3"]),
        "sysctl -w vm.drop_caches=3",
    )?;
    Ok(())
}

/// Whether `dir` is the root of a mount (its device differs from its parent's), or a
/// mount whose daemon is gone (stat fails with ENOTCONN).
fn is_mount_point(dir: &Path) -> bool {
    let parent = match dir.parent() {
        Some(p) => p,
        None => return true,
    };
    match (std::fs::metadata(dir), std::fs::metadata(parent)) {
        (Ok(d), Ok(p)) => d.dev() != p.dev(),
        (Err(e), _) => e.raw_os_error() == Some(nix::libc::ENOTCONN),
        _ => false,
    }
}

/// Unmount a FUSE mount: `fusermount3 -uz`, else `umount -l`. Errors ignored (this runs
/// on the way out, and on directories that may not be mounted at all).
fn fuse_unmount(dir: &Path) {
    let quiet = |c: &mut Command| {
        c.arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !quiet(Command::new("fusermount3").arg("-uz")) {
        quiet(Command::new("umount").arg("-l"));
    }
}

/// Unmount a kernel mount (`umount`, else `umount -l`); errors ignored.
fn unmount(dir: &Path) {
    let quiet = |c: &mut Command| {
        c.arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !quiet(&mut Command::new("umount")) {
        quiet(Command::new("umount").arg("-l"));
    }
}

/// The last `n` lines of a log file (empty when it cannot be read).
fn log_tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

// ---------------------------------------------------------------------------------------
// Mount guards. Fields of `Mounts` drop in declaration order: the Granule mount and
// bindfs (which sits on the tmpfs) before the tmpfs.

/// A tmpfs mounted for the run; unmounted on drop.
struct TmpfsMount {
    dir: PathBuf,
}

impl TmpfsMount {
    fn mount(dir: &Path, size: u64) -> anyhow::Result<TmpfsMount> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        run_cmd(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o"])
                .arg(format!("size={size},mode=0755"))
                .arg("granule-bench-fs")
                .arg(dir),
            "mount -t tmpfs",
        )?;
        Ok(TmpfsMount {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        unmount(&self.dir);
    }
}

/// bindfs over a tmpfs directory; unmounted on drop.
struct BindfsMount {
    dir: PathBuf,
}

impl BindfsMount {
    fn mount(source: &Path, dir: &Path) -> anyhow::Result<BindfsMount> {
        std::fs::create_dir_all(source)
            .with_context(|| format!("creating {}", source.display()))?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        // bindfs returns once the mount is up (its daemon forks into the background).
        run_cmd(
            Command::new("bindfs")
                .args(["-o", BINDFS_OPTS])
                .arg(source)
                .arg(dir),
            "bindfs (Debian package bindfs)",
        )?;
        let guard = BindfsMount {
            dir: dir.to_path_buf(),
        };
        if !is_mount_point(dir) {
            bail!(
                "bindfs exited successfully but {} is not a mount",
                dir.display()
            );
        }
        Ok(guard)
    }
}

impl Drop for BindfsMount {
    fn drop(&mut self) {
        fuse_unmount(&self.dir);
    }
}

/// The Granule mount: a `granule fs mount` child process. Dropping it stops the process
/// (SIGTERM, then SIGKILL) and unmounts the directory whatever the process did.
struct GranuleMount {
    child: Option<Child>,
    dir: PathBuf,
    log: PathBuf,
    /// The line the mount printed when it was ready.
    mounted_line: String,
}

impl GranuleMount {
    fn start(dir: &Path, log: &Path) -> anyhow::Result<GranuleMount> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let exe = crate::granule_exe()?;
        let log_file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut child = Command::new(&exe)
            .args(["fs", "mount"])
            .arg(dir)
            .args(["--nodes", NODES])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .with_context(|| format!("starting {} fs mount", exe.display()))?;
        let stdout = child.stdout.take();
        let mut guard = GranuleMount {
            child: Some(child),
            dir: dir.to_path_buf(),
            log: log.to_path_buf(),
            mounted_line: String::new(),
        };
        let Some(stdout) = stdout else {
            bail!("granule fs mount: no stdout pipe");
        };
        // A thread reads the mount's stdout to its end (so the pipe never fills) and hands
        // every line over; after the `mounted` line nobody listens and lines are dropped.
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("fs-mount-stdout".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let _ = tx.send(line);
                }
            })
            .context("starting a thread")?;
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        loop {
            check_interrupted()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "granule fs mount did not print its `mounted` line within {} s; its log ({}):\n{}",
                    MOUNT_TIMEOUT.as_secs(),
                    guard.log.display(),
                    log_tail(&guard.log, 20)
                );
            }
            match rx.recv_timeout(left.min(Duration::from_millis(500))) {
                Ok(line) if line.contains("mounted") => {
                    guard.mounted_line = line;
                    break;
                }
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Its stdout closed: it exited (or is exiting) without mounting.
                    let status = guard
                        .child
                        .as_mut()
                        .map(|c| c.wait())
                        .transpose()
                        .ok()
                        .flatten();
                    bail!(
                        "granule fs mount exited before mounting ({}); its log ({}):\n{}",
                        status.map_or("unknown status".into(), |s| s.to_string()),
                        guard.log.display(),
                        log_tail(&guard.log, 20)
                    );
                }
            }
        }
        if !is_mount_point(dir) {
            bail!(
                "granule fs mount printed `{}` but {} is not a mount",
                guard.mounted_line,
                dir.display()
            );
        }
        Ok(guard)
    }

    /// An error when the mount process has exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(child) = self.child.as_mut() {
            if let Some(status) = child.try_wait().context("checking the mount process")? {
                bail!(
                    "the granule mount process exited during the benchmark ({status}); its log ({}):\n{}",
                    self.log.display(),
                    log_tail(&self.log, 20)
                );
            }
        }
        Ok(())
    }

    /// The mount's status (`granule fs status DIR --json`), or why there is none.
    fn status(&self) -> Result<serde_json::Value, String> {
        let exe = crate::granule_exe().map_err(|e| e.to_string())?;
        let out = Command::new(exe)
            .args(["fs", "status"])
            .arg(&self.dir)
            .arg("--json")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "granule fs status failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("granule fs status --json: {e}"))
    }

    /// Stop the mount process (SIGTERM; SIGKILL after [`STOP_TIMEOUT`]) and make sure the
    /// directory is unmounted. Says how the process ended.
    fn stop(&mut self) -> String {
        let Some(mut child) = self.child.take() else {
            return "already stopped".into();
        };
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let mut how = match child.try_wait() {
            Ok(Some(status)) => format!("had exited by itself ({status})"),
            _ => {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                let deadline = Instant::now() + STOP_TIMEOUT;
                loop {
                    match child.try_wait() {
                        Ok(Some(status)) => break format!("exited after SIGTERM ({status})"),
                        Ok(None) if Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(20))
                        }
                        _ => {
                            let _ = child.kill();
                            let _ = child.wait();
                            break format!(
                                "did not exit within {} s of SIGTERM: killed",
                                STOP_TIMEOUT.as_secs()
                            );
                        }
                    }
                }
            }
        };
        if is_mount_point(&self.dir) {
            how.push_str("; the directory was still mounted: fusermount3 -uz");
        }
        fuse_unmount(&self.dir);
        how
    }
}

impl Drop for GranuleMount {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Everything mounted for the run, torn down in field order on drop.
struct Mounts {
    granule: GranuleMount,
    _bindfs: BindfsMount,
    _tmpfs: TmpfsMount,
}

/// The work directory's layout. Dropped after the mounts (it is made first), it removes
/// the directory, so that a run leaves nothing behind in the temporary directory.
struct Dirs {
    root: PathBuf,
}

impl Drop for Dirs {
    fn drop(&mut self) {
        self.clean_stale();
        // Never recurse into a file system still mounted below (its unmount failed).
        let mounted = [self.granule(), self.bindfs(), self.tmpfs_root()]
            .iter()
            .any(|d| is_mount_point(d));
        if !mounted {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

impl Dirs {
    fn tmpfs_root(&self) -> PathBuf {
        self.root.join("tmpfs")
    }
    fn bindfs_source(&self) -> PathBuf {
        self.tmpfs_root().join("under-bindfs")
    }
    fn bindfs(&self) -> PathBuf {
        self.root.join("bindfs")
    }
    fn granule(&self) -> PathBuf {
        self.root.join("granule")
    }
    fn target(&self, fs: Fs) -> PathBuf {
        match fs {
            Fs::Tmpfs => self.tmpfs_root().join("direct"),
            Fs::Bindfs => self.bindfs(),
            Fs::Granule => self.granule(),
        }
    }

    /// Undo what a killed earlier run left: its mounts (inner ones first).
    fn clean_stale(&self) {
        for dir in [self.granule(), self.bindfs()] {
            if is_mount_point(&dir) {
                fuse_unmount(&dir);
            }
        }
        if is_mount_point(&self.tmpfs_root()) {
            unmount(&self.tmpfs_root());
        }
    }
}

// ---------------------------------------------------------------------------------------
// The tests.

/// dd's summary line: `67108864 bytes (67 MB, 64 MiB) copied, 0.0251 s, 2.7 GB/s` →
/// (bytes, seconds). With `LC_ALL=C`.
fn parse_dd(stderr: &str) -> anyhow::Result<(u64, f64)> {
    let line = stderr
        .lines()
        .rev()
        .find(|l| l.contains(" copied, "))
        .context("no `copied` line")?;
    let bytes = line
        .split_whitespace()
        .next()
        .and_then(|b| b.parse::<u64>().ok())
        .context("no byte count")?;
    let after = line
        .split(" copied, ")
        .nth(1)
        .context("nothing after `copied,`")?;
    let secs = after
        .split(" s")
        .next()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .context("no seconds")?;
    Ok((bytes, secs))
}

/// Run dd with `args`; (bytes, seconds) from its own report.
fn dd(args: &[String]) -> anyhow::Result<(u64, f64)> {
    let out = run_cmd(
        Command::new("dd").args(args).env("LC_ALL", "C"),
        &format!("dd {}", args.join(" ")),
    )?;
    let text = String::from_utf8_lossy(&out.stderr);
    parse_dd(&text).with_context(|| format!("dd's output: {text}"))
}

/// Sequential write of `bytes` to `file`, timed to the end of dd's fsync: GB/s.
fn seq_write(file: &Path, bytes: u64) -> anyhow::Result<f64> {
    let (n, secs) = dd(&[
        "if=/dev/zero".into(),
        format!("of={}", file.display()),
        "bs=1M".into(),
        format!("count={}", bytes / MIB),
        "conv=fsync".into(),
    ])?;
    if n != bytes {
        bail!("dd wrote {n} bytes to {}, not {bytes}", file.display());
    }
    Ok(n as f64 / secs / 1e9)
}

/// Cold sequential read of `file` (`bytes` long) after dropping caches: GB/s.
fn seq_read_cold(file: &Path, bytes: u64) -> anyhow::Result<f64> {
    drop_caches()?;
    let (n, secs) = dd(&[
        format!("if={}", file.display()),
        "of=/dev/null".into(),
        "bs=1M".into(),
    ])?;
    if n != bytes {
        bail!(
            "dd read {n} bytes of {}, which holds {bytes}",
            file.display()
        );
    }
    Ok(n as f64 / secs / 1e9)
}

/// One `fio` job's IOPS in direction `dir` (`read` or `write`) from its JSON output.
fn parse_fio(text: &str, dir: &str) -> anyhow::Result<f64> {
    // fio may print notes before the JSON object.
    let start = text.find('{').context("no JSON object")?;
    let v: serde_json::Value = serde_json::from_str(&text[start..]).context("fio's JSON")?;
    let job = v.get("jobs").and_then(|j| j.get(0)).context("no jobs[0]")?;
    if let Some(err) = job.get("error").and_then(|e| e.as_i64()) {
        if err != 0 {
            bail!("fio job error {err}");
        }
    }
    job.get(dir)
        .and_then(|d| d.get("iops"))
        .and_then(|i| i.as_f64())
        .with_context(|| format!("no jobs[0].{dir}.iops"))
}

/// Run fio's `rw` (randwrite or randread) job on the existing `file`: IOPS.
fn fio(file: &Path, rw: &str, p: &Params) -> anyhow::Result<f64> {
    let mut cmd = Command::new("fio");
    cmd.arg(format!("--name={rw}"))
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--rw={rw}"))
        .args(["--bs=4k", "--ioengine=psync", "--iodepth=1", "--numjobs=1"])
        .arg(format!("--size={}", p.fio_bytes))
        .arg(format!("--runtime={}", p.fio_runtime_s))
        .args(["--fallocate=none", "--randrepeat=1", "--invalidate=1"])
        .args(["--output-format=json"]);
    if rw == "randwrite" {
        cmd.args(["--overwrite=1", "--end_fsync=1"]);
    }
    let out = run_cmd(&mut cmd, &format!("fio --rw={rw} (Debian package fio)"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let dir = if rw == "randwrite" { "write" } else { "read" };
    parse_fio(&text, dir).with_context(|| format!("fio's output: {text}"))
}

/// Random 4 KiB overwrites, then cold random reads, on a file written with dd first:
/// (write IOPS, read IOPS).
fn random_io(dir: &Path, p: &Params) -> anyhow::Result<(f64, f64)> {
    let file = dir.join("fio.dat");
    dd(&[
        "if=/dev/zero".into(),
        format!("of={}", file.display()),
        "bs=1M".into(),
        format!("count={}", p.fio_bytes / MIB),
        "conv=fsync".into(),
    ])?;
    let w = fio(&file, "randwrite", p)?;
    check_interrupted()?;
    drop_caches()?;
    let r = fio(&file, "randread", p)?;
    std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
    Ok((w, r))
}

/// Create, stat and unlink `n` empty files in a fresh directory under `dir`, each phase
/// timed: (create, stat, unlink, all three together) in ops/s.
fn small_files(dir: &Path, n: usize) -> anyhow::Result<(f64, f64, f64, f64)> {
    let sub = dir.join("small-files");
    std::fs::create_dir(&sub).with_context(|| format!("creating {}", sub.display()))?;
    let names: Vec<PathBuf> = (0..n).map(|i| sub.join(format!("f{i:06}"))).collect();
    let t0 = Instant::now();
    for (i, name) in names.iter().enumerate() {
        std::fs::File::create(name).with_context(|| format!("creating {}", name.display()))?;
        if i % 1000 == 999 {
            check_interrupted()?;
        }
    }
    let t1 = Instant::now();
    for name in &names {
        let m = std::fs::metadata(name).with_context(|| format!("stat {}", name.display()))?;
        if !m.is_file() || m.len() != 0 {
            bail!(
                "{}: not an empty regular file after creating it",
                name.display()
            );
        }
    }
    let t2 = Instant::now();
    for name in &names {
        std::fs::remove_file(name).with_context(|| format!("unlinking {}", name.display()))?;
    }
    let t3 = Instant::now();
    std::fs::remove_dir(&sub).with_context(|| format!("removing {}", sub.display()))?;
    let rate = |a: Instant, b: Instant, ops: usize| ops as f64 / (b - a).as_secs_f64();
    Ok((
        rate(t0, t1, n),
        rate(t1, t2, n),
        rate(t2, t3, n),
        rate(t0, t3, 3 * n),
    ))
}

/// One loopback TCP stream carrying `bytes` (writer and reader threads, 1 MiB buffers),
/// timed on the reader from the writer's start to the last byte: GB/s.
pub(crate) fn raw_tcp(bytes: u64) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    let addr = listener.local_addr()?;
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let writer = std::thread::Builder::new()
        .name("fs-raw-tcp-writer".into())
        .spawn(move || -> std::io::Result<()> {
            let mut s = TcpStream::connect(addr)?;
            let buf = vec![0x5au8; MIB as usize];
            if go_rx.recv().is_err() {
                return Ok(());
            }
            let mut left = bytes;
            while left > 0 {
                let n = left.min(buf.len() as u64) as usize;
                s.write_all(&buf[..n])?;
                left -= n as u64;
            }
            s.shutdown(std::net::Shutdown::Write)
        })
        .context("starting the writer thread")?;
    let (mut conn, _) = listener.accept().context("accepting the writer")?;
    let mut buf = vec![0u8; MIB as usize];
    let start = Instant::now();
    go_tx.send(()).context("the writer thread is gone")?;
    let mut got = 0u64;
    while got < bytes {
        let n = conn.read(&mut buf).context("reading the stream")?;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    match writer.join() {
        Ok(r) => r.context("the writer")?,
        Err(_) => bail!("the writer thread panicked"),
    }
    if got != bytes {
        bail!("raw TCP: received {got} of {bytes} bytes");
    }
    Ok(bytes as f64 / secs / 1e9)
}

/// Write a pseudo-random file that crosses stripe boundaries, read it back cold and
/// compare (not timed).
fn check_read_back(dir: &Path) -> anyhow::Result<()> {
    let file = dir.join("read-back.dat");
    let len = 3 * MIB as usize + 4099;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    {
        let mut f =
            std::fs::File::create(&file).with_context(|| format!("creating {}", file.display()))?;
        f.write_all(&data)
            .with_context(|| format!("writing {}", file.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync {}", file.display()))?;
    }
    drop_caches()?;
    let back = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
    if back.len() != data.len() {
        bail!(
            "{}: wrote {} bytes, read back {}",
            file.display(),
            data.len(),
            back.len()
        );
    }
    if let Some(i) = back.iter().zip(&data).position(|(a, b)| a != b) {
        bail!(
            "{}: read back a different byte at offset {i} (of {})",
            file.display(),
            data.len()
        );
    }
    Ok(())
}

/// All tests of one repetition on one file system; `after_write` runs while the
/// sequential file is in place (between its write and its read, not timed).
fn measure(
    dir: &Path,
    p: &Params,
    progress: &granule_report::Progress,
    fs: Fs,
    after_write: &mut dyn FnMut(),
) -> anyhow::Result<Sample> {
    let file = dir.join("seq.dat");
    let write_gbps = seq_write(&file, p.seq_bytes)?;
    progress.step(format!(
        "{}: sequential write {write_gbps:.3} GB/s",
        fs.name()
    ));
    after_write();
    check_interrupted()?;
    let read_gbps = seq_read_cold(&file, p.seq_bytes)?;
    std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
    progress.step(format!(
        "{}: cold sequential read {read_gbps:.3} GB/s",
        fs.name()
    ));
    check_interrupted()?;
    let (randwrite_iops, randread_iops) = random_io(dir, p)?;
    progress.step(format!(
        "{}: fio 4 KiB random writes {randwrite_iops:.0} IOPS, reads {randread_iops:.0} IOPS",
        fs.name()
    ));
    check_interrupted()?;
    let (create_ops, stat_ops, unlink_ops, small_ops) = small_files(dir, p.files)?;
    progress.step(format!(
        "{}: small files create {create_ops:.0}/s, stat {stat_ops:.0}/s, unlink {unlink_ops:.0}/s",
        fs.name()
    ));
    Ok(Sample {
        write_gbps,
        read_gbps,
        randwrite_iops,
        randread_iops,
        create_ops,
        stat_ops,
        unlink_ops,
        small_ops,
    })
}

fn median(v: &[f64]) -> f64 {
    granule_report::stats::Summary::of(v).map_or(f64::NAN, |s| s.median)
}

fn runs_text(v: &[f64], digits: usize) -> String {
    v.iter()
        .map(|x| format!("{x:.digits$}"))
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------------------

/// Run the benchmark and write its report.
pub fn run(opts: &BenchOpts) -> anyhow::Result<PathBuf> {
    check_machine()?;
    let handler = catch_signals().is_ok();
    let _active = Active::begin("fs: interrupted; unmounting (again to quit at once)");
    let p = Params::new(opts.quick, opts.reps);
    if p.reps == 0 {
        bail!("--reps must be at least 1");
    }
    // Nothing pinned: every thread of this process, and the processes it starts, may run
    // on every vCPU (an earlier benchmark of this process may have pinned the driver).
    let _saved = crate::affinity::SavedAffinity::unpin();

    let dirs = Dirs {
        root: std::env::temp_dir().join("granule-bench-fs"),
    };
    dirs.clean_stale();
    std::fs::create_dir_all(&dirs.root)
        .with_context(|| format!("creating {}", dirs.root.display()))?;
    let tmpfs_size = p.seq_bytes + p.fio_bytes + 1024 * MIB;
    let tmpfs = TmpfsMount::mount(&dirs.tmpfs_root(), tmpfs_size)?;
    std::fs::create_dir_all(dirs.target(Fs::Tmpfs))?;
    let bindfs = BindfsMount::mount(&dirs.bindfs_source(), &dirs.bindfs())?;
    let granule = GranuleMount::start(&dirs.granule(), &dirs.root.join("granule-mount.log"))?;
    let mut mounts = Mounts {
        granule,
        _bindfs: bindfs,
        _tmpfs: tmpfs,
    };
    let mounted_line = mounts.granule.mounted_line.clone();

    for fs in Fs::ALL {
        check_read_back(&dirs.target(fs))
            .with_context(|| format!("{}: reading back what was written", fs.name()))?;
    }

    let progress = granule_report::Progress::new((p.reps * (1 + 4 * Fs::ALL.len())) as u64, "fs");
    let mut samples: [Vec<Sample>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let mut tcp = Vec::new();
    // The mount's status with the first sequential file in place, and at the end.
    let mut status_full: Option<Result<serde_json::Value, String>> = None;
    for rep in 0..p.reps {
        check_interrupted()?;
        let t = raw_tcp(p.seq_bytes)?;
        progress.step(format!("raw TCP: {t:.3} GB/s"));
        tcp.push(t);
        // Rotate the order, so no file system always meets a warmer machine.
        for k in 0..Fs::ALL.len() {
            let fs = Fs::ALL[(rep + k) % Fs::ALL.len()];
            check_interrupted()?;
            mounts.granule.check_alive()?;
            let mut after_write = || {
                if fs == Fs::Granule && status_full.is_none() {
                    status_full = Some(mounts.granule.status());
                }
            };
            let s = measure(&dirs.target(fs), &p, &progress, fs, &mut after_write)
                .with_context(|| format!("{} (repetition {})", fs.name(), rep + 1))?;
            samples[fs.index()].push(s);
        }
    }
    progress.finish();
    mounts.granule.check_alive()?;
    let status_end = Some(mounts.granule.status());
    let stopped = mounts.granule.stop();
    drop(mounts);

    let collected = Collected {
        samples,
        tcp,
        mounted_line,
        stopped,
        status_full,
        status_end,
        handler,
    };
    report(opts, &p, &collected)
}

/// What a run collected, for the report.
struct Collected {
    /// Per file system (by [`Fs::index`]), one sample per repetition.
    samples: [Vec<Sample>; 3],
    /// Raw TCP GB/s, one per repetition.
    tcp: Vec<f64>,
    mounted_line: String,
    /// How the mount process ended.
    stopped: String,
    /// `granule fs status --json` with the first sequential file in place.
    status_full: Option<Result<serde_json::Value, String>>,
    /// The same at the end of the run.
    status_end: Option<Result<serde_json::Value, String>>,
    /// Whether Ctrl-C was caught.
    handler: bool,
}

/// A one-line digest of the mount's status: its stores (class, stripes, bytes used) and
/// its counters.
fn status_digest(v: &serde_json::Value) -> String {
    let num =
        |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_f64()).unwrap_or(f64::NAN);
    let text = |v: &serde_json::Value, k: &str| {
        v.get(k).and_then(|x| x.as_str()).unwrap_or("?").to_string()
    };
    let stores: Vec<String> = v
        .get("stores")
        .and_then(|s| s.as_array())
        .map(|a| {
            a.iter()
                .map(|st| {
                    format!(
                        "{} ({}, {}): {} stripes, {:.1} MiB",
                        text(st, "name"),
                        text(st, "class"),
                        st.get("state")
                            .map_or("?".into(), |x| x.to_string().replace('"', "")),
                        num(st, "stripes"),
                        num(st, "used") / MIB as f64
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let counters: Vec<String> = [
        "inodes",
        "reads",
        "writes",
        "bytes_read",
        "bytes_written",
        "cache_hits",
        "verification_failures",
        "replicas_missing",
        "stripes_lost",
    ]
    .iter()
    .filter(|k| v.get(**k).is_some())
    .map(|k| format!("{k} {}", num(v, k)))
    .collect();
    format!(
        "stores: {}; counters: {}",
        stores.join("; "),
        counters.join(", ")
    )
}

/// Tables, plot, summary.
fn report(opts: &BenchOpts, p: &Params, c: &Collected) -> anyhow::Result<PathBuf> {
    let Collected {
        samples,
        tcp,
        mounted_line,
        stopped,
        handler,
        ..
    } = c;
    type Get = fn(&Sample) -> f64;
    let tests: [(&str, &str, &str, Get, usize); 8] = [
        (
            "seq write",
            "sequential write (dd bs=1M conv=fsync)",
            "GB/s",
            |s| s.write_gbps,
            3,
        ),
        (
            "cold seq read",
            "cold sequential read (dd bs=1M after drop_caches)",
            "GB/s",
            |s| s.read_gbps,
            3,
        ),
        (
            "rand write",
            "random 4 KiB writes (fio psync, end_fsync)",
            "IOPS",
            |s| s.randwrite_iops,
            0,
        ),
        (
            "rand read",
            "random 4 KiB reads, cold (fio psync)",
            "IOPS",
            |s| s.randread_iops,
            0,
        ),
        (
            "create",
            "small files: create",
            "ops/s",
            |s| s.create_ops,
            0,
        ),
        ("stat", "small files: stat", "ops/s", |s| s.stat_ops, 0),
        (
            "unlink",
            "small files: unlink",
            "ops/s",
            |s| s.unlink_ops,
            0,
        ),
        (
            "small files",
            "small files: create+stat+unlink",
            "ops/s",
            |s| s.small_ops,
            0,
        ),
    ];
    let med = |fs: Fs, get: Get| median(&samples[fs.index()].iter().map(get).collect::<Vec<f64>>());
    let tcp_med = median(tcp);

    let mut table = Table::new(&["test", "file system", "median", "unit", "vs tmpfs", "runs"]);
    let mut plot_vals: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for (i, (_, long, unit, get, digits)) in tests.iter().enumerate() {
        let base = med(Fs::Tmpfs, *get);
        for fs in Fs::ALL {
            let m = med(fs, *get);
            let runs: Vec<f64> = samples[fs.index()].iter().map(*get).collect();
            table.row(vec![
                Cell::from(*long),
                Cell::from(fs.name()),
                Cell::from(m),
                Cell::from(*unit),
                Cell::from(m / base),
                Cell::from(runs_text(&runs, *digits)),
            ]);
            if fs != Fs::Tmpfs {
                plot_vals[fs.index()].push(m / base);
            }
        }
        if i == 1 {
            table.row(vec![
                Cell::from(*long),
                Cell::from("raw TCP, one loopback stream"),
                Cell::from(tcp_med),
                Cell::from(*unit),
                Cell::from(tcp_med / base),
                Cell::from(runs_text(tcp, 3)),
            ]);
        }
    }
    let read_base = med(Fs::Tmpfs, |s| s.read_gbps);
    let plot = Plot::bars("file systems relative to tmpfs (median; log scale)")
        .y_label("throughput ÷ tmpfs's")
        .log_y(true)
        .categories(tests.iter().map(|t| t.0))
        .bar_series("bindfs over tmpfs", plot_vals[Fs::Bindfs.index()].clone())
        .bar_series("granule mount", plot_vals[Fs::Granule.index()].clone())
        .bar_series(
            "raw TCP stream",
            (0..tests.len()).map(|i| {
                if i == 1 {
                    tcp_med / read_base
                } else {
                    f64::NAN
                }
            }),
        )
        .hline(1.0, "tmpfs");

    let g = |get: Get| med(Fs::Granule, get);
    let t = |get: Get| med(Fs::Tmpfs, get);
    let b = |get: Get| med(Fs::Bindfs, get);
    let seq_write_vs_tmpfs = g(|s| s.write_gbps) / t(|s| s.write_gbps);
    let seq_read_cold_vs_passthrough = g(|s| s.read_gbps) / b(|s| s.read_gbps);
    let seq_read_cold_vs_raw_tcp = g(|s| s.read_gbps) / tcp_med;
    let seq_read_vs_tmpfs = g(|s| s.read_gbps) / t(|s| s.read_gbps);
    let randread_iops_vs_tmpfs = g(|s| s.randread_iops) / t(|s| s.randread_iops);
    let randwrite_iops_vs_tmpfs = g(|s| s.randwrite_iops) / t(|s| s.randwrite_iops);
    let small_files_vs_tmpfs = g(|s| s.small_ops) / t(|s| s.small_ops);
    // (NaN figures miss.)
    let targets = [
        (
            "seq_write_vs_tmpfs",
            seq_write_vs_tmpfs,
            TARGET_SEQ_WRITE_VS_TMPFS,
        ),
        (
            "seq_read_cold_vs_passthrough",
            seq_read_cold_vs_passthrough,
            TARGET_SEQ_READ_COLD_VS_PASSTHROUGH,
        ),
        (
            "seq_read_cold_vs_raw_tcp",
            seq_read_cold_vs_raw_tcp,
            TARGET_SEQ_READ_COLD_VS_RAW_TCP,
        ),
    ];
    let met: Vec<bool> = targets.iter().map(|(_, v, min)| *v >= *min).collect();

    let placement = "nothing pinned: dd, fio, the bindfs daemon, the granule mount process and its embedded \
                     node processes, and this process's threads (the small-file loop, the raw-TCP writer and \
                     reader) all float over every vCPU"
        .to_string();
    let mut meta = Meta::collect(placement, opts.quick);
    meta.note(format!(
        "sizes: sequential file {} MiB (dd bs=1M); fio file {} MiB, 4 KiB blocks, ioengine=psync, iodepth 1, \
         one job, each fio run bounded by --runtime={} s; {} small files; {} repetition(s), the order of the \
         file systems rotating each one; figures are medians, ratios are ratios of medians",
        p.seq_bytes / MIB,
        p.fio_bytes / MIB,
        p.fio_runtime_s,
        p.files,
        p.reps
    ));
    meta.note(format!(
        "tmpfs: a tmpfs mounted for the run. bindfs {} (Debian; it links libfuse 2, so the kernel sends it \
         writes of at most 128 KiB) with -o {BINDFS_OPTS}, single-threaded, over a directory of the same \
         tmpfs. granule: `granule fs mount DIR --nodes \"{NODES}\"` (own embedded nodes, default stripe and \
         replicas), which printed `{mounted_line}`; at the end the mount process {stopped}",
        bindfs_version(),
    ));
    meta.note(
        "cold reads: `sync` and `sysctl vm.drop_caches=3` before each read; that empties the page cache in front \
         of both FUSE daemons, while tmpfs's pages are the file itself (its read is a memory read). Random \
         reads read the file fio overwrote, after dropping caches, in one pass (every 4 KiB block once). \
         Small files are empty, created, stat-ed and unlinked back to back (each file system's own \
         attribute and dentry caching applies)",
    );
    meta.note(
        "granule reads its own stores' stripes in place: the stores (the two node processes and the \
         mount process) keep them in shared memory files the mount maps. The first repetition's cold \
         read also maps the freshly written pages into the mount (page-table set-up), which later \
         repetitions skip: the file is rewritten into slots that kept their pages when the previous \
         file was removed. The runs column shows both",
    );
    meta.note(format!(
        "raw TCP: one loopback stream of {} MiB from a writer thread to a reader thread of this process, \
         1 MiB buffers, default socket buffers",
        p.seq_bytes / MIB
    ));
    for (when, st) in [
        ("with the first sequential file in place", &c.status_full),
        ("at the end of the run", &c.status_end),
    ] {
        match st {
            Some(Ok(v)) => meta.note(format!("granule fs status {when}: {}", status_digest(v))),
            Some(Err(e)) => meta.note(format!("granule fs status {when}: unavailable ({e})")),
            None => meta.note(format!("granule fs status {when}: not taken")),
        };
    }
    if !handler {
        meta.note(
            "Ctrl-C was not caught in this run (the handler could not be installed): an \
             interrupted run leaves its mounts to the next run, which removes them first",
        );
    }
    let verdicts: Vec<String> = targets
        .iter()
        .zip(&met)
        .map(|((k, v, min), ok)| {
            format!(
                "{k} = {v:.3} (target ≥ {min}): {}",
                if *ok { "met" } else { "MISSED" }
            )
        })
        .collect();
    meta.note(format!("judged targets: {}", verdicts.join("; ")));
    if met.iter().any(|ok| !ok) {
        let missed: Vec<&str> = targets
            .iter()
            .zip(&met)
            .filter(|(_, ok)| !**ok)
            .map(|((k, _, _), _)| *k)
            .collect();
        meta.note(format!("TARGET MISSED: {}", missed.join(", ")));
    }

    let mut rep = Report::new("fs", meta);
    rep.title("Benchmark: fs — the Granule mount vs tmpfs, bindfs over tmpfs and raw TCP");
    rep.table(table);
    rep.plot(plot);
    rep.summary("seq_write_vs_tmpfs", seq_write_vs_tmpfs);
    rep.summary("seq_read_cold_vs_passthrough", seq_read_cold_vs_passthrough);
    rep.summary("seq_read_cold_vs_raw_tcp", seq_read_cold_vs_raw_tcp);
    rep.summary("seq_read_vs_tmpfs", seq_read_vs_tmpfs);
    rep.summary("randread_iops_vs_tmpfs", randread_iops_vs_tmpfs);
    rep.summary("small_files_vs_tmpfs", small_files_vs_tmpfs);
    rep.summary("randwrite_iops_vs_tmpfs", randwrite_iops_vs_tmpfs);
    for fs in Fs::ALL {
        let n = fs.name();
        rep.summary(format!("seq_write_gbps_{n}"), med(fs, |s| s.write_gbps));
        rep.summary(format!("seq_read_cold_gbps_{n}"), med(fs, |s| s.read_gbps));
        rep.summary(format!("randwrite_iops_{n}"), med(fs, |s| s.randwrite_iops));
        rep.summary(format!("randread_iops_{n}"), med(fs, |s| s.randread_iops));
        rep.summary(format!("small_files_ops_{n}"), med(fs, |s| s.small_ops));
    }
    rep.summary("raw_tcp_gbps", tcp_med);
    rep.summary(
        "bindfs_seq_write_vs_tmpfs",
        b(|s| s.write_gbps) / t(|s| s.write_gbps),
    );
    rep.summary(
        "bindfs_seq_read_cold_vs_raw_tcp",
        b(|s| s.read_gbps) / tcp_med,
    );
    for ((k, _, _), ok) in targets.iter().zip(&met) {
        rep.summary(format!("target_{k}_met"), if *ok { 1.0 } else { 0.0 });
    }
    rep.summary(
        "targets_met",
        if met.iter().all(|ok| *ok) { 1.0 } else { 0.0 },
    );
    rep.summary("repetitions", p.reps as f64);
    let dir = rep.write(&opts.out)?;
    let statuses = serde_json::json!({
        "with_sequential_file": c.status_full.as_ref().and_then(|s| s.as_ref().ok()),
        "end": c.status_end.as_ref().and_then(|s| s.as_ref().ok()),
    });
    let path = dir.join("granule_status.json");
    std::fs::write(&path, serde_json::to_string_pretty(&statuses)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(dir)
}

/// `bindfs --version`'s version, e.g. `1.14.7`.
fn bindfs_version() -> String {
    Command::new("bindfs")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .nth(1)
                .map(str::to_string)
        })
        .unwrap_or_else(|| "(version unknown)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_dd() {
        let text = "64+0 records in\n64+0 records out\n\
                    67108864 bytes (67 MB, 64 MiB) copied, 0.0251 s, 2.7 GB/s\n";
        assert_eq!(parse_dd(text).unwrap(), (67108864, 0.0251));
        let big = "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 2.02736 s, 530 MB/s\n";
        assert_eq!(parse_dd(big).unwrap(), (1073741824, 2.02736));
        assert!(parse_dd("dd: error writing 'x': No space left on device\n").is_err());
    }

    #[test]
    fn parses_fio() {
        let text = "note: both iodepth >= 1 and synchronous I/O engine are selected\n\
                    {\"fio version\": \"fio-3.33\", \"jobs\": [{\"jobname\": \"randread\", \"error\": 0, \
                    \"read\": {\"iops\": 12345.5}, \"write\": {\"iops\": 0.0}}]}";
        assert_eq!(parse_fio(text, "read").unwrap(), 12345.5);
        assert_eq!(parse_fio(text, "write").unwrap(), 0.0);
        let failed = "{\"jobs\": [{\"error\": 5, \"read\": {\"iops\": 1.0}}]}";
        assert!(parse_fio(failed, "read").is_err());
        assert!(parse_fio("no json", "read").is_err());
    }

    #[test]
    fn raw_tcp_moves_the_bytes() {
        let gbps = raw_tcp(8 * MIB).unwrap();
        assert!(gbps > 0.0 && gbps.is_finite());
    }
}
