//! Whether the mount a record names is alive, decided by something a dead process cannot
//! hold: an exclusive `flock` on a lock file beside the record, taken by the mount when it
//! starts and held for its whole life.
//!
//! A pid is not such a thing. A process killed with SIGKILL stays a zombie until its
//! parent reaps it, and a pid is reused by unrelated processes, so `kill(pid, 0)` says
//! "alive" for mounts that are long dead — and the next mount then started empty and
//! overwrote the dead one's record, losing track of the data it left on the nodes. The
//! kernel drops a process's `flock`s when its last descriptor of the file closes, which
//! happens as it dies, before it is a zombie; no other process holds the lock by having
//! the same pid. The descriptor is opened close-on-exec, so the node processes a mount
//! starts do not inherit it (and keep the lock after the mount died).

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::path::{Path, PathBuf};

/// The lock file of the record at `record`.
pub fn lock_path(record: &Path) -> PathBuf {
    record.with_extension("lock")
}

/// The lock a live mount holds; dropping it releases the lock.
#[derive(Debug)]
pub struct MountLock {
    _held: Flock<File>,
}

impl MountLock {
    /// Take the lock of the record at `record` (its directory must exist). `Ok(None)`:
    /// another live process holds it.
    pub fn try_take(record: &Path) -> std::io::Result<Option<MountLock>> {
        // std opens with O_CLOEXEC: children the mount spawns never hold the lock.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(lock_path(record))?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(held) => Ok(Some(MountLock { _held: held })),
            Err((_, Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(std::io::Error::from(e)),
        }
    }
}

/// Whether a live process holds the lock of the record at `record`. No lock file: no
/// live mount (a mount takes the lock before it writes its record). A lock file that
/// cannot be opened counts as held: never judge a mount dead on a guess.
pub fn held(record: &Path) -> bool {
    let path = lock_path(record);
    let file = match std::fs::OpenOptions::new().write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
        Err(_) => return true,
    };
    // Got it: nobody holds it (released at once: the drop unlocks).
    Flock::lock(file, FlockArg::LockExclusiveNonblock).is_err()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    fn record_in(dir: &Path) -> PathBuf {
        dir.join("mount-0000000000000001.json")
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "waited 10 s for {what}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_held_lock_is_alive_and_a_released_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let rec = record_in(dir.path());
        assert!(!held(&rec), "no lock file: no live mount");
        let lock = MountLock::try_take(&rec).unwrap().expect("free lock");
        assert!(held(&rec));
        assert!(
            MountLock::try_take(&rec).unwrap().is_none(),
            "a second mount must not get the lock"
        );
        drop(lock);
        assert!(!held(&rec));
        assert!(MountLock::try_take(&rec).unwrap().is_some());
    }

    /// A process that holds the lock and is killed with SIGKILL, but not reaped (a
    /// zombie, whose pid `kill(pid, 0)` still finds), holds it no more.
    #[test]
    fn a_killed_holder_not_yet_reaped_is_dead() {
        let dir = tempfile::tempdir().unwrap();
        let rec = record_in(dir.path());
        std::fs::write(lock_path(&rec), b"").unwrap();
        // -o: the lock's descriptor is closed before `sleep` runs, so only `flock`
        // itself (this test's child) holds it.
        let mut child = Command::new("flock")
            .args(["-o", "--exclusive"])
            .arg(lock_path(&rec))
            .args(["sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .expect("flock(1) from util-linux");
        wait_for("the child to take the lock", || held(&rec));
        let sleeper = Command::new("pgrep")
            .args(["-P", &child.id().to_string()])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
        wait_for("the lock to be released", || !held(&rec));
        // Not reaped yet: the pid still answers kill(pid, 0), the old test of liveness.
        assert!(
            nix::sys::signal::kill(pid, None).is_ok(),
            "the zombie is still there"
        );
        let _ = child.wait();
        if !sleeper.is_empty() {
            let _ = Command::new("kill").args(["-9", &sleeper]).status();
        }
    }

    /// A pid reused by an unrelated live process says nothing: without the lock, the
    /// mount is dead.
    #[test]
    fn a_live_process_with_the_recorded_pid_but_no_lock_is_dead() {
        let dir = tempfile::tempdir().unwrap();
        let rec = record_in(dir.path());
        std::fs::write(lock_path(&rec), b"").unwrap();
        let mut unrelated = Command::new("sleep").arg("600").spawn().unwrap();
        assert!(
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(unrelated.id() as i32), None).is_ok()
        );
        assert!(!held(&rec));
        let _ = unrelated.kill();
        let _ = unrelated.wait();
    }
}
