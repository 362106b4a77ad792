//! Helpers for the file system's integration tests (`fs_posix.rs`, `fs_victims.rs`),
//! included by them with `#[path]`: whether FUSE can be used here, a `granule fs mount`
//! process that is always unmounted and ended (with a time bound that kills it, so calls
//! blocked in the mount return), hand-started victim stores, a tmpfs reference directory,
//! commands and calls with a time bound, and moving the page cache out of the way so reads
//! reach the file system.
#![allow(dead_code)]

use std::ffi::CString;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The `granule` binary under test.
pub const GRANULE: &str = env!("CARGO_BIN_EXE_granule");

/// Set (non-empty) to skip the tests that mount when this machine cannot; unset, they fail.
pub const SKIP_VAR: &str = "GRANULE_SKIP_FUSE_TESTS";

pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;

/// Why this process cannot mount a FUSE file system, if it cannot.
fn fuse_missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the test is not running as root".into());
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
    {
        return Some(format!(
            "/dev/fuse cannot be opened ({e}); load the module (modprobe fuse) or give the \
             container the device (--device /dev/fuse --cap-add SYS_ADMIN)"
        ));
    }
    match Command::new("fusermount3").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("fusermount3 is not installed (Debian: apt-get install fuse3)".into()),
    }
}

/// True when `test` can mount. Otherwise: with GRANULE_SKIP_FUSE_TESTS set, prints why and
/// returns false (the test skips); without it, fails with the reason.
#[must_use]
pub fn fuse_usable(test: &str) -> bool {
    let Some(why) = fuse_missing() else {
        return true;
    };
    if std::env::var_os(SKIP_VAR).is_some_and(|v| !v.is_empty()) {
        eprintln!("skipping {test}: {why} ({SKIP_VAR} is set)");
        return false;
    }
    panic!(
        "{test} needs FUSE: {why}. Run it as root on a machine with /dev/fuse and \
         fusermount3, or set {SKIP_VAR}=1 to skip the tests that mount."
    );
}

static SERIAL: Mutex<()> = Mutex::new(());

/// One mounting test at a time in a test binary: the machine has few CPUs, and the time
/// bounds should measure the file system, not the other tests.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fs type of the mount at `dir` in /proc/self/mountinfo, if `dir` is a mount point.
pub fn mount_type(dir: &Path) -> Option<String> {
    granule_host::mounts::mount_type(dir)
}

/// Lazily unmount what is mounted at `dir` (nothing there is fine).
pub fn fusermount_lazy(dir: &Path) {
    let _ = Command::new("fusermount3")
        .arg("-uz")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Send `sig` to the process group `pgid` (a group this test created for a child).
fn kill_group(pgid: u32, sig: libc::c_int) {
    // SAFETY: kill has no memory-safety preconditions; the group is one we created.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), sig);
    }
}

/// Whether `child` has exited, without reaping it (so its process group id stays ours).
fn exited(child: &Child) -> bool {
    // SAFETY: waitid writes only into `info`, which lives on this stack frame.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let r = libc::waitid(
            libc::P_PID,
            child.id(),
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        );
        r != 0 || info.si_pid() != 0
    }
}

fn wait_exited(child: &Child, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if exited(child) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    exited(child)
}

/// End `child` (the leader of its own process group): SIGTERM, then SIGKILL after `grace`;
/// then SIGKILL to whatever is left of its group (processes it started), then reap it.
fn end_group(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    let pgid = child.id();
    if !exited(child) {
        kill_group(pgid, libc::SIGTERM);
        if !wait_exited(child, grace) {
            kill_group(pgid, libc::SIGKILL);
        }
    }
    kill_group(pgid, libc::SIGKILL);
    child.wait().ok()
}

/// End `child`, started as the leader of a process group of its own
/// (`process_group(0)`): SIGTERM to the group, SIGKILL after `grace`, then reap it.
pub fn end_process_group(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    end_group(child, grace)
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A running `granule fs mount`: unmounted (`fusermount3 -uz`) and ended on every exit
/// path; its stderr is kept in a file and shown when the test fails. A watchdog kills it
/// when the test runs past its time bound, so calls blocked in the mount return (with
/// ENOTCONN) and the test fails instead of hanging.
pub struct Mount {
    pub dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
    tmp: Option<tempfile::TempDir>,
    timed_out: Arc<AtomicBool>,
    limit: Duration,
    stop_watchdog: Option<mpsc::Sender<()>>,
    watchdog: Option<JoinHandle<()>>,
}

impl Mount {
    /// `granule fs mount DIR ARGS` on a fresh directory; returns once it printed that it
    /// is mounted and /proc/self/mountinfo shows it as `fuse.granule`. The whole test
    /// (from now) must end within `limit`.
    pub fn start(args: &[&str], limit: Duration) -> Mount {
        Mount::start_env(args, &[], limit)
    }

    /// [`Mount::start`] with these environment variables set for the mount (settings).
    pub fn start_env(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Mount {
        let tmp = tempfile::Builder::new()
            .prefix("granule-fs-test")
            .tempdir()
            .expect("temp dir");
        let dir = tmp.path().join("mnt");
        std::fs::create_dir(&dir).expect("mount point");
        let log = tmp.path().join("mount.log");
        let err = std::fs::File::create(&log).expect("mount log");
        let mut child = Command::new(GRANULE)
            .args(["fs", "mount"])
            .arg(&dir)
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("start granule fs mount");
        let (tx, rx) = mpsc::channel::<Result<String, String>>();
        let out = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                match l {
                    Ok(l) => {
                        let _ = tx.send(Ok(l));
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                }
            }
            let _ = tx.send(Err("stdout closed".into()));
        });
        let timed_out = Arc::new(AtomicBool::new(false));
        let mut m = Mount {
            dir: dir.clone(),
            child: Some(child),
            log,
            tmp: Some(tmp),
            timed_out: timed_out.clone(),
            limit,
            stop_watchdog: None,
            watchdog: None,
        };
        let started = Instant::now();
        let start_limit = Duration::from_secs(120);
        let mut seen = Vec::new();
        loop {
            let left = start_limit.saturating_sub(started.elapsed());
            match rx.recv_timeout(left) {
                Ok(Ok(l)) if l.starts_with("granule fs: mounted") => break,
                Ok(Ok(l)) => seen.push(l),
                Ok(Err(e)) => panic!(
                    "granule fs mount {args:?} ended before saying it was mounted ({e}); \
                     stdout: {seen:?}\nstderr:\n{}",
                    tail(&m.log_text(), 60)
                ),
                Err(_) => panic!(
                    "granule fs mount {args:?} did not say it was mounted within \
                     {start_limit:?}; stdout: {seen:?}\nstderr:\n{}",
                    tail(&m.log_text(), 60)
                ),
            }
        }
        // Later output is drained by the reader thread (it sends into a closed channel).
        drop(rx);
        let ty = mount_type(&dir);
        assert_eq!(
            ty.as_deref(),
            Some("fuse.granule"),
            "{} is not in /proc/self/mountinfo as fuse.granule",
            dir.display()
        );
        let pgid = m.child.as_ref().map(|c| c.id()).unwrap_or(0);
        let (stop, stopped) = mpsc::channel::<()>();
        let wd_dir = dir.clone();
        m.stop_watchdog = Some(stop);
        m.watchdog = Some(std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(limit) {
                timed_out.store(true, Ordering::SeqCst);
                eprintln!(
                    "the test ran past its time bound of {limit:?}: killing the mount at {} \
                     so blocked calls return",
                    wd_dir.display()
                );
                kill_group(pgid, libc::SIGKILL);
                fusermount_lazy(&wd_dir);
            }
        }));
        m
    }

    /// What the mount wrote on stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A path inside the mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// Unmount with `granule fs umount DIR` and check that the mount process then exits
    /// with status 0 and the mount point is gone from /proc/self/mountinfo.
    pub fn unmount_cleanly(mut self) {
        let out = run_bounded(
            Command::new(GRANULE).args(["fs", "umount"]).arg(&self.dir),
            Duration::from_secs(30),
        );
        assert!(
            out.status.success(),
            "granule fs umount failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let child = self.child.as_mut().expect("mount process");
        assert!(
            wait_exited(child, Duration::from_secs(30)),
            "granule fs mount still runs 30 s after granule fs umount; stderr:\n{}",
            tail(&self.log_text(), 40)
        );
        let status = end_group(child, Duration::from_secs(1));
        self.child = None;
        assert!(
            status.is_some_and(|s| s.success()),
            "granule fs mount exited with {status:?} after granule fs umount; stderr:\n{}",
            tail(&self.log_text(), 40)
        );
        assert_eq!(mount_type(&self.dir), None, "still mounted after umount");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        drop(self.stop_watchdog.take());
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        if mount_type(&self.dir).is_some() {
            fusermount_lazy(&self.dir);
        }
        if let Some(mut child) = self.child.take() {
            // Unmounted from outside, the mount exits by itself; give it a moment.
            let _ = wait_exited(&child, Duration::from_secs(5));
            end_group(&mut child, Duration::from_secs(5));
        }
        if mount_type(&self.dir).is_some() {
            fusermount_lazy(&self.dir);
        }
        if mount_type(&self.dir).is_some() {
            // Never let the temp dir's removal walk into a mount that is still there.
            eprintln!("{} is still mounted; leaving it", self.dir.display());
            if let Some(t) = self.tmp.take() {
                let _ = t.keep();
            }
        }
        if std::thread::panicking() {
            eprintln!(
                "--- granule fs mount stderr (last 80 lines) ---\n{}\n---",
                tail(&self.log_text(), 80)
            );
        } else if self.timed_out.load(Ordering::SeqCst) {
            panic!("the test ran past its time bound of {:?}", self.limit);
        }
    }
}

/// A hand-started victim store: `granule store --listen 127.0.0.1:0 --bytes B --secret S`.
pub struct Store {
    pub addr: String,
    pub secret: String,
    child: Option<Child>,
    /// Its stderr, shown if it ends by itself.
    log: tempfile::NamedTempFile,
}

impl Store {
    pub fn start(bytes: &str, secret: &str) -> Store {
        let log = tempfile::NamedTempFile::new().expect("store log");
        let err = log.reopen().expect("store log");
        let mut child = Command::new(GRANULE)
            .args(["store", "--listen", "127.0.0.1:0", "--bytes", bytes])
            .args(["--secret", secret])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(0)
            .spawn()
            .expect("start granule store");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            for l in lines.by_ref() {
                let Ok(l) = l else { break };
                if let Some(a) = l.strip_prefix("granule store: listening ") {
                    let _ = tx.send(a.trim().to_string());
                    break;
                }
            }
            lines.for_each(drop);
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => Store {
                addr,
                secret: secret.into(),
                child: Some(child),
                log,
            },
            Err(_) => {
                end_group(&mut child, Duration::from_secs(1));
                panic!("granule store did not print `granule store: listening ADDR` in 30 s");
            }
        }
    }

    /// `ADDR=SECRET`, as `--victims` takes it.
    pub fn victim_arg(&self) -> String {
        format!("{}={}", self.addr, self.secret)
    }

    /// SIGKILL: the store vanishes without draining.
    pub fn kill(&mut self) {
        self.report_if_gone();
        if let Some(mut c) = self.child.take() {
            kill_group(c.id(), libc::SIGKILL);
            let _ = c.wait();
        }
    }

    /// A store that ended by itself (crashed, or was killed by someone else) says so on
    /// stderr, with its exit status and its log, since the mount then sees it lost.
    fn report_if_gone(&mut self) {
        let Some(c) = self.child.as_mut() else { return };
        if exited(c) {
            let status = c.wait().ok();
            self.child = None;
            let log = std::fs::read_to_string(self.log.path()).unwrap_or_default();
            eprintln!(
                "granule store {} ended by itself ({status:?}); its stderr:\n{}",
                self.addr,
                tail(&log, 30)
            );
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.report_if_gone();
        if let Some(mut c) = self.child.take() {
            end_group(&mut c, Duration::from_secs(2));
        }
    }
}

/// Run `cmd` in a process group of its own with its output captured; kill the group and
/// fail if it runs longer than `limit`.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e}"));
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let o = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let e = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let done = wait_exited(&child, limit);
    if !done {
        kill_group(child.id(), libc::SIGKILL);
    }
    let status = child.wait().expect("wait");
    let stdout = o.join().unwrap_or_default();
    let stderr = e.join().unwrap_or_default();
    assert!(
        done,
        "{what} did not finish within {limit:?}; stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Run `f` on a thread and fail if it does not return within `limit` (a call that hangs
/// in the mount; the mount's watchdog ends it later).
pub fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(RecvTimeoutError::Timeout) => panic!("{what} did not return within {limit:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}

const TMPFS_MAGIC: i64 = 0x0102_1994;

/// A reference directory on tmpfs: under /dev/shm when that is tmpfs, else on a tmpfs
/// this test mounts (and unmounts when dropped).
pub struct Tmpfs {
    dir: Option<tempfile::TempDir>,
    mounted: bool,
}

impl Tmpfs {
    pub fn new() -> Tmpfs {
        if statfs_type(Path::new("/dev/shm")) == Some(TMPFS_MAGIC) {
            let dir = tempfile::Builder::new()
                .prefix("granule-fs-ref")
                .tempdir_in("/dev/shm")
                .expect("temp dir in /dev/shm");
            return Tmpfs {
                dir: Some(dir),
                mounted: false,
            };
        }
        let dir = tempfile::Builder::new()
            .prefix("granule-fs-ref")
            .tempdir()
            .expect("temp dir");
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4g", "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount -t tmpfs");
        assert!(st.success(), "mount -t tmpfs failed");
        Tmpfs {
            dir: Some(dir),
            mounted: true,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("dir").path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if self.mounted {
            if let Some(d) = &self.dir {
                let _ = Command::new("umount").arg("-l").arg(d.path()).status();
            }
        }
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

/// The file system type (statfs f_type) at `p`.
pub fn statfs_type(p: &Path) -> Option<i64> {
    let c = cpath(p);
    // SAFETY: `c` is a valid C string; `s` is written by statfs.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        (libc::statfs(c.as_ptr(), &mut s) == 0).then_some(s.f_type)
    }
}

/// statvfs of `p`.
pub fn statvfs(p: &Path) -> std::io::Result<libc::statvfs> {
    let c = cpath(p);
    // SAFETY: `c` is a valid C string; `s` is written by statvfs.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut s) == 0 {
            Ok(s)
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// Drop the clean cached pages of the file at `p` (POSIX_FADV_DONTNEED), so the next read
/// reaches the file system. Dirty pages stay: fsync first.
pub fn drop_cache(p: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(p)?;
    drop_cache_fd(&f)
}

pub fn drop_cache_fd(f: &std::fs::File) -> std::io::Result<()> {
    // SAFETY: the descriptor is open for the duration of the call.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(r))
    }
}

/// Drop the cached pages of every regular file under `root`.
pub fn drop_cache_tree(root: &Path) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    for e in rd.flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            drop_cache_tree(&e.path());
        } else if t.is_file() {
            let _ = drop_cache(&e.path());
        }
    }
}

/// `len` bytes from a seeded generator (the same seed gives the same bytes).
pub fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Where two byte strings first differ, as a message (None when equal).
pub fn first_difference(got: &[u8], want: &[u8]) -> Option<String> {
    if got == want {
        return None;
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Some(format!(
        "{} bytes, expected {}; first difference at byte {at} (got {:?}, expected {:?})",
        got.len(),
        want.len(),
        got.get(at..(at + 8).min(got.len())),
        want.get(at..(at + 8).min(want.len())),
    ))
}

/// `granule fs status DIR --json`.
pub fn fs_status_json(dir: &Path) -> serde_json::Value {
    let out = run_bounded(
        Command::new(GRANULE)
            .args(["fs", "status"])
            .arg(dir)
            .arg("--json"),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "granule fs status --json failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "granule fs status --json printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
